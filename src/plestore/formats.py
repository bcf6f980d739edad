"""Row formats: how one table row is stored as bytes, and how it becomes bf16.

Every format has one numpy decode and one torch decode (any device) that are bit-identical for
every non-NaN value (NaN stays NaN; its payload bits may differ between backends). The numpy
decode returns float32 arrays holding exactly the bf16 values, since numpy has no bf16.

Dequant follows what the engines compute (see shared/spec/qwen4exp-ple.md §2.3):

| format      | row bytes (dim d)        | value                                              |
|-------------|--------------------------|----------------------------------------------------|
| `bf16`      | 2d                       | the bf16 itself                                    |
| `fp8_e4m3`  | d                        | bf16(bf16(e4m3) * bf16(table scale))               |
| `nvfp4`     | d/2 codes + d/16 scales  | bf16(fp32(fp4 * e4m3 block scale) * fp32 scale)    |
| `fp8_ue8m0` | d + d/32 scales          | bf16(fp32(e4m3) * 2^(byte-127)); the byte is       |
|             |                          | shifted into the fp32 exponent: 0 -> 0, 255 -> inf |
| `nf4`       | d/2 codes + fp16 + 2 pad | bf16(fp32(NF4_LEVELS[code]) * fp32(fp16 scale))    |

Packed nibbles: element 2i is the low nibble of byte i, element 2i+1 the high nibble.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMATS",
    "NF4_LEVELS",
    "EncodeError",
    "Encoded",
    "RowFormat",
    "bf16_round",
    "get_format",
]

# ----------------------------------------------------------------------------------------------
# Scalar codecs shared by the formats (numpy, exact)
# ----------------------------------------------------------------------------------------------


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


def _ue8m0_scale(b: np.ndarray) -> np.ndarray:
    """Scale byte -> float32 2^(b-127), computed as the engines do: the byte shifted into the
    fp32 exponent field (so byte 0 gives 0.0 and byte 255 gives +inf)."""
    return (b.astype(np.uint32) << 23).view(np.float32)


def _unpack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 [N, d/2] -> uint8 [N, d]: element 2i = low nibble of byte i."""
    out = np.empty((codes.shape[0], codes.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = codes & 0x0F
    out[:, 1::2] = codes >> 4
    return out


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 [N, d] (values < 16) -> uint8 [N, d/2]."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


# ----------------------------------------------------------------------------------------------
# Format interface
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodeError:
    """How far decode(encode(x)) is from x: absolute and relative (to max |x|) errors."""

    max_abs: float
    max_rel: float  # max_abs / max |x|
    rmse: float
    rel_rmse: float  # rmse / rms(x)

    @staticmethod
    def measure(reference: np.ndarray, decoded: np.ndarray) -> EncodeError:
        ref = np.asarray(reference, dtype=np.float64)
        diff = np.abs(np.asarray(decoded, dtype=np.float64) - ref)
        amax = float(np.abs(ref).max()) if ref.size else 0.0
        rms = float(np.sqrt(np.mean(ref**2))) if ref.size else 0.0
        max_abs = float(diff.max()) if diff.size else 0.0
        rmse = float(np.sqrt(np.mean(diff**2))) if diff.size else 0.0
        return EncodeError(
            max_abs=max_abs,
            max_rel=max_abs / amax if amax else 0.0,
            rmse=rmse,
            rel_rmse=rmse / rms if rms else 0.0,
        )


@dataclass(frozen=True)
class Encoded:
    """Packed rows plus the per-table scale they were encoded with (1.0 when unused)."""

    rows: np.ndarray  # uint8 [N, row_bytes]
    scale: float

    def error(self, fmt: RowFormat, reference: np.ndarray) -> EncodeError:
        return EncodeError.measure(reference, fmt.decode(self.rows, scale=self.scale))


class RowFormat(ABC):
    """How rows of one table are stored. Stateless; one instance per format in FORMATS."""

    name: str
    block_size: int = 1  # dim must be a multiple of this
    has_table_scale: bool = False  # one float scale per table (fp8 weight_scale, nvfp4 scale_2)
    description: str = ""

    # -- layout ------------------------------------------------------------------------------
    def check_dim(self, dim: int) -> None:
        if not isinstance(dim, (int, np.integer)) or dim <= 0:
            raise ValueError(f"{self.name}: dim must be a positive int, got {dim!r}")
        if dim % self.block_size:
            raise ValueError(
                f"{self.name}: dim {dim} is not a multiple of the format's block size "
                f"{self.block_size}"
            )

    def row_bytes(self, dim: int) -> int:
        self.check_dim(dim)
        return self._row_bytes(int(dim))

    def dim_for_row_bytes(self, row_bytes: int) -> int:
        """Inverse of row_bytes (every format's row size is strictly increasing in dim)."""
        for dim in range(self.block_size, 8 * row_bytes + 1, self.block_size):
            rb = self._row_bytes(dim)
            if rb == row_bytes:
                return dim
            if rb > row_bytes:
                break
        raise ValueError(f"{self.name}: no dim has rows of {row_bytes} bytes")

    @abstractmethod
    def _row_bytes(self, dim: int) -> int: ...

    # -- encode ------------------------------------------------------------------------------
    def encode(self, values: Any, scale: float | None = None) -> Encoded:
        """float [N, dim] -> Encoded(uint8 [N, row_bytes], table scale).

        `scale` is the per-table scale for formats that have one (None: derived from max |x|);
        other formats take no scale.
        """
        x = _as_float_matrix(values, self.name)
        self.check_dim(x.shape[1])
        if not np.isfinite(x).all() and self.name != "bf16":
            r, c = np.argwhere(~np.isfinite(x))[0]
            raise ValueError(f"{self.name}: cannot encode non-finite value at row {r}, col {c}")
        if scale is not None and not self.has_table_scale and scale != 1.0:
            raise ValueError(f"{self.name} has no per-table scale (got scale={scale})")
        if self.has_table_scale:
            scale = self._default_scale(x) if scale is None else float(scale)
            if not (np.isfinite(scale) and scale > 0):
                raise ValueError(f"{self.name}: table scale must be finite and > 0, got {scale}")
        else:
            scale = 1.0
        return Encoded(rows=self._encode(x, scale), scale=scale)

    def _default_scale(self, x: np.ndarray) -> float:
        return 1.0

    @abstractmethod
    def _encode(self, x: np.ndarray, scale: float) -> np.ndarray: ...

    # -- decode ------------------------------------------------------------------------------
    def decode(self, rows: Any, scale: float = 1.0, dim: int | None = None) -> Any:
        """uint8 [N, row_bytes] -> values [N, dim].

        numpy in: float32 holding exact bf16 values. torch in: bf16 on the rows' device.
        """
        if _is_torch(rows):
            return self.decode_torch(rows, scale, dim)
        return self.decode_numpy(rows, scale, dim)

    def decode_numpy(self, rows: np.ndarray, scale: float = 1.0, dim: int | None = None):
        rows = np.asarray(rows)
        dim = self._check_rows(rows.dtype == np.uint8, rows.shape, dim, "numpy")
        self._check_scale(scale)
        with np.errstate(over="ignore", invalid="ignore"):  # NaN/inf bytes decode to NaN/inf
            return self._decode_numpy(np.ascontiguousarray(rows), dim, float(scale))

    def decode_torch(self, rows: torch.Tensor, scale: float = 1.0, dim: int | None = None):
        import torch

        dim = self._check_rows(rows.dtype == torch.uint8, tuple(rows.shape), dim, "torch")
        self._check_scale(scale)
        if rows.shape[0] == 0:
            return torch.empty((0, dim), dtype=torch.bfloat16, device=rows.device)
        return self._decode_torch(rows.contiguous(), dim, float(scale))

    def _check_rows(self, is_u8: bool, shape: tuple, dim: int | None, backend: str) -> int:
        if not is_u8:
            raise ValueError(f"{self.name}: rows must be uint8 ({backend}), got another dtype")
        if len(shape) != 2:
            raise ValueError(f"{self.name}: rows must be 2-D [N, row_bytes], got shape {shape}")
        if dim is None:
            dim = self.dim_for_row_bytes(shape[1])
        if shape[1] != self.row_bytes(dim):
            raise ValueError(
                f"{self.name}: rows of dim {dim} are {self.row_bytes(dim)} bytes, got {shape[1]}"
            )
        return dim

    def _check_scale(self, scale: float) -> None:
        if not self.has_table_scale and scale != 1.0:
            raise ValueError(f"{self.name} has no per-table scale (got scale={scale})")

    @abstractmethod
    def _decode_numpy(self, rows: np.ndarray, dim: int, scale: float) -> np.ndarray: ...

    @abstractmethod
    def _decode_torch(self, rows: torch.Tensor, dim: int, scale: float) -> torch.Tensor: ...

    def __repr__(self) -> str:
        return f"RowFormat({self.name!r})"


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _as_float_matrix(values: Any, name: str) -> np.ndarray:
    if _is_torch(values):
        values = values.detach().float().cpu().numpy()
    x = np.asarray(values)
    if x.dtype.kind != "f":
        raise ValueError(f"{name}: encode takes floating-point values, got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name}: encode takes a 2-D [N, dim] array, got shape {x.shape}")
    return x.astype(np.float32, copy=False)


def _torch_lut(lut: np.ndarray, device: Any) -> torch.Tensor:
    import torch

    return torch.from_numpy(lut).to(device)


# ----------------------------------------------------------------------------------------------
# The formats
# ----------------------------------------------------------------------------------------------


class _BF16(RowFormat):
    name = "bf16"
    description = "bf16 values, stored as is"

    def _row_bytes(self, dim: int) -> int:
        return 2 * dim

    def _encode(self, x: np.ndarray, scale: float) -> np.ndarray:
        bits = bf16_round(x).view(np.uint32) >> 16
        return bits.astype("<u2").view(np.uint8).reshape(x.shape[0], -1)

    def _decode_numpy(self, rows: np.ndarray, dim: int, scale: float) -> np.ndarray:
        bits = rows.view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32)

    def _decode_torch(self, rows, dim, scale):
        import torch

        return rows.view(torch.bfloat16)


class _FP8E4M3(RowFormat):
    name = "fp8_e4m3"
    has_table_scale = True
    description = "e4m3fn bytes x one bf16 per-table scale (Qwen4Exp fp8 checkpoints)"

    def _row_bytes(self, dim: int) -> int:
        return dim

    def _default_scale(self, x: np.ndarray) -> float:
        # The engines multiply by bf16(scale): take the smallest bf16 >= max|x| / 448.
        amax = float(np.abs(x).max()) if x.size else 0.0
        s = bf16_round(np.array([max(amax, 1e-30) / 448.0], np.float32))
        if float(s[0]) * 448.0 < amax:
            s = (s.view(np.uint32) + (1 << 16)).view(np.float32)  # the next bf16 up
        return float(s[0])

    def _encode(self, x: np.ndarray, scale: float) -> np.ndarray:
        s = bf16_round(np.array([scale], np.float32))[0]
        return E4M3.encode(x.astype(np.float64) / np.float64(s))

    def _decode_numpy(self, rows: np.ndarray, dim: int, scale: float) -> np.ndarray:
        s = bf16_round(np.array([scale], np.float32))[0]
        return bf16_round(E4M3_LUT[rows] * s)

    def _decode_torch(self, rows, dim, scale):
        import torch

        s = torch.tensor(scale, dtype=torch.bfloat16, device=rows.device)
        return rows.view(torch.float8_e4m3fn).to(torch.bfloat16) * s


class _NVFP4(RowFormat):
    name = "nvfp4"
    block_size = 16
    has_table_scale = True
    description = "e2m1 codes + e4m3 scale per 16 values + fp32 per-table scale (ModelOpt NVFP4)"

    def _row_bytes(self, dim: int) -> int:
        return dim // 2 + dim // 16

    def _default_scale(self, x: np.ndarray) -> float:
        amax = float(np.abs(x).max()) if x.size else 0.0
        return float(np.float32(max(amax, 1e-30) / (6.0 * 448.0)))

    def _encode(self, x: np.ndarray, scale: float) -> np.ndarray:
        n, dim = x.shape
        blocks = x.reshape(n, dim // 16, 16).astype(np.float64)
        s2 = np.float64(np.float32(scale))
        block_amax = np.abs(blocks).max(axis=2)  # [N, d/16]
        bs_codes = E4M3.encode(block_amax / 6.0 / s2)  # [N, d/16]
        bs = E4M3_LUT[bs_codes].astype(np.float64)
        denom = (bs * s2)[:, :, None]
        q = np.divide(blocks, denom, out=np.zeros_like(blocks), where=denom > 0)
        codes = E2M1.encode(q).reshape(n, dim)
        return np.concatenate([_pack_nibbles(codes), bs_codes], axis=1)

    def _decode_numpy(self, rows: np.ndarray, dim: int, scale: float) -> np.ndarray:
        n = rows.shape[0]
        fp4 = E2M1_LUT[_unpack_nibbles(rows[:, : dim // 2])]  # [N, d]
        bs = E4M3_LUT[rows[:, dim // 2 :]]  # [N, d/16]
        v = (fp4.reshape(n, dim // 16, 16) * bs[:, :, None]).reshape(n, dim)  # exact in fp32
        return bf16_round(v * np.float32(scale))

    def _decode_torch(self, rows, dim, scale):
        import torch

        n = rows.shape[0]
        codes = rows[:, : dim // 2]
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(n, dim)  # [N, d]
        fp4 = _torch_lut(E2M1_LUT, rows.device)[nibbles.long()]
        bs = rows[:, dim // 2 :].contiguous().view(torch.float8_e4m3fn).float()  # [N, d/16]
        v = (fp4.view(n, dim // 16, 16) * bs[:, :, None]).view(n, dim)
        s2 = torch.tensor(scale, dtype=torch.float32, device=rows.device)
        return (v * s2).to(torch.bfloat16)


class _FP8UE8M0(RowFormat):
    name = "fp8_ue8m0"
    block_size = 32
    description = "e4m3fn values + one power-of-two scale byte per 32 values (DeepSeek Engram)"

    def _row_bytes(self, dim: int) -> int:
        return dim + dim // 32

    def _encode(self, x: np.ndarray, scale: float) -> np.ndarray:
        n, dim = x.shape
        blocks = x.reshape(n, dim // 32, 32).astype(np.float64)
        amax = np.abs(blocks).max(axis=2)
        with np.errstate(divide="ignore"):
            k = np.ceil(np.log2(np.where(amax > 0, amax / 448.0, 1.0)))
        k = np.clip(k, -126, 127).astype(np.int64)  # bytes 1..254: never 0 (-> 0.0) or 255 (inf)
        vals = E4M3.encode((blocks / np.ldexp(1.0, k)[:, :, None]).reshape(n, dim))
        return np.concatenate([vals, (k + 127).astype(np.uint8)], axis=1)

    def _decode_numpy(self, rows: np.ndarray, dim: int, scale: float) -> np.ndarray:
        n = rows.shape[0]
        v = E4M3_LUT[rows[:, :dim]].reshape(n, dim // 32, 32)
        s = _ue8m0_scale(rows[:, dim:])  # [N, d/32]
        return bf16_round((v * s[:, :, None]).reshape(n, dim))

    def _decode_torch(self, rows, dim, scale):
        import torch

        n = rows.shape[0]
        v = rows[:, :dim].contiguous().view(torch.float8_e4m3fn).float().view(n, dim // 32, 32)
        s = (rows[:, dim:].to(torch.int32) << 23).view(torch.float32)  # [N, d/32]
        return (v * s[:, :, None]).view(n, dim).to(torch.bfloat16)


class _NF4(RowFormat):
    name = "nf4"
    block_size = 2
    description = "NF4 codes + fp16 row scale + 2 pad bytes (vLLM nf4 tables)"

    def _row_bytes(self, dim: int) -> int:
        return dim // 2 + 4

    def _encode(self, x: np.ndarray, scale: float) -> np.ndarray:
        n, dim = x.shape
        amax = np.abs(x).max(axis=1) if dim else np.zeros(n)
        row_scale = (amax / float(NF4_LEVELS[-1])).astype(np.float16)  # RNE
        s = row_scale.astype(np.float64)[:, None]
        q = np.divide(x, s, out=np.zeros(x.shape, np.float64), where=s > 0)
        codes = np.abs(q[:, :, None] - NF4_LEVELS.astype(np.float64)).argmin(axis=2)
        out = np.zeros((n, dim // 2 + 4), dtype=np.uint8)
        out[:, : dim // 2] = _pack_nibbles(codes.astype(np.uint8))
        out[:, dim // 2 : dim // 2 + 2] = row_scale.astype("<f2").view(np.uint8).reshape(n, 2)
        return out

    def _decode_numpy(self, rows: np.ndarray, dim: int, scale: float) -> np.ndarray:
        levels = NF4_LEVELS[_unpack_nibbles(rows[:, : dim // 2])]
        s = rows[:, dim // 2 : dim // 2 + 2].copy().view("<f2").astype(np.float32)  # [N, 1]
        return bf16_round(levels * s)

    def _decode_torch(self, rows, dim, scale):
        import torch

        n = rows.shape[0]
        codes = rows[:, : dim // 2]
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(n, dim)
        levels = _torch_lut(NF4_LEVELS, rows.device)[nibbles.long()]
        s = rows[:, dim // 2 : dim // 2 + 2].contiguous().view(torch.float16).float()  # [N, 1]
        return (levels * s).to(torch.bfloat16)


FORMATS: dict[str, RowFormat] = {
    f.name: f for f in (_BF16(), _FP8E4M3(), _NVFP4(), _FP8UE8M0(), _NF4())
}

_ALIASES = {
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "bfloat16": "bf16",
    "mxfp8": "fp8_ue8m0",
}


def get_format(name: str | RowFormat) -> RowFormat:
    """The RowFormat called `name` (aliases: fp8, float8_e4m3fn, bfloat16, mxfp8)."""
    if isinstance(name, RowFormat):
        return name
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    try:
        return FORMATS[key]
    except KeyError:
        known = ", ".join(FORMATS)
        raise ValueError(f"unknown row format {name!r}; known formats: {known}") from None
