"""Generation counters for heartbeats, apart from the engine so that the agent can keep and sum
them without importing torch (which only nodes serving textgen versions load)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GenerationStats:
    """An engine's counters (``streams_active`` is its live stream count), or their sum over
    engines: the largest batch is then the largest any engine ran."""

    decode_steps_total: int = 0
    max_decode_batch: int = 0
    streams_cancelled_total: int = 0
    tokens_generated_total: int = 0

    def add(self, other: GenerationStats) -> None:
        self.decode_steps_total += other.decode_steps_total
        self.max_decode_batch = max(self.max_decode_batch, other.max_decode_batch)
        self.streams_cancelled_total += other.streams_cancelled_total
        self.tokens_generated_total += other.tokens_generated_total
