"""AdamW against the checked-in PyTorch oracle (docs/optimizers.md#adamw-qualification).

The fixture comes from `qualification/adamw_pytorch_oracle.py` (see its docstring for the
regenerate command). F32: every lane after every step of a free-running trajectory within
`2e-12 + 5e-6 * |expected|`. BF16: per step (state restored to the oracle's previous step) within
1 ULP for parameters, 4 for first moments, 3 for second moments. Also: an eps below f32's
smallest value, any eps f32 represents, and bf16 parameters and state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_tensors

from kiln_train.optim import AdamW, build_optimizer
from kiln_train.optim.state import encode_state
from kiln_train.qualify.adamw_oracle import (
    FIELDS,
    PER_STEP,
    TRAJECTORY,
    build_case_optimizer,
    decode_lanes,
    replay_case,
    ulp_distance,
)

FIXTURE = Path(__file__).resolve().parents[3] / "qualification" / "fixtures" / "adamw_pytorch_oracle_v1.json"
BOUNDS = {"parameter": 1, "exp_avg": 4, "exp_avg_sq": 3}


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def _case(fixture, case_id):
    return next(c for c in fixture["cases"] if c["id"] == case_id)


def test_fixture_records_its_provenance(fixture):
    gen = fixture["generator"]
    assert fixture["schema"] == "kiln.adamw-pytorch-oracle.v1"
    assert gen["torch_version"].startswith("2.")
    assert gen["optimizer"] == "torch.optim.AdamW(foreach=False, fused=False)"
    assert gen["command"].startswith(".venv/bin/python qualification/adamw_pytorch_oracle.py")
    assert fixture["tolerances"] == {
        "float32": {"absolute": 2e-12, "relative": 5e-6},
        "bfloat16": {"parameter_ulps": 1, "exp_avg_ulps": 4, "exp_avg_sq_ulps": 3},
    }
    assert sorted(c["id"] for c in fixture["cases"]) == [
        "low_gradient_bfloat16",
        "low_gradient_float32",
        "ordinary_bfloat16",
        "ordinary_float32",
    ]
    for case in fixture["cases"]:
        assert len(case["gradients"]) == len(case["trajectory"]) == 10


@pytest.mark.parametrize("case_id", ["ordinary_float32", "low_gradient_float32"])
def test_f32_trajectory_matches_pytorch(fixture, case_id):
    case = _case(fixture, case_id)
    opt = build_case_optimizer(case, "cpu")
    shapes = {p["name"]: p["shape"] for p in case["params"]}
    worst = 0.0
    for grads, record in zip(case["gradients"], case["trajectory"], strict=True):
        opt.step({n: decode_lanes(grads[n], "float32", s) for n, s in shapes.items()})
        assert opt.param_steps == dict.fromkeys(shapes, record["step"])
        for n, s in shapes.items():
            ours = {
                "parameter": opt.params[n].detach(),
                "exp_avg": opt.state[n]["m"],
                "exp_avg_sq": opt.state[n]["v"],
            }
            for f in FIELDS:
                want = decode_lanes(record["params"][n][f], "float32", s).double()
                err = (ours[f].double() - want).abs()
                bound = 2e-12 + 5e-6 * want.abs()
                assert bool((err <= bound).all()), (case_id, record["step"], n, f, float(err.max()))
                worst = max(worst, float(err.max()))
    print(f"{case_id}: worst absolute error {worst:.3e}")


@pytest.mark.parametrize("case_id", ["ordinary_bfloat16", "low_gradient_bfloat16"])
def test_bf16_per_step_within_ulp_envelope(fixture, case_id):
    case = _case(fixture, case_id)
    replay = replay_case(case, fixture["tolerances"], mode=PER_STEP)
    assert replay.checked_lanes == 10 * 2 * 32 * 3
    for f, limit in BOUNDS.items():
        assert replay.fields[f].max_ulps <= limit, (case_id, f, replay.fields[f])
    assert replay.passed, replay.violations
    drift = replay_case(case, fixture["tolerances"], mode=TRAJECTORY)
    print(
        f"{case_id}: per-step worst ulps "
        f"{ {f: e.max_ulps for f, e in replay.fields.items()} }, free-running drift "
        f"{ {f: e.max_ulps for f, e in drift.fields.items()} }"
    )


def test_replay_reports_a_violation_when_the_math_is_wrong(fixture):
    case = json.loads(json.dumps(_case(fixture, "ordinary_float32")))
    case["hyperparameters"]["eps"] = 1e-6  # not what the oracle ran
    replay = replay_case(case, fixture["tolerances"])
    assert not replay.passed
    assert "ordinary_float32 step" in replay.violations[0]


def test_f32_is_bitwise_identical_to_torch_adamw():
    gen = torch.Generator().manual_seed(11)
    init = [torch.randn(6, 5, generator=gen), torch.randn(5, 6, generator=gen)]
    ref_params = [torch.nn.Parameter(t.clone()) for t in init]
    ours = AdamW(
        [(f"p{i}", torch.nn.Parameter(t.clone())) for i, t in enumerate(init)],
        3e-3,
        beta1=0.8,
        beta2=0.95,
        eps=1e-7,
        weight_decay=0.1,
    )
    ref = torch.optim.AdamW(
        ref_params, lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1, foreach=False, fused=False
    )
    for _ in range(7):
        grads = [torch.randn(t.shape, generator=gen) * 0.01 for t in init]
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        ref.step()
        ours.step({f"p{i}": g for i, g in enumerate(grads)})
    for i, p in enumerate(ref_params):
        assert torch.equal(ours.params[f"p{i}"], p)
        assert torch.equal(ours.state[f"p{i}"]["m"], ref.state[p]["exp_avg"])
        assert torch.equal(ours.state[f"p{i}"]["v"], ref.state[p]["exp_avg_sq"])


def test_bf16_step_is_the_f32_step_rounded_once():
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(4, 9, generator=gen).to(torch.bfloat16)
    low = build_optimizer("adam_w", [("w", torch.nn.Parameter(p0.clone()))], 1e-2, weight_decay=0.05)
    high = build_optimizer("adam_w", [("w", torch.nn.Parameter(p0.float()))], 1e-2, weight_decay=0.05)
    for step in range(4):
        g = (torch.randn(4, 9, generator=gen) * 0.1).to(torch.bfloat16)
        if step:  # start each step from identical (bf16-representable) state
            high.params["w"].data.copy_(low.params["w"].float())
            for f in ("m", "v"):
                high.state["w"][f].copy_(low.state["w"][f].float())
        low.step({"w": g})
        high.step({"w": g.float()})
        assert (
            low.params["w"].dtype == low.state["w"]["m"].dtype == low.state["w"]["v"].dtype == torch.bfloat16
        )
        assert torch.equal(low.params["w"], high.params["w"].to(torch.bfloat16))
        assert torch.equal(low.state["w"]["m"], high.state["w"]["m"].to(torch.bfloat16))
        assert torch.equal(low.state["w"]["v"], high.state["w"]["v"].to(torch.bfloat16))


def test_first_step_is_sign_like_and_decay_is_decoupled():
    p0 = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    g = torch.tensor([[0.3, -0.001], [2.0, 0.0]])
    opt = build_optimizer("adam_w", [("w", torch.nn.Parameter(p0.clone()))], 1e-2, weight_decay=0.5)
    opt.step({"w": g})
    decayed = p0 * (1 - 1e-2 * 0.5)
    # bias-corrected m_hat / sqrt(v_hat) = sign(g) for |g| >> eps; zero gradient -> decay only
    expected = decayed - 1e-2 * torch.sign(g)
    torch.testing.assert_close(opt.params["w"].detach(), expected, rtol=0, atol=1e-6)
    assert opt.hyperparameters() == {
        "kind": "adam_w",
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.5,
    }


def test_ulp_distance_counts_representable_steps():
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    next_up = torch.tensor([1.0078125], dtype=torch.bfloat16)  # 1 + 2**-7
    assert int(ulp_distance(one, next_up)[0]) == 1
    assert int(ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0]))[0]) == 0
    tiny = torch.tensor([2.0**-149])
    assert int(ulp_distance(tiny, -tiny)[0]) == 2
    assert int(ulp_distance(torch.tensor([1.0]), torch.tensor([1.0 + 2.0**-23]))[0]) == 1
    with pytest.raises(ValueError):
        ulp_distance(one, torch.tensor([1.0]))


# ----- eps below f32 and bf16 state ---------------------------------------------------------------


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
