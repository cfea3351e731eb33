"""qualification/gpu_bench.py runs the product's step end to end on the CPU (`--preset tiny`), so
the GPU benchmark cannot rot: finetune under each budget, the kernels' own timings, a profile,
transformers + PEFT, one markdown table and a RESULT line with the same rows; and a run that
exceeds its time limit ends with rows saying so instead of hanging."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "qualification" / "gpu_bench.py"

pytestmark = pytest.mark.slow


def _run(*args: str, timeout: float = 900) -> tuple[int, list[str], dict]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--preset", "tiny", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    lines = proc.stdout.splitlines()
    assert lines and lines[-1].startswith("RESULT "), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, lines, json.loads(lines[-1][len("RESULT ") :])


def _table(lines: list[str]) -> list[list[str]]:
    start = next(i for i, line in enumerate(lines) if line.startswith("| run |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def bench():
    return _run("--profile")


def test_the_tiny_run_fills_every_row(bench):
    code, lines, result = bench
    assert code == 0 and result["failed"] == 0, lines[-30:]
    kiln = [r for r in result["rows"] if r["side"] == "kiln"]
    assert [(r["length"], r["budget_gib"]) for r in kiln] == [
        (64, 0.093),
        (64, 1.0),
        (256, 0.093),
        (256, 1.0),
    ]
    for r in kiln:
        assert r["status"] == "ok" and r["gdn_path"] == "torch-chunked"
        assert r["timed_steps"] == 1 and r["step_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["length"] / r["step_s"])
        assert r["pct_peak"] > 0 and r["peak_gib"] > 0
        assert r["estimate_gib"] > 0 and r["estimate_over_peak"] >= 1  # the estimate bounds the step
    segments = {(r["length"], r["budget_gib"]): r["segments"] for r in kiln}
    assert segments[(256, 0.093)] > 1 == segments[(256, 1.0)] == segments[(64, 1.0)]


def test_transformers_runs_beside_and_fla_says_why_not(bench):
    _, _, result = bench
    theirs = {r["gdn_path"]: r for r in result["rows"] if r["side"] == "transformers+peft"}
    assert theirs["torch"]["status"] == "ok" and theirs["torch"]["length"] == 128
    assert theirs["torch"]["step_s"] > 0 and theirs["torch"]["budget_gib"] is None
    assert theirs["fla"]["status"] == "skipped: the flash-linear-attention gated delta rule runs on CUDA only"


def test_the_table_shows_the_result_rows(bench):
    _, lines, result = bench
    table = _table(lines)
    assert len(table) == len(result["rows"]) == 6
    for cells, row in zip(table, result["rows"], strict=True):
        assert cells[0] == row["side"] and cells[1] == str(row["length"])
        if row["status"] == "ok":
            assert cells[5] == f"{row['step_s']:.3f}" and cells[3] == str(row["segments"])
            assert cells[-1] == ""
        else:
            assert cells[5] == "—" and cells[-1] == row["status"]


def test_the_cpu_run_records_the_reference_kernels_and_their_timings(bench):
    _, lines, result = bench
    assert set(result["kernel_paths"].values()) == {"torch", "torch-chunked"}
    assert sorted(result["kernels"]) == ["causal_conv1d_silu", "gated_rms_norm", "offset_rms_norm", "swiglu"]
    assert all(set(t) == {"torch"} and t["torch"] > 0 for t in result["kernels"].values())
    assert any(line.startswith("# kernel swiglu forward+backward at T=64: torch ") for line in lines)
    assert any("Self CPU" in line for line in lines)  # the profile's table


def test_a_run_out_of_time_reports_rows_instead_of_hanging():
    start = time.monotonic()
    code, lines, result = _run("--time-limit", "3", timeout=120)
    assert time.monotonic() - start < 60
    assert code == 1 and len(result["rows"]) == 6
    assert result["failed"] == 7  # the six rows and the kernels' timings
    assert all(r["status"].startswith("not run: ") for r in result["rows"])
    assert _table(lines)[0][-1].startswith("not run: ")
