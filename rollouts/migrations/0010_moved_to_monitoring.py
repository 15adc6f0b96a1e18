# Drift reports and alerts moved to the monitoring app (monitoring.0001): forget them here, keep
# their tables.

from django.db import migrations

from platform_site.moves import CONTENTTYPES, move_content_types


class Migration(migrations.Migration):

    dependencies = [
        CONTENTTYPES,
        ('monitoring', '0001_initial'),
        ('rollouts', '0009_referencesample_moved'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveField(
                    model_name='driftreport',
                    name='model',
                ),
                migrations.RemoveField(
                    model_name='driftreport',
                    name='tenant',
                ),
                migrations.RemoveField(
                    model_name='driftreport',
                    name='version',
                ),
                migrations.DeleteModel(
                    name='Alert',
                ),
                migrations.DeleteModel(
                    name='DriftReport',
                ),
            ],
        ),
        move_content_types("rollouts", "monitoring", ["driftreport", "alert"]),
    ]
