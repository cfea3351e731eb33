"""The served OpenAPI document against what the server does:

- path parameters and query integers carry the constraints the server enforces, so a
  schema-valid request is never a 400;
- raw JSON files (`/receipt`, `/openapi.json`) are documented as objects;
- the request body forbids what the validators always refuse (no transport, `dataset`,
  `post_eval`, `train_mtp: true`, out-of-range optimizer values, ...).

Each constraint in the document is held to the server at its edges: just inside is accepted,
just outside is refused with the envelope, and a refusal leaves nothing behind.
"""

from __future__ import annotations

import math
import re
from urllib.parse import quote

import pytest

from api.routes.adapters import check_adapter_name
from kiln.store import register_adapter
from kiln_train.errors import KilnError
from kiln_train.sft_config import U64_MAX, parse_sft_request
from tests.api.conftest import example, sft_body, snapshot
from tests.api.openapi_support import matches


def _doc(client) -> dict:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    return response.get_json()


def _parameter(doc: dict, path: str, method: str, name: str) -> dict:
    (param,) = [p for p in doc["paths"][path][method]["parameters"] if p["name"] == name]
    return param["schema"]


ADAPTER_NAMES = [
    "a",
    "Z9",
    "-x",
    ".hidden",
    "a.b_c-d",
    "x" * 255,
    "x" * 256,
    ".",
    "..",
    "...",
    "a.kiln-checkpoint",
    "a.kiln-checkpointx",
    "é",
    "a b",
    "a\n",
    "%",
    "\U0010607a?",
]


def _is_adapter_name(name: str) -> bool:
    try:
        check_adapter_name(name)
    except KilnError:
        return False
    return True


@pytest.mark.parametrize("name", ADAPTER_NAMES)
def test_adapter_name_parameter_is_what_the_routes_accept(
    name, client, sessions, settings, engine, broker, storage
):
    doc = _doc(client)
    for path, method in [
        ("/v1/adapters/{name}", "delete"),
        ("/v1/adapters/{name}/download", "get"),
        ("/v1/adapters/{name}/receipt", "get"),
    ]:
        schema = _parameter(doc, path, method, "name")
        assert matches(schema, name) == _is_adapter_name(name), (path, name)
    if name in (".", ".."):
        return  # a client resolves dot segments before sending; check_adapter_name covers them
    before = snapshot(engine, broker, storage)
    response = client.get(f"/v1/adapters/{quote(name, safe='')}/receipt")
    expected = ("adapter_not_found", 404) if _is_adapter_name(name) else ("invalid_adapter_name", 400)
    assert (response.get_json()["error"]["code"], response.status_code) == expected
    assert snapshot(engine, broker, storage) == before


def test_job_id_parameter_bounds_are_the_stores(client, runner):
    doc = _doc(client)
    schema = _parameter(doc, "/v1/train/status/{job_id}", "get", "job_id")
    assert (schema["minLength"], schema["maxLength"]) == (1, 64)
    assert client.get(f"/v1/train/status/{'j' * 64}").get_json()["error"]["code"] == "training_job_not_found"
    assert client.get(f"/v1/train/status/{'j' * 65}").get_json()["error"]["code"] == "training_job_not_found"


def test_event_query_bounds_are_the_enforced_ones(client, runner):
    doc = _doc(client)
    after = _parameter(doc, "/v1/train/jobs/{job_id}/events", "get", "after")
    limit = _parameter(doc, "/v1/train/jobs/{job_id}/events", "get", "limit")
    assert after["type"] == limit["type"] == "integer"
    job_id = client.post("/v1/train/sft", json=sft_body(1)).get_json()["job_id"]
    events = f"/v1/train/jobs/{job_id}/events"
    for name, schema in (("after", after), ("limit", limit)):
        for inside in (schema["minimum"], schema["maximum"]):
            assert client.get(f"{events}?{name}={inside}").status_code == 200, (name, inside)
        for outside in (schema["minimum"] - 1, schema["maximum"] + 1):
            response = client.get(f"{events}?{name}={outside}")
            assert response.status_code == 400, (name, outside)
            assert response.get_json()["error"]["code"] == "training_invalid_request"


def test_raw_json_files_are_documented_as_objects(client, sessions, settings):
    doc = _doc(client)
    for path in ("/v1/adapters/{name}/receipt", "/openapi.json"):
        content = doc["paths"][path]["get"]["responses"]["200"]["content"]
        assert content == {"application/json": {"schema": {"type": "object"}}}, path
    root = settings.adapters_dir / "receipted"
    root.mkdir(parents=True)
    (root / "train_receipt.json").write_text('{"schema": "kiln.train-receipt", "final_loss": 0.5}')
    with sessions.begin() as session:
        register_adapter(
            session,
            name="receipted",
            job_id=None,
            path=str(root),
            size_bytes=1,
            safetensors_sha256="sha256:" + "ab" * 32,
            rank=4,
            alpha=8.0,
        )
    response = client.get("/v1/adapters/receipted/receipt")
    assert response.status_code == 200 and response.mimetype == "application/json"
    assert isinstance(response.get_json(), dict)
    download = doc["paths"]["/v1/adapters/{name}/download"]["get"]["responses"]["200"]["content"]
    assert download == {"application/gzip": {"schema": {"type": "string", "format": "binary"}}}


# ----- the request body -------------------------------------------------------------------------

ROW = example(0)
CONFIG = {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0}


def _accepted(body: dict) -> bool:
    try:
        parse_sft_request(body)
    except KilnError as exc:
        assert exc.code == "training_invalid_request"
        return False
    return True


def _with(**config) -> dict:
    return {"examples": [ROW], "config": {**CONFIG, **config}}


def test_request_number_bounds_hold_at_their_edges(client):
    schemas = _doc(client)["components"]["schemas"]
    config = schemas["SftConfig"]["properties"]
    (lr,) = [s for s in config["learning_rate"]["anyOf"] if s.get("type") == "number"]
    low, high = lr["exclusiveMinimum"], lr["exclusiveMaximum"]
    assert not _accepted(_with(learning_rate=low)) and _accepted(_with(learning_rate=math.nextafter(low, 1)))
    assert not _accepted(_with(learning_rate=high)) and _accepted(
        _with(learning_rate=math.nextafter(high, 0))
    )
    alpha = config["lora_alpha"]
    assert (alpha["exclusiveMinimum"], alpha["exclusiveMaximum"]) == (low, high)
    # Rank 1 (SGD: Muon needs 2) so that alpha/rank is alpha itself; high alpha needs the opt-in.
    tiny = {"lora_rank": 1, "optimizer": {"kind": "sgd"}, "allow_high_lora_scale": True}
    assert not _accepted(_with(lora_alpha=0.0)) and not _accepted(_with(lora_alpha=5e-324, **tiny))
    assert not _accepted(_with(lora_alpha=low, **tiny))
    assert _accepted(_with(lora_alpha=math.nextafter(low, 1), **tiny))
    assert not _accepted(_with(lora_alpha=high, **tiny))
    assert _accepted(_with(lora_alpha=math.nextafter(high, 0), **tiny))
    (seed_int,) = [s for s in config["seed"]["anyOf"] if s.get("type") == "integer"]
    assert (seed_int["minimum"], seed_int["maximum"]) == (0, U64_MAX)
    assert _accepted(_with(seed=U64_MAX)) and not _accepted(_with(seed=U64_MAX + 1))
    assert not _accepted(_with(seed=-1)) and _accepted(_with(seed=0))
    (seed_str,) = [s for s in config["seed"]["anyOf"] if s.get("type") == "string"]
    assert re.search(seed_str["pattern"], "42") and _accepted(_with(seed="42"))
    assert not re.search(seed_str["pattern"], "-1") and not _accepted(_with(seed="-1"))

    adam = schemas["AdamWConfig"]["properties"]
    for beta in ("beta1", "beta2"):
        assert (adam[beta]["minimum"], adam[beta]["exclusiveMaximum"]) == (0, 1)
        assert _accepted(_with(optimizer={"kind": "adam_w", beta: 0.0}))
        assert _accepted(_with(optimizer={"kind": "adam_w", beta: math.nextafter(1.0, 0)}))
        assert not _accepted(_with(optimizer={"kind": "adam_w", beta: 1.0}))
        assert not _accepted(_with(optimizer={"kind": "adam_w", beta: -5e-324}))
    assert adam["eps"]["exclusiveMinimum"] == 0
    assert not _accepted(_with(optimizer={"kind": "adam_w", "eps": 0.0}))
    assert adam["weight_decay"]["minimum"] == 0
    assert not _accepted(_with(optimizer={"kind": "adam_w", "weight_decay": -5e-324}))

    muon = schemas["MuonConfig"]["properties"]
    assert (muon["ns_iters"]["minimum"], muon["ns_iters"]["maximum"]) == (1, 20)
    for ns, ok in ((0, False), (1, True), (20, True), (21, False)):
        assert _accepted(_with(optimizer={"kind": "muon", "ns_iters": ns})) is ok, ns
    assert (muon["momentum"]["minimum"], muon["momentum"]["exclusiveMaximum"]) == (0, 1)
    assert not _accepted(_with(optimizer={"kind": "muon", "momentum": 1.0}))
    assert _accepted(_with(optimizer={"kind": "muon", "momentum": math.nextafter(1.0, 0)}))


def test_request_string_patterns_match_the_validators(client):
    config = _doc(client)["components"]["schemas"]["SftConfig"]["properties"]
    (name,) = [s for s in config["output_name"]["anyOf"] if s.get("type") == "string"]
    assert config["base_adapter"]["anyOf"][0] == name
    for value in [
        "a",
        "a" * 200,
        "-a",
        ".a",
        "a/b",
        "é",
        "x.kiln-checkpoint",
        "x-checkpoint-step-00000001",
        "a b",
    ]:
        assert matches(name, value) == _accepted(_with(output_name=value)), value
    (prompt,) = [s for s in config["adapter_smoke_prompts"]["anyOf"] if s.get("type") == "array"]
    for value in ["hi", " x ", " ", "", "\t\n"]:
        body = _with(adapter_smoke_test=True, adapter_smoke_prompts=[value])
        assert matches(prompt["items"], value) == _accepted(body), repr(value)
    # NUL is refused by the body reader (api.http.unstorable_value), before the validators
    assert not matches(prompt["items"], "a\u0000")
    response = client.post(
        "/v1/train/sft", json=_with(adapter_smoke_test=True, adapter_smoke_prompts=["a\u0000"])
    )
    assert response.status_code == 400 and "U+0000" in response.get_json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"config": CONFIG}, "exactly one of examples, dataset_path or dataset"),
        ({"examples": [ROW], "dataset_path": "rows.jsonl", "config": CONFIG}, "exactly one of"),
        ({"dataset": "named", "config": CONFIG}, "named datasets are not supported"),
        ({"examples": [ROW], "dataset_split": "train", "config": CONFIG}, "dataset_split requires"),
        ({"examples": [ROW], "post_eval": {}, "config": CONFIG}, "post_eval gates are not supported"),
        ({"examples": [ROW], "config": {**CONFIG, "train_mtp": True}}, "train_mtp=true is not permitted"),
        (
            {"examples": [ROW], "config": {**CONFIG, "adapter_smoke_prompts": ["hi"]}},
            "adapter_smoke_prompts requires adapter_smoke_test=true",
        ),
        ({"examples": [ROW], "config": {"lora_rank": 1, "lora_alpha": 1.0}}, "at least 2 for the muon"),
    ],
)
def test_bodies_the_document_forbids_are_refused(body, fragment, client, engine, broker, storage, runner):
    """The document says these are invalid (transports, unsupported fields, cross-field rules);
    the server refuses them with 400 and writes nothing."""
    doc = _doc(client)
    request = doc["components"]["schemas"]["SftRequest"]
    assert [branch["required"] for branch in request["oneOf"]] == [["examples"], ["dataset_path"]]
    for unsupported in ("dataset", "dataset_split", "post_eval"):
        assert request["properties"][unsupported]["type"] == "null"
    train_mtp = doc["components"]["schemas"]["SftConfig"]["properties"]["train_mtp"]["anyOf"]
    assert {"const": False} in [{k: v for k, v in s.items() if k == "const"} for s in train_mtp]
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=body)
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["code"] == "training_invalid_request" and fragment in error["message"]
    assert snapshot(engine, broker, storage) == before


def test_cross_field_rules_are_in_the_document(client):
    rules = _doc(client)["components"]["schemas"]["SftConfig"]["allOf"]
    smoke, muon = rules
    assert smoke["if"]["required"] == ["adapter_smoke_prompts"]
    assert smoke["then"]["properties"]["adapter_smoke_test"] == {"const": True}
    assert muon["then"]["properties"]["lora_rank"]["minimum"] == 2
    # sgd and adam_w take rank 1; muon, stated or by default, does not
    assert _accepted(
        {"examples": [ROW], "config": {"lora_rank": 1, "lora_alpha": 1.0, "optimizer": {"kind": "sgd"}}}
    )
    assert not _accepted({"examples": [ROW], "config": {"lora_rank": 1, "lora_alpha": 1.0}})
    assert not _accepted(
        {"examples": [ROW], "config": {"lora_rank": 1, "lora_alpha": 1.0, "optimizer": {"kind": "muon"}}}
    )


@pytest.mark.parametrize("key", ["k", "k" * 255, "k" * 256, "a b", "~!", "clé", "a\tb", "a\x01", ""])
def test_idempotency_key_header_is_what_admission_accepts(key, client, engine, broker, storage, runner):
    from api.admission_checks import check_idempotency_key

    schema = _parameter(_doc(client), "/v1/train/sft", "post", "Idempotency-Key")
    try:
        check_idempotency_key(key)
        valid = True
    except KilnError:
        valid = False
    assert matches(schema, key) == valid, repr(key)
    if valid:
        return
    before = snapshot(engine, broker, storage)
    response = client.post(
        "/v1/train/sft",
        json=sft_body(1),
        headers=[("Idempotency-Key", key.encode("utf-8").decode("latin-1"))],
    )
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["code"] == "training_invalid_request" and "Idempotency-Key" in error["message"]
    assert snapshot(engine, broker, storage) == before
