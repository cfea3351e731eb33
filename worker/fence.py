"""The fence a worker gives each run: the job's claim number, checked against the job row.

Every claim of a job increments its `attempts`; a run holds the number its claim got. Each write
the run makes to the store is conditioned on that number in the same transaction
(`kiln.store.require_owner` and the `attempt` arguments), and each directory it renames into
the adapter registry is checked against it right before and right after the rename
(`kiln_train.artifacts.fencing`). A worker that stalled past its lease (GC pause, VM freeze, SIGSTOP) and
wakes after the job was given to another claim therefore changes nothing the current owner
records or publishes: it stops at its next check and records nothing.
"""

from __future__ import annotations

from pathlib import Path

from kiln import store
from kiln_train.artifacts.fencing import DirIdentity, RunIdentity
from kiln_train.checkpoint import CheckpointManifest


class JobFence:
    """`kiln_train.artifacts.fencing.Fence` for one claim of one job."""

    def __init__(self, runtime, job_id: str, attempt: int, identity: RunIdentity) -> None:
        self.runtime = runtime
        self.job_id = job_id
        self.attempt = attempt
        self.identity = identity
        self.renamed_dirs: dict[Path, DirIdentity] = {}

    def check(self) -> None:
        """Still ours: renews the lease under this claim number, or raises `LeaseLost`."""
        rt = self.runtime
        lease = rt.settings.training.lease_seconds
        rt.transact(lambda s, _: store.renew_lease(s, self.job_id, rt.worker_id, lease, attempt=self.attempt))

    def leftover_checkpoint(self, basename: str, manifest: CheckpointManifest) -> bool:
        """This job's run wrote it and no other job recorded it (a later submission that resumes
        an earlier job's checkpoint shares its identity but must not touch that job's files)."""
        if not self.identity.wrote_checkpoint(manifest):
            return False
        owner = self.runtime.transact(lambda s, _: store.checkpoint_owner(s, basename))
        return owner is None or owner == self.job_id

    def leftover_adapter(self, receipt: dict) -> bool:
        """This job's run published it and no adapter row holds the name."""
        if not self.identity.wrote_adapter(receipt):
            return False
        name = self.identity.adapter_name
        return self.runtime.transact(lambda s, _: store.get_adapter(s, name) is None)

    def renamed(self, target: Path, identity: DirIdentity) -> None:
        self.renamed_dirs[target] = identity
