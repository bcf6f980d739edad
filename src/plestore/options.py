"""Options of an opened table: one dataclass, validated at construction.

Every field can come from Python (`open_table(path, threads=64)`), from an environment
variable `PLESTORE_<FIELD>` (e.g. `PLESTORE_TIER=direct`, `PLESTORE_CACHE_BYTES=1G`), or from
the CLI; explicit arguments win over the environment, which wins over the defaults.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["TIER_NAMES", "TableOptions", "parse_bytes"]

TIER_NAMES = ("auto", "device", "pinned", "mapped", "direct", "cascade")


def parse_bytes(value: str | int) -> int:
    """'512M', '4GiB', '1.5G', '4096' -> bytes (binary units)."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(value))
    if not m:
        raise ValueError(f"not a byte size: {value!r} (examples: 4096, 512M, 4GiB)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


@dataclass(frozen=True)
class TableOptions:
    tier: str = "auto"  # auto | device | pinned | mapped | direct | cascade
    device: str | None = None  # "cuda", "cuda:1", "cpu"; None: cuda if available
    row_start: int | None = None  # this rank's rows [row_start, row_end); None: all rows
    row_end: int | None = None
    threads: int = 32  # host gather / page-fault threads (pinned CPU gather, mapped)
    queue_depth: int = 128  # direct: reads in flight
    io_engine: str = "auto"  # direct: auto | io_uring | threads
    cache_bytes: int = 256 << 20  # direct: row cache = the tier's whole host footprint
    rss_budget_bytes: int = 4 << 30  # mapped: resident-set budget of the mapping
    willneed: bool = False  # mapped: WILLNEED on a read's pages first (see tiers/mapped.py)
    gather: str = "auto"  # pinned: cpu (gather + H2D) | gpu (kernel reads pinned memory) | auto
    hugepages: bool = True  # pinned/device: transparent hugepages for host buffers
    timeout_s: float | None = None  # default timeout of Pending.result()
    check_ids: bool = True  # validate ids of device-side lookups (one sync); False for capture
    # host lookups of at most this many ids run in the caller's thread (decode-sized: a worker
    # waits for the GIL). measured: RESULTS.md "host time, part by part" (inline lookups)
    inline_ids: int = 4096
    progress: bool = False  # show a progress bar while loading pinned/device tables
    gpu_cache_bytes: int = 0  # host tiers: a row cache of this size in device memory (0: off)
    # its share for the profile's hot rows (plestore profile), the rest admitted by frequency:
    # 3/4 beat 1/2 on every stream and size. measured: RESULTS.md "GPU row cache and cascade on
    # real text"
    gpu_cache_static: float = 0.75
    gpu_cache_admit_min: int = 2  # a missed row's reads before it is admitted (1: at once)
    device_budget_bytes: int | None = None  # cascade: rows resident on the device (None: free)
    pinned_budget_bytes: int | None = None  # cascade: rows in pinned memory (None: available)
    native: str = "auto"  # host core: auto (compiled where built) | on | off (pure Python)
    share: str = "none"  # pinned: "node": one host copy per node, shared by processes (io/shm.py)
    #: check every block read from the file against the table's per-block CRC-32 (format 2):
    #: direct and mapped per read (on the Python host path: the native core does not check),
    #: pinned and device as they load (tablefile/checksums.py)
    verify_reads: bool = False

    def __post_init__(self) -> None:
        if self.tier not in TIER_NAMES:
            raise ValueError(f"tier must be one of {', '.join(TIER_NAMES)}; got {self.tier!r}")
        if self.io_engine not in ("auto", "io_uring", "threads"):
            raise ValueError(f"io_engine must be auto, io_uring or threads; got {self.io_engine!r}")
        native = {"1": "on", "true": "on", "0": "off", "false": "off"}.get(
            str(self.native).lower(), str(self.native).lower()
        )
        if native not in ("auto", "on", "off"):
            raise ValueError(f"native must be auto, on or off (1/0); got {self.native!r}")
        object.__setattr__(self, "native", native)
        if self.share not in ("none", "node"):
            raise ValueError(f"share must be none or node; got {self.share!r}")
        if self.gather not in ("auto", "cpu", "gpu"):
            raise ValueError(f"gather must be auto, cpu or gpu; got {self.gather!r}")
        for name in ("threads", "queue_depth", "gpu_cache_admit_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("cache_bytes", "rss_budget_bytes", "inline_ids", "gpu_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("device_budget_bytes", "pinned_budget_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.gpu_cache_static <= 1.0:
            raise ValueError(f"gpu_cache_static must be in [0, 1], got {self.gpu_cache_static}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not isinstance(self.verify_reads, bool):
            raise ValueError(f"verify_reads must be True or False, got {self.verify_reads!r}")
        if (self.row_start is None) != (self.row_end is None):
            raise ValueError("give both row_start and row_end, or neither")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> TableOptions:
        """Defaults, then PLESTORE_* environment variables, then explicit keyword arguments."""
        env = os.environ if env is None else env
        known = {f.name: f for f in fields(cls)}
        unknown = set(overrides) - set(known)
        if unknown:
            raise TypeError(
                f"unknown table options: {', '.join(sorted(unknown))}; known: {', '.join(known)}"
            )
        values: dict[str, Any] = {}
        for name, f in known.items():
            raw = env.get(f"PLESTORE_{name.upper()}")
            if raw is not None:
                values[name] = _convert(name, f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> TableOptions:
        return dataclasses.replace(self, **changes)


def _convert(name: str, type_: Any, raw: str) -> Any:
    t = str(type_)
    try:
        if name.endswith("_bytes"):
            return parse_bytes(raw)
        if t.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if t.startswith("int"):
            return int(raw)
        if t.startswith("float"):
            return float(raw)
    except ValueError:
        raise ValueError(f"PLESTORE_{name.upper()}={raw!r} is not a valid {t}") from None
    return raw
