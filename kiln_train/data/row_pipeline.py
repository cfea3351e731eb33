"""The SFT row pipeline: source row -> format conversion -> render -> tokenize -> labels -> row
checks, one `RowOutcome` per non-blank row, in order (docs/ingestion.md).

`ingestion` applies the invalid-row policy to these outcomes and writes the receipt. Rows are
rendered one by one and tokenized `CHUNK_ROWS` at a time with `encode_batch`. The length rule
(`config.max_length`/`config.truncation`, `LengthRule`) is applied to the tokenized row, after
labelling: `"error"` rejects a longer row `too_long`; `"right"` cuts it and rejects it
`answer_truncated` when no supervised target is left after position 0.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln_train.data.chat_template import (
    ChatTemplate,
    RenderedConversation,
    TemplateRenderError,
    training_template,
)
from kiln_train.data.conversation import (
    ANSWER_TRUNCATED,
    EMPTY_OUTPUT,
    INVALID_JSON,
    TOKENIZATION_ERROR,
    TOO_LONG,
    RowRejection,
    RowSchemaError,
)
from kiln_train.data.ingestion_sources import LineCounts, SourceRow, example_rows, jsonl_rows, parse_row
from kiln_train.data.labels import IGNORE_INDEX, build_labels, label_encoding
from kiln_train.data.row_formats import (
    MESSAGES,
    ConvertedRow,
    FormatRejection,
    convert_messages,
    convert_row,
    detect_format,
    given_row_sha256,
    supervised_from_offsets,
)
from kiln_train.data.row_identity import PARSED_ROW_DOMAIN, domain_digest, raw_row_sha256
from kiln_train.data.tokenizer import IM_END as EOS_TEXT

CHUNK_ROWS = 256  # rows rendered, then tokenized together with encode_batch
TRUNCATIONS = ("error", "right")


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
    line: int | None = None  # physical line of a JSONL file (blank lines counted)
    format: str | None = None  # row_formats.FORMATS, once the row's format is known
    conversion: str | None = None  # how the row became a conversation (row_formats)
    dropped_tokens: int = 0  # tokens cut off by `truncation: "right"`

    @property
    def kept(self) -> bool:
        return self.tokenized is not None


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
    source: SourceRow
    converted: ConvertedRow
    rendered: RenderedConversation
    boundary: int | None = None  # raw-text rows: where the completion starts in `rendered.text`


def _rejected(row: SourceRow, sha: str, reason: str, detail: str, fmt: str | None = None, **kw) -> RowOutcome:
    return RowOutcome(row.row_index, sha, reason=reason, detail=detail, line=row.line, format=fmt, **kw)


def _convert(row: SourceRow) -> ConvertedRow | RowOutcome:
    """The row in its format's conversion, or its rejection."""
    if row.parse_error is not None:
        return _rejected(row, raw_row_sha256(row.raw), INVALID_JSON, row.parse_error)
    try:
        fmt = MESSAGES if row.parsed is not None else detect_format(row.obj)
    except RowRejection as exc:
        try:
            return _rejected(row, given_row_sha256(row.obj), exc.reason, exc.detail)
        except RowSchemaError as schema:
            return _rejected(row, raw_row_sha256(row.raw), INVALID_JSON, schema.detail)
    try:
        if fmt != MESSAGES:
            return convert_row(row.obj, fmt)
        parsed, canonical, unrenderable = row.parsed if row.parsed is not None else parse_row(row.obj)
    except FormatRejection as exc:
        return _rejected(row, exc.row_sha256, exc.reason, exc.detail, fmt)
    except RowSchemaError as exc:
        return _rejected(row, raw_row_sha256(row.raw), INVALID_JSON, exc.detail)
    row_sha = domain_digest(PARSED_ROW_DOMAIN, canonical.encode("utf-8"))
    try:
        return convert_messages(parsed, canonical, unrenderable, row_sha)
    except FormatRejection as exc:
        return _rejected(row, row_sha, exc.reason, exc.detail, fmt)


def text_of(converted: ConvertedRow) -> str:
    """The raw text of a plain prompt/completion row: prompt, completion and one EOS (none added
    when the completion already ends with it)."""
    completion = converted.completion
    return converted.prompt + completion + ("" if completion.endswith(EOS_TEXT) else EOS_TEXT)


def _front(row: SourceRow, template: ChatTemplate, t: IngestionTimings):
    """Parse, convert, hash, check and render one row: a RowOutcome (rejected) or a _Pending."""
    t0 = time.perf_counter()
    converted = _convert(row)
    t1 = time.perf_counter()
    t.parse_hash += t1 - t0
    if isinstance(converted, RowOutcome):
        return converted
    if converted.conversation is None:  # raw text: no template, one EOS
        text = text_of(converted)
        boundary = len(converted.prompt)
        return _Pending(row, converted, RenderedConversation(text, ((boundary, len(text)),)), boundary)
    conversation = converted.conversation
    try:
        rendered = template.render(conversation.messages, conversation.tools)
    except TemplateRenderError as exc:
        t.render += time.perf_counter() - t1
        return _rejected(
            row, converted.row_sha256, TOKENIZATION_ERROR, f"chat template: {exc}", converted.format
        )
    t.render += time.perf_counter() - t1
    if converted.context_turns:
        rendered = RenderedConversation(rendered.text, rendered.spans[converted.context_turns :])
    return _Pending(row, converted, rendered)


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


def _back(
    pending: list[_Pending], tokenizer, t: IngestionTimings, limit: LengthRule | None
) -> list[RowOutcome]:
    """Tokenize rendered rows together, label them and apply the token-level row checks."""
    if not pending:
        return []
    t0 = time.perf_counter()
    encodings = _encode_all(tokenizer, [p.rendered.text for p in pending])
    t1 = time.perf_counter()
    t.tokenize += t1 - t0
    out = [_label(p, enc, limit) for p, enc in zip(pending, encodings, strict=True)]
    t.label += time.perf_counter() - t1
    return out


def _label(p: _Pending, enc, limit: LengthRule | None) -> RowOutcome:
    """One tokenized row's outcome: labels, the length rule, the supervision checks."""
    fmt, rendered, sha = p.converted.format, p.rendered, p.converted.row_sha256

    def rejected(reason: str, detail: str) -> RowOutcome:
        return _rejected(
            p.source, sha, reason, detail, fmt, rendered=rendered, conversion=p.converted.conversion
        )

    if isinstance(enc, str):
        return rejected(TOKENIZATION_ERROR, f"tokenizer: {enc}")
    if len(enc.ids) < 2:
        return rejected(
            TOKENIZATION_ERROR,
            f"the rendered conversation has {len(enc.ids)} token(s); at least 2 are required",
        )
    ids = enc.ids
    if p.boundary is None:
        labels = label_encoding(enc, rendered.spans)
    else:
        first = supervised_from_offsets(enc.offsets, p.boundary)
        if first >= len(ids) - 1:  # the last token is the EOS
            return rejected(
                EMPTY_OUTPUT,
                "the completion has no token of its own before the EOS (it is empty or merges into the "
                "prompt's last token, which is not supervised)",
            )
        labels = build_labels(ids, [(first, len(ids))])
        rendered = RenderedConversation(rendered.text, ((enc.offsets[first][0], len(rendered.text)),))
    if labels.supervised_tokens == 0:
        return rejected(
            TOKENIZATION_ERROR,
            "no supervised assistant token at a position >= 1 (nothing to learn after the causal shift)",
        )
    label_ids, dropped, supervised = labels.labels, 0, labels.supervised_tokens
    if limit is not None and len(ids) > limit.max_length:
        if limit.truncation == "error":
            return rejected(
                TOO_LONG,
                f"the row is {len(ids)} tokens; config.max_length is {limit.max_length} "
                '(truncation "error": nothing is shortened; set truncation "right" to cut rows)',
            )
        dropped = len(ids) - limit.max_length
        ids, label_ids = ids[: limit.max_length], label_ids[: limit.max_length]
        supervised = sum(1 for label in label_ids[1:] if label != IGNORE_INDEX)
        if not supervised:
            return rejected(
                ANSWER_TRUNCATED,
                f"cut to config.max_length {limit.max_length} of {len(enc.ids)} tokens, no supervised "
                "token is left after position 0 (the prompt fills the limit)",
            )
    row = TokenizedRow(p.source.row_index, sha, ids, label_ids, supervised)
    return RowOutcome(
        p.source.row_index,
        sha,
        tokenized=row,
        rendered=rendered,
        line=p.source.line,
        format=fmt,
        conversion=p.converted.conversion,
        dropped_tokens=dropped,
    )


@dataclass(frozen=True)
class LengthRule:
    """`config.max_length` and `config.truncation` (docs/ingestion.md#length-limits)."""

    max_length: int
    truncation: str = "error"

    @classmethod
    def of(cls, max_length: int | None, truncation: str | None = None) -> LengthRule | None:
        """The rule for these settings; None when there is no limit."""
        if max_length is None:
            return None
        if truncation not in (None, *TRUNCATIONS):
            raise ValueError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
        return cls(max_length, truncation or "error")

    @classmethod
    def of_config(cls, config) -> LengthRule | None:
        """The rule of an `SftConfig` (anything with `max_length` and `truncation`)."""
        return cls.of(getattr(config, "max_length", None), getattr(config, "truncation", None))


class OutcomeStream:
    """Row outcomes in order, plus what reading the source counted besides rows (`blank_lines`,
    complete once the stream is consumed)."""

    def __init__(self, outcomes: Iterator[RowOutcome], counts: LineCounts) -> None:
        self._outcomes = outcomes
        self.counts = counts

    def __iter__(self) -> Iterator[RowOutcome]:
        return self._outcomes

    def __next__(self) -> RowOutcome:
        return next(self._outcomes)

    @property
    def blank_lines(self) -> int:
        return self.counts.blank_lines


def _outcomes(
    rows: Iterable[SourceRow],
    tokenizer,
    template: ChatTemplate | None,
    timings: IngestionTimings,
    limit: LengthRule | None = None,
) -> Iterator[RowOutcome]:
    template = template or training_template()
    chunk: list[RowOutcome | _Pending] = []

    def flush() -> list[RowOutcome]:
        pending = [c for c in chunk if isinstance(c, _Pending)]
        done = iter(_back(pending, tokenizer, timings, limit))
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
    limit: LengthRule | None = None,
) -> Iterator[RowOutcome]:
    """Every inline example's outcome in order (no policy applied).

    Raises `training_invalid_request` at once when any example cannot be deserialised, naming it
    as `<field>[<index>]`.
    """
    timings = timings or IngestionTimings()
    t0 = time.perf_counter()
    rows = example_rows(list(examples), field)
    timings.parse_hash += time.perf_counter() - t0
    return _outcomes(rows, tokenizer, template, timings, limit)


def iter_jsonl_outcomes(
    path: Path,
    *,
    tokenizer,
    template: ChatTemplate | None = None,
    timings: IngestionTimings | None = None,
    limit: LengthRule | None = None,
) -> OutcomeStream:
    """Every non-blank JSONL row's outcome in order (no policy applied); the stream counts the
    file's blank lines as it reads."""
    counts = LineCounts()
    rows = jsonl_rows(Path(path), counts)
    return OutcomeStream(_outcomes(rows, tokenizer, template, timings or IngestionTimings(), limit), counts)
