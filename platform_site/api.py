"""What every app's DRF layer shares beyond the error handler (``platform_site.errors``): body
validation, the API's error shape in the schema, and the schema class that documents every
error status an operation can answer."""

from __future__ import annotations

from typing import Any

import orjson
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse, inline_serializer
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request

# The largest whole number a client may send in a body or a query string (PostgreSQL's
# `integer`): a larger one reached the database and came back a 500 (an offset of 2**63 on the
# prediction list). tests/test_api_bounds.py holds every integer the schema documents to a
# maximum.
MAX_INT = 2**31 - 1


def validated(serializer_class: type[serializers.Serializer[Any]], data: Any) -> dict[str, Any]:
    """The body or query parameters checked by ``serializer_class``; a 400 naming each bad
    field otherwise."""
    checked = serializer_class(data=data)
    checked.is_valid(raise_exception=True)
    return dict(checked.validated_data)


class JSONTextField(serializers.JSONField):
    """A JSON value sent as text (a field of a multipart form), read with orjson: it refuses
    nesting past its depth limit, where the stdlib's parser (DRF's ``binary=True``) recursed
    until RecursionError, a 500; and lone surrogates, which nothing could write back."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(binary=True, **kwargs)

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, str | bytes):
            try:
                # str(): a form's value arrives as DRF's JSONString, a str subclass orjson refuses
                return orjson.loads(data if isinstance(data, bytes) else str(data))
            except orjson.JSONDecodeError:
                self.fail("invalid")
        return super().to_internal_value(data)


# The shape of every error the API answers (``platform_site.errors.api_exception_handler``).
# Built from a dict: a serializer cannot declare a field named ``fields`` (its own attribute).
ErrorResponse = inline_serializer(
    "ErrorResponse",
    fields={
        "error": serializers.CharField(help_text="What is wrong, naming the field when one is."),
        "fields": serializers.DictField(
            required=False, help_text="Per-field problems, when the body failed validation."
        ),
    },
)

# Why each error status can answer an operation; which ones apply is read from the operation
# (see ``ApiSchema.error_statuses``).
ERRORS = {
    400: "The body, a query parameter or a path parameter is not valid: `error` names it.",
    401: "No API key or session, or an invalid or revoked key.",
    403: "The caller's role in the tenant does not allow this (or the CSRF check failed).",
    404: "No such object in the caller's tenant.",
    409: "The change no longer fits the object's current state (or lost a race).",
    413: "The body is larger than the server accepts.",
    415: "The body is not in a media type the operation reads.",
    503: "The platform's database cannot be reached: retry after `Retry-After` seconds.",
}


class ApiSchema(AutoSchema):
    """drf-spectacular's schema, with each operation's error answers documented in the API's
    error shape, so the schema describes every status the API returns (schemathesis checks it
    in tests/fuzz/test_api_schema.py). An operation's own ``extend_schema`` entry for a status
    wins over the generic one."""

    def get_operation(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
        operation: dict[str, Any] | None = super().get_operation(*args, **kwargs)
        if operation is None:
            return None
        responses = operation.setdefault("responses", {})
        for status in self.error_statuses(operation):
            if str(status) not in responses:
                response = OpenApiResponse(ErrorResponse, description=ERRORS[status])
                responses[str(status)] = self._get_response_for_code(response, str(status))
        return operation

    def error_statuses(self, operation: dict[str, Any]) -> list[int]:
        has_body = "requestBody" in operation
        statuses = []
        if has_body or operation.get("parameters"):
            statuses.append(400)
        if not any(isinstance(p, AllowAny) for p in self.view.get_permissions()):
            statuses += [401, 403]
        if "{" in self.path:
            statuses.append(404)
        if self.method in ("POST", "PUT", "PATCH", "DELETE"):
            statuses.append(409)
        if has_body:
            statuses += [413, 415]
        statuses.append(503)  # every operation needs the database (platform_site.postgres)
        return statuses


class ExportFormatParam:
    """For an export view whose ``?format=`` names the file's format (csv, parquet): not one of
    DRF's renderers, which would answer 404 to ``csv``. Errors are answered as JSON."""

    def perform_content_negotiation(
        self, request: Request, force: bool = False
    ) -> tuple[BaseRenderer, str]:
        return JSONRenderer(), "application/json"
