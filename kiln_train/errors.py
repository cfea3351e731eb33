"""Contract error codes (docs/errors.md#codes) and the one exception type that carries them.

Every part of the library raises `KilnError` (or a subclass) with a contract `code`, a message
and a hint; the api turns it into the envelope `{"error": {"code", "message", "hint"}}` and
chooses the HTTP status for the code (`api.errors`). No HTTP concern lives here.
"""

from __future__ import annotations

TRAINING_INVALID_REQUEST = "training_invalid_request"
TRAINING_BACKEND_UNSUPPORTED = "training_backend_unsupported"
TRAINING_WILL_NOT_FIT = "training_will_not_fit"
INVALID_ADAPTER_NAME = "invalid_adapter_name"
ADAPTER_ALREADY_EXISTS = "adapter_already_exists"

# code -> (message prefix, static hint) of the codes the library raises.
ERROR_TEXT: dict[str, tuple[str, str]] = {
    TRAINING_INVALID_REQUEST: (
        "Invalid training request: ",
        "Fix the named field or row and resubmit; nothing was queued.",
    ),
    TRAINING_BACKEND_UNSUPPORTED: (
        "Native training is unavailable on the selected backend: ",
        "Check GET /v1/config -> training.optimizer_support for what the resident runner supports.",
    ),
    TRAINING_WILL_NOT_FIT: (
        "",
        "Dynamic gradient checkpointing was already tried; shrink lora_rank, send fewer or shorter "
        "examples, or free device memory.",
    ),
    INVALID_ADAPTER_NAME: ("", "Adapter names are one path segment of [A-Za-z0-9._-]."),
    ADAPTER_ALREADY_EXISTS: ("", "Adapter names are never overwritten; pick a new output_name."),
}


class KilnError(Exception):
    """An error with a contract code; `message` already carries the code's prefix.

    `hint` is the caller's, else the code's static hint; None for a code the library does not
    know (a service code), whose hint the service supplies when it answers.
    """

    def __init__(self, code: str, detail: str, *, hint: str | None = None) -> None:
        prefix, default_hint = ERROR_TEXT.get(code, ("", None))
        self.code = code
        self.detail = detail
        self.message = f"{prefix}{detail}" if prefix and not detail.startswith(prefix) else detail
        self.hint = hint if hint is not None else default_hint
        super().__init__(self.message)

    def envelope(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "hint": self.hint or ""}}


def invalid_request(detail: str, *, hint: str | None = None) -> KilnError:
    return KilnError(TRAINING_INVALID_REQUEST, detail, hint=hint)


def backend_unsupported(detail: str, *, hint: str | None = None) -> KilnError:
    return KilnError(TRAINING_BACKEND_UNSUPPORTED, detail, hint=hint)


class OwnershipLost(Exception):
    """This run no longer owns its job (a later claim of it holds the job): stop, record nothing."""


class TrainingFailure(Exception):
    """A run failed after admission; `reason` is a receipt failure category.

    docs/errors.md#failure-reasons.
    """

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


FAILURE_REASONS = (
    "data_schema_error",
    "adapter_load_failed",
    "zero_action_tokens",
    "cancelled",
    "unsupported_loss_config",
    "nan_loss",
    "oom",
    "shape_mismatch",
    "unsafe_lora_scale",
    "base_adapter_missing",
    "training_error",
    # beyond the Rust implementation's reasons: the service's own terminal reasons
    "worker_lost",
    "plan_drift",
)
