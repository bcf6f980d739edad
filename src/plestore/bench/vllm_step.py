"""`plestore bench vllm TABLE`: a decode step's PLE lookup as vLLM's Qwen4Exp runs it through the
plugin, per tier, beside the device tier's — the cost a vLLM user pays for each tier.

vLLM's step, as the plugin sees it (one PLE layer on decoder layer 1, as the real model):

    segment 1   embed + hash: the step's ids written into the model's fixed id buffer
    start       the PLE layer's lookup starts (layer 1's prefetch, before layer 0 runs)
    segment 2   layer 0
    finish      the rows, where the PLE layer consumes them
    segment 3   the PLE projection and the layers after it

Tiers the GPU reads (device; pinned, through UVA) run the whole step as one CUDA graph: the
lookup's kernel captured, reading the ids where segment 1 wrote them. Host tiers (and a tier
named with '+eager') run start and finish eagerly between the graphs of segments 1-3 (vLLM's
breakable-graph eager breaks). Steps cycle over --id-sets sets of ids, read once before timing
(warm rows; cold reads are `bench lookup`'s and `bench e2e`'s). Every step's rows are checked
bit for bit against the resident table. Layers are bf16 matmuls sized
by --hidden (the step's other work: what a lookup can hide behind).

    plestore bench vllm TABLE --tiers device,pinned,pinned+eager,mapped,direct --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import plestore
from plestore.bench.methods import tier_options
from plestore.bench.report import append_csv, machine
from plestore.integrations.vllm.lookup import PleLayerLookup

__all__ = ["main", "run_step"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plestore bench vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("table", help="a packed Qwen4Exp table (its .json, or the directory)")
    p.add_argument(
        "--tiers",
        default="device,pinned,pinned+eager,mapped,direct",
        help="tiers, with table options after ':' (pinned:gather=cpu); '+eager' runs a tier "
        "the GPU reads itself between graphs, as host tiers run",
    )
    p.add_argument(
        "--id-sets", type=int, default=8, help="steps cycle over this many id sets (warm rows)"
    )
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes (tokens a step)")
    p.add_argument("--steps", type=int, default=200, help="timed steps per tier and batch")
    p.add_argument("--hidden", type=int, default=2560, help="width of the layers' matmuls")
    p.add_argument("--layers", type=int, default=4, help="layers after the PLE layer")
    p.add_argument("--csv", default="benchmarks/bench.csv", help="append rows here ('' off)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _open(path: str, spec: str, device: str):
    """'pinned:gather=cpu+eager' -> (the table on that tier with those options, capture?)."""
    spec, eager, _ = spec.partition("+eager")
    tier, kw = tier_options(spec)
    return plestore.open_table(path, tier=tier, device=device, **kw), not eager


class _Step:
    """One decode step's GPU work around the PLE lookup (see the module doc)."""

    def __init__(self, lookup: PleLayerLookup, batch: int, hidden: int, layers: int, sets: int):
        dev, t = lookup.table.device, lookup.table
        g = torch.Generator(device="cpu").manual_seed(batch)
        self.lookup, self.batch, self.sets = lookup, batch, sets
        self.base = torch.randint(0, t.spec.rows, (batch, lookup.heads), generator=g).to(dev)
        self.step = torch.zeros((), dtype=torch.int64, device=dev)
        self.ids = torch.zeros_like(self.base)  # the model's fixed id buffer
        self.rows = torch.zeros(batch, lookup.width, dtype=t.dtype, device=dev)
        self.x = torch.randn(batch, hidden, dtype=torch.bfloat16, device=dev)
        scale = hidden**-0.5
        self.w = [torch.randn(hidden, hidden, dtype=torch.bfloat16, device=dev) * scale]
        self.w += [w.clone() for w in self.w * layers]
        self.proj = torch.randn(lookup.width, hidden, dtype=torch.bfloat16, device=dev) * 0.01

    def hash(self) -> None:  # segment 1: this step's ids, computed on the device
        torch.remainder(self.step + 1, self.sets, out=self.step)  # one of `sets` id sets
        torch.remainder(self.base + self.step * 7919, self.lookup.table.spec.rows, out=self.ids)

    def layer0(self) -> None:  # segment 2
        self.h = self.x @ self.w[0]

    def rest(self) -> None:  # segment 3: the PLE projection, then the layers after it
        h = self.h + self.rows.to(torch.bfloat16) @ self.proj
        for w in self.w[1:]:
            h = torch.relu(h @ w)
        self.out = h

    def start(self) -> None:
        self.lookup.start(self.ids)

    def finish(self) -> None:
        self.rows.copy_(self.lookup.finish(self.batch))


def run_step(lookup, ref, batch: int, steps: int, hidden: int, layers: int, sets: int) -> dict:
    """Time `steps` decode steps of one tier (warm: after a pass over the id sets); every
    step's rows checked against `ref`."""
    s = _Step(lookup, batch, hidden, layers, sets)
    cuda = lookup.table.device.type == "cuda"
    plan = [s.hash, s.start, s.layer0, s.finish, s.rest]
    if cuda:
        plan = _graphs(s, captured=lookup.captures)
    for _ in range(sets):  # warm-up: every id set's rows read once
        for fn in plan:
            fn()
    times, bad = [], 0
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for fn in plan:
            fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        bad += not torch.equal(s.rows.view(torch.int16), ref.lookup(s.ids).view(torch.int16))
    return {
        "step_us": 1e6 * statistics.median(times),
        "p90_us": 1e6 * sorted(times)[int(0.9 * (len(times) - 1))],
        "captured": bool(cuda and lookup.captures),
        "steps_with_wrong_rows": bad,
    }


def _graphs(s: _Step, captured: bool) -> list:
    """The step as CUDA graphs: one whole graph, or three around the eager start and finish."""
    for fn in (s.hash, s.start, s.layer0, s.finish, s.rest):  # warm up before any capture
        fn()
    torch.cuda.synchronize()
    if captured:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in (s.hash, s.start, s.layer0, s.finish, s.rest):
                fn()
        return [g.replay]
    parts = []
    for segment in (s.hash, s.layer0, s.rest):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            segment()
        parts.append(g)
    return [parts[0].replay, s.start, parts[1].replay, s.finish, parts[2].replay]


def _line(r: dict) -> str:
    text = f"{r['tier']:>18} b{r['batch']:<3} {r['step_us']:8.1f} us/step"
    if r["vs_device"]:
        text += f"  {r['vs_device']:.3f}x device"
    if r["captured"]:
        text += "  (one graph)"
    if r["steps_with_wrong_rows"]:
        text += f"  WRONG ROWS in {r['steps_with_wrong_rows']} steps"
    return text


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log = (lambda m: print(m, file=sys.stderr)) if a.json else print
    ref = plestore.open_table(a.table, tier="device", device=device)
    rows = []
    for spec in a.tiers.split(","):
        table, capture = _open(a.table, spec, device)
        batches = list(map(int, a.batches.split(",")))
        lookup = PleLayerLookup(table, table.spec.heads, max(batches), capture=capture)
        for batch in batches:
            timed = run_step(lookup, ref, batch, a.steps, a.hidden, a.layers, a.id_sets)
            rows.append({"tier": spec, "batch": batch, **timed})
        lookup.close()
    for r in rows:  # beside the device tier's step at the same batch
        base = next((b for b in rows if b["tier"] == "device" and b["batch"] == r["batch"]), None)
        r["vs_device"] = r["step_us"] / base["step_us"] if base else None
        log(_line(r))
    ref.close()
    result = {"machine": machine(), "table": a.table, "rows": rows}
    if a.csv:
        append_csv(a.csv, [{"bench": "vllm", **r} for r in rows], result["machine"])
    if a.json:
        print(json.dumps(result, indent=1))
    return 1 if any(r["steps_with_wrong_rows"] for r in rows) else 0
