"""The gated delta rule (GDN, the linear attention of Qwen4-Exp's linear layers, where its PLE
layers sit) as a plain torch recurrence, installed over SGLang's Triton GDN kernel for this CPU
machine's engines: under Triton 3.8's interpreter FLA's chunk_gated_delta_rule returns a final
state ~6e9 off and decode goes NaN (shared/spec/sglang.md). Test scaffolding, not the product:
the stock engine and every plestore engine run the same recurrence, so their tokens compare.

Per value head, token by token (float32, the state [V, K] as SGLang's pool stores it):
    q, k <- l2norm(q), l2norm(k);  q <- q * scale
    S <- S * exp(g)
    S <- S + outer(beta * (v - S k), k)
    o <- S q
Value head h reads key / query head h // (HV / H)."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

#: sglang.srt.layers.attention.linear.kernels.gdn_triton.TritonGDNKernel's methods replaced
REPLACED = ("extend", "decode", "packed_decode", "target_verify")


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrence(q, k, v, g, beta, state, scale):
    """One sequence. q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV]; state [HV, V, K] float32
    (updated in place). Returns o [T, HV, V] float32."""
    hv, h = v.shape[1], q.shape[1]
    q = _l2norm(q.float()).repeat_interleave(hv // h, dim=1) * scale  # [T, HV, K]
    k = _l2norm(k.float()).repeat_interleave(hv // h, dim=1)  # [T, HV, K]
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    for t in range(v.shape[0]):
        state.mul_(g[t].exp()[:, None, None])
        recalled = torch.einsum("hvk,hk->hv", state, k[t])  # [HV, V]
        delta = (v[t] - recalled) * beta[t][:, None]
        state.add_(delta[:, :, None] * k[t][:, None, :])
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])
    return out


def gates(a, b, A_log, dt_bias):
    """SGLang's GDN gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return g, b.float().sigmoid()


def _run(q, k, v, g, beta, ssm_states, cache_indices, starts, scale):
    """Sequences [starts[i], starts[i+1]) of the flattened tokens, each on its pool slot
    cache_indices[i] (a negative slot: padding, output zero, no state)."""
    out = torch.zeros(v.shape, dtype=torch.float32)
    for i, slot in enumerate(cache_indices.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if slot < 0 or hi == lo:
            continue
        state = ssm_states[slot].float()  # [HV, V, K]
        out[lo:hi] = recurrence(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state, scale)
        ssm_states[slot] = state.to(ssm_states.dtype)
    return out


def extend(
    self,
    q,
    k,
    v,
    g,
    beta,
    *,
    ssm_states,
    cache_indices,
    query_start_loc,
    inplace_update=True,
    **kwargs,
):
    """TritonGDNKernel.extend: q, k [1, T, H, K]; v [1, T, HV, V]; g, beta [1, T, HV] (gates
    already applied). Returns (o [1, T, HV, V], None, None): no per-chunk states, which only the
    mamba radix cache's state tracking reads (the tests' engines run without a radix cache)."""
    if not inplace_update:
        raise NotImplementedError("gdn_torch: extend without inplace_update")
    t = q.shape[1]
    scale = q.shape[-1] ** -0.5
    out = _run(
        q[0],
        k[0],
        v[0],
        g.reshape(t, -1),
        beta.reshape(t, -1),
        ssm_states,
        cache_indices,
        query_start_loc.tolist(),
        scale,
    )
    return out.to(q.dtype)[None], None, None


def decode(
    self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc, **kwargs
):
    """TritonGDNKernel.decode: one token per sequence. q, k [1, B, H, K]; v [1, B, HV, V];
    a, b [B, HV]. Returns o [1, B, HV, V]."""
    g, beta = gates(a, b, A_log, dt_bias)
    scale = q.shape[-1] ** -0.5
    out = _run(
        q[0], k[0], v[0], g, beta, ssm_states, cache_indices, query_start_loc.tolist(), scale
    )
    return out.to(q.dtype)[None]


def packed_decode(
    self,
    mixed_qkv,
    a,
    b,
    *,
    A_log,
    dt_bias,
    scale,
    ssm_states,
    cache_indices,
    num_v_heads,
    head_v_dim,
    **kwargs,
):
    """TritonGDNKernel.packed_decode: mixed_qkv [B, q | k | v] after the convolution, q and k
    of H heads of K = scale^-2 values each. Returns o [1, B, HV, V]."""
    if any(kwargs.get(f"replayssm_{x}") is not None for x in ("d", "k", "g", "write_pos")):
        raise NotImplementedError("gdn_torch: ReplaySSM decode")
    n = mixed_qkv.shape[0]
    head_k = round(scale**-2)
    qk = (mixed_qkv.shape[1] - num_v_heads * head_v_dim) // 2
    q, k, v = mixed_qkv.split([qk, qk, num_v_heads * head_v_dim], dim=-1)
    q, k = q.reshape(n, -1, head_k), k.reshape(n, -1, head_k)  # [B, H, K]
    v = v.reshape(n, num_v_heads, head_v_dim)  # [B, HV, V]
    g, beta = gates(a, b, A_log, dt_bias)
    out = _run(q, k, v, g, beta, ssm_states, cache_indices, list(range(n + 1)), scale)
    return out.to(mixed_qkv.dtype)[None]


def target_verify(self, *args, **kwargs):
    raise NotImplementedError("gdn_torch: speculative decoding's target_verify")


def install(module) -> None:
    """Replace TritonGDNKernel's methods in SGLang's gdn_triton module (its GDN dispatcher
    holds TritonGDNKernel instances, so class attributes reach every one)."""
    cls = module.TritonGDNKernel
    for name in REPLACED:
        setattr(cls, name, globals()[name])
    print(
        f"gdn_torch: {cls.__name__} runs the torch recurrence (pid {os.getpid()})",
        file=sys.stderr,
        flush=True,
    )  # (the tests look for this line in the engine's log)
