"""`api.json_text`: the step-wise decoder and digest give exactly what the one-call forms give
(values, errors and their positions, the canonical digest a stored fingerprint was made with)."""

from __future__ import annotations

import json
import random

import pytest

from api.json_text import DECODER, loads
from kiln_train.ground.digest import canonical_json_bytes, json_sha256, sha256_prefixed


def _outcome(fn, text: str):
    try:
        return "value", fn(text)
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize(
    "text",
    [
        "{}",
        "[]",
        ' { "a" : [ 1 , 2 ] , "b" : {"c": [3]} } \n',
        '{"examples": [{"messages": []}, {"x": 1.5}], "config": {"epochs": 1}}',
        '"text"',
        "3",
        "null",
        '{"a": 1} x',
        '{"a": 1, "a": 2}',
        '{"a": [{"b": 1, "b": 2}]}',
        '{"a": NaN}',
        '{"a": [Infinity]}',
        '{"a": 1e400}',
        '{"a": [1,]}',
        '{"a": [1 2]}',
        '{"a" 1}',
        '{"a": 1,}',
        "{a: 1}",
        '{"a": [1, 2',
        '{"a": "\\ud800"}',
        '{"a": "tab\tinside"}',
        "\ufeff{}",
        "",
        "   ",
        '{"a": [' + "[" * 5000 + "]" * 5000 + "]}",
    ],
)
def test_loads_is_the_decoder(text):
    assert _outcome(loads, text) == _outcome(DECODER.decode, text)


def _random_value(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 4 or roll < 0.3:
        return rng.choice([0, -7, 2.5, 1e-300, 10**30, "", 'é\u2028"\\', None, True, False])
    if roll < 0.65:
        return {
            rng.choice(["b", "A", "a", "é", "_", "10", "1"]): _random_value(rng, depth + 1) for _ in range(4)
        }
    return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]


def test_random_documents_decode_and_digest_alike():
    rng = random.Random(20261201)
    for _ in range(3000):
        value = _random_value(rng)
        assert json_sha256(value) == sha256_prefixed(canonical_json_bytes(value)), value
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]))
        assert loads(text) == DECODER.decode(text)
