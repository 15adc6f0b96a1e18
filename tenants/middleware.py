"""``Idempotency-Key`` on every state-changing call of the control-plane API (``POST``, ``PUT``,
``PATCH``, ``DELETE`` under ``/api/v1/``), in one place rather than in each view.

A call without the header pays one dictionary lookup. A call with it runs its view inside a
transaction that also keeps the answer (``tenants.idempotency``), so a retry by the same caller
gets the first answer back, marked ``Idempotent-Replayed: true``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.db import transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.utils.deprecation import MiddlewareMixin

from platform_site.errors import Conflict, Invalid, Unprocessable
from platform_site.tokens import bearer

from . import idempotency
from .keys import identify_key
from .models import Membership

API_PREFIX = "/api/v1/"
CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
META_KEY = "HTTP_IDEMPOTENCY_KEY"
# The response headers a replay repeats (others, such as cookies, belong to the first call).
KEPT_HEADERS = ("content-type", "location")

View = Callable[..., HttpResponseBase]


class IdempotencyMiddleware(MiddlewareMixin):
    async def process_view(
        self,
        request: HttpRequest,
        view: View,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> HttpResponseBase | None:
        # Async, so a call without the header costs no thread hop (a sync process_view would
        # cost one on every request that reaches Django, the OpenAI endpoints included).
        raw = request.META.get(META_KEY)
        if (
            raw is None
            or request.method not in CHANGES
            or not request.path.startswith(API_PREFIX)
            or getattr(getattr(view, "cls", None), "idempotency_in_view", False)
        ):
            return None
        try:
            key = idempotency.parse_key(raw)
        except Invalid as exc:
            return _error(400, f"{idempotency.HEADER}: {exc}")
        # The views are sync: the claim, the view and the kept answer run in one thread, so
        # they can share one transaction.
        run = sync_to_async(_run_once, thread_sensitive=True)
        return await run(request, key, view, args, kwargs)


def _run_once(
    request: HttpRequest, key: str, view: View, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> HttpResponseBase | None:
    caller = caller_scope(request)
    if caller is None:
        return None  # no credentials the view would accept: the view says so itself
    tenant_id, who = caller
    try:
        fingerprint = request_fingerprint(request)
    except RequestDataTooBig:
        return _error(413, "request body is larger than the limit")
    except (MultiPartParserError, SuspiciousOperation) as exc:  # hostile or broken forms
        return _error(400, f"the request body cannot be read as a form: {exc}")
    try:
        claimed = idempotency.begin(tenant_id, who, key, fingerprint)
    except Conflict as exc:
        return _error(409, str(exc), [("Retry-After", "1")])
    except Unprocessable as exc:
        return _error(422, str(exc))
    if isinstance(claimed, idempotency.Stored):
        return _replay(claimed)
    kept = False
    try:
        with transaction.atomic():
            response = view(request, *args, **kwargs)
            render = getattr(response, "render", None)
            if callable(render):
                render()  # DRF's responses render late; the body is kept now
            keep = isinstance(response, HttpResponse) and (
                response.status_code in idempotency.STORED_STATUSES
            )
            if isinstance(response, HttpResponse) and keep:
                idempotency.complete(claimed, _stored(response))
        kept = keep  # only once committed: a failed commit frees the key for the retry
    finally:
        if not kept:
            idempotency.release(claimed)
    return response


def caller_scope(request: HttpRequest) -> tuple[int, str] | None:
    """The tenant and caller a key belongs to: an API key, or a signed-in member acting in one
    tenant (the ``X-Tenant`` header, or their only tenant), as ``caller_of`` decides it. None
    when neither holds: the view then refuses the call as it would without the header."""
    raw = bearer(request.META.get("HTTP_AUTHORIZATION"))
    if raw is not None:
        identity = identify_key(raw)
        return None if identity is None else (identity.tenant_id, f"key:{identity.key_id}")
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    memberships = Membership.objects.filter(user=user)
    slug = request.headers.get("X-Tenant")
    if slug:
        memberships = memberships.filter(tenant__slug=slug)
    found = list(memberships.values_list("tenant_id", flat=True)[:2])
    return (found[0], f"user:{user.pk}") if len(found) == 1 else None


def request_fingerprint(request: HttpRequest) -> str:
    """The request's fingerprint. A multipart upload is read as its fields and files' contents
    (a client retrying it may pick a new boundary); Django spools large files to disk, and DRF
    reads the parsed form afterwards."""
    path = request.get_full_path()
    if request.content_type != "multipart/form-data":
        return idempotency.fingerprint(request.method or "", path, request.body)
    parts: list[bytes] = []
    for name, values in sorted(request.POST.lists()):
        parts += [name.encode(), *(v.encode() for v in values)]
    for name, files in sorted(request.FILES.lists()):
        for upload in files:
            digest = hashlib.sha256()
            for chunk in upload.chunks():
                digest.update(chunk)
            upload.seek(0)
            parts += [name.encode(), (upload.name or "").encode(), digest.digest()]
    return idempotency.fingerprint(request.method or "", path, *parts)


def _stored(response: HttpResponse) -> idempotency.Stored:
    """What a retry is given. A body over SWITCHYARD_IDEMPOTENCY_MAX_ANSWER_BYTES is not kept,
    and both answers say so (``Idempotency-Stored: false``); the rest is: the call acted, so its
    retry must still not act again, and gets the status and ``Location`` (where to read it)."""
    headers = [(name, response[name]) for name in KEPT_HEADERS if response.has_header(name)]
    if len(response.content) <= settings.SWITCHYARD_IDEMPOTENCY_MAX_ANSWER_BYTES:
        return idempotency.Stored(response.status_code, headers, response.content)
    response[idempotency.STORED_HEADER] = "false"
    headers.append((idempotency.STORED_HEADER, "false"))
    return idempotency.Stored(response.status_code, headers, b"")


def _replay(stored: idempotency.Stored) -> HttpResponse:
    response = HttpResponse(stored.body, status=stored.status)
    for name, value in stored.headers:
        response[name] = value
    response[idempotency.REPLAYED_HEADER] = "true"
    return response


def _error(status: int, message: str, headers: list[tuple[str, str]] | None = None) -> JsonResponse:
    """The API's error shape (``platform_site.errors``)."""
    response = JsonResponse({"error": message}, status=status)
    for name, value in headers or []:
        response[name] = value
    return response
