"""Row formats: golden decodings, independent references (torch fp8, ml_dtypes), numpy == torch
bit for bit, round trips, every byte value, NaN/Inf/subnormals and bad input."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_bit_identical, devices, load_golden
from plestore.formats import FORMATS, NF4_LEVELS, EncodeError, get_format
from plestore.formats import codecs as F

RNG = np.random.default_rng(20261129)


def _random_rows(fmt, n, dim, rng, finite=True):
    """Random packed rows covering many byte values; scale bytes kept finite when asked."""
    rows = rng.integers(0, 256, size=(n, fmt.row_bytes(dim)), dtype=np.uint8)
    if finite and fmt.name in ("fp8_e4m3", "nvfp4", "fp8_ue8m0"):
        rows[(rows & 0x7F) == 0x7F] &= 0xFE  # drop e4m3 NaN codes
    if finite and fmt.name == "fp8_ue8m0":
        rows[:, dim:] = rng.integers(100, 150, size=(n, dim // 32), dtype=np.uint8)
    if fmt.name == "nf4":
        rows[:, dim // 2 : dim // 2 + 2] = (
            rng.standard_normal(n).astype("<f2").view(np.uint8).reshape(n, 2)
        )
        rows[:, dim // 2 + 2 :] = 0
    return rows


# -- golden vectors ------------------------------------------------------------------------------


def test_golden_nvfp4():
    g = load_golden("dequant_vectors.json")["nvfp4_dim32"]
    rows = np.array([g["packed_code_bytes"] + g["block_scale_e4m3_bytes"]], np.uint8)
    fmt = get_format("nvfp4")
    assert fmt.row_bytes(32) == 18
    np.testing.assert_array_equal(F.unpack_nibbles(rows[:, :16])[0], g["unpacked_codes"])
    want = F.bf16_round(np.array([g["values_fp32"]], np.float32))
    out = fmt.decode(rows, scale=g["weight_scale_2"])
    assert_bit_identical(out, want)
    assert_bit_identical(fmt.decode(torch.from_numpy(rows), scale=g["weight_scale_2"]), want)


def test_golden_nf4():
    g = load_golden("dequant_vectors.json")["nf4_dim32"]
    np.testing.assert_array_equal(NF4_LEVELS, np.array(g["levels"], np.float32))
    rows = np.array([g["row_bytes"]], np.uint8)
    fmt = get_format("nf4")
    np.testing.assert_array_equal(F.unpack_nibbles(rows[:, :16])[0], g["unpacked_codes"])
    want = F.bf16_round(np.array([g["values_fp32"]], np.float32))
    assert_bit_identical(fmt.decode(rows), want)
    assert_bit_identical(fmt.decode(torch.from_numpy(rows)), want)


def test_golden_fp8():
    g = load_golden("dequant_vectors.json")["fp8_dim32"]
    rows = np.array([g["e4m3_bytes"]], np.uint8)
    fmt = get_format("fp8_e4m3")
    want = np.array([g["values_bf16_as_fp32"]], np.float32)
    assert_bit_identical(fmt.decode(rows, scale=g["weight_scale"]), want)
    assert_bit_identical(fmt.decode(torch.from_numpy(rows), scale=g["weight_scale"]), want)


# -- independent references ----------------------------------------------------------------------


def test_e4m3_all_256_bytes_match_torch_and_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    via_torch = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    via_ml = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(F.E4M3_LUT, via_torch)
    np.testing.assert_array_equal(F.E4M3_LUT, via_ml)
    assert np.isnan(F.E4M3_LUT[[0x7F, 0xFF]]).all()
    assert np.isfinite(np.delete(F.E4M3_LUT, [0x7F, 0xFF])).all()


def test_e2m1_all_16_codes_match_ml_dtypes():
    via_ml = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(F.E2M1_LUT, via_ml)


def test_e4m3_encode_is_torch_cast_with_saturation():
    x = np.concatenate(
        [
            RNG.standard_normal(20000) * 10.0 ** RNG.integers(-4, 3, 20000),
            F.E4M3_LUT[np.isfinite(F.E4M3_LUT)],  # every representable value
            (F.E4M3_LUT[1:0x7E] + F.E4M3_LUT[2:0x7F]) / 2,  # every tie
            [2.0**-10, 2.0**-10 * 3, 500.0, -1e9, -0.0, 0.0],
        ]
    ).astype(np.float32)
    ours = F.E4M3.encode(x)
    ref = torch.from_numpy(np.clip(x, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8)
    np.testing.assert_array_equal(ours, ref.numpy())


def test_e2m1_encode_matches_ml_dtypes_rne():
    grid = F.E2M1_LUT[:8]
    x = np.concatenate(
        [RNG.standard_normal(20000) * 3, grid, -grid, (grid[:-1] + grid[1:]) / 2, [7.0, -100.0]]
    ).astype(np.float32)
    ours = F.E2M1_LUT[F.E2M1.encode(x)]
    ref = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(ours, ref)


def test_ue8m0_scale_bytes_match_ml_dtypes_in_range():
    b = np.arange(1, 255, dtype=np.uint8)  # 0 and 255 follow the engines' shift (0.0 / inf)
    np.testing.assert_array_equal(
        F.ue8m0_scale(b), b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    )
    assert F.ue8m0_scale(np.array([0], np.uint8))[0] == 0.0
    assert np.isinf(F.ue8m0_scale(np.array([255], np.uint8))[0])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bf16_round_matches_torch():
    x = np.concatenate(
        [
            RNG.standard_normal(50000) * 10.0 ** RNG.integers(-40, 38, 50000),
            np.array([1e-45, -1e-40, 3.4e38, np.inf, -np.inf, 0.0, -0.0], np.float32),
            (np.arange(1 << 16, dtype=np.uint32) << 16 | 0x8000).view(np.float32),  # exact ties
        ]
    ).astype(np.float32)
    ref = torch.from_numpy(x).to(torch.bfloat16)
    assert_bit_identical(F.bf16_round(x), ref)


# -- numpy == torch, every format ----------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", list(FORMATS))
def test_numpy_and_torch_decode_bit_identical(name, device):
    fmt = get_format(name)
    for dim in (fmt.block_size * 2, 160 if 160 % fmt.block_size == 0 else 256, 256):
        rows = _random_rows(fmt, 997, dim, RNG, finite=False)
        scale = 0.0123 if fmt.has_table_scale else 1.0
        want = fmt.decode(rows, scale=scale)
        got = fmt.decode(torch.from_numpy(rows).to(device), scale=scale)
        assert got.dtype == fmt.torch_dtype and got.device.type == device
        assert_bit_identical(got, want)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(list(FORMATS)),
    n=st.integers(0, 33),
    blocks=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    scale=st.floats(1e-6, 1e3),
)
def test_decode_agrees_on_random_rows(name, n, blocks, seed, scale):
    fmt = get_format(name)
    dim = 32 * blocks
    rows = _random_rows(fmt, n, dim, np.random.default_rng(seed))
    s = scale if fmt.has_table_scale else 1.0
    want = fmt.decode(rows, scale=s)
    assert want.shape == (n, dim)
    assert_bit_identical(fmt.decode(torch.from_numpy(rows), scale=s), want)


# -- round trips and encode error ----------------------------------------------------------------


# nf4 is left out: it re-derives each row's fp16 scale from the bf16-rounded maximum, so a
# second encode may pick a neighbouring scale; its error bound is tested below.
@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "nvfp4", "fp8_ue8m0"])
def test_round_trip_is_a_fixed_point(name):
    """decode(encode(decode(encode(x)))) == decode(encode(x)): re-encoding a decoded table is
    lossless (what `pack` relies on when it converts a table it has already converted)."""
    fmt = get_format(name)
    x = RNG.standard_normal((64, 160 if 160 % fmt.block_size == 0 else 256)).astype(np.float32)
    enc = fmt.encode(x)
    y = fmt.decode(enc.rows, scale=enc.scale)
    enc2 = fmt.encode(y, scale=enc.scale if fmt.has_table_scale else None)
    assert_bit_identical(fmt.decode(enc2.rows, scale=enc2.scale), y)


def test_bf16_round_trip_exact_for_bf16_values():
    x = F.bf16_round(RNG.standard_normal((8, 160)).astype(np.float32))
    fmt = get_format("bf16")
    assert_bit_identical(fmt.decode(fmt.encode(x).rows), x)


@pytest.mark.parametrize(
    "name,max_rel",  # bound on max|err| / max|x| for N(0,1) rows of 160/256 values
    [("bf16", 2**-8), ("fp8_e4m3", 2**-4), ("nvfp4", 0.25), ("fp8_ue8m0", 2**-3), ("nf4", 0.3)],
)
def test_encode_error_is_bounded_on_normal_data(name, max_rel):
    fmt = get_format(name)
    x = RNG.standard_normal((256, 160 if 160 % fmt.block_size == 0 else 256)).astype(np.float32)
    enc = fmt.encode(x)
    err = enc.error(fmt, x)
    assert isinstance(err, EncodeError)
    assert 0 <= err.max_rel <= max_rel, err
    assert 0 < err.rmse <= err.max_abs


def test_fp8_default_scale_is_bf16_and_covers_amax():
    x = RNG.standard_normal((10, 160)).astype(np.float32) * 1234.5
    enc = get_format("fp8").encode(x)
    assert F.bf16_round(np.array([enc.scale], np.float32))[0] == np.float32(enc.scale)
    assert enc.scale * 448 >= np.abs(x).max()
    assert not np.isnan(get_format("fp8").decode(enc.rows, scale=enc.scale)).any()


def test_nvfp4_encode_layout_and_scales():
    fmt = get_format("nvfp4")
    x = RNG.standard_normal((4, 160)).astype(np.float32)
    enc = fmt.encode(x, scale=0.001)
    assert enc.rows.shape == (4, 90) and enc.scale == 0.001
    bs = F.E4M3_LUT[enc.rows[:, 80:]]  # block scales: e4m3(amax_block / 6 / scale_2)
    amax = np.abs(x.reshape(4, 10, 16)).max(axis=2)
    np.testing.assert_array_equal(bs, F.E4M3_LUT[F.E4M3.encode(amax / 6 / np.float32(0.001))])


def test_nvfp4_all_zero_block_decodes_to_zero():
    x = np.zeros((2, 32), np.float32)
    x[1, 16:] = 1.0
    fmt = get_format("nvfp4")
    enc = fmt.encode(x)
    np.testing.assert_array_equal(fmt.decode(enc.rows, scale=enc.scale)[0], 0.0)


# -- NaN, Inf, subnormals ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8_e4m3", "nvfp4", "fp8_ue8m0", "nf4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantized_encode_rejects_non_finite(name, bad):
    x = np.ones((3, 64), np.float32)
    x[2, 5] = bad
    with pytest.raises(ValueError, match="row 2, col 5"):
        get_format(name).encode(x)


def test_bf16_keeps_nan_and_inf():
    x = np.array([[np.nan, np.inf, -np.inf, 1.0]], np.float32)
    fmt = get_format("bf16")
    out = fmt.decode(fmt.encode(x).rows)
    assert np.isnan(out[0, 0]) and out[0, 1] == np.inf and out[0, 2] == -np.inf
    assert_bit_identical(fmt.decode(torch.from_numpy(fmt.encode(x).rows)), out)


def test_nan_bytes_decode_to_nan_in_both_backends():
    rows = np.full((1, 64), 0x7F, np.uint8)
    for name in ("fp8_e4m3", "fp8_ue8m0"):
        fmt = get_format(name)
        r = rows[:, : fmt.row_bytes(32)].copy()
        assert np.isnan(fmt.decode(r)).all()
        assert torch.isnan(fmt.decode(torch.from_numpy(r))).all()


def test_subnormals_survive():
    sub = F.E4M3_LUT[1:8]  # e4m3 subnormals 2^-9 .. 7*2^-9
    np.testing.assert_array_equal(F.E4M3_LUT[F.E4M3.encode(sub)], sub)
    x = np.array([[1e-40, -3e-39] + [0.0] * 30], np.float32)  # fp32/bf16 subnormals
    fmt = get_format("bf16")
    assert_bit_identical(fmt.decode(torch.from_numpy(fmt.encode(x).rows)), F.bf16_round(x))
    assert fmt.decode(fmt.encode(x).rows)[0, 0] != 0


# -- layout and bad input ------------------------------------------------------------------------


def test_row_bytes_table():
    got = {
        n: (f.row_bytes(160) if 160 % f.block_size == 0 else None, f.row_bytes(256))
        for n, f in FORMATS.items()
    }
    assert got == {
        "bf16": (320, 512),
        "fp8_e4m3": (160, 256),
        "nvfp4": (90, 144),
        "fp8_ue8m0": (165, 264),
        "nf4": (84, 132),
        "fp16": (320, 512),
        "fp32": (640, 1024),
    }
    for f in FORMATS.values():
        for dim in (f.block_size, 10 * f.block_size, 256):
            assert f.dim_for_row_bytes(f.row_bytes(dim)) == dim


def test_aliases_and_unknown_format():
    assert get_format("fp8").name == "fp8_e4m3"
    assert get_format("float8_e4m3fn").name == "fp8_e4m3"
    assert get_format("BFloat16").name == "bf16"
    assert get_format("float16").name == "fp16" and get_format("float32").name == "fp32"
    with pytest.raises(ValueError, match="unknown row format 'int3'.*known formats"):
        get_format("int3")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: get_format("nvfp4").row_bytes(100), "not a multiple of the format's block"),
        (lambda: get_format("fp8_ue8m0").encode(np.zeros((2, 48), np.float32)), "block size 32"),
        (lambda: get_format("bf16").encode(np.zeros((2, 4), np.int32)), "floating-point"),
        (lambda: get_format("bf16").encode(np.zeros(4, np.float32)), "2-D"),
        (lambda: get_format("bf16").decode(np.zeros((2, 8), np.int8)), "uint8"),
        (lambda: get_format("bf16").decode(np.zeros(8, np.uint8)), "2-D"),
        (lambda: get_format("nvfp4").decode(np.zeros((2, 91), np.uint8)), "no dim has rows"),
        (lambda: get_format("fp8").decode(np.zeros((2, 10), np.uint8), dim=8), "are 8 bytes"),
        (lambda: get_format("bf16").decode(np.zeros((2, 8), np.uint8), scale=2.0), "no per-table"),
        (lambda: get_format("fp8").encode(np.ones((1, 4), np.float32), scale=0.0), "and > 0"),
        (lambda: get_format("bf16").decode(torch.zeros(2, 8, dtype=torch.int16)), "uint8"),
    ],
)
def test_bad_input_raises_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
