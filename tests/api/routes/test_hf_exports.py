"""`/v1/train/hf/sft/exports` and `/v1/train/hf/exports[/{name}[/download]]`: a bundle built from
the live runner, listed, described, downloaded and deleted; every refusal leaves nothing."""

from __future__ import annotations

import io
import json
import math
import re
import tarfile
from urllib.parse import quote

import pytest

from kiln.store import register_adapter
from kiln_train.checkpoint.epoch_order import epoch_order
from kiln_train.interop.bundle import verify_bundle
from tests.api.conftest import example, snapshot, write_base_adapter
from tests.api.hf_support import HF_CONFIG, export_body
from tests.kiln_train.interop.support import MANIFEST_FILES

BUNDLE_FILES = MANIFEST_FILES | {"kiln_hf_export.json"}


def test_export_list_get_download_delete(client, runner, settings):
    answer = client.post("/v1/train/hf/sft/exports", json=export_body())
    assert answer.status_code == 201, answer.get_json()
    info = answer.get_json()
    path = settings.storage_root / "hf-exports" / "bundle.kiln-hf"
    assert info["path"] == str(path) and info["name"] == "bundle"
    assert (info["rows_kept"], info["rows_rejected"], info["total_steps"]) == (3, 0, 6)
    assert (info["optimizer"], info["lora_rank"], info["lora_alpha"], info["seed"]) == ("sgd", 4, 8.0, "9")
    assert info["download"] == "/v1/train/hf/exports/bundle/download"
    manifest = verify_bundle(path)
    assert info["manifest"] == manifest and info["bundle_digest"] == manifest["bundle_digest"]
    assert manifest["resident_runner"]["runner_id"] == runner
    assert manifest["schedule"]["epoch_orders"] == [epoch_order(9, e, 3) for e in range(2)]

    listed = client.get("/v1/train/hf/exports").get_json()["exports"]
    assert [e["name"] for e in listed] == ["bundle"] and listed[0] == info
    assert client.get("/v1/train/hf/exports/bundle").get_json() == info

    download = client.get("/v1/train/hf/exports/bundle/download")
    assert download.status_code == 200 and download.mimetype == "application/gzip"
    assert 'filename="bundle.kiln-hf.tar.gz"' in download.headers["Content-Disposition"]
    with tarfile.open(fileobj=io.BytesIO(download.get_data()), mode="r:gz") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert set(members) == {f"bundle.kiln-hf/{f}" for f in BUNDLE_FILES}
    assert members["bundle.kiln-hf/kiln_hf_export.json"] == (path / "kiln_hf_export.json").read_bytes()

    deleted = client.delete("/v1/train/hf/exports/bundle")
    assert deleted.status_code == 200 and deleted.get_json() == {"name": "bundle", "status": "deleted"}
    assert not path.exists() and list((settings.storage_root / "hf-exports").iterdir()) == []
    gone = client.get("/v1/train/hf/exports/bundle")
    assert gone.status_code == 404 and gone.get_json()["error"]["code"] == "hf_export_not_found"
    assert client.get("/v1/train/hf/exports").get_json() == {"exports": []}


def test_export_from_a_dataset_path_skipping_bad_rows(client, runner, settings):
    rows = [json.dumps(example(0)), "{broken", json.dumps(example(1))]
    (settings.datasets_dir / "rows.jsonl").write_text("\n".join(rows) + "\n")
    body = {
        "name": "from-file",
        "dataset_path": "rows.jsonl",
        "invalid_row_policy": "skip",
        "config": HF_CONFIG,
    }
    answer = client.post("/v1/train/hf/sft/exports", json=body)
    assert answer.status_code == 201, answer.get_json()
    info = answer.get_json()
    assert (info["rows_kept"], info["rows_rejected"]) == (2, 1)
    assert info["manifest"]["data"]["source_locator"] == "rows.jsonl"
    lines = (
        (settings.storage_root / "hf-exports" / "from-file.kiln-hf" / "train.jsonl").read_text().splitlines()
    )
    assert sorted({json.loads(line)["row_index"] for line in lines}) == [1, 3]


def test_defaults_draw_a_seed_and_use_adam_w(client, runner):
    answer = client.post("/v1/train/hf/sft/exports", json={"name": "d", "examples": [example(0)]})
    assert answer.status_code == 201, answer.get_json()
    manifest = answer.get_json()["manifest"]
    assert manifest["optimizer"] == {
        "learning_rate": 1e-4,
        "kind": "adam_w",
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    assert (manifest["lora"]["rank"], manifest["lora"]["alpha"], manifest["schedule"]["epochs"]) == (
        16,
        32.0,
        3,
    )
    assert re.fullmatch(r"[0-9]+", manifest["seed"])


def test_an_input_adapter_is_the_starting_point(client, runner, sessions, settings, runner_kwargs):
    path = write_base_adapter(settings.adapters_dir / "warm", runner_kwargs["model_config"])
    with sessions.begin() as session:
        register_adapter(
            session,
            name="warm",
            job_id=None,
            path=str(path),
            size_bytes=1,
            safetensors_sha256="sha256:" + "0" * 64,
            rank=4,
            alpha=8.0,
        )
    answer = client.post("/v1/train/hf/sft/exports", json=export_body(input_adapter="warm"))
    assert answer.status_code == 201, answer.get_json()
    initial = answer.get_json()["manifest"]["lora"]["initial_adapter"]
    assert initial["source"] == "input_adapter" and initial["input_adapter"]["name"] == "warm"


@pytest.mark.parametrize(
    ("body", "status", "code", "fragment"),
    [
        (export_body(surprise=1), 400, "training_invalid_request", "surprise: unknown field"),
        (
            export_body(config={**HF_CONFIG, "gradient_accumulation_steps": 4}),
            400,
            "training_invalid_request",
            "config.gradient_accumulation_steps: unknown field",
        ),
        (
            {**export_body(), "dataset_path": "x.jsonl"},
            400,
            "training_invalid_request",
            "exactly one of examples",
        ),
        (export_body(name="-bad"), 400, "training_invalid_request", "name"),
        (
            export_body(config={**HF_CONFIG, "optimizer": {"kind": "muon"}}),
            400,
            "hf_export_unsupported",
            "config.optimizer.kind 'muon' cannot be exported",
        ),
        (
            export_body(config={**HF_CONFIG, "lora_alpha": 64.0}),
            400,
            "training_invalid_request",
            "unsafe LoRA scaling",
        ),
        (export_body(config={**HF_CONFIG, "seed": "-1"}), 400, "training_invalid_request", "config.seed"),
        (  # the schema allows 1,048,576; the model and the optimizer tuple allow far less, as for a job
            export_body(config={**HF_CONFIG, "lora_rank": 8192, "lora_alpha": 16.0}),
            400,
            "training_invalid_request",
            "lora_rank 8192 is outside 1..=",
        ),
        (
            export_body(config={**HF_CONFIG, "learning_rate": 0.0}),
            400,
            "training_invalid_request",
            "config.learning_rate",
        ),
        (
            export_body(input_adapter="absent"),
            400,
            "training_invalid_request",
            "input_adapter 'absent' is not",
        ),
        (
            {"name": "x", "examples": [{"messages": []}], "config": HF_CONFIG},
            400,
            "training_invalid_request",
            "rejected as empty_messages",
        ),
        (
            {"name": "x", "dataset_path": "../etc/passwd", "config": HF_CONFIG},
            400,
            "training_invalid_request",
            "'..' segments",
        ),
    ],
)
def test_refused_exports_leave_nothing(client, runner, engine, broker, storage, body, status, code, fragment):
    before = snapshot(engine, broker, storage)
    answer = client.post("/v1/train/hf/sft/exports", json=body)
    assert answer.status_code == status, answer.get_json()
    error = answer.get_json()["error"]
    assert error["code"] == code and fragment in error["message"], error
    assert snapshot(engine, broker, storage) == before


def test_names_are_never_overwritten(client, runner, settings):
    assert client.post("/v1/train/hf/sft/exports", json=export_body()).status_code == 201
    manifest = (settings.storage_root / "hf-exports" / "bundle.kiln-hf" / "kiln_hf_export.json").read_bytes()
    again = client.post("/v1/train/hf/sft/exports", json=export_body(config={**HF_CONFIG, "seed": 10}))
    assert again.status_code == 409 and again.get_json()["error"]["code"] == "hf_export_already_exists"
    assert (
        settings.storage_root / "hf-exports" / "bundle.kiln-hf" / "kiln_hf_export.json"
    ).read_bytes() == manifest


def test_no_live_runner_is_503(client, engine, broker, storage):
    before = snapshot(engine, broker, storage)
    answer = client.post("/v1/train/hf/sft/exports", json=export_body())
    assert answer.status_code == 503 and answer.get_json()["error"]["code"] == "training_no_runner"
    assert snapshot(engine, broker, storage) == before


@pytest.mark.parametrize("method", ["get", "delete"])
def test_unknown_and_invalid_export_names(client, method):
    missing = getattr(client, method)("/v1/train/hf/exports/nothing-here")
    assert missing.status_code == 404 and missing.get_json()["error"]["code"] == "hf_export_not_found"
    bad = getattr(client, method)(f"/v1/train/hf/exports/{quote('-x', safe='')}")
    assert bad.status_code == 400 and bad.get_json()["error"]["code"] == "training_invalid_request"
    download = client.get("/v1/train/hf/exports/nothing-here/download")
    assert download.status_code == 404


# ----- held to the OpenAPI document --------------------------------------------------------------


def _doc(client) -> dict:
    return client.get("/openapi.json").get_json()


def _matches(schema: dict, value: str) -> bool:
    if "pattern" in schema and not re.search(schema["pattern"].replace("$", r"\Z"), value):
        return False
    if "anyOf" in schema and not any(_matches(s, value) for s in schema["anyOf"]):
        return False
    return not ("not" in schema and _matches(schema["not"], value))


@pytest.mark.parametrize(
    "name", ["a", "Z9", "a.b_c-d", "x" * 128, "x" * 129, "-x", ".x", "é", "a b", "a.kiln-hf"]
)
def test_export_name_parameter_is_what_the_routes_accept(client, name):
    doc = _doc(client)
    for path, method in [
        ("/v1/train/hf/exports/{name}", "get"),
        ("/v1/train/hf/exports/{name}", "delete"),
        ("/v1/train/hf/exports/{name}/download", "get"),
    ]:
        (param,) = doc["paths"][path][method]["parameters"]
        valid = _matches(param["schema"], name)
        answer = getattr(client, method)(path.replace("{name}", quote(name, safe="")))
        expected = ("hf_export_not_found", 404) if valid else ("training_invalid_request", 400)
        assert (answer.get_json()["error"]["code"], answer.status_code) == expected, (path, name)
    request = doc["components"]["schemas"]["HfSftExportRequest"]
    assert request["properties"]["name"]["pattern"] == param["schema"]["pattern"]


def test_export_request_document_matches_the_parser(client, runner):
    doc = _doc(client)
    schemas = doc["components"]["schemas"]
    request, config = schemas["HfSftExportRequest"], schemas["HfExportConfig"]
    assert request["additionalProperties"] is False and config["additionalProperties"] is False
    assert [branch["required"] for branch in request["oneOf"]] == [["examples"], ["dataset_path"]]
    assert config["not"]["properties"]["optimizer"]["properties"]["kind"] == {"const": "muon"}
    operation = doc["paths"]["/v1/train/hf/sft/exports"]["post"]
    assert set(operation["responses"]) == {"201", "default"}
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "HfSftExportRequest"
    )
    epochs = config["properties"]["epochs"]
    rank = config["properties"]["lora_rank"]
    (seed,) = [s for s in config["properties"]["seed"]["anyOf"] if s.get("type") == "integer"]
    (lr,) = [s for s in config["properties"]["learning_rate"]["anyOf"] if s.get("type") == "number"]
    for field, value, ok in [
        ("epochs", epochs["minimum"], True),
        ("epochs", epochs["minimum"] - 1, False),
        ("epochs", epochs["maximum"] + 1, False),
        ("lora_rank", rank["maximum"] + 1, False),
        ("seed", seed["maximum"], True),
        ("seed", seed["maximum"] + 1, False),
        ("learning_rate", lr["exclusiveMinimum"], False),
        ("learning_rate", math.nextafter(lr["exclusiveMinimum"], 1), True),
    ]:
        body = export_body(name=f"edge-{field}-{ok}", n=1, config={**HF_CONFIG, "epochs": 1, field: value})
        answer = client.post("/v1/train/hf/sft/exports", json=body)
        assert (answer.status_code == 201) is ok, (field, value, answer.get_json())
        if not ok:
            assert answer.get_json()["error"]["code"] == "training_invalid_request"


def _integers(schema, where):
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            yield where, schema
        for key, value in schema.items():
            yield from _integers(value, f"{where}.{key}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            yield from _integers(value, f"{where}[{i}]")


def test_every_export_integer_has_an_upper_bound(client):
    schemas = _doc(client)["components"]["schemas"]
    found = [
        hit for model in ("HfSftExportRequest", "HfExportConfig") for hit in _integers(schemas[model], model)
    ]
    assert len(found) >= 3
    for where, schema in found:
        assert "maximum" in schema, where


def test_abandoned_staging_is_swept_by_the_next_export(client, runner, settings):
    import os
    import time

    root = settings.storage_root / "hf-exports"
    old = root / ".gone.kiln-hf.incomplete-0123"
    fresh = root / ".busy.kiln-hf.incomplete-4567"
    for path in (old, fresh):
        (path / "initial_adapter").mkdir(parents=True)
        (path / "train.jsonl").write_text("{}")
    stale = time.time() - 2 * 3600
    for path in (old / "initial_adapter", old / "train.jsonl", old):
        os.utime(path, (stale, stale))
    assert client.post("/v1/train/hf/sft/exports", json=export_body()).status_code == 201
    assert not old.exists() and fresh.exists()
    assert [e["name"] for e in client.get("/v1/train/hf/exports").get_json()["exports"]] == ["bundle"]
