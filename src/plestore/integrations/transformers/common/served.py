"""`TableServed`: the base of every module that serves rows from a plestore table."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from plestore.lookup import Table

__all__ = ["TableServed", "attach_stats", "served_stats"]


class TableServed(nn.Module):
    """What every module serving rows from a table shares: the table (closed with the module, or
    swapped for another tier's), and a clear error for the offloaded weight's old name."""

    #: (the replaced module's weight attribute, what it was, how to read rows instead)
    OFFLOADED: tuple[str, str, str] = ("weight", "the weight", ".table.lookup(row_ids)")

    def __init__(self, table: Table) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.spec.rows, table.spec.dim
        self._finalizer = weakref.finalize(self, table.close)

    def use_table(self, table: Table, *, close: bool = True) -> Table:
        """Serve rows from another opened table holding the same rows (e.g. the same file on
        another tier). The current table is closed, or with close=False handed back open (the
        caller closes it: e.g. a benchmark switching between tiers). Returns the old table."""
        same = (table.spec.rows, table.spec.dim) == (self.num_embeddings, self.embedding_dim)
        if not same:
            raise ValueError(
                f"table {table.spec.name} is [{table.spec.rows}, {table.spec.dim}], this module "
                f"serves [{self.num_embeddings}, {self.embedding_dim}]"
            )
        old = self.table
        if close:
            self.close()
        else:
            self._finalizer.detach()
        self.table = table
        self._finalizer = weakref.finalize(self, table.close)
        return old

    def close(self) -> None:
        """Close the table (its worker thread, pinned memory, file handles)."""
        self._finalizer()

    def __getattr__(self, name: str) -> Any:
        attr, what, how = self.OFFLOADED
        if name == attr:
            raise AttributeError(
                f"{what} was offloaded to a plestore table ({self.table.file.meta_path}); read "
                f"rows with {how}"
            )
        return super().__getattr__(name)


def served_stats(model: nn.Module) -> dict[str, dict]:
    """Every table serving `model`'s modules: its `stats()`, keyed by the table's name."""
    return {
        m.table.spec.name: m.table.stats() for m in model.modules() if isinstance(m, TableServed)
    }


class _Stats:
    """`model.plestore_stats()`: holds the model weakly (no cycle keeps it, or its tables)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)

    def __call__(self) -> dict[str, dict]:
        model = self._model()
        return {} if model is None else served_stats(model)


def attach_stats(model: nn.Module) -> None:
    """Give a model plestore serves `model.plestore_stats()` (see served_stats)."""
    model.plestore_stats = _Stats(model)
