"""Gated DeltaNet token mixer of the Qwen3.5 layers where layer_types[i] == "linear_attention"
(docs/model.md#gated-deltanet).

in_proj_qkv → causal depthwise conv (kernel K, no bias) + SiLU over the concatenated
[q (Nk·dk) | k (Nk·dk) | v (Nv·dv)] channels → split into heads; beta = sigmoid(in_proj_b x);
g = −exp(A_log)·softplus(in_proj_a x + dt_bias) in fp32; the gated delta rule (delta_rule.py);
per value head a plain-w RMSNorm gated by silu(in_proj_z x); out_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln_train.kernels.paths import TORCH, TRITON
from kiln_train.model.config import Qwen35Config
from kiln_train.model.delta_rule import CHUNK_SIZE, IMPL_AUTO, gated_delta_rule, resolve_impl
from kiln_train.model.linear import FrozenLinear
from kiln_train.model.norms import GatedRMSNorm, compute_dtype
from kiln_train.model.recompute import project, recompute

# Backward rebuilds the conv and the delta rule of at most this many tokens at a time (the state
# entering each block is kept), so its transient f32 working set does not grow with T.
RECOMPUTE_BLOCK = 4096


@dataclass
class GdnState:
    """What a GDN layer carries from one call to the next: the last K−1 conv inputs and S."""

    conv: torch.Tensor  # [B, K-1, conv_dim]
    recurrent: torch.Tensor  # [B, Nv, dk, dv], fp32


class CausalDepthwiseConv(nn.Module):
    """`conv1d.weight` [C, 1, K]: c_t = Σ_j w[:, 0, j]·m_{t−(K−1)+j}, zero (or carried) before t = 0.

    Runs as Kiln's Triton kernel when the backend chose it (`kernel_path`, docs/kernels.md#kernel-paths).
    """

    kernel_path = TORCH

    def __init__(self, channels: int, kernel: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.kernel = kernel
        self.register_buffer("weight", torch.empty(channels, 1, kernel, device=device, dtype=dtype))

    def forward(self, m: torch.Tensor, prefix: torch.Tensor | None = None):
        """m [B, T, C] -> (silu(conv(m)) [B, T, C], the last K−1 inputs [B, K−1, C])."""
        if self.kernel_path == TRITON:
            from kiln_train.kernels.causal_conv import causal_conv1d_silu

            return causal_conv1d_silu(m, self.weight, prefix)
        kern, t = self.kernel, m.shape[1]
        padded = F.pad(m, (0, 0, kern - 1, 0)) if prefix is None else torch.cat((prefix.to(m.dtype), m), 1)
        # K shifted multiply-adds in the [B, T, C] layout: no transposes, accumulated in fp32.
        cdt = compute_dtype(m.dtype)
        w = self.weight[:, 0, :].to(cdt)
        acc = padded[:, 0:t].to(cdt) * w[:, 0]
        for j in range(1, kern):
            acc = acc + padded[:, j : j + t] * w[:, j]
        return F.silu(acc.to(m.dtype)), padded[:, t:]


class GatedDeltaNet(nn.Module):
    """HF module path `layers.{i}.linear_attn`."""

    def __init__(self, config: Qwen35Config, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        d, nv = config.hidden_size, self.num_v_heads
        self.in_proj_qkv = FrozenLinear(d, config.linear_conv_dim, **kw)
        self.in_proj_z = FrozenLinear(d, self.value_dim, **kw)
        self.in_proj_b = FrozenLinear(d, nv, **kw)
        self.in_proj_a = FrozenLinear(d, nv, **kw)
        self.conv1d = CausalDepthwiseConv(config.linear_conv_dim, config.linear_conv_kernel_dim, **kw)
        self.register_buffer("A_log", torch.zeros(nv, **kw))
        self.register_buffer("dt_bias", torch.ones(nv, **kw))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, **kw)
        self.out_proj = FrozenLinear(self.value_dim, d, **kw)
        self.impl = IMPL_AUTO
        self.chunk_size = CHUNK_SIZE

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        return self.forward_with_state(x, None, return_state=False, norm=norm)[0]

    def forward_with_state(
        self,
        x: torch.Tensor,
        state: GdnState | None,
        *,
        return_state: bool = True,
        norm: nn.Module | None = None,
    ) -> tuple[torch.Tensor, GdnState | None]:
        """Mix x [B, T, D] (pre-norm when `norm` is given); `state` continues a previous call
        (None = start of sequence).

        Backward keeps x, the in_proj_qkv output (the conv input), the gate and β
        pre-activations, z and the delta rule's output; the conv, the gates and the delta rule
        are rebuilt there block by block (`RECOMPUTE_BLOCK` tokens, docs/performance.md)."""
        t = x.shape[1]
        projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        mixed, z, b_pre, a_pre = project(norm, (x,), projections)
        conv = None if state is None else state.conv
        recurrent = None if state is None else state.recurrent
        outputs = []
        for start in range(0, t, RECOMPUTE_BLOCK):
            stop = min(t, start + RECOMPUTE_BLOCK)
            carry = return_state or stop < t
            block = (mixed[:, start:stop], b_pre[:, start:stop], a_pre[:, start:stop])
            if carry:
                o, conv, recurrent = recompute(self.mix_carry, *block, conv, recurrent)
            else:
                o = recompute(self.mix, *block, conv, recurrent)
            outputs.append(o)
        o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        y = project(self.gated_norm, (o, z), (self.out_proj,), keep=True)[0]
        return y, (GdnState(conv, recurrent) if return_state else None)

    def gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The per-head output norm gated by silu(z): [B, T, Nv, dv], [B, T, Nv·dv] -> [B, T, Nv·dv]."""
        b, t = o.shape[:2]
        return self.norm(o, z.reshape(b, t, self.num_v_heads, self.head_v_dim)).reshape(b, t, self.value_dim)

    def mix(self, mixed, b_pre, a_pre, conv, recurrent) -> torch.Tensor:
        return self._mix(mixed, b_pre, a_pre, conv, recurrent, False)[0]

    def mix_carry(self, mixed, b_pre, a_pre, conv, recurrent):
        return self._mix(mixed, b_pre, a_pre, conv, recurrent, True)

    def _mix(self, mixed, b_pre, a_pre, conv, recurrent, carry: bool):
        """conv + SiLU, gates, the gated delta rule: (o [B, T, Nv, dv], conv tail, final state)."""
        b, t, _ = mixed.shape
        mixed, conv_tail = self.conv1d(mixed, conv)
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(b_pre)
        cdt = compute_dtype(mixed.dtype)
        g = -self.A_log.to(cdt).exp() * F.softplus(a_pre.to(cdt) + self.dt_bias.to(cdt))
        o, final = gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            impl=resolve_impl(self.impl, mixed.device),
            chunk_size=self.chunk_size,
            initial_state=recurrent,
            output_final_state=carry,
        )
        return o, conv_tail, final
