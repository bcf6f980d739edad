"""The reference decoder: token-identical greedy generation (and equal logits) on every tier and
format, the PLE lookup prefetched before layer 0; clear errors for mismatched parts."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from ple_decoder import small_decoder as _decoder

import plestore
from conftest import devices, requires_cuda
from plestore.checkpoint import Checkpoint
from plestore.hashing import Qwen4ExpHash
from plestore.models import DecoderConfig, ReferenceDecoder, load_ple_weights
from plestore.tablefile.pack import pack_checkpoint

TIERS = ["device", "pinned", "mapped", "direct"]


@pytest.fixture(scope="module", params=["bf16", "fp8_e4m3", "nvfp4"])
def packed(request, small_checkpoint, tmp_path_factory):
    ckpt = small_checkpoint("qwen3.8-flash-next", request.param)
    out = tmp_path_factory.mktemp(f"tables-{request.param}")
    pack_checkpoint(ckpt, out)
    return ckpt, out


@pytest.mark.parametrize("device", devices())
def test_every_tier_generates_what_the_resident_table_does(packed, device):
    ckpt, tables = packed
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 248320, n).tolist() for n in (21, 5, 40)]
    results = {}
    for tier in TIERS:
        with plestore.open_table(tables, tier=tier, device=device) as table:
            model = _decoder(ckpt, table, device)
            results[tier] = model.generate(prompts, 8, chunk_size=16, keep_logits=True)
            phases = table.stats()["phases"]
            assert phases["prefill"]["rows"] == 66 * 16 and phases["decode"]["calls"] == 7
    ref = results["device"]
    assert all(len(t) == 8 for t in ref.tokens)
    for tier, res in results.items():
        assert res.tokens == ref.tokens, tier
        for a, b in zip(res.logits, ref.logits, strict=True):
            assert torch.equal(a, b), tier


def _eager_steps(model, prompts, steps: int, forced: np.ndarray | None = None):
    """(greedy tokens per request, logits per step) of plain eager steps, hashed and looked up
    from the host: the prompts, then each step's greedy tokens (or forced[:, k]) fed back."""
    slots = np.array([model.pool.allocate() for _ in prompts], np.int64)
    model.kv.lengths[slots] = 0
    qsl = np.concatenate([[0], np.cumsum([len(p) for p in prompts])])
    tokens = np.concatenate([np.array(p, np.int64) for p in prompts])
    want, logits = [[] for _ in prompts], []
    for k in range(steps):
        logits.append(model.step(slots, tokens, qsl, "prefill" if k == 0 else "decode").cpu())
        greedy = logits[-1].argmax(-1).numpy()
        for i, t in enumerate(greedy.tolist()):
            want[i].append(t)
        tokens = greedy if forced is None or k == steps - 1 else forced[:, k]
        qsl = np.arange(len(prompts) + 1)
    return want, logits


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("tier", TIERS)
def test_decode_runner_equals_eager_steps(packed, device, graphs, tier):
    """generate()'s decode loop (static buffers; tokens fed back, hashed and the rows decoded on
    the device; a host tier stages them; CUDA graphs when `graphs` on a GPU) gives the tokens
    and logits of plain eager steps hashed and looked up from the host."""
    ckpt, tables = packed
    if device == "cpu" and graphs:
        pytest.skip("no CUDA graphs on CPU (the runner steps eagerly; the other case covers it)")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 248320, n).tolist() for n in (13, 30, 7)]
    with plestore.open_table(tables, tier=tier, device=device) as table:
        model = _decoder(ckpt, table, device, cuda_graphs=graphs)
        got = model.generate(prompts, 6, chunk_size=64, keep_logits=True)
        assert set(got.exposed_s) == {"prefill", "decode"}
        assert all(v >= 0 for v in got.exposed_s.values())
        assert set(got.host_s) == set(got.window_s) == {"prefill", "decode"}
        assert got.host_s["decode"] > 0 and (got.window_s["decode"] > 0) == (device != "cpu")
        assert [p for p, _, _ in got.step_times] == ["prefill"] + ["decode"] * 5
        assert table.stats()["phases"]["decode"]["calls"] == 5
        want, logits = _eager_steps(model, prompts, 6)
    assert got.tokens == want
    for a, b in zip(got.logits, logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("tier", ["device", "mapped"])
def test_forced_decode_reads_the_given_tokens(packed, device, graphs, tier):
    """generate(forced=...): decode step s reads forced[:, s] (its n-grams hashed, its rows
    looked up) instead of the greedy token; tokens and logits are those of eager steps fed
    the same inputs, and differ from greedy generation's."""
    ckpt, tables = packed
    if device == "cpu" and graphs:
        pytest.skip("no CUDA graphs on CPU (the runner steps eagerly; the other case covers it)")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 248320, n).tolist() for n in (11, 24)]
    forced = rng.integers(0, 248320, (2, 5))
    with plestore.open_table(tables, tier=tier, device=device) as table:
        model = _decoder(ckpt, table, device, cuda_graphs=graphs)
        greedy = model.generate(prompts, 6, chunk_size=64)
        for _ in range(2):  # (on a GPU the second replays what the first captured)
            got = model.generate(
                prompts, 6, chunk_size=64, keep_logits=True, forced=forced.tolist()
            )
        again = model.generate(prompts, 6, chunk_size=64)  # forcing does not stick
        want, logits = _eager_steps(model, prompts, 6, forced)
    assert got.tokens == want and again.tokens == greedy.tokens
    assert got.tokens != greedy.tokens
    for a, b in zip(got.logits, logits, strict=True):
        assert torch.equal(a, b)


def test_forced_tokens_are_checked(packed):
    ckpt, tables = packed
    with plestore.open_table(tables, device="cpu") as table:
        model = _decoder(ckpt, table, "cpu")
        for bad, match in [
            ([[1, 2, 3]], "forced has 1 requests, prompts 2"),
            ([[1, 2], [3]], "at least 2 tokens"),
            ([[1, 2], [3, 248320]], "forced tokens must be in"),
            ([[1, 2], [-1, 0]], "forced tokens must be in"),
        ]:
            with pytest.raises(ValueError, match=match):
                model.generate([[5, 6], [7]], 3, forced=bad)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tier", ["device", "direct"])
def test_captured_prefill_and_decode_equal_eager(packed, tier):
    """Uniform prefill chunks (a repeating shape: captured) and decode replay CUDA graphs; tokens
    and logits equal the same generation with every step launched eagerly."""
    ckpt, tables = packed
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 248320, 32).tolist() for _ in range(3)]
    out = {}
    with plestore.open_table(tables, tier=tier, device="cuda") as table:
        for graphs in (True, False):
            model = _decoder(ckpt, table, "cuda", cuda_graphs=graphs)
            for _ in range(2):  # the second run replays what the first captured
                out[graphs] = model.generate(prompts, 5, chunk_size=8, keep_logits=True)
            captured = [k for k, r in model._runners.items() if r.captured]
            want = [(3, 3, 1, True, table), (3, 24, 8, False, None)]
            assert sorted(captured) == (want if graphs else [])
    assert out[True].tokens == out[False].tokens
    for a, b in zip(out[True].logits, out[False].logits, strict=True):
        assert torch.equal(a, b)


def test_runner_buffers_hold_what_an_eager_step_builds(packed):
    from plestore.models.attention import StepInputs
    from plestore.models.graphs import StepRunner

    ckpt, tables = packed
    with plestore.open_table(tables, device="cpu") as table:
        model = _decoder(ckpt, table, "cpu")
        slots, qsl = np.array([2, 0, 3]), np.array([0, 4, 5, 9])
        tokens, past = np.arange(9) * 7, np.array([5, 0, 11])
        runner = StepRunner(model, 3, 9, 4)
        runner.load(slots, tokens, qsl, past)
        want = StepInputs.from_host(slots, tokens, qsl, past, "cpu")
        for name in ("tok", "slot", "past", "req", "col", "qsl", "last"):
            assert torch.equal(getattr(runner.inp, name), getattr(want, name)), name
        assert runner.inp.lq == want.lq == 4
        with pytest.raises(ValueError, match="shape"):
            runner.load(slots, tokens[:8], np.array([0, 4, 5, 8]), past)
        with pytest.raises(ValueError, match="shape"):  # as many values, other R and T
            runner.load(slots[:2], np.arange(10), np.array([0, 4, 10]), past[:2])


def test_lookup_is_started_before_layer_zero(packed, monkeypatch):
    """The step prefetches the rows before the first block runs and waits at the PLE layer."""
    ckpt, tables = packed
    events = []
    with plestore.open_table(tables, tier="mapped", device="cpu") as table:
        model = _decoder(ckpt, table, "cpu")
        orig_prefetch, orig_block = table.prefetch, type(model.blocks[0]).forward

        def prefetch(*a, **k):
            events.append("prefetch")
            return orig_prefetch(*a, **k)

        def block(self, bank, kv, layer, *a):
            events.append(f"layer{layer}")
            return orig_block(self, bank, kv, layer, *a)

        monkeypatch.setattr(table, "prefetch", prefetch)
        monkeypatch.setattr(type(model.blocks[0]), "forward", block)
        model.generate([[1, 2, 3]], 1)
    assert events[:3] == ["prefetch", "layer0", "layer1"]


def test_next_prefill_chunk_is_looked_up_a_step_ahead_with_the_right_rows(packed, monkeypatch):
    """Chunked prefill starts chunk k+1's lookup once step k is queued (its tokens are known);
    the rows it asks for must be those of hashing each whole prompt at once — the n-gram context
    carried across the chunk boundary — and each step asks once."""
    ckpt, tables = packed
    rng = np.random.default_rng(3)
    lengths = (37, 9, 20)
    prompts = [rng.integers(0, 248320, n).tolist() for n in lengths]
    asked, events = [], []
    with plestore.open_table(tables, tier="mapped", device="cpu") as table:
        model = _decoder(ckpt, table, "cpu")
        orig_prefetch, orig_block = table.prefetch, type(model.blocks[0]).forward

        def prefetch(ids, label="lookup", **k):
            asked.append((label, np.array(ids)))
            events.append("prefetch")
            return orig_prefetch(ids, label=label, **k)

        def block(self, bank, kv, layer, *a):
            events.append(f"layer{layer}")
            return orig_block(self, bank, kv, layer, *a)

        monkeypatch.setattr(table, "prefetch", prefetch)
        monkeypatch.setattr(type(model.blocks[0]), "forward", block)
        model.generate(prompts, 1, chunk_size=16)
    layers = model.cfg.num_layers  # step 2's lookup right after step 1's layers, before its own
    assert events[: layers + 3] == ["prefetch"] + [f"layer{i}" for i in range(layers)] + [
        "prefetch",
        "layer0",
    ]
    steps = [ids for label, ids in asked if label == "prefill"]
    chunks = [[16, 9, 16], [16, 4], [5]]  # tokens per live request in each step
    live = [[0, 1, 2], [0, 2], [0]]
    assert [len(ids) for ids in steps] == [sum(c) for c in chunks]  # one lookup per step
    got = [[] for _ in prompts]
    for ids, reqs, counts in zip(steps, live, chunks, strict=True):
        for i, rows in zip(reqs, np.split(ids, np.cumsum(counts)[:-1]), strict=True):
            got[i].append(rows)
    fresh = np.full((1, model.hash.spec.ngram_size - 1), model.cfg.eos_token_id, np.int64)
    for i, p in enumerate(prompts):
        qsl = np.array([0, len(p)], np.int64)
        want, _ = model.hash.row_ids(np.array(p, np.int64), qsl, fresh)
        np.testing.assert_array_equal(np.concatenate(got[i]), want)


def test_mismatched_parts_are_refused(packed, small_checkpoint, tmp_path):
    ckpt, tables = packed
    other = small_checkpoint("qwen3.8-flash-next", "bf16", ngram_vocab_size_base=2000)
    with plestore.open_table(tables, device="cpu") as table:
        ngram = Qwen4ExpHash.from_hf_config(Checkpoint.open(other).config)
        cfg = DecoderConfig(vocab_size=248320, eos_token_id=248044, hidden_size=64)
        with pytest.raises(ValueError, match="does not match the PLE hash"):
            ReferenceDecoder(cfg, table, ngram)
        ngram = Qwen4ExpHash.from_hf_config(Checkpoint.open(ckpt).config)
        with pytest.raises(ValueError, match="decoder vocab 1000 != hash vocab 248320"):
            ReferenceDecoder(
                DecoderConfig(vocab_size=1000, eos_token_id=2, hidden_size=64), table, ngram
            )
        weights, prefix = load_ple_weights(Checkpoint.open(ckpt), 1)
        with pytest.raises(ValueError, match="key_proj"):
            ReferenceDecoder(
                DecoderConfig(vocab_size=248320, eos_token_id=248044, hidden_size=32),
                table,
                ngram,
                weights,
                prefix,
            )
        with pytest.raises(ValueError, match="no PLE weights under"):
            load_ple_weights(Checkpoint.open(ckpt), 5)
        model = ReferenceDecoder(cfg, table, ngram, weights, prefix)
        with pytest.raises(ValueError, match="non-empty prompt"):
            model.generate([[]], 2)


def test_demo_runs_every_tier_and_is_exact(tmp_path):
    from plestore.models.demo import run_demo

    small = dict(
        num_prompts=2,
        decode_tokens=4,
        hidden_size=64,
        device="cpu",
        ngram_vocab_size_base=1000,
        log=lambda *a: None,
    )
    res = run_demo(tmp_path, "nvfp4", **small)
    assert [r["tier"] for r in res["rows"]] == ["device", "pinned", "mapped", "direct"]
    assert all(r["exact"] for r in res["rows"]), res["rows"]
    again = run_demo(tmp_path, "nvfp4", tiers=("device",), **small)
    assert again["pack_reused"]


@pytest.mark.parametrize("as_json", [True, False])
def test_demo_cli(tmp_path, capsys, as_json):
    import json

    from plestore.cli import main

    rc = main(
        [
            "demo",
            "--dir",
            str(tmp_path),
            "--tiers",
            "device,pinned",
            "--prompts",
            "1",
            "--decode-tokens",
            "2",
            "--hidden-size",
            "64",
            "--device",
            "cpu",
            *(["--json"] if as_json else []),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    if as_json:
        assert [r["tier"] for r in json.loads(text)["rows"]] == ["device", "pinned"]
    else:  # the table people read: one line per tier, exact marks, the workload's rows
        lines = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
        rows = {cells[0]: cells for cells in lines if cells and cells[0] in ("device", "pinned")}
        assert set(rows) == {"device", "pinned"}
        assert all(cells[-1] == "✓" for cells in rows.values()), text
        assert rows["pinned"][3:5] == rows["device"][3:5], text


def test_the_demos_distinct_rows_are_those_the_lookups_asked_for(packed, monkeypatch):
    """_distinct_rows hashes the generation again: per step, as many distinct ids as the
    decoder's lookups (prefill prefetches, decode stages) carried."""
    from plestore.lookup.staged import StagedLookup
    from plestore.models.demo import _distinct_rows

    ckpt, tables = packed
    seen = []
    stage = StagedLookup.stage
    monkeypatch.setattr(
        StagedLookup,
        "stage",
        lambda self, ids, **kw: seen.append(ids.copy()) or stage(self, ids, **kw),
    )
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 248320, n).tolist() for n in (37, 5, 70)]
    with plestore.open_table(tables, tier="mapped", device="cpu") as table:
        prefetch = table.prefetch
        table.prefetch = lambda ids, **kw: seen.append(np.array(ids)) or prefetch(ids, **kw)
        model = _decoder(ckpt, table, "cpu")
        res = model.generate(prompts, 6, chunk_size=16)
    assert len(seen) == 5 + 5  # prefill chunks of 16 (70 tokens), decode steps
    want = sum(np.unique(ids).size for ids in seen)
    assert _distinct_rows(model.hash, prompts, res.tokens, chunk=16) == want


def test_the_demo_times_each_tier_after_a_warm_up_and_shows_the_spread(tmp_path):
    import json
    import statistics
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "plestore", "demo", "--dir", str(tmp_path), "--tiers", "device"]
    cmd += ["--prompts", "1", "--decode-tokens", "3", "--hidden-size", "64", "--device", "cpu"]
    cmd += ["--ngram-vocab-size-base", "1000", "--repeats", "3"]
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["rows"]
    for kind in ("prefill", "decode"):
        runs = row[f"{kind}_tok_s_runs"]
        assert len(runs) == 3 and row[f"{kind}_tok_s"] == statistics.median(runs)
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    assert "the median of 3 generations after a warm-up (min-max)" in text
    line = next(x for x in text.splitlines() if x.startswith("device "))
    assert re.search(r"device +[\d,]+ \([\d,]+-[\d,]+\) +[\d.,]+ \([\d.,]+-[\d.,]+\)", line)
