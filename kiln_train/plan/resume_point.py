"""The resume point of a run (docs/checkpoints.md#resume): the named `.kiln-checkpoint` is fully
validated (file set, sizes, SHA-256), the run's seed is the checkpoint's, and everything the
request leaves open is taken from the checkpoint so the resumed run is the same run.

After ingestion, `check_resume_identity` compares what admission computed (effective config,
data identity, total steps) with the manifest and names the first drift (400). The trainer
repeats the complete `compare_for_resume` before it restores anything. Used by the service's
admission and the library's `finetune` alike. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln_train.checkpoint import VALIDATION_AUX_KEY, CheckpointManifest, load_checkpoint, seed_for_resume
from kiln_train.checkpoint.resume_expectation import RESUME_IGNORED_CONFIG_FIELDS, first_difference
from kiln_train.errors import KilnError, invalid_request
from kiln_train.plan.names import NAME_MAX_BYTES
from kiln_train.sft_config import SftConfig


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    manifest: CheckpointManifest
    manifest_sha256: str  # bare hex of the manifest bytes
    seed: int

    def pin(self) -> dict:
        """What the worker re-verifies at dequeue (`verify_queued_checkpoint`)."""
        return {
            "checkpoint": self.path.name,
            "checkpoint_id": self.manifest.checkpoint_id,
            "manifest_sha256": "sha256:" + self.manifest_sha256,
            "global_step": self.manifest.progress.global_step,
            "seed": str(self.seed),
        }


def resolve_checkpoint_path(name: str, adapters_dir: Path) -> Path:
    """A basename directly under the adapter registry, or an absolute path directly beneath it."""
    if "\0" in name:
        raise invalid_request("config.resume_checkpoint must not contain NUL bytes")
    root = adapters_dir.resolve()
    candidate = Path(name)
    if len(candidate.name.encode("utf-8")) > NAME_MAX_BYTES:
        # The filesystem refuses the lookup itself (ENAMETOOLONG): no such checkpoint can exist.
        raise invalid_request(
            f"config.resume_checkpoint names a directory of {len(candidate.name.encode('utf-8'))} bytes; "
            f"a checkpoint directory name holds at most {NAME_MAX_BYTES}"
        )
    if candidate.is_absolute():
        if candidate.parent.resolve() != root:
            raise invalid_request(
                f"config.resume_checkpoint {name!r} is not directly beneath the adapter registry {root}"
            )
        if candidate.name in ("", ".", ".."):  # `<registry>/..` is the storage root, no checkpoint
            raise invalid_request(
                "config.resume_checkpoint must name a checkpoint directory in the adapter registry"
            )
        return candidate
    if len(candidate.parts) != 1 or name in (".", ".."):
        raise invalid_request(f"config.resume_checkpoint {name!r} must be a checkpoint directory's basename")
    return root / name


def load_resume_point(config: SftConfig, adapters_dir: Path) -> ResumePoint:
    """Fully validate the checkpoint and fix the seed; 400 naming the fault."""
    assert config.resume_checkpoint is not None
    path = resolve_checkpoint_path(config.resume_checkpoint, adapters_dir)
    try:
        loaded = load_checkpoint(path, verify_hashes=True)
    except KilnError as exc:  # name the field: the loader only knows the directory
        raise invalid_request(f"config.resume_checkpoint: {exc.detail}", hint=exc.hint) from None
    manifest = loaded.manifest
    if manifest.training_kind != "sft":
        raise invalid_request(
            f"config.resume_checkpoint {path.name!r} is a {manifest.training_kind} checkpoint, not sft"
        )
    seed = seed_for_resume(manifest, config.seed)
    if config.output_name is not None and config.output_name != manifest.adapter_name:
        raise invalid_request(
            f"config.output_name {config.output_name!r} differs from the checkpoint's adapter "
            f"{manifest.adapter_name!r}; a resumed run writes the same adapter"
        )
    return ResumePoint(path=path, manifest=manifest, manifest_sha256=loaded.manifest_sha256, seed=seed)


def adopt_checkpoint_fields(config: SftConfig, point: ResumePoint) -> SftConfig:
    """Fill what the request left open from the checkpoint's effective config."""
    saved = point.manifest.effective_config
    update: dict = {"seed": point.seed}
    if config.output_name is None:
        update["output_name"] = point.manifest.adapter_name
    for name in ("grad_checkpoint_segments", "checkpoint_interval"):
        if getattr(config, name) is None and saved.get(name) is not None:
            update[name] = saved[name]
    return config.model_copy(update=update)


def check_resume_identity(
    point: ResumePoint,
    effective_config: dict,
    kept_corpus_sha256: str,
    rows_kept: int,
    total_steps: int,
    validation: dict | None = None,
) -> None:
    """The admitted run must be the checkpointed run: config, data, length and the held-out
    validation corpus and schedule (`validation`: its identity, None without) (400 on drift)."""
    manifest = point.manifest

    def drop(config: dict) -> dict:
        return {k: v for k, v in config.items() if k not in RESUME_IGNORED_CONFIG_FIELDS}

    found = first_difference("effective_config", drop(manifest.effective_config), drop(effective_config))
    if found is None and manifest.data.content_sha256.removeprefix(
        "sha256:"
    ) != kept_corpus_sha256.removeprefix("sha256:"):
        found = ("data.content_sha256", manifest.data.content_sha256, kept_corpus_sha256)
    if found is None and manifest.data.item_count != rows_kept:
        found = ("data.item_count", manifest.data.item_count, rows_kept)
    if found is None and manifest.progress.total_steps != total_steps:
        found = ("progress.total_steps", manifest.progress.total_steps, total_steps)
    if found is None:
        recorded = manifest.auxiliary_state.get(VALIDATION_AUX_KEY)
        found = first_difference(f"auxiliary_state.{VALIDATION_AUX_KEY}", recorded, validation)
    if found is not None:
        where, theirs, ours = found
        raise invalid_request(
            f"config.resume_checkpoint {point.path.name!r} does not match this request at {where}: "
            f"checkpoint {theirs!r}, request {ours!r}"
        )
    if manifest.progress.global_step >= manifest.progress.total_steps:
        raise invalid_request(
            f"config.resume_checkpoint {point.path.name!r} is complete (step {manifest.progress.global_step} "
            f"of {manifest.progress.total_steps}); nothing is left to train"
        )
