"""`GET /openapi.json`: an OpenAPI 3.1 document whose paths and methods are exactly the app's routes."""

from __future__ import annotations

import re


def _app_routes(app) -> set[tuple[str, str]]:
    routes = set()
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            routes.add((path, method.lower()))
    return routes


def test_document_paths_equal_the_url_map(client, app):
    doc = client.get("/openapi.json").get_json()
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert documented == _app_routes(app)


def test_document_is_openapi_3_1_with_resolvable_refs(client):
    doc = client.get("/openapi.json").get_json()
    assert doc["openapi"] == "3.1.0"
    schemas = doc["components"]["schemas"]
    for name in (
        "SftRequest",
        "SftConfig",
        "TrainingResponse",
        "TrainingStatus",
        "TrainingJobDetail",
        "ErrorEnvelope",
        "QueueResponse",
    ):
        assert name in schemas, name
    refs = set(
        re.findall(
            r'"\$ref": "#/components/schemas/([^"]+)"', client.get("/openapi.json").get_data(as_text=True)
        )
    )
    assert refs <= set(schemas)
    submit = doc["paths"]["/v1/train/sft"]["post"]
    assert submit["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SftRequest"
    }
    assert submit["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "ErrorEnvelope"
    )
    assert (
        "additionalProperties" in schemas["SftConfig"]
        and schemas["SftConfig"]["additionalProperties"] is False
    )
    assert set(schemas["TrainingStatus"]["required"]) >= {
        "job_id",
        "state",
        "progress",
        "current_loss",
        "adapter_name",
        "started_at",
        "elapsed_secs",
    }


def _integer_schemas(schema, where: str):
    """Every schema of integer type inside `schema` (anyOf branches, arrays, nested objects)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            yield where, schema
        for key, value in schema.items():
            yield from _integer_schemas(value, f"{where}.{key}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            yield from _integer_schemas(value, f"{where}[{i}]")


def test_every_request_integer_has_an_upper_bound(client):
    schemas = client.get("/openapi.json").get_json()["components"]["schemas"]
    request_models = ("SftRequest", "SftConfig", "SgdConfig", "AdamWConfig", "MuonConfig")
    found = {}
    for model in request_models:
        for name, prop in schemas[model]["properties"].items():
            for where, schema in _integer_schemas(prop, f"{model}.{name}"):
                assert "maximum" in schema, where
                found[f"{model}.{name}"] = schema["maximum"]
    assert found == {
        "SftConfig.epochs": 100_000,
        "SftConfig.max_length": 2**31 - 1,
        "SftConfig.lora_rank": 1 << 20,
        "SftConfig.checkpoint_interval": 2**64 - 1,
        "SftConfig.grad_checkpoint_segments": 1024,
        "SftConfig.seed": 2**64 - 1,
        "MuonConfig.ns_iters": 20,
    }


def test_the_request_body_states_its_size_and_nesting_limits(client):
    body = client.get("/openapi.json").get_json()["paths"]["/v1/train/sft"]["post"]["requestBody"]
    assert "server.max_request_mb" in body["description"] and "64 levels" in body["description"]


def test_the_document_describes_every_row_format_with_an_example(client):
    schemas = client.get("/openapi.json").get_json()["components"]["schemas"]
    examples = schemas["SftRequest"]["properties"]["examples"]
    for word in ("`messages`", "`instruction`", "`input`", "`output`", "`history`", "`prompt`/`completion`"):
        assert word in examples["description"], word
    (sample,) = examples["examples"]
    assert [sorted(row) for row in sample] == [
        ["messages"],
        ["input", "instruction", "output"],
        ["completion", "prompt"],
        ["completion", "prompt"],
    ]
    assert isinstance(sample[2]["prompt"], list) and isinstance(sample[3]["prompt"], str)
    config = schemas["SftConfig"]["properties"]
    assert (
        "too_long" in config["truncation"]["description"]
        and "longest row" in config["max_length"]["description"]
    )
