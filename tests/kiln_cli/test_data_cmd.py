"""`kiln data inspect` through click's CliRunner: the demo data set, fail and skip policies, JSON
output equal to ingestion, chat-template sources, the tokenizer cache, and a file full of edge rows
(row numbers, reasons, the receipt, and row text shown as data)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import kiln_train.data.packaged_tokenizer as packaged_tokenizer
from kiln_cli.main import cli
from kiln_train.data.chat_template import official_chat_template
from kiln_train.data.ingestion import ingest_jsonl
from kiln_train.data.row_identity import raw_row_sha256

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.jsonl"
GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
BAD_ROLE = {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}


@pytest.fixture()
def runner():
    return CliRunner()


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "\n".join([json.dumps(GOOD), "", json.dumps(BAD_ROLE), "{not json", json.dumps(GOOD)]) + "\n",
        encoding="utf-8",
    )
    return path


@pytest.fixture()
def model_dir(tmp_path, tokenizer_dir):
    out = tmp_path / "model"
    shutil.copytree(tokenizer_dir, out)
    (out / "chat_template.jinja").write_text(official_chat_template(), encoding="utf-8")
    return out


def test_inspect_demo_dataset_all_rows_kept(runner, model_dir):
    result = runner.invoke(cli, ["data", "inspect", str(DEMO), "--model", str(model_dir)])
    assert result.exit_code == 0, result.output
    assert result.output.count("── row ") == 30
    assert "30 row(s) read, 30 kept, 0 rejected (policy fail)" in result.output
    # supervised spans are bracketed when stdout is not a terminal
    assert "⟦<think>\n\n</think>\n\nThe capital of Australia is Canberra.<|im_end|>\n⟧" in result.output
    assert "<|im_start|>assistant\n⟦" in result.output


def test_inspect_fail_policy_shows_every_row_and_exits_nonzero(runner, model_dir, data_file):
    result = runner.invoke(cli, ["data", "inspect", str(data_file), "--model", str(model_dir)])
    assert result.exit_code == 1
    assert result.output.count("── row ") == 4
    assert "REJECTED invalid_role: messages[1].role is 'bot'" in result.output
    assert "REJECTED invalid_json" in result.output
    assert "SFT row 2 (sha256:" in result.output and "rejected as invalid_role" in result.output


def test_inspect_json_matches_ingestion(runner, model_dir, data_file, qwen_tokenizer):
    result = runner.invoke(
        cli, ["data", "inspect", str(data_file), "--model", str(model_dir), "--policy", "skip", "--json"]
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    rows, receipt = lines[:-1], lines[-1]
    assert [r["row_index"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("rejection") for r in rows] == [None, "invalid_role", "invalid_json", None]
    expected = ingest_jsonl(data_file, tokenizer=qwen_tokenizer, policy="skip")
    assert receipt == expected.receipt
    assert rows[0]["input_ids"] == expected.rows[0].input_ids
    assert rows[0]["labels"] == expected.rows[0].labels
    assert rows[3]["row_sha256"] == expected.rows[1].row_sha256
    assert receipt["rejected_rows"] == [
        {
            "row_index": 2,
            "row_sha256": rows[1]["row_sha256"],
            "reason": "invalid_role",
            "line": rows[1]["line"],
        },
        {
            "row_index": 3,
            "row_sha256": rows[2]["row_sha256"],
            "reason": "invalid_json",
            "line": rows[2]["line"],
        },
    ]
    assert [r["line"] for r in rows] == sorted({r["line"] for r in rows})  # physical lines, ascending
    assert rows[0]["format"] == "messages" and rows[0]["conversion"] == "messages as given"


def test_inspect_json_fail_policy_ends_with_error_envelope(runner, model_dir, data_file):
    result = runner.invoke(cli, ["data", "inspect", str(data_file), "--model", str(model_dir), "--json"])
    assert result.exit_code == 1
    last = json.loads(result.output.splitlines()[-1])
    assert last["error"]["code"] == "training_invalid_request"
    assert "SFT row 2 (" in last["error"]["message"]


def test_inspect_refuses_a_foreign_chat_template(runner, model_dir):
    (model_dir / "chat_template.jinja").write_text("{{ messages }}", encoding="utf-8")
    result = runner.invoke(cli, ["data", "inspect", str(DEMO), "--model", str(model_dir)])
    assert result.exit_code == 2
    assert "not an official Qwen3.5 template" in result.output


@pytest.mark.parametrize(
    "write, needle",
    [
        (lambda d: (d / "chat_template.jinja").write_bytes(b"\xff{{ x }}"), "chat_template.jinja in"),
        (
            lambda d: (
                (d / "chat_template.jinja").unlink(),
                (d / "tokenizer_config.json").write_text('{"chat_template": 5}', encoding="utf-8"),
            ),
            "field 'chat_template' is a number",
        ),
    ],
)
def test_inspect_names_an_unreadable_template_source(runner, model_dir, write, needle):
    write(model_dir)
    result = runner.invoke(cli, ["data", "inspect", str(DEMO), "--model", str(model_dir)])
    assert result.exit_code == 2
    assert needle in result.output and "Traceback" not in result.output


def test_inspect_without_model_uses_the_tokenizer_cache(
    runner, tmp_path, monkeypatch, qwen_tokenizer, data_file
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built = []
    monkeypatch.setattr(packaged_tokenizer, "build_tokenizer", lambda: built.append(1) or qwen_tokenizer)
    first = runner.invoke(cli, ["data", "inspect", str(data_file), "--policy", "skip", "--json"])
    assert first.exit_code == 0, first.output
    cached = tmp_path / "cache" / "kiln" / "tokenizer" / packaged_tokenizer.cache_key() / "tokenizer.json"
    assert cached.is_file() and built == [1]
    second = runner.invoke(cli, ["data", "inspect", str(data_file), "--policy", "skip", "--json"])
    assert second.exit_code == 0
    assert built == [1]  # loaded from the cache, not rebuilt
    assert second.output == first.output


# ----- a file full of edge rows ---------------------------------------------------------------

U = {"role": "user", "content": "Hi"}
BOM_ROW = b"\xef\xbb\xbf" + json.dumps(GOOD).encode()
ROWS = [
    BOM_ROW,  # 1 invalid_json (byte-order mark)
    json.dumps(GOOD).encode() + b"\r",  # 2 kept (CRLF line ending)
    b"   \t  \r",  # blank: not a row
    b'{"messages": "\xff\xfe"}',  # 3 invalid_json (not UTF-8)
    b"[1, 2]",  # 4 invalid_json (not an object)
    json.dumps({"messages": [{"role": "tool", "content": "r"}, U, GOOD["messages"][1]]}).encode(),  # 5
    json.dumps(
        {
            "messages": [
                {"role": "user", "content": "\x1b[2J\x1b[31mred\u202e"},
                {"role": "assistant", "content": "a\r\nb"},
            ]
        }
    ).encode(),  # 6 kept, hostile to terminals
    json.dumps(
        {"tools": [{"a\u2028b\ufdd0": 1}], "messages": GOOD["messages"]}, ensure_ascii=False
    ).encode(),  # 7
    b'"just a string"',  # 8 invalid_json
    json.dumps(GOOD).encode(),  # 9 kept, no trailing newline
]
REJECTED = {
    1: "invalid_json",
    3: "invalid_json",
    4: "invalid_json",
    5: "tokenization_error",
    7: "tokenization_error",
    8: "invalid_json",
}


@pytest.fixture()
def edge_file(tmp_path):
    path = tmp_path / "edges.jsonl"
    path.write_bytes(b"\r\n".join(ROWS))
    return path


def inspect(model_dir, path, *args):
    return CliRunner().invoke(cli, ["data", "inspect", str(path), "--model", str(model_dir), *args])


def test_json_skip_rows_reasons_and_receipt_add_up(model_dir, edge_file, qwen_tokenizer):
    result = inspect(model_dir, edge_file, "--policy", "skip", "--json")
    assert result.exit_code == 0, result.output
    assert result.output.isascii()  # JSON Lines safe: no raw U+2028 can split a line
    lines = result.output.split("\n")
    assert lines[-1] == ""
    objects = [json.loads(line) for line in lines[:-1]]
    rows, receipt = objects[:-1], objects[-1]
    assert [r["row_index"] for r in rows] == list(range(1, 10))
    assert {r["row_index"]: r["rejection"] for r in rows if "rejection" in r} == REJECTED
    assert rows[0]["row_sha256"] == raw_row_sha256(BOM_ROW)
    assert "byte-order mark" in rows[0]["detail"]
    assert "invalid UTF-8 byte 0xff" in rows[2]["detail"]
    assert "messages[0] is a tool result at the start" in rows[4]["detail"]
    assert "tools[0].a\u2028b\ufdd0 contains an internal span marker" in rows[6]["detail"]
    assert receipt["rows_read"] == 9
    assert receipt["rows_kept"] + receipt["rows_rejected"] == receipt["rows_read"]
    assert (receipt["rows_kept"], receipt["rows_rejected"]) == (3, 6)
    assert [r["row_index"] for r in receipt["rejected_rows"]] == sorted(REJECTED)
    assert [r["reason"] for r in receipt["rejected_rows"]] == [REJECTED[i] for i in sorted(REJECTED)]
    assert receipt["kept_row_hashes"] == [r["row_sha256"] for r in rows if "rejection" not in r]
    assert receipt == ingest_jsonl(edge_file, tokenizer=qwen_tokenizer, policy="skip").receipt


def test_fail_policy_names_the_first_bad_row(model_dir, edge_file):
    result = inspect(model_dir, edge_file)
    assert result.exit_code == 1
    assert result.output.count("── row ") == 9  # every row is still shown
    assert (
        f"── Invalid training request: line 1: SFT row 1 ({raw_row_sha256(BOM_ROW)}) rejected as invalid_json: "
        "not valid JSON: "
        "the line starts with a UTF-8 byte-order mark" in result.output
    )
    as_json = inspect(model_dir, edge_file, "--json")
    assert as_json.exit_code == 1
    envelope = json.loads(as_json.output.splitlines()[-1])
    assert envelope["error"]["code"] == "training_invalid_request"
    assert envelope["error"]["message"].startswith("Invalid training request: line 1: SFT row 1 (sha256:")


def test_row_text_is_shown_as_data_not_terminal_input(model_dir, edge_file):
    result = inspect(model_dir, edge_file, "--policy", "skip")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out and "\u2028" not in out
    assert "<|im_start|>user\n\\x1b[2J\\x1b[31mred\\u202e<|im_end|>\n" in out
    assert "⟦<think>\n\n</think>\n\na\\r\nb<|im_end|>\n⟧" in out
    assert "REJECTED tokenization_error: tools[0].a\\u2028b\\ufdd0 contains an internal span marker" in out
    assert "── 9 row(s) read, 3 kept, 6 rejected (policy skip)" in out


def test_skip_policy_with_no_row_left_exits_nonzero(model_dir, tmp_path):
    path = tmp_path / "none.jsonl"
    path.write_bytes(b"\xef\xbb\xbf\n" + json.dumps({"messages": [U]}).encode())
    result = inspect(model_dir, path, "--policy", "skip")
    assert result.exit_code == 1
    assert "no trainable rows: read 2 row(s), rejected 2" in result.output


def test_an_unreadable_file_is_a_clear_error_not_a_traceback(model_dir):
    result = inspect(model_dir, "/proc/self/mem")  # exists, but reading it from offset 0 fails (EIO)
    assert result.exit_code == 2
    assert "kiln: cannot read /proc/self/mem: Input/output error" in result.output
    assert "Traceback" not in result.output


INSTRUCTION_FILE = Path(__file__).resolve().parents[2] / "examples" / "instruction.jsonl"


def test_inspect_shows_each_rows_line_format_and_conversion(model_dir, tmp_path):
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n" + INSTRUCTION_FILE.read_text())
    result = inspect(model_dir, data, "--policy", "skip")
    assert result.exit_code == 0, result.output[-2000:]
    assert "── row 1  line 2  instruction  sha256:" in result.output
    assert "   converted: user = instruction, assistant = output" in result.output
    assert "converted: system, user = instruction, assistant = output" in result.output
    assert "converted: 1 history pair(s), user = instruction, assistant = output" in result.output
    assert "── row 9  line 10  prompt_completion  sha256:" in result.output
    assert "── row 10  line 11  text_prompt_completion  sha256:" in result.output
    assert "converted: raw text: prompt + completion + EOS, no chat template" in result.output


def test_inspect_applies_the_length_rule_it_is_given(model_dir, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(INSTRUCTION_FILE.read_text())
    facts = [json.loads(line) for line in inspect(model_dir, data, "--json").output.splitlines()[:-1]]
    longest = max(f["seq_len"] for f in facts)
    refused = inspect(model_dir, data, "--max-length", str(longest - 1))
    assert refused.exit_code == 1 and "rejected as too_long" in refused.output
    cut = inspect(model_dir, data, "--max-length", str(longest - 1), "--truncation", "right", "--json")
    assert cut.exit_code == 0, cut.output[-2000:]
    *rows, receipt = [json.loads(line) for line in cut.output.splitlines()]
    assert max(r["seq_len"] for r in rows) == longest - 1 and sum(r["dropped_tokens"] for r in rows) >= 1
    assert receipt["row_counts"]["rows_truncated"] == sum(1 for r in rows if r["dropped_tokens"])
