"""The SGLang plugin's settings and the SGLang releases it supports. Pure Python: no SGLang import.

    PLESTORE_SGLANG='{"tier": "direct"}' python -m sglang.launch_server --model-path CKPT ...

The variable holds a JSON object of the keys every engine's plugin takes
(integrations/settings.py: `tier`, `table_dir`, `pack_timeout_s`, any `TableOptions` field);
unset, the plugin changes nothing. SGLang's scheduler processes inherit it from the process that
starts the engine.
"""

from __future__ import annotations

import json
import os

from plestore.integrations.settings import PlestoreSettings
from plestore.options import UNTESTED_RELEASE_VARS, allow_untested_release

__all__ = [
    "ALLOW_UNTESTED",
    "ENV",
    "SUPPORTED_SGLANG",
    "UnsupportedSglang",
    "check_sglang_version",
    "settings_from_env",
]

ENV = "PLESTORE_SGLANG"
#: SGLang releases whose Qwen4-Exp PLE interface the plugin was built and tested against
SUPPORTED_SGLANG = ("0.5.23",)
#: set to 1 to run another SGLang release anyway, at the user's risk (the contract check at
#: start still refuses one that lacks a name the plugin uses)
ALLOW_UNTESTED = UNTESTED_RELEASE_VARS["sglang"]


class UnsupportedSglang(RuntimeError):
    """This SGLang is not a release the plugin supports."""


def settings_from_env(env: dict[str, str] | None = None) -> PlestoreSettings | None:
    """The settings in PLESTORE_SGLANG (None when unset or empty); ValueError naming the
    variable and the key otherwise."""
    raw = (os.environ if env is None else env).get(ENV, "").strip()
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV} is not JSON ({e.msg} at character {e.pos}): {raw!r}") from None
    return PlestoreSettings.parse(value, ENV, "SGLang")


def check_sglang_version(version: str) -> None:
    """UnsupportedSglang for a release outside SUPPORTED_SGLANG, unless ALLOW_UNTESTED is set."""
    if version.split("+")[0] in SUPPORTED_SGLANG or allow_untested_release("sglang"):
        return
    raise UnsupportedSglang(
        f"plestore's SGLang plugin is tested with SGLang {', '.join(SUPPORTED_SGLANG)}; this "
        f"is SGLang {version}. Install a tested SGLang, unset {ENV}, or set {ALLOW_UNTESTED}=1 "
        "to run it anyway at your own risk"
    )
