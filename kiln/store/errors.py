"""The job store's own exceptions (contract errors are `kiln_train.errors.KilnError`).

The store raises `KilnError` where the contract names the outcome (docs/errors.md#codes: job not
found, not cancellable, already started, adapter not found) so the api can answer with the
envelope as is; it raises the classes below for the service's internal rules.
"""

from __future__ import annotations

from sqlalchemy import exc as sa_exc

from kiln_train.errors import OwnershipLost

# The database cannot be reached right now (connection refused or dropped): worth retrying.
STORE_UNREACHABLE = (sa_exc.OperationalError, sa_exc.InterfaceError)

# Contract codes the store raises as `KilnError` (api.errors maps them to HTTP statuses).
TRAINING_JOB_NOT_FOUND = "training_job_not_found"
TRAINING_JOB_NOT_CANCELLABLE = "training_job_not_cancellable"
TRAINING_JOB_ALREADY_STARTED = "training_job_already_started"
ADAPTER_NOT_FOUND = "adapter_not_found"


class StoreError(Exception):
    """Base class of the job store's internal errors."""


class InvalidTransition(StoreError):
    """A state change that the job's current state does not allow (e.g. completing a queued job)."""

    def __init__(self, job_id: str, wanted: str, state: str | None) -> None:
        self.job_id = job_id
        self.wanted = wanted
        self.state = state
        super().__init__(f"job {job_id}: cannot {wanted} from state {state!r}")


class LeaseLost(StoreError, OwnershipLost):
    """The worker no longer owns the running job (its lease was taken back by the reconciler, or
    a later claim holds it): the run stops and records nothing."""

    def __init__(self, job_id: str, worker_id: str) -> None:
        self.job_id = job_id
        self.worker_id = worker_id
        super().__init__(f"job {job_id} is no longer running under worker {worker_id}")


class IdempotencyKeyTaken(StoreError):
    """Another job already holds this Idempotency-Key (look it up with find_by_idempotency_key)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"idempotency key {key!r} already names a job")


class DatabaseUnavailable(sa_exc.OperationalError):
    """The job database did not answer within the time `wait_for_database` was given.

    An OperationalError like the connection failure it ends, so whatever reports those (the CLI's
    one-line database errors) reports this one too; its message adds how long it waited."""

    def __init__(self, reason: str, waited_s: float, attempts: int) -> None:
        self.reason = reason
        self.waited_s = waited_s
        self.attempts = attempts
        tries = f"{attempts} attempt{'' if attempts == 1 else 's'}"
        message = f"{reason} (no answer after waiting {waited_s:.0f} s, {tries})"
        super().__init__(None, None, ConnectionError(message))
