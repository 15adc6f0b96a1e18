"""The front-door lifecycle: what every front door (OIP REST and gRPC, the prediction API,
embeddings, OpenAI's completions and chat, the generation websocket) does around its codec, in
one place so the doors cannot drift apart.

A door opens a ``Call`` (its request id and traceparent), runs its codec under ``serve`` (parse
the request, call the pipeline, render the reply) and gives ``serve`` its protocol's error
renderer; once its reply is sent it calls ``Call.finish``. The lifecycle owns:

- tracing: the request id and traceparent (a malformed id is a 400 before any work), set for
  the request's log records; a sampled request's spans (``gateway.spans``: the door names
  itself with a ``Door``) are exported once its reply is sent;
- refusals and their metrics: every door's outcome is counted by ``GatewayState.observe`` from
  the moment the door says it is predicting, so a 401, 404 or 429 counts the same everywhere;
- the Idempotency-Key: claimed through ``Call.claim_key``, kept with ``Call.keep`` (which
  marks an answer too large to keep ``Idempotency-Stored: false``), and released on every exit
  without a kept answer (an error, an exception, the client gone, a cancellation), so a retry
  computes instead of getting 409 until the lease ends;
- error mapping: an ``ApiError`` or any exception becomes the door's own error shape, an
  unexpected exception a logged 500 that never shows a traceback;
- after-reply work: the metrics, the log sample and shadow copies run once the reply is sent.

KServe's REST and gRPC endpoints and Ray Serve's proxy are shaped the same way: a codec per
protocol around one generic request lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from contextvars import Token
from typing import Any, TypeVar

from platform_site import telemetry
from tenants.keys import KeyIdentity

from . import admission, idempotency, spans, tracing
from .asgi_types import Receive
from .dispatch import in_background
from .errors import ApiError
from .metrics import Observed
from .parsed import After
from .routes import Route
from .state import GatewayState

log = logging.getLogger(__name__)

Reply = TypeVar("Reply")
Rendered = TypeVar("Rendered")  # an error in the door's shape (often its Reply type too)


class Call:
    """One request through a front door, from its ids to the work after its reply."""

    __slots__ = ("state", "trace", "observed", "after", "claim", "status", "refused", "_token")

    def __init__(
        self,
        state: GatewayState,
        request_id: str | None,
        traceparent: str | None,
        door: spans.Door | None = None,
        where: Any = None,
    ) -> None:
        """``door``: how its span names the request, read from ``where`` (the door's request
        object) only when the request is sampled; without one, no span (not a prediction)."""
        self.state = state
        self.refused: ApiError | None = None  # answered before any work: a malformed id
        try:
            self.trace = tracing.start_trace(request_id, traceparent)
        except tracing.BadRequestId as exc:
            self.trace = tracing.start_trace(None, None)
            self.refused = ApiError(400, str(exc))
        # With tracing off (or the request unsampled) this test is all its spans cost it.
        if telemetry.exporting is None or door is None or not self.trace.sampled:
            self.observed = Observed(self.trace)
        else:
            self.observed = spans.Timeline(self.trace, door, where)
        self.after: After = []  # shadow copies, started once the reply is sent
        self.claim: idempotency.Claim | None = None  # held, not yet kept
        self.status = 200  # the status the reply carries; errors set it
        self._token: Token[tracing.Trace | None] | None = None

    def predicting(self) -> None:
        """From here on the request is counted (its refusals too) and may be logged."""
        self.observed.predicting = True

    def admit(
        self, authorization: str | None, model_name: str, version: str | None
    ) -> Coroutine[Any, Any, tuple[KeyIdentity, Route]]:
        """Authenticate, rate-limit and resolve (``admission.admit``), timed as stages. Not a
        coroutine of its own: the caller awaits admission's, one frame less per request."""
        return admission.admit(self.state, authorization, model_name, version, self.observed)

    async def authenticate(self, authorization: str | None) -> KeyIdentity:
        """The caller's key, for doors that resolve the model later (generation)."""
        identity = await admission.authenticate(self.state, authorization)
        self.observed.tenant = identity.tenant_slug
        return identity

    async def claim_key(
        self, identity: KeyIdentity, value: str | None, method: str, path: str, *body: bytes
    ) -> idempotency.Stored | None:
        """Hold the request's Idempotency-Key (``value``; None: no header, no cost). Returns
        the first answer when this is a retry of an answered request: nothing is computed,
        so nothing is counted or logged."""
        claim = await admission.claim_key(self.state, identity, value, method, path, *body)
        if claim is None:
            return None
        if claim.replay is not None:
            self.observed.predicting = False
            return claim.replay
        self.claim = claim
        return None

    async def keep(
        self, status: int, headers: list[tuple[str, str]], body: bytes
    ) -> list[tuple[str, str]]:
        """The answer a retry with the same key is given; the claim is then no longer held.
        Returns the reply's headers: ``headers``, and ``Idempotency-Stored: false`` when the
        answer was not kept (``Claim.keep``), so the client knows a retry computes again."""
        claim, self.claim = self.claim, None
        if claim is None or await claim.keep(status, headers, body):
            return headers
        return [*headers, idempotency.NOT_STORED]

    def finish(self) -> None:
        """Once the reply is sent: count it, offer it to the prediction log, start the work
        queued for after the reply (never before it: it must not delay the answer)."""
        if self.observed.predicting:
            self.state.observe(self.observed, self.status)
        if type(self.observed) is spans.Timeline:  # sampled: its spans, from times it took
            spans.export(self.observed, self.status)
        for coro in self.after:
            in_background(coro)
        if self._token is not None:
            tracing.current.reset(self._token)
            self._token = None


async def serve(
    call: Call, work: Coroutine[Any, Any, Reply], render_error: Callable[[ApiError], Rendered]
) -> Reply | Rendered:
    """Await a door's ``work`` (parse, call, render) for ``call``. Every error, expected or
    not, comes back as ``render_error`` renders it in the door's protocol, with ``call.status``
    set. A held Idempotency-Key that was not kept is released whatever the exit. ``work`` is a
    coroutine, not a callable, so the lifecycle costs no closure per request."""
    if call.refused is not None:
        work.close()  # never started
        call.status = call.refused.status
        return render_error(call.refused)
    call._token = tracing.current.set(call.trace)  # its log records carry the ids
    try:
        reply = await work
    except ApiError as exc:
        error = exc
    except Exception:
        log.exception("unhandled error in %s", getattr(work, "__qualname__", "a front door"))
        error = ApiError(500, "internal server error")
    except BaseException:  # cancelled (the client left, a shutdown): nothing was answered
        claim, call.claim = call.claim, None
        if claim is not None:
            # A task being cancelled cannot await the release.
            in_background(claim.release())
        raise
    else:
        await _release(call)  # a door that returned without keeping its answer
        return reply
    await _release(call)
    call.status = error.status
    return render_error(error)


async def _release(call: Call) -> None:
    claim, call.claim = call.claim, None
    if claim is not None:
        await claim.release()


async def until_client_leaves(receive: Receive, work: Coroutine[Any, Any, Reply]) -> Reply:
    """Await ``work`` (a prediction, its body already read); an HTTP client that hangs up
    meanwhile cancels it, so the agent drops it unrun if it is still queued, and the request
    ends as a 499 (which releases its Idempotency-Key like any other unanswered exit)."""
    task = asyncio.current_task()
    assert task is not None
    watch = DisconnectWatch(receive, task)
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.client_left or task.uncancel():
            raise  # cancelled from outside (shutdown), not by the client leaving
        raise ApiError(499, "the client disconnected before the answer") from None
    finally:
        watch.stop()


class DisconnectWatch:
    """Cancels the request's task if its client hangs up while it waits for the agent.

    Under the web command's own HTTP protocol (``gateway.drain``), whose request cycle is
    ``receive``'s owner, the connection's end calls ``client_gone`` itself: no task, no timer.
    Under any other server a watching task reads ``receive`` for the disconnect, started only
    once a request has waited ``WATCH_AFTER_S``: a task per request cost ~0.35 ms of CPU on a
    0.6 ms request (oip_bench, 16 connections). Nor does such a request get a timer of its own
    (a timer made and cancelled per request was ~4 µs of CPU, bench/README.md "The gateway's
    own cost"): it joins ``_Waiting``, whose one timer, running only while requests wait,
    starts the watchers of those waiting longer than ``WATCH_AFTER_S``. At 64 connections on
    a slow machine most requests wait that long, and their watchers were ~5 % of the
    gateway's CPU: hence the protocol's hook.
    """

    WATCH_AFTER_S = 0.02

    def __init__(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        self.receive, self.task = receive, task
        self.client_left = False
        self.watcher: asyncio.Task[None] | None = None
        self.cycle = getattr(receive, "__self__", None)
        if hasattr(self.cycle, "on_disconnect"):
            self.cycle.on_disconnect = self.client_gone  # type: ignore[union-attr]
            return
        self.cycle = None
        self.waiting = _Waiting.of(asyncio.get_running_loop())
        self.waiting.add(self)

    def client_gone(self) -> None:
        """The connection ended before the answer (the server's hook)."""
        self.client_left = True
        self.task.cancel()

    def _start(self) -> None:
        self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.client_gone()

    def stop(self) -> None:
        if self.cycle is not None:
            self.cycle.on_disconnect = None
            return
        self.waiting.since.pop(self, None)
        if self.watcher is not None:
            self.watcher.cancel()


class _Waiting:
    """The requests of one event loop waiting for their answers, and since when."""

    _loops: dict[asyncio.AbstractEventLoop, _Waiting] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.since: dict[DisconnectWatch, float] = {}  # oldest first (insertion order)
        self.timer: asyncio.TimerHandle | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Waiting:
        waiting = cls._loops.get(loop)
        if waiting is None:
            waiting = cls._loops[loop] = cls(loop)
        return waiting

    def add(self, watch: DisconnectWatch) -> None:
        self.since[watch] = self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_later(DisconnectWatch.WATCH_AFTER_S, self._sweep)

    def _sweep(self) -> None:
        self.timer = None
        cutoff = self.loop.time() - DisconnectWatch.WATCH_AFTER_S
        for watch, since in list(self.since.items()):
            if since > cutoff:
                break
            del self.since[watch]
            watch._start()
        if self.since:  # idle, no timer runs
            self.timer = self.loop.call_later(DisconnectWatch.WATCH_AFTER_S, self._sweep)
