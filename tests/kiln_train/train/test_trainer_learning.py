"""The trainer learns, and a seed reproduces a run bit for bit on CPU."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln_train.model.tiny import write_tiny_checkpoint
from kiln_train.train.resident import load_resident
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

FINAL_NORM = "model.language_model.norm.weight"
HEAD_GAIN = 10.0


@pytest.fixture(scope="module")
def learnable_dir(tmp_path_factory, qwen_tokenizer):
    """The tiny model with a final-norm gain of 10.

    A 64-wide random model whose tied head has std 0.02 can move a logit by at most about
    |h|·|e| ≈ 8 · 0.16 ≈ 1.3 nats, and the LoRA targets cannot change the frozen final norm or
    head, so no optimizer could halve its loss. With the gain (an ordinary trained-model logit
    scale) the trunk adapters have the headroom that learning needs.
    """
    out = write_tiny_checkpoint(
        tmp_path_factory.mktemp("learnable") / "model", "tiny", seed=0, tokenizer=qwen_tokenizer
    )
    weights = load_file(str(out / "model.safetensors"))
    weights[FINAL_NORM] = torch.full_like(weights[FINAL_NORM], HEAD_GAIN - 1.0)  # (1 + w) offset norm
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_twenty_conversations_three_epochs_learn(learnable_dir, tmp_path):
    res = load_resident(learnable_dir)
    ingestion = ingest(res, conversations(20))
    config = make_config(seed=3, epochs=3, lora_rank=8, lora_alpha=16.0, learning_rate=2e-3)
    result = train(res, config, ingestion, tmp_path)
    assert result.status == "success", result.failure_message
    history = result.loss_history
    assert len(history) == 60
    means = [sum(history[e * 20 : (e + 1) * 20]) / 20 for e in range(3)]
    assert means[2] < 0.5 * means[0], means
    assert means[1] < means[0] and means[2] < means[1], means


def _adapter_bytes(result) -> bytes:
    assert result.status == "success", result.failure_message
    return (result.adapter_path / "adapter_model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def small_data(resident):
    return ingest(resident, conversations(4))


@pytest.mark.parametrize("optimizer", ["adam_w", "muon", "sgd"])
def test_the_same_seed_reproduces_the_adapter_bit_for_bit(resident, small_data, tmp_path, optimizer):
    config = make_config(seed=21, epochs=2, optimizer={"kind": optimizer}, learning_rate=1e-2)
    one = train(resident, config, small_data, tmp_path / "one", adapter_name="same")
    two = train(resident, config, small_data, tmp_path / "two", adapter_name="same")
    assert _adapter_bytes(one) == _adapter_bytes(two)
    assert one.loss_history == two.loss_history
    assert one.receipt["lora_grad_norms"] == two.receipt["lora_grad_norms"]


def test_different_seeds_give_different_adapters(resident, small_data, tmp_path):
    a = train(resident, make_config(seed=1, epochs=1), small_data, tmp_path / "a", adapter_name="x")
    b = train(resident, make_config(seed=2, epochs=1), small_data, tmp_path / "b", adapter_name="x")
    ta = load_file(str(a.adapter_path / "adapter_model.safetensors"))
    tb = load_file(str(b.adapter_path / "adapter_model.safetensors"))
    assert ta.keys() == tb.keys()
    assert all(not torch.equal(ta[k], tb[k]) for k in ta if k.endswith("lora_A.weight"))  # seeded init
    assert a.loss_history != b.loss_history  # another epoch order and another start


def test_gradient_checkpointing_changes_memory_not_the_update(resident, small_data, tmp_path):
    plain = train(resident, make_config(seed=4, epochs=1), small_data, tmp_path / "plain", adapter_name="g")
    segmented = train(
        resident,
        make_config(seed=4, epochs=1, grad_checkpoint_segments=2),
        small_data,
        tmp_path / "seg",
        adapter_name="g",
    )
    assert plain.loss_history == segmented.loss_history
    assert _adapter_bytes(plain) == _adapter_bytes(segmented)
