"""Open Inference Protocol v2 over REST, as a lean ASGI application.

The infer path is the platform's hottest, so it bypasses Django's request/response stack (a
measured 5-10x in CPU per request) and calls the shared pipeline directly. Everything else
under ``/v2`` is small and served here too, so KServe and Triton clients work unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from . import graphs, idempotency, pipeline, spans
from .asgi_io import error_body as _error
from .asgi_io import header as _header
from .asgi_io import read_body as _read_body
from .asgi_io import respond as _respond
from .asgi_types import Receive, Scope, Send
from .errors import ApiError
from .frontdoor import Call, serve, until_client_leaves
from .oip_codec import parse_infer, render_infer
from .routes import Route
from .scheduling import TIMEOUT_HEADER, schedule
from .state import GatewayState, get_state

log = logging.getLogger(__name__)

SERVER_METADATA = orjson.dumps(
    {"name": "switchyard", "version": "0.1.0", "extensions": ["binary_tensor_data"]}
)
DOOR = spans.HttpDoor(spans.oip_route, spans.scope_request)  # its sampled requests' spans


async def oip_app(scope: Scope, receive: Receive, send: Send) -> None:
    state = get_state()
    call = Call(state, _header(scope, b"x-request-id"), _header(scope, b"traceparent"), DOOR, scope)
    status, body, headers = await serve(call, _handle(state, scope, receive, call), _render_error)
    await _respond(send, status, body, [*headers, *call.trace.headers()])
    call.finish()


Answer = tuple[int, bytes, list[tuple[str, str]]]


def _render_error(exc: ApiError) -> Answer:
    """OIP's error shape: ``{"error": message}``."""
    return exc.status, _error(exc.message), exc.headers


async def _handle(state: GatewayState, scope: Scope, receive: Receive, call: Call) -> Answer:
    method = scope["method"]
    parts = scope["path"].rstrip("/").split("/")[1:]  # "/v2/models/x/infer" -> [v2, models, ..]
    n = len(parts)
    if parts == ["v2"]:
        _allow(method, "GET")
        return 200, SERVER_METADATA, []
    if n == 3 and parts[1] == "health" and parts[2] == "live":
        _allow(method, "GET")
        return 200, orjson.dumps({"live": True}), []
    if n == 3 and parts[1] == "health" and parts[2] == "ready":
        _allow(method, "GET")
        ready = state.serving_ready()
        return (200 if ready else 503), orjson.dumps({"ready": ready}), []
    if n < 3 or parts[1] != "models":
        raise ApiError(404, f"no such endpoint: {scope['path']}")
    name = parts[2]
    rest = parts[3:]
    version = None
    if rest[:1] == ["versions"]:
        if len(rest) < 2:
            raise ApiError(404, f"no such endpoint: {scope['path']}")
        version, rest = rest[1], rest[2:]
    authorization = _header(scope, b"authorization")
    if rest == ["infer"]:
        _allow(method, "POST")
        call.predicting()  # counted (and maybe logged) whatever happens from here
        return await _infer(state, scope, receive, authorization, name, version, call)
    if rest == []:
        _allow(method, "GET")
        _, route = await call.admit(authorization, name, version)
        return 200, orjson.dumps(model_metadata(route)), []
    if rest == ["ready"]:
        _allow(method, "GET")
        _, route = await call.admit(authorization, name, version)
        ready = await graphs.ready(state, route)
        return (200 if ready else 503), orjson.dumps({"name": name, "ready": ready}), []
    raise ApiError(404, f"no such endpoint: {scope['path']}")


async def _infer(
    state: GatewayState,
    scope: Scope,
    receive: Receive,
    authorization: str | None,
    name: str,
    version: str | None,
    call: Call,
) -> Answer:
    identity, route = await call.admit(authorization, name, version)
    observed = call.observed
    body = await _read_body(scope, receive, state.max_body)
    header_length = _header(scope, b"inference-header-content-length")
    parsed = parse_infer(body, header_length, route)
    sched = schedule(state, identity, parsed.parameters, _header(scope, TIMEOUT_HEADER.encode()))
    # A retry with the same Idempotency-Key gets the first answer; the binary header is part
    # of the request (it says where the JSON ends).
    replay = await call.claim_key(
        identity,
        _header(scope, idempotency.HEADER.encode()),
        "POST",
        scope["path"],
        body,
        (header_length or "").encode(),
    )
    if replay is not None:
        return replay.status, replay.body, [*replay.headers, idempotency.REPLAYED]
    observed.mark("serialization")
    # A client that hangs up while it waits cancels its request, so the agent drops it
    # unrun if it is still queued (the body is read: the next message is the disconnect).
    routed, outputs = await until_client_leaves(
        receive,
        pipeline.predict(
            state,
            identity,
            route,
            lambda h: _header(scope, h.encode()),
            parsed,
            observed,
            call.after,
            sched,
        ),
    )
    payload, headers = render_infer(
        routed.route, parsed.id, outputs, parsed.binary_outputs, routed.arm, routed.degraded
    )
    observed.mark("serialization")
    headers = await call.keep(200, headers, payload)
    return 200, payload, headers


def model_metadata(route: Route) -> dict[str, Any]:
    return {
        "name": route.model_name,
        "versions": [str(route.version)],
        "platform": route.platform,
        "inputs": [
            {"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in route.inputs
        ],
        "outputs": [dict(o) for o in route.outputs],
    }


def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise ApiError(
            405, f"method {method} not allowed here; use {allowed}", [("Allow", allowed)]
        )
