"""The shapes of a raw ASGI app's arguments, for the lean apps that skip Django's request
stack (OIP v2, metrics) and the entry point that routes to them.

Plain aliases rather than asgiref's typed dicts: these apps read a few well-known keys of an
HTTP scope and message, and a union of every scope kind would only get in their way.
"""

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

Scope = dict[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
