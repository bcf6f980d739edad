"""Deterministic primality and the prime sequences the n-gram hashes size their heads with."""

from __future__ import annotations

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


def primes_from(start: int, count: int) -> list[int]:
    """The first `count` primes >= start, increasing."""
    out: list[int] = []
    n = max(start, 2)
    while len(out) < count:
        if is_prime(n):
            out.append(n)
        n += 1
    return out
