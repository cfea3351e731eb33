"""Muon: momentum, Newton–Schulz orthogonalisation, shape-aware scale, decoupled weight decay.

docs/optimizers.md#hyperparameters. Per LoRA matrix `W` of shape `[rows, cols]`:

    buf  = momentum * buf + g
    u    = g + momentum * buf      (nesterov)   |   u = buf   (plain heavy ball)
    O    = newton_schulz(u, ns_iters)
    W   *= 1 - lr * weight_decay
    W   -= lr * scale * O,    scale = 0.2 * sqrt(max(rows, cols))

`newton_schulz` normalises `X = u / (||u||_F + 1e-7)` (transposed so rows <= cols, which keeps the
Gram matrix the small `rows x rows` one) and runs `ns_iters` steps of the quintic
`X <- a X + (b A + c A^2) X`, `A = X X^T`, with `(a, b, c) = (3.4445, -4.7750, 2.0315)`. Each step
maps every singular value `s` to `a s + b s^3 + c s^5`, pushing them towards ~1 without an SVD.

Scale: an orthogonalised `[rows, cols]` matrix with min(rows, cols) unit singular values has RMS
`1 / sqrt(max(rows, cols))`. LoRA pairs are extremely unequal (A is `[r, in]`, B is `[out, r]`), so a
scale that depends on the aspect ratio (Keller Jordan's `sqrt(max(1, rows/cols))`) would give A an
RMS update of `1/sqrt(in)` and B `1/sqrt(r)`: a ~12x imbalance at r=16, in=2560. We use the
`0.2 * sqrt(max(rows, cols))` rule (Moonshot AI, "Muon is Scalable for LLM Training"), which makes
the update RMS 0.2 for every matrix: A and B move at the same rate and the learning rate means the
same thing for every shape, close to AdamW's typical update RMS.

Rank >= 2 is required: a rank-1 LoRA matrix orthogonalises to a sign pattern and the update stops
being a low-rank preconditioned step (seed: "rank 1 would skip orthogonalization").

Precision: the momentum buffer is resident in the parameter dtype; the whole update (momentum,
Newton–Schulz, decay, step) runs in f32 and each output is rounded once.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kiln_train.errors import invalid_request
from kiln_train.optim.base import Optimizer, upcast, write_back

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_NORM_EPS = 1e-7
UPDATE_RMS = 0.2


def newton_schulz(u: Tensor, iters: int) -> Tensor:
    """Approximately orthogonalise a 2-D f32 matrix (its polar factor) with the quintic iteration."""
    a, b, c = NS_COEFFICIENTS
    transposed = u.shape[0] > u.shape[1]
    x = u.T if transposed else u
    # `x / (||x||_F + eps)`, computed on `x` pre-scaled by a power of two near its largest
    # magnitude: ||x||_F squares every element, which overflows f32 (an infinite norm, a silently
    # zero update) once ||x|| > ~1.8e19 and underflows for tiny gradients. Scaling by a power of two
    # is exact, so for ordinary magnitudes the result is bit-identical to the unscaled formula.
    _, exponent = torch.frexp(x.abs().amax())
    scale = torch.ldexp(torch.ones((), dtype=x.dtype, device=x.device), exponent - 1)
    x = x / scale
    x = x / (torch.linalg.matrix_norm(x) + NS_NORM_EPS / scale)
    for _ in range(iters):
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.T if transposed else x


def update_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """`0.2 * sqrt(max(rows, cols))`: every matrix gets the same update RMS (see module docstring)."""
    return UPDATE_RMS * math.sqrt(max(shape[0], shape[1]))


class Muon(Optimizer):
    kind = "muon"

    def __init__(
        self,
        params,
        lr: float,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_iters: int = 5,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, lr)
        for name, p in self.params.items():
            if p.dim() != 2 or min(p.shape) < 2:
                raise invalid_request(
                    f"lora_rank must be at least 2 for the muon optimizer: leaf {name!r} has shape "
                    f"{list(p.shape)}, and Muon orthogonalises 2-D matrices whose smaller side is >= 2"
                )
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.ns_iters = int(ns_iters)
        self.weight_decay = float(weight_decay)

    # What `hyperparameters()` reports: the attributes set above, in contract order.
    hyperparameter_names = ("momentum", "nesterov", "ns_iters", "weight_decay")

    def _update(self, name: str, param: Tensor, grad: Tensor) -> None:
        p, g = upcast(param), upcast(grad)
        buf = upcast(self.state[name]["momentum"])
        buf.mul_(self.momentum).add_(g)
        u = g.add(buf, alpha=self.momentum) if self.nesterov else buf
        ortho = newton_schulz(u, self.ns_iters)
        if self.weight_decay != 0.0:
            p.mul_(1 - self.lr * self.weight_decay)
        p.add_(ortho, alpha=-self.lr * update_scale(p.shape))
        write_back(param, p)
        write_back(self.state[name]["momentum"], buf)
