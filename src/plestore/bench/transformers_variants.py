"""One model, every variant of `plestore bench transformers`: the stock PLE modules (their weights
kept aside on the device) and plestore's, with the same table file open on every tier at once, so
the variants can be swapped between rounds of one interleaved run instead of timed in sequence."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class _Site:
    """One PLE module of the model: where it hangs, the stock module and its weight."""

    parent: nn.Module
    attr: str
    stock: nn.Module
    holder: nn.Module  # the module whose `.weight` offloading clears
    weight: torch.Tensor  # kept here while plestore serves: swapped back for stock rounds
    text_model: nn.Module | None = None  # Qwen4Exp: where the prefetch hook goes
    ours: nn.Module | None = None  # the plestore module, once offloaded


def _sites(model: nn.Module) -> list[_Site]:
    from plestore.integrations.transformers.common.family import family_of_config
    from plestore.integrations.transformers.gemma.site import find_site
    from plestore.integrations.transformers.qwen.site import find_qwen_sites

    if family_of_config(model.config) == "qwen4_exp":
        out = []
        for s in find_qwen_sites(model, fmt=None):
            emb = s.module.ngram_embedding
            out.append(_Site(s.parent, s.attr, s.module, emb, emb.weight, s.text_model))
        return out
    s = find_site(model)
    return [_Site(s.parent, s.attr, s.module, s.module, s.module.weight)]


@dataclass
class Variants:
    """Swaps a model between 'stock' and plestore on each opened tier."""

    model: nn.Module
    sites: list[_Site] = field(init=False)
    tables: dict[str, list[Any]] = field(default_factory=dict)  # tier -> a table per site
    current: str = "stock"
    _hooks: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sites = _sites(self.model)

    def offload(self, table_dir: str, tiers: list[str], device: torch.device, **options) -> Any:
        """Pack (or reuse) the tables, serve them from tiers[0], and open the same files on the
        other tiers (a tier this machine refuses, e.g. direct I/O on tmpfs, is skipped with a
        message). Returns the offload report."""
        import plestore
        from plestore.integrations.transformers import offload_per_layer_embeddings

        fmt = options.pop("format", None)
        report = offload_per_layer_embeddings(
            self.model, table_dir, tier=tiers[0], device=device, format=fmt, **options
        )
        for s in self.sites:
            s.ours = getattr(s.parent, s.attr)
        self.tables[tiers[0]] = [s.ours.table for s in self.sites]
        self._hooks = [s.ours.prefetch_hook for s in self.sites if hasattr(s.ours, "prefetch_hook")]
        self.current = tiers[0]
        # as offloading opens them (it leaves out the id check where ids are rows by construction)
        options["check_ids"] = self.tables[tiers[0]][0].options.tuning.check_ids
        for tier in tiers[1:]:
            t0 = time.perf_counter()
            try:
                self.tables[tier] = [
                    plestore.open_table(
                        str(s.ours.table.file.meta_path), tier=tier, device=str(device), **options
                    )
                    for s in self.sites
                ]
                print(f"opened {tier} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            except OSError as e:
                print(f"skipping tier {tier}: {e}", file=sys.stderr)
        return report

    @property
    def names(self) -> list[str]:
        return ["stock", *self.tables]

    def use(self, variant: str) -> None:
        """Put `variant`'s PLE modules into the model (and only its prefetch hooks)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if variant == "stock":
            for s in self.sites:
                s.holder.weight = s.weight
                setattr(s.parent, s.attr, s.stock)
        else:
            from plestore.integrations.transformers.qwen.ngram import install_prefetch

            for s, table in zip(self.sites, self.tables[variant], strict=True):
                if s.ours.table is not table:
                    s.ours.use_table(table, close=False)  # every tier's table stays open
                s.holder.weight = None
                setattr(s.parent, s.attr, s.ours)
            for text_model in {id(s.text_model): s.text_model for s in self.sites}.values():
                mine = [s.ours for s in self.sites if s.text_model is text_model]
                if text_model is not None:
                    self._hooks.append(install_prefetch(text_model, mine))
        self.current = variant

    def parked_device_bytes(self) -> int:
        """Bytes of stock weights held aside on a CUDA device while plestore serves (subtracted
        from a plestore variant's peak: it would not hold them)."""
        if self.current == "stock":
            return 0
        return sum(
            s.weight.numel() * s.weight.element_size()
            for s in self.sites
            if s.weight.device.type == "cuda"
        )

    def table_host_bytes(self) -> int:
        """Host memory the current variant's tables hold (0 for stock)."""
        if self.current == "stock":
            return 0
        return sum(t.tier.host_bytes() for t in self.tables[self.current])

    def ple_modules(self) -> list[nn.Module]:
        """The modules that serve the current variant's PLE rows."""
        return [s.stock if self.current == "stock" else s.ours for s in self.sites]

    def close(self) -> None:
        for tables in self.tables.values():
            for t in tables:
                t.close()


class PleClock:
    """CPU wall time spent in the PLE modules (and plestore's prefetch, started before the first
    decoder layer): with the step time, where a step's time goes. On a GPU it includes any wait
    for the device (a host tier reads ids on the host), which an eager step pays in full."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._undo: list[Any] = []
        for m in modules:
            self._undo.append(m.register_forward_pre_hook(self._start))
            self._undo.append(m.register_forward_hook(self._stop))
            if hasattr(m, "prefetch"):
                m.prefetch = self._timed(m.prefetch)
                self._undo.append(m)

    def _start(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1

    def _timed(self, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return wrapped

    def close(self) -> None:
        for u in self._undo:
            if isinstance(u, nn.Module):
                del u.prefetch  # the instance attribute: the method shows through again
            else:
                u.remove()
