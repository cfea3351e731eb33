"""The native Qwen3.5 text causal LM (docs/model.md#forward).

    h = Embed[input_ids]                                   (no scaling)
    per layer: h += GDN(norm1(h)) or GatedAttn(norm1(h));  h += SwiGLU(norm2(h))
    h = norm(h);  logits = h · W_lmᵀ                       (W_lm = the embedding when tied)

Every base tensor is a buffer under its Hugging Face name (without the `model.` /
`model.language_model.` prefix), so the base is frozen structurally: autograd never computes a base
weight gradient and the embedding output is not differentiable w.r.t. the table
(docs/training-profile.md#frozen-base). The only trainable leaves are LoRA pairs added by
`attach_lora`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln_train.model.attention import GatedAttention
from kiln_train.model.checkpointing import run_layers
from kiln_train.model.config import LINEAR_ATTENTION, Qwen35Config
from kiln_train.model.delta_rule import IMPLS, resolve_impl
from kiln_train.model.gdn import GatedDeltaNet
from kiln_train.model.linear import FrozenLinear
from kiln_train.model.mlp import SwiGLU
from kiln_train.model.norms import OffsetRMSNorm
from kiln_train.model.rope import rope_tables


class FrozenEmbedding(nn.Module):
    """`embed_tokens.weight` [V, D] as a frozen buffer."""

    def __init__(self, vocab: int, dim: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty(vocab, dim, device=device, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class DecoderLayer(nn.Module):
    """HF module path `layers.{i}`: pre-norm token mixer + pre-norm SwiGLU, both residual."""

    def __init__(self, config: Qwen35Config, index: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.index = index
        self.layer_type = config.layer_types[index]
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, **kw)
        else:
            self.self_attn = GatedAttention(config, **kw)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, **kw)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    @property
    def is_linear_attention(self) -> bool:
        return self.layer_type == LINEAR_ATTENTION

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # Each norm runs inside the projection group it feeds, so backward keeps the pre-norm h
        # and recomputes the normed input (docs/performance.md#saved-activations).
        norm = self.input_layernorm
        mixed = (
            self.linear_attn(h, norm=norm) if self.is_linear_attention else self.self_attn(h, rope, norm=norm)
        )
        h = h + mixed
        return h + self.mlp(h, norm=self.post_attention_layernorm)


class Qwen35Model(nn.Module):
    """Qwen3.5 text trunk + head. Build it with `load_model`; attach adapters with `attach_lora`."""

    def __init__(self, config: Qwen35Config, *, device=None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.config = config
        self.embed_tokens = FrozenEmbedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(config, i, **kw) for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.lm_head = (
            None if config.tie_word_embeddings else FrozenLinear(config.hidden_size, config.vocab_size, **kw)
        )
        self.mtp_tensor_names: list[str] = []
        self.lora = None  # the attached LoraSet, if any

    # ----- facts ------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The frozen output head [V, D]: the embedding table when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_gdn_impl(self, impl: str, chunk_size: int | None = None) -> None:
        """Choose the gated-delta-rule implementation of every GDN layer (auto|chunk|recurrent|fla)."""
        if impl not in IMPLS:
            raise ValueError(f"unknown gated delta rule implementation {impl!r}; expected one of {IMPLS}")
        for layer in self.layers:
            if layer.is_linear_attention:
                layer.linear_attn.impl = impl
                if chunk_size is not None:
                    layer.linear_attn.chunk_size = chunk_size

    def _settle_gdn_impls(self) -> None:
        """Decide each GDN layer's kernel here, before any checkpointed segment: the first CUDA
        decision runs a one-time FLA probe with its own backward, whose saved tensors inside a
        segment would differ between the forward and the recomputation (CheckpointError)."""
        if self.device.type != "cuda":
            return
        for layer in self.layers:
            if layer.is_linear_attention:
                resolve_impl(layer.linear_attn.impl, self.device)

    # ----- forward ----------------------------------------------------------------------
    def hidden_states(self, input_ids: torch.Tensor, *, num_segments: int = 1) -> torch.Tensor:
        """Final hidden states [B, T, D] after the final RMSNorm.

        num_segments > 1 checkpoints contiguous layer groups (recomputed in backward).
        """
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got shape {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        vocab = self.config.vocab_size
        # An out-of-range id would be an opaque IndexError on cpu and a device-side assert (a dead
        # CUDA context) on cuda: e.g. a tokenizer whose ids exceed this checkpoint's vocab_size.
        if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
            bad = input_ids[(input_ids < 0) | (input_ids >= vocab)]
            raise ValueError(
                f"token id {int(bad.flatten()[0])} is outside the model's vocabulary "
                f"(vocab_size {vocab}); the tokenizer does not match this checkpoint"
            )
        self._settle_gdn_impls()
        h = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=h.device)
        rope = rope_tables(positions, self.config.rotary_dim, self.config.rope_theta, h.dtype)
        h = run_layers(self.layers, h, rope, num_segments)
        return self.norm(h)

    def logits(self, input_ids: torch.Tensor, *, num_segments: int = 1) -> torch.Tensor:
        """Dense logits [B, T, V] (the portable reference route; training gathers rows first)."""
        return F.linear(self.hidden_states(input_ids, num_segments=num_segments), self.lm_head_weight)

    def forward(self, input_ids: torch.Tensor, *, num_segments: int = 1) -> torch.Tensor:
        return self.logits(input_ids, num_segments=num_segments)
