# Monitoring's models were made by the gateway and rollouts apps: this takes them over as they
# are (state only), keeping their tables and rows; gateway.0005 and rollouts.0010 let go of them.

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('rollouts', '0009_referencesample_moved'),
        ('gateway', '0004_observability'),
        ('registry', '0004_referencesample_moved'),
        ('tenants', '0005_auditevent_moved'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='TrafficSample',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('window_end', models.DateTimeField(db_index=True)),
                        ('requests', models.PositiveIntegerField()),
                        ('errors', models.PositiveIntegerField()),
                        ('latency_buckets', models.JSONField()),
                        ('version', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='traffic', to='registry.modelversion')),
                    ],
                    options={
                        'db_table': 'gateway_trafficsample',
                        'ordering': ['-window_end'],
                    },
                ),
                migrations.CreateModel(
                    name='Alert',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('kind', models.CharField(choices=[('drift', 'Drift'), ('slo_burn', 'SLO burn'), ('rollback', 'Rollback')], max_length=10)),
                        ('severity', models.CharField(choices=[('warning', 'Warning'), ('critical', 'Critical')], max_length=10)),
                        ('key', models.CharField(max_length=200)),
                        ('title', models.CharField(max_length=200)),
                        ('message', models.TextField()),
                        ('details', models.JSONField(blank=True, default=dict)),
                        ('created_at', models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                        ('last_seen_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('resolved_at', models.DateTimeField(blank=True, null=True)),
                        ('webhook_state', models.CharField(choices=[('none', 'No webhook'), ('pending', 'Pending'), ('sent', 'Sent'), ('failed', 'Failed')], default='none', max_length=10)),
                        ('webhook_attempts', models.PositiveSmallIntegerField(default=0)),
                        ('webhook_error', models.CharField(blank=True, max_length=300)),
                        ('model', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='registry.model')),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='alerts', to='tenants.tenant')),
                    ],
                    options={
                        'db_table': 'rollouts_alert',
                        'ordering': ['-created_at'],
                        'constraints': [models.UniqueConstraint(condition=models.Q(('resolved_at__isnull', True)), fields=('tenant', 'key'), name='one_open_alert_per_key')],
                    },
                ),
                migrations.CreateModel(
                    name='DriftReport',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('window_start', models.DateTimeField()),
                        ('window_end', models.DateTimeField()),
                        ('reference_source', models.CharField(max_length=10)),
                        ('rows_current', models.PositiveIntegerField()),
                        ('rows_reference', models.PositiveIntegerField()),
                        ('threshold', models.FloatField()),
                        ('features', models.JSONField(default=dict)),
                        ('score', models.JSONField(blank=True, null=True)),
                        ('quality', models.JSONField(default=dict)),
                        ('flagged', models.JSONField(default=list)),
                        ('max_psi', models.FloatField(default=0.0)),
                        ('created_at', models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                        ('model', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='drift_reports', to='registry.model')),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tenants.tenant')),
                        ('version', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='drift_reports', to='registry.modelversion')),
                    ],
                    options={
                        'db_table': 'rollouts_driftreport',
                        'ordering': ['-created_at'],
                        'indexes': [models.Index(fields=['version', 'created_at'], name='drift_version_time')],
                    },
                ),
                migrations.CreateModel(
                    name='Feedback',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('request_id', models.CharField(max_length=128)),
                        ('label', models.JSONField()),
                        ('received_at', models.DateTimeField(db_index=True)),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tenants.tenant')),
                    ],
                    options={
                        'db_table': 'gateway_feedback',
                        'ordering': ['-received_at'],
                        'constraints': [models.UniqueConstraint(fields=('tenant', 'request_id'), name='feedback_unique_per_request')],
                    },
                ),
                migrations.CreateModel(
                    name='PredictionLog',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('arm', models.CharField(blank=True, max_length=50)),
                        ('request_id', models.CharField(max_length=128)),
                        ('trace_id', models.CharField(blank=True, max_length=32)),
                        ('inputs', models.JSONField(default=dict)),
                        ('outputs', models.JSONField(default=dict)),
                        ('scores', models.JSONField(default=list)),
                        ('latency_ms', models.FloatField()),
                        ('status', models.PositiveSmallIntegerField()),
                        ('created_at', models.DateTimeField(db_index=True)),
                        ('model', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='registry.model')),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tenants.tenant')),
                        ('version', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='prediction_logs', to='registry.modelversion')),
                    ],
                    options={
                        'db_table': 'gateway_predictionlog',
                        'ordering': ['-created_at'],
                        'indexes': [models.Index(fields=['version', 'created_at'], name='predlog_version_time'), models.Index(fields=['tenant', 'request_id'], name='predlog_tenant_request'), models.Index(fields=['model', 'created_at'], name='predlog_model_time')],
                    },
                ),
            ],
        ),
    ]
