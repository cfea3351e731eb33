"""Gated full attention of the Qwen3.5 layers where layer_types[i] == "full_attention".

docs/model.md#gated-attention.

q_proj emits, per head, [query (d) | gate (d)] (interleaved per head, not two halves); q and k get a
(1+w) RMSNorm over head_dim before the partial RoPE; causal softmax attention with GQA (kv head j
serves query heads j·g .. j·g+g−1), scale d^−0.5; the output is multiplied by sigmoid(gate) before
o_proj. SDPA is used for the attention itself (fp32 softmax on the fp32 path; the fused CUDA
kernels accumulate in fp32 too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln_train.model.config import Qwen35Config
from kiln_train.model.linear import FrozenLinear
from kiln_train.model.norms import OffsetRMSNorm
from kiln_train.model.recompute import project, recompute
from kiln_train.model.rope import apply_partial_rope


class GatedAttention(nn.Module):
    """HF module path `layers.{i}.self_attn` (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm)."""

    def __init__(self, config: Qwen35Config, *, device=None, dtype=None) -> None:
        super().__init__()
        h, d = config.num_attention_heads, config.head_dim
        kv = config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        kw = {"device": device, "dtype": dtype}
        self.q_proj = FrozenLinear(config.hidden_size, h * d * 2, **kw)
        self.k_proj = FrozenLinear(config.hidden_size, kv * d, **kw)
        self.v_proj = FrozenLinear(config.hidden_size, kv * d, **kw)
        self.o_proj = FrozenLinear(h * d, config.hidden_size, **kw)
        self.q_norm = OffsetRMSNorm(d, config.rms_norm_eps, **kw)
        self.k_norm = OffsetRMSNorm(d, config.rms_norm_eps, **kw)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], norm: nn.Module | None = None
    ) -> torch.Tensor:
        """x [B, T, hidden] (pre-norm when `norm` is given). Backward keeps x, the q_proj output
        (query and gate), k, v and the attention output; the q/k norms, RoPE and the attention
        itself are recomputed there (docs/performance.md#saved-activations)."""
        b, t, _ = x.shape
        h, d = self.num_heads, self.head_dim
        query_gate, key, value = project(norm, (x,), (self.q_proj, self.k_proj, self.v_proj))
        query, gate = query_gate.view(b, t, h, 2 * d).chunk(2, dim=-1)
        cos, sin = rope
        o = recompute(self.attend, query, key, value, cos, sin)
        return project(self.output_gate, (o, gate), (self.o_proj,), keep=True)[0]

    def attend(self, query, key, value, cos, sin) -> torch.Tensor:
        """Causal GQA softmax attention of the normed, rotated heads: [B, T, heads·head_dim]."""
        b, t = query.shape[:2]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(query).transpose(1, 2)
        k = self.k_norm(key.view(b, t, kv, d)).transpose(1, 2)
        v = value.view(b, t, kv, d).transpose(1, 2)
        q = apply_partial_rope(q, cos, sin)
        k = apply_partial_rope(k, cos, sin)
        if kv != h:
            # Repeat-interleave (not tile): kv head j serves query heads j*g .. j*g+g-1.
            g = h // kv
            k = k[:, :, None].expand(b, kv, g, t, d).reshape(b, h, t, d)
            v = v[:, :, None].expand(b, kv, g, t, d).reshape(b, h, t, d)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
        return o.transpose(1, 2).reshape(b, t, h * d)

    @staticmethod
    def output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        b, t = o.shape[:2]
        return o * torch.sigmoid(gate.reshape(b, t, o.shape[-1]))
