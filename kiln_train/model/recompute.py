"""What the layers keep for backward: projection groups and recomputed cores (docs/performance.md).

A LoRA step needs, for its backward, only the input of each trained projection and the inputs of
the nonlinearities; everything in between can be recomputed from those for far less than the
base matmuls cost. Two autograd functions make the layers keep exactly that:

- `project(prologue, inputs, linears)`: y = prologue(*inputs) (a norm, SiLU·up, the output gate,
  or nothing), then every frozen projection of y with its LoRA pair. Only `inputs` are kept; the
  backward recomputes y, forms each projection's input gradient (y·Wᵀ's needs only W) and LoRA
  gradients, and backpropagates through the recomputed prologue. y itself, the LoRA
  intermediates and the prologue's f32 internals are never kept.
- `recompute(fn, *inputs)`: a weight-free core (GDN's conv + delta rule, attention's q/k norms,
  RoPE and softmax attention) whose forward runs without a graph and is rebuilt from its inputs in
  backward, like a checkpoint, but saved through `ctx.save_for_backward` so saved-tensor hooks
  (segment checkpointing, the activation benchmark) see what is kept.

Both forwards compute exactly what the plain modules compute (same ops, same order), so outputs
are bit-identical; gradients agree to rounding. Without autograd they run the plain path.
Under segment checkpointing (`kiln_train.model.checkpointing`) a projection group marked
`keep=True` (the layer's output projections, h wide) is computed once: the segment's forward
keeps its output and the recomputation in backward reuses it instead of redoing the matmul.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kiln_train.model.linear import FrozenLinear


class SegmentOutputs:
    """The kept outputs of one checkpointed segment's `keep=True` groups, in call order: the
    forward records them, its recomputation in backward replays them."""

    def __init__(self) -> None:
        self.outputs: list[tuple[torch.Tensor, ...]] = []
        self.replaying = False
        self.cursor = 0

    def start(self) -> None:
        """Called at each run of the segment: the first records, later ones replay."""
        self.replaying = bool(self.outputs)
        self.cursor = 0

    def take(self) -> tuple[torch.Tensor, ...]:
        outputs = self.outputs[self.cursor]
        self.cursor += 1
        return outputs


_local = threading.local()


def _active() -> list[SegmentOutputs]:
    """This thread's stack of running segment stores (a recomputation runs wholly on one thread:
    the caller's on cpu, the autograd engine's device thread on cuda)."""
    stack = getattr(_local, "stores", None)
    if stack is None:
        stack = _local.stores = []
    return stack


class segment_outputs:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Make `store` the active segment store while a checkpointed segment runs."""

    def __init__(self, store: SegmentOutputs) -> None:
        self.store = store

    def __enter__(self) -> SegmentOutputs:
        self.store.start()
        _active().append(self.store)
        return self.store

    def __exit__(self, *exc) -> None:
        _active().pop()


def _apply(y: torch.Tensor, linear: FrozenLinear) -> torch.Tensor:
    """FrozenLinear.forward's arithmetic, op for op."""
    out = F.linear(y, linear.weight)
    if linear.lora_A is not None:
        out = out + F.linear(F.linear(y, linear.lora_A) * linear.lora_scale, linear.lora_B)
    return out


def _detached(inputs) -> list:
    """The inputs as plain tensors for a forward without a graph (module hooks that track
    gradients, e.g. FlopCounterMode's, then see no tensor that requires one)."""
    return [t.detach() if t is not None else None for t in inputs]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, prologue, linears, replay, n_inputs, *args):
        inputs = args[:n_inputs]
        ctx.prologue, ctx.linears, ctx.n_inputs = prologue, linears, n_inputs
        ctx.save_for_backward(*inputs)
        if replay is not None:
            return tuple(t.detach() for t in replay)
        y = prologue(*_detached(inputs))
        return tuple(_apply(y, linear) for linear in linears)

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        wants = ctx.needs_input_grad[4 : 4 + ctx.n_inputs]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(w) for t, w in zip(inputs, wants, strict=True)]
            y = ctx.prologue(*leaves)
        yd = y.detach()
        # No input wants a gradient (layer 0 reads the embedding): only the LoRA gradients.
        flows = any(wants)
        grad_y = None
        lora_grads: list[torch.Tensor | None] = []
        for linear, g in zip(ctx.linears, grads, strict=True):
            has_lora = linear.lora_A is not None
            if g is None:
                lora_grads += [None, None] if has_lora else []
                continue
            gy = g.matmul(linear.weight) if flows else None
            if has_lora:
                scaled = F.linear(yd, linear.lora_A) * linear.lora_scale
                grad_b = _flat(g).t().matmul(_flat(scaled))
                grad_u = g.matmul(linear.lora_B) * linear.lora_scale
                grad_a = _flat(grad_u).t().matmul(_flat(yd))
                if flows:
                    gy = gy + grad_u.matmul(linear.lora_A)
                lora_grads += [grad_a, grad_b]
            if flows:
                grad_y = gy if grad_y is None else grad_y + gy
        input_grads: list[torch.Tensor | None] = [None] * ctx.n_inputs
        needed = [i for i, w in enumerate(wants) if w]
        if needed and grad_y is not None:
            got = torch.autograd.grad(y, [leaves[i] for i in needed], grad_y, allow_unused=True)
            for i, g in zip(needed, got, strict=True):
                input_grads[i] = g
        return (None, None, None, None, *input_grads, *lora_grads)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def project(
    prologue: Callable | None,
    inputs: Sequence[torch.Tensor],
    linears: Sequence[FrozenLinear],
    *,
    keep: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Every projection in `linears` of y = prologue(*inputs), keeping only `inputs` for backward
    (see the module docstring). `keep=True` marks an output group whose outputs a checkpointed
    segment keeps instead of recomputing."""
    prologue = prologue or _identity
    if not torch.is_grad_enabled():
        y = prologue(*inputs)
        return tuple(_apply(y, linear) for linear in linears)
    stores = _active()
    store = stores[-1] if keep and stores else None
    replay = store.take() if store is not None and store.replaying else None
    loras = [p for linear in linears if linear.lora_A is not None for p in (linear.lora_A, linear.lora_B)]
    outputs = _Project.apply(prologue, tuple(linears), replay, len(inputs), *inputs, *loras)
    if store is not None and replay is None:
        store.outputs.append(tuple(t.detach() for t in outputs))
    return outputs


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, n_inputs, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        outputs = fn(*_detached(inputs))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        # An output aliasing an input (a conv tail sliced from its input) becomes its own tensor,
        # so autograd never treats it as a view of what the caller passed in.
        held = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
        return tuple(o.clone() if o.untyped_storage().data_ptr() in held else o for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        wants = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [
                t.detach().requires_grad_(w) if t is not None else None
                for t, w in zip(inputs, wants, strict=True)
            ]
            outputs = ctx.fn(*leaves)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
        needed = [i for i, w in enumerate(wants) if w]
        result: list[torch.Tensor | None] = [None] * len(inputs)
        if needed and pairs:
            got = torch.autograd.grad(
                [o for o, _ in pairs], [leaves[i] for i in needed], [g for _, g in pairs], allow_unused=True
            )
            for i, g in zip(needed, got, strict=True):
                result[i] = g
        return (None, None, *result)


def recompute(fn: Callable, *inputs: torch.Tensor | None):
    """fn(*inputs), keeping only `inputs` for backward and rebuilding fn's graph there. fn must be
    deterministic and weight-free (its buffers are constants); it returns a tensor or a tuple."""
    if not torch.is_grad_enabled():
        return fn(*inputs)
    outputs = _Recompute.apply(fn, len(inputs), *inputs)
    return outputs if len(outputs) > 1 else outputs[0]
