"""Refusals a newcomer meets from the CLI: every rejected row of a --data file (bounded, with a
count of the rest), an unknown config field answered with the nearest real one, and a wrongly
shaped optimizer answered with its accepted forms."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from kiln_cli.rejected_rows import SHOWN
from tests.api.conftest import example
from tests.kiln_cli.api_server import http_json, write_jsonl

NO_ANSWER = {"messages": [{"role": "user", "content": "a question nobody answers"}]}


def test_every_rejected_row_of_the_file_is_listed_with_its_line(kiln, server, tmp_path):
    rows = [example(1), {"messages": []}, example(2), NO_ANSWER, {"messages": []}]
    data = write_jsonl(tmp_path / "d.jsonl", rows, blank_lines=True)  # row n is line 2n - 1
    jobs_before = http_json(server, "GET", "/v1/train/status")
    code, out, err = kiln("train", "sft", "--data", str(data), "--no-wait")
    assert code == 1 and out == ""
    assert "SFT row 2 (" in err and "rejected as empty_messages" in err  # the server's first refusal
    assert f"  note: 3 rows of {data} are rejected (the server stops at the first); all of them:" in err
    listed = [line for line in err.splitlines() if line.startswith("  note: line ")]
    assert [line.split(":")[1].strip() for line in listed] == [
        "line 3 (row 2)",
        "line 7 (row 4)",
        "line 9 (row 5)",
    ]
    assert listed[0].startswith("  note: line 3 (row 2): empty_messages: ")
    assert listed[1].startswith("  note: line 7 (row 4): ") and "empty_messages" not in listed[1]
    assert "more (kiln data inspect" not in err
    assert http_json(server, "GET", "/v1/train/status") == jobs_before


def test_the_list_is_bounded_with_a_count_of_the_rest(kiln, server, tmp_path):
    rows = [example(1)] + [{"messages": []}] * (SHOWN + 7)
    data = write_jsonl(tmp_path / "many.jsonl", rows)
    code, _out, err = kiln("train", "sft", "--data", str(data), "--dry-run")
    assert code == 1
    assert f"  note: {SHOWN + 7} rows of {data} are rejected" in err
    listed = [line for line in err.splitlines() if line.startswith("  note: line ")]
    assert len(listed) == SHOWN and listed[0].startswith("  note: line 2 (row 2): empty_messages")
    assert f"  note: ... and 7 more (kiln data inspect {data} shows every row)" in err


def test_a_single_bad_row_is_named_once(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "one.jsonl", [example(1), {"messages": []}])
    code, _out, err = kiln("train", "sft", "--data", str(data), "--no-wait")
    assert code == 1 and "rejected as empty_messages" in err
    assert "are rejected (the server stops at the first)" not in err


def post_refusal(server, body: dict) -> dict:
    request = urllib.request.Request(
        server.url + "/v1/train/sft",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as exc:
        assert exc.code == 400
        return json.loads(exc.read())["error"]
    raise AssertionError("the request was admitted")


def test_the_api_names_the_nearest_field_and_the_optimizer_forms(server):
    rows = [example(1)]
    error = post_refusal(server, {"examples": rows, "config": {"epoch": 2}})
    assert error["code"] == "training_invalid_request"
    assert error["message"].endswith(
        "config.epoch: unknown field (not part of the native_online_lora_v1 contract); did you mean `epochs`?"
    )
    error = post_refusal(server, {"examples": rows, "config": {"optimizer": "adamw"}})
    assert 'config.optimizer: must be an object with a "kind": ' in error["message"]
    assert error["message"].endswith('did you mean {"kind": "adam_w"}?')
    assert "valid dictionary" not in error["message"]


def test_a_rank_alone_that_breaks_the_scale_limit_says_why(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(1)])
    code, _out, err = kiln("train", "sft", "--data", str(data), "--rank", "4", "--no-wait")
    assert code == 1 and "unsafe LoRA scaling" in err
    assert (
        "  note: --rank 4 without --alpha keeps the server's default lora_alpha; pass --alpha 8 "
        "(2 x rank, the usual choice) or --allow-high-lora-scale"
    ) in err
    code, _out, err = kiln("train", "sft", "--data", str(data), "--rank", "4", "--alpha", "40", "--no-wait")
    assert code == 1 and "unsafe LoRA scaling" in err and "without --alpha" not in err  # alpha was chosen
