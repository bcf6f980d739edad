"""The decode step `plestore bench vllm` times: vLLM's Qwen4Exp step around its one PLE layer,
sized like the real model (bench/vllm_step.py says what each segment is)."""

from __future__ import annotations

import torch

__all__ = ["DecodeLayer", "DecodeStep", "model_dtype"]


class DecodeLayer:
    """One decoder layer's matmuls at decode (attention's projections, a gated MLP): bf16 on a
    GPU, float32 on a CPU (no fast bf16 there)."""

    def __init__(self, a, dev: torch.device, g: torch.Generator) -> None:
        def w(i, o):
            return (torch.randn(i, o, generator=g) * i**-0.5).to(dev, model_dtype(dev))

        h = a.hidden
        self.qkv, self.o = w(h, a.q_dim + 2 * a.kv_dim), w(a.q_dim, h)
        self.gate_up, self.down, self.q_dim, self.ffn = w(h, 2 * a.ffn), w(a.ffn, h), a.q_dim, a.ffn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x + (x @ self.qkv)[:, : self.q_dim] @ self.o
        gu = x @ self.gate_up
        return x + (torch.nn.functional.silu(gu[:, : self.ffn]) * gu[:, self.ffn :]) @ self.down


class DecodeStep:
    """One decode step's GPU work around the PLE lookup (see the module doc)."""

    def __init__(self, lookup, a, batch: int, sets: int, seed: int) -> None:
        t = lookup.table
        dev = t.device
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.lookup, self.batch, self.sets, self.rows_total = lookup, batch, sets, t.spec.rows
        self.base = torch.randint(0, t.spec.rows, (batch, lookup.heads), generator=g).to(dev)
        self.step = torch.zeros((), dtype=torch.int64, device=dev)
        self.ids = torch.zeros_like(self.base)  # the model's fixed id buffer
        self.rows = torch.zeros(batch, lookup.width, dtype=t.dtype, device=dev)
        self.x = torch.randn(batch, a.hidden, generator=g).to(dev, model_dtype(dev))
        self.layer = DecodeLayer(a, dev, g)  # (one layer's weights serve all: each > the L2)
        self.layers = a.layers
        self.kv = (torch.randn(lookup.width, 5 * a.hidden, generator=g) * 0.01).to(
            dev, model_dtype(dev)
        )  # the PLE layer's merged kv projection [width, C*H + H] (hc_count 4)

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


def model_dtype(dev: torch.device) -> torch.dtype:
    return torch.bfloat16 if dev.type == "cuda" else torch.float32
