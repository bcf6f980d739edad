"""GPU row cache hit rate vs its size, on real text and on Zipf streams — simulated on the CPU
with the cache's own directory (`plestore.lookup.gpudirectory`), at the real table's row count.

    plestore bench hitrate --text textstreams/en --text textstreams/de --zipf --plot out.png

Each stream's documents are split at random in two halves: the static hot set is profiled on
one (`hot_rows`, what `plestore profile` writes), the cache serves the other. Serving is what
an engine does: prefill chunks of `--chunk` tokens over half the served documents (the cache
warms), then `--decode-steps` decode steps of `--batch` concurrent requests over the other
half's documents (never prefilled: a decode step re-reading prefilled tokens would hit rows no
server's decode reads again). Modes:
static (the profile's hottest rows, up to the cache's size, and nothing else), dynamic
(admission by frequency only), both (the profile's hottest rows in `gpu_cache_static` of the
cache, as a table opens its cache, the rest admitted by frequency). The hit rate counts row
reads (ids, repeats included); `unique` counts each lookup's distinct rows, which is what a
disk read or a PCIe copy pays for. No table file and no GPU: only row ids (the real Qwen4Exp
hash) and the directory's decisions (probed and admitted to by the host core: the compiled one
where built, else its numpy reference, the same decisions).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from plestore.hashing import Qwen4ExpHash
from plestore.lookup.gpudirectory import GpuCacheDirectory, static_slots_for
from plestore.lookup.profile import TokenStream, hot_rows
from plestore.options import Tuning

__all__ = ["HitRate", "simulate", "zipf_stream"]

MODES = {"static": 1.0, "dynamic": 0.0, "both": Tuning.gpu_cache_static}


@dataclass
class HitRate:
    stream: str
    mode: str
    cache_gib: float
    phase: str  # prefill | decode
    ids: int
    hit_rate: float  # ids served by the cache / ids
    unique_hit_rate: float  # per lookup: distinct rows served / distinct rows
    static_rows: int
    dynamic_rows: int
    profiled_rows: int
    admit_min: int = Tuning.gpu_cache_admit_min


def zipf_stream(tokens: int, doc_tokens: int, vocab: int, a: float = 1.1, seed: int = 0):
    """i.i.d. Zipf(a) tokens (ranks mapped to random token ids, as `bench.workloads`) in
    documents of `doc_tokens`."""
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(a, tokens), vocab) - 1
    ids = np.random.default_rng(12345).permutation(vocab)[ranks].astype(np.int32)
    starts = np.r_[np.arange(0, tokens, doc_tokens), tokens]
    return TokenStream(ids, starts.astype(np.int64), {"zipf": a})


def _serve(d: GpuCacheDirectory, lookups) -> tuple[int, int, int, int]:
    ids = hits = uniq = uhits = 0
    for rows in lookups:
        rows = rows.reshape(-1)
        slot = d.locate(rows)
        miss = slot < 0
        u, first = np.unique(rows, return_index=True)
        ids += rows.size
        hits += rows.size - int(miss.sum())
        uniq += u.size
        uhits += u.size - int(miss[first].sum())
        if miss.any():
            d.admit(u[miss[first]])  # the distinct missed rows
    return ids, hits, uniq, uhits


def simulate(
    name: str,
    stream: TokenStream,
    hasher: Qwen4ExpHash,
    sizes_gib: list[float],
    modes: list[str],
    row_bytes: int = 96,
    chunk: int = 2048,
    prefill_tokens: int = 1_000_000,
    batch: int = 64,
    decode_steps: int = 2000,
    min_count: int = 1,
    admit_min: int = Tuning.gpu_cache_admit_min,
    log=print,
) -> list[HitRate]:
    profile, serve = stream.split(0.5)
    if serve.documents >= 2:
        prefilled, decoded = serve.split(0.5, seed=1)
    else:  # (a tiny stream: decode re-reads the one document prefill served)
        prefilled = decoded = serve
        log(f"{name}: one document to serve: decode re-reads what prefill read")
    rows, _ = hot_rows(profile.row_ids(hasher), min_count)
    log(f"{name}: profiled {profile.ids.size:,} tokens -> {rows.size:,} rows read >= {min_count}x")
    out = []
    for gib in sizes_gib:
        slots = int(gib * 2**30) // row_bytes
        for mode in modes:
            t0 = time.perf_counter()
            n_static = static_slots_for(rows.size, int(slots * MODES[mode]))
            dynamic = 0 if mode == "static" else slots - n_static  # static: the profile alone
            d = GpuCacheDirectory(rows, dynamic, admit_min=admit_min, static_slots=n_static)
            chunks = prefilled.prefill_chunks(hasher, chunk, limit=max(1, prefill_tokens // chunk))
            pre = _serve(d, chunks)
            dec = _serve(d, decoded.decode_steps(hasher, batch, decode_steps, seed=1))
            for phase, (n, h, u, uh) in (("prefill", pre), ("decode", dec)):
                out.append(
                    HitRate(
                        name,
                        mode,
                        gib,
                        phase,
                        n,
                        h / n,
                        uh / u,
                        d.static_rows,
                        d.dynamic_capacity,
                        int(rows.size),
                        admit_min,
                    )
                )
            log(
                f"{name} {gib:g} GiB {mode}: prefill {pre[1] / pre[0]:.3f} "
                f"(unique {pre[3] / pre[2]:.3f}), decode {dec[1] / dec[0]:.3f} "
                f"(unique {dec[3] / dec[2]:.3f})  [{time.perf_counter() - t0:.0f} s]"
            )
            del d
    return out


def plot(results: list[HitRate], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = list(dict.fromkeys(r.stream for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, phase in zip(axes, ("prefill", "decode"), strict=True):
        for s in streams:
            for mode, style in (("static", ":"), ("dynamic", "--"), ("both", "-")):
                rs = [r for r in results if (r.stream, r.mode, r.phase) == (s, mode, phase)]
                if rs:
                    x = [r.cache_gib for r in rs]
                    ax.plot(x, [r.hit_rate for r in rs], style, marker="o", label=f"{s} {mode}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPU cache (GiB of HBM, 96-B slots)")
        ax.set_title(f"{phase}: row reads served by the cache")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hit rate")
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle("Qwen3.8-Flash-Next PLE table (320,001,536 rows): profile on half, serve half")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plestore bench hitrate", description=__doc__)
    ap.add_argument("--text", action="append", default=[], help="a token stream (plestore text)")
    ap.add_argument("--zipf", action="store_true", help="also an i.i.d. Zipf(1.1) stream")
    ap.add_argument("--zipf-tokens", type=int, default=2_000_000)
    ap.add_argument("--sizes", default="0.5,1,2,4,8", help="cache sizes in GiB")
    ap.add_argument("--modes", default="static,dynamic,both")
    ap.add_argument("--row-bytes", type=int, default=96, help="cache bytes a row (NVFP4: 96)")
    ap.add_argument("--min-count", type=int, default=1, help="profile rows read this often")
    ap.add_argument(
        "--admit-min",
        type=int,
        default=Tuning.gpu_cache_admit_min,
        help="the cache's gpu_cache_admit_min",
    )
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk tokens")
    ap.add_argument("--prefill-tokens", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=64, help="concurrent decode requests")
    ap.add_argument("--decode-steps", type=int, default=2000)
    ap.add_argument("--ngram-vocab-size-base", type=int, default=20_000_000, help="table scale")
    ap.add_argument("--plot", default="", help="PNG path ('' off)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    hasher = Qwen4ExpHash(248_320, 248_044, ngram_vocab_size_base=a.ngram_vocab_size_base)
    streams = [(p.rstrip("/").split("/")[-1], TokenStream.load(p)) for p in a.text]
    if a.zipf:
        doc = min(4096, max(1, a.zipf_tokens // 16))  # at least 16 documents to split
        streams.append(("zipf1.1", zipf_stream(a.zipf_tokens, doc, hasher.vocab_size)))
    if not streams:
        ap.error("give --text STREAM and/or --zipf")
    sizes = [float(s) for s in a.sizes.split(",")]
    modes = a.modes.split(",")
    if set(modes) - set(MODES):
        ap.error(f"modes: {', '.join(MODES)}")

    def log(line: str) -> None:  # progress on stderr: stdout is the JSON with --json
        print(line, file=sys.stderr if a.json else sys.stdout, flush=True)

    results = []
    for name, stream in streams:
        results += simulate(
            name,
            stream,
            hasher,
            sizes,
            modes,
            a.row_bytes,
            a.chunk,
            a.prefill_tokens,
            a.batch,
            a.decode_steps,
            a.min_count,
            a.admit_min,
            log,
        )
    if a.plot:
        plot(results, a.plot)
    if a.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
    return 0
