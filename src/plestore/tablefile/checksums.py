"""Per-block checksums of a table's data region, in a sidecar file beside the data.

    OUT/<table>.crc   a 64-byte header (magic, version, algorithm, data id, unit, count), then
                      `count` little-endian uint32: the CRC-32 of data-region bytes
                      [i * unit, min((i + 1) * unit, data_bytes)) for block i.

The unit is the layout's `block_bytes` (a cold row is one block read, so a block is what a read
can check), or CHECK_UNIT bytes for rows packed back to back. A 320 M-row table in 512-B blocks
has ~56 M blocks, so the CRCs live in their own file (224 MB), mapped when a check needs them,
not in the JSON metadata. With `verify_reads`, every tier checks the blocks its rows come from
(`check_span`) before a row is returned or cached; a mismatch raises `BlockChecksumError`
naming the table, the block and its rows.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from plestore import native
from plestore.spec import RowLayout
from plestore.tablefile.format import DATA_OFFSET, TableFileError
from plestore.tablefile.layout import rows_within

__all__ = [
    "CHECK_UNIT",
    "BlockChecks",
    "BlockChecksumError",
    "UnitCrcs",
    "block_crcs",
    "check_unit",
    "name_runs",
    "runs",
    "unit_crcs",
]

CHECK_UNIT = 4096  # rows back to back (block_bytes 0): one page per check
MAGIC = b"PLESTORE-CRC\0\0\0\0"  # 16 bytes
VERSION = 1
ALGORITHM_CRC32 = 1
_HEADER = struct.Struct("<16sII16sQQ")  # magic, version, algorithm, data id, unit, count
HEADER_BYTES = 64


def block_crcs(view: Any, starts: Any, sizes: Any) -> np.ndarray:
    """uint32 [n]: zlib's CRC-32 of view[starts[i] : starts[i] + sizes[i]], one call of the host
    core (the compiled one wherever it is built, whatever a table's `native` mode: on its pool;
    one zlib.crc32 call per 512-B block capped a table's load). A block outside the view is a
    ValueError."""
    starts = np.ascontiguousarray(starts, np.int64)
    sizes = np.ascontiguousarray(np.broadcast_to(sizes, starts.shape), np.int64)
    out = np.empty(starts.size, np.uint32)
    native.load().crc32_blocks(view, starts, sizes, out, _crc_threads())
    return out


@cache
def _crc_threads() -> int:
    """The pool's threads for block CRCs: one per core (asked once: checks run per read)."""
    return native.memory_threads(os.cpu_count() or 1)


def check_unit(layout: RowLayout) -> int:
    return layout.block_bytes or CHECK_UNIT


def checks_for(table: Any, options: Any) -> BlockChecks | None:
    """The checks a tier runs on its reads: the table's, if options.verify_reads; a table
    without them (format version 1) is refused, saying how to get them."""
    if not options.verify_reads:
        return None
    if table.block_checks is None:
        raise TableFileError(
            f"table {table.name} ({table.meta_path}) is format version {table.version}, which "
            "has no per-block checksums, so verify_reads cannot check it: re-pack it "
            f"(`plestore pack CHECKPOINT {table.meta_path.parent}` rewrites older tables), or "
            "open it with verify_reads off"
        )
    return table.block_checks


class BlockChecksumError(TableFileError):
    """A block read from a table file does not match its stored checksum: the file is corrupt."""


@dataclass(frozen=True)
class UnitCrcs:
    """The CRCs of the whole units inside a run of data-region bytes, and the partial units at
    its ends (bytes), for a writer that receives runs in order (`BlockChecksWriter.add`)."""

    head: bytes  # bytes before the first unit boundary (completes the previous run's tail)
    crcs: np.ndarray  # uint32 [whole units]
    tail: bytes  # bytes after the last whole unit


def unit_crcs(data: np.ndarray, start: int, unit: int) -> UnitCrcs:
    """Split data-region bytes `data` (starting at data-region offset `start`) at unit
    boundaries; CRC-32 every whole unit. Thread-safe (a pack's workers call it)."""
    view = memoryview(np.ascontiguousarray(data).reshape(-1))
    first = (-start) % unit
    if first >= len(view):
        return UnitCrcs(bytes(view), np.empty(0, np.uint32), b"")
    body = view[first:]
    n = len(body) // unit
    crcs = block_crcs(body, np.arange(n, dtype=np.int64) * unit, unit)
    return UnitCrcs(bytes(view[:first]), crcs, bytes(body[n * unit :]))


class BlockChecksWriter:
    """Appends block CRCs to a temporary sidecar as a writer lays rows down, in order."""

    def __init__(self, tmp: Path, unit: int, data_id: bytes, data_bytes: int) -> None:
        self.tmp, self.unit, self.data_id = tmp, unit, data_id
        self.count = -(-data_bytes // unit)
        self._f = open(tmp, "wb")  # noqa: SIM115 - closed by commit/abort
        self._f.write(b"\0" * HEADER_BYTES)
        self._carry = b""
        self._written = 0

    def add(self, part: UnitCrcs) -> None:
        self._carry += part.head
        if len(self._carry) == self.unit or (len(part.crcs) or part.tail):
            if self._carry:
                if len(self._carry) != self.unit:
                    raise AssertionError("block checksums: runs do not abut")
                self._put(np.array([zlib.crc32(self._carry)], np.uint32))
            self._carry = b""
        self._put(part.crcs)
        self._carry += part.tail

    def _put(self, crcs: np.ndarray) -> None:
        if len(crcs):
            self._f.write(crcs.astype("<u4").tobytes())
            self._written += len(crcs)

    def finish(self) -> None:
        """Write the last (short) block's CRC and the header; fsync. The caller renames."""
        if self._carry:
            self._put(np.array([zlib.crc32(self._carry)], np.uint32))
            self._carry = b""
        if self._written != self.count:
            raise AssertionError(f"block checksums: {self._written} of {self.count} written")
        self._f.seek(0)
        header = _HEADER.pack(MAGIC, VERSION, ALGORITHM_CRC32, self.data_id, self.unit, self.count)
        self._f.write(header.ljust(HEADER_BYTES, b"\0"))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()
        self.tmp.unlink(missing_ok=True)


class BlockChecks:
    """An opened, validated sidecar. `crcs` is mapped on first use."""

    def __init__(self, table: Any, path: Path, unit: int, count: int) -> None:
        self.table = table  # the TableFile (name, layout, rows, data path for error messages)
        self.path = path
        self.unit = unit
        self.count = count
        self._crcs: np.ndarray | None = None

    @classmethod
    def open(cls, table: Any, entry: Any) -> BlockChecks:
        """Validate a sidecar against its table in O(1): the metadata entry, the file's size
        and header (magic, version, algorithm, data id, unit, count)."""
        err = TableFileError
        where = f"{table.meta_path}: block_checksums"
        if not isinstance(entry, dict) or set(entry) != {"file", "unit", "count", "algorithm"}:
            raise err(f"{where} must be {{file, unit, count, algorithm}}, got {entry!r}")
        unit, count = check_unit(table.layout), -(-table.data_bytes // check_unit(table.layout))
        name = entry["file"]
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".crc"):
            raise err(f"{where}.file must name a .crc file beside the metadata, got {name!r}")
        if entry["algorithm"] != "crc32":
            raise err(f"{where}.algorithm must be 'crc32', got {entry['algorithm']!r}")
        if entry["unit"] != unit or type(entry["unit"]) is not int:
            raise err(f"{where}.unit must be {unit} for this layout, got {entry['unit']!r}")
        if entry["count"] != count or type(entry["count"]) is not int:
            raise err(f"{where}.count must be {count} for {table.data_bytes} bytes")
        path = table.meta_path.with_name(name)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                raw = f.read(_HEADER.size)
        except FileNotFoundError:
            raise err(f"block checksum file {path} is missing; re-pack the table") from None
        if size != HEADER_BYTES + 4 * count:
            raise err(
                f"block checksum file {path} is {size} bytes, expected "
                f"{HEADER_BYTES + 4 * count} (truncated or from another pack)"
            )
        magic, version, algo, data_id, f_unit, f_count = _HEADER.unpack(raw)
        if magic != MAGIC or version != VERSION or algo != ALGORITHM_CRC32:
            raise err(f"{path} is not a plestore block checksum file (version {VERSION})")
        if data_id.hex() != table.data_id or (f_unit, f_count) != (unit, count):
            raise err(f"block checksum file {path} does not belong to {table.meta_path}")
        return cls(table, path, unit, count)

    @property
    def crcs(self) -> np.ndarray:
        if self._crcs is None:
            self._crcs = np.memmap(self.path, "<u4", "r", HEADER_BYTES, (self.count,))
        return self._crcs

    def _compare(self, units: np.ndarray, got: np.ndarray) -> None:
        """Raise for the first of `units` whose computed CRC (`got`) is not the stored one."""
        bad = np.flatnonzero(self.crcs[units] != got)
        if bad.size:
            raise self.mismatch(int(units[bad[0]]))

    def _crcs_of(self, view: memoryview, starts: np.ndarray, units: np.ndarray) -> np.ndarray:
        """CRC-32 of block units[i], whose bytes start at view[starts[i]] (the last block of
        the data region may be short)."""
        return block_crcs(
            view, starts, np.minimum(self.unit, self.table.data_bytes - units * self.unit)
        )

    def check_span(self, lo: int, buf: Any, fd: int | None = None) -> None:
        """Check every block overlapping data-region bytes [lo, lo + len(buf)): from `buf`
        where it holds the whole block, else read from the data file (`fd`, or a new one)."""
        view = memoryview(np.ascontiguousarray(buf).reshape(-1)).cast("B")
        unit, data_bytes = self.unit, self.table.data_bytes
        hi, end = lo + len(view), min(lo + len(view), data_bytes)
        if end <= lo:
            return
        units = np.arange(lo // unit, (end - 1) // unit + 1, dtype=np.int64)
        whole = (units * unit >= lo) & (np.minimum((units + 1) * unit, data_bytes) <= hi)
        inside = units[whole]
        self._compare(inside, self._crcs_of(view, inside * unit - lo, inside))
        edges = units[~whole]  # at most two blocks only partly in buf: read them whole
        if edges.size:
            own = os.open(self.table.data_path, os.O_RDONLY) if fd is None else None
            try:
                self._check_from_file(edges, own if fd is None else fd)
            finally:
                if own is not None:
                    os.close(own)

    def _check_from_file(self, units: np.ndarray, fd: int) -> None:
        for u in units.tolist():
            a, b = u * self.unit, min((u + 1) * self.unit, self.table.data_bytes)
            data = os.pread(fd, b - a, DATA_OFFSET + a)
            if len(data) != b - a or zlib.crc32(data) != int(self.crcs[u]):
                raise self.mismatch(u)

    def check_region(self, rows: np.ndarray, region: np.ndarray) -> None:
        """Check the blocks holding `rows` in `region`, the whole data region (uint8, e.g. a
        mapping of it)."""
        units = self.units_of_rows(rows)
        view = memoryview(region).cast("B")
        self._compare(units, self._crcs_of(view, units * self.unit, units))

    def units_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """Sorted unique blocks that hold any byte of the given rows."""
        offs = self.table.layout.offsets(rows)
        first = offs // self.unit
        last = (offs + self.table.layout.row_bytes - 1) // self.unit
        if np.array_equal(first, last):
            return np.unique(first)
        spans = [np.arange(a, b + 1) for a, b in zip(first.tolist(), last.tolist(), strict=True)]
        return np.unique(np.concatenate(spans))

    def verify_rows(self, rows: np.ndarray) -> None:
        """Check the blocks of `rows` against the file (a plain pread per block)."""
        fd = os.open(self.table.data_path, os.O_RDONLY)
        try:
            self._check_from_file(self.units_of_rows(np.asarray(rows, np.int64)), fd)
        finally:
            os.close(fd)

    def bad_blocks(self, lo: int, data: Any) -> np.ndarray:
        """The blocks (int64, ascending) of whole blocks `data` (data-region bytes from `lo`,
        a multiple of the unit) whose CRC-32 is not the stored one."""
        view = memoryview(data).cast("B")
        units = np.arange(lo // self.unit, -(-(lo + len(view)) // self.unit), dtype=np.int64)
        got = self._crcs_of(view, units * self.unit - lo, units)
        return units[self.crcs[units] != got]

    def rows_of(self, unit: int) -> tuple[int, int]:
        """[first, last] rows with bytes in block `unit`."""
        t = self.table
        a, b = unit * self.unit, min((unit + 1) * self.unit, t.data_bytes)
        return rows_within(t.layout, t.spec.rows, a, b)

    def mismatch(self, unit: int) -> BlockChecksumError:
        t = self.table
        a, b = unit * self.unit, min((unit + 1) * self.unit, t.data_bytes)
        first, last = self.rows_of(unit)
        return BlockChecksumError(
            f"table {t.name}: block {unit} (data bytes [{a}, {b}) of {t.data_path}) does not "
            f"match its CRC-32: rows {first}..{last} are corrupt on disk; nothing was returned. "
            f"Run `plestore verify {t.meta_path}` and re-pack the table"
        )


def runs(sorted_ids: list[int]) -> list[tuple[int, int]]:
    """[a, b] runs of consecutive ids."""
    out: list[list[int]] = []
    for i in sorted_ids:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return [(a, b) for a, b in out]


def name_runs(runs: list[dict], most: int = 20) -> str:
    """'block 992 (rows 4960..4964), blocks 994..995 (rows ...)', the first `most` runs."""
    names = []
    for r in runs[:most]:
        kind = "blocks" if "blocks" in r else "chunks"
        a, b = r[kind]
        unit = f"{kind[:-1]} {a}" if a == b else f"{kind} {a}..{b}"
        names.append(f"{unit} (rows {r['rows'][0]}..{r['rows'][1]})")
    more = f", and {len(runs) - most} more runs (--json lists all)" if len(runs) > most else ""
    return ", ".join(names) + more
