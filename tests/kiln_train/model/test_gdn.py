"""Gated DeltaNet: chunked form vs the per-token recurrence, carried state, the layer, the oracle."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from kiln_train.model.config import parse_config
from kiln_train.model.delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
    resolve_impl,
)
from kiln_train.model.gdn import CausalDepthwiseConv, GatedDeltaNet
from kiln_train.model.tiny import text_config, wrapper_config


def _inputs(b, t, hk, hv, dk, dv, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=g, dtype=dtype)
    k = torch.randn(b, t, hk, dk, generator=g, dtype=dtype)
    v = torch.randn(b, t, hv, dv, generator=g, dtype=dtype)
    # Realistic log-decays: -exp(A_log)*softplus(a + dt_bias) with A in [1, 16].
    decay = -torch.empty(b, t, hv, dtype=dtype).uniform_(0.0, 3.0, generator=g)
    beta = torch.rand(b, t, hv, generator=g, dtype=dtype)
    tensors = [q, k, v, decay, beta]
    if requires_grad:
        tensors = [x.requires_grad_() for x in tensors]
    return tensors


@pytest.mark.parametrize(
    "b,t,hk,hv,dk,dv,chunk",
    [
        (1, 1, 2, 2, 16, 16, 64),
        (2, 63, 2, 4, 16, 8, 64),
        (1, 64, 1, 3, 8, 12, 64),
        (2, 65, 2, 6, 16, 16, 64),
        (1, 200, 2, 4, 32, 16, 64),
        (1, 77, 2, 4, 16, 16, 16),
    ],
)
def test_chunked_equals_recurrence_f64(b, t, hk, hv, dk, dv, chunk):
    q, k, v, g, beta = _inputs(b, t, hk, hv, dk, dv)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, output_final_state=True)
    assert o.shape == (b, t, hv, dv) and s.shape == (b, hv, dk, dv)
    assert o.dtype == torch.float64
    assert (o - o_ref).abs().max().item() < 1e-10
    assert (s - s_ref).abs().max().item() < 1e-10
    assert o_ref.abs().max().item() > 1e-2  # the comparison is not between two near-zero tensors


@pytest.mark.parametrize("split", [1, 40, 64, 130])
def test_split_sequence_with_carried_state_equals_whole(split):
    q, k, v, g, beta = _inputs(2, 150, 2, 4, 16, 16, seed=1)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    parts = [slice(0, split), slice(split, 150)]
    outs, state = [], None
    for p in parts:
        o, state = chunk_gated_delta_rule(
            q[:, p], k[:, p], v[:, p], g[:, p], beta[:, p], initial_state=state, output_final_state=True
        )
        outs.append(o)
    assert (torch.cat(outs, 1) - whole).abs().max().item() < 1e-10
    assert (state - s_whole).abs().max().item() < 1e-10
    o_rec, s_rec = recurrent_gated_delta_rule(
        q[:, split:],
        k[:, split:],
        v[:, split:],
        g[:, split:],
        beta[:, split:],
        initial_state=chunk_gated_delta_rule(
            q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split], output_final_state=True
        )[1],
        output_final_state=True,
    )
    assert (o_rec - whole[:, split:]).abs().max().item() < 1e-10


def test_chunked_gradients_equal_recurrence_gradients_f64():
    args = _inputs(1, 90, 2, 4, 8, 8, seed=2, requires_grad=True)
    w = torch.randn(1, 90, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    grads = []
    for fn in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        o, s = fn(*args, output_final_state=True)
        grads.append(torch.autograd.grad((o * w).sum() + s.sum(), args))
    for ref, got in zip(*grads, strict=True):
        assert (ref - got).abs().max().item() < 1e-9 * max(1.0, ref.abs().max().item())


def test_matches_transformers_torch_fallbacks_f32():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    hf_chunk = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    q, k, v, g, beta = _inputs(2, 130, 2, 6, 16, 16, dtype=torch.float32, seed=3)
    ours, s_ours = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    ref, s_ref = hf_chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)
    assert (ours - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    assert (s_ours - s_ref).abs().max().item() < 1e-5 * s_ref.abs().max().item()


def test_flash_linear_attention_is_never_selected_on_cpu():
    assert resolve_impl("auto", torch.device("cpu")) == "chunk"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_impl("fla", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown"):
        resolve_impl("triton", torch.device("cpu"))
    q, k, v, g, beta = _inputs(1, 10, 1, 1, 4, 4)
    a, _ = gated_delta_rule(q, k, v, g, beta)
    b, _ = gated_delta_rule(q, k, v, g, beta, impl="recurrent")
    assert (a - b).abs().max().item() < 1e-12


def test_rejects_bad_head_ratio_and_state_shape():
    q, k, v, g, beta = _inputs(1, 4, 2, 3, 4, 4)
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta = _inputs(1, 4, 2, 4, 4, 4)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 4, 4, dtype=torch.float64))


def test_causal_conv_equals_conv1d_and_carries_its_tail():
    gen = torch.Generator().manual_seed(4)
    conv = CausalDepthwiseConv(12, 4, dtype=torch.float64)
    conv.weight.copy_(torch.randn(12, 1, 4, generator=gen, dtype=torch.float64))
    m = torch.randn(2, 30, 12, generator=gen, dtype=torch.float64)
    ours, tail = conv(m)
    ref = F.silu(F.conv1d(m.transpose(1, 2), conv.weight, padding=3, groups=12)[..., :30]).transpose(1, 2)
    assert (ours - ref).abs().max().item() < 1e-12
    assert torch.equal(tail, m[:, -3:])
    first, tail1 = conv(m[:, :11])
    second, _ = conv(m[:, 11:], tail1)
    assert (torch.cat((first, second), 1) - ours).abs().max().item() < 1e-12


def test_gdn_layer_state_carry_equals_whole_sequence():
    cfg = parse_config(wrapper_config(text_config("tiny", {"vocab_size": 64})))
    torch.manual_seed(5)
    layer = GatedDeltaNet(cfg, dtype=torch.float64)
    for buf in layer.buffers():
        buf.copy_(torch.randn_like(buf) * (0.3 if buf.dim() > 1 else 0.5))
    x = torch.randn(2, 100, cfg.hidden_size, dtype=torch.float64)
    whole = layer(x)
    a, state = layer.forward_with_state(x[:, :37], None)
    b, _ = layer.forward_with_state(x[:, 37:], state)
    assert (torch.cat((a, b), 1) - whole).abs().max().item() < 1e-10
    layer.impl = "recurrent"
    assert (layer(x) - whole).abs().max().item() < 1e-10
