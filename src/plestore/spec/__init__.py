"""What a table is: `TableSpec` (rows, dim, format, scale, shards, hash) and `RowLayout` (where
each row sits in a table file). Both are frozen dataclasses validated at construction and
round-trip through JSON; every other module takes them as given.

Specs come from a Hugging Face `config.json` (`table_specs_from_hf_config`) — presets are just
real model configs (`PRESETS`), so a preset and the checkpoint it describes share one path.
"""

from plestore.spec.hashspec import (
    EngramHashSpec,
    HashSpec,
    IdentityHashSpec,
    Qwen4ExpHashSpec,
    check_hash_constants,
)
from plestore.spec.hf import load_hf_config, merged_text_config
from plestore.spec.presets import PRESETS, Preset, preset_config
from plestore.spec.table import RowLayout, ShardLayout, TableSpec, table_specs_from_hf_config

__all__ = [
    "PRESETS",
    "EngramHashSpec",
    "HashSpec",
    "IdentityHashSpec",
    "Preset",
    "Qwen4ExpHashSpec",
    "RowLayout",
    "ShardLayout",
    "TableSpec",
    "check_hash_constants",
    "load_hf_config",
    "merged_text_config",
    "preset_config",
    "table_specs_from_hf_config",
]
