"""The OpenAPI document is the one pinned in `fixtures/openapi_v1.json`, byte for byte: a
reorganisation of the code must not change the contract it publishes. A deliberate contract change
(a request field, a route, an optimizer kind) regenerates the fixture and says so in its commit:

    KILN_REGENERATE_OPENAPI=1 .venv/bin/python -m pytest tests/api/test_openapi_stability.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from api.routes.openapi import _document_text

FIXTURE = Path(__file__).parent / "fixtures" / "openapi_v1.json"
REGENERATE = "KILN_REGENERATE_OPENAPI=1 .venv/bin/python -m pytest tests/api/test_openapi_stability.py"


def _without_security(value):
    if isinstance(value, dict):
        return {k: _without_security(v) for k, v in value.items() if k != "security"}
    if isinstance(value, list):
        return [_without_security(v) for v in value]
    return value


def _changed_paths(old, new, path: str = "") -> list[str]:
    """The JSON paths where `new` differs from `old`: `+` added, `-` removed, `~` changed."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            where = f"{path}/{key}"
            if key not in old:
                out.append(f"+ {where}")
            elif key not in new:
                out.append(f"- {where}")
            else:
                out += _changed_paths(old[key], new[key], where)
        return out
    return [] if old == new else [f"~ {path}"]


def test_the_document_with_tokens_is_the_pinned_one_byte_for_byte():
    text = _document_text(True) + "\n"
    if os.environ.get("KILN_REGENERATE_OPENAPI") == "1":
        FIXTURE.write_text(text, encoding="utf-8")
    pinned = FIXTURE.read_text(encoding="utf-8")
    if text != pinned:
        changed = _changed_paths(json.loads(pinned), json.loads(text)) or ["(formatting only)"]
        pytest.fail(
            f"the OpenAPI document changed at {len(changed)} place(s): {'; '.join(changed[:12])}. "
            f"If intended (a contract change), regenerate: {REGENERATE}"
        )


def test_the_change_report_names_each_path():
    old = {"a": {"b": 1, "c": [1]}, "d": 2}
    new = {"a": {"b": 2, "c": [1], "e": 0}}
    assert _changed_paths(old, new) == ["~ /a/b", "+ /a/e", "- /d"]


def test_without_tokens_only_the_security_requirements_go():
    with_tokens, without = json.loads(_document_text(True)), json.loads(_document_text(False))
    assert "security" not in json.dumps(without["paths"])
    assert without == _without_security(with_tokens)


def test_the_server_serves_exactly_that_text(client):
    response = client.get("/openapi.json")
    assert response.status_code == 200 and response.mimetype == "application/json"
    assert response.get_data(as_text=True) in (_document_text(True), _document_text(False))
