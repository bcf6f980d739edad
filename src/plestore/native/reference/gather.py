"""The gathers and the id check in numpy: `check_ids`, `gather`, `gather_start` (gather.c,
gatherpy.c, ids.c), the same arguments and results."""

from __future__ import annotations

import ctypes
import resource
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

import numpy as np

__all__ = [
    "GatherJob",
    "as_bytes",
    "as_ids",
    "check_ids",
    "gather",
    "gather_start",
    "layout_offsets",
    "layout_ok",
    "offsets_within",
    "thread_pool",
]

GRAIN = 2048  # rows per piece of a gather on the pool (gatherpy.c's GRAIN)


@cache
def thread_pool(threads: int) -> ThreadPoolExecutor:
    """A pool of `threads` made once (numpy's copies release the GIL; page faults wait apart)."""
    return ThreadPoolExecutor(threads, thread_name_prefix="plestore-ref")


def as_bytes(obj: Any, writable: bool = False) -> np.ndarray:
    """A C-contiguous buffer's bytes as uint8 [n] (no copy)."""
    view = memoryview(obj)
    if not view.c_contiguous:
        raise ValueError("buffers must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("out must be a writable buffer")
    return np.frombuffer(view.cast("B"), np.uint8)


def as_ids(obj: Any) -> np.ndarray:
    arr = np.asarray(obj)
    if arr.dtype != np.int64:
        raise ValueError(f"ids must hold int64, got {arr.dtype}")
    return np.ascontiguousarray(arr).reshape(-1)


def check_ids(ids: Any, rows: int) -> int:
    """The first position of an id outside [0, rows), or -1."""
    v = as_ids(ids)
    bad = np.flatnonzero((v < 0) | (v >= rows))
    return int(bad[0]) if bad.size else -1


def layout_offsets(ids: np.ndarray, base: int, rpb: int, block: int, stride: int) -> np.ndarray:
    """core.h's layout_offset of each row (id - base)."""
    row = ids - base
    with np.errstate(over="ignore"):
        return (row // rpb) * block + (row % rpb) * stride


def offsets_within(ids, base, rpb, block, stride, nbytes, row_bytes) -> tuple:
    """(offsets, which rows lie inside [0, nbytes)): core.h's offset_of, the block index
    bounded before it is multiplied, so a huge id cannot wrap into range."""
    row = ids - base
    with np.errstate(over="ignore"):
        ok = (ids >= base) & (row // rpb <= max(0, nbytes) // block)
        offs = layout_offsets(np.where(ok, ids, base), base, rpb, block, stride)
    return offs, ok & (offs <= nbytes - row_bytes)


def layout_ok(rpb: int, block: int, stride: int, row_bytes: int) -> bool:
    return (
        rpb >= 1
        and row_bytes >= 1
        and stride >= row_bytes
        and block >= stride
        and (rpb <= block // stride)
    )


class _Gather:
    """gather()'s arguments, checked as gatherpy.c's parse() checks them (blocking: the C's
    GIL choice, nothing here)."""

    def __init__(
        self,
        src,
        ids,
        out,
        out_stride,
        row_bytes,
        base,
        rpb,
        block,
        stride,
        threads=1,
        grain=GRAIN,
        count_faults=False,
        src_offset=0,
        blocking=False,
        streaming=False,
    ) -> None:
        if not layout_ok(rpb, block, stride, row_bytes) or out_stride < row_bytes or src_offset < 0:
            raise ValueError("gather: bad layout or strides")
        self.src, self.ids = as_bytes(src), as_ids(ids)
        self.out = as_bytes(out, writable=True)
        n = self.ids.size
        if src_offset > self.src.size or (n and (n - 1) * out_stride + row_bytes > self.out.size):
            raise ValueError("gather: out is too small for the rows")
        self.src = self.src[src_offset:]
        self.stride, self.rb, self.n = out_stride, row_bytes, n
        self.layout = (base, rpb, block, stride)
        self.threads, self.grain = max(1, threads), max(1, grain)
        self.count_faults, self.streaming = count_faults, streaming
        self.bad, self.major, self.minor, self.inblock = -1, 0, 0, 0  # (run's results)

    def piece(self, a: int, b: int) -> tuple[int, int, int, int]:
        """Rows [a, b) copied to out: (a bad position or -1, the faults and 512-B blocks read
        this thread took doing it)."""
        r0 = resource.getrusage(resource.RUSAGE_THREAD) if self.count_faults else None
        ids, rb, stride, out = self.ids[a:b], self.rb, self.stride, self.out
        base, rpb, block, lay_stride = self.layout
        offs, ok = offsets_within(ids, base, rpb, block, lay_stride, self.src.size, rb)
        bad = a + int(np.flatnonzero(~ok)[0]) if not ok.all() else -1
        items = np.ndarray((max(0, self.src.size - rb + 1),), (np.void, rb), self.src, 0, (1,))
        rows = np.ndarray((b - a,), (np.void, rb), out, a * stride, (stride,))
        rows[ok] = items[offs[ok]]
        if self.streaming and stride > rb:  # as sink.h: a streamed row's padding is zeros
            whole = min(b - a, (out.size - a * stride) // stride)
            np.ndarray((whole, stride - rb), np.uint8, out, a * stride + rb, (stride, 1))[:] = 0
            if whole < b - a:  # the last row's padding, as far as out reaches
                out[(a + whole) * stride + rb : (a + whole + 1) * stride] = 0
        if r0 is None:
            return bad, 0, 0, 0
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        return (
            bad,
            r1.ru_majflt - r0.ru_majflt,
            r1.ru_minflt - r0.ru_minflt,
            (r1.ru_inblock - r0.ru_inblock),
        )

    def run(self) -> None:
        pieces = [(a, min(self.n, a + self.grain)) for a in range(0, self.n, self.grain)]
        if self.threads == 1 or len(pieces) < 2:
            done = [self.piece(a, b) for a, b in pieces]
        else:
            pool = thread_pool(self.threads)
            done = [f.result() for f in [pool.submit(self.piece, a, b) for a, b in pieces]]
        bad = [d[0] for d in done if d[0] >= 0]
        self.bad = bad[0] if bad else -1
        self.major, self.minor, self.inblock = (sum(d[k] for d in done) for k in (1, 2, 3))

    def result(self) -> tuple[int, int, int, int]:
        return self.bad, self.major, self.minor, self.inblock * 512


def gather(*args: Any, **kw: Any) -> tuple[int, int, int, int]:
    """gather(src, ids, out, out_stride, row_bytes, base, rows_per_block, block, stride,
    threads=1, grain=2048, count_faults=False, src_offset=0, blocking=False, streaming=False):
    rows at the layout's offsets from src into out; (a bad position or -1, major faults, minor
    faults, bytes read from storage by the gathering threads: count_faults's)."""
    g = _Gather(*args, **kw)
    g.run()
    return g.result()


_H2D = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
)


class GatherJob:
    """A gather begun by gather_start: here done at once, so wait() has nothing to wait for;
    copy() queues each chunk's copy through CUDA's cuMemcpyHtoDAsync as the core's does."""

    def __init__(self, g: _Gather) -> None:
        self._g = g
        g.run()

    def wait(self, rows: int) -> int:
        return self._g.bad

    def copy(self, dst: int, stream: int, chunk: int, h2d: int) -> tuple[int, int]:
        if chunk < 1 or not h2d or not dst:
            raise ValueError("copy: needs chunk_rows >= 1, a device address, h2d")
        g, fn = self._g, _H2D(h2d)
        if g.bad >= 0:
            return g.bad, 0
        at = g.out.ctypes.data
        for a in range(0, g.n, chunk):
            b = min(g.n, a + chunk)
            nbytes = min((b - a) * g.stride, g.out.size - a * g.stride)
            err = fn(dst + a * g.stride, at + a * g.stride, nbytes, stream)
            if err:
                return g.bad, err
        return g.bad, 0

    def finish(self) -> tuple[int, int, int, int]:
        return self._g.result()


def gather_start(*args: Any, **kw: Any) -> GatherJob:
    """gather(), as a job: wait(rows), copy(dst, stream, chunk, h2d), finish()."""
    return GatherJob(_Gather(*args, **kw))
