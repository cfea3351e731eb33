"""The memory budget a training step may use on the resident device (`[memory]` settings), the
device's free and total memory, and the CPU allocator policy the estimate assumes. Torch-free
at import (only a CUDA device's query imports torch).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
from pathlib import Path

from kiln_train.ground.backend import Backend
from kiln_train.plan.memory import GIB


def available_budget(
    backend: Backend,
    *,
    total_bytes: int,
    free_bytes: int,
    reserve_gb: float,
    training_memory_gb: float | None = None,
) -> int:
    """Bytes a training step may use on the resident device (docs/memory.md#budget, `[memory]`).

    `free_bytes` is what the device reports with the model already resident (CUDA
    `torch.cuda.mem_get_info()[0]` in the worker; CPU `cpu_available_bytes()`), bounded by
    `total_bytes`. `[memory].reserve_gb` stays free beside the estimate (the contract's fixed
    1 GiB safety margin, configurable here), and `[memory].training_memory_gb` caps the result.
    The formula is the same for both backends; `backend` names whose numbers these are.
    """
    if backend.name not in ("cpu", "cuda"):
        raise ValueError(f"no budget rule for backend {backend.name!r}")
    if total_bytes < 0 or free_bytes < 0 or reserve_gb < 0:
        raise ValueError("memory figures must be non-negative")
    available = min(free_bytes, total_bytes) - math.ceil(reserve_gb * GIB)
    if training_memory_gb is not None:
        available = min(available, math.floor(training_memory_gb * GIB))
    return max(0, available)


def memory_budget(
    backend: Backend,
    memory: tuple[int | None, int | None],
    *,
    reserve_gb: float,
    training_memory_gb: float | None = None,
) -> int | None:
    """The budget of the device whose `(free, total)` bytes are `memory`: what `device_memory`
    measures now (the library, the worker at dequeue) or what a runner registered (admission).
    None when the device reports no free memory; an unknown total is the free memory. The one
    entry to `available_budget` for every caller."""
    free, total = memory
    if free is None:
        return None
    return available_budget(
        backend,
        total_bytes=total or free,
        free_bytes=free,
        reserve_gb=reserve_gb,
        training_memory_gb=training_memory_gb,
    )


def cpu_available_bytes(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int:
    """Host memory a new allocation can get: `MemAvailable`, bounded by a cgroup v2 limit if set."""
    available = None
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        if limit != "max":
            used = int(Path(cgroup, "memory.current").read_text().strip())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def device_memory(device: str) -> tuple[int | None, int | None]:
    """(free, total) bytes of the resident device; CPU: MemAvailable and MemTotal."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), int(total)
    total = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
    except OSError:
        pass
    return cpu_available_bytes(), total


# glibc mallopt parameters (malloc.h).
_M_MMAP_THRESHOLD = -3
CPU_MMAP_THRESHOLD_BYTES = 64 * 1024


def apply_cpu_allocator_policy(mmap_threshold: int = CPU_MMAP_THRESHOLD_BYTES) -> bool:
    """Make freed host tensors go back to the OS; the cpu estimate assumes this policy.

    glibc serves allocations below its mmap threshold from heap arenas, and by default raises that
    threshold (up to 32 MiB) every time a large block is freed, so most of a step's tensors end up
    in arenas that keep their high-water mark and fragment: on the `small` preset the resident set
    then grows step after step (~1.6x the live tensor bytes at T = 1024, ~4x at T = 256). A fixed
    64 KiB threshold maps every larger tensor directly and unmaps it on free, so resident memory
    follows live tensors and returns to the same level after every step. The cpu worker calls
    this once at start, before loading the model. Returns False where it cannot apply (not glibc).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
    except (OSError, AttributeError):
        return False
