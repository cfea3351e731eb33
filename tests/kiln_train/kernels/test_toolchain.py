"""The toolchain report the worker image's build checks: Triton's version against fla's Hopper
guard and whether fla's kernels import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from packaging.version import Version

from kiln_train.kernels.toolchain import FLA_HOPPER_TRITON, gpu_kernels_problem, toolchain_report


def test_this_environment_reports_its_triton():
    import triton

    report = toolchain_report()
    assert report["triton"] == triton.__version__ and report["triton_importable"] is True
    assert report["fla_hopper_guard_passes"] is (Version(report["triton"]) >= FLA_HOPPER_TRITON)


@pytest.mark.parametrize(
    ("report", "problem"),
    [
        ({"triton": "3.7.1", "triton_importable": True, "fla_importable": True, "fla_hopper_guard_passes": True}, None),
        ({"triton": None, "triton_importable": False, "fla_importable": False, "fla_hopper_guard_passes": False}, "Triton is not importable"),
        ({"triton": "3.7.1", "triton_importable": True, "fla_importable": False, "fla_hopper_guard_passes": True}, "fla-core"),
        ({"triton": "3.6.0", "triton_importable": True, "fla_importable": True, "fla_hopper_guard_passes": False}, "3.6.0 < 3.7.1"),
    ],
)  # fmt: skip
def test_an_image_without_the_gpu_kernels_is_a_problem(report, problem):
    found = gpu_kernels_problem(report)
    assert found is None if problem is None else problem in found


def test_the_command_prints_the_report_and_fails_without_fla():
    proc = subprocess.run(
        [sys.executable, "-m", "kiln_train.kernels.toolchain"], capture_output=True, text=True
    )
    printed = json.loads(proc.stdout)
    assert printed["triton_importable"] is True
    assert proc.returncode == (0 if printed["problem"] is None else 1)
    if not printed["fla_importable"]:
        assert "fla-core" in printed["problem"]
