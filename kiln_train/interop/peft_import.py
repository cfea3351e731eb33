"""Importing a PEFT LoRA adapter into Kiln's registry, after it proved it belongs (docs/interop.md).

An upload is a gzip tar of an adapter directory: `adapter_config.json` and
`adapter_model.safetensors` (required), and from a run of a Kiln export bundle
`kiln_hf_result.json`, `step_losses.jsonl` and optionally the bundle's `kiln_hf_export.json`.
`plan_import` checks, in this order, and names the first difference:

1. the archive: a gzip tar of regular files, at most one directory deep, each name once;
2. `adapter_config.json`: peft_type LORA, an integer rank, a finite positive alpha, target_modules
   a list drawn from the ten Qwen3.5 targets, and no option Kiln cannot represent (DoRA, rsLoRA,
   biases, per-module ranks or alphas, modules_to_save, layer subsets, fan-in-fan-out, an
   initialisation that rewrote the base weights, ...);
3. `adapter_model.safetensors` against the resident model: every tensor a LoRA A/B weight of a
   listed target on an existing projection, every such projection present, shapes
   `A [r, in]` / `B [out, r]` (a wrong rank is named as one), floating dtypes, finite values;
4. when `kiln_hf_result.json` is present: a finished run (`kiln.hf-trl-result.v1`), whose
   recorded adapter file hashes are the uploaded files', whose export (by bundle digest) is one this
   server published or the uploaded `kiln_hf_export.json`, run by that bundle's own `train.py`,
   on the rank, alpha and targets the adapter claims, with the base model, tokenizer and training
   template identities of the resident runner.

Structural problems (1-3, and a run that did not finish) are `peft_import_invalid` (400);
provenance problems (4) are `peft_import_mismatch` (409). Nothing is written before every check
passed. `publish_import` then writes the adapter Kiln can warm-start from: the tensors under
Kiln's key names (a VL-class prefix is normalised), Kiln's `adapter_config.json`, targets the
upload did not train filled with a zero-delta pair (B = 0, A from `kiln-py.seeded-lora-init.v1`
so the pair can still learn), `adapter_manifest.json`, the import receipt
`kiln_import_receipt.json` (schema `kiln.hf-peft-import.v1`) and the run's own files, in a
staging directory renamed into place (names are never overwritten).

Torch-free: the api runs it.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import tarfile
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from kiln_train.artifacts.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_MANIFEST,
    ADAPTER_MODEL,
    PEFT_PREFIX,
    VL_PEFT_PREFIX,
    adapter_config,
    check_adapter_name,
    expected_shapes,
    parse_key,
)
from kiln_train.artifacts.digest import sha256_prefixed
from kiln_train.artifacts.receipt import ADAPTER_MANIFEST_TYPE
from kiln_train.checkpoint.fs import fsync_dir, rename_no_replace, write_new_file
from kiln_train.errors import ADAPTER_ALREADY_EXISTS, KilnError
from kiln_train.interop import safetensors_io
from kiln_train.interop.bundle import EXPORT_SCHEMA, MANIFEST, RUNNER_FILE, ResidentFacts, manifest_digest
from kiln_train.interop.errors import import_invalid, import_mismatch
from kiln_train.interop.lora_init import LORA_INIT_ALGORITHM, seeded_lora_tensors
from kiln_train.model.config import ATTENTION_TARGETS, GDN_TARGETS, LORA_TARGET_MODULES, MLP_TARGETS

IMPORT_SCHEMA = "kiln.hf-peft-import.v1"
RESULT_SCHEMA = "kiln.hf-trl-result.v1"
RESULT_FILE = "kiln_hf_result.json"
LOSSES_FILE = "step_losses.jsonl"
IMPORT_RECEIPT = "kiln_import_receipt.json"
SOURCE_CONFIG = "peft_adapter_config.json"  # the uploaded adapter_config.json, kept as it came
UPLOAD_FILES = (ADAPTER_CONFIG, ADAPTER_MODEL, RESULT_FILE, LOSSES_FILE, MANIFEST)
RUN_ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_MODEL)
STAGING_MARK = ".incomplete-"
MAX_MEMBERS = 64

# adapter_config.json keys that only describe the run or the file (any value).
_DESCRIPTIVE = frozenset(
    {
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "auto_mapping",
        "peft_version",
        "lora_dropout",  # dropout shapes training only; the trained adapter is plain LoRA
        "megatron_core",
        "qalora_group_size",  # meaningful only with use_qalora, which is refused
        "ensure_weight_tying",  # meaningful only with modules_to_save / trainable tokens, refused
        "eva_config",  # EVA only chooses the initial A; rank redistribution would show in rank_pattern
    }
)
# Initialisations after which the adapter is a plain delta on the original base weights (PiSSA,
# OLoRA, LoftQ, CorDA and LoRA-GA rewrite the base weights instead).
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")


@dataclass(frozen=True)
class Upload:
    """The files of an upload Kiln reads (by name), and the names it ignored."""

    files: dict[str, bytes]
    ignored: tuple[str, ...] = ()


@dataclass
class ImportPlan:
    """Everything `publish_import` writes, decided by `plan_import` (no file written yet)."""

    rank: int
    alpha: float
    targets: list[str]
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]]
    filled: list[str]
    fill_seed: int | None
    key_prefix: str
    upload: Upload
    peft_config: dict
    result: dict | None
    export: dict | None
    resident: ResidentFacts
    checks: list[str] = field(default_factory=list)

    @property
    def vouched(self) -> bool:
        """Whether a run manifest bound the adapter to the resident identities."""
        return self.result is not None


# ----- 1. the archive -------------------------------------------------------------------------------


def read_archive(data: bytes, *, max_bytes: int) -> Upload:
    """The known files of a gzip tar (flat, or under one top-level directory); 400 otherwise."""
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")  # noqa: SIM115 (closed below)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise import_invalid(f"the upload is not a gzip tar archive ({exc})") from None
    files: dict[str, bytes] = {}
    ignored: list[str] = []
    top: set[str] = set()
    total = 0
    try:
        with archive:
            for count, member in enumerate(archive, start=1):
                if count > MAX_MEMBERS:
                    raise import_invalid(f"the archive holds more than {MAX_MEMBERS} entries")
                parts = _member_parts(member.name)
                if member.isdir():
                    continue
                if not member.isreg():
                    raise import_invalid(f"archive entry {member.name!r} is not a regular file")
                if len(parts) > 2:
                    raise import_invalid(
                        f"archive entry {member.name!r} is nested too deep: the adapter files go at the top "
                        "or in one directory"
                    )
                top.add(parts[0] if len(parts) == 2 else "")
                if len(top) > 1:
                    raise import_invalid(
                        "the archive mixes several directories; upload one adapter directory"
                    )
                base = parts[-1]
                if base not in UPLOAD_FILES:
                    ignored.append(base)
                    continue
                if base in files:
                    raise import_invalid(f"the archive holds {base} twice")
                total += member.size
                if total > max_bytes:
                    raise import_invalid(f"the archive unpacks to more than {max_bytes} bytes")
                handle = archive.extractfile(member)
                content = handle.read() if handle is not None else b""
                if len(content) != member.size:
                    raise import_invalid(f"archive entry {member.name!r} is truncated")
                files[base] = content
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise import_invalid(f"the archive cannot be read ({exc})") from None
    return Upload(files, tuple(sorted(ignored)))


def _member_parts(name: str) -> tuple[str, ...]:
    path = PurePosixPath(name)
    parts = tuple(p for p in path.parts if p not in ("", "."))
    if path.is_absolute() or ".." in parts or not parts:
        raise import_invalid(f"archive entry {name!r} is not a relative path inside the archive")
    return parts


def read_directory(path: Path) -> Upload:
    """The known files of an adapter directory (the CLI and library path)."""
    files = {name: (path / name).read_bytes() for name in UPLOAD_FILES if (path / name).is_file()}
    return Upload(files)


# ----- 2. adapter_config.json -----------------------------------------------------------------------


def _falsy(value) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


def _neutral_checks() -> dict[str, tuple[Callable[[object], bool], str]]:
    none = (_falsy, "Kiln adapters have none")
    return {
        "use_dora": (_falsy, "DoRA adds a magnitude vector Kiln does not train or load"),
        "use_rslora": (_falsy, "rsLoRA scales by alpha/sqrt(r); Kiln scales by alpha/r"),
        "use_qalora": (_falsy, "QA-LoRA pools the input; Kiln's LoRA does not"),
        "bias": (lambda v: v in (None, "none"), "Kiln trains no biases"),
        "lora_bias": (_falsy, "Kiln trains no LoRA biases"),
        "fan_in_fan_out": (_falsy, "Kiln stores A as [r, in] and B as [out, r]"),
        "modules_to_save": (_falsy, "Kiln trains the LoRA pairs only"),
        "trainable_token_indices": (_falsy, "Kiln trains no token embeddings"),
        "target_parameters": (_falsy, "Kiln adapts modules, not parameters"),
        "rank_pattern": (_falsy, "Kiln uses one rank for every target"),
        "alpha_pattern": (_falsy, "Kiln uses one alpha for every target"),
        "layers_to_transform": (_falsy, "Kiln adapts every layer"),
        "layers_pattern": (_falsy, "Kiln adapts every layer"),
        "exclude_modules": (_falsy, "Kiln adapts every layer of a target"),
        "layer_replication": (_falsy, "Kiln does not replicate layers"),
        "alora_invocation_tokens": (_falsy, "activated LoRA changes when the adapter applies"),
        "megatron_config": none,
        "loftq_config": (_falsy, "LoftQ rewrites the base weights"),
        "corda_config": (_falsy, "CorDA rewrites the base weights"),
        "lora_ga_config": (_falsy, "LoRA-GA rewrites the base weights"),
        "init_lora_weights": (
            lambda v: v in _PLAIN_INITS,
            "this initialisation rewrites the base weights, so the adapter is not a delta on the resident model",
        ),
    }


def check_peft_config(data: bytes) -> tuple[int, float, list[str], dict]:
    """(rank, alpha, targets, the config) of an adapter_config.json Kiln can represent."""
    try:
        cfg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise import_invalid(f"{ADAPTER_CONFIG} is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise import_invalid(f"{ADAPTER_CONFIG} is not a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise import_invalid(
            f"{ADAPTER_CONFIG}: peft_type is {cfg.get('peft_type')!r}; Kiln imports LORA adapters"
        )
    task = cfg.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise import_invalid(f"{ADAPTER_CONFIG}: task_type is {task!r}; Kiln adapters are CAUSAL_LM")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise import_invalid(f"{ADAPTER_CONFIG}: r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise import_invalid(f"{ADAPTER_CONFIG}: lora_alpha must be a finite positive number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        raise import_invalid(
            f"{ADAPTER_CONFIG}: target_modules is the pattern {targets!r}; Kiln imports adapters that list "
            f"their modules, drawn from {list(LORA_TARGET_MODULES)}"
        )
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise import_invalid(f"{ADAPTER_CONFIG}: target_modules must be a non-empty list of module names")
    for target in targets:
        if target not in LORA_TARGET_MODULES:
            raise import_invalid(
                f"{ADAPTER_CONFIG}: target module {target!r} is not one of Kiln's ten LoRA targets "
                f"{list(LORA_TARGET_MODULES)}"
            )
    if len(set(targets)) != len(targets):
        raise import_invalid(f"{ADAPTER_CONFIG}: target_modules lists a module twice")
    rules = _neutral_checks()
    for key in sorted(cfg):
        if key in ("peft_type", "task_type", "r", "lora_alpha", "target_modules") or key in _DESCRIPTIVE:
            continue
        value = cfg[key]
        ok, why = rules.get(key, (_falsy, "Kiln does not know this PEFT option"))
        if not ok(value):
            raise import_invalid(
                f"{ADAPTER_CONFIG}: {key} = {json.dumps(value)} cannot be represented: {why}"
            )
    return r, float(alpha), list(targets), cfg


# ----- 3. the tensors -------------------------------------------------------------------------------


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


# ----- 4. the run -----------------------------------------------------------------------------------


def _json_file(upload: Upload, name: str) -> dict:
    try:
        value = json.loads(upload.files[name].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise import_invalid(f"{name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise import_invalid(f"{name} is not a JSON object")
    return value


def _get(obj: dict, path: str):
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def check_run(
    upload: Upload,
    resident: ResidentFacts,
    rank: int,
    alpha: float,
    targets: list[str],
    find_export: Callable[[str], dict | None],
) -> tuple[dict, dict]:
    """(result, export manifest) of a run whose manifest vouches for the upload on this server."""
    result = _json_file(upload, RESULT_FILE)
    if result.get("schema") != RESULT_SCHEMA:
        raise import_invalid(f"{RESULT_FILE}: schema is {result.get('schema')!r}, not {RESULT_SCHEMA}")
    if result.get("status") != "success":
        raise import_invalid(
            f"{RESULT_FILE}: the run did not finish ({result.get('message') or result.get('status')})"
        )
    recorded = result.get("adapter") if isinstance(result.get("adapter"), dict) else {}
    for name in RUN_ADAPTER_FILES:
        got = sha256_prefixed(upload.files[name])
        if recorded.get(name) != got:
            raise import_mismatch(
                f"{name} has sha256 {got}, but the run recorded {recorded.get(name)} in {RESULT_FILE}: the file was "
                "changed after training"
            )
    digest = _get(result, "export.bundle_digest")
    export = None
    if MANIFEST in upload.files:
        export = _json_file(upload, MANIFEST)
        if export.get("schema") != EXPORT_SCHEMA or manifest_digest(export) != export.get("bundle_digest"):
            raise import_mismatch(
                f"the uploaded {MANIFEST} does not recompute to its bundle_digest: it was changed"
            )
        if export.get("bundle_digest") != digest:
            raise import_mismatch(
                f"{RESULT_FILE} names export {digest}, the uploaded {MANIFEST} is {export.get('bundle_digest')}"
            )
    else:
        export = find_export(digest) if isinstance(digest, str) else None
        if export is None:
            raise import_mismatch(
                f"{RESULT_FILE} names export bundle_digest {digest}, which is no export of this server; upload "
                f"the bundle's {MANIFEST} with the adapter"
            )
    files = export.get("files") if isinstance(export.get("files"), dict) else {}
    entry = files.get(RUNNER_FILE)
    script = entry.get("sha256") if isinstance(entry, dict) else None
    if _get(result, "script.sha256") != script:
        raise import_mismatch(
            f"the run executed a train.py with sha256 {_get(result, 'script.sha256')}, the export's is {script}"
        )
    pairs = (
        ("base_model.model_config_sha256", resident.identity["model_config_sha256"]),
        ("base_model.base_weights_sha256", resident.base_weights_sha256),
        ("tokenizer.tokenizer_vocab_sha256", resident.identity["tokenizer_vocab_sha256"]),
        ("template.training_chat_template_sha256", resident.identity["training_chat_template_sha256"]),
    )
    for path, pinned in pairs:
        for source, value in (
            (RESULT_FILE, _get(result, path)),
            (f"the export's {MANIFEST}", _get(export, path)),
        ):
            if value != pinned:
                raise import_mismatch(
                    f"{source}: {path} is {value}, the resident runner's is {pinned}: the adapter was trained "
                    f"against another {path.split('.')[0].replace('_', ' ')}"
                )
    claims = (
        ("lora.rank", lambda v: v == rank, rank),
        ("lora.alpha", lambda v: isinstance(v, int | float) and float(v) == alpha, alpha),
        ("lora.target_modules", lambda v: isinstance(v, list) and sorted(v) == sorted(targets), targets),
    )
    for path, same, mine in claims:
        for source, value in (
            (RESULT_FILE, _get(result, path)),
            (f"the export's {MANIFEST}", _get(export, path)),
        ):
            if not same(value):
                raise import_mismatch(f"{source}: {path} is {value}, {ADAPTER_CONFIG} says {mine}")
    return result, export


# ----- the plan and the publication -----------------------------------------------------------------


def plan_import(
    upload: Upload, resident: ResidentFacts, find_export: Callable[[str], dict | None]
) -> ImportPlan:
    """Every check, in order; the first failure raises (400 or 409), nothing is written."""
    for name in RUN_ADAPTER_FILES:
        if name not in upload.files:
            raise import_invalid(f"the upload has no {name}; it must hold a PEFT adapter directory")
    checks = ["archive"]
    rank, alpha, targets, cfg = check_peft_config(upload.files[ADAPTER_CONFIG])
    checks.append("adapter_config")
    tensors, prefix = check_tensors(upload.files[ADAPTER_MODEL], resident, rank, targets)
    checks += ["tensor_names_and_shapes", "dtypes", "finite_values"]
    result = export = None
    if RESULT_FILE in upload.files:
        result, export = check_run(upload, resident, rank, alpha, targets, find_export)
        checks += ["run_files", "export_digest", "runner_script", "identities", "lora_shape"]
    filled = [t for t in LORA_TARGET_MODULES if t not in targets]
    fill_seed = None
    if filled:
        fill_seed = int.from_bytes(hashlib.sha256(upload.files[ADAPTER_MODEL]).digest()[:8], "big")
        init = seeded_lora_tensors(resident.model, rank, fill_seed)
        for key, value in init.items():
            if parse_key(key)[2] in filled:
                tensors[key] = value
    return ImportPlan(
        rank=rank,
        alpha=alpha,
        targets=[t for t in LORA_TARGET_MODULES if t in targets],
        tensors=tensors,
        filled=filled,
        fill_seed=fill_seed,
        key_prefix=prefix,
        upload=upload,
        peft_config=cfg,
        result=result,
        export=export,
        resident=resident,
        checks=checks,
    )


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _receipt(name: str, plan: ImportPlan, published: dict, runner_id: str | None) -> dict:
    resident = plan.resident
    run = None
    if plan.result is not None:
        result, export = plan.result, plan.export or {}
        run = {
            "export": {"name": export.get("name"), "bundle_digest": export.get("bundle_digest")},
            "script_sha256": _get(result, "script.sha256"),
            "versions": result.get("versions"),
            "version_drift": result.get("version_drift"),
            "steps": _get(result, "run.steps"),
            "final_loss": _get(result, "losses.final_loss"),
            "losses_sha256": _get(result, "losses.sha256"),
            "training_data_sha256": _get(export, "data.kept_corpus_sha256"),
        }
    return {
        "schema": IMPORT_SCHEMA,
        "adapter_name": name,
        "imported_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "origin": "kiln_hf_trl_run" if plan.result is not None else "peft",
        "upload": {
            "files": {
                n: {"sha256": sha256_prefixed(b), "bytes": len(b)}
                for n, b in sorted(plan.upload.files.items())
            },
            "ignored": list(plan.upload.ignored),
        },
        "peft_config": plan.peft_config,
        "adapter": {
            "rank": plan.rank,
            "alpha": plan.alpha,
            "key_prefix": plan.key_prefix,
            "dtypes": sorted({d for d, _, _ in plan.tensors.values()}),
            "tensors": len(plan.tensors),
            "targets_trained": plan.targets,
            "targets_filled": plan.filled,
            "fill": None
            if not plan.filled
            else {"a": LORA_INIT_ALGORITHM, "seed": str(plan.fill_seed), "b": "zeros", "delta": "zero"},
        },
        "run": run,
        "resident": {
            "runner_id": runner_id,
            "model_config_sha256": resident.identity["model_config_sha256"],
            "base_weights_sha256": resident.base_weights_sha256,
            "tokenizer_vocab_sha256": resident.identity["tokenizer_vocab_sha256"],
            "training_chat_template_sha256": resident.identity["training_chat_template_sha256"],
        },
        "identity_vouched_by_run": plan.vouched,
        "checks": plan.checks,
        "published": published,
    }


def _manifest(name: str, plan: ImportPlan, hashes: dict) -> dict:
    """`adapter_manifest.json`: the fields a warm start reads (kiln_train.artifacts.adapter
    .check_adapter_provenance) are set only where a run manifest vouched for them."""
    resident, vouched = plan.resident, plan.vouched
    return {
        "schema_version": 1,
        "manifest_type": ADAPTER_MANIFEST_TYPE,
        "adapter_name": name,
        "safetensors_hash": hashes["safetensors_hash"],
        "config_hash": hashes["config_hash"],
        "receipt_hash": hashes["receipt_hash"],
        "parent_adapter": None,
        "model_config_hash": resident.identity["model_config_sha256"] if vouched else None,
        "training_chat_template_hash": resident.identity["training_chat_template_sha256"]
        if vouched
        else None,
        "base_weight_shard_manifest": {"aggregate_sha256": resident.base_weights_sha256} if vouched else None,
        "execution_provenance": None,
        "training_precision": None,
        "kiln_commit": None,
        "training_data_hash": _get(plan.export, "data.kept_corpus_sha256") if plan.export else None,
        "training_data_source": "hf_trl_export" if vouched else None,
        "training_data_path": None,
        "openenv_training_data": None,
        "target_modules": {
            "full_attention": list(ATTENTION_TARGETS),
            "gated_deltanet": list(GDN_TARGETS),
            "mlp": list(MLP_TARGETS),
        },
        "files": {
            "adapter_model": ADAPTER_MODEL,
            "adapter_config": ADAPTER_CONFIG,
            "import_receipt": IMPORT_RECEIPT,
        },
        "origin": "peft_import",
    }


def publish_import(
    adapters_dir: Path,
    name: str,
    plan: ImportPlan,
    *,
    runner_id: str | None = None,
    register: Callable[[Path, dict], None] | None = None,
) -> tuple[Path, dict]:
    """Write the adapter in a hidden staging directory and rename it to `adapters_dir/name`.

    `register(path, receipt)` records it (the api inserts the `adapters` row in the transaction
    it commits); when it raises, the published directory is removed again, so a refused import
    leaves nothing. Returns (path, import receipt).
    """
    check_adapter_name(name)
    adapters_dir.mkdir(parents=True, exist_ok=True)
    target = adapters_dir / name
    # A fixed-length staging name (an adapter name may use the whole 255 bytes of a path segment);
    # the registry's sweep of abandoned `.<x>.incomplete-<hex>` directories covers it too.
    staging = adapters_dir / f".hf-import{STAGING_MARK}{uuid.uuid4().hex}"
    staging.mkdir()
    renamed = False
    try:
        model_bytes = safetensors_io.dump(plan.tensors, {"format": "pt"})
        config_bytes = _json_bytes(adapter_config(plan.rank, plan.alpha))
        write_new_file(staging / ADAPTER_MODEL, model_bytes)
        write_new_file(staging / ADAPTER_CONFIG, config_bytes)
        write_new_file(staging / SOURCE_CONFIG, plan.upload.files[ADAPTER_CONFIG])
        for extra in (RESULT_FILE, LOSSES_FILE, MANIFEST):
            if extra in plan.upload.files:
                write_new_file(staging / extra, plan.upload.files[extra])
        published = {
            "adapter_model_sha256": sha256_prefixed(model_bytes),
            "adapter_model_bytes": len(model_bytes),
            "adapter_config_sha256": sha256_prefixed(config_bytes),
        }
        receipt = _receipt(name, plan, published, runner_id)
        receipt_bytes = _json_bytes(receipt)
        write_new_file(staging / IMPORT_RECEIPT, receipt_bytes)
        hashes = {
            "safetensors_hash": published["adapter_model_sha256"],
            "config_hash": published["adapter_config_sha256"],
            "receipt_hash": sha256_prefixed(receipt_bytes),
        }
        write_new_file(staging / ADAPTER_MANIFEST, _json_bytes(_manifest(name, plan, hashes)))
        fsync_dir(staging)
        try:
            rename_no_replace(staging, target)
        except FileExistsError:
            raise KilnError(ADAPTER_ALREADY_EXISTS, f"adapter {name!r} already exists") from None
        renamed = True
        fsync_dir(adapters_dir)
        if register is not None:
            register(target, receipt)
    except BaseException:
        shutil.rmtree(target if renamed else staging, ignore_errors=True)
        raise
    return target, receipt
