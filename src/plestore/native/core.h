/* plestore's native host core: shared declarations (see __init__.py for what it is for). */
#ifndef PLESTORE_CORE_H
#define PLESTORE_CORE_H

#include <stdint.h>
#include <stddef.h>
#include <time.h>

#include "constants.h"

/* CLOCK_MONOTONIC in ns */
static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* -- the row hashes that place rows in sets (rowsets.py's set_of, sketch_index) ------------- */

/* a divisor of numbers below 2^32, d >= 1, as its reciprocal: x mod d by two multiplies, not a
 * 64-bit division (measured: RESULTS.md "host step alone"). Exact for every such x and d
 * (Lemire, Kaser, Kurz, "Faster remainder by direct computation", 2019) */
typedef struct {
    uint64_t d, m;
} divisor_t;

static inline divisor_t divisor_of(uint64_t d) {
    return (divisor_t){d, d >= 1 && d <= UINT32_MAX ? UINT64_MAX / d + 1 : 0};
}

/* x mod v.d, x < 2^32 */
static inline uint64_t mod_small(uint64_t x, divisor_t v) {
    if (v.d > UINT32_MAX) return x; /* (x < 2^32 <= d) */
    return (uint64_t)(((unsigned __int128)(v.m * x) * v.d) >> 64);
}

/* row's set of `sets` (v: divisor_of(sets)): a multiplicative hash, the product wrapping */
static inline int64_t row_set(uint64_t row, divisor_t v) {
    return (int64_t)mod_small(row * HASH_GOLDEN >> 32, v);
}

/* row's frequency counter in a sketch of mask + 1 */
static inline uint64_t sketch_at(uint64_t row, uint64_t mask) {
    return ((row ^ HASH_SKETCH_SEED) * HASH_MIX >> 29) & mask;
}

/* -- pool.c: one process-wide pthread pool, created on first use, grown on demand ---------- */

/* work(ctx, begin, end, worker): process items [begin, end); worker is 0 for the caller */
typedef void (*pool_work)(void *ctx, int64_t begin, int64_t end, int worker);

/* Run work over [0, n) in pieces of `grain` on up to `threads` threads (the caller included).
 * Returns once every piece is done. A pool busy with another caller's job runs this one in the
 * calling thread alone (never waits for the other job). */
void pool_run(pool_work work, void *ctx, int64_t n, int64_t grain, int threads);

/* pool_run in two halves: pool_start sets up to threads - 1 pool threads on j's pieces and
 * returns how many (0: none; the caller then runs every piece); pool_take runs the next piece
 * in the calling thread (0: none left); pool_finish takes the rest, waits for the pool threads
 * and frees the pool. Pieces always span `grain` items (the last one fewer), whoever runs
 * them; j lives until pool_finish returns. In a child forked meanwhile (pool_forked) the
 * pieces the parent's threads took are nobody's: pool_finish returns at once, and the
 * caller runs whatever it cannot see done. */
typedef struct pool_job {
    pool_work work;
    void *ctx;
    int64_t n, grain;
    _Atomic int64_t next; /* the first item not yet taken */
    int pooled;           /* holds the pool (pool_finish frees it) */
    uint64_t forks;       /* the process's forks when it started */
} pool_job;
int pool_start(pool_job *j, pool_work work, void *ctx, int64_t n, int64_t grain, int threads);
int pool_take(pool_job *j, int worker);
int pool_forked(const pool_job *j);
void pool_finish(pool_job *j);
int pool_size(void);

/* -- layout: the one row -> data-region offset rule (spec.RowLayout.offsets) ---------------- */
typedef struct {
    int64_t rows_per_block; /* 1 for unblocked layouts (block = the row's pitch) */
    int64_t block;          /* bytes per block (or pitch) */
    int64_t stride;         /* bytes between rows within a block */
} layout_t;

/* whether a layout is one RowLayout makes (native.layout_rule): rows fit their stride, strides
 * their block, so no offset of an in-range row can overflow */
static inline int layout_ok(int64_t rpb, int64_t block, int64_t stride, int64_t row_bytes) {
    return rpb >= 1 && row_bytes >= 1 && stride >= row_bytes && block >= stride &&
           rpb <= block / stride;
}

static inline int64_t layout_offset(const layout_t *l, int64_t row) {
    if (l->rows_per_block == 1) return row * l->block; /* (no division for unblocked rows) */
    return (row / l->rows_per_block) * l->block + (row % l->rows_per_block) * l->stride;
}

/* A read's per-row bounds, worked out once per call: the last whole block a row may start in
 * (src_bytes / block: a division per row otherwise) and the last offset a row may start at */
typedef struct {
    layout_t layout;
    int64_t base, last_block, limit;
} bounds_t;

/* id's offset in src, or -1 if its row lies outside [0, src_bytes - row_bytes]: the block
 * index is bounded before it is multiplied, so a huge id cannot wrap into range */
static inline int64_t offset_of(const bounds_t *k, int64_t id) {
    const int64_t rpb = k->layout.rows_per_block;
    int64_t row;
    if (__builtin_sub_overflow(id, k->base, &row) || row < 0 ||
        (rpb == 1 ? row : row / rpb) > k->last_block)
        return -1;
    int64_t off = layout_offset(&k->layout, row); /* (the division above, reused) */
    return off <= k->limit ? off : -1;
}

/* -- gather.c -------------------------------------------------------------------------------- */
typedef struct {
    const uint8_t *src;
    int64_t src_bytes; /* every row read must lie inside [src, src + src_bytes) */
    const int64_t *ids;
    int64_t count;
    int64_t base; /* ids are global; row (id - base) of the layout */
    layout_t layout;
    int64_t row_bytes;
    uint8_t *out;
    int64_t out_stride;
    int count_faults;
    int64_t out_len; /* bytes of out (>= (count - 1) * out_stride + row_bytes) */
    int streaming; /* non-temporal stores (gather_can_stream): out is bound for a DMA copy */
    int64_t grain;   /* rows per piece (gather_begin's) */
    uint8_t *done;   /* [pieces]: set as each piece is written (gather_begin's), or NULL */
    /* results */
    int64_t bad;             /* an index whose row lies outside src, or -1 */
    int64_t major, minor;    /* page faults the gathering threads took (count_faults) */
    int64_t inblock;         /* 512-B units they read from storage (count_faults): their
                              * read_bytes of /proc/.../io, exact (block I/O is in sectors) */
} gather_t;

void gather_run(gather_t *g, int threads, int64_t grain);
int gather_can_stream(int64_t out_stride);

/* A gather begun on the pool and waited for a prefix of rows at a time, so each prefix's DMA
 * copy can be queued while the rest is gathered. gather_begin returns -1 (no memory) or 0;
 * gather_wait(rows): out's first `rows` rows are written (the caller takes pieces meanwhile if
 * some are still untaken); gather_end: every row, the pool freed. g's results as gather_run's. */
typedef struct {
    gather_t g;
    pool_job job;
    int64_t cursor; /* pieces [0, cursor) seen done */
} gather_job;
int gather_begin(gather_job *j, int threads, int64_t grain);
void gather_wait(gather_job *j, int64_t rows);
void gather_end(gather_job *j);

/* -- uring.c: a minimal io_uring of reads (raw syscalls, no liburing) ------------------------ */
typedef struct ring ring_t;

ring_t *ring_open(unsigned entries, int *err);
void ring_close(ring_t *r);
/* Reads of len bytes at offs[i] into dst + i * len, at most qd in flight; expect[i] bytes each
 * (the file may end inside the last). submit_only: hand the first qd to the kernel and return
 * (ring_finish completes them). Returns 0, or -errno with *bad_off the offset of a failed read
 * and *got its result (>= 0: a short read). */
int ring_read(ring_t *r, int fd, const int64_t *offs, int64_t n, int64_t len, uint8_t *dst,
              int64_t file_size, unsigned qd, int submit_only, int64_t *bad_off, int64_t *got);
int ring_finish(ring_t *r, int64_t *bad_off, int64_t *got);
int ring_pending(const ring_t *r);


/* -- ids.c, filecheck.c --------------------------------------------------------------------- */
/* the first position of an id outside [0, rows), or -1 */
int64_t ids_first_outside(const int64_t *v, int64_t n, int64_t rows);
/* the mapped file against what was seen: 0 as seen (size bytes at least, that link count and
 * change time), 1 truncated, 2 unlinked, 3 its link count or change time moved, -errno of fstat */
int file_state(int fd, int64_t size, uint64_t nlink, int64_t ctime_ns);

/* -- willneed.c: the mapped tier's cold-read hint ------------------------------------------ */
/* MADV_WILLNEED on the pages of rows ids[0:n] of a mapping (map_bytes from map; the layout's
 * offsets from map + src_offset): -1 if probe > 0 and the first `probe` rows' pages are all
 * resident (nothing advised), else the bytes this thread read doing it; scratch: 3n */
int64_t willneed_rows(const uint8_t *map, int64_t map_bytes, int64_t src_offset,
                      const int64_t *ids, int64_t n, int64_t row_bytes, int64_t base,
                      layout_t layout, int64_t probe, int64_t *scratch);

/* -- crc.c ------------------------------------------------------------------------------------ */
/* zlib's CRC-32 of n bytes */
uint32_t crc32_bytes(const uint8_t *p, int64_t n);

/* -- direct.c: the direct tier's read, from row ids to placed rows ---------------------------- */
typedef struct {
    int fd;
    int64_t file_size, data_offset, unit, step, row_bytes;
    layout_t layout;
    uint8_t *staging; /* [staging_units, unit]: block reads of read() */
    int64_t staging_units;
    uint8_t *ahead; /* [ahead_units, unit]: block reads started at prefetch() */
    int64_t ahead_units;
    ring_t *ring, *ring_ahead;
    unsigned qd;
    /* the row cache (tiers/hostcache.py's arrays, shared with it) */
    int64_t *tags, *stamp; /* [sets, ways] */
    uint8_t *data;         /* [sets * ways, row_bytes] */
    int64_t sets, ways;
    divisor_t by_sets; /* sets' (row_set) */
    int64_t clock; /* the cache's last stamp (direct_read advances it) */
    /* reads in flight on ring_ahead: their unit offsets, sorted */
    int64_t *ahead_offs, ahead_n;
    int ahead_live;
    int threads;   /* for the probe of large lookups */
    int streaming; /* the cache's rows reach out with non-temporal stores (sink.h) */
    /* verify_reads: the CRC-32 of every check unit of the data region (NULL: no checks), and a
     * descriptor without O_DIRECT for blocks a read unit holds only in part */
    const uint32_t *crcs;
    int64_t check_unit, data_bytes;
    int check_fd;
} direct_t;

typedef struct {
    int64_t hits, blocks, ahead_blocks;
    int64_t bad_block; /* a block whose bytes do not match its CRC-32 (nothing admitted), or -1 */
    int err;           /* 0, or -errno */
    int64_t bad_off; /* the failed read's offset */
    int64_t got;     /* its result (>= 0: a short read) */
} direct_result;

/* rows per piece of a probe on the pool: smaller probes run in the calling thread */
#define PROBE_GRAIN 4096
/* probe: out[i] = cached rows, stamped `clock`; miss[] = positions not cached (hit[]: scratch
 * of n bytes); on up to `threads` threads; returns the misses' count */
int64_t direct_probe(direct_t *d, const int64_t *rows, int64_t n, uint8_t *out,
                     int64_t out_stride, int64_t out_len, int64_t clock, int64_t *miss,
                     uint8_t *hit, int threads);
/* read the misses' units (ahead reads first), check their blocks (crcs), place them, admit
 * them to the cache (`clock`) */
void direct_fill(direct_t *d, const int64_t *rows, const int64_t *miss, int64_t k, uint8_t *out,
                 int64_t out_stride, int64_t clock, direct_result *res);
/* submit the reads of rows the cache lacks (one queue at most); returns how many, or -errno */
int64_t direct_prefetch(direct_t *d, const int64_t *rows, int64_t n);
void direct_drop_ahead(direct_t *d);
/* one read, probe then fill, the cache's clock advanced (hits stamped clock + 1, admissions
 * clock + 2); miss: scratch of n, hit: of n bytes; returns the hits */
int64_t direct_read(direct_t *d, const int64_t *rows, int64_t n, uint8_t *out, int64_t out_stride,
                    int64_t out_len, int64_t *miss, uint8_t *hit, direct_result *res);

/* -- gpudirectory.c: the GPU row cache directory's probe --------------------------------------- */
typedef struct {
    const int64_t *rows, *stags, *tags;
    int64_t *slot, *stamp;
    int32_t *sketch;
    int64_t r0, r1, static_sets, sets, ways, clock, mask, saturated;
    divisor_t sdiv, ddiv; /* static_sets', sets' */
    int touch, shared; /* shared: pieces run on several threads */
} locate_t;
/* slot[i] of rows [a, b): resident, static, dynamic or -1; touch: stamps, counters */
void cache_locate_piece(void *ctx, int64_t a, int64_t b, int worker);

/* the GPU row cache directory (lookup/gpudirectory.py's arrays; its lock, taken around a
 * probe, is the one GpuRowCache takes) */
typedef struct {
    void *lock; /* a Mutex (module.c: mutex_lock) */
    const int64_t *static_tags;
    const int64_t *tags;
    int64_t *stamp, *state; /* state: [clock, ids counted since aging, holds version] */
    int32_t *sketch;
    int64_t sketch_len, r0, r1, static_sets, sets, ways, mask, saturated, age_every, base;
} dir_t;

/* The directory's probe of rows[0:n] into slot, whole, its lock held by the caller: touching
 * (a directory with dynamic sets), its clock advanced, hits stamped, every row counted, and
 * every counter halved once age_every ids were counted since the last halving: the one place
 * the directory ages (GpuCacheDirectory.locate and the host step both come here). Past
 * LOCATE_GRAIN ids on up to `threads` threads. */
void cache_probe(const dir_t *c, const int64_t *rows, int64_t n, int64_t *slot, int touch,
                 int threads);

/* -- hoststep.c: a host-fed staged lookup's host step, whole, without the GIL ----------------- */
/* the states a host step (and feed_serve) returns, S_*, and the counters' words, C_*:
 * constants.h */

/* rows [lo, hi) read by a plain gather from host memory, or by a DirectCore (its lock taken) */
typedef struct {
    int64_t lo, hi;
    int streaming; /* non-temporal stores: the staging is bound for the GPU */
    void *direct;  /* a DirectCore (module.c: direct_core_read), or NULL: a gather */
    const uint8_t *map, *src; /* the buffer, and its rows' region (src_offset bytes in) */
    int64_t map_bytes, src_offset, src_bytes, row_bytes, base;
    layout_t layout;
    int warm_threads, cold_threads;
    int clean; /* reads in a row that needed no disk (a mapping is cold below 2: mapped.py's) */
    int check_file, fd;
    int64_t size, ctime_ns;
    uint64_t nlink;
    /* verify_reads: the CRC-32 of every check unit of the data region (src's bytes, at the
     * rows' layout offsets); NULL: no checks */
    const uint32_t *crcs;
    int64_t check_unit, data_bytes;
} part_t;

typedef struct {
    int64_t rows, start, end; /* the table's rows; this rank's [start, end) */
    part_t parts[2];          /* a row is read by the first part that holds it */
    int nparts;
    dir_t *dir; /* NULL: no GPU row cache */
} hoststep_t;

/* one step's buffers: ids [n]; out: the staged rows, `stride` bytes each; index [n] (the
 * decode's: a row in staging, a cache slot, -1: another rank's); held [n] or NULL (each id's
 * dynamic cache slot, else -1) */
typedef struct {
    const int64_t *ids;
    int64_t n, stride, out_len;
    uint8_t *out;
    int64_t *index, *held;
} stepbufs_t;

#define STEP_SCRATCH 5 /* int64 words of scratch a host step needs per id */
/* the step: 0 (staged), or a state with *detail (constants.h's SHARED_STATES says which);
 * scratch: STEP_SCRATCH * n int64 */
int host_step(hoststep_t *s, const stepbufs_t *b, int64_t *scratch, int64_t *counters,
              int64_t *detail);
/* a DirectCore's read (module.c), under its lock: its hits, or -1 (closed), -2 (out too small);
 * res as direct_fill's; *bytes: bytes read from storage */
int64_t direct_core_read(void *core, const int64_t *rows, int64_t n, uint8_t *out,
                         int64_t out_stride, int64_t out_len, int streaming, int64_t *miss,
                         direct_result *res, int64_t *bytes);
/* a Mutex's lock and unlock (module.c), for code without the GIL */
void mutex_lock(void *mutex);
void mutex_unlock(void *mutex);

#endif
