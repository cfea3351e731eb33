"""CUDA checks (bf16 model, flash-linear-attention kernels); skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln_train.model import attach_lora, load_model
from kiln_train.model.delta_rule import (
    chunk_gated_delta_rule,
    fla_chunk_kernel,
    fla_unusable_reason,
    gated_delta_rule,
)
from kiln_train.model.tiny import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _fla_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    return fla_unusable_reason(torch.device("cuda", torch.cuda.current_device()))


FLA_REASON = _fla_reason()
needs_fla = pytest.mark.skipif(
    FLA_REASON is not None, reason=f"flash-linear-attention unusable: {FLA_REASON}"
)
OVERRIDES = {"vocab_size": 512, "bos_token_id": None, "eos_token_id": None}


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("gpu"), "tiny", seed=4, overrides=OVERRIDES, with_tokenizer=False
    )


def test_cuda_defaults_to_bf16_and_auto_picks_fla_only_when_it_trains_correctly(ckpt):
    model = load_model(ckpt, device="cuda")
    assert model.dtype == torch.bfloat16 and model.device.type == "cuda"
    layer = next(layer for layer in model.layers if layer.is_linear_attention)
    from kiln_train.model.delta_rule import resolve_impl

    expected = "fla" if FLA_REASON is None else "chunk"
    assert resolve_impl(layer.linear_attn.impl, model.device) == expected
    if fla_chunk_kernel() is not None and FLA_REASON is not None:
        with pytest.raises(ValueError, match="flash-linear-attention"):
            resolve_impl("fla", model.device)  # importable but unusable: never chosen, refused when asked


@pytest.mark.parametrize("impl", ["chunk", pytest.param("fla", marks=needs_fla)])
def test_bf16_logits_and_lora_grads_track_f32(ckpt, impl):
    ids = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(0))
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(ckpt, device="cuda", dtype=dtype)
        model.set_gdn_impl("chunk" if dtype == torch.float32 else impl)
        lora = attach_lora(model, rank=4, alpha=8.0, seed=0)
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        logits = model.logits(ids.cuda())
        F.cross_entropy(logits[0, :-1].float(), ids[0, 1:].cuda()).backward()
        results[dtype] = (logits.detach(), {n: p.grad.float() for n, p in lora.named_parameters()})
    (ref, ref_grads), (got, grads) = results[torch.float32], results[torch.bfloat16]
    assert _rel(got, ref) < 5e-2
    for name, g in grads.items():
        if "lora_B" in name:
            assert _rel(g, ref_grads[name]) < 1e-1, name


@needs_fla
def test_fla_kernel_matches_chunked_torch_with_carried_state():
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, t, hk, hv, dk, dv = 1, 300, 2, 4, 64, 64
    q = torch.randn(b, t, hk, dk, device="cuda", generator=gen)
    k = torch.randn(b, t, hk, dk, device="cuda", generator=gen)
    v = torch.randn(b, t, hv, dv, device="cuda", generator=gen)
    g = -torch.rand(b, t, hv, device="cuda", generator=gen) * 2
    beta = torch.rand(b, t, hv, device="cuda", generator=gen)
    ref, ref_state = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    got, state = gated_delta_rule(q, k, v, g, beta, impl="fla", output_final_state=True)
    assert _rel(got, ref) < 5e-3 and _rel(state, ref_state) < 5e-3
    first, mid = gated_delta_rule(
        q[:, :130], k[:, :130], v[:, :130], g[:, :130], beta[:, :130], impl="fla", output_final_state=True
    )
    second, _ = gated_delta_rule(
        q[:, 130:],
        k[:, 130:],
        v[:, 130:],
        g[:, 130:],
        beta[:, 130:],
        impl="fla",
        initial_state=mid,
        output_final_state=True,
    )
    assert _rel(torch.cat((first, second), 1), ref) < 5e-3


def test_checkpointed_segments_train_on_cuda_with_the_automatic_kernel_choice(tmp_path):
    """The first CUDA forward decides FLA vs torch with a probe that has its own backward; run
    inside a checkpointed segment it changed the saved-tensor count (CheckpointError on H200)."""
    from kiln_train.model import delta_rule

    delta_rule.fla_unusable_reason.cache_clear()  # the decision must happen in this forward
    path = write_tiny_checkpoint(tmp_path / "seg", "tiny", seed=5, overrides=OVERRIDES, with_tokenizer=False)
    model = load_model(path, device="cuda")
    lora = attach_lora(model, rank=4, alpha=8.0, seed=0)
    ids = torch.randint(0, 512, (1, 96), generator=torch.Generator().manual_seed(2)).cuda()
    logits = model.logits(ids, num_segments=2)
    F.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()
    assert all(p.grad is not None and bool(p.grad.isfinite().all()) for _, p in lora.named_parameters())
