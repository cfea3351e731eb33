"""The reconciler: nothing admitted is ever lost (docs/recovery.md#reconciler).

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
from kiln.broker import publish_job
from kiln.store import states
from kiln_train import checkpoint as ckpt
from kiln_train.artifacts.adapter import ADAPTER_MODEL, TRAIN_RECEIPT
from kiln_train.artifacts.fencing import RunIdentity, rehome
from kiln_train.errors import KilnError
from kiln_train.ground.digest import file_digest
from worker.attempt_progress import settle_lost

log = logging.getLogger(__name__)

PUBLISH_GRACE_SECONDS = 5.0
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
        done["republished"] += self._republish_lost_messages()
        done["swept"] += len(sweep_abandoned(self.runtime.settings.adapters_dir))
        return done

    def _republish_lost_messages(self) -> int:
        """Publish again, oldest first, every job still queued a reconcile period after its
        message went out while this worker sat idle for that long: an idle worker takes a waiting
        message within moments, so the broker lost it (Redis restarted without persistence or
        flushed; or a worker died holding it unacknowledged, which Redis gives back only after the
        visibility timeout). A lost message is thus found within two reconcile periods; the first
        message that arrives then drains the whole queue (`WorkerRuntime._drain_queue`). A
        duplicate message is harmless: a message whose row is not `queued` is dropped."""
        rt = self.runtime
        idle_since = getattr(rt, "idle_since", None)
        if rt.celery is None or idle_since is None or rt.shutdown.is_set():
            return 0
        period = rt.settings.training.reconcile_interval_seconds
        if idle_since > store.utcnow() - timedelta(seconds=period):  # our own clock: a duration
            return 0  # busy until recently: a waiting message may still be on its way to us
        with rt.factory.begin() as s:
            cutoff = store.store_now(s) - timedelta(seconds=period)  # the clock that stamped them
            lost = [(j.id, j.published_at) for j in store.lost_message_jobs(s, older_than=cutoff)]
        count = 0
        for job_id, seen in lost:
            try:
                with rt.factory.begin() as s:
                    if not store.restamp_published(s, job_id, seen):
                        continue  # another reconciler published it, or the job left the queue
                    # Published inside the transaction: a failed publish keeps the old stamp.
                    publish_job(rt.celery, job_id, rt.settings.queue.queue_name)
                    store.append_event(
                        s,
                        job_id,
                        states.EVENT_REPUBLISHED,
                        f"still queued {period:g} s after its message went out while a worker sat "
                        "idle: the broker lost the message; published again",
                        level=states.LEVEL_WARNING,
                        data={"previously_published_at": seen.isoformat()},
                    )
            except Exception:
                log.exception("publishing the lost queue message of job %s again failed; will retry", job_id)
                continue
            log.warning("job %s: queue message lost by the broker; published again", job_id)
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
            outcome = self._settle_lost(lost)
            if outcome in ("resumed", "restarted"):
                requeued.append(lost.job_id)
                done["resumed"] += 1
            elif outcome == "completed":
                done["completed"] += 1
            elif outcome == "failed":
                failed += 1
        self._republish(requeued)  # our own transition: no api publish to race
        return failed

    def _settle_lost(self, lost: LostJob) -> str | None:
        """Complete, resume, restart or fail one job whose worker stopped renewing its lease;
        None when another actor moved it first."""
        rt = self.runtime
        published = self._published_adapter(lost)
        plan = None if published is not None else self._recovery_plan(lost)
        resume_step = _step_of(plan.resume) if plan is not None and plan.resume else None
        settled = settle_lost(lost, resume_step, rt.settings.training.max_attempts)
        retry = not lost.cancel_requested and settled.retry
        progress = {"progress": settled.record, "note": settled.note}
        # Its owner is presumed dead (lease expired, runner silent): the publications it was
        # staging will never be finished. Swept before the job can have a new owner.
        sweep_job_staging(rt.settings.adapters_dir, lost.identity.adapter_name)
        try:
            if published is not None:
                # Adopted under a new directory identity first: should the lost worker only have
                # stalled, it cannot take back (by inode) the adapter the job completes with.
                if not rehome(Path(published["adapter_path"])):
                    return None
                with rt.factory.begin() as s:
                    store.complete_lost_job(s, lost.job_id, **published)
                log.warning("job %s: worker lost after publishing its adapter; completed", lost.job_id)
                return "completed"
            adopted = self._adopt(lost, plan.adopt) if plan.adopt is not None else None
            with rt.factory.begin() as s:
                if adopted is not None:
                    _record_adopted(s, lost.job_id, adopted)
                if retry and plan.resume is not None:
                    store.requeue_for_resume(s, lost.job_id, plan.resume, **progress)
                    outcome = "resumed"
                elif retry:
                    store.requeue_for_restart(
                        s,
                        lost.job_id,
                        resume_checkpoint=lost.pinned_resume,
                        start_step=lost.pinned_start,
                        reason=f"worker lost before a usable checkpoint (attempt {lost.attempts})",
                        **progress,
                    )
                    outcome = "restarted"
                else:
                    note = settled.give_up if not lost.cancel_requested else ""
                    store.fail_worker_lost(s, lost.job_id, progress=settled.record, note=note)
                    outcome = "failed"
            log.warning("job %s: worker lost; %s (%s)", lost.job_id, outcome, plan.resume or "no checkpoint")
        except store.InvalidTransition:
            return None  # another reconciler (or the worker itself) moved it first
        except KilnError as exc:  # the adapter's name was registered meanwhile
            log.warning("job %s: cannot complete from its published adapter: %s", lost.job_id, exc)
            try:
                with rt.factory.begin() as s:
                    store.fail_worker_lost(s, lost.job_id)
            except store.InvalidTransition:
                return None
            return "failed"
        self._withdraw_unrecorded(lost.job_id, plan.withdraw)
        return outcome

    def _published_adapter(self, lost: LostJob) -> dict | None:
        """The job's adapter, when its worker published it (atomically, under the final name) and
        was lost before recording that: the receipt must name this run (adapter, seed, corpus)."""
        path = self.runtime.settings.adapters_dir / lost.identity.adapter_name
        model, receipt_file = path / ADAPTER_MODEL, path / TRAIN_RECEIPT
        if not (model.is_file() and receipt_file.is_file()):
            return None
        try:
            receipt = json.loads(receipt_file.read_text(encoding="utf-8"))
            if not lost.identity.wrote_adapter(receipt):
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

    def _recovery_plan(self, lost: LostJob) -> RecoveryPlan:
        """Where the job's next attempt starts: its newest checkpoint that validates on disk,
        recorded (its row matches) or not (a complete checkpoint of this run whose worker died
        between publishing and recording it: adopted, when every step up to it is recorded).
        Checkpoints of this run above that point (damaged, unrecorded) are withdrawn once the job
        moved on: the next attempt publishes those names again. Directories recorded by another
        job (a submission that resumed it) are never touched."""
        rt = self.runtime
        with rt.factory.begin() as s:
            recorded = {c.basename: c.manifest_sha256 for c in store.list_checkpoints(s, lost.job_id)}
        withdraw: list[Path] = []
        for basename in _checkpoint_dirs(rt.settings.adapters_dir, lost.identity.adapter_name):
            path = rt.settings.adapters_dir / basename
            mine = basename in recorded
            if not mine and not self._unclaimed_leftover(path, lost):
                continue
            if _step_of(basename) <= lost.pinned_start:
                break  # where this submission started: nothing below is the job's to recover
            try:
                loaded = ckpt.load_checkpoint(path, verify_hashes=True)
            except Exception as exc:
                log.warning("checkpoint %s of job %s is not resumable: %s", basename, lost.job_id, exc)
                withdraw.append(path)
                continue
            if mine and loaded.manifest_sha256 == _bare(recorded[basename]):
                return RecoveryPlan(resume=basename, withdraw=withdraw)
            if not mine and self._steps_recorded(lost.job_id, loaded.manifest.progress.global_step):
                return RecoveryPlan(resume=basename, withdraw=withdraw, adopt=loaded)
            log.warning("checkpoint %s of job %s is not the one recorded", basename, lost.job_id)
            withdraw.append(path)
        return RecoveryPlan(resume=None, withdraw=withdraw)

    def _unclaimed_leftover(self, path: Path, lost: LostJob) -> bool:
        """Written by this job's run and recorded by no job."""
        if not _written_by(path, lost.identity):
            return False
        with self.runtime.factory.begin() as s:
            return store.checkpoint_owner(s, path.name) is None

    def _steps_recorded(self, job_id: str, global_step: int) -> bool:
        with self.runtime.factory.begin() as s:
            return store.steps_recorded_through(s, job_id, global_step)

    def _adopt(self, lost: LostJob, loaded) -> dict | None:
        """Make an unrecorded checkpoint the job's own before recording it: a new directory
        identity (same bytes), so the lost worker, should it only have stalled, cannot take it
        back. The row (returned) is written with the requeue."""
        path = loaded.path
        if not rehome(path):
            return None
        return {
            "checkpoint_id": loaded.manifest.checkpoint_id,
            "basename": path.name,
            "path": str(path),
            "global_step": loaded.manifest.progress.global_step,
            "epoch_index": loaded.manifest.progress.epoch_index,
            "cursor": loaded.manifest.progress.cursor_in_epoch,
            "manifest_sha256": "sha256:" + loaded.manifest_sha256,
            "size_bytes": sum(r.size_bytes for r in loaded.files.values())
            + (path / ckpt.MANIFEST_FILENAME).stat().st_size,
        }

    def _withdraw_unrecorded(self, job_id: str, paths: list[Path]) -> None:
        with self.runtime.factory.begin() as s:
            recorded = {c.basename for c in store.list_checkpoints(s, job_id)}
        for path in paths:
            if path.name not in recorded:
                log.warning("job %s: withdrawing %s (published, never recorded)", job_id, path.name)
                withdraw(path)


@dataclass(frozen=True)
class RecoveryPlan:
    resume: str | None  # the checkpoint the next attempt starts from (None: from the start)
    withdraw: list[Path]  # this run's checkpoints above it, withdrawn once the job moved on
    adopt: object | None = None  # the LoadedCheckpoint to record first (published, never recorded)


@dataclass(frozen=True)
class LostJob:
    """What the reconciler needs of a job whose lease expired (plain values, no ORM objects)."""

    job_id: str
    attempts: int
    releases: int  # deliveries ended by a graceful release (not lost; not counted)
    cancel_requested: bool
    identity: RunIdentity
    pinned_resume: str | None = None  # the checkpoint the submission itself resumed, if any
    pinned_start: int = 0  # its step (where every attempt starts unless it resumes further on)
    start_step: int = 0  # where the lost attempt started
    reached_step: int = 0  # the furthest step it recorded
    history: tuple[dict, ...] = ()  # the progress records of the attempts lost before it
    released: bool = False  # its worker gave it back at a checkpoint (a graceful release)


def _lost_job(s, job) -> LostJob:
    admission = store.get_admission(s, job.id)
    pin = (admission.checkpoint_plan or {}).get("resume_from") if admission is not None else None
    pinned_start = int(pin.get("global_step") or 0) if pin else 0
    return LostJob(
        job_id=job.id,
        attempts=job.attempts,
        releases=store.count_graceful_releases(s, job.id),
        cancel_requested=job.cancel_requested,
        identity=RunIdentity(
            adapter_name=job.adapter_name,
            seed=job.effective_seed,
            corpus_sha256=admission.kept_corpus_sha256 if admission is not None else "",
            total_steps=job.total_steps,
        ),
        pinned_resume=pin.get("checkpoint") if pin else None,
        pinned_start=pinned_start,
        start_step=store.claim_start(s, job.id) or pinned_start,
        reached_step=int(job.global_step or 0),
        history=tuple(store.attempt_history(s, job.id)),
        released=store.released_since_claim(s, job.id),
    )


def _record_adopted(s, job_id: str, record: dict) -> None:
    if store.get_checkpoint(s, job_id, record["basename"]) is None:
        store.record_checkpoint(s, job_id, write_ms=None, adopted=True, **record)


def _bare(digest: str) -> str:
    return digest.removeprefix("sha256:")


def _step_of(basename: str) -> int:
    return int(basename.removesuffix(ckpt.CHECKPOINT_SUFFIX).rsplit("-", 1)[1])


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
    adapters_dir: Path, start_basename: str | None, recorded: set[str], identity: RunIdentity
) -> list[Path]:
    """The job's checkpoint directories above the step of `start_basename` (None: above step 0)
    that no row in `recorded` names and that this job's run wrote (same adapter, seed, data and
    length)."""
    names = _checkpoint_dirs(adapters_dir, identity.adapter_name)
    if start_basename is not None:
        if start_basename not in names:
            return []
        names = names[: names.index(start_basename)]  # highest step first
    return [
        adapters_dir / name
        for name in names
        if name not in recorded and _written_by(adapters_dir / name, identity)
    ]


def _written_by(path: Path, identity: RunIdentity) -> bool:
    """Whether a checkpoint directory was written by this job's run (same adapter, seed, data and
    length; adapter names are unique among live jobs)."""
    try:
        manifest, _ = ckpt.read_checkpoint_manifest(path)
    except Exception:
        return False
    return identity.wrote_checkpoint(manifest)


_STAGING = re.compile(r"\.(?P<name>.+)\.incomplete-[0-9a-f-]+", re.S)


def sweep_job_staging(directory: Path, adapter_name: str) -> list[str]:
    """Delete the publication staging directories of one adapter (its own and its checkpoints'):
    called once the job's owner is known to be gone, so nobody will finish them."""
    checkpoint = re.compile(
        rf"{re.escape(adapter_name)}-checkpoint-step-[0-9]{{8,}}{re.escape(ckpt.CHECKPOINT_SUFFIX)}"
    )
    swept = []
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = _STAGING.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        name = match.group("name")
        if name != adapter_name and not checkpoint.fullmatch(name):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not os.path.lexists(entry):
            log.warning("deleted %s: the staging of a publication whose worker was lost", entry.name)
            swept.append(entry.name)
    return swept


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
