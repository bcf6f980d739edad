"""wait_word's reference (feedwait.c): poll a 64-bit word until it differs from `last`."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["wait_word"]


def wait_word(words: Any, index: int, last: int, timeout_s: float) -> int:
    """words[index] once it differs from last, or last after timeout_s; the GIL yielded
    between polls (time.sleep(0)) so the thread that writes the word runs."""
    if not (isinstance(words, np.ndarray) and words.dtype == np.int64):
        raise ValueError(f"words must hold int64, got {getattr(words, 'dtype', type(words))}")
    view = words.reshape(-1)
    if not 0 <= index < view.size:
        raise IndexError("wait_word: index outside the buffer")
    deadline = time.monotonic() + timeout_s
    while True:
        value = int(view[index])
        if value != last or time.monotonic() > deadline:
            return value
        time.sleep(0)
