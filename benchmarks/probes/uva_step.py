"""Probe: what a host-memory read costs inside a captured decode step, and whether a host-fed
lookup's staging reads faster through UVA or through a captured DMA copy first.

Each variant is one CUDA graph: [layer 0, the lookup's kernels, 8 layers] (hidden 2560, a
Qwen3-4B-sized layer), or the lookup's kernels alone; replays timed with events, rounds
interleaved, medians. Rows: NVFP4 (90 B, stride 96), 16 a token.

    none          no lookup
    device        gather_decode from a 1M-row table in HBM
    uva-table     the same table in pinned host memory, read through UVA
    uva-staging   the rows already staged: n rows of pinned staging, read through UVA
    dma-staging   the staging copied to HBM first (captured memcpy), then decoded there
    fed           the real thing: a mapped table's host-fed lookup (post, host thread, wait)
    fed-dma       the same, its staging copied to HBM before the decode

    python3 benchmarks/probes/uva_step.py TABLE   (a packed table; fed variants use it)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import plestore
from plestore.formats import get_format
from plestore.io.memory import HostBuffer
from plestore.kernels.gather_decode import gather_decode

H, Q, KV, FFN, ROWS, RB, DIM = 2560, 4096, 1024, 9728, 1 << 20, 96, 160


def _w(i, o):
    return (torch.randn(i, o, device="cuda") * i**-0.5).to(torch.bfloat16)


W: list[torch.Tensor] = []  # the layer's weights, made in main (on the GPU)


def layer(x):
    x = x + (x @ W[0])[:, :Q] @ W[1]
    gu = x @ W[2]
    return x + (torch.nn.functional.silu(gu[:, :FFN]) * gu[:, FFN:]) @ W[3]


def variants(batch: int, table_path: str) -> dict:
    fmt, n = get_format("nvfp4"), batch * 16
    host = HostBuffer(ROWS * RB, pin=True)
    host.tensor.copy_(torch.randint(0, 100, (ROWS * RB,), dtype=torch.uint8))  # finite scales
    pinned = host.tensor.view(ROWS, RB)
    dev = pinned.cuda()
    sets = [torch.randint(0, ROWS, (n,), device="cuda") for _ in range(8)]
    ids = sets[0].clone()
    stage = HostBuffer(n * RB, pin=True)
    staging = stage.tensor.view(n, RB)
    staging.copy_(pinned[:n])
    stage_dev = torch.empty_like(staging, device="cuda")
    iota = torch.arange(n, device="cuda")
    out = torch.empty(n, DIM, dtype=torch.bfloat16, device="cuda")
    table = plestore.open_table(table_path, tier="mapped", device="cuda", timeout_s=3)
    tids = torch.zeros(batch, 16, dtype=torch.int64, device="cuda")
    fed = table.staged((batch, 16), ids=tids, feed=True)
    tids2 = torch.zeros_like(tids)
    fed2 = table.staged((batch, 16), ids=tids2, feed=True)
    f2 = fed2.staged.fixed
    if f2.device is None:  # (what fed-dma measures: the staging copied to HBM first)
        f2.device = (
            torch.empty_like(f2.rows, device="cuda"),
            torch.empty_like(f2.index, device="cuda"),
        )

    def dec(src, idx):
        gather_decode(src, idx, 0, src.shape[0], fmt, DIM, 1.0, out)

    def rotate(t):
        return lambda: t.copy_(sets[int(torch.randint(0, 8, ()))].view_as(t) % table.spec.rows)

    return {
        "none": ([], None),
        "device": ([lambda: dec(dev, ids)], lambda: ids.copy_(sets[int(torch.randint(0, 8, ()))])),
        "uva-table": (
            [lambda: dec(pinned, ids)],
            lambda: ids.copy_(sets[int(torch.randint(0, 8, ()))]),
        ),
        "uva-staging": ([lambda: dec(staging, iota)], None),
        "dma-staging": (
            [lambda: stage_dev.copy_(staging, non_blocking=True), lambda: dec(stage_dev, iota)],
            None,
        ),
        "fed": ([fed.post, fed.decode], rotate(tids)),
        "fed-dma": ([fed2.post, fed2.decode], rotate(tids2)),
    }, (host, stage, table)


def capture(fns, with_layers: bool, batch: int):
    x = torch.randn(batch, H, device="cuda", dtype=torch.bfloat16)

    def step():
        h = layer(x) if with_layers else x
        for fn in fns:
            fn()
        if with_layers:
            for _ in range(8):
                h = layer(h)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g


def time_replays(g, before, reps: int = 100) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main(table_path: str) -> None:
    W.extend([_w(H, Q + 2 * KV), _w(Q, H), _w(H, 2 * FFN), _w(FFN, H)])
    for batch in (1, 64):
        vs, keep = variants(batch, table_path)
        graphs = {
            (k, lay): capture(f, lay, batch)
            for k, (f, _) in vs.items()
            for lay in (True, False)
            if f or lay
        }
        res: dict = {k: [] for k in graphs}
        for _ in range(5):
            for k, g in graphs.items():
                res[k].append(time_replays(g, vs[k[0]][1]))
        for (name, lay), ts in res.items():
            line = {
                "batch": batch,
                "variant": name,
                "layers": lay,
                "us": round(statistics.median(ts), 1),
            }
            print(json.dumps(line), flush=True)
        keep[2].close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("table", help="a packed table (the fed variants read it)")
    main(p.parse_args().table)
