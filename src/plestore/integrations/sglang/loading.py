"""What the plugin does around SGLang's loader: the checkpoint's PLE table shards are never
read (files holding only them are not opened, and a file's other tensors are read without
them), the model is one plestore serves, and the tables open once the rest is loaded.

- `TableSkippingSafetensors` stands for `safetensors` in SGLang's weight_utils (whose
  iterators open every file through `safetensors.safe_open`): its handles list no table
  tensor, so none is read. A loader that reads whole files (`--weight-loader-disable-mmap`)
  still reads the table shards of a file mixing them with other weights.
- `drop_table_files` (after DefaultModelLoader._prepare_weights): files holding only table
  shards leave the list every iterator and prefetcher reads.
- `check_model` (before load_model_with_memory_saver): a model plestore does not serve is a
  clear refusal, never stock SGLang.
- `open_tables` (after Qwen4ExpForConditionalGeneration.load_weights).
"""

from __future__ import annotations

import logging
import re

from plestore.checkpoint.safetensors_io import read_header
from plestore.integrations.serving import model_dir_of
from plestore.integrations.settings import PlestoreSettings, TableServeError
from plestore.integrations.sglang.contract import check_attributes

__all__ = [
    "MODELS",
    "TABLE_TENSOR",
    "TableSkippingSafetensors",
    "check_model",
    "drop_table_files",
    "open_tables",
]

log = logging.getLogger("sglang.plestore")
#: the checkpoint tensors plestore serves (SGLang's load_weights reads them as ...shard_<i>)
TABLE_TENSOR = re.compile(r"\.ple\.ple_embedding\.ngram_embedding\.shard_\d+\.weight$")
#: architectures whose tables the plugin serves
MODELS = ("Qwen4ExpForConditionalGeneration",)


class TableSkippingSafetensors:
    """The `safetensors` module as SGLang's weight iterators see it: `safe_open` handles that
    list no table tensor; everything else is the real module's."""

    def __init__(self, real) -> None:
        self.real = real

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def safe_open(self, *args, **kwargs):
        return _SkippingHandle(self.real.safe_open(*args, **kwargs))


class _SkippingHandle:
    def __init__(self, handle) -> None:
        self._handle = handle

    def __enter__(self):
        self._opened = self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def __getattr__(self, name: str):
        return getattr(self._target(), name)

    def _target(self):
        return self.__dict__.get("_opened", self._handle)

    def keys(self):
        return [k for k in self._target().keys() if not TABLE_TENSOR.search(k)]  # noqa: SIM118


def drop_table_files(result, *args, **kwargs):
    """After DefaultModelLoader._prepare_weights: (folder, files, use_safetensors) without the
    files that hold only table shards (their headers read, nothing else)."""
    folder, files, use_safetensors = result
    if not use_safetensors:
        return result
    kept = [f for f in files if not _only_tables(f)]
    if len(kept) < len(files):
        log.info(
            "plestore: %d checkpoint files hold only PLE tables: not read", len(files) - len(kept)
        )
    return folder, kept, use_safetensors


def _only_tables(path: str) -> bool:
    names = read_header(path).tensors
    return bool(names) and all(TABLE_TENSOR.search(n) for n in names)


def check_model(*args, **kwargs) -> None:
    """Before load_model_with_memory_saver: the engine's model has tables plestore serves."""
    config = kwargs.get("model_config")
    if config is None or kwargs.get("is_draft_worker"):
        return None
    check_attributes(config, "model-config")
    archs = list(config.hf_config.architectures or [])
    if not any(a in MODELS for a in archs):
        named = ", ".join(archs) or "no architecture"
        raise TableServeError(
            f"PLESTORE_SGLANG is set, but {config.model_path} ({named}) has no table plestore "
            f"serves in SGLang; it serves {', '.join(MODELS)}. Unset PLESTORE_SGLANG for it"
        )
    if not getattr(config.hf_text_config, "ple_layer_ids", None):
        raise TableServeError(
            f"PLESTORE_SGLANG is set, but {config.model_path} has no PLE layers "
            "(ple_layer_ids is empty)"
        )
    return None


def open_tables(_result, model, *args, settings: PlestoreSettings, served: type, **kwargs):
    """After load_weights: every served table packed (or reused) and opened."""
    from sglang.srt.runtime_context import get_server_args

    modules = [m for m in model.modules() if isinstance(m, served) and m.lookup is None]
    if not modules:
        return
    server = get_server_args()
    check_attributes(server, "server-args")
    model_dir = model_dir_of(server.model_path, server.revision, server.download_dir)
    for module in modules:
        module.open(model_dir, settings)
