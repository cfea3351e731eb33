"""Parity with transformers + PEFT at the real Qwen3.5-4B widths, on the CPU, in f32.

    .venv/bin/python qualification/parity_4b_widths.py [--layers 4] [--lengths 1 65 300]

The tests compare against transformers on many small shapes; this checks the real widths
(hidden 2560, 16 query heads of 256 with 4 KV heads, GDN 16 key heads x 128 -> 32 value heads x
128, MLP 9216, the full 248,320-token vocabulary, tied head) with the first `--layers` layers of
the 4B pattern (three Gated DeltaNet layers, then full attention), random weights with non-zero
norm offsets and non-zero LoRA B, so that every module and every LoRA leaf matters. It prints,
per T: max |logit difference| / max |logit| and the worst relative LoRA-gradient difference (CE
loss), ours vs transformers + PEFT on the same weights. Pass: logits <= 1e-5, gradients <= 1e-4.
Memory: about 2 x 4.4 GB of f32 weights for 4 layers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kiln_train.model import attach_lora, load_model  # noqa: E402
from kiln_train.model.config import LORA_TARGET_MODULES, QWEN35_4B_TEXT_CONFIG  # noqa: E402
from kiln_train.model.tiny import write_tiny_checkpoint  # noqa: E402

RANK, ALPHA = 16, 32.0
LOGIT_TOL, GRAD_TOL = 1e-5, 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if ids.shape[1] == 1:
        return F.cross_entropy(logits[0], ids[0])
    return F.cross_entropy(logits[0, :-1], ids[0, 1:])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 65, 300])
    args = parser.parse_args()

    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    overrides = {k: v for k, v in QWEN35_4B_TEXT_CONFIG.items() if k not in ("dtype", "rope_parameters")}
    overrides.update(num_hidden_layers=args.layers, bos_token_id=None, eos_token_id=None)
    overrides["rope_theta"] = QWEN35_4B_TEXT_CONFIG["rope_parameters"]["rope_theta"]
    overrides["partial_rotary_factor"] = QWEN35_4B_TEXT_CONFIG["rope_parameters"]["partial_rotary_factor"]
    failed = False
    with tempfile.TemporaryDirectory(prefix="kiln-4b-widths-") as d:
        t0 = time.perf_counter()
        path = write_tiny_checkpoint(d, "small", seed=3, overrides=overrides, with_tokenizer=False)
        ours = load_model(path)
        cfg = ours.config
        print(
            f"# Qwen3.5-4B widths, {args.layers} layers {cfg.layer_types}, vocab {cfg.vocab_size}, "
            f"tied {cfg.tie_word_embeddings}; f32 CPU, LoRA r={RANK}; threads {torch.get_num_threads()}; "
            f"checkpoint written and loaded in {time.perf_counter() - t0:.1f} s"
        )
        lora = attach_lora(ours, RANK, ALPHA, 0)
        with torch.no_grad():
            for i, (_, p) in enumerate(sorted(lora.named_parameters())):
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(i))
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        theirs = peft.get_peft_model(
            theirs,
            peft.LoraConfig(
                r=RANK, lora_alpha=ALPHA, target_modules=list(LORA_TARGET_MODULES), lora_dropout=0.0
            ),
        )
        ours_state = dict(lora.named_parameters())
        peft_params = {
            n.replace(".default.weight", ".weight"): p
            for n, p in theirs.named_parameters()
            if p.requires_grad
        }
        missing = sorted(set(ours_state) ^ set(peft_params))
        if missing:
            raise SystemExit(f"LoRA leaves differ between the sides: {missing[:6]}")
        with torch.no_grad():
            for n, p in peft_params.items():
                p.copy_(ours_state[n])
        print("| T | logits rel diff | worst LoRA grad rel diff | leaf | ours s | theirs s |")
        print("|---|---|---|---|---|---|")
        for t in args.lengths:
            ids = torch.randint(0, cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(t))
            for p in (*ours_state.values(), *peft_params.values()):
                p.grad = None
            t1 = time.perf_counter()
            logits = ours.logits(ids)
            _loss(logits, ids).backward()
            t2 = time.perf_counter()
            ref = theirs(input_ids=ids).logits
            _loss(ref, ids).backward()
            t3 = time.perf_counter()
            logit_err = _rel(logits.detach(), ref.detach())
            largest = max(p.grad.abs().max().item() for p in peft_params.values())
            grad_errs = {
                n: _rel(ours_state[n].grad, p.grad)
                for n, p in peft_params.items()
                if p.grad.abs().max().item() > 1e-4 * largest  # exact-zero leaves hold only noise
            }
            leaf, grad_err = max(grad_errs.items(), key=lambda kv: kv[1])
            failed |= logit_err > LOGIT_TOL or grad_err > GRAD_TOL
            print(
                f"| {t} | {logit_err:.2e} | {grad_err:.2e} | {leaf} | {t2 - t1:.1f} | {t3 - t2:.1f} |",
                flush=True,
            )
    print("verdict:", "FAIL" if failed else "pass", f"(logits <= {LOGIT_TOL:g}, gradients <= {GRAD_TOL:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
