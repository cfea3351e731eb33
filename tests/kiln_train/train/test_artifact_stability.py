"""A fixed tiny run writes the receipt and checkpoint manifests it wrote before: a reorganisation
of the code must not change what a run records.

The fixture `fixtures/stable_run_v1.json` holds the receipt, the adapter manifest and both
checkpoint manifests of one seeded AdamW run on the `tiny` preset, with the fields that depend on
the moment, the machine or the source tree (times, paths, git state, binary and source digests,
library versions) replaced by `"<volatile>"`. Everything else is compared exactly, floats
within 1e-6 relative (CPU kernels may round the last bit differently on another machine).

Regenerate (only when a change of recorded behaviour is intended):
    KILN_REGENERATE_STABLE_RUN=1 .venv/bin/python -m pytest tests/kiln_train/train/test_artifact_stability.py
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from kiln_train import checkpoint as ckpt
from kiln_train.artifacts.adapter import ADAPTER_MANIFEST, TRAIN_RECEIPT

FIXTURE = Path(__file__).parent / "fixtures" / "stable_run_v1.json"
VOLATILE = "<volatile>"
# Keys whose values describe the moment, the host, the checkout or the installed libraries.
VOLATILE_KEYS = {
    "produced_at",
    "created_at",
    "path",
    "git_commit",
    "kiln_commit",
    "git_dirty",
    "git_source",
    "build",
    "versions",
    "contract_sha256",
    "provenance_sha256",
    "execution_identity_sha256",
    "numerical_runtime_sha256",
    "effective_environment_sha256",
    "effective_server_config_sha256",
    "env_config_hash",
    "kiln_env_config_hash",
    "wall_clock_ms",
    "peak_vram_mib",
    "peak_memory_bytes",
    "phase_timings",
    "timings",
    "step_ms",
    "mean_step_ms",
    "cpu_threads",
}
# Digests of float bytes: the same values on this machine, possibly not to the last bit on another.
FLOAT_DIGESTS = {"adapter_model_sha256", "safetensors_hash", "receipt_hash", "sha256", "files", "hashes"}


def mask(value, key: str | None = None):
    if key in VOLATILE_KEYS:
        return VOLATILE
    if isinstance(value, dict):
        return {k: mask(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [mask(v, key) for v in value]
    return value


def run_artifacts(resident, qwen_examples, tmp_path) -> dict:
    from kiln_train.data.ingestion import ingest_examples
    from kiln_train.sft_config import parse_sft_config
    from qualification.bench_support import train_on_resident

    config = parse_sft_config(
        {
            "epochs": 2,
            "lora_rank": 4,
            "lora_alpha": 8,
            "checkpoint_interval": 2,
            "seed": 7,
            "optimizer": {"kind": "adam_w"},
        }
    ).resolve()
    ingestion = ingest_examples(
        qwen_examples, tokenizer=resident.tokenizer, template=resident.template, policy="fail"
    )
    registry = tmp_path / "adapters"
    result = train_on_resident(resident, config, ingestion, registry, adapter_name="stable")
    assert result.status == "success", result.failure_message
    out = {
        "receipt": json.loads((result.adapter_path / TRAIN_RECEIPT).read_text()),
        "adapter_manifest": json.loads((result.adapter_path / ADAPTER_MANIFEST).read_text()),
    }
    for step in (2, 4):
        name = ckpt.checkpoint_dir_name("stable", step)
        out[f"checkpoint_{step}"] = json.loads((registry / name / ckpt.MANIFEST_FILENAME).read_text())
    return mask(out)


def compare(found, expected, where: str = "") -> list[str]:
    if isinstance(expected, dict) and isinstance(found, dict):
        problems = []
        if set(found) != set(expected):
            problems.append(f"{where}: keys {sorted(set(found) ^ set(expected))} differ")
        for k in set(found) & set(expected):
            if k in FLOAT_DIGESTS:
                continue
            problems += compare(found[k], expected[k], f"{where}.{k}")
        return problems
    if isinstance(expected, list) and isinstance(found, list):
        if len(found) != len(expected):
            return [f"{where}: {len(found)} items, expected {len(expected)}"]
        return [
            p
            for i, (a, b) in enumerate(zip(found, expected, strict=True))
            for p in compare(a, b, f"{where}[{i}]")
        ]
    if isinstance(expected, float) and isinstance(found, int | float) and not isinstance(found, bool):
        return (
            []
            if math.isclose(found, expected, rel_tol=1e-6, abs_tol=1e-12)
            else [f"{where}: {found} != {expected}"]
        )
    return [] if found == expected else [f"{where}: {found!r} != {expected!r}"]


@pytest.fixture(scope="module")
def resident(tiny_model_dir_for_stability):
    from kiln_train.train.resident import load_resident

    return load_resident(tiny_model_dir_for_stability)


@pytest.fixture(scope="module")
def tiny_model_dir_for_stability(tmp_path_factory, qwen_tokenizer):
    from kiln_train.model.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("stable-model"), preset="tiny", tokenizer=qwen_tokenizer
    )


EXAMPLES = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": f"{i} + {i} = {2 * i}.", "reasoning_content": "Add."},
        ]
    }
    for i in range(3)
]


def test_a_fixed_run_records_what_it_recorded_before(resident, tmp_path):
    found = run_artifacts(resident, EXAMPLES, tmp_path)
    if os.environ.get("KILN_REGENERATE_STABLE_RUN") == "1":
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    expected = json.loads(FIXTURE.read_text())
    assert compare(found, expected) == []
