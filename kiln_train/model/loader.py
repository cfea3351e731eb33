"""Load a Hugging Face Qwen3.5 checkpoint directory into a `Qwen35Model` (docs/model.md#loading).

Accepted layouts: `config.json` with or without the VL wrapper (`text_config`); one
`model.safetensors` or shards listed by `model.safetensors.index.json`; trunk tensors under
`model.language_model.` (VL wrapper) or `model.` (text-only); `lm_head.weight` for untied heads
(see `resolve_head_tying` for configs that omit the tie flag or contradict the stored head).
Vision tensors (`model.visual.*`) are ignored; MTP tensors (`mtp.*`) are recognised, not loaded,
and their names recorded in `model.mtp_tensor_names` (kiln never trains or runs the MTP head).
Missing, unexpected, duplicated, mis-shaped or non-float tensors, index entries whose shard is
missing or lacks the tensor, and unreadable files raise `ModelCheckpointError` (code
training_backend_unsupported) naming the checkpoint key (`tensor`), the file (`file`) and, for
shapes, expected vs got.

Memory: the model is built on the meta device, then each tensor is read from the memory-mapped
file (`safetensors.safe_open`, straight onto the target device) and cast once to the final dtype,
so the weights are never held twice.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED, KilnError
from kiln_train.ground.backend import backend_for_device
from kiln_train.model.config import Qwen35Config, load_config, stated_tie
from kiln_train.model.qwen35 import Qwen35Model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TRUNK_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."
LM_HEAD_KEY = "lm_head.weight"
FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}
# Local names only Mixture-of-Experts checkpoints use (routed experts, router, shared expert).
MOE_TENSOR_MARKERS = re.compile(r"\.mlp\.(experts|gate|shared_expert|shared_expert_gate)\.")


class ModelCheckpointError(KilnError):
    """A model checkpoint directory (Hugging Face weights) that is not a loadable Qwen3.5 text
    model. Exact training checkpoints have their own error, `kiln_train.checkpoint.CheckpointError`.

    `tensor` names the culprit tensor (its checkpoint key) and `file` the file it lives in (or the
    index / directory that should have held it), when there is one.
    """

    def __init__(self, detail: str, tensor: str | None = None, file: str | None = None) -> None:
        super().__init__(TRAINING_BACKEND_UNSUPPORTED, detail)
        self.tensor = tensor
        self.file = file


def resolve_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    """The backend's base dtype for `device` unless `dtype` is given (docs/training-profile.md#backends)."""
    if dtype is not None:
        return dtype
    name = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
    return getattr(torch, backend_for_device(name).torch_dtype_name)


def _shard_keys(path: Path) -> list[str]:
    """Tensor keys in one safetensors file's header; a ModelCheckpointError names an unreadable file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())  # noqa: SIM118 (safe_open is not a mapping)
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise ModelCheckpointError(
            f"{path.name} in {path.parent} is not a readable safetensors file: {exc}", file=path.name
        ) from None


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen and seen[key] != value:
            raise ValueError(f"key {key!r} appears twice, mapped to {seen[key]!r} and {value!r}")
        seen[key] = value
    return seen


def _shard_path(model_dir: Path, key: str, name: str) -> Path:
    """The shard file `name` of the index, which must be a plain file name inside `model_dir`.

    transformers joins the name to the directory, so `../x.safetensors` or an absolute path would
    read weights from elsewhere, which the checkpoint's identity (the digest of the directory's own
    `*.safetensors` files) does not cover. A shard that is a symlink (the Hugging Face cache layout)
    is fine: it is a file of the directory.
    """
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise ModelCheckpointError(
            f"{INDEX_FILE} in {model_dir} maps tensor {key!r} to {name!r}, which is not a file name in the "
            "model directory (shards must be plain file names next to the index)",
            key,
            INDEX_FILE,
        )
    return model_dir / name


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor key -> the safetensors file holding it (every file's header is read and checked)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicate_keys)[
                "weight_map"
            ]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError) as exc:
            raise ModelCheckpointError(
                f"{INDEX_FILE} in {model_dir} has no valid weight_map: {exc}", file=INDEX_FILE
            ) from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ModelCheckpointError(
                f"{INDEX_FILE} in {model_dir} has no valid weight_map: it must map tensor names to "
                "shard file names",
                file=INDEX_FILE,
            )
        files: dict[str, Path] = {}
        held: dict[str, set[str]] = {}
        for key, name in weight_map.items():
            path = _shard_path(model_dir, key, name)
            if name not in held:
                if not path.is_file():
                    raise ModelCheckpointError(
                        f"shard {name} listed in {INDEX_FILE} for tensor {key!r} is missing", key, name
                    )
                held[name] = set(_shard_keys(path))
            if key not in held[name]:
                raise ModelCheckpointError(
                    f"{INDEX_FILE} lists tensor {key!r} in shard {name}, which does not contain it", key, name
                )
            files[key] = path
        return files
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise ModelCheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    return {key: single for key in _shard_keys(single)}


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


def _where(files: dict, key: str) -> str:
    path = files.get(key)
    return f" in {path.name}" if isinstance(path, Path) else ""


def _file_name(files: dict, key: str) -> str | None:
    path = files.get(key)
    return path.name if isinstance(path, Path) else None


def _trunk_prefix(keys) -> str:
    """The trunk prefix this checkpoint uses (`model.language_model.` or `model.`)."""
    for key in keys:
        kind, _ = classify(key)
        if kind == "trunk":
            return next(p for p in TRUNK_PREFIXES if key.startswith(p))
    return TRUNK_PREFIXES[0]


def _unexpected_detail(key: str, local: str) -> str:
    if MOE_TENSOR_MARKERS.search(local):
        return (
            " (a Mixture-of-Experts tensor: only dense Qwen3.5 checkpoints are supported; "
            "its config.json should not claim a dense model)"
        )
    return " (not a tensor of the Qwen3.5 text model this config.json describes)"


def _plan(model: Qwen35Model, files: dict) -> tuple[dict[str, str], list[str]]:
    """Local buffer name -> checkpoint key for every base tensor, and the MTP keys seen.

    `files` maps checkpoint keys to the file holding them (or to anything else for in-memory
    tensors); errors name the key, the file and the expected shape.
    """
    expected = dict(model.named_buffers())
    plan: dict[str, str] = {}
    mtp: list[str] = []
    for key in sorted(files):
        kind, local = classify(key)
        if kind == "vision":
            continue
        if kind == "mtp":
            mtp.append(key)
            continue
        if kind == "head" and model.lm_head is None:
            continue  # tied: the head is the embedding (load_model unties a distinct head first)
        if kind == "unknown" or local not in expected:
            raise ModelCheckpointError(
                f"unexpected tensor {key!r}{_where(files, key)}{_unexpected_detail(key, local)}",
                key,
                _file_name(files, key),
            )
        if local in plan:
            raise ModelCheckpointError(
                f"tensor {key!r}{_where(files, key)} duplicates {plan[local]!r}", key, _file_name(files, key)
            )
        plan[local] = key
    missing = [name for name in expected if name not in plan]
    if missing:
        prefix = _trunk_prefix(files)
        names = [LM_HEAD_KEY if m == "lm_head.weight" else prefix + m for m in missing]
        shown = ", ".join(
            f"{n!r} (shape {tuple(expected[m].shape)})" for n, m in zip(names[:8], missing[:8], strict=True)
        )
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        stored = sorted({p.name for p in files.values() if isinstance(p, Path)})
        source = f" ({', '.join(stored[:3])}{', ...' if len(stored) > 3 else ''})" if stored else ""
        raise ModelCheckpointError(f"checkpoint{source} is missing tensor(s) {shown}{more}", names[0])
    return plan, mtp


def _check(key: str, shape: tuple, kind: str, expected: tuple, file: str | None = None) -> None:
    where = f" in {file}" if file else ""
    if shape != expected:
        raise ModelCheckpointError(f"tensor {key!r}{where} has shape {shape}, expected {expected}", key, file)
    if kind not in FLOAT_DTYPES:
        raise ModelCheckpointError(f"tensor {key!r}{where} has unsupported dtype {kind}", key, file)


def _set_buffer(model: torch.nn.Module, local: str, value: torch.Tensor) -> None:
    parent, _, leaf = local.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    module._buffers[leaf] = value


def _device_string(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


def load_state_into(
    model: Qwen35Model,
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    files: dict[str, Path] | None = None,
) -> None:
    """Fill every base buffer of `model` from the checkpoint in `model_dir` (see module docstring).

    `files` is `checkpoint_files(model_dir)` when the caller already has it.
    """
    from safetensors import safe_open

    device = torch.device(device)
    files = checkpoint_files(Path(model_dir)) if files is None else files
    plan, mtp = _plan(model, files)
    expected = {name: tuple(buf.shape) for name, buf in model.named_buffers()}
    by_file: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    for local, key in plan.items():
        by_file[files[key]].append((local, key))
    for path, items in sorted(by_file.items()):
        with safe_open(str(path), framework="pt", device=_device_string(device)) as f:
            for local, key in items:
                view = f.get_slice(key)  # header only: check before reading the data
                _check(key, tuple(view.get_shape()), view.get_dtype(), expected[local], path.name)
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


HEAD_COMPARE_ROWS = 4096  # rows per slice when comparing a stored head with the embedding


def _same_rows(files: dict[str, Path], key_a: str, key_b: str) -> bool:
    """Whether two stored [V, D] matrices are equal, read a slice of rows at a time."""
    from safetensors import safe_open

    with (
        safe_open(str(files[key_a]), framework="pt") as fa,
        safe_open(str(files[key_b]), framework="pt") as fb,
    ):
        a, b = fa.get_slice(key_a), fb.get_slice(key_b)
        shape = tuple(a.get_shape())
        if shape != tuple(b.get_shape()) or len(shape) != 2:
            return False
        for start in range(0, shape[0], HEAD_COMPARE_ROWS):
            stop = min(shape[0], start + HEAD_COMPARE_ROWS)
            if not torch.equal(a[start:stop].float(), b[start:stop].float()):
                return False
    return True


def resolve_head_tying(config: Qwen35Config, files: dict[str, Path]) -> Qwen35Config:
    """Whether the head is tied, decided from config.json and the stored tensors.

    - config.json states no tie_word_embeddings, or its VL wrapper and text_config disagree:
      tied exactly when the checkpoint has no `lm_head.weight` (a checkpoint saved tied stores no
      head; transformers' class default, untied, would leave the head random).
    - it says tied but the checkpoint also stores an `lm_head.weight` that differs from the
      embedding: transformers does not tie them and uses the stored head; so do we.
    """
    has_head = LM_HEAD_KEY in files
    stated = stated_tie(config.extra)
    if stated is None:
        tied = not has_head
    elif stated and has_head:
        embedding = _trunk_prefix(files) + "embed_tokens.weight"
        tied = embedding not in files or _same_rows(files, embedding, LM_HEAD_KEY)
    else:
        tied = stated
    return config if tied == config.tie_word_embeddings else replace(config, tie_word_embeddings=tied)


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Read a Qwen3.5 checkpoint directory; dtype None = the backend's (f32 on cpu, bf16 on cuda)."""
    device = torch.device(device)
    config = load_config(model_dir)
    files = checkpoint_files(Path(model_dir))
    config = resolve_head_tying(config, files)
    dtype = resolve_dtype(device, dtype)
    with torch.device("meta"):
        model = Qwen35Model(config, dtype=dtype)
    load_state_into(model, model_dir, device, files)
    return model.eval()
