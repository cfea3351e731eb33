"""The common optimizer interface: an all-or-nothing step over an exact gradient set.

See docs/training-profile.md#gradient-set and docs/optimizers.md#precision:

- `step(grads)` first checks the whole gradient set (exact key set, each gradient's shape, dtype
  and device equal to its leaf's, every value finite) and raises `GradientSetError` before any
  parameter, state buffer or step counter changes. A finite all-zero gradient is valid.
- f32 parameters are updated with f32 math. bf16 parameters are upcast (parameter, gradient and
  state) to f32 temporaries, updated with the same f32 math and rounded once, to nearest even,
  back into the resident bf16 tensors. Nothing f32 survives between steps (no master copy).
- State serialises to f32 CPU tensors plus per-parameter `uint32` step counters keyed as
  docs/checkpoints.md#optimizer-state says (`state.py` owns the key layout), and restores into
  the resident dtype and device.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from kiln_train.errors import TrainingFailure
from kiln_train.optim import state as state_keys
from kiln_train.optim.kinds import optimizer_kind

SUPPORTED_PARAMETER_DTYPES = (torch.float32, torch.bfloat16)
U32_MAX = 2**32 - 1


class GradientSetError(TrainingFailure):
    """The observed gradient set is not exactly the trainable leaf set, or is not finite."""

    def __init__(self, message: str) -> None:
        super().__init__("training_error", message)


class OptimizerStateError(TrainingFailure):
    """Serialised optimizer state does not fit this optimizer (keys, shapes, values, counters)."""

    def __init__(self, message: str) -> None:
        super().__init__("training_error", message)


def _describe(t: Tensor) -> str:
    return f"shape {list(t.shape)}, dtype {str(t.dtype).removeprefix('torch.')}, device {t.device}"


class Optimizer(ABC):
    """One optimizer over named trainable leaves.

    Subclasses set `kind` (a registered kind, `kinds.py`, whose entry names the per-parameter
    `state_fields`, e.g. `("m", "v")`, that each instance takes at construction) and
    `hyperparameter_names` (the attributes `hyperparameters()` reports, in contract order), and
    implement `_update(name, param, grad)`, which runs under `torch.no_grad()` after the whole
    gradient set has been validated and must not fail for a valid set.
    """

    kind: str = ""
    state_fields: tuple[str, ...] = ()
    hyperparameter_names: tuple[str, ...] = ()

    def __init__(self, params: Sequence[tuple[str, torch.nn.Parameter]], lr: float) -> None:
        if not (isinstance(lr, int | float) and not isinstance(lr, bool)):
            raise TypeError(f"lr must be a real number, got {type(lr).__name__}")
        lr = float(lr)
        if not math.isfinite(lr) or lr <= 0.0:
            raise ValueError(f"lr must be finite and positive, got {lr!r}")
        self.lr = lr
        self.state_fields = optimizer_kind(self.kind).state_fields
        self.params: dict[str, Tensor] = {}
        for name, param in params:
            if not isinstance(name, str) or not name:
                raise ValueError(f"parameter names must be non-empty strings, got {name!r}")
            if name in self.params:
                raise ValueError(f"duplicate parameter name {name!r}")
            if not isinstance(param, Tensor):
                raise TypeError(f"parameter {name!r} is not a tensor")
            if param.dtype not in SUPPORTED_PARAMETER_DTYPES:
                raise ValueError(f"parameter {name!r} has unsupported dtype {param.dtype}: use f32 or bf16")
            self.params[name] = param
        if not self.params:
            raise ValueError("an optimizer needs at least one trainable parameter")
        self.step_count = 0
        self.param_steps: dict[str, int] = dict.fromkeys(self.params, 0)
        # Resident state: same dtype and device as the parameter (no f32 master copy).
        self.state: dict[str, dict[str, Tensor]] = {
            name: {f: torch.zeros_like(p, memory_format=torch.contiguous_format) for f in self.state_fields}
            for name, p in self.params.items()
        }

    # ----- the step -------------------------------------------------------------------
    def step(self, grads: dict[str, Tensor]) -> None:
        """Apply one update, or raise `GradientSetError` having changed nothing."""
        self.check_gradients(grads)
        with torch.no_grad():
            for name, param in self.params.items():
                self.param_steps[name] += 1
                self._update(name, param, grads[name])
        self.step_count += 1

    def check_gradients(self, grads: dict[str, Tensor]) -> None:
        """The exact-set, metadata and finite checks; one device sync for the finite reduction."""
        if not isinstance(grads, dict):
            raise GradientSetError(
                f"the gradient set must be a mapping of leaf name to tensor, got {type(grads)}"
            )
        missing = [n for n in self.params if n not in grads]
        if missing:
            raise GradientSetError(
                f"gradient set is missing {len(missing)} trainable leaf(s), first {missing[0]!r}"
            )
        unknown = [n for n in grads if n not in self.params]
        if unknown:
            raise GradientSetError(
                f"gradient set has {len(unknown)} unknown leaf(s) that are not trainable, first {unknown[0]!r}"
            )
        for name, param in self.params.items():
            grad = grads[name]
            if not isinstance(grad, Tensor):
                raise GradientSetError(f"gradient for leaf {name!r} is not a tensor ({type(grad).__name__})")
            if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
                raise GradientSetError(
                    f"gradient for leaf {name!r} does not match the leaf: gradient has {_describe(grad)}, "
                    f"leaf has {_describe(param)}"
                )
        # One reduction per leaf, stacked on the device, read back once per device (one sync).
        by_device: dict[torch.device, list[str]] = {}
        for name in self.params:
            by_device.setdefault(grads[name].device, []).append(name)
        bad: list[str] = []
        for names in by_device.values():
            finite = torch.stack([torch.isfinite(grads[n]).all() for n in names]).cpu()
            bad += [n for n, ok in zip(names, finite.tolist(), strict=True) if not ok]
        if bad:
            name = next(n for n in self.params if n in bad)
            grad = grads[name]
            nan = int(torch.isnan(grad).sum())
            inf = int(torch.isinf(grad).sum())
            raise GradientSetError(
                f"gradient for leaf {name!r} is not finite ({nan} NaN and {inf} infinite value(s))"
            )

    @abstractmethod
    def _update(self, name: str, param: Tensor, grad: Tensor) -> None:
        """Apply one update to `param` in place (under no_grad, after the set was validated)."""

    # ----- serialisation (docs/checkpoints.md#optimizer-state) ---------------------------
    def state_tensors(self) -> dict[str, Tensor]:
        """F32 CPU copies of every state buffer plus `uint32 [1]` step counters; empty when stateless."""
        out: dict[str, Tensor] = {}
        if not self.state_fields:
            return out
        for name in self.params:
            for f in self.state_fields:
                key = state_keys.state_key(name, self.kind, f)
                out[key] = self.state[name][f].detach().to("cpu", torch.float32, copy=True).contiguous()
            if self.param_steps[name] > U32_MAX:
                raise OptimizerStateError(f"step counter of {name!r} no longer fits the u32 checkpoint field")
            out[state_keys.state_key(name, self.kind, state_keys.STEP)] = torch.tensor(
                [self.param_steps[name]], dtype=torch.uint32
            )
        return out

    def expected_state_keys(self) -> list[str]:
        if not self.state_fields:
            return []
        return [
            state_keys.state_key(name, self.kind, f)
            for name in self.params
            for f in (*self.state_fields, state_keys.STEP)
        ]

    def load_state_tensors(self, tensors: dict[str, Tensor], *, global_step: int) -> None:
        """Restore state saved by `state_tensors`; validates everything before changing anything."""
        if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
            raise OptimizerStateError(f"global_step must be a non-negative integer, got {global_step!r}")
        expected = self.expected_state_keys()
        _check_key_set(self.kind, expected, tensors)
        steps: dict[str, int] = {}
        for name, param in self.params.items():
            for f in self.state_fields:
                key = state_keys.state_key(name, self.kind, f)
                t = tensors[key]
                if t.dtype != torch.float32:
                    raise OptimizerStateError(f"optimizer state {key!r} must be f32, found {t.dtype}")
                if t.shape != param.shape:
                    raise OptimizerStateError(
                        f"optimizer state {key!r} has shape {list(t.shape)}, "
                        f"parameter {name!r} has {list(param.shape)}"
                    )
                if not bool(torch.isfinite(t).all()):
                    raise OptimizerStateError(f"optimizer state {key!r} contains non-finite values")
            if self.state_fields:
                key = state_keys.state_key(name, self.kind, state_keys.STEP)
                steps[name] = _read_step(key, tensors[key], global_step)
        with torch.no_grad():
            for name, param in self.params.items():
                for f in self.state_fields:
                    src = tensors[state_keys.state_key(name, self.kind, f)]
                    self.state[name][f] = src.to(
                        device=param.device, dtype=param.dtype, copy=True
                    ).contiguous()
        self.param_steps = steps if self.state_fields else dict.fromkeys(self.params, global_step)
        self.step_count = global_step

    def hyperparameters(self) -> dict:
        """The optimizer object as the contract spells it (used in manifests and receipts)."""
        return {"kind": self.kind, **{name: getattr(self, name) for name in self.hyperparameter_names}}


def _check_key_set(kind: str, expected: Iterable[str], tensors: dict[str, Tensor]) -> None:
    if not isinstance(tensors, dict):
        raise OptimizerStateError(f"{kind} optimizer state must be a mapping of key to tensor")
    expected = list(expected)
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise OptimizerStateError(
            f"{kind} optimizer state is missing {len(missing)} key(s), first {missing[0]!r}"
        )
    wanted = set(expected)
    unknown = sorted(k for k in tensors if k not in wanted)
    if unknown:
        raise OptimizerStateError(
            f"{kind} optimizer state has {len(unknown)} unexpected key(s), first {unknown[0]!r}"
        )
    for key in expected:
        if not isinstance(tensors[key], Tensor):
            raise OptimizerStateError(f"optimizer state {key!r} is not a tensor")


def _read_step(key: str, t: Tensor, global_step: int) -> int:
    if t.dtype != torch.uint32 or list(t.shape) != [1]:
        raise OptimizerStateError(
            f"optimizer step counter {key!r} must be uint32 with shape [1], found {t.dtype} {list(t.shape)}"
        )
    # uint32 has limited op support; widen before reading.
    value = int(t.to(torch.int64)[0])
    if value > global_step:
        raise OptimizerStateError(
            f"optimizer step counter {key!r} is {value}, beyond the checkpoint's global step {global_step}"
        )
    return value


def upcast(t: Tensor) -> Tensor:
    """An f32 view of `t`: the tensor itself when already f32, else an f32 temporary."""
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def write_back(dst: Tensor, src32: Tensor) -> None:
    """Store an f32 result into the resident tensor, rounding once (to nearest even) if bf16."""
    if src32 is not dst:
        dst.copy_(src32)
