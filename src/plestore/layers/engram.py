"""The DeepSeek-V4.1 Engram layer (spec engram.md, "Layer math differs"): one projection of the
looked-up rows gives a key per hyper-connection stream and one shared value; each stream is
gated by how well its hidden state matches its key, and the gated value is added to it. There
is no short conv, so the layer carries no per-request state (the n-gram context lives in the
hashing step).

The spec gives the formula, not the rounding points or the weight names; our reading:

* `kv = wkv(emb)` [T, (hc+1)*dim] in the activation dtype, rows `[key_0 | ... | key_{hc-1} |
  value]` (streams in order, the shared value last);
* `dot_c = sum_j h_c[j] * q_w[j] * k_w[j] * key_c[j] / rms(h_c) / rms(key_c) / sqrt(dim)` with
  `rms(x) = sqrt(mean(x^2) + eps)`, i.e. the dot of RMSNorm_q(h_c) and RMSNorm_k(key_c) (plain
  weights, not `1 + w`) scaled by 1/sqrt(dim); `q_w` and `k_w` are [dim], shared by all streams;
  computed in fp32 from the rounded key and h, not rounded itself;
* `gate_c = sigmoid(sign(dot_c) * sqrt(max(|dot_c|, 1e-6)))` (float64, sign(0) -> 0.5);
* `h'_c = round(h_c + round(gate_c * value))`: the gated value is rounded once, like PLE's `gv`,
  then added to each stream; where `token_mask` is False, h' = h bit for bit (gate closed).

Checkpoint names: `wkv.weight` is the spec's; `q_norm.weight` and `k_norm.weight` are ours (the
spec does not name the two norm weights) — `load_weights` takes aliases for the real ones.
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
from plestore.layers.ops import rows_invariant_linear, signed_sqrt_gate, tree_sum

__all__ = ["EngramV41", "EngramV41Config"]


@dataclass(frozen=True)
class EngramV41Config:
    """dim = hidden_size (per stream), hc_mult streams, num_heads hash columns of head_dim each
    (24 x 256 for V4.1-Flash: (max_ngram_size - 1) * n_heads)."""

    hidden_size: int
    hc_mult: int = 4
    num_heads: int = 24
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        check_positive_ints(self, "hidden_size", "hc_mult", "num_heads", "head_dim")
        check_activation_dtype(self)

    @property
    def embed_dim(self) -> int:
        """Width of the flattened looked-up rows: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @classmethod
    def from_hf_config(
        cls, config: str | Path | Mapping | Any, dtype: torch.dtype = torch.bfloat16
    ) -> EngramV41Config:
        """From a DeepSeek-V4.1 config (path, dict or config object; text_config keys win)."""
        cfg = hf_text_config(config)
        for key in ("hidden_size", "engram_head_dim"):
            if key not in cfg:
                raise ValueError(f"DeepSeek-V4.1 Engram config lacks the key {key!r}")
        heads = ((cfg.get("engram_max_ngram_size") or 4) - 1) * (cfg.get("engram_n_heads") or 8)
        return cls(
            hidden_size=cfg["hidden_size"],
            hc_mult=cfg.get("hc_mult") or 4,
            num_heads=heads,
            head_dim=cfg["engram_head_dim"],
            rms_norm_eps=cfg.get("rms_norm_eps") or 1e-6,
            dtype=dtype,
        )


class _Weight(nn.Module):
    def __init__(self, n: int, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=dtype, device=device))


class EngramV41(nn.Module):
    """One Engram layer. `forward(h, emb, token_mask)`: h [T, hc, dim] or [T, hc*dim] (the
    hyper-connection streams), emb [T, num_heads*head_dim] (or [T, num_heads, head_dim]), both
    in the layer dtype; token_mask [T] bool (False closes the gate). Returns h' shaped like h."""

    def __init__(self, config: EngramV41Config, device: torch.device | str | None = None):
        super().__init__()
        self.config = c = config
        self.wkv = nn.Linear(
            c.embed_dim, (c.hc_mult + 1) * c.hidden_size, bias=False, dtype=c.dtype, device=device
        )
        self.q_norm = _Weight(c.hidden_size, c.dtype, device)
        self.k_norm = _Weight(c.hidden_size, c.dtype, device)

    def forward(self, h: Tensor, emb: Tensor, token_mask: Tensor | None = None) -> Tensor:
        c = self.config
        dt, hc, dim = c.dtype, c.hc_mult, c.hidden_size
        self._check(h, emb, token_mask)
        t = h.shape[0]
        x = h.reshape(t, hc, dim)  # [T, hc, dim]
        kv = rows_invariant_linear(emb.reshape(t, c.embed_dim), self.wkv.weight)
        kv = kv.view(t, hc + 1, dim)  # [T, hc+1, dim]
        key, value = kv[:, :hc].float(), kv[:, hc].float()  # [T, hc, dim], [T, dim]
        xf = x.float()
        inv_h = 1.0 / torch.sqrt(tree_sum(xf * xf) / dim + c.rms_norm_eps)  # [T, hc]
        inv_k = 1.0 / torch.sqrt(tree_sum(key * key) / dim + c.rms_norm_eps)  # [T, hc]
        prod = (xf * self.q_norm.weight.float()) * (key * self.k_norm.weight.float())
        dot = tree_sum(prod) * inv_h * inv_k / math.sqrt(dim)  # [T, hc]
        gate = signed_sqrt_gate(dot).float()  # [T, hc]
        gv = (gate[:, :, None] * value[:, None, :]).to(dt)  # [T, hc, dim]
        out = (xf + gv.float()).to(dt)
        if token_mask is not None:
            out = torch.where(token_mask[:, None, None], out, x)
        return out.reshape(h.shape)

    def _check(self, h: Tensor, emb: Tensor, token_mask: Tensor | None) -> None:
        c, name = self.config, type(self).__name__
        if h.dim() not in (2, 3) or h.shape[1:] not in (
            (c.hc_mult, c.hidden_size),
            (c.hc_mult * c.hidden_size,),
        ):
            raise ValueError(
                f"{name}: h is {list(h.shape)}; expected [T, hc_mult={c.hc_mult}, "
                f"hidden_size={c.hidden_size}] or [T, {c.hc_mult * c.hidden_size}] "
                "(wrong stream count or hidden size?)"
            )
        t = h.shape[0]
        shapes = ((c.embed_dim,), (c.num_heads, c.head_dim))
        if emb.dim() not in (2, 3) or emb.shape[0] != t or tuple(emb.shape[1:]) not in shapes:
            raise ValueError(
                f"{name}: emb is {list(emb.shape)}; expected [T={t}, num_heads*"
                f"head_dim = {c.num_heads}*{c.head_dim} = {c.embed_dim}] or "
                f"[T, {c.num_heads}, {c.head_dim}]"
            )
        for what, x in (("h", h), ("emb", emb)):
            if x.dtype != c.dtype:
                raise ValueError(f"{name}: {what} is {x.dtype}, the layer computes in {c.dtype}")
        dev = self.wkv.weight.device
        for what, x in (("h", h), ("emb", emb), ("token_mask", token_mask)):
            if x is not None and x.device != dev:
                raise ValueError(f"{name}: {what} is on {x.device}, the weights on {dev}")
        if token_mask is not None and (
            token_mask.dtype != torch.bool or list(token_mask.shape) != [t]
        ):
            raise ValueError(
                f"{name}: token_mask must be a bool tensor [{t}], got "
                f"{token_mask.dtype} {list(token_mask.shape)}"
            )

    def load_weights(
        self,
        tensors: Mapping[str, Tensor],
        prefix: str = "",
        aliases: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Copy wkv.weight, q_norm.weight, k_norm.weight from `tensors` under `prefix` (e.g.
        "model.layers.1.engram."), casting to the layer dtype. `aliases` maps our names to the
        checkpoint's where they differ. Returns the names consumed; raises naming every missing
        or mis-shaped weight."""
        if prefix and not prefix.endswith("."):
            prefix += "."
        aliases = dict(aliases or {})
        params = dict(self.named_parameters())
        names = {n: prefix + aliases.get(n, n) for n in params}
        missing = [src for src in names.values() if src not in tensors]
        if missing:
            raise ValueError(
                f"checkpoint lacks {', '.join(missing)} (looked under prefix {prefix!r})"
            )
        bad = [
            f"{names[n]} is {tensors[names[n]].dtype} {list(tensors[names[n]].shape)}, "
            f"expected a float tensor {list(p.shape)}"
            for n, p in params.items()
            if tuple(tensors[names[n]].shape) != tuple(p.shape)
            or not tensors[names[n]].is_floating_point()
            or tensors[names[n]].dtype.itemsize == 1
        ]
        if bad:
            raise ValueError("bad Engram weights: " + "; ".join(bad))
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(tensors[names[n]].to(device=p.device, dtype=p.dtype))
        return sorted(names.values())
