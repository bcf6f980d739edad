"""An engine's names a plugin replaces or relies on, checked the same way for every engine:
each plugin lists its `Use`s once (integrations/<engine>/contract.py); `broken_uses` says which
the installed release lacks or changed, and `missing_attributes` what an engine object lacks. A
plugin checks them where the engine starts (a renamed symbol is a clear refusal naming it,
never an AttributeError mid-load) and its contract job checks them for every supported release.
Pure Python: imports no engine until asked to resolve a name."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ContractBroken", "Use", "broken_uses", "missing_attributes", "resolve"]


class ContractBroken(RuntimeError):
    """This engine release lacks (or changed) a name the plugin relies on."""


@dataclass(frozen=True)
class Use:
    """One engine name: `module:attr.path`, what the plugin does with it, and for whom."""

    target: str  # "vllm.engine.arg_utils:EngineArgs.create_engine_config"
    role: str  # replaced | subclassed | called | read | wrapped
    why: str
    params: tuple[str, ...] = ()  # parameters it must take (by name)
    releases: tuple[str, ...] = ()  # the release lines that have it (empty: every one)
    needed_by: str = "all"  # the part of the plugin that uses it

    def in_release(self, release: str) -> bool:
        return not self.releases or release in self.releases


def resolve(target: str):
    """The object `module:attr.path` names (ImportError / AttributeError if it is gone)."""
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing_params(obj, params: Iterable[str]) -> list[str]:
    """The parameters of `params` that callable `obj` does not take."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # (a builtin or an object without a signature)
        return []
    names = set(sig.parameters)
    return [p for p in params if p not in names]


def broken_uses(uses: Iterable[Use]) -> list[str]:
    """['target (role: why): what fails', ...] for the uses this installed engine breaks."""
    problems = []
    for use in uses:
        try:
            obj = resolve(use.target)
        except (ImportError, AttributeError) as e:
            problems.append(f"{use.target} ({use.role}: {use.why}): {type(e).__name__}: {e}")
            continue
        missing = missing_params(obj, use.params)
        if missing:
            problems.append(f"{use.target} no longer takes {', '.join(missing)}")
    return problems


def missing_attributes(obj, chains: Iterable[str]) -> list[str]:
    """The attribute chains ("a.b.c") of `chains` that `obj` lacks."""
    missing = []
    for chain in chains:
        value = obj
        for part in chain.split("."):
            if not hasattr(value, part):
                missing.append(chain)
                break
            value = getattr(value, part)
    return missing
