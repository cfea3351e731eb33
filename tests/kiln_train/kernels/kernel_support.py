"""What the kernel tests share: one forward + backward with a fixed cotangent, and the two
agreement measures (f32: against the reference; bf16: against an f64 truth, beside the
reference's own error)."""

from __future__ import annotations

import pytest
import torch

# The interpreter tests hand the kernels CPU tensors: with CUDA the kernels compile for the GPU
# instead, and test_kernels_gpu.py covers them there.
interpreted_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="an interpreter test; test_kernels_gpu.py covers CUDA"
)


def forward_backward(fn, inputs: list[torch.Tensor], cotangent: torch.Tensor) -> list[torch.Tensor]:
    """[output, gradient of every input] in f64, for `fn(*inputs)` pulled back along `cotangent`."""
    args = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*args)
    out = out[0] if isinstance(out, tuple) else out
    (out.double() * cotangent.double()).sum().backward()
    return [out.detach().double()] + [a.grad.double() for a in args]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference over the largest reference magnitude."""
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def assert_f32_agrees(reference, kernel, inputs, cotangent, tol: float = 1e-5) -> None:
    for i, (got, want) in enumerate(
        zip(
            forward_backward(kernel, inputs, cotangent),
            forward_backward(reference, inputs, cotangent),
            strict=True,
        )
    ):
        assert relative(got, want) <= tol, (i, relative(got, want))


def assert_bf16_as_accurate(reference, truth, kernel, inputs, cotangent) -> None:
    """The kernel's bf16 result is about as far from the f64 truth as the torch reference's bf16
    result is. Triton's interpreter rounds f32 -> bf16 toward zero where a GPU rounds to nearest,
    so on the CPU the kernel may sit up to a few rounding steps further out: 4x, and 3e-2 at most."""
    wide = [x.double() for x in inputs]
    want = forward_backward(truth, wide, cotangent)
    ours = forward_backward(kernel, inputs, cotangent)
    theirs = forward_backward(reference, inputs, cotangent)
    for i, (k, r, t) in enumerate(zip(ours, theirs, want, strict=True)):
        assert torch.isfinite(k).all()
        k_err, r_err = relative(k, t), relative(r, t)
        assert k_err <= max(4 * r_err, 1e-3) and k_err <= 3e-2, (i, k_err, r_err)


def saved_tensors(fn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor autograd keeps for backward while `fn(*inputs)` runs."""
    kept: list[torch.Tensor] = []

    def pack(t):
        kept.append(t)
        return t

    args = [x.detach().clone().requires_grad_() for x in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return kept
