"""Refused resumes: nothing is trained, no LoRA tensor is allocated and nothing but the failed
receipt is written, and the message names the file or field at fault (kiln-contract §5.5, §5.7).

- A checkpoint name the run may publish is already taken (a later checkpoint of the adapter, or a
  stale one of an earlier run): refused at once instead of failing when the run reaches it.
- Files whose digests were recomputed to match (so only their content can tell): another rank, a
  missing or extra tensor, NaN, the wrong dtype, not safetensors at all; optimizer state with a
  missing key, NaN, F64, a step counter past the global step.
- A flipped byte anywhere in any file; the newest of two checkpoints corrupt.
- A checkpoint of another model shape, or copied under another adapter's name.
- A kill at every stage of publication: the hidden staging directory is never loadable or
  listed, and a resume from the previous checkpoint publishes the same name beside it, bit-exact.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from kiln_train import model as model_pkg
from kiln_train.checkpoint import (
    CheckpointError,
    discover_checkpoints,
    load_checkpoint,
)
from kiln_train.checkpoint import publish as publish_module
from kiln_train.model.resident import load_resident
from kiln_train.model.tiny import write_tiny_checkpoint
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.test_resume_probe_support import NAME, assert_same_run, ckpt_path, leg
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

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


def _copy_registry(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".failed"))
    return dst


def _refused(result, root: Path, attach_calls, *fragments, reason="training_error", before=None):
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


def _resume(resident, ingestion, root, checkpoint, **kw):
    return train(
        resident,
        make_config(**CONFIG),
        ingestion,
        root,
        adapter_name=NAME,
        resume_checkpoint=checkpoint,
        **kw,
    )


# ----- names the run would publish again --------------------------------------------------------


def test_a_later_checkpoint_refuses_the_resume_before_any_work(
    resident, ingestion, stopped, straight, tmp_path, attach_calls
):
    root = _copy_registry(stopped, tmp_path / "reg")
    before = sorted(p.name for p in root.iterdir())
    result = _resume(resident, ingestion, root, ckpt_path(root, 3))
    _refused(
        result, root, attach_calls, f"'{ckpt_path(root, 6).name}'", "adapter_already_exists", before=before
    )
    # The newest one resumes, and finishes the straight run.
    final = _resume(resident, ingestion, root, ckpt_path(root, 7))
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
        _refused(
            result,
            root,
            attach_calls,
            ckpt_path(root, stale_step).name,
            before=[ckpt_path(root, stale_step).name],
        )
    else:
        assert result.status == "success", result.failure_message


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
    result = _resume(resident, ingestion, root, forged)
    _refused(result, root, attach_calls, src.name, *fragments, reason=reason)


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
        result = _resume(resident, ingestion, root, copy)
        _refused(result, root, attach_calls, f"files[{rel!r}].sha256: manifest")


@pytest.fixture
def validate_resume(resident, ingestion, tmp_path):
    """The trainer's own resume validation (`SftRun._load_resume`) of a checkpoint directory."""
    from kiln_train.train.identity import auxiliary_state
    from kiln_train.train.run import SftRun
    from kiln_train.train.segment_plan import default_checkpoint_plan, per_row_plan

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
    _, entries = per_row_plan(resident, config, ingestion, run.plan, run.route)
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


def test_the_newest_of_two_checkpoints_corrupt(
    resident, ingestion, stopped, straight, tmp_path, attach_calls
):
    """Status discovery validates manifests only, so the corrupt newest still lists; resuming it
    fails naming the file, and the older one resumes to the straight run."""
    root = _copy_registry(stopped, tmp_path / "reg")
    shutil.rmtree(ckpt_path(root, 7))
    newest = ckpt_path(root, 6)
    data = bytearray((newest / ADAPTER).read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / ADAPTER).write_bytes(bytes(data))
    assert [c for c in discover_checkpoints(root, NAME) if c.valid][-1].path == newest
    before = sorted(p.name for p in root.iterdir())
    result = _resume(resident, ingestion, root, newest)
    _refused(result, root, attach_calls, newest.name, "files['adapter.safetensors'].sha256", before=before)
    shutil.move(newest, tmp_path / newest.name)  # the later name must be free to resume the older one
    final = _resume(resident, ingestion, root, ckpt_path(root, 3))
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
    # The original directory offered to a run of the other adapter: adapter_name drift.
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
    result = _resume(other, ingestion, root, ckpt_path(stopped, 6))
    _refused(result, root, attach_calls, ckpt_path(stopped, 6).name, "auxiliary_state.")


# ----- a kill during publication --------------------------------------------------------------------


class Killed(BaseException):
    """Stands for the process dying: not an `Exception`, so no cleanup handler runs."""


STAGES = [
    "create_staging",
    "write_sentinel",
    "write_artifacts",
    "check_staging_files",
    "check_loop_state",
    "hash_artifacts",
    "write_manifest",
    "remove_sentinel",
    "rename_into_place",
]


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
    final = _resume(resident, ingestion, root, ckpt_path(root, resume_from))
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
