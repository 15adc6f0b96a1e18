# The drift reference sample moves here from the rollouts app (it is uploaded with the version):
# only the model's owner changes; the table rollouts_referencesample and its rows stay.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('rollouts', '0008_auditevent_moved'),
        ('registry', '0003_observability'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='ReferenceSample',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('source', models.CharField(choices=[('upload', 'Upload'), ('window', 'Window')], max_length=10)),
                        ('columns', models.JSONField()),
                        ('scores', models.JSONField(blank=True, default=list)),
                        ('rows', models.PositiveIntegerField()),
                        ('window_start', models.DateTimeField(blank=True, null=True)),
                        ('window_end', models.DateTimeField(blank=True, null=True)),
                        ('created_at', models.DateTimeField(auto_now=True)),
                        ('uploaded_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, to=settings.AUTH_USER_MODEL)),
                        ('version', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='reference', to='registry.modelversion')),
                    ],
                    options={
                        'db_table': 'rollouts_referencesample',
                    },
                ),
            ],
        ),
    ]
