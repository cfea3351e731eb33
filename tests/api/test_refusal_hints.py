"""The HF export request's refusals name the nearest field too (api/hf.py: parse_export_request)."""

from __future__ import annotations

import pytest

from api.hf import parse_export_request
from kiln_train.errors import KilnError


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"name": "x", "examples": [{}], "confg": {}},
            "confg: unknown field (not part of the native_online_lora_v1 contract); did you mean `config`?",
        ),
        (
            {"name": "x", "examples": [{}], "config": {"epoch": 1}},
            "config.epoch: unknown field (not part of the native_online_lora_v1 contract); did you mean `epochs`?",
        ),
        (
            {"name": "x", "examples": [{}], "config": {"optimizer": "adamw"}},
            'got the string \'adamw\'; did you mean {"kind": "adam_w"}?',
        ),
    ],
)
def test_an_export_refusal_says_what_to_write_instead(body, expected):
    with pytest.raises(KilnError) as caught:
        parse_export_request(body)
    assert caught.value.message.endswith(expected), caught.value.message
