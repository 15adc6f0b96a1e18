"""Checking a torch.export archive without torch: its signature, and every way an archive could
make the loader unpickle, evaluate or call something refused."""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

import pytest
import torch
from torch._export.serde.schema import ScalarType

from serving_agent.torch_archive import SCALAR_TO_OIP, ArchiveError, read_archive
from tests.torch_models import ConvNet, conv_net, export, mlp, rewrite_json


def read(archive: bytes):
    return read_archive(io.BytesIO(archive))


def test_the_signature_is_read_from_the_archive_with_a_dynamic_batch() -> None:
    archive = read(mlp()[1])
    assert archive.inputs == [{"name": "features", "datatype": "FP32", "shape": [-1, 6]}]
    assert archive.outputs == [
        {"name": "output_0", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "output_1", "datatype": "FP32", "shape": [-1]},
    ]
    conv = read(conv_net()[1])
    assert conv.inputs == [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]


def test_scalar_types_map_to_the_oip_datatypes_of_the_same_dtype() -> None:
    names = {
        "UINT8": "BYTE", "INT8": "CHAR", "INT16": "SHORT", "INT32": "INT", "INT64": "LONG",
        "FP16": "HALF", "FP32": "FLOAT", "FP64": "DOUBLE", "BOOL": "BOOL", "UINT16": "UINT16",
        "UINT32": "UINT32", "UINT64": "UINT64",
    }  # fmt: skip
    assert {oip: ScalarType(n).name for n, oip in SCALAR_TO_OIP.items()} == names


def test_a_fixed_batch_dimension_is_refused_with_the_fix() -> None:
    torch.manual_seed(0)
    static = export(ConvNet().eval(), torch.randn(2, 1, 8, 8), "image", dynamic=False)
    with pytest.raises(ArchiveError, match=r"no dynamic batch dimension.*torch.export.Dim"):
        read(static)


def test_keyword_inputs_are_refused() -> None:
    class Keyword(torch.nn.Module):
        def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
            return x * scale

    batch = torch.export.Dim("batch")
    program = torch.export.export(
        Keyword(),
        (torch.ones(2, 3),),
        {"scale": torch.ones(2, 3)},
        dynamic_shapes={"x": {0: batch}, "scale": {0: batch}},
    )
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    with pytest.raises(ArchiveError, match="positional"):
        read(buffer.getvalue())


def _pickled_weight(config: dict[str, Any]) -> None:
    next(iter(config["config"].values()))["use_pickle"] = True


def _eval_in_shape(program: dict[str, Any]) -> None:
    sizes = program["graph_module"]["graph"]["tensor_values"]["features"]["sizes"]
    sizes[0]["as_expr"]["expr_str"] = "__import__('os').system('touch /tmp/pwned')"


def _eval_in_range(program: dict[str, Any]) -> None:
    program["range_constraints"]["__import__('os').getcwd()"] = {"min_val": 1, "max_val": 2}


def _string_bound(program: dict[str, Any]) -> None:
    next(iter(program["range_constraints"].values()))["max_val"] = "1 or __import__('os')"


def _os_system(program: dict[str, Any]) -> None:
    program["graph_module"]["graph"]["nodes"][0]["target"] = "torch.os.system"


def _custom_object(program: dict[str, Any]) -> None:
    program["graph_module"]["graph"]["custom_obj_values"] = {"obj": {"name": "obj"}}


def _empty_input_spec(program: dict[str, Any]) -> None:
    program["graph_module"]["signature"]["input_specs"].append({})


def _bad_in_spec(program: dict[str, Any]) -> None:
    program["graph_module"]["module_call_graph"][0]["signature"]["in_spec"] = "[1, {"


@pytest.mark.parametrize(
    ("member", "change", "message"),
    [
        ("data/weights/model_weights_config.json", _pickled_weight, "stored as a pickle"),
        ("models/model.json", _eval_in_shape, "not plain symbolic arithmetic"),
        ("models/model.json", _eval_in_range, "not plain symbolic arithmetic"),
        ("models/model.json", _string_bound, "non-integer bound"),
        ("models/model.json", _os_system, "calls 'torch.os.system'"),
        ("models/model.json", _custom_object, "custom"),
        ("models/model.json", _empty_input_spec, "malformed archive"),
        ("models/model.json", _bad_in_spec, "malformed archive"),
    ],
)
def test_archives_that_would_unpickle_evaluate_call_or_crash_are_refused(
    member: str, change: Any, message: str
) -> None:
    with pytest.raises(ArchiveError, match=message):
        read(rewrite_json(mlp()[1], member, change))


def test_guards_code_is_dropped_never_executed() -> None:
    def guards(program: dict[str, Any]) -> None:
        program["guards_code"] = ["__import__('os').system('touch /tmp/pwned')"]

    assert read(rewrite_json(mlp()[1], "models/model.json", guards)).program["guards_code"] == []


def test_members_beyond_a_plain_export_are_refused() -> None:
    archive = io.BytesIO(mlp()[1])
    with zipfile.ZipFile(archive, "a") as zf:
        root = zf.namelist()[0].split("/")[0]
        # The legacy layout's pickled weights, which torch.export.load would still unpickle.
        zf.writestr(f"{root}/data/weights/model.pt", pickle.dumps({"w": 1}))
    with pytest.raises(ArchiveError, match=r"unexpected member .*model\.pt"):
        read(archive.getvalue())


@pytest.mark.parametrize("data", [b"", b"not a zip", pickle.dumps({"a": 1}), b"PK\x03\x04broken"])
def test_what_is_not_an_archive_is_refused(data: bytes) -> None:
    with pytest.raises(ArchiveError):
        read(data)


def test_a_zip_that_is_not_an_export_is_refused() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("model/config.json", "{}")
    with pytest.raises(ArchiveError, match="unexpected member"):
        read(buffer.getvalue())


class _Normalizer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class _Incrementer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2


@pytest.mark.parametrize(
    ("module", "written"),
    [(_Normalizer().train(), "b_norm_num_batches_tracked"), (_Incrementer(), "add_ on x")],
    ids=["batch-norm-in-training-mode", "in-place-on-the-input"],
)
def test_programs_that_change_their_inputs_or_state_are_refused(
    module: torch.nn.Module, written: str
) -> None:
    archive = export(module, torch.randn(3, 4), "x")
    with pytest.raises(ArchiveError, match=f"changes its inputs or state.*{written}.*eval mode"):
        read(archive)
    assert read(export(_Normalizer().eval(), torch.randn(3, 4), "x")).inputs
