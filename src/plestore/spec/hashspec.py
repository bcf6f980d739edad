"""Hash specs: how token ids become row ids (pure data; `plestore.hashing` builds the hashers
from them). Sizes, offsets and multipliers are derived here, once, from the config values."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import numpy as np

from plestore.spec.primes import primes_from

__all__ = [
    "MAX_FIELD",
    "MAX_HASH_PRIMES",
    "MAX_NGRAM",
    "EngramHashSpec",
    "HashSpec",
    "IdentityHashSpec",
    "Qwen4ExpHashSpec",
    "check_hash_constants",
]


#: the largest size, count or id any spec field may hold: far above every real table (rows
#: 3.8e8, vocabularies 2.6e5, prime bases 2e7), far below int64 sums and products of them
MAX_FIELD = 1 << 48
#: primes a hash spec may derive (layers x heads), so that no config or table metadata can make
#: the prime search spin: real ones need 16-48 per table
MAX_HASH_PRIMES = 8192
#: n-gram orders (one multiplier each): real ones are 3 and 4
MAX_NGRAM = 16


def check_positive(
    obj: Any, *names: str, allow_zero: tuple[str, ...] = (), hi: int = MAX_FIELD
) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if n in allow_zero else 1):
            raise ValueError(f"{type(obj).__name__}.{n} must be a positive int, got {v!r}"[:200])
        if v > hi:
            raise ValueError(f"{type(obj).__name__}.{n} is {v}, above the limit {hi}")


def _check_primes(obj: Any, count: int, what: str) -> None:
    if count > MAX_HASH_PRIMES:
        raise ValueError(
            f"{type(obj).__name__}: {what} need {count} primes, more than the {MAX_HASH_PRIMES} "
            "any real model needs; the config or table metadata is corrupt"
        )


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


class _PrimeHeads:
    """Head offsets and row totals, derived from `head_sizes` (one prime per hash head)."""

    head_sizes: tuple[int, ...]

    @cached_property
    def head_offsets(self) -> tuple[int, ...]:
        """Row where each head's range starts: running sum of the sizes before it."""
        return tuple(int(x) for x in np.cumsum((0,) + self.head_sizes[:-1]))

    @property
    def total_rows(self) -> int:
        """Rows any id can address (sum of head sizes)."""
        return sum(self.head_sizes)


@dataclass(frozen=True)
class Qwen4ExpHashSpec(_PrimeHeads):
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
        check_positive(
            self, "vocab_size", "heads_per_ngram", "ngram_vocab_size_base", "pad_multiple"
        )
        check_positive(self, "layer_index", allow_zero=("layer_index",))
        check_positive(self, "eos_token_id", allow_zero=("eos_token_id",))
        check_positive(self, "seed", allow_zero=("seed",), hi=_MASK64 >> 1)
        check_positive(self, "ngram_size", hi=MAX_NGRAM)
        if self.ngram_size < 2:
            raise ValueError(f"ngram_size must be an int >= 2, got {self.ngram_size!r}")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} is outside [0, {self.vocab_size})")
        _check_primes(self, (self.layer_index + 1) * self.heads, f"layer {self.layer_index}")

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

    @property
    def num_rows(self) -> int:
        """Table rows: total_rows padded up to a multiple of pad_multiple."""
        return math.ceil(self.total_rows / self.pad_multiple) * self.pad_multiple


@dataclass(frozen=True)
class EngramHashSpec(_PrimeHeads):
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
        ids = self.layer_ids
        if not isinstance(ids, (list, tuple)) or not ids or len(ids) > MAX_HASH_PRIMES:
            raise ValueError(f"layer_ids must be a non-empty list of layer ids, got {ids!r}"[:200])
        if not all(isinstance(x, (int, np.integer)) and 0 <= x <= MAX_FIELD for x in ids):
            raise ValueError(f"layer_ids must be non-negative ints, got {ids!r}"[:200])
        object.__setattr__(self, "layer_ids", tuple(int(x) for x in ids))
        check_positive(self, "compressed_vocab_size", "n_heads", "vocab_size")
        check_positive(
            self, "layer_position", "pad_token_id", allow_zero=("layer_position", "pad_token_id")
        )
        check_positive(self, "max_ngram_size", hi=MAX_NGRAM)
        if not 0 <= self.layer_position < len(self.layer_ids):
            raise ValueError(
                f"layer_position {self.layer_position} is not an index of {self.layer_ids}"
            )
        if self.max_ngram_size < 2:
            raise ValueError(f"max_ngram_size must be >= 2, got {self.max_ngram_size}")
        if not 0 <= self.pad_token_id < self.compressed_vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is not a compressed id")
        _check_primes(self, len(self.layer_ids) * self.heads, f"{len(self.layer_ids)} layers")

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
        check_positive(self, "vocab_size")
        if not isinstance(self.out_of_range, str) or self.out_of_range not in ("error", "zero"):
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


def hash_to_dict(h: HashSpec) -> dict:
    d = {f.name: getattr(h, f.name) for f in dataclasses.fields(h)}
    if "layer_ids" in d:
        d["layer_ids"] = list(d["layer_ids"])
    return {"kind": h.kind, **d}


def hash_from_dict(d: dict) -> HashSpec:
    if not isinstance(d, dict):
        raise ValueError(f"a hash spec is a JSON object, got {type(d).__name__}")
    d = dict(d)
    kind = d.pop("kind", None)
    if not isinstance(kind, str) or kind not in _HASH_KINDS:
        raise ValueError(f"unknown hash kind {kind!r}; known: {', '.join(_HASH_KINDS)}")
    return from_fields(_HASH_KINDS[kind], d)


def from_fields(cls: type, d: Any) -> Any:
    """cls(**d) for a JSON object, with unknown and missing fields a ValueError naming them."""
    if not isinstance(d, dict):
        raise ValueError(f"{cls.__name__} is a JSON object, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(d) - set(fields)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {sorted(map(str, unknown))}")
    missing = [
        n
        for n, f in fields.items()
        if n not in d
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{cls.__name__}: missing keys {missing}")
    return cls(**d)
