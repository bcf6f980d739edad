"""What both model classes need around vLLM's loader: the checkpoint directory, its table
tensors left unread, the served tables opened and checked against vLLM's shapes
(`open_served`), and closed when the worker exits (`close_at_exit`)."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import threading
import weakref
from collections.abc import Iterator

from vllm.model_executor.model_loader import weight_utils

from plestore.integrations.vllm.metrics import publish
from plestore.lookup import Table
from plestore.tablefile import TableFile

__all__ = ["ServedTables", "close_at_exit", "model_dir_of", "open_served", "tables_unread"]


def model_dir_of(model_config, load_config) -> str:
    """The checkpoint directory: the model path, or its snapshot in the Hugging Face cache
    (vLLM downloaded it before loading the weights)."""
    if os.path.isdir(model_config.model):
        return model_config.model
    from huggingface_hub import snapshot_download

    return snapshot_download(
        model_config.model,
        revision=model_config.revision,
        cache_dir=load_config.download_dir,
        local_files_only=True,
    )


@contextlib.contextmanager
def tables_unread(tensor: re.Pattern) -> Iterator[None]:
    """vLLM's safetensors iterator skips the tensors `tensor` matches before reading them (its
    `should_skip_weight` hook, rebound for the duration: a whole-file loader format still reads
    them, and the model drops them unused)."""
    original = weight_utils.should_skip_weight

    def should_skip_weight(name: str, *args) -> bool:
        return bool(tensor.search(name)) or original(name, *args)

    weight_utils.should_skip_weight = should_skip_weight
    try:
        yield
    finally:
        weight_utils.should_skip_weight = original


class ServedTables:
    """What the plugin's model classes add around vLLM's loader, mixed in front of vLLM's class:
    the tensors TABLE_TENSOR matches are left unread (whole files of them not even opened), and
    once the rest is loaded `open_tables(model_dir)` opens what serves them. Without plestore
    settings (`plestore_settings` None) vLLM's own loading runs."""

    TABLE_TENSOR: re.Pattern
    plestore_settings = None

    def keep_plestore(self, vllm_config, settings) -> None:
        self.plestore_settings = settings
        self.plestore_source = vllm_config.model_config, vllm_config.load_config

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """Checkpoint files holding only served tables are not read at all."""
        return self.plestore_settings is not None and bool(self.TABLE_TENSOR.search(name))

    def load_weights(self, weights):
        if self.plestore_settings is None:
            return super().load_weights(weights)
        table = self.TABLE_TENSOR
        with tables_unread(table):
            loaded = super().load_weights((n, w) for n, w in weights if not table.search(n))
        self.open_tables(model_dir_of(*self.plestore_source))
        return loaded

    def open_tables(self, model_dir: str) -> None:
        raise NotImplementedError


def open_served(meta, options, rows: int, dim: int, what: str):
    """The packed table at `meta` opened with `options`, checked to be [rows, dim] as vLLM
    built `what`, its counters published to vLLM's /metrics (metrics.py), and closed when the
    worker exits."""
    table = Table(TableFile.open(meta), options)
    if (table.spec.rows, table.dim) != (rows, dim):
        table.close()
        raise ValueError(f"{meta} is [{table.spec.rows}, {table.dim}]; {what} is [{rows}, {dim}]")
    close_at_exit(table)
    publish(table)
    return table


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
