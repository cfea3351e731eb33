"""`kiln tokenizer build` and `kiln data inspect` through click's CliRunner."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import kiln.cli.tokenizer_cmd as tokenizer_cmd
from kiln.cli.main import cli
from kiln_train.data.chat_template import official_chat_template
from kiln_train.data.ingestion import ingest_jsonl

DEMO = Path(__file__).resolve().parents[3] / "examples" / "demo.jsonl"
GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
BAD_ROLE = {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}


@pytest.fixture()
def runner():
    return CliRunner()


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "\n".join([json.dumps(GOOD), "", json.dumps(BAD_ROLE), "{not json", json.dumps(GOOD)]) + "\n",
        encoding="utf-8",
    )
    return path


@pytest.fixture()
def model_dir(tmp_path, tokenizer_dir):
    out = tmp_path / "model"
    shutil.copytree(tokenizer_dir, out)
    (out / "chat_template.jinja").write_text(official_chat_template(), encoding="utf-8")
    return out


def test_tokenizer_build_writes_files_and_prints_ids(runner, tmp_path, qwen_tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer_cmd, "build_tokenizer", lambda: qwen_tokenizer)
    result = runner.invoke(cli, ["tokenizer", "build", str(tmp_path / "tok")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tok" / "tokenizer.json").stat().st_size > 30_000_000
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend"
    assert "vocab size 248077 (BPE 248044)" in result.output
    assert " 248045  <|im_start|>" in result.output
    assert " 248046  <|im_end|>" in result.output
    assert " 248076  <|audio_pad|>" in result.output


def test_inspect_demo_dataset_all_rows_kept(runner, model_dir):
    result = runner.invoke(cli, ["data", "inspect", str(DEMO), "--model", str(model_dir)])
    assert result.exit_code == 0, result.output
    assert result.output.count("── row ") == 30
    assert "30 row(s) read, 30 kept, 0 rejected (policy fail)" in result.output
    # supervised spans are bracketed when stdout is not a terminal
    assert "⟦<think>\n\n</think>\n\nThe capital of Australia is Canberra.<|im_end|>\n⟧" in result.output
    assert "<|im_start|>assistant\n⟦" in result.output


def test_inspect_fail_policy_shows_every_row_and_exits_nonzero(runner, model_dir, data_file):
    result = runner.invoke(cli, ["data", "inspect", str(data_file), "--model", str(model_dir)])
    assert result.exit_code == 1
    assert result.output.count("── row ") == 4
    assert "REJECTED invalid_role: messages[1].role is 'bot'" in result.output
    assert "REJECTED invalid_json" in result.output
    assert "SFT row 2 (sha256:" in result.output and "rejected as invalid_role" in result.output


def test_inspect_json_matches_ingestion(runner, model_dir, data_file, qwen_tokenizer):
    result = runner.invoke(
        cli, ["data", "inspect", str(data_file), "--model", str(model_dir), "--policy", "skip", "--json"]
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    rows, receipt = lines[:-1], lines[-1]
    assert [r["row_index"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("rejection") for r in rows] == [None, "invalid_role", "invalid_json", None]
    expected = ingest_jsonl(data_file, tokenizer=qwen_tokenizer, policy="skip")
    assert receipt == expected.receipt
    assert rows[0]["input_ids"] == expected.rows[0].input_ids
    assert rows[0]["labels"] == expected.rows[0].labels
    assert rows[3]["row_sha256"] == expected.rows[1].row_sha256
    assert receipt["rejected_rows"] == [
        {"row_index": 2, "row_sha256": rows[1]["row_sha256"], "reason": "invalid_role"},
        {"row_index": 3, "row_sha256": rows[2]["row_sha256"], "reason": "invalid_json"},
    ]


def test_inspect_json_fail_policy_ends_with_error_envelope(runner, model_dir, data_file):
    result = runner.invoke(cli, ["data", "inspect", str(data_file), "--model", str(model_dir), "--json"])
    assert result.exit_code == 1
    last = json.loads(result.output.splitlines()[-1])
    assert last["error"]["code"] == "training_invalid_request"
    assert "SFT row 2 (" in last["error"]["message"]


def test_inspect_refuses_a_foreign_chat_template(runner, model_dir):
    (model_dir / "chat_template.jinja").write_text("{{ messages }}", encoding="utf-8")
    result = runner.invoke(cli, ["data", "inspect", str(DEMO), "--model", str(model_dir)])
    assert result.exit_code == 2
    assert "not an official Qwen3.5 template" in result.output


@pytest.mark.parametrize(
    "write, needle",
    [
        (lambda d: (d / "chat_template.jinja").write_bytes(b"\xff{{ x }}"), "chat_template.jinja in"),
        (
            lambda d: (
                (d / "chat_template.jinja").unlink(),
                (d / "tokenizer_config.json").write_text('{"chat_template": 5}', encoding="utf-8"),
            ),
            "field 'chat_template' is a number",
        ),
    ],
)
def test_inspect_names_an_unreadable_template_source(runner, model_dir, write, needle):
    write(model_dir)
    result = runner.invoke(cli, ["data", "inspect", str(DEMO), "--model", str(model_dir)])
    assert result.exit_code == 2
    assert needle in result.output and "Traceback" not in result.output


def test_inspect_without_model_uses_the_tokenizer_cache(
    runner, tmp_path, monkeypatch, qwen_tokenizer, data_file
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built = []
    monkeypatch.setattr(tokenizer_cmd, "build_tokenizer", lambda: built.append(1) or qwen_tokenizer)
    first = runner.invoke(cli, ["data", "inspect", str(data_file), "--policy", "skip", "--json"])
    assert first.exit_code == 0, first.output
    cached = tmp_path / "cache" / "kiln" / "tokenizer" / tokenizer_cmd.cache_key() / "tokenizer.json"
    assert cached.is_file() and built == [1]
    second = runner.invoke(cli, ["data", "inspect", str(data_file), "--policy", "skip", "--json"])
    assert second.exit_code == 0
    assert built == [1]  # loaded from the cache, not rebuilt
    assert second.output == first.output
