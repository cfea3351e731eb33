"""Stored datasets (`/v1/datasets`) and the data inspector (`/v1/data/inspect`): uploads are
validated like a `dataset_path` submission and stored atomically under a name never reused;
a refused upload leaves no file; the inspector answers the facts `kiln data inspect --json`
prints, plus the rendering cut into tokens with the supervised ones marked."""

from __future__ import annotations

import hashlib
import json

import pytest
from click.testing import CliRunner

from api import create_app
from kiln_cli.main import cli
from kiln_train.data.ingestion import ingest_jsonl
from kiln_train.data.labels import IGNORE_INDEX
from tests.api.conftest import example, make_settings, snapshot

NDJSON = {"Content-Type": "application/x-ndjson"}
BAD_ROLE = {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}
XSS = {
    "messages": [
        {"role": "user", "content": "<img src=x onerror=alert(1)>"},
        {"role": "assistant", "content": "<script>alert(2)</script> & done"},
    ]
}


def jsonl(*rows) -> bytes:
    return ("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n").encode()


def upload(client, name, data: bytes, **query):
    params = "&".join(f"{k}={v}" for k, v in {"name": name, **query}.items())
    return client.post(f"/v1/datasets?{params}", data=data, headers=NDJSON)


def test_upload_stores_the_file_with_its_hash_and_facts_and_a_job_trains_on_it(
    client, settings, runner, qwen_tokenizer
):
    data = jsonl(example(0), example(1), XSS)
    response = upload(client, "rows.jsonl", data)
    assert response.status_code == 201, response.get_json()
    info = response.get_json()
    stored = settings.datasets_dir / "rows.jsonl"
    assert stored.read_bytes() == data
    assert info["sha256"] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert info["bytes"] == len(data) and info["dataset_path"] == "rows.jsonl"
    expected = ingest_jsonl(stored, tokenizer=qwen_tokenizer)
    stats = info["stats"]
    assert (stats["rows_read"], stats["rows_kept"], stats["rows_rejected"]) == (3, 3, 0)
    assert stats["tokens"] == expected.total_tokens
    assert stats["supervised_tokens"] == expected.total_supervised_tokens
    assert stats["kept_corpus_sha256"] == expected.receipt["kept_corpus_sha256"]
    assert stats["tokenizer"].startswith("runner runner-test")
    # the hidden sidecar is not a dataset; the listing and the detail agree with the upload
    assert [d["name"] for d in client.get("/v1/datasets").get_json()["datasets"]] == ["rows.jsonl"]
    assert client.get("/v1/datasets").get_json()["datasets"][0] == info
    assert client.get("/v1/datasets/rows.jsonl").get_json() == info
    body = {"dataset_path": info["dataset_path"], "config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0}}
    admitted = client.post("/v1/train/sft", json=body)
    assert admitted.status_code == 200, admitted.get_json()
    assert admitted.get_json()["rows_kept"] == 3


def test_a_bad_row_under_fail_is_a_row_numbered_400_and_nothing_is_stored(
    client, engine, broker, storage, runner
):
    before = snapshot(engine, broker, storage)
    response = upload(client, "bad.jsonl", jsonl(example(0), BAD_ROLE))
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["code"] == "training_invalid_request"
    assert "SFT row 2 (sha256:" in error["message"] and "rejected as invalid_role" in error["message"]
    assert snapshot(engine, broker, storage) == before


def test_skip_stores_the_rows_it_can_and_records_each_rejection(client, settings, runner):
    response = upload(
        client, "mixed.jsonl", jsonl(example(0), BAD_ROLE, "{not json", example(1)), invalid_row_policy="skip"
    )
    assert response.status_code == 201, response.get_json()
    stats = response.get_json()["stats"]
    assert (stats["rows_read"], stats["rows_kept"], stats["rows_rejected"]) == (4, 2, 2)
    rejections = stats["rejections"]
    assert [(r["row_index"], r["reason"]) for r in rejections] == [(2, "invalid_role"), (3, "invalid_json")]
    assert "messages[1].role is 'bot'" in rejections[0]["detail"]
    assert all(r["row_sha256"].startswith("sha256:") for r in rejections)


def test_an_upload_of_mixed_formats_reports_formats_lines_and_blank_lines(client, settings, runner):
    alpaca = {"instruction": "Translate to French", "input": "good morning", "output": "bonjour"}
    plain = {"prompt": "2+2=", "completion": "4"}
    body = jsonl(example(0), "", alpaca, "", "", {"instruction": "x", "output": ""}, plain)
    response = upload(client, "formats.jsonl", body, invalid_row_policy="skip")
    assert response.status_code == 201, response.get_json()
    stats = response.get_json()["stats"]
    assert stats["rows_per_format"] == {"instruction": 1, "messages": 1, "text_prompt_completion": 1}
    assert stats["blank_lines"] == 3
    (rejection,) = stats["rejections"]
    assert (rejection["row_index"], rejection["line"], rejection["reason"]) == (3, 6, "empty_output")
    described = client.get("/v1/datasets/formats.jsonl").get_json()["stats"]
    assert described == stats


def test_a_name_is_never_overwritten(client, settings, runner):
    assert upload(client, "keep.jsonl", jsonl(example(0))).status_code == 201
    before = (settings.datasets_dir / "keep.jsonl").read_bytes()
    response = upload(client, "keep.jsonl", jsonl(example(1), example(2)))
    assert response.status_code == 409
    assert response.get_json()["error"]["code"] == "dataset_already_exists"
    assert (settings.datasets_dir / "keep.jsonl").read_bytes() == before
    assert sorted(p.name for p in settings.datasets_dir.iterdir()) == [
        ".keep.jsonl.kiln-dataset.json",
        "keep.jsonl",
    ]


@pytest.mark.parametrize("name", ["../escape", ".hidden", "a/b", "-dash", "x" * 201, "sp ace", "%2e%2e"])
def test_names_that_are_not_one_plain_segment_are_400(name, client, engine, broker, storage, runner):
    before = snapshot(engine, broker, storage)
    response = client.post(
        "/v1/datasets", query_string={"name": name}, data=jsonl(example(0)), headers=NDJSON
    )
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "invalid_dataset_name"
    assert snapshot(engine, broker, storage) == before


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded",
        "text/plain",
        None,
    ],
)
def test_only_json_lines_bodies_are_accepted(content_type, client, engine, broker, storage, runner):
    before = snapshot(engine, broker, storage)
    headers = {"Content-Type": content_type} if content_type else {}
    for path in ("/v1/datasets?name=x.jsonl", "/v1/data/inspect"):
        response = client.post(path, data=jsonl(example(0)), headers=headers)
        assert response.status_code == 415, path
        error = response.get_json()["error"]
        assert error["code"] == "unsupported_media_type" and "application/x-ndjson" in error["hint"]
    assert snapshot(engine, broker, storage) == before


def test_missing_name_empty_body_and_bad_policy_are_400(client, engine, broker, storage, runner):
    before = snapshot(engine, broker, storage)
    cases = [
        ("/v1/datasets", jsonl(example(0)), "query parameter name is required"),
        ("/v1/datasets?name=e.jsonl", b"", "the request body is empty"),
        ("/v1/datasets?name=b.jsonl", b"\n\n  \n", "no trainable rows"),
        ("/v1/datasets?name=p.jsonl&invalid_row_policy=maybe", jsonl(example(0)), "invalid_row_policy"),
    ]
    for path, data, fragment in cases:
        response = client.post(path, data=data, headers=NDJSON)
        assert response.status_code == 400, path
        assert fragment in response.get_json()["error"]["message"], path
    assert snapshot(engine, broker, storage) == before


def test_an_upload_over_the_request_limit_is_413_and_leaves_nothing(storage, db_url, engine, broker, runner):
    settings = make_settings(storage, db_url, broker.queue, server={"max_request_mb": 0.001})
    app = create_app(settings)
    try:
        before = snapshot(engine, broker, storage)
        rows = jsonl(*[example(i) for i in range(40)])
        assert len(rows) > 1100
        response = app.test_client().post("/v1/datasets?name=big.jsonl", data=rows, headers=NDJSON)
        assert response.status_code == 413
        assert response.get_json()["error"]["code"] == "training_request_too_large"
        assert snapshot(engine, broker, storage) == before
    finally:
        app.extensions["kiln"].close()


def test_delete_removes_file_and_facts_and_refuses_while_a_job_trains_on_it(client, settings, runner):
    assert upload(client, "d.jsonl", jsonl(example(0))).status_code == 201
    body = {"dataset_path": "d.jsonl", "config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0}}
    job_id = client.post("/v1/train/sft", json=body).get_json()["job_id"]
    refused = client.delete("/v1/datasets/d.jsonl")
    assert refused.status_code == 409
    error = refused.get_json()["error"]
    assert error["code"] == "dataset_in_use" and job_id in error["message"]
    assert (settings.datasets_dir / "d.jsonl").is_file()
    assert client.delete(f"/v1/train/queue/{job_id}").get_json()["status"] == "cancelled"
    deleted = client.delete("/v1/datasets/d.jsonl")
    assert deleted.get_json() == {"name": "d.jsonl", "status": "deleted"}
    assert list(settings.datasets_dir.iterdir()) == []
    again = client.delete("/v1/datasets/d.jsonl")
    assert (again.status_code, again.get_json()["error"]["code"]) == (404, "dataset_not_found")


def test_a_copied_in_file_is_listed_and_described_on_demand(client, settings, runner, qwen_tokenizer):
    data = jsonl(example(3), BAD_ROLE)
    (settings.datasets_dir / "copied.jsonl").write_bytes(data)
    (settings.datasets_dir / ".hidden.jsonl").write_bytes(data)
    (settings.datasets_dir / "folder").mkdir()
    (listed,) = client.get("/v1/datasets").get_json()["datasets"]
    assert (listed["name"], listed["stats"], listed["sha256"]) == ("copied.jsonl", None, None)
    detail = client.get("/v1/datasets/copied.jsonl").get_json()
    assert detail["sha256"] == "sha256:" + hashlib.sha256(data).hexdigest()
    assert detail["stats"]["rows_kept"] == 1 and detail["stats"]["rejections"][0]["row_index"] == 2
    assert client.get("/v1/datasets/.hidden.jsonl").status_code == 400
    assert client.get("/v1/datasets/folder").status_code == 404


# ----- the inspector --------------------------------------------------------------------------


def cli_inspect(path, model_dir, policy) -> list[dict]:
    result = CliRunner().invoke(
        cli, ["data", "inspect", str(path), "--model", str(model_dir), "--policy", policy, "--json"]
    )
    return [json.loads(line) for line in result.output.splitlines() if line.strip()]


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_inspect_gives_the_facts_of_kiln_data_inspect_json(policy, client, runner, tiny_model_dir, tmp_path):
    data = jsonl(
        example(0), BAD_ROLE, XSS, "[1, 2]", {"messages": [{"role": "user", "content": "only a user"}]}
    )
    path = tmp_path / "rows.jsonl"
    path.write_bytes(data)
    *cli_rows, verdict = cli_inspect(path, tiny_model_dir, policy)
    response = client.post(f"/v1/data/inspect?invalid_row_policy={policy}", data=data, headers=NDJSON)
    assert response.status_code == 200, response.get_json()
    answer = response.get_json()
    assert [row["facts"] for row in answer["rows"]] == cli_rows
    assert answer["rows_read"] == 5 and not answer["has_more"]
    if policy == "skip":
        # the same receipt; only where the rows came from differs (a file, the request body)
        assert answer["receipt"] == {**verdict, "source_locator": "request body"}
        assert answer["error"] is None
    else:
        assert answer["receipt"] is None
        assert answer["error"] == verdict["error"]
    for row in answer["rows"]:
        facts = row["facts"]
        if "labels" in facts:
            pieces = row["pieces"]
            assert "".join(p["text"] for p in pieces) == row["text"]
            marked = [p["token"] for p in pieces if p["supervised"]]
            assert marked == [i for i, label in enumerate(facts["labels"]) if label != IGNORE_INDEX]
            assert [p["token"] for p in pieces if p["token"] is not None] == list(range(facts["seq_len"]))
    xss = answer["rows"][2]
    assert "<img src=x onerror=alert(1)>" in xss["text"]
    assert answer["rows"][3]["text"] is None and answer["rows"][3]["facts"]["rejection"] == "invalid_json"


def test_inspect_pages_and_stored_datasets(client, runner):
    data = jsonl(*[example(i) for i in range(5)])
    assert upload(client, "five.jsonl", data).status_code == 201
    page = client.get("/v1/datasets/five.jsonl/inspect?offset=3&limit=10").get_json()
    assert [r["facts"]["row_index"] for r in page["rows"]] == [4, 5]
    assert page["offset"] == 3 and page["rows_read"] == 5 and not page["has_more"]
    first = client.post("/v1/data/inspect?limit=2", data=data, headers=NDJSON).get_json()
    assert [r["facts"]["row_index"] for r in first["rows"]] == [1, 2] and first["has_more"]
    assert first["receipt"]["rows_kept"] == 5
    for query in ("limit=0", "limit=1001", "offset=-1", "offset=x"):
        response = client.post(f"/v1/data/inspect?{query}", data=data, headers=NDJSON)
        assert response.status_code == 400, query
    missing = client.get("/v1/datasets/none.jsonl/inspect")
    assert (missing.status_code, missing.get_json()["error"]["code"]) == (404, "dataset_not_found")


def test_inspect_stores_nothing(client, engine, broker, storage, runner):
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/data/inspect", data=jsonl(example(0)), headers=NDJSON)
    assert response.status_code == 200
    assert snapshot(engine, broker, storage) == before


def test_without_a_live_runner_the_packaged_tokenizer_counts(client, settings, qwen_tokenizer):
    response = upload(client, "early.jsonl", jsonl(example(0)))
    assert response.status_code == 201, response.get_json()
    stats = response.get_json()["stats"]
    assert stats["tokenizer"] == "packaged Qwen3.5 tokenizer (no live runner)"
    expected = ingest_jsonl(settings.datasets_dir / "early.jsonl", tokenizer=qwen_tokenizer)
    assert stats["tokens"] == expected.total_tokens
