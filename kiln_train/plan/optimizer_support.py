"""The `kiln.training-optimizer-support` v1 report and the static optimizer-tuple gate.

Precision, rank ranges and the report (docs/optimizers.md#precision, docs/optimizers.md#rank-ranges,
docs/optimizers.md#support-report) for the two backends (docs/training-profile.md#backends):

| backend | route              | parameter dtypes | Muon rank          | AdamW, SGD rank |
| cpu     | portable_reference | f32              | 2..=model maximum  | 1..=model maximum |
| cuda    | native_device_hook | f32, bf16        | 2..=48             | 1..=model maximum |

`model_maximum` is the smallest input/output dimension over the model's trained projections
(`Qwen35Config.model_maximum_rank()`); `maximum = min(backend_maximum, model_maximum)`, with a null
`backend_maximum` meaning the optimizer backend adds no ceiling. Live-memory admission may still
reject a rank inside the range. Torch-free: the api builds the report for `GET /v1/config` and
uses `check_optimizer_tuple` as its static gate; the worker repeats the gate at dequeue.
"""

from __future__ import annotations

from kiln_train.errors import invalid_request
from kiln_train.ground.backend import NATIVE_DEVICE_HOOK, PORTABLE_REFERENCE, Backend
from kiln_train.model.config import Qwen35Config
from kiln_train.optim.kinds import optimizer_kind, optimizer_kinds

SCHEMA = {"id": "kiln.training-optimizer-support", "version": 1}
ROUND_TO_NEAREST = "round_to_nearest"
WORKLOADS = ("sft", "grpo", "opd", "distill_refresh")
DISTILL_REFRESH_REASON = (
    "distill_refresh is unavailable until admission pins separate exact SFT and OPD phase plans, "
    "prepares the exact SFT rows, and reserves the maximum sequential working set"
)
UNIMPLEMENTED_WORKLOAD_REASON = {
    "grpo": "grpo is not implemented by this Python server",
    "opd": "opd is not implemented by this Python server",
    "distill_refresh": DISTILL_REFRESH_REASON,
}
NO_RUNNER_REASON = "no live training runner has registered its resident identity"


def parameter_dtypes(backend: Backend) -> list[str]:
    """Parameter dtypes the backend's optimizer implementation accepts (the CPU reference is f32)."""
    if backend.optimizer_route == NATIVE_DEVICE_HOOK:
        return ["f32", "bf16"]
    return ["f32"]


def backend_maximum_rank(backend: Backend, kind: str) -> int | None:
    """The optimizer backend's own rank ceiling (only CUDA Muon has one); None = unbounded."""
    return backend.muon_rank_max if optimizer_kind(kind).backend_rank_ceiling else None


def rank_range(backend: Backend, config: Qwen35Config, kind: str) -> dict:
    """`optimizer_tuple.lora_rank` for one kind."""
    model_maximum = config.model_maximum_rank()
    backend_maximum = backend_maximum_rank(backend, kind)
    maximum = model_maximum if backend_maximum is None else min(backend_maximum, model_maximum)
    return {
        "minimum": optimizer_kind(kind).minimum_rank,
        "maximum": maximum,
        "backend_maximum": backend_maximum,
        "model_maximum": model_maximum,
        "live_memory_admission_required": True,
    }


def optimizer_entry(backend: Backend, config: Qwen35Config, kind: str) -> dict:
    ranks = rank_range(backend, config, kind)
    supported = ranks["minimum"] <= ranks["maximum"]
    reason = None
    if not supported:
        reason = (
            f"{kind} needs lora_rank >= {ranks['minimum']} but the largest rank this model and the "
            f"{backend.name} backend allow is {ranks['maximum']}"
        )
    return {
        "kind": kind,
        "backend_implementation": {
            "supported": True,
            "route": backend.optimizer_route,
            "native_device_hook": backend.optimizer_route == NATIVE_DEVICE_HOOK,
            "parameter_dtypes": parameter_dtypes(backend),
        },
        "optimizer_tuple": {"supported": supported, "unavailable_reason": reason, "lora_rank": ranks},
    }


def workload_entry(workload: str, tuple_kinds: list[str]) -> dict:
    reason = UNIMPLEMENTED_WORKLOAD_REASON.get(workload)
    return {
        "workload": workload,
        "supported": reason is None,
        "unavailable_reason": reason,
        # workload gate ∩ resident tuple kinds; empty when the workload is unsupported
        "allowed_optimizer_kinds": list(tuple_kinds) if reason is None else [],
    }


def optimizer_support_report(backend: Backend, config: Qwen35Config) -> dict:
    """`GET /v1/config -> training.optimizer_support` for the resident runner.

    docs/optimizers.md#support-report.
    """
    if backend.optimizer_route not in (NATIVE_DEVICE_HOOK, PORTABLE_REFERENCE):
        raise ValueError(f"unknown optimizer route {backend.optimizer_route!r}")
    optimizers = [optimizer_entry(backend, config, kind) for kind in optimizer_kinds()]
    tuple_kinds = [o["kind"] for o in optimizers if o["optimizer_tuple"]["supported"]]
    return {
        "schema": dict(SCHEMA),
        "backend": backend.name,
        "device": backend.device,
        "base_weight_dtype": backend.base_weight_dtype,
        "resolved_lora_parameter_dtype": backend.lora_dtype,
        "immutable_after_startup": True,
        "rounding_modes": [ROUND_TO_NEAREST],
        "backend_implementation_rounding_modes": [ROUND_TO_NEAREST],
        "optimizer_tuple_kinds": tuple_kinds,
        "workloads": [workload_entry(w, tuple_kinds) for w in WORKLOADS],
        "optimizers": optimizers,
    }


def native_training_supported(report: dict | None) -> bool:
    """`training.native_training_supported`: the resident runner admits SFT (None = no runner)."""
    return native_training_unavailable_reason(report) is None


def native_training_unavailable_reason(report: dict | None) -> str | None:
    """`training.native_training_unavailable_reason`: why SFT is not admitted, or None."""
    if report is None:
        return NO_RUNNER_REASON
    sft = next((w for w in report.get("workloads", []) if w.get("workload") == "sft"), None)
    if sft is None:
        return "the resident runner reports no sft workload"
    if not sft["supported"]:
        return sft["unavailable_reason"]
    if not sft["allowed_optimizer_kinds"]:
        return "the resident runner supports no optimizer tuple for sft"
    return None


def check_optimizer_tuple(backend: Backend, config: Qwen35Config, kind: str, rank: int) -> None:
    """The static gate: `kind` has a supported tuple and `rank` lies in its range.

    Raises `KilnError(training_invalid_request)` naming lora_rank, the range, the optimizer and
    the backend. Live-memory admission comes later and never lowers the rank.
    """
    if kind not in optimizer_kinds():
        raise invalid_request(
            f"optimizer.kind {kind!r} is not one of {', '.join(optimizer_kinds())} on the {backend.name} backend"
        )
    entry = optimizer_entry(backend, config, kind)
    ranks = entry["optimizer_tuple"]["lora_rank"]
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise invalid_request(f"lora_rank must be an integer, got {rank!r}")
    if not entry["optimizer_tuple"]["supported"]:
        raise invalid_request(f"lora_rank {rank}: {entry['optimizer_tuple']['unavailable_reason']}")
    if not ranks["minimum"] <= rank <= ranks["maximum"]:
        ceiling = (
            f"backend maximum {ranks['backend_maximum']}, model maximum {ranks['model_maximum']}"
            if ranks["backend_maximum"] is not None
            else f"model maximum {ranks['model_maximum']}; the backend adds no ceiling"
        )
        raise invalid_request(
            f"lora_rank {rank} is outside {ranks['minimum']}..={ranks['maximum']} for the {kind} optimizer "
            f"on the {backend.name} backend ({ceiling})",
            hint=f"Choose lora_rank in {ranks['minimum']}..={ranks['maximum']} or another optimizer; "
            "GET /v1/config -> training.optimizer_support lists every range.",
        )
