"""PEFT adapters: interop with transformers + PEFT both ways, base-adapter warm starts, and a
publication that never replaces a name taken at the last moment.

docs/artifacts.md#peft-adapter (adapter directory, config, tensor names); docs/checkpoints.md#resume
(a PEFT adapter may be a new run's `base_adapter`, subject to shape and provenance checks; that
is never a resume).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kiln_train.artifacts import adapter as adapter_module
from kiln_train.artifacts.adapter import publish_adapter
from kiln_train.errors import KilnError
from kiln_train.ground.digest import file_digest
from kiln_train.model import attach_lora, load_model
from kiln_train.model.config import LORA_TARGET_MODULES
from kiln_train.optim import request_optimizer as optimizer_mod
from tests.kiln_train.artifacts.receipt_checks import validate_receipt
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import (
    conversations,
    failed_receipt,
    ingest,
    make_config,
    read_json,
    train,
)

one_thread, resident, tiny_dir, other_tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir, fx.other_tiny_dir

pytestmark = pytest.mark.usefixtures("one_thread")

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def ingestion(resident):
    return ingest(resident, conversations(3))


@pytest.fixture(scope="module")
def registry(resident, ingestion, tmp_path_factory):
    """A registry holding one trained adapter, `base-r4`."""
    root = tmp_path_factory.mktemp("registry")
    config = make_config(seed=9, epochs=2, lora_rank=RANK, lora_alpha=ALPHA, learning_rate=5e-3)
    result = train(resident, config, ingestion, root, adapter_name="base-r4")
    assert result.status == "success", result.failure_message
    return root


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_our_adapter_loads_in_peft_with_the_same_logits(tiny_dir, registry):
    import peft

    adapter_dir = registry / "base-r4"
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    ours = load_model(tiny_dir)
    lora = attach_lora(ours, RANK, ALPHA, seed=0)
    lora.load_state_dict(tensors)
    theirs = peft.PeftModel.from_pretrained(_hf_model(tiny_dir), adapter_dir).eval()
    ids = torch.randint(0, 248_000, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours.logits(ids)
        b = theirs(ids).logits
        plain = load_model(tiny_dir).logits(ids)
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= 1e-4 * scale
    assert (a - plain).abs().max().item() > 1e-3 * scale  # the trained adapter moves the logits
    # Every tensor of our file was consumed by PEFT under its own key (no remap).
    peft_state = peft.get_peft_model_state_dict(theirs)
    assert set(peft_state) == set(tensors)
    assert all(torch.equal(peft_state[k], tensors[k]) for k in tensors)


def _first_step_params(monkeypatch) -> dict:
    """Records the leaves, optimizer counters and state as the first optimizer step starts."""
    seen: dict = {}
    real_build = optimizer_mod.build_optimizer

    def build(*args, **settings):
        opt = real_build(*args, **settings)
        real_step = opt.step

        def step(grads):
            if not seen:
                seen["params"] = {n: p.detach().clone() for n, p in opt.params.items()}
                seen["step_count"] = opt.step_count
                seen["param_steps"] = dict(opt.param_steps)
                seen["state_zero"] = all(
                    int(torch.count_nonzero(t)) == 0 for s in opt.state.values() for t in s.values()
                )
            real_step(grads)

        opt.step = step
        return opt

    monkeypatch.setattr(optimizer_mod, "build_optimizer", build)
    return seen


def test_a_base_adapter_warm_starts_a_new_run(resident, ingestion, registry, tmp_path, monkeypatch):
    root = tmp_path / "reg"
    shutil.copytree(registry / "base-r4", root / "base-r4")
    seen = _first_step_params(monkeypatch)
    reports = []
    config = make_config(seed=10, epochs=1, lora_rank=RANK, lora_alpha=ALPHA, base_adapter="base-r4")
    result = train(resident, config, ingestion, root, adapter_name="child", progress=reports.append)
    assert result.status == "success", result.failure_message
    base = load_file(str(root / "base-r4" / "adapter_model.safetensors"))
    assert set(seen["params"]) == set(base)
    assert all(torch.equal(seen["params"][k], base[k]) for k in base)  # started from the adapter
    assert seen["step_count"] == 0 and set(seen["param_steps"].values()) == {0} and seen["state_zero"]
    assert [r.global_step for r in reports] == [1, 2, 3]  # a new run: step 1 of epochs x rows
    receipt = read_json(result.adapter_path / "train_receipt.json")
    validate_receipt(receipt)
    model_file = root / "base-r4" / "adapter_model.safetensors"
    assert receipt["adapters"]["base"] == {
        "path": str(root / "base-r4"),
        "adapter_model_sha256": file_digest(model_file),
        "adapter_model_bytes": model_file.stat().st_size,
    }
    assert receipt["config"]["base_adapter"] == "base-r4"
    assert read_json(result.adapter_path / "adapter_manifest.json")["parent_adapter"] == "base-r4"


def test_an_adapter_saved_by_peft_warm_starts_with_peft_s_loss(
    tiny_dir, resident, ingestion, tmp_path, monkeypatch
):
    """PEFT -> Kiln: `save_pretrained` output is a valid base adapter and means the same function."""
    import peft

    hf = _hf_model(tiny_dir)
    config = peft.LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=list(LORA_TARGET_MODULES),
        lora_dropout=0.0,
        init_lora_weights=False,  # random A and B: a non-trivial adapter
    )
    torch.manual_seed(0)
    model = peft.get_peft_model(hf, config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    model.save_pretrained(tmp_path / "from-peft")
    reports = []
    run_config = make_config(seed=12, epochs=1, lora_rank=RANK, lora_alpha=ALPHA, base_adapter="from-peft")
    result = train(
        resident, run_config, ingestion, tmp_path, adapter_name="kiln-child", progress=reports.append
    )
    assert result.status == "success", result.failure_message
    row = ingestion.rows[reports[0].item]
    with torch.no_grad():
        logits = model(torch.tensor([row.input_ids])).logits[0]
    want = F.cross_entropy(logits[:-1].double(), torch.tensor(row.labels)[1:], ignore_index=-100).item()
    assert reports[0].loss == pytest.approx(want, rel=1e-4)


def _copy(registry, tmp_path, name="base-r4", new="copy"):
    root = tmp_path / "reg"
    shutil.copytree(registry / name, root / new)
    return root, root / new


def _fail(resident, ingestion, root, base: str, reason: str, match: str, rank: int = RANK):
    config = make_config(seed=13, epochs=1, lora_rank=rank, lora_alpha=2.0 * rank, base_adapter=base)
    result = train(resident, config, ingestion, root, adapter_name="warm")
    assert result.failure_reason == reason, result.failure_message
    assert match in result.failure_message, result.failure_message
    receipt = failed_receipt(result, root)
    validate_receipt(receipt)
    assert result.global_step == 0
    return receipt


def test_a_missing_base_adapter(resident, ingestion, tmp_path):
    _fail(
        resident,
        ingestion,
        tmp_path,
        "nope",
        "base_adapter_missing",
        "'nope' is not an adapter in the registry",
    )
    _fail(resident, ingestion, tmp_path, "..", "base_adapter_missing", "is not an adapter name")
    (tmp_path / "empty").mkdir()
    _fail(resident, ingestion, tmp_path, "empty", "base_adapter_missing", "is not a PEFT adapter directory")


def test_a_base_adapter_of_another_rank_is_a_shape_mismatch(resident, ingestion, registry, tmp_path):
    root, _ = _copy(registry, tmp_path)
    _fail(
        resident,
        ingestion,
        root,
        "copy",
        "shape_mismatch",
        "base adapter rank 4 differs from lora_rank 2",
        rank=2,
    )


def test_a_base_adapter_with_other_tensors_is_a_shape_mismatch(resident, ingestion, registry, tmp_path):
    root, path = _copy(registry, tmp_path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    wrong = dict(tensors)
    wrong[key] = torch.zeros(RANK, 7)
    save_file(wrong, str(path / "adapter_model.safetensors"))
    (path / "adapter_manifest.json").unlink()  # a plain PEFT adapter: shapes alone decide
    _fail(resident, ingestion, root, "copy", "shape_mismatch", f"base adapter {key} has shape (4, 7)")
    save_file({k: v for k, v in tensors.items() if k != key}, str(path / "adapter_model.safetensors"))
    _fail(resident, ingestion, root, "copy", "shape_mismatch", "base adapter tensor set differs")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "nan", "bad_config"])
def test_a_corrupt_base_adapter_is_adapter_load_failed(resident, ingestion, registry, tmp_path, damage):
    root, path = _copy(registry, tmp_path)
    model = path / "adapter_model.safetensors"
    if damage == "garbage":
        model.write_bytes(b"\x00\x01 not a safetensors file" * 10)
        match = "is not a readable safetensors file"
    elif damage == "truncated":
        model.write_bytes(model.read_bytes()[:-100])
        match = "is not a readable safetensors file"
    elif damage == "nan":
        tensors = load_file(str(model))
        key = sorted(tensors)[1]
        tensors[key][0, 0] = float("nan")
        save_file(tensors, str(model))
        (path / "adapter_manifest.json").unlink()
        match = f"{key} is not a finite floating-point tensor"
    else:
        (path / "adapter_config.json").write_text("{not json")
        match = "is not readable JSON"
    _fail(resident, ingestion, root, "copy", "adapter_load_failed", match)


@pytest.mark.parametrize("field", ["safetensors_hash", "model_config_hash", "base_weights"])
def test_a_base_adapter_with_other_provenance_is_refused(
    resident, ingestion, registry, tmp_path, other_tiny_dir, field
):
    from kiln_train.artifacts.provenance import base_weight_shard_manifest, model_identity

    root, path = _copy(registry, tmp_path)
    manifest = read_json(path / "adapter_manifest.json")
    if field == "safetensors_hash":
        manifest["safetensors_hash"] = "sha256:" + "1" * 64
        match = "does not match its manifest's safetensors_hash"
    elif field == "model_config_hash":
        manifest["model_config_hash"] = "sha256:" + "2" * 64
        match = "was trained on another model config"
    else:
        manifest["base_weight_shard_manifest"] = base_weight_shard_manifest(other_tiny_dir)
        assert model_identity(other_tiny_dir, None)["model_config_sha256"] == manifest["model_config_hash"]
        match = "was trained on other base weights"
    (path / "adapter_manifest.json").write_text(json.dumps(manifest))
    _fail(resident, ingestion, root, "copy", "adapter_load_failed", match)


def test_an_exact_checkpoint_is_not_a_base_adapter(resident, ingestion, tmp_path):
    config = make_config(seed=13, epochs=2, lora_rank=RANK, lora_alpha=ALPHA, checkpoint_interval=2)
    first = train(resident, config, ingestion, tmp_path, adapter_name="ck")
    assert first.status == "success"
    name = "ck-checkpoint-step-00000002.kiln-checkpoint"
    assert (tmp_path / name).is_dir()
    _fail(resident, ingestion, tmp_path, name, "adapter_load_failed", "is an exact training checkpoint")


def test_an_adapter_made_on_the_vl_class_warm_starts_under_text_model_names(
    resident, ingestion, registry, tmp_path, monkeypatch
):
    """PEFT over `Qwen3_5ForConditionalGeneration` nests layers under `model.language_model.`."""
    root, path = _copy(registry, tmp_path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    nested = {
        k.replace("base_model.model.model.", "base_model.model.model.language_model.", 1): v
        for k, v in tensors.items()
    }
    save_file(nested, str(path / "adapter_model.safetensors"))
    (path / "adapter_manifest.json").unlink()
    seen = _first_step_params(monkeypatch)
    config = make_config(seed=10, epochs=1, lora_rank=RANK, lora_alpha=ALPHA, base_adapter="copy")
    result = train(resident, config, ingestion, root, adapter_name="child")
    assert result.status == "success", result.failure_message
    assert set(seen["params"]) == set(tensors)
    assert all(torch.equal(seen["params"][k], tensors[k]) for k in tensors)


@pytest.mark.parametrize(
    "change,reason,match",
    [
        ({"lora_alpha": 2.0}, "adapter_load_failed", "base adapter lora_alpha 2 differs from lora_alpha 8"),
        ({"use_dora": True}, "adapter_load_failed", "base adapter sets use_dora: true"),
        ({"use_rslora": True}, "adapter_load_failed", "base adapter sets use_rslora: true"),
        ({"rank_pattern": {"q_proj": 8}}, "adapter_load_failed", "non-empty rank_pattern"),
        ({"target_modules": "all-linear"}, "shape_mismatch", "target_modules must list the modules"),
        (
            {"target_modules": ["q_proj", "v_proj"]},
            "shape_mismatch",
            "base adapter targets ['q_proj', 'v_proj']",
        ),
    ],
)
def test_a_base_adapter_that_means_another_function_is_refused(
    resident, ingestion, registry, tmp_path, change, reason, match
):
    root, path = _copy(registry, tmp_path)
    cfg = read_json(path / "adapter_config.json")
    cfg.update(change)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    _fail(resident, ingestion, root, "copy", reason, match)


def test_a_base_adapter_with_integer_tensors_is_refused_from_its_header(
    resident, ingestion, registry, tmp_path
):
    root, path = _copy(registry, tmp_path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    tensors[key] = torch.zeros(tensors[key].shape, dtype=torch.int32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    _fail(resident, ingestion, root, "copy", "adapter_load_failed", f"base adapter {key} is I32")


def test_the_static_check_needs_no_torch_and_reads_only_the_header(registry, resident, tmp_path):
    from kiln_train.artifacts.adapter import check_base_adapter_files
    from kiln_train.errors import TrainingFailure

    _, path = _copy(registry, tmp_path)
    check_base_adapter_files(path, resident.config, RANK, ALPHA)  # the registry's adapter passes
    model = path / "adapter_model.safetensors"
    data = model.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    model.write_bytes(data[: 8 + header_len])  # header intact, tensor bytes gone: still statically valid
    check_base_adapter_files(path, resident.config, RANK, ALPHA)
    model.write_bytes((10**9).to_bytes(8, "little") + data[8:])
    with pytest.raises(TrainingFailure) as err:
        check_base_adapter_files(path, resident.config, RANK, ALPHA)
    assert err.value.reason == "adapter_load_failed"
    assert "header length 1000000000 does not fit" in str(err.value)


# ----- publication under a name taken at the last moment ------------------------------------------


def _publish(registry, name):
    tensors = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 3)}
    return publish_adapter(
        registry,
        name,
        tensors,
        rank=2,
        alpha=4.0,
        build_receipt=lambda output: {"status": "success", "output": output},
        build_manifest=lambda receipt, hashes: {"adapter_name": name, **hashes},
    )


def test_an_empty_directory_taking_the_name_at_the_last_moment_is_not_replaced(tmp_path, monkeypatch):
    registry = tmp_path / "adapters"
    registry.mkdir()
    name = "raced"
    target = registry / name
    real_fsync_dir = adapter_module.fsync_dir

    def synced_then_taken(path):
        real_fsync_dir(path)
        if Path(path).name.startswith(f".{name}.incomplete-"):  # the staging is complete: another
            target.mkdir()  # publisher (an import, a restore) takes the name right before the rename

    monkeypatch.setattr(adapter_module, "fsync_dir", synced_then_taken)
    with pytest.raises(KilnError) as refused:
        _publish(registry, name)
    monkeypatch.undo()
    assert refused.value.code == "adapter_already_exists"
    assert target.is_dir() and list(target.iterdir()) == []  # theirs, untouched
    assert sorted(p.name for p in registry.iterdir()) == [name]  # no staging directory left behind


def test_publication_still_works(tmp_path):
    path = _publish(tmp_path / "adapters", "fine")
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        "adapter_manifest.json",
        "adapter_model.safetensors",
        "train_receipt.json",
    ]
