"""Request bodies of the HF export route, shared by the export and import tests."""

from __future__ import annotations

from tests.api.conftest import example

HF_CONFIG = {"epochs": 2, "lora_rank": 4, "lora_alpha": 8.0, "optimizer": {"kind": "sgd"}, "seed": 9}


def export_body(name: str = "bundle", n: int = 3, **fields) -> dict:
    return {"name": name, "examples": [example(i) for i in range(n)], "config": dict(HF_CONFIG), **fields}
