"""Hugging Face transformers: Gemma 3n / Gemma 4 per-layer embeddings served by plestore.

    from plestore.integrations.transformers import load_gemma, offload_per_layer_embeddings
    model, report = load_gemma("gemma-3n-E4B-it/", tier="auto", device_map="cuda")
    report = offload_per_layer_embeddings(model, "tables/")   # an already loaded model

Greedy decoding, logits and `model.generate()` are bit-identical to the stock model with the
default bf16 table (bf16 models); fp8_e4m3 / nvfp4 tables are opt-in (`format=`), and
`measure_divergence` says how far they move the outputs. transformers is imported only by the
calls that need it (load_gemma); `import plestore` never imports it.
"""

from plestore.integrations.transformers.arch import UnsupportedModelError
from plestore.integrations.transformers.divergence import measure_divergence
from plestore.integrations.transformers.load import load_gemma
from plestore.integrations.transformers.module import PerLayerEmbedding
from plestore.integrations.transformers.offload import OffloadReport, offload_per_layer_embeddings
from plestore.integrations.transformers.table import TableMismatchError

__all__ = [
    "OffloadReport",
    "PerLayerEmbedding",
    "TableMismatchError",
    "UnsupportedModelError",
    "load_gemma",
    "measure_divergence",
    "offload_per_layer_embeddings",
]
