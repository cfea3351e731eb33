"""What the installed kernel toolchain can run: Triton's version and whether flash-linear-attention's
kernels import and pass its Hopper guard (docs/kernels.md#where-each-path-runs).

`python -m kiln_train.kernels.toolchain` prints the report and exits 1 when the worker image's
GPU kernels could not run (the worker image's build runs it); it needs no GPU.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata

from packaging.version import Version

# flash-linear-attention refuses its gated backward on Hopper with Triton 3.4 .. 3.7.0 (a Triton
# miscompilation fixed in 3.7.1); torch 2.13's CUDA build pins Triton 3.7.1.
FLA_HOPPER_TRITON = Version("3.7.1")


def toolchain_report() -> dict:
    """Versions and import status of Triton and flash-linear-attention's kernels (no GPU needed)."""
    report: dict = {"triton": _version("triton"), "fla_core": _version("fla-core")}
    report["triton_importable"] = _imports("triton")
    report["fla_importable"] = report["triton_importable"] and _imports("fla.ops.gated_delta_rule")
    triton = report["triton"]
    report["fla_hopper_guard_passes"] = triton is not None and Version(triton) >= FLA_HOPPER_TRITON
    return report


def gpu_kernels_problem(report: dict) -> str | None:
    """Why a worker image with this toolchain would not run the GPU kernels, or None."""
    if not report["triton_importable"]:
        return "Triton is not importable: Kiln's kernels would fall back to torch"
    if not report["fla_importable"]:
        return "flash-linear-attention's kernels (fla-core) are not importable"
    if not report["fla_hopper_guard_passes"]:
        return f"Triton {report['triton']} < {FLA_HOPPER_TRITON}: fla refuses its gated backward on Hopper"
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _imports(module: str) -> bool:
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fla warns when it finds no GPU (a build machine)
            importlib.import_module(module)
    except Exception:
        return False
    return True


def main() -> int:
    report = toolchain_report()
    problem = gpu_kernels_problem(report)
    print(json.dumps({**report, "problem": problem}, sort_keys=True))
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
