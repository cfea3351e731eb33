"""`CheckpointError`: every rejection of a `.kiln-checkpoint` (docs/checkpoints.md#loading).

It is a `KilnError` with code `training_invalid_request`, so the api surfaces a bad
`resume_checkpoint` as a 400 whose message names the checkpoint field or file at fault.
"""

from __future__ import annotations

from kiln_train.errors import TRAINING_INVALID_REQUEST, KilnError

_HINT = (
    "Exact checkpoints are immutable: resume only from an intact .kiln-checkpoint directory with an "
    "identical configuration, data, base model and runtime."
)


class CheckpointError(KilnError):
    """A checkpoint that cannot be written, loaded or resumed; the message names the field."""

    def __init__(self, detail: str, *, hint: str | None = None) -> None:
        super().__init__(TRAINING_INVALID_REQUEST, detail, hint=hint if hint is not None else _HINT)
