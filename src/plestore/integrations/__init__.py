"""Adapters that put plestore tables under other libraries' models.

`plestore.integrations.transformers`: Hugging Face transformers, Gemma 3n / Gemma 4 per-layer
embeddings. Each adapter imports its library only when used, so `import plestore` never needs it.
"""
