"""Filesystem primitives for checkpoints: tree listing, file hashing, fsync, no-replace rename.

Every checkpoint file must be a regular, non-symlink file with exactly one link
(docs/checkpoints.md#publication): a symlink or a hard link could let another path change a
checkpoint after its digest was taken. Files are opened with `O_NOFOLLOW` and checked with `fstat`
on the same descriptor, so a swap between check and read is caught. Linux/POSIX.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import stat
from pathlib import Path

from kiln_train.checkpoint.errors import CheckpointError

_CHUNK = 1 << 20
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


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


def write_new_file(path: Path, data: bytes) -> None:
    """Create `path` (never overwriting, never through a symlink), write `data`, fsync."""
    fd = os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644
    )
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    _fsync(path, os.O_RDONLY | os.O_NOFOLLOW)


def fsync_dir(path: Path) -> None:
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every directory under `root`, deepest first, then `root` itself."""
    dirs = [Path(d) for d, _, _ in os.walk(root)]
    for directory in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(directory)


def _libc_renameat2():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _libc_renameat2()


def rename_no_replace(source: Path, target: Path) -> None:
    """Atomically rename `source` to `target`, failing if `target` exists (even an empty dir).

    Uses renameat2(RENAME_NOREPLACE) where the kernel and filesystem support it; elsewhere falls
    back to an existence check followed by rename(2) (which still refuses a non-empty target).
    """
    if _RENAMEAT2 is not None:
        rc = _RENAMEAT2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(source))
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    os.rename(source, target)
