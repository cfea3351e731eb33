"""Resume drift: every bound field that differs fails, naming the field, before any model work.

docs/checkpoints.md#resume: the checkpoint binds the effective config (learning rate, rank, seed,
optimizer, segments, anomaly flag, ...), the data identity, the loss route (planning identity
v4, with the kernel paths), the base-weight content, the execution provenance and the adapter
name. A resume that
drifts in any of them fails before LoRA tensors are attached, and a PEFT adapter directory
offered as a checkpoint is refused with a clear message.
"""

from __future__ import annotations

import dataclasses

import pytest

from kiln_train.checkpoint import PEFT_MESSAGE
from kiln_train.kernels.paths import FLA, GATED_DELTA_RULE, SWIGLU, TRITON, KernelPaths
from kiln_train.train.resident import load_resident
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.resume import refusal_fixtures as rf
from tests.kiln_train.train.trainer_fixtures import conversations, failed_receipt, ingest, make_config, train

one_thread, resident, tiny_dir, other_tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir, fx.other_tiny_dir
attach_calls = rf.attach_calls

pytestmark = pytest.mark.usefixtures("one_thread")

SEED, NAME = 41, "drift"
BASE = {"seed": SEED, "epochs": 2, "learning_rate": 1e-3, "checkpoint_interval": 2}


@pytest.fixture(scope="module")
def ingestion(resident):
    return ingest(resident, conversations(3))


@pytest.fixture(scope="module")
def checkpoint(resident, ingestion, tmp_path_factory):
    """A run that publishes step 2 and is then cancelled (the checkpoint every test resumes)."""
    root = tmp_path_factory.mktemp("drift")
    done = {"n": 0}
    result = train(
        resident,
        make_config(**BASE),
        ingestion,
        root,
        adapter_name=NAME,
        progress=lambda r: done.__setitem__("n", r.global_step),
        should_stop=lambda: done["n"] >= 2,
    )
    assert result.failure_reason == "cancelled"
    path = root / f"{NAME}-checkpoint-step-00000002.kiln-checkpoint"
    assert path.is_dir()
    return path


def _resume(res, ingestion, checkpoint, tmp_path, *, name=NAME, route=None, **changes):
    config = make_config(**{**BASE, **changes})
    kw = {"loss_route": route} if route else {}
    return train(res, config, ingestion, tmp_path, adapter_name=name, resume_checkpoint=checkpoint, **kw)


def _check_drift(result, tmp_path, attach_calls, *fragments):
    assert result.status == "failed"
    assert result.failure_reason == "training_error", result.failure_message
    for fragment in fragments:
        assert fragment in result.failure_message, result.failure_message
    assert attach_calls == []  # refused before any LoRA allocation or training
    assert result.global_step == 0 and result.checkpoints == []
    assert not list(tmp_path.glob("*.kiln-checkpoint"))
    failed_receipt(result, tmp_path)


def test_the_unchanged_request_resumes(resident, ingestion, checkpoint, tmp_path, attach_calls):
    result = _resume(resident, ingestion, checkpoint, tmp_path)
    assert result.status == "success", result.failure_message
    assert result.global_step == 6 and len(result.loss_history) == 6
    assert len(attach_calls) == 1


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"learning_rate": 2e-3}, ["effective_config.learning_rate: checkpoint 0.001, request 0.002"]),
        ({"lora_rank": 2, "lora_alpha": 4.0}, ["effective_config.lora_rank: checkpoint 4, request 2"]),
        ({"seed": SEED + 1}, [f"seed: checkpoint {SEED}, request {SEED + 1}"]),
        (
            {"optimizer": {"kind": "muon"}},
            ['effective_config.optimizer.kind: checkpoint "adam_w", request "muon"'],
        ),
        ({"epochs": 3}, ["effective_config.epochs: checkpoint 2, request 3"]),
        (
            {"grad_checkpoint_segments": 2},
            ["effective_config.grad_checkpoint_segments: checkpoint null, request 2"],
        ),
        ({"detect_anomaly": True}, ["effective_config.detect_anomaly: checkpoint false, request true"]),
        ({"checkpoint_interval": 3}, ["effective_config.checkpoint_interval: checkpoint 2, request 3"]),
    ],
)
def test_config_drift_names_the_field(
    resident, ingestion, checkpoint, tmp_path, attach_calls, changes, fragments
):
    result = _resume(resident, ingestion, checkpoint, tmp_path, **changes)
    _check_drift(result, tmp_path, attach_calls, *fragments)


def test_other_data_is_drift(resident, checkpoint, tmp_path, attach_calls):
    other = ingest(resident, conversations(3, offset=50))
    result = _resume(resident, other, checkpoint, tmp_path)
    _check_drift(result, tmp_path, attach_calls, "data.content_sha256: checkpoint")


def test_another_adapter_name_is_drift(resident, ingestion, checkpoint, tmp_path, attach_calls):
    result = _resume(resident, ingestion, checkpoint, tmp_path, name="renamed")
    _check_drift(result, tmp_path, attach_calls, 'adapter_name: checkpoint "drift", request "renamed"')


def test_another_loss_route_is_planning_drift(resident, ingestion, checkpoint, tmp_path, attach_calls):
    full = dataclasses.replace(
        resident, backend=dataclasses.replace(resident.backend, sft_loss_route="full_logits")
    )
    result = _resume(full, ingestion, checkpoint, tmp_path, route="full_logits")
    _check_drift(
        result,
        tmp_path,
        attach_calls,
        'auxiliary_state.training_runtime_planning_identity.sft_loss_route: checkpoint "kt_tape_flce", '
        'request "full_logits"',
    )


@pytest.mark.parametrize(
    ("op", "path", "recorded"), [(GATED_DELTA_RULE, FLA, "torch-chunked"), (SWIGLU, TRITON, "torch")]
)
def test_another_kernel_path_is_planning_drift(
    resident, ingestion, checkpoint, tmp_path, attach_calls, op, path, recorded
):
    """A resume on another GDN path or kernel set names the operation (docs/kernels.md#checkpoints)."""
    paths = KernelPaths({**resident.kernel_paths.paths, op: path})
    other = dataclasses.replace(resident, kernel_paths=paths)
    result = _resume(other, ingestion, checkpoint, tmp_path)
    _check_drift(
        result,
        tmp_path,
        attach_calls,
        f"auxiliary_state.training_runtime_planning_identity.kernel_paths.{op}: "
        f'checkpoint "{recorded}", request "{path}"',
    )


def test_other_base_weights_are_drift(other_tiny_dir, ingestion, checkpoint, tmp_path, attach_calls):
    other = load_resident(other_tiny_dir)
    result = _resume(other, ingest(other, conversations(3)), checkpoint, tmp_path)
    _check_drift(result, tmp_path, attach_calls, "auxiliary_state.base_model_weights_sha256: checkpoint")


def test_another_execution_identity_is_drift(tiny_dir, ingestion, checkpoint, tmp_path, attach_calls):
    other = load_resident(tiny_dir, environ={"KILN_EXTRA_FLAG": "1"})  # another effective environment
    result = _resume(other, ingestion, checkpoint, tmp_path)
    _check_drift(result, tmp_path, attach_calls, "auxiliary_state.execution_provenance.provenance_sha256")


def test_a_peft_adapter_is_not_a_resumable_checkpoint(resident, ingestion, tmp_path, attach_calls):
    done = train(
        resident, make_config(**{**BASE, "epochs": 1}), ingestion, tmp_path / "reg", adapter_name="peft"
    )
    assert done.status == "success"
    attach_calls.clear()
    result = _resume(resident, ingestion, done.adapter_path, tmp_path)
    _check_drift(result, tmp_path, attach_calls, PEFT_MESSAGE)


def test_a_tampered_checkpoint_is_refused(resident, ingestion, checkpoint, tmp_path, attach_calls):
    import shutil

    copy = tmp_path / "copies" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    data = bytearray((copy / "adapter.safetensors").read_bytes())
    data[-1] ^= 0x01
    (copy / "adapter.safetensors").write_bytes(bytes(data))
    result = _resume(resident, ingestion, copy, tmp_path)
    _check_drift(result, tmp_path, attach_calls, "adapter.safetensors")


def test_resume_ignores_base_adapter(resident, ingestion, checkpoint, tmp_path, attach_calls):
    """A resume continues the checkpoint's own tensors; a base_adapter in the request is not loaded."""
    result = _resume(resident, ingestion, checkpoint, tmp_path, base_adapter="does-not-exist")
    assert result.status == "success", result.failure_message
    assert result.receipt["adapters"]["base"]["path"] is None
