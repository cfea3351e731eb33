"""Atomic publication of a `.kiln-checkpoint` directory (docs/checkpoints.md#publication).

1. Refuse if the target exists (checkpoint names are immutable).
2. Create the hidden sibling staging dir `.<basename>.incomplete-<uuid4>`.
3. Write the `.incomplete` sentinel (checkpoint id + newline); fsync it and the dir.
4. Write the artifacts; the staging file set must equal the declared set + sentinel, each a
   regular, non-symlink, single-link file; the loop state must satisfy its invariants.
5. Hash each artifact (size + SHA-256) into `files`, validate the manifest, write
   `checkpoint_manifest.json` last, fsync the manifest and every artifact.
6. Remove the sentinel, fsync the tree.
7. Rename (no-replace) the staging dir to the target; fsync the parent.

Until step 7 nothing exists under the final name, and the staging dir (hidden, not ending in
`.kiln-checkpoint`, sentinel or no manifest) is never loadable; a later writer publishes the same
name beside a stale one. An ordinary exception removes the staging dir; a crash leaves it.

A service run passes a `fence` (checked right before the rename and again right after it, see
`kiln_train.artifacts.fencing`): a checkpoint already under the target name that a stale run of the same
job wrote is then adopted when it is identical to this one (same manifest but for `created_at`,
same file bytes) and withdrawn otherwise, instead of failing the run.

Each step is a module-level function so tests can inject a crash at every stage. The GPU lock is
the caller's business: pass artifacts as bytes already copied off the device (or a writer
callable that encodes host tensors), so encoding, hashing and I/O run after its release.
Torch-free.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kiln_train.artifacts.fencing import Fence, adopt_files, fenced_rename, grab_leftover, put_back
from kiln_train.checkpoint import fs
from kiln_train.checkpoint.draft import ManifestDraft
from kiln_train.checkpoint.errors import CheckpointError
from kiln_train.checkpoint.loop_state import check_loop_state_progress, parse_loop_state
from kiln_train.checkpoint.manifest import (
    MANIFEST_FILENAME,
    MAX_MANIFEST_BYTES,
    SENTINEL_FILENAME,
    STATE_FILE_ROLES,
    CheckpointManifest,
    FileRecord,
    checkpoint_dir_name,
    parse_manifest_bytes,
)
from kiln_train.checkpoint.rules import check_relpath, validate_manifest
from kiln_train.ground import durable_files
from kiln_train.ground.digest import sha256_hex

log = logging.getLogger(__name__)

Artifact = bytes | Callable[[Path], None]
"""Either the file's bytes, or a function that writes the file at the path it is given."""

_PLACEHOLDER_SHA256 = "0" * 64


@dataclass(frozen=True)
class PublishedCheckpoint:
    """A published checkpoint and what it cost to write."""

    path: Path
    manifest: CheckpointManifest
    manifest_sha256: str
    total_bytes: int  # artifacts + manifest
    publish_ms: float  # steps 1-7, wall clock


def staging_dir_name(basename: str) -> str:
    return f".{basename}.incomplete-{uuid.uuid4()}"


def _artifact_roles(
    draft: ManifestDraft, artifacts: Mapping[str, Artifact], roles: Mapping[str, str]
) -> dict:
    """relpath -> role for every artifact; state_files fix the roles of the files they name."""
    declared = {path: STATE_FILE_ROLES[member] for member, path in draft.state_files.present().items()}
    out: dict[str, str] = {}
    for path in artifacts:
        check_relpath(f"artifacts[{path!r}]", path)
        role = declared.get(path, roles.get(path))
        if role is None:
            raise CheckpointError(f"artifacts[{path!r}]: no role (name it in state_files or in roles)")
        if path in declared and path in roles and roles[path] != declared[path]:
            raise CheckpointError(
                f"roles[{path!r}]: {roles[path]!r} conflicts with the state_files role {declared[path]!r}"
            )
        out[path] = role
    for path in declared:
        if path not in artifacts:
            raise CheckpointError(f"state_files: {path!r} is declared but no artifact was given for it")
    return out


def _prevalidate(draft: ManifestDraft, roles: Mapping[str, str]) -> None:
    """Run every manifest rule before touching the disk, with placeholder file digests."""
    placeholder = {
        path: FileRecord(role=role, size_bytes=0, sha256=_PLACEHOLDER_SHA256) for path, role in roles.items()
    }
    validate_manifest(draft.to_manifest(placeholder))


# ----- the stages (module-level so tests can inject a crash at each) ---------------------------
def create_staging(registry_dir: Path, basename: str) -> Path:
    staging = registry_dir / staging_dir_name(basename)
    staging.mkdir(mode=0o755)
    return staging


def write_sentinel(staging: Path, checkpoint_id: str) -> None:
    durable_files.write_new_file(staging / SENTINEL_FILENAME, f"{checkpoint_id}\n".encode("ascii"))
    durable_files.fsync_dir(staging)


def write_artifacts(staging: Path, artifacts: Mapping[str, Artifact]) -> None:
    for rel, artifact in artifacts.items():
        path = staging / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(artifact, bytes | bytearray | memoryview):
            durable_files.write_new_file(path, bytes(artifact))
        elif callable(artifact):
            artifact(path)
            if not path.is_file() or path.is_symlink():
                raise CheckpointError(f"artifacts[{rel!r}]: the writer did not create a regular file")
            durable_files.fsync_file(path)
        else:
            raise CheckpointError(f"artifacts[{rel!r}]: expected bytes or a writer callable")


def check_staging_files(staging: Path, declared: Mapping[str, str]) -> None:
    """The staging set must be exactly the declared artifacts plus the sentinel."""
    present = set(fs.list_tree(staging, "checkpoint staging"))
    expected = set(declared) | {SENTINEL_FILENAME}
    if present != expected:
        extra, missing = sorted(present - expected), sorted(expected - present)
        raise CheckpointError(f"checkpoint staging: file set differs (unexpected {extra}, missing {missing})")


def check_loop_state(staging: Path, draft: ManifestDraft) -> None:
    """The loop state must satisfy its invariants and sit at the manifest's progress."""
    rel = draft.state_files.loss_history
    if rel is not None:
        state = parse_loop_state(fs.read_regular_file(staging / rel, rel, "checkpoint staging"))
        check_loop_state_progress(state, draft.progress)


def hash_artifacts(staging: Path, roles: Mapping[str, str]) -> dict[str, FileRecord]:
    files = {}
    for rel in sorted(roles):
        size, sha256 = fs.hash_regular_file(staging / rel, rel, "checkpoint staging")
        files[rel] = FileRecord(role=roles[rel], size_bytes=size, sha256=sha256)
    return files


def build_manifest(draft: ManifestDraft, files: dict[str, FileRecord]) -> tuple[CheckpointManifest, bytes]:
    manifest = draft.to_manifest(files)
    validate_manifest(manifest)
    data = manifest.to_bytes()
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"{MANIFEST_FILENAME}: {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES} byte limit"
        )
    return manifest, data


def write_manifest(staging: Path, data: bytes, artifacts: Mapping[str, Artifact]) -> None:
    durable_files.write_new_file(staging / MANIFEST_FILENAME, data)
    for rel in artifacts:
        durable_files.fsync_file(staging / rel)


def remove_sentinel(staging: Path) -> None:
    (staging / SENTINEL_FILENAME).unlink()
    durable_files.fsync_tree(staging)


def rename_into_place(staging: Path, target: Path) -> None:
    try:
        durable_files.rename_no_replace(staging, target)
    except FileExistsError:
        raise CheckpointError(
            f"checkpoint {target.name!r} already exists; checkpoint names are never overwritten"
        ) from None


def sync_parent(registry_dir: Path) -> None:
    durable_files.fsync_dir(registry_dir)


# ----- leftovers of a stale run of the same job -------------------------------------------------
def _already_exists(basename: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {basename!r} already exists; checkpoint names are never overwritten")


def _read_leftover(hidden: Path) -> tuple[CheckpointManifest, bytes] | None:
    """The manifest of a grabbed directory and its bytes (None when there is no readable one)."""
    try:
        if hidden.is_symlink() or not hidden.is_dir():
            return None
        data = fs.read_regular_file(hidden / MANIFEST_FILENAME, MANIFEST_FILENAME, "leftover")
        return parse_manifest_bytes(data), data
    except (CheckpointError, OSError):
        return None


def _complete(hidden: Path, manifest: CheckpointManifest) -> bool:
    """Whether the grabbed directory holds exactly the files its manifest declares, byte for byte."""
    try:
        validate_manifest(manifest)
        if set(fs.list_tree(hidden, "leftover")) != set(manifest.files) | {MANIFEST_FILENAME}:
            return False
        for rel, record in manifest.files.items():
            if fs.hash_regular_file(hidden / rel, rel, "leftover") != (record.size_bytes, record.sha256):
                return False
    except (CheckpointError, OSError):
        return False
    return True


def _identical(
    manifest: CheckpointManifest, draft: ManifestDraft, artifacts: Mapping[str, Artifact], roles
) -> bool:
    """Whether `manifest` is what this publication would write, but for its `created_at`."""
    files = {}
    for rel, artifact in artifacts.items():
        if not isinstance(artifact, bytes | bytearray | memoryview):
            return False  # a writer callable: its bytes are unknown until written
        data = bytes(artifact)
        files[rel] = FileRecord(role=roles[rel], size_bytes=len(data), sha256=sha256_hex(data))
    ours = draft.to_manifest(files).model_dump(mode="json")
    theirs = manifest.model_dump(mode="json")
    ours.pop("created_at")
    theirs.pop("created_at")
    return ours == theirs


def _settle_leftover(
    registry_dir: Path,
    target: Path,
    draft: ManifestDraft,
    artifacts: Mapping[str, Artifact],
    roles: Mapping[str, str],
    fence: Fence | None,
) -> PublishedCheckpoint | None:
    """Something holds the target name. A checkpoint a stale run of this job left there is adopted
    (returned) when identical, else withdrawn (None: publish ours); anything else is refused."""
    if fence is None or target.is_symlink():
        raise _already_exists(target.name)
    started = time.perf_counter()
    hidden = grab_leftover(target, fence)  # one rename: nobody else can act on it now
    if hidden is None:
        return None
    found = _read_leftover(hidden)
    if found is None or not fence.leftover_checkpoint(target.name, found[0]):
        put_back(hidden, target)
        raise _already_exists(target.name)
    manifest, manifest_bytes = found
    if not (_complete(hidden, manifest) and _identical(manifest, draft, artifacts, roles)):
        log.warning("withdrew %s: a stale run of this job left different or damaged content", target.name)
        shutil.rmtree(hidden, ignore_errors=True)
        return None
    staging = create_staging(registry_dir, target.name)
    try:
        adopt_files(hidden, staging)
        durable_files.fsync_tree(staging)
        fenced_rename(staging, target, fence, rename_into_place)
    except Exception:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(hidden, ignore_errors=True)
        raise
    sync_parent(registry_dir)
    log.warning("adopted %s: a stale run of this job had written exactly this checkpoint", target.name)
    return PublishedCheckpoint(
        path=target,
        manifest=manifest,
        manifest_sha256=sha256_hex(manifest_bytes),
        total_bytes=sum(r.size_bytes for r in manifest.files.values()) + len(manifest_bytes),
        publish_ms=(time.perf_counter() - started) * 1000.0,
    )


def _place(
    staging: Path, target: Path, fence: Fence | None, settle: Callable[[], PublishedCheckpoint | None] | None
) -> PublishedCheckpoint | None:
    """Rename the staging dir into place. When a stale run of the job renamed its own copy there
    meanwhile, `settle` adopts it (returned) or withdraws it and the rename is tried again."""
    for _ in range(3):
        try:
            fenced_rename(staging, target, fence, rename_into_place)
            return None
        except CheckpointError:
            if settle is None or not (target.exists() or target.is_symlink()):
                raise
        adopted = settle()
        if adopted is not None:
            return adopted
    raise _already_exists(target.name)


# ----- the whole publication -------------------------------------------------------------------
def publish_checkpoint(
    registry_dir: Path,
    draft: ManifestDraft,
    artifacts: Mapping[str, Artifact],
    *,
    roles: Mapping[str, str] | None = None,
    fence: Fence | None = None,
) -> PublishedCheckpoint:
    """Publish `artifacts` with the manifest built from `draft` as
    `<registry_dir>/<adapter>-checkpoint-step-<global_step:08>.kiln-checkpoint`.

    `roles` gives the role of artifacts not named by `draft.state_files`. Bad input raises
    `CheckpointError` before anything is written. `fence`: see the module notes.
    """
    started = time.perf_counter()
    registry_dir = Path(registry_dir)
    role_map = _artifact_roles(draft, artifacts, roles or {})
    _prevalidate(draft, role_map)
    basename = checkpoint_dir_name(draft.adapter_name, draft.progress.global_step)
    target = registry_dir / basename
    registry_dir.mkdir(parents=True, exist_ok=True)

    def settle() -> PublishedCheckpoint | None:
        return _settle_leftover(registry_dir, target, draft, artifacts, role_map, fence)

    if target.exists() or target.is_symlink():
        adopted = settle()
        if adopted is not None:
            return adopted

    staging = create_staging(registry_dir, basename)
    try:
        write_sentinel(staging, draft.checkpoint_id)
        write_artifacts(staging, artifacts)
        check_staging_files(staging, role_map)
        check_loop_state(staging, draft)
        files = hash_artifacts(staging, role_map)
        manifest, manifest_bytes = build_manifest(draft, files)
        write_manifest(staging, manifest_bytes, artifacts)
        remove_sentinel(staging)
        adopted = _place(staging, target, fence, settle if fence is not None else None)
    except Exception:
        # An ordinary failure leaves nothing behind; a crash (process death) would leave the
        # hidden staging dir, which is never loadable.
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if adopted is not None:
        shutil.rmtree(staging, ignore_errors=True)
        return adopted
    sync_parent(registry_dir)
    publish_ms = (time.perf_counter() - started) * 1000.0
    total = sum(r.size_bytes for r in files.values()) + len(manifest_bytes)
    log.info("published checkpoint %s (%d bytes) in %.1f ms", target, total, publish_ms)
    return PublishedCheckpoint(
        path=target,
        manifest=manifest,
        manifest_sha256=sha256_hex(manifest_bytes),
        total_bytes=total,
        publish_ms=publish_ms,
    )
