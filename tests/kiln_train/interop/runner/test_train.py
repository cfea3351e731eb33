"""The TRL runner refuses, before its first step, a bundle or a setup that would not repeat Kiln's
run; and stops, with no adapter, where Kiln's trainer would stop."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln_train.interop.bundle import ResidentFacts
from kiln_train.interop.export import export_sft
from kiln_train.sft_config import parse_sft_config
from tests.kiln_train.interop.support import kiln_run, read_json, rehash_bundle, run_train_py
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations

resident, tiny_dir, other_tiny_dir = fx.resident, fx.tiny_dir, fx.other_tiny_dir


@pytest.fixture(scope="module")
def exported(resident, tmp_path_factory):
    def make(name: str, **config):
        body = {"epochs": 1, "lora_rank": 2, "lora_alpha": 4.0, "optimizer": {"kind": "sgd"}, **config}
        return export_sft(
            tmp_path_factory.mktemp("exports"),
            name=name,
            resident=ResidentFacts.of_resident(resident),
            tokenizer=resident.tokenizer,
            config=parse_sft_config(body).resolve(seed=5),
            examples=conversations(2),
        ).path

    return make


@pytest.fixture(scope="module")
def pristine(exported):
    return exported("r")


@pytest.fixture
def bundle(pristine, tmp_path):
    """A copy of one exported bundle, for a test to change."""
    return shutil.copytree(pristine, tmp_path / "r.kiln-hf")


def _refused(proc, code: int, fragment: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert fragment in proc.stderr, proc.stderr[-3000:]


def test_a_changed_file_is_refused(bundle, tiny_dir, tmp_path):
    with (bundle / "train.jsonl").open("a") as f:
        f.write("\n")
    _refused(run_train_py(bundle, tiny_dir, tmp_path / "out"), 2, "train.jsonl has sha256")
    assert not (tmp_path / "out").exists()


def test_a_changed_manifest_is_refused(bundle, tiny_dir, tmp_path):
    manifest = read_json(bundle / "kiln_hf_export.json")
    manifest["optimizer"]["learning_rate"] = 1.0
    (bundle / "kiln_hf_export.json").write_text(json.dumps(manifest))
    _refused(run_train_py(bundle, tiny_dir, tmp_path / "out"), 2, "bundle_digest")


def test_another_base_model_is_refused(bundle, other_tiny_dir, tmp_path):
    _refused(run_train_py(bundle, other_tiny_dir, tmp_path / "out"), 4, "the bundle was exported for sha256:")
    empty = tmp_path / "empty-model"
    empty.mkdir()
    _refused(run_train_py(bundle, empty, tmp_path / "out"), 4, "has no config.json")


def test_other_versions_of_the_pinned_stack_are_refused(bundle, tiny_dir, tmp_path):
    lock = (bundle / "requirements.lock").read_text().replace("trl==1.16.0", "trl==1.15.0")
    (bundle / "requirements.lock").write_text(lock)
    rehash_bundle(bundle)
    _refused(
        run_train_py(bundle, tiny_dir, tmp_path / "out"),
        3,
        "trl 1.16.0 is installed but the bundle pins 1.15.0",
    )


def test_results_are_never_overwritten(bundle, tiny_dir, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "adapter_model.safetensors").write_bytes(b"earlier run")
    _refused(run_train_py(bundle, tiny_dir, tmp_path / "out"), 2, "is not empty")
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == b"earlier run"


def test_a_row_transformers_tokenizes_differently_is_refused(bundle, tiny_dir, tmp_path):
    lines = (bundle / "train.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["input_ids"][5] += 1
    lines[0] = json.dumps(first)
    (bundle / "train.jsonl").write_text("\n".join(lines) + "\n")
    rehash_bundle(bundle)
    proc = run_train_py(bundle, tiny_dir, tmp_path / "out")
    _refused(proc, 5, "the first difference is at token 5")
    assert read_json(tmp_path / "out" / "kiln_hf_result.json")["status"] == "failed"
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_without_an_adapter(exported, tiny_dir, tmp_path):
    bundle = exported("nan", learning_rate=1e30)
    proc = run_train_py(bundle, tiny_dir, tmp_path / "out")
    _refused(proc, 6, "Kiln fails such a run with nan_loss")
    result = read_json(tmp_path / "out" / "kiln_hf_result.json")
    assert result["status"] == "failed" and result["exit_status"] == 6
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


MIXED_ROWS = [
    {"instruction": "Which color is listed?", "input": "red", "output": "Red."},
    {"system": "Be brief.", "history": [["Hi", "Hello"]], "instruction": "Name a color.", "output": "Blue."},
    {
        "prompt": [
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Green."},
            {"role": "user", "content": "Another?"},
        ],
        "completion": [{"role": "assistant", "content": "Gold."}],
    },
    {"prompt": "The answer is for", "completion": "ty-two."},  # a straddling token: not supervised
    *conversations(1),
]
SGD = {"epochs": 1, "lora_rank": 2, "lora_alpha": 4.0, "optimizer": {"kind": "sgd"}, "learning_rate": 0.05}


def test_a_bundle_of_every_row_format_trains_in_trl_like_kiln(resident, tiny_dir, tmp_path):
    """The runner re-derives each converted row's ids and labels with transformers (exit 5 unless
    they are Kiln's), then TRL trains them: per-step losses equal Kiln's own run of the rows."""
    config = parse_sft_config(SGD).resolve(seed=5)
    facts = ResidentFacts.of_resident(resident)
    bundle = export_sft(
        tmp_path / "exports", name="formats", resident=facts, tokenizer=resident.tokenizer, config=config,
        examples=MIXED_ROWS,
    ).path  # fmt: skip
    proc = run_train_py(bundle, tiny_dir, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = [
        json.loads(line)["loss"] for line in (tmp_path / "out" / "step_losses.jsonl").read_text().splitlines()
    ]
    ours = kiln_run(resident, config, MIXED_ROWS, tmp_path / "kiln", "formats").loss_history
    assert len(theirs) == len(ours) == len(MIXED_ROWS)
    assert max(abs(a - b) / abs(b) for a, b in zip(theirs, ours, strict=True)) <= 1e-4


def test_a_bundle_of_rows_cut_by_right_truncation_trains_in_trl(resident, tiny_dir, tmp_path):
    rows = conversations(2)
    config = parse_sft_config({**SGD, "max_length": 25, "truncation": "right"}).resolve(seed=5)
    bundle = export_sft(
        tmp_path / "exports", name="cut", resident=ResidentFacts.of_resident(resident),
        tokenizer=resident.tokenizer, config=config, examples=rows,
    ).path  # fmt: skip
    lines = [json.loads(line) for line in (bundle / "train.jsonl").read_text().splitlines()]
    assert {len(line["input_ids"]) for line in lines} == {25} and {line["max_length"] for line in lines} == {
        25
    }
    proc = run_train_py(bundle, tiny_dir, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_json(tmp_path / "out" / "kiln_hf_result.json")["run"]["steps"] == 2
