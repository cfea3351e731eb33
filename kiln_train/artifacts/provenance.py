"""Identity objects: base-weight shard manifest, model/tokenizer digests, execution provenance.

docs/artifacts.md#provenance. Torch-free at import; `runtime_versions()` imports torch lazily.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from kiln_train.data.chat_template import CHAT_TEMPLATE_FILE
from kiln_train.data.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from kiln_train.ground.digest import file_digest, json_sha256, sha256_prefixed
from kiln_train.model.config import CONFIG_FILE

BASE_WEIGHT_SHARDS = "kiln.base-weight-shards.v1"
BASE_MODEL_CONTENT = "kiln.base-model-content.v1"
EXECUTION_PROVENANCE = "kiln.execution-provenance.v1"
KERNEL_CONTRACT = "kiln.kernel-contract.v1"
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PRIVATE", "AUTH", "CREDENTIAL")
# Only the training library defines what executes; an api or docs change is not a new identity.
PACKAGE_ROOTS = ("kiln_train",)


def base_weight_shard_manifest(model_dir: str | Path) -> dict:
    """`kiln.base-weight-shards.v1` over every `*.safetensors` file of the model directory."""
    shards = sorted(p for p in Path(model_dir).iterdir() if p.suffix == ".safetensors" and p.is_file())
    if not 1 <= len(shards) <= 4096:
        raise ValueError(f"expected 1..4096 .safetensors shards in {model_dir}, found {len(shards)}")
    records = [{"filename": p.name, "size_bytes": p.stat().st_size, "sha256": file_digest(p)} for p in shards]
    return {
        "schema_version": 1,
        "manifest_type": BASE_WEIGHT_SHARDS,
        "aggregate_algorithm": BASE_MODEL_CONTENT,
        "aggregate_sha256": shard_aggregate(records),
        "total_size_bytes": sum(r["size_bytes"] for r in records),
        "shards": records,
    }


def shard_aggregate(records: list[dict]) -> str:
    """Aggregate over (size, digest) pairs sorted by (digest bytes, size); filenames excluded."""
    pairs = sorted(
        (bytes.fromhex(r["sha256"].removeprefix("sha256:")), int(r["size_bytes"])) for r in records
    )
    h = hashlib.sha256(BASE_MODEL_CONTENT.encode("ascii") + b"\0" + len(pairs).to_bytes(8, "little"))
    for digest, size in pairs:
        h.update(size.to_bytes(8, "little") + digest)
    return "sha256:" + h.hexdigest()


def optional_file_digest(path: Path) -> str | None:
    return file_digest(path) if path.is_file() else None


def model_identity(model_dir: str | Path, training_chat_template_sha256: str | None) -> dict:
    """Digests of the files that define the model and its text interface."""
    d = Path(model_dir)
    template = optional_file_digest(d / CHAT_TEMPLATE_FILE)
    if template is None and (d / TOKENIZER_CONFIG_FILE).is_file():
        tmpl = json.loads((d / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8")).get("chat_template")
        template = sha256_prefixed(tmpl.encode("utf-8")) if isinstance(tmpl, str) else None
    return {
        "model_config_sha256": file_digest(d / CONFIG_FILE),
        "tokenizer_vocab_sha256": file_digest(d / TOKENIZER_FILE),
        "tokenizer_config_sha256": optional_file_digest(d / TOKENIZER_CONFIG_FILE),
        "chat_template_sha256": template,
        "training_chat_template_sha256": training_chat_template_sha256,
    }


def environment_sha256(environ: dict[str, str]) -> str:
    """Digest of the sorted KILN_* variables; secret-looking names contribute only their presence."""
    items = []
    for name in sorted(k for k in environ if k.startswith("KILN_")):
        secret = any(m in name.upper() for m in SECRET_MARKERS)
        items.append([name, "<redacted-present>" if secret else environ[name]])
    return json_sha256(items)


def _package_version() -> str:
    try:
        return metadata.version("kiln")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


@lru_cache(maxsize=1)
def source_tree_sha256() -> str:
    """Digest of every .py/.jinja file of the training library (path + content), in path order."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256(b"kiln-py.source-tree.v1\0")
    for pkg in PACKAGE_ROOTS:
        base = root / pkg
        if not base.is_dir():
            continue
        for p in sorted(q for q in base.rglob("*") if q.suffix in (".py", ".jinja")):
            rel = p.relative_to(root).as_posix().encode()
            data = p.read_bytes()
            h.update(len(rel).to_bytes(8, "big") + rel + len(data).to_bytes(8, "big") + data)
    return "sha256:" + h.hexdigest()


@lru_cache(maxsize=1)
def git_state() -> tuple[str | None, bool | None]:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return None, None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return commit.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def runtime_versions() -> dict[str, str]:
    """Versions of the numerical stack the trainer executes with."""
    versions = {"python": platform.python_version()}
    for dist in (
        "torch",
        "safetensors",
        "tokenizers",
        "jinja2",
        "numpy",
        "flash-linear-attention",
        "fla-core",
        "triton",
    ):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def execution_provenance(
    *,
    backend: dict,
    device_name: str,
    model: dict,
    training_policy: dict,
    compiled_features: list[str],
    server_config: dict,
    environ: dict[str, str] | None = None,
    kernel_paths: dict[str, str] | None = None,
) -> dict:
    """`kiln.execution-provenance.v1`; `provenance_sha256` covers every other field.

    `kernel_paths` (additive within version 1): the implementation of each fused operation, as
    `kiln_train.kernels.paths.KernelPaths.to_dict` gives it (docs/kernels.md#kernel-paths).
    """
    versions = runtime_versions()
    kernels = {
        "contract_type": KERNEL_CONTRACT,
        "versions": versions,
        "compiled_features": sorted(compiled_features),
    }
    if kernel_paths is not None:
        kernels["paths"] = dict(sorted(kernel_paths.items()))
    kernels["contract_sha256"] = json_sha256(kernels)
    prov = {
        "schema_version": 1,
        "provenance_type": EXECUTION_PROVENANCE,
        "backend": {
            "name": backend["name"],
            "device": backend["device"],
            "numerical_runtime_sha256": json_sha256(
                {"versions": versions, "device_name": device_name, "backend": backend}
            ),
        },
        "build": {
            "package_version": _package_version(),
            "target": f"{platform.machine()}-{sys.platform}-cpython{sys.version_info[0]}{sys.version_info[1]}",
            "executable_sha256": file_digest(sys.executable) if os.path.isfile(sys.executable) else None,
            # git commit/dirtiness live in the receipt's `kiln` section: they change with any commit
            # (docs, api) and would turn every deploy into identity drift for queued jobs.
            "source_tree_sha256": source_tree_sha256(),
        },
        "model": model,
        "precision": {"inference_dtype": backend["base_weight_dtype"], "training_policy": training_policy},
        "kernels": kernels,
        "configuration": {
            "effective_server_config_sha256": json_sha256(server_config),
            "effective_environment_sha256": environment_sha256(
                dict(os.environ if environ is None else environ)
            ),
        },
    }
    prov["provenance_sha256"] = json_sha256(prov)
    return prov


def verify_provenance_digest(prov: dict) -> bool:
    body = {k: v for k, v in prov.items() if k != "provenance_sha256"}
    return prov.get("provenance_sha256") == json_sha256(body)
