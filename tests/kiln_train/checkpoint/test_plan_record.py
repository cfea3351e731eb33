"""`auxiliary_state.gradient_checkpoint_plan`: the pinned plan a checkpoint's per-row segment list
was derived from, validated by the strict loader and adopted by a library resume."""

from __future__ import annotations

import json

import pytest

from kiln_train.checkpoint import CheckpointError, load_checkpoint, publish_checkpoint
from kiln_train.checkpoint.rules import checkpoint_plan_problem
from kiln_train.plan.row_plan import recorded_plan
from kiln_train.train.resume_state import recorded_aux, recorded_checkpoint_plan
from tests.kiln_train.checkpoint.checkpoint_support import artifacts, draft


@pytest.mark.parametrize(
    "plan, segments, problem",
    [
        ({"max_segments": 1, "auto": False, "budget_bytes": None}, None, None),
        ({"max_segments": 3, "auto": True, "budget_bytes": 10**9}, 3, None),
        ({"max_segments": 2, "auto": True, "budget_bytes": None}, 2, None),
        ({"max_segments": 2, "auto": False, "budget_bytes": 5}, 2, "fixed plan"),
        ({"max_segments": 2, "auto": True}, 2, "exactly max_segments, auto, budget_bytes"),
        ({"max_segments": 2, "auto": True, "budget_bytes": 1, "x": 1}, 2, "exactly"),
        ([], 2, "exactly"),
        ({"max_segments": 0, "auto": False, "budget_bytes": None}, None, "max_segments: 0"),
        ({"max_segments": True, "auto": False, "budget_bytes": None}, None, "max_segments: True"),
        ({"max_segments": 2, "auto": "yes", "budget_bytes": None}, 2, "auto: 'yes'"),
        ({"max_segments": 2, "auto": True, "budget_bytes": -1}, 2, "budget_bytes: -1"),
        ({"max_segments": 2, "auto": True, "budget_bytes": 1.5}, 2, "budget_bytes: 1.5"),
        ({"max_segments": 3, "auto": False, "budget_bytes": None}, 2, "differs from effective_config"),
    ],
)
def test_plan_record_rules(plan, segments, problem):
    found = checkpoint_plan_problem(plan, segments)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_recorded_plan_normalises_what_rows_do_not_depend_on():
    assert recorded_plan({"max_segments": 2, "auto": False, "budget_bytes": 123, "boundary": "x"}) == {
        "max_segments": 2,
        "auto": False,
        "budget_bytes": None,
    }
    assert recorded_plan({"max_segments": 4, "auto": True, "budget_bytes": 99}) == {
        "max_segments": 4,
        "auto": True,
        "budget_bytes": 99,
    }


def test_the_loader_refuses_a_malformed_plan_record(tmp_path):
    bad = {"max_segments": 1, "auto": False, "budget_bytes": 7}
    try:
        published = publish_checkpoint(tmp_path, draft(7, gradient_checkpoint_plan=bad), artifacts(7))
    except CheckpointError as exc:  # refused before publication is as good as at load
        assert "auxiliary_state.gradient_checkpoint_plan" in exc.message
        return
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(published.path)
    assert "auxiliary_state.gradient_checkpoint_plan: budget_bytes" in err.value.message


def test_a_valid_plan_record_loads_and_is_read_back(tmp_path):
    plan = {"max_segments": 1, "auto": True, "budget_bytes": 1 << 33}
    published = publish_checkpoint(tmp_path, draft(7, gradient_checkpoint_plan=plan), artifacts(7))
    loaded = load_checkpoint(published.path)
    assert loaded.manifest.auxiliary_state["gradient_checkpoint_plan"] == plan
    assert recorded_checkpoint_plan(recorded_aux(published.path)) == plan


@pytest.mark.parametrize(
    "aux", [{}, {"gradient_checkpoint_plan": [1]}, {"gradient_checkpoint_plan": {"auto": 1}}]
)
def test_a_library_resume_without_a_readable_record_uses_the_default_plan(tmp_path, aux):
    (tmp_path / "checkpoint_manifest.json").write_text(json.dumps({"auxiliary_state": aux}), encoding="utf-8")
    assert recorded_checkpoint_plan(recorded_aux(tmp_path)) is None
