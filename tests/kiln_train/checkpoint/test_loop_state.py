"""`sft_loop_state.json` (`kiln.sft-loop-state.v1`, kiln-contract §5.1): round trip and invariants."""

from __future__ import annotations

import json
import math
import struct

import pytest

from kiln_train.checkpoint import CheckpointError, GradNormStats, SftLoopState, parse_loop_state
from kiln_train.checkpoint.loop_state import check_loop_state_progress
from kiln_train.checkpoint.manifest import Progress
from tests.kiln_train.checkpoint.checkpoint_support import loop_state


def _bits(values):
    return [struct.pack("<d", v) for v in values]


def _mutated(state: SftLoopState, **changes) -> bytes:
    raw = state.model_dump(mode="json")
    raw.update(changes)
    return json.dumps(raw).encode()


def test_round_trip_is_bit_exact():
    awkward = [0.1, 1 / 3, 2.0**-1074, 1.7976931348623157e308, 5e-324, 0.30000000000000004, 1e-17 + 2.0]
    state = SftLoopState(
        global_step=len(awkward),
        epoch_index=1,
        cursor_in_epoch=2,
        loss_history=awkward,
        last_loss=awkward[-1],
        current_epoch_loss_sum=awkward[-2] + awkward[-1],
        current_epoch_items=2,
        first_epoch_loss=0.7,
        best_epoch_loss=0.7 - 2**-52,
        lora_grad_norms={"layers.0.mlp.up_proj": GradNormStats.first(math.pi).add(math.e)},
    )
    data = state.to_bytes()
    back = parse_loop_state(data)
    assert back == state
    assert _bits(back.loss_history) == _bits(awkward)
    assert back.lora_grad_norms["layers.0.mlp.up_proj"].sum == math.pi + math.e
    assert back.to_bytes() == data
    body = json.loads(data)
    assert body["schema_version"] == 1 and body["state_type"] == "kiln.sft-loop-state.v1"


def test_grad_norm_accumulator():
    stats = GradNormStats.first(2.0).add(0.5).add(3.5)
    assert (stats.sample_count, stats.sum, stats.min, stats.max, stats.mean) == (3, 6.0, 0.5, 3.5, 2.0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"loss_history": [1.0, 2.0]}, "loss_history has 2 entries, global_step is 7"),
        ({"last_loss": 123.0}, "last_loss 123.0 is not the last loss_history entry"),
        ({"current_epoch_items": 1}, "current_epoch_items 1 differs from cursor_in_epoch 2"),
        ({"first_epoch_loss": None}, "first_epoch_loss must be present at epoch_index 1"),
        ({"best_epoch_loss": None}, "best_epoch_loss must be present at epoch_index 1"),
        ({"best_epoch_loss": 99.0}, "best_epoch_loss 99.0 exceeds first_epoch_loss"),
        ({"state_type": "kiln.sft-loop-state.v0"}, "state_type"),
        ({"schema_version": 2}, "schema_version"),
        ({"extra": 1}, "extra: unknown field"),
        (
            {"lora_grad_norms": {"m": {"sample_count": 1, "sum": 1.0, "min": 2.0, "max": 1.0}}},
            "min exceeds max",
        ),
        (
            {"lora_grad_norms": {"m": {"sample_count": 1, "sum": 1.0, "min": 1.0, "max": 1.0, "mean": 1.0}}},
            "unknown",
        ),
        ({"global_step": 7.0}, "global_step"),
    ],
)
def test_invariant_violations_are_rejected(changes, message):
    data = _mutated(loop_state(7), **changes)  # 5 items per epoch: epoch 1, cursor 2
    with pytest.raises(CheckpointError, match="sft_loop_state.json") as info:
        parse_loop_state(data)
    assert message in info.value.message


def test_epoch_fields_must_be_null_in_the_first_epoch():
    with pytest.raises(CheckpointError, match="first_epoch_loss must be null at epoch_index 0"):
        parse_loop_state(_mutated(loop_state(3), first_epoch_loss=1.0, best_epoch_loss=1.0))


def test_zero_cursor_means_zero_running_sum():
    with pytest.raises(CheckpointError, match="current_epoch_loss_sum 0.5 must be 0 at cursor 0"):
        parse_loop_state(_mutated(loop_state(5), current_epoch_loss_sum=0.5))


@pytest.mark.parametrize(
    "text", ['{"x": NaN}', '{"x": Infinity}', '{"x": 1e999}', '{"a": 1, "a": 2}', "[1]", "\xff"]
)
def test_strict_json(text):
    with pytest.raises(CheckpointError, match="sft_loop_state.json"):
        parse_loop_state(text.encode("latin-1"))


def test_non_finite_loss_cannot_be_written():
    with pytest.raises(ValueError):
        SftLoopState(
            global_step=1,
            epoch_index=0,
            cursor_in_epoch=1,
            loss_history=[math.nan],
            last_loss=math.nan,
            current_epoch_loss_sum=math.nan,
            current_epoch_items=1,
            first_epoch_loss=None,
            best_epoch_loss=None,
            lora_grad_norms={},
        )


def test_progress_must_match_the_manifest():
    state = loop_state(7)
    check_loop_state_progress(
        state,
        Progress(global_step=7, total_steps=10, epoch_index=1, cursor_in_epoch=2, data_order=[0, 1, 2, 3, 4]),
    )
    with pytest.raises(CheckpointError, match="cursor_in_epoch 2 differs from progress.cursor_in_epoch 3"):
        check_loop_state_progress(
            state,
            Progress(
                global_step=7, total_steps=10, epoch_index=1, cursor_in_epoch=3, data_order=[0, 1, 2, 3, 4]
            ),
        )
