"""DeepSeek-V4.1 in vLLM with its Engram tables served by plestore: the model class the plugin
registers for `DeepseekV41ForCausalLM` (vLLM's own, plus):

- with `additional_config={"plestore": {...}}`: while vLLM builds the model, the names its
  decoder layer and model build the Engram pieces by (`Engram`, `EngramBatch` in
  `deepseek_v41/nvidia/model.py`) name plestore's layer (`engram.py`) and no batch (the packed
  path: docs/vllm.md), and `engram_config`'s `cpu_offload` / `use_thp` read off (plestore's
  tier takes their place; logged); `dp_shared_memory` is what `share` says: with "node", vLLM's
  DP-shared layout (heads over TP only, the DP replicas on a node mapping one copy) where vLLM's
  own check finds the node fits it, else heads over TP × DP (each rank its own rows). No table
  is allocated; the loader skips the Engram tables' tensors before reading them; after loading,
  each layer's table is packed from the checkpoint (or reused) and opened on this rank's heads.
- without it: vLLM's class, unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

from vllm.models.deepseek_v41.nvidia import model as vllm_model
from vllm.models.deepseek_v41.nvidia import vl_model as vllm_vl

from plestore.integrations.vllm import validate
from plestore.integrations.vllm.config import PlestoreSettings
from plestore.integrations.vllm.engram import PlestoreEngram, PlestoreEngramEmbedding
from plestore.integrations.vllm.loading import ServedTables

__all__ = ["DeepseekV41ForCausalLM", "engram_classes"]

log = logging.getLogger("vllm.plestore")  # printed with the engine's own log
#: the Engram tables' tensors, as released (`.scale`, F8_E8M0) or as vLLM names them
_TABLE_TENSOR = re.compile(r"\.engram\.embed(?:_tokens)?\.(?:weight|scale|weight_scale_inv)$")
#: vLLM's own Engram offload flags, off while plestore serves the tables
OFFLOAD_FLAGS = ("cpu_offload", "dp_shared_memory", "use_thp")


class _NoBatch:
    """EngramBatch's place with plestore: no batch (each layer stages its own decoded rows)."""

    @classmethod
    def create(cls, layers, max_tokens):
        return None


@contextlib.contextmanager
def engram_classes(settings: PlestoreSettings | None, engram_config) -> Iterator[None]:
    """For the duration of the model's build: plestore's Engram layer and no EngramBatch in the
    names vLLM's model builds them by, vLLM's own offload flags off and its DP-shared layout
    where `share` is "node" (restored after)."""
    if settings is None:
        yield
        return
    saved = {"Engram": vllm_model.Engram, "EngramBatch": vllm_model.EngramBatch}
    flags = {}
    if engram_config is not None:
        flags = {f: getattr(engram_config, f) for f in OFFLOAD_FLAGS if hasattr(engram_config, f)}
        on = [f for f, v in flags.items() if v and f != "dp_shared_memory"]  # (share's now)
        if on:
            log.info(
                "plestore: the Engram tables are plestore's; vLLM's own offload "
                "(engram_config.%s) is not used",
                ", ".join(on),
            )
        for f in flags:
            setattr(engram_config, f, False)
        if "dp_shared_memory" in flags:  # one copy a node: vLLM's DP-shared layout, if it fits
            engram_config.dp_shared_memory = settings.table_options().share == "node"
    vllm_model.Engram, vllm_model.EngramBatch = PlestoreEngram, _NoBatch
    try:
        yield
    finally:
        for name, cls in saved.items():
            setattr(vllm_model, name, cls)
        for f, v in flags.items():
            setattr(engram_config, f, v)


class DeepseekV41ForCausalLM(ServedTables, vllm_vl.DeepseekV41ForCausalLM):
    """The registered DeepSeek-V4.1 class."""

    TABLE_TENSOR = _TABLE_TENSOR

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        settings = validate(vllm_config)
        with engram_classes(settings, vllm_config.engram_config):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.keep_plestore(vllm_config, settings)

    def open_tables(self, model_dir: str) -> None:
        for module in self.modules():
            if isinstance(module, PlestoreEngramEmbedding):
                module.open(model_dir, self.plestore_settings)
