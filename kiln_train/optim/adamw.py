"""AdamW with decoupled weight decay, bias correction and per-parameter step counters.

docs/optimizers.md#hyperparameters and docs/optimizers.md#adamw-qualification. The f32 lane
math is written as the same tensor operations, in the same order and with the same double-precision
scalars, as eager `torch.optim.AdamW(foreach=False, fused=False)` (the oracle of
`qualification/adamw_pytorch_oracle.py`):

    step  += 1
    p     *= 1 - lr * weight_decay                 (decoupled decay, before the moments)
    m      = lerp(m, g, 1 - beta1)
    v      = v * beta2 + (1 - beta2) * g * g
    denom  = sqrt(v) / sqrt(1 - beta2**step) + eps
    p     += -(lr / (1 - beta1**step)) * m / denom

so an f32 parameter reproduces the oracle to the last bit on the same device. A bf16 parameter runs
the identical f32 math on upcast temporaries (parameter, gradient, both moments) and rounds each
output once, whereas eager bf16 PyTorch rounds after every tensor operation; that difference is
the contract's declared 1/4/3-ULP envelope for parameters/first/second moments.
"""

from __future__ import annotations

from torch import Tensor

from kiln_train.optim.base import Optimizer, upcast, write_back

F32_SMALLEST_SUBNORMAL = 2.0**-149


class AdamW(Optimizer):
    kind = "adam_w"

    def __init__(
        self,
        params,
        lr: float,
        *,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, lr)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        # The f32 lane adds eps as an f32 scalar: an eps below f32's smallest subnormal (the
        # contract admits any finite eps > 0) would round to 0 and turn a zero gradient's
        # 0 / (0 + 0) into NaN. It is floored at the smallest positive f32 instead; any eps f32
        # can represent is used exactly as given. Rounding to nearest even sends an eps to 0
        # exactly when it is at most half the smallest subnormal.
        self._lane_eps = self.eps if self.eps > F32_SMALLEST_SUBNORMAL / 2 else F32_SMALLEST_SUBNORMAL
        self.weight_decay = float(weight_decay)

    # What `hyperparameters()` reports: the attributes set above, in contract order.
    hyperparameter_names = ("beta1", "beta2", "eps", "weight_decay")

    def _update(self, name: str, param: Tensor, grad: Tensor) -> None:
        state = self.state[name]
        step = self.param_steps[name]
        p, g = upcast(param), upcast(grad)
        m, v = upcast(state["m"]), upcast(state["v"])
        if self.weight_decay != 0.0:
            p.mul_(1 - self.lr * self.weight_decay)
        m.lerp_(g, 1 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        bias_correction1 = 1 - self.beta1**step
        bias_correction2 = 1 - self.beta2**step
        step_size = self.lr / bias_correction1
        denom = (v.sqrt() / bias_correction2**0.5).add_(self._lane_eps)
        p.addcdiv_(m, denom, value=-step_size)
        write_back(param, p)
        write_back(state["m"], m)
        write_back(state["v"], v)
