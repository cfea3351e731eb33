"""The native model's own behaviour: shapes, head, checkpoint segments, frozen base, input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln_train.model import attach_lora, load_model, segment_bounds
from kiln_train.model.tiny import write_tiny_checkpoint

OVERRIDES = {
    "vocab_size": 200,
    "num_hidden_layers": 5,
    "layer_types": [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ],
    "bos_token_id": None,
    "eos_token_id": None,
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("model"), "tiny", seed=2, overrides=OVERRIDES, with_tokenizer=False
    )


def test_shapes_head_and_final_norm(ckpt):
    model = load_model(ckpt)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    ids = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        logits = model.logits(ids)
    assert hidden.shape == (2, 17, 64) and logits.shape == (2, 17, 200)
    assert model.lm_head_weight is model.embed_tokens.weight  # tied
    assert torch.allclose(logits, hidden @ model.embed_tokens.weight.T, atol=1e-6)
    # the final RMSNorm is applied: per-row RMS of hidden / (1 + w) is 1 (up to eps = 1e-6 against
    # a mean square of ~4e-4 for this small-weight random model)
    unscaled = hidden / (1.0 + model.norm.weight)
    assert torch.allclose(unscaled.pow(2).mean(-1).sqrt(), torch.ones(2, 17), atol=3e-3)
    assert torch.equal(model(ids), logits)


def test_causality_prefix_logits_do_not_depend_on_later_tokens(ckpt):
    model = load_model(ckpt)
    ids = torch.randint(0, 200, (1, 90), generator=torch.Generator().manual_seed(1))
    other = ids.clone()
    other[0, 70:] = (other[0, 70:] + 1) % 200
    with torch.no_grad():
        a, b = model.logits(ids), model.logits(other)
    assert torch.allclose(a[:, :70], b[:, :70], atol=1e-6)
    assert not torch.allclose(a[:, 70:], b[:, 70:], atol=1e-3)


def test_segment_bounds_are_array_split():
    assert segment_bounds(5, 1) == [(0, 5)]
    assert segment_bounds(5, 2) == [(0, 3), (3, 5)]
    assert segment_bounds(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert segment_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for bad in (0, 6, 2.0):
        with pytest.raises(ValueError, match="num_segments"):
            segment_bounds(5, bad)


@pytest.mark.parametrize("num_segments", [2, 3, 5])
def test_checkpoint_segments_give_equal_loss_and_gradients(ckpt, num_segments):
    ids = torch.randint(0, 200, (1, 80), generator=torch.Generator().manual_seed(2))
    results = []
    for segments in (1, num_segments):
        model = load_model(ckpt)
        lora = attach_lora(model, rank=3, alpha=6.0, seed=4)
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        loss = F.cross_entropy(model.logits(ids, num_segments=segments)[0, :-1], ids[0, 1:])
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in lora.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert (grads_a[name] - grads_b[name]).abs().max().item() <= 1e-6 * max(
            1.0, grads_a[name].abs().max().item()
        ), name


def test_checkpointing_recomputes_segments_in_backward(ckpt):
    model = load_model(ckpt)
    attach_lora(model, rank=2, alpha=2.0, seed=0)
    calls = []
    handle = model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(3))
    model.logits(ids, num_segments=2).sum().backward()
    assert len(calls) == 2  # forward + recomputation in backward
    calls.clear()
    model.logits(ids, num_segments=1).sum().backward()
    assert len(calls) == 1
    handle.remove()


def test_gdn_implementations_agree_in_the_model(ckpt):
    model = load_model(ckpt, dtype=torch.float64)
    ids = torch.randint(0, 200, (1, 70), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        chunked = model.logits(ids)
        model.set_gdn_impl("recurrent")
        recurrent = model.logits(ids)
        model.set_gdn_impl("chunk", chunk_size=16)
        small_chunks = model.logits(ids)
    assert (chunked - recurrent).abs().max().item() < 1e-10
    assert (chunked - small_chunks).abs().max().item() < 1e-10
    with pytest.raises(ValueError, match="unknown"):
        model.set_gdn_impl("cuda-graph")
    model.set_gdn_impl("fla")
    with pytest.raises(ValueError, match="CUDA"):
        model.logits(ids)


def test_rejects_malformed_input_ids(ckpt):
    model = load_model(ckpt)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model.logits(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"T >= 1"):
        model.logits(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        model.logits(torch.zeros(1, 3))
