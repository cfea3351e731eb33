"""Memory admission on the real Qwen3.5 sizes and extreme inputs (probe of kiln-contract §7)."""

from __future__ import annotations

import re

import pytest

from kiln_train.errors import TRAINING_WILL_NOT_FIT, KilnError
from kiln_train.model.config import QWEN35_4B_TEXT_CONFIG, parse_config
from kiln_train.plan.backend import FULL_LOGITS, KT_TAPE_FLCE, backend_for_device
from kiln_train.plan.memory import GIB, U64_MAX, estimate
from kiln_train.plan.segments import admissible_rank_ceiling, max_rank_that_fits, plan_segments

CUDA = backend_for_device("cuda")
CPU = backend_for_device("cpu")


def _size(hidden, inter, layers, heads, kv, v_heads, tied):
    return parse_config(
        {
            **QWEN35_4B_TEXT_CONFIG,
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "linear_num_value_heads": v_heads,
            "tie_word_embeddings": tied,
            "layer_types": [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
            ],
        }
    )


# qwen35.md §1.2: 0.8B / 4B / 9B / 27B.
SIZES = {
    "0.8b": _size(1024, 3584, 24, 8, 2, 16, True),
    "4b": parse_config(QWEN35_4B_TEXT_CONFIG),
    "9b": _size(4096, 12288, 32, 16, 4, 32, False),
    "27b": _size(5120, 17408, 64, 24, 4, 48, False),
}
NARROW = _size(256, 512, 4, 2, 1, 16, True)


def common(**kw):
    args = {
        "max_seq_len": 4096,
        "max_supervised_tokens": 2048,
        "lora_rank": 16,
        "optimizer_kind": "muon",
        "loss_route": KT_TAPE_FLCE,
        "backend": CUDA,
        "weights_resident": True,
    }
    args.update(kw)
    return args


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


@pytest.mark.parametrize("name", ["0.8b", "27b"])
def test_planner_picks_the_first_fitting_count_at_the_exact_boundary(name):
    config = SIZES[name]
    kw = common(max_seq_len=65536, max_supervised_tokens=4096)
    layers = config.num_hidden_layers
    totals = {s: estimate(config, num_segments=s, **kw).total for s in range(1, layers + 1)}
    for target in (2, 3, layers // 2, layers):
        budget = totals[target]
        first = min(s for s in totals if totals[s] <= budget)
        plan = plan_segments(config, **kw, available_bytes=budget)
        assert plan.num_segments == first and plan.breakdown.total == totals[first] <= budget
    smallest = min(totals.values())
    with pytest.raises(KilnError) as err:
        plan_segments(config, **kw, available_bytes=smallest - 1)
    assert err.value.code == TRAINING_WILL_NOT_FIT
    assert f"num_segments={layers})" in err.value.message
    assert f"(num_segments 1..={layers})" in err.value.message


def test_admissible_rank_ceiling_clamps_to_the_optimizer_tuple_range():
    """Memory alone may allow rank 1024, but CUDA Muon admits 2..=48: never advise outside that."""
    config = SIZES["4b"]
    assert admissible_rank_ceiling(config, 1024, optimizer_kind="muon", backend=CUDA) == 48
    assert admissible_rank_ceiling(config, 1024, optimizer_kind="adam_w", backend=CUDA) == 1024
    assert admissible_rank_ceiling(config, 1024, optimizer_kind="muon", backend=CPU) == 1024
    # Muon needs rank >= 2: a resource ceiling of 1 means no admissible rank.
    assert admissible_rank_ceiling(config, 1, optimizer_kind="muon", backend=CUDA) == 0
    assert admissible_rank_ceiling(config, 1, optimizer_kind="sgd", backend=CUDA) == 1


def _best(config, **kw):
    return min(
        estimate(config, num_segments=s, **common(**kw)).total for s in range(1, config.num_hidden_layers + 1)
    )


def test_413_for_rank_dominated_request_advises_an_admissible_rank():
    config = SIZES["4b"]
    short = {"max_seq_len": 16, "max_supervised_tokens": 8}
    at48, at2, at1 = (_best(config, lora_rank=r, **short) for r in (48, 2, 1))
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
            available_bytes=_best(config, lora_rank=1, optimizer_kind="sgd", **short),
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
