"""The `kiln` entry point registers every command module; a missing one fails loudly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXPECTED_COMMANDS = {
    "adapters",
    "config",
    "data",
    "db",
    "demo",
    "health",
    "jobs",
    "model",
    "qualify",
    "serve",
    "tokenizer",
    "train",
    "up",
    "worker",
}


def _listed_commands(help_text: str) -> set[str]:
    section = help_text.split("Commands:", 1)[1]
    return {line.split()[0] for line in section.splitlines() if line.startswith("  ") and line.split()}


def test_kiln_help_lists_every_top_level_command():
    kiln = Path(sys.executable).with_name("kiln")
    result = subprocess.run([str(kiln), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert _listed_commands(result.stdout) == EXPECTED_COMMANDS


def test_health_lists_the_api_and_the_worker_probes():
    from click.testing import CliRunner

    from kiln_cli.main import cli

    result = CliRunner().invoke(cli, ["health", "--help"])
    assert result.exit_code == 0, result.output
    assert _listed_commands(result.output) == {"api", "worker"}


def test_a_missing_command_module_stops_the_entry_point():
    script = "import sys; sys.modules['kiln_cli.demo_cmd'] = None; import kiln_cli.main"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "kiln_cli.demo_cmd" in result.stderr
