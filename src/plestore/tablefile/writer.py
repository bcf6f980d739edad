"""Writing a table file atomically: rows in order to a temporary file, then data and metadata
renamed into place, so an interrupted pack leaves nothing that validates."""

from __future__ import annotations

import glob
import json
import os
import uuid
from pathlib import Path

import numpy as np

from plestore.io.writeback import WriteBehind, fsync_dir
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile.checksums import BlockChecksWriter, check_unit, unit_crcs
from plestore.tablefile.file import TableFile
from plestore.tablefile.format import (
    DATA_OFFSET,
    DEFAULT_CHUNK_BYTES,
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    data_name,
)
from plestore.tablefile.layout import PreparedRows, crc32_combine, crc_pieces, next_offset, place

__all__ = ["TableWriter", "remove_stale_temps", "stale_temps"]


def remove_stale_temps(directory: str | os.PathLike, table: str) -> list[Path]:
    """Delete temporary files that a killed writer of `table` left in `directory` (those of live
    processes stay) and return them. A killed full-size pack leaves tens of GB behind; without
    this, every rerun on a nearly full disk would fail."""
    removed = stale_temps(directory, table)
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def stale_temps(directory: str | os.PathLike, table: str | None = None) -> list[Path]:
    """The temporary files killed writers (of `table`, or of any table) left in `directory`:
    hidden `.<table>.<ext>.tmp-PID...` files whose process is gone."""
    found, pattern = [], f".{glob.escape(table)}.*.tmp-*" if table else ".*.tmp-*"
    for p in sorted(Path(directory).glob(pattern)):
        try:
            pid = int(p.name.rsplit(".tmp-", 1)[1].split("-")[0])
        except ValueError:
            continue
        if pid == os.getpid() or not _pid_alive(pid):
            found.append(p)
    return found


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
        self.data_path = self.out_dir / data_name(self.meta_path)
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
        self.checks_path = self.out_dir / f"{self.meta_path.name[: -len('.json')]}.crc"
        self._checks = BlockChecksWriter(
            self.out_dir / f".{self.checks_path.name}.tmp-{os.getpid()}-{self.data_id.hex()[:8]}",
            check_unit(self.layout),
            self.data_id,
            self.data_bytes,
        )
        self._behind = WriteBehind(self._fd, DATA_OFFSET)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self.data_id, self.data_bytes)
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
        start = next_offset(self.layout, first_row, self.spec.rows)
        data = place(self.layout, rows, first_row, self.spec.rows, out) if n else rows.reshape(-1)
        return PreparedRows(
            first_row,
            n,
            start,
            data,
            crc_pieces(data, start, self.chunk_bytes),
            unit_crcs(data, start, self._checks.unit),
        )

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
        self._checks.add(p.block_crcs)
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
        self._checks.finish()
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
            "block_checksums": {
                "file": self.checks_path.name,
                "unit": self._checks.unit,
                "count": self._checks.count,
                "algorithm": "crc32",
            },
            "source": self.source,
        }
        os.replace(self._tmp, self.data_path)
        os.replace(self._checks.tmp, self.checks_path)
        tmp_meta = self.meta_path.with_name(f".{self.meta_path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp_meta, "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_meta, self.meta_path)
        except BaseException:
            tmp_meta.unlink(missing_ok=True)
            raise
        fsync_dir(self.out_dir)
        return TableFile.open(self.meta_path)

    def abort(self) -> None:
        if not self._closed:
            os.close(self._fd)
            self._checks.abort()
            self._closed = True
        self._tmp.unlink(missing_ok=True)
        self._checks.tmp.unlink(missing_ok=True)
