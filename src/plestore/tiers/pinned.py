"""`pinned` tier: the row range in host DRAM, registered with CUDA at its exact size.

Two ways to bring rows to the GPU, chosen per lookup by the engine:
- cpu: host threads gather the rows into a pinned staging buffer, one H2D copy moves them;
- gpu: a kernel reads the rows straight out of the registered memory (UVA) into HBM — no host
  work at all, the lowest latency for decode-sized lookups.
Rows are kept at a stride rounded up to 16 bytes where that costs <= 1/8 extra (90 -> 96 for
nvfp4): aligned rows copy faster on both paths (shared/device.md: 96-B rows copy 2x faster than
90-B rows). On a machine without CUDA it is plain RAM and the cpu path.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from plestore.io.memory import HostBuffer
from plestore.tiers.base import ReadStats, Tier

__all__ = ["PinnedTier", "padded_stride"]


def padded_stride(row_bytes: int) -> int:
    for align in (16, 8, 4):
        stride = -(-row_bytes // align) * align
        if (stride - row_bytes) * 8 <= row_bytes:
            return stride
    return row_bytes


def _gather(items: np.ndarray, idx: np.ndarray, dst: np.ndarray) -> None:
    """dst[i] = items[idx[i]] for void row items. Fancy indexing, not np.take: take would first
    copy a non-contiguous source (the whole table) into a contiguous one."""
    dst[:] = items[idx]


class PinnedTier(Tier):
    name = "pinned"
    can_read_host = True
    needs_unique = False

    def __init__(self, table, row_range, device, options) -> None:
        super().__init__(table, row_range, device, options)
        self.stride = padded_stride(self.row_bytes)
        pin = device.type == "cuda"
        self.buffer = HostBuffer(row_range.rows * self.stride, pin=pin, hugepages=options.hugepages)
        self.rows = self.buffer.array.reshape(row_range.rows, self.stride)  # [rows, stride]
        # one void item per row: a gather then copies each row with a single memcpy
        self._items = np.ndarray(
            (row_range.rows,),
            np.dtype((np.void, self.row_bytes)),
            buffer=self.buffer.array,
            strides=(self.stride,),
        )
        self.rows_tensor = self.buffer.tensor.view(row_range.rows, self.stride) if pin else None
        self._pool = ThreadPoolExecutor(options.threads, thread_name_prefix="plestore-pinned")

        def sink(first: int, rows: np.ndarray) -> None:
            self.rows[first : first + len(rows), : self.row_bytes] = rows

        self._stream_range(sink, progress=self._progress_bar("loading into pinned memory"))

    def read(self, rows: np.ndarray, out: np.ndarray) -> ReadStats:
        self._check_open()
        n = len(rows)
        if n == 0:
            return ReadStats()
        local = self.row_range.local(rows)
        dst = out.view(np.dtype((np.void, self.row_bytes)))[:, 0]  # [>= n] void rows
        parts = max(1, min(self.options.threads, n // 2048))  # ~2k rows per task
        if parts == 1:
            _gather(self._items, local, dst[:n])
        else:
            bounds = np.linspace(0, n, parts + 1).astype(np.int64)
            futures = [
                self._pool.submit(_gather, self._items, local[a:b], dst[a:b])
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
                if b > a
            ]
            for f in futures:
                f.result()
        return ReadStats(rows=n)

    def device_source(self) -> torch.Tensor | None:
        """Registered host memory: the GPU reads rows from it directly."""
        self._check_open()
        return self.rows_tensor

    def host_bytes(self) -> int:
        return self.buffer.nbytes

    def host_budget(self) -> int | None:
        return self.buffer.nbytes

    def describe(self) -> dict:
        return {**super().describe(), "pinned": self.buffer.pinned, "row_stride": self.stride}

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._pool.shutdown(wait=True)
        self._items = self.rows = self.rows_tensor = None
        self.buffer.close()
