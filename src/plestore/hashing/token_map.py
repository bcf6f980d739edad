"""DeepSeek Engram's compressed token map: tokenizer id -> compressed id (spec engram.md).

Engram hashes n-grams of *compressed* ids, so that tokens equal up to case, accents, Unicode
compatibility forms and whitespace share table rows. The map is built once from the tokenizer:
every id is decoded alone (the raw Rust tokenizer, special tokens kept, no clean-up of spaces)
and normalised with NFKC, NFD, strip accents, lowercase, whitespace runs -> one space, strip (a
token that is exactly one space survives the strip); tokens whose decoding is a partial UTF-8
sequence (it contains U+FFFD) key on their raw token string instead; an empty normal form keys
on the decoded text. Keys get compressed ids in first-seen order (id 0, 1, 2, ...).

The map is stored as a `.npy` (loaded with allow_pickle=False) or JSON file, never pickle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from plestore.io.jsonfile import read_json

__all__ = ["compressed_token_map", "load_token_map", "save_token_map", "token_key_normalizer"]

_SENTINEL = "\ue000"  # private-use char: shields a lone space from Strip


def token_key_normalizer() -> Any:
    """The reference normaliser, built from the `tokenizers` library (Rust) so that Unicode
    tables and regex semantics are exactly those the reference used."""
    try:
        from tokenizers import Regex, normalizers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "building the Engram token map needs the `tokenizers` package (pip install tokenizers)"
        ) from e
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def compressed_token_map(tokenizer: Any) -> np.ndarray:
    """int64 [tokenizer vocab incl. added tokens]: the compressed id of every token id.

    `tokenizer` is a `tokenizers.Tokenizer` or a transformers fast tokenizer (its Rust backend
    is used, so transformers' `clean_up_tokenization_spaces` never applies).
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "id_to_token") or not hasattr(backend, "get_vocab_size"):
        raise ValueError(
            f"expected a tokenizers.Tokenizer or a fast transformers tokenizer, got "
            f"{type(tokenizer).__name__}"
        )
    normalizer = token_key_normalizer()
    n = backend.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    out = np.empty(n, dtype=np.int64)
    for tid in range(n):
        text = backend.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 sequence decodes to U+FFFD: key on the raw token
            key = backend.id_to_token(tid) or ""
        else:
            key = normalizer.normalize_str(text) or text
        out[tid] = keys.setdefault(key, len(keys))
    return out


def check_token_map(token_map: Any, compressed_vocab_size: int | None = None) -> np.ndarray:
    """A 1-D int64 map whose ids are exactly 0..compressed_vocab_size-1 (the reference asserts
    the compressed size; another size means another tokenizer)."""
    m = np.asarray(token_map)
    if m.ndim != 1 or m.size == 0 or m.dtype.kind not in "iu":
        raise ValueError(
            f"a token map is a non-empty 1-D integer array, got {m.dtype} {list(m.shape)}"
        )
    if m.dtype == np.uint64 and int(m.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"token map entry {int(np.argmax(m))} is out of range ({int(m.max())})")
    m = m.astype(np.int64)
    if m.min() < 0:
        raise ValueError(f"token map entry {int(np.argmin(m))} is negative ({int(m.min())})")
    if compressed_vocab_size is not None and int(m.max()) + 1 != compressed_vocab_size:
        raise ValueError(
            f"token map has {int(m.max()) + 1} compressed ids, the config says "
            f"engram_compressed_vocab_size={compressed_vocab_size}: built from another tokenizer?"
        )
    return m


def save_token_map(path: str | Path, token_map: Any) -> None:
    """Write a map as `.npy` (no pickle) or `.json` (chosen by the suffix)."""
    p = Path(path)
    m = check_token_map(token_map)
    if p.suffix == ".npy":
        with p.open("wb") as f:
            np.save(f, m, allow_pickle=False)
    elif p.suffix == ".json":
        doc = {
            "kind": "engram_token_map",
            "compressed_vocab_size": int(m.max()) + 1,
            "token_map": m.tolist(),
        }
        p.write_text(json.dumps(doc))
    else:
        raise ValueError(f"token map files end in .npy or .json, got {p.name}")


def load_token_map(path: str | Path, compressed_vocab_size: int | None = None) -> np.ndarray:
    """Read a map written by `save_token_map` (a plain JSON list is accepted too)."""
    p = Path(path)
    if p.suffix == ".npy":
        try:
            m = np.load(p, allow_pickle=False)
        except FileNotFoundError:
            raise
        except Exception as e:  # a corrupt .npy header raises from numpy's parser (any type)
            raise ValueError(
                f"{p} is not a valid .npy token map ({type(e).__name__}: {e})"
            ) from None
    elif p.suffix == ".json":
        doc = read_json(p, f"token map {p}")
        if isinstance(doc, dict) and "token_map" not in doc:
            raise ValueError(f"token map {p} has no 'token_map' list")
        doc = doc["token_map"] if isinstance(doc, dict) else doc
        if not isinstance(doc, list) or not all(type(x) is int for x in doc):
            raise ValueError(f"token map {p}: token_map must be a list of ints")
        m = np.asarray(doc) if doc else np.empty(0, np.int64)
    else:
        raise ValueError(f"token map files end in .npy or .json, got {p.name}")
    return check_token_map(m, compressed_vocab_size)
