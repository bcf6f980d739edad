"""The GPU halves of a host-fed captured lookup (`plestore.lookup.graphfeed`): two one-program
kernels that a CUDA graph replays, beside their torch references (CPU: the same protocol, run
at once).

    feed_post(ids, header, box, counter, key)   after the hash: seq = ++counter; the step's ids
                                                into `box` (pinned host memory, UVA stores),
                                                header[KEY] = key, a system-scope fence, then
                                                header[POSTED] = seq (the host side spins on it)
    feed_wait(header, counter, bad, timeout_ns) before the rows' consumer: polls header[READY]
                                                (or header[FAILED]) for this step's seq, bounded
                                                by %globaltimer; bad[0] = 1 and header[TIMED_OUT]
                                                = seq when the rows did not come

The header is int64 words in mapped pinned memory, written by one side each: POSTED, KEY by the
GPU; READY, FAILED by the host side; TIMED_OUT by the GPU. Sequence numbers make a late or
stale READY never count for a later step. No stream memory operations (cuStreamWaitValue):
the H200 has none (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS = 0, shared/device.md).
"""

from __future__ import annotations

import time

import torch

from plestore.kernels import announce_reference, triton_available
from plestore.native.constants import HEADER_WORDS, W_FAILED, W_KEY, W_POSTED, W_READY, W_TIMED_OUT

__all__ = [
    "FAILED",
    "HEADER_WORDS",
    "KEY",
    "POSTED",
    "READY",
    "TIMED_OUT",
    "feed_post",
    "feed_post_reference",
    "feed_wait",
    "feed_wait_reference",
]

#: the header's int64 words (constants.h's W_*: the host core's too)
POSTED, READY, FAILED, TIMED_OUT, KEY = W_POSTED, W_READY, W_FAILED, W_TIMED_OUT, W_KEY


def feed_post_reference(
    ids: torch.Tensor, header: torch.Tensor, box: torch.Tensor, counter: torch.Tensor, key: int
) -> None:
    """Plain torch: the same writes in the same order (POSTED last)."""
    seq = int(counter[0]) + 1
    counter[0] = seq
    box.copy_(ids.reshape(-1))
    header[KEY] = key
    header[POSTED] = seq


def feed_wait_reference(
    header: torch.Tensor, counter: torch.Tensor, bad: torch.Tensor, timeout_ns: int
) -> None:
    """Plain torch: poll until this step's seq is READY (or FAILED, or the time is up), yielding
    the GIL between polls to the host side's thread."""
    seq, deadline = int(counter[0]), time.monotonic_ns() + timeout_ns
    while int(header[READY]) != seq and int(header[FAILED]) != seq:
        if time.monotonic_ns() > deadline:
            header[TIMED_OUT] = seq
            break
        time.sleep(0)
    bad[0] = int(header[READY]) != seq


def feed_post(
    ids: torch.Tensor, header: torch.Tensor, box: torch.Tensor, counter: torch.Tensor, key: int
) -> None:
    """ids: int64 on the device (n values); header int64 [HEADER_WORDS] and box int64 [n] in
    pinned host memory; counter int64 [1] on the device."""
    if not (ids.is_cuda and triton_available()):
        if ids.is_cuda:
            announce_reference("feed_post")
        return feed_post_reference(ids, header, box, counter, key)
    n = ids.numel()
    _post_kernel[(1,)](
        ids, header, box, counter, n, key, BLOCK=_BLOCK, POSTED=POSTED, KEY=KEY, num_warps=4
    )


def feed_wait(header: torch.Tensor, counter: torch.Tensor, bad: torch.Tensor, timeout_ns: int):
    """bad: uint8 [1] on the device (1: this step's rows did not come)."""
    if not (bad.is_cuda and triton_available()):
        if bad.is_cuda:
            announce_reference("feed_wait")
        return feed_wait_reference(header, counter, bad, timeout_ns)
    _wait_kernel[(1,)](
        header, counter, bad, timeout_ns, READY=READY, FAILED=FAILED, TIMED_OUT=TIMED_OUT,
        num_warps=1,
    )  # fmt: skip


_BLOCK = 1024

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _fence_sys():
        # every store before it visible system-wide (PCIe to the host) before any after it
        return tl.inline_asm_elementwise(
            "fence.sc.sys;\n\tmov.u64 $0, 0;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit
    def _now_ns():
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit(do_not_specialize=["n", "key"])
    def _post_kernel(
        ids, header, box, counter, n, key, BLOCK: tl.constexpr, POSTED: tl.constexpr,
        KEY: tl.constexpr,
    ):  # fmt: skip
        seq = tl.load(counter) + 1
        for start in range(0, n, BLOCK):
            o = start + tl.arange(0, BLOCK)
            m = o < n
            tl.store(box + o, tl.load(ids + o, mask=m), mask=m)
        tl.store(header + KEY, key.to(tl.int64))
        zero = _fence_sys()  # (each thread fences its own stores, then all meet)
        tl.debug_barrier()
        tl.store(counter, seq)
        tl.store(header + POSTED, seq + zero)  # last

    @triton.jit(do_not_specialize=["timeout_ns"])
    def _wait_kernel(
        header, counter, bad, timeout_ns, READY: tl.constexpr, FAILED: tl.constexpr,
        TIMED_OUT: tl.constexpr,
    ):  # fmt: skip
        seq = tl.load(counter)
        t0 = _now_ns()
        ready = tl.load(header + READY, volatile=True)
        failed = tl.load(header + FAILED, volatile=True)
        waiting = (ready != seq) & (failed != seq)
        while waiting:
            ready = tl.load(header + READY, volatile=True)
            failed = tl.load(header + FAILED, volatile=True)
            late = (_now_ns() - t0) > timeout_ns
            waiting = (ready != seq) & (failed != seq) & (~late)
        missing = ready != seq
        tl.store(bad, missing.to(tl.uint8))
        if missing & (failed != seq):
            tl.store(header + TIMED_OUT, seq)
