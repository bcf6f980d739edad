"""Slow per-token references of the n-gram hashes, written straight from the spec text with
Python ints (no vectorisation, no shared code with plestore.hashing except the constants)."""

from __future__ import annotations


def qwen_row_ids(h, tokens: list[int], context: list[int]) -> list[list[int]]:
    """Qwen4Exp ids of one request's chunk (spec qwen4exp-ple.md §1.4), walking predecessors."""
    n, eos, m = h.ngram_size, h.eos_token_id, h.multipliers
    seq = list(context) + list(tokens)  # context oldest first
    out = []
    for t in range(len(context), len(seq)):
        window = [seq[t]]
        crossed = False
        for s in range(1, n):
            p = seq[t - s]
            window.append(eos if crossed else p)
            crossed = crossed or p == eos
        row = []
        for k in range(2, n + 1):
            mixed = 0
            for i in range(k):
                mixed ^= window[i] * m[i]
            for j in range(h.heads_per_ngram):
                hh = (k - 2) * h.heads_per_ngram + j
                row.append(h.head_offsets[hh] + mixed % h.head_sizes[hh])
        out.append(row)
    return out


def engram_row_ids(h, tokens, positions, dead, lookback, lookback_dead, token_map=None):
    """Engram ids [T][layers][cols] of one request's chunk (spec engram.md): lookback newest
    first, -1 = unknown; positions per token (None: no position blocking)."""
    n, pad = h.max_ngram_size, h.pad_id
    cmap = (lambda x: x) if token_map is None else (lambda x: int(token_map[x]))
    out = []
    for t in range(len(tokens)):
        values, blocked = [], False
        for s in range(n):
            if s <= t:
                raw, is_dead = tokens[t - s], dead[t - s]
            else:
                k = s - t - 1
                raw, is_dead = lookback[k], lookback_dead[k]
            before_start = positions is not None and positions[t] - s < 0
            blocked = blocked or is_dead or before_start
            values.append(pad if blocked or raw == -1 else cmap(raw))
        per_layer = []
        for li in range(len(h.layers)):
            mult, row, rolling = h.multipliers[li], [], values[0] * h.multipliers[li][0]
            for s in range(1, n):
                rolling ^= values[s] * mult[s]
                for j in range(h.n_heads):
                    c = (s - 1) * h.n_heads + j
                    row.append(h.head_offsets[li][c] + rolling % h.head_sizes[li][c])
            per_layer.append(row)
        out.append(per_layer)
    return out
