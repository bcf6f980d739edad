"""`cascade` tier: a device budget, then a pinned budget, then a file tier for the rest.

    rows [start, a)   resident in device memory: the table's GPU row cache holds them as its
                      resident region (`plestore.lookup.gpucache`), so they are hits that
                      never reach this tier
    rows [a, b)       pinned host memory (a `PinnedTier` of that range)
    rows [b, end)     the file: `direct` where O_DIRECT works, else `mapped`

Budgets come from `device_budget_bytes` / `pinned_budget_bytes`, or, when None, from free
memory: the device's free memory less `DEVICE_HEADROOM` (0 on a CPU device: the pinned part is
that memory already), MemAvailable less `PINNED_HEADROOM`. The split and its reason are logged
and reported by `describe()` (and so `Table.stats()`). Rows stay bytes from each part, decoded
by the one kernel: the cascade is exact by construction, as each part is.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from plestore.io.memory import gpu_available, mem_available
from plestore.tiers.base import FedReads, HostPart, ReadStats, RowRange, Tier, check_fits
from plestore.tiers.direct import DirectTier
from plestore.tiers.mapped import MappedTier
from plestore.tiers.pinned import PinnedTier, padded_stride

__all__ = ["CascadePlan", "CascadeTier", "plan_cascade"]

log = logging.getLogger("plestore")

DEVICE_HEADROOM = 16 << 30  # device memory left to the model (weights, KV cache, activations)
PINNED_HEADROOM = 8 << 30  # MemAvailable left after pinning (as AUTO leaves for the pinned tier)


@dataclass(frozen=True)
class CascadePlan:
    device: tuple[int, int]  # rows resident on the device
    pinned: tuple[int, int]  # rows in pinned host memory
    file: tuple[int, int]  # rows read from the file
    file_tier: str  # direct | mapped
    device_bytes: int
    pinned_bytes: int
    reason: str


def plan_cascade(table, row_range: RowRange, device: torch.device, options) -> CascadePlan:
    """Budgets -> row ranges, in order: device, pinned, file."""
    rb, rows = table.layout.row_bytes, row_range.rows
    notes = []
    dev_budget = options.device_budget_bytes
    if dev_budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            dev_budget = max(0, free - DEVICE_HEADROOM)
            notes.append(
                f"device: {free / 2**30:.1f} GiB free less {DEVICE_HEADROOM >> 30} GiB headroom"
            )
        else:
            dev_budget = 0
            notes.append("device: none on a CPU device (the pinned part is that memory)")
    else:
        notes.append(f"device: {dev_budget / 2**30:.2f} GiB requested")
    pin_budget = options.pinned_budget_bytes
    if pin_budget is None:
        avail = mem_available()
        pin_budget = max(0, avail - PINNED_HEADROOM)
        notes.append(
            f"pinned: {avail / 2**30:.1f} GiB available less {PINNED_HEADROOM >> 30} GiB headroom"
        )
    else:
        notes.append(f"pinned: {pin_budget / 2**30:.2f} GiB requested")
    n_dev = min(rows, dev_budget // rb)
    n_pin = min(rows - n_dev, pin_budget // padded_stride(rb))
    a = row_range.start + n_dev
    b = a + n_pin
    _check_budgets(
        table.name,
        options,
        device,
        (RowRange(row_range.start, a), n_dev * rb),
        (RowRange(a, b), n_pin * padded_stride(rb)),
    )
    file_tier = "direct"
    if b < row_range.end:
        from plestore.io.probe import o_direct_alignment

        try:
            o_direct_alignment(table.data_path)
        except OSError as e:
            file_tier = "mapped"
            notes.append(f"file: mapped (no O_DIRECT: {e})")
    reason = (
        f"device rows [{row_range.start}, {a}) {n_dev * rb / 2**30:.2f} GiB, pinned [{a}, {b}) "
        f"{n_pin * padded_stride(rb) / 2**30:.2f} GiB, {file_tier} [{b}, {row_range.end}) "
        f"{(row_range.end - b) * rb / 2**30:.2f} GiB; " + "; ".join(notes)
    )
    return CascadePlan(
        (row_range.start, a),
        (a, b),
        (b, row_range.end),
        file_tier,
        n_dev * rb,
        n_pin * padded_stride(rb),
        reason,
    )


def _check_budgets(name: str, options, device: torch.device, dev: tuple, pin: tuple) -> None:
    """A budget asked for that the memory cannot hold is refused before any row loads, naming
    the option (budgets from free memory fit by construction). dev / pin: (rows, bytes)."""
    fix = "lower {} or leave it unset (a budget from free memory)"
    if options.device_budget_bytes is not None and device.type == "cuda":
        key = "device_budget_bytes"
        check_fits(name, "cascade", *dev, gpu_available(device), "GPU", fix.format(key))
    if options.pinned_budget_bytes is not None:
        key = "pinned_budget_bytes"
        check_fits(name, "cascade", *pin, mem_available(), "host", fix.format(key))


class CascadeTier(Tier):
    name = "cascade"
    can_read_host = True

    def __init__(self, table, row_range, device, options) -> None:
        super().__init__(table, row_range, device, options)
        self.plan = plan_cascade(table, row_range, device, options)
        log.info("plestore: table %s cascade: %s", table.name, self.plan.reason)
        #: rows the table's GPU row cache keeps resident (the device budget)
        self.resident = self.plan.device
        a, b = self.plan.pinned
        self.pinned = PinnedTier(table, RowRange(a, b), device, options) if b > a else None
        # the file tier spans every row (the device rows too: a lookup without the GPU cache
        # still gets them, from the file); it holds only its row cache or mapping
        file_cls = DirectTier if self.plan.file_tier == "direct" else MappedTier
        try:
            self.file = file_cls(table, row_range, device, options)
        except BaseException:  # the pinned part goes back
            if self.pinned is not None:
                self.pinned.close()
            raise
        if self.pinned is not None:  # read() copies the parts' rows on into out on the CPU
            self.pinned.stream_stores = self.file.stream_stores = False
        self.reads_storage = True
        self.exact_disk_bytes = self.file.exact_disk_bytes
        self.prefetch_before_read = self.file.prefetch_before_read

    def _split(self, rows: np.ndarray) -> np.ndarray | None:
        """Mask of rows in the pinned part (None: none are)."""
        if self.pinned is None:
            return None
        a, b = self.plan.pinned
        m = (rows >= a) & (rows < b)
        return m if m.any() else None

    def on_storage(self, rows: np.ndarray) -> np.ndarray:
        pin = self._split(rows)
        return np.ones(len(rows), bool) if pin is None else ~pin

    def read(self, rows: np.ndarray, out: np.ndarray) -> ReadStats:
        self._check_open()
        n = len(rows)
        pin = self._split(rows)
        if pin is None:
            return self.file.read(rows, out)
        rb = self.row_bytes
        ip, ifile = np.flatnonzero(pin), np.flatnonzero(~pin)
        tmp = np.empty((ip.size, self.pinned.staging_stride), np.uint8)
        st = self.pinned.read(rows[ip], tmp)
        out[ip, :rb] = tmp[:, :rb]
        if ifile.size:
            buf = np.empty((ifile.size, self.file.staging_stride), np.uint8)
            fst = self.file.read(rows[ifile], buf)
            out[ifile, :rb] = buf[:, :rb]
            for k in ("cache_hits", "blocks_read", "bytes_read", "major_faults", "minor_faults"):
                setattr(st, k, getattr(st, k) + getattr(fst, k))
        st.rows = n
        return st

    def host_parts(self) -> tuple[HostPart, ...] | None:
        """The pinned part's gather (its rows' bytes, not its padding: the staging's stride is
        the row's) before the file tier's."""
        file = self.file.host_parts()
        if file is None or self.pinned is None:
            return file
        g = self.pinned.gather_source()
        if g is None:
            return None
        return (HostPart(*self.plan.pinned, replace(g, row_bytes=self.row_bytes)), *file)

    def fed_reads(self, reads: FedReads) -> None:
        self.file.fed_reads(reads)

    def check_file(self) -> None:
        self.file.check_file()

    def prefetch(self, rows: np.ndarray) -> None:
        pin = self._split(rows)
        self.file.prefetch(rows if pin is None else rows[~pin])

    def drop_cache(self) -> None:
        self.file.drop_cache()

    def host_bytes(self) -> int:
        return self.file.host_bytes() + (self.pinned.host_bytes() if self.pinned else 0)

    def describe(self) -> dict:
        d = super().describe()
        d["cascade"] = {
            k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.plan).items()
        }
        d["pinned_bytes"] = self.pinned.buffer.nbytes if self.pinned else 0
        d["file"] = self.file.describe()
        return d

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self.file.close()  # (built last: closed first)
        if self.pinned is not None:
            self.pinned.close()
