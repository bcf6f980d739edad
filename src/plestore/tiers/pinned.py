"""`pinned` tier: the row range in host DRAM, registered with CUDA at its exact size.

Two ways to bring rows to the GPU, chosen per lookup by the engine:
- cpu: host threads gather the rows into a pinned staging buffer, one H2D copy moves them;
- gpu: a kernel reads the rows straight out of the registered memory (UVA) into HBM — no host
  work at all, the lowest latency for decode-sized lookups.
Rows are kept at a stride rounded up to 16 bytes where that costs <= 1/8 extra (90 -> 96 for
nvfp4): aligned rows copy faster on both paths (shared/device.md: 96-B rows against 90-B
ones). On a machine without CUDA it is plain RAM and the cpu path.
"""

from __future__ import annotations

import numpy as np
import torch

from plestore import native
from plestore.io.memory import HostBuffer, mem_available
from plestore.tiers.base import GatherSource, PooledReading, Reading, ReadStats, Tier, check_fits

__all__ = ["PinnedTier", "padded_stride"]


def padded_stride(row_bytes: int) -> int:
    for align in (16, 8, 4):
        stride = -(-row_bytes // align) * align
        if (stride - row_bytes) * 8 <= row_bytes:
            return stride
    return row_bytes


class PinnedTier(Tier):
    name = "pinned"
    can_read_host = True
    reads_storage = False
    # a large lookup's rows in one gather on every thread, its copy queued a chunk at a time as
    # the gather passes it (start_read): a gather per chunk took 2.4x as long. measured:
    # RESULTS.md "host time, part by part" (65,536-row host lookup)
    read_chunk_rows = 16384

    def __init__(self, table, row_range, device, options) -> None:
        super().__init__(table, row_range, device, options)
        self._core = native.load(options.tuning.native)  # (may refuse: before any memory)
        self.stride = padded_stride(self.row_bytes)
        pin = device.type == "cuda"
        nbytes = row_range.rows * self.stride
        if options.share == "node" and nbytes:  # one copy per node, built by its first opener
            from plestore.io.shm import open_shared

            key = f"{table.data_id}-{row_range.start}-{row_range.end}-{self.stride}"
            label = str(table.meta_path)  # (what `plestore shm list` shows)
            self.buffer = open_shared(key, nbytes, self._fill, pin, options.tuning.hugepages, label)
        else:
            check_fits(table.name, self.name, row_range, nbytes, mem_available(), "host")
            self.buffer = HostBuffer(nbytes, pin=pin, hugepages=options.tuning.hugepages)
            try:
                self._fill(self.buffer.array, None)
            except BaseException:  # (a bad block, an I/O error): the pinned pages go back
                self.buffer.close()
                raise
        self.rows = self.buffer.array.reshape(row_range.rows, self.stride)  # [rows, stride]
        self.rows_tensor = self.buffer.tensor.view(row_range.rows, self.stride)  # [rows, stride]
        self.staging_stride = self.stride  # whole padded rows: the fastest gather and copy
        self._threads = native.memory_threads(options.tuning.threads)

    def _fill(self, array: np.ndarray, progress) -> None:
        """Stream the row range from the file into array (uint8 [rows * stride])."""
        rows = array.reshape(self.row_range.rows, self.stride)  # [rows, stride]
        bar = self._progress_bar("loading into pinned memory")

        def sink(first: int, got: np.ndarray) -> None:
            rows[first : first + len(got), : self.row_bytes] = got

        def tick(n: int) -> None:
            for f in (bar, progress):
                if f is not None:
                    f(n)

        self._stream_range(sink, progress=tick)

    def read(self, rows: np.ndarray, out: np.ndarray) -> ReadStats:
        """out: uint8 [>= n, stride], one gather of the host core."""
        self._check_open()
        n = len(rows)
        if n:
            args = self._gather_args(rows, out)
            self._check_gathered(rows, self._core.gather(*args, streaming=self.stream_stores))
        return ReadStats(rows=n)

    def start_read(self, rows: np.ndarray, out: np.ndarray) -> Reading:
        """Past a chunk, one gather begun on the pool, waited for a chunk at a time."""
        if len(rows) <= self.read_chunk_rows:
            return Reading(self, rows, out, chunk=len(rows))
        self._check_open()
        job = self._core.gather_start(
            *self._gather_args(rows, out), grain=PooledReading.GRAIN, streaming=self.stream_stores
        )
        return PooledReading(self, rows, out, job, lambda res: self._check_gathered(rows, res))

    def gather_source(self) -> GatherSource | None:
        if self._closed:
            return None
        s, threads = self.stride, self._threads
        return GatherSource(self.rows, 0, s, self.row_range.start, (1, s, s), threads, threads)

    def _gather_args(self, rows: np.ndarray, out: np.ndarray) -> tuple:
        """The native gather's arguments: rows of `stride` bytes from row_range.start."""
        s, start = self.stride, self.row_range.start
        return self.rows, rows, out, out.shape[1], s, start, 1, s, s, self._threads

    def _check_gathered(self, rows: np.ndarray, result: tuple) -> ReadStats:
        if result[0] >= 0:
            raise IndexError(f"row {int(rows[result[0]])} is not in {self.row_range}")
        return ReadStats(rows=len(rows))

    def device_rows(self) -> torch.Tensor | None:
        """Registered host memory: the GPU reads rows from it directly."""
        self._check_open()
        return self.rows_tensor if self.buffer.pinned else None

    def host_bytes(self) -> int:
        return self.buffer.nbytes

    def host_budget(self) -> int | None:
        return self.buffer.nbytes

    def describe(self) -> dict:
        shared = getattr(self.buffer, "path", None)  # share="node": the node's one copy
        return {
            **super().describe(),
            "pinned": self.buffer.pinned,
            "row_stride": self.stride,
            "shared_copy": shared,
            "built_shared_copy": getattr(self.buffer, "built", None),
        }

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self.rows = self.rows_tensor = None
        self.buffer.close()
