"""Bit-exact continuation from an exact checkpoint in a fresh process (kiln-contract §5).

For each optimizer, with gradient checkpointing off and on (2 segments): N steps straight versus
k steps, checkpoint, a new Python process that loads the resident model, re-ingests the rows and
resumes to N. The continuation must give bitwise-identical adapter tensors, optimizer state and
loss history, mid-epoch (k = 3) and at an epoch boundary (k = 4). The straight run and the
resumed run both publish the step-6 checkpoint; its adapter, optimizer and loop-state files must
be byte-identical, and so must the final adapters.

The "k steps then stop" run is a cooperative cancel (`should_stop`), which publishes the
checkpoint at k and fails as `cancelled` (kiln-contract §5.6). All resumes run in one child
process (`python -m tests.kiln_train.train.trainer_fixtures resume`), with the same torch thread count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln_train.checkpoint import load_checkpoint
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, read_json, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[4]
ROWS, EPOCHS, INTERVAL, SEED = 4, 2, 3, 31
TOTAL = ROWS * EPOCHS
LATER = 6  # a checkpoint both the straight and the resumed run publish
OPTIMIZERS = {"sgd": 0.05, "adam_w": 5e-3, "muon": 1e-2}
SEGMENTS = (1, 2)
STOPS = {"mid_epoch": 3, "epoch_boundary": 4}
NAME = "exact"


def _ckpt(root: Path, step: int) -> Path:
    return root / f"{NAME}-checkpoint-step-{step:08d}.kiln-checkpoint"


class Counter:
    def __init__(self):
        self.done = 0

    def __call__(self, report):
        self.done = report.global_step


@pytest.fixture(scope="module")
def runs(resident, tiny_dir, tmp_path_factory):
    rows = conversations(ROWS)
    ingestion = ingest(resident, rows)
    base = tmp_path_factory.mktemp("resume")
    straight, jobs = {}, []
    for opt, lr in OPTIMIZERS.items():
        for segments in SEGMENTS:
            config = make_config(
                seed=SEED,
                epochs=EPOCHS,
                optimizer={"kind": opt},
                learning_rate=lr,
                checkpoint_interval=INTERVAL,
                grad_checkpoint_segments=segments if segments > 1 else None,
            )
            root = base / f"{opt}-s{segments}-straight"
            result = train(resident, config, ingestion, root, adapter_name=NAME)
            assert result.status == "success", result.failure_message
            straight[(opt, segments)] = {"result": result, "root": root}
            for where, k in STOPS.items():
                stop_root = base / f"{opt}-s{segments}-{where}"
                counter = Counter()
                stopped = train(
                    resident,
                    config,
                    ingestion,
                    stop_root,
                    adapter_name=NAME,
                    progress=counter,
                    should_stop=lambda c=counter, k=k: c.done >= k,
                )
                assert stopped.failure_reason == "cancelled", stopped.failure_message
                assert stopped.loss_history == result.loss_history[:k]
                jobs.append(
                    {
                        "key": [opt, segments, where],
                        "model_dir": str(tiny_dir),
                        "rows": rows,
                        "config": json.loads(config.model_dump_json()),
                        "output_root": str(stop_root),
                        "adapter_name": NAME,
                        "resume_checkpoint": str(_ckpt(stop_root, k)),
                    }
                )
    jobs_file = base / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    resumed = fx.run_in_fresh_process("tests.kiln_train.train.trainer_fixtures", "resume", str(jobs_file))
    by_key = {tuple(job["key"]): (job, out) for job, out in zip(jobs, resumed, strict=True)}
    return {"straight": straight, "resumed": by_key}


CASES = [(opt, seg, where) for opt in OPTIMIZERS for seg in SEGMENTS for where in STOPS]


@pytest.mark.parametrize(("opt", "segments", "where"), CASES)
def test_a_fresh_process_continues_bit_for_bit(runs, opt, segments, where):
    straight = runs["straight"][(opt, segments)]
    job, out = runs["resumed"][(opt, segments, where)]
    ref = straight["result"]
    assert out["status"] == "success", out["failure_message"]
    assert out["global_step"] == TOTAL
    # The loop state carries the history: the resumed run reports the whole of it, bit for bit.
    assert out["loss_history"] == ref.loss_history
    stop_root = Path(job["output_root"])
    assert out["checkpoints"] == [_ckpt(stop_root, LATER).name]
    final = "adapter_model.safetensors"
    assert (Path(out["adapter_path"]) / final).read_bytes() == (ref.adapter_path / final).read_bytes()
    mine, theirs = _ckpt(stop_root, LATER), _ckpt(straight["root"], LATER)
    files = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in mine.iterdir()) == files
    assert ("optimizer.safetensors" in files) is (opt != "sgd")
    for name in files:
        if name != "checkpoint_manifest.json":
            assert (mine / name).read_bytes() == (theirs / name).read_bytes(), name
    m1, m2 = read_json(mine / "checkpoint_manifest.json"), read_json(theirs / "checkpoint_manifest.json")
    assert m1.pop("created_at") and m2.pop("created_at")
    assert m1 == m2
    # Receipts agree on everything the run computed (not on timing, paths or dates).
    r1 = read_json(Path(out["adapter_path"]) / "train_receipt.json")
    r2 = ref.receipt
    for key in ("lora_delta_norms", "lora_grad_norms", "token_counts", "hyperparameters", "config", "data"):
        assert r1[key] == r2[key], key


@pytest.mark.parametrize("opt", [o for o in OPTIMIZERS if o != "sgd"])
def test_the_resumed_optimizer_state_is_the_checkpointed_one(runs, opt):
    """The restored moments and counters are what the straight run held at step k."""
    straight = runs["straight"][(opt, 1)]
    loaded = load_checkpoint(_ckpt(straight["root"], 3), verify_hashes=True)
    state = load_file(str(loaded.path / "optimizer.safetensors"))
    steps = {k: int(v.to(torch.int64)[0]) for k, v in state.items() if k.endswith(".step")}
    assert steps and set(steps.values()) == {3}
    assert loaded.manifest.optimizer.step == loaded.manifest.scheduler.step == 3
    assert loaded.manifest.optimizer.kind == opt
