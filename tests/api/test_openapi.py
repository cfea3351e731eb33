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
