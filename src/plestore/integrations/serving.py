"""What every engine's plugin does around its loader, engine-agnostic (no engine import): find
the checkpoint directory, open a packed table checked against the engine's shapes
(`open_served`), publish its counters to the engine's /metrics, and close it when the worker
exits (`close_at_exit`)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable

from plestore.integrations.metrics import publish
from plestore.lookup import Table
from plestore.tablefile import TableFile

__all__ = ["close_at_exit", "log_served", "model_dir_of", "open_served", "run_once"]


def run_once(entry: Callable[[], None]) -> Callable[[], None]:
    """A plugin's entry point run once a process, by whichever thread calls it first (engines
    call it in every worker process, and some more than once)."""
    lock, ran = threading.Lock(), []

    @functools.wraps(entry)
    def once() -> None:
        with lock:
            if not ran:
                ran.append(True)
                entry()

    return once


def model_dir_of(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The checkpoint directory: the model path, or its snapshot in the Hugging Face cache (the
    engine downloaded it before loading the weights)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(
        model, revision=revision, cache_dir=download_dir, local_files_only=True
    )


def open_served(meta, options, rows: int, dim: int, what: str, scale: float | None = None):
    """The packed table at `meta` opened with `options` (at `scale`, where the engine applies
    the table's own scale itself), checked to be [rows, dim] as the engine built `what`, its
    counters published to the engine's /metrics (metrics.py), and closed when the worker
    exits."""
    tf = TableFile.open(meta)
    table = Table(tf if scale is None else tf.with_scale(scale), options)
    if (table.spec.rows, table.dim) != (rows, dim):
        table.close()
        raise ValueError(f"{meta} is [{table.spec.rows}, {table.dim}]; {what} is [{rows}, {dim}]")
    close_at_exit(table)
    publish(table)
    return table


def log_served(log, prefix: str, rows: tuple[int, int], meta, reused: bool, lookup) -> None:
    """The one line an engine's log gets for each table a plugin serves."""
    log.info(
        "plestore: %s rows [%d, %d) from %s (%s), tier %s%s",
        prefix,
        *rows,
        meta,
        "reused" if reused else "packed",
        lookup.table.tier.name,
        ", captured in CUDA graphs" if lookup.captures else "",
    )


_open = weakref.WeakSet()
_open_lock = threading.Lock()
_registered = False  # _close_all registered with atexit


def close_at_exit(table) -> None:
    """Close `table` when the worker process exits: a node copy (share="node") is removed by
    its last user, not left in /dev/shm."""
    global _registered
    with _open_lock:
        if not _registered:
            atexit.register(_close_all)
            _registered = True
        _open.add(table)


def _close_all() -> None:
    with _open_lock:
        tables = list(_open)
    for table in tables:
        with contextlib.suppress(Exception):  # (exiting: nothing left to report to)
            table.close()
