from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "gateway"
    verbose_name = "Gateway and fleet"

    def ready(self) -> None:
        from .changes import watch_changes

        watch_changes()
