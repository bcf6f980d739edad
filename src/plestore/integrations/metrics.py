"""plestore's per-table counters in an engine's Prometheus `/metrics`, from every worker process.

SGLang (`--enable-metrics`) always runs prometheus_client's multiprocess mode
(PROMETHEUS_MULTIPROC_DIR set before its scheduler processes start): the first case below.
vLLM's tables live in its engine-core / worker processes; `/metrics` is served by the API server
process from its own registry. vLLM collects other processes' metrics only where it runs several
API servers (it then sets PROMETHEUS_MULTIPROC_DIR, and every registry is prometheus_client's
multiprocess collection). So, per process:

- a worker that serves tables publishes each table's counters (`Table.metrics`: calls, rows,
  absent ids, cache and GPU-cache hits, bytes read, read / H2D / decode / wait (exposed) /
  total seconds, per phase) once a second and at exit:
    PROMETHEUS_MULTIPROC_DIR set: as prometheus_client counters (their values in that directory,
        summed over processes by the engine's multiprocess collection);
    otherwise: as a snapshot file `<pid>.json` in DIR_ENV, a directory the first process that
        loads the plugin makes (and removes at exit) and its child processes inherit;
- every process registers a collector on prometheus_client's default registry that sums those
  files over processes: the API server's `/metrics` shows them.

Names: `plestore_<counter>_total` and `plestore_<timer>_seconds_total` (those of
`Metrics.prometheus`), labels `table` (the table's name, e.g. `ple.layers.1`), `tier`, `phase`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

__all__ = ["DIR_ENV", "PUBLISH_EVERY_S", "install_collector", "publish", "samples"]

#: the directory of the snapshot files an API server and its engine processes share
DIR_ENV = "PLESTORE_VLLM_METRICS_DIR"
PUBLISH_EVERY_S = 1.0
_LABELS = ("table", "tier", "phase")
_lock = threading.Lock()
_write_lock = threading.Lock()  # (the thread and the exit's last write, one at a time)
_tables: list = []  # the tables this process publishes
_publisher: threading.Thread | None = None
_collector_installed = False


def _metric(key: str) -> str:
    """A Metrics counter / timer name -> its Prometheus family name (without `_total`)."""
    return f"plestore_{key.removesuffix('_s')}_seconds" if key.endswith("_s") else f"plestore_{key}"


def samples(tables) -> dict[tuple[str, str, str, str], float]:
    """{(family, table, tier, phase): value} of the tables' counters now."""
    out: dict[tuple[str, str, str, str], float] = defaultdict(float)
    for table in tables:
        snap = table.metrics.snapshot()
        for phase, values in snap["phases"].items():
            for key, value in values.items():
                if key != "gpu_cache_hit_rate":  # (a ratio, not a counter)
                    out[(_metric(key), snap["table"], snap["tier"], phase)] += value
    return dict(out)


def install_collector() -> None:
    """The collector of every process's snapshot files, on prometheus_client's default
    registry (the one an API server's /metrics serves); the directory made where none is
    inherited. Idempotent."""
    global _collector_installed
    with _lock:
        if _collector_installed:
            return
        _collector_installed = True
        if not os.environ.get(DIR_ENV):
            made = tempfile.mkdtemp(prefix="plestore-vllm-metrics-")
            os.environ[DIR_ENV] = made  # (inherited by the engine processes started later)
            atexit.register(shutil.rmtree, made, True)
        from prometheus_client import REGISTRY

        REGISTRY.register(_FileCollector(Path(os.environ[DIR_ENV])))


class _FileCollector:
    """Sums the snapshot files of every process (a dead one's counts stay, as counters do)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        totals: dict[tuple, float] = defaultdict(float)
        for path in sorted(self.directory.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):  # (replaced while read: next scrape)
                for family, table, tier, phase, value in json.loads(path.read_text()):
                    totals[(family, table, tier, phase)] += value
        families: dict[str, CounterMetricFamily] = {}
        for (family, *labels), value in sorted(totals.items()):
            if family not in families:
                families[family] = CounterMetricFamily(
                    family, f"plestore {family.removeprefix('plestore_')}", labels=_LABELS
                )
            families[family].add_metric(labels, value)
        yield from families.values()


def publish(table) -> None:
    """Publish `table`'s counters from this process from now on (a thread, once a second, and
    at exit)."""
    global _publisher
    with _lock:
        _tables.append(table)
        if _publisher is not None:
            return
        sink = _PrometheusSink() if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else _FileSink()
        _publisher = threading.Thread(
            target=_publish_loop, args=(sink,), name="plestore-metrics", daemon=True
        )
        _publisher.start()
        atexit.register(_publish_once, sink)  # (after the tables' close: atexit runs LIFO)


def _publish_loop(sink) -> None:
    while True:
        time.sleep(PUBLISH_EVERY_S)
        with contextlib.suppress(Exception):  # (a closed table mid-snapshot: next round)
            _publish_once(sink)


def _publish_once(sink) -> None:
    with _lock:
        tables = list(_tables)
    with _write_lock:
        sink.write(samples(tables))


class _FileSink:
    """This process's counters as `<pid>.json` in DIR_ENV, replaced atomically."""

    def write(self, values: dict) -> None:
        directory = os.environ.get(DIR_ENV)
        if not directory or not os.path.isdir(directory):
            return
        path = Path(directory) / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([[*key, value] for key, value in values.items()]))
        os.replace(tmp, path)


class _PrometheusSink:
    """This process's counters as prometheus_client counters (multiprocess mode: their values
    in PROMETHEUS_MULTIPROC_DIR), raised by what grew since the last write."""

    def __init__(self) -> None:
        self.counters: dict = {}
        self.last: dict = {}

    def write(self, values: dict) -> None:
        from prometheus_client import Counter

        for key, value in values.items():
            family, *labels = key
            if family not in self.counters:
                self.counters[family] = Counter(
                    family, f"plestore {family.removeprefix('plestore_')}", _LABELS
                )
            grew = value - self.last.get(key, 0.0)
            if grew > 0:
                self.counters[family].labels(*labels).inc(grew)
            self.last[key] = value
