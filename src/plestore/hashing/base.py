"""What every hasher shares: the `Hasher` base the lookup engine calls, and batch validation.

A batch is ragged: `input_ids` [T] holds every request's new tokens back to back and
`query_start_loc` [R+1] says where each request starts (vLLM's convention). Hashers accept numpy
arrays (and Python lists) or torch tensors, and answer in kind: numpy in -> numpy out, torch in ->
torch out on the same device.

Validation is exact and names the culprit (request r, position j in its chunk), because a wrong
row id is silent: it fetches a real, plausible row. On CUDA the checks cost one device->host sync,
so every hasher takes `check=False` for callers that vouch for their ids (CUDA-graph capture);
the unchecked path has no host round trip and never reads out of bounds (indices are clamped),
but gives meaningless ids for invalid input.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from plestore.spec import HashSpec

Array = Any  # np.ndarray | torch.Tensor


class Hasher(ABC):
    """Token ids -> table row ids, one table (or a group of tables sharing a hash).

    The uniform call is `step(input_ids, query_start_loc, state, **extras) -> (ids, next_state)`
    with ids int64 [T, heads]; `fresh_state(R)` is the state of R new requests. Each hasher also
    has its own richer `row_ids(...)`; see the subclasses.
    """

    kind: str
    spec: HashSpec

    @property
    @abstractmethod
    def heads(self) -> int:
        """Row ids per token (columns of `step`'s output)."""

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Rows of the table the ids address (ids are in [0, num_rows))."""

    @abstractmethod
    def fresh_state(self, num_requests: int, device: str | torch.device | None = None) -> Any:
        """Per-request state of `num_requests` requests that have seen no token yet."""

    @abstractmethod
    def step(
        self,
        input_ids: Array,
        query_start_loc: Array,
        state: Any,
        *,
        check: bool = True,
        **extras: Any,
    ) -> tuple[Array, Any]:
        """Row ids [T, heads] of one engine step and the state to pass with the next step."""

    def check_checkpoint_constants(self, **stored: Any) -> None:
        """Refuse hash constants a checkpoint ships (e.g. `layer_multipliers=`,
        `ngram_heads_vocab_sizes=`, `ngram_heads_offsets=`) that disagree with this hash.

        The engines copy them over the derived values without comparing; a disagreement means
        the table was built with another hash, so we raise (`plestore.spec.check_hash_constants`).
        """
        from plestore.spec import check_hash_constants

        check_hash_constants(self.spec, **stored)


def make_hash(spec: HashSpec, **kwargs: Any) -> Hasher:
    """The hasher of a `HashSpec` (e.g. `TableSpec.hash`). `kwargs` go to its constructor
    (Engram: `token_map=`)."""
    from plestore.hashing.engram import EngramHash
    from plestore.hashing.identity import IdentityHash
    from plestore.hashing.qwen4exp import Qwen4ExpHash
    from plestore.spec import EngramHashSpec, IdentityHashSpec, Qwen4ExpHashSpec

    if isinstance(spec, Qwen4ExpHashSpec):
        return Qwen4ExpHash.from_spec(spec, **kwargs)
    if isinstance(spec, EngramHashSpec):
        return EngramHash.from_spec(spec, **kwargs)
    if isinstance(spec, IdentityHashSpec):
        return IdentityHash.from_spec(spec, **kwargs)
    raise ValueError(f"no hasher for {type(spec).__name__}; expected a plestore.spec HashSpec")


# ----------------------------------------------------------------------------------------------
# Arrays: numpy or torch through one small shim; indexing, ^, *, % and comparisons are shared
# ----------------------------------------------------------------------------------------------


def is_torch(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


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


# ----------------------------------------------------------------------------------------------
# Validation messages (numpy; torch inputs reach them only once a batch is known to be bad)
# ----------------------------------------------------------------------------------------------


def check_request_count(num_tokens: int, qsl_len: int) -> None:
    if qsl_len < 1 or (qsl_len == 1 and num_tokens):
        raise ValueError(
            f"query_start_loc has {qsl_len} entries; it needs R+1 (one per request, plus the "
            f"end) for {num_tokens} tokens"
        )


def check_query_start_loc(qsl: np.ndarray, num_tokens: int) -> None:
    """qsl[0] == 0, non-decreasing, qsl[-1] == T (empty requests allowed)."""
    if int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(qsl[0])}")
    steps = np.diff(qsl.astype(np.int64))
    if steps.size and steps.min() < 0:
        r = int(np.argmax(steps < 0))
        raise ValueError(
            f"query_start_loc is not monotone: request {r} ends at {int(qsl[r + 1])}, before its "
            f"start {int(qsl[r])}"
        )
    if int(qsl[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc ends at {int(qsl[-1])}, but input_ids holds {num_tokens} tokens"
        )


def locate(qsl: np.ndarray, t: int) -> tuple[int, int]:
    """(request, position in its chunk) of flat token index t."""
    r = int(np.searchsorted(qsl[1:], t, side="right"))
    return r, t - int(qsl[r])


def check_token_range(
    ids: np.ndarray,
    qsl: np.ndarray,
    high: int,
    what: str = "vocabulary",
    skip: np.ndarray | None = None,
) -> None:
    """Every id (except where `skip`) in [0, high); else name the first offender."""
    bad = (ids < 0) | (ids >= high)
    if skip is not None:
        bad &= ~skip
    if bad.any():
        t = int(np.argmax(bad))
        r, j = locate(qsl, t)
        raise ValueError(
            f"input_ids[{t}] = {int(ids[t])} (request {r}, position {j} of its chunk) is outside "
            f"the {what} [0, {high})"
        )


def check_state_range(
    name: str,
    state: np.ndarray,
    high: int,
    meaning: str,
    allowed: tuple[int, ...] = (),
    skip: np.ndarray | None = None,
) -> None:
    """Every entry of a per-request [R, w] state in [0, high) (or in `allowed`)."""
    bad = (state < 0) | (state >= high)
    for v in allowed:
        bad &= state != v
    if skip is not None:
        bad &= ~skip
    if bad.any():
        r, k = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}[{r}, {k}] = {int(state[r, k])} (request {r}, {meaning} {k}) is outside "
            f"[0, {high})"
        )


def qsl_ok(qsl: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Device-side: the conditions `check_query_start_loc` checks, as one bool tensor."""
    return (qsl[0] == 0) & (qsl[-1] == num_tokens) & (qsl[1:] >= qsl[:-1]).all()


def sanitize_query_start_loc(qsl: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Unchecked torch path: force qsl into a valid shape (start 0, monotone, end T) with fixed-
    shape ops, so that invalid input gives wrong ids rather than an out-of-bounds gather (which
    would poison the CUDA context)."""
    inner = qsl[1:-1].clamp(0, num_tokens)
    if inner.numel():
        inner = torch.cummax(inner, 0).values
    zero = torch.zeros(1, dtype=qsl.dtype, device=qsl.device)
    end = torch.full((1,), num_tokens, dtype=qsl.dtype, device=qsl.device)
    return torch.cat([zero, inner, end]) if qsl.shape[0] > 1 else zero


# ----------------------------------------------------------------------------------------------
# The ragged layout both n-gram hashes gather from
# ----------------------------------------------------------------------------------------------


class RaggedLayout:
    """Per request, `[carried (width, oldest first) | this chunk's tokens]`, all requests in one
    flat buffer of T + R*width entries, so that predecessor s <= width of token t sits at
    `tok_pos[t] - s`, always inside t's own request. Fixed shapes only (no sync on CUDA)."""

    def __init__(self, xp: Backend, qsl: Array, num_tokens: int, width: int) -> None:
        self.xp, self.qsl, self.width = xp, qsl, width
        self.num_requests = qsl.shape[0] - 1
        self.seg = xp.segments(qsl, num_tokens)  # [T]
        self.tok_pos = xp.arange(num_tokens) + (self.seg + 1) * width  # [T]
        self.head_pos = qsl[:-1] + xp.arange(self.num_requests) * width  # [R]
        self.size = num_tokens + self.num_requests * width

    def buffer(self, carried: Array, tokens: Array) -> Array:
        """[T + R*width] int64: carried [R, width] (oldest first) and tokens [T] interleaved."""
        buf = self.xp.empty((self.size,))
        buf[self.tok_pos] = tokens
        cols = self.xp.arange(self.width)
        buf[(self.head_pos[:, None] + cols[None, :]).reshape(-1)] = carried.reshape(-1)
        return buf

    def tail(self, buf: Array) -> Array:
        """[R, width] each request's last `width` entries: its next carried state (an empty
        chunk leaves it unchanged)."""
        r, cols = self.xp.arange(self.num_requests), self.xp.arange(self.width)
        end = self.qsl[1:] + (r + 1) * self.width  # [R] one past the request's last entry
        return buf[end[:, None] - self.width + cols[None, :]]
