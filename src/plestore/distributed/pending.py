"""`ShardedPending`: a sharded lookup in flight (see `plestore.distributed.sharded`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from plestore.lookup import Pending

if TYPE_CHECKING:
    from plestore.distributed.sharded import ShardedTable

__all__ = ["ShardedPending"]


class ShardedPending:
    """A sharded lookup in flight: `result()` returns the full rows (or this rank's slice)."""

    def __init__(
        self,
        owner: ShardedTable,
        local: Pending | None,
        n: int,
        shape: tuple,
        out,
        sync: bool,
        ids: Any,
    ):
        self._owner, self._local, self._n, self._shape, self._out = owner, local, n, shape, out
        self.ids = ids  # [..., k] as given (rows mode: which rows are another rank's)
        self._sync, self._issued = sync, False  # sync: its rows land on the caller's stream
        self._work: Any = None
        self._buf: torch.Tensor | None = None  # what the collective combines
        self._result: torch.Tensor | None = None

    def done(self) -> bool:
        """This rank's rows are on their way (their host work finished)."""
        return self._local is None or self._local.done()

    def run_now(self) -> None:
        """As `Pending.run_now`: do deferred host work now, then issue what is ready."""
        if self._local is not None:
            self._local.run_now()
        self._owner._pump()

    def result(self, timeout: float | None = None) -> torch.Tensor:
        if self._result is None:
            self._owner._issue_through(self, timeout)
            self._result = self._owner._finish(self, timeout)
        return self._result
