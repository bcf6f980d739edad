"""The hot-row profile: the rows real text reads most, beside a table for its GPU row cache.

    TABLE.hot.npy   int64 [2, rows]: row ids, most read first, and their read counts
    TABLE.hot.json  the table's data id (a repacked table ignores a stale profile) and sources

`plestore profile` writes it from token streams (`plestore text`): each stream hashed with the
table's own hash, every document a fresh request; the GPU row cache's static set takes its
hottest rows (`load_profile`). `TokenStream` is such a stream, also turned into what an engine
looks up (prefill chunks, decode steps) by the benchmarks.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from plestore.hashing import make_hash

if TYPE_CHECKING:
    from plestore.tablefile import TableFile

__all__ = [
    "TokenStream",
    "hot_rows",
    "load_profile",
    "profile_path",
    "profile_streams",
    "write_profile",
]

log = logging.getLogger("plestore")


def hot_rows(row_ids: np.ndarray, min_count: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(rows, counts) of the rows read at least `min_count` times, most read first (ties:
    lower id first)."""
    rows, counts = np.unique(np.asarray(row_ids, np.int64).reshape(-1), return_counts=True)
    keep = counts >= min_count
    rows, counts = rows[keep], counts[keep]
    order = np.argsort(-counts, kind="stable")
    return rows[order], counts[order].astype(np.int64)


def profile_path(file: TableFile) -> Path:
    """Where a table's hot-row profile lives: beside its metadata, named after it."""
    return file.meta_path.with_name(file.meta_path.stem + ".hot.npy")


def write_profile(file: TableFile, rows: np.ndarray, counts: np.ndarray, text: dict) -> Path:
    """Write the hot rows (most used first) and their use counts, keyed by the table's data
    id (a repacked table ignores a stale profile)."""
    rows, counts = np.asarray(rows, np.int64), np.asarray(counts, np.int64)
    if rows.shape != counts.shape or rows.ndim != 1:
        raise ValueError("profile rows and counts must be 1-D arrays of one length")
    if rows.size and (rows.min() < 0 or rows.max() >= file.spec.rows):
        raise ValueError(f"profile rows must lie in [0, {file.spec.rows})")
    path = profile_path(file)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, np.stack([rows, counts]))
    tmp.replace(path)
    meta = {"data_id": file.data_id, "rows": int(rows.size), "source": text}  # (the text read)
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    return path


def load_profile(file: TableFile) -> np.ndarray | None:
    """The table's hot rows, most used first, or None (no profile, or one of other data)."""
    path = profile_path(file)
    if not path.exists():
        return None
    meta = json.loads(path.with_suffix(".json").read_text())
    if meta.get("data_id") != file.data_id:
        log.warning("plestore: %s profiles other data (data_id differs): not used", path)
        return None
    arr = np.load(path, allow_pickle=False)
    if arr.ndim != 2 or arr.shape[0] != 2 or arr.dtype != np.int64:
        raise ValueError(f"{path}: expected int64 [2, rows] (rows, counts)")
    rows = arr[0]
    if rows.size and (rows.min() < 0 or rows.max() >= file.spec.rows):
        raise ValueError(f"{path}: rows outside the table [0, {file.spec.rows})")
    return rows


def profile_streams(
    file: TableFile,
    streams: list[str],
    min_count: int = 1,
    max_rows: int | None = None,
    split: float | None = None,
) -> dict[str, Any]:
    """Profile `file` on token streams and write the profile; what `plestore profile` prints:
    the profile's path, rows, bytes, the share of the streams' reads its rows take, and the
    sources. split: only a seeded share of each stream's documents (as `bench hitrate`)."""
    if file.spec.hash is None:
        raise ValueError(f"table {file.name} has no hash spec: its rows are not addressed by text")
    if min_count < 1:
        raise ValueError(f"--min-count must be >= 1, got {min_count}")
    if split is not None and not 0 < split < 1:
        raise ValueError(f"--split must be a share in (0, 1), got {split}")
    hasher = make_hash(file.spec.hash)
    parts, tokens = [], 0
    for path in streams:
        stream = TokenStream.load(path)
        if split is not None:
            stream = stream.split(split)[0]
        tokens += stream.ids.size
        parts.append(stream.row_ids(hasher).reshape(-1))
    rows, counts = hot_rows(np.concatenate(parts), min_count)
    if max_rows is not None:
        rows, counts = rows[:max_rows], counts[:max_rows]
    text: dict[str, Any] = {"streams": streams, "tokens": int(tokens), "min_count": min_count}
    if split is not None:
        text["split"] = split
    out = write_profile(file, rows, counts, text)
    return {
        "table": file.name,
        "profile": str(out),
        "rows": int(rows.size),
        "bytes": int(rows.size) * file.layout.row_bytes,
        "read_share": float(counts.sum()) / max(1, sum(p.size for p in parts)),
        **text,
    }


class TokenStream:
    """A stream written by `build_stream`: ids int32 [N] and document starts [D + 1]."""

    def __init__(self, ids: np.ndarray, starts: np.ndarray, meta: dict | None = None) -> None:
        if starts.ndim != 1 or starts.size < 2 or starts[0] != 0 or starts[-1] != ids.size:
            raise ValueError("document starts must run from 0 to the number of tokens")
        if np.any(np.diff(starts) <= 0):
            raise ValueError("documents must be non-empty and in order")
        self.ids, self.starts, self.meta = ids, starts.astype(np.int64), meta or {}

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenStream:
        p = Path(path)
        meta = json.loads(p.with_suffix(".json").read_text())
        ids = np.load(p.with_suffix(".npy"), allow_pickle=False)
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise ValueError(f"{p.with_suffix('.npy')}: expected a 1-D integer array")
        if ids.size != meta.get("tokens"):
            raise ValueError(f"{p}: {ids.size} ids but the JSON says tokens={meta.get('tokens')}")
        starts = np.array([d["start"] for d in meta["docs"]] + [ids.size], dtype=np.int64)
        return cls(ids, starts, meta)

    @property
    def documents(self) -> int:
        return self.starts.size - 1

    def doc(self, i: int) -> np.ndarray:
        return self.ids[self.starts[i] : self.starts[i + 1]]

    def subset(self, docs: np.ndarray) -> TokenStream:
        """The stream of documents `docs` (in that order)."""
        parts = [self.doc(int(d)) for d in docs]
        starts = np.cumsum([0] + [p.size for p in parts])
        return TokenStream(np.concatenate(parts), starts, self.meta)

    def split(self, fraction: float = 0.5, seed: int = 0) -> tuple[TokenStream, TokenStream]:
        """Two streams of documents drawn at random (a profile on one, served on the other):
        the first holds about `fraction` of the tokens."""
        if self.documents < 2:
            raise ValueError("splitting a stream needs at least two documents")
        order = np.random.default_rng(seed).permutation(self.documents)
        sizes = np.diff(self.starts)[order]
        k = int(np.searchsorted(np.cumsum(sizes), fraction * self.ids.size)) + 1
        k = min(max(k, 1), self.documents - 1)
        return self.subset(np.sort(order[:k])), self.subset(np.sort(order[k:]))

    def row_ids(self, hasher) -> np.ndarray:
        """Row ids int64 [N, heads] of the whole stream, each document a fresh request (any
        `plestore.hashing` hasher)."""
        ids = self.ids.astype(np.int64)
        rows, _ = hasher.step(ids, self.starts, hasher.fresh_state(self.documents))
        return rows

    def prefill_chunks(self, hasher, chunk: int, limit: int | None = None) -> Iterator[np.ndarray]:
        """Row ids [<= chunk, heads] of each prefill chunk: documents in order, each chunked
        with its context carried."""
        done = 0
        for d in range(self.documents):
            toks, ctx = self.doc(d).astype(np.int64), hasher.fresh_context(1)
            for a in range(0, toks.size, chunk):
                part = toks[a : a + chunk]
                rows, ctx = hasher.row_ids(part, np.array([0, part.size]), ctx)
                yield rows
                done += 1
                if limit is not None and done >= limit:
                    return

    def decode_steps(self, hasher, batch: int, steps: int, seed: int = 0) -> Iterator[np.ndarray]:
        """Row ids [batch, heads] of `steps` decode steps of `batch` concurrent requests, each
        over its own document from a random position (its context the two tokens before); a
        request at its document's end moves to the next unused document, from its start."""
        rng = np.random.default_rng(seed)
        order = rng.permutation(self.documents)
        nxt = 0
        pos = np.zeros(batch, np.int64)
        end = np.zeros(batch, np.int64)
        ctx = hasher.fresh_context(batch)
        w = ctx.shape[1]

        def start(r: int, anywhere: bool) -> None:
            nonlocal nxt
            d = order[nxt % self.documents]
            nxt += 1
            a, b = int(self.starts[d]), int(self.starts[d + 1])
            p = a + int(rng.integers(0, b - a)) if anywhere else a
            pos[r], end[r] = p, b
            prev = self.ids[max(a, p - w) : p].astype(np.int64)
            ctx[r] = hasher.eos_token_id
            if prev.size:
                ctx[r, w - prev.size :] = prev

        for r in range(batch):
            start(r, True)
        for _ in range(steps):
            toks = self.ids[pos].astype(np.int64)
            rows, ctx = hasher.decode_row_ids(toks, ctx)
            yield rows
            pos += 1
            for r in np.flatnonzero(pos >= end):
                start(int(r), False)
