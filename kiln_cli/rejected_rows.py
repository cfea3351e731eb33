"""Every rejected row of a refused submission, not only the first.

Under `invalid_row_policy=fail` the server refuses a corpus at its first bad row. When that
happens to a `--data` file, the CLI asks the server's data inspector (`POST /v1/data/inspect`,
which stores nothing) for all the file's rejections, so one round of fixes covers them all. The
list is bounded: the first `SHOWN` rows with their reason and detail, then a count of the rest.
"""

from __future__ import annotations

import re
from pathlib import Path

from kiln_cli.http_client import ApiClient, ApiError, ApiUnreachable

INSPECT_PATH = "/v1/data/inspect"
NDJSON = "application/x-ndjson"
# The server's largest inspector page; rows beyond it are counted from the receipt.
INSPECT_PAGE = 1000
# Rejected rows printed in full; the rest are counted.
SHOWN = 20
# How the server names a training row it refused (kiln_train.data.ingestion.select_rows).
REFUSED_ROW = re.compile(r"SFT row \d+ \(sha256:[0-9a-f]+\) rejected as ")


def names_a_rejected_row(message: str) -> bool:
    """Whether a refusal is a training row rejected under the fail policy."""
    return REFUSED_ROW.search(message) is not None


def rejected_row_notes(client: ApiClient, path: Path, lines: list[int]) -> list[str]:
    """Notes listing every rejected row of the JSONL file `path` (row n is file line
    `lines[n - 1]`); empty when the inspector cannot be asked or finds fewer than two."""
    try:
        raw = path.read_bytes()
        reply = client.request(
            "POST",
            INSPECT_PATH,
            raw=(raw, NDJSON),
            query={"invalid_row_policy": "skip", "limit": INSPECT_PAGE},
        ).body
    except (OSError, ApiError, ApiUnreachable):
        return []
    rejected = _rejections(reply)
    if len(rejected) < 2:
        return []  # the refusal itself already names the one bad row
    notes = [f"{len(rejected)} rows of {path} are rejected (the server stops at the first); all of them:"]
    for index, reason, detail in rejected[:SHOWN]:
        where = f"line {lines[index - 1]}" if 0 < index <= len(lines) else f"row {index}"
        notes.append(f"{where} (row {index}): {reason}" + (f": {detail}" if detail else ""))
    if len(rejected) > SHOWN:
        notes.append(f"... and {len(rejected) - SHOWN} more (kiln data inspect {path} shows every row)")
    return notes


def _rejections(reply: dict) -> list[tuple[int, str, str | None]]:
    """(row index, reason, detail) of every rejected row: the page's rows carry the detail, the
    receipt (when any row was kept) lists the rejections beyond the page."""
    found: dict[int, tuple[int, str, str | None]] = {}
    for row in reply.get("rows") or []:
        facts = row.get("facts") or {}
        if facts.get("rejection"):
            found[facts["row_index"]] = (facts["row_index"], facts["rejection"], facts.get("detail"))
    receipt = reply.get("receipt") or {}
    for entry in receipt.get("rejected_rows") or []:
        found.setdefault(entry["row_index"], (entry["row_index"], entry["reason"], None))
    if reply.get("has_more") and not receipt:
        # no row was kept, so every row read beyond the page was rejected too
        for index in range(len(reply.get("rows") or []) + 1, int(reply.get("rows_read") or 0) + 1):
            found.setdefault(index, (index, "rejected", None))
    return [found[i] for i in sorted(found)]
