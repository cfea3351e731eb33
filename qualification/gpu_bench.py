"""The product's GPU step, measured: `kiln_train.finetune` on a random-weight Qwen3.5-4B checkpoint
(the plan's segments under a device budget, the fused chunked CE, AdamW, the backend's kernel
paths) at T = 4,096 / 16,384 / 32,768 on devices of 24 and 80 GiB, beside transformers + PEFT at
T = 4,096 (torch GDN, and flash-linear-attention's where it is usable), in one bounded run.

    python qualification/gpu_bench.py --device cuda                 # about 5 minutes on an H200
    python qualification/gpu_bench.py --device cuda --profile       # + the top ops of one run
    .venv/bin/python qualification/gpu_bench.py --device cpu --preset tiny   # the same code, CPU

A budget is the memory of the device emulated: the run's `training_memory_gb` is the budget less
the resident model and the 1 GiB reserve (docs/memory.md#budget). Columns: T (tokens of the
row), segments (the plan's), GDN path, step s (median wall time between steps after the first),
tokens/s, % of peak (4·N·T for the frozen trunk, N its non-embedding linear weights, plus 4·V·D
per supervised row for the head, over the step time, against a large matmul in the training dtype
measured in the same run: bf16 on CUDA, f32 on the CPU), peak GiB (CUDA: max allocated, weights
included; CPU: peak RSS), estimate/peak (the admission estimate over the measured working set,
the peak less what was in use before the run). Then `# kernel` lines (each fused operation alone,
forward + backward) and, last, one line `RESULT {json}` with the same rows.

Every stage runs in a worker process under its own time limit, inside the run's limit (7 minutes
for the 4B preset): a stage that runs out is a row saying so, and a fresh worker takes the rest.
Exit status 1 when a stage failed or ran out of time. docs/kernels.md#benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kiln_train.model.config import QWEN35_4B_TEXT_CONFIG  # noqa: E402  (torch-free)

READY, STAGE, RESULT = "READY ", "STAGE ", "RESULT "


@dataclass(frozen=True)
class Preset:
    base: str  # the write_tiny_checkpoint preset the overrides apply to
    overrides: dict
    lengths: tuple[int, ...]
    budgets_gib: tuple[float, ...]
    steps: dict[int, int]  # rows per finetune run by T (the first step warms up)
    transformers_length: int
    transformers_steps: int
    reserve_gib: float
    limits: dict = field(default_factory=dict)  # seconds: prepare, load, kernels, profile, transformers, T
    time_limit_s: float = 420.0


PRESETS = {
    "qwen35-4b": Preset(
        base="small",
        overrides={k: v for k, v in QWEN35_4B_TEXT_CONFIG.items() if k != "dtype"},
        lengths=(4096, 16384, 32768),
        budgets_gib=(24, 80),
        steps={4096: 3, 16384: 3, 32768: 2},
        transformers_length=4096,
        transformers_steps=3,
        reserve_gib=1.0,
        limits={
            "prepare": 150,
            "load": 240,
            "kernels": 60,
            "profile": 120,
            "transformers": 150,
            4096: 60,
            16384: 120,
            32768: 180,
        },  # fmt: skip
        time_limit_s=420,
    ),
    "tiny": Preset(  # the CPU smoke run of the same code (tests/qualification/test_gpu_bench.py)
        base="tiny",
        overrides={},
        lengths=(64, 256),
        # 0.093: the 0.06 GiB model leaves T = 256 two or three segments (one needs > 0.0937, three
        # < 0.0922: the planner prices the lean layers, docs/performance.md#estimate)
        budgets_gib=(0.093, 1.0),
        steps={64: 2, 256: 2},
        transformers_length=128,
        transformers_steps=2,
        reserve_gib=0.0,
        limits={
            "prepare": 120,
            "load": 180,
            "kernels": 120,
            "profile": 180,
            "transformers": 240,
            64: 120,
            256: 120,
        },
        time_limit_s=1200,
    ),
}


# ----- workers ---------------------------------------------------------------------------------
class Worker:
    """One worker process: its protocol lines come back through `next`, the rest is relayed."""

    def __init__(self, job: dict) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-job", json.dumps(job)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: queue.Queue = queue.Queue()
        self.last = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next(self, tag: str, limit: float) -> dict | str:
        """The JSON after the next `tag` line, or why none came within `limit` seconds."""
        deadline = time.monotonic() + max(0.0, limit)
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return f"timed out after {limit:.0f} s"
            if line is None:
                code = self.proc.wait()
                return f"the worker exited ({code}): {self.last[-240:]}"
            if line.startswith(tag):
                return json.loads(line[len(tag) :])
            if line.strip():
                self.last = line
            print(f"#   {line}", flush=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Clock:
    def __init__(self, limit_s: float) -> None:
        self.end = time.monotonic() + limit_s

    def left(self) -> float:
        return self.end - time.monotonic()


def run_stages(job: dict, stages: list[dict], limits: dict, clock: Clock) -> tuple[dict | None, list[dict]]:
    """Run `stages` in workers of `job`, each stage under its limit; a stage that fails or runs out
    becomes a row saying so and a fresh worker takes the rest. Returns (the first READY, rows)."""
    ready, rows, pending = None, [], list(stages)
    while pending:
        if clock.left() <= 1:
            rows += [_not_run(s, "not run: the run's time limit") for s in pending]
            break
        worker = Worker({**job, "stages": pending})
        try:
            info = worker.next(READY, min(limits["load"], clock.left()))
            if isinstance(info, str):
                rows += [_not_run(s, f"not run: loading {info}") for s in pending]
                break
            ready = ready or info
            while pending:
                stage = pending.pop(0)
                limit = min(_limit(stage, limits), clock.left())
                row = worker.next(STAGE, limit)
                rows.append(_not_run(stage, row) if isinstance(row, str) else {**_describe(stage), **row})
                if isinstance(row, str):
                    break  # the worker is stuck or gone: a fresh one takes the rest
        finally:
            worker.stop()
    return ready, rows


def _limit(stage: dict, limits: dict) -> float:
    kind = stage["stage"]
    return limits[stage["length"]] if kind == "kiln" else limits[kind]


def _describe(stage: dict) -> dict:
    return {k: v for k, v in stage.items() if k in ("stage", "length", "budget_gib", "side", "gdn_path")}


def _not_run(stage: dict, why: str) -> dict:
    return {**_describe(stage), "status": why}


# ----- the run ---------------------------------------------------------------------------------
def plan_stages(preset: Preset, profile: bool) -> tuple[list[dict], list[dict]]:
    """(the Kiln worker's stages, one transformers stage per GDN path)."""
    kiln = [{"stage": "kernels", "length": preset.lengths[0]}]
    for length in preset.lengths:
        steps = preset.steps[length]
        kiln += [
            {"stage": "kiln", "side": "kiln", "length": length, "budget_gib": b, "steps": steps}
            for b in preset.budgets_gib
        ]
    if profile:
        budget = max(preset.budgets_gib)
        kiln.append(
            {
                "stage": "profile",
                "length": preset.lengths[0],
                "budget_gib": budget,
                "reserve_gib": preset.reserve_gib,
            }
        )
    theirs = [
        {"stage": "transformers", "side": "transformers+peft", "gdn": gdn, "gdn_path": gdn,
         "length": preset.transformers_length, "steps": preset.transformers_steps}
        for gdn in ("torch", "fla")
    ]  # fmt: skip
    return kiln, theirs


def run(args) -> int:
    preset = PRESETS[args.preset]
    if args.lengths:
        preset = _with(preset, lengths=tuple(args.lengths))
    if args.budgets:
        preset = _with(preset, budgets_gib=tuple(args.budgets))
    clock = Clock(args.time_limit or preset.time_limit_s)
    started = time.monotonic()
    print(f"# gpu_bench: preset {args.preset} on {args.device}, run limit {clock.left():.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-bench-", dir=args.scratch) as work:
        job = {"device": args.device, "model_dir": str(Path(work) / "model"), "scratch": work,
               "base_preset": preset.base, "overrides": preset.overrides, "reserve_gib": preset.reserve_gib}  # fmt: skip
        _, (prepared,) = run_stages({**job, "kind": "prepare"}, [{"stage": "prepare"}], preset.limits, clock)
        kiln_stages, their_stages = plan_stages(preset, args.profile)
        if prepared.get("status") != "ok":
            rows = [
                _not_run(s, f"not run: the checkpoint was not written ({prepared['status']})")
                for s in kiln_stages + their_stages
            ]
            return report(args, preset, None, rows, time.monotonic() - started)
        ready, rows = run_stages({**job, "kind": "kiln"}, kiln_stages, preset.limits, clock)
        if not args.no_transformers:
            for stage in their_stages:
                rows += run_stages({**job, "kind": "transformers"}, [stage], preset.limits, clock)[1]
    return report(args, preset, ready, rows, time.monotonic() - started)


def _with(preset: Preset, **changes) -> Preset:
    from dataclasses import replace

    lengths = changes.get("lengths", preset.lengths)
    steps = {t: preset.steps.get(t, min(preset.steps.values())) for t in lengths}
    limits = {
        **preset.limits,
        **{
            t: preset.limits.get(t, max(v for k, v in preset.limits.items() if isinstance(k, int)))
            for t in lengths
        },
    }
    return replace(preset, steps=steps, limits=limits, **changes)


# ----- the report ------------------------------------------------------------------------------
COLUMNS = (
    "run",
    "T",
    "budget GiB",
    "segments",
    "GDN path",
    "step s",
    "tokens/s",
    "% of peak",
    "peak GiB",
    "estimate/peak",
    "note",
)


def report(args, preset: Preset, ready: dict | None, rows: list[dict], seconds: float) -> int:
    kernels = next((r.get("kernels") for r in rows if r.get("stage") == "kernels"), None)
    table = [r for r in rows if r.get("stage") in ("kiln", "transformers")]
    peak = (ready or {}).get("peak_tflops")
    if ready:
        print(
            f"# device {ready['device_name']}; kernel paths {json.dumps(ready['kernel_paths'], sort_keys=True)}"
        )
        for op, why in sorted(ready["kernel_reasons"].items()):
            print(f"#   {op}: {why}")
        dtype = "bf16" if args.device.startswith("cuda") else "f32"
        print(f"# peak: {peak:.3g} TFLOP/s ({dtype} matmul measured in this run); run took {seconds:.0f} s")
    for op, times in sorted((kernels or {}).items()):
        print(
            f"# kernel {op} forward+backward at T={preset.lengths[0]}: "
            + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items())
        )
    for row in rows:
        if row.get("stage") == "profile" and row.get("status") != "ok":
            print(f"# profile: {row['status']}")
    print()
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in table:
        print("| " + " | ".join(_cells(r)) + " |")
    failed = [r for r in rows if _failed(r)]
    result = {"preset": args.preset, "device": args.device, "device_name": (ready or {}).get("device_name"),
              "peak_tflops": peak, "kernel_paths": (ready or {}).get("kernel_paths"),
              "kernel_reasons": (ready or {}).get("kernel_reasons"), "kernels": kernels,
              "seconds": round(seconds, 1), "rows": table, "failed": len(failed)}  # fmt: skip
    print(RESULT + json.dumps(result, sort_keys=True), flush=True)
    return 1 if failed else 0


def _cells(r: dict) -> list[str]:
    def num(key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "—"

    budget = "—" if r.get("budget_gib") is None else f"{r['budget_gib']:g}"
    note = "" if r.get("status") == "ok" else str(r.get("status", "")).replace("|", "/")
    return [r.get("side", r.get("stage", "")), str(r.get("length", "—")), budget, num("segments", "d"), r.get("gdn_path", "—"),
            num("step_s", ".3f"), num("tokens_per_s", ",.0f"), num("pct_peak", ".1f"), num("peak_gib", ".2f"),
            num("estimate_over_peak", ".2f"), note]  # fmt: skip


def _failed(row: dict) -> bool:
    status = str(row.get("status", ""))
    return not (status == "ok" or status.startswith("skipped") or status.startswith("training_will_not_fit"))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="qwen35-4b", choices=sorted(PRESETS))
    parser.add_argument("--lengths", type=int, nargs="+", help="override the preset's T values")
    parser.add_argument("--budgets", type=float, nargs="+", help="override the preset's device budgets (GiB)")
    parser.add_argument("--profile", action="store_true", help="print the top ops of one profiled run")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers + PEFT rows")
    parser.add_argument("--time-limit", type=float, help="the whole run's limit in seconds")
    parser.add_argument("--scratch", default=None, help="where the checkpoint and adapters are written")
    parser.add_argument("--worker-job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_job:
        from qualification.gpu_bench_stages import run_worker

        run_worker(json.loads(args.worker_job))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
