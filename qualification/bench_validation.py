"""Benchmark: what an evaluated validation token costs against a trained token (issue 17).

One `train_sft` run per length T on the `small` tiny checkpoint (full 248,320-token vocabulary,
f32 on CPU), LoRA rank r with AdamW, one conversation per optimizer step, with held-out
validation rows of the same length evaluated after every step (`interval_steps = 1`). The
trainer's callbacks give the two phases apart:

    progress(step k) -> evaluation k -> on_evaluation(k) -> step k + 1 -> progress(step k + 1)

so a step's time is `progress(k + 1) - on_evaluation(k)` and an evaluation's is
`on_evaluation(k) - progress(k)`. The process runs with the cpu worker's allocator policy
(`apply_cpu_allocator_policy`), as a worker would. The first step and the baseline (which also pay for start-up)
are left out. Reported, by wall clock and by this process's CPU time (less sensitive to a shared
machine): median seconds per step and per evaluation, trained and evaluated tokens per second,
and the cost of an evaluated token relative to a trained one (target <= 0.4x).

    .venv/bin/python qualification/bench_validation.py --lengths 2000 4000 --steps 3

This is a measurement, not a test: nothing asserts the target.
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

from qualification.bench_trainer import conversation  # noqa: E402


def measure(model_dir: str, length: int, *, steps: int, validation_rows: int, rank: int) -> dict:
    import torch

    from kiln_train.data.ingestion import ingest_examples
    from kiln_train.data.tokenizer import load_tokenizer
    from kiln_train.data.validation import prepare_validation
    from kiln_train.sft_config import ValidationSpec
    from kiln_train.train.resident import load_resident
    from qualification.bench_support import lora_config, require_success, train_on_resident

    tokenizer = load_tokenizer(model_dir)
    rows = [conversation(length, i, tokenizer) for i in range(steps + 1)]
    held_out = [conversation(length, 1000 + i, tokenizer) for i in range(validation_rows)]
    resident = load_resident(model_dir)
    ingestion = ingest_examples(rows, tokenizer=resident.tokenizer, template=resident.template)
    ingestion, validation = prepare_validation(
        ValidationSpec(examples=held_out, interval_steps=1),
        ingestion,
        tokenizer=resident.tokenizer,
        template=resident.template,
    )
    config = lora_config(rank)
    marks: list[tuple[str, int, float, float, int]] = []  # (kind, global step, wall, cpu, tokens)

    def progress(report) -> None:
        marks.append(("step", report.global_step, time.perf_counter(), time.process_time(), report.tokens))

    def evaluated(evaluation) -> None:
        marks.append(("eval", evaluation.global_step, time.perf_counter(), time.process_time(), 0))

    with tempfile.TemporaryDirectory(prefix="kiln-bench-validation-out-") as out:
        result = train_on_resident(
            resident,
            config,
            ingestion,
            out,
            adapter_name="bench",
            progress=progress,
            validation=validation,
            on_evaluation=evaluated,
        )
    require_success(result)
    step_s, step_cpu, step_tokens, eval_s, eval_cpu = [], [], [], [], []
    for previous, current in zip(marks, marks[1:], strict=False):
        if current[0] == "step" and previous[0] == "eval" and current[1] >= 2:
            step_s.append(current[2] - previous[2])
            step_cpu.append(current[3] - previous[3])
            step_tokens.append(current[4])
        if current[0] == "eval" and previous[0] == "step" and current[1] >= 1:
            eval_s.append(current[2] - previous[2])
            eval_cpu.append(current[3] - previous[3])
    tokens, eval_tokens = statistics.median(step_tokens), validation.stats.total_tokens
    out = {
        "length": length,
        "train_tokens": tokens,
        "eval_tokens": eval_tokens,
        "threads": torch.get_num_threads(),
        "evaluations": len(result.validation_history),
    }
    for clock, steps_, evals in (("wall", step_s, eval_s), ("cpu", step_cpu, eval_cpu)):
        step_median, eval_median = statistics.median(steps_), statistics.median(evals)
        out[f"{clock}_step_s"], out[f"{clock}_eval_s"] = step_median, eval_median
        out[f"{clock}_train_tok_s"] = tokens / step_median
        out[f"{clock}_eval_tok_s"] = eval_tokens / eval_median
        # seconds per evaluated token over seconds per trained token
        out[f"{clock}_cost"] = (eval_median / eval_tokens) / (step_median / tokens)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000])
    p.add_argument("--steps", type=int, default=3, help="timed steps (and evaluations) per length")
    p.add_argument("--validation-rows", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--layers", type=int, help="override the preset's layer count (a trunk-heavier shape, for contrast)"
    )
    args = p.parse_args()

    import torch

    from kiln_train.plan.budget import apply_cpu_allocator_policy
    from qualification.bench_support import write_bench_checkpoint

    torch.set_num_threads(args.threads)
    apply_cpu_allocator_policy()  # what the cpu worker runs with (freed tensors go back to the OS)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-validation-") as tmp:
        model_dir = str(write_bench_checkpoint(Path(tmp) / "small"))
        print(
            f"# small preset (vocab 248320, f32, CPU), LoRA r={args.rank} AdamW, {args.steps} timed steps, "
            f"{args.validation_rows} validation rows evaluated after every step; torch threads {args.threads}; "
            f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        table = [
            measure(model_dir, n, steps=args.steps + 1, validation_rows=args.validation_rows, rank=args.rank)
            for n in args.lengths
        ]
    print()
    print(
        "| T (tokens) | clock | step s | trained tok/s | evaluation s (tokens) | evaluated tok/s | "
        "evaluated token / trained token |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in table:
        for clock in ("wall", "cpu"):
            print(
                f"| {r['train_tokens']:.0f} | {clock} | {r[f'{clock}_step_s']:.3f} | "
                f"{r[f'{clock}_train_tok_s']:.0f} | {r[f'{clock}_eval_s']:.3f} ({r['eval_tokens']}) | "
                f"{r[f'{clock}_eval_tok_s']:.0f} | {r[f'{clock}_cost']:.2f}x |"
            )


if __name__ == "__main__":
    main()
