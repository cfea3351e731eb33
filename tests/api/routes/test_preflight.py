"""`POST /v1/train/sft/preflight`: the whole admission of a submission, answered as its plan,
or exactly the error the submission gets; never a job, a row, a queue message or a file."""

from __future__ import annotations

import json

import pytest

from api.errors import MEMORY_BREAKDOWN_HEADER
from kiln.store import register_runner
from tests.api.conftest import RUNNER_ID, example, sft_body, snapshot, unique_name

GIB = 1 << 30


def both(client, body):
    """(preflight response, submission response) for one body."""
    return client.post("/v1/train/sft/preflight", json=body), client.post("/v1/train/sft", json=body)


def test_the_plan_is_what_the_submission_is_admitted_with(client, engine, broker, storage, runner):
    body = sft_body(3, output_name=unique_name(), epochs=2, seed=7, optimizer={"kind": "adam_w"})
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft/preflight", json=body)
    assert response.status_code == 200, response.get_json()
    plan = response.get_json()
    assert snapshot(engine, broker, storage) == before  # nothing written
    admitted = client.post("/v1/train/sft", json=body).get_json()
    assert (
        (plan["rows_kept"], plan["total_steps"]) == (admitted["rows_kept"], admitted["total_steps"]) == (3, 6)
    )
    assert plan["grad_checkpoint_segments"] == admitted["grad_checkpoint_segments"]
    assert round(plan["memory"]["estimate_bytes"] / GIB, 4) == admitted["memory_estimate_gb"]
    assert plan["learning_rate"] == 1e-4 and plan["effective_config"]["seed"] == "7"
    assert plan["drawn"] == [] and plan["runner_id"] == RUNNER_ID
    assert plan["memory"]["breakdown"]["total"] == plan["memory"]["estimate_bytes"]
    assert plan["memory"]["available_bytes"] == 15 * GIB  # 16 GiB free less the 1 GiB reserve
    detail = client.get(f"/v1/train/jobs/{admitted['job_id']}").get_json()
    assert detail["replay_request"]["config"]["learning_rate"] == plan["learning_rate"]


def test_defaults_a_submission_draws_are_named_not_invented(client, runner):
    plan = client.post("/v1/train/sft/preflight", json=sft_body(1)).get_json()
    assert plan["drawn"] == ["seed", "output_name"]
    assert plan["effective_config"]["seed"] is None and plan["effective_config"]["output_name"] is None
    assert plan["learning_rate"] == 1e-3  # muon's default


def test_skipped_rows_are_listed_with_number_hash_and_reason(client, runner):
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}
    body = {"examples": [example(0), bad, example(1)], "config": {"invalid_row_policy": "skip", "epochs": 1}}
    plan = client.post("/v1/train/sft/preflight", json=body).get_json()
    assert (plan["rows_read"], plan["rows_kept"], plan["rows_rejected"]) == (3, 2, 1)
    (row,) = plan["rejected_rows"]
    assert (
        row["row_index"] == 2 and row["reason"] == "invalid_role" and row["row_sha256"].startswith("sha256:")
    )


@pytest.mark.parametrize(
    "body",
    [
        sft_body(1, epochs=0),
        sft_body(1, lora_alpha=100.0),
        sft_body(1, optimizer={"kind": "adam_w", "beta1": 1.0}),
        sft_body(1, gradient_accumulation_steps=4),
        sft_body(1, output_name="../x"),
        sft_body(1, resume_checkpoint="nope.kiln-checkpoint"),
        sft_body(1, base_adapter="missing"),
        {"examples": [{"messages": [{"role": "user", "content": "no answer"}]}], "config": {}},
        {"dataset_path": "absent.jsonl"},
        {"config": {}},
        [],
    ],
)
def test_a_refused_body_gets_exactly_the_submissions_error(body, client, engine, broker, storage, runner):
    before = snapshot(engine, broker, storage)
    preflight, submission = both(client, body)
    assert preflight.status_code == submission.status_code == 400
    assert preflight.get_json() == submission.get_json()
    assert snapshot(engine, broker, storage) == before


def test_a_name_in_use_is_the_same_409(client, runner):
    name = unique_name()
    assert client.post("/v1/train/sft", json=sft_body(1, output_name=name)).status_code == 200
    preflight, submission = both(client, sft_body(1, output_name=name))
    assert preflight.status_code == submission.status_code == 409
    assert preflight.get_json() == submission.get_json()


def test_no_live_runner_is_the_same_503(client, engine, broker, storage):
    before = snapshot(engine, broker, storage)
    preflight, submission = both(client, sft_body(1))
    assert preflight.status_code == submission.status_code == 503
    assert preflight.get_json() == submission.get_json()
    assert preflight.get_json()["error"]["code"] == "training_no_runner"
    assert snapshot(engine, broker, storage) == before


def _runner_with_budget(sessions, runner_kwargs, available_bytes: int) -> None:
    """Re-register the test runner so admission's budget is `available_bytes` (1 GiB reserve)."""
    kwargs = {**runner_kwargs, "free_memory_bytes": available_bytes + GIB, "total_memory_bytes": 64 * GIB}
    with sessions.begin() as session:
        register_runner(session, RUNNER_ID, **kwargs)


def test_a_job_that_will_not_fit_is_the_same_413_with_its_breakdown(
    client, engine, broker, storage, sessions, runner_kwargs
):
    _runner_with_budget(sessions, runner_kwargs, 1 << 20)  # 1 MiB: nothing fits
    before = snapshot(engine, broker, storage)
    preflight, submission = both(client, sft_body(1))
    assert preflight.status_code == submission.status_code == 413
    assert preflight.get_json() == submission.get_json()
    assert preflight.get_json()["error"]["code"] == "training_will_not_fit"
    breakdown = json.loads(preflight.headers[MEMORY_BREAKDOWN_HEADER])
    assert breakdown == json.loads(submission.headers[MEMORY_BREAKDOWN_HEADER])
    assert breakdown["available_bytes"] == 1 << 20 and breakdown["total"] > 1 << 20
    assert f"{breakdown['base_weights'] / GIB:.2f} GB" in preflight.get_json()["error"]["message"]
    assert snapshot(engine, broker, storage) == before


def test_the_largest_rank_that_fits_is_the_boundary_admission_draws(client, sessions, runner_kwargs, runner):
    def plan(rank: int):
        body = sft_body(2, lora_rank=rank, lora_alpha=float(rank), optimizer={"kind": "adam_w"})
        return client.post("/v1/train/sft/preflight", json=body)

    generous = plan(1).get_json()
    top = generous["lora_rank_range"]["maximum"]
    assert generous["max_lora_rank_that_fits"] == top  # 15 GiB: every rank fits the tiny model
    low = generous["memory"]["estimate_bytes"]
    high = plan(top).get_json()["memory"]["estimate_bytes"]
    assert high > low
    _runner_with_budget(sessions, runner_kwargs, (low + high) // 2)
    ceiling = plan(1).get_json()["max_lora_rank_that_fits"]
    assert 1 <= ceiling < top
    assert plan(ceiling).status_code == 200
    refused = plan(ceiling + 1)
    assert refused.status_code == 413
    assert (
        f"The largest lora_rank that fits this request is {ceiling}."
        in refused.get_json()["error"]["message"]
    )
