"""`PerLayerEmbedding`: the drop-in for Gemma's `embed_tokens_per_layer`, rows from a plestore
table instead of a weight on the GPU.

transformers computes (Gemma3nTextScaledWordEmbedding / Gemma4TextScaledWordEmbedding)

    embedding(ids, weight) * embed_scale.to(weight.dtype)        # weight bf16: one bf16 multiply

The table stores the raw weight rows (unscaled), `Table.lookup` returns exactly those rows as
bf16, and forward applies the same multiply to them: a bf16 x bf16 product is computed exactly
in fp32 (8-bit x 8-bit mantissas) and rounded once, on every device, so the result carries the
same bits as the stock module's.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from plestore.hashing.identity import IdentityHash
from plestore.lookup import Table

__all__ = ["PerLayerEmbedding", "TableServed"]


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


class PerLayerEmbedding(TableServed):
    """ids [...] -> per-layer inputs [..., num_hidden_layers * hidden_size_per_layer_input].

    Same forward as the module it replaces: the embed scale (a non-persistent buffer, cast with
    the model like the original), the output dtype of the original weight (tracked through
    `model.to(dtype)` by an empty buffer), out-of-range ids mapped to row 0 where the model does
    that (`out_of_range="zero"`, Gemma 3n) or refused with IndexError (Gemma 4, as nn.Embedding),
    and the output on the ids' device. It holds no weight: `state_dict()` no longer has
    `embed_tokens_per_layer.weight`.
    """

    OFFLOADED = ("weight", "the per-layer embedding weight", ".table.lookup(ids[..., None])")

    def __init__(
        self,
        table: Table,
        *,
        embed_scale: torch.Tensor,
        scalar_embed_scale: float,
        dtype: torch.dtype,
        padding_idx: int | None = None,
        out_of_range: str = "error",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(table)
        self.padding_idx = padding_idx
        self.scalar_embed_scale = float(scalar_embed_scale)
        self.out_of_range = out_of_range
        self.hasher = IdentityHash(self.num_embeddings, out_of_range=out_of_range)
        scale = embed_scale.detach().to(device="cpu").clone()
        self.register_buffer("embed_scale", scale.to(device), persistent=False)
        self.register_buffer("dtype_ref", torch.empty(0, dtype=dtype, device=device), False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weight this module replaces (follows `model.to(dtype)`)."""
        return self.dtype_ref.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Gemma 3n: ids outside [0, rows) -> 0 (on the ids' device, no sync); Gemma 4: as they are
        ids = self.hasher.row_ids(input_ids, check=False)
        rows = self.table.lookup(ids.unsqueeze(-1))  # bf16 [..., dim] on the table's device
        rows = rows.to(device=input_ids.device, dtype=self.dtype)
        return rows * self.embed_scale.to(device=rows.device, dtype=self.dtype)

    def reset_embed_scale(self) -> None:
        """Set embed_scale as transformers' `_init_weights` does (constant_ of the python float)
        — needed after from_pretrained replaced the non-persistent buffers with empty ones."""
        with torch.no_grad():
            self.embed_scale.fill_(self.scalar_embed_scale)

    def extra_repr(self) -> str:
        spec = self.table.spec
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, table={spec.name} ({spec.format}, "
            f"tier={self.table.tier.name}, {self.table.device}), out_of_range={self.out_of_range}"
        )
