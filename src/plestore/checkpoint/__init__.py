"""Hugging Face checkpoints: read safetensors by hand, find the embedding tables, and write
synthetic checkpoints in the real names, dtypes and shard layout."""

from plestore.checkpoint.detect import (
    Segment,
    SourceTable,
    declare_qwen_shard_format,
    detect_tables,
)
from plestore.checkpoint.reader import Checkpoint, CheckpointError
from plestore.checkpoint.safetensors_io import SafetensorsError, TensorInfo
from plestore.checkpoint.synth import SynthReport, synth_checkpoint
from plestore.checkpoint.synthrows import expected_rows

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "SafetensorsError",
    "Segment",
    "SourceTable",
    "SynthReport",
    "TensorInfo",
    "declare_qwen_shard_format",
    "detect_tables",
    "expected_rows",
    "synth_checkpoint",
]
