"""Fixtures and checks shared by the refused-resume tests: one registry trained straight through,
one stopped at step 7 (checkpoints 3, 6 and 7), and the check that a refusal did no work."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln_train import model as model_pkg
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.resume.resume_support import NAME, ckpt_path, leg
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

MANIFEST = "checkpoint_manifest.json"
ADAPTER, OPTIMIZER, LOOP = "adapter.safetensors", "optimizer.safetensors", "sft_loop_state.json"
CONFIG = {"seed": 23, "epochs": 2, "checkpoint_interval": 3}  # 4 rows: 8 steps, checkpoints 3 and 6


@pytest.fixture(scope="module")
def ingestion(resident):
    return ingest(resident, conversations(4, offset=80))


@pytest.fixture(scope="module")
def straight(resident, ingestion, tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    result = train(resident, make_config(**CONFIG), ingestion, root, adapter_name=NAME)
    assert result.status == "success", result.failure_message
    return result, root


@pytest.fixture(scope="module")
def stopped(resident, ingestion, tmp_path_factory):
    """A registry holding the checkpoints of steps 3, 6 (interval) and 7 (a cooperative stop)."""
    root = tmp_path_factory.mktemp("stopped")
    result = leg(resident, make_config(**CONFIG), ingestion, root, resume=None, stop_at=7)
    assert result.failure_reason == "cancelled", result.failure_message
    assert [p.name for p in sorted(root.glob("*.kiln-checkpoint"))] == [
        ckpt_path(root, s).name for s in (3, 6, 7)
    ]
    return root


@pytest.fixture
def attach_calls(monkeypatch):
    calls = []
    real = model_pkg.attach_lora
    monkeypatch.setattr(model_pkg, "attach_lora", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def copy_registry(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".failed"))
    return dst


def assert_refused(result, root: Path, attach_calls, *fragments, reason="training_error", before=None):
    """Failed before any LoRA allocation, naming `fragments`; the registry gained only a receipt."""
    assert result.status == "failed"
    assert result.failure_reason == reason, result.failure_message
    for fragment in fragments:
        assert fragment in result.failure_message, result.failure_message
    assert attach_calls == []
    assert result.global_step == 0 and result.checkpoints == []
    after = sorted(p.name for p in Path(root).iterdir()) if Path(root).exists() else []
    assert after == sorted({*(before or []), ".failed"})
    assert result.receipt_path.parent == Path(root) / ".failed" / NAME


def resume_run(resident, ingestion, root, checkpoint, **kw):
    return train(
        resident,
        make_config(**CONFIG),
        ingestion,
        root,
        adapter_name=NAME,
        resume_checkpoint=checkpoint,
        **kw,
    )
