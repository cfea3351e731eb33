"""Memory admission: the SFT working-set estimate, checkpoint-segment planning, the available
budget and the 413 `training_will_not_fit` message (kiln-contract §7; seed 000 "Admission and
execution binding").

Torch-free: the api prices a request with nothing but the model's `config.json` numbers.

The estimate is the contract's `Breakdown` computed for THIS implementation (torch autograd over
`kiln_train.model`, the loss routes of `kiln_train.train.loss`, the optimizers of `kiln_train.optim`) in
the resident backend's dtypes (cpu: f32 everywhere; cuda: bf16 weights/activations/LoRA/optimizer
state with f32 inner math). Every term is an upper bound of bytes that are live at the step's peak
and says why it exists; `qualification/memory_honesty.py` measures real steps against it.

All size arithmetic saturates toward rejection: Python integers cannot wrap, and any value at or
above `U64_MAX` is clamped to `U64_MAX`, which never fits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kiln_train.errors import TRAINING_WILL_NOT_FIT, KilnError, invalid_request
from kiln_train.model.config import Qwen35Config
from kiln_train.plan.backend import FULL_LOGITS, Backend
from kiln_train.plan.formulas import (
    ESTIMATED_ROUTES as ESTIMATED_ROUTES,
)  # re-exported: the api's route gate
from kiln_train.plan.formulas import F32, boundary_bytes, loss_workspace_bytes, segment_activation_bytes
from kiln_train.plan.optimizer_support import rank_range

GIB = 1 << 30
MIB = 1 << 20
U64_MAX = 2**64 - 1

OPTIMIZER_STATE_BUFFERS = {"sgd": 0, "muon": 1, "adam_w": 2}

# Memory the compute runtime takes for a row beyond its tensors: on cpu BLAS/oneDNN buffers and
# per-shape kernel caches (8-12 MiB measured on a warmed-up worker, charged twice; the one-time thread pools
# and imports are part of the worker's resident baseline, see `qualification/memory_honesty.py`);
# on cuda the cuBLAS workspaces and attention/GDN kernel workspaces of the caching allocator.
RUNTIME_SCRATCH_BYTES = {"cpu": 24 * MIB, "cuda": 64 * MIB}


def saturate(value: int) -> int:
    """Clamp a non-negative byte count to `U64_MAX` (which means "does not fit")."""
    if value < 0:
        raise ValueError(f"byte counts are non-negative, got {value}")
    return U64_MAX if value >= U64_MAX else value


@dataclass(frozen=True)
class Breakdown:
    """Bytes of one SFT step's working set (kiln-contract §7.2), plus the inputs that priced it."""

    base_weights: int
    per_segment_activations: int
    boundary_states: int
    loss_workspace: int
    lora_param_grad: int
    lora_optimizer_state: int
    residency_scratch: int
    safety_margin: int
    max_seq_len: int
    max_supervised_tokens: int
    lora_rank: int
    num_segments: int
    loss_route: str
    optimizer_kind: str

    @property
    def activations(self) -> int:
        """Per-segment activations plus retained boundary states (the message's `activations`)."""
        return saturate(self.per_segment_activations + self.boundary_states)

    @property
    def working_set(self) -> int:
        """The step's peak before the safety margin.

        With one segment the loss runs on top of every saved activation, so both count. With
        more, the loss's forward and backward finish (its saved state freed) before the first
        segment is recomputed, so only the larger of the two phases counts.
        """
        if self.num_segments == 1:
            phases = self.per_segment_activations + self.loss_workspace
        else:
            phases = max(self.per_segment_activations, self.loss_workspace)
        return saturate(
            self.base_weights
            + self.boundary_states
            + phases
            + self.lora_param_grad
            + self.lora_optimizer_state
            + self.residency_scratch
        )

    @property
    def total(self) -> int:
        return saturate(self.working_set + self.safety_margin)

    def fits(self, available_bytes: int) -> bool:
        return self.total < U64_MAX and self.total <= available_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["activations"] = self.activations
        d["total"] = self.total
        return d


# ----- the estimate --------------------------------------------------------------------------


def _dtype_bytes(name: str) -> int:
    return 4 if name == "f32" else 2


def estimate(
    config: Qwen35Config,
    *,
    max_seq_len: int,
    max_supervised_tokens: int,
    lora_rank: int,
    optimizer_kind: str,
    num_segments: int,
    loss_route: str,
    backend: Backend,
    weights_resident: bool,
) -> Breakdown:
    """The working set of one SFT step (kiln-contract §7.2) for this implementation.

    `weights_resident=True` when the budget was measured with the model already loaded (the
    worker's CUDA free memory), so base weights are not charged again.
    """
    for name, value in (
        ("max_seq_len", max_seq_len),
        ("max_supervised_tokens", max_supervised_tokens),
        ("lora_rank", lora_rank),
        ("num_segments", num_segments),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if optimizer_kind not in OPTIMIZER_STATE_BUFFERS:
        raise ValueError(f"unknown optimizer kind {optimizer_kind!r}")
    if num_segments > config.num_hidden_layers:
        raise ValueError(f"num_segments {num_segments} exceeds {config.num_hidden_layers} layers")
    t, a, r, s = max_seq_len, max_supervised_tokens, lora_rank, num_segments
    e = _dtype_bytes(backend.activation_dtype)
    lora_e = _dtype_bytes(backend.lora_dtype)
    state_e = _dtype_bytes(backend.optimizer_state_dtype)
    lora_elements = config.lora_elements_per_rank() * r
    largest_leaf = config.max_feature_dim() * r

    weights = (
        0 if weights_resident else config.base_parameter_count() * _dtype_bytes(backend.base_weight_dtype)
    )
    activations = saturate(segment_activation_bytes(config, t, r, e, s))
    boundaries = saturate(boundary_bytes(config, t, e, s))
    loss = saturate(loss_workspace_bytes(config, loss_route, t, a, e))
    # The trainable leaves and their .grad, in the LoRA dtype.
    param_grad = saturate(2 * lora_elements * lora_e)
    # AdamW m and v, Muon momentum, SGD nothing; resident in the optimizer-state dtype.
    optimizer_state = saturate(OPTIMIZER_STATE_BUFFERS[optimizer_kind] * lora_elements * state_e)
    # The optimizer's f32 temporaries for the largest leaf (upcasts, Newton-Schulz iterates,
    # AdamW's denominator), one byte per gradient element for the finite check, and the compute
    # runtime's own buffers.
    scratch = saturate(
        8 * F32 * largest_leaf + lora_elements + RUNTIME_SCRATCH_BYTES.get(backend.name, 64 * MIB)
    )
    breakdown = Breakdown(
        base_weights=saturate(weights),
        per_segment_activations=activations,
        boundary_states=boundaries,
        loss_workspace=loss,
        lora_param_grad=param_grad,
        lora_optimizer_state=optimizer_state,
        residency_scratch=scratch,
        safety_margin=0,
        max_seq_len=t,
        max_supervised_tokens=a,
        lora_rank=r,
        num_segments=s,
        loss_route=loss_route,
        optimizer_kind=optimizer_kind,
    )
    # Allocator rounding and fragmentation: 1/16 of the working set. The fixed reserve beside it
    # is the budget's `[memory].reserve_gb`.
    return replace(breakdown, safety_margin=saturate(-(-breakdown.working_set // 16)))


# ----- planning ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentPlan:
    """The admitted checkpoint plan: how many segments, and the breakdown that fits."""

    num_segments: int
    breakdown: Breakdown
    available_bytes: int


def candidate_segments(config: Qwen35Config, loss_route: str) -> range:
    """Segment counts automatic planning may try: 1 for `full_logits`, else 1..=num_layers."""
    return range(1, 2) if loss_route == FULL_LOGITS else range(1, config.num_hidden_layers + 1)


def check_segment_request(config: Qwen35Config, loss_route: str, requested: int | None) -> None:
    """Reject an explicit segment count the route or the model cannot honour (400)."""
    if requested is None:
        return
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise invalid_request(
            f"config.grad_checkpoint_segments must be a positive integer, got {requested!r}"
        )
    if loss_route == FULL_LOGITS and requested > 1:
        raise invalid_request(
            f"config.grad_checkpoint_segments={requested} is not allowed on the full_logits loss route: "
            "checkpoint tails run outside the active tape, so full_logits is a one-segment plan"
        )
    if requested > config.num_hidden_layers:
        raise invalid_request(
            f"config.grad_checkpoint_segments={requested} exceeds the model's "
            f"{config.num_hidden_layers} layers"
        )


def plan_segments(
    config: Qwen35Config,
    *,
    max_seq_len: int,
    max_supervised_tokens: int,
    lora_rank: int,
    optimizer_kind: str,
    loss_route: str,
    backend: Backend,
    weights_resident: bool,
    available_bytes: int,
    requested_segments: int | None = None,
) -> SegmentPlan:
    """Admit the first plan whose complete bound fits, or raise 400/413 (kiln-contract §7.4).

    An explicit `requested_segments` is honoured as is (413 when it does not fit); otherwise
    1 segment is tried, then 2..=num_layers (never more than 1 for `full_logits`).
    """
    check_segment_request(config, loss_route, requested_segments)
    counts = (
        [requested_segments]
        if requested_segments is not None
        else list(candidate_segments(config, loss_route))
    )
    common = {
        "max_seq_len": max_seq_len,
        "max_supervised_tokens": max_supervised_tokens,
        "lora_rank": lora_rank,
        "optimizer_kind": optimizer_kind,
        "loss_route": loss_route,
        "backend": backend,
        "weights_resident": weights_resident,
    }
    breakdown = None
    for s in counts:
        breakdown = estimate(config, num_segments=s, **common)
        if breakdown.fits(available_bytes):
            return SegmentPlan(s, breakdown, available_bytes)
    ceiling = admissible_rank_ceiling(
        config,
        max_rank_that_fits(
            config,
            available_bytes=available_bytes,
            requested_segments=requested_segments,
            **{k: v for k, v in common.items() if k != "lora_rank"},
        ),
        optimizer_kind=optimizer_kind,
        backend=backend,
    )
    raise will_not_fit(breakdown, available_bytes, rank_ceiling=ceiling, tried=counts)


def row_segments(
    plan: dict, seq_len: int, supervised: int, estimate_fits: Callable[[int, int, int], bool]
) -> int:
    """Segments for one row: the smallest count within the pinned plan whose bound fits.

    `plan` is a pinned checkpoint plan `{max_segments, auto, budget_bytes}`; a plan that is not
    auto (or has no budget) runs every row with `max_segments`. `estimate_fits(seq_len,
    supervised, segments)` says whether that row's bound fits the plan's budget.
    """
    max_s = int(plan.get("max_segments", 1))
    if not plan.get("auto", False) or plan.get("budget_bytes") is None:
        return max_s
    for s in range(1, max_s + 1):
        if estimate_fits(seq_len, supervised, s):
            return s
    return max_s


def check_row_plan_fits(
    config: Qwen35Config,
    rows: Iterable[tuple[int, int]],
    plan: dict,
    *,
    lora_rank: int,
    optimizer_kind: str,
    loss_route: str,
    backend: Backend,
    weights_resident: bool,
    available_bytes: int,
) -> Breakdown | None:
    """Re-admit a pinned per-row plan (a resume's) against today's budget: each row's bound with
    the segments the plan gives it must fit `available_bytes`; raises 413 for the worst row that
    does not. `rows` are `(seq_len, supervised_tokens)`. Returns the largest row bound (None for
    no rows)."""
    common = {
        "lora_rank": lora_rank,
        "optimizer_kind": optimizer_kind,
        "loss_route": loss_route,
        "backend": backend,
        "weights_resident": weights_resident,
    }
    budget = plan.get("budget_bytes")

    def bound(seq_len: int, supervised: int, segments: int) -> Breakdown:
        return estimate(
            config, max_seq_len=seq_len, max_supervised_tokens=supervised, num_segments=segments, **common
        )

    worst: tuple[Breakdown, int, int, int] | None = None
    for seq_len, supervised in sorted(set(rows)):
        s = row_segments(plan, seq_len, supervised, lambda t, a, k: bound(t, a, k).fits(int(budget)))
        b = bound(seq_len, supervised, s)
        if worst is None or b.total > worst[0].total:
            worst = (b, seq_len, supervised, s)
    if worst is None:
        return None
    breakdown, seq_len, supervised, s = worst
    if not breakdown.fits(available_bytes):
        # plan_segments raises the contract's 413 (breakdown, advice, rank ceiling) for that row.
        plan_segments(
            config,
            max_seq_len=seq_len,
            max_supervised_tokens=supervised,
            available_bytes=available_bytes,
            requested_segments=s,
            **common,
        )
    return breakdown


def admissible_rank_ceiling(
    config: Qwen35Config, resource_ceiling: int, *, optimizer_kind: str, backend: Backend
) -> int:
    """The rank the 413 may advise: the memory ceiling clamped to the optimizer tuple's static range.

    A rank above the backend's ceiling (CUDA Muon: 48) or below the optimizer's minimum (Muon: 2)
    would be rejected with 400 before memory is even priced, so it is never advised; 0 = none.
    """
    ranks = rank_range(backend, config, optimizer_kind)
    ceiling = min(resource_ceiling, ranks["maximum"])
    return ceiling if ceiling >= ranks["minimum"] else 0


def max_rank_that_fits(
    config: Qwen35Config,
    *,
    max_seq_len: int,
    max_supervised_tokens: int,
    optimizer_kind: str,
    loss_route: str,
    backend: Backend,
    weights_resident: bool,
    available_bytes: int,
    requested_segments: int | None = None,
) -> int:
    """The largest LoRA rank that fits: min(model ceiling, resource ceiling); 0 when none does.

    The resource ceiling searches the same segment plans admission would try; the estimate grows
    with rank, so a bisection over 1..=model ceiling finds it.
    """
    counts = (
        [requested_segments]
        if requested_segments is not None
        else list(candidate_segments(config, loss_route))
    )

    def fits(rank: int) -> bool:
        return any(
            estimate(
                config,
                max_seq_len=max_seq_len,
                max_supervised_tokens=max_supervised_tokens,
                lora_rank=rank,
                optimizer_kind=optimizer_kind,
                num_segments=s,
                loss_route=loss_route,
                backend=backend,
                weights_resident=weights_resident,
            ).fits(available_bytes)
            for s in counts
        )

    low, high = 0, config.model_maximum_rank()
    while low < high:  # invariant: every rank <= low fits (rank 0 trivially)
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


# ----- the available budget ------------------------------------------------------------------


def available_budget(
    backend: Backend,
    *,
    total_bytes: int,
    free_bytes: int,
    reserve_gb: float,
    training_memory_gb: float | None = None,
) -> int:
    """Bytes a training step may use on the resident device (kiln-contract §7.4, `[memory]`).

    `free_bytes` is what the device reports with the model already resident (CUDA
    `torch.cuda.mem_get_info()[0]` in the worker; CPU `cpu_available_bytes()`), bounded by
    `total_bytes`. `[memory].reserve_gb` stays free beside the estimate (the contract's fixed
    1 GiB safety margin, configurable here), and `[memory].training_memory_gb` caps the result.
    The formula is the same for both backends; `backend` names whose numbers these are.
    """
    if backend.name not in ("cpu", "cuda"):
        raise ValueError(f"no budget rule for backend {backend.name!r}")
    if total_bytes < 0 or free_bytes < 0 or reserve_gb < 0:
        raise ValueError("memory figures must be non-negative")
    available = min(free_bytes, total_bytes) - math.ceil(reserve_gb * GIB)
    if training_memory_gb is not None:
        available = min(available, math.floor(training_memory_gb * GIB))
    return max(0, available)


def cpu_available_bytes(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int:
    """Host memory a new allocation can get: `MemAvailable`, bounded by a cgroup v2 limit if set."""
    available = None
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        if limit != "max":
            used = int(Path(cgroup, "memory.current").read_text().strip())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


# glibc mallopt parameters (malloc.h).
_M_MMAP_THRESHOLD = -3
CPU_MMAP_THRESHOLD_BYTES = 64 * 1024


def apply_cpu_allocator_policy(mmap_threshold: int = CPU_MMAP_THRESHOLD_BYTES) -> bool:
    """Make freed host tensors go back to the OS; the cpu estimate assumes this policy.

    glibc serves allocations below its mmap threshold from heap arenas, and by default raises that
    threshold (up to 32 MiB) every time a large block is freed, so most of a step's tensors end up
    in arenas that keep their high-water mark and fragment: on the `small` preset the resident set
    then grows step after step (~1.6x the live tensor bytes at T = 1024, ~4x at T = 256). A fixed
    64 KiB threshold maps every larger tensor directly and unmaps it on free, so resident memory
    follows live tensors and returns to the same level after every step. The cpu worker calls
    this once at start, before loading the model. Returns False where it cannot apply (not glibc).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
    except (OSError, AttributeError):
        return False


# ----- the 413 ------------------------------------------------------------------------------


def _gb(n: int) -> str:
    return f"{n / GIB:.2f}"


def will_not_fit_message(
    breakdown: Breakdown, available_bytes: int, *, rank_ceiling: int, tried: list[int] | None = None
) -> str:
    """The one-line `training_will_not_fit` message of kiln-contract §7.5 plus the advice."""
    b = breakdown
    head = (
        f"Estimated training step working set is {_gb(b.total)} GB but only {_gb(available_bytes)} GB "
        f"is available. Breakdown: weights {_gb(b.base_weights)} GB, activations {_gb(b.activations)} GB "
        f"(max_seq_len={b.max_seq_len}, num_segments={b.num_segments}), loss workspace "
        f"{_gb(b.loss_workspace)} GB (route={b.loss_route}), LoRA params+grads {_gb(b.lora_param_grad)} GB, "
        f"optimizer state {_gb(b.lora_optimizer_state)} GB, residency scratch {_gb(b.residency_scratch)} GB "
        f"(lora_rank={b.lora_rank})."
    )
    return f"{head} {advice(b, rank_ceiling=rank_ceiling, tried=tried)}"


def dominant_component(breakdown: Breakdown) -> str:
    """Which part of the request the estimate mostly pays for: weights, sequence, loss or rank."""
    b = breakdown
    parts = {
        "weights": b.base_weights,
        "sequence": b.activations,
        "loss": b.loss_workspace,
        "rank": saturate(b.lora_param_grad + b.lora_optimizer_state + b.residency_scratch),
    }
    return max(parts, key=lambda k: parts[k])


def advice(breakdown: Breakdown, *, rank_ceiling: int, tried: list[int] | None = None) -> str:
    b = breakdown
    cause = dominant_component(b)
    if cause == "rank":
        rank_part = saturate(b.lora_param_grad + b.lora_optimizer_state + b.residency_scratch)
        first = (
            f"LoRA rank dominates: lora_rank={b.lora_rank} needs {_gb(rank_part)} GB for LoRA params, "
            f"gradients, {b.optimizer_kind} state and scratch; shrink lora_rank."
        )
    elif cause == "sequence":
        first = (
            f"Sequence length dominates: activations for max_seq_len={b.max_seq_len} need "
            f"{_gb(b.activations)} GB even at num_segments={b.num_segments}; send shorter examples."
        )
    elif cause == "loss":
        first = (
            f"The loss workspace dominates: route={b.loss_route} needs {_gb(b.loss_workspace)} GB for "
            f"max_seq_len={b.max_seq_len} with {b.max_supervised_tokens} supervised tokens; send shorter "
            "examples or fewer supervised tokens."
        )
    else:
        first = (
            f"General capacity: the base weights alone need {_gb(b.base_weights)} GB; free device memory "
            "or raise [memory].training_memory_gb."
        )
    if tried and len(tried) > 1:
        checkpointing = (
            f"Dynamic gradient checkpointing was already tried (num_segments {tried[0]}..={tried[-1]})."
        )
    elif b.loss_route == FULL_LOGITS:
        checkpointing = "The full_logits loss route allows a single checkpoint segment only."
    else:
        checkpointing = f"The requested grad_checkpoint_segments={b.num_segments} was honoured as given."
    if rank_ceiling > 0:
        ceiling = f"The largest lora_rank that fits this request is {rank_ceiling}."
    else:
        ceiling = "No lora_rank fits this request; send shorter examples or free memory."
    return f"{first} {checkpointing} {ceiling}"


def will_not_fit(
    breakdown: Breakdown, available_bytes: int, *, rank_ceiling: int, tried: list[int] | None = None
) -> KilnError:
    """The 413 error: code `training_will_not_fit`, message per kiln-contract §7.5."""
    error = KilnError(
        TRAINING_WILL_NOT_FIT,
        will_not_fit_message(breakdown, available_bytes, rank_ceiling=rank_ceiling, tried=tried),
    )
    # The numbers ride along in bytes (with the budget) for clients that draw them.
    error.breakdown = {**breakdown.to_dict(), "available_bytes": available_bytes}
    return error
