"""Typed configuration: kiln.toml + KILN_<SECTION>_<FIELD> + CLI flags (docs/configuration.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.settings import ConfigError, check_bind_safety, load_settings
from kiln_cli.main import cli


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kiln.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_need_no_services(tmp_path):
    loaded = load_settings(environ={}, cwd=tmp_path)
    s = loaded.settings
    assert s.database_url.startswith("sqlite:///") and s.database_url.endswith("/.kiln/kiln.db")
    assert s.broker_url.startswith("sqla+sqlite:///")
    assert s.model.device == "cpu"
    assert s.model_path == (Path(".kiln") / "models" / "default").resolve()
    assert loaded.sources == {} and loaded.config_file is None


def test_precedence_cli_over_env_over_toml_over_default(tmp_path):
    toml = write_toml(
        tmp_path, "[server]\nport = 9001\nhost = '127.0.0.2'\n[training]\nmax_queued_jobs = 5\n"
    )
    env = {"KILN_SERVER_PORT": "9002", "KILN_STORAGE_ROOT": str(tmp_path / "store")}
    loaded = load_settings(toml, cli={"server.port": 9003}, environ=env)
    s = loaded.settings
    assert s.server.port == 9003 and loaded.sources["server.port"] == "cli"
    assert s.server.host == "127.0.0.2" and loaded.sources["server.host"] == f"toml:{toml}"
    assert s.storage_root == (tmp_path / "store").resolve()
    assert loaded.sources["storage.root"] == "env:KILN_STORAGE_ROOT"
    assert s.training.max_queued_jobs == 5
    assert s.training.lease_seconds == 120 and "training.lease_seconds" not in loaded.sources


def test_the_named_settings_have_predictable_env_names(tmp_path):
    env = {
        "KILN_STORAGE_ROOT": "/srv/kiln",
        "KILN_MODEL_PATH": "/models/q",
        "KILN_DATABASE_URL": "postgresql+psycopg://u:p@db/kiln",
        "KILN_QUEUE_BROKER_URL": "redis://r:6379/0",
        "KILN_SERVER_HOST": "0.0.0.0",
        "KILN_SERVER_PORT": "8500",
        "KILN_SERVER_API_TOKENS": "one,two",
    }
    s = load_settings(environ=env, cwd=tmp_path).settings
    assert str(s.storage.root) == "/srv/kiln" and str(s.model.path) == "/models/q"
    assert s.database_url == env["KILN_DATABASE_URL"] and s.broker_url == env["KILN_QUEUE_BROKER_URL"]
    assert (s.server.host, s.server.port, s.server.api_tokens) == ("0.0.0.0", 8500, ["one", "two"])
    assert load_settings(
        environ={"KILN_SERVER_API_TOKENS": '["a,b"]'}, cwd=tmp_path
    ).settings.server.api_tokens == ["a,b"]


def test_kiln_toml_in_the_working_directory_and_kiln_config_are_found(tmp_path):
    write_toml(tmp_path, "[server]\nport = 9100\n")
    assert load_settings(environ={}, cwd=tmp_path).settings.server.port == 9100
    other = tmp_path / "other.toml"
    other.write_text("[server]\nport = 9200\n")
    assert load_settings(environ={"KILN_CONFIG": str(other)}, cwd=tmp_path).settings.server.port == 9200


@pytest.mark.parametrize(
    ("toml", "fragment"),
    [
        ("[server]\nprot = 1\n", "unknown key server.prot"),
        ("[servr]\nport = 1\n", "unknown section [servr]"),
        ("[server]\nport = 0\n", "server.port"),
        ("[server]\nport = 'eighty'\n", "server.port"),
        ("[model]\ndevice = 'tpu'\n", "model.device"),
        ("[training]\nloss_route = 'full_logits'\n", "unknown key training.loss_route"),
        ("[server\n", "kiln.toml"),
    ],
)
def test_unknown_keys_and_bad_values_stop_start_up_with_path_and_reason(tmp_path, toml, fragment):
    with pytest.raises(ConfigError) as err:
        load_settings(write_toml(tmp_path, toml), environ={})
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"KILN_SERVER_PROT": "1"}, "KILN_SERVER_PROT: unknown setting server.prot"),
        ({"KILN_TRAINING_MAX_ATTEMPTS": "zero"}, "training.max_attempts (env:KILN_TRAINING_MAX_ATTEMPTS)"),
        ({"KILN_DATABASE_ECHO": "maybe"}, "KILN_DATABASE_ECHO: expected a boolean"),
        ({"KILN_USE_FLCE": "1"}, "KILN_USE_FLCE: this switch was removed"),
        ({"KILN_BF16_STOCHASTIC_ROUND": "1"}, "removed"),
    ],
)
def test_bad_environment_overrides_stop_start_up(tmp_path, env, fragment):
    with pytest.raises(ConfigError) as err:
        load_settings(environ=env, cwd=tmp_path)
    assert fragment in str(err.value)


def test_backend_owned_behaviour_has_no_setting(tmp_path):
    for key in ("loss_route", "sft_loss_route", "tape", "rounding", "stochastic_rounding"):
        for section in ("training", "model", "memory"):
            with pytest.raises(ConfigError):
                load_settings(write_toml(tmp_path, f"[{section}]\n{key} = 'x'\n"), environ={})


def test_non_loopback_bind_needs_tokens_or_explicit_permission(tmp_path):
    s = load_settings(environ={"KILN_SERVER_HOST": "0.0.0.0"}, cwd=tmp_path).settings
    with pytest.raises(ConfigError, match="not a loopback address"):
        check_bind_safety(s)
    check_bind_safety(
        load_settings(environ={"KILN_SERVER_HOST": "0.0.0.0", "KILN_SERVER_API_TOKENS": "t"}).settings
    )
    allowed = {"KILN_SERVER_HOST": "0.0.0.0", "KILN_SERVER_ALLOW_UNAUTHENTICATED_REMOTE": "true"}
    check_bind_safety(load_settings(environ=allowed, cwd=tmp_path).settings)


@pytest.mark.parametrize(
    ("toml", "reason"),
    [
        (
            "[training]\nlease_seconds = 10\nheartbeat_seconds = 5\n",
            "heartbeat_seconds (5) must be at most lease_seconds / 3",
        ),
        (
            "[training]\nheartbeat_seconds = 10\nrunner_stale_seconds = 15\nlease_seconds = 60\n",
            "runner_stale_seconds (15) must be at least twice heartbeat_seconds (10)",
        ),
    ],
)
def test_contradicting_timings_stop_start_up_with_the_reason(tmp_path, monkeypatch, toml, reason):
    monkeypatch.chdir(tmp_path)
    write_toml(tmp_path, toml)
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert reason in str(refused.value)
    for command in (["config", "show"], ["worker"]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 2 and reason in result.output, result.output


def test_timings_at_the_limits_are_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_toml(tmp_path, "[training]\nlease_seconds = 15\nheartbeat_seconds = 5\nrunner_stale_seconds = 10\n")
    training = load_settings().settings.training
    assert (training.lease_seconds, training.heartbeat_seconds, training.runner_stale_seconds) == (
        15,
        5.0,
        10,
    )
