"""The validation curve in the job store on SQLite and Postgres (kiln/store/validation.py,
migration 0004): evaluations written under the run's claim, read back per job and in bulk,
dropped with the steps a resume or restart replays, and the `v_validation_curve` view."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import exc, text

from kiln.store import (
    Admission,
    LeaseLost,
    claim_job,
    evaluation_recorded,
    latest_evaluations,
    record_checkpoint,
    record_evaluation,
    requeue_for_restart,
    requeue_for_resume,
    states,
    utcnow,
    validation_histories,
    validation_history,
)
from kiln.store.jobs import delete_job, finish_job
from tests.kiln.store.store_support import admit, run_steps


def _evaluate(session, job, worker, step: int, loss: float, attempt: int | None = None):
    return record_evaluation(
        session,
        job.id,
        worker,
        {
            "global_step": step,
            "epoch": step // 5,
            "loss": loss,
            "token_accuracy": 0.1 * step,
            "supervised_tokens": 40,
            "rows": 2,
        },
        attempt=job.attempts if attempt is None else attempt,
    )


def _running(factory, worker: str = "worker-a", **overrides):
    with factory.begin() as session:
        job = admit(session, **overrides)
        return claim_job(session, job.id, worker, 60)


def test_evaluations_are_written_under_the_claim_and_read_in_step_order(factory):
    job = _running(factory)
    other = _running(factory, "worker-b")
    with factory.begin() as session:
        _evaluate(session, job, "worker-a", 0, 3.0)
        _evaluate(session, job, "worker-a", 4, 2.0)
        _evaluate(session, job, "worker-a", 2, 2.5)
        _evaluate(session, other, "worker-b", 0, 9.0)
    with factory() as session:
        rows = validation_history(session, job.id)
        assert [(r.global_step, r.epoch, r.loss, r.rows, r.supervised_tokens) for r in rows] == [
            (0, 0, 3.0, 2, 40),
            (2, 0, 2.5, 2, 40),
            (4, 0, 2.0, 2, 40),
        ]
        assert rows[1].token_accuracy == pytest.approx(0.2)
        assert rows[0].evaluated_at.tzinfo is not None
        assert evaluation_recorded(session, job.id, 2) and not evaluation_recorded(session, job.id, 3)
        curves = validation_histories(session, [job.id, other.id, "absent"])
        assert [r.global_step for r in curves[job.id]] == [0, 2, 4] and len(curves[other.id]) == 1
        assert "absent" not in curves and validation_histories(session, []) == {}
        latest = {row.job_id: (name, row.global_step) for name, row in latest_evaluations(session)}
        assert latest == {job.id: (job.adapter_name, 4), other.id: (other.adapter_name, 0)}


def test_a_stale_or_foreign_claim_writes_nothing(factory):
    job = _running(factory)
    for worker, attempt in (("worker-b", job.attempts), ("worker-a", job.attempts + 1)):
        with factory.begin() as session, pytest.raises(LeaseLost):
            _evaluate(session, job, worker, 0, 1.0, attempt=attempt)
    with factory.begin() as session:
        _evaluate(session, job, "worker-a", 0, 1.0)
    with factory.begin() as session, pytest.raises(exc.IntegrityError):
        _evaluate(session, job, "worker-a", 0, 1.0)  # one evaluation per step
    with factory.begin() as session:
        finish_job(session, job.id, states.COMPLETED, worker_id="worker-a", attempt=job.attempts)
    with factory.begin() as session, pytest.raises(LeaseLost):
        _evaluate(session, job, "worker-a", 5, 1.0)  # a finished job takes no more
    with factory() as session:
        assert [r.global_step for r in validation_history(session, job.id)] == [0]


def test_a_resume_drops_the_evaluations_past_its_checkpoint_and_a_restart_drops_all(factory):
    job = _running(factory)
    with factory.begin() as session:
        run_steps(session, job, "worker-a", [3.0, 2.5, 2.0, 1.8])
        for step in (0, 2, 4):
            _evaluate(session, job, "worker-a", step, 3.0 - step / 10)
        basename = f"{job.id[:8]}-checkpoint-step-00000002.kiln-checkpoint"
        record_checkpoint(
            session,
            job.id,
            checkpoint_id="sft-step-00000002",
            basename=basename,
            path=f"/storage/adapters/{basename}",
            global_step=2,
            epoch_index=0,
            cursor=2,
            manifest_sha256="sha256:" + "aa" * 32,
            size_bytes=4096,
            write_ms=1.0,
        )
    future = utcnow() + timedelta(seconds=120)
    with factory.begin() as session:
        requeue_for_resume(session, job.id, basename, now=future)
    with factory() as session:
        assert [r.global_step for r in validation_history(session, job.id)] == [0, 2]
    with factory.begin() as session:
        again = claim_job(session, job.id, "worker-c", 60)
        _evaluate(session, again, "worker-c", 4, 1.5)  # the resumed run records step 4 again
    with factory() as session:
        assert [(r.global_step, r.loss) for r in validation_history(session, job.id)] == [
            (0, 3.0),
            (2, 2.8),
            (4, 1.5),
        ]
    with factory.begin() as session:
        requeue_for_restart(
            session,
            job.id,
            resume_checkpoint=None,
            start_step=0,
            reason="test",
            now=future + timedelta(seconds=120),
        )
    with factory() as session:
        assert validation_history(session, job.id) == []


def test_the_view_and_the_pinned_column(factory):
    job = _running(factory)
    with factory.begin() as session:
        _evaluate(session, job, "worker-a", 0, 2.0)
        _evaluate(session, job, "worker-a", 3, 1.5)
        session.get(Admission, job.id).validation = {"holdout_percent": 10, "interval_steps": 3}
    with factory() as session:
        rows = session.execute(
            text(
                "SELECT job_id, adapter_name, global_step, epoch, loss, token_accuracy, supervised_tokens, rows,"
                " evaluated_at FROM v_validation_curve ORDER BY global_step"
            )
        ).all()
        assert [(r.job_id, r.adapter_name, r.global_step, r.loss) for r in rows] == [
            (job.id, job.adapter_name, 0, 2.0),
            (job.id, job.adapter_name, 3, 1.5),
        ]
        assert session.get(Admission, job.id).validation == {"holdout_percent": 10, "interval_steps": 3}
    with factory.begin() as session:
        finish_job(session, job.id, states.COMPLETED, worker_id="worker-a", attempt=job.attempts)
        delete_job(session, job.id)  # a soft delete keeps the curve for SQL history
    with factory() as session:
        assert len(validation_history(session, job.id)) == 2
        assert latest_evaluations(session) == []  # but the gauges forget a deleted job
