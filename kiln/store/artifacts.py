"""Published artifacts of jobs: exact checkpoints (docs/checkpoints.md), adapters
(docs/artifacts.md#peft-adapter), loss curve.

Rows are written after the files were published (staging dir + rename,
docs/ARCHITECTURE.md#storage-root), so a row always names a complete artifact on disk.
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kiln.store import states
from kiln.store.errors import ADAPTER_NOT_FOUND
from kiln.store.events import append_event
from kiln.store.models import Adapter, Checkpoint, Job, TrainingStep, store_now
from kiln_train.errors import ADAPTER_ALREADY_EXISTS, KilnError


def record_checkpoint(
    session: Session,
    job_id: str,
    *,
    checkpoint_id: str,
    basename: str,
    path: str,
    global_step: int,
    epoch_index: int,
    cursor: int,
    manifest_sha256: str,
    size_bytes: int,
    write_ms: float | None,
    adopted: bool = False,
) -> Checkpoint:
    """Record a published checkpoint, make it the job's latest, and log `checkpoint_saved`.
    `adopted`: a lost worker published it and did not live to record it (`write_ms` is None)."""
    checkpoint = Checkpoint(
        job_id=job_id,
        checkpoint_id=checkpoint_id,
        basename=basename,
        path=path,
        global_step=global_step,
        epoch_index=epoch_index,
        cursor=cursor,
        manifest_sha256=manifest_sha256,
        size_bytes=size_bytes,
        write_ms=write_ms,
        created_at=store_now(session),
    )
    session.add(checkpoint)
    session.flush()
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(latest_checkpoint=basename)
        .execution_options(synchronize_session=False)
    )
    append_event(
        session,
        job_id,
        states.EVENT_CHECKPOINT_SAVED,
        f"checkpoint {basename} at step {global_step}"
        + (" adopted (published by a lost worker that did not record it)" if adopted else ""),
        data={
            "checkpoint": basename,
            "global_step": global_step,
            "size_bytes": size_bytes,
            "write_ms": write_ms,
            "adopted": adopted,
        },
    )
    return checkpoint


def checkpoint_owner(session: Session, basename: str) -> str | None:
    """The job that recorded the checkpoint directory `basename`, or None (nobody did)."""
    return session.scalar(select(Checkpoint.job_id).where(Checkpoint.basename == basename))


def list_checkpoints(session: Session, job_id: str) -> list[Checkpoint]:
    """A job's checkpoints, oldest step first."""
    query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.global_step)
    return list(session.scalars(query))


def latest_checkpoint(session: Session, job_id: str) -> Checkpoint | None:
    """The job's checkpoint with the highest global step (what a resume starts from)."""
    query = (
        select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.global_step.desc()).limit(1)
    )
    return session.scalars(query).first()


def get_checkpoint(session: Session, job_id: str, basename: str) -> Checkpoint | None:
    """One of the job's checkpoints by its directory basename."""
    query = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.basename == basename)
    return session.scalars(query).one_or_none()


def loss_history(session: Session, job_id: str) -> list[TrainingStep]:
    """The job's loss curve: one row per optimizer step, in step order."""
    query = select(TrainingStep).where(TrainingStep.job_id == job_id).order_by(TrainingStep.global_step)
    return list(session.scalars(query))


def register_adapter(
    session: Session,
    *,
    name: str,
    job_id: str | None,
    path: str,
    size_bytes: int,
    safetensors_sha256: str,
    rank: int,
    alpha: float,
    base_model_sha256: str | None = None,
) -> Adapter:
    """Record a published adapter. A live adapter's name is never reused (KilnError
    `adapter_already_exists`); a deleted one's row is taken over by the new adapter."""
    existing = session.get(Adapter, name, populate_existing=True)
    if existing is not None and existing.deleted_at is None:
        raise KilnError(ADAPTER_ALREADY_EXISTS, f"adapter {name!r} already exists")
    adapter = existing or Adapter(name=name)
    adapter.job_id = job_id
    adapter.path = path
    adapter.size_bytes = size_bytes
    adapter.safetensors_sha256 = safetensors_sha256
    adapter.rank = rank
    adapter.alpha = alpha
    adapter.base_model_sha256 = base_model_sha256
    adapter.created_at = store_now(session)
    adapter.deleted_at = None
    session.add(adapter)
    session.flush()
    return adapter


def get_adapter(session: Session, name: str) -> Adapter | None:
    """A live (not deleted) adapter by name."""
    adapter = session.get(Adapter, name, populate_existing=True)
    return adapter if adapter is not None and adapter.deleted_at is None else None


def list_adapters(session: Session) -> list[Adapter]:
    """Live adapters, newest first."""
    query = (
        select(Adapter).where(Adapter.deleted_at.is_(None)).order_by(Adapter.created_at.desc(), Adapter.name)
    )
    return list(session.scalars(query))


def delete_adapter(session: Session, name: str) -> Adapter:
    """Soft-delete an adapter row (the caller removes the files); KilnError `adapter_not_found`."""
    adapter = get_adapter(session, name)
    if adapter is None:
        raise KilnError(ADAPTER_NOT_FOUND, f"no adapter named {name!r}")
    adapter.deleted_at = store_now(session)
    session.flush()
    return adapter
