"""A user resume of a run whose gradient checkpoint plan was planned automatically (the default).

Admission pins `{max_segments, auto, budget_bytes}`; with `auto` every row gets the fewest
segments whose bound fits the budget admission saw, and the checkpoint binds the digest of that
per-row list. A resume is a new admission on another day with another free-memory reading, so it
must re-derive the rows from the checkpoint's recorded plan (`auxiliary_state.
gradient_checkpoint_plan`), not plan afresh, and its admission pins that plan, so the job passes
the dequeue check of `gradient_checkpoint_plan_sha256`.
"""

from __future__ import annotations

import hashlib

from sqlalchemy import select, update

from kiln import store
from kiln.store.models import Admission, Runner
from kiln_train.checkpoint import load_checkpoint
from tests.api.conftest import sft_body, unique_name
from tests.worker.runtime_support import job_row, submit

CONFIG = {"epochs": 2, "checkpoint_interval": 2, "seed": 23}  # no grad_checkpoint_segments: auto


def _plan(sessions, job_id: str) -> dict:
    with sessions() as s:
        return s.scalars(select(Admission.checkpoint_plan).where(Admission.job_id == job_id)).one()


def _adapter_sha(settings, name: str) -> str:
    return hashlib.sha256(
        (settings.adapters_dir / name / "adapter_model.safetensors").read_bytes()
    ).hexdigest()


def _cancel_after(client, runtime, step: int) -> None:
    original = runtime.recording.on_step

    def on_step(jid, report):
        original(jid, report)
        if report.global_step == step:
            assert client.delete(f"/v1/train/queue/{jid}").status_code == 200

    runtime.recording.on_step = on_step


def _cancelled_run(client, runtime, sessions, settings, name: str) -> tuple[str, str]:
    first = submit(client, sft_body(3, output_name=name, **CONFIG))
    plan = _plan(sessions, first)
    assert plan["auto"] is True and plan["budget_bytes"] > 0
    original = runtime.recording.on_step
    _cancel_after(client, runtime, 2)
    assert runtime.run_job(first) == "failed"
    runtime.recording.on_step = original
    assert job_row(sessions, first).failure_reason == "cancelled"
    checkpoint = job_row(sessions, first).latest_checkpoint
    assert checkpoint is not None
    manifest = load_checkpoint(settings.adapters_dir / checkpoint).manifest
    assert manifest.auxiliary_state["gradient_checkpoint_plan"] == {
        "max_segments": plan["max_segments"],
        "auto": True,
        "budget_bytes": plan["budget_bytes"],
    }
    return first, checkpoint


def test_an_auto_planned_run_resumes_through_the_api_bit_exactly(client, runtime, sessions, settings):
    straight_name = unique_name("auto-straight")
    straight = submit(client, sft_body(3, output_name=straight_name, **CONFIG))
    assert runtime.run_job(straight) == "completed"

    name = unique_name("auto-resumed")
    first, checkpoint = _cancelled_run(client, runtime, sessions, settings, name)
    second = submit(client, sft_body(3, resume_checkpoint=checkpoint, **CONFIG))
    assert _plan(sessions, second)["auto"] is True
    assert _plan(sessions, second)["budget_bytes"] == _plan(sessions, first)["budget_bytes"]
    assert runtime.run_job(second) == "completed", job_row(sessions, second).error_message
    assert job_row(sessions, second).adapter_name == name
    assert _adapter_sha(settings, name) == _adapter_sha(settings, straight_name)


def test_a_resume_under_another_free_memory_reading_keeps_the_checkpoints_plan(
    client, runtime, sessions, settings
):
    name = unique_name("auto-drift")
    first, checkpoint = _cancelled_run(client, runtime, sessions, settings, name)
    with sessions.begin() as s:
        runner = s.scalars(select(Runner).where(Runner.id == runtime.worker_id)).one()
        drifted = runner.free_memory_bytes - (3 << 30)
        s.execute(update(Runner).where(Runner.id == runner.id).values(free_memory_bytes=drifted))
    second = submit(client, sft_body(3, resume_checkpoint=checkpoint, **CONFIG))
    pinned, original = _plan(sessions, second), _plan(sessions, first)
    assert (pinned["auto"], pinned["max_segments"], pinned["budget_bytes"]) == (
        True,
        original["max_segments"],
        original["budget_bytes"],
    )
    assert runtime.run_job(second) == "completed", job_row(sessions, second).error_message


def test_a_resume_whose_rows_no_longer_fit_is_413_and_leaves_nothing(client, runtime, sessions, settings):
    name = unique_name("auto-small")
    _, checkpoint = _cancelled_run(client, runtime, sessions, settings, name)
    with sessions.begin() as s:
        s.execute(
            update(Runner).where(Runner.id == runtime.worker_id).values(free_memory_bytes=(1 << 30) + 4096)
        )
    with sessions() as s:
        before = len(store.list_jobs(s))
    response = client.post("/v1/train/sft", json=sft_body(3, resume_checkpoint=checkpoint, **CONFIG))
    assert response.status_code == 413
    assert response.get_json()["error"]["code"] == "training_will_not_fit"
    with sessions() as s:
        assert len(store.list_jobs(s)) == before
