"""The values of synthetic tables: packed row bytes as a pure function of (seed, table, row id).

Because a row's bytes depend only on (seed, table name, format, dim, row), any row of a synthetic
checkpoint — or of a table packed from it, in any layout — can be checked without the source
(`expected_rows`), and generation parallelises over row blocks with no shared state.

Generator: counter-based splitmix64. Row r of a table with W = ceil(row_bytes / 8) words gets
words `mix(key + (r*W + j + 1) * GAMMA)` for j < W, key = blake2b(seed, table name); the words'
little-endian bytes, cut to row_bytes, are then shaped per format so every row is valid and
plausible (masks, not rejection, so the cost stays flat):

| format     | bytes                               | values                              |
|------------|-------------------------------------|-------------------------------------|
| bf16       | u16 & 0x83FF, exponent forced 120+  | +-[2^-7, 2), no inf/NaN             |
| fp8_e4m3   | byte & 0xBF (top exponent bit 0)    | +-[0, 1.875]; never NaN (0x7F/0xFF) |
| nvfp4      | codes any; block scales 0x30 + b&15 | e4m3 scales in [0.5, 1.875]         |
| fp8_ue8m0  | values & 0xBF; scales 117 + b&7     | 2^-10 .. 2^-3 per 32 values         |
| fp16       | u16 & 0x87FF, exponent 12..13 set   | +-[2^-3, 2^-1), finite              |
| fp32       | u32 & 0x83FFFFFF, exponent 120+     | +-[2^-7, 2), finite                 |
| nf4        | codes any; fp16 scale 2^-6..2^-3    | 2 pad bytes zero                    |

numpy's uint64 ops release the GIL, and chunks of 32K words stay in L2 (several times faster
than ops over whole arrays).
"""

from __future__ import annotations

import hashlib

import numpy as np

from plestore.spec import TableSpec

__all__ = ["SYNTH_SCALES", "expected_rows", "random_bf16", "random_words"]

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_CHUNK_WORDS = 1 << 15  # 256 KiB of uint64: fits L2 with its temporary

#: Table scale a synthetic checkpoint stores per format (exact in bf16 and fp32).
SYNTH_SCALES = {"fp8_e4m3": 2.0**-6, "nvfp4": 2.0**-8}


def _rep(pattern: int, width: int) -> np.uint64:
    """Repeat a `width`-byte pattern across 8 bytes."""
    out = 0
    for i in range(0, 8, width):
        out |= pattern << (8 * i)
    return np.uint64(out)


def _key(seed: int, name: str) -> np.uint64:
    h = hashlib.blake2b(f"plestore-synth:{seed}:{name}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(h, "little"))


def random_words(key: np.uint64, rows: np.ndarray, words: int, shape=None) -> np.ndarray:
    """uint64 [n, words]: the splitmix64 stream of counters rows*words + j (j < words).

    `shape(block)` is applied to each cache-sized block of rows (uint64 [m, words]) in place.
    """
    rows = np.asarray(rows, dtype=np.uint64).reshape(-1)
    out = np.empty((rows.size, words), np.uint64)
    step = max(1, _CHUNK_WORDS // words)  # rows per block
    j = np.arange(1, words + 1, dtype=np.uint64)  # +1: the splitmix64 state is advanced first
    tmp = np.empty(step * words, np.uint64)
    with np.errstate(over="ignore"):
        for i in range(0, rows.size, step):
            x = out[i : i + step]  # [m, words]
            np.multiply(rows[i : i + step, None], np.uint64(words), out=x)
            x += j
            x *= _GAMMA
            x += key
            flat, t = x.reshape(-1), tmp[: x.size]
            np.right_shift(flat, np.uint64(30), out=t)
            flat ^= t
            flat *= _C1
            np.right_shift(flat, np.uint64(27), out=t)
            flat ^= t
            flat *= _C2
            np.right_shift(flat, np.uint64(31), out=t)
            flat ^= t
            if shape is not None:
                shape(x)
    return out


def _shaper(fmt: str, dim: int):
    """In-place op making random words valid bytes of `fmt` rows (see the module table)."""
    if fmt == "bf16":
        mask, bits = _rep(0x83FF, 2), _rep(0x3C00, 2)

        def bf16(x):
            x &= mask
            x |= bits

        return bf16
    if fmt in ("fp16", "fp32"):  # finite values of modest size: sign, small exponent, mantissa
        mask, bits = (
            (_rep(0x87FF, 2), _rep(0x3000, 2))
            if fmt == "fp16"
            else (
                _rep(0x83FFFFFF, 4),
                _rep(0x3C000000, 4),
            )
        )

        def wide(x):
            x &= mask
            x |= bits

        return wide
    if fmt in ("fp8_e4m3", "fp8_ue8m0"):
        mask = _rep(0xBF, 1)

        def fp8(x):
            x &= mask
            if fmt == "fp8_ue8m0":  # scale bytes follow the dim value bytes
                s = x.view(np.uint8)[:, dim : dim + dim // 32]
                s &= 7
                s += 117

        return fp8
    if fmt == "nvfp4":

        def nvfp4(x):
            s = x.view(np.uint8)[:, dim // 2 : dim // 2 + dim // 16]
            s &= 0x0F
            s |= 0x30

        return nvfp4
    if fmt == "nf4":

        def nf4(x):
            b = x.view(np.uint8)
            b[:, dim // 2] = 0  # fp16 scale, low byte: mantissa bits
            hi = b[:, dim // 2 + 1]
            hi &= 0x0F
            hi += 0x24
            b[:, dim // 2 + 2 : dim // 2 + 4] = 0

        return nf4
    raise ValueError(f"no synthetic generator for format {fmt}")


def expected_rows(spec: TableSpec, seed: int, rows) -> np.ndarray:
    """Packed bytes of synthetic rows `rows` of table `spec`: uint8 [n, row_bytes].

    The same rows a synthetic checkpoint of this seed holds, and a table packed from it.
    """
    rb = spec.row_bytes
    words = -(-rb // 8)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= spec.rows):
        raise IndexError(f"rows outside table {spec.name} [0, {spec.rows})")
    w = random_words(_key(seed, spec.name), rows, words, _shaper(spec.format, spec.dim))
    b = w.view(np.uint8)  # [n, words*8]
    return b if b.shape[1] == rb else np.ascontiguousarray(b[:, :rb])


def random_bf16(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Small bf16 weights (+-[2^-11, 2^-7)) for tensor `name`, as uint16 bit patterns."""
    n = int(np.prod(shape, dtype=np.int64))
    mask, bits = _rep(0x81FF, 2), _rep(0x3A00, 2)

    def small(x):
        x &= mask
        x |= bits

    w = random_words(_key(seed, name), np.arange(-(-n // 4)), 1, small)
    return w.view("<u2").reshape(-1)[:n].reshape(shape)
