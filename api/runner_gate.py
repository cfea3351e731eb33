"""The live runner as admission sees it (docs/ARCHITECTURE.md#the-path-of-one-job, step 5).

Admission never guesses what the worker holds: backend, device, dtypes, loss route, model shape
and tokenizer all come from the runner's row in `runners`. A row the api cannot interpret
(unknown device, a loss route with no estimator, a shape that is not Qwen3.5) is a 501, never a
"close enough" plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kiln.store import Runner
from kiln_train.data.chat_template import training_template
from kiln_train.errors import backend_unsupported
from kiln_train.ground.backend import backend_for_device
from kiln_train.model.config import parse_config
from kiln_train.plan.formulas import ESTIMATED_ROUTES
from kiln_train.plan.gates import TrainingTarget, sft_optimizer_kinds
from kiln_train.plan.optimizer_support import native_training_unavailable_reason


@dataclass(frozen=True)
class RunnerTarget(TrainingTarget):
    """Everything admission pins from the live runner: what a run is planned against, and the
    runner's id, execution identity, model path, model identity and memory."""

    runner_id: str
    execution_identity_digest: str
    model_path: str
    identity: dict
    free_memory_bytes: int | None
    total_memory_bytes: int | None


def runner_target(runner: Runner) -> RunnerTarget:
    """Interpret the runner row; 501 `training_backend_unsupported` when SFT cannot run on it."""
    reason = native_training_unavailable_reason(runner.optimizer_support)
    if reason is not None:
        raise backend_unsupported(f"runner {runner.id}: {reason}")
    try:
        backend = backend_for_device(runner.device)
    except ValueError as exc:
        raise backend_unsupported(f"runner {runner.id}: {exc}") from None
    if backend.name != runner.backend:
        raise backend_unsupported(
            f"runner {runner.id} reports backend {runner.backend!r} on device {runner.device!r}, which "
            f"belongs to the {backend.name!r} backend"
        )
    if runner.loss_route not in ESTIMATED_ROUTES:
        raise backend_unsupported(
            f"runner {runner.id} uses the SFT loss route {runner.loss_route!r}, which this server cannot "
            f"price in memory (known: {', '.join(ESTIMATED_ROUTES)})"
        )
    # The runner's own facts win over the device defaults (they are what it actually holds).
    backend = dataclasses.replace(
        backend,
        base_weight_dtype=runner.base_weight_dtype,
        lora_dtype=runner.lora_dtype,
        sft_loss_route=runner.loss_route,
    )
    identity = runner.model_config.get("identity")
    if not isinstance(identity, dict):
        raise backend_unsupported(f"runner {runner.id} registered no model identity")
    return RunnerTarget(
        runner_id=runner.id,
        backend=backend,
        model=parse_config(runner.model_config),
        loss_route=runner.loss_route,
        execution_identity_digest=runner.execution_identity_digest,
        model_path=runner.model_path,
        identity=identity,
        allowed_optimizer_kinds=sft_optimizer_kinds(runner.optimizer_support),
        free_memory_bytes=runner.free_memory_bytes,
        total_memory_bytes=runner.total_memory_bytes,
    )


def check_training_template(target: RunnerTarget) -> None:
    """The api renders rows with the same training template the runner pinned (501 otherwise)."""
    pinned = target.identity.get("training_chat_template_sha256")
    ours = "sha256:" + training_template().sha256
    if pinned is not None and pinned != ours:
        raise backend_unsupported(
            f"the runner's training chat template is {pinned} but this api renders with {ours}; "
            "upgrade the api and the worker together"
        )
