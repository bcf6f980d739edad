"""Decode steps as engines run them: over static buffers, replayed as two CUDA graphs.

A decode step's shapes are fixed by its batch size, so engines capture it once and replay it:
the host then launches a step in microseconds instead of launching every kernel (the eager
reference step spent ~12 ms of Python per step on the H200 for about 1 ms of GPU work, so any
host work, a lookup included, landed on the critical path). The step is captured in two halves
around the PLE lookup, because its rows depend on this step's tokens, which the host learns only
from the previous step:

    front(s)  embedding + layers before the PLE layer, from the tokens the last back(s-1) left
              on the device
    host      waits for back(s-1)'s tokens (copied after it) -> hash -> lookup -> rows into emb
    back(s)   the PLE layer on emb, the remaining layers, the head, the greedy pick: writes the
              next tokens and advances the positions on the device

so the host's hashing and gathering overlap front(s) on the GPU. On CPU, or with
`DecoderConfig.cuda_graphs` off, the same loop calls the two halves eagerly on the same buffers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from plestore.models.attention import StepInputs

if TYPE_CHECKING:
    from plestore.models.reference import GenerationResult, ReferenceDecoder

__all__ = ["DecodeRunner", "Exposure"]


class Exposure:
    """Per phase, how long the step waited for its rows: on CUDA the GPU time between the end of
    the layers before the PLE layer and the rows being ready (events on the step's stream: host
    work hidden behind those layers does not count, a late host or the rows' own kernel does);
    on CPU the lookup's wall time (everything there is on the critical path)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[str, object, object]] = []  # (phase, start, stop)
        self._open: object = None

    def start(self) -> None:
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self, phase: str) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self._spans.append((phase, self._open, end))

    def totals(self) -> dict[str, float]:
        """Seconds per phase (waits for the recorded events)."""
        out: dict[str, float] = {}
        for phase, a, b in self._spans:
            s = a.elapsed_time(b) / 1e3 if self.cuda else b - a  # type: ignore[union-attr]
            out[phase] = out.get(phase, 0.0) + s
        return out


class DecodeRunner:
    """Decode steps of `batch` requests over static buffers (see the module docstring)."""

    def __init__(self, model: ReferenceDecoder, batch: int) -> None:
        dev, r = model.device, batch
        self.model, self.batch = model, r
        z = torch.zeros(r, dtype=torch.int64, device=dev)
        ar = torch.arange(r + 1, device=dev)
        self.inp = StepInputs(
            tok=z, slot=z.clone(), past=z.clone(), req=ar[:r], col=z.clone(), qsl=ar,
            last=ar[:r].clone(), lq=1,
        )  # fmt: skip
        spec = model.table.spec
        self.emb = torch.zeros(r, spec.heads * spec.dim, dtype=torch.bfloat16, device=dev)
        self.cuda = dev.type == "cuda"
        self._host_tokens = torch.zeros(r, dtype=torch.int64, pin_memory=self.cuda)
        self._sampled = torch.cuda.Event() if self.cuda else None
        self._graphs: tuple | None = None
        self.logits: torch.Tensor | None = None  # [R, vocab] fp32 of the last back()

    def bind(self, slots: np.ndarray) -> bool:
        """Point the buffers at these (freshly allocated) slots. The first time on CUDA this
        captures the graphs, whose warm-up runs write the slots' state: returns True then, and
        the caller resets that state (before prefill, which overwrites the KV cache anyway)."""
        self.inp.slot.copy_(torch.from_numpy(slots))
        if self._graphs is not None or not (self.cuda and self.model.cfg.cuda_graphs):
            return False
        self._capture()
        return True

    @torch.inference_mode()
    def run(
        self, res: GenerationResult, slots: np.ndarray, steps: int, keep: bool, exposure
    ) -> None:
        """`steps` greedy decode steps after each request's last token in res.tokens."""
        m, r = self.model, self.batch
        slots_t = torch.from_numpy(slots)
        past = m.kv.reserve(slots, np.full(r, steps))  # room for every step, checked now
        tokens = np.array([t[-1] for t in res.tokens], np.int64)  # [R] host
        self.inp.past.copy_(torch.from_numpy(past))
        self.inp.tok.copy_(torch.from_numpy(tokens))
        t_prev = time.perf_counter()
        for s in range(steps):
            self._front()
            if s:
                tokens, t_prev = self._collect(res, t_prev)
            ctx = m.pool.context[slots_t].numpy()  # [R, n-1]
            row_ids, next_ctx = m.hash.decode_row_ids(tokens, ctx)  # overlaps front on the GPU
            exposure.start()
            m.table.prefetch(row_ids, label="decode", out=self.emb).result()
            exposure.stop("decode")
            self._back()
            m.pool.context[slots_t] = torch.from_numpy(next_ctx)
            if keep:
                res.logits.append(self.logits.cpu())
            self._host_tokens.copy_(self.inp.tok, non_blocking=True)
            if self._sampled is not None:
                self._sampled.record()
        if steps:
            self._collect(res, t_prev)

    # -- internals -----------------------------------------------------------------------------
    def _collect(self, res: GenerationResult, t_prev: float) -> tuple[np.ndarray, float]:
        """Wait for the last step's tokens; account the step and append them."""
        if self._sampled is not None:
            self._sampled.synchronize()
        tokens = self._host_tokens.numpy().copy()
        now = time.perf_counter()
        res.step_times.append(("decode", self.batch, now - t_prev))
        res.decode_s += now - t_prev
        res.decode_tokens += self.batch
        for i, tok in enumerate(tokens.tolist()):
            res.tokens[i].append(tok)
        return tokens, now

    def _front(self) -> None:
        if self._graphs is not None:
            self._graphs[0].replay()
        else:
            self._bank, self._where = self.model.front(self.inp)

    def _back(self) -> None:
        if self._graphs is not None:
            self._graphs[1].replay()
            return
        self.logits = self.model.back(self.inp, self._where, self._bank, self.emb)
        self.inp.tok.copy_(self.logits.argmax(-1))  # the next step's input, on the device
        self.inp.past.add_(1)

    def _capture(self) -> None:
        """Warm up on a side stream (lazy cuBLAS/allocator set-up must not happen in a capture),
        then capture front and back into the model's graph pool. Tensors passed from front to
        back stay referenced, so back's capture never reuses their memory."""
        dev = self.model.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                self._front()
                self._back()
        torch.cuda.current_stream(dev).wait_stream(side)
        m = self.model
        if m._graph_pool is None:
            m._graph_pool = torch.cuda.graph_pool_handle()
        front, back = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.inference_mode():
            with torch.cuda.graph(front, pool=m._graph_pool):
                self._front()
            with torch.cuda.graph(back, pool=m._graph_pool):
                self._back()
        self._graphs = (front, back)
