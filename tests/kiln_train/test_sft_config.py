"""Request-side optimizer and learning-rate validation (docs/optimizers.md#hyperparameters).

Every bad field fails with `training_invalid_request` and a message naming the field; every range
edge is exercised from both sides.
"""

from __future__ import annotations

import logging
import math

import pytest

from api.errors import http_status
from kiln_train.errors import KilnError
from kiln_train.optim.kinds import optimizer_kind
from kiln_train.sft_config import (
    AdamWConfig,
    MuonConfig,
    SgdConfig,
    parse_sft_config,
    parse_sft_request,
)

FLT_MAX = 3.4028234663852886e38
F32_OVERFLOW_HALFWAY = 2.0**128 - 2.0**103  # ties-to-even rounds this (and above) to +inf
F32_MIN_SUBNORMAL = 2.0**-149
F32_UNDERFLOW_HALFWAY = 2.0**-150  # ties-to-even rounds this to +0


def rejects(obj: dict, *fragments: str) -> KilnError:
    with pytest.raises(KilnError) as info:
        parse_sft_config(obj)
    err = info.value
    assert err.code == "training_invalid_request"
    assert http_status(err) == 400
    assert err.message.startswith("Invalid training request: ")
    for fragment in fragments:
        assert fragment in err.message, (fragment, err.message)
    return err


def optimizer(kind: str, **fields) -> dict:
    return {"optimizer": {"kind": kind, **fields}}


# ----- defaults ----------------------------------------------------------------------------
def test_omitted_optimizer_is_muon_with_defaults():
    cfg = parse_sft_config({})
    assert cfg.optimizer == MuonConfig(
        kind="muon", momentum=0.95, nesterov=True, ns_iters=5, weight_decay=0.0
    )
    assert cfg.learning_rate is None
    assert cfg.resolved_learning_rate() == 1e-3
    assert cfg.to_json()["optimizer"] == {
        "kind": "muon",
        "momentum": 0.95,
        "nesterov": True,
        "ns_iters": 5,
        "weight_decay": 0.0,
    }


@pytest.mark.parametrize(
    ("kind", "expected", "lr"),
    [
        ("sgd", SgdConfig(kind="sgd"), 1e-4),
        ("adam_w", AdamWConfig(kind="adam_w", beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0), 1e-4),
        ("muon", MuonConfig(kind="muon", momentum=0.95, nesterov=True, ns_iters=5, weight_decay=0.0), 1e-3),
    ],
)
def test_kind_only_objects_take_defaults_and_resolve_the_default_rate(kind, expected, lr):
    cfg = parse_sft_config(optimizer(kind))
    assert cfg.optimizer == expected
    assert optimizer_kind(kind).default_learning_rate == lr
    resolved = cfg.resolve(seed=7)
    assert resolved.learning_rate == lr and resolved.seed == 7


def test_expanded_forms_are_accepted_verbatim():
    adam = {"kind": "adam_w", "beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1}
    muon = {"kind": "muon", "momentum": 0.9, "nesterov": False, "ns_iters": 7, "weight_decay": 0.01}
    assert parse_sft_config({"optimizer": adam}).to_json()["optimizer"] == adam
    assert parse_sft_config({"optimizer": muon}).to_json()["optimizer"] == muon
    assert parse_sft_config({"optimizer": {"kind": "sgd"}}).to_json()["optimizer"] == {"kind": "sgd"}


# ----- shape of the tagged object ----------------------------------------------------------
@pytest.mark.parametrize(
    ("obj", "fragments"),
    [
        (optimizer("sgd", momentum=0.9), ["optimizer.sgd.momentum", "unknown field"]),
        (optimizer("sgd", lr=0.1), ["optimizer.sgd.lr", "unknown field"]),
        (optimizer("adam_w", momentum=0.9), ["optimizer.adam_w.momentum", "unknown field"]),
        (optimizer("adam_w", betas=[0.9, 0.99]), ["optimizer.adam_w.betas", "unknown field"]),
        (optimizer("adam_w", amsgrad=True), ["optimizer.adam_w.amsgrad", "unknown field"]),
        (optimizer("muon", beta1=0.9), ["optimizer.muon.beta1", "unknown field"]),
        (
            optimizer("muon", stochastic_rounding=True),
            ["optimizer.muon.stochastic_rounding", "unknown field"],
        ),
        (optimizer("adam"), ["optimizer", "'adam'"]),
        (optimizer("lion"), ["optimizer", "'lion'"]),
        ({"optimizer": {"beta1": 0.9}}, ["optimizer", 'the object has no "kind"']),
        ({"optimizer": "muon"}, ["optimizer"]),
        ({"optimizer": None}, ["optimizer"]),
        ({"optimizer": ["muon"]}, ["optimizer"]),
    ],
)
def test_malformed_optimizer_objects(obj, fragments):
    rejects(obj, *fragments)


@pytest.mark.parametrize(
    "knob",
    [
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "lr_scheduler_type",
        "warmup_steps",
        "max_grad_norm",
    ],
)
def test_general_trainer_knobs_are_rejected(knob):
    rejects({knob: 1}, knob, "unknown field")


# ----- numeric ranges ----------------------------------------------------------------------
NAN, INF = math.nan, math.inf
ALMOST_ONE = math.nextafter(1.0, 0.0)


@pytest.mark.parametrize("field", ["beta1", "beta2"])
@pytest.mark.parametrize("value", [0, 0.0, 0.5, ALMOST_ONE])
def test_adamw_betas_accept_the_half_open_unit_interval(field, value):
    assert getattr(parse_sft_config(optimizer("adam_w", **{field: value})).optimizer, field) == value


@pytest.mark.parametrize("field", ["beta1", "beta2"])
@pytest.mark.parametrize(
    ("value", "why"),
    [
        (1.0, "must be in [0, 1)"),
        (1, "must be in [0, 1)"),
        (1.5, "must be in [0, 1)"),
        (-1e-12, "must be in [0, 1)"),
        (NAN, "must be finite"),
        (INF, "must be finite"),
        (-INF, "must be finite"),
        (True, "valid number"),
        ("0.9", "valid number"),
        (None, "valid number"),
    ],
)
def test_adamw_betas_reject(field, value, why):
    rejects(optimizer("adam_w", **{field: value}), f"optimizer.adam_w.{field}", why)


@pytest.mark.parametrize("value", [5e-324, 1e-30, 1e-8, 1.0, 1e30])
def test_adamw_eps_accepts_any_positive_finite_value(value):
    assert parse_sft_config(optimizer("adam_w", eps=value)).optimizer.eps == value


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (0.0, "greater than zero"),
        (-0.0, "greater than zero"),
        (-1e-8, "greater than zero"),
        (INF, "must be finite"),
        (NAN, "must be finite"),
        (False, "valid number"),
    ],
)
def test_adamw_eps_rejects(value, why):
    rejects(optimizer("adam_w", eps=value), "optimizer.adam_w.eps", why)


@pytest.mark.parametrize("kind", ["adam_w", "muon"])
@pytest.mark.parametrize("value", [0, 0.0, 1e-12, 0.1, 1e6])
def test_weight_decay_accepts_non_negative_finite_values(kind, value):
    assert parse_sft_config(optimizer(kind, weight_decay=value)).optimizer.weight_decay == value


@pytest.mark.parametrize("kind", ["adam_w", "muon"])
@pytest.mark.parametrize(
    ("value", "why"),
    [(-1e-12, "non-negative"), (-1.0, "non-negative"), (INF, "must be finite"), (NAN, "must be finite")],
)
def test_weight_decay_rejects(kind, value, why):
    rejects(optimizer(kind, weight_decay=value), f"optimizer.{kind}.weight_decay", why)


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 0.95, ALMOST_ONE])
def test_muon_momentum_accepts_the_half_open_unit_interval(value):
    assert parse_sft_config(optimizer("muon", momentum=value)).optimizer.momentum == value


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (1.0, "must be in [0, 1)"),
        (-0.1, "must be in [0, 1)"),
        (NAN, "must be finite"),
        (INF, "must be finite"),
        ("0.95", "valid number"),
    ],
)
def test_muon_momentum_rejects(value, why):
    rejects(optimizer("muon", momentum=value), "optimizer.muon.momentum", why)


@pytest.mark.parametrize("value", [1, 2, 5, 19, 20])
def test_muon_ns_iters_accepts_1_to_20(value):
    assert parse_sft_config(optimizer("muon", ns_iters=value)).optimizer.ns_iters == value


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (0, "must be in 1..=20"),
        (21, "must be in 1..=20"),
        (-5, "must be in 1..=20"),
        (2**70, "must be in 1..=20"),
        (5.0, "valid integer"),
        (5.5, "valid integer"),
        (True, "valid integer"),
        ("5", "valid integer"),
    ],
)
def test_muon_ns_iters_rejects(value, why):
    rejects(optimizer("muon", ns_iters=value), "optimizer.muon.ns_iters", why)


@pytest.mark.parametrize("value", [True, False])
def test_muon_nesterov_accepts_booleans(value):
    assert parse_sft_config(optimizer("muon", nesterov=value)).optimizer.nesterov is value


@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_muon_nesterov_rejects_non_booleans(value):
    rejects(optimizer("muon", nesterov=value), "optimizer.muon.nesterov", "valid boolean")


# ----- learning rate -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        1,
        1e-4,
        0.5,
        FLT_MAX,
        math.nextafter(F32_OVERFLOW_HALFWAY, 0.0),  # still rounds down to FLT_MAX
        F32_MIN_SUBNORMAL,
        math.nextafter(F32_UNDERFLOW_HALFWAY, 1.0),  # rounds up to the smallest subnormal
    ],
)
def test_learning_rate_accepts_values_that_survive_f32(value):
    assert parse_sft_config({"learning_rate": value}).learning_rate == value


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (0.0, "must be positive"),
        (-0.0, "must be positive"),
        (-1e-3, "must be positive"),
        (NAN, "must be finite"),
        (INF, "must be finite"),
        (-INF, "must be finite"),
        (F32_OVERFLOW_HALFWAY, "after conversion to f32"),
        (1e39, "after conversion to f32"),
        (1e308, "after conversion to f32"),
        (F32_UNDERFLOW_HALFWAY, "after conversion to f32"),
        (1e-46, "after conversion to f32"),
        (5e-324, "after conversion to f32"),
        (10**400, "valid number"),
        (True, "valid number"),
        ("1e-3", "valid number"),
    ],
)
def test_learning_rate_rejects(value, why):
    rejects({"learning_rate": value}, "learning_rate", why)


WARN_LOGGER = "kiln_train.sft_config"


@pytest.mark.parametrize("kind", ["muon", "adam_w", "sgd"])
def test_rates_far_from_the_default_log_a_warning(kind, caplog):
    default = optimizer_kind(kind).default_learning_rate
    cases = {
        default * 50: False,
        math.nextafter(default * 50, math.inf): True,
        default / 50: False,
        math.nextafter(default / 50, 0.0): True,
        default: False,
        default * 1000: True,
    }
    for lr, warns in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
            resolved = parse_sft_config({"learning_rate": lr, **optimizer(kind)}).resolve(seed=1)
        assert resolved.learning_rate == lr
        records = [r for r in caplog.records if r.name == WARN_LOGGER and r.levelno == logging.WARNING]
        assert bool(records) is warns, (kind, lr)
        if warns:
            text = records[0].getMessage()
            assert f"{lr:g}" in text and kind in text and "50x" in text


def test_an_omitted_rate_never_warns(caplog):
    with caplog.at_level(logging.WARNING, logger=WARN_LOGGER):
        parse_sft_config(optimizer("adam_w")).resolve(seed=1)
    assert not [r for r in caplog.records if r.name == WARN_LOGGER]


# ----- cross-field and request level ------------------------------------------------------
def test_muon_needs_rank_two():
    rejects({"lora_rank": 1, "lora_alpha": 2.0}, "lora_rank must be at least 2 for the muon optimizer")
    assert parse_sft_config({"lora_rank": 2, "lora_alpha": 4.0}).lora_rank == 2
    for kind in ("adam_w", "sgd"):
        assert parse_sft_config({"lora_rank": 1, "lora_alpha": 2.0, **optimizer(kind)}).lora_rank == 1


def test_request_errors_name_the_full_field_path():
    body = {"examples": [{"messages": []}], "config": optimizer("adam_w", beta2=1.0)}
    with pytest.raises(KilnError) as info:
        parse_sft_request(body)
    assert info.value.code == "training_invalid_request"
    assert "config.optimizer.adam_w.beta2: beta2 must be in [0, 1)" in info.value.message
    body = {"examples": [{"messages": []}], "config": {"learning_rate": 1e39}}
    with pytest.raises(KilnError, match=r"config\.learning_rate: learning_rate must stay finite"):
        parse_sft_request(body)
    ok = parse_sft_request({"examples": [{"messages": []}]})
    assert ok.config.optimizer.kind == "muon"


@pytest.mark.parametrize(
    "name",
    ["adapter\n", "-lead", ".hidden", "x-checkpoint-step-1", "a.kiln-checkpoint", "a/b", "é", "a" * 256],
)
def test_output_name_is_one_adapter_directory_name(name):
    rejects({"output_name": name}, "output_name")


@pytest.mark.parametrize("name", ["a", "support-bot_v1.2", "0" * 255])
def test_output_name_accepts_adapter_directory_names(name):
    assert parse_sft_config({"output_name": name}).output_name == name


def test_every_name_check_matches_in_full():
    """`^...$` with `re.match` admits a trailing newline; every name check must refuse it."""
    from kiln_train.artifacts.adapter import check_adapter_name
    from kiln_train.checkpoint.errors import CheckpointError
    from kiln_train.checkpoint.manifest import check_identifier

    with pytest.raises(KilnError):
        check_adapter_name("adapter\n")
    with pytest.raises(CheckpointError):
        check_identifier("adapter_name", "adapter\n")
    assert check_adapter_name("adapter") == "adapter"
    check_identifier("adapter_name", "adapter")


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"lora_alpha": 5e-324}, "after conversion to f32"),
        ({"lora_alpha": 1e-46, "lora_rank": 1}, "after conversion to f32"),
        ({"lora_alpha": 1.5e-45, "lora_rank": 64, "optimizer": {"kind": "sgd"}}, "is 0 in f32"),
    ],
)
def test_a_lora_scale_that_is_zero_in_f32_is_rejected(fields, why):
    rejects(fields, "lora_alpha", why)


def test_the_smallest_f32_scale_is_accepted():
    config = parse_sft_config({"lora_alpha": 1e-44, "lora_rank": 4})
    assert config.alpha_over_rank > 0


@pytest.mark.parametrize("value, ok", [(1, True), (2**64 - 1, True), (2**64, False), (0, False)])
def test_checkpoint_interval_is_a_u64_of_at_least_one(value, ok):
    if ok:
        assert parse_sft_config({"checkpoint_interval": value}).checkpoint_interval == value
    else:
        rejects({"checkpoint_interval": value}, "checkpoint_interval")
