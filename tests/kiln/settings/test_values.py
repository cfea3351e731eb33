"""Configuration values are checked at load: of the wrong type, out of range, blank, malformed or
misspelt, they are refused, never coerced, ignored or accepted until something breaks.

Each case stops start-up (`kiln config show`, `kiln serve`, `kiln worker`: exit 2, one line naming
the setting and the reason, no traceback) or, for KILN_ variables that are clearly not settings, is
reported as a warning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.settings import ConfigError, load_settings
from kiln_cli.main import cli


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kiln.toml"
    path.write_text(text, encoding="utf-8")
    return path


def refused(tmp_path: Path, *, text: str | None = None, env: dict[str, str] | None = None) -> str:
    path = toml(tmp_path, text) if text is not None else None
    with pytest.raises(ConfigError) as err:
        load_settings(path, environ=env or {}, cwd=tmp_path)
    return str(err.value)


# ----- TOML is typed: a wrong type is refused, not coerced ---------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[server]\nport = true\n", "server.port: expected an integer, got a boolean (True)"),
        ("[server]\nport = '8000'\n", "server.port: expected an integer, got a string ('8000')"),
        ("[server]\nport = 8000.0\n", "server.port: expected an integer, got a float (8000.0)"),
        ("[database]\necho = 'yes'\n", "database.echo: expected true or false, got a string ('yes')"),
        ("[database]\necho = 1\n", "database.echo: expected true or false, got an integer (1)"),
        (
            "[training]\nlease_seconds = 1979-05-27\n",
            "training.lease_seconds: expected an integer, got a date",
        ),
        ("[server]\napi_tokens = 'abc'\n", "server.api_tokens: expected an array of strings, got a string"),
        ("[storage]\nroot = 5\n", "storage.root: expected a string (a path), got an integer (5)"),
        ("[memory]\nreserve_gb = true\n", "memory.reserve_gb: expected a number, got a boolean"),
    ],
)
def test_toml_values_of_the_wrong_type_are_refused(tmp_path, text, needle):
    message = refused(tmp_path, text=text)
    assert needle in message and str(tmp_path / "kiln.toml") in message


def test_toml_numbers_that_are_right_still_load(tmp_path):
    s = load_settings(
        toml(tmp_path, "[memory]\nreserve_gb = 2\ntraining_memory_gb = 10.5\n[database]\necho = true\n"),
        environ={},
    ).settings
    assert s.memory.reserve_gb == 2.0 and s.memory.training_memory_gb == 10.5 and s.database.echo is True


def test_a_byte_order_mark_is_tolerated(tmp_path):
    path = tmp_path / "kiln.toml"
    path.write_bytes(b"\xef\xbb\xbf[server]\nport = 9101\n")
    assert load_settings(path, environ={}).settings.server.port == 9101


# ----- values that pass the type but cannot work ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[server]\nmax_request_mb = inf\n", "server.max_request_mb (toml:"),
        ("[memory]\nreserve_gb = inf\n", "memory.reserve_gb (toml:"),
        ("[memory]\ntraining_memory_gb = inf\n", "memory.training_memory_gb (toml:"),
        ("[training]\nheartbeat_seconds = inf\n", "training.heartbeat_seconds (toml:"),
        ("[training]\nreconcile_interval_seconds = inf\n", "training.reconcile_interval_seconds (toml:"),
    ],
)
def test_infinite_floats_are_refused(tmp_path, text, needle):
    message = refused(tmp_path, text=text)
    assert needle in message and "finite number" in message


@pytest.mark.parametrize(
    "key",
    [
        "training.lease_seconds",
        "training.runner_stale_seconds",
        "training.max_queued_jobs",
        "training.checkpoint_interval",
        "queue.visibility_timeout_s",
    ],
)
def test_integers_beyond_a_32_bit_bound_are_refused(tmp_path, key):
    section, name = key.split(".")
    message = refused(tmp_path, text=f"[{section}]\n{name} = 99999999999999999\n")
    assert f"{key} (toml:" in message and "less than or equal to 2147483647" in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nhost = ''\n", "server.host"),
        ("[server]\nhost = '   '\n", "server.host"),
        ("[queue]\nqueue_name = '  '\n", "queue.queue_name"),
        ("[storage]\nroot = ''\n", "storage.root"),
        ("[model]\npath = ''\n", "model.path"),
        ("[database]\nurl = ''\n", "database.url"),
        ("[queue]\nbroker_url = ' '\n", "queue.broker_url"),
    ],
)
def test_blank_text_settings_are_refused(tmp_path, text, key):
    message = refused(tmp_path, text=text)
    assert f"{key} (toml:" in message and "must not be blank" in message


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        (
            {"KILN_DATABASE_URL": "not a url"},
            "database.url (env:KILN_DATABASE_URL): Value error, not a SQLAlchemy URL",
        ),
        ({"KILN_QUEUE_BROKER_URL": "redis-host:6379"}, "queue.broker_url (env:KILN_QUEUE_BROKER_URL)"),
        ({"KILN_QUEUE_BROKER_URL": "nope"}, "not a broker URL"),
        ({"KILN_QUEUE_BROKER_URL": "gopher://x"}, "unknown broker transport 'gopher'"),
    ],
)
def test_malformed_urls_are_refused_at_load(tmp_path, env, needle):
    assert needle in refused(tmp_path, env=env)


def test_a_url_with_a_password_is_refused_without_echoing_it(tmp_path):
    message = refused(tmp_path, env={"KILN_DATABASE_URL": "postgres ql://kiln:hunter2@db/kiln"})
    assert "database.url" in message and "hunter2" not in message


def test_well_formed_urls_still_load(tmp_path):
    env = {
        "KILN_DATABASE_URL": "postgresql+psycopg://kiln:pw@db:5432/kiln",
        "KILN_QUEUE_BROKER_URL": "sqla+sqlite:////var/lib/kiln/broker.db",
    }
    s = load_settings(environ=env, cwd=tmp_path).settings
    assert s.database_url == env["KILN_DATABASE_URL"] and s.broker_url == env["KILN_QUEUE_BROKER_URL"]


# ----- environment spellings --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        (
            {"KILN_SERVER_PORT": ""},
            'KILN_SERVER_PORT: empty value; unset the variable to use the default ("8420")',
        ),
        ({"KILN_SERVER_HOST": "  "}, "KILN_SERVER_HOST: empty value"),
        (
            {"KILN_STORAGE_ROOT": ""},
            'KILN_STORAGE_ROOT: empty value; unset the variable to use the default (".kiln")',
        ),
        ({"KILN_MODEL_DEVICE": ""}, "KILN_MODEL_DEVICE: empty value"),
        ({"KILN_QUEUE_QUEUE_NAME": ""}, "KILN_QUEUE_QUEUE_NAME: empty value"),
    ],
)
def test_an_empty_variable_for_a_setting_with_a_default_names_the_variable(tmp_path, env, needle):
    assert needle in refused(tmp_path, env=env)


def test_an_empty_variable_for_an_optional_setting_means_unset(tmp_path):
    env = {"KILN_DATABASE_URL": "", "KILN_MODEL_PATH": " ", "KILN_TRAINING_CHECKPOINT_INTERVAL": ""}
    s = load_settings(environ=env, cwd=tmp_path).settings
    assert s.database.url is None and s.model.path is None and s.training.checkpoint_interval is None


def test_null_is_a_value_for_a_setting_that_cannot_be_null(tmp_path):
    """`none` is a legal queue name; only optional settings read null/none as unset."""
    s = load_settings(environ={"KILN_QUEUE_QUEUE_NAME": "none"}, cwd=tmp_path).settings
    assert s.queue.queue_name == "none"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ('{"a": "b"}', "KILN_SERVER_API_TOKENS: a JSON dict is not a list"),
        ('"tok"', "api token 1 is wrapped in quotes"),
        ("'tok'", "api token 1 is wrapped in quotes"),
        ("good,has space", "api token 2 must be printable ASCII without spaces"),
        ('["tok\\u00e9"]', "api token 1 must be printable ASCII"),
        ('[" tok"]', "api token 1 must be printable ASCII without spaces"),
    ],
)
def test_api_tokens_that_could_never_be_presented_are_refused(tmp_path, raw, needle):
    assert needle in refused(tmp_path, env={"KILN_SERVER_API_TOKENS": raw})


@pytest.mark.parametrize(
    ("raw", "tokens"),
    [("a,b", ["a", "b"]), (" a , b ,", ["a", "b"]), ('["a,b", "c"]', ["a,b", "c"]), ("", []), ("[]", [])],
)
def test_api_token_spellings_that_work(tmp_path, raw, tokens):
    s = load_settings(environ={"KILN_SERVER_API_TOKENS": raw}, cwd=tmp_path).settings
    assert s.server.api_tokens == tokens


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("KILN_SERVR_PORT", "KILN_SERVER_PORT"),
        ("KILN_DATABSE_URL", "KILN_DATABASE_URL"),
        ("KILN_server_port", "KILN_SERVER_PORT"),
        ("KILN_STORAGEROOT", "KILN_STORAGE_ROOT"),
    ],
)
def test_a_misspelt_setting_variable_stops_start_up_with_a_suggestion(tmp_path, name, suggestion):
    assert f"{name}: not a Kiln setting; did you mean {suggestion}?" in refused(tmp_path, env={name: "1"})


def test_other_kiln_variables_are_warnings_and_the_known_ones_are_silent(tmp_path):
    env = {
        "KILN_FOO": "x",
        "KILN_API_URL": "http://h:1",
        "KILN_API_TOKEN": "t",
        "KILN_API_TOKENS": "t",
        "KILN_MODEL_NAME": "Qwen3.5-4B",
        "KILN_GPU_DEVICE": "0",
        "KILN_API_PORT": "8420",
    }
    loaded = load_settings(environ=env, cwd=tmp_path)
    assert loaded.warnings == ["KILN_FOO is not a Kiln setting and is ignored"]


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    assert "is a directory, not a kiln.toml file" in refused(tmp_path, env={"KILN_CONFIG": str(tmp_path)})
    with pytest.raises(ConfigError, match="--config .*: is a directory"):
        load_settings(tmp_path, environ={})


# ----- the commands: exit 2, the setting and the reason, no traceback -----------------------------


def run(args: list[str], env: dict[str, str], tmp_path: Path):
    base = {
        "KILN_CONFIG": "",
        "KILN_API_URL": "",
        "KILN_API_TOKEN": "",
        "KILN_STORAGE_ROOT": str(tmp_path / "s"),
    }
    return CliRunner().invoke(cli, args, env={**base, **env})


@pytest.mark.parametrize("command", [["config", "show"], ["serve"], ["worker"], ["db", "upgrade"]])
@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"KILN_SERVR_PORT": "9000"}, "KILN_SERVR_PORT: not a Kiln setting; did you mean KILN_SERVER_PORT?"),
        ({"KILN_SERVER_MAX_REQUEST_MB": "inf"}, "server.max_request_mb (env:KILN_SERVER_MAX_REQUEST_MB)"),
        ({"KILN_SERVER_PORT": ""}, "KILN_SERVER_PORT: empty value"),
        ({"KILN_DATABASE_URL": "not a url"}, "database.url (env:KILN_DATABASE_URL)"),
    ],
)
def test_commands_refuse_to_start(tmp_path, command, env, needle):
    result = run(command, env, tmp_path)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert "kiln: configuration error: " in result.output and needle in result.output


def test_config_show_prints_warnings_on_stderr_and_still_shows(tmp_path):
    result = CliRunner().invoke(
        cli,
        ["config", "show", "--json"],
        env={"KILN_CONFIG": "", "KILN_FOO": "1", "KILN_STORAGE_ROOT": str(tmp_path)},
    )
    assert result.exit_code == 0, result.output
    assert "kiln: warning: KILN_FOO is not a Kiln setting and is ignored" in result.stderr
    rows = {r["key"]: r for r in json.loads(result.stdout)["settings"]}
    assert rows["storage.root"]["value"] == str(tmp_path)
