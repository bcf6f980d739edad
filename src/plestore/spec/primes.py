"""Deterministic primality and the prime sequences the n-gram hashes size their heads with."""

from __future__ import annotations

import threading

# Deterministic Miller–Rabin for every n < 2^64 (Jim Sinclair's bases, as vLLM uses).
_MR_BASES = (2, 325, 9375, 28178, 450775, 9780504, 1795265022)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        a %= n
        if a == 0:
            continue
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


#: start -> the primes found from it so far: the specs of a model's layers ask for growing
#: prefixes of one sequence (layer d of a Qwen4Exp config for (d + 1) * heads primes), which
#: would otherwise cost quadratic time in the number of layers
_FOUND: dict[int, list[int]] = {}
_LOCK = threading.Lock()


def primes_from(start: int, count: int) -> list[int]:
    """The first `count` primes >= start, increasing. Callers bound `count` (the specs hold
    it to MAX_HASH_PRIMES); `start` must be below 2^63 (Miller-Rabin here is exact below 2^64)."""
    if not 0 <= start < 2**63:
        raise ValueError(f"prime search start {start} is outside [0, 2^63)")
    with _LOCK:
        out = _FOUND.setdefault(start, [])
        if len(out) < count:
            n = out[-1] + 1 if out else max(start, 2)
            while len(out) < count:
                if is_prime(n):
                    out.append(n)
                n += 1
            if len(_FOUND) > 64:  # keep the cache small: a few bases per process
                _FOUND.pop(next(iter(_FOUND)))
        return out[:count]
