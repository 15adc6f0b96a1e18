"""What every app's DRF layer shares beyond the error handler (``platform_site.errors``)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers


def validated(serializer_class: type[serializers.Serializer], data: Any) -> dict[str, Any]:
    """The body or query parameters checked by ``serializer_class``; a 400 naming each bad
    field otherwise."""
    checked = serializer_class(data=data)
    checked.is_valid(raise_exception=True)
    return dict(checked.validated_data)
