"""OpenAI's ``POST /v1/embeddings`` for embedding models (``Model.task == "embedding"``): a
version that takes text (an ONNX graph with a tokenizer, ``registry.text``) answers one vector
per input string. It runs the same pipeline as an OIP request (authentication and scopes, rate
limits, the key's in-flight limit, aliases and rollout plans, idempotency keys, metrics and the
prediction log); ``usage.prompt_tokens`` is what the agent's tokenizer fed the model. Errors in
OpenAI's shape."""

from __future__ import annotations

import base64
import logging
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from registry.models import TaskKind

from . import idempotency, pipeline, spans
from .admission import model_ref
from .asgi_io import header, read_body, respond
from .asgi_types import Receive, Scope, Send
from .checks import check_tensor
from .errors import ApiError
from .frontdoor import Call, serve, until_client_leaves
from .openai_api import ERROR_TYPES
from .parsed import ParsedInfer
from .routes import Route
from .scheduling import TIMEOUT_HEADER, schedule
from .state import GatewayState, get_state

log = logging.getLogger(__name__)

# The output that counts each row's tokens (``registry.text.TOKEN_COUNT``).
TOKEN_COUNT = "token_count"
MAX_INPUTS = 2048  # OpenAI's own limit per request
DOOR = spans.HttpDoor("/v1/embeddings", spans.scope_request, "embeddings")


class EmbeddingsBody(BaseModel):
    # OpenAI clients may send parameters we do not use: ignored.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


async def embeddings_app(scope: Scope, receive: Receive, send: Send) -> None:
    """``/v1/embeddings`` as a lean ASGI app, as OIP v2 is: Django's request stack measured at
    about half the throughput on a CPU the model shares (docs/text-and-embeddings.md)."""
    state = get_state()
    call = Call(state, header(scope, b"x-request-id"), header(scope, b"traceparent"), DOOR, scope)
    status, body, headers = await serve(call, _answer(state, scope, receive, call), _render_error)
    await respond(send, status, body, [*headers, *call.trace.headers()])
    call.finish()


Answer = tuple[int, bytes, list[tuple[str, str]]]


def _render_error(exc: ApiError) -> Answer:
    return exc.status, _error(exc.status, exc.message), exc.headers


def _error(status: int, message: str) -> bytes:
    """OpenAI's error shape (``openai_api.openai_error``'s body)."""
    error_type = ERROR_TYPES.get(status, "server_error")
    error = {"message": message, "type": error_type, "param": None, "code": None}
    try:
        return orjson.dumps({"error": error})
    except orjson.JSONEncodeError:  # it quotes a lone surrogate the caller sent: escape it
        error["message"] = message.encode("utf-8", "backslashreplace").decode()
        return orjson.dumps({"error": error})


async def _answer(state: GatewayState, scope: Scope, receive: Receive, call: Call) -> Answer:
    if scope["method"] != "POST":
        raise ApiError(405, "use POST", [("Allow", "POST")])
    # Counted (and maybe logged) whatever happens from here, as on every door: a refused key
    # or an exhausted rate limit is a refusal in the metrics.
    call.predicting()
    raw = await read_body(scope, receive, state.max_body)
    body, texts = _parse(raw)
    name, version = model_ref(body.model)
    identity, route = await call.admit(header(scope, b"authorization"), name, version)
    text_input, dimensions = _embedding_signature(route, body.model)
    _check_dimensions(body, dimensions)
    array = np.empty(len(texts), dtype=object)
    array[:] = [t.encode() for t in texts]
    spec = route.input(text_input)
    assert spec is not None
    check_tensor(spec, array, "input")
    sched = schedule(state, identity, None, header(scope, TIMEOUT_HEADER.encode()))
    replay = await call.claim_key(
        identity, header(scope, idempotency.HEADER.encode()), "POST", scope["path"], raw
    )
    if replay is not None:
        return replay.status, replay.body, [*replay.headers, idempotency.REPLAYED]
    # All outputs: a rollout plan's other arm may name its embedding output differently.
    parsed = ParsedInfer(None, [text_input], [array], None, set())
    # A client that hangs up while it waits cancels its request, as on OIP.
    routed, outputs = await until_client_leaves(
        receive,
        pipeline.predict(
            state,
            identity,
            route,
            lambda h: header(scope, h.lower().encode()),
            parsed,
            call.observed,
            call.after,
            sched,
        ),
    )
    vectors = [a for n, a in outputs if n != TOKEN_COUNT and a.ndim == 2]
    tokens = [a for n, a in outputs if n == TOKEN_COUNT]
    if len(vectors) != 1 or not tokens:
        raise ApiError(
            502, f"version {routed.route.version} of {body.model!r} gave no embeddings for text"
        )
    _check_dimensions(body, vectors[0].shape[1])  # a width the signature left open
    payload = orjson.dumps(
        _document(body, vectors[0], tokens[0]), option=orjson.OPT_SERIALIZE_NUMPY
    )
    headers = [("x-switchyard-version", str(routed.route.version))]
    if routed.arm:
        headers.append(("x-switchyard-arm", routed.arm))
    headers = await call.keep(200, headers, payload)
    return 200, payload, headers


def _parse(raw: bytes) -> tuple[EmbeddingsBody, list[str]]:
    try:
        # orjson: it refuses nesting past its depth limit, lone surrogates and NaN.
        data = orjson.loads(raw or b"null")
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    try:
        body = EmbeddingsBody.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}") from None
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise ApiError(400, "input: must not be empty")
    if not all(isinstance(t, str) for t in texts):
        raise ApiError(400, "input: token arrays are not supported; send strings")
    if len(texts) > MAX_INPUTS:
        raise ApiError(400, f"input: at most {MAX_INPUTS} strings per request")
    if any(t == "" for t in texts):
        raise ApiError(400, "input: strings must not be empty")
    return body, [t for t in texts if isinstance(t, str)]


def _embedding_signature(route: Route, model: str) -> tuple[str, int]:
    """The text input and the embedding width (-1: not declared) of an embedding model's
    version."""
    if route.task != TaskKind.EMBEDDING:
        raise ApiError(
            400, f"model {model!r} is a {route.task} model; /v1/embeddings serves embedding models"
        )
    vectors = [o for o in route.outputs if o["name"] != TOKEN_COUNT and len(o["shape"]) == 2]
    if len(route.inputs) != 1 or not route.inputs[0].text or len(vectors) != 1:
        raise ApiError(
            400,
            f"model {model!r} does not take text and give one [batch, dimensions] output: "
            "upload its ONNX graph with a tokenizer",
        )
    return route.inputs[0].name, vectors[0]["shape"][1]


def _check_dimensions(body: EmbeddingsBody, width: int) -> None:
    """Embeddings are not shortened: ``dimensions`` may only name the model's own width."""
    if body.dimensions is not None and width >= 0 and body.dimensions != width:
        raise ApiError(
            400,
            f"dimensions: model {body.model!r} gives {width}-dimensional embeddings and "
            "cannot shorten them; leave dimensions out",
        )


def _document(body: EmbeddingsBody, vectors: np.ndarray, tokens: np.ndarray) -> dict[str, Any]:
    vectors = vectors.astype("<f4", copy=False)
    data: list[dict[str, Any]] = []
    for i, row in enumerate(vectors):
        # base64: the little-endian float32 bytes, as OpenAI sends them (its SDK decodes so).
        embedding: Any = (
            base64.b64encode(row.tobytes()).decode() if body.encoding_format == "base64" else row
        )
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    used = int(tokens.sum())
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": used, "total_tokens": used},
    }
