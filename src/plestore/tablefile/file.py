"""The packed on-disk table: one row-addressable data file plus JSON metadata.

    OUT/<table>.json   metadata: format version, TableSpec, RowLayout, data file name and size,
                       data id, per-chunk CRC32s, source fingerprint. Written last, atomically.
    OUT/<table>.rows   a 4096-byte header (magic, version, data id, data size), then the data
                       region: rows placed by `RowLayout.offsets`, so none straddles a block.
    OUT/<table>.crc    (version 2) the CRC-32 of every block, for `verify_reads` (checksums.py).

Opening validates in O(1): metadata version and spec, the data file's size, and that its header
carries the metadata's data id — so a data file from another or an interrupted pack is refused
rather than read. `verify` recomputes the checksums and names the first bad chunk and rows.
"""

from __future__ import annotations

import copy
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from plestore.formats import get_format
from plestore.io.jsonfile import read_json
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile.checksums import BlockChecks, name_runs, runs
from plestore.tablefile.format import (
    DATA_OFFSET,
    HEADER,
    MAGIC,
    MAX_DATA_BYTES,
    READABLE_VERSIONS,
    TableFileError,
)
from plestore.tablefile.layout import (
    next_offset,
    rows_within,
    unplace,
)

__all__ = [
    "TableFile",
    "VerifyReport",
    "find_tables",
    "no_tables_message",
]


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    chunks: int
    bad_chunks: list[int] = field(default_factory=list)
    first_bad_rows: tuple[int, int] | None = None  # [first, last] rows of the first bad part
    message: str = ""
    bad_blocks: list[int] = field(default_factory=list)  # blocks differing from the .crc sidecar
    blocks: int = 0  # blocks checked against the sidecar (0: format 1 has none)
    bad_runs: list[dict] = field(default_factory=list)  # {"blocks" | "chunks": [a, b], "rows"}


class TableFile:
    """An opened (validated) table file. Holds no file descriptor: tiers open their own."""

    def __init__(self, meta_path: Path, meta: dict) -> None:
        self.meta_path = meta_path
        self.meta = meta
        self.spec = TableSpec.from_dict(meta["spec"])
        self.layout = RowLayout.from_dict(meta["layout"])
        data_file = _field(meta, "data_file", str)
        if Path(data_file).name != data_file or data_file in ("", ".", ".."):
            raise ValueError(f"data_file must name a file beside the metadata, got {data_file!r}")
        self.data_path = meta_path.with_name(data_file)
        self.data_bytes = _field(meta, "data_bytes", int, 0, MAX_DATA_BYTES)
        self.data_id = _field(meta, "data_id", str)
        self.chunk_bytes = _field(meta, "chunk_bytes", int, 1, MAX_DATA_BYTES)
        sums = _field(meta, "checksums", list)
        if len(sums) > -(-MAX_DATA_BYTES // self.chunk_bytes):
            raise ValueError(f"checksums: {len(sums)} entries is more than any table has")
        if not all(isinstance(c, str) and len(c) == 8 for c in sums):
            raise ValueError("checksums must be 8-digit hex strings")
        self.checksums: list[int] = [int(c, 16) for c in sums]
        self.source: dict = meta.get("source") or {}
        if not isinstance(self.source, dict):
            raise ValueError(f"source must be an object, got {type(self.source).__name__}")
        self.version: int = meta["plestore_table"]
        self.block_checks = None  # BlockChecks of a version-2 table (set by _validate)

    # -- open --------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, table: str | None = None) -> TableFile:
        """Open a table by its metadata path, or a directory holding it (`table` picks one)."""
        if not Path(path).exists():
            raise TableFileError(f"{path} does not exist")  # (as inspect says)
        meta_path = _resolve(Path(path), table)
        try:
            meta = read_json(meta_path, f"table metadata {meta_path}")
        except FileNotFoundError:
            raise TableFileError(f"no table metadata at {meta_path}") from None
        except ValueError as e:
            raise TableFileError(str(e)) from None
        if not isinstance(meta, dict):
            raise TableFileError(f"{meta_path}: metadata is not a JSON object")
        if "plestore_table" not in meta:
            raise TableFileError(
                f"{meta_path} is not plestore table metadata (no 'plestore_table' format "
                "version); open a table's .json, its .rows, or the directory holding them"
            )
        version = meta["plestore_table"]
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise TableFileError(
                f"{meta_path}: table format version {version!r}, this plestore reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; re-pack the table"
            )
        try:
            tf = cls(meta_path, meta)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise TableFileError(f"{meta_path}: bad metadata ({e})") from None
        tf._validate()
        return tf

    def with_scale(self, scale: float) -> TableFile:
        """The same file with its rows decoded at another table scale: an engine that computes
        with the stored bytes at another scale (transformers drops an FP8 checkpoint's
        `weight_scale`: 1.0) opens the one table every engine shares. Nothing is written."""
        if not get_format(self.spec.format).has_table_scale:
            raise ValueError(f"table {self.spec.name} is {self.spec.format}: it has no scale")
        other = copy.copy(self)
        other.spec = self.spec.replace(scale=float(scale))
        return other

    def _validate(self) -> None:
        expect = self.layout.data_bytes(self.spec.rows)
        if self.layout.row_bytes != self.spec.row_bytes:
            raise TableFileError(
                f"{self.meta_path}: layout rows of {self.layout.row_bytes} B, spec rows of "
                f"{self.spec.row_bytes} B"
            )
        if self.data_bytes != expect:
            raise TableFileError(
                f"{self.meta_path}: metadata says {self.data_bytes} data bytes, the layout "
                f"needs {expect}"
            )
        if len(self.checksums) != -(-self.data_bytes // self.chunk_bytes):
            raise TableFileError(f"{self.meta_path}: checksum count does not match the data size")
        try:
            size = self.data_path.stat().st_size
            with open(self.data_path, "rb") as f:
                header = f.read(HEADER.size)
        except FileNotFoundError:
            raise TableFileError(f"data file {self.data_path} is missing") from None
        if size != DATA_OFFSET + self.data_bytes:
            raise TableFileError(
                f"data file {self.data_path} is {size} bytes, expected "
                f"{DATA_OFFSET + self.data_bytes} (truncated or from another pack)"
            )
        if len(header) < HEADER.size:
            raise TableFileError(f"data file {self.data_path} has no header")
        magic, version, data_id, nbytes = HEADER.unpack(header)
        if magic != MAGIC or version != self.version:
            raise TableFileError(
                f"{self.data_path} is not a plestore table data file of version {self.version}"
            )
        if data_id.hex() != self.data_id or nbytes != self.data_bytes:
            raise TableFileError(
                f"data file {self.data_path} does not belong to {self.meta_path} (an "
                "interrupted or concurrent pack?); re-run pack"
            )
        if self.version >= 2:
            self.block_checks = BlockChecks.open(self, self.meta.get("block_checksums"))

    # -- rows --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    def row_offsets(self, rows: np.ndarray) -> np.ndarray:
        """Absolute file offsets (int64) of rows: the header plus the layout rule."""
        return DATA_OFFSET + self.layout.offsets(rows)

    def read_rows(self, rows: Any) -> np.ndarray:
        """uint8 [n, row_bytes] of the given rows, with plain buffered preads.

        The simple, obviously-correct reader: tests, verify and small tools use it; the tiers
        are the fast paths.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.spec.rows):
            bad = rows[(rows < 0) | (rows >= self.spec.rows)][0]
            raise IndexError(f"row {bad} is outside table {self.name} [0, {self.spec.rows})")
        rb = self.layout.row_bytes
        out = np.empty((rows.size, rb), dtype=np.uint8)
        fd = os.open(self.data_path, os.O_RDONLY)
        try:
            for i, off in enumerate(self.row_offsets(rows).tolist()):
                got = os.preadv(fd, [memoryview(out[i])], off)
                if got != rb:
                    raise OSError(f"short read of row {rows[i]} from {self.data_path}")
        finally:
            os.close(fd)
        return out

    def read_range(
        self,
        start: int,
        count: int,
        fd: int | None = None,
        drop_cache: bool = False,
        checks: Any = None,
    ) -> np.ndarray:
        """uint8 [count, row_bytes] of rows [start, start+count) with one pread of their span.

        The bulk counterpart of read_rows (verify --against, tests, loading a whole table);
        the inverse of the writer's placement. `fd` reuses an open descriptor; `drop_cache`
        evicts the bytes from the page cache afterwards (POSIX_FADV_DONTNEED), so streaming a
        whole table into pinned or device memory does not also fill the page cache. `checks`
        (BlockChecks) checks every block the rows lie in before they are returned.
        """
        if start < 0 or count < 0 or start + count > self.spec.rows:
            raise IndexError(
                f"rows [{start}, {start + count}) exceed table {self.name} [0, {self.spec.rows})"
            )
        if count == 0:
            return np.empty((0, self.layout.row_bytes), np.uint8)
        own = fd is None
        fd = os.open(self.data_path, os.O_RDONLY) if own else fd
        try:
            return self._rows_of(
                start, count, *self._read_span(start, count, fd), fd, drop_cache, checks
            )
        finally:
            if own:
                os.close(fd)

    def _read_span(self, start: int, count: int, fd: int) -> tuple[int, np.ndarray]:
        """(data-region offset, bytes) of the span rows [start, start+count) lie in: one pread."""
        lo = int(self.layout.offsets(np.array([start]))[0])
        buf = np.empty(next_offset(self.layout, start + count, self.spec.rows) - lo, np.uint8)
        if os.preadv(fd, [memoryview(buf)], DATA_OFFSET + lo) != buf.size:
            raise TableFileError(f"{self.data_path}: short read of rows {start}+{count}")
        return lo, buf

    def _rows_of(self, start, count, lo, buf, fd, drop_cache, checks) -> np.ndarray:
        """read_range's rows from their span's bytes `buf` (read from offset `lo`), checked."""
        if checks is not None:
            checks.check_span(lo, buf, fd)
        if drop_cache:
            os.posix_fadvise(fd, DATA_OFFSET + lo, buf.size, os.POSIX_FADV_DONTNEED)
        return np.ascontiguousarray(unplace(self.layout, buf, start, count))

    def stream(
        self,
        start: int,
        end: int,
        sink: Callable[[int, np.ndarray], None],
        checks: Any = None,
        progress: Callable[[int], None] | None = None,
        chunk_bytes: int = 64 << 20,
    ) -> None:
        """sink(first_row, packed rows [n, row_bytes]) for rows [start, end) read in order, in
        pieces of chunk_bytes (each block checked against `checks` where given), dropped from
        the page cache behind (a 27-48 GiB table loaded into memory must not also fill it);
        progress(bytes) after each piece. A thread reads the next piece while this one is
        checked and sunk (measured: RESULTS.md "GPU row cache: its start")."""
        if not 0 <= start <= end <= self.spec.rows:
            raise IndexError(
                f"rows [{start}, {end}) are not in table {self.name} [0, {self.spec.rows})"
            )
        chunk = max(1, chunk_bytes // self.layout.row_stride)
        pieces = [(a, min(chunk, end - a)) for a in range(start, end, chunk)]
        fd = os.open(self.data_path, os.O_RDONLY)
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="plestore-stream") as reader:
                ahead = reader.submit(self._read_span, *pieces[0], fd) if pieces else None
                for k, (first, n) in enumerate(pieces):
                    span = ahead.result()
                    if k + 1 < len(pieces):
                        ahead = reader.submit(self._read_span, *pieces[k + 1], fd)
                    sink(first, self._rows_of(first, n, *span, fd, True, checks))
                    if progress:
                        progress(n * self.layout.row_bytes)
        finally:
            os.close(fd)

    def chunk_rows(self, chunk: int) -> tuple[int, int]:
        """[first, last] rows with bytes inside checksum chunk `chunk`."""
        lo = chunk * self.chunk_bytes
        return rows_within(
            self.layout, self.spec.rows, lo, min(lo + self.chunk_bytes, self.data_bytes)
        )

    # -- verify ------------------------------------------------------------------------------
    def verify(
        self, threads: int = 8, progress: Callable[[int], None] | None = None
    ) -> VerifyReport:
        """Recompute every chunk's CRC32 (parallel preads) and compare with the metadata; and,
        from the same reads, every block's CRC-32 with the .crc sidecar (format 2). Names every
        bad block (or, without a sidecar, chunk) and its rows."""
        n, bc = len(self.checksums), self.block_checks
        bad_blocks: list[np.ndarray] = []
        fd = os.open(self.data_path, os.O_RDONLY)
        try:

            def crc(i: int) -> int:
                lo = i * self.chunk_bytes
                size = min(self.chunk_bytes, self.data_bytes - lo)
                data = os.pread(fd, size, DATA_OFFSET + lo)
                if len(data) != size:
                    raise TableFileError(f"{self.data_path}: short read in chunk {i}")
                if bc is not None:  # chunks are whole blocks (chunk_bytes: multiples of 4096)
                    bad_blocks.append(bc.bad_blocks(lo, data))
                if progress:
                    progress(size)
                return zlib.crc32(data)

            with ThreadPoolExecutor(max(1, threads)) as pool:
                got = list(pool.map(crc, range(n)))
        finally:
            os.close(fd)
        bad = [i for i in range(n) if got[i] != self.checksums[i]]
        blocks = sorted(np.concatenate(bad_blocks).tolist()) if bad_blocks else []
        count = 0 if bc is None else bc.count
        if not bad and not blocks:
            size = self.chunk_bytes
            size = f"{size >> 20} MiB" if size % (1 << 20) == 0 else f"{size:,} B"
            checked = f"{n:,} chunk CRC32s ({size} chunks)" + (
                f" and {count:,} block CRC-32s ({bc.unit}-B blocks, the .crc sidecar)" if bc else ""
            )
            message = f"all {self.spec.rows:,} rows: {checked} match"
            return VerifyReport(True, n, message=message, blocks=count)
        if blocks:  # the precise unit: name every bad block
            found = [
                {"blocks": [a, b], "rows": [bc.rows_of(a)[0], bc.rows_of(b)[1]]}
                for a, b in runs(blocks)
            ]
            what = f"{len(blocks):,} of {count:,} blocks differ from the .crc sidecar"
            if not bad:
                what += f" while all {n:,} chunks match: the .crc file is damaged; re-pack"
        else:  # no sidecar (format 1), or the sidecar holds what the metadata does not
            found = [
                {"chunks": [a, b], "rows": [self.chunk_rows(a)[0], self.chunk_rows(b)[1]]}
                for a, b in runs(bad)
            ]
            what = f"{len(bad):,} of {n:,} chunks differ from their CRC32s"
            if bc is not None:
                what += " while every block matches the .crc sidecar: the metadata is damaged"
        message = f"{what}: " + name_runs(found)
        first = tuple(found[0]["rows"])
        return VerifyReport(False, n, bad, first, message, blocks, count, found)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "metadata": str(self.meta_path),
            "data_file": str(self.data_path),
            "spec": self.spec.to_dict(),
            "layout": self.layout.to_dict(),
            "data_bytes": self.data_bytes,
            "chunk_bytes": self.chunk_bytes,
            "chunks": len(self.checksums),
            "format_version": self.version,
            "block_checksums": (
                {"unit": self.block_checks.unit, "count": self.block_checks.count}
                if self.block_checks is not None
                else None
            ),
            "source_fingerprint": self.source.get("fingerprint"),
        }


def _field(meta: dict, key: str, kind: type, lo: int | None = None, hi: int | None = None):
    """meta[key], of exactly `kind` (an int is no bool), within [lo, hi]."""
    if key not in meta:
        raise ValueError(f"metadata lacks {key!r}")
    v = meta[key]
    if type(v) is not kind:
        raise ValueError(f"{key} must be a {kind.__name__}, got {v!r}"[:200])
    if lo is not None and not lo <= v <= hi:
        raise ValueError(f"{key} must be in [{lo}, {hi}], got {v}")
    return v


def _resolve(path: Path, table: str | None) -> Path:
    if path.is_dir():
        metas = find_tables(path)
        if not metas:
            raise TableFileError(no_tables_message(path))
        if table is not None:
            match = [m for m in metas if m.name == f"{table}.json"]
            if not match:
                names = ", ".join(m.name[:-5] for m in metas)
                raise TableFileError(f"{path} holds no table {table!r} (tables: {names})")
            return match[0]
        if len(metas) != 1:
            names = ", ".join(m.name[:-5] for m in metas)
            raise TableFileError(f"{path} holds tables [{names}]; name one (table=...)")
        return metas[0]
    if path.suffix == ".rows":
        return path.with_suffix(".json")
    return path


def no_tables_message(path: Path) -> str:
    """Why a directory opens no table, and the command that makes one."""
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return (
            f"{path} is a checkpoint (config.json + safetensors), not a directory of packed "
            f"tables: pack it once with `plestore pack {path} TABLES` and open TABLES"
        )
    return (
        f"{path} holds no packed tables (no <table>.json); pack a checkpoint into it with "
        f"`plestore pack CHECKPOINT {path}`"
    )


def find_tables(directory: str | os.PathLike) -> list[Path]:
    """Metadata files of the tables in a directory (by their version key, not their name)."""
    out = []
    for p in sorted(Path(directory).glob("*.json")):
        try:
            if read_json(p).get("plestore_table") is not None:
                out.append(p)
        except (OSError, ValueError, AttributeError):
            continue
    return out
