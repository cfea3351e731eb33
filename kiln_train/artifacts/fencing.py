"""Publication fencing: a run that lost its job never publishes over the job's current owner.

`OwnershipLost` lives in `kiln_train.errors` (the job store raises a subclass of it).

The service gives each run a `Fence` (library runs have none). The trainer calls `fence.check()`
immediately before every atomic rename of a checkpoint or adapter directory and again right
after it. A run whose check fails stops with `OwnershipLost` and records nothing; when it had
already renamed a directory into place it first takes back exactly that directory (`take_back`,
matched by inode, so a directory the current owner put under the same name is never touched).

The current owner, for its part, may find directories a stale run of the same job left under the
names it must publish. Those are `Leftover`s: `grab` moves one out of the way atomically (so the
stale run and the owner never both act on it), and the owner then adopts it when it is identical
to what it would write, or deletes it otherwise.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kiln_train.errors import OwnershipLost

log = logging.getLogger(__name__)

DirIdentity = tuple[int, int]
"""(st_dev, st_ino) of a directory: survives a rename, differs for any other directory."""


class Fence(Protocol):
    """What a service run is given to publish safely beside stale runs of its own job."""

    def check(self) -> None:
        """Raise `OwnershipLost` unless this run still owns its job (and keep owning it a while)."""

    def leftover_checkpoint(self, basename: str, manifest) -> bool:
        """Whether a checkpoint under a name this run publishes was left by a stale run of this
        job (it may then be adopted or withdrawn); anything else is never overwritten. `manifest`
        is the leftover's `kiln_train.checkpoint.CheckpointManifest` (that folder stands above
        this one, so the type is not imported here)."""

    def leftover_adapter(self, receipt: dict) -> bool:
        """Whether the adapter holding this run's name was published by a stale run of this job
        (and is registered to no one): it is then replaced by this run's publication."""

    def renamed(self, target: Path, identity: DirIdentity) -> None:
        """This run renamed a directory into place as `target` (so it can take back exactly that
        one should its outcome turn out not to be the job's)."""


def dir_identity(path: Path) -> DirIdentity:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def withdrawn_name(path: Path) -> Path:
    """A hidden sibling name the registry sweep recognises as work in progress."""
    return path.parent / f".withdrawn-{uuid.uuid4().hex}-{path.name}"[:255]


def grab(path: Path) -> Path | None:
    """Move `path` to a hidden name in one rename; the hidden path, or None when it was gone."""
    hidden = withdrawn_name(path)
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return None
    return hidden


def put_back(hidden: Path, path: Path) -> bool:
    """Rename a grabbed directory back under its name (never over something else)."""
    # Imported here: the checkpoint package publishes through this module.
    from kiln_train.ground.durable_files import rename_no_replace

    try:
        rename_no_replace(hidden, path)
    except OSError:
        log.error("could not put %s back as %s; it stays hidden for the registry sweep", hidden, path)
        return False
    return True


def take_back(path: Path, identity: DirIdentity) -> None:
    """Withdraw the directory this run renamed to `path`, and only that one: the grabbed
    directory is deleted when its inode is `identity`, otherwise it is put back untouched."""
    hidden = grab(path)
    if hidden is None:
        return
    if dir_identity(hidden) != identity:
        put_back(hidden, path)
        return
    shutil.rmtree(hidden, ignore_errors=True)


def grab_leftover(path: Path, fence: Fence) -> Path | None:
    """Grab what holds `path` for a clean-up, but only while this run owns its job: checked
    before the grab and again after it (a stale run puts back what it grabbed and stops)."""
    fence.check()
    hidden = grab(path)
    if hidden is None:
        return None
    try:
        fence.check()
    except OwnershipLost:
        put_back(hidden, path)
        raise
    return hidden


def fenced_rename(staging: Path, target: Path, fence: Fence | None, rename) -> None:
    """`rename(staging, target)` between two fence checks. A run found stale after the rename
    takes back what it renamed before `OwnershipLost` propagates."""
    if fence is None:
        rename(staging, target)
        return
    identity = dir_identity(staging)  # a rename keeps it; taken before, so nothing can swap it
    fence.check()
    rename(staging, target)
    fence.renamed(target, identity)
    try:
        fence.check()
    except OwnershipLost:
        take_back(target, identity)
        raise


def adopt_files(hidden: Path, staging: Path) -> None:
    """Move every entry of `hidden` into `staging` (renames only), then remove `hidden`: the
    content is kept, the directory (and so its identity) is the adopter's own."""
    for entry in os.listdir(hidden):
        os.rename(hidden / entry, staging / entry)
    os.rmdir(hidden)


@dataclass(frozen=True)
class RunIdentity:
    """What every attempt of one job shares, and so what marks an artifact as that job's: the
    adapter name (unique among live jobs), the effective seed, the kept corpus and the length."""

    adapter_name: str
    seed: str
    corpus_sha256: str
    total_steps: int

    def wrote_checkpoint(self, manifest) -> bool:
        """Whether this job's run wrote the checkpoint whose `CheckpointManifest` this is."""
        return (
            manifest.training_kind == "sft"
            and manifest.adapter_name == self.adapter_name
            and str(manifest.seed) == self.seed
            and _bare(manifest.data.content_sha256) == _bare(self.corpus_sha256)
            and manifest.progress.total_steps == self.total_steps
        )

    def wrote_adapter(self, receipt: dict) -> bool:
        """Whether a successful run of this job wrote the adapter whose receipt this is."""
        try:
            return (
                receipt["status"] == "success"
                and receipt["adapter_name"] == self.adapter_name
                and str(receipt["config"]["seed"]) == self.seed
                and _bare(receipt["data"]["sft_ingestion"]["kept_corpus_sha256"]) == _bare(self.corpus_sha256)
            )
        except (KeyError, TypeError):
            return False


def _bare(digest: str) -> str:
    return str(digest).removeprefix("sha256:")


def rehome(path: Path) -> bool:
    """Give the directory at `path` a new identity without touching its content: grab it, move
    its entries into a fresh hidden staging directory, rename that back to `path`. A stale run
    that later takes back the directory it renamed (by inode) then leaves this one alone. False
    when `path` was gone (or could not be put back: it then waits hidden for the sweep)."""
    hidden = grab(path)
    if hidden is None:
        return False
    staging = path.parent / f".{path.name}.incomplete-{uuid.uuid4().hex}"[:255]
    staging.mkdir()
    adopt_files(hidden, staging)
    return put_back(staging, path)
