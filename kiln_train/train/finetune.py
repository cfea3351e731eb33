"""`finetune`: train one LoRA adapter with no server, in one call (docs/library.md).

A library run gets what a submission to the service gets, from the same code: the config is
parsed and its names checked (`kiln_train/plan/names.py`), the request is gated against the
model's backend (`kiln_train/plan/gates.py`), then `kiln_train/plan/run_plan.py: plan_run`
resolves the defaults (learning rate by optimizer, a seed drawn once), ingests the rows with the
model's tokenizer and training template and admits the memory plan. A refusal is the
`KilnError` the service would answer with (its `code`: `training_invalid_request`,
`training_will_not_fit`, `adapter_already_exists`, `training_backend_unsupported`), raised
before anything is written. Then `train_sft` trains with the pinned plan and publishes the
adapter, its receipt and its checkpoints into `output_dir`, an adapter registry laid out like
the service's `<storage.root>/adapters/`.

What the service adds around a run (the job store, the queue, leases, fencing, re-verification
at dequeue) has no counterpart here: nothing waits between planning and training.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from kiln_train.data.ingestion import IngestionResult, LengthRule
from kiln_train.data.row_source import row_source
from kiln_train.data.validation import ValidationSet, prepare_validation
from kiln_train.errors import ADAPTER_ALREADY_EXISTS, KilnError, backend_unsupported, invalid_request
from kiln_train.ground.backend import backend_for_device
from kiln_train.plan.budget import apply_cpu_allocator_policy, device_memory, memory_budget
from kiln_train.plan.gates import check_base_adapter, check_static_gates, resident_target
from kiln_train.plan.names import check_no_later_checkpoints, check_request_names
from kiln_train.plan.run_plan import RunPlan, plan_run
from kiln_train.sft_config import SftConfig, ValidationSpec, describe_validation_error, parse_sft_config
from kiln_train.train.evaluation import Evaluation
from kiln_train.train.request import TrainRequest
from kiln_train.train.resident import ResidentModel, load_resident, missing_device
from kiln_train.train.result import StepReport, TrainResult
from kiln_train.train.trainer import new_run_id, train_sft
from kiln_train.train.warmup import warm_up

# The service's `[memory]` defaults (docs/configuration.md): 1 GiB kept free, no cap.
DEFAULT_RESERVE_GB = 1.0

Data = list[dict] | str | Path


def finetune(
    model: str | Path | ResidentModel,
    data: Data,
    config: dict | SftConfig | None,
    output_dir: str | Path,
    *,
    progress: Callable[[StepReport], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    device: str = "cpu",
    reserve_gb: float = DEFAULT_RESERVE_GB,
    training_memory_gb: float | None = None,
    validation: dict | ValidationSpec | None = None,
    on_evaluation: Callable[[Evaluation], None] | None = None,
) -> TrainResult:
    """Train one LoRA adapter on `data` and publish it into `output_dir`; returns the run's
    `TrainResult` (`status` "success" with `adapter_path`, or "failed" with a failed receipt).

    - `model`: a Hugging Face Qwen3.5 checkpoint directory (loaded on `device`: "cpu", "cuda"
      or "cuda:N"), or a `ResidentModel` already loaded with `load_resident` (reused as is).
    - `data`: the example objects of a request's `examples`, or the path of a JSONL file (one
      conversation per line; ingested like a `dataset_path`).
    - `config`: the request's `config` as a dict (or an `SftConfig`); omitted fields take the
      service's defaults and an omitted seed is drawn once (the receipt records it).
      `resume_checkpoint` and `base_adapter` name directories inside `output_dir`.
    - `progress` is called after every optimizer step; `should_stop` is polled after every step
      and True stops the run at a checkpoint (failure reason `cancelled`).
    - `reserve_gb` and `training_memory_gb` bound the memory budget as the service's
      `[memory]` settings do.
    - `validation`: a request's `validation` (docs/validation.md): `{"examples": [...]}`,
      `{"dataset_path": FILE}` (any JSONL file here) or `{"holdout_percent": P}`, with an optional
      `interval_steps`; `on_evaluation` is called with each evaluation.

    Raises `KilnError` (its `code` and `message` name the field, row or file) when the service
    would refuse the same submission; nothing is written then.
    """
    parsed = _parse_config(config)
    spec = _parse_validation(validation)
    check_request_names(parsed)
    memory = _memory_settings(reserve_gb, training_memory_gb)
    registry = Path(output_dir).expanduser().resolve()
    resident = model if isinstance(model, ResidentModel) else _load(model, device, memory)
    plan, run_id = _plan(resident, parsed, data, registry, memory, spec)
    registry.mkdir(parents=True, exist_ok=True)
    return train_sft(
        TrainRequest(
            resident=resident,
            config=plan.config,
            ingestion=plan.ingestion,
            loss_route=resident.backend.sft_loss_route,
            output_root=registry,
            adapter_name=plan.config.output_name,
            progress=progress,
            should_stop=should_stop,
            checkpoint_plan=plan.checkpoint_plan(),
            resume_checkpoint=plan.resume.path if plan.resume is not None else None,
            run_id=run_id,
            validation=plan.validation,
            on_evaluation=on_evaluation,
            requested_config=parsed.model_dump(mode="json", exclude_unset=True),
        )
    )


def _parse_config(config: dict | SftConfig | None) -> SftConfig:
    if isinstance(config, SftConfig):
        return config
    return parse_sft_config(config, field_path=("config",))


def _parse_validation(validation: dict | ValidationSpec | None) -> ValidationSpec | None:
    if validation is None or isinstance(validation, ValidationSpec):
        return validation
    try:
        return ValidationSpec.model_validate(validation)
    except ValidationError as exc:
        raise invalid_request(describe_validation_error(exc, ("validation",))) from None


def _validate(
    resident: ResidentModel, spec: ValidationSpec | None, config: SftConfig, ingestion: IngestionResult
) -> tuple[IngestionResult, ValidationSet | None]:
    """The held-out rows, as the service derives them; a `dataset_path` is any JSONL file here."""
    root = None
    if spec is not None and spec.dataset_path is not None:
        path = Path(spec.dataset_path).expanduser().resolve()
        spec, root = spec.model_copy(update={"dataset_path": str(path)}), path.parent
    return prepare_validation(
        spec,
        ingestion,
        tokenizer=resident.tokenizer,
        template=resident.template,
        policy=config.invalid_row_policy,
        seed=config.seed,
        datasets_root=root,
        limit=LengthRule.of_config(config),
    )


def _memory_settings(reserve_gb: float, training_memory_gb: float | None) -> dict:
    """The `[memory]` values of this run, checked as the settings check them."""
    if isinstance(reserve_gb, bool) or not isinstance(reserve_gb, int | float) or not reserve_gb >= 0:
        raise invalid_request(f"reserve_gb must be a non-negative number, got {reserve_gb!r}")
    if training_memory_gb is not None and (
        isinstance(training_memory_gb, bool)
        or not isinstance(training_memory_gb, int | float)
        or not training_memory_gb > 0
    ):
        raise invalid_request(
            f"training_memory_gb must be a positive number or None, got {training_memory_gb!r}"
        )
    return {"reserve_gb": reserve_gb, "training_memory_gb": training_memory_gb}


def _load(model_dir: str | Path, device: str, memory: dict) -> ResidentModel:
    """Load the model as the worker does: the CPU allocator policy first, the memory settings in
    the execution identity, one warm-up step before the budget is measured."""
    try:
        backend_for_device(device)
    except ValueError as exc:
        raise invalid_request(f"device {device!r}: {exc}") from None
    problem = missing_device(device)
    if problem is not None:
        raise backend_unsupported(f"device {device!r}: {problem}")
    if device == "cpu":
        apply_cpu_allocator_policy()
    try:
        resident = load_resident(model_dir, device=device, server_config={"memory": memory})
    except OSError as exc:
        raise backend_unsupported(f"cannot load the model at {model_dir}: {exc.strerror or exc}") from None
    warm_up(resident)
    return resident


def _plan(
    resident: ResidentModel,
    config: SftConfig,
    data: Data,
    registry: Path,
    memory: dict,
    validation: ValidationSpec | None = None,
) -> tuple[RunPlan, str]:
    """The static gates, then `plan_run`, then the names the run will publish."""
    target = resident_target(resident.backend, resident.config)
    check_static_gates(target, config)
    check_base_adapter(config, registry, target.model)
    if config.output_name is not None:
        _check_adapter_free(registry, config.output_name)
    run_id = new_run_id()
    plan = plan_run(
        config,
        target,
        adapters_dir=registry,
        ingest=lambda effective: _ingest(resident, data, effective),
        available_bytes=lambda: _available_bytes(resident, memory),
        default_output_name=f"sft-{run_id[:8]}",
        server=False,
        validate=lambda effective, ingestion: _validate(resident, validation, effective, ingestion),
    )
    name = plan.config.output_name
    assert name is not None
    _check_adapter_free(registry, name)
    start = plan.resume.manifest.progress.global_step if plan.resume is not None else 0
    check_no_later_checkpoints(registry, name, start, resumed=plan.resume is not None)
    return plan, run_id


def _ingest(resident: ResidentModel, data: Data, config: SftConfig) -> IngestionResult:
    if isinstance(data, str | Path):
        source = row_source(dataset_path=data)
    elif isinstance(data, list | tuple):
        if not data:
            raise invalid_request("examples must contain at least one example")
        source = row_source(examples=list(data))
    else:
        raise invalid_request(
            f"data must be a list of example objects or the path of a JSONL file, got {type(data).__name__}"
        )
    return source.ingest(
        tokenizer=resident.tokenizer,
        template=resident.template,
        policy=config.invalid_row_policy,
        limit=LengthRule.of_config(config),
    )


def _available_bytes(resident: ResidentModel, memory: dict) -> int:
    backend = resident.backend
    budget = memory_budget(backend, device_memory(backend.device), **memory)
    if budget is None:
        raise backend_unsupported(f"device {backend.device} reports no free memory to plan against")
    return budget


def _check_adapter_free(registry: Path, name: str) -> None:
    """Adapter names are never overwritten (409 `adapter_already_exists`, as the service)."""
    if (registry / name).exists():
        raise KilnError(ADAPTER_ALREADY_EXISTS, f"adapter directory {name!r} already exists in the registry")
