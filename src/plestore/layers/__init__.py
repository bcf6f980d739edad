"""Model-side math: the Qwen4Exp PLE sublayer (more to come: the DeepSeek-V4.1 Engram layer and
the pool of per-request state).

A slow float64 reference lives in `plestore.layers.reference`; the deterministic primitives that
make results independent of batching live in `plestore.layers.ops`."""

from plestore.layers.qwen4exp import Qwen4ExpPLE, Qwen4ExpPLEConfig, ple_weight_prefix

__all__ = ["Qwen4ExpPLE", "Qwen4ExpPLEConfig", "ple_weight_prefix"]
