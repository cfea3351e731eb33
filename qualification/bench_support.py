"""Set-up the bench scripts share, and that the trainer tests reuse: the tiny checkpoint a bench
measures on, the LoRA config it trains with, and one `train_sft` run on a resident's own route.

Importing this module loads torch and `kiln_train`; the bench drivers that keep torch out of
their orchestrating process import it inside the functions that train.
"""

from __future__ import annotations

from pathlib import Path

from kiln_train.data.ingestion import IngestionResult
from kiln_train.data.tokenizer import build_tokenizer
from kiln_train.model.tiny import write_tiny_checkpoint
from kiln_train.sft_config import SftConfig, parse_sft_config
from kiln_train.train.request import TrainRequest
from kiln_train.train.resident import ResidentModel
from kiln_train.train.result import TrainResult
from kiln_train.train.trainer import train_sft


def write_bench_checkpoint(directory: Path, preset: str = "small") -> Path:
    """A tiny checkpoint of `preset` with the full vocabulary, seeded so every bench run measures the same model."""
    return write_tiny_checkpoint(directory, preset, seed=0, tokenizer=build_tokenizer())


def lora_config(rank: int, *, optimizer: str = "adam_w", learning_rate: float = 1e-4, **fields) -> SftConfig:
    """One epoch of LoRA rank `rank` (alpha 2 * rank) with `optimizer`, resolved with seed 0."""
    body = {
        "epochs": 1,
        "lora_rank": rank,
        "lora_alpha": 2.0 * rank,
        "optimizer": {"kind": optimizer},
        "learning_rate": learning_rate,
    }
    return parse_sft_config({**body, **fields}).resolve(seed=0)


def train_on_resident(
    resident: ResidentModel, config: SftConfig, ingestion: IngestionResult, output_root: Path | str, **request
) -> TrainResult:
    """`train_sft` on the resident's own loss route; `request` holds the other `TrainRequest` fields."""
    request.setdefault("loss_route", resident.backend.sft_loss_route)
    return train_sft(
        TrainRequest(
            resident=resident, config=config, ingestion=ingestion, output_root=output_root, **request
        )
    )


def require_success(result: TrainResult) -> None:
    """Stop the bench when its run failed: a failed run's timings measure nothing."""
    if result.status != "success":
        raise RuntimeError(f"train_sft failed: {result.failure_reason}: {result.failure_message}")
