# Pools, deployments and scaling decisions moved to the fleet app (fleet.0001): forget them
# here, keep their tables.

from django.db import migrations

from platform_site.moves import CONTENTTYPES, move_content_types


class Migration(migrations.Migration):

    dependencies = [
        CONTENTTYPES,
        ('fleet', '0001_initial'),
        ('gateway', '0006_moved_to_fleet'),
        ('rollouts', '0010_moved_to_monitoring'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveField(
                    model_name='deployment',
                    name='pool',
                ),
                migrations.RemoveField(
                    model_name='deployment',
                    name='tenant',
                ),
                migrations.RemoveField(
                    model_name='deployment',
                    name='version',
                ),
                migrations.RemoveField(
                    model_name='scalingdecision',
                    name='deployment',
                ),
                migrations.DeleteModel(
                    name='Pool',
                ),
                migrations.DeleteModel(
                    name='Deployment',
                ),
                migrations.DeleteModel(
                    name='ScalingDecision',
                ),
            ],
        ),
        move_content_types("rollouts", "fleet", ["pool", "deployment", "scalingdecision"]),
    ]
