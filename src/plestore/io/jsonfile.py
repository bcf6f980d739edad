"""JSON from files we do not trust (table metadata, configs, token maps, safetensors headers):
every way a file can fail to parse is a ValueError naming the file, and a file's size is bounded
before it is read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["MAX_JSON_BYTES", "parse_json", "read_json"]

#: the largest JSON file read whole (a 256k-token Engram map as JSON is ~2 MB, a table's
#: metadata a few KB): a huge or endless file is refused before it is read
MAX_JSON_BYTES = 256 << 20


def parse_json(raw: bytes | str, what: str) -> Any:
    """json.loads, with undecodable, malformed and too deeply nested text all a ValueError."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} is not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{what}: JSON nested too deeply") from None


def read_json(path: str | os.PathLike, what: str | None = None) -> Any:
    """Parse a JSON file of at most MAX_JSON_BYTES; FileNotFoundError passes through."""
    p = Path(path)
    what = what or str(p)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_JSON_BYTES:
            raise ValueError(f"{what} is {size} bytes, more than a JSON file here may be")
        raw = f.read(MAX_JSON_BYTES + 1)
    return parse_json(raw, what)
