"""The loop's mutable progress (what `sft_loop_state.json` serialises) and the end of an epoch,
where the divergence guard (`guards.py`, docs/training-profile.md) is applied."""

from __future__ import annotations

from dataclasses import dataclass

from kiln_train import checkpoint as ckpt
from kiln_train.errors import TrainingFailure
from kiln_train.train.grad_norms import GradNormAccumulator
from kiln_train.train.guards import DIVERGENCE_MARGIN, DIVERGENCE_RATIO


@dataclass
class LoopProgress:
    """Mutable progress of the main phase (what `sft_loop_state.json` serialises)."""

    global_step: int = 0
    epoch_index: int = 0
    cursor: int = 0
    loss_history: list[float] | None = None
    epoch_loss_sum: float = 0.0
    epoch_items: int = 0
    first_epoch_loss: float | None = None
    best_epoch_loss: float | None = None

    def state(self, grads: GradNormAccumulator) -> ckpt.SftLoopState:
        history = list(self.loss_history or [])
        return ckpt.SftLoopState(
            global_step=self.global_step,
            epoch_index=self.epoch_index,
            cursor_in_epoch=self.cursor,
            loss_history=history,
            last_loss=history[-1] if history else None,
            current_epoch_loss_sum=self.epoch_loss_sum,
            current_epoch_items=self.epoch_items,
            first_epoch_loss=self.first_epoch_loss,
            best_epoch_loss=self.best_epoch_loss,
            lora_grad_norms=dict(grads.stats),
        )

    def end_epoch(self, rows: int) -> None:
        """Close the epoch just finished (its `rows` steps): the divergence guard, then the next epoch."""
        avg = self.epoch_loss_sum / rows
        if self.first_epoch_loss is None:
            self.first_epoch_loss = avg
        elif (
            avg > self.first_epoch_loss * DIVERGENCE_RATIO and avg - self.best_epoch_loss > DIVERGENCE_MARGIN
        ):
            raise TrainingFailure(
                "training_error",
                f"divergence guard: epoch {self.epoch_index + 1} mean loss {avg:.4f} exceeds "
                f"{DIVERGENCE_RATIO:g}x the first epoch's {self.first_epoch_loss:.4f} and the best epoch "
                f"{self.best_epoch_loss:.4f} by more than {DIVERGENCE_MARGIN:g}",
            )
        self.best_epoch_loss = avg if self.best_epoch_loss is None else min(self.best_epoch_loss, avg)
        self.epoch_index += 1
        self.cursor = 0
        self.epoch_loss_sum = 0.0
        self.epoch_items = 0
