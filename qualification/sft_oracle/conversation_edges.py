"""The conversations fixture's named edge rows: the outcome Kiln must give each, and why.

`kiln` is the expected outcome: a rejection reason and a fragment of its detail (or `kept`). Where
TRL renders the row anyway, `why` names the documented rule that refuses it. The fixture records
the oracle's own result next to each.
"""

from __future__ import annotations

_Q = {"role": "user", "content": "Q"}
_A = {"role": "assistant", "content": "A"}
_TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "name": "f", "content": "r"}
# Where the structural rules below are written down.
_CONVERSATION_DOC = "kiln_train/data/conversation.py module docstring"


def _calling(name: str = "f", arguments: str = '{"x": 1}') -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [_call_raw(name, arguments)]}


def _call_raw(name: str, arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def conversation_edges() -> list[dict]:
    """Named edge rows in fixture order: template refusals, misplaced tool results, bad tool calls."""
    return _template_and_content_edges() + _tool_result_edges() + _tool_call_edges()


def _template_and_content_edges() -> list[dict]:
    """Rows the template refuses, rows with nothing to supervise, and content Kiln cannot train."""
    return [
        {
            "name": "only_wrapped_tool_response_user",
            "example": {"messages": [{"role": "user", "content": "<tool_response>x</tool_response>"}, _A]},
            "kiln": {"rejection": "tokenization_error", "detail": "No user query found in messages."},
            "why": "the template raises (chat template failure; docs/ingestion.md#validation)",
        },
        {
            "name": "system_not_first",
            "example": {"messages": [_Q, {"role": "system", "content": "late"}, _A]},
            "kiln": {"rejection": "tokenization_error", "detail": "System message must be at the beginning."},
            "why": "the template raises (docs/ingestion.md#validation)",
        },
        {
            "name": "only_system",
            "example": {"messages": [{"role": "system", "content": "S"}]},
            "kiln": {"rejection": "tokenization_error", "detail": "No user query found in messages."},
            "why": "the template raises (docs/ingestion.md#validation)",
        },
        {
            "name": "audio_part",
            "example": {
                "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, _A]
            },
            "kiln": {"rejection": "tokenization_error", "detail": "only text parts are rendered"},
            "why": "the template raises 'Unexpected item type in content.' (docs/ingestion.md#validation)",
        },
        {
            "name": "only_user",
            "example": {"messages": [_Q]},
            "kiln": {"rejection": "tokenization_error", "detail": "no supervised assistant token"},
            "why": "no supervised assistant token at positions >= 1 (docs/ingestion.md#validation)",
        },
        {
            "name": "empty_assistant_turn_is_rejected",
            "example": {"messages": [_Q, {"role": "assistant", "content": " \n"}]},
            "kiln": {
                "rejection": "empty_response",
                "detail": "has empty content, no tool calls and no reasoning",
            },
            "why": "only the empty think block and <|im_end|>\\n would be trained: an empty answer "
            "(docs/ingestion.md#validation)",
        },
        {
            "name": "image_part",
            "example": {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
                    _A,
                ]
            },
            "kiln": {"rejection": "tokenization_error", "detail": "image/video part"},
            "why": f"a text-only model cannot train on vision placeholders ({_CONVERSATION_DOC}, check 4)",
        },
        {
            "name": "span_marker_in_content",
            "example": {"messages": [{"role": "user", "content": "Q\ufdd0"}, _A]},
            "kiln": {"rejection": "tokenization_error", "detail": "internal span marker"},
            "why": "an internal-marker collision fails the row closed (docs/tokenization.md#span-markers)",
        },
    ]


def _tool_result_edges() -> list[dict]:
    """A tool result that answers no call: first, after a system or user turn, or a plain answer."""
    return [
        {
            "name": "tool_result_first",
            "example": {"messages": [_TOOL_RESULT, _Q, _A]},
            "kiln": {
                "rejection": "tokenization_error",
                "detail": "messages[0] is a tool result at the start",
            },
            "why": f"TRL renders it without its <|im_start|>user header ({_CONVERSATION_DOC})",
        },
        {
            "name": "tool_result_after_system",
            "example": {"messages": [{"role": "system", "content": "S"}, _TOOL_RESULT, _Q, _A]},
            "kiln": {
                "rejection": "tokenization_error",
                "detail": "messages[1] is a tool result after a system message",
            },
            "why": f"a tool result must answer a call ({_CONVERSATION_DOC})",
        },
        {
            "name": "tool_result_after_user",
            "example": {"messages": [_Q, _TOOL_RESULT, _A]},
            "kiln": {
                "rejection": "tokenization_error",
                "detail": "messages[1] is a tool result after a user message",
            },
            "why": f"a tool result must answer a call ({_CONVERSATION_DOC})",
        },
        {
            "name": "tool_result_after_assistant_without_calls",
            "example": {"messages": [_Q, _A, _TOOL_RESULT, _A]},
            "kiln": {
                "rejection": "tokenization_error",
                "detail": "after an assistant message without tool calls",
            },
            "why": f"a tool result must answer a call ({_CONVERSATION_DOC})",
        },
    ]


def _tool_call_edges() -> list[dict]:
    """Tool calls Kiln cannot render faithfully: no name, ambiguous or invalid arguments, legacy fields."""
    return [
        {
            "name": "function_name_empty",
            "example": {"messages": [_Q, _calling(name="")]},
            "kiln": {"rejection": "tokenization_error", "detail": "function.name is empty"},
            "why": f"'<function=>' is not a call ({_CONVERSATION_DOC})",
        },
        {
            "name": "arguments_duplicate_key",
            "example": {"messages": [_Q, _calling(arguments='{"a": 1, "a": 2}')]},
            "kiln": {"rejection": "tokenization_error", "detail": "duplicate object key 'a'"},
            "why": f"an ambiguous arguments object; a parser silently keeps one value ({_CONVERSATION_DOC})",
        },
        {
            "name": "arguments_deeper_than_serde_json",
            "example": {"messages": [_Q, _calling(arguments='{"a": ' + "[" * 127 + "]" * 127 + "}")]},
            "kiln": {"rejection": "tokenization_error", "detail": "nested deeper than 127 arrays/objects"},
            "why": f"serde_json's recursion limit ({_CONVERSATION_DOC})",
        },
        {
            "name": "legacy_function_call",
            "example": {
                "messages": [
                    _Q,
                    {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                ]
            },
            "kiln": {"rejection": "tokenization_error", "detail": "messages[1].function_call is set"},
            "why": f"TRL renders an empty answer in place of the call ({_CONVERSATION_DOC})",
        },
        {
            "name": "assistant_refusal",
            "example": {"messages": [_Q, {"role": "assistant", "content": None, "refusal": "I can't help."}]},
            "kiln": {"rejection": "tokenization_error", "detail": "messages[1].refusal is set"},
            "why": f"TRL renders an empty answer in place of the refusal ({_CONVERSATION_DOC})",
        },
        {
            "name": "arguments_invalid_json",
            "example": {"messages": [_Q, _calling(arguments="{x")]},
            "kiln": {"rejection": "tokenization_error", "detail": "function.arguments is not valid JSON"},
            "why": "arguments is a JSON string parsed before rendering; it cannot be (docs/tokenization.md#tool-calls)",
        },
        {
            "name": "arguments_not_an_object",
            "example": {"messages": [_Q, _calling(arguments="[1, 2]")]},
            "kiln": {"rejection": "tokenization_error", "detail": "must encode a JSON object, got array"},
            "why": "arguments parse into the object the Qwen template expects (docs/tokenization.md#tool-calls)",
        },
    ]
