"""A resume computes with the intra-op thread count its checkpoint recorded (docs/checkpoints.md).

CPU matmul and reduction kernels split work by torch's intra-op thread count, so one run trained
with 2 threads and the same run with 1 thread end in different bits. A checkpoint records the
count in `auxiliary_state.backend_runtime.cpu_threads`; `train_sft` resumes with that count
whatever the resuming process uses, restores the process's own count afterwards, and records the
count in the receipt's `runtime.cpu_threads`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from kiln_train.train.resume_state import intra_op_threads, recorded_aux, recorded_cpu_threads
from qualification.bench_support import train_on_resident
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, read_json

resident, tiny_dir = fx.resident, fx.tiny_dir  # shared fixtures

NAME = "threads"
ROWS, EPOCHS, INTERVAL, STOP = 4, 1, 2, 2


def _train(resident, config, ingestion, root: Path, threads: int, **kw):
    with intra_op_threads(threads):
        return train_on_resident(resident, config, ingestion, root, adapter_name=NAME, **kw)


def _adapter_sha(result) -> str:
    return hashlib.sha256((result.adapter_path / "adapter_model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def setup(resident):
    ingestion = ingest(resident, conversations(ROWS))
    config = make_config(seed=5, epochs=EPOCHS, optimizer={"kind": "adam_w"}, checkpoint_interval=INTERVAL)
    return ingestion, config


def test_thread_count_changes_the_bits_and_a_resume_uses_the_recorded_count(resident, setup, tmp_path):
    ingestion, config = setup
    straight2 = _train(resident, config, ingestion, tmp_path / "straight2", threads=2)
    straight1 = _train(resident, config, ingestion, tmp_path / "straight1", threads=1)
    assert straight2.status == straight1.status == "success"
    # The premise: the two counts give different adapters (else this test proves nothing).
    assert _adapter_sha(straight2) != _adapter_sha(straight1)
    assert straight2.receipt["runtime"]["cpu_threads"] == 2
    assert straight1.receipt["runtime"]["cpu_threads"] == 1

    stopped_root = tmp_path / "stopped"
    done = {"step": 0}

    def progress(report):
        done["step"] = report.global_step

    stopped = _train(
        resident,
        config,
        ingestion,
        stopped_root,
        threads=2,
        progress=progress,
        should_stop=lambda: done["step"] >= STOP,
    )
    assert stopped.status == "failed" and stopped.failure_reason == "cancelled"
    ckpt = stopped_root / f"{NAME}-checkpoint-step-{STOP:08d}.kiln-checkpoint"
    manifest = read_json(ckpt / "checkpoint_manifest.json")
    assert manifest["auxiliary_state"]["backend_runtime"]["cpu_threads"] == 2
    assert recorded_cpu_threads(recorded_aux(ckpt)) == 2

    # Resume in a process running 1 thread: the continuation runs with 2 and equals straight2.
    with intra_op_threads(1):
        resumed = train_on_resident(
            resident, config, ingestion, stopped_root, adapter_name=NAME, resume_checkpoint=ckpt
        )
        assert torch.get_num_threads() == 1  # the process's own count is back
    assert resumed.status == "success", resumed.failure_message
    assert resumed.loss_history == straight2.loss_history
    assert _adapter_sha(resumed) == _adapter_sha(straight2)
    assert resumed.receipt["runtime"]["cpu_threads"] == 2


@pytest.mark.parametrize(
    "value, expected",
    [
        (3, 3),
        (1, 1),
        (0, None),
        (-2, None),
        (True, None),
        (2.0, None),
        ("2", None),
        (10**6, None),
        (None, None),
    ],
)
def test_recorded_thread_count_is_read_only_when_it_is_a_sane_integer(tmp_path, value, expected):
    body = {"auxiliary_state": {"backend_runtime": {"cpu_threads": value}}}
    (tmp_path / "checkpoint_manifest.json").write_text(json.dumps(body), encoding="utf-8")
    assert recorded_cpu_threads(recorded_aux(tmp_path)) == expected


@pytest.mark.parametrize("content", [None, "not json", "[]", '{"auxiliary_state": 3}', "\udcff"])
def test_an_unreadable_manifest_leaves_the_count_to_the_strict_loader(tmp_path, content):
    if content is not None:
        (tmp_path / "checkpoint_manifest.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    assert recorded_cpu_threads(recorded_aux(tmp_path)) is None


def test_a_resume_refused_by_the_loader_restores_the_thread_count(resident, setup, tmp_path):
    ingestion, config = setup
    bogus = tmp_path / "bogus-checkpoint-step-00000002.kiln-checkpoint"
    bogus.mkdir()
    body = {"auxiliary_state": {"backend_runtime": {"cpu_threads": 3}}}
    (bogus / "checkpoint_manifest.json").write_text(json.dumps(body), encoding="utf-8")
    with intra_op_threads(1):
        result = train_on_resident(
            resident, config, ingestion, tmp_path / "out", adapter_name=NAME, resume_checkpoint=bogus
        )
        assert torch.get_num_threads() == 1
    assert result.status == "failed"
