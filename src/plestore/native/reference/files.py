"""The file-side calls in Python: `check_file` (filecheck.c), `willneed` (willneed.c) and
`crc32_blocks` (crc.c, zlib's CRC-32), the same arguments and results."""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import zlib
from typing import Any

import numpy as np

from plestore.native.reference.gather import as_bytes, as_ids, layout_ok, offsets_within

__all__ = ["check_file", "crc32_blocks", "willneed"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def check_file(fd: int, size: int, nlink: int, ctime_ns: int) -> int:
    """0: as seen (size bytes at least, that link count and change time); 1: truncated;
    2: unlinked; 3: link count or change time moved; else -errno of fstat."""
    try:
        st = os.fstat(fd)
    except OSError as e:
        return -(e.errno or 1)
    if st.st_size < size:
        return 1
    if st.st_nlink == 0:
        return 2
    return 3 if (st.st_nlink, st.st_ctime_ns) != (nlink, ctime_ns) else 0


def willneed(
    src: Any,
    ids: Any,
    row_bytes: int,
    base: int,
    rows_per_block: int,
    block: int,
    stride: int,
    src_offset: int,
    probe: int,
) -> int:
    """MADV_WILLNEED on the pages of the rows (one call per run of adjacent pages): -1 when
    probe > 0 and the pages of the first `probe` rows are resident (nothing advised), else the
    bytes the kernel read from storage in this thread doing it. Rows outside src are left out."""
    if not layout_ok(rows_per_block, block, stride, row_bytes) or src_offset < 0:
        raise ValueError("willneed: bad layout")
    ids, view = as_ids(ids), as_bytes(src)
    start = view.ctypes.data + src_offset
    nbytes = view.size - src_offset
    offs, ok = offsets_within(ids, base, rows_per_block, block, stride, nbytes, row_bytes)
    offs = offs[ok] if nbytes > 0 else offs[:0]
    page = mmap.PAGESIZE
    at = start % page  # (the mapping starts on a page: src_offset's place in its page)
    first, lead = (start - at), at
    pages = (lead + offs) // page
    if probe > 0:
        vec = ctypes.c_ubyte()
        sample = pages[:probe].tolist()
        if all(
            not _libc.mincore(first + p * page, page, ctypes.byref(vec)) and vec.value & 1
            for p in sample
        ):
            return -1
    ends = (lead + offs + row_bytes - 1) // page
    pages = np.unique(np.concatenate([pages, ends]))
    r0 = resource.getrusage(resource.RUSAGE_THREAD).ru_inblock
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1  # runs of adjacent pages
    for s, e in zip(
        pages[np.r_[0, breaks]].tolist(),
        pages[np.r_[breaks - 1, pages.size - 1]].tolist(),
        strict=True,
    ):
        _libc.madvise(first + s * page, (e - s + 1) * page, mmap.MADV_WILLNEED)
    return (resource.getrusage(resource.RUSAGE_THREAD).ru_inblock - r0) * 512


def crc32_blocks(buf: Any, starts: Any, sizes: Any, out: Any, threads: int = 1) -> None:
    """out[i] = zlib's CRC-32 of buf[starts[i] : starts[i] + sizes[i]]."""
    view = memoryview(buf).cast("B")
    starts, sizes = as_ids(starts), as_ids(sizes)
    dst = np.asarray(out)
    if dst.dtype != np.uint32 or dst.size < starts.size or sizes.size != starts.size:
        raise ValueError("crc32_blocks: out must be uint32 [n] and sizes one per start")
    bad = np.flatnonzero((starts < 0) | (sizes < 0) | (starts > len(view) - sizes))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"block {i} [{starts[i]}, +{sizes[i]}) lies outside the buffer")
    for i, (a, n) in enumerate(zip(starts.tolist(), sizes.tolist(), strict=True)):
        dst[i] = zlib.crc32(view[a : a + n])
