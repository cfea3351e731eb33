"""The admission estimate is never below a real step's peak (a small CPU run of
`qualification/memory_honesty.py`: fresh subprocess per case, peak RSS above the loaded model)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "qualification" / "memory_honesty.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("memory_honesty", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("memory_honesty", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    from kiln_train.model.tiny import write_tiny_checkpoint

    # The `small` layer shapes, 4 layers (3 GDN + 1 attention), a 16k vocabulary: a few seconds a case.
    out = tmp_path_factory.mktemp("small16k")
    overrides = {"vocab_size": 16384, "num_hidden_layers": 4}
    return str(write_tiny_checkpoint(out, "small", overrides=overrides, with_tokenizer=False))


@pytest.mark.parametrize(
    ("seq_len", "rank", "optimizer", "segments", "route"),
    [
        (2048, 16, "adam_w", 1, "kt_tape_flce"),
        (2048, 8, "muon", 2, "kt_tape_flce"),
        (512, 16, "sgd", 1, "full_logits"),
    ],
)
def test_estimate_covers_the_measured_peak(small_dir, seq_len, rank, optimizer, segments, route):
    honesty = _load_script()
    case = honesty.Case(seq_len, rank, optimizer, segments, route)
    estimate = honesty.estimate_case(small_dir, "cpu", case).total
    actual = honesty.measure(small_dir, "cpu", case)
    assert actual > 0
    assert estimate >= actual, (
        f"estimate {estimate / 2**20:.1f} MiB < actual {actual / 2**20:.1f} MiB for {case}"
    )
    if route == "kt_tape_flce":  # the training route: tight as well (docs/performance.md#estimate)
        assert estimate <= 1.3 * actual, f"estimate {estimate / actual:.2f}x the actual peak for {case}"


@pytest.mark.parametrize(
    ("seq_len", "optimizer", "route"),
    [(2048, "adam_w", "kt_tape_flce"), (512, "sgd", "full_logits")],
)
def test_the_validation_forward_estimate_covers_the_measured_peak(small_dir, seq_len, optimizer, route):
    honesty = _load_script()
    case = honesty.Case(seq_len, 16, optimizer, 1, route, phase="validation")
    estimate = honesty.estimate_case(small_dir, "cpu", case)
    actual = honesty.measure(small_dir, "cpu", case)
    assert actual > 0
    assert estimate.total >= actual, (
        f"forward estimate {estimate.total / 2**20:.1f} MiB < actual {actual / 2**20:.1f} MiB for {case}"
    )
    training = honesty.estimate_case(small_dir, "cpu", honesty.Case(seq_len, 16, optimizer, 1, route))
    assert estimate.total < training.total  # no backward: always less than a step of the same row
