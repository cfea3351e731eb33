"""HTTP client commands: `kiln train sft`, `kiln jobs list|show|cancel|events|delete`,
`kiln adapters list|download|delete` (routes: docs/ARCHITECTURE.md#routes; flags:
docs/configuration.md#cli-flags).

Every command talks to a running api (kiln_cli.http_client). Human tables by default, JSON with
`--json`. The connection options and the printing of errors and exit statuses live in
kiln_cli.client_connection.

Torch-free at import (the `kiln` command imports every command module).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from kiln_cli.client_connection import with_client
from kiln_cli.client_view import (
    JOB_STATES,
    TERMINAL_STATES,
    describe_admission,
    describe_job,
    describe_preflight,
    echo_table,
    emit_json,
    format_bytes,
    format_loss,
    format_progress,
    format_unix_ms,
)
from kiln_cli.http_client import (
    EXIT_API_ERROR,
    ApiClient,
    ApiError,
    download_archive,
    extract_archive,
    quote_segment,
)
from kiln_cli.rejected_rows import names_a_rejected_row, rejected_row_notes
from kiln_cli.sft_submit import (
    EXIT_INTERRUPTED,
    annotate_rows,
    read_examples,
    read_smoke_prompts,
    scale_notes,
    sft_config,
    validation_body,
    wait_for_job,
)
from kiln_train.optim.kinds import optimizer_kinds

# Admission tokenizes every row inside the request (the server allows it 300 s).
SUBMIT_TIMEOUT_S = 330.0
EVENT_PAGE = 100
REPLAY_HEADER = "Idempotent-Replayed"
PREFLIGHT_PATH = "/v1/train/sft/preflight"


def register(cli: click.Group) -> None:
    register_train(_group(cli, "train", "Submit training jobs to a running api."))
    register_jobs(_group(cli, "jobs", "Inspect, follow and cancel training jobs."))
    register_adapters(_group(cli, "adapters", "List, download and delete published adapters."))


def _group(cli: click.Group, name: str, help_text: str) -> click.Group:
    existing = cli.commands.get(name)
    if isinstance(existing, click.Group):
        return existing
    group = click.Group(name, help=help_text)
    cli.add_command(group)
    return group


# ----- kiln train sft -----------------------------------------------------------------------


def finite_float(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter("must be a finite number")
    return value


def json_option(help_text: str = "Print JSON instead of text.") -> Callable:
    return click.option("--json", "as_json", is_flag=True, help=help_text)


def apply_options(options: tuple[Callable, ...]) -> Callable:
    """Apply click option decorators in the order written (the first is listed first in --help)."""

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


# The request's config fields; `sft_config` turns the given ones into the body's `config`.
SFT_CONFIG_OPTIONS = (
    click.option("--epochs", type=int, help="Passes over the data (server default 3)."),
    click.option("--rank", type=int, help="LoRA rank (lora_rank)."),
    click.option("--alpha", type=float, callback=finite_float, help="LoRA alpha (lora_alpha)."),
    click.option("--optimizer", type=click.Choice(optimizer_kinds()), help="Optimizer kind (its defaults)."),
    click.option("--learning-rate", type=float, callback=finite_float, help="Constant learning rate."),
    click.option("--seed", type=int, help="u64 seed (the server draws one when omitted)."),
    click.option("--checkpoint-interval", type=int, help="Exact checkpoint every N steps."),
    click.option("--resume-checkpoint", metavar="NAME", help="Resume from this exact checkpoint."),
    click.option("--output-name", metavar="NAME", help="Adapter name (auto when omitted)."),
    click.option("--base-adapter", metavar="NAME", help="Warm-start from this PEFT adapter's weights."),
    click.option("--invalid-row-policy", type=click.Choice(["fail", "skip"]), help="What a bad row does."),
    click.option("--max-length", type=int, help="Longest row in tokens (none by default)."),
    click.option(
        "--truncation",
        type=click.Choice(["error", "right"]),
        help="A row over --max-length: error (too_long, default) or right (cut it).",
    ),
    click.option("--grad-checkpoint-segments", type=int, help="Gradient checkpoint segments."),
    click.option("--allow-high-lora-scale", is_flag=True, default=None, help="Allow alpha/rank > 2."),
    click.option("--detect-anomaly", is_flag=True, default=None, help="Scan every backward op for NaN/Inf."),
    click.option("--adapter-smoke-test", is_flag=True, default=None, help="Run base-vs-adapter canaries."),
)


def validation_options(how_sent: str) -> tuple[Callable, ...]:
    """--validation-data, --holdout-percent and --validation-interval; `how_sent` ends the first
    option's help (how the command reads the file)."""
    return (
        click.option(
            "--validation-data",
            metavar="FILE.jsonl",
            help="Held-out conversations, evaluated (never trained on) before the first update, at every "
            f"epoch's end and every --validation-interval steps; {how_sent}",
        ),
        click.option(
            "--holdout-percent",
            type=int,
            metavar="P",
            help="Hold out P percent (1..50) of --data's rows as validation rows (a split seeded by the run's seed).",
        ),
        click.option(
            "--validation-interval",
            type=int,
            metavar="N",
            help="Also evaluate the validation rows every N steps.",
        ),
    )


@click.command("sft")
@click.option("--data", required=True, metavar="FILE.jsonl", help="Conversations, one JSON object per line.")
@click.option(
    "--dataset-path",
    "as_dataset_path",
    is_flag=True,
    help="Send --data as the server-local dataset_path (relative to the server's datasets/ "
    "directory) instead of uploading its rows.",
)
@apply_options(SFT_CONFIG_OPTIONS)
@click.option(
    "--adapter-smoke-prompts-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Canary prompts: a JSON string array, or the file as one prompt.",
)
@apply_options(
    validation_options("sent inline, or with --dataset-path as a server-local validation dataset_path.")
)
@click.option("--idempotency-key", metavar="KEY", help="Resubmitting with the same key never double-admits.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Run the whole admission (preflight) and print the plan; nothing is queued.",
)
@click.option("--no-wait", is_flag=True, help="Print the admission and return.")
@click.option("--poll-interval", type=float, default=1.0, hidden=True)
@json_option()
@with_client
def train_sft(
    client: ApiClient,
    data: str,
    as_dataset_path: bool,
    adapter_smoke_prompts_file: Path | None,
    validation_data: str | None,
    holdout_percent: int | None,
    validation_interval: int | None,
    idempotency_key: str | None,
    dry_run: bool,
    no_wait: bool,
    poll_interval: float,
    as_json: bool,
    **options: Any,
) -> None:
    """Submit a native SFT job (training_profile native_online_lora_v1) and follow it to its
    adapter and receipt."""
    config = sft_config(options)
    if adapter_smoke_prompts_file is not None:
        config["adapter_smoke_prompts"] = read_smoke_prompts(adapter_smoke_prompts_file)
    lines: list[int] = []
    if as_dataset_path:
        body: dict[str, Any] = {"dataset_path": data, "config": config}
    else:
        examples, lines = read_examples(Path(data), options.get("invalid_row_policy"))
        body = {"examples": examples, "config": config}
    validation, validation_lines = validation_body(
        validation_data,
        holdout_percent,
        validation_interval,
        as_dataset_path=as_dataset_path,
        policy=options.get("invalid_row_policy"),
    )
    if validation is not None:
        body["validation"] = validation
    with (
        scale_notes(options),
        rows_named_in_errors(
            lines, Path(data), validation_lines, Path(validation_data) if validation_data else None, client
        ),
    ):
        if dry_run:
            show_preflight(client, body, as_json)
            return
        admission = submit_sft(client, body, idempotency_key, as_json)
    if no_wait:
        if as_json:
            emit_json(admission)
        else:
            click.echo(f"follow it: kiln jobs events {admission['job_id']} --follow")
        return
    follow_to_outcome(client, admission, poll_interval, as_json)


def register_train(train: click.Group) -> None:
    train.add_command(train_sft)


@contextmanager
def rows_named_in_errors(
    lines: list[int],
    data: Path,
    validation_lines: list[int] | None = None,
    validation: Path | None = None,
    client: ApiClient | None = None,
) -> Iterator[None]:
    """An error envelope that names row indexes gets the local file's line numbers added; with
    the `client`, a refused row of the local file brings the list of all its rejected rows."""
    try:
        yield
    except ApiError as err:
        annotate_rows(err, lines, data, validation_lines, validation)
        if client is not None and lines and names_a_rejected_row(err.message):
            err.notes.extend(rejected_row_notes(client, data, lines))
        raise


def show_preflight(client: ApiClient, body: dict[str, Any], as_json: bool) -> None:
    plan = client.request("POST", PREFLIGHT_PATH, body=body, timeout=SUBMIT_TIMEOUT_S).body
    if as_json:
        emit_json(plan)
    else:
        describe_preflight(plan)


def submit_sft(client: ApiClient, body: dict[str, Any], idempotency_key: str | None, as_json: bool) -> dict:
    """POST the submission and describe the admission (a replay says so); returns its body."""
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else None
    try:
        reply = client.request("POST", "/v1/train/sft", body=body, headers=headers, timeout=SUBMIT_TIMEOUT_S)
    except KeyboardInterrupt:
        click.echo(
            "\nkiln: interrupted before the server answered; the job may still have been admitted: "
            "see `kiln jobs list`"
            + (
                " (resubmitting with the same --idempotency-key never admits it twice)"
                if idempotency_key
                else ""
            ),
            err=True,
        )
        sys.exit(EXIT_INTERRUPTED)
    admission = reply.body
    if not as_json:
        replayed = reply.headers.get(REPLAY_HEADER) == "true"
        describe_admission(admission, replayed)
    return admission


def follow_to_outcome(client: ApiClient, admission: dict, poll_interval: float, as_json: bool) -> None:
    """Wait for the admitted job to finish, print its outcome; exit 1 unless it completed."""
    wait_for_job(client, admission, poll_interval)
    detail = client.get(f"/v1/train/jobs/{quote_segment(admission['job_id'])}")
    if as_json:
        emit_json({"admission": admission, "job": detail})
    else:
        describe_job(detail, outcome=True)
    if detail["state"] != "completed":
        sys.exit(EXIT_API_ERROR)


# ----- kiln jobs ----------------------------------------------------------------------------


def job_command(name: str, json_help: str = "Print JSON instead of text.") -> Callable:
    """`kiln jobs NAME JOB_ID [--json]`, talking to the api."""

    def decorate(command: Callable) -> click.Command:
        return click.command(name)(click.argument("job_id")(json_option(json_help)(with_client(command))))

    return decorate


@click.command("list")
@click.option("--state", type=click.Choice(JOB_STATES), help="Only jobs in this state.")
@json_option("Print JSON instead of a table.")
@with_client
def jobs_list(client: ApiClient, state: str | None, as_json: bool) -> None:
    """Every retained job, oldest first."""
    rows = [j for j in client.get("/v1/train/status") if state is None or j["state"] == state]
    if as_json:
        emit_json(rows)
        return
    echo_table(
        ("ID", "STATE", "ADAPTER", "PROGRESS", "LOSS", "SUBMITTED"),
        [
            (
                j["job_id"],
                j["state"],
                j.get("adapter_name") or "-",
                format_progress(j),
                format_loss(j.get("current_loss")),
                format_unix_ms(j.get("submitted_unix_ms")),
            )
            for j in rows
        ],
    )


@job_command("show", "Print the full TrainingJobDetail JSON.")
def jobs_show(client: ApiClient, job_id: str, as_json: bool) -> None:
    """One job: status, data, loss curve, latest checkpoint and receipt summary."""
    detail = client.get(f"/v1/train/jobs/{quote_segment(job_id)}")
    if as_json:
        emit_json(detail)
    else:
        describe_job(detail, outcome=False)


@job_command("cancel")
def jobs_cancel(client: ApiClient, job_id: str, as_json: bool) -> None:
    """Cancel a job: a queued one ends at once, a running one at its next step boundary."""
    answer = client.delete(f"/v1/train/queue/{quote_segment(job_id)}")
    if as_json:
        emit_json(answer)
    elif answer["status"] == "cancelled":
        click.echo(f"job {answer['job_id']} cancelled")
    else:
        click.echo(f"job {answer['job_id']} cancelling: {answer.get('message') or ''}".rstrip(": "))


@job_command("delete")
def jobs_delete(client: ApiClient, job_id: str, as_json: bool) -> None:
    """Delete a finished job from the job list (its history rows stay for SQL)."""
    answer = client.delete(f"/v1/train/jobs/{quote_segment(job_id)}")
    if as_json:
        emit_json(answer)
    else:
        click.echo(f"job {answer['job_id']} deleted")


@click.command("events")
@click.argument("job_id")
@click.option("--follow", is_flag=True, help="Keep polling until the job is finished.")
@click.option("--poll-interval", type=float, default=1.0, hidden=True)
@json_option("Print one JSON object per event (JSON Lines).")
@with_client
def jobs_events(client: ApiClient, job_id: str, follow: bool, poll_interval: float, as_json: bool) -> None:
    """The job's events, oldest first (cursor-paged with `after`)."""

    def show(event: dict) -> None:
        if as_json:
            click.echo(json.dumps(event))
        else:
            click.echo(f"{event['created_at']}  {event['level']:<7}  {event['kind']:<16}  {event['message']}")

    try:
        follow_events(client, job_id, show, follow, poll_interval)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


def register_jobs(jobs: click.Group) -> None:
    for command in (jobs_list, jobs_show, jobs_cancel, jobs_delete, jobs_events):
        jobs.add_command(command)


def follow_events(
    client: ApiClient, job_id: str, show: Callable[[dict], None], follow: bool, interval: float
) -> None:
    """Print every event after the cursor; with `follow`, until the job is terminal (and its last
    events are drained)."""
    segment = quote_segment(job_id)
    cursor: int | None = None
    finished = False
    while True:
        while True:
            page = client.get(f"/v1/train/jobs/{segment}/events", {"after": cursor, "limit": EVENT_PAGE})
            for event in page["data"]:
                show(event)
            if page["last_id"] is not None:
                cursor = page["last_id"]
            if not page["has_more"]:
                break
        if not follow or finished:
            return
        finished = client.get(f"/v1/train/status/{segment}")["state"] in TERMINAL_STATES
        if not finished:
            time.sleep(interval)


# ----- kiln adapters ------------------------------------------------------------------------


def register_adapters(adapters: click.Group) -> None:
    @adapters.command("list")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    @with_client
    def adapters_list(client: ApiClient, as_json: bool) -> None:
        """Published adapters with their size, shape and exact checkpoints."""
        listing = client.get("/v1/adapters")["adapters"]
        if as_json:
            emit_json(listing)
            return
        echo_table(
            ("NAME", "RANK", "ALPHA", "SIZE", "CREATED", "JOB", "CHECKPOINTS"),
            [
                (
                    a["name"],
                    str(a["rank"]),
                    f"{a['alpha']:g}",
                    format_bytes(a["size_bytes"]),
                    a["created_at"],
                    a.get("job_id") or "-",
                    str(len(a.get("checkpoints") or [])),
                )
                for a in listing
            ],
        )

    @adapters.command("download")
    @click.argument("name")
    @click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Archive path.")
    @click.option(
        "--extract", type=click.Path(file_okay=False, path_type=Path), help="Unpack into DIR/NAME/."
    )
    @click.option("--force", is_flag=True, help="Overwrite an existing output archive.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
    @with_client
    def adapters_download(
        client: ApiClient, name: str, output: Path | None, extract: Path | None, force: bool, as_json: bool
    ) -> None:
        """Download an adapter as NAME.tar.gz (or -o OUT.tar.gz), or unpack it with --extract DIR."""
        if output is not None and extract is not None:
            raise click.UsageError("pass either -o/--output or --extract, not both")
        path = f"/v1/adapters/{quote_segment(name)}/download"
        if extract is not None:
            target, files = extract_archive(client, path, name, extract)
            result = {"name": name, "extracted_to": str(target), "files": files}
            message = f"adapter {name} extracted to {target} ({len(files)} files)"
        else:
            target = output if output is not None else Path(f"{name}.tar.gz")
            size = download_archive(client, path, target, force)
            result = {"name": name, "archive": str(target), "bytes": size}
            message = f"adapter {name} saved to {target} ({format_bytes(size)})"
        if as_json:
            emit_json(result)
        else:
            click.echo(message)

    @adapters.command("delete")
    @click.argument("name")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
    @with_client
    def adapters_delete(client: ApiClient, name: str, as_json: bool) -> None:
        """Delete an idle adapter and its exact checkpoints (no prompt)."""
        answer = client.delete(f"/v1/adapters/{quote_segment(name)}")
        if as_json:
            emit_json(answer)
            return
        removed = answer.get("removed_checkpoints") or []
        click.echo(
            f"adapter {answer['name']} deleted" + (f" with {len(removed)} checkpoint(s)" if removed else "")
        )
        for checkpoint in removed:
            click.echo(f"  removed {checkpoint}")
