"""The wire contract's helpers as the agent uses them."""

from __future__ import annotations

from serving_agent.protocol import InferError, decode_frame, error_frame


def test_an_error_frame_decodes_to_the_infer_error_it_names() -> None:
    header, arrays = decode_frame(error_frame(7, "overloaded", "queue full"))
    assert header == InferError(id=7, code="overloaded", message="queue full")
    assert arrays == []
