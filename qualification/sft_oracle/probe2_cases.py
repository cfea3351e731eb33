"""The corner-case fixture's named rows and edge rows.

`probe2_named` and `probe2_tools_rows` are rows Kiln must render exactly as TRL does; `probe2_edges`
are rows Kiln refuses although TRL renders them (or both refuse), each with the outcome and why.
The order of each list is the order of the fixture.
"""

from __future__ import annotations

import copy
import json

# Shared by the named rows below; `probe2_named` returns a deep copy, so callers get fresh rows.
_Q = {"role": "user", "content": "Q"}
_A = {"role": "assistant", "content": "A"}
_RESULT = {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "r"}


def _calling(arguments, content=None) -> dict:
    """An assistant turn with one call of `f`; `...` leaves the arguments out."""
    call = {"id": "c1", "type": "function", "function": {"name": "f"}}
    if arguments is not ...:
        call["function"]["arguments"] = arguments
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def _assistant(content, **extra) -> dict:
    return {"role": "assistant", "content": content, **extra}


def probe2_named() -> list[tuple[str, list[dict]]]:
    """Hand-written rows (their messages) for the corners, all of which Kiln must render as TRL does."""
    rows = _reasoning_rows() + _turn_order_rows() + _argument_rows() + _ignored_field_rows() + _content_rows()
    return copy.deepcopy(rows)


def _reasoning_rows() -> list[tuple[str, list[dict]]]:
    """Inline <think> next to reasoning fields, lone think tags, whitespace around every part."""
    return [
        (
            "think_in_content_and_reasoning_content",
            [_Q, _assistant("<think>x</think>ans", reasoning_content="real")],
        ),
        (
            "think_in_content_empty_reasoning_content",
            [_Q, _assistant("<think>x</think>ans", reasoning_content="")],
        ),
        (
            "think_in_content_null_reasoning_content",
            [_Q, _assistant("<think>x</think>ans", reasoning_content=None)],
        ),
        ("content_only_close_think", [_Q, _assistant("</think>")]),
        ("content_only_open_think", [_Q, _assistant("<think>")]),
        ("reasoning_whitespace_only", [_Q, _assistant("A", reasoning_content="  \n\t ")]),
        (
            "leading_trailing_whitespace_everywhere",
            [
                {"role": "system", "content": "\n\n S \n"},
                {"role": "user", "content": "\n Q\n\n"},
                _assistant("\n\n  A  \n\n", reasoning_content="\n\n r \n\n"),
            ],
        ),
    ]


def _turn_order_rows() -> list[tuple[str, list[dict]]]:
    """Turns after the last assistant, consecutive assistants or users, an assistant first."""
    return [
        ("ends_with_user", [_Q, _A, _Q]),
        ("ends_with_tool_result", [_Q, _calling('{"x": 1}'), _RESULT]),
        ("consecutive_assistants", [_Q, _A, _A]),
        (
            "consecutive_assistants_reasoning",
            [_Q, _assistant("A1", reasoning_content="r1"), _assistant("<think>r2</think>A2")],
        ),
        ("consecutive_users", [_Q, _Q, _A]),
        ("assistant_first", [_A, _Q, _A]),
    ]


def _argument_rows() -> list[tuple[str, list[dict]]]:
    """Tool-call arguments of every JSON type and spelling, as a string, an object or absent."""
    return [
        (
            "arguments_nested",
            [_Q, _calling(json.dumps({"a": {"b": [1, {"c": None}], "d": "x"}, "e": [], "f": {}}))],
        ),
        (
            "arguments_string_escapes",
            [
                _Q,
                _calling(
                    json.dumps(
                        {"s": 'he said "hi"\nline2\t\\ end', "u": "ünï 😀 中", "e": "", "w": "  pad  "}
                    )
                ),
            ],
        ),
        ("arguments_negative_zero", [_Q, _calling('{"x": -0.0, "y": -0, "z": 0.0}')]),
        (
            "arguments_big_integers",
            [_Q, _calling('{"x": 123456789012345678901234567890, "y": [18446744073709551616]}')],
        ),
        (
            "arguments_float_spellings",
            [_Q, _calling('{"a": 1e16, "b": 1e-5, "c": 1E2, "d": 0.1, "e": 1.0, "f": 2.50}')],
        ),
        ("arguments_largest_f64", [_Q, _calling('{"m": 1.7976931348623157e308, "t": 5e-324}')]),
        ("arguments_literals", [_Q, _calling('{"t": true, "f": false, "n": null}')]),
        ("arguments_object", [_Q, _calling({"t": True, "n": None, "x": 1.5, "l": [1, "a"], "s": "q"})]),
        ("arguments_empty_object", [_Q, _calling({})]),
        ("arguments_absent", [_Q, _calling(...)]),
        ("arguments_padded_string", [_Q, _calling('  {"x": 1}  \n')]),
        ("arguments_unicode_escapes", [_Q, _calling('{"x": "\\u00e9\\ud83d\\ude00"}')]),
        ("arguments_nul_escape", [_Q, _calling('{"x": "a\\u0000b"}')]),
        ("arguments_delimiter_keys", [_Q, _calling('{"</parameter>": "<|im_end|>", "a b": 1}')]),
    ]


def _ignored_field_rows() -> list[tuple[str, list[dict]]]:
    """Fields the template ignores or resolves: call types, calls and reasoning on other roles, aliases."""
    return [
        (
            "tool_call_type_not_function",
            [
                _Q,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"type": "custom", "function": {"name": "f", "arguments": "{}"}}],
                },
            ],
        ),
        (
            "tool_calls_on_user_are_not_rendered",
            [
                {
                    "role": "user",
                    "content": "Q",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
                },
                _A,
            ],
        ),
        (
            "reasoning_on_user_and_system_is_not_rendered",
            [
                {"role": "system", "content": "S", "reasoning_content": "s"},
                {"role": "user", "content": "Q", "reasoning_content": "u"},
                _A,
            ],
        ),
        (
            "reasoning_aliases_first_non_null_wins",
            [_Q, _assistant("A", reasoning_content=None, thinking="two", reasoning="three")],
        ),
        ("reasoning_aliases_empty_string_wins", [_Q, _assistant("A", thinking="", reasoning="x")]),
    ]


def _content_rows() -> list[tuple[str, list[dict]]]:
    """Content-part shapes, control characters, CRLF, extra keys, call markup in content, odd names."""
    return [
        ("content_parts_empty_arrays", [{"role": "user", "content": []}, _Q, _assistant([])]),
        ("content_parts_without_type", [{"role": "user", "content": [{"text": "Q"}]}, _A]),
        (
            "content_parts_unknown_type_with_text",
            [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Q"}, {"type": "foo", "text": "!"}],
                },
                _A,
            ],
        ),
        (
            "content_control_characters",
            [
                {"role": "user", "content": "a\x00b\x1b[31m\x08\x0b\x0c\x1c\x85"},
                _assistant("\x00c\x01\x7f\u2028\u2029ok\x0c"),
            ],
        ),
        ("content_crlf_think", [_Q, _assistant("<think>\r\nr\r\n</think>\r\n\r\nA")]),
        (
            "extra_message_keys",
            [{"role": "user", "content": "Q", "weight": 0}, _assistant("A", weight=0, loss=False)],
        ),
        (
            "call_xml_in_content_and_tool_calls",
            [
                _Q,
                {**_calling('{"x": 1}'), "content": "<tool_call>\n<function=g>\n</function>\n</tool_call>"},
                _RESULT,
                _A,
            ],
        ),
        ("only_reasoning_no_content", [_Q, {"role": "assistant", "reasoning_content": "just thinking"}]),
        ("whitespace_content_with_calls", [_Q, _calling('{"x": 1}', content="  \n ")]),
        (
            "function_name_padded_and_odd",
            [
                _Q,
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": " f\n>g\x00", "arguments": "{}"}}],
                },
            ],
        ),
    ]


def probe2_tools_rows() -> list[tuple[str, dict]]:
    """Whole rows with `tools`: a nested schema, an empty list, entries not OpenAI-shaped, a blank system."""
    q = {"role": "user", "content": "Q"}
    a = {"role": "assistant", "content": "A"}
    nested = {
        "type": "function",
        "function": {
            "name": "f",
            "description": 'd\n"q" ü',
            "parameters": {
                "type": "object",
                "properties": {
                    "o": {
                        "type": "object",
                        "properties": {
                            "a": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "null"}]}}
                        },
                        "required": ["a"],
                    },
                    "n": {"type": "number", "minimum": 0.5, "maximum": 1e16},
                },
                "$defs": {"x": {"enum": [1, "a", None, True]}},
            },
        },
    }
    return [
        ("tools_nested_schema", {"tools": [nested], "messages": [q, a]}),
        ("tools_empty_list", {"tools": [], "messages": [{"role": "system", "content": "S"}, q, a]}),
        ("tools_not_openai_shaped", {"tools": [{"name": "f", "parameters": {}}, {}], "messages": [q, a]}),
        (
            "tools_blank_system",
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "messages": [{"role": "system", "content": "  "}, q, a],
            },
        ),
    ]


def probe2_edges() -> list[dict]:
    """Rows Kiln refuses although TRL renders them (or where both refuse): the outcome and why."""
    q = {"role": "user", "content": "Q"}

    def calling(arguments: str) -> dict:
        """A whole row: the question, then one call of `f` with these arguments."""
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return {"messages": [q, {"role": "assistant", "content": None, "tool_calls": [call]}]}

    where = "messages[1].tool_calls[0].function.arguments"
    return [
        {
            "name": "arguments_lone_surrogate",
            "example": calling('{"x": "\\ud800"}'),
            "kiln": {
                "rejection": "tokenization_error",
                "detail": f"{where} decodes to a lone UTF-16 surrogate",
            },
            "why": "no tokenizer can encode it (TRL's fails too); serde_json refuses the escape "
            "(docs/tokenization.md#tool-calls)",
        },
        {
            "name": "arguments_number_beyond_f64",
            "example": calling('{"x": 1e400, "y": [-1e400]}'),
            "kiln": {"rejection": "tokenization_error", "detail": f"{where} holds a number out of range"},
            "why": "TRL trains 'inf' and '[-Infinity]' in place of the data's number (docs/tokenization.md#tool-calls)",
        },
        {
            "name": "arguments_span_marker_escape",
            "example": calling('{"x": "\\ufdd0"}'),
            "kiln": {
                "rejection": "tokenization_error",
                "detail": f"{where} contains an internal span marker",
            },
            "why": "an internal-marker collision fails the row closed (docs/tokenization.md#span-markers)",
        },
        {
            "name": "arguments_raw_newline_in_string",
            "example": calling('{"x": "a\nb"}'),
            "kiln": {
                "rejection": "tokenization_error",
                "detail": f"{where} is not valid JSON: Invalid control character",
            },
            "why": "not JSON (both refuse)",
        },
        {
            "name": "image_part_with_text",
            "example": {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Q", "image_url": None}]},
                    {"role": "assistant", "content": "A"},
                ]
            },
            "kiln": {"rejection": "tokenization_error", "detail": "is an image/video part"},
            "why": "TRL renders a vision placeholder for any part holding an image_url key; a text model cannot train on it",
        },
        {
            "name": "role_capitalised",
            "example": {"messages": [q, {"role": "Assistant", "content": "A"}]},
            "kiln": {"rejection": "invalid_role", "detail": "messages[1].role is 'Assistant'"},
            "why": "roles are exact (both refuse; docs/ingestion.md#validation)",
        },
        {
            "name": "role_user_padded",
            "example": {
                "messages": [{"role": "user ", "content": "Q"}, {"role": "assistant", "content": "A"}]
            },
            "kiln": {"rejection": "invalid_role", "detail": "messages[0].role is 'user '"},
            "why": "roles are exact (TRL: no user query; docs/ingestion.md#validation)",
        },
    ]
