"""User errors on the command line end in one message and a nonzero exit, never a traceback.

Each case is an input a person typed (a bad kiln.toml, a bad environment variable, an unusable
--url, an unwritable download target, a database that is down, a port already taken, a broken
model directory, ...). The assertions check the exit status, that the message names the thing at
fault, and that click saw a clean `SystemExit` rather than an escaping exception.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import kiln_cli.tokenizer_cmd as tokenizer_cmd
import kiln_train.data.packaged_tokenizer as packaged_tokenizer
from kiln_cli.http_client import BadUrl, normalize_url
from kiln_cli.main import cli
from tests.kiln_cli.processes import ctrl_c_default

CLOSED_URL = "http://127.0.0.1:9"  # discard port: nothing listens there
DOWN_POSTGRES = "postgresql+psycopg://kiln:secret@127.0.0.1:9/kiln"


def invoke(args: list[str], env: dict[str, str] | None = None):
    base = {"KILN_CONFIG": "", "KILN_API_URL": "", "KILN_API_TOKEN": ""}
    return CliRunner().invoke(cli, args, env={**base, **(env or {})})


def assert_clean_exit(result, code: int, *needles: str) -> None:
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, (needle, result.output)


# ----- configuration ----------------------------------------------------------------------------


def test_kiln_toml_that_is_not_utf8_names_the_file(tmp_path):
    (tmp_path / "kiln.toml").write_bytes(b"\xff\xfe[server]\n")
    result = CliRunner().invoke(cli, ["config", "show", "--config", str(tmp_path / "kiln.toml")])
    assert_clean_exit(result, 2, f"{tmp_path / 'kiln.toml'}: not UTF-8 text")


def test_a_list_variable_that_is_broken_json_names_the_variable():
    result = invoke(["config", "show"], env={"KILN_SERVER_API_TOKENS": '["a",'})
    assert_clean_exit(result, 2, "KILN_SERVER_API_TOKENS: not a JSON list")


def test_a_comma_list_variable_still_works():
    result = invoke(["config", "show", "--json"], env={"KILN_SERVER_API_TOKENS": "a, b"})
    assert result.exit_code == 0, result.output
    rows = {r["key"]: r for r in json.loads(result.output)["settings"]}
    assert rows["server.api_tokens"]["value"] == ["<redacted 1 chars>", "<redacted 1 chars>"]
    assert rows["server.api_tokens"]["source"] == "env:KILN_SERVER_API_TOKENS"


# ----- --url --------------------------------------------------------------------------------------


def test_url_forms():
    assert normalize_url("127.0.0.1:8420") == "http://127.0.0.1:8420"
    assert normalize_url("localhost:8420/") == "http://localhost:8420"
    assert normalize_url(" https://kiln.example/ ") == "https://kiln.example"
    assert normalize_url("http://[::1]:8420") == "http://[::1]:8420"
    for bad, reason in [
        ("ftp://127.0.0.1:8420", "only http:// and https://"),
        ("http://127.0.0.1:99999", "out of range"),
        ("http://:8420", "names no host"),
        ("http://h:8420/?x=1", "no query"),
        ("", "is empty"),
    ]:
        with pytest.raises(BadUrl, match=reason):
            normalize_url(bad)


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["jobs", "list", "--url", "ftp://127.0.0.1:8420"], {}, "only http:// and https://"),
        (["jobs", "list"], {"KILN_API_URL": "gopher://x"}, "'gopher://x'"),
        (["adapters", "list", "--url", "http://127.0.0.1:70000"], {}, "out of range"),
    ],
)
def test_an_unusable_url_is_a_usage_error(args, env, needle):
    result = invoke(args, env=env)
    assert_clean_exit(result, 2, "Invalid value for '--url'", needle)


def test_a_scheme_less_url_reaches_the_address_it_names():
    result = invoke(["jobs", "list", "--url", "127.0.0.1:9"])
    assert_clean_exit(result, 3, "cannot reach the Kiln api: http://127.0.0.1:9/v1/train/status")


@pytest.mark.parametrize(
    "args",
    [["jobs", "show", ""], ["jobs", "cancel", " "], ["adapters", "delete", ""], ["adapters", "download", ""]],
)
def test_an_empty_id_or_name_is_a_usage_error(args):
    result = invoke([*args, "--url", CLOSED_URL])
    assert_clean_exit(result, 2, "must not be empty")


# ----- adapter downloads: local targets are checked before anything is fetched --------------------


def test_download_into_a_missing_directory(tmp_path):
    target = tmp_path / "nope" / "a.tar.gz"
    result = invoke(["adapters", "download", "a", "-o", str(target), "--url", CLOSED_URL])
    assert_clean_exit(result, 2, f"cannot write {target}: directory {target.parent} does not exist")


def test_download_below_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "a.tar.gz"
    result = invoke(["adapters", "download", "a", "-o", str(target), "--url", CLOSED_URL])
    assert_clean_exit(result, 2, f"{tmp_path / 'afile'} is not a directory")


def test_download_over_an_existing_file_needs_force(tmp_path):
    target = tmp_path / "a.tar.gz"
    target.write_bytes(b"keep me")
    result = invoke(["adapters", "download", "a", "-o", str(target), "--url", CLOSED_URL])
    assert_clean_exit(result, 2, f"{target} exists; pass --force")
    assert target.read_bytes() == b"keep me"
    forced = invoke(["adapters", "download", "a", "-o", str(target), "--force", "--url", CLOSED_URL])
    assert_clean_exit(forced, 3, "cannot reach the Kiln api")  # checked locally, then fetched
    assert target.read_bytes() == b"keep me"


def test_extract_where_no_directory_can_be_made(tmp_path):
    (tmp_path / "afile").write_text("x")
    where = tmp_path / "afile" / "sub"
    result = invoke(["adapters", "download", "a", "--extract", str(where), "--url", CLOSED_URL])
    assert_clean_exit(result, 2, f"cannot create {where}")


# ----- health probe -------------------------------------------------------------------------------


def test_health_api_with_a_url_that_is_not_one():
    result = invoke(["health", "api", "--url", "nope"])
    assert_clean_exit(result, 1, "nope: not a usable URL")


# ----- database, port, storage --------------------------------------------------------------------


@pytest.mark.parametrize("command", [["db", "upgrade"], ["serve"], ["worker"]])
def test_a_database_that_is_down_is_one_line(tmp_path, command):
    env = {"KILN_STORAGE_ROOT": str(tmp_path / "s"), "KILN_DATABASE_URL": DOWN_POSTGRES}
    result = invoke(command, env=env)
    assert_clean_exit(
        result,
        2,
        f"kiln {' '.join(command)}: job database postgresql+psycopg://kiln:***@127.0.0.1:9/kiln:",
        "check database.url (KILN_DATABASE_URL)",
    )
    assert "secret" not in result.output


def test_db_upgrade_waits_for_a_database_that_is_down_then_says_how_long(tmp_path):
    env = {"KILN_STORAGE_ROOT": str(tmp_path / "s"), "KILN_DATABASE_URL": DOWN_POSTGRES}
    started = time.monotonic()
    result = invoke(["db", "upgrade", "--wait", "2"], env=env)
    assert time.monotonic() - started >= 1.5
    assert_clean_exit(
        result,
        2,
        "kiln db upgrade: waiting for the job database (",
        "kiln db upgrade: job database postgresql+psycopg://kiln:***@127.0.0.1:9/kiln:",
        "(no answer after waiting 2 s, ",
        "check database.url (KILN_DATABASE_URL)",
    )
    assert "secret" not in result.output


def test_a_database_url_sqlalchemy_cannot_use(tmp_path):
    env = {"KILN_STORAGE_ROOT": str(tmp_path / "s"), "KILN_DATABASE_URL": "bogus://x"}
    result = invoke(["db", "upgrade"], env=env)
    assert_clean_exit(result, 2, "job database bogus://x: Can't load plugin: sqlalchemy.dialects:bogus")


def test_an_unknown_revision(tmp_path):
    result = invoke(["db", "upgrade", "--revision", "nope"], env={"KILN_STORAGE_ROOT": str(tmp_path)})
    assert_clean_exit(result, 2, "Can't locate revision identified by 'nope'")


def test_a_storage_root_that_cannot_be_created(tmp_path):
    (tmp_path / "afile").write_text("x")
    result = invoke(["db", "upgrade"], env={"KILN_STORAGE_ROOT": str(tmp_path / "afile" / "root")})
    assert_clean_exit(result, 2, "cannot create the storage directories", "KILN_STORAGE_ROOT")


def test_serve_on_a_port_already_in_use(tmp_path):
    env = {"KILN_STORAGE_ROOT": str(tmp_path)}
    assert invoke(["db", "upgrade"], env=env).exit_code == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = invoke(["serve", "--port", str(port)], env=env)
    assert_clean_exit(result, 2, f"kiln serve: 127.0.0.1:{port} is already in use", "--port")
    assert not list(tmp_path.glob("run/prometheus-*"))  # refused before the metrics directory exists


# ----- the worker's model and device -------------------------------------------------------------


def test_worker_with_a_directory_that_is_not_a_checkpoint(tmp_path):
    env = {"KILN_STORAGE_ROOT": str(tmp_path)}
    assert invoke(["db", "upgrade"], env=env).exit_code == 0
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = invoke(["worker", "--model-path", str(model)], env=env)
    assert_clean_exit(result, 2, f"kiln worker: cannot load the model at {model}:", "config.json")


def test_worker_on_a_cuda_device_that_is_not_there(tmp_path):
    """Refused before the model is read (the device is checked first)."""
    import torch

    env = {"KILN_STORAGE_ROOT": str(tmp_path)}
    assert invoke(["db", "upgrade"], env=env).exit_code == 0
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    device = f"cuda:{torch.cuda.device_count()}"  # one past the last visible device, on any machine
    result = invoke(["worker", "--model-path", str(model), "--device", device], env=env)
    assert_clean_exit(result, 2, f"kiln worker: model.device is {device}, but")


# ----- model and tokenizer directories -----------------------------------------------------------


def test_init_tiny_if_missing_over_a_foreign_config(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    result = invoke(["model", "init-tiny", str(tmp_path / "m"), "--if-missing"])
    assert_clean_exit(result, 2, "is not a usable Qwen3.5 checkpoint", "vocab_size")


def test_init_tiny_where_nothing_can_be_written(tmp_path, qwen_tokenizer, monkeypatch):
    monkeypatch.setattr(packaged_tokenizer, "cached_tokenizer", lambda root=None: qwen_tokenizer)
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "model"
    result = invoke(["model", "init-tiny", str(out)])
    assert_clean_exit(result, 2, f"kiln: cannot write a checkpoint to {out}")


def test_tokenizer_build_keeps_existing_files_without_force(tmp_path, qwen_tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer_cmd, "build_tokenizer", lambda: qwen_tokenizer)
    out = tmp_path / "model"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"mine": true}')
    result = invoke(["tokenizer", "build", str(out)])
    assert_clean_exit(result, 2, f"{out / 'tokenizer.json'}", "--force")
    assert (out / "tokenizer.json").read_text() == '{"mine": true}'
    assert not (out / "tokenizer_config.json").exists()
    forced = invoke(["tokenizer", "build", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert (out / "tokenizer.json").stat().st_size > 30_000_000


def test_tokenizer_build_where_nothing_can_be_written(tmp_path, qwen_tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer_cmd, "build_tokenizer", lambda: qwen_tokenizer)
    (tmp_path / "afile").write_text("x")
    result = invoke(["tokenizer", "build", str(tmp_path / "afile" / "tok")])
    assert_clean_exit(result, 2, f"kiln: cannot write the tokenizer into {tmp_path / 'afile' / 'tok'}")


# ----- Ctrl-C while the api has not answered ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["jobs", "list"], "kiln: interrupted"),
        (
            ["train", "sft", "--data", "rows.jsonl"],
            "the job may still have been admitted: see `kiln jobs list`",
        ),
    ],
)
def test_ctrl_c_before_the_answer_exits_130_without_a_traceback(tmp_path, args, needle):
    (tmp_path / "rows.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
        + "\n"
    )
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln_cli.main", *args, "--url", url],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=ctrl_c_default,
        )
        conn, _ = silent.accept()  # the request is on its way
        with conn:
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert needle in err
    assert "Traceback" not in err and "Aborted!" not in err
