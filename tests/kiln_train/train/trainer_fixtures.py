"""Shared fixtures and helpers for the trainer, resume, adapter, receipt and canary tests.

One tiny random Qwen3.5 checkpoint (full Qwen3.5 vocabulary, so the real tokenizer and chat
template apply) is written once per session and one resident model is loaded from it; tests that
mutate the model load their own copy. Torch runs single-threaded inside these tests: the CI
machine is shared and small-shape kernels oversubscribed across threads are 20x slower, and the
bit-exact comparisons need one fixed thread count in every process that takes part.

Import the fixtures a test module uses explicitly:

    from tests.kiln_train.train.trainer_fixtures import resident, tiny_dir  # noqa: F401

The module is also the fresh-process resume driver of `resume/test_exact.py`:

    python -m tests.kiln_train.train.trainer_fixtures resume JOBS.json

where JOBS.json lists `{model_dir, rows, config, output_root, adapter_name, resume_checkpoint}`
objects; each is resumed with `train_sft` in order and the results are printed as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln_train.data.ingestion import IngestionResult, ingest_examples
from kiln_train.model.tiny import write_tiny_checkpoint
from kiln_train.sft_config import SftConfig, parse_sft_config
from kiln_train.train.resident import ResidentModel, load_resident
from kiln_train.train.result import TrainResult
from qualification.bench_support import train_on_resident

TRAIN_THREADS = 1
_CACHE: dict[str, object] = {}

COLORS = ["red", "blue", "green", "gold", "teal", "pink", "gray", "navy", "lime", "plum"]


def conversations(n: int, *, offset: int = 0) -> list[dict]:
    """`n` distinct short user/assistant conversations (the assistant turns share one pattern)."""
    rows = []
    for i in range(offset, offset + n):
        color = COLORS[i % len(COLORS)]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Item {i}: which color is listed?"},
                    {"role": "assistant", "content": f"The color is {color}."},
                ]
            }
        )
    return rows


@pytest.fixture(scope="module")
def one_thread():
    """Torch single-threaded for the module (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, qwen_tokenizer) -> Path:
    """A tiny random Qwen3.5 checkpoint with the real tokenizer and chat template (seed 0)."""
    if "tiny" not in _CACHE:
        out = tmp_path_factory.mktemp("trainer-tiny") / "model"
        _CACHE["tiny"] = write_tiny_checkpoint(out, "tiny", seed=0, tokenizer=qwen_tokenizer)
    return _CACHE["tiny"]


@pytest.fixture(scope="session")
def other_tiny_dir(tmp_path_factory, qwen_tokenizer) -> Path:
    """The same architecture with other random weights (seed 1): different base-weight content."""
    if "other" not in _CACHE:
        out = tmp_path_factory.mktemp("trainer-tiny-other") / "model"
        _CACHE["other"] = write_tiny_checkpoint(out, "tiny", seed=1, tokenizer=qwen_tokenizer)
    return _CACHE["other"]


@pytest.fixture(scope="session")
def resident(tiny_dir) -> ResidentModel:
    """The shared resident model; tests must leave its base weights as they found them."""
    if "resident" not in _CACHE:
        _CACHE["resident"] = load_resident(tiny_dir)
    return _CACHE["resident"]


def ingest(resident: ResidentModel, rows: list[dict], **kw) -> IngestionResult:
    return ingest_examples(rows, tokenizer=resident.tokenizer, template=resident.template, **kw)


def make_config(seed: int = 7, **fields) -> SftConfig:
    """An effective (resolved) config; small rank and a fast optimizer unless overridden."""
    body = {"epochs": 2, "lora_rank": 4, "lora_alpha": 8.0, "optimizer": {"kind": "adam_w"}}
    body["learning_rate"] = 1e-3
    body.update(fields)
    return parse_sft_config(body).resolve(seed=seed)


def train(resident: ResidentModel, config: SftConfig, ingestion: IngestionResult, root: Path, **kw):
    """`train_sft` on the resident's own route with single-threaded torch."""
    before = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        return train_on_resident(resident, config, ingestion, root, **kw)
    finally:
        torch.set_num_threads(before)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def failed_receipt(result: TrainResult, root: Path) -> dict:
    """The failed receipt of `result`, checked to lie where the contract's failure path puts it."""
    assert result.status == "failed"
    assert result.adapter_path is None
    assert result.receipt_path.parent == Path(root) / ".failed" / result.adapter_name
    assert result.receipt_path.name.endswith(".train_receipt.json")
    assert not (Path(root) / result.adapter_name).exists()
    receipt = read_json(result.receipt_path)
    assert receipt["status"] == "failed"
    assert receipt["failure_reason"] == result.failure_reason
    assert receipt["failure_message"] == result.failure_message
    assert receipt["adapters"]["output"] == {
        "path": None,
        "adapter_model_sha256": None,
        "adapter_model_bytes": None,
    }
    assert receipt["lora_delta_norms"] == []
    return receipt


def result_summary(result: TrainResult) -> dict:
    """What a fresh-process run prints of its result for the parent test to compare."""
    return {
        "status": result.status,
        "failure_reason": result.failure_reason,
        "failure_message": result.failure_message,
        "global_step": result.global_step,
        "loss_history": result.loss_history,
        "adapter_path": None if result.adapter_path is None else str(result.adapter_path),
    }


# ----- the fresh-process resume driver ------------------------------------------------------------


def _resume_jobs(jobs_path: str) -> None:
    torch.set_num_threads(TRAIN_THREADS)
    jobs = json.loads(Path(jobs_path).read_text(encoding="utf-8"))
    residents: dict[str, ResidentModel] = {}
    out = []
    for job in jobs:
        res = residents.get(job["model_dir"])
        if res is None:
            res = residents[job["model_dir"]] = load_resident(job["model_dir"])
        ingestion = ingest(res, job["rows"])
        config = SftConfig.model_validate(job["config"])
        result = train_on_resident(
            res,
            config,
            ingestion,
            job["output_root"],
            adapter_name=job["adapter_name"],
            resume_checkpoint=job["resume_checkpoint"],
        )
        out.append({**result_summary(result), "checkpoints": [c["basename"] for c in result.checkpoints]})
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "resume":
        raise SystemExit("usage: python -m tests.kiln_train.train.trainer_fixtures resume JOBS.json")
    _resume_jobs(sys.argv[2])


def run_in_fresh_process(module: str, *args: str) -> object:
    """`python -m <module> <args>` from the repository root in a new interpreter (same torch
    thread count); the JSON its last stdout line carries."""
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
