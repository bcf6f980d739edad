"""A loaded model's per-layer rows packed into a plestore table file (`prepare_weight_table`),
or the one already there reused. Checkpoints on disk go through the one packing path every
engine shares (`common/packed.py`, `plestore.integrations.tables.prepare_table`); this module
packs what only a loaded model has: its live weights.

    table_dir/embed_tokens_per_layer.<format>.json + .rows    (one table per format)

The rows are stored unscaled (the raw weight); the module applies embed_scale as transformers
does. Lossy formats get their per-table scale from a first pass over the values (max |x|).

Sources: a loaded model's rows come from its checkpoint file when it was loaded from one, each
chunk checked against the weight it must equal (any difference: the weight was changed after
loading, so the rows come from the weight instead); else from the weight itself.

Reuse: the stored shape and format must match and the stored value digest must equal this
model's (source.py says what it hashes): the live weight's digest when there is one, else the
checkpoint's — skipped when the checkpoint file is the one the table was packed from, unchanged
(name, size, mtime). Any difference is a `TableMismatchError`, never a silent rewrite.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

import plestore
from plestore.formats import get_format
from plestore.integrations.tables import TableMismatchError
from plestore.integrations.transformers.common.source import RowSource, ValueDigest, WeightSource
from plestore.lookup import Table
from plestore.options import TableOptions
from plestore.spec import RowLayout, TableSpec
from plestore.tablefile import TableFile, TableWriter

__all__ = [
    "PLAIN",
    "PreparedTable",
    "Site",
    "TableMismatchError",
    "check_table_dir",
    "checked_table_options",
    "default_format",
    "open_for",
    "prepare_weight_table",
]

log = logging.getLogger("plestore")


class _SourceDiffers(Exception):
    """The checkpoint's rows are not the live weight's (it was changed after loading)."""


class Site(Protocol):
    """A model's per-layer table as found in it: a Gemma `PleSite` or a Qwen4Exp `QwenSite`."""

    path: str
    rows: int
    dim: int

    @property
    def family_name(self) -> str: ...

    @property
    def weight_path(self) -> str: ...

    def identity(self) -> dict: ...


@dataclass(frozen=True)
class PreparedTable:
    file: TableFile
    reused: bool
    fingerprint: str
    origin: dict  # what the rows were packed from
    seconds: float


def check_table_dir(table_dir: str | os.PathLike, spec: TableSpec) -> Path:
    """The table's metadata path; raises if the directory cannot hold a new table."""
    d = Path(table_dir)
    meta = d / f"{spec.name}.json"
    if meta.exists():
        return meta
    if d.exists() and not d.is_dir():
        raise NotADirectoryError(f"table_dir {d} exists and is not a directory")
    probe = d if d.exists() else next((p for p in d.parents if p.exists()), Path("/"))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot create the table in {d}: {probe} is not writable")
    return meta


def _fingerprint(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def _identity(site, values: str) -> dict:
    """What the table was packed for: the site's shape (and hash) plus its values' digest."""
    return {**site.identity(), "values": values}


#: formats that store values as they are: exact iff every value is a number of that dtype
PLAIN = ("bf16", "fp16", "fp32")


def _encode(fmt, rows: torch.Tensor, scale: float | None) -> np.ndarray:
    """CPU float rows [n, dim] -> packed uint8 [n, row_bytes]; a plain format of the rows' own
    dtype is a byte copy, another plain one a cast (round to nearest even, as torch casts)."""
    if fmt.name in PLAIN:
        return rows.to(fmt.torch_dtype).contiguous().view(torch.uint8).numpy()
    return fmt.encode(rows.float().numpy(), scale=scale if fmt.has_table_scale else None).rows


def _representable(rows: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every value of rows is exactly a `dtype` number (NaN and the sign of zero included)."""
    if rows.dtype == dtype:
        return True
    back = rows.to(dtype).to(rows.dtype)
    same = (back == rows) | (torch.isnan(back) & torch.isnan(rows))
    return bool((same & (back.signbit() == rows.signbit())).all())


def _table_scale(fmt, source: RowSource) -> float | None:
    """Per-table scale of a lossy format, as its encoder would derive it from all rows — but 1.0
    for fp8_e4m3 when every value is an e4m3 number (a model loaded from an FP8 checkpoint:
    transformers casts the e4m3 rows and drops their scale), which keeps them exactly."""
    if not fmt.has_table_scale:
        return None
    amax, e4m3 = 0.0, fmt.name == "fp8_e4m3"
    for _, chunk in source.device_chunks():  # a GPU weight is checked where it lives
        amax = max(amax, float(chunk.abs().max()))
        e4m3 = e4m3 and _representable(chunk, torch.float8_e4m3fn)
    if e4m3:
        return 1.0
    probe = np.full((1, fmt.block_size), amax, np.float32)
    return fmt.encode(probe).scale


def _pack(
    meta: Path, spec: TableSpec, site: Site, source: RowSource, live: torch.Tensor | None
) -> tuple[TableFile, str]:
    """Write the table from `source`; with `live`, every chunk must equal the weight's rows."""
    fmt = get_format(spec.format)
    check = live is not None and not isinstance(source, WeightSource)
    scale = _table_scale(fmt, source)
    if scale is not None:
        spec = spec.replace(scale=scale)
    digest = ValueDigest()
    e4m3 = fmt.name == "fp8_e4m3" and scale == 1.0  # every value an e4m3 number (_table_scale)
    with TableWriter(meta.parent, spec, RowLayout(spec.row_bytes)) as w:
        for start, rows in source.device_chunks():
            chunk = rows.to("cpu")
            if check:
                want = live[start : start + len(chunk)]
                if not torch.equal(chunk.to(device=want.device, dtype=want.dtype), want):
                    raise _SourceDiffers(start)
            digest.update(chunk)
            if fmt.name in PLAIN and not _representable(chunk, fmt.torch_dtype):
                have = str(source.dtype).removeprefix("torch.")
                raise ValueError(
                    f"{site.weight_path} is {have} with values that are not {fmt.out_dtype} "
                    f"numbers: a {fmt.name} table would round them. Leave format unset (a "
                    f"table of the weight's own dtype, {have}), cast the model first "
                    f"(model.to(torch.{fmt.out_dtype})), or choose a lossy format explicitly "
                    "(format='fp8_e4m3' or 'nvfp4')"
                )
            if e4m3:  # exact cast, on the weight's device: 1 byte per value crosses to the host
                w.write_rows(rows.to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy())
            else:
                w.write_rows(_encode(fmt, chunk, scale))
        identity = _identity(site, digest.hexdigest())
        fp = _fingerprint(identity)
        stats = source.file_stats()
        w.source = {
            "fingerprint": fp,
            "identity": identity,
            "origin": {**source.describe(), **({"file_stats": stats} if stats else {})},
            "packed_by": "plestore.integrations.transformers",
            "exact": fmt.name in PLAIN or (fmt.name == "fp8_e4m3" and scale == 1.0),
        }
        return w.commit(), fp


def prepare_weight_table(
    table_dir: str | os.PathLike,
    spec: TableSpec,
    site: Site,
    source: RowSource,
    live: torch.Tensor | None = None,
) -> PreparedTable:
    """Reuse the table in table_dir when its fingerprint matches this model's, else pack it
    from `source` (checked against the `live` weight, falling back to it)."""
    t0 = time.perf_counter()
    meta = check_table_dir(table_dir, spec)
    if meta.exists():
        tf = TableFile.open(meta)
        _check_reusable(tf, spec, site, source, live)
        origin = tf.source.get("origin", {})
        return PreparedTable(tf, True, tf.source["fingerprint"], origin, time.perf_counter() - t0)
    try:
        tf, fp = _pack(meta, spec, site, source, live)
    except _SourceDiffers as e:
        log.warning(
            "plestore: %s row %s differs from the checkpoint it was loaded from (changed after "
            "loading?); packing the table from the weight instead",
            site.path,
            e.args[0],
        )
        tf, fp = _pack(meta, spec, site, WeightSource(live, site.weight_path), None)
    return PreparedTable(tf, False, fp, tf.source["origin"], time.perf_counter() - t0)


def _check_reusable(
    tf: TableFile, spec: TableSpec, site: Site, source: RowSource, live: torch.Tensor | None
) -> None:
    stored = tf.source.get("identity") or {}
    where = str(tf.meta_path)
    mine = site.identity()
    if stored.get("kind") != mine["kind"]:
        raise TableMismatchError(
            f"{where} was not packed by plestore's transformers integration for a "
            f"{site.family_name} model (source {tf.source.get('origin') or tf.source or 'unknown'}"
            "); use another table_dir"
        )
    want = (spec.rows, spec.dim, spec.format)
    have = (tf.spec.rows, tf.spec.dim, tf.spec.format)
    theirs = {k: v for k, v in stored.items() if k != "values"}
    if have != want or theirs != mine:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        detail = "; ".join(f"{k}: table {theirs.get(k)!r}, model {mine.get(k)!r}" for k in diff)
        raise TableMismatchError(
            f"{where} holds a [{have[0]}, {have[1]}] {have[2]} table; {site.path} needs "
            f"[{want[0]}, {want[1]}] {want[2]}{' (' + detail + ')' if detail else ''}: it "
            "belongs to a different model or config. Use another table_dir"
        )
    if live is not None:  # what the model computes with
        values = WeightSource(live, site.weight_path).digest().hexdigest()
    elif source.file_stats() is not None and source.file_stats() == (
        tf.source.get("origin") or {}
    ).get("file_stats"):
        values = stored["values"]  # the very file it was packed from, unchanged
    else:
        values = source.digest().hexdigest()
    fp = _fingerprint(_identity(site, values))
    if fp != tf.source.get("fingerprint"):
        raise TableMismatchError(
            f"{where} was packed from another model's weights (fingerprint "
            f"{tf.source.get('fingerprint')}, this model's {fp}; packed from "
            f"{tf.source.get('origin')}). Use another table_dir, or delete it to repack"
        )


def default_format(dtype: torch.dtype) -> str:
    """The lossless table format of a weight dtype: bf16, fp16, else fp32."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def checked_table_options(tier: str, device: torch.device, site: Any, table_options: dict) -> dict:
    """Table options, validated now (before anything is packed or modified)."""
    opts = dict(table_options)
    # Gemma 3n remaps ids into range itself and Qwen4Exp's hash yields only table rows: skip the
    # range check (a GPU sync per lookup)
    opts.setdefault("check_ids", getattr(site, "out_of_range", "hash") == "error")
    TableOptions.from_env(tier=tier, device=str(device), **opts)
    return opts


def open_for(
    prepared: PreparedTable, tier: str, device: torch.device, opts: dict
) -> tuple[Table, float]:
    t0 = time.perf_counter()
    table = plestore.open_table(str(prepared.file.meta_path), tier=tier, device=str(device), **opts)
    return table, time.perf_counter() - t0
