"""Circuit breakers: stop sending work where it keeps failing, and find out when it recovers.

One ``Breaker`` guards each agent link (an agent that cannot be reached, or does not answer)
and one each version (a version whose every request fails, on whatever agent). ``threshold``
consecutive failures open it: for ``cooldown_s`` nothing is sent there. Then it is half-open:
one request goes through as a probe; its success closes the breaker, its failure opens it for
another cooldown. A probe that never reports (its client left) is given up after a cooldown,
so a breaker can never stay half-open for good.

A ``SharedBreaker`` is one such breaker for a dependency the whole process calls (a Redis
server, the database): the first failure opens it for every caller in every thread at once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

log = logging.getLogger(__name__)


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


class SharedBreaker:
    """The breaker of one dependency for the whole process: one failure opens it, for
    ``retry_s``; then a single caller probes while the others still keep away. Its callers run
    in any thread (the database is called from several), so each step holds a lock."""

    def __init__(self, what: str, retry_s: float) -> None:
        self.what = what  # for the log: "Redis at 127.0.0.1:6379", "the database 'default'"
        self._breaker = Breaker(threshold=1, cooldown_s=retry_s)
        self._lock = threading.Lock()

    def available(self) -> bool:
        """Whether a call may go now (it does not claim the probe: ``claim`` does)."""
        return self._breaker.available(time.monotonic())

    def claim(self) -> bool:
        """Whether this call may go now; while half-open, the one call answered True is the
        probe and every other is answered False until it reports."""
        with self._lock:
            now = time.monotonic()
            if not self._breaker.available(now):
                return False
            self._breaker.begin(now)
            return True

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            was_closed = self._breaker.opened_at is None
            self._breaker.failure(time.monotonic())
        if was_closed:
            log.warning(
                "%s is unreachable (%r); calls fail fast, one probe every %g s",
                self.what,
                exc,
                self._breaker.cooldown_s,
            )

    def succeeded(self) -> None:
        if self._breaker.opened_at is None:
            return  # the common case, closed: no lock taken
        with self._lock:
            was_open = self._breaker.opened_at is not None
            self._breaker.success()
        if was_open:
            log.info("%s answers again", self.what)

    def retry_after(self) -> int:
        """Seconds until the next probe (at least 1): the ``Retry-After`` of a refused call."""
        return self._breaker.retry_after(time.monotonic())
