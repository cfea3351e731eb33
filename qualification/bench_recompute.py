"""What gradient checkpointing costs: FLOPs of one training step per segment count, counted with
`torch.utils.flop_counter.FlopCounterMode` on the CPU.

A few decoder layers at the real 4B widths (GDN and attention alternating, random weights, LoRA
r = 16, bf16) run one forward + backward through `Qwen35Model.hidden_states` for each segment
count; the table gives total FLOPs and the ratio to one segment (no recompute). The trunk only:
the loss head is never recomputed, so a whole step's ratio is lower still.

    .venv/bin/python qualification/bench_recompute.py                    # 4B widths, 4 layers, T = 256
    .venv/bin/python qualification/bench_recompute.py --preset tiny      # the test's shape

Prints a markdown table and, last, `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_activations import DTYPES, bench_config, random_model  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from kiln_train.model.lora import attach_lora  # noqa: E402


class _GlobalOnly:
    """Stands in for FlopCounterMode's module tracker: totals only. The tracker's gradient hooks
    on module inputs cannot follow the autograd.grad calls that rebuild recomputed parts."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def step_flops(model, ids: torch.Tensor, segments: int) -> int:
    """FLOPs of one forward + backward of the trunk with `segments` checkpointed segments."""
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _GlobalOnly()
    with counter:
        hidden = model.hidden_states(ids, num_segments=segments)
        hidden.float().square().mean().backward()
    return counter.get_total_flops()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=("4b", "tiny"), default="4b")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument(
        "--segments", type=int, nargs="*", default=None, help="default: 1, 2, 4, .. up to --layers"
    )
    args = ap.parse_args(argv)
    config = bench_config(args.preset, args.layers)
    model = random_model(config, DTYPES[args.dtype], seed=0)
    attach_lora(model, rank=args.rank, alpha=2.0 * args.rank, seed=0)
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    counts = args.segments or sorted(
        {1} | {2**k for k in range(args.layers.bit_length()) if 2**k <= args.layers}
    )
    if 1 not in counts:
        counts = [1, *counts]
    flops = {s: step_flops(model, ids, s) for s in counts}
    print(
        f"preset {args.preset}, {args.layers} layers, T = {args.seq_len}, LoRA r = {args.rank}, {args.dtype}"
    )
    print("| segments | GFLOP | ratio to one segment |")
    print("|---|---|---|")
    rows = []
    for s in counts:
        ratio = flops[s] / flops[1]
        rows.append({"segments": s, "flops": flops[s], "ratio": round(ratio, 4)})
        print(f"| {s} | {flops[s] / 1e9:,.2f} | {ratio:.3f} |")
    print(
        "RESULT "
        + json.dumps(
            {"preset": args.preset, "layers": args.layers, "seq_len": args.seq_len, "rows": rows},
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
