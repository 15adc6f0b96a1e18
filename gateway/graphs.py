"""Running a graph version (docs/graphs.md) on the gateway, node by node.

Each node is resolved through the process's cached routes as a front door resolves a request
(an alias names its version at request time) and sent through the same dispatch as any request
(``run_inference``: the tenant's budget stop, the version's breaker, a cold start's hold, the
agents' fair scheduling and batching), carrying the request's trace and what is left of its
deadline. Each node's latency and failures are counted per graph and node in the gateway's
metrics. A node's own model's rollout plan is not applied: the node's alias is a pointer, and
the graph's traffic is the graph's (its own plan splits it).
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from monitoring.traffic import NO_PLAN, PlanArmKey
from registry.graph_spec import MAX_DEPTH, MAX_NODES, Condition, Ensemble, Node, Sequence, Step
from tenants.keys import KeyIdentity

from . import spans
from .admission import check_budget
from .checks import check_tensor
from .dispatch import DispatchError
from .errors import ApiError, api_error
from .inference import run_inference
from .metrics import Observed
from .routes import Route, RouteMissing
from .scheduling import Schedule, default_schedule
from .state import GatewayState
from .tracing import Trace, current

Answer = list[tuple[str, np.ndarray]]
Tensors = dict[str, np.ndarray]

# A graph that no longer fits what its nodes are (an alias moved to a version of another
# signature, a model deleted) is the platform's fault, not the client's: a 502 naming the node.
BROKEN = 502


async def run_route(
    state: GatewayState,
    route: Route,
    names: list[str],
    arrays: list[np.ndarray],
    outputs: list[str] | None = None,
    observed: Observed | None = None,
    *,
    identity: KeyIdentity | None = None,
    sched: Schedule | None = None,
    counted: PlanArmKey | None = NO_PLAN,
) -> Answer:
    """Answer a request for ``route`` as ``run_inference`` does: a version an agent serves is
    dispatched to it; a graph is run here, its nodes dispatched in turn. The pipeline, the
    fallback ladder and shadow copies all call this, so a graph is served, degraded and
    shadowed like any version."""
    if route.graph is None:
        return await run_inference(
            state,
            route,
            names,
            arrays,
            outputs,
            observed,
            identity=identity,
            sched=sched,
            counted=counted,
        )
    return await run_graph(
        state,
        route,
        names,
        arrays,
        outputs,
        observed,
        identity=identity,
        sched=sched,
        counted=counted,
    )


async def run_graph(
    state: GatewayState,
    route: Route,
    names: list[str],
    arrays: list[np.ndarray],
    outputs: list[str] | None = None,
    observed: Observed | None = None,
    *,
    identity: KeyIdentity | None = None,
    sched: Schedule | None = None,
    counted: PlanArmKey | None = NO_PLAN,
) -> Answer:
    """Run a graph version on a request's tensors and answer its outputs. The graph's own
    outcome is counted for its version like an agent's version (guardrails, SLOs); each node
    is counted for its own version by the dispatch."""
    if identity is not None and counted is not None:
        check_budget(state, identity)
    if sched is None:
        sched = default_schedule(state, identity)
    started = time.perf_counter()
    trace = current.get()
    if observed is not None:
        observed.route = route
        observed.names, observed.arrays = names, arrays
        trace = observed.trace
    run = GraphRun(state, route.tenant_id, identity, sched, trace)
    if type(observed) is spans.Timeline:  # a sampled request: a span per node
        run.timeline = observed
    try:
        result = await run.graph(route, dict(zip(names, arrays, strict=True)), 1)
        answer = _answer(route, result, outputs)
    except ApiError as exc:
        if counted is not None:
            if run.not_ready:  # nothing failed: a node's replica was not up yet
                state.traffic.not_ready(route.version_id, counted)
            else:
                seconds = time.perf_counter() - started
                state.traffic.record(route.version_id, seconds, exc.status < 500, counted)
        raise
    if counted is not None:
        rows = len(arrays[0]) if arrays and arrays[0].ndim else 0
        state.traffic.record(route.version_id, time.perf_counter() - started, True, counted, rows)
    if observed is not None:
        observed.mark("dispatch")
        observed.outputs = answer
    return answer


def _answer(route: Route, result: Tensors, outputs: list[str] | None) -> Answer:
    wanted = list(route.output_names) if outputs is None else outputs
    missing = [name for name in wanted if name not in result]
    if missing:
        raise ApiError(
            BROKEN,
            f"graph {route.model_name!r} v{route.version}: its last step gave no output "
            f"{missing[0]!r} (a node's alias now names a version of another signature)",
        )
    return [(name, result[name]) for name in wanted]


async def ready(state: GatewayState, route: Route, level: int = 1) -> bool:
    """Whether a version can answer now: an agent's version when a replica is ready; a graph
    when every version its nodes name now is (``/v2/models/{name}/ready``, gRPC ModelReady)."""
    if route.graph is None:
        return state.pool.is_ready(route.version_id)
    if level > MAX_DEPTH:
        return False
    for node in route.graph.nodes:
        try:
            target = await state.route(route.tenant_id, node.model, node.target)
        except (RouteMissing, DispatchError):
            return False
        if not await ready(state, target, level + 1):
            return False
    return True


class GraphRun:
    """One request through a graph: its deadline, its trace, and how many model calls it has
    made (bounded: aliases may have moved since the graph's upload was checked)."""

    def __init__(
        self,
        state: GatewayState,
        tenant_id: int,
        identity: KeyIdentity | None,
        sched: Schedule,
        trace: Trace | None,
    ) -> None:
        self.state, self.tenant_id, self.identity = state, tenant_id, identity
        self.priority = sched.priority
        self.deadline = time.monotonic() + sched.budget_ms / 1000
        self.trace = trace
        self.tenant = identity.tenant_slug if identity is not None else ""
        self.calls = 0
        self.timeline: spans.Timeline | None = None  # a sampled request's, for nodes' spans
        self.not_ready = False  # a node failed only because no replica of it was ready yet

    async def graph(self, route: Route, env: Tensors, level: int) -> Tensors:
        assert route.graph is not None
        return await self.step(route, route.graph.root, env, level)

    async def step(self, graph: Route, step: Step, env: Tensors, level: int) -> Tensors:
        """The tensors ``step`` gives, by name; ``env``: the request's inputs and what earlier
        steps gave (a later name shadows an earlier one)."""
        if isinstance(step, Node):
            return await self.node(graph, step, env, level)
        if isinstance(step, Sequence):
            local, out = dict(env), {}
            for s in step.steps:
                out = await self.step(graph, s, local, level)
                local.update(out)
            return out
        if isinstance(step, Ensemble):
            outs = await self.all(graph, step.members, env, level)
            if isinstance(step.combine, Node):
                local = dict(env)
                for out in outs:
                    local.update(out)
                return await self.node(graph, step.combine, local, level)
            return combine(step.combine, outs, f"graph {graph.model_name!r} ensemble")
        for condition, branch in step.cases:
            if holds(condition, env, f"graph {graph.model_name!r} switch"):
                return await self.step(graph, branch, env, level)
        return await self.step(graph, step.default, env, level)

    async def all(
        self, graph: Route, members: tuple[Step, ...], env: Tensors, level: int
    ) -> list[Tensors]:
        """An ensemble's members at once; the first to fail (in the members' order) fails the
        request and the others are cancelled (a queued one is dropped by its agent unrun)."""
        tasks: list[asyncio.Task[Tensors]] = []
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.step(graph, m, env, level)) for m in members]
        except BaseExceptionGroup:
            for task in tasks:
                if task.done() and not task.cancelled():
                    failure = task.exception()
                    if isinstance(failure, ApiError):
                        raise failure from None
            raise
        return [task.result() for task in tasks]

    async def node(self, graph: Route, node: Node, env: Tensors, level: int) -> Tensors:
        started = time.perf_counter()
        span = None if self.timeline is None else spans.NodeSpan(self.timeline, node.name, graph)
        status: int | None = None  # None: cancelled, neither answered nor failed
        try:
            out = await self._node(node, env, level)
            status = 200
        except ApiError as exc:
            status = exc.status
            raise
        finally:
            if status is not None:
                self._observe(graph, node, started, status)
            if span is not None:
                span.close(status)
        return out

    def _observe(self, graph: Route, node: Node, started: float, status: int) -> None:
        if self.state.count_metrics:
            seconds = time.perf_counter() - started
            self.state.metrics.graph_node(self.tenant, graph, node.name, seconds, status)

    async def _node(self, node: Node, env: Tensors, level: int) -> Tensors:
        where = f"graph node {node.name!r}"
        try:
            route = await self.state.route(self.tenant_id, node.model, node.target)
        except RouteMissing as exc:
            raise ApiError(BROKEN, f"{where}: {exc}") from None
        except DispatchError as exc:
            failure = api_error(exc)
            raise ApiError(failure.status, f"{where}: {failure.message}", failure.headers) from None
        if route.generates_text:
            raise ApiError(BROKEN, f"{where}: {node.ref} now generates text")
        names, arrays = [], []
        for spec in route.inputs:
            source = node.source(spec.name)
            array = env.get(source)
            if array is None or array.dtype != spec.dtype:
                raise ApiError(
                    BROKEN,
                    f"{where}: {node.ref} (v{route.version}) takes {spec.datatype} "
                    f"{list(spec.shape)} as {spec.name!r}, which {source!r} is not here (its "
                    "alias names a version of another signature than the upload checked)",
                )
            names.append(spec.name)
            arrays.append(array)
        if route.graph is not None:
            if level >= MAX_DEPTH:
                raise ApiError(
                    BROKEN,
                    f"{where}: {node.ref} nests graphs past {MAX_DEPTH} deep (or in a cycle)",
                )
            try:
                inner = await self.graph(route, dict(zip(names, arrays, strict=True)), level + 1)
            except ApiError as exc:
                raise ApiError(exc.status, f"{where}: {exc.message}", exc.headers) from None
            answer = _answer(route, inner, None)
        else:
            answer = await self._dispatch(node, route, names, arrays, where)
        return {node.renamed(name): array for name, array in answer}

    async def _dispatch(
        self, node: Node, route: Route, names: list[str], arrays: list[np.ndarray], where: str
    ) -> Answer:
        """One node on an agent, through the same dispatch as any request: its signature
        checked first (as a front door checks a request's), within what is left of the
        request's deadline, under the request's trace."""
        # An alias names a version only now: say which one answered.
        answered = f", v{route.version}" if isinstance(node.target, str) else ""
        named = f"{where} ({node.ref}{answered})"
        self.calls += 1
        if self.calls > MAX_NODES:
            raise ApiError(
                BROKEN,
                f"{named}: the graph expands past {MAX_NODES} model calls (an alias a node "
                "names has moved to a larger graph since the upload was checked)",
            )
        for spec, array in zip(route.inputs, arrays, strict=True):
            check_tensor(spec, array, f"{named} input {spec.name!r}")
        left_ms = (self.deadline - time.monotonic()) * 1000
        if left_ms < 1:
            raise ApiError(504, f"{named}: the request's deadline passed before the node ran")
        # A sampled request's node carries its node's span: the agent's spans are its children.
        trace = self.trace if self.timeline is None else spans.node_trace(self.trace)
        observed = Observed(trace) if trace is not None else None
        try:
            return await run_inference(
                self.state,
                route,
                names,
                arrays,
                None,
                observed,
                identity=self.identity,
                sched=Schedule(self.priority, left_ms),
                counted=NO_PLAN,
            )
        except ApiError as exc:
            if exc.status == 503 and not self.state.pool.is_ready(route.version_id):
                self.not_ready = True
            raise ApiError(exc.status, f"{named}: {exc.message}", exc.headers) from None


# Combining and choosing, on the tensors themselves --------------------------------------------


def combine(combiner: str, outs: list[Tensors], where: str) -> Tensors:
    """An ensemble's built-in combiner over its members' outputs of the same names."""
    result: Tensors = {}
    for name in outs[0]:
        arrays = [out.get(name) for out in outs]
        present = [a for a in arrays if a is not None]
        if len(present) != len(arrays):
            raise ApiError(BROKEN, f"{where}: a member gave no output {name!r}")
        try:
            result[name] = _COMBINERS[combiner](present)
        except ValueError as exc:  # shapes the members answered that do not combine
            shapes = [list(a.shape) for a in present]
            raise ApiError(
                BROKEN, f"{where} ({combiner}) output {name!r}: members answered {shapes}: {exc}"
            ) from None
    return result


def _mean(arrays: list[np.ndarray]) -> np.ndarray:
    return np.mean(np.stack(arrays), axis=0).astype(arrays[0].dtype, copy=False)


def _sum(arrays: list[np.ndarray]) -> np.ndarray:
    return np.sum(np.stack(arrays), axis=0).astype(arrays[0].dtype, copy=False)


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays, axis=-1)


def _vote(arrays: list[np.ndarray]) -> np.ndarray:
    """Each row's majority label; a tie goes to the label of the member listed first among
    those tied. Scores (rank 2) vote with their arg-max."""
    labels = [a.argmax(axis=-1) if a.ndim == 2 else a for a in arrays]
    rows = len(labels[0])
    if any(len(column) != rows for column in labels):
        raise ValueError("the members answered different numbers of rows")
    out = np.empty(rows, dtype=labels[0].dtype)
    for row in range(rows):
        counts: dict[Any, int] = {}
        for column in labels:
            counts[column[row]] = counts.get(column[row], 0) + 1
        out[row] = max(counts, key=counts.__getitem__)  # the first of the most counted
    return out


_COMBINERS: dict[str, Callable[[list[np.ndarray]], np.ndarray]] = {
    "mean": _mean,
    "sum": _sum,
    "concat": _concat,
    "vote": _vote,
}
_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}


def holds(condition: Condition, env: Tensors, where: str) -> bool:
    """Whether a switch's condition holds on the request: compared element by element, then
    reduced (``any``, ``all``, ``first``); an empty tensor satisfies no condition."""
    array = env.get(condition.input)
    if array is None:
        raise ApiError(BROKEN, f"{where}: no tensor {condition.input!r} to test")
    flat = array.ravel()
    if condition.reduce == "first":
        flat = flat[:1]
    if flat.size == 0:
        return False
    value: object = condition.value
    if isinstance(value, str):
        value = value.encode()  # BYTES tensors hold bytes
    try:
        hits = np.asarray(_OPS[condition.op](flat, value), dtype=bool)
    except TypeError:
        raise ApiError(
            BROKEN, f"{where}: {condition.input!r} cannot be compared with {condition.value!r}"
        ) from None
    return bool(hits.all()) if condition.reduce == "all" else bool(hits.any())
