"""The validation loss and token accuracy against an independent computation (docs/validation.md).

The reference is the library stack, not Kiln: transformers' `Qwen3_5ForCausalLM` loaded from
the tiny checkpoint, PEFT loading the adapter Kiln published, token ids and labels from the
Transformers + TRL conversations fixture (`qualification/sft_template_oracle.py`: the chat template
rendered by `apply_chat_template(..., return_assistant_tokens_mask=True)`), and
`torch.nn.functional.cross_entropy` over the shifted labels of the dense logits. Token-weighted
over the same rows, in f32: the loss within 1e-5 relative, the token accuracy exactly equal.
The baseline (step 0) is checked against the plain base model.
"""

from __future__ import annotations

import pytest
import torch

from kiln_train.data.labels import IGNORE_INDEX
from kiln_train.data.validation import prepare_validation
from kiln_train.sft_config import ValidationSpec
from tests.kiln_train.data.reference_fixtures import labels_from, load_fixture
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import ingest, make_config, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, MAX_TOKENS = 4, 160


@pytest.fixture(scope="module")
def oracle_cases():
    """Short conversations of the fixture with their oracle token ids and labels."""
    cases = [
        c
        for c in load_fixture("qwen35_sft_conversations_v1.json")["cases"]
        if "error" not in c and len(c["input_ids"]) <= MAX_TOKENS and c["supervised_ranges"]
    ]
    assert len(cases) >= ROWS
    return cases[:ROWS]


def reference(model, cases) -> tuple[float, float]:
    """(token-weighted mean CE, token accuracy) of `model` on the cases' oracle ids and labels."""
    ce_total, correct, targets = 0.0, 0, 0
    with torch.no_grad():
        for case in cases:
            ids = torch.tensor([case["input_ids"]])
            labels = torch.tensor(labels_from(case["input_ids"], case["supervised_ranges"]))
            logits = model(ids, use_cache=False).logits[0, :-1].float()
            shifted = labels[1:]
            mask = shifted != IGNORE_INDEX
            ce_total += float(
                torch.nn.functional.cross_entropy(logits, shifted, ignore_index=IGNORE_INDEX, reduction="sum")
            )
            correct += int((logits[mask].argmax(-1) == shifted[mask]).sum())
            targets += int(mask.sum())
    return ce_total / targets, correct / targets


def test_validation_loss_and_accuracy_equal_transformers_with_peft(
    resident, tiny_dir, oracle_cases, tmp_path
):
    import peft
    from transformers import AutoModelForCausalLM

    examples = [c["example"] for c in oracle_cases]
    # Train on the validation rows themselves so the adapter moves their predictions a lot (and the
    # token accuracy leaves zero): an oracle test, not a generalisation claim.
    ingestion = ingest(resident, examples)
    ingested, validation = prepare_validation(
        ValidationSpec(examples=examples), ingestion, tokenizer=resident.tokenizer, template=resident.template
    )
    assert [r.input_ids for r in validation.rows] == [c["input_ids"] for c in oracle_cases]
    config = make_config(seed=3, epochs=4, learning_rate=2e-2, lora_rank=8, lora_alpha=16.0)
    result = train(resident, config, ingested, tmp_path, adapter_name="oracle", validation=validation)
    assert result.status == "success", result.failure_message
    baseline, final = result.validation_history[0], result.validation_history[-1]
    assert final["global_step"] == result.global_step

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    assert type(base).__name__ == "Qwen3_5ForCausalLM"
    base_loss, base_accuracy = reference(base, oracle_cases)
    adapted = peft.PeftModel.from_pretrained(base, result.adapter_path).eval()
    loss, accuracy = reference(adapted, oracle_cases)

    print(
        f"\nvalidation oracle ({ROWS} rows, {validation.stats.total_supervised_tokens} targets): "
        f"baseline kiln {baseline['loss']!r} vs transformers {base_loss!r} "
        f"(rel {abs(baseline['loss'] - base_loss) / base_loss:.2e}); "
        f"final kiln {final['loss']!r} vs transformers+peft {loss!r} (rel {abs(final['loss'] - loss) / loss:.2e}); "
        f"accuracy {final['token_accuracy']} vs {accuracy}"
    )
    assert baseline["loss"] == pytest.approx(base_loss, rel=1e-5, abs=0)
    assert baseline["token_accuracy"] == base_accuracy
    assert final["loss"] == pytest.approx(loss, rel=1e-5, abs=0)
    assert final["token_accuracy"] == accuracy
    assert accuracy > base_accuracy  # the adapter did change the predictions the check compares
    assert loss < base_loss
