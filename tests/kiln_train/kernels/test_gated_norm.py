"""The GDN gated RMSNorm kernel against `kiln_train.model.norms.gated_rms_norm`: values and
gradients of x and the gate in f32 and bf16, what it saves, and the inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from kiln_train.kernels.gated_norm import gated_rms_norm as fused
from kiln_train.model.norms import gated_rms_norm
from tests.kiln_train.kernels.kernel_support import (
    assert_bf16_as_accurate,
    assert_f32_agrees,
    interpreted_only,
    saved_tensors,
)

pytestmark = interpreted_only

EPS = 1e-6


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    z = (torch.randn(shape, generator=g) * 2).to(dtype)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, z, w, torch.randn(shape, generator=g)


@pytest.mark.parametrize("shape", [(1, 1, 1, 5), (2, 19, 3, 70), (1, 33, 4, 128)])
def test_f32_values_and_gradients_match_the_reference(shape):
    x, z, w, cot = _inputs(shape, torch.float32)
    assert_f32_agrees(
        lambda x, z: gated_rms_norm(x, z, w, EPS), lambda x, z: fused(x, z, w, EPS), [x, z], cot
    )


@pytest.mark.parametrize("shape", [(2, 19, 3, 70), (1, 33, 4, 128)])
def test_bf16_is_as_accurate_as_the_reference(shape):
    x, z, w, cot = _inputs(shape, torch.bfloat16, seed=1)
    assert_bf16_as_accurate(
        lambda x, z: gated_rms_norm(x, z, w, EPS),
        lambda x, z: gated_rms_norm(x, z, w.double(), EPS),
        lambda x, z: fused(x, z, w, EPS),
        [x, z],
        cot,
    )


def test_backward_keeps_x_and_the_gate_and_one_f32_statistic_per_row():
    x, z, w, _ = _inputs((2, 7, 3, 64), torch.bfloat16, seed=2)
    kept = saved_tensors(lambda x, z: fused(x, z, w, EPS), [x, z])
    wide = [t for t in kept if t.numel() == x.numel()]
    assert [t.dtype for t in wide] == [torch.bfloat16, torch.bfloat16]
    stats = [t for t in kept if t.dtype == torch.float32]
    assert [t.numel() for t in stats] == [2 * 7 * 3]


@pytest.mark.parametrize(
    ("x", "z", "w", "message"),
    [
        (torch.zeros(2, 8), torch.zeros(2, 9), torch.zeros(8), "do not fit"),
        (torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(4), "do not fit"),
        (torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), "every input"),
        (torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(8, requires_grad=True), "frozen"),
    ],
)
def test_inputs_the_kernel_cannot_take_are_refused(x, z, w, message):
    with pytest.raises(ValueError, match=message):
        fused(x, z, w, EPS)
