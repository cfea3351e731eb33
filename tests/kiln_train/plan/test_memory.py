"""The memory estimate: component values on real Qwen3.5 sizes, growth with every input, saturation
instead of overflow (docs/memory.md#components)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from api.errors import http_status
from kiln_train.errors import TRAINING_WILL_NOT_FIT, KilnError
from kiln_train.ground.backend import FULL_LOGITS
from kiln_train.model.config import parse_config
from kiln_train.plan.formulas import (
    attention_layer_bytes,
    gdn_layer_bytes,
    segment_layer_ranges,
    vocab_chunk_size,
)
from kiln_train.plan.memory import U64_MAX, estimate, saturate
from kiln_train.plan.segments import plan_segments
from tests.kiln_train.plan.plan_support import CPU, CUDA, QWEN35_4B, SIZES, common, est, plan

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
    # Saved per layer (docs/performance.md#saved-activations), T = 4096, bf16: the derived minimum.
    # Attention: 2·(2h + 2i + qd + 2·kvd + 2·qd) = 2·37,888 per token.
    assert attention_layer_bytes(QWEN35_4B, 4096, 16, 2) == 4096 * 75_776 == 310_378_496
    # GDN: 2·(2h + 2i + conv 8192 + 2·nv + 2·vd) = 2·40,000 per token; one rebuild block, no carry.
    gdn, attn = 4096 * 80_000, 310_378_496
    assert gdn_layer_bytes(QWEN35_4B, 4096, 16, 2) == gdn
    # A longer row keeps the f32 state (32·128·128·4) and conv tail (8192·3·2) entering each block.
    assert gdn_layer_bytes(QWEN35_4B, 3 * 4096, 16, 2) == 3 * gdn + 2 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    # 8 segments of 4 layers [GDN, GDN, GDN, attention]. Backward of layer n holds the layers before
    # it plus, the larger of: its whole saved set + its largest group backward (SwiGLU's down
    # group, T·(5·2·i + 2·h)); or its core inputs + the rebuilt core (GDN: the chunked delta rule
    # over the whole 4096-token block, 1,715,612,160 bytes; held T·2·(h + conv + 2·nv + vd)).
    group = 4096 * (5 * 2 * 9216 + 2 * 2560)
    gdn_core = 4096 * 2 * (2560 + 8192 + 64 + 4096) + 1_715_612_160
    attn_core = 4096 * 2 * (2560 + 2 * 4096 + 2 * 1024) + 4096 * (2 * 4 * 5120 + 13 * 2 * 4096 + 4 * 16)
    peaks = [
        max(gdn + group, gdn_core),
        gdn + max(gdn + group, gdn_core),
        2 * gdn + max(gdn + group, gdn_core),
        3 * gdn + max(attn + group, attn_core),
    ]
    backward = max(peaks) + 4 * 4096 * 2560 * 2  # plus four bf16 [T, h] gradients
    assert backward == 2 * gdn + gdn_core + 4 * 4096 * 2560 * 2 == 2_577_017_344
    # Priced beside the loss: max(the last segment, the backward peak − the loss workspace).
    loss = 235_012_096
    assert b.per_segment_activations == max(3 * gdn + attn, backward - loss) == 2_342_005_248
    # (8+1) boundaries of T·h bf16 + the final norm's f32 input + the hidden output + rope tables,
    # + the two [T, h] outputs each layer of the 7 checkpointed segments keeps (28 layers).
    assert b.boundary_states == 4096 * (9 * 2560 * 2 + 4 * 2560 + 2560 * 2 + 2 * 64 * 2 + 2 * 28 * 2560 * 2)
    assert b.boundary_states == 1_427_111_936
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
    assert b.loss_workspace == expected_loss == loss
    working = 8_411_502_592 + 1_427_111_936 + 2_342_005_248 + loss + 2 * 121_896_960 + 102_301_696
    assert b.working_set == working == 12_761_727_488
    assert b.safety_margin == -(-working // 16)
    assert b.total == working + b.safety_margin
    assert b.activations == b.per_segment_activations + b.boundary_states


def test_one_segment_adds_the_loss_on_top_of_all_activations():
    b = est(num_segments=1)
    layers = 24 * 4096 * 80_000 + 8 * 4096 * 75_776
    assert b.per_segment_activations >= layers  # every layer's saved set stays for the loss
    assert b.working_set == (
        b.base_weights
        + b.boundary_states
        + b.per_segment_activations
        + b.loss_workspace
        + b.lora_param_grad
        + b.lora_optimizer_state
        + b.residency_scratch
    )
    # 4B, T = 4096, one segment, bf16 on CUDA: about 20.3 GiB (it was 70.2 GiB before the layers
    # kept only their group inputs), under the 24 GiB.
    assert 20 * 2**30 < b.total < 21 * 2**30


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


# ----- real Qwen3.5 sizes --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SIZES))
def test_untied_sizes_charge_the_head_and_bounds_grow_with_t_rank_and_state(name):
    config = SIZES[name]
    weights = estimate(config, num_segments=1, **common(weights_resident=False)).base_weights
    assert weights == config.base_parameter_count() * 2
    if not config.tie_word_embeddings:
        tied = parse_config({**config.to_dict(), "tie_word_embeddings": True})
        assert weights - tied.base_parameter_count() * 2 == config.vocab_size * config.hidden_size * 2
    s = config.num_hidden_layers // 4
    totals_t = [
        estimate(config, num_segments=s, **common(max_seq_len=t, max_supervised_tokens=t)).total
        for t in (1, 2, 63, 64, 65, 4096, 262144, 1 << 20)
    ]
    assert totals_t == sorted(totals_t) and len(set(totals_t)) == len(totals_t)
    totals_r = [
        estimate(config, num_segments=s, **common(lora_rank=r)).total
        for r in (2, 3, 16, 48, config.model_maximum_rank())
    ]
    assert totals_r == sorted(totals_r) and len(set(totals_r)) == len(totals_r)
    by_opt = [
        estimate(config, num_segments=s, **common(optimizer_kind=k)).total for k in ("sgd", "muon", "adam_w")
    ]
    assert by_opt[0] < by_opt[1] < by_opt[2]


def test_sizes_that_would_overflow_u64_reject_instead_of_wrapping():
    config = SIZES["27b"]
    huge = 1 << 62
    b = estimate(config, num_segments=1, **common(max_seq_len=huge, max_supervised_tokens=huge))
    assert b.total == U64_MAX and not b.fits(U64_MAX) and not b.fits(U64_MAX - 1)
    b = estimate(config, num_segments=1, **common(lora_rank=1 << 60))
    assert b.lora_param_grad == U64_MAX and b.total == U64_MAX and not b.fits(U64_MAX)
    with pytest.raises(KilnError) as err:
        plan_segments(
            config, **common(max_seq_len=huge, max_supervised_tokens=huge), available_bytes=U64_MAX - 1
        )
    assert err.value.code == TRAINING_WILL_NOT_FIT
    assert "No lora_rank fits this request" in err.value.message


def test_memory_modules_do_not_import_torch():
    code = (
        "import sys, kiln_train.plan.memory, kiln_train.plan.formulas, kiln_train.plan.segments, "
        "kiln_train.plan.budget, kiln_train.plan.refusal; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("seq_len", "budget_gib", "segments"),
    # Before the layers kept only their group inputs (and segments kept their output projections)
    # the same budgets needed 3, 16, 8 and 16 segments.
    [(4096, 24, 1), (16384, 24, 3), (32768, 80, 2), (32768, 48, 3)],
)
def test_the_planner_prices_the_lean_layers_and_picks_few_segments(seq_len, budget_gib, segments):
    chosen = plan(budget_gib * 2**30, max_seq_len=seq_len, max_supervised_tokens=seq_len // 2)
    assert chosen.num_segments == segments
    if segments > 1:  # one segment fewer does not fit
        sizes = {"max_seq_len": seq_len, "max_supervised_tokens": seq_len // 2, "weights_resident": True}
        assert not est(num_segments=segments - 1, **sizes).fits(budget_gib * 2**30)
