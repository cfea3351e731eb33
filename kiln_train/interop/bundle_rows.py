"""`train.jsonl` of an export bundle: Kiln's admitted rows in its step order (docs/interop.md#export).

A line holds the step (1-based), its epoch and position, the row's index in the source and its
`kiln.sft-parsed-row.v1` hash, the parsed row itself, the messages and tools as Kiln hands them to
the template, and Kiln's token ids and supervised token ranges for the row.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln_train.checkpoint.epoch_order import epoch_order
from kiln_train.data.conversation import RowRejection, decode_json, parse_example, prepare_for_template
from kiln_train.data.ingestion import IngestionResult
from kiln_train.data.ingestion_sources import jsonl_lines
from kiln_train.data.labels import IGNORE_INDEX
from kiln_train.data.row_identity import parsed_row_sha256
from kiln_train.data.row_identity import serde_canonical_json as row_canonical_json


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


def _row_record(row, source_obj) -> dict:
    """What train.jsonl says about one kept row (the step fields are added per step)."""
    parsed = parse_example(source_obj)
    canonical = row_canonical_json(parsed)
    if parsed_row_sha256(parsed) != row.row_sha256:
        raise RuntimeError(f"row {row.row_index}: the source row no longer hashes to {row.row_sha256}")
    try:
        conversation = prepare_for_template(parsed, canonical)
    except RowRejection as exc:  # ingestion kept it, so this is not reachable with the same code
        raise RuntimeError(f"row {row.row_index}: {exc}") from None
    return {
        "row_index": row.row_index,
        "row_sha256": row.row_sha256,
        "row": parsed,
        "messages": conversation.messages,
        "tools": conversation.tools,
        "input_ids": list(row.input_ids),
        "supervised_ranges": label_ranges(row.labels),
        "tokens": row.seq_len,
        "supervised_tokens": row.supervised_tokens,
    }


def step_orders(seed: int, epochs: int, n: int) -> list[list[int]]:
    """Kiln's per-epoch item orders (indices into the kept rows)."""
    return [epoch_order(seed, e, n) for e in range(epochs)]


def train_lines(ingestion: IngestionResult, sources: dict[int, object], orders: list[list[int]]) -> bytes:
    """`train.jsonl`: one line per optimizer step, the steps of every epoch in `orders`."""
    records = [_row_record(row, sources[row.row_index]) for row in ingestion.rows]
    out = []
    step = 0
    for epoch, order in enumerate(orders):
        for position, item in enumerate(order):
            step += 1
            line = {"step": step, "epoch": epoch, "position": position, "item": item, **records[item]}
            out.append(json.dumps(line, ensure_ascii=False, separators=(",", ":"), allow_nan=False))
    return ("\n".join(out) + "\n").encode("utf-8")
