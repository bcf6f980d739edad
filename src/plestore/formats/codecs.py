"""Scalar codecs the row formats share, exact in numpy: bf16 rounding, the e4m3 / e2m1
minifloats, NF4 levels, ue8m0 scales, packed nibbles."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even), returned as float32. NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), out)


@dataclass(frozen=True)
class _MiniFloat:
    """A sign-magnitude minifloat without infinities (e4m3fn, e2m1): exact decode + RNE encode."""

    mbits: int  # mantissa bits
    ebits: int  # exponent bits
    emin: int  # exponent of the smallest normal value
    max_finite: float
    nan_code: int | None  # magnitude code that means NaN (0x7F for e4m3fn), None if no NaN

    def decode_lut(self) -> np.ndarray:
        """float32 value of every code (sign bit included)."""
        n = 1 << (1 + self.ebits + self.mbits)
        codes = np.arange(n)
        sign = np.where(codes >> (self.ebits + self.mbits), -1.0, 1.0)
        mag_code = codes & ((1 << (self.ebits + self.mbits)) - 1)
        e = mag_code >> self.mbits
        m = mag_code & ((1 << self.mbits) - 1)
        sub = m * 2.0 ** (self.emin - self.mbits)
        norm = (1.0 + m / (1 << self.mbits)) * 2.0 ** (e - 1 + self.emin)
        vals = sign * np.where(e == 0, sub, norm)
        if self.nan_code is not None:
            vals[mag_code == self.nan_code] = np.nan
        return vals.astype(np.float32)

    def encode(self, x: np.ndarray) -> np.ndarray:
        """float -> codes (uint8), round to nearest, ties to even, saturating at max_finite.

        The caller guarantees finite input. -0.0 keeps its sign bit.
        """
        x = np.asarray(x, dtype=np.float64)
        mag = np.minimum(np.abs(x), self.max_finite)
        _, exp = np.frexp(mag)  # mag = frac * 2**exp, frac in [0.5, 1)
        e = np.maximum(exp - 1, self.emin)  # exponent of the binade (subnormals share emin)
        quantum = np.ldexp(1.0, e - self.mbits)
        steps = np.rint(mag / quantum)  # exact: dividing by a power of two; rint ties to even
        r = np.minimum(steps * quantum, self.max_finite)
        _, rexp = np.frexp(r)
        re = rexp - 1
        normal = r >= 2.0**self.emin
        biased = np.where(normal, re - self.emin + 1, 0)
        scaled = np.where(normal, np.ldexp(r, -re), r / 2.0**self.emin)  # [1,2) or [0,1)
        mant = np.rint((scaled - normal) * (1 << self.mbits)).astype(np.int64)
        code = (biased.astype(np.int64) << self.mbits) | mant
        sign = np.signbit(x).astype(np.int64) << (self.ebits + self.mbits)
        return (code | sign).astype(np.uint8)


E4M3 = _MiniFloat(mbits=3, ebits=4, emin=-6, max_finite=448.0, nan_code=0x7F)
E2M1 = _MiniFloat(mbits=1, ebits=2, emin=0, max_finite=6.0, nan_code=None)
E4M3_LUT = E4M3.decode_lut()  # [256] float32
E2M1_LUT = E2M1.decode_lut()  # [16] float32

#: NF4 code levels (vLLM's table): negatives first, ascending. Code k -> NF4_LEVELS[k].
NF4_LEVELS = np.array(
    [
        -2.7326,
        -2.0690,
        -1.6181,
        -1.2562,
        -0.9424,
        -0.6568,
        -0.3881,
        -0.1284,
        0.1284,
        0.3881,
        0.6568,
        0.9424,
        1.2562,
        1.6181,
        2.0690,
        2.7326,
    ],
    dtype=np.float32,
)


def ue8m0_scale(b: np.ndarray) -> np.ndarray:
    """Scale byte -> float32 2^(b-127), computed as the engines do: the byte shifted into the
    fp32 exponent field (so byte 0 gives 0.0 and byte 255 gives +inf)."""
    return (b.astype(np.uint32) << 23).view(np.float32)


def unpack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 [N, d/2] -> uint8 [N, d]: element 2i = low nibble of byte i."""
    out = np.empty((codes.shape[0], codes.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = codes & 0x0F
    out[:, 1::2] = codes >> 4
    return out


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 [N, d] (values < 16) -> uint8 [N, d/2]."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
