"""The bounded reader of untrusted JSON: too deep is a ValueError with the bound, never a
RecursionError; everything else parses as json.loads does."""

from __future__ import annotations

import json

import pytest

from kiln_train.ground import json_bounded


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_the_bound_itself_parses_and_one_more_level_is_refused():
    assert json_bounded.depth(json_bounded.loads(nested(64))) == 64
    with pytest.raises(json_bounded.JsonTooDeep, match="nested deeper than 64 levels"):
        json_bounded.loads(nested(65))


@pytest.mark.parametrize("levels", [500, 100_000])
def test_past_the_interpreters_recursion_limit_is_a_value_error(levels):
    with pytest.raises(ValueError, match="nested deeper than 8 levels"):
        json_bounded.loads(nested(levels).encode(), limit=8)


def test_objects_count_as_levels_and_hooks_are_kept():
    text = '{"a": {"b": [1, {"c": 2}]}}'
    assert json_bounded.loads(text) == json.loads(text)
    with pytest.raises(json_bounded.JsonTooDeep):
        json_bounded.loads(text, limit=3)
    pairs = json_bounded.loads('{"x": 1, "y": 2}', object_pairs_hook=list)
    assert pairs == [("x", 1), ("y", 2)]


def test_malformed_and_non_utf8_keep_their_own_errors():
    with pytest.raises(json.JSONDecodeError):
        json_bounded.loads("[1,")
    with pytest.raises(UnicodeDecodeError):
        json_bounded.loads(b"\xff[]")
