"""Pinned staging: where a tier reads the rows of a lookup before the GPU decodes them.

`Staging` serves lookups (two, used in turn, each grown on demand and reused only after the GPU
finished with it); `FixedStaging` serves one staged lookup at fixed addresses (a captured decode
reads them), with device copies where the kernel would read too much pinned memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from plestore.io.memory import HostBuffer

__all__ = ["FixedStaging", "Staging", "cached_view", "fill_index", "scatter_index"]

#: views of the staging and the iota kept per shape (lookup sizes of an engine's steps repeat)
_VIEWS = 64


def cached_view(views: dict, key: Any, make: Any) -> torch.Tensor:
    """views[key], made by make() the first time (a decode step's sizes repeat; a torch slice
    and view per lookup cost more than a dict probe); at most _VIEWS kept."""
    view = views.get(key)
    if view is None:
        if len(views) >= _VIEWS:
            views.clear()
        view = views[key] = make()
    return view


def fill_index(index: np.ndarray, inr: np.ndarray | None, present: int) -> None:
    """index[j] = the row in staging that output row j decodes (-1: another rank's id, zeros),
    from this rank's mask `inr` and its count."""
    positions = np.arange(present, dtype=np.int64)
    scatter_index(index, None if present == index.size else inr, positions)


def scatter_index(index: np.ndarray, inr: np.ndarray | None, values: np.ndarray) -> None:
    """index[inr] = values, -1 elsewhere (another rank's ids: zeros); inr None: every row."""
    if inr is None:
        index[:] = values
    else:
        index.fill(-1)
        index[inr] = values


class Staging:
    """Pinned host buffers for one lookup in flight (row bytes + index), grown on demand.
    Reused only after the GPU finished with them (the event of their last use)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.rows: HostBuffer | None = None
        self.index: HostBuffer | None = None
        self.last_use: Any = None
        self._done: Any = None  # the event a lookup through it records (see done)
        self._views: dict = {}  # a shape -> its view of the buffers (see rows_tensor)

    def ensure(self, row_bytes: int, index_items: int) -> None:
        if self.last_use is not None:
            self.last_use.synchronize()
        if self.rows is None or self.rows.nbytes < row_bytes:
            self._views.clear()
            if self.rows is not None:
                self.rows.close()
            self.rows = HostBuffer(max(row_bytes, 1 << 20), pin=self.pin, hugepages=False)
        if self.index is None or self.index.nbytes < index_items * 8:
            self._views.clear()
            if self.index is not None:
                self.index.close()
            self.index = HostBuffer(max(index_items * 8, 1 << 16), pin=self.pin, hugepages=False)

    def done(self) -> Any:
        """An event to mark the GPU done with these buffers: one, recorded again by each lookup
        through them (ensure() waited for its last record; a new event each lookup costs its
        creation)."""
        if self._done is None:
            self._done = torch.cuda.Event()
        return self._done

    def rows_tensor(self, u: int, rb: int) -> torch.Tensor:
        """The first u rows in staging, rb bytes each, uint8 [u, rb], made once per shape."""
        return cached_view(self._views, (u, rb), lambda: self.rows.tensor[: u * rb].view(u, rb))

    def rows_array(self, u: int, rb: int) -> np.ndarray:
        """The first u rows in staging, rb bytes each, numpy uint8 [u, rb], made once per shape."""
        return cached_view(
            self._views, ("np", u, rb), lambda: self.rows.array[: u * rb].reshape(u, rb)
        )

    def index_tensor(self, n: int) -> torch.Tensor:
        """The first n index entries, int64 [n], made once per size."""
        return cached_view(self._views, n, lambda: self.index.tensor[: n * 8].view(torch.int64))

    def close(self) -> None:
        self._views.clear()
        for b in (self.rows, self.index):
            if b is not None:
                b.close()


class FixedStaging:
    """A staged lookup's n rows of rb bytes and its index, pinned at fixed addresses; `device`
    holds copies of both where its plan copies them (the decode copies them first: fixed
    addresses and sizes, still capturable), else None (the kernel reads pinned memory)."""

    def __init__(self, n: int, rb: int, cuda: bool, device: torch.device, copy: bool) -> None:
        self._rows = HostBuffer(n * rb, pin=cuda, hugepages=False)  # row i in staging
        self._index = HostBuffer(n * 8, pin=cuda, hugepages=False)  # out row j <- a row in staging
        self.rows_array = self._rows.array  # uint8 [n * rb]
        self.index_array = self._index.array.view(np.int64)  # [n]
        self.rows = self._rows.tensor.view(n, rb)  # [n, rb]
        self.index = self._index.tensor.view(torch.int64)  # [n]
        self.device = None
        if copy:
            self.device = (
                torch.empty((n, rb), dtype=torch.uint8, device=device),  # [n, rb]
                torch.empty(n, dtype=torch.int64, device=device),  # [n]
            )

    def kernel_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, index) for the kernel: the device copies, made now (queued on the current
        stream), or the pinned buffers themselves."""
        if self.device is None:
            return self.rows, self.index
        self.device[0].copy_(self.rows, non_blocking=True)
        self.device[1].copy_(self.index, non_blocking=True)
        return self.device

    def close(self) -> None:
        self._rows.close()
        self._index.close()
