"""Safetensors, read and written by hand.

A file is an 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`),
then the data region; offsets are relative to the data region's start.

Why by hand: we read a few rows of a 100 GB tensor at a time and must never load a whole file,
never unpickle, and never trust an offset before checking it. `read_header` checks everything a
reader later relies on (every tensor inside the file, sizes equal to shape x dtype, no overlaps),
so a truncated or hostile file fails here, naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plestore.formats import E4M3_LUT

__all__ = [
    "DTYPE_SIZES",
    "MAX_HEADER_BYTES",
    "SafetensorsError",
    "SafetensorsHeader",
    "TensorInfo",
    "decode_tensor",
    "layout_file",
    "read_header",
    "write_safetensors",
]

#: Bytes per element of every safetensors dtype string.
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,  # power-of-two scales (DeepSeek-V4.1's Engram scales)
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
#: The reference implementation refuses headers above 100 MB; so do we (a corrupt length field
#: would otherwise make us read gigabytes of "JSON").
MAX_HEADER_BYTES = 100_000_000
_MAX_DIMS = 64  # a tensor's rank (the reference has no limit; real ones are <= 5)
_NUMPY = {
    "BOOL": "?",
    "U8": "u1",
    "I8": "i1",
    "I16": "<i2",
    "U16": "<u2",
    "F16": "<f2",
    "I32": "<i4",
    "U32": "<u4",
    "F32": "<f4",
    "I64": "<i8",
    "U64": "<u8",
    "F64": "<f8",
}


class SafetensorsError(ValueError):
    """A file is not valid safetensors, or a tensor in it is not what it claims."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: `offset` is absolute in `file`, `nbytes` long."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def rows(self) -> int:
        """Length of the leading dimension (1 for a scalar)."""
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        """Bytes per index of the leading dimension."""
        return math.prod(self.shape[1:]) * self.itemsize if self.shape else self.itemsize

    def describe(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "file": self.file.name,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    file_size: int
    mtime_ns: int
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate the header of one safetensors file (reads only the header)."""
    path = Path(path)
    try:
        st = path.stat()
        with open(path, "rb", buffering=0) as f:
            # no readahead: a boot that reads every shard's header reads no tensor page
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(
                    f"{path} is not a safetensors file: {st.st_size} bytes, shorter than the "
                    "8-byte header length"
                )
            (n,) = struct.unpack("<Q", head)
            if n > st.st_size - 8:
                raise SafetensorsError(
                    f"{path}: header length {n} exceeds the file ({st.st_size} bytes); not a "
                    "safetensors file, or truncated"
                )
            if n > MAX_HEADER_BYTES or n < 2:
                raise SafetensorsError(f"{path}: implausible header length {n}; not safetensors")
            raw = f.read(n)
    except FileNotFoundError:
        raise SafetensorsError(f"safetensors file {path} is missing") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise SafetensorsError(f"{path} is not a safetensors file: header is not JSON") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path} is not a safetensors file: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + n
    data_size = st.st_size - data_start
    tensors = {
        name: _tensor_info(path, name, entry, data_start, data_size)
        for name, entry in header.items()
    }
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise SafetensorsError(f"{path}: tensors {a} and {b} overlap")
    return SafetensorsHeader(path, st.st_size, st.st_mtime_ns, data_start, tensors, metadata)


def _tensor_info(path: Path, name: str, e: Any, data_start: int, data_size: int) -> TensorInfo:
    where = f"{path}: tensor {name}"
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
        raise SafetensorsError(f"{where}: entry needs dtype, shape and data_offsets")
    dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise SafetensorsError(f"{where}: unknown dtype {dtype!r}"[:300])
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(_is_uint(d) for d in shape):
        raise SafetensorsError(
            f"{where}: shape {shape!r} is not a list of non-negative ints (at most {_MAX_DIMS})"[
                :300
            ]
        )
    if not (
        isinstance(offs, list)
        and len(offs) == 2
        and all(_is_uint(o) for o in offs)
        and offs[0] <= offs[1]
    ):
        raise SafetensorsError(f"{where}: bad data_offsets {offs!r}"[:300])
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if offs[1] - offs[0] != nbytes:
        raise SafetensorsError(
            f"{where}: data_offsets span {offs[1] - offs[0]} bytes, shape {shape} x {dtype} "
            f"needs {nbytes}"
        )
    if offs[1] > data_size:
        raise SafetensorsError(
            f"{where}: data [{offs[0]}, {offs[1]}) extends past the end of the file's data "
            f"({data_size} bytes): the file is truncated or its header is corrupt"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + offs[0], nbytes)


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def decode_tensor(info: TensorInfo, raw: bytes | np.ndarray) -> np.ndarray:
    """Bytes of a tensor -> numpy array of its shape. BF16 and F8_E4M3 become float32 holding
    the exact values (numpy has neither dtype); F8_E5M2 is refused."""
    buf = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, bytes) else raw.reshape(-1)
    if info.dtype == "BF16":
        out = (buf.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif info.dtype == "F8_E4M3":
        out = E4M3_LUT[buf]
    elif info.dtype in _NUMPY:
        out = buf.view(_NUMPY[info.dtype])
    else:
        raise SafetensorsError(f"{info.file}: tensor {info.name}: dtype {info.dtype} unsupported")
    return out.reshape(info.shape)


def layout_file(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """Plan a file holding `tensors` (name, dtype, shape) in this order, back to back.

    Returns the header bytes (length prefix included, JSON padded with spaces to 8 bytes as the
    reference writer does), {name: (absolute offset, nbytes)} and the total file size.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    pos, spans = 0, {}
    for name, dtype, shape in tensors:
        if name in header or name in spans:
            raise ValueError(f"tensor {name} appears twice")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        spans[name] = (pos, nbytes)
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return (
        struct.pack("<Q", len(text)) + text,
        {k: (start + o, n) for k, (o, n) in spans.items()},
        start + pos,
    )


def write_safetensors(
    path: str | os.PathLike,
    tensors: dict[str, tuple[str, np.ndarray]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write small tensors {name: (dtype string, array whose bytes are the tensor)} to a file.

    For small files (tests, configs); synth streams large tensors through `layout_file`.
    """
    plan = [(n, d, tuple(np.shape(a))) for n, (d, a) in tensors.items()]
    header, spans, _ = layout_file(plan, metadata)
    with open(path, "wb") as f:
        f.write(header)
        for name, (dtype, a) in tensors.items():
            data = np.ascontiguousarray(a).tobytes()
            if len(data) != spans[name][1]:
                raise ValueError(
                    f"{name}: {len(data)} bytes, {dtype} {np.shape(a)} needs {spans[name][1]}"
                )
            f.write(data)
