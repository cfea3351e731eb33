"""`kiln train sft --validation-data FILE | --holdout-percent P [--validation-interval N]` and
the validation lines of the progress, the dry run and `kiln jobs show` (docs/validation.md),
against a real api in a thread (tests/kiln_cli/conftest.py)."""

from __future__ import annotations

import json
import re

from kiln.store import claim_job, record_evaluation
from kiln_cli import client_view
from kiln_cli.client_view import ProgressLine
from tests.api.conftest import example
from tests.kiln_cli.api_server import name, write_jsonl

NO_TARGET = {"messages": [{"role": "user", "content": "only a question"}]}
BASE = ("--rank", "4", "--alpha", "8", "--epochs", "2")


def test_the_validation_flags_become_the_requests_validation(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(i) for i in range(4)])
    held = write_jsonl(tmp_path / "held.jsonl", [example(20), example(21)], blank_lines=True)
    cases = [
        (("--validation-data", str(held)), {"examples": [example(20), example(21)]}),
        (
            ("--validation-data", str(held), "--validation-interval", "3"),
            {"examples": [example(20), example(21)], "interval_steps": 3},
        ),
        (
            ("--holdout-percent", "25", "--validation-interval", "2"),
            {"holdout_percent": 25, "interval_steps": 2},
        ),
    ]
    for flags, validation in cases:
        before = len(server.recorder.posts())
        code, out, err = kiln(
            "train", "sft", "--data", str(data), *BASE, "--output-name", name(), *flags, "--no-wait", "--json"
        )
        assert code == 0, err
        (sent,) = server.recorder.posts()[before:]
        assert sent.json()["validation"] == validation
        rows = 3 if "holdout_percent" in validation else 4
        assert json.loads(out)["rows_kept"] == rows


def test_with_dataset_path_the_validation_file_is_named_on_the_server(kiln, server, tmp_path):
    for file, rows in (("train.jsonl", range(3)), ("held.jsonl", (30, 31))):
        write_jsonl(server.settings.datasets_dir / file, [example(i) for i in rows])
    before = len(server.recorder.posts())
    code, _out, err = kiln(
        "train", "sft", "--data", "train.jsonl", "--dataset-path", "--validation-data", "held.jsonl",
        *BASE, "--output-name", name(), "--no-wait",
    )  # fmt: skip
    assert code == 0, err
    (sent,) = server.recorder.posts()[before:]
    assert sent.json()["dataset_path"] == "train.jsonl"
    assert sent.json()["validation"] == {"dataset_path": "held.jsonl"}


def test_conflicting_or_orphan_validation_flags_fail_locally(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    held = write_jsonl(tmp_path / "held.jsonl", [example(2)])
    before = len(server.recorder.posts())
    for flags, fragment in (
        (("--validation-data", str(held), "--holdout-percent", "10"), "not both"),
        (
            (
                "--validation-interval",
                "2",
            ),
            "--validation-interval needs --validation-data or --holdout-percent",
        ),
        (("--validation-data", str(tmp_path / "missing.jsonl")), "--validation-data"),
    ):
        code, _out, err = kiln("train", "sft", "--data", str(data), *flags, "--no-wait")
        assert code == 2 and fragment in err, err
    assert len(server.recorder.posts()) == before


def test_a_refused_validation_row_is_mapped_to_its_file_line(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1), example(2)])
    held = write_jsonl(tmp_path / "held.jsonl", [example(3), NO_TARGET], blank_lines=True)  # row 2 is line 3
    code, _out, err = kiln("train", "sft", "--data", str(data), "--validation-data", str(held), "--no-wait")
    assert code == 1
    assert "SFT validation row 2 (" in err
    assert f"  note: SFT validation row 2 is line 3 of {held}" in err
    assert "SFT row 2 is line" not in err  # the training file's lines are not blamed
    code, _out, err = kiln("train", "sft", "--data", str(data), "--holdout-percent", "60", "--no-wait")
    assert code == 1 and "validation.holdout_percent" in err


def test_the_dry_run_lists_the_validation_rows(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(i) for i in range(3)])
    held = write_jsonl(tmp_path / "held.jsonl", [example(20), NO_TARGET])
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--validation-data", str(held), "--validation-interval", "4",
        "--invalid-row-policy", "skip", *BASE, "--dry-run",
    )  # fmt: skip
    assert code == 0, err
    assert "validation         inline: 1 row(s) kept, 1 rejected" in out
    assert "evaluations        4 (every 4 step(s) and every epoch's end)" in out
    assert "rejected validation row 2 (sha256:" in out
    code, out, _ = kiln("train", "sft", "--data", str(data), *BASE, "--dry-run")
    assert "validation" not in out


def test_the_progress_prints_each_evaluation_once(capsys, monkeypatch):
    history = [
        {"global_step": 0, "epoch": 0, "loss": 2.5, "token_accuracy": 0.1},
        {"global_step": 4, "epoch": 1, "loss": 2.25, "token_accuracy": 0.125},
    ]
    status = {
        "state": "running",
        "global_step": 4,
        "total_steps": 8,
        "current_loss": 1.5,
        "elapsed_secs": 5.0,
    }
    live = ProgressLine(rows_kept=4, live=True)
    live.show({**status, "global_step": 1, "validation_history": history[:1]})
    live.show({**status, "validation_history": history})
    live.show({**status, "validation_history": history})
    live.finish()
    err = re.sub(r" +\n", "\n", capsys.readouterr().err)  # a live line is padded over the bar it replaces
    assert err.count("validation at baseline (base model): loss 2.5000, token accuracy 0.1000\n") == 1
    assert err.count("validation at step 4, epoch 1: loss 2.2500, token accuracy 0.1250\n") == 1
    assert err.endswith("step 4/8  epoch 2/2  loss 1.5000  val 2.2500  0:05\n")

    monkeypatch.setattr(client_view.time, "monotonic", lambda: 0.0)
    log = ProgressLine(rows_kept=4, live=False)
    log.show({**status, "validation_history": history})
    assert capsys.readouterr().err.splitlines() == [
        "validation at baseline (base model): loss 2.5000, token accuracy 0.1000",
        "validation at step 4, epoch 1: loss 2.2500, token accuracy 0.1250",
        "[############------------] step 4/8  epoch 2/2  loss 1.5000  val 2.2500  0:05",
    ]
    plain = ProgressLine(rows_kept=4, live=False)
    plain.show({**status, "validation_history": []})
    assert "val" not in capsys.readouterr().err


def test_jobs_show_prints_the_validation_curve(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(i) for i in range(4)])
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--holdout-percent", "25", *BASE, "--output-name", name(),
        "--no-wait", "--json",
    )  # fmt: skip
    assert code == 0, err
    job_id = json.loads(out)["job_id"]
    with server.sessions.begin() as session:
        job = claim_job(session, job_id, "worker-cli", 60)
        for step, loss, accuracy in ((0, 3.0, 0.0), (3, 2.0, 0.5), (6, 2.5, 0.25)):
            record_evaluation(
                session,
                job_id,
                "worker-cli",
                {
                    "global_step": step,
                    "epoch": step // 3,
                    "loss": loss,
                    "token_accuracy": accuracy,
                    "supervised_tokens": 8,
                    "rows": 1,
                },
                attempt=job.attempts,
            )
    code, out, err = kiln("jobs", "show", job_id)
    assert code == 0, err
    assert (
        "validation curve  loss 3.0000 -> 2.5000, token accuracy 0.0000 -> 0.2500, best 2.0000 at step 3 "
        "(3 evaluation(s))" in out
    )
