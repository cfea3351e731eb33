"""The command line behind `qualification/sft_template_oracle.py`: `--write` or `--check`."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from kiln_train.data.tokenizer import build_tokenizer, write_tokenizer

from .checks import check
from .constants import CONVERSATIONS_FIXTURE, FIXTURE, PROBE2_FIXTURE
from .fixtures import build_conversations_fixture, build_fixture, build_probe2_fixture, dump_fixture


def main(description: str | None = None) -> int:
    parser = argparse.ArgumentParser(description=description)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the checked-in fixture")
    mode.add_argument("--check", action="store_true", help="re-run the oracle and diff")
    args = parser.parse_args()

    from transformers import PreTrainedTokenizerFast

    tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_json, _ = write_tokenizer(tmp, tokenizer)
        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        if not hf_tokenizer.backend_tokenizer.model.ignore_merges:
            raise SystemExit("the oracle tokenizer lost ignore_merges; see docs/tokenization.md#tokenizer")
        if args.check:
            return check(hf_tokenizer, tokenizer, tokenizer_json)
        fixtures = {
            FIXTURE: build_fixture(hf_tokenizer, tokenizer_json),
            CONVERSATIONS_FIXTURE: build_conversations_fixture(hf_tokenizer, tokenizer_json),
            PROBE2_FIXTURE: build_probe2_fixture(hf_tokenizer, tokenizer_json),
        }
    for path, fixture in fixtures.items():
        _write(path, fixture)
    return 0


def _write(path: Path, fixture: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_fixture(fixture), encoding="utf-8")
    counts = f"{len(fixture['cases'])} cases"
    if "edges" in fixture:
        counts = f"{len(fixture['cases'])} conversations, {len(fixture['edges'])} edge rows"
    print(f"wrote {path} ({path.stat().st_size} bytes, {counts})")
