"""`kiln train local`: train an adapter in this process, with no api and no worker
(docs/library.md#the-command).

It takes the config flags of `kiln train sft` (the same `config`), ingests `--data` the way the
server ingests a `dataset_path` file, and calls `kiln_train.finetune`, which makes the checks of a
submission, trains and publishes into `--output`. The progress line and the receipt summary are
those of `kiln train sft`. Exit status: 0 when the adapter is published; 1 when the run is
refused (the error's code, message and hint on stderr, as the server would answer) or fails (its
failure reason; the failed receipt stays in `--output`); 2 for bad usage; 130 on Ctrl-C (the
first Ctrl-C during training stops at the next step and writes a checkpoint to resume from).

Torch is imported only when the command runs.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from kiln_cli.client_cmd import SFT_CONFIG_OPTIONS, apply_options, json_option, validation_options
from kiln_cli.client_view import ProgressLine, describe_local_run, emit_json
from kiln_cli.http_client import EXIT_API_ERROR
from kiln_cli.sft_submit import (
    EXIT_INTERRUPTED,
    read_smoke_prompts,
    row_lines,
    row_notes,
    sft_config,
    validation_body,
    validation_row_notes,
)
from kiln_train.errors import KilnError
from kiln_train.sft_config import SftConfig, parse_sft_config


def register(cli: click.Group) -> None:
    train = cli.commands.get("train")
    if not isinstance(train, click.Group):
        raise RuntimeError("kiln_cli.client_cmd registers the `train` group before this module")
    train.add_command(train_local)


@click.command("local")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Hugging Face Qwen3.5 checkpoint directory (e.g. from `kiln model init-tiny`).",
)
@click.option(
    "--data",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    metavar="FILE.jsonl",
    help="Conversations, one JSON object per line.",
)
@click.option(
    "--output",
    "output_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Adapter registry directory: the adapter, its checkpoints and failed receipts go here.",
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@apply_options(SFT_CONFIG_OPTIONS)
@click.option(
    "--adapter-smoke-prompts-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Canary prompts: a JSON string array, or the file as one prompt.",
)
@apply_options(validation_options("read here like --data."))
@json_option("Print the run's result (with its receipt) as JSON instead of text.")
def train_local(
    model_dir: Path,
    data: Path,
    output_dir: Path,
    device: str,
    adapter_smoke_prompts_file: Path | None,
    validation_data: str | None,
    holdout_percent: int | None,
    validation_interval: int | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Train a native SFT adapter here, with no server: the checks of a submission, then the
    run, then the adapter, its receipt and checkpoints in --output."""
    body = sft_config(options)
    if adapter_smoke_prompts_file is not None:
        body["adapter_smoke_prompts"] = read_smoke_prompts(adapter_smoke_prompts_file)
    validation, _ = validation_body(
        validation_data,
        holdout_percent,
        validation_interval,
        as_dataset_path=True,  # finetune reads a validation dataset_path as any JSONL file
        policy=None,
    )
    try:
        config = parse_sft_config(body, field_path=("config",))  # before torch loads
        with stop_on_interrupt() as stop, quiet_library():
            outcome = run_local(model_dir, data, config, output_dir, device, stop, validation)
    except KilnError as exc:
        notes = row_notes(exc.message, row_lines(data), data)
        if validation_data is not None:
            held_out = Path(validation_data)
            notes += validation_row_notes(exc.message, row_lines(held_out), held_out)
        report_refusal(exc, notes)
        sys.exit(EXIT_API_ERROR)
    except KeyboardInterrupt:
        click.echo("\nkiln: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if as_json:
        emit_json(outcome)
    else:
        describe_local_run(outcome)
    if outcome["status"] != "success":
        if stop.requested and outcome.get("failure_reason") == "cancelled":
            checkpoints = outcome.get("checkpoints") or []
            if checkpoints:
                click.echo(f"  resume it:  --resume-checkpoint {checkpoints[-1]['basename']}", err=True)
            sys.exit(EXIT_INTERRUPTED)
        sys.exit(EXIT_API_ERROR)


def run_local(
    model_dir: Path,
    data: Path,
    config: SftConfig,
    output_dir: Path,
    device: str,
    stop: StopRequest,
    validation: dict | None = None,
) -> dict:
    """`finetune` with the progress line on stderr (each validation evaluation on a line of its
    own, as `kiln train sft` prints them); the result as JSON values."""
    from kiln_train import finetune

    click.echo(f"loading {model_dir} on {device} ...", err=True)
    line = ProgressLine(rows_kept=0)
    evaluations: list[dict] = []
    last: dict = {"state": "running", "global_step": 0, "total_steps": 0, "current_loss": None}

    def progress(report) -> None:
        if not stop.training:  # the first step: the clock starts with the training
            stop.training = True
            line.started = time.monotonic() - report.step_ms / 1000
            line.rows_kept = report.total_steps // config.epochs
        last.update(global_step=report.global_step, total_steps=report.total_steps, current_loss=report.loss)
        show()

    def on_evaluation(evaluation) -> None:
        evaluations.append(evaluation.to_json())
        if stop.training:  # the baseline comes before the first step; it shows with that step
            show()

    def show() -> None:
        line.show(
            {**last, "elapsed_secs": time.monotonic() - line.started, "validation_history": evaluations}
        )

    try:
        result = finetune(
            model_dir,
            data,
            config,
            output_dir,
            progress=progress,
            should_stop=stop.is_set,
            device=device,
            validation=validation,
            on_evaluation=on_evaluation,
        )
    finally:
        line.finish()
    return result.to_dict()


class StopRequest:
    """Ctrl-C while training asks the run to stop at its next step (with a checkpoint); before
    the first step, or a second time, it interrupts at once."""

    def __init__(self) -> None:
        self.training = False
        self.requested = False
        self._event = threading.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    def handle(self, signum, frame) -> None:
        if not self.training or self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._event.set()
        click.echo("\nstopping after this step (it writes a checkpoint); Ctrl-C again to abort", err=True)


@contextmanager
def stop_on_interrupt() -> Iterator[StopRequest]:
    stop = StopRequest()
    previous = signal.signal(signal.SIGINT, stop.handle)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def quiet_library() -> Iterator[None]:
    """The library's INFO lines (each checkpoint published) would break the progress line; they
    show with `kiln -v`."""
    logger = logging.getLogger("kiln_train")
    before = logger.level
    if not click.get_current_context().find_root().params.get("verbose"):
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(before)


def report_refusal(exc: KilnError, notes: list[str]) -> None:
    """A refusal as `kiln train sft` prints the server's: code, message, hint, notes."""
    click.echo(f"kiln: {exc.code}: {exc.message}", err=True)
    if exc.hint:
        click.echo(f"  hint: {exc.hint}", err=True)
    for note in notes:
        click.echo(f"  note: {note}", err=True)
