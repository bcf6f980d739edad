"""`plestore demo`: the whole path on this machine, in one command.

Synthesise a Qwen3.8-Flash-Next-format checkpoint (reused when present), pack its PLE table
(reused when the fingerprint matches), then run the reference decoder on a few prompts with the
table on every tier and check that tokens and logits equal the resident-table run. Every tier
runs a short generation before any is timed (the process's first-use costs: the first tier timed
had the widest spread), then each is timed after a warm-up generation of the same shapes
(kernels, graphs, allocations), over `repeats` generations, each from cold storage (the tier's
caches dropped): the median and the range.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

import plestore
from plestore.checkpoint import Checkpoint, CheckpointError, synth_checkpoint
from plestore.hashing import Qwen4ExpHash
from plestore.io.memory import evict
from plestore.models import DecoderConfig, ReferenceDecoder, load_ple_weights
from plestore.options import TIER_NAMES
from plestore.tablefile.pack import pack_checkpoint

__all__ = ["DemoRow", "run_demo"]

TIERS = TIER_NAMES[1:5]  # the storage tiers (not auto; the cascade composes them: --tiers)
_CHUNK = 256  # prompt tokens per request per prefill step


@dataclass
class DemoRow:
    tier: str
    prefill_tok_s: float  # the median over the timed runs
    decode_tok_s: float
    rows_per_token: float
    unique_rows_per_token: float  # distinct rows per step's lookup: the workload's, every tier's
    disk_bytes_per_token: float
    host_bytes: int
    exact: bool
    note: str = ""
    prefill_tok_s_runs: list[float] = field(default_factory=list)  # every timed run
    decode_tok_s_runs: list[float] = field(default_factory=list)


def _checkpoint(path: Path, fmt: str, hidden: int, base: int | None, progress: bool) -> Checkpoint:
    """The synthetic checkpoint at path, synthesised unless one with these settings is there."""
    try:
        ck = Checkpoint.open(path)
        text = ck.config.get("text_config", {})
        if text.get("hidden_size") == hidden and base in (None, text["ngram_vocab_size_base"]):
            return ck
        ck.close()
    except (CheckpointError, OSError, ValueError, KeyError):
        pass
    synth_checkpoint(
        path,
        "qwen3.8-flash-next",
        fmt,
        ngram_vocab_size_base=base,
        hidden_size=hidden,
        overwrite=True,
        progress=progress,
    )
    return Checkpoint.open(path)


def _distinct_rows(
    ngram: Qwen4ExpHash, prompts: list[list[int]], tokens: list[list[int]], chunk: int = _CHUNK
) -> int:
    """Distinct row ids per lookup, summed over a generation's steps (prefill chunks of `chunk`
    tokens per request, then a token per request a step), hashed again here: a property of the
    prompts and tokens, the same on every tier (no tier sorts repeats out)."""
    fed = [p + t[:-1] for p, t in zip(prompts, tokens, strict=True)]  # every token a step took
    ids = [
        ngram.row_ids(np.array(f), np.array([0, len(f)]), ngram.fresh_context(1))[0] for f in fed
    ]
    steps = [  # [T, heads] row ids per request in the step
        [x[a : min(a + chunk, len(p))] for x, p in zip(ids, prompts, strict=True) if a < len(p)]
        for a in range(0, max(map(len, prompts)), chunk)
    ]
    steps += [
        [x[len(p) + j : len(p) + j + 1] for x, p in zip(ids, prompts, strict=True)]
        for j in range(min(map(len, tokens)) - 1)
    ]
    return sum(np.unique(np.concatenate(step)).size for step in steps)


def run_demo(
    workdir: str | os.PathLike = "plestore-demo",
    format: str = "fp8_e4m3",
    tiers: tuple[str, ...] = TIERS,
    num_prompts: int = 3,
    decode_tokens: int = 64,
    hidden_size: int | None = None,
    device: str | None = None,
    ngram_vocab_size_base: int | None = None,
    progress: bool = False,
    log=print,
    repeats: int = 3,
) -> dict:
    """Run the demo; returns {"rows": [DemoRow...], "checkpoint": ..., "pack": ..., ...}."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    hidden = hidden_size or (2560 if dev.type == "cuda" else 256)
    work = Path(workdir)
    fmt = plestore.get_format(format).name
    log(f"working in {work.resolve()}: a checkpoint and its table, reused by the next run")
    t0 = time.perf_counter()
    ck = _checkpoint(work / f"checkpoint-{fmt}", fmt, hidden, ngram_vocab_size_base, progress)
    log(f"checkpoint: {ck.root} ({ck.nbytes / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f} s)")
    tables = work / f"tables-{fmt}"
    t0 = time.perf_counter()
    pack = pack_checkpoint(ck.root, tables, progress=progress, force=True)  # (its own table)
    log(
        f"table: {tables} ({pack.tables[0].data_bytes / 2**20:.0f} MiB, "
        f"{'reused' if pack.reused else 'packed'}, {time.perf_counter() - t0:.1f} s)"
    )
    weights, prefix = load_ple_weights(ck, layer=1)
    ngram = Qwen4ExpHash.from_hf_config(ck.config)
    cfg = DecoderConfig(
        vocab_size=ngram.spec.vocab_size,
        eos_token_id=ngram.spec.eos_token_id,
        hidden_size=hidden,
        num_heads=max(1, hidden // 64),
        max_seq_len=512,
        max_requests=max(8, num_prompts),
    )
    rng = np.random.default_rng(7)
    prompts = [
        rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(48, 240, num_prompts)
    ]
    rows, resident = [], None
    order = ("device", *[t for t in tiers if t != "device"])
    parts = (cfg, ngram, weights, prefix)
    _warm(order, tables, dev, parts, prompts)
    for tier in order:
        row, res = _tier_row(
            tier, tables, dev, parts, prompts, decode_tokens, repeats, resident, log
        )
        rows.append(row)
        resident = resident or res
    return {
        "device": str(dev),
        "format": fmt,
        "hidden_size": hidden,
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "decode_tokens": decode_tokens,
        "repeats": repeats,
        "checkpoint": str(ck.root),
        "table_dir": str(tables),
        "pack_reused": pack.reused,
        "rows": [asdict(r) for r in rows],
    }


def _warm(tiers, tables, dev, model_parts, prompts) -> None:
    """A short generation on every tier before any is timed: the process's first-use costs
    (kernels, allocator, thread pools, page tables) otherwise fall on the first tier timed."""
    cfg, ngram, weights, prefix = model_parts
    for tier in tiers:
        try:
            table = plestore.open_table(tables, tier=tier, device=str(dev))
        except (OSError, RuntimeError, ValueError):
            continue  # (said where the tier is timed)
        with table:
            model = ReferenceDecoder(cfg, table, ngram, weights, prefix, device=dev)
            model.generate(prompts, 4, chunk_size=_CHUNK)
            del model


def _tier_row(tier, tables, dev, model_parts, prompts, decode_tokens, repeats, resident, log):
    """(the tier's DemoRow, its first timed generation or None): a warm-up of the same shapes,
    then `repeats` timed generations each from cold storage, compared with the resident
    table's (`resident`; None: this is it)."""
    cfg, ngram, weights, prefix = model_parts
    evict(tables)
    try:
        table = plestore.open_table(tables, tier=tier, device=str(dev))
    except (OSError, RuntimeError, ValueError) as e:
        log(f"{tier}: unavailable here ({e})")
        return DemoRow(tier, 0, 0, 0, 0, 0, 0, False, f"unavailable: {e}"), None
    with table:
        model = ReferenceDecoder(cfg, table, ngram, weights, prefix, device=dev)
        model.generate(prompts, decode_tokens, chunk_size=_CHUNK)  # warm-up: the same shapes
        runs, stats = [], None
        for i in range(repeats):
            table.drop_caches()  # every timed run reads a storage tier's rows cold
            table.metrics.reset()
            runs.append(model.generate(prompts, decode_tokens, _CHUNK, keep_logits=i == 0))
            stats = stats or table.stats()  # (one generation's lookups)
        del model
    res = runs[0]
    resident = resident or res
    exact = all(r.tokens == resident.tokens for r in runs) and all(
        torch.equal(a, b) for a, b in zip(res.logits, resident.logits, strict=True)
    )
    prefill = [r.prefill_tokens / r.prefill_s for r in runs]
    decode = [r.decode_tokens / r.decode_s if r.decode_s else 0.0 for r in runs]
    ph = stats["phases"]
    tokens = res.prefill_tokens + res.decode_tokens
    looked = sum(p["rows"] for p in ph.values())
    disk = sum(p["disk_read_bytes"] for p in ph.values())
    log(f"{tier}: done ({'exact' if exact else 'MISMATCH'})")
    row = DemoRow(
        tier,
        statistics.median(prefill),
        statistics.median(decode),
        looked / tokens,
        _distinct_rows(ngram, prompts, res.tokens) / tokens,
        disk / tokens,
        stats["host_bytes"],
        exact,
        prefill_tok_s_runs=prefill,
        decode_tok_s_runs=decode,
    )
    return row, res
