from django.apps import AppConfig


class MonitoringConfig(AppConfig):
    name = "monitoring"
    verbose_name = "Monitoring: traffic, predictions, quality, drift, SLOs and alerts"
