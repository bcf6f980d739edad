"""plestore's counters in vLLM's /metrics: vLLM's OpenAI server (`python -m
vllm.entrypoints.openai.api_server`, vLLM's CPU build: the API server in one process, the engine
core holding the tables in another) with the plugin; after N requests on loopback, /metrics
shows `plestore_` counters per table that grew by exactly what those requests looked up."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="the vLLM job's venv has vLLM (.ci/vllm); this one has not")

from process_sessions import end_session  # noqa: E402
from vllm_models import PROMPTS  # noqa: E402

START_TIMEOUT_S = 240
NEW_TOKENS = 8
HEADS = 4  # the tiny model's n-gram heads a token: (ngram_size - 1) * heads_per_ngram


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _counters(text: str, family: str) -> dict[str, float]:
    """{table: value} of `family` (summed over phases) in a /metrics page."""
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^{family}\{{([^}}]*)\}} (\S+)$", text, re.M):
        table = dict(re.findall(r'(\w+)="([^"]*)"', labels))["table"]
        out[table] = out.get(table, 0.0) + float(value)
    return out


@pytest.fixture
def server(tmp_path):
    """The OpenAI server on a free loopback port, in a session of its own (ended, and checked
    empty, after the test): its base URL."""
    from vllm_models import save_qwen

    model = save_qwen(tmp_path / "qwen")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = {"tier": "direct", "table_dir": str(tmp_path / "tables")}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init"]
    cmd += ["--dtype", "bfloat16", "--max-model-len", "512", "--max-num-batched-tokens", "64"]
    cmd += ["--max-num-seqs", "4", "--enforce-eager", "--additional-config"]
    cmd += [json.dumps({"plestore": conf})]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115 (read after the server ends)
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, _tail(log)
            assert time.time() < deadline, f"no server in {START_TIMEOUT_S} s:\n{_tail(log)}"
            try:
                _get(f"{url}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        yield url, str(model), log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = end_session(proc.pid)
        log.close()
        assert not left, f"the server left processes {left} behind"


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-6000:]


def _settled(url: str, family: str) -> dict[str, float]:
    """The family's values once the engine process has published what it counted (it
    publishes once a second): two readings a publishing period apart that agree."""
    from plestore.integrations.metrics import PUBLISH_EVERY_S

    last = None
    for _ in range(15):
        now = _counters(_get(f"{url}/metrics"), family)
        if now == last:
            return now
        last = now
        time.sleep(PUBLISH_EVERY_S * 1.2)
    raise AssertionError(f"{family} never settled: {last}")


def test_metrics_show_what_the_requests_read(server):
    url, model, log = server
    tables = ("ple.layers.0", "ple.layers.1")
    before = _settled(url, "plestore_rows_total")  # (whatever the engine's warm-up looked up)
    reads0 = _settled(url, "plestore_bytes_read_total")
    for prompt in PROMPTS:  # one after another: each request's tokens, counted once
        body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        out = _post(f"{url}/v1/completions", {**body, "ignore_eos": True})
        assert out["usage"]["completion_tokens"] == NEW_TOKENS, out
    after = _settled(url, "plestore_rows_total")
    # every token the engine ran (the prompt, then each generated one but the last) looks up
    # HEADS ids in each layer's table
    tokens = sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)
    grew = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in after}
    assert grew == dict.fromkeys(tables, HEADS * tokens), _tail(log)
    reads = _settled(url, "plestore_bytes_read_total")
    assert all(reads[t] > reads0.get(t, 0.0) for t in tables), (reads0, reads)  # direct reads
    page = _get(f"{url}/metrics")
    for family in ("plestore_calls_total", "plestore_host_gather_seconds_total"):
        found = re.findall(rf"^{family}\{{([^}}]*)\}}", page, re.M)
        # "graph": the steps the table's graph feed served (on the CPU build too, up to
        # FEED_MAX_TOKENS a step); "step": the plugin's eager lookups
        labels = {f'phase="{p}",table="ple.layers.1",tier="direct"' for p in ("graph", "step")}
        assert labels & set(found), page[-3000:]
    assert "vllm:" in page  # vLLM's own metrics still there


_WORKER = """
import sys, torch
from plestore.integrations.metrics import publish
from plestore.lookup import Table
from plestore.options import TableOptions
from plestore.tablefile import TableFile

table = Table(TableFile.open(sys.argv[1]), TableOptions(tier="mapped", device="cpu"))
publish(table)
for n in map(int, sys.argv[2:]):
    table.lookup(torch.arange(n)[:, None])
"""


def test_several_processes_are_summed_by_vllms_multiprocess_collection(small_checkpoint, tmp_path):
    """Where vLLM runs several API servers it sets PROMETHEUS_MULTIPROC_DIR and serves
    prometheus_client's multiprocess collection: each process's counters are summed there."""
    from prometheus_client import CollectorRegistry, multiprocess

    from plestore.integrations.tables import prepare_table

    meta, _ = prepare_table(
        small_checkpoint("qwen3.8-flash-next", "bf16"), tmp_path, "ple.layers.1"
    )
    (tmp_path / "prom").mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    for lookups in (["5", "7"], ["11"]):  # two processes, three lookups
        cmd = [sys.executable, "-c", _WORKER, str(meta), *lookups]
        subprocess.run(cmd, env=env, check=True, timeout=120)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path / "prom"))
    rows = calls = 0.0
    for family in registry.collect():
        for s in family.samples:
            assert s.labels.get("table") == "ple.layers.1" and s.labels["tier"] == "mapped"
            rows += s.value if s.name == "plestore_rows_total" else 0
            calls += s.value if s.name == "plestore_calls_total" else 0
    assert (rows, calls) == (23, 3)
