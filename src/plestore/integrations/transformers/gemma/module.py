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

import torch

from plestore.hashing.identity import IdentityHash
from plestore.integrations.transformers.common.served import TableServed
from plestore.lookup import Table

__all__ = ["PerLayerEmbedding"]


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
