"""Adapter canaries (`adapter_smoke_test`, docs/artifacts.md#canaries).

For each prompt (raw text, no chat template): last-position logits of the base model and of the
model with the adapter, then a short greedy generation with and without the adapter (output ends
before the first end-of-sequence token, so a model that stops at once has empty output). Runs under
`torch.inference_mode()`, outside any training scope.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch

NEW_TOKENS = 4
MAX_OUTPUT_CHARS = 512
LOGIT_DELTA_FLOOR = 1e-6
LATENCY_FACTOR, LATENCY_SLACK_MS = 4.0, 500.0


@contextmanager
def lora_disabled(model: torch.nn.Module):
    """Detach every LoRA pair for the duration (the base model exactly), then reattach it."""
    stash = []
    for module in model.modules():
        if getattr(module, "lora_A", None) is not None:
            stash.append((module, module.lora_A, module.lora_B, module.lora_scale))
            module.clear_lora()
    try:
        yield
    finally:
        for module, a, b, scale in stash:
            module.set_lora(a, b, scale)


# End-of-sequence tokens of the Qwen chat vocabulary; generation stops at the first one.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def stop_token_ids(model, tokenizer) -> frozenset[int]:
    """Token ids that end a greedy generation: the model's `eos_token_id` and the tokenizer's
    end-of-turn / end-of-text specials (whichever exist)."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if isinstance(eos, int) and not isinstance(eos, bool):
        ids.add(eos)
    lookup = getattr(tokenizer, "token_to_id", None)
    if callable(lookup):
        for token in STOP_TOKENS:
            tid = lookup(token)
            if isinstance(tid, int):
                ids.add(tid)
    return frozenset(ids)


def _greedy(model, ids: list[int], n: int) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = list(ids)
    device = next(iter(model.buffers())).device
    for _ in range(n):
        logits = model.logits(torch.tensor([out], device=device))[0, -1]
        out.append(int(torch.argmax(logits.float())))
    return out[len(ids) :], (time.perf_counter() - t0) * 1000.0


def until_stop(tokens: list[int], stop: frozenset[int]) -> list[int]:
    """The generated tokens before the first end-of-sequence token (which is not output)."""
    for i, token in enumerate(tokens):
        if token in stop:
            return tokens[:i]
    return tokens


def _outcome(finite: bool, delta: float | None, text_changed: bool, adapter_text: str) -> tuple[str, str]:
    if not finite:
        return "non_finite_logits", "base or adapter logits contain NaN/Inf"
    if not adapter_text.strip():
        return "empty_adapter_output", "the adapter generated only whitespace or nothing"
    changed = delta is not None and delta > LOGIT_DELTA_FLOOR
    if changed and text_changed:
        return "logits_changed_text_changed", "the adapter moved the logits and changed the greedy text"
    if changed:
        return "logits_changed_text_identical", "the adapter moved the logits; greedy text is unchanged"
    if text_changed:
        return "text_changed_without_measurable_logit_delta", "text differs with no measurable logit delta"
    return "no_logit_change", "the adapter did not measurably change the last-position logits"


def run_smoke_test(model, tokenizer, prompts: list[str]) -> dict:
    """The receipt's `adapter_smoke_test` object; never raises (an error becomes a warning)."""
    try:
        return _smoke(model, tokenizer, prompts)
    except Exception as exc:  # the canary is evidence, not a gate on the run itself
        return {
            "enabled": True,
            "passed": False,
            "warnings": [f"smoke test failed to run: {exc}"],
            "prompts": [],
        }


def _smoke(model, tokenizer, prompts: list[str]) -> dict:
    warnings, results, diagnostics = [], [], []
    if not prompts:
        warnings.append("no prompts")
    device = next(iter(model.buffers())).device
    stop = stop_token_ids(model, tokenizer)
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids or [0]
            x = torch.tensor([ids], device=device)
            with lora_disabled(model):
                base_logits = model.logits(x)[0, -1].double()
                base_ids, base_ms = _greedy(model, ids, NEW_TOKENS)
                base_ids = until_stop(base_ids, stop)
            adapter_logits = model.logits(x)[0, -1].double()
            adapter_ids, adapter_ms = _greedy(model, ids, NEW_TOKENS)
            adapter_ids = until_stop(adapter_ids, stop)
            finite = bool(torch.isfinite(base_logits).all() and torch.isfinite(adapter_logits).all())
            delta = float((adapter_logits - base_logits).norm()) if finite else None
            base_text = tokenizer.decode(base_ids, skip_special_tokens=False)
            adapter_text = tokenizer.decode(adapter_ids, skip_special_tokens=False)
            outcome, explanation = _outcome(finite, delta, base_ids != adapter_ids, adapter_text)
            results.append(
                {
                    "prompt": prompt,
                    "finite_logits": finite,
                    "logit_delta_l2": delta if delta is None or math.isfinite(delta) else None,
                    "generated_text_different": base_ids != adapter_ids,
                    "base_output": base_text,
                    "adapter_output": adapter_text,
                    "adapter_output_tokens": len(adapter_ids),
                    "adapter_output_chars": len(adapter_text),
                    "base_generation_ms": round(base_ms, 3),
                    "adapter_generation_ms": round(adapter_ms, 3),
                }
            )
            diagnostics.append({"prompt": prompt, "outcome": outcome, "explanation": explanation})
            if not finite:
                warnings.append(f"non-finite logits for prompt {prompt!r}")
            if len(adapter_ids) > NEW_TOKENS or len(adapter_text) > MAX_OUTPUT_CHARS:
                warnings.append(f"adapter output too long for prompt {prompt!r}")
            if adapter_ms > base_ms * LATENCY_FACTOR + LATENCY_SLACK_MS:
                warnings.append(f"adapter generation latency regression for prompt {prompt!r}")
    if results and not any((r["logit_delta_l2"] or 0.0) > LOGIT_DELTA_FLOOR for r in results):
        warnings.append("no prompt shows a logit delta above 1e-06: the adapter may be a no-op")
    return {
        "enabled": True,
        "passed": not warnings,
        "warnings": warnings,
        "prompt_diagnostics": diagnostics,
        "prompts": results,
    }


def canary_status(smoke: dict) -> dict:
    """`adapter_canary_status.json`: the derived canary checks.

    A check holds only on evidence: with no prompt run (an empty list, or a smoke test that failed
    to run) every check is false, and `simple_tool_call_shaped_prompt` needs a tool-call prompt whose
    adapter output is non-empty with finite logits, not merely the prompt's presence.
    """
    prompts = smoke.get("prompts", [])
    ran = bool(prompts)
    tool_prompts = [p for p in prompts if "tool call" in p["prompt"].lower()]
    return {
        "schema_version": 1,
        "passed": smoke.get("passed", False),
        "checks": {
            "simple_short_completion": ran and prompts[0]["adapter_output_tokens"] > 0,
            "simple_tool_call_shaped_prompt": bool(tool_prompts)
            and all(p["finite_logits"] and p["adapter_output_tokens"] > 0 for p in tool_prompts),
            "output_length_sanity": ran
            and all(
                p["adapter_output_tokens"] <= NEW_TOKENS and p["adapter_output_chars"] <= MAX_OUTPUT_CHARS
                for p in prompts
            ),
            "finite_logits": ran and all(p["finite_logits"] for p in prompts),
            "latency_sanity": ran
            and all(
                p["adapter_generation_ms"] <= p["base_generation_ms"] * LATENCY_FACTOR + LATENCY_SLACK_MS
                for p in prompts
            ),
            "nonzero_logit_delta_from_base": any(
                (p["logit_delta_l2"] or 0.0) > LOGIT_DELTA_FLOOR for p in prompts
            ),
        },
    }
