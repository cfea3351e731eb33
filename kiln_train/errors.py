"""Contract error codes (kiln-contract §1.6) and the one exception type that carries them.

Every room raises `KilnError` (or a subclass) with a contract `code`; the api turns it into the
envelope `{"error": {"code", "message", "hint"}}` with the code's HTTP status.
"""

from __future__ import annotations

TRAINING_INVALID_REQUEST = "training_invalid_request"
TRAINING_BACKEND_UNSUPPORTED = "training_backend_unsupported"
TRAINING_WILL_NOT_FIT = "training_will_not_fit"
TRAINING_REQUEST_TOO_LARGE = "training_request_too_large"
TRAINING_QUEUE_FULL = "training_queue_full"
TRAINING_TRACKED_FULL = "training_tracked_full"
TRAINING_ADMISSION_BUSY = "training_admission_busy"
TRAINING_JOB_NOT_FOUND = "training_job_not_found"
TRAINING_JOB_NOT_CANCELLABLE = "training_job_not_cancellable"
TRAINING_JOB_ALREADY_STARTED = "training_job_already_started"
TRAINING_NO_RUNNER = "training_no_runner"
SERVER_SHUTTING_DOWN = "server_shutting_down"
INVALID_ADAPTER_NAME = "invalid_adapter_name"
ADAPTER_NOT_FOUND = "adapter_not_found"
ADAPTER_ALREADY_EXISTS = "adapter_already_exists"
ADAPTER_ACTIVE = "adapter_active"

# code -> (HTTP status, Retry-After seconds or None, message prefix, static hint)
ERROR_CATALOG: dict[str, tuple[int, int | None, str, str]] = {
    TRAINING_INVALID_REQUEST: (
        400,
        None,
        "Invalid training request: ",
        "Fix the named field or row and resubmit; nothing was queued.",
    ),
    TRAINING_BACKEND_UNSUPPORTED: (
        501,
        None,
        "Native training is unavailable on the selected backend: ",
        "Check GET /v1/config -> training.optimizer_support for what the resident runner supports.",
    ),
    TRAINING_WILL_NOT_FIT: (
        413,
        None,
        "",
        "Dynamic gradient checkpointing was already tried; shrink lora_rank, send fewer or shorter "
        "examples, or free device memory.",
    ),
    TRAINING_REQUEST_TOO_LARGE: (
        413,
        None,
        "",
        "Send the data as a server-local dataset_path under the storage root's datasets/ directory.",
    ),
    TRAINING_QUEUE_FULL: (503, 30, "", "The training queue is full; retry after the Retry-After delay."),
    TRAINING_TRACKED_FULL: (503, 30, "", "Too many tracked jobs; delete finished jobs or retry later."),
    TRAINING_ADMISSION_BUSY: (503, 1, "", "Another admission is in progress; retry shortly."),
    TRAINING_NO_RUNNER: (
        503,
        10,
        "",
        "Start a worker (`kiln worker`); submissions are admitted only against a live runner.",
    ),
    TRAINING_JOB_NOT_FOUND: (404, None, "", "List jobs with GET /v1/train/status."),
    TRAINING_JOB_NOT_CANCELLABLE: (409, None, "", "The job already finished; nothing to cancel."),
    TRAINING_JOB_ALREADY_STARTED: (
        409,
        None,
        "",
        "The job left the queue while the cancel was processed; cancel it again to stop it cooperatively.",
    ),
    SERVER_SHUTTING_DOWN: (503, 5, "", "The server is shutting down; retry against the new instance."),
    INVALID_ADAPTER_NAME: (400, None, "", "Adapter names are one path segment of [A-Za-z0-9._-]."),
    ADAPTER_NOT_FOUND: (404, None, "", "List adapters with GET /v1/adapters."),
    ADAPTER_ALREADY_EXISTS: (409, None, "", "Adapter names are never overwritten; pick a new output_name."),
    ADAPTER_ACTIVE: (409, None, "", "A running job is writing this adapter; wait for it to finish."),
}


class KilnError(Exception):
    """An error with a contract code; `message` already carries the code's prefix."""

    def __init__(self, code: str, detail: str, *, hint: str | None = None) -> None:
        status, retry_after, prefix, default_hint = ERROR_CATALOG.get(code, (500, None, "", ""))
        self.code = code
        self.status = status
        self.retry_after = retry_after
        self.detail = detail
        self.message = f"{prefix}{detail}" if prefix and not detail.startswith(prefix) else detail
        self.hint = hint if hint is not None else default_hint
        super().__init__(self.message)

    def envelope(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "hint": self.hint}}


def invalid_request(detail: str, *, hint: str | None = None) -> KilnError:
    return KilnError(TRAINING_INVALID_REQUEST, detail, hint=hint)


def backend_unsupported(detail: str, *, hint: str | None = None) -> KilnError:
    return KilnError(TRAINING_BACKEND_UNSUPPORTED, detail, hint=hint)


class OwnershipLost(Exception):
    """This run no longer owns its job (a later claim of it holds the job): stop, record nothing."""


class TrainingFailure(Exception):
    """A run failed after admission; `reason` is a receipt failure category (kiln-contract §4.1)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


FAILURE_REASONS = (
    "data_schema_error",
    "adapter_load_failed",
    "zero_groups",
    "zero_action_tokens",
    "zero_env_tokens",
    "cancelled",
    "unsupported_loss_config",
    "nan_loss",
    "oom",
    "shape_mismatch",
    "unsafe_lora_scale",
    "base_adapter_missing",
    "training_error",
    # beyond the original: the service's own terminal reasons
    "worker_lost",
    "plan_drift",
)
