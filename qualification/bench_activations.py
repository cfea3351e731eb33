"""Saved-for-backward bytes per token per layer of the native model, by layer kind.

Builds a few decoder layers of Qwen3.5 at the real 4B widths (one Gated DeltaNet layer and one
gated-attention layer by default, random weights) in bf16 on the CPU, attaches LoRA, runs one
forward under `torch.autograd.graph.saved_tensors_hooks` and records every tensor autograd keeps
for backward. Storage is counted once however often it is saved (views of one tensor, the one
input of several projections), weights and LoRA leaves are not activations and are skipped. Each
saved tensor is charged to the innermost module running when it was saved:

    norms      a block or q/k RMSNorm that saves on its own
    gdn        the linear_attn mixer (its projection groups, conv, gates, delta rule, output norm)
    attention  the self_attn mixer (its projection groups, q/k norms, RoPE, SDPA, output gate)
    mlp        the SwiGLU MLP
    lora       a LoRA projection that saves on its own
    layer      the decoder layer itself

The model fuses each block norm and every LoRA projection into the projection group that calls
them (kiln_train/model/recompute.py), so their inputs are charged to the mixer or the MLP and
the norms and lora rows read 0; before that fusion they kept their own copies.

It prints one row per kind and per whole layer (bytes / token / layer) beside the derived
minimum (docs/performance.md#saved-activations), then `RESULT {json}`.

    .venv/bin/python qualification/bench_activations.py                 # 4B widths, T = 256
    .venv/bin/python qualification/bench_activations.py --preset tiny   # the test's shape
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln_train.model.config import (  # noqa: E402
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    QWEN35_4B_TEXT_CONFIG,
    Qwen35Config,
    parse_config,
)
from kiln_train.model.linear import FrozenLinear  # noqa: E402
from kiln_train.model.lora import attach_lora  # noqa: E402
from kiln_train.model.norms import OffsetRMSNorm  # noqa: E402
from kiln_train.model.qwen35 import Qwen35Model  # noqa: E402
from kiln_train.plan.formulas import minimum_saved_bytes_per_token  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
KINDS = ("norms", "gdn", "attention", "mlp", "lora", "layer")
TINY = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}


def bench_config(preset: str, layers: int) -> Qwen35Config:
    """The 4B text config (or tiny widths) with `layers` layers, a full-attention layer every 2nd."""
    raw = dict(QWEN35_4B_TEXT_CONFIG, vocab_size=512, num_hidden_layers=layers)
    if preset == "tiny":
        raw.update(TINY)
    raw["layer_types"] = [FULL_ATTENTION if i % 2 else LINEAR_ATTENTION for i in range(layers)]
    return parse_config(raw)


def random_model(config: Qwen35Config, dtype: torch.dtype, seed: int) -> Qwen35Model:
    gen = torch.Generator().manual_seed(seed)
    model = Qwen35Model(config, dtype=dtype)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("A_log"):
                value = torch.empty(buf.shape).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
                value = 1.0 + 0.1 * torch.randn(buf.shape, generator=gen)
            elif buf.dim() == 1:
                value = 0.1 * torch.randn(buf.shape, generator=gen)
            elif name.endswith("conv1d.weight"):
                value = torch.empty(buf.shape).uniform_(-0.5, 0.5, generator=gen)
            else:
                value = 0.02 * torch.randn(buf.shape, generator=gen)
            buf.copy_(value.to(dtype))
    return model


class SavedBytes:
    """Pack hook + module hooks: unique saved storage bytes by (layer index, kind)."""

    def __init__(self, model: Qwen35Model) -> None:
        self.stack: list[tuple[int | None, str]] = []
        self.seen: set[int] = set()
        self.bytes: dict[tuple[int | None, str], int] = {}
        self.skip = {t.untyped_storage().data_ptr() for t in model.buffers()}
        self.skip |= {p.untyped_storage().data_ptr() for p in model.parameters()}
        if model.lora is not None:
            self.skip |= {p.untyped_storage().data_ptr() for p in model.lora.parameters()}
        self.handles = []
        for name, module in model.named_modules():
            region = self._region(name, module)
            if region is not None:
                self.handles.append(module.register_forward_pre_hook(self._enter(region)))
                self.handles.append(module.register_forward_hook(self._leave))

    @staticmethod
    def _region(name: str, module) -> tuple[int | None, str] | None:
        parts = name.split(".")
        if len(parts) < 2 or parts[0] != "layers":
            return None
        layer = int(parts[1])
        if len(parts) == 2:
            return layer, "layer"
        if isinstance(module, FrozenLinear):
            return layer, "lora"
        if isinstance(module, OffsetRMSNorm):
            return layer, "norms"
        kind = {"linear_attn": "gdn", "self_attn": "attention", "mlp": "mlp"}.get(parts[2])
        return (layer, kind) if kind else None

    def _enter(self, region):
        def hook(module, args):
            self.stack.append(region)

        return hook

    def _leave(self, module, args, output):
        self.stack.pop()

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            self.seen.add(ptr)
            key = self.stack[-1] if self.stack else (None, "outside")
            self.bytes[key] = self.bytes.get(key, 0) + storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def measure(config: Qwen35Config, seq_len: int, rank: int, dtype: torch.dtype, segments: int = 1) -> dict:
    """Saved bytes per token per layer: by kind (averaged over the layers that have it) and by
    whole layer kind (GDN layer, attention layer)."""
    model = random_model(config, dtype, seed=0)
    attach_lora(model, rank=rank, alpha=2.0 * rank, seed=0)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    counter = SavedBytes(model)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        hidden = model.hidden_states(ids, num_segments=segments)
    hidden.float().square().mean().backward()  # the graph is real: backward runs through it
    for handle in counter.handles:
        handle.remove()
    types = config.layer_types
    count = {LINEAR_ATTENTION: types.count(LINEAR_ATTENTION), FULL_ATTENTION: types.count(FULL_ATTENTION)}
    per_layer = {LINEAR_ATTENTION: 0, FULL_ATTENTION: 0}
    by_kind = dict.fromkeys(KINDS, 0)
    for (layer, kind), n in counter.bytes.items():
        if layer is None:
            continue
        per_layer[types[layer]] += n
        by_kind[kind] += n
    per_token = {}
    for kind, n in by_kind.items():
        layers = {"gdn": count[LINEAR_ATTENTION], "attention": count[FULL_ATTENTION]}.get(kind, len(types))
        per_token[kind] = n / seq_len / max(1, layers)
    gdn = per_layer[LINEAR_ATTENTION] / seq_len / max(1, count[LINEAR_ATTENTION])
    attn = per_layer[FULL_ATTENTION] / seq_len / max(1, count[FULL_ATTENTION])
    return {"by_kind": per_token, "gdn_layer": gdn, "attention_layer": attn}


def layout_mean(gdn: float, attn: float, config: Qwen35Config) -> float:
    """Mean per layer over the real 4B layout (a full-attention layer every 4th: 24 GDN + 8)."""
    types = parse_config(QWEN35_4B_TEXT_CONFIG).layer_types
    n_attn = types.count(FULL_ATTENTION)
    return (gdn * (len(types) - n_attn) + attn * n_attn) / len(types)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=("4b", "tiny"), default="4b")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    config = bench_config(args.preset, args.layers)
    dtype = DTYPES[args.dtype]
    e = torch.finfo(dtype).bits // 8
    got = measure(config, args.seq_len, args.rank, dtype)
    minimum = {
        "gdn_layer": minimum_saved_bytes_per_token(config, LINEAR_ATTENTION, e),
        "attention_layer": minimum_saved_bytes_per_token(config, FULL_ATTENTION, e),
    }
    got["mean_layer"] = layout_mean(got["gdn_layer"], got["attention_layer"], config)
    minimum["mean_layer"] = layout_mean(minimum["gdn_layer"], minimum["attention_layer"], config)
    print(
        f"preset {args.preset}, T = {args.seq_len}, LoRA r = {args.rank}, {args.dtype}; bytes / token / layer"
    )
    print("| kind | saved | minimum | saved / minimum |")
    print("|---|---|---|---|")
    for kind in KINDS:
        print(f"| {kind} | {got['by_kind'][kind]:,.0f} | | |")
    for row in ("gdn_layer", "attention_layer", "mean_layer"):
        print(f"| {row} | {got[row]:,.0f} | {minimum[row]:,.0f} | {got[row] / minimum[row]:.2f} |")
    result = {
        "preset": args.preset,
        "seq_len": args.seq_len,
        "rank": args.rank,
        "dtype": args.dtype,
        "saved": {k: round(v) for k, v in got["by_kind"].items()} | {row: round(got[row]) for row in minimum},
        "minimum": {k: round(v) for k, v in minimum.items()},
    }
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
