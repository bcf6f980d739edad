"""The transformers releases plestore is tested with, checked where a model enters plestore
(`load`, `load_gemma`, `offload_per_layer_embeddings`), and the error for a transformers API
plestore does not know (it never computes rows another way).

The tested range runs from the oldest release CI tests (the `transformers` extra's lower bound
in pyproject.toml: Qwen4Exp's classes exist from 5.17) to the newest it tests (every 5.25.x).
A release outside it is refused up front unless PLESTORE_ALLOW_UNTESTED_TRANSFORMERS=1.
"""

from __future__ import annotations

import logging

from plestore.options import UNTESTED_RELEASE_VARS, allow_untested_release

__all__ = [
    "TESTED_NEWEST",
    "TESTED_OLDEST",
    "UntestedTransformersError",
    "check_release",
    "tested_range",
    "unknown_api",
]

log = logging.getLogger("plestore")

TESTED_OLDEST = (5, 17, 0)  # pyproject.toml: transformers>=5.17
TESTED_NEWEST = (5, 25)  # every 5.25.x
ALLOW = UNTESTED_RELEASE_VARS["transformers"]
_warned: set[str] = set()


class UntestedTransformersError(RuntimeError):
    """The installed transformers is outside the tested range, or lacks an API plestore uses."""


def tested_range() -> str:
    oldest, newest = ".".join(map(str, TESTED_OLDEST)), ".".join(map(str, TESTED_NEWEST))
    return f"{oldest} to {newest}.x"


def installed() -> str:
    import transformers

    return str(transformers.__version__)


def _in_range(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    # a pre-release of the oldest (5.17.0.dev0) is older than it; of a newer minor, outside
    return v >= Version(".".join(map(str, TESTED_OLDEST))) and v.release[:2] <= TESTED_NEWEST


def check_release(version: str | None = None) -> str:
    """The installed transformers version, if tested; else UntestedTransformersError naming
    the tested range (or, with PLESTORE_ALLOW_UNTESTED_TRANSFORMERS=1, one warning)."""
    version = installed() if version is None else version
    if _in_range(version):
        return version
    if not allow_untested_release("transformers"):
        raise UntestedTransformersError(
            f"transformers {version} is outside the releases plestore is tested with "
            f"({tested_range()}): install one of those (pip install 'transformers>=5.17,<5.26'), "
            f"or set {ALLOW}=1 to run this one anyway, at your own risk"
        )
    if version not in _warned:
        _warned.add(version)
        log.warning(
            "plestore: transformers %s is untested (tested: %s); running it anyway (%s=1)",
            version,
            tested_range(),
            ALLOW,
        )
    return version


def unknown_api(what: str) -> UntestedTransformersError:
    """The error for a transformers API plestore follows but does not find (`what`)."""
    return UntestedTransformersError(
        f"transformers {installed()}: {what}, which plestore follows to compute rows exactly as "
        f"transformers does (tested releases: {tested_range()}); this release is not supported"
    )
