"""Load a Hugging Face Qwen3.5 checkpoint directory into a `Qwen35Model` (qwen35.md §1, §2.5, §3).

Accepted layouts: `config.json` with or without the VL wrapper (`text_config`); one
`model.safetensors` or shards listed by `model.safetensors.index.json`; trunk tensors under
`model.language_model.` (VL wrapper) or `model.` (text-only); `lm_head.weight` for untied heads
(ignored when tied, as transformers does). Vision tensors (`model.visual.*`) are ignored; MTP
tensors (`mtp.*`) are recognised, not loaded, and their names recorded in `model.mtp_tensor_names`
(kiln never trains or runs the MTP head). Missing, unexpected, duplicated, mis-shaped or
non-float tensors raise `CheckpointError` (code training_backend_unsupported) naming the tensor.

Memory: the model is built on the meta device, then each tensor is read from the memory-mapped
file (`safetensors.safe_open`, straight onto the target device) and cast once to the final dtype,
so the weights are never held twice.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from kiln_train.backend import backend_for_device
from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED, KilnError
from kiln_train.model.qwen35 import Qwen35Model
from kiln_train.model_config import load_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TRUNK_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."
LM_HEAD_KEY = "lm_head.weight"
FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}


class CheckpointError(KilnError):
    """A checkpoint directory that is not a loadable Qwen3.5 text model; `tensor` names the culprit."""

    def __init__(self, detail: str, tensor: str | None = None) -> None:
        super().__init__(TRAINING_BACKEND_UNSUPPORTED, detail)
        self.tensor = tensor


def resolve_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    """The backend's base dtype for `device` unless `dtype` is given (DESIGN §3)."""
    if dtype is not None:
        return dtype
    name = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
    return getattr(torch, backend_for_device(name).torch_dtype_name)


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor key -> the safetensors file holding it."""
    from safetensors import safe_open

    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{INDEX_FILE} in {model_dir} has no valid weight_map: {exc}") from exc
        files = {}
        for key, name in weight_map.items():
            path = model_dir / name
            if not path.is_file():
                raise CheckpointError(f"shard {name} listed for tensor {key!r} is missing", key)
            files[key] = path
        return files
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    with safe_open(str(single), framework="pt") as f:
        return {key: single for key in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def classify(key: str) -> tuple[str, str]:
    """("vision"|"mtp"|"head"|"trunk"|"unknown", local name) of one checkpoint key."""
    if key.startswith(VISION_PREFIXES):
        return "vision", key
    if key.startswith(MTP_PREFIX):
        return "mtp", key
    if key == LM_HEAD_KEY:
        return "head", "lm_head.weight"
    for prefix in TRUNK_PREFIXES:
        if key.startswith(prefix):
            return "trunk", key[len(prefix) :]
    return "unknown", key


def _plan(model: Qwen35Model, keys) -> tuple[dict[str, str], list[str]]:
    """Local buffer name -> checkpoint key for every base tensor, and the MTP keys seen."""
    expected = dict(model.named_buffers())
    plan: dict[str, str] = {}
    mtp: list[str] = []
    for key in sorted(keys):
        kind, local = classify(key)
        if kind == "vision":
            continue
        if kind == "mtp":
            mtp.append(key)
            continue
        if kind == "head" and model.lm_head is None:
            continue  # tied: the head is the embedding (transformers ties it the same way)
        if kind == "unknown" or local not in expected:
            raise CheckpointError(f"unexpected tensor {key!r} in the checkpoint", key)
        if local in plan:
            raise CheckpointError(f"tensor {key!r} duplicates {plan[local]!r}", key)
        plan[local] = key
    missing = [name for name in expected if name not in plan]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s) {shown}{more}", missing[0])
    return plan, mtp


def _check(key: str, shape: tuple, kind: str, expected: tuple) -> None:
    if shape != expected:
        raise CheckpointError(f"tensor {key!r} has shape {shape}, expected {expected}", key)
    if kind not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {key!r} has unsupported dtype {kind}", key)


def _set_buffer(model: torch.nn.Module, local: str, value: torch.Tensor) -> None:
    parent, _, leaf = local.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    module._buffers[leaf] = value


def _device_string(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


def load_state_into(model: Qwen35Model, model_dir: str | Path, device: str | torch.device = "cpu") -> None:
    """Fill every base buffer of `model` from the checkpoint in `model_dir` (see module docstring)."""
    from safetensors import safe_open

    device = torch.device(device)
    files = checkpoint_files(Path(model_dir))
    plan, mtp = _plan(model, files)
    expected = {name: tuple(buf.shape) for name, buf in model.named_buffers()}
    by_file: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    for local, key in plan.items():
        by_file[files[key]].append((local, key))
    for path, items in sorted(by_file.items()):
        with safe_open(str(path), framework="pt", device=_device_string(device)) as f:
            for local, key in items:
                view = f.get_slice(key)  # header only: check before reading the data
                _check(key, tuple(view.get_shape()), view.get_dtype(), expected[local])
                _set_buffer(model, local, f.get_tensor(key).to(dtype=model.dtype))
    model.mtp_tensor_names = mtp


_TORCH_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
}


def load_tensors_into(
    model: Qwen35Model, tensors: dict[str, torch.Tensor], device: str | torch.device = "cpu"
) -> None:
    """Fill the base buffers from in-memory tensors under checkpoint keys (same rules as files)."""
    device = torch.device(device)
    plan, mtp = _plan(model, tensors)
    expected = {name: tuple(buf.shape) for name, buf in model.named_buffers()}
    for local, key in plan.items():
        value = tensors[key]
        _check(
            key, tuple(value.shape), _TORCH_DTYPE_NAMES.get(value.dtype, str(value.dtype)), expected[local]
        )
        _set_buffer(model, local, value.to(device=device, dtype=model.dtype))
    model.mtp_tensor_names = mtp


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Read a Qwen3.5 checkpoint directory; dtype None = the backend's (f32 on cpu, bf16 on cuda)."""
    device = torch.device(device)
    config = load_config(model_dir)
    dtype = resolve_dtype(device, dtype)
    with torch.device("meta"):
        model = Qwen35Model(config, dtype=dtype)
    load_state_into(model, model_dir, device)
    return model.eval()
