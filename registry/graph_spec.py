"""The document of a ``graph`` version (docs/graphs.md): other versions of the same tenant
composed as a sequence, an ensemble or a switch, and the checks of it at upload.

``parse`` reads the document alone (its syntax, kinds, limits and conditions); ``compose``
checks it against the tenant's versions through a ``Lookup`` the caller gives
(``registry.graphs.node_target``, tenant-scoped) and derives the graph's signature from its
nodes. Neither touches the database itself, so the format table can name them and the gateway
can read a stored graph without importing the registry's models.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from django.core.files.base import File

from .signature import SignatureError

# Bounds on what one request may fan out to, and on how far graphs may nest: each node is a
# dispatch of its own, so a graph is the one place where one request becomes many.
MAX_DOCUMENT_BYTES = 64 * 1024
MAX_NODES = 16  # model calls in the whole graph, the nodes of nested graphs included
MAX_DEPTH = 4  # compositions inside compositions, nested graphs included
COMBINERS = ("mean", "sum", "concat", "vote")
OPS = ("<", "<=", ">", ">=", "==", "!=")
REDUCES = ("any", "all", "first")
FLOATS = ("FP16", "FP32", "FP64")
# Node names become Prometheus label values and appear in error messages.
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
MAX_NAME = 100  # as long as a model name, which a node is named after by default
MAX_TENSOR_NAME = 256
MAX_STRING_VALUE = 256

Tensor = dict[str, Any]  # {"name", "datatype", "shape"} as ModelVersion stores a signature
Signature = tuple[list[Tensor], list[Tensor]]


@dataclass(frozen=True)
class Node:
    """One call of another version: ``model`` at a version number or an alias name."""

    name: str
    model: str
    target: int | str
    inputs: tuple[tuple[str, str], ...] = ()  # (the node's input, the tensor it reads)
    outputs: tuple[tuple[str, str], ...] = ()  # (the node's output, the name it is given)

    def source(self, name: str) -> str:
        """The tensor the node's input ``name`` reads."""
        return dict(self.inputs).get(name, name)

    def renamed(self, name: str) -> str:
        """The name the node's output ``name`` is given."""
        return dict(self.outputs).get(name, name)

    @property
    def ref(self) -> str:
        """How messages name what the node calls: ``model v3`` or ``model@production``."""
        if isinstance(self.target, int):
            return f"{self.model!r} v{self.target}"
        return f"{self.model!r}@{self.target}"


@dataclass(frozen=True)
class Sequence:
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Ensemble:
    members: tuple[Step, ...]
    combine: str | Node  # a built-in combiner (COMBINERS) or a node given every member's outputs


@dataclass(frozen=True)
class Condition:
    input: str
    op: str
    value: float | int | str | bool
    reduce: str = "any"


@dataclass(frozen=True)
class Switch:
    cases: tuple[tuple[Condition, Step], ...]
    default: Step


Step = Node | Sequence | Ensemble | Switch


@dataclass(frozen=True)
class Graph:
    root: Step
    nodes: tuple[Node, ...]  # every node, in the document's order
    depth: int  # compositions nested in this document (0: the root is one node)


class NodeMissing(LookupError):
    """What a node names does not exist for the tenant; the message says what is missing."""


@dataclass(frozen=True)
class Target:
    """The version a node names, as the lookup found it."""

    version_id: int
    version: int
    inputs: list[Tensor]
    outputs: list[Tensor]
    generates_text: bool
    graph: Graph | None  # the version is itself a graph


# (model name, version number or alias name) -> the version, as the uploading tenant sees it;
# raises NodeMissing.
Lookup = Callable[[str, int | str], Target]


def _refuse(where: str, problem: str) -> SignatureError:
    return SignatureError("artifact", f"{where}: {problem}")


# Reading the document ---------------------------------------------------------------------


def check_document(upload: File[bytes]) -> Signature:
    """The format table's ``check``: refuse a document that is not a graph, reading it alone.
    A graph's signature is its nodes' (``compose``), so this gives none."""
    parse(read_document(upload))
    return [], []


def read_document(upload: File[bytes]) -> Any:
    upload.seek(0)
    data = upload.read(MAX_DOCUMENT_BYTES + 1)
    upload.seek(0)
    if len(data) > MAX_DOCUMENT_BYTES:
        raise _refuse("graph", f"a graph document is at most {MAX_DOCUMENT_BYTES} bytes")
    try:
        # orjson refuses nesting past its own limit instead of recursing without one.
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise _refuse("graph", f"not a JSON document: {exc}") from None


def parse(doc: Any) -> Graph:
    """The graph a document describes, refusing anything else with a message naming where."""
    reader = _Reader()
    root = reader.step(doc, "graph", 0)
    return Graph(root, tuple(reader.nodes), reader.depth)


class _Reader:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.depth = 0

    def step(self, value: Any, where: str, level: int) -> Step:
        if not isinstance(value, dict):
            raise _refuse(where, "must be an object: a node (with 'model') or a composition")
        kinds = [k for k in ("sequence", "ensemble", "switch") if k in value]
        if "model" in value:
            kinds.append("model")
        if len(kinds) != 1:
            raise _refuse(
                where,
                "must be exactly one of a node ('model' with 'version' or 'alias'), "
                "'sequence', 'ensemble' or 'switch'",
            )
        if kinds[0] == "model":
            return self.node(value, where)
        level += 1
        if level > MAX_DEPTH:
            raise _refuse(where, f"compositions nest at most {MAX_DEPTH} deep")
        self.depth = max(self.depth, level)
        if kinds[0] == "sequence":
            _only(value, {"sequence"}, where)
            steps = _list(value["sequence"], f"{where}.sequence", 1)
            return Sequence(
                tuple(self.step(s, f"{where}.sequence[{i}]", level) for i, s in enumerate(steps))
            )
        if kinds[0] == "ensemble":
            _only(value, {"ensemble", "combine"}, where)
            members = _list(value["ensemble"], f"{where}.ensemble", 2)
            parsed = tuple(
                self.step(m, f"{where}.ensemble[{i}]", level) for i, m in enumerate(members)
            )
            combine = value.get("combine")
            if isinstance(combine, dict):
                return Ensemble(parsed, self.node(combine, f"{where}.combine"))
            if combine not in COMBINERS:
                raise _refuse(
                    f"{where}.combine",
                    f"must be one of {', '.join(COMBINERS)}, or a node given the members' "
                    f"outputs; got {_shown(combine)}",
                )
            return Ensemble(parsed, combine)
        _only(value, {"switch", "default"}, where)
        cases = _list(value["switch"], f"{where}.switch", 1)
        read = []
        for i, case in enumerate(cases):
            at = f"{where}.switch[{i}]"
            if not isinstance(case, dict) or set(case) != {"when", "then"}:
                raise _refuse(at, "must be an object with 'when' (a condition) and 'then'")
            read.append(
                (_condition(case["when"], f"{at}.when"), self.step(case["then"], at, level))
            )
        if "default" not in value:
            raise _refuse(where, "a switch needs a 'default' branch, taken when no case holds")
        return Switch(tuple(read), self.step(value["default"], f"{where}.default", level))

    def node(self, value: Any, where: str) -> Node:
        if not isinstance(value, dict) or "model" not in value:
            raise _refuse(where, "must be a node: an object with 'model'")
        _only(value, {"name", "model", "version", "alias", "inputs", "outputs"}, where)
        model = value["model"]
        if not isinstance(model, str) or not 0 < len(model) <= 100:
            raise _refuse(f"{where}.model", "must be a model name")
        target: int | str
        if ("version" in value) == ("alias" in value):
            raise _refuse(
                where, "name the version by 'version' (a number) or by 'alias': one of the two"
            )
        if "version" in value:
            target = value["version"]
            if not isinstance(target, int) or isinstance(target, bool) or target < 1:
                raise _refuse(
                    f"{where}.version", f"must be a positive integer; got {_shown(target)}"
                )
        else:
            target = value["alias"]
            if not isinstance(target, str) or not 0 < len(target) <= 50:
                raise _refuse(f"{where}.alias", "must be an alias name")
        name = value.get("name", model)
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or set(name) - _NAME_CHARS:
            raise _refuse(
                f"{where}.name",
                f"must be 1-{MAX_NAME} letters, digits, '.', '_' or '-'; got {_shown(name)}",
            )
        if any(n.name == name for n in self.nodes):
            raise _refuse(
                f"{where}.name",
                f"{name!r} names two nodes (a node is named after its model unless it says "
                "'name'): give each its own name",
            )
        node = Node(
            name,
            model,
            target,
            _renames(value.get("inputs", {}), f"{where}.inputs", unique=False),
            _renames(value.get("outputs", {}), f"{where}.outputs", unique=True),
        )
        self.nodes.append(node)
        if len(self.nodes) > MAX_NODES:
            raise _refuse(where, f"a graph has at most {MAX_NODES} nodes")
        return node


def _only(value: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(value) - allowed, key=str)
    if unknown:
        raise _refuse(
            where, f"unknown key {_shown(unknown[0])} (allowed: {', '.join(sorted(allowed))})"
        )


def _list(value: Any, where: str, least: int) -> list[Any]:
    if not isinstance(value, list) or len(value) < least:
        raise _refuse(where, f"must be a list of at least {least} step{'s' if least > 1 else ''}")
    return value


def _renames(value: Any, where: str, *, unique: bool) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise _refuse(where, "must be an object of tensor name to tensor name")
    for key, to in value.items():
        if not isinstance(to, str) or not 0 < len(to) <= MAX_TENSOR_NAME or not key:
            raise _refuse(f"{where}.{_shown(key)}", "must name a tensor (a non-empty string)")
    if unique and len(set(value.values())) != len(value):
        raise _refuse(where, "gives two outputs the same name")
    return tuple(value.items())


def _condition(value: Any, where: str) -> Condition:
    if not isinstance(value, dict):
        raise _refuse(where, "must be an object: {input, op, value, reduce}")
    _only(value, {"input", "op", "value", "reduce"}, where)
    name, op, operand = value.get("input"), value.get("op"), value.get("value")
    reduce = value.get("reduce", "any")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TENSOR_NAME:
        raise _refuse(f"{where}.input", "must name a tensor")
    if op not in OPS:
        raise _refuse(f"{where}.op", f"must be one of {' '.join(OPS)}; got {_shown(op)}")
    if reduce not in REDUCES:
        raise _refuse(
            f"{where}.reduce", f"must be one of {', '.join(REDUCES)}; got {_shown(reduce)}"
        )
    if isinstance(operand, bool) or isinstance(operand, str):
        if op not in ("==", "!="):
            raise _refuse(
                f"{where}.op", f"{op} compares numbers; a string or boolean takes == or !="
            )
        if isinstance(operand, str) and len(operand) > MAX_STRING_VALUE:
            raise _refuse(f"{where}.value", f"at most {MAX_STRING_VALUE} characters")
    elif not isinstance(operand, int | float) or not math.isfinite(operand):
        raise _refuse(
            f"{where}.value",
            f"must be a finite number, a string or a boolean; got {_shown(operand)}",
        )
    return Condition(name, op, operand, reduce)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


# Checking it against the tenant's versions -------------------------------------------------


def compose_upload(upload: File[bytes], lookup: Lookup) -> tuple[Signature, dict[str, Any]]:
    """The format table's ``compose``: check an uploaded graph against the versions its nodes
    name (``lookup``, as the uploading tenant sees them) and give its signature, derived from
    its nodes, and what the version keeps of it (``ModelVersion.lineage["graph"]``: the
    document, which the gateway reads back with ``parse``)."""
    doc = read_document(upload)
    graph = parse(doc)
    return compose(graph, lookup), {"graph": doc}


def compose(graph: Graph, lookup: Lookup) -> Signature:
    """The graph's signature: the request inputs its nodes read and the outputs of its last
    step; refuses nodes that do not exist for the tenant, that generate text, whose tensors do
    not fit what feeds them, and graphs past the bounds once nested graphs are counted."""
    flow = _Flow(lookup)
    calls, depth = flow.measure(graph, ())
    if calls > MAX_NODES:
        raise _refuse(
            "graph", f"expands to {calls} model calls with its nested graphs; at most {MAX_NODES}"
        )
    if depth > MAX_DEPTH:
        raise _refuse("graph", f"nests {depth} deep with its nested graphs; at most {MAX_DEPTH}")
    outputs = flow.step(graph.root, {}, "graph")
    flow.check_conditions()
    return list(flow.required.values()), list(outputs.values())


def graph_depth(graph: Graph, nested: int) -> int:
    """How deep a graph nests: its own compositions (at least one level: calling a graph is a
    level even when its root is one node) plus the deepest graph a node names (``nested``).
    The gateway counts graph levels at request time against the same bound."""
    return max(graph.depth, 1) + nested


class _Flow:
    """Walks a graph as requests will flow through it: tensors by name, each step reading
    what the request and the steps before it gave."""

    def __init__(self, lookup: Lookup) -> None:
        self.lookup = lookup
        self.targets: dict[tuple[str, int | str], Target] = {}
        self.required: dict[str, Tensor] = {}  # the request's inputs, in order of first use
        self.conditions: list[tuple[Condition, dict[str, Tensor], str]] = []

    def target(self, node: Node) -> Target:
        key = (node.model, node.target)
        found = self.targets.get(key)
        if found is None:
            try:
                found = self.targets[key] = self.lookup(node.model, node.target)
            except NodeMissing as exc:
                raise _refuse(f"graph node {node.name!r}", str(exc)) from None
            if found.generates_text:
                raise _refuse(
                    f"graph node {node.name!r}",
                    f"{node.ref} generates text; a graph composes versions that answer tensors",
                )
        return found

    def measure(self, graph: Graph, stack: tuple[int, ...]) -> tuple[int, int]:
        """(model calls, depth) of a graph, the graphs its nodes name expanded as they resolve
        now. ``stack``: the graph versions being expanded, so a cycle is refused rather than
        followed (only aliases can make one: a version names only versions older than it)."""
        calls, nested = 0, 0
        for node in graph.nodes:
            found = self.target(node)
            if found.graph is None:
                calls += 1
                continue
            if found.version_id in stack:
                raise _refuse(
                    f"graph node {node.name!r}", f"{node.ref} leads back to itself (a cycle)"
                )
            if len(stack) >= MAX_DEPTH:
                raise _refuse(f"graph node {node.name!r}", f"graphs nest at most {MAX_DEPTH} deep")
            sub_calls, sub_depth = self.measure(found.graph, (*stack, found.version_id))
            calls += sub_calls
            nested = max(nested, sub_depth)
            if calls > MAX_NODES:
                break
        return calls, graph_depth(graph, nested)

    def step(self, step: Step, avail: dict[str, Tensor], where: str) -> dict[str, Tensor]:
        """The tensors ``step`` gives, by name, when ``avail`` are the tensors earlier steps
        gave (the request's inputs are read through ``required``)."""
        if isinstance(step, Node):
            return self.node(step, avail)
        if isinstance(step, Sequence):
            local = dict(avail)
            out: dict[str, Tensor] = {}
            for s in step.steps:
                out = self.step(s, local, where)
                local.update(out)
            return out
        if isinstance(step, Ensemble):
            outs = [self.step(m, avail, where) for m in step.members]
            if isinstance(step.combine, Node):
                local = dict(avail)
                for out in outs:
                    local.update(out)
                return self.node(step.combine, local)
            return _combined(step.combine, outs)
        branches = [self.step(s, avail, where) for _, s in step.cases]
        branches.append(self.step(step.default, avail, where))
        for i, (condition, _) in enumerate(step.cases):
            self.conditions.append((condition, dict(avail), f"switch[{i}].when"))
        return _same_outputs(branches)

    def node(self, node: Node, avail: dict[str, Tensor]) -> dict[str, Tensor]:
        found = self.target(node)
        where = f"graph node {node.name!r}"
        takes = [t["name"] for t in found.inputs]
        gives = [t["name"] for t in found.outputs]
        for name, _ in node.inputs:
            if name not in takes:
                raise _refuse(
                    f"{where}.inputs", f"{node.ref} takes no input {name!r} (it takes {takes})"
                )
        for name, _ in node.outputs:
            if name not in gives:
                raise _refuse(
                    f"{where}.outputs", f"{node.ref} gives no output {name!r} (it gives {gives})"
                )
        for spec in found.inputs:
            source = node.source(spec["name"])
            given = avail.get(source)
            if given is None:
                given = self.required.get(source)
                if given is None:
                    self.required[source] = {
                        "name": source,
                        "datatype": spec["datatype"],
                        "shape": list(spec["shape"]),
                    }
                    continue
                merged = _merge(given, spec)
                if merged is None:
                    raise _refuse(
                        where,
                        f"reads request input {source!r} as {_sig(spec)}, but another node reads "
                        f"it as {_sig(given)}",
                    )
                self.required[source] = {**given, "shape": merged}
            elif _merge(given, spec) is None:
                raise _refuse(
                    where,
                    f"input {spec['name']!r} of {node.ref} takes {_sig(spec)}, but {source!r} "
                    f"is {_sig(given)} there",
                )
        return {
            node.renamed(t["name"]): {**t, "name": node.renamed(t["name"])} for t in found.outputs
        }

    def check_conditions(self) -> None:
        """Each switch's condition reads a tensor the graph has where it stands (an earlier
        step's output, or a request input some node reads), of a type its value compares to."""
        for condition, avail, where in self.conditions:
            spec = avail.get(condition.input) or self.required.get(condition.input)
            if spec is None:
                raise _refuse(
                    f"graph {where}",
                    f"input {condition.input!r} is no tensor of the graph there: name a request "
                    "input that a node reads, or an output of an earlier step",
                )
            datatype, value = spec["datatype"], condition.value
            if datatype == "BYTES":
                fits = isinstance(value, str)
            elif datatype == "BOOL":
                fits = isinstance(value, bool)
            else:
                fits = isinstance(value, int | float) and not isinstance(value, bool)
            if not fits:
                wanted = {"BYTES": "a string", "BOOL": "true or false"}.get(datatype, "a number")
                raise _refuse(
                    f"graph {where}",
                    f"{condition.input!r} is {datatype}: compare it with {wanted}, not "
                    f"{_shown(value)}",
                )


def _sig(t: Tensor) -> str:
    return f"{t['datatype']} {list(t['shape'])}"


def _merge(a: Tensor, b: Tensor) -> list[int] | None:
    """The shape both tensors fit (-1 where neither fixes a dimension), or None when their
    datatypes, ranks or fixed dimensions disagree."""
    if a["datatype"] != b["datatype"] or len(a["shape"]) != len(b["shape"]):
        return None
    shape = []
    for x, y in zip(a["shape"], b["shape"], strict=True):
        if x != -1 and y != -1 and x != y:
            return None
        shape.append(x if x != -1 else y)
    return shape


def _same_outputs(outs: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Branches of a switch answer the same outputs: the graph has one signature."""
    first = outs[0]
    merged = dict(first)
    for out in outs[1:]:
        if list(out) != list(first):
            raise _refuse(
                "graph switch",
                f"every branch must give the same outputs; one gives {list(first)}, another "
                f"{list(out)} (rename them with 'outputs')",
            )
        for name, t in out.items():
            shape = _merge(merged[name], t)
            if shape is None:
                raise _refuse(
                    "graph switch",
                    f"output {name!r} is {_sig(merged[name])} in one branch and {_sig(t)} in "
                    "another",
                )
            merged[name] = {**merged[name], "shape": shape}
    return merged


def _combined(combiner: str, outs: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The outputs a built-in combiner gives from the members' (the same names in each)."""
    names = list(outs[0])
    for out in outs[1:]:
        if sorted(out) != sorted(names):
            raise _refuse(
                "graph ensemble",
                f"{combiner} combines outputs of the same names; one member gives {names}, "
                f"another {list(out)} (rename them with 'outputs')",
            )
    result: dict[str, Tensor] = {}
    for name in names:
        tensors = [out[name] for out in outs]
        first = tensors[0]
        datatype, rank = first["datatype"], len(first["shape"])
        for t in tensors[1:]:
            if t["datatype"] != datatype or len(t["shape"]) != rank:
                raise _refuse(
                    "graph ensemble",
                    f"output {name!r} is {_sig(first)} in one member and {_sig(t)} in another",
                )
        where = f"graph ensemble ({combiner}) output {name!r}"
        if combiner in ("mean", "sum"):
            if combiner == "mean" and datatype not in FLOATS:
                raise _refuse(
                    where,
                    f"mean averages floating-point outputs, not {datatype} (vote counts labels)",
                )
            if datatype in ("BYTES", "BOOL"):
                raise _refuse(where, f"sum adds numbers, not {datatype}")
            shape = list(first["shape"])
            for t in tensors[1:]:
                merged = _merge({**first, "shape": shape}, t)
                if merged is None:
                    raise _refuse(
                        where,
                        f"is {_sig(first)} in one member and {_sig(t)} in another: "
                        f"{combiner} needs the same shape",
                    )
                shape = merged
            # A classifier's class labels stay when every member has the same ones.
            params = [t.get("parameters") for t in tensors]
            kept = (
                {"parameters": params[0]}
                if params[0] and all(p == params[0] for p in params)
                else {}
            )
            result[name] = {"name": name, "datatype": datatype, "shape": shape, **kept}
        elif combiner == "concat":
            if rank < 1:
                raise _refuse(
                    where, "concat joins tensors along their last dimension: a scalar has none"
                )
            head: list[int] | None = list(first["shape"][:-1])
            for t in tensors[1:]:
                head = (
                    _merge({**first, "shape": head}, {**t, "shape": t["shape"][:-1]})
                    if head is not None
                    else None
                )
            if head is None:
                raise _refuse(
                    where, "members give it in shapes that differ before the last dimension"
                )
            lasts = [t["shape"][-1] for t in tensors]
            last = -1 if -1 in lasts else sum(lasts)
            result[name] = {"name": name, "datatype": datatype, "shape": [*head, last]}
        else:  # vote
            if rank == 1 and datatype not in FLOATS:
                result[name] = {"name": name, "datatype": datatype, "shape": [-1]}
            elif rank == 2 and datatype not in ("BYTES", "BOOL"):
                result[name] = {"name": name, "datatype": "INT64", "shape": [-1]}
            else:
                raise _refuse(
                    where,
                    f"vote takes labels (a rank-1 tensor of integers or BYTES) or scores (a rank-2 "
                    f"numeric tensor, its arg-max the label); got {_sig(first)}",
                )
    return result
