"""A step's text as one ``TokenBatch`` frame from the agent, and the gateway's stream inboxes
that merge what a reader has not taken yet: the same text and token counts as one frame per
token, the first chunk never held back, and hostile batches refused on arrival."""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.dispatch import AgentLink, AgentPool, DispatchError, StreamInbox
from serving_agent.protocol import (
    FrameError,
    GenerateDone,
    GenerateRequest,
    TokenBatch,
    TokenChunk,
    decode_frame,
    encode_frame,
    unbatch,
)


def run(coro_fn: Any) -> Any:
    return async_to_sync(coro_fn)()


def raw_frame(header: Any) -> bytes:
    """A frame with any JSON header, as a hostile agent could send it."""
    head = json.dumps(header).encode()
    return struct.pack("!I", len(head)) + head


async def pool_with_link() -> tuple[AgentPool, AgentLink, list[bytes]]:
    sent: list[bytes] = []

    async def send(message: bytes) -> None:
        sent.append(message)

    pool = AgentPool()
    link = AgentLink("fake", send)
    pool.add(link)
    pool.set_ready(link, 1, True)
    return pool, link, sent


async def open_streams(pool: AgentPool, count: int) -> list[StreamInbox]:
    return [
        await pool.open_stream(GenerateRequest(id=0, version_id=1, prompt="x"))
        for _ in range(count)
    ]


async def read_all(stream: StreamInbox) -> list[TokenChunk | GenerateDone]:
    frames: list[TokenChunk | GenerateDone] = []
    while not frames or not isinstance(frames[-1], GenerateDone):
        frames.append(await stream.next(1.0))
    return frames


def test_a_batch_round_trips_and_unbatches_into_its_chunks() -> None:
    batch = TokenBatch([TokenChunk(1, "Call", 4), TokenChunk(2, " me", 3)])
    header, arrays = decode_frame(encode_frame(batch))
    assert header == batch and arrays == []
    assert unbatch(header) == [TokenChunk(1, "Call", 4), TokenChunk(2, " me", 3)]
    done = GenerateDone(1, "length", 2, 7, 1.0, 2.0)
    assert unbatch(done) == [done]


def test_every_stream_of_a_batch_gets_its_own_text_and_tokens() -> None:
    texts = ["Call me Ishmael.", "Some years ago", "never mind how long"]

    async def scenario() -> list[list[TokenChunk | GenerateDone]]:
        pool, link, _ = await pool_with_link()
        streams = await open_streams(pool, 3)
        readers = [asyncio.ensure_future(read_all(s)) for s in streams]
        for step in range(max(map(len, texts))):
            chunks = [
                TokenChunk(s.id, text[step], 1)
                for s, text in zip(streams, texts, strict=True)
                if step < len(text)
            ]
            pool.deliver(link, encode_frame(TokenBatch(chunks)))
            for s, text in zip(streams, texts, strict=True):
                if step == len(text) - 1:
                    done = GenerateDone(s.id, "length", 1, len(text), 1.0, 1.0)
                    pool.deliver(link, encode_frame(done))
            await asyncio.sleep(0)  # readers keep up: one chunk each per step
        return await asyncio.gather(*readers)

    for text, frames in zip(texts, run(scenario), strict=True):
        chunks, done = frames[:-1], frames[-1]
        assert "".join(c.text for c in chunks) == text  # type: ignore[union-attr]
        assert sum(c.tokens for c in chunks) == len(text) == done.output_tokens  # type: ignore[union-attr]


def test_a_reader_that_is_behind_gets_what_waits_as_one_chunk() -> None:
    async def scenario() -> list[TokenChunk | GenerateDone]:
        pool, link, _ = await pool_with_link()
        (stream,) = await open_streams(pool, 1)
        # Three steps' batches arrive before the reader looks; one single chunk too (an agent
        # of the previous protocol sends those).
        for text in ("Call", " me", " Ish"):
            pool.deliver(link, encode_frame(TokenBatch([TokenChunk(stream.id, text, 2)])))
        pool.deliver(link, encode_frame(TokenChunk(stream.id, "mael", 1)))
        pool.deliver(link, encode_frame(GenerateDone(stream.id, "length", 1, 7, 1.0, 1.0)))
        return await read_all(stream)

    merged, done = run(scenario)
    assert merged == TokenChunk(merged.id, "Call me Ishmael", 7)  # type: ignore[union-attr]
    assert isinstance(done, GenerateDone) and done.output_tokens == 7


def test_the_first_chunk_goes_to_a_waiting_reader_at_once() -> None:
    """Merging only joins what already waits: a reader that waits gets each chunk as soon as
    it arrives, never held for more."""

    async def scenario() -> tuple[TokenChunk | GenerateDone, TokenChunk | GenerateDone]:
        pool, link, _ = await pool_with_link()
        (stream,) = await open_streams(pool, 1)
        first = asyncio.ensure_future(stream.next(5.0))
        await asyncio.sleep(0)  # the reader waits
        pool.deliver(link, encode_frame(TokenBatch([TokenChunk(stream.id, "C", 1)])))
        got_first = await asyncio.wait_for(first, 0.5)
        second = asyncio.ensure_future(stream.next(5.0))
        await asyncio.sleep(0)
        pool.deliver(link, encode_frame(TokenBatch([TokenChunk(stream.id, "a", 1)])))
        return got_first, await asyncio.wait_for(second, 0.5)

    first, second = run(scenario)
    assert first.text == "C" and second.text == "a"  # type: ignore[union-attr]


def test_a_silent_stream_times_out_with_504() -> None:
    async def scenario() -> DispatchError:
        pool, _, _ = await pool_with_link()
        (stream,) = await open_streams(pool, 1)
        with pytest.raises(DispatchError) as silent:
            await stream.next(0.05)
        return silent.value

    error = run(scenario)
    assert error.status == 504 and "sent nothing for 0.05 s" in error.message


def test_a_batch_chunk_for_a_request_fails_it_and_others_are_handed_back() -> None:
    """A stream's text cannot answer an infer request (502, as a single chunk does); chunks for
    streams this process does not read come back from ``deliver``, for another process."""

    async def scenario() -> tuple[DispatchError, Any, list[TokenChunk | GenerateDone]]:
        pool, link, _ = await pool_with_link()
        (stream,) = await open_streams(pool, 1)
        request = asyncio.ensure_future(pool.infer(1, [], [], None, 1.0))
        await asyncio.sleep(0)
        (request_id,) = link.pending
        batch = TokenBatch(
            [TokenChunk(request_id, "x", 1), TokenChunk(stream.id, "y", 1), TokenChunk(99, "z", 1)]
        )
        unmatched = pool.deliver(link, encode_frame(batch))
        pool.deliver(link, encode_frame(GenerateDone(stream.id, "length", 1, 1, 1.0, 1.0)))
        with pytest.raises(DispatchError) as failed:
            await request
        return failed.value, unmatched, await read_all(stream)

    failed, unmatched, frames = run(scenario)
    assert failed.status == 502 and "TokenChunk" in failed.message
    assert unmatched == TokenBatch([TokenChunk(99, "z", 1)])
    assert frames[0] == TokenChunk(frames[0].id, "y", 1)


HOSTILE_BATCHES = [
    {"type": "token_batch", "chunks": []},
    {"type": "token_batch"},
    {"type": "token_batch", "chunks": None},
    {"type": "token_batch", "chunks": {"id": 1}},
    {"type": "token_batch", "chunks": [{"type": "tokens", "id": 1, "text": "x", "tokens": -1}]},
    {"type": "token_batch", "chunks": [{"type": "tokens", "id": "1", "text": "x", "tokens": 1}]},
    {"type": "token_batch", "chunks": [{"type": "tokens", "id": 1, "text": 5, "tokens": 1}]},
    {"type": "token_batch", "chunks": [{"type": "tokens", "id": 1, "tokens": 1}]},
    {"type": "token_batch", "chunks": [[1, "x", 1]]},
    {
        "type": "token_batch",
        "chunks": [{"type": "done", "id": 1, "finish_reason": "stop", "input_tokens": 1}],
    },
    {"type": "token_batch", "chunks": [{"type": "token_batch", "chunks": []}]},
    {"type": "tokens", "id": 1, "text": "x", "tokens": -5},
]


@pytest.mark.parametrize("header", HOSTILE_BATCHES)
def test_hostile_batches_are_refused_on_arrival_and_the_stream_goes_on(header: Any) -> None:
    with pytest.raises(FrameError):
        decode_frame(raw_frame(header))

    async def scenario() -> tuple[Any, list[TokenChunk | GenerateDone]]:
        pool, link, _ = await pool_with_link()
        (stream,) = await open_streams(pool, 1)
        refused = pool.deliver(link, raw_frame(header))
        pool.deliver(link, encode_frame(TokenBatch([TokenChunk(stream.id, "ok", 1)])))
        pool.deliver(link, encode_frame(GenerateDone(stream.id, "length", 1, 1, 1.0, 1.0)))
        return refused, await read_all(stream)

    refused, frames = run(scenario)
    assert refused is None
    assert [type(f) for f in frames] == [TokenChunk, GenerateDone]
    assert frames[0].text == "ok"  # type: ignore[union-attr]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
CHUNKISH = st.fixed_dictionaries(
    {"type": st.sampled_from(["tokens", "done", "token_batch", 7])},
    optional={"id": JSON | st.integers(), "text": JSON, "tokens": JSON | st.integers()},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=JSON | st.lists(CHUNKISH | JSON, max_size=5))
def test_fuzzed_batches_are_decoded_well_typed_or_dropped(chunks: Any) -> None:
    """Whatever an agent puts in a batch, the gateway either hands its streams well-typed
    chunks or drops the frame; it never raises."""
    frame = raw_frame({"type": "token_batch", "chunks": chunks})

    async def scenario() -> list[Any]:
        pool, link, _ = await pool_with_link()
        (stream,) = await open_streams(pool, 1)
        pool.deliver(link, frame)
        return list(stream.items)

    try:
        header, _ = decode_frame(frame)
    except FrameError:
        header = None
    items = run(scenario)
    if header is None:
        assert items == []
    else:
        assert isinstance(header, TokenBatch) and header.chunks
        for chunk in header.chunks:
            assert isinstance(chunk, TokenChunk) and isinstance(chunk.id, int)
            assert isinstance(chunk.text, str) and chunk.tokens >= 0
        assert all(isinstance(item, TokenChunk) for item in items)


def test_chunks_for_another_process_are_forwarded_as_a_batch_of_its_own() -> None:
    """Process A's stream is held by an agent connected to process B: B feeds its own stream
    and sends A only A's chunks, which A feeds to its stream; the done frame ends the route."""
    from types import SimpleNamespace

    from gateway.consumers import AgentConsumer

    async def scenario() -> tuple[list, list, list[str]]:
        pool_b, link, _ = await pool_with_link()
        (local,) = await open_streams(pool_b, 1)

        to_b: list[bytes] = []

        async def remote_sender(channel: str, frame: bytes) -> None:
            to_b.append(frame)

        pool_a = AgentPool()
        pool_a.remote, pool_a.remote_sender = {1: ["channel-b"]}, remote_sender
        remote = await pool_a.open_stream(GenerateRequest(id=0, version_id=1, prompt="x"))

        forwarded: list[tuple[str, bytes]] = []

        async def send_remote(channel: str, frame: bytes) -> None:
            forwarded.append((channel, frame))

        consumer = AgentConsumer.__new__(AgentConsumer)
        consumer.link, consumer.state = link, SimpleNamespace(pool=pool_b)
        consumer.remote_replies = {remote.id: "channel-a"}
        consumer._send_remote = send_remote  # type: ignore[method-assign]
        for text in ("Call", " me"):
            chunks = [TokenChunk(local.id, text.upper(), 1), TokenChunk(remote.id, text, 1)]
            batch = TokenBatch(chunks)
            await consumer._reply_frame(encode_frame(batch))
        await consumer._reply_frame(encode_frame(GenerateDone(remote.id, "length", 1, 2, 1.0, 1.0)))
        pool_b.deliver(link, encode_frame(GenerateDone(local.id, "length", 1, 2, 1.0, 1.0)))
        for _, frame in forwarded:
            pool_a.deliver_remote(frame)
        routes = [channel for channel, _ in forwarded] + list(consumer.remote_replies)
        sent = [decode_frame(frame)[0] for _, frame in forwarded]
        assert sent[:2] == [
            TokenBatch([TokenChunk(remote.id, "Call", 1)]),  # only A's chunks go to A
            TokenBatch([TokenChunk(remote.id, " me", 1)]),
        ]
        return await read_all(local), await read_all(remote), routes

    local, remote, channels = run(scenario)
    assert local[0].text == "CALL ME" and remote[0].text == "Call me"  # type: ignore[union-attr]
    assert isinstance(remote[-1], GenerateDone)
    assert channels == ["channel-a"] * 3  # two batches and the done frame; the route is gone
