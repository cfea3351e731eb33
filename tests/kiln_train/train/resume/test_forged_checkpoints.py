"""Resumes from checkpoints whose files were altered are refused before any work, naming the file
or manifest field (docs/checkpoints.md#loading).

- Files whose digests were recomputed to match (so only their content can tell): another rank, a
  missing or extra tensor, NaN, the wrong dtype, not safetensors at all; optimizer state with a
  missing key, NaN, F64, a step counter past the global step; loop-state statistics that do not
  follow from the loss history.
- A flipped byte anywhere in any file, the manifest included; every manifest field edited.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from kiln_train.checkpoint import CheckpointError
from tests.kiln_train.train.resume import refusal_fixtures as rf
from tests.kiln_train.train.resume.refusal_fixtures import (
    ADAPTER,
    CONFIG,
    LOOP,
    MANIFEST,
    OPTIMIZER,
    assert_refused,
    resume_run,
)
from tests.kiln_train.train.resume.resume_support import NAME, ckpt_path
from tests.kiln_train.train.trainer_fixtures import make_config

one_thread, resident, tiny_dir = rf.one_thread, rf.resident, rf.tiny_dir  # shared fixtures
ingestion, straight, stopped, attach_calls = rf.ingestion, rf.straight, rf.stopped, rf.attach_calls

pytestmark = pytest.mark.usefixtures("one_thread")

# ----- content the digests cannot vouch for -------------------------------------------------------


def _forge(src: Path, dst: Path, rel: str, mutate) -> Path:
    """Copy the checkpoint, rewrite `rel` and record its new size and digest in the manifest."""
    shutil.copytree(src, dst)
    data = mutate((dst / rel).read_bytes())
    (dst / rel).write_bytes(data)
    manifest = json.loads((dst / MANIFEST).read_text())
    manifest["files"][rel].update(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (dst / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return dst


def _tensors(edit):
    def mutate(data: bytes) -> bytes:
        tensors = dict(load(data))
        edit(tensors)
        return save(tensors)

    return mutate


FIRST_A = "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"


def _nan(tensors, key):
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = float("nan")


def _loop(edit):
    def mutate(data: bytes) -> bytes:
        state = json.loads(data)
        edit(state)
        return json.dumps(state, indent=2).encode()

    return mutate


def _bump_last(state):
    state["loss_history"][-1] += 1e-6
    state["last_loss"] = state["loss_history"][-1]


FORGED = {
    "adapter-rank-2": (
        ADAPTER,
        _tensors(
            lambda t: t.update({k: (v[:2] if "lora_A" in k else v[:, :2]).contiguous() for k, v in t.items()})
        ),
        "shape_mismatch",
        ["adapter.safetensors", FIRST_A, "(2, 64)"],
    ),
    "adapter-missing-tensor": (
        ADAPTER,
        _tensors(lambda t: t.pop(FIRST_A)),
        "shape_mismatch",
        ["adapter.safetensors", "1 missing", FIRST_A],
    ),
    "adapter-extra-tensor": (
        ADAPTER,
        _tensors(lambda t: t.update(extra=torch.zeros(2))),
        "shape_mismatch",
        ["adapter.safetensors", "1 unknown", "extra"],
    ),
    "adapter-nan": (
        ADAPTER,
        _tensors(lambda t: _nan(t, FIRST_A)),
        "training_error",
        ["adapter.safetensors", "non-finite"],
    ),
    "adapter-f64": (
        ADAPTER,
        _tensors(lambda t: t.update({k: v.double() for k, v in t.items()})),
        "shape_mismatch",
        ["adapter.safetensors", "torch.float64"],
    ),
    "adapter-not-safetensors": (
        ADAPTER,
        lambda data: b"not a safetensors file",
        "training_error",
        ["adapter.safetensors is not a readable safetensors file"],
    ),
    "optimizer-missing-key": (
        OPTIMIZER,
        _tensors(lambda t: t.pop(FIRST_A + ".adamw.v")),
        "training_error",
        ["optimizer.safetensors", "missing 1 key", FIRST_A + ".adamw.v"],
    ),
    "optimizer-nan": (
        OPTIMIZER,
        _tensors(lambda t: _nan(t, FIRST_A + ".adamw.m")),
        "training_error",
        ["optimizer.safetensors", FIRST_A + ".adamw.m", "non-finite"],
    ),
    "optimizer-f64": (
        OPTIMIZER,
        _tensors(lambda t: t.update({FIRST_A + ".adamw.m": t[FIRST_A + ".adamw.m"].double()})),
        "training_error",
        ["optimizer.safetensors", "must be f32"],
    ),
    "optimizer-step-beyond": (
        OPTIMIZER,
        _tensors(lambda t: t.update({FIRST_A + ".adamw.step": torch.tensor([9], dtype=torch.uint32)})),
        "training_error",
        ["optimizer.safetensors", "is 9, beyond the checkpoint's global step 6"],
    ),
    "optimizer-truncated": (
        OPTIMIZER,
        lambda data: data[:100],
        "training_error",
        ["optimizer.safetensors is not a readable safetensors file"],
    ),
    "optimizer-step-behind": (
        OPTIMIZER,
        _tensors(lambda t: t.update({FIRST_A + ".adamw.step": torch.tensor([5], dtype=torch.uint32)})),
        "training_error",
        ["optimizer.safetensors", "the step counter of", "is 5; every LoRA leaf is updated at each of the 6"],
    ),
    "loop-grad-norm-samples": (
        LOOP,
        _loop(lambda st: st["lora_grad_norms"]["q_proj"].update(sample_count=1)),
        "training_error",
        ["sft_loop_state.json", "lora_grad_norms sample counts", "'q_proj': 1"],
    ),
    "loop-grad-norm-module": (
        LOOP,
        _loop(lambda st: st["lora_grad_norms"].update(lm_head=st["lora_grad_norms"]["q_proj"])),
        "training_error",
        ["sft_loop_state.json", "lora_grad_norms sample counts", "'lm_head'"],
    ),
    # The step-6 loop state: epoch 1, cursor 2; its epoch statistics follow from loss_history.
    "loop-epoch-sum": (
        LOOP,
        _loop(lambda st: st.update(current_epoch_loss_sum=st["current_epoch_loss_sum"] + 1e-9)),
        "training_error",
        ["sft_loop_state.json", "current_epoch_loss_sum", "is not the sum of this epoch's 2 loss_history"],
    ),
    "loop-last-loss-changed": (
        LOOP,
        _loop(_bump_last),
        "training_error",
        ["sft_loop_state.json", "current_epoch_loss_sum"],
    ),
    "loop-first-epoch-mean": (
        LOOP,
        _loop(lambda st: st.update(first_epoch_loss=st["first_epoch_loss"] * 1.5)),
        "training_error",
        ["sft_loop_state.json", "first_epoch_loss", "is not the epoch mean"],
    ),
    "loop-first-epoch-history": (
        LOOP,
        _loop(lambda st: st["loss_history"].__setitem__(0, st["loss_history"][0] - 1e-3)),
        "training_error",
        ["sft_loop_state.json", "first_epoch_loss", "is not the epoch mean"],
    ),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_forged_tensor_files_are_refused_before_any_work(
    resident, ingestion, stopped, tmp_path, attach_calls, case
):
    rel, mutate, reason, fragments = FORGED[case]
    src = ckpt_path(stopped, 6)
    forged = _forge(src, tmp_path / "forged" / src.name, rel, mutate)
    root = tmp_path / "reg"
    result = resume_run(resident, ingestion, root, forged)
    assert_refused(result, root, attach_calls, src.name, *fragments, reason=reason)


# ----- corruption -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rel", [ADAPTER, OPTIMIZER, LOOP])
def test_a_flipped_byte_anywhere_in_a_state_file_names_it(
    resident, ingestion, stopped, tmp_path, attach_calls, rel
):
    src = ckpt_path(stopped, 6)
    size = (src / rel).stat().st_size
    for i, pos in enumerate(sorted({0, 1, 9, size // 3, size // 2, size - 2, size - 1})):
        copy = tmp_path / f"flip-{i}" / src.name
        shutil.copytree(src, copy)
        data = bytearray((copy / rel).read_bytes())
        data[pos] ^= 0x10
        (copy / rel).write_bytes(bytes(data))
        root = tmp_path / f"reg-{i}"
        result = resume_run(resident, ingestion, root, copy)
        assert_refused(result, root, attach_calls, f"files[{rel!r}].sha256: manifest")


@pytest.fixture
def validate_resume(resident, ingestion, tmp_path):
    """The trainer's own resume validation (`SftRun._load_resume`) of a checkpoint directory."""
    from kiln_train.plan.row_plan import default_checkpoint_plan, per_row_plan
    from kiln_train.train.identity import auxiliary_state
    from kiln_train.train.run import SftRun

    config = make_config(**CONFIG)
    run = SftRun(
        resident,
        config,
        ingestion,
        loss_route=resident.backend.sft_loss_route,
        registry=tmp_path / "reg",
        adapter_name=NAME,
        plan=default_checkpoint_plan(config),
        run_id="probe",
    )
    _, entries = per_row_plan(resident.config, resident.backend, config, ingestion, run.plan, run.route)
    aux = auxiliary_state(resident, config, ingestion, run.route, entries)

    def validate(path: Path) -> None:
        run.config, run.aux = config, dict(aux)
        run._load_resume(path)

    return validate


def test_a_flipped_byte_in_the_manifest_names_it(stopped, tmp_path, validate_resume):
    """Every 7th byte, two bits each: the loader or the resume comparison names the manifest and
    the checkpoint, unless the edit kept the same JSON value (`1e-08` -> `1E-08`) or touched only
    `created_at` (a record nothing binds)."""
    src = ckpt_path(stopped, 6)
    copy = tmp_path / "flip" / src.name
    shutil.copytree(src, copy)
    validate_resume(copy)  # the unedited copy resumes
    original = (src / MANIFEST).read_bytes()
    value = json.loads(original)
    unchanged = 0
    for pos in range(0, len(original), 7):
        for bit in (0x01, 0x20):
            data = bytearray(original)
            data[pos] ^= bit
            (copy / MANIFEST).write_bytes(bytes(data))
            try:
                edited = json.loads(bytes(data))
            except ValueError:
                edited = None
            if isinstance(edited, dict) and {**edited, "created_at": 0} == {**value, "created_at": 0}:
                unchanged += 1
                continue
            with pytest.raises(CheckpointError) as info:
                validate_resume(copy)
            message = info.value.message
            assert MANIFEST in message and src.name in message, (pos, bit, message)
    assert unchanged < 40  # created_at digits and exponent letters only


def _leaves(value, path=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i))
    else:
        yield path, value


def _other_values(value) -> list:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1 if value > 0 else 2]
    if isinstance(value, float):
        return [value * 2 + 1, value + 1e-12]
    if isinstance(value, str):
        return [value + "x", value[:-1] + ("A" if value[-1:] != "A" else "B"), ""]
    if value is None:
        return [1, "x"]
    return [[0], {}]


def test_every_manifest_field_edited_is_refused_naming_it(stopped, tmp_path, validate_resume):
    """Each leaf of the manifest set to other values (one edit at a time): refused, and the
    message names that field (its key or an enclosing one). `created_at` is a record only."""
    src = ckpt_path(stopped, 6)
    copy = tmp_path / "edit" / src.name
    shutil.copytree(src, copy)
    original = json.loads((src / MANIFEST).read_text())
    edits = 0
    for path, value in _leaves(original):
        if path == ("created_at",):
            continue
        for other in _other_values(value):
            edited = json.loads(json.dumps(original))
            holder = edited
            for key in path[:-1]:
                holder = holder[key]
            holder[path[-1]] = other
            (copy / MANIFEST).write_text(json.dumps(edited, indent=2))
            with pytest.raises(CheckpointError) as info:
                validate_resume(copy)
            message = info.value.message
            named = [str(k) for k in path if isinstance(k, str) and str(k) in message]
            assert MANIFEST in message and named, (path, other, message)
            edits += 1
    assert edits > 300
