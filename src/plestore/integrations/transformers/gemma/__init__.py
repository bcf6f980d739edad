"""Gemma 3n / Gemma 4: `embed_tokens_per_layer` served from one plestore table."""
