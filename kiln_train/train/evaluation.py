"""Held-out validation: the loss and token accuracy of the validation rows under the current
adapter (docs/validation.md).

One evaluation runs every validation row through the model without a gradient
(`torch.no_grad()`, in the resident training dtype) and, on the run's loss route, counts for each
supervised next-token target its cross-entropy and whether the arg-max prediction is the target:

    loss           = Σ CE over all supervised targets of all rows / their number (token-weighted)
    token_accuracy = targets whose arg-max is the target / their number

On `kt_tape_flce` the scores are computed one block of rows and vocabulary columns at a time
(`chunked_validation_stats`, the forward of `loss.ChunkedLinearCrossEntropy` without the gradient
accumulator): per row the running max and sum of exponentials, the target's score, and the largest
score before and after the target's column, which decide whether the arg-max (the first index of
the maximum, as `torch.argmax`) is the target; the `[T, V]` logits never exist. On
`full_logits` the dense logits are used, as the route does for training.

An evaluation touches nothing a training step reads: no parameter, gradient, optimizer state or
data order, and it draws from no random stream (it has none to draw), so a run with validation
trains exactly the bits of the same run without it. `should_stop` is polled between rows: a
cancel never waits for a whole evaluation (`EvaluationStopped`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln_train.data.ingestion import TokenizedRow
from kiln_train.errors import TrainingFailure
from kiln_train.ground.backend import FULL_LOGITS, KT_TAPE_FLCE
from kiln_train.plan.formulas import validation_score_block
from kiln_train.train.loss import IGNORE_INDEX, LOSS_ROUTES

EVALUATION_FIELDS = ("global_step", "epoch", "loss", "token_accuracy")


class EvaluationStopped(Exception):
    """The run was asked to stop while an evaluation was in progress (it is not recorded)."""


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of the validation rows.

    `global_step` is the optimizer steps taken when it ran (0: the baseline, before the first
    update); `epoch` the epochs completed by then."""

    global_step: int
    epoch: int
    loss: float
    token_accuracy: float
    supervised_tokens: int
    rows: int

    def to_json(self) -> dict:
        """The record checkpoints and receipts keep (`EVALUATION_FIELDS`)."""
        return {name: getattr(self, name) for name in EVALUATION_FIELDS}


@dataclass(frozen=True)
class RowStats:
    """One row's sums: cross-entropy over its supervised targets, how many the arg-max got
    right, and how many there are."""

    ce_sum: float
    correct: int
    targets: int


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunked_validation_stats(
    active: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of `active @ weight^T` against `targets`, and whether the arg-max is
    the target, one `[block_rows, chunk]` score block at a time: `([A] CE in the accumulation
    dtype, [A] bool)`.

    Per row: the running maximum and the rescaled sum of exponentials (the log-sum-exp), the
    target's own score as the block computed it, and the largest score before and after the
    target's column. The arg-max (the first index of the maximum, as `torch.argmax`) is the target
    exactly when every earlier score is smaller and no later one larger, so no arg-max pass over
    the scores is needed. Rows are independent, so blocking them changes no value; the blocks are
    sized (`plan.formulas.validation_score_block`) to keep the element-wise passes in cache.
    """
    acc = _accumulation_dtype(active.dtype)
    rows = active.shape[0]
    block_rows = block_rows or rows
    ce_parts, hit_parts = [], []
    for first in range(0, rows, block_rows):
        h = active[first : first + block_rows].to(acc)
        wanted = targets[first : first + block_rows]
        n = h.shape[0]
        full = (n,)
        running_max = torch.full(full, float("-inf"), dtype=acc, device=active.device)
        running_sum = torch.zeros(full, dtype=acc, device=active.device)
        target_score = torch.zeros(full, dtype=acc, device=active.device)
        before = torch.full(full, float("-inf"), dtype=acc, device=active.device)
        after = torch.full(full, float("-inf"), dtype=acc, device=active.device)
        # One score buffer for the block's full-width chunks: a fresh block per chunk would be
        # mapped and faulted in again every time under the worker's allocator policy.
        buffer = torch.empty((n, chunk), dtype=acc, device=active.device)
        for start in range(0, weight.shape[0], chunk):
            w = weight[start : start + chunk].to(acc)
            if w.shape[0] == chunk:
                scores = torch.mm(h, w.t(), out=buffer)  # [n, chunk]
            else:
                scores = h @ w.t()
            width = scores.shape[1]
            block_max = scores.amax(1)
            before = torch.where(wanted >= start + width, torch.maximum(before, block_max), before)
            after = torch.where(wanted < start, torch.maximum(after, block_max), after)
            inside = ((wanted >= start) & (wanted < start + width)).nonzero().squeeze(1)
            if inside.numel():
                local = (wanted.index_select(0, inside) - start).unsqueeze(1)
                own = scores.index_select(0, inside)
                columns = torch.arange(width, device=active.device).unsqueeze(0)
                target_score[inside] = own.gather(1, local).squeeze(1)
                low = torch.where(columns < local, own, float("-inf")).amax(1)
                high = torch.where(columns > local, own, float("-inf")).amax(1)
                before[inside] = torch.maximum(before.index_select(0, inside), low)
                after[inside] = torch.maximum(after.index_select(0, inside), high)
            new_max = torch.maximum(running_max, block_max)
            rescale = torch.exp(running_max - new_max)
            scores.sub_(new_max.unsqueeze(1)).exp_()
            running_sum.mul_(rescale).add_(scores.sum(1))
            running_max = new_max
            del scores, w
        del buffer
        ce_parts.append(running_max + running_sum.log() - target_score)
        hit_parts.append((before < target_score) & (after <= target_score))
    return torch.cat(ce_parts), torch.cat(hit_parts)


def row_validation_stats(
    route: str, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor
) -> RowStats:
    """The sums of one row on `route`; `hidden` is `[T, D]` (or `[1, T, D]`), `labels` the `[T]`
    unshifted labels (position t predicts labels[t + 1])."""
    if route not in LOSS_ROUTES:
        raise TrainingFailure("unsupported_loss_config", f"no validation pass for SFT loss route {route!r}")
    if hidden.dim() == 3:
        hidden = hidden[0]
    flat = labels.reshape(-1)
    targets = flat[1:]
    positions = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    if positions.numel() == 0:
        raise TrainingFailure("zero_action_tokens", "a validation row has no supervised next-token target")
    wanted = targets.index_select(0, positions)
    weight = head_weight.detach()
    if route == KT_TAPE_FLCE:
        active = hidden.index_select(0, positions)
        block_rows, chunk = validation_score_block(weight.shape[0], positions.shape[0])
        ce, hit = chunked_validation_stats(active, weight, wanted, chunk, block_rows)
    else:
        assert route == FULL_LOGITS
        logits = hidden[:-1].index_select(0, positions) @ weight.t()
        acc = _accumulation_dtype(logits.dtype)
        ce = torch.nn.functional.cross_entropy(logits.to(acc), wanted, reduction="none")
        hit = logits.argmax(1) == wanted
    return RowStats(ce_sum=float(ce.sum()), correct=int(hit.sum()), targets=int(positions.numel()))


def evaluate(
    model,
    rows: Sequence[TokenizedRow],
    *,
    route: str,
    device: torch.device,
    global_step: int,
    epoch: int,
    should_stop: Callable[[], bool] | None = None,
) -> Evaluation:
    """One evaluation of `rows` under the model's current adapter (no gradient, the model's own
    dtype). Polls `should_stop` between rows and raises `EvaluationStopped` when it says so; a
    non-finite loss fails the run (`nan_loss`), as in training."""
    ce_total, correct, targets = 0.0, 0, 0
    with torch.no_grad():
        for row in rows:
            if should_stop is not None and should_stop():
                raise EvaluationStopped(f"stopped during the validation at global step {global_step}")
            ids = torch.tensor([row.input_ids], device=device)
            labels = torch.tensor(row.labels, device=device)
            hidden = model.hidden_states(ids)
            stats = row_validation_stats(route, hidden, model.lm_head_weight, labels)
            del hidden
            ce_total += stats.ce_sum
            correct += stats.correct
            targets += stats.targets
    loss = ce_total / targets
    if not math.isfinite(loss):
        raise TrainingFailure(
            "nan_loss", f"non-finite validation loss {loss} at global step {global_step} ({len(rows)} rows)"
        )
    return Evaluation(
        global_step=global_step,
        epoch=epoch,
        loss=loss,
        token_accuracy=correct / targets,
        supervised_tokens=targets,
        rows=len(rows),
    )


def best_evaluation(history: Sequence[dict]) -> dict | None:
    """The evaluation with the lowest loss (the earliest among equals), or None."""
    best = None
    for entry in history:
        if best is None or entry["loss"] < best["loss"]:
            best = entry
    return None if best is None else dict(best)
