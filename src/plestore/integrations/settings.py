"""What an engine asks of plestore, the same keys for every engine's plugin, validated before
the engine builds anything. Pure Python: no engine import.

    vLLM    additional_config={"plestore": {...}}      (integrations/vllm/config.py)
    SGLang  PLESTORE_SGLANG='{...}' (JSON)              (integrations/sglang/settings.py)

Keys: `tier`, `table_dir` (default `<model dir>/plestore`), `pack_timeout_s` (how long a start
waits for another process's pack to make progress) and any `TableOptions` field
(`gpu_cache_bytes`, `share`, `verify_reads`, ...). PLESTORE_* environment variables apply
beneath them, as for `open_table`. docs/engines.md documents them once for both engines.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plestore.options import TableOptions
from plestore.tablefile.pack import PACK_LOCK_TIMEOUT_S

__all__ = ["ENGINE_SET", "PlestoreSettings", "TableServeError", "setting_keys"]

#: the plugin's own keys, beside TableOptions' fields
_OWN = ("table_dir", "pack_timeout_s")
#: options the engine decides (a rank's vocab range and device), refused as keys
ENGINE_SET = ("row_start", "row_end", "device")


class TableServeError(RuntimeError):
    """A table the engine asked plestore to serve cannot be served (the message names the
    layer); raised at engine start, never later."""


def setting_keys() -> list[str]:
    """Every key a plugin's settings may hold."""
    return sorted((set(TableOptions.names()) - set(ENGINE_SET)) | set(_OWN))


@dataclass(frozen=True)
class PlestoreSettings:
    """What one engine asked of its plestore plugin."""

    table_dir: str | None = None  # None: <model dir>/plestore
    pack_timeout_s: float = PACK_LOCK_TIMEOUT_S  # a waiting start gives up after a stall this long
    options: dict[str, Any] = field(default_factory=dict)  # TableOptions fields, as given
    source: str = "plestore settings"  # where they came from, for messages
    engine: str = "the engine"

    @classmethod
    def parse(cls, raw: Any, source: str, engine: str) -> PlestoreSettings:
        """Settings from `raw` (a mapping) found at `source` ("additional_config.plestore",
        "PLESTORE_SGLANG") of `engine`; ValueError naming the key otherwise."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source} must be an object of settings, got {type(raw).__name__}")
        known = setting_keys()
        for key in raw:
            if key in ENGINE_SET:
                raise ValueError(
                    f"{source}.{key} is set by {engine} (each rank's vocab range and device); "
                    "leave it out"
                )
            if key not in known:
                raise ValueError(
                    f"{source} has an unknown key {key!r}; known keys: {', '.join(known)}"
                )
        table_dir = raw.get("table_dir")
        if table_dir is not None and not isinstance(table_dir, str | os.PathLike):
            raise ValueError(f"{source}.table_dir must be a path, got {table_dir!r}")
        timeout = raw.get("pack_timeout_s", cls.pack_timeout_s)
        number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
        if not number or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(
                f"{source}.pack_timeout_s must be a finite number > 0, got {timeout!r}"
            )
        options = {k: v for k, v in raw.items() if k not in _OWN}
        table_dir = None if table_dir is None else str(table_dir)
        settings = cls(table_dir, float(timeout), options, source, engine)
        settings.table_options()  # every option checked now, at engine start
        return settings

    def table_options(self, **engine_set: Any) -> TableOptions:
        """The TableOptions a table opens with: environment, then these settings, then what
        the engine sets (the rank's rows, the device)."""
        try:
            return TableOptions.from_env(**{**self.options, **engine_set})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.source}: {e}") from None

    def tables_in(self, model_dir: str | os.PathLike) -> Path:
        return Path(self.table_dir) if self.table_dir else Path(model_dir) / "plestore"
