"""Find the embedding tables in a checkpoint and check them against its config.

The config gives each table's spec (`table_specs_from_hf_config`: rows, dim, format, shards,
hash); the checkpoint gives the bytes and the per-table scale. Everything the two could disagree
on is checked here, once, naming the tensor and file: missing or extra shards, row counts,
dtypes, shapes, NVFP4 global scales that differ across shards, and stored hash constants. After
detection a `SourceTable` is trusted: it reads packed rows (the row format's bytes, e.g. NVFP4's
`[80 code bytes | 10 block-scale bytes]`) for any row range, whatever the shard layout.

Checkpoint tensors per family (spec/qwen4exp-ple.md §2.1, spec/engram.md, spec/gemma-ple.md):

    Qwen4Exp  {P}.ngram_embedding.shard_{i}.weight  BF16|F8_E4M3 [rows_i, dim] | U8 [rows_i, dim/2]
              (F16|F32 [rows_i, dim]: a float16 / float32 model saved by transformers)
              {P}.ngram_embedding.weight_scale      fp8: one F32/BF16 scalar
              {P}.ngram_embedding.shard_{i}.weight_scale    nvfp4: F8_E4M3 [rows_i, dim/16]
              {P}.ngram_embedding.shard_{i}.weight_scale_2  nvfp4: F32 scalar, equal in all shards
              {P}.{layer_multipliers,ngram_heads_vocab_sizes,ngram_heads_offsets}  I64
              with P = model.language_model.layers.L.ple.ple_embedding (or model.layers.L...)
    Engram    model.layers.L.engram.embed.weight F8_E4M3 [rows, 256], .weight_scale_inv U8 [rows, 8]
    Gemma     ...embed_tokens_per_layer.weight BF16 [vocab, layers*256]
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import re
from dataclasses import dataclass

import numpy as np

from plestore.checkpoint.reader import Checkpoint, CheckpointError
from plestore.checkpoint.safetensors_io import TensorInfo
from plestore.spec import TableSpec, check_hash_constants, table_specs_from_hf_config

__all__ = ["Segment", "SourceTable", "declare_qwen_shard_format", "detect_tables"]

_HASH_CONSTANTS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


@dataclass(frozen=True)
class Segment:
    """Rows [first_row, first_row+rows) of a table stored in one checkpoint shard: `parts` are
    the tensors whose rows, side by side, make the packed row (one, or codes + scales)."""

    first_row: int
    rows: int
    parts: tuple[TensorInfo, ...]


@dataclass(frozen=True)
class SourceTable:
    """One validated table of a checkpoint. `fingerprint` hashes the spec, the tensors' names,
    dtypes, shapes and offsets, and their files' sizes and mtimes: O(headers) to compute, and it
    changes whenever the source could have."""

    spec: TableSpec
    segments: tuple[Segment, ...]
    tensors: tuple[TensorInfo, ...]  # every tensor the table is made of
    checkpoint: Checkpoint
    fingerprint: str

    @property
    def name(self) -> str:
        return self.spec.name

    def read_rows(
        self,
        start: int,
        count: int,
        out: np.ndarray | None = None,
        scratch: np.ndarray | None = None,
    ) -> np.ndarray:
        """Packed rows [start, start+count): uint8 [count, row_bytes], across shard boundaries.

        `out` receives them; `scratch` (uint8, >= count x the widest part's row bytes) holds a
        part of split rows (NVFP4 codes, scales) before it is interleaved — so a caller that
        passes both allocates nothing."""
        rb = self.spec.row_bytes
        if start < 0 or count < 0 or start + count > self.spec.rows:
            raise IndexError(
                f"rows [{start}, {start + count}) exceed table {self.name} [0, {self.spec.rows})"
            )
        out = np.empty((count, rb), np.uint8) if out is None else out
        firsts = [s.first_row for s in self.segments]
        k = max(0, bisect.bisect_right(firsts, start) - 1)
        while count and k < len(self.segments) and self.segments[k].first_row < start + count:
            seg = self.segments[k]
            a, b = max(start, seg.first_row), min(start + count, seg.first_row + seg.rows)
            if a < b:
                dst = out[a - start : b - start]
                if len(seg.parts) == 1:  # the shard's rows are the packed rows: no copy
                    self.checkpoint.read_rows(seg.parts[0], a - seg.first_row, b - a, out=dst)
                else:
                    col = 0
                    for part in seg.parts:
                        w = part.row_bytes
                        tmp = None if scratch is None else scratch[: (b - a) * w].reshape(-1, w)
                        dst[:, col : col + w] = self.checkpoint.read_rows(
                            part, a - seg.first_row, b - a, out=tmp
                        )
                        col += w
            k += 1
        return out

    def describe(self) -> dict:
        s = self.spec
        return {
            "name": s.name,
            "tensor": s.tensor,
            "format": s.format,
            "rows": s.rows,
            "dim": s.dim,
            "scale": s.scale,
            "row_bytes": s.row_bytes,
            "nbytes": s.nbytes,
            "shards": len(self.segments),
            "rows_per_shard": s.shards.rows_per_shard if s.shards else s.rows,
            "files": sorted({t.file.name for t in self.tensors}),
            "dtypes": sorted({t.dtype for t in self.tensors}),
            "fingerprint": self.fingerprint,
        }


def detect_tables(checkpoint: Checkpoint) -> list[SourceTable]:
    """Every table the checkpoint's config describes, validated against the tensors."""
    try:
        specs = table_specs_from_hf_config(checkpoint.config)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{checkpoint.root}/config.json: {e}") from None
    kind = specs[0].hash.kind if specs[0].hash is not None else "identity"
    find = {"qwen4exp": _qwen_table, "engram": _engram_table}.get(kind, _gemma_table)
    tables = [find(checkpoint, s) for s in specs]
    _refuse_undeclared(checkpoint, tables)
    return tables


def declare_qwen_shard_format(checkpoint: Checkpoint) -> str:
    """The format a Qwen4Exp checkpoint's PLE shards hold (their dtype: bf16, fp16, fp32 or
    fp8_e4m3), declared in its config for detection: a float32 or float16 save_pretrained has
    no ple_embedding_dtype. NVFP4 shards (U8 codes) only where the config declares NVFP4
    tables (an engine that decodes them: vLLM >= 0.33); otherwise refused."""
    shards = (i for n, i in checkpoint.tensors.items() if ".ngram_embedding.shard_" in n)
    weights = {i.dtype for i in shards if i.name.endswith(".weight")}
    if not weights:
        raise CheckpointError(f"{checkpoint.root}: no ngram_embedding.shard_{{i}}.weight tensors")
    cfg = checkpoint.config
    target = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    if weights == {"U8"} and {s.format for s in table_specs_from_hf_config(cfg)} == {"nvfp4"}:
        return "nvfp4"
    fmt = _SHARD_FORMATS.get(next(iter(weights))) if len(weights) == 1 else None
    if fmt is None:
        raise CheckpointError(
            f"{checkpoint.root}: PLE shards are {sorted(weights)}; one of "
            f"{', '.join(_SHARD_FORMATS)} is served unpacked (NVFP4 codes only where the "
            "config declares NVFP4 tables)"
        )
    target["ple_embedding_dtype"] = "fp8" if fmt == "fp8_e4m3" else fmt
    return fmt


_SHARD_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8_e4m3"}


# ----------------------------------------------------------------------------------------------
# Families
# ----------------------------------------------------------------------------------------------


def _qwen_table(ck: Checkpoint, spec: TableSpec) -> SourceTable:
    prefix = _qwen_prefix(ck, spec)
    shard_re = re.compile(
        re.escape(prefix) + r"\.shard_(\d+)\.(weight|weight_scale|weight_scale_2)$"
    )
    found: dict[int, dict[str, TensorInfo]] = {}
    for name, info in ck.tensors.items():
        m = shard_re.match(name)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = info
    sh, fmt, dim = spec.shards, spec.format, spec.dim
    assert sh is not None
    parts_of = {
        "bf16": {"weight": ("BF16", dim)},
        "fp8_e4m3": {"weight": ("F8_E4M3", dim)},
        "fp16": {"weight": ("F16", dim)},  # transformers' save_pretrained of a float16 model
        "fp32": {"weight": ("F32", dim)},  # ... and of a float32 one
        "nvfp4": {
            "weight": ("U8", dim // 2),
            "weight_scale": ("F8_E4M3", dim // 16),
            "weight_scale_2": ("F32", None),
        },
    }.get(fmt)
    if parts_of is None:
        raise CheckpointError(
            f"table {spec.name}: Qwen4Exp checkpoints hold bf16, fp8_e4m3, nvfp4 (or, saved "
            f"by transformers, fp16 / fp32) tables, config says {fmt}"
        )
    extra = sorted(i for i in found if i >= sh.num_shards)
    if extra:
        raise CheckpointError(
            f"table {spec.name}: tensor {prefix}.shard_{extra[0]}.weight is an extra shard: the "
            f"config's split_ngram_parts gives {sh.num_shards} shards (0..{sh.num_shards - 1})"
        )
    segments, tensors, scales2 = _qwen_shards(ck, spec, prefix, found, parts_of)
    scale = _qwen_scale(ck, spec, prefix, tensors, scales2)
    layer = prefix.rsplit(".ngram_embedding", 1)[0]
    for key in _HASH_CONSTANTS:
        info = ck.tensors.get(f"{layer}.{key}")
        if info is None:
            continue
        _expect(info, "I64", None, "a hash constant")
        tensors.append(info)
        try:
            check_hash_constants(spec.hash, **{key: ck.read_tensor(info.name)})
        except ValueError as e:
            raise CheckpointError(f"{info.name} in {info.file.name}: {e}") from None
    return _source(ck, spec.replace(scale=scale, tensor=prefix), segments, tensors)


def _qwen_shards(ck: Checkpoint, spec: TableSpec, prefix: str, found: dict, parts_of: dict):
    """(segments, every tensor read, NVFP4 global scales) of a Qwen4Exp table's shards, each
    checked against the config's split: present, dtypes and shapes, nothing extra."""
    sh, fmt = spec.shards, spec.format
    segments, tensors, scales2 = [], [], []
    for i in range(sh.num_shards):
        first, rows = sh.shard_rows(i, spec.rows)
        have = found.get(i, {})
        if rows == 0 and not have:
            continue  # an empty trailing shard may be left out
        parts = []
        for kind, (dtype, width) in parts_of.items():
            name = f"{prefix}.shard_{i}.{kind}"
            if kind not in have:
                raise CheckpointError(
                    f"table {spec.name}: tensor {name} is missing (shard {i} of {sh.num_shards}, "
                    f"rows {first}..{first + rows - 1}; format {fmt})"
                )
            info = have.pop(kind)
            tensors.append(info)
            if width is None:  # the NVFP4 global scale
                scales2.append((info, _scalar(ck, info, ("F32",))))
                continue
            _expect(
                info,
                dtype,
                (rows, width),
                f"shard {i} of a {fmt} table with "
                f"{sh.num_shards} shards of {sh.rows_per_shard} rows",
            )
            parts.append(info)
        if have:
            name = next(iter(have.values())).name
            raise CheckpointError(f"table {spec.name}: unexpected tensor {name} for a {fmt} table")
        if rows:
            segments.append(Segment(first, rows, tuple(parts)))
    return segments, tensors, scales2


def _qwen_scale(ck: Checkpoint, spec: TableSpec, prefix: str, tensors: list, scales2) -> float:
    """The table scale: fp8's weight_scale, NVFP4's one global scale (the same in every shard)."""
    fmt = spec.format
    scale = 1.0
    if fmt == "fp8_e4m3":
        info = _require(ck, f"{prefix}.weight_scale", spec, "the fp8 table scale")
        tensors.append(info)
        scale = _scalar(ck, info, ("F32", "BF16"))
    elif fmt == "nvfp4":
        info0, scale = scales2[0]
        for info, s in scales2[1:]:
            if np.float32(s).tobytes() != np.float32(scale).tobytes():
                raise CheckpointError(
                    f"table {spec.name}: NVFP4 global scales differ across shards: {info.name} "
                    f"is {s!r}, {info0.name} is {scale!r} (in {info.file.name}); a table has one"
                )
    return scale


def _qwen_prefix(ck: Checkpoint, spec: TableSpec) -> str:
    cands = [spec.tensor, spec.tensor.replace("model.language_model.", "model.", 1)]
    for p in cands:
        if f"{p}.weight" in ck.tensors:
            raise CheckpointError(
                f"table {spec.name}: {p}.weight is a non-sharded n-gram table; Qwen4Exp "
                "checkpoints store it as ngram_embedding.shard_{i}.weight (the engines reject "
                "this layout too)"
            )
    for p in cands:
        if any(n.startswith(p + ".shard_") for n in ck.tensors):
            return p
    raise CheckpointError(
        f"config.json describes PLE table {spec.name}, but the checkpoint has no tensor "
        f"{cands[0]}.shard_0.weight (nor the text-only {cands[1]}.shard_0.weight)"
    )


def _engram_table(ck: Checkpoint, spec: TableSpec) -> SourceTable:
    """The released checkpoints name the table `layers.L.engram.embed.weight` + `.scale`
    (F8_E8M0); plestore's synthetic ones `model.layers.L...` + `.weight_scale_inv` (U8): the
    same bytes, both taken."""
    if spec.format != "fp8_ue8m0":
        raise CheckpointError(f"table {spec.name}: Engram checkpoints hold fp8_ue8m0 tables")
    prefix = next(
        (
            p
            for p in (spec.tensor, spec.tensor.removeprefix("model."))
            if f"{p}.weight" in ck.tensors
        ),
        spec.tensor,
    )
    w = _require(ck, f"{prefix}.weight", spec, "the Engram embedding")
    names = [f"{prefix}.{n}" for n in ("weight_scale_inv", "scale")]
    s = _require(
        ck, next((n for n in names if n in ck.tensors), names[0]), spec, "its ue8m0 scales"
    )
    _expect(w, "F8_E4M3", (spec.rows, spec.dim), "the Engram table (rows = sum of its primes)")
    want = "F8_E8M0" if s.dtype == "F8_E8M0" else "U8"
    _expect(s, want, (spec.rows, spec.dim // 32), "one ue8m0 scale per 32 values")
    spec = spec.replace(tensor=prefix)
    return _source(ck, spec, [Segment(0, spec.rows, (w, s))], [w, s])


def _gemma_table(ck: Checkpoint, spec: TableSpec) -> SourceTable:
    name = f"{spec.tensor}.weight"
    if name not in ck.tensors:
        cands = [n for n in ck.tensors if n.endswith("embed_tokens_per_layer.weight")]
        if len(cands) != 1:
            raise CheckpointError(
                f"table {spec.name}: expected one tensor {name}, found {cands or 'none'}"
            )
        name = cands[0]
    w = ck.tensors[name]
    if spec.format != "bf16":
        raise CheckpointError(f"table {spec.name}: Gemma checkpoints hold bf16 tables")
    _expect(w, "BF16", (spec.rows, spec.dim), "vocab_size_per_layer_input x layers*256")
    spec = spec.replace(tensor=name.removesuffix(".weight"))
    return _source(ck, spec, [Segment(0, spec.rows, (w,))], [w])


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _source(ck: Checkpoint, spec: TableSpec, segments, tensors) -> SourceTable:
    doc = {
        "v": 1,
        "spec": spec.to_dict(),
        "tensors": [t.describe() for t in tensors],
        "files": ck.file_stats(list(tensors)),
    }
    fp = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]
    return SourceTable(spec, tuple(segments), tuple(tensors), ck, fp)


def _require(ck: Checkpoint, name: str, spec: TableSpec, what: str) -> TensorInfo:
    if name not in ck.tensors:
        raise CheckpointError(f"table {spec.name}: tensor {name} ({what}) is missing")
    return ck.tensors[name]


def _expect(info: TensorInfo, dtype: str, shape: tuple | None, why: str) -> None:
    if info.dtype != dtype or (shape is not None and info.shape != shape):
        want = f"{dtype} {list(shape)}" if shape is not None else dtype
        raise CheckpointError(
            f"tensor {info.name} in {info.file.name}: expected {want} ({why}), got "
            f"{info.dtype} {list(info.shape)}"
        )


def _scalar(ck: Checkpoint, info: TensorInfo, dtypes: tuple[str, ...]) -> float:
    if info.dtype not in dtypes or math.prod(info.shape) != 1:
        want = " or ".join(dtypes)
        raise CheckpointError(
            f"tensor {info.name} in {info.file.name}: expected a scalar "
            f"{want}, got {info.dtype} {list(info.shape)}"
        )
    v = float(ck.read_tensor(info.name).reshape(-1)[0])
    if not (math.isfinite(v) and v > 0):
        raise CheckpointError(f"tensor {info.name} in {info.file.name}: scale {v} is not > 0")
    return v


def _refuse_undeclared(ck: Checkpoint, tables: list[SourceTable]) -> None:
    """A table in the checkpoint that the config does not list would be silently ignored."""
    known = {t.spec.tensor for t in tables}
    pat = re.compile(r"^(.*\.(?:ple\.ple_embedding\.ngram_embedding|engram\.embed))\.")
    for name in ck.tensors:
        m = pat.match(name)
        if m and m.group(1) not in known:
            raise CheckpointError(
                f"tensor {name} belongs to a table config.json does not declare "
                "(ple_layer_ids / engram_layer_ids); refusing to guess its spec"
            )
