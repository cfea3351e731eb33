"""One SFT run in progress: the LoRA set and optimizer it trains, its loop over the epochs, and
the exact checkpoints it publishes (`native_online_lora_v1`, docs/training-profile.md#update-rule).

One admitted conversation is one microbatch is one optimizer step; `epochs × rows_kept` steps;
each epoch visits every row once in the seed-derived order `kiln-py.epoch-order.v1`; the
learning rate is constant; no clipping, warmup, schedule or accumulation. A non-finite loss fails
the run (`nan_loss`); the optimizer refuses a step whose gradient set is not exactly the LoRA
leaves.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kiln_train import checkpoint as ckpt
from kiln_train.artifacts.adapter import adapter_identity, check_adapter_name, load_base_adapter
from kiln_train.artifacts.adapter_layout import TRAIN_RECEIPT
from kiln_train.artifacts.fencing import Fence
from kiln_train.errors import ADAPTER_ALREADY_EXISTS, KilnError, TrainingFailure
from kiln_train.model.lora import release_lora
from kiln_train.optim.kinds import keeps_state
from kiln_train.optim.request_optimizer import optimizer_for
from kiln_train.optim.state import encode_state
from kiln_train.plan.row_plan import per_row_plan
from kiln_train.train.anomaly import anomaly_scan
from kiln_train.train.evaluation import Evaluation, EvaluationStopped, best_evaluation, evaluate
from kiln_train.train.grad_norms import GradNormAccumulator
from kiln_train.train.identity import auxiliary_state
from kiln_train.train.invariants import check_config_for_training, verify_rows
from kiln_train.train.loop_progress import LoopProgress
from kiln_train.train.loss import sft_loss
from kiln_train.train.result import StepReport
from kiln_train.train.resume_state import ResumeState, check_manifest, read_resume_state
from kiln_train.train.scope import training_scope

log = logging.getLogger(__name__)


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
        validation=None,
        on_evaluation: Callable[[Evaluation], None] | None = None,
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
        self.loop = LoopProgress(loss_history=[])
        self.grads = GradNormAccumulator()
        self.checkpoints: list[dict] = []
        self.lora = None
        self.optimizer = None
        self.segments: list[int] = []
        self.aux: dict = {}
        self.base_adapter_identity: dict | None = None
        self.on_checkpoint: Callable[[dict], None] | None = on_checkpoint
        self.fence = fence
        self.validation = validation  # a kiln_train.data.validation.ValidationSet, or None
        self.on_evaluation = on_evaluation
        self.validation_history: list[dict] = []  # every evaluation so far (a resume's included)

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
        self._check_validation()
        self.segments, entries = per_row_plan(
            self.resident.config, self.resident.backend, c, self.ingestion, self.plan, self.route
        )
        self.aux = auxiliary_state(self.resident, c, self.ingestion, self.route, entries, self.plan)
        if self.validation is not None:
            self.aux[ckpt.VALIDATION_AUX_KEY] = self.validation.identity()
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

    def _check_validation(self) -> None:
        """The validation rows match the part of the receipt that admitted them (or there are
        none on either side)."""
        part = self.ingestion.receipt.get("validation")
        if self.validation is None:
            if part is not None:
                raise TrainingFailure(
                    "data_schema_error",
                    "the ingestion receipt records validation rows but the run was given no validation set",
                )
            return
        try:
            self.validation.check()
        except ValueError as exc:
            raise TrainingFailure("data_schema_error", str(exc)) from None
        if part != self.validation.part:
            raise TrainingFailure(
                "data_schema_error", "the validation rows differ from the ingestion receipt's validation part"
            )

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

    def _load_resume(self, path: Path) -> ResumeState:
        """Full validation of the checkpoint against this run, all before any model work."""
        loaded, lineage = check_manifest(
            path,
            config=self.config,
            adapter_name=self.adapter_name,
            resident=self.resident,
            ingestion=self.ingestion,
            auxiliary_state=self.aux,
        )
        # Resume ignores the request's base_adapter: the run's lineage is the checkpoint's.
        self.config = self.config.model_copy(update={"base_adapter": lineage.base_adapter})
        self.aux = dict(lineage.auxiliary_state)
        # The evaluations so far continue; each checkpoint records the history up to its step.
        self.validation_history = list(self.aux.pop(ckpt.VALIDATION_HISTORY_AUX_KEY, None) or [])
        self.base_adapter_identity = lineage.base_adapter_identity
        return read_resume_state(loaded, self.model, self.config)

    def _restore(self, resume: ResumeState) -> None:
        m = resume.loaded.manifest
        self.lora.load_state_dict(resume.adapter, strict=True)
        if resume.optimizer_state is not None:
            self.optimizer.load_state_tensors(resume.optimizer_state, global_step=m.progress.global_step)
        self.optimizer.step_count = m.progress.global_step
        ls = resume.loaded.loop_state
        self.loop = LoopProgress(
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
        """Every remaining step, each followed by its phases in order: record (the loop state, the
        epoch's end, the progress report), evaluate, checkpoint, stop."""
        c, lp = self.config, self.loop
        if self._evaluation_due(lp.global_step) and not self._evaluate(should_stop):
            # Stopped during the baseline (nothing trained yet) or during the evaluation a resume
            # owed at its start (the checkpoint it resumed from stays the resume point).
            raise TrainingFailure(
                "cancelled",
                f"training cancelled by user during the validation at global step {lp.global_step} of "
                f"{self.total_steps}, before any further step",
            )
        while lp.epoch_index < c.epochs:
            order = ckpt.epoch_order(c.seed, lp.epoch_index, self.n)
            while lp.cursor < self.n:
                t0 = time.perf_counter()
                item = order[lp.cursor]
                loss = self.step(item)
                epoch_done = self._record(item, loss, t0, progress)
                interrupted = self._evaluate_if_due(should_stop)
                saved = self._checkpoint_if_due()
                self._stop_if_asked(should_stop, interrupted=interrupted, saved=saved)
                if epoch_done:
                    break

    def _record(self, item: int, loss: float, t0: float, progress) -> bool:
        """Phase 1: count the step, close the epoch at its last row, report progress. The step is
        recorded before its checkpoint is published, so a checkpoint found on disk always has its
        steps recorded (and can be adopted after a crash). True when the epoch ended."""
        c, lp = self.config, self.loop
        row = self.ingestion.rows[item]
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
            item=item,
            row_index=row.row_index,
        )
        epoch_done = lp.cursor == self.n
        if epoch_done:
            self._end_epoch()
        if progress is not None:
            progress(report)
        return epoch_done

    def _evaluate_if_due(self, should_stop) -> bool:
        """Phase 2: evaluate the validation rows when due; True when a stop interrupted it. After
        the last step a stop is not honoured, so the final evaluation runs whole."""
        if not self._evaluation_due(self.loop.global_step):
            return False
        poll = should_stop if self.loop.global_step < self.total_steps else None
        return not self._evaluate(poll)

    def _checkpoint_if_due(self) -> bool:
        """Phase 3: the checkpoint every `checkpoint_interval` steps (none after the last step)."""
        interval, step = self.config.checkpoint_interval, self.loop.global_step
        if interval and step % interval == 0 and step < self.total_steps:
            self.write_checkpoint()
            return True
        return False

    def _stop_if_asked(self, should_stop, *, interrupted: bool, saved: bool) -> None:
        """Phase 4: honour a stop (a cancel, a warm shutdown) before the last step: checkpoint this
        step unless phase 3 just did, then end the run `cancelled`."""
        step = self.loop.global_step
        if should_stop is None or step >= self.total_steps or not (interrupted or should_stop()):
            return
        stopped = f"training cancelled by user at global step {step} of {self.total_steps}"
        if not saved:
            try:
                self.write_checkpoint()
            except OSError as exc:
                # The stop is still honoured (a full or failing disk must not turn a cancel or a
                # warm shutdown into a crash); the run's latest earlier checkpoint stays its resume
                # point.
                raise TrainingFailure(
                    "cancelled",
                    f"{stopped}; the checkpoint at this step could not be written "
                    f"({type(exc).__name__}: {exc}), so the latest earlier checkpoint, if "
                    "any, is the resume point",
                ) from exc
        raise TrainingFailure("cancelled", stopped)

    # ----- validation ----------------------------------------------------------------------------
    def _evaluation_due(self, step: int) -> bool:
        """Whether the validation rows are evaluated at `step` (and have not been yet): the baseline
        (step 0), every epoch's end, every `interval_steps` steps."""
        if self.validation is None:
            return False
        if self.validation_history and self.validation_history[-1]["global_step"] >= step:
            return False
        interval = self.validation.interval_steps
        return step == 0 or step % self.n == 0 or bool(interval and step % interval == 0)

    def _evaluate(self, should_stop) -> bool:
        """Evaluate the validation rows now; False when a stop request interrupted it (nothing is
        recorded then). Touches no tensor, state or random stream of the training."""
        lp = self.loop
        try:
            evaluation = evaluate(
                self.model,
                self.validation.rows,
                route=self.route,
                device=self.device,
                global_step=lp.global_step,
                epoch=lp.epoch_index,
                should_stop=should_stop,
            )
        except EvaluationStopped:
            log.info("validation at global step %d interrupted by a stop request", lp.global_step)
            return False
        self.validation_history.append(evaluation.to_json())
        if self.on_evaluation is not None:
            self.on_evaluation(evaluation)
        return True

    def validation_section(self) -> dict | None:
        """The receipt's `validation` section: the corpus, every evaluation, the best one."""
        if self.validation is None:
            return None
        history = [dict(e) for e in self.validation_history]
        return {**self.validation.identity(), "evaluations": history, "best": best_evaluation(history)}

    def _checkpoint_aux(self) -> dict:
        if self.validation is None:
            return self.aux
        return {**self.aux, ckpt.VALIDATION_HISTORY_AUX_KEY: [dict(e) for e in self.validation_history]}

    def _end_epoch(self) -> None:
        self.loop.end_epoch(self.n)

    # ----- checkpoints ----------------------------------------------------------------------
    def write_checkpoint(self) -> ckpt.PublishedCheckpoint:
        from safetensors.torch import save as save_tensors

        c, lp = self.config, self.loop
        t0 = time.perf_counter()
        tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(self.lora.state_dict().items())}
        artifacts = {ckpt.ADAPTER_FILE: save_tensors(tensors, metadata={"format": "pt"})}
        if keeps_state(c.optimizer.kind):
            artifacts[ckpt.OPTIMIZER_FILE] = encode_state(self.optimizer.state_tensors())
        artifacts[ckpt.LOOP_STATE_FILE] = lp.state(self.grads).to_bytes()
        finished = lp.epoch_index >= c.epochs
        order = [] if finished else ckpt.epoch_order(c.seed, lp.epoch_index, self.n)
        draft = ckpt.sft_manifest_draft(
            config=c,
            adapter_name=self.adapter_name,
            precision_policy=self.resident.backend.precision_policy(keeps_state(c.optimizer.kind)),
            global_step=lp.global_step,
            total_steps=self.total_steps,
            epoch_index=lp.epoch_index,
            cursor_in_epoch=lp.cursor,
            data_order=order,
            content_sha256=self.ingestion.receipt["kept_corpus_sha256"],
            item_count=self.n,
            auxiliary_state=self._checkpoint_aux(),
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
