"""JSON from outside, read with a bound on nesting: the one reader for untrusted JSON documents.

`json.loads` recurses once per level of arrays and objects; a 33 KB file of `[` x 100000 makes it
raise RecursionError, which no caller expects of a parser and which a route would answer with a
500. Here that is a ValueError (`JsonTooDeep`) like any other malformed document, and a document
that parses but nests deeper than the bound is refused the same way, so every reader of uploaded
files (PEFT configs, safetensors headers, run results and manifests) refuses it with its own
contract error and the same words.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

MAX_DEPTH = 64


class JsonTooDeep(ValueError):
    """A document nested deeper than the bound (a ValueError, so parse errors catch it)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"nested deeper than {limit} levels of arrays and objects")
        self.limit = limit


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Levels of arrays and objects in `value` (a scalar is 0), walked without recursion; stops at
    `limit + 1` so a hostile value costs no more than reaching the bound."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if level > deepest:
            deepest = level
            if deepest > limit:
                return limit + 1
        stack.extend((child, level + 1) for child in children if isinstance(child, dict | list | tuple))
    return deepest


def loads(
    data: bytes | str,
    *,
    limit: int = MAX_DEPTH,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """The JSON value in `data` (bytes are UTF-8). Raises UnicodeDecodeError, or ValueError:
    `json.JSONDecodeError` for malformed text, `JsonTooDeep` past `limit` levels."""
    text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    try:
        value = json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise JsonTooDeep(limit) from None
    if depth(value, limit) > limit:
        raise JsonTooDeep(limit)
    return value
