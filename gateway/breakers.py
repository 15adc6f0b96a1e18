"""Circuit breakers: stop sending work where it keeps failing, and find out when it recovers.

One breaker guards each agent link (an agent that cannot be reached, or does not answer) and
one each version (a version whose every request fails, on whatever agent). ``threshold``
consecutive failures open it: for ``cooldown_s`` nothing is sent there. Then it is half-open:
one request goes through as a probe; its success closes the breaker, its failure opens it for
another cooldown. A probe that never reports (its client left) is given up after a cooldown,
so a breaker can never stay half-open for good.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class Breaker:
    threshold: int = 5
    cooldown_s: float = 5.0
    failures: int = 0  # consecutive
    opened_at: float | None = None
    probe_at: float | None = None  # when the half-open probe went out

    def state(self, now: float | None = None) -> str:
        if self.opened_at is None:
            return CLOSED
        now = time.monotonic() if now is None else now
        return OPEN if now - self.opened_at < self.cooldown_s else HALF_OPEN

    def available(self, now: float) -> bool:
        """Whether a request may be sent now (closed, or half-open with no probe out)."""
        if self.opened_at is None:
            return True
        if now - self.opened_at < self.cooldown_s:
            return False
        return self.probe_at is None or now - self.probe_at >= self.cooldown_s

    def begin(self, now: float) -> None:
        """A request is sent: when half-open it is the probe."""
        if self.opened_at is not None:
            self.probe_at = now

    def retry_after(self, now: float) -> int:
        """Seconds until the next probe may go out (at least 1, for Retry-After)."""
        if self.opened_at is None:
            return 1
        return max(1, math.ceil(self.cooldown_s - (now - self.opened_at)))

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.probe_at = None

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.opened_at is not None or self.failures >= self.threshold:
            # A failed probe (or the threshold reached) opens it for a whole cooldown again.
            self.opened_at = now
            self.probe_at = None
