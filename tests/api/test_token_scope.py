"""Tokens are equal administrators (docs/security.md#tokens): token B lists, reads, downloads,
cancels and deletes what token A made, route family by route family, as documented; only an
Idempotency-Key is scoped to the token that sent it. `/metrics` needs a token; error messages
name no server path."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from api import create_app
from kiln.store import register_adapter
from tests.api.conftest import make_settings, sft_body
from tests.api.hf_support import export_body
from tests.kiln_train.interop.support import fake_run_output, tar_gz

A, B = "token-a", "token-b"
RUN_FILES = ["adapter_config.json", "adapter_model.safetensors", "kiln_hf_result.json", "step_losses.jsonl"]


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def secured_settings(storage, db_url, engine, broker):
    return make_settings(storage, db_url, broker.queue, server={"api_tokens": [A, B]})


@pytest.fixture
def secured(secured_settings):
    app = create_app(secured_settings)
    yield app.test_client()
    app.extensions["kiln"].close()


def test_jobs_token_b_reads_cancels_and_deletes_token_a_s_job(secured, runner):
    job = secured.post("/v1/train/sft", json=sft_body(2), headers=bearer(A)).get_json()["job_id"]
    b = bearer(B)
    assert [j["job_id"] for j in secured.get("/v1/train/status", headers=b).get_json()] == [job]
    assert secured.get(f"/v1/train/status/{job}", headers=b).get_json()["state"] == "queued"
    assert secured.get(f"/v1/train/jobs/{job}", headers=b).status_code == 200
    events = secured.get(f"/v1/train/jobs/{job}/events", headers=b).get_json()
    assert [e["kind"] for e in events["data"]][:1] == ["queued"]
    assert [q["job_id"] for q in secured.get("/v1/train/queue", headers=b).get_json()["queued"]] == [job]
    assert secured.delete(f"/v1/train/queue/{job}", headers=b).status_code == 200
    assert secured.delete(f"/v1/train/jobs/{job}", headers=b).status_code == 200
    assert secured.get(f"/v1/train/status/{job}", headers=bearer(A)).status_code == 404


def test_idempotency_keys_are_the_one_thing_scoped_per_token(secured, runner):
    key = {"Idempotency-Key": "same-key"}
    first = secured.post("/v1/train/sft", json=sft_body(1), headers={**bearer(A), **key}).get_json()
    again = secured.post("/v1/train/sft", json=sft_body(1), headers={**bearer(A), **key}).get_json()
    other = secured.post("/v1/train/sft", json=sft_body(1), headers={**bearer(B), **key}).get_json()
    assert again["job_id"] == first["job_id"] and other["job_id"] != first["job_id"]


def test_datasets_token_b_lists_reads_inspects_and_deletes_token_a_s_upload(secured, runner):
    rows = json.dumps(sft_body(1)["examples"][0]).encode() + b"\n"
    created = secured.post(
        "/v1/datasets?name=a.jsonl", data=rows, headers={**bearer(A), "Content-Type": "application/x-ndjson"}
    )
    assert created.status_code == 201, created.get_json()
    b = bearer(B)
    assert [d["name"] for d in secured.get("/v1/datasets", headers=b).get_json()["datasets"]] == ["a.jsonl"]
    assert secured.get("/v1/datasets/a.jsonl", headers=b).get_json()["sha256"] == created.get_json()["sha256"]
    assert secured.get("/v1/datasets/a.jsonl/inspect", headers=b).status_code == 200
    assert secured.delete("/v1/datasets/a.jsonl", headers=b).status_code == 200
    assert secured.get("/v1/datasets", headers=bearer(A)).get_json()["datasets"] == []


def test_exports_and_adapters_token_b_acts_on_token_a_s(secured, runner, secured_settings, tmp_path):
    a, b = bearer(A), bearer(B)
    assert secured.post("/v1/train/hf/sft/exports", json=export_body(), headers=a).status_code == 201
    bundle = secured_settings.storage_root / "hf-exports" / "bundle.kiln-hf"
    upload = tar_gz(fake_run_output(bundle, tmp_path / "out"), RUN_FILES)
    imported = secured.post(
        "/v1/train/hf/peft/imports/tuned", data=upload, headers={**a, "Content-Type": "application/gzip"}
    )
    assert imported.status_code == 201, imported.get_json()
    assert [e["name"] for e in secured.get("/v1/train/hf/exports", headers=b).get_json()["exports"]] == [
        "bundle"
    ]
    assert secured.get("/v1/train/hf/exports/bundle", headers=b).status_code == 200
    download = secured.get("/v1/train/hf/exports/bundle/download", headers=b)
    with tarfile.open(fileobj=io.BytesIO(download.get_data()), mode="r:gz") as tar:
        assert any(n.endswith("kiln_hf_export.json") for n in tar.getnames())
    assert [x["name"] for x in secured.get("/v1/adapters", headers=b).get_json()["adapters"]] == ["tuned"]
    assert secured.get("/v1/adapters/tuned/download", headers=b).status_code == 200
    assert secured.get("/v1/checkpoints", headers=b).status_code == 200
    assert secured.delete("/v1/adapters/tuned", headers=b).get_json()["status"] == "deleted"
    assert secured.delete("/v1/train/hf/exports/bundle", headers=b).status_code == 200
    assert secured.get("/v1/train/hf/exports", headers=a).get_json()["exports"] == []


def test_metrics_need_a_token_and_health_does_not(secured):
    assert secured.get("/metrics").status_code == 401
    assert secured.get("/metrics", headers=bearer("wrong")).status_code == 401
    assert secured.get("/metrics", headers=bearer(B)).status_code == 200
    assert secured.get("/health").status_code == 200


def test_the_sign_in_page_says_tokens_are_equal_administrators(secured):
    page = secured.get("/").get_data(as_text=True)
    assert "Every api token is an equal administrator: it sees and changes every job, dataset" in page


def test_error_messages_name_no_server_path(secured, runner, secured_settings, sessions):
    """The registry's parent (`<registry>/..`) and a path outside it are refused without the
    server's absolute paths in the answer."""
    registry = str(secured_settings.adapters_dir)
    for resume in (f"{registry}/..", "/elsewhere/x.kiln-checkpoint", f"{registry}/absent.kiln-checkpoint"):
        body = sft_body(1, resume_checkpoint=resume)
        answer = secured.post("/v1/train/sft", json=body, headers=bearer(A))
        assert answer.status_code == 400, answer.get_json()
        text = answer.get_data(as_text=True)
        assert str(secured_settings.storage_root) not in text, text
    with sessions.begin() as session:
        register_adapter(
            session,
            name="gone",
            job_id=None,
            path=str(secured_settings.adapters_dir / "gone"),
            size_bytes=1,
            safetensors_sha256="sha256:" + "0" * 64,
            rank=4,
            alpha=8.0,
        )
    gone = secured.get("/v1/adapters/gone/download", headers=bearer(B))
    assert gone.status_code == 404
    assert "its directory <registry>/gone is missing" in gone.get_json()["error"]["message"]
    assert str(secured_settings.storage_root) not in gone.get_data(as_text=True)
