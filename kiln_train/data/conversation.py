"""One SFT example: schema check, normalisation and the render-ready form (docs/ingestion.md#validation).

Rows are OpenAI-shaped: `{"messages": [...], "tools": [...]?}`; other example-level keys are
ignored (they never reach rendering or row identity). Checked in contract order:

1. `parse_example` (not deserialisable -> `RowSchemaError`, i.e. `invalid_json` in JSONL):
   - the example is an object; `messages` is a list of objects (missing or null -> empty);
   - `role` is a string; `content` is a string, null/missing (-> ""), or a list of content parts
     (objects); `reasoning_content`, `name`, `tool_call_id` are strings or null;
     `tool_calls` is a list of `{"id"?, "type"?, "function": {"name": str, "arguments"?}}` with
     `arguments` a JSON string (OpenAI) or an object; `tools` is a list of objects or null.
   - `reasoning_content` may also arrive as `thinking` or `reasoning` (first non-null wins, the
     same aliasing Transformers applies); it is normalised to `reasoning_content`.
   - unknown keys inside a message or tool call are ignored (as serde ignores them).
2. empty `messages` -> `empty_messages`.
3. a role outside system/user/assistant/tool -> `invalid_role`.
4. `prepare_for_template` (-> `tokenization_error`): `function.arguments` strings that are not a
   JSON object, or whose escapes decode to what the row itself could not hold (a lone surrogate, a
   number beyond f64 such as `1e400`, a span marker); content parts that are not text (images/video: the text model cannot see them;
   Transformers would render vision tokens); internal span markers anywhere in the row.

Where the contract is silent Kiln refuses rather than guesses (each is a documented choice, never
a difference from TRL on a conversation Kiln admits):

- nesting: a row (or a `function.arguments` string) nested deeper than 127 arrays/objects is
  refused -- serde_json's recursion limit, so the Rust reference refuses the same rows -- as
  `invalid_json` (`tokenization_error` for an arguments string). This is checked without
  recursion, so no row can exhaust Python's stack.
- duplicate object keys: a JSON text that repeats a key inside one object is ambiguous (a parser
  silently keeps one value): `invalid_json` for the row (ingestion.py decodes JSONL lines with
  `decode_json`), `tokenization_error` for a `function.arguments` string.
- `function.arguments` null or absent renders a call without parameters; `""` is not JSON and
  is refused like any other invalid arguments string.
- an empty (or whitespace-only) function name is refused (`<function=>` is not a call).
- tool results must answer a call: every run of consecutive `tool` messages must directly follow
  an assistant message with at least one tool call (in `tool_calls`, or written by the producer
  as Qwen `<tool_call>` XML inside the content, which renders the same). Otherwise the template
  would either emit a tool result without its `<|im_start|>user` header (a `tool` message first,
  or right after the system message) or present a result nobody asked for (after a user turn or
  an assistant turn without calls) -- TRL renders both silently; Kiln refuses the row.
- output the template cannot show is refused, not dropped: a message with a non-null legacy
  `function_call` or an assistant `refusal` (OpenAI export fields the Qwen template ignores) would
  otherwise train an empty answer in place of the call or the refusal text (`unrenderable_field`,
  `tokenization_error`; `null` values, as OpenAI exports write them, are fine).
- turns after the last assistant message are kept as unsupervised context: the contract's only
  supervision requirement is at least one supervised token, and a training sequence ends after
  the last rendered message (docs/tokenization.md#rendering).

The parsed row (what `kiln.sft-parsed-row.v1` hashes) is `{"messages": [...]}` plus `"tools"` when
present. Each message has `role`, `content` (a string, or the list of content parts as given),
and only when present `reasoning_content`, `tool_calls`, `name`, `tool_call_id`; each tool call
keeps `id`/`type` when present and `function.arguments` exactly as given (the original JSON
string). Structured content is joined for rendering as the Qwen template does: the `text` of each
part concatenated with "".
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kiln_train.data.chat_template import SPAN_CLOSE, SPAN_OPEN
from kiln_train.ground.json_bounded import depth

ROLES = ("system", "user", "assistant", "tool")
REASONING_ALIASES = ("reasoning_content", "thinking", "reasoning")

INVALID_JSON = "invalid_json"
EMPTY_MESSAGES = "empty_messages"
INVALID_ROLE = "invalid_role"
TOKENIZATION_ERROR = "tokenization_error"
# Row formats (row_formats.py), row rules and length limits (ingestion.py): Kiln's own reasons.
AMBIGUOUS_FORMAT = "ambiguous_format"
UNSUPPORTED_FORMAT = "unsupported_format"
UNKNOWN_FIELD = "unknown_field"
INVALID_FIELD_TYPE = "invalid_field_type"
EMPTY_OUTPUT = "empty_output"
EMPTY_RESPONSE = "empty_response"
TOO_LONG = "too_long"
ANSWER_TRUNCATED = "answer_truncated"
REJECTION_REASONS = (
    INVALID_JSON,
    EMPTY_MESSAGES,
    INVALID_ROLE,
    TOKENIZATION_ERROR,
    AMBIGUOUS_FORMAT,
    UNSUPPORTED_FORMAT,
    UNKNOWN_FIELD,
    INVALID_FIELD_TYPE,
    EMPTY_OUTPUT,
    EMPTY_RESPONSE,
    TOO_LONG,
    ANSWER_TRUNCATED,
)

# serde_json's default recursion limit: it starts at 128 and refuses the value whose opening
# bracket brings it to 0, so 127 nested arrays/objects are the most a Rust reference row can hold.
MAX_JSON_DEPTH = 127


class RowRejection(Exception):
    """A row fails the contract; `reason` is one of REJECTION_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


class RowSchemaError(RowRejection):
    """The row cannot be deserialised as an SFT example; `field` names the offending path."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(INVALID_JSON, f"{field}: {problem}")


@dataclass(frozen=True)
class Conversation:
    """A parsed, normalised example: `parsed` is hashed, `messages`/`tools` are rendered."""

    parsed: dict
    messages: list[dict]
    tools: list[dict] | None


class DuplicateKeyError(ValueError):
    """A JSON object repeats a key."""


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(f"duplicate object key {key!r}")
            seen.add(key)
    return out


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def decode_json(text: str):
    """Strict JSON: no NaN/Infinity, no repeated key inside an object, at most MAX_JSON_DEPTH levels.

    Raises ValueError (DuplicateKeyError, JSONDecodeError, or a depth error) with a readable message.
    """
    try:
        value = json.loads(text, object_pairs_hook=_unique_pairs, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} arrays/objects") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} arrays/objects")
    return value


def json_depth(value, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of arrays/objects in `value` (a scalar is 0), counted up to `limit + 1` by the
    ground's non-recursive walk (`kiln_train.ground.json_bounded.depth`) under a row's bound."""
    return depth(value, limit)


def _opt_str(msg: dict, key: str, where: str) -> str | None:
    value = msg.get(key)
    if value is not None and not isinstance(value, str):
        raise RowSchemaError(f"{where}.{key}", f"expected a string or null, got {_kind(value)}")
    return value


def kind_of(value) -> str:
    """The JSON kind of `value` as messages name it (`string`, `array`, `null`, ...)."""
    return _kind(value)


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _parse_content(value, where: str):
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for j, part in enumerate(value):
            if not isinstance(part, dict):
                raise RowSchemaError(
                    f"{where}.content[{j}]", f"expected a content part object, got {_kind(part)}"
                )
            if "text" in part and not isinstance(part["text"], str):
                raise RowSchemaError(
                    f"{where}.content[{j}].text", f"expected a string, got {_kind(part['text'])}"
                )
        return value
    raise RowSchemaError(
        f"{where}.content", f"expected a string, an array of content parts or null, got {_kind(value)}"
    )


def _parse_tool_calls(value, where: str) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise RowSchemaError(f"{where}.tool_calls", f"expected an array or null, got {_kind(value)}")
    calls = []
    for k, call in enumerate(value):
        at = f"{where}.tool_calls[{k}]"
        if not isinstance(call, dict):
            raise RowSchemaError(at, f"expected an object, got {_kind(call)}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise RowSchemaError(f"{at}.function", f"expected an object, got {_kind(function)}")
        name = function.get("name")
        if not isinstance(name, str):
            raise RowSchemaError(f"{at}.function.name", f"expected a string, got {_kind(name)}")
        parsed_function = {"name": name}
        if function.get("arguments") is not None:
            arguments = function["arguments"]
            if not isinstance(arguments, str | dict):
                raise RowSchemaError(
                    f"{at}.function.arguments", f"expected a JSON string or an object, got {_kind(arguments)}"
                )
            parsed_function["arguments"] = arguments
        parsed_call = {"function": parsed_function}
        for key in ("id", "type"):
            if call.get(key) is not None:
                if not isinstance(call[key], str):
                    raise RowSchemaError(f"{at}.{key}", f"expected a string, got {_kind(call[key])}")
                parsed_call[key] = call[key]
        calls.append(parsed_call)
    return calls


def _parse_message(msg, where: str) -> dict:
    if not isinstance(msg, dict):
        raise RowSchemaError(where, f"expected a message object, got {_kind(msg)}")
    role = msg.get("role")
    if not isinstance(role, str):
        raise RowSchemaError(f"{where}.role", f"expected a string, got {_kind(role)}")
    out = {"role": role, "content": _parse_content(msg.get("content"), where)}
    reasoning = None
    for key in REASONING_ALIASES:
        value = _opt_str(msg, key, where)
        if reasoning is None and value is not None:
            reasoning = value
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    calls = _parse_tool_calls(msg.get("tool_calls"), where)
    if calls is not None:
        out["tool_calls"] = calls
    for key in ("name", "tool_call_id"):
        value = _opt_str(msg, key, where)
        if value is not None:
            out[key] = value
    return out


def parse_example(obj) -> dict:
    """Deserialise and normalise one example into its parsed-row form; RowSchemaError if impossible."""
    if not isinstance(obj, dict):
        raise RowSchemaError("example", f"expected an object, got {_kind(obj)}")
    if json_depth(obj) > MAX_JSON_DEPTH:
        raise RowSchemaError("example", f"nested deeper than {MAX_JSON_DEPTH} arrays/objects")
    messages = obj.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        raise RowSchemaError("messages", f"expected an array, got {_kind(messages)}")
    parsed: dict = {"messages": [_parse_message(m, f"messages[{i}]") for i, m in enumerate(messages)]}
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RowSchemaError("tools", f"expected an array or null, got {_kind(tools)}")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise RowSchemaError(f"tools[{i}]", f"expected an object, got {_kind(tool)}")
        parsed["tools"] = tools
    return parsed


UNRENDERED_OUTPUT_FIELDS = ("function_call", "refusal")


def unrenderable_field(obj) -> str | None:
    """The first message field carrying output the template would silently drop, or None.

    `obj` is the example as received (parse_example drops unknown keys, so this looks at the source).
    """
    messages = obj.get("messages") if isinstance(obj, dict) else None
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(m, dict):
            continue
        for key in UNRENDERED_OUTPUT_FIELDS:
            if m.get(key) is not None:
                return (
                    f"messages[{i}].{key} is set, but the Qwen template does not render it "
                    f"(the turn would be trained as if it were absent); "
                    + ("use tool_calls" if key == "function_call" else "put the refusal text in content")
                )
    return None


def check_roles(parsed: dict) -> None:
    """Contract checks 2 and 3: non-empty messages, known roles."""
    messages = parsed["messages"]
    if not messages:
        raise RowRejection(EMPTY_MESSAGES, "messages is missing or empty")
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise RowRejection(
                INVALID_ROLE, f"messages[{i}].role is {m['role']!r}; expected one of {', '.join(ROLES)}"
            )


def _join_parts(parts: list, where: str) -> str:
    """Text parts concatenated with "" (the Qwen template's join); anything else is refused."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if "image" in part or "image_url" in part or kind == "image" or "video" in part or kind == "video":
            raise RowRejection(
                TOKENIZATION_ERROR,
                f"{where}.content[{j}] is an image/video part; the text model cannot train on it",
            )
        if "text" not in part:
            raise RowRejection(
                TOKENIZATION_ERROR,
                f"{where}.content[{j}] has no text (type {kind!r}); only text parts are rendered",
            )
        texts.append(part["text"])
    return "".join(texts)


def _render_arguments(arguments, where: str) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = decode_json(arguments)
    except ValueError as exc:
        raise RowRejection(TOKENIZATION_ERROR, f"{where} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RowRejection(TOKENIZATION_ERROR, f"{where} must encode a JSON object, got {_kind(value)}")
    _check_decoded_arguments(value, where)
    return value


def _check_decoded_arguments(value: dict, where: str) -> None:
    """What the row's own checks cannot see, because the arguments string holds it only as escapes.

    - a lone UTF-16 surrogate (`"\\ud800"`): not Unicode text, so no tokenizer can encode it (and
      serde_json refuses the escape);
    - a number too large for an f64 (`1e400`): Python reads it as infinity, so the call would be
      trained as `inf` instead of the number the data holds (serde_json: "number out of range");
    - an internal span marker written as an escape (`"\\ufdd0"`): caught here with its field named,
      rather than later as a malformed span.
    """
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RowRejection(
            TOKENIZATION_ERROR,
            f"{where} decodes to a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair); "
            "that is not Unicode text",
        ) from None
    except ValueError:
        raise RowRejection(
            TOKENIZATION_ERROR,
            f"{where} holds a number out of range (it does not fit a 64-bit float and would render as inf)",
        ) from None
    if SPAN_OPEN in text or SPAN_CLOSE in text:
        raise RowRejection(TOKENIZATION_ERROR, f"{where} contains an internal span marker (U+FDD0/U+FDD1)")


def _makes_a_call(message: dict) -> bool:
    return bool(message.get("tool_calls")) or "<tool_call>" in message["content"]


def _check_tool_results(messages: list[dict]) -> None:
    """Every run of `tool` messages directly follows an assistant message that made a tool call."""
    for i, m in enumerate(messages):
        if m["role"] != "tool" or (i > 0 and messages[i - 1]["role"] == "tool"):
            continue
        previous = messages[i - 1] if i > 0 else None
        if previous is None or previous["role"] != "assistant" or not _makes_a_call(previous):
            after = "at the start" if previous is None else f"after a {previous['role']} message"
            if previous is not None and previous["role"] == "assistant":
                after = "after an assistant message without tool calls"
            raise RowRejection(
                TOKENIZATION_ERROR,
                f"messages[{i}] is a tool result {after}; tool results must directly follow an "
                "assistant message with tool_calls",
            )


def find_marker(parsed: dict, canonical: str) -> str | None:
    """The first field of the row that carries an internal span marker, or None when clean."""
    if SPAN_OPEN not in canonical and SPAN_CLOSE not in canonical:
        return None

    def has_marker(text: str) -> bool:
        return SPAN_OPEN in text or SPAN_CLOSE in text

    def walk(value, path: str) -> str | None:
        if isinstance(value, str):
            return path if has_marker(value) else None
        if isinstance(value, dict):
            children = [(f"{path}.{key}", key, item) for key, item in value.items()]
        elif isinstance(value, list):
            children = [(f"{path}[{i}]", None, item) for i, item in enumerate(value)]
        else:
            return None
        for child_path, key, item in children:
            if key is not None and has_marker(key):
                return child_path
            found = walk(item, child_path)
            if found:
                return found
        return None

    return (walk(parsed, "") or ".row").lstrip(".")


def prepare_for_template(parsed: dict, canonical: str) -> Conversation:
    """Contract check 4 (the part before the template runs): build the render-ready messages.

    `canonical` is the row's canonical JSON (already computed for its hash); a marker anywhere in
    it fails the row.
    """
    where = find_marker(parsed, canonical)
    if where is not None:
        raise RowRejection(TOKENIZATION_ERROR, f"{where} contains an internal span marker (U+FDD0/U+FDD1)")
    messages = []
    for i, m in enumerate(parsed["messages"]):
        at = f"messages[{i}]"
        content = m["content"]
        out = {
            "role": m["role"],
            "content": content if isinstance(content, str) else _join_parts(content, at),
        }
        if "reasoning_content" in m:
            out["reasoning_content"] = m["reasoning_content"]
        if "tool_calls" in m:
            calls = []
            for k, call in enumerate(m["tool_calls"]):
                function = call["function"]
                if not function["name"].strip():
                    raise RowRejection(TOKENIZATION_ERROR, f"{at}.tool_calls[{k}].function.name is empty")
                rendered = {"name": function["name"]}
                if "arguments" in function:
                    rendered["arguments"] = _render_arguments(
                        function["arguments"], f"{at}.tool_calls[{k}].function.arguments"
                    )
                calls.append(rendered)
            out["tool_calls"] = calls
        for key in ("name", "tool_call_id"):
            if key in m:
                out[key] = m[key]
        messages.append(out)
    _check_tool_results(messages)
    return Conversation(parsed, messages, parsed.get("tools"))
