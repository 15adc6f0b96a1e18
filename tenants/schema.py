"""OpenAPI description of the API-key authentication, so `/api/docs/` offers a Bearer field."""

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "tenants.authentication.ApiKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema: AutoSchema) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A tenant API key: `Authorization: Bearer sy_<prefix>_<secret>`.",
        }


# The statuses the Idempotency-Key adds to a state-changing call (tenants.middleware).
IDEMPOTENCY_STATUSES = {
    "400": "A malformed Idempotency-Key (or another problem with the request).",
    "409": "A call with this Idempotency-Key is still being processed (Retry-After: 1).",
    "422": "This Idempotency-Key was used for a different request (method, path or body).",
}
CHANGES = ("post", "put", "patch", "delete")


def document_idempotency_key(
    result: dict[str, Any], generator: object, request: object, public: bool
) -> dict[str, Any]:
    """drf-spectacular post-processing hook: every state-changing ``/api/v1/`` operation takes an
    optional ``Idempotency-Key`` header and may answer its 400, 409 and 422, so the schema
    describes what the middleware does in front of every view."""
    error = {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"error": {"type": "string"}},
                "required": ["error"],
            }
        }
    }
    header = {
        "in": "header",
        "name": "Idempotency-Key",
        "required": False,
        "description": "Send the same key to retry safely: within the retention window a "
        "retry by the same caller gets the first 2xx answer (`Idempotent-Replayed: true`) "
        "instead of acting twice. An answer over the kept size is kept without its body: "
        "both answers say `Idempotency-Stored: false`, and the retry still does not act.",
        "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"},
    }
    for path, operations in result.get("paths", {}).items():
        if not path.startswith("/api/v1/"):
            continue
        for method in CHANGES:
            operation = operations.get(method)
            if operation is None:
                continue
            parameters = operation.setdefault("parameters", [])
            if not any(p.get("name") == "Idempotency-Key" for p in parameters):
                parameters.append(header)
            responses = operation.setdefault("responses", {})
            for status, description in IDEMPOTENCY_STATUSES.items():
                responses.setdefault(status, {"description": description, "content": error})
    return result
