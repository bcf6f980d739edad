"""SGLang's loader with the plugin loaded reads no byte of a PLE table: its iterators (through
weight_utils' safetensors, which the plugin rebinds) list no table shard, and files holding
only table shards leave the file list before any iterator or prefetcher opens them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from plestore.checkpoint.safetensors_io import read_header


def test_the_weight_iterators_yield_and_read_no_table_shard(plugin, stock, monkeypatch):
    from sglang.srt.model_loader import weight_utils

    from plestore.integrations.sglang.loading import TABLE_TENSOR, TableSkippingSafetensors

    assert isinstance(weight_utils.safetensors, TableSkippingSafetensors)
    model_dir = stock["bf16"][0]
    files = sorted(str(f) for f in Path(model_dir).glob("*.safetensors"))
    every = {n for f in files for n in read_header(f).tensors}
    assert any(TABLE_TENSOR.search(n) for n in every)
    read = []
    real = weight_utils.safetensors.real.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.opened = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.opened.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.opened.get_tensor(name)

    monkeypatch.setattr(weight_utils.safetensors.real, "safe_open", Spy)
    for iterate in (
        weight_utils.safetensors_weights_iterator,
        lambda files: weight_utils.buffered_multi_thread_safetensors_weights_iterator(files, 2),
    ):
        read.clear()
        names = {name for name, _ in iterate(files)}
        assert names == {n for n in every if not TABLE_TENSOR.search(n)}
        assert read and not any(TABLE_TENSOR.search(n) for n in read)


def test_files_holding_only_table_shards_are_dropped(plugin, stock, tmp_path):
    from plestore.checkpoint.safetensors_io import write_safetensors
    from plestore.integrations.sglang.loading import TABLE_TENSOR, drop_table_files

    model_dir = Path(stock["bf16"][0])
    files = sorted(str(f) for f in model_dir.glob("*.safetensors"))
    only = [f for f in files if all(TABLE_TENSOR.search(n) for n in read_header(f).tensors)]
    mixed = [f for f in files if f not in only]
    assert mixed, "the synthetic checkpoint has other weights"
    if not only:  # a checkpoint whose table shards share files: one file of them alone
        shutil.copy(mixed[0], tmp_path / "other.safetensors")
        name = "model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight"
        write_safetensors(
            tmp_path / "table.safetensors", {name: ("F32", np.zeros((4, 2), np.float32))}
        )
        only, mixed = [str(tmp_path / "table.safetensors")], [str(tmp_path / "other.safetensors")]
    folder, kept, st = drop_table_files((str(model_dir), only + mixed, True))
    assert (folder, kept, st) == (str(model_dir), mixed, True)
    assert drop_table_files(("d", only, False)) == ("d", only, False)  # (not safetensors)
