"""Tables over a torch.distributed group: the split (unit tests) and real gloo groups of 2 and 3
spawned processes, each world checking everything in one spawn (a spawn costs seconds): rows and
heads lookups bit-identical to one process on every tier — a row of -0.0 and NaN payloads
included, compared as raw bits (rows mode's float sum keeps each NaN a NaN, its payload the
communicator's: lookup/ranksum.py) — in any wait order, with ranks on different tiers; ranks that
disagree, or a rank that never arrives, raise on every rank within a bounded time."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import time

import numpy as np
import pytest
import torch

from conftest import requires_cuda
from plestore.distributed import head_columns, plan_shard, vocab_range
from plestore.spec import TableSpec
from plestore.spec.hashspec import IdentityHashSpec, Qwen4ExpHashSpec
from plestore.tablefile import TableWriter

TIERS = ["device", "pinned", "mapped", "direct"]
DIM = 16
HASH = Qwen4ExpHashSpec(vocab_size=100, eos_token_id=1, ngram_vocab_size_base=40)
SPECIAL = {5: 0x8000, 6: 0x7F81, 7: 0xFFC1, 8: 0x7F80}  # -0.0, NaN payloads, +inf


def _bf16_table(path, spec: TableSpec, seed: int = 0) -> np.ndarray:
    """A bf16 table of random bit patterns (specials included); returns its rows as uint16."""
    bits = np.random.default_rng(seed).integers(0, 1 << 16, (spec.rows, spec.dim), np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0x3F80  # random NaNs/infs out, then chosen ones in
    for row, pattern in SPECIAL.items():
        if row < spec.rows:
            bits[row] = pattern
    with TableWriter(path, spec) as w:
        w.write_rows(bits.view(np.uint8).reshape(spec.rows, -1))
        w.commit()
    return bits


def _spec(name="ple", **kw) -> TableSpec:
    base = dict(name=name, rows=HASH.num_rows, dim=DIM, format="bf16", heads=16, hash=HASH)
    return TableSpec(**{**base, **kw})


def _pair(r) -> tuple[int, int]:
    return r.start, r.end


# -- the split -----------------------------------------------------------------------------
def test_vocab_range_is_vllms_where_vllm_defines_one():
    # vocab_range_from_global_vocab_size: rows / world a rank when world divides the rows
    assert _pair(vocab_range(1024, 2, 4)) == (512, 768)
    assert [vocab_range(320_001_536, r, 8).start for r in (1, 7)] == [40_000_192, 280_001_344]
    # VocabParallelEmbedding (pad to 64, split, clip): 1010 rows, TP2 -> 512 | 498
    assert _pair(vocab_range(1010, 1, 2, pad_to=64)) == (512, 1010)
    assert _pair(vocab_range(1010, 1, 2)) == (505, 1010)
    # ranks cover the rows exactly once, in order, also where world does not divide them
    for rows, world in [(10, 3), (10, 4), (7, 7), (1280, 3)]:
        ranges = [vocab_range(rows, r, world) for r in range(world)]
        assert ranges[0].start == 0 and ranges[-1].end == rows
        assert all(a.end == b.start for a, b in zip(ranges, ranges[1:], strict=False))
    with pytest.raises(ValueError, match="3 ranks for a table of 2 rows"):
        vocab_range(2, 0, 3)


def test_heads_split_follows_the_engram_port():
    assert [head_columns(24, r, 2) for r in range(2)] == [(0, 12), (12, 24)]
    assert [head_columns(16, r, 3) for r in range(3)] == [(0, 6), (6, 12), (12, 16)]
    with pytest.raises(ValueError, match="3 ranks for 2 heads"):
        head_columns(2, 0, 3)
    spec = _spec()
    plans = [plan_shard(spec, "heads", r, 3) for r in range(3)]
    offs = HASH.head_offsets
    assert _pair(plans[1].rows) == (offs[6], offs[12])
    assert plans[2].rows.end == spec.rows and plans[0].rows.start == 0  # padding rows: the last's
    assert plans[2].part == 6 and plans[2].local_heads == 4
    gemma = TableSpec(name="g", rows=300, dim=DIM, format="bf16", hash=IdentityHashSpec(300))
    with pytest.raises(ValueError, match="per-head row ranges"):
        plan_shard(gemma, "heads", 0, 2)
    with pytest.raises(ValueError, match="shard must be one of"):
        plan_shard(spec, "cols", 0, 2)


# -- real groups -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ids(rng, n_tokens: int) -> np.ndarray:
    """Valid ids [n, 16]: column h within head h's rows; the special rows in column 0."""
    offs, sizes = HASH.head_offsets, HASH.head_sizes
    ids = np.stack([rng.integers(o, o + s, n_tokens) for o, s in zip(offs, sizes, strict=True)], 1)
    ids[: len(SPECIAL), 0] = list(SPECIAL)[: min(n_tokens, len(SPECIAL))]
    return ids


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def _same(got: torch.Tensor, want: torch.Tensor, summed: bool) -> bool:
    """Bit-identical; where the rows were summed (rows mode), a NaN needs only stay a NaN."""
    g, w = _bits(got), _bits(want)
    if not summed:
        return np.array_equal(g, w)
    nan = want.float().isnan().cpu().numpy()
    return np.array_equal(g[~nan], w[~nan]) and bool(got.float().isnan().cpu().numpy()[nan].all())


def _join(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    """This spawned process joins the group (one GPU a rank for NCCL; one thread: the ranks
    share the machine's cores)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _world(rank: int, world: int, port: int, tables: dict, backend="gloo", device="cpu") -> None:

    import plestore
    from plestore.distributed import GroupDisagrees, open_sharded

    _join(rank, world, port, backend)
    rng = np.random.default_rng(7)  # the same ids on every rank
    path = tables["ple"]
    with plestore.open_table(path, tier="device", device="cpu") as one:  # the one process
        batches = [_ids(rng, n) for n in (9, 1, 300)]
        want = [one.lookup(ids) for ids in batches]
    assert (_bits(want[0])[0, :DIM] == 0x8000).all()  # -0.0 survived the reference

    for tier in TIERS:
        # ranks on different tiers too: the collectives must still pair up
        mine = tier if rank == 0 else TIERS[(TIERS.index(tier) + rank) % 4]
        opts = dict(device=device, cache_bytes=1 << 20, inline_ids=64)  # 300 x 16 ids: worker
        for mode, gather in [("rows", True), ("heads", True), ("heads", False)]:
            with open_sharded(path, mode, tier=mine, gather=gather, **opts) as t:
                if mode == "rows":
                    assert t.table.tier.row_range == t.plan.rows
                    assert t.plan.rows.rows < HASH.num_rows  # reads only its rows
                cols = slice(*(c * DIM for c in t.plan.columns)) if not gather else slice(None)

                def cut(x, cols=cols):
                    return x[:, cols]

                pend = [t.prefetch(ids) for ids in batches]
                got = [pend[i].result() for i in (2, 0, 1)]  # waited for out of order
                summed = mode == "rows"
                for g, i in zip(got, (2, 0, 1), strict=True):
                    assert _same(g, cut(want[i]), summed), (tier, mode, i)
                assert _same(t.lookup(batches[0]), cut(want[0]), summed)
                out = torch.empty_like(cut(want[1]).contiguous(), device=device)
                assert t.lookup_into(torch.as_tensor(batches[1]), out) is out
                assert _same(out, cut(want[1]), summed)
                if mode == "heads":  # an id in another head's rows raises on every rank
                    bad = batches[0].copy()
                    bad[3, 2] = HASH.head_offsets[5]
                    with pytest.raises(IndexError, match=r"position \(3, 2\)"):
                        t.lookup(bad)

    _share_node(rank, world, path, want, batches, device)

    # ranks that disagree on the table: every rank raises, none hangs
    t0 = time.monotonic()
    with pytest.raises(GroupDisagrees, match="disagree"):
        open_sharded(tables["ple"] if rank == 0 else tables["other"], "rows", device=device)
    with pytest.raises(GroupDisagrees, match="rank"):  # one rank's open fails: all raise
        open_sharded(path if rank else tables["missing"], "rows", device=device)
    with pytest.raises(GroupDisagrees, match=f"{world} ranks for a table of 1 rows"):
        open_sharded(tables["tiny"], "rows", device=device)
    with pytest.raises(GroupDisagrees, match="per-head row ranges"):
        open_sharded(tables["tiny"], "heads", device=device)
    assert time.monotonic() - t0 < 20
    # a rank that never arrives (alive, not calling): the others give up after the bounded wait
    if rank < world - 1:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="not every one"):
            open_sharded(path, "rows", device=device, agree_timeout_s=1.0)
        assert time.monotonic() - t0 < 10
    else:
        time.sleep(2.5)
    os._exit(0)  # the group holds an abandoned exchange: leave without tearing it down


def _share_node(rank: int, world: int, path: str, want: list, batches: list, device) -> None:
    """share="node": the ranks open the pinned table at once; one builds, all read it, the
    table's pages count once between them (PSS), and the last closer removes the copy."""
    import torch.distributed as dist

    import plestore
    from plestore.bench.shared import table_pss
    from plestore.distributed import open_sharded
    from plestore.distributed.agree import collective_device

    held = []
    for share in ("none", "node"):
        dist.barrier()
        t = plestore.open_table(path, tier="pinned", device=device, share=share)
        held.append(t)
        for ids, w in zip(batches, want, strict=True):
            assert np.array_equal(_bits(t.lookup(ids)), _bits(w))
        dist.barrier()  # every rank maps it now
        got = torch.tensor([table_pss(t), int(bool(t.tier.describe()["built_shared_copy"]))])
        got = got.to(collective_device(None))
        dist.all_reduce(got)
        copies = got[0].item() / t.tier.buffer.nbytes
        if share == "none":
            assert copies > world - 0.1  # the measure sees private copies
        else:
            assert copies <= 1.1 and got[1].item() == 1, (copies, got)  # one copy, one builder
            seg = t.tier.buffer.path
    with open_sharded(path, "rows", tier="pinned", device=device, share="node") as s:
        assert _same(s.lookup(batches[0]), want[0], summed=True)
    for t in held:
        t.close()
    dist.barrier()
    assert not os.path.exists(seg)  # the last closer removed it
    assert not [f for f in os.listdir(os.path.dirname(seg)) if f.endswith(".seg")]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    _bf16_table(root / "ple", _spec())
    _bf16_table(root / "other", _spec(), seed=1)  # same spec, other data
    tiny = TableSpec(name="tiny", rows=1, dim=DIM, format="bf16")
    _bf16_table(root / "tiny", tiny)
    return {k: str(root / k) for k in ("ple", "other", "tiny", "missing")}


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_lookups_bit_identical_in_a_gloo_group(tables, world, tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setenv("PLESTORE_SHM_DIR", str(tmp_path / "shm"))  # the spawned ranks' too
    mp.spawn(_world, (world, _free_port(), tables), nprocs=world, join=True)


def _tmpfs_dir(tmp_path) -> str:
    """A segment directory CUDA can register: a file of a disk file system mapped shared is
    refused by cudaHostRegister (invalid value; seen on the H200), a tmpfs one is not."""
    if not os.path.isdir("/dev/shm"):
        return str(tmp_path / "shm")
    path = os.path.join("/dev/shm", f"plestore-test-{tmp_path.name}")
    os.makedirs(path, exist_ok=True)
    return path


@pytest.mark.gpu
@requires_cuda
def test_sharded_lookups_on_one_gpu_gloo(tables, tmp_path, monkeypatch):
    """Two ranks on one GPU (gloo carries the rows through the host): streams, events and the
    shared copy registered with CUDA by both processes."""
    import torch.multiprocessing as mp

    shm = _tmpfs_dir(tmp_path)
    monkeypatch.setenv("PLESTORE_SHM_DIR", shm)
    try:
        mp.spawn(_world, (2, _free_port(), tables, "gloo", "cuda"), nprocs=2, join=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (nvidia-h200-x2)")
def test_sharded_lookups_nccl_two_gpus(tables, tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    shm = _tmpfs_dir(tmp_path)
    monkeypatch.setenv("PLESTORE_SHM_DIR", shm)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # the GPU machine's notes: multicast off
    try:
        mp.spawn(_world, (2, _free_port(), tables, "nccl", "cuda"), nprocs=2, join=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _empty_rank_world(rank: int, world: int, port: int, path: str) -> None:

    from plestore.distributed import open_sharded

    _join(rank, world, port)
    code = 1
    try:
        with open_sharded(path, "rows", tier="device", device="cpu", pad_to=64) as t:
            assert (t.table is None) == (rank == 1)  # 10 rows padded to 64: rank 1 has none
            ids = torch.tensor([[1.0, 2.0]])  # float ids: a ValueError on every rank alike
            with pytest.raises(ValueError, match="integers"):
                t.lookup(ids, timeout=5.0)
            got = t.lookup(np.array([[1, 9]]), timeout=5.0)  # still in step afterwards
            assert got.shape == (1, 2 * DIM)
            t.metrics.reset()  # an empty rank's metrics: a table's that never looks up
            assert "phases" in t.metrics.snapshot()
        code = 0
    finally:
        os._exit(code)  # (a failure above printed its traceback as it left the process)


def test_an_empty_rank_refuses_the_ids_its_peers_refuse(tmp_path):
    """A rank the split leaves empty checks ids as a table does (dtype too): a float id raises
    on every rank, instead of the empty rank entering an all-reduce its peers never join."""
    import torch.multiprocessing as mp

    _bf16_table(tmp_path / "small", TableSpec(name="small", rows=10, dim=DIM, format="bf16"))
    mp.spawn(_empty_rank_world, (2, _free_port(), str(tmp_path / "small")), nprocs=2, join=True)


@pytest.mark.parametrize("n_tokens", [2, 600])  # 32 and 9,600 ids: either side of inline_ids
def test_a_failed_lookup_leaves_the_table_out_of_step(tables, n_tokens):
    """A lookup() whose host path fails where it runs (the caller's thread, at any size) issues
    no collective while its peers issue theirs: the table refuses every later lookup rather
    than pair its next collective with their last one (a one-rank group of this process)."""
    import torch.distributed as dist

    from plestore.distributed import open_sharded

    dist.init_process_group("gloo", f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        with open_sharded(tables["ple"], "rows", tier="mapped", device="cpu") as t:
            assert repr(t).endswith(", tier=mapped)") and " object at 0x" not in repr(t)
            ids = _ids(np.random.default_rng(2), n_tokens)
            t.lookup(ids)

            def failing(rows, out):
                raise OSError(errno.EIO, "injected")

            t.table.tier.read = failing
            with pytest.raises(OSError, match="injected"):
                t.lookup(ids)
            with pytest.raises(RuntimeError, match="out of step"):
                t.lookup(ids[:1])
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def qwen_table(small_checkpoint, tmp_path_factory):
    """(a small bf16 Qwen checkpoint, its packed table): packed once for the module's tests."""
    from plestore.tablefile.pack import pack_checkpoint

    ckpt = small_checkpoint("qwen3.8-flash-next", "bf16")
    path = tmp_path_factory.mktemp("qwen") / "t"
    pack_checkpoint(ckpt, path)
    return str(ckpt), str(path)


def _decoder_world(rank: int, world: int, port: int, ckpt: str, path: str, backend="gloo") -> None:
    import torch.distributed as dist
    from ple_decoder import small_decoder

    import plestore
    from plestore.distributed import open_sharded

    _join(rank, world, port, backend)
    # NCCL: one GPU a rank; the decode steps (and their all-reduce) captured
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 248320, n).tolist() for n in (13, 30, 7)]
    with plestore.open_table(path, tier="device", device=device) as one:
        want = small_decoder(ckpt, one, device).generate(prompts, 6, chunk_size=8, keep_logits=True)
    tier = ["device", "mapped"][rank % 2]  # one rank's rows staged on the host, one's not
    with open_sharded(path, "rows", tier=tier, device=device) as t:
        assert t.table.tier.row_range == t.plan.rows  # this rank reads its rows only
        got = small_decoder(ckpt, t, device).generate(prompts, 6, chunk_size=8, keep_logits=True)
        assert t.stats()["phases"]["decode"]["calls"] == 5
        staged = t.staged((3, 16))
        with pytest.raises(IndexError, match="outside"):  # checked on every rank alike
            staged.stage(np.full((3, 16), t.spec.rows))
        with pytest.raises(ValueError, match=r"shape \(3, 16\) expected"):
            staged.stage(np.zeros((2, 16), np.int64))
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        assert torch.equal(a, b)
    with open_sharded(path, "heads", device=device) as h, pytest.raises(ValueError, match="rows-"):
        h.staged((3, 16))
    dist.barrier()  # (rank 0 holds the group's store: it leaves last)
    os._exit(0)


def test_reference_decoder_over_a_rows_sharded_table(qwen_table):
    """The reference decoder on a table sharded over a gloo group of 2 (prefill lookups and
    the decode loop's staged lookup, each summed over the group; one rank staging on the
    host, one reading on the device): tokens and logits of one process's table."""
    import torch.multiprocessing as mp

    mp.spawn(_decoder_world, (2, _free_port(), *qwen_table), nprocs=2, join=True)


def _e2e_world(rank: int, world: int, port: int, path: str, out: str) -> None:
    import json

    import torch.distributed as dist

    from plestore.bench.e2e import run_e2e

    _join(rank, world, port)
    rows = run_e2e(
        path,
        ["mapped", "mapped:shard=rows", "direct:shard=rows"],
        [2],
        torch.device("cpu"),
        hidden_size=64,
        num_layers=2,
        prompt_tokens=12,
        decode_steps=3,
        reps=1,
        prefill_chunk=8,
        log=lambda m: None,
    )
    if rank == 0:
        with open(out, "w") as f:
            json.dump([[r.tier, r.cache, r.tokens_equal_resident] for r in rows], f)
    dist.barrier()
    os._exit(0)


def test_bench_e2e_runs_tiers_sharded_over_the_group(qwen_table, tmp_path):
    """`bench e2e` tiers `TIER:shard=rows` open over the process group (each rank reading its
    half) beside the one-process ones, warm and cold: tokens equal the resident table's."""
    import json

    import torch.multiprocessing as mp

    args = (2, _free_port(), qwen_table[1], str(tmp_path / "rows.json"))
    mp.spawn(_e2e_world, args, nprocs=2, join=True)
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {(t, c) for t, c, _ in rows} >= {
        ("mapped:shard=rows", "warm"),
        ("mapped:shard=rows", "cold"),
        ("direct:shard=rows", "cold"),
    }
    assert all(same for _, _, same in rows)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (nvidia-h200-x2)")
def test_reference_decoder_over_nccl_captured(qwen_table, monkeypatch):
    """As above on two GPUs: the decode steps replay CUDA graphs holding the NCCL all-reduce."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # the GPU machine's notes: multicast off
    mp.spawn(_decoder_world, (2, _free_port(), *qwen_table, "nccl"), nprocs=2, join=True)
