"""One error shape for the whole API: ``{"error": "<field>: <problem>", "fields": {...}}``."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler

from registry.signature import SignatureError


class Conflict(Exception):
    """A change that lost a race or no longer fits the current state: the API answers 409."""


class Forbidden(Exception):
    """The caller's role or identity does not allow this change: the API answers 403."""


class _ConflictError(exceptions.APIException):
    status_code = 409
    default_code = "conflict"


def _flatten(detail, prefix: str = "") -> list[str]:
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            name = key if key != "non_field_errors" else ""
            out += _flatten(value, f"{prefix}.{name}" if prefix and name else prefix or name)
        return out
    if isinstance(detail, list):
        return [m for item in detail for m in _flatten(item, prefix)]
    return [f"{prefix}: {detail}" if prefix else str(detail)]


def api_exception_handler(exc, context):
    if isinstance(exc, SignatureError):
        exc = exceptions.ValidationError({exc.field: [str(exc)]})
    elif isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(
            exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        )
    elif isinstance(exc, Conflict):
        exc = _ConflictError(str(exc))
    elif isinstance(exc, Forbidden):
        exc = exceptions.PermissionDenied(str(exc))
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or "not found")
    response = exception_handler(exc, context)
    if response is None:
        return None
    detail = response.data
    body = {"error": "; ".join(_flatten(detail)) or "error"}
    if isinstance(detail, dict) and set(detail) - {"detail"}:
        body["fields"] = detail
    return Response(body, status=response.status_code, headers=_keep_headers(response))


def _keep_headers(response) -> dict:
    return {k: v for k, v in response.items() if k in ("WWW-Authenticate", "Retry-After", "Allow")}
