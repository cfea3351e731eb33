"""The `kiln.training-optimizer-support` v1 report and the static optimizer-tuple gate."""

from __future__ import annotations

import subprocess
import sys

import pytest

from api.errors import http_status
from kiln_train.errors import KilnError
from kiln_train.ground.backend import backend_for_device
from kiln_train.model.config import QWEN35_4B_TEXT_CONFIG, parse_config
from kiln_train.plan.optimizer_support import (
    DISTILL_REFRESH_REASON,
    check_optimizer_tuple,
    native_training_supported,
    native_training_unavailable_reason,
    optimizer_support_report,
)

QWEN35_4B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": QWEN35_4B_TEXT_CONFIG}
SEED_DISTILL_REASON = (
    "distill_refresh is unavailable until admission pins separate exact SFT and OPD phase plans, prepares "
    "the exact SFT rows, and reserves the maximum sequential working set"
)


def tiny_config(*, kv_heads=1, head_dim=16):
    return parse_config(
        {
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "intermediate_size": 128,
            "vocab_size": 1000,
        }
    )


@pytest.fixture(scope="module")
def qwen4b():
    cfg = parse_config(QWEN35_4B)
    assert cfg.model_maximum_rank() == 1024
    return cfg


def _optimizers(report):
    return {o["kind"]: o for o in report["optimizers"]}


def _rank(lo, hi, backend_max, model_max=1024):
    return {
        "minimum": lo,
        "maximum": hi,
        "backend_maximum": backend_max,
        "model_maximum": model_max,
        "live_memory_admission_required": True,
    }


def _workloads_for(kinds):
    return [
        {"workload": "sft", "supported": True, "unavailable_reason": None, "allowed_optimizer_kinds": kinds},
        {
            "workload": "grpo",
            "supported": False,
            "unavailable_reason": "grpo is not implemented by this Python server",
            "allowed_optimizer_kinds": [],
        },
        {
            "workload": "opd",
            "supported": False,
            "unavailable_reason": "opd is not implemented by this Python server",
            "allowed_optimizer_kinds": [],
        },
        {
            "workload": "distill_refresh",
            "supported": False,
            "unavailable_reason": SEED_DISTILL_REASON,
            "allowed_optimizer_kinds": [],
        },
    ]


def test_cpu_report_for_qwen35_4b(qwen4b):
    report = optimizer_support_report(backend_for_device("cpu"), qwen4b)
    assert report == {
        "schema": {"id": "kiln.training-optimizer-support", "version": 1},
        "backend": "cpu",
        "device": "cpu",
        "base_weight_dtype": "f32",
        "resolved_lora_parameter_dtype": "f32",
        "immutable_after_startup": True,
        "rounding_modes": ["round_to_nearest"],
        "backend_implementation_rounding_modes": ["round_to_nearest"],
        "optimizer_tuple_kinds": ["muon", "adam_w", "sgd"],
        "workloads": _workloads_for(["muon", "adam_w", "sgd"]),
        "optimizers": [
            {
                "kind": kind,
                "backend_implementation": {
                    "supported": True,
                    "route": "portable_reference",
                    "native_device_hook": False,
                    "parameter_dtypes": ["f32"],
                },
                "optimizer_tuple": {"supported": True, "unavailable_reason": None, "lora_rank": rank},
            }
            for kind, rank in (
                ("muon", _rank(2, 1024, None)),
                ("adam_w", _rank(1, 1024, None)),
                ("sgd", _rank(1, 1024, None)),
            )
        ],
    }


def test_cuda_report_for_qwen35_4b(qwen4b):
    report = optimizer_support_report(backend_for_device("cuda"), qwen4b)
    assert report["backend"] == "cuda" and report["device"] == "cuda:0"
    assert report["base_weight_dtype"] == report["resolved_lora_parameter_dtype"] == "bf16"
    assert report["optimizer_tuple_kinds"] == ["muon", "adam_w", "sgd"]
    assert report["workloads"] == _workloads_for(["muon", "adam_w", "sgd"])
    opts = _optimizers(report)
    assert list(opts) == ["muon", "adam_w", "sgd"]
    for o in opts.values():
        assert o["backend_implementation"] == {
            "supported": True,
            "route": "native_device_hook",
            "native_device_hook": True,
            "parameter_dtypes": ["f32", "bf16"],
        }
        assert (
            o["optimizer_tuple"]["supported"] is True and o["optimizer_tuple"]["unavailable_reason"] is None
        )
    assert opts["muon"]["optimizer_tuple"]["lora_rank"] == _rank(2, 48, 48)
    assert opts["adam_w"]["optimizer_tuple"]["lora_rank"] == _rank(1, 1024, None)
    assert opts["sgd"]["optimizer_tuple"]["lora_rank"] == _rank(1, 1024, None)
    assert optimizer_support_report(backend_for_device("cuda:3"), qwen4b)["device"] == "cuda:3"


def test_distill_refresh_reason_is_the_seeds():
    assert DISTILL_REFRESH_REASON == SEED_DISTILL_REASON


def test_model_maximum_bounds_every_kind_on_a_small_model():
    cfg = tiny_config()  # k/v projection out dim 1 x 16
    assert cfg.model_maximum_rank() == 16
    opts = _optimizers(optimizer_support_report(backend_for_device("cuda"), cfg))
    assert opts["muon"]["optimizer_tuple"]["lora_rank"] == _rank(2, 16, 48, 16)
    assert opts["adam_w"]["optimizer_tuple"]["lora_rank"] == _rank(1, 16, None, 16)


def test_a_model_too_narrow_for_muon_drops_the_muon_tuple():
    cfg = tiny_config(head_dim=1)
    assert cfg.model_maximum_rank() == 1
    report = optimizer_support_report(backend_for_device("cpu"), cfg)
    muon = _optimizers(report)["muon"]["optimizer_tuple"]
    assert muon["supported"] is False
    assert "muon needs lora_rank >= 2" in muon["unavailable_reason"]
    assert report["optimizer_tuple_kinds"] == ["adam_w", "sgd"]
    assert report["workloads"][0]["allowed_optimizer_kinds"] == ["adam_w", "sgd"]
    with pytest.raises(KilnError, match="muon needs lora_rank >= 2"):
        check_optimizer_tuple(backend_for_device("cpu"), cfg, "muon", 2)


def test_native_training_summary(qwen4b):
    report = optimizer_support_report(backend_for_device("cuda"), qwen4b)
    assert native_training_supported(report) is True
    assert native_training_unavailable_reason(report) is None
    assert native_training_supported(None) is False
    assert "no live training runner" in native_training_unavailable_reason(None)
    report["workloads"][0] = {
        "workload": "sft",
        "supported": False,
        "unavailable_reason": "weights are not resident",
        "allowed_optimizer_kinds": [],
    }
    assert native_training_supported(report) is False
    assert native_training_unavailable_reason(report) == "weights are not resident"


@pytest.mark.parametrize(
    ("device", "kind", "ok", "bad"),
    [
        ("cuda", "muon", (2, 16, 48), (1, 49, 1024)),
        ("cuda", "adam_w", (1, 48, 1024), (0, 1025)),
        ("cuda", "sgd", (1, 1024), (0, 1025)),
        ("cpu", "muon", (2, 49, 1024), (1, 1025)),
        ("cpu", "adam_w", (1, 1024), (0, 1025)),
    ],
)
def test_tuple_gate(qwen4b, device, kind, ok, bad):
    backend = backend_for_device(device)
    for rank in ok:
        check_optimizer_tuple(backend, qwen4b, kind, rank)
    for rank in bad:
        with pytest.raises(KilnError) as info:
            check_optimizer_tuple(backend, qwen4b, kind, rank)
        err = info.value
        assert err.code == "training_invalid_request" and http_status(err) == 400
        assert err.message.startswith("Invalid training request: lora_rank ")
        assert f"lora_rank {rank} is outside" in err.message
        assert f"for the {kind} optimizer on the {device} backend" in err.message


def test_tuple_gate_message_names_range_and_ceilings(qwen4b):
    with pytest.raises(KilnError) as info:
        check_optimizer_tuple(backend_for_device("cuda"), qwen4b, "muon", 64)
    assert info.value.message == (
        "Invalid training request: lora_rank 64 is outside 2..=48 for the muon optimizer on the cuda "
        "backend (backend maximum 48, model maximum 1024)"
    )
    with pytest.raises(KilnError) as info:
        check_optimizer_tuple(backend_for_device("cpu"), qwen4b, "sgd", 2048)
    assert (
        "outside 1..=1024 for the sgd optimizer on the cpu backend (model maximum 1024" in info.value.message
    )
    with pytest.raises(KilnError, match="optimizer.kind 'lion'"):
        check_optimizer_tuple(backend_for_device("cpu"), qwen4b, "lion", 8)
    with pytest.raises(KilnError, match="lora_rank must be an integer"):
        check_optimizer_tuple(backend_for_device("cpu"), qwen4b, "sgd", 8.0)


def test_module_is_torch_free():
    code = (
        "import sys, kiln_train.plan.optimizer_support; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
