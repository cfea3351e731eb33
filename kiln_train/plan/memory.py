"""The memory estimate of one SFT step: the working-set `Breakdown` and `estimate`, which computes
it for this implementation (docs/memory.md; pinned at admission: docs/ARCHITECTURE.md#pinning).

Torch-free: the api prices a request with nothing but the model's `config.json` numbers.

The estimate is the contract's `Breakdown` computed for THIS implementation (torch autograd over
`kiln_train.model`, the loss routes of `kiln_train.train.loss`, the optimizers of `kiln_train.optim`) in
the resident backend's dtypes (cpu: f32 everywhere; cuda: bf16 weights/activations/LoRA/optimizer
state with f32 inner math). Every term is an upper bound of bytes that are live at the step's peak
and says why it exists; `qualification/memory_honesty.py` measures real steps against it.

All size arithmetic saturates toward rejection: Python integers cannot wrap, and any value at or
above `U64_MAX` is clamped to `U64_MAX`, which never fits. Admission builds on it: segment
planning (`plan.segments`), the available budget (`plan.budget`) and the 413 (`plan.refusal`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TypedDict

from kiln_train.ground.backend import Backend
from kiln_train.model.config import Qwen35Config
from kiln_train.optim.kinds import optimizer_kind as registered_kind
from kiln_train.plan.formulas import (
    F32,
    boundary_bytes,
    eval_loss_workspace_bytes,
    forward_activation_bytes,
    forward_boundary_bytes,
    loss_workspace_bytes,
    segment_activation_bytes,
)

GIB = 1 << 30
MIB = 1 << 20
U64_MAX = 2**64 - 1


# Memory the compute runtime takes for a row beyond its tensors: on cpu BLAS/oneDNN buffers and
# per-shape kernel caches (8-12 MiB measured on a warmed-up worker, charged twice; the one-time thread pools
# and imports are part of the worker's resident baseline, see `qualification/memory_honesty.py`);
# on cuda the cuBLAS workspaces and attention/GDN kernel workspaces of the caching allocator.
RUNTIME_SCRATCH_BYTES = {"cpu": 24 * MIB, "cuda": 64 * MIB}


class Pricing(TypedDict):
    """What prices a step besides its rows' sizes and its segments: `estimate`'s other keywords,
    which the admission checks of one run pass through unchanged (`plan.segments`)."""

    lora_rank: int
    optimizer_kind: str
    loss_route: str
    backend: Backend
    weights_resident: bool


def saturate(value: int) -> int:
    """Clamp a non-negative byte count to `U64_MAX` (which means "does not fit")."""
    if value < 0:
        raise ValueError(f"byte counts are non-negative, got {value}")
    return U64_MAX if value >= U64_MAX else value


@dataclass(frozen=True)
class Breakdown:
    """Bytes of one SFT step's working set (docs/memory.md#components), plus the inputs that priced it."""

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

        The loss runs on top of the saved activations of the last segment (which is never
        recomputed; with one segment, of every layer); each segment's backward runs later, after
        the loss has freed its workspace. `per_segment_activations` is priced beside the loss
        (`formulas.segment_activation_bytes`), so the sum is the larger of the two phases.
        """
        return saturate(
            self.base_weights
            + self.boundary_states
            + self.per_segment_activations
            + self.loss_workspace
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


def _dtype_bytes(name: str) -> int:
    return 4 if name == "f32" else 2


def _check_inputs(optimizer_kind: str, **sizes: int) -> None:
    """ValueError for a size that is not a positive integer, or an unknown optimizer kind."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    registered_kind(optimizer_kind)  # ValueError for an unknown kind


def _priced_by(t: int, a: int, r: int, s: int, loss_route: str, optimizer_kind: str) -> dict:
    """The inputs a `Breakdown` records beside its components."""
    return {
        "max_seq_len": t,
        "max_supervised_tokens": a,
        "lora_rank": r,
        "num_segments": s,
        "loss_route": loss_route,
        "optimizer_kind": optimizer_kind,
    }


def _with_safety_margin(breakdown: Breakdown) -> Breakdown:
    """Allocator rounding and fragmentation: 1/16 of the working set. The fixed reserve beside it
    is the budget's `[memory].reserve_gb`."""
    return replace(breakdown, safety_margin=saturate(-(-breakdown.working_set // 16)))


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
    """The working set of one SFT step (docs/memory.md#components) for this implementation.

    `weights_resident=True` when the budget was measured with the model already loaded (the
    worker's CUDA free memory), so base weights are not charged again.
    """
    _check_inputs(
        optimizer_kind,
        max_seq_len=max_seq_len,
        max_supervised_tokens=max_supervised_tokens,
        lora_rank=lora_rank,
        num_segments=num_segments,
    )
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
    boundaries = saturate(boundary_bytes(config, t, e, s))
    loss = saturate(loss_workspace_bytes(config, loss_route, t, a, e))
    activations = saturate(segment_activation_bytes(config, t, r, e, s, loss))
    # The trainable leaves and their .grad, in the LoRA dtype.
    param_grad = saturate(2 * lora_elements * lora_e)
    # AdamW m and v, Muon momentum, SGD nothing; resident in the optimizer-state dtype.
    optimizer_state = saturate(registered_kind(optimizer_kind).state_buffers * lora_elements * state_e)
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
        **_priced_by(t, a, r, s, loss_route, optimizer_kind),
    )
    return _with_safety_margin(breakdown)


def forward_estimate(
    config: Qwen35Config,
    *,
    max_seq_len: int,
    max_supervised_tokens: int,
    lora_rank: int,
    optimizer_kind: str,
    loss_route: str,
    backend: Backend,
    weights_resident: bool,
) -> Breakdown:
    """The working set of one validation forward (docs/validation.md): no gradient, so no saved
    activations, no `.grad` and no optimizer temporaries; the LoRA leaves and the optimizer state
    stay resident between steps. Same components as `estimate` so the 413 reads the same;
    `num_segments` is 1 (nothing is recomputed without a backward).

    - per_segment_activations: the heaviest layer's tensors (its saved set in training is an
      upper bound of what one layer holds at once without autograd) plus its input and output;
    - boundary_states: the embedding output, the final norm's f32 input and its output, the rope
      tables (`forward_boundary_bytes`);
    - loss_workspace: the chunked evaluation pass (`eval_loss_workspace_bytes`);
    - lora_param_grad: the LoRA leaves only; lora_optimizer_state: as in training;
    - residency_scratch: the compute runtime's buffers only.
    """
    _check_inputs(
        optimizer_kind,
        max_seq_len=max_seq_len,
        max_supervised_tokens=max_supervised_tokens,
        lora_rank=lora_rank,
    )
    t, a, r = max_seq_len, max_supervised_tokens, lora_rank
    e = _dtype_bytes(backend.activation_dtype)
    lora_elements = config.lora_elements_per_rank() * r
    weights = (
        0 if weights_resident else config.base_parameter_count() * _dtype_bytes(backend.base_weight_dtype)
    )
    breakdown = Breakdown(
        base_weights=saturate(weights),
        per_segment_activations=saturate(forward_activation_bytes(config, t, r, e)),
        boundary_states=saturate(forward_boundary_bytes(config, t, e)),
        loss_workspace=saturate(eval_loss_workspace_bytes(config, loss_route, t, a, e)),
        lora_param_grad=saturate(lora_elements * _dtype_bytes(backend.lora_dtype)),
        lora_optimizer_state=saturate(
            registered_kind(optimizer_kind).state_buffers
            * lora_elements
            * _dtype_bytes(backend.optimizer_state_dtype)
        ),
        residency_scratch=saturate(RUNTIME_SCRATCH_BYTES.get(backend.name, 64 * MIB)),
        safety_margin=0,
        **_priced_by(t, a, r, 1, loss_route, optimizer_kind),
    )
    return _with_safety_margin(breakdown)
