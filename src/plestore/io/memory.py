"""Host memory: page-aligned buffers, CUDA registration at the exact size, and accounting.

torch's pinned allocator rounds every request up to a power of two (a 26.8 GiB table would pin
32 GiB); registering an mmap'd buffer with cudaHostRegister pins exactly what is asked for.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import numpy as np
import torch

__all__ = [
    "HostBuffer",
    "clear_cuda_error",
    "held_bytes",
    "evict",
    "gpu_available",
    "mem_available",
    "process_io",
]

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
#: bytes open HostBuffers hold ("host": anonymous maps; "pinned": those registered with CUDA)
_HELD = {"host": 0, "pinned": 0}
_HELD_LOCK = threading.Lock()


def held_bytes() -> dict[str, int]:
    """Host memory the process's open HostBuffers hold now, and how much of it is pinned:
    what a closed table, or one that failed to open, has given back."""
    with _HELD_LOCK:
        return dict(_HELD)


def _count(kind: str, nbytes: int) -> None:
    with _HELD_LOCK:
        _HELD[kind] += nbytes


class HostBuffer:
    """An anonymous, page-aligned host buffer; optionally registered (pinned) with CUDA.

    `array` is a uint8 numpy view and `tensor` a torch view of the same memory. Registered
    memory is page-locked, so torch's non_blocking copies from it are real DMA, and GPU kernels
    can read it directly through unified virtual addressing.
    """

    def __init__(self, nbytes: int, pin: bool = False, hugepages: bool = True) -> None:
        self.nbytes = int(nbytes)
        self._map = mmap.mmap(-1, max(self.nbytes, 1), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._mapped = self.nbytes  # counted in held_bytes until close
        _count("host", self._mapped)
        if hugepages and self.nbytes >= (2 << 20):
            try:
                self._map.madvise(_MADV_HUGEPAGE)
            except (OSError, ValueError):
                pass  # transparent hugepages disabled: fine, just more TLB misses
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=self.nbytes)
        self.tensor = torch.from_numpy(self.array)
        self.pinned = False
        if pin:
            self._register()

    @property
    def address(self) -> int:
        return int(self.array.ctypes.data)

    def _register(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("cannot pin host memory: no CUDA device")
        if self.nbytes == 0:
            return
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.address, self.nbytes, 0)
        code = int(getattr(err, "value", err))
        if code != 0:
            clear_cuda_error()
            raise RuntimeError(
                f"cudaHostRegister of {self.nbytes} bytes failed (CUDA error {code}: "
                f"{cudart.cudaGetErrorString(err)}); the host may lack lockable memory "
                "(ulimit -l) — use tier='mapped' or 'direct'"
            )
        self.pinned = True
        _count("pinned", self.nbytes)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
            _count("pinned", -self.nbytes)
        _count("host", -getattr(self, "_mapped", 0))  # (a shared copy maps no anonymous memory)
        self._mapped = 0
        if not self._map.closed and hasattr(self, "array"):  # (closed once: nothing to do)
            del self.tensor, self.array
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still alive elsewhere; the mapping goes with it


def clear_cuda_error() -> None:
    """Take back the error a failed CUDA runtime call left as the thread's last error: torch
    reads that at its next kernel launch and would raise it as its own."""
    global _cudart
    if _cudart is None:
        _cudart = _loaded_cudart()
    if _cudart:
        _cudart.cudaGetLastError()


def _loaded_cudart() -> ctypes.CDLL | bool:
    """The CUDA runtime torch loaded (by its soname, else the one mapped; never loaded anew),
    or False (linked into torch, or none: nothing this process can reach)."""
    names = [f"libcudart.so.{(torch.version.cuda or '').split('.')[0]}"]
    with open("/proc/self/maps") as f:  # fields: address perms offset dev inode path
        names += sorted({p for ln in f if "/libcudart.so" in (p := ln.split(maxsplit=5)[-1])})
    for name in names:
        try:
            return ctypes.CDLL(name.strip().removesuffix(" (deleted)"), mode=os.RTLD_NOLOAD)
        except OSError:
            continue
    return False


_cudart: ctypes.CDLL | bool | None = None


def evict(path: str | os.PathLike) -> None:
    """Drop a file — or every file of a directory (a table or checkpoint dir) — from the page
    cache. POSIX_FADV_DONTNEED only drops clean pages no process maps: measure cold in a fresh
    process."""
    from pathlib import Path

    p = Path(path)
    for f in sorted(x for x in p.iterdir() if x.is_file()) if p.is_dir() else [p]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gpu_available(device: torch.device) -> int:
    """A CUDA device's free memory, with what torch's allocator holds unused (a closed table's)."""
    held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + held


def process_io() -> dict[str, int]:
    """/proc/self/io counters (read_bytes = bytes this process caused to be read from disk)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


_io_fd: tuple[int, int] | None = None  # (pid, fd of /proc/self/io): reopened after a fork


def disk_read_bytes() -> int:
    """read_bytes of /proc/self/io, from a descriptor kept open: a lookup reads it twice, and
    open + parse costs ~10x more (measured: RESULTS.md "host time, part by part").
    0 where absent."""
    global _io_fd
    pid = os.getpid()
    if _io_fd is None or _io_fd[0] != pid:
        try:
            _io_fd = (pid, os.open("/proc/self/io", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            return 0
    data = os.pread(_io_fd[1], 512, 0)
    at = data.find(b"read_bytes:")
    return int(data[at + 11 : data.index(b"\n", at)]) if at >= 0 else 0
