"""The progress rule itself (worker/attempt_progress.py), case by case, without a store."""

from __future__ import annotations

from worker.attempt_progress import settle_attempt


def settle(**kw):
    args = {
        "attempt": 1,
        "releases": 0,
        "start_step": 0,
        "reached_step": 0,
        "checkpoint_step": None,
        "pinned_start": 0,
        "history": [],
        "max_attempts": 3,
    }
    return settle_attempt(**{**args, **kw})


def test_a_step_past_every_earlier_attempt_is_progress():
    first = settle(reached_step=5)
    assert first.record["advanced"] and first.record["stalled_attempts"] == 0 and first.retry
    again = settle(attempt=2, reached_step=5, history=[first.record])
    assert not again.record["advanced"] and again.record["stalled_attempts"] == 1 and again.retry
    further = settle(attempt=3, reached_step=6, history=[first.record, again.record])
    assert further.record["advanced"] and further.record["stalled_attempts"] == 1


def test_a_new_checkpoint_is_progress_even_below_the_furthest_step():
    """An earlier attempt reached step 15 without a checkpoint; this one published step 10's."""
    earlier = settle(reached_step=15, checkpoint_step=None)
    now = settle(attempt=2, start_step=0, reached_step=12, checkpoint_step=10, history=[earlier.record])
    assert now.record["advanced"] and now.record["stalled_attempts"] == 0


def test_the_limit_counts_only_attempts_without_progress_and_not_releases():
    stalled = [{"reached_step": 4, "advanced": False}] * 2
    last = settle(attempt=4, releases=1, start_step=2, reached_step=4, checkpoint_step=2, history=stalled)
    assert last.record["stalled_attempts"] == 3 and not last.retry
    assert "lost 3 attempts without progress (training.max_attempts 3)" in last.give_up
    released = settle(attempt=1, releases=1, start_step=0, reached_step=3, checkpoint_step=3, released=True)
    assert not released.record["advanced"] and released.record["released"] and released.retry
    assert released.record["stalled_attempts"] == 0


def test_a_delivery_settled_before_progress_records_counts_against_the_limit():
    """Jobs lost under the old rule carry no records: their deliveries all count, as they did."""
    assert settle(attempt=3, reached_step=0).record["stalled_attempts"] == 3
