"""The strict checkpoint loader and status discovery (docs/checkpoints.md#loading).

`load_checkpoint` is resume admission's full validation: the directory itself (a real
directory named `*.kiln-checkpoint`, no `.incomplete` sentinel), the manifest (present, single
link, not a symlink, <= 16 MiB, strict JSON, no unknown field, every rule of
`rules.validate_manifest`), the file set (exactly `files` + the manifest, each regular,
single-link, of the recorded size and SHA-256) and the SFT loop state (invariants, same
progress as the manifest). `discover_checkpoints` is status discovery: manifest-only validation
of every `<adapter>-checkpoint-step-*.kiln-checkpoint` of one adapter, sorted by step, invalid
ones reported rather than hidden. Torch-free.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from kiln_train.artifacts.adapter_layout import ADAPTER_CONFIG, ADAPTER_MODEL
from kiln_train.checkpoint import fs
from kiln_train.checkpoint.errors import CheckpointError
from kiln_train.checkpoint.loop_state import SftLoopState, check_loop_state_progress, parse_loop_state
from kiln_train.checkpoint.manifest import (
    CHECKPOINT_SUFFIX,
    MANIFEST_FILENAME,
    MAX_MANIFEST_BYTES,
    SENTINEL_FILENAME,
    CheckpointManifest,
    FileRecord,
    checkpoint_dir_name,
    parse_manifest_bytes,
)
from kiln_train.checkpoint.rules import validate_manifest
from kiln_train.ground.digest import sha256_hex

PEFT_MARKERS = (ADAPTER_CONFIG, ADAPTER_MODEL)
PEFT_MESSAGE = "PEFT adapter snapshots are not resumable checkpoints"


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A fully validated checkpoint."""

    path: Path
    manifest: CheckpointManifest
    manifest_sha256: str  # bare hex of the manifest bytes (the queue keeps it; docs/checkpoints.md#loading)
    files: dict[str, FileRecord]
    loop_state: SftLoopState

    def file_path(self, rel: str) -> Path:
        if rel not in self.files:
            raise CheckpointError(f"checkpoint {self.path.name!r}: {rel!r} is not one of its files")
        return self.path / rel

    def read_verified(self, rel: str) -> bytes:
        """The bytes of one file, re-checked against the manifest at the moment they are read."""
        path = self.file_path(rel)
        try:
            data = fs.read_regular_file(path, rel, "file set")
            _check_content(rel, self.files[rel], len(data), sha256_hex(data))
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {self.path.name!r}: {exc.detail}") from None
        return data


@dataclass(frozen=True)
class DiscoveredCheckpoint:
    """One checkpoint directory of an adapter, as status discovery sees it."""

    path: Path
    global_step: int  # from the directory name
    manifest: CheckpointManifest | None  # None when invalid
    manifest_sha256: str | None
    error: str | None  # why it is not usable, None when valid

    @property
    def valid(self) -> bool:
        return self.error is None


def _check_directory(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError("does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError("is a symlink; a checkpoint must be a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError("is not a directory")
    has_manifest = os.path.lexists(path / MANIFEST_FILENAME)
    if not has_manifest and any(os.path.lexists(path / m) for m in PEFT_MARKERS):
        raise CheckpointError(f"is a PEFT adapter directory; {PEFT_MESSAGE}")
    if not path.name.endswith(CHECKPOINT_SUFFIX):
        raise CheckpointError(f"the directory name does not end with {CHECKPOINT_SUFFIX!r}")
    if os.path.lexists(path / SENTINEL_FILENAME):
        raise CheckpointError(
            f"holds the {SENTINEL_FILENAME!r} sentinel; the checkpoint was never completely published"
        )
    if not has_manifest:
        raise CheckpointError(f"{MANIFEST_FILENAME} is missing ({PEFT_MESSAGE})")


def _read_manifest(path: Path) -> tuple[CheckpointManifest, str]:
    _check_directory(path)
    data = fs.read_regular_file(
        path / MANIFEST_FILENAME, MANIFEST_FILENAME, "manifest", max_bytes=MAX_MANIFEST_BYTES
    )
    manifest = parse_manifest_bytes(data)
    try:
        validate_manifest(manifest)
    except CheckpointError as exc:  # name the file the offending field lives in
        raise CheckpointError(f"{MANIFEST_FILENAME}: {exc.detail}") from None
    expected = checkpoint_dir_name(manifest.adapter_name, manifest.progress.global_step)
    if path.name != expected:
        raise CheckpointError(
            f"the directory name is not {expected!r} (from {MANIFEST_FILENAME}: adapter_name "
            f"{manifest.adapter_name!r}, progress.global_step {manifest.progress.global_step})"
        )
    return manifest, sha256_hex(data)


def _check_content(rel: str, record: FileRecord, size: int, sha256: str | None) -> None:
    # A mismatch cannot tell which side changed: name both the file and the manifest.
    changed = f"{rel} or {MANIFEST_FILENAME} was modified"
    if size != record.size_bytes:
        raise CheckpointError(
            f"files[{rel!r}].size_bytes: manifest {record.size_bytes}, on disk {size} ({changed})"
        )
    if sha256 is not None and sha256 != record.sha256:
        raise CheckpointError(
            f"files[{rel!r}].sha256: manifest {record.sha256}, on disk {sha256} ({changed})"
        )


def _check_file_set(path: Path, manifest: CheckpointManifest) -> None:
    present = set(fs.list_tree(path, "file set"))
    expected = set(manifest.files) | {MANIFEST_FILENAME}
    missing, extra = sorted(expected - present), sorted(present - expected)
    if missing:
        raise CheckpointError(f"file set: {missing[0]!r} is listed in files but missing")
    if extra:
        raise CheckpointError(f"file set: {extra[0]!r} is not listed in files")


def read_checkpoint_manifest(path: Path) -> tuple[CheckpointManifest, str]:
    """Manifest-only validation: (manifest, manifest SHA-256 hex); raises `CheckpointError`."""
    path = Path(path)
    try:
        return _read_manifest(path)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path.name!r}: {exc.detail}") from None


def load_checkpoint(path: Path, *, verify_hashes: bool = True) -> LoadedCheckpoint:
    """Full validation of one checkpoint directory (docs/checkpoints.md#loading); raises
    `CheckpointError` naming the fault."""
    path = Path(path)
    try:
        manifest, manifest_sha256 = _read_manifest(path)
        _check_file_set(path, manifest)
        loop_rel = manifest.state_files.loss_history
        for rel, record in manifest.files.items():
            if rel == loop_rel:
                continue
            if verify_hashes:
                size, sha256 = fs.hash_regular_file(path / rel, rel, "file set")
            else:
                size, sha256 = _single_link_size(path / rel, rel), None
            _check_content(rel, record, size, sha256)
        # Read the loop state once: the bytes that are checked are the bytes that are parsed.
        data = fs.read_regular_file(path / loop_rel, loop_rel, "file set")
        sha256 = sha256_hex(data) if verify_hashes else None
        _check_content(loop_rel, manifest.files[loop_rel], len(data), sha256)
        state = parse_loop_state(data)
        check_loop_state_progress(state, manifest.progress)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path.name!r}: {exc.detail}") from None
    return LoadedCheckpoint(
        path=path,
        manifest=manifest,
        manifest_sha256=manifest_sha256,
        files=dict(manifest.files),
        loop_state=state,
    )


def _single_link_size(path: Path, rel: str) -> int:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"file set: {rel!r} is not a regular file")
    if st.st_nlink != 1:
        raise CheckpointError(
            f"file set: {rel!r} has {st.st_nlink} hard links; checkpoint files must not be hard-linked"
        )
    return st.st_size


def _step_pattern(adapter_name: str) -> re.Pattern[str]:
    return re.compile(
        rf"^{re.escape(adapter_name)}-checkpoint-step-([0-9]{{8,}}){re.escape(CHECKPOINT_SUFFIX)}$"
    )


def discover_checkpoints(registry_dir: Path, adapter_name: str) -> list[DiscoveredCheckpoint]:
    """Every `<adapter_name>-checkpoint-step-*.kiln-checkpoint` in `registry_dir`, by step.

    Manifest-only validation (no file hashing); hidden staging dirs are not checkpoints and are
    skipped. Invalid entries are returned with `error` set so status can show them.
    """
    registry_dir = Path(registry_dir)
    if not registry_dir.is_dir():
        return []
    pattern = _step_pattern(adapter_name)
    found = []
    with os.scandir(registry_dir) as entries:
        for entry in entries:
            match = pattern.match(entry.name)
            if match is None:
                continue
            path = Path(entry.path)
            try:
                manifest, digest = read_checkpoint_manifest(path)
                found.append(DiscoveredCheckpoint(path, int(match.group(1)), manifest, digest, None))
            except CheckpointError as exc:
                found.append(DiscoveredCheckpoint(path, int(match.group(1)), None, None, exc.detail))
    return sorted(found, key=lambda c: (c.global_step, c.path.name))


def checkpoint_names(registry_dir: Path, adapter_name: str) -> dict[int, str]:
    """step -> basename of every entry in `registry_dir` (of any kind, valid or not) that holds the
    exact name a checkpoint of `adapter_name` at that step would be published under."""
    registry_dir = Path(registry_dir)
    if not registry_dir.is_dir():
        return {}
    pattern = _step_pattern(adapter_name)
    found = {}
    with os.scandir(registry_dir) as entries:
        for entry in entries:
            match = pattern.match(entry.name)
            if match is not None and entry.name == checkpoint_dir_name(adapter_name, int(match.group(1))):
                found[int(match.group(1))] = entry.name
    return dict(sorted(found.items()))
