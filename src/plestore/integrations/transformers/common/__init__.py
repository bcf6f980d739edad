"""What the Gemma and Qwen4Exp integrations share: the model family, the row sources and their
fingerprint, packing or reusing a table, the table-served module base, loading helpers, the
report of what moved where, and the divergence measure for lossy formats."""
