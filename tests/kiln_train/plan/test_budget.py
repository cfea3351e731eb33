"""The memory budget: device free memory less the reserve, the optional cap, and what the CPU backend
reads from /proc/meminfo and the cgroup (docs/memory.md#budget)."""

from __future__ import annotations

import pytest

from kiln_train.plan.budget import available_budget, cpu_available_bytes, memory_budget
from kiln_train.plan.memory import GIB
from tests.kiln_train.plan.plan_support import CPU, CUDA


def test_available_budget_subtracts_reserve_and_applies_cap():
    total, free = 80 * GIB, 70 * GIB
    assert available_budget(CUDA, total_bytes=total, free_bytes=free, reserve_gb=1.0) == 69 * GIB
    assert (
        available_budget(CUDA, total_bytes=total, free_bytes=free, reserve_gb=1.0, training_memory_gb=20)
        == 20 * GIB
    )
    assert available_budget(CUDA, total_bytes=total, free_bytes=GIB // 2, reserve_gb=1.0) == 0
    assert (
        available_budget(CPU, total_bytes=8 * GIB, free_bytes=9 * GIB, reserve_gb=0.5) == 7 * GIB + GIB // 2
    )
    with pytest.raises(ValueError):
        available_budget(CPU, total_bytes=GIB, free_bytes=-1, reserve_gb=0)


def test_cpu_available_bytes_reads_meminfo_and_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert cpu_available_bytes(meminfo, cgroup) == 20_000_000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    assert cpu_available_bytes(meminfo, cgroup) == 20_000_000 * 1024
    (cgroup / "memory.max").write_text(str(8 * GIB) + "\n")
    (cgroup / "memory.current").write_text(str(3 * GIB) + "\n")
    assert cpu_available_bytes(meminfo, cgroup) == 5 * GIB
    assert cpu_available_bytes() > 0  # this machine


def test_memory_budget_is_the_budget_of_measured_or_registered_figures():
    """The one entry the api, the worker and the library use: (free, total) as measured or registered."""
    free, total = 70 * GIB, 80 * GIB
    assert memory_budget(CUDA, (free, total), reserve_gb=1.0) == available_budget(
        CUDA, total_bytes=total, free_bytes=free, reserve_gb=1.0
    )
    assert memory_budget(CUDA, (free, total), reserve_gb=1.0, training_memory_gb=20) == 20 * GIB
    # An unknown total is the free memory; unknown free memory gives no budget at all.
    assert memory_budget(CPU, (4 * GIB, None), reserve_gb=0.5) == 3 * GIB + GIB // 2
    assert memory_budget(CPU, (None, 8 * GIB), reserve_gb=0.5) is None
