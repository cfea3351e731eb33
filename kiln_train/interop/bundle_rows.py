"""`train.jsonl` of an export bundle: Kiln's admitted rows in its step order (docs/interop.md#export).

A line holds the step (1-based), its epoch and position, the row's index in the source and its
`kiln.sft-parsed-row.v1` hash, the row itself (parsed for `messages`, as given for
another format), the messages and tools as Kiln hands them to the template (a converted row's
conversation), and Kiln's token ids and supervised token ranges for the row. What the runner needs
to re-derive the labels of the other formats rides along: `context_messages` (a conversational
prompt/completion row: how many leading messages are the prompt, whose tokens are context),
`text` and `completion_start` (a plain prompt/completion row: the raw text and the character
where supervision starts; `messages` is null), and `max_length` (every row, when the run cuts
rows with `truncation: "right"`).
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln_train.checkpoint.epoch_order import epoch_order
from kiln_train.data.conversation import RowRejection, decode_json, parse_example
from kiln_train.data.ingestion import IngestionResult
from kiln_train.data.ingestion_sources import jsonl_lines
from kiln_train.data.labels import IGNORE_INDEX
from kiln_train.data.row_formats import (
    MESSAGES,
    PROMPT_COMPLETION,
    convert_messages,
    convert_row,
    detect_format,
)
from kiln_train.data.row_identity import parsed_row_sha256
from kiln_train.data.row_identity import serde_canonical_json as row_canonical_json
from kiln_train.data.row_pipeline import text_of


def jsonl_objects(path: Path) -> dict[int, object]:
    """Row index (1-based among non-blank lines, as ingestion numbers them) -> decoded JSON, for
    every line that decodes (the others were rejected and are never exported)."""
    out: dict[int, object] = {}
    for index, line in jsonl_lines(path):
        try:
            out[index] = decode_json(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            continue
    return out


def label_ranges(labels: list[int]) -> list[list[int]]:
    """Token index ranges `[start, end)` whose labels are supervised."""
    ranges: list[list[int]] = []
    start = None
    for i, label in enumerate([*labels, IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            ranges.append([start, i])
            start = None
    return ranges


def _row_record(row, source_obj, max_length: int | None) -> dict:
    """What train.jsonl says about one kept row (the step fields are added per step): the row as
    given and what its format converts to (row_formats), which the runner re-tokenizes."""
    try:
        fmt = detect_format(source_obj)
        if fmt == MESSAGES:
            parsed = parse_example(source_obj)
            canonical = row_canonical_json(parsed)
            converted = convert_messages(parsed, canonical, None, parsed_row_sha256(parsed))
        else:
            parsed, converted = source_obj, convert_row(source_obj, fmt)
    except RowRejection as exc:  # ingestion kept it, so this is not reachable with the same code
        raise RuntimeError(f"row {row.row_index}: {exc}") from None
    if converted.row_sha256 != row.row_sha256:
        raise RuntimeError(f"row {row.row_index}: the source row no longer hashes to {row.row_sha256}")
    conversation = converted.conversation
    record: dict = {
        "row_index": row.row_index,
        "row_sha256": row.row_sha256,
        "row": parsed,
        "messages": conversation.messages if conversation is not None else None,
        "tools": conversation.tools if conversation is not None else None,
    }
    if fmt == PROMPT_COMPLETION:  # the prompt's messages are context, their assistant turns too
        record["context_messages"] = len(source_obj["prompt"])
    if conversation is None:  # raw text: no template; supervised from the completion's first character
        record["text"] = text_of(converted)
        record["completion_start"] = len(converted.prompt)
    if max_length is not None:
        record["max_length"] = max_length
    return record | {
        "input_ids": list(row.input_ids),
        "supervised_ranges": label_ranges(row.labels),
        "tokens": row.seq_len,
        "supervised_tokens": row.supervised_tokens,
    }


def step_orders(seed: int, epochs: int, n: int) -> list[list[int]]:
    """Kiln's per-epoch item orders (indices into the kept rows)."""
    return [epoch_order(seed, e, n) for e in range(epochs)]


def train_lines(
    ingestion: IngestionResult,
    sources: dict[int, object],
    orders: list[list[int]],
    truncate_to: int | None = None,
) -> bytes:
    """`train.jsonl`: one line per optimizer step, the steps of every epoch in `orders`.
    `truncate_to` is `config.max_length` under `truncation: "right"` (None otherwise)."""
    records = [_row_record(row, sources[row.row_index], truncate_to) for row in ingestion.rows]
    out = []
    step = 0
    for epoch, order in enumerate(orders):
        for position, item in enumerate(order):
            step += 1
            line = {"step": step, "epoch": epoch, "position": position, "item": item, **records[item]}
            out.append(json.dumps(line, ensure_ascii=False, separators=(",", ":"), allow_nan=False))
    return ("\n".join(out) + "\n").encode("utf-8")
