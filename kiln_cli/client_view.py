"""What the client commands print: tables, key/value blocks, the live progress line, and the
receipt summary of a finished job (the api's response shapes in, text out).

Torch-free and server-free: every function takes the decoded JSON the api returned.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import click

# TrainingStatus.state on the wire (docs/ARCHITECTURE.md#job-states).
JOB_STATES = ("queued", "running", "completed", "failed")
TERMINAL_STATES = ("completed", "failed")

BAR_WIDTH = 24
# Without a terminal (a log file, CI) the progress line is printed as whole lines, at most this
# often unless the job's state changes.
LOG_LINE_PERIOD_S = 5.0


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2))


def echo_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    for row in (tuple(headers), *rows):
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def echo_pairs(pairs: Sequence[tuple[str, str]], indent: str = "  ", err: bool = False) -> None:
    width = max((len(k) for k, _ in pairs), default=0)
    for key, value in pairs:
        click.echo(f"{indent}{key:<{width}}  {value}", err=err)


def format_loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def format_progress(status: dict) -> str:
    total = status.get("total_steps") or 0
    step = status.get("global_step") or 0
    return f"{step}/{total} {100 * (status.get('progress') or 0.0):.0f}%"


def format_unix_ms(ms: int | None) -> str:
    if ms is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_bytes(count: int | None) -> str:
    if count is None:
        return "-"
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def epoch_of(step: int, total: int, rows_kept: int) -> tuple[int, int] | None:
    """(current epoch, epochs) from the step counter: steps = epochs x rows kept
    (docs/training-profile.md#update-rule)."""
    if rows_kept <= 0 or total <= 0:
        return None
    epochs = max(1, total // rows_kept)
    return (epochs if step >= total else min(epochs, step // rows_kept + 1)), epochs


class ProgressLine:
    """The live progress line on stderr: bar, step/total, epoch, loss, elapsed. Redrawn in place
    on a terminal; printed as throttled whole lines otherwise."""

    def __init__(self, rows_kept: int, live: bool | None = None) -> None:
        self.rows_kept = rows_kept
        self.live = sys.stderr.isatty() if live is None else live
        self.started = time.monotonic()
        self.width = 0
        self.last_state: str | None = None
        self.last_moved = ""
        self.last_printed = 0.0
        self.evaluations_shown: set[int] = set()  # global steps whose validation line was printed

    def render(self, status: dict) -> tuple[str, str]:
        """(what changed, the line): the first part leaves out the clock, so a log gets a new
        line only when the job moved."""
        state = status["state"]
        if state == "queued":
            position = status.get("queue_position")
            where = f"queued (position {position})" if position else "queued"
            return where, f"{where}, waiting {format_seconds(time.monotonic() - self.started)}"
        step, total = status.get("global_step") or 0, status.get("total_steps") or 0
        filled = int(BAR_WIDTH * min(1.0, step / total)) if total else 0
        parts = [f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] step {step}/{total}"]
        epoch = epoch_of(step, total, self.rows_kept)
        if epoch is not None:
            parts.append(f"epoch {epoch[0]}/{epoch[1]}")
        parts.append(f"loss {format_loss(status.get('current_loss'))}")
        history = status.get("validation_history") or []
        if history:
            parts.append(f"val {format_loss(history[-1].get('loss'))}")
        moved = "  ".join(parts)
        clock = format_seconds(status.get("elapsed_secs"))
        return moved, f"{moved}  {clock}" + ("" if state == "running" else f"  {state}")

    def show(self, status: dict) -> None:
        for evaluation in status.get("validation_history") or []:
            step = evaluation.get("global_step")
            if step in self.evaluations_shown:
                continue
            self.evaluations_shown.add(step)
            text = validation_line(evaluation)
            if self.live:
                text = "\r" + text + " " * max(0, self.width - len(text))
                self.width = 0
            click.echo(text, err=True)
        moved, line = self.render(status)
        if self.live:
            padding = " " * max(0, self.width - len(line))
            click.echo(f"\r{line}{padding}", nl=False, err=True)
            self.width = len(line)
            return
        now = time.monotonic()
        changed_state = status["state"] != self.last_state
        if changed_state or (moved != self.last_moved and now - self.last_printed >= LOG_LINE_PERIOD_S):
            click.echo(line, err=True)
            self.last_printed = now
            self.last_moved = moved
        self.last_state = status["state"]

    def finish(self) -> None:
        if self.live and self.width:
            click.echo("", err=True)
            self.width = 0


def validation_line(evaluation: dict) -> str:
    """One evaluation of the held-out validation rows, as the progress prints it."""
    step = evaluation.get("global_step")
    where = "baseline (base model)" if step == 0 else f"step {step}, epoch {evaluation.get('epoch')}"
    accuracy = evaluation.get("token_accuracy")
    return f"validation at {where}: loss {format_loss(evaluation.get('loss'))}, token accuracy " + (
        "-" if accuracy is None else f"{accuracy:.4f}"
    )


# ----- admissions, jobs, receipts -----------------------------------------------------------


def model_text(model: dict) -> str:
    """The model a job trains on; a random checkpoint Kiln drew says so."""
    random = model.get("random_init")
    if random:
        return (
            f"{model['path']} (a random {random.get('preset')} checkpoint: the mechanics, not a useful model)"
        )
    return str(model["path"])


def describe_admission(admission: dict, replayed: bool) -> None:
    header = f"job {admission['job_id']} {admission['state']}"
    click.echo(header + (" (Idempotency-Key replay of an earlier identical request)" if replayed else ""))
    segments = admission.get("grad_checkpoint_segments")
    echo_pairs(
        [
            ("effective seed", str(admission["effective_seed"])),
            ("rows", f"{admission['rows_kept']} kept, {admission['rows_rejected']} rejected"),
            (
                "steps",
                f"{admission['total_steps']}"
                + (f" ({segments} gradient-checkpoint segment(s))" if segments else ""),
            ),
            ("memory estimate", f"{admission['memory_estimate_gb']:g} GiB"),
            *([("model", model_text(admission["model"]))] if admission.get("model") else []),
        ]
    )
    if admission.get("message"):
        click.echo(f"  {admission['message']}")


def describe_preflight(plan: dict) -> None:
    """`kiln train sft --dry-run`: the plan the submission would be admitted with."""
    click.echo(f"preflight: {plan['message']}")
    drawn = set(plan.get("drawn") or [])
    config = plan.get("effective_config") or {}
    memory = plan["memory"]
    echo_pairs(
        [
            (
                "rows",
                f"{plan['rows_kept']} kept, {plan['rows_rejected']} rejected (of {plan['rows_read']} read)",
            ),
            ("steps", f"{plan['total_steps']} ({plan['epochs']} epoch(s))"),
            (
                "segments",
                f"{plan['grad_checkpoint_segments']} gradient-checkpoint segment(s)"
                + (" (planned)" if plan.get("auto_segments") else ""),
            ),
            ("tokens", f"{plan['total_tokens']} (supervised {plan['total_supervised_tokens']})"),
            ("learning rate", f"{plan['learning_rate']:g}"),
            ("seed", "drawn at submission" if "seed" in drawn else str(config.get("seed"))),
            (
                "memory estimate",
                f"{format_bytes(memory['estimate_bytes'])} of {format_bytes(memory['available_bytes'])} available",
            ),
            ("largest rank that fits", str(plan["max_lora_rank_that_fits"])),
        ]
    )
    for row in plan.get("rejected_rows") or []:
        where = f" at line {row['line']}" if row.get("line") is not None else ""
        click.echo(f"  rejected row {row['row_index']}{where} ({row['row_sha256']}): {row['reason']}")
    validation = plan.get("validation")
    if validation:
        source = validation["source"]
        if source == "holdout":
            source = f"holdout {validation.get('holdout_percent')}% of the submitted rows"
        echo_pairs(
            [
                (
                    "validation",
                    f"{source}: {validation['rows_kept']} row(s) kept, {validation['rows_rejected']} rejected, "
                    f"{validation['total_supervised_tokens']} supervised token(s)",
                ),
                (
                    "evaluations",
                    f"{validation['evaluations']}"
                    + (
                        f" (every {validation['interval_steps']} step(s) and every epoch's end)"
                        if validation.get("interval_steps")
                        else " (the baseline and every epoch's end)"
                    ),
                ),
                ("validation memory", format_bytes(validation["memory"]["estimate_bytes"])),
            ]
        )
        for row in validation.get("rejected_rows") or []:
            click.echo(f"  rejected validation row {row['row_index']} ({row['row_sha256']}): {row['reason']}")


def receipt_summary(detail: dict) -> list[tuple[str, str]]:
    """The receipt's headline figures (docs/artifacts.md#train-receipt): what a finished run did and cost."""
    receipt = detail.get("train_receipt")
    if not isinstance(receipt, dict):
        return []
    hyper = receipt.get("hyperparameters") or {}
    runtime = receipt.get("runtime") or {}
    tokens = receipt.get("token_counts") or {}
    wall_ms = runtime.get("wall_clock_ms")
    pairs = [
        ("status", str(receipt.get("status"))),
        ("final loss", format_loss(detail.get("current_loss"))),
        ("steps", f"{detail.get('global_step')}/{detail.get('total_steps')}"),
        (
            "learning rate",
            f"{hyper.get('learning_rate'):g}" if hyper.get("learning_rate") is not None else "-",
        ),
        ("seed", str(hyper.get("seed", "-"))),
        ("rank / alpha", f"{hyper.get('rank')} / {hyper.get('alpha')}"),
        ("loss route", str(runtime.get("sft_loss_route") or "-")),
        ("wall clock", "-" if wall_ms is None else f"{wall_ms / 1000:.1f} s"),
        ("peak memory", format_bytes(runtime.get("peak_memory_bytes"))),
        ("supervised tokens", str(tokens.get("action_tokens", "-"))),
        ("canary", canary_summary(receipt.get("adapter_smoke_test"))),
    ]
    validation = receipt.get("validation")
    if isinstance(validation, dict) and validation.get("evaluations"):
        pairs.append(("validation", validation_summary(validation["evaluations"], validation.get("best"))))
    if receipt.get("failure_reason"):
        pairs.insert(1, ("failure reason", str(receipt["failure_reason"])))
    return pairs


def validation_summary(evaluations: list[dict], best: dict | None = None) -> str:
    """First and last validation loss and token accuracy, and the best evaluation."""
    first, last = evaluations[0], evaluations[-1]
    text = (
        f"loss {format_loss(first.get('loss'))} -> {format_loss(last.get('loss'))}, token accuracy "
        f"{first.get('token_accuracy', 0):.4f} -> {last.get('token_accuracy', 0):.4f}"
    )
    if best:
        text += f", best {format_loss(best.get('loss'))} at step {best.get('global_step')}"
    return text + f" ({len(evaluations)} evaluation(s))"


def canary_summary(smoke: Any) -> str:
    if not isinstance(smoke, dict) or not smoke.get("enabled", True):
        return "not run"
    prompts = len(smoke.get("prompts") or [])
    warnings = smoke.get("warnings") or []
    verdict = "passed" if smoke.get("passed") else "did not pass"
    text = f"{verdict} ({prompts} prompt(s), {len(warnings)} warning(s))"
    return text + "".join(f"\n      - {w}" for w in warnings)


def describe_job(detail: dict, outcome: bool) -> None:
    """`kiln jobs show`, and the end of `kiln train sft` (outcome=True: the failure on stderr)."""
    state = detail["state"]
    failed = state == "failed"
    if outcome and failed:
        click.echo(
            f"job {detail['job_id']} failed: {detail.get('failure_reason') or 'unknown reason'}", err=True
        )
        click.echo(f"  error: {detail.get('error') or '-'}", err=True)
    elif outcome:
        click.echo(f"job {detail['job_id']} {state}")
        if state == "completed":
            echo_pairs(
                [
                    ("adapter", str(detail.get("adapter_name"))),
                    ("adapter path", str(detail.get("adapter_path"))),
                ]
            )
    else:
        echo_pairs(job_pairs(detail), indent="")
    summary = receipt_summary(detail)
    if summary:
        click.echo("receipt:")
        echo_pairs(summary)


def describe_local_run(outcome: dict) -> None:
    """The end of `kiln train local` (`TrainResult.to_dict()`): the adapter and its checkpoints,
    or the failure on stderr; then the receipt summary."""
    checkpoints = [c["basename"] for c in outcome.get("checkpoints") or []]
    if outcome["status"] == "success":
        click.echo(f"adapter {outcome['adapter_name']} published")
        pairs = [("adapter path", str(outcome["adapter_path"]))]
    else:
        click.echo(f"run failed: {outcome.get('failure_reason') or 'unknown reason'}", err=True)
        click.echo(f"  error: {outcome.get('failure_message') or '-'}", err=True)
        pairs = [("failed receipt", str(outcome["receipt_path"]))]
    if checkpoints:
        pairs.append(("checkpoints", f"{len(checkpoints)} (latest {checkpoints[-1]})"))
    echo_pairs(pairs)
    summary = receipt_summary(
        {
            "train_receipt": outcome.get("receipt"),
            "current_loss": outcome.get("final_loss"),
            "global_step": outcome.get("global_step"),
            "total_steps": outcome.get("total_steps"),
        }
    )
    if summary:
        click.echo("receipt:")
        echo_pairs(summary)


def job_pairs(detail: dict) -> list[tuple[str, str]]:
    # The detail's own `epoch` is the trainer's 0-based epoch index; show the 1-based count.
    data = detail.get("training_data") or {}
    epoch = None
    if detail["state"] != "queued":
        epoch = epoch_of(
            detail.get("global_step") or 0, detail.get("total_steps") or 0, data.get("rows") or 0
        )
    pairs = [
        ("job", detail["job_id"]),
        (
            "state",
            detail["state"]
            + (f" (queue position {detail['queue_position']})" if detail.get("queue_position") else ""),
        ),
        ("adapter", detail.get("adapter_name") or "-"),
        ("progress", format_progress(detail) + (f", epoch {epoch[0]}/{epoch[1]}" if epoch else "")),
        ("loss", format_loss(detail.get("current_loss"))),
        ("seed", str(detail.get("effective_seed"))),
        ("submitted", format_unix_ms(detail.get("submitted_unix_ms"))),
        ("finished", format_unix_ms(detail.get("finished_unix_ms"))),
        ("elapsed", format_seconds(detail.get("elapsed_secs"))),
    ]
    if detail.get("model"):
        pairs.append(("model", model_text(detail["model"])))
    if data:
        where = data.get("dataset_path") or "inline"
        pairs.append(
            ("data", f"{where}: {data.get('rows')} row(s) kept, {data.get('rows_rejected') or 0} rejected")
        )
    if detail["state"] == "failed":
        pairs.append(("failure", f"{detail.get('failure_reason') or '-'}: {detail.get('error') or '-'}"))
    if detail.get("adapter_path"):
        pairs.append(("adapter path", detail["adapter_path"]))
    checkpoint = detail.get("latest_checkpoint")
    if checkpoint:
        pairs.append(
            (
                "checkpoint",
                f"{checkpoint['resume_checkpoint']} (step {checkpoint['global_step']}/{checkpoint['total_steps']})",
            )
        )
    elif detail.get("checkpoint_error"):
        pairs.append(("checkpoint", f"unreadable: {detail['checkpoint_error']}"))
    evaluations = detail.get("validation_history") or []
    if evaluations:
        best = min(evaluations, key=lambda e: e["loss"])
        pairs.append(("validation curve", validation_summary(evaluations, best)))
    losses = [p["loss"] for p in detail.get("loss_history") or []]
    if losses:
        pairs.append(
            (
                "loss curve",
                f"{losses[0]:.4f} -> {losses[-1]:.4f} (min {min(losses):.4f}, {len(losses)} samples)",
            )
        )
    return pairs
