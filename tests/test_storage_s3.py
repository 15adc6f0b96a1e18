"""Artifacts in an S3 bucket (moto's real S3 server): uploads land in the bucket, agents get
presigned URLs straight to it (and never send their node token there), and versions are
registered by reference from the bucket or an allowed local directory."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from fleet.assignments import assignment_for
from fleet.nodes import create_node
from registry.models import ModelVersion
from serving_agent import ArtifactCache
from serving_agent._cache import download_source
from serving_agent._exceptions import AgentError, ChecksumMismatch
from tests.factories import key_client, make_model, make_session
from tests.fuzz.strategies import fuzz
from tests.onnx_models import small_onnx
from tests.s3_server import REGION, s3_server

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def s3_storages(endpoint: str, bucket: str) -> dict:
    return {
        "default": {
            "BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {
                "bucket_name": bucket,
                "endpoint_url": endpoint,
                "region_name": REGION,
                "default_acl": None,
                "querystring_auth": True,
                "querystring_expire": 1234,
                "signature_version": "s3v4",
                "file_overwrite": False,
            },
        },
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }


@pytest.fixture
def bucket(s3, settings) -> str:
    """S3 storage in a fresh bucket of its own."""
    name = s3.new_bucket()
    settings.SWITCHYARD_STORAGE = "s3"
    settings.STORAGES = s3_storages(s3.endpoint, name)
    return name


@pytest.fixture
def api(world) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {world.key_a}")
    assert client.post("/api/v1/models", {"name": "clf", "task": "classifier"}).status_code == 201
    return client


def upload(api, artifact: bytes):
    data = {"artifact": SimpleUploadedFile("m.onnx", artifact)}
    return api.post("/api/v1/models/clf/versions", data, format="multipart")


def by_reference(api, uri: str, **fields):
    return api.post("/api/v1/models/clf/versions", {"artifact_uri": uri, **fields})


def promote(api, number: int) -> None:
    moved = api.put("/api/v1/models/clf/aliases/production", {"version": number}, format="json")
    assert moved.status_code == 200, moved.content


def agent_spec(version: ModelVersion):
    node, _ = create_node("n1")
    (spec,) = assignment_for(node, make_session(node).pk)
    assert spec.version_id == version.pk
    return spec


def object_bytes(s3, bucket: str, key: str) -> bytes:
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


# Uploads -------------------------------------------------------------------------------------


def test_upload_through_the_api_lands_in_the_bucket(s3, bucket, world, api, onnx_bytes):
    response = upload(api, onnx_bytes)
    assert response.status_code == 201, response.content
    version = ModelVersion.objects.get()
    key = f"artifacts/{world.a.pk}/{version.sha256}.onnx"
    assert version.artifact.name == key and version.artifact_uri == ""
    assert object_bytes(s3, bucket, key) == onnx_bytes


def test_an_upload_spooled_to_disk_is_checked_there_and_streamed_to_the_bucket(
    s3, bucket, settings, api, onnx_bytes
):
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 0  # every upload is a temporary file on disk
    assert upload(api, onnx_bytes).status_code == 201
    version = ModelVersion.objects.get()
    assert object_bytes(s3, bucket, version.artifact.name) == onnx_bytes


def test_the_same_bytes_are_one_object_per_tenant_and_outlive_a_deleted_version(
    s3, bucket, world, api, onnx_bytes
):
    assert upload(api, onnx_bytes).status_code == upload(api, onnx_bytes).status_code == 201
    first, again = ModelVersion.objects.order_by("version")
    key = f"artifacts/{world.a.pk}/{first.sha256}.onnx"
    assert first.artifact.name == again.artifact.name == key
    listed = s3.client().list_objects_v2(Bucket=bucket)["Contents"]
    assert [o["Key"] for o in listed] == [key]
    # Another tenant's identical upload is its own object: nothing tells it what tenant A holds.
    make_model(world.b, "clf")
    theirs = key_client(world.key_b).post(
        "/api/v1/models/clf/versions",
        {"artifact": SimpleUploadedFile("m.onnx", onnx_bytes)},
        format="multipart",
    )
    assert theirs.status_code == 201
    listed = s3.client().list_objects_v2(Bucket=bucket)["Contents"]
    assert sorted(o["Key"] for o in listed) == sorted(
        [key, f"artifacts/{world.b.pk}/{first.sha256}.onnx"]
    )
    first.delete()  # as the admin deletes a version: the object stays for the other
    assert object_bytes(s3, bucket, key) == onnx_bytes


# Presigned downloads -------------------------------------------------------------------------


def test_agents_get_a_presigned_url_straight_to_the_bucket(s3, bucket, api, onnx_bytes):
    promote(api, upload(api, onnx_bytes).json()["version"])
    spec = agent_spec(ModelVersion.objects.get())
    url = urlsplit(spec.artifact_url)
    assert f"{url.scheme}://{url.netloc}" == s3.endpoint
    query = parse_qs(url.query)
    assert query["X-Amz-Expires"] == ["1234"] and "X-Amz-Signature" in query
    body = httpx.get(spec.artifact_url).content  # no credentials: the signature is the grant
    assert hashlib.sha256(body).hexdigest() == spec.sha256


def test_the_platform_download_path_redirects_to_the_bucket(client, bucket, api, onnx_bytes):
    promote(api, upload(api, onnx_bytes).json()["version"])
    version = ModelVersion.objects.get()
    _, token = create_node("n1")
    response = client.get(
        f"/api/v1/agent/artifacts/{version.pk}", HTTP_AUTHORIZATION=f"Bearer {token}"
    )
    assert response.status_code == 302
    assert "X-Amz-Signature" in response["Location"]
    # Still scoped: another tenant's node gets nothing, not even a redirect.
    from tests.factories import make_tenant

    _, other = create_node("n2", tenant=make_tenant("gamma"))
    refused = client.get(
        f"/api/v1/agent/artifacts/{version.pk}", HTTP_AUTHORIZATION=f"Bearer {other}"
    )
    assert refused.status_code == 404


def test_node_headers_go_only_to_the_platform():
    platform, auth = "http://platform.test:8000", {"Authorization": "Bearer syn_x"}
    assert download_source(platform, "/api/v1/agent/artifacts/1", auth) == (
        "http://platform.test:8000/api/v1/agent/artifacts/1",
        auth,
    )
    assert download_source(platform, "http://PLATFORM.test:8000/a", auth)[1] == auth
    for elsewhere in (
        "https://bucket.s3.amazonaws.com/k?X-Amz-Signature=1",
        "http://platform.test:9000/a",  # same host, another port: another origin
        "https://platform.test:8000/a",
        "http://platform.test.evil.example:8000/a",
        "//evil.example/a",
    ):
        if elsewhere.startswith("//"):
            with pytest.raises(AgentError):
                download_source(platform, elsewhere, auth)
        else:
            assert download_source(platform, elsewhere, auth) == (elsewhere, {})
    with pytest.raises(AgentError):
        download_source(platform, "file:///etc/passwd", auth)


def test_a_tampered_object_is_refused_by_the_agent_cache(s3, bucket, api, onnx_bytes, tmp_path):
    promote(api, upload(api, onnx_bytes).json()["version"])
    version = ModelVersion.objects.get()
    spec = agent_spec(version)
    s3.client().put_object(Bucket=bucket, Key=version.artifact.name, Body=small_onnx(seed=7))
    cache = ArtifactCache(tmp_path)
    try:
        with pytest.raises(ChecksumMismatch):
            asyncio.run(cache.fetch(spec.artifact_url, spec.sha256, {}))
    finally:
        cache.close()
    assert not any(tmp_path.iterdir())  # nothing of it is kept


# Registration by reference: S3 ---------------------------------------------------------------


def test_register_by_reference_from_the_bucket(s3, bucket, world, api, onnx_bytes):
    key = "imports/alpha/team/model.onnx"
    s3.client().put_object(Bucket=bucket, Key=key, Body=onnx_bytes)
    uri = f"s3://{bucket}/{key}"
    response = by_reference(api, uri, source_commit="abc")
    assert response.status_code == 201, response.content
    assert response.json()["artifact_uri"] == uri
    version = ModelVersion.objects.get()
    assert version.sha256 == hashlib.sha256(onnx_bytes).hexdigest()
    assert version.artifact.name == key  # left where it is: not copied through the platform
    assert version.inputs[0]["name"] and version.source_commit == "abc"
    promote(api, version.version)
    spec = agent_spec(version)
    assert urlsplit(spec.artifact_url).path.endswith(key)
    assert hashlib.sha256(httpx.get(spec.artifact_url).content).hexdigest() == version.sha256


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("s3://other-bucket/imports/alpha/m.onnx", "is not this platform's bucket"),
        ("s3://{bucket}/imports/alpha/../beta/m.onnx", "'..'"),
        ("s3://{bucket}/imports/beta/m.onnx", "under 'imports/alpha/'"),
        ("s3://{bucket}/artifacts/1/m.onnx", "under 'imports/alpha/'"),
        ("s3://{bucket}/imports/alpha/", "under 'imports/alpha/'"),
        ("s3://{bucket}/imports/alpha/missing.onnx", "no readable object"),
        ("s3://{bucket}/imports/alpha/m\n.onnx", "control characters"),
        ("s3://{bucket}/imports/alpha/m.onnx?versionId=1", "'?' or '#'"),
        ("s3:///imports/alpha/m.onnx", "is not this platform's bucket"),
        ("http://example.com/m.onnx", "expected s3://"),
        ("models/m.onnx", "expected s3://"),
    ],
)
def test_references_outside_the_tenants_import_prefix_are_refused(
    s3, bucket, api, onnx_bytes, uri, problem
):
    for key in ("imports/beta/m.onnx", "artifacts/1/m.onnx"):
        s3.client().put_object(Bucket=bucket, Key=key, Body=onnx_bytes)
    response = by_reference(api, uri.format(bucket=bucket))
    assert response.status_code == 400, response.content
    assert problem in json.dumps(response.json()["fields"]["artifact_uri"])
    assert not ModelVersion.objects.exists()


def test_a_referenced_object_gets_the_checks_of_an_upload(s3, bucket, api):
    import pickle

    client = s3.client()
    client.put_object(Bucket=bucket, Key="imports/alpha/p.onnx", Body=pickle.dumps({"a": 1}))
    client.put_object(Bucket=bucket, Key="imports/alpha/junk.onnx", Body=b"not a model")
    pickled = by_reference(api, f"s3://{bucket}/imports/alpha/p.onnx")
    assert pickled.status_code == 400 and "pickle" in json.dumps(pickled.json())
    junk = by_reference(api, f"s3://{bucket}/imports/alpha/junk.onnx")
    assert junk.status_code == 400 and "artifact" in junk.json()["fields"]
    assert not ModelVersion.objects.exists()


def test_a_referenced_object_over_the_limit_gets_413(s3, bucket, settings, api, onnx_bytes):
    settings.SWITCHYARD_MAX_ARTIFACT_BYTES = len(onnx_bytes) - 1
    s3.client().put_object(Bucket=bucket, Key="imports/alpha/m.onnx", Body=onnx_bytes)
    response = by_reference(api, f"s3://{bucket}/imports/alpha/m.onnx")
    assert response.status_code == 413 and "artifact_uri" in response.json()["fields"]


def test_s3_references_need_s3_storage(world, api):
    response = by_reference(api, "s3://bucket/imports/alpha/m.onnx")
    assert response.status_code == 400
    assert "SWITCHYARD_STORAGE=s3" in json.dumps(response.json())


def test_exactly_one_of_a_file_or_a_reference(api, onnx_bytes):
    both = {"artifact": SimpleUploadedFile("m.onnx", onnx_bytes), "artifact_uri": "/x"}
    for data in (both, {}):
        response = api.post("/api/v1/models/clf/versions", data, format="multipart")
        assert response.status_code == 400 and "exactly one" in json.dumps(response.json())


# Registration by reference: local paths (the embedded mode) ----------------------------------


@pytest.fixture
def import_dir(settings, tmp_path, onnx_bytes):
    allowed = tmp_path / "imports"
    allowed.mkdir()
    (allowed / "m.onnx").write_bytes(onnx_bytes)
    (tmp_path / "secret.onnx").write_bytes(onnx_bytes)
    (allowed / "link.onnx").symlink_to(tmp_path / "secret.onnx")
    settings.SWITCHYARD_ARTIFACT_IMPORT_DIRS = [str(allowed)]
    settings.MEDIA_ROOT = str(tmp_path / "media")
    return allowed


def test_register_by_reference_from_an_allowed_directory(api, import_dir, onnx_bytes):
    path = str(import_dir / "m.onnx")
    response = by_reference(api, path)
    assert response.status_code == 201, response.content
    version = ModelVersion.objects.get()
    assert version.artifact_uri == path
    with version.artifact.open("rb") as f:
        assert f.read() == onnx_bytes  # copied into storage, where agents fetch it
    assert os.path.exists(path)  # copied, never moved away from its owner


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("{tmp}/secret.onnx", "outside the allowed import directories"),
        ("{allowed}/../secret.onnx", "'..'"),
        ("{allowed}/link.onnx", "outside the allowed import directories"),
        ("{allowed}", "outside the allowed import directories"),
        ("{allowed}/missing.onnx", "not a regular file"),
        ("/etc/passwd", "outside the allowed import directories"),
    ],
)
def test_local_paths_outside_the_allow_list_are_refused(api, import_dir, name, problem):
    path = name.format(tmp=import_dir.parent, allowed=import_dir)
    response = by_reference(api, path)
    assert response.status_code == 400, response.content
    assert problem in json.dumps(response.json()["fields"]["artifact_uri"])


def test_local_paths_are_refused_without_an_allow_list(api, import_dir, settings):
    settings.SWITCHYARD_ARTIFACT_IMPORT_DIRS = []
    response = by_reference(api, str(import_dir / "m.onnx"))
    assert response.status_code == 400
    assert "SWITCHYARD_ARTIFACT_IMPORT_DIRS" in json.dumps(response.json())


HOSTILE_URIS = st.sampled_from(
    [
        "s3://{bucket}/imports/alpha/",
        "s3://{bucket}/imports/alpha/%2e%2e/beta/m.onnx",
        "s3://{bucket}//imports/alpha/m.onnx",
        "s3://{bucket}:443/imports/alpha/m.onnx",
        "s3://u:p@{bucket}/imports/alpha/m.onnx",
        "s3://{bucket}/imports/alpha/" + "a" * 1100,
        "{allowed}/\u202e.onnx",
        "{allowed}/m.onnx\x00",
        "file://{allowed}/m.onnx",
        "~/m.onnx",
        "",
    ]
)


@fuzz(40)
@given(uri=HOSTILE_URIS | st.text(max_size=60) | st.text(max_size=40).map("{allowed}/".__add__))
def test_hostile_references_never_get_a_server_error(s3, bucket, api, import_dir, uri):
    uri = uri.replace("{bucket}", bucket).replace("{allowed}", str(import_dir))
    response = by_reference(api, uri)
    assert response.status_code < 500, response.content[:300]
    if response.status_code >= 400:
        assert response.json()["error"]


def test_an_unreachable_bucket_is_a_503_with_retry_after_not_a_500(world, api, settings):
    """Nothing is wrong with the request when the store is down: 503 + Retry-After, no row."""
    import socket

    from botocore.config import Config

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    storages = s3_storages(f"http://127.0.0.1:{port}", "gone")
    storages["default"]["OPTIONS"]["client_config"] = Config(
        signature_version="s3v4", retries={"max_attempts": 1, "mode": "standard"}
    )
    settings.SWITCHYARD_STORAGE = "s3"
    settings.STORAGES = storages
    for response in (
        upload(api, small_onnx()),
        by_reference(api, "s3://gone/imports/alpha/m.onnx"),
    ):
        assert response.status_code == 503, response.content
        assert response["Retry-After"] == "5"
        assert (
            "could not be reached" in response.json()["error"]
            or "did not take" in (response.json()["error"])
        )
    assert not ModelVersion.objects.exists()
