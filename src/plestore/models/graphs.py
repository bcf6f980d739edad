"""Steps over static buffers, replayed as CUDA graphs — as engines run them.

A step's shapes are fixed by its batch (R requests, T tokens, chunks of at most lq), so engines
capture it once and replay it: the host then launches a step in microseconds instead of
launching every kernel (the eager reference step spent more time in Python than its GPU
work took, so any host work, a lookup included, landed on the critical path; measured:
RESULTS.md "e2e warm"). A
step is captured in two halves around the PLE lookup, whose rows may arrive from the host:

    front   embedding + the layers before the PLE layer (what the lookup overlaps)
    back    the PLE layer on `emb`, the remaining layers, the head

Decode (`StepRunner.decode`) keeps its whole loop on the device, as engines do: back(s) picks
the greedy tokens, writes them into the token buffer, advances the positions and hashes the
tokens' n-grams into the next step's row ids (`Qwen4ExpHash.decode_ids` on the device, with
each request's context held there; or, teacher-forced, feeds given tokens instead: a known
continuation of real text); front(s+1) consumes the tokens into the context. The rows
are a `Table.staged` lookup whose kernel runs at the start of back. A table the GPU reads
itself (resident, or pinned memory through UVA) then needs no host at all: the host launches
step s+1 before it collects step s's tokens. A host tier needs each step's ids on the host:
they are copied after back(s) with its tokens, and the host stages the rows while front(s+1)
runs:

    GPU   back(s): rows, layers, argmax, ids(s+1) -> host | front(s+1): layer 0 | back(s+1)
    host                        wait for ids(s+1) -> tier read into staging ->  launch back(s+1)

Prefill steps of a shape that repeats (uniform chunks) replay graphs too; their inputs come from
the host in one copy, their rows from a lookup hashed on the host a step ahead. On CPU, or with
`DecoderConfig.cuda_graphs` off, the same buffers and loops run the two halves eagerly.
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
    work hidden behind those layers does not count; a late host — waiting for the ids, reading
    — or the rows' own kernel does, except a staged lookup's, which runs inside back);
    on CPU the lookup's wall time (everything there is on the critical path).

    Also per phase, what decides it: the window (the GPU time of those layers, marked by
    `window()` before front is launched; CUDA only) and the host's chain (`stop`'s host_s: from
    the rows' ids in the host's hands to back's launch; a GPU-read decode step has none), so a
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
    runner, whose back writes the sampled tokens into `inp.tok`, advances `inp.past` and hashes
    the next step's row ids into `ids`, and whose rows are a staged lookup decoded in back."""

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
        self._graphs: tuple | None = None
        self.logits: torch.Tensor | None = None  # [R, vocab] fp32 of the last back()
        self.staged = None
        if feedback:
            width = model.hash.context_width
            self.ctx = torch.zeros(r, width, dtype=torch.int64, device=dev)  # n-gram context
            self.ids = torch.zeros(r, spec.heads, dtype=torch.int64, device=dev)  # row ids
            self.staged = model.table.staged((r, spec.heads), out=self.emb, ids=self.ids)
            # sampled tokens reach the host in two buffers used in turn (a GPU-read table's
            # step s+1 may write one while the host reads the other), a host tier's ids in one
            self._tokens_host = torch.zeros(2, r, dtype=torch.int64, pin_memory=self.cuda)
            # (copied on a stream of their own: front(s+1) need not wait behind the copy)
            self._ids_host, self._ids_stream = self.ids, None
            if self.cuda and self.staged.needs_stage:
                self._ids_host = torch.zeros(r, spec.heads, dtype=torch.int64, pin_memory=True)
                self._ids_stream = torch.cuda.Stream(dev)
            self._sent = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
            # teacher forcing (decode(forced=...)): back(s) feeds forced[s + 1], not its argmax
            self.pred = torch.zeros(r, dtype=torch.int64, device=dev)  # back's greedy tokens
            self.forced = torch.zeros(model.cfg.max_seq_len + 1, r, dtype=torch.int64, device=dev)
            self.force = torch.zeros((), dtype=torch.bool, device=dev)
            self.step_no = torch.zeros(1, dtype=torch.int64, device=dev)
            self._forcing = False  # the eager step skips the forcing ops when nothing is forced

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
            return
        if self.feedback:  # the step's tokens join the context
            self.ctx.copy_(self.model.hash.advance_context(self.inp.tok, self.ctx))
        self._bank, self._where = self.model.front(self.inp)

    def back(self) -> torch.Tensor:
        """Logits [R, vocab] fp32, valid until the next step is launched."""
        if self._graphs is not None:
            self._graphs[1].replay()
            return self.logits
        if self.staged is not None:
            self.staged.decode()  # into self.emb
        self.logits = self.model.back(self.inp, self._where, self._bank, self.emb)
        if self.feedback:  # the next step's input and row ids, on the device
            self.pred.copy_(self.logits.argmax(-1))
            if self._forcing or (self.cuda and torch.cuda.is_current_stream_capturing()):
                self.step_no.add_(1)
                forced = self.forced.index_select(0, self.step_no).squeeze(0)  # [R]
                self.inp.tok.copy_(torch.where(self.force, forced, self.pred))
            else:
                self.inp.tok.copy_(self.pred)
            self.inp.past.add_(1)
            self.ids.copy_(self.model.hash.decode_ids(self.inp.tok, self.ctx))
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
        self,
        res: GenerationResult,
        slots: np.ndarray,
        steps: int,
        keep: bool,
        exposure: Exposure,
        forced: np.ndarray | None = None,
    ) -> None:
        """`steps` greedy decode steps after each request's last token in res.tokens; with
        `forced` (int64 [R, steps]) step s reads forced[:, s] instead (res.tokens still gets the
        greedy predictions)."""
        m, r = self.model, self.shape[0]
        slots_t = torch.from_numpy(slots)
        past = m.kv.reserve(slots, np.full(r, steps))  # room for every step, checked now
        tokens = np.array([t[-1] for t in res.tokens], np.int64)  # [R] host
        self.step_no.zero_()
        self.force.fill_(forced is not None)
        self._forcing = forced is not None
        if forced is not None:
            tokens = forced[:, 0]
            self.forced[1:steps].copy_(torch.from_numpy(forced[:, 1:].T.copy()))
        self.load(slots, tokens, np.arange(r + 1), past)
        self.ctx.copy_(m.pool.context[slots_t])  # (host -> device, once)
        self.ids.copy_(m.hash.decode_ids(self.inp.tok, self.ctx))  # step 0's ids
        host = self.staged.needs_stage  # the rows come through the host: it needs the ids
        self._send(0)
        t_prev = time.perf_counter()
        for s in range(steps):
            exposure.window()
            self.front()
            exposure.start()  # the GPU's wait counts from the end of front
            if host:  # wait for this step's ids (and tokens); back decodes them
                now = h0 = self._wait(s)
                self.staged.stage(self._ids_host.numpy(), label="decode")
            else:
                h0 = time.perf_counter()
                self.staged.replayed("decode")
            exposure.stop("decode", time.perf_counter() - h0)
            logits = self.back()
            if host:  # the tokens' bookkeeping waits until back is launched
                t_prev = self._account(res, s, t_prev, now)
            if keep:
                res.logits.append(logits.cpu())
            self._send(s + 1)
            if not host:  # step s is queued: collect step s-1's tokens while it runs
                t_prev = self._collect(res, s, t_prev)
        t_prev = self._collect(res, steps, t_prev)
        m.pool.context[slots_t] = self.ctx.cpu()

    def _send(self, k: int) -> None:
        """Copy step k's input tokens (sampled by step k-1) and, for a host tier, its row ids to
        the host, behind the GPU work queued so far: the ids on their own stream, so front(k)
        runs beside their copy (the host waits for them before it launches back(k), which
        writes the next ids)."""
        if k:
            self._tokens_host[k % 2].copy_(self.pred, non_blocking=True)
        if self._ids_stream is not None:  # its event follows the tokens' copy too
            self._ids_stream.wait_stream(torch.cuda.current_stream(self.model.device))
            with torch.cuda.stream(self._ids_stream):
                self._ids_host.copy_(self.ids, non_blocking=True)
                self._sent[k % 2].record()
        elif self._sent is not None:
            self._sent[k % 2].record()

    def _collect(self, res: GenerationResult, k: int, t_prev: float) -> float:
        """Wait for what `_send(k)` copied and account step k (see _account)."""
        return self._account(res, k, t_prev, self._wait(k))

    def _wait(self, k: int) -> float:
        """Wait for what `_send(k)` copied; returns when it arrived."""
        if self._sent is not None:
            self._sent[k % 2].synchronize()
        return time.perf_counter()

    def _account(self, res: GenerationResult, k: int, t_prev: float, now: float) -> float:
        """Append step k's input tokens (k >= 1: the tokens step k-1 sampled, collected at
        `now`) and account that step. Returns now."""
        if not k:
            return t_prev
        tokens = self._tokens_host[k % 2].tolist()
        res.step_times.append(("decode", len(tokens), now - t_prev))
        res.decode_s += now - t_prev
        res.decode_tokens += len(tokens)
        for i, tok in enumerate(tokens):
            res.tokens[i].append(tok)
        return now
