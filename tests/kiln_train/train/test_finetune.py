"""`kiln_train.finetune`: the README's example runs, the call trains what `train_sft` trains,
resolves defaults and refuses requests as the service's admission does, and resumes its own
stopped run (docs/library.md). The comparison with a job the service runs is in
tests/worker/test_finetune_parity.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.settings import Settings
from kiln_train import KilnError, finetune
from kiln_train.train.finetune import DEFAULT_RESERVE_GB
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, read_json, train

one_thread, resident, tiny_dir = fx.one_thread, fx.resident, fx.tiny_dir  # shared fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[3]
ADAPTER_FILES = [
    "adapter_config.json",
    "adapter_manifest.json",
    "adapter_model.safetensors",
    "train_receipt.json",
]
CONFIG = {
    "epochs": 2,
    "lora_rank": 4,
    "lora_alpha": 8.0,
    "optimizer": {"kind": "adam_w"},
    "learning_rate": 1e-3,
}


def readme_library_example() -> str:
    """The Python block of the README's "Use it as a library" section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Use it as a library\n(.*?)^## ", text, re.S | re.M)
    assert section is not None, "README.md has no 'Use it as a library' section"
    blocks = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    assert len(blocks) == 1, blocks
    return blocks[0]


def test_the_readme_example_trains_an_adapter_on_a_tiny_model(tmp_path, tiny_dir, monkeypatch):
    # The README builds its model with `kiln model init-tiny models/tiny`: the tiny preset, seed 0,
    # the real tokenizer; tiny_dir is that checkpoint.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_dir)
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(readme_library_example(), "README.md", "exec"), {"__name__": "readme"})
    status, adapter_path, final_loss = out.getvalue().split()
    assert status == "success"
    adapter = Path(adapter_path)
    assert adapter.parent == tmp_path / "adapters"
    assert sorted(p.name for p in adapter.iterdir()) == ADAPTER_FILES
    receipt = read_json(adapter / "train_receipt.json")
    assert receipt["status"] == "success" and receipt["adapter_name"] == adapter.name
    assert re.fullmatch(r"sft-[0-9a-f]{8}", adapter.name)
    hyper = receipt["hyperparameters"]
    assert (hyper["rank"], hyper["alpha"], hyper["epochs"]) == (4, 8.0, 2)
    assert hyper["learning_rate"] == 1e-3  # Muon's default, resolved as admission resolves it
    assert re.fullmatch(r"[0-9]+", hyper["seed"])  # drawn once and recorded
    assert receipt["data"]["sft_ingestion"]["rows_kept"] == 2
    assert receipt["data"]["sft_ingestion"]["source"] == "inline"
    assert receipt["runtime"]["sft_loss_route"] == "kt_tape_flce"
    assert math.isfinite(float(final_loss))
    checkpoints = sorted(p.name for p in (tmp_path / "adapters").glob("*.kiln-checkpoint"))
    assert checkpoints == [f"{adapter.name}-checkpoint-step-00000002.kiln-checkpoint"]


def test_finetune_trains_the_adapter_train_sft_trains(tmp_path, resident):
    rows = conversations(3)
    result = finetune(resident, rows, {**CONFIG, "seed": 21, "output_name": "lib"}, tmp_path / "lib")
    direct = train(
        resident,
        make_config(seed=21, **CONFIG),
        ingest(resident, rows),
        tmp_path / "direct",
        adapter_name="lib",
    )
    assert result.status == direct.status == "success", result.failure_message
    assert result.loss_history == direct.loss_history  # floats compared exactly
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (result.adapter_path / name).read_bytes() == (direct.adapter_path / name).read_bytes(), name
    # The library's effective config is the one admission pins: segments planned, name filled.
    config = read_json(result.receipt_path)["config"]
    assert config["grad_checkpoint_segments"] == 1 and config["output_name"] == "lib"
    assert config["seed"] == "21" and config["learning_rate"] == 1e-3


def test_a_jsonl_file_is_ingested_like_a_dataset_path_with_defaults_resolved(tmp_path, resident):
    rows = [json.dumps(r) for r in conversations(2)]
    data = tmp_path / "rows.jsonl"
    data.write_text(f"{rows[0]}\n\n{{not json\n{rows[1]}\n", encoding="utf-8")
    config = {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0, "optimizer": {"kind": "adam_w"}}
    result = finetune(resident, data, {**config, "invalid_row_policy": "skip"}, tmp_path / "out")
    assert result.status == "success", result.failure_message
    receipt = read_json(result.receipt_path)
    ingestion = receipt["data"]["sft_ingestion"]
    assert (ingestion["source"], ingestion["source_locator"]) == ("dataset_path", str(data))
    assert (ingestion["rows_read"], ingestion["rows_kept"]) == (3, 2)
    assert [(r["row_index"], r["reason"]) for r in ingestion["rejected_rows"]] == [(2, "invalid_json")]
    assert receipt["hyperparameters"]["learning_rate"] == 1e-4  # AdamW's default
    assert result.total_steps == 2
    # asked vs ran: the request as sent beside the effective config
    assert receipt["requested_config"] == {**config, "invalid_row_policy": "skip"}
    assert receipt["config"]["learning_rate"] == 1e-4 and "learning_rate" not in receipt["requested_config"]
    assert list(receipt)[-2:] == ["requested_config", "config"]


def refusal(tmp_path: Path, model, data, config, code: str, *needles: str, **kw) -> None:
    """finetune raises KilnError(code) naming the fault, and writes nothing."""
    output = tmp_path / "refused"
    with pytest.raises(KilnError) as caught:
        finetune(model, data, config, output, **kw)
    assert caught.value.code == code, caught.value.message
    for needle in needles:
        assert needle in caught.value.message, (needle, caught.value.message)
    assert not output.exists()


def test_a_bad_row_is_refused_naming_the_row(tmp_path, resident):
    rows = conversations(2)
    rows.insert(1, {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]})
    refusal(
        tmp_path, resident, rows, CONFIG, "training_invalid_request", "SFT row 2 (sha256:", "invalid_role"
    )


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"lora_rank": 0}, "config.lora_rank"),
        ({"gradient_accumulation_steps": 4}, "config.gradient_accumulation_steps: unknown field"),
        ({"optimizer": {"kind": "adam_w", "beta1": 1.5}}, "config.optimizer.adam_w.beta1"),
        ({"output_name": "a/b"}, "config.output_name"),
        ({"base_adapter": "../x"}, "config.base_adapter '../x'"),
        ({"base_adapter": "missing", "lora_rank": 4, "lora_alpha": 8.0}, "not an adapter in the registry"),
        ({"resume_checkpoint": "nope.kiln-checkpoint"}, "config.resume_checkpoint"),
        ({"train_mtp": True}, "train_mtp=true is not implemented"),
    ],
)
def test_config_errors_are_refused_naming_the_field(tmp_path, resident, config, needle):
    refusal(tmp_path, resident, conversations(1), config, "training_invalid_request", needle)


def test_the_static_gates_of_the_backend_and_model_apply(tmp_path, resident):
    rank = resident.config.model_maximum_rank() + 1
    config = {**CONFIG, "lora_rank": rank, "lora_alpha": float(rank)}
    refusal(
        tmp_path,
        resident,
        conversations(1),
        config,
        "training_invalid_request",
        f"lora_rank {rank} is outside",
    )
    segments = resident.config.num_hidden_layers + 1
    config = {**CONFIG, "grad_checkpoint_segments": segments}
    needle = f"config.grad_checkpoint_segments={segments} exceeds"
    refusal(tmp_path, resident, conversations(1), config, "training_invalid_request", needle)


def test_a_run_that_will_not_fit_is_the_413(tmp_path, resident):
    refusal(
        tmp_path, resident, conversations(1), CONFIG, "training_will_not_fit", "GB", training_memory_gb=0.001
    )


def test_names_are_never_overwritten(tmp_path, resident):
    output = tmp_path / "refused"
    (output / "taken").mkdir(parents=True)
    with pytest.raises(KilnError) as caught:
        finetune(resident, conversations(1), {**CONFIG, "output_name": "taken"}, output)
    assert caught.value.code == "adapter_already_exists"
    (output / "taken").rmdir()
    (output / "late-checkpoint-step-00000002.kiln-checkpoint").mkdir()
    with pytest.raises(KilnError) as caught:
        finetune(resident, conversations(2), {**CONFIG, "output_name": "late"}, output)
    assert caught.value.code == "adapter_already_exists" and "from an earlier run" in caught.value.message


def test_data_and_arguments_of_the_wrong_kind_are_refused(tmp_path, resident):
    refusal(tmp_path, resident, {"messages": []}, CONFIG, "training_invalid_request", "data must be a list")
    refusal(tmp_path, resident, [], CONFIG, "training_invalid_request", "at least one example")
    refusal(tmp_path, resident, tmp_path / "absent.jsonl", CONFIG, "training_invalid_request", "absent.jsonl")
    refusal(
        tmp_path, resident, conversations(1), CONFIG, "training_invalid_request", "reserve_gb", reserve_gb=-1
    )


def test_a_missing_model_directory_is_refused(tmp_path):
    model = tmp_path / "no-model"
    refusal(tmp_path, model, conversations(1), CONFIG, "training_backend_unsupported", "does not exist")


def test_the_memory_defaults_are_the_services():
    memory = Settings().memory
    assert (memory.reserve_gb, memory.training_memory_gb) == (DEFAULT_RESERVE_GB, None)


def test_a_stopped_run_resumes_to_the_adapter_of_a_straight_run(tmp_path, resident):
    rows = conversations(3)
    config = {**CONFIG, "output_name": "chain"}
    straight = finetune(resident, rows, {**config, "seed": 5}, tmp_path / "straight")
    steps: list[int] = []
    stopped = finetune(
        resident,
        rows,
        {**config, "seed": 5},
        tmp_path / "chain",
        progress=lambda report: steps.append(report.global_step),
        should_stop=lambda: steps[-1] == 2,
    )
    assert (stopped.status, stopped.failure_reason, stopped.global_step) == ("failed", "cancelled", 2)
    checkpoint = stopped.checkpoints[-1]["basename"]
    # The resume names only the checkpoint: the seed, the name and the plan come from it.
    resumed = finetune(resident, rows, {**CONFIG, "resume_checkpoint": checkpoint}, tmp_path / "chain")
    assert resumed.status == "success", resumed.failure_message
    assert resumed.loss_history == straight.loss_history
    name = "adapter_model.safetensors"
    assert (resumed.adapter_path / name).read_bytes() == (straight.adapter_path / name).read_bytes()


def test_a_model_it_loads_has_the_execution_identity_of_a_default_worker(tiny_dir):
    from kiln_train.train.finetune import _load
    from kiln_train.train.resident import load_resident

    worker = load_resident(
        tiny_dir, device="cpu", server_config={"memory": Settings().memory.model_dump(mode="json")}
    )
    library = _load(tiny_dir, "cpu", {"reserve_gb": DEFAULT_RESERVE_GB, "training_memory_gb": None})
    assert library.execution_identity_digest == worker.execution_identity_digest


def test_the_planning_it_shares_with_the_api_does_not_import_torch():
    code = (
        "import sys, kiln_train, kiln_train.plan.run_plan, kiln_train.plan.gates, kiln_train.plan.names, "
        "kiln_train.plan.resume_point; assert 'finetune' in kiln_train.__all__; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_instruction_rows_train_the_adapter_their_messages_rows_train(tmp_path, resident):
    """The format seam converts, nothing more: the same conversations written as instruction rows
    give bit-identical adapters and losses; only the row identities (the rows as given) differ."""
    rows = conversations(3)
    alpaca = [
        {"instruction": r["messages"][0]["content"], "output": r["messages"][1]["content"]} for r in rows
    ]
    config = {**CONFIG, "seed": 21}
    native = finetune(resident, rows, {**config, "output_name": "native"}, tmp_path / "native")
    converted = finetune(resident, alpaca, {**config, "output_name": "native"}, tmp_path / "converted")
    assert native.status == converted.status == "success", converted.failure_message
    assert converted.loss_history == native.loss_history
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (converted.adapter_path / name).read_bytes() == (native.adapter_path / name).read_bytes(), name
    ours, theirs = read_json(converted.receipt_path), read_json(native.receipt_path)
    assert ours["data"]["sft_ingestion"]["row_counts"]["rows_per_format"] == {"instruction": 3}
    assert "row_counts" not in theirs["data"]["sft_ingestion"]  # a messages-only receipt is unchanged
    assert (
        ours["data"]["sft_ingestion"]["kept_row_hashes"] != theirs["data"]["sft_ingestion"]["kept_row_hashes"]
    )
