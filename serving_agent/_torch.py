"""The torch runtime: a ``torch.export`` archive, deserialized without pickle or ``eval``.

``torch.export.load`` would unpickle parts of an archive and evaluate strings in it (see
``torch_archive``), so the program is rebuilt here from the pieces that are only data: the
checked JSON program (``guards_code`` dropped), raw weight and constant payloads, and no example
inputs. This imports torch; the agent imports it only for torch versions, before it reads the
memory in use, so torch and the export machinery that the first load would otherwise import
(``torch.export._trace`` and ``_unlift`` pull in dynamo and inductor modules: ~29 MiB here) are
not counted against the first torch version.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# Not called here: imported now so that the first load does not import them (see above).
import torch._inductor.sizevars
import torch.export._trace
import torch.export._unlift
import torch.utils._pytree as pytree
from torch._export.serde import schema
from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass
from torch.export.pt2_archive._package import PT2ArchiveReader, _load_constants, _load_state_dict

from ._exceptions import BadInput
from ._runtime import Runtime, load_runtime
from .protocol import VersionSpec
from .torch_archive import MODEL, read_archive

logger = logging.getLogger(__name__)

# Request tensors arrive as read-only views of the frames they came in, and copying them to
# silence torch would cost a copy per batch: the program cannot write to them (an archive that
# mutates its inputs is refused), so the warning says nothing here.
warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
# torch 2.13's own run_decompositions trips its own deprecation of LeafSpec checks.
warnings.filterwarnings(
    "ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning
)


def pick_device(device: str) -> str:
    """ "cuda" when asked for (or "auto") and torch can really run a kernel there, else "cpu"."""
    if device == "cpu":
        return "cpu"
    try:
        if torch.cuda.is_available():
            torch.zeros(1, device="cuda").add_(1)  # a driver that lists a GPU may still fail
            return "cuda"
        reason = "torch sees no CUDA GPU"
    except Exception as exc:  # noqa: BLE001 - any CUDA failure means "use CPU"
        reason = str(exc)
    level = logging.WARNING if device == "cuda" else logging.DEBUG
    logger.log(level, "CUDA unusable for device=%s, running on CPU: %s", device, reason)
    return "cpu"


def load_program(path: Path | str) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """The archive's program as a callable module, with its input and output names."""
    archive = read_archive(str(path))
    reader = PT2ArchiveReader(str(path))
    # Both read raw payloads only: read_archive refused pickled and legacy ones.
    state_dict = _load_state_dict(reader, MODEL)
    constants = _load_constants(reader, MODEL)
    serialized = _dict_to_dataclass(schema.ExportedProgram, archive.program)
    program = ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, b"")
    # Functionalized (no decompositions): in-place updates of intermediates become plain ops,
    # and any write to an input or a buffer shows up as an output of its own, refused here.
    program = program.run_decompositions({})
    outputs = program.graph_signature.output_specs
    writes = sorted({s.kind.name for s in outputs if s.kind.name != "USER_OUTPUT"})
    if writes:
        raise ValueError(
            f"the program changes its inputs or state as it runs ({', '.join(writes)}): export "
            "the model in eval mode (model.eval()), without in-place changes to its inputs"
        )
    return (
        program.module(),
        [t["name"] for t in archive.inputs],
        [t["name"] for t in archive.outputs],
    )


# A dynamic dimension's bounds: (input index, dimension, lowest, highest or None).
Bound = tuple[int, int, int, int | None]


def dynamic_bounds(module: torch.fx.GraphModule) -> list[Bound] | None:
    """The ranges the program accepts for its inputs' dynamic dimensions, or None when one of
    them is not a plain symbol with a range (then the program checks its inputs itself)."""
    ranges = getattr(module, "range_constraints", {})
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    bounds: list[Bound] = []
    for i, node in enumerate(placeholders):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return None
        for dim, size in enumerate(value.shape):
            if not isinstance(size, torch.SymInt):
                continue
            found = ranges.get(size.node.expr)
            if found is None:
                return None
            try:
                high: int | None = int(found.upper)
            except (TypeError, OverflowError):  # unbounded (sympy's infinity)
                high = None
            bounds.append((i, dim, int(found.lower), high))
    return bounds


class TorchRuntime(Runtime):
    """An exported torch program on CUDA when asked for and working, else on CPU."""

    def __init__(self, path: Path | str, device: str = "auto", threads: int = 1) -> None:
        # Intra-op threads, as ONNX Runtime's: one batch at a time per version.
        torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))
        module, self.input_names, self.output_names = load_program(path)
        self._bounds = dynamic_bounds(module)
        if self._bounds is not None:
            # The program's own input check (pytree, guards, ranges) costs ~0.15 ms a call,
            # twice the MLP's compute: the signature was checked before the request was
            # queued, and the dynamic dimensions' ranges are checked in run().
            module.validate_inputs = False  # type: ignore[assignment]
        self._device = pick_device(device)
        self._module: torch.nn.Module | None = module.to(self._device)
        self.provider = f"torch-{self._device}"

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self._module is None:
            raise RuntimeError("runtime is closed")
        arrays = [inputs[name] for name in self.input_names]
        for i, dim, low, high in self._bounds or ():
            size = arrays[i].shape[dim]
            if size < low or (high is not None and size > high):
                raise BadInput(
                    f"input {self.input_names[i]!r}: dimension {dim} is {size}, and the "
                    f"exported program takes {low} to {high if high is not None else 'any'}"
                )
        args = [torch.from_numpy(array).to(self._device) for array in arrays]
        try:
            with torch.inference_mode():
                result = self._module(*args)
        except RuntimeError as exc:
            # The program's own check of its shape constraints, for programs whose dynamic
            # dimensions are not plain ranges (dynamic_bounds() gave None).
            if str(exc).startswith("Expected input"):
                raise BadInput(str(exc).splitlines()[0]) from exc
            raise
        outputs = pytree.tree_leaves(result)
        if len(outputs) != len(self.output_names):
            raise RuntimeError(f"the program returned {len(outputs)} outputs")
        return [out.detach().cpu().numpy() for out in outputs]

    def close(self) -> None:
        self._module = None
        if self._device == "cuda":
            torch.cuda.empty_cache()


def load_torch(
    path: Path,
    spec: VersionSpec,
    threads: int = 1,
    *,
    wrap: Callable[[Runtime], Runtime] | None = None,
) -> Runtime:
    """The agent's loader for ``torch`` versions (``serving_agent.formats``): the exported
    program, behind the same signature checks as an ONNX graph."""
    return load_runtime(path, spec, threads, TorchRuntime, wrap)
