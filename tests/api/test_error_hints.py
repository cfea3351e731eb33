"""`hint` is a string in every error envelope, as the served OpenAPI document says: every code's
static hint, rendered through the api's error handler, and the interop routes' answers."""

from __future__ import annotations

import pytest
from flask import Flask

from api.errors import API_ERRORS, ApiError, error_response
from api.openapi import build_document
from kiln_train.errors import ERROR_TEXT, KilnError
from kiln_train.interop.errors import INTEROP_HINTS, InteropError
from tests.api.hf_support import HF_CONFIG, export_body

JSON_TYPES = {"string": str, "object": dict, "integer": int, "array": list, "boolean": bool}


def _resolve(document: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def assert_conforms(document: dict, schema: dict, value, where: str = "$") -> None:
    """The keywords the envelope's schema uses: type, properties, required, additionalProperties."""
    schema = _resolve(document, schema)
    kind = schema.get("type")
    assert kind is None or isinstance(value, JSON_TYPES[kind]), f"{where}: {value!r} is not a {kind}"
    if kind == "object":
        assert set(schema.get("required", [])) <= set(value), f"{where}: missing members"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), f"{where}: extra members"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                assert_conforms(document, sub, value[key], f"{where}.{key}")


ENVELOPE = {"$ref": "#/components/schemas/ErrorEnvelope"}


@pytest.fixture(scope="module")
def document() -> dict:
    return build_document(auth=True)


def _error(code: str) -> KilnError:
    if code in INTEROP_HINTS:
        return InteropError(code, "detail")
    if code in ERROR_TEXT:
        return KilnError(code, "detail")
    return ApiError(code, "detail")


def test_every_static_hint_is_one_string():
    hints = [h for _, h in ERROR_TEXT.values()] + list(INTEROP_HINTS.values())
    hints += [h for _, _, h in API_ERRORS.values() if h is not None]
    assert hints and all(isinstance(h, str) and h for h in hints), [
        h for h in hints if not isinstance(h, str)
    ]


@pytest.mark.parametrize("code", sorted(set(API_ERRORS) | set(ERROR_TEXT) | set(INTEROP_HINTS)))
def test_every_code_renders_an_envelope_the_document_describes(code, document):
    with Flask(__name__).app_context():
        body = error_response(_error(code)).get_json()
    assert body["error"]["code"] == code
    assert_conforms(document, ENVELOPE, body)


def test_interop_routes_answer_string_hints(client, runner):
    document = client.get("/openapi.json").get_json()
    muon = client.post(
        "/v1/train/hf/sft/exports", json=export_body(config={**HF_CONFIG, "optimizer": {"kind": "muon"}})
    )
    broken = client.post(
        "/v1/train/hf/peft/imports/x",
        data=b"\x1f\x8b not really",
        headers={"Content-Type": "application/gzip"},
    )
    for answer, code in ((muon, "hf_export_unsupported"), (broken, "peft_import_invalid")):
        assert answer.status_code == 400 and answer.get_json()["error"]["code"] == code
        assert_conforms(document, ENVELOPE, answer.get_json())
        assert "docs/interop.md" in answer.get_json()["error"]["hint"]
