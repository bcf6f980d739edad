"""The row-format interface: `RowFormat` (bytes per row, encode, decode in numpy and torch) and
the encode-error measure."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


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
    out_dtype: str = "bfloat16"  # the torch dtype rows decode to (bf16 but for fp16 / fp32)
    description: str = ""

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype a lookup delivers rows in."""
        import torch

        return getattr(torch, self.out_dtype)

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

        numpy in: float32 holding exactly the decoded values. torch in: `torch_dtype` (bf16 but
        for fp16 / fp32) on the rows' device.
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
            return torch.empty((0, dim), dtype=self.torch_dtype, device=rows.device)
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


def torch_lut(lut: np.ndarray, device: Any) -> torch.Tensor:
    import torch

    return torch.from_numpy(lut).to(device)


# ----------------------------------------------------------------------------------------------
# The formats
