"""`POST /v1/train/sft`: admission in contract order, pinned rows, publish, defaults, dataset_path,
Idempotency-Key, and every rejection class leaving no row, no message and no file."""

from __future__ import annotations

import json

import pytest

from api import create_app
from kiln.store import Admission, Job, JobEvent, heartbeat_runner, register_adapter, register_runner
from tests.api.conftest import (
    RUNNER_ID,
    example,
    make_settings,
    sft_body,
    snapshot,
    unique_name,
)


def _job(sessions, job_id: str) -> Job:
    with sessions() as session:
        return session.get(Job, job_id)


def _admission(sessions, job_id: str) -> Admission:
    with sessions() as session:
        return session.get(Admission, job_id)


def test_admission_writes_job_admission_event_and_publishes(client, sessions, broker, runner, runner_kwargs):
    body = sft_body(3, output_name="math-v1", epochs=2)
    response = client.post("/v1/train/sft", json=body)
    assert response.status_code == 200, response.get_json()
    out = response.get_json()
    assert out["state"] == "queued"
    assert out["rows_kept"] == 3 and out["rows_rejected"] == 0 and out["total_steps"] == 6
    assert out["grad_checkpoint_segments"] == 1
    assert 0 < out["memory_estimate_gb"] < 1
    seed = out["effective_seed"]
    assert isinstance(seed, str) and seed.isdigit()

    job = _job(sessions, out["job_id"])
    assert (job.state, job.adapter_name, job.effective_seed) == ("queued", "math-v1", seed)
    assert (job.optimizer_kind, job.learning_rate, job.lora_rank, job.lora_alpha) == ("muon", 1e-3, 4, 8.0)
    assert (job.epochs, job.rows_kept, job.total_steps) == (2, 3, 6)
    assert (job.loss_route, job.backend, job.device) == ("kt_tape_flce", "cpu", "cpu")
    assert job.published_at is not None and job.idempotency_key is None
    assert job.request_fingerprint.startswith("sha256:")

    admission = _admission(sessions, out["job_id"])
    assert admission.runner_id == RUNNER_ID
    assert admission.execution_identity_digest == runner_kwargs["execution_identity_digest"]
    assert admission.loss_route == "kt_tape_flce"
    assert admission.checkpoint_plan == {
        "max_segments": 1,
        "auto": True,
        "budget_bytes": (16 << 30) - (1 << 30),
        "boundary": "contiguous",
        "resume_from": None,
    }
    assert admission.optimizer["kind"] == "muon" and admission.optimizer["learning_rate"] == 1e-3
    assert admission.memory_estimate_bytes == admission.memory_breakdown["total"]
    assert admission.effective_config["seed"] == seed
    assert admission.effective_config["grad_checkpoint_segments"] == 1
    assert admission.effective_config["output_name"] == "math-v1"
    assert admission.requested_config == body["config"]  # as sent: only what the client set
    assert "seed" not in admission.requested_config and admission.effective_config["truncation"] == "error"
    assert admission.data_source == "examples" and admission.examples == body["examples"]
    assert admission.ingestion_receipt["rows_kept"] == 3
    assert admission.kept_corpus_sha256 == admission.ingestion_receipt["kept_corpus_sha256"]
    assert admission.max_seq_len > admission.max_supervised_tokens > 0

    with sessions() as session:
        events = session.query(JobEvent).filter_by(job_id=out["job_id"]).all()
    assert [e.kind for e in events] == ["queued"]
    assert events[0].data["rows_kept"] == 3
    assert broker.task_ids() == [out["job_id"]]


def test_defaults_output_name_interval_learning_rate_and_explicit_seed(
    storage, db_url, engine, broker, sessions, runner
):
    settings = make_settings(storage, db_url, broker.queue, training={"checkpoint_interval": 5})
    app = create_app(settings)
    try:
        client = app.test_client()
        out = client.post("/v1/train/sft", json=sft_body(1, optimizer={"kind": "adam_w"})).get_json()
        config = _admission(sessions, out["job_id"]).effective_config
        assert config["output_name"] == f"sft-{out['job_id'][:8]}"
        assert config["checkpoint_interval"] == 5
        assert config["learning_rate"] == 1e-4
        explicit = client.post(
            "/v1/train/sft", json=sft_body(1, seed=18446744073709551615, checkpoint_interval=2)
        ).get_json()
        assert explicit["effective_seed"] == "18446744073709551615"
        config = _admission(sessions, explicit["job_id"]).effective_config
        assert config["checkpoint_interval"] == 2 and config["seed"] == "18446744073709551615"
    finally:
        app.extensions["kiln"].close()


def test_dataset_path_is_read_from_the_datasets_directory(client, settings, sessions, runner):
    data = settings.datasets_dir / "math.jsonl"
    data.write_text("\n".join(json.dumps(example(i)) for i in range(4)) + "\n\n", encoding="utf-8")
    response = client.post(
        "/v1/train/sft", json={"dataset_path": "math.jsonl", "config": {"lora_rank": 4, "lora_alpha": 8}}
    )
    assert response.status_code == 200, response.get_json()
    out = response.get_json()
    assert out["rows_kept"] == 4 and out["total_steps"] == 12  # default epochs 3
    admission = _admission(sessions, out["job_id"])
    assert admission.data_source == "dataset_path" and admission.examples is None
    assert admission.dataset_path == "math.jsonl"
    assert admission.ingestion_receipt["source"] == "dataset_path"
    assert admission.ingestion_receipt["source_locator"] == "math.jsonl"


def test_skip_policy_reports_rejected_rows(client, runner):
    bad = {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "x"}]}
    body = {
        "examples": [example(0), bad, example(1)],
        "config": {"lora_rank": 4, "lora_alpha": 8, "invalid_row_policy": "skip"},
    }
    out = client.post("/v1/train/sft", json=body).get_json()
    assert (out["rows_kept"], out["rows_rejected"]) == (2, 1)


def test_idempotency_key_replays_the_same_job(client, engine, broker, sessions, runner):
    body = sft_body(2, output_name=unique_name())
    first = client.post("/v1/train/sft", json=body, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 200
    # Same JSON with another key order and spacing is the same request.
    again = client.post(
        "/v1/train/sft",
        data=json.dumps(body, indent=3, sort_keys=True),
        headers={"Idempotency-Key": "k-1", "Content-Type": "application/json"},
    )
    assert again.status_code == 200
    assert again.get_json()["job_id"] == first.get_json()["job_id"]
    assert again.get_json()["effective_seed"] == first.get_json()["effective_seed"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert broker.depth() == 1
    with sessions() as session:
        assert session.query(Job).count() == 1
    assert _job(sessions, first.get_json()["job_id"]).idempotency_key == "k-1"


def test_idempotency_key_with_another_body_is_422(client, engine, broker, storage, runner):
    client.post("/v1/train/sft", json=sft_body(2), headers={"Idempotency-Key": "k-2"})
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=sft_body(3), headers={"Idempotency-Key": "k-2"})
    assert response.status_code == 422
    assert response.get_json()["error"]["code"] == "idempotency_key_reused"
    assert snapshot(engine, broker, storage) == before


def test_idempotency_key_format_is_checked(client, runner):
    response = client.post("/v1/train/sft", json=sft_body(1), headers={"Idempotency-Key": "x" * 256})
    assert response.status_code == 400
    assert "Idempotency-Key" in response.get_json()["error"]["message"]


def test_no_runner_is_503_with_retry_after(client, engine, broker, storage):
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=sft_body(1))
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "10"
    assert response.get_json()["error"]["code"] == "training_no_runner"
    assert snapshot(engine, broker, storage) == before


def test_stale_runner_is_not_live(client, sessions, runner_kwargs, settings):
    with sessions.begin() as session:
        register_runner(session, RUNNER_ID, **runner_kwargs)
    from datetime import timedelta

    from kiln.store import Runner, utcnow

    with sessions.begin() as session:
        session.get(Runner, RUNNER_ID).heartbeat_at = utcnow() - timedelta(
            seconds=settings.training.runner_stale_seconds + 5
        )
    assert client.post("/v1/train/sft", json=sft_body(1)).get_json()["error"]["code"] == "training_no_runner"


def test_will_not_fit_is_413_with_the_breakdown(client, sessions, engine, broker, storage, runner):
    with sessions.begin() as session:
        heartbeat_runner(
            session, RUNNER_ID, free_memory_bytes=(1 << 30) + (1 << 20)
        )  # 1 MiB over the reserve
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=sft_body(2))
    assert response.status_code == 413
    error = response.get_json()["error"]
    assert error["code"] == "training_will_not_fit"
    message = error["message"]
    assert message.startswith("Estimated training step working set is ")
    assert "but only 0.00 GB is available. Breakdown: weights 0.00 GB, activations " in message
    assert "route=kt_tape_flce" in message and "(lora_rank=4)." in message
    assert "num_segments=" in message and "max_seq_len=" in message
    assert "Dynamic gradient checkpointing was already tried (num_segments 1..=4)" in message
    assert error["hint"].startswith("Dynamic gradient checkpointing was already tried")
    assert snapshot(engine, broker, storage) == before


def test_full_logits_runner_refuses_explicit_segments(client, sessions, runner_kwargs):
    with sessions.begin() as session:
        register_runner(session, RUNNER_ID, **{**runner_kwargs, "loss_route": "full_logits"})
    response = client.post("/v1/train/sft", json=sft_body(1, grad_checkpoint_segments=2))
    assert response.status_code == 400
    assert "full_logits" in response.get_json()["error"]["message"]
    ok = client.post("/v1/train/sft", json=sft_body(1)).get_json()
    assert ok["grad_checkpoint_segments"] == 1


def test_explicit_segments_are_honoured(client, sessions, runner):
    out = client.post("/v1/train/sft", json=sft_body(1, grad_checkpoint_segments=3)).get_json()
    assert out["grad_checkpoint_segments"] == 3
    assert _admission(sessions, out["job_id"]).checkpoint_plan["auto"] is False


def test_tokenizer_mismatch_is_501(client, sessions, runner_kwargs):
    config = json.loads(json.dumps(runner_kwargs["model_config"]))
    config["identity"]["tokenizer_vocab_sha256"] = "sha256:" + "0" * 64
    with sessions.begin() as session:
        register_runner(session, RUNNER_ID, **{**runner_kwargs, "model_config": config})
    response = client.post("/v1/train/sft", json=sft_body(1))
    assert response.status_code == 501
    assert response.get_json()["error"]["message"].startswith(
        "Native training is unavailable on the selected backend: "
    )


def test_publish_failure_still_admits_and_leaves_the_job_unpublished(
    storage, db_url, engine, broker, sessions, runner
):
    from worker.celery_app import make_celery

    settings = make_settings(storage, db_url, broker.queue)
    dead = make_settings(storage, db_url, broker.queue, queue={"broker_url": "redis://127.0.0.1:1/0"})
    celery = make_celery(dead)
    celery.conf.broker_connection_timeout = 1
    celery.conf.broker_connection_max_retries = 0
    app = create_app(settings, celery=celery)
    try:
        response = app.test_client().post("/v1/train/sft", json=sft_body(1))
        assert response.status_code == 200
        job = _job(sessions, response.get_json()["job_id"])
        assert job.state == "queued" and job.published_at is None
        assert broker.depth() == 0
    finally:
        app.extensions["kiln"].close()


# ----- every rejection class leaves nothing behind ------------------------------------------


def _register(sessions, runner_kwargs, **overrides):
    with sessions.begin() as session:
        register_runner(session, RUNNER_ID, **{**runner_kwargs, **overrides})


def _unsupported_report(runner_kwargs) -> dict:
    report = json.loads(json.dumps(runner_kwargs["optimizer_support"]))
    for workload in report["workloads"]:
        if workload["workload"] == "sft":
            workload.update(
                supported=False, unavailable_reason="sft is switched off", allowed_optimizer_kinds=[]
            )
    return report


REJECTIONS = {
    # name: (setup(sessions, runner_kwargs, client, settings) -> body, status, code, message fragment)
    "unknown_field": (
        lambda s, k, c, st: (_register(s, k), sft_body(1, gradient_accumulation_steps=4))[1],
        400,
        "training_invalid_request",
        "config.gradient_accumulation_steps: unknown field",
    ),
    "unsafe_scale": (
        lambda s, k, c, st: (_register(s, k), sft_body(1, lora_rank=4, lora_alpha=32.0))[1],
        400,
        "training_invalid_request",
        "unsafe LoRA scaling",
    ),
    "bad_row": (
        lambda s, k, c, st: (
            _register(s, k),
            {
                "examples": [example(0), {"messages": [{"role": "robot", "content": "x"}]}],
                "config": {"lora_rank": 4, "lora_alpha": 8},
            },
        )[1],
        400,
        "training_invalid_request",
        "SFT row 2 (sha256:",
    ),
    "rank_out_of_range": (
        lambda s, k, c, st: (_register(s, k), sft_body(1, lora_rank=100000, lora_alpha=8.0))[1],
        400,
        "training_invalid_request",
        "lora_rank 100000 is outside",
    ),
    "dataset_outside": (
        lambda s, k, c, st: (_register(s, k), {"dataset_path": "../kiln.db"})[1],
        400,
        "training_invalid_request",
        "must not contain '..'",
    ),
    "missing_checkpoint": (
        lambda s, k, c, st: (
            _register(s, k),
            sft_body(1, resume_checkpoint="nope-checkpoint-step-00000001.kiln-checkpoint"),
        )[1],
        400,
        "training_invalid_request",
        "does not exist",
    ),
    "adapter_exists": (
        lambda s, k, c, st: (
            _register(s, k),
            _add_adapter(s, st, "taken"),
            sft_body(1, output_name="taken"),
        )[2],
        409,
        "adapter_already_exists",
        "adapter 'taken' already exists",
    ),
    "adapter_targeted": (
        lambda s, k, c, st: (
            _register(s, k),
            c.post("/v1/train/sft", json=sft_body(1, output_name="busy")),
            sft_body(2, output_name="busy"),
        )[2],
        409,
        "adapter_already_exists",
        "already targets adapter 'busy'",
    ),
    "will_not_fit": (
        lambda s, k, c, st: (_register(s, k, free_memory_bytes=1 << 30), sft_body(1))[1],
        413,
        "training_will_not_fit",
        "Breakdown: weights",
    ),
    "workload_unsupported": (
        lambda s, k, c, st: (_register(s, k, optimizer_support=_unsupported_report(k)), sft_body(1))[1],
        501,
        "training_backend_unsupported",
        "sft is switched off",
    ),
    "route_unpriced": (
        lambda s, k, c, st: (_register(s, k, loss_route="vulkan_active_rows"), sft_body(1))[1],
        501,
        "training_backend_unsupported",
        "vulkan_active_rows",
    ),
    "no_runner": (lambda s, k, c, st: sft_body(1), 503, "training_no_runner", "no live training runner"),
}


def _add_adapter(sessions, settings, name):
    with sessions.begin() as session:
        register_adapter(
            session,
            name=name,
            job_id=None,
            path=str(settings.adapters_dir / name),
            size_bytes=1,
            safetensors_sha256="sha256:" + "1" * 64,
            rank=4,
            alpha=8.0,
        )


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_rejection_leaves_no_row_message_or_file(
    case, client, sessions, engine, broker, storage, settings, runner_kwargs
):
    setup, status, code, fragment = REJECTIONS[case]
    body = setup(sessions, runner_kwargs, client, settings)
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=body)
    assert response.status_code == status, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == code
    assert fragment in error["message"]
    assert set(error) == {"code", "message", "hint"}
    assert snapshot(engine, broker, storage) == before


def test_queue_full_is_503_and_leaves_nothing(storage, db_url, engine, broker, sessions, runner):
    app = create_app(make_settings(storage, db_url, broker.queue, training={"max_queued_jobs": 1}))
    try:
        client = app.test_client()
        assert client.post("/v1/train/sft", json=sft_body(1)).status_code == 200
        before = snapshot(engine, broker, storage)
        response = client.post("/v1/train/sft", json=sft_body(1))
        assert response.status_code == 503 and response.headers["Retry-After"] == "30"
        assert response.get_json()["error"]["code"] == "training_queue_full"
        assert snapshot(engine, broker, storage) == before
    finally:
        app.extensions["kiln"].close()


def test_tracked_full_is_503(storage, db_url, engine, broker, sessions, runner):
    app = create_app(make_settings(storage, db_url, broker.queue, training={"max_tracked_jobs": 1}))
    try:
        client = app.test_client()
        assert client.post("/v1/train/sft", json=sft_body(1)).status_code == 200
        response = client.post("/v1/train/sft", json=sft_body(1))
        assert response.status_code == 503 and response.headers["Retry-After"] == "30"
        assert response.get_json()["error"]["code"] == "training_tracked_full"
    finally:
        app.extensions["kiln"].close()


def test_oversized_body_is_413_request_too_large(storage, db_url, engine, broker, runner):
    app = create_app(make_settings(storage, db_url, broker.queue, server={"max_request_mb": 0.01}))
    try:
        before = snapshot(engine, broker, storage)
        response = app.test_client().post("/v1/train/sft", json=sft_body(200))
        assert response.status_code == 413
        assert response.get_json()["error"]["code"] == "training_request_too_large"
        assert snapshot(engine, broker, storage) == before
    finally:
        app.extensions["kiln"].close()


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"examples": NaN}', b"\xff\xfe"])
def test_malformed_json_is_400(raw, client, engine, broker, storage, runner):
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", data=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "training_invalid_request"
    assert snapshot(engine, broker, storage) == before


def test_body_must_be_an_object(client, runner):
    response = client.post("/v1/train/sft", json=[1, 2])
    assert response.status_code == 400
    assert "JSON object" in response.get_json()["error"]["message"]


def test_broker_queue_is_the_configured_one(client, broker, runner):
    client.post("/v1/train/sft", json=sft_body(1))
    assert broker.client.llen(broker.queue) == 1


def test_embedded_default_broker_receives_the_message(storage, db_url, engine, broker, sessions, runner):
    """With no broker configured the api publishes to the SQLite broker under the storage root."""
    import sqlite3

    settings = make_settings(storage, db_url, broker.queue)
    settings = settings.model_copy(update={"queue": settings.queue.model_copy(update={"broker_url": None})})
    app = create_app(settings)
    try:
        response = app.test_client().post("/v1/train/sft", json=sft_body(1))
        assert response.status_code == 200
        assert _job(sessions, response.get_json()["job_id"]).published_at is not None
        with sqlite3.connect(storage / "broker.db") as broker_db:
            assert broker_db.execute("SELECT count(*) FROM kombu_message").fetchone() == (1,)
    finally:
        app.extensions["kiln"].close()
