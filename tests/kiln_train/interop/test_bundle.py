"""SFT export bundles: their files, manifest, row order and token records; refusals leave nothing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from api.errors import http_status
from kiln_train.checkpoint.epoch_order import epoch_order
from kiln_train.errors import KilnError
from kiln_train.interop import bundle as bundle_mod
from kiln_train.interop.bundle import ResidentFacts, verify_bundle
from kiln_train.interop.export import export_sft
from kiln_train.model.config import LORA_TARGET_MODULES
from kiln_train.sft_config import parse_sft_config
from tests.kiln_train.interop.support import MANIFEST_FILES, read_json, write_json
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest

resident, tiny_dir = fx.resident, fx.tiny_dir

TOOL_ROW = {
    "messages": [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": "Weather in Paris for two days?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "24C."}],
        },
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
}


def _config(**fields):
    body = {
        "epochs": 2,
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "optimizer": {"kind": "sgd"},
        "learning_rate": 1e-3,
    }
    return parse_sft_config({**body, **fields}).resolve(seed=fields.get("seed", 11))


def _export(resident, root, name="b", rows=None, **kw):
    config = kw.pop("config", None) or _config()
    return export_sft(
        root,
        name=name,
        resident=ResidentFacts.of_resident(resident),
        tokenizer=resident.tokenizer,
        config=config,
        **({"examples": rows if rows is not None else [*conversations(3), TOOL_ROW]} | kw),
    )


def test_bundle_files_and_manifest(resident, tmp_path):
    result = _export(resident, tmp_path)
    assert result.path == tmp_path / "b.kiln-hf"
    manifest = verify_bundle(result.path)
    assert set(manifest["files"]) == MANIFEST_FILES
    assert sorted(str(p.relative_to(result.path)) for p in result.path.rglob("*") if p.is_file()) == sorted(
        MANIFEST_FILES | {"kiln_hf_export.json"}
    )
    assert (
        manifest["schema"] == "kiln.hf-trl-export.v1"
        and manifest["training_profile"] == "native_online_lora_v1"
    )
    identity = resident.identity
    assert manifest["base_model"]["model_config_sha256"] == identity["model_config_sha256"]
    assert manifest["base_model"]["base_weights_sha256"] == resident.base_weights_sha256
    assert manifest["tokenizer"]["tokenizer_vocab_sha256"] == identity["tokenizer_vocab_sha256"]
    assert manifest["template"]["training_chat_template_sha256"] == identity["training_chat_template_sha256"]
    assert manifest["files"]["tokenizer.json"]["sha256"] == identity["tokenizer_vocab_sha256"]
    assert manifest["lora"]["target_modules"] == list(LORA_TARGET_MODULES)
    assert (manifest["lora"]["rank"], manifest["lora"]["alpha"], manifest["lora"]["dropout"]) == (4, 8.0, 0.0)
    assert manifest["lora"]["initial_adapter"]["source"] == "seeded"
    assert manifest["lora"]["initial_adapter"]["algorithm"] == "kiln-py.seeded-lora-init.v1"
    assert manifest["seed"] == "11" and manifest["optimizer"] == {"learning_rate": 1e-3, "kind": "sgd"}
    assert manifest["schedule"]["total_steps"] == 8 and manifest["schedule"]["batch_size"] == 1
    assert manifest["schedule"]["epoch_orders"] == [epoch_order(11, e, 4) for e in range(2)]
    assert manifest["data"]["kept_corpus_sha256"] == result.ingestion.receipt["kept_corpus_sha256"]
    assert read_json(result.path / "ingestion_receipt.json") == result.ingestion.receipt
    fidelity = {row["aspect"]: row["agreement"] for row in manifest["profile_fidelity"]}
    assert fidelity["order"] == fidelity["tokens_and_labels"] == fidelity["initial_adapter"] == "exact"
    assert fidelity["optimizer"] == "exact" and fidelity["loss"] == "rounding"
    assert fidelity["checkpoints"] == "differs"
    assert json.loads((result.path / "initial_adapter" / "adapter_config.json").read_text())["r"] == 4
    assert "python train.py --model" in (result.path / "README.md").read_text()


def test_train_jsonl_is_kilns_step_order_with_its_tokens(resident, tmp_path):
    rows = [*conversations(3), TOOL_ROW]
    result = _export(resident, tmp_path, rows=rows)
    ingestion = ingest(resident, rows)
    lines = [json.loads(line) for line in (result.path / "train.jsonl").read_text().splitlines()]
    orders = [epoch_order(11, e, len(rows)) for e in range(2)]
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert [(line["epoch"], line["item"]) for line in lines] == [
        (e, i) for e, order in enumerate(orders) for i in order
    ]
    for line in lines:
        row = ingestion.rows[line["item"]]
        assert line["row_index"] == row.row_index == line["item"] + 1
        assert line["row_sha256"] == row.row_sha256
        assert line["input_ids"] == row.input_ids
        supervised = [i for i, label in enumerate(row.labels) if label != -100]
        assert [i for a, b in line["supervised_ranges"] for i in range(a, b)] == supervised
        assert (line["tokens"], line["supervised_tokens"]) == (row.seq_len, row.supervised_tokens)
    tool = next(line for line in lines if line["row_index"] == 4)
    assert (
        tool["row"]["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'
    )
    assert tool["messages"][2]["tool_calls"] == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
    ]
    assert tool["messages"][4]["content"] == "Sunny, 24C."
    assert tool["tools"] == TOOL_ROW["tools"]


def test_dataset_path_with_skip_keeps_source_row_numbers(resident, tmp_path):
    good = conversations(3)
    data = tmp_path / "rows.jsonl"
    lines = [
        json.dumps(good[0]),
        "",
        "{not json",
        json.dumps({"messages": []}),
        json.dumps(good[1]),
        json.dumps(good[2]),
    ]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = _export(
        resident,
        tmp_path / "exports",
        rows=None,
        config=_config(invalid_row_policy="skip"),
        examples=None,
        dataset=data,
        dataset_locator="rows.jsonl",
    )
    manifest = verify_bundle(result.path)
    assert (
        manifest["data"]["rows_read"],
        manifest["data"]["rows_kept"],
        manifest["data"]["rows_rejected"],
    ) == (5, 3, 2)
    assert manifest["data"]["source"] == "dataset_path" and manifest["data"]["source_locator"] == "rows.jsonl"
    records = [json.loads(line) for line in (result.path / "train.jsonl").read_text().splitlines()]
    assert sorted({r["row_index"] for r in records}) == [1, 4, 5]
    assert {r["row_index"]: r["row"] for r in records} == {1: good[0], 4: good[1], 5: good[2]}


def test_muon_is_refused_and_nothing_is_written(resident, tmp_path):
    config = parse_sft_config({"lora_rank": 4, "lora_alpha": 8.0, "optimizer": {"kind": "muon"}}).resolve(
        seed=1
    )
    with pytest.raises(KilnError) as err:
        _export(resident, tmp_path, config=config)
    assert err.value.code == "hf_export_unsupported" and http_status(err.value) == 400
    assert "torch.optim.Muon" in err.value.message and "sgd or adam_w" in err.value.message
    assert list(tmp_path.iterdir()) == []


def test_names_are_never_overwritten(resident, tmp_path):
    first = _export(resident, tmp_path)
    digest = read_json(first.path / "kiln_hf_export.json")["bundle_digest"]
    with pytest.raises(KilnError) as err:
        _export(resident, tmp_path, config=_config(seed=99))
    assert err.value.code == "hf_export_already_exists" and http_status(err.value) == 409
    assert read_json(first.path / "kiln_hf_export.json")["bundle_digest"] == digest
    assert [p.name for p in tmp_path.iterdir()] == ["b.kiln-hf"]


@pytest.mark.parametrize("name", ["", "-x", ".x", "a/b", "x" * 129, "é"])
def test_bad_names_are_refused(resident, tmp_path, name):
    with pytest.raises(KilnError) as err:
        _export(resident, tmp_path, name=name)
    assert err.value.code == "training_invalid_request"
    assert list(tmp_path.iterdir()) == []


def test_a_changed_file_or_fact_fails_verification(resident, tmp_path):
    path = _export(resident, tmp_path).path
    with (path / "train.jsonl").open("a") as f:
        f.write("\n")
    with pytest.raises(ValueError, match="train.jsonl has sha256"):
        verify_bundle(path)
    path = _export(resident, tmp_path, name="c").path
    manifest = read_json(path / "kiln_hf_export.json")
    manifest["optimizer"]["learning_rate"] = 1.0
    write_json(path / "kiln_hf_export.json", manifest)
    with pytest.raises(ValueError, match="bundle_digest"):
        verify_bundle(path)


def test_a_model_directory_that_changed_under_the_runner_is_refused(resident, tmp_path):
    facts = ResidentFacts.of_resident(resident)
    stale = ResidentFacts(
        **{**facts.__dict__, "identity": {**facts.identity, "tokenizer_vocab_sha256": "sha256:" + "0" * 64}}
    )
    with pytest.raises(KilnError) as err:
        export_sft(
            tmp_path,
            name="x",
            resident=stale,
            tokenizer=resident.tokenizer,
            config=_config(),
            examples=conversations(2),
        )
    assert err.value.code == "hf_export_unsupported" and "tokenizer.json" in err.value.message
    assert list(tmp_path.iterdir()) == []


def _adapter(path, resident, rank=4, alpha=8.0, fill=0.01, **config):
    from kiln_train.artifacts.adapter import expected_shapes

    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(5)
    tensors = {
        k: torch.randn(s, generator=gen) * fill for k, s in expected_shapes(resident.config, rank).items()
    }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(LORA_TARGET_MODULES),
        **config,
    }
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return tensors


def test_input_adapter_is_the_starting_point(resident, tmp_path):
    tensors = _adapter(tmp_path / "reg" / "base", resident)
    result = _export(resident, tmp_path / "exports", input_adapter=("base", tmp_path / "reg" / "base"))
    initial = load_file(str(result.path / "initial_adapter" / "adapter_model.safetensors"))
    assert set(initial) == set(tensors) and all(torch.equal(initial[k], tensors[k]) for k in tensors)
    source = result.manifest["lora"]["initial_adapter"]
    assert source["source"] == "input_adapter" and source["algorithm"] is None
    assert source["input_adapter"]["name"] == "base"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"rank": 8}, "rank 8 differs from lora_rank 4"),
        ({"alpha": 4.0}, "lora_alpha 4 differs"),
        ({"fill": float("nan")}, "non-finite"),
        ({"use_dora": True}, "use_dora"),
    ],
)
def test_input_adapter_checks(resident, tmp_path, kwargs, fragment):
    _adapter(tmp_path / "reg" / "base", resident, **kwargs)
    with pytest.raises(KilnError) as err:
        _export(resident, tmp_path / "exports", input_adapter=("base", tmp_path / "reg" / "base"))
    assert err.value.code == "training_invalid_request"
    assert "input_adapter 'base'" in err.value.message and fragment in err.value.message
    assert not (tmp_path / "exports").exists() or list((tmp_path / "exports").iterdir()) == []


def test_staging_is_removed_when_a_build_fails(tmp_path):
    def build(directory):
        (directory / "partial").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        bundle_mod.publish_bundle(tmp_path, "x", build)
    assert list(tmp_path.iterdir()) == []


ALPACA = {"instruction": "Which color is listed?", "input": "red, blue", "output": "Red and blue."}


def test_instruction_rows_are_exported_converted_with_their_own_identity(resident, tmp_path):
    rows = [*conversations(2), ALPACA]
    result = _export(resident, tmp_path, rows=rows)
    ingestion = ingest(resident, rows)
    lines = [json.loads(line) for line in (result.path / "train.jsonl").read_text().splitlines()]
    alpaca = next(line for line in lines if line["row_index"] == 3)
    assert alpaca["row"] == ALPACA  # the row as given, which its hash covers
    assert alpaca["row_sha256"] == ingestion.rows[2].row_sha256
    assert alpaca["messages"] == [
        {"role": "user", "content": "Which color is listed?\nred, blue"},
        {"role": "assistant", "content": "Red and blue."},
    ]
    assert alpaca["input_ids"] == ingestion.rows[2].input_ids
    verify_bundle(result.path)


PROMPT_COMPLETION = {
    "prompt": [
        {"role": "user", "content": "Colour?"},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another?"},
    ],
    "completion": [{"role": "assistant", "content": "Blue."}],
}
PLAIN = {"prompt": "The colour is", "completion": " red."}


def test_prompt_completion_rows_carry_what_the_runner_needs(resident, tmp_path):
    rows = [*conversations(1), PROMPT_COMPLETION, PLAIN]
    result = _export(resident, tmp_path, rows=rows)
    ingestion = ingest(resident, rows)
    lines = {
        json.loads(line)["row_index"]: json.loads(line)
        for line in (result.path / "train.jsonl").read_text().splitlines()
    }
    conversational, plain = lines[2], lines[3]
    assert conversational["row"] == PROMPT_COMPLETION and conversational["context_messages"] == 3
    assert [m["content"] for m in conversational["messages"]] == ["Colour?", "Red.", "Another?", "Blue."]
    assert plain["messages"] is None and plain["text"] == "The colour is red.<|im_end|>"
    assert plain["completion_start"] == len("The colour is")
    assert (plain["input_ids"], conversational["input_ids"]) == (
        ingestion.rows[2].input_ids,
        ingestion.rows[1].input_ids,
    )
    assert "context_messages" not in lines[1] and "text" not in lines[1] and "max_length" not in lines[1]
    verify_bundle(result.path)


def test_right_truncation_rides_along_as_max_length(resident, tmp_path):
    rows = conversations(2)
    longest = max(r.seq_len for r in ingest(resident, rows).rows)
    result = _export(
        resident, tmp_path, rows=rows, config=_config(max_length=longest - 1, truncation="right")
    )
    lines = [json.loads(line) for line in (result.path / "train.jsonl").read_text().splitlines()]
    assert {line["max_length"] for line in lines} == {longest - 1}
    assert max(line["tokens"] for line in lines) == longest - 1
