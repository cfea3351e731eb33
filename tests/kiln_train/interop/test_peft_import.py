"""PEFT import: each check names the first difference and leaves nothing behind; a passing import
is an adapter Kiln's warm start accepts."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch
from safetensors.torch import load_file, save_file

from api.errors import http_status
from kiln_train.artifacts.adapter import load_base_adapter
from kiln_train.errors import KilnError
from kiln_train.interop import peft_import
from kiln_train.interop.bundle import ResidentFacts, read_manifest
from kiln_train.interop.export import export_sft
from kiln_train.interop.lora_init import seeded_lora_tensors
from kiln_train.interop.peft_import import Upload, plan_import, publish_import, read_archive, read_directory
from kiln_train.model.config import LORA_TARGET_MODULES
from kiln_train.sft_config import parse_sft_config
from tests.kiln_train.interop.support import fake_run_output, read_json, rewrite_result, tar_gz, write_json
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations

resident, tiny_dir = fx.resident, fx.tiny_dir
MAX = 1 << 30


@pytest.fixture(scope="module")
def facts(resident):
    return ResidentFacts.of_resident(resident)


@pytest.fixture(scope="module")
def bundle(resident, facts, tmp_path_factory):
    config = parse_sft_config(
        {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0, "optimizer": {"kind": "adam_w"}}
    ).resolve(seed=3)
    root = tmp_path_factory.mktemp("exports")
    return export_sft(
        root,
        name="imp",
        resident=facts,
        tokenizer=resident.tokenizer,
        config=config,
        examples=conversations(2),
    ).path


@pytest.fixture
def run(bundle, tmp_path):
    """A fresh run output for the bundle, and the lookup that finds the bundle's export."""
    out = fake_run_output(bundle, tmp_path / "out")
    manifest = read_manifest(bundle)

    def find(digest):
        return manifest if digest == manifest["bundle_digest"] else None

    return out, find


def _refused(upload, facts, find, code, fragment):
    with pytest.raises(KilnError) as err:
        plan_import(upload, facts, find)
    assert err.value.code == code, err.value.message
    assert http_status(err.value) == {"peft_import_invalid": 400, "peft_import_mismatch": 409}[code]
    assert fragment in err.value.message, err.value.message
    return err.value


def test_a_run_output_imports_and_warm_starts(run, facts, resident, tmp_path):
    out, find = run
    plan = plan_import(read_directory(out), facts, find)
    assert plan.vouched and plan.filled == [] and plan.key_prefix == "text"
    registry = tmp_path / "registry"
    path, receipt = publish_import(registry, "imported", plan, runner_id="r1")
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        "adapter_manifest.json",
        "adapter_model.safetensors",
        "kiln_hf_result.json",
        "kiln_import_receipt.json",
        "peft_adapter_config.json",
        "step_losses.jsonl",
    ]
    assert [p.name for p in registry.iterdir()] == ["imported"]  # no staging left
    assert receipt["schema"] == "kiln.hf-peft-import.v1" and receipt["origin"] == "kiln_hf_trl_run"
    assert receipt["resident"]["runner_id"] == "r1"
    assert "identities" in receipt["checks"]
    ours, theirs = (
        load_file(str(path / "adapter_model.safetensors")),
        load_file(str(out / "adapter_model.safetensors")),
    )
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    manifest = read_json(path / "adapter_manifest.json")
    assert manifest["model_config_hash"] == resident.identity["model_config_sha256"]
    assert manifest["base_weight_shard_manifest"] == {"aggregate_sha256": resident.base_weights_sha256}
    tensors = load_base_adapter(
        path,
        resident.config,
        4,
        alpha=8.0,
        model_config_sha256=resident.identity["model_config_sha256"],
        base_weights_sha256=resident.base_weights_sha256,
    )
    assert set(tensors) == set(ours)


def test_a_plain_peft_adapter_imports_without_a_vouched_identity(run, facts, tmp_path):
    out, find = run
    upload = Upload(
        {
            k: v
            for k, v in read_directory(out).files.items()
            if k in ("adapter_config.json", "adapter_model.safetensors")
        }
    )
    plan = plan_import(upload, facts, find)
    assert not plan.vouched
    path, receipt = publish_import(tmp_path, "plain", plan)
    manifest = read_json(path / "adapter_manifest.json")
    assert receipt["origin"] == "peft" and receipt["run"] is None
    assert manifest["model_config_hash"] is None and manifest["base_weight_shard_manifest"] is None


def test_a_subset_of_targets_is_filled_with_zero_delta_pairs(run, facts, resident, tmp_path):
    out, find = run
    keep = ("q_proj", "v_proj", "gate_proj")
    tensors = {
        k: v for k, v in load_file(str(out / "adapter_model.safetensors")).items() if k.split(".")[-3] in keep
    }
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = read_json(out / "adapter_config.json")
    write_json(out / "adapter_config.json", {**config, "target_modules": list(keep)})
    upload = Upload({k: (out / k).read_bytes() for k in ("adapter_config.json", "adapter_model.safetensors")})
    plan = plan_import(upload, facts, find)
    assert plan.targets == ["q_proj", "v_proj", "gate_proj"]
    assert plan.filled == [t for t in LORA_TARGET_MODULES if t not in keep]
    path, receipt = publish_import(tmp_path, "subset", plan)
    published = load_file(str(path / "adapter_model.safetensors"))
    init = seeded_lora_tensors(resident.config, 4, plan.fill_seed)
    for key, value in published.items():
        if key.split(".")[-3] in keep:
            assert torch.equal(value, tensors[key])
        elif ".lora_B." in key:
            assert torch.count_nonzero(value) == 0
        else:
            assert value.numpy().tobytes() == init[key][2]
    assert receipt["adapter"]["fill"]["seed"] == str(plan.fill_seed)
    assert json.loads((path / "adapter_config.json").read_text())["target_modules"] == list(
        LORA_TARGET_MODULES
    )
    load_base_adapter(path, resident.config, 4, alpha=8.0)


def test_vl_class_keys_are_published_under_kilns_names(run, facts, tmp_path):
    out, find = run
    tensors = load_file(str(out / "adapter_model.safetensors"))
    vl = {
        k.replace("base_model.model.model.", "base_model.model.model.language_model.", 1): v
        for k, v in tensors.items()
    }
    save_file(vl, str(out / "adapter_model.safetensors"))
    rewrite_result(out)
    plan = plan_import(read_directory(out), facts, find)
    assert plan.key_prefix == "vl" and set(plan.tensors) == set(tensors)


# ----- what is refused ------------------------------------------------------------------------------


def _edit_config(out, **changes):
    config = read_json(out / "adapter_config.json")
    config.update(changes)
    write_json(out / "adapter_config.json", config)
    rewrite_result(out)


def _edit_tensors(out, edit):
    tensors = load_file(str(out / "adapter_model.safetensors"))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    rewrite_result(out)


A0 = "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"
B3 = "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda out: _edit_config(out, r=8), "wrong rank: tensor"),
        (
            lambda out: _edit_config(out, target_modules=[*LORA_TARGET_MODULES, "lm_head"]),
            "'lm_head' is not one of",
        ),
        (lambda out: _edit_config(out, target_modules="all-linear"), "is the pattern 'all-linear'"),
        (lambda out: _edit_config(out, use_dora=True), "use_dora = true cannot be represented"),
        (lambda out: _edit_config(out, use_rslora=True), "use_rslora"),
        (lambda out: _edit_config(out, bias="all"), 'bias = "all"'),
        (lambda out: _edit_config(out, modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda out: _edit_config(out, init_lora_weights="pissa"), "init_lora_weights"),
        (lambda out: _edit_config(out, layers_to_transform=[0, 1]), "layers_to_transform"),
        (lambda out: _edit_config(out, some_future_option={"on": True}), "some_future_option"),
        (lambda out: _edit_config(out, peft_type="IA3"), "peft_type is 'IA3'"),
        (lambda out: _edit_config(out, lora_alpha=float("inf")), "lora_alpha must be a finite"),
        (
            lambda out: _edit_tensors(
                out, lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(2, 2)})
            ),
            "'base_model.model.lm_head.weight' is not a LoRA A/B weight",
        ),
        (
            lambda out: _edit_tensors(out, lambda t: t.__setitem__(A0, torch.zeros(4, 7))),
            f"shape mismatch: tensor '{A0}' is [4, 7]",
        ),
        (lambda out: _edit_tensors(out, lambda t: t.pop(B3)), f"tensor '{B3}' is missing"),
        (
            lambda out: _edit_tensors(out, lambda t: t[A0].view(-1).__setitem__(5, float("nan"))),
            f"tensor '{A0}' holds a non-finite value (NaN or infinity) at element 5",
        ),
        (
            lambda out: _edit_tensors(out, lambda t: t.__setitem__(B3, t[B3].to(torch.int32))),
            "is I32, not a floating-point tensor",
        ),
        (
            lambda out: _edit_tensors(
                out,
                lambda t: t.update(
                    {"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}
                ),
            ),
            "names no projection of the resident model (4 layers",
        ),
    ],
)
def test_bad_adapters_are_400(run, facts, edit, fragment, tmp_path):
    out, find = run
    edit(out)
    _refused(read_directory(out), facts, find, "peft_import_invalid", fragment)


def test_a_file_changed_after_the_run_is_409(run, facts):
    out, find = run
    _edit_tensors(out, lambda t: t[B3].add_(1e-3))
    result = read_json(out / "kiln_hf_result.json")
    result["adapter"]["adapter_model.safetensors"] = "sha256:" + "1" * 64  # the run's record, not the file's
    write_json(out / "kiln_hf_result.json", result)
    _refused(read_directory(out), facts, find, "peft_import_mismatch", "adapter_model.safetensors has sha256")


@pytest.mark.parametrize(
    ("field", "fragment"),
    [
        ("base_weights_sha256", "base_model.base_weights_sha256 is"),
        ("model_config_sha256", "base_model.model_config_sha256 is"),
        ("tokenizer_vocab_sha256", "tokenizer.tokenizer_vocab_sha256 is"),
        ("training_chat_template_sha256", "template.training_chat_template_sha256 is"),
    ],
)
def test_another_base_model_tokenizer_or_template_is_409(run, facts, field, fragment):
    out, find = run
    other = "sha256:" + "e" * 64
    if field == "base_weights_sha256":
        resident = ResidentFacts(**{**facts.__dict__, "base_weights_sha256": other})
    else:
        resident = ResidentFacts(**{**facts.__dict__, "identity": {**facts.identity, field: other}})
    error = _refused(read_directory(out), resident, find, "peft_import_mismatch", fragment)
    assert other in error.message


def test_an_export_this_server_never_made_is_409_unless_uploaded(run, facts, bundle):
    out, _ = run
    upload = read_directory(out)
    _refused(upload, facts, lambda digest: None, "peft_import_mismatch", "no export of this server")
    files = {**upload.files, "kiln_hf_export.json": (bundle / "kiln_hf_export.json").read_bytes()}
    assert plan_import(Upload(files), facts, lambda digest: None).export["name"] == "imp"
    manifest = json.loads(files["kiln_hf_export.json"])
    manifest["seed"] = "4"
    files["kiln_hf_export.json"] = json.dumps(manifest).encode()
    _refused(Upload(files), facts, lambda digest: None, "peft_import_mismatch", "does not recompute")


def test_a_run_of_another_script_or_shape_is_409(run, facts):
    out, find = run
    result = read_json(out / "kiln_hf_result.json")
    write_json(out / "kiln_hf_result.json", {**result, "script": {"sha256": "sha256:" + "2" * 64}})
    _refused(read_directory(out), facts, find, "peft_import_mismatch", "executed a train.py")
    write_json(out / "kiln_hf_result.json", {**result, "lora": {**result["lora"], "alpha": 16.0}})
    _refused(read_directory(out), facts, find, "peft_import_mismatch", "lora.alpha is 16.0")


def test_an_unfinished_run_is_400(run, facts):
    out, find = run
    write_json(
        out / "kiln_hf_result.json", {"schema": "kiln.hf-trl-result.v1", "status": "failed", "message": "nan"}
    )
    _refused(read_directory(out), facts, find, "peft_import_invalid", "did not finish (nan)")


def test_missing_files_are_400(facts):
    _refused(
        Upload({"adapter_config.json": b"{}"}),
        facts,
        lambda d: None,
        "peft_import_invalid",
        "no adapter_model",
    )


# ----- archives and publication ---------------------------------------------------------------------


def _tar(entries) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data, kind in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE:
                info.linkname = "/etc/passwd"
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return buffer.getvalue()


def test_archives_flat_or_in_one_directory(run):
    out, _ = run
    for arcroot in (None, "trl-output"):
        upload = read_archive(tar_gz(out, arcroot=arcroot), max_bytes=MAX)
        assert set(upload.files) == {
            "adapter_config.json",
            "adapter_model.safetensors",
            "kiln_hf_result.json",
            "step_losses.jsonl",
        }
    (out / "README.md").write_text("peft model card")
    assert read_archive(tar_gz(out), max_bytes=MAX).ignored == ("README.md",)


@pytest.mark.parametrize(
    ("blob", "fragment"),
    [
        (b"not a tarball", "not a gzip tar"),
        (_tar([("adapter_config.json", b"", tarfile.SYMTYPE)]), "is not a regular file"),
        (_tar([("../adapter_config.json", b"{}", tarfile.REGTYPE)]), "not a relative path"),
        (_tar([("/abs/adapter_config.json", b"{}", tarfile.REGTYPE)]), "not a relative path"),
        (_tar([("a/b/adapter_config.json", b"{}", tarfile.REGTYPE)]), "nested too deep"),
        (
            _tar([("a/adapter_config.json", b"{}", tarfile.REGTYPE), ("b/x", b"", tarfile.REGTYPE)]),
            "several directories",
        ),
        (
            _tar(
                [
                    ("adapter_config.json", b"{}", tarfile.REGTYPE),
                    ("./adapter_config.json", b"{}", tarfile.REGTYPE),
                ]
            ),
            "twice",
        ),
        (_tar([("adapter_model.safetensors", b"x" * 100, tarfile.REGTYPE)]), "unpacks to more than 64 bytes"),
    ],
)
def test_bad_archives_are_400(blob, fragment):
    with pytest.raises(KilnError) as err:
        read_archive(blob, max_bytes=64)
    assert err.value.code == "peft_import_invalid" and fragment in err.value.message


def test_publication_never_overwrites_and_cleans_up(run, facts, tmp_path):
    out, find = run
    plan = plan_import(read_directory(out), facts, find)
    registry = tmp_path / "registry"
    (registry / "taken").mkdir(parents=True)
    with pytest.raises(KilnError) as err:
        publish_import(registry, "taken", plan)
    assert err.value.code == "adapter_already_exists"
    assert [p.name for p in registry.iterdir()] == ["taken"]

    def register(path, receipt):
        raise KilnError("adapter_already_exists", "a row took the name")

    with pytest.raises(KilnError):
        publish_import(registry, "raced", plan, register=register)
    assert [p.name for p in registry.iterdir()] == ["taken"]
    with pytest.raises(KilnError) as err:
        publish_import(registry, "a-checkpoint-step-00000001", plan)
    assert err.value.code == "invalid_adapter_name"
    assert peft_import.IMPORT_SCHEMA == "kiln.hf-peft-import.v1"


def test_a_name_of_a_whole_path_segment_publishes(run, facts, tmp_path):
    """The staging directory's name does not grow with the adapter's (255 bytes is allowed)."""
    out, find = run
    name = "n" * 255
    path, _ = publish_import(tmp_path / "registry", name, plan_import(read_directory(out), facts, find))
    assert path.name == name and [p.name for p in (tmp_path / "registry").iterdir()] == [name]


def test_init_only_options_are_accepted(run, facts):
    out, find = run
    _edit_config(out, init_lora_weights="eva", eva_config={"rho": 2.0}, lora_dropout=0.1)
    assert plan_import(read_directory(out), facts, find).peft_config["init_lora_weights"] == "eva"
