"""The plugin's settings: `additional_config={"plestore": {...}}` of a vLLM engine
(`vllm serve CKPT --additional-config '{"plestore": {"tier": "direct"}}'`), validated before the
engine builds anything. Pure Python: no vLLM import.

Keys: `tier`, `table_dir` (default `<model dir>/plestore`), `pack_timeout_s` (how long a start
waits for another process's pack to make progress) and any `TableOptions` field
(`gpu_cache_bytes`, `share`, `verify_reads`, ...). PLESTORE_* environment variables apply
beneath them, as for `open_table`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plestore.integrations.vllm.releases import RELEASES, Release, nearest, release_of
from plestore.options import UNTESTED_RELEASE_VARS, TableOptions, allow_untested_release
from plestore.tablefile.pack import PACK_LOCK_TIMEOUT_S

__all__ = [
    "ALLOW_UNTESTED",
    "KEY",
    "SUPPORTED_VLLM",
    "PlestoreSettings",
    "TableServeError",
    "UnsupportedVllm",
    "check_vllm_version",
]

KEY = "plestore"  # the additional_config entry
#: vLLM releases whose PLE interface the plugin was built and tested against
SUPPORTED_VLLM = tuple(RELEASES)
#: set to 1 to run a vLLM release outside SUPPORTED_VLLM anyway, at the user's risk (the
#: contract check at engine start still refuses one that lacks a name the plugin uses)
ALLOW_UNTESTED = UNTESTED_RELEASE_VARS["vllm"]
#: the plugin's own keys, beside TableOptions' fields
_OWN = ("table_dir", "pack_timeout_s")
#: options vLLM decides (a rank's vocab range and device), refused as keys
_SET_BY_VLLM = ("row_start", "row_end", "device")


class TableServeError(RuntimeError):
    """A table the engine asked plestore to serve cannot be served (the message names the
    layer); raised at engine start, never later."""


class UnsupportedVllm(RuntimeError):
    """This vLLM is not a release the plugin supports."""


def check_vllm_version(version: str) -> Release:
    """The adapter of vLLM `version`; UnsupportedVllm for a release outside SUPPORTED_VLLM
    unless ALLOW_UNTESTED is set (then the nearest tested release's adapter)."""
    release = release_of(version)
    if release is not None:
        return release
    if allow_untested_release("vllm"):
        return nearest(version)
    tested = f"{SUPPORTED_VLLM[0]}.x to {SUPPORTED_VLLM[-1]}.x"
    raise UnsupportedVllm(
        f"plestore's vLLM plugin is tested with vLLM {tested}; this is vLLM {version}. "
        f"Install a tested vLLM, remove the 'plestore' additional_config, or set "
        f"{ALLOW_UNTESTED}=1 to run it anyway at your own risk"
    )


@dataclass(frozen=True)
class PlestoreSettings:
    """What one engine asked of the plugin."""

    table_dir: str | None = None  # None: <model dir>/plestore
    pack_timeout_s: float = PACK_LOCK_TIMEOUT_S  # a waiting start gives up after a stall this long
    options: dict[str, Any] = field(default_factory=dict)  # TableOptions fields, as given

    @classmethod
    def from_additional_config(cls, additional: Any) -> PlestoreSettings | None:
        """None when the engine did not ask for plestore; ValueError naming the key otherwise."""
        if not isinstance(additional, dict) or KEY not in additional:
            return None
        raw = additional[KEY]
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(
                f"additional_config.{KEY} must be an object of settings, got {type(raw).__name__}"
            )
        known = sorted((set(TableOptions.names()) - set(_SET_BY_VLLM)) | set(_OWN))
        for key in raw:
            if key in _SET_BY_VLLM:
                raise ValueError(
                    f"additional_config.{KEY}.{key} is set by vLLM (each rank's vocab range and "
                    "device); leave it out"
                )
            if key not in known:
                raise ValueError(
                    f"additional_config.{KEY} has an unknown key {key!r}; known keys: "
                    f"{', '.join(known)}"
                )
        table_dir = raw.get("table_dir")
        if table_dir is not None and not isinstance(table_dir, str | os.PathLike):
            raise ValueError(f"additional_config.{KEY}.table_dir must be a path, got {table_dir!r}")
        timeout = raw.get("pack_timeout_s", cls.pack_timeout_s)
        number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
        if not number or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(
                f"additional_config.{KEY}.pack_timeout_s must be a finite number > 0, "
                f"got {timeout!r}"
            )
        options = {k: v for k, v in raw.items() if k not in _OWN}
        settings = cls(None if table_dir is None else str(table_dir), float(timeout), options)
        settings.table_options()  # every option checked now, at engine start
        return settings

    def table_options(self, **vllm_set: Any) -> TableOptions:
        """The TableOptions a table opens with: environment, then these settings, then what
        vLLM sets (the rank's rows, the device)."""
        try:
            return TableOptions.from_env(**{**self.options, **vllm_set})
        except (TypeError, ValueError) as e:
            raise ValueError(f"additional_config.{KEY}: {e}") from None

    def tables_in(self, model_dir: str | os.PathLike) -> Path:
        return Path(self.table_dir) if self.table_dir else Path(model_dir) / "plestore"
