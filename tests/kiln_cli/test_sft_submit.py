"""`kiln train sft` against a real api: the request it sends, local checks of the data and prompt
files, the server's refusals mapped to file lines, `--dry-run` (the preflight: the plan or the
submission's refusal, nothing queued), waiting for the outcome, Ctrl-C, and a real worker run to
its receipt (slow: real `kiln serve` + `kiln worker` processes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from kiln_cli import sft_submit
from kiln_cli.sft_submit import read_smoke_prompts
from tests.api.conftest import example
from tests.kiln_cli.api_server import PROFILE, api_server, http_json, name, submit, write_jsonl
from tests.kiln_cli.processes import ctrl_c_default
from tests.worker.stack import KILN, Stack

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
        "--max-length", "4096", "--truncation", "right",
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
        "max_length": 4096,
        "truncation": "right",
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
    assert (effective["max_length"], effective["truncation"]) == (4096, "right")

    # The same key and body again: the server replays the first admission.
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--epochs", "1", "--rank", "2", "--alpha", "4",
        "--optimizer", "adam_w", "--learning-rate", "0.0002", "--seed", "12345",
        "--checkpoint-interval", "1", "--invalid-row-policy", "skip", "--grad-checkpoint-segments", "1",
        "--detect-anomaly", "--adapter-smoke-test", "--adapter-smoke-prompts-file", str(prompts),
        "--max-length", "4096", "--truncation", "right",
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


def test_an_api_gone_while_waiting_exits_3_after_the_grace_period(kiln, tmp_path, runner_kwargs, monkeypatch):
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
    assert (
        f"/v1/train/status/{job_id}" in err
        and f"is Kiln running at {doomed.url}? Start it with `kiln up`" in err
    )


def test_dry_run_prints_the_plan_and_queues_nothing(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(i) for i in range(3)])
    jobs_before = http_json(server, "GET", "/v1/train/status")
    flags = ["--data", str(data), "--epochs", "2", "--rank", "4", "--alpha", "8", "--output-name", name()]
    code, out, err = kiln("train", "sft", *flags, "--dry-run", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert (plan["rows_kept"], plan["total_steps"], plan["drawn"]) == (3, 6, ["seed"])
    assert server.recorder.posts()[-1].path == "/v1/train/sft/preflight"
    code, out, err = kiln("train", "sft", *flags, "--dry-run")
    assert code == 0, err
    assert out.startswith("preflight: would admit 3 row(s) x 2 epoch(s) = 6 step(s)")
    assert re.search(r"^  rows +3 kept, 0 rejected \(of 3 read\)$", out, re.M)
    assert re.search(r"^  seed +drawn at submission$", out, re.M)
    assert re.search(rf"^  largest rank that fits +{plan['max_lora_rank_that_fits']}$", out, re.M)
    assert http_json(server, "GET", "/v1/train/status") == jobs_before


def test_dry_run_reports_the_refusal_a_submission_would_get(kiln, server, tmp_path):
    rows = [example(1), {"messages": []}]
    data = write_jsonl(tmp_path / "d.jsonl", rows, blank_lines=True)
    jobs_before = http_json(server, "GET", "/v1/train/status")
    code, _out, err = kiln("train", "sft", "--data", str(data), "--dry-run")
    assert code == 1
    assert "kiln: training_invalid_request (HTTP 400)" in err and "rejected as empty_messages" in err
    assert f"  note: SFT row 2 is line 3 of {data}" in err
    assert http_json(server, "GET", "/v1/train/status") == jobs_before


def test_ctrl_c_stops_waiting_and_prints_the_cancel_hint(server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    proc = subprocess.Popen(
        [*KILN, "train", "sft", "--data", str(data), "--rank", "4", "--alpha", "8", "--url", server.url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path, preexec_fn=ctrl_c_default,
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
def test_train_sft_waits_for_a_real_worker_and_prints_the_receipt(tmp_path, tiny_model_dir):
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


def test_a_dry_run_of_a_dataset_path_names_each_rejected_rows_line(kiln, server):
    dataset = server.settings.datasets_dir / f"{name('lines')}.jsonl"
    alpaca = {"instruction": "Which colour?", "output": "Red."}
    write_jsonl(dataset, [example(1), "", alpaca, {"instruction": "x", "output": ""}])
    code, out, err = kiln(
        "train", "sft", "--data", dataset.name, "--dataset-path", "--invalid-row-policy", "skip",
        "--rank", "4", "--alpha", "8", "--epochs", "1", "--dry-run",
    )  # fmt: skip
    assert code == 0, err
    assert re.search(r"^  rejected row 3 at line 4 \(sha256:[0-9a-f]{64}\): empty_output$", out, re.M), out
