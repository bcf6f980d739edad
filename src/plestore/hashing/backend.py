"""numpy or torch through one small shim: hashers are written once against `Backend`, and
indexing, ^, *, % and comparisons are shared by both array kinds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["Array", "Backend", "is_torch", "same_kind"]

Array = Any  # np.ndarray | torch.Tensor


def is_torch(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def same_kind(x: Any, like: Any) -> Any:
    """Per-request state `x` as the kind of the ids `like` (numpy, or torch on their device):
    a state made by `fresh_context()` (numpy) serves torch ids and the other way round."""
    if is_torch(like) and not is_torch(x):
        return torch.as_tensor(np.asarray(x), device=like.device)
    if is_torch(x) and not is_torch(like):
        return x.cpu().numpy()
    return x


class Backend:
    """The few array calls that differ between numpy and torch, for the kind of `input_ids`.

    Hashers are written once against it, so the numpy and torch paths cannot drift apart; the
    tests check both against the golden vectors and a per-token brute force.
    """

    def __init__(self, input_ids: Any) -> None:
        self.torch = is_torch(input_ids)
        self.device = input_ids.device if self.torch else None
        self.kind = f"torch tensors on {self.device}" if self.torch else "numpy arrays"

    # -- inputs (metadata checks only: no device sync) ------------------------------------------
    def ints(self, name: str, x: Any, ndim: int | None = None) -> Array:
        """An integer array of this backend (dtype kept, so range checks see the real values)."""
        if is_torch(x) != self.torch:
            what = f"a {type(x).__name__}"
            raise ValueError(f"{name} is {what}, but input_ids makes this call take {self.kind}")
        if self.torch:
            if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
                raise ValueError(f"{name} must hold integers, got dtype {x.dtype}")
            if x.device != self.device:
                raise ValueError(f"{name} is on {x.device} but input_ids is on {self.device}")
        else:
            x = np.asarray(x)
            if x.size == 0 and x.dtype.kind == "f":  # [] and np.zeros((0, 2)) default to float
                x = x.astype(np.int64)
            if x.dtype.kind not in "iu":
                raise ValueError(f"{name} must hold integers, got dtype {x.dtype}")
        if ndim is not None and x.ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {list(x.shape)}")
        return x

    def mask(self, name: str, x: Any, shape: tuple[int, ...]) -> Array:
        """A bool mask of this backend and shape; None -> all False."""
        if x is None:
            return self.zeros(shape, bool)
        if is_torch(x) != self.torch:
            raise ValueError(f"{name} is a {type(x).__name__}, but this call takes {self.kind}")
        if not self.torch:
            x = np.asarray(x)
            x = x.astype(bool) if x.size == 0 else x
        if not (x.dtype == torch.bool if self.torch else x.dtype == np.bool_):
            raise ValueError(f"{name} must be a bool mask, got dtype {x.dtype}")
        if self.torch and x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but input_ids is on {self.device}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {list(x.shape)}, expected {list(shape)}")
        return x

    def validate(self, ok: Callable[[], Any], explain: Callable[..., None], *arrays: Any) -> None:
        """Raise `explain`'s ValueError if the batch is invalid. numpy: run `explain` (exact,
        cheap). torch: reduce `ok()` to one bool on the device — the one sync — and only if it
        is False copy the arrays to the host for `explain` to name the culprit."""
        if not self.torch:
            explain(*arrays)
        elif not bool(ok()):
            explain(*(None if a is None else a.cpu().numpy() for a in arrays))
            raise ValueError("invalid batch")  # unreachable: explain checks at least as much

    # -- array calls ---------------------------------------------------------------------------
    def int64(self, a: Array) -> Array:
        return a.long() if self.torch else np.asarray(a, dtype=np.int64)

    def arange(self, n: int) -> Array:
        if self.torch:
            return torch.arange(n, dtype=torch.int64, device=self.device)
        return np.arange(n, dtype=np.int64)

    def zeros(self, shape: tuple[int, ...], dtype: type = int) -> Array:
        if self.torch:
            return torch.zeros(
                shape, dtype=torch.bool if dtype is bool else torch.int64, device=self.device
            )
        return np.zeros(shape, dtype=bool if dtype is bool else np.int64)

    def full(self, shape: tuple[int, ...], value: int) -> Array:
        if self.torch:
            return torch.full(shape, value, dtype=torch.int64, device=self.device)
        return np.full(shape, value, dtype=np.int64)

    def empty(self, shape: tuple[int, ...]) -> Array:
        if self.torch:
            return torch.empty(shape, dtype=torch.int64, device=self.device)
        return np.empty(shape, dtype=np.int64)

    def where(self, cond: Array, a: Any, b: Any) -> Array:
        return torch.where(cond, a, b) if self.torch else np.where(cond, a, b)

    def clip(self, a: Array, low: int, high: int) -> Array:
        return a.clamp(low, high) if self.torch else np.clip(a, low, high)

    def remainder(self, a: Array, b: Array) -> Array:
        """Floor mod (torch.remainder semantics; ids are non-negative anyway)."""
        return torch.remainder(a, b) if self.torch else np.remainder(a, b)

    def flip_cols(self, a: Array) -> Array:
        return a.flip(1) if self.torch else a[:, ::-1]

    def segments(self, qsl: Array, num_tokens: int) -> Array:
        """[T] the request each token belongs to (empty requests own no token)."""
        t = self.arange(num_tokens)
        if self.torch:
            return torch.searchsorted(qsl[1:].contiguous(), t, right=True)
        return np.searchsorted(qsl[1:], t, side="right").astype(np.int64)

    def tables(self, cache: dict, arrays: tuple) -> tuple:
        """numpy constants as they are, or as tensors on this device (made once per device,
        so that CUDA-graph capture never meets a host->device copy)."""
        if not self.torch:
            return arrays
        if self.device not in cache:
            cache[self.device] = tuple(
                None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
                for a in arrays
            )
        return cache[self.device]
