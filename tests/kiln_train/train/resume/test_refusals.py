"""Refused resumes: nothing is trained, no LoRA tensor is allocated and nothing but the failed
receipt is written, and the message names the checkpoint or field at fault
(docs/checkpoints.md#resume).

- A checkpoint name the run may publish is already taken (a later checkpoint of the adapter, or a
  stale one of an earlier run): refused at once instead of failing when the run reaches it.
- The newest of two checkpoints corrupt; a checkpoint of another model shape, or copied under
  another adapter's name.
- A kill at every stage of publication: the hidden staging directory is never loadable or
  listed, and a resume from the previous checkpoint publishes the same name beside it, bit-exact.
"""

from __future__ import annotations

import shutil

import pytest

from kiln_train.checkpoint import CheckpointError, discover_checkpoints, load_checkpoint
from kiln_train.checkpoint import publish as publish_module
from kiln_train.model.tiny import write_tiny_checkpoint
from kiln_train.train.resident import load_resident
from tests.kiln_train.checkpoint.checkpoint_support import PUBLICATION_STAGES
from tests.kiln_train.train.resume import refusal_fixtures as rf
from tests.kiln_train.train.resume.refusal_fixtures import (
    ADAPTER,
    CONFIG,
    MANIFEST,
    assert_refused,
    copy_registry,
    resume_run,
)
from tests.kiln_train.train.resume.resume_support import NAME, assert_same_run, ckpt_path
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, train

one_thread, resident, tiny_dir = rf.one_thread, rf.resident, rf.tiny_dir  # shared fixtures
ingestion, straight, stopped, attach_calls = rf.ingestion, rf.straight, rf.stopped, rf.attach_calls

pytestmark = pytest.mark.usefixtures("one_thread")

# ----- names the run would publish again --------------------------------------------------------


def test_a_later_checkpoint_refuses_the_resume_before_any_work(
    resident, ingestion, stopped, straight, tmp_path, attach_calls
):
    root = copy_registry(stopped, tmp_path / "reg")
    before = sorted(p.name for p in root.iterdir())
    result = resume_run(resident, ingestion, root, ckpt_path(root, 3))
    assert_refused(
        result, root, attach_calls, f"'{ckpt_path(root, 6).name}'", "adapter_already_exists", before=before
    )
    # The newest one resumes, and finishes the straight run.
    final = resume_run(resident, ingestion, root, ckpt_path(root, 7))
    assert final.loss_history == straight[0].loss_history
    assert (final.adapter_path / "adapter_model.safetensors").read_bytes() == (
        straight[0].adapter_path / "adapter_model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    ("stale_step", "with_stop", "refused"),
    [
        (3, False, True),  # an interval step: certainly published again
        (5, True, True),  # a step a cooperative stop may land on
        (5, False, False),  # no stop, not an interval step: never published
        (8, True, False),  # the last step: never checkpointed
        (99, True, False),  # beyond the run
    ],
)
def test_a_stale_checkpoint_of_an_earlier_run(
    resident, ingestion, tmp_path, attach_calls, stale_step, with_stop, refused
):
    root = tmp_path / "reg"
    ckpt_path(root, stale_step).mkdir(parents=True)
    kw = {"should_stop": lambda: False} if with_stop else {}
    result = train(resident, make_config(**CONFIG), ingestion, root, adapter_name=NAME, **kw)
    if refused:
        assert_refused(
            result,
            root,
            attach_calls,
            ckpt_path(root, stale_step).name,
            before=[ckpt_path(root, stale_step).name],
        )
    else:
        assert result.status == "success", result.failure_message


def test_the_newest_of_two_checkpoints_corrupt(
    resident, ingestion, stopped, straight, tmp_path, attach_calls
):
    """Status discovery validates manifests only, so the corrupt newest still lists; resuming it
    fails naming the file, and the older one resumes to the straight run."""
    root = copy_registry(stopped, tmp_path / "reg")
    shutil.rmtree(ckpt_path(root, 7))
    newest = ckpt_path(root, 6)
    data = bytearray((newest / ADAPTER).read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / ADAPTER).write_bytes(bytes(data))
    assert [c for c in discover_checkpoints(root, NAME) if c.valid][-1].path == newest
    before = sorted(p.name for p in root.iterdir())
    result = resume_run(resident, ingestion, root, newest)
    assert_refused(
        result, root, attach_calls, newest.name, "files['adapter.safetensors'].sha256", before=before
    )
    shutil.move(newest, tmp_path / newest.name)  # the later name must be free to resume the older one
    final = resume_run(resident, ingestion, root, ckpt_path(root, 3))
    assert final.status == "success", final.failure_message
    assert final.loss_history == straight[0].loss_history


def test_a_checkpoint_copied_under_another_adapter_name(resident, ingestion, stopped, tmp_path, attach_calls):
    src = ckpt_path(stopped, 6)
    renamed = tmp_path / "copies" / src.name.replace(f"{NAME}-", "other-", 1)
    shutil.copytree(src, renamed)
    root = tmp_path / "reg"
    result = train(
        resident, make_config(**CONFIG), ingestion, root, adapter_name="other", resume_checkpoint=renamed
    )
    assert result.status == "failed" and attach_calls == []
    assert f"the directory name is not '{src.name}'" in result.failure_message
    # The checkpoint under its published name, offered to a run of the other adapter: adapter_name drift.
    result = train(
        resident, make_config(**CONFIG), ingestion, root, adapter_name="other", resume_checkpoint=src
    )
    assert f'adapter_name: checkpoint "{NAME}", request "other"' in result.failure_message
    assert attach_calls == [] and not list(root.glob("*.kiln-checkpoint"))


def test_a_checkpoint_of_another_model_shape(qwen_tokenizer, stopped, tmp_path, attach_calls):
    model_dir = write_tiny_checkpoint(
        tmp_path / "wider", "tiny", seed=0, overrides={"intermediate_size": 96}, tokenizer=qwen_tokenizer
    )
    other = load_resident(model_dir)
    ingestion = ingest(other, conversations(4, offset=80))
    root = tmp_path / "reg"
    result = resume_run(other, ingestion, root, ckpt_path(stopped, 6))
    assert_refused(result, root, attach_calls, ckpt_path(stopped, 6).name, "auxiliary_state.")


# ----- a kill during publication --------------------------------------------------------------------


class Killed(BaseException):
    """Stands for the process dying: not an `Exception`, so no cleanup handler runs."""


# build_manifest writes nothing (a kill there leaves what one after hash_artifacts does), and after
# rename_into_place the checkpoint is complete: neither gives a state of its own to resume from.
STAGES = [s for s in PUBLICATION_STAGES if s not in ("build_manifest", "sync_parent")]


@pytest.mark.parametrize("stage", STAGES)
def test_a_kill_after_each_publication_stage(resident, ingestion, straight, tmp_path, monkeypatch, stage):
    root = tmp_path / "reg"
    real = getattr(publish_module, stage)
    calls = {"n": 0}

    def killing(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint (step 6); step 3 publishes normally
            raise Killed(stage)
        return out

    monkeypatch.setattr(publish_module, stage, killing)
    with pytest.raises(Killed):
        train(resident, make_config(**CONFIG), ingestion, root, adapter_name=NAME)
    monkeypatch.setattr(publish_module, stage, real)
    target = ckpt_path(root, 6)
    staging = [p for p in root.iterdir() if p.name.startswith(f".{target.name}.incomplete-")]
    if stage == "rename_into_place":
        assert staging == [] and load_checkpoint(target).manifest.progress.global_step == 6
        resume_from = 6
    else:
        assert len(staging) == 1 and not target.exists()
        (left,) = staging
        sentinel = (left / ".incomplete").exists()
        assert sentinel is (stage not in ("create_staging", "remove_sentinel"))
        assert (left / MANIFEST).exists() is (stage in ("write_manifest", "remove_sentinel"))
        with pytest.raises(CheckpointError, match="does not end with '.kiln-checkpoint'"):
            load_checkpoint(left)
        resume_from = 3
    assert [c.global_step for c in discover_checkpoints(root, NAME)] == sorted({3, resume_from})
    final = resume_run(resident, ingestion, root, ckpt_path(root, resume_from))
    assert_same_run(straight[0], final, straight[1], root, [])
    if stage != "rename_into_place":
        assert left.exists()  # never cleaned up behind the writer's back, never in the way
        # Renamed into place by hand, it is refused unless it had become complete.
        manual = tmp_path / "manual" / target.name
        shutil.copytree(left, manual)
        if sentinel:
            with pytest.raises(CheckpointError, match="'.incomplete' sentinel"):
                load_checkpoint(manual)
        elif stage == "create_staging":
            with pytest.raises(CheckpointError, match="checkpoint_manifest.json is missing"):
                load_checkpoint(manual)
        else:
            assert load_checkpoint(manual).manifest.progress.global_step == 6
