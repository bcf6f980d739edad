"""Synthetic checkpoints in the real tensor names, dtypes and shard layout, at any scale.

`synth_checkpoint` writes `config.json` (a preset's real config, scaled through the n-gram
vocabulary base), `model.safetensors.index.json` and several shard files holding the table
(Qwen4Exp: 128 row shards; Engram: one tensor pair per layer; Gemma: one tensor), the hash
constant buffers, the PLE layer weights and unrelated tensors in between, so a reader must seek
and never gets away with assuming one table per file. Table rows come from `expected_rows`, so
they can be checked without the source.

Writing is parallel: row blocks of ~8 MiB are generated and pwritten by a thread pool (numpy and
pwrite release the GIL), bounded to 2 blocks per thread in flight. Files are written under
temporary names, fsynced and renamed; the index comes last, so an interrupted synth leaves no
directory that opens as a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from plestore.checkpoint.reader import INDEX_NAME, SINGLE_NAME, CheckpointError
from plestore.checkpoint.safetensors_io import DTYPE_SIZES, layout_file
from plestore.checkpoint.synthrows import SYNTH_SCALES, expected_rows, random_bf16
from plestore.io.streaming import bounded_map, peak_rss_bytes, progress_bar
from plestore.io.writeback import fsync_dir
from plestore.spec import PRESETS, TableSpec, preset_config, table_specs_from_hf_config

__all__ = ["DEFAULT_BASES", "SynthReport", "synth_checkpoint"]

#: Default scale per family: a table of a few hundred MB, so a demo takes seconds. The real
#: sizes need the real base (Qwen: 20,000,000 -> 320M rows; Engram 16,000,000; Gemma 262,144).
DEFAULT_BASES = {"qwen4exp": 100_000, "engram": 20_000, "identity": 16_384}
_BLOCK_BYTES = 8 << 20  # bytes generated per task


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Callable[[], np.ndarray] | None = None  # small tensors: their bytes
    table: int = -1  # table tensors: index into specs, shard start row, byte columns of the row
    first_row: int = 0
    cols: tuple[int, int] = (0, 0)


@dataclass
class SynthReport:
    out: str
    preset: str
    format: str
    seed: int
    tables: list[dict] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["throughput_bytes_per_s"] = self.bytes / self.seconds if self.seconds else None
        return d


def synth_checkpoint(
    out: str | os.PathLike,
    preset: str,
    format: str | None = None,
    ngram_vocab_size_base: int | None = None,
    seed: int = 0,
    hidden_size: int | None = None,
    text_only: bool = False,
    num_files: int | None = None,
    max_file_bytes: int = 5 << 30,
    threads: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> SynthReport:
    """Write a synthetic checkpoint of `preset` to directory `out` (see the module doc).

    `ngram_vocab_size_base` scales the table (None: `DEFAULT_BASES`; the real base gives the
    real size); `seed` picks the row values (not the hash: the config keeps the real hash
    seed); `hidden_size` shrinks the non-table weights; `text_only` uses `model.layers.L...`.
    """
    t0 = time.perf_counter()
    cfg, specs, kind = _config(preset, format, ngram_vocab_size_base, seed, hidden_size, text_only)
    plan = {"qwen4exp": _qwen_tensors, "engram": _engram_tensors}.get(kind, _gemma_tensors)
    tensors = plan(cfg.get("text_config", cfg), specs, seed, text_only)
    out = Path(out)
    _prepare_dir(out, overwrite)
    files = []  # (file name, its tensors, header bytes, {tensor: (offset, nbytes)}, size)
    groups = _split_files(tensors, num_files, max_file_bytes)
    for i, group in enumerate(groups):
        meta = {"format": "pt", "plestore_synth_seed": str(seed)}
        header, spans, size = layout_file([(t.name, t.dtype, t.shape) for t in group], meta)
        files.append(
            (f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", group, header, spans, size)
        )
    total = sum(f[4] for f in files)
    try:
        with progress_bar(total, f"synth {preset} {specs[0].format}", progress) as bar:
            _write_files(out, files, specs, seed, threads, bar)
    except OSError as e:
        for fname, *_ in files:
            (out / f".{fname}.partial").unlink(missing_ok=True)
        raise OSError(
            e.errno,
            f"{e.strerror or e} while writing a checkpoint into {out} (no "
            "index was written: the directory is not a checkpoint)",
        ) from e
    for fname, *_ in files:
        os.replace(out / f".{fname}.partial", out / fname)
    weight_map = {t.name: f[0] for f in files for t in f[1]}
    nbytes = sum(sum(n for _, n in f[3].values()) for f in files)
    _write_json(out / "config.json", cfg)
    _write_json(out / INDEX_NAME, {"metadata": {"total_size": nbytes}, "weight_map": weight_map})
    fsync_dir(out)
    tables = [
        {
            "name": s.name,
            "rows": s.rows,
            "dim": s.dim,
            "format": s.format,
            "row_bytes": s.row_bytes,
            "nbytes": s.nbytes,
        }
        for s in specs
    ]
    return SynthReport(
        str(out),
        preset,
        specs[0].format,
        seed,
        tables,
        [f[0] for f in files],
        total,
        time.perf_counter() - t0,
        peak_rss_bytes(),
    )


def _config(preset, format, base, seed, hidden_size, text_only) -> tuple[dict, list, str]:
    """The preset's config at this scale (+ a plestore_synth note) and its table specs, with the
    scales and tensor names synth writes."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    kind = table_specs_from_hf_config(preset_config(preset, format))[0].hash.kind
    cfg = preset_config(preset, format, base or DEFAULT_BASES[kind])
    if hidden_size is not None:
        cfg.get("text_config", cfg)["hidden_size"] = hidden_size
    cfg["plestore_synth"] = {"seed": seed, "preset": preset, "generator": "synthrows-v1"}
    specs = [
        s.replace(scale=SYNTH_SCALES.get(s.format, 1.0)) for s in table_specs_from_hf_config(cfg)
    ]
    if text_only:
        specs = [
            s.replace(tensor=s.tensor.replace("model.language_model.", "model.", 1)) for s in specs
        ]
    return cfg, specs, kind


def _write_files(out: Path, files: list, specs: list, seed: int, threads, bar) -> None:
    """Headers and small tensors from this thread; table rows from the pool; then fsync."""
    fds = {}
    try:
        parts: dict[tuple[int, int], list] = {}  # (table, shard's first row) -> its tensors
        for fname, group, header, spans, _ in files:
            fd = fds[fname] = os.open(out / f".{fname}.partial", _WRITE_FLAGS, 0o644)
            _pwrite(fd, header, 0)
            bar.update(len(header))
            for t in group:
                offset, nbytes = spans[t.name]
                if t.data is None:
                    parts.setdefault((t.table, t.first_row), []).append(
                        (t.shape[0], t.cols, fd, offset)
                    )
                    continue
                _pwrite(fd, np.ascontiguousarray(t.data()).view(np.uint8), offset)
                bar.update(nbytes)
        jobs = [
            job
            for (ti, first), ps in parts.items()
            for job in _table_jobs(specs[ti], seed, first, ps)
        ]
        with closing(bounded_map(lambda job: job(), jobs, threads)) as done:
            for n in done:  # on an error, closing drains the pool before the fds close
                bar.update(n)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _table_jobs(spec: TableSpec, seed: int, first_row: int, parts: list) -> list:
    """Closures that each generate one block of a shard's packed rows and write every part
    (e.g. NVFP4 codes and block scales: columns of the packed row) to its tensor; they return
    the bytes written."""
    rows = parts[0][0]
    step = max(1, _BLOCK_BYTES // spec.row_bytes)

    def job(a: int, n: int) -> int:
        packed = expected_rows(spec, seed, np.arange(first_row + a, first_row + a + n))
        for _, (c0, c1), fd, offset in parts:
            part = packed if c1 - c0 == packed.shape[1] else np.ascontiguousarray(packed[:, c0:c1])
            _pwrite(fd, part, offset + a * (c1 - c0))
        return packed.nbytes

    return [lambda a=a: job(a, min(step, rows - a)) for a in range(0, rows, step)]


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


# ----------------------------------------------------------------------------------------------
# Tensor plans per family
# ----------------------------------------------------------------------------------------------


def _small(seed: int, name: str, shape: tuple[int, ...]) -> _Tensor:
    return _Tensor(name, "BF16", shape, lambda: random_bf16(seed, name, shape))


def _const(name: str, dtype: str, values) -> _Tensor:
    np_dtype = {"I64": "<i8", "F32": "<f4"}[dtype]
    arr = np.asarray(values, dtype=np_dtype)
    return _Tensor(name, dtype, arr.shape, lambda: arr)


def _qwen_tensors(cfg: dict, specs: list[TableSpec], seed: int, text_only: bool) -> list[_Tensor]:
    lm = "model" if text_only else "model.language_model"
    hidden, hc = cfg["hidden_size"], cfg.get("hc_count", 4)
    embed, k = cfg.get("ple_embed_dim") or hidden, cfg.get("ple_conv_kernel_size", 4)
    out = [
        _small(seed, f"{lm}.embed_tokens.weight", (256, hidden)),  # a slice: seek past it
        _small(seed, f"{lm}.layers.0.mlp.gate_proj.weight", (64, hidden)),
    ]
    fillers = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.up_proj.weight"]
    for ti, s in enumerate(specs):
        emb = s.tensor  # ...layers.L.ple.ple_embedding.ngram_embedding
        ple = emb.rsplit(".ple_embedding", 1)[0]  # ...layers.L.ple
        layer = ple.rsplit(".ple", 1)[0]
        h = s.hash
        out += [
            _const(f"{ple}.ple_embedding.layer_multipliers", "I64", h.multipliers),
            _const(f"{ple}.ple_embedding.ngram_heads_vocab_sizes", "I64", h.head_sizes),
            _const(f"{ple}.ple_embedding.ngram_heads_offsets", "I64", h.head_offsets),
            _small(seed, f"{ple}.key_proj.weight", (hc * hidden, embed)),
            _small(seed, f"{ple}.value_proj.weight", (hidden, embed)),
        ]
        out += [
            _small(seed, f"{ple}.norm_{n}.weight", (hc * hidden,)) for n in ("key", "query", "conv")
        ]
        out.append(_small(seed, f"{ple}.conv1d.weight", (hc * hidden, 1, k)))
        sh, d = s.shards, s.dim
        for i in range(sh.num_shards):
            first, rows = sh.shard_rows(i, s.rows)
            base = f"{emb}.shard_{i}"
            if s.format == "nvfp4":
                codes, scales = (0, d // 2), (d // 2, d // 2 + d // 16)
                out += [
                    _Tensor(f"{base}.weight", "U8", (rows, d // 2), None, ti, first, codes),
                    _Tensor(
                        f"{base}.weight_scale", "F8_E4M3", (rows, d // 16), None, ti, first, scales
                    ),
                    _const(f"{base}.weight_scale_2", "F32", s.scale),
                ]
            else:
                dtype = {"bf16": "BF16", "fp8_e4m3": "F8_E4M3"}[s.format]
                out.append(
                    _Tensor(f"{base}.weight", dtype, (rows, d), None, ti, first, (0, s.row_bytes))
                )
            if i % 32 == 31 and fillers:  # unrelated tensors between the shards
                out.append(_small(seed, f"{layer}.{fillers.pop(0)}", (64, hidden)))
        if s.format == "fp8_e4m3":
            out.append(_const(f"{emb}.weight_scale", "F32", s.scale))
    out.append(_small(seed, f"{lm}.norm.weight", (hidden,)))
    return out


def _engram_tensors(cfg: dict, specs: list[TableSpec], seed: int, text_only: bool) -> list[_Tensor]:
    hidden = cfg.get("hidden_size", 4096)
    out = [_small(seed, "model.embed_tokens.weight", (256, hidden))]
    for ti, s in enumerate(specs):
        layer = s.tensor.rsplit(".engram", 1)[0]
        d = s.dim
        out += [
            _small(seed, f"{layer}.input_layernorm.weight", (hidden,)),
            _Tensor(f"{s.tensor}.weight", "F8_E4M3", (s.rows, d), None, ti, 0, (0, d)),
            _small(seed, f"{layer}.mlp.gate_proj.weight", (64, hidden)),
            _Tensor(
                f"{s.tensor}.weight_scale_inv",
                "U8",
                (s.rows, d // 32),
                None,
                ti,
                0,
                (d, d + d // 32),
            ),
        ]
    out.append(_small(seed, "model.norm.weight", (hidden,)))
    return out


def _gemma_tensors(cfg: dict, specs: list[TableSpec], seed: int, text_only: bool) -> list[_Tensor]:
    lm = specs[0].tensor.rsplit(".", 1)[0]  # model.language_model
    hidden, s = cfg["hidden_size"], specs[0]
    return [
        _small(seed, f"{lm}.embed_tokens.weight", (256, hidden)),
        _Tensor(f"{s.tensor}.weight", "BF16", (s.rows, s.dim), None, 0, 0, (0, s.row_bytes)),
        _small(seed, f"{lm}.per_layer_model_projection.weight", (s.dim, hidden)),
        _small(seed, f"{lm}.per_layer_projection_norm.weight", (256,)),
    ]


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def _split_files(tensors: list[_Tensor], num_files: int | None, max_bytes: int) -> list[list]:
    """Consecutive groups of tensors of about equal bytes (at least 3 files, as in real
    checkpoints, so readers cross files)."""
    sizes = [math.prod(t.shape) * DTYPE_SIZES[t.dtype] for t in tensors]
    total = sum(sizes)
    n = num_files or max(3, -(-total // max_bytes))
    n = max(1, min(n, len(tensors)))
    groups: list[list[_Tensor]] = [[]]
    acc = 0
    for t, size in zip(tensors, sizes, strict=True):
        if groups[-1] and acc >= total * len(groups) / n and len(groups) < n:
            groups.append([])
        groups[-1].append(t)
        acc += size
    return groups


def _prepare_dir(out: Path, overwrite: bool) -> None:
    """Refuse to mix with an existing checkpoint unless `overwrite`; then remove it first (index
    first, so the directory never looks like a complete checkpoint)."""
    index = out / INDEX_NAME
    if index.exists() or (out / SINGLE_NAME).exists():
        if not overwrite:
            raise CheckpointError(f"{out} already holds a checkpoint; pass overwrite (--force)")
        try:
            old = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError):
            old = set()
        index.unlink(missing_ok=True)
        for f in old | {SINGLE_NAME, "config.json"}:
            (out / f).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob(".*.partial"):  # left by an interrupted synth
        p.unlink()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
