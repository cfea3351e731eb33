"""qualification/bench_recompute.py counts a step's FLOPs per segment count: selective recompute
keeps every segmented plan within 1.35x of the one-segment step (docs/performance.md#recompute)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "qualification" / "bench_recompute.py"


def test_segmented_plans_cost_at_most_a_third_more_flops():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "tiny", "--seq-len", "128", "--layers", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("RESULT ")
    rows = {row["segments"]: row for row in json.loads(lines[-1][len("RESULT ") :])["rows"]}
    assert sorted(rows) == [1, 2, 4]
    assert rows[1]["ratio"] == 1.0
    # More segments recompute more layers (all but the last segment), never a whole step again.
    assert 1.0 < rows[2]["ratio"] < rows[4]["ratio"] <= 1.35
    assert rows[4]["flops"] > rows[2]["flops"] > rows[1]["flops"]
