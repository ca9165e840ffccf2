"""The references the kernels are judged by: cuflash.reference against a direct per-row formula and finite
differences, the low-precision references against float64, and cuflash._xpref (the same math in batched
matmuls, used on the GPU for large shapes) against cuflash.reference."""
from __future__ import annotations

import itertools
import math
import zlib

import numpy as np
import pytest

from cuflash import _xpref, reference

# (batch, seqlen_q, seqlen_k, heads, head_dim)
SHAPES = [(1, 1, 1, 1, 8), (2, 5, 7, 3, 8), (1, 7, 5, 2, 16), (2, 9, 9, 1, 4), (1, 1, 13, 2, 8), (1, 13, 1, 2, 8)]


def randn(rng, *shape):
    return rng.standard_normal(shape)


def per_row_attention(q, k, v, causal, scale):
    """softmax(scale * q_i . k_j over visible j) . v, one query row at a time, in plain Python loops.
    k and v may have fewer heads (grouped-query attention): query head h reads head h // (H_q // H_kv)."""
    b_, sq, h_, d = q.shape
    sk = k.shape[1]
    group = h_ // k.shape[2] if k.shape[2] else 1
    o = np.zeros((b_, sq, h_, d))
    lse = np.full((b_, h_, sq), -np.inf)
    for b, h, i in itertools.product(range(b_), range(h_), range(sq)):
        visible = [j for j in range(sk) if not causal or j <= i + sk - sq]
        if not visible:
            continue  # a row that sees no key: o = 0, lse = -inf
        kv = h // group
        scores = [scale * sum(q[b, i, h, c] * k[b, j, kv, c] for c in range(d)) for j in visible]
        m = max(scores)
        weights = [math.exp(s - m) for s in scores]
        total = sum(weights)
        lse[b, h, i] = m + math.log(total)
        for w, j in zip(weights, visible):
            o[b, i, h] += (w / total) * v[b, j, kv]
    return o, lse


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_forward64_matches_the_per_row_formula(shape, causal, scale):
    b, sq, sk, h, d = shape
    rng = np.random.default_rng(zlib.crc32(repr((shape, causal, scale)).encode()))
    q, k, v = randn(rng, b, sq, h, d), randn(rng, b, sk, h, d), randn(rng, b, sk, h, d)
    o, lse = reference.attention_forward64(q, k, v, causal=causal, softmax_scale=scale)
    o_row, lse_row = per_row_attention(q, k, v, causal, 1 / math.sqrt(d) if scale is None else scale)
    np.testing.assert_allclose(o, o_row, rtol=1e-12, atol=1e-12, err_msg=f"o mismatch for {shape} causal={causal}")
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_row))
    np.testing.assert_allclose(lse, lse_row, rtol=1e-12, atol=1e-12)


def test_causal_aligns_bottom_right_and_fully_masked_rows_give_zero_and_minus_inf():
    rng = np.random.default_rng(1)
    b, sq, sk, h, d = 2, 7, 3, 2, 8  # query i sees keys j <= i - 4: rows 0-3 see nothing
    q, k, v = randn(rng, b, sq, h, d), randn(rng, b, sk, h, d), randn(rng, b, sk, h, d)
    o, lse = reference.attention_forward64(q, k, v, causal=True)
    assert np.all(o[:, :4] == 0) and np.all(lse[:, :, :4] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, 4:]))
    # row 4 sees only key 0: o = v_0 exactly (up to rounding)
    np.testing.assert_allclose(o[:, 4], v[:, 0], rtol=1e-12, atol=1e-14)
    # the last row sees every key: it equals non-causal attention
    o_full, _ = reference.attention_forward64(q, k, v, causal=False)
    np.testing.assert_allclose(o[:, -1], o_full[:, -1], rtol=1e-12, atol=1e-14)
    assert reference.causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_forward64_with_no_keys():
    q = np.ones((1, 3, 2, 8))
    o, lse = reference.attention_forward64(q, np.ones((1, 0, 2, 8)), np.ones((1, 0, 2, 8)))
    assert o.shape == (1, 3, 2, 8) and np.all(o == 0) and np.all(lse == -np.inf)


def _central_difference(x, loss, eps):
    """d loss / d x by central differences, one element of x at a time (x is perturbed in place and
    restored)."""
    numeric = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        orig = x[idx]
        x[idx] = orig + eps
        plus = loss()
        x[idx] = orig - eps
        minus = loss()
        x[idx] = orig
        numeric[idx] = (plus - minus) / (2 * eps)
    return numeric


def _loss(q, k, v, do, causal, scale):
    return float(np.sum(reference.attention_forward64(q, k, v, causal, scale)[0] * do))


@pytest.mark.parametrize("sq,sk,causal", [(3, 4, False), (4, 3, False), (4, 4, True), (3, 5, True), (5, 3, True)])
def test_backward64_matches_central_finite_differences(sq, sk, causal):
    rng = np.random.default_rng(10 * sq + sk + causal)
    b, h, d, scale = 1, 2, 4, 0.7
    q, k, v, do = randn(rng, b, sq, h, d), randn(rng, b, sk, h, d), randn(rng, b, sk, h, d), randn(rng, b, sq, h, d)
    grads = reference.attention_backward64(do, q, k, v, causal=causal, softmax_scale=scale)
    eps = 1e-6
    for name, x, g in zip("qkv", (q, k, v), grads):
        numeric = _central_difference(x, lambda: _loss(q, k, v, do, causal, scale), eps)
        err = np.abs(g - numeric).max()
        assert err <= 1e-7 * max(1.0, np.abs(numeric).max()), f"d{name} vs finite differences: {err:.2e}"
    if causal and sq > sk:  # rows that see no key get no gradient
        assert np.all(grads[0][:, : sq - sk] == 0)


@pytest.mark.parametrize("dtype,tol", [("fp16", 5e-3), ("bf16", 4e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_lowp_references_are_close_to_float64_but_not_equal(dtype, tol, causal):
    rng = np.random.default_rng(7)
    b, sq, sk, h, d = 2, 33, 47, 2, 64
    q, k, v, do = (reference._round(randn(rng, b, s, h, d), dtype) for s in (sq, sk, sk, sq))
    o64, _ = reference.attention_forward64(q, k, v, causal)
    o = reference.attention_lowp(q, k, v, dtype, causal)
    err = np.abs(o - o64).max()
    assert 0 < err <= tol * np.abs(o64).max(), f"{dtype} o: {err:.2e}"
    for name, g, g64 in zip("qkv", reference.attention_backward_lowp(do, q, k, v, dtype, causal),
                            reference.attention_backward64(do, q, k, v, causal)):
        err = np.abs(g - g64).max()
        assert 0 < err <= 2 * tol * np.abs(g64).max(), f"{dtype} d{name}: {err:.2e} vs max {np.abs(g64).max():.2e}"


# --- cuflash._xpref: the same references in batched matmuls, for NumPy or CuPy ---------------------------

XP_SHAPES = [(2, 113, 203, 3, 64, False), (1, 64, 32, 2, 32, True), (2, 17, 40, 2, 128, True), (1, 1, 9, 1, 8, True)]


def _ulp(dtype, magnitude):
    """Spacing of `dtype` numbers at `magnitude` (fp16: 10, bf16: 7 mantissa bits)."""
    bits = 10 if dtype == "fp16" else 7
    return 2.0 ** (math.floor(math.log2(max(magnitude, 2.0**-14))) - bits)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_xp_round_to_matches_ml_dtypes(dtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-6, 6, 20000)).astype(np.float32)
    x[:4] = [np.inf, -np.inf, np.nan, 0.0]
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(_xpref.round_to(x, dtype), reference._round(x, dtype))


@pytest.mark.parametrize("shape", XP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_xp_float64_references_equal_reference(shape):
    b, sq, sk, h, d, causal = shape
    rng = np.random.default_rng(sq * sk)
    q, k, v, do = (randn(rng, b, s, h, d) for s in (sq, sk, sk, sq))
    for got, want in zip(_xpref.attention_forward64(q, k, v, causal), reference.attention_forward64(q, k, v, causal)):
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for got, want in zip(_xpref.attention_backward64(do, q, k, v, causal, 0.3),
                         reference.attention_backward64(do, q, k, v, causal, 0.3)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("shape", XP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_xp_lowp_references_agree_with_reference(shape, dtype):
    """Matmul and einsum sum in different orders, so a few elements round to a neighbouring dtype value;
    each element may differ by one unit in the last place, and the error against float64 is as large."""
    b, sq, sk, h, d, causal = shape
    rng = np.random.default_rng(sq + sk)
    q, k, v, do = (reference._round(randn(rng, b, s, h, d), dtype) for s in (sq, sk, sk, sq))
    o64, _ = reference.attention_forward64(q, k, v, causal)
    pairs = [("o", _xpref.attention_lowp(q, k, v, dtype, causal), reference.attention_lowp(q, k, v, dtype, causal),
              o64)]
    grads64 = reference.attention_backward64(do, q, k, v, causal)
    for name, got, want, g64 in zip(("dq", "dk", "dv"), _xpref.attention_backward_lowp(do, q, k, v, dtype, causal),
                                    reference.attention_backward_lowp(do, q, k, v, dtype, causal), grads64):
        pairs.append((name, got, want, g64))
    for name, got, want, ref64 in pairs:
        assert got.shape == want.shape and got.dtype == np.float32, name
        diff = np.abs(got - want).max()
        assert diff <= _ulp(dtype, np.abs(want).max()), f"{name}: {diff:.2e} apart"
        err_got, err_want = np.abs(got - ref64).max(), np.abs(want - ref64).max()
        assert 0.5 * err_want <= err_got <= 2 * err_want + 1e-6, f"{name}: error {err_got:.2e} vs {err_want:.2e}"


# --- grouped-query attention: k, v with H_kv heads, query head h uses kv head h // (H_q // H_kv) -------------

GQA_SHAPES = [(2, 5, 7, 4, 2, 8), (1, 7, 5, 6, 1, 8), (1, 9, 9, 6, 3, 4), (2, 1, 13, 8, 2, 8)]  # b, sq, sk, hq, hkv, d


def explicit_repeat(x, heads_q):
    """(B, S, H_kv, D) -> (B, S, H_q, D) by index, one query head at a time: head h is x[:, :, h // group]."""
    group = heads_q // x.shape[2]
    return np.stack([x[:, :, h // group] for h in range(heads_q)], axis=2)


def explicit_group_sum(dx, heads_kv):
    """(B, S, H_q, D) -> (B, S, H_kv, D): kv head g accumulates the gradient of every query head h with
    h // group == g, one query head at a time."""
    group = dx.shape[2] // heads_kv
    out = np.zeros(dx.shape[:2] + (heads_kv,) + dx.shape[3:], dtype=np.float64)
    for h in range(dx.shape[2]):
        out[:, :, h // group] += dx[:, :, h]
    return out


def test_repeat_kv_maps_query_head_h_to_kv_head_h_over_group():
    x = np.arange(3)[None, None, :, None] * np.ones((1, 1, 3, 2))  # kv head g holds the value g
    rep = reference.repeat_kv(x, 6)
    assert rep[0, 0, :, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert reference.sum_kv_groups(rep, 3)[0, 0, :, 0].tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="heads_q=4 is not a multiple of heads_kv=3"):
        reference.repeat_kv(np.ones((1, 1, 3, 2)), 4)


@pytest.mark.parametrize("shape", GQA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_forward64_matches_the_per_row_formula(shape, causal):
    b, sq, sk, hq, hkv, d = shape
    rng = np.random.default_rng(zlib.crc32(repr(("gqa", shape, causal)).encode()))
    q, k, v = randn(rng, b, sq, hq, d), randn(rng, b, sk, hkv, d), randn(rng, b, sk, hkv, d)
    o, lse = reference.attention_forward64(q, k, v, causal=causal)
    o_row, lse_row = per_row_attention(q, k, v, causal, 1 / math.sqrt(d))
    assert o.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq)
    np.testing.assert_allclose(o, o_row, rtol=1e-12, atol=1e-12, err_msg=f"o mismatch for GQA {shape}")
    np.testing.assert_allclose(lse, lse_row, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", GQA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_equals_dense_attention_on_repeated_heads(shape, causal):
    """Forward: GQA == multi-head attention on k, v with each kv head copied to its query heads. Backward: dq
    the same, dk and dv the sums over the query heads of each group."""
    b, sq, sk, hq, hkv, d = shape
    rng = np.random.default_rng(zlib.crc32(repr(("gqa-rep", shape, causal)).encode()))
    q, k, v, do = randn(rng, b, sq, hq, d), randn(rng, b, sk, hkv, d), randn(rng, b, sk, hkv, d), randn(rng, b, sq, hq, d)
    k_rep, v_rep = explicit_repeat(k, hq), explicit_repeat(v, hq)
    for got, want in zip(reference.attention_forward64(q, k, v, causal, 0.4),
                         reference.attention_forward64(q, k_rep, v_rep, causal, 0.4)):
        np.testing.assert_array_equal(got, want)
    dq, dk, dv = reference.attention_backward64(do, q, k, v, causal, 0.4)
    dq_r, dk_r, dv_r = reference.attention_backward64(do, q, k_rep, v_rep, causal, 0.4)
    assert dk.shape == k.shape and dv.shape == v.shape
    np.testing.assert_array_equal(dq, dq_r)
    np.testing.assert_allclose(dk, explicit_group_sum(dk_r, hkv), rtol=1e-12, atol=1e-13, err_msg="dk != group sum")
    np.testing.assert_allclose(dv, explicit_group_sum(dv_r, hkv), rtol=1e-12, atol=1e-13, err_msg="dv != group sum")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("shape", GQA_SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_gqa_lowp_references_equal_repeated_heads_with_rounded_group_sums(shape, dtype):
    """Low precision: o and dq as on repeated heads; dk, dv = the group sums of the rounded per-head gradients,
    rounded again (a framework's backward through a head repeat), to one unit in the last place."""
    b, sq, sk, hq, hkv, d = shape
    rng = np.random.default_rng(sq * sk + hq)
    q, k, v, do = (reference._round(randn(rng, b, s, h, d), dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    k_rep, v_rep = explicit_repeat(k, hq), explicit_repeat(v, hq)
    np.testing.assert_array_equal(reference.attention_lowp(q, k, v, dtype, True),
                                  reference.attention_lowp(q, k_rep, v_rep, dtype, True))
    dq, dk, dv = reference.attention_backward_lowp(do, q, k, v, dtype, True)
    dq_r, dk_r, dv_r = reference.attention_backward_lowp(do, q, k_rep, v_rep, dtype, True)
    np.testing.assert_array_equal(dq, dq_r)
    for name, got, per_head in (("dk", dk, dk_r), ("dv", dv, dv_r)):
        want = reference._round(explicit_group_sum(per_head, hkv), dtype)
        diff = np.abs(got - want).max()
        assert diff <= _ulp(dtype, np.abs(want).max()), f"{name}: {diff:.2e} from the rounded group sum"


@pytest.mark.parametrize("hq,hkv,causal", [(4, 2, False), (3, 1, True), (4, 1, False)])
def test_gqa_backward64_matches_central_finite_differences(hq, hkv, causal):
    """dk, dv of a kv head shared by several query heads: the derivative of the loss through all of them."""
    rng = np.random.default_rng(hq * 10 + hkv + causal)
    b, sq, sk, d, scale = 1, 4, 3, 4, 0.7
    q, k, v, do = randn(rng, b, sq, hq, d), randn(rng, b, sk, hkv, d), randn(rng, b, sk, hkv, d), randn(rng, b, sq, hq, d)
    grads = reference.attention_backward64(do, q, k, v, causal=causal, softmax_scale=scale)
    eps = 1e-6
    for name, x, g in zip("qkv", (q, k, v), grads):
        assert g.shape == x.shape, f"d{name} has shape {g.shape}, {name} has {x.shape}"
        numeric = _central_difference(x, lambda: _loss(q, k, v, do, causal, scale), eps)
        err = np.abs(g - numeric).max()
        assert err <= 1e-7 * max(1.0, np.abs(numeric).max()), f"GQA d{name} vs finite differences: {err:.2e}"


@pytest.mark.parametrize("shape", GQA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_xp_gqa_references_equal_reference(shape):
    b, sq, sk, hq, hkv, d = shape
    rng = np.random.default_rng(sq + 100 * hq)
    q, k, v, do = randn(rng, b, sq, hq, d), randn(rng, b, sk, hkv, d), randn(rng, b, sk, hkv, d), randn(rng, b, sq, hq, d)
    for got, want in zip(_xpref.attention_forward64(q, k, v, True), reference.attention_forward64(q, k, v, True)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for got, want in zip(_xpref.attention_backward64(do, q, k, v, True), reference.attention_backward64(do, q, k, v, True)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for dtype in ("fp16", "bf16"):
        qr, kr, vr, dor = (reference._round(x, dtype) for x in (q, k, v, do))
        got, want = _xpref.attention_lowp(qr, kr, vr, dtype, True), reference.attention_lowp(qr, kr, vr, dtype, True)
        assert np.abs(got - want).max() <= _ulp(dtype, np.abs(want).max())
        for got, want in zip(_xpref.attention_backward_lowp(dor, qr, kr, vr, dtype, True),
                             reference.attention_backward_lowp(dor, qr, kr, vr, dtype, True)):
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= 2 * _ulp(dtype, np.abs(want).max()), dtype


def test_no_keys_in_every_reference():
    """Sk = 0: o = 0, lse = -inf, no gradient, in float64 and low precision, NumPy and the xp mirror."""
    rng = np.random.default_rng(5)
    q, do = randn(rng, 1, 3, 4, 8), randn(rng, 1, 3, 4, 8)
    k = v = np.zeros((1, 0, 2, 8))
    for mod in (reference, _xpref):
        o, lse = mod.attention_forward64(q, k, v, True)
        assert np.all(o == 0) and np.all(lse == -np.inf), mod.__name__
        assert np.all(mod.attention_lowp(q, k, v, "bf16", True) == 0), mod.__name__
        for grads in (mod.attention_backward64(do, q, k, v, True), mod.attention_backward_lowp(do, q, k, v, "fp16")):
            assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and np.all(grads[0] == 0), mod.__name__


# --- variable-length batches: packed sequences, each its own dense attention --------------------------------

def packed_problem(rng, lens_q, lens_k, hq, hkv, d):
    """Packed q, k, v, do and cu_seqlens (int32) for the given per-sequence lengths."""
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v = randn(rng, cu_q[-1], hq, d), randn(rng, cu_k[-1], hkv, d), randn(rng, cu_k[-1], hkv, d)
    return q, k, v, randn(rng, cu_q[-1], hq, d), cu_q, cu_k


VARLEN_LENGTHS = [  # (lengths of q, lengths of k): zero-length sequences, Sq > Sk, Sq < Sk, single rows
    ([3, 0, 5, 1, 4], [6, 2, 0, 1, 3]),
    ([1, 7], [9, 2]),
    ([0, 0], [0, 4]),
]


@pytest.mark.parametrize("lens", VARLEN_LENGTHS, ids=lambda x: "q" + "-".join(map(str, x[0])) + "_k" + "-".join(map(str, x[1])))
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward64_is_the_per_row_formula_per_sequence(lens, hq, hkv, causal):
    """Each sequence b, alone, as in per_row_attention; causal bottom-right per sequence; lse (H_q, total_q)."""
    rng = np.random.default_rng(zlib.crc32(repr((lens, hq, causal)).encode()))
    q, k, v, _, cu_q, cu_k = packed_problem(rng, *lens, hq, hkv, 8)
    o, lse = reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, causal, 0.5)
    assert o.shape == q.shape and lse.shape == (hq, q.shape[0])
    for b in range(len(lens[0])):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o_b, lse_b = per_row_attention(q[None, rq], k[None, rk], v[None, rk], causal, 0.5)
        np.testing.assert_allclose(o[rq], o_b[0], rtol=1e-12, atol=1e-12, err_msg=f"sequence {b}")
        np.testing.assert_allclose(lse[:, rq], lse_b[0], rtol=1e-12, atol=1e-12, err_msg=f"sequence {b}")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_equal_lengths_is_batched_dense_attention(causal):
    """B sequences of the same lengths packed == the (B, S, H, D) dense call, forward and backward."""
    rng = np.random.default_rng(11)
    b, sq, sk, hq, hkv, d = 3, 5, 7, 4, 2, 8
    q, k, v, do, cu_q, cu_k = packed_problem(rng, [sq] * b, [sk] * b, hq, hkv, d)
    o, lse = reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, causal)
    dense = lambda x, s: x.reshape(b, s, *x.shape[1:])  # noqa: E731
    o_d, lse_d = reference.attention_forward64(dense(q, sq), dense(k, sk), dense(v, sk), causal)
    np.testing.assert_array_equal(o, o_d.reshape(o.shape))
    np.testing.assert_array_equal(lse, lse_d.transpose(1, 0, 2).reshape(hq, b * sq))
    grads = reference.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, causal)
    grads_d = reference.attention_backward64(dense(do, sq), dense(q, sq), dense(k, sk), dense(v, sk), causal)
    for name, g, gd in zip(("dq", "dk", "dv"), grads, grads_d):
        np.testing.assert_allclose(g, gd.reshape(g.shape), rtol=1e-13, atol=1e-14, err_msg=name)
    for dtype in ("fp16", "bf16"):
        qr, kr, vr, dor = (reference._round(x, dtype) for x in (q, k, v, do))
        np.testing.assert_array_equal(reference.attention_varlen_lowp(qr, kr, vr, cu_q, cu_k, dtype, causal),
                                      reference.attention_lowp(dense(qr, sq), dense(kr, sk), dense(vr, sk), dtype,
                                                               causal).reshape(q.shape))
        for g, gd in zip(reference.attention_varlen_backward_lowp(dor, qr, kr, vr, cu_q, cu_k, dtype, causal),
                         reference.attention_backward_lowp(dense(dor, sq), dense(qr, sq), dense(kr, sk), dense(vr, sk),
                                                           dtype, causal)):
            np.testing.assert_array_equal(g, gd.reshape(g.shape))


def test_varlen_zero_length_sequences_give_no_output_and_no_gradient():
    """A sequence without keys: o = 0, lse = -inf, dq = 0; a sequence without queries: dk = dv = 0."""
    rng = np.random.default_rng(12)
    q, k, v, do, cu_q, cu_k = packed_problem(rng, [2, 3, 0], [3, 0, 4], 2, 1, 8)
    o, lse = reference.attention_varlen_forward64(q, k, v, cu_q, cu_k)
    assert np.all(o[2:5] == 0) and np.all(lse[:, 2:5] == -np.inf) and np.all(np.isfinite(lse[:, :2]))
    dq, dk, dv = reference.attention_varlen_backward64(do, q, k, v, cu_q, cu_k)
    assert np.all(dq[2:5] == 0) and np.all(dk[3:7] == 0) and np.all(dv[3:7] == 0)
    assert np.abs(dk[:3]).max() > 0 and np.abs(dq[:2]).max() > 0


@pytest.mark.parametrize("lens", VARLEN_LENGTHS[:2], ids=["mixed", "two"])
def test_xp_varlen_references_equal_reference(lens):
    rng = np.random.default_rng(13)
    q, k, v, do, cu_q, cu_k = packed_problem(rng, *lens, 4, 2, 8)
    for got, want in zip(_xpref.attention_varlen_forward64(q, k, v, cu_q, cu_k, True),
                         reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, True)):
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for got, want in zip(_xpref.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, True),
                         reference.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, True)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    qr, kr, vr, dor = (reference._round(x, "bf16") for x in (q, k, v, do))
    pairs = [(_xpref.attention_varlen_lowp(qr, kr, vr, cu_q, cu_k, "bf16", True),
              reference.attention_varlen_lowp(qr, kr, vr, cu_q, cu_k, "bf16", True))]
    pairs += zip(_xpref.attention_varlen_backward_lowp(dor, qr, kr, vr, cu_q, cu_k, "bf16", True),
                 reference.attention_varlen_backward_lowp(dor, qr, kr, vr, cu_q, cu_k, "bf16", True))
    for got, want in pairs:
        assert got.shape == want.shape and np.abs(got - want).max() <= 2 * _ulp("bf16", np.abs(want).max())


# --- KV cache: append into the cache, then dense attention over each sequence's first L_b keys -----------------

def kv_problem(rng, batch, sq, hq, hkv, d, capacity, page_size=None, s_new=0):
    """q, a dense or paged cache (shuffled blocks, two spare blocks, unused table entries -1), new k, v."""
    q = randn(rng, batch, sq, hq, d)
    k_new = v_new = None
    if s_new:
        k_new, v_new = randn(rng, batch, s_new, hkv, d), randn(rng, batch, s_new, hkv, d)
    if page_size is None:
        return q, randn(rng, batch, capacity, hkv, d), randn(rng, batch, capacity, hkv, d), None, k_new, v_new
    max_blocks = capacity // page_size
    num_blocks = batch * max_blocks + 2
    table = rng.permutation(num_blocks)[:batch * max_blocks].reshape(batch, max_blocks).astype(np.int32)
    caches = [randn(rng, num_blocks, page_size, hkv, d) for _ in range(2)]
    return q, caches[0], caches[1], table, k_new, v_new


def keys_by_loop(cache, b, length, table):
    """Logical keys 0..length-1 of sequence b, one at a time: dense cache[b, j]; paged
    cache[table[b, j // page_size], j % page_size]."""
    if table is None:
        return np.stack([cache[b, j] for j in range(length)]) if length else cache[b, :0]
    p = cache.shape[1]
    return np.stack([cache[table[b, j // p], j % p] for j in range(length)]) if length else cache[0, :0]


KV_CASES = [  # (batch, sq, hq, hkv, capacity, page_size, s_new, cache_seqlens)
    (3, 1, 4, 1, 10, None, 0, [0, 7, 10]),
    (3, 3, 2, 2, 12, None, 3, [0, 5, 9]),
    (2, 4, 4, 2, 12, 4, 2, [3, 10]),
    (2, 2, 2, 1, 16, 8, 0, 13),
    (2, 1, 2, 2, 8, 4, 0, None),
    (3, 5, 2, 1, 12, 4, 5, [0, 4, 7]),
]


@pytest.mark.parametrize("case", KV_CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-h{c[2]}x{c[3]}-cap{c[4]}-page{c[5]}-new{c[6]}")
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_reference_is_per_row_attention_over_the_valid_prefix(case, causal):
    batch, sq, hq, hkv, capacity, page, s_new, seqlens = case
    rng = np.random.default_rng(zlib.crc32(repr((case, causal)).encode()))
    q, k_cache, v_cache, table, k_new, v_new = kv_problem(rng, batch, sq, hq, hkv, 8, capacity, page, s_new)
    k_cache0, v_cache0 = k_cache.copy(), v_cache.copy()
    cs = np.asarray(seqlens, dtype=np.int32) if isinstance(seqlens, list) else seqlens
    o, lse, k_after, v_after = reference.attention_kvcache64(q, k_cache, v_cache, cs, k_new, v_new, table, causal)
    assert np.array_equal(k_cache, k_cache0) and np.array_equal(v_cache, v_cache0), "the arguments were modified"
    assert o.shape == q.shape and lse.shape == (batch, hq, sq)
    cached = [capacity] * batch if seqlens is None else [seqlens] * batch if isinstance(seqlens, int) else seqlens
    for b in range(batch):
        length = cached[b] + s_new
        keys, values = keys_by_loop(k_after, b, length, table), keys_by_loop(v_after, b, length, table)
        o_b, lse_b = per_row_attention(q[b:b + 1], keys[None], values[None], causal, 1 / math.sqrt(8))
        np.testing.assert_allclose(o[b], o_b[0], rtol=1e-12, atol=1e-12, err_msg=f"sequence {b}, L={length}")
        np.testing.assert_allclose(lse[b], lse_b[0], rtol=1e-12, atol=1e-12)
        if length == 0:
            assert np.all(o[b] == 0) and np.all(lse[b] == -np.inf)


@pytest.mark.parametrize("case", [c for c in KV_CASES if c[6]], ids=lambda c: f"page{c[5]}-new{c[6]}")
def test_kvcache_append_writes_exactly_the_new_slots(case):
    """New key t of sequence b lands at logical position cache_seqlens[b] + t (through the block table when
    paged); every other element of the caches keeps its value."""
    batch, sq, hq, hkv, capacity, page, s_new, seqlens = case
    rng = np.random.default_rng(21)
    _, k_cache, v_cache, table, k_new, v_new = kv_problem(rng, batch, sq, hq, hkv, 8, capacity, page, s_new)
    k_after, v_after = reference.kvcache_append(k_cache, v_cache, k_new, v_new, np.asarray(seqlens), table)
    written = np.zeros(k_cache.shape[:2], dtype=bool)
    for b in range(batch):
        for t in range(s_new):
            pos = seqlens[b] + t
            slot = (b, pos) if table is None else (table[b, pos // page], pos % page)
            np.testing.assert_array_equal(k_after[slot], k_new[b, t])
            np.testing.assert_array_equal(v_after[slot], v_new[b, t])
            written[slot] = True
    assert written.sum() == batch * s_new, "two new keys landed in one slot"
    np.testing.assert_array_equal(k_after[~written], k_cache[~written])
    np.testing.assert_array_equal(v_after[~written], v_cache[~written])


def test_paged_cache_equals_the_dense_cache_it_was_cut_from():
    rng = np.random.default_rng(22)
    batch, page, max_blocks, hkv, d = 2, 4, 3, 2, 8
    q, dense_k, dense_v = randn(rng, batch, 3, 4, d), randn(rng, batch, page * max_blocks, hkv, d), \
        randn(rng, batch, page * max_blocks, hkv, d)
    table = rng.permutation(batch * max_blocks + 1)[:batch * max_blocks].reshape(batch, max_blocks).astype(np.int32)
    paged_k, paged_v = (np.full((batch * max_blocks + 1, page, hkv, d), np.nan) for _ in range(2))
    for b in range(batch):
        for j in range(max_blocks):
            paged_k[table[b, j]] = dense_k[b, j * page:(j + 1) * page]
            paged_v[table[b, j]] = dense_v[b, j * page:(j + 1) * page]
    cs = np.array([5, 12], dtype=np.int32)
    o_d, lse_d, _, _ = reference.attention_kvcache64(q, dense_k, dense_v, cs, causal=True)
    o_p, lse_p, _, _ = reference.attention_kvcache64(q, paged_k, paged_v, cs, block_table=table, causal=True)
    np.testing.assert_array_equal(o_p, o_d)
    np.testing.assert_array_equal(lse_p, lse_d)


def test_kvcache_seqlens_none_int_and_array_agree():
    rng = np.random.default_rng(23)
    q, k_cache, v_cache, *_ = kv_problem(rng, 2, 2, 2, 1, 8, 9)
    full = reference.attention_kvcache64(q, k_cache, v_cache, None)[0]
    np.testing.assert_array_equal(full, reference.attention_kvcache64(q, k_cache, v_cache, 9)[0])
    np.testing.assert_array_equal(full, reference.attention_kvcache64(q, k_cache, v_cache, np.array([9, 9]))[0])
    part = reference.attention_kvcache64(q, k_cache, v_cache, 4)[0]
    np.testing.assert_array_equal(part, reference.attention_forward64(q, k_cache[:, :4], v_cache[:, :4])[0])


@pytest.mark.parametrize("case", KV_CASES, ids=lambda c: f"page{c[5]}-new{c[6]}-{c[7]}")
def test_xp_kvcache_references_equal_reference(case):
    batch, sq, hq, hkv, capacity, page, s_new, seqlens = case
    rng = np.random.default_rng(24)
    q, k_cache, v_cache, table, k_new, v_new = kv_problem(rng, batch, sq, hq, hkv, 8, capacity, page, s_new)
    cs = np.asarray(seqlens, dtype=np.int32) if isinstance(seqlens, list) else seqlens
    want = reference.attention_kvcache64(q, k_cache, v_cache, cs, k_new, v_new, table, True)
    got = _xpref.attention_kvcache64(q, k_cache, v_cache, cs, k_new, v_new, table, True)
    for name, g, w in zip(("o", "lse", "k_cache", "v_cache"), got, want):
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w), err_msg=name)
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=name)
    qr, kr, vr = (reference._round(x, "fp16") for x in (q, k_cache, v_cache))
    knr, vnr = (None, None) if k_new is None else (reference._round(k_new, "fp16"), reference._round(v_new, "fp16"))
    lowp = reference.attention_kvcache_lowp(qr, kr, vr, "fp16", cs, knr, vnr, table, True)
    got = _xpref.attention_kvcache_lowp(qr, kr, vr, "fp16", cs, knr, vnr, table, True)
    assert got.shape == lowp.shape and np.abs(got - lowp).max() <= _ulp("fp16", np.abs(lowp).max())
