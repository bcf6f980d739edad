"""The one sum sharded rows take (lookup/ranksum.py): a rank's part holds -0.0 for other ranks'
ids, and a float all-reduce of the parts gives every value its owner's bits. Shown for every
bf16 and fp16 bit pattern through real gloo groups of 2 and 3 processes (a NaN stays a NaN, its
payload the communicator's), and for the GPU's own additions (what NCCL and an engine's custom
all-reduce compute per element)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from conftest import requires_cuda
from plestore.lookup.ranksum import negative_absent

DTYPES = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern once, as `dtype` [65536]."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def _exact(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-identical, but a NaN need only stay a NaN."""
    nan = want.isnan()
    same = got.view(torch.int16) == want.view(torch.int16)
    return bool(same[~nan].all()) and bool(got[nan].isnan().all())


def test_other_ranks_rows_become_negative_zero_and_own_rows_stay():
    rows = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(4, 6).to(torch.bfloat16)
    ids = np.array([[0, 5, 9], [4, 4, 10], [3, 7, 8], [11, 2, 6]])  # [4 tokens, 3 heads]
    want = rows.clone().view(4, 3, 2)
    out = negative_absent(rows, ids, 4, 9)  # this rank: rows [4, 9)
    assert out is rows
    got = rows.view(4, 3, 2)
    mine = torch.from_numpy((ids >= 4) & (ids < 9))
    assert torch.equal(got[mine].view(torch.int16), want[mine].view(torch.int16))
    assert (got[~mine].view(torch.int16) == -32768).all()  # 0x8000: -0.0, not +0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sum_every_pattern(rank: int, world: int, port: int) -> None:
    """Each pattern owned by one rank (its id in that rank's range), summed by gloo."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    n = 1 << 16
    ids = torch.arange(n).reshape(n, 1)  # [n tokens, 1 head]: id i owned by rank i * world // n
    start, end = rank * n // world, (rank + 1) * n // world
    for dtype in DTYPES:
        want = _patterns(dtype)
        part = negative_absent(want.clone().reshape(n, 1), ids, start, end)
        dist.all_reduce(part, group=dist.group.WORLD)
        assert _exact(part.reshape(n), want), (dtype, rank, world)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_every_pattern_survives_a_gloo_sum(world):
    import torch.multiprocessing as mp

    mp.spawn(_sum_every_pattern, (world, _free_port()), nprocs=world, join=True)


@pytest.mark.gpu
@requires_cuda
def test_every_pattern_survives_the_gpus_additions():
    """x + (-0.0) on the GPU in the dtype itself and through an fp32 accumulator (NCCL's and
    custom all-reduces' two ways), in either order, for every pattern; fp32 on specials and a
    random sample."""
    for dtype in DTYPES:
        x = _patterns(dtype).cuda()
        nz = torch.full_like(x, -0.0)
        for got in (x + nz, nz + x, (x.float() + nz.float()).to(dtype), nz + nz + x):
            assert _exact(got, x), dtype
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int32)
    special = torch.tensor([0, -(2**31), 0x7F800000, -8388608, 1, 0x7FC00001], dtype=torch.int32)
    x = torch.cat([bits, special]).view(torch.float32).cuda()
    got = x + torch.full_like(x, -0.0)
    nan = x.isnan()
    assert bool((got.view(torch.int32) == x.view(torch.int32))[~nan].all())
    assert bool(got[nan].isnan().all())
