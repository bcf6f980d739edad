"""The reference decoder's batch and attention: one step's inputs on the device, and a padded
KV cache every step attends over in full."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from plestore.models.reference import DecoderConfig

__all__ = ["KVCache", "StepInputs"]


@dataclass
class StepInputs:
    """One step's batch on the device. Request r's new tokens are tok[qsl[r]:qsl[r + 1]]."""

    tok: Tensor  # [T] token ids
    slot: Tensor  # [R] KV-cache and state-pool slot of each request
    past: Tensor  # [R] tokens each request had cached before this step
    req: Tensor  # [T] request of each token
    col: Tensor  # [T] position of each token within its request's chunk
    qsl: Tensor  # [R+1] query_start_loc
    last: Tensor  # [R] index of each request's last token
    lq: int  # longest chunk (a shape, so fixed for a captured step)

    @staticmethod
    def host_arrays(
        slots: np.ndarray, tokens: np.ndarray, qsl: np.ndarray, past: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        """The fields' values, in field order, from a step's host arrays."""
        req = np.repeat(np.arange(len(slots)), np.diff(qsl))
        return (tokens, slots, past, req, np.arange(qsl[-1]) - qsl[req], qsl, qsl[1:] - 1)

    @classmethod
    def from_host(
        cls, slots: np.ndarray, tokens: np.ndarray, qsl: np.ndarray, past: np.ndarray, device
    ) -> StepInputs:
        """Built on the host and sent in one copy: no device sync inside a step."""
        parts = cls.host_arrays(slots, tokens, qsl, past)
        flat = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
        views = flat.to(device, non_blocking=True).split([len(a) for a in parts])
        return cls(*views, lq=int(np.diff(qsl).max(initial=1)))


class KVCache:
    """Padded K/V [layers, slots, max_len, heads, head_dim]. Every step attends over all max_len
    positions (masked), so its kernels and shapes do not depend on how far its requests are:
    the same in an eager step and a captured one (whose shapes are fixed)."""

    def __init__(self, cfg: DecoderConfig, device: torch.device) -> None:
        hd = cfg.hidden_size // cfg.num_heads
        shape = (cfg.num_layers, cfg.max_requests, cfg.max_seq_len, cfg.num_heads, hd)
        self.k = torch.zeros(shape, dtype=cfg.dtype, device=device)
        self.v = torch.zeros(shape, dtype=cfg.dtype, device=device)
        self.lengths = np.zeros(cfg.max_requests, np.int64)  # cached tokens per slot (host)
        self.max_len = cfg.max_seq_len
        self._keys = torch.arange(cfg.max_seq_len, device=device)
        self._cuda = device.type == "cuda"

    def reserve(self, slots: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Room for `counts` more tokens per slot; returns the lengths before them (host)."""
        past = self.lengths[slots].copy()
        if (past + counts).max(initial=0) > self.max_len:
            raise ValueError(f"a request would exceed max_seq_len {self.max_len}")
        self.lengths[slots] += counts
        return past

    def where(self, inp: StepInputs) -> tuple[Tensor, Tensor, Tensor]:
        """(slot [T], position [T]) each new token is cached at, and the attention mask
        [R, 1, Lq, max_len]: a query sees its request's keys up to its own position. Padding
        query rows still see key 0, so no row is all masked (NaN)."""
        pos = inp.past[inp.req] + inp.col
        qpos = inp.past[:, None] + self._keys[: inp.lq]  # [R, Lq]
        mask = (self._keys <= qpos[..., None]) | (self._keys == 0)  # [R, Lq, max_len]
        return inp.slot[inp.req], pos, mask[:, None]

    def attend(self, layer: int, q, k, v, inp: StepInputs, where: tuple) -> Tensor:
        slot, pos, mask = where
        self.k[layer, slot, pos] = k
        self.v[layer, slot, pos] = v
        qp = q.new_zeros(inp.slot.numel(), inp.lq, *q.shape[1:])  # [R, Lq, heads, hd]
        qp[inp.req, inp.col] = q
        kk = self.k[layer, inp.slot].transpose(1, 2)  # [R, heads, max_len, hd]
        vv = self.v[layer, inp.slot].transpose(1, 2)
        with self._deterministic():
            out = F.scaled_dot_product_attention(qp.transpose(1, 2), kk, vv, attn_mask=mask)
        return out.transpose(1, 2)[inp.req, inp.col]  # [T, heads, hd]

    def _deterministic(self):
        """On CUDA, attention kernels that give the same result every run: torch's default
        (cuDNN attention) did not, which turns every tier comparison into noise;
        the memory-efficient and math kernels repeat exactly (measured: RESULTS.md "e2e warm",
        benchmarks/probes/first_divergence.py)."""
        if not self._cuda:
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
