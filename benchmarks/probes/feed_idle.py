"""A host-fed captured step after a quiet spell vs in a stream of steps, and the host thread's
CPU while idle (graphfeed SPIN_S, SLEEP_S, SLEEP_MAX_S).

    python benchmarks/probes/feed_idle.py TABLE.json"""

import argparse
import json
import statistics
import time

import torch

import plestore
from plestore.lookup.graphfeed import SLEEP_MAX_S, SLEEP_S, SPIN_S


def main(path: str) -> None:
    out = {"spin_s": SPIN_S, "sleep_s": SLEEP_S, "sleep_max_s": SLEEP_MAX_S}
    for tier in ("mapped", "direct"):
        with plestore.open_table(path, tier=tier, device="cuda", timeout_s=3) as t:
            ids = torch.randint(0, t.spec.rows, (1, t.spec.heads), device="cuda")
            feed = t.staged(tuple(ids.shape), ids=ids, feed=True)
            feed.post(), feed.decode()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                feed.post()
                feed.decode()

            def step(g=g) -> float:
                t0 = time.perf_counter()
                g.replay()
                torch.cuda.synchronize()
                return 1e6 * (time.perf_counter() - t0)

            busy = [step() for _ in range(300)][50:]
            idle = []
            for _ in range(20):
                time.sleep(0.3)
                idle.append(step())
            c0, w0 = time.process_time(), time.monotonic()
            time.sleep(2.0)  # idle: the process's CPU (the feeder's polls) over 2 s
            cpu = (time.process_time() - c0) / (time.monotonic() - w0)
            t.check_feed()
            out[tier] = {
                "host_path": feed.feeder.host_path,
                "step_us_streaming": statistics.median(busy),
                "step_us_after_idle": statistics.median(idle),
                "step_us_after_idle_max": max(idle),
                "idle_cpu_cores": cpu,
            }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("table", help="a packed table (its .json)")
    main(p.parse_args().table)
