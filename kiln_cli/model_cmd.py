"""`kiln model init-tiny OUT_DIR`: write a tiny random Qwen3.5 checkpoint (kiln_train/tiny.py).

Torch is imported only when the command runs, so `kiln --help` stays fast.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import click

PRESET_NAMES = ("tiny", "small")


def register(cli: click.Group) -> None:
    @cli.group("model")
    def model_group() -> None:
        """Build and inspect Qwen3.5 model directories."""

    @model_group.command("init-tiny")
    @click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
    @click.option("--preset", type=click.Choice(PRESET_NAMES), default="tiny", show_default=True)
    @click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=0, show_default=True)
    @click.option(
        "--chat-template",
        "chat_template",
        type=click.Choice(("think", "nothink")),
        default="think",
        show_default=True,
        help="The official template the checkpoint ships: think (Qwen3.5-4B and larger) or nothink (2B and smaller).",
    )
    @click.option(
        "--if-missing",
        is_flag=True,
        help="Do nothing (exit 0) when OUT_DIR already holds a checkpoint (container start-up).",
    )
    def init_tiny(out_dir: Path, preset: str, seed: int, chat_template: str, if_missing: bool) -> None:
        """Write a complete random Qwen3.5 checkpoint (config, weights incl. mtp.*, tokenizer, template)."""
        from kiln_train.data.packaged_tokenizer import cached_tokenizer, io_reason, is_io_error
        from kiln_train.errors import KilnError
        from kiln_train.model.config import load_config
        from kiln_train.model.tiny import write_tiny_checkpoint

        if if_missing and (out_dir / "config.json").is_file():
            try:
                load_config(out_dir)  # an existing directory must still be a Qwen3.5 checkpoint
            except (KilnError, OSError, ValueError) as exc:
                raise click.UsageError(
                    f"{out_dir} holds a config.json that is not a usable Qwen3.5 checkpoint "
                    f"({getattr(exc, 'message', None) or exc}); remove the directory or choose another"
                ) from None
            click.echo(f"{out_dir} already holds a checkpoint; nothing to do")
            return
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise click.UsageError(f"{out_dir} already exists and is not an empty directory")
        # Build in a sibling staging directory and rename, so a failure leaves nothing behind.
        staging: Path | None = None
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
            write_tiny_checkpoint(
                staging, preset, seed, tokenizer=cached_tokenizer(), chat_template=chat_template
            )
            staging.chmod(0o755)  # mkdtemp makes it owner-only; a model directory is shared
            if out_dir.exists():
                out_dir.rmdir()
            staging.rename(out_dir)
        except Exception as exc:
            if not is_io_error(exc):
                raise
            click.echo(f"kiln: cannot write a checkpoint to {out_dir}: {io_reason(exc)}", err=True)
            sys.exit(2)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        config = load_config(out_dir)
        click.echo(
            f"wrote {preset} Qwen3.5 checkpoint to {out_dir} (seed {seed}, "
            f"{config.base_parameter_count():,} trunk parameters, {config.num_hidden_layers} layers)"
        )
        for path in sorted(out_dir.iterdir()):
            click.echo(f"  {path.name} ({path.stat().st_size} bytes)")
