"""What a run binds and records about itself: a checkpoint's `auxiliary_state` (everything a
resume must match) and the facts a receipt is built from."""

from __future__ import annotations

import torch

from kiln_train import checkpoint as ckpt
from kiln_train.artifacts.provenance import git_state
from kiln_train.artifacts.receipt import RunFacts
from kiln_train.data.ingestion import IngestionResult
from kiln_train.ground.digest import json_sha256
from kiln_train.optim.kinds import keeps_state
from kiln_train.plan.formulas import checkpoint_boundary_policy
from kiln_train.plan.row_plan import default_checkpoint_plan, recorded_plan
from kiln_train.sft_config import SftConfig
from kiln_train.train.resident import ResidentModel


def auxiliary_state(
    resident: ResidentModel,
    config: SftConfig,
    ingestion: IngestionResult,
    route: str,
    plan_entries: list,
    plan: dict | None = None,
) -> dict:
    """`auxiliary_state` of an SFT checkpoint: everything resume must match.

    docs/checkpoints.md#bound-identities.
    """
    ident = resident.identity
    precision = resident.backend.precision_policy(keeps_state(config.optimizer.kind))
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
            ckpt.PLANNING_KERNEL_PATHS_KEY: resident.kernel_paths.to_dict(),
        },
        "valid_indices_sha256": json_sha256(sorted(r.row_index for r in ingestion.rows)),
        ckpt.CHECKPOINT_PLAN_AUX_KEY: recorded_plan(plan or default_checkpoint_plan(config)),
    }


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
        training_precision=resident.backend.precision_policy(keeps_state(config.optimizer.kind)),
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
