# Nodes, agent sessions and the config generation moved to the fleet app (fleet.0001): forget
# them here, keep their tables. The gateway owns no models any more.

from django.db import migrations

from platform_site.moves import CONTENTTYPES, move_content_types


class Migration(migrations.Migration):

    dependencies = [
        CONTENTTYPES,
        ('fleet', '0001_initial'),
        ('gateway', '0005_moved_to_monitoring'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveField(
                    model_name='agentsession',
                    name='deployment',
                ),
                migrations.RemoveField(
                    model_name='agentsession',
                    name='node',
                ),
                migrations.DeleteModel(
                    name='ConfigGeneration',
                ),
                migrations.RemoveField(
                    model_name='node',
                    name='tenant',
                ),
                migrations.DeleteModel(
                    name='AgentSession',
                ),
                migrations.DeleteModel(
                    name='Node',
                ),
            ],
        ),
        move_content_types("gateway", "fleet", ["node", "agentsession", "configgeneration"]),
    ]
