"""Hypothesis-generated frames on the text-generation websocket
(``/ws/v1/models/{name}/generate``): every frame but a cancel gets an error frame naming the
problem (the model here does not generate text, so no frame starts a generation), and the socket
stays open: no frame closes it with 1011 (a server error) or at all."""

from __future__ import annotations

import json

import orjson
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from hypothesis import given
from hypothesis import strategies as st

from platform_site.routing import websocket_urlpatterns
from tests.fuzz.conftest import Platform
from tests.fuzz.strategies import HOSTILE_LITERALS, fuzz, json_values, numbers, text

generate = st.fixed_dictionaries(
    {"type": st.just("generate")},
    optional={
        "id": text | json_values,
        "prompt": text | json_values,
        "max_tokens": numbers | json_values,
        "temperature": numbers | json_values,
        "top_p": numbers | json_values,
        "stop": st.lists(text, max_size=5) | json_values,
        "seed": numbers | json_values,
        "routing_key": text | json_values,
    },
)
other = st.fixed_dictionaries(
    {"type": st.sampled_from(["bogus", "", "GENERATE"]) | json_values},
    optional={"id": text | json_values},
)


def answered(frame: str) -> bool:
    """Frames that must get an error frame: not empty (no text frame at all), not a cancel
    (answered by nothing) and not an auth (a bad key closes the socket, as documented)."""
    try:
        message = orjson.loads(frame)
    except orjson.JSONDecodeError:
        return frame != ""
    return not (isinstance(message, dict) and message.get("type") in ("cancel", "auth"))


frames = (
    (generate | other | json_values).map(lambda v: json.dumps(v, allow_nan=True))
    | st.sampled_from(HOSTILE_LITERALS)
    | text
).filter(answered)


@fuzz(60)
@given(
    sent=st.lists(frames, max_size=5),
    hostile=st.sampled_from(HOSTILE_LITERALS),
    at=st.integers(min_value=0, max_value=5),
)
def test_every_frame_is_answered_and_none_closes_the_socket(
    platform: Platform, sent: list[str], hostile: str, at: int
) -> None:
    sent = [*sent[:at], hostile, *sent[at:]]  # one frame no JSON encoder writes, every time

    async def scenario() -> None:
        headers = [(b"authorization", f"Bearer {platform.key}".encode())]
        socket = WebsocketCommunicator(
            URLRouter(websocket_urlpatterns), "/ws/v1/models/clf/generate", headers=headers
        )
        connected, _ = await socket.connect()
        assert connected
        try:
            for frame in sent:
                await socket.send_to(text_data=frame)
                reply = await socket.receive_output(timeout=5)
                assert reply["type"] == "websocket.send", (frame[:80], reply)
                answer = json.loads(reply["text"])
                assert answer["type"] == "error" and answer["message"], answer
        finally:
            await socket.disconnect()

    async_to_sync(scenario)()
