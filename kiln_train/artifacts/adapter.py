"""PEFT adapter directories: writing, atomic publication, reading, the adapter manifest.

docs/artifacts.md#peft-adapter. Tensor names are the Hugging Face module paths under PEFT's
`base_model.model.` root (docs/artifacts.md#tensor-names), so PEFT and serving engines load the
adapter without a key remap.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from kiln_train.artifacts.adapter_layout import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_MODEL, TRAIN_RECEIPT
from kiln_train.artifacts.fencing import Fence, fenced_rename, grab_leftover, put_back
from kiln_train.artifacts.receipt import NULL_ADAPTER_IDENTITY
from kiln_train.errors import ADAPTER_ALREADY_EXISTS, INVALID_ADAPTER_NAME, KilnError, TrainingFailure
from kiln_train.ground.digest import file_digest, sha256_prefixed
from kiln_train.ground.durable_files import fsync_dir, rename_no_replace, write_new_file
from kiln_train.model.config import LORA_TARGET_MODULES, Qwen35Config

PEFT_PREFIX = "base_model.model.model."
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # matched in full
log = logging.getLogger(__name__)
_KEY_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|linear_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


def check_adapter_name(name: str) -> str:
    if (
        not ADAPTER_NAME_RE.fullmatch(name)
        or name.endswith(".kiln-checkpoint")
        or "-checkpoint-step-" in name
    ):
        raise KilnError(INVALID_ADAPTER_NAME, f"invalid adapter name {name!r}")
    return name


def adapter_config(rank: int, alpha: float) -> dict:
    """`adapter_config.json`: exactly the keys of docs/artifacts.md#adapter-config."""
    return {
        "r": rank,
        "lora_alpha": float(alpha),
        "target_modules": list(LORA_TARGET_MODULES),
        "task_type": "CAUSAL_LM",
        "bias": "none",
        "peft_type": "LORA",
    }


def parse_key(key: str) -> tuple[int, str, str, str]:
    """(layer, block, target, "A"|"B") of a PEFT LoRA key; ValueError if it is not one."""
    m = _KEY_RE.match(key)
    if not m or m.group(3) not in LORA_TARGET_MODULES:
        raise ValueError(f"not a Qwen3.5 LoRA tensor name: {key}")
    return int(m.group(1)), m.group(2), m.group(3), m.group(4)


def expected_shapes(config: Qwen35Config, rank: int) -> dict[str, tuple[int, int]]:
    """PEFT key -> shape for every LoRA tensor of a rank-`rank` adapter on `config`."""
    shapes = {}
    for p in config.projections():
        base = f"{PEFT_PREFIX}{p.module}"
        shapes[f"{base}.lora_A.weight"] = (rank, p.in_features)
        shapes[f"{base}.lora_B.weight"] = (p.out_features, rank)
    return shapes


def lora_delta_norms(tensors: dict, scale: float) -> list[dict]:
    """Per target module: L2 (Frobenius) norms of A and B and the bound scale·|A|·|B| on |ΔW|."""
    pairs: dict[tuple[int, str], dict[str, float]] = {}
    for key, t in tensors.items():
        layer, _, target, ab = parse_key(key)
        pairs.setdefault((layer, target), {})[ab] = float(t.double().norm())
    out = []
    for target in LORA_TARGET_MODULES:
        rows = [v for (_, tgt), v in sorted(pairs.items()) if tgt == target and len(v) == 2]
        if not rows:
            continue
        a = [r["A"] for r in rows]
        b = [r["B"] for r in rows]
        bound = [scale * r["A"] * r["B"] for r in rows]
        out.append(
            {
                "module": target,
                "pair_count": len(rows),
                "a_l2_mean": sum(a) / len(a),
                "a_l2_max": max(a),
                "b_l2_mean": sum(b) / len(b),
                "b_l2_max": max(b),
                "delta_l2_upper_bound_mean": sum(bound) / len(bound),
                "delta_l2_upper_bound_max": max(bound),
            }
        )
    return out


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def publish_adapter(
    registry: Path,
    name: str,
    tensors: dict,
    *,
    rank: int,
    alpha: float,
    build_receipt: Callable[[dict], dict],
    build_manifest: Callable[[dict, dict], dict],
    extra_files: dict[str, bytes] | None = None,
    fence: Fence | None = None,
) -> Path:
    """Write the adapter in a hidden staging directory, then rename it to `registry/name`.

    `build_receipt(output_identity)` gets `{path, adapter_model_sha256, adapter_model_bytes}` and
    returns the receipt; `build_manifest(receipt, file_hashes)` returns `adapter_manifest.json`.
    Never overwrites: an existing name raises `adapter_already_exists`, unless the `fence` (checked
    around the rename, see `kiln_train.artifacts.fencing`) says a stale run of the same job published it.
    """
    from safetensors.torch import save as save_tensors

    check_adapter_name(name)
    registry.mkdir(parents=True, exist_ok=True)
    target = registry / name
    if os.path.lexists(target):
        _withdraw_leftover(target, fence)
    staging = registry / f".{name}.incomplete-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        ordered = {k: tensors[k].detach().cpu().contiguous() for k in sorted(tensors)}
        model_bytes = save_tensors(ordered, metadata={"format": "pt"})
        write_new_file(staging / ADAPTER_MODEL, model_bytes)
        config_bytes = json_bytes(adapter_config(rank, alpha))
        write_new_file(staging / ADAPTER_CONFIG, config_bytes)
        for rel, data in (extra_files or {}).items():
            write_new_file(staging / rel, data)
        output = {
            "path": str(target),
            "adapter_model_sha256": sha256_prefixed(model_bytes),
            "adapter_model_bytes": len(model_bytes),
        }
        receipt = build_receipt(output)
        receipt_bytes = json_bytes(receipt)
        write_new_file(staging / TRAIN_RECEIPT, receipt_bytes)
        hashes = {
            "safetensors_hash": output["adapter_model_sha256"],
            "config_hash": sha256_prefixed(config_bytes),
            "receipt_hash": sha256_prefixed(receipt_bytes),
        }
        write_new_file(staging / ADAPTER_MANIFEST, json_bytes(build_manifest(receipt, hashes)))
        fsync_dir(staging)
        _place_adapter(staging, target, fence)
        try:
            fsync_dir(registry)
        except OSError:
            # Renamed but not made durable: the run fails, and a failed run leaves no adapter
            # holding the name.
            shutil.rmtree(target, ignore_errors=True)
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _rename_adapter(staging: Path, target: Path) -> None:
    try:
        # No-replace: plain rename(2) silently replaces an empty directory that took the name
        # after any check (names are never overwritten).
        rename_no_replace(staging, target)
    except FileExistsError:
        raise KilnError(ADAPTER_ALREADY_EXISTS, f"adapter {target.name!r} already exists") from None


def _place_adapter(staging: Path, target: Path, fence: Fence | None) -> None:
    """Rename into place between fence checks; a stale run's copy that took the name meanwhile
    is withdrawn and the rename tried again."""
    for _ in range(3):
        try:
            fenced_rename(staging, target, fence, _rename_adapter)
            return
        except KilnError:
            if fence is None or not os.path.lexists(target):
                raise
        _withdraw_leftover(target, fence)
    raise KilnError(ADAPTER_ALREADY_EXISTS, f"adapter {target.name!r} already exists")


def _withdraw_leftover(target: Path, fence: Fence | None) -> None:
    """An adapter holds the name: withdraw it when a stale run of this job wrote it, else refuse."""
    exists = KilnError(ADAPTER_ALREADY_EXISTS, f"adapter {target.name!r} already exists")
    if fence is None or target.is_symlink():
        raise exists
    hidden = grab_leftover(target, fence)
    if hidden is None:
        return
    try:
        receipt = json.loads((hidden / TRAIN_RECEIPT).read_text(encoding="utf-8"))
        ours = isinstance(receipt, dict) and fence.leftover_adapter(receipt)
    except (OSError, ValueError):
        ours = False
    if not ours:
        put_back(hidden, target)
        raise exists
    shutil.rmtree(hidden, ignore_errors=True)
    log.warning(
        "withdrew adapter %s: published by a stale run of this job; publishing this run's", target.name
    )


def read_adapter(path: Path) -> tuple[dict, dict]:
    """(adapter_config, tensors) of a PEFT adapter directory.

    A missing directory or file is `base_adapter_missing`; unreadable JSON or safetensors bytes
    are `adapter_load_failed` (the adapter exists but is corrupt).
    """
    from safetensors.torch import load as load_tensors

    model_path = path / ADAPTER_MODEL
    if not (path / ADAPTER_CONFIG).is_file() or not model_path.is_file():
        raise TrainingFailure("base_adapter_missing", f"{path} is not a PEFT adapter directory")
    cfg = _read_adapter_config(path)
    try:
        tensors = load_tensors(model_path.read_bytes())
    except Exception as exc:  # safetensors raises its own error types for every malformed file
        raise TrainingFailure(
            "adapter_load_failed", f"{model_path} is not a readable safetensors file: {exc}"
        ) from None
    return cfg, tensors


def check_adapter_provenance(
    path: Path, *, model_config_sha256: str | None, base_weights_sha256: str | None
) -> None:
    """When the adapter carries `adapter_manifest.json`, it must describe these files and this base.

    A plain PEFT adapter (no manifest) is accepted on shapes alone; a Kiln adapter whose manifest
    disagrees with its own files or names another model config or base-weight content is refused.
    """
    manifest_path = path / ADAPTER_MANIFEST
    if not manifest_path.is_file():
        return
    manifest = _read_json_object(manifest_path)
    if manifest.get("safetensors_hash") != file_digest(path / ADAPTER_MODEL):
        raise TrainingFailure(
            "adapter_load_failed",
            f"base adapter {path.name}: adapter_model.safetensors does not match its manifest's safetensors_hash",
        )
    if model_config_sha256 is not None and manifest.get("model_config_hash") not in (
        None,
        model_config_sha256,
    ):
        raise TrainingFailure(
            "adapter_load_failed",
            f"base adapter {path.name} was trained on another model config: model_config_hash "
            f"{manifest.get('model_config_hash')}, resident {model_config_sha256}",
        )
    shards = manifest.get("base_weight_shard_manifest")
    theirs = shards.get("aggregate_sha256") if isinstance(shards, dict) else None
    if base_weights_sha256 is not None and theirs is not None and theirs != base_weights_sha256:
        raise TrainingFailure(
            "adapter_load_failed",
            f"base adapter {path.name} was trained on other base weights: "
            f"base_weight_shard_manifest.aggregate_sha256 {theirs}, resident {base_weights_sha256}",
        )


# PEFT over transformers' VL class (`Qwen3_5ForConditionalGeneration`) nests the text layers one
# level deeper; the tensors are the same, so such an adapter warm-starts under our names.
VL_PEFT_PREFIX = "base_model.model.model.language_model."

# LoraConfig fields that change what A and B mean; a warm start from such an adapter would not
# start from the function it was trained to compute.
_FOREIGN_PARAMETRISATION = ("use_dora", "use_rslora")
_PER_MODULE_OVERRIDES = ("rank_pattern", "alpha_pattern")


def _normalise_keys(tensors: dict) -> dict:
    if tensors and all(k.startswith(VL_PEFT_PREFIX) for k in tensors):
        return {PEFT_PREFIX + k[len(VL_PEFT_PREFIX) :]: v for k, v in tensors.items()}
    return tensors


def _check_lora_parametrisation(cfg: dict, rank: int, alpha: float | None) -> None:
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int):
        raise TrainingFailure("adapter_load_failed", f"base adapter config has no integer rank r (got {r!r})")
    if r != rank:
        raise TrainingFailure(
            "shape_mismatch", f"base adapter rank {cfg.get('r')} differs from lora_rank {rank}"
        )
    for key in _FOREIGN_PARAMETRISATION:
        if cfg.get(key):
            raise TrainingFailure(
                "adapter_load_failed",
                f"base adapter sets {key}: true; Kiln trains plain LoRA (scale lora_alpha/r), so it "
                "cannot continue this adapter",
            )
    for key in _PER_MODULE_OVERRIDES:
        if cfg.get(key):
            raise TrainingFailure(
                "adapter_load_failed",
                f"base adapter has a non-empty {key}; Kiln uses one rank and one alpha for every target",
            )
    theirs = cfg.get("lora_alpha")
    if alpha is not None and theirs is not None:
        if isinstance(theirs, bool) or not isinstance(theirs, (int, float)):
            raise TrainingFailure(
                "adapter_load_failed", f"base adapter lora_alpha {theirs!r} is not a number"
            )
        if float(theirs) != float(alpha):
            raise TrainingFailure(
                "adapter_load_failed",
                f"base adapter lora_alpha {theirs:g} differs from lora_alpha {alpha:g}: the warm start "
                f"would scale its delta by {float(alpha) / float(theirs):g}; submit lora_alpha {theirs:g}",
            )
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise TrainingFailure(
            "shape_mismatch",
            f"base adapter target_modules must list the modules {list(LORA_TARGET_MODULES)} "
            f"(got {targets!r})",
        )
    if set(targets) != set(LORA_TARGET_MODULES):
        raise TrainingFailure(
            "shape_mismatch",
            f"base adapter targets {sorted(set(targets))} differ from {list(LORA_TARGET_MODULES)}",
        )


def _safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file's JSON header, without torch."""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(0)
            prefix = fh.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if length < 2 or length > size - 8:
                raise ValueError(f"header length {length} does not fit a {size}-byte file")
            header = json.loads(fh.read(length).decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        out = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = entry["shape"] if isinstance(entry, dict) else None
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"tensor {name!r} has no valid shape")
            out[name] = (str(entry.get("dtype")), tuple(shape))
        return out
    except (OSError, UnicodeDecodeError, ValueError, KeyError) as exc:
        raise TrainingFailure(
            "adapter_load_failed", f"{path} is not a readable safetensors file: {exc}"
        ) from None


def _read_adapter_config(path: Path) -> dict:
    return _read_json_object(path / ADAPTER_CONFIG)


def _read_json_object(path: Path) -> dict:
    """A JSON object file of the adapter; anything else is `adapter_load_failed`."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrainingFailure("adapter_load_failed", f"{path} is not readable JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TrainingFailure("adapter_load_failed", f"{path} is not a JSON object")
    return obj


_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


def check_base_adapter_files(path: Path, config: Qwen35Config, rank: int, alpha: float | None) -> None:
    """The static half of the warm-start check, torch-free (admission runs it before queueing).

    Not an exact checkpoint, both files present and readable, LoRA type, rank, plain-LoRA
    parametrisation (no DoRA/rsLoRA/per-module patterns; `lora_alpha` equal to the run's when
    given), target set, and the exact A/B key set with PEFT shapes and floating dtypes read from
    the safetensors header (keys of an adapter made on transformers' VL class are accepted under
    their text-model names).
    """
    if path.name.endswith(".kiln-checkpoint"):
        raise TrainingFailure(
            "adapter_load_failed",
            f"{path.name} is an exact checkpoint; use resume_checkpoint to continue it, not base_adapter",
        )
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_MODEL).is_file():
        raise TrainingFailure("base_adapter_missing", f"{path} is not a PEFT adapter directory")
    cfg = _read_adapter_config(path)
    header = _normalise_keys(_safetensors_header(path / ADAPTER_MODEL))
    if cfg.get("peft_type", "LORA") != "LORA":
        raise TrainingFailure(
            "adapter_load_failed", f"base adapter peft_type {cfg.get('peft_type')} is not LORA"
        )
    _check_lora_parametrisation(cfg, rank, alpha)
    want = expected_shapes(config, rank)
    missing = sorted(set(want) - set(header))
    extra = sorted(set(header) - set(want))
    if missing or extra:
        raise TrainingFailure(
            "shape_mismatch",
            f"base adapter tensor set differs: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}",
        )
    for key, shape in want.items():
        dtype, got = header[key]
        if got != shape:
            raise TrainingFailure("shape_mismatch", f"base adapter {key} has shape {got}, want {shape}")
        if dtype not in _FLOAT_DTYPES:
            raise TrainingFailure(
                "adapter_load_failed", f"base adapter {key} is {dtype}, not a floating-point tensor"
            )


def load_base_adapter(
    path: Path,
    config: Qwen35Config,
    rank: int,
    *,
    alpha: float | None = None,
    model_config_sha256: str | None = None,
    base_weights_sha256: str | None = None,
) -> dict:
    """Read a warm-start adapter's tensors, validated against the model and the run's rank.

    `check_base_adapter_files` first, then the tensors themselves (readable, finite) and, given
    the resident digests, the provenance its `adapter_manifest.json` records.
    """
    check_base_adapter_files(path, config, rank, alpha)
    _, tensors = read_adapter(path)
    tensors = _normalise_keys(tensors)
    for key, t in tensors.items():
        if not t.is_floating_point() or not bool(t.float().isfinite().all()):
            raise TrainingFailure(
                "adapter_load_failed", f"base adapter {key} is not a finite floating-point tensor"
            )
    check_adapter_provenance(
        path, model_config_sha256=model_config_sha256, base_weights_sha256=base_weights_sha256
    )
    return tensors


def adapter_identity(path: Path | None) -> dict:
    """`adapters.base` / `adapters.output` receipt object for an adapter directory (or null path)."""
    if path is None:
        return dict(NULL_ADAPTER_IDENTITY)
    model = path / ADAPTER_MODEL
    return {
        "path": str(path),
        "adapter_model_sha256": file_digest(model),
        "adapter_model_bytes": model.stat().st_size,
    }
