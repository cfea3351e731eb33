"""LoRA on the ten targets: names, order, init algorithm, frozen base, PEFT parity and interop."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from kiln_train.model import attach_lora, load_model
from kiln_train.model.config import LORA_TARGET_MODULES
from kiln_train.model.tiny import write_tiny_checkpoint

OVERRIDES = {"vocab_size": 320, "bos_token_id": None, "eos_token_id": None}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("lora"), "tiny", seed=3, overrides=OVERRIDES, with_tokenizer=False
    )


def _randomise_b(lora, seed=0, std=0.05):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def _next_token_loss(logits, ids):
    return F.cross_entropy(logits[0, :-1], ids[0, 1:])


def test_names_order_and_shapes(ckpt):
    model = load_model(ckpt)
    lora = attach_lora(model, rank=4, alpha=8.0, seed=1)
    names = lora.names()
    assert names[:4] == [
        "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight",
        "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_B.weight",
        "base_model.model.model.layers.0.linear_attn.in_proj_z.lora_A.weight",
        "base_model.model.model.layers.0.linear_attn.in_proj_z.lora_B.weight",
    ]
    layer3 = [n for n in names if ".layers.3." in n]
    assert [n.split(".")[-3] for n in layer3[::2]] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert layer3[0] == "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
    assert names[-1] == "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
    cfg = model.config
    assert len(names) == 2 * len(cfg.projections()) == 2 * (3 * 6 + 7)
    for proj in cfg.projections():
        a = dict(lora.named_parameters())[f"base_model.model.model.{proj.module}.lora_A.weight"]
        b = dict(lora.named_parameters())[f"base_model.model.model.{proj.module}.lora_B.weight"]
        assert a.shape == (4, proj.in_features) and b.shape == (proj.out_features, 4)
        assert torch.count_nonzero(b) == 0
        assert a.abs().max().item() <= math.sqrt(1 / proj.in_features)
        assert a.abs().max().item() > 0.5 * math.sqrt(1 / proj.in_features)
    assert {n.split(".")[-3] for n in names} == set(LORA_TARGET_MODULES)
    assert lora.scale == 2.0 and lora.rank == 4 and lora.alpha == 8.0
    assert lora.entry(names[0]).layer == 0 and lora.entry(layer3[0]).layer == 3
    assert [n for n in names if lora.entry(n).layer == 3] == layer3
    assert sum(p.numel() for p in lora.parameters()) == cfg.lora_elements_per_rank() * 4
    assert lora.seed == 1


def test_init_is_the_documented_algorithm(ckpt):
    model = load_model(ckpt)
    lora = attach_lora(model, rank=3, alpha=3.0, seed=12345)
    gen = torch.Generator().manual_seed(12345)
    for proj in model.config.projections():
        bound = math.sqrt(1.0 / proj.in_features)
        expected = torch.empty(3, proj.in_features).uniform_(-bound, bound, generator=gen)
        got = lora.state_dict()[f"base_model.model.model.{proj.module}.lora_A.weight"]
        assert torch.equal(got, expected)
    other = attach_lora(load_model(ckpt), rank=3, alpha=3.0, seed=12345)
    assert all(torch.equal(lora.state_dict()[k], v) for k, v in other.state_dict().items())
    third = attach_lora(load_model(ckpt), rank=3, alpha=3.0, seed=12346)
    assert not torch.equal(third.parameters()[0], lora.parameters()[0])


def test_zero_b_leaves_logits_unchanged_and_only_lora_gets_gradients(ckpt):
    model = load_model(ckpt)
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model.logits(ids)
    lora = attach_lora(model, rank=2, alpha=4.0, seed=0)
    assert list(model.parameters()) == lora.parameters()  # the only parameters are LoRA leaves
    loss = _next_token_loss(model.logits(ids), ids)
    assert torch.equal(model.logits(ids).detach(), base)
    loss.backward()
    for name, buf in model.named_buffers():
        assert not buf.requires_grad and buf.grad is None, name
    grads = {n: p.grad for n, p in lora.named_parameters()}
    assert all(g is not None for g in grads.values())
    # with B = 0 the A gradients vanish and the B gradients carry the signal
    assert all(torch.count_nonzero(g) == 0 for n, g in grads.items() if "lora_A" in n)
    assert all(torch.count_nonzero(g) > 0 for n, g in grads.items() if "lora_B" in n)


def test_embedding_output_is_not_differentiable(ckpt):
    model = load_model(ckpt)
    ids = torch.tensor([[1, 2, 3]])
    assert not model.embed_tokens(ids).requires_grad
    assert not model.hidden_states(ids).requires_grad  # no LoRA: nothing trainable
    attach_lora(model, rank=2, alpha=2.0, seed=0)
    assert model.hidden_states(ids).requires_grad


def _peft_model(ckpt, rank, alpha):
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(LORA_TARGET_MODULES), lora_dropout=0.0
    )
    return peft.get_peft_model(base, config)


def _peft_key(key: str) -> str:
    return key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
        ".lora_B.weight", ".lora_B.default.weight"
    )


@pytest.mark.parametrize("num_segments", [1, 3])
def test_lora_gradients_match_peft(ckpt, num_segments):
    model = load_model(ckpt)
    lora = attach_lora(model, rank=4, alpha=8.0, seed=7)
    _randomise_b(lora)
    ref = _peft_model(ckpt, 4, 8.0)
    missing, unexpected = ref.load_state_dict(
        {_peft_key(k): v for k, v in lora.state_dict().items()}, strict=False
    )
    assert not unexpected and not [m for m in missing if "lora_" in m]
    ids = torch.randint(0, 320, (1, 150), generator=torch.Generator().manual_seed(4))
    ours = _next_token_loss(model.logits(ids, num_segments=num_segments), ids)
    theirs = _next_token_loss(ref(ids).logits, ids)
    assert abs(ours.item() - theirs.item()) < 1e-5
    ours.backward()
    theirs.backward()
    ref_params = dict(ref.named_parameters())
    assert sum(p.requires_grad for p in ref_params.values()) == len(lora)
    for name, p in lora.named_parameters():
        r = ref_params[_peft_key(name)].grad
        assert r.abs().max().item() > 0, name
        assert (p.grad - r).abs().max().item() <= 1e-4 * r.abs().max().item(), name


def test_adapter_files_load_in_peft_without_remap(ckpt, tmp_path):
    """The PEFT keys are the HF module paths: PeftModel.from_pretrained reads our tensors as-is."""
    import peft
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = load_model(ckpt)
    lora = attach_lora(model, rank=2, alpha=4.0, seed=5)
    _randomise_b(lora, seed=1, std=0.05)
    save_file(
        {k: v.contiguous() for k, v in lora.state_dict().items()}, str(tmp_path / "adapter_model.safetensors")
    )
    (tmp_path / "adapter_config.json").write_text(
        json.dumps(
            {
                "r": 2,
                "lora_alpha": 4.0,
                "target_modules": list(LORA_TARGET_MODULES),
                "task_type": "CAUSAL_LM",
                "bias": "none",
                "peft_type": "LORA",
            }
        )
    )
    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(base, tmp_path)
    ids = torch.randint(0, 320, (1, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ours, theirs = model.logits(ids), ref(ids).logits
        plain = load_model(ckpt).logits(ids)
    assert (ours - plain).abs().max().item() > 1e-3  # the adapter changes the output
    assert (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()


def test_state_dict_round_trip_keeps_leaf_identity(ckpt):
    model = load_model(ckpt)
    lora = attach_lora(model, rank=2, alpha=2.0, seed=0)
    leaves = lora.parameters()
    snapshot = {k: v.clone() for k, v in lora.state_dict().items()}
    other = attach_lora(load_model(ckpt), rank=2, alpha=2.0, seed=99)
    other_leaves = other.parameters()
    other.load_state_dict(snapshot)
    assert other.parameters() == other_leaves and all(
        a is b for a, b in zip(other.parameters(), other_leaves, strict=True)
    )
    assert all(torch.equal(other.state_dict()[k], v) for k, v in snapshot.items())
    assert lora.parameters() == leaves
    first = next(iter(snapshot))
    with pytest.raises(ValueError, match="missing"):
        other.load_state_dict({k: v for k, v in snapshot.items() if k != first})
    with pytest.raises(ValueError, match="unexpected"):
        other.load_state_dict(
            {**snapshot, "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": snapshot[first]}
        )
    with pytest.raises(ValueError, match="shape"):
        other.load_state_dict({**snapshot, first: torch.zeros(7, 7)})
    other.load_state_dict({first: torch.zeros_like(snapshot[first])}, strict=False)
    assert torch.count_nonzero(other.state_dict()[first]) == 0


def test_attach_validation_and_remove(ckpt):
    model = load_model(ckpt)
    for rank in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rank"):
            attach_lora(model, rank=rank, alpha=1.0, seed=0)
    for alpha in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="alpha"):
            attach_lora(model, rank=2, alpha=alpha, seed=0)
    lora = attach_lora(model, rank=2, alpha=2.0, seed=0)
    with pytest.raises(ValueError, match="already attached"):
        attach_lora(model, rank=2, alpha=2.0, seed=0)
    with pytest.raises(KeyError, match="no LoRA tensor"):
        lora.entry("base_model.model.model.layers.0.mlp.nope.lora_A.weight")
    lora.remove(model)
    assert model.lora is None and list(model.parameters()) == []
    assert len(attach_lora(model, rank=3, alpha=3.0, seed=0)) == len(lora)


def test_lora_dtype_follows_the_model_or_the_argument(ckpt):
    model = load_model(ckpt, dtype=torch.float64)
    lora = attach_lora(model, rank=2, alpha=2.0, seed=0)
    assert {p.dtype for p in lora.parameters()} == {torch.float64}
    model32 = load_model(ckpt)
    lora32 = attach_lora(model32, rank=2, alpha=2.0, seed=0)
    assert torch.equal(lora32.parameters()[0], lora.parameters()[0].float())
