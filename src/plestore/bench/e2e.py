"""`plestore bench e2e`: the reference decoder's step time with the table on each tier, divided
by the resident table's, at several batch sizes, warm and cold.

Every tier's table is open at once and one decoder switches between them, so each repetition
runs every (tier, warm|cold) configuration back to back and a tier's ratio is the median over
repetitions of (resident step time / tier step time) from the same repetition: drift of a noisy
machine cancels instead of landing on whichever tier ran last. Each run generates greedily;
step times are host wall time per step, which includes the sampler's sync. Prompts are
prefilled in chunks (`prefill_chunk` tokens per request per step, as engines batch prefill), so
the decoder looks up chunk k+1 while chunk k runs; only the first chunk's lookup has no more
than layer 0 to hide behind. Warm: the same run went before (rows cached); cold: the tier's
caches dropped — every open table's: a page another table maps stays in the page cache — and
the file evicted first, so every step's rows start on the disk.
Decode steps and the (uniform) prefill chunks replay CUDA graphs (`plestore.models.graphs`), as
engines run them: the step time is then the GPU's, and host work shows only where it is not
hidden behind layer 0 (or, for the next prefill chunk's lookup, behind the whole step). Decode
samples and hashes the next step's ids on the device, so a table the GPU reads (device,
pinned) runs with no host in the loop and a host tier's host only reads the rows.
`exposed_*_ms` is the time per step the PLE layer waited for its rows: on CUDA the GPU time
between the end of layer 0 and the rows being ready (host work hidden behind layer 0 does not
count; a lookup's kernel between the graphs does, a decode step's inside back does not).
`window_*_ms` is layer 0's GPU time (what a lookup can hide behind) and `host_*_ms` the host's
chain from a step's ids to the PLE half's launch (decode: from the ids in hand): a host chain
longer than the window, plus the host's wake-up, shows as exposed time.
Cold rows carry the disk's bound, measured in the same run: `disk_*_ms` is the time O_DIRECT
reads of as many random blocks as the direct tier read per step take (a direct-tier row its own:
behind a GPU row cache, its misses'; the disk's latency for a decode step's few, its random-read
rate for many), and `bound_*_ratio` the best ratio any tier
could reach with those reads hidden as far as the decoder allows: a decode step's behind layer
0; a prompt's chunk by chunk, one after another on the disk — the first chunk's rows behind
layer 0 alone, the last chunk's after every chunk's reads (the later chunks are looked up a
step ahead, so their reads may also overlap the steps before).
`gpu_caches` adds each host tier again behind a GPU row cache of each size (a variant,
static set from the table's profile if it has one), with the cache's hit rate per phase beside
the ratios. Every run, warm-ups included, starts the cache as a restart would — its static set,
no dynamic rows — so warm and cold differ only in the tier's state: kept, the dynamic rows
admitted by earlier runs of the same prompts made later runs hit every row (a rate no server
sees; the hit rates of unseen text: `bench hitrate`), and a run's misses rows that no run
before it had read through the tier (so "warm" read the disk).
`text`: prompts are real documents of a token stream (`plestore text`), one per request (with
`text_split`, of the documents a `plestore profile --split` of that share left unseen), and
decode continues each document: its steps are teacher-forced with the document's next tokens
(`ReferenceDecoder.generate(forced=...)`; random weights would otherwise decode tokens that are
not text), so decode lookups are real text's; the greedy predictions are still compared.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

import plestore
from plestore.bench.limits import random_read_floor_s
from plestore.bench.methods import tier_options
from plestore.distributed import open_sharded
from plestore.hashing import Qwen4ExpHash
from plestore.io.memory import evict
from plestore.models import DecoderConfig, ReferenceDecoder
from plestore.options import TableOptions
from plestore.tablefile import TableFile

__all__ = ["E2EResult", "decoder_config", "run_e2e"]

_PHASES = ("decode", "prefill")
_COLD_TIERS = ("mapped", "direct", "cascade")  # tiers with a cold state (memory tiers: none)
_HOST_TIERS = ("pinned", "mapped", "direct", "cascade")  # tiers a GPU row cache can front


def text_prompts(
    stream_path: str, requests: int, tokens: int, vocab: int, held_out: float | None = None
) -> list[list[int]]:
    """`requests` runs of `tokens` tokens, each from a different document of a token stream
    (the longest documents, from a random offset; shorter ones are taken whole); held_out: only
    from the documents a profile with `plestore profile --split held_out` did not see."""
    from plestore.lookup.profile import TokenStream

    s = TokenStream.load(stream_path)
    if held_out is not None:
        s = s.split(held_out)[1]
    if int(s.ids.max()) >= vocab:
        raise ValueError(f"{stream_path}: token ids reach {int(s.ids.max())}, vocab is {vocab}")
    rng = np.random.default_rng(0)
    docs = np.argsort(-np.diff(s.starts), kind="stable")
    prompts = []
    for r in range(requests):
        d = s.doc(int(docs[r % docs.size]))
        a = int(rng.integers(0, max(1, d.size - tokens)))
        prompts.append(d[a : a + tokens].astype(np.int64).tolist())
    return prompts


@dataclass
class E2EResult:
    tier: str
    batch: int
    cache: str  # warm | cold
    prefill_step_ms: float  # median over repetitions of each run's mean prefill step
    decode_step_ms: float  # ... of each run's median decode step
    prefill_first_ms: float = 0.0  # ... of each run's first prefill step (the one whose lookup
    # has only layer 0 to hide behind: the later chunks are looked up a step ahead)
    prefill_ratio: float | None = None  # resident step time / this tier's (1.0 = no cost)
    decode_ratio: float | None = None
    exposed_prefill_ms: float = 0.0  # per prefill step: what the PLE layer waited for rows
    exposed_decode_ms: float = 0.0  # per decode step
    window_prefill_ms: float = 0.0  # per step: GPU time of the layers the lookup hides behind
    window_decode_ms: float = 0.0
    host_prefill_ms: float = 0.0  # per step: the host's chain from ids to the PLE half's launch
    host_decode_ms: float = 0.0
    blocks_prefill: float = 0.0  # per step: blocks the tier read from storage (direct counts)
    blocks_decode: float = 0.0
    disk_prefill_ms: float | None = None  # cold: reads of that many random blocks, alone
    disk_decode_ms: float | None = None
    bound_prefill_ratio: float | None = None  # cold: the best ratio those reads allow
    bound_decode_ratio: float | None = None
    tokens_equal_resident: bool | None = None
    reps: int = 1
    gpu_cache_hit_prefill: float | None = None  # share of this rank's ids the GPU cache served
    gpu_cache_hit_decode: float | None = None


def run_e2e(
    table_dir: str,
    tiers: list[str],
    batches: list[int],
    device: torch.device,
    hidden_size: int = 6144,
    num_layers: int = 4,
    prompt_tokens: int = 512,
    decode_steps: int = 32,
    reps: int = 5,  # fewer scatter past the effects. measured: RESULTS.md "e2e warm"
    prefill_chunk: int = 128,
    cuda_graphs: bool = True,
    caches: list[str] | tuple[str, ...] = ("warm", "cold"),
    log: Callable[[str], None] = print,
    gpu_caches: list[int] | tuple[int, ...] = (),
    text: str | None = None,
    text_split: float | None = None,
) -> list[E2EResult]:
    """Step times per (tier, batch, warm|cold) and their ratio to the resident tier."""
    tf = TableFile.open(table_dir)
    ngram, file_bytes = Qwen4ExpHash.from_spec(tf.spec.hash), os.path.getsize(tf.data_path)
    cfg = decoder_config(
        ngram,
        hidden_size,
        num_layers,
        prompt_tokens + decode_steps,
        max(batches),
        cuda_graphs=cuda_graphs,
    )
    prompts, forced = _prompts(
        batches, prompt_tokens, decode_steps, cfg.vocab_size, text, text_split
    )
    tiers, configs = _configs(tiers, gpu_caches, caches, log)
    tables: dict[str, plestore.Table] = {}
    # warm means the rows are in memory: a mapped Rss budget below the table would trim them
    # (and drop them from the page cache) between steps, and "warm" steps would read the disk
    opts = {"rss_budget_bytes": max(TableOptions().rss_budget_bytes, file_bytes)}
    try:
        for label in tiers:  # a tier, or a variant: `direct:native=off` (see tier_options)
            tier, variant = tier_options(label)
            shard = variant.pop("shard", None)  # `mapped:shard=rows`: over the process group
            open_ = plestore.open_table if shard is None else partial(open_sharded, shard=shard)
            t0 = time.perf_counter()
            tables[label] = open_(table_dir, tier=tier, device=str(device), **{**opts, **variant})
            log(f"e2e: {label} open in {time.perf_counter() - t0:.1f} s")  # (a cache's fill)
        model = ReferenceDecoder(cfg, tables["device"], ngram, device=device)
        results = []
        for batch in batches:
            args = (prompts[batch], decode_steps, prefill_chunk, forced[batch])
            runs = _runs(model, tables, tiers, configs, table_dir, batch, reps, args, log)
            rows = _summarise(runs, batch)
            if ("direct", "cold") in runs:
                _disk_bound(rows, tables, -(-prompt_tokens // prefill_chunk), log)
            results += rows
    finally:
        for t in tables.values():
            t.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _prompts(batches, prompt_tokens: int, decode_steps: int, vocab: int, text, text_split):
    """Per batch size, its requests' prompts and the tokens each decode step is forced to (None:
    sampled): random tokens, or with `text` each request a document's start and continuation."""
    rng = np.random.default_rng(0)
    prompts = {
        b: [rng.integers(0, vocab, prompt_tokens).tolist() for _ in range(b)] for b in batches
    }
    forced = {b: None for b in batches}
    if text is not None:  # each request a document: the prompt, then its next tokens forced
        runs = {
            b: text_prompts(text, b, prompt_tokens + decode_steps, vocab, text_split)
            for b in batches
        }
        prompts = {b: [r[:prompt_tokens] for r in runs[b]] for b in batches}
        forced = {b: [_continued(r, prompt_tokens, decode_steps) for r in runs[b]] for b in batches}
    return prompts, forced


def _configs(tiers, gpu_caches, caches, log) -> tuple[list[str], list[tuple[str, str]]]:
    """The tiers to open (the resident one first; each host tier again behind each GPU cache
    size) and the (tier, warm|cold) runs."""
    tiers = ["device", *dict.fromkeys(t for t in tiers if t != "device")]
    tiers += [  # each host tier with no cache of its own again behind each cache
        f"{t}{',' if ':' in t else ':'}gpu_cache_bytes={c}"
        for c in gpu_caches
        for t in tiers
        if tier_options(t)[0] in _HOST_TIERS and "gpu_cache_bytes" not in tier_options(t)[1]
    ]
    if not set(caches) <= {"warm", "cold"} or not caches:
        raise ValueError(f"caches must be warm and/or cold, got {list(caches)}")
    configs = [(t, "warm") for t in tiers]  # (the resident warm run is every ratio's base)
    if "cold" in caches:
        configs += [(t, "cold") for t in tiers if tier_options(t)[0] in _COLD_TIERS]
    if "warm" not in caches:
        configs = configs[:1] + [c for c in configs if c[1] == "cold"]
    if any(c[1] == "cold" for c in configs) and ("direct", "cold") not in configs:
        log("e2e: no disk bound on the cold rows (the direct tier's cold run counts the blocks)")
    return tiers, configs


def _runs(model, tables, tiers, configs, table_dir, batch: int, reps: int, args, log) -> dict:
    """Every config's runs at one batch size, configs alternated rep by rep:
    (prefill, decode, exposed prefill, decode ms, tokens) each."""
    runs = {c: [] for c in configs}
    for tier in tiers:  # warm-up: kernels for these shapes, allocator, caches
        _warm_up(model, tables[tier], *args)
    cooled = False  # a cold run dropped every table's caches since the warm-up
    for rep in range(reps):
        for tier, cache in configs:
            if cache == "cold":
                cooled = True
            elif cooled and tier_options(tier)[0] in _COLD_TIERS:  # warm again
                _warm_up(model, tables[tier], *args)
            runs[tier, cache].append(_run(model, tables, tier, table_dir, cache, *args))
            pre, dec = runs[tier, cache][-1][:2]
            log(
                f"e2e rep {rep + 1}/{reps} {tier} b{batch} {cache}: "
                f"prefill {pre:.2f} ms, decode {dec:.2f} ms/step"
            )
    return runs


def decoder_config(
    ngram: Qwen4ExpHash, hidden: int, layers: int, tokens: int, requests: int, **kw
) -> DecoderConfig:
    """The benchmark's decoder: 128-wide heads, room for `tokens` per request."""
    return DecoderConfig(
        vocab_size=ngram.spec.vocab_size,
        eos_token_id=ngram.spec.eos_token_id,
        hidden_size=hidden,
        num_heads=max(1, hidden // 128),
        num_layers=layers,
        max_seq_len=tokens + 8,
        max_requests=requests,
        **kw,
    )


def _continued(run: list[int], prompt_tokens: int, decode_steps: int) -> list[int]:
    """Decode inputs continuing a document: its tokens after the prompt (a document that ends
    sooner repeats its last token)."""
    rest = run[prompt_tokens:] or run[-1:]
    return (rest + rest[-1:] * decode_steps)[: max(decode_steps - 1, 0)]


def _restart_gpu_cache(table) -> None:
    """The table's GPU row cache as a restart leaves it: its static set, no dynamic rows (a
    sharded table's is its own rows' table's; nothing is in flight between runs)."""
    local = getattr(table, "table", table)  # (a ShardedTable: this rank's Table, or None)
    cache = getattr(local, "gpu_cache", None)
    if cache is not None:
        cache.clear()


def _warm_up(model, table, prompts, decode_steps, prefill_chunk, forced) -> None:
    model.table = table
    _restart_gpu_cache(table)  # as the timed run will find it: the same misses read
    model.generate(prompts, decode_steps, chunk_size=prefill_chunk, forced=forced)


def _run(model, tables, tier, table_dir, cache, prompts, decode_steps, prefill_chunk, forced):
    model.table = table = tables[tier]
    if cache == "cold":  # every table's: a page another table maps stays in the page cache
        for t in tables.values():
            t.drop_caches()
        evict(table_dir)
    _restart_gpu_cache(table)  # the replayed prompts' rows not admitted by the runs before
    table.metrics.reset()
    res = model.generate(prompts, decode_steps, chunk_size=prefill_chunk, forced=forced)
    phases = table.metrics.snapshot()["phases"]
    steps = {ph: [s for p, _, s in res.step_times if p == ph] for ph in ("prefill", "decode")}
    per_step = [  # ms per step of each phase: exposed, window, host
        getattr(res, f)[ph] / len(steps[ph]) * 1e3 if ph in getattr(res, f) else 0.0
        for f in ("exposed_s", "window_s", "host_s")
        for ph in ("prefill", "decode")
    ]
    per_step += [  # blocks read per step of each phase
        phases[ph]["blocks_read"] / max(1, phases[ph]["calls"]) if ph in phases else 0.0
        for ph in ("prefill", "decode")
    ]
    per_step += [  # the GPU row cache's hit rate per phase (0 without one)
        phases[ph]["gpu_cache_hit_rate"] if ph in phases else 0.0 for ph in ("prefill", "decode")
    ]
    return (
        float(np.mean(steps["prefill"])) * 1e3,  # mean: the first chunk's wait counts in full
        float(np.median(steps["decode"])) * 1e3,
        steps["prefill"][0] * 1e3,
        *per_step,
        res.tokens,
    )


_PER_STEP = [
    "prefill_first_ms",
    *(f"{w}_{ph}_ms" for w in ("exposed", "window", "host") for ph in ("prefill", "decode")),
    "blocks_prefill",
    "blocks_decode",
    "gpu_cache_hit_prefill",
    "gpu_cache_hit_decode",
]


def _summarise(runs: dict, batch: int) -> list[E2EResult]:
    base = runs["device", "warm"]
    out = []
    for (tier, cache), rs in runs.items():
        col = np.array([r[:-1] for r in rs])  # [reps, (prefill, decode, *_PER_STEP) ms]
        ratio = np.median(np.array([b[:2] for b in base]) / col[:, :2], axis=0)  # same rep
        med = np.median(col, axis=0).tolist()
        out.append(
            E2EResult(
                tier,
                batch,
                cache,
                med[0],
                med[1],
                prefill_ratio=float(ratio[0]),
                decode_ratio=float(ratio[1]),
                tokens_equal_resident=all(r[-1] == base[0][-1] for r in rs),
                reps=len(rs),
                **dict(zip(_PER_STEP, med[2:], strict=True)),
            )
        )
    return out


def _disk_bound(rows: list[E2EResult], tables: dict, chunks: int, log) -> None:
    """Time reads of as many random blocks as a cold step read (the median of several, back to
    back: the disk at its best) and put that and the ratio it allows on the batch's cold rows:
    a direct-tier row's own blocks, read as its table reads (behind a GPU row cache: its
    misses'; under one block a step on average, that share of one block's time), for the rest
    (mapped counts no blocks) the direct row behind the same GPU cache, else the uncached one."""
    res = next(r for r in rows if r.tier == "device")
    base = next(r for r in rows if (r.tier, r.cache) == ("direct", "cold"))
    direct = {  # GPU cache bytes -> the direct tier's cold row behind that cache
        tier_options(r.tier)[1].get("gpu_cache_bytes", 0): r
        for r in rows
        if r.cache == "cold"
        and tier_options(r.tier)[0] == "direct"
        and tier_options(r.tier)[1].keys() <= {"gpu_cache_bytes"}
    }
    floor: dict[tuple, float] = {}

    def disk_ms(t: plestore.Table, phase: str, blocks: float) -> float:
        n = max(1, round(blocks))
        key = (t.tier.unit, t.tier.options.tuning.queue_depth, phase, n)
        if blocks and key not in floor:
            reps = 15 if phase == "decode" else 3
            path, unit, qd = str(t.file.data_path), t.tier.unit, t.tier.options.tuning.queue_depth
            times = [random_read_floor_s(path, n, unit, qd, seed=i) for i in range(reps)]
            floor[key] = 1e3 * float(np.median(times))
        return floor.get(key, 0.0) * min(1.0, blocks)

    for r in rows:
        if r.cache != "cold":
            continue
        tier, opts = tier_options(r.tier)
        src = r if tier == "direct" else direct.get(opts.get("gpu_cache_bytes", 0), base)
        t = tables[src.tier]
        disk = {p: disk_ms(t, p, getattr(src, f"blocks_{p}")) for p in _PHASES}
        # hidden behind layer 0 at most
        step, window = res.decode_step_ms, res.window_decode_ms
        bound = {"decode": step / (step + max(0.0, disk["decode"] - window))}
        # the disk reads the chunks one after another; the first chunk waits for its rows behind
        # layer 0 alone, the last chunk's PLE layer for every chunk's
        step, window, d = res.prefill_step_ms, res.window_prefill_ms, disk["prefill"]
        total = max(chunks * step + d - window, chunks * d + step - window, chunks * step)
        bound["prefill"] = step * chunks / total
        for p in _PHASES:
            setattr(r, f"disk_{p}_ms", disk[p])
            setattr(r, f"bound_{p}_ratio", bound[p])
        log(
            f"e2e b{r.batch} {r.tier} disk bound: "
            + ", ".join(f"{p} {disk[p]:.2f} ms/step -> ratio <= {bound[p]:.3f}" for p in disk)
        )
