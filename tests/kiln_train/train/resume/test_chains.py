"""Exact resume under scenarios beyond `test_exact.py` (docs/checkpoints.md#when-checkpoints-are-written,
docs/checkpoints.md#resume).

Each case trains one run straight through and the same run as a chain of cooperative stops
(`should_stop`), every leg resuming from the checkpoint the previous leg published: a resumed
run resumed again, stops mid-epoch and right after an epoch boundary, `checkpoint_interval` 1,
an interval that does not divide the rows, one larger than the run (no interval checkpoints at
all), the last checkpoint before the final step, one row for one or several epochs, a corpus
admitted with `invalid_row_policy=skip`, rows of very different lengths, each optimizer (SGD,
AdamW with weight decay, Muon with and without Nesterov) and 1, 2 and 3 gradient-checkpoint
segments. The chain must reproduce the straight run bit for bit: loss history, adapter, every
checkpoint the straight run published, receipt and adapter manifest. One chain runs every leg in
a fresh Python process.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.resume.resume_support import (
    NAME,
    assert_same_run,
    chain,
    ckpt_path,
    leg,
    run_leg_in_fresh_process,
)
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows_with_invalid() -> list[dict]:
    """Six rows, the 2nd (no assistant target) and 5th (no messages) rejected under `skip`."""
    rows = conversations(6, offset=20)
    rows[1] = {"messages": [{"role": "user", "content": "nothing to learn"}]}
    rows[4] = {"not_messages": []}
    return rows


def _rows_of_mixed_length() -> list[dict]:
    rows = conversations(4, offset=40)
    rows[0]["messages"][0]["content"] = "why " * 150
    rows[2]["messages"][1]["content"] = "The answer is long. " * 40
    return rows


CASES = {
    # name: (rows, ingestion kwargs, config fields, stops)
    "resumed-twice-mid-epoch": (4, {}, {"epochs": 3, "checkpoint_interval": 3}, [2, 5]),
    "stops-at-epoch-boundaries": (4, {}, {"epochs": 3, "checkpoint_interval": 3}, [4, 8]),
    "interval-1-three-resumes": (4, {}, {"epochs": 2, "checkpoint_interval": 1}, [1, 3, 7]),
    "interval-not-dividing-rows": (5, {}, {"epochs": 3, "checkpoint_interval": 4}, [6, 13]),
    "interval-beyond-the-run": (4, {}, {"epochs": 2, "checkpoint_interval": 100}, [3]),
    "no-interval": (4, {}, {"epochs": 2}, [3, 5]),
    "last-checkpoint-before-final-step": (4, {}, {"epochs": 2, "checkpoint_interval": 7}, [7]),
    "one-row-one-epoch": (1, {}, {"epochs": 1, "checkpoint_interval": 1}, []),
    "one-row-three-epochs": (1, {}, {"epochs": 3, "checkpoint_interval": 1}, [1, 2]),
    "skip-policy": (
        "invalid",
        {"policy": "skip"},
        {"epochs": 2, "invalid_row_policy": "skip", "checkpoint_interval": 3},
        [2, 5],
    ),
    "mixed-lengths-2-segments": (
        "mixed",
        {},
        {"epochs": 2, "grad_checkpoint_segments": 2, "checkpoint_interval": 3},
        [2, 5],
    ),
    "sgd": (4, {}, {"optimizer": {"kind": "sgd"}, "learning_rate": 0.05, "checkpoint_interval": 2}, [3, 6]),
    "adam_w-weight-decay": (
        4,
        {},
        {"optimizer": {"kind": "adam_w", "beta1": 0.8, "weight_decay": 0.1}, "checkpoint_interval": 2},
        [3, 6],
    ),
    "muon-nesterov": (
        4,
        {},
        {"optimizer": {"kind": "muon"}, "learning_rate": 1e-2, "checkpoint_interval": 2},
        [3, 6],
    ),
    "muon-plain-weight-decay": (
        4,
        {},
        {
            "optimizer": {"kind": "muon", "nesterov": False, "weight_decay": 0.05},
            "learning_rate": 1e-2,
            "checkpoint_interval": 2,
        },
        [3, 6],
    ),
    "muon-3-segments": (
        "mixed",
        {},
        {
            "optimizer": {"kind": "muon"},
            "learning_rate": 1e-2,
            "grad_checkpoint_segments": 3,
            "checkpoint_interval": 3,
        },
        [1, 4],
    ),
}


def _rows(spec) -> list[dict]:
    if spec == "invalid":
        return _rows_with_invalid()
    if spec == "mixed":
        return _rows_of_mixed_length()
    return conversations(spec)


@pytest.mark.parametrize("case", list(CASES))
def test_a_chain_of_resumes_is_the_straight_run(resident, tmp_path, case):
    rows, ingest_kw, fields, stops = CASES[case]
    ingestion = ingest(resident, _rows(rows), **ingest_kw)
    config = make_config(seed=13, **{"epochs": 2, **fields})
    straight, chained = tmp_path / "straight", tmp_path / "chain"
    ref = train(resident, config, ingestion, straight, adapter_name=NAME)
    final = chain(resident, config, ingestion, chained, stops)
    assert_same_run(ref, final, straight, chained, stops)


def test_skip_keeps_the_admitted_rows_and_their_order(resident):
    """The skip corpus the chain above trains on: rows 2 and 5 out, the rest in source order."""
    ingestion = ingest(resident, _rows_with_invalid(), policy="skip")
    assert [r.row_index for r in ingestion.rows] == [1, 3, 4, 6]
    assert ingestion.receipt["rows_kept"] == 4 and ingestion.receipt["rows_rejected"] == 2


def test_a_row_set_of_very_different_lengths_is_what_the_chain_trains(resident):
    lengths = [r.seq_len for r in ingest(resident, _rows_of_mixed_length()).rows]
    assert max(lengths) > 5 * min(lengths)


def test_every_leg_in_a_fresh_process(resident, tiny_dir, tmp_path):
    """k1 here -> a fresh process resumes and stops at k2 -> another fresh process resumes to N."""
    rows = conversations(5, offset=60)
    ingestion = ingest(resident, rows)
    config = make_config(
        seed=17,
        epochs=3,
        optimizer={"kind": "muon"},
        learning_rate=1e-2,
        grad_checkpoint_segments=2,
        checkpoint_interval=4,
    )
    straight, chained = tmp_path / "straight", tmp_path / "chain"
    ref = train(resident, config, ingestion, straight, adapter_name=NAME)
    stops = [3, 11]
    stopped = leg(resident, config, ingestion, chained, resume=None, stop_at=stops[0])
    assert stopped.failure_reason == "cancelled", stopped.failure_message
    job = {
        "model_dir": str(tiny_dir),
        "rows": rows,
        "config": json.loads(config.model_dump_json()),
        "output_root": str(chained),
        "adapter_name": NAME,
    }
    second = run_leg_in_fresh_process(
        {**job, "resume_checkpoint": str(ckpt_path(chained, stops[0])), "stop_at": stops[1]}, tmp_path
    )
    assert second["failure_reason"] == "cancelled", second["failure_message"]
    assert second["loss_history"] == ref.loss_history[: stops[1]]
    last = run_leg_in_fresh_process({**job, "resume_checkpoint": str(ckpt_path(chained, stops[1]))}, tmp_path)
    final = SimpleNamespace(
        status=last["status"],
        failure_message=last["failure_message"],
        global_step=last["global_step"],
        loss_history=last["loss_history"],
        adapter_path=Path(last["adapter_path"]) if last["adapter_path"] else None,
        receipt_path=Path(last["receipt_path"]),
    )
    assert_same_run(ref, final, straight, chained, stops)
