"""The web UI's start page: models, aliases and the fleet at a glance."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from registry.models import Alias

from .models import AgentSession


@login_required(login_url="/admin/login/")
def home(request):
    tenant_ids = request.user.memberships.values_list("tenant_id", flat=True)
    aliases = Alias.objects.select_related("model__tenant", "version").order_by("model__name")
    if not request.user.is_superuser:
        aliases = aliases.filter(model__tenant_id__in=tenant_ids)
    sessions = AgentSession.objects.select_related("node").filter(disconnected_at__isnull=True)
    return render(request, "home.html", {"aliases": aliases, "sessions": sessions})
