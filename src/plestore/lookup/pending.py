"""`Pending`: a lookup in flight, returned by `Table.prefetch`: a started `Call` (lookup/plan.py)
whose plan says where its host work runs — on the table's worker thread (a future; its GPU work
ordered by an event the caller's stream waits on), at `result()` in the caller's thread
(decode-sized lookups; their one kernel goes straight onto the caller's stream), or, for a
deferred prefetch, a step early at `run_now()` (its plan's `ahead`: its GPU work on the table's
stream, behind an event, like a worker's). Errors of any kind surface from `result()`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plestore.lookup.executor import Executor
    from plestore.lookup.plan import Call

__all__ = ["Pending"]


class Pending:
    """A lookup in flight. `result()` returns the bf16 rows, ordered on the caller's stream."""

    def __init__(
        self,
        executor: Executor,
        call: Call,
        future: Future | None = None,
        ready: Any = None,
        deferred: bool = False,
    ) -> None:
        self._executor, self._context = executor, executor.context
        self.plan = call.plan  # (what it carries out: its route, where it runs)
        self._out, self._shape, self._label = call.out, call.shape, call.label
        self._future, self._ready = future, ready
        self._deferred = call if deferred else None  # a call to run at result(), not yet run
        self._owned = call.plan.make_out  # out made on the table's stream: record the consumer's
        self._error: Exception | None = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Host work finished (GPU work may still be queued)."""
        if self._deferred is not None or self._lock.locked():
            return False
        return self._future is None or self._future.done()

    def run_now(self) -> None:
        """Do deferred host work now, in this thread, without waiting for anything: for a
        caller that has queued GPU work and would otherwise sit idle until it finishes (an
        engine between launching step k and syncing on its tokens, with step k+1's ids known).
        A deferred prefetch's GPU work then goes on the table's stream, beside the caller's
        (its plan's `ahead`); another's on the caller's stream, as at result(). Nothing to do
        for lookups on the worker or on the device. Errors wait for result()."""
        self._run(ahead=True)

    def _run(self, ahead: bool) -> None:
        with self._lock:
            call, self._deferred = self._deferred, None
            if call is not None:
                plan = call.plan.ahead if ahead and call.plan.ahead is not None else call.plan
                try:
                    ready = self._executor.run(call, plan)
                    if ready is not None:  # run ahead: its GPU work is on the table's stream
                        self._ready = ready
                except Exception as e:  # raised from every result(), as a worker's error would be
                    self._error = e

    def result(self, timeout: float | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        self._run(ahead=False)  # (under its lock: a second caller waits for the first's run)
        if self._error is not None:
            raise self._error
        if self._future is not None:
            ctx = self._context
            timeout = ctx.timeout_s if timeout is None else timeout
            try:
                self._ready = self._future.result(timeout=timeout)  # (its GPU work's event)
            except FutureTimeout:
                raise TimeoutError(
                    f"lookup of {self._out.shape[0]} rows from table {ctx.name} "
                    f"({ctx.tier.name} tier) did not finish within {timeout} s"
                ) from None
        if self._ready is not None:
            torch.cuda.current_stream(self._out.device).wait_event(self._ready)
        if self._owned:  # its memory is not reused while the caller's stream may still read it
            self._out.record_stream(torch.cuda.current_stream(self._out.device))
        self._context.metrics.add_wait(self._label, time.perf_counter() - t0)
        return self._out.view(self._shape)
