"""`kiln config show`: values with their sources, exit 2 on a bad configuration, and the README's
configuration reference is the one the command generates."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kiln_cli.config_cmd import configuration_reference
from kiln_cli.main import cli

ROOT = Path(__file__).resolve().parents[2]


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kiln.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_config_show_prints_values_and_sources(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_toml(tmp_path, "[server]\nport = 9300\n")
    monkeypatch.setenv("KILN_TRAINING_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("KILN_SERVER_API_TOKENS", "very-secret-token")
    result = CliRunner().invoke(cli, ["config", "show", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["key"]: r for r in json.loads(result.output)["settings"]}
    assert rows["server.port"]["value"] == 9300 and rows["server.port"]["source"].startswith("toml:")
    assert rows["training.max_attempts"] == {
        "key": "training.max_attempts",
        "value": 7,
        "source": "env:KILN_TRAINING_MAX_ATTEMPTS",
    }
    assert "very-secret-token" not in result.output
    assert rows["derived.database_url"]["value"].endswith("kiln.db")
    table = CliRunner().invoke(cli, ["config", "show"])
    assert (
        table.exit_code == 0
        and "server.port" in table.output
        and "[env:KILN_TRAINING_MAX_ATTEMPTS]" in table.output
    )


def test_config_show_exits_2_on_a_bad_configuration(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_toml(tmp_path, "[server]\nprot = 1\n")
    result = CliRunner().invoke(cli, ["config", "show"])
    assert result.exit_code == 2 and "unknown key server.prot" in result.output


def test_readme_configuration_reference_is_the_generated_one():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert configuration_reference() in readme
