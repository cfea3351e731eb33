"""Check 3 of a PEFT import: `adapter_model.safetensors` against the resident model (docs/interop.md#import).

Every tensor a LoRA A/B weight of a listed target on an existing projection, every such projection
present, shapes `A [r, in]` / `B [out, r]` (a wrong rank is named as one), floating dtypes, finite
values.
"""

from __future__ import annotations

from kiln_train.artifacts.adapter import (
    ADAPTER_MODEL,
    PEFT_PREFIX,
    VL_PEFT_PREFIX,
    expected_shapes,
    parse_key,
)
from kiln_train.interop import safetensors_io
from kiln_train.interop.bundle import ResidentFacts
from kiln_train.interop.errors import import_invalid


def check_tensors(
    data: bytes, resident: ResidentFacts, rank: int, targets: list[str]
) -> tuple[dict[str, tuple[str, tuple[int, ...], bytes]], str]:
    """The uploaded tensors under Kiln's key names, checked against the resident model; and which
    key prefix they came with ("text" or "vl")."""
    try:
        parsed = safetensors_io.parse(data)
    except safetensors_io.SafetensorsError as exc:
        raise import_invalid(f"{ADAPTER_MODEL} is not a readable safetensors file: {exc}") from None
    names = sorted(parsed.tensors)
    if not names:
        raise import_invalid(f"{ADAPTER_MODEL} holds no tensors")
    vl = all(n.startswith(VL_PEFT_PREFIX) for n in names)
    full = expected_shapes(resident.model, rank)
    wanted = {k: v for k, v in full.items() if parse_key(k)[2] in targets}
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for name in names:
        key = PEFT_PREFIX + name[len(VL_PEFT_PREFIX) :] if vl else name
        try:
            layer, block, target, _ = parse_key(key)
        except ValueError:
            raise import_invalid(
                f"tensor {name!r} is not a LoRA A/B weight of one of Kiln's ten Qwen3.5 targets"
            ) from None
        if target not in targets:
            raise import_invalid(f"tensor {name!r} adapts {target}, which adapter_config.json does not list")
        if key not in full:
            raise import_invalid(
                f"tensor {name!r} names no projection of the resident model ({resident.model.num_hidden_layers} "
                f"layers; layer {layer} has no {block}.{target})"
            )
        info = parsed.tensors[name]
        tensors[key] = (info.dtype, info.shape, parsed.raw(name))
    for key in wanted:
        if key not in tensors:
            raise import_invalid(
                f"tensor {key!r} is missing: every layer of every listed target needs its A and B"
            )
    for key, want in wanted.items():
        dtype, shape, raw = tensors[key]
        if shape != want:
            ab = parse_key(key)[3]
            fixed, rank_axis = (1, 0) if ab == "A" else (0, 1)  # A [r, in], B [out, r]
            if len(shape) == 2 and shape[fixed] == want[fixed] and shape[rank_axis] != rank:
                raise import_invalid(
                    f"wrong rank: tensor {key!r} has rank {shape[rank_axis]}, adapter_config.json says r = {rank}"
                )
            raise import_invalid(
                f"shape mismatch: tensor {key!r} is {list(shape)}, the resident model's projection needs {list(want)}"
            )
        if dtype not in safetensors_io.FLOAT_DTYPES:
            raise import_invalid(f"tensor {key!r} is {dtype}, not a floating-point tensor")
    for key in wanted:
        dtype, _, raw = tensors[key]
        bad = safetensors_io.first_non_finite(dtype, raw)
        if bad is not None:
            raise import_invalid(
                f"tensor {key!r} holds a non-finite value (NaN or infinity) at element {bad}"
            )
    return tensors, "vl" if vl else "text"
