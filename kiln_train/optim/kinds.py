"""The optimizer registry: one entry per kind, read by everything that treats kinds differently.

An entry names the kind's request object (`configs.py`), its update class (imported only when a
run builds it, so this module stays torch-free), its default learning rate, its rank rule, and the
per-parameter state buffers it keeps. The request contract (`sft_config`), the support report and
rank gate (`plan/optimizer_support.py`), memory pricing (`plan/memory.py`), checkpoint manifests and
their rules, the precision policy, the UI's defaults and the OpenAPI document all read it, so
adding an optimizer is one entry here plus its update class (docs/ARCHITECTURE.md#how-to-add-an-optimizer).

`OptimizerConfig` is the request's `optimizer` field: it validates by the registry as it stands
when a request arrives, and its JSON schema is the tagged union of the kinds registered when the
models were built (the built-in three).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Union

from pydantic import BaseModel, Field, TypeAdapter
from pydantic_core import core_schema

from kiln_train.optim.configs import ADAMW_SCHEMA, MUON_SCHEMA, AdamWConfig, MuonConfig, SgdConfig


@dataclass(frozen=True)
class OptimizerKind:
    """What Kiln knows about one optimizer kind.

    - `kind`: the contract's `optimizer.kind` value; `title`: its name for people (the UI).
    - `config`: the request object's pydantic class (its `kind` field is `Literal[kind]`).
    - `update`: `"module:Class"` of the `Optimizer` subclass that applies the update.
    - `default_learning_rate`: the resolved learning rate when a request omits it.
    - `minimum_rank`: the smallest `lora_rank` the update is defined for.
    - `backend_rank_ceiling`: whether the backend's rank ceiling (`Backend.muon_rank_max`) applies.
    - `state_fields`: the per-parameter state buffers, each the shape of its parameter.
    - `state_key_segment`: the kind's segment of `optimizer.safetensors` keys (`{key}.adamw.m`).
    - `schema_constraints`: JSON Schema per field of `config` for what its validators check (OpenAPI).
    """

    kind: str
    title: str
    config: type[BaseModel]
    update: str
    default_learning_rate: float
    minimum_rank: int = 1
    backend_rank_ceiling: bool = False
    state_fields: tuple[str, ...] = ()
    state_key_segment: str = ""
    schema_constraints: Mapping[str, dict] = field(default_factory=dict)

    @property
    def keeps_state(self) -> bool:
        """Whether a checkpoint carries `optimizer.safetensors` (and the precision policy a state dtype)."""
        return bool(self.state_fields)

    @property
    def state_buffers(self) -> int:
        """Parameter-sized state buffers per trainable leaf (memory pricing)."""
        return len(self.state_fields)

    def update_class(self) -> type:
        """The update class (imports torch)."""
        module, _, name = self.update.partition(":")
        return getattr(importlib.import_module(module), name)

    def default_config(self) -> BaseModel:
        """The request object with every field at its default."""
        return self.config(kind=self.kind)

    def field_types(self) -> dict[str, str]:
        """The request object's own fields (not `kind`) and their JSON types, in declaration order."""
        names = {bool: "boolean", int: "integer", float: "number", str: "string"}
        return {
            name: names.get(info.annotation, "string")
            for name, info in self.config.model_fields.items()
            if name != "kind"
        }


# In contract order: the support report, the UI and every error message list kinds this way.
_REGISTRY: dict[str, OptimizerKind] = {
    entry.kind: entry
    for entry in (
        OptimizerKind(
            kind="muon",
            title="Muon",
            config=MuonConfig,
            update="kiln_train.optim.muon:Muon",
            default_learning_rate=1e-3,
            minimum_rank=2,
            backend_rank_ceiling=True,
            state_fields=("momentum",),
            state_key_segment="muon",
            schema_constraints=MUON_SCHEMA,
        ),
        OptimizerKind(
            kind="adam_w",
            title="AdamW",
            config=AdamWConfig,
            update="kiln_train.optim.adamw:AdamW",
            default_learning_rate=1e-4,
            state_fields=("m", "v"),
            state_key_segment="adamw",
            schema_constraints=ADAMW_SCHEMA,
        ),
        OptimizerKind(
            kind="sgd",
            title="SGD",
            config=SgdConfig,
            update="kiln_train.optim.sgd:Sgd",
            default_learning_rate=1e-4,
            state_key_segment="sgd",
        ),
    )
}


def optimizer_kinds() -> tuple[str, ...]:
    """Every registered kind, in contract order."""
    return tuple(_REGISTRY)


def registered() -> tuple[OptimizerKind, ...]:
    """Every registered entry, in contract order."""
    return tuple(_REGISTRY.values())


def optimizer_kind(kind: str) -> OptimizerKind:
    """The entry of `kind`; ValueError for any other value."""
    entry = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if entry is None:
        raise ValueError(f"unknown optimizer kind {kind!r}")
    return entry


def keeps_state(kind: str) -> bool:
    """Whether the `kind` optimizer keeps per-parameter state (checkpoints carry it; SGD keeps none)."""
    return optimizer_kind(kind).keeps_state


def register(entry: OptimizerKind) -> None:
    """Add a kind after the others (ValueError if its name or key segment is taken)."""
    if entry.kind in _REGISTRY:
        raise ValueError(f"optimizer kind {entry.kind!r} is already registered")
    kind_field = entry.config.model_fields.get("kind")
    if kind_field is None or getattr(kind_field.annotation, "__args__", None) != (entry.kind,):
        raise ValueError(f"{entry.config.__name__}.kind must be Literal[{entry.kind!r}]")
    if any(e.state_key_segment == entry.state_key_segment for e in _REGISTRY.values()):
        raise ValueError(f"state key segment {entry.state_key_segment!r} is already used")
    _REGISTRY[entry.kind] = entry


def unregister(kind: str) -> None:
    """Remove a kind `register` added (the built-in kinds stay)."""
    if kind in _BUILT_IN:
        raise ValueError(f"the built-in optimizer kind {kind!r} cannot be removed")
    _REGISTRY.pop(kind, None)


_BUILT_IN = frozenset(_REGISTRY)


def expected_kinds_message() -> str:
    """`Input should be 'muon', 'adam_w' or 'sgd'`, as pydantic words a literal mismatch."""
    quoted = [repr(k) for k in _REGISTRY]
    listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return f"Input should be {listed}"


def known_kind(kind: str) -> str:
    """`kind` when it is registered (a field validator for records that name a kind)."""
    if kind not in _REGISTRY:
        raise ValueError(expected_kinds_message())
    return kind


def _union_members() -> tuple[type[BaseModel], ...]:
    """The config classes of the tagged union, newest entry first: the order the OpenAPI `oneOf` and
    pydantic's "expected tags" message have always listed them in (sgd, adam_w, muon)."""
    return tuple(e.config for e in reversed(_REGISTRY.values()))


def _tagged_union(configs: tuple[type[BaseModel], ...]) -> Any:
    return Annotated[Union[configs], Field(discriminator="kind")]  # noqa: UP007 (a runtime tuple)


_ADAPTERS: dict[tuple[type[BaseModel], ...], TypeAdapter] = {}


def _validate_choice(value: Any) -> BaseModel:
    configs = _union_members()
    adapter = _ADAPTERS.get(configs)
    if adapter is None:
        adapter = _ADAPTERS[configs] = TypeAdapter(_tagged_union(configs))
    return adapter.validate_python(value)


class _OptimizerChoice:
    """Pydantic hooks of `OptimizerConfig` (validation by the live registry, schema by the built one)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        built = _union_members()
        union = handler.generate_schema(_tagged_union(built))

        def serialize(value: BaseModel, plain: Any, info: Any) -> Any:
            return plain(value) if type(value) in built else value.model_dump(mode=info.mode)

        return core_schema.no_info_wrap_validator_function(
            lambda value, _built_union: _validate_choice(value),
            union,
            serialization=core_schema.wrap_serializer_function_ser_schema(
                serialize, info_arg=True, schema=union
            ),
        )


# The request's tagged `optimizer` object: one of the registered kinds' config classes.
OptimizerConfig = Annotated[BaseModel, _OptimizerChoice]
