"""The plugin's settings: `additional_config={"plestore": {...}}` of a vLLM engine
(`vllm serve CKPT --additional-config '{"plestore": {"tier": "direct"}}'`), the keys every
engine's plugin takes (integrations/settings.py), and the vLLM releases it supports. Pure
Python: no vLLM import.
"""

from __future__ import annotations

from typing import Any

from plestore.integrations import settings
from plestore.integrations.settings import TableServeError
from plestore.integrations.vllm.releases import RELEASES, Release, nearest, release_of
from plestore.options import UNTESTED_RELEASE_VARS, allow_untested_release

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


class PlestoreSettings(settings.PlestoreSettings):
    """What one vLLM engine asked of the plugin (the keys every engine's plugin takes)."""

    @classmethod
    def from_additional_config(cls, additional: Any) -> PlestoreSettings | None:
        """None when the engine did not ask for plestore; ValueError naming the key otherwise."""
        if not isinstance(additional, dict) or additional.get(KEY) is None:
            return None
        return cls.parse(additional[KEY], f"additional_config.{KEY}", "vLLM")
