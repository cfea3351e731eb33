"""Muon: an independent f64 reference step, Newton–Schulz singular values, rank rules; gradients
whose norm overflows or underflows f32, and odd shapes."""

from __future__ import annotations

import math

import pytest
import torch

from kiln_train.errors import KilnError
from kiln_train.optim import Muon, build_optimizer
from kiln_train.optim.muon import NS_COEFFICIENTS, newton_schulz, update_scale

QUINTIC = (3.4445, -4.7750, 2.0315)


def reference_step(p, g, buf, *, lr, momentum, nesterov, iters, wd):
    """One Muon step in float64, written from the formulas (not from the implementation)."""
    buf = momentum * buf + g
    u = g + momentum * buf if nesterov else buf
    rows, cols = u.shape
    x = u.T if rows > cols else u
    x = x / (torch.sqrt((x * x).sum()) + 1e-7)
    a, b, c = QUINTIC
    for _ in range(iters):
        s = x @ x.T
        x = a * x + b * (s @ x) + c * (s @ (s @ x))
    o = x.T if rows > cols else x
    p = p * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(rows, cols)) * o
    return p, buf


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(4, 24), (24, 4), (6, 6)])
def test_matches_float64_reference(shape, nesterov):
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.1
    cfg = {"momentum": 0.9, "nesterov": nesterov, "ns_iters": 5, "weight_decay": 0.1}
    opt = build_optimizer("muon", [("w", torch.nn.Parameter(p0.float()))], 2e-2, **cfg)
    ref_p, ref_buf = p0.clone(), torch.zeros(shape, dtype=torch.float64)
    for _ in range(3):  # the 2nd and 3rd steps exercise a non-zero momentum buffer
        g = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.05
        g32 = g.float()
        opt.step({"w": g32})
        ref_p, ref_buf = reference_step(
            ref_p, g32.double(), ref_buf, lr=2e-2, momentum=0.9, nesterov=nesterov, iters=5, wd=0.1
        )
        step_size = 2e-2 * 0.2 * math.sqrt(max(shape))
        # f32 Newton–Schulz vs f64: error a small fraction of the step, far below a wrong formula's
        torch.testing.assert_close(opt.params["w"].double(), ref_p, rtol=0, atol=2e-4 * step_size)
        torch.testing.assert_close(opt.state["w"]["momentum"].double(), ref_buf, rtol=1e-6, atol=3e-8)
    assert opt.param_steps == {"w": 3} and opt.step_count == 3


def _quintic_iterated(s: torch.Tensor, iters: int) -> torch.Tensor:
    a, b, c = QUINTIC
    for _ in range(iters):
        s = a * s + b * s**3 + c * s**5
    return s


@pytest.mark.parametrize("shape", [(2, 40), (8, 64), (64, 8), (16, 16), (48, 256)])
def test_orthogonalised_update_has_singular_values_near_one(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    u = torch.randn(shape, generator=gen)
    out = newton_schulz(u, 5)
    assert out.shape == u.shape and out.dtype == torch.float32
    sv_in = torch.linalg.svdvals(u.double())
    sv_out = torch.linalg.svdvals(out.double())
    normalised = sv_in / torch.linalg.matrix_norm(u.double())
    # Newton–Schulz acts on each singular value independently: s -> a s + b s^3 + c s^5.
    expected = _quintic_iterated(normalised, 5).sort(descending=True).values
    torch.testing.assert_close(sv_out, expected, rtol=0, atol=2e-3)
    # Five quintic steps map every normalised singular value in [0.01, 1] into [0.682, 1.135]
    # (the scalar map's range on that interval); a Gaussian matrix's smallest one is far above
    # 0.01, so the update is orthogonal up to the quintic's designed wobble, not to 1e-3.
    assert float(normalised.min()) > 0.01
    assert float(sv_out.min()) >= 0.67 and float(sv_out.max()) <= 1.15, sv_out


def test_more_iterations_stay_in_the_band():
    u = torch.randn(12, 30, generator=torch.Generator().manual_seed(2))
    for iters in (5, 10, 20):
        sv = torch.linalg.svdvals(newton_schulz(u, iters))
        assert float(sv.min()) >= 0.67 and float(sv.max()) <= 1.21


def test_update_scale_gives_every_shape_the_same_rms():
    for shape in [(16, 2560), (2560, 16), (4, 4), (2, 9216)]:
        u = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        o = newton_schulz(u, 5) * update_scale(shape)
        rms = float(o.pow(2).mean().sqrt())
        assert 0.14 <= rms <= 0.23, (shape, rms)


def test_rank_two_works_and_rank_one_is_rejected():
    params = [
        ("a", torch.nn.Parameter(torch.randn(2, 32) * 0.1)),
        ("b", torch.nn.Parameter(torch.zeros(32, 2))),
    ]
    opt = build_optimizer("muon", params, 1e-3)
    assert isinstance(opt, Muon)
    before = params[0][1].detach().clone()
    opt.step({"a": torch.randn(2, 32) * 0.01, "b": torch.randn(32, 2) * 0.01})
    assert not torch.equal(params[0][1].detach(), before)
    assert torch.isfinite(params[1][1]).all() and params[1][1].abs().sum() > 0

    for shape in [(1, 32), (32, 1)]:
        with pytest.raises(KilnError) as info:
            build_optimizer("muon", [("x.lora_A.weight", torch.nn.Parameter(torch.zeros(shape)))], 1e-3)
        assert info.value.code == "training_invalid_request"
        assert "lora_rank must be at least 2 for the muon optimizer" in info.value.message
        assert "'x.lora_A.weight'" in info.value.message
    with pytest.raises(KilnError, match="2-D"):
        build_optimizer("muon", [("v", torch.nn.Parameter(torch.zeros(8)))], 1e-3)


def test_zero_gradient_only_decays():
    p0 = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    opt = build_optimizer("muon", [("w", torch.nn.Parameter(p0.clone()))], 1e-2, weight_decay=0.5)
    opt.step({"w": torch.zeros(4, 8)})
    assert torch.equal(opt.params["w"].detach(), p0 * (1 - 1e-2 * 0.5))
    assert torch.equal(opt.state["w"]["momentum"], torch.zeros(4, 8))


def test_bf16_keeps_resident_state_in_bf16_and_rounds_once():
    gen = torch.Generator().manual_seed(9)
    p0 = (torch.randn(4, 16, generator=gen) * 0.1).to(torch.bfloat16)
    low = build_optimizer("muon", [("w", torch.nn.Parameter(p0.clone()))], 1e-2, weight_decay=0.1)
    high = build_optimizer("muon", [("w", torch.nn.Parameter(p0.float()))], 1e-2, weight_decay=0.1)
    g = (torch.randn(4, 16, generator=gen) * 0.1).to(torch.bfloat16)
    low.step({"w": g})
    high.step({"w": g.float()})
    assert low.params["w"].dtype == low.state["w"]["momentum"].dtype == torch.bfloat16
    assert torch.equal(low.params["w"], high.params["w"].to(torch.bfloat16))
    assert torch.equal(low.state["w"]["momentum"], high.state["w"]["momentum"].to(torch.bfloat16))
    assert low.hyperparameters() == {
        "kind": "muon",
        "momentum": 0.95,
        "nesterov": True,
        "ns_iters": 5,
        "weight_decay": 0.1,
    }


# ----- extreme gradients and odd shapes -----------------------------------------------------------


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
