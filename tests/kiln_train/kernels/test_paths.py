"""Kernel paths: one allowed implementation per operation, the features they record, and the
shapes a recorded `kernel_paths` object may not take."""

from __future__ import annotations

import pytest

from kiln_train.kernels.paths import (
    FLA,
    FUSED_OPS,
    GATED_DELTA_RULE,
    OPS,
    SWIGLU,
    TORCH,
    TORCH_CHUNKED,
    TRITON,
    KernelPaths,
)


def test_the_reference_set_and_its_features():
    paths = KernelPaths.reference("why")
    assert paths.to_dict() == dict(
        sorted({GATED_DELTA_RULE: TORCH_CHUNKED, **{op: TORCH for op in FUSED_OPS}}.items())
    )
    assert paths.features() == [
        "torch-causal-conv1d-silu",
        "torch-chunked-gated-delta-rule",
        "torch-gated-rms-norm",
        "torch-offset-rms-norm",
        "torch-swiglu",
    ]
    assert paths.reasons == {op: "why" for op in OPS}


def test_the_fast_set_names_its_kernels():
    paths = KernelPaths({GATED_DELTA_RULE: FLA, **{op: TRITON for op in FUSED_OPS}})
    assert "fla-gated-delta-rule" in paths.features() and "triton-swiglu" in paths.features()


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ({op: TORCH for op in FUSED_OPS}, "exactly"),
        ({GATED_DELTA_RULE: TORCH_CHUNKED, **{op: TORCH for op in FUSED_OPS}, "extra": TORCH}, "exactly"),
        ({GATED_DELTA_RULE: TRITON, **{op: TORCH for op in FUSED_OPS}}, "gated_delta_rule must be one of"),
        ({GATED_DELTA_RULE: FLA, **{op: TORCH for op in FUSED_OPS}, SWIGLU: "cuda"}, "swiglu must be one of"),
        (["fla"], "exactly"),
    ],
)
def test_paths_outside_the_allowed_set_are_refused(paths, message):
    with pytest.raises(ValueError, match=message):
        KernelPaths(paths)
