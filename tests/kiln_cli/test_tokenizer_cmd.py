"""`kiln tokenizer build` through click's CliRunner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import kiln_cli.tokenizer_cmd as tokenizer_cmd
from kiln_cli.main import cli


@pytest.fixture()
def runner():
    return CliRunner()


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
