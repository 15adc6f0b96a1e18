# The reference sample moved to the registry app (registry.0004): forget it here, keep its table.

from django.db import migrations

from platform_site.moves import CONTENTTYPES, move_content_types


class Migration(migrations.Migration):

    dependencies = [
        CONTENTTYPES,
        ('registry', '0004_referencesample_moved'),
        ('rollouts', '0008_auditevent_moved'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(
                    name='ReferenceSample',
                ),
            ],
        ),
        move_content_types("rollouts", "registry", ["referencesample"]),
    ]
