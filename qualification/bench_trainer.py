"""Benchmark: `train_sft` versus a transformers + PEFT + torch AdamW loop (speed and memory).

Both sides train LoRA rank r (alpha 2r, the ten Qwen3.5 targets, no dropout) with AdamW on the
same `small` tiny checkpoint (full 248,320-token vocabulary, f32 on CPU), one conversation per
optimizer step, on the same admitted rows (our ingestion: Qwen3.5 training template, assistant-only
labels). Each conversation is about T tokens long, most of them assistant tokens.

- ours: `kiln_train.train_sft` (route `kt_tape_flce`, the exact gradient-set check, grad-norm
  statistics: the whole production step). Step time = the time between consecutive progress
  callbacks.
- theirs: `AutoModelForCausalLM` + `peft.get_peft_model` + `torch.optim.AdamW` over the LoRA
  parameters; per step `model(input_ids, labels=labels).loss.backward(); opt.step();
  opt.zero_grad()` -- the standard Hugging Face loss on dense logits.

Each (side, T) runs in its own subprocess so peak RSS (`VmHWM`, which includes model loading
on both sides) is clean; rounds alternate the sides so background load hits both alike. The
table reports the median wall step time, the median CPU time per step (less sensitive to a shared
machine), tokens/s from each, peak RSS and the ratios ours/theirs. Targets at T ~ 4,000:
tokens/s >= 1.4x theirs, peak RSS <= 0.5x theirs.

    .venv/bin/python qualification/bench_trainer.py --lengths 1000 4000 --rounds 3 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULT_TAG = "RESULT "
WORDS = [
    "kiln",
    "fires",
    "clay",
    "into",
    "stone",
    "while",
    "the",
    "potter",
    "waits",
    "and",
    "watches",
    "the",
    "glaze",
    "turn",
    "from",
    "dull",
    "powder",
    "to",
    "bright",
    "glass",
    "as",
    "heat",
    "climbs",
    "past",
    "one",
    "thousand",
    "degrees",
    "over",
    "many",
    "patient",
    "hours",
]


def conversation(target_tokens: int, index: int, tokenizer) -> dict:
    """A user/assistant pair whose rendered length is close to `target_tokens`."""
    user = f"Tell story number {index} about the kiln."
    words, text = [], ""
    # Grow the reply in word steps until the tokenized reply reaches the budget (minus template).
    budget = max(8, target_tokens - 30)
    i = index
    while True:
        words.append(WORDS[i % len(WORDS)])
        i += 7
        if len(words) % 64 == 0 or len(words) > budget:
            text = " ".join(words)
            if len(tokenizer.encode(text, add_special_tokens=False).ids) >= budget:
                break
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": text}]}


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM). Not ru_maxrss: that keeps the forking driver's size
    across exec, which inflated both sides by the driver's RSS."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ----- one worker process ------------------------------------------------------------------------
def run_ours(args, rows) -> dict:
    import torch

    from kiln_train.data.ingestion import ingest_examples
    from kiln_train.train.resident import load_resident
    from qualification.bench_support import lora_config, require_success, train_on_resident

    resident = load_resident(args.model_dir)
    ingestion = ingest_examples(rows, tokenizer=resident.tokenizer, template=resident.template)
    config = lora_config(args.rank)
    marks = []

    def progress(report):
        marks.append((time.perf_counter(), time.process_time(), report.tokens, report.loss, report.item))

    with tempfile.TemporaryDirectory(prefix="kiln-bench-out-") as out:
        start = (time.perf_counter(), time.process_time())
        result = train_on_resident(resident, config, ingestion, out, adapter_name="bench", progress=progress)
    require_success(result)
    points = [start, *[(m[0], m[1]) for m in marks]]
    wall = [points[i + 1][0] - points[i][0] for i in range(len(marks))]
    cpu = [points[i + 1][1] - points[i][1] for i in range(len(marks))]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens": [m[2] for m in marks],
        # The epoch order permutes the rows: report row 0's loss, the row theirs trains first.
        "loss": next(m[3] for m in marks if m[4] == 0),
        "threads": torch.get_num_threads(),
    }


def run_theirs(args, rows) -> dict:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from kiln_train.data.ingestion import ingest_examples
    from kiln_train.model.config import LORA_TARGET_MODULES
    from kiln_train.train.resident import load_resident

    # The same admitted rows: the tokenizer and template are loaded the way the trainer loads them.
    resident = load_resident(args.model_dir)
    ingestion = ingest_examples(rows, tokenizer=resident.tokenizer, template=resident.template)
    del resident
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    lora = peft.LoraConfig(
        r=args.rank, lora_alpha=2.0 * args.rank, target_modules=list(LORA_TARGET_MODULES), lora_dropout=0.0
    )
    model = peft.get_peft_model(base, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    wall, cpu, tokens, losses = [], [], [], []
    for row in ingestion.rows:
        ids = torch.tensor([row.input_ids])
        labels = torch.tensor([row.labels])
        w0, c0 = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
        tokens.append(row.seq_len)
        losses.append(value)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens": tokens,
        "loss": losses[0],
        "threads": torch.get_num_threads(),
    }


def run_worker(args) -> None:
    import torch

    from kiln_train.data.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model_dir)
    rows = [conversation(args.length, i, tokenizer) for i in range(args.warmup + args.steps)]
    out = run_ours(args, rows) if args.worker == "ours" else run_theirs(args, rows)
    for key in ("wall_s", "cpu_s", "tokens"):
        out[key] = out[key][args.warmup :]
    out.update({"side": args.worker, "length": args.length, "peak_rss_mib": peak_rss_mib()})
    print(RESULT_TAG + json.dumps(out), flush=True)


# ----- orchestration -------------------------------------------------------------------------------
def _run(args, side: str, length: int, model_dir: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--length", str(length)]
    cmd += ["--model-dir", model_dir, "--rank", str(args.rank), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise RuntimeError(
        f"{side} worker failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def _summary(runs: list[dict]) -> dict:
    wall = sum((r["wall_s"] for r in runs), [])
    cpu = sum((r["cpu_s"] for r in runs), [])
    tokens = statistics.median(sum((r["tokens"] for r in runs), []))
    return {
        "tokens": tokens,
        "wall": statistics.median(wall),
        "cpu": statistics.median(cpu),
        "rss": statistics.median(r["peak_rss_mib"] for r in runs),
        "loss": runs[0]["loss"],
    }


def run_benchmark(args) -> None:
    from qualification.bench_support import write_bench_checkpoint

    with tempfile.TemporaryDirectory(prefix="kiln-bench-trainer-") as tmp:
        model_dir = str(write_bench_checkpoint(Path(tmp) / "small"))
        print(
            f"# small preset (vocab 248320, f32, CPU), LoRA r={args.rank} AdamW, {args.steps} timed steps x "
            f"{args.rounds} rounds after {args.warmup} warm-up; torch threads {args.threads}; "
            f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f}"
        )
        table = []
        for length in args.lengths:
            runs: dict[str, list[dict]] = {"ours": [], "theirs": []}
            for _ in range(args.rounds):
                for side in ("ours", "theirs"):
                    r = _run(args, side, length, model_dir)
                    runs[side].append(r)
                    print(
                        f"#   T={length} {side}: wall {[round(x, 2) for x in r['wall_s']]} s, "
                        f"cpu {[round(x, 2) for x in r['cpu_s']]} s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
                        f"row-0 loss {r['loss']:.4f}",
                        flush=True,
                    )
            table.append((length, _summary(runs["ours"]), _summary(runs["theirs"])))
    print()
    print("| T (tokens) | side | step wall s | tok/s wall | step cpu s | tok/s cpu | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for length, ours, theirs in table:
        for side, s in (("kiln train_sft", ours), ("transformers+PEFT+AdamW", theirs)):
            print(
                f"| {s['tokens']:.0f} | {side} | {s['wall']:.3f} | {s['tokens'] / s['wall']:.0f} | "
                f"{s['cpu']:.3f} | {s['tokens'] / s['cpu']:.0f} | {s['rss']:.0f} |"
            )
        print(
            f"| {length} | ours/theirs | | {theirs['wall'] / ours['wall']:.2f}x tok/s | | "
            f"{theirs['cpu'] / ours['cpu']:.2f}x tok/s | {ours['rss'] / theirs['rss']:.2f}x RSS |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--worker", choices=["ours", "theirs"])
    p.add_argument("--length", type=int)
    p.add_argument("--model-dir")
    args = p.parse_args()
    if args.worker:
        run_worker(args)
    else:
        run_benchmark(args)


if __name__ == "__main__":
    main()
