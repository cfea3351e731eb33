"""SFT ingestion: rows in, tokenized rows and the `kiln.sft-ingestion.v1` receipt out (docs/ingestion.md).

Every transport reaches one path (`row_pipeline`): parse -> row format (`row_formats`: messages,
instruction, prompt/completion conversational or plain text, each converted into the one
conversation the template renders) -> row identity -> role checks -> render (training template)
-> tokenize -> assistant-only labels -> row checks -> the length rule. No packing, splitting or
dedup, ever; truncation only when a request opts into `config.truncation: "right"`: one accepted
row is one conversation is one sequence.

Transports:
- inline `examples` (`ingest_examples`): objects from the request body. A `messages` example that
  cannot be deserialised is a transport error (400 `training_invalid_request` naming the field),
  never a skippable row -- `invalid_json` exists for JSONL only (docs/ingestion.md#transports).
  A row of another format is a row: its problems are row rejections under the policy.
- server-local JSONL (`ingest_jsonl`, path from `resolve_dataset_path`): split on `\\n`, strip
  ASCII whitespace (space, tab, LF, FF, CR); an empty result is a blank line: not a row, but
  counted in the physical line numbers errors name and in the receipt's `row_counts.blank_lines`.
  Every other line is one row, numbered from 1. A row must be UTF-8 JSON text as serde_json reads
  it: a line that is not UTF-8, starts with a byte-order mark (only ASCII whitespace is trimmed,
  so a BOM left by an editor makes row 1 `invalid_json`, with a detail that says so), repeats a
  key inside an object, or nests deeper than 127 arrays/objects is `invalid_json`
  (`conversation.decode_json`). The last line needs no newline; lines of any length are read whole.

Rejection reasons, contract ones first: `invalid_json`, `empty_messages`, `invalid_role`,
`tokenization_error` (template failure, span-marker collision, undecodable tool arguments,
non-text content, a tool result that answers no call, an empty function name, output the template
would drop (`function_call`, `refusal`), fewer than 2 tokens, or no supervised token at a position
>= 1; the rules Kiln adds where the contract is silent are listed in `conversation`'s docstring);
then Kiln's: the row-format reasons (`row_formats`), `empty_response`, `too_long` and
`answer_truncated`.

Policies: `fail` (the first rejected row rejects the submission: `training_invalid_request`,
"line <l>: SFT row <n> (<row_sha256>) rejected as <reason>: <detail>", the line only for a file)
and `skip` (rejected rows are recorded with their line and logged; at least one row must remain).
The receipt lives in `ingestion_receipt`; reading the transports (and the dataset path rule) in
`ingestion_sources`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln_train.data.chat_template import ChatTemplate
from kiln_train.data.ingestion_receipt import (
    INGESTION_SCHEMA,
    POLICIES,
    SOURCES,
    build_ingestion_receipt,
    validate_ingestion_receipt,
)
from kiln_train.data.ingestion_sources import resolve_dataset_path
from kiln_train.data.labels import MASK_CONTRACT
from kiln_train.data.row_formats import MESSAGES
from kiln_train.data.row_identity import kept_corpus_sha256, parsed_row_sha256, raw_row_sha256
from kiln_train.data.row_pipeline import (
    IngestionTimings,
    LengthRule,
    OutcomeStream,
    RowOutcome,
    TokenizedRow,
    iter_example_outcomes,
    iter_jsonl_outcomes,
)
from kiln_train.errors import invalid_request

log = logging.getLogger(__name__)


__all__ = [
    "INGESTION_SCHEMA",
    "MASK_CONTRACT",
    "IngestionResult",
    "IngestionTimings",
    "LengthRule",
    "OutcomeStream",
    "RowOutcome",
    "apply_invalid_row_policy",
    "build_ingestion_receipt",
    "TokenizedRow",
    "ingest_examples",
    "ingest_jsonl",
    "iter_example_outcomes",
    "iter_jsonl_outcomes",
    "kept_corpus_sha256",
    "parsed_row_sha256",
    "raw_row_sha256",
    "resolve_dataset_path",
    "validate_ingestion_receipt",
]


@dataclass(frozen=True)
class TokenStats:
    """The longest row, the most supervised row and the totals of a set of tokenized rows (what
    memory admission prices and receipts and preflight report)."""

    max_seq_len: int
    max_supervised_tokens: int
    total_tokens: int
    total_supervised_tokens: int

    @classmethod
    def of(cls, rows: Sequence[TokenizedRow]) -> TokenStats:
        return cls(
            max_seq_len=max(r.seq_len for r in rows),
            max_supervised_tokens=max(r.supervised_tokens for r in rows),
            total_tokens=sum(r.seq_len for r in rows),
            total_supervised_tokens=sum(r.supervised_tokens for r in rows),
        )

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class IngestionResult:
    receipt: dict
    rows: list[TokenizedRow]
    max_seq_len: int
    max_supervised_tokens: int
    total_tokens: int
    total_supervised_tokens: int


# --------------------------------------------------------------------------- policy and receipt


@dataclass
class RowTally:
    """What `select_rows` counts besides kept and rejected rows (the receipt's `row_counts`)."""

    rows_per_format: dict[str, int] = field(default_factory=dict)  # kept rows per format
    rows_truncated: int = 0
    tokens_dropped: int = 0

    def add(self, outcome: RowOutcome) -> None:
        fmt = outcome.format or MESSAGES
        self.rows_per_format[fmt] = self.rows_per_format.get(fmt, 0) + 1
        if outcome.dropped_tokens:
            self.rows_truncated += 1
            self.tokens_dropped += outcome.dropped_tokens


def rejection_message(outcome: RowOutcome, row_label: str = "SFT row") -> str:
    """`line <l>: SFT row <n> (<sha>) rejected as <reason>: <detail>` (no line for inline rows)."""
    where = f"line {outcome.line}: " if outcome.line is not None else ""
    return (
        f"{where}{row_label} {outcome.row_index} ({outcome.row_sha256}) rejected as {outcome.reason}: "
        f"{outcome.detail}"
    )


def select_rows(
    outcomes: Iterable[RowOutcome],
    policy: str,
    *,
    row_label: str = "SFT row",
    empty: str | None = None,
    tally: RowTally | None = None,
) -> tuple[list[TokenizedRow], list[dict], int]:
    """Apply `fail`/`skip` to row outcomes in order: (kept rows, rejected entries, rows read).

    `row_label` names a row in messages (`SFT row 3`, `SFT validation row 3`); `empty` is the
    message's lead when no row is kept (400); `tally`, when given, counts kept rows per format
    and truncations."""
    if policy not in POLICIES:
        raise invalid_request(f"invalid_row_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    rows: list[TokenizedRow] = []
    rejected: list[dict] = []
    read = 0
    for outcome in outcomes:
        read += 1
        if outcome.kept:
            rows.append(outcome.tokenized)
            if tally is not None:
                tally.add(outcome)
            continue
        message = rejection_message(outcome, row_label)
        if policy == "fail":
            raise invalid_request(message)
        log.warning("skipping %s", message)
        entry = {"row_index": outcome.row_index, "row_sha256": outcome.row_sha256, "reason": outcome.reason}
        if outcome.line is not None:
            entry["line"] = outcome.line
        rejected.append(entry)
    if not rows:
        raise invalid_request(
            f"{empty or 'SFT corpus contains no trainable rows'}: read {read} row(s), rejected "
            f"{len(rejected)} (invalid_row_policy {policy})"
        )
    return rows, rejected, read


def apply_invalid_row_policy(
    outcomes: Iterable[RowOutcome],
    policy: str,
    source: str,
    source_locator: str | None,
    *,
    blank_lines: int | None = None,
) -> IngestionResult:
    """Apply `fail`/`skip` to row outcomes in order and build the receipt.

    docs/ingestion.md#invalid-row-policy. `blank_lines` defaults to what an `OutcomeStream`
    counted (0 for inline rows). The receipt's `row_counts` is left out when it would say only
    "every row is `messages`, no blank line, nothing truncated", so such a corpus keeps the
    receipt (and the receipt digest checkpoints bind) it had before row formats existed.
    """
    if policy not in POLICIES:
        raise invalid_request(f"invalid_row_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if source not in SOURCES:
        raise ValueError(f"unknown SFT source {source!r}")
    tally = RowTally()
    rows, rejected, read = select_rows(outcomes, policy, tally=tally)
    if blank_lines is None:
        blank_lines = outcomes.blank_lines if isinstance(outcomes, OutcomeStream) else 0
    counts = {
        "blank_lines": blank_lines,
        "rows_per_format": dict(sorted(tally.rows_per_format.items())),
        "rows_skipped": len(rejected),
        "rows_truncated": tally.rows_truncated,
        "tokens_dropped": tally.tokens_dropped,
    }
    plain = set(tally.rows_per_format) == {MESSAGES} and not blank_lines and not tally.rows_truncated
    receipt = build_ingestion_receipt(
        source,
        source_locator,
        policy,
        read,
        [r.row_sha256 for r in rows],
        rejected,
        row_counts=None if plain else counts,
    )
    return ingestion_result(receipt, rows)


def ingestion_result(receipt: dict, rows: list[TokenizedRow]) -> IngestionResult:
    """An `IngestionResult` of `rows` under `receipt`, with the rows' length statistics."""
    return IngestionResult(receipt=receipt, rows=rows, **TokenStats.of(rows).to_dict())


def ingest_examples(
    examples: list,
    *,
    tokenizer,
    template: ChatTemplate | None = None,
    policy: str = "fail",
    source: str = "inline",
    source_locator: str | None = None,
    timings: IngestionTimings | None = None,
    limit: LengthRule | None = None,
) -> IngestionResult:
    """Ingest inline examples (request `examples`, or rows another source already holds as objects)."""
    if not isinstance(examples, list):
        raise invalid_request("examples must be an array of example objects")
    outcomes = iter_example_outcomes(
        examples, tokenizer=tokenizer, template=template, timings=timings, limit=limit
    )
    return apply_invalid_row_policy(outcomes, policy, source, source_locator)


def ingest_jsonl(
    path: Path,
    *,
    tokenizer,
    template: ChatTemplate | None = None,
    policy: str = "fail",
    source: str = "dataset_path",
    source_locator: str | None = None,
    timings: IngestionTimings | None = None,
    limit: LengthRule | None = None,
) -> IngestionResult:
    """Ingest a JSONL file (already resolved with `resolve_dataset_path` when it came from a request).

    `source_locator` is what the receipt names (the request's `dataset_path`); default: the path.
    """
    locator = source_locator if source_locator is not None else str(path)
    outcomes = iter_jsonl_outcomes(path, tokenizer=tokenizer, template=template, timings=timings, limit=limit)
    try:
        return apply_invalid_row_policy(outcomes, policy, source, locator)
    except OSError as exc:
        raise invalid_request(f"cannot read dataset {locator!r}: {exc.strerror or exc}") from None
