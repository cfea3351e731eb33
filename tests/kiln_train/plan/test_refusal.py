"""The 413 `training_will_not_fit` message: its shape and order, the dominant cause it names and the
rank it advises (docs/memory.md#the-413)."""

from __future__ import annotations

import re

import pytest

from kiln_train.errors import TRAINING_WILL_NOT_FIT, KilnError
from kiln_train.ground.backend import FULL_LOGITS, KT_TAPE_FLCE
from kiln_train.plan.memory import GIB
from kiln_train.plan.refusal import dominant_component, will_not_fit_message
from kiln_train.plan.segments import max_rank_that_fits, plan_segments
from tests.kiln_train.plan.plan_support import (
    CUDA,
    NARROW,
    QWEN35_4B,
    SIZES,
    SMALL,
    best_total,
    common,
    est,
    plan,
)

# ----- the 413 message ---------------------------------------------------------------------

MESSAGE = re.compile(
    r"^Estimated training step working set is (\d+\.\d\d) GB but only (\d+\.\d\d) GB is available\. "
    r"Breakdown: weights (\d+\.\d\d) GB, activations (\d+\.\d\d) GB \(max_seq_len=(\d+), num_segments=(\d+)\), "
    r"loss workspace (\d+\.\d\d) GB \(route=(\w+)\), LoRA params\+grads (\d+\.\d\d) GB, "
    r"optimizer state (\d+\.\d\d) GB, residency scratch (\d+\.\d\d) GB \(lora_rank=(\d+)\)\. (.+)$"
)


def test_message_shape_and_order():
    b = est()
    msg = will_not_fit_message(b, 3 * GIB, rank_ceiling=7)
    assert "\n" not in msg
    m = MESSAGE.match(msg)
    assert m, msg
    assert float(m.group(1)) == round(b.total / GIB, 2)
    assert m.group(2) == "3.00"
    assert float(m.group(3)) == round(b.base_weights / GIB, 2)
    assert float(m.group(4)) == round(b.activations / GIB, 2)
    assert (m.group(5), m.group(6)) == ("4096", "8")
    assert float(m.group(7)) == round(b.loss_workspace / GIB, 2)
    assert m.group(8) == "kt_tape_flce"
    assert float(m.group(9)) == round(b.lora_param_grad / GIB, 2)
    assert float(m.group(10)) == round(b.lora_optimizer_state / GIB, 2)
    assert float(m.group(11)) == round(b.residency_scratch / GIB, 2)
    assert m.group(12) == "16"
    assert m.group(13).endswith("The largest lora_rank that fits this request is 7.")


def _rejection(available, **kw) -> KilnError:
    with pytest.raises(KilnError) as err:
        plan(available, **kw)
    assert err.value.code == "training_will_not_fit"
    assert MESSAGE.match(err.value.message), err.value.message
    return err.value


def test_rank_too_large_names_the_rank():
    kw = {"max_seq_len": 256, "max_supervised_tokens": 128, "lora_rank": 1024, "optimizer_kind": "adam_w"}
    budget = est(num_segments=1, weights_resident=True, **{**kw, "lora_rank": 128}).total
    err = _rejection(budget, **kw)
    assert "LoRA rank dominates: lora_rank=1024" in err.message
    ceiling = max_rank_that_fits(
        QWEN35_4B,
        max_seq_len=256,
        max_supervised_tokens=128,
        optimizer_kind="adam_w",
        loss_route=KT_TAPE_FLCE,
        backend=CUDA,
        weights_resident=True,
        available_bytes=budget,
    )
    assert 128 <= ceiling < 1024
    assert f"The largest lora_rank that fits this request is {ceiling}." in err.message


def test_sequence_too_long_names_the_sequence():
    err = _rejection(40 * GIB, max_seq_len=262144, max_supervised_tokens=1024)
    assert "Sequence length dominates: activations for max_seq_len=262144" in err.message
    assert "No lora_rank fits this request" in err.message


def test_loss_workspace_problem_names_the_route():
    # Narrow layers, full vocabulary: the dense [T, V] logits outweigh everything else.
    err = _rejection(
        8 * GIB, config=SMALL, loss_route=FULL_LOGITS, max_seq_len=8192, max_supervised_tokens=4096
    )
    assert "The loss workspace dominates: route=full_logits" in err.message


def test_general_capacity_names_the_weights():
    err = _rejection(6 * GIB, weights_resident=False, max_seq_len=512, max_supervised_tokens=100)
    assert "General capacity: the base weights alone need 7.83 GB" in err.message


def test_dominant_component_of_each_kind():
    assert (
        dominant_component(est(weights_resident=False, max_seq_len=64, max_supervised_tokens=8)) == "weights"
    )
    assert (
        dominant_component(
            est(weights_resident=True, max_seq_len=64, lora_rank=1024, max_supervised_tokens=8)
        )
        == "rank"
    )
    assert (
        dominant_component(est(weights_resident=True, max_seq_len=65536, max_supervised_tokens=8))
        == "sequence"
    )


def test_413_for_rank_dominated_request_advises_an_admissible_rank():
    config = SIZES["4b"]
    short = {"max_seq_len": 16, "max_supervised_tokens": 8}
    at48, at2, at1 = (best_total(config, lora_rank=r, **short) for r in (48, 2, 1))
    assert at1 < at2 < at48
    budget = (at48 + at2) // 2
    with pytest.raises(KilnError) as err:
        plan_segments(config, **common(lora_rank=48, **short), available_bytes=budget)
    msg = err.value.message
    ceiling = int(re.search(r"largest lora_rank that fits this request is (\d+)\.", msg).group(1))
    assert 2 <= ceiling < 48
    plan = plan_segments(config, **common(lora_rank=ceiling, **short), available_bytes=budget)
    assert plan.breakdown.total <= budget
    # Memory for rank 1 only: Muon cannot use rank 1, so the 413 advises no rank at all.
    kw = {k: v for k, v in common(**short).items() if k != "lora_rank"}
    assert max_rank_that_fits(config, **kw, available_bytes=at2 - 1) == 1
    with pytest.raises(KilnError) as err:
        plan_segments(config, **common(lora_rank=48, **short), available_bytes=at2 - 1)
    assert "No lora_rank fits this request" in err.value.message
    assert "largest lora_rank" not in err.value.message
    # SGD at the same budget may be advised rank 1.
    with pytest.raises(KilnError) as err:
        plan_segments(
            config,
            **common(lora_rank=48, optimizer_kind="sgd", **short),
            available_bytes=best_total(config, lora_rank=1, optimizer_kind="sgd", **short),
        )
    assert "The largest lora_rank that fits this request is 1." in err.value.message


def test_413_message_order_for_each_cause():
    order = [
        "Estimated training step working set is ",
        " GB but only ",
        " GB is available. Breakdown: weights ",
        " GB, activations ",
        " GB (max_seq_len=",
        ", num_segments=",
        "), loss workspace ",
        " GB (route=",
        "), LoRA params+grads ",
        " GB, optimizer state ",
        " GB, residency scratch ",
        " GB (lora_rank=",
    ]
    cases = {
        "Sequence length dominates": ("9b", common(max_seq_len=1 << 20, max_supervised_tokens=16), 40 * GIB),
        "The loss workspace dominates": (
            "narrow",
            common(max_seq_len=8192, max_supervised_tokens=8192, loss_route=FULL_LOGITS),
            10 * GIB,
        ),
        "LoRA rank dominates": (
            "9b",
            common(max_seq_len=16, max_supervised_tokens=8, lora_rank=1024, optimizer_kind="adam_w"),
            2 * GIB,
        ),
        "General capacity": (
            "9b",
            common(max_seq_len=16, max_supervised_tokens=8, weights_resident=False),
            4 * GIB,
        ),
    }
    for cause, (name, kw, budget) in cases.items():
        with pytest.raises(KilnError) as err:
            plan_segments(NARROW if name == "narrow" else SIZES[name], **kw, available_bytes=budget)
        msg = err.value.message
        assert err.value.code == TRAINING_WILL_NOT_FIT and "\n" not in msg
        pos = [msg.index(p) for p in order]
        assert pos == sorted(pos), cause
        assert cause in msg
        assert msg.index(cause) > pos[-1]
