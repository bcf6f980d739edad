"""Torch versions of the Qwen4Exp ops vLLM has only in Triton, for its CPU build without a Triton
CPU backend: the hyper-connection ops (`nvidia/ops/hc.py`) and the PLE gate and dilated short
convolution (`common/ops/ple.py`). Each takes the arguments of the function it replaces and keeps
its rounding boundaries (fp32 math, the activation dtype wherever the kernel materialises one), so
vLLM's CPU engine computes what its GPU kernels compute, up to fp32 summation order.

Registered through vLLM's own override registry (`register_kernels`, see `cpu.py`).
"""

from __future__ import annotations

import torch

__all__ = [
    "OVERRIDES",
    "grouped_gemma_rmsnorm",
    "hc_combine",
    "hc_combine_norm",
    "hc_gate_mix",
    "hc_silu",
    "ple_conv",
    "ple_gate",
]

_HC = "vllm.models.qwen4_exp.nvidia.ops.hc"
_PLE = "vllm.models.qwen4_exp.common.ops.ple"
_NULL_STATE = 0  # vLLM's NULL_BLOCK_ID: a padded row's state slot


def _rms_affine(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 x [..., G] * rsqrt(mean(x^2) + eps), then y + y * w (Gemma's 1 + w affine)."""
    y = x * torch.rsqrt(x.square().sum(-1, keepdim=True) / x.shape[-1] + eps)
    return y + y * w.float()


def grouped_gemma_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, num_groups: int
) -> torch.Tensor:
    n, dim = x.shape
    g = x.float().view(n, num_groups, dim // num_groups)  # [N, groups, group_dim]
    w = weight.view(-1) if weight.numel() * num_groups == dim else weight.view(num_groups, -1)
    return _rms_affine(g, w, eps).view(n, dim).to(x.dtype)


def hc_silu(x: torch.Tensor, hc_count: int) -> torch.Tensor:
    v = x.float() / hc_count
    return (v * torch.sigmoid(v)).to(x.dtype)


def hc_gate_mix(x: torch.Tensor, gate: torch.Tensor, hc_count: int) -> torch.Tensor:
    n, dim = gate.shape
    xs = x.float().view(n, hc_count, dim // hc_count)  # [N, HC, H]
    gs = gate.float().view(n, hc_count, dim // hc_count)
    acc = torch.zeros(n, dim // hc_count, dtype=torch.float32, device=x.device)
    for s in range(hc_count):  # stream by stream, as the kernel accumulates
        acc += torch.sigmoid(gs[:, s]) * xs[:, s]
    return (acc / hc_count).to(x.dtype)


def _combined(residual, block_output, injection_logits, hc_count) -> torch.Tensor:
    """fp32 [N, HC, H]: residual + block (scaled per stream by 2 * sigmoid(logit / HC))."""
    n, dim = residual.shape
    block = block_output.float()[:, None, :]  # [N, 1, H]
    if injection_logits is not None:
        block = block * (2.0 * torch.sigmoid(injection_logits.float() / hc_count))[:, :, None]
    return residual.float().view(n, hc_count, dim // hc_count) + block


def hc_combine(
    residual: torch.Tensor,
    block_output: torch.Tensor,
    injection_logits: torch.Tensor | None,
    hc_count: int,
) -> torch.Tensor:
    out = _combined(residual, block_output, injection_logits, hc_count)
    return out.reshape(residual.shape).to(residual.dtype)


def hc_combine_norm(
    residual: torch.Tensor,
    block_output: torch.Tensor,
    injection_logits: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    hc_count: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, dim = residual.shape
    out = _combined(residual, block_output, injection_logits, hc_count).to(residual.dtype)
    shared = norm_weight.numel() * hc_count == dim
    w = norm_weight.view(-1) if shared else norm_weight.view(hc_count, -1)
    y = _rms_affine(out.float(), w, eps).to(residual.dtype)  # normalised per stream
    return out.reshape(n, dim), y.reshape(n, dim)


def ple_gate(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key_w: torch.Tensor,
    norm_query_w: torch.Tensor,
    norm_conv_w: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gated, normed) [T, HC*H]: every stream's value gated by
    g = sigmoid(sign(d) sqrt(max(|d|, 1e-6))), d = <norm(k), norm(q)> / sqrt(H)."""
    if key.dtype != value.dtype or key.dtype != hidden.dtype:
        raise ValueError("key, value, and hidden must have the same dtype")
    dt = hidden.dtype
    t, h = value.shape
    hc = hidden.shape[-1] // h
    k = key.float().reshape(t, hc, h)  # [T, HC, H]
    q = hidden.float().reshape(t, hc, h)
    kn = _normed(k, norm_key_w.float().view(hc, h), eps).to(dt)
    qn = _normed(q, norm_query_w.float().view(hc, h), eps).to(dt)
    products = (kn.float() * qn.float()).to(dt)
    dot = products.float().sum(-1).to(dt).float()  # [T, HC]
    d = (dot / torch.sqrt(torch.tensor(float(h)))).to(dt).float()
    magnitude = torch.sqrt(torch.clamp(d.abs(), min=1e-6)).to(dt).float()
    g = torch.sigmoid(torch.sign(d) * magnitude).to(dt).float()
    gated = (g[:, :, None] * value.float()[:, None, :]).to(dt)  # [T, HC, H]
    normed = _normed(gated.float(), norm_conv_w.float().view(hc, h), eps)
    return gated.reshape(t, hc * h), normed.to(dt).reshape(t, hc * h)


def _normed(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 x * rsqrt(mean(x^2) + eps) * (1 + w) over the last dimension."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) / x.shape[-1] + eps) * (1.0 + w)


def ple_conv(
    inputs: torch.Tensor,
    residual: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weights: torch.Tensor,
    state_indices: torch.Tensor,
    outer_residual: torch.Tensor | None,
    *,
    mode: str,
    dilation: int,
    query_start_loc: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    has_initial_states: torch.Tensor | None = None,
    spec_query_len: int = 1,
    token_indices: torch.Tensor | None = None,
) -> None:
    """The dilated causal short convolution of every request, in place: residual[t] gets
    silu(conv) (+ residual, then + outer_residual, when outer_residual is given) and each
    request's state [C, window] its last (K-1)*D inputs. Rows past the batch's last request and
    rows of the null state slot get no convolution (0)."""
    del num_accepted_tokens, spec_query_len
    if mode == "spec":
        raise NotImplementedError(
            "plestore's CPU short convolution has no speculative-decode mode: run without "
            "speculative decoding on vLLM's CPU build"
        )
    if mode not in ("decode", "prefill"):
        raise ValueError(f"Unsupported short-conv mode: {mode}")
    rows = token_indices.long() if token_indices is not None else None
    n = rows.numel() if rows is not None else inputs.shape[0]
    if mode == "decode":  # one token per request
        qsl = list(range(n + 1))
        inits = None if has_initial_states is None else has_initial_states[:n].tolist()
    else:
        if query_start_loc is None or has_initial_states is None:
            raise ValueError("query_start_loc and has_initial_states are required for prefill")
        qsl = query_start_loc.tolist()
        inits = has_initial_states.tolist()
    state_len = (conv_weights.shape[1] - 1) * dilation
    slots = state_indices.tolist()
    if mode == "decode" and len(slots) < n:
        raise ValueError(f"decode of {n} tokens needs {n} state indices, got {len(slots)}")
    conv_out = torch.zeros(n, inputs.shape[1], dtype=inputs.dtype, device=inputs.device)
    updates = []
    for r in range(len(slots) if mode == "prefill" else n):
        a, b = qsl[r], min(qsl[r + 1], n)
        sid = int(slots[r])
        if sid == _NULL_STATE or b <= a:
            continue
        at = torch.arange(a, b) if rows is None else rows[a:b]
        x = inputs[at]  # [L, C]
        state = conv_state[sid, :, :state_len]  # [C, state_len]
        init = bool(inits[r]) if inits is not None else True
        prev = state.t().float() if init else torch.zeros(state_len, x.shape[1])
        seq = torch.cat([prev, x.float()])  # [state_len + L, C], both exact in fp32
        conv_out[a:b] = _dilated_silu(seq, conv_weights, dilation, b - a, residual.dtype)
        updates.append((sid, seq[-state_len:].t()))
    for sid, window in updates:  # every token read the old state first
        conv_state[sid, :, :state_len] = window.to(conv_state.dtype)
    out_rows = torch.arange(n) if rows is None else rows
    if outer_residual is None:
        residual[out_rows] = conv_out
    else:
        ple = (residual[out_rows] + conv_out).to(residual.dtype)
        residual[out_rows] = (outer_residual[out_rows].float() + ple.float()).to(residual.dtype)


def _dilated_silu(
    seq: torch.Tensor, w: torch.Tensor, dilation: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """silu(conv) [n, C] in `dtype` of the last n positions of fp32 seq [state_len + n, C]: taps
    k = 0..K-1 at j + D*k summed in fp32 in tap order, the conv rounded to `dtype` first."""
    acc = torch.zeros(n, seq.shape[1], dtype=torch.float32, device=seq.device)
    for k in range(w.shape[1]):
        acc += w[:, k].float() * seq[dilation * k : dilation * k + n]
    conv = acc.to(dtype).float()
    return (conv * torch.sigmoid(conv)).to(dtype)


#: vLLM's qualified names -> their torch versions (vllm.triton_utils.dispatcher.register_kernels)
OVERRIDES = {
    f"{_HC}.grouped_gemma_rmsnorm": grouped_gemma_rmsnorm,
    f"{_HC}.hc_silu": hc_silu,
    f"{_HC}.hc_gate_mix": hc_gate_mix,
    f"{_HC}.hc_combine": hc_combine,
    f"{_HC}.hc_combine_norm": hc_combine_norm,
    f"{_PLE}.ple_gate": ple_gate,
    f"{_PLE}.ple_conv": ple_conv,
}
