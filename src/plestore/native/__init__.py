"""The host core: the host path's hot loops behind one interface, compiled (C, `_core`, built
from source at install) or its numpy reference (`reference`), with the same functions:

- `check_ids(ids, rows)`: the first id outside [0, rows), or -1;
- `gather(src, ids, out, ...)`: rows at the table layout's offsets copied into staging (the C
  on a pthread pool made once: software prefetches keep each thread's loads in flight, and from
  a file mapping each thread's page faults wait on the disk while the others go on);
  `gather_start` begins one whose `copy` queues each chunk's copy to the GPU as it is written
  (CUDA's `cuMemcpyHtoDAsync`, found in the driver library torch loaded: `cuda_h2d`);
- `check_file`, `willneed`: the mapped tier's file check and cold-read hint;
- `cache_locate(...)`, `cache_admit(...)`: the GPU row cache directory's probe (slots, recency,
  frequency counts) and admission;
- `crc32_blocks(buf, starts, sizes, out, threads)`: zlib's CRC-32 of many blocks (a table's
  block checks, as a load streams it or a pack writes it);
- `recode_nvfp4(raw, dim, lut, out, counts)`: NVFP4 rows through a symbol table, the symbols
  counted (pack's format conversion);
- `feed_serve(...)`: a captured host-fed lookup's host side (lookup/graphfeed.py): the wait for
  a step's posted ids and its whole host step without the GIL — ids checked, this rank's ids,
  the GPU row cache's probe, the tier's parts read (gathers, `DirectCore`), the index, READY;
  `host_step(plan, feed, counters)`: that step alone (a staged lookup's stage());
- `Mutex`: a lock Python takes with `with` and that step takes without the GIL (the GPU row
  cache directory's);
- `DirectCore`: the direct tier's read — host row cache probe, read units of the misses, their
  O_DIRECT reads (the C through an io_uring of its own, raw syscalls, no liburing; the
  reference by preadv on threads), their blocks checked (verify_reads), the rows placed and
  admitted, by its own clock — its prefetch (reads started, collected by the next read) and
  `clear`.

Tiers call `load(mode)`'s result and never branch on which it is. `mode` is the `native` knob
(Tuning.native, PLESTORE_NATIVE): auto (the compiled core where built, else the reference,
announced once), on (the compiled core, or an error), off (the reference). Both return the
same bytes: tests/test_native.py compares them call by call, and the tier conformance tests run
under both (HOST_CORES, tests/conftest.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from types import ModuleType

from plestore.native import constants

__all__ = [
    "ABI_VERSION",
    "CAPTURE_RELAXED",
    "FEED_COUNTERS",
    "FEED_STATES",
    "MODES",
    "STREAM_MEM_OPS",
    "available",
    "cuda_capture_mode",
    "cuda_device_attribute",
    "cuda_error",
    "cuda_h2d",
    "layout_rule",
    "load",
    "memory_threads",
]

log = logging.getLogger("plestore")

MODES = ("auto", "on", "off")
#: the interface this source expects of the compiled core (constants.h's): an in-place build
#: left from other sources is refused as not built, never half-used
ABI_VERSION = constants.ABI_VERSION
#: feed_serve's counters, a word each (constants.h's C_*): the host steps' totals
FEED_COUNTERS = constants.COUNTERS
#: what feed_serve's return says, by its number (constants.h's S_*)
FEED_STATES = constants.STATES

try:
    from plestore.native import _core
except ImportError as e:  # not built (no compiler at install): the reference serves
    _core = None
    _missing = (
        "no compiled plestore/native/_core for this Python"
        if e.name in ("plestore.native._core", "plestore.native")
        else str(e)
    )
else:
    _missing = ""
    built = getattr(_core, "ABI_VERSION", 1)
    if built != ABI_VERSION or not constants.built_from(_core):
        _missing = (
            f"plestore/native/_core was built from other sources (interface {built}, these "
            f"need {ABI_VERSION} and constants.h's values); rebuild it: "
            "python3 setup.py build_ext --inplace"
        )
        _core = None

_warned = False


def available() -> bool:
    return _core is not None


def load(mode: str = "auto") -> ModuleType:
    """The host core for `mode` (auto | on | off): the compiled one, or the numpy reference."""
    global _warned
    if mode == "on" and _core is None:
        raise RuntimeError(
            f"native=on but plestore's native core is not built ({_missing}); reinstall "
            "with a C compiler (pip install -e .) or use native=auto|off"
        )
    if mode != "off" and _core is not None:
        return _core
    if mode != "off" and not _warned:
        _warned = True
        log.warning(
            "plestore: native host core not built (%s); the numpy reference host core serves",
            _missing,
        )
    from plestore.native import reference  # (imports torch: only where it serves)

    return reference


def memory_threads(threads: int) -> int:
    """Threads for a gather from memory: at most one per core (past that they only contend)."""
    return max(1, min(threads, len(os.sched_getaffinity(0))))


def layout_rule(layout) -> tuple[int, int, int]:
    """A RowLayout's offsets as the core's one rule, (rows per block, block bytes, row stride):
    offset = (row // rpb) * block + (row % rpb) * stride."""
    if layout.block_bytes == 0:
        return 1, layout.row_stride, layout.row_stride
    if layout.rows_per_block == 0:
        return 1, layout.row_span, layout.row_span
    return layout.rows_per_block, layout.block_bytes, layout.row_stride


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")  # (the driver library torch's CUDA runtime loaded)
    except OSError:
        return None


@functools.cache
def cuda_h2d() -> int | None:
    """The address of CUDA's `cuMemcpyHtoDAsync_v2` for `GatherJob.copy`, or None where there is
    no CUDA driver library (the host path then queues its copies through torch)."""
    lib = _libcuda()
    fn = getattr(lib, "cuMemcpyHtoDAsync_v2", None) if lib is not None else None
    return ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else None


#: CUDA's stream capture modes (CUstreamCaptureMode)
CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL, CAPTURE_RELAXED = 0, 1, 2
#: CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1: cuStreamWaitValue / WriteValue usable
STREAM_MEM_OPS = 92


def cuda_capture_mode(mode: int) -> int:
    """Set this thread's stream capture mode (cuThreadExchangeStreamCaptureMode), returning the
    one before: RELAXED lets a capturing thread make calls a global capture forbids (pinning
    memory, loading a module); -1 where there is no driver library."""
    lib = _libcuda()
    if lib is None:
        return -1
    m = ctypes.c_int(mode)
    if lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(m)) != 0:
        return -1
    return m.value


def cuda_device_attribute(attribute: int, device: int = 0) -> int | None:
    """A CUDA device attribute (cuDeviceGetAttribute), or None where the driver does not say."""
    lib, value = _libcuda(), ctypes.c_int(0)
    if lib is None or lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) != 0:
        return None
    return value.value


def cuda_error(code: int) -> str:
    """A CUDA driver error code's name (cuGetErrorName), e.g. CUDA_ERROR_INVALID_VALUE."""
    name = ctypes.c_char_p()
    lib = _libcuda()
    if lib is None or lib.cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
        return f"CUDA error {code}"
    return name.value.decode()
