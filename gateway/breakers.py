"""The gateway's circuit breakers (per agent link, per version) are ``platform_site.breakers``'s,
which the Redis and database circuits below the gateway share."""

from platform_site.breakers import CLOSED, HALF_OPEN, OPEN, Breaker

__all__ = ["CLOSED", "HALF_OPEN", "OPEN", "Breaker"]
