/* The values the C core, Python and the Triton kernels share, defined here only.
 *
 * The C includes this file; module.c exports every value (`_core.CONSTANTS`); Python reads this
 * same file (plestore/native/constants.py parses it), so the numpy reference has the values
 * where the core is not built, and a core built from other values is refused as stale.
 * tests/test_constants.py fails if a value is defined anywhere else. Keep to the two forms
 * below (`#define NAME integer` and the lists), which constants.py parses. */
#ifndef PLESTORE_CONSTANTS_H
#define PLESTORE_CONSTANTS_H

/* the core's interface version: bump when a call's arguments or results change */
#define ABI_VERSION 21

/* ways of a static set in the GPU row cache directory */
#define STATIC_WAYS 16

/* a cold mapping's read of this many rows or more faults on the pool, COLD_GRAIN rows a piece
 * (one thread faulting 1,024 cold rows waits for 1,024 reads in a row); warm reads take
 * WARM_GRAIN-row pieces */
#define COLD_ROWS 64
#define COLD_GRAIN 16
#define WARM_GRAIN 2048
/* a cold mapping's WILLNEED is skipped when the pages of this many of a read's rows are in */
#define PROBE_ROWS 32
/* a mapping is cold until this many reads in a row needed no disk */
#define WARM_READS 2

/* a graph feed's header: int64 words in mapped pinned memory, 64 B apart (kernels/feed.py) */
#define W_POSTED 0
#define W_READY 8
#define W_FAILED 16
#define W_TIMED_OUT 24
#define W_KEY 32
/* the wake (feed_wake): WAKE counts the engine's wakes (a futex on its low 32 bits), WOKEN the
 * last the host side acted on, ASLEEP 1 while it sleeps on WAKE (both written by the host) */
#define W_WAKE 40
#define W_WOKEN 48
#define W_ASLEEP 56
#define HEADER_WORDS 64

/* the row hashes that place rows in sets (rowsets.py, direct.c, gpudirectory.c) */
#define HASH_GOLDEN 0x9E3779B97F4A7C15ULL
#define HASH_MIX 0xBF58476D1CE4E5B9ULL
#define HASH_SKETCH_SEED 0x5BD1E995ULL

/* every value above, by name (module.c's CONSTANTS) */
#define SHARED_NUMBERS(X)                                                                      \
    X(ABI_VERSION) X(STATIC_WAYS) X(COLD_ROWS) X(COLD_GRAIN) X(WARM_GRAIN) X(PROBE_ROWS)         \
    X(WARM_READS) X(W_POSTED) X(W_READY) X(W_FAILED) X(W_TIMED_OUT) X(W_KEY) X(W_WAKE)          \
    X(W_WOKEN) X(W_ASLEEP) X(HEADER_WORDS) X(HASH_GOLDEN) X(HASH_MIX) X(HASH_SKETCH_SEED)

/* what a host step (and feed_serve) returns, in order: S_QUIET = 0, ... (Python: lower case).
 * A refused step's detail says what failed: BAD_ID / BAD_ROW the id's position; FILE_CHANGED
 * file_state's (a mapping's file truncated, removed or touched: its tier looks); READ_FAILED
 * the read's errno (-1: the tier's core closed, -2: its staging too small); CORRUPT the block
 * failing its CRC-32 (verify_reads) */
#define SHARED_STATES(X)                                                                       \
    X(QUIET) X(STOP) X(POSTED) X(BAD_ID) X(BAD_ROW) X(FILE_CHANGED) X(READ_FAILED) X(CORRUPT)    \
    X(TIMED_OUT) X(NO_FEED)

/* feed_serve's counters, a word each, in order: C_STOP = 0, ... (Python: the second name).
 * CLEAN is a state, not a total: the mapping's reads in a row that needed no disk after the
 * last fed step of a part with a file (-1: none yet) */
#define SHARED_COUNTERS(X)                                                                     \
    X(STOP, stop) X(STEPS, steps) X(ROWS, rows) X(ABSENT, absent) X(MAJOR, major_faults)         \
    X(MINOR, minor_faults) X(DISK, disk_bytes) X(GATHER_NS, gather_ns)                           \
    X(HOST_HITS, host_cache_hits) X(DIRECT_ROWS, direct_rows) X(BLOCKS, blocks_read)             \
    X(GPU_HITS, gpu_cache_hits) X(STEP_NS, step_ns) X(CLEAN, clean_reads)

#define STATE_ENUM(name) S_##name,
#define COUNTER_ENUM(name, py) C_##name,
enum { SHARED_STATES(STATE_ENUM) S_COUNT };
enum { SHARED_COUNTERS(COUNTER_ENUM) C_WORDS };

#endif
