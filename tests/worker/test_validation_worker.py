"""Held-out validation in the resident worker against the real store (SQLite and Postgres):
the rows re-derived at dequeue (drift fails the job `plan_drift`), every evaluation recorded
under the run's claim with its event, and a warm shutdown in the middle of an evaluation
resumed from its checkpoint into the same history as an uninterrupted run."""

from __future__ import annotations

import json

from sqlalchemy import update

from kiln import store
from kiln.store import states
from kiln.store.models import Admission
from kiln_train import checkpoint as ckpt
from tests.api.conftest import example, unique_name
from tests.worker.runtime_support import event_kinds, job_row, steps, submit


def body(name: str, validation: dict, n: int = 3, **config) -> dict:
    return {
        "examples": [example(i) for i in range(n)],
        "config": {"epochs": 2, "lora_rank": 4, "lora_alpha": 8.0, "seed": 17, "output_name": name, **config},
        "validation": validation,
    }


def curve(sessions, job_id) -> list[tuple[int, int, float, float]]:
    with sessions() as s:
        return [
            (r.global_step, r.epoch, r.loss, r.token_accuracy) for r in store.validation_history(s, job_id)
        ]


def test_every_evaluation_is_recorded_with_its_event(client, runtime, sessions, settings):
    name = unique_name("validated")
    job_id = submit(
        client, body(name, {"holdout_percent": 25, "interval_steps": 2}, n=8, checkpoint_interval=4)
    )
    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.rows_kept == 6 and job.total_steps == 12  # 2 of the 8 rows are held out
    evaluations = job.receipt["validation"]["evaluations"]
    # epoch ends 6 and 12, every 2 steps, the baseline
    assert [e["global_step"] for e in evaluations] == [0, 2, 4, 6, 8, 10, 12]
    assert curve(sessions, job_id) == [
        (e["global_step"], e["epoch"], e["loss"], e["token_accuracy"]) for e in evaluations
    ]
    assert job.receipt["validation"]["source"] == "holdout" and job.receipt["validation"]["rows"] == 2
    kinds = event_kinds(sessions, job_id)
    assert kinds.count(states.EVENT_VALIDATION_EVALUATED) == 7
    assert kinds.index(states.EVENT_VALIDATION_EVALUATED) < kinds.index("epoch_complete")
    with sessions() as s:
        events, _ = store.list_events(s, job_id, limit=1000)
    first = next(e for e in events if e.kind == states.EVENT_VALIDATION_EVALUATED)
    assert first.data["global_step"] == 0 and first.message.startswith("validation at baseline (base model)")
    for record in store_checkpoints(sessions, job_id):
        manifest = ckpt.read_checkpoint_manifest(settings.adapters_dir / record)[0]
        history = manifest.auxiliary_state[ckpt.VALIDATION_HISTORY_AUX_KEY]
        assert history == [e for e in evaluations if e["global_step"] <= manifest.progress.global_step]
    detail = client.get(f"/v1/train/jobs/{job_id}").get_json()
    assert [v["loss"] for v in detail["validation_history"]] == [e["loss"] for e in evaluations]


def store_checkpoints(sessions, job_id) -> list[str]:
    with sessions() as s:
        return [c.basename for c in store.list_checkpoints(s, job_id)]


def test_a_validation_dataset_changed_after_admission_is_plan_drift(client, runtime, sessions, settings):
    data = settings.datasets_dir / "held-out.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(example(i)) + "\n" for i in (30, 31)), encoding="utf-8")
    job_id = submit(client, body(unique_name("drift"), {"dataset_path": "held-out.jsonl"}))
    data.write_text("".join(json.dumps(example(i)) + "\n" for i in (30, 32)), encoding="utf-8")
    assert runtime.run_job(job_id) == "failed"
    job = job_row(sessions, job_id)
    assert job.failure_reason == "plan_drift" and job.error_message.startswith(
        "data.ingestion_receipt_sha256"
    )
    assert steps(sessions, job_id) == [] and curve(sessions, job_id) == []


def test_a_tampered_validation_pin_is_plan_drift(client, runtime, sessions):
    job_id = submit(client, body(unique_name("pin"), {"holdout_percent": 25}, n=8))
    with sessions.begin() as s:
        s.execute(
            update(Admission).where(Admission.job_id == job_id).values(validation={"holdout_percent": 40})
        )
    assert runtime.run_job(job_id) == "failed"
    job = job_row(sessions, job_id)
    assert job.failure_reason == "plan_drift" and job.error_message.startswith("data.")
    assert curve(sessions, job_id) == []


def test_a_warm_shutdown_during_an_evaluation_resumes_into_the_same_history(
    client, runtime, sessions, settings
):
    validation = {"examples": [example(40), example(41)], "interval_steps": 2}
    reference = submit(client, body(unique_name("straight"), validation))
    assert runtime.run_job(reference) == "completed"
    expected = curve(sessions, reference)
    assert [e[0] for e in expected] == [0, 2, 3, 4, 6]

    name = unique_name("interrupted")
    job_id = submit(client, body(name, validation))
    real = runtime.recording.on_step

    def on_step(jid, report):
        real(jid, report)
        if report.global_step == 2:
            runtime.shutdown.set()  # the stop flag is up when the evaluation at step 2 polls it

    runtime.recording.on_step = on_step
    try:
        assert runtime.run_job(job_id) == "requeued"
    finally:
        runtime.recording.on_step = real
        runtime.shutdown.clear()
    job = job_row(sessions, job_id)
    assert (
        job.state == states.QUEUED
        and job.resume_checkpoint == f"{name}-checkpoint-step-00000002.kiln-checkpoint"
    )
    assert curve(sessions, job_id) == expected[:1]  # the interrupted evaluation left no row
    manifest = ckpt.read_checkpoint_manifest(settings.adapters_dir / job.resume_checkpoint)[0]
    assert [e["global_step"] for e in manifest.auxiliary_state[ckpt.VALIDATION_HISTORY_AUX_KEY]] == [0]

    assert runtime.run_job(job_id) == "completed"
    assert curve(sessions, job_id) == expected  # step 2 evaluated first on resume, nothing twice
    job = job_row(sessions, job_id)
    assert [(e["global_step"], e["loss"]) for e in job.receipt["validation"]["evaluations"]] == [
        (e[0], e[2]) for e in expected
    ]
