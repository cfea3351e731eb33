"""Job and runner states, service failure reasons and event kinds (docs/ARCHITECTURE.md#job-states,
docs/errors.md#failure-reasons).

Defined once here; the models' CHECK constraints, the migrations and every caller use these
names. The contract has no `cancelled` state: a cancelled job ends `failed` with
`failure_reason = "cancelled"`.
"""

from __future__ import annotations

# `TrainingState` (docs/ARCHITECTURE.md#job-states)
QUEUED = "queued"
RUNNING = "running"
COMPLETED = "completed"
FAILED = "failed"
JOB_STATES = (QUEUED, RUNNING, COMPLETED, FAILED)
TERMINAL_STATES = (COMPLETED, FAILED)

JOB_TYPE_SFT = "sft"

# Failure reasons the service itself assigns; the trainer's receipt categories
# (kiln_train.errors.FAILURE_REASONS, docs/errors.md#failure-reasons) are stored verbatim beside them.
REASON_CANCELLED = "cancelled"
REASON_WORKER_LOST = "worker_lost"
REASON_PLAN_DRIFT = "plan_drift"
SERVICE_FAILURE_REASONS = (REASON_CANCELLED, REASON_WORKER_LOST, REASON_PLAN_DRIFT)

# Runner lifecycle (the `runners` table).
RUNNER_STARTING = "starting"
RUNNER_READY = "ready"
RUNNER_BUSY = "busy"
RUNNER_STOPPED = "stopped"
RUNNER_STATES = (RUNNER_STARTING, RUNNER_READY, RUNNER_BUSY, RUNNER_STOPPED)
RUNNER_LIVE_STATES = (RUNNER_READY, RUNNER_BUSY)

# job_events.kind
EVENT_QUEUED = "queued"
EVENT_STARTED = "started"
EVENT_PLAN_VERIFIED = "plan_verified"
EVENT_STEP = "step"
EVENT_EPOCH_COMPLETE = "epoch_complete"
EVENT_CHECKPOINT_SAVED = "checkpoint_saved"
EVENT_VALIDATION_EVALUATED = "validation_evaluated"
EVENT_COMPLETED = "completed"
EVENT_FAILED = "failed"
EVENT_CANCEL_REQUESTED = "cancel_requested"
EVENT_CANCELLED = "cancelled"
EVENT_REQUEUED = "requeued"
EVENT_WORKER_LOST = "worker_lost"
EVENT_REPUBLISHED = "republished"
EVENT_DELETED = "deleted"

# job_events.level
LEVEL_DEBUG = "debug"
LEVEL_INFO = "info"
LEVEL_WARNING = "warning"
LEVEL_ERROR = "error"
EVENT_LEVELS = (LEVEL_DEBUG, LEVEL_INFO, LEVEL_WARNING, LEVEL_ERROR)

# prepared_sft_admissions.data_source
SOURCE_EXAMPLES = "examples"
SOURCE_DATASET_PATH = "dataset_path"
DATA_SOURCES = (SOURCE_EXAMPLES, SOURCE_DATASET_PATH)
