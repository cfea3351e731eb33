"""A directory as a streamed gzip tar (`GET /v1/adapters/{name}/download`, the HF export downloads).

Written block by block — tar headers from `tarfile.TarInfo`, file bytes in 1 MiB chunks, a gzip
stream from zlib — so a multi-GiB adapter never sits in memory and the first bytes leave at once.
The result is an ordinary `.tar.gz` (`tar xzf`, `tarfile.open(mode="r:gz")`).
"""

from __future__ import annotations

import os
import stat
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from flask import Response, current_app

CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE  # 512
GZIP_WBITS = 31  # zlib: gzip container


def archive_members(root: Path) -> list[Path]:
    """Regular files under `root`, sorted, symlinks and special files skipped."""
    members = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if stat.S_ISREG(os.lstat(path).st_mode):
                members.append(path)
    return members


def tar_blocks(root: Path, arcroot: str) -> Iterator[bytes]:
    """The uncompressed tar stream of the files under `root`, as `<arcroot>/<relative path>`."""
    for path in archive_members(root):
        st = os.lstat(path)
        info = tarfile.TarInfo(f"{arcroot}/{path.relative_to(root).as_posix()}")
        info.size = st.st_size
        info.mtime = int(st.st_mtime)
        info.mode = 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        written = 0
        with open(path, "rb") as f:
            while written < info.size:
                chunk = f.read(min(CHUNK, info.size - written))
                if not chunk:
                    raise OSError(f"{path} shrank while it was being archived")
                written += len(chunk)
                yield chunk
        if info.size % BLOCK:
            yield b"\0" * (BLOCK - info.size % BLOCK)
    yield b"\0" * (2 * BLOCK)  # end-of-archive marker


def stream_tar_gz(root: Path, arcroot: str) -> Iterator[bytes]:
    """Gzip-compressed `tar_blocks`, yielded as the compressor produces output."""
    gz = zlib.compressobj(6, zlib.DEFLATED, GZIP_WBITS)
    for block in tar_blocks(root, arcroot):
        out = gz.compress(block)
        if out:
            yield out
    yield gz.flush()


def tar_gz_download(root: Path, arcroot: str) -> Response:
    """The streamed `stream_tar_gz(root, arcroot)` as an attachment named `<arcroot>.tar.gz`."""
    return current_app.response_class(
        stream_tar_gz(root, arcroot),
        mimetype="application/gzip",
        headers={"Content-Disposition": f'attachment; filename="{arcroot}.tar.gz"'},
        direct_passthrough=True,
    )
