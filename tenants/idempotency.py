"""Idempotency keys (``Idempotency-Key``, as Stripe and draft-ietf-httpapi-idempotency-key-header):
a retry of a state-changing call with the same key, by the same caller, within the retention
window gets the first answer back instead of acting twice.

This module holds what every front door shares (the key's syntax, the request fingerprint, the
errors) and the control plane's store, ``IdempotencyRecord`` rows; the data path keeps its own
store off the database (``gateway.idempotency``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from platform_site.errors import Conflict, Invalid, Unprocessable

from .models import IdempotencyRecord

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # Stripe's name: "true" on an answer given again
# "false" on an answer that was not kept for its retries (too large, or on the data path its
# tenant's kept answers at their budget). Neither Stripe nor the draft names one; absent means
# kept, as Idempotent-Replayed is absent on a first answer.
STORED_HEADER = "Idempotency-Stored"
MAX_KEY_LENGTH = 255
# Printable ASCII without spaces: a UUID, a ULID or any token a client library generates.
_KEY = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_LENGTH}}}")
# Only answers that say the call acted are kept: any other answer (a refusal, an overload, an
# error) did nothing a retry must not repeat, so the key is freed for the retry.
STORED_STATUSES = range(200, 300)


def parse_key(value: str) -> str:
    """The key a header carries, or ``Invalid``. The draft sends it as a structured-field
    string (``"abc"``); a bare token (Stripe's form) is taken as it is."""
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if not _KEY.fullmatch(value):
        raise Invalid(
            HEADER,
            f"must be 1 to {MAX_KEY_LENGTH} printable ASCII characters without spaces "
            f"(a UUID, for example); got {len(value)} characters",
        )
    return value


def fingerprint(method: str, path: str, *parts: bytes) -> str:
    """What identifies a request for its key: its method, path and body (and any header that
    changes how the body reads). The same key with another fingerprint is refused (422)."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(f"{method} {path}\n".encode())
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))  # framed: b"ab", b"" != b"a", b"b"
        digest.update(part)
    return digest.hexdigest()


def reused(key: str) -> Unprocessable:
    return Unprocessable(
        f"{HEADER}: {key!r} was already used for a different request (another method, path or "
        "body); use a new key for a new request"
    )


def in_progress(key: str) -> Conflict:
    return Conflict(
        f"{HEADER}: a request with {key!r} is still being processed; retry once it has answered"
    )


def retention() -> timedelta:
    return timedelta(seconds=settings.SWITCHYARD_IDEMPOTENCY_RETENTION_S)


# How long a call may hold its key unanswered before a retry may take it over: its process
# died mid-call (the change and its answer were rolled back together, see complete()).
ABANDONED_AFTER = timedelta(minutes=5)


@dataclass(frozen=True)
class Stored:
    """An answer kept for replay: status, the headers that matter, body."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


def begin(tenant_id: int, caller: str, key: str, fingerprint: str) -> IdempotencyRecord | Stored:
    """Claim ``key`` for this call (the record to ``complete`` or ``release``), or the stored
    answer of the first call with it. Raises ``Conflict`` while that call still runs and
    ``Unprocessable`` when the key was used for another request.

    The claim commits at once, in its own transaction, so a concurrent retry sees it and gets
    409 rather than waiting on the first call's locks."""
    now = timezone.now()
    for _ in range(2):  # a claim that loses the insert race reads the winner's row
        found = IdempotencyRecord.objects.filter(tenant_id=tenant_id, caller=caller, key=key)
        record = found.first()
        if record is None:
            try:
                with transaction.atomic():
                    return IdempotencyRecord.objects.create(
                        tenant_id=tenant_id,
                        caller=caller,
                        key=key,
                        fingerprint=fingerprint,
                        created_at=now,
                    )
            except IntegrityError:
                continue
        expired = record.created_at < now - retention()
        abandoned = record.status is None and record.created_at < now - ABANDONED_AFTER
        if expired or abandoned:
            # Conditional update: of two retries taking over the same stale row, one wins.
            taken = found.filter(pk=record.pk, created_at=record.created_at).update(
                fingerprint=fingerprint, status=None, headers=[], body=b"", created_at=now
            )
            if taken:
                record.fingerprint, record.status, record.created_at = fingerprint, None, now
                return record
            continue
        if record.status is None:
            raise in_progress(key)  # whatever it asks: the first answer is not known yet
        if record.fingerprint != fingerprint:
            raise reused(key)
        headers = [(str(name), str(value)) for name, value in record.headers]
        return Stored(record.status, headers, bytes(record.body))
    raise in_progress(key)


def complete(record: IdempotencyRecord, answer: Stored) -> None:
    """Keep the call's answer. Called inside the transaction of the change it answers, so the
    change and its answer commit together: a call that dies between them leaves neither."""
    IdempotencyRecord.objects.filter(pk=record.pk).update(
        status=answer.status, headers=[list(h) for h in answer.headers], body=answer.body
    )


def release(record: IdempotencyRecord) -> None:
    """Free the key of a call that did not act (it failed or was refused): a retry runs anew."""
    IdempotencyRecord.objects.filter(pk=record.pk, status__isnull=True).delete()


def purge_expired() -> int:
    """Delete records past the retention window (a beat task, with the other retention
    purges); a retry after that acts again."""
    cutoff = timezone.now() - retention()
    deleted, _ = IdempotencyRecord.objects.filter(created_at__lt=cutoff).delete()
    return deleted
