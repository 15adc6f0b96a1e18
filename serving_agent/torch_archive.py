"""Reading and checking a ``torch.export`` archive (``torch.export.save``'s ``.pt2`` zip) without
torch and without running anything in it: the registry reads the signature at upload here, and
the agent checks the same things again before it deserializes the program.

``torch.export.load`` is not safe on an untrusted file (its own docstring says so): it unpickles
weights and constants marked ``use_pickle`` (``weights_only=False``), torchbind and opaque
objects, and the example inputs (falling back to ``weights_only=False``); it hands every
symbolic shape expression (``expr_str``) to ``sympy.sympify``, which is ``eval``; it ``exec``s
the archive's ``guards_code``; and a graph node may name any callable reachable from ``torch``,
``operator`` or ``math`` (``torch.os.system`` included). So an archive is accepted only when
none of that is needed: raw tensor payloads, ATen/prims operators and a few symbolic-int
helpers, shape expressions of plain symbols and arithmetic, and tensors in and out. The agent
never reads the example inputs or extra files, and drops ``guards_code`` (the signature check
and the agent's check of dynamic dimensions against their exported ranges cover what the guards
would).
"""

from __future__ import annotations

import json
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import IO, Any

MODEL = "model"  # torch.export.save stores its one program under this name
# JSON members are read whole; a program's graph is kilobytes to a few megabytes.
MAX_JSON_BYTES = 64 * 1024 * 1024

# torch._export.serde.schema.ScalarType -> Open Inference Protocol datatype (bfloat16 and
# complex types have no OIP/numpy counterpart and are refused at the model's edges).
SCALAR_TO_OIP = {
    1: "UINT8",
    2: "INT8",
    3: "INT16",
    4: "INT32",
    5: "INT64",
    6: "FP16",
    7: "FP32",
    8: "FP64",
    12: "BOOL",
    28: "UINT16",
    34: "UINT32",
    35: "UINT64",
}

# Members a plain export has; anything else (AOTInductor binaries, legacy pickled weights,
# executorch payloads) is refused rather than ignored, so what was checked is what loads.
_MEMBERS = re.compile(
    r"(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/model\.json|data/weights/model_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/model_constants_config\.json|data/constants/tensor_\d+"
    # Pickled example inputs: always written by torch.export.save, never read here or on the
    # agent. Extra files are plain strings that nothing reads either.
    r"|data/sample_inputs/model\.pt|extra/[^/]+)"
)

# Graph targets that may be called: ATen and prims operators, and the symbolic-int arithmetic
# that dynamic shapes produce (torch._export.serde.serialize._SYM_OPS).
_OPERATOR = re.compile(r"torch\.ops\.(aten|prims)\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+")
_SYM_OPS = {
    *(
        f"_operator.{name}"
        for name in (
            "eq ne le ge lt gt neg pos and_ or_ not_ add sub mul truediv floordiv mod pow"
        ).split()
    ),
    *(f"torch.{name}" for name in "sym_int sym_float sym_ite sym_max sym_min sym_not".split()),
    "torch._sym_sqrt",
    "math.trunc",
}

# sympy.sympify evaluates its string: only symbols, numbers, arithmetic and these names pass.
_EXPR_NAMES = {
    "Symbol",
    "Integer",
    "Rational",
    "True",
    "False",
    "positive",
    "integer",
    "real",
    "Mod",
    "Max",
    "Min",
    "Abs",
    "Eq",
    "Ne",
    "Le",
    "Lt",
    "Ge",
    "Gt",
    "And",
    "Or",
    "Not",
    "FloorDiv",
    "ModularIndexing",
    "Where",
    "PythonMod",
    "CeilToInt",
    "FloorToInt",
    "CleanDiv",
    "PowByNatural",
    "IntTrueDiv",
    "FloatTrueDiv",
    "TruncToInt",
}
_EXPR_TOKEN = re.compile(
    r"\s*(?:([A-Za-z_][A-Za-z0-9_]*)|('[a-z]+[0-9]+')|([0-9]+)|([-+*/%(),=<>!&|~^]))"
)
_SYMBOL_NAME = re.compile(r"[a-z]+[0-9]+")


class ArchiveError(ValueError):
    """The file is not a torch.export archive Switchyard can load safely; says why."""


@dataclass
class TorchArchive:
    """What the platform needs from an archive: where it sits in the zip, its program (the
    parsed ``models/model.json``, ``guards_code`` dropped) and its signature."""

    root: str
    program: dict[str, Any]
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)


def output_name(i: int) -> str:
    """A program's outputs have no names of their own (its nodes' names change between exports):
    they are ``output_0``, ``output_1``... in the order ``forward`` returns them."""
    return f"output_{i}"


def read_archive(file: str | IO[bytes]) -> TorchArchive:
    """Check the archive at ``file`` (a path or a seekable binary file) and read its signature.

    Raises ``ArchiveError`` naming the first problem.
    """
    try:
        with zipfile.ZipFile(file) as zf:
            return _read(zf)
    except ArchiveError:
        raise
    except zipfile.BadZipFile as exc:
        raise ArchiveError(f"not a zip archive torch.export.save wrote: {exc}") from None
    # Whatever a crafted file makes the zip reader or the walk over its JSON trip on (a member
    # that does not inflate, a list where an object belongs, nesting too deep) is its problem.
    except (
        KeyError,
        TypeError,
        AttributeError,
        IndexError,
        ValueError,
        StopIteration,
        RecursionError,
        NotImplementedError,
        EOFError,
        zlib.error,
    ) as exc:
        raise ArchiveError(f"malformed archive: {exc!r}"[:300]) from None


def _read(zf: zipfile.ZipFile) -> TorchArchive:
    names = zf.namelist()
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1 or not all("/" in n for n in names):
        raise ArchiveError("not a torch.export archive: expected one top-level folder")
    root = roots.pop()
    for name in names:
        if not _MEMBERS.fullmatch(name[len(root) + 1 :]):
            raise ArchiveError(
                f"unexpected member {name!r}: only programs saved with torch.export.save "
                "(no AOTInductor, no legacy pickled weights) are accepted"
            )

    def member(path: str) -> bytes:
        info = zf.getinfo(f"{root}/{path}")
        if info.file_size > MAX_JSON_BYTES:
            raise ArchiveError(f"{path} is larger than {MAX_JSON_BYTES} bytes")
        return zf.read(info)

    def json_member(path: str) -> Any:
        try:
            return json.loads(member(path))
        except KeyError:
            raise ArchiveError(f"not a torch.export archive: {path} is missing") from None
        except ValueError as exc:
            raise ArchiveError(f"{path} is not valid JSON: {exc}") from None

    try:
        if member("archive_format").strip() != b"pt2":
            raise ArchiveError("not a torch.export archive: archive_format is not pt2")
    except KeyError:
        raise ArchiveError("not a torch.export archive: archive_format is missing") from None
    for config, kind in (
        ("data/weights/model_weights_config.json", "weight"),
        ("data/constants/model_constants_config.json", "constant"),
    ):
        for fqn, payload in json_member(config)["config"].items():
            if payload["use_pickle"] or not str(payload["path_name"]).startswith(
                ("weight_", "tensor_")
            ):
                raise ArchiveError(
                    f"{kind} {fqn!r} is stored as a pickle (a tensor subclass or a custom "
                    "object); only plain tensors are accepted"
                )
    program = json_member("models/model.json")
    if not isinstance(program, dict):
        raise ArchiveError("models/model.json is not an exported program")
    program["guards_code"] = []  # exec'd by torch on load; see the module docstring
    _check_code_paths(program)
    inputs, outputs = _signature(program)
    _check_no_writes(program["graph_module"]["graph"])
    return TorchArchive(root, program, inputs, outputs)


def _check_code_paths(program: dict[str, Any]) -> None:
    """Refuse anything the deserializer would evaluate or call beyond tensors and operators."""
    for name, bounds in program.get("range_constraints", {}).items():
        _check_expr(name)
        for bound in (bounds["min_val"], bounds["max_val"]):
            if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool)):
                raise ArchiveError(f"range constraint {name!r} has a non-integer bound")
    graph_module = program["graph_module"]
    if graph_module["graph"].get("custom_obj_values"):
        raise ArchiveError("the program holds custom (torchbind) objects; they need pickle")
    for value in _walk(graph_module):
        if "expr_str" in value:
            _check_expr(value["expr_str"])
        target = value.get("target")
        if isinstance(target, str) and "outputs" in value:
            if not (_OPERATOR.fullmatch(target) or target in _SYM_OPS):
                raise ArchiveError(
                    f"the program calls {target!r}; only ATen and prims operators are accepted"
                )


def _check_no_writes(graph: dict[str, Any]) -> None:
    """Refuse a program that writes to its inputs, weights or buffers as it runs: a model
    exported in training mode (batch norm updating its running statistics) would change with
    every request, and request tensors are read-only views of the frames they came in. The
    agent checks this again, exactly, on the functionalized program; this catches the usual
    cases at upload: an in-place operator on a graph input, batch norm in training mode."""
    placeholders = {arg["as_tensor"]["name"] for arg in graph["inputs"] if "as_tensor" in arg}
    for node in graph["nodes"]:
        op = node["target"].split(".")
        args = {a["name"]: a["arg"] for a in node["inputs"]}
        written = args.get("self", {}).get("as_tensor", {}).get("name")
        in_place = len(op) == 5 and op[3].endswith("_") and written in placeholders
        if in_place or args.get("training") == {"as_bool": True}:
            raise ArchiveError(
                f"the program changes its inputs or state as it runs ({op[-2]} on "
                f"{written or 'its buffers'}): export the model in eval mode (model.eval()), "
                "without in-place changes to its inputs"
            )


def _walk(value: Any) -> Any:
    """Every JSON object inside ``value``, depth first."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _check_expr(expr: object) -> None:
    if not isinstance(expr, str) or len(expr) > 4096:
        raise ArchiveError("a shape expression is not a short string")
    pos = 0
    while pos < len(expr):
        token = _EXPR_TOKEN.match(expr, pos)
        if token is None or (
            token.group(1)
            and token.group(1) not in _EXPR_NAMES
            and not _SYMBOL_NAME.fullmatch(token.group(1))
        ):
            raise ArchiveError(f"shape expression {expr[:80]!r} is not plain symbolic arithmetic")
        pos = token.end()


def _signature(program: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    graph_module = program["graph_module"]
    tensors = graph_module["graph"]["tensor_values"]
    inputs: list[dict[str, Any]] = []
    for spec in graph_module["signature"]["input_specs"]:
        kind, body = next(iter(spec.items()))
        if kind in ("parameter", "buffer", "tensor_constant"):
            continue
        arg = body.get("arg", {}) if kind == "user_input" else {}
        if "as_tensor" not in arg:
            raise ArchiveError(
                f"the program takes a {kind} {arg or body}; only tensor inputs are accepted"
            )
        inputs.append(_tensor(arg["as_tensor"]["name"], tensors[arg["as_tensor"]["name"]]))
    outputs: list[dict[str, Any]] = []
    for spec in graph_module["signature"]["output_specs"]:
        kind, body = next(iter(spec.items()))
        if kind != "user_output":
            raise ArchiveError(f"the program has a {kind} output; only tensors it returns")
        arg = body["arg"]
        if "as_tensor" not in arg:
            raise ArchiveError("the program returns something other than tensors")
        outputs.append(
            {
                **_tensor(arg["as_tensor"]["name"], tensors[arg["as_tensor"]["name"]]),
                "name": output_name(len(outputs)),
            }
        )
    if not inputs or not outputs:
        raise ArchiveError("the program must take and return at least one tensor")
    _check_positional(graph_module, len(inputs))
    for tensor in (*inputs, *outputs):
        if not tensor["shape"] or tensor["shape"][0] != -1:
            raise ArchiveError(
                f"{tensor['name']!r} has no dynamic batch dimension (shape {tensor['shape']}): "
                "export with dynamic_shapes={name: {0: torch.export.Dim('batch')}}"
            )
    return inputs, outputs


def _tensor(name: str, meta: dict[str, Any]) -> dict[str, Any]:
    datatype = SCALAR_TO_OIP.get(meta["dtype"])
    if datatype is None:
        raise ArchiveError(f"tensor {name!r} has a dtype Switchyard cannot serve ({meta['dtype']})")
    shape = [size["as_int"] if "as_int" in size else -1 for size in meta["sizes"]]
    return {"name": name, "datatype": datatype, "shape": shape}


def _check_positional(graph_module: dict[str, Any], count: int) -> None:
    """The agent calls ``forward`` with the inputs as positional tensors, in signature order."""
    top = next((entry for entry in graph_module["module_call_graph"] if entry["fqn"] == ""), None)
    if top is None or top["signature"] is None:
        raise ArchiveError("the program has no call signature")
    _, spec = json.loads(top["signature"]["in_spec"])
    args, kwargs = spec["children_spec"]
    flat = all(child["type"] is None for child in args["children_spec"])
    if kwargs["children_spec"] or not flat or len(args["children_spec"]) != count:
        raise ArchiveError(
            "forward must take its tensors as positional arguments (no keyword arguments, "
            "lists or dicts of tensors)"
        )
