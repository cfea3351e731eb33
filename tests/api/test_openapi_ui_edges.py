"""The routes of the browser UI (datasets, inspector, preflight, checkpoints, the UI's files)
held to what the OpenAPI document says about them, at the edges: what it allows is accepted,
what it forbids is the envelope with the contract's status, and a refusal leaves nothing behind.
"""

from __future__ import annotations

import json
from typing import Literal
from urllib.parse import quote

import pytest
from pydantic import BaseModel

from api.datasets import check_dataset_name
from api.routes.adapters import check_adapter_name
from kiln_train.errors import KilnError
from kiln_train.optim.configs import STRICT
from kiln_train.optim.kinds import OptimizerKind, register, unregister
from tests.api.conftest import example, snapshot
from tests.api.openapi_support import matches

NDJSON = {"Content-Type": "application/x-ndjson"}
ROWS = (json.dumps(example(0)) + "\n").encode()
NEW_ROUTES = [
    ("post", "/v1/train/sft/preflight"),
    ("post", "/v1/datasets"),
    ("get", "/v1/datasets"),
    ("get", "/v1/datasets/{dataset}"),
    ("delete", "/v1/datasets/{dataset}"),
    ("get", "/v1/datasets/{dataset}/inspect"),
    ("post", "/v1/data/inspect"),
    ("get", "/v1/checkpoints"),
    ("get", "/"),
    ("get", "/ui/defaults.json"),
    ("get", "/ui/{filename}"),
]


def _doc(client) -> dict:
    return client.get("/openapi.json").get_json()


def _param(doc: dict, path: str, method: str, name: str) -> dict:
    (param,) = [p for p in doc["paths"][path][method]["parameters"] if p["name"] == name]
    return param


def _envelope(response) -> dict:
    body = response.get_json()
    assert body is not None and set(body) == {"error"}, response.get_data(as_text=True)[:200]
    assert set(body["error"]) == {"code", "message", "hint"}
    return body["error"]


def _accepts(check, name: str) -> bool:
    try:
        check(name)
    except KilnError:
        return False
    return True


def test_every_new_route_is_documented(client):
    paths = _doc(client)["paths"]
    for method, path in NEW_ROUTES:
        assert method in paths.get(path, {}), (method, path)
    upload = paths["/v1/datasets"]["post"]
    assert upload["requestBody"]["content"] == {"application/x-ndjson": {"schema": {"type": "string"}}}
    assert "201" in upload["responses"]
    assert _param(_doc(client), "/v1/datasets", "post", "name")["required"] is True
    preflight = paths["/v1/train/sft/preflight"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    assert preflight == {"$ref": "#/components/schemas/SftRequest"}


def test_the_ui_files_are_public_and_the_api_routes_are_not():
    from api.openapi import build_document

    paths = build_document(auth=True)["paths"]
    for method, path in NEW_ROUTES:
        secured = "security" in paths[path][method]
        assert secured == (path != "/" and not path.startswith("/ui/")), (method, path)


DATASET_NAMES = [
    "a",
    "rows.jsonl",
    "A-b_c.1",
    "x" * 200,
    "x" * 201,
    ".hidden",
    "-dash",
    "_under",
    "a b",
    "é.jsonl",
    "a\n",
    "..",
    "a%b",
]


@pytest.mark.parametrize("name", DATASET_NAMES)
def test_dataset_names_the_document_allows_are_the_ones_the_routes_accept(
    name, client, engine, broker, storage, runner
):
    doc = _doc(client)
    accepted = _accepts(check_dataset_name, name)
    for path, method in [
        ("/v1/datasets/{dataset}", "get"),
        ("/v1/datasets/{dataset}", "delete"),
        ("/v1/datasets/{dataset}/inspect", "get"),
    ]:
        assert matches(_param(doc, path, method, "dataset")["schema"], name) == accepted, (path, name)
    assert matches(_param(doc, "/v1/datasets", "post", "name")["schema"], name) == accepted
    before = snapshot(engine, broker, storage)
    if name != "..":  # a client resolves dot segments before sending
        response = client.get(f"/v1/datasets/{quote(name, safe='')}")
        expected = ("dataset_not_found", 404) if accepted else ("invalid_dataset_name", 400)
        assert (_envelope(response)["code"], response.status_code) == expected
    upload = client.post("/v1/datasets", query_string={"name": name, "invalid_row_policy": "fail"}, data=b"x",
                         headers=NDJSON)  # fmt: skip
    assert upload.status_code == 400  # a bad name, or (a good one) the row that is not JSON
    code = _envelope(upload)["code"]
    assert code == ("training_invalid_request" if accepted else "invalid_dataset_name")
    assert snapshot(engine, broker, storage) == before


@pytest.mark.parametrize("route", ["/v1/data/inspect", "/v1/datasets/five.jsonl/inspect"])
def test_inspect_page_bounds_hold_at_their_edges(route, client, settings, runner):
    (settings.datasets_dir / "five.jsonl").write_bytes(ROWS * 5)
    doc = _doc(client)
    template = "/v1/data/inspect" if route == "/v1/data/inspect" else "/v1/datasets/{dataset}/inspect"
    method = "post" if route == "/v1/data/inspect" else "get"

    def call(query: str):
        if method == "post":
            return client.post(f"{route}?{query}", data=ROWS, headers=NDJSON)
        return client.get(f"{route}?{query}")

    for name in ("offset", "limit"):
        schema = _param(doc, template, method, name)["schema"]
        for inside in (schema["minimum"], schema["maximum"]):
            assert call(f"{name}={inside}").status_code == 200, (name, inside)
        for outside in (schema["minimum"] - 1, schema["maximum"] + 1):
            response = call(f"{name}={outside}")
            assert response.status_code == 400 and _envelope(response)["code"] == "training_invalid_request"
    policy = _param(doc, template, method, "invalid_row_policy")["schema"]
    for value in policy["enum"]:
        assert call(f"invalid_row_policy={value}").status_code == 200
    for value in ("Skip", "", "none", "fail "):
        response = call(f"invalid_row_policy={quote(value)}")
        assert response.status_code == 400, value


@pytest.mark.parametrize("adapter", ["a", "x" * 255, "x" * 256, "a b", ".", "a.kiln-checkpoint", "é"])
def test_the_checkpoints_adapter_filter_is_what_the_route_accepts(adapter, client):
    schema = _param(_doc(client), "/v1/checkpoints", "get", "adapter")["schema"]
    accepted = _accepts(check_adapter_name, adapter)
    response = client.get("/v1/checkpoints", query_string={"adapter": adapter})
    assert response.status_code == (200 if accepted else 400), adapter
    if accepted:
        assert response.get_json() == {"checkpoints": []}
        assert matches(schema, adapter)
    else:
        assert _envelope(response)["code"] == "invalid_adapter_name"


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"\xff\xfe", b"null", b"[]", b'{"examples": "nope"}', b'{"config": {"epochs": 1e400}}'],
)
def test_garbage_to_the_preflight_is_a_400_envelope_and_writes_nothing(
    body, client, engine, broker, storage, runner
):
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft/preflight", data=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert _envelope(response)["code"] == "training_invalid_request"
    assert snapshot(engine, broker, storage) == before


@pytest.mark.parametrize(
    "body",
    [b"\xff\xfe\x00", b"\xef\xbb\xbf" + ROWS, b"{" * 500 + b"\n", b"\x00\n", b"[" * 200 + b"]" * 200 + b"\n"],
)
def test_garbage_rows_are_row_numbered_refusals_not_errors(body, client, engine, broker, storage, runner):
    before = snapshot(engine, broker, storage)
    stored = client.post("/v1/datasets?name=g.jsonl", data=body, headers=NDJSON)
    assert stored.status_code == 400, stored.get_json()
    assert "SFT row 1 (sha256:" in _envelope(stored)["message"]
    inspected = client.post("/v1/data/inspect", data=body, headers=NDJSON)
    assert inspected.status_code == 200
    answer = inspected.get_json()
    assert answer["error"]["code"] == "training_invalid_request" and answer["receipt"] is None
    assert snapshot(engine, broker, storage) == before


@pytest.mark.parametrize(
    "path", ["/ui/missing.js", "/ui/../api/app.py", "/ui/%2e%2e/app.py", "/ui/vendor/", "/ui/"]
)
def test_files_outside_the_ui_are_a_404_envelope(path, client):
    response = client.get(path)
    assert response.status_code == 404
    assert _envelope(response)["code"] == "not_found"


class _LionConfig(BaseModel):
    model_config = STRICT
    kind: Literal["lion"]
    beta: float = 0.9


def test_the_form_defaults_list_every_registered_optimizer(client):
    """The SFT form builds its optimizer choices and fields from this answer (api/ui/static/app.js:
    buildOptimizerForms), so a registered kind reaches the browser without a page edit."""
    body = client.get("/ui/defaults.json").get_json()
    assert body["optimizer_kinds"] == ["muon", "adam_w", "sgd"]
    assert body["optimizer_titles"] == {"muon": "Muon", "adam_w": "AdamW", "sgd": "SGD"}
    muon = body["optimizer_fields"]["muon"]
    assert [(f["name"], f["type"]) for f in muon] == [
        ("momentum", "number"),
        ("nesterov", "boolean"),
        ("ns_iters", "integer"),
        ("weight_decay", "number"),
    ]
    assert body["optimizer_fields"]["sgd"] == []
    assert body["optimizers"]["adam_w"] == {
        "kind": "adam_w",
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    assert body["learning_rate"] == {"muon": 1e-3, "adam_w": 1e-4, "sgd": 1e-4}
    register(
        OptimizerKind(kind="lion", title="Lion", config=_LionConfig, update="", default_learning_rate=3e-4)
    )
    try:
        body = client.get("/ui/defaults.json").get_json()
    finally:
        unregister("lion")
    assert body["optimizer_kinds"] == ["muon", "adam_w", "sgd", "lion"]
    assert body["optimizers"]["lion"] == {"kind": "lion", "beta": 0.9}
    assert body["optimizer_fields"]["lion"] == [{"name": "beta", "type": "number"}]
    assert body["learning_rate"]["lion"] == 3e-4


def test_a_registered_optimizers_ranges_and_rank_rule_reach_the_openapi_constraints():
    from api.openapi_constraints import request_constraints, sft_config_rules

    lion = OptimizerKind(
        kind="lion",
        title="Lion",
        config=_LionConfig,
        update="",
        default_learning_rate=3e-4,
        minimum_rank=4,
        schema_constraints={"beta": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}},
    )
    assert "_LionConfig" not in request_constraints()
    register(lion)
    try:
        constraints, rules = request_constraints(), sft_config_rules()["allOf"]
    finally:
        unregister("lion")
    assert constraints["_LionConfig"] == {"beta": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}}
    assert constraints["MuonConfig"]["ns_iters"] == {"type": "integer", "minimum": 1, "maximum": 20}
    # muon is the default kind (an omitted optimizer means it); lion must be named.
    assert rules[-2]["if"]["anyOf"][0] == {"not": {"required": ["optimizer"]}}
    assert rules[-1] == {
        "if": {"anyOf": [{"properties": {"optimizer": {"properties": {"kind": {"const": "lion"}}}}}]},
        "then": {"properties": {"lora_rank": {"minimum": 4}}},
    }
    assert len(sft_config_rules()["allOf"]) == len(rules) - 1
