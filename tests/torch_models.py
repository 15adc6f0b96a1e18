"""Small torch models exported with ``torch.export`` for tests (no Django here, so any process
can import it): the module, to compute the reference in the test, and its ``.pt2`` archive."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable
from functools import cache
from typing import Any

import torch


class Mlp(torch.nn.Module):
    """Two outputs: class probabilities and a score per row."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(6, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.hidden(features))
        return torch.softmax(self.head(h), dim=-1), h.sum(dim=-1)


class ConvNet(torch.nn.Module):
    """A small image classifier with batch norm (a buffer-holding layer) in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 8 * 8, 5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.norm(self.conv(image))).flatten(1))


def export(
    module: torch.nn.Module, example: torch.Tensor, name: str, dynamic: bool = True
) -> bytes:
    """``module``'s archive, its batch dimension dynamic (as Switchyard needs) unless told not."""
    shapes = {name: {0: torch.export.Dim("batch", max=4096)}} if dynamic else None
    program = torch.export.export(module, (example,), dynamic_shapes=shapes)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


@cache
def mlp() -> tuple[Mlp, bytes]:
    torch.manual_seed(0)
    module = Mlp().eval()
    return module, export(module, torch.randn(2, 6), "features")


@cache
def conv_net() -> tuple[ConvNet, bytes]:
    torch.manual_seed(1)
    module = ConvNet()
    module.norm.running_mean.normal_()  # not the identity: the buffers must travel
    module.norm.running_var.uniform_(0.5, 2.0)
    module.eval()
    return module, export(module, torch.randn(2, 1, 8, 8), "image")


def rewrite(archive: bytes, change: Callable[[str, bytes], bytes | None]) -> bytes:
    """A copy of ``archive`` with each member passed through ``change(name, data)`` (None drops
    it): for crafting the hostile archives the checks must refuse."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = change(info.filename, src.read(info))
            if data is not None:
                dst.writestr(info.filename, data)
    return out.getvalue()


def rewrite_json(archive: bytes, member: str, change: Callable[[Any], None]) -> bytes:
    """A copy of ``archive`` whose JSON ``member`` (e.g. "models/model.json") ``change`` edits."""

    def edit(name: str, data: bytes) -> bytes:
        if not name.endswith("/" + member):
            return data
        value = json.loads(data)
        change(value)
        return json.dumps(value).encode()

    return rewrite(archive, edit)
