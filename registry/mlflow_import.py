"""Import a version from an MLflow model registry (``models:/name/3`` or ``models:/name@alias``).

Only the ONNX flavour is imported: pickle-based flavours (sklearn, pyfunc...) would run code on
load and the runtimes cannot serve them. The artifact goes through ``create_version`` like any
upload (hash, pickle refusal, signature read from the graph); the MLflow run's id, metrics,
params and signature are kept in ``ModelVersion.lineage["mlflow"]``.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from django.conf import settings
from django.core.files import File

from platform_site.errors import Conflict, Invalid, Unavailable
from tenants.audit import Actor

from . import services
from .models import Model, ModelVersion

# An unreachable tracking server must answer the caller in seconds, not hold a web worker for
# MLflow's default of 7 retries of up to 120 s each; an operator's own values win.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

# Where a version's artifacts may be read from: the tracking server's own stores. A local path
# or file: URI (which the server reports, so a hostile one could name anything) would read
# this platform's disk.
ARTIFACT_SCHEMES = ("models", "runs", "mlflow-artifacts", "http", "https", "s3", "gs", "wasbs")

SOURCE = re.compile(
    r"^models:/(?P<name>[\w.\-]{1,256})(?:/(?P<version>\d{1,9})|@(?P<alias>[\w\-]{1,256}))$"
)


def parse_source(source: str) -> tuple[str, str | None, str | None]:
    """(name, version, alias) of a ``models:/`` URI, or a 400 naming ``source``."""
    match = SOURCE.match(source or "")
    if match is None:
        raise Invalid("source", "expected models:/<name>/<version> or models:/<name>@<alias>")
    return match["name"], match["version"], match["alias"]


def tracking_uri_for(requested: str | None) -> str:
    """The tracking server to read from: the request's, when its host is the configured
    server's or allow-listed (``SWITCHYARD_MLFLOW_ALLOWED_HOSTS``), else the configured one."""
    configured = settings.SWITCHYARD_MLFLOW_TRACKING_URI
    uri = requested or configured
    if not uri:
        raise Invalid("tracking_uri", "no tracking URI given and none configured")
    # Only a tracking server over HTTP: a file: or sqlite: URI would read the server's disk.
    parsed = urlparse(uri)
    try:
        port = parsed.port
    except ValueError:
        raise Invalid("tracking_uri", "the tracking URI's port is not a number") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise Invalid("tracking_uri", "the tracking URI must be an http(s) URL")
    if requested and not _host_allowed(parsed.hostname, port, configured):
        raise Invalid(
            "tracking_uri",
            f"the host {parsed.hostname!r} is not an allowed MLflow tracking server "
            "(SWITCHYARD_MLFLOW_ALLOWED_HOSTS)",
        )
    return uri


def _host_allowed(host: str, port: int | None, configured: str) -> bool:
    allowed = set(settings.SWITCHYARD_MLFLOW_ALLOWED_HOSTS)
    if configured:
        own = urlparse(configured)
        if own.hostname:
            allowed.add(own.netloc.rsplit("@", 1)[-1].lower())
    names = {host.lower()} | ({f"{host.lower()}:{port}"} if port is not None else set())
    return bool(names & allowed)


def import_version(
    model: Model,
    source: str,
    tracking_uri: str | None,
    actor: Actor,
    created_by_id: int | None = None,
) -> tuple[ModelVersion, str | None]:
    """Resolve, download and register an MLflow model version; returns it and its MLflow alias."""
    try:  # the mlflow extra (mlflow-skinny, PyYAML): not every install has it
        import yaml
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise Unavailable(
            f"MLflow import is not installed here ({exc.name} is missing): "
            "install the platform with its mlflow extra, pip install 'switchyard[mlflow]'"
        ) from None

    name, number, alias = parse_source(source)
    uri = tracking_uri_for(tracking_uri)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        if alias is not None:
            mv = client.get_model_version_by_alias(name, alias)
        else:
            mv = client.get_model_version(name, str(number))
    except MlflowException as exc:
        raise Invalid("source", f"MLflow could not resolve {source}: {exc.message}") from None
    except OSError as exc:
        raise Invalid("tracking_uri", f"the tracking server cannot be reached: {exc}") from None
    existing = [
        v
        for v in model.versions.all()
        if (v.lineage or {}).get("mlflow", {}).get("tracking_uri") == uri
        and v.lineage["mlflow"].get("name") == name
        and str(v.lineage["mlflow"].get("version")) == str(mv.version)
    ]
    if existing:
        raise Conflict(
            f"{name} version {mv.version} is already imported as version {existing[0].version}"
        )
    if urlparse(str(mv.source or "")).scheme not in ARTIFACT_SCHEMES:
        raise Invalid("source", f"the model's artifacts are at {mv.source!r}, not in a store")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(_download(str(mv.source or ""), tmp, uri))
        except MlflowException as exc:
            raise Invalid(
                "source", f"the model's artifacts cannot be read: {exc.message}"
            ) from None
        mlmodel = (
            yaml.safe_load((local / "MLmodel").read_text())
            if (local / "MLmodel").is_file()
            else None
        )
        if not isinstance(mlmodel, dict):
            raise Invalid("source", "the MLflow model has no MLmodel file")
        flavors = mlmodel.get("flavors") or {}
        if "onnx" not in flavors:
            names = ", ".join(sorted(flavors)) or "none"
            raise Invalid(
                "source", f"flavour(s) {names} cannot be served: only the onnx flavour is imported"
            )
        data = str(flavors["onnx"].get("data") or "model.onnx")
        onnx_path = (local / data).resolve()
        if not onnx_path.is_relative_to(local.resolve()) or not onnx_path.is_file():
            raise Invalid("source", f"the onnx flavour's file {data!r} is missing")
        metrics, params = _run_data(client, mv.run_id)
        lineage = {
            "mlflow": {
                "tracking_uri": uri,
                "name": name,
                "version": str(mv.version),
                "alias": alias,
                "run_id": mv.run_id,
                "metrics": metrics,
                "params": params,
                "signature": mlmodel.get("signature"),
                "source": mv.source,
            }
        }
        with onnx_path.open("rb") as fh:
            version = services.create_version(
                model,
                File(fh, name="model.onnx"),
                actor=actor,
                created_by_id=created_by_id,
                lineage=lineage,
                offline_metrics=metrics,
            )
    return version, alias


def _download(source: str, dst: str, uri: str) -> str:
    from mlflow.artifacts import download_artifacts

    return str(download_artifacts(artifact_uri=source, dst_path=dst, tracking_uri=uri))


def _run_data(client: Any, run_id: str | None) -> tuple[dict[str, float], dict[str, str]]:
    if not run_id:
        return {}, {}
    run = client.get_run(run_id)
    return dict(run.data.metrics), dict(run.data.params)
