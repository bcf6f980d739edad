"""The DeepSeek-V4.1 Engram layer (spec engram.md, "Layer math differs"): one projection of the
looked-up rows gives a key per hyper-connection stream and one shared value; each stream is
gated by how well its hidden state matches its key, and the gated value is added to it. There
is no short conv, so the layer carries no per-request state (the n-gram context lives in the
hashing step).

The spec gives the formula, not the rounding points or the weights' shapes; we follow vLLM's
DeepSeek-V4.1 port (`Engram.forward`, its `_fused_engram_post_wkv_kernel`), which
`tests/vllm/test_engram_vllm.py` compares bit for bit:

* `kv = wkv(emb)` [T, (hc+1)*dim] in the activation dtype, rows `[key_0 | ... | key_{hc-1} |
  value]` (streams in order, the shared value last); everything after it is float32;
* `dot_c = sum_j h_c[j] * q_w[c,j] * k_w[c,j] * key_c[j] * (rms(h_c)^-1 * rms(key_c)^-1 *
  dim^-1/2)` with `rms(x) = sqrt(mean(x^2) + eps)`; `q_weight` and `k_weight` are [hc, dim], one
  row per stream (the checkpoint's `engram.q_weight`, `engram.k_weight`);
* `gate_c = sigmoid(s * sqrt(max(|dot_c|, 1e-6)))`, s = -1 where dot_c < 0, else +1 (so
  dot = 0 gives sigmoid(1e-3), not 0.5); the sigmoid in float64, rounded once to fp32;
* `h'_c = round(h_c + gate_c * value)`, computed in fp32 and rounded once to the layer dtype
  (`forward_fp32` returns it unrounded); where `token_mask` is False, h' = h bit for bit.

Sums run in `tree_sum`'s fixed order, vLLM's kernel in its own: the fp32 intermediates can
differ in their last bits, which moves an output only next to a rounding boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from plestore.layers._common import check_activation_dtype, check_positive_ints, hf_text_config
from plestore.layers.ops import rows_invariant_linear, sigmoid64, tree_sum

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
        shape = (c.hc_mult, c.hidden_size)  # one row per stream
        self.q_weight = nn.Parameter(torch.ones(shape, dtype=c.dtype, device=device))
        self.k_weight = nn.Parameter(torch.ones(shape, dtype=c.dtype, device=device))
        # dim^-1/2 as the kernel's rsqrt(dim) gives it: fp32 sqrt, then an fp32 reciprocal
        self.inv_sqrt_dim = float(1.0 / torch.sqrt(torch.tensor(float(c.hidden_size))))

    def forward(self, h: Tensor, emb: Tensor, token_mask: Tensor | None = None) -> Tensor:
        return self.forward_fp32(h, emb, token_mask).to(self.config.dtype).reshape(h.shape)

    def forward_fp32(self, h: Tensor, emb: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """h' [T, hc, dim] in float32, before `forward`'s one rounding to the layer dtype."""
        c = self.config
        hc, dim = c.hc_mult, c.hidden_size
        self._check(h, emb, token_mask)
        t = h.shape[0]
        x = h.reshape(t, hc, dim).float()  # [T, hc, dim]
        kv = rows_invariant_linear(emb.reshape(t, c.embed_dim), self.wkv.weight)
        kv = kv.view(t, hc + 1, dim)  # [T, hc+1, dim]
        key, value = kv[:, :hc].float(), kv[:, hc].float()  # [T, hc, dim], [T, dim]
        inv_h = 1.0 / torch.sqrt(tree_sum(x * x) / dim + c.rms_norm_eps)  # [T, hc]
        inv_k = 1.0 / torch.sqrt(tree_sum(key * key) / dim + c.rms_norm_eps)  # [T, hc]
        dot = tree_sum(x * self.q_weight.float() * self.k_weight.float() * key)  # [T, hc]
        dot = dot * (inv_h * inv_k * self.inv_sqrt_dim)
        r = torch.sqrt(dot.abs().clamp_min(1e-6))
        gate = sigmoid64(torch.where(dot < 0, -r, r)).float()  # [T, hc]
        out = x + gate[:, :, None] * value[:, None, :]  # [T, hc, dim]
        if token_mask is not None:
            out = torch.where(token_mask[:, None, None], out, x)
        return out

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
        """Copy wkv.weight, q_weight, k_weight from `tensors` under `prefix` (e.g.
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
