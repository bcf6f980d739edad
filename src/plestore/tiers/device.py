"""`device` tier: the whole row range resident in the device's memory (HBM, or RAM on a CPU).

The ceiling every other tier is measured against: one gather, no host work. Loading streams
the table in 64 MiB pieces, so host memory stays bounded while a 27-48 GiB table uploads.
"""

from __future__ import annotations

import torch

from plestore.io.memory import gpu_available, mem_available
from plestore.tiers.base import Tier, check_fits

__all__ = ["DeviceTier"]


class DeviceTier(Tier):
    name = "device"
    can_read_host = False

    def __init__(self, table, row_range, device, options) -> None:
        super().__init__(table, row_range, device, options)
        nbytes = row_range.rows * self.row_bytes
        if device.type == "cuda":
            check_fits(table.name, self.name, row_range, nbytes, gpu_available(device), "GPU")
        else:
            check_fits(table.name, self.name, row_range, nbytes, mem_available(), "host")
        self.rows = torch.empty((row_range.rows, self.row_bytes), dtype=torch.uint8, device=device)

        def sink(first: int, rows) -> None:
            self.rows[first : first + len(rows)].copy_(torch.from_numpy(rows.copy()))

        try:
            self._stream_range(sink, progress=self._progress_bar("loading into " + str(device)))
        except BaseException:  # (a bad block): the device memory goes back now
            self.rows = None
            raise

    def device_rows(self) -> torch.Tensor:
        self._check_open()
        return self.rows

    def device_bytes(self) -> int:
        return self.rows.numel() if self.device.type != "cpu" else 0

    def host_bytes(self) -> int:
        return self.rows.numel() if self.device.type == "cpu" else 0

    def close(self) -> None:
        super().close()
        self.rows = torch.empty(0, dtype=torch.uint8)
