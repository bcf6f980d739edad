/* Rows written in order into out, `stride` apart, by one thread. Streaming (out bound for a
 * DMA copy, not the CPU): through a small buffer stored out with non-temporal stores. Rows a
 * pool's threads leave dirty in their own caches make the copy engine's read of them slower
 * (measured: RESULTS.md "host time, part by part"); streamed, they are in memory, where
 * the copy reads them at PCIe's pace. A streamed row left unwritten, and every row's padding
 * past row_bytes, reach out as zeros (no stale bytes). */
#ifndef PLESTORE_SINK_H
#define PLESTORE_SINK_H

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define SINK_BYTES 8192 /* bytes of rows collected per store pass (in L1) */

typedef struct {
    uint8_t *out;
    int64_t stride, out_len;
    int64_t cap;          /* rows per pass; 0: not streaming (rows go straight to out) */
    int64_t first, count; /* buf holds rows [first, first + count) */
    _Alignas(64) uint8_t buf[SINK_BYTES];
} row_sink;

/* whether rows of this stride can stream here (SSE2; a row fits the buffer) */
static inline int sink_can_stream(int64_t stride) {
#if defined(__SSE2__)
    return stride >= 1 && stride <= SINK_BYTES;
#else
    (void)stride;
    return 0;
#endif
}

static inline void sink_open(row_sink *s, uint8_t *out, int64_t stride, int64_t out_len,
                             int streaming, int64_t first) {
    s->out = out, s->stride = stride, s->out_len = out_len;
    s->cap = streaming && sink_can_stream(stride) ? SINK_BYTES / stride : 0;
    s->first = first, s->count = 0;
}

static inline void sink_flush(row_sink *s) {
#if defined(__SSE2__)
    if (!s->count) return;
    uint8_t *dst = s->out + s->first * s->stride;
    int64_t len = s->count * s->stride, room = s->out_len - s->first * s->stride;
    if (len > room) len = room; /* (the last row's padding lies past out) */
    int64_t j = (int64_t)((-(uintptr_t)dst) & 15); /* dst's ends stored as usual */
    if (j > len) j = len;
    memcpy(dst, s->buf, (size_t)j);
    for (; j + 16 <= len; j += 16)
        _mm_stream_si128((__m128i *)(dst + j), _mm_loadu_si128((const __m128i *)(s->buf + j)));
    memcpy(dst + j, s->buf + j, (size_t)(len - j));
    s->first += s->count, s->count = 0;
#else
    (void)s;
#endif
}

/* where row i (the next in order: first + count) is written, zeroed when streamed */
static inline uint8_t *sink_row(row_sink *s, int64_t i) {
    if (!s->cap) return s->out + i * s->stride;
    if (s->count == s->cap) sink_flush(s);
    uint8_t *row = s->buf + s->count++ * s->stride;
    memset(row, 0, (size_t)s->stride);
    return row;
}

/* every row in out, ordered before what the caller does next (another thread's read) */
static inline void sink_close(row_sink *s) {
#if defined(__SSE2__)
    if (!s->cap) return;
    sink_flush(s);
    _mm_sfence();
#endif
}

#endif
