"""SFT ingestion: rows in, tokenized rows and the `kiln.sft-ingestion.v1` receipt out (docs/ingestion.md).

Every transport reaches one path: parse -> row identity -> role checks -> render (training
template) -> tokenize -> assistant-only labels -> row checks. No truncation, packing, splitting or
dedup, ever: one accepted row is one conversation is one sequence.

Transports:
- inline `examples` (`ingest_examples`): objects from the request body. An example that cannot
  be deserialised as an SFT example is a transport error (400 `training_invalid_request` naming
  the field), never a skippable row -- `invalid_json` exists for JSONL only (docs/ingestion.md#transports).
- server-local JSONL (`ingest_jsonl`, path from `resolve_dataset_path`): split on `\\n`, strip
  ASCII whitespace (space, tab, LF, FF, CR); an empty result is a blank line: ignored, not a row,
  not counted. Every other line is one row, numbered from 1. A row must be UTF-8 JSON text as
  serde_json reads it: a line that is not UTF-8, starts with a byte-order mark (only ASCII
  whitespace is trimmed, so a BOM left by an editor makes row 1 `invalid_json`, with a detail that
  says so), repeats a key inside an object, or nests deeper than 127 arrays/objects is
  `invalid_json` (`conversation.decode_json`). The last line needs no newline; lines of any
  length are read whole (nothing is ever truncated).

Rejection reasons, in contract order: `invalid_json`, `empty_messages`, `invalid_role`,
`tokenization_error` (template failure, span-marker collision, undecodable tool arguments,
non-text content, a tool result that answers no call, an empty function name, output the template
would drop (`function_call`, `refusal`), fewer than 2 tokens, or no supervised token at a position
>= 1; the rules Kiln adds where the contract is silent are listed in `conversation`'s docstring).

Policies: `fail` (the first rejected row rejects the submission: `training_invalid_request`,
"SFT row <n> (<row_sha256>) rejected as <reason>: <detail>") and `skip` (rejected rows are
recorded and logged; at least one row must remain). The receipt lives in `ingestion_receipt`;
reading the transports (and the dataset path rule) in `ingestion_sources`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln_train.data.chat_template import (
    ChatTemplate,
    RenderedConversation,
    TemplateRenderError,
    training_template,
)
from kiln_train.data.conversation import (
    INVALID_JSON,
    TOKENIZATION_ERROR,
    RowRejection,
    RowSchemaError,
    check_roles,
    prepare_for_template,
)
from kiln_train.data.ingestion_receipt import (
    INGESTION_SCHEMA,
    POLICIES,
    SOURCES,
    build_ingestion_receipt,
    validate_ingestion_receipt,
)
from kiln_train.data.ingestion_sources import (
    SourceRow,
    example_rows,
    jsonl_rows,
    parse_row,
    resolve_dataset_path,
)
from kiln_train.data.labels import MASK_CONTRACT, label_encoding
from kiln_train.data.row_identity import (
    PARSED_ROW_DOMAIN,
    domain_digest,
    kept_corpus_sha256,
    parsed_row_sha256,
    raw_row_sha256,
)
from kiln_train.errors import invalid_request

log = logging.getLogger(__name__)

CHUNK_ROWS = 256  # rows rendered, then tokenized together with encode_batch

__all__ = [
    "INGESTION_SCHEMA",
    "MASK_CONTRACT",
    "IngestionResult",
    "IngestionTimings",
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
class TokenizedRow:
    """One accepted row: token ids and aligned labels (-100 where not supervised)."""

    row_index: int
    row_sha256: str
    input_ids: list[int]
    labels: list[int]
    supervised_tokens: int  # supervised targets at positions >= 1

    @property
    def seq_len(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class RowOutcome:
    """What happened to one non-blank row: `tokenized` when kept, `reason`/`detail` when rejected."""

    row_index: int
    row_sha256: str
    tokenized: TokenizedRow | None = None
    rendered: RenderedConversation | None = None
    reason: str | None = None
    detail: str | None = None

    @property
    def kept(self) -> bool:
        return self.tokenized is not None


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


@dataclass
class IngestionTimings:
    """Seconds spent per stage (pass one in to measure; the benchmark prints it)."""

    parse_hash: float = 0.0
    render: float = 0.0
    tokenize: float = 0.0
    label: float = 0.0


# --------------------------------------------------------------------------- the row pipeline


@dataclass
class _Pending:
    row_index: int
    row_sha256: str
    rendered: RenderedConversation


def _front(row: SourceRow, template: ChatTemplate, t: IngestionTimings):
    """Parse, hash, check and render one row: a RowOutcome (rejected) or a _Pending (rendered)."""
    t0 = time.perf_counter()
    if row.parse_error is not None:
        t.parse_hash += time.perf_counter() - t0
        return RowOutcome(row.row_index, raw_row_sha256(row.raw), reason=INVALID_JSON, detail=row.parse_error)
    try:
        parsed, canonical, unrenderable = row.parsed if row.parsed is not None else parse_row(row.obj)
    except RowSchemaError as exc:
        t.parse_hash += time.perf_counter() - t0
        return RowOutcome(row.row_index, raw_row_sha256(row.raw), reason=INVALID_JSON, detail=exc.detail)
    row_sha = domain_digest(PARSED_ROW_DOMAIN, canonical.encode("utf-8"))
    try:
        check_roles(parsed)
        if unrenderable is not None:
            raise RowRejection(TOKENIZATION_ERROR, unrenderable)
        conversation = prepare_for_template(parsed, canonical)
    except RowRejection as exc:
        t.parse_hash += time.perf_counter() - t0
        return RowOutcome(row.row_index, row_sha, reason=exc.reason, detail=exc.detail)
    t1 = time.perf_counter()
    t.parse_hash += t1 - t0
    try:
        rendered = template.render(conversation.messages, conversation.tools)
    except TemplateRenderError as exc:
        t.render += time.perf_counter() - t1
        return RowOutcome(row.row_index, row_sha, reason=TOKENIZATION_ERROR, detail=f"chat template: {exc}")
    t.render += time.perf_counter() - t1
    return _Pending(row.row_index, row_sha, rendered)


def _encode_all(tokenizer, texts: list[str]) -> list:
    """Encodings of `texts`, batched; a text the tokenizer refuses gets its error message instead.

    The normaliser keeps text the tokenizer cannot take out of rendering, so the per-row retry is a
    backstop: one row must never take down the rows batched with it (a tokenizer failure is that
    row's `tokenization_error`, docs/ingestion.md#validation).
    """
    try:
        return tokenizer.encode_batch(texts, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - retried row by row below, each failure named
        pass
    out: list = []
    for text in texts:
        try:
            (enc,) = tokenizer.encode_batch([text], add_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - a tokenizer failure is the row's rejection
            enc = f"{type(exc).__name__}: {exc}"
        out.append(enc)
    return out


def _back(pending: list[_Pending], tokenizer, t: IngestionTimings) -> list[RowOutcome]:
    """Tokenize rendered rows together, label them and apply the token-level row checks."""
    if not pending:
        return []
    t0 = time.perf_counter()
    encodings = _encode_all(tokenizer, [p.rendered.text for p in pending])
    t1 = time.perf_counter()
    t.tokenize += t1 - t0
    out = []
    for p, enc in zip(pending, encodings, strict=True):
        if isinstance(enc, str):
            problem: str | None = f"tokenizer: {enc}"
        elif len(enc.ids) < 2:
            problem = f"the rendered conversation has {len(enc.ids)} token(s); at least 2 are required"
        else:
            problem = None
        if problem is not None:
            out.append(
                RowOutcome(
                    p.row_index, p.row_sha256, rendered=p.rendered, reason=TOKENIZATION_ERROR, detail=problem
                )
            )
            continue
        ids = enc.ids
        labels = label_encoding(enc, p.rendered.spans)
        if labels.supervised_tokens == 0:
            out.append(
                RowOutcome(
                    p.row_index,
                    p.row_sha256,
                    rendered=p.rendered,
                    reason=TOKENIZATION_ERROR,
                    detail="no supervised assistant token at a position >= 1 (nothing to learn after the causal shift)",
                )
            )
            continue
        row = TokenizedRow(p.row_index, p.row_sha256, ids, labels.labels, labels.supervised_tokens)
        out.append(RowOutcome(p.row_index, p.row_sha256, tokenized=row, rendered=p.rendered))
    t.label += time.perf_counter() - t1
    return out


def _outcomes(
    rows: Iterable[SourceRow],
    tokenizer,
    template: ChatTemplate | None,
    timings: IngestionTimings,
) -> Iterator[RowOutcome]:
    template = template or training_template()
    chunk: list[RowOutcome | _Pending] = []

    def flush() -> list[RowOutcome]:
        pending = [c for c in chunk if isinstance(c, _Pending)]
        done = iter(_back(pending, tokenizer, timings))
        return [next(done) if isinstance(c, _Pending) else c for c in chunk]

    for row in rows:
        chunk.append(_front(row, template, timings))
        if len(chunk) >= CHUNK_ROWS:
            yield from flush()
            chunk = []
    yield from flush()


def iter_example_outcomes(
    examples: list,
    *,
    tokenizer,
    template: ChatTemplate | None = None,
    timings: IngestionTimings | None = None,
    field: str = "examples",
) -> Iterator[RowOutcome]:
    """Every inline example's outcome in order (no policy applied).

    Raises `training_invalid_request` at once when any example cannot be deserialised, naming it
    as `<field>[<index>]`.
    """
    timings = timings or IngestionTimings()
    t0 = time.perf_counter()
    rows = example_rows(list(examples), field)
    timings.parse_hash += time.perf_counter() - t0
    return _outcomes(rows, tokenizer, template, timings)


def iter_jsonl_outcomes(
    path: Path, *, tokenizer, template: ChatTemplate | None = None, timings: IngestionTimings | None = None
) -> Iterator[RowOutcome]:
    """Every non-blank JSONL row's outcome in order (no policy applied)."""
    return _outcomes(jsonl_rows(Path(path)), tokenizer, template, timings or IngestionTimings())


# --------------------------------------------------------------------------- policy and receipt


def select_rows(
    outcomes: Iterable[RowOutcome], policy: str, *, row_label: str = "SFT row", empty: str | None = None
) -> tuple[list[TokenizedRow], list[dict], int]:
    """Apply `fail`/`skip` to row outcomes in order: (kept rows, rejected entries, rows read).

    `row_label` names a row in messages (`SFT row 3`, `SFT validation row 3`); `empty` is the
    message's lead when no row is kept (400)."""
    if policy not in POLICIES:
        raise invalid_request(f"invalid_row_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    rows: list[TokenizedRow] = []
    rejected: list[dict] = []
    read = 0
    for outcome in outcomes:
        read += 1
        if outcome.kept:
            rows.append(outcome.tokenized)
            continue
        message = (
            f"{row_label} {outcome.row_index} ({outcome.row_sha256}) rejected as {outcome.reason}: "
            f"{outcome.detail}"
        )
        if policy == "fail":
            raise invalid_request(message)
        log.warning("skipping %s", message)
        rejected.append(
            {"row_index": outcome.row_index, "row_sha256": outcome.row_sha256, "reason": outcome.reason}
        )
    if not rows:
        raise invalid_request(
            f"{empty or 'SFT corpus contains no trainable rows'}: read {read} row(s), rejected "
            f"{len(rejected)} (invalid_row_policy {policy})"
        )
    return rows, rejected, read


def apply_invalid_row_policy(
    outcomes: Iterable[RowOutcome], policy: str, source: str, source_locator: str | None
) -> IngestionResult:
    """Apply `fail`/`skip` to row outcomes in order and build the receipt.

    docs/ingestion.md#invalid-row-policy.
    """
    if policy not in POLICIES:
        raise invalid_request(f"invalid_row_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if source not in SOURCES:
        raise ValueError(f"unknown SFT source {source!r}")
    rows, rejected, read = select_rows(outcomes, policy)
    receipt = build_ingestion_receipt(
        source, source_locator, policy, read, [r.row_sha256 for r in rows], rejected
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
) -> IngestionResult:
    """Ingest inline examples (request `examples`, or rows another source already holds as objects)."""
    if not isinstance(examples, list):
        raise invalid_request("examples must be an array of example objects")
    outcomes = iter_example_outcomes(examples, tokenizer=tokenizer, template=template, timings=timings)
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
) -> IngestionResult:
    """Ingest a JSONL file (already resolved with `resolve_dataset_path` when it came from a request).

    `source_locator` is what the receipt names (the request's `dataset_path`); default: the path.
    """
    locator = source_locator if source_locator is not None else str(path)
    outcomes = iter_jsonl_outcomes(path, tokenizer=tokenizer, template=template, timings=timings)
    try:
        return apply_invalid_row_policy(outcomes, policy, source, locator)
    except OSError as exc:
        raise invalid_request(f"cannot read dataset {locator!r}: {exc.strerror or exc}") from None
