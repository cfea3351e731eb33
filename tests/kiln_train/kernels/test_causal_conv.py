"""The causal depthwise conv1d + SiLU kernel against `kiln_train.model.gdn.CausalDepthwiseConv`:
values and gradients (of m, and of a carried prefix) in f32 and bf16, sequences shorter than the
kernel, the carried tail, what it saves, and the inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from kiln_train.kernels.causal_conv import causal_conv1d_silu
from kiln_train.model.gdn import CausalDepthwiseConv
from tests.kiln_train.kernels.kernel_support import (
    assert_bf16_as_accurate,
    assert_f32_agrees,
    interpreted_only,
    saved_tensors,
)

pytestmark = interpreted_only


def _conv(channels, kernel, dtype, seed=0):
    conv = CausalDepthwiseConv(channels, kernel, dtype=dtype)
    conv.weight.copy_(torch.randn(conv.weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.6)
    return conv


def _randn(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(("b", "t", "c", "k"), [(1, 1, 3, 4), (2, 37, 45, 4), (1, 70, 130, 3), (1, 5, 8, 1)])
def test_f32_values_and_gradients_match_the_reference(b, t, c, k):
    conv = _conv(c, k, torch.float32)
    m = _randn((b, t, c), torch.float32, 1)
    cot = _randn((b, t, c), torch.float32, 2)
    assert_f32_agrees(conv, lambda m: causal_conv1d_silu(m, conv.weight), [m], cot)


@pytest.mark.parametrize("t", [2, 3, 29])
def test_a_carried_prefix_gets_its_gradient_too(t):
    conv = _conv(45, 4, torch.float32, seed=3)
    m, prefix = _randn((2, t, 45), torch.float32, 4), _randn((2, 3, 45), torch.float32, 5)
    cot = _randn((2, t, 45), torch.float32, 6)
    assert_f32_agrees(conv, lambda m, p: causal_conv1d_silu(m, conv.weight, p), [m, prefix], cot)


@pytest.mark.parametrize("t", [1, 2, 3, 10])
def test_the_carried_tail_is_the_references(t):
    conv = _conv(12, 4, torch.float32, seed=7)
    m, prefix = _randn((2, t, 12), torch.float32, 8), _randn((2, 3, 12), torch.float32, 9)
    for carried in (None, prefix):
        _, want = conv(m, carried)
        _, got = causal_conv1d_silu(m, conv.weight, carried)
        assert torch.equal(got, want)


def test_bf16_is_as_accurate_as_the_reference():
    conv = _conv(45, 4, torch.bfloat16, seed=10)
    wide = _conv(45, 4, torch.float64, seed=10)
    wide.weight.copy_(conv.weight)
    m, cot = _randn((2, 29, 45), torch.bfloat16, 11), _randn((2, 29, 45), torch.float32, 12)
    assert_bf16_as_accurate(conv, wide, lambda m: causal_conv1d_silu(m, conv.weight), [m], cot)


def test_backward_keeps_the_input_and_no_activation():
    conv = _conv(32, 4, torch.bfloat16, seed=13)
    m = _randn((2, 16, 32), torch.bfloat16, 14)
    kept = saved_tensors(lambda m: causal_conv1d_silu(m, conv.weight)[0], [m])
    wide = {t.data_ptr(): t for t in kept if t.numel() == m.numel()}
    assert len(wide) == 1 and next(iter(wide.values())).dtype == torch.bfloat16  # m itself, once
    assert all(t.numel() in (m.numel(), conv.weight.numel()) for t in kept)


def test_inputs_the_kernel_cannot_take_are_refused():
    conv = _conv(8, 4, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        causal_conv1d_silu(torch.zeros(1, 3, 9), conv.weight)
    with pytest.raises(ValueError, match="prefix must be"):
        causal_conv1d_silu(torch.zeros(1, 3, 8), conv.weight, torch.zeros(1, 2, 8))
    with pytest.raises(ValueError, match="frozen"):
        causal_conv1d_silu(torch.zeros(1, 3, 8), conv.weight.clone().requires_grad_())
