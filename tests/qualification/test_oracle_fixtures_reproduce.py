"""The oracle fixtures in `qualification/fixtures/` are what their generators write today, byte for
byte (the generators' own `--write`/`--out` serialisation, run in-process against the pinned
TRL/transformers/torch): a reorganisation of Kiln must not change what the oracles record.
Regenerate (only for a change the oracle is meant to record):

    .venv/bin/python qualification/adamw_pytorch_oracle.py --out qualification/fixtures/adamw_pytorch_oracle_v1.json
    .venv/bin/python qualification/sft_template_oracle.py --write
    .venv/bin/python qualification/sft_nothink_oracle.py --write
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "qualification" / "fixtures"


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory, qwen_tokenizer):
    from transformers import PreTrainedTokenizerFast

    from kiln_train.data.tokenizer import write_tokenizer

    tokenizer_json, _ = write_tokenizer(tmp_path_factory.mktemp("oracle-tokenizer"), qwen_tokenizer)
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json)), tokenizer_json


def test_the_adamw_oracle_fixture_reproduces():
    from qualification.adamw_pytorch_oracle import build_fixture, dump

    path = FIXTURES / "adamw_pytorch_oracle_v1.json"
    assert dump(build_fixture()) + "\n" == path.read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("builder", "name"),
    [
        ("build_fixture", "qwen35_sft_oracle_v1.json"),
        ("build_conversations_fixture", "qwen35_sft_conversations_v1.json"),
        ("build_probe2_fixture", "qwen35_sft_probe2_v1.json"),
    ],
)
def test_the_sft_template_oracle_fixtures_reproduce(hf_tokenizer, builder, name):
    from qualification.sft_oracle import fixtures

    fixture = getattr(fixtures, builder)(*hf_tokenizer)
    assert fixtures.dump_fixture(fixture) == (FIXTURES / name).read_text(encoding="utf-8")


@pytest.mark.slow
def test_the_nothink_equivalence_fixture_reproduces(hf_tokenizer, qwen_tokenizer):
    from qualification.sft_nothink_oracle import FIXTURE, build

    text = json.dumps(build(hf_tokenizer[0], qwen_tokenizer), indent=1, ensure_ascii=False) + "\n"
    assert text == FIXTURE.read_text(encoding="utf-8")
