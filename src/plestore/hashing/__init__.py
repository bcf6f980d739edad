"""Exact row ids for hashed n-gram tables (Qwen4Exp PLE, DeepSeek Engram) and identity tables."""
