"""`train_sft`: the library entry point that trains one LoRA adapter (the worker calls it too).

It resolves the run's name, id and plan, runs an `SftRun` (`kiln_train.train.run`) and ends in
exactly one outcome: the published adapter with its receipt, or a failed receipt. A resumed run
first adopts what its checkpoint recorded (`kiln_train.train.resume_state`).
"""

from __future__ import annotations

import json
import logging
import resource
import time
import uuid
from dataclasses import replace
from pathlib import Path

import torch

from kiln_train.artifacts.adapter import check_adapter_name
from kiln_train.artifacts.adapter_layout import CANARY_STATUS, TRAIN_RECEIPT
from kiln_train.artifacts.receipt import RunFacts, build_receipt
from kiln_train.errors import OwnershipLost, TrainingFailure, invalid_request
from kiln_train.model.lora import release_lora
from kiln_train.plan.row_plan import default_checkpoint_plan
from kiln_train.train.canary import canary_status, run_smoke_test
from kiln_train.train.identity import run_facts
from kiln_train.train.publication import publish_success, write_failed_receipt
from kiln_train.train.request import TrainRequest
from kiln_train.train.result import TrainResult, classify_exception
from kiln_train.train.resume_state import (
    intra_op_threads,
    recorded_aux,
    recorded_checkpoint_plan,
    recorded_cpu_threads,
)
from kiln_train.train.run import SftRun

log = logging.getLogger(__name__)


def train_sft(request: TrainRequest) -> TrainResult:
    """Train one LoRA adapter from admitted rows; publish the adapter or a failed receipt.

    `request.config` must be the effective config (`SftConfig.resolve()`), `loss_route` the
    route pinned at admission (it must equal the resident backend's). `resume_checkpoint` is a
    `.kiln-checkpoint` directory; every identity it binds must match this run. A service run
    passes its `fence` (`kiln_train.artifacts.fencing`): once the run no longer owns its job it raises
    `OwnershipLost` and leaves no receipt, adapter or checkpoint behind.
    """
    # A resumed run computes with the intra-op thread count its checkpoint recorded: CPU matmul
    # and reduction kernels split work by thread count, so any other count changes the bits.
    resume_checkpoint = request.resume_checkpoint
    aux = recorded_aux(resume_checkpoint) if resume_checkpoint is not None else {}
    recorded = recorded_cpu_threads(aux)
    if resume_checkpoint is not None and request.checkpoint_plan is None:
        # A library resume re-derives the per-row segment plan from the checkpoint's own record
        # (an auto plan depends on the budget its first admission saw). The service pins it at
        # admission instead (api.admission adopts the same record).
        request = replace(request, checkpoint_plan=recorded_checkpoint_plan(aux))
    with intra_op_threads(recorded):
        t0 = time.perf_counter()
        run, facts = _start(request)
        try:
            resume = request.resume_checkpoint
            run.prepare(
                Path(resume) if resume is not None else None, may_stop=request.should_stop is not None
            )
            facts.config = run.config.to_json()  # a resume adopted the checkpoint's base_adapter
            run.run(request.progress, request.should_stop)
            return _publish(request, run, facts, t0)
        except OwnershipLost:
            raise  # the job is another attempt's now: this run records nothing
        except Exception as exc:  # every failure ends in a receipt; nothing half-published remains
            return _fail(request, run, facts, t0, exc)
        finally:
            release_lora(request.resident.model)


def _start(request: TrainRequest) -> tuple[SftRun, RunFacts]:
    """The run and the receipt's facts, before anything is written (a bad name cannot even
    place a failed receipt safely, and an unresolved config has no learning rate or seed to record)."""
    resident, config = request.resident, request.config
    run_id = request.run_id or new_run_id()
    name = request.adapter_name or config.output_name or f"sft-{run_id[:8]}"
    check_adapter_name(name)
    if config.seed is None or config.learning_rate is None:
        raise invalid_request(
            "train_sft needs the effective config (SftConfig.resolve()): seed and learning_rate"
        )
    device = resident.backend.device
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(torch.device(device))
    facts = run_facts(resident, config, request.ingestion, request.loss_route, name)
    facts.requested_config = request.requested_config
    facts.cpu_threads = torch.get_num_threads()
    facts.attempts = request.attempts
    run = SftRun(
        resident,
        config,
        request.ingestion,
        loss_route=request.loss_route,
        registry=Path(request.output_root),
        adapter_name=name,
        plan=request.checkpoint_plan or default_checkpoint_plan(config),
        run_id=run_id,
        on_checkpoint=request.on_checkpoint,
        fence=request.fence,
        validation=request.validation,
        on_evaluation=request.on_evaluation,
    )
    return run, facts


def _publish(request: TrainRequest, run: SftRun, facts: RunFacts, t0: float) -> TrainResult:
    """After the last step: smoke-test if asked, and publish the adapter with its receipt."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in run.lora.state_dict().items()}
    config, resident = request.config, request.resident
    smoke = None
    if config.adapter_smoke_test:
        smoke = run_smoke_test(resident.model, resident.tokenizer, config.smoke_prompts())
    _settle(facts, run, t0, smoke, epochs_done=config.epochs)
    extra = {CANARY_STATUS: json.dumps(canary_status(smoke), indent=2).encode()} if smoke else None
    path, receipt = publish_success(
        resident,
        facts,
        run.registry,
        tensors,
        parent_adapter=run.config.base_adapter,
        extra_files=extra,
        fence=request.fence,
    )
    return _result(run, facts, receipt, path / TRAIN_RECEIPT, adapter_path=path)


def _fail(request: TrainRequest, run: SftRun, facts: RunFacts, t0: float, exc: Exception) -> TrainResult:
    """Record a failure: the failed receipt under the registry's failed-receipts directory."""
    if request.fence is not None:
        request.fence.check()  # a stale run's failure is not the job's outcome either
    reason, message = classify_exception(exc)
    if not isinstance(exc, TrainingFailure):
        log.exception("SFT run %s failed", run.run_id)
    _settle(facts, run, t0, None, epochs_done=run.loop.epoch_index)
    receipt = build_receipt(facts, status="failed", failure_reason=reason, failure_message=message)
    path = write_failed_receipt(run.registry, run.adapter_name, run.run_id, receipt)
    return _result(run, facts, receipt, path, adapter_path=None)


def _result(
    run: SftRun, facts: RunFacts, receipt: dict, receipt_path: Path, *, adapter_path: Path | None
) -> TrainResult:
    """The run's `TrainResult`: its progress and measurements, and the outcome its receipt records."""
    history = run.loop.loss_history
    return TrainResult(
        status=receipt["status"],
        adapter_name=run.adapter_name,
        adapter_path=adapter_path,
        receipt=receipt,
        receipt_path=receipt_path,
        global_step=run.loop.global_step,
        total_steps=run.total_steps,
        final_loss=history[-1] if history else None,
        failure_reason=receipt["failure_reason"],
        failure_message=receipt.get("failure_message"),
        checkpoints=run.checkpoints,
        peak_memory_bytes=facts.peak_memory_bytes,
        wall_clock_ms=facts.wall_clock_ms,
        loss_history=list(history),
        validation_history=[dict(e) for e in run.validation_history],
    )


def _settle(facts: RunFacts, run: SftRun, t0: float, smoke: dict | None, *, epochs_done: int) -> None:
    """Complete the receipt's facts with what the run measured."""
    facts.wall_clock_ms = int((time.perf_counter() - t0) * 1000)
    facts.peak_memory_bytes = peak_memory_bytes(run.resident.backend.device)
    facts.steps_completed = run.loop.global_step
    facts.epochs_completed = epochs_done
    facts.lora_grad_norms = run.grads.receipt_rows()
    facts.adapter_smoke_test = smoke
    facts.validation = run.validation_section()
    if run.base_adapter_identity is not None:
        facts.base_adapter = run.base_adapter_identity


def peak_memory_bytes(device: str) -> int:
    """The run's peak: device memory on CUDA, the process's peak resident set on the CPU."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
