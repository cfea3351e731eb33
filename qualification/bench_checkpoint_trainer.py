"""Exact-checkpoint write time and size from real `train_sft` runs.

For each optimizer, trains the `small` tiny preset (full vocabulary, f32 on CPU) at LoRA rank r
with `checkpoint_interval=1` on short conversations, so every step but the last publishes a
`.kiln-checkpoint` through the trainer's own path: LoRA and optimizer tensors copied to host,
safetensors encoding, the loop state, staging directory + sentinel + fsyncs + hashes + manifest
+ rename (docs/checkpoints.md#publication). Reports the trainer's `write_ms` per checkpoint (median and max),
the checkpoint's size and its files, and the time a strict load (`load_checkpoint`, every hash
verified) takes. Whereas `bench_checkpoint.py` times the checkpoint module on random tensors,
this is what a training job pays.

    .venv/bin/python qualification/bench_checkpoint_trainer.py --preset small --rank 16 --checkpoints 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln_train.checkpoint import load_checkpoint  # noqa: E402
from kiln_train.data.ingestion import ingest_examples  # noqa: E402
from kiln_train.train.resident import load_resident  # noqa: E402
from qualification.bench_support import lora_config, train_on_resident, write_bench_checkpoint  # noqa: E402

OPTIMIZERS = {"sgd": 1e-4, "adam_w": 1e-4, "muon": 1e-3}


def rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Question {i}: what fires clay?"},
                {"role": "assistant", "content": f"A kiln fires clay, answer {i}."},
            ]
        }
        for i in range(n)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--checkpoints", type=int, default=5, help="checkpoints per optimizer")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--out", help="registry directory (default: a temporary directory on the same disk as /tmp)"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-ckpt-") as tmp:
        model_dir = write_bench_checkpoint(Path(tmp) / "model", args.preset)
        resident = load_resident(model_dir)
        ingestion = ingest_examples(
            rows(args.checkpoints + 1), tokenizer=resident.tokenizer, template=resident.template
        )
        registry = Path(args.out) if args.out else Path(tmp) / "registry"
        print(
            f"# {args.preset} preset, LoRA rank {args.rank} ({resident.config.lora_elements_per_rank() * args.rank:,} "
            f"trainable f32 elements), {args.checkpoints} checkpoints per optimizer, registry {registry} "
            f"(cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f})"
        )
        print()
        print(
            "| optimizer | write ms (median) | write ms (max) | checkpoint MiB | adapter MiB | optimizer MiB | "
            "loop state KiB | strict load ms |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for kind, lr in OPTIMIZERS.items():
            config = lora_config(args.rank, optimizer=kind, learning_rate=lr, checkpoint_interval=1)
            result = train_on_resident(
                resident, config, ingestion, registry, adapter_name=f"bench-{kind.replace('_', '')}"
            )
            if result.status != "success":
                raise SystemExit(f"{kind}: {result.failure_reason}: {result.failure_message}")
            writes = [c["write_ms"] for c in result.checkpoints]
            last = Path(result.checkpoints[-1]["path"])
            sizes = {f.name: f.stat().st_size for f in last.iterdir()}
            loads = []
            for c in result.checkpoints:
                t0 = time.perf_counter()
                load_checkpoint(Path(c["path"]), verify_hashes=True)
                loads.append((time.perf_counter() - t0) * 1000.0)
            mib = 2**20
            print(
                f"| {kind} | {statistics.median(writes):.1f} | {max(writes):.1f} | "
                f"{result.checkpoints[-1]['size_bytes'] / mib:.2f} | {sizes['adapter.safetensors'] / mib:.2f} | "
                f"{sizes.get('optimizer.safetensors', 0) / mib:.2f} | {sizes['sft_loop_state.json'] / 1024:.1f} | "
                f"{statistics.median(loads):.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
