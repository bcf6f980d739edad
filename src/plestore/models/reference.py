"""A small reference decoder that runs the Qwen4Exp PLE sublayer the way the engines do.

It is a test vehicle, not a real model: random (seeded) attention and MLP weights, no positional
encoding, and a simple 4-stream residual bank (each layer reads a softmax-weighted mix of the
streams and writes its output back to every stream with per-stream weights). What it does
faithfully is the part plestore serves: every step hashes the new tokens on the host with each
request's n-gram context and looks up their rows while layer 0 runs, waiting for them only at
the PLE layer (decoder layer 1), whose weights load from a checkpoint by their real names.
Greedy generation over a batch of requests with chunked prefill and decode (steps over static
buffers replayed as CUDA graphs on a GPU, as engines run them: `plestore.models.graphs`), a KV
cache and a per-request state pool; the same run on every tier must give identical tokens and
logits.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plestore.hashing import Qwen4ExpHash
from plestore.layers import Qwen4ExpPLE, Qwen4ExpPLEConfig, StatePool
from plestore.lookup import Table
from plestore.models.attention import KVCache, StepInputs
from plestore.models.graphs import Exposure, StepRunner

__all__ = ["DecoderConfig", "GenerationResult", "ReferenceDecoder"]


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    eos_token_id: int
    hidden_size: int = 256
    hc_count: int = 4
    num_layers: int = 3
    ple_layer: int = 1  # 0-based decoder layer that owns the PLE sublayer
    num_heads: int = 4
    intermediate_size: int = 0  # 0: 2 * hidden_size
    max_seq_len: int = 1024
    max_requests: int = 64
    rms_norm_eps: float = 1e-6
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    cuda_graphs: bool = True  # on a GPU, decode and repeating prefill shapes replay CUDA graphs

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "hc_count",
            "num_layers",
            "num_heads",
            "max_seq_len",
            "max_requests",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"DecoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.ple_layer < self.num_layers:
            raise ValueError(f"ple_layer {self.ple_layer} is not a layer of {self.num_layers}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by {self.num_heads}")
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", 2 * self.hidden_size)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per request
    logits: list[Tensor] = field(default_factory=list)  # per step [R, vocab] fp32 (keep_logits)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    step_times: list[tuple[str, int, float]] = field(default_factory=list)  # (phase, R, s)
    exposed_s: dict[str, float] = field(default_factory=dict)  # per phase: waited for rows
    window_s: dict[str, float] = field(default_factory=dict)  # ... GPU time of the layers before
    host_s: dict[str, float] = field(default_factory=dict)  # ... host chain to back's launch


class _Block(nn.Module):
    """Pre-norm attention + SwiGLU MLP on the bank's mixed stream."""

    def __init__(self, cfg: DecoderConfig, gen: torch.Generator) -> None:
        super().__init__()
        h, m, c = cfg.hidden_size, cfg.intermediate_size, cfg.hc_count
        dev = gen.device

        def w(*shape: int) -> nn.Parameter:
            return nn.Parameter(
                torch.randn(*shape, generator=gen, device=dev) / math.sqrt(shape[-1])
            )

        self.qkv, self.o = w(3 * h, h), w(h, h)
        self.up, self.down = w(2 * m, h), w(h, m)
        self.norm1 = nn.Parameter(torch.ones(h, device=dev))
        self.norm2 = nn.Parameter(torch.ones(h, device=dev))
        self.read = nn.Parameter(torch.randn(c, generator=gen, device=dev))  # stream mix in
        self.write = nn.Parameter(torch.rand(c, generator=gen, device=dev) + 0.5)  # streams out
        self.heads, self.eps = cfg.num_heads, cfg.rms_norm_eps

    def _norm(self, x: Tensor, w: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w

    def forward(
        self, bank: Tensor, kv: KVCache, layer: int, inp: StepInputs, where: tuple
    ) -> Tensor:
        t, c, h = bank.shape  # [T, C, H]
        mix = torch.softmax(self.read.float(), 0).to(bank.dtype)
        x = (bank * mix[None, :, None]).sum(1)  # [T, H]
        q, k, v = F.linear(self._norm(x, self.norm1), self.qkv).view(t, 3, self.heads, -1).unbind(1)
        x = x + F.linear(kv.attend(layer, q, k, v, inp, where).reshape(t, h), self.o)  # [T, H]
        gate, up = F.linear(self._norm(x, self.norm2), self.up).chunk(2, -1)
        out = x + F.linear(F.silu(gate) * up, self.down)  # [T, H]
        return bank + out[:, None, :] * self.write.to(bank.dtype)[None, :, None]


class ReferenceDecoder(nn.Module):
    """Greedy generation with the PLE sublayer at `ple_layer`, its rows from a plestore Table."""

    def __init__(
        self,
        cfg: DecoderConfig,
        table: Table,
        ngram_hash: Qwen4ExpHash,
        ple_weights: Mapping[str, Tensor] | None = None,
        ple_prefix: str = "",
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.table, self.hash = cfg, table, ngram_hash
        self.device = torch.device(device) if device is not None else table.device
        spec = table.spec
        embed_dim = spec.heads * spec.dim
        if spec.rows != ngram_hash.num_rows or spec.heads != ngram_hash.heads:
            raise ValueError(
                f"table {spec.name} ({spec.rows} rows, {spec.heads} ids per token) does not match "
                f"the PLE hash ({ngram_hash.num_rows} rows, {ngram_hash.heads} heads)"
            )
        if cfg.vocab_size != ngram_hash.spec.vocab_size:
            raise ValueError(
                f"decoder vocab {cfg.vocab_size} != hash vocab {ngram_hash.spec.vocab_size}"
            )
        # weights are drawn on the target device (a 248k x 2560 head takes seconds on a CPU)
        gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        dev = self.device
        self.embed = nn.Parameter(
            torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, device=dev)
        )
        self.blocks = nn.ModuleList(_Block(cfg, gen) for _ in range(cfg.num_layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden_size, device=dev))
        # untied output head: a tied random model keeps predicting its input token, which would
        # make every decode step look up the same n-gram rows
        self.lm_head = nn.Parameter(
            torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, device=dev)
        )
        self.ple = Qwen4ExpPLE(
            Qwen4ExpPLEConfig(
                hidden_size=cfg.hidden_size,
                hc_count=cfg.hc_count,
                ple_embed_dim=embed_dim,
                dilation=ngram_hash.spec.ngram_size,
                rms_norm_eps=cfg.rms_norm_eps,
                dtype=cfg.dtype,
            )
        )
        if ple_weights is None:  # random PLE weights (norm weights stay zero, i.e. scale 1)
            for p in (self.ple.key_proj.weight, self.ple.value_proj.weight):
                w = torch.randn(p.shape, generator=gen, device=dev) / math.sqrt(embed_dim)
                p.data.copy_(w)
            conv = self.ple.conv1d.weight
            conv.data.copy_(torch.randn(conv.shape, generator=gen, device=dev) * 0.5)
        self.to(self.device, cfg.dtype)
        if ple_weights is not None:
            self.ple.load_weights(ple_weights, ple_prefix)
        self.pool = StatePool.for_qwen4exp(
            self.ple.config,
            cfg.max_requests,
            num_ple_layers=1,
            eos_token_id=cfg.eos_token_id,
            ngram_size=ngram_hash.spec.ngram_size,
            device=self.device,
            context_device="cpu",
        )
        self.kv = KVCache(cfg, self.device)
        self._ahead: tuple | None = None  # (step arrays, pending, context) started a step early
        # per (R, T, lq, decode, the table of a decode runner's staged lookup): see _runners_for
        self._runners: dict[tuple, StepRunner] = {}
        self._graph_pool = None  # CUDA graphs of every runner share one memory pool

    # -- one engine step -----------------------------------------------------------------------
    @torch.inference_mode()
    def step(
        self,
        slots: np.ndarray,
        tokens: np.ndarray,
        qsl: np.ndarray,
        phase: str,
        next_step: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
        exposure: Exposure | None = None,
    ) -> Tensor:
        """Run the new tokens of requests `slots` (ragged by qsl); return the last token's
        logits per request [R, vocab] (fp32).

        next_step: (slots, tokens, qsl) of the following step when its tokens are known already
        (chunked prefill): once this step's GPU work is queued, its lookup is hashed, started
        and gathered here while the GPU runs this step — a whole step ahead of the layer that
        needs it — and the next step picks the rows up when called with the same arrays."""
        with self._on_device():
            return self._step(slots, tokens, qsl, phase, next_step, exposure)

    def _step(self, slots, tokens, qsl, phase, next_step, exposure) -> Tensor:
        self.pool.check(slots.tolist(), f"run a {phase} step on")
        pending, next_ctx = self._lookup(slots, tokens, qsl, phase)
        past = self.kv.reserve(slots, np.diff(qsl))
        runner = self._runners.get((*_shape(tokens, qsl), False, None))  # a captured prefill
        exposure = exposure or Exposure(self.device)
        h0 = time.perf_counter()
        exposure.window()
        if runner is not None:
            runner.load(slots, tokens, qsl, past)
            runner.front()
        else:
            inp = StepInputs.from_host(slots, tokens, qsl, past, self.device)
            bank, where = self.front(inp)
        exposure.start()
        emb = pending.result()  # [T, heads*dim] bf16: waits only if still in flight
        if runner is not None:
            runner.emb.copy_(emb)
        exposure.stop(phase, time.perf_counter() - h0)
        logits = runner.back() if runner is not None else self.back(inp, where, bank, emb)
        self.pool.context[torch.from_numpy(slots)] = torch.from_numpy(next_ctx)
        if next_step is not None:  # this step is queued: hash and gather the next one meanwhile
            ctx = self.pool.context[torch.from_numpy(next_step[0])].numpy()  # [R', n-1]
            self._ahead = (next_step, *self._start_lookup(*next_step, ctx, phase, defer=True))
            self._ahead[1].run_now()
        return logits

    def front(self, inp: StepInputs) -> tuple[Tensor, tuple]:
        """The token embedding and the layers before the PLE layer: what the lookup overlaps."""
        where = self.kv.where(inp)
        x = self.embed[inp.tok]  # [T, H]
        bank = x[:, None, :].expand(-1, self.cfg.hc_count, -1).contiguous()  # [T, C, H]
        for i in range(self.cfg.ple_layer):
            bank = self.blocks[i](bank, self.kv, i, inp, where)
        return bank, where

    def back(self, inp: StepInputs, where: tuple, bank: Tensor, emb: Tensor) -> Tensor:
        """The PLE sublayer on the looked-up rows emb [T, heads*dim], the remaining layers and
        the head: logits [R, vocab] fp32 of each request's last token. The slots' conv states
        are read and written on the device (the host checked the slots)."""
        conv = self.pool.conv_state[0, inp.slot]  # [R, C*H, S]
        t = emb.shape[0]
        flat, new_conv = self.ple(bank.view(t, -1), emb.to(bank.dtype), inp.qsl, conv, check=False)
        self.pool.conv_state[0, inp.slot] = new_conv
        bank = flat.view_as(bank)
        for i in range(self.cfg.ple_layer, self.cfg.num_layers):
            bank = self.blocks[i](bank, self.kv, i, inp, where)
        h = self.blocks[0]._norm(bank[inp.last].mean(1), self.final_norm)  # [R, H]
        return F.linear(h, self.lm_head).float()  # [R, vocab]

    def _lookup(self, slots, tokens, qsl, phase) -> tuple:
        """(pending rows, context after this step): the lookup started a step ahead for exactly
        these arrays, else one started now — before layer 0, which it overlaps."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and tuple(map(id, ahead[0])) == (id(slots), id(tokens), id(qsl)):
            return ahead[1], ahead[2]
        ctx = self.pool.context[torch.from_numpy(slots)].numpy()  # [R, n-1] host
        return self._start_lookup(slots, tokens, qsl, ctx, phase)

    def _start_lookup(self, slots, tokens, qsl, ctx, phase, defer=False) -> tuple:
        row_ids, next_ctx = self.hash.row_ids(tokens, qsl, ctx)  # [T, heads] on the host
        return self.table.prefetch(row_ids, label=phase, defer=defer), next_ctx

    # -- greedy generation ---------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        chunk_size: int = 256,
        keep_logits: bool = False,
        forced: list[list[int]] | None = None,
    ) -> GenerationResult:
        """Chunked prefill of every prompt, then `max_new_tokens - 1` decode steps (CUDA graphs
        on a GPU for decode and for prefill shapes that repeat; see `_runners_for`).

        forced: teacher forcing — each request's first `max_new_tokens - 1` tokens are decode
        step 0, 1, ...'s inputs instead of the greedy ones (the lookups then follow a known
        continuation, e.g. of real text); `tokens` still holds the greedy predictions."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one non-empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        inputs = None if forced is None else self._forced(forced, len(prompts), max_new_tokens - 1)
        with self._on_device():
            return self._generate(prompts, max_new_tokens, chunk_size, keep_logits, inputs)

    def _forced(self, forced: list[list[int]], requests: int, steps: int) -> np.ndarray | None:
        """int64 [requests, steps] of decode inputs, checked (None: no decode steps)."""
        if len(forced) != requests:
            raise ValueError(f"forced has {len(forced)} requests, prompts {requests}")
        if any(len(f) < steps for f in forced):
            raise ValueError(f"forced needs at least {steps} tokens per request (the decode steps)")
        out = np.array([list(f)[:steps] for f in forced], dtype=np.int64).reshape(requests, steps)
        if out.size and (out.min() < 0 or out.max() >= self.cfg.vocab_size):
            raise ValueError(f"forced tokens must be in [0, {self.cfg.vocab_size})")
        return out if steps else None

    def _on_device(self):
        """Make the model's GPU current: streams, events and graph capture use the current
        device (a model on cuda:1 under current device 0 would sync on the wrong stream)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def _generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        chunk_size: int,
        keep_logits: bool,
        forced: np.ndarray | None,
    ) -> GenerationResult:
        slots = np.array([self.pool.allocate() for _ in prompts], np.int64)
        self.kv.lengths[slots] = 0
        res = GenerationResult(tokens=[[] for _ in prompts])
        exposure = Exposure(self.device)
        try:
            plan, done = [], [0] * len(prompts)  # prefill steps: known before the first runs
            while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
                live = [i for i, p in enumerate(prompts) if done[i] < len(p)]
                chunks = [prompts[i][done[i] : done[i] + chunk_size] for i in live]
                for i, c in zip(live, chunks, strict=True):
                    done[i] += len(c)
                plan.append((live, _batch(slots[live], chunks)))
            decode = self._runners_for(slots, [b for _, b in plan], max_new_tokens > 1)
            last = {i: k for k, (live, _) in enumerate(plan) for i in live}  # final chunk
            for k, (live, batch) in enumerate(plan):
                ahead = plan[k + 1][1] if k + 1 < len(plan) else None
                t0 = time.perf_counter()
                logits = self.step(*batch, "prefill", next_step=ahead, exposure=exposure)
                next_tokens = logits.argmax(-1).tolist()  # the step's one sync: R token ids
                res.step_times.append(("prefill", len(live), time.perf_counter() - t0))
                res.prefill_s += res.step_times[-1][2]
                if keep_logits:
                    res.logits.append(logits.cpu())
                for j, i in enumerate(live):
                    if last[i] == k:
                        res.tokens[i].append(next_tokens[j])
                res.prefill_tokens += len(batch[1])
            if decode is not None:
                decode.decode(res, slots, max_new_tokens - 1, keep_logits, exposure, forced)
        finally:
            self._ahead = None
            for s in slots.tolist():
                self.pool.free(s)
        for phase, tot in exposure.totals().items():
            res.exposed_s[phase], res.window_s[phase] = tot["exposed"], tot["window"]
            res.host_s[phase] = tot["host"]
        return res

    def _runners_for(self, slots: np.ndarray, prefill: list[tuple], decode: bool):
        """Make (and on CUDA capture) the step runners this generation uses, before its first
        step: capture's warm-up runs write the slots' state, harmless while they are fresh (the
        conv states are reset here; a KV position they wrote is written again before a step
        attends to it). Decode always runs on a runner (returned; None without decode steps); a
        prefill shape gets one when it repeats (uniform chunks) and CUDA graphs are on: a
        one-off shape runs faster eagerly than warmed up, captured and replayed once."""
        graphs = self.device.type == "cuda" and self.cfg.cuda_graphs and self.table.graph_capturable
        wanted = []  # (key, batch to capture with)
        if graphs:
            seen: dict[tuple, int] = {}
            for batch in prefill:
                key = (*_shape(batch[1], batch[2]), False, None)
                seen[key] = seen.get(key, 0) + 1
                if seen[key] == 2:  # (a shape captured before is used whenever it comes)
                    wanted.append((key, batch))
        r = len(slots)
        dkey = (r, r, 1, True, self.table)  # its staged lookup is the table's (held: no reuse)
        if decode:
            wanted.append((dkey, (slots, np.zeros(r, np.int64), np.arange(r + 1))))
        captured = False
        for key, (b_slots, b_tokens, b_qsl) in wanted:
            runner = self._runners.get(key)
            if runner is None:
                runner = self._runners[key] = StepRunner(self, *key[:4])
            if graphs and not runner.captured:
                runner.load(b_slots, b_tokens, b_qsl, np.zeros(len(b_slots), np.int64))
                runner.capture()
                captured = True
        if captured:
            self.pool.conv_state[:, torch.from_numpy(slots).to(self.device)] = 0
        return self._runners[dkey] if decode else None


def _shape(tokens: np.ndarray, qsl: np.ndarray) -> tuple[int, int, int]:
    """A step's (requests, tokens, longest chunk): what fixes a captured step's shapes."""
    return len(qsl) - 1, len(tokens), int(np.diff(qsl).max(initial=1))


def _batch(slots: np.ndarray, chunks: list[list[int]]) -> tuple[np.ndarray, ...]:
    """A step's (slots, tokens, query_start_loc) from each request's new tokens."""
    qsl = np.concatenate([[0], np.cumsum([len(c) for c in chunks])]).astype(np.int64)
    return slots, np.array([t for c in chunks for t in c], np.int64), qsl
