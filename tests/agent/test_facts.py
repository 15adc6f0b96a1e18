"""Node facts for the Hello: never fail on a node without GPUs."""

from __future__ import annotations

import shutil

import pytest

from serving_agent import node_facts
from serving_agent._facts import gpus, memory_bytes, parse_nvidia_smi


def test_nvidia_smi_csv_becomes_gpus_with_bytes() -> None:
    output = "NVIDIA H100 80GB HBM3, 81559\nNVIDIA A10, [N/A]\n"
    parsed = parse_nvidia_smi(output)
    assert [(g.name, g.memory_bytes) for g in parsed] == [
        ("NVIDIA H100 80GB HBM3", 81559 * 1024 * 1024),
        ("NVIDIA A10", 0),
    ]


def test_a_node_without_nvidia_smi_reports_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert gpus() == []


def test_hello_describes_this_node() -> None:
    hello = node_facts("node-7")
    assert hello.host == "node-7" and hello.cpu_count >= 1
    assert hello.memory_bytes == memory_bytes() > 0
    assert "CPUExecutionProvider" in hello.providers
