"""Refusals that say what to write instead: the field a person probably meant when they wrote an
unknown one (`config.epoch` → `epochs`), the accepted forms of a tagged object when it arrives in
the wrong shape (`"optimizer": "adamw"` → `{"kind": "adam_w"}`), and the parent a misplaced field
belongs under (`epochs` at the top of a request → `config.epochs`).

Works on any pydantic model by walking its field annotations, so a new field or a new tag needs
no change here. Torch-free; imports nothing of kiln_train.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from typing import Any, Literal

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


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation admits (through Optional, unions, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def _tag_values(model: type[BaseModel], tag: str) -> tuple[str, ...]:
    """The literal values a model's tag field accepts (`kind: Literal["muon"]` → `("muon",)`)."""
    info = model.model_fields.get(tag)
    if info is None or typing.get_origin(info.annotation) is not Literal:
        return ()
    return tuple(str(v) for v in typing.get_args(info.annotation))


def _discriminator(model: type[BaseModel], field: str) -> str | None:
    info = model.model_fields.get(field)
    if info is None:
        return None
    tag = info.discriminator
    if tag is None:
        for meta in typing.get_args(info.annotation)[1:]:
            tag = getattr(meta, "discriminator", None) or tag
    return tag if isinstance(tag, str) else None


def _walk(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[type[BaseModel], str] | None:
    """(the model holding the last part of `loc`, that part), following pydantic's error path:
    a field name descends into its model, a tag value picks one member of a tagged union."""
    *path, last = loc
    parts = list(path)
    while parts:
        part = parts.pop(0)
        info = model.model_fields.get(str(part))
        if info is None:
            return None
        members = _models_in(info.annotation)
        if len(members) == 1:
            model = members[0]
            continue
        tag = _discriminator(model, str(part))
        if not members or tag is None or not parts:
            return None
        chosen = [m for m in members if str(parts[0]) in _tag_values(m, tag)]
        if len(chosen) != 1:
            return None
        parts.pop(0)
        model = chosen[0]
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
    for name, info in holder.model_fields.items():
        for child in _models_in(info.annotation):
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
    tag = _discriminator(holder, field)
    info = holder.model_fields.get(field)
    if tag is None or info is None:
        return None
    tags = [t for m in _models_in(info.annotation) for t in _tag_values(m, tag)]
    if not tags:
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
