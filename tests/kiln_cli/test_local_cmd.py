"""`kiln train local` as a person runs it: a real `kiln` process on the tiny checkpoint, its
output, the files it publishes and its exit status (docs/library.md#the-command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KILN = [sys.executable, "-m", "kiln_cli.main"]
ROOT = Path(__file__).resolve().parents[2]
RUN_FLAGS = ["--epochs", "2", "--rank", "4", "--alpha", "8", "--optimizer", "adam_w"]


def conversation(i: int) -> str:
    messages = [
        {"role": "user", "content": f"Item {i}: which color is listed?"},
        {"role": "assistant", "content": f"The color is {['red', 'blue', 'green'][i % 3]}."},
    ]
    return json.dumps({"messages": messages})


def kiln_local(model: Path, data: Path, output: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KILN_CONFIG": "", "PYTHONPATH": str(ROOT)}
    args = [*KILN, "train", "local", "--model", str(model), "--data", str(data), "--output", str(output)]
    return subprocess.run([*args, *flags], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_train_local_publishes_an_adapter_and_prints_its_receipt(tmp_path, tiny_model_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(conversation(i) for i in range(2)) + "\n", encoding="utf-8")
    output = tmp_path / "adapters"
    flags = [*RUN_FLAGS, "--seed", "3", "--checkpoint-interval", "2", "--output-name", "cli-run"]
    proc = kiln_local(tiny_model_dir, data, output, *flags)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"loading {tiny_model_dir} on cpu" in proc.stderr
    assert "step 1/4  epoch 1/2  loss" in proc.stderr  # the progress line of `kiln train sft`
    lines = proc.stdout.splitlines()
    assert lines[0] == "adapter cli-run published"
    assert f"  adapter path  {output / 'cli-run'}" in lines
    assert "  checkpoints   1 (latest cli-run-checkpoint-step-00000002.kiln-checkpoint)" in lines
    summary = lines[lines.index("receipt:") + 1 :]
    assert summary[0].split() == ["status", "success"]
    assert ["steps", "4/4"] in [line.split() for line in summary]
    assert ["seed", "3"] in [line.split() for line in summary]
    assert ["learning", "rate", "0.0001"] in [line.split() for line in summary]  # AdamW's default
    adapter = output / "cli-run"
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_manifest.json",
        "adapter_model.safetensors",
        "train_receipt.json",
    ]
    receipt = json.loads((adapter / "train_receipt.json").read_text(encoding="utf-8"))
    assert receipt["status"] == "success" and receipt["hyperparameters"]["seed"] == "3"
    assert receipt["data"]["sft_ingestion"]["source_locator"] == str(data)
    assert (output / "cli-run-checkpoint-step-00000002.kiln-checkpoint").is_dir()


@pytest.mark.slow
def test_train_local_json_skips_bad_lines_when_asked(tmp_path, tiny_model_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text(f"{conversation(0)}\n\nnot json\n{conversation(1)}\n", encoding="utf-8")
    output = tmp_path / "adapters"
    proc = kiln_local(tiny_model_dir, data, output, *RUN_FLAGS, "--invalid-row-policy", "skip", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "success" and result["global_step"] == result["total_steps"] == 4
    assert result["adapter_path"] == str(output / result["adapter_name"])
    assert Path(result["receipt_path"]).is_file()
    ingestion = result["receipt"]["data"]["sft_ingestion"]
    assert [(r["row_index"], r["reason"]) for r in ingestion["rejected_rows"]] == [(2, "invalid_json")]
    assert len(result["loss_history"]) == 4


def test_a_bad_row_exits_1_naming_the_row_and_its_line(tmp_path, tiny_model_dir):
    bad = json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]})
    data = tmp_path / "rows.jsonl"
    data.write_text(f"{conversation(0)}\n\n{bad}\n", encoding="utf-8")
    output = tmp_path / "adapters"
    proc = kiln_local(tiny_model_dir, data, output, *RUN_FLAGS)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (
        "kiln: training_invalid_request: Invalid training request: line 3: SFT row 2 (sha256:" in proc.stderr
    )
    assert "rejected as invalid_role" in proc.stderr
    assert f"note: SFT row 2 is line 3 of {data}" in proc.stderr
    assert proc.stdout == ""
    assert not output.exists()


def test_a_config_error_exits_1_naming_the_field(tmp_path, tiny_model_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text(conversation(0) + "\n", encoding="utf-8")
    output = tmp_path / "adapters"
    proc = kiln_local(tiny_model_dir, data, output, "--epochs", "0")
    assert proc.returncode == 1, proc.stderr
    assert "kiln: training_invalid_request: Invalid training request: config.epochs:" in proc.stderr
    assert "loading" not in proc.stderr  # refused before the model was loaded
    assert "Traceback" not in proc.stderr
    assert not output.exists()


def test_a_missing_model_directory_is_a_usage_error(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(conversation(0) + "\n", encoding="utf-8")
    proc = kiln_local(tmp_path / "absent", data, tmp_path / "adapters")
    assert proc.returncode == 2, proc.stderr
    assert "--model" in proc.stderr and "does not exist" in proc.stderr


@pytest.mark.slow
def test_held_out_rows_are_evaluated_and_printed_and_kept_in_the_receipt(tmp_path, tiny_model_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(conversation(i) for i in range(2)) + "\n", encoding="utf-8")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("\n".join(conversation(i) for i in range(5, 7)) + "\n", encoding="utf-8")
    output = tmp_path / "adapters"
    flags = [*RUN_FLAGS, "--validation-data", str(held_out), "--validation-interval", "1", "--json"]
    proc = kiln_local(tiny_model_dir, data, output, *flags)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    evaluations = result["receipt"]["validation"]["evaluations"]
    # the baseline, then every step (steps 2 and 4 are also epoch ends: evaluated once)
    assert [e["global_step"] for e in evaluations] == [0, 1, 2, 3, 4]
    assert [e["global_step"] for e in result["validation_history"]] == [0, 1, 2, 3, 4]
    assert result["receipt"]["validation"]["rows"] == 2
    baseline = evaluations[0]
    assert f"validation at baseline (base model): loss {baseline['loss']:.4f}" in proc.stderr
    last = evaluations[-1]
    assert f"validation at step 4, epoch 2: loss {last['loss']:.4f}" in proc.stderr
    assert proc.stderr.count("validation at ") == 5


def test_a_bad_held_out_row_exits_1_naming_its_line(tmp_path, tiny_model_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text(conversation(0) + "\n", encoding="utf-8")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(f"{conversation(1)}\n\nnot json\n", encoding="utf-8")
    output = tmp_path / "adapters"
    proc = kiln_local(tiny_model_dir, data, output, *RUN_FLAGS, "--validation-data", str(held_out))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "kiln: training_invalid_request:" in proc.stderr
    assert "SFT validation row 2" in proc.stderr and "invalid_json" in proc.stderr
    assert f"note: SFT validation row 2 is line 3 of {held_out}" in proc.stderr
    assert not output.exists()


def test_validation_flags_that_contradict_each_other_are_usage_errors(tmp_path, tiny_model_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text(conversation(0) + "\n", encoding="utf-8")
    both = kiln_local(
        tiny_model_dir, data, tmp_path / "a", "--validation-data", str(data), "--holdout-percent", "10"
    )
    assert both.returncode == 2 and "give --validation-data or --holdout-percent, not both" in both.stderr
    alone = kiln_local(tiny_model_dir, data, tmp_path / "a", "--validation-interval", "2")
    assert alone.returncode == 2
    assert "--validation-interval needs --validation-data or --holdout-percent" in alone.stderr
    assert not (tmp_path / "a").exists()
