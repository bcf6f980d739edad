"""The ragged layout both n-gram hashes gather from."""

from __future__ import annotations

from plestore.hashing.backend import Array, Backend

__all__ = ["RaggedLayout"]


class RaggedLayout:
    """Per request, `[carried (width, oldest first) | this chunk's tokens]`, all requests in one
    flat buffer of T + R*width entries, so that predecessor s <= width of token t sits at
    `tok_pos[t] - s`, always inside t's own request. Fixed shapes only (no sync on CUDA)."""

    def __init__(self, xp: Backend, qsl: Array, num_tokens: int, width: int) -> None:
        self.xp, self.qsl, self.width = xp, qsl, width
        self.num_requests = qsl.shape[0] - 1
        self.seg = xp.segments(qsl, num_tokens)  # [T]
        self.tok_pos = xp.arange(num_tokens) + (self.seg + 1) * width  # [T]
        self.head_pos = qsl[:-1] + xp.arange(self.num_requests) * width  # [R]
        self.size = num_tokens + self.num_requests * width

    def buffer(self, carried: Array, tokens: Array) -> Array:
        """[T + R*width] int64: carried [R, width] (oldest first) and tokens [T] interleaved."""
        buf = self.xp.empty((self.size,))
        buf[self.tok_pos] = tokens
        cols = self.xp.arange(self.width)
        buf[(self.head_pos[:, None] + cols[None, :]).reshape(-1)] = carried.reshape(-1)
        return buf

    def tail(self, buf: Array) -> Array:
        """[R, width] each request's last `width` entries: its next carried state (an empty
        chunk leaves it unchanged)."""
        r, cols = self.xp.arange(self.num_requests), self.xp.arange(self.width)
        end = self.qsl[1:] + (r + 1) * self.width  # [R] one past the request's last entry
        return buf[end[:, None] - self.width + cols[None, :]]
