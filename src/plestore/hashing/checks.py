"""A ragged batch's validation messages: exact, naming the culprit (request r, position j in
its chunk). numpy; torch inputs reach them only once a batch is known to be bad (`qsl_ok` is the
device-side test, `sanitize_query_start_loc` the unchecked path's clamp)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "check_query_start_loc",
    "check_request_count",
    "check_state_range",
    "check_token_range",
    "locate",
    "qsl_ok",
    "sanitize_query_start_loc",
]


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
