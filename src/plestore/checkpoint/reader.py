"""Open a Hugging Face checkpoint directory and read tensors by name, a row range at a time.

A checkpoint is `model.safetensors.index.json` plus the shard files its weight_map names, or a
single `model.safetensors`, next to a `config.json`. Opening parses every header (tens of KB, not
the hundreds of GB behind them) and cross-checks the index against the headers; reading a row
range is one pread of exactly those bytes, so memory never depends on a tensor's size.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from plestore.checkpoint.safetensors_io import (
    SafetensorsError,
    SafetensorsHeader,
    TensorInfo,
    decode_tensor,
    read_header,
)

__all__ = ["INDEX_NAME", "SINGLE_NAME", "Checkpoint", "CheckpointError"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint is missing pieces, or its tensors contradict its config."""


class Checkpoint:
    """The tensors of a checkpoint: names -> `TensorInfo` (dtype, shape, file, offset).

    Holds one read-only descriptor per file, opened on first use; preads on it are thread-safe.
    Use as a context manager (or call close()).
    """

    def __init__(self, root: Path, headers: list[SafetensorsHeader], index: Path | None) -> None:
        self.root = root
        self.headers = headers
        self.index_path = index
        self.tensors: dict[str, TensorInfo] = {}
        for h in headers:
            for name, info in h.tensors.items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"tensor {name} is in both {self.tensors[name].file.name} and {h.path.name}"
                    )
                self.tensors[name] = info
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._config: dict | None = None

    # -- open --------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        """Open a checkpoint directory (or one .safetensors file) and validate every header."""
        path = Path(path)
        if path.is_file() and path.suffix == ".safetensors":
            return cls(path.parent, [read_header(path)], None)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
        index = path / INDEX_NAME
        if index.exists():
            return cls(path, cls._headers_from_index(index), index)
        if (path / SINGLE_NAME).exists():
            return cls(path, [read_header(path / SINGLE_NAME)], None)
        raise CheckpointError(f"{path} holds neither {INDEX_NAME} nor {SINGLE_NAME}")

    @staticmethod
    def _headers_from_index(index: Path) -> list[SafetensorsHeader]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AssertionError):
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map)") from None
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or "/" in fname or fname.startswith("."):
                raise CheckpointError(f"{index}: tensor {name} maps to a bad file name {fname!r}")
            files.setdefault(fname, []).append(name)
        headers = []
        for fname, names in files.items():
            fpath = index.parent / fname
            if not fpath.exists():
                raise CheckpointError(
                    f"shard file {fname} (holding {names[0]} and {len(names) - 1} more tensors "
                    f"per {index.name}) is missing"
                )
            h = read_header(fpath)
            lost = [n for n in names if n not in h.tensors]
            if lost:
                raise CheckpointError(
                    f"{index.name} says tensor {lost[0]} is in {fname}, but {fname}'s header "
                    f"does not have it ({len(lost)} such tensors)"
                )
            headers.append(h)
        return headers

    # -- metadata ----------------------------------------------------------------------------
    @property
    def config(self) -> dict:
        """The checkpoint's config.json."""
        if self._config is None:
            p = self.root / "config.json"
            try:
                self._config = json.loads(p.read_text())
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {self.root} has no config.json") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{p} is not valid JSON: {e}") from None
        return self._config

    @property
    def nbytes(self) -> int:
        return sum(h.file_size for h in self.headers)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.root} has no tensor {name}") from None

    def file_stats(self, infos: list[TensorInfo] | None = None) -> list[dict[str, Any]]:
        """Name, size and mtime of the files (holding `infos`, or all): the cheap part of a
        source fingerprint."""
        files = {i.file for i in infos} if infos is not None else {h.path for h in self.headers}
        return [
            {"file": h.path.name, "size": h.file_size, "mtime_ns": h.mtime_ns}
            for h in self.headers
            if h.path in files
        ]

    # -- reading -----------------------------------------------------------------------------
    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def read_tensor(self, name: str, max_bytes: int = 64 << 20) -> np.ndarray:
        """A whole (small) tensor as numpy (see `decode_tensor`); refuses big ones."""
        info = self.tensor(name)
        if info.nbytes > max_bytes:
            raise CheckpointError(f"tensor {name} is {info.nbytes} bytes; read it by rows")
        return decode_tensor(info, self._pread(info, info.offset, info.nbytes))

    def read_rows(
        self, info: TensorInfo | str, start: int, count: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Raw bytes of rows [start, start+count) of a tensor: uint8 [count, row_bytes].

        `out` (C-contiguous uint8 of that shape) receives them without a copy.
        """
        if isinstance(info, str):
            info = self.tensor(info)
        if start < 0 or count < 0 or start + count > info.rows:
            raise CheckpointError(
                f"rows [{start}, {start + count}) are outside tensor {info.name} ({info.rows} rows)"
            )
        rb = info.row_bytes
        if out is None:
            out = np.empty((count, rb), np.uint8)
        elif out.shape != (count, rb) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous uint8 [{count}, {rb}]")
        self._pread(info, info.offset + start * rb, count * rb, out.reshape(-1))
        return out

    def _pread(self, info: TensorInfo, offset: int, size: int, out: np.ndarray | None = None):
        buf = np.empty(size, np.uint8) if out is None else out
        fd, view, done = self._fd(info.file), memoryview(buf), 0
        while done < size:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise SafetensorsError(
                    f"{info.file}: tensor {info.name}: file ended at byte {offset + done} "
                    "(truncated since it was opened?)"
                )
            done += n
        return buf

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        n, k = len(self.headers), len(self.tensors)
        return f"Checkpoint({str(self.root)!r}, {n} files, {k} tensors)"
