"""The errors domain code raises, and the API's one error shape for them:
``{"error": "<field>: <problem>", "fields": {...}}``.

Domain functions raise these (or Django's ``ValidationError``), never DRF's exceptions: the
API's exception handler below, the web pages and the data path each answer them in their own
protocol.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler

from platform_site.postgres import DatabaseUnavailable


class Conflict(Exception):
    """A change that lost a race or no longer fits the current state: the API answers 409."""


class Forbidden(Exception):
    """The caller's role or identity does not allow this change: the API answers 403."""


class Unprocessable(Exception):
    """A request well formed but at odds with what was sent before (an ``Idempotency-Key``
    reused for another request): the API answers 422."""


class Unavailable(Exception):
    """A service the change needs (the artifact store, say) cannot be reached or refused to
    work: nothing is wrong with the request, so the API answers 503 with ``Retry-After``.
    The database unreachable is ``platform_site.postgres.DatabaseUnavailable``, answered alike."""

    retry_after_s = 5


class OverBudget(Exception):
    """The tenant's monthly budget is spent and its hard stop refuses new work: the API
    answers 429 naming the budget, with ``Retry-After`` (until an approver's override)."""

    retry_after_s = 3600


class NotFound(Http404):
    """A lookup through the caller's tenant found nothing: 404 in the API and the pages.

    It is Django's ``Http404``, so a page view needs no handler of its own for it."""


class Invalid(ValueError):
    """A value the caller sent is not acceptable: the API answers 400 naming ``field``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class TooLarge(Invalid):
    """An upload larger than the platform accepts: the API answers 413 naming ``field``."""


class _TooLargeError(exceptions.ValidationError):
    status_code = 413
    default_code = "too_large"


class _ConflictError(exceptions.APIException):
    status_code = 409
    default_code = "conflict"


class _UnprocessableError(exceptions.APIException):
    status_code = 422
    default_code = "unprocessable"


class _OverBudgetError(exceptions.APIException):
    status_code = 429
    default_code = "over_budget"


class _UnavailableError(exceptions.APIException):
    status_code = 503
    default_code = "unavailable"


def _flatten(detail: Any, prefix: str = "") -> list[str]:
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            name = key if key != "non_field_errors" else ""
            out += _flatten(value, f"{prefix}.{name}" if prefix and name else prefix or name)
        return out
    if isinstance(detail, list):
        return [m for item in detail for m in _flatten(item, prefix)]
    return [f"{prefix}: {detail}" if prefix else str(detail)]


def _as_drf(exc: Exception) -> Exception:
    """The DRF exception that answers a domain error (others pass through unchanged)."""
    if isinstance(exc, TooLarge):
        return _TooLargeError({exc.field: [str(exc)]})
    if isinstance(exc, Invalid):
        return exceptions.ValidationError({exc.field: [str(exc)]})
    if isinstance(exc, DjangoValidationError):
        return exceptions.ValidationError(
            exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        )
    if isinstance(exc, Conflict):
        return _ConflictError(str(exc))
    if isinstance(exc, Unprocessable):
        return _UnprocessableError(str(exc))
    if isinstance(exc, Unavailable | DatabaseUnavailable):
        return _UnavailableError(str(exc))
    if isinstance(exc, OverBudget):
        return _OverBudgetError(str(exc))
    if isinstance(exc, Forbidden):
        return exceptions.PermissionDenied(str(exc))
    if isinstance(exc, Http404):
        return exceptions.NotFound(str(exc) or "not found")
    return exc


def api_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    response = exception_handler(_as_drf(exc), context)
    if response is None:
        return None
    detail = response.data
    body: dict[str, Any] = {"error": "; ".join(_flatten(detail)) or "error"}
    if isinstance(detail, dict) and set(detail) - {"detail"}:
        body["fields"] = detail
    headers = _keep_headers(response)
    if isinstance(exc, Unavailable | OverBudget | DatabaseUnavailable):
        headers["Retry-After"] = str(exc.retry_after_s)
    return Response(body, status=response.status_code, headers=headers)


def _keep_headers(response: Response) -> dict[str, str]:
    return {k: v for k, v in response.items() if k in ("WWW-Authenticate", "Retry-After", "Allow")}
