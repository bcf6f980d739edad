/* A minimal io_uring of reads, as io/uring.py but in C: raw syscalls, no liburing, no kernel
 * header needed (the structs below are the kernel ABI, as io/uring.py spells them). One batch at
 * a time per ring; the caller serialises use of a ring. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core.h"

#define SYS_SETUP 425 /* the same number on every architecture (since Linux 5.1) */
#define SYS_ENTER 426
#define OFF_SQ_RING 0ULL
#define OFF_CQ_RING 0x8000000ULL
#define OFF_SQES 0x10000000ULL
#define FEAT_SINGLE_MMAP 1u
#define ENTER_GETEVENTS 1u
#define OP_READ 22

struct sqe {
    uint8_t opcode, flags;
    uint16_t ioprio;
    int32_t fd;
    uint64_t off, addr;
    uint32_t len, rw_flags;
    uint64_t user_data;
    uint8_t pad[24];
};
struct cqe {
    uint64_t user_data;
    int32_t res;
    uint32_t flags;
};
struct params {
    uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd;
    uint32_t resv[3];
    uint32_t sq_off[10]; /* head, tail, mask, entries, flags, dropped, array, resv1, user_addr */
    uint32_t cq_off[10]; /* head, tail, mask, entries, overflow, cqes, flags, resv1, user_addr */
};
_Static_assert(sizeof(struct sqe) == 64 && sizeof(struct cqe) == 16, "io_uring ABI");
_Static_assert(sizeof(struct params) == 120, "io_uring params ABI");

struct ring {
    int fd;
    unsigned sq_entries, cq_entries, sq_mask, cq_mask;
    void *sq_map, *cq_map, *sqe_map;
    size_t sq_size, cq_size, sqe_size;
    uint32_t *sq_head, *sq_tail, *cq_head, *cq_tail;
    struct sqe *sqes;
    struct cqe *cqes;
    int broken;
    /* the batch in flight */
    int rfd;
    const int64_t *offs;
    int64_t n, len, file_size, submitted, completed;
    uint8_t *dst;
    unsigned qd;
    int failure; /* -errno of the first failed read, 0 */
    int64_t bad_off, got;
};

static long sys_enter(int fd, unsigned submit, unsigned wait) {
    return syscall(SYS_ENTER, fd, submit, wait, ENTER_GETEVENTS, NULL, 0);
}

ring_t *ring_open(unsigned entries, int *err) {
    struct params p;
    memset(&p, 0, sizeof p);
    int fd = (int)syscall(SYS_SETUP, entries, &p);
    if (fd < 0) {
        *err = errno;
        return NULL;
    }
    ring_t *r = calloc(1, sizeof *r);
    if (!r) {
        close(fd);
        *err = ENOMEM;
        return NULL;
    }
    r->fd = fd;
    r->sq_entries = p.sq_entries;
    r->cq_entries = p.cq_entries;
    r->sq_size = p.sq_off[6] + p.sq_entries * sizeof(uint32_t);
    r->cq_size = p.cq_off[5] + p.cq_entries * sizeof(struct cqe);
    r->sqe_size = p.sq_entries * sizeof(struct sqe);
    int prot = PROT_READ | PROT_WRITE, fl = MAP_SHARED | MAP_POPULATE;
    if (p.features & FEAT_SINGLE_MMAP) {
        size_t size = r->sq_size > r->cq_size ? r->sq_size : r->cq_size;
        r->sq_size = r->cq_size = size;
        r->sq_map = r->cq_map = mmap(NULL, size, prot, fl, fd, OFF_SQ_RING);
    } else {
        r->sq_map = mmap(NULL, r->sq_size, prot, fl, fd, OFF_SQ_RING);
        r->cq_map = mmap(NULL, r->cq_size, prot, fl, fd, OFF_CQ_RING);
    }
    r->sqe_map = mmap(NULL, r->sqe_size, prot, fl, fd, OFF_SQES);
    if (r->sq_map == MAP_FAILED || r->cq_map == MAP_FAILED || r->sqe_map == MAP_FAILED) {
        *err = errno;
        if (r->sq_map == MAP_FAILED) r->sq_map = NULL;
        if (r->cq_map == MAP_FAILED) r->cq_map = NULL;
        if (r->sqe_map == MAP_FAILED) r->sqe_map = NULL;
        ring_close(r);
        return NULL;
    }
    uint8_t *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (uint32_t *)(sq + p.sq_off[0]);
    r->sq_tail = (uint32_t *)(sq + p.sq_off[1]);
    r->sq_mask = *(uint32_t *)(sq + p.sq_off[2]);
    r->cq_head = (uint32_t *)(cq + p.cq_off[0]);
    r->cq_tail = (uint32_t *)(cq + p.cq_off[1]);
    r->cq_mask = *(uint32_t *)(cq + p.cq_off[2]);
    r->cqes = (struct cqe *)(cq + p.cq_off[5]);
    r->sqes = r->sqe_map;
    uint32_t *array = (uint32_t *)(sq + p.sq_off[6]);
    for (unsigned i = 0; i < p.sq_entries; i++) array[i] = i; /* slot i always names SQE i */
    memset(r->sqes, 0, r->sqe_size);
    for (unsigned i = 0; i < p.sq_entries; i++) r->sqes[i].opcode = OP_READ;
    return r;
}

void ring_close(ring_t *r) {
    if (!r) return;
    if (r->sqe_map) munmap(r->sqe_map, r->sqe_size);
    if (r->cq_map && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_size);
    if (r->sq_map) munmap(r->sq_map, r->sq_size);
    close(r->fd);
    free(r);
}

int ring_pending(const ring_t *r) { return r->offs != NULL; }

static int64_t expect_of(const ring_t *r, int64_t i) {
    int64_t left = r->file_size - r->offs[i];
    return left < r->len ? left : r->len;
}

static void fill(ring_t *r, int64_t k) {
    uint32_t tail = *r->sq_tail; /* only this thread writes it */
    for (int64_t j = 0; j < k; j++) {
        int64_t i = r->submitted + j;
        struct sqe *e = &r->sqes[(tail + j) & r->sq_mask];
        e->fd = r->rfd;
        e->off = (uint64_t)r->offs[i];
        e->addr = (uint64_t)(uintptr_t)(r->dst + i * r->len);
        e->len = (uint32_t)r->len;
        e->user_data = (uint64_t)i;
    }
    __atomic_store_n(r->sq_tail, tail + (uint32_t)k, __ATOMIC_RELEASE);
    r->submitted += k;
}

/* Hand the kernel every entry it has not taken, and wait for `wait` completions. */
static int enter(ring_t *r, unsigned wait) {
    for (;;) {
        unsigned untaken = *r->sq_tail - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        if (sys_enter(r->fd, untaken, wait) >= 0) return 0;
        if (errno != EINTR) return -errno;
    }
}

static int64_t reap(ring_t *r) {
    uint32_t head = *r->cq_head, tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    int64_t count = (uint32_t)(tail - head);
    for (uint32_t h = head; h != tail; h++) {
        struct cqe *c = &r->cqes[h & r->cq_mask];
        int64_t i = (int64_t)c->user_data, want = expect_of(r, i);
        if (c->res != want && !r->failure) {
            r->failure = c->res < 0 ? c->res : -EIO;
            r->bad_off = r->offs[i];
            r->got = c->res;
        }
    }
    __atomic_store_n(r->cq_head, tail, __ATOMIC_RELEASE);
    r->completed += count;
    return count;
}

/* After a failed enter: drop the entries the kernel has not taken and wait for those it has, so
 * no buffer is written once the batch is given up; if even that fails the ring is unusable. */
static void drain(ring_t *r) {
    uint32_t head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    int64_t untaken = (uint32_t)(*r->sq_tail - head);
    __atomic_store_n(r->sq_tail, head, __ATOMIC_RELEASE);
    r->submitted -= untaken;
    while (r->completed < r->submitted) {
        if (sys_enter(r->fd, 0, (unsigned)(r->submitted - r->completed)) < 0 && errno != EINTR) {
            r->broken = 1;
            return;
        }
        reap(r);
    }
}

static int done_batch(ring_t *r, int64_t *bad_off, int64_t *got, int err) {
    if (!err) err = r->failure;
    *bad_off = r->bad_off;
    *got = r->got;
    r->offs = NULL;
    return err;
}

int ring_finish(ring_t *r, int64_t *bad_off, int64_t *got) {
    while (r->completed < r->n) {
        int64_t room = (int64_t)r->qd - (r->submitted - r->completed);
        int64_t k = r->failure ? 0 : (room < r->n - r->submitted ? room : r->n - r->submitted);
        if (k > 0) fill(r, k);
        int64_t inflight = r->submitted - r->completed;
        /* with every read submitted, one wake-up for all of them (see io/uring.py) */
        unsigned wait = (unsigned)(r->submitted == r->n ? inflight : (inflight < 1 ? inflight : 1));
        int err = enter(r, wait);
        if (err) {
            drain(r);
            return done_batch(r, bad_off, got, err);
        }
        reap(r);
        if (r->failure && r->completed == r->submitted) break;
    }
    return done_batch(r, bad_off, got, 0);
}

int ring_read(ring_t *r, int fd, const int64_t *offs, int64_t n, int64_t len, uint8_t *dst,
              int64_t file_size, unsigned qd, int submit_only, int64_t *bad_off, int64_t *got) {
    *bad_off = -1;
    *got = 0;
    if (r->broken) return -EIO;
    if (n <= 0) return 0;
    if (qd > r->sq_entries) qd = r->sq_entries;
    if (qd > r->cq_entries) qd = r->cq_entries;
    if (qd < 1) qd = 1;
    r->rfd = fd;
    r->offs = offs;
    r->n = n;
    r->len = len;
    r->dst = dst;
    r->file_size = file_size;
    r->qd = qd;
    r->submitted = r->completed = 0;
    r->failure = 0;
    r->bad_off = -1;
    r->got = 0;
    fill(r, n < qd ? n : qd);
    if (submit_only) {
        int err = enter(r, 0);
        if (err) {
            drain(r);
            return done_batch(r, bad_off, got, err);
        }
        return 0;
    }
    return ring_finish(r, bad_off, got);
}
