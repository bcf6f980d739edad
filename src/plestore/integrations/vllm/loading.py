"""What both model classes need around vLLM's loader: the checkpoint's table tensors left unread,
and the served tables opened once the rest is loaded (integrations/serving.py)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from vllm.model_executor.model_loader import weight_utils

from plestore.integrations.serving import model_dir_of
from plestore.integrations.vllm import steps

__all__ = ["ServedTables", "tables_unread"]


@contextlib.contextmanager
def tables_unread(tensor: re.Pattern) -> Iterator[None]:
    """vLLM's safetensors iterator skips the tensors `tensor` matches before reading them (its
    `should_skip_weight` hook, rebound for the duration: a whole-file loader format still reads
    them, and the model drops them unused)."""
    original = weight_utils.should_skip_weight

    def should_skip_weight(name: str, *args) -> bool:
        return bool(tensor.search(name)) or original(name, *args)

    weight_utils.should_skip_weight = should_skip_weight
    try:
        yield
    finally:
        weight_utils.should_skip_weight = original


class ServedTables:
    """What the plugin's model classes add around vLLM's loader, mixed in front of vLLM's class:
    the tensors TABLE_TENSOR matches are left unread (whole files of them not even opened), and
    once the rest is loaded `open_tables(model_dir)` opens what serves them. Without plestore
    settings (`plestore_settings` None) vLLM's own loading runs."""

    TABLE_TENSOR: re.Pattern
    plestore_settings = None

    def keep_plestore(self, vllm_config, settings) -> None:
        self.plestore_settings = settings
        self.plestore_source = vllm_config.model_config, vllm_config.load_config

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """Checkpoint files holding only served tables are not read at all."""
        return self.plestore_settings is not None and bool(self.TABLE_TENSOR.search(name))

    def load_weights(self, weights):
        if self.plestore_settings is None:
            return super().load_weights(weights)
        table = self.TABLE_TENSOR
        with tables_unread(table):
            loaded = super().load_weights((n, w) for n, w in weights if not table.search(n))
        model, load = self.plestore_source
        self.open_tables(model_dir_of(model.model, model.revision, load.download_dir))
        steps.install()  # (the runner wakes and checks the tables' graph feeds each step)
        return loaded

    def open_tables(self, model_dir: str) -> None:
        raise NotImplementedError
