"""Where the per-layer rows come from, read in bounded chunks: the model's own weight (any
device), or the checkpoint's safetensors file (`safe_open(..., framework="pt")` + `get_slice`,
never pickle) — plus the value digest that fingerprints them.

Fingerprint (decided here; see docs/transformers.md): a SHA-256 over the table's *values*, not
over files or dtypes, so a bf16 checkpoint, the model loaded from it in bf16 or in float32, and
its table all agree, while two fine-tunes with identical file names and sizes never do. The
bytes hashed are the values as bf16 when every value is exactly a bf16 (always, for bf16
weights), else as float32; chunks of a fixed number of rows are hashed on worker threads and
the digest is the SHA-256 of their digests (so every core hashes).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CHUNK_VALUES",
    "CheckpointSource",
    "CheckpointTensor",
    "RowSource",
    "ValueDigest",
    "WeightSource",
    "find_checkpoint_tensor",
    "local_checkpoint_dir",
]

#: values per chunk (64 MiB of bf16): bounds host memory while packing or hashing any table; a
#: fixed row count per chunk (whatever the dtype) keeps the chunked digest source-independent
CHUNK_VALUES = 32 << 20
_HASH_THREADS = 4
TENSOR_SUFFIX = "embed_tokens_per_layer.weight"


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _sha256(t: torch.Tensor) -> bytes:
    return hashlib.sha256(_bytes(t)).digest()  # hashlib releases the GIL on large buffers


class ValueDigest:
    """SHA-256 of a table's values, chunk by chunk in row order, independent of the dtype
    holding them. Each `update` is one chunk (a fixed row count: RowSource.chunks)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="plestore-hash")
        self._bf16: list[Future] = []
        self._f32: list[Future] = []
        self._inflight: deque[Future] = deque()
        self.exact_bf16 = True  # every value so far is exactly a bf16

    def _submit(self, leaves: list, t: torch.Tensor) -> None:
        while len(self._inflight) >= 2 * _HASH_THREADS:  # bounds the chunks held in memory
            self._inflight.popleft().result()
        f = self._pool.submit(_sha256, t)
        leaves.append(f)
        self._inflight.append(f)

    def update(self, rows: torch.Tensor) -> None:
        """rows: a CPU float tensor [n, dim] of any float dtype."""
        if rows.dtype == torch.bfloat16:
            self._submit(self._bf16, rows)
            return
        as_bf16 = rows.to(torch.bfloat16)
        if self.exact_bf16:
            back = as_bf16.to(rows.dtype)
            same = (back == rows) | (torch.isnan(back) & torch.isnan(rows))
            self.exact_bf16 = bool((same & (back.signbit() == rows.signbit())).all())
        if self.exact_bf16:
            self._submit(self._bf16, as_bf16)
        self._submit(self._f32, rows.to(torch.float32))

    def hexdigest(self) -> str:
        kind, leaves = ("bf16", self._bf16) if self.exact_bf16 else ("f32", self._f32)
        root = hashlib.sha256(b"".join(f.result() for f in leaves)).hexdigest()
        self._pool.shutdown()
        return f"{kind}:sha256x{len(leaves)}:{root}"


class RowSource:
    """Rows [start, start + n) of a [rows, dim] float table, chunk by chunk, on the CPU."""

    rows: int
    dim: int
    dtype: torch.dtype

    def read(self, start: int, n: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        step = max(1, CHUNK_VALUES // self.dim)
        for start in range(0, self.rows, step):
            yield start, self.read(start, min(step, self.rows - start))

    def device_chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """`chunks`, each where the source keeps it (a GPU weight's stay on the GPU)."""
        return self.chunks()

    def digest(self) -> ValueDigest:
        d = ValueDigest()
        for _, chunk in self.chunks():
            d.update(chunk)
        return d

    def describe(self) -> dict:  # pragma: no cover - interface
        raise NotImplementedError

    def file_stats(self) -> list | None:
        """What identifies unchanged source files (None: nothing to trust, re-hash)."""
        return None


class WeightSource(RowSource):
    """The model's weight, wherever it lives; chunks are copied to the CPU one at a time."""

    def __init__(self, weight: torch.Tensor, where: str) -> None:
        self.weight = weight.detach()
        self.rows, self.dim = (int(s) for s in self.weight.shape)
        self.dtype = self.weight.dtype
        self.where = where

    def read(self, start: int, n: int) -> torch.Tensor:
        return self.weight[start : start + n].to("cpu", copy=True)

    def device_chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        step = max(1, CHUNK_VALUES // self.dim)
        for start in range(0, self.rows, step):
            yield start, self.weight[start : start + step]

    def describe(self) -> dict:
        return {
            "kind": "weights",
            "module": self.where,
            "device": str(self.weight.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }


@dataclass(frozen=True)
class CheckpointTensor:
    """The per-layer weight inside a local safetensors checkpoint."""

    directory: Path
    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def file_stats(self) -> list:
        st = self.file.stat()
        return [self.file.name, st.st_size, st.st_mtime_ns]


class CheckpointSource(RowSource):
    """Rows straight from the checkpoint file: `get_slice(key)[a:b]` reads only those rows,
    cast to `dtype` (the dtype the model holds the weight in: transformers casts the same way
    when it loads, so the table holds exactly the model's values)."""

    def __init__(self, tensor: CheckpointTensor, dtype: torch.dtype | None = None) -> None:
        from safetensors import safe_open

        self.tensor = tensor
        self.rows, self.dim = tensor.shape
        self.dtype = dtype or tensor.dtype
        self._file = safe_open(str(tensor.file), framework="pt")
        self._slice = self._file.get_slice(tensor.key)

    def read(self, start: int, n: int) -> torch.Tensor:
        return self._slice[start : start + n].to(self.dtype)

    def describe(self) -> dict:
        return {
            "kind": "checkpoint",
            "directory": str(self.tensor.directory),
            "file": self.tensor.file.name,
            "tensor": self.tensor.key,
            "dtype": str(self.tensor.dtype).removeprefix("torch."),
            "cast_to": str(self.dtype).removeprefix("torch."),
        }

    def file_stats(self) -> list:
        """The file as packed: name, size, mtime and the dtype its values were cast to."""
        return [*self.tensor.file_stats(), str(self.dtype)]


_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def local_checkpoint_dir(model_or_path) -> Path | None:
    """The local directory a model was loaded from (`config._name_or_path` / `name_or_path`),
    when it holds safetensors files; else None."""
    if isinstance(model_or_path, (str, os.PathLike)):
        candidates = [model_or_path]
    else:
        config = getattr(model_or_path, "config", None)
        candidates = [
            getattr(model_or_path, "name_or_path", None),
            getattr(config, "_name_or_path", None),
            getattr(config, "name_or_path", None),
        ]
    for c in candidates:
        if c and Path(c).is_dir() and any(Path(c).glob("*.safetensors")):
            return Path(c)
    return None


def find_checkpoint_tensor(directory: str | os.PathLike) -> CheckpointTensor | None:
    """The `...embed_tokens_per_layer.weight` tensor of a safetensors checkpoint (the index's
    weight map first, else every *.safetensors file's header). None when absent."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    files: list[Path]
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted({f for k, f in weight_map.items() if k.endswith(TENSOR_SUFFIX)})
        files = [directory / n for n in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
            for key in names:
                if key.endswith(TENSOR_SUFFIX):
                    sl = f.get_slice(key)
                    st_dtype = sl.get_dtype()
                    if st_dtype not in _ST_DTYPES:
                        raise ValueError(
                            f"{file.name}: {key} is {st_dtype}; plestore packs per-layer "
                            f"embeddings from {', '.join(_ST_DTYPES)} checkpoints"
                        )
                    return CheckpointTensor(
                        directory, file, key, tuple(sl.get_shape()), _ST_DTYPES[st_dtype]
                    )
    return None
