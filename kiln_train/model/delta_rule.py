"""The gated delta rule of the Gated DeltaNet layers (docs/model.md#gated-deltanet).

All three implementations take the same arguments, FLA's convention:
q, k [B, T, Hk, dk] raw (before L2 normalisation), v [B, T, Hv, dv], g (log-decay ≤ 0) and
beta (already sigmoided) [B, T, Hv]; value head h uses key head h // (Hv/Hk) (repeat-interleave).
They return (o [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv] or None).

Per value head, with S ∈ R^{dk×dv} (zero or a carried `initial_state`):
    q ← l2norm(q)/√dk, k ← l2norm(k)            (eps 1e−6 inside the rsqrt of the sum)
    S ← e^{g_t} S;  S ← S + k_t ⊗ β_t (v_t − Sᵀk_t);  o_t = Sᵀ q_t     (read after the update)

- `recurrent_gated_delta_rule`: the per-token loop, the reference.
- `chunk_gated_delta_rule`: the chunked WY/UT form (chunk 64 by default), the default on CPU and the
  CUDA fallback. Within a chunk with γ the cumulative log-decay and Γ_ij = e^{γ_i−γ_j} (i ≥ j):
  A = I + strictlower(diag(β) K Kᵀ ⊙ Γ); U = A⁻¹ diag(β) V; W = A⁻¹ diag(β e^γ) K; then with S the
  state entering the chunk, V' = U − W S, O = (Q ⊙ e^γ) S + ((Q Kᵀ) ⊙ Γ) V',
  S_next = e^{γ_C} S + (K ⊙ e^{γ_C−γ})ᵀ V'. T is padded to a chunk multiple with β = k = g = 0,
  which leaves the state unchanged. Everything runs in fp32 (f64 when given f64).
- FLA's `chunk_gated_delta_rule` Triton kernel on CUDA when `fla` is importable (never on CPU).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln_train.model.norms import compute_dtype

CHUNK_SIZE = 64
IMPL_AUTO, IMPL_CHUNK, IMPL_RECURRENT, IMPL_FLA = "auto", "chunk", "recurrent", "fla"
IMPLS = (IMPL_AUTO, IMPL_CHUNK, IMPL_RECURRENT, IMPL_FLA)
L2_EPS = 1e-6


@functools.lru_cache(maxsize=1)
def fla_chunk_kernel():
    """FLA's chunked gated-delta-rule kernel, or None when flash-linear-attention is unusable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except Exception:  # not installed, or installed without triton: fall back to torch
        return None
    return kernel


@functools.cache
def fla_unusable_reason(device: torch.device) -> str | None:
    """None when FLA's kernel trains correctly on `device`, else why not.

    Importable is not enough: FLA 0.6.0 refuses its backward on Hopper with Triton < 3.7.1 (a
    Triton miscompilation), and other kernel/toolchain pairs may fail or disagree. So on first use
    per device one small bf16 forward + backward (the training dtype on CUDA) runs through FLA
    and through the torch chunked form; FLA is used only when it runs and both agree (5e-2 of the
    largest magnitude on the output and every input gradient: bf16 rounding is far below that, a
    miscompiled kernel far above). Anything else falls back to the torch form.
    """
    if device.type != "cuda":
        return "the flash-linear-attention gated delta rule runs on CUDA only"
    if fla_chunk_kernel() is None:
        return "flash-linear-attention is not importable; install the `gpu` extra"
    try:
        with torch.inference_mode(False), torch.enable_grad():
            return _fla_probe(device)
    except Exception as exc:  # the kernel refused or failed to build on this device
        return f"flash-linear-attention failed on {device}: {type(exc).__name__}: {str(exc).splitlines()[0]}"


def _fla_probe(device: torch.device) -> str | None:
    """One small bf16 forward + backward through FLA and the torch chunked form; None when they agree."""
    gen = torch.Generator(device=device).manual_seed(0)
    b, t, hk, hv, dk, dv = 1, 80, 1, 2, 64, 64

    def inputs():
        return [
            torch.randn(b, t, hk, dk, device=device, generator=gen),
            torch.randn(b, t, hk, dk, device=device, generator=gen),
            torch.randn(b, t, hv, dv, device=device, generator=gen),
            -torch.rand(b, t, hv, device=device, generator=gen),
            torch.rand(b, t, hv, device=device, generator=gen),
        ]

    base = [x.to(torch.bfloat16) for x in inputs()]
    results = []
    for fn in (fla_gated_delta_rule, chunk_gated_delta_rule):
        args = [x.clone().requires_grad_() for x in base]
        o, _ = fn(*args)
        o.float().square().sum().backward()
        results.append([o.detach().float()] + [a.grad.float() for a in args])
    torch.cuda.synchronize(device)
    for got, want in zip(*results, strict=True):
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        if not err <= 5e-2:
            return f"flash-linear-attention disagrees with the torch chunked form ({err:.2e} relative)"
    return None


def resolve_impl(impl: str, device: torch.device) -> str:
    """`auto` -> FLA on CUDA when it trains correctly there (`fla_unusable_reason`), else the torch
    chunked form."""
    if impl not in IMPLS:
        raise ValueError(f"unknown gated delta rule implementation {impl!r}; expected one of {IMPLS}")
    if impl == IMPL_AUTO:
        if device.type != "cuda" or fla_chunk_kernel() is None:
            return IMPL_CHUNK
        return IMPL_FLA if fla_unusable_reason(canonical_device(device)) is None else IMPL_CHUNK
    if impl == IMPL_FLA:
        reason = fla_unusable_reason(canonical_device(device))
        if reason is not None:
            raise ValueError(reason)
    return impl


def canonical_device(device: torch.device) -> torch.device:
    """`cuda` and `cuda:0` are one cache entry."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """Normalise and scale q/k, map key heads onto value heads, move to [B, H, T, ·] in fp32."""
    b, t, hk, dk = q.shape
    hv = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != (b, t) or g.shape != (b, t, hv) or beta.shape != (b, t, hv):
        raise ValueError(
            f"gated delta rule shapes disagree: q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
            f"g{tuple(g.shape)} beta{tuple(beta.shape)}"
        )
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    cdt = compute_dtype(v.dtype)
    q = l2_normalize(q.to(cdt)) * dk**-0.5
    k = l2_normalize(k.to(cdt))
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v = (x.transpose(1, 2).to(cdt) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).to(cdt) for x in (g, beta))
    return q, k, v, g, beta


def _initial_state(initial_state, b, h, dk, dv, like):
    if initial_state is None:
        return like.new_zeros(b, h, dk, dv)
    if initial_state.shape != (b, h, dk, dv):
        raise ValueError(f"initial_state must be [{b}, {h}, {dk}, {dv}], got {tuple(initial_state.shape)}")
    return initial_state.to(like.dtype)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, output_final_state=False):
    """Per-token recurrence (the reference form)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    state = _initial_state(initial_state, b, h, dk, v.shape[-1], v)
    outs = []
    for i in range(t):
        state = state * g[:, :, i].exp()[..., None, None]
        k_t = k[:, :, i]
        predicted = (k_t[..., None] * state).sum(-2)  # Sᵀ k
        delta = (v[:, :, i] - predicted) * beta[:, :, i, None]
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((q[:, :, i, :, None] * state).sum(-2))
    o = torch.stack(outs, dim=2)
    return o.transpose(1, 2).to(out_dtype), (state if output_final_state else None)


def chunk_gated_delta_rule(
    q, k, v, g, beta, *, chunk_size: int = CHUNK_SIZE, initial_state=None, output_final_state=False
):
    """Chunked WY/UT form: intra-chunk work batched over all chunks, a short scan over chunks."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t) % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)

    gamma = g.cumsum(-1)  # log of the decay from the chunk start through position i
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # Γ_ij = exp(γ_i − γ_j) for i ≥ j; the masked upper part would overflow, so it is -inf first.
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    a = ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~causal.tril(-1), 0.0)  # strictly lower
    rhs = torch.cat((v * beta[..., None], k_beta * gamma.exp()[..., None]), dim=-1)
    # unitriangular: the solve reads (I + strictlower(a)); one solve serves U and W together.
    u, w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split((dv, dk), dim=-1)

    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    gamma_last = gamma[..., -1:]
    k_decayed = (k * (gamma_last - gamma).exp()[..., None]).transpose(-1, -2)
    chunk_decay = gamma_last.exp()[..., None]

    state = _initial_state(initial_state, b, h, dk, dv, v)
    entering, corrected = [], []
    # unbind (not indexing): its backward stacks the chunk gradients once instead of writing
    # each into a zero-filled full-size tensor, which would cost O(N²) memory traffic.
    for u_i, w_i, kd_i, decay_i in zip(
        u.unbind(2), w.unbind(2), k_decayed.unbind(2), chunk_decay.unbind(2), strict=True
    ):
        entering.append(state)
        v_new = u_i - w_i @ state
        corrected.append(v_new)
        state = state * decay_i + kd_i @ v_new
    s_in = torch.stack(entering, dim=2)
    v_new = torch.stack(corrected, dim=2)
    o = q_decayed @ s_in + attn @ v_new
    o = o.reshape(b, h, n * c, dv)[:, :, :t]
    return o.transpose(1, 2).to(out_dtype), (state if output_final_state else None)


def fla_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, output_final_state=False):
    """flash-linear-attention's Triton kernel (CUDA); q/k normalised inside the kernel."""
    kernel = fla_chunk_kernel()
    if kernel is None:
        raise ValueError("flash-linear-attention is not importable")
    o, state = kernel(
        q,
        k,
        v,
        g=g.float(),
        beta=beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True,
    )
    return o.to(v.dtype), (state if output_final_state else None)


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    impl: str = IMPL_AUTO,
    chunk_size: int = CHUNK_SIZE,
    initial_state=None,
    output_final_state: bool = False,
):
    """Dispatch to the implementation `impl` names (see module docstring)."""
    impl = resolve_impl(impl, q.device)
    kw = {"initial_state": initial_state, "output_final_state": output_final_state}
    if impl == IMPL_FLA:
        return fla_gated_delta_rule(q, k, v, g, beta, **kw)
    if impl == IMPL_RECURRENT:
        return recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, **kw)
