"""Helpers of the HF/TRL interop tests.

- `kiln_run`: Kiln's own run of some rows, through the public `kiln_train.train_sft` entry point
  (the one place these tests call the trainer);
- `run_train_py`: a bundle's `train.py` in a fresh interpreter, with the real pinned TRL;
- `fake_run_output`: what `train.py` leaves in its output directory, without training (the
  bundle's initial adapter with B nudged, PEFT's adapter_config.json, a result manifest whose
  hashes are right), for the import tests that need a run but not its numbers;
- `rehash_bundle`, `rewrite_result`: re-sign an edited bundle or result, so a test reaches the
  check behind the hashes; `tar_gz`: an upload.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln_train.data.ingestion import ingest_examples
from kiln_train.interop.bundle import MANIFEST, manifest_digest

TRAIN_THREADS = 1
# The files an export bundle's manifest lists; the bundle also holds the manifest itself.
MANIFEST_FILES = {
    "README.md",
    "chat_template_training.jinja",
    "config.json",
    "ingestion_receipt.json",
    "initial_adapter/adapter_config.json",
    "initial_adapter/adapter_model.safetensors",
    "requirements.lock",
    "tokenizer.json",
    "train.jsonl",
    "train.py",
}

# adapter_config.json exactly as PEFT 0.21.2 saves a LoRA adapter trained by TRL (r, alpha and
# target_modules filled in per test).
PEFT_ADAPTER_CONFIG = {
    "alora_invocation_tokens": None,
    "alpha_pattern": {},
    "arrow_config": None,
    "auto_mapping": None,
    "base_model_name_or_path": "/models/qwen3.5",
    "bias": "none",
    "corda_config": None,
    "ensure_weight_tying": False,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "kasa_config": None,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_bias": False,
    "lora_dropout": 0.0,
    "lora_ga_config": None,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "monteclora_config": None,
    "peft_type": "LORA",
    "peft_version": "0.21.2",
    "qalora_group_size": 16,
    "rank_pattern": {},
    "revision": None,
    "target_parameters": None,
    "task_type": "CAUSAL_LM",
    "trainable_token_indices": None,
    "use_bdlora": None,
    "use_dora": False,
    "use_qalora": False,
    "use_rslora": False,
    "velora_config": None,
}


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def kiln_run(resident, config, rows: list[dict], output_root: Path, adapter_name: str, **kw):
    """Kiln's run of `rows` under the effective `config` (single-threaded torch)."""
    from qualification.bench_support import train_on_resident

    ingestion = ingest_examples(rows, tokenizer=resident.tokenizer, template=resident.template)
    before = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        return train_on_resident(resident, config, ingestion, output_root, adapter_name=adapter_name, **kw)
    finally:
        torch.set_num_threads(before)


def run_train_py(bundle: Path, model_dir: Path, out: Path, *extra: str, timeout: float = 900):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, str(bundle / "train.py"), "--model", str(model_dir), "--output-dir", str(out)]
    command += ["--threads", str(TRAIN_THREADS), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_json(path: Path, value: dict) -> None:
    Path(path).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def rehash_bundle(bundle: Path) -> dict:
    """Recompute every file hash and the digest of an edited bundle (a consistent re-sign)."""
    manifest = read_json(bundle / MANIFEST)
    for rel, entry in manifest["files"].items():
        data = (bundle / rel).read_bytes()
        entry.update(sha256=sha256(data), bytes=len(data))
    manifest["bundle_digest"] = manifest_digest(manifest)
    write_json(bundle / MANIFEST, manifest)
    return manifest


def fake_run_output(bundle: Path, out: Path, *, seed: int = 0, scale: float = 1e-3) -> Path:
    """A run's output directory for `bundle` without training."""
    manifest = read_json(bundle / MANIFEST)
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(bundle / "initial_adapter" / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for key, value in tensors.items():
        if ".lora_B." in key:
            tensors[key] = (torch.randn(value.shape, generator=gen) * scale).to(value.dtype)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / "adapter_model.safetensors"))
    lora = manifest["lora"]
    config = {**PEFT_ADAPTER_CONFIG, "r": lora["rank"], "lora_alpha": lora["alpha"]}
    config["target_modules"] = list(reversed(lora["target_modules"]))  # PEFT writes a set's order
    write_json(out / "adapter_config.json", config)
    steps = manifest["schedule"]["total_steps"]
    losses = "".join(json.dumps({"step": s + 1, "loss": 12.0 - 0.01 * s}) + "\n" for s in range(steps))
    (out / "step_losses.jsonl").write_text(losses, encoding="utf-8")
    result = {
        "schema": "kiln.hf-trl-result.v1",
        "status": "success",
        "export": {"name": manifest["name"], "bundle_digest": manifest["bundle_digest"]},
        "script": {"file": "train.py", "sha256": sha256((bundle / "train.py").read_bytes())},
        "versions": {"trl": "1.16.0"},
        "version_drift": [],
        "base_model": {k: manifest["base_model"][k] for k in ("model_config_sha256", "base_weights_sha256")},
        "tokenizer": {"tokenizer_vocab_sha256": manifest["tokenizer"]["tokenizer_vocab_sha256"]},
        "template": {"training_chat_template_sha256": manifest["template"]["training_chat_template_sha256"]},
        "lora": {k: lora[k] for k in ("rank", "alpha", "target_modules")},
        "optimizer": manifest["optimizer"],
        "run": {"steps": steps},
        "losses": {"file": "step_losses.jsonl", "sha256": sha256((out / "step_losses.jsonl").read_bytes())},
    }
    rewrite_result(out, result)
    return out


def rewrite_result(out: Path, result: dict | None = None) -> dict:
    """Write (or re-sign) kiln_hf_result.json with the adapter files' current hashes."""
    result = result if result is not None else read_json(out / "kiln_hf_result.json")
    result["adapter"] = {
        name: sha256((out / name).read_bytes())
        for name in ("adapter_config.json", "adapter_model.safetensors")
    }
    write_json(out / "kiln_hf_result.json", result)
    return result


def tar_gz(directory: Path, names: list[str] | None = None, arcroot: str | None = "trl-output") -> bytes:
    """A gzip tar of `names` (default: every file) of `directory`, under `arcroot/` (or flat)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in names or sorted(p.name for p in directory.iterdir() if p.is_file()):
            tar.add(directory / name, arcname=f"{arcroot}/{name}" if arcroot else name)
    return buffer.getvalue()


def relative_error(ours: dict, theirs: dict) -> tuple[float, str]:
    """max over tensors of max|a - b| / max|b|, and the tensor where it is reached."""
    worst, where = 0.0, ""
    for key, ref in theirs.items():
        scale = ref.abs().max().item()
        err = (ours[key] - ref).abs().max().item() / scale if scale else (ours[key] - ref).abs().max().item()
        if err >= worst:
            worst, where = err, key
    return worst, where
