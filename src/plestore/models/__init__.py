"""Model-side test vehicles: the reference decoder that the demo, tests and benchmark drive."""

from plestore.models.reference import DecoderConfig, GenerationResult, ReferenceDecoder
from plestore.models.weights import load_ple_weights

__all__ = ["DecoderConfig", "GenerationResult", "ReferenceDecoder", "load_ple_weights"]
