"""The state a resumed run reads from its exact checkpoint before any work.

A resume is refused, naming the field or file, before any model work: the manifest must match
this run (`check_manifest`), then the adapter tensors, the optimizer state and the loop state's
statistics must fit the LoRA layout the run will create (`read_resume_state`). A resumed run
also computes with the intra-op thread count and the gradient checkpoint plan its checkpoint
recorded (`recorded_*`, `intra_op_threads`), read leniently before the strict load.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln_train import checkpoint as ckpt
from kiln_train.data.ingestion import IngestionResult
from kiln_train.errors import TrainingFailure
from kiln_train.model.config import Qwen35Config
from kiln_train.model.lora import lora_key
from kiln_train.optim.kinds import keeps_state
from kiln_train.optim.request_optimizer import optimizer_for
from kiln_train.sft_config import SftConfig
from kiln_train.train.resident import ResidentModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lineage:
    """What a validated checkpoint imposes on the run: its base adapter (a resume ignores the
    request's) and the auxiliary state the run binds from then on."""

    base_adapter: str | None
    base_adapter_identity: dict | None
    auxiliary_state: dict


@dataclass(frozen=True)
class ResumeState:
    """A checkpoint validated for this run, with its tensors decoded on the host."""

    loaded: ckpt.LoadedCheckpoint
    adapter: dict[str, torch.Tensor]
    optimizer_state: dict[str, torch.Tensor] | None

    @property
    def start_step(self) -> int:
        return self.loaded.manifest.progress.global_step


def check_manifest(
    path: Path,
    *,
    config: SftConfig,
    adapter_name: str,
    resident: ResidentModel,
    ingestion: IngestionResult,
    auxiliary_state: dict,
) -> tuple[ckpt.LoadedCheckpoint, Lineage]:
    """Load the checkpoint (every file hash verified) and compare its manifest with this run."""
    loaded = ckpt.load_checkpoint(path, verify_hashes=True)
    m = loaded.manifest
    expected = ckpt.sft_resume_expectation(
        config=config,
        adapter_name=adapter_name,
        precision_policy=resident.backend.precision_policy(keeps_state(config.optimizer.kind)),
        content_sha256=ingestion.receipt["kept_corpus_sha256"],
        item_count=len(ingestion.rows),
        auxiliary_state=ckpt.with_checkpoint_lineage(auxiliary_state, m),
        requested_seed=config.seed,
    )
    try:
        ckpt.compare_for_resume(m, expected)
    except ckpt.CheckpointError as exc:
        raise ckpt.CheckpointError(
            f"checkpoint {loaded.path.name!r}: {ckpt.MANIFEST_FILENAME}: {exc.detail}"
        ) from None
    base_adapter, identity = ckpt.checkpoint_lineage(m)
    return loaded, Lineage(base_adapter, identity, expected.auxiliary_state)


def read_resume_state(loaded: ckpt.LoadedCheckpoint, model, config: SftConfig) -> ResumeState:
    """The checkpoint's loop statistics, adapter tensors and optimizer state, each checked against
    the LoRA layout `attach_lora` will create on `model` for `config`."""
    check_grad_norm_samples(loaded, model.config)
    layout = lora_layout(model.config, config.lora_rank)
    adapter = adapter_tensors(loaded, layout, model.dtype)
    return ResumeState(loaded, adapter, optimizer_state(loaded, layout, model.dtype, config))


def lora_layout(config: Qwen35Config, rank: int) -> dict[str, tuple[int, ...]]:
    """PEFT key -> shape of every LoRA leaf `attach_lora` will create (no allocation)."""
    layout: dict[str, tuple[int, ...]] = {}
    for proj in config.projections():
        layout[lora_key(proj.module, "A")] = (rank, proj.in_features)
        layout[lora_key(proj.module, "B")] = (proj.out_features, rank)
    return layout


def _decode(loaded: ckpt.LoadedCheckpoint, rel: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load as load_tensors

    data = loaded.read_verified(rel)
    try:
        return load_tensors(data)
    except Exception as exc:  # safetensors raises its own error types for a malformed file
        raise ckpt.CheckpointError(
            f"checkpoint {loaded.path.name!r}: {rel} is not a readable safetensors file ({exc})"
        ) from None


def _check_leaf_set(where: str, layout: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor]) -> None:
    """`shape_mismatch` unless the tensors are exactly the LoRA leaves of `layout`."""
    missing = [k for k in layout if k not in tensors]
    unknown = sorted(k for k in tensors if k not in layout)
    if missing or unknown:
        raise TrainingFailure(
            "shape_mismatch",
            f"{where}: the tensor set differs from the LoRA leaves ({len(missing)} missing, first "
            f"{missing[:1]}; {len(unknown)} unknown, first {unknown[:1]})",
        )


def adapter_tensors(
    loaded: ckpt.LoadedCheckpoint, layout: dict[str, tuple[int, ...]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The checkpoint's adapter tensors, checked against the LoRA layout: exact key set, shapes,
    the resident parameter dtype, finite values."""
    where = f"checkpoint {loaded.path.name!r}: {ckpt.ADAPTER_FILE}"
    tensors = _decode(loaded, ckpt.ADAPTER_FILE)
    _check_leaf_set(where, layout, tensors)
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


def optimizer_state(
    loaded: ckpt.LoadedCheckpoint, layout: dict[str, tuple[int, ...]], dtype: torch.dtype, config: SftConfig
) -> dict[str, torch.Tensor] | None:
    """The checkpoint's optimizer state, validated by the optimizer's own loader against
    storage-free (meta) leaves of the LoRA layout: exact keys, shapes, F32, finite, counters."""
    rel = loaded.manifest.state_files.optimizer_state
    if rel is None:
        return None
    state = _decode(loaded, rel)
    leaves = [(k, torch.empty(s, dtype=dtype, device="meta")) for k, s in layout.items()]
    probe = optimizer_for(config, leaves)
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


def check_grad_norm_samples(loaded: ckpt.LoadedCheckpoint, config: Qwen35Config) -> None:
    """The loop state's gradient-norm statistics hold one sample per projection and step."""
    per_target: dict[str, int] = {}
    for proj in config.projections():
        per_target[proj.target] = per_target.get(proj.target, 0) + 1
    state, step = loaded.loop_state, loaded.manifest.progress.global_step
    expected = {t: n * step for t, n in per_target.items()} if step else {}
    found = {t: s.sample_count for t, s in state.lora_grad_norms.items()}
    if found != expected:
        raise ckpt.CheckpointError(
            f"checkpoint {loaded.path.name!r}: {ckpt.LOOP_STATE_FILE}: lora_grad_norms sample counts "
            f"{found} are not one per projection and step {expected}"
        )


# ----- what a resumed run adopts before the strict load ----------------------------------------


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
