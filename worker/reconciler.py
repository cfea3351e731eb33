"""The reconciler: nothing admitted is ever lost (DESIGN §1, peers.md §3.4).

At worker start and periodically:
- a job committed but never published (the api died between commit and publish, or the broker
  was down) is published again;
- a running job whose lease expired (its worker died) is completed when the worker had already
  published its adapter, resumed from its newest recorded exact checkpoint that validates on disk
  (newer ones it published but never recorded are withdrawn: the resumed run writes and records
  them again), otherwise failed with `worker_lost`; a job that
  already used up its deliveries is failed too. A job whose owner is provably alive is left alone;
- hidden work directories in the adapter registry that outlived the process that made them
  (SIGKILL, OOM kill or power loss mid-publication, a deletion whose rmtree failed) are deleted.
Every transition is a conditional UPDATE, so two reconcilers racing do no harm.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from kiln import store
from kiln.store import states
from kiln_train import checkpoint as ckpt
from kiln_train.adapter import ADAPTER_MODEL, TRAIN_RECEIPT
from kiln_train.errors import KilnError
from kiln_train.provenance import file_digest
from worker.celery_app import publish_job

log = logging.getLogger(__name__)

PUBLISH_GRACE_SECONDS = 5.0
# A worker idle this long while a published job stays queued concludes that job's doorbell was
# lost (an idle worker takes a waiting message within moments) and rings it again.
LOST_DOORBELL_SECONDS = 60.0
# Hidden directories in the adapter registry are work in progress: a publication's staging dir
# (adapter or checkpoint, `.<name>.incomplete-<id>`), a withdrawal (`.withdrawn-<hex>-<name>`) or
# a deletion's trash (`.trash-<hex>`). The process that made one removes it; one that outlived its
# process is deleted once nothing in it has changed for this long (a live publication writes and
# renames within seconds; the margin covers a slow network filesystem).
ABANDONED_AFTER_SECONDS = 3600.0
_UNREMOVABLE: set[Path] = set()  # abandoned work directories already reported as undeletable
_HIDDEN_WORK = re.compile(
    r"\.(?:.+\.incomplete-[0-9a-f-]+|withdrawn-[0-9a-f]{32}-.+|trash-[0-9a-f]{32})", re.S
)


class Reconciler:
    def __init__(self, runtime) -> None:
        self.runtime = runtime

    def run_once(self) -> dict:
        """One pass; returns counts of what it did (for logs and tests)."""
        done = {"republished": 0, "resumed": 0, "failed": 0, "completed": 0, "swept": 0}
        done["failed"] += self._expire_leases(done)
        done["republished"] += self._republish()
        done["republished"] += self._ring_lost_doorbells()
        done["swept"] += len(sweep_abandoned(self.runtime.settings.adapters_dir))
        return done

    def _ring_lost_doorbells(self) -> int:
        """Publish again the jobs still queued long after their message went out, while this
        worker sat idle: the broker lost the message (Redis restarted without persistence or
        flushed; or a worker died holding it unacknowledged, which Redis gives back only after
        the visibility timeout, days). Without this such a job waited until some newer job's
        doorbell happened to run it first. A duplicate doorbell is harmless: a message whose row
        is not `queued` is dropped."""
        rt = self.runtime
        idle_since = getattr(rt, "idle_since", None)
        if rt.celery is None or idle_since is None or rt.shutdown.is_set():
            return 0
        idle_for = LOST_DOORBELL_SECONDS
        if idle_since > store.utcnow() - timedelta(seconds=idle_for):  # our own clock: a duration
            return 0  # busy until recently: a waiting message may still be on its way to us
        with rt.factory.begin() as s:
            cutoff = store.store_now(s) - timedelta(seconds=idle_for)  # the clock that stamped them
            lost = [(j.id, j.published_at) for j in store.stale_doorbells(s, older_than=cutoff)]
        count = 0
        for job_id, seen in lost:
            if rt.idle_since != idle_since:
                break  # a doorbell arrived meanwhile: this worker is not idle any more
            try:
                with rt.factory.begin() as s:
                    if not store.restamp_published(s, job_id, seen):
                        continue  # another reconciler rang it, or the job left the queue
                    # Published inside the transaction: a failed publish keeps the old stamp.
                    publish_job(rt.celery, job_id, rt.settings.queue.queue_name)
                    store.append_event(
                        s,
                        job_id,
                        states.EVENT_REPUBLISHED,
                        f"still queued {LOST_DOORBELL_SECONDS:.0f} s after its message went out while "
                        "a worker sat idle: the broker lost the message; published again",
                        level=states.LEVEL_WARNING,
                        data={"previously_published_at": seen.isoformat()},
                    )
            except Exception:
                log.exception("ringing the lost doorbell of job %s failed; will retry", job_id)
                continue
            log.warning("job %s: doorbell lost by the broker; published again", job_id)
            count += 1
        return count

    def _republish(self, job_ids: list[str] | None = None) -> int:
        """Publish committed jobs whose message never went out (or `job_ids`, just requeued)."""
        rt = self.runtime
        if rt.celery is None:
            return 0
        if job_ids is None:
            with rt.factory.begin() as s:
                cutoff = store.store_now(s) - timedelta(seconds=PUBLISH_GRACE_SECONDS)
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
        stale = rt.settings.training.runner_stale_seconds
        with rt.factory.begin() as s:
            expired = [_lost_job(s, j) for j in store.expired_leases(s, owner_fresh_seconds=stale)]
        for lost in expired:
            published = self._published_adapter(lost)
            resume = None
            if (
                published is None
                and not lost.cancel_requested
                and lost.attempts - lost.releases < rt.settings.training.max_attempts
            ):
                resume = self._resumable(lost)
            try:
                with rt.factory.begin() as s:
                    if published is not None:
                        store.complete_lost_job(s, lost.job_id, **published)
                        done["completed"] += 1
                        log.warning(
                            "job %s: worker lost after publishing its adapter; completed", lost.job_id
                        )
                    elif resume is not None:
                        store.requeue_for_resume(s, lost.job_id, resume[0])
                        requeued.append(lost.job_id)
                        done["resumed"] += 1
                        log.warning("job %s: worker lost; requeued from %s", lost.job_id, resume[0])
                    else:
                        store.fail_worker_lost(s, lost.job_id)
                        failed += 1
                        log.warning("job %s: worker lost; no resumable checkpoint", lost.job_id)
                if resume is not None:
                    self._withdraw_unrecorded(lost.job_id, resume[1])
            except store.InvalidTransition:
                continue  # another reconciler (or the worker itself) moved it first
            except KilnError as exc:  # the adapter's name was registered meanwhile
                log.warning("job %s: cannot complete from its published adapter: %s", lost.job_id, exc)
                with rt.factory.begin() as s:
                    try:
                        store.fail_worker_lost(s, lost.job_id)
                        failed += 1
                    except store.InvalidTransition:
                        continue
        self._republish(requeued)  # our own transition: no api publish to race
        return failed

    def _published_adapter(self, lost: LostJob) -> dict | None:
        """The job's adapter, when its worker published it (atomically, under the final name) and
        was lost before recording that: the receipt must name this run (adapter, seed, corpus)."""
        path = self.runtime.settings.adapters_dir / lost.adapter_name
        model, receipt_file = path / ADAPTER_MODEL, path / TRAIN_RECEIPT
        if not (model.is_file() and receipt_file.is_file()):
            return None
        try:
            receipt = json.loads(receipt_file.read_text(encoding="utf-8"))
            ingestion = receipt["data"]["sft_ingestion"]
            ours = (
                receipt["status"] == "success"
                and receipt["adapter_name"] == lost.adapter_name
                and str(receipt["config"]["seed"]) == lost.effective_seed
                and _bare(ingestion["kept_corpus_sha256"]) == _bare(lost.kept_corpus_sha256)
            )
            if not ours:
                return None
            hyper = receipt["hyperparameters"]
            base = (receipt.get("model") or {}).get("base_weight_shard_manifest") or {}
            return {
                "adapter_path": str(path),
                "receipt": receipt,
                "size_bytes": sum(p.stat().st_size for p in path.iterdir() if p.is_file()),
                "safetensors_sha256": file_digest(model),
                "rank": int(hyper["rank"]),
                "alpha": float(hyper["alpha"]),
                "base_model_sha256": base.get("aggregate_sha256"),
            }
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("adapter %s of job %s is not usable: %s", path, lost.job_id, exc)
            return None

    def _resumable(self, lost: LostJob) -> tuple[str, list[Path]] | None:
        """The job's newest recorded checkpoint that still validates on disk, and the newer ones
        its worker published but did not live to record or that no longer validate (damaged on
        disk): the resumed run publishes those names again (and records their steps), so they
        are withdrawn once the job is requeued and their rows are dropped."""
        rt = self.runtime
        with rt.factory.begin() as s:
            recorded = {c.basename: c.manifest_sha256 for c in store.list_checkpoints(s, lost.job_id)}
        unrecorded: list[Path] = []
        for basename in _checkpoint_dirs(rt.settings.adapters_dir, lost.adapter_name):
            path = rt.settings.adapters_dir / basename
            if basename not in recorded:
                if _written_by(path, lost):
                    unrecorded.append(path)
                continue
            try:
                loaded = ckpt.load_checkpoint(path, verify_hashes=True)
            except Exception as exc:
                log.warning("checkpoint %s of job %s is not resumable: %s", basename, lost.job_id, exc)
                unrecorded.append(path)  # newer than the resume point: the resumed run rewrites it
                continue
            if loaded.manifest_sha256 == _bare(recorded[basename]):
                return basename, unrecorded
            log.warning("checkpoint %s of job %s is not the one recorded", basename, lost.job_id)
            unrecorded.append(path)
        return None

    def _withdraw_unrecorded(self, job_id: str, paths: list[Path]) -> None:
        with self.runtime.factory.begin() as s:
            recorded = {c.basename for c in store.list_checkpoints(s, job_id)}
        for path in paths:
            if path.name not in recorded:
                log.warning("job %s: withdrawing %s (published, never recorded)", job_id, path.name)
                withdraw(path)


@dataclass(frozen=True)
class LostJob:
    """What the reconciler needs of a job whose lease expired (plain values, no ORM objects)."""

    job_id: str
    attempts: int
    releases: int  # deliveries ended by a graceful release (not lost; not counted)
    cancel_requested: bool
    adapter_name: str
    effective_seed: str
    kept_corpus_sha256: str
    total_steps: int


def _lost_job(s, job) -> LostJob:
    admission = store.get_admission(s, job.id)
    return LostJob(
        job_id=job.id,
        attempts=job.attempts,
        releases=store.count_graceful_releases(s, job.id),
        cancel_requested=job.cancel_requested,
        adapter_name=job.adapter_name,
        effective_seed=job.effective_seed,
        kept_corpus_sha256=admission.kept_corpus_sha256 if admission is not None else "",
        total_steps=job.total_steps,
    )


def _bare(digest: str) -> str:
    return digest.removeprefix("sha256:")


def _checkpoint_dirs(adapters_dir: Path, adapter_name: str) -> list[str]:
    """Basenames of the adapter's `.kiln-checkpoint` directories, highest step first."""
    pattern = re.compile(
        rf"{re.escape(adapter_name)}-checkpoint-step-([0-9]{{8,}}){re.escape(ckpt.CHECKPOINT_SUFFIX)}"
    )
    found = []
    if adapters_dir.is_dir():
        for entry in adapters_dir.iterdir():
            match = pattern.fullmatch(entry.name)
            if match is not None:
                found.append((int(match.group(1)), entry.name))
    return [name for _, name in sorted(found, reverse=True)]


def unrecorded_checkpoints_beyond(
    adapters_dir: Path, resume_basename: str, recorded: set[str], lost: LostJob
) -> list[Path]:
    """The job's checkpoint directories above the step of `resume_basename` that no row in
    `recorded` names and that this job's run wrote (same adapter, seed, data and length)."""
    names = _checkpoint_dirs(adapters_dir, lost.adapter_name)
    if resume_basename not in names:
        return []
    newer = names[: names.index(resume_basename)]  # highest step first
    return [
        adapters_dir / name
        for name in newer
        if name not in recorded and _written_by(adapters_dir / name, lost)
    ]


def _written_by(path: Path, lost: LostJob) -> bool:
    """Whether a checkpoint directory was written by this job's run (same adapter, seed, data and
    length; adapter names are unique among live jobs)."""
    try:
        manifest, _ = ckpt.read_checkpoint_manifest(path)
    except Exception:
        return False
    return (
        manifest.training_kind == "sft"
        and manifest.adapter_name == lost.adapter_name
        and str(manifest.seed) == lost.effective_seed
        and _bare(manifest.data.content_sha256) == _bare(lost.kept_corpus_sha256)
        and manifest.progress.total_steps == lost.total_steps
    )


def sweep_abandoned(
    directory: Path, *, older_than: float | None = None, now: float | None = None
) -> list[str]:
    """Delete the hidden work directories in `directory` (see `_HIDDEN_WORK`) in which nothing
    has changed for `older_than` seconds (default `ABANDONED_AFTER_SECONDS`); returns their
    names. Anything else is left alone: published adapters and checkpoints, other hidden files,
    symlinks."""
    older_than = ABANDONED_AFTER_SECONDS if older_than is None else older_than
    now = time.time() if now is None else now
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    swept = []
    for entry in entries:
        if not _HIDDEN_WORK.fullmatch(entry.name):
            continue
        try:
            if entry.is_symlink() or not entry.is_dir() or now - _last_change(entry) < older_than:
                continue
        except OSError:
            continue  # gone meanwhile: its owner finished with it
        shutil.rmtree(entry, ignore_errors=True)
        if os.path.lexists(entry):
            if entry not in _UNREMOVABLE:  # once, not every pass
                _UNREMOVABLE.add(entry)
                log.warning("could not delete the abandoned work directory %s; delete it by hand", entry)
            continue
        log.warning("deleted %s: abandoned by a process that did not finish with it", entry)
        swept.append(entry.name)
    return swept


def _last_change(root: Path) -> float:
    """The newest modification or status change of `root` and everything under it (symlinks are
    not followed; ctime also moves on a rename into the tree, and no one can set it back)."""
    st = root.lstat()
    newest = max(st.st_mtime, st.st_ctime)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            newest = max(newest, st.st_mtime, st.st_ctime)
    return newest


def withdraw(path: Path) -> None:
    """Take a published directory back: one rename to a hidden name (a reader never sees half of
    it), then delete."""
    if not path.exists():
        return
    hidden = path.parent / f".withdrawn-{uuid.uuid4().hex}-{path.name}"[:255]
    try:
        path.rename(hidden)
    except OSError:
        log.exception("could not withdraw %s", path)
        return
    shutil.rmtree(hidden, ignore_errors=True)
