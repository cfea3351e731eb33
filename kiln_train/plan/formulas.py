"""Byte formulas of one SFT step in THIS implementation (docs/memory.md#components).

Torch-free: `kiln_train.plan.memory` combines these terms into the admission `Breakdown`. Every term
is an upper bound of bytes live at the step's peak; `qualification/memory_honesty.py` measures
real steps against the result.
"""

from __future__ import annotations

from kiln_train.errors import invalid_request
from kiln_train.ground.backend import FULL_LOGITS, KT_TAPE_FLCE
from kiln_train.ground.layer_segments import segment_layer_ranges
from kiln_train.model.config import FULL_ATTENTION, Qwen35Config

MIB = 1 << 20
F32 = 4
ESTIMATED_ROUTES = (KT_TAPE_FLCE, FULL_LOGITS)

# Vocabulary chunk of the kt_tape_flce route: at most 4096 columns, shrunk (by halving) while the
# f32 [A, chunk] score block would exceed the scratch budget, never below 256 columns.
LOSS_VOCAB_CHUNK_MAX = 4096
LOSS_VOCAB_CHUNK_MIN = 256
LOSS_CHUNK_SCRATCH_BYTES = 256 * MIB


def vocab_chunk_size(vocab_size: int, active_rows: int) -> int:
    """Columns per vocabulary chunk of `kt_tape_flce` for `active_rows` supervised targets.

    Shared by the loss (which uses it) and the estimator (which charges it), so both agree.
    """
    chunk = min(vocab_size, LOSS_VOCAB_CHUNK_MAX)
    while chunk > LOSS_VOCAB_CHUNK_MIN and active_rows * chunk * F32 > LOSS_CHUNK_SCRATCH_BYTES:
        chunk //= 2
    return max(1, min(chunk, vocab_size))


#
# Notation (bytes unless said otherwise): T = max_seq_len, A = max_supervised_tokens, h = hidden,
# i = intermediate, r = LoRA rank, e = activation element bytes (cpu 4, cuda 2), F = 4 (the f32
# compute dtype of norms, the delta rule and the loss), V = vocabulary.
#
# Per-layer saved activations are what torch autograd keeps for backward in `kiln_train.model`
# (counted with saved-tensor hooks while writing these formulas; `qualification/memory_honesty.py`
# checks whole steps). Per token:
#
# both layer kinds
#   2·F·h      the two block RMSNorms save their f32 input
#   2·e·h      the normed inputs, saved once each by the LoRA branches (x for dA) of the projections
#   4·e·i      SwiGLU: gate output (silu input), silu output, up output, their product (down's input)
#   e·r        one [T, r] LoRA intermediate (x·Aᵀ, kept for dB) per trained projection
# gated full attention (qd = heads·head_dim, kvd = kv_heads·head_dim)
#   4·qd (+4·qd when e = 4)   q RMSNorm saves the f32 query (for f32 it is a view of the whole
#                             q_proj output [q | gate], twice as wide)
#   F·kvd      k RMSNorm saves the f32 key
#   4·e·qd     SDPA keeps q, the repeated k and v, and its output
#   3·e·qd     the re-laid-out output, sigmoid(gate), and their product (o_proj's input)
#   4·(2·heads + kv_heads + 2)  per-row f32 reductions (norm rsqrt, attention log-sum-exp)
# gated DeltaNet (kd = k_heads·dk, vd = v_heads·dv, conv = 2·kd + vd, nv = v_heads, c = 64)
#   e·conv     the conv output kept by SiLU
#   F·conv     q, k, v in f32 (views of the SiLU output on cpu, upcast copies on cuda)
#   the chunked delta rule, all f32, over T rounded up to a multiple of c:
#     6·nv·c   decay Γ, K·Kᵀ, A, Q·Kᵀ, (Q·Kᵀ)⊙Γ and one batched-matmul copy
#     10·nv·dk repeated q and k, k·β, q·e^γ, k·e^(γ_C−γ), matmul re-layouts, the W half of the solve
#     4·nv·dv  the U half of the solve, the per-chunk corrected values, their stack, one re-layout
#     2·nv·dk·dv/c   the state entering every chunk, kept by the scan and stacked for the output
#   (12 + e)·vd  gated output norm: f32 output, f32 gate, silu(gate), the weighted norm
#   e·vd       out_proj's input
#   32·nv      per-head gates, betas and reductions
# plus, per layer and independent of T, the f32 upcast conv kernel, two causal masks and f32 norm
# weights.
#
# The activation dtype is f32 on cpu and bf16 on cuda; GDN on cuda uses flash-linear-attention
# when importable, which keeps far less than the torch chunked form charged here (an upper bound).

GDN_CHUNK = 64  # kiln_train.model.delta_rule.CHUNK_SIZE (this module must not import torch)
# While a layer runs backward, the gradients it creates mostly replace saved tensors that its
# finished nodes have freed (measured: the tensor peak stays within the saved set); charged: 1/8 of
# the largest layer plus four [T, h] gradients flowing along the residual stream.
BACKWARD_WORKSPACE_DIVISOR = 8
GRADIENT_FLOW_STATES = 4


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _common_layer_bytes(config: Qwen35Config, t: int, r: int, e: int) -> int:
    h, i = config.hidden_size, config.intermediate_size
    return t * (2 * F32 * h + 2 * e * h + 4 * e * i) + 4 * F32 * h


def attention_layer_bytes(config: Qwen35Config, t: int, r: int, e: int) -> int:
    """Saved activations of one gated full-attention layer for a `t`-token row."""
    qd = config.num_attention_heads * config.head_dim
    kvd = config.num_key_value_heads * config.head_dim
    per_token = (
        4 * qd
        + (4 * qd if e == F32 else 0)
        + F32 * kvd
        + 4 * e * qd
        + 3 * e * qd
        + 7 * e * r
        + F32 * (2 * config.num_attention_heads + config.num_key_value_heads + 2)
    )
    return _common_layer_bytes(config, t, r, e) + t * per_token


def gdn_layer_bytes(config: Qwen35Config, t: int, r: int, e: int) -> int:
    """Saved activations of one Gated DeltaNet layer for a `t`-token row (torch chunked form)."""
    nv, nk = config.linear_num_value_heads, config.linear_num_key_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    vd, conv, c = config.linear_value_dim, config.linear_conv_dim, GDN_CHUNK
    padded = _ceil_to(t, c)
    delta_rule = F32 * (6 * nv * c + 10 * nv * dk + 4 * nv * dv) * padded + F32 * 2 * nv * dk * dv * (
        padded // c
    )
    per_token = e * conv + F32 * conv + (12 + e) * vd + e * vd + 6 * e * r + 32 * nv + 8 * nk
    constant = F32 * conv * config.linear_conv_kernel_dim + 2 * c * c + F32 * (dv + 4 * dk)
    return _common_layer_bytes(config, t, r, e) + t * per_token + delta_rule + constant


def layer_activation_bytes(config: Qwen35Config, t: int, r: int, e: int) -> list[int]:
    """Saved activation bytes of every layer, in layer order."""
    return [
        attention_layer_bytes(config, t, r, e) if kind == FULL_ATTENTION else gdn_layer_bytes(config, t, r, e)
        for kind in config.layer_types
    ]


def checkpoint_boundary_policy() -> dict:
    """`training.checkpoint_boundary_policy`: how activation recomputation is bounded.

    Kiln recomputes whole planned segments (`segment_layer_ranges`, the count chosen at admission
    and pinned); there is no token-threshold recompute, anchor stride or boundary cache, so those
    members are null. Checkpoints bind this object in their planning identity; `/v1/config` and
    `/health` show it. A fresh dict each call (callers may embed and mutate it).
    """
    return {
        "recompute_mode": "segments",
        "recompute_threshold_tokens": None,
        "anchor_stride": None,
        "cache_target_bytes": None,
    }


def segment_activation_bytes(config: Qwen35Config, t: int, r: int, e: int, num_segments: int) -> int:
    """Activations live while the heaviest segment runs backward (all layers with one segment).

    The segment's saved activations (recomputed under checkpointing) plus the backward allowance:
    1/`BACKWARD_WORKSPACE_DIVISOR` of its largest layer and `GRADIENT_FLOW_STATES` [T, h] gradients.
    """
    per_layer = layer_activation_bytes(config, t, r, e)
    heaviest = max(
        sum(per_layer[start:stop])
        for start, stop in segment_layer_ranges(config.num_hidden_layers, num_segments)
    )
    allowance = (
        max(per_layer) // BACKWARD_WORKSPACE_DIVISOR + GRADIENT_FLOW_STATES * t * config.hidden_size * e
    )
    return heaviest + allowance


def boundary_bytes(config: Qwen35Config, t: int, e: int, num_segments: int) -> int:
    """Hidden states retained across the whole step.

    (s+1)·T·h·e: the input of every checkpointed segment plus the trunk output (with one segment:
    the embedding output and the trunk output); the final RMSNorm's f32 input and its output
    (the hidden states the loss reads); the rope tables.
    """
    h = config.hidden_size
    return t * ((num_segments + 1) * h * e + F32 * h + h * e + 2 * config.rotary_dim * e)


def loss_workspace_bytes(config: Qwen35Config, route: str, t: int, a: int, e: int) -> int:
    """Peak bytes of the loss route on top of the retained activations (docs/memory.md#loss-workspace).

    kt_tape_flce (`kiln_train.train.loss.ChunkedLinearCrossEntropy`): the gathered rows [A, h] (e), an
    f32 upcast of them when e < 4, the f32 target head rows and their product with the rows, the
    f32 gradient accumulator [A, h], the f32 [chunk, h] head slice when e < 4, the f32 [A, chunk]
    scores with one reduction temporary, per-row statistics, and in backward the [T, h] scatter
    of the row gradient.
    full_logits: dense [T, V] logits (e), their f32 copy when e < 4, the saved f32 log-softmax,
    then in backward three f32 [T, V] gradients (nll, log-softmax, the un-sliced logits) and the
    cast back to e; and the [T, h] hidden gradient.
    """
    h, v = config.hidden_size, config.vocab_size
    if route == KT_TAPE_FLCE:
        chunk = vocab_chunk_size(v, a)
        low = e < F32
        return (
            e * a * h
            + (F32 * a * h if low else 0)
            + (e * a * h if low else 0)
            + 3 * F32 * a * h
            + (F32 * chunk * h if low else 0)
            + 2 * F32 * a * chunk
            + 16 * F32 * a
            + e * t * h
        )
    if route == FULL_LOGITS:
        low = e < F32
        return (
            e * t * v + (F32 * t * v if low else 0) + 3 * F32 * t * v + (e * t * v if low else 0) + e * t * h
        )
    raise invalid_request(f"no memory estimate for SFT loss route {route!r}; known: {list(ESTIMATED_ROUTES)}")


# ----- the validation forward (no gradient) --------------------------------------------------------

# The validation pass scores one block of [rows, columns] at a time, small enough that its
# element-wise passes (max, exp, sum) run from cache: at most 1024 vocabulary columns, and as many
# supervised rows as keep the f32 block within VALIDATION_SCORE_BLOCK_BYTES. Training's chunk
# (`vocab_chunk_size`) is larger because its gradient accumulator needs the whole row set per chunk.
VALIDATION_VOCAB_CHUNK = 1024
VALIDATION_SCORE_BLOCK_BYTES = 8 * MIB


def validation_score_block(vocab_size: int, active_rows: int) -> tuple[int, int]:
    """(rows, columns) of one f32 score block of the validation pass (kiln_train.train.evaluation)."""
    columns = max(1, min(vocab_size, VALIDATION_VOCAB_CHUNK))
    rows = max(1, min(active_rows, VALIDATION_SCORE_BLOCK_BYTES // (F32 * columns)))
    return rows, columns


def forward_activation_bytes(config: Qwen35Config, t: int, r: int, e: int) -> int:
    """Activations live while one layer runs forward without autograd: nothing is kept from layer
    to layer, so the bound is the heaviest layer's tensors (what training saves of it bounds what
    it creates and holds at once) plus its [T, h] input and output."""
    return max(layer_activation_bytes(config, t, r, e)) + 2 * t * config.hidden_size * e


def forward_boundary_bytes(config: Qwen35Config, t: int, e: int) -> int:
    """Hidden states a validation forward keeps across layers: the embedding output, the final
    RMSNorm's f32 input and its output, the rope tables."""
    h = config.hidden_size
    return t * (h * e + F32 * h + h * e + 2 * config.rotary_dim * e)


def eval_loss_workspace_bytes(config: Qwen35Config, route: str, t: int, a: int, e: int) -> int:
    """Peak bytes of the validation loss and token accuracy (kiln_train.train.evaluation).

    kt_tape_flce (the blocked pass): the gathered rows [A, h] (e), their f32 upcast when e < 4,
    the f32 target head rows and their product with the rows, the f32 [chunk, h] head slice when
    e < 4, one f32 score block (`validation_score_block`) with one reduction temporary, and per-row
    statistics (running max, sum, arg-max, the target logit, the block's max and arg-max). No
    gradient accumulator, no [T, h] scatter.
    full_logits: the dense [T, V] logits (e), their f32 copy when e < 4, one f32 [T, V]
    log-softmax and the [T, h] hidden.
    """
    h, v = config.hidden_size, config.vocab_size
    low = e < F32
    if route == KT_TAPE_FLCE:
        rows, chunk = validation_score_block(v, a)
        return (
            e * a * h
            + (F32 * a * h if low else 0)
            + 2 * F32 * a * h
            + (F32 * chunk * h if low else 0)
            + 2 * F32 * rows * chunk
            + 24 * F32 * a
        )
    if route == FULL_LOGITS:
        return e * t * v + (F32 * t * v if low else 0) + F32 * t * v + e * t * h
    raise invalid_request(f"no memory estimate for SFT loss route {route!r}; known: {list(ESTIMATED_ROUTES)}")


# ----- the derived minimum of saved activations (docs/performance.md#saved-activations) -----------


def minimum_saved_bytes_per_token(config: Qwen35Config, layer_type: str, e: int) -> int:
    """Bytes per token one decoder layer must keep for LoRA's backward when every base-weight
    matmul runs once and everything cheaper (norms, gates, conv, the token mixer itself) may be
    recomputed: the input of each projection group once, in the activation dtype `e`.

    Both kinds: the two block-norm inputs (2h) and SwiGLU's gate and up (2i). Gated DeltaNet: the
    conv input from in_proj_qkv (2·kd + vd), the gate and β pre-activations (2·nv), the delta
    rule's output and the z gate (2·vd). Gated attention: the query and key before their norms and
    v (qd + 2·kvd), the attention output and its sigmoid gate (2·qd).
    """
    h, i = config.hidden_size, config.intermediate_size
    common = 2 * h + 2 * i
    if layer_type == FULL_ATTENTION:
        qd = config.num_attention_heads * config.head_dim
        kvd = config.num_key_value_heads * config.head_dim
        return e * (common + 3 * qd + 2 * kvd)
    nv, vd = config.linear_num_value_heads, config.linear_value_dim
    return e * (common + config.linear_conv_dim + 2 * nv + 2 * vd)
