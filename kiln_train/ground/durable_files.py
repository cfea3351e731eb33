"""Durable file writes and the no-replace rename every publication uses (checkpoints, adapters,
export bundles, PEFT imports): a new file is created exclusively, never through a symlink, and
fsynced; directories are fsynced after their entries change; a rename never replaces what is
already there. Linux/POSIX.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


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
