"""Registration by reference: a version whose artifact already lies in the platform's bucket
(``s3://bucket/key``) or, in the embedded mode, in an allow-listed local directory, registered
without uploading it through the platform.

The platform reads the artifact once, to hash it and run the same checks as an upload
(``services.create_version``). An S3 object stays where it is: the version's artifact names
its key and agents download it straight from the bucket by presigned URL, verifying its
sha256 (an object changed after registration is refused by every agent). A local file is
copied into storage in chunks.

Where a reference may point is narrow on purpose, as the caller chooses it: only the
configured bucket, only keys under the tenant's import prefix
(``SWITCHYARD_S3_IMPORT_PREFIX``), only files under ``SWITCHYARD_ARTIFACT_IMPORT_DIRS``
(after symlinks are resolved), never a ``..`` component. Anything else is a 400 naming it.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from django.conf import settings
from django.core.files.storage import default_storage
from django.core.files.uploadedfile import TemporaryUploadedFile

from platform_site.errors import Invalid, TooLarge, Unavailable

from . import services
from .models import Model, ModelVersion
from .uploads import FileOnDisk

if TYPE_CHECKING:
    from storages.backends.s3 import S3Storage

FIELD = "artifact_uri"
_CHUNK = 1024 * 1024
# Keys and paths are plain text: no control characters (log and header injection) or
# backslashes (a second path separator on some systems).
_UNSAFE = re.compile(r"[\x00-\x1f\x7f\\]")


def register_by_reference(model: Model, uri: str, **kwargs: Any) -> ModelVersion:
    """Check where ``uri`` points, read the artifact once and create the version
    (``kwargs`` as for ``services.create_version``), recording ``artifact_uri``."""
    if _UNSAFE.search(uri):
        raise Invalid(FIELD, "must not contain control characters or backslashes")
    parts = urlsplit(uri)
    if parts.scheme == "s3":
        if parts.query or parts.fragment:  # would be cut off the key: name exactly one object
            raise Invalid(FIELD, "an s3:// reference must not contain '?' or '#'")
        return _from_s3(model, uri, parts.netloc, parts.path.removeprefix("/"), **kwargs)
    if parts.scheme == "" and uri.startswith("/"):
        return _from_local(model, uri, **kwargs)
    raise Invalid(FIELD, "expected s3://<bucket>/<key> or an absolute local path")


def _no_dot_segments(path: str) -> None:
    if any(part in ("..", ".") for part in path.split("/")):
        raise Invalid(FIELD, "must not contain '..' or '.' path components")


def _check_size(size: int) -> None:
    limit = settings.SWITCHYARD_MAX_ARTIFACT_BYTES
    if size <= 0:
        raise Invalid(FIELD, "the referenced artifact is empty")
    if size > limit:
        raise TooLarge(FIELD, f"the referenced artifact is larger than the limit of {limit} bytes")


def s3_import_prefix(model: Model) -> str:
    return str(settings.SWITCHYARD_S3_IMPORT_PREFIX).replace("{tenant}", model.tenant.slug)


def _from_s3(model: Model, uri: str, bucket: str, key: str, **kwargs: Any) -> ModelVersion:
    if settings.SWITCHYARD_STORAGE != "s3":
        raise Invalid(FIELD, "s3:// references need SWITCHYARD_STORAGE=s3 on this platform")
    storage = cast("S3Storage", default_storage)  # SWITCHYARD_STORAGE=s3 configures it
    own_bucket = storage.bucket_name
    if bucket != own_bucket:
        raise Invalid(FIELD, f"bucket {bucket!r} is not this platform's bucket ({own_bucket!r})")
    _no_dot_segments(key)
    prefix = s3_import_prefix(model)
    if not key.startswith(prefix) or key == prefix or "//" in key:
        raise Invalid(FIELD, f"the key must be an object under {prefix!r} in {own_bucket!r}")
    client = storage.connection.meta.client
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except ClientError:
        raise Invalid(FIELD, f"no readable object at {uri}") from None
    except BotoCoreError as exc:  # the bucket's endpoint: unreachable, timed out
        raise Unavailable(f"the bucket could not be reached: {exc}") from None
    _check_size(int(head["ContentLength"]))
    # One read of the object, to a temporary file the checks and the hash read from disk
    # (bounded memory); the object itself stays in the bucket, where agents fetch it.
    copy = TemporaryUploadedFile(key.rsplit("/", 1)[-1], "application/octet-stream", 0, None)
    try:
        body = client.get_object(Bucket=bucket, Key=key, IfMatch=head["ETag"])["Body"]
        read = 0
        for chunk in body.iter_chunks(_CHUNK):
            read += len(chunk)
            _check_size(read)  # the object may have grown since the HEAD
            copy.write(chunk)
        copy.flush()
        copy.size = read
        return services.create_version(model, copy, stored_name=key, artifact_uri=uri, **kwargs)
    except ClientError:  # replaced between the HEAD and the GET
        raise Invalid(FIELD, f"the object at {uri} changed while it was read") from None
    except BotoCoreError as exc:
        raise Unavailable(f"the bucket could not be reached: {exc}") from None
    finally:
        copy.close()


def _allowed_dirs(model: Model) -> list[str]:
    dirs = [
        d.replace("{tenant}", model.tenant.slug) for d in settings.SWITCHYARD_ARTIFACT_IMPORT_DIRS
    ]
    return [os.path.realpath(d) for d in dirs if os.path.isabs(d)]


def _from_local(model: Model, path: str, **kwargs: Any) -> ModelVersion:
    _no_dot_segments(path)
    allowed = _allowed_dirs(model)
    if not allowed:
        raise Invalid(FIELD, "local paths are refused: SWITCHYARD_ARTIFACT_IMPORT_DIRS is empty")
    real = os.path.realpath(path)  # symlinks resolved: a link may not lead out of the list
    if not any(os.path.commonpath([real, d]) == d and real != d for d in allowed):
        raise Invalid(FIELD, f"{path} is outside the allowed import directories")
    if not os.path.isfile(real):
        raise Invalid(FIELD, f"{path} is not a regular file")
    _check_size(os.path.getsize(real))
    with FileOnDisk(real) as artifact:
        return services.create_version(model, artifact, artifact_uri=path, **kwargs)
