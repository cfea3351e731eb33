"""The backend's choice of kernel paths, made once per process when the resident model loads
(docs/kernels.md#choice).

On CUDA each fused operation runs Kiln's Triton kernel when Triton imports and the kernel's
agreement check passes at the model's widths in the model's dtype, and the gated delta rule runs
flash-linear-attention when its own check passes (`kiln_train.model.delta_rule`); anything else
runs the torch reference. On the CPU everything runs the torch reference. No request can change
the choice.
"""

from __future__ import annotations

import functools
import logging

import torch

from kiln_train.kernels.paths import (
    CAUSAL_CONV1D_SILU,
    FLA,
    FUSED_OPS,
    GATED_DELTA_RULE,
    GATED_RMS_NORM,
    GDN_IMPL,
    OFFSET_RMS_NORM,
    SWIGLU,
    TORCH,
    TORCH_CHUNKED,
    TRITON,
    KernelPaths,
)
from kiln_train.model.config import Qwen35Config

log = logging.getLogger(__name__)

CPU_REASON = "the CPU backend runs the torch reference"


def choose_kernel_paths(device: torch.device | str, dtype: torch.dtype, config: Qwen35Config) -> KernelPaths:
    """The kernel paths a model of `config` in `dtype` trains with on `device` (checks run once)."""
    from kiln_train.model.delta_rule import canonical_device

    device = torch.device(device)
    if device.type != "cuda":
        return KernelPaths.reference(CPU_REASON)
    paths = checked_paths(canonical_device(device), dtype, config)
    for op, reason in sorted(paths.reasons.items()):
        log.warning("kernel path of %s on %s: %s (%s)", op, device, paths.paths[op], reason)
    return paths


@functools.cache
def checked_paths(device: torch.device, dtype: torch.dtype, config: Qwen35Config) -> KernelPaths:
    """Run every agreement check on `device` (any device: the tests run them through Triton's
    interpreter on the CPU) and keep what passes."""
    from kiln_train.model.delta_rule import fla_unusable_reason

    paths, reasons = {}, {}
    reason = fla_unusable_reason(device)
    paths[GATED_DELTA_RULE] = FLA if reason is None else TORCH_CHUNKED
    if reason is not None:
        reasons[GATED_DELTA_RULE] = reason
    shared = triton_unusable_reason(dtype)
    for op in FUSED_OPS:
        reason = shared or _disagreement(op, config, device, dtype)
        paths[op] = TRITON if reason is None else TORCH
        if reason is not None:
            reasons[op] = reason
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the checks' blocks must not read as used memory in the budget
    return KernelPaths(paths, reasons)


def triton_unusable_reason(dtype: torch.dtype) -> str | None:
    """Why no Triton kernel can run for a model in `dtype`, or None."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # not installed, or broken against this torch
        return f"Triton is not importable ({type(exc).__name__}: {exc})"
    from kiln_train.kernels.layout import KERNEL_DTYPES

    if dtype not in KERNEL_DTYPES:
        return f"the Triton kernels cover {', '.join(str(d) for d in KERNEL_DTYPES)}, not {dtype}"
    return None


def _disagreement(op: str, config: Qwen35Config, device: torch.device, dtype: torch.dtype) -> str | None:
    from kiln_train.model.kernel_agreement import disagreement

    return disagreement(op, config, device, dtype)


def use_kernel_paths(model, paths: KernelPaths) -> None:
    """Set every module of `model` (a Qwen35Model) to run its operation on `paths`."""
    from kiln_train.model.gdn import CausalDepthwiseConv
    from kiln_train.model.mlp import SwiGLU
    from kiln_train.model.norms import GatedRMSNorm, OffsetRMSNorm

    owners = {
        OffsetRMSNorm: OFFSET_RMS_NORM,
        GatedRMSNorm: GATED_RMS_NORM,
        SwiGLU: SWIGLU,
        CausalDepthwiseConv: CAUSAL_CONV1D_SILU,
    }
    model.set_gdn_impl(GDN_IMPL[paths.paths[GATED_DELTA_RULE]])
    for module in model.modules():
        op = owners.get(type(module))
        if op is not None:
            module.kernel_path = paths.paths[op]
