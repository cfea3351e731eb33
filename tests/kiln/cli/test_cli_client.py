"""The HTTP client commands against a real api: `kiln train sft`, `kiln jobs ...`,
`kiln adapters ...`.

The api runs in a thread (werkzeug's server on a free port) over a migrated SQLite store, the test's
own Redis queue and a live runner row for the tiny model; a WSGI recorder keeps every request so the
tests see exactly what the CLI sent (body, bearer token, Idempotency-Key). No worker runs, so jobs
stay queued unless a test cancels them. The slow test runs real `kiln serve` + `kiln worker`
processes and lets `kiln train sft` wait for a tiny job to finish.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import tarfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from werkzeug.serving import make_server

from api import create_app
from kiln.cli import client_cmd, client_view, sft_submit
from kiln.cli.client_view import ProgressLine
from kiln.cli.http_client import settings_url
from kiln.cli.main import cli
from kiln.cli.sft_submit import read_smoke_prompts
from kiln.settings import Settings
from kiln.store import claim_job, make_engine, register_adapter, register_runner, session_factory
from tests.api.conftest import REDIS_URL, example, make_settings, runner_kwargs, tiny_model_dir  # noqa: F401
from tests.kiln.store.store_support import migrated_database
from tests.worker.stack import KILN, Stack, free_port

PROFILE = "native_online_lora_v1"
TOKEN = "cli-test-token"


# ----- a real api in a thread -----------------------------------------------------------------


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    authorization: str | None
    idempotency_key: str | None
    body: bytes

    def json(self):
        return json.loads(self.body)


class Recorder:
    """WSGI middleware keeping every request the server receives."""

    def __init__(self, app) -> None:
        self.app = app
        self.requests: list[Recorded] = []

    def __call__(self, environ, start_response):
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        environ["wsgi.input"] = io.BytesIO(body)
        self.requests.append(
            Recorded(
                environ["REQUEST_METHOD"],
                environ["PATH_INFO"],
                dict(urllib.parse.parse_qsl(environ.get("QUERY_STRING", ""))),
                environ.get("HTTP_AUTHORIZATION"),
                environ.get("HTTP_IDEMPOTENCY_KEY"),
                body,
            )
        )
        return self.app(environ, start_response)

    def posts(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "POST"]


@dataclass
class Server:
    url: str
    port: int
    settings: Settings
    sessions: object
    recorder: Recorder
    queue: str
    stop: Callable[[], None]


@contextmanager
def api_server(root: Path, runner: dict | None, **sections: dict) -> Iterator[Server]:
    """The api on a free port over a fresh SQLite store (with a live runner when given)."""
    storage = root / "storage"
    storage.mkdir(parents=True)
    queue = f"kiln-cli-test-{uuid.uuid4().hex[:10]}"
    with migrated_database("sqlite", root) as db_url:
        sections.setdefault("training", {})["runner_stale_seconds"] = 3600
        settings = make_settings(storage, db_url, queue, **sections)
        settings.ensure_dirs()
        engine = make_engine(db_url)
        sessions = session_factory(engine)
        if runner is not None:
            with sessions.begin() as session:
                register_runner(session, "runner-cli", **runner)
        app = create_app(settings)
        recorder = Recorder(app.wsgi_app)
        app.wsgi_app = recorder
        server = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        port = server.server_port

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join()

        try:
            yield Server(f"http://127.0.0.1:{port}", port, settings, sessions, recorder, queue, stop)
        finally:
            stop()
            app.extensions["kiln"].close()
            engine.dispose()
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"*{queue}*"):
                client.delete(key)
            client.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, runner_kwargs) -> Iterator[Server]:  # noqa: F811
    with api_server(tmp_path_factory.mktemp("api"), runner_kwargs) as srv:
        yield srv


@pytest.fixture
def kiln(server, monkeypatch):
    """Run `kiln ARGS... --url <server>` in-process; (exit code, stdout, stderr)."""
    monkeypatch.delenv("KILN_API_TOKEN", raising=False)
    monkeypatch.delenv("KILN_API_URL", raising=False)

    def run(*args: str, url: str | None = server.url, env: dict | None = None):
        extra = ["--url", url] if url is not None else []
        result = CliRunner().invoke(cli, [*args, *extra], env=env, catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    return run


def write_jsonl(path: Path, rows: list, blank_lines: bool = False) -> Path:
    lines = []
    for row in rows:
        lines.append(row if isinstance(row, str) else json.dumps(row))
        if blank_lines:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def name(prefix: str = "cli") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def submit(kiln, tmp_path, *flags: str, rows: int = 2) -> dict:
    data = write_jsonl(tmp_path / f"{uuid.uuid4().hex[:6]}.jsonl", [example(i) for i in range(rows)])
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--rank", "4", "--alpha", "8", "--epochs", "1",
        "--output-name", name(), *flags, "--no-wait", "--json",
    )  # fmt: skip
    assert code == 0, err
    return json.loads(out)


def http_json(server: Server, method: str, path: str):
    request = urllib.request.Request(server.url + path, method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


# ----- kiln train sft -------------------------------------------------------------------------


def test_train_sft_sends_the_profile_and_only_the_given_fields(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1), example(2)], blank_lines=True)
    adapter = name()
    before = len(server.recorder.posts())
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--epochs", "2", "--rank", "4", "--alpha", "8",
        "--output-name", adapter, "--no-wait", "--json",
    )  # fmt: skip
    assert code == 0, err
    admission = json.loads(out)
    assert admission["state"] == "queued"
    assert (admission["rows_kept"], admission["rows_rejected"], admission["total_steps"]) == (2, 0, 4)
    assert admission["effective_seed"].isdigit()

    (sent,) = server.recorder.posts()[before:]
    assert sent.path == "/v1/train/sft"
    assert sent.json() == {
        "examples": [example(1), example(2)],
        "config": {
            "training_profile": PROFILE,
            "epochs": 2,
            "lora_rank": 4,
            "lora_alpha": 8.0,
            "output_name": adapter,
        },
    }
    code, out, err = kiln("jobs", "show", admission["job_id"], "--json")
    assert code == 0, err
    effective = json.loads(out)["replay_request"]["config"]
    assert effective["training_profile"] == PROFILE
    assert (effective["epochs"], effective["lora_rank"], effective["lora_alpha"]) == (2, 4, 8.0)
    assert effective["optimizer"]["kind"] == "muon" and effective["learning_rate"] == 1e-3  # server defaults
    assert effective["seed"] == admission["effective_seed"]  # u64 seeds travel as strings
    assert effective["detect_anomaly"] is False and effective["adapter_smoke_test"] is False


def test_train_sft_maps_every_flag_to_its_config_field(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(3), example(4)])
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["First canary?", "Second canary?"]), encoding="utf-8")
    adapter = name()
    before = len(server.recorder.posts())
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--epochs", "1", "--rank", "2", "--alpha", "4",
        "--optimizer", "adam_w", "--learning-rate", "0.0002", "--seed", "12345",
        "--checkpoint-interval", "1", "--invalid-row-policy", "skip", "--grad-checkpoint-segments", "1",
        "--detect-anomaly", "--adapter-smoke-test", "--adapter-smoke-prompts-file", str(prompts),
        "--output-name", adapter, "--idempotency-key", f"key-{adapter}", "--no-wait", "--json",
    )  # fmt: skip
    assert code == 0, err
    admission = json.loads(out)
    assert admission["effective_seed"] == "12345"
    assert admission["grad_checkpoint_segments"] == 1
    (sent,) = server.recorder.posts()[before:]
    assert sent.idempotency_key == f"key-{adapter}"
    assert sent.json()["config"] == {
        "training_profile": PROFILE,
        "epochs": 1,
        "lora_rank": 2,
        "lora_alpha": 4.0,
        "learning_rate": 0.0002,
        "seed": 12345,
        "checkpoint_interval": 1,
        "output_name": adapter,
        "invalid_row_policy": "skip",
        "grad_checkpoint_segments": 1,
        "detect_anomaly": True,
        "adapter_smoke_test": True,
        "optimizer": {"kind": "adam_w"},
        "adapter_smoke_prompts": ["First canary?", "Second canary?"],
    }
    effective = http_json(server, "GET", f"/v1/train/jobs/{admission['job_id']}")["replay_request"]["config"]
    assert effective["optimizer"] == {
        "kind": "adam_w", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
    }  # fmt: skip
    assert effective["adapter_smoke_prompts"] == ["First canary?", "Second canary?"]
    assert effective["detect_anomaly"] is True and effective["checkpoint_interval"] == 1

    # The same key and body again: the server replays the first admission.
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--epochs", "1", "--rank", "2", "--alpha", "4",
        "--optimizer", "adam_w", "--learning-rate", "0.0002", "--seed", "12345",
        "--checkpoint-interval", "1", "--invalid-row-policy", "skip", "--grad-checkpoint-segments", "1",
        "--detect-anomaly", "--adapter-smoke-test", "--adapter-smoke-prompts-file", str(prompts),
        "--output-name", adapter, "--idempotency-key", f"key-{adapter}", "--no-wait",
    )  # fmt: skip
    assert code == 0, err
    assert f"job {admission['job_id']} queued (Idempotency-Key replay" in out


def test_warm_start_and_resume_flags_are_sent_and_judged_by_the_server(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--resume-checkpoint", "nope.kiln-checkpoint",
        "--base-adapter", "no-such-adapter", "--allow-high-lora-scale", "--no-wait",
    )  # fmt: skip
    assert code == 1 and out == ""
    assert "training_invalid_request (HTTP 400)" in err and "checkpoint 'nope.kiln-checkpoint'" in err
    assert "  hint: Exact checkpoints are immutable" in err
    assert server.recorder.posts()[-1].json()["config"] == {
        "training_profile": PROFILE,
        "resume_checkpoint": "nope.kiln-checkpoint",
        "base_adapter": "no-such-adapter",
        "allow_high_lora_scale": True,
    }


def test_a_text_prompts_file_is_one_prompt(kiln, server, tmp_path):
    prompts = tmp_path / "prompt.txt"
    prompts.write_text("Say something about kilns.\nIn two lines.\n", encoding="utf-8")
    admission = submit(kiln, tmp_path, "--adapter-smoke-test", "--adapter-smoke-prompts-file", str(prompts))
    sent = server.recorder.posts()[-1].json()["config"]
    assert sent["adapter_smoke_prompts"] == ["Say something about kilns.\nIn two lines."]
    effective = http_json(server, "GET", f"/v1/train/jobs/{admission['job_id']}")["replay_request"]["config"]
    assert effective["adapter_smoke_prompts"] == ["Say something about kilns.\nIn two lines."]


def test_prompts_file_forms(tmp_path):
    cases = {
        '["a", "b c"]\n': ["a", "b c"],
        '"one quoted prompt"\n': ["one quoted prompt"],
        "plain prompt\r\n": ["plain prompt"],
        "42\n": ["42"],
        "{not json at all}": ["{not json at all}"],
    }
    for text, expected in cases.items():
        path = tmp_path / "p"
        path.write_text(text, encoding="utf-8")
        assert read_smoke_prompts(path) == expected, text


def test_bad_prompts_files_fail_locally(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    before = len(server.recorder.posts())
    for text, expected in [
        ('["unterminated"', "starts with '[' but is not JSON"),
        ('["ok", 3]', "must be a JSON array of strings"),
        ("  \n", "is empty"),
    ]:
        path = tmp_path / "bad-prompts"
        path.write_text(text, encoding="utf-8")
        code, _out, err = kiln(
            "train", "sft", "--data", str(data), "--adapter-smoke-test",
            "--adapter-smoke-prompts-file", str(path), "--no-wait",
        )  # fmt: skip
        assert code == 2 and expected in err, err
    assert len(server.recorder.posts()) == before  # nothing was sent


def test_prompts_without_the_smoke_test_are_refused_by_the_server(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n", encoding="utf-8")
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--adapter-smoke-prompts-file", str(prompts), "--no-wait"
    )
    assert code == 1 and out == ""
    assert "kiln: training_invalid_request (HTTP 400): Invalid training request: " in err
    assert "adapter_smoke_prompts" in err
    assert "hint: Fix the named field or row and resubmit; nothing was queued." in err


def test_a_bad_config_field_prints_the_envelope_and_queues_nothing(kiln, server, tmp_path):
    jobs_before = http_json(server, "GET", "/v1/train/status")
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    code, out, err = kiln("train", "sft", "--data", str(data), "--epochs", "0", "--no-wait")
    assert code == 1 and out == ""
    first = err.splitlines()[0]
    assert first.startswith(
        "kiln: training_invalid_request (HTTP 400): Invalid training request: config.epochs"
    )
    assert "  hint: Fix the named field or row and resubmit; nothing was queued." in err
    assert http_json(server, "GET", "/v1/train/status") == jobs_before


def test_the_server_row_number_is_mapped_to_the_file_line(kiln, server, tmp_path):
    rows = [example(1), {"messages": []}]
    data = write_jsonl(tmp_path / "d.jsonl", rows, blank_lines=True)  # row 2 is line 3
    code, _out, err = kiln("train", "sft", "--data", str(data), "--no-wait")
    assert code == 1
    assert "SFT row 2 (" in err and "rejected as empty_messages" in err
    assert f"  note: SFT row 2 is line 3 of {data}" in err


def test_unparseable_lines_fail_locally_naming_the_line(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1), "", "{broken", "[1, 2]", json.dumps(example(2))])
    before = len(server.recorder.posts())
    code, _out, err = kiln("train", "sft", "--data", str(data), "--no-wait")
    assert code == 2
    assert "line 3: not valid JSON" in err and "line 4: not a JSON object" in err
    code, _out, err = kiln("train", "sft", "--data", str(data), "--invalid-row-policy", "skip", "--no-wait")
    assert code == 2
    assert "--dataset-path" in err and "invalid_row_policy=skip" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    code, _out, err = kiln("train", "sft", "--data", str(empty), "--no-wait")
    assert code == 2 and "no rows" in err
    code, _out, err = kiln("train", "sft", "--data", str(tmp_path / "missing.jsonl"), "--no-wait")
    assert code == 2 and "missing.jsonl" in err
    assert len(server.recorder.posts()) == before


def test_dataset_path_lets_the_server_skip_bad_lines(kiln, server):
    dataset = server.settings.datasets_dir / f"{name('ds')}.jsonl"
    write_jsonl(dataset, [example(1), "{broken", example(2)])
    code, out, err = kiln(
        "train", "sft", "--data", dataset.name, "--dataset-path", "--invalid-row-policy", "skip",
        "--rank", "4", "--alpha", "8", "--epochs", "1", "--no-wait", "--json",
    )  # fmt: skip
    assert code == 0, err
    admission = json.loads(out)
    assert (admission["rows_kept"], admission["rows_rejected"]) == (2, 1)
    assert server.recorder.posts()[-1].json() == {
        "dataset_path": dataset.name,
        "config": {
            "training_profile": PROFILE,
            "lora_rank": 4,
            "lora_alpha": 8.0,
            "epochs": 1,
            "invalid_row_policy": "skip",
        },
    }


def test_human_admission_output(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(i) for i in range(3)])
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--epochs", "2", "--rank", "4", "--alpha", "8", "--seed", "77",
        "--no-wait",
    )  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("job ") and lines[0].endswith(" queued")
    text = "\n".join(lines)
    assert "effective seed   77" in text
    assert "rows             3 kept, 0 rejected" in text
    assert "steps            6 (1 gradient-checkpoint segment(s))" in text
    assert "memory estimate" in text and "GiB" in text
    assert f"follow it: kiln jobs events {lines[0].split()[1]} --follow" in text


def test_waiting_for_a_cancelled_job_reports_its_failure(kiln, server, tmp_path):
    """`train sft` without --no-wait polls the status; a job cancelled meanwhile ends it with
    the failure reason on stderr and exit 1."""
    adapter = name()

    def cancel_when_queued() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for job in http_json(server, "GET", "/v1/train/status"):
                if job["adapter_name"] == adapter and job["state"] == "queued":
                    http_json(server, "DELETE", f"/v1/train/queue/{job['job_id']}")
                    return
            time.sleep(0.2)

    canceller = threading.Thread(target=cancel_when_queued)
    canceller.start()
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--rank", "4", "--alpha", "8", "--output-name", adapter,
        "--poll-interval", "0.2",
    )  # fmt: skip
    canceller.join()
    assert code == 1
    job_id = out.splitlines()[0].split()[1]
    assert f"job {job_id} failed: cancelled" in err
    assert "  error: " in err


def test_progress_line_redraws_on_a_terminal_and_logs_moves_otherwise(capsys, monkeypatch):
    status = {
        "state": "running",
        "global_step": 3,
        "total_steps": 8,
        "current_loss": 1.23456,
        "elapsed_secs": 61.0,
    }
    live = ProgressLine(rows_kept=4, live=True)
    live.show({"state": "queued", "queue_position": 2})
    live.show(status)
    live.finish()
    err = capsys.readouterr().err
    first, second = err.split("\r")[1:]
    assert first.startswith("queued (position 2), waiting 0:0")
    assert second == "[#########---------------] step 3/8  epoch 1/2  loss 1.2346  1:01\n"  # finish() ends it

    clock = iter([0.0, 0.0, 1.0, 2.0, 7.0, 8.0])
    monkeypatch.setattr(client_view.time, "monotonic", lambda: next(clock))
    log = ProgressLine(rows_kept=4, live=False)
    log.show(status)  # t=0: first line
    log.show({**status, "elapsed_secs": 62.0})  # t=1: only the clock moved
    log.show({**status, "global_step": 4})  # t=2: moved, but within 5 s of the last line
    log.show({**status, "global_step": 5, "elapsed_secs": 70.0})  # t=7: moved, printed
    log.show({**status, "state": "completed", "global_step": 8})  # t=8: a new state is always printed
    assert capsys.readouterr().err.splitlines() == [
        "[#########---------------] step 3/8  epoch 1/2  loss 1.2346  1:01",
        "[###############---------] step 5/8  epoch 2/2  loss 1.2346  1:10",
        "[########################] step 8/8  epoch 2/2  loss 1.2346  1:01  completed",
    ]


def test_an_api_gone_while_waiting_exits_3_after_the_grace_period(kiln, tmp_path, runner_kwargs, monkeypatch):  # noqa: F811
    monkeypatch.setattr(sft_submit, "UNREACHABLE_GRACE_S", 1.0)
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    with api_server(tmp_path / "api", runner_kwargs) as doomed:

        def stop_after_the_first_poll() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if any(r.path.startswith("/v1/train/status/") for r in doomed.recorder.requests):
                    doomed.stop()
                    return
                time.sleep(0.05)

        stopper = threading.Thread(target=stop_after_the_first_poll)
        stopper.start()
        started = time.monotonic()
        code, out, err = kiln(
            "train", "sft", "--data", str(data), "--poll-interval", "0.1", url=doomed.url
        )  # fmt: skip
        stopper.join()
    assert code == 3
    assert time.monotonic() - started >= 1.0  # it kept polling through the grace period
    job_id = out.splitlines()[0].split()[1]
    assert f"/v1/train/status/{job_id}" in err and f"is `kiln serve` running at {doomed.url}?" in err


# ----- kiln jobs ------------------------------------------------------------------------------


def test_jobs_list_show_cancel_delete(kiln, server, tmp_path):
    queued = submit(kiln, tmp_path)
    cancelled = submit(kiln, tmp_path)

    code, out, err = kiln("jobs", "cancel", cancelled["job_id"])
    assert (code, out) == (0, f"job {cancelled['job_id']} cancelled\n"), err
    code, out, err = kiln("jobs", "cancel", cancelled["job_id"])
    assert code == 1 and out == ""
    assert "kiln: training_job_not_cancellable (HTTP 409): " in err and cancelled["job_id"] in err
    assert "  hint: The job already finished; nothing to cancel." in err

    code, out, err = kiln("jobs", "list", "--json")
    assert code == 0, err
    states = {j["job_id"]: j["state"] for j in json.loads(out)}
    assert states[queued["job_id"]] == "queued" and states[cancelled["job_id"]] == "failed"
    code, out, _ = kiln("jobs", "list", "--state", "failed", "--json")
    assert {j["state"] for j in json.loads(out)} == {"failed"}
    assert cancelled["job_id"] in {j["job_id"] for j in json.loads(out)}

    code, out, _ = kiln("jobs", "list")
    header, *rows = out.splitlines()
    assert header.split() == ["ID", "STATE", "ADAPTER", "PROGRESS", "LOSS", "SUBMITTED"]
    row = next(r for r in rows if r.startswith(queued["job_id"]))
    assert row.split()[1:2] == ["queued"] and "0/2 0%" in row
    code, out, _ = kiln("jobs", "list", "--state", "bogus")
    assert code == 2

    code, out, err = kiln("jobs", "show", cancelled["job_id"])
    assert code == 0, err
    assert f"job        {cancelled['job_id']}" in out
    assert "state      failed" in out and "failure    cancelled: " in out
    assert "data       inline: 2 row(s) kept, 0 rejected" in out
    code, out, _ = kiln("jobs", "show", queued["job_id"])
    assert "(queue position " in out

    code, _out, err = kiln("jobs", "delete", queued["job_id"])
    assert code == 1 and "training_job_active (HTTP 409)" in err
    code, out, err = kiln("jobs", "delete", cancelled["job_id"])
    assert (code, out) == (0, f"job {cancelled['job_id']} deleted\n"), err
    code, out, _ = kiln("jobs", "list", "--json")
    assert cancelled["job_id"] not in {j["job_id"] for j in json.loads(out)}


def test_cancelling_a_running_job_is_cooperative(kiln, server, tmp_path):
    job_id = submit(kiln, tmp_path)["job_id"]
    with server.sessions.begin() as session:
        assert claim_job(session, job_id, "w-cli", 60) is not None
    code, out, err = kiln("jobs", "cancel", job_id)
    assert code == 0, err
    assert out == f"job {job_id} cancelling: stop requested — the trainer aborts at the next step boundary\n"
    code, out, err = kiln("jobs", "cancel", job_id, "--json")
    assert json.loads(out)["status"] == "cancelling"
    code, out, _ = kiln("jobs", "show", job_id)
    assert "state      running" in out and "epoch 1/1" in out


def test_unknown_job_is_the_servers_404(kiln):
    for args in (("jobs", "show", "no-such-job"), ("jobs", "cancel", "no-such-job"), ("jobs", "events", "x")):
        code, out, err = kiln(*args)
        assert code == 1 and out == "", args
        assert err.startswith("kiln: training_job_not_found (HTTP 404): "), err
        assert "  hint: List jobs with GET /v1/train/status." in err


def test_a_job_id_cannot_escape_its_path_segment(kiln, server):
    code, _out, err = kiln("jobs", "show", "../adapters")
    assert code == 1 and "HTTP 404" in err
    assert server.recorder.requests[-1].path == "/v1/train/jobs/../adapters"  # one segment, not a route


def test_events_are_read_page_by_page(kiln, server, tmp_path, monkeypatch):
    admission = submit(kiln, tmp_path)
    job_id = admission["job_id"]
    http_json(server, "DELETE", f"/v1/train/queue/{job_id}")
    expected = http_json(server, "GET", f"/v1/train/jobs/{job_id}/events")["data"]
    assert len(expected) >= 2

    monkeypatch.setattr(client_cmd, "EVENT_PAGE", 1)
    before = len(server.recorder.requests)
    code, out, err = kiln("jobs", "events", job_id, "--json")
    assert code == 0, err
    assert [json.loads(line) for line in out.splitlines()] == expected
    pages = [r for r in server.recorder.requests[before:] if r.path.endswith("/events")]
    assert [p.query.get("after") for p in pages] == [None, *(str(e["id"]) for e in expected[:-1])]

    code, out, _ = kiln("jobs", "events", job_id)
    lines = out.splitlines()
    assert len(lines) == len(expected)
    assert lines[0].split()[2] == "queued" and expected[0]["message"] in lines[0]


def test_events_follow_until_the_job_finishes(kiln, server, tmp_path):
    job_id = submit(kiln, tmp_path)["job_id"]
    timer = threading.Timer(1.5, lambda: http_json(server, "DELETE", f"/v1/train/queue/{job_id}"))
    timer.start()
    code, out, err = kiln("jobs", "events", job_id, "--follow", "--json", "--poll-interval", "0.2")
    timer.join()
    assert code == 0, err
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert kinds[0] == "queued" and "cancelled" in kinds
    final = http_json(server, "GET", f"/v1/train/jobs/{job_id}/events")["data"]
    assert kinds == [e["kind"] for e in final]  # every event once, nothing after the end missed


# ----- kiln adapters --------------------------------------------------------------------------


def publish_adapter(server: Server, adapter: str, checkpoints=(2,)) -> dict[str, bytes]:
    root = server.settings.adapters_dir / adapter
    root.mkdir(parents=True)
    files = {
        "adapter_config.json": b'{"r": 4}\n',
        "adapter_model.safetensors": os.urandom(3 << 20),
        "adapter_manifest.json": json.dumps({"schema_version": 1, "adapter_name": adapter}).encode(),
    }
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    for step in checkpoints:
        ck = server.settings.adapters_dir / f"{adapter}-checkpoint-step-{step:08d}.kiln-checkpoint"
        ck.mkdir()
        (ck / "manifest.json").write_text("{}")
    with server.sessions.begin() as session:
        register_adapter(
            session, name=adapter, job_id=None, path=str(root), size_bytes=sum(map(len, files.values())),
            safetensors_sha256="sha256:" + "cd" * 32, rank=4, alpha=8.0,
        )  # fmt: skip
    return files


def test_adapters_list_download_extract_delete(kiln, server, tmp_path, monkeypatch):
    adapter = name("ad")
    files = publish_adapter(server, adapter)

    code, out, err = kiln("adapters", "list", "--json")
    assert code == 0, err
    listed = next(a for a in json.loads(out) if a["name"] == adapter)
    assert listed["checkpoints"] == [f"{adapter}-checkpoint-step-00000002.kiln-checkpoint"]
    code, out, _ = kiln("adapters", "list")
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "RANK", "ALPHA", "SIZE", "CREATED", "JOB", "CHECKPOINTS"]
    row = next(r for r in rows if r.startswith(adapter)).split()
    assert row[1:5] == ["4", "8", "3.0", "MiB"] and row[-1] == "1"

    archive = tmp_path / "out.tar.gz"
    code, out, err = kiln("adapters", "download", adapter, "-o", str(archive))
    assert code == 0, err
    assert out.startswith(f"adapter {adapter} saved to {archive}")
    with tarfile.open(archive, "r:gz") as tar:
        assert {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()} == {
            f"{adapter}/{rel}": data for rel, data in files.items()
        }
    code, _out, err = kiln("adapters", "download", adapter, "-o", str(archive))
    assert code == 2 and "--force" in err
    code, _out, err = kiln("adapters", "download", adapter, "-o", str(archive), "--force")
    assert code == 0, err

    monkeypatch.chdir(tmp_path)
    code, out, err = kiln("adapters", "download", adapter, "--json")
    assert code == 0, err
    assert json.loads(out) == {
        "name": adapter,
        "archive": f"{adapter}.tar.gz",
        "bytes": (tmp_path / f"{adapter}.tar.gz").stat().st_size,
    }

    code, out, err = kiln("adapters", "download", adapter, "--extract", str(tmp_path / "unpacked"))
    assert code == 0, err
    target = tmp_path / "unpacked" / adapter
    assert {p.name: p.read_bytes() for p in target.iterdir()} == files
    assert [p.name for p in (tmp_path / "unpacked").iterdir()] == [adapter]  # no staging left behind
    code, _out, err = kiln("adapters", "download", adapter, "--extract", str(tmp_path / "unpacked"))
    assert code == 2 and "exists" in err
    code, _out, err = kiln("adapters", "download", adapter, "-o", "x.tar.gz", "--extract", "d")
    assert code == 2

    code, out, err = kiln("adapters", "delete", adapter)
    assert code == 0, err
    assert out.splitlines() == [
        f"adapter {adapter} deleted with 1 checkpoint(s)",
        f"  removed {adapter}-checkpoint-step-00000002.kiln-checkpoint",
    ]
    assert not (server.settings.adapters_dir / adapter).exists()
    for args in (
        ("adapters", "delete", adapter),
        ("adapters", "download", adapter, "-o", str(tmp_path / "n")),
    ):
        code, out, err = kiln(*args)
        assert code == 1 and err.startswith("kiln: adapter_not_found (HTTP 404): "), err
    assert not (tmp_path / "n").exists() and not list(tmp_path.glob(".n.*"))  # no partial file


def test_invalid_adapter_name_is_the_servers_400(kiln):
    code, _out, err = kiln("adapters", "delete", "bad name!")
    assert code == 1 and "invalid_adapter_name (HTTP 400)" in err


# ----- connection, tokens, 503 ------------------------------------------------------------------


def test_connection_refused_exits_3_naming_the_url(kiln):
    url = f"http://127.0.0.1:{free_port()}"
    for args in (("jobs", "list"), ("adapters", "list"), ("jobs", "show", "x")):
        code, out, err = kiln(*args, url=url)
        assert code == 3 and out == ""
        assert f"is `kiln serve` running at {url}?" in err and "Connection refused" in err


def test_the_url_comes_from_the_settings(kiln, server, tmp_path):
    config = tmp_path / "kiln.toml"
    config.write_text(f'[server]\nhost = "0.0.0.0"\nport = {server.port}\n', encoding="utf-8")
    code, out, err = kiln("jobs", "list", "--json", "--config", str(config), url=None)
    assert code == 0, err
    assert isinstance(json.loads(out), list)
    assert settings_url("0.0.0.0", 8420) == "http://127.0.0.1:8420"
    assert settings_url("::", 9000) == "http://[::1]:9000"
    assert settings_url("fd00::5", 1) == "http://[fd00::5]:1"
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = 0\n", encoding="utf-8")
    code, _out, err = kiln("jobs", "list", "--config", str(bad), url=None)
    assert code == 2 and "server.port" in err


@pytest.fixture(scope="module")
def secured(tmp_path_factory, runner_kwargs) -> Iterator[Server]:  # noqa: F811
    with api_server(tmp_path_factory.mktemp("secured"), runner_kwargs, server={"api_tokens": [TOKEN]}) as srv:
        yield srv


def test_the_bearer_token_is_sent(kiln, secured, tmp_path):
    code, out, err = kiln("jobs", "list", url=secured.url)
    assert code == 1 and out == ""
    assert "kiln: unauthorized (HTTP 401): missing bearer token" in err
    assert "hint: Send `Authorization: Bearer <token>`" in err

    code, out, err = kiln("jobs", "list", "--json", "--token", TOKEN, url=secured.url)
    assert code == 0, err
    assert secured.recorder.requests[-1].authorization == f"Bearer {TOKEN}"

    code, out, err = kiln("adapters", "list", "--json", url=secured.url, env={"KILN_API_TOKEN": TOKEN})
    assert code == 0, err
    assert secured.recorder.requests[-1].authorization == f"Bearer {TOKEN}"

    code, _out, err = kiln("jobs", "list", "--token", "wrong", url=secured.url)
    assert code == 1 and "invalid bearer token" in err

    # Without --url the first of server.api_tokens goes with the settings' own address ...
    config = tmp_path / "kiln.toml"
    config.write_text(f'[server]\nport = {secured.port}\napi_tokens = ["{TOKEN}"]\n', encoding="utf-8")
    code, _out, err = kiln("jobs", "list", "--config", str(config), url=None)
    assert code == 0, err
    assert secured.recorder.requests[-1].authorization == f"Bearer {TOKEN}"
    # ... but never to a URL given by hand.
    code, _out, err = kiln("jobs", "list", "--config", str(config), url=secured.url)
    assert code == 1 and "missing bearer token" in err


def test_no_runner_is_a_503_with_retry_after(kiln, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    with api_server(tmp_path / "api", None) as bare:
        code, out, err = kiln("train", "sft", "--data", str(data), "--no-wait", url=bare.url)
    assert code == 1 and out == ""
    assert err.startswith("kiln: training_no_runner (HTTP 503): no live training runner")
    assert "  hint: Start a worker (`kiln worker`)" in err
    assert "  retry after: 10 s" in err


def test_a_non_kiln_error_page_is_reported_with_its_status(kiln):
    def bad_gateway(environ, start_response):
        start_response("502 Bad Gateway", [("Content-Type", "text/html")])
        return [b"<html>upstream down</html>"]

    proxy = make_server("127.0.0.1", 0, bad_gateway)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        code, _out, err = kiln("jobs", "list", url=f"http://127.0.0.1:{proxy.server_port}")
    finally:
        proxy.shutdown()
        thread.join()
    assert code == 1
    assert "kiln: http_502 (HTTP 502): " in err and "<html>upstream down</html>" in err


def test_ctrl_c_stops_waiting_and_prints_the_cancel_hint(server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    proc = subprocess.Popen(
        [*KILN, "train", "sft", "--data", str(data), "--rank", "4", "--alpha", "8", "--url", server.url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        first = proc.stdout.readline().decode()  # the admission's first line: "job <id> queued"
        assert first.startswith("job "), first + proc.stderr.read().decode()
        job_id = first.split()[1]
        assert proc.stderr.readline().decode().startswith("queued")  # waiting now
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert f"kiln jobs cancel {job_id}" in err.decode()
    assert http_json(server, "GET", f"/v1/train/status/{job_id}")["state"] == "queued"  # still there


# ----- with a real worker ---------------------------------------------------------------------


@pytest.mark.slow
def test_train_sft_waits_for_a_real_worker_and_prints_the_receipt(tmp_path, tiny_model_dir):  # noqa: F811
    stack = Stack(tmp_path, tiny_model_dir, None, None)
    try:
        stack.start_api()
        stack.start_worker()
        data = write_jsonl(tmp_path / "demo.jsonl", [example(i) for i in range(3)], blank_lines=True)
        adapter = name("e2e")
        env = {k: v for k, v in stack.env.items() if k != "KILN_SERVER_PORT"}
        result = subprocess.run(
            [
                *KILN, "train", "sft", "--data", str(data), "--epochs", "2", "--rank", "4", "--alpha", "8",
                "--optimizer", "adam_w", "--seed", "5", "--adapter-smoke-test", "--output-name", adapter,
                "--url", stack.url(""),
            ],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
        assert "job " in out.splitlines()[0] and "rows             3 kept, 0 rejected" in out
        assert "step 6/6" in result.stderr and "epoch 2/2" in result.stderr  # the progress line
        job_id = out.splitlines()[0].split()[1]
        assert f"job {job_id} completed" in out
        adapter_path = stack.root / "storage" / "adapters" / adapter
        assert f"adapter path  {adapter_path}" in out
        summary = out.split("receipt:\n", 1)[1]
        assert "status             success" in summary
        assert "steps              6/6" in summary
        assert "learning rate      0.0001" in summary and "seed               5" in summary
        assert "loss route         kt_tape_flce" in summary
        assert "supervised tokens" in summary and "wall clock" in summary and "peak memory" in summary
        assert "canary             " in summary and "(3 prompt(s)" in summary
        detail = stack.get(f"/v1/train/jobs/{job_id}")[1]
        loss = detail["current_loss"]
        assert f"final loss         {loss:.4f}" in summary
        tokens = detail["train_receipt"]["token_counts"]["action_tokens"]
        assert f"supervised tokens  {tokens}" in summary

        # The same job through `jobs show` and the adapter through `adapters download --extract`.
        show = subprocess.run(
            [*KILN, "jobs", "show", job_id, "--url", stack.url("")], capture_output=True, text=True, env=env
        )
        assert show.returncode == 0, show.stderr
        assert "progress      6/6 100%, epoch 2/2" in show.stdout and ", 6 samples)" in show.stdout
        unpack = subprocess.run(
            [*KILN, "adapters", "download", adapter, "--extract", str(tmp_path / "x"), "--url", stack.url("")],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        assert unpack.returncode == 0, unpack.stderr
        assert (tmp_path / "x" / adapter / "adapter_model.safetensors").is_file()
        assert (tmp_path / "x" / adapter / "train_receipt.json").is_file()
    finally:
        stack.close()
