"""LoRA adapters on the ten Qwen3.5 targets (docs/training-profile.md#lora, docs/artifacts.md#tensor-names).

Targets (LORA_TARGET_MODULES): q_proj k_proj v_proj o_proj (self_attn), in_proj_qkv in_proj_z
out_proj (linear_attn), gate_proj up_proj down_proj (mlp). Names are the PEFT keys of the Hugging
Face module paths, `base_model.model.model.layers.{i}.{self_attn|linear_attn|mlp}.{target}.lora_{A|B}.weight`,
so PEFT and serving engines load the adapter without a remap. Shapes: A [r, in], B [out, r];
y = base(x) + (alpha/r)·(x·Aᵀ)·Bᵀ, no dropout.

Initialisation `kiln-py.seeded-lora-init.v1` (exact algorithm, so a seed reproduces an adapter):
one CPU `torch.Generator` seeded with `seed`; for every projection in `named_parameters` order
(layer ascending, then the target order above), draw A as a float32 CPU tensor of shape [r, in]
with `Tensor.uniform_(-b, b, generator=gen)`, b = sqrt(1/in) (the Kaiming-uniform bound of the
contract), then cast it to the LoRA dtype and move it to the model's device; B is zeros.
This is the Python port's own algorithm: its streams differ from the Rust `kiln.seeded-lora-init.v1`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kiln_train.model.config import Projection
from kiln_train.model.linear import FrozenLinear

PEFT_KEY_PREFIX = "base_model.model.model."


def lora_key(module_path: str, which: str) -> str:
    """PEFT tensor key of `layers.{i}.{sub}.{target}` for which in {"A", "B"}."""
    return f"{PEFT_KEY_PREFIX}{module_path}.lora_{which}.weight"


@dataclass(frozen=True)
class LoraEntry:
    name: str
    parameter: nn.Parameter
    layer: int
    module: str  # HF module path without the root, e.g. "layers.3.self_attn.q_proj"
    target: str
    kind: str  # "A" | "B"


class LoraSet:
    """The trainable LoRA leaves of one model, in a stable order, under their PEFT names."""

    def __init__(self, rank: int, alpha: float, seed: int, entries: list[LoraEntry], modules: dict) -> None:
        self.rank = rank
        self.alpha = float(alpha)
        self.scale = self.alpha / rank
        self.seed = seed
        self._entries = entries
        self._by_name = {e.name: e for e in entries}
        self._modules: dict[str, FrozenLinear] = modules

    # ----- listing ----------------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(PEFT key, leaf) for every A and B: layer, then target order, then A before B."""
        return [(e.name, e.parameter) for e in self._entries]

    def parameters(self) -> list[nn.Parameter]:
        return [e.parameter for e in self._entries]

    def names(self) -> list[str]:
        return [e.name for e in self._entries]

    def entry(self, name: str) -> LoraEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no LoRA tensor named {name!r}") from None

    def __len__(self) -> int:
        return len(self._entries)

    # ----- state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Detached tensors sharing storage with the leaves (clone for a snapshot)."""
        return {e.name: e.parameter.detach() for e in self._entries}

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy values in place (the leaves keep their identity, so optimizers stay attached)."""
        missing = [n for n in self._by_name if n not in state]
        unexpected = [n for n in state if n not in self._by_name]
        if strict and (missing or unexpected):
            raise ValueError(f"LoRA state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, value in state.items():
            entry = self._by_name.get(name)
            if entry is None:
                continue
            if tuple(value.shape) != tuple(entry.parameter.shape):
                raise ValueError(
                    f"LoRA tensor {name!r} has shape {tuple(value.shape)}, "
                    f"expected {tuple(entry.parameter.shape)}"
                )
            with torch.no_grad():
                entry.parameter.copy_(value.to(device=entry.parameter.device, dtype=entry.parameter.dtype))

    def remove(self, model) -> None:
        """Detach the adapters from the model (it becomes the plain frozen base again)."""
        for module in self._modules.values():
            module.clear_lora()
        if getattr(model, "lora", None) is self:
            model.lora = None


def _draw_a(proj: Projection, rank: int, gen: torch.Generator) -> torch.Tensor:
    bound = math.sqrt(1.0 / proj.in_features)
    return torch.empty(rank, proj.in_features, dtype=torch.float32).uniform_(-bound, bound, generator=gen)


def attach_lora(model, rank: int, alpha: float, seed: int, dtype: torch.dtype | None = None) -> LoraSet:
    """Add LoRA pairs to the ten targets of every layer (`kiln-py.seeded-lora-init.v1`)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora rank must be a positive integer, got {rank!r}")
    if not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"lora alpha must be finite and positive, got {alpha!r}")
    if getattr(model, "lora", None) is not None:
        raise ValueError("a LoRA set is already attached to this model; remove it first")
    dtype = dtype or model.dtype
    device = model.device
    scale = float(alpha) / rank
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    entries: list[LoraEntry] = []
    modules: dict[str, FrozenLinear] = {}
    for proj in model.config.projections():
        module = model.get_submodule(proj.module)
        a = nn.Parameter(_draw_a(proj, rank, gen).to(device=device, dtype=dtype))
        b = nn.Parameter(torch.zeros(proj.out_features, rank, device=device, dtype=dtype))
        module.set_lora(a, b, scale)
        modules[proj.module] = module
        for kind, param in (("A", a), ("B", b)):
            entries.append(
                LoraEntry(lora_key(proj.module, kind), param, proj.layer, proj.module, proj.target, kind)
            )
    lora = LoraSet(rank, alpha, int(seed), entries, modules)
    model.lora = lora
    return lora


def release_lora(model) -> None:
    """Detach whatever LoRA set is attached, leaving the resident base model as loaded."""
    lora = getattr(model, "lora", None)
    if lora is not None:
        lora.remove(model)
