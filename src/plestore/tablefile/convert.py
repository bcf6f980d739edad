"""Pack's format conversion: packed rows of one format -> packed rows of another (the values the
engines see, re-encoded with the target's table scale), with the error over every value.

    scale = scale_from_amax(source, target)   a first pass, where the target has a table scale
    conv = Conversion(src_spec, dst_spec)     once per table (its scales fixed)
    rows, sums = conv(raw)                    per batch; the sums feed ErrorSum

Where every value maps to its target code on its own — targets bf16, fp8_e4m3, fp16, fp32 from
a source whose values are bf16 — conversion is a table lookup: a row's bytes become 16-bit
symbols (a value's bf16 bits; for NVFP4 a block-scale byte and a code byte: two values), and
each symbol's target codes and error terms are computed once per table by the formats' own
decode and encode, so the bytes are decode-then-encode's exactly; the error sums come from a
histogram of the symbols. NVFP4 rows go through the table in one pass of the host core
(`native.recode_nvfp4`). Other targets (a scale per block: nvfp4, fp8_ue8m0, nf4) decode and
encode every batch. The first pass over NVFP4 reads max |x| from its nibble codes and block
scales without decoding them.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import cache

import numpy as np

from plestore import native
from plestore.checkpoint import SourceTable
from plestore.formats import EncodeError, get_format
from plestore.io.streaming import bounded_map, progress_bar
from plestore.spec import TableSpec

__all__ = ["Conversion", "ErrorSum", "scale_from_amax"]

#: Targets whose encode is value by value (so a table of every bf16 value's code is exact).
ELEMENTWISE = ("bf16", "fp8_e4m3", "fp16", "fp32")
#: Values per batch: decode + encode work in float64 with ~10 temporaries (~90 B a value); the
#: lookup path holds ~11 B a value (symbols, their int64 indices, the codes).
SLOW_BATCH_VALUES, FAST_BATCH_VALUES = 1 << 20, 4 << 20
SLOW_BYTES_PER_VALUE, FAST_BYTES_PER_VALUE = 90, 11


class Conversion:
    """Rows of `src` -> rows of `dst` (same rows and dim, another format or scale)."""

    def __init__(self, src: TableSpec, dst: TableSpec) -> None:
        self.src, self.dst = src, dst
        self.fmt = get_format(dst.format)
        self.scale = dst.scale if self.fmt.has_table_scale else None
        self._scratch = threading.local()  # each thread's symbol buffers, kept batch to batch
        bf16_values = get_format(src.format).out_dtype == "bfloat16"
        fast = self.fmt.name in ELEMENTWISE and bf16_values
        self.symbols = _symbols(src.format, src.scale) if fast else None
        self.batch_values = FAST_BATCH_VALUES if fast else SLOW_BATCH_VALUES
        self.bytes_per_value = FAST_BYTES_PER_VALUE if fast else SLOW_BYTES_PER_VALUE
        if fast:
            self._tables(self.symbols.values)

    def _tables(self, values: np.ndarray) -> None:
        """Per symbol: the target codes (one unsigned int holding the k values' codes), the
        error terms (max |d|, sum d^2, sum x^2, max |x|) and whether encode refuses it."""
        k = values.shape[1]
        ok = np.isfinite(values) | (self.fmt.name == "bf16")  # only bf16 stores non-finite
        flat = np.where(ok, values, 0).reshape(1, -1)  # [1, 65536 * k]
        with np.errstate(over="ignore"):  # fp16: bf16 values past its range become inf
            codes = self.fmt.encode(flat, scale=self.scale).rows.reshape(65536, -1)
        self.lut = np.ascontiguousarray(codes).view(f"<u{codes.shape[1]}")[:, 0]  # [65536]
        back = self.fmt.decode_numpy(codes.reshape(1, -1), self.dst.scale, flat.shape[1])
        ref = flat.reshape(65536, k).astype(np.float64)
        d = np.abs(back.reshape(65536, k).astype(np.float64) - ref)
        self.terms = (d.max(1), (d**2).sum(1), (ref**2).sum(1), np.abs(ref).max(1))
        self.refused = ~ok.all(1)

    def __call__(self, raw: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, tuple]:
        """Packed rows uint8 [n, src row bytes] -> (uint8 [n, dst row bytes], error sums), into
        `out` where given. Deterministic, so verify recomputes a converted table's rows."""
        if self.symbols is None:
            return self._decode_encode(raw)
        n = raw.shape[0]
        rows = np.empty((n, self.dst.row_bytes), np.uint8) if out is None else out[:n]
        counts = self._recode(np.ascontiguousarray(raw), rows)  # int64 [65536]
        if counts[self.refused].any():
            return self._decode_encode(raw)  # raises, naming the value
        seen = np.flatnonzero(counts)  # (the terms of symbols not seen may be NaN)
        times = counts[seen]
        max_d, sq_d, sq_x, max_x = (t[seen] for t in self.terms)
        sums = (max_d.max(initial=0), times @ sq_d, times @ sq_x, max_x.max(initial=0))
        return rows, (*map(float, sums), n * self.src.dim)

    def _recode(self, raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """rows = each symbol's target codes (lut); returns how often each symbol was seen."""
        if self.symbols.nvfp4:  # the host core's one pass (its reference: the same in numpy)
            counts = np.zeros(65536, np.int64)
            native.load().recode_nvfp4(raw, self.src.dim, self.lut, rows, counts)
            return counts
        idx = self.symbols.of(raw, self.src.dim, self._scratch)  # intp [n, dim]
        np.take(self.lut, idx, out=rows.view(self.lut.dtype), mode="clip")  # (in range)
        return np.bincount(idx.reshape(-1), minlength=65536)

    def _decode_encode(self, raw: np.ndarray) -> tuple[np.ndarray, tuple]:
        src = self.src
        values = get_format(src.format).decode_numpy(raw, scale=src.scale, dim=src.dim)
        try:
            enc = self.fmt.encode(values, scale=self.scale)
        except ValueError as e:
            raise ValueError(f"table {src.name}: {e}") from None
        back = self.fmt.decode_numpy(enc.rows, scale=enc.scale, dim=self.dst.dim)
        ref = values.astype(np.float64)
        diff = np.abs(back.astype(np.float64) - ref)
        sums = (
            float(diff.max(initial=0)),
            float((diff**2).sum()),
            float((ref**2).sum()),
            float(np.abs(ref).max(initial=0)),
            ref.size,
        )
        return enc.rows, sums


@dataclass(frozen=True)
class _Symbols:
    """A source format's rows as uint16 symbols, each standing for k values in row order (NVFP4:
    2, else 1); `values` float32 [65536, k]: what each symbol decodes to."""

    nvfp4: bool
    values: np.ndarray
    fmt: str
    scale: float

    def of(self, raw: np.ndarray, dim: int, scratch=None) -> np.ndarray:
        """The symbols of a bf16-valued source's rows (a value's bf16 bits), as indices: intp
        [n, dim]. `scratch` (an object whose attributes hold one thread's buffers) keeps them
        from batch to batch: a batch's tens of MB allocated afresh cost as much in page faults
        as their work. (NVFP4's symbols: the host core's recode_nvfp4.)"""
        v = get_format(self.fmt).decode_numpy(raw, scale=self.scale, dim=dim)
        idx = _buffer(scratch, "idx", (raw.shape[0], dim), np.intp)
        np.copyto(idx, v.view(np.uint32) >> 16, casting="unsafe")  # bf16 bits
        return idx


def _buffer(scratch, name: str, shape: tuple, dtype) -> np.ndarray:
    """An array of `shape` in scratch's buffer `name` (grown as needed), or a new one."""
    size = math.prod(shape)
    if scratch is None:
        return np.empty(shape, dtype)
    buf = getattr(scratch, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype)
        setattr(scratch, name, buf)
    return buf[:size].reshape(shape)


@cache
def _symbols(fmt: str, scale: float) -> _Symbols:
    if fmt != "nvfp4":
        bits = np.arange(65536, dtype=np.uint32) << 16
        return _Symbols(False, bits.view(np.float32).reshape(65536, 1), fmt, scale)
    # Every (block-scale byte b, code byte c) decoded by nvfp4 itself: 8,192 rows of dim 16,
    # row b * 32 + g holding code bytes 8g..8g+7 and scale byte b.
    rows = np.empty((256, 32, 9), np.uint8)
    rows[:, :, :8] = np.arange(256, dtype=np.uint8).reshape(32, 8)
    rows[:, :, 8] = np.arange(256, dtype=np.uint8)[:, None]
    values = get_format("nvfp4").decode_numpy(rows.reshape(-1, 9), scale=scale, dim=16)
    return _Symbols(True, values.reshape(65536, 2), fmt, scale)  # [b, g, 8, 2] -> [b<<8|c]


@dataclass
class ErrorSum:
    """EncodeError over a whole table from per-batch sums (max |d|, sum d^2, sum x^2, max |x|)."""

    max_abs: float = 0.0
    sq_diff: float = 0.0
    sq_ref: float = 0.0
    amax: float = 0.0
    count: int = 0

    def add(self, s: tuple) -> None:
        self.max_abs = max(self.max_abs, s[0])
        self.sq_diff += s[1]
        self.sq_ref += s[2]
        self.amax = max(self.amax, s[3])
        self.count += s[4]

    def result(self) -> EncodeError:
        rmse = math.sqrt(self.sq_diff / self.count) if self.count else 0.0
        rms = math.sqrt(self.sq_ref / self.count) if self.count else 0.0
        return EncodeError(
            self.max_abs,
            self.max_abs / self.amax if self.amax else 0.0,
            rmse,
            rmse / rms if rms else 0.0,
        )


def scale_from_amax(src: SourceTable, tgt, batch_bytes: int, threads: int, progress: bool):
    """First pass: the table scale `tgt` would pick for the whole table's max |x| (of finite
    values: the conversion refuses others, naming them)."""
    spec = src.spec
    fmt = get_format(spec.format)
    per_batch = FAST_BATCH_VALUES if fmt.name == "nvfp4" else SLOW_BATCH_VALUES
    n = max(1, min(batch_bytes // spec.row_bytes, per_batch // spec.dim))

    widest = max(p.row_bytes for seg in src.segments for p in seg.parts)  # (split rows)
    local = threading.local()  # each thread's read buffers, kept batch to batch (see `of`)

    def amax(a: int) -> float:
        m = min(n, spec.rows - a)
        out = _buffer(local, "raw", (m, spec.row_bytes), np.uint8)
        raw = src.read_rows(a, m, out=out, scratch=_buffer(local, "part", (m * widest,), np.uint8))
        if fmt.name == "nvfp4":
            return _nvfp4_amax(raw, spec.dim, spec.scale, local)
        v = fmt.decode_numpy(raw, scale=spec.scale)
        return float(np.abs(v[np.isfinite(v)]).max(initial=0))

    best = 0.0
    with progress_bar(spec.nbytes, f"amax {src.name}", progress) as bar:
        starts = range(0, spec.rows, n)
        for a, m in zip(starts, bounded_map(amax, starts, threads), strict=True):
            best = max(best, m)
            bar.update(min(n, spec.rows - a) * spec.row_bytes)
    probe = np.zeros((1, spec.dim), np.float32)
    probe[0, 0] = best
    return tgt.encode(probe).scale  # the format's own rule for a table of this max |x|


def _nvfp4_amax(raw: np.ndarray, dim: int, scale: float, scratch=None) -> float:
    """max |x| of finite values of NVFP4 rows, exactly, without decoding them: |x| grows with
    its nibble's magnitude code and its block scale's. For each nibble code t from 6.0 down:
    the largest scale among blocks holding a nibble of code >= t (SWAR on 16 nibbles at once),
    until that is the table's largest scale (no smaller nibble can pass it then). `scratch`:
    as in `_Symbols.of`."""
    if not raw.shape[0]:
        return 0.0
    shape = (raw.shape[0], dim // 16)  # [n, blocks]
    mag = np.bitwise_and(raw[:, dim // 2 :], 0x7F, out=_buffer(scratch, "mag", shape, np.uint8))
    has = np.equal(mag, 0x7F, out=_buffer(scratch, "has", shape, np.bool_))
    np.copyto(mag, 0, where=has)  # NaN scales: the conversion refuses them
    nibbles = _buffer(scratch, "nibbles", shape, np.uint64)  # 16 nibble magnitude codes a block
    np.bitwise_and(raw[:, : dim // 2].view("<u8"), 0x7 * _NIBBLES, out=nibbles)
    tmp = _buffer(scratch, "tmp", shape, np.uint64)
    value, top, best = _nvfp4_values(scale), int(mag.max()), 0.0
    for t in range(7, 0, -1):
        np.add(nibbles, (8 - t) * _NIBBLES, out=tmp)  # (no carry: 7 + 7 < 16)
        np.not_equal(np.bitwise_and(tmp, 0x8 * _NIBBLES, out=tmp), 0, out=has)  # a nibble >= t
        s = int(np.max(mag, where=has, initial=0))
        best = max(best, float(value[s, t]))
        if s == top:
            break
    return best


_NIBBLES = np.uint64(0x1111111111111111)


@cache
def _nvfp4_values(scale: float) -> np.ndarray:
    """float32 [128, 8]: |x| of nibble magnitude code t under positive block scale code s."""
    rows = np.zeros((128, 8, 9), np.uint8)
    rows[:, :, 0] = np.arange(8)  # the first value: nibble t
    rows[:, :, 8] = np.arange(128)[:, None]
    v = get_format("nvfp4").decode_numpy(rows.reshape(-1, 9), scale=scale, dim=16)
    return np.abs(v[:, 0]).reshape(128, 8)
