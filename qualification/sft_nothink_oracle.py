"""Oracle: Qwen3.5's "nothink" checkpoints (2B and smaller) train under Kiln's one training template.

Qwen3.5-2B and smaller ship the nothink chat template (TRL's `qwen3_5_nothink.jinja`); TRL trains
them with `qwen3_5_nothink_training.jinja`. Kiln selects its one training template for both the
think and the nothink model template (`kiln_train.data.chat_template.select_training_template`). That
is only right if the two TRL training variants produce the same text, ids and assistant mask for
every SFT conversation (add_generation_prompt=false). This script proves it with the real stack:
Transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` over Kiln's converted
tokenizer runs both TRL training templates on every example of the checked-in conversation
fixtures (`qualification/fixtures/qwen35_sft_*_v1.json`), requires identical results (or the
identical template error), and compares Kiln's ingestion with the nothink result on every row Kiln
keeps. It also records both variants' generation prompts, the one place they differ.

The fixture `qualification/fixtures/qwen35_sft_nothink_equivalence_v1.json` records the counts,
the template digests and the digests of the source fixtures it read;
tests/kiln_train/data/test_chat_template_nothink.py checks it without TRL.

Regenerate (after any source fixture changes):

    .venv/bin/python qualification/sft_nothink_oracle.py --write
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kiln_train.data.chat_template import NOTHINK_TEMPLATE_FILE, training_chat_template_sha256  # noqa: E402
from kiln_train.data.tokenizer import build_tokenizer, write_tokenizer  # noqa: E402
from kiln_train.ground.digest import file_sha256_hex  # noqa: E402
from qualification.sft_oracle.stack import library_versions, oracle_input, run_kiln, run_oracle  # noqa: E402

FIXTURES = REPO / "qualification" / "fixtures"
SOURCES = ("qwen35_sft_oracle_v1.json", "qwen35_sft_conversations_v1.json", "qwen35_sft_probe2_v1.json")
FIXTURE = FIXTURES / "qwen35_sft_nothink_equivalence_v1.json"
SCHEMA = "kiln.qwen35-sft-nothink-equivalence.v1"
REGENERATE = ".venv/bin/python qualification/sft_nothink_oracle.py --write"
GENERATION_PROMPT_EXAMPLE = [{"role": "user", "content": "What is 2+2?"}]


def source_examples() -> tuple[list[dict], list[tuple[str, dict]]]:
    """(per-source records, [(label, example)]) for every example the source fixtures hold."""
    records, examples = [], []
    for name in SOURCES:
        path = FIXTURES / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = 0
        for key, entries in data.items():
            if not isinstance(entries, list):
                continue
            for entry in entries:
                if isinstance(entry, dict) and isinstance(entry.get("example"), dict):
                    examples.append((f"{name}:{key}:{entry.get('name', rows)}", entry["example"]))
                    rows += 1
        records.append({"file": name, "sha256": file_sha256_hex(path), "examples": rows})
    return records, examples


def _prepared(example: dict):
    try:
        return oracle_input(example)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # malformed on purpose (an edge row): no oracle input exists


def _oracle(hf_tokenizer, template: str, example: dict, prepared) -> dict:
    """`run_oracle`, with any error the template raises on a malformed edge row as the result."""
    try:
        return run_oracle(hf_tokenizer, template, example, prepared)
    except Exception as exc:  # noqa: BLE001 - the error itself is the compared result
        return {"error": f"{type(exc).__name__}: {exc}"}


def _trl_templates() -> dict[str, Path]:
    import trl

    root = Path(trl.__file__).parent / "chat_templates"
    return {
        "think": root / "qwen3_5_think.jinja",
        "nothink": root / "qwen3_5_nothink.jinja",
        "think_training": root / "qwen3_5_think_training.jinja",
        "nothink_training": root / "qwen3_5_nothink_training.jinja",
    }


def build(hf_tokenizer, tokenizer) -> dict:
    paths = _trl_templates()
    think = paths["think_training"].read_text(encoding="utf-8")
    nothink = paths["nothink_training"].read_text(encoding="utf-8")
    records, examples = source_examples()
    compared = identical = errors = kiln_compared = kiln_equal = 0
    differences: list[str] = []
    for label, example in examples:
        prepared = _prepared(example)
        if prepared is None:
            continue
        a = _oracle(hf_tokenizer, think, example, prepared)
        b = _oracle(hf_tokenizer, nothink, example, prepared)
        compared += 1
        errors += "error" in b
        if a == b:
            identical += 1
        else:
            differences.append(label)
        if "error" in b:
            continue
        kiln = run_kiln(tokenizer, example)
        if "rejection" in kiln:
            continue
        kiln_compared += 1
        if (kiln["text"], kiln["input_ids"], kiln["assistant_masks"]) == (
            b["text"],
            b["input_ids"],
            b["assistant_masks"],
        ):
            kiln_equal += 1
        else:
            differences.append("kiln:" + label)
    prompts = {}
    for flavour in ("think", "nothink"):
        source = paths[f"{flavour}_training"].read_text(encoding="utf-8")
        prompts[flavour] = hf_tokenizer.apply_chat_template(
            GENERATION_PROMPT_EXAMPLE, tokenize=False, add_generation_prompt=True, chat_template=source
        )
    return {
        "schema": SCHEMA,
        "description": (
            "TRL's qwen3_5_think_training.jinja and qwen3_5_nothink_training.jinja rendered through "
            "Transformers (return_assistant_tokens_mask) over Kiln's converted tokenizer on every "
            "example of the source fixtures: identical text, ids and masks; Kiln's ingestion equals "
            "the nothink result on every row it keeps. The variants differ only in the generation "
            "prompt, which SFT never renders."
        ),
        "regenerate": REGENERATE,
        "versions": library_versions(),
        "templates": {
            "trl_think_sha256": file_sha256_hex(paths["think"]),
            "trl_nothink_sha256": file_sha256_hex(paths["nothink"]),
            "trl_think_training_sha256": file_sha256_hex(paths["think_training"]),
            "trl_nothink_training_sha256": file_sha256_hex(paths["nothink_training"]),
            "kiln_nothink_chat_template_sha256": file_sha256_hex(NOTHINK_TEMPLATE_FILE),
            "kiln_training_template_sha256": training_chat_template_sha256(),
        },
        "sources": records,
        "rows_compared": compared,
        "rows_identical": identical,
        "rows_template_error": errors,
        "kiln_rows_compared": kiln_compared,
        "kiln_rows_equal": kiln_equal,
        "differences": differences,
        "generation_prompts": {"messages": GENERATION_PROMPT_EXAMPLE, **prompts},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the checked-in fixture")
    mode.add_argument("--check", action="store_true", help="re-run and diff against the fixture")
    args = parser.parse_args()

    from transformers import PreTrainedTokenizerFast

    tokenizer = build_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_json, _ = write_tokenizer(tmp, tokenizer)
        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        result = build(hf_tokenizer, tokenizer)
    text = json.dumps(result, indent=1, ensure_ascii=False) + "\n"
    print(
        f"{result['rows_identical']}/{result['rows_compared']} rows identical under both TRL training "
        f"variants ({result['rows_template_error']} template errors, equal too); Kiln equals nothink on "
        f"{result['kiln_rows_equal']}/{result['kiln_rows_compared']} kept rows"
    )
    if args.check:
        stored = FIXTURE.read_text(encoding="utf-8") if FIXTURE.is_file() else ""
        if stored != text:
            print(f"{FIXTURE} differs from a fresh run; regenerate with: {REGENERATE}")
            return 1
        return 0 if not result["differences"] else 1
    FIXTURE.write_text(text, encoding="utf-8")
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
    return 0 if not result["differences"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
