"""The prediction API's request and response bodies, for validation and the OpenAPI schema.

One definition for both: ``gateway.api.predict_app`` validates each request with
``PredictRequest`` and the schema (``/api/schema/``) documents the same classes from
``PredictView``.
"""

from __future__ import annotations

from rest_framework import serializers

from platform_site import api as platform_api


class PredictRequest(serializers.Serializer):
    instances = serializers.ListField(
        required=False,
        help_text="Rows: objects of feature name → value, or lists of values in signature order.",
    )
    inputs = serializers.DictField(
        required=False, help_text="Columns: input name → nested list (batch first)."
    )
    outputs = serializers.ListField(child=serializers.CharField(), required=False)


class PredictResponse(serializers.Serializer):
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
