"""A resume on a runner whose kernel paths differ from its checkpoint's fails at dequeue with
`plan_drift`, naming the operation, before any model work (docs/kernels.md#checkpoints).

Another GDN path (flash-linear-attention or the torch chunked form) or another fused-kernel set
computes other bits, so the continuation would not be the checkpointed run.
"""

from __future__ import annotations

import dataclasses

from kiln.store import states
from kiln_train.kernels.paths import FLA, GATED_DELTA_RULE, KernelPaths
from tests.api.conftest import sft_body, unique_name
from tests.worker.runtime_support import event_kinds, job_row, steps, submit

CONFIG = {"epochs": 2, "checkpoint_interval": 2, "seed": 29}


def test_a_resume_under_another_gdn_path_is_plan_drift(client, runtime, sessions, settings):
    name = unique_name("kernels")
    first = submit(client, sft_body(3, output_name=name, **CONFIG))
    original = runtime.recording.on_step

    def cancel_after_two(jid, report):
        original(jid, report)
        if report.global_step == 2:
            assert client.delete(f"/v1/train/queue/{jid}").status_code == 200

    runtime.recording.on_step = cancel_after_two
    assert runtime.run_job(first) == "failed"
    runtime.recording.on_step = original
    checkpoint = job_row(sessions, first).latest_checkpoint
    assert checkpoint is not None

    second = submit(client, sft_body(3, resume_checkpoint=checkpoint, **CONFIG))
    resident = runtime.resident
    runtime.resident = dataclasses.replace(
        resident, kernel_paths=KernelPaths({**resident.kernel_paths.paths, GATED_DELTA_RULE: FLA})
    )
    try:
        assert runtime.run_job(second) == "failed"
    finally:
        runtime.resident = resident
    job = job_row(sessions, second)
    assert job.state == states.FAILED and job.failure_reason == "plan_drift"
    assert job.error_code == "training_plan_drift"
    assert job.error_message.startswith(
        "kernel_paths: the checkpoint trained with kernel_paths.gated_delta_rule = 'torch-chunked' "
        "but this runner executes 'fla'"
    ), job.error_message
    assert steps(sessions, second) == [] and "plan_verified" not in event_kinds(sessions, second)
    assert not (settings.adapters_dir / name).exists()
