"""Optimizers on extreme inputs: huge/tiny Muon gradients, sub-f32 AdamW eps, odd shapes, bf16."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_tensors

from kiln_train.errors import KilnError
from kiln_train.optim import AdamW, GradientSetError, Muon, Sgd
from kiln_train.optim.muon import NS_COEFFICIENTS, update_scale
from kiln_train.optim.state import encode_state


def _ns64(u: torch.Tensor, iters: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    x = u.double()
    t = x.shape[0] > x.shape[1]
    x = x.T if t else x
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(iters):
        g = x @ x.T
        x = a * x + (b * g + c * (g @ g)) @ x
    return x.T if t else x


@pytest.mark.parametrize("magnitude", [1e20, 1e30, 3e37])
def test_muon_huge_finite_gradient_still_updates(magnitude):
    """||g||_F overflows f32 here; the update must equal the one for the same direction at scale 1."""
    torch.manual_seed(1)
    direction = torch.randn(4, 64)
    p_big = torch.nn.Parameter(torch.zeros(4, 64))
    p_one = torch.nn.Parameter(torch.zeros(4, 64))
    Muon([("a", p_big)], 1e-3).step({"a": direction * magnitude})
    Muon([("a", p_one)], 1e-3).step({"a": direction})
    assert torch.isfinite(p_big).all()
    assert p_big.abs().max() > 0
    torch.testing.assert_close(p_big, p_one, rtol=1e-4, atol=1e-7)


def test_muon_tiny_gradient_matches_float64_reference():
    torch.manual_seed(2)
    g = torch.randn(3, 40) * 1e-25  # ||g||^2 underflows f32
    p = torch.nn.Parameter(torch.zeros(3, 40))
    Muon([("a", p)], 1e-2, nesterov=False, ns_iters=5).step({"a": g})
    expected = -1e-2 * update_scale((3, 40)) * _ns64(g, 5)
    torch.testing.assert_close(p.double(), expected, rtol=1e-4, atol=1e-30)


@pytest.mark.parametrize("shape", [(2, 2), (2, 9216), (9216, 2), (2, 3), (3, 2), (48, 248)])
@pytest.mark.parametrize("iters", [1, 20])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_float64_reference_on_odd_shapes(shape, iters, nesterov):
    torch.manual_seed(3)
    p0 = torch.randn(*shape)
    grads = [torch.randn(*shape) for _ in range(2)]
    p = torch.nn.Parameter(p0.clone())
    opt = Muon([("a", p)], 1e-2, momentum=0.9, nesterov=nesterov, ns_iters=iters, weight_decay=0.1)
    ref, buf = p0.double(), torch.zeros(shape, dtype=torch.float64)
    for g in grads:
        opt.step({"a": g})
        buf = 0.9 * buf + g.double()
        u = g.double() + 0.9 * buf if nesterov else buf
        ref = ref * (1 - 1e-2 * 0.1) - 1e-2 * update_scale(shape) * _ns64(u, iters)
    torch.testing.assert_close(p.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(opt.state["a"]["momentum"].double(), buf, rtol=1e-6, atol=1e-6)


def test_muon_zero_gradient_moves_only_by_weight_decay():
    p = torch.nn.Parameter(torch.ones(2, 5))
    Muon([("a", p)], 0.5, weight_decay=0.2).step({"a": torch.zeros(2, 5)})
    assert torch.equal(p.detach(), torch.full((2, 5), 0.9))


def test_muon_rejects_a_matrix_with_a_side_of_one():
    with pytest.raises(KilnError) as err:
        Muon([("a", torch.nn.Parameter(torch.zeros(1, 64)))], 1e-3)
    assert "lora_rank must be at least 2" in err.value.message


@pytest.mark.parametrize("eps", [1e-50, 1e-46, 5e-324])
def test_adamw_eps_below_f32_zero_gradient_stays_finite(eps):
    p = torch.nn.Parameter(torch.ones(3, 3))
    opt = AdamW([("a", p)], 1e-3, eps=eps, weight_decay=0.0)
    opt.step({"a": torch.zeros(3, 3)})
    opt.step({"a": torch.zeros(3, 3)})
    assert torch.equal(p.detach(), torch.ones(3, 3))
    assert torch.equal(opt.state["a"]["m"], torch.zeros(3, 3))
    assert opt.hyperparameters()["eps"] == eps


@pytest.mark.parametrize("eps", [1e-8, 1e-40])
def test_adamw_representable_eps_matches_torch(eps):
    """Any eps f32 represents (subnormal included) is used exactly: bitwise equal to torch.optim.AdamW."""
    torch.manual_seed(4)
    p0 = torch.randn(4, 6)
    grads = [torch.randn(4, 6) * 1e-3, torch.zeros(4, 6), torch.randn(4, 6)]
    ours = torch.nn.Parameter(p0.clone())
    theirs = torch.nn.Parameter(p0.clone())
    opt = AdamW([("a", ours)], 1e-3, beta1=0.0, beta2=0.999999, eps=eps, weight_decay=0.5)
    ref = torch.optim.AdamW(
        [theirs], lr=1e-3, betas=(0.0, 0.999999), eps=eps, weight_decay=0.5, foreach=False, fused=False
    )
    for g in grads:
        opt.step({"a": g})
        theirs.grad = g.clone()
        ref.step()
        assert torch.equal(ours.detach(), theirs.detach())


def test_bf16_adamw_rounds_once_and_state_round_trips_bit_exact():
    torch.manual_seed(5)
    p0 = torch.randn(8, 16).bfloat16()
    grads = [torch.randn(8, 16).bfloat16() for _ in range(3)]
    p = torch.nn.Parameter(p0.clone())
    opt = AdamW([("a", p)], 1e-2, weight_decay=0.01)
    # f32 reference of the same math, rounded once per step into bf16 storage.
    rp, rm, rv = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for step, g in enumerate(grads, 1):
        opt.step({"a": g})
        fp, fm, fv, fg = rp.float(), rm.float(), rv.float(), g.float()
        fp.mul_(1 - 1e-2 * 0.01)
        fm.lerp_(fg, 1 - 0.9)
        fv.mul_(0.999).addcmul_(fg, fg, value=1 - 0.999)
        denom = (fv.sqrt() / (1 - 0.999**step) ** 0.5).add_(1e-8)
        fp.addcdiv_(fm, denom, value=-(1e-2 / (1 - 0.9**step)))
        rp, rm, rv = fp.bfloat16(), fm.bfloat16(), fv.bfloat16()
        assert torch.equal(p.detach(), rp) and torch.equal(opt.state["a"]["m"], rm)
        assert torch.equal(opt.state["a"]["v"], rv)
    assert opt.state["a"]["m"].dtype == torch.bfloat16
    blob = encode_state(opt.state_tensors())
    other = AdamW([("a", torch.nn.Parameter(p.detach().clone()))], 1e-2, weight_decay=0.01)
    other.load_state_tensors(load_tensors(blob), global_step=3)
    for f in ("m", "v"):
        assert other.state["a"][f].dtype == torch.bfloat16
        assert torch.equal(other.state["a"][f], opt.state["a"][f])
    g = torch.randn(8, 16).bfloat16()
    opt.step({"a": g})
    other.step({"a": g})
    assert torch.equal(other.params["a"], opt.params["a"])


@pytest.mark.parametrize("cls", [Sgd, AdamW, Muon])
def test_one_bad_gradient_changes_nothing(cls):
    a = torch.nn.Parameter(torch.randn(4, 8))
    b = torch.nn.Parameter(torch.randn(8, 4).bfloat16())
    opt = cls([("a", a), ("b", b)], 1e-2)
    opt.step({"a": torch.randn(4, 8), "b": torch.randn(8, 4).bfloat16()})
    before = (
        a.detach().clone(),
        b.detach().clone(),
        opt.state_tensors(),
        dict(opt.param_steps),
        opt.step_count,
    )
    bad_b = torch.randn(8, 4).bfloat16()
    bad_b[3, 1] = float("inf")
    with pytest.raises(GradientSetError):
        opt.step({"a": torch.randn(4, 8), "b": bad_b})
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    after = opt.state_tensors()
    assert after.keys() == before[2].keys() and all(torch.equal(after[k], before[2][k]) for k in after)
    assert opt.param_steps == before[3] and opt.step_count == before[4]
