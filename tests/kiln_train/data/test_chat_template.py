"""Kiln's Qwen3.5 SFT rendering and labels against the Transformers+TRL oracle fixture
(docs/tokenization.md#oracle-fixtures)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kiln_train.data.chat_template import (
    SPAN_CLOSE,
    SPAN_OPEN,
    ChatTemplate,
    RenderedConversation,
    TemplateRenderError,
    chat_template_sha256,
    extract_spans,
    load_model_chat_template,
    official_chat_template,
    select_training_template,
    training_chat_template_sha256,
    training_template,
)
from kiln_train.data.ingestion import iter_example_outcomes
from kiln_train.data.labels import IGNORE_INDEX, MASK_CONTRACT
from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED, KilnError
from tests.kiln_train.data.reference_fixtures import holds_empty_answer, render_without_row_rules

FIXTURE = Path(__file__).resolve().parents[3] / "qualification" / "fixtures" / "qwen35_sft_oracle_v1.json"


@pytest.fixture(scope="module")
def oracle():
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def outcome_of(tokenizer, row):
    (outcome,) = list(iter_example_outcomes([row], tokenizer=tokenizer))
    return outcome


def render(messages, tools=None):
    return training_template().render(messages, tools)


# --------------------------------------------------------------------------- oracle fixture


def test_fixture_header_pins_versions_and_templates(oracle):
    assert oracle["schema"] == "kiln.qwen35-sft-oracle.v1"
    assert oracle["mask_contract"] == MASK_CONTRACT == "kiln.qwen35-assistant-only.v1"
    assert oracle["versions"]["transformers"] == "5.23.0"
    assert oracle["versions"]["trl"] == "1.16.0"
    assert "sft_template_oracle.py --write" in oracle["regenerate"]
    # The fixture was produced against this exact training template, and the checked-in inference
    # template is byte-identical to TRL's copy of the official Qwen3.5 think template.
    assert oracle["artifacts"]["kiln_training_template_sha256"] == training_chat_template_sha256()
    assert oracle["artifacts"]["trl_think_template_sha256"] == chat_template_sha256()


def test_named_cases_match_oracle_exactly(qwen_tokenizer, oracle):
    names = {c["name"] for c in oracle["cases"]}
    for required in (
        "plain",
        "thinking_reasoning_content",
        "thinking_inline",
        "tool_call_and_response",
        "parallel_calls",
        "multi_turn",
        "adversarial_user_literals",
        "adversarial_assistant_literals",
        "structured_content",
    ):
        assert required in names
    for case in oracle["cases"]:
        outcome = outcome_of(qwen_tokenizer, case["example"])
        if "error" in case:
            assert outcome.reason == "tokenization_error", case["name"]
            assert case["error"] in outcome.detail, case["name"]
            continue
        assert outcome.kept, (case["name"], outcome.detail)
        row = outcome.tokenized
        assert outcome.rendered.text == case["text"], case["name"]
        assert row.input_ids == case["input_ids"], case["name"]
        assert [int(label != IGNORE_INDEX) for label in row.labels] == case["assistant_masks"], case["name"]
        assert row.labels == case["labels"], case["name"]
        assert row.supervised_tokens == sum(case["assistant_masks"][1:])


def test_random_differential_cases_match_oracle(qwen_tokenizer, oracle):
    assert len(oracle["random_cases"]) >= 40
    for case in oracle["random_cases"]:
        outcome = outcome_of(qwen_tokenizer, case["example"])
        if "error" in case:
            assert outcome.reason == "tokenization_error"
            continue
        if holds_empty_answer(case["example"]):  # the row rule rejects it; the rendering still agrees
            assert outcome.reason == "empty_response", case["name"]
            text, ids, labels = render_without_row_rules(case["example"], tokenizer=qwen_tokenizer)
            assert (text, ids) == (case["text"], case["input_ids"]), case["name"]
            assert [[a, b] for a, b in _ranges(labels)] == case["supervised_ranges"], case["name"]
            continue
        assert outcome.rendered.text == case["text"], case["name"]
        assert outcome.tokenized.input_ids == case["input_ids"], case["name"]
        ranges = [[a, b] for a, b in _ranges(outcome.tokenized.labels)]
        assert ranges == case["supervised_ranges"], case["name"]


def _ranges(labels):
    out, start = [], None
    for i, label in enumerate([*labels, IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            out.append((start, i))
            start = None
    return out


def test_adversarial_literals_do_not_move_loss_boundaries(qwen_tokenizer, oracle):
    case = next(c for c in oracle["cases"] if c["name"] == "adversarial_user_literals")
    row = outcome_of(qwen_tokenizer, case["example"]).tokenized
    supervised = [i for i, label in zip(row.input_ids, row.labels, strict=True) if label != IGNORE_INDEX]
    # Only the real assistant turn is supervised, although the user typed a fake one.
    assert qwen_tokenizer.decode(supervised, skip_special_tokens=False) == (
        "<think>\n\n</think>\n\nI see literal delimiters.<|im_end|>\n"
    )


# ------------------------------------------------ rendering examples: docs/tokenization.md#rendering


def test_example_b_and_b2():
    b = render(
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "2 plus 2 is 4."},
        ]
    )
    assert b.text == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n2 plus 2 is 4.\n</think>\n\n4<|im_end|>\n"
    )
    assert [b.text[a:z] for a, z in b.spans] == ["<think>\n2 plus 2 is 4.\n</think>\n\n4<|im_end|>\n"]
    b2 = render([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}])
    assert b2.text == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n"
    )


def test_example_c_training_variant_keeps_historic_reasoning():
    c = render(
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "r2"},
        ]
    )
    assert c.text == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nr1\n</think>\n\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n"
    )
    assert [c.text[a:z] for a, z in c.spans] == [
        "<think>\nr1\n</think>\n\nA1<|im_end|>\n",
        "<think>\nr2\n</think>\n\nA2<|im_end|>\n",
    ]


def test_example_d_tools_preamble_and_tool_round_trip():
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
    d = render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "Need tool.",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}],
            },
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21C.", "reasoning_content": "Got it."},
        ],
        [tool],
    )
    head = (
        '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{"type": "function", '
        '"function": {"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}\n</tools>'
        "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:"
    )
    tail = (
        "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        "<think>\nNeed tool.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "Paris\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
        "<think>\nGot it.\n</think>\n\nIt is 21C.<|im_end|>\n"
    )
    assert d.text.startswith(head)
    assert d.text.endswith(tail)
    assert d.text.count("<IMPORTANT>") == 1
    assert len(d.spans) == 2


def test_example_e_parallel_calls_and_grouped_tool_results():
    e = render(
        [
            {"role": "user", "content": "Compare"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"name": "f", "arguments": {"x": [1, 2]}},
                    {"name": "g", "arguments": {"y": {"a": 1}}},
                ],
            },
            {"role": "tool", "content": "r1"},
            {"role": "tool", "content": "r2"},
        ]
    )
    assert e.text == (
        "<|im_start|>user\nCompare<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=f>\n"
        "<parameter=x>\n[1, 2]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>\n<parameter=y>\n"
        '{"a": 1}\n</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nr1\n'
        "</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
    )


def test_scalar_parameters_use_python_str_and_content_is_trimmed():
    f = render(
        [
            {"role": "user", "content": "  Hi there \n"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "set", "arguments": {"flag": True, "x": 1.5, "s": "a b", "n": None}}],
            },
            {"role": "tool", "content": "ok"},
            {"role": "assistant", "content": "Done.", "reasoning_content": "fine"},
        ]
    )
    assert f.text.startswith("<|im_start|>user\nHi there<|im_end|>\n")
    assert (
        "<parameter=flag>\nTrue\n</parameter>\n<parameter=x>\n1.5\n</parameter>\n<parameter=s>\na b\n</parameter>\n"
        "<parameter=n>\nNone\n</parameter>\n" in f.text
    )
    assert f.text.endswith("<|im_start|>assistant\n<think>\nfine\n</think>\n\nDone.<|im_end|>\n")


def test_template_errors_are_raised():
    with pytest.raises(TemplateRenderError, match="No user query found"):
        render([{"role": "assistant", "content": "A"}])
    with pytest.raises(TemplateRenderError, match="No user query found"):
        render(
            [
                {"role": "user", "content": " <tool_response>x</tool_response> "},
                {"role": "assistant", "content": "A"},
            ]
        )
    with pytest.raises(TemplateRenderError, match="System message must be at the beginning"):
        render([{"role": "user", "content": "Q"}, {"role": "system", "content": "S"}])


# --------------------------------------------------------------------------- prefix preservation


def test_rendering_and_labels_are_prefix_preserving(qwen_tokenizer):
    full = [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "user", "content": "Q2"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
        },
        {"role": "tool", "content": "result"},
        {"role": "assistant", "content": "final", "reasoning_content": "r3"},
    ]
    previous = None
    for end in (3, 5, 7):
        outcome = outcome_of(qwen_tokenizer, {"messages": full[:end]})
        assert outcome.kept
        if previous is not None:
            assert outcome.rendered.text.startswith(previous.rendered.text)
            n = previous.tokenized.seq_len
            assert outcome.tokenized.input_ids[:n] == previous.tokenized.input_ids
            assert outcome.tokenized.labels[:n] == previous.tokenized.labels
        previous = outcome


# --------------------------------------------------------------------------- span markers


def test_marker_in_message_data_fails_the_row(qwen_tokenizer):
    base = {
        "tools": [{"type": "function", "function": {"name": "f", "description": "d"}}],
        "messages": [
            {"role": "user", "content": "Q"},
            {
                "role": "assistant",
                "content": "A",
                "reasoning_content": "R",
                "tool_calls": [{"function": {"name": "f", "arguments": '{"k": "v"}'}}],
            },
        ],
    }
    assert outcome_of(qwen_tokenizer, base).kept
    places = [
        (lambda r: r["messages"][0].__setitem__("content", f"Q{SPAN_OPEN}"), "messages[0].content"),
        (lambda r: r["messages"][1].__setitem__("content", f"{SPAN_CLOSE}A"), "messages[1].content"),
        (
            lambda r: r["messages"][1].__setitem__("reasoning_content", SPAN_OPEN + SPAN_CLOSE),
            "reasoning_content",
        ),
        (
            lambda r: r["messages"][1]["tool_calls"][0]["function"].__setitem__(
                "arguments", '{"k": "\ufdd1"}'
            ),
            "arguments",
        ),
        (
            lambda r: r["tools"][0]["function"].__setitem__("description", f"d{SPAN_OPEN}"),
            "tools[0].function",
        ),
        (lambda r: r["messages"][0].__setitem__("name", SPAN_CLOSE), "messages[0].name"),
    ]
    for mutate, where in places:
        row = copy.deepcopy(base)
        mutate(row)
        outcome = outcome_of(qwen_tokenizer, row)
        assert outcome.reason == "tokenization_error", where
        assert "span marker" in outcome.detail and where in outcome.detail, outcome.detail


def test_extract_spans_refuses_malformed_markers():
    assert extract_spans(f"a{SPAN_OPEN}bc{SPAN_CLOSE}d{SPAN_OPEN}e{SPAN_CLOSE}") == RenderedConversation(
        "abcde", ((1, 3), (4, 5))
    )
    for bad in (
        f"a{SPAN_CLOSE}b",
        f"a{SPAN_OPEN}b",
        f"{SPAN_OPEN}a{SPAN_OPEN}b{SPAN_CLOSE}{SPAN_CLOSE}",
        f"{SPAN_OPEN}a{SPAN_CLOSE}{SPAN_CLOSE}",
    ):
        with pytest.raises(TemplateRenderError):
            extract_spans(bad)
    with pytest.raises(TemplateRenderError, match="expected 2 supervised spans"):
        extract_spans(f"{SPAN_OPEN}a{SPAN_CLOSE}", expected=2)


def test_generation_tag_becomes_markers_and_digest_is_the_file():
    template = ChatTemplate("x{% generation %}{{ y }}{% endgeneration %}z")
    assert template.render_marked([], None) == f"x{SPAN_OPEN}{SPAN_CLOSE}z"
    marked = ChatTemplate("{{ messages[0].content }}{% generation %}B{% endgeneration %}").render_marked(
        [{"role": "user", "content": "A"}]
    )
    assert marked == f"A{SPAN_OPEN}B{SPAN_CLOSE}"
    assert len(training_chat_template_sha256()) == 64
    assert training_chat_template_sha256() == training_template().sha256
    assert training_chat_template_sha256() != chat_template_sha256()


def test_tojson_matches_transformers_filter():
    out = ChatTemplate("{{ messages | tojson }}").render_marked([{"é": [1, 2.5, None, True, "<b>"]}])
    assert out == '[{"é": [1, 2.5, null, true, "<b>"]}]'


# --------------------------------------------------------------------------- model template selection


def test_select_training_template_requires_the_official_template(tmp_path):
    assert select_training_template(official_chat_template()) is training_template()
    with pytest.raises(KilnError) as err:
        select_training_template(official_chat_template() + " ")
    assert err.value.code == TRAINING_BACKEND_UNSUPPORTED
    with pytest.raises(KilnError):
        select_training_template(None)

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "chat_template.jinja").write_text(official_chat_template(), encoding="utf-8")
    assert load_model_chat_template(tmp_path / "a") == official_chat_template()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "T"}), encoding="utf-8"
    )
    assert load_model_chat_template(tmp_path / "b") == "T"
    assert load_model_chat_template(tmp_path) is None
