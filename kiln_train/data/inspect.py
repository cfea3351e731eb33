"""Each row as SFT ingestion sees it, as data: the facts `kiln data inspect --json` prints per row
and the api's data inspector serves, plus the rendering cut into tokens for a browser.

Torch-free. `row_facts` is the one definition of a row's facts; `token_pieces` re-encodes the
rendered text (the same text ingestion tokenized, with the same tokenizer) to cut it at token
offsets, and for a kept row checks the ids equal the ones ingestion produced, so a piece marked
supervised is exactly a token whose label is not IGNORE_INDEX.
"""

from __future__ import annotations

from kiln_train.data.ingestion import RowOutcome
from kiln_train.data.labels import IGNORE_INDEX, label_encoding


def row_facts(outcome: RowOutcome) -> dict:
    """One row's facts: where it is (`line` in a file, null inline), its `format` and how it was
    converted (null when it never got that far), then ids and labels of a kept row (and the
    tokens `truncation: "right"` cut off), the reason and detail of a rejected one."""
    facts = {
        "row_index": outcome.row_index,
        "line": outcome.line,
        "row_sha256": outcome.row_sha256,
        "format": outcome.format,
        "conversion": outcome.conversion,
    }
    if outcome.kept:
        row = outcome.tokenized
        return facts | {
            "seq_len": row.seq_len,
            "supervised_tokens": row.supervised_tokens,
            "dropped_tokens": outcome.dropped_tokens,
            "input_ids": row.input_ids,
            "labels": row.labels,
        }
    return facts | {"rejection": outcome.reason, "detail": outcome.detail}


def token_pieces(outcome: RowOutcome, tokenizer) -> list[dict] | None:
    """The rendered text as consecutive pieces `{"text", "token", "supervised"}`: one per token
    (its index, and whether its label is supervised) and text no token covers (`token` None).
    None when the row was never rendered or the tokenizer refuses its text."""
    rendered = outcome.rendered
    if rendered is None:
        return None
    try:
        (encoding,) = tokenizer.encode_batch([rendered.text], add_special_tokens=False)
    except Exception:  # noqa: BLE001 - the row's own rejection already names the tokenizer failure
        return None
    if outcome.kept:
        if encoding.ids != outcome.tokenized.input_ids:
            raise ValueError(f"row {outcome.row_index}: re-encoding the rendering gave other token ids")
        labels = outcome.tokenized.labels
    else:
        labels = label_encoding(encoding, rendered.spans).labels
    text = rendered.text
    pieces: list[dict] = []
    cursor = 0
    for index, (start, end) in enumerate(encoding.offsets):
        if start > cursor:
            pieces.append({"text": text[cursor:start], "token": None, "supervised": False})
        start = max(start, cursor)  # a character split over several byte-level tokens: shown once
        pieces.append(
            {
                "text": text[start:end] if end > start else "",
                "token": index,
                "supervised": labels[index] != IGNORE_INDEX,
            }
        )
        cursor = max(cursor, end)
    if cursor < len(text):
        pieces.append({"text": text[cursor:], "token": None, "supervised": False})
    return pieces
