"""`kiln data inspect` on a file full of edge rows: row numbers, reasons, the receipt, and row text
shown as data (kiln-contract §3.1-§3.5)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from kiln.cli.main import cli
from kiln_train.data.chat_template import official_chat_template
from kiln_train.data.ingestion import ingest_jsonl
from kiln_train.data.row_identity import raw_row_sha256

U = {"role": "user", "content": "Hi"}
GOOD = {"messages": [U, {"role": "assistant", "content": "Hello"}]}
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
def model_dir(tmp_path, tokenizer_dir):
    out = tmp_path / "model"
    shutil.copytree(tokenizer_dir, out)
    (out / "chat_template.jinja").write_text(official_chat_template(), encoding="utf-8")
    return out


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
        f"── Invalid training request: SFT row 1 ({raw_row_sha256(BOM_ROW)}) rejected as invalid_json: not valid JSON: "
        "the line starts with a UTF-8 byte-order mark" in result.output
    )
    as_json = inspect(model_dir, edge_file, "--json")
    assert as_json.exit_code == 1
    envelope = json.loads(as_json.output.splitlines()[-1])
    assert envelope["error"]["code"] == "training_invalid_request"
    assert envelope["error"]["message"].startswith("Invalid training request: SFT row 1 (sha256:")


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
