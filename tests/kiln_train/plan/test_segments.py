"""Segment planning: the fewest gradient-checkpoint segments that fit, explicit counts, the largest
rank that fits, and a pinned per-row plan re-admitted row by row (docs/memory.md#segment-planning)."""

from __future__ import annotations

import pytest

from api.errors import http_status
from kiln_train.errors import TRAINING_WILL_NOT_FIT, KilnError
from kiln_train.ground.backend import FULL_LOGITS, KT_TAPE_FLCE
from kiln_train.plan.memory import GIB, estimate
from kiln_train.plan.segments import (
    admissible_rank_ceiling,
    check_row_plan_fits,
    max_rank_that_fits,
    plan_segments,
    row_segments,
)
from tests.kiln_train.plan.plan_support import CPU, CUDA, QWEN35_4B, SIZES, common, est, plan

# ----- segment planning --------------------------------------------------------------------


def test_plan_fits_at_one_segment():
    p = plan(10**15)
    assert p.num_segments == 1
    assert p.breakdown.num_segments == 1


def test_plan_takes_the_first_count_that_fits():
    totals = {s: est(num_segments=s, weights_resident=True).total for s in range(1, 33)}
    # A budget just big enough for 4 segments but not for 1..3.
    budget = totals[4]
    assert all(totals[s] > budget for s in (1, 2, 3))
    p = plan(budget)
    assert p.num_segments == 4
    assert p.breakdown.total <= budget
    first = next(s for s in range(1, 33) if totals[s] <= budget - 1)
    assert plan(budget - 1).num_segments == first


def test_plan_that_never_fits_is_413():
    with pytest.raises(KilnError) as err:
        plan(2 * GIB)
    assert err.value.code == "training_will_not_fit"
    assert "num_segments=32" in err.value.message  # the last plan tried is reported
    assert "Dynamic gradient checkpointing was already tried (num_segments 1..=32)" in err.value.message


def test_full_logits_is_never_given_more_than_one_segment():
    budget = est(num_segments=8, weights_resident=True).total
    assert plan(budget).num_segments > 1
    with pytest.raises(KilnError) as err:
        plan(budget, loss_route=FULL_LOGITS)
    assert err.value.code == "training_will_not_fit"
    assert "route=full_logits" in err.value.message
    assert "num_segments=1" in err.value.message
    assert "allows a single checkpoint segment" in err.value.message


def test_explicit_multi_segment_with_full_logits_is_invalid():
    with pytest.raises(KilnError) as err:
        plan(10**15, loss_route=FULL_LOGITS, requested_segments=2)
    assert err.value.code == "training_invalid_request"
    assert http_status(err.value) == 400
    assert "grad_checkpoint_segments=2" in err.value.message
    assert plan(10**15, loss_route=FULL_LOGITS, requested_segments=1).num_segments == 1


def test_explicit_segment_count_is_honoured_or_413():
    assert plan(10**15, requested_segments=3).num_segments == 3
    budget = est(num_segments=8, weights_resident=True).total
    with pytest.raises(KilnError) as err:
        plan(budget, requested_segments=2)
    assert err.value.code == "training_will_not_fit"
    assert "num_segments=2" in err.value.message
    assert "grad_checkpoint_segments=2 was honoured as given" in err.value.message
    with pytest.raises(KilnError) as err:
        plan(10**15, requested_segments=33)
    assert err.value.code == "training_invalid_request"


@pytest.mark.parametrize("name", ["0.8b", "27b"])
def test_planner_picks_the_first_fitting_count_at_the_exact_boundary(name):
    config = SIZES[name]
    kw = common(max_seq_len=65536, max_supervised_tokens=4096)
    layers = config.num_hidden_layers
    totals = {s: estimate(config, num_segments=s, **kw).total for s in range(1, layers + 1)}
    for target in (2, 3, layers // 2, layers):
        budget = totals[target]
        first = min(s for s in totals if totals[s] <= budget)
        plan = plan_segments(config, **kw, available_bytes=budget)
        assert plan.num_segments == first and plan.breakdown.total == totals[first] <= budget
    smallest = min(totals.values())
    with pytest.raises(KilnError) as err:
        plan_segments(config, **kw, available_bytes=smallest - 1)
    assert err.value.code == TRAINING_WILL_NOT_FIT
    assert f"num_segments={layers})" in err.value.message
    assert f"(num_segments 1..={layers})" in err.value.message


def test_admissible_rank_ceiling_clamps_to_the_optimizer_tuple_range():
    """Memory alone may allow rank 1024, but CUDA Muon admits 2..=48: never advise outside that."""
    config = SIZES["4b"]
    assert admissible_rank_ceiling(config, 1024, optimizer_kind="muon", backend=CUDA) == 48
    assert admissible_rank_ceiling(config, 1024, optimizer_kind="adam_w", backend=CUDA) == 1024
    assert admissible_rank_ceiling(config, 1024, optimizer_kind="muon", backend=CPU) == 1024
    # Muon needs rank >= 2: a resource ceiling of 1 means no admissible rank.
    assert admissible_rank_ceiling(config, 1, optimizer_kind="muon", backend=CUDA) == 0
    assert admissible_rank_ceiling(config, 1, optimizer_kind="sgd", backend=CUDA) == 1


# ----- rank ceiling ------------------------------------------------------------------------


def test_rank_ceiling_is_the_largest_rank_that_fits():
    kw = {
        "max_seq_len": 1024,
        "max_supervised_tokens": 512,
        "optimizer_kind": "muon",
        "loss_route": KT_TAPE_FLCE,
        "backend": CUDA,
        "weights_resident": True,
    }
    budget = est(num_segments=32, lora_rank=300, **{k: v for k, v in kw.items() if k != "loss_route"}).total
    r = max_rank_that_fits(QWEN35_4B, available_bytes=budget, **kw)
    assert r >= 300

    def fits(rank):
        return any(
            est(num_segments=s, lora_rank=rank, **{k: v for k, v in kw.items() if k != "loss_route"}).fits(
                budget
            )
            for s in range(1, 33)
        )

    assert fits(r) and not fits(r + 1)
    assert (
        max_rank_that_fits(QWEN35_4B, available_bytes=10**15, **kw) == QWEN35_4B.model_maximum_rank() == 1024
    )
    assert max_rank_that_fits(QWEN35_4B, available_bytes=1, **kw) == 0


# ----- re-admitting a pinned per-row plan (a resume of an auto-planned run) ----------------------


def _row_bound(t: int, a: int, s: int):
    return est(max_seq_len=t, max_supervised_tokens=a, num_segments=s, lora_rank=16, optimizer_kind="adam_w")


def test_row_segments_gives_each_row_the_fewest_segments_within_the_plan():
    long_1, long_2 = _row_bound(16384, 8192, 1), _row_bound(16384, 8192, 2)
    assert long_2.total < long_1.total
    budget = long_2.total  # the long row needs 2 segments, a short one fits in 1
    plan = {"max_segments": 4, "auto": True, "budget_bytes": budget}

    def fits(t, a, s):
        return _row_bound(t, a, s).fits(budget)

    assert row_segments(plan, 16384, 8192, fits) == 2
    assert row_segments(plan, 512, 256, fits) == 1
    fixed = {"max_segments": 4, "auto": False, "budget_bytes": None}
    assert row_segments(fixed, 512, 256, fits) == 4
    nothing_fits = {"max_segments": 3, "auto": True, "budget_bytes": 1}
    assert row_segments(nothing_fits, 512, 256, lambda *_: False) == 3


def test_a_pinned_row_plan_is_readmitted_row_by_row():
    budget = _row_bound(16384, 8192, 2).total
    plan = {"max_segments": 4, "auto": True, "budget_bytes": budget}
    rows = [(16384, 8192), (12000, 6000), (512, 256), (512, 256)]
    common = {
        "lora_rank": 16,
        "optimizer_kind": "adam_w",
        "loss_route": KT_TAPE_FLCE,
        "backend": CUDA,
        "weights_resident": False,
    }
    worst = check_row_plan_fits(QWEN35_4B, rows, plan, available_bytes=budget, **common)
    # The worst row under the plan: a 12k row on 1 segment can outweigh the 16k row on 2.
    expected = max(
        (_row_bound(t, a, 1) if _row_bound(t, a, 1).fits(budget) else _row_bound(t, a, 2)).total
        for t, a in rows
    )
    assert worst is not None and worst.total == expected <= budget
    assert check_row_plan_fits(QWEN35_4B, [], plan, available_bytes=budget, **common) is None
    # A budget one byte under the worst row's bound: 413 with the contract's breakdown.
    with pytest.raises(KilnError) as err:
        check_row_plan_fits(QWEN35_4B, rows, plan, available_bytes=expected - 1, **common)
    assert err.value.code == "training_will_not_fit"
    assert "loss workspace" in err.value.message and "num_segments" in err.value.message
