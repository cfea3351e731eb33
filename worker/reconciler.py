"""The reconciler: nothing admitted is ever lost (DESIGN §1, peers.md §3.4).

At worker start and periodically:
- a job committed but never published (the api died between commit and publish, or the broker
  was down) is published again;
- a running job whose lease expired (its worker died) is resumed from its latest exact
  checkpoint when one exists and is valid on disk, otherwise failed with `worker_lost`;
  a job that already used up its deliveries is failed too.
Every transition is a conditional UPDATE, so two reconcilers racing do no harm.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from kiln import store
from kiln.store import states
from kiln_train import checkpoint as ckpt
from worker.celery_app import publish_job

log = logging.getLogger(__name__)

PUBLISH_GRACE_SECONDS = 5.0


class Reconciler:
    def __init__(self, runtime) -> None:
        self.runtime = runtime

    def run_once(self) -> dict:
        """One pass; returns counts of what it did (for logs and tests)."""
        done = {"republished": 0, "resumed": 0, "failed": 0}
        done["failed"] += self._expire_leases(done)
        done["republished"] += self._republish()
        return done

    def _republish(self, job_ids: list[str] | None = None) -> int:
        """Publish committed jobs whose message never went out (or `job_ids`, just requeued)."""
        rt = self.runtime
        if rt.celery is None:
            return 0
        if job_ids is None:
            cutoff = store.utcnow() - timedelta(seconds=PUBLISH_GRACE_SECONDS)
            with rt.factory.begin() as s:
                job_ids = [j.id for j in store.unpublished_jobs(s, older_than=cutoff)]
        count = 0
        for job_id in job_ids:
            try:
                publish_job(rt.celery, job_id, rt.settings.queue.queue_name)
            except Exception:
                log.exception("republishing job %s failed; will retry", job_id)
                continue
            with rt.factory.begin() as s:
                if store.mark_published(s, job_id):
                    store.append_event(s, job_id, states.EVENT_REPUBLISHED, "published by the reconciler")
                    count += 1
        return count

    def _expire_leases(self, done: dict) -> int:
        rt = self.runtime
        failed, requeued = 0, []
        with rt.factory.begin() as s:
            expired = [(j.id, j.attempts, j.cancel_requested) for j in store.expired_leases(s)]
        for job_id, attempts, cancel in expired:
            resume = (
                None if cancel or attempts >= rt.settings.training.max_attempts else self._resumable(job_id)
            )
            try:
                with rt.factory.begin() as s:
                    if resume is not None:
                        store.requeue_for_resume(s, job_id, resume)
                        requeued.append(job_id)
                        done["resumed"] += 1
                        log.warning("job %s: worker lost; requeued from %s", job_id, resume)
                    else:
                        store.fail_worker_lost(s, job_id)
                        failed += 1
                        log.warning("job %s: worker lost; no resumable checkpoint", job_id)
            except store.InvalidTransition:
                continue  # another reconciler (or the worker itself) moved it first
        self._republish(requeued)  # our own transition: no api publish to race
        return failed

    def _resumable(self, job_id: str) -> str | None:
        """The job's latest recorded checkpoint, if it still validates on disk."""
        rt = self.runtime
        with rt.factory.begin() as s:
            rows = [(c.basename, c.manifest_sha256) for c in reversed(store.list_checkpoints(s, job_id))]
        for basename, digest in rows:
            path = rt.settings.adapters_dir / basename
            try:
                loaded = ckpt.load_checkpoint(path, verify_hashes=True)
            except Exception as exc:
                log.warning("checkpoint %s of job %s is not resumable: %s", basename, job_id, exc)
                continue
            if loaded.manifest_sha256 == digest.removeprefix("sha256:"):
                return basename
        return None
