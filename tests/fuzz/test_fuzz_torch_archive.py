"""Hypothesis-mutated torch.export archives: whatever is changed in the program's JSON or the
weights' config, or however the zip is truncated or corrupted, reading the archive either gives
a signature or refuses with ``ArchiveError`` (the upload's 400), never another exception (a 500).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving_agent.torch_archive import ArchiveError, read_archive
from tests.fuzz.strategies import HOSTILE_LITERALS, fuzz, json_values
from tests.torch_models import mlp, rewrite, rewrite_json

ARCHIVE = mlp()[1]
MEMBERS = ["models/model.json", "data/weights/model_weights_config.json"]


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside a JSON document."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += paths(item, (*prefix, i))
    return found


def read_or_refuse(archive: bytes) -> None:
    try:
        read_archive(io.BytesIO(archive))
    except ArchiveError:
        pass


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    member = draw(st.sampled_from(MEMBERS))
    replacement = draw(json_values | st.sampled_from(HOSTILE_LITERALS))
    choice = draw(st.integers(min_value=0))

    def change(document: Any) -> None:
        targets = [p for p in paths(document) if p]
        where = targets[choice % len(targets)]
        parent = document
        for key in where[:-1]:
            parent = parent[key]
        parent[where[-1]] = replacement

    return rewrite_json(ARCHIVE, member, change)


@fuzz(150)
@given(archive=mutated())
def test_a_mutated_program_is_read_or_refused(archive: bytes) -> None:
    read_or_refuse(archive)


@fuzz(100)
@given(at=st.integers(0, len(ARCHIVE) - 1), flip=st.integers(1, 255), cut=st.booleans())
def test_a_truncated_or_corrupted_zip_is_read_or_refused(at: int, flip: int, cut: bool) -> None:
    corrupted = ARCHIVE[:at] + bytes([ARCHIVE[at] ^ flip]) + ARCHIVE[at + 1 :]
    read_or_refuse(ARCHIVE[:at] if cut else corrupted)


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_deeply_nested_json_is_refused(depth: int) -> None:
    def nest(name: str, data: bytes) -> bytes:
        if not name.endswith("models/model.json"):
            return data
        return data.replace(b'"guards_code": []', b'"guards_code": ' + b"[" * depth + b"]" * depth)

    deep = rewrite(ARCHIVE, nest)
    assert b"[[[[" in deep
    with pytest.raises(ArchiveError):
        read_archive(io.BytesIO(deep))
