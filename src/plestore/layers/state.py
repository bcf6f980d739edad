"""Per-request state carried between engine steps, in a fixed pool of slots.

A request holds one slot from its first chunk to its end. The slot keeps:
* its n-gram context: the last `ngram_size - 1` token ids it has seen, oldest first (all EOS
  when fresh, spec §1.5) — stored only; hashing reads it elsewhere;
* one conv state per PLE layer: `[C*H, (K-1)*D]` (zeros when fresh, spec §3).

A slot is reset when allocated, so a fresh request needs no `has_initial_state=False`: its
state already reads as zeros/EOS. Slot bookkeeping lives on the host; gather/scatter index the
device tensors with the slot ids.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from plestore.layers.ops import history_index

if TYPE_CHECKING:
    from plestore.layers.qwen4exp import Qwen4ExpPLEConfig

__all__ = ["RequestState", "StatePool", "StatePoolError", "advance_context"]


class StatePoolError(RuntimeError):
    """A slot was used after free / never allocated, or the pool is exhausted."""


class RequestState(NamedTuple):
    context: Tensor  # [R, ngram_size - 1] int64, oldest first
    conv: Tensor  # [layers, R, C*H, (K-1)*D]


def advance_context(context: Tensor, token_ids: Tensor, query_start_loc: Tensor) -> Tensor:
    """New n-gram context per request after this step: the last `n-1` entries of
    `[old context | this request's tokens]` (spec §1.5). context [R, n-1], token_ids [T] (T may
    include padding after query_start_loc[-1]); returns [R, n-1] with context's dtype."""
    r, width = context.shape
    qsl = query_start_loc.to(context.device).long()
    src = torch.cat([context.reshape(-1), token_ids.to(context.dtype)])  # [R*(n-1) + T]
    lengths = qsl[1:] - qsl[:-1]  # [R]
    cols = lengths[:, None] - width + torch.arange(width, device=context.device)  # [R, n-1]
    reqs = torch.arange(r, device=context.device)[:, None].expand(r, width)
    return src[history_index(qsl, reqs, cols, width)]


class StatePool:
    """`num_slots` request states. `allocate()` hands out a reset slot, `free(slot)` returns it;
    `gather`/`scatter` (all state) and `conv`/`set_conv` (one layer) read and write by slot.
    Using a slot that is not allocated raises `StatePoolError` naming it."""

    def __init__(
        self,
        num_slots: int,
        *,
        context_width: int,
        context_fill: int,
        conv_layers: int,
        conv_channels: int,
        conv_width: int,
        conv_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        context_device: torch.device | str | None = None,
    ) -> None:
        """`context_device` (default: `device`) may differ from the conv state's: engines that
        hash on the host keep the n-gram contexts there, the conv states next to the model."""
        for name, v in (
            ("num_slots", num_slots),
            ("context_width", context_width),
            ("conv_channels", conv_channels),
            ("conv_width", conv_width),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"StatePool {name} must be a positive int, got {v!r}")
        if not isinstance(conv_layers, int) or conv_layers < 0:
            raise ValueError(f"StatePool conv_layers must be an int >= 0, got {conv_layers!r}")
        self.num_slots, self.context_fill = num_slots, context_fill
        self.context = torch.full(
            (num_slots, context_width),
            context_fill,
            dtype=torch.int64,
            device=device if context_device is None else context_device,
        )
        self.conv_state = torch.zeros(
            conv_layers, num_slots, conv_channels, conv_width, dtype=conv_dtype, device=device
        )
        self._free: deque[int] = deque(range(num_slots))
        self._live = [False] * num_slots
        self._was_freed = [False] * num_slots

    @classmethod
    def for_qwen4exp(
        cls,
        config: Qwen4ExpPLEConfig,
        num_slots: int,
        *,
        num_ple_layers: int,
        eos_token_id: int,
        ngram_size: int | None = None,
        device: torch.device | str | None = None,
        context_device: torch.device | str | None = None,
    ) -> StatePool:
        """Pool for a Qwen4Exp model: context of ngram_size-1 EOS, one conv state per PLE layer
        shaped by `config`. ngram_size defaults to config.dilation (the model dilates the conv
        by ngram_size)."""
        ngram_size = config.dilation if ngram_size is None else ngram_size
        return cls(
            num_slots,
            context_width=ngram_size - 1,
            context_fill=eos_token_id,
            conv_layers=num_ple_layers,
            conv_channels=config.channels,
            conv_width=config.state_width,
            conv_dtype=config.dtype,
            device=device,
            context_device=context_device,
        )

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot, reset to a fresh request's state (EOS context, zero conv state)."""
        if not self._free:
            raise StatePoolError(
                f"state pool exhausted: all {self.num_slots} slots are in use; free finished "
                "requests first or make the pool larger"
            )
        slot = self._free.popleft()
        self._live[slot], self._was_freed[slot] = True, False
        self.context[slot] = self.context_fill
        self.conv_state[:, slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.check([slot], "free")
        self._live[slot], self._was_freed[slot] = False, True
        self._free.append(slot)

    def gather(self, slots: Sequence[int] | Tensor) -> RequestState:
        """Copies of the state of `slots` (request order), ready to feed a step."""
        idx = self._index(slots, "gather")
        return RequestState(self.context[idx], self.conv_state[:, idx.to(self.conv_state.device)])

    def scatter(self, slots: Sequence[int] | Tensor, state: RequestState) -> None:
        """Write back the state of `slots` after a step (shapes as `gather` returns them)."""
        idx = self._index(slots, "scatter", unique=True)
        self.context[idx] = state.context.to(self.context.device, self.context.dtype)
        self.conv_state[:, idx.to(self.conv_state.device)] = state.conv.to(self.conv_state.dtype)

    def conv(self, slots: Sequence[int] | Tensor, layer: int) -> Tensor:
        """Conv state of PLE layer `layer` (dense index) for `slots`: [R, C*H, (K-1)*D]."""
        idx = self._index(slots, "read conv state of").to(self.conv_state.device)
        return self.conv_state[self._layer(layer), idx]

    def set_conv(self, slots: Sequence[int] | Tensor, layer: int, value: Tensor) -> None:
        idx = self._index(slots, "write conv state of", unique=True).to(self.conv_state.device)
        self.conv_state[self._layer(layer), idx] = value.to(self.conv_state.dtype)

    # ------------------------------------------------------------------------------------------
    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.conv_state.shape[0]:
            raise ValueError(f"no PLE layer {layer}: the pool holds {self.conv_state.shape[0]}")
        return layer

    def _index(self, slots: Sequence[int] | Tensor, what: str, unique: bool = False) -> Tensor:
        ids = slots.tolist() if isinstance(slots, Tensor) else [int(s) for s in slots]
        self.check(ids, what)
        if unique and len(set(ids)) != len(ids):
            raise ValueError(f"cannot {what} slots {ids}: a slot appears twice")
        return torch.tensor(ids, dtype=torch.int64, device=self.context.device)

    def check(self, ids: list[int], what: str) -> None:
        """Raise StatePoolError naming the first of `ids` that is not an allocated slot."""
        for s in ids:
            if not 0 <= s < self.num_slots:
                raise StatePoolError(
                    f"cannot {what} slot {s}: the pool has slots 0..{self.num_slots - 1}"
                )
            if not self._live[s]:
                if self._was_freed[s]:
                    raise StatePoolError(
                        f"cannot {what} slot {s}: it was freed (state used after free)"
                    )
                raise StatePoolError(f"cannot {what} slot {s}: it was never allocated")
