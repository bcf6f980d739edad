"""A spy on transformers' safetensors handles, for the tests that a checkpoint load never reads
the per-layer tables: every read of a watched tensor is recorded (holding a lazy slice reads
nothing; indexing it, or get_tensor, does)."""

from __future__ import annotations

from collections.abc import Callable


def spy_reads(monkeypatch, watched: Callable[[str], bool]) -> list[str]:
    """Patch transformers' safe_open; returns the list the keys of watched reads go to."""
    import transformers.modeling_utils as mu

    reads: list[str] = []
    real = mu.safe_open

    class Slice:
        def __init__(self, sl, key) -> None:
            self._sl, self._key = sl, key

        def __getitem__(self, index):
            reads.append(self._key)
            return self._sl[index]

        def __getattr__(self, name):
            return getattr(self._sl, name)

    class Handle:
        def __init__(self, *args, **kwargs) -> None:
            self._h = real(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._h, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def get_slice(self, key):
            sl = self._h.get_slice(key)
            return Slice(sl, key) if watched(key) else sl

        def get_tensor(self, key):
            if watched(key):
                reads.append(key)
            return self._h.get_tensor(key)

    monkeypatch.setattr(mu, "safe_open", Handle)
    return reads
