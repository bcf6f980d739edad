"""Model-side math: the Qwen4Exp PLE sublayer, the DeepSeek-V4.1 Engram layer, and the pool of
per-request state (n-gram context, conv state) they carry between engine steps.

Slow float64 references live in `plestore.layers.reference`; the deterministic primitives that
make results independent of batching live in `plestore.layers.ops`."""

from plestore.layers.engram import EngramV41, EngramV41Config
from plestore.layers.qwen4exp import Qwen4ExpPLE, Qwen4ExpPLEConfig, ple_weight_prefix
from plestore.layers.state import RequestState, StatePool, StatePoolError, advance_context

__all__ = [
    "EngramV41",
    "EngramV41Config",
    "Qwen4ExpPLE",
    "Qwen4ExpPLEConfig",
    "RequestState",
    "StatePool",
    "StatePoolError",
    "advance_context",
    "ple_weight_prefix",
]
