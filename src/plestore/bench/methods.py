"""Every way of serving the table that the benchmark compares, behind one interface.

The known methods of other engines are re-implemented here from their public descriptions
(shared/spec/qwen4exp-ple.md §4, landscape.md) — no code copied — and read the same packed table
file as plestore's tiers, so only the access method differs. Each returns bf16 rows on the
device, and the benchmark checks every method's output against the resident reference before
timing it.

| method          | what it reproduces                                                         |
|-----------------|----------------------------------------------------------------------------|
| hbm-resident    | the table in GPU memory: one gather + decode (the ceiling)                 |
| pinned-uva      | SGLang/vLLM default: one-row-per-program Triton gather from pinned memory  |
| mmap-fault      | SGLang file backend's pattern: mmap + MADV_RANDOM, one thread faulting     |
| mmap-willneed   | WILLNEED on each distinct page from one thread, then gather (MiaAI, SGLang)|
| mmap-pool       | vLLM ple_mmap: dedup, 32 workers x 2,048-row chunks, coalesced readahead   |
| odirect-pool    | halo-box / llama.cpp direct reads: 64 threads of O_DIRECT 4 KiB preads     |
| vllm-pinned-uva | vLLM 0.34 `cpu_offload` (default on): pinned-uva, under vLLM's name            |
| sglang-pinned-uva | SGLang 0.5.23 `--ple-offload-backend pinned`: pinned-uva, under its name   |
| sglang-file     | SGLang's `file` backend as it runs: mmap-fault, WILLNEED per page of gathers |
|                 | of >= 2,048 rows on one thread, Rss trimmed to a budget every 30 s         |
| vllm-disk-offload | vLLM 0.34 `disk_offload`: unique, WILLNEED per page run, one serial preadv |
|                 | per distinct row, index_select into pinned rows (DiskOffloadStaging)       |
| plestore-<tier> | plestore.open_table(tier=...); `:native=off` the numpy reference host core |
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import plestore
from plestore.formats import get_format
from plestore.io.memory import HostBuffer
from plestore.tablefile import DATA_OFFSET, TableFile

__all__ = [
    "METHODS",
    "DiskOffloadStaging",
    "Method",
    "PinnedUva",
    "SglangFile",
    "make_method",
    "tier_options",
]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class Method:
    """lookup(ids [N] int64 numpy) -> bf16 [N, dim] on the device, finished (synchronised)."""

    name = ""
    disk = False  # reads storage (has a cold case)

    def __init__(self, tf: TableFile, device: torch.device) -> None:
        self.tf, self.device = tf, device
        self.fmt, self.dim, self.rb = get_format(tf.spec.format), tf.spec.dim, tf.layout.row_bytes

    def _decode(self, raw: torch.Tensor) -> torch.Tensor:
        return self.fmt.decode_torch(raw.to(self.device, non_blocking=True), self.tf.spec.scale)

    def lookup(self, ids: np.ndarray) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _load(tf: TableFile, dst: torch.Tensor) -> torch.Tensor:
    """Fill dst [rows, row_bytes] with the whole table, 256 MiB at a time."""
    step = max(1, (256 << 20) // tf.layout.row_bytes)
    for a in range(0, tf.spec.rows, step):
        n = min(step, tf.spec.rows - a)
        dst[a : a + n].copy_(torch.from_numpy(tf.read_range(a, n, drop_cache=True)))
    return dst


class HbmResident(Method):
    name = "hbm-resident"

    def __init__(self, tf, device):
        super().__init__(tf, device)
        self.rows = _load(
            tf, torch.empty((tf.spec.rows, self.rb), dtype=torch.uint8, device=device)
        )

    def lookup(self, ids):
        idx = torch.from_numpy(ids).to(self.device, non_blocking=True)
        return self.fmt.decode_torch(torch.index_select(self.rows, 0, idx), self.tf.spec.scale)


class PinnedUva(Method):
    name = "pinned-uva"

    def __init__(self, tf, device):
        super().__init__(tf, device)
        self.buf = HostBuffer(tf.spec.rows * self.rb, pin=device.type == "cuda")
        self.rows = _load(tf, self.buf.tensor.view(tf.spec.rows, self.rb))

    def lookup(self, ids):
        from plestore.bench.uva_kernel import one_row_per_program_gather

        idx = torch.from_numpy(ids).to(self.device, non_blocking=True)
        return self._decode(one_row_per_program_gather(self.rows, idx))

    def close(self):
        self.rows = None
        self.buf.close()


class _Mapped(Method):
    disk = True

    def __init__(self, tf, device):
        super().__init__(tf, device)
        self.fd = os.open(tf.data_path, os.O_RDONLY)
        self.map = mmap.mmap(self.fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        self.map.madvise(mmap.MADV_RANDOM)
        self.items = np.ndarray(
            (tf.data_bytes - self.rb + 1,),
            np.dtype((np.void, self.rb)),
            buffer=self.map,
            offset=DATA_OFFSET,
            strides=(1,),
        )
        probe = np.frombuffer(self.map, np.uint8, count=1)
        self.base = probe.ctypes.data
        del probe

    def _gather(self, offs: np.ndarray) -> torch.Tensor:
        rows = self.items[offs].view(np.uint8).reshape(len(offs), self.rb)
        return torch.from_numpy(rows)

    def close(self):
        self.items = None
        try:
            self.map.close()
        except BufferError:
            pass
        os.close(self.fd)


class MmapFault(_Mapped):
    name = "mmap-fault"

    def lookup(self, ids):
        return self._decode(self._gather(self.tf.layout.offsets(ids)))


class MmapWillneed(_Mapped):
    name = "mmap-willneed"

    def lookup(self, ids):
        offs = self.tf.layout.offsets(ids)
        for page in np.unique((offs + DATA_OFFSET) // mmap.PAGESIZE).tolist():
            _libc.madvise(self.base + page * mmap.PAGESIZE, mmap.PAGESIZE, mmap.MADV_WILLNEED)
        return self._decode(self._gather(offs))


class SglangFile(_Mapped):
    """SGLang 0.5.23's `file` backend (shared/spec/sglang.md): the mapping (MADV_RANDOM)
    faulted row by row by the gather; a gather of >= `prefetch_rows` first queues WILLNEED on
    each distinct page to one background thread (its prefetcher); a daemon thread drops the
    mapping's pages in 1 GiB slices every `interval_s` once its Rss passes `budget` (its
    trimmer; SGLANG_QWEN4_PLE_RSS_BUDGET_GB, _RSS_INTERVAL_S)."""

    name = "sglang-file"
    prefetch_rows, budget, interval_s = 2048, 8 << 30, 30.0

    def __init__(self, tf, device):
        super().__init__(tf, device)
        self.pool = ThreadPoolExecutor(1)
        self.stop, self.trims = threading.Event(), 0
        self.trimmer = threading.Thread(target=self._trim_loop, daemon=True)
        self.trimmer.start()

    def lookup(self, ids):
        offs = self.tf.layout.offsets(ids)
        if ids.size >= self.prefetch_rows:
            first = (offs + DATA_OFFSET) // mmap.PAGESIZE
            last = (offs + DATA_OFFSET + self.rb - 1) // mmap.PAGESIZE
            self.pool.submit(self._advise, np.unique(np.concatenate([first, last])))
        return self._decode(self._gather(offs))

    def _advise(self, pages: np.ndarray) -> None:
        for page in pages.tolist():
            os.posix_fadvise(self.fd, page * mmap.PAGESIZE, mmap.PAGESIZE, os.POSIX_FADV_WILLNEED)

    def resident_bytes(self) -> int:
        from plestore.tiers.mapped import mapping_rss

        return mapping_rss(str(self.tf.data_path.resolve()))

    def _trim_loop(self) -> None:
        while not self.stop.wait(self.interval_s):
            if self.resident_bytes() <= self.budget:
                continue
            self.trims += 1
            for start in range(0, len(self.map), 1 << 30):
                self.map.madvise(mmap.MADV_DONTNEED, start, min(1 << 30, len(self.map) - start))
                self.stop.wait(0.005)

    def close(self):
        self.stop.set()
        self.trimmer.join()
        self.pool.shutdown()
        super().close()


class MmapPool(_Mapped):
    name = "mmap-pool"
    workers, chunk, readahead_runs = 32, 2048, 4096

    def __init__(self, tf, device):
        super().__init__(tf, device)
        self.pool = ThreadPoolExecutor(self.workers)

    def lookup(self, ids):
        uniq, inv = np.unique(ids, return_inverse=True)
        offs = self.tf.layout.offsets(uniq) + DATA_OFFSET
        ends = offs + self.rb
        breaks = np.flatnonzero(offs[1:] != ends[:-1]) + 1  # coalesce only abutting rows
        starts, stops = offs[np.r_[0, breaks]], ends[np.r_[breaks - 1, len(offs) - 1]]
        if len(starts) <= self.readahead_runs:
            for s, e in zip(starts.tolist(), stops.tolist(), strict=True):
                os.posix_fadvise(self.fd, s, e - s, os.POSIX_FADV_WILLNEED)
        out = np.empty(len(uniq), np.dtype((np.void, self.rb)))

        def work(a):
            out[a : a + self.chunk] = self.items[offs[a : a + self.chunk] - DATA_OFFSET]

        list(self.pool.map(work, range(0, len(uniq), self.chunk)))
        rows = torch.from_numpy(out.view(np.uint8).reshape(len(uniq), self.rb)[inv])
        return self._decode(rows)

    def close(self):
        self.pool.shutdown()
        super().close()


class ODirectPool(Method):
    name = "odirect-pool"
    disk = True
    threads, page = 64, 4096

    def __init__(self, tf, device):
        super().__init__(tf, device)
        self.fd = os.open(tf.data_path, os.O_RDONLY | os.O_DIRECT)
        self.pool = ThreadPoolExecutor(self.threads)

    def lookup(self, ids):
        offs = self.tf.layout.offsets(ids) + DATA_OFFSET
        first = offs // self.page * self.page
        span = -(-(offs + self.rb - first) // self.page) * self.page  # 1 or 2 pages per row
        pages, which = np.unique(first, return_inverse=True)
        width = int(span.max())
        buf = HostBuffer(len(pages) * width)
        staged = buf.array.reshape(len(pages), width)
        plist = pages.tolist()

        def work(part):
            for i in part.tolist():
                os.preadv(self.fd, [memoryview(staged[i])], plist[i])

        list(self.pool.map(work, np.array_split(np.arange(len(pages)), self.threads)))
        pos = which * width + (offs - first)
        items = np.ndarray(
            (buf.nbytes - self.rb + 1,),
            np.dtype((np.void, self.rb)),
            buffer=buf.array,
            strides=(1,),
        )
        rows = torch.from_numpy(items[pos].view(np.uint8).reshape(len(ids), self.rb))
        out = self._decode(rows)
        del items
        buf.close()
        return out

    def close(self):
        self.pool.shutdown()
        os.close(self.fd)


class DiskOffloadStaging:
    """vLLM 0.34 `disk_offload`'s host half of a step, from its description (shared/spec/vllm.md
    "vLLM 0.33 / 0.34"), not its code: ids (on the host) -> their rows in pinned host memory by
    `np.unique`, `posix_fadvise(WILLNEED)` over each run of pages, one serial `os.preadv` per
    distinct row (Python) and `index_select` into the pinned rows. One plane: a packed row holds
    codes and scales together (vLLM reads each plane of a row this way, one after another)."""

    page = 4096

    def __init__(self, tf: TableFile, max_ids: int, pin: bool) -> None:
        self.tf, self.rb, self.max_ids = tf, tf.layout.row_bytes, max_ids
        self.fd = os.open(tf.data_path, os.O_RDONLY)
        self._uniq = HostBuffer(max_ids * self.rb, hugepages=False)  # the distinct rows read
        self._rows = HostBuffer(max_ids * self.rb, pin=pin, hugepages=False)  # in id order
        self.uniq = self._uniq.tensor.view(max_ids, self.rb)
        self.rows = self._rows.tensor.view(max_ids, self.rb)
        arr = self._uniq.array.reshape(max_ids, self.rb)
        self._slots = [memoryview(arr[i]) for i in range(max_ids)]

    def stage(self, ids: np.ndarray) -> torch.Tensor:
        """uint8 [n, row_bytes] pinned: the rows of ids [n], read from the file now."""
        uniq, inv = np.unique(ids, return_inverse=True)
        offs = self.tf.layout.offsets(uniq) + DATA_OFFSET
        pages = np.unique(np.concatenate([offs // self.page, (offs + self.rb - 1) // self.page]))
        cut = np.flatnonzero(np.diff(pages) != 1) + 1
        for run in np.split(pages, cut):  # WILLNEED over each run of pages
            first, count = int(run[0]), len(run)
            os.posix_fadvise(self.fd, first * self.page, count * self.page, os.POSIX_FADV_WILLNEED)
        for slot, off in zip(self._slots, offs.tolist(), strict=False):  # one preadv a row
            os.preadv(self.fd, [slot], off)
        out = self.rows[: ids.size]
        torch.index_select(self.uniq[: uniq.size], 0, torch.from_numpy(inv.reshape(-1)), out=out)
        return out

    def close(self) -> None:
        self._slots = []
        os.close(self.fd)
        self._uniq.close()
        self._rows.close()


class VllmDiskOffload(Method):
    name = "vllm-disk-offload"
    disk = True

    def __init__(self, tf, device):
        super().__init__(tf, device)
        self.staging: DiskOffloadStaging | None = None

    def lookup(self, ids):
        if self.staging is None or self.staging.max_ids < ids.size:
            if self.staging is not None:
                self.staging.close()
            self.staging = DiskOffloadStaging(self.tf, ids.size, self.device.type == "cuda")
        return self._decode(self.staging.stage(ids))

    def close(self):
        if self.staging is not None:
            self.staging.close()


class Plestore(Method):
    def __init__(self, tf, device, tier: str, **options):
        super().__init__(tf, device)
        self.name = f"plestore-{tier}"
        self.disk = tier in ("mapped", "direct")
        self.table = plestore.open_table(tf.meta_path, tier=tier, device=str(device), **options)
        self._staging: HostBuffer | None = None
        if not self.table.tier.can_read_host:
            self.read_alone = None

    def lookup(self, ids):
        return self.table.lookup(ids[:, None])

    def read_alone(self, ids: np.ndarray) -> None:
        """The tier's read() of ids alone, into pinned staging (host tiers; see LookupResult)."""
        tier = self.table.tier
        if self._staging is None or self._staging.nbytes < ids.size * tier.staging_stride:
            if self._staging is not None:
                self._staging.close()
            pin = self.device.type == "cuda"
            self._staging = HostBuffer(ids.size * tier.staging_stride, pin=pin, hugepages=False)
        out = self._staging.array[: ids.size * tier.staging_stride]
        tier.read(ids, out.reshape(ids.size, tier.staging_stride))

    def close(self):
        if self._staging is not None:
            self._staging.close()
        self.table.close()


METHODS = (
    "hbm-resident",
    "pinned-uva",
    "mmap-fault",
    "mmap-willneed",
    "mmap-pool",
    "odirect-pool",
    "vllm-disk-offload",
    "plestore-device",
    "plestore-pinned",
    "plestore-mapped",
    "plestore-direct",
)
_CLASSES = {
    c.name: c
    for c in (
        HbmResident,
        PinnedUva,
        MmapFault,
        MmapWillneed,
        MmapPool,
        ODirectPool,
        VllmDiskOffload,
        SglangFile,
    )
}
_CLASSES["vllm-pinned-uva"] = PinnedUva  # (vLLM's cpu_offload is this gather)
_CLASSES["sglang-pinned-uva"] = PinnedUva  # (SGLang's pinned backend is this gather)


def split_labels(text: str) -> list[str]:
    """A comma-separated list of `tier[:key=value,...]` labels: a `key=value` item with no colon
    continues the label before it (`direct:a=1,b=2,mapped` -> `direct:a=1,b=2`, `mapped`); an
    option's value may therefore hold no colon."""
    labels: list[str] = []
    for item in filter(None, text.split(",")):
        if labels and ":" in labels[-1] and "=" in item and ":" not in item:
            labels[-1] += f",{item}"
        else:
            labels.append(item)
    return labels


def tier_options(label: str) -> tuple[str, dict]:
    """`tier[:key=value,...]` -> (tier, table options), e.g. `direct:native=off`."""
    tier, _, opts = label.partition(":")
    options: dict = {}
    for kv in filter(None, opts.split(",")):
        key, _, value = kv.partition("=")
        bools = {"true": True, "false": False}
        options[key] = int(value) if value.isdigit() else bools.get(value, value)
    return tier, options


def make_method(name: str, tf: TableFile, device: torch.device, **options) -> Method:
    """A method by name; plestore tiers take table options after a colon, e.g.
    `plestore-pinned:gather=gpu` or `plestore-direct:cache_bytes=0,queue_depth=64`."""
    if name.startswith("plestore-"):
        tier, opts = tier_options(name.removeprefix("plestore-"))
        m = Plestore(tf, device, tier, **{**options, **opts})
        m.name = name
        return m
    if name not in _CLASSES:
        known = ", ".join([*METHODS, *sorted(set(_CLASSES) - set(METHODS))])
        raise ValueError(f"unknown method {name!r}; methods: {known}")
    m = _CLASSES[name](tf, device)
    m.name = name
    return m
