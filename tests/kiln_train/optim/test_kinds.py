"""The optimizer registry (kiln_train/optim/kinds.py): a fourth kind registered by a fixture, with
its own request object and update class and nothing else edited, is parsed, reported, priced,
checkpointed and reloaded like the built-in three, and is gone again after the fixture."""

from __future__ import annotations

import re
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, field_validator
from safetensors.torch import load as decode

from kiln_train.checkpoint import ADAPTER_FILE, OPTIMIZER_FILE, load_checkpoint, publish_checkpoint
from kiln_train.errors import KilnError
from kiln_train.ground.backend import backend_for_device
from kiln_train.model.config import QWEN35_4B_TEXT_CONFIG, parse_config
from kiln_train.optim import build_optimizer
from kiln_train.optim.base import Optimizer, upcast, write_back
from kiln_train.optim.configs import STRICT, MuonConfig
from kiln_train.optim.kinds import (
    OptimizerKind,
    keeps_state,
    optimizer_kind,
    optimizer_kinds,
    register,
    registered,
    unregister,
)
from kiln_train.optim.request_optimizer import optimizer_for
from kiln_train.optim.state import encode_state
from kiln_train.plan.memory import estimate
from kiln_train.plan.optimizer_support import check_optimizer_tuple, optimizer_support_report
from kiln_train.sft_config import parse_sft_config
from tests.kiln_train.checkpoint.checkpoint_support import LORA_KEY, artifacts, draft

BUILT_IN = ("muon", "adam_w", "sgd")


class HeavyBallConfig(BaseModel):
    """Heavy-ball momentum SGD: v <- beta * v + g; p <- p - lr * v."""

    model_config = STRICT
    kind: Literal["heavy_ball"]
    beta: float = 0.9

    @field_validator("beta")
    @classmethod
    def _beta(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError("beta must be in [0, 1)")
        return v


class HeavyBall(Optimizer):
    kind = "heavy_ball"
    hyperparameter_names = ("beta",)

    def __init__(self, params, lr: float, *, beta: float = 0.9) -> None:
        super().__init__(params, lr)
        self.beta = beta

    def _update(self, name, param, grad) -> None:
        v = self.state[name]["velocity"]
        v.mul_(self.beta).add_(grad)
        p = upcast(param)
        p.add_(upcast(v), alpha=-self.lr)
        write_back(param, p)


HEAVY_BALL = OptimizerKind(
    kind="heavy_ball",
    title="Heavy ball",
    config=HeavyBallConfig,
    update=f"{__name__}:HeavyBall",
    default_learning_rate=3e-4,
    minimum_rank=3,
    state_fields=("velocity",),
    state_key_segment="heavyball",
    schema_constraints={"beta": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}},
)


@pytest.fixture
def heavy_ball():
    register(HEAVY_BALL)
    try:
        yield HEAVY_BALL
    finally:
        unregister(HEAVY_BALL.kind)


def test_the_built_in_kinds_and_their_rules():
    assert optimizer_kinds() == BUILT_IN
    assert {e.kind: (e.default_learning_rate, e.minimum_rank, e.state_buffers) for e in registered()} == {
        "muon": (1e-3, 2, 1),
        "adam_w": (1e-4, 1, 2),
        "sgd": (1e-4, 1, 0),
    }
    assert [keeps_state(k) for k in BUILT_IN] == [True, True, False]
    with pytest.raises(ValueError, match="unknown optimizer kind 'lion'"):
        optimizer_kind("lion")


def test_update_classes_take_their_state_fields_from_the_registry():
    leaf = [("w", torch.nn.Parameter(torch.ones(2, 3)))]
    for kind in BUILT_IN:
        assert build_optimizer(kind, leaf, 0.1).state_fields == optimizer_kind(kind).state_fields


def test_register_refuses_a_taken_name_a_wrong_literal_or_removing_a_built_in():
    with pytest.raises(ValueError, match="already registered"):
        register(optimizer_kind("sgd"))
    with pytest.raises(ValueError, match=r"Literal\['heavy_ball'\]"):
        register(
            OptimizerKind(
                kind="heavy_ball", title="", config=MuonConfig, update="", default_learning_rate=1.0
            )
        )
    with pytest.raises(ValueError, match="cannot be removed"):
        unregister("adam_w")


def test_config_parsing_picks_up_the_new_kind(heavy_ball):
    config = parse_sft_config(
        {"optimizer": {"kind": "heavy_ball", "beta": 0.5}, "lora_rank": 4, "lora_alpha": 8.0}
    )
    assert config.optimizer == HeavyBallConfig(kind="heavy_ball", beta=0.5)
    assert config.to_json()["optimizer"] == {"kind": "heavy_ball", "beta": 0.5}
    assert config.resolve(seed=1).learning_rate == 3e-4
    with pytest.raises(KilnError, match=r"config\.optimizer\.heavy_ball\.beta: beta must be in \[0, 1\)"):
        parse_sft_config({"optimizer": {"kind": "heavy_ball", "beta": 1.5}}, field_path=("config",))
    with pytest.raises(KilnError, match="lora_rank must be at least 3 for the heavy_ball optimizer"):
        parse_sft_config({"optimizer": {"kind": "heavy_ball"}, "lora_rank": 2, "lora_alpha": 4.0})


def test_the_support_report_and_rank_gate_pick_up_the_new_kind(heavy_ball):
    model = parse_config(QWEN35_4B_TEXT_CONFIG)
    for device in ("cpu", "cuda"):
        report = optimizer_support_report(backend_for_device(device), model)
        assert [o["kind"] for o in report["optimizers"]] == [*BUILT_IN, "heavy_ball"]
        entry = report["optimizers"][-1]["optimizer_tuple"]
        assert entry["supported"] and entry["lora_rank"]["minimum"] == 3
        assert entry["lora_rank"]["backend_maximum"] is None  # only muon takes the backend ceiling
        assert "heavy_ball" in report["workloads"][0]["allowed_optimizer_kinds"]
    check_optimizer_tuple(backend_for_device("cpu"), model, "heavy_ball", 3)
    with pytest.raises(KilnError, match="lora_rank 2 is outside 3..="):
        check_optimizer_tuple(backend_for_device("cpu"), model, "heavy_ball", 2)


def test_memory_pricing_charges_the_new_kinds_state_buffers(heavy_ball):
    model = parse_config(QWEN35_4B_TEXT_CONFIG)
    priced = {
        kind: estimate(
            model,
            max_seq_len=256,
            max_supervised_tokens=128,
            lora_rank=8,
            optimizer_kind=kind,
            num_segments=4,
            loss_route="kt_tape_flce",
            backend=backend_for_device("cpu"),
            weights_resident=True,
        ).lora_optimizer_state
        for kind in (*BUILT_IN, "heavy_ball")
    }
    # One parameter-sized buffer, like Muon's momentum; SGD keeps none, AdamW two.
    assert priced["heavy_ball"] == priced["muon"] > 0 == priced["sgd"]
    assert priced["adam_w"] == 2 * priced["heavy_ball"]


def test_a_checkpoint_of_the_new_kind_round_trips(heavy_ball, tmp_path):
    files = artifacts(7, "heavy_ball")  # adapter and loop state; the optimizer state comes from a real run
    key = LORA_KEY.format("A")
    leaves = [(key, torch.nn.Parameter(decode(files[ADAPTER_FILE])[key].clone()))]
    run_config = parse_sft_config(
        {"optimizer": {"kind": "heavy_ball", "beta": 0.5}, "lora_rank": 4, "lora_alpha": 8.0}
    )
    trained = optimizer_for(run_config.resolve(seed=1), leaves)
    assert isinstance(trained, HeavyBall) and trained.beta == 0.5
    for _ in range(7):
        trained.step({name: torch.full_like(p, 0.25) for name, p in leaves})
    files[OPTIMIZER_FILE] = encode_state(trained.state_tensors())
    published = publish_checkpoint(tmp_path, draft(7, "heavy_ball"), files)
    loaded = load_checkpoint(published.path)
    record = loaded.manifest.optimizer
    assert record.kind == "heavy_ball" and record.state_file == OPTIMIZER_FILE
    assert loaded.manifest.precision_policy.optimizer_state_dtype == "f32"
    assert record.hyperparameters.optimizer == HeavyBallConfig(kind="heavy_ball")
    assert loaded.manifest.effective_config["optimizer"] == {"kind": "heavy_ball", "beta": 0.9}
    state = decode(loaded.read_verified(OPTIMIZER_FILE))
    assert sorted(state) == [f"{key}.heavyball.{f}" for f in ("step", "velocity")]
    fresh = build_optimizer(
        "heavy_ball", [(n, torch.nn.Parameter(p.detach().clone())) for n, p in leaves], 3e-4
    )
    fresh.load_state_tensors(state, global_step=7)
    assert torch.equal(fresh.state[key]["velocity"], trained.state[key]["velocity"])
    assert fresh.param_steps == trained.param_steps == {key: 7}


def test_the_new_kind_is_gone_after_its_fixture():
    assert optimizer_kinds() == BUILT_IN
    with pytest.raises(KilnError) as refused:
        parse_sft_config({"optimizer": {"kind": "heavy_ball"}})
    # The refusal names the unknown kind and offers only the built-in three.
    assert "heavy_ball" in refused.value.message
    assert re.search(r"sgd.*adam_w.*muon", refused.value.message)
    with pytest.raises(KilnError, match="is not one of muon, adam_w, sgd"):
        check_optimizer_tuple(backend_for_device("cpu"), parse_config(QWEN35_4B_TEXT_CONFIG), "heavy_ball", 4)
