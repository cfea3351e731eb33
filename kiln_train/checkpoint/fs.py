"""Reading checkpoint files safely: tree listing, size-capped reads and hashing of regular files.

Every checkpoint file must be a regular, non-symlink file with exactly one link
(docs/checkpoints.md#publication): a symlink or a hard link could let another path change a
checkpoint after its digest was taken. Files are opened with `O_NOFOLLOW` and checked with `fstat`
on the same descriptor, so a swap between check and read is caught. Linux/POSIX. Writing files
durably and renaming without replacing are `kiln_train/ground/durable_files.py`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

from kiln_train.checkpoint.errors import CheckpointError

_CHUNK = 1 << 20


def list_tree(root: Path, what: str) -> list[str]:
    """Every non-directory entry under `root` as a `/`-joined relative path, sorted.

    A symlink (to a file or a directory) or a special file anywhere in the tree is rejected.
    """
    found: list[str] = []
    pending = [(root, "")]
    while pending:
        directory, prefix = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                rel = f"{prefix}{entry.name}"
                if entry.is_symlink():
                    raise CheckpointError(
                        f"{what}: {rel!r} is a symlink; checkpoint files must be regular files"
                    )
                if entry.is_dir(follow_symlinks=False):
                    pending.append((Path(entry.path), f"{rel}/"))
                elif entry.is_file(follow_symlinks=False):
                    found.append(rel)
                else:
                    raise CheckpointError(f"{what}: {rel!r} is not a regular file")
    return sorted(found)


def _open_regular(path: Path, rel: str, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{what}: {rel!r} is missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(
                f"{what}: {rel!r} is a symlink; checkpoint files must be regular files"
            ) from None
        raise CheckpointError(f"{what}: cannot open {rel!r}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{what}: {rel!r} is not a regular file")
    if st.st_nlink != 1:
        os.close(fd)
        raise CheckpointError(
            f"{what}: {rel!r} has {st.st_nlink} hard links; checkpoint files must not be hard-linked"
        )
    return fd


def read_regular_file(path: Path, rel: str, what: str, *, max_bytes: int | None = None) -> bytes:
    """The bytes of a regular, single-link, non-symlink file (optionally size-capped)."""
    fd = _open_regular(path, rel, what)
    try:
        size = os.fstat(fd).st_size
        if max_bytes is not None and size > max_bytes:
            raise CheckpointError(f"{what}: {rel!r} is {size} bytes, above the {max_bytes} byte limit")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)


def hash_regular_file(path: Path, rel: str, what: str) -> tuple[int, str]:
    """(size in bytes, lowercase hex SHA-256) of a regular, single-link, non-symlink file."""
    fd = _open_regular(path, rel, what)
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    finally:
        os.close(fd)
    return size, digest.hexdigest()
