"""The torch-free safetensors reader and writer against the reference implementation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load, save

from kiln_train.interop import safetensors_io as st


def test_round_trip_with_the_reference():
    tensors = {
        "b": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "c": torch.zeros(0, 4, dtype=torch.float16),
        "d": torch.tensor([[1.0]], dtype=torch.float64),
    }
    parsed = st.parse(save(tensors, metadata={"format": "pt"}))
    assert parsed.metadata == {"format": "pt"}
    assert {n: (t.dtype, t.shape) for n, t in parsed.tensors.items()} == {
        "a": ("BF16", (2,)),
        "b": ("F32", (2, 3)),
        "c": ("F16", (0, 4)),
        "d": ("F64", (1, 1)),
    }
    again = load(
        st.dump({n: (t.dtype, t.shape, parsed.raw(n)) for n, t in parsed.tensors.items()}, {"format": "pt"})
    )
    assert set(again) == set(tensors) and all(torch.equal(again[n], tensors[n]) for n in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_first_non_finite_finds_nan_and_infinities(dtype):
    base = torch.linspace(-3e4, 3e4, 1000).to(dtype)
    clean = st.parse(save({"x": base}))
    assert st.first_non_finite(clean.tensors["x"].dtype, clean.raw("x")) is None
    for index, bad in ((0, math.nan), (517, math.inf), (999, -math.inf)):
        t = base.clone()
        t[index] = bad
        parsed = st.parse(save({"x": t}))
        assert st.first_non_finite(parsed.tensors["x"].dtype, parsed.raw("x")) == index, (dtype, bad)
    # the largest finite values and subnormals are finite
    info = torch.finfo(dtype)
    edge = torch.tensor([info.max, -info.max, info.tiny / 2, 0.0], dtype=dtype)
    parsed = st.parse(save({"x": edge}))
    assert st.first_non_finite(parsed.tensors["x"].dtype, parsed.raw("x")) is None


def _file(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize(
    ("blob", "fragment"),
    [
        (b"\x01", "too short"),
        ((10**9).to_bytes(8, "little") + b"{}", "does not fit"),
        (_file({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "needs 8 bytes"),
        (_file({"x": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "unknown dtype"),
        (
            _file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
            "belong to no tensor",
        ),
        (
            _file(
                {
                    "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "y": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]},
                },
                b"\0" * 8,
            ),
            "overlaps",
        ),
        (len(b'{"x": 1, "x": 2}').to_bytes(8, "little") + b'{"x": 1, "x": 2}', "twice"),
        (_file({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b""), "non-negative"),
    ],
)
def test_malformed_files_are_refused_naming_the_problem(blob, fragment):
    with pytest.raises(st.SafetensorsError, match=fragment):
        st.parse(blob)
