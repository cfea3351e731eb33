"""qualification/bench_activations.py measures what autograd keeps for backward, per token and
layer, beside the derived minimum (docs/performance.md#saved-activations)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kiln_train.model.config import FULL_ATTENTION, LINEAR_ATTENTION, QWEN35_4B_TEXT_CONFIG, parse_config
from kiln_train.plan.formulas import minimum_saved_bytes_per_token

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "qualification" / "bench_activations.py"


def test_the_minimum_at_4b_widths_is_the_documented_sum():
    config = parse_config(QWEN35_4B_TEXT_CONFIG)
    # GDN: 2·2560 norm inputs + 2·9216 gate/up + 8192 conv input + 2·32 gates + 2·4096 (o, z)
    assert minimum_saved_bytes_per_token(config, LINEAR_ATTENTION, 2) == 2 * 40_000
    # attention: 2·2560 + 2·9216 + 4096 query + 2·1024 key/value + 2·4096 (output, gate)
    assert minimum_saved_bytes_per_token(config, FULL_ATTENTION, 2) == 2 * 37_888
    assert minimum_saved_bytes_per_token(config, LINEAR_ATTENTION, 4) == 4 * 40_000


def _run(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "tiny", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("RESULT ")
    assert any(line.startswith("| gdn_layer |") for line in lines)
    return json.loads(lines[-1][len("RESULT ") :])


def test_the_bench_counts_saved_bytes_by_kind_next_to_the_minimum():
    result = _run("--seq-len", "128")
    saved, minimum = result["saved"], result["minimum"]
    assert result["dtype"] == "bf16" and result["seq_len"] == 128
    for kind in ("gdn_layer", "attention_layer", "mean_layer"):
        # nothing keeps less than what LoRA's backward needs; the model keeps within 1.5x of it
        assert minimum[kind] <= saved[kind] <= 1.5 * minimum[kind], (kind, saved[kind], minimum[kind])
    assert saved["gdn"] > 0 and saved["mlp"] > 0
