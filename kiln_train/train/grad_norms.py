"""Per-target-module statistics of the LoRA gradient norms (the receipt's `lora_grad_norms`)."""

from __future__ import annotations

import torch

from kiln_train.checkpoint import GradNormStats
from kiln_train.model.config import LORA_TARGET_MODULES


class GradNormAccumulator:
    """Per-target-module statistics of ‖(∇A, ∇B)‖ over every step and projection."""

    def __init__(self, state: dict[str, GradNormStats] | None = None) -> None:
        self.stats: dict[str, GradNormStats] = dict(state or {})

    def add(self, named_grads: dict[str, torch.Tensor]) -> None:
        pair_sq: dict[str, torch.Tensor] = {}
        for name, g in named_grads.items():
            base = name.rsplit(".lora_", 1)[0]
            sq = g.double().pow(2).sum()
            pair_sq[base] = pair_sq[base] + sq if base in pair_sq else sq
        norms = torch.stack(list(pair_sq.values())).sqrt().tolist()
        for base, norm in zip(pair_sq, norms, strict=True):
            target = base.rsplit(".", 1)[1]
            prev = self.stats.get(target)
            self.stats[target] = GradNormStats.first(norm) if prev is None else prev.add(norm)

    def receipt_rows(self) -> list[dict]:
        rows = []
        for target in LORA_TARGET_MODULES:
            s = self.stats.get(target)
            if s is not None:
                rows.append(
                    {
                        "module": target,
                        "sample_count": s.sample_count,
                        "min": s.min,
                        "mean": s.mean,
                        "max": s.max,
                    }
                )
        return rows
