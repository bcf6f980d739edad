"""Real text as a token stream: text files -> a real tokenizer -> token ids, one document each.

    plestore text STREAM FILE_OR_DIR... --tokenizer gpt2.tiktoken | tokenizer.json

writes STREAM.npy (token ids, documents back to back; uint16 where the vocabulary allows, else
int32) and STREAM.json (the tokenizer and its vocabulary's sha256, each source file, document
starts, token count). Both tokenizer kinds
are files a package ships (`tiktoken` ranks such as the openai-whisper sdist's
`whisper/assets/gpt2.tiktoken`; a Hugging Face `tokenizer.json`): nothing is fetched. Text is
read from plain files (fortune files: their `%` separator lines dropped), `.gz`, and HTML (tags,
scripts and styles dropped). Ids of any tokenizer with a vocabulary <= the hash's vocab_size are
valid inputs to the PLE hash.

`plestore.lookup.profile.TokenStream` loads a stream (for `plestore profile` and the benchmarks).
"""

from __future__ import annotations

import gzip
import hashlib
import html.parser
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["build_stream", "load_tokenizer", "read_documents"]

#: GPT-2's pre-tokenizer pattern (tiktoken's r50k/gpt2 encoding, whisper's tokenizer)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_MAX_FILE_BYTES = 64 << 20  # a text file larger than this is refused (bounded memory)


@dataclass
class Tokenizer:
    name: str
    kind: str  # tiktoken | tokenizers
    vocab_size: int
    sha256: str
    _encode: object = field(repr=False)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a file: a `.tiktoken` rank file (needs the `tiktoken` package; GPT-2's
    pattern) or a Hugging Face `tokenizer.json` (the `tokenizers` package)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"tokenizer: {p} is not a file (a .tiktoken or tokenizer.json)")
    digest = hashlib.sha256(p.read_bytes()).hexdigest()
    if p.suffix == ".tiktoken":
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise ValueError(f"tokenizer {p}: reading .tiktoken files needs tiktoken ({e})") from e
        ranks = load_tiktoken_bpe(str(p))
        enc = tiktoken.Encoding(
            p.stem, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
        )
        return Tokenizer(p.name, "tiktoken", enc.n_vocab, digest, enc.encode_ordinary)
    if p.suffix == ".json":
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(p))
        return Tokenizer(
            p.name,
            "tokenizers",
            tok.get_vocab_size(),
            digest,
            lambda text: tok.encode(text, add_special_tokens=False).ids,
        )
    raise ValueError(f"tokenizer {p}: expected a .tiktoken or a tokenizer .json file")


class _HTMLText(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("p", "br", "div", "li", "tr", "h1", "h2", "h3", "h4", "pre"):
            self.parts.append("\n")

    def handle_endtag(self, tag) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data) -> None:
        if not self._skip:
            self.parts.append(data)


def _read_text(path: Path) -> str:
    if path.stat().st_size > _MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than {_MAX_FILE_BYTES >> 20} MiB")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        with gzip.open(path) as f:
            raw = f.read(_MAX_FILE_BYTES + 1)
        if len(raw) > _MAX_FILE_BYTES:
            raise ValueError(f"{path}: decompresses past {_MAX_FILE_BYTES >> 20} MiB")
    text = raw.decode("utf-8", errors="replace")
    name = path.name.removesuffix(".gz")
    if name.endswith((".html", ".htm")):
        p = _HTMLText()
        p.feed(text)
        text = "".join(p.parts)
    lines = text.splitlines()
    if lines.count("%") >= 3:  # a fortune file: % separates the cookies
        lines = [ln for ln in lines if ln != "%"]
    return "\n".join(ln.rstrip() for ln in lines).strip() + "\n"


def read_documents(paths: list[str | os.PathLike]) -> list[tuple[str, str]]:
    """(path, text) per file, directories walked in sorted order; binary files (a NUL byte in
    the first 4 KiB), images, fortune indexes and files whose bytes were seen already (links,
    fortunes' `.u8` twins) are skipped."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"text source {p} does not exist")
    docs, seen = [], set()
    skip = (".png", ".gif", ".jpg", ".svg", ".pdf", ".css", ".js", ".dat", ".u8")
    for f in files:
        if f.suffix.lower() in skip:
            continue
        raw = f.read_bytes() if f.stat().st_size <= _MAX_FILE_BYTES else b""
        digest = hashlib.sha256(raw).digest()
        if (b"\0" in raw[:4096] and f.suffix != ".gz") or digest in seen:
            continue
        seen.add(digest)
        text = _read_text(f)
        if text.strip():
            docs.append((str(f), text))
    return docs


def build_stream(
    out: str | os.PathLike,
    sources: list[str | os.PathLike],
    tokenizer: str | os.PathLike,
    max_tokens: int | None = None,
    vocab_limit: int = 248_320,
    progress=None,
) -> dict:
    """Tokenize every document of `sources`; write OUT.npy (int32 ids) and OUT.json. Returns the
    JSON's dict. max_tokens: stop after this many tokens (the last document cut)."""
    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > vocab_limit:
        raise ValueError(
            f"tokenizer {tok.name} has {tok.vocab_size} ids; the hash takes < {vocab_limit}"
        )
    docs = read_documents(sources)
    if not docs:
        raise ValueError(f"no text found in {', '.join(map(str, sources))}")
    parts, meta_docs, total = [], [], 0
    for path, text in docs:
        ids = np.asarray(tok.encode(text), dtype=np.int32)
        if max_tokens is not None:
            ids = ids[: max(0, max_tokens - total)]
        if ids.size == 0:
            break
        parts.append(ids)
        meta_docs.append({"path": path, "start": total, "tokens": int(ids.size)})
        total += int(ids.size)
        if progress:
            progress(path, total)
    ids = np.concatenate(parts)
    if tok.vocab_size <= 1 << 16:  # half the bytes for GPT-2-sized vocabularies
        ids = ids.astype(np.uint16)
    out = Path(out)
    np.save(out.with_suffix(".npy"), ids)
    meta = {
        "tokens": total,
        "documents": len(meta_docs),
        "tokenizer": {
            "file": str(tokenizer),
            "kind": tok.kind,
            "vocab_size": tok.vocab_size,
            "sha256": tok.sha256,
        },
        "max_tokens": max_tokens,
        "docs": meta_docs,
    }
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta
