"""Resident runners: a worker's identity and heartbeat in `runners` (docs/ARCHITECTURE.md#processes).

The worker registers what it holds resident (backend, device, dtypes, loss route, optimizer
support, execution identity, free memory) and refreshes a heartbeat; the api admits against
the live runner and answers 503 with Retry-After when there is none.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kiln.store import states
from kiln.store.models import Runner, store_now

_UNCHANGED: Any = object()


def register_runner(
    session: Session,
    runner_id: str,
    *,
    hostname: str,
    pid: int,
    backend: str,
    device: str,
    base_weight_dtype: str,
    lora_dtype: str,
    loss_route: str,
    optimizer_support: dict[str, Any],
    execution_identity_digest: str,
    model_path: str,
    model_config: dict[str, Any],
    free_memory_bytes: int | None = None,
    total_memory_bytes: int | None = None,
    state: str = states.RUNNER_READY,
) -> Runner:
    """Insert or replace the runner row for worker `runner_id`, with a fresh start and heartbeat."""
    if state not in states.RUNNER_STATES:
        raise ValueError(f"runner state must be one of {states.RUNNER_STATES}, got {state!r}")
    now = store_now(session)
    runner = session.get(Runner, runner_id, populate_existing=True) or Runner(id=runner_id)
    runner.hostname = hostname
    runner.pid = pid
    runner.backend = backend
    runner.device = device
    runner.base_weight_dtype = base_weight_dtype
    runner.lora_dtype = lora_dtype
    runner.loss_route = loss_route
    runner.optimizer_support = optimizer_support
    runner.execution_identity_digest = execution_identity_digest
    runner.model_path = model_path
    runner.model_config = model_config
    runner.free_memory_bytes = free_memory_bytes
    runner.total_memory_bytes = total_memory_bytes
    runner.started_at = now
    runner.heartbeat_at = now
    runner.state = state
    runner.current_job_id = None
    session.add(runner)
    session.flush()
    return runner


def heartbeat_runner(
    session: Session,
    runner_id: str,
    *,
    free_memory_bytes: int | None = _UNCHANGED,
    state: str = _UNCHANGED,
    current_job_id: str | None = _UNCHANGED,
) -> bool:
    """Refresh a runner's heartbeat (and whatever else is given); False when it is unknown or
    stopped. Pass `current_job_id=None` to clear the job it runs."""
    values: dict[str, Any] = {"heartbeat_at": store_now(session)}
    if free_memory_bytes is not _UNCHANGED:
        values["free_memory_bytes"] = free_memory_bytes
    if state is not _UNCHANGED:
        if state not in states.RUNNER_STATES:
            raise ValueError(f"runner state must be one of {states.RUNNER_STATES}, got {state!r}")
        values["state"] = state
    if current_job_id is not _UNCHANGED:
        values["current_job_id"] = current_job_id
    result = session.execute(
        update(Runner)
        .where(Runner.id == runner_id, Runner.state != states.RUNNER_STOPPED)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def live_runner(session: Session, stale_after_seconds: float, now: datetime | None = None) -> Runner | None:
    """The ready or busy runner with the most recent heartbeat, if it beat within
    `stale_after_seconds`; None means nobody can take jobs (503 with Retry-After)."""
    cutoff = (now or store_now(session)) - timedelta(seconds=stale_after_seconds)
    query = (
        select(Runner)
        .where(Runner.state.in_(states.RUNNER_LIVE_STATES), Runner.heartbeat_at >= cutoff)
        .order_by(Runner.heartbeat_at.desc(), Runner.id)
        .limit(1)
    )
    return session.scalars(query.execution_options(populate_existing=True)).first()


def get_runner(session: Session, runner_id: str) -> Runner | None:
    """A runner row by worker id, as stored now."""
    return session.get(Runner, runner_id, populate_existing=True)


def stop_runner(session: Session, runner_id: str) -> bool:
    """Mark a runner stopped (clean worker shutdown); False when it is unknown."""
    result = session.execute(
        update(Runner)
        .where(Runner.id == runner_id)
        .values(state=states.RUNNER_STOPPED, current_job_id=None, heartbeat_at=store_now(session))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1
