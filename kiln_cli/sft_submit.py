"""Submitting an SFT job from the command line: the request's config from the flags, the rows of
a local JSONL file, the canary prompts file, and the wait for the job to finish. The CLI sends
`training_profile` explicitly; `--adapter-smoke-prompts-file` loads a JSON string array or one
text prompt (docs/configuration.md#cli-flags).

The JSONL rule is the server's (kiln_train.data.ingestion): lines split on LF, ASCII whitespace
stripped, blank lines are not rows. Rows travel inline as parsed JSON objects.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from kiln_cli.client_view import TERMINAL_STATES, ProgressLine
from kiln_cli.http_client import EXIT_USAGE, ApiClient, ApiError, ApiUnreachable, quote_segment
from kiln_train.sft_config import TRAINING_PROFILE

EXIT_INTERRUPTED = 130
# A poll that cannot reach the api is retried this long (an api restart) before giving up.
UNREACHABLE_GRACE_S = 30.0
ASCII_WHITESPACE = b" \t\n\x0c\r"  # Rust's u8::is_ascii_whitespace, as the server strips


class InputError(click.ClickException):
    """Bad local input (a data or prompts file): exit 2, nothing was sent."""

    exit_code = EXIT_USAGE


# option name -> SftConfig field; only options the user gave are sent (server defaults otherwise).
CONFIG_FIELDS = {
    "epochs": "epochs",
    "rank": "lora_rank",
    "alpha": "lora_alpha",
    "learning_rate": "learning_rate",
    "seed": "seed",
    "checkpoint_interval": "checkpoint_interval",
    "resume_checkpoint": "resume_checkpoint",
    "output_name": "output_name",
    "base_adapter": "base_adapter",
    "invalid_row_policy": "invalid_row_policy",
    "max_length": "max_length",
    "truncation": "truncation",
    "grad_checkpoint_segments": "grad_checkpoint_segments",
    "allow_high_lora_scale": "allow_high_lora_scale",
    "detect_anomaly": "detect_anomaly",
    "adapter_smoke_test": "adapter_smoke_test",
}


def sft_config(options: dict[str, Any]) -> dict[str, Any]:
    """The request's `config`: the profile, always explicit (docs/training-profile.md#the-profile), then the
    given options."""
    config: dict[str, Any] = {"training_profile": TRAINING_PROFILE}
    for option, field_name in CONFIG_FIELDS.items():
        if options.get(option) is not None:
            config[field_name] = options[option]
    if options.get("optimizer") is not None:
        config["optimizer"] = {"kind": options["optimizer"]}
    return config


# The server's refusal of alpha/rank above its limit (kiln_train/sft_config.py: SftConfig).
UNSAFE_SCALE = "unsafe LoRA scaling"


@contextmanager
def scale_notes(options: dict[str, Any]) -> Iterator[None]:
    """A refused LoRA scale after `--rank` alone says why: alpha stayed the server's default."""
    try:
        yield
    except ApiError as err:
        rank = options.get("rank")
        if UNSAFE_SCALE in err.message and rank is not None and options.get("alpha") is None:
            err.notes.append(
                f"--rank {rank} without --alpha keeps the server's default lora_alpha; pass --alpha "
                f"{2 * rank} (2 x rank, the usual choice) or --allow-high-lora-scale"
            )
        raise


def read_examples(path: Path, policy: str | None, flag: str = "--data") -> tuple[list[dict], list[int]]:
    """The JSONL file's rows as parsed objects, and each row's line number. A line that is not a
    JSON object cannot travel inline (the server's skip policy needs the raw line to hash it)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{flag} {path}: {exc.strerror or exc}") from None
    rows: list[dict] = []
    lines: list[int] = []
    bad: list[str] = []
    for number, line in nonblank_lines(raw):
        try:
            value = json.loads(line.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError) as exc:
            bad.append(f"line {number}: not valid JSON: {exc}")
            continue
        if not isinstance(value, dict):
            bad.append(f"line {number}: not a JSON object")
            continue
        rows.append(value)
        lines.append(number)
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        if policy == "skip":
            raise InputError(
                f"{path}: {len(bad)} line(s) are not JSON objects ({shown}). Rows sent inline must be JSON "
                "objects, so the server cannot apply invalid_row_policy=skip to these lines; copy the file "
                "into the server's datasets/ directory and submit it with --dataset-path, where the server "
                "skips invalid_json rows and records their hashes."
            )
        raise InputError(f"{path}: {shown} (invalid_row_policy=fail; nothing was sent)")
    if not rows:
        raise InputError(f"{path}: no rows (the file is empty or only blank lines)")
    return rows, lines


def nonblank_lines(raw: bytes) -> Iterator[tuple[int, bytes]]:
    """(line number, stripped line) of every line that is a row: the JSONL rule of ingestion."""
    for number, raw_line in enumerate(raw.split(b"\n"), start=1):
        line = raw_line.strip(ASCII_WHITESPACE)
        if line:
            yield number, line


def row_lines(path: Path) -> list[int]:
    """The file line of each row of a JSONL file (row n is `row_lines(path)[n - 1]`)."""
    try:
        return [number for number, _ in nonblank_lines(path.read_bytes())]
    except OSError:
        return []


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def read_smoke_prompts(path: Path) -> list[str]:
    """`--adapter-smoke-prompts-file`: a JSON array of strings, or the whole file as one prompt."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--adapter-smoke-prompts-file {path}: {exc}") from None
    stripped = text.strip()
    if not stripped:
        raise InputError(f"--adapter-smoke-prompts-file {path} is empty; write one prompt or a JSON array")
    if stripped.startswith("["):
        try:
            value = json.loads(stripped)
        except ValueError as exc:
            raise InputError(
                f"--adapter-smoke-prompts-file {path} starts with '[' but is not JSON: {exc}"
            ) from None
        if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
            raise InputError(f"--adapter-smoke-prompts-file {path} must be a JSON array of strings")
        return value
    try:
        value = json.loads(stripped)
    except ValueError:
        value = None
    if isinstance(value, str):  # a JSON string literal is that one prompt, unquoted
        return [value]
    return [text.rstrip("\r\n")]


def annotate_rows(
    err: ApiError,
    lines: list[int],
    path: Path,
    validation_lines: list[int] | None = None,
    validation_path: Path | None = None,
) -> None:
    """Name the file line behind a row the server refers to (`examples[i]`, `SFT row n`, and for
    held-out rows sent with --validation-data `validation.examples[i]`, `SFT validation row n`)."""
    err.notes.extend(row_notes(err.message, lines, path))
    if validation_lines and validation_path is not None:
        err.notes.extend(validation_row_notes(err.message, validation_lines, validation_path))


# (pattern, label, the number of the first row) of each way the server names a row: `examples[i]`
# counts from 0, `SFT row n` from 1. A held-out row (`validation.examples[i]`) is no training row.
TRAINING_ROW_NAMES = (
    (r"(?<!validation\.)examples\[(\d+)\]", "examples[{}]", 0),
    (r"SFT row (\d+)", "SFT row {}", 1),
)
VALIDATION_ROW_NAMES = (
    (r"validation\.examples\[(\d+)\]", "validation.examples[{}]", 0),
    (r"SFT validation row (\d+)", "SFT validation row {}", 1),
)


def row_notes(message: str, lines: list[int], path: Path) -> list[str]:
    """`examples[i] is line L of FILE` / `SFT row n is line L of FILE` for each row `message` names
    (a held-out row, `validation.examples[i]`, is not a training row)."""
    return _line_notes(message, lines, path, TRAINING_ROW_NAMES)


def validation_row_notes(message: str, lines: list[int], path: Path) -> list[str]:
    """The same for the held-out rows of --validation-data: `validation.examples[i]` and
    `SFT validation row n`."""
    return _line_notes(message, lines, path, VALIDATION_ROW_NAMES)


def _line_notes(
    message: str, lines: list[int], path: Path, names: tuple[tuple[str, str, int], ...]
) -> list[str]:
    notes = []
    for pattern, label, first in names:
        for match in re.finditer(pattern, message):
            number = int(match.group(1))
            if 0 <= number - first < len(lines):
                notes.append(f"{label.format(number)} is line {lines[number - first]} of {path}")
    return notes


def validation_body(
    validation_data: str | None,
    holdout_percent: int | None,
    interval: int | None,
    *,
    as_dataset_path: bool,
    policy: str | None,
) -> tuple[dict[str, Any] | None, list[int]]:
    """The request's `validation` from --validation-data / --holdout-percent /
    --validation-interval (None without either), and the validation file's row lines."""
    if validation_data is not None and holdout_percent is not None:
        raise click.UsageError("give --validation-data or --holdout-percent, not both")
    if validation_data is None and holdout_percent is None:
        if interval is not None:
            raise click.UsageError("--validation-interval needs --validation-data or --holdout-percent")
        return None, []
    lines: list[int] = []
    if holdout_percent is not None:
        body: dict[str, Any] = {"holdout_percent": holdout_percent}
    elif as_dataset_path:
        body = {"dataset_path": validation_data}
    else:
        examples, lines = read_examples(Path(validation_data), policy, "--validation-data")
        body = {"examples": examples}
    if interval is not None:
        body["interval_steps"] = interval
    return body, lines


def wait_for_job(client: ApiClient, admission: dict, interval: float) -> dict:
    """Poll the job's status about every `interval` seconds until it is terminal, drawing the
    progress line on stderr. Ctrl-C stops waiting (the job keeps running) and exits 130."""
    job_id = admission["job_id"]
    progress = ProgressLine(rows_kept=admission.get("rows_kept") or 0)
    path = f"/v1/train/status/{quote_segment(job_id)}"
    unreachable_since: float | None = None
    try:
        while True:
            try:
                status = client.get(path)
            except ApiUnreachable:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > UNREACHABLE_GRACE_S:
                    progress.finish()
                    raise
                time.sleep(interval)
                continue
            unreachable_since = None
            progress.show(status)
            if status["state"] in TERMINAL_STATES:
                progress.finish()
                return status
            time.sleep(interval)
    except KeyboardInterrupt:
        progress.finish()
        click.echo(f"\nstopped waiting; job {job_id} keeps going on the server.", err=True)
        click.echo(f"  cancel it:  kiln jobs cancel {job_id}", err=True)
        click.echo(f"  follow it:  kiln jobs events {job_id} --follow", err=True)
        sys.exit(EXIT_INTERRUPTED)
