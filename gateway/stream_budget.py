"""Each tenant's text-generation budgets in one gateway process: concurrent streams, and prompt
plus generated tokens per minute. Kept in process like the embedded rate limiter: with several
gateway processes, each one enforces the tenant's numbers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tenants.keys import KeyIdentity


class BudgetExceeded(Exception):
    def __init__(self, message: str, wait_s: float):
        super().__init__(message)
        self.wait_s = wait_s


@dataclass
class TokenBudget:
    """Tokens per minute as a bucket that may go into debt: a stream is admitted while the
    bucket has tokens, and what it generates is charged as it is generated."""

    per_minute: int
    tokens: float = -1.0
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = float(self.per_minute)

    def refill(self, now: float) -> None:
        rate = self.per_minute / 60.0
        self.tokens = min(self.per_minute, self.tokens + (now - self.updated) * rate)
        self.updated = now


class TenantStreams:
    """Each tenant's concurrent streams and tokens per minute in this gateway process."""

    def __init__(self) -> None:
        self.active: dict[int, int] = {}
        self._budgets: dict[int, TokenBudget] = {}

    def admit(self, identity: KeyIdentity, prompt_tokens: int) -> None:
        tenant = identity.tenant_id
        if self.active.get(tenant, 0) >= identity.max_streams:
            raise BudgetExceeded(
                f"too many concurrent streams for tenant {identity.tenant_slug!r} "
                f"(at most {identity.max_streams})",
                1.0,
            )
        budget = self._budget(identity)
        budget.refill(time.monotonic())
        if budget.tokens < 1:
            wait = (1 - budget.tokens) / (identity.tokens_per_minute / 60.0)
            raise BudgetExceeded(
                f"token budget exceeded for tenant {identity.tenant_slug!r} "
                f"({identity.tokens_per_minute} tokens per minute)",
                wait,
            )
        budget.tokens -= prompt_tokens
        self.active[tenant] = self.active.get(tenant, 0) + 1

    def charge(self, identity: KeyIdentity, tokens: int) -> None:
        self._budget(identity).tokens -= tokens

    def release(self, identity: KeyIdentity) -> None:
        self.active[identity.tenant_id] = max(0, self.active.get(identity.tenant_id, 1) - 1)

    def _budget(self, identity: KeyIdentity) -> TokenBudget:
        budget = self._budgets.get(identity.tenant_id)
        if budget is None or budget.per_minute != identity.tokens_per_minute:
            budget = self._budgets[identity.tenant_id] = TokenBudget(identity.tokens_per_minute)
        return budget
