"""A bounded load generator for OIP v2 over gRPC: N concurrent streams of ModelInfer calls (raw
tensors, as tritonclient sends them) for at most --seconds and at most --requests in all.

Prints requests/s, p50 and p99, and a last line ``BENCH {json}`` in the shape
``bench/infer.lua`` gives wrk's results (requests, duration_us, p50_us, p99_us, errors), so
``bench/oip_bench.py`` reads both the same way. The client is Python (grpc.aio, on uvloop when
installed): pin it to a CPU of its own, and read a high-concurrency run as the client's limit
as much as the server's.

    .venv/bin/python bench/grpc_load.py --key "$KEY" --concurrency 16 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc


def infer_request(model: str, input_name: str, shape: list[int]) -> service_pb2.ModelInferRequest:
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=input_name, datatype="FP32", shape=shape)
    request.raw_input_contents.append(x.tobytes())
    return request


async def load(
    address: str,
    key: str,
    request: service_pb2.ModelInferRequest,
    concurrency: int,
    seconds: float,
    max_requests: int,
) -> dict:
    """Run the streams; latencies of successful calls and the count of failed ones."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    metadata = [("authorization", f"Bearer {key}")]
    budget = [max_requests]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        await stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10)
        start = time.perf_counter()
        deadline = start + seconds

        async def stream() -> None:
            while budget[0] > 0 and time.perf_counter() < deadline:
                budget[0] -= 1
                sent = time.perf_counter()
                try:
                    await stub.ModelInfer(request, metadata=metadata, timeout=30)
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                    continue
                latencies.append(time.perf_counter() - sent)

        await asyncio.gather(*(stream() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    ordered = np.sort(np.array(latencies)) if latencies else np.array([0.0])
    return {
        "requests": len(latencies),
        "duration_us": round(elapsed * 1e6),
        "p50_us": round(float(np.percentile(ordered, 50)) * 1e6),
        "p99_us": round(float(np.percentile(ordered, 99)) * 1e6),
        "errors": sum(errors.values()),
        "error_codes": errors,
    }


def run(
    address: str,
    key: str,
    concurrency: int,
    seconds: float,
    max_requests: int = 10_000_000,
    model: str = "fraud-detector",
    input_name: str = "features",
    shape: tuple[int, ...] = (1, 32),
) -> dict:
    request = infer_request(model, input_name, list(shape))
    coro = load(address, key, request, concurrency, seconds, max_requests)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="127.0.0.1:8001")
    parser.add_argument("--key", required=True, help="the tenant's API key")
    parser.add_argument("--model", default="fraud-detector")
    parser.add_argument("--input", default="features", help="the model's FP32 input")
    parser.add_argument("--shape", default="1,32", help="the input's shape, comma-separated")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent streams")
    parser.add_argument("--seconds", type=float, default=10.0, help="at most this long")
    parser.add_argument("--requests", type=int, default=1_000_000, help="at most this many")
    args = parser.parse_args()
    shape = tuple(int(d) for d in args.shape.split(","))
    result = run(
        args.address,
        args.key,
        args.concurrency,
        args.seconds,
        args.requests,
        args.model,
        args.input,
        shape,
    )
    seconds = result["duration_us"] / 1e6
    print(
        f"{result['requests']} requests in {seconds:.1f} s: "
        f"{result['requests'] / seconds:,.0f} req/s, p50 {result['p50_us'] / 1000:.2f} ms, "
        f"p99 {result['p99_us'] / 1000:.2f} ms, errors {result['errors']} "
        f"{result['error_codes'] or ''}"
    )
    print("BENCH " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
