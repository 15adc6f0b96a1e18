"""Facts about this node that the agent reports in its Hello: CPUs, memory, GPUs, providers,
and the memory budget its loaded versions may fill."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess

import onnxruntime

from .__version__ import __version__
from ._memory import default_memory_budget
from .protocol import Gpu, Hello

logger = logging.getLogger(__name__)

_NVIDIA_SMI_QUERY = [
    "--query-gpu=name,memory.total",
    "--format=csv,noheader,nounits",
]


def memory_bytes() -> int:
    """Total physical memory, or 0 when the platform will not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return 0


def parse_nvidia_smi(output: str) -> list[Gpu]:
    """GPUs from ``nvidia-smi --query-gpu=name,memory.total`` CSV (memory in MiB)."""
    gpus = []
    for line in output.splitlines():
        name, _, mib = line.rpartition(",")
        if not name.strip():
            continue
        try:
            memory = int(float(mib)) * 1024 * 1024
        except ValueError:
            memory = 0  # "[N/A]" on some boards
        gpus.append(Gpu(name=name.strip(), memory_bytes=memory))
    return gpus


def gpus() -> list[Gpu]:
    """The node's NVIDIA GPUs; none when nvidia-smi is missing or fails (a CPU node)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        result = subprocess.run(
            [smi, *_NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("nvidia-smi failed, reporting no GPUs: %s", exc)
        return []
    return parse_nvidia_smi(result.stdout)


def node_facts(
    name: str | None = None, *, deployment: str | None = None, memory_budget_bytes: int = 0
) -> Hello:
    """The Hello message describing this node; a budget of 0 is replaced by the default for
    this node (its GPU's memory, else a share of the memory available now)."""
    node_gpus = gpus()
    return Hello(
        agent_version=__version__,
        host=name or socket.gethostname(),
        cpu_count=os.cpu_count() or 1,
        memory_bytes=memory_bytes(),
        gpus=node_gpus,
        providers=onnxruntime.get_available_providers(),
        deployment=deployment,
        memory_budget_bytes=memory_budget_bytes or default_memory_budget(node_gpus),
        groups=True,
    )
