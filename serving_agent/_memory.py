"""Measuring the memory loaded versions hold: this process's RSS, CUDA memory, the budget that
loaded versions may fill, and GPU use for heartbeats.

Everything here degrades to a plain answer on nodes without the optional pieces (no CUDA, no
torch, no ``pynvml``, no glibc): an unknown reading is 0 and an unknown GPU list is empty.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import resource
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .protocol import Gpu, GpuUse

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
# The share of the node's available memory an agent fills when no budget is given: the rest is
# headroom for request tensors, batches and the interpreter itself.
HOST_BUDGET_FRACTION = 0.7
# Below this a footprint is lost in allocator noise, and its release is not checked.
MEASURABLE_BYTES = 8 * MiB
_UNLIMITED_CGROUP = 1 << 60  # cgroup files say "max" or a huge number when there is no limit


def mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def rss_bytes() -> int:
    """This process's resident set size now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    # The peak, not the current size (the best macOS offers without psutil); in kB on Linux.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _cuda() -> Any | None:
    """torch.cuda when torch is already imported and sees a GPU. Never imports torch: an
    ONNX-only node must not pay for it, and there torch would not hold any memory anyway."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no CUDA"
        return None


def cuda_allocated_bytes() -> int:
    """CUDA memory torch's tensors occupy now; 0 without torch or CUDA.

    ONNX Runtime's CUDA arena is invisible here: a version it runs on CUDA is accounted by its
    estimate, and its eviction cannot be verified by measurement.
    """
    cuda = _cuda()
    return int(cuda.memory_allocated()) if cuda is not None else 0


@dataclass(frozen=True)
class Reading:
    """Memory in use at one moment: host RSS and CUDA memory allocated by torch."""

    host: int
    device: int

    def minus(self, earlier: Reading, on_cuda: bool) -> int:
        """Bytes gained since ``earlier`` where the version lives (negative: freed)."""
        return self.device - earlier.device if on_cuda else self.host - earlier.host


def read_memory() -> Reading:
    return Reading(host=rss_bytes(), device=cuda_allocated_bytes())


@cache
def _malloc_trim() -> Any | None:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_memory(collect: bool = True) -> None:
    """Hand freed memory back to the OS, so RSS shows what an unload really freed.

    Collects reference cycles (unless ``collect`` is false), asks glibc to return its free heap
    pages (without this a freed model can stay in RSS for good), and empties torch's CUDA
    cache. Blocking: call it in a worker thread.
    """
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    cuda = _cuda()
    if cuda is not None:
        cuda.empty_cache()


def released_enough(footprint: int, freed: int) -> bool:
    """Did an unload give back its memory? At least half of the footprint measured at load
    must come back; a footprint too small to tell from allocator noise passes unchecked."""
    return footprint < MEASURABLE_BYTES or freed >= footprint / 2


def available_memory_bytes(
    meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")
) -> int:
    """Memory this process could still take: MemAvailable, capped by the cgroup's limit (a
    container sees the whole host in /proc/meminfo). 0 when neither can be read."""
    available = 0
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # cgroup v1
    ):
        try:
            limit = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < _UNLIMITED_CGROUP:
            left = max(0, int(limit) - usage)
            available = min(available, left) if available else left
        break
    return available


def default_memory_budget(gpus: list[Gpu], available: int | None = None) -> int:
    """What loaded versions may fill when no budget is given: the first GPU's memory (versions
    load onto it), else a share of the host memory available now. 0 means unknown: no limit."""
    if gpus and gpus[0].memory_bytes > 0:
        return gpus[0].memory_bytes
    if available is None:
        available = available_memory_bytes()
    return int(available * HOST_BUDGET_FRACTION)


@cache
def _nvml() -> Any | None:
    """pynvml, initialized; None when it is not installed or finds no driver (checked once)."""
    try:
        import pynvml  # nvidia-ml-py, a dependency; kept optional for a trimmed agent image
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError and friends: no GPU figures
        logger.info("NVML unavailable, heartbeats report no GPU use: %s", exc)
        return None
    return pynvml


def gpu_use() -> list[GpuUse]:
    """Utilization and memory of each GPU (all processes), for the fleet pages; empty on CPU
    nodes and wherever NVML does not answer."""
    nvml = _nvml()
    if nvml is None:
        return []
    try:
        uses = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            utilization = nvml.nvmlDeviceGetUtilizationRates(handle)
            uses.append(
                GpuUse(
                    index=index,
                    utilization_pct=float(utilization.gpu),
                    memory_used_bytes=int(memory.used),
                    memory_total_bytes=int(memory.total),
                )
            )
        return uses
    except Exception as exc:  # noqa: BLE001 - a GPU that fell off the bus must not stop beats
        logger.warning("NVML query failed: %s", exc)
        return []
