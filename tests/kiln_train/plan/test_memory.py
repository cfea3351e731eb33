"""Memory admission: component values, saturation, segment planning, the budget and the 413."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from api.errors import http_status
from kiln_train.errors import KilnError
from kiln_train.model.config import QWEN35_4B_TEXT_CONFIG, parse_config
from kiln_train.model.tiny import PRESETS
from kiln_train.plan.backend import FULL_LOGITS, KT_TAPE_FLCE, backend_for_device
from kiln_train.plan.budget import available_budget, cpu_available_bytes
from kiln_train.plan.formulas import (
    attention_layer_bytes,
    gdn_layer_bytes,
    segment_layer_ranges,
    vocab_chunk_size,
)
from kiln_train.plan.memory import GIB, U64_MAX, estimate, saturate
from kiln_train.plan.refusal import dominant_component, will_not_fit_message
from kiln_train.plan.segments import check_row_plan_fits, max_rank_that_fits, plan_segments, row_segments

# The `small` preset of kiln_train.model.tiny: 8 narrow layers under the full vocabulary.
SMALL = parse_config({**PRESETS["small"], "dtype": "bfloat16"})

CUDA = backend_for_device("cuda")
CPU = backend_for_device("cpu")

# Qwen3.5-4B text config (qwen35.md §1.1).
QWEN35_4B = parse_config(QWEN35_4B_TEXT_CONFIG)


def est(config=QWEN35_4B, **kw):
    args = {
        "max_seq_len": 4096,
        "max_supervised_tokens": 2048,
        "lora_rank": 16,
        "optimizer_kind": "adam_w",
        "num_segments": 8,
        "loss_route": KT_TAPE_FLCE,
        "backend": CUDA,
        "weights_resident": False,
    }
    args.update(kw)
    return estimate(config, **args)


def plan(available, config=QWEN35_4B, **kw):
    args = {
        "max_seq_len": 4096,
        "max_supervised_tokens": 2048,
        "lora_rank": 16,
        "optimizer_kind": "adam_w",
        "loss_route": KT_TAPE_FLCE,
        "backend": CUDA,
        "weights_resident": True,
        "available_bytes": available,
    }
    args.update(kw)
    return plan_segments(config, **args)


# ----- component values --------------------------------------------------------------------


def test_qwen35_4b_components_on_cuda():
    b = est()
    # 4,205,751,296 parameters (embedding counted once: tied) x 2 bytes of bf16.
    assert b.base_weights == 8_411_502_592
    # LoRA elements per rank: Σ(in+out) over the trained projections = 1,904,640; x16, bf16,
    # parameter + gradient.
    assert QWEN35_4B.lora_elements_per_rank() == 1_904_640
    assert b.lora_param_grad == 1_904_640 * 16 * 2 * 2 == 121_896_960
    # AdamW: m and v in bf16.
    assert b.lora_optimizer_state == 1_904_640 * 16 * 2 * 2
    # Largest leaf 9216 x 16 in f32 x 8 temporaries, one byte per gradient element, 64 MiB cuda runtime.
    assert b.residency_scratch == 8 * 4 * 9216 * 16 + 1_904_640 * 16 + 64 * 2**20 == 102_301_696
    # One gated full-attention layer at T = 4096 (h 2560, i 9216, qd 4096, kvd 1024, e = 2):
    #   T·(2·4·h + 2·2·h + 4·2·i) + 16·h          norms, normed inputs, SwiGLU
    #   T·(4·qd + 4·kvd + 4·2·qd + 3·2·qd + 7·2·16 + 4·(2·16 + 4 + 2))
    assert attention_layer_bytes(QWEN35_4B, 4096, 16, 2) == 748_167_168
    # One Gated DeltaNet layer at T = 4096 (nv 32, dk = dv 128, conv 8192, vd 4096, chunk 64):
    # the same common part + T·(2·conv + 4·conv + 14·vd + 2·vd + 6·2·16 + 32·32 + 8·16)
    # + 4·T·(6·32·64 + 10·32·128 + 4·32·128) + 4·2·32·128·128·(T/64) + constants.
    assert gdn_layer_bytes(QWEN35_4B, 4096, 16, 2) == 2_312_555_008
    # 8 segments of 4 layers, each 3 GDN + 1 attention; backward allowance: 1/8 of the largest
    # layer and four bf16 [T, h] gradients.
    assert (
        b.per_segment_activations
        == 3 * 2_312_555_008 + 748_167_168 + 2_312_555_008 // 8 + 4 * 4096 * 2560 * 2
    )
    assert b.per_segment_activations == 8_058_787_648
    # (8+1) boundaries of T·h bf16 + the final norm's f32 input + the hidden output + rope tables.
    assert b.boundary_states == 4096 * (9 * 2560 * 2 + 4 * 2560 + 2560 * 2 + 2 * 64 * 2) == 252_706_816
    # kt_tape_flce, A = 2048 rows, chunk 4096, bf16 rows upcast per chunk.
    a, h, chunk = 2048, 2560, 4096
    expected_loss = (
        2 * a * h
        + 4 * a * h
        + 2 * a * h
        + 3 * 4 * a * h
        + 4 * chunk * h
        + 2 * 4 * a * chunk
        + 64 * a
        + 2 * 4096 * h
    )
    assert b.loss_workspace == expected_loss == 235_012_096
    # Segmented: the loss finishes before any segment is recomputed, so the larger phase counts.
    working = 8_411_502_592 + 252_706_816 + max(8_058_787_648, 235_012_096) + 2 * 121_896_960 + 102_301_696
    assert b.working_set == working == 17_069_092_672
    assert b.safety_margin == -(-working // 16)
    assert b.total == working + b.safety_margin
    assert b.activations == b.per_segment_activations + b.boundary_states


def test_one_segment_adds_the_loss_on_top_of_all_activations():
    b = est(num_segments=1)
    layers = 24 * 2_312_555_008 + 8 * 748_167_168
    assert b.per_segment_activations == layers + 2_312_555_008 // 8 + 4 * 4096 * 2560 * 2
    assert b.working_set == (
        b.base_weights
        + b.boundary_states
        + b.per_segment_activations
        + b.loss_workspace
        + b.lora_param_grad
        + b.lora_optimizer_state
        + b.residency_scratch
    )


def test_segment_cut_matches_the_model():
    torch = pytest.importorskip("torch")  # noqa: F841 - the model's checkpointing module needs torch
    from kiln_train.model.checkpointing import segment_bounds

    for layers in range(1, 65):
        for segments in range(1, layers + 1):
            assert segment_layer_ranges(layers, segments) == segment_bounds(layers, segments)


def test_cpu_backend_charges_f32_everywhere():
    cpu = est(backend=CPU, optimizer_kind="muon")
    cuda = est(backend=CUDA, optimizer_kind="muon")
    assert cpu.base_weights == 2 * cuda.base_weights
    assert cpu.lora_param_grad == 2 * cuda.lora_param_grad
    assert cpu.lora_optimizer_state == 1_904_640 * 16 * 4  # one momentum buffer in f32
    assert est(optimizer_kind="sgd").lora_optimizer_state == 0
    assert est(weights_resident=True).base_weights == 0


def test_full_logits_charges_dense_logits():
    b = est(loss_route=FULL_LOGITS, num_segments=1, max_seq_len=1024, max_supervised_tokens=512)
    t, v, h = 1024, 248320, 2560
    # bf16 logits, their f32 copy, f32 log-softmax + two more f32 [T, V] in backward, the cast
    # back, and the hidden gradient.
    assert b.loss_workspace == 2 * t * v + 4 * t * v + 3 * 4 * t * v + 2 * t * v + 2 * t * h
    flce = est(num_segments=1, max_seq_len=1024, max_supervised_tokens=512)
    assert b.loss_workspace > 20 * flce.loss_workspace


def test_estimate_grows_with_each_input():
    base = est()
    assert est(lora_rank=64).total > base.total
    assert est(max_seq_len=8192).total > base.total
    assert est(max_supervised_tokens=4000).loss_workspace > base.loss_workspace
    assert est(num_segments=1).per_segment_activations > base.per_segment_activations
    assert est(num_segments=32).boundary_states > base.boundary_states


def test_vocab_chunk_shrinks_for_many_rows():
    assert vocab_chunk_size(248320, 4096) == 4096
    assert vocab_chunk_size(248320, 1 << 20) == 256


# ----- saturation --------------------------------------------------------------------------


def test_absurd_sequence_length_saturates_and_never_fits():
    b = est(max_seq_len=10**18, max_supervised_tokens=10**18)
    assert b.per_segment_activations == U64_MAX
    assert b.total == U64_MAX
    assert not b.fits(U64_MAX)
    with pytest.raises(KilnError) as err:
        plan(U64_MAX, max_seq_len=10**18, max_supervised_tokens=10**18)
    assert err.value.code == "training_will_not_fit"
    assert http_status(err.value) == 413


def test_absurd_rank_saturates():
    b = est(lora_rank=10**16)
    assert b.total == U64_MAX
    assert not b.fits(10**30)


def test_saturate_clamps():
    assert saturate(5) == 5
    assert saturate(U64_MAX + 12345) == U64_MAX
    with pytest.raises(ValueError):
        saturate(-1)


def test_invalid_inputs_are_rejected():
    with pytest.raises(ValueError):
        est(lora_rank=0)
    with pytest.raises(ValueError):
        est(optimizer_kind="lion")
    with pytest.raises(KilnError) as err:
        est(loss_route="vulkan_active_rows")
    assert err.value.code == "training_invalid_request"


# ----- segment planning --------------------------------------------------------------------


def test_plan_fits_at_one_segment():
    p = plan(10**15)
    assert p.num_segments == 1
    assert p.breakdown.num_segments == 1


def test_plan_takes_the_first_count_that_fits():
    totals = {s: est(num_segments=s, weights_resident=True).total for s in range(1, 33)}
    # A budget just big enough for 4 segments but not for 1..3.
    budget = totals[4]
    assert all(totals[s] > budget for s in (1, 2, 3))
    p = plan(budget)
    assert p.num_segments == 4
    assert p.breakdown.total <= budget
    first = next(s for s in range(1, 33) if totals[s] <= budget - 1)
    assert plan(budget - 1).num_segments == first


def test_plan_that_never_fits_is_413():
    with pytest.raises(KilnError) as err:
        plan(2 * GIB)
    assert err.value.code == "training_will_not_fit"
    assert "num_segments=32" in err.value.message  # the last plan tried is reported
    assert "Dynamic gradient checkpointing was already tried (num_segments 1..=32)" in err.value.message


def test_full_logits_is_never_given_more_than_one_segment():
    budget = est(num_segments=8, weights_resident=True).total
    assert plan(budget).num_segments > 1
    with pytest.raises(KilnError) as err:
        plan(budget, loss_route=FULL_LOGITS)
    assert err.value.code == "training_will_not_fit"
    assert "route=full_logits" in err.value.message
    assert "num_segments=1" in err.value.message
    assert "allows a single checkpoint segment" in err.value.message


def test_explicit_multi_segment_with_full_logits_is_invalid():
    with pytest.raises(KilnError) as err:
        plan(10**15, loss_route=FULL_LOGITS, requested_segments=2)
    assert err.value.code == "training_invalid_request"
    assert http_status(err.value) == 400
    assert "grad_checkpoint_segments=2" in err.value.message
    assert plan(10**15, loss_route=FULL_LOGITS, requested_segments=1).num_segments == 1


def test_explicit_segment_count_is_honoured_or_413():
    assert plan(10**15, requested_segments=3).num_segments == 3
    budget = est(num_segments=8, weights_resident=True).total
    with pytest.raises(KilnError) as err:
        plan(budget, requested_segments=2)
    assert err.value.code == "training_will_not_fit"
    assert "num_segments=2" in err.value.message
    assert "grad_checkpoint_segments=2 was honoured as given" in err.value.message
    with pytest.raises(KilnError) as err:
        plan(10**15, requested_segments=33)
    assert err.value.code == "training_invalid_request"


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


# ----- rank ceiling ------------------------------------------------------------------------


def test_rank_ceiling_is_the_largest_rank_that_fits():
    kw = {
        "max_seq_len": 1024,
        "max_supervised_tokens": 512,
        "optimizer_kind": "muon",
        "loss_route": KT_TAPE_FLCE,
        "backend": CUDA,
        "weights_resident": True,
    }
    budget = est(num_segments=32, lora_rank=300, **{k: v for k, v in kw.items() if k != "loss_route"}).total
    r = max_rank_that_fits(QWEN35_4B, available_bytes=budget, **kw)
    assert r >= 300

    def fits(rank):
        return any(
            est(num_segments=s, lora_rank=rank, **{k: v for k, v in kw.items() if k != "loss_route"}).fits(
                budget
            )
            for s in range(1, 33)
        )

    assert fits(r) and not fits(r + 1)
    assert (
        max_rank_that_fits(QWEN35_4B, available_bytes=10**15, **kw) == QWEN35_4B.model_maximum_rank() == 1024
    )
    assert max_rank_that_fits(QWEN35_4B, available_bytes=1, **kw) == 0


# ----- the budget --------------------------------------------------------------------------


def test_available_budget_subtracts_reserve_and_applies_cap():
    total, free = 80 * GIB, 70 * GIB
    assert available_budget(CUDA, total_bytes=total, free_bytes=free, reserve_gb=1.0) == 69 * GIB
    assert (
        available_budget(CUDA, total_bytes=total, free_bytes=free, reserve_gb=1.0, training_memory_gb=20)
        == 20 * GIB
    )
    assert available_budget(CUDA, total_bytes=total, free_bytes=GIB // 2, reserve_gb=1.0) == 0
    assert (
        available_budget(CPU, total_bytes=8 * GIB, free_bytes=9 * GIB, reserve_gb=0.5) == 7 * GIB + GIB // 2
    )
    with pytest.raises(ValueError):
        available_budget(CPU, total_bytes=GIB, free_bytes=-1, reserve_gb=0)


def test_cpu_available_bytes_reads_meminfo_and_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert cpu_available_bytes(meminfo, cgroup) == 20_000_000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    assert cpu_available_bytes(meminfo, cgroup) == 20_000_000 * 1024
    (cgroup / "memory.max").write_text(str(8 * GIB) + "\n")
    (cgroup / "memory.current").write_text(str(3 * GIB) + "\n")
    assert cpu_available_bytes(meminfo, cgroup) == 5 * GIB
    assert cpu_available_bytes() > 0  # this machine


def test_memory_modules_do_not_import_torch():
    code = (
        "import sys, kiln_train.plan.memory, kiln_train.plan.formulas, kiln_train.plan.segments, "
        "kiln_train.plan.budget, kiln_train.plan.refusal; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----- re-admitting a pinned per-row plan (a resume of an auto-planned run) ----------------------


def _row_bound(t: int, a: int, s: int):
    return est(max_seq_len=t, max_supervised_tokens=a, num_segments=s, lora_rank=16, optimizer_kind="adam_w")


def test_row_segments_gives_each_row_the_fewest_segments_within_the_plan():
    long_1, long_2 = _row_bound(16384, 8192, 1), _row_bound(16384, 8192, 2)
    assert long_2.total < long_1.total
    budget = long_2.total  # the long row needs 2 segments, a short one fits in 1
    plan = {"max_segments": 4, "auto": True, "budget_bytes": budget}

    def fits(t, a, s):
        return _row_bound(t, a, s).fits(budget)

    assert row_segments(plan, 16384, 8192, fits) == 2
    assert row_segments(plan, 512, 256, fits) == 1
    fixed = {"max_segments": 4, "auto": False, "budget_bytes": None}
    assert row_segments(fixed, 512, 256, fits) == 4
    nothing_fits = {"max_segments": 3, "auto": True, "budget_bytes": 1}
    assert row_segments(nothing_fits, 512, 256, lambda *_: False) == 3


def test_a_pinned_row_plan_is_readmitted_row_by_row():
    budget = _row_bound(16384, 8192, 2).total
    plan = {"max_segments": 4, "auto": True, "budget_bytes": budget}
    rows = [(16384, 8192), (12000, 6000), (512, 256), (512, 256)]
    common = {
        "lora_rank": 16,
        "optimizer_kind": "adam_w",
        "loss_route": KT_TAPE_FLCE,
        "backend": CUDA,
        "weights_resident": False,
    }
    worst = check_row_plan_fits(QWEN35_4B, rows, plan, available_bytes=budget, **common)
    # The worst row under the plan: a 12k row on 1 segment can outweigh the 16k row on 2.
    expected = max(
        (_row_bound(t, a, 1) if _row_bound(t, a, 1).fits(budget) else _row_bound(t, a, 2)).total
        for t, a in rows
    )
    assert worst is not None and worst.total == expected <= budget
    assert check_row_plan_fits(QWEN35_4B, [], plan, available_bytes=budget, **common) is None
    # Today's budget one byte under the worst row's bound: 413 with the contract's breakdown.
    with pytest.raises(KilnError) as err:
        check_row_plan_fits(QWEN35_4B, rows, plan, available_bytes=expected - 1, **common)
    assert err.value.code == "training_will_not_fit"
    assert "loss workspace" in err.value.message and "num_segments" in err.value.message
