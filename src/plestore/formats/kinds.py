"""The row formats, one class each, and the registry `get_format` reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from plestore.formats.base import RowFormat, torch_lut
from plestore.formats.codecs import (
    E2M1,
    E2M1_LUT,
    E4M3,
    E4M3_LUT,
    NF4_LEVELS,
    bf16_round,
    pack_nibbles,
    ue8m0_scale,
    unpack_nibbles,
)

if TYPE_CHECKING:
    pass


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


class _FP16(RowFormat):
    name = "fp16"
    out_dtype = "float16"
    description = "IEEE half values, stored as is (float16 models, exactly)"

    def _row_bytes(self, dim: int) -> int:
        return 2 * dim

    def _encode(self, x: np.ndarray, scale: float) -> np.ndarray:
        return x.astype("<f2").view(np.uint8).reshape(x.shape[0], -1)  # RNE, as torch casts

    def _decode_numpy(self, rows: np.ndarray, dim: int, scale: float) -> np.ndarray:
        return rows.view("<f2").astype(np.float32)

    def _decode_torch(self, rows, dim, scale):
        import torch

        return rows.view(torch.float16)


class _FP32(RowFormat):
    name = "fp32"
    out_dtype = "float32"
    description = "float32 values, stored as is (float32 models, exactly)"

    def _row_bytes(self, dim: int) -> int:
        return 4 * dim

    def _encode(self, x: np.ndarray, scale: float) -> np.ndarray:
        return np.ascontiguousarray(x, "<f4").view(np.uint8).reshape(x.shape[0], -1)

    def _decode_numpy(self, rows: np.ndarray, dim: int, scale: float) -> np.ndarray:
        return rows.view("<f4").copy()

    def _decode_torch(self, rows, dim, scale):
        import torch

        return rows.view(torch.float32)


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
        return np.concatenate([pack_nibbles(codes), bs_codes], axis=1)

    def _decode_numpy(self, rows: np.ndarray, dim: int, scale: float) -> np.ndarray:
        n = rows.shape[0]
        fp4 = E2M1_LUT[unpack_nibbles(rows[:, : dim // 2])]  # [N, d]
        bs = E4M3_LUT[rows[:, dim // 2 :]]  # [N, d/16]
        v = (fp4.reshape(n, dim // 16, 16) * bs[:, :, None]).reshape(n, dim)  # exact in fp32
        return bf16_round(v * np.float32(scale))

    def _decode_torch(self, rows, dim, scale):
        import torch

        n = rows.shape[0]
        codes = rows[:, : dim // 2]
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(n, dim)  # [N, d]
        fp4 = torch_lut(E2M1_LUT, rows.device)[nibbles.long()]
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
        s = ue8m0_scale(rows[:, dim:])  # [N, d/32]
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
        out[:, : dim // 2] = pack_nibbles(codes.astype(np.uint8))
        out[:, dim // 2 : dim // 2 + 2] = row_scale.astype("<f2").view(np.uint8).reshape(n, 2)
        return out

    def _decode_numpy(self, rows: np.ndarray, dim: int, scale: float) -> np.ndarray:
        levels = NF4_LEVELS[unpack_nibbles(rows[:, : dim // 2])]
        s = rows[:, dim // 2 : dim // 2 + 2].copy().view("<f2").astype(np.float32)  # [N, 1]
        return bf16_round(levels * s)

    def _decode_torch(self, rows, dim, scale):
        import torch

        n = rows.shape[0]
        codes = rows[:, : dim // 2]
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(n, dim)
        levels = torch_lut(NF4_LEVELS, rows.device)[nibbles.long()]
        s = rows[:, dim // 2 : dim // 2 + 2].contiguous().view(torch.float16).float()  # [N, 1]
        return (levels * s).to(torch.bfloat16)


FORMATS: dict[str, RowFormat] = {
    f.name: f for f in (_BF16(), _FP8E4M3(), _NVFP4(), _FP8UE8M0(), _NF4(), _FP16(), _FP32())
}

_ALIASES = {
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "mxfp8": "fp8_ue8m0",
}


def get_format(name: str | RowFormat) -> RowFormat:
    """The RowFormat called `name` (aliases: fp8, float8_e4m3fn, bfloat16, float16, half,
    float32, float, mxfp8)."""
    if isinstance(name, RowFormat):
        return name
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    try:
        return FORMATS[key]
    except KeyError:
        known = ", ".join(FORMATS)
        raise ValueError(f"unknown row format {name!r}; known formats: {known}") from None
