"""The model a job trains on, named in its answers: the submission, the status list and the job
detail carry the runner's model path and, for a random checkpoint Kiln drew, its preset and seed
(`kiln_train/model/random_init.py`); a real model (no mark) says `random_init: null`."""

from __future__ import annotations

import shutil

from kiln.store import register_runner
from kiln_train.model.random_init import RANDOM_INIT_FILE, random_init_of
from tests.api.conftest import RUNNER_ID, sft_body


def test_a_job_names_its_random_model_in_every_answer(client, runner, runner_kwargs, tiny_model_dir):
    expected = {"path": str(tiny_model_dir), "random_init": {"preset": "tiny", "seed": 0}}
    assert runner_kwargs["model_config"]["random_init"] == expected["random_init"]
    answer = client.post("/v1/train/sft", json=sft_body())
    assert answer.status_code == 200, answer.get_json()
    job_id = answer.get_json()["job_id"]
    assert answer.get_json()["model"] == expected
    assert client.get(f"/v1/train/jobs/{job_id}").get_json()["model"] == expected
    assert client.get(f"/v1/train/status/{job_id}").get_json()["model"] == expected
    listed = {j["job_id"]: j for j in client.get("/v1/train/status").get_json()}
    assert listed[job_id]["model"] == expected


def test_health_says_the_resident_model_is_random(client, runner):
    runner_body = client.get("/health").get_json()["runner"]
    assert runner_body["model_random_init"] == {"preset": "tiny", "seed": 0}


def test_a_real_model_has_no_random_mark(client, sessions, runner_kwargs, tiny_model_dir, tmp_path):
    unmarked = shutil.copytree(tiny_model_dir, tmp_path / "qwen3.5-real")
    (unmarked / RANDOM_INIT_FILE).unlink()
    real = {**runner_kwargs, "model_path": str(unmarked)}
    real["model_config"] = {**runner_kwargs["model_config"], "random_init": random_init_of(unmarked)}
    with sessions.begin() as session:
        register_runner(session, RUNNER_ID, **real)
    answer = client.post("/v1/train/sft", json=sft_body())
    assert answer.status_code == 200, answer.get_json()
    job_id = answer.get_json()["job_id"]
    assert client.get(f"/v1/train/jobs/{job_id}").get_json()["model"] == {
        "path": str(unmarked),
        "random_init": None,
    }


def test_the_mark_is_read_only_from_a_well_formed_file(tmp_path):
    assert random_init_of(tmp_path) is None
    assert random_init_of(None) is None
    (tmp_path / RANDOM_INIT_FILE).write_text("not json", encoding="utf-8")
    assert random_init_of(tmp_path) is None
    (tmp_path / RANDOM_INIT_FILE).write_text('{"preset": "small", "seed": 3}', encoding="utf-8")
    assert random_init_of(tmp_path) == {"preset": "small", "seed": 3}
