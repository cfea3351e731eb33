"""Qwen3.5 checkpoints that ship the "nothink" template (2B and smaller) train like the think ones.

The proof that one training template serves both is the oracle fixture
`qualification/fixtures/qwen35_sft_nothink_equivalence_v1.json` (regenerate:
`.venv/bin/python qualification/sft_nothink_oracle.py --write`): TRL's two training variants,
run through Transformers on every example of the conversation fixtures, give identical text, ids
and masks, and Kiln's ingestion equals them. These tests read that fixture (no TRL needed) and
train a tiny nothink checkpoint end to end.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln_cli.main import cli
from kiln_train.data.chat_template import (
    NOTHINK_TEMPLATE_FILE,
    chat_template_sha256,
    official_chat_template,
    official_nothink_chat_template,
    select_training_template,
    training_chat_template_sha256,
    training_template,
)
from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED, KilnError
from kiln_train.model.tiny import TEMPLATE_FILES, write_tiny_checkpoint
from kiln_train.train.resident import load_resident
from tests.kiln_train.train import trainer_fixtures as fx

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "qualification" / "fixtures"
FIXTURE = FIXTURES / "qwen35_sft_nothink_equivalence_v1.json"


@pytest.fixture(scope="module")
def oracle() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_both_trl_training_variants_and_kiln_agree_on_every_fixture_conversation(oracle):
    assert oracle["schema"] == "kiln.qwen35-sft-nothink-equivalence.v1"
    assert oracle["differences"] == []
    assert oracle["rows_compared"] >= 600 and oracle["rows_identical"] == oracle["rows_compared"]
    assert oracle["kiln_rows_compared"] >= 550 and oracle["kiln_rows_equal"] == oracle["kiln_rows_compared"]
    # The one difference between the flavours: the generation prompt, which SFT never renders.
    prompts = oracle["generation_prompts"]
    assert prompts["think"].endswith("<|im_start|>assistant\n<think>\n")
    assert prompts["nothink"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_oracle_read_the_fixtures_checked_in_now(oracle):
    for source in oracle["sources"]:
        assert _sha(FIXTURES / source["file"]) == source["sha256"], (
            f"{source['file']} changed since the nothink oracle ran; regenerate: {oracle['regenerate']}"
        )
    assert {s["file"] for s in oracle["sources"]} >= {
        "qwen35_sft_oracle_v1.json",
        "qwen35_sft_conversations_v1.json",
    }


def test_stored_templates_are_the_ones_the_oracle_compared(oracle):
    t = oracle["templates"]
    assert _sha(NOTHINK_TEMPLATE_FILE) == t["trl_nothink_sha256"] == t["kiln_nothink_chat_template_sha256"]
    assert chat_template_sha256(official_nothink_chat_template()) == t["trl_nothink_sha256"]
    assert chat_template_sha256() == t["trl_think_sha256"]
    assert training_chat_template_sha256() == t["kiln_training_template_sha256"]
    assert t["trl_think_sha256"] != t["trl_nothink_sha256"]


def test_both_official_templates_select_the_training_template_and_nothing_else_does():
    assert select_training_template(official_chat_template()) is training_template()
    assert select_training_template(official_nothink_chat_template()) is training_template()
    for near_miss in (official_nothink_chat_template() + "\n", official_nothink_chat_template()[1:]):
        with pytest.raises(KilnError) as err:
            select_training_template(near_miss)
        assert err.value.code == TRAINING_BACKEND_UNSUPPORTED
        assert "not an official Qwen3.5 template" in err.value.message
        assert chat_template_sha256(official_nothink_chat_template()) in err.value.message


def test_a_nothink_checkpoint_trains_and_its_receipt_names_its_template(tmp_path, qwen_tokenizer):
    model = write_tiny_checkpoint(
        tmp_path / "model", "tiny", seed=3, tokenizer=qwen_tokenizer, chat_template="nothink"
    )
    assert (model / "chat_template.jinja").read_bytes() == NOTHINK_TEMPLATE_FILE.read_bytes()
    resident = load_resident(model)
    nothink = "sha256:" + chat_template_sha256(official_nothink_chat_template())
    assert resident.identity["chat_template_sha256"] == nothink
    assert resident.identity["training_chat_template_sha256"].endswith(training_chat_template_sha256())
    ingestion = fx.ingest(resident, fx.conversations(2))
    result = fx.train(resident, fx.make_config(epochs=1), ingestion, tmp_path / "out")
    assert result.status == "success", result.failure_message
    assert result.global_step == 2
    assert result.receipt["tokenizer"]["chat_template_hash"] == nothink
    assert result.receipt["config_hashes"]["chat_template_hash"] == nothink


def test_init_tiny_writes_either_official_template(tmp_path):
    runner = CliRunner()
    for flavour in ("think", "nothink"):
        out = tmp_path / flavour
        result = runner.invoke(cli, ["model", "init-tiny", str(out), "--chat-template", flavour])
        assert result.exit_code == 0, result.output
        assert (out / "chat_template.jinja").read_bytes() == TEMPLATE_FILES[flavour].read_bytes()
    result = runner.invoke(cli, ["model", "init-tiny", str(tmp_path / "x"), "--chat-template", "other"])
    assert result.exit_code == 2 and "other" in result.output
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="chat_template"):
        write_tiny_checkpoint(tmp_path / "y", "tiny", with_tokenizer=False, chat_template="other")
    assert not (tmp_path / "y").exists()
