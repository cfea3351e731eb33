"""Which implementation runs each fused operation of the model: the kernel paths a runner
executes with (docs/kernels.md#kernel-paths).

The paths are chosen once per process by the backend (`kiln_train.model.kernel_choice`), never
by a request; they are recorded in the execution provenance (`kernels.paths`, and one
`compiled_features` entry each), the receipt (which carries the provenance) and every
checkpoint's planning identity, so a resume under another set is planning drift. Torch-free: the
checkpoint rules and the worker's dequeue check read these names without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The operations (the keys of `kernels.paths` and of the planning identity's `kernel_paths`).
GATED_DELTA_RULE = "gated_delta_rule"
OFFSET_RMS_NORM = "offset_rms_norm"
GATED_RMS_NORM = "gated_rms_norm"
SWIGLU = "swiglu"
CAUSAL_CONV1D_SILU = "causal_conv1d_silu"
FUSED_OPS = (OFFSET_RMS_NORM, GATED_RMS_NORM, SWIGLU, CAUSAL_CONV1D_SILU)
OPS = (GATED_DELTA_RULE, *FUSED_OPS)

# The implementations. The fused operations run the torch reference in kiln_train/model/ or
# Kiln's Triton kernel; the gated delta rule runs the torch chunked form or flash-linear-attention.
TORCH = "torch"
TRITON = "triton"
TORCH_CHUNKED = "torch-chunked"
FLA = "fla"
ALLOWED_PATHS = {GATED_DELTA_RULE: (TORCH_CHUNKED, FLA), **{op: (TORCH, TRITON) for op in FUSED_OPS}}

# The gated delta rule's path as `kiln_train.model.delta_rule` names its implementations.
GDN_IMPL = {TORCH_CHUNKED: "chunk", FLA: "fla"}


@dataclass(frozen=True)
class KernelPaths:
    """One path per operation, and why each operation that could be faster is not."""

    paths: dict[str, str]
    reasons: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_kernel_paths(self.paths)

    @classmethod
    def reference(cls, reason: str) -> KernelPaths:
        """Every operation on its torch reference, for `reason`."""
        paths = {op: ALLOWED_PATHS[op][0] for op in OPS}
        return cls(paths, {op: reason for op in OPS})

    def features(self) -> list[str]:
        """The `compiled_features` entries of these paths, e.g. `triton-swiglu`."""
        return sorted(f"{path}-{op.replace('_', '-')}" for op, path in self.paths.items())

    def to_dict(self) -> dict[str, str]:
        return dict(sorted(self.paths.items()))


def check_kernel_paths(paths: object) -> None:
    """Raise ValueError unless `paths` names exactly the operations, each with an allowed path."""
    if not isinstance(paths, dict) or set(paths) != set(OPS):
        got = sorted(paths) if isinstance(paths, dict) else type(paths).__name__
        raise ValueError(f"kernel paths must name exactly {list(OPS)}, got {got}")
    for op, path in paths.items():
        if path not in ALLOWED_PATHS[op]:
            raise ValueError(f"kernel path of {op} must be one of {ALLOWED_PATHS[op]}, got {path!r}")
