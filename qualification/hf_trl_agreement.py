"""How closely the pinned TRL runner reproduces Kiln's own run of the same export bundle.

For each optimizer: a tiny random Qwen3.5 checkpoint (the real tokenizer), a few conversations,
an export bundle (`kiln_train.interop.export.export_sft`), the bundle's `train.py` in a fresh
interpreter (the real pinned TRL on the CPU, f32), and Kiln's `train_sft` on the same rows and
config. Printed per optimizer: the largest relative difference of the per-step losses, of the
final adapter tensors (max |a - b| / max |b| per tensor) and of the trained deltas (final minus
initial, which starts at zero), plus wall times. `tests/kiln_train/interop/test_trl_end_to_end.py`
holds SGD to 1e-4 (losses) and 1e-3 (adapters); this script reports AdamW, which is measured
rather than bound.

    .venv/bin/python qualification/hf_trl_agreement.py [--optimizers sgd adam_w] [--rows 3]
        [--epochs 2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from kiln_train import TrainRequest, train_sft  # noqa: E402
from kiln_train.data.ingestion import ingest_examples  # noqa: E402
from kiln_train.data.tokenizer import build_tokenizer  # noqa: E402
from kiln_train.interop.bundle import ResidentFacts  # noqa: E402
from kiln_train.interop.export import export_sft  # noqa: E402
from kiln_train.model.tiny import write_tiny_checkpoint  # noqa: E402
from kiln_train.sft_config import parse_sft_config  # noqa: E402
from kiln_train.train.resident import load_resident  # noqa: E402

LEARNING_RATES = {"sgd": 0.05, "adam_w": 1e-3}
COLORS = ["red", "blue", "green", "gold", "teal", "pink", "gray", "navy"]


def rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Item {i}: which color is listed?"},
                {"role": "assistant", "content": f"The color is {COLORS[i % len(COLORS)]}."},
            ]
        }
        for i in range(n)
    ]


def max_relative(ours: dict, theirs: dict) -> float:
    worst = 0.0
    for key, ref in theirs.items():
        scale = ref.abs().max().item()
        diff = (ours[key] - ref).abs().max().item()
        worst = max(worst, diff / scale if scale else diff)
    return worst


def measure(resident, work: Path, optimizer: str, n: int, epochs: int) -> dict:
    data = rows(n)
    body = {"epochs": epochs, "lora_rank": 4, "lora_alpha": 8.0, "seed": 7}
    body |= {"optimizer": {"kind": optimizer}, "learning_rate": LEARNING_RATES[optimizer]}
    config = parse_sft_config(body).resolve()
    export = export_sft(
        work / "exports",
        name=f"agree-{optimizer}",
        resident=ResidentFacts.of_resident(resident),
        tokenizer=resident.tokenizer,
        config=config,
        examples=data,
    )
    out = work / f"trl-{optimizer}"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(export.path / "train.py"), "--model", str(resident.model_dir)]
        + ["--output-dir", str(out), "--threads", "1"],
        capture_output=True,
        text=True,
    )
    trl_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    torch.set_num_threads(1)
    ingestion = ingest_examples(data, tokenizer=resident.tokenizer, template=resident.template)
    t0 = time.perf_counter()
    kiln = train_sft(
        TrainRequest(
            resident=resident,
            config=config,
            ingestion=ingestion,
            loss_route=resident.backend.sft_loss_route,
            output_root=work / "registry",
            adapter_name=f"kiln-{optimizer}",
        )
    )
    kiln_s = time.perf_counter() - t0
    if kiln.status != "success":
        raise SystemExit(f"Kiln's run failed: {kiln.failure_message}")
    theirs = [json.loads(line)["loss"] for line in (out / "step_losses.jsonl").read_text().splitlines()]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(theirs, kiln.loss_history, strict=True))
    trl_adapter = load_file(str(out / "adapter_model.safetensors"))
    kiln_adapter = load_file(str(kiln.adapter_path / "adapter_model.safetensors"))
    initial = load_file(str(export.path / "initial_adapter" / "adapter_model.safetensors"))
    return {
        "optimizer": optimizer,
        "learning_rate": LEARNING_RATES[optimizer],
        "steps": len(theirs),
        "loss_max_rel": loss_rel,
        "adapter_max_rel": max_relative(trl_adapter, kiln_adapter),
        "delta_max_rel": max_relative(
            {k: trl_adapter[k] - initial[k] for k in initial},
            {k: kiln_adapter[k] - initial[k] for k in initial},
        ),
        "trl_wall_s": round(trl_s, 1),
        "kiln_wall_s": round(kiln_s, 1),
        "kiln_losses": kiln.loss_history,
        "trl_losses": theirs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adam_w"], choices=["sgd", "adam_w"])
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-hf-agreement-") as tmp:
        work = Path(tmp)
        model_dir = write_tiny_checkpoint(work / "model", "tiny", seed=0, tokenizer=build_tokenizer())
        resident = load_resident(model_dir)
        results = [measure(resident, work, o, args.rows, args.epochs) for o in args.optimizers]
    for r in results:
        print(
            f"{r['optimizer']:>6} lr {r['learning_rate']:g}, {r['steps']} steps: loss max rel "
            f"{r['loss_max_rel']:.3e}, adapter max rel {r['adapter_max_rel']:.3e}, trained delta max rel "
            f"{r['delta_max_rel']:.3e} (TRL {r['trl_wall_s']} s incl. start-up, Kiln {r['kiln_wall_s']} s)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
