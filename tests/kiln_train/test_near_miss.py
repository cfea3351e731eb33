"""Refusals that say what to write instead (kiln_train/ground/near_miss.py): the nearest field
name, a misplaced field's parent, and the accepted forms of the tagged optimizer object."""

from __future__ import annotations

import pytest

from kiln_train.errors import KilnError
from kiln_train.ground.near_miss import nearest
from kiln_train.sft_config import parse_sft_config, parse_sft_request

ROWS = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]


def refusal(config: dict | None = None, **top) -> str:
    body = {"examples": ROWS, **top}
    if config is not None:
        body["config"] = config
    with pytest.raises(KilnError) as caught:
        parse_sft_request(body)
    return caught.value.message


def test_nearest_offers_only_a_close_name():
    names = ["epochs", "learning_rate", "lora_rank"]
    assert nearest("epoch", names) == "epochs"
    assert nearest("LORA_RNK", names) == "lora_rank"
    assert nearest("lr", names) is None
    assert nearest("zzz", []) is None


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            {"epoch": 2},
            "config.epoch: unknown field (not part of the native_online_lora_v1 contract); did you mean `epochs`?",
        ),
        (
            {"lora_rnk": 4},
            "config.lora_rnk: unknown field (not part of the native_online_lora_v1 contract); did you mean `lora_rank`?",
        ),
        (
            {"optimizer": {"kind": "adam_w", "beta_1": 0.9}},
            "config.optimizer.adam_w.beta_1: unknown field (not part of the native_online_lora_v1 contract); "
            "did you mean `beta1`?",
        ),
        ({"lr": 0.1}, "config.lr: unknown field (not part of the native_online_lora_v1 contract)"),
    ],
)
def test_an_unknown_config_field_names_the_nearest_real_one(config, expected):
    message = refusal(config)
    assert message.endswith(expected), message
    if "did you mean" not in expected:
        assert "did you mean" not in message


def test_a_config_field_written_at_the_top_says_where_it_belongs():
    assert refusal(epochs=3).endswith(
        "epochs: unknown field (not part of the native_online_lora_v1 contract); "
        "`epochs` belongs under `config` (`config.epochs`)"
    )
    assert refusal(lora_rnk=3).endswith("did you mean `config.lora_rank`?")


@pytest.mark.parametrize("optimizer", ["adamw", {"kind": "adamw"}, {"kind": "ADAM_W"}])
def test_a_wrongly_shaped_optimizer_names_the_accepted_forms(optimizer):
    message = refusal({"optimizer": optimizer})
    assert 'config.optimizer: must be an object with a "kind": ' in message, message
    for kind in ("muon", "adam_w", "sgd"):
        assert f'{{"kind": "{kind}"}}' in message
    assert message.endswith('did you mean {"kind": "adam_w"}?'), message
    assert "valid dictionary" not in message and "Input tag" not in message
    found = "got the string 'adamw'" if optimizer == "adamw" else '"kind" \''
    assert found in message, message


@pytest.mark.parametrize("optimizer", [["muon"], {}, 7])
def test_an_optimizer_with_no_recognisable_kind_lists_the_forms_without_a_guess(optimizer):
    message = refusal({"optimizer": optimizer})
    assert 'config.optimizer: must be an object with a "kind": ' in message, message
    assert "did you mean" not in message


def test_the_library_entry_point_gives_the_same_hints_under_its_path():
    with pytest.raises(KilnError) as caught:
        parse_sft_config({"epoch": 1}, field_path=("config",))
    assert caught.value.message.endswith(
        "config.epoch: unknown field (not part of the native_online_lora_v1 contract); did you mean `epochs`?"
    )
