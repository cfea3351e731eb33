"""Canaries on odd prompts, an immediately-EOS model, and the no-mutation / inference-mode rules."""

from __future__ import annotations

import pytest
import torch

from kiln_train.data.tokenizer import ENDOFTEXT_ID, IM_END_ID
from kiln_train.model import attach_lora
from kiln_train.train.canary import canary_status, run_smoke_test, stop_token_ids
from tests.kiln_train.train import trainer_fixtures as fx

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


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
