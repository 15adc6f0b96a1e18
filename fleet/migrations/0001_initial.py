# The fleet's models were made by the gateway and rollouts apps: this takes them over as they
# are (state only), keeping their tables and rows; gateway.0006 and rollouts.0011 let go of them.

import django.core.validators
import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('rollouts', '0010_moved_to_monitoring'),
        ('gateway', '0005_moved_to_monitoring'),
        ('registry', '0004_referencesample_moved'),
        ('tenants', '0005_auditevent_moved'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='ConfigGeneration',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('value', models.BigIntegerField(default=0)),
                    ],
                    options={
                        'db_table': 'gateway_configgeneration',
                    },
                ),
                migrations.CreateModel(
                    name='Pool',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.SlugField(max_length=63, unique=True)),
                        ('backend', models.CharField(choices=[('local', 'Local agent processes'), ('kubernetes', 'Kubernetes')], max_length=12)),
                        ('namespace', models.CharField(default='switchyard', max_length=63)),
                        ('image', models.CharField(blank=True, max_length=200)),
                        ('node_selector', models.JSONField(blank=True, default=dict)),
                        ('tolerations', models.JSONField(blank=True, default=list)),
                        ('description', models.CharField(blank=True, max_length=200)),
                    ],
                    options={
                        'db_table': 'rollouts_pool',
                    },
                ),
                migrations.CreateModel(
                    name='Deployment',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('min_replicas', models.PositiveIntegerField(default=0)),
                        ('max_replicas', models.PositiveIntegerField(default=4, validators=[django.core.validators.MinValueValidator(1)])),
                        ('target_load_per_replica', models.FloatField(default=8.0, validators=[django.core.validators.MinValueValidator(0.01)])),
                        ('slo_p99_ms', models.FloatField(blank=True, null=True, validators=[django.core.validators.MinValueValidator(1)])),
                        ('scale_down_window_s', models.PositiveIntegerField(default=120)),
                        ('idle_to_zero_s', models.PositiveIntegerField(default=300)),
                        ('cpu', models.CharField(default='1', max_length=20)),
                        ('memory', models.CharField(default='2Gi', max_length=20)),
                        ('gpus', models.PositiveIntegerField(default=0)),
                        ('mig_profile', models.CharField(blank=True, max_length=20)),
                        ('isolation', models.CharField(choices=[('shared', "Shared pool, within the tenant's quota"), ('dedicated', 'Dedicated nodes')], default='shared', max_length=10)),
                        ('desired_replicas', models.PositiveIntegerField(default=0)),
                        ('woken_at', models.DateTimeField(blank=True, null=True)),
                        ('last_active_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('applied_template', models.CharField(blank=True, max_length=64)),
                        ('updated_at', models.DateTimeField(auto_now=True)),
                        ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tenants.tenant')),
                        ('version', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='deployments', to='registry.modelversion')),
                        ('pool', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='deployments', to='fleet.pool')),
                    ],
                    options={
                        'db_table': 'rollouts_deployment',
                    },
                ),
                migrations.CreateModel(
                    name='Node',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(max_length=100, unique=True)),
                        ('token_prefix', models.CharField(editable=False, max_length=16, unique=True)),
                        ('token_hash', models.CharField(editable=False, max_length=64)),
                        ('enabled', models.BooleanField(default=True)),
                        ('facts', models.JSONField(blank=True, default=dict, editable=False)),
                        ('last_seen_at', models.DateTimeField(blank=True, editable=False, null=True)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('tenant', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='nodes', to='tenants.tenant')),
                    ],
                    options={
                        'db_table': 'gateway_node',
                        'ordering': ['name'],
                    },
                ),
                migrations.CreateModel(
                    name='AgentSession',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('channel_name', models.CharField(max_length=200, unique=True)),
                        ('ready_versions', models.JSONField(blank=True, default=list)),
                        ('version_states', models.JSONField(blank=True, default=dict)),
                        ('stats', models.JSONField(blank=True, default=dict)),
                        ('deployment_name', models.CharField(blank=True, max_length=63)),
                        ('memory_budget_bytes', models.BigIntegerField(default=0)),
                        ('connected_at', models.DateTimeField(auto_now_add=True)),
                        ('last_heartbeat_at', models.DateTimeField(auto_now_add=True)),
                        ('disconnected_at', models.DateTimeField(blank=True, null=True)),
                        ('deployment', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='sessions', to='fleet.deployment')),
                        ('node', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='sessions', to='fleet.node')),
                    ],
                    options={
                        'db_table': 'gateway_agentsession',
                        'ordering': ['-connected_at'],
                    },
                ),
                migrations.CreateModel(
                    name='ScalingDecision',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('created_at', models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                        ('current', models.PositiveIntegerField()),
                        ('desired', models.PositiveIntegerField()),
                        ('accepted', models.PositiveIntegerField(blank=True, null=True)),
                        ('dry_run', models.BooleanField(default=False)),
                        ('reason', models.CharField(max_length=300)),
                        ('inputs', models.JSONField(default=dict)),
                        ('error', models.CharField(blank=True, max_length=300)),
                        ('deployment', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='decisions', to='fleet.deployment')),
                    ],
                    options={
                        'db_table': 'rollouts_scalingdecision',
                        'ordering': ['-created_at', '-pk'],
                    },
                ),
                migrations.AddConstraint(
                    model_name='deployment',
                    constraint=models.UniqueConstraint(fields=('version', 'pool'), name='one_deployment_per_version_and_pool', violation_error_message='This version already has a deployment on this pool.'),
                ),
            ],
        ),
    ]
