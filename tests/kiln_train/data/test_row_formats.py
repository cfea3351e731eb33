"""Row formats (kiln_train/data/row_formats.py): each format's conversion, its identity, and every
rejection reason with the physical line it is on."""

from __future__ import annotations

import hashlib
import json

import pytest

from kiln_train.data.chat_template import training_template
from kiln_train.data.ingestion import (
    ingest_examples,
    ingest_jsonl,
    iter_example_outcomes,
    iter_jsonl_outcomes,
)
from kiln_train.data.labels import IGNORE_INDEX, label_encoding
from kiln_train.data.tokenizer import IM_END, IM_END_ID
from kiln_train.errors import KilnError
from tests.kiln_train.data.ingestion_support import reject_message

ALPACA = {"instruction": "Translate to French", "input": "good morning", "output": "bonjour"}


def one(tokenizer, row):
    (outcome,) = list(iter_example_outcomes([row], tokenizer=tokenizer))
    return outcome


def rendered(tokenizer, messages, tools=None):
    """(text, ids, labels) of `messages` through the template and the mask, independently of the
    row pipeline."""
    r = training_template().render(messages, tools)
    (enc,) = tokenizer.encode_batch([r.text], add_special_tokens=False)
    return r.text, enc.ids, label_encoding(enc, r.spans).labels


def given_sha(row) -> str:
    canonical = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(b"kiln.sft-parsed-row.v1\0" + canonical.encode()).hexdigest()


# ----- instruction rows ------------------------------------------------------------------------


def test_instruction_row_is_the_conversation_the_issue_describes(qwen_tokenizer):
    out = one(qwen_tokenizer, ALPACA)
    assert out.kept and out.format == "instruction"
    messages = [
        {"role": "user", "content": "Translate to French\ngood morning"},
        {"role": "assistant", "content": "bonjour"},
    ]
    text, ids, labels = rendered(qwen_tokenizer, messages)
    assert out.rendered.text == text
    assert text.startswith(
        "<|im_start|>user\nTranslate to French\ngood morning<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (out.tokenized.input_ids, out.tokenized.labels) == (ids, labels)
    # the same tokens as the messages row it converts to; its identity is the row as given
    twin = one(qwen_tokenizer, {"messages": messages})
    assert twin.tokenized.input_ids == ids and twin.tokenized.labels == labels
    assert out.row_sha256 == given_sha(ALPACA) != twin.row_sha256
    respelled = json.loads(json.dumps(dict(reversed(list(ALPACA.items())))))
    assert one(qwen_tokenizer, respelled).row_sha256 == out.row_sha256


def test_instruction_with_system_history_and_no_input(qwen_tokenizer):
    row = {
        "system": "Be brief.",
        "history": [["2+2?", "4"], ["3+3?", "6"]],
        "instruction": "4+4?",
        "input": "",
        "output": "8",
    }
    out = one(qwen_tokenizer, row)
    assert out.kept, out.detail
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "4+4?"},  # empty input: the instruction alone
        {"role": "assistant", "content": "8"},
    ]
    text, ids, labels = rendered(qwen_tokenizer, messages)
    assert (out.rendered.text, out.tokenized.input_ids, out.tokenized.labels) == (text, ids, labels)
    assert len(out.rendered.spans) == 3  # history answers are supervised like any assistant turn
    assert "2 history pair(s)" in out.conversion


# ----- prompt/completion, conversational -------------------------------------------------------


def test_conversational_prompt_completion_supervises_only_the_completion(qwen_tokenizer):
    prompt = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another?"},
    ]
    completion = [{"role": "assistant", "content": "Blue."}]
    out = one(qwen_tokenizer, {"prompt": prompt, "completion": completion})
    assert out.kept and out.format == "prompt_completion"
    text, ids, all_labels = rendered(qwen_tokenizer, prompt + completion)
    assert (out.rendered.text, out.tokenized.input_ids) == (text, ids)
    labels = out.tokenized.labels
    supervised = qwen_tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])
    assert "Blue." in supervised and "Red." not in supervised
    # the messages row supervises both answers; the completion row exactly the last one
    assert sum(lab != IGNORE_INDEX for lab in labels) < sum(lab != IGNORE_INDEX for lab in all_labels)
    assert labels[-8:] == all_labels[-8:]
    assert "1 assistant turn(s) unsupervised" in out.conversion


# ----- prompt/completion, plain strings --------------------------------------------------------


def test_plain_prompt_completion_is_raw_text_with_one_eos(qwen_tokenizer):
    row = {"prompt": "The capital of France is", "completion": " Paris."}
    out = one(qwen_tokenizer, row)
    assert out.kept and out.format == "text_prompt_completion"
    text = "The capital of France is Paris." + IM_END
    assert out.rendered.text == text and "<|im_start|>" not in text  # no chat template
    (enc,) = qwen_tokenizer.encode_batch([text], add_special_tokens=False)
    ids = out.tokenized.input_ids
    assert ids == enc.ids and ids[-1] == IM_END_ID and ids.count(IM_END_ID) == 1
    (prompt_enc,) = qwen_tokenizer.encode_batch([row["prompt"]], add_special_tokens=False)
    n = len(prompt_enc.ids)  # the boundary falls on a token boundary here
    assert out.tokenized.labels == [IGNORE_INDEX] * n + ids[n:]
    # a completion that already ends with the EOS gets no second one
    again = one(qwen_tokenizer, {"prompt": row["prompt"], "completion": " Paris." + IM_END})
    assert again.tokenized.input_ids == ids and again.row_sha256 != out.row_sha256


def test_plain_prompt_completion_masks_a_token_that_straddles_the_boundary(qwen_tokenizer):
    row = {"prompt": "The answer is for", "completion": "ty-two"}
    out = one(qwen_tokenizer, row)
    assert out.kept, out.detail
    (enc,) = qwen_tokenizer.encode_batch(["The answer is forty-two" + IM_END], add_special_tokens=False)
    boundary = len(row["prompt"])
    straddling = [i for i, (s, e) in enumerate(enc.offsets) if s < boundary < e]
    assert straddling, "the example must put a token across the boundary"
    (k,) = straddling
    assert out.tokenized.labels[k] == IGNORE_INDEX  # " forty" is partly prompt: not supervised
    assert out.tokenized.labels[k + 1 :] == enc.ids[k + 1 :]
    assert all(label == IGNORE_INDEX for label in out.tokenized.labels[:k])


def test_plain_completion_swallowed_by_the_prompt_token_is_empty_output(qwen_tokenizer):
    # "Hell" + "o" tokenizes as one token "Hello": the completion has no token of its own
    (enc,) = qwen_tokenizer.encode_batch(["Hello" + IM_END], add_special_tokens=False)
    assert len(enc.ids) == 2
    out = one(qwen_tokenizer, {"prompt": "Hell", "completion": "o"})
    assert (out.kept, out.reason) == (False, "empty_output")
    assert "no token of its own" in out.detail
    assert one(qwen_tokenizer, {"prompt": "Hello", "completion": "o"}).kept  # "o" is its own token


# ----- rejections, each with its line ----------------------------------------------------------

GOOD = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
TOOL_ONLY = {
    "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
}
BAD_ROWS = [
    (
        {"messages": GOOD["messages"], "instruction": "x", "output": "y"},
        "ambiguous_format",
        "more than one format",
    ),
    ({"instruction": "x", "output": "y", "source": "web"}, "unknown_field", "'source' beside"),
    ({"instruction": "x", "output": ""}, "empty_output", "output is empty"),
    ({"instruction": "x"}, "empty_output", "output is missing"),
    ({"prompt": "x", "completion": ""}, "empty_output", "completion is empty"),
    ({"prompt": [{"role": "user", "content": "x"}], "completion": []}, "empty_output", "empty list"),
    ({"instruction": 5, "output": "y"}, "invalid_field_type", "instruction must be a string, got number"),
    ({"completion": [{"role": "assistant", "content": "y"}]}, "invalid_field_type", "prompt is missing"),
    ({"prompt": "x"}, "empty_output", "completion is missing"),
    ({"instruction": "x", "output": "y", "history": [["a"]]}, "invalid_field_type", "history[0]"),
    (
        {"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]},
        "invalid_field_type",
        "completion",
    ),
    (
        {"prompt": [{"role": "user", "content": 3}], "completion": [{"role": "assistant", "content": "y"}]},
        "invalid_field_type",
        "prompt[0].content",
    ),
    (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        "unsupported_format",
        "`conversations` key: ShareGPT",
    ),
    (
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": " \n"}]},
        "empty_response",
        "messages[1] has empty content, no tool calls and no reasoning",
    ),
    (
        {"history": [["q", ""]], "instruction": "x", "output": "y"},
        "empty_response",
        "history[0] has an empty",
    ),
    (
        {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": ""}]},
        "empty_response",
        "completion[0] has empty content",
    ),
]


@pytest.mark.parametrize(
    ("row", "reason", "detail"), BAD_ROWS, ids=[f"{r}-{i}" for i, (_, r, _) in enumerate(BAD_ROWS)]
)
def test_every_rejection_has_its_reason_and_line(qwen_tokenizer, tmp_path, row, reason, detail):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([json.dumps(GOOD), "", "  ", json.dumps(row), json.dumps(ALPACA), ""]) + "\n")
    with pytest.raises(KilnError) as err:
        ingest_jsonl(path, tokenizer=qwen_tokenizer)
    message = reject_message(err.value)
    assert message.startswith("Invalid training request: line 4: SFT row 2 (sha256:"), message
    assert f"rejected as {reason}: " in message and detail in message, message

    result = ingest_jsonl(path, tokenizer=qwen_tokenizer, policy="skip")
    (entry,) = result.receipt["rejected_rows"]
    assert (entry["row_index"], entry["reason"], entry["line"]) == (2, reason, 4)
    counts = result.receipt["row_counts"]
    assert counts["blank_lines"] == 3 and counts["rows_skipped"] == 1
    assert counts["rows_per_format"] == {"instruction": 1, "messages": 1}

    # inline, the same row is a row rejection under the policy too (no line: it is not in a file)
    inline = list(iter_example_outcomes([GOOD, row], tokenizer=qwen_tokenizer))
    assert (inline[1].kept, inline[1].reason, inline[1].line) == (False, reason, None)
    assert inline[1].row_sha256 == entry["row_sha256"]


def test_a_messages_row_with_a_prompt_column_stays_a_messages_row(qwen_tokenizer):
    """UltraChat-style rows carry `prompt` and `prompt_id` beside `messages`: metadata, ignored as
    every other key of a `messages` row; only a `completion` makes the line ambiguous."""
    ultrachat = {"prompt": "Q", "prompt_id": "abc", "messages": GOOD["messages"]}
    out = one(qwen_tokenizer, ultrachat)
    assert out.kept and out.format == "messages"
    assert out.row_sha256 == one(qwen_tokenizer, GOOD).row_sha256  # parsed identity, as before formats
    both = one(qwen_tokenizer, {**ultrachat, "completion": "A"})
    assert (both.kept, both.reason) == (False, "ambiguous_format")


def test_tool_call_only_assistant_turn_stays_valid(qwen_tokenizer):
    assert one(qwen_tokenizer, TOOL_ONLY).kept
    reasoning_only = {
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "", "reasoning_content": "hm"},
        ]
    }
    assert one(qwen_tokenizer, reasoning_only).kept


def test_mixed_file_counts_rows_per_format_and_keeps_order(qwen_tokenizer, tmp_path):
    rows = [
        GOOD,
        ALPACA,
        {"prompt": "1+1=", "completion": "2"},
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "completion": [{"role": "assistant", "content": "hey"}],
        },
        TOOL_ONLY,
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n\n".join(json.dumps(r) for r in rows) + "\n\n")
    stream = iter_jsonl_outcomes(path, tokenizer=qwen_tokenizer)
    outcomes = list(stream)
    assert [o.line for o in outcomes] == [1, 3, 5, 7, 9]
    assert [o.format for o in outcomes] == [
        "messages",
        "instruction",
        "text_prompt_completion",
        "prompt_completion",
        "messages",
    ]
    assert stream.blank_lines == 5
    receipt = ingest_jsonl(path, tokenizer=qwen_tokenizer).receipt
    assert receipt["row_counts"] == {
        "blank_lines": 5,
        "rows_per_format": {
            "instruction": 1,
            "messages": 2,
            "prompt_completion": 1,
            "text_prompt_completion": 1,
        },
        "rows_skipped": 0,
        "rows_truncated": 0,
        "tokens_dropped": 0,
    }
    inline = ingest_examples(rows, tokenizer=qwen_tokenizer)
    assert inline.receipt["kept_row_hashes"] == receipt["kept_row_hashes"]
    assert inline.receipt["row_counts"]["blank_lines"] == 0
