from django.apps import AppConfig


class BatchConfig(AppConfig):
    name = "batch"
    verbose_name = "Batch jobs"
