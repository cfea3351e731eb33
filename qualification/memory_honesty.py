"""Is the admission estimate honest? Real SFT steps measured against `kiln_train.plan.memory.estimate`.

Each case runs in a FRESH subprocess: load the model (a tiny random checkpoint, default preset
`small`), warm the runtime up as the resident worker does at start (`warm_up`: one 16-token
checkpointed step), release freed heap memory, then take the baseline. Then attach LoRA, build the optimizer and run two real training steps
exactly as the trainer does (`hidden_states` with the segment count, `sft_loss` on the route,
`backward`, the gradient dict, `optimizer.step`, grads released), and measure the peak:

- cpu: with the worker's allocator policy (`kiln_train.plan.budget.apply_cpu_allocator_policy`),
  peak RSS (`VmHWM`, reset with `/proc/self/clear_refs` after the baseline) minus the RSS
  at the baseline: what the process really took from the machine, allocator slack included;
- cuda: `torch.cuda.max_memory_allocated()` minus the allocated bytes at the baseline.

A `validation` case prices one held-out validation forward (`forward_estimate`) instead: LoRA
attached, the optimizer state allocated by one short step, then `evaluation.evaluate` on a row
of T tokens without a gradient (docs/validation.md); on cpu the peak RSS is reset after the short
step, so the measured peak is the forward's with the LoRA set and optimizer state resident.

The estimate is priced with `weights_resident=True` (the budget is measured with the model
loaded), so `estimate.total` is compared with the step's own working set. The contract for the
estimate: never below the actual peak; at most 1.3x above it for training rows (kt_tape_flce) of
T >= 2048 (docs/performance.md#estimate).

    .venv/bin/python qualification/memory_honesty.py            # the full CPU table
    .venv/bin/python qualification/memory_honesty.py --quick    # a few cases
    .venv/bin/python qualification/memory_honesty.py --device cuda

The table prints estimate / actual per case and the worst ratios; the exit status is 1 when any
estimate is below its actual peak.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

MIB = 1 << 20


@dataclass(frozen=True)
class Case:
    seq_len: int
    rank: int
    optimizer: str
    segments: int
    route: str = "kt_tape_flce"
    supervised_fraction: float = 0.5
    phase: str = "train"  # or "validation": one forward without a gradient (forward_estimate)

    @property
    def supervised(self) -> int:
        return max(1, int((self.seq_len - 1) * self.supervised_fraction))


def full_cases() -> list[Case]:
    cases = []
    for t in (256, 1024, 2048, 4096):
        cases.append(Case(t, 16, "adam_w", 1))
        cases.append(Case(t, 16, "adam_w", 4))
    for r in (8, 64):
        cases.append(Case(2048, r, "adam_w", 2))
    for opt in ("sgd", "muon"):
        cases.append(Case(2048, 16, opt, 2))
    cases += [
        Case(1024, 64, "muon", 1),
        Case(4096, 8, "sgd", 2),
        Case(4096, 64, "muon", 4),
        Case(2048, 16, "adam_w", 8),
        Case(2048, 16, "adam_w", 1, supervised_fraction=1.0),
        Case(1024, 16, "adam_w", 1, supervised_fraction=0.05),
        Case(256, 16, "sgd", 1, route="full_logits"),
        Case(512, 16, "adam_w", 1, route="full_logits"),
    ]
    for t in (1024, 2048, 4096):
        cases.append(Case(t, 16, "adam_w", 1, phase="validation"))
    cases += [
        Case(2048, 64, "muon", 1, phase="validation", supervised_fraction=1.0),
        Case(512, 16, "adam_w", 1, route="full_logits", phase="validation"),
    ]
    return cases


def quick_cases() -> list[Case]:
    return [
        Case(1024, 16, "adam_w", 1),
        Case(2048, 8, "muon", 4),
        Case(1024, 64, "sgd", 2),
        Case(256, 16, "adam_w", 1, route="full_logits"),
        Case(2048, 16, "adam_w", 1, phase="validation"),
    ]


# ----- the child: one case in a fresh process ----------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _page_size()


def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _release_heap() -> None:
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _make_row(seq_len: int, supervised: int, vocab: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    labels = torch.full((seq_len,), -100, dtype=torch.long)
    # The last `supervised` tokens are assistant tokens (their predecessors are the loss rows).
    labels[seq_len - supervised :] = ids[0, seq_len - supervised :]
    return ids, labels


def train_steps(model, case: Case, device, steps: int, seed: int = 0) -> None:
    """Real steps, as `kiln_train.train.trainer` runs them."""
    from kiln_train.model import attach_lora
    from kiln_train.optim import build_optimizer
    from kiln_train.train.loss import sft_loss

    lora = attach_lora(model, case.rank, float(2 * case.rank), seed)
    named = lora.named_parameters()
    optimizer = build_optimizer(case.optimizer, named, 1e-4)
    try:
        for step in range(steps):
            ids, labels = _make_row(case.seq_len, case.supervised, model.config.vocab_size, seed + step)
            ids, labels = ids.to(device), labels.to(device)
            hidden = model.hidden_states(ids, num_segments=case.segments)
            loss = sft_loss(case.route, hidden, model.lm_head_weight, labels)
            loss.backward()
            grads = {name: p.grad for name, p in named}
            optimizer.step(grads)
            del hidden, loss, grads
            for _, p in named:
                p.grad = None
    finally:
        del optimizer
        lora.remove(model)


def validation_forward(model, case: Case, device, seed: int = 0) -> None:
    """One evaluation of a validation row as the trainer runs it (`evaluation.evaluate`), with the
    LoRA set and the optimizer state of a run in progress resident."""
    import torch

    from kiln_train.data.ingestion import TokenizedRow
    from kiln_train.model import attach_lora
    from kiln_train.optim import build_optimizer
    from kiln_train.train.evaluation import evaluate
    from kiln_train.train.loss import sft_loss

    lora = attach_lora(model, case.rank, float(2 * case.rank), seed)
    named = lora.named_parameters()
    optimizer = build_optimizer(case.optimizer, named, 1e-4)
    try:
        # One short step allocates the optimizer state the forward runs beside.
        ids, labels = _make_row(16, 8, model.config.vocab_size, seed)
        loss = sft_loss(
            case.route, model.hidden_states(ids.to(device)), model.lm_head_weight, labels.to(device)
        )
        loss.backward()
        optimizer.step({name: p.grad for name, p in named})
        del loss
        for _, p in named:
            p.grad = None
        _release_heap()
        if device.type == "cpu":
            _reset_hwm()
        else:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        ids, labels = _make_row(case.seq_len, case.supervised, model.config.vocab_size, seed + 1)
        row = TokenizedRow(1, "sha256:" + "0" * 64, ids[0].tolist(), labels.tolist(), case.supervised)
        evaluate(model, [row], route=case.route, device=device, global_step=1, epoch=0)
    finally:
        del optimizer
        lora.remove(model)


def warm_up(model, device) -> None:
    """What the resident worker does once at start: one 16-token checkpointed step.

    One-time process costs are part of the worker's resident baseline, not of any job: thread
    pools and BLAS buffers, and the ~80 MiB of modules torch.utils.checkpoint imports on its first
    call. Per-shape kernel caches and workspaces of a real row stay in the measurement (the
    estimate charges them as runtime scratch).
    """
    train_steps(model, Case(16, 2, "sgd", 2), device, steps=1, seed=99)


def run_child(model_dir: str, device_name: str, case: Case) -> dict:
    import torch

    from kiln_train.model import load_model
    from kiln_train.plan.budget import apply_cpu_allocator_policy

    torch.manual_seed(0)
    device = torch.device(device_name)
    if device.type == "cpu" and not apply_cpu_allocator_policy():
        raise RuntimeError("the cpu allocator policy could not be applied (not glibc?)")
    model = load_model(model_dir, device=device)
    warm_up(model, device)
    _release_heap()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = _rss_bytes()
        _reset_hwm()
    if case.phase == "validation":
        validation_forward(model, case, device)
    else:
        train_steps(model, case, device, steps=2)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _hwm_bytes()
    return {"actual": max(0, peak - base), "baseline": base}


# ----- the parent --------------------------------------------------------------------------


def estimate_case(model_dir: str, device_name: str, case: Case):
    from kiln_train.ground.backend import backend_for_device
    from kiln_train.model.config import load_config
    from kiln_train.plan.memory import estimate, forward_estimate

    if case.phase == "validation":
        return forward_estimate(
            load_config(model_dir),
            max_seq_len=case.seq_len,
            max_supervised_tokens=case.supervised,
            lora_rank=case.rank,
            optimizer_kind=case.optimizer,
            loss_route=case.route,
            backend=backend_for_device(device_name),
            weights_resident=True,
        )
    return estimate(
        load_config(model_dir),
        max_seq_len=case.seq_len,
        max_supervised_tokens=case.supervised,
        lora_rank=case.rank,
        optimizer_kind=case.optimizer,
        num_segments=case.segments,
        loss_route=case.route,
        backend=backend_for_device(device_name),
        weights_resident=True,
    )


def measure(model_dir: str, device_name: str, case: Case) -> int:
    """Run one case in a fresh interpreter; returns the actual peak bytes."""
    cmd = [sys.executable, __file__, "--child", json.dumps(asdict(case)), "--model-dir", model_dir]
    cmd += ["--device", device_name]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{out.stderr[-4000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["actual"])


def run_table(model_dir: str, device_name: str, cases: list[Case]) -> list[dict]:
    rows = []
    print(
        f"{'T':>6} {'A':>6} {'rank':>5} {'optimizer':>9} {'seg':>4} {'route':>13} {'phase':>10} "
        f"{'estimate MiB':>13} {'actual MiB':>11} {'est/act':>8}",
        flush=True,
    )
    for case in cases:
        est = estimate_case(model_dir, device_name, case).total
        act = measure(model_dir, device_name, case)
        ratio = est / act if act else float("inf")
        rows.append(
            {**asdict(case), "supervised": case.supervised, "estimate": est, "actual": act, "ratio": ratio}
        )
        flag = "  UNDER" if est < act else ""
        print(
            f"{case.seq_len:>6} {case.supervised:>6} {case.rank:>5} {case.optimizer:>9} {case.segments:>4} "
            f"{case.route:>13} {case.phase:>10} {est / MIB:>13.1f} {act / MIB:>11.1f} {ratio:>8.2f}{flag}",
            flush=True,
        )
    return rows


def summarize(rows: list[dict]) -> str:
    worst_under = min(r["ratio"] for r in rows)
    long_rows = [
        r
        for r in rows
        if r["seq_len"] >= 2048 and r.get("route") == "kt_tape_flce" and r.get("phase", "train") == "train"
    ]
    worst_over = max((r["ratio"] for r in long_rows), default=float("nan"))
    return (
        f"lowest estimate/actual (must be >= 1): {worst_under:.2f}; "
        f"highest estimate/actual for kt_tape_flce training, T >= 2048 (target <= 1.3): {worst_over:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-dir")
    parser.add_argument("--child")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.model_dir, args.device, Case(**json.loads(args.child)))))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from kiln_train.model.tiny import write_tiny_checkpoint

            model_dir = str(write_tiny_checkpoint(Path(tmp) / args.preset, args.preset, with_tokenizer=False))
        rows = run_table(model_dir, args.device, quick_cases() if args.quick else full_cases())
    print(summarize(rows))
    return 0 if all(r["estimate"] >= r["actual"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
