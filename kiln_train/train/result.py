"""What a run reports: one `StepReport` per optimizer step and the `TrainResult` at the end, and
how an exception inside the run becomes a receipt failure reason."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kiln_train.errors import TrainingFailure


@dataclass(frozen=True)
class StepReport:
    global_step: int
    total_steps: int
    epoch: int
    cursor: int
    loss: float
    step_ms: float
    tokens: int
    supervised_tokens: int
    learning_rate: float
    item: int | None = None  # position of the row among the kept rows (what the epoch order permutes)
    row_index: int | None = None  # the row's source number (1-based, as ingestion counts rows)


@dataclass
class TrainResult:
    status: str  # "success" | "failed"
    adapter_name: str
    adapter_path: Path | None
    receipt: dict
    receipt_path: Path
    global_step: int
    total_steps: int
    final_loss: float | None
    failure_reason: str | None = None
    failure_message: str | None = None
    checkpoints: list[dict] = field(default_factory=list)
    peak_memory_bytes: int | None = None
    wall_clock_ms: int = 0
    loss_history: list[float] = field(default_factory=list)
    validation_history: list[dict] = field(default_factory=list)  # every evaluation, resumed ones too

    def to_dict(self) -> dict:
        """The result as JSON values (paths as strings), e.g. for `kiln train local --json`."""
        out = asdict(self)
        for key in ("adapter_path", "receipt_path"):
            out[key] = None if out[key] is None else str(out[key])
        return out


def classify_exception(exc: BaseException) -> tuple[str, str]:
    """Map an exception raised inside the loop to a receipt failure category."""
    if isinstance(exc, TrainingFailure):
        return exc.reason, exc.message
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return "oom", text
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom", text
    return "training_error", text
