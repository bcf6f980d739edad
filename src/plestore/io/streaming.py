"""Plumbing for the streaming tools (synth, pack, verify): a bounded ordered thread map, byte
progress bars, and memory readings.

Bounded, because a table is larger than memory: at most `window` items are in flight, so peak
memory is window x (one item's buffers) whatever the table size. Ordered, because table files
are written sequentially. Threads, not processes: numpy, pread/pwrite, zlib and hashlib release
the GIL on large buffers, so threads scale and share no copies.
"""

from __future__ import annotations

import os
import resource
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["bounded_map", "default_threads", "peak_rss_bytes", "progress_bar"]

T = TypeVar("T")
R = TypeVar("R")


def default_threads() -> int:
    """Worker threads of synth, pack and verify (their `--threads` otherwise): the CPU count
    capped at 16. (PLESTORE_THREADS is the table option `threads`: lookups' gather threads.)"""
    return max(1, min(os.cpu_count() or 1, 16))


def bounded_map(
    fn: Callable[[T], R], items: Iterable[T], threads: int | None = None, window: int | None = None
) -> Iterator[R]:
    """fn over items on a thread pool, yielding results in input order with at most `window`
    (default 2 x threads) submitted and not yet consumed. An exception in fn is raised at its
    item; the rest is cancelled."""
    threads = threads or default_threads()
    window = max(1, window or 2 * threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="plestore") as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


class _Silent:
    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool = True) -> Any:
    """A tqdm byte counter on stderr (bytes/s), or a silent one (tqdm not even imported)."""
    if not enabled:
        return _Silent()
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not enabled,
        mininterval=0.5,
        smoothing=0.1,
        dynamic_ncols=True,
    )


def peak_rss_bytes() -> int:
    """Peak resident set size of this process image so far.

    Linux: VmHWM of /proc/self/status. Not getrusage's ru_maxrss: exec carries the launching
    process's peak over into it (a pack started by a 1 GiB benchmark "peaks" at 1 GiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, else KiB
