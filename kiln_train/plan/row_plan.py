"""The pinned gradient-checkpoint plan applied to a run: the default plan, the segments each row
gets from it, and the part of it a checkpoint records. Admission chose the plan (`segments.py`);
the trainer derives each row's segments from it here. Torch-free."""

from __future__ import annotations

from kiln_train.data.ingestion import IngestionResult
from kiln_train.ground.backend import Backend
from kiln_train.ground.layer_segments import segment_bounds
from kiln_train.model.config import Qwen35Config
from kiln_train.plan.memory import estimate
from kiln_train.plan.segments import row_segments
from kiln_train.sft_config import SftConfig


def default_checkpoint_plan(config: SftConfig) -> dict:
    return {"max_segments": config.grad_checkpoint_segments or 1, "auto": False, "budget_bytes": None}


def per_row_plan(
    cfg: Qwen35Config, backend: Backend, config: SftConfig, ingestion: IngestionResult, plan: dict, route: str
):
    """Segments for every kept row of the resident model `cfg` on `backend`, and the plan list
    whose digest the checkpoint binds."""

    def fits(seq_len: int, supervised: int, segments: int) -> bool:
        b = estimate(
            cfg,
            max_seq_len=seq_len,
            max_supervised_tokens=supervised,
            lora_rank=config.lora_rank,
            optimizer_kind=config.optimizer.kind,
            num_segments=segments,
            loss_route=route,
            backend=backend,
            weights_resident=True,
        )
        return b.fits(int(plan["budget_bytes"]))

    segments, entries = [], []
    for row in ingestion.rows:
        s = row_segments(plan, row.seq_len, row.supervised_tokens, fits)
        segments.append(s)
        entries.append(
            {
                "seq_len": row.seq_len,
                "enabled": s > 1,
                "num_segments": s,
                "auto_configured": bool(plan.get("auto", False)),
                "boundaries": [start for start, _ in segment_bounds(cfg.num_hidden_layers, s)],
            }
        )
    return segments, entries


def recorded_plan(plan: dict) -> dict:
    """The part of a pinned checkpoint plan the per-row plan is derived from (what a checkpoint
    records as `auxiliary_state.gradient_checkpoint_plan`)."""
    auto, budget = bool(plan.get("auto", False)), plan.get("budget_bytes")
    return {
        "max_segments": int(plan.get("max_segments", 1)),
        "auto": auto,
        # Only an auto plan's rows depend on the budget; a fixed plan records none, so resuming it
        # under another budget is the same plan.
        "budget_bytes": int(budget) if auto and budget is not None else None,
    }
