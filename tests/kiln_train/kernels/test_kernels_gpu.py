"""The Triton kernels compiled for a CUDA device: in bf16 (the training dtype there) each agrees
with the torch reference to one rounding of the output, the backend chooses every one at the
model's widths, and a bf16 model on them trains like the reference. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from kiln_train.kernels.causal_conv import causal_conv1d_silu
from kiln_train.kernels.gated_norm import gated_rms_norm as fused_gated
from kiln_train.kernels.paths import FUSED_OPS, TRITON, KernelPaths
from kiln_train.kernels.rms_norm import rms_norm_offset as fused_rms
from kiln_train.kernels.swiglu import silu_mul as fused_silu_mul
from kiln_train.model import Qwen35Model, attach_lora, load_tensors_into
from kiln_train.model import kernel_choice as choice
from kiln_train.model.config import QWEN35_4B_TEXT_CONFIG, parse_config
from kiln_train.model.gdn import CausalDepthwiseConv
from kiln_train.model.mlp import silu_mul
from kiln_train.model.norms import gated_rms_norm, rms_norm_offset
from kiln_train.model.tiny import random_tensors, text_config, wrapper_config
from tests.kiln_train.kernels.kernel_support import forward_backward, relative

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
# bf16 keeps 8 significant bits: one rounding apart is 2^-8 of the value, and the largest value
# bounds every element's rounding step.
ONE_ROUNDING = 2.0**-7


def _randn(*shape, scale=1.0, seed=0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(CUDA, BF16)


def _assert_one_rounding(reference, kernel, inputs):
    out = reference(*inputs)
    cot = torch.randn((out[0] if isinstance(out, tuple) else out).shape, device=CUDA)
    ours, theirs = forward_backward(kernel, inputs, cot), forward_backward(reference, inputs, cot)
    for i, (got, want) in enumerate(zip(ours, theirs, strict=True)):  # the output, then each gradient
        assert relative(got, want) <= 2 * ONE_ROUNDING, (i, relative(got, want))


@pytest.mark.parametrize("width", [256, 2560, 70])
def test_offset_rms_norm(width):
    w = _randn(width, scale=0.3, seed=1)
    _assert_one_rounding(
        lambda x: rms_norm_offset(x, w, 1e-6),
        lambda x: fused_rms(x, w, 1e-6),
        [_randn(3, 333, width, scale=2)],
    )


def test_gated_rms_norm():
    w = 1 + _randn(128, scale=0.1, seed=2)
    x, z = _randn(2, 301, 32, 128, seed=3), _randn(2, 301, 32, 128, scale=2, seed=4)
    _assert_one_rounding(
        lambda x, z: gated_rms_norm(x, z, w, 1e-6), lambda x, z: fused_gated(x, z, w, 1e-6), [x, z]
    )


def test_swiglu():
    _assert_one_rounding(
        silu_mul, fused_silu_mul, [_randn(1, 517, 9216, scale=3, seed=5), _randn(1, 517, 9216, seed=6)]
    )


@pytest.mark.parametrize("prefixed", [False, True])
def test_causal_conv1d_silu(prefixed):
    conv = CausalDepthwiseConv(8192, 4, device=CUDA, dtype=BF16)
    conv.weight.copy_(_randn(8192, 1, 4, scale=0.5, seed=7))
    inputs = [_randn(2, 389, 8192, seed=8)] + ([_randn(2, 3, 8192, seed=9)] if prefixed else [])
    _assert_one_rounding(conv, lambda m, *p: causal_conv1d_silu(m, conv.weight, *p), inputs)


def test_the_backend_chooses_every_kernel_at_the_4b_widths():
    cfg = parse_config(
        wrapper_config(text_config("small", {k: v for k, v in QWEN35_4B_TEXT_CONFIG.items() if k != "dtype"}))
    )
    choice.checked_paths.cache_clear()
    paths = choice.choose_kernel_paths("cuda", BF16, cfg)
    assert {op: paths.paths[op] for op in FUSED_OPS} == {op: TRITON for op in FUSED_OPS}, paths.reasons


def test_a_bf16_model_on_the_kernels_trains_like_the_reference():
    cfg = parse_config(wrapper_config(text_config("small", {"vocab_size": 4096, "num_hidden_layers": 4})))
    results = []
    for use in (False, True):
        with torch.device("meta"):
            model = Qwen35Model(cfg, dtype=BF16)
        load_tensors_into(model, random_tensors(cfg, 0, dtype=BF16, device=CUDA), CUDA)
        model.set_gdn_impl("chunk")
        if use:
            fused = {**KernelPaths.reference("").paths, **{op: TRITON for op in FUSED_OPS}}
            choice.use_kernel_paths(model, KernelPaths(fused))
        lora = attach_lora(model, 8, 16.0, 0)
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator(device=CUDA).manual_seed(len(name)))
        ids = torch.randint(0, 4096, (1, 700), generator=torch.Generator().manual_seed(1)).to(CUDA)
        logits = model.logits(ids, num_segments=2)
        torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()
        results.append((logits.detach().float(), {n: p.grad.float() for n, p in lora.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    # Each side is a bf16 computation of the same math; they differ by bf16 roundings only.
    assert relative(got.double(), want.double()) < 3e-2
    worst = max(
        relative(got_grads[n].double(), g.double()) for n, g in want_grads.items() if g.abs().max() > 0
    )
    assert worst < 1e-1
