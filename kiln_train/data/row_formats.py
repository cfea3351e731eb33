"""Row formats: every kind of JSONL line Kiln trains on, converted into the one conversation the
training template renders (docs/ingestion.md#row-formats).

A line is read on its own; formats may mix in one file. The format is chosen by the keys present:

- `messages`: the native conversation (`conversation.parse_example`), unchanged: keys beside
  `messages`/`tools` are ignored, and the row's identity is its parsed form, as before formats
  existed (so a `messages` corpus keeps its hashes).
- `instruction`: `instruction`, optional `input`, `output`, optional `system`, optional
  `history` (a list of `[instruction, response]` pairs before this one). Becomes `system?`, a
  user and an assistant turn per history pair, the user turn `instruction` (or
  `instruction + "\\n" + input` when `input` is not empty) and the assistant turn `output`.
  Every assistant turn is supervised, as in a `messages` row.
- `prompt_completion`: `prompt` and `completion` are lists of messages (and `tools` may sit
  beside them). Rendered as one conversation; only the completion's assistant turns are
  supervised (an assistant turn inside the prompt is context).
- `text_prompt_completion`: `prompt` and `completion` are strings. Raw text, no chat template:
  `prompt + completion` followed by one EOS (none added when the completion already ends with
  it), tokenized once without added special tokens; supervised are the tokens that start at or
  after the prompt's end in the fast tokenizer's offsets (the completion and the EOS). A token
  that straddles the boundary is not supervised (`supervised_from_offsets`).

Identity: a converted format's row hash is over the row as given (its canonical JSON), so the same
Alpaca line always has the same hash whatever the conversion does.

Rejections (each its own reason code, under `invalid_row_policy` like every row rejection):
`ambiguous_format` (keys of two formats on one line), `unsupported_format` (a known foreign
format, e.g. ShareGPT `conversations`, for which no converter exists), `unknown_field` (a key
beside a converted format's keys), `invalid_field_type` (a value of the wrong type),
`empty_output` (an empty `output`/`completion`, or a completion with no assistant turn) and
`empty_response` (a supervised assistant turn with empty content, no tool calls and no
reasoning; a tool-call-only turn is valid).

Adding a format is one converter here (a function from the row object to a `ConvertedRow`),
one entry in `FORMATS` and `_detect`, and its tests (docs/ARCHITECTURE.md#how-to-add-a-row-format).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln_train.data.conversation import (
    AMBIGUOUS_FORMAT,
    EMPTY_OUTPUT,
    EMPTY_RESPONSE,
    INVALID_FIELD_TYPE,
    TOKENIZATION_ERROR,
    UNKNOWN_FIELD,
    UNSUPPORTED_FORMAT,
    Conversation,
    RowRejection,
    RowSchemaError,
    check_roles,
    find_marker,
    kind_of,
    parse_example,
    prepare_for_template,
    unrenderable_field,
)
from kiln_train.data.row_identity import PARSED_ROW_DOMAIN, domain_digest, serde_canonical_json

MESSAGES = "messages"
INSTRUCTION = "instruction"
PROMPT_COMPLETION = "prompt_completion"
TEXT_PROMPT_COMPLETION = "text_prompt_completion"
FORMATS = (MESSAGES, INSTRUCTION, PROMPT_COMPLETION, TEXT_PROMPT_COMPLETION)

INSTRUCTION_KEYS = ("instruction", "input", "output", "system", "history")
PROMPT_COMPLETION_KEYS = ("prompt", "completion")
# Keys of formats people have that Kiln has no converter for: what to say when a row has one.
FOREIGN_FORMATS = {
    "conversations": "ShareGPT (`conversations` with from/value turns)",
    "text": "plain language-model text (`text`)",
    "chosen": "preference pairs (`chosen`/`rejected`)",
}
EXPECTED = (
    "expected `messages`, `instruction`/`output` (with optional `input`, `system`, `history`) or "
    "`prompt`/`completion`"
)


@dataclass(frozen=True)
class ConvertedRow:
    """A row turned into what the tokenizer sees.

    Template formats carry `conversation` (and `context_turns`: how many leading assistant turns
    are context, not supervised); the raw-text format carries `prompt` and `completion` instead.
    `conversion` says in a line how the row became that (shown by `kiln data inspect`)."""

    format: str
    row_sha256: str
    conversion: str
    conversation: Conversation | None = None
    context_turns: int = 0
    prompt: str | None = None
    completion: str | None = None


class FormatRejection(RowRejection):
    """A row rejected with its identity known (`row_sha256`)."""

    def __init__(self, reason: str, detail: str, row_sha256: str) -> None:
        self.row_sha256 = row_sha256
        super().__init__(reason, detail)


def detect_format(obj) -> str:
    """The format a row object is written in (`messages` for anything without another format's
    keys, so a row with none of them fails as today's `empty_messages`); RowRejection when the
    keys are ambiguous or belong to a format Kiln does not convert."""
    if not isinstance(obj, dict):
        return MESSAGES
    found = [
        name
        for name, present in (
            (MESSAGES, "messages" in obj),
            (INSTRUCTION, "instruction" in obj),
            # A `messages` row may carry a `prompt` as metadata (UltraChat's rows do): only a
            # `completion`, or a `prompt` without `messages`, announces a prompt/completion row.
            (PROMPT_COMPLETION, "completion" in obj or ("prompt" in obj and "messages" not in obj)),
        )
        if present
    ]
    if len(found) > 1:
        keys = [k for k in ("messages", "instruction", "prompt", "completion") if k in obj]
        raise RowRejection(
            AMBIGUOUS_FORMAT,
            f"the row has keys of more than one format ({', '.join(keys)}); one line is one format: {EXPECTED}",
        )
    if not found:
        for key, name in FOREIGN_FORMATS.items():
            if key in obj:
                raise RowRejection(
                    UNSUPPORTED_FORMAT,
                    f"the row has a `{key}` key: {name} rows have no converter in Kiln; {EXPECTED}",
                )
        return MESSAGES
    if found[0] == PROMPT_COMPLETION and isinstance(obj.get("prompt"), str):
        return TEXT_PROMPT_COMPLETION
    return found[0]


def given_row_sha256(obj) -> str:
    """Identity of a converted row: the row as given (its canonical JSON)."""
    try:
        canonical = serde_canonical_json(obj)
        payload = canonical.encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise RowSchemaError("example", f"not representable as JSON: {exc}") from None
    return domain_digest(PARSED_ROW_DOMAIN, payload)


def convert_messages(parsed: dict, canonical: str, unrenderable: str | None, row_sha: str) -> ConvertedRow:
    """A `messages` row (already parsed by `ingestion_sources.parse_row`)."""
    try:
        check_roles(parsed)
        if unrenderable is not None:
            raise RowRejection(TOKENIZATION_ERROR, unrenderable)
        conversation = prepare_for_template(parsed, canonical)
        check_responses(conversation.messages, 0, "messages")
    except FormatRejection:
        raise
    except RowRejection as exc:
        raise FormatRejection(exc.reason, exc.detail, row_sha) from None
    return ConvertedRow(MESSAGES, row_sha, "messages as given", conversation)


def convert_row(obj, fmt: str) -> ConvertedRow:
    """Convert a row of a non-`messages` format; FormatRejection (with the row's hash) when it is
    not a valid row of that format."""
    row_sha = given_row_sha256(obj)
    converter = {
        INSTRUCTION: _instruction,
        PROMPT_COMPLETION: _prompt_completion,
        TEXT_PROMPT_COMPLETION: _text_prompt_completion,
    }[fmt]
    try:
        return converter(obj, row_sha)
    except FormatRejection:
        raise
    except RowRejection as exc:
        raise FormatRejection(exc.reason, exc.detail, row_sha) from None


def _check_keys(obj: dict, allowed: tuple[str, ...], fmt: str) -> None:
    unknown = sorted(k for k in obj if k not in allowed)
    if unknown:
        raise RowRejection(
            UNKNOWN_FIELD,
            f"{', '.join(repr(k) for k in unknown)} beside a {fmt} row's keys; "
            f"a {fmt} row has only {', '.join(allowed)}",
        )


def _string(obj: dict, key: str, *, optional: bool) -> str:
    value = obj.get(key)
    if value is None and optional:
        return ""
    if isinstance(value, str):
        return value
    if value is None and key in ("output", "completion"):
        raise RowRejection(EMPTY_OUTPUT, f"{key} is missing")
    raise RowRejection(INVALID_FIELD_TYPE, f"{key} must be a string, got {kind_of(value)}")


def _no_markers(obj: dict) -> None:
    canonical = serde_canonical_json(obj)
    where = find_marker(obj, canonical)
    if where is not None:
        raise RowRejection(TOKENIZATION_ERROR, f"{where} contains an internal span marker (U+FDD0/U+FDD1)")


def _instruction(obj: dict, row_sha: str) -> ConvertedRow:
    _check_keys(obj, INSTRUCTION_KEYS, INSTRUCTION)
    instruction = _string(obj, "instruction", optional=False)
    extra = _string(obj, "input", optional=True)
    output = _string(obj, "output", optional=False)
    system = _string(obj, "system", optional=True)
    if not output.strip():
        raise RowRejection(EMPTY_OUTPUT, "output is empty")
    history = obj.get("history")
    pairs: list[tuple[str, str]] = []
    if history is not None:
        if not isinstance(history, list):
            raise RowRejection(
                INVALID_FIELD_TYPE, f"history must be an array of pairs, got {kind_of(history)}"
            )
        for i, pair in enumerate(history):
            if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
                raise RowRejection(
                    INVALID_FIELD_TYPE, f"history[{i}] must be a pair [instruction, response] of strings"
                )
            pairs.append((pair[0], pair[1]))
    _no_markers(obj)
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    for question, answer in pairs:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    user = instruction if not extra else f"{instruction}\n{extra}"
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    for i, (_question, answer) in enumerate(pairs):
        if not answer.strip():
            raise RowRejection(
                EMPTY_RESPONSE, f"history[{i}] has an empty response (an empty answer would be trained)"
            )
    conversion = (
        ("system, " if system else "")
        + (f"{len(pairs)} history pair(s), " if pairs else "")
        + ("user = instruction + \\n + input" if extra else "user = instruction")
        + ", assistant = output"
    )
    return ConvertedRow(INSTRUCTION, row_sha, conversion, Conversation(obj, messages, None))


def _messages_of(value, key: str) -> list[dict]:
    try:
        return parse_example({"messages": value})["messages"]
    except RowSchemaError as exc:
        field = key + exc.field[len("messages") :] if exc.field.startswith("messages") else key
        problem = exc.detail[len(exc.field) + 2 :]
        raise RowRejection(INVALID_FIELD_TYPE, f"{field}: {problem}") from None


def _prompt_completion(obj: dict, row_sha: str) -> ConvertedRow:
    _check_keys(obj, (*PROMPT_COMPLETION_KEYS, "tools"), "prompt/completion")
    prompt, completion = obj.get("prompt"), obj.get("completion")
    for key, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, list):
            if value is None and key == "completion":
                raise RowRejection(EMPTY_OUTPUT, "completion is missing")
            if value is None:
                raise RowRejection(INVALID_FIELD_TYPE, "prompt is missing (a completion needs its prompt)")
            raise RowRejection(
                INVALID_FIELD_TYPE,
                f"{key} must be a list of messages (like the other side) or both must be strings, "
                f"got {kind_of(value)}",
            )
    prompt_msgs = _messages_of(prompt, "prompt")
    completion_msgs = _messages_of(completion, "completion")
    if not completion_msgs:
        raise RowRejection(EMPTY_OUTPUT, "completion is an empty list")
    if not any(m["role"] == "assistant" for m in completion_msgs):
        raise RowRejection(EMPTY_OUTPUT, "completion has no assistant message (nothing to supervise)")
    parsed = {"messages": prompt_msgs + completion_msgs}
    tools = obj.get("tools")
    if tools is not None:
        try:
            parsed["tools"] = parse_example({"tools": tools})["tools"]
        except RowSchemaError as exc:
            raise RowRejection(INVALID_FIELD_TYPE, exc.detail) from None
    check_roles(parsed)
    source = {"messages": list(prompt) + list(completion)}
    unrenderable = unrenderable_field(source)
    if unrenderable is not None:
        raise RowRejection(TOKENIZATION_ERROR, unrenderable)
    conversation = prepare_for_template(parsed, serde_canonical_json(parsed))
    context = sum(1 for m in prompt_msgs if m["role"] == "assistant")
    check_responses(conversation.messages, len(prompt_msgs), "completion")
    conversion = (
        f"{len(prompt_msgs)} prompt message(s) as context"
        + (f" ({context} assistant turn(s) unsupervised)" if context else "")
        + f", {len(completion_msgs)} completion message(s) supervised"
    )
    return ConvertedRow(PROMPT_COMPLETION, row_sha, conversion, conversation, context_turns=context)


def _text_prompt_completion(obj: dict, row_sha: str) -> ConvertedRow:
    _check_keys(obj, PROMPT_COMPLETION_KEYS, "prompt/completion")
    prompt = _string(obj, "prompt", optional=False)
    completion = obj.get("completion")
    if completion is None:
        raise RowRejection(EMPTY_OUTPUT, "completion is missing")
    if not isinstance(completion, str):
        raise RowRejection(
            INVALID_FIELD_TYPE,
            f"completion must be a string like the prompt (or both lists of messages), got {kind_of(completion)}",
        )
    if not completion:
        raise RowRejection(EMPTY_OUTPUT, "completion is empty")
    return ConvertedRow(
        TEXT_PROMPT_COMPLETION,
        row_sha,
        "raw text: prompt + completion + EOS, no chat template",
        prompt=prompt,
        completion=completion,
    )


def check_responses(messages: list[dict], start: int, label: str) -> None:
    """`empty_response` for a supervised assistant turn (index >= `start`) with empty content, no
    tool calls and no reasoning."""
    for i, m in enumerate(messages):
        if i < start or m["role"] != "assistant":
            continue
        content = m.get("content")
        text = content if isinstance(content, str) else ""
        if text.strip() or m.get("tool_calls") or (m.get("reasoning_content") or "").strip():
            continue
        where = f"{label}[{i - start}]"
        raise RowRejection(
            EMPTY_RESPONSE,
            f"{where} has empty content, no tool calls and no reasoning (an empty answer would be trained)",
        )


def supervised_from_offsets(offsets: list[tuple[int, int]], boundary: int) -> int:
    """Index of the first token that starts at or after character `boundary` (a token that
    straddles it is not supervised); len(offsets) when none does."""
    for index, (start, _end) in enumerate(offsets):
        if start >= boundary:
            return index
    return len(offsets)
