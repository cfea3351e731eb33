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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, t, _ = x.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        query, gate = self.q_proj(x).view(b, t, h, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(query).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, kv, d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, kv, d).transpose(1, 2)
        cos, sin = rope
        q = apply_partial_rope(q, cos, sin)
        k = apply_partial_rope(k, cos, sin)
        if kv != h:
            # Repeat-interleave (not tile): kv head j serves query heads j*g .. j*g+g-1.
            g = h // kv
            k = k[:, :, None].expand(b, kv, g, t, d).reshape(b, h, t, d)
            v = v[:, :, None].expand(b, kv, g, t, d).reshape(b, h, t, d)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
        o = o.transpose(1, 2).reshape(b, t, h * d)
        return self.o_proj(o * torch.sigmoid(gate.reshape(b, t, h * d)))
