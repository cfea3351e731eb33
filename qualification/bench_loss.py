"""SFT step time and peak memory: kt_tape_flce vs full_logits vs transformers + PEFT.

On the `small` random preset (8 layers, hidden 256, the full 248,320-token vocabulary), with half
of the tokens supervised (the second half of the row), one LoRA rank-16 step on every one of the
ten targets with AdamW, for T in {512, 2048, 8192}:

- `kt_tape_flce`: Kiln's model, gathered rows + chunked linear cross-entropy (the backend route);
- `full_logits`: Kiln's model, dense [T, V] logits + cross-entropy (the portable reference);
- `hf_peft`: transformers `AutoModelForCausalLM` + PEFT `get_peft_model` (same targets, rank and
  alpha), their standard loss `model(input_ids, labels=labels).loss`, `torch.optim.AdamW`.

Each (route, T) runs in its own fresh subprocess with the cpu allocator policy of the worker
(`kiln_train.plan.budget.apply_cpu_allocator_policy`, applied to all three alike). Peak memory is the
peak RSS above the RSS after the model is loaded; step time is the mean of the measured steps
after one warm-up step. A case whose dense logits would not fit in the machine's available memory
(estimated with the full_logits formula of `kiln_train.plan.memory`) is skipped, not run into an OOM.

Targets at T = 2048: kt_tape_flce peak RSS <= 0.4x hf_peft and step time <= 0.7x.

    .venv/bin/python qualification/bench_loss.py                 # T = 512, 2048, 8192
    .venv/bin/python qualification/bench_loss.py --seq-lens 2048 --steps 3
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kiln_train.model.config import LORA_TARGET_MODULES

MIB = 1 << 20
ROUTES = ("kt_tape_flce", "full_logits", "hf_peft")
RANK, ALPHA, LR = 16, 32.0, 1e-4
TARGETS = list(LORA_TARGET_MODULES)


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _row(seq_len: int, vocab: int, step: int):
    import torch

    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    labels = torch.full((1, seq_len), -100, dtype=torch.long)
    half = seq_len // 2
    labels[0, half:] = ids[0, half:]
    return ids, labels


def kiln_stepper(model_dir: str, route: str):
    from kiln_train.model import attach_lora, load_model
    from kiln_train.optim import build_optimizer
    from kiln_train.train.loss import sft_loss

    model = load_model(model_dir)
    vocab = model.config.vocab_size

    def setup():
        lora = attach_lora(model, RANK, ALPHA, 0)
        named = lora.named_parameters()
        optimizer = build_optimizer("adam_w", named, LR)

        def step(ids, labels):
            hidden = model.hidden_states(ids)
            loss = sft_loss(route, hidden, model.lm_head_weight, labels[0])
            loss.backward()
            optimizer.step({name: p.grad for name, p in named})
            for _, p in named:
                p.grad = None
            return float(loss)

        return step

    return vocab, setup


def hf_stepper(model_dir: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = base.config.vocab_size

    def setup():
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, bias="none")
        model = get_peft_model(base, config)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=LR, foreach=False)

        def step(ids, labels):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss)

        return step

    return vocab, setup


def run_child(model_dir: str, route: str, seq_len: int, steps: int) -> dict:
    import torch

    from kiln_train.plan.budget import apply_cpu_allocator_policy

    apply_cpu_allocator_policy()
    torch.manual_seed(0)
    vocab, setup = hf_stepper(model_dir) if route == "hf_peft" else kiln_stepper(model_dir, route)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _rss()
    _reset_hwm()
    step = setup()
    times, losses = [], []
    for i in range(steps + 1):
        ids, labels = _row(seq_len, vocab, i)
        start = time.perf_counter()
        losses.append(step(ids, labels))
        if i > 0:  # step 0 is the warm-up
            times.append(time.perf_counter() - start)
    return {"peak": _hwm() - base, "step_s": sum(times) / len(times), "loss": losses[0]}


def dense_logits_bytes(model_dir: str, seq_len: int) -> int:
    from kiln_train.ground.backend import backend_for_device
    from kiln_train.model.config import load_config
    from kiln_train.plan.formulas import loss_workspace_bytes

    config = load_config(model_dir)
    e = backend_for_device("cpu").dtype_bytes
    return loss_workspace_bytes(config, "full_logits", seq_len, seq_len // 2, e)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--child", nargs=3, metavar=("MODEL_DIR", "ROUTE", "SEQ_LEN"))
    args = parser.parse_args(argv)
    if args.child:
        model_dir, route, seq_len = args.child
        print(json.dumps(run_child(model_dir, route, int(seq_len), args.steps)))
        return 0

    from kiln_train.model.tiny import write_tiny_checkpoint
    from kiln_train.plan.budget import cpu_available_bytes

    results: dict[tuple[str, int], dict | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_tiny_checkpoint(Path(tmp) / args.preset, args.preset, with_tokenizer=False))
        print(f"{'T':>6} {'route':>13} {'step s':>8} {'peak RSS MiB':>13} {'first loss':>11}", flush=True)
        for t in args.seq_lens:
            for route in args.routes:
                dense = route != "kt_tape_flce"
                need = dense_logits_bytes(model_dir, t)
                if dense and need > 0.6 * cpu_available_bytes():
                    results[(route, t)] = f"skipped: dense logits need ~{need / 2**30:.1f} GiB"
                    print(f"{t:>6} {route:>13} {results[(route, t)]}", flush=True)
                    continue
                cmd = [
                    sys.executable,
                    __file__,
                    "--steps",
                    str(args.steps),
                    "--child",
                    model_dir,
                    route,
                    str(t),
                ]
                out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    results[(route, t)] = f"failed: {out.stderr.strip().splitlines()[-1:]}"
                    print(f"{t:>6} {route:>13} {results[(route, t)]}", flush=True)
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                results[(route, t)] = r
                print(
                    f"{t:>6} {route:>13} {r['step_s']:>8.2f} {r['peak'] / MIB:>13.1f} {r['loss']:>11.4f}",
                    flush=True,
                )
    for t in args.seq_lens:
        ours, hf = results.get(("kt_tape_flce", t)), results.get(("hf_peft", t))
        if isinstance(ours, dict) and isinstance(hf, dict):
            print(
                f"T={t}: kt_tape_flce / hf_peft peak RSS {ours['peak'] / hf['peak']:.2f}x (target <= 0.4 at 2048), "
                f"step time {ours['step_s'] / hf['step_s']:.2f}x (target <= 0.7 at 2048)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
