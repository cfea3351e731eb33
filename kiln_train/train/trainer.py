"""The native SFT trainer: `native_online_lora_v1` (seed 000 "Update contract").

One admitted conversation is one microbatch is one optimizer step; `epochs × rows_kept` steps;
each epoch visits every row once in the seed-derived order `kiln-py.epoch-order.v1`; the
learning rate is constant; no clipping, warmup, schedule or accumulation. A non-finite loss fails
the run (`nan_loss`); the optimizer refuses a step whose gradient set is not exactly the LoRA
leaves. `train_sft` is the library entry point; the worker calls the same function.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln_train import checkpoint as ckpt
from kiln_train.artifacts.adapter import adapter_identity, check_adapter_name, load_base_adapter
from kiln_train.artifacts.adapter_layout import CANARY_STATUS, TRAIN_RECEIPT
from kiln_train.artifacts.fencing import Fence
from kiln_train.artifacts.receipt import RunFacts, build_receipt
from kiln_train.data.ingestion import IngestionResult
from kiln_train.errors import (
    ADAPTER_ALREADY_EXISTS,
    KilnError,
    OwnershipLost,
    TrainingFailure,
    invalid_request,
)
from kiln_train.model.resident import ResidentModel
from kiln_train.optim import Optimizer, build_optimizer
from kiln_train.optim.state import encode_state
from kiln_train.sft_config import SftConfig
from kiln_train.train.anomaly import anomaly_scan
from kiln_train.train.canary import canary_status, run_smoke_test
from kiln_train.train.loss import sft_loss
from kiln_train.train.support import (
    DIVERGENCE_MARGIN,
    DIVERGENCE_RATIO,
    GradNormAccumulator,
    StepReport,
    TrainResult,
    auxiliary_state,
    check_config_for_training,
    classify_exception,
    default_checkpoint_plan,
    new_run_id,
    peak_memory_bytes,
    per_row_plan,
    publish_success,
    release_lora,
    run_facts,
    training_scope,
    verify_rows,
    write_failed_receipt,
)

log = logging.getLogger(__name__)


def optimizer_for(config: SftConfig, params) -> Optimizer:
    """The optimizer `config.optimizer` names, at the run's learning rate, over `params`."""
    choice = config.optimizer
    return build_optimizer(choice.kind, params, config.learning_rate, **choice.model_dump(exclude={"kind"}))


@dataclass
class _Loop:
    """Mutable progress of the main phase (what `sft_loop_state.json` serialises)."""

    global_step: int = 0
    epoch_index: int = 0
    cursor: int = 0
    loss_history: list[float] | None = None
    epoch_loss_sum: float = 0.0
    epoch_items: int = 0
    first_epoch_loss: float | None = None
    best_epoch_loss: float | None = None

    def state(self, grads: GradNormAccumulator) -> ckpt.SftLoopState:
        history = list(self.loss_history or [])
        return ckpt.SftLoopState(
            global_step=self.global_step,
            epoch_index=self.epoch_index,
            cursor_in_epoch=self.cursor,
            loss_history=history,
            last_loss=history[-1] if history else None,
            current_epoch_loss_sum=self.epoch_loss_sum,
            current_epoch_items=self.epoch_items,
            first_epoch_loss=self.first_epoch_loss,
            best_epoch_loss=self.best_epoch_loss,
            lora_grad_norms=dict(grads.stats),
        )


@dataclass(frozen=True)
class _Resume:
    """A checkpoint validated for this run, with its tensors decoded on the host."""

    loaded: ckpt.LoadedCheckpoint
    adapter: dict[str, torch.Tensor]
    optimizer_state: dict[str, torch.Tensor] | None

    @property
    def start_step(self) -> int:
        return self.loaded.manifest.progress.global_step


class SftRun:
    """One call of `train_sft`: the state shared by the loop, checkpoints and publication."""

    def __init__(
        self,
        resident,
        config,
        ingestion,
        *,
        loss_route,
        registry,
        adapter_name,
        plan,
        run_id,
        on_checkpoint=None,
        fence: Fence | None = None,
    ):
        self.resident = resident
        self.config = config
        self.ingestion = ingestion
        self.route = loss_route
        self.registry = Path(registry)
        self.adapter_name = adapter_name
        self.plan = plan
        self.run_id = run_id
        self.model = resident.model
        self.device = torch.device(resident.backend.device)
        self.n = len(ingestion.rows)
        self.total_steps = config.epochs * self.n
        self.loop = _Loop(loss_history=[])
        self.grads = GradNormAccumulator()
        self.checkpoints: list[dict] = []
        self.lora = None
        self.optimizer = None
        self.segments: list[int] = []
        self.aux: dict = {}
        self.base_adapter_identity: dict | None = None
        self.on_checkpoint: Callable[[dict], None] | None = on_checkpoint
        self.fence = fence

    # ----- set-up ------------------------------------------------------------------------
    def prepare(self, resume_checkpoint: Path | None, *, may_stop: bool = True) -> None:
        """Every check, then the LoRA set and optimizer. A resume is refused, naming the field or
        file, before any model work: the checkpoint (files, manifest, identity, tensors and
        optimizer state against the LoRA layout) is fully validated before LoRA tensors exist."""
        from kiln_train.model import attach_lora

        release_lora(self.model)  # a crashed earlier job must not leave its pairs attached
        c = self.config
        if (self.registry / self.adapter_name).exists() and not self._leftover_adapter():
            # Names are immutable: discover the clash now, not after the whole run.
            raise TrainingFailure(
                "training_error",
                f"{ADAPTER_ALREADY_EXISTS}: adapter {self.adapter_name!r} already exists in "
                f"{self.registry}; adapter names are never overwritten",
            )
        check_config_for_training(c, self.route, self.resident, int(self.plan.get("max_segments", 1)))
        verify_rows(self.ingestion)
        self.segments, entries = per_row_plan(self.resident, c, self.ingestion, self.plan, self.route)
        self.aux = auxiliary_state(self.resident, c, self.ingestion, self.route, entries, self.plan)
        resume = self._load_resume(resume_checkpoint) if resume_checkpoint is not None else None
        self._check_checkpoint_names(resume.start_step if resume is not None else 0, may_stop)
        c = self.config  # a resume adopts the checkpoint's base_adapter
        self.lora = attach_lora(self.model, c.lora_rank, c.lora_alpha, c.seed)
        if c.base_adapter is not None and resume is None:
            self._warm_start(c.base_adapter)
            self.aux = {**self.aux, ckpt.BASE_ADAPTER_AUX_KEY: dict(self.base_adapter_identity)}
        self.optimizer = optimizer_for(c, self.lora.named_parameters())
        if resume is not None:
            self._restore(resume)

    def _leftover_adapter(self) -> bool:
        """Whether the adapter under this run's name is a stale run's of the same job (a service
        run then replaces it when it publishes; see `kiln_train.artifacts.fencing`)."""
        if self.fence is None:
            return False
        try:
            receipt = json.loads((self.registry / self.adapter_name / TRAIN_RECEIPT).read_text("utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(receipt, dict) and self.fence.leftover_adapter(receipt)

    def _leftover_checkpoint(self, basename: str) -> bool:
        if self.fence is None:
            return False
        try:
            manifest, _ = ckpt.read_checkpoint_manifest(self.registry / basename)
        except ckpt.CheckpointError:
            return False
        return self.fence.leftover_checkpoint(basename, manifest)

    def _check_checkpoint_names(self, start: int, may_stop: bool) -> None:
        """Checkpoint names are never overwritten: refuse now, before any work, when a name this
        run may publish (an interval step, or any step a cooperative stop may land on) is taken
        (by anything but a stale run of the same job, which publication settles)."""
        interval = self.config.checkpoint_interval
        for step, basename in ckpt.checkpoint_names(self.registry, self.adapter_name).items():
            if not start < step < self.total_steps or self._leftover_checkpoint(basename):
                continue
            if may_stop or (interval and step % interval == 0):
                raise TrainingFailure(
                    "training_error",
                    f"{ADAPTER_ALREADY_EXISTS}: exact checkpoint {basename!r} of adapter "
                    f"{self.adapter_name!r} already exists in {self.registry} (step {step}, after this "
                    f"run's start at step {start}); this run could have to publish that name again and "
                    "checkpoint names are never overwritten. Resume from the newest checkpoint, or move "
                    "the later ones out of the registry",
                )

    def _warm_start(self, name: str) -> None:
        """Start from a PEFT adapter's tensors: a new run (fresh optimizer, step 0), not a resume."""
        if name.endswith(ckpt.CHECKPOINT_SUFFIX):
            raise TrainingFailure(
                "adapter_load_failed",
                f"base_adapter {name!r} is an exact training checkpoint, not a PEFT adapter; "
                "continue it with resume_checkpoint",
            )
        try:
            check_adapter_name(name)
        except KilnError:
            raise TrainingFailure(
                "base_adapter_missing", f"base_adapter {name!r} is not an adapter name"
            ) from None
        path = self.registry / name
        if not path.is_dir():
            raise TrainingFailure(
                "base_adapter_missing", f"base_adapter {name!r} is not an adapter in the registry"
            )
        tensors = load_base_adapter(
            path,
            self.resident.config,
            self.config.lora_rank,
            alpha=self.config.lora_alpha,
            model_config_sha256=self.resident.identity["model_config_sha256"],
            base_weights_sha256=self.resident.base_weights_sha256,
        )
        self.base_adapter_identity = adapter_identity(path)
        dtype = next(p for _, p in self.lora.named_parameters()).dtype
        self.lora.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)

    def _load_resume(self, path: Path) -> _Resume:
        """Full validation of the checkpoint against this run, all before any model work."""
        loaded = ckpt.load_checkpoint(path, verify_hashes=True)
        m = loaded.manifest
        expected = ckpt.sft_resume_expectation(
            config=self.config,
            adapter_name=self.adapter_name,
            precision_policy=self.resident.backend.precision_policy(self.config.optimizer.kind),
            content_sha256=self.ingestion.receipt["kept_corpus_sha256"],
            item_count=self.n,
            auxiliary_state=ckpt.with_checkpoint_lineage(self.aux, m),
            requested_seed=self.config.seed,
        )
        try:
            ckpt.compare_for_resume(m, expected)
        except ckpt.CheckpointError as exc:
            raise ckpt.CheckpointError(
                f"checkpoint {loaded.path.name!r}: {ckpt.MANIFEST_FILENAME}: {exc.detail}"
            ) from None
        # Resume ignores the request's base_adapter: the run's lineage is the checkpoint's.
        base_adapter, identity = ckpt.checkpoint_lineage(m)
        self.config = self.config.model_copy(update={"base_adapter": base_adapter})
        self.aux = expected.auxiliary_state
        self.base_adapter_identity = identity
        self._check_resume_grad_norms(loaded)
        adapter = self._resume_adapter_tensors(loaded)
        optimizer_state = self._resume_optimizer_state(loaded)
        return _Resume(loaded, adapter, optimizer_state)

    def _lora_layout(self) -> dict[str, tuple[int, ...]]:
        """PEFT key -> shape of every LoRA leaf `attach_lora` will create (no allocation)."""
        from kiln_train.model.lora import lora_key

        r = self.config.lora_rank
        layout: dict[str, tuple[int, ...]] = {}
        for proj in self.model.config.projections():
            layout[lora_key(proj.module, "A")] = (r, proj.in_features)
            layout[lora_key(proj.module, "B")] = (proj.out_features, r)
        return layout

    @staticmethod
    def _decode(loaded: ckpt.LoadedCheckpoint, rel: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load as load_tensors

        data = loaded.read_verified(rel)
        try:
            return load_tensors(data)
        except Exception as exc:  # safetensors raises its own error types for a malformed file
            raise ckpt.CheckpointError(
                f"checkpoint {loaded.path.name!r}: {rel} is not a readable safetensors file ({exc})"
            ) from None

    def _resume_adapter_tensors(self, loaded: ckpt.LoadedCheckpoint) -> dict[str, torch.Tensor]:
        """The checkpoint's adapter tensors, checked against the LoRA layout: exact key set, shapes,
        the resident parameter dtype, finite values."""
        where = f"checkpoint {loaded.path.name!r}: {ckpt.ADAPTER_FILE}"
        tensors = self._decode(loaded, ckpt.ADAPTER_FILE)
        layout, dtype = self._lora_layout(), self.model.dtype
        missing = [k for k in layout if k not in tensors]
        unknown = sorted(k for k in tensors if k not in layout)
        if missing or unknown:
            raise TrainingFailure(
                "shape_mismatch",
                f"{where}: the tensor set differs from the LoRA leaves ({len(missing)} missing, first "
                f"{missing[:1]}; {len(unknown)} unknown, first {unknown[:1]})",
            )
        for key, shape in layout.items():
            t = tensors[key]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise TrainingFailure(
                    "shape_mismatch",
                    f"{where}: tensor {key!r} is {tuple(t.shape)} {t.dtype}, the LoRA leaf is {shape} {dtype}",
                )
            if not bool(torch.isfinite(t).all()):
                raise ckpt.CheckpointError(f"{where}: tensor {key!r} holds non-finite values")
        return tensors

    def _resume_optimizer_state(self, loaded: ckpt.LoadedCheckpoint) -> dict[str, torch.Tensor] | None:
        """The checkpoint's optimizer state, validated by the optimizer's own loader against
        storage-free (meta) leaves of the LoRA layout: exact keys, shapes, F32, finite, counters."""
        rel = loaded.manifest.state_files.optimizer_state
        if rel is None:
            return None
        state = self._decode(loaded, rel)
        dtype = self.model.dtype
        leaves = [(k, torch.empty(s, dtype=dtype, device="meta")) for k, s in self._lora_layout().items()]
        probe = optimizer_for(self.config, leaves)
        where = f"checkpoint {loaded.path.name!r}: {rel}"
        step = loaded.manifest.progress.global_step
        try:
            probe.load_state_tensors(state, global_step=step)
        except TrainingFailure as exc:
            raise TrainingFailure(exc.reason, f"{where}: {exc.message}") from None
        # One conversation is one update of every leaf: each counter is the global step.
        for key, count in probe.param_steps.items():
            if count != step:
                raise ckpt.CheckpointError(
                    f"{where}: the step counter of {key!r} is {count}; every LoRA leaf is updated at each of "
                    f"the {step} steps"
                )
        return state

    def _check_resume_grad_norms(self, loaded: ckpt.LoadedCheckpoint) -> None:
        """The loop state's gradient-norm statistics hold one sample per projection and step."""
        per_target: dict[str, int] = {}
        for proj in self.model.config.projections():
            per_target[proj.target] = per_target.get(proj.target, 0) + 1
        state, step = loaded.loop_state, loaded.manifest.progress.global_step
        expected = {t: n * step for t, n in per_target.items()} if step else {}
        found = {t: s.sample_count for t, s in state.lora_grad_norms.items()}
        if found != expected:
            raise ckpt.CheckpointError(
                f"checkpoint {loaded.path.name!r}: {ckpt.LOOP_STATE_FILE}: lora_grad_norms sample counts "
                f"{found} are not one per projection and step {expected}"
            )

    def _restore(self, resume: _Resume) -> None:
        m = resume.loaded.manifest
        self.lora.load_state_dict(resume.adapter, strict=True)
        if resume.optimizer_state is not None:
            self.optimizer.load_state_tensors(resume.optimizer_state, global_step=m.progress.global_step)
        self.optimizer.step_count = m.progress.global_step
        ls = resume.loaded.loop_state
        self.loop = _Loop(
            global_step=ls.global_step,
            epoch_index=ls.epoch_index,
            cursor=ls.cursor_in_epoch,
            loss_history=list(ls.loss_history),
            epoch_loss_sum=ls.current_epoch_loss_sum,
            epoch_items=ls.current_epoch_items,
            first_epoch_loss=ls.first_epoch_loss,
            best_epoch_loss=ls.best_epoch_loss,
        )
        self.grads = GradNormAccumulator(dict(ls.lora_grad_norms))
        log.info("resumed %s at global step %d", resume.loaded.path.name, ls.global_step)

    # ----- one step ----------------------------------------------------------------------
    def step(self, row_pos: int) -> float:
        row = self.ingestion.rows[row_pos]
        ids = torch.tensor([row.input_ids], device=self.device)
        labels = torch.tensor(row.labels, device=self.device)
        named = self.lora.named_parameters()
        with training_scope():
            hidden = self.model.hidden_states(ids, num_segments=self.segments[row_pos])
            loss = sft_loss(self.route, hidden, self.model.lm_head_weight, labels)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise TrainingFailure(
                    "nan_loss",
                    f"non-finite loss {value} at global step {self.loop.global_step + 1} "
                    f"(row {row.row_index}, {row.row_sha256})",
                )
            with anomaly_scan(loss, self.config.detect_anomaly):
                loss.backward()
        grads = {name: p.grad for name, p in named if p.grad is not None}
        try:
            self.optimizer.step(grads)
            self.grads.add(grads)
        finally:
            for _, p in named:
                p.grad = None
        return value

    # ----- the loop ------------------------------------------------------------------------
    def run(self, progress, should_stop) -> None:
        c, lp = self.config, self.loop
        interval = c.checkpoint_interval
        while lp.epoch_index < c.epochs:
            order = ckpt.epoch_order(c.seed, lp.epoch_index, self.n)
            while lp.cursor < self.n:
                t0 = time.perf_counter()
                row = self.ingestion.rows[order[lp.cursor]]
                loss = self.step(order[lp.cursor])
                lp.global_step += 1
                lp.cursor += 1
                lp.loss_history.append(loss)
                lp.epoch_loss_sum += loss
                lp.epoch_items += 1
                report = StepReport(
                    global_step=lp.global_step,
                    total_steps=self.total_steps,
                    epoch=lp.epoch_index,
                    cursor=lp.cursor,
                    loss=loss,
                    step_ms=(time.perf_counter() - t0) * 1000.0,
                    tokens=row.seq_len,
                    supervised_tokens=row.supervised_tokens,
                    learning_rate=c.learning_rate,
                    item=order[lp.cursor - 1],
                    row_index=row.row_index,
                )
                epoch_done = lp.cursor == self.n
                if epoch_done:
                    self._end_epoch()
                # The step is recorded before its checkpoint is published, so a checkpoint found
                # on disk always has its steps recorded (and can be adopted after a crash).
                if progress is not None:
                    progress(report)
                saved = False
                if interval and lp.global_step % interval == 0 and lp.global_step < self.total_steps:
                    self.write_checkpoint()
                    saved = True
                if should_stop is not None and lp.global_step < self.total_steps and should_stop():
                    stopped = (
                        f"training cancelled by user at global step {lp.global_step} of {self.total_steps}"
                    )
                    if not saved:
                        try:
                            self.write_checkpoint()
                        except OSError as exc:
                            # The stop is still honoured (a full or failing disk must not turn a
                            # cancel or a warm shutdown into a crash); the run's latest earlier
                            # checkpoint stays its resume point.
                            raise TrainingFailure(
                                "cancelled",
                                f"{stopped}; the checkpoint at this step could not be written "
                                f"({type(exc).__name__}: {exc}), so the latest earlier checkpoint, if "
                                "any, is the resume point",
                            ) from exc
                    raise TrainingFailure("cancelled", stopped)
                if epoch_done:
                    break

    def _end_epoch(self) -> None:
        lp = self.loop
        avg = lp.epoch_loss_sum / self.n
        if lp.first_epoch_loss is None:
            lp.first_epoch_loss = avg
        elif avg > lp.first_epoch_loss * DIVERGENCE_RATIO and avg - lp.best_epoch_loss > DIVERGENCE_MARGIN:
            raise TrainingFailure(
                "training_error",
                f"divergence guard: epoch {lp.epoch_index + 1} mean loss {avg:.4f} exceeds "
                f"{DIVERGENCE_RATIO:g}x the first epoch's {lp.first_epoch_loss:.4f} and the best epoch "
                f"{lp.best_epoch_loss:.4f} by more than {DIVERGENCE_MARGIN:g}",
            )
        lp.best_epoch_loss = avg if lp.best_epoch_loss is None else min(lp.best_epoch_loss, avg)
        lp.epoch_index += 1
        lp.cursor = 0
        lp.epoch_loss_sum = 0.0
        lp.epoch_items = 0

    # ----- checkpoints ----------------------------------------------------------------------
    def write_checkpoint(self) -> ckpt.PublishedCheckpoint:
        from safetensors.torch import save as save_tensors

        c, lp = self.config, self.loop
        t0 = time.perf_counter()
        tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(self.lora.state_dict().items())}
        artifacts = {ckpt.ADAPTER_FILE: save_tensors(tensors, metadata={"format": "pt"})}
        if c.optimizer.kind != "sgd":
            artifacts[ckpt.OPTIMIZER_FILE] = encode_state(self.optimizer.state_tensors())
        artifacts[ckpt.LOOP_STATE_FILE] = lp.state(self.grads).to_bytes()
        finished = lp.epoch_index >= c.epochs
        order = [] if finished else ckpt.epoch_order(c.seed, lp.epoch_index, self.n)
        draft = ckpt.sft_manifest_draft(
            config=c,
            adapter_name=self.adapter_name,
            precision_policy=self.resident.backend.precision_policy(c.optimizer.kind),
            global_step=lp.global_step,
            total_steps=self.total_steps,
            epoch_index=lp.epoch_index,
            cursor_in_epoch=lp.cursor,
            data_order=order,
            content_sha256=self.ingestion.receipt["kept_corpus_sha256"],
            item_count=self.n,
            auxiliary_state=self.aux,
        )
        published = ckpt.publish_checkpoint(self.registry, draft, artifacts, fence=self.fence)
        record = {
            "checkpoint_id": published.manifest.checkpoint_id,
            "path": str(published.path),
            "basename": published.path.name,
            "global_step": lp.global_step,
            "epoch_index": lp.epoch_index,
            "cursor": lp.cursor,
            "manifest_sha256": published.manifest_sha256,
            "size_bytes": published.total_bytes,
            "write_ms": (time.perf_counter() - t0) * 1000.0,
        }
        self.checkpoints.append(record)
        if self.on_checkpoint is not None:
            self.on_checkpoint(record)
        return published


def train_sft(
    resident: ResidentModel,
    config: SftConfig,
    ingestion: IngestionResult,
    *,
    loss_route: str,
    output_root: str | Path,
    adapter_name: str | None = None,
    progress: Callable[[StepReport], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    checkpoint_plan: dict | None = None,
    resume_checkpoint: str | Path | None = None,
    on_checkpoint: Callable[[dict], None] | None = None,
    run_id: str | None = None,
    fence: Fence | None = None,
) -> TrainResult:
    """Train one LoRA adapter from admitted rows; publish the adapter or a failed receipt.

    `config` must be the effective config (`SftConfig.resolve()`), `loss_route` the route pinned
    at admission (it must equal the resident backend's). `resume_checkpoint` is a
    `.kiln-checkpoint` directory; every identity it binds must match this run. A service run
    passes its `fence` (`kiln_train.artifacts.fencing`): once the run no longer owns its job it raises
    `OwnershipLost` and leaves no receipt, adapter or checkpoint behind.
    """
    # A resumed run computes with the intra-op thread count its checkpoint recorded: CPU matmul
    # and reduction kernels split work by thread count, so any other count changes the bits.
    aux = recorded_aux(resume_checkpoint) if resume_checkpoint is not None else {}
    recorded = recorded_cpu_threads(aux)
    if resume_checkpoint is not None and checkpoint_plan is None:
        # A library resume re-derives the per-row segment plan from the checkpoint's own record
        # (an auto plan depends on the budget its first admission saw). The service pins it at
        # admission instead (api.admission adopts the same record).
        checkpoint_plan = recorded_checkpoint_plan(aux)
    with intra_op_threads(recorded):
        return _train_sft(
            resident,
            config,
            ingestion,
            loss_route=loss_route,
            output_root=output_root,
            adapter_name=adapter_name,
            progress=progress,
            should_stop=should_stop,
            checkpoint_plan=checkpoint_plan,
            resume_checkpoint=resume_checkpoint,
            on_checkpoint=on_checkpoint,
            run_id=run_id,
            fence=fence,
        )


# A manifest may claim any count; more than this is not a real machine's (the strict loader then
# refuses the checkpoint anyway, since the claim is part of its bound auxiliary state).
MAX_RECORDED_THREADS = 1024


def recorded_aux(resume_checkpoint: str | Path) -> dict:
    """A checkpoint manifest's `auxiliary_state`, read leniently ({} where it cannot be read: the
    strict loader, which runs before any training, then names what is wrong with it)."""
    try:
        manifest = json.loads((Path(resume_checkpoint) / ckpt.MANIFEST_FILENAME).read_text(encoding="utf-8"))
        aux = manifest["auxiliary_state"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return {}
    return aux if isinstance(aux, dict) else {}


def recorded_checkpoint_plan(aux: dict) -> dict | None:
    """The pinned gradient checkpoint plan a checkpoint's run used, or None (absent or malformed:
    the default plan then applies and the strict comparison reports any drift)."""
    plan = aux.get(ckpt.CHECKPOINT_PLAN_AUX_KEY)
    if isinstance(plan, dict) and set(plan) == set(ckpt.CHECKPOINT_PLAN_KEYS):
        return dict(plan)
    return None


def recorded_cpu_threads(aux: dict) -> int | None:
    """The intra-op thread count a checkpoint's run used, or None where it cannot be read."""
    runtime = aux.get("backend_runtime")
    value = runtime.get("cpu_threads") if isinstance(runtime, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_RECORDED_THREADS:
        return value
    return None


@contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """Torch's intra-op thread count set to `count` (None: left as it is) for the block."""
    before = torch.get_num_threads()
    if count is not None and count != before:
        log.info("using %d intra-op threads (recorded by the checkpoint; this process had %d)", count, before)
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _train_sft(
    resident: ResidentModel,
    config: SftConfig,
    ingestion: IngestionResult,
    *,
    loss_route: str,
    output_root: str | Path,
    adapter_name: str | None,
    progress: Callable[[StepReport], None] | None,
    should_stop: Callable[[], bool] | None,
    checkpoint_plan: dict | None,
    resume_checkpoint: str | Path | None,
    on_checkpoint: Callable[[dict], None] | None,
    run_id: str | None,
    fence: Fence | None,
) -> TrainResult:
    t0 = time.perf_counter()
    run_id = run_id or new_run_id()
    name = adapter_name or config.output_name or f"sft-{run_id[:8]}"
    # Caller errors, raised before anything is written: a bad name cannot even place a failed
    # receipt safely, and an unresolved config has no learning rate or seed to record.
    check_adapter_name(name)
    if config.seed is None or config.learning_rate is None:
        raise invalid_request(
            "train_sft needs the effective config (SftConfig.resolve()): seed and learning_rate"
        )
    registry = Path(output_root)
    device = resident.backend.device
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(torch.device(device))
    facts = run_facts(resident, config, ingestion, loss_route, name)
    facts.cpu_threads = torch.get_num_threads()
    plan = checkpoint_plan or default_checkpoint_plan(config)
    run = SftRun(
        resident,
        config,
        ingestion,
        loss_route=loss_route,
        registry=registry,
        adapter_name=name,
        plan=plan,
        run_id=run_id,
        on_checkpoint=on_checkpoint,
        fence=fence,
    )
    try:
        run.prepare(
            Path(resume_checkpoint) if resume_checkpoint is not None else None,
            may_stop=should_stop is not None,
        )
        facts.config = run.config.to_json()  # a resume adopted the checkpoint's base_adapter
        run.run(progress, should_stop)
        tensors = {k: v.detach().cpu().contiguous() for k, v in run.lora.state_dict().items()}
        smoke = None
        if config.adapter_smoke_test:
            smoke = run_smoke_test(resident.model, resident.tokenizer, config.smoke_prompts())
        _settle(facts, run, t0, device, smoke, epochs_done=config.epochs)
        extra = {CANARY_STATUS: json.dumps(canary_status(smoke), indent=2).encode()} if smoke else None
        parent = run.config.base_adapter
        path, receipt = publish_success(
            resident, facts, registry, tensors, parent_adapter=parent, extra_files=extra, fence=fence
        )
        return TrainResult(
            status="success",
            adapter_name=name,
            adapter_path=path,
            receipt=receipt,
            receipt_path=path / TRAIN_RECEIPT,
            global_step=run.loop.global_step,
            total_steps=run.total_steps,
            final_loss=run.loop.loss_history[-1] if run.loop.loss_history else None,
            checkpoints=run.checkpoints,
            peak_memory_bytes=facts.peak_memory_bytes,
            wall_clock_ms=facts.wall_clock_ms,
            loss_history=list(run.loop.loss_history),
        )
    except OwnershipLost:
        raise  # the job is another attempt's now: this run records nothing
    except Exception as exc:  # every failure ends in a receipt; nothing half-published remains
        if fence is not None:
            fence.check()  # a stale run's failure is not the job's outcome either
        reason, message = classify_exception(exc)
        if not isinstance(exc, TrainingFailure):
            log.exception("SFT run %s failed", run_id)
        _settle(facts, run, t0, device, None, epochs_done=run.loop.epoch_index)
        receipt = build_receipt(facts, status="failed", failure_reason=reason, failure_message=message)
        path = write_failed_receipt(registry, name, run_id, receipt)
        return TrainResult(
            status="failed",
            adapter_name=name,
            adapter_path=None,
            receipt=receipt,
            receipt_path=path,
            global_step=run.loop.global_step,
            total_steps=run.total_steps,
            final_loss=run.loop.loss_history[-1] if run.loop.loss_history else None,
            failure_reason=reason,
            failure_message=message,
            checkpoints=run.checkpoints,
            peak_memory_bytes=facts.peak_memory_bytes,
            wall_clock_ms=facts.wall_clock_ms,
            loss_history=list(run.loop.loss_history),
        )
    finally:
        release_lora(resident.model)


def _settle(
    facts: RunFacts, run: SftRun, t0: float, device: str, smoke: dict | None, *, epochs_done: int
) -> None:
    facts.wall_clock_ms = int((time.perf_counter() - t0) * 1000)
    facts.peak_memory_bytes = peak_memory_bytes(device)
    facts.steps_completed = run.loop.global_step
    facts.epochs_completed = epochs_done
    facts.lora_grad_norms = run.grads.receipt_rows()
    facts.adapter_smoke_test = smoke
    if run.base_adapter_identity is not None:
        facts.base_adapter = run.base_adapter_identity
