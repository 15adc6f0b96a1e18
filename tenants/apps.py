from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants"

    def ready(self) -> None:
        from axes.signals import user_locked_out
        from django.db.models.signals import pre_delete

        from .audit import audit_tenant_deletion
        from .logins import on_user_locked_out
        from .models import Tenant

        user_locked_out.connect(on_user_locked_out, dispatch_uid="tenants.audit_lockout")
        pre_delete.connect(audit_tenant_deletion, Tenant, dispatch_uid="tenants.audit_deletion")
