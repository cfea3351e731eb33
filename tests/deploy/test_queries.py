"""deploy/queries.sql on SQLite and Postgres: every documented query runs against a job history
seeded through the store API, and answers with the values that history implies."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import bindparam, text

from kiln.store import (
    UtcDateTime,
    ValidationEvaluation,
    claim_job,
    finish_job,
    get_job,
    make_engine,
    record_checkpoint,
    record_evaluation,
    register_adapter,
    request_cancel,
    requeue_for_resume,
    session_factory,
    states,
    utcnow,
    validation_history,
)
from tests.deploy.queries_sql import QUERIES
from tests.kiln.store.store_support import BACKENDS, admit, claim_and_finish, migrated_database, run_steps


def test_every_query_is_documented_and_tested():
    assert len(QUERIES) >= 10
    for name, (question, sql) in QUERIES.items():
        assert question.endswith("?") or "?" in question, f"{name}: say the question it answers"
        assert sql.upper().startswith("SELECT"), name
    tested = {name[len("test_") :] for name in globals() if name.startswith("test_")}
    assert set(QUERIES) <= tested, f"queries without a test: {set(QUERIES) - tested}"


def as_utc(value):
    """Timestamps from views come back as datetimes (Postgres) or UTC text (SQLite)."""
    if isinstance(value, str):
        return datetime.fromisoformat(value).replace(tzinfo=UTC)
    return value


@pytest.fixture(scope="module", params=BACKENDS)
def history(request, tmp_path_factory):
    """A job history with completed, failed, cancelled, resumed, running and queued jobs."""
    with migrated_database(request.param, tmp_path_factory.mktemp("queries")) as url:
        engine = make_engine(url)
        factory = session_factory(engine)
        seeded = _seed(factory)
        seeded["factory"] = factory
        yield seeded
        engine.dispose()


def _completed(factory, losses, *, step_ms, tokens, final_loss, wall_clock_ms, peak, **job):
    with factory.begin() as session:
        record = admit(session, **job)
        claimed = claim_job(session, record.id, "worker-1", 60)
        run_steps(session, claimed, "worker-1", losses, step_ms=step_ms, tokens=tokens)
        finish_job(
            session,
            record.id,
            states.COMPLETED,
            worker_id="worker-1",
            final_loss=final_loss,
            wall_clock_ms=wall_clock_ms,
            peak_memory_bytes=peak,
        )
    return record.id


def _seed(factory) -> dict:
    ids: dict[str, str] = {}
    ids["a"] = _completed(
        factory, [2.0, 1.0, 0.5], step_ms=100.0, tokens=50, final_loss=0.5, wall_clock_ms=3000, peak=1000,
        optimizer_kind="muon", lora_rank=8,
    )  # fmt: skip
    ids["b"] = _completed(
        factory, [1.2, 0.8], step_ms=200.0, tokens=100, final_loss=0.8, wall_clock_ms=5000, peak=3000,
        optimizer_kind="adam_w", lora_rank=16, lora_alpha=32.0,
    )  # fmt: skip
    ids["c"] = _completed(
        factory, [0.9, 0.3], step_ms=300.0, tokens=60, final_loss=0.3, wall_clock_ms=4000, peak=2000,
        optimizer_kind="muon", lora_rank=16, lora_alpha=32.0, adapter_name="bot-c",
    )  # fmt: skip
    with factory.begin() as session:
        register_adapter(
            session, name="bot-c", job_id=ids["c"], path="/s/adapters/bot-c", size_bytes=777,
            safetensors_sha256="sha256:" + "12" * 32, rank=16, alpha=32.0,
        )  # fmt: skip

    with factory.begin() as session:
        oom_early = admit(session, lora_rank=32, lora_alpha=64.0)
        claim_and_finish(
            session, oom_early.id, states.FAILED, failure_reason="oom", error_message="CUDA OOM early"
        )
    ids["oom_early"] = oom_early.id
    time.sleep(0.02)
    between_ooms = utcnow()
    time.sleep(0.02)
    with factory.begin() as session:
        oom_late = admit(session, lora_rank=32, lora_alpha=64.0)
        claim_and_finish(
            session, oom_late.id, states.FAILED, failure_reason="oom", error_message="CUDA OOM late"
        )
        nan = admit(session)
        claim_and_finish(session, nan.id, states.FAILED, failure_reason="nan_loss")
        cancelled = admit(session)
        request_cancel(session, cancelled.id)
    ids.update(oom_late=oom_late.id, nan=nan.id, cancelled=cancelled.id)

    # A job whose worker died after step 2: resumed from its checkpoint, completed on attempt 2.
    with factory.begin() as session:
        resumed = admit(session, optimizer_kind="sgd", lora_rank=8)
        held = claim_job(session, resumed.id, "worker-1", 60)
        run_steps(session, held, "worker-1", [3.0, 2.0], step_ms=50.0, tokens=10)
        checkpoint = record_checkpoint(
            session, resumed.id, checkpoint_id="sft-step-00000002", basename="r-checkpoint-step-00000002.kiln-checkpoint",
            path="/s/adapters/r-checkpoint-step-00000002.kiln-checkpoint", global_step=2, epoch_index=0, cursor=2,
            manifest_sha256="sha256:" + "34" * 32, size_bytes=10, write_ms=1.0,
        )  # fmt: skip
    with factory.begin() as session:
        requeue_for_resume(session, resumed.id, checkpoint.basename, now=utcnow() + timedelta(seconds=61))
        held = claim_job(session, resumed.id, "worker-2", 60)
        run_steps(session, held, "worker-2", [1.5], start=3, step_ms=50.0, tokens=10)
        finish_job(
            session, resumed.id, states.COMPLETED, worker_id="worker-2", final_loss=0.9, wall_clock_ms=1000,
            peak_memory_bytes=500,
        )  # fmt: skip
    ids["resumed"] = resumed.id

    with factory.begin() as session:
        running = admit(session, optimizer_kind="muon", lora_rank=8, total_steps=20)
        held = claim_job(session, running.id, "worker-3", 60)
        run_steps(session, held, "worker-3", [2.0], step_ms=100.0, tokens=50)
        ids["running"] = running.id
        ids["queued_first"] = admit(session).id
        ids["queued_second"] = admit(session).id
    return {"ids": ids, "between_ooms": between_ooms}


def run(history, name: str, **params):
    _, sql = QUERIES[name]
    statement = text(sql)
    for key, value in params.items():
        if isinstance(value, datetime):
            statement = statement.bindparams(bindparam(key, type_=UtcDateTime()))
    with history["factory"]() as session:
        return [tuple(row) for row in session.execute(statement, params)]


def test_failed_oom_last_week(history):
    ids = history["ids"]
    week_ago = utcnow() - timedelta(days=7)
    rows = run(history, "failed_oom_last_week", since=week_ago)
    assert [(r[0], r[2], r[5]) for r in rows] == [
        (ids["oom_late"], 32, "CUDA OOM late"),
        (ids["oom_early"], 32, "CUDA OOM early"),
    ]
    assert as_utc(rows[0][6]) >= as_utc(rows[1][6]) >= week_ago
    assert [r[0] for r in run(history, "failed_oom_last_week", since=history["between_ooms"])] == [
        ids["oom_late"]
    ]
    assert run(history, "failed_oom_last_week", since=utcnow() + timedelta(minutes=1)) == []


def test_loss_curve(history):
    rows = run(history, "loss_curve", job_id=history["ids"]["resumed"])
    assert [(r[0], r[2], r[4]) for r in rows] == [(1, 3.0, 50.0), (2, 2.0, 50.0), (3, 1.5, 50.0)]
    assert run(history, "loss_curve", job_id="no-such-job") == []


def test_mean_step_time_by_rank(history):
    rows = run(history, "mean_step_time_by_rank")
    assert [(r[0], r[1], r[2]) for r in rows] == [(8, 3, 7), (16, 2, 4)]
    assert rows[0][3] == pytest.approx((4 * 100.0 + 3 * 50.0) / 7)
    assert rows[1][3] == pytest.approx(250.0)


def test_failures_by_reason(history):
    rows = run(history, "failures_by_reason")
    assert [(r[0], r[1]) for r in rows] == [("oom", 2), ("cancelled", 1), ("nan_loss", 1)]
    with history["factory"]() as session:
        late = get_job(session, history["ids"]["oom_late"]).finished_at
    assert as_utc(rows[0][2]) == late


def test_queue_depth(history):
    ((queued, oldest),) = run(history, "queue_depth")
    with history["factory"]() as session:
        first = get_job(session, history["ids"]["queued_first"]).submitted_at
    assert queued == 2 and as_utc(oldest) == first


def test_queue(history):
    ids = history["ids"]
    assert [(r[0], r[1]) for r in run(history, "queue")] == [
        (1, ids["queued_first"]),
        (2, ids["queued_second"]),
    ]


def test_final_loss_by_optimizer(history):
    rows = run(history, "final_loss_by_optimizer")
    assert [r[0] for r in rows] == ["adam_w", "muon", "sgd"]
    assert [r[1] for r in rows] == [1, 2, 1]
    assert [r[2] for r in rows] == pytest.approx([0.8, 0.4, 0.9])
    assert [r[3] for r in rows] == pytest.approx([0.8, 0.3, 0.9])


def test_slowest_jobs(history):
    ids = history["ids"]
    rows = run(history, "slowest_jobs", limit=2)
    assert [(r[0], r[2]) for r in rows] == [(ids["b"], 5000), (ids["c"], 4000)]
    assert len(run(history, "slowest_jobs", limit=10)) == 4  # a, b, c, resumed


def test_throughput_by_rank_optimizer(history):
    rows = run(history, "throughput_by_rank_optimizer")
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        (8, "muon", 2, 4),
        (8, "sgd", 1, 3),
        (16, "adam_w", 1, 2),
        (16, "muon", 1, 2),
    ]
    assert [r[4] for r in rows] == pytest.approx([100.0, 50.0, 200.0, 300.0])
    # tokens per second = sum(tokens) * 1000 / sum(step_ms)
    assert [r[5] for r in rows] == pytest.approx([500.0, 200.0, 500.0, 200.0])


def test_peak_memory_by_rank(history):
    assert run(history, "peak_memory_by_rank") == [(8, 2, 1000), (16, 2, 3000)]


def test_retried_jobs(history):
    assert run(history, "retried_jobs") == [
        (history["ids"]["resumed"], _adapter(history, "resumed"), 2, "completed", None)
    ]


def test_running_jobs(history):
    rows = run(history, "running_jobs")
    assert [(r[0], r[2], r[3], r[4], r[5], bool(r[7])) for r in rows] == [
        (history["ids"]["running"], "worker-3", 1, 20, 2.0, False)
    ]
    assert as_utc(rows[0][6]) is not None


def test_adapter_lineage(history):
    rows = run(history, "adapter_lineage", adapter_name="bot-c")
    assert [(r[0], r[2], r[3], r[4], r[6], r[7], r[11]) for r in rows] == [
        ("bot-c", 777, history["ids"]["c"], "muon", 16, 32.0, 0.3)
    ]
    assert run(history, "adapter_lineage", adapter_name="nope") == []


def _adapter(history, key: str) -> str:
    with history["factory"]() as session:
        return get_job(session, history["ids"][key]).adapter_name


def _seed_evaluations(history) -> tuple[str, str]:
    """Validation evaluations of the running job and of a completed one (written once)."""
    ids = history["ids"]
    with history["factory"].begin() as session:
        if not validation_history(session, ids["running"]):
            running = get_job(session, ids["running"])
            for step, loss in ((0, 3.0), (1, 2.5)):
                point = {"global_step": step, "epoch": 0, "loss": loss, "token_accuracy": 0.1 * (step + 1)}
                point.update(supervised_tokens=40, rows=2)
                record_evaluation(session, ids["running"], "worker-3", point, attempt=running.attempts)
            session.add_all(
                ValidationEvaluation(
                    job_id=ids["a"],
                    global_step=step,
                    epoch=step // 3,
                    loss=loss,
                    token_accuracy=0.5,
                    supervised_tokens=30,
                    rows=1,
                    evaluated_at=utcnow(),
                )  # fmt: skip
                for step, loss in ((0, 4.0), (2, 1.5), (3, 2.0))
            )
    return ids["running"], ids["a"]


def test_validation_curve(history):
    running, _ = _seed_evaluations(history)
    rows = run(history, "validation_curve", job_id=running)
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [(0, 0, 3.0, 40), (1, 0, 2.5, 40)]
    assert [r[3] for r in rows] == pytest.approx([0.1, 0.2])
    assert as_utc(rows[0][5]) <= as_utc(rows[1][5])
    assert run(history, "validation_curve", job_id=history["ids"]["b"]) == []


def test_validation_by_job(history):
    running, completed = _seed_evaluations(history)
    rows = {r[0]: r[2:] for r in run(history, "validation_by_job")}
    assert rows == {running: (3.0, 2.5, 2.5, 1, 2), completed: (4.0, 2.0, 1.5, 3, 3)}
