# Traffic samples, the prediction log and feedback moved to the monitoring app (monitoring.0001):
# forget them here, keep their tables.

from django.db import migrations

from platform_site.moves import CONTENTTYPES, move_content_types


class Migration(migrations.Migration):

    dependencies = [
        CONTENTTYPES,
        ('monitoring', '0001_initial'),
        ('gateway', '0004_observability'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveField(
                    model_name='predictionlog',
                    name='model',
                ),
                migrations.RemoveField(
                    model_name='predictionlog',
                    name='tenant',
                ),
                migrations.RemoveField(
                    model_name='predictionlog',
                    name='version',
                ),
                migrations.RemoveField(
                    model_name='trafficsample',
                    name='version',
                ),
                migrations.DeleteModel(
                    name='Feedback',
                ),
                migrations.DeleteModel(
                    name='PredictionLog',
                ),
                migrations.DeleteModel(
                    name='TrafficSample',
                ),
            ],
        ),
        move_content_types("gateway", "monitoring", ["trafficsample", "predictionlog", "feedback"]),
    ]
