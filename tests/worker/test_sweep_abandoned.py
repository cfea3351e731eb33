"""Hidden work directories that outlive their process are swept from the adapter registry.

A publication stages in `.<name>.incomplete-<id>`, a withdrawal renames to `.withdrawn-...`, an
adapter deletion moves into `.trash-<hex>`; each process removes its own. A SIGKILL, an OOM kill
or power loss in the middle left them on disk for ever (a 4B checkpoint is hundreds of MiB).
The reconciler deletes the ones nothing has touched for `ABANDONED_AFTER_SECONDS`, and nothing
else: published adapters and checkpoints, live staging, other hidden entries, symlinks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kiln_train.checkpoint import discover_checkpoints, load_checkpoint
from tests.api.conftest import sft_body, unique_name
from tests.kiln_train.checkpoint.checkpoint_support import publish
from tests.worker.test_runtime import submit
from worker import reconciler as reconciler_mod
from worker.reconciler import ABANDONED_AFTER_SECONDS, sweep_abandoned, withdraw

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT = "support-bot-checkpoint-step-00000007.kiln-checkpoint"


def _killed_mid_publication(registry: Path, what: str) -> None:
    """A real process SIGKILLed in the middle of publishing (after its first file is written)."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        registry = Path({str(registry)!r})
        if {what!r} == "checkpoint":
            from kiln_train.checkpoint import publish as publish_module
            from tests.kiln_train.checkpoint.checkpoint_support import publish
            original = publish_module.write_artifacts
            def dying(*args, **kwargs):
                original(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
            publish_module.write_artifacts = dying
            publish(registry, 9)
        else:
            import torch
            from kiln_train.artifacts import adapter
            def dying(output):
                os.kill(os.getpid(), signal.SIGKILL)
            adapter.publish_adapter(
                registry, "half-written", {{"w": torch.zeros(2, 2)}}, rank=2, alpha=4.0,
                build_receipt=dying, build_manifest=lambda receipt, hashes: {{}},
            )
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr


def _crash_residue(registry: Path) -> list[str]:
    """The four kinds of residue, made by the code that makes them."""
    registry.mkdir(parents=True, exist_ok=True)
    _killed_mid_publication(registry, "checkpoint")
    _killed_mid_publication(registry, "adapter")
    # A withdrawal and a deletion whose rmtree did not get to finish.
    victim = registry / "withdrawn-one"
    (victim / "deep").mkdir(parents=True)
    (victim / "deep" / "weights.bin").write_bytes(b"x" * 4096)
    original_rmtree = reconciler_mod.shutil.rmtree
    reconciler_mod.shutil.rmtree = lambda *a, **k: None
    try:
        withdraw(victim)
    finally:
        reconciler_mod.shutil.rmtree = original_rmtree
    trash = registry / f".trash-{'ab' * 16}"
    (trash / "deleted-adapter").mkdir(parents=True)
    (trash / "deleted-adapter" / "adapter_model.safetensors").write_bytes(b"y" * 100)
    residue = sorted(e.name for e in registry.iterdir() if e.name.startswith("."))
    assert len(residue) == 4, residue
    assert any(n.startswith(f".{CHECKPOINT.replace('00000007', '00000009')}.incomplete-") for n in residue)
    assert any(n.startswith(".half-written.incomplete-") for n in residue)
    assert any(n.startswith(".withdrawn-") and n.endswith("-withdrawn-one") for n in residue)
    assert trash.name in residue
    return residue


def test_crash_residue_is_swept_once_abandoned_and_nothing_else(tmp_path):
    registry = tmp_path / "adapters"
    residue = _crash_residue(registry)
    published = publish(registry, 7)
    # What must survive: a published checkpoint, an adapter, another hidden file, a symlink
    # whose name looks like staging and whose target is outside the registry.
    (registry / "my-adapter").mkdir()
    (registry / "my-adapter" / "adapter_model.safetensors").write_bytes(b"z")
    (registry / ".registry.lock").write_text("")
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (registry / f".linked.incomplete-{'cd' * 16}").symlink_to(outside, target_is_directory=True)

    fresh = time.time()
    assert sweep_abandoned(registry) == []  # just written: a live process could still own them
    assert sweep_abandoned(registry, now=fresh + ABANDONED_AFTER_SECONDS - 60) == []
    swept = sweep_abandoned(registry, now=fresh + ABANDONED_AFTER_SECONDS + 60)
    assert sorted(swept) == residue
    assert sorted(os.listdir(registry)) == sorted(
        [".registry.lock", f".linked.incomplete-{'cd' * 16}", CHECKPOINT, "my-adapter"]
    )
    assert (outside / "keep.txt").read_text() == "keep"
    assert load_checkpoint(published.path, verify_hashes=True).manifest.checkpoint_id == "sft-step-00000007"
    assert [(c.path.name, c.error) for c in discover_checkpoints(registry, "support-bot")] == [
        (CHECKPOINT, None)
    ]
    assert sweep_abandoned(registry, now=fresh + 10 * ABANDONED_AFTER_SECONDS) == []


def test_recent_activity_deep_inside_keeps_a_staging_directory(tmp_path):
    staging = tmp_path / f".big.incomplete-{'ef' * 16}"
    (staging / "a" / "b").mkdir(parents=True)
    born = staging.lstat().st_ctime
    time.sleep(0.05)
    (staging / "a" / "b" / "shard.bin").write_bytes(b"still writing")
    written = (staging / "a" / "b" / "shard.bin").lstat().st_mtime
    assert written > born
    # Old by the directory's own stamps, young by the file being written deep inside.
    now = born + ABANDONED_AFTER_SECONDS + (written - born) / 2
    assert sweep_abandoned(tmp_path, now=now) == []
    assert staging.is_dir()
    assert sweep_abandoned(tmp_path, now=written + ABANDONED_AFTER_SECONDS + 1) == [staging.name]
    assert not staging.exists()


def test_a_missing_registry_sweeps_nothing(tmp_path):
    assert sweep_abandoned(tmp_path / "absent") == []


def test_the_worker_s_reconciler_sweeps_and_its_jobs_still_train(client, runtime, settings, monkeypatch):
    """Through the running worker: residue next to a live registry goes, a job still trains and
    publishes after the pass, and the pass reports how much it swept."""
    residue = _crash_residue(settings.adapters_dir)
    assert runtime.reconciler.run_once()["swept"] == 0  # fresh: left alone
    monkeypatch.setattr(reconciler_mod, "ABANDONED_AFTER_SECONDS", 0.0)
    assert runtime.reconciler.run_once()["swept"] == len(residue)
    assert not any(e.name.startswith(".") for e in settings.adapters_dir.iterdir())
    name = unique_name("after-sweep")
    job_id = submit(client, sft_body(2, output_name=name))
    assert runtime.run_job(job_id) == "completed"
    assert (settings.adapters_dir / name / "adapter_model.safetensors").is_file()
    assert runtime.reconciler.run_once()["swept"] == 0


@pytest.mark.parametrize(
    "name",
    [
        ".incomplete-" + "a" * 32,  # no name before the marker
        "visible.incomplete-" + "a" * 32,  # not hidden
        ".withdrawn-short-x",
        ".trash-" + "g" * 32,
        ".trash-" + "a" * 31,
    ],
)
def test_only_the_hidden_work_names_are_swept(tmp_path, name):
    (tmp_path / name).mkdir()
    assert sweep_abandoned(tmp_path, older_than=0.0, now=time.time() + 60) == []
    assert (tmp_path / name).is_dir()


def test_an_undeletable_directory_is_reported_once_and_left(tmp_path, monkeypatch, caplog):
    stuck = tmp_path / f".stuck.incomplete-{'12' * 16}"
    stuck.mkdir()
    (stuck / "part").write_bytes(b"p")
    monkeypatch.setattr(reconciler_mod.shutil, "rmtree", lambda *a, **k: None)  # EPERM, EBUSY ...
    later = time.time() + ABANDONED_AFTER_SECONDS + 60
    with caplog.at_level("WARNING", logger="worker.reconciler"):
        assert sweep_abandoned(tmp_path, now=later) == []
        assert sweep_abandoned(tmp_path, now=later) == []
    reports = [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]
    assert reports == [f"could not delete the abandoned work directory {stuck}; delete it by hand"]
    assert (stuck / "part").read_bytes() == b"p"
    monkeypatch.undo()
    assert sweep_abandoned(tmp_path, now=later) == [stuck.name]
