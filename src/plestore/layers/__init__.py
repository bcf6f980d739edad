"""Model-side math: the Qwen4Exp PLE sublayer and the pool of per-request state (n-gram context,
conv state) it carries between engine steps.

A slow float64 reference lives in `plestore.layers.reference`; the deterministic primitives that
make results independent of batching live in `plestore.layers.ops`."""

from plestore.layers.qwen4exp import Qwen4ExpPLE, Qwen4ExpPLEConfig, ple_weight_prefix
from plestore.layers.state import RequestState, StatePool, StatePoolError, advance_context

__all__ = [
    "Qwen4ExpPLE",
    "Qwen4ExpPLEConfig",
    "RequestState",
    "StatePool",
    "StatePoolError",
    "advance_context",
    "ple_weight_prefix",
]
