"""`plestore bench vllm ENGRAM_DIR`: DeepSeek-V4.1's two Engram layers as the vLLM plugin runs them
(integrations/vllm/engram.py), per tier, beside the device tier's, vLLM's own pinned-UVA Engram
lookup and a stage-before-the-step disk method — on a step sized like DeepSeek-V4.1-Flash.

The step (both layers' rows started as soon as the step's ids exist, as the plugin's
`prepare_embeddings` does, and each finished where its layer consumes it):

    hash        both layers' ids [T, 24] (every column in its own rows), on the device
    start x 2   layer 1's and layer 14's lookups start
    layer 0     the decoder layer before Engram layer 1
    finish 1    layer 1's rows; its Engram math (wkv [24 * 256, 5 * hidden], gate, value)
    layers 1-13 --mid-layers decoder layers (what layer 14's reads hide behind)
    finish 14   layer 14's rows; its Engram math
    rest        --layers decoder layers

ENGRAM_DIR holds `engram.layers.1.json` and `engram.layers.14.json` (`plestore pack` of a
DeepSeek-V4.1 checkpoint; `plestore synth --preset deepseek-v4.1-flash --ngram-vocab-size-base
N` scales it: each layer's rows are the sum of its 24 primes near N)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from plestore.bench.vllm_model import DecodeLayer, Segment, StepTier, model_dtype, weight

__all__ = ["ENGRAM_DEFAULTS", "ENGRAM_TIERS", "EngramStep", "engram_tables"]

LAYER_IDS = (1, 14)  # DeepSeek-V4.1's Engram layers (shared/spec/engram.md)
#: DeepSeek-V4.1-Flash-sized decoder layers (hidden 4096; attention's projections and an MLP as
#: wide as its active experts) and hyper-connection streams
ENGRAM_DEFAULTS = {"hidden": 4096, "q_dim": 4096, "kv_dim": 512, "ffn": 14336, "layers": 4}
HC_MULT = 4
ENGRAM_TIERS = (
    "device,pinned,vllm-engram-pinned-uva,mapped,direct,"
    "cascade:device_budget_bytes=1000000000,pinned_budget_bytes=1000000000,"
    "direct:gpu_cache_bytes=268435456,disk-prestage,direct+eager"
)


def engram_tables(path: str) -> dict[int, str] | None:
    """Engram layer id -> its packed table's .json in the directory `path`; None where `path`
    is not a directory holding both Engram layers' tables."""
    root = Path(path)
    found = {lid: root / f"engram.layers.{lid}.json" for lid in LAYER_IDS}
    if not root.is_dir() or not all(p.is_file() for p in found.values()):
        return None
    return {lid: str(p) for lid, p in found.items()}


class EngramStep:
    """One decode step of DeepSeek-V4.1's layers around its two Engram layers (module doc)."""

    def __init__(self, tier: StepTier, a, batch: int, sets: int, seed: int) -> None:
        self.lookups = tier.lookups
        first = self.lookups[0].table
        dev = first.device
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.batch, self.sets = batch, sets
        self.step = torch.zeros((), dtype=torch.int64, device=dev)
        self.lo, self.size, self.base, self.ids, self.rows = [], [], [], [], []
        for lookup in self.lookups:
            hs = lookup.table.spec.hash
            lo = torch.tensor(hs.head_offsets, dtype=torch.int64)  # [24] a column's first row
            size = torch.tensor(hs.head_sizes, dtype=torch.int64)  # [24] its rows (a prime)
            base = (torch.rand(batch, len(size), generator=g) * size).long()  # [T, 24]
            self.lo.append(lo.to(dev))
            self.size.append(size.to(dev))
            self.base.append(base.to(dev))
            self.ids.append(torch.zeros(batch, len(size), dtype=torch.int64, device=dev))
            self.rows.append(torch.zeros(batch, lookup.width, dtype=first.dtype, device=dev))
        self.x = torch.randn(batch, a.hidden, generator=g).to(dev, model_dtype(dev))
        self.layer = DecodeLayer(a, dev, g)  # (one layer's weights serve all: each > the L2)
        self.mid, self.layers = a.mid_layers, a.layers
        # an Engram layer's wkv [24 * 256, (hc_mult + 1) * hidden]: a key a stream + one value
        self.wkv = [weight(lk.width, (HC_MULT + 1) * a.hidden, dev, g) for lk in self.lookups]
        self.segments: list[Segment] = [
            ("gpu", self.hash),
            *(("start", self._start(i)) for i in range(len(self.lookups))),
            ("gpu", self.layer0),
            ("finish", self._finish(0)),
            ("gpu", self.middle),
            ("finish", self._finish(1)),
            ("gpu", self.rest),
        ]
        # what layer 14's reads, started at the hash, hide behind (layer 1's: layer 0 alone)
        self.window: list[Callable[[], None]] = [self.layer0, self.middle]

    def hash(self) -> None:  # both layers' ids: each column's own rows, one of `sets` id sets
        torch.remainder(self.step + 1, self.sets, out=self.step)
        for lo, size, base, ids in zip(self.lo, self.size, self.base, self.ids, strict=True):
            torch.remainder(base + self.step * 7919, size, out=ids)
            ids.add_(lo)

    def layer0(self) -> None:
        self.h = self.layer(self.x)

    def middle(self) -> None:  # layer 1's Engram math, then the layers up to 14
        h = self._engram(self.h, 0)
        for _ in range(self.mid):
            h = self.layer(h)
        self.h = h

    def rest(self) -> None:
        h = self._engram(self.h, 1)
        for _ in range(self.layers):
            h = self.layer(h)
        self.out = h

    def _engram(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """h + gate * value, the gate from the first stream's key (a stand-in of the fused
        post-wkv kernel's work: the wkv matmul dominates)."""
        kv = self.rows[i].to(h.dtype) @ self.wkv[i]  # [T, (hc_mult + 1) * hidden]
        hidden = h.shape[1]
        gate = torch.sigmoid((h * kv[:, :hidden]).sum(-1, keepdim=True) * hidden**-0.5)
        return h + gate * kv[:, HC_MULT * hidden :]

    def _start(self, i: int) -> Callable[[], None]:
        return lambda: self.lookups[i].start(self.ids[i])

    def _finish(self, i: int) -> Callable[[], None]:
        return lambda: self.rows[i].copy_(self.lookups[i].finish(self.batch))

    def exact(self, refs: tuple) -> bool:
        """Both layers' rows bit-equal to the resident tables' (refs: one table a layer)."""
        return all(
            torch.equal(rows.view(torch.int16), ref.lookup(ids).view(torch.int16))
            for rows, ids, ref in zip(self.rows, self.ids, refs, strict=True)
        )
