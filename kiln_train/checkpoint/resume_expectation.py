"""What a resumed run must match: compare a checkpoint with what the new run computes
(docs/checkpoints.md#resume).

Before any model or GPU work, everything the manifest binds must equal the new run's value:
training kind, adapter (output) name, the explicit seed, the effective config (after LR/seed
resolution; `resume_checkpoint` and `base_adapter` excluded, since resume ignores the latter and
the former names the checkpoint itself), precision policy, data identity, total steps, optimizer
and scheduler records, RNG streams, the base-weight aggregate, the execution-provenance digest
and then the whole auxiliary state. The first drift fails with its field path and both values,
e.g. `effective_config.lora_rank: checkpoint 16, request 8`. Progress-dependent members (the
optimizer/scheduler `step`, the RNG `position`) are validated against the progress by the
loader instead. A warm-started run's lineage (`effective_config.base_adapter` and its recorded
identity `auxiliary_state.base_adapter`) is not compared but adopted (`checkpoint_lineage`,
`with_checkpoint_lineage`): the resumed run is the checkpointed run, whatever base adapter the
request names. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln_train.checkpoint.draft import (
    checkpoint_effective_config,
    sft_optimizer_record,
    sft_rng_states,
    sft_scheduler_record,
)
from kiln_train.checkpoint.errors import CheckpointError
from kiln_train.checkpoint.load import LoadedCheckpoint
from kiln_train.checkpoint.manifest import (
    BASE_ADAPTER_AUX_KEY,
    DATA_SOURCE_KIND,
    VALIDATION_AUX_KEY,
    VALIDATION_HISTORY_AUX_KEY,
    CheckpointManifest,
    DataIdentity,
    OptimizerRecord,
    PrecisionPolicy,
    RngStates,
    SchedulerRecord,
    strip_sha256_prefix,
)
from kiln_train.sft_config import SftConfig

# effective_config members that may differ between the checkpointed run and its resumption
RESUME_IGNORED_CONFIG_FIELDS = ("resume_checkpoint", "base_adapter")
_ABSENT = object()


@dataclass(frozen=True)
class ResumeExpectation:
    """What the resuming run computes, shaped like the manifest parts it must equal."""

    adapter_name: str
    effective_config: dict[str, Any]
    precision_policy: PrecisionPolicy
    data: DataIdentity
    total_steps: int
    optimizer: OptimizerRecord
    scheduler: SchedulerRecord
    rng_states: RngStates
    auxiliary_state: dict[str, Any]
    requested_seed: int | None = None  # the request's explicit seed, if it sent one
    training_kind: str = "sft"


def seed_for_resume(manifest: CheckpointManifest, requested_seed: int | None) -> int:
    """The seed a resumed run must use: the checkpoint's; an explicit request seed must equal it."""
    if requested_seed is not None and requested_seed != manifest.seed:
        raise CheckpointError(f"seed: checkpoint {manifest.seed}, request {requested_seed}")
    return manifest.seed


def sft_resume_expectation(
    *,
    config: SftConfig,
    adapter_name: str,
    precision_policy: dict[str, Any],
    content_sha256: str,
    item_count: int,
    auxiliary_state: dict[str, Any],
    requested_seed: int | None,
) -> ResumeExpectation:
    """The expectation of a resumed SFT run; `config` is resolved with `seed_for_resume`'s seed."""
    return ResumeExpectation(
        adapter_name=adapter_name,
        effective_config=checkpoint_effective_config(config),
        precision_policy=PrecisionPolicy.model_validate(precision_policy),
        data=DataIdentity(
            source_kind=DATA_SOURCE_KIND,
            content_sha256=strip_sha256_prefix(content_sha256),
            item_count=item_count,
        ),
        total_steps=config.epochs * item_count,
        optimizer=sft_optimizer_record(config, 0),
        scheduler=sft_scheduler_record(config, 0),
        rng_states=sft_rng_states(config.seed, 0),
        auxiliary_state=auxiliary_state,
        requested_seed=requested_seed,
    )


def checkpoint_lineage(manifest: CheckpointManifest) -> tuple[str | None, dict[str, Any] | None]:
    """The warm start a checkpointed run made: (`effective_config.base_adapter`, its receipt
    identity or None). A resumed run adopts both whatever its request says (resume ignores
    `base_adapter`), so its receipt, adapter manifest and later checkpoints name the same parent."""
    identity = manifest.auxiliary_state.get(BASE_ADAPTER_AUX_KEY)
    return manifest.effective_config.get("base_adapter"), (dict(identity) if identity is not None else None)


def with_checkpoint_lineage(auxiliary_state: dict[str, Any], manifest: CheckpointManifest) -> dict[str, Any]:
    """The resuming run's auxiliary state with what the checkpoint records as its run's history
    adopted: the base-adapter identity, and the validation evaluations made so far (progress, not
    identity: the validation corpus itself, `auxiliary_state.validation`, is compared)."""
    adopted = (BASE_ADAPTER_AUX_KEY, VALIDATION_HISTORY_AUX_KEY)
    out = {k: v for k, v in auxiliary_state.items() if k not in adopted}
    _, identity = checkpoint_lineage(manifest)
    if identity is not None:
        out[BASE_ADAPTER_AUX_KEY] = identity
    if VALIDATION_HISTORY_AUX_KEY in manifest.auxiliary_state:
        out[VALIDATION_HISTORY_AUX_KEY] = manifest.auxiliary_state[VALIDATION_HISTORY_AUX_KEY]
    return out


def _render(value: Any) -> str:
    if value is _ABSENT:
        return "<absent>"
    text = json.dumps(value, sort_keys=False, default=str)
    return text if len(text) <= 160 else text[:157] + "..."


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def first_difference(path: str, ours: Any, theirs: Any) -> tuple[str, Any, Any] | None:
    """The first (path, checkpoint value, request value) where two JSON values differ, or None."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in [*ours, *(k for k in theirs if k not in ours)]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in ours or key not in theirs:
                return sub, ours.get(key, _ABSENT), theirs.get(key, _ABSENT)
            found = first_difference(sub, ours[key], theirs[key])
            if found:
                return found
        return None
    if isinstance(ours, list) and isinstance(theirs, list):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            found = first_difference(f"{path}[{i}]", a, b)
            if found:
                return found
        if len(ours) != len(theirs):
            return f"{path} length", len(ours), len(theirs)
        return None
    return None if _same_scalar(ours, theirs) else (path, ours, theirs)


def _require_equal(path: str, ours: Any, theirs: Any) -> None:
    found = first_difference(path, ours, theirs)
    if found:
        where, a, b = found
        raise CheckpointError(f"{where}: checkpoint {_render(a)}, request {_render(b)}")


def _without(value: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if k not in keys}


def compare_for_resume(manifest: CheckpointManifest, expected: ResumeExpectation) -> None:
    """Raise `CheckpointError` naming the first field where the checkpoint and the new run drift."""
    _require_equal("training_kind", manifest.training_kind, expected.training_kind)
    _require_equal("adapter_name", manifest.adapter_name, expected.adapter_name)
    if expected.requested_seed is not None:
        seed_for_resume(manifest, expected.requested_seed)
    _require_equal(
        "effective_config",
        _without(manifest.effective_config, RESUME_IGNORED_CONFIG_FIELDS),
        _without(expected.effective_config, RESUME_IGNORED_CONFIG_FIELDS),
    )
    _require_equal(
        "precision_policy",
        manifest.precision_policy.model_dump(mode="json"),
        expected.precision_policy.model_dump(mode="json"),
    )
    _require_equal("data", manifest.data.model_dump(mode="json"), expected.data.model_dump(mode="json"))
    _require_equal("progress.total_steps", manifest.progress.total_steps, expected.total_steps)
    _require_equal(
        "optimizer",
        _without(manifest.optimizer.model_dump(mode="json"), ("step",)),
        _without(expected.optimizer.model_dump(mode="json"), ("step",)),
    )
    _require_equal(
        "scheduler",
        _without(manifest.scheduler.model_dump(mode="json"), ("step",)),
        _without(expected.scheduler.model_dump(mode="json"), ("step",)),
    )
    ours_rng = manifest.rng_states.model_dump(mode="json", by_alias=True)
    theirs_rng = expected.rng_states.model_dump(mode="json", by_alias=True)
    _require_equal(
        "rng_states",
        {name: _without(stream, ("position",)) for name, stream in ours_rng.items()},
        {name: _without(stream, ("position",)) for name, stream in theirs_rng.items()},
    )
    ours_aux, theirs_aux = manifest.auxiliary_state, expected.auxiliary_state
    _require_equal(
        "auxiliary_state.base_model_weights_sha256",
        ours_aux.get("base_model_weights_sha256", _ABSENT),
        theirs_aux.get("base_model_weights_sha256", _ABSENT),
    )
    # The planning identity (loss route, kernel paths) before the provenance digest that also
    # covers the kernel paths: a resume under another GDN path or kernel set names the operation.
    _require_equal(
        "auxiliary_state.training_runtime_planning_identity",
        ours_aux.get("training_runtime_planning_identity", _ABSENT),
        theirs_aux.get("training_runtime_planning_identity", _ABSENT),
    )
    _require_equal(
        "auxiliary_state.execution_provenance.provenance_sha256",
        _get(ours_aux, "execution_provenance", "provenance_sha256"),
        _get(theirs_aux, "execution_provenance", "provenance_sha256"),
    )
    # The held-out validation corpus and schedule, named before the digests that also cover it.
    _require_equal(
        f"auxiliary_state.{VALIDATION_AUX_KEY}",
        ours_aux.get(VALIDATION_AUX_KEY, _ABSENT),
        theirs_aux.get(VALIDATION_AUX_KEY, _ABSENT),
    )
    _require_equal("auxiliary_state", ours_aux, theirs_aux)
    epochs = manifest.effective_config.get("epochs")
    if manifest.progress.global_step >= manifest.progress.total_steps or (
        isinstance(epochs, int) and manifest.progress.epoch_index >= epochs
    ):
        raise CheckpointError(
            f"progress.epoch_index: {manifest.progress.epoch_index} of {epochs} epochs "
            f"(global_step {manifest.progress.global_step} of {manifest.progress.total_steps}); "
            "the checkpointed run has nothing left to train"
        )


def _get(value: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return _ABSENT
        value = value[key]
    return value


def verify_queued_checkpoint(
    loaded: LoadedCheckpoint, *, checkpoint_id: str, manifest_sha256: str, seed: int
) -> None:
    """At dequeue: the reloaded checkpoint must be the one admission pinned (id, manifest digest, seed)."""
    m = loaded.manifest
    _require_equal("checkpoint_id", m.checkpoint_id, checkpoint_id)
    _require_equal("manifest_sha256", loaded.manifest_sha256, strip_sha256_prefix(manifest_sha256))
    _require_equal("seed", m.seed, seed)
