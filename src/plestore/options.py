"""Options of an opened table: what the user chooses (`TableOptions`) apart from the tuning
knobs (`Tuning`, its `tuning` field), both dataclasses validated at construction, and the
process's defaults for both (`defaults`, exported as `plestore.defaults`).

Every field of either can come from Python (`open_table(path, tier="direct", threads=64)`), from
the process defaults (`plestore.defaults.set(threads=64)`, for the process or a `with` block),
from an environment variable `PLESTORE_<FIELD>` (e.g. `PLESTORE_TIER=direct`,
`PLESTORE_THREADS=64`, read once per process, at the first table), or from the CLI: explicit
arguments win over the defaults set, which win over the environment, which wins over the
built-in defaults. `TableOptions` takes a knob's name as well as its own fields
(`TableOptions(threads=64)`) and reads it through (`options.threads` is
`options.tuning.threads`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import threading
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "TIER_NAMES",
    "Defaults",
    "TableOptions",
    "Tuning",
    "allow_untested_release",
    "defaults",
    "parse_bytes",
]

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
class Tuning:
    """How a table does its work, never what it returns: the defaults are measured, and a
    change moves only speed (or, for check_ids, when a bad id is caught)."""

    threads: int = 32  # host gather / page-fault threads (pinned CPU gather, mapped)
    queue_depth: int = 128  # direct: reads in flight
    io_engine: str = "auto"  # direct: auto | io_uring | threads
    willneed: bool = False  # mapped: WILLNEED on a read's pages first (see tiers/mapped.py)
    gather: str = "auto"  # pinned: cpu (gather + H2D) | gpu (kernel reads pinned memory) | auto
    hugepages: bool = True  # pinned/device: transparent hugepages for host buffers
    # host lookups of at most this many ids run in the caller's thread (decode-sized: a worker
    # waits for the GIL). measured: RESULTS.md "host time, part by part" (inline lookups)
    inline_ids: int = 4096
    check_ids: bool = True  # validate ids of device-side lookups (one sync); False for capture
    # the GPU row cache's share for the profile's hot rows (plestore profile), the rest admitted
    # by frequency. measured: RESULTS.md "GPU row cache and cascade on real text"
    gpu_cache_static: float = 0.75
    gpu_cache_admit_min: int = 2  # a missed row's reads before it is admitted (1: at once)
    native: str = "auto"  # host core: auto (compiled where built) | on | off (numpy reference)

    def __post_init__(self) -> None:
        check_types(self, skip=("native",))  # (native also takes 1 / 0 / True / False)
        if self.io_engine not in ("auto", "io_uring", "threads"):
            raise ValueError(f"io_engine must be auto, io_uring or threads; got {self.io_engine!r}")
        native = {"1": "on", "true": "on", "0": "off", "false": "off"}.get(
            str(self.native).lower(), str(self.native).lower()
        )
        if native not in ("auto", "on", "off"):
            raise ValueError(f"native must be auto, on or off (1/0); got {self.native!r}")
        object.__setattr__(self, "native", native)
        if self.gather not in ("auto", "cpu", "gpu"):
            raise ValueError(f"gather must be auto, cpu or gpu; got {self.gather!r}")
        for name in ("threads", "queue_depth", "gpu_cache_admit_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.inline_ids < 0:
            raise ValueError(f"inline_ids must be >= 0, got {self.inline_ids}")
        if not 0.0 <= self.gpu_cache_static <= 1.0:
            raise ValueError(f"gpu_cache_static must be in [0, 1], got {self.gpu_cache_static}")


_KNOBS = frozenset(f.name for f in fields(Tuning))

#: a field's annotation -> (the check, what the message calls it)
_TYPES = {
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer"),
    "float": (
        lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v),
        "a number (not NaN)",
    ),
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def check_types(obj: Any, skip: tuple[str, ...] = ()) -> None:
    """Each field of the dataclass `obj` holds its annotated type, or one error naming the field
    and the type (`threads must be an integer, got '8' (str)`), never a failed comparison."""
    for f in fields(obj):
        kind, _, none = str(f.type).partition(" | ")
        value = getattr(obj, f.name)
        if f.name in skip or kind not in _TYPES or (none == "None" and value is None):
            continue
        ok, what = _TYPES[kind]
        if not ok(value):
            also = " or None" if none == "None" else ""
            raise ValueError(
                f"{f.name} must be {what}{also}, got {value!r} ({type(value).__name__})"
            )


@dataclass(frozen=True, init=False)
class TableOptions:
    """What the user chooses for an opened table; `tuning` holds the knobs."""

    tier: str = "auto"  # auto | device | pinned | mapped | direct | cascade
    device: str | None = None  # "cuda", "cuda:1", "cpu"; None: cuda if available
    row_start: int | None = None  # this rank's rows [row_start, row_end); None: all rows
    row_end: int | None = None
    timeout_s: float | None = None  # default timeout of Pending.result()
    progress: bool = False  # show a progress bar while loading pinned/device tables
    share: str = "none"  # pinned: "node": one host copy per node, shared by processes (io/shm.py)
    #: check every block read from the file against the table's per-block CRC-32 (format 2):
    #: direct and mapped per read, pinned and device as they load (tablefile/checksums.py)
    verify_reads: bool = False
    cache_bytes: int = 256 << 20  # direct: row cache = the tier's whole host footprint
    rss_budget_bytes: int = 4 << 30  # mapped: resident-set budget of the mapping
    gpu_cache_bytes: int = 0  # host tiers: a row cache of this size in device memory (0: off)
    device_budget_bytes: int | None = None  # cascade: rows resident on the device (None: free)
    pinned_budget_bytes: int | None = None  # cascade: rows in pinned memory (None: available)
    tuning: Tuning = field(default_factory=Tuning)

    def __init__(self, *args: Any, tuning: Tuning | None = None, **values: Any) -> None:
        """Fields by position or name; a knob's name sets it in `tuning`."""
        own = [f for f in fields(self) if f.name != "tuning"]
        if len(args) > len(own):
            raise TypeError(f"TableOptions takes at most {len(own)} positional fields")
        for f, v in zip(own, args, strict=False):
            if f.name in values:
                raise TypeError(f"TableOptions got {f.name!r} twice")
            values[f.name] = v
        knobs = {k: values.pop(k) for k in list(values) if k in _KNOBS}
        unknown = set(values) - {f.name for f in own}
        if unknown:
            raise TypeError(f"unknown table options: {', '.join(sorted(unknown))}")
        for f in own:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, values.get(f.name, default))
        tuning = tuning or Tuning()
        object.__setattr__(
            self, "tuning", dataclasses.replace(tuning, **knobs) if knobs else tuning
        )
        self._validate()

    def __getattr__(self, name: str) -> Any:
        if name in _KNOBS:  # (only reached for names that are no field of this class)
            return getattr(self.tuning, name)
        raise AttributeError(f"'TableOptions' object has no attribute {name!r}")

    def _validate(self) -> None:
        check_types(self, skip=("device", "tuning"))  # (device: a str or a torch.device)
        if self.tier not in TIER_NAMES:
            raise ValueError(f"tier must be one of {', '.join(TIER_NAMES)}; got {self.tier!r}")
        if self.share not in ("none", "node"):
            raise ValueError(f"share must be none or node; got {self.share!r}")
        for name in ("cache_bytes", "rss_budget_bytes", "gpu_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("device_budget_bytes", "pinned_budget_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not isinstance(self.verify_reads, bool):
            raise ValueError(f"verify_reads must be True or False, got {self.verify_reads!r}")
        for name in ("row_start", "row_end"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.row_start is None) != (self.row_end is None):
            raise ValueError("give both row_start and row_end, or neither")

    @classmethod
    def names(cls) -> list[str]:
        """Every option name: the user's fields, then the knobs."""
        return [f.name for f in fields(cls) if f.name != "tuning"] + [
            f.name for f in fields(Tuning)
        ]

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> TableOptions:
        """The process defaults (`defaults`: built-in, PLESTORE_* read once, `defaults.set`) —
        or, given `env`, the built-in defaults under that mapping's PLESTORE_* — then explicit
        keyword arguments (None: not given), over the user's fields and the knobs alike."""
        unknown = set(overrides) - set(_ALL)
        if unknown:
            raise TypeError(
                f"unknown table options: {', '.join(sorted(unknown))}; known: "
                f"{', '.join(cls.names())}"
            )
        values = defaults.as_dict() if env is None else parse_environment(env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> TableOptions:
        """A copy with some fields or knobs changed."""
        tuning = changes.pop("tuning", self.tuning)
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tuning"}
        return TableOptions(**{**own, **changes}, tuning=tuning)


_ALL = {f.name: f for c in (TableOptions, Tuning) for f in fields(c) if f.name != "tuning"}


def builtin_defaults() -> dict[str, Any]:
    """Every option's and knob's built-in default."""
    own, knobs = TableOptions(), Tuning()
    return {name: getattr(knobs if name in _KNOBS else own, name) for name in _ALL}


def parse_environment(env: Any) -> dict[str, Any]:
    """The built-in defaults under the PLESTORE_<NAME> variables of `env` (the one place the
    options' variables are read): a bad value raises naming the variable."""
    values, given = builtin_defaults(), {}
    for name, f in _ALL.items():
        raw = env.get(f"PLESTORE_{name.upper()}")
        if raw is not None:
            values[name] = given[name] = _convert(name, f.type, raw)
    _check_variables(given, env)
    return values


def _check_variables(given: dict[str, Any], env: Any) -> None:
    """Check each variable's value as TableOptions does, a bad one named as the variable the
    user set (`PLESTORE_TIER='bogus': tier must be one of ...`). The pair rule of row_start /
    row_end waits for explicit arguments (TableOptions checks it then)."""
    for name, value in given.items():
        alone = {name: value}
        if name in ("row_start", "row_end"):
            alone = {"row_start": 0, "row_end": 0, name: value}
        try:
            TableOptions(**alone)
        except (TypeError, ValueError) as e:
            raw = env.get(f"PLESTORE_{name.upper()}")
            raise ValueError(f"PLESTORE_{name.upper()}={raw!r}: {e}") from None


class Defaults:
    """The process's defaults of every option and knob (`plestore.defaults`): the built-in
    ones under the PLESTORE_* variables (read once, at the first use), under `set(...)`'s:

        plestore.defaults.set(threads=8)           # from now on, in this process
        with plestore.defaults.set(native="off"):  # in this block only (then as before)
            table = plestore.open_table(path)
        plestore.defaults.reset("tier")            # the built-in, whatever PLESTORE_TIER says

    Explicit arguments (`open_table(path, threads=64)`) win over them. A set is seen by every
    thread of the process (as kvikio's `defaults.set`); a table keeps the options it opened
    with."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._environment: dict[str, Any] | None = None  # PLESTORE_* parsed (None: not yet)
        self._set: dict[str, Any] = {}  # what set() and reset() put over them

    def as_dict(self) -> dict[str, Any]:
        """Every option's and knob's default now."""
        with self._lock:
            if self._environment is None:
                self._environment = parse_environment(os.environ)
            return {**self._environment, **self._set}

    def get(self, name: str) -> Any:
        if name not in _ALL:
            raise KeyError(f"unknown table option {name!r}; known: {', '.join(_ALL)}")
        return self.as_dict()[name]

    def set(self, **values: Any) -> _Restore:
        """New defaults, checked as TableOptions checks them; as a context manager, only for its
        block."""
        unknown = set(values) - set(_ALL)
        if unknown:
            raise TypeError(f"unknown table options: {', '.join(sorted(unknown))}")
        TableOptions(**{**self.as_dict(), **values})  # (raises naming a bad value)
        with self._lock:
            saved = dict(self._set)
            self._set.update(values)
        return _Restore(self, saved)

    def reset(self, *names: str) -> _Restore:
        """These defaults (every one, given none) back to the built-in ones, whatever the
        environment says; as a context manager, only for its block."""
        builtin = builtin_defaults()
        return self.set(**{n: builtin[n] for n in (names or builtin)})

    def _restore(self, saved: dict[str, Any]) -> None:
        with self._lock:
            self._set = saved


class _Restore:
    """What Defaults.set returns: nothing to do, or, as a context manager, the defaults as they
    were before it, back at the end of the block."""

    def __init__(self, owner: Defaults, saved: dict[str, Any]) -> None:
        self._owner, self._saved = owner, saved

    def __enter__(self) -> Defaults:
        return self._owner

    def __exit__(self, *exc: Any) -> None:
        self._owner._restore(self._saved)


#: the process's defaults (see Defaults)
defaults = Defaults()


def _convert(name: str, type_: Any, raw: str) -> Any:
    """An environment variable's text as its field's type."""
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


#: engine -> the variable that runs a release outside plestore's tested range anyway (at the
#: user's risk); the engine integrations read it through allow_untested_release
UNTESTED_RELEASE_VARS = {
    "transformers": "PLESTORE_ALLOW_UNTESTED_TRANSFORMERS",
    "vllm": "PLESTORE_ALLOW_UNTESTED_VLLM",
    "sglang": "PLESTORE_ALLOW_UNTESTED_SGLANG",
}


def allow_untested_release(engine: str, env: dict[str, str] | None = None) -> bool:
    """Whether the user asked to run an untested `engine` release anyway (its variable is 1)."""
    env = os.environ if env is None else env
    name = UNTESTED_RELEASE_VARS[engine]
    raw = env.get(name, "")
    if raw.lower() in ("", "0", "false", "no", "off"):
        return False
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={raw!r} is not a valid bool (1 or 0)")
