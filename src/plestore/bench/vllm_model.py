"""The decode steps `plestore bench vllm` times, sized like the real models: vLLM's Qwen4Exp step
around its one PLE layer (bench/vllm_step.py says what each segment is), and the tier a step's
lookups run on.

A step is a list of segments `(kind, fn)`: kind "gpu" (model work, captured), "start" (a
lookup starts), "finish" (its rows are consumed); the bench runs them as one graph or with the
starts and finishes between graphs (`StepTier.placement`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import plestore
from plestore.bench.methods import tier_options
from plestore.bench.vllm_baselines import open_baseline
from plestore.integrations.layerlookup import PleLayerLookup

__all__ = [
    "DecodeLayer",
    "DecodeStep",
    "Segment",
    "StepTier",
    "model_dtype",
    "open_step_tier",
    "weight",
]

Segment = tuple[str, Callable[[], None]]  # (kind: gpu | start | finish, the segment's work)


@dataclass
class StepTier:
    """One tier as a step sees it: its lookups (one a PLE layer) and where they run — "graph"
    (inside the step's one graph), "breaks" (start and finish between graphs) or "before"
    (the starts on the host between the hash's graph and the model's)."""

    name: str
    lookups: tuple  # PleLayerLookup or a bench/vllm_baselines lookup, one per layer

    @property
    def placement(self) -> str:
        first = self.lookups[0]
        return getattr(first, "placement", None) or ("graph" if first.captures else "breaks")

    @property
    def cuda(self) -> bool:
        return self.lookups[0].table.device.type == "cuda"

    def close(self) -> None:
        for lookup in self.lookups:
            lookup.close()


def open_step_tier(
    spec: str, paths: list[str], baselines: dict, device, max_tokens: int, timeout_s: float
) -> StepTier:
    """A tier spec -> its lookups, one a table in `paths`: a vLLM baseline's (a name in
    `baselines`), or plestore tables' PleLayerLookups ('+eager': between graphs; '+beside': on
    a side stream; timeout_s: a captured step's wait for its rows, unless the spec sets it)."""
    if spec in baselines:
        return StepTier(spec, tuple(open_baseline(spec, p, device, max_tokens) for p in paths))
    base, eager, _ = spec.partition("+eager")
    base, beside, _ = base.partition("+beside")
    tier, kw = tier_options(base)
    kw.setdefault("timeout_s", timeout_s)
    lookups: list = []
    try:
        for path in paths:
            table = plestore.open_table(path, tier=tier, device=str(device), **kw)
            lookups.append(
                PleLayerLookup(
                    table, table.spec.heads, max_tokens, capture=not eager, beside=bool(beside)
                )
            )
    except Exception:
        for lookup in lookups:
            lookup.close()
        raise
    return StepTier(spec, tuple(lookups))


class DecodeLayer:
    """One decoder layer's matmuls at decode (attention's projections, a gated MLP): bf16 on a
    GPU, float32 on a CPU (no fast bf16 there)."""

    def __init__(self, a, dev: torch.device, g: torch.Generator) -> None:
        h = a.hidden
        self.qkv, self.o = weight(h, a.q_dim + 2 * a.kv_dim, dev, g), weight(a.q_dim, h, dev, g)
        self.gate_up, self.down = weight(h, 2 * a.ffn, dev, g), weight(a.ffn, h, dev, g)
        self.q_dim, self.ffn = a.q_dim, a.ffn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x + (x @ self.qkv)[:, : self.q_dim] @ self.o
        gu = x @ self.gate_up
        return x + (torch.nn.functional.silu(gu[:, : self.ffn]) * gu[:, self.ffn :]) @ self.down


class DecodeStep:
    """One decode step of vLLM's Qwen4Exp around its PLE lookup (bench/vllm_step.py)."""

    def __init__(self, tier: StepTier, a, batch: int, sets: int, seed: int) -> None:
        (self.lookup,) = tier.lookups
        t = self.lookup.table
        dev = t.device
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.batch, self.sets, self.rows_total = batch, sets, t.spec.rows
        self.base = torch.randint(0, t.spec.rows, (batch, self.lookup.heads), generator=g).to(dev)
        self.step = torch.zeros((), dtype=torch.int64, device=dev)
        self.ids = torch.zeros_like(self.base)  # the model's fixed id buffer
        self.rows = torch.zeros(batch, self.lookup.width, dtype=t.dtype, device=dev)
        self.x = torch.randn(batch, a.hidden, generator=g).to(dev, model_dtype(dev))
        self.layer = DecodeLayer(a, dev, g)  # (one layer's weights serve all: each > the L2)
        self.layers = a.layers
        # the PLE layer's merged kv projection [width, C*H + H] (hc_count 4)
        self.kv = weight(self.lookup.width, 5 * a.hidden, dev, g, 0.01)
        self.segments: list[Segment] = [
            ("gpu", self.hash),
            ("start", self.start),
            ("gpu", self.layer0),
            ("finish", self.finish),
            ("gpu", self.rest),
        ]
        self.window: list[Callable[[], None]] = [self.layer0]  # what a started read hides behind

    def hash(self) -> None:  # segment 1: this step's ids, computed on the device
        torch.remainder(self.step + 1, self.sets, out=self.step)  # one of `sets` id sets
        torch.remainder(self.base + self.step * 7919, self.rows_total, out=self.ids)

    def layer0(self) -> None:  # segment 2
        self.h = self.layer(self.x)

    def rest(self) -> None:  # segment 3: the PLE layer's projection, then the layers after it
        kv = self.rows.to(self.kv.dtype) @ self.kv
        h = self.h + kv[:, : self.h.shape[1]]
        for _ in range(self.layers):
            h = self.layer(h)
        self.out = h

    def start(self) -> None:
        self.lookup.start(self.ids)

    def finish(self) -> None:
        self.rows.copy_(self.lookup.finish(self.batch))

    def exact(self, refs: tuple) -> bool:
        """This step's rows bit-equal to the resident table's (refs: one table a layer)."""
        return torch.equal(self.rows.view(torch.int16), refs[0].lookup(self.ids).view(torch.int16))


def weight(i: int, o: int, dev: torch.device, g: torch.Generator, scale: float | None = None):
    """A random [i, o] matrix in the model's dtype (scaled to keep activations in range)."""
    return (torch.randn(i, o, generator=g) * (scale or i**-0.5)).to(dev, model_dtype(dev))


def model_dtype(dev: torch.device) -> torch.dtype:
    return torch.bfloat16 if dev.type == "cuda" else torch.float32
