"""Refusals that say what to write instead: the field a person probably meant when they wrote an
unknown one (`config.epoch` → `epochs`), the accepted forms of a tagged object when it arrives in
the wrong shape (`"optimizer": "adamw"` → `{"kind": "adam_w"}`), and the parent a misplaced field
belongs under (`epochs` at the top of a request → `config.epochs`).

Works on any pydantic model by walking the core schema pydantic validates with (so a new field,
a new tag or a registry of tagged kinds needs no change here). Torch-free; imports nothing of kiln_train.
"""

from __future__ import annotations

import difflib
import json
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

# How alike a written name and a field's name must be to be offered (difflib's ratio, 0..1):
# `epoch`/`epochs` is 0.91, `lora_rnk`/`lora_rank` 0.94, `lr`/`learning_rate` 0.27 (not offered).
CUTOFF = 0.7
# The pydantic error types that mean "this tagged object has the wrong shape".
TAGGED_SHAPE_ERRORS = ("model_attributes_type", "model_type", "union_tag_invalid", "union_tag_not_found")


def nearest(word: str, names: typing.Iterable[str]) -> str | None:
    """The name in `names` closest to `word` (case ignored), or None when none is close."""
    by_folded = {n.lower(): n for n in names}
    close = difflib.get_close_matches(word.lower(), list(by_folded), n=1, cutoff=CUTOFF)
    return by_folded[close[0]] if close else None


# Core-schema nodes that only wrap the schema inside them (validators, defaults, Optional).
_WRAPPERS = ("function-after", "function-before", "function-wrap", "function-plain", "default", "nullable")


@dataclass(frozen=True)
class _Held:
    """What a field holds: its model classes and, for a tagged union, the tag field and each
    tag's class (in the union's order)."""

    models: tuple[type[BaseModel], ...] = ()
    tag: str | None = None
    by_tag: tuple[tuple[str, type[BaseModel]], ...] = ()


def _unwrap(schema: dict, refs: dict[str, dict]) -> dict:
    """The node under validator, default, Optional and definition wrappers."""
    while True:
        kind = schema.get("type")
        if kind == "definitions":
            refs.update({d["ref"]: d for d in schema.get("definitions", []) if "ref" in d})
            schema = schema["schema"]
        elif kind == "definition-ref":
            schema = refs.get(schema.get("schema_ref"), {})
        elif kind in _WRAPPERS and isinstance(schema.get("schema"), dict):
            schema = schema["schema"]
        else:
            return schema


def _held(model: type[BaseModel], field: str) -> _Held:
    """What `model.field` holds, read from pydantic's core schema: the validation pydantic
    really runs, however the annotation is spelled (a plain union, a registry's wrapper)."""
    refs: dict[str, dict] = {}
    top = _unwrap(getattr(model, "__pydantic_core_schema__", {}), refs)
    if top.get("type") != "model":
        return _Held()
    fields = _unwrap(top.get("schema", {}), refs).get("fields", {})
    if field not in fields:
        return _Held()
    node = _unwrap(fields[field].get("schema", {}), refs)
    if node.get("type") == "model":
        return _Held(models=(node["cls"],))
    if node.get("type") == "tagged-union" and isinstance(node.get("discriminator"), str):
        by_tag = [(str(tag), _unwrap(choice, refs)) for tag, choice in node.get("choices", {}).items()]
        pairs = tuple((tag, choice["cls"]) for tag, choice in by_tag if choice.get("type") == "model")
        models = tuple(dict.fromkeys(cls for _, cls in pairs))
        return _Held(models=models, tag=node["discriminator"], by_tag=pairs)
    if node.get("type") == "union":
        choices = [c[0] if isinstance(c, tuple) else c for c in node.get("choices", [])]
        found = [_unwrap(c, refs) for c in choices]
        return _Held(models=tuple(c["cls"] for c in found if c.get("type") == "model"))
    return _Held()


def _walk(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[type[BaseModel], str] | None:
    """(the model holding the last part of `loc`, that part), following pydantic's error path:
    a field name descends into its model, a tag value picks one member of a tagged union."""
    *path, last = loc
    parts = [str(p) for p in path]
    while parts:
        held = _held(model, parts.pop(0))
        if held.tag is None and len(held.models) == 1:
            model = held.models[0]
            continue
        if held.tag is None or not parts:
            return None
        chosen = dict(held.by_tag).get(parts.pop(0))
        if chosen is None:
            return None
        model = chosen
    return model, str(last)


def unknown_field_hint(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """`did you mean `epochs`?` for an unknown field at `loc`, or where a field of a nested
    part was written one level too high (`belongs under `config``)."""
    found = _walk(model, loc) if loc else None
    if found is None:
        return None
    holder, written = found
    close = nearest(written, holder.model_fields)
    if close is not None:
        return f"did you mean `{close}`?"
    for name in holder.model_fields:
        for child in _held(holder, name).models:
            if written in child.model_fields:
                return f"`{written}` belongs under `{name}` (`{name}.{written}`)"
            close = nearest(written, child.model_fields)
            if close is not None:
                return f"did you mean `{name}.{close}`?"
    return None


def tagged_shape_message(model: type[BaseModel], loc: tuple[Any, ...], value: Any) -> str | None:
    """For a tagged object given in the wrong shape (a string, a list, an unknown tag), the
    accepted forms, e.g. `must be an object with a "kind": {"kind": "muon"}, {"kind": "adam_w"}
    or {"kind": "sgd"}; did you mean {"kind": "adam_w"}?`. None when `loc` is no tagged field."""
    if not loc:
        return None
    found = _walk(model, loc)
    if found is None:
        return None
    holder, field = found
    held = _held(holder, field)
    tag, tags = held.tag, [t for t, _ in held.by_tag]
    if tag is None or not tags:
        return None
    forms = [json.dumps({tag: t}) for t in tags]
    accepted = ", ".join(forms[:-1]) + f" or {forms[-1]}" if len(forms) > 1 else forms[0]
    message = f"must be an object with a {json.dumps(tag)}: {accepted}; {_found(value, tag)}"
    written = value.get(tag) if isinstance(value, dict) else value
    if isinstance(written, str):
        close = nearest(written, tags)
        if close is not None:
            message += f"; did you mean {json.dumps({tag: close})}?"
    return message


def _found(value: Any, tag: str) -> str:
    """What arrived instead of a tagged object, in a few words."""
    if isinstance(value, dict):
        if tag not in value:
            return f"the object has no {json.dumps(tag)}"
        return f"{json.dumps(tag)} {value[tag]!r} is none of them"[:200]
    if isinstance(value, str):
        return f"got the string {value[:80]!r}"
    names = {list: "a list", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}
    return f"got {names.get(type(value), type(value).__name__)}"


def refusal_text(model: type[BaseModel], err: dict[str, Any], relative_loc: tuple[Any, ...]) -> str | None:
    """A better sentence than pydantic's for one error of `model`, or None to keep its own.
    `relative_loc` is the error's path inside `model` (pydantic's `loc`)."""
    kind = err.get("type")
    if kind == "extra_forbidden":
        hint = unknown_field_hint(model, relative_loc)
        return None if hint is None else f"unknown field; {hint}"
    if kind in TAGGED_SHAPE_ERRORS:
        loc = relative_loc
        # an unknown tag is reported one level deeper (at the tag field) by some pydantic paths
        message = tagged_shape_message(model, loc, err.get("input"))
        if message is None and len(loc) > 1:
            message = tagged_shape_message(model, loc[:-1], err.get("input"))
        return message
    return None
