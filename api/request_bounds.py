"""What one dataset upload or inspection may cost (docs/security.md#what-a-request-may-cost).

Tokenizing a row holds its ids, labels and offsets as Python objects: about 100 bytes of memory
per byte of the row's line. So the bound is on the line, not only on the body: a line longer than
`MAX_LINE_BYTES` is refused while the body is spooled to disk, before anything is parsed. Rows are
then held slim (hashes and counts, no ids, no rendering) except the ones an inspector answer
shows, and an answer carries token pieces for at most `INSPECT_PIECES_MAX` tokens: the page ends
early (`has_more`) rather than growing, and a single row longer than that is shown without its
pieces.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from kiln_train.data.ingestion import RowOutcome
from kiln_train.errors import invalid_request

MAX_LINE_BYTES = 1 << 20
INSPECT_PIECES_MAX = 50_000


class LineMeter:
    """Fed the body chunk by chunk; raises the 400 at the first line longer than the bound."""

    def __init__(self, limit: int = MAX_LINE_BYTES) -> None:
        self.limit = limit
        self.line = 1  # the line `current` bytes belong to
        self.current = 0

    def feed(self, chunk: bytes) -> None:
        parts = chunk.split(b"\n")
        lengths = [self.current + len(parts[0]), *map(len, parts[1:])]
        if max(lengths) > self.limit:
            over = next(i for i, n in enumerate(lengths) if n > self.limit)
            self._refuse(self.line + over)
        self.line += len(parts) - 1
        self.current = lengths[-1]

    def _refuse(self, line: int) -> None:
        raise invalid_request(
            f"line {line} of the body is longer than {self.limit} bytes, the most one row may take",
            hint=f"Keep each JSON Lines row under {self.limit // 1024} KiB; docs/security.md#what-a-request-may-cost.",
        )


@dataclass(frozen=True)
class SlimRow:
    """What the policy and the statistics read of a kept row, without its ids or labels."""

    row_index: int
    row_sha256: str
    seq_len: int
    supervised_tokens: int


def slim(outcome: RowOutcome) -> RowOutcome:
    """`outcome` without its token ids, labels and rendering (kept: only its counts)."""
    row = outcome.tokenized
    light = None
    if row is not None:
        light = SlimRow(row.row_index, row.row_sha256, row.seq_len, row.supervised_tokens)
    return replace(outcome, tokenized=light, rendered=None)  # type: ignore[arg-type]


def piece_cost(outcome: RowOutcome) -> int:
    """Token pieces showing `outcome` would take, at most (a rejected row: its characters)."""
    if outcome.tokenized is not None:
        return outcome.tokenized.seq_len
    return len(outcome.rendered.text) if outcome.rendered is not None else 0


class PageBudget:
    """Which rows an inspector page shows in full: from `offset`, at most `limit` rows, while their
    pieces fit `INSPECT_PIECES_MAX` (the first row always, its pieces only when they fit)."""

    def __init__(self, offset: int, limit: int) -> None:
        self.offset, self.limit, self.pieces = offset, limit, INSPECT_PIECES_MAX
        self.shown: list[int] = []  # positions among the outcomes
        self.spent = 0
        self.closed = False

    def take(self, position: int, outcome: RowOutcome) -> bool:
        """Whether the row at `position` is shown (kept in full)."""
        if self.closed or position < self.offset:
            return False
        cost = piece_cost(outcome)
        if len(self.shown) >= self.limit or (self.shown and self.spent + cost > self.pieces):
            self.closed = True
            return False
        self.shown.append(position)
        self.spent += cost
        return True


def shows_pieces(outcome: RowOutcome) -> bool:
    """Whether an answer carries the row's token pieces (not for a row past the whole budget)."""
    return piece_cost(outcome) <= INSPECT_PIECES_MAX


def yielding(rows: Iterable[RowOutcome]) -> Iterator[RowOutcome]:
    """`rows`, giving up the GIL between two: parsing and tokenizing hold it, and a /health probe
    served by another thread of the same worker would otherwise wait up to the interpreter's
    switch interval at each of its own steps (docs/security.md#health-under-load)."""
    for row in rows:
        yield row
        time.sleep(0)


def check_example_sizes(examples: list | None, field: str) -> None:
    """Inline examples are rows too: each may take at most MAX_LINE_BYTES as compact JSON, the
    bound of a JSON Lines row, so a 64 MiB body of one example cannot cost gigabytes when it is
    tokenized (400 naming the example)."""
    for index, example in enumerate(examples or []):
        size = len(
            json.dumps(example, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
        )
        if size > MAX_LINE_BYTES:
            raise invalid_request(
                f"{field}[{index}] is {size} bytes as JSON; one example may take at most {MAX_LINE_BYTES}",
                hint=f"Keep each example under {MAX_LINE_BYTES // 1024} KiB; docs/security.md#what-a-request-may-cost.",
            )
