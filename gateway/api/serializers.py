"""The prediction API's request and response bodies, for validation and the OpenAPI schema.

One definition for both: ``gateway.api.predict_app`` validates each request with
``PredictRequest`` and the schema (``/api/schema/``) documents the same classes from
``PredictView``.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from platform_site import api as platform_api
from serving_agent.protocol import PRIORITY_CLASSES


class _AsSent(serializers.Field[Any, Any, Any, Any]):
    """A value kept as the caller sent it: ``pipeline.schedule`` reads it, as it reads OIP's
    parameters, so both front doors accept and refuse the same values with the same words (a
    DRF ``FloatField`` would take ``"100"``, which OIP refuses). ``null`` is absent, as on
    OIP."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(required=False, allow_null=True, **kwargs)

    def to_internal_value(self, data: object) -> object:
        return data

    def to_representation(self, value: object) -> object:
        return value


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "enum": list(PRIORITY_CLASSES)},
            {"type": "integer", "minimum": 0, "maximum": 4},
        ],
        "nullable": True,
    }
)
class _Priority(_AsSent):
    pass


@extend_schema_field({"type": "number", "exclusiveMinimum": 0, "nullable": True})
class _Timeout(_AsSent):
    pass


class PredictParameters(serializers.Serializer[Any]):
    """How the request is scheduled: the same ``parameters`` as OIP's infer request."""

    priority = _Priority(
        help_text="The request's priority class: a name, or Triton's integer (1 best .. 4; 0 "
        "the API key's default). Without it, the key's class; above the key's class is a 403."
    )
    timeout = _Timeout(
        help_text="The request's deadline in microseconds (as OIP's and Triton's "
        "`parameters.timeout`), capped at the server's; the `x-switchyard-timeout-ms` header "
        "does the same in milliseconds, and the shorter of both wins."
    )

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in data if key not in self.fields)
            if unknown:  # a misspelt "timeout_ms" silently ignored would be a surprise later
                raise serializers.ValidationError(
                    {
                        key[:40]: f"unknown parameter; send only {', '.join(self.fields)}"
                        for key in unknown[:5]
                    }
                )
        return super().to_internal_value(data)


class PredictRequest(serializers.Serializer[Any]):
    instances = serializers.ListField(
        required=False,
        help_text="Rows: objects of feature name → value, or lists of values in signature order.",
    )
    inputs = serializers.DictField(
        required=False, help_text="Columns: input name → nested list (batch first)."
    )
    outputs = serializers.ListField(child=serializers.CharField(), required=False)
    parameters = PredictParameters(required=False)


class PredictResponse(serializers.Serializer[Any]):
    model = serializers.CharField()
    version = serializers.IntegerField()
    predictions = serializers.ListField(help_text="The first output, one entry per row.")
    outputs = serializers.DictField(help_text="Every output asked for: name → nested list.")
    class_labels = serializers.DictField(
        required=False,
        help_text="A classifier's probability outputs: output name → the class label of each "
        "column.",
    )
    arm = serializers.CharField(
        required=False, help_text="The rollout arm that answered, while a plan routes the model."
    )


# The API's one error shape, defined with the schema class that documents it everywhere.
ErrorResponse = platform_api.ErrorResponse
