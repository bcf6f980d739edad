"""gdn_torch (the GDN ops every engine of the job runs) against transformers' own torch
recurrence, and its SGLang entry points against each other: a prefill in one piece, in two
chunks (the state carried in the pool slot) and token by token through decode / packed decode
give the same outputs and states."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang", reason="the SGLang job's venv has SGLang (.ci/sglang)")

import gdn_torch  # noqa: E402

H, HV, K, V = 2, 4, 16, 8  # grouped: value head h reads key head h // 2


def _inputs(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k = r(t, H, K).bfloat16(), r(t, H, K).bfloat16()
    v = r(t, HV, V).bfloat16()
    a, b = r(t, HV), r(t, HV)
    A_log, dt_bias = r(HV) * 0.5, r(HV) * 0.5
    return q, k, v, a, b, A_log, dt_bias


def test_recurrence_equals_transformers():
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, a, b, A_log, dt_bias = _inputs(11)
    g, beta = gdn_torch.gates(a, b, A_log, dt_bias)
    state0 = torch.randn(HV, V, K)
    state = state0.clone()
    ours = gdn_torch.recurrence(q, k, v, g, beta, state, K**-0.5)
    rep = HV // H
    theirs, final = torch_recurrent_gated_delta_rule(  # (in float32: it returns q's dtype)
        q.float().repeat_interleave(rep, 1)[None],
        k.float().repeat_interleave(rep, 1)[None],
        v.float()[None],
        g[None],
        beta[None],
        initial_state=state0.transpose(-1, -2)[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # (transformers' state is [HV, K, V])
    torch.testing.assert_close(ours, theirs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final[0].transpose(-1, -2), rtol=1e-5, atol=1e-5)


def test_extend_chunks_decode_and_packed_decode_agree():
    t, slot = 9, 2
    q, k, v, a, b, A_log, dt_bias = _inputs(t, seed=1)
    g, beta = gdn_torch.gates(a, b, A_log, dt_bias)
    cu = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731

    def pool():
        return torch.zeros(4, HV, V, K)

    # one prefill of the sequence, on slot 2 (slot 0 padding: -1)
    whole = pool()
    o_whole, *_ = gdn_torch.extend(
        None,
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        ssm_states=whole,
        cache_indices=torch.tensor([slot]),
        query_start_loc=cu(0, t),
    )
    # two chunks, the second continuing from the state the first left in the slot
    chunked = pool()
    o1, *_ = gdn_torch.extend(
        None,
        q[None, :5],
        k[None, :5],
        v[None, :5],
        g[None, :5],
        beta[None, :5],
        ssm_states=chunked,
        cache_indices=torch.tensor([slot]),
        query_start_loc=cu(0, 5),
    )
    o2, *_ = gdn_torch.extend(
        None,
        q[None, 5:],
        k[None, 5:],
        v[None, 5:],
        g[None, 5:],
        beta[None, 5:],
        ssm_states=chunked,
        cache_indices=torch.tensor([slot]),
        query_start_loc=cu(0, 4),
    )
    assert torch.equal(torch.cat([o1, o2], 1), o_whole)
    assert torch.equal(chunked, whole)
    # token by token: decode (q, k, v apart) and packed decode (q | k | v in one row), in a
    # batch beside a padded row (slot -1: zero output, no state touched)
    dec, packed = pool(), pool()
    for i in range(t):
        idx = torch.tensor([-1, slot])
        pair = lambda x, i=i: torch.stack([torch.zeros_like(x[i]), x[i]])  # noqa: E731
        o_dec = gdn_torch.decode(
            None,
            pair(q)[None],
            pair(k)[None],
            pair(v)[None],
            pair(a),
            pair(b),
            A_log=A_log,
            dt_bias=dt_bias,
            ssm_states=dec,
            cache_indices=idx,
            query_start_loc=cu(0, 1, 2),
        )
        mixed = torch.cat([pair(q).flatten(1), pair(k).flatten(1), pair(v).flatten(1)], 1)
        o_packed = gdn_torch.packed_decode(
            None,
            mixed,
            pair(a),
            pair(b),
            A_log=A_log,
            dt_bias=dt_bias,
            scale=K**-0.5,
            ssm_states=packed,
            cache_indices=idx,
            num_v_heads=HV,
            head_v_dim=V,
        )
        assert torch.equal(o_dec, o_packed)
        assert not o_dec[0, 0].any()
        assert torch.equal(o_dec[0, 1], o_whole[0, i])
    # (the states agree to float32 rounding: reductions over 1 or 9 rows round differently)
    torch.testing.assert_close(dec, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(packed, whole, rtol=1e-6, atol=1e-7)
