"""The all-or-nothing step, state serialisation and bit-exact continuation for every optimizer."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load as decode_state
from safetensors.torch import load_file, save_file

from kiln_train.errors import TrainingFailure
from kiln_train.optim import AdamW, GradientSetError, Muon, OptimizerStateError, Sgd, build_optimizer
from kiln_train.optim.base import Optimizer
from kiln_train.optim.state import encode_state

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
SHAPES = {A: (4, 12), B: (10, 4)}
SETTINGS = {"sgd": {}, "adam_w": {"weight_decay": 0.02}, "muon": {"weight_decay": 0.01}}
OPTIMIZER_STATE_FILE = "optimizer.safetensors"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
LR = {"sgd": 1e-2, "adam_w": 1e-2, "muon": 1e-2}


def build(kind: str, params, lr: float) -> Optimizer:
    return build_optimizer(kind, params, lr, **SETTINGS[kind])


def has_state_file(optimizer: Optimizer) -> bool:
    """SGD is stateless: its checkpoint carries no optimizer file."""
    return bool(optimizer.state_fields)


def save_state_file(optimizer: Optimizer, path) -> None:
    """Write `optimizer.safetensors` for a stateful optimizer."""
    if not has_state_file(optimizer):
        raise ValueError(f"the {optimizer.kind} optimizer is stateless and has no state file")
    save_file(optimizer.state_tensors(), str(path))


def load_state_file(optimizer: Optimizer, path, *, global_step: int) -> None:
    """Restore `optimizer.safetensors` into `optimizer` (exact keys, shapes, finite, steps)."""
    optimizer.load_state_tensors(load_file(str(path), device="cpu"), global_step=global_step)


def make_params(dtype: torch.dtype, seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (n, torch.nn.Parameter(torch.randn(s, generator=gen).mul_(0.1).to(dtype))) for n, s in SHAPES.items()
    ]


def make_grads(dtype: torch.dtype, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(s, generator=gen).mul_(0.05).to(dtype) for n, s in SHAPES.items()}


def snapshot(opt) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in opt.params.items()},
        "state": {n: {f: t.clone() for f, t in st.items()} for n, st in opt.state.items()},
        "param_steps": dict(opt.param_steps),
        "step_count": opt.step_count,
    }


def assert_same(opt, snap: dict) -> None:
    assert opt.step_count == snap["step_count"]
    assert opt.param_steps == snap["param_steps"]
    for n, p in opt.params.items():
        assert torch.equal(p.detach(), snap["params"][n]), n
        for f, t in opt.state[n].items():
            assert torch.equal(t, snap["state"][n][f]), (n, f)


def bad_sets(dtype: torch.dtype) -> dict[str, tuple[dict, str]]:
    """Each broken gradient set and a fragment its error message must contain."""
    good = make_grads(dtype, 99)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    nan = dict(good)
    nan[B] = good[B].clone()
    nan[B][3, 1] = float("nan")
    inf = dict(good)
    inf[A] = good[A].clone()
    inf[A][0, 0] = float("-inf")
    return {
        "missing": ({A: good[A]}, f"missing 1 trainable leaf(s), first {B!r}"),
        "unknown": (
            {**good, "layers.0.mlp.up_proj.lora_A.weight": good[A]},
            "'layers.0.mlp.up_proj.lora_A.weight'",
        ),
        "shape": (
            {A: good[A], B: good[B].T.contiguous()},
            f"leaf {B!r} does not match the leaf: gradient has shape [4, 10]",
        ),
        "dtype": ({A: good[A].to(other), B: good[B]}, f"leaf {A!r} does not match"),
        "nan": (nan, f"leaf {B!r} is not finite (1 NaN and 0 infinite"),
        "inf": (inf, f"leaf {A!r} is not finite (0 NaN and 1 infinite"),
        "not_a_tensor": ({A: good[A], B: good[B].tolist()}, f"gradient for leaf {B!r} is not a tensor"),
    }


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("kind", SETTINGS)
def test_rejected_gradient_set_changes_nothing(kind, dtype_name):
    dtype = DTYPES[dtype_name]
    opt = build(kind, make_params(dtype), LR[kind])
    opt.step(make_grads(dtype, 0))  # non-trivial state and counters first
    snap = snapshot(opt)
    for case, (grads, fragment) in bad_sets(dtype).items():
        with pytest.raises(GradientSetError) as info:
            opt.step(grads)
        assert isinstance(info.value, TrainingFailure)
        assert info.value.reason == "training_error"
        assert fragment in info.value.message, (case, info.value.message)
        assert_same(opt, snap)


@pytest.mark.parametrize("kind", SETTINGS)
def test_zero_gradient_is_a_valid_step(kind):
    opt = build(kind, make_params(torch.float32), LR[kind])
    zeros = {n: torch.zeros(s) for n, s in SHAPES.items()}
    opt.step(zeros)
    assert opt.step_count == 1
    for p in opt.params.values():
        assert torch.isfinite(p).all()
    if kind != "sgd":
        assert set(opt.param_steps.values()) == {1}


def test_gradient_on_another_device_is_rejected():
    opt = build("adam_w", make_params(torch.float32), 1e-3)
    grads = make_grads(torch.float32, 0)
    grads[A] = grads[A].to("meta")
    with pytest.raises(GradientSetError, match="device meta"):
        opt.step(grads)
    assert opt.step_count == 0


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("kind", ["adam_w", "muon"])
def test_state_round_trips_through_safetensors(tmp_path, kind, dtype_name):
    dtype = DTYPES[dtype_name]
    opt = build(kind, make_params(dtype), LR[kind])
    for step in range(3):
        opt.step(make_grads(dtype, step))
    tensors = opt.state_tensors()
    fields = ("m", "v") if kind == "adam_w" else ("momentum",)
    segment = "adamw" if kind == "adam_w" else "muon"
    expected = {f"{n}.{segment}.{f}" for n in SHAPES for f in (*fields, "step")}
    assert set(tensors) == expected
    for key, t in tensors.items():
        assert t.device.type == "cpu"
        if key.endswith(".step"):
            assert t.dtype == torch.uint32 and list(t.shape) == [1] and int(t.to(torch.int64)[0]) == 3
        else:
            assert t.dtype == torch.float32
            name = key.rsplit(".", 2)[0]
            resident = opt.state[name][key.rsplit(".", 1)[1]]
            assert resident.dtype == dtype  # resident state in the parameter dtype
            assert torch.equal(t, resident.float())

    # bytes and file encodings both survive exactly, including the U32 counters
    decoded = decode_state(encode_state(tensors))
    path = tmp_path / OPTIMIZER_STATE_FILE
    save_state_file(opt, path)
    from_file = load_file(str(path))
    for loaded in (decoded, from_file):
        assert set(loaded) == expected
        for key in expected:
            assert loaded[key].dtype == tensors[key].dtype
            assert torch.equal(loaded[key], tensors[key]), key

    fresh = build(kind, make_params(dtype), LR[kind])
    load_state_file(fresh, path, global_step=3)
    assert fresh.step_count == 3
    assert fresh.param_steps == {A: 3, B: 3}
    for n in SHAPES:
        for f in fields:
            assert fresh.state[n][f].dtype == dtype
            assert torch.equal(fresh.state[n][f], opt.state[n][f])


def test_sgd_is_stateless():
    opt = build("sgd", make_params(torch.float32), 1e-2)
    opt.step(make_grads(torch.float32, 0))
    assert opt.state_tensors() == {}
    assert not has_state_file(opt)
    with pytest.raises(ValueError, match="stateless"):
        save_state_file(opt, "/nonexistent/optimizer.safetensors")
    fresh = build("sgd", make_params(torch.float32), 1e-2)
    fresh.load_state_tensors({}, global_step=7)
    assert fresh.step_count == 7
    with pytest.raises(OptimizerStateError, match="unexpected key"):
        fresh.load_state_tensors({f"{A}.adamw.m": torch.zeros(4, 12)}, global_step=7)


def _corrupt(tensors: dict, case: str) -> tuple[dict, str]:
    t = {k: v.clone() for k, v in tensors.items()}
    m, step = f"{A}.adamw.m", f"{B}.adamw.step"
    if case == "missing":
        del t[m]
        return t, f"missing 1 key(s), first {m!r}"
    if case == "unknown":
        t["extra.adamw.m"] = torch.zeros(1)
        return t, "unexpected key(s), first 'extra.adamw.m'"
    if case == "shape":
        t[m] = torch.zeros(12, 4)
        return t, f"{m!r} has shape [12, 4]"
    if case == "dtype":
        t[m] = t[m].to(torch.float64)
        return t, f"{m!r} must be f32"
    if case == "nan":
        t[m][1, 1] = float("nan")
        return t, f"{m!r} contains non-finite"
    if case == "step_dtype":
        t[step] = torch.tensor([2], dtype=torch.int64)
        return t, "must be uint32 with shape [1]"
    if case == "step_ahead":
        t[step] = torch.tensor([5], dtype=torch.uint32)
        return t, "is 5, beyond the checkpoint's global step 2"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing", "unknown", "shape", "dtype", "nan", "step_dtype", "step_ahead"])
def test_bad_state_is_rejected_before_anything_changes(case):
    opt = build("adam_w", make_params(torch.float32), 1e-2)
    opt.step(make_grads(torch.float32, 0))
    opt.step(make_grads(torch.float32, 1))
    tensors = opt.state_tensors()
    target = build("adam_w", make_params(torch.float32, seed=5), 1e-2)
    target.step(make_grads(torch.float32, 7))
    snap = snapshot(target)
    bad, fragment = _corrupt(tensors, case)
    with pytest.raises(OptimizerStateError) as info:
        target.load_state_tensors(bad, global_step=2)
    assert fragment in info.value.message
    assert_same(target, snap)


def test_step_counter_may_trail_the_global_step():
    opt = build("muon", make_params(torch.float32), 1e-2)
    opt.step(make_grads(torch.float32, 0))
    fresh = build("muon", make_params(torch.float32), 1e-2)
    fresh.load_state_tensors(opt.state_tensors(), global_step=4)
    assert fresh.step_count == 4 and fresh.param_steps == {A: 1, B: 1}


def _run(kind, dtype, steps, *, resume_at=None, tmp_path=None):
    opt = build(kind, make_params(dtype), LR[kind])
    for step in range(steps):
        if resume_at is not None and step == resume_at:
            # Checkpoint: parameters as stored bytes, optimizer state through safetensors bytes.
            param_bytes = {n: p.detach().clone() for n, p in opt.params.items()}
            path = tmp_path / "adapter.safetensors"
            save_file(param_bytes, str(path))
            state = decode_state(encode_state(opt.state_tensors()))
            restored = load_file(str(path))
            opt = build(kind, [(n, torch.nn.Parameter(restored[n])) for n in SHAPES], LR[kind])
            opt.load_state_tensors(state, global_step=resume_at)
        opt.step(make_grads(dtype, step))
    return opt


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("kind", SETTINGS)
def test_resume_is_bit_exact(tmp_path, kind, dtype_name):
    dtype = DTYPES[dtype_name]
    straight = _run(kind, dtype, 6)
    resumed = _run(kind, dtype, 6, resume_at=3, tmp_path=tmp_path)
    assert resumed.step_count == straight.step_count == 6
    assert resumed.param_steps == straight.param_steps
    for n in SHAPES:
        assert resumed.params[n].dtype == dtype
        assert torch.equal(resumed.params[n], straight.params[n]), n
        for f in straight.state[n]:
            assert torch.equal(resumed.state[n][f], straight.state[n][f]), (n, f)


def test_build_rejects_bad_parameter_sets():
    with pytest.raises(ValueError, match="duplicate parameter name"):
        build("sgd", [(A, torch.nn.Parameter(torch.zeros(2, 2)))] * 2, 1e-3)
    with pytest.raises(ValueError, match="unsupported dtype"):
        build("sgd", [(A, torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64)))], 1e-3)
    with pytest.raises(ValueError, match="at least one"):
        build("sgd", [], 1e-3)
    for lr in (0.0, -1e-3, math.inf, math.nan):
        with pytest.raises(ValueError, match="lr must be finite and positive"):
            build("sgd", make_params(torch.float32), lr)


# ----- one bad gradient in a mixed-precision set --------------------------------------------------


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
