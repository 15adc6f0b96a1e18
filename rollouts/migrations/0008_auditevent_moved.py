# The audit log moved to the tenants app (tenants.0005): forget it here, keep its table.

from django.db import migrations

from platform_site.moves import CONTENTTYPES, move_content_types


class Migration(migrations.Migration):

    dependencies = [
        CONTENTTYPES,
        ('tenants', '0005_auditevent_moved'),
        ('rollouts', '0007_observability'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(
                    name='AuditEvent',
                ),
            ],
        ),
        move_content_types("rollouts", "tenants", ["auditevent"]),
    ]
