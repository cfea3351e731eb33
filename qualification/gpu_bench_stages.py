"""The stages `gpu_bench.py` runs, each inside a worker process the orchestrator can bound and kill.

- `prepare`: write the random-weight checkpoint (config, tokenizer, chat template, weights drawn
  on the device) every other stage loads.
- `kiln` worker: load the resident model as the worker does (kernel paths chosen, one warm-up
  step), then per stage `kiln_train.finetune` on conversations of T tokens under a memory budget,
  the fused kernels' own timings, or a profiled run.
- `transformers` worker: transformers + PEFT (LoRA on the same ten targets, AdamW) on the same
  checkpoint, with the torch GDN path or flash-linear-attention's.

A worker prints `READY {json}` once loaded and `STAGE {json}` after each stage; anything else it
prints is relayed as a comment. Imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

GIB = 1 << 30
RANK = 16
READY, STAGE = "READY ", "STAGE "
# One-token words (with their leading space) the conversations are built from.
WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "by", "at")  # fmt: skip


def emit(tag: str, obj: dict) -> None:
    print(tag + json.dumps(obj, sort_keys=True), flush=True)


# ----- measuring ---------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> int:
    """Start a peak measurement; returns the bytes in use now (the baseline)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # a 24 GiB budget must not see the last stage's cached blocks
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # freed heap pages would serve the run unseen
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):  # reset VmHWM to the current RSS where the kernel allows it
        Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def matmul_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in `dtype`: the ceiling the step is compared with."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    reps, start = 10, time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def step_flops(model, length: int, supervised: int) -> float:
    """4·N·T for the frozen trunk (forward + input gradients; N = non-embedding linear weights)
    plus 4·V·D per supervised row for the head."""
    from kiln_train.model.linear import FrozenLinear

    n = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, FrozenLinear) and m is not model.lm_head
    )
    return 4.0 * n * length + 4.0 * model.lm_head_weight.numel() * supervised


# ----- rows ------------------------------------------------------------------------------
def conversations(resident, length: int, count: int, seed: int) -> tuple[list[dict], int, int]:
    """`count` single-turn conversations of `length` tokens after Kiln's training template (about
    half of them the supervised answer), built from one-token words; returns them with the longest
    row's length and supervised token count."""
    import random

    from kiln_train.data.ingestion import ingest_examples

    def example(rng, user: int, answer: int) -> dict:
        def text(n):
            return " ".join(rng.choice(WORDS) for _ in range(n))

        turns = [{"role": "user", "content": text(user)}, {"role": "assistant", "content": text(answer)}]
        return {"messages": turns}

    def ingest(examples):
        common = {"tokenizer": resident.tokenizer, "template": resident.template, "policy": "fail"}
        return ingest_examples(examples, **common).rows

    out = []
    for i in range(count):
        user = answer = max(1, length // 2 - 16)
        for _ in range(8):  # each word is one token: the template's overhead settles in a step or two
            ex = example(random.Random(seed * 1000 + i), user, answer)
            gap = length - ingest([ex])[0].seq_len
            if gap == 0:
                break
            answer, user = max(1, answer + gap - gap // 2), max(1, user + gap // 2)
        out.append(ex)
    rows = ingest(out)
    return out, max(r.seq_len for r in rows), max(r.supervised_tokens for r in rows)


def figures(step_s, length, flops, peak_flops, peak, working_set, estimate) -> dict:
    """The table's measured columns of one row."""
    out = {"peak_gib": peak / GIB, "working_set_gib": working_set / GIB}
    if step_s:
        out |= {
            "step_s": step_s,
            "tokens_per_s": length / step_s,
            "pct_peak": 100.0 * flops / step_s / peak_flops,
        }
    if estimate is not None and working_set > 0:
        out |= {"estimate_gib": estimate / GIB, "estimate_over_peak": estimate / working_set}
    return out


# ----- the kiln worker ---------------------------------------------------------------------
def load_kiln(model_dir: str, device: str):
    """The resident model as a worker loads it: allocator policy, kernel paths, one warm-up step."""
    from kiln_train.plan.budget import apply_cpu_allocator_policy
    from kiln_train.train.resident import load_resident
    from kiln_train.train.warmup import warm_up

    if device == "cpu":
        apply_cpu_allocator_policy()
    resident = load_resident(model_dir, device=device)
    warm_up(resident)
    return resident


def resident_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def training_budget(resident, budget_gib: float, reserve_gib: float) -> float:
    """GiB a training step may use on a device of `budget_gib`: what the model and the reserve leave."""
    return budget_gib - resident_bytes(resident.model) / GIB - reserve_gib


def kiln_stage(resident, stage: dict, scratch: Path, peak_flops: float, reserve_gib: float) -> dict:
    """`finetune` on `steps` conversations of T tokens, on a device of `budget_gib` GiB: the
    budget less the resident model and the reserve is the run's `training_memory_gb`."""
    from kiln_train.errors import KilnError
    from kiln_train.kernels.paths import GATED_DELTA_RULE
    from kiln_train.plan.memory import estimate
    from kiln_train.train.finetune import finetune

    device = torch.device(resident.backend.device)
    length, budget = stage["length"], stage["budget_gib"]
    row = {"side": "kiln", "length": length, "budget_gib": budget}
    row["gdn_path"] = resident.kernel_paths.paths[GATED_DELTA_RULE]
    training_gib = training_budget(resident, budget, reserve_gib)
    if training_gib <= 0:
        model_gib = resident_bytes(resident.model) / GIB
        return {**row, "status": f"the {model_gib:.2f} GiB model leaves no training memory in {budget} GiB"}
    examples, seq_len, supervised = conversations(resident, length, stage["steps"], seed=length)
    row["length"] = seq_len
    marks: list[float] = []

    def on_step(report) -> None:
        sync(device)
        marks.append(time.perf_counter())

    config = {"epochs": 1, "lora_rank": RANK, "lora_alpha": 2 * RANK, "learning_rate": 1e-4, "seed": 0}
    config["output_name"] = f"bench-{length}-{budget}".replace(".", "_")
    baseline = reset_peak(device)
    try:
        result = finetune(
            resident, examples, config, scratch, progress=on_step, training_memory_gb=training_gib
        )
    except KilnError as exc:
        return {**row, "status": f"{exc.code}: {exc.message}"[:300]}
    if result.status != "success":
        return {**row, "status": f"{result.failure_reason}: {result.failure_message}"[:300]}
    top = peak_bytes(device)
    segments = int(result.receipt["config"]["grad_checkpoint_segments"])
    est = estimate(
        resident.config,
        max_seq_len=seq_len,
        max_supervised_tokens=supervised,
        lora_rank=RANK,
        optimizer_kind="adam_w",
        num_segments=segments,
        loss_route=resident.backend.sft_loss_route,
        backend=resident.backend,
        weights_resident=True,
    ).total
    timed = [b - a for a, b in zip(marks, marks[1:], strict=False)]  # the first step warms up
    step_s = statistics.median(timed) if timed else None
    flops = step_flops(resident.model, seq_len, supervised)
    measured = figures(step_s, seq_len, flops, peak_flops, top, top - baseline, est)
    return {**row, **measured, "segments": segments, "timed_steps": len(timed), "status": "ok"}


def profile_stage(resident, stage: dict, scratch: Path, rows: int = 25) -> str:
    """The top operations of a two-step `finetune` under torch.profiler (by device time on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    from kiln_train.train.finetune import finetune

    device = torch.device(resident.backend.device)
    examples, _, _ = conversations(resident, stage["length"], 2, seed=7)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    config = {"epochs": 1, "lora_rank": RANK, "lora_alpha": 2 * RANK, "learning_rate": 1e-4, "seed": 0}
    config["output_name"] = "bench-profile"
    budget = training_budget(resident, stage["budget_gib"], stage["reserve_gib"])
    with profile(activities=activities) as prof:
        finetune(resident, examples, config, scratch, training_memory_gb=budget)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


# ----- transformers + PEFT -----------------------------------------------------------------
def transformers_stage(job: dict, stage: dict, peak_flops: float) -> dict:
    """transformers + PEFT on the same checkpoint: LoRA r=16 on the ten targets, next-token CE over
    the last half of T random tokens, backward, AdamW; flash-linear-attention's GDN kernel only
    when this process may import it (the torch-path worker hides it before transformers loads)."""
    import torch.nn.functional as F

    from kiln_train.model import Qwen35Model
    from kiln_train.model.config import parse_config
    from qualification.bench_model import build_theirs

    device = torch.device(job["device"])
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    length, steps = stage["length"], stage["steps"]
    args = _Args(model_dir=job["model_dir"], preset=job["base_preset"], seed=0, rank=RANK)
    hidden, head, params = build_theirs(args, device, dtype)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, head.shape[0], (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    half = length // 2
    targets = ids[0, half + 1 :]

    def step() -> None:
        h = hidden(ids)[:, half:].reshape(-1, head.shape[1])
        F.cross_entropy(F.linear(h, head)[:-1].float(), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    baseline = reset_peak(device)
    marks = []
    for _ in range(steps):
        step()
        sync(device)
        marks.append(time.perf_counter())
    timed = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    step_s = statistics.median(timed) if timed else None
    config = parse_config(json.loads((Path(job["model_dir"]) / "config.json").read_text()))
    with torch.device("meta"):
        shape = Qwen35Model(config)  # only to count the same weights as Kiln's rows
    flops = step_flops(shape, length, length - half - 1)
    top = peak_bytes(device)
    row = {"side": "transformers+peft", "length": length, "budget_gib": None, "segments": 1}
    row["gdn_path"] = transformers_gdn_path()
    return {
        **row,
        **figures(step_s, length, flops, peak_flops, top, top - baseline, None),
        "timed_steps": len(timed),
        "status": "ok",
    }


def transformers_gdn_path() -> str:
    """The gated delta rule transformers resolved when it imported: fla's kernel or its torch form."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    cells = modeling_qwen3_5.torch_chunk_gated_delta_rule.__closure__ or ()
    modules = {getattr(c.cell_contents, "__module__", "") for c in cells if callable(c.cell_contents)}
    return "fla" if any(m.startswith("fla.") for m in modules) else "torch"


class _Args:
    """The fields of bench_model's command line that `build_theirs` reads."""

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


def fla_reason(device: torch.device) -> str | None:
    from kiln_train.model.delta_rule import canonical_device, fla_unusable_reason

    return fla_unusable_reason(canonical_device(device))


# ----- the worker process ------------------------------------------------------------------
def run_worker(job: dict) -> None:
    """Run one worker's stages (`job` from the orchestrator), printing READY and STAGE lines."""
    device = torch.device(job["device"])
    start = time.perf_counter()
    if job["kind"] == "prepare":
        from kiln_train.data.tokenizer import build_tokenizer
        from kiln_train.model.tiny import write_tiny_checkpoint

        emit(READY, {})
        write_tiny_checkpoint(
            job["model_dir"],
            job["base_preset"],
            seed=0,
            overrides=job["overrides"],
            tokenizer=build_tokenizer(),
            device=job["device"],
        )
        emit(STAGE, {"status": "ok", "seconds": time.perf_counter() - start})
        return
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    peak_flops = matmul_peak_flops(device, dtype)
    if job["kind"] == "transformers":
        (stage,) = job["stages"]  # one GDN path per process: transformers picks it at import
        gdn = stage["gdn"]
        reason = fla_reason(device) if gdn == "fla" else None
        if gdn == "torch":
            sys.modules["fla"] = None
        emit(READY, {"peak_tflops": peak_flops / 1e12})
        row = {"side": "transformers+peft", "length": stage["length"], "gdn_path": gdn}
        if reason is not None:
            emit(STAGE, {**row, "status": f"skipped: {reason}"})
        else:
            emit(STAGE, {**row, **transformers_stage(job, stage, peak_flops)})
        return
    resident = load_kiln(job["model_dir"], job["device"])
    paths = resident.kernel_paths
    emit(
        READY,
        {
            "load_s": time.perf_counter() - start,
            "device_name": resident.device_name,
            "kernel_paths": paths.to_dict(),
            "kernel_reasons": paths.reasons,
            "peak_tflops": peak_flops / 1e12,
        },
    )
    scratch = Path(job["scratch"])
    for i, stage in enumerate(job["stages"]):
        try:
            emit(
                STAGE,
                kiln_worker_stage(resident, stage, scratch / f"stage-{i}", peak_flops, job["reserve_gib"]),
            )
        except Exception as exc:  # one stage's failure is its row; the next stage still runs
            first = (str(exc).strip().splitlines() or [""])[0]
            emit(STAGE, {"status": f"error: {type(exc).__name__}: {first}"[:300]})
        finally:
            if torch.device(job["device"]).type == "cuda":
                torch.cuda.empty_cache()


def kiln_worker_stage(resident, stage: dict, scratch: Path, peak_flops: float, reserve_gib: float) -> dict:
    if stage["stage"] == "kernels":
        from qualification.gpu_bench_kernels import kernel_timings

        return {"kernels": kernel_timings(resident, stage["length"]), "status": "ok"}
    if stage["stage"] == "profile":
        print(profile_stage(resident, stage, scratch), flush=True)
        return {"status": "ok"}
    return kiln_stage(resident, stage, scratch, peak_flops, reserve_gib)
