"""Checkpoint write/load cost and size for a tiny-model preset at a LoRA rank, per optimizer.

Builds the exact SFT checkpoint layout of docs/checkpoints.md#layout (every trainable LoRA tensor of the
preset under its PEFT name, the optimizer state in the contract's F32 + U32-step layout, a loop
state at the given step) with random host tensors, then times `publish_checkpoint` (encode +
write + fsync + hash + manifest + rename) and `load_checkpoint` (full validation with hashing).
The figures are the checkpoint module's own cost: device-to-host copies are not included.

    .venv/bin/python qualification/bench_checkpoint.py --preset small --rank 16 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

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
    SftLoopState,
    epoch_order,
    load_checkpoint,
    publish_checkpoint,
    sft_manifest_draft,
)
from kiln_train.ground.backend import backend_for_device
from kiln_train.ground.digest import json_sha256, sha256_prefixed
from kiln_train.model.config import parse_config
from kiln_train.model.tiny import text_config
from kiln_train.optim.kinds import keeps_state
from kiln_train.sft_config import parse_sft_config

ITEMS = 200
STEP = 250  # epoch 1, cursor 50


def _digest(text: str) -> str:
    return sha256_prefixed(text.encode())


def lora_tensors(preset: str, rank: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    config = parse_config(text_config(preset))
    out = {}
    for p in config.projections():
        prefix = f"base_model.model.model.{p.module}"
        out[f"{prefix}.lora_A.weight"] = torch.randn(rank, p.in_features, generator=gen)
        out[f"{prefix}.lora_B.weight"] = torch.randn(p.out_features, rank, generator=gen)
    return out


def optimizer_tensors(kind: str, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    if kind == "sgd":
        return None
    out = {}
    for key, t in params.items():
        step = torch.tensor([STEP], dtype=torch.uint32)
        if kind == "adam_w":
            out[f"{key}.adamw.m"], out[f"{key}.adamw.v"], out[f"{key}.adamw.step"] = t * 0.1, t * t, step
        else:
            out[f"{key}.muon.momentum"], out[f"{key}.muon.step"] = t * 0.5, step
    return out


def auxiliary_state(policy: dict) -> dict:
    shards = [{"filename": "model.safetensors", "size_bytes": 1, "sha256": _digest("shard")}]
    provenance = {"schema_version": 1, "provenance_type": "kiln.execution-provenance.v1"}
    provenance["provenance_sha256"] = json_sha256(provenance)
    return {
        "loop_state_type": SFT_LOOP_STATE_TYPE,
        "model_config_sha256": _digest("config"),
        "tokenizer_config_sha256": _digest("tokenizer"),
        "chat_template_sha256": _digest("template"),
        "training_chat_template_sha256": _digest("training template"),
        "base_model_weights_sha256": shard_aggregate(shards),
        "base_weight_shard_manifest": {"aggregate_sha256": shard_aggregate(shards), "shards": shards},
        "execution_provenance": provenance,
        "backend_runtime": {"name": "cpu"},
        "kiln_train_version": "bench",
        "gradient_checkpoint_plan_sha256": _digest("plan"),
        "ingestion_receipt_sha256": _digest("receipt"),
        "training_precision_policy": policy,
        "training_runtime_planning_identity": {
            "schema": SFT_PLANNING_SCHEMA,
            "sft_loss_route": "kt_tape_flce",
        },
        "valid_indices_sha256": _digest("indices"),
    }


def loop_state(params: dict[str, torch.Tensor]) -> SftLoopState:
    losses = [1.0 / (1 + k) for k in range(STEP)]
    epoch, cursor = divmod(STEP, ITEMS)
    first = sum(losses[:ITEMS]) / ITEMS
    running = 0.0
    for loss in losses[STEP - cursor :]:
        running += loss
    modules = {key.removeprefix("base_model.model.model.").rsplit(".lora_", 1)[0] for key in params}
    return SftLoopState(
        global_step=STEP,
        epoch_index=epoch,
        cursor_in_epoch=cursor,
        loss_history=losses,
        last_loss=losses[-1],
        current_epoch_loss_sum=running,
        current_epoch_items=cursor,
        first_epoch_loss=first,
        best_epoch_loss=first,
        lora_grad_norms={
            m: GradNormStats(sample_count=STEP, sum=STEP * 0.1, min=0.01, max=0.5) for m in modules
        },
    )


def bench(preset: str, rank: int, kind: str, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = lora_tensors(preset, rank, gen)
    opt = optimizer_tensors(kind, params)
    config = parse_sft_config(
        {"epochs": 2, "lora_rank": rank, "lora_alpha": float(rank), "optimizer": {"kind": kind}}
    )
    config = config.resolve(seed=7)
    policy = backend_for_device("cpu").precision_policy(keeps_state(kind))
    epoch, cursor = divmod(STEP, ITEMS)
    draft = sft_manifest_draft(
        config=config,
        adapter_name="bench",
        precision_policy=policy,
        global_step=STEP,
        total_steps=2 * ITEMS,
        epoch_index=epoch,
        cursor_in_epoch=cursor,
        data_order=epoch_order(config.seed, epoch, ITEMS),
        content_sha256="0" * 64,
        item_count=ITEMS,
        auxiliary_state=auxiliary_state(policy),
    )
    state = loop_state(params)
    publish_ms, load_ms, encode_ms = [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            artifacts = {ADAPTER_FILE: save(params), LOOP_STATE_FILE: state.to_bytes()}
            if opt is not None:
                artifacts[OPTIMIZER_FILE] = save(opt)
            encode_ms.append((time.perf_counter() - t0) * 1000)
            published = publish_checkpoint(Path(tmp), draft, artifacts)
            publish_ms.append(published.publish_ms)
            t0 = time.perf_counter()
            load_checkpoint(published.path)
            load_ms.append((time.perf_counter() - t0) * 1000)
            size = published.total_bytes
    return {
        "optimizer": kind,
        "bytes": size,
        "encode_ms": statistics.median(encode_ms),
        "publish_ms": statistics.median(publish_ms),
        "load_ms": statistics.median(load_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"preset={args.preset} rank={args.rank} step={STEP} items={ITEMS} (medians of {args.repeats})")
    for kind in ("muon", "adam_w", "sgd"):
        r = bench(args.preset, args.rank, kind, args.repeats)
        print(
            f"{r['optimizer']:>7}: {r['bytes'] / 2**20:8.2f} MiB  encode {r['encode_ms']:7.1f} ms  "
            f"publish {r['publish_ms']:7.1f} ms  load(verify) {r['load_ms']:7.1f} ms"
        )


if __name__ == "__main__":
    main()
