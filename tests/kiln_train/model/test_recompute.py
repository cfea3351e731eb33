"""The layers keep only each projection group's input and rebuild the rest in backward
(kiln_train/model/recompute.py): outputs are bit-identical to the plain modules, gradients equal
plain autograd, and the GDN rebuild in blocks equals the whole-sequence one."""

from __future__ import annotations

import pytest
import torch

import kiln_train.model.gdn as gdn_module
from kiln_train.model.config import parse_config
from kiln_train.model.gdn import GatedDeltaNet
from kiln_train.model.linear import FrozenLinear
from kiln_train.model.norms import OffsetRMSNorm
from kiln_train.model.recompute import SegmentOutputs, project, recompute, segment_outputs
from kiln_train.model.tiny import text_config, wrapper_config

F64 = torch.float64


def _linear(gen, n_in, n_out, rank=4):
    lin = FrozenLinear(n_in, n_out, dtype=F64)
    lin.weight.copy_(torch.randn(n_out, n_in, generator=gen, dtype=F64) * 0.3)
    a = torch.nn.Parameter(torch.randn(rank, n_in, generator=gen, dtype=F64) * 0.3)
    b = torch.nn.Parameter(torch.randn(n_out, rank, generator=gen, dtype=F64) * 0.3)
    lin.set_lora(a, b, 2.0)
    return lin


def _group():
    gen = torch.Generator().manual_seed(0)
    norm = OffsetRMSNorm(8, 1e-6, dtype=F64)
    norm.weight.copy_(torch.randn(8, generator=gen, dtype=F64) * 0.1)
    linears = (_linear(gen, 8, 6), _linear(gen, 8, 3))
    h = torch.randn(2, 5, 8, generator=gen, dtype=F64, requires_grad=True)
    return norm, linears, h


def _grads(outputs, leaves):
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=F64).view_as(o)).sum() for o in outputs)
    return torch.autograd.grad(loss, leaves)


def test_project_equals_the_plain_modules_and_keeps_only_its_input():
    norm, linears, h = _group()
    plain = [lin(norm(h)) for lin in linears]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        fused = project(norm, (h,), linears)
    assert all(torch.equal(p, f) for p, f in zip(plain, fused, strict=True))  # bit-identical forward
    assert [t.data_ptr() for t in kept] == [h.data_ptr()]  # h once: no normed x, no x·Aᵀ
    leaves = [h] + [p for lin in linears for p in (lin.lora_A, lin.lora_B)]
    for want, got in zip(_grads(plain, leaves), _grads(fused, leaves), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_an_unused_output_and_an_input_without_grad_give_the_right_gradients():
    norm, linears, h = _group()
    x = h.detach()  # like the embedding output feeding layer 0: no gradient wanted
    leaves = [p for lin in linears for p in (lin.lora_A, lin.lora_B)]
    want = _grads([linears[0](norm(x))], leaves[:2])
    got = _grads([project(norm, (x,), linears)[0]], leaves)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    assert got[2].abs().max() == 0 and got[3].abs().max() == 0  # the unused projection's LoRA


def test_recompute_keeps_inputs_and_rebuilds_the_graph():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(4, 6, generator=gen, dtype=F64, requires_grad=True)
    b = torch.randn(4, 6, generator=gen, dtype=F64, requires_grad=True)

    def fn(x, y):
        return torch.tanh(x) * y.exp(), (x * y).sum(-1)

    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = recompute(fn, a, b)
    assert sorted(t.data_ptr() for t in kept) == sorted((a.data_ptr(), b.data_ptr()))
    want = _grads(fn(a, b), [a, b])
    got = _grads(out, [a, b])
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_a_kept_group_is_computed_once_and_replayed_in_the_recomputation():
    norm, linears, h = _group()
    store = SegmentOutputs()
    with segment_outputs(store):
        first = project(norm, (h,), linears, keep=True)
    assert len(store.outputs) == 1
    linears[0].weight.mul_(0)  # a replay must not recompute the matmul
    with segment_outputs(store):
        again = project(norm, (h,), linears, keep=True)
    assert store.replaying and torch.equal(again[0], first[0])


@pytest.mark.parametrize("block", [32, 64])
def test_gdn_rebuilt_in_blocks_equals_the_whole_sequence(monkeypatch, block):
    cfg = parse_config(wrapper_config(text_config("tiny", {"vocab_size": 64})))
    torch.manual_seed(5)
    layer = GatedDeltaNet(cfg, dtype=F64)
    for buf in layer.buffers():
        buf.copy_(torch.randn_like(buf) * (0.3 if buf.dim() > 1 else 0.5))
    x = torch.randn(2, 150, cfg.hidden_size, dtype=F64, requires_grad=True)
    weights = torch.randn(2, 150, cfg.hidden_size, dtype=F64)
    whole = layer(x)
    (want,) = torch.autograd.grad((whole * weights).sum(), x)
    monkeypatch.setattr(gdn_module, "RECOMPUTE_BLOCK", block)
    blocked = layer(x)
    (got,) = torch.autograd.grad((blocked * weights).sum(), x)
    assert (blocked - whole).abs().max().item() < 1e-10
    assert (got - want).abs().max().item() < 1e-10
