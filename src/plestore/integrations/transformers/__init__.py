"""Hugging Face transformers: per-layer embedding tables served by plestore — Gemma 3n / Gemma 4
(`embed_tokens_per_layer`) and Qwen4Exp (the PLE n-gram tables, one per PLE layer).

    from plestore.integrations.transformers import load, offload_per_layer_embeddings
    model, report = load("Qwen3.8-Flash-Next/", tier="auto", device_map="cuda")  # or a Gemma
    report = offload_per_layer_embeddings(model, "tables/")   # an already loaded model

Greedy decoding, logits and `model.generate()` are bit-identical to the stock model with the
default table format (the weight's own dtype); fp8_e4m3 / nvfp4 tables are opt-in (`format=`), and
`measure_divergence` says how far they move the outputs. transformers is imported only by the
calls that need it (load, load_gemma); `import plestore` never imports it.
"""

from plestore.integrations.tables import TableMismatchError
from plestore.integrations.transformers.common.divergence import measure_divergence
from plestore.integrations.transformers.common.family import UnsupportedModelError
from plestore.integrations.transformers.common.release import UntestedTransformersError
from plestore.integrations.transformers.common.report import OffloadReport
from plestore.integrations.transformers.gemma.load import load_gemma
from plestore.integrations.transformers.gemma.module import PerLayerEmbedding
from plestore.integrations.transformers.load import load, offload_per_layer_embeddings
from plestore.integrations.transformers.qwen.ngram import NGramEmbedding

__all__ = [
    "NGramEmbedding",
    "OffloadReport",
    "PerLayerEmbedding",
    "TableMismatchError",
    "UnsupportedModelError",
    "UntestedTransformersError",
    "load",
    "load_gemma",
    "measure_divergence",
    "offload_per_layer_embeddings",
]
