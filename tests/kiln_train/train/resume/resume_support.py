"""Helpers shared by the resume tests in this folder: chains of legs and their comparison.

A "chain" is one run trained straight through and the same run stopped cooperatively at each of
`stops` (`should_stop`, which publishes the checkpoint at that step), every leg resuming from the
checkpoint the previous leg published, and a last leg that resumes to the end. `assert_same_run`
then compares the two bit for bit: loss history, final adapter bytes, every checkpoint the
straight run published (file bytes and manifest), the receipt and the adapter manifest (all but
timing, dates and paths).

The fresh-process leg driver is also here:

    python -m tests.kiln_train.train.resume.resume_support leg JOB.json

where JOB.json is `{model_dir, rows, policy, config, output_root, adapter_name, resume_checkpoint,
stop_at}`; the leg's result is printed as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from kiln_train.sft_config import SftConfig
from kiln_train.train.resident import load_resident
from qualification.bench_support import train_on_resident
from tests.kiln_train.train.trainer_fixtures import (
    TRAIN_THREADS,
    ingest,
    read_json,
    result_summary,
    run_in_fresh_process,
    train,
)

ROOT = Path(__file__).resolve().parents[4]
NAME = "probe"
ADAPTER_MODEL = "adapter_model.safetensors"
MANIFEST = "checkpoint_manifest.json"
# Receipt members that legitimately differ between two runs of the same training.
VOLATILE_RECEIPT = {
    "produced_at",
    "runtime.wall_clock_ms",
    "runtime.peak_vram_mib",
    "runtime.peak_memory_bytes",
    "adapters.output.path",
    "adapters.base.path",
    # The working copy's git state as each process saw it (others may commit meanwhile).
    "kiln.git_commit",
    "kiln.git_dirty",
}
# Checkpoint-manifest members that name where the run's registry was (straight and chained runs
# train in different registries): the warm-start adapter's directory.
VOLATILE_MANIFEST = {"auxiliary_state.base_adapter.path"}


def ckpt_path(root: Path, step: int, name: str = NAME) -> Path:
    return Path(root) / f"{name}-checkpoint-step-{step:08d}.kiln-checkpoint"


class StopAt:
    """`progress` + `should_stop` pair that stops cooperatively once `step` is reached."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, 0

    def progress(self, report) -> None:
        self.done = report.global_step

    def should_stop(self) -> bool:
        return self.done >= self.step


def leg(resident, config, ingestion, root: Path, *, resume: Path | None, stop_at: int | None, name=NAME):
    """One leg of a chain: resume (or start) and stop at `stop_at` (None: run to the end)."""
    stopper = StopAt(stop_at) if stop_at is not None else None
    return train(
        resident,
        config,
        ingestion,
        root,
        adapter_name=name,
        resume_checkpoint=resume,
        progress=stopper.progress if stopper else None,
        should_stop=stopper.should_stop if stopper else None,
    )


def chain(resident, config, ingestion, root: Path, stops: list[int], *, name=NAME):
    """Every leg of the chain in this process; returns the final leg's result."""
    resume = None
    for k in stops:
        stopped = leg(resident, config, ingestion, root, resume=resume, stop_at=k, name=name)
        assert stopped.failure_reason == "cancelled", stopped.failure_message
        assert stopped.global_step == k
        resume = ckpt_path(root, k, name)
        assert resume.is_dir(), f"the stop at step {k} published no checkpoint"
    return leg(resident, config, ingestion, root, resume=resume, stop_at=None, name=name)


def json_diff(a, b, path: str = "") -> list[str]:
    """Dotted paths where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in [*a, *(k for k in b if k not in a)]:
            sub = f"{path}.{key}" if path else key
            if key not in a or key not in b:
                out.append(sub)
            else:
                out += json_diff(a[key], b[key], sub)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in json_diff(x, y, f"{path}[{i}]")]
    return [] if a == b and type(a) is type(b) else [path]


def assert_same_run(
    ref, final, straight_root: Path, chain_root: Path, stops: list[int], *, name=NAME
) -> None:
    """The chained run is the straight run, bit for bit (see the module docstring)."""
    assert ref.status == "success", ref.failure_message
    assert final.status == "success", final.failure_message
    assert final.global_step == ref.global_step == ref.total_steps
    assert final.loss_history == ref.loss_history  # floats compared exactly
    assert (final.adapter_path / ADAPTER_MODEL).read_bytes() == (
        ref.adapter_path / ADAPTER_MODEL
    ).read_bytes()
    cfg = "adapter_config.json"
    assert (final.adapter_path / cfg).read_bytes() == (ref.adapter_path / cfg).read_bytes()
    # Checkpoints: the chain publishes the straight run's ones plus one per stop.
    straight = sorted(p.name for p in Path(straight_root).glob("*.kiln-checkpoint"))
    chained = sorted(p.name for p in Path(chain_root).glob("*.kiln-checkpoint"))
    assert chained == sorted({*straight, *(ckpt_path(chain_root, k, name).name for k in stops)})
    for basename in straight:
        mine, theirs = Path(chain_root) / basename, Path(straight_root) / basename
        files = sorted(p.name for p in theirs.iterdir())
        assert sorted(p.name for p in mine.iterdir()) == files
        for f in files:
            if f != MANIFEST:
                assert (mine / f).read_bytes() == (theirs / f).read_bytes(), f"{basename}/{f}"
        m1, m2 = read_json(mine / MANIFEST), read_json(theirs / MANIFEST)
        assert m1.pop("created_at") and m2.pop("created_at")
        assert [p for p in json_diff(m1, m2) if p not in VOLATILE_MANIFEST] == [], basename
    # The receipt and the adapter manifest agree on everything the run computed.
    r1, r2 = read_json(final.receipt_path), read_json(ref.receipt_path)
    assert [p for p in json_diff(r1, r2) if p not in VOLATILE_RECEIPT] == []
    a1 = read_json(final.adapter_path / "adapter_manifest.json")
    a2 = read_json(ref.adapter_path / "adapter_manifest.json")
    assert [p for p in json_diff(a1, a2) if p not in ("receipt_hash", "kiln_commit")] == []


# ----- fresh-process legs ------------------------------------------------------------------------


def run_leg_in_fresh_process(job: dict, tmp: Path) -> dict:
    """Run one leg in a new Python process (same torch thread count); its result as a dict."""
    job_file = Path(tmp) / f"leg-{os.getpid()}-{len(list(Path(tmp).glob('leg-*.json')))}.json"
    job_file.write_text(json.dumps(job), encoding="utf-8")
    return run_in_fresh_process("tests.kiln_train.train.resume.resume_support", "leg", str(job_file))


def _leg_main(job_path: str) -> None:
    torch.set_num_threads(TRAIN_THREADS)
    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    res = load_resident(job["model_dir"])
    ingestion = ingest(res, job["rows"], policy=job.get("policy", "fail"))
    stopper = StopAt(job["stop_at"]) if job.get("stop_at") is not None else None
    result = train_on_resident(
        res,
        SftConfig.model_validate(job["config"]),
        ingestion,
        job["output_root"],
        adapter_name=job["adapter_name"],
        resume_checkpoint=job.get("resume_checkpoint"),
        progress=stopper.progress if stopper else None,
        should_stop=stopper.should_stop if stopper else None,
    )
    print(json.dumps({**result_summary(result), "receipt_path": str(result.receipt_path)}))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "leg":
        raise SystemExit("usage: python -m tests.kiln_train.train.resume.resume_support leg JOB.json")
    _leg_main(sys.argv[2])
