"""Held-out validation through the api (docs/validation.md): the request field and its refusals,
what admission pins and prices, the preflight, a resume's validation identity, the job answer's
`validation_history`, the metrics gauges and the OpenAPI document. A refusal writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.store import (
    Admission,
    Job,
    JobEvent,
    claim_job,
    heartbeat_runner,
    record_evaluation,
    record_step,
)
from kiln_train.checkpoint import epoch_order, publish_checkpoint, sft_manifest_draft
from kiln_train.ground.backend import backend_for_device
from kiln_train.optim.kinds import keeps_state
from kiln_train.sft_config import SftConfig
from tests.api.conftest import RUNNER_ID, example, snapshot
from tests.kiln_train.checkpoint.checkpoint_support import artifacts, auxiliary_state

NO_TARGET = {"messages": [{"role": "user", "content": "only a question"}]}
WORKER = "worker-test"


def body(n: int = 4, validation: dict | None = None, **config) -> dict:
    out = {
        "examples": [example(i) for i in range(n)],
        "config": {"epochs": 2, "lora_rank": 4, "lora_alpha": 8.0, **config},
    }
    if validation is not None:
        out["validation"] = validation
    return out


def long_row(words: int) -> dict:
    text = " ".join(f"word{i}" for i in range(words))
    return {"messages": [{"role": "user", "content": "Repeat."}, {"role": "assistant", "content": text}]}


def test_inline_validation_is_pinned_priced_and_replayed(client, sessions, runner):
    validation = {"examples": [example(20), example(21)], "interval_steps": 3}
    response = client.post("/v1/train/sft", json=body(validation=validation))
    assert response.status_code == 200, response.get_json()
    out = response.get_json()
    assert out["rows_kept"] == 4 and out["total_steps"] == 8  # validation rows are not trained on
    with sessions() as session:
        admission = session.get(Admission, out["job_id"])
        job = session.get(Job, out["job_id"])
        (event,) = session.query(JobEvent).filter_by(job_id=out["job_id"]).all()
        pinned = dict(admission.validation)
        receipt = dict(admission.ingestion_receipt)
        breakdown = dict(admission.memory_breakdown)
        estimate = admission.memory_estimate_bytes
    assert pinned == validation
    assert job.rows_kept == 4
    part = receipt["validation"]
    assert part["source"] == "inline" and part["rows_read"] == part["rows_kept"] == 2
    assert receipt["rows_kept"] == 4
    forward = breakdown["validation_forward"]
    assert forward["num_segments"] == 1 and forward["lora_param_grad"] < breakdown["lora_param_grad"]
    assert estimate == max(breakdown["total"], forward["total"])
    assert event.data["validation_rows"] == 2
    detail = client.get(f"/v1/train/jobs/{out['job_id']}").get_json()
    assert detail["replay_request"]["validation"] == validation
    assert detail["validation_history"] == []


def test_without_validation_nothing_new_is_pinned(client, sessions, runner):
    out = client.post("/v1/train/sft", json=body()).get_json()
    with sessions() as session:
        admission = session.get(Admission, out["job_id"])
        assert admission.validation is None
        assert "validation" not in admission.ingestion_receipt
        assert "validation_forward" not in admission.memory_breakdown
        assert admission.memory_estimate_bytes == admission.memory_breakdown["total"]
        (event,) = session.query(JobEvent).filter_by(job_id=out["job_id"]).all()
    assert "validation_rows" not in event.data
    assert "validation" not in client.get(f"/v1/train/jobs/{out['job_id']}").get_json()["replay_request"]


def test_a_holdout_takes_rows_out_of_training_by_the_run_seed(client, sessions, runner):
    request = body(10, validation={"holdout_percent": 20}, seed=1234)
    plans = [client.post("/v1/train/sft/preflight", json=request).get_json() for _ in range(2)]
    assert plans[0] == plans[1]  # one seed, one split
    plan = plans[0]
    assert plan["rows_read"] == 10 and plan["rows_kept"] == 8 and plan["total_steps"] == 16
    assert plan["validation"]["source"] == "holdout" and plan["validation"]["holdout_percent"] == 20
    assert plan["validation"]["rows_kept"] == 2
    out = client.post("/v1/train/sft", json=request).get_json()
    assert out["rows_kept"] == 8 and out["total_steps"] == 16
    with sessions() as session:
        receipt = session.get(Admission, out["job_id"]).ingestion_receipt
    assert receipt["validation"]["kept_corpus_sha256"] == plan["validation"]["corpus_sha256"]
    assert receipt["kept_corpus_sha256"] == plan["kept_corpus_sha256"]
    other = client.post(
        "/v1/train/sft/preflight", json=body(10, validation={"holdout_percent": 20}, seed=99)
    ).get_json()
    assert other["validation"]["corpus_sha256"] != plan["validation"]["corpus_sha256"]


@pytest.mark.parametrize(
    ("validation", "config", "fragment"),
    [
        ({"holdout_percent": 10, "bogus": 1}, {}, "validation.bogus: unknown field"),
        ({"holdout_percent": 10, "examples": [example(1)]}, {}, "validation: exactly one of"),
        ({"holdout_percent": 51}, {}, "validation.holdout_percent: Input should be less than or equal to 50"),
        (
            {"holdout_percent": 5, "interval_steps": 0},
            {},
            "validation.interval_steps: Input should be greater",
        ),
        ({"examples": [example(1), {"messages": 7}]}, {}, "validation.examples[1]: "),
        ({"examples": [example(1), NO_TARGET]}, {}, "SFT validation row 2 (sha256:"),
        (
            {"examples": [NO_TARGET]},
            {"invalid_row_policy": "skip"},
            "validation corpus contains no usable rows: read 1 row(s), rejected 1",
        ),
        ({"dataset_path": "held-out.jsonl"}, {}, "validation.dataset_path 'held-out.jsonl' does not exist"),
        ({"dataset_path": "x" * 1025}, {}, "validation.dataset_path is 1025 characters"),
    ],
)
def test_a_bad_validation_is_a_400_naming_it_and_leaves_nothing(
    validation, config, fragment, client, engine, broker, storage, runner
):
    before = snapshot(engine, broker, storage)
    for path in ("/v1/train/sft", "/v1/train/sft/preflight"):
        response = client.post(path, json=body(validation=validation, **config))
        assert response.status_code == 400, response.get_json()
        error = response.get_json()["error"]
        assert error["code"] == "training_invalid_request"
        assert fragment in error["message"], error["message"]
    assert snapshot(engine, broker, storage) == before


def test_a_holdout_without_a_row_on_each_side_is_a_400(client, engine, broker, storage, runner):
    before = snapshot(engine, broker, storage)
    same = {
        "examples": [example(1)] * 3,
        "config": {"lora_rank": 4, "lora_alpha": 8.0},
        "validation": {"holdout_percent": 50},
    }
    response = client.post("/v1/train/sft", json=same)
    assert response.status_code == 400
    message = response.get_json()["error"]["message"]
    assert "validation.holdout_percent 50: 3 kept row(s) in 1 distinct row hash(es)" in message
    assert snapshot(engine, broker, storage) == before


def test_a_validation_dataset_path_is_read_under_the_datasets_directory(client, sessions, settings, runner):
    settings.datasets_dir.mkdir(parents=True, exist_ok=True)
    (settings.datasets_dir / "held-out.jsonl").write_text(
        "".join(json.dumps(example(i)) + "\n" for i in (30, 31, 32))
    )
    out = client.post("/v1/train/sft", json=body(validation={"dataset_path": "held-out.jsonl"})).get_json()
    with sessions() as session:
        part = session.get(Admission, out["job_id"]).ingestion_receipt["validation"]
    assert part["source"] == "dataset_path" and part["source_locator"] == "held-out.jsonl"
    assert part["rows_kept"] == 3


def test_a_validation_row_that_cannot_fit_is_a_413_naming_the_forward(
    client, sessions, engine, broker, storage, runner
):
    request = body(2, validation={"examples": [long_row(3000)]})
    plan = client.post("/v1/train/sft/preflight", json=request).get_json()
    train_total = plan["memory"]["breakdown"]["total"]
    forward_total = plan["validation"]["memory"]["estimate_bytes"]
    assert forward_total > train_total  # the held-out row is far longer than the training rows
    assert plan["memory"]["estimate_bytes"] == forward_total
    with sessions.begin() as session:  # the training step fits, the validation forward does not
        heartbeat_runner(session, RUNNER_ID, free_memory_bytes=(1 << 30) + (train_total + forward_total) // 2)
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=request)
    assert response.status_code == 413, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == "training_will_not_fit"
    assert error["message"].startswith("Estimated validation forward working set is ")
    assert "Breakdown: weights 0.00 GB, activations " in error["message"]
    assert "send shorter validation examples" in error["message"]
    header = json.loads(response.headers["Kiln-Memory-Breakdown"])
    assert header["phase"] == "validation_forward" and header["total"] == forward_total
    assert snapshot(engine, broker, storage) == before
    assert client.post("/v1/train/sft", json=body(2)).status_code == 200  # the training rows alone fit


def test_the_preflight_reports_the_validation_rows(client, engine, broker, storage, runner):
    before = snapshot(engine, broker, storage)
    request = body(
        3, validation={"examples": [example(40), NO_TARGET], "interval_steps": 4}, invalid_row_policy="skip"
    )
    plan = client.post("/v1/train/sft/preflight", json=request).get_json()
    validation = plan["validation"]
    assert validation["source"] == "inline" and validation["interval_steps"] == 4
    assert (validation["rows_read"], validation["rows_kept"], validation["rows_rejected"]) == (2, 1, 1)
    assert validation["rejected_rows"][0]["row_index"] == 2
    assert validation["rejected_rows"][0]["reason"] == "tokenization_error"
    assert validation["corpus_sha256"].startswith("sha256:")
    # 6 steps of 3 rows: the baseline, epoch ends 3 and 6, interval 4
    assert validation["evaluations"] == 4
    assert validation["memory"]["breakdown"]["num_segments"] == 1
    assert plan["validation"]["max_seq_len"] <= plan["validation"]["total_tokens"]
    assert client.post("/v1/train/sft/preflight", json=body(3)).get_json()["validation"] is None
    assert snapshot(engine, broker, storage) == before


def _checkpoint_with_validation(client, sessions, settings, request: dict, name: str) -> Path:
    """Admit `request`, cancel it and publish its checkpoint at step 3 binding its validation."""
    plan = client.post("/v1/train/sft/preflight", json=request).get_json()
    out = client.post("/v1/train/sft", json=request).get_json()
    assert client.delete(f"/v1/train/queue/{out['job_id']}").get_json()["status"] == "cancelled"
    with sessions() as session:
        admission = session.get(Admission, out["job_id"])
        config = SftConfig.model_validate(admission.effective_config)
        corpus = admission.kept_corpus_sha256
    rows = plan["rows_kept"]
    identity = {
        "schema": "kiln.sft-validation.v1",
        "source": plan["validation"]["source"],
        "rows": plan["validation"]["rows_kept"],
        "supervised_tokens": plan["validation"]["total_supervised_tokens"],
        "corpus_sha256": plan["validation"]["corpus_sha256"],
        "interval_steps": plan["validation"]["interval_steps"],
    }
    history = [{"global_step": 0, "epoch": 0, "loss": 12.5, "token_accuracy": 0.0}]
    draft = sft_manifest_draft(
        config=config,
        adapter_name=name,
        precision_policy=backend_for_device("cpu").precision_policy(keeps_state(config.optimizer.kind)),
        global_step=3,
        total_steps=config.epochs * rows,
        epoch_index=0,
        cursor_in_epoch=3,
        data_order=epoch_order(config.seed, 0, rows),
        content_sha256=corpus,
        item_count=rows,
        auxiliary_state={
            **auxiliary_state(config.optimizer.kind),
            "validation": identity,
            "validation_history": history,
        },
    )
    return Path(publish_checkpoint(settings.adapters_dir, draft, artifacts(3, config.optimizer.kind)).path)


def test_a_resume_must_bring_the_same_validation(client, sessions, settings, engine, broker, storage, runner):
    validation = {"examples": [example(20), example(21)], "interval_steps": 2}
    request = body(5, validation=validation, output_name="validated")
    point = _checkpoint_with_validation(client, sessions, settings, request, "validated")
    resume = {**request, "config": {**request["config"], "resume_checkpoint": point.name}}
    before = snapshot(engine, broker, storage)
    for changed, fragment in (
        (
            {**validation, "examples": [example(22)]},
            "auxiliary_state.validation.rows: checkpoint 2, request 1",
        ),
        (
            {**validation, "interval_steps": 3},
            "auxiliary_state.validation.interval_steps: checkpoint 2, request 3",
        ),
        (None, "auxiliary_state.validation: checkpoint {"),
    ):
        drifted = {k: v for k, v in resume.items() if k != "validation"}
        if changed is not None:
            drifted["validation"] = changed
        response = client.post("/v1/train/sft", json=drifted)
        assert response.status_code == 400, response.get_json()
        message = response.get_json()["error"]["message"]
        assert f"config.resume_checkpoint {point.name!r} does not match this request at {fragment}" in message
    assert snapshot(engine, broker, storage) == before
    same = client.post("/v1/train/sft", json=resume)
    assert same.status_code == 200, same.get_json()


def test_the_job_answer_and_the_metrics_carry_the_validation_curve(client, sessions, runner):
    out = client.post("/v1/train/sft", json=body(validation={"holdout_percent": 25})).get_json()
    job_id = out["job_id"]
    with sessions.begin() as session:
        job = claim_job(session, job_id, WORKER, 60)
        attempt = job.attempts
        record_evaluation(
            session,
            job_id,
            WORKER,
            {
                "global_step": 0,
                "epoch": 0,
                "loss": 2.5,
                "token_accuracy": 0.25,
                "supervised_tokens": 12,
                "rows": 1,
            },
            attempt=attempt,
        )
        record_step(
            session,
            job_id,
            WORKER,
            global_step=1,
            epoch=0,
            loss=2.0,
            learning_rate=1e-3,
            step_ms=5.0,
            tokens=20,
            supervised_tokens=6,
            attempt=attempt,
        )
        record_evaluation(
            session,
            job_id,
            WORKER,
            {
                "global_step": 1,
                "epoch": 0,
                "loss": 2.25,
                "token_accuracy": 0.5,
                "supervised_tokens": 12,
                "rows": 1,
            },
            attempt=attempt,
        )
    status = client.get(f"/v1/train/status/{job_id}").get_json()
    assert [(v["global_step"], v["loss"], v["token_accuracy"]) for v in status["validation_history"]] == [
        (0, 2.5, 0.25),
        (1, 2.25, 0.5),
    ]
    sample = status["validation_history"][1]
    assert sample["epoch"] == 0 and sample["rows"] == 1 and sample["supervised_tokens"] == 12
    assert sample["progress"] == pytest.approx(1 / status["total_steps"]) and sample["elapsed_secs"] >= 0
    detail = client.get(f"/v1/train/jobs/{job_id}").get_json()
    assert detail["validation_history"] == status["validation_history"]
    (listed,) = [j for j in client.get("/v1/train/status").get_json() if j["job_id"] == job_id]
    assert listed["validation_history"] == status["validation_history"]
    queue = client.get("/v1/train/queue").get_json()
    assert queue["running"]["validation_history"] == status["validation_history"]
    text = client.get("/metrics").get_data(as_text=True)
    labels = f'adapter_name="{status["adapter_name"]}",job_id="{job_id}"'
    assert f"kiln_validation_loss{{{labels}}} 2.25" in text
    assert f"kiln_validation_token_accuracy{{{labels}}} 0.5" in text
    assert f"kiln_validation_global_step{{{labels}}} 1.0" in text


def test_the_openapi_document_describes_validation(client):
    doc = client.get("/openapi.json").get_json()
    schemas = doc["components"]["schemas"]
    spec = schemas["ValidationSpec"]
    assert spec["additionalProperties"] is False
    assert set(spec["properties"]) == {"examples", "dataset_path", "holdout_percent", "interval_steps"}
    percent = spec["properties"]["holdout_percent"]["anyOf"][0]
    assert (percent["minimum"], percent["maximum"]) == (1, 50)
    interval = spec["properties"]["interval_steps"]["anyOf"][0]
    assert (interval["minimum"], interval["maximum"]) == (1, 2**64 - 1)
    assert spec["properties"]["dataset_path"]["anyOf"][0]["maxLength"] == 1024
    assert [sorted(branch["required"]) for branch in spec["oneOf"]] == [
        ["examples"],
        ["dataset_path"],
        ["holdout_percent"],
    ]
    assert schemas["SftRequest"]["properties"]["validation"]["anyOf"][0] == {
        "$ref": "#/components/schemas/ValidationSpec"
    }
    assert "validation_history" in schemas["TrainingStatus"]["required"]
    assert schemas["ValidationSample"]["required"] == [
        "global_step",
        "epoch",
        "progress",
        "loss",
        "token_accuracy",
        "supervised_tokens",
        "rows",
        "elapsed_secs",
    ]
    assert "validation" in schemas["PreflightResponse"]["properties"]
