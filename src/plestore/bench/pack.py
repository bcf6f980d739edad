"""Full-size pack throughput, against the disk's own bandwidth measured in the same run.

    plestore bench pack --json                      # H200: 320M-row NVFP4, 26.8 GiB
    plestore bench pack --ngram-vocab-size-base 100000 --json   # a quick small run

Phases (each tool runs in a fresh `python -m plestore` process, so its peak RSS is its own):
1. disk: write N GiB of random bytes + fsync (what pack does), read them back cold (O_DIRECT,
   or buffered after posix_fadvise(DONTNEED) where O_DIRECT is refused), then copy them cold to
   a second file on the same disk (read and write overlapped): the ceiling of any pack whose
   source shares the table's disk.
2. synth the checkpoint (default: the real Qwen3.8-Flash-Next NVFP4 table).
3. pack it cold (checkpoint evicted: pack reads the disk) -> bytes/s vs the disk's write and
   copy rates, and peak RSS; reopen the table (TableFile.open) and re-pack (must say reused);
   then pack again from a warm source (checkpoint in the page cache, as right after a download
   or with the checkpoint on another device) -> vs the write rate alone.
4. with --convert FORMAT: warm packs into FORMAT alternated with plain warm packs (--rounds),
   the conversion's time over the plain pack's beside them (#37's target: at most 3x).

Needs free space for max(disk test, checkpoint + table): ~54 GiB at full size (~77 GiB with
--convert fp8_e4m3). The work directory is deleted at the end unless --keep. `--results FILE`
appends one JSON line.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from plestore.bench.report import machine as _machine
from plestore.io.memory import evict
from plestore.io.streaming import bounded_map
from plestore.io.writeback import WriteBehind
from plestore.spec import preset_config, table_specs_from_hf_config
from plestore.tablefile import TableFile

GiB = 1 << 30
_BUF = 64 << 20


def disk_bandwidth(path: Path, nbytes: int) -> dict:
    """Sequential write + fsync, a cold sequential read, and a cold copy, of `nbytes` at `path`."""
    buf = mmap.mmap(-1, _BUF)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(_BUF))  # incompressible
    nbytes = max(_BUF, nbytes // _BUF * _BUF)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    behind = WriteBehind(fd)  # as pack writes: the disk busy from the first byte
    for off in range(0, nbytes, _BUF):
        os.pwrite(fd, buf, off)
        behind.written(off + _BUF)
    os.fsync(fd)
    write_s = time.perf_counter() - t0
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    try:
        fd, method = os.open(path, os.O_RDONLY | os.O_DIRECT), "O_DIRECT"
    except (OSError, AttributeError):
        fd, method = os.open(path, os.O_RDONLY), "buffered after fadvise(DONTNEED)"
    t0 = time.perf_counter()
    try:
        for off in range(0, nbytes, _BUF):
            os.preadv(fd, [buf], off)
    except OSError:  # O_DIRECT opened but refused on read (some filesystems)
        os.close(fd)
        fd, method = os.open(path, os.O_RDONLY), "buffered after fadvise(DONTNEED)"
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for off in range(0, nbytes, _BUF):
            os.preadv(fd, [buf], off)
    read_s = time.perf_counter() - t0
    os.close(fd)
    copy_s = _copy_cold(path, path.with_suffix(".copy"), nbytes)
    path.unlink()
    return {
        "bytes": nbytes,
        "write_s": write_s,
        "write_bytes_per_s": nbytes / write_s,
        "read_s": read_s,
        "read_bytes_per_s": nbytes / read_s,
        "read_method": method,
        "copy_s": copy_s,
        "copy_bytes_per_s": nbytes / copy_s,
    }


def _copy_cold(src: Path, dst: Path, nbytes: int) -> float:
    """Seconds to copy `src` (evicted first) to `dst` + fsync, reading ahead on 4 threads while
    this one writes with write-behind — the way pack overlaps its reads and writes."""
    evict(src)
    fin = os.open(src, os.O_RDONLY)
    fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def read(off: int) -> np.ndarray:
        buf = np.empty(min(_BUF, nbytes - off), np.uint8)
        os.preadv(fin, [buf], off)
        return buf

    t0 = time.perf_counter()
    behind, off = WriteBehind(fout), 0
    for buf in bounded_map(read, range(0, nbytes, _BUF), threads=4, window=8):
        os.pwrite(fout, buf, off)
        off += buf.size
        behind.written(off)
    os.fsync(fout)
    seconds = time.perf_counter() - t0
    os.close(fin)
    os.close(fout)
    dst.unlink()
    return seconds


def plestore(*args: str, progress: bool) -> tuple[dict, float]:
    """Run `python -m plestore ARGS --json`; returns (its JSON, wall seconds)."""
    cmd = [sys.executable, "-m", "plestore", *args, "--json"]
    if not progress:
        cmd.append("--no-progress")
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out), time.perf_counter() - t0


def machine() -> dict:
    """The shared machine record (CPU, GPU, versions, commit, date) plus memory and kernel."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {**_machine(), "host": platform.node(), "mem_bytes": mem, "kernel": platform.release()}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="plestore bench pack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.8-flash-next")
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument(
        "--ngram-vocab-size-base",
        type=int,
        default=20_000_000,
        help="20000000 = the real 320M-row table (26.8 GiB NVFP4)",
    )
    ap.add_argument("--workdir", default="pack_full_work", help="on the disk to measure")
    ap.add_argument("--disk-test-gib", type=float, help="default: min(4, table size)")
    ap.add_argument("--block-bytes", default="4096", choices=["4096", "512", "0"])
    ap.add_argument("--batch-mib", type=float, default=16)
    ap.add_argument("--threads", type=int, help="default: CPUs, at most 16")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and table")
    ap.add_argument("--convert", metavar="FORMAT", help="also time packs converting to FORMAT")
    ap.add_argument("--rounds", type=int, default=3, help="--convert's alternated rounds")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--results", help="append the JSON result as one line to this file")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    spec = table_specs_from_hf_config(preset_config(a.preset, a.format, a.ngram_vocab_size_base))
    table_bytes = sum(s.nbytes for s in spec)
    converted = sum(s.replace(format=a.convert).nbytes for s in spec) if a.convert else 0
    need = table_bytes + 1.05 * max(table_bytes, converted) + (256 << 20)  # checkpoint + table
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(f"{work}: {free / GiB:.1f} GiB free, this run needs ~{need / GiB:.1f}")
    scale = {
        "preset": a.preset,
        "format": a.format,
        "rows": sum(s.rows for s in spec),
        "ngram_vocab_size_base": a.ngram_vocab_size_base,
        "table_bytes": table_bytes,
    }
    r: dict = {"machine": machine(), "workdir": str(work.resolve()), "scale": scale}
    dd = a.disk_test_gib * GiB if a.disk_test_gib else min(4 * GiB, max(GiB / 2, table_bytes))
    r["disk"] = disk_bandwidth(work / "disk-test.bin", int(dd))
    try:
        _synth_and_pack(a, work, spec[0].name, r)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    if a.results:
        with open(a.results, "a") as f:
            f.write(json.dumps(r) + "\n")
    if a.json:
        json.dump(r, sys.stdout, indent=1)
        print()
    else:
        _print(r)
    return 0


def _synth_and_pack(a: argparse.Namespace, work: Path, table: str, r: dict) -> None:
    """Synthesise the checkpoint, pack it cold, reopen the table, re-pack (reused), pack warm;
    each step's numbers into r."""
    ck, out = work / "checkpoint", work / "tables"
    threads = ["--threads", str(a.threads)] if a.threads else []
    progress = not a.no_progress
    s, wall = plestore(
        "synth",
        str(ck),
        "--preset",
        a.preset,
        "--format",
        a.format,
        "--ngram-vocab-size-base",
        str(a.ngram_vocab_size_base),
        "--force",
        *threads,
        progress=progress,
    )
    r["synth"] = {
        "bytes": s["bytes"],
        "seconds": s["seconds"],
        "wall_s": wall,
        "bytes_per_s": s["throughput_bytes_per_s"],
        "peak_rss_bytes": s["peak_rss_bytes"],
    }
    opts = ["--block-bytes", a.block_bytes, "--batch-mib", str(a.batch_mib), *threads]

    def pack(cold: bool, *more: str) -> dict:
        shutil.rmtree(out, ignore_errors=True)
        if cold:
            evict(ck)
        p, wall = plestore("pack", str(ck), str(out), *opts, *more, progress=progress)
        bps = p["throughput_bytes_per_s"]
        return {
            "bytes_written": p["bytes_written"],
            "seconds": p["seconds"],
            "wall_s": wall,
            "bytes_per_s": bps,
            "vs_disk_write": bps / r["disk"]["write_bytes_per_s"],
            "vs_disk_copy": bps / r["disk"]["copy_bytes_per_s"],
            "peak_rss_bytes": p["peak_rss_bytes"],
            "cold_source": cold,
            "block_bytes": int(a.block_bytes),
            "batch_mib": a.batch_mib,
        }

    r["pack"] = pack(cold=True)
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        TableFile.open(out, table)
    r["reopen_ms"] = (time.perf_counter() - t0) / n * 1e3
    q, wall = plestore("pack", str(ck), str(out), *opts, progress=False)
    r["repack"] = {"reused": q["reused"], "seconds": q["seconds"], "wall_s": wall}
    r["pack_warm"] = pack(cold=False)
    if a.convert:
        r["convert"] = _conversion(a, lambda *more: pack(False, *more))


def _conversion(a: argparse.Namespace, pack) -> dict:
    """Warm packs converting to a.convert, each round beside a plain warm pack."""
    plain, conv = [], []
    for _ in range(a.rounds):
        plain.append(pack())
        conv.append(pack("--format", a.convert))
    ratios = [c["seconds"] / p["seconds"] for p, c in zip(plain, conv, strict=True)]
    return {
        "format": a.convert,
        "plain_seconds": [p["seconds"] for p in plain],
        "seconds": [c["seconds"] for c in conv],
        "ratio_median": float(np.median(ratios)),
        "ratio_range": [min(ratios), max(ratios)],
        "peak_rss_bytes": max(c["peak_rss_bytes"] for c in conv),
        "plain_peak_rss_bytes": max(p["peak_rss_bytes"] for p in plain),
    }


def _print(r: dict) -> None:
    d, s, q = r["disk"], r["synth"], r["repack"]
    gb = 1e9
    print(f"{r['machine']['host']} ({r['machine']['cores']} CPUs), {r['machine']['date']}")
    print(
        f"table: {r['scale']['rows']:,} rows {r['scale']['format']}, "
        f"{r['scale']['table_bytes'] / GiB:.2f} GiB"
    )
    print(
        f"disk:  write+fsync {d['write_bytes_per_s'] / gb:.2f} GB/s, read "
        f"{d['read_bytes_per_s'] / gb:.2f} GB/s ({d['read_method']}), cold copy "
        f"{d['copy_bytes_per_s'] / gb:.2f} GB/s, {d['bytes'] / GiB:.1f} GiB"
    )
    print(
        f"synth: {s['bytes_per_s'] / gb:.2f} GB/s ({s['seconds']:.1f} s), peak RSS "
        f"{s['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
    for p in (r["pack"], r["pack_warm"]):
        print(
            f"pack:  {p['bytes_per_s'] / gb:.2f} GB/s = {p['vs_disk_write']:.0%} of disk write, "
            f"{p['vs_disk_copy']:.0%} of cold copy ({p['seconds']:.1f} s, "
            f"{'cold' if p['cold_source'] else 'warm'} source), peak RSS "
            f"{p['peak_rss_bytes'] / 2**20:.0f} MiB"
        )
    print(
        f"reopen {r['reopen_ms']:.2f} ms; re-pack {'reused' if q['reused'] else 'NOT reused'} "
        f"in {q['seconds']:.3f} s ({q['wall_s']:.2f} s with interpreter start)"
    )
    c = r.get("convert")
    if c:
        lo, hi = c["ratio_range"]
        print(
            f"pack --format {c['format']}: {c['ratio_median']:.2f}x a plain pack's time "
            f"({lo:.2f}-{hi:.2f}x over {len(c['seconds'])} rounds, median "
            f"{np.median(c['seconds']):.2f} vs {np.median(c['plain_seconds']):.2f} s), "
            f"peak RSS {c['peak_rss_bytes'] / 2**20:.0f} vs "
            f"{c['plain_peak_rss_bytes'] / 2**20:.0f} MiB"
        )


if __name__ == "__main__":
    sys.exit(main())
