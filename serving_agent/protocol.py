"""Wire protocol between the platform and a serving agent.

Control messages are JSON text frames validated by the pydantic models below. Inference
requests and replies are binary frames: a 4-byte big-endian header length, the JSON header,
then the raw little-endian tensor bytes in header order. Raw bytes avoid re-encoding numbers as
JSON on both hops. Nothing here is ever unpickled.

One binary websocket message carries one or more frames, each behind its own 4-byte length
(``pack_frames``/``unpack_frames``): under load both sides coalesce the frames ready in one
event-loop turn into one message, which measured as the largest single saving on the data path
(one socket write and one websocket parse per batch instead of per request).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec
import numpy as np
from pydantic import BaseModel, Field, TypeAdapter

AGENT_WS_PATH = "/ws/agent/"
CLOSE_UNAUTHORIZED = 4401  # websocket close code: unknown or disabled node token
CLOSE_BAD_MESSAGE = 4400  # websocket close code: a message that breaks the protocol
# websocket close code: the agent claimed what was not assigned to it (a version, or a
# deployment outside its node's tenant scope); the platform trusts nothing more on that socket
CLOSE_CLAIM_REFUSED = 4403
ARTIFACT_PATH = "/api/v1/agent/artifacts/{version_id}"
TOKENIZER_PATH = "/api/v1/agent/tokenizers/{version_id}"

# Open Inference Protocol v2 datatypes and their numpy equivalents. A BYTES tensor is a numpy
# object array of ``bytes`` (what tritonclient sends and returns); a model's str outputs (ONNX
# string tensors, class labels) are carried as their UTF-8 bytes (``wire_array``).
OIP_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype("bool"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype("O"),
}
NUMPY_TO_OIP: dict[np.dtype, str] = {v: k for k, v in OIP_TO_NUMPY.items()}


class TensorParameters(BaseModel):
    """What the registry read from the artifact about a tensor beyond its type and shape."""

    # A classifier's probabilities: the class label of each column. The artifact gives them as
    # one {label: probability} map per row (ONNX's ZipMap); the agent returns the matrix.
    labels: list[int] | list[str] | None = None


class TensorSpec(BaseModel):
    """A named tensor in a signature; -1 in ``shape`` is a dynamic dimension."""

    name: str
    datatype: str
    shape: list[int]
    parameters: TensorParameters | None = None


class GenerationLimits(BaseModel):
    """Hard limits of a generative version, per replica: past them a request is refused."""

    max_input_tokens: int = 512
    max_output_tokens: int = 256
    max_streams: int = 16  # concurrent streams decoded together on one replica
    # streams that may wait for a slot (admitted best priority class first); 0: max_streams
    max_waiting: int = Field(default=0, ge=0)


class VersionSpec(BaseModel):
    """One model version an agent must serve.

    Versions of a format that answers batches (``onnx``, ``torch``) answer ``InferRequest``
    frames. Versions of a format that streams (``textgen``, ``hf``; ``serving_agent.formats``)
    answer ``GenerateRequest`` frames with a stream of ``TokenChunk``s (in ``TokenBatch``
    frames, one per engine step) and one ``GenerateDone`` (or an ``InferError``).
    """

    version_id: int
    model: str
    version: int
    sha256: str
    artifact_url: str
    # A key of ``serving_agent.formats.FORMATS`` (the platform's ``registry.formats`` holds the
    # same): an agent that lacks it fails this version's load, not the whole assignment.
    format: str = "onnx"
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int = 32
    max_queue_delay_ms: float = 0.0
    max_queue: int = 256
    # Requests one caller (a tenant's API key) may hold queued or running on this version
    # while another caller has work on it (0: half of ``max_queue``), so a flooding caller
    # cannot fill the queue.
    max_queue_per_caller: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    generation: GenerationLimits | None = None  # set for textgen versions
    # The platform's estimate of the memory one loaded copy needs (0: unknown, the agent
    # estimates from the artifact's size). Agents measure the real footprint when they load.
    memory_bytes: int = 0
    # NaN marks a missing value in float inputs (tree models); infinities stay refused.
    allow_missing: bool = False
    # A tokenizer.json for the version's BYTES text inputs ("" when none), fetched and checked
    # against its hash like the artifact.
    tokenizer_url: str = ""
    tokenizer_sha256: str = ""
    # The version's tenant: a ``python`` package's worker runs as that tenant's own uid, so no
    # two tenants' code shares a uid on a node.
    tenant_id: int = 0


# Platform -> agent ----------------------------------------------------------------------------


class Assign(BaseModel):
    """The full set of versions the agent must serve; anything else it holds is unloaded."""

    type: Literal["assign"] = "assign"
    versions: list[VersionSpec]
    heartbeat_s: float = 5.0


# Links to every gateway process: requests reach the agent in the process that received them.
MAX_LINKS = 256
MAX_LINK_URL = 300


class Links(BaseModel):
    """The other gateway processes' link addresses, and the session to attach there. The
    agent keeps one data link to each (and drops those no longer listed); the connection this
    arrives on already serves the process that sent it."""

    type: Literal["links"] = "links"
    session: int
    urls: list[Annotated[str, Field(max_length=MAX_LINK_URL, pattern=r"^wss?://")]] = Field(
        default_factory=list, max_length=MAX_LINKS
    )


# Agent -> platform ----------------------------------------------------------------------------


class Gpu(BaseModel):
    name: str
    memory_bytes: int = 0


class Hello(BaseModel):
    """First message after connecting: the node's facts."""

    type: Literal["hello"] = "hello"
    agent_version: str
    host: str
    cpu_count: int
    memory_bytes: int
    gpus: list[Gpu] = Field(default_factory=list)
    providers: list[str] = Field(default_factory=list)
    # The cluster Deployment this replica was started for (None: a node run by hand).
    deployment: str | None = None
    # Memory this agent may fill with loaded versions (accelerator memory on a GPU node).
    memory_budget_bytes: int = 0
    # The agent serves grouped infer frames (``InferRequest.members``); a gateway sends an
    # agent that does not say so one frame per request.
    groups: bool = False


class Attach(BaseModel):
    """First message on a data link (and again when the agent's session changes): the
    session, opened by the agent's hello on its main connection, whose versions it serves.
    Nothing else is claimed here: which versions are ready comes from that session."""

    type: Literal["attach"] = "attach"
    session: int
    groups: bool = False  # as ``Hello.groups``


class Detach(BaseModel):
    """On a data link the agent retires (its gateway process now holds the agent's main
    connection, or is no longer listed): send nothing new on it. The requests already sent on
    it are answered on it; then the agent closes it. Without this, closing the link failed the
    requests in flight on it (502) at every move of the main connection."""

    type: Literal["detach"] = "detach"


VersionState = Literal["loading", "ready", "failed", "unloaded", "evicted"]


class VersionStatus(BaseModel):
    """A version's load state on this agent; the gateway routes only to ``ready`` ones.

    ``evicted``: unloaded by the agent itself to make room for another assigned version (it was
    the least recently used cold one); it stays unloaded until the platform assigns it again.
    """

    type: Literal["status"] = "status"
    version_id: int
    state: VersionState
    detail: str = ""
    provider: str = ""
    memory_bytes: int = 0  # with ``ready``: the footprint measured while loading


class VersionLoad(BaseModel):
    """One loaded version in a heartbeat: what it holds and how busy it is."""

    version_id: int
    memory_bytes: int = 0  # footprint measured while loading
    queue_depth: int = 0
    in_flight: int = 0
    requests_total: int = 0
    idle_s: float | None = None  # since its last request (None: never used)
    load_s: float = 0.0  # download to ready, warm-up included
    # Since the version loaded on this agent (usage, chargeback and right-sizing take deltas
    # between heartbeats): the CPU time its model runs took (thread CPU time, every thread of
    # the runtime), the wall time of runs on an accelerator, the model runs and the rows they
    # took (batch occupancy), the wall time of all runs, and the time requests spent queued
    # before their run, summed over requests.
    cpu_s_total: float = 0.0
    accel_s_total: float = 0.0
    runs_total: int = 0
    run_rows_total: int = 0
    run_s_total: float = 0.0
    queue_wait_s_total: float = 0.0


class GpuUse(BaseModel):
    index: int
    utilization_pct: float = 0.0
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0


class Heartbeat(BaseModel):
    type: Literal["heartbeat"] = "heartbeat"
    queue_depth: int = 0
    in_flight: int = 0
    # Requests queued or running on average since the previous heartbeat (Little's law): the
    # autoscaler's load signal, which an instant's queue depth and in-flight count under-read.
    load_avg: float = 0.0
    requests_total: int = 0
    errors_total: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    # Generation (textgen versions): streams decoding now, decode steps run, the largest batch
    # one step decoded since the agent started, streams cancelled, tokens generated.
    streams_active: int = 0
    decode_steps_total: int = 0
    max_decode_batch: int = 0
    streams_cancelled_total: int = 0
    tokens_generated_total: int = 0
    # Placement and the fleet pages: the memory budget, what loaded versions use, each loaded
    # version's load, versions evicted to make room, and GPU use when the node has GPUs.
    memory_budget_bytes: int = 0
    memory_used_bytes: int = 0
    versions: list[VersionLoad] = Field(default_factory=list)
    evicted: list[int] = Field(default_factory=list)
    gpus: list[GpuUse] = Field(default_factory=list)
    # Rows per model run since the agent started: counts per bucket of BATCH_SIZE_BOUNDS (the
    # last bucket is open-ended), and their sum; the platform exports them as a histogram.
    batch_size_counts: list[int] = Field(default_factory=list)
    batch_rows_total: int = 0
    # The scheduler, since the agent started: requests dropped past their deadline before
    # compute, removed from the queue because their caller gave up, and shed for load
    # (refused, or evicted from a full queue by higher-priority or fairer work).
    expired_total: int = 0
    cancelled_total: int = 0
    shed_total: int = 0


AgentMessage = Annotated[
    Hello | Attach | Detach | VersionStatus | Heartbeat, Field(discriminator="type")
]
agent_message = TypeAdapter(AgentMessage)


# Upper bounds of the batch-size histogram buckets (rows per model run).
BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# Binary inference frames --------------------------------------------------------------------
# Frame headers are msgspec structs: typed and validated like the pydantic messages above, but
# measured ~4x cheaper per request (bench/frame_bench.py), which matters on the hot path.


class FrameTensor(msgspec.Struct, frozen=True):
    name: str
    datatype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]  # concrete: a frame has no dynamic dims


# Priority classes, best first: the agent's batcher serves a better class strictly first.
# Shadow copies always travel as ``shadow`` and are shed first.
PRIORITY_CLASSES = ("critical", "interactive", "batch", "shadow")
CRITICAL, INTERACTIVE, BATCH, SHADOW = range(len(PRIORITY_CLASSES))
# The longest budget an agent honours; a larger one (or none) is clamped to it.
MAX_BUDGET_MS = 3_600_000.0


class Member(msgspec.Struct, array_like=True):
    """One request of a grouped frame: its own id, the rows it holds of the frame's inputs
    (in the order of ``InferRequest.members``) and its trace."""

    id: int
    rows: Annotated[int, msgspec.Meta(ge=1)]
    trace: str = ""


class InferRequest(msgspec.Struct, tag="infer", tag_field="type"):
    id: int
    version_id: int
    inputs: list[FrameTensor]
    outputs: list[str] | None = None  # names the caller asked for; None means all
    trace: str = ""  # the W3C traceparent of the platform's span, for the agent's logs
    # Scheduling: whose request it is (the tenant and its API key: the batcher shares a
    # version fairly between callers), its class, and the time left to answer it in ms,
    # counted from the frame's arrival (clocks need not agree). A request still queued when
    # its budget runs out is answered "expired" and never run.
    tenant: Annotated[int, msgspec.Meta(ge=0)] = 0
    key: Annotated[int, msgspec.Meta(ge=0)] = 0
    priority: Annotated[int, msgspec.Meta(ge=0, le=len(PRIORITY_CLASSES) - 1)] = INTERACTIVE
    budget_ms: Annotated[float, msgspec.Meta(ge=0)] | None = None
    # A group: requests of one caller for this version sent in one event-loop turn, their
    # inputs concatenated along axis 0 in this order. ``id`` names the group (a cancel of it,
    # the one reply); the agent answers it with one result of the concatenated rows, or one
    # error for all, or, when members fare differently, one reply per member id. Empty: one
    # request, ``id`` its own.
    members: list[Member] = []


class InferResult(msgspec.Struct, tag="result", tag_field="type"):
    id: int
    outputs: list[FrameTensor]
    # Where the time went on the agent: waiting for a batch, and the model run it was in.
    queue_ms: float = 0.0
    compute_ms: float = 0.0


# "over_share": the caller holds more than its share of a shared version's queue (429);
# "overloaded": the queue is full of better or fairer work (503); "expired": the budget ran
# out before compute; "cancelled": the caller gave up (a ``Cancel`` frame) before compute.
# "gone": the agent, or the gateway process holding its connection, went away mid-request (sent
# between gateway processes, never by an agent): 502, a failure of the path, not of the model.
ErrorCode = Literal[
    "overloaded",
    "over_share",
    "not_loaded",
    "bad_input",
    "expired",
    "cancelled",
    "internal",
    "gone",
]


class InferError(msgspec.Struct, tag="error", tag_field="type"):
    id: int
    code: ErrorCode
    message: str


# Generation frames (no tensors). Platform -> agent: ``GenerateRequest``, ``CancelGenerate``
# (which also cancels a queued infer request).
# Agent -> platform: ``TokenChunk`` (one or more tokens of text), then ``GenerateDone``; or an
# ``InferError`` with the request's id ("bad_input" past the version's token limits,
# "overloaded" past its concurrent and waiting streams, "expired" past its admission budget).
# An agent sends the chunks of one engine step as one ``TokenBatch`` frame per connection; the
# platform also takes single ``TokenChunk``s.


class ChatTurn(msgspec.Struct):
    role: str
    content: str


class GenerateRequest(msgspec.Struct, tag="generate", tag_field="type"):
    id: int
    version_id: int
    prompt: str
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 64
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 1.0  # 0: greedy
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: every token may be sampled
    stop: list[str] = []
    seed: int | None = None
    trace: str = ""  # the W3C traceparent of the platform's span, for the agent's logs
    # A chat, rendered by the agent with the model's own chat template (hf versions); when
    # set, ``prompt`` is ignored.
    messages: list[ChatTurn] = []
    # Scheduling, as ``InferRequest``'s: a stream waiting for a slot is admitted best class
    # first (FIFO within a class). ``budget_ms`` is the deadline of its admission (its first
    # token), counted from the frame's arrival: one still waiting past it is answered
    # "expired" and never run. Defaults keep an older platform's frames valid, and an older
    # agent ignores the fields (msgspec skips unknown fields).
    priority: Annotated[int, msgspec.Meta(ge=0, le=len(PRIORITY_CLASSES) - 1)] = INTERACTIVE
    budget_ms: Annotated[float, msgspec.Meta(ge=0)] | None = None


class CancelGenerate(msgspec.Struct, tag="cancel", tag_field="type"):
    """The caller gave up on this request id: a stream stops decoding at its next step, an
    infer request still queued is removed and answered "cancelled" (one already running
    finishes; its answer is dropped)."""

    id: int


class TokenChunk(msgspec.Struct, tag="tokens", tag_field="type"):
    id: int
    text: str
    # How many tokens this chunk's text holds; never negative, since clients are billed by it.
    tokens: Annotated[int, msgspec.Meta(ge=0)]


class TokenBatch(msgspec.Struct, tag="token_batch", tag_field="type"):
    """Every stream's new text from one engine step, for one connection: one frame header to
    encode and decode per step instead of one per stream, which is what the platform paid per
    token. Chunks of one stream keep their order."""

    chunks: Annotated[list[TokenChunk], msgspec.Meta(min_length=1)]


FinishReason = Literal["stop", "length", "cancelled"]


class GenerateDone(msgspec.Struct, tag="done", tag_field="type"):
    id: int
    finish_reason: FinishReason
    input_tokens: int
    output_tokens: int
    ttft_ms: float  # from the request's arrival at the agent to its first token
    decode_ms: float  # from the first token to the last


FrameHeader = (
    InferRequest
    | InferResult
    | InferError
    | GenerateRequest
    | CancelGenerate
    | TokenChunk
    | TokenBatch
    | GenerateDone
)
_decode_header = msgspec.json.Decoder(FrameHeader).decode
_encode_header = msgspec.json.Encoder().encode

_LEN = struct.Struct("!I")
# A BYTES element's length prefix: 4 bytes little-endian, as in Triton's binary extension, KServe's
# gRPC raw contents and these frames.
BYTES_LEN = struct.Struct("<I")


def wire_array(array: np.ndarray) -> np.ndarray:
    """``array`` as it travels: numeric arrays unchanged; str, numpy string and object arrays
    as an object array of ``bytes`` (str as UTF-8), the one form of a BYTES tensor."""
    if array.dtype.kind not in "OUS":
        return array
    out = np.empty(array.shape, dtype=object)
    flat = out.reshape(-1)
    for i, value in enumerate(array.reshape(-1).tolist()):
        if isinstance(value, str):
            flat[i] = value.encode()
        elif isinstance(value, bytes):
            flat[i] = value
        else:
            raise TypeError(f"a BYTES tensor holds {type(value).__name__}, not str or bytes")
    return out


def pack_bytes(array: np.ndarray) -> bytes:
    """A BYTES tensor's elements, each behind its 4-byte little-endian length, row-major."""
    parts: list[bytes] = []
    for value in wire_array(array).reshape(-1).tolist():
        parts.append(BYTES_LEN.pack(len(value)))
        parts.append(value)
    return b"".join(parts)


def unpack_bytes(
    data: bytes | memoryview, offset: int, count: int, end: int
) -> tuple[np.ndarray, int]:
    """``count`` length-prefixed elements read from ``data[offset:end]``: a flat object array
    of ``bytes`` and the offset past the last one. ``ValueError`` names what does not fit: a
    length that runs past ``end``, or fewer bytes than ``count`` prefixes need (checked before
    reading, so a hostile shape costs no loop)."""
    if count * BYTES_LEN.size > end - offset:
        raise ValueError(f"{count} elements need at least {count * BYTES_LEN.size} bytes")
    view = memoryview(data)
    out = np.empty(count, dtype=object)
    for i in range(count):
        if offset + BYTES_LEN.size > end:
            raise ValueError(f"element {i}'s length runs past the end of the tensor")
        (size,) = BYTES_LEN.unpack_from(view, offset)
        offset += BYTES_LEN.size
        if offset + size > end:
            raise ValueError(f"element {i} declares {size} bytes, past the end of the tensor")
        out[i] = bytes(view[offset : offset + size])
        offset += size
    return out, offset


class FrameError(ValueError):
    """A binary frame that cannot be decoded."""


def encode_frame(header: FrameHeader, arrays: Sequence[np.ndarray] = ()) -> bytes:
    """Header JSON plus the arrays' bytes, in the order the header lists them."""
    head = _encode_header(header)
    parts = [_LEN.pack(len(head)), head]
    parts.extend(
        pack_bytes(a) if a.dtype.kind in "OUS" else np.ascontiguousarray(a).tobytes()
        for a in arrays
    )
    return b"".join(parts)


def decode_frame(data: bytes) -> tuple[FrameHeader, list[np.ndarray]]:
    """Parse a frame; numeric arrays are zero-copy views into ``data``, BYTES tensors object
    arrays of ``bytes``."""
    if len(data) < _LEN.size:
        raise FrameError("frame shorter than its length prefix")
    (head_len,) = _LEN.unpack_from(data)
    end = _LEN.size + head_len
    if end > len(data):
        raise FrameError("frame header runs past the end of the frame")
    try:
        header = _decode_header(data[_LEN.size : end])
    except msgspec.MsgspecError as exc:
        raise FrameError(f"bad frame header: {exc}") from exc
    tensors = header.inputs if isinstance(header, InferRequest) else getattr(header, "outputs", [])
    arrays: list[np.ndarray] = []
    offset = end
    view = memoryview(data)
    for t in tensors:
        dtype = OIP_TO_NUMPY.get(t.datatype)
        if dtype is None:
            raise FrameError(f"tensor {t.name!r}: unsupported datatype {t.datatype}")
        count = math.prod(t.shape)
        if t.datatype == "BYTES":
            try:
                flat, offset = unpack_bytes(view, offset, count, len(data))
            except ValueError as exc:
                raise FrameError(f"tensor {t.name!r}: {exc}") from None
            arrays.append(flat.reshape(t.shape))
            continue
        nbytes = count * dtype.itemsize
        if offset + nbytes > len(data):
            raise FrameError(f"tensor {t.name!r}: frame holds fewer bytes than its shape needs")
        arrays.append(np.frombuffer(view[offset : offset + nbytes], dtype=dtype).reshape(t.shape))
        offset += nbytes
    if offset != len(data):
        raise FrameError("frame has trailing bytes after its tensors")
    return header, arrays


def unbatch(header: FrameHeader) -> list[FrameHeader]:
    """What each stream gets from a frame: a ``TokenBatch``'s chunks, or the frame itself."""
    return list(header.chunks) if isinstance(header, TokenBatch) else [header]


def error_frame(request_id: int, code: ErrorCode, message: str) -> bytes:
    """The frame answering a request that failed: an ``InferError`` with its code and why."""
    return encode_frame(InferError(id=request_id, code=code, message=message))


def tensor_of(name: str, array: np.ndarray) -> FrameTensor:
    """The frame header entry describing ``array`` (a supported numeric dtype, or str, bytes
    or object for BYTES)."""
    if array.dtype.kind in "OUS":
        return FrameTensor(name, "BYTES", list(array.shape))
    return FrameTensor(name, NUMPY_TO_OIP[array.dtype.newbyteorder("<")], list(array.shape))


def pack_frames(frames: list[bytes]) -> bytes:
    """One websocket message holding several frames, each prefixed with its length."""
    parts: list[bytes] = []
    for frame in frames:
        parts.append(_LEN.pack(len(frame)))
        parts.append(frame)
    return b"".join(parts)


def unpack_frames(message: bytes) -> list[bytes]:
    """The frames of one websocket message (``FrameError`` if the lengths do not add up)."""
    frames: list[bytes] = []
    offset, end = 0, len(message)
    while offset < end:
        if offset + _LEN.size > end:
            raise FrameError("message ends inside a frame length")
        (size,) = _LEN.unpack_from(message, offset)
        offset += _LEN.size
        if offset + size > end:
            raise FrameError("frame runs past the end of the message")
        frames.append(message[offset : offset + size])
        offset += size
    return frames
