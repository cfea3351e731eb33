"""The backend's choice of kernel paths: the torch reference on the CPU; on a device where the
checks run (here through Triton's interpreter), each Triton kernel whose agreement check passes,
the torch reference for one that disagrees or fails, and for every one when Triton is missing
or the dtype is not covered; and a model switched onto the chosen paths trains like the
reference."""

from __future__ import annotations

import sys

import pytest
import torch

from kiln_train.kernels.paths import (
    CAUSAL_CONV1D_SILU,
    FUSED_OPS,
    GATED_DELTA_RULE,
    GATED_RMS_NORM,
    OFFSET_RMS_NORM,
    SWIGLU,
    TORCH,
    TORCH_CHUNKED,
    TRITON,
)
from kiln_train.model import Qwen35Model, attach_lora, load_tensors_into
from kiln_train.model import kernel_choice as choice
from kiln_train.model.config import parse_config
from kiln_train.model.tiny import random_tensors, text_config, wrapper_config
from tests.kiln_train.kernels.kernel_support import interpreted_only

pytestmark = interpreted_only

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def config():
    return parse_config(wrapper_config(text_config("tiny", {"vocab_size": 300})))


@pytest.fixture(autouse=True)
def fresh_checks():
    choice.checked_paths.cache_clear()
    yield
    choice.checked_paths.cache_clear()


def test_the_cpu_backend_runs_the_torch_reference(config):
    paths = choice.choose_kernel_paths("cpu", torch.float32, config)
    assert paths.paths == {GATED_DELTA_RULE: TORCH_CHUNKED, **{op: TORCH for op in FUSED_OPS}}
    assert set(paths.reasons) == set(paths.paths) and choice.CPU_REASON in paths.reasons[SWIGLU]


def test_every_kernel_that_agrees_is_chosen(config):
    paths = choice.checked_paths(CPU, torch.float32, config)
    assert {op: paths.paths[op] for op in FUSED_OPS} == {op: TRITON for op in FUSED_OPS}
    assert paths.paths[GATED_DELTA_RULE] == TORCH_CHUNKED  # fla runs on CUDA only
    assert "CUDA only" in paths.reasons[GATED_DELTA_RULE]
    assert set(paths.reasons) == {GATED_DELTA_RULE}


def test_a_kernel_that_disagrees_falls_back_alone(config, monkeypatch):
    from kiln_train.kernels import swiglu

    right = swiglu.silu_mul
    monkeypatch.setattr(swiglu, "silu_mul", lambda g, u: right(g, u) * 1.01)
    paths = choice.checked_paths(CPU, torch.float32, config)
    assert paths.paths[SWIGLU] == TORCH
    assert "SwiGLU kernel disagrees with the torch reference (output" in paths.reasons[SWIGLU]
    assert all(paths.paths[op] == TRITON for op in (OFFSET_RMS_NORM, GATED_RMS_NORM, CAUSAL_CONV1D_SILU))


def test_a_kernel_that_fails_falls_back_with_the_error(config, monkeypatch):
    from kiln_train.kernels import causal_conv

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed\nmore detail")

    monkeypatch.setattr(causal_conv, "causal_conv1d_silu", broken)
    paths = choice.checked_paths(CPU, torch.float32, config)
    assert paths.paths[CAUSAL_CONV1D_SILU] == TORCH
    assert paths.reasons[CAUSAL_CONV1D_SILU].endswith("RuntimeError: PTX assembly failed")


def test_without_triton_every_fused_operation_runs_the_reference(config, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    paths = choice.checked_paths(CPU, torch.float32, config)
    assert all(paths.paths[op] == TORCH for op in FUSED_OPS)
    assert all(paths.reasons[op].startswith("Triton is not importable") for op in FUSED_OPS)


def test_an_f64_model_runs_the_reference(config):
    paths = choice.checked_paths(CPU, torch.float64, config)
    assert all(paths.paths[op] == TORCH for op in FUSED_OPS)
    assert "not torch.float64" in paths.reasons[SWIGLU]


def _model(config, seed=0):
    with torch.device("meta"):
        model = Qwen35Model(config)
    load_tensors_into(model, random_tensors(config, seed, dtype=torch.float32, device="cpu"), "cpu")
    return model


def test_a_model_on_the_chosen_kernels_trains_like_the_reference(config):
    """Logits and every LoRA gradient of a two-segment step agree with the torch paths."""
    reference, fused = _model(config), _model(config)
    paths = choice.checked_paths(CPU, torch.float32, config)
    choice.use_kernel_paths(fused, paths)
    kinds = {type(m).__name__: m.kernel_path for m in fused.modules() if hasattr(m, "kernel_path")}
    assert kinds == {
        "OffsetRMSNorm": TRITON,
        "GatedRMSNorm": TRITON,
        "SwiGLU": TRITON,
        "CausalDepthwiseConv": TRITON,
    }
    ids = torch.randint(0, 300, (1, 45), generator=torch.Generator().manual_seed(3))
    results = []
    for model in (reference, fused):
        lora = attach_lora(model, 4, 8.0, 0)
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        logits = model.logits(ids, num_segments=2)
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in lora.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    for name, g in want_grads.items():
        assert ((got_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() < 1e-4, name
