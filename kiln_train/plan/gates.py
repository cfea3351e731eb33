"""The cheap checks of a request against the model and backend it would train on, before any
row is tokenized: the optimizer tuple, an explicit segment count, and a warm start's base
adapter files (docs/training-profile.md#what-is-refused). Torch-free.

The service checks against what the live runner registered (`api/runner_gate.py: runner_target`
builds its `TrainingTarget`); the library checks against the model it loaded
(`resident_target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln_train.artifacts.adapter import check_base_adapter_files
from kiln_train.errors import TrainingFailure, backend_unsupported, invalid_request
from kiln_train.ground.backend import Backend
from kiln_train.model.config import Qwen35Config
from kiln_train.plan.optimizer_support import (
    check_optimizer_tuple,
    native_training_unavailable_reason,
    optimizer_support_report,
)
from kiln_train.plan.segments import check_segment_request
from kiln_train.sft_config import SftConfig


@dataclass(frozen=True)
class TrainingTarget:
    """What a run is planned against: the backend, the model's shape, the SFT loss route, and
    the optimizer kinds the backend admits for SFT."""

    backend: Backend
    model: Qwen35Config
    loss_route: str
    allowed_optimizer_kinds: tuple[str, ...]


def sft_optimizer_kinds(report: dict) -> tuple[str, ...]:
    """The optimizer kinds an optimizer support report admits for the sft workload."""
    sft = next(w for w in report["workloads"] if w["workload"] == "sft")
    return tuple(sft["allowed_optimizer_kinds"])


def resident_target(backend: Backend, model: Qwen35Config) -> TrainingTarget:
    """The target of a run on a model this process holds (501 when SFT cannot run on it)."""
    report = optimizer_support_report(backend, model)
    reason = native_training_unavailable_reason(report)
    if reason is not None:
        raise backend_unsupported(f"the {backend.name} backend: {reason}")
    return TrainingTarget(
        backend=backend,
        model=model,
        loss_route=backend.sft_loss_route,
        allowed_optimizer_kinds=sft_optimizer_kinds(report),
    )


def check_static_gates(target: TrainingTarget, config: SftConfig) -> None:
    """Optimizer tuple (kind x rank range) and an explicit segment count the route allows (400)."""
    kind = config.optimizer.kind
    if kind not in target.allowed_optimizer_kinds:
        raise invalid_request(
            f"config.optimizer.kind {kind!r} is not supported for sft by the resident runner "
            f"(allowed: {', '.join(target.allowed_optimizer_kinds) or 'none'})"
        )
    check_optimizer_tuple(target.backend, target.model, kind, config.lora_rank)
    check_segment_request(target.model, target.loss_route, config.grad_checkpoint_segments)


def check_base_adapter(config: SftConfig, adapters_dir: Path, model: Qwen35Config) -> None:
    """A warm start needs a base adapter in the registry that fits the model, the run's rank and
    alpha (adapter_config.json and the safetensors header; no tensor is read). The trainer
    re-checks everything, values and provenance included, when the run starts. A resume ignores
    `base_adapter` (docs/checkpoints.md#resume), so it is not checked then."""
    name = config.base_adapter
    if name is None or config.resume_checkpoint is not None:
        return
    path = adapters_dir / name
    if not path.is_dir():
        raise invalid_request(f"config.base_adapter {name!r} is not an adapter in the registry")
    try:
        check_base_adapter_files(path, model, config.lora_rank, config.lora_alpha)
    except TrainingFailure as exc:
        raise invalid_request(f"config.base_adapter {name!r}: {exc.message}") from None
