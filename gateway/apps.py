from django.apps import AppConfig


class GatewayConfig(AppConfig):
    """The data path. It owns no models; its migrations keep the history of the tables it made,
    which now belong to the monitoring and fleet apps."""

    name = "gateway"
    verbose_name = "Gateway"
