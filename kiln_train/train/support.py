"""Pieces of the SFT trainer that are not the loop: the training scope, step reports, results,
gradient-norm statistics, segment planning per row, failure classification, publication, and the
identity a run records (checkpoint `auxiliary_state`, receipt facts).
"""

from __future__ import annotations

import logging
import resource
import uuid
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln_train import checkpoint as ckpt
from kiln_train.artifacts import adapter as adapter_io
from kiln_train.artifacts.adapter_layout import FAILED_RECEIPTS_DIR, TRAIN_RECEIPT
from kiln_train.artifacts.digest import json_sha256
from kiln_train.artifacts.fencing import Fence
from kiln_train.artifacts.provenance import git_state
from kiln_train.artifacts.receipt import RunFacts, adapter_manifest, build_receipt
from kiln_train.checkpoint import GradNormStats
from kiln_train.data.ingestion import IngestionResult, kept_corpus_sha256
from kiln_train.errors import TrainingFailure
from kiln_train.model.checkpointing import segment_bounds
from kiln_train.model.config import LORA_TARGET_MODULES
from kiln_train.model.resident import ResidentModel
from kiln_train.plan.backend import FULL_LOGITS
from kiln_train.plan.formulas import checkpoint_boundary_policy
from kiln_train.plan.memory import estimate
from kiln_train.plan.segments import row_segments
from kiln_train.sft_config import MAX_LORA_ALPHA_OVER_RANK, SftConfig

log = logging.getLogger(__name__)

DIVERGENCE_RATIO, DIVERGENCE_MARGIN = 8.0, 5.0

# The training scope (seed 000 "Tape authority"): set only inside forward/backward of a step.
TRAINING_SCOPE: ContextVar[bool] = ContextVar("kiln_training_scope", default=False)


@contextmanager
def training_scope():
    """Open the explicit training scope: gradients recorded, graph-preserving kernels only."""
    token = TRAINING_SCOPE.set(True)
    try:
        with torch.enable_grad():
            yield
    finally:
        TRAINING_SCOPE.reset(token)


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


def release_lora(model) -> None:
    """Detach whatever LoRA set is attached, leaving the resident base model as loaded."""
    lora = getattr(model, "lora", None)
    if lora is not None:
        lora.remove(model)


def peak_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


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


def failed_receipt_path(registry: Path, adapter_name: str, run_id: str) -> Path:
    return registry / FAILED_RECEIPTS_DIR / adapter_name / f"{run_id}.{TRAIN_RECEIPT}"


def write_failed_receipt(registry: Path, adapter_name: str, run_id: str, receipt: dict) -> Path:
    path = failed_receipt_path(registry, adapter_name, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(adapter_io.json_bytes(receipt))
    tmp.replace(path)
    return path


def publish_success(
    resident: ResidentModel,
    facts: RunFacts,
    registry: Path,
    tensors: dict,
    *,
    parent_adapter: str | None,
    extra_files: dict[str, bytes] | None = None,
    fence: Fence | None = None,
) -> tuple[Path, dict]:
    scale = facts.alpha / facts.rank
    holder: dict = {}

    def _receipt(output: dict) -> dict:
        holder["receipt"] = build_receipt(
            facts,
            status="success",
            output=output,
            lora_delta_norms=adapter_io.lora_delta_norms(tensors, scale),
        )
        return holder["receipt"]

    path = adapter_io.publish_adapter(
        registry,
        facts.adapter_name,
        tensors,
        rank=facts.rank,
        alpha=facts.alpha,
        build_receipt=_receipt,
        build_manifest=lambda receipt, hashes: adapter_manifest(
            receipt, hashes, parent_adapter=parent_adapter
        ),
        extra_files=extra_files,
        fence=fence,
    )
    return path, holder["receipt"]


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


# ----- planning and identity (what checkpoints bind and receipts record) ------------------------
def default_checkpoint_plan(config: SftConfig) -> dict:
    return {"max_segments": config.grad_checkpoint_segments or 1, "auto": False, "budget_bytes": None}


def per_row_plan(
    resident: ResidentModel, config: SftConfig, ingestion: IngestionResult, plan: dict, route: str
):
    """Segments for every kept row, and the plan list whose digest the checkpoint binds."""
    cfg = resident.config

    def fits(seq_len: int, supervised: int, segments: int) -> bool:
        b = estimate(
            cfg,
            max_seq_len=seq_len,
            max_supervised_tokens=supervised,
            lora_rank=config.lora_rank,
            optimizer_kind=config.optimizer.kind,
            num_segments=segments,
            loss_route=route,
            backend=resident.backend,
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


def auxiliary_state(
    resident: ResidentModel,
    config: SftConfig,
    ingestion: IngestionResult,
    route: str,
    plan_entries: list,
    plan: dict | None = None,
) -> dict:
    """`auxiliary_state` of an SFT checkpoint (kiln-contract §5.3): everything resume must match."""
    ident = resident.identity
    precision = resident.backend.precision_policy(config.optimizer.kind)
    return {
        "loop_state_type": ckpt.SFT_LOOP_STATE_TYPE,
        "model_config_sha256": ident["model_config_sha256"],
        "tokenizer_config_sha256": ident["tokenizer_config_sha256"],
        "chat_template_sha256": ident["chat_template_sha256"],
        "training_chat_template_sha256": ident["training_chat_template_sha256"],
        "base_model_weights_sha256": resident.base_weights_sha256,
        "base_weight_shard_manifest": resident.shard_manifest,
        "execution_provenance": resident.provenance,
        "backend_runtime": {
            "backend": resident.backend.name,
            "device": resident.backend.device,
            # CPU reductions split by thread count, so the count is part of what makes a
            # continuation bit-exact; train_sft resumes with the checkpoint's count.
            "cpu_threads": torch.get_num_threads(),
        },
        "kiln_train_version": resident.provenance["build"]["package_version"],
        "gradient_checkpoint_plan_sha256": json_sha256(plan_entries),
        "ingestion_receipt_sha256": json_sha256(ingestion.receipt),
        "training_precision_policy": precision,
        "training_runtime_planning_identity": {
            "schema": ckpt.SFT_PLANNING_SCHEMA,
            "sft_loss_route": route,
            "checkpoint_boundary_policy": checkpoint_boundary_policy(),
            "runtime_device": resident.backend.device,
        },
        "valid_indices_sha256": json_sha256(sorted(r.row_index for r in ingestion.rows)),
        ckpt.CHECKPOINT_PLAN_AUX_KEY: recorded_plan(plan or default_checkpoint_plan(config)),
    }


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


def run_facts(
    resident: ResidentModel, config: SftConfig, ingestion: IngestionResult, route: str, name: str
) -> RunFacts:
    commit, dirty = git_state()
    prov = resident.provenance
    return RunFacts(
        adapter_name=name,
        config=config.to_json(),
        learning_rate=float(config.learning_rate),
        seed=int(config.seed),
        rank=config.lora_rank,
        alpha=config.lora_alpha,
        epochs=config.epochs,
        ingestion=ingestion.receipt,
        loss_route=route,
        training_precision=resident.backend.precision_policy(config.optimizer.kind),
        execution_provenance=prov,
        model_path=str(resident.model_dir),
        model_identity=resident.identity,
        base_weight_shard_manifest=resident.shard_manifest,
        package_version=prov["build"]["package_version"],
        git_commit=commit,
        git_dirty=dirty,
        env_config_hash=prov["configuration"]["effective_environment_sha256"],
        tokens_per_epoch=ingestion.total_tokens,
        supervised_per_epoch=ingestion.total_supervised_tokens,
    )


def warm_up(resident: ResidentModel, tokens: int = 16) -> None:
    """One tiny checkpointed forward/backward at worker start, then the model is left as loaded.

    One-time process costs (thread pools, BLAS buffers, the modules the first checkpointed step
    imports) then belong to the worker's resident baseline, not to the first job's memory; the
    estimate charges per-job costs only.
    """
    from kiln_train.model import attach_lora
    from kiln_train.train.loss import sft_loss

    model = resident.model
    release_lora(model)
    lora = attach_lora(model, 2, 2.0, 0)
    try:
        ids = torch.arange(tokens, device=model.device).remainder(resident.config.vocab_size)[None]
        labels = ids[0].clone()
        segments = min(2, resident.config.num_hidden_layers)
        with training_scope():
            hidden = model.hidden_states(ids, num_segments=segments)
            sft_loss(resident.backend.sft_loss_route, hidden, model.lm_head_weight, labels).backward()
    finally:
        lora.remove(model)
