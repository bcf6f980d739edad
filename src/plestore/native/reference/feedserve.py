"""feed_serve's reference (feedserve.c): a graph feed's host side — wait for a post (spinning
while steps keep coming, then short sleeps that `feed_wake` ends), the posted step's host step
(hoststep.py), READY = seq — with the same arguments, returns and counters."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from plestore.native.constants import (
    HEADER_WORDS,
    W_ASLEEP,
    W_KEY,
    W_POSTED,
    W_READY,
    W_TIMED_OUT,
    W_WAKE,
    W_WOKEN,
    C,
    S,
)
from plestore.native.reference.hoststep import WORDS, check_feed, check_plan, part_states, run_step

__all__ = ["clear_if", "feed_serve", "feed_wake", "publish"]

#: the futex stand-in: an Event per header (by address) that feed_wake sets and a nap waits on
_bells: dict[int, threading.Event] = {}
_bells_lock = threading.Lock()


def _words(obj: Any, name: str, least: int) -> np.ndarray:
    arr = np.asarray(obj)
    if arr.dtype != np.int64 or arr.size < least:
        raise ValueError(f"feed_serve: {name} must hold int64 (at least {least})")
    return arr.reshape(-1)


def publish(words: Any, i: int, value: int) -> None:
    """words[i] = value (feedserve.c's is a release store; numpy has none: the reference serves
    where the core is not built, and weakly ordered hosts build it)."""
    w = _words(words, "words", 1)
    if not 0 <= i < w.size:
        raise IndexError("publish: word index outside words")
    w[i] = value


def clear_if(words: Any, i: int, expected: int) -> bool:
    """words[i] = 0 where it still holds expected (feedserve.c's is a compare-and-swap; here
    the check and the store are two steps)."""
    w = _words(words, "words", 1)
    if not 0 <= i < w.size:
        raise IndexError("clear_if: word index outside words")
    if int(w[i]) != expected:
        return False
    w[i] = 0
    return True


def _bell(w: np.ndarray) -> threading.Event:
    with _bells_lock:
        return _bells.setdefault(w.ctypes.data, threading.Event())


def feed_wake(words: Any) -> None:
    """A step is coming: the host side's sleep ended now (feedserve.c's futex wake)."""
    w = _words(words, "words", HEADER_WORDS)
    w[W_WAKE] += 1
    if w[W_ASLEEP]:
        _bell(w).set()


def _take_wake(w: np.ndarray) -> bool:
    """A wake not yet acted on: True, and now it is."""
    wake = int(w[W_WAKE])
    if wake == w[W_WOKEN]:
        return False
    w[W_WOKEN] = wake
    return True


def _nap_or_wake(w: np.ndarray, last: int, nap: float) -> bool:
    """Sleep up to `nap` s, or until feed_wake or a post; True if a wake came (acted on)."""
    wake = int(w[W_WAKE])  # (the nap waits only while WAKE holds it)
    if wake != w[W_WOKEN]:
        w[W_WOKEN] = wake
        return True
    bell = _bell(w)
    bell.clear()
    w[W_ASLEEP] = 1
    if int(w[W_POSTED]) == last and int(w[W_WAKE]) == wake:
        bell.wait(nap)
    w[W_ASLEEP] = 0
    return _take_wake(w)  # (one that ended the nap: acted on now, not after a return)


def feed_serve(
    words: Any,
    counters: Any,
    feeds: tuple,
    plan: tuple | None,
    last: int,
    timed_out: int,
    posted_ns: int,
    spin_s: float,
    sleep_s: float,
    sleep_max_s: float,
    return_s: float,
) -> tuple[int, int, int, int]:
    """(state, the last seq seen, detail, posted_ns): see feedserve.c (the sleeps between polls
    from sleep_s doubling up to sleep_max_s)."""
    w, c = _words(words, "words", HEADER_WORDS), _words(counters, "counters", WORDS)
    if plan is not None:
        plan = check_plan(plan)
    for feed in feeds:
        _words(feed[0], "box", 1)
        _words(feed[2], "index", 1)
        check_feed(feed)
    states = part_states(plan) if plan is not None else []
    entered, nap = time.monotonic_ns(), sleep_s
    while True:
        seq = int(w[W_POSTED])
        if seq != last:
            posted_ns = time.monotonic_ns()
            w[W_WOKEN] = w[W_WAKE]  # (the wakes before this post are spent)
            if plan is None:
                return S.POSTED, seq, 0, posted_ns
            key = int(w[W_KEY])
            if not 0 <= key < len(feeds):
                return S.NO_FEED, last, key, posted_ns
            state, detail = run_step(plan, feeds[key], c, states)
            last, nap = seq, sleep_s
            if state:
                return state, last, detail, posted_ns
            publish(w, W_READY, seq)
            c[C.STEP_NS] += time.monotonic_ns() - posted_ns
            continue
        if c[C.STOP]:
            return S.STOP, last, 0, posted_ns
        if int(w[W_TIMED_OUT]) != timed_out:
            return S.TIMED_OUT, last, 0, posted_ns
        now = time.monotonic_ns()
        if now - posted_ns < spin_s * 1e9:
            time.sleep(0)  # (the GIL to the thread that posts)
            continue
        if now - entered > return_s * 1e9:
            return S.QUIET, last, 0, posted_ns
        if _nap_or_wake(w, last, nap):  # a step is coming: spin as after a post
            posted_ns, nap = time.monotonic_ns(), sleep_s
            continue
        nap = min(2 * nap, sleep_max_s)
