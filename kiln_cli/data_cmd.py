"""`kiln data inspect FILE.jsonl`: see exactly what SFT ingestion would train on, row by row.

Every non-blank row is shown, whatever the policy: its rendering with the supervised spans
highlighted (ANSI colour on a terminal, `⟦…⟧` otherwise), token and supervised-token counts, its
row hash, or its rejection. The invalid-row policy is then applied as the server would
(docs/ingestion.md#invalid-row-policy): under `fail` any rejected row makes the command exit 1;
under `skip` it exits 1 only when no row remains. `--json` prints one object per row and the ingestion receipt
(or the error envelope) as the final line; every line is ASCII JSON, so no character inside a row
(U+2028, U+0085, ...) can split a line for a JSON Lines reader.

Row text is shown as data, never as terminal input: control characters other than newline and
tab (ESC, CR, backspace, C1 controls, DEL), line/paragraph separators and bidirectional-override
characters are printed as `\\xNN` / `\\uNNNN` escapes, so a row cannot recolour, clear, overwrite
or reorder what the terminal shows (and click, which strips ANSI sequences when stdout is not a
terminal, cannot hide them either).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import click

from kiln_train.data.chat_template import (
    load_model_chat_template,
    select_training_template,
    training_template,
)
from kiln_train.data.ingestion import LengthRule, RowOutcome, apply_invalid_row_policy, iter_jsonl_outcomes
from kiln_train.data.ingestion_receipt import POLICIES
from kiln_train.data.inspect import row_facts
from kiln_train.data.packaged_tokenizer import cached_tokenizer
from kiln_train.data.tokenizer import load_tokenizer
from kiln_train.errors import KilnError

OPEN_BRACKET, CLOSE_BRACKET = "⟦", "⟧"
# C0 controls except tab and newline, DEL, C1 controls, zero-width/bidi formatting that reorders or
# hides text, line/paragraph separators, and the span markers' noncharacters.
_INVISIBLE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufdd0\ufdd1]"
)

_SHORT_ESCAPES = {"\r": "\\r", "\x0b": "\\v", "\x0c": "\\f", "\x08": "\\b", "\x00": "\\0"}


def visible(text: str) -> str:
    """`text` with every character that would act on the terminal written as an escape."""

    def escape(match: re.Match) -> str:
        char = match.group()
        if char in _SHORT_ESCAPES:
            return _SHORT_ESCAPES[char]
        code = ord(char)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _INVISIBLE.sub(escape, text)


def load_model_text_stack(model: Path | None):
    """(tokenizer, training template) for a model directory, or the packaged Qwen3.5 ones."""
    if model is None:
        return cached_tokenizer(), training_template()
    tokenizer = load_tokenizer(model)
    chat_template = load_model_chat_template(model)
    if chat_template is None:
        click.echo(f"kiln: {model} has no chat template; using the Qwen3.5 training template", err=True)
        return tokenizer, training_template()
    return tokenizer, select_training_template(chat_template)


def highlight(text: str, spans, color: bool) -> str:
    """The rendering with supervised character spans marked."""
    out, pos = [], 0
    for a, b in spans:
        out.append(visible(text[pos:a]))
        segment = visible(text[a:b])
        out.append(
            click.style(segment, fg="green", bold=True) if color else OPEN_BRACKET + segment + CLOSE_BRACKET
        )
        pos = b
    out.append(visible(text[pos:]))
    return "".join(out)


def echo_row(outcome: RowOutcome, color: bool) -> None:
    if outcome.kept:
        row = outcome.tokenized
        status = f"kept  tokens {row.seq_len}  supervised {row.supervised_tokens}"
    else:
        status = f"REJECTED {outcome.reason}: {visible(outcome.detail or '')}"
        if color:
            status = click.style(status, fg="red", bold=True)
    where = f"  line {outcome.line}" if outcome.line is not None else ""
    fmt = f"  {outcome.format}" if outcome.format else ""
    click.echo(f"── row {outcome.row_index}{where}{fmt}  {outcome.row_sha256}  {status}")
    if outcome.conversion and outcome.format != "messages":
        click.echo(f"   converted: {outcome.conversion}")
    if outcome.rendered is not None:
        shown = highlight(outcome.rendered.text, outcome.rendered.spans, color)
        click.echo(shown, nl=not shown.endswith("\n"))


def register(cli: click.Group) -> None:
    @cli.group("data")
    def data_group() -> None:
        """Inspect SFT data the way ingestion sees it."""

    @data_group.command("inspect")
    @click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option(
        "--model",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="Model (or tokenizer) directory; default: the packaged Qwen3.5 tokenizer.",
    )
    @click.option("--policy", type=click.Choice(POLICIES), default="fail", show_default=True)
    @click.option("--json", "as_json", is_flag=True, help="One JSON object per row, then the receipt.")
    @click.option(
        "--max-length", type=click.IntRange(min=2), help="Longest row in tokens, as config.max_length."
    )
    @click.option(
        "--truncation",
        type=click.Choice(["error", "right"]),
        default="error",
        show_default=True,
        help="A row over --max-length: too_long, or cut (as config.truncation).",
    )
    def inspect(
        file: Path, model: Path | None, policy: str, as_json: bool, max_length: int | None, truncation: str
    ) -> None:
        """Render, tokenize and label every row of FILE.jsonl; report kept and rejected rows."""
        try:
            tokenizer, template = load_model_text_stack(model)
        except (KilnError, FileNotFoundError) as exc:
            click.echo(f"kiln: {getattr(exc, 'message', exc)}", err=True)
            sys.exit(2)
        logging.getLogger("kiln_train.data.ingestion").setLevel(logging.ERROR)  # rows are shown below
        try:
            limit = LengthRule.of(max_length, truncation)
            stream = iter_jsonl_outcomes(file, tokenizer=tokenizer, template=template, limit=limit)
            outcomes = list(stream)
        except OSError as exc:
            click.echo(f"kiln: cannot read {file}: {exc.strerror or exc}", err=True)
            sys.exit(2)
        color = not as_json and sys.stdout.isatty()
        for outcome in outcomes:
            if as_json:
                click.echo(json.dumps(row_facts(outcome)))
            else:
                echo_row(outcome, color)
        try:
            result = apply_invalid_row_policy(
                outcomes, policy, "dataset_path", str(file), blank_lines=stream.blank_lines
            )
        except KilnError as exc:
            if as_json:
                click.echo(json.dumps(exc.envelope()))
            else:
                click.echo(f"── {visible(exc.message)}")
            sys.exit(1)
        if as_json:
            click.echo(json.dumps(result.receipt))
            return
        receipt = result.receipt
        click.echo(
            f"── {receipt['rows_read']} row(s) read, {receipt['rows_kept']} kept, {receipt['rows_rejected']} rejected "
            f"(policy {policy}); tokens {result.total_tokens}, supervised {result.total_supervised_tokens}, "
            f"longest {result.max_seq_len}"
        )
        click.echo(f"── kept corpus {receipt['kept_corpus_sha256']}")
