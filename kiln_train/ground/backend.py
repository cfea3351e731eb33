"""Backend facts fixed at worker start (docs/training-profile.md#backends). Nothing here is configurable.

| backend | base / LoRA / optimizer-state dtype | SFT loss route | optimizer route    | Muon rank |
| cuda    | bf16 / bf16 / bf16                   | kt_tape_flce   | native_device_hook | 2..=48    |
| cpu     | f32 / f32 / f32                      | kt_tape_flce   | portable_reference | 2..=model |

Torch-free so the api can reason about the resident runner's identity.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# SFT loss route enum (docs/training-profile.md#loss-route).
KT_TAPE_FLCE = "kt_tape_flce"
FULL_LOGITS = "full_logits"
VULKAN_ACTIVE_ROWS = "vulkan_active_rows"
SFT_LOSS_ROUTES = (KT_TAPE_FLCE, VULKAN_ACTIVE_ROWS, FULL_LOGITS)

# Optimizer implementation routes (docs/optimizers.md#support-report).
NATIVE_DEVICE_HOOK = "native_device_hook"
PORTABLE_REFERENCE = "portable_reference"

ROUND_TO_NEAREST = {"mode": "round_to_nearest"}

# torch dtype names <-> contract dtype names
CONTRACT_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
TORCH_DTYPE_NAME = {v: k for k, v in CONTRACT_DTYPE.items()}


@dataclass(frozen=True)
class Backend:
    """What the resident runner is and what it owns."""

    name: str  # "cpu" | "cuda"
    device: str  # "cpu" | "cuda:0"
    base_weight_dtype: str  # contract dtype name: "f32" | "bf16"
    lora_dtype: str
    optimizer_state_dtype: str
    activation_dtype: str
    gradient_dtype: str
    sft_loss_route: str
    optimizer_route: str
    muon_rank_max: int | None  # backend ceiling for Muon; None = unbounded

    @property
    def torch_dtype_name(self) -> str:
        return TORCH_DTYPE_NAME[self.base_weight_dtype]

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.base_weight_dtype == "f32" else 2

    def precision_policy(self, keeps_optimizer_state: bool) -> dict:
        """`runtime.training_precision` / checkpoint `precision_policy` (docs/optimizers.md#precision);
        an optimizer that keeps no state (`kinds.keeps_state`) has state dtype `none`."""
        if not isinstance(keeps_optimizer_state, bool):
            raise TypeError(f"keeps_optimizer_state must be a bool, got {keeps_optimizer_state!r}")
        return {
            "parameter_dtype": self.lora_dtype,
            "optimizer_state_dtype": self.optimizer_state_dtype if keeps_optimizer_state else "none",
            "activation_dtype": self.activation_dtype,
            "gradient_dtype": self.gradient_dtype,
            "stochastic_rounding": dict(ROUND_TO_NEAREST),
        }

    def to_dict(self) -> dict:
        return asdict(self)


# Every backend keeps all its tensor kinds in one dtype (the table above).
_TENSOR_DTYPE_FIELDS = (
    "base_weight_dtype",
    "lora_dtype",
    "optimizer_state_dtype",
    "activation_dtype",
    "gradient_dtype",
)


def backend_for_device(device: str) -> Backend:
    """The backend owning `device` ("cpu", "cuda", "cuda:N")."""
    if device == "cpu":
        return _backend("cpu", "cpu", "f32", PORTABLE_REFERENCE, muon_rank_max=None)
    if device == "cuda" or device.startswith("cuda:"):
        index = device.split(":", 1)[1] if ":" in device else "0"
        return _backend("cuda", f"cuda:{index}", "bf16", NATIVE_DEVICE_HOOK, muon_rank_max=48)
    raise ValueError(f"unsupported device {device!r}: use cpu, cuda or cuda:N")


def _backend(
    name: str, device: str, dtype: str, optimizer_route: str, *, muon_rank_max: int | None
) -> Backend:
    """A backend whose every tensor kind is `dtype`, on the one SFT loss route."""
    return Backend(
        name=name,
        device=device,
        **dict.fromkeys(_TENSOR_DTYPE_FIELDS, dtype),
        sft_loss_route=KT_TAPE_FLCE,
        optimizer_route=optimizer_route,
        muon_rank_max=muon_rank_max,
    )
