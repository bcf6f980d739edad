"""Identity row ids (Gemma per-layer tables) and the factory every table's hasher comes from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import devices
from plestore.hashing import EngramHash, Hasher, IdentityHash, Qwen4ExpHash, make_hash
from plestore.spec import PRESETS, IdentityHashSpec, preset_config, table_specs_from_hf_config


@pytest.mark.parametrize("device", [None, *devices()])
def test_identity_rows_are_token_ids(device):
    h = IdentityHash(vocab_size=100)
    ids = [[0, 5, 99], [7, 8, 9]]  # any shape, e.g. [B, S]
    x = np.array(ids, dtype=np.int32) if device is None else torch.tensor(ids, device=device)
    got = h.row_ids(x)
    assert got.tolist() == ids and got.dtype in (np.int64, torch.int64)
    rows, state = h.step(x.reshape(-1), [0, 6], h.fresh_state(1))
    assert rows.shape == (6, 1) and state is None
    bad = x.clone() if device else x.copy()
    bad[1, 2] = 100
    msg = (
        r"input_ids\[1, 2\] = 100 is outside the per-layer vocabulary \[0, 100\); use out_of_range="
    )
    with pytest.raises(ValueError, match=msg):
        h.row_ids(bad)
    bad[1, 2] = -3
    with pytest.raises(ValueError, match=r"input_ids\[1, 2\] = -3"):
        h.row_ids(bad)
    assert h.row_ids(bad, check=False).tolist() == [[0, 5, 99], [7, 8, -3]]  # caller vouches
    with pytest.raises(ValueError, match="must hold integers"):
        h.row_ids(np.array([1.0]) if device is None else torch.tensor([1.0], device=device))


def test_out_of_range_zero_matches_transformers_gemma():
    """Gemma3nModel.get_per_layer_inputs: ids outside [0, vocab_size_per_layer_input) -> 0."""
    h = IdentityHash(vocab_size=262144, out_of_range="zero")
    x = torch.tensor([[-1, 0, 262143, 262144, 262200, 17]])
    mask = torch.logical_and(x >= 0, x < 262144)  # transformers' expression
    assert h.row_ids(x).tolist() == torch.where(mask, x, torch.zeros_like(x)).tolist()
    assert h.row_ids(x.numpy()).tolist() == [[0, 0, 262143, 0, 0, 17]]


def test_make_hash_covers_every_preset():
    kinds = {"qwen4exp": Qwen4ExpHash, "engram": EngramHash, "identity": IdentityHash}
    for name in PRESETS:
        for table in table_specs_from_hf_config(preset_config(name)):
            h = make_hash(table.hash)
            assert isinstance(h, Hasher) and isinstance(h, kinds[h.kind])
            assert (h.heads, h.num_rows) == (table.heads, table.rows), name
            assert h.spec == table.hash
    assert make_hash(IdentityHashSpec(10, "zero")).out_of_range == "zero"
    with pytest.raises(ValueError, match="no hasher for dict"):
        make_hash({"kind": "qwen4exp"})


def test_uniform_step_over_every_kind():
    """The engine's view: fresh_state, then step -> ids [T, heads] below num_rows."""
    ids, qsl = np.array([3, 1, 4, 1, 5]), np.array([0, 2, 5])
    specs = [
        table_specs_from_hf_config(preset_config(n))[0].hash
        for n in ("qwen3.8-flash-next", "deepseek-v4.1-flash", "gemma4-e2b")
    ]
    for spec in specs:
        h = make_hash(spec)
        out, state = h.step(ids, qsl, h.fresh_state(2))
        assert out.shape == (5, h.heads) and out.min() >= 0 and out.max() < h.num_rows
        more, _ = h.step(ids[:1], np.array([0, 1, 1]), state)
        assert more.shape == (1, h.heads)
    with pytest.raises(ValueError, match="takes no"):
        make_hash(specs[0]).step(ids, qsl, None, dead_mask=None)
