# The audit log moves here from the rollouts app: only the model's owner changes (state), the
# table rollouts_auditevent and its rows stay as they are.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('rollouts', '0007_observability'),
        ('tenants', '0004_observability'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='AuditEvent',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('actor_label', models.CharField(max_length=150)),
                        ('action', models.CharField(max_length=50)),
                        ('target', models.CharField(max_length=200)),
                        ('before', models.JSONField(blank=True, default=dict)),
                        ('after', models.JSONField(blank=True, default=dict)),
                        ('reason', models.TextField(blank=True)),
                        ('created_at', models.DateTimeField(auto_now_add=True, db_index=True)),
                        ('actor', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, to=settings.AUTH_USER_MODEL)),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='audit', to='tenants.tenant')),
                    ],
                    options={
                        'db_table': 'rollouts_auditevent',
                        'ordering': ['-created_at', '-pk'],
                    },
                ),
            ],
        ),
    ]
