"""Admin for models, versions (uploaded through the same checks as the API) and aliases."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest

from tenants.admin_audit import AuditedAdmin
from tenants.audit import SYSTEM, Actor, user_actor

from .models import Model, ModelVersion
from .services import (
    LADDER_FIELDS,
    SERVING_FIELDS,
    check_personal_fields,
    create_version,
    update_serving_settings,
)
from .signature import SignatureError


@admin.register(Model)
class ModelAdmin(AuditedAdmin[Model]):
    list_display = ["name", "tenant", "task", "created_at"]
    list_filter = ["tenant", "task"]
    search_fields = ["name"]
    # The fallback ladder decides who answers when the primary fails: it changes through the
    # traffic gate (PATCH /api/v1/models/{name}), never in a form that skips it.
    readonly_fields = LADDER_FIELDS


class VersionUploadForm(forms.ModelForm[ModelVersion]):
    """On creation: the artifact is hashed and its signature read and checked."""

    upload = forms.FileField(help_text="ONNX file", required=True)
    tokenizer_file = forms.FileField(
        required=False,
        label="Tokenizer",
        help_text="tokenizer.json: the version then takes a BYTES text input",
    )
    created: ModelVersion  # set by clean(): the version the upload became
    actor: Actor = SYSTEM  # set by the admin's get_form(): who uploads, for the audit log

    class Meta:
        model = ModelVersion
        fields = [
            "model",
            "upload",
            "tokenizer_file",
            "source_commit",
            "training_data_hash",
            "parent",
            "offline_metrics",
            "feature_names",
            "allow_missing",
            *SERVING_FIELDS,
        ]

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        model = data.get("model")
        upload = data.get("upload")
        if model is None or upload is None:
            return data
        details = {
            k: data[k]
            for k in self.Meta.fields
            if k in data and k not in ("model", "upload", "tokenizer_file")
        }
        tokenizer = data.get("tokenizer_file")
        try:
            self.created = create_version(
                model, upload, actor=self.actor, tokenizer=tokenizer, **details
            )
        except SignatureError as exc:
            raise forms.ValidationError({"upload": f"{exc.field}: {exc}"}) from None
        return data


class VersionChangeForm(forms.ModelForm[ModelVersion]):
    """On a change: only the serving settings, checked as the API checks them."""

    def clean_personal_fields(self) -> dict[str, str]:
        value = self.cleaned_data["personal_fields"]
        try:
            return check_personal_fields(self.instance, value)
        except SignatureError as exc:
            raise forms.ValidationError(str(exc)) from None


@admin.register(ModelVersion)
class ModelVersionAdmin(AuditedAdmin[ModelVersion]):
    audits_saves = False  # uploads and setting changes go through the audited services

    list_display = ["__str__", "sha256", "format", "device", "created_at"]
    list_filter = ["model__tenant", "format"]
    editable = SERVING_FIELDS

    def get_form(
        self,
        request: HttpRequest,
        obj: ModelVersion | None = None,
        change: bool = False,
        **kwargs: Any,
    ) -> type[forms.ModelForm[ModelVersion]]:
        kwargs["form"] = VersionUploadForm if obj is None else VersionChangeForm
        form = super().get_form(request, obj, change, **kwargs)
        if obj is None:
            # A subclass per request: the upload (in clean()) is audited as this person's.
            return type(form.__name__, (form,), {"actor": user_actor(request.user)})
        return form

    def get_fields(self, request: HttpRequest, obj: ModelVersion | None = None) -> tuple[str, ...]:
        if obj is None:
            return tuple(VersionUploadForm.Meta.fields)
        return tuple(f.name for f in ModelVersion._meta.fields if f.name != "id")

    def get_readonly_fields(
        self, request: HttpRequest, obj: ModelVersion | None = None
    ) -> list[str]:
        if obj is None:
            return []
        return [f.name for f in ModelVersion._meta.fields if f.name not in self.editable]

    def save_model(
        self,
        request: HttpRequest,
        obj: ModelVersion,
        form: VersionUploadForm | VersionChangeForm,
        change: bool,
    ) -> None:
        if change:
            # Through the same checks as the API (personal fields name real inputs).
            changes = {f: form.cleaned_data[f] for f in form.changed_data}
            # The object already holds the form's values: the function compares with the row.
            update_serving_settings(
                ModelVersion.objects.get(pk=obj.pk), changes, user_actor(request.user)
            )
            return
        assert isinstance(form, VersionUploadForm)  # get_form() gives a new version this form
        created = form.created
        created.created_by_id = request.user.pk
        created.save(update_fields=["created_by"])
        obj.pk = created.pk


# Alias is registered by rollouts.admin: moving an alias goes through rollouts.approvals (the
# rollout policy's protected aliases need an approval), which this app cannot import.
