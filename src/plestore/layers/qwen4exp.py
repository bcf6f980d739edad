"""The Qwen4Exp (Qwen3.8-Flash-Next) PLE sublayer: gate the looked-up n-gram embedding against the
hyper-connection bank, pass it through a dilated causal short conv with per-request state, and
add the result to every stream of the bank (spec qwen4exp-ple.md §3).

Rounding (bf16, or whatever `dtype` is) happens exactly where §3 says the reference
materialises a value: the key/value projections, the three norms (computed in fp32), the gate
dot `d`, `gv = g * value`, the conv output before SiLU, `gv + silu(conv)`, and the bank sum.
Between those points we compute in fp32 (sums, norms, conv taps) or float64 (sigmoid), never in
the activation dtype.

Every token's result is independent of how the batch was cut: a token gives the same bits in one
unsplit prefill, in any chunk of a chunked prefill, or alone in a decode step, whatever other
requests share the batch (see `plestore.layers.ops` for how).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from plestore.layers._common import check_activation_dtype, check_positive_ints, hf_text_config
from plestore.layers.ops import (
    history_index,
    ragged_positions,
    rows_invariant_linear,
    sigmoid64,
    signed_sqrt_gate,
    tree_sum,
)

__all__ = ["GroupedRMSNorm", "Qwen4ExpPLE", "Qwen4ExpPLEConfig", "ple_weight_prefix"]


@dataclass(frozen=True)
class Qwen4ExpPLEConfig:
    """Shapes and numerics of one PLE sublayer. H = hidden_size, C = hc_count (streams),
    E = ple_embed_dim (width of the looked-up rows, defaults to H), K = conv_kernel_size,
    D = dilation (the model uses ngram_size for it)."""

    hidden_size: int
    hc_count: int = 4
    ple_embed_dim: int | None = None
    conv_kernel_size: int = 4
    dilation: int = 3
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.ple_embed_dim is None:
            object.__setattr__(self, "ple_embed_dim", self.hidden_size)
        check_positive_ints(
            self, "hidden_size", "hc_count", "ple_embed_dim", "conv_kernel_size", "dilation"
        )
        check_activation_dtype(self)

    @property
    def channels(self) -> int:
        """C*H: the bank width and the number of conv channels."""
        return self.hc_count * self.hidden_size

    @property
    def state_width(self) -> int:
        """(K-1)*D: conv state columns carried per request (9 for the real model)."""
        return (self.conv_kernel_size - 1) * self.dilation

    @classmethod
    def from_hf_config(
        cls, config: str | Path | Mapping | Any, dtype: torch.dtype = torch.bfloat16
    ) -> Qwen4ExpPLEConfig:
        """From a Hugging Face Qwen4Exp config (path, dict or config object); keys of a nested
        `text_config` win. Absent keys take the engines' defaults (spec: hc_count 4, kernel 4,
        ngram_size 3, ple_embed_dim = hidden_size)."""
        cfg = hf_text_config(config)
        if "hidden_size" not in cfg:
            raise ValueError("Qwen4Exp config lacks the key 'hidden_size'")
        return cls(
            hidden_size=cfg["hidden_size"],
            hc_count=cfg.get("hc_count") or 4,
            ple_embed_dim=cfg.get("ple_embed_dim") or cfg["hidden_size"],
            conv_kernel_size=cfg.get("ple_conv_kernel_size") or 4,
            dilation=cfg.get("ngram_size") or 3,
            rms_norm_eps=cfg.get("rms_norm_eps") or 1e-6,
            dtype=dtype,
        )


def ple_weight_prefix(layer: int, multimodal: bool = True) -> str:
    """Checkpoint prefix of decoder layer `layer`'s PLE (0-based decoder index, e.g. 1 for
    ple_layer_ids=[2]); text-only/older exports drop the `language_model.` part."""
    return f"model.{'language_model.' if multimodal else ''}layers.{layer}.ple."


class GroupedRMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * (1 + w)` over each contiguous group of `group_size` channels,
    in fp32, cast back to x's dtype. `w` is zero-initialised, as in the model."""

    def __init__(
        self,
        groups: int,
        group_size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.groups, self.group_size, self.eps = groups, group_size, eps
        self.weight = nn.Parameter(torch.zeros(groups * group_size, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        xf = x.float().reshape(-1, self.groups, self.group_size)  # [T, C, H]
        inv = 1.0 / torch.sqrt(tree_sum(xf * xf) / self.group_size + self.eps)  # [T, C]
        scale = 1.0 + self.weight.float().view(self.groups, self.group_size)  # [C, H]
        return (xf * inv[..., None] * scale).to(x.dtype).reshape(shape)


class Qwen4ExpPLE(nn.Module):
    """One PLE sublayer; parameter names match the checkpoint below the layer's `ple.` prefix.

    `forward(bank, emb, query_start_loc, conv_state, has_initial_state, valid)` takes a ragged
    batch of T tokens from R requests (request r owns tokens
    `[query_start_loc[r], query_start_loc[r+1])`; any mix of prefill chunks and decode steps)
    and returns `(bank', new_conv_state)`.
    """

    def __init__(self, config: Qwen4ExpPLEConfig, device: torch.device | str | None = None):
        super().__init__()
        self.config = c = config
        kw = {"dtype": c.dtype, "device": device}
        self.key_proj = nn.Linear(c.ple_embed_dim, c.channels, bias=False, **kw)
        self.value_proj = nn.Linear(c.ple_embed_dim, c.hidden_size, bias=False, **kw)
        self.norm_key = GroupedRMSNorm(c.hc_count, c.hidden_size, c.rms_norm_eps, **kw)
        self.norm_query = GroupedRMSNorm(c.hc_count, c.hidden_size, c.rms_norm_eps, **kw)
        self.norm_conv = GroupedRMSNorm(c.hc_count, c.hidden_size, c.rms_norm_eps, **kw)
        # Holds the depthwise weight [C*H, 1, K] under its checkpoint name; forward does its own
        # gather across request boundaries and never calls it.
        self.conv1d = nn.Conv1d(
            c.channels,
            c.channels,
            c.conv_kernel_size,
            groups=c.channels,
            dilation=c.dilation,
            bias=False,
            **kw,
        )

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        bank: Tensor,
        emb: Tensor,
        query_start_loc: Tensor,
        conv_state: Tensor | None = None,
        has_initial_state: Tensor | None = None,
        valid: Tensor | None = None,
        *,
        check: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """bank [T, C*H] (or [T, C, H]) and emb [T, E] in the layer dtype; query_start_loc [R+1]
        int; conv_state [R, C*H, (K-1)*D] (None: every request fresh); has_initial_state [R]
        bool (False: treat that request's state as zeros, as for a new request; None: all
        True); valid [T] bool (False: zero PLE output for that token).

        Returns bank' (same shape as bank; bank + PLE output, rounded once) and the new conv
        state [R, C*H, (K-1)*D]: per request the last (K-1)*D columns of the normed, gated
        values ending at its last token, reaching back into the old state for short chunks.

        Tokens at or after query_start_loc[-1] belong to no request: they get zero output and
        enter no conv window. `valid` masks only the output; an invalid token inside a request
        still enters its neighbours' conv windows. `check=False` skips the checks that read
        query_start_loc back to the host (for CUDA graphs).
        """
        out, mask, new_state = self._ple(
            bank, emb, query_start_loc, conv_state, has_initial_state, valid, check
        )
        flat = bank.reshape(out.shape)  # [T, C*H]
        summed = (flat.float() + out.float()).to(bank.dtype)
        return torch.where(mask[:, None], summed, flat).view(bank.shape), new_state

    def ple_output(
        self,
        bank: Tensor,
        emb: Tensor,
        query_start_loc: Tensor,
        conv_state: Tensor | None = None,
        has_initial_state: Tensor | None = None,
        valid: Tensor | None = None,
        *,
        check: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Like forward, but returns the PLE output `gv + silu(conv)` [T, C*H] itself (zeros for
        padding and invalid tokens) instead of adding it to the bank (newer vLLM folds the add
        elsewhere)."""
        out, mask, new_state = self._ple(
            bank, emb, query_start_loc, conv_state, has_initial_state, valid, check
        )
        return torch.where(mask[:, None], out, torch.zeros_like(out)), new_state

    def _ple(self, bank, emb, qsl, conv_state, has_initial_state, valid, check):
        c = self.config
        dt, C, H, K, D, S, CH = (
            c.dtype,
            c.hc_count,
            c.hidden_size,
            c.conv_kernel_size,
            c.dilation,
            c.state_width,
            c.channels,
        )
        self._check(bank, emb, qsl, conv_state, has_initial_state, valid, check)
        t, r = emb.shape[0], qsl.numel() - 1
        bank = bank.reshape(t, CH)

        key = rows_invariant_linear(emb, self.key_proj.weight)  # [T, C*H]
        value = rows_invariant_linear(emb, self.value_proj.weight)  # [T, H]
        kn = self.norm_key(key).view(t, C, H)
        qn = self.norm_query(bank).view(t, C, H)
        d = (tree_sum(kn.float() * qn.float()) / math.sqrt(H)).to(dt)  # [T, C]
        g = signed_sqrt_gate(d).float()  # [T, C]
        gv = (g[:, :, None] * value.float()[:, None, :]).to(dt).view(t, CH)  # [T, C*H]
        gn = self.norm_conv(gv)  # [T, C*H]

        # Conv over [carried state | this step's tokens] of each request, as one gather per tap
        # from a stacked source: rows [0, R*S) state, [R*S, R*S+T) tokens, R*S+T a zero row.
        if conv_state is None:
            state = gn.new_zeros(r, CH, S)
        elif has_initial_state is None:
            state = conv_state
        else:
            state = torch.where(has_initial_state[:, None, None], conv_state, 0)
        src = torch.cat([state.transpose(1, 2).reshape(r * S, CH), gn, gn.new_zeros(1, CH)])
        req, pos, inside = ragged_positions(qsl, t)
        w = self.conv1d.weight.float().view(CH, K)
        acc = None
        for k in range(K):  # fixed order, oldest tap (t - (K-1)*D) first
            idx = history_index(qsl, req, pos - (K - 1 - k) * D, S)
            idx = torch.where(inside, idx, r * S + t)
            term = src[idx].float() * w[:, k]  # [T, C*H]
            acc = term if acc is None else acc + term
        y = acc.to(dt).double()  # conv output rounded before SiLU
        out = (gv.double() + y * sigmoid64(y)).float().to(dt)  # [T, C*H]

        lengths = (qsl[1:] - qsl[:-1]).long()  # [R]
        cols = lengths[:, None] - S + torch.arange(S, device=qsl.device)  # [R, S]
        reqs = torch.arange(r, device=qsl.device)[:, None].expand(r, S)
        new_state = src[history_index(qsl, reqs, cols, S)]  # [R, S, C*H]
        new_state = new_state.transpose(1, 2).contiguous()  # [R, C*H, S]

        mask = inside if valid is None else inside & valid
        return out, mask, new_state

    def _check(self, bank, emb, qsl, conv_state, has_initial_state, valid, check) -> None:
        c, name = self.config, type(self).__name__
        if emb.dim() != 2 or emb.shape[1] != c.ple_embed_dim:
            raise ValueError(
                f"{name}: emb must be [T, ple_embed_dim={c.ple_embed_dim}], got "
                f"{list(emb.shape)} (wrong ple_embed_dim?)"
            )
        t = emb.shape[0]
        if bank.dim() == 3:
            if bank.shape[1] != c.hc_count or bank.shape[2] != c.hidden_size:
                raise ValueError(
                    f"{name}: bank is {list(bank.shape)}; expected [T, hc_count={c.hc_count}, "
                    f"hidden_size={c.hidden_size}] (wrong stream count or hidden size)"
                )
        elif bank.dim() != 2 or bank.shape[1] != c.channels:
            raise ValueError(
                f"{name}: bank is {list(bank.shape)}; expected [T, hc_count*hidden_size = "
                f"{c.hc_count}*{c.hidden_size} = {c.channels}] (wrong stream count or hidden "
                "size?)"
            )
        if bank.shape[0] != t:
            raise ValueError(f"{name}: bank has {bank.shape[0]} tokens, emb {t}")
        for what, x in (("bank", bank), ("emb", emb), ("conv_state", conv_state)):
            if x is not None and x.dtype != c.dtype:
                raise ValueError(f"{name}: {what} is {x.dtype}, the layer computes in {c.dtype}")
        dev = self.conv1d.weight.device
        for what, x in (
            ("bank", bank),
            ("emb", emb),
            ("query_start_loc", qsl),
            ("conv_state", conv_state),
            ("has_initial_state", has_initial_state),
            ("valid", valid),
        ):
            if x is not None and x.device != dev:
                raise ValueError(f"{name}: {what} is on {x.device}, the weights on {dev}")
        if qsl.dim() != 1 or qsl.numel() < 1 or qsl.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name}: query_start_loc must be a 1-D int32/int64 tensor [R+1], "
                f"got {qsl.dtype} {list(qsl.shape)}"
            )
        r = qsl.numel() - 1
        want = [r, c.channels, c.state_width]
        if conv_state is not None and list(conv_state.shape) != want:
            raise ValueError(
                f"{name}: conv_state must be [R, C*H, (K-1)*D] = {want}, got "
                f"{list(conv_state.shape)}"
            )
        for what, x, n in (("has_initial_state", has_initial_state, r), ("valid", valid, t)):
            if x is not None and (x.dtype != torch.bool or list(x.shape) != [n]):
                raise ValueError(
                    f"{name}: {what} must be a bool tensor [{n}], got {x.dtype} {list(x.shape)}"
                )
        if check:
            q = qsl.tolist()
            if q[0] != 0 or any(b < a for a, b in zip(q, q[1:], strict=False)) or q[-1] > t:
                raise ValueError(
                    f"{name}: query_start_loc must start at 0, never decrease and "
                    f"end at most at T={t}, got {q}"
                )

    # ------------------------------------------------------------------------------------------
    def load_weights(self, tensors: Mapping[str, Tensor], prefix: str = "") -> list[str]:
        """Copy this layer's weights from `tensors` (checkpoint name -> tensor) under `prefix`
        (e.g. `ple_weight_prefix(1)` = "model.language_model.layers.1.ple."), casting to the
        layer dtype. Accepts a merged `kv_proj.weight` [C*H + H, E] (newer vLLM) instead of
        key_proj/value_proj. Other names (the table under `ple_embedding.`) are ignored.
        Returns the names it consumed; raises naming every missing or mis-shaped weight."""
        c = self.config
        if prefix and not prefix.endswith("."):
            prefix += "."
        params = dict(self.named_parameters())
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        found = {n: (prefix + n, tensors[prefix + n]) for n in params if prefix + n in tensors}
        merged = prefix + "kv_proj.weight"
        if merged in tensors:
            if "key_proj.weight" in found or "value_proj.weight" in found:
                raise ValueError(
                    f"checkpoint has both {merged} and separate key_proj/value_proj "
                    "weights; which one is meant is ambiguous"
                )
            kv = tensors[merged]
            want = (c.channels + c.hidden_size, c.ple_embed_dim)
            if tuple(kv.shape) != want:
                raise ValueError(
                    f"{merged} has shape {list(kv.shape)}, expected {list(want)} "
                    "([C*H + H, E]: key rows, then value rows)"
                )
            found["key_proj.weight"] = (merged, kv[: c.channels])
            found["value_proj.weight"] = (merged, kv[c.channels :])
        missing = [prefix + n for n in params if n not in found]
        if missing:
            raise ValueError(
                f"checkpoint lacks {', '.join(missing)} (looked under prefix {prefix!r}; "
                f"{sum(k.startswith(prefix) for k in tensors)} names there)"
            )
        bad = [
            f"{src} is {list(x.shape)}, expected {list(shapes[n])}"
            for n, (src, x) in found.items()
            if tuple(x.shape) != shapes[n]
        ]
        bad += [
            f"{src} has dtype {x.dtype}; quantized or integer projection weights are not "
            "supported (dequantize first)"
            for n, (src, x) in found.items()
            if not x.is_floating_point() or x.dtype.itemsize == 1
        ]
        if bad:
            raise ValueError("bad PLE weights: " + "; ".join(bad))
        with torch.no_grad():
            for n, (_, x) in found.items():
                params[n].copy_(x.to(device=params[n].device, dtype=params[n].dtype))
        return sorted({src for src, _ in found.values()})
