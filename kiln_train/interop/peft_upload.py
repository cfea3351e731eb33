"""The upload of a PEFT import: a gzip tar of an adapter directory, or the directory itself.

Check 1 of `peft_import` (docs/interop.md#import): a gzip tar of regular files, at most one
directory deep, each name once. Only the files Kiln reads (`UPLOAD_FILES`) are kept; the names of
the others are recorded as ignored.
"""

from __future__ import annotations

import io
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kiln_train.artifacts.adapter import ADAPTER_CONFIG, ADAPTER_MODEL
from kiln_train.interop.bundle import MANIFEST
from kiln_train.interop.errors import import_invalid

RESULT_FILE = "kiln_hf_result.json"
LOSSES_FILE = "step_losses.jsonl"
UPLOAD_FILES = (ADAPTER_CONFIG, ADAPTER_MODEL, RESULT_FILE, LOSSES_FILE, MANIFEST)
MAX_MEMBERS = 64


@dataclass(frozen=True)
class Upload:
    """The files of an upload Kiln reads (by name), and the names it ignored."""

    files: dict[str, bytes]
    ignored: tuple[str, ...] = ()


def read_archive(data: bytes, *, max_bytes: int) -> Upload:
    """The known files of a gzip tar (flat, or under one top-level directory); 400 otherwise."""
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")  # noqa: SIM115 (closed below)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise import_invalid(f"the upload is not a gzip tar archive ({exc})") from None
    files: dict[str, bytes] = {}
    ignored: list[str] = []
    top: set[str] = set()
    total = 0
    try:
        with archive:
            for count, member in enumerate(archive, start=1):
                if count > MAX_MEMBERS:
                    raise import_invalid(f"the archive holds more than {MAX_MEMBERS} entries")
                parts = _member_parts(member.name)
                if member.isdir():
                    continue
                if not member.isreg():
                    raise import_invalid(f"archive entry {member.name!r} is not a regular file")
                if len(parts) > 2:
                    raise import_invalid(
                        f"archive entry {member.name!r} is nested too deep: the adapter files go at the top "
                        "or in one directory"
                    )
                top.add(parts[0] if len(parts) == 2 else "")
                if len(top) > 1:
                    raise import_invalid(
                        "the archive mixes several directories; upload one adapter directory"
                    )
                base = parts[-1]
                if base not in UPLOAD_FILES:
                    ignored.append(base)
                    continue
                if base in files:
                    raise import_invalid(f"the archive holds {base} twice")
                total += member.size
                if total > max_bytes:
                    raise import_invalid(f"the archive unpacks to more than {max_bytes} bytes")
                handle = archive.extractfile(member)
                content = handle.read() if handle is not None else b""
                if len(content) != member.size:
                    raise import_invalid(f"archive entry {member.name!r} is truncated")
                files[base] = content
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise import_invalid(f"the archive cannot be read ({exc})") from None
    return Upload(files, tuple(sorted(ignored)))


def _member_parts(name: str) -> tuple[str, ...]:
    path = PurePosixPath(name)
    parts = tuple(p for p in path.parts if p not in ("", "."))
    if path.is_absolute() or ".." in parts or not parts:
        raise import_invalid(f"archive entry {name!r} is not a relative path inside the archive")
    return parts


def read_directory(path: Path) -> Upload:
    """The known files of an adapter directory (the CLI and library path)."""
    files = {name: (path / name).read_bytes() for name in UPLOAD_FILES if (path / name).is_file()}
    return Upload(files)
