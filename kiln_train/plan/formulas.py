"""Byte formulas of one SFT step in THIS implementation (docs/memory.md#components).

Torch-free: `kiln_train.plan.memory` combines these terms into the admission `Breakdown`. Every term
is an upper bound of bytes live at the step's peak; `qualification/memory_honesty.py` measures
real steps against the result.
"""

from __future__ import annotations

from kiln_train.errors import invalid_request
from kiln_train.ground.backend import FULL_LOGITS, KT_TAPE_FLCE
from kiln_train.ground.layer_segments import segment_layer_ranges
from kiln_train.model.config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config

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
# Saved per layer (docs/performance.md#saved-activations): each projection group keeps only its
# input and each weight-free core only its inputs (`kiln_train.model.recompute`), which is the
# derived minimum `minimum_saved_bytes_per_token` per token. A GDN layer longer than one rebuild
# block (`RECOMPUTE_BLOCK`) also keeps, per extra block, the f32 recurrent state and the conv tail
# entering it.
#
# Transient per layer (`layer_transient_bytes`): while a layer runs backward it rebuilds one part at
# a time and that part's gradients coexist with it; the largest part bounds the layer:
#   GDN core, per token of one block (at most RECOMPUTE_BLOCK tokens): the rebuilt conv output
#     (e·conv) and its f32 q/k/v (F·conv); the chunked delta rule, all f32 over the block rounded
#     up to a multiple of c = 64: 6·nv·c (decay Γ, K·Kᵀ, A, Q·Kᵀ, their product, one matmul copy),
#     10·nv·dk (repeated, scaled and decayed q/k, re-layouts, the W half of the solve),
#     4·nv·dv (U, the corrected values, their stack, one re-layout), 2·nv·dk·dv/c (the state
#     entering every chunk, stacked); gates 32·nv; the incoming (e·vd) and outgoing (e·conv)
#     gradients. Backward frees the rebuilt tensors as the gradients it forms replace them.
#   attention core, per token (never blocked): the f32 q/k norms (2·F·(qd + kvd)), RoPE and the
#     repeated k/v (6·e·qd), the SDPA output and log-sum-exp (e·qd + F·heads), and the
#     gradients of q, k, v before and after the repeat (6·e·qd).
#   SwiGLU's down group: the product and its gradient, then silu(gate) with the gradients of
#     silu(gate) and up, then (silu(gate) released) the gate gradient: 5·e·i at most, plus the
#     incoming gradient (e·h).
#   a norm group: the incoming projection gradients (at most 2·e·i, gate and up), the recomputed
#     norm with its f32 internals and the summed input gradient ((3·F + 3·e)·h).
#   GDN's output group: the recomputed gated norm in f32 (12·vd + e·vd) and its two gradients.
# plus GRADIENT_FLOW_STATES [T, h] gradients flowing along the residual stream.
#
# The activation dtype is f32 on cpu and bf16 on cuda; GDN on cuda uses flash-linear-attention
# when importable, which rebuilds far less than the torch chunked form charged here (an upper bound).

GDN_CHUNK = 64  # kiln_train.model.delta_rule.CHUNK_SIZE (this module must not import torch)
RECOMPUTE_BLOCK = 4096  # kiln_train.model.gdn.RECOMPUTE_BLOCK
GRADIENT_FLOW_STATES = 4


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def attention_layer_bytes(config: Qwen35Config, t: int, r: int, e: int) -> int:
    """Saved activations of one gated full-attention layer for a `t`-token row."""
    return t * minimum_saved_bytes_per_token(config, FULL_ATTENTION, e)


def gdn_layer_bytes(config: Qwen35Config, t: int, r: int, e: int) -> int:
    """Saved activations of one Gated DeltaNet layer for a `t`-token row: the minimum, plus the
    state and conv tail entering every rebuild block after the first."""
    carried = -(-t // RECOMPUTE_BLOCK) - 1
    state = F32 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    tail = e * config.linear_conv_dim * (config.linear_conv_kernel_dim - 1)
    return t * minimum_saved_bytes_per_token(config, LINEAR_ATTENTION, e) + carried * (state + tail)


def layer_activation_bytes(config: Qwen35Config, t: int, r: int, e: int) -> list[int]:
    """Saved activation bytes of every layer, in layer order."""
    return [
        attention_layer_bytes(config, t, r, e) if kind == FULL_ATTENTION else gdn_layer_bytes(config, t, r, e)
        for kind in config.layer_types
    ]


def _gdn_core_transient(config: Qwen35Config, t: int, e: int) -> int:
    nv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    conv, c = config.linear_conv_dim, GDN_CHUNK
    padded = _ceil_to(min(t, RECOMPUTE_BLOCK), c)
    rebuilt = (
        (e + F32) * conv * padded
        + F32 * (6 * nv * c + 10 * nv * dk + 4 * nv * dv + 8 * nv) * padded
        + F32 * 2 * nv * dk * dv * (padded // c)
    )
    flowing = (e * config.linear_value_dim + e * conv) * padded
    constant = F32 * conv * config.linear_conv_kernel_dim + 2 * c * c + F32 * (dv + 4 * dk)
    return rebuilt + flowing + constant


def _group_transient(config: Qwen35Config, t: int, r: int, e: int, layer_type: str) -> int:
    """The largest projection group's backward in one layer (its saved inputs are counted apart)."""
    h, i = config.hidden_size, config.intermediate_size
    per_token = max(5 * e * i + e * h, 2 * e * i + (3 * F32 + 3 * e) * h + 4 * e * r)
    if layer_type == LINEAR_ATTENTION:
        per_token = max(per_token, (12 + 3 * e) * config.linear_value_dim + e * h)
    return t * per_token


def _core_phase(config: Qwen35Config, t: int, e: int, layer_type: str) -> tuple[int, int]:
    """(what the layer still holds of its own saved set, the rebuilt core with its gradients) when
    its token mixer is rebuilt in backward: its MLP and output group have already run backward."""
    h = config.hidden_size
    if layer_type == FULL_ATTENTION:
        qd = config.num_attention_heads * config.head_dim
        kvd = config.num_key_value_heads * config.head_dim
        held = t * e * (h + 2 * qd + 2 * kvd)
        return held, t * (2 * F32 * (qd + kvd) + 13 * e * qd + F32 * config.num_attention_heads)
    held = t * e * (h + config.linear_conv_dim + 2 * config.linear_num_value_heads + config.linear_value_dim)
    return held, _gdn_core_transient(config, t, e)


def layer_transient_bytes(config: Qwen35Config, t: int, r: int, e: int, layer_type: str | None = None) -> int:
    """The largest part one layer of `layer_type` (default: either kind) computes at once: a
    projection group's backward or its rebuilt core (see the notation above). It also bounds what
    one layer holds at once in a forward without autograd."""
    kinds = set(config.layer_types) if layer_type is None else {layer_type}
    return max(max(_group_transient(config, t, r, e, k), _core_phase(config, t, e, k)[1]) for k in kinds)


def backward_peak_bytes(config: Qwen35Config, t: int, r: int, e: int, start: int, stop: int) -> int:
    """The activations live while layers [start, stop) run backward, plus `GRADIENT_FLOW_STATES`
    [T, h] gradients. Layer n runs backward while the layers before it still hold their saved
    activations and those after it have freed theirs: first its projection groups (its whole saved
    set held), then its rebuilt core (only the core's and the input group's inputs held)."""
    per_layer = layer_activation_bytes(config, t, r, e)
    kinds = config.layer_types
    peak = 0
    for n in range(start, stop):
        before = sum(per_layer[start:n])
        held, core = _core_phase(config, t, e, kinds[n])
        groups = per_layer[n] + _group_transient(config, t, r, e, kinds[n])
        peak = max(peak, before + max(groups, held + core))
    return peak + GRADIENT_FLOW_STATES * t * config.hidden_size * e


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


def segment_activation_bytes(
    config: Qwen35Config, t: int, r: int, e: int, num_segments: int, loss_bytes: int = 0
) -> int:
    """Activations charged beside the loss workspace (`loss_bytes`) at the step's peak.

    Two phases peak: the loss runs on top of the last segment's saved activations (never
    recomputed; with one segment, every layer's), and later each segment runs backward with its
    saved activations (rebuilt, but for the last) and what its layers rebuild
    (`backward_peak_bytes`). The working set adds `loss_bytes` to this, so the result is
    max(last segment, the worst segment's backward peak − loss).
    """
    per_layer = layer_activation_bytes(config, t, r, e)
    ranges = segment_layer_ranges(config.num_hidden_layers, num_segments)
    last = sum(per_layer[ranges[-1][0] : ranges[-1][1]])
    backward = max(backward_peak_bytes(config, t, r, e, start, stop) for start, stop in ranges)
    return max(last, backward - loss_bytes)


def boundary_bytes(config: Qwen35Config, t: int, e: int, num_segments: int) -> int:
    """Hidden states retained across the whole step.

    (s+1)·T·h·e: the input of every segment plus the trunk output (with one segment: the
    embedding output and the trunk output); the final RMSNorm's f32 input and its output (the
    hidden states the loss reads); the rope tables; and with s > 1 the outputs a checkpointed
    segment keeps instead of recomputing (`kiln_train.model.checkpointing`): two [T, h] per layer
    (the mixer's and the MLP's output projections) of every segment but the last.
    """
    h = config.hidden_size
    ranges = segment_layer_ranges(config.num_hidden_layers, num_segments)
    kept_layers = sum(stop - start for start, stop in ranges[:-1]) if num_segments > 1 else 0
    return t * (
        (num_segments + 1) * h * e + F32 * h + h * e + 2 * config.rotary_dim * e + 2 * kept_layers * h * e
    )


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
    to layer, so the bound is the heaviest layer phase (its group outputs with the largest group
    at work, or its core's inputs with the core at work: what its backward holds at those points
    bounds what its forward creates) plus its [T, h] input and output."""
    per_layer = dict(zip(config.layer_types, layer_activation_bytes(config, t, r, e), strict=True))
    phases = []
    for kind, saved in per_layer.items():
        held, core = _core_phase(config, t, e, kind)
        phases += [saved + _group_transient(config, t, r, e, kind), held + core]
    return max(phases) + 2 * t * config.hidden_size * e


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
