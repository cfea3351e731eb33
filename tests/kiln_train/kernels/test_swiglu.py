"""The SwiGLU product kernel against `kiln_train.model.mlp.silu_mul`: values and
gradients in f32 and bf16, the whole MLP with the kernel switched on, and what it saves."""

from __future__ import annotations

import pytest
import torch

from kiln_train.kernels.paths import TRITON
from kiln_train.kernels.swiglu import silu_mul
from kiln_train.model.mlp import SwiGLU
from kiln_train.model.mlp import silu_mul as reference
from tests.kiln_train.kernels.kernel_support import (
    assert_bf16_as_accurate,
    assert_f32_agrees,
    interpreted_only,
    saved_tensors,
)

pytestmark = interpreted_only


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * 3).to(dtype) for _ in range(2)] + [
        torch.randn(shape, generator=g)
    ]


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 37, 70), (1, 5, 4099)])
def test_f32_values_and_gradients_match_thereference(shape):
    gate, up, cot = _inputs(shape, torch.float32)
    assert_f32_agrees(reference, silu_mul, [gate, up], cot)


def test_bf16_is_as_accurate_as_thereference():
    gate, up, cot = _inputs((3, 37, 70), torch.bfloat16, seed=1)
    assert_bf16_as_accurate(reference, reference, silu_mul, [gate, up], cot)


def test_the_mlp_on_the_kernel_matches_the_mlp_on_thereference():
    torch.manual_seed(2)
    mlp = SwiGLU(48, 136)
    for buf in mlp.buffers():
        buf.normal_(0, buf.shape[-1] ** -0.5)
    x, cot = torch.randn(2, 9, 48), torch.randn(2, 9, 48)
    on_kernel = SwiGLU(48, 136)
    on_kernel.load_state_dict(mlp.state_dict())
    on_kernel.kernel_path = TRITON
    assert_f32_agrees(mlp, on_kernel, [x], cot)


def test_backward_keeps_gate_and_up_only():
    gate, up, _ = _inputs((2, 5, 64), torch.bfloat16, seed=3)
    kept = saved_tensors(silu_mul, [gate, up])
    assert len(kept) == 2 and all(t.dtype == torch.bfloat16 and t.shape == gate.shape for t in kept)


def test_inputs_the_kernel_cannot_take_are_refused():
    with pytest.raises(ValueError, match="differ in shape"):
        silu_mul(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="covers"):
        silu_mul(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
