"""plestore's counters at SGLang's /metrics: with --enable-metrics SGLang runs
prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR set before its schedulers
start) and serves /metrics from its own `add_prometheus_middleware`; a scheduler process that
serves a table (here: a process opening one as the plugin does, looking rows up, exiting)
publishes its counters there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from .conftest import QWEN

WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    from plestore.integrations.serving import open_served
    from plestore.options import TableOptions
    from plestore.tablefile import TableFile

    spec = TableFile.open(sys.argv[1]).spec
    table = open_served(sys.argv[1], TableOptions.from_env(tier="mapped"), spec.rows, spec.dim, "t")
    table.lookup(np.arange(48, dtype=np.int64).reshape(3, 16), label="step")
""")


def test_a_schedulers_table_counters_reach_sglangs_metrics(small_checkpoint, tmp_path, monkeypatch):
    from fastapi import FastAPI
    from sglang.srt.utils.common import add_prometheus_middleware
    from starlette.testclient import TestClient

    from plestore.integrations.tables import ple_table_name, prepare_table

    meta, _ = prepare_table(small_checkpoint(QWEN, "bf16"), tmp_path / "t", ple_table_name(1))
    prom = tmp_path / "prometheus"
    prom.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(meta)], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    app = FastAPI()
    add_prometheus_middleware(app)  # (SGLang's /metrics)
    text = TestClient(app).get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("plestore_rows_total{"))
    assert 'table="ple.layers.1"' in line and 'tier="mapped"' in line, line
    assert float(line.rsplit(" ", 1)[1]) == 48.0, line
