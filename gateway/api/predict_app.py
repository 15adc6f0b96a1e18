"""The prediction API's front door (``POST /api/v1/models/{name}/predict`` and
``.../versions/{v}/predict``, ``{v}`` a version number or an alias name) as a lean ASGI app,
routed before Django by platform_site/asgi.py.

Django's request stack (its handler, seven middlewares, DRF's request wrapper and content
negotiation) cost ~2.3 ms of CPU per request against 0.15 ms for the whole OIP v2 path, so
this path skips it, as ``gateway.oip`` does, and keeps what the API promises: the URL patterns
of gateway/api/urls.py (resolved, not copied), the request serializer of
gateway/api/serializers.py (run directly: it is pure Python), the API's error shape
(``platform_site.errors``), and the one pipeline every front door calls. ``PredictView``
documents it in the OpenAPI schema and answers through ``answer()`` below when a request
reaches Django (Django's test client, other methods).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import orjson
from django.urls import Resolver404, resolve
from rest_framework.exceptions import ValidationError

from platform_site.errors import api_exception_handler

from .. import bytes_tensors, idempotency, pipeline, spans
from ..asgi_io import error_body, header, read_body, respond
from ..asgi_types import Receive, Scope, Send
from ..errors import ApiError
from ..frontdoor import Call, serve, until_client_leaves
from ..oip_codec import DEGRADED_HEADER
from ..parsed import ParsedInfer
from ..predict_codec import arrays_from_predict_body
from ..scheduling import TIMEOUT_HEADER, schedule
from ..state import GatewayState, get_state
from .serializers import PredictRequest

log = logging.getLogger(__name__)

# The names of the predict URLs in gateway/api/urls.py: a path that resolves to one of them is
# served here.
PREDICT = "gateway-predict"
PREDICT_VERSION = "gateway-predict-version"
PREDICT_URL_NAMES = (PREDICT, PREDICT_VERSION)

# One bound instance: building a serializer deep-copies its fields (tens of µs), and
# ``run_validation`` keeps no state on it between calls.
REQUEST = PredictRequest()

Header = Callable[[str], str | None]  # a request header by its lower-case name
BodyReader = Callable[[], Awaitable[bytes]]


@dataclass(frozen=True, slots=True)
class PredictURL:
    name: str
    version: str | None  # a version number or an alias name, as the path wrote it


Headers = list[tuple[str, str]]


@dataclass
class Answer:
    """A reply, and its call: ``finish`` once it is sent (the metrics, the log, shadows)."""

    status: int
    body: bytes
    headers: Headers
    call: Call

    def finish(self) -> None:
        self.call.finish()


def predict_url(scope: Scope) -> PredictURL | None:
    """The model and version a ``POST`` to a predict URL names; None for any other request
    (those go to Django, which answers other methods as DRF does)."""
    if scope["method"] != "POST" or not scope["path"].endswith("/predict"):
        return None
    return _resolve(scope["path"])


@lru_cache(maxsize=1024)  # a warm model's path is resolved once, not per request
def _resolve(path: str) -> PredictURL | None:
    try:
        found = resolve(path)
    except Resolver404:
        return None
    if found.url_name not in PREDICT_URL_NAMES:
        return None
    return PredictURL(found.kwargs["name"], found.kwargs.get("version"))


async def predict_app(url: PredictURL, scope: Scope, receive: Receive, send: Send) -> None:
    state = get_state()
    reply = await answer(
        state,
        lambda name: header(scope, name.encode()),
        url,
        lambda: read_body(scope, receive, state.max_body),
        receive,
    )
    await respond(send, reply.status, reply.body, reply.headers)
    reply.finish()


async def answer(
    state: GatewayState,
    header: Header,
    url: PredictURL,
    body: BodyReader,
    receive: Receive | None = None,
) -> Answer:
    """The reply to one prediction request, whatever goes wrong: every error in the API's
    shape (``{"error": ...}``), with its status and headers (``Retry-After`` when shedding).
    ``receive``: the ASGI channel, watched for a client that leaves (Django watches its own)."""
    call = Call(state, header("x-request-id"), header("traceparent"), DOOR, url)
    call.predicting()  # counted (and maybe logged) whatever happens from here
    payload, headers = await serve(
        call, _predict(call, state, header, url, body, receive), _render_error
    )
    return Answer(call.status, payload, [*headers, *call.trace.headers()], call)


def _render_error(exc: ApiError) -> tuple[bytes, Headers]:
    """The API's error shape: ``{"error": ...}``, plus ``fields`` when the serializer refused
    the body."""
    return (exc.body if isinstance(exc, FieldErrors) else error_body(exc.message)), exc.headers


class FieldErrors(ApiError):
    """A body the serializer refused, rendered as every DRF view in the API answers it."""

    def __init__(self, exc: ValidationError) -> None:
        response = api_exception_handler(exc, {})
        assert response is not None  # the handler answers every DRF exception
        super().__init__(400, str(response.data.get("error", "invalid body")))
        # List items' errors are keyed by their index.
        self.body = orjson.dumps(response.data, option=orjson.OPT_NON_STR_KEYS)


async def _predict(
    call: Call,
    state: GatewayState,
    header: Header,
    url: PredictURL,
    read: BodyReader,
    receive: Receive | None,
) -> tuple[bytes, Headers]:
    observed = call.observed
    identity, route = await call.admit(header("authorization"), url.name, url.version)
    raw = await read()
    data = parse_body(header("content-type"), raw)
    names, arrays, outputs = arrays_from_predict_body(data, route)
    # The body's parameters (priority, timeout) and the timeout header, read as on OIP: the
    # serializer refused unknown names and left the values to ``schedule``.
    sched = schedule(state, identity, data.get("parameters"), header(TIMEOUT_HEADER))
    replay = await call.claim_key(identity, header(idempotency.HEADER), "POST", _path_of(url), raw)
    if replay is not None:
        call.status = replay.status
        return replay.body, [*replay.headers, idempotency.REPLAYED]
    observed.mark("serialization")
    parsed = ParsedInfer(None, names, arrays, outputs, set())
    predicted = pipeline.predict(
        state,
        identity,
        route,
        lambda h: header(h.lower()),
        parsed,
        observed,
        call.after,  # the shadow copy, if the plan samples one, runs once the reply is sent
        sched,
    )
    # A client that hangs up while it waits cancels its request, as on OIP.
    routed, result = await (
        predicted if receive is None else until_client_leaves(receive, predicted)
    )
    answer: dict[str, Any] = {
        "model": routed.route.model_name,
        "version": routed.route.version,
        "predictions": result[0][1],
        "outputs": dict(result),
    }
    labels = {
        o["name"]: o["parameters"]["labels"]
        for o in routed.route.outputs
        if "labels" in o.get("parameters", {})
    }
    if labels:  # a classifier's probabilities: the class label of each column
        answer["class_labels"] = labels
    headers: Headers = []
    if routed.arm is not None:
        answer["arm"] = routed.arm
    if routed.degraded is not None:  # the model's fallback ladder answered: say which step
        answer["degraded"] = routed.degraded
        headers.append((DEGRADED_HEADER, routed.degraded))
    # numpy arrays written by orjson itself: ~10x cheaper than .tolist() and then encoding.
    payload = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY, default=_as_list)
    observed.mark("serialization")
    headers = await call.keep(200, headers, payload)
    return payload, headers


def _route_of(path: str) -> str:
    # A model's name holds no "/": a "/versions/" segment is the version's.
    if "/versions/" in path:
        return "/api/v1/models/{name}/versions/{version}/predict"
    return "/api/v1/models/{name}/predict"


# Its sampled requests' spans; both ways in (the lean app, Django's view) come through answer().
DOOR = spans.HttpDoor(_route_of, lambda url: ("POST", _path_of(url)))


def _path_of(url: PredictURL) -> str:
    """The request's identity for its key: the model and version it names (the same whether
    it came through the lean app or Django)."""
    version = "" if url.version is None else f"/versions/{url.version}"
    return f"/api/v1/models/{url.name}{version}/predict"


def parse_body(content_type: str | None, body: bytes) -> dict[str, Any]:
    """The body as validated by ``PredictRequest``: JSON only (a body without a content type
    is read as JSON, as curl scripts and OIP clients send it)."""
    if content_type is not None and not _is_json(content_type):
        raise ApiError(
            415,
            f"unsupported media type {content_type.split(';')[0].strip()!r}: "
            "send the body as JSON with 'Content-Type: application/json'",
        )
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    try:
        validated: dict[str, Any] = REQUEST.run_validation(data)
    except ValidationError as exc:
        raise FieldErrors(exc) from None
    return validated


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _as_list(value: object) -> object:
    """Arrays orjson does not write natively (not C-contiguous, or of another dtype)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OSU":  # BYTES (string labels): strings, as OIP's JSON has them
            return (
                np.array(bytes_tensors.to_json(value), dtype=object).reshape(value.shape).tolist()
            )
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")
