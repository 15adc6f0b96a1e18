"""Open Inference Protocol v2 over gRPC (KServe's ``grpc_predict_v2.proto``), served by a
``grpc.aio`` server inside each ASGI process, on the same event loop and through the same
pipeline and gateway state as the REST front door (``gateway/oip.py``).

Handlers are registered under ``/inference.GRPCInferenceService/<Method>``, the paths Triton
and KServe serve, whatever the package name of our copy of the proto (see its header).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeAlias, TypeVar

import grpc
import orjson
from django.conf import settings
from google.protobuf.message import DecodeError, Message

from . import graphs, grpc_codec, idempotency, pipeline, spans
from .admission import admit
from .errors import ApiError
from .frontdoor import Call, serve
from .oip import SERVER_METADATA, model_metadata
from .proto import grpc_predict_v2_pb2 as pb
from .scheduling import TIMEOUT_HEADER, schedule
from .state import GatewayState, get_state

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
# ModelInfer's sampled calls' spans, with the gRPC status code each error answers as.
INFER_DOOR = spans.RpcDoor(SERVICE, "ModelInfer", lambda s: grpc_codec.grpc_code(s).value[0])
_SERVER = orjson.loads(SERVER_METADATA)

Reply = TypeVar("Reply", bound=Message)
Context: TypeAlias = grpc.aio.ServicerContext


def _metadata(context: Context) -> dict[str, str]:
    # Keys arrive lower-cased; a binary (-bin) value is bytes and names nothing we read.
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


async def _abort(context: Context, exc: ApiError, trailers: list[tuple[str, str]]) -> None:
    context.set_trailing_metadata([*trailers, *grpc_codec.error_metadata(exc)])
    await context.abort(grpc_codec.grpc_code(exc.status), exc.message)


async def _answer(context: Context, work: Callable[[], Awaitable[Reply]]) -> Reply:
    """Run a call that is not a prediction; a pipeline error becomes its gRPC status."""
    try:
        return await work()
    except ApiError as exc:
        await _abort(context, exc, [])
    except Exception:
        log.exception("unhandled error in a gRPC call")
        await _abort(context, ApiError(500, "internal server error"), [])
    raise AssertionError("abort raises")  # pragma: no cover


async def server_live(request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
    return pb.ServerLiveResponse(live=True)


async def server_ready(request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
    # The same answer as GET /v2/health/ready.
    return pb.ServerReadyResponse(ready=get_state().serving_ready())


async def server_metadata(
    request: pb.ServerMetadataRequest, context: Context
) -> pb.ServerMetadataResponse:
    # binary_tensor_data is a REST extension: gRPC carries raw tensors natively.
    return pb.ServerMetadataResponse(name=_SERVER["name"], version=_SERVER["version"])


async def model_ready(request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
    async def work() -> pb.ModelReadyResponse:
        state = get_state()
        authorization = _metadata(context).get("authorization")
        _, route = await admit(state, authorization, request.name, request.version)
        return pb.ModelReadyResponse(ready=await graphs.ready(state, route))

    return await _answer(context, work)


async def model_metadata_call(
    request: pb.ModelMetadataRequest, context: Context
) -> pb.ModelMetadataResponse:
    async def work() -> pb.ModelMetadataResponse:
        state = get_state()
        authorization = _metadata(context).get("authorization")
        _, route = await admit(state, authorization, request.name, request.version)
        doc = model_metadata(route)  # the REST answer's fields, tensors reduced to the proto's
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=doc["name"],
            versions=doc["versions"],
            platform=doc["platform"],
            inputs=[
                tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                for t in doc["inputs"]
            ],
            outputs=[
                tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                for t in doc["outputs"]
            ],
        )

    return await _answer(context, work)


async def model_infer(request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
    state = get_state()
    metadata = _metadata(context)
    call = Call(state, metadata.get("x-request-id"), metadata.get("traceparent"), INFER_DOOR)
    if call.refused is None:
        call.predicting()  # a malformed request id is refused before it is a prediction
    answer = await serve(
        call, _infer(state, request, metadata, call, context.time_remaining()), _as_error
    )
    call.finish()  # the metrics and shadow copies before the abort, which raises
    if isinstance(answer, ApiError):
        await _abort(context, answer, call.trace.headers() if call.refused is None else [])
        raise AssertionError("abort raises")  # pragma: no cover
    reply, marks = answer
    lowercase = [(name.lower(), value) for name, value in marks]  # as gRPC metadata must be
    context.set_trailing_metadata([*call.trace.headers(), *lowercase])
    return reply


def _as_error(exc: ApiError) -> ApiError:
    """gRPC renders an error by aborting the call (``_abort``: its status code and
    trailers), which can only happen once the call is finished."""
    return exc


async def _infer(
    state: GatewayState,
    request: pb.ModelInferRequest,
    metadata: dict[str, str],
    call: Call,
    time_left: float | None = None,
) -> tuple[pb.ModelInferResponse, list[tuple[str, str]]]:
    """The reply, and the idempotency trailers: ``idempotent-replayed`` when it is the first
    answer to an earlier call with the same ``idempotency-key`` metadata (then nothing was
    computed), ``idempotency-stored: false`` when it was not kept for its retries."""
    version = request.model_version or None
    identity, route = await call.admit(metadata.get("authorization"), request.model_name, version)
    parsed = grpc_codec.parse_infer(request, route)
    sched = schedule(
        state,
        identity,
        grpc_codec.request_parameters(request.parameters),
        metadata.get(TIMEOUT_HEADER),
    )
    if time_left is not None:  # the client's gRPC deadline travels to the agent too
        sched = replace(sched, budget_ms=max(min(sched.budget_ms, time_left * 1000), 1.0))
    # A retry with the same idempotency-key (metadata, as the REST header) gets the first
    # answer; the request's own bytes are what it must match. Only calls with the key pay.
    key = metadata.get(idempotency.HEADER)
    if key is not None:
        replay = await call.claim_key(
            identity, key, "POST", "grpc:ModelInfer", request.SerializeToString()
        )
        if replay is not None:
            return pb.ModelInferResponse.FromString(replay.body), [idempotency.REPLAYED]
    call.observed.mark("serialization")
    routed, outputs = await pipeline.predict(
        state,
        identity,
        route,
        lambda name: metadata.get(name.lower()),
        parsed,
        call.observed,
        call.after,
        sched,
    )
    reply = grpc_codec.render_infer(
        routed.route,
        parsed.id,
        outputs,
        bool(request.raw_input_contents),
        routed.arm,
        routed.degraded,
    )
    call.observed.mark("serialization")
    return reply, await call.keep(200, [], reply.SerializeToString())


def _unary(
    handler: Callable[[Any, Context], Awaitable[Message]], request: type[Message]
) -> grpc.RpcMethodHandler:
    """A handler that decodes its own request: bytes that are not a ``request`` message are
    the caller's fault (INVALID_ARGUMENT), where a failing ``request_deserializer`` makes gRPC
    itself answer INTERNAL."""

    async def decoded(raw: bytes, context: Context) -> Message:
        try:
            message = request.FromString(raw)
        except DecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid {request.DESCRIPTOR.name}: {exc}",
            )
        return await handler(message, context)

    return grpc.unary_unary_rpc_method_handler(
        decoded, response_serializer=lambda reply: reply.SerializeToString()
    )


HANDLERS = {
    "ServerLive": _unary(server_live, pb.ServerLiveRequest),
    "ServerReady": _unary(server_ready, pb.ServerReadyRequest),
    "ModelReady": _unary(model_ready, pb.ModelReadyRequest),
    "ServerMetadata": _unary(server_metadata, pb.ServerMetadataRequest),
    "ModelMetadata": _unary(model_metadata_call, pb.ModelMetadataRequest),
    "ModelInfer": _unary(model_infer, pb.ModelInferRequest),
}


async def start_server(host: str, port: int, max_message_bytes: int) -> tuple[grpc.aio.Server, int]:
    """A started server on ``host:port`` (port 0: a free one) and the port it bound.

    ``so_reuseport``: every uvicorn worker binds the same port and the kernel spreads the
    connections between them, as it does for the HTTP port.
    """
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1),
            # Larger requests are refused by gRPC itself with RESOURCE_EXHAUSTED, as REST
            # refuses a larger body with 413.
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", -1),
        ]
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, HANDLERS),))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound


_servers: list[grpc.aio.Server] = []


async def start() -> int | None:
    """Start this process's gRPC server (``SWITCHYARD_GRPC_PORT``; 0 leaves it off), on the
    running event loop, which then is the loop its calls' gateway state belongs to."""
    port = settings.SWITCHYARD_GRPC_PORT
    if not port:
        return None
    get_state()  # the loop's state (and its refresh loop) before the first call needs it
    server, bound = await start_server(
        settings.SWITCHYARD_GRPC_HOST, port, settings.SWITCHYARD_MAX_BODY_BYTES
    )
    _servers.append(server)
    log.info("Open Inference Protocol v2 over gRPC on %s:%s", settings.SWITCHYARD_GRPC_HOST, bound)
    return bound


def running() -> bool:
    """Whether this process's gRPC server is started (and not stopped since)."""
    return bool(_servers)


async def stop(grace_s: float = 5.0) -> None:
    """Finish the calls in flight (for up to ``grace_s``), then close."""
    while _servers:
        await _servers.pop().stop(grace_s)
