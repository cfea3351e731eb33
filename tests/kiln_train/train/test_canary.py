"""Adapter canaries: `adapter_smoke_test` and `adapter_canary_status.json` (docs/artifacts.md#canaries)."""

from __future__ import annotations

import pytest
import torch

from kiln_train.data.tokenizer import ENDOFTEXT_ID, IM_END_ID
from kiln_train.model import attach_lora
from kiln_train.sft_config import BUILTIN_SMOKE_PROMPTS
from kiln_train.train import canary
from kiln_train.train.canary import canary_status, run_smoke_test, stop_token_ids
from kiln_train.train.resident import load_resident
from kiln_train.train.scope import TRAINING_SCOPE
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, read_json, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_KEYS = {
    "prompt",
    "finite_logits",
    "logit_delta_l2",
    "generated_text_different",
    "base_output",
    "adapter_output",
    "adapter_output_tokens",
    "adapter_output_chars",
    "base_generation_ms",
    "adapter_generation_ms",
}
OUTCOMES = {
    "non_finite_logits",
    "empty_adapter_output",
    "logits_changed_text_changed",
    "logits_changed_text_identical",
    "text_changed_without_measurable_logit_delta",
    "no_logit_change",
}
CHECKS = {
    "simple_short_completion",
    "simple_tool_call_shaped_prompt",
    "output_length_sanity",
    "finite_logits",
    "latency_sanity",
    "nonzero_logit_delta_from_base",
}


@pytest.fixture(scope="module")
def ingestion(resident):
    return ingest(resident, conversations(3))


def _latency_only(warnings: list[str]) -> bool:
    # Generation timing on a shared CI machine is noise; every other warning is a real finding.
    return all("latency regression" in w for w in warnings)


def _check_shape(smoke: dict, prompts: list[str]) -> None:
    assert smoke["enabled"] is True
    assert smoke["passed"] is (not smoke["warnings"])
    assert [p["prompt"] for p in smoke["prompts"]] == prompts
    assert [d["prompt"] for d in smoke["prompt_diagnostics"]] == prompts
    for p, d in zip(smoke["prompts"], smoke["prompt_diagnostics"], strict=True):
        assert set(p) == PROMPT_KEYS
        assert d["outcome"] in OUTCOMES and d["explanation"]
        assert 0 <= p["adapter_output_tokens"] <= canary.NEW_TOKENS  # generation stops at end of sequence
        assert p["adapter_output_chars"] == len(p["adapter_output"])
        assert p["base_generation_ms"] >= 0 and p["adapter_generation_ms"] >= 0


def test_the_built_in_canaries_run_after_a_successful_run(resident, ingestion, tmp_path):
    config = make_config(seed=2, epochs=2, learning_rate=5e-3, adapter_smoke_test=True)
    result = train(resident, config, ingestion, tmp_path, adapter_name="canaried")
    assert result.status == "success", result.failure_message
    smoke = result.receipt["adapter_smoke_test"]
    _check_shape(smoke, list(BUILTIN_SMOKE_PROMPTS))
    assert _latency_only(smoke["warnings"]), smoke["warnings"]
    for p, d in zip(smoke["prompts"], smoke["prompt_diagnostics"], strict=True):
        assert p["finite_logits"] is True and p["logit_delta_l2"] > 1e-6  # the adapter is trained
        assert d["outcome"] == (
            "logits_changed_text_changed"
            if p["generated_text_different"]
            else "logits_changed_text_identical"
        )
    path = result.adapter_path
    assert read_json(path / "train_receipt.json")["adapter_smoke_test"] == smoke
    status = read_json(path / "adapter_canary_status.json")
    assert status == canary_status(smoke)
    assert set(status["checks"]) == CHECKS and status["passed"] is smoke["passed"]
    assert status["checks"]["finite_logits"] and status["checks"]["nonzero_logit_delta_from_base"]
    assert status["checks"]["simple_tool_call_shaped_prompt"] and status["checks"]["output_length_sanity"]
    assert status["checks"]["simple_short_completion"]


def test_custom_prompts_replace_the_built_in_ones(resident, ingestion, tmp_path):
    prompts = ["Say hi.", "Return a tool call for a lookup:"]
    config = make_config(seed=2, epochs=1, adapter_smoke_test=True, adapter_smoke_prompts=prompts)
    result = train(resident, config, ingestion, tmp_path)
    smoke = result.receipt["adapter_smoke_test"]
    _check_shape(smoke, prompts)
    assert result.receipt["config"]["adapter_smoke_prompts"] == prompts


def test_the_canary_compares_against_the_exact_base_model_in_inference_mode(resident, monkeypatch):
    """Base logits are the model without LoRA; everything runs under inference mode, no training scope."""
    model = resident.model
    ids = resident.tokenizer.encode("Say hi.", add_special_tokens=False).ids
    with torch.no_grad():
        base_last = model.logits(torch.tensor([ids]))[0, -1].double()
    lora = attach_lora(model, 2, 4.0, seed=0)
    try:
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if name.endswith("lora_B.weight"):
                    p.fill_(0.02)
            adapter_last = model.logits(torch.tensor([ids]))[0, -1].double()
        modes = []
        real_logits = type(model).logits

        def logits(self, *a, **k):
            modes.append((torch.is_inference_mode_enabled(), TRAINING_SCOPE.get()))
            return real_logits(self, *a, **k)

        monkeypatch.setattr(type(model), "logits", logits)
        smoke = run_smoke_test(model, resident.tokenizer, ["Say hi."])
        assert modes and set(modes) == {(True, False)}
        want = (adapter_last - base_last).norm().item()
        assert smoke["prompts"][0]["logit_delta_l2"] == pytest.approx(want, rel=1e-6)
        assert model.lora is lora and all(m.lora_A is not None for m in lora._modules.values())  # reattached
    finally:
        lora.remove(model)


def test_an_adapter_that_changes_nothing_warns(resident):
    lora = attach_lora(resident.model, 2, 4.0, seed=0)  # B = 0: the adapter is the identity
    try:
        smoke = run_smoke_test(resident.model, resident.tokenizer, ["Say hi.", "Name a color:"])
    finally:
        lora.remove(resident.model)
    assert smoke["passed"] is False
    assert "no prompt shows a logit delta above 1e-06: the adapter may be a no-op" in smoke["warnings"]
    assert [d["outcome"] for d in smoke["prompt_diagnostics"]] == ["no_logit_change"] * 2
    assert all(p["logit_delta_l2"] == 0.0 and not p["generated_text_different"] for p in smoke["prompts"])
    assert canary_status(smoke)["checks"]["nonzero_logit_delta_from_base"] is False


def test_non_finite_logits_are_reported(tiny_dir):
    copy = load_resident(tiny_dir)
    with torch.no_grad():
        copy.model.norm.weight.fill_(float("nan"))
    lora = attach_lora(copy.model, 2, 4.0, seed=0)
    smoke = run_smoke_test(copy.model, copy.tokenizer, ["Say hi."])
    lora.remove(copy.model)
    assert smoke["passed"] is False
    assert smoke["prompts"][0]["finite_logits"] is False and smoke["prompts"][0]["logit_delta_l2"] is None
    assert smoke["prompt_diagnostics"][0]["outcome"] == "non_finite_logits"
    assert "non-finite logits for prompt 'Say hi.'" in smoke["warnings"]
    assert canary_status(smoke)["checks"]["finite_logits"] is False


def test_a_slow_adapter_is_a_latency_regression(resident, monkeypatch):
    timings = iter([10.0, 10.0 * canary.LATENCY_FACTOR + canary.LATENCY_SLACK_MS + 1.0])
    real_greedy = canary._greedy
    monkeypatch.setattr(canary, "_greedy", lambda m, ids, n: (real_greedy(m, ids, n)[0], next(timings)))
    lora = attach_lora(resident.model, 2, 4.0, seed=0)
    try:
        smoke = run_smoke_test(resident.model, resident.tokenizer, ["Say hi."])
    finally:
        lora.remove(resident.model)
    assert "adapter generation latency regression for prompt 'Say hi.'" in smoke["warnings"]
    assert canary_status(smoke)["checks"]["latency_sanity"] is False


def test_a_canary_that_cannot_run_fails_closed_without_failing_the_job(resident):
    class Broken:
        def encode(self, *a, **k):
            raise RuntimeError("tokenizer gone")

    smoke = run_smoke_test(resident.model, Broken(), ["Say hi."])
    assert smoke == {
        "enabled": True,
        "passed": False,
        "warnings": ["smoke test failed to run: tokenizer gone"],
        "prompts": [],
    }
    status = canary_status(smoke)
    assert status["passed"] is False and status["checks"]["simple_short_completion"] is False


@pytest.mark.parametrize(
    ("finite", "delta", "changed", "text", "outcome"),
    [
        (False, None, False, "x", "non_finite_logits"),
        (True, 1.0, True, "  ", "empty_adapter_output"),
        (True, 1.0, True, "x", "logits_changed_text_changed"),
        (True, 1.0, False, "x", "logits_changed_text_identical"),
        (True, 1e-9, True, "x", "text_changed_without_measurable_logit_delta"),
        (True, 0.0, False, "x", "no_logit_change"),
    ],
)
def test_each_outcome(finite, delta, changed, text, outcome):
    got, explanation = canary._outcome(finite, delta, changed, text)
    assert got == outcome and explanation


# ----- odd prompts, an immediately-EOS model, no mutation -----------------------------------------


@pytest.fixture
def adapter(resident):
    lora = attach_lora(resident.model, 2, 4.0, seed=0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if name.endswith("lora_B.weight"):
                p.fill_(0.02)
    yield lora
    lora.remove(resident.model)


def test_stop_ids_are_the_end_of_turn_and_end_of_text_tokens(resident):
    stop = stop_token_ids(resident.model, resident.tokenizer)
    assert {IM_END_ID, ENDOFTEXT_ID} <= stop


def test_a_model_that_emits_eos_at_once_has_empty_output(resident, adapter, monkeypatch):
    model = resident.model
    real = type(model).logits

    def eos_first(self, *a, **k):
        out = real(self, *a, **k).clone()
        out[..., IM_END_ID] = out.abs().max() * 10 + 100
        return out

    monkeypatch.setattr(type(model), "logits", eos_first)
    smoke = run_smoke_test(model, resident.tokenizer, ["Name a color:"])
    p = smoke["prompts"][0]
    assert p["adapter_output"] == "" and p["base_output"] == ""
    assert p["adapter_output_tokens"] == 0 and p["adapter_output_chars"] == 0
    assert p["generated_text_different"] is False and p["finite_logits"] is True
    assert smoke["prompt_diagnostics"][0]["outcome"] == "empty_adapter_output"
    assert canary_status(smoke)["checks"]["simple_short_completion"] is False
    assert canary_status(smoke)["checks"]["output_length_sanity"] is True


def test_odd_prompts_run_and_leave_trained_tensors_untouched(resident, adapter, monkeypatch):
    model = resident.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    versions = {n: p._version for n, p in model.named_parameters()}
    prompts = [
        "Ünïcödé — 名前は? 🙂",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "word " * 600,
        "x",
    ]
    modes = []
    real = type(model).logits

    def spy(self, *a, **k):
        modes.append(torch.is_inference_mode_enabled())
        return real(self, *a, **k)

    monkeypatch.setattr(type(model), "logits", spy)
    smoke = run_smoke_test(model, resident.tokenizer, prompts)
    assert [p["prompt"] for p in smoke["prompts"]] == prompts
    assert all(m is True for m in modes) and modes
    for p in smoke["prompts"]:
        assert p["finite_logits"] is True and p["logit_delta_l2"] > 1e-6
        assert 0 <= p["adapter_output_tokens"] <= 4
        assert p["adapter_output_chars"] == len(p["adapter_output"])
    for p, d in zip(smoke["prompts"], smoke["prompt_diagnostics"], strict=True):
        if p["adapter_output"].strip():
            assert d["outcome"].startswith("logits_changed"), d
        else:
            assert d["outcome"] == "empty_adapter_output", d
    assert not [w for w in smoke["warnings"] if "latency" not in w]
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for n, t in before.items():
        assert torch.equal(after[n].detach(), t) and after[n]._version == versions[n], n
    assert all(m.lora_A is not None for m in adapter._modules.values())


def test_empty_prompt_list_fails_with_the_no_prompts_warning(resident, adapter):
    smoke = run_smoke_test(resident.model, resident.tokenizer, [])
    assert smoke["passed"] is False and smoke["warnings"] == ["no prompts"]
    assert smoke["prompts"] == [] and smoke["prompt_diagnostics"] == []
    assert canary_status(smoke)["checks"]["simple_short_completion"] is False
