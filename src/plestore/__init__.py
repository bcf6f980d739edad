"""plestore: serve giant embedding tables (Qwen4Exp PLE, DeepSeek Engram, Gemma PLE) off the GPU."""

from plestore.formats import FORMATS, RowFormat, get_format

__version__ = "0.1.0"

__all__ = ["FORMATS", "RowFormat", "__version__", "get_format"]
