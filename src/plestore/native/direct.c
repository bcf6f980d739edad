/* The direct tier's read in one call (tiers/direct.py holds the why): host row cache probe,
 * the read units of the misses, their O_DIRECT reads through io_uring (those started at
 * prefetch collected first), their blocks checked against the table's CRC-32s (verify_reads),
 * the rows placed, and their admission to the cache. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"
#include "sink.h"


static inline int64_t set_of(const direct_t *d, int64_t row) {
    return row_set((uint64_t)row, d->by_sets); /* as reference/direct.py's set_of */
}

static inline void unit_of(const direct_t *d, int64_t row, int64_t *start, int64_t *within) {
    int64_t off = d->data_offset + layout_offset(&d->layout, row);
    *within = off % d->step;
    *start = off - *within;
}

/* A probe is two dependent misses per row (the set's tags, then the row's slot): the tags of
 * row i + TAG_AHEAD are fetched, row i + SLOT_AHEAD's slot found and its bytes fetched, row i
 * copied, so both misses of a row are in flight while earlier rows copy. */
#define TAG_AHEAD 16
#define SLOT_AHEAD 8 /* a power of two: the ring of found slots */

typedef struct {
    direct_t *d;
    const int64_t *rows;
    uint8_t *out, *hit;
    int64_t out_stride, out_len, clock;
} probe_t;

/* the slot (set * ways + way) holding row, or -1; its bytes fetched into the cache */
static inline int64_t find_slot(const direct_t *d, int64_t row) {
    int64_t base = set_of(d, row) * d->ways;
    for (int64_t w = 0; w < d->ways; w++) {
        if (d->tags[base + w] == row) {
            const uint8_t *at = d->data + (base + w) * d->row_bytes;
            __builtin_prefetch(at);
            __builtin_prefetch(at + d->row_bytes - 1);
            return base + w;
        }
    }
    return -1;
}

static void probe_piece(void *ctx, int64_t a, int64_t b, int worker) {
    probe_t *p = ctx;
    direct_t *d = p->d;
    (void)worker;
    row_sink sink; /* (streamed, a miss's row is zeros until direct_fill places it) */
    sink_open(&sink, p->out, p->out_stride, p->out_len, d->streaming, a);
    int64_t found[SLOT_AHEAD]; /* row i's slot at found[i % SLOT_AHEAD], found ahead */
    for (int64_t i = a; i < b && i < a + TAG_AHEAD; i++)
        __builtin_prefetch(d->tags + set_of(d, p->rows[i]) * d->ways);
    for (int64_t i = a; i < b && i < a + SLOT_AHEAD; i++)
        found[i % SLOT_AHEAD] = find_slot(d, p->rows[i]);
    for (int64_t i = a; i < b; i++) {
        int64_t slot = found[i % SLOT_AHEAD];
        if (i + SLOT_AHEAD < b) found[i % SLOT_AHEAD] = find_slot(d, p->rows[i + SLOT_AHEAD]);
        if (i + TAG_AHEAD < b)
            __builtin_prefetch(d->tags + set_of(d, p->rows[i + TAG_AHEAD]) * d->ways);
        uint8_t *dst = sink_row(&sink, i);
        p->hit[i] = slot >= 0;
        if (slot >= 0) { /* (threads stamping one slot store the same clock) */
            __atomic_store_n(&d->stamp[slot], p->clock, __ATOMIC_RELAXED);
            memcpy(dst, d->data + slot * d->row_bytes, (size_t)d->row_bytes);
        }
    }
    sink_close(&sink);
}

int64_t direct_probe(direct_t *d, const int64_t *rows, int64_t n, uint8_t *out,
                     int64_t out_stride, int64_t out_len, int64_t clock, int64_t *miss,
                     uint8_t *hit, int threads) {
    if (!d->sets) {
        for (int64_t i = 0; i < n; i++) miss[i] = i;
        return n;
    }
    probe_t p = {d, rows, out, hit, out_stride, out_len, clock};
    pool_run(probe_piece, &p, n, PROBE_GRAIN, threads);
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++)
        if (!hit[i]) miss[k++] = i;
    return k;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* sort and deduplicate v[0:n] in place; returns the unique count */
static int64_t sort_unique(int64_t *v, int64_t n) {
    if (n < 2) return n;
    qsort(v, (size_t)n, sizeof *v, cmp_i64);
    int64_t u = 1;
    for (int64_t i = 1; i < n; i++)
        if (v[i] != v[u - 1]) v[u++] = v[i];
    return u;
}

static int64_t find(const int64_t *v, int64_t n, int64_t x) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (v[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && v[lo] == x ? lo : -1;
}

/* Place rows[miss[j]] found in staged units (sorted offsets units[0:u], unit i at
 * staged + i * unit) into out; compacts miss to those not found; returns how many remain. */
static int64_t place(direct_t *d, const int64_t *rows, int64_t *miss, int64_t k,
                     const int64_t *units, int64_t u, const uint8_t *staged, uint8_t *out,
                     int64_t out_stride) {
    int64_t left = 0;
    for (int64_t j = 0; j < k; j++) {
        int64_t start, within, i = miss[j];
        unit_of(d, rows[i], &start, &within);
        int64_t slot = find(units, u, start);
        if (slot < 0) {
            miss[left++] = i;
            continue;
        }
        memcpy(out + i * out_stride, staged + slot * d->unit + within, (size_t)d->row_bytes);
    }
    return left;
}

/* Admit rows[idx[j]] with the bytes in out: into the least recently used way of the row's set
 * (the first of equal stamps), never displacing a row admitted by this same call (stamped
 * `clock`): at most `ways` admissions per set per call. */
static void admit(direct_t *d, const int64_t *rows, const int64_t *idx, int64_t k,
                  const uint8_t *out, int64_t out_stride, int64_t clock) {
    if (!d->sets) return;
    for (int64_t j = 0; j < k; j++) {
        int64_t r = rows[idx[j]], s = set_of(d, r), *tags = d->tags + s * d->ways;
        int64_t *stamp = d->stamp + s * d->ways, victim = 0, present = 0;
        for (int64_t w = 0; w < d->ways; w++) {
            if (tags[w] == r) present = 1;
            if (stamp[w] < stamp[victim]) victim = w;
        }
        if (present || stamp[victim] == clock) continue;
        tags[victim] = r;
        stamp[victim] = clock;
        memcpy(d->data + (s * d->ways + victim) * d->row_bytes, out + idx[j] * out_stride,
               (size_t)d->row_bytes);
    }
}

/* The first block of staged read units (at file offsets units[0..u), unit i at staged +
 * i * unit) whose CRC-32 is not the table's, or -1 (-2: no memory); blocks a unit holds only in
 * part are read whole through check_fd. No crcs: -1. */
static int64_t check_units(const direct_t *d, const int64_t *units, int64_t u,
                           const uint8_t *staged) {
    if (!d->crcs) return -1;
    const int64_t cu = d->check_unit;
    uint8_t *whole = NULL;
    int64_t bad = -1;
    for (int64_t i = 0; i < u && bad == -1; i++) {
        const int64_t lo = units[i] - d->data_offset, hi = lo + d->unit;
        const int64_t end = hi < d->data_bytes ? hi : d->data_bytes;
        for (int64_t b = lo / cu; b * cu < end && bad == -1; b++) {
            const int64_t bs = b * cu, be = bs + cu < d->data_bytes ? bs + cu : d->data_bytes;
            uint32_t crc;
            if (bs >= lo && be <= hi) {
                crc = crc32_bytes(staged + i * d->unit + (bs - lo), be - bs);
            } else {
                if (!whole && !(whole = malloc((size_t)cu))) {
                    bad = -2;
                    break;
                }
                if (pread(d->check_fd, whole, (size_t)(be - bs), d->data_offset + bs) != be - bs) {
                    bad = b; /* (unreadable: as corrupt) */
                    break;
                }
                crc = crc32_bytes(whole, be - bs);
            }
            if (crc != d->crcs[b]) bad = b;
        }
    }
    free(whole);
    return bad;
}

void direct_drop_ahead(direct_t *d) {
    if (!d->ahead_live) return;
    int64_t bad, got;
    if (ring_finish(d->ring_ahead, &bad, &got)) d->ahead_n = 0; /* read again by read() */
    d->ahead_live = 0;
}

void direct_fill(direct_t *d, const int64_t *rows, const int64_t *miss_in, int64_t k,
                 uint8_t *out, int64_t out_stride, int64_t clock, direct_result *res) {
    res->blocks = res->ahead_blocks = 0;
    res->bad_block = -1;
    res->err = 0;
    /* (k == 0 still collects a prefetch's reads, as the reference does) */
    int64_t *miss = malloc((size_t)(2 * k + 1) * sizeof *miss), *units = miss + k;
    if (!miss) {
        res->err = -ENOMEM;
        return;
    }
    memcpy(miss, miss_in, (size_t)k * sizeof *miss);
    int64_t left = k;
    if (d->ahead_live) {
        direct_drop_ahead(d);
        if (d->ahead_n) { /* read at prefetch (counted in the tier's totals then) */
            res->bad_block = check_units(d, d->ahead_offs, d->ahead_n, d->ahead);
            if (res->bad_block == -1)
                left = place(d, rows, miss, left, d->ahead_offs, d->ahead_n, d->ahead, out,
                             out_stride);
            res->ahead_blocks = d->ahead_n;
        }
        d->ahead_n = 0;
    }
    for (int64_t a = 0; a < left && !res->err && res->bad_block == -1; a += d->staging_units) {
        int64_t m = left - a < d->staging_units ? left - a : d->staging_units, within;
        for (int64_t j = 0; j < m; j++) unit_of(d, rows[miss[a + j]], &units[j], &within);
        int64_t u = sort_unique(units, m);
        if (units[u - 1] >= d->file_size) {
            res->err = -EINVAL;
            res->bad_off = units[u - 1];
            res->got = 0;
            break;
        }
        res->err = ring_read(d->ring, d->fd, units, u, d->unit, d->staging, d->file_size, d->qd,
                             0, &res->bad_off, &res->got);
        if (res->err) break;
        res->blocks += u;
        if ((res->bad_block = check_units(d, units, u, d->staging)) != -1) break;
        int64_t *part = miss + a;
        int64_t still = place(d, rows, part, m, units, u, d->staging, out, out_stride);
        (void)still; /* every unit of these rows was read */
    }
    if (res->bad_block == -2) res->err = -ENOMEM, res->bad_block = -1;
    if (!res->err && res->bad_block == -1) admit(d, rows, miss_in, k, out, out_stride, clock);
    free(miss);
}

int64_t direct_prefetch(direct_t *d, const int64_t *rows, int64_t n) {
    direct_drop_ahead(d);
    d->ahead_n = 0;
    if (!d->ring_ahead || n == 0) return 0;
    int64_t *units = malloc((size_t)n * sizeof *units), k = 0, within;
    if (!units) return -ENOMEM;
    for (int64_t i = 0; i < n; i++) {
        int cached = 0;
        if (d->sets) {
            int64_t s = set_of(d, rows[i]), *tags = d->tags + s * d->ways;
            for (int64_t w = 0; w < d->ways && !cached; w++) cached = tags[w] == rows[i];
        }
        if (!cached) unit_of(d, rows[i], &units[k++], &within);
    }
    int64_t u = sort_unique(units, k);
    if (u > d->ahead_units) u = d->ahead_units;
    while (u > 0 && units[u - 1] >= d->file_size) u--;
    if (u == 0) {
        free(units);
        return 0;
    }
    memcpy(d->ahead_offs, units, (size_t)u * sizeof *units);
    free(units);
    int64_t bad, got;
    int err = ring_read(d->ring_ahead, d->fd, d->ahead_offs, u, d->unit, d->ahead, d->file_size,
                        (unsigned)d->ahead_units, 1, &bad, &got);
    if (err) return err; /* a hint only: read() meets (and raises) the same error */
    d->ahead_n = u;
    d->ahead_live = 1;
    return u;
}

int64_t direct_read(direct_t *d, const int64_t *rows, int64_t n, uint8_t *out, int64_t out_stride,
                    int64_t out_len, int64_t *miss, uint8_t *hit, direct_result *res) {
    d->clock += 2;
    int64_t k = direct_probe(d, rows, n, out, out_stride, out_len, d->clock - 1, miss, hit,
                             d->threads);
    direct_fill(d, rows, miss, k, out, out_stride, d->clock, res);
    return n - k;
}
