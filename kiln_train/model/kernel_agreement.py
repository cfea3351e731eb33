"""Agreement checks: each Triton kernel against the torch reference in kiln_train/model/, at the
model's own widths, on the device and in the dtype it will train with (docs/kernels.md#agreement).

A check builds the model's module twice over the same frozen weights, runs a seeded forward and
backward (odd row counts, so masked tails are exercised) through the reference and through the
kernel, and compares the output and every input gradient against the largest reference
magnitude. The tolerance sits far above rounding (the kernels round where the reference does)
and far below what a miscompiled or mis-launched kernel produces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln_train.kernels.paths import (
    CAUSAL_CONV1D_SILU,
    GATED_RMS_NORM,
    OFFSET_RMS_NORM,
    SWIGLU,
    TORCH,
    TRITON,
)
from kiln_train.model.config import Qwen35Config

ROWS = 67
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def disagreement(op: str, config: Qwen35Config, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the Triton kernel of `op` agrees with the reference on `device` in `dtype`, else why not."""
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for name, build, inputs in CASES[op](config):
                found = _compare(name, build, inputs, device, dtype)
                if found is not None:
                    return found
    except Exception as exc:  # the kernel failed to compile or launch here: the reference runs
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"the Triton {op} kernel failed on {device}: {type(exc).__name__}: {first}"
    return None


def _compare(name: str, build: Callable, shapes: list, device, dtype) -> str | None:
    gen = torch.Generator(device=device).manual_seed(0)
    module = build(dtype, device)
    with torch.no_grad():  # projections scaled like a trained model's (std 1/√fan-in)
        for buf in module.buffers():
            std = buf.shape[-1] ** -0.5 if buf.dim() == 2 else 0.5
            buf.copy_(torch.randn(buf.shape, generator=gen, device=device) * std)
    inputs = [torch.randn(s, generator=gen, device=device).to(dtype) for s in shapes]
    results = []
    for kernel in (TORCH, TRITON):
        for m in module.modules():
            if hasattr(m, "kernel_path"):
                m.kernel_path = kernel
        args = [x.clone().requires_grad_() for x in inputs]
        out = module(*args)
        out = out[0] if isinstance(out, tuple) else out
        cotangent = torch.randn(
            out.shape, generator=torch.Generator(device=device).manual_seed(1), device=device
        )
        (out.float() * cotangent).sum().backward()
        results.append([out.detach().float()] + [a.grad.float() for a in args])
    tol = TOLERANCE[dtype]
    for i, (want, got) in enumerate(zip(*results, strict=True)):
        what = "output" if i == 0 else f"gradient of input {i}"
        if not bool(torch.isfinite(got).all()):
            return f"the Triton {name} kernel's {what} is not finite"
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        if not err <= tol:
            return (
                f"the Triton {name} kernel disagrees with the torch reference ({what}: {err:.2e} > {tol:.0e})"
            )
    return None


# ----- the cases: (name, module builder, input shapes) per operation ------------------------------
def _offset_norm_cases(config: Qwen35Config) -> list:
    from kiln_train.model.norms import OffsetRMSNorm

    widths = sorted({config.hidden_size, config.head_dim})
    return [
        (f"offset RMSNorm (width {w})", _builder(OffsetRMSNorm, w, config.rms_norm_eps), [(1, ROWS, w)])
        for w in widths
    ]


def _gated_norm_cases(config: Qwen35Config) -> list:
    from kiln_train.model.norms import GatedRMSNorm

    nv, dv = config.linear_num_value_heads, config.linear_value_head_dim
    shape = (1, ROWS, nv, dv)
    return [("gated RMSNorm", _builder(GatedRMSNorm, dv, config.rms_norm_eps), [shape, shape])]


def _swiglu_cases(config: Qwen35Config) -> list:
    from kiln_train.model.mlp import SwiGLU

    build = _builder(SwiGLU, config.hidden_size, config.intermediate_size)
    return [("SwiGLU", build, [(1, ROWS, config.hidden_size)])]


def _conv_cases(config: Qwen35Config) -> list:
    from kiln_train.model.gdn import CausalDepthwiseConv

    c, k = config.linear_conv_dim, config.linear_conv_kernel_dim
    build = _builder(CausalDepthwiseConv, c, k)
    return [
        ("causal conv1d", build, [(1, ROWS, c)]),
        ("causal conv1d with a carried prefix", build, [(2, ROWS, c), (2, k - 1, c)]),
    ]


def _builder(cls, *args):
    def build(dtype, device):
        return cls(*args, device=device, dtype=dtype)

    return build


CASES = {
    OFFSET_RMS_NORM: _offset_norm_cases,
    GATED_RMS_NORM: _gated_norm_cases,
    SWIGLU: _swiglu_cases,
    CAUSAL_CONV1D_SILU: _conv_cases,
}
