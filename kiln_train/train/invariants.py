"""The trainer's own re-check, before any work, of what admission already enforced: the loss
route and scale rules of the config, and the admitted rows against their ingestion receipt."""

from __future__ import annotations

from kiln_train.data.ingestion import IngestionResult, kept_corpus_sha256
from kiln_train.errors import TrainingFailure
from kiln_train.ground.backend import FULL_LOGITS
from kiln_train.sft_config import MAX_LORA_ALPHA_OVER_RANK, SftConfig
from kiln_train.train.resident import ResidentModel


def check_config_for_training(
    config: SftConfig, loss_route: str, resident: ResidentModel, max_segments: int
) -> None:
    """The trainer's own re-check of the invariants admission already enforced."""
    if loss_route != resident.backend.sft_loss_route:
        raise TrainingFailure(
            "unsupported_loss_config",
            f"pinned SFT loss route {loss_route!r} differs from the resident backend's "
            f"{resident.backend.sft_loss_route!r}; the job is not run under another algorithm",
        )
    if loss_route == FULL_LOGITS and max_segments > 1:
        raise TrainingFailure(
            "unsupported_loss_config",
            f"loss route full_logits cannot run with {max_segments} gradient-checkpoint segments",
        )
    if config.lora_alpha / config.lora_rank > MAX_LORA_ALPHA_OVER_RANK and not config.allow_high_lora_scale:
        raise TrainingFailure(
            "unsafe_lora_scale",
            f"unsafe LoRA scaling: alpha/rank = {config.lora_alpha / config.lora_rank:g} exceeds "
            f"{MAX_LORA_ALPHA_OVER_RANK:g} without allow_high_lora_scale",
        )
    if config.train_mtp:
        raise TrainingFailure("unsupported_loss_config", "train_mtp is not supported by this trainer")
    if config.seed is None or config.learning_rate is None:
        raise TrainingFailure("training_error", "train_sft needs an effective config (SftConfig.resolve())")


def verify_rows(ingestion: IngestionResult) -> None:
    """Re-verify the admitted rows against their receipt before any training work."""
    receipt = ingestion.receipt
    hashes = [r.row_sha256 for r in ingestion.rows]
    if not ingestion.rows or len(hashes) != receipt["rows_kept"] or hashes != receipt["kept_row_hashes"]:
        raise TrainingFailure("data_schema_error", "the admitted rows do not match their ingestion receipt")
    if kept_corpus_sha256(hashes) != receipt["kept_corpus_sha256"]:
        raise TrainingFailure("data_schema_error", "the kept-corpus digest does not recompute")
    for row in ingestion.rows:
        if len(row.input_ids) != len(row.labels) or row.seq_len < 2 or row.supervised_tokens < 1:
            raise TrainingFailure(
                "zero_action_tokens", f"row {row.row_index} ({row.row_sha256}) has no supervised target"
            )
