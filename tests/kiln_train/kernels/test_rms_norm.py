"""The offset RMSNorm kernel against `kiln_train.model.norms.rms_norm_offset`: values and
gradients in f32 and bf16 at odd widths and row counts, strided inputs, what it saves, and the
inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from kiln_train.kernels.rms_norm import rms_norm_offset as fused
from kiln_train.model.norms import rms_norm_offset
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
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.4).to(dtype)
    return x, w, torch.randn(shape, generator=g)


@pytest.mark.parametrize("shape", [(1, 1, 7), (3, 37, 70), (2, 5, 9, 256), (1, 13, 2560)])
def test_f32_values_and_gradients_match_the_reference(shape):
    x, w, cot = _inputs(shape, torch.float32)
    assert_f32_agrees(lambda x: rms_norm_offset(x, w, EPS), lambda x: fused(x, w, EPS), [x], cot)


@pytest.mark.parametrize("shape", [(3, 37, 70), (2, 5, 9, 256)])
def test_bf16_is_as_accurate_as_the_reference(shape):
    x, w, cot = _inputs(shape, torch.bfloat16, seed=1)
    assert_bf16_as_accurate(
        lambda x: rms_norm_offset(x, w, EPS),
        lambda x: rms_norm_offset(x, w.double(), EPS),
        lambda x: fused(x, w, EPS),
        [x],
        cot,
    )


def test_a_strided_slice_of_a_wider_tensor_is_normalised_in_place_of_a_copy():
    """The attention q norm reads the query half of q_proj's [.., heads, 2·head_dim] output."""
    wide, w, _ = _inputs((2, 11, 3, 2 * 32), torch.float32, seed=2)
    query = wide[..., :32]
    cot = torch.randn(query.shape)
    assert_f32_agrees(
        lambda q: rms_norm_offset(q, w[:32], EPS), lambda q: fused(q, w[:32], EPS), [query], cot
    )
    y = fused(query, w[:32], EPS)
    assert y.shape == query.shape and y.is_contiguous()


def test_backward_keeps_the_input_and_one_f32_statistic_per_row():
    x, w, _ = _inputs((4, 9, 96), torch.bfloat16, seed=3)
    kept = saved_tensors(lambda x: fused(x, w, EPS), [x])
    wide = [t for t in kept if t.numel() == x.numel()]
    assert [t.dtype for t in wide] == [torch.bfloat16]  # x as given, no f32 copy
    stats = [t for t in kept if t.dtype == torch.float32]
    assert [t.numel() for t in stats] == [4 * 9]


def test_the_weight_gets_no_gradient_and_a_trainable_weight_is_refused():
    x, w, _ = _inputs((2, 3, 16), torch.float32, seed=4)
    x.requires_grad_()
    fused(x, w, EPS).sum().backward()
    assert w.grad is None and x.grad is not None
    with pytest.raises(ValueError, match="frozen"):
        fused(x, w.clone().requires_grad_(), EPS)


@pytest.mark.parametrize(
    ("x", "w", "message"),
    [
        (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64), "covers"),
        (torch.zeros(2, 8), torch.zeros(8, dtype=torch.bfloat16), "every input"),
        (torch.zeros(2, 8), torch.zeros(9), "width"),
    ],
)
def test_inputs_the_kernel_cannot_take_are_refused(x, w, message):
    with pytest.raises(ValueError, match=message):
        fused(x, w, EPS)
