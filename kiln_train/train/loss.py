"""The two SFT loss routes (docs/training-profile.md#loss-route).

Both compute the contract loss: the mean next-token cross-entropy over the supervised targets of one
conversation. `labels` follow the Hugging Face representation (docs/training-profile.md#loss;
unshifted: `labels[t]` is `input_ids[t]` on assistant tokens, -100 elsewhere), so position `t`
predicts `labels[t + 1]`.

- `kt_tape_flce` (every resident backend): gathers the final hidden states of the positions whose
  next token is supervised (`A` rows), then runs a chunked linear cross-entropy over the vocabulary
  as one `torch.autograd.Function`. A single pass per vocabulary chunk keeps an online
  log-sum-exp and, when a gradient is needed, the unnormalised softmax-weighted sum of head rows,
  so the hidden-state gradient is finished in the forward pass and backward only scales it. At
  most `[A, chunk]` scores exist at a time; the `[T, V]` logits never do. Accumulation is f32
  (f64 for f64 inputs); bf16 inputs are upcast one chunk at a time.
- `full_logits` (the portable reference): dense `hidden @ W^T` logits and `F.cross_entropy` with
  `ignore_index=-100` after the causal shift. Only constructed explicitly (tests, qualification).

The head is a frozen constant on both routes (docs/training-profile.md#frozen-base): it is
detached before use, so no weight gradient is computed or stored, and a head passed with
`requires_grad=True` still ends with `.grad is None`.

The route is a backend capability: callers pass the resident backend's `sft_loss_route`; nothing
here reads a request field, a setting or the environment.

A row with no supervised target raises `TrainingFailure("zero_action_tokens", ...)`: admission
already rejects such rows, so meeting one in the trainer is a run failure, never a silent zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kiln_train.errors import TrainingFailure, invalid_request
from kiln_train.ground.backend import FULL_LOGITS, KT_TAPE_FLCE
from kiln_train.plan.formulas import vocab_chunk_size

IGNORE_INDEX = -100
LOSS_ROUTES = (KT_TAPE_FLCE, FULL_LOGITS)


def count_supervised_targets(labels: torch.Tensor | Sequence[int]) -> int:
    """Number of next-token targets: positions `t >= 1` whose label is not -100.

    `labels[0]` is never a target (no position predicts the first token).
    """
    if isinstance(labels, torch.Tensor):
        flat = labels.reshape(-1)
        return int((flat[1:] != IGNORE_INDEX).sum().item()) if flat.numel() > 1 else 0
    return sum(1 for x in list(labels)[1:] if x != IGNORE_INDEX)


def sft_loss(
    route: str, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """The scalar SFT loss of one conversation on `route` (`kt_tape_flce` or `full_logits`).

    `hidden` is the final (post-norm) hidden state, `[T, D]` or `[1, T, D]`; `head_weight` the
    `[V, D]` LM head (tied embedding); `labels` the `[T]` (or `[1, T]`) unshifted labels.
    """
    hidden2d, flat_labels = _check_inputs(hidden, head_weight, labels)
    if route == KT_TAPE_FLCE:
        return _kt_tape_flce(hidden2d, head_weight, flat_labels)
    if route == FULL_LOGITS:
        return _full_logits(hidden2d, head_weight, flat_labels)
    raise invalid_request(f"unknown SFT loss route {route!r}; this trainer implements {list(LOSS_ROUTES)}")


def _check_inputs(
    hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if hidden.dim() == 3:
        if hidden.shape[0] != 1:
            raise TrainingFailure(
                "shape_mismatch", f"one conversation per step: hidden batch is {hidden.shape[0]}"
            )
        hidden = hidden[0]
    if hidden.dim() != 2:
        raise TrainingFailure(
            "shape_mismatch", f"hidden must be [T, D] or [1, T, D], got {tuple(hidden.shape)}"
        )
    flat = labels.reshape(-1)
    if flat.shape[0] != hidden.shape[0]:
        raise TrainingFailure(
            "shape_mismatch", f"labels have {flat.shape[0]} positions but hidden has {hidden.shape[0]}"
        )
    if head_weight.dim() != 2 or head_weight.shape[1] != hidden.shape[1]:
        raise TrainingFailure(
            "shape_mismatch",
            f"head weight {tuple(head_weight.shape)} does not match hidden width {hidden.shape[1]}",
        )
    if count_supervised_targets(flat) == 0:
        raise TrainingFailure(
            "zero_action_tokens", "the conversation has no supervised next-token target (all labels are -100)"
        )
    targets = flat[1:]
    supervised = targets[targets != IGNORE_INDEX]
    vocab = head_weight.shape[0]
    if bool(((supervised < 0) | (supervised >= vocab)).any()):
        bad = int(supervised[(supervised < 0) | (supervised >= vocab)][0])
        raise TrainingFailure("data_schema_error", f"label {bad} is outside the vocabulary [0, {vocab})")
    return hidden, flat


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----- kt_tape_flce ---------------------------------------------------------------------------


def _kt_tape_flce(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    targets = labels[1:]
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # positions t whose labels[t+1] is supervised
    active = hidden.index_select(0, rows)  # [A, D]; its backward scatters into the full [T, D] gradient
    chunk = vocab_chunk_size(head_weight.shape[0], rows.shape[0])
    return ChunkedLinearCrossEntropy.apply(
        active, head_weight.detach(), targets.index_select(0, rows), chunk, active.requires_grad
    )


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean CE of `active @ weight^T` against `targets`, one vocabulary chunk at a time.

    Forward keeps, per row, the running max `m`, the running sum `s = Σ exp(z - m)` and (when a
    gradient is wanted) `g = Σ exp(z - m) · w_v`, rescaled by `exp(m_old - m_new)` whenever the
    max grows. Then `lse = m + log s`, `loss = mean(lse - z_target)` and the hidden gradient
    `(g / s - w_target) / A` is complete. Backward returns only that gradient times the upstream
    scalar: the weight is a saved constant with no gradient.
    """

    @staticmethod
    def forward(ctx, active, weight, targets, chunk, need_grad):  # noqa: D401 - autograd API
        acc = _accumulation_dtype(active.dtype)
        rows = active.shape[0]
        h = active.to(acc)
        w_target = weight.index_select(0, targets).to(acc)
        target_logit = (h * w_target).sum(1)
        running_max = torch.full((rows,), float("-inf"), dtype=acc, device=active.device)
        running_sum = torch.zeros(rows, dtype=acc, device=active.device)
        grad_sum = torch.zeros_like(h) if need_grad else None
        for start in range(0, weight.shape[0], chunk):
            w = weight[start : start + chunk].to(acc)  # a copy only for low-precision heads
            scores = h @ w.t()  # [A, chunk]
            new_max = torch.maximum(running_max, scores.amax(1))
            rescale = torch.exp(running_max - new_max)
            scores.sub_(new_max.unsqueeze(1)).exp_()
            running_sum.mul_(rescale).add_(scores.sum(1))
            if grad_sum is not None:
                grad_sum.mul_(rescale.unsqueeze(1)).addmm_(scores, w)
            running_max = new_max
            del scores, w
        lse = running_max + running_sum.log()
        loss = (lse - target_logit).sum() / rows
        if grad_sum is not None:
            grad_sum.div_(running_sum.unsqueeze(1)).sub_(w_target).div_(rows)
            ctx.save_for_backward(grad_sum)
        ctx.input_dtype = active.dtype
        return loss.to(acc)

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_active,) = ctx.saved_tensors
        return (grad_active * grad_loss).to(ctx.input_dtype), None, None, None, None


# ----- full_logits ---------------------------------------------------------------------------


def _full_logits(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = hidden @ head_weight.detach().t()  # [T, V] in the model dtype
    acc = _accumulation_dtype(logits.dtype)
    return F.cross_entropy(logits[:-1].to(acc), labels[1:], ignore_index=IGNORE_INDEX, reduction="mean")
