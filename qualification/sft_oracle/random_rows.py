"""The first fixture's random differential rows: short seeded conversations over every template branch.

Words mix plain text, CJK, emoji, combining marks, CRLF and the template's own delimiters; rows
mix system prompts, reasoning (field, inline, empty), tool calls with random JSON arguments and
tool results, and now and then a system message out of place.
"""

from __future__ import annotations

import random

from .named_cases import SEARCH_TOOL, WEATHER_TOOL, call

_WORDS = [
    "hello",
    "world",
    "  padded  ",
    "\n",
    "\t",
    "数据",
    "模型训练",
    "😀",
    "👨‍👩‍👧‍👦",
    "e\u0301",
    "naïve",
    "x = [1, 2]",
    "\r\n",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<tool_response>",
    "</tool_response>",
    "{'a': 1}",
    "  ",
    "Zürich",
    "ДАННЫЕ",
    "مرحبا",
    "1.5",
]


def _text(rng: random.Random, lo: int = 0, hi: int = 8) -> str:
    return "".join(rng.choice(_WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(lo, hi)))


def _value(rng: random.Random, depth: int = 0):
    kind = rng.choice(
        ["str", "int", "float", "bool", "none", "list", "dict"] if depth < 2 else ["str", "int"]
    )
    if kind == "str":
        return _text(rng, 0, 4)
    if kind == "int":
        return rng.randint(-1000, 10**6)
    if kind == "float":
        return rng.choice([1.5, -0.25, 3.0, 1e-7, 123456.789, 2.5e20])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _content(rng: random.Random, lo: int = 0, hi: int = 8):
    if rng.random() < 0.15:
        return [{"type": "text", "text": _text(rng, 0, 3)} for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.05:
        return None
    return _text(rng, lo, hi)


def random_row(rng: random.Random) -> dict:
    """One random conversation exercising every branch of the template."""
    messages: list[dict] = []
    row: dict = {}
    if rng.random() < 0.4:
        row["tools"] = rng.sample([WEATHER_TOOL, SEARCH_TOOL], rng.randint(1, 2))
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _content(rng)})
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": _content(rng, 1)})
        style = rng.choice(["plain", "reasoning", "inline", "tools", "empty_reasoning"])
        msg: dict = {"role": "assistant", "content": _content(rng, 1)}
        if style == "reasoning":
            msg["reasoning_content"] = _text(rng, 0, 5)
        elif style == "empty_reasoning":
            msg["reasoning_content"] = ""
        elif style == "inline":
            msg["content"] = f"<think>{_text(rng, 0, 4)}</think>{_text(rng, 1, 4)}"
        if style == "tools":
            if rng.random() < 0.5:
                msg["content"] = rng.choice([None, ""]) if rng.random() < 0.7 else _text(rng, 1, 3)
                if msg["content"] is None and rng.random() < 0.5:
                    del msg["content"]
            n = rng.randint(1, 3)
            msg["tool_calls"] = [
                call(
                    rng.choice(["get_weather", "search", "f"]),
                    {f"p{j}": _value(rng) for j in range(rng.randint(0, 3))},
                    f"c{k}",
                )
                for k in range(n)
            ]
            messages.append(msg)
            for k in range(rng.randint(1, n)):
                messages.append(
                    {"role": "tool", "tool_call_id": f"c{k}", "name": "f", "content": _content(rng, 0, 4)}
                )
            if rng.random() < 0.6:
                messages.append({"role": "assistant", "content": _content(rng, 1)})
            continue
        messages.append(msg)
    if rng.random() < 0.03:
        messages.insert(rng.randint(1, len(messages)), {"role": "system", "content": "late"})
    row["messages"] = messages
    return row


def random_rows(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [random_row(rng) for _ in range(n)]
