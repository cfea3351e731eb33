"""Reading the served OpenAPI document in the tests that hold it to the server."""

from __future__ import annotations

import math
import re


def matches(schema: dict, value: str) -> bool:
    """The string keywords the document uses (pattern, min/maxLength, enum, not/anyOf)."""
    # ECMA-262 `$` is the end of input; Python's also matches before a final newline.
    if "pattern" in schema and not re.search(schema["pattern"].replace("$", r"\Z"), value):
        return False
    if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", math.inf):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "anyOf" in schema and not any(matches(s, value) for s in schema["anyOf"]):
        return False
    return not ("not" in schema and matches(schema["not"], value))
