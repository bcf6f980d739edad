"""StatePool: allocate/free/gather/scatter, reset on allocate, use-after-free and exhaustion
errors; advance_context; and a pool driving Qwen4ExpPLE through chunked steps."""

from __future__ import annotations

import pytest
import torch

from conftest import devices
from plestore.layers import (
    Qwen4ExpPLE,
    Qwen4ExpPLEConfig,
    RequestState,
    StatePool,
    StatePoolError,
    advance_context,
)

EOS = 248044
CFG = Qwen4ExpPLEConfig(hidden_size=16, hc_count=2, ple_embed_dim=32)


def pool(device="cpu", slots=3, layers=2) -> StatePool:
    return StatePool.for_qwen4exp(
        CFG, slots, num_ple_layers=layers, eos_token_id=EOS, device=device
    )


@pytest.mark.parametrize("device", devices())
def test_allocate_resets_and_roundtrips(device):
    p = pool(device)
    a, b = p.allocate(), p.allocate()
    assert p.num_free == 1
    st = p.gather([a, b])
    assert st.context.shape == (2, 2) and (st.context == EOS).all()
    assert st.conv.shape == (2, 2, 32, 9) and st.conv.dtype == torch.bfloat16
    assert (st.conv == 0).all()
    ctx = torch.tensor([[1, 2], [3, 4]], device=device)
    conv = torch.randn(2, 2, 32, 9, device=device).bfloat16()
    p.scatter([b, a], RequestState(ctx, conv))
    got = p.gather(torch.tensor([a, b]))
    assert torch.equal(got.context, ctx.flip(0)) and torch.equal(got.conv, conv.flip(1))
    layer1 = torch.randn(1, 32, 9, device=device).bfloat16()
    p.set_conv([a], 1, layer1)
    assert torch.equal(p.conv([a], 1), layer1) and torch.equal(p.conv([a], 0), conv[0, 1:])
    p.free(a)
    assert p.allocate() == 2  # FIFO: the never-used slot comes before the freed one
    again = p.allocate()
    assert again == a and p.num_free == 0
    fresh = p.gather([again])  # slot a held data before it was freed
    assert (fresh.context == EOS).all() and (fresh.conv == 0).all()


def test_use_after_free_and_exhaustion_raise():
    p = pool(slots=2)
    a, b = p.allocate(), p.allocate()
    with pytest.raises(StatePoolError, match="exhausted: all 2 slots are in use"):
        p.allocate()
    p.free(a)
    calls = [
        lambda: p.gather([b, a]),
        lambda: p.conv([a], 0),
        lambda: p.free(a),
        lambda: p.scatter([a], p.gather([b])),
        lambda: p.set_conv([a], 0, None),
    ]
    for call in calls:
        with pytest.raises(StatePoolError, match=f"slot {a}: it was freed \\(state used after"):
            call()
    with pytest.raises(StatePoolError, match="slot 5: the pool has slots 0..1"):
        p.gather([5])
    q = pool(slots=2)
    with pytest.raises(StatePoolError, match="never allocated"):
        q.gather([0])
    with pytest.raises(ValueError, match="a slot appears twice"):
        p.scatter([b, b], p.gather([b, b]))
    with pytest.raises(ValueError, match="no PLE layer 2"):
        p.conv([b], 2)
    with pytest.raises(ValueError, match="num_slots must be a positive int"):
        StatePool(0, context_width=2, context_fill=0, conv_layers=1, conv_channels=4, conv_width=9)


@pytest.mark.parametrize("device", devices())
def test_advance_context(device):
    """Last n-1 of [old context | the request's tokens]: long chunks, 1-token decode steps,
    empty entries and trailing padding."""
    ctx = torch.tensor([[EOS, EOS], [7, 8], [5, 6], [1, 2]], device=device)
    tokens = torch.tensor([10, 11, 12, 20, 30, -1, -1], device=device)
    qsl = torch.tensor([0, 3, 4, 4, 5], device=device)
    got = advance_context(ctx, tokens, qsl)
    want = torch.tensor([[11, 12], [8, 20], [5, 6], [2, 30]], device=device)
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", devices())
def test_pool_drives_chunked_ple(device):
    """Two requests through a pool: chunks of 3, 1, 4, 2 tokens give the same output and final
    state as one unsplit prefill; the pool's fresh slot needs no has_initial_state."""
    torch.manual_seed(0)
    m = Qwen4ExpPLE(CFG)
    with torch.no_grad():
        for prm in m.parameters():
            prm.copy_(torch.randn_like(prm.float()) * 0.3)
    m = m.to(device)
    n = 10
    bank = torch.randn(2, n, 32).bfloat16().to(device)
    emb = torch.randn(2, n, 32).bfloat16().to(device)
    p = pool(device, layers=1)
    slots = [p.allocate(), p.allocate()]
    outs, done = [[], []], 0
    for k in (3, 1, 4, 2):
        qsl = torch.tensor([0, k, 2 * k], device=device)
        b = torch.cat([bank[0, done : done + k], bank[1, done : done + k]])
        e = torch.cat([emb[0, done : done + k], emb[1, done : done + k]])
        out, new = m(b, e, qsl, p.conv(slots, 0))
        p.set_conv(slots, 0, new)
        outs[0].append(out[:k])
        outs[1].append(out[k:])
        done += k
    for r in range(2):
        want, state = m(bank[r], emb[r], torch.tensor([0, n], device=device))
        assert torch.equal(torch.cat(outs[r]), want)
        assert torch.equal(p.conv([slots[r]], 0), state)
