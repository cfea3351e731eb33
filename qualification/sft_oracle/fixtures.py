"""Building the three fixtures from the oracle's results, and writing them in a diff-friendly layout.

Each fixture pins the reference stack (library versions, template and tokenizer digests) in its
header, then holds one case per line: the row exactly as Kiln receives it and what the oracle
made of it. `dump_fixture` is the one serialisation, so a fixture's bytes change only when its
cases or its header do.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln_train.data.chat_template import training_chat_template_sha256
from kiln_train.data.labels import MASK_CONTRACT
from kiln_train.data.tokenizer import vocabulary_file
from kiln_train.ground.digest import file_sha256_hex

from .constants import (
    CHECK,
    CONVERSATIONS_ROWS,
    CONVERSATIONS_SCHEMA,
    CONVERSATIONS_SEED,
    FIXTURE_SCHEMA,
    PROBE2_ROWS,
    PROBE2_SCHEMA,
    PROBE2_SEED,
    RANDOM_ROWS,
    RANDOM_SEED,
    REGENERATE,
)
from .conversation_edges import conversation_edges
from .conversations import conversation_rows
from .named_cases import named_cases
from .probe2 import probe2_rows
from .probe2_cases import probe2_edges, probe2_named, probe2_tools_rows
from .random_rows import random_rows
from .stack import library_versions, mask_ranges, oracle_entry, run_oracle, trl_template_path


def _header(schema: str, description: str) -> dict:
    """The fields every fixture opens with, in this order."""
    return {
        "schema": schema,
        "description": description,
        "regenerate": REGENERATE,
        "check": CHECK,
        "mask_contract": MASK_CONTRACT,
        "versions": library_versions(),
    }


def _artifacts(tokenizer_json: Path) -> dict:
    """Digests of what the conversations and corner-case fixtures were rendered with."""
    return {
        "trl_training_template_sha256": file_sha256_hex(trl_template_path()),
        "kiln_training_template_sha256": training_chat_template_sha256(),
        "tokenizer_json_sha256": file_sha256_hex(tokenizer_json),
        "tokenizer_vocabulary_sha256": file_sha256_hex(vocabulary_file()),
    }


def build_fixture(hf_tokenizer, tokenizer_json: Path) -> dict:
    """The first fixture: named cases with full labels, and the random set with supervised ranges."""
    template_path = trl_template_path()
    template = template_path.read_text(encoding="utf-8")
    cases = []
    for name, row in named_cases():
        cases.append({"name": name, "example": row, **run_oracle(hf_tokenizer, template, row)})
    randoms = []
    for i, row in enumerate(random_rows(RANDOM_SEED, RANDOM_ROWS)):
        result = run_oracle(hf_tokenizer, template, row)
        entry = {"name": f"random_{i:03d}", "example": row}
        if "error" in result:
            entry["error"] = result["error"]
        else:
            entry.update(
                text=result["text"],
                input_ids=result["input_ids"],
                supervised_ranges=mask_ranges(result["assistant_masks"]),
            )
        randoms.append(entry)
    description = (
        "Transformers apply_chat_template(return_assistant_tokens_mask=True) over TRL's "
        "qwen3_5_think_training.jinja with Kiln's converted Qwen3.5 tokenizer; labels = ids where mask "
        "else -100; add_generation_prompt=false; function.arguments JSON strings parsed to objects."
    )
    return {
        **_header(FIXTURE_SCHEMA, description),
        "artifacts": {
            "trl_training_template": "trl/chat_templates/qwen3_5_think_training.jinja",
            "trl_training_template_sha256": file_sha256_hex(template_path),
            "trl_think_template_sha256": file_sha256_hex(template_path.with_name("qwen3_5_think.jinja")),
            "kiln_training_template_sha256": training_chat_template_sha256(),
            "tokenizer_json_sha256": file_sha256_hex(tokenizer_json),
            "tokenizer_vocabulary_sha256": file_sha256_hex(vocabulary_file()),
        },
        "random_seed": RANDOM_SEED,
        "cases": cases,
        "random_cases": randoms,
    }


def build_conversations_fixture(hf_tokenizer, tokenizer_json: Path) -> dict:
    """The conversations fixture: the seeded `conversation_rows` and the named edge rows."""
    template = trl_template_path().read_text(encoding="utf-8")
    cases = []
    for i, row in enumerate(conversation_rows(CONVERSATIONS_SEED, CONVERSATIONS_ROWS)):
        cases.append(
            {"name": f"conversation_{i:03d}", "example": row, **oracle_entry(hf_tokenizer, template, row)}
        )
    edges = []
    for edge in conversation_edges():
        edges.append({**edge, "oracle": oracle_entry(hf_tokenizer, template, edge["example"])})
    description = (
        "Seeded conversations rendered by Transformers apply_chat_template(return_assistant_tokens_mask=True) "
        "over TRL's qwen3_5_think_training.jinja with Kiln's converted Qwen3.5 tokenizer; add_generation_prompt"
        "=false; function.arguments JSON strings parsed to objects. supervised_ranges are the token ranges "
        "[start, end) where the assistant mask is 1; labels = input_ids inside them, -100 elsewhere. Edge rows "
        "record the oracle's result next to the outcome Kiln must give and why."
    )
    return {
        **_header(CONVERSATIONS_SCHEMA, description),
        "artifacts": _artifacts(tokenizer_json),
        "generator": {
            "function": "conversation_rows",
            "seed": CONVERSATIONS_SEED,
            "rows": CONVERSATIONS_ROWS,
        },
        "cases": cases,
        "edges": edges,
    }


def build_probe2_fixture(hf_tokenizer, tokenizer_json: Path) -> dict:
    """The corner-case fixture: named corner rows, the seeded `probe2_rows` and the edge rows."""
    template = trl_template_path().read_text(encoding="utf-8")
    named = [(n, {"messages": m}) for n, m in probe2_named()] + probe2_tools_rows()
    cases = [{"name": n, "example": row, **oracle_entry(hf_tokenizer, template, row)} for n, row in named]
    for i, row in enumerate(probe2_rows(PROBE2_SEED, PROBE2_ROWS)):
        cases.append({"name": f"probe2_{i:03d}", "example": row, **oracle_entry(hf_tokenizer, template, row)})
    edges = [{**e, "oracle": oracle_entry(hf_tokenizer, template, e["example"])} for e in probe2_edges()]
    description = (
        "Named corner rows and seeded probe2_rows conversations rendered by Transformers apply_chat_template("
        "return_assistant_tokens_mask=True) over TRL's qwen3_5_think_training.jinja with Kiln's converted "
        "Qwen3.5 tokenizer; add_generation_prompt=false; function.arguments JSON strings parsed to objects. "
        "Every case is one Kiln must keep with exactly this text, these ids and these supervised ranges; "
        "edge rows record the oracle's result next to the outcome Kiln must give and why."
    )
    return {
        **_header(PROBE2_SCHEMA, description),
        "artifacts": _artifacts(tokenizer_json),
        "generator": {"function": "probe2_rows", "seed": PROBE2_SEED, "rows": PROBE2_ROWS},
        "cases": cases,
        "edges": edges,
    }


def dump_fixture(fixture: dict) -> str:
    """JSON with the header pretty-printed and one case per line (reviewable diffs)."""

    def compact(value) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    lines = ["{"]
    items = list(fixture.items())
    for n, (key, value) in enumerate(items):
        comma = "," if n < len(items) - 1 else ""
        if isinstance(value, list):
            lines.append(f"  {json.dumps(key)}: [")
            lines.extend(f"    {compact(v)}{',' if j < len(value) - 1 else ''}" for j, v in enumerate(value))
            lines.append(f"  ]{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"
