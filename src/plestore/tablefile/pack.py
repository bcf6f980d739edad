"""Checkpoint -> table files, streaming with bounded memory, atomic, and reused when unchanged.

    pack_checkpoint(checkpoint, out)   every detected table -> out/<table>.json + .rows

Rows move in batches (default 16 MiB): worker threads read a batch from the checkpoint shards
(pread of exactly its bytes), optionally convert it to another format (`convert.py`), hash it,
lay it out and checksum it (`TableWriter.prepare`); the calling thread only
appends batches in row order. At most `window` batches are in flight, each in its own slot of
preallocated buffers (INFLIGHT_BYTES of them: 512 MiB), so peak memory depends on neither the
table size nor the thread count.

Atomic: the data goes to a temporary file and becomes visible at commit (see `TableWriter`); a
killed pack leaves nothing that opens, and the rerun deletes its leftovers and starts over.
Reuse: a table whose stored source fingerprint (O(headers), see `SourceTable`) and pack options
match, and which opens, is not rewritten — pack returns at once.
"""

from __future__ import annotations

import hashlib
import math
import os
import queue
import time
from contextlib import closing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from plestore.checkpoint import Checkpoint, CheckpointError, SourceTable, detect_tables
from plestore.formats import get_format
from plestore.io.odirect import FALLBACK_BLOCK_BYTES, directory_block_bytes
from plestore.io.streaming import bounded_map, default_threads, peak_rss_bytes, progress_bar
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile import (
    TableFile,
    TableFileError,
    TableWriter,
    find_tables,
    place_bytes,
    remove_stale_temps,
)
from plestore.tablefile.convert import Conversion, ErrorSum, scale_from_amax
from plestore.tablefile.packlock import pack_lock
from plestore.tablefile.reuse import (
    foreign_table,
    refuse_foreign,
    replaced_options,
    reusable,
    reusable_table,
)

__all__ = [
    "DEFAULT_BATCH_BYTES",
    "DEFAULT_BLOCK_BYTES",
    "PACK_LOCK_TIMEOUT_S",
    "foreign_table",
    "PackReport",
    "TablePackReport",
    "pack_checkpoint",
    "plan_batches",
    "renamed",
    "reusable",
]

#: Source bytes per batch: keeps 15 workers busy inside INFLIGHT_BYTES (`bench pack
#: --batch-mib` varies it). measured: RESULTS.md "pack" (a worker's time per batch)
DEFAULT_BATCH_BYTES = 16 << 20
#: Bytes of batches in flight (the peak-RSS budget, with the interpreter's ~60 MB on top).
INFLIGHT_BYTES = 512 << 20
#: Bytes per block of a new table where its directory's disk cannot be probed; elsewhere a new
#: table gets the smallest O_DIRECT read there (io/odirect.py), unless the caller chooses
DEFAULT_BLOCK_BYTES = FALLBACK_BLOCK_BYTES
#: Seconds a pack waits for another process's pack into the same directory to make progress.
PACK_LOCK_TIMEOUT_S = 600.0


@dataclass
class TablePackReport:
    name: str
    path: str
    rows: int
    format: str
    source_format: str
    scale: float
    block_bytes: int
    reused: bool
    fingerprint: str
    data_bytes: int = 0  # bytes of the table's data region (written unless reused)
    source_bytes: int = 0  # bytes read from the checkpoint
    seconds: float = 0.0
    encode_error: dict | None = None  # converted tables: EncodeError over every value
    removed_temps: int = 0  # leftovers of an interrupted pack deleted first
    block_reason: str = ""  # why this block size: chosen by the caller, or probed
    replaced: dict | None = None  # option -> [old, new] of a table of this source replaced

    @property
    def throughput(self) -> float | None:
        return None if self.reused or not self.seconds else self.data_bytes / self.seconds


@dataclass
class PackReport:
    checkpoint: str
    out: str
    tables: list[TablePackReport] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_bytes: int = 0

    @property
    def reused(self) -> bool:
        return bool(self.tables) and all(t.reused for t in self.tables)

    @property
    def bytes_written(self) -> int:
        return sum(t.data_bytes for t in self.tables if not t.reused)

    def to_dict(self) -> dict:
        tables = [{**asdict(t), "throughput_bytes_per_s": t.throughput} for t in self.tables]
        secs = sum(t.seconds for t in self.tables if not t.reused)
        return {
            "checkpoint": self.checkpoint,
            "out": self.out,
            "reused": self.reused,
            "bytes_written": self.bytes_written,
            "seconds": self.seconds,
            "throughput_bytes_per_s": self.bytes_written / secs if secs else None,
            "peak_rss_bytes": self.peak_rss_bytes,
            "tables": tables,
        }


def pack_checkpoint(
    checkpoint: str | os.PathLike | Checkpoint,
    out: str | os.PathLike,
    format: str | None = None,
    block_bytes: int | None = None,
    table: str | list[str] | None = None,
    scale: float | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    threads: int | None = None,
    progress: bool = False,
    lock_timeout_s: float = PACK_LOCK_TIMEOUT_S,
    force: bool = False,
    names: dict[str, str] | None = None,
) -> PackReport:
    """Pack every table of `checkpoint` (or those named by `table`) into directory `out`.

    `format` converts (e.g. bf16/fp8 -> nvfp4) with table scale `scale`, or one computed from
    max |x| in a first pass; None keeps the checkpoint's format, byte for byte (`scale` then
    replaces the stored table scale: transformers loads fp8 PLE rows without theirs, i.e. 1.0).
    One process packs into `out` at a time; the others wait while it makes progress (at most
    `lock_timeout_s` without any, see packlock.py), then find its tables reusable. A table in
    `out` packed from another checkpoint (another source fingerprint) is refused, before
    anything is written, unless `force`; one of this checkpoint is replaced when the options
    differ (`replaced` in its report says which). `block_bytes=None` reuses a table of any block
    size, and gives a new one the smallest O_DIRECT read of `out`'s disk (512 B on most:
    `directory_block_bytes`; DEFAULT_BLOCK_BYTES where none works); `names` packs a table
    under another name (`{"ple.layers.1": "ple.layers.1.bf16"}`: a conversion beside the
    source-format table, not over it).
    """
    t0 = time.perf_counter()
    own = not isinstance(checkpoint, Checkpoint)
    try:
        ck = Checkpoint.open(checkpoint) if own else checkpoint
    except CheckpointError:
        if Path(checkpoint).is_dir() and find_tables(checkpoint):
            raise TableFileError(
                f"{checkpoint} holds packed tables, not a checkpoint: pack reads a checkpoint "
                "(config.json + safetensors); these tables open as they are (plestore "
                "inspect, plestore.open_table)"
            ) from None
        raise
    try:
        sources = [renamed(s, (names or {}).get(s.name)) for s in _select(detect_tables(ck), table)]
        out = Path(out)
        _check_writable(out)
        report = PackReport(str(ck.root), str(out))
        with pack_lock(out, lock_timeout_s):
            if not force:  # under the lock: a pack that held it may have just written a table
                refuse_foreign(out, sources)
            for src in sources:
                opts = _options(src, format, block_bytes, scale)
                report.tables.append(
                    _pack_one(src, out, opts, batch_bytes, threads or default_threads(), progress)
                )
    finally:
        if own:
            ck.close()
    report.seconds = time.perf_counter() - t0
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def _select(sources: list[SourceTable], table: str | list[str] | None) -> list[SourceTable]:
    if table is None:
        return sources
    wanted = [table] if isinstance(table, str) else list(table)
    unknown = [w for w in wanted if w not in {s.name for s in sources}]
    if unknown:
        names = ", ".join(s.name for s in sources)
        raise ValueError(f"checkpoint has no table {unknown[0]!r} (tables: {names})")
    return [s for s in sources if s.name in wanted]


def renamed(src: SourceTable, name: str | None) -> SourceTable:
    """src packed under `name` (its fingerprint stays the source's)."""
    return src if name is None else replace(src, spec=src.spec.replace(name=name))


def _options(
    src: SourceTable, format: str | None, block_bytes: int | None, scale: float | None
) -> dict:
    """The pack options a table is reused for (with the source fingerprint); block_bytes None:
    any."""
    return {
        "format": get_format(format or src.spec.format).name,
        "block_bytes": block_bytes,
        "scale": None if scale is None else float(scale),
    }


def _pack_one(
    src: SourceTable, out: Path, opts: dict, batch_bytes: int, threads: int, progress: bool
) -> TablePackReport:
    t0 = time.perf_counter()
    rep = TablePackReport(
        src.name,
        str(out / f"{src.name}.json"),
        src.spec.rows,
        opts["format"],
        src.spec.format,
        src.spec.scale,
        opts["block_bytes"],
        False,
        src.fingerprint,
    )
    old = reusable_table(out, src, opts)
    if old is not None:
        rep.reused, rep.scale, rep.data_bytes = True, old.spec.scale, old.data_bytes
        rep.encode_error = old.source.get("encode_error")
        rep.block_bytes = old.source["options"]["block_bytes"]
    else:
        rep.block_reason = "chosen"
        if opts["block_bytes"] is None:  # any: a new table gets the disk's best
            block, rep.block_reason = directory_block_bytes(out)
            opts = {**opts, "block_bytes": block}
        rep.block_bytes = opts["block_bytes"]
        rep.replaced = replaced_options(out, src, opts)
        rep.removed_temps = len(remove_stale_temps(out, src.name))
        spec = _target_spec(src, opts, batch_bytes, threads, progress)
        conv = Conversion(src.spec, spec) if spec.format != src.spec.format else None
        tf = _write_table(src, spec, conv, out, opts, batch_bytes, threads, progress)
        rep.scale, rep.data_bytes = spec.scale, tf.data_bytes
        rep.encode_error = tf.source.get("encode_error")
        first = conv is not None and conv.fmt.has_table_scale and opts["scale"] is None
        rep.source_bytes = src.spec.nbytes * (2 if first else 1)
    rep.seconds = time.perf_counter() - t0
    return rep


def _target_spec(
    src: SourceTable, opts: dict, batch_bytes: int, threads: int, progress: bool
) -> TableSpec:
    """The table's spec after conversion: target format, and its table scale (given, or from
    a first pass over max |x|)."""
    if opts["format"] == src.spec.format:
        if opts["scale"] is not None and get_format(src.spec.format).has_table_scale:
            return src.spec.replace(scale=opts["scale"])  # the bytes as stored, another scale
        return src.spec
    tgt = get_format(opts["format"])
    scale = opts["scale"] if tgt.has_table_scale else 1.0
    if scale is None:
        scale = scale_from_amax(src, tgt, batch_bytes, threads, progress)
    return src.spec.replace(format=tgt.name, scale=scale)


def _write_table(
    src: SourceTable,
    spec: TableSpec,
    conv: Conversion | None,
    out: Path,
    opts: dict,
    batch_bytes: int,
    threads: int,
    progress: bool,
) -> TableFile:
    """Stream the rows through a TableWriter (see the module doc) and commit."""
    layout = RowLayout(spec.row_bytes, block_bytes=opts["block_bytes"])
    values = conv.batch_values if conv else None
    rows_per_batch, chunk = plan_batches(src.spec, layout, batch_bytes, values)
    split = any(len(seg.parts) > 1 for seg in src.segments)  # NVFP4: codes + scales
    part_bytes = max(p.row_bytes for seg in src.segments for p in seg.parts) if split else 0
    slot_bytes = rows_per_batch * (src.spec.row_bytes + part_bytes) + place_bytes(
        layout, rows_per_batch
    )
    if conv:
        slot_bytes += rows_per_batch * spec.dim * conv.bytes_per_value  # its temporaries
    window = max(2, min(2 * threads, INFLIGHT_BYTES // slot_bytes))
    # Each batch in flight owns one slot of preallocated buffers (read, part scratch, laid-out
    # bytes) until the writer has written it, so memory is `window` slots whatever the threads:
    # fresh 16 MiB arrays per batch let glibc's per-thread arenas keep ~1.4 GiB on 16 cores.
    free = queue.SimpleQueue()
    for _ in range(window):
        free.put(_Slot(rows_per_batch, src.spec.row_bytes, part_bytes, layout, conv))
    source = _source_record(src, opts)
    digests, err = [], ErrorSum()

    def work(a: int):
        n = min(rows_per_batch, spec.rows - a)
        slot = free.get_nowait()  # never empty: at most `window` batches are unconsumed
        raw = src.read_rows(a, n, out=slot.raw[:n], scratch=slot.scratch)
        digest = hashlib.sha256(raw).digest()
        rows, stats = conv(raw, slot.converted) if conv else (raw, None)
        return slot, w.prepare(rows, a, out=slot.placed), digest, stats

    starts = range(0, spec.rows, rows_per_batch)
    try:
        with (
            TableWriter(out, spec, layout, source, chunk) as w,
            progress_bar(w.data_bytes, f"pack {src.name}", progress) as bar,
            closing(bounded_map(work, starts, threads, window)) as batches,
        ):
            for slot, p, digest, stats in batches:
                w.write_prepared(p)
                free.put(slot)
                digests.append(digest)
                if stats is not None:
                    err.add(stats)
                bar.update(p.data.size)
            whole = hashlib.sha256(b"".join(digests)).hexdigest()
            source["rows_sha256"] = {"batch_rows": rows_per_batch, "hex": whole}
            if conv:
                source["encode_error"] = asdict(err.result())
            return w.commit()
    except OSError as e:
        raise OSError(
            e.errno,
            f"{e.strerror or e} while packing table {src.name} into {out} (nothing was committed)",
        ) from e


class _Slot:
    """The buffers of one batch in flight (see _write_table)."""

    def __init__(self, rows: int, row_bytes: int, part_bytes: int, layout: RowLayout, conv):
        self.raw = np.empty((rows, row_bytes), np.uint8)  # [rows, source row bytes]
        self.scratch = np.empty(rows * part_bytes, np.uint8)  # one part of split rows
        self.placed = np.empty(place_bytes(layout, rows), np.uint8)  # laid-out data region
        self.converted = np.empty((rows, layout.row_bytes) if conv else 0, np.uint8)


def plan_batches(
    src: TableSpec, layout: RowLayout, batch_bytes: int, batch_values: int | None = None
) -> tuple[int, int]:
    """(rows per batch, checksum chunk bytes): `batch_bytes` of source rows, at most
    `batch_values` values (a conversion's). Batches are whole blocks and end on a 4 KiB
    multiple of the data region, and the chunk is a whole number of batches, so every batch's
    CRC pieces are whole chunks or chunk starts (a combine is one cached matrix product)."""
    rows = max(1, batch_bytes // src.row_bytes)
    if batch_values is not None:
        rows = min(rows, max(1, batch_values // src.dim))
    if layout.rows_per_block:
        unit = layout.rows_per_block * (4096 // math.gcd(layout.block_bytes, 4096))
    else:
        pitch = layout.row_stride if layout.block_bytes == 0 else layout.row_span
        unit = 4096 // math.gcd(pitch, 4096)
    rows = max(unit, rows // unit * unit)
    per = layout.data_bytes(rows)
    return rows, per * max(1, (64 << 20) // per)


def _source_record(src: SourceTable, opts: dict) -> dict:
    """What the table file remembers of its source: the fingerprint and options decide reuse;
    the rest (tensors, files, format, scale; rows_sha256 added at the end) is for people."""
    return {
        "fingerprint": src.fingerprint,
        "options": opts,
        "checkpoint": str(src.checkpoint.root),
        "tensors": [t.describe() for t in src.tensors],
        "files": src.checkpoint.file_stats(list(src.tensors)),
        "source_format": src.spec.format,
        "source_scale": src.spec.scale,
    }


def _check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"output {out} is a file: pack writes <table>.json, .rows and .crc into a directory; "
            "name a new or existing directory"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".plestore-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OSError(e.errno, f"output directory {out} is not writable: {e.strerror or e}") from e
