"""Steps over static buffers, replayed as CUDA graphs — as engines run them.

A step's shapes are fixed by its batch (R requests, T tokens, chunks of at most lq), so engines
capture it once and replay it: the host then launches a step in microseconds instead of
launching every kernel (the eager reference step spent ~7-12 ms of Python per step on the H200
for 1-3 ms of GPU work, so any host work, a lookup included, landed on the critical path). A
step is captured in two halves around the PLE lookup, whose rows arrive from the host:

    front   embedding + the layers before the PLE layer (what the lookup overlaps)
    back    the PLE layer on `emb`, the remaining layers, the head

Decode (`StepRunner.decode`) feeds each step's greedy tokens back on the device: back(s) writes
them into the token buffer and advances the positions, so front(s+1) is launched before the host
has seen them; the host then waits for back(s)'s tokens (copied after it), hashes them and
gathers the rows while front(s+1) runs on the GPU:

    front(s+1) | host: tokens of s -> hash -> lookup -> rows into emb | back(s+1)

With `DecoderConfig.staged_lookup` the host only stages the rows (`Table.staged`) and their
kernel runs inside the captured back — no launch from Python between the graphs.

Prefill steps of a shape that repeats (uniform chunks) replay graphs too; their inputs come from
the host in one copy. On CPU, or with `DecoderConfig.cuda_graphs` off, the same buffers and
loop run the two halves eagerly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from plestore.models.attention import StepInputs

if TYPE_CHECKING:
    from plestore.models.reference import GenerationResult, ReferenceDecoder

__all__ = ["Exposure", "StepRunner"]


class Exposure:
    """Per phase, how long the step waited for its rows: on CUDA the GPU time between the end of
    the layers before the PLE layer and the rows being ready (events on the step's stream: host
    work hidden behind those layers does not count; a late host — waiting for tokens, hashing,
    reading — or the rows' own kernel does, except a staged lookup's, which runs inside back);
    on CPU the lookup's wall time (everything there is on the critical path).

    Also per phase, what decides it: the window (the GPU time of those layers, marked by
    `window()` before front is launched; CUDA only) and the host's chain (`stop`'s host_s: from
    the rows' ids being computable — a decode step's tokens in hand — to back's launch), so a
    reader sees how much of the window the host used."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[str, object, object, object]] = []  # (phase, window, start, stop)
        self._host: dict[str, float] = {}
        self._window: object = None
        self._open: object = None

    def window(self) -> None:
        """Mark where front begins on the GPU (before its launch)."""
        if self.cuda:
            self._window = self._mark()

    def start(self) -> None:
        self._open = self._mark()

    def stop(self, phase: str, host_s: float = 0.0) -> None:
        self._spans.append((phase, self._window, self._open, self._mark()))
        self._window = None
        self._host[phase] = self._host.get(phase, 0.0) + host_s

    def _mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def totals(self) -> dict[str, dict[str, float]]:
        """Seconds per phase: {"exposed", "window", "host"} (waits for the recorded events)."""
        out: dict[str, dict[str, float]] = {}
        for phase, w, a, b in self._spans:
            tot = out.setdefault(phase, {"exposed": 0.0, "window": 0.0, "host": self._host[phase]})
            if self.cuda:  # (events)
                tot["exposed"] += a.elapsed_time(b) / 1e3  # type: ignore[union-attr]
                if w is not None:
                    tot["window"] += w.elapsed_time(a) / 1e3  # type: ignore[union-attr]
            else:
                tot["exposed"] += b - a  # type: ignore[operator]
        return out


class StepRunner:
    """Steps of one shape over static buffers (see the module docstring). `feedback`: a decode
    runner, whose back writes the sampled tokens into `inp.tok` and advances `inp.past`."""

    def __init__(
        self, model: ReferenceDecoder, r: int, t: int, lq: int, feedback: bool = False
    ) -> None:
        dev = model.device
        self.model, self.shape, self.feedback = model, (r, t, lq), feedback
        self.cuda = dev.type == "cuda"
        sizes = [t, r, r, t, t, r + 1, r]  # tok, slot, past, req, col, qsl, last
        self._flat = torch.zeros(sum(sizes), dtype=torch.int64, device=dev)
        self._host = torch.zeros(sum(sizes), dtype=torch.int64, pin_memory=self.cuda)
        self._loaded = torch.cuda.Event() if self.cuda else None  # the last load's copy is done
        self.inp = StepInputs(*self._flat.split(sizes), lq=lq)
        spec = model.table.spec
        self.emb = torch.zeros(t, spec.heads * spec.dim, dtype=torch.bfloat16, device=dev)
        self._tokens_host = torch.zeros(r, dtype=torch.int64, pin_memory=self.cuda)
        self._sampled = torch.cuda.Event() if self.cuda else None
        self._graphs: tuple | None = None
        self.logits: torch.Tensor | None = None  # [R, vocab] fp32 of the last back()
        # decode with DecoderConfig.staged_lookup: back decodes the rows the host staged
        self.staged = None
        if feedback and model.cfg.staged_lookup:
            self.staged = model.table.staged((r, spec.heads), out=self.emb)

    def load(self, slots: np.ndarray, tokens: np.ndarray, qsl: np.ndarray, past: np.ndarray):
        """A step's batch into the buffers, in one copy from pinned memory."""
        parts = StepInputs.host_arrays(slots, tokens, qsl, past)
        r, t, lq = self.shape
        if len(slots) != r or len(tokens) != t or np.diff(qsl).max() > lq:
            raise ValueError(f"this batch does not have the runner's shape {self.shape}")
        if self._loaded is not None:
            self._loaded.synchronize()  # (long done: every step ends in a sync)
        np.concatenate(parts, out=self._host.numpy(), casting="unsafe")
        self._flat.copy_(self._host, non_blocking=True)
        if self._loaded is not None:
            self._loaded.record()

    def front(self) -> None:
        if self._graphs is not None:
            self._graphs[0].replay()
        else:
            self._bank, self._where = self.model.front(self.inp)

    def back(self) -> torch.Tensor:
        """Logits [R, vocab] fp32, valid until the next step is launched."""
        if self._graphs is not None:
            self._graphs[1].replay()
            return self.logits
        if self.staged is not None:
            self.staged.decode()  # into self.emb
        self.logits = self.model.back(self.inp, self._where, self._bank, self.emb)
        if self.feedback:
            self.inp.tok.copy_(self.logits.argmax(-1))  # the next step's input, on the device
            self.inp.past.add_(1)
        return self.logits

    def capture(self) -> None:
        """Warm up on a side stream (lazy cuBLAS/allocator set-up must not happen in a capture),
        then capture front and back into the model's graph pool. Needs a loaded batch; the
        warm-up runs write its slots' KV cache and conv state, which the caller resets. Tensors
        passed from front to back stay referenced, so back's capture never reuses them. Every
        runner's graphs share that pool: safe because one step's outputs (logits, tokens) are
        consumed before any other graph is replayed."""
        dev, m = self.model.device, self.model
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                self.front()
                self.back()
        torch.cuda.current_stream(dev).wait_stream(side)
        if m._graph_pool is None:
            m._graph_pool = torch.cuda.graph_pool_handle()
        front, back = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.inference_mode():
            with torch.cuda.graph(front, pool=m._graph_pool):
                self.front()
            with torch.cuda.graph(back, pool=m._graph_pool):
                self.back()
        self._graphs = (front, back)

    @property
    def captured(self) -> bool:
        return self._graphs is not None

    # -- the decode loop -------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(
        self, res: GenerationResult, slots: np.ndarray, steps: int, keep: bool, exposure: Exposure
    ) -> None:
        """`steps` greedy decode steps after each request's last token in res.tokens."""
        m, r = self.model, self.shape[0]
        slots_t = torch.from_numpy(slots)
        past = m.kv.reserve(slots, np.full(r, steps))  # room for every step, checked now
        tokens = np.array([t[-1] for t in res.tokens], np.int64)  # [R] host
        self.load(slots, tokens, np.arange(r + 1), past)
        t_prev = time.perf_counter()
        for s in range(steps):
            exposure.window()
            self.front()
            exposure.start()  # the GPU's wait counts from the end of front
            if s:
                tokens, t_prev = self._collect(res, t_prev)
            h0 = time.perf_counter()
            ctx = m.pool.context[slots_t].numpy()  # [R, n-1]
            row_ids, next_ctx = m.hash.decode_row_ids(tokens, ctx)  # overlaps front on the GPU
            if self.staged is not None:  # back decodes them
                self.staged.stage(row_ids, label="decode")
            else:
                m.table.lookup_into(row_ids, self.emb, label="decode")  # front runs meanwhile
            exposure.stop("decode", time.perf_counter() - h0)
            logits = self.back()
            m.pool.context[slots_t] = torch.from_numpy(next_ctx)
            if keep:
                res.logits.append(logits.cpu())
            self._tokens_host.copy_(self.inp.tok, non_blocking=True)
            if self._sampled is not None:
                self._sampled.record()
        if steps:
            self._collect(res, t_prev)

    def _collect(self, res: GenerationResult, t_prev: float) -> tuple[np.ndarray, float]:
        """Wait for the last step's tokens; account the step and append them."""
        if self._sampled is not None:
            self._sampled.synchronize()
        tokens = self._tokens_host.numpy().copy()
        now = time.perf_counter()
        res.step_times.append(("decode", len(tokens), now - t_prev))
        res.decode_s += now - t_prev
        res.decode_tokens += len(tokens)
        for i, tok in enumerate(tokens.tolist()):
            res.tokens[i].append(tok)
        return tokens, now
