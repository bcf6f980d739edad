"""Slow, plainly written references for the layer math, one token at a time in float64.

They share no code with the modules: they read the spec formulas straight (qwen4exp-ple.md §3,
engram.md "Layer math differs") and walk each request token by token, with a Python list as the
PLE conv history. Tests compare the modules against them.

`round_dtype=None` computes everything in float64. `round_dtype=torch.bfloat16` rounds at the
boundaries the spec lists (each still computed from float64 values), which should agree with the
bf16 module bit for bit except where a float64 and an fp32 computation of the same quantity land
on different sides of a bf16 rounding boundary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["engram_v41_reference", "qwen4exp_ple_reference"]


def _rounder(round_dtype: torch.dtype | None):
    if round_dtype is None:
        return lambda x: x
    return lambda x: x.to(torch.float32).to(round_dtype).to(torch.float64)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _gate(d: float, sign_of_zero: int = 0) -> float:
    """sigmoid(sign(d) * sqrt(max(|d|, 1e-6))); Engram takes sign(0) = +1 (sigmoid(1e-3))."""
    sign = (d > 0) - (d < 0) or sign_of_zero
    return _sigmoid(sign * math.sqrt(max(abs(d), 1e-6)))


def qwen4exp_ple_reference(
    weights: Mapping[str, Tensor],
    bank: Tensor,
    emb: Tensor,
    query_start_loc: list[int],
    conv_state: Tensor | None,
    *,
    hc_count: int,
    dilation: int,
    eps: float,
    valid: list[bool] | None = None,
    round_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """weights: the module's parameter names (key_proj.weight, value_proj.weight, norm_key.weight,
    norm_query.weight, norm_conv.weight, conv1d.weight). bank [T, C*H], emb [T, E],
    conv_state [R, C*H, S] or None (all fresh). Returns (bank', new_state, ple_out), float64."""
    rnd = _rounder(round_dtype)
    w = {k: v.detach().cpu().double() for k, v in weights.items()}
    bank, emb = bank.detach().cpu().double(), emb.detach().cpu().double()
    t_total, channels = bank.shape
    h = channels // hc_count
    kernel = w["conv1d.weight"].shape[-1]
    s = (kernel - 1) * dilation
    r_total = len(query_start_loc) - 1
    if conv_state is None:
        conv_state = torch.zeros(r_total, channels, s)
    conv_state = conv_state.detach().cpu().double()

    def norm(x: Tensor, weight: Tensor) -> Tensor:  # one token, [C*H]
        out = torch.empty_like(x)
        for c in range(hc_count):
            g = x[c * h : (c + 1) * h]
            ms = sum(float(v) ** 2 for v in g) / h
            out[c * h : (c + 1) * h] = g / math.sqrt(ms + eps) * (1 + weight[c * h : (c + 1) * h])
        return rnd(out)

    ple = torch.zeros(t_total, channels, dtype=torch.float64)
    new_state = torch.zeros(r_total, channels, s, dtype=torch.float64)
    for r in range(r_total):
        history = [conv_state[r, :, j] for j in range(s)]  # oldest first
        for t in range(query_start_loc[r], query_start_loc[r + 1]):
            key = rnd(w["key_proj.weight"] @ emb[t])
            value = rnd(w["value_proj.weight"] @ emb[t])
            kn = norm(key, w["norm_key.weight"])
            qn = norm(bank[t], w["norm_query.weight"])
            gv = torch.empty(channels, dtype=torch.float64)
            for c in range(hc_count):
                dot = float(
                    rnd(
                        torch.tensor(
                            sum(
                                float(a) * float(b)
                                for a, b in zip(
                                    kn[c * h : (c + 1) * h], qn[c * h : (c + 1) * h], strict=True
                                )
                            )
                            / math.sqrt(h)
                        )
                    )
                )
                gv[c * h : (c + 1) * h] = _gate(dot) * value
            gv = rnd(gv)
            history.append(norm(gv, w["norm_conv.weight"]))
            y = torch.zeros(channels, dtype=torch.float64)
            for k in range(kernel):
                y += w["conv1d.weight"][:, 0, k] * history[-1 - (kernel - 1 - k) * dilation]
            y = rnd(y)
            ple[t] = rnd(gv + y * torch.sigmoid(y))
        new_state[r] = torch.stack(history[-s:], dim=1)
    if valid is not None:
        ple[~torch.tensor(valid, dtype=torch.bool)] = 0
    ple[query_start_loc[-1] :] = 0
    return rnd(bank + ple), new_state, ple


def engram_v41_reference(
    weights: Mapping[str, Tensor],
    h: Tensor,
    emb: Tensor,
    *,
    hc_mult: int,
    eps: float,
    token_mask: list[bool] | None = None,
    round_dtype: torch.dtype | None = None,
) -> Tensor:
    """weights: wkv.weight [(hc+1)*dim, heads*head_dim], q_weight [hc, dim], k_weight [hc, dim].
    h [T, hc, dim], emb [T, heads*head_dim]. Returns h' [T, hc, dim] in float64:
    h'[c] = h[c] + gate_c * value with gate_c from
    dot_c = sum_j h[c,j] q_w[c,j] k_w[c,j] key[c,j] / rms(h[c]) / rms(key[c]) / sqrt(dim);
    `round_dtype` rounds kv and h'."""
    rnd = _rounder(round_dtype)
    w = {k: v.detach().cpu().double() for k, v in weights.items()}
    h, emb = h.detach().cpu().double(), emb.detach().cpu().double()
    t_total, _, dim = h.shape
    out = h.clone()
    for t in range(t_total):
        if token_mask is not None and not token_mask[t]:
            continue
        kv = rnd(w["wkv.weight"] @ emb[t]).view(hc_mult + 1, dim)
        value = kv[hc_mult]
        for c in range(hc_mult):
            x, key = h[t, c], kv[c]
            rms_x = math.sqrt(sum(float(v) ** 2 for v in x) / dim + eps)
            rms_k = math.sqrt(sum(float(v) ** 2 for v in key) / dim + eps)
            dot = sum(
                float(x[j])
                * float(w["q_weight"][c, j])
                * float(w["k_weight"][c, j])
                * float(key[j])
                for j in range(dim)
            )
            gate = _gate(dot / rms_x / rms_k / math.sqrt(dim), sign_of_zero=1)
            out[t, c] = rnd(x + gate * value)
    return out
