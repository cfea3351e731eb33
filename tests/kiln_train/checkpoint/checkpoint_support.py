"""Builders shared by the checkpoint tests: a consistent SFT checkpoint with tiny tensors."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from kiln_train.artifacts.provenance import shard_aggregate
from kiln_train.checkpoint import (
    ADAPTER_FILE,
    LOOP_STATE_FILE,
    OPTIMIZER_FILE,
    SFT_LOOP_STATE_TYPE,
    SFT_PLANNING_SCHEMA,
    GradNormStats,
    ManifestDraft,
    PublishedCheckpoint,
    SftLoopState,
    epoch_order,
    publish_checkpoint,
    sft_manifest_draft,
)
from kiln_train.ground.backend import backend_for_device
from kiln_train.ground.digest import json_sha256
from kiln_train.optim.kinds import keeps_state
from kiln_train.sft_config import SftConfig, parse_sft_config

ADAPTER = "support-bot"
# The publisher's stages (kiln_train/checkpoint/publish.py), in the order it runs them.
PUBLICATION_STAGES = [
    "create_staging",
    "write_sentinel",
    "write_artifacts",
    "check_staging_files",
    "check_loop_state",
    "hash_artifacts",
    "build_manifest",
    "write_manifest",
    "remove_sentinel",
    "rename_into_place",
    "sync_parent",
]
ITEM_COUNT = 5
SEED = 1234
CONTENT_SHA256 = "sha256:" + hashlib.sha256(b"kept corpus").hexdigest()
LORA_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


def _hex(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def resolved_config(optimizer: str | dict = "adam_w", **overrides: Any) -> SftConfig:
    """A resolved config; `optimizer` is a kind or a whole optimizer object."""
    opt = optimizer if isinstance(optimizer, dict) else {"kind": optimizer}
    raw = {"epochs": 2, "lora_rank": 4, "lora_alpha": 8.0, "optimizer": opt, "seed": SEED}
    raw.update(overrides)
    return parse_sft_config(raw).resolve()


def precision_policy(optimizer: str = "adam_w") -> dict:
    return backend_for_device("cpu").precision_policy(keeps_state(optimizer))


def auxiliary_state(optimizer: str = "adam_w", **overrides: Any) -> dict:
    shards = [
        {"filename": "model-00001-of-00002.safetensors", "size_bytes": 1024, "sha256": _hex("shard 1")},
        {"filename": "model-00002-of-00002.safetensors", "size_bytes": 512, "sha256": _hex("shard 2")},
    ]
    aggregate = shard_aggregate(shards)
    provenance = {
        "schema_version": 1,
        "provenance_type": "kiln.execution-provenance.v1",
        "backend": {"name": "cpu"},
    }
    provenance["provenance_sha256"] = json_sha256(provenance)
    aux = {
        "loop_state_type": SFT_LOOP_STATE_TYPE,
        "model_config_sha256": _hex("config.json"),
        "tokenizer_config_sha256": _hex("tokenizer_config.json"),
        "chat_template_sha256": _hex("chat_template"),
        "training_chat_template_sha256": _hex("training_chat_template"),
        "base_model_weights_sha256": aggregate,
        "base_weight_shard_manifest": {
            "schema_version": 1,
            "manifest_type": "kiln.base-weight-shards.v1",
            "aggregate_algorithm": "kiln.base-model-content.v1",
            "aggregate_sha256": aggregate,
            "total_size_bytes": 1536,
            "shards": shards,
        },
        "execution_provenance": provenance,
        "backend_runtime": {"name": "cpu", "device": "cpu"},
        "kiln_train_version": "0.1.0",
        "gradient_checkpoint_plan_sha256": _hex("plan"),
        "ingestion_receipt_sha256": _hex("receipt"),
        "training_precision_policy": precision_policy(optimizer),
        "training_runtime_planning_identity": {
            "schema": SFT_PLANNING_SCHEMA,
            "sft_loss_route": "kt_tape_flce",
            "checkpoint_boundary_policy": {
                "recompute_mode": "auto",
                "recompute_threshold_tokens": 8192,
                "anchor_stride": None,
                "cache_target_bytes": 6442450944,
            },
        },
        "valid_indices_sha256": _hex("valid indices"),
    }
    aux.update(overrides)
    return aux


def position(global_step: int, item_count: int = ITEM_COUNT) -> tuple[int, int]:
    """(epoch_index, cursor_in_epoch) after `global_step` steps."""
    return divmod(global_step, item_count)


def loop_state(global_step: int, item_count: int = ITEM_COUNT) -> SftLoopState:
    epoch, cursor = position(global_step, item_count)
    losses = [2.0 / (1.0 + 0.37 * k) + 1e-17 * k for k in range(global_step)]
    running = 0.0
    for loss in losses[global_step - cursor :] if cursor else []:
        running += loss
    means = [sum(losses[e * item_count : (e + 1) * item_count]) / item_count for e in range(epoch)]
    norms = {"layers.0.self_attn.q_proj": GradNormStats.first(0.5)} if global_step else {}
    for _ in range(global_step - 1 if global_step else 0):
        norms["layers.0.self_attn.q_proj"] = norms["layers.0.self_attn.q_proj"].add(0.25)
    return SftLoopState(
        global_step=global_step,
        epoch_index=epoch,
        cursor_in_epoch=cursor,
        loss_history=losses,
        last_loss=losses[-1] if losses else None,
        current_epoch_loss_sum=running,
        current_epoch_items=cursor,
        first_epoch_loss=means[0] if means else None,
        best_epoch_loss=min(means) if means else None,
        lora_grad_norms=norms,
    )


def draft(global_step: int = 7, optimizer: str = "adam_w", **aux_overrides: Any) -> ManifestDraft:
    config = resolved_config(optimizer)
    epoch, cursor = position(global_step)
    return sft_manifest_draft(
        config=config,
        adapter_name=ADAPTER,
        precision_policy=precision_policy(optimizer),
        global_step=global_step,
        total_steps=config.epochs * ITEM_COUNT,
        epoch_index=epoch,
        cursor_in_epoch=cursor,
        data_order=epoch_order(SEED, epoch, ITEM_COUNT),
        content_sha256=CONTENT_SHA256,
        item_count=ITEM_COUNT,
        auxiliary_state=auxiliary_state(optimizer, **aux_overrides),
        created_at="2026-05-01T12:00:00.000Z",
    )


def artifacts(global_step: int = 7, optimizer: str = "adam_w") -> dict[str, bytes]:
    a = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 7.0
    b = torch.zeros(4, 2, dtype=torch.float32)
    out = {
        ADAPTER_FILE: save({LORA_KEY.format("A"): a, LORA_KEY.format("B"): b}),
        LOOP_STATE_FILE: loop_state(global_step).to_bytes(),
    }
    if optimizer == "adam_w":
        key = LORA_KEY.format("A")
        out[OPTIMIZER_FILE] = save(
            {
                f"{key}.adamw.m": a * 0.1,
                f"{key}.adamw.v": a * a * 0.01,
                f"{key}.adamw.step": torch.tensor([global_step], dtype=torch.uint32),
            }
        )
    elif optimizer == "muon":
        key = LORA_KEY.format("A")
        out[OPTIMIZER_FILE] = save(
            {
                f"{key}.muon.momentum": a * 0.5,
                f"{key}.muon.step": torch.tensor([global_step], dtype=torch.uint32),
            }
        )
    return out


def publish(registry: Path, global_step: int = 7, optimizer: str = "adam_w") -> PublishedCheckpoint:
    return publish_checkpoint(registry, draft(global_step, optimizer), artifacts(global_step, optimizer))
