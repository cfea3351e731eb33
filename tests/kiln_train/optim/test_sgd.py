"""SGD: `p <- p - lr * g`, stateless, one rounding for bf16 parameters."""

from __future__ import annotations

import torch

from kiln_train.optim import Sgd, build_optimizer


def _params(dtype):
    gen = torch.Generator().manual_seed(3)
    return [
        ("a", torch.nn.Parameter(torch.randn(3, 5, generator=gen).to(dtype))),
        ("b", torch.nn.Parameter(torch.randn(5, 3, generator=gen).to(dtype))),
    ]


def _grads(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3, 5, generator=gen).to(dtype), "b": torch.randn(5, 3, generator=gen).to(dtype)}


def test_build_returns_sgd_with_the_given_rate():
    opt = build_optimizer("sgd", _params(torch.float32), 0.25)
    assert isinstance(opt, Sgd)
    assert opt.kind == "sgd" and opt.lr == 0.25
    assert opt.hyperparameters() == {"kind": "sgd"}


def test_f32_update_is_p_minus_lr_g():
    params = _params(torch.float32)
    before = {n: p.detach().clone() for n, p in params}
    opt = build_optimizer("sgd", params, 0.125)  # a power of two: lr*g is exact
    grads = _grads(torch.float32, 1)
    opt.step(grads)
    for n, p in params:
        assert torch.equal(p.detach(), before[n] - 0.125 * grads[n])
    assert opt.step_count == 1


def test_two_steps_accumulate_against_an_f64_reference():
    params = _params(torch.float32)
    ref = {n: p.detach().double().clone() for n, p in params}
    opt = build_optimizer("sgd", params, 3e-2)
    for seed in (1, 2):
        grads = _grads(torch.float32, seed)
        opt.step(grads)
        for n in ref:
            ref[n] -= 3e-2 * grads[n].double()
    for n, p in params:
        torch.testing.assert_close(p.detach().double(), ref[n], rtol=0, atol=1e-6)


def test_bf16_update_rounds_once_from_f32():
    params = _params(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in params}
    opt = build_optimizer("sgd", params, 3e-3)
    grads = _grads(torch.bfloat16, 4)
    opt.step(grads)
    for n, p in params:
        assert p.dtype == torch.bfloat16
        expected = (before[n].float() - 3e-3 * grads[n].float()).to(torch.bfloat16)
        assert torch.equal(p.detach(), expected)
    assert opt.state_tensors() == {}
