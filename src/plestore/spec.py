"""What a table is: `TableSpec` (rows, dim, format, scale, shards, hash) and `RowLayout` (where
each row sits in a table file). Both are frozen dataclasses validated at construction and
round-trip through JSON; every other module takes them as given.

Specs come from a Hugging Face `config.json` (`table_specs_from_hf_config`) — presets are just
real model configs (`PRESETS`), so a preset and the checkpoint it describes share one path.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from plestore.formats import get_format
from plestore.hashing.primes import primes_from

__all__ = [
    "EngramHashSpec",
    "HashSpec",
    "IdentityHashSpec",
    "PRESETS",
    "Qwen4ExpHashSpec",
    "RowLayout",
    "ShardLayout",
    "TableSpec",
    "check_hash_constants",
    "preset_config",
    "table_specs_from_hf_config",
]


def _check_positive(obj: Any, *names: str, allow_zero: tuple[str, ...] = ()) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if n in allow_zero else 1):
            raise ValueError(f"{type(obj).__name__}.{n} must be a positive int, got {v!r}")


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def check_hash_constants(spec: HashSpec, **stored: Any) -> None:
    """Compare constants a checkpoint ships (e.g. layer_multipliers, ngram_heads_vocab_sizes,
    ngram_heads_offsets) with the derived ones; raise naming the first mismatch.

    The engines let the checkpoint win silently; a mismatch means the table was built with
    another hash, so every looked-up row would be wrong. We refuse instead of guessing.
    """
    derived = {
        "layer_multipliers": getattr(spec, "multipliers", None),
        "multipliers": getattr(spec, "multipliers", None),
        "ngram_heads_vocab_sizes": getattr(spec, "head_sizes", None),
        "head_sizes": getattr(spec, "head_sizes", None),
        "ngram_heads_offsets": getattr(spec, "head_offsets", None),
        "head_offsets": getattr(spec, "head_offsets", None),
    }
    for key, value in stored.items():
        if key not in derived or derived[key] is None:
            raise ValueError(f"{spec.kind} hash has no constant called {key!r}")
        got = [int(v) for v in np.asarray(value).reshape(-1).tolist()]
        want = list(derived[key])
        if got != want:
            i = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            raise ValueError(
                f"checkpoint {key} disagrees with the {spec.kind} hash derived from the config "
                f"at index {i}: checkpoint {got[i] if i < len(got) else '(missing)'}, derived "
                f"{want[i] if i < len(want) else '(missing)'} (shape {len(got)} vs {len(want)}); "
                "the table was built with another hash configuration"
            )


# ----------------------------------------------------------------------------------------------
# Hash specs: how token ids become row ids (pure data; plestore.hashing builds the hashers)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Qwen4ExpHashSpec:
    """Qwen4Exp PLE n-gram hash of one PLE layer (spec §1). `layer_index` is the dense index."""

    kind: ClassVar[str] = "qwen4exp"
    vocab_size: int
    eos_token_id: int
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    seed: int = 1234
    layer_index: int = 0
    pad_multiple: int = 128

    def __post_init__(self) -> None:
        _check_positive(
            self, "vocab_size", "heads_per_ngram", "ngram_vocab_size_base", "pad_multiple"
        )
        _check_positive(self, "layer_index", "seed", allow_zero=("layer_index", "seed"))
        if not isinstance(self.ngram_size, int) or self.ngram_size < 2:
            raise ValueError(f"ngram_size must be an int >= 2, got {self.ngram_size!r}")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} is outside [0, {self.vocab_size})")

    @property
    def heads(self) -> int:
        """Row ids per token: (ngram_size - 1) * heads_per_ngram, bigram heads first."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @cached_property
    def multipliers(self) -> tuple[int, ...]:
        """One odd multiplier per n-gram position (spec §1.2), each < (2^63-1) // vocab_size."""
        half_bound = max(1, ((2**63 - 1) // self.vocab_size) // 2)
        base_seed = self.seed + 10007 * self.layer_index
        return tuple(
            2 * (_splitmix64((base_seed + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1
            for i in range(self.ngram_size)
        )

    @cached_property
    def head_sizes(self) -> tuple[int, ...]:
        """Head h of dense layer d has the (d*heads + h + 1)-th prime >= base rows."""
        primes = primes_from(self.ngram_vocab_size_base, (self.layer_index + 1) * self.heads)
        return tuple(primes[self.layer_index * self.heads :])

    @cached_property
    def head_offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.head_sizes[:-1]))

    @property
    def total_rows(self) -> int:
        """Rows any id can address (sum of head sizes)."""
        return sum(self.head_sizes)

    @property
    def num_rows(self) -> int:
        """Table rows: total_rows padded up to a multiple of pad_multiple."""
        return math.ceil(self.total_rows / self.pad_multiple) * self.pad_multiple


@dataclass(frozen=True)
class EngramHashSpec:
    """DeepSeek-V4.1 Engram hash for the table of one Engram layer (spec engram.md).

    All layers' primes come from one sequence (layer-major, then order, then head), so each
    table's spec knows every layer id and which one it is.
    """

    kind: ClassVar[str] = "engram"
    layer_ids: tuple[int, ...]
    layer_position: int
    compressed_vocab_size: int
    pad_token_id: int
    max_ngram_size: int = 4
    n_heads: int = 8
    vocab_size: int = 16_000_000  # engram_vocab_size: the prime base

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(x) for x in self.layer_ids))
        _check_positive(self, "compressed_vocab_size", "n_heads", "vocab_size")
        if not self.layer_ids or not 0 <= self.layer_position < len(self.layer_ids):
            raise ValueError(
                f"layer_position {self.layer_position} is not an index of {self.layer_ids}"
            )
        if self.max_ngram_size < 2:
            raise ValueError(f"max_ngram_size must be >= 2, got {self.max_ngram_size}")
        if not 0 <= self.pad_token_id < self.compressed_vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is not a compressed id")

    @property
    def heads(self) -> int:
        """Hash columns per layer: (max_ngram_size - 1) * n_heads, order-major."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def layer_id(self) -> int:
        return self.layer_ids[self.layer_position]

    @cached_property
    def multipliers(self) -> tuple[int, ...]:
        """One odd multiplier per shift 0..max_ngram_size-1, from numpy's default_rng seeded
        with 10007 * the raw layer id (as the reference does)."""
        bound = max(1, ((2**63 - 1) // self.compressed_vocab_size) // 2)
        rng = np.random.default_rng(10007 * self.layer_id)
        draws = rng.integers(0, bound, self.max_ngram_size, dtype=np.int64)
        return tuple(int(x) * 2 + 1 for x in draws)

    @cached_property
    def head_sizes(self) -> tuple[int, ...]:
        primes = primes_from(self.vocab_size, len(self.layer_ids) * self.heads)
        first = self.layer_position * self.heads
        return tuple(primes[first : first + self.heads])

    @cached_property
    def head_offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.head_sizes[:-1]))

    @property
    def total_rows(self) -> int:
        return sum(self.head_sizes)

    @property
    def num_rows(self) -> int:
        return self.total_rows


@dataclass(frozen=True)
class IdentityHashSpec:
    """Row id = token id (Gemma per-layer embeddings). Out-of-range ids are an error unless
    `out_of_range="zero"`, which maps them to row 0 as transformers' multimodal Gemma does."""

    kind: ClassVar[str] = "identity"
    vocab_size: int
    out_of_range: str = "error"

    def __post_init__(self) -> None:
        _check_positive(self, "vocab_size")
        if self.out_of_range not in ("error", "zero"):
            raise ValueError(f"out_of_range must be 'error' or 'zero', got {self.out_of_range!r}")

    @property
    def heads(self) -> int:
        return 1

    @property
    def num_rows(self) -> int:
        return self.vocab_size


HashSpec = Qwen4ExpHashSpec | EngramHashSpec | IdentityHashSpec
_HASH_KINDS: dict[str, type] = {
    c.kind: c for c in (Qwen4ExpHashSpec, EngramHashSpec, IdentityHashSpec)
}


def _hash_to_dict(h: HashSpec) -> dict:
    d = {f.name: getattr(h, f.name) for f in dataclasses.fields(h)}
    if "layer_ids" in d:
        d["layer_ids"] = list(d["layer_ids"])
    return {"kind": h.kind, **d}


def _hash_from_dict(d: dict) -> HashSpec:
    d = dict(d)
    kind = d.pop("kind", None)
    if kind not in _HASH_KINDS:
        raise ValueError(f"unknown hash kind {kind!r}; known: {', '.join(_HASH_KINDS)}")
    return _HASH_KINDS[kind](**d)


# ----------------------------------------------------------------------------------------------
# Table spec and row layout
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardLayout:
    """How a checkpoint splits the table's rows: shard i holds rows
    [i*rows_per_shard, i*rows_per_shard + rows_i), the last shards possibly shorter or empty."""

    rows_per_shard: int
    num_shards: int

    def __post_init__(self) -> None:
        _check_positive(self, "rows_per_shard", "num_shards")

    def shard_rows(self, i: int, total_rows: int) -> tuple[int, int]:
        """(first global row, row count) of shard i."""
        start = i * self.rows_per_shard
        return start, max(0, min(self.rows_per_shard, total_rows - start))


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: `rows` x `dim` values in `format`, looked up `heads` rows per token.

    `scale` is the per-table scale (fp8 weight_scale, nvfp4 weight_scale_2; 1.0 otherwise).
    `tensor` names the table in its checkpoint (the shard prefix for sharded tables).
    """

    name: str
    rows: int
    dim: int
    format: str
    scale: float = 1.0
    heads: int = 1
    shards: ShardLayout | None = None
    hash: HashSpec | None = None
    tensor: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TableSpec.name must not be empty")
        _check_positive(self, "rows", "dim", "heads")
        fmt = get_format(self.format)
        object.__setattr__(self, "format", fmt.name)
        fmt.check_dim(self.dim)
        scale = float(self.scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"TableSpec.scale must be finite and > 0, got {self.scale!r}")
        if not fmt.has_table_scale and scale != 1.0:
            raise ValueError(f"format {fmt.name} has no per-table scale, got scale={scale}")
        object.__setattr__(self, "scale", scale)
        if self.hash is not None:
            if self.hash.num_rows != self.rows:
                raise ValueError(
                    f"table {self.name}: hash addresses {self.hash.num_rows} rows, spec has "
                    f"{self.rows}"
                )
            if self.hash.heads != self.heads:
                raise ValueError(
                    f"table {self.name}: hash gives {self.hash.heads} ids per token, spec has "
                    f"heads={self.heads}"
                )
        sh = self.shards
        if sh is not None and sh.rows_per_shard * sh.num_shards < self.rows:
            raise ValueError(
                f"table {self.name}: {self.shards.num_shards} shards of "
                f"{self.shards.rows_per_shard} rows cannot hold {self.rows} rows"
            )

    @property
    def row_bytes(self) -> int:
        return get_format(self.format).row_bytes(self.dim)

    @property
    def nbytes(self) -> int:
        """Packed bytes of all rows (no block padding)."""
        return self.rows * self.row_bytes

    def replace(self, **changes: Any) -> TableSpec:
        return dataclasses.replace(self, **changes)

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "rows": self.rows,
            "dim": self.dim,
            "format": self.format,
            "scale": self.scale,
            "heads": self.heads,
            "shards": dataclasses.asdict(self.shards) if self.shards else None,
            "hash": _hash_to_dict(self.hash) if self.hash else None,
            "tensor": self.tensor,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TableSpec:
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"TableSpec: unknown keys {sorted(unknown)}")
        if d.get("shards") is not None:
            d["shards"] = ShardLayout(**d["shards"])
        if d.get("hash") is not None:
            d["hash"] = _hash_from_dict(d["hash"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> TableSpec:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_hf_config(
        cls, config: str | Path | dict, table: str | None = None, format: str | None = None
    ) -> TableSpec:
        """The table of a Hugging Face config; `table` (a name) picks one when it has several."""
        specs = table_specs_from_hf_config(config, format=format)
        if table is None and len(specs) == 1:
            return specs[0]
        for s in specs:
            if s.name == table:
                return s
        names = ", ".join(s.name for s in specs)
        raise ValueError(f"config has tables [{names}]; pass table= one of them (got {table!r})")


@dataclass(frozen=True)
class RowLayout:
    """Where rows sit in a table file's data region.

    Rows are `row_stride` bytes apart and never straddle a `block_bytes` block (4096 matches a
    page, 512 a sector; 0 packs rows back to back), so a cold row costs exactly one block read.
    A row larger than a block starts on a block boundary and spans the fewest whole blocks.
    """

    row_bytes: int
    row_stride: int = 0  # 0: = row_bytes
    block_bytes: int = 4096

    VALID_BLOCKS: ClassVar[tuple[int, ...]] = (0, 512, 4096)

    def __post_init__(self) -> None:
        _check_positive(self, "row_bytes")
        if self.row_stride == 0:
            object.__setattr__(self, "row_stride", self.row_bytes)
        if self.row_stride < self.row_bytes:
            raise ValueError(f"row_stride {self.row_stride} < row_bytes {self.row_bytes}")
        if self.block_bytes not in self.VALID_BLOCKS:
            raise ValueError(
                f"block_bytes must be one of {self.VALID_BLOCKS}, got {self.block_bytes}"
            )

    @property
    def rows_per_block(self) -> int:
        """Rows per block (0 when unblocked or when a row spans several blocks)."""
        if self.block_bytes == 0 or self.row_stride > self.block_bytes:
            return 0
        return self.block_bytes // self.row_stride

    @property
    def row_span(self) -> int:
        """Bytes one row occupies when rows do not share blocks (row_stride > block_bytes)."""
        return -(-self.row_stride // self.block_bytes) * self.block_bytes

    def offsets(self, rows: np.ndarray) -> np.ndarray:
        """int64 byte offset of each row within the data region. The one row -> offset rule."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.block_bytes == 0:
            return rows * self.row_stride
        rpb = self.rows_per_block
        if rpb == 0:
            return rows * self.row_span
        return (rows // rpb) * self.block_bytes + (rows % rpb) * self.row_stride

    def data_bytes(self, num_rows: int) -> int:
        """Size of the data region holding num_rows rows (whole blocks when blocked)."""
        if num_rows == 0:
            return 0
        if self.block_bytes == 0:
            return num_rows * self.row_stride
        rpb = self.rows_per_block
        if rpb == 0:
            return num_rows * self.row_span
        return -(-num_rows // rpb) * self.block_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RowLayout:
        return cls(**d)


# ----------------------------------------------------------------------------------------------
# Hugging Face configs -> table specs
# ----------------------------------------------------------------------------------------------


def _load_config(config: str | Path | dict) -> dict:
    if isinstance(config, dict):
        return config
    p = Path(config)
    if p.is_dir():
        p = p / "config.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"no config.json at {p}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None


def _text_config(cfg: dict) -> dict:
    """Merged view: nested text_config keys win over top-level ones (as the engines do)."""
    text = cfg.get("text_config") or {}
    merged = {k: v for k, v in cfg.items() if k != "text_config"}
    merged.update(text)
    return merged


def _require(cfg: dict, key: str, family: str) -> Any:
    if key not in cfg:
        raise ValueError(f"{family} config lacks the key {key!r}")
    return cfg[key]


def _qwen_format(cfg: dict) -> str:
    """Table format the engines would load: ple_embedding_dtype, then the quantization config."""
    dtype = cfg.get("ple_embedding_dtype")
    if dtype:
        return get_format(dtype).name
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    ignored = " ".join(
        map(str, q.get("ignore", []) + q.get("ignored_layers", []) + q.get("exclude_modules", []))
    )
    if "ngram_embedding" in ignored:
        return "bf16"
    if method == "fp8":
        return "fp8_e4m3"
    if method == "modelopt":
        algo = str(q.get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return "nvfp4"
        if algo == "FP8":
            return "fp8_e4m3"
        if algo == "MIXED_PRECISION":
            for name, entry in (q.get("quantized_layers") or {}).items():
                if "ngram_embedding" in name or name.endswith(".ple") or ".ple." in name:
                    return {"FP8": "fp8_e4m3", "NVFP4": "nvfp4"}.get(
                        str(entry.get("quant_algo", "")).upper(), "bf16"
                    )
    return "bf16"


def _qwen_specs(cfg: dict, fmt: str | None) -> list[TableSpec]:
    fam = "qwen4_exp"
    layer_ids = sorted(set(_require(cfg, "ple_layer_ids", fam)))
    vocab = _require(cfg, "vocab_size", fam)
    eos = _require(cfg, "eos_token_id", fam)
    if isinstance(eos, list):
        eos = eos[0]
    ngram = cfg.get("ngram_size", 3)
    hpn = cfg.get("heads_per_ngram", 8)
    heads = (ngram - 1) * hpn
    embed_dim = cfg.get("ple_embed_dim") or _require(cfg, "hidden_size", fam)
    if embed_dim % heads:
        raise ValueError(f"ple_embed_dim {embed_dim} is not divisible by {heads} n-gram heads")
    parts = cfg.get("split_ngram_parts", 512)
    fmt = get_format(fmt).name if fmt else _qwen_format(cfg)
    specs = []
    for d, lid in enumerate(layer_ids):
        h = Qwen4ExpHashSpec(
            vocab_size=vocab,
            eos_token_id=eos,
            ngram_size=ngram,
            heads_per_ngram=hpn,
            ngram_vocab_size_base=cfg.get("ngram_vocab_size_base", 20_000_000),
            seed=cfg.get("seed", 1234),
            layer_index=d,
            pad_multiple=cfg.get("make_ngram_vocab_size_divisible_by", 128),
        )
        layer = lid - 1  # ple_layer_ids are 1-based decoder layers
        specs.append(
            TableSpec(
                name=f"ple.layers.{layer}",
                rows=h.num_rows,
                dim=embed_dim // heads,
                format=fmt,
                heads=heads,
                shards=ShardLayout(-(-h.num_rows // parts), parts),
                hash=h,
                tensor=f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding",
            )
        )
    return specs


def _engram_specs(cfg: dict, fmt: str | None) -> list[TableSpec]:
    fam = "engram"
    layer_ids = tuple(_require(cfg, "engram_layer_ids", fam))
    specs = []
    for pos, lid in enumerate(layer_ids):
        h = EngramHashSpec(
            layer_ids=layer_ids,
            layer_position=pos,
            compressed_vocab_size=_require(cfg, "engram_compressed_vocab_size", fam),
            pad_token_id=cfg.get("engram_pad_token_id", 2),
            max_ngram_size=cfg.get("engram_max_ngram_size", 4),
            n_heads=cfg.get("engram_n_heads", 8),
            vocab_size=_require(cfg, "engram_vocab_size", fam),
        )
        declared = cfg.get("engram_num_embeddings")
        if declared is not None and declared[pos] != h.num_rows:
            raise ValueError(
                f"engram layer {lid}: engram_num_embeddings says {declared[pos]} rows, the "
                f"primes give {h.num_rows}"
            )
        specs.append(
            TableSpec(
                name=f"engram.layers.{lid}",
                rows=h.num_rows,
                dim=_require(cfg, "engram_head_dim", fam),
                format=fmt or "fp8_ue8m0",
                heads=h.heads,
                hash=h,
                tensor=f"model.layers.{lid}.engram.embed",
            )
        )
    return specs


def _gemma_specs(cfg: dict, fmt: str | None) -> list[TableSpec]:
    fam = "gemma"
    layers = _require(cfg, "num_hidden_layers", fam)
    per_layer = _require(cfg, "hidden_size_per_layer_input", fam)
    vocab = _require(cfg, "vocab_size_per_layer_input", fam)
    h = IdentityHashSpec(vocab_size=vocab)
    return [
        TableSpec(
            name="embed_tokens_per_layer",
            rows=vocab,
            dim=layers * per_layer,
            format=fmt or "bf16",
            heads=1,
            hash=h,
            tensor="model.language_model.embed_tokens_per_layer",
        )
    ]


def table_specs_from_hf_config(
    config: str | Path | dict, format: str | None = None
) -> list[TableSpec]:
    """Every offloadable table a Hugging Face config describes (Qwen4Exp PLE layers, Engram
    layers, or the Gemma 3n/4 per-layer embedding). `format` overrides the stored format."""
    cfg = _text_config(_load_config(config))
    if cfg.get("ple_layer_ids"):
        return _qwen_specs(cfg, format)
    if cfg.get("engram_layer_ids"):
        return _engram_specs(cfg, format)
    if "vocab_size_per_layer_input" in cfg:
        return _gemma_specs(cfg, format)
    raise ValueError(
        "config describes no plestore table: expected ple_layer_ids (Qwen4Exp), "
        "engram_layer_ids (DeepSeek Engram) or vocab_size_per_layer_input (Gemma 3n/4)"
    )


# ----------------------------------------------------------------------------------------------
# Presets: real model configs (text part), scalable through the n-gram vocabulary base
# ----------------------------------------------------------------------------------------------

_QWEN_FORMAT_KEYS = {
    "bf16": {"ple_embedding_dtype": "bfloat16"},
    "fp8_e4m3": {"ple_embedding_dtype": "float8_e4m3fn"},
    "nvfp4": {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}},
}


def _qwen_preset(fmt: str, base: int | None, seed: int | None) -> dict:
    text = {
        "model_type": "qwen4_exp_text",
        "vocab_size": 248320,
        "eos_token_id": 248044,
        "hidden_size": 2560,
        "hc_count": 4,
        "ple_layer_ids": [2],
        "ple_embed_dim": 2560,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": base or 20_000_000,
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 128,
        "rms_norm_eps": 1e-6,
    }
    if seed is not None:
        text["seed"] = seed
    if fmt not in _QWEN_FORMAT_KEYS:
        raise ValueError(f"qwen3.8-flash-next ships bf16, fp8_e4m3 or nvfp4 tables, not {fmt}")
    extra = _QWEN_FORMAT_KEYS[fmt]
    text.update({k: v for k, v in extra.items() if k != "quantization_config"})
    cfg = {
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "text_config": text,
    }
    if "quantization_config" in extra:
        cfg["quantization_config"] = extra["quantization_config"]
    return cfg


def _engram_preset(fmt: str, base: int | None, seed: int | None) -> dict:
    if fmt != "fp8_ue8m0":
        raise ValueError(f"deepseek-v4.1-flash ships fp8_ue8m0 Engram tables, not {fmt}")
    cfg = {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "engram_layer_ids": [1, 14],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_vocab_size": base or 16_000_000,
        "engram_compressed_vocab_size": 99092,
        "engram_pad_token_id": 2,
    }
    if base is None:
        cfg["engram_num_embeddings"] = [384006168, 384016682]
    return cfg


def _gemma_preset(model_type: str, layers: int, hidden: int):
    def make(fmt: str, base: int | None, seed: int | None) -> dict:
        # `base` scales the per-layer vocabulary (the table's rows) for small synthetic copies.
        text = {
            "model_type": f"{model_type}_text",
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "vocab_size": 262144,
            "vocab_size_per_layer_input": base or 262144,
            "hidden_size_per_layer_input": 256,
        }

        return {"model_type": model_type, "text_config": text}

    return make


@dataclass(frozen=True)
class Preset:
    """A named real model: its config (text part) and the formats its checkpoints ship."""

    name: str
    formats: tuple[str, ...]
    make: Any = field(repr=False)
    note: str = ""

    def config(
        self,
        format: str | None = None,
        ngram_vocab_size_base: int | None = None,
        seed: int | None = None,
    ) -> dict:
        fmt = get_format(format or self.formats[0]).name
        return self.make(fmt, ngram_vocab_size_base, seed)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "qwen3.8-flash-next",
            ("fp8_e4m3", "nvfp4", "bf16"),
            _qwen_preset,
            "Qwen3.8-Flash-Next PLE: 320,001,536 rows x 160, 128 shards",
        ),
        Preset(
            "deepseek-v4.1-flash",
            ("fp8_ue8m0",),
            _engram_preset,
            "DeepSeek-V4.1-Flash Engram: layers 1 and 14, 384M rows x 256 each",
        ),
        Preset(
            "gemma3n-e2b",
            ("bf16",),
            _gemma_preset("gemma3n", 30, 2048),
            "Gemma 3n E2B per-layer embeddings [262144, 30*256]",
        ),
        Preset(
            "gemma3n-e4b",
            ("bf16",),
            _gemma_preset("gemma3n", 35, 2048),
            "Gemma 3n E4B per-layer embeddings [262144, 35*256]",
        ),
        Preset(
            "gemma4-e2b",
            ("bf16",),
            _gemma_preset("gemma4", 35, 1536),
            "Gemma 4 E2B per-layer embeddings [262144, 35*256]",
        ),
        Preset(
            "gemma4-e4b",
            ("bf16",),
            _gemma_preset("gemma4", 42, 2560),
            "Gemma 4 E4B per-layer embeddings [262144, 42*256]",
        ),
    )
}


def preset_config(
    name: str,
    format: str | None = None,
    ngram_vocab_size_base: int | None = None,
    seed: int | None = None,
) -> dict:
    """The Hugging Face config of preset `name` (see PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    p = PRESETS[name]
    fmt = get_format(format or p.formats[0]).name
    if fmt not in p.formats:
        raise ValueError(f"preset {name} ships {', '.join(p.formats)} tables, not {fmt}")
    return p.config(fmt, ngram_vocab_size_base, seed)
