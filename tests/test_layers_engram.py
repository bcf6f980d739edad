"""EngramV41 against the float64 reference, the closed gate of token_mask, dot = 0, batching
invariance, input checks, config and weight loading (vLLM's own kernel: tests/vllm/)."""

from __future__ import annotations

import pytest
import torch

from conftest import devices
from plestore.layers import EngramV41, EngramV41Config
from plestore.layers.reference import engram_v41_reference
from plestore.spec import preset_config

HC, DIM, HEADS, HD = 4, 64, 6, 32
EMB = HEADS * HD
DTYPES = [torch.bfloat16, torch.float32]


def make_layer(dtype, device="cpu", seed=0) -> EngramV41:
    g = torch.Generator().manual_seed(seed)
    m = EngramV41(
        EngramV41Config(hidden_size=DIM, hc_mult=HC, num_heads=HEADS, head_dim=HD, dtype=dtype)
    )
    with torch.no_grad():
        m.wkv.weight.copy_(torch.randn(m.wkv.weight.shape, generator=g) * EMB**-0.5)
        m.q_weight.copy_(1 + 0.3 * torch.randn(HC, DIM, generator=g))  # a row per stream
        m.k_weight.copy_(1 + 0.3 * torch.randn(HC, DIM, generator=g))
    return m.to(device)


def rand(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def case(dtype, device, seed=0, t=24):
    m = make_layer(dtype, device, seed)
    h = rand((t, HC, DIM), dtype, device, seed + 1)
    emb = rand((t, EMB), dtype, device, seed + 2)
    mask = torch.rand(t, generator=torch.Generator().manual_seed(seed + 3)) > 0.25
    return m, h, emb, mask.to(device)


def ref(m, h, emb, mask, round_dtype=None):
    return engram_v41_reference(
        dict(m.named_parameters()),
        h,
        emb,
        hc_mult=HC,
        eps=1e-6,
        token_mask=mask.tolist(),
        round_dtype=round_dtype,
    )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_matches_float64_reference(device, seed):
    """rel = |err| / (1 + |ref|): max <= 2^-5, mean <= 2^-8. bf16 rounds kv, gate*value and the
    sum (2^-9 relative each); h + gate*value may cancel, hence the 1 + |ref| scale (measured
    over 4 seeds: max rel 0.007, mean rel 6.5e-4)."""
    m, h, emb, mask = case(torch.bfloat16, device, seed)
    got = m(h, emb, mask).detach().cpu().double()
    want = ref(m, h, emb, mask)
    rel = (got - want).abs() / (1 + want.abs())
    assert rel.max() <= 2**-5 and rel.mean() <= 2**-8, (rel.max(), rel.mean())


@pytest.mark.parametrize("device", devices())
def test_bf16_rounds_as_documented(device):
    """Rounding kv and h + gate*value once in the reference matches bit for bit on at least
    99.9% of values, the rest within 1 ulp; forward is forward_fp32 rounded once."""
    m, h, emb, mask = case(torch.bfloat16, device)
    got = m(h, emb, mask)
    assert torch.equal(got, m.forward_fp32(h, emb, mask).bfloat16())
    got = got.detach().cpu().double()
    want = ref(m, h, emb, mask, torch.bfloat16)
    assert (got == want).double().mean() >= 0.999
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(2**-10)
    assert ((got - want).abs() <= ulp).all()


@pytest.mark.parametrize("device", devices())
def test_fp32_matches_float64_reference(device):
    """|err| <= 1e-5 * (1 + |ref|): fp32 rounding (6e-8) over sums of 64 and a few steps
    (measured over 4 seeds: max 8.3e-7 of 1 + |ref|)."""
    m, h, emb, mask = case(torch.float32, device)
    want = ref(m, h, emb, mask)
    err = (m(h, emb, mask).detach().cpu().double() - want).abs()
    assert (err <= 1e-5 * (1 + want.abs())).all(), err.max()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_token_mask_closes_the_gate(device, dtype):
    """Masked tokens come back bit-identical to h, even with NaN rows looked up for them."""
    m, h, emb, mask = case(dtype, device)
    emb[~mask] = float("nan")
    out = m(h, emb, mask)
    assert torch.equal(out[~mask], h[~mask])
    assert not out.isnan().any() and (out[mask] != h[mask]).any()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_at_a_time_is_bit_identical(device, dtype):
    m, h, emb, mask = case(dtype, device)
    whole = m(h, emb, mask)
    for t in range(h.shape[0]):
        assert torch.equal(m(h[t : t + 1], emb[t : t + 1], mask[t : t + 1]), whole[t : t + 1])


@pytest.mark.parametrize("device", devices())
def test_zero_dot_opens_the_gate_to_sigmoid_of_1e_3(device):
    """A zero q_weight row makes that stream's dot = 0 exactly; its gate is then
    sigmoid(+sqrt(1e-6)) (vLLM's sign: + unless dot < 0), not sigmoid(0) = 0.5, and
    h' = h + gate * value with value = emb[:, :DIM] (identity rows in wkv)."""
    m, h, emb, _ = case(torch.bfloat16, device)
    with torch.no_grad():
        m.q_weight[1].zero_()
        m.wkv.weight[HC * DIM :].copy_(torch.eye(DIM, EMB))
    gate = torch.sigmoid(torch.tensor(1e-6).sqrt().double()).float()
    assert gate > 0.5
    want = (h[:, 1].float() + gate * emb[:, :DIM].float()).bfloat16()
    assert torch.equal(m(h, emb)[:, 1], want)


def test_shapes_and_bad_inputs():
    m, h, emb, mask = case(torch.bfloat16, "cpu")
    t = h.shape[0]
    flat = m(h.reshape(t, HC * DIM), emb.view(t, HEADS, HD), mask)
    assert flat.shape == (t, HC * DIM) and torch.equal(flat.view(t, HC, DIM), m(h, emb, mask))
    cases = [
        ((h[:, :3], emb, None), "wrong stream count or hidden size"),
        ((h.reshape(t, -1)[:, :-1], emb, None), r"hc_mult=4"),
        ((h, emb[:, :-2], None), r"num_heads\*head_dim = 6\*32 = 192"),
        ((h, emb[:-1], None), r"expected \[T=24"),
        ((h.float(), emb, None), "h is torch.float32, the layer computes in torch.bfloat16"),
        ((h, emb, mask[:-1]), r"token_mask must be a bool tensor \[24\]"),
        ((h, emb, mask.int()), "token_mask must be a bool tensor"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            m(*args)


def test_config_from_hf_config():
    cfg = EngramV41Config.from_hf_config(
        preset_config("deepseek-v4.1-flash") | {"hidden_size": 4096}
    )
    assert (cfg.hidden_size, cfg.hc_mult, cfg.num_heads, cfg.head_dim) == (4096, 4, 24, 256)
    assert cfg.embed_dim == 6144
    cfg = EngramV41Config.from_hf_config(
        {"text_config": {"hidden_size": 8, "hc_mult": 2, "engram_head_dim": 4, "engram_n_heads": 2}}
    )
    assert (cfg.hidden_size, cfg.hc_mult, cfg.num_heads, cfg.head_dim) == (8, 2, 6, 4)
    with pytest.raises(ValueError, match="lacks the key 'hidden_size'"):
        EngramV41Config.from_hf_config(preset_config("deepseek-v4.1-flash"))
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        EngramV41Config(hidden_size=8, head_dim=0)


def test_load_weights():
    src = make_layer(torch.bfloat16, seed=5)
    prefix = "model.layers.1.engram."
    names = ["k_weight", "q_weight", "wkv.weight"]  # DeepSeek-V4.1's (and vLLM's) names
    assert sorted(n for n, _ in src.named_parameters()) == names
    ckpt = {prefix + n: p.detach().clone() for n, p in src.named_parameters()}
    ckpt[prefix + "embed.weight"] = torch.zeros(3, 3)  # the table: not the layer's
    dst = EngramV41(src.config)
    assert dst.load_weights(ckpt, prefix) == [prefix + n for n in names]
    assert all(torch.equal(a, b) for a, b in zip(dst.parameters(), src.parameters(), strict=True))
    renamed = {k.replace("q_weight", "q_w"): v for k, v in ckpt.items()}
    dst.load_weights(renamed, prefix, aliases={"q_weight": "q_w"})
    del ckpt[prefix + "k_weight"]
    with pytest.raises(ValueError, match=r"lacks model\.layers\.1\.engram\.k_weight"):
        dst.load_weights(ckpt, prefix)
    bad = renamed | {prefix + "wkv.weight": torch.zeros(5, EMB)}
    with pytest.raises(ValueError, match=r"wkv\.weight is torch\.float32 \[5, 192\], expected"):
        dst.load_weights(bad, prefix, aliases={"q_weight": "q_w"})
    shared = renamed | {prefix + "q_w": torch.ones(DIM)}  # one row for all streams: refused
    with pytest.raises(
        ValueError, match=r"q_w is torch\.float32 \[64\], expected a float tensor \[4, 64\]"
    ):
        dst.load_weights(shared, prefix, aliases={"q_weight": "q_w"})
