"""Capabilities, probed rather than assumed: what this machine's GPU, kernel and filesystem allow.

The tiers call these at open, so an unsupported choice fails there with a message that names
the alternative — not later, with a wrong row or a hang.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from plestore.io.odirect import o_direct_alignment
from plestore.io.uring import uring_available

__all__ = ["Capabilities", "capabilities", "filesystem_type", "o_direct_alignment"]

# CUdevice_attribute values (cuda.h)
_ATTR = {
    "integrated": 18,
    "pageable_memory_access": 88,
    "host_pointer_for_registered_mem": 91,
    "stream_mem_ops": 92,
    "host_register_supported": 99,
    "pageable_uses_host_page_tables": 100,
}


@dataclass(frozen=True)
class Capabilities:
    cuda: bool
    device_name: str
    integrated: bool  # the GPU has no memory of its own: it shares the host's (DGX Spark)
    pageable_memory_access: bool  # GPU may dereference pageable (e.g. mmap'd) host memory
    pageable_uses_host_page_tables: bool
    stream_mem_ops: bool  # cuStreamWaitValue32 / WriteValue32
    host_register_supported: bool  # cudaHostRegister (exact-size pinning)
    io_uring: bool
    transparent_hugepages: str  # always | madvise | never | unknown

    def to_dict(self) -> dict:
        return asdict(self)


def _cuda_attributes(index: int) -> dict[str, bool]:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return {k: False for k in _ATTR}
    lib.cuInit(0)
    out = {}
    for name, attr in _ATTR.items():
        value = ctypes.c_int(0)
        ok = lib.cuDeviceGetAttribute(ctypes.byref(value), attr, index) == 0
        out[name] = bool(ok and value.value)
    return out


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return "unknown"


@cache
def capabilities(device_index: int | None = None) -> Capabilities:
    """Probe once per device: CUDA attributes, io_uring, hugepages."""
    cuda = torch.cuda.is_available()
    attrs = {k: False for k in _ATTR}
    name = "cpu"
    if cuda:
        index = torch.cuda.current_device() if device_index is None else device_index
        name = torch.cuda.get_device_name(index)
        attrs = _cuda_attributes(index)
    return Capabilities(
        cuda=cuda,
        device_name=name,
        integrated=attrs["integrated"],
        pageable_memory_access=attrs["pageable_memory_access"],
        pageable_uses_host_page_tables=attrs["pageable_uses_host_page_tables"],
        stream_mem_ops=attrs["stream_mem_ops"],
        host_register_supported=attrs["host_register_supported"],
        io_uring=uring_available(),
        transparent_hugepages=_thp_mode(),
    )


def filesystem_type(path: str | os.PathLike) -> str:
    """The type of the filesystem `path` (or its nearest existing parent) lies on, from
    /proc/self/mounts ("tmpfs", "ext4", ...; "" where that cannot be read)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    real, best, kind = str(p.resolve()), -1, ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > best:
                    best, kind = len(mount), parts[2]
    except OSError:
        return ""
    return kind
