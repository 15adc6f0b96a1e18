"""The live gateway processes and their link addresses: each registers when it starts, is
marked seen by its refresh loop, and removes itself when it stops. One that died without
removing itself stops counting as live after ``LIVE_S``."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from .models import GatewayProcess

# A process marks itself seen every SEEN_EVERY_S; one unseen for LIVE_S is taken for dead.
SEEN_EVERY_S = 5.0
LIVE_S = 20.0
# Rows of processes dead this long are deleted when another process registers.
FORGET_S = 3600.0


def register_gateway(key: str, link_url: str, host: str) -> None:
    horizon = timezone.now() - timedelta(seconds=FORGET_S)
    GatewayProcess.objects.filter(seen_at__lt=horizon).delete()
    GatewayProcess.objects.update_or_create(
        key=key, defaults={"link_url": link_url, "host": host, "seen_at": timezone.now()}
    )


def mark_gateway_seen(key: str) -> None:
    GatewayProcess.objects.filter(key=key).update(seen_at=timezone.now())


def deregister_gateway(key: str) -> None:
    GatewayProcess.objects.filter(key=key).delete()


def live_gateways() -> dict[str, str]:
    """{process key: link URL} of the gateway processes seen within ``LIVE_S``."""
    horizon = timezone.now() - timedelta(seconds=LIVE_S)
    rows = GatewayProcess.objects.filter(seen_at__gte=horizon).values_list("key", "link_url")
    return dict(rows)
