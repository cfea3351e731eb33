"""A heartbeat that read the current run just before a warm-shutdown release must not renew the
lease the release expires: the release waits for that heartbeat to finish (`lease_lock`), so the
job never stays `running` under a fresh lease after its worker let it go."""

from __future__ import annotations

import threading
import time

from kiln import store
from tests.api.conftest import sft_body, unique_name
from tests.worker.test_runtime import job_row, submit
from worker.runtime import CurrentRun


class _PausingFactory:
    """The runtime's session factory, pausing `begin()` on the thread named `pause_thread`."""

    def __init__(self, inner, pause_thread: str):
        self.inner, self.pause_thread = inner, pause_thread
        self.entered, self.go = threading.Event(), threading.Event()

    def begin(self):
        if threading.current_thread().name == self.pause_thread:
            self.entered.set()
            assert self.go.wait(30)
        return self.inner.begin()

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_a_release_waits_for_the_heartbeat_that_already_read_the_run(client, runtime, sessions):
    job_id = submit(client, sft_body(2, output_name=unique_name("hb-race")))
    pinned = runtime._claim(job_id)
    assert pinned is not None
    runtime.run = CurrentRun(job_id, 1, pinned.attempt)
    factory = runtime.factory
    pausing = runtime.factory = _PausingFactory(factory, "hb")
    outcome: list[str] = []
    heartbeat = threading.Thread(target=runtime.heartbeat, name="hb")
    release = threading.Thread(target=lambda: outcome.append(runtime._release_for_resume(job_id)), name="rel")
    try:
        heartbeat.start()
        assert pausing.entered.wait(30)  # the heartbeat holds the run it read, not yet renewed
        release.start()
        time.sleep(0.5)
        assert release.is_alive(), "the release went ahead of a heartbeat that had read the run"
        pausing.go.set()
        heartbeat.join(30)
        release.join(30)
    finally:
        pausing.go.set()
        runtime.factory = factory
    assert outcome == ["requeued"] and runtime.run is None
    job = job_row(sessions, job_id)
    # Let go: requeued (from step 0: no checkpoint here), never running on a renewed lease.
    renewed = job.lease_expires_at is not None and job.lease_expires_at > store.utcnow()
    assert not (job.state == "running" and renewed), (job.state, job.lease_expires_at)
    assert job.state == "queued" and job.global_step == 0
