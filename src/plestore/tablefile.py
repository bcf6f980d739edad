"""The packed on-disk table: one row-addressable data file plus JSON metadata.

    OUT/<table>.json   metadata: format version, TableSpec, RowLayout, data file name and size,
                       data id, per-chunk CRC32s, source fingerprint. Written last, atomically.
    OUT/<table>.rows   a 4096-byte header (magic, version, data id, data size), then the data
                       region: rows placed by `RowLayout.offsets`, so none straddles a block.

Opening validates in O(1): metadata version and spec, the data file's size, and that its header
carries the metadata's data id — so a data file from another or an interrupted pack is refused
rather than read. `verify` recomputes the checksums and names the first bad chunk and rows.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from plestore.io.writeback import WriteBehind
from plestore.spec import RowLayout, TableSpec

__all__ = [
    "DATA_OFFSET",
    "FORMAT_VERSION",
    "PreparedRows",
    "TableFile",
    "TableFileError",
    "TableWriter",
    "VerifyReport",
    "crc32_combine",
    "find_tables",
    "fsync_dir",
    "place_bytes",
    "remove_stale_temps",
]

FORMAT_VERSION = 1
MAGIC = b"PLESTORE-TABLE\0\0"  # 16 bytes
DATA_OFFSET = 4096  # the header's size: keeps the data region block-aligned for O_DIRECT
DEFAULT_CHUNK_BYTES = 64 << 20
_HEADER = struct.Struct("<16sI16sQ")  # magic, version, data id, data bytes


class TableFileError(ValueError):
    """A table file is missing, corrupt, incomplete or does not match what was expected."""


def _data_name(meta_path: Path) -> str:
    return meta_path.name[: -len(".json")] + ".rows"


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    chunks: int
    bad_chunks: list[int] = field(default_factory=list)
    first_bad_rows: tuple[int, int] | None = None  # [first, last] rows touching the first bad chunk
    message: str = ""


class TableFile:
    """An opened (validated) table file. Holds no file descriptor: tiers open their own."""

    def __init__(self, meta_path: Path, meta: dict) -> None:
        self.meta_path = meta_path
        self.meta = meta
        self.spec = TableSpec.from_dict(meta["spec"])
        self.layout = RowLayout.from_dict(meta["layout"])
        self.data_path = meta_path.with_name(meta["data_file"])
        self.data_bytes = int(meta["data_bytes"])
        self.data_id = meta["data_id"]
        self.chunk_bytes = int(meta["chunk_bytes"])
        self.checksums: list[int] = [int(c, 16) for c in meta["checksums"]]
        self.source: dict = meta.get("source") or {}

    # -- open --------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, table: str | None = None) -> TableFile:
        """Open a table by its metadata path, or a directory holding it (`table` picks one)."""
        meta_path = _resolve(Path(path), table)
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise TableFileError(f"no table metadata at {meta_path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TableFileError(f"{meta_path}: metadata is not valid JSON ({e})") from None
        if meta.get("plestore_table") != FORMAT_VERSION:
            raise TableFileError(
                f"{meta_path}: table format version {meta.get('plestore_table')!r}, this "
                f"plestore reads version {FORMAT_VERSION}; re-pack the table"
            )
        try:
            tf = cls(meta_path, meta)
        except (KeyError, TypeError, ValueError) as e:
            raise TableFileError(f"{meta_path}: bad metadata ({e})") from None
        tf._validate()
        return tf

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
                header = f.read(_HEADER.size)
        except FileNotFoundError:
            raise TableFileError(f"data file {self.data_path} is missing") from None
        if size != DATA_OFFSET + self.data_bytes:
            raise TableFileError(
                f"data file {self.data_path} is {size} bytes, expected "
                f"{DATA_OFFSET + self.data_bytes} (truncated or from another pack)"
            )
        if len(header) < _HEADER.size:
            raise TableFileError(f"data file {self.data_path} has no header")
        magic, version, data_id, nbytes = _HEADER.unpack(header)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise TableFileError(f"{self.data_path} is not a plestore table data file")
        if data_id.hex() != self.data_id or nbytes != self.data_bytes:
            raise TableFileError(
                f"data file {self.data_path} does not belong to {self.meta_path} (an "
                "interrupted or concurrent pack?); re-run pack"
            )

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
        self, start: int, count: int, fd: int | None = None, drop_cache: bool = False
    ) -> np.ndarray:
        """uint8 [count, row_bytes] of rows [start, start+count) with one pread of their span.

        The bulk counterpart of read_rows (verify --against, tests, loading a whole table);
        the inverse of the writer's placement. `fd` reuses an open descriptor; `drop_cache`
        evicts the bytes from the page cache afterwards (POSIX_FADV_DONTNEED), so streaming a
        whole table into pinned or device memory does not also fill the page cache.
        """
        if start < 0 or count < 0 or start + count > self.spec.rows:
            raise IndexError(
                f"rows [{start}, {start + count}) exceed table {self.name} [0, {self.spec.rows})"
            )
        rb, lay = self.layout.row_bytes, self.layout
        if count == 0:
            return np.empty((0, rb), np.uint8)
        lo = int(lay.offsets(np.array([start]))[0])
        hi = _next_offset(lay, start + count, self.spec.rows)
        buf = np.empty(hi - lo, np.uint8)
        own = fd is None
        fd = os.open(self.data_path, os.O_RDONLY) if own else fd
        try:
            if os.preadv(fd, [memoryview(buf)], DATA_OFFSET + lo) != buf.size:
                raise TableFileError(f"{self.data_path}: short read of rows {start}+{count}")
            if drop_cache:
                os.posix_fadvise(fd, DATA_OFFSET + lo, buf.size, os.POSIX_FADV_DONTNEED)
        finally:
            if own:
                os.close(fd)
        return np.ascontiguousarray(_unplace(lay, buf, start, count))

    def chunk_rows(self, chunk: int) -> tuple[int, int]:
        """[first, last] rows with bytes inside checksum chunk `chunk`."""
        lo = chunk * self.chunk_bytes
        hi = min(lo + self.chunk_bytes, self.data_bytes) - 1
        first = _first_row_ending_after(self.layout, self.spec.rows, lo)
        last = _last_row_starting_before(self.layout, self.spec.rows, hi)
        return first, last

    # -- verify ------------------------------------------------------------------------------
    def verify(
        self, threads: int = 8, progress: Callable[[int], None] | None = None
    ) -> VerifyReport:
        """Recompute every chunk's CRC32 (parallel preads) and compare with the metadata."""
        n = len(self.checksums)
        fd = os.open(self.data_path, os.O_RDONLY)
        try:

            def crc(i: int) -> int:
                lo = i * self.chunk_bytes
                size = min(self.chunk_bytes, self.data_bytes - lo)
                data = os.pread(fd, size, DATA_OFFSET + lo)
                if len(data) != size:
                    raise TableFileError(f"{self.data_path}: short read in chunk {i}")
                if progress:
                    progress(size)
                return zlib.crc32(data)

            with ThreadPoolExecutor(max(1, threads)) as pool:
                got = list(pool.map(crc, range(n)))
        finally:
            os.close(fd)
        bad = [i for i in range(n) if got[i] != self.checksums[i]]
        if not bad:
            return VerifyReport(True, n, message=f"all {n} chunks match")
        rows = self.chunk_rows(bad[0])
        return VerifyReport(
            False,
            n,
            bad,
            rows,
            f"{len(bad)} of {n} chunks differ; first bad chunk {bad[0]} holds rows "
            f"{rows[0]}..{rows[1]}",
        )

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
            "source_fingerprint": self.source.get("fingerprint"),
        }


def _next_offset(layout: RowLayout, row: int, total_rows: int) -> int:
    """Data-region offset where row `row` starts, or the data end when row == total_rows."""
    if row >= total_rows:
        return layout.data_bytes(total_rows)
    return int(layout.offsets(np.array([row]))[0])


def _place(
    layout: RowLayout, rows: np.ndarray, first: int, total_rows: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Lay rows [first, first+n) out as the data region bytes from the first row's offset up to
    the next row's offset (or the data end): block padding included, so consecutive batches
    abut and every byte of the data region belongs to exactly one batch. `out` (uint8, at least
    `place_bytes` long) is used instead of a new buffer."""
    n, rb = rows.shape
    rpb = layout.rows_per_block
    end = _next_offset(layout, first + n, total_rows)
    start = _next_offset(layout, first, total_rows)
    if rpb == 0:  # unblocked, or one row per whole-block span
        pitch = layout.row_stride if layout.block_bytes == 0 else layout.row_span
        if pitch == rb:
            return rows.reshape(-1)  # back to back: the rows are the bytes
        buf = _zeros(n * pitch, out).reshape(n, pitch)  # [n, pitch]
        buf[:, :rb] = rows
        return buf.reshape(-1)[: end - start]
    b0 = first // rpb
    nb = -(-(end - b0 * layout.block_bytes) // layout.block_bytes)
    blocks = _zeros(nb * layout.block_bytes, out).reshape(nb, -1)  # [blocks, block_bytes]
    grid = blocks[:, : rpb * layout.row_stride].reshape(nb, rpb, layout.row_stride)  # view
    p0 = first - b0 * rpb  # slot of the first row within block b0
    h = min(n, rpb - p0)  # rows in the (partial) head block
    grid[0, p0 : p0 + h, :rb] = rows[:h]
    m = (n - h) // rpb  # full blocks
    grid[1 : 1 + m, :, :rb] = rows[h : h + m * rpb].reshape(m, rpb, rb)
    t = n - h - m * rpb  # rows in the tail block
    if t:
        grid[1 + m, :t, :rb] = rows[h + m * rpb :]
    lo = start - b0 * layout.block_bytes
    return blocks.reshape(-1)[lo : lo + end - start]


def place_bytes(layout: RowLayout, rows: int) -> int:
    """The most bytes `_place` lays out for `rows` rows starting anywhere (its `out` size)."""
    if layout.rows_per_block == 0:
        pitch = layout.row_stride if layout.block_bytes == 0 else layout.row_span
        return rows * pitch
    return (-(-rows // layout.rows_per_block) + 1) * layout.block_bytes


def _zeros(size: int, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.zeros(size, np.uint8)
    if out.size < size:
        raise ValueError(f"layout buffer holds {out.size} bytes, {size} needed")
    buf = out[:size]
    buf.fill(0)
    return buf


def _unplace(layout: RowLayout, buf: np.ndarray, first: int, n: int) -> np.ndarray:
    """Inverse of _place: [n, row_bytes] view of rows [first, first+n) in buf, which holds the
    data region from row `first`'s offset to at least the last row's end."""
    rb, rpb = layout.row_bytes, layout.rows_per_block
    if rpb == 0:
        pitch = layout.row_stride if layout.block_bytes == 0 else layout.row_span
        full = np.zeros(n * pitch, np.uint8)
        full[: buf.size] = buf[: n * pitch]
        return full.reshape(n, pitch)[:, :rb]
    b0 = first // rpb
    lo = (first - b0 * rpb) * layout.row_stride
    nb = -(-(lo + buf.size) // layout.block_bytes)
    blocks = np.zeros(nb * layout.block_bytes, np.uint8)
    blocks[lo : lo + buf.size] = buf
    grid = blocks.reshape(nb, layout.block_bytes)[:, : rpb * layout.row_stride]
    slots = grid.reshape(nb, rpb, layout.row_stride).reshape(nb * rpb, layout.row_stride)
    p0 = first - b0 * rpb
    return slots[p0 : p0 + n, :rb]


@dataclass(frozen=True)
class PreparedRows:
    """Rows laid out and checksummed, ready for `TableWriter.write_prepared` (see prepare)."""

    first_row: int
    num_rows: int
    start: int  # data-region offset of data[0]
    data: np.ndarray  # uint8, the data region bytes [start, start + data.size)
    pieces: tuple[tuple[int, int], ...]  # (length, crc32) split at checksum-chunk boundaries


def _crc_pieces(data: np.ndarray, start: int, chunk_bytes: int) -> tuple[tuple[int, int], ...]:
    out, pos, view = [], start, memoryview(data)
    while len(view):
        room = chunk_bytes - pos % chunk_bytes
        part, view = view[:room], view[room:]
        out.append((len(part), zlib.crc32(part)))
        pos += len(part)
    return tuple(out)


def _gf2_times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B) (zlib's crc32_combine, which Python's zlib
    does not expose). Lets workers checksum their own rows in parallel.

    CRC-32 is linear over GF(2): appending len2 zero bytes to A is a 32x32 bit matrix applied to
    crc(A); square-and-multiply builds that matrix from the one-zero-byte operator."""
    op = [0xEDB88320] + [1 << (n - 1) for n in range(1, 32)]  # append one zero bit
    for _ in range(3):
        op = [_gf2_times(op, v) for v in op]  # 2, 4, 8 bits: one zero byte
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(op, crc1)
        len2 >>= 1
        if len2:
            op = [_gf2_times(op, v) for v in op]  # twice as many zero bytes
    return crc1 ^ crc2


def _first_row_ending_after(layout: RowLayout, rows: int, byte: int) -> int:
    lo, hi = 0, rows - 1
    while lo < hi:  # smallest row whose last byte >= byte
        mid = (lo + hi) // 2
        if int(layout.offsets(np.array([mid]))[0]) + layout.row_bytes - 1 >= byte:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _last_row_starting_before(layout: RowLayout, rows: int, byte: int) -> int:
    lo, hi = 0, rows - 1
    while lo < hi:  # largest row whose first byte <= byte
        mid = (lo + hi + 1) // 2
        if int(layout.offsets(np.array([mid]))[0]) <= byte:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _resolve(path: Path, table: str | None) -> Path:
    if path.is_dir():
        metas = find_tables(path)
        if table is not None:
            match = [m for m in metas if m.name == f"{table}.json"]
            if not match:
                names = ", ".join(m.name[:-5] for m in metas) or "none"
                raise TableFileError(f"{path} holds no table {table!r} (tables: {names})")
            return match[0]
        if len(metas) != 1:
            names = ", ".join(m.name[:-5] for m in metas) or "none"
            raise TableFileError(f"{path} holds tables [{names}]; name one (table=...)")
        return metas[0]
    if path.suffix == ".rows":
        return path.with_suffix(".json")
    return path


def find_tables(directory: str | os.PathLike) -> list[Path]:
    """Metadata files of the tables in a directory (by their version key, not their name)."""
    out = []
    for p in sorted(Path(directory).glob("*.json")):
        try:
            if json.loads(p.read_text()).get("plestore_table") is not None:
                out.append(p)
        except (OSError, ValueError, AttributeError):
            continue
    return out


def remove_stale_temps(directory: str | os.PathLike, table: str) -> list[Path]:
    """Delete temporary files that a killed writer of `table` left in `directory` (those of live
    processes stay) and return them. A killed full-size pack leaves tens of GB behind; without
    this, every rerun on a nearly full disk would fail."""
    removed = []
    for p in Path(directory).glob(f".{glob.escape(table)}.*.tmp-*"):
        try:
            pid = int(p.name.rsplit(".tmp-", 1)[1].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and _pid_alive(pid):
            continue
        p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class TableWriter:
    """Writes one table file: rows in increasing order, then `commit()` makes it visible.

    Data goes to a temporary file; commit fsyncs it, renames it into place, then writes the
    metadata (temporary name, fsync, rename). A crash at any point leaves no metadata that
    validates against the data, so an interrupted pack is refused at open and redone.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        spec: TableSpec,
        layout: RowLayout | None = None,
        source: dict | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.spec = spec
        self.layout = layout or RowLayout(spec.row_bytes)
        if self.layout.row_bytes != spec.row_bytes:
            raise ValueError(f"layout row_bytes {self.layout.row_bytes} != spec {spec.row_bytes}")
        if chunk_bytes <= 0 or chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
        self.source = source or {}
        self.chunk_bytes = chunk_bytes
        self.data_bytes = self.layout.data_bytes(spec.rows)
        self.data_id = uuid.uuid4().bytes
        self.meta_path = self.out_dir / f"{spec.name}.json"
        self.data_path = self.out_dir / _data_name(self.meta_path)
        self._tmp = (
            self.out_dir / f".{self.data_path.name}.tmp-{os.getpid()}-{self.data_id.hex()[:8]}"
        )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._next_row = 0
        self._pos = 0  # bytes of the data region written so far
        self._crcs: list[int] = []
        self._crc = 0
        self._closed = False
        self._behind = WriteBehind(self._fd, DATA_OFFSET)
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, self.data_id, self.data_bytes)
        self._write_at(header.ljust(DATA_OFFSET, b"\0"), 0)

    def __enter__(self) -> TableWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._closed:
            self.abort()

    @property
    def rows_written(self) -> int:
        return self._next_row

    def write_rows(self, rows: np.ndarray) -> None:
        """Append the next rows (uint8 [n, row_bytes], continuing from rows_written)."""
        self.write_prepared(self.prepare(rows, self._next_row))

    def prepare(
        self, rows: np.ndarray, first_row: int, out: np.ndarray | None = None
    ) -> PreparedRows:
        """Lay out and checksum rows [first_row, first_row+n) without touching the writer's
        state: thread-safe, so a pack's workers do this CPU work in parallel and the writing
        thread only calls `write_prepared` in row order. `out` (uint8, `place_bytes(layout, n)`)
        receives the laid-out bytes, so a caller can recycle its buffers."""
        rows = np.ascontiguousarray(rows)
        rb = self.layout.row_bytes
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != rb:
            raise ValueError(f"write_rows takes uint8 [n, {rb}], got {rows.dtype} {rows.shape}")
        n = rows.shape[0]
        if first_row < 0 or first_row + n > self.spec.rows:
            raise ValueError(f"table {self.spec.name} has {self.spec.rows} rows; got more")
        start = _next_offset(self.layout, first_row, self.spec.rows)
        data = _place(self.layout, rows, first_row, self.spec.rows, out) if n else rows.reshape(-1)
        return PreparedRows(first_row, n, start, data, _crc_pieces(data, start, self.chunk_bytes))

    def write_prepared(self, p: PreparedRows) -> None:
        """Append prepared rows; they must continue from rows_written."""
        if p.first_row != self._next_row:
            raise ValueError(
                f"rows must be written in order: next is row {self._next_row}, got "
                f"rows from {p.first_row}"
            )
        if p.num_rows == 0:
            return
        assert p.start == self._pos, (p.start, self._pos)
        self._write_at(p.data, DATA_OFFSET + p.start)
        for length, crc in p.pieces:  # fold the pieces into the running per-chunk CRCs
            at_boundary = self._pos % self.chunk_bytes == 0
            self._crc = crc if at_boundary else crc32_combine(self._crc, crc, length)
            self._pos += length
            if self._pos % self.chunk_bytes == 0:
                self._crcs.append(self._crc)
                self._crc = 0
        self._next_row += p.num_rows
        self._behind.written(DATA_OFFSET + self._pos)

    def _write_at(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def commit(self) -> TableFile:
        if self._next_row != self.spec.rows:
            raise ValueError(
                f"table {self.spec.name}: {self._next_row} of {self.spec.rows} rows written"
            )
        assert self._pos == self.data_bytes, (self._pos, self.data_bytes)
        if self._pos % self.chunk_bytes:
            self._crcs.append(self._crc)
        os.fsync(self._fd)
        os.close(self._fd)
        self._closed = True
        meta = {
            "plestore_table": FORMAT_VERSION,
            "spec": self.spec.to_dict(),
            "layout": self.layout.to_dict(),
            "data_file": self.data_path.name,
            "data_bytes": self.data_bytes,
            "data_id": self.data_id.hex(),
            "chunk_bytes": self.chunk_bytes,
            "checksum": "crc32",
            "checksums": [f"{c:08x}" for c in self._crcs],
            "source": self.source,
        }
        os.replace(self._tmp, self.data_path)
        tmp_meta = self.meta_path.with_name(f".{self.meta_path.name}.tmp-{os.getpid()}")
        with open(tmp_meta, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_meta, self.meta_path)
        fsync_dir(self.out_dir)
        return TableFile.open(self.meta_path)

    def abort(self) -> None:
        if not self._closed:
            os.close(self._fd)
            self._closed = True
        self._tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make renames in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
