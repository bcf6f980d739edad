"""Token streams from text files (the code path that tokenizes the real corpora, here on a tiny
text and a tokenizer trained by the test), the traffic built from them, `plestore profile`
writing a table's hot rows for its GPU cache, and the hit-rate simulation."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import plestore
from conftest import assert_bit_identical
from plestore.bench import hitrate
from plestore.bench.text import build_stream, read_documents
from plestore.cli import main
from plestore.formats import get_format
from plestore.hashing import Qwen4ExpHash
from plestore.lookup.profile import TokenStream
from plestore.spec import Qwen4ExpHashSpec, RowLayout, TableSpec
from plestore.tablefile import TableWriter

EN = "The quick brown fox jumps over the lazy dog. " * 40 + "A table of rows serves text. " * 30
DE = "Der schnelle braune Fuchs springt über den faulen Hund. " * 30


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("text")
    (d / "en.txt").write_text(EN)
    (d / "page.html").write_text(f"<html><style>x{{}}</style><p>{DE}</p><script>no</script>")
    with gzip.open(d / "de.txt.gz", "wt") as f:
        f.write(DE + EN[:400])
    (d / "cookies").write_text("one cookie\n%\ntwo cookies\n%\nthree\n%\nfour\n")
    (d / "cookies.u8").write_text("one cookie\n%\ntwo cookies\n%\nthree\n%\nfour\n")  # a twin
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([EN, DE], trainers.BpeTrainer(vocab_size=400, show_progress=False))
    tok.save(str(d.parent / "tokenizer.json"))  # beside the text, not among it
    return d


def test_text_files_become_a_token_stream(corpus, tmp_path):
    docs = dict(read_documents([corpus]))
    assert set(map(str, docs)) == {
        str(corpus / n) for n in ("en.txt", "page.html", "de.txt.gz", "cookies")
    }
    html = docs[str(corpus / "page.html")]
    assert "Fuchs" in html and "no" not in html.split() and "x{}" not in html
    assert "%" not in docs[str(corpus / "cookies")]
    out = tmp_path / "s"
    assert (
        main(["text", str(out), str(corpus), "--tokenizer", str(corpus.parent / "tokenizer.json")])
        == 0
    )
    meta = json.loads(out.with_suffix(".json").read_text())
    s = TokenStream.load(out)
    assert s.documents == 4 == meta["documents"] and s.ids.dtype == np.uint16
    assert s.ids.size == meta["tokens"] and int(s.ids.max()) < meta["tokenizer"]["vocab_size"]
    tok = Tokenizer.from_file(str(corpus.parent / "tokenizer.json"))
    i = [d["path"] for d in meta["docs"]].index(str(corpus / "en.txt"))
    assert tok.decode(s.doc(i).tolist()).strip() == EN.strip()
    capped = build_stream(tmp_path / "c", [corpus], corpus.parent / "tokenizer.json", max_tokens=50)
    assert capped["tokens"] == 50
    with pytest.raises(ValueError, match="does not exist"):
        build_stream(tmp_path / "x", [corpus / "nope"], corpus.parent / "tokenizer.json")


def test_traffic_carries_each_requests_context(corpus, tmp_path):
    build_stream(tmp_path / "s", [corpus], corpus.parent / "tokenizer.json")
    s = TokenStream.load(tmp_path / "s")
    h = Qwen4ExpHash(248_320, 248_044, ngram_vocab_size_base=1000)
    whole = s.row_ids(h)  # [N, 16]
    chunks = np.concatenate(list(s.prefill_chunks(h, 7)))
    assert np.array_equal(chunks, whole)  # chunked prefill == one pass over each document
    steps = list(s.decode_steps(h, batch=3, steps=40, seed=5))
    assert len(steps) == 40 and steps[0].shape == (3, 16)
    # every decode row is a row of the whole-stream hash (a token with its real predecessors)
    seen = {tuple(r) for r in whole.tolist()}
    assert all(tuple(r) in seen for st in steps for r in st.tolist())
    a, b = s.split(0.5, seed=1)
    assert a.documents + b.documents == s.documents and a.ids.size + b.ids.size == s.ids.size


def _qwen_table(path, base=1000):
    spec_h = Qwen4ExpHashSpec(vocab_size=248_320, eos_token_id=248_044, ngram_vocab_size_base=base)
    fmt = get_format("nvfp4")
    x = np.random.default_rng(0).standard_normal((spec_h.num_rows, 160)).astype(np.float32)
    enc = fmt.encode(x)
    spec = TableSpec(
        name="ple",
        rows=spec_h.num_rows,
        dim=160,
        format="nvfp4",
        scale=enc.scale,
        heads=16,
        hash=spec_h,
    )
    with TableWriter(path, spec, RowLayout(spec.row_bytes, block_bytes=512)) as w:
        w.write_rows(enc.rows)
        w.commit()
    return path, fmt.decode(enc.rows, scale=enc.scale), spec_h


def test_profile_feeds_the_gpu_cache(corpus, tmp_path):
    build_stream(tmp_path / "s", [corpus], corpus.parent / "tokenizer.json")
    path, ref, spec_h = _qwen_table(tmp_path / "t")
    args = ["profile", str(path), "--text", str(tmp_path / "s"), "--json"]
    assert main([*args, "--min-count", "2"]) == 0
    twice = np.load(next(path.glob("*.hot.npy")))
    assert main(args) == 0  # every row read: those read once after the rest
    hot = np.load(next(path.glob("*.hot.npy")))
    assert hot.shape[0] == 2 and (np.diff(hot[1]) <= 0).all() and hot[1, -1] == 1
    assert twice[1].min() >= 2 and (hot[:, : twice.shape[1]] == twice).all()
    s = TokenStream.load(tmp_path / "s")
    ids = s.row_ids(Qwen4ExpHash.from_spec(spec_h))[:64]
    with plestore.open_table(path, tier="direct", device="cpu", gpu_cache_bytes=1 << 20) as t:
        d = t.gpu_cache.directory
        assert d.static_rows > 0.9 * min(hot.shape[1], (1 << 20) // 90 // 2)
        assert_bit_identical(t.lookup(ids), ref[ids.reshape(-1)].reshape(64, -1))
        assert t.stats()["phases"]["lookup"]["gpu_cache_hit_rate"] > 0.5  # the text's own rows


def test_profile_split_leaves_the_e2e_prompts_unseen(corpus, tmp_path, capsys):
    """`profile --split F` counts only the documents of one side of the stream's seeded split;
    `bench e2e --text-split F` takes its prompts from the other side."""
    from plestore.bench.e2e import text_prompts

    build_stream(tmp_path / "s", [corpus], corpus.parent / "tokenizer.json")
    path, _, spec_h = _qwen_table(tmp_path / "t")
    s = TokenStream.load(tmp_path / "s")
    seen, unseen = s.split(0.5)
    argv = ["profile", str(path), "--text", str(tmp_path / "s"), "--split", "0.5", "--json"]
    assert main(argv) == 0
    meta = json.loads(next(path.glob("*.hot.json")).read_text())
    assert meta["source"]["split"] == 0.5 and meta["source"]["tokens"] == seen.ids.size
    hasher = Qwen4ExpHash.from_spec(spec_h)
    want = np.unique(seen.row_ids(hasher), return_counts=True)
    hot = np.load(next(path.glob("*.hot.npy")))
    assert set(hot[0].tolist()) == set(want[0].tolist())  # every row the seen side read
    docs = [unseen.doc(d).tolist() for d in range(unseen.documents)]
    for prompt in text_prompts(str(tmp_path / "s"), 3, 8, spec_h.vocab_size, held_out=0.5):
        assert any(_within(prompt, d) for d in docs)  # an unseen document's tokens
    assert main(["profile", str(path), "--text", str(tmp_path / "s"), "--split", "1.5"]) != 0
    assert "--split must be a share" in capsys.readouterr().err
    e2e = ["bench", "e2e", str(path), "--device", "cpu", "--text-split", "0.5"]
    assert main(e2e) != 0  # (no --text)
    assert "--text-split takes a share" in capsys.readouterr().err


def _within(part: list[int], whole: list[int]) -> bool:
    return any(whole[i : i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def test_hitrate_simulation_runs_and_orders(corpus, tmp_path, capsys):
    build_stream(tmp_path / "s", [corpus], corpus.parent / "tokenizer.json")
    argv = ["--text", str(tmp_path / "s"), "--zipf", "--zipf-tokens", "4000", "--sizes", "0,0.01"]
    argv += ["--prefill-tokens", "600", "--chunk", "100", "--decode-steps", "30", "--batch", "4"]
    argv += ["--ngram-vocab-size-base", "1000", "--json", "--plot", str(tmp_path / "p.png")]
    assert hitrate.main(argv) == 0
    rs = json.loads(capsys.readouterr().out)
    assert {r["stream"] for r in rs} == {"s", "zipf1.1"} and (tmp_path / "p.png").exists()
    for r in rs:
        assert 0 <= r["hit_rate"] <= 1 and 0 <= r["unique_hit_rate"] <= 1
        if r["cache_gib"] == 0:
            assert r["hit_rate"] == 0
    big = [r for r in rs if r["cache_gib"] > 0 and r["stream"] == "s" and r["phase"] == "decode"]
    assert all(r["hit_rate"] > 0.5 for r in big)  # the repetitive text fits a 10 MiB cache


def test_bench_e2e_with_text_prompts_and_gpu_caches(corpus, tmp_path, capsys, monkeypatch):
    from plestore.bench.e2e import text_prompts
    from plestore.lookup.staged import StagedLookup

    build_stream(tmp_path / "s", [corpus], corpus.parent / "tokenizer.json")
    path, _, spec_h = _qwen_table(tmp_path / "t")
    staged, stage = [], StagedLookup.stage

    def spy(self, row_ids, label="decode"):
        if self.context.gpu_cache is None and self.context.tier.name == "direct":
            staged.append(np.array(row_ids))
        return stage(self, row_ids, label)

    monkeypatch.setattr(StagedLookup, "stage", spy)
    assert main(["profile", str(path), "--text", str(tmp_path / "s")]) == 0
    argv = ["bench", "e2e", str(path), "--device", "cpu", "--json", "--csv", ""]
    argv += ["--batches", "2", "--hidden-size", "64", "--layers", "2", "--prompt-tokens", "16"]
    # a label with options of its own (commas inside it), with a cache of its own: not cached again
    tiers = "device,direct,direct:gpu_cache_bytes=131072,gpu_cache_admit_min=1"
    argv += ["--decode-steps", "4", "--tiers", tiers, "--e2e-reps", "1"]
    argv += ["--prefill-chunk", "8", "--gpu-caches", "64K", "--text", str(tmp_path / "s")]
    argv += ["--caches", "warm"]  # (cold through the cache: tests/test_gpucache.py)
    capsys.readouterr()
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["e2e"]
    assert [(r["tier"], r["cache"]) for r in rows] == [
        ("device", "warm"),
        ("direct", "warm"),
        ("direct:gpu_cache_bytes=131072,gpu_cache_admit_min=1", "warm"),
        ("direct:gpu_cache_bytes=65536", "warm"),
    ]
    assert all(r["tokens_equal_resident"] for r in rows)
    cached = [r for r in rows if "gpu_cache_bytes" in r["tier"]]
    assert all(r["gpu_cache_hit_prefill"] > 0 for r in cached)  # the profile's rows, at least
    assert all(r["gpu_cache_hit_decode"] > 0 for r in cached)
    # decode continues each document: step s reads the rows of its token 16 + s
    hasher = Qwen4ExpHash.from_spec(spec_h)
    want = []
    for run in text_prompts(str(tmp_path / "s"), 2, 16 + 4, spec_h.vocab_size):
        ctx = hasher.fresh_context(1)
        ids_of_run, _ = hasher.row_ids(np.array(run), np.array([0, len(run)]), ctx)
        want.append(ids_of_run[16:19])  # [3 decode steps, heads]
    want = np.stack(want, axis=1)  # [steps, R, heads]
    assert len(staged) == 2 * 3  # warm-up and one rep
    for k, ids in enumerate(staged):
        np.testing.assert_array_equal(ids, want[k % 3])
    assert rows[1]["gpu_cache_hit_prefill"] == 0


def test_e2e_decode_continues_each_document():
    from plestore.bench.e2e import _continued

    assert _continued([1, 2, 3, 4, 5, 6], 3, 3) == [4, 5]  # decode steps 0, 1 read these
    assert _continued([1, 2, 3, 4], 3, 4) == [4, 4, 4]  # a document that ends: its last token
    assert _continued([1, 2], 3, 3) == [2, 2]
    assert _continued([1, 2, 3, 4], 3, 1) == []


def test_bench_lookup_text_workload(corpus, tmp_path):
    from plestore.bench.lookup import run_lookup_bench

    build_stream(tmp_path / "s", [corpus], corpus.parent / "tokenizer.json")
    path, _, _ = _qwen_table(tmp_path / "t")
    rows = run_lookup_bench(
        str(path),
        ["plestore-direct:gpu_cache_bytes=1048576"],
        ["decode-b8", "prefill-2048"],
        ["text"],
        torch.device("cpu"),
        {},
        reps=2,
        cold=(),
        log=lambda m: None,
        text=str(tmp_path / "s"),
    )
    assert len(rows) == 2 and all(r.exact for r in rows)
    assert {r.rows for r in rows} == {8 * 16, 2048 * 16}
