from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants"

    def ready(self) -> None:
        from axes.signals import user_locked_out

        from . import schema  # noqa: F401  (registers the OpenAPI auth extension)
        from .logins import on_user_locked_out

        user_locked_out.connect(on_user_locked_out, dispatch_uid="tenants.audit_lockout")
