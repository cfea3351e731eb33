"""Benchmark: one LoRA training step (forward + backward) of the native Qwen3.5 model vs
transformers + PEFT on the same weights.

The step: LoRA rank r (alpha 2r) on the ten targets, frozen base, B = 1 sequence of T random token
ids, next-token cross-entropy over the last half of the positions computed with plain
`F.cross_entropy` on dense logits of those positions only (ours: the head applied to the gathered
hidden rows; transformers: `logits_to_keep`). No optimizer step; gradients are cleared between
steps. B is zero at init on both sides, so both start from the same loss (printed as a check).

Each (side, T) runs in its own subprocess so peak RSS is clean; rounds alternate the sides so
background load on a shared machine hits both alike; the table shows the fastest step over all
timed steps (and the median), peak RSS (VmHWM) or peak CUDA memory, and the ratios ours/theirs.

CPU:
    .venv/bin/python qualification/bench_model.py --preset small --lengths 512 2048
GPU (when a CUDA machine is lent; needs transformers + peft, optionally flash-linear-attention):
    python qualification/bench_model.py --device cuda --preset qwen35-4b-random --lengths 4096
    python qualification/bench_model.py --device cuda --parity      # bf16 logits/grad parity
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kiln_train.model import Qwen35Model, attach_lora, load_model, load_tensors_into  # noqa: E402
from kiln_train.model.config import LORA_TARGET_MODULES, QWEN35_4B_TEXT_CONFIG, parse_config  # noqa: E402
from kiln_train.model.tiny import random_tensors, text_config, wrapper_config, write_tiny_checkpoint  # noqa: E402

# Qwen3.5-4B text shape (docs/model.md#configuration); weights are random, drawn on the device.
QWEN35_4B = {k: v for k, v in QWEN35_4B_TEXT_CONFIG.items() if k != "dtype"}
RANDOM_PRESETS = {"qwen35-4b-random": ("small", QWEN35_4B)}
RESULT_TAG = "RESULT "


# ----- building the two sides --------------------------------------------------------------
def _text(preset: str) -> dict:
    base, overrides = RANDOM_PRESETS.get(preset, (preset, None))
    return text_config(base, overrides)


def build_ours(args, device, dtype):
    if args.model_dir:
        model = load_model(args.model_dir, device=device, dtype=dtype)
    else:
        cfg = parse_config(wrapper_config(_text(args.preset)))
        with torch.device("meta"):
            model = Qwen35Model(cfg, dtype=dtype)
        load_tensors_into(model, random_tensors(cfg, args.seed, dtype=dtype, device=device), device)
    if args.gdn_impl:
        model.set_gdn_impl(args.gdn_impl)
    lora = attach_lora(model, rank=args.rank, alpha=2.0 * args.rank, seed=0)

    def hidden(ids):
        return model.hidden_states(ids, num_segments=args.segments)

    return hidden, model.lm_head_weight, lora.parameters()


def build_theirs(args, device, dtype):
    import peft
    from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if args.model_dir:
        base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device)
    else:
        text = {k: v for k, v in _text(args.preset).items() if k not in ("model_type", "dtype")}
        with torch.device(device):
            base = Qwen3_5ForCausalLM._from_config(Qwen3_5TextConfig(**text), dtype=dtype)
        cfg = parse_config(wrapper_config(_text(args.preset)))
        tensors = random_tensors(cfg, args.seed, dtype=dtype, device=device)
        state = {
            k.replace("model.language_model.", "model."): v
            for k, v in tensors.items()
            if k.startswith("model.")
        }
        missing, unexpected = base.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:
            raise RuntimeError(f"4B random weights do not fit transformers: {missing[:3]} {unexpected[:3]}")
        del tensors, state
    config = peft.LoraConfig(
        r=args.rank, lora_alpha=2.0 * args.rank, target_modules=list(LORA_TARGET_MODULES), lora_dropout=0.0
    )
    model = peft.get_peft_model(base, config)
    text_model = model.base_model.model.model

    def hidden(ids):
        return text_model(input_ids=ids).last_hidden_state

    params = [p for p in model.parameters() if p.requires_grad]
    return hidden, base.lm_head.weight, params


# ----- one worker process ------------------------------------------------------------------
def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def run_worker(args) -> None:
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    build = build_ours if args.worker == "ours" else build_theirs
    hidden, head, params = build(args, device, dtype)
    load_s = time.perf_counter() - t0
    t, half = args.length, args.length // 2
    ids = torch.randint(
        0,
        248000 if head.shape[0] > 248000 else head.shape[0],
        (1, t),
        generator=torch.Generator().manual_seed(args.seed),
    ).to(device)
    targets = ids[0, half + 1 :]

    def step() -> float:
        h = hidden(ids)[:, half:].reshape(-1, head.shape[1])
        logits = F.linear(h, head)[:-1]
        loss = F.cross_entropy(logits.float(), targets)
        loss.backward()
        for p in params:
            p.grad = None
        return loss.item()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    rss_loaded = _rss_kib("VmRSS")
    if device.type == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats()
        loaded_bytes = torch.cuda.memory_allocated()
    losses, times, cpu_times = [], [], []
    for i in range(args.warmup + args.steps):
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step())
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    result = {
        "side": args.worker,
        "length": t,
        "load_s": load_s,
        "step_s": times,
        "cpu_s": cpu_times,
        "loss": losses[0],
        "rss_loaded_mib": rss_loaded / 1024,
        "peak_rss_mib": _rss_kib("VmHWM") / 1024,
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        result["cuda_loaded_gib"] = loaded_bytes / 2**30
        result["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(RESULT_TAG + json.dumps(result), flush=True)


# ----- orchestration -----------------------------------------------------------------------
def _worker_command(args, side: str, length: int, model_dir: str | None) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--length", str(length)]
    cmd += [
        "--preset",
        args.preset,
        "--device",
        args.device,
        "--rank",
        str(args.rank),
        "--seed",
        str(args.seed),
    ]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--segments", str(args.segments)]
    if model_dir:
        cmd += ["--model-dir", model_dir]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.gdn_impl:
        cmd += ["--gdn-impl", args.gdn_impl]
    return cmd


def _run(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise RuntimeError(f"worker failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def run_benchmark(args) -> None:
    model_dir = args.model_dir
    tmp = None
    if model_dir is None and args.preset not in RANDOM_PRESETS:
        tmp = tempfile.TemporaryDirectory(prefix="kiln-bench-")
        model_dir = str(write_tiny_checkpoint(tmp.name, args.preset, seed=args.seed, with_tokenizer=False))
    sides = args.sides.split(",")
    print(
        f"# preset {args.preset} on {args.device}, LoRA r={args.rank}, {args.steps} timed steps x {args.rounds} "
        f"rounds after {args.warmup} warm-up; cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f}"
    )
    rows = []
    for length in args.lengths:
        results: dict[str, list[dict]] = {s: [] for s in sides}
        for _ in range(args.rounds):
            for side in sides:
                r = _run(_worker_command(args, side, length, model_dir))
                results[side].append(r)
                # Each run as it ends, so a run cut off by a time limit still leaves the others.
                print(f"#   done T={length} {side}: {json.dumps(r, sort_keys=True)}", flush=True)
        rows.append((length, results))
        for side in sides:
            r = results[side][-1]
            print(
                f"#   T={length} {side}: loss {r['loss']:.6f}, load {r['load_s']:.1f} s, "
                f"steps {[round(x, 3) for x in sum((x['step_s'] for x in results[side]), [])]}"
            )
    _print_table(args, rows, sides)
    if tmp is not None:
        tmp.cleanup()


def _summary(runs: list[dict]) -> dict:
    steps = sum((r["step_s"] for r in runs), [])
    cpu = sum((r["cpu_s"] for r in runs), [])
    out = {"best": min(steps), "median": statistics.median(steps), "loss": runs[0]["loss"]}
    out["cpu_best"], out["cpu_median"] = min(cpu), statistics.median(cpu)
    out["peak"] = max(r.get("cuda_peak_gib", r["peak_rss_mib"]) for r in runs)
    out["loaded"] = max(r.get("cuda_loaded_gib", r["rss_loaded_mib"]) for r in runs)
    return out


def _print_table(args, rows, sides) -> None:
    unit = "GiB (cuda peak)" if args.device.startswith("cuda") else "MiB (peak RSS)"
    print(
        f"\n| T | side | best step s | median step s | best CPU s | median CPU s | tokens/s | peak {unit} "
        "| after load | loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length, results in rows:
        summaries = {s: _summary(results[s]) for s in sides}
        for side, s in summaries.items():
            print(
                f"| {length} | {side} | {s['best']:.3f} | {s['median']:.3f} | {s['cpu_best']:.3f} | "
                f"{s['cpu_median']:.3f} | {length / s['best']:.0f} | "
                f"{s['peak']:.0f} | {s['loaded']:.0f} | {s['loss']:.5f} |"
            )
        if len(sides) == 2:
            a, b = summaries[sides[0]], summaries[sides[1]]
            print(
                f"| {length} | ratio {sides[0]}/{sides[1]} | {a['best'] / b['best']:.2f} | "
                f"{a['median'] / b['median']:.2f} | {a['cpu_best'] / b['cpu_best']:.2f} | "
                f"{a['cpu_median'] / b['cpu_median']:.2f} | | {a['peak'] / b['peak']:.2f} | | |"
            )


# ----- bf16 parity on CUDA -----------------------------------------------------------------
PARITY_CONFIGS = {
    "tiny_gva2": ("tiny", {"vocab_size": 512, "bos_token_id": None, "eos_token_id": None}),
    "gva3_untied": (
        "tiny",
        {
            "vocab_size": 384,
            "linear_num_value_heads": 6,
            "tie_word_embeddings": False,
            "bos_token_id": None,
            "eos_token_id": None,
        },
    ),
    "small_full_vocab": ("small", {}),
}


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _parity_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; at T = 1 the one position against its own token (a plain sum of
    248k logits would measure bf16 cancellation, not the model)."""
    if ids.shape[1] == 1:
        return F.cross_entropy(logits[0].float(), ids[0])
    return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])


def run_parity(args) -> None:
    """bf16 on CUDA: ours (FLA and torch-chunk GDN) and transformers vs an f32 reference."""
    import peft
    from transformers import AutoModelForCausalLM

    from kiln_train.model.delta_rule import fla_unusable_reason

    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit(
            "--parity compares bf16 on CUDA; the f32 CPU parity lives in tests/kiln_train/model/test_qwen35_parity.py"
        )
    fla_reason = fla_unusable_reason(torch.device("cuda", torch.cuda.current_device()))
    impls = ["chunk"] + (["fla"] if fla_reason is None else [])
    print(f"# bf16 parity on {torch.cuda.get_device_name(device)}; GDN impls {impls}")
    if fla_reason is not None:
        print(f"# fla not used: {fla_reason}")
    print(
        "| config | T | ours impl | ours bf16 vs f32 | transformers bf16 vs f32 | ours vs transformers (bf16) "
        "| LoRA grad rel err ours bf16 vs f32 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (preset, overrides) in PARITY_CONFIGS.items():
        with tempfile.TemporaryDirectory() as d:
            path = write_tiny_checkpoint(d, preset, seed=1, overrides=overrides, with_tokenizer=False)
            ref32 = load_model(path, device=device, dtype=torch.float32)
            ref32.set_gdn_impl("chunk")
            lora32 = attach_lora(ref32, 8, 16.0, 0)
            with torch.no_grad():
                for n, p in lora32.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.05, generator=torch.Generator(device=device).manual_seed(len(n)))
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
            hf = peft.get_peft_model(
                hf,
                peft.LoraConfig(
                    r=8, lora_alpha=16.0, target_modules=list(LORA_TARGET_MODULES), lora_dropout=0.0
                ),
            )
            hf.load_state_dict(
                {
                    k.replace(".weight", ".default.weight"): v.to(torch.bfloat16)
                    for k, v in lora32.state_dict().items()
                },
                strict=False,
            )
            vocab = ref32.config.vocab_size
            # One bf16 model per GDN path for every T (loading one per T doubled the stage's time).
            ours_models = {}
            for impl in impls:
                ours = load_model(path, device=device)
                ours.set_gdn_impl(impl)
                lora = attach_lora(ours, 8, 16.0, 0)
                lora.load_state_dict(lora32.state_dict())
                ours_models[impl] = (ours, lora)
            for t in (1, 100, 300):
                ids = torch.randint(
                    0, min(vocab, 248000), (1, t), generator=torch.Generator().manual_seed(t)
                ).to(device)
                ref_logits = ref32.logits(ids)
                loss = _parity_loss(ref_logits, ids)
                loss.backward()
                ref_grads = {n: p.grad.clone() for n, p in lora32.named_parameters()}
                for p in lora32.parameters():
                    p.grad = None
                with torch.no_grad():
                    theirs = hf(ids).logits
                for impl, (ours, lora) in ours_models.items():
                    logits = ours.logits(ids)
                    loss = _parity_loss(logits, ids)
                    loss.backward()
                    # Leaves whose exact gradient is zero (q/k at T = 1: one key, softmax weight 1)
                    # hold only f32 rounding noise; a relative error of noise is not a measurement.
                    largest = max(g.abs().max().item() for g in ref_grads.values())
                    grad_err = max(
                        _rel(p.grad, ref_grads[n])
                        for n, p in lora.named_parameters()
                        if ref_grads[n].abs().max().item() > 1e-4 * largest
                    )
                    print(
                        f"| {name} | {t} | {impl} | {_rel(logits, ref_logits):.2e} | {_rel(theirs, ref_logits):.2e} "
                        f"| {_rel(logits, theirs):.2e} | {grad_err:.2e} |"
                    )
                    for p in lora.parameters():
                        p.grad = None
            del ours_models


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small", choices=["tiny", "small", *RANDOM_PRESETS])
    parser.add_argument("--model-dir", default=None, help="benchmark this checkpoint instead of a preset")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--segments", type=int, default=1, help="our gradient-checkpoint segments")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--sides", default="ours,transformers")
    parser.add_argument("--gdn-impl", default=None, choices=["auto", "chunk", "recurrent", "fla"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parity", action="store_true", help="bf16 parity table (CUDA)")
    parser.add_argument("--worker", default=None, choices=["ours", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=512, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
    elif args.parity:
        run_parity(args)
    else:
        run_benchmark(args)


if __name__ == "__main__":
    main()
