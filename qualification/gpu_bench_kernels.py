"""The fused operations alone, for `gpu_bench.py`: forward + backward of each at the model's widths
through the torch reference, Kiln's Triton kernel (where the backend chose it) and Liger-Kernel's
(where it is installed and has the operation, on CUDA), so the table's step times can be read
against the operations they contain. docs/kernels.md#benchmark. Imports torch."""

from __future__ import annotations

import time
from importlib import import_module

import torch

from kiln_train.kernels.paths import (
    CAUSAL_CONV1D_SILU,
    FUSED_OPS,
    GATED_RMS_NORM,
    OFFSET_RMS_NORM,
    SWIGLU,
    TRITON,
)
from qualification.gpu_bench_stages import sync

# Where each operation's Triton kernel lives (module under kiln_train.kernels, function).
KERNELS = {
    OFFSET_RMS_NORM: ("rms_norm", "rms_norm_offset"),
    GATED_RMS_NORM: ("gated_norm", "gated_rms_norm"),
    SWIGLU: ("swiglu", "silu_mul"),
    CAUSAL_CONV1D_SILU: ("causal_conv", "causal_conv1d_silu"),
}


def kernel_timings(resident, length: int) -> dict:
    """Forward + backward of each fused operation at the model's widths over `length` tokens: the
    torch reference, Kiln's Triton kernel where this backend chose it, Liger-Kernel's where it is
    installed and has the operation (on CUDA)."""
    device, dtype, cfg = resident.model.device, resident.model.dtype, resident.config
    out = {}
    for op in FUSED_OPS:
        args, impls = _operation(op, cfg, length, device, dtype)
        timings = {"torch": _time_fwd_bwd(impls["torch"], args, device)}
        if resident.kernel_paths.paths[op] == TRITON:
            timings["triton"] = _time_fwd_bwd(impls["triton"], args, device)
        if "liger" in impls and device.type == "cuda":
            timings["liger"] = _time_fwd_bwd(impls["liger"], args, device)
        out[op] = timings
    return out


def _operation(op: str, cfg, length: int, device, dtype):
    """(inputs, {implementation: callable}) of one fused operation at the model's widths."""
    from kiln_train.model import norms
    from kiln_train.model.gdn import CausalDepthwiseConv
    from kiln_train.model.mlp import silu_mul

    def rand(*shape):
        return torch.randn(shape, device=device).to(dtype)

    eps = cfg.rms_norm_eps
    if op == OFFSET_RMS_NORM:
        w = 0.1 * rand(cfg.hidden_size)
        impls = {
            "torch": lambda x: norms.rms_norm_offset(x, w, eps),
            "triton": lambda x: _kernel(op)(x, w, eps),
        }
        liger = _liger("rms_norm", "LigerRMSNormFunction")
        if liger is not None:
            impls["liger"] = lambda x: liger.apply(x, w, eps, 1.0, "gemma", False)
        return [rand(1, length, cfg.hidden_size)], impls
    if op == GATED_RMS_NORM:
        w = 1 + 0.1 * rand(cfg.linear_value_head_dim)
        shape = (1, length, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        impls = {
            "torch": lambda x, z: norms.gated_rms_norm(x, z, w, eps),
            "triton": lambda x, z: _kernel(op)(x, z, w, eps),
        }
        return [rand(*shape), rand(*shape)], impls
    if op == CAUSAL_CONV1D_SILU:
        conv = CausalDepthwiseConv(
            cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, device=device, dtype=dtype
        )
        conv.weight.copy_(0.3 * rand(*conv.weight.shape))
        impls = {"torch": lambda m: conv(m)[0], "triton": lambda m: _kernel(op)(m, conv.weight)[0]}
        return [rand(1, length, cfg.linear_conv_dim)], impls
    impls = {"torch": silu_mul, "triton": lambda g, u: _kernel(op)(g, u)}
    liger = _liger("swiglu", "LigerSiLUMulFunction")
    if liger is not None:
        impls["liger"] = liger.apply
    return [rand(1, length, cfg.intermediate_size), rand(1, length, cfg.intermediate_size)], impls


def _kernel(op: str):
    module, name = KERNELS[op]
    return getattr(import_module(f"kiln_train.kernels.{module}"), name)


def _liger(module: str, name: str):
    try:
        return getattr(import_module(f"liger_kernel.ops.{module}"), name)
    except Exception:  # not installed, or not importable on this toolchain
        return None


def _time_fwd_bwd(fn, inputs, device, reps: int = 5) -> float:
    """Best milliseconds of one forward + backward (after two warm-up rounds that compile)."""
    args = [x.detach().clone().requires_grad_() for x in inputs]
    best = float("inf")
    for i in range(reps + 2):
        sync(device)
        start = time.perf_counter()
        fn(*args).float().sum().backward()
        sync(device)
        if i >= 2:
            best = min(best, time.perf_counter() - start)
        for a in args:
            a.grad = None
    return best * 1000.0
