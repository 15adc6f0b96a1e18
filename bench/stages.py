"""Server CPU per request by stage: the gateway's and the agent's CPU time, sampled by
``bench/cpu_sampler.py`` (which each runs under with ``oip_bench.py --profile``), each sample
given to the stage of the innermost platform function on its stack, divided by the requests
served.

The stages are the issue's: what a request costs from the socket to the model and back, one row
each; "event loop" is the server's and asyncio's own scheduling between them, "other" what
matches no rule (start-up threads, the refresh loop).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

# (stage, file suffix, function or None for any function in the file). Searched from a
# sample's innermost frame outwards: the first frame that matches one decides. So time in a
# library called from a stage's function (orjson under the codec, ONNX Runtime under the
# runner) is that stage's.
GATEWAY_RULES: list[tuple[str, str, str | None]] = [
    ("log sample", "gateway/predlog.py", None),
    ("metrics", "gateway/metrics.py", None),
    ("metrics", "gateway/state.py", "observe"),
    ("usage", "monitoring/traffic.py", None),
    ("usage", "gateway/inference.py", "_version_outcome"),
    ("idempotency", "gateway/idempotency.py", None),
    ("frame back", "gateway/consumers.py", None),
    ("frame back", "gateway/dispatch.py", "_wait"),
    ("frame back", "serving_agent/protocol.py", "decode_frame"),
    ("frame back", "serving_agent/protocol.py", "unpack_frames"),
    ("frame back", "serving_agent/protocol.py", "array_of"),
    ("frame to the agent", "serving_agent/protocol.py", None),
    ("frame to the agent", "gateway/dispatch.py", None),
    ("quota and budget", "gateway/admission.py", "rate_limit"),
    ("quota and budget", "tenants/ratelimit.py", None),
    ("quota and budget", "gateway/admission.py", "check_budget"),
    ("quota and budget", "gateway/admission.py", "in_flight"),
    ("quota and budget", "gateway/admission.py", "hold_in_flight"),
    ("quota and budget", "gateway/admission.py", "release_in_flight"),
    ("quota and budget", "gateway/state.py", "enter"),
    ("quota and budget", "gateway/state.py", "leave"),
    ("authenticate", "gateway/admission.py", "authenticate"),
    ("authenticate", "gateway/state.py", "identify"),
    ("authenticate", "tenants/keys.py", None),
    ("authenticate", "platform_site/tokens.py", None),
    ("route", "gateway/admission.py", "resolve"),
    ("route", "gateway/admission.py", "parse_version"),
    ("route", "gateway/state.py", "route"),
    ("route", "gateway/state.py", "split"),
    ("route", "gateway/arms.py", None),
    ("route", "gateway/routes.py", None),
    ("validate and decode", "gateway/oip_codec.py", "parse_infer"),
    ("validate and decode", "gateway/oip_codec.py", "_load_json"),
    ("validate and decode", "gateway/oip_codec.py", "_parse_input"),
    ("validate and decode", "gateway/oip_codec.py", "_parse_outputs"),
    ("validate and decode", "gateway/oip_codec.py", "_from_json_data"),
    ("validate and decode", "gateway/oip_codec.py", "_shaped"),
    ("validate and decode", "gateway/checks.py", None),
    ("validate and decode", "gateway/parsed.py", None),
    ("validate and decode", "gateway/scheduling.py", None),
    ("validate and decode", "gateway/asgi_io.py", "read_body"),
    ("validate and decode", "gateway/bytes_tensors.py", None),
    ("encode", "gateway/oip_codec.py", None),
    ("encode", "gateway/asgi_io.py", None),
    ("run", "gateway/inference.py", None),  # the dispatch's own bookkeeping (breaker, ready)
    ("run", "gateway/graphs.py", None),
    ("run", "gateway/pipeline.py", None),
    ("run", "gateway/state.py", "ready"),
    ("accept and parse", "gateway/frontdoor.py", None),
    ("accept and parse", "gateway/tracing.py", None),
    ("accept and parse", "gateway/oip.py", None),
    ("accept and parse", "platform_site/asgi.py", None),
    ("accept and parse", "gateway/http_bounds.py", None),
    ("encode", "gateway/drain.py", "_OneWriteCycle.send"),  # the reply's one write
    ("encode", "gateway/drain.py", "write"),
    ("accept and parse", "gateway/drain.py", None),
    ("accept and parse", "channels/routing.py", None),
]
# Where no platform function is on the stack: the server's and the event loop's own work.
GATEWAY_FALLBACKS: list[tuple[str, str, str | None]] = [
    ("accept and parse", "uvicorn/protocols/http", None),
    ("frame back", "uvicorn/protocols/websockets", None),
    ("frame back", "websockets/", None),
    ("frame back", "channels/", None),
    ("accept and parse", "uvicorn/", None),
    ("event loop", "asyncio/", None),
]

AGENT_RULES: list[tuple[str, str, str | None]] = [
    ("run", "onnxruntime/", None),
    ("run", "serving_agent/_serving.py", None),
    ("run", "serving_agent/runtimes.py", None),
    ("queue and batch", "serving_agent/_batcher.py", None),
    ("frame back", "serving_agent/protocol.py", "encode_frame"),
    ("frame back", "serving_agent/protocol.py", "pack_frames"),
    ("frame back", "serving_agent/protocol.py", "tensor_of"),
    ("frame back", "serving_agent/_connection.py", "send_frames"),
    ("frame back", "serving_agent/_connection.py", "send"),
    ("frame to the agent", "serving_agent/protocol.py", None),
    ("frame to the agent", "serving_agent/_connection.py", None),
    ("frame to the agent", "serving_agent/_links.py", None),
    ("frame to the agent", "serving_agent/_agent.py", None),
    ("frame to the agent", "serving_agent/_versions.py", None),
]
AGENT_FALLBACKS: list[tuple[str, str, str | None]] = [
    ("frame to the agent", "websockets/", None),
    ("event loop", "asyncio/", None),
]
ORDER = [
    "accept and parse",
    "authenticate",
    "quota and budget",
    "route",
    "validate and decode",
    "idempotency",
    "frame to the agent",
    "queue and batch",
    "run",
    "frame back",
    "encode",
    "metrics",
    "log sample",
    "usage",
    "event loop",
    "other",
]


def sampled_command(out: Path, args: list[str]) -> list[str]:
    """``args`` (``python -m module ...``) run under bench/cpu_sampler.py writing to ``out``."""
    python, m, *rest = args
    assert m == "-m", args
    sampler = str(Path(__file__).resolve().parent / "cpu_sampler.py")
    return [python, sampler, "--out", str(out), "-m", *rest]


def _frames(line: str) -> tuple[list[tuple[str, str]], int]:
    """A raw line ``root;...;leaf count`` as [(function, file)] from leaf to root, and its
    count. A frame reads ``function (file:line)``."""
    stack, _, count = line.rpartition(" ")
    frames = []
    for frame in reversed(stack.split(";")):
        function, _, where = frame.partition(" (")
        frames.append((function, where.rsplit(":", 1)[0]))
    return frames, int(count)


def _match(frames: list[tuple[str, str]], rules: list[tuple[str, str, str | None]]) -> str | None:
    for function, where in frames:
        method = function.rpartition(".")[2]  # "AgentPool._wait" matches a rule for "_wait"
        for stage, suffix, name in rules:
            if suffix in where and (name is None or name == function or name == method):
                return stage
    return None


def attribute(raw: str, rules: list, fallbacks: list) -> Counter[str]:
    """CPU (µs) per stage in the sampler's output."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        if not line.strip():
            continue
        frames, count = _frames(line)
        counts[_match(frames, rules) or _match(frames, fallbacks) or "other"] += count
    return counts


def gateway_stages(raw: str) -> Counter[str]:
    return attribute(raw, GATEWAY_RULES, GATEWAY_FALLBACKS)


def agent_stages(raw: str) -> Counter[str]:
    return attribute(raw, AGENT_RULES, AGENT_FALLBACKS)


def table(
    label: str,
    requests: int,
    gateway: Counter[str],
    gateway_ms: float,
    agent: Counter[str],
    agent_ms: float,
) -> str:
    """One row per stage: its CPU per request (µs) in the gateway and the agent, and its share.
    ``gateway``/``agent`` are sampled CPU µs per stage over ``requests`` requests;
    ``gateway_ms``/``agent_ms`` each process's CPU per request read from /proc over the same
    run (sampled time falls short of it by the sampler's own cost and what ran unsampled)."""
    g_sampled = sum(gateway.values()) / max(requests, 1)
    a_sampled = sum(agent.values()) / max(requests, 1)
    total = g_sampled + a_sampled or 1
    lines = [
        f"Server CPU per request by stage, {label}: sampled {g_sampled:.0f} µs in the gateway "
        f"and {a_sampled:.0f} µs in the agent, of {gateway_ms * 1000:.0f} and "
        f"{agent_ms * 1000:.0f} µs read from /proc with the sampler on:",
        "",
        "| stage | gateway µs/req | agent µs/req | total µs/req | share |",
        "| --- | --- | --- | --- | --- |",
    ]
    for stage in ORDER:
        g = gateway.get(stage, 0) / max(requests, 1)
        a = agent.get(stage, 0) / max(requests, 1)
        if round(g) == 0 and round(a) == 0:
            continue
        lines.append(f"| {stage} | {g:.0f} | {a:.0f} | {g + a:.0f} | {(g + a) / total:.0%} |")
    lines.append(f"| **total** | {g_sampled:.0f} | {a_sampled:.0f} | {total:.0f} | 100% |")
    return "\n".join(lines) + "\n"
