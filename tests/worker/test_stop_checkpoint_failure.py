"""A stop whose checkpoint cannot be written (full or failing disk) is still a stop.

The trainer honours the stop and ends `cancelled`, naming the write error; the run's latest earlier
checkpoint stays its resume point. For a warm shutdown the worker then releases the job (resumed
from that checkpoint, or failed `worker_lost` without one) instead of failing it for good as a
`training_error`.
"""

from __future__ import annotations

import errno

import kiln_train.checkpoint as ckpt
from tests.api.conftest import sft_body, unique_name
from tests.kiln_train.train import trainer_fixtures as fx
from tests.worker.runtime_support import event_kinds, job_row, submit


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_the_trainer_honours_a_stop_whose_checkpoint_fails(resident, monkeypatch, tmp_path):
    ingestion = fx.ingest(resident, fx.conversations(3))
    monkeypatch.setattr(ckpt, "publish_checkpoint", _enospc)
    done = {"step": 0}

    def progress(report):
        done["step"] = report.global_step

    result = fx.train(
        resident,
        fx.make_config(epochs=1),
        ingestion,
        tmp_path,
        progress=progress,
        should_stop=lambda: done["step"] >= 1,
    )
    assert result.status == "failed" and result.failure_reason == "cancelled"
    assert result.global_step == 1
    assert "could not be written (OSError: [Errno 28] No space left on device)" in result.failure_message
    assert result.checkpoints == []
    assert list(tmp_path.glob("*.kiln-checkpoint")) == []


def test_a_warm_shutdown_whose_checkpoint_fails_releases_the_job(client, runtime, sessions, monkeypatch):
    job_id = submit(client, sft_body(3, output_name=unique_name("enospc")))
    monkeypatch.setattr(ckpt, "publish_checkpoint", _enospc)
    original = runtime.recording.on_step

    def on_step(jid, report):
        original(jid, report)
        runtime.request_shutdown()

    runtime.recording.on_step = on_step
    try:
        outcome = runtime.run_job(job_id)
    finally:
        runtime.recording.on_step = original
        runtime.shutdown.clear()
    assert outcome == "requeued"
    job = job_row(sessions, job_id)
    # No checkpoint was ever written: the job runs again from step 0, not a training_error
    # blamed on the job.
    assert (job.state, job.failure_reason, job.global_step) == ("queued", None, 0)
    assert "requeued" in event_kinds(sessions, job_id)


def test_an_adapter_whose_registry_fsync_fails_is_not_left_behind(resident, monkeypatch, tmp_path):
    import kiln_train.artifacts.adapter as adapter_io

    real = adapter_io.fsync_dir

    def failing(path):
        if tmp_path.resolve() == type(tmp_path)(path).resolve():
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(adapter_io, "fsync_dir", failing)
    result = fx.train(resident, fx.make_config(epochs=1), fx.ingest(resident, fx.conversations(2)), tmp_path)
    assert result.status == "failed" and "Input/output error" in result.failure_message
    assert not (tmp_path / result.adapter_name).exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []
