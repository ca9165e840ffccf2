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


def keys_by_loop(cache, b, length, table, start=0, row=None):
    """Logical keys start..length-1 of sequence b, one at a time: dense cache[row, j] (row = b unless given); paged
    cache[table[b, j // page_size], j % page_size]."""
    positions = range(start, length)
    if table is None:
        row = b if row is None else row
        return np.stack([cache[row, j] for j in positions]) if length > start else cache[0, :0]
    p = cache.shape[1]
    return np.stack([cache[table[b, j // p], j % p] for j in positions]) if length > start else cache[0, :0]


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


# --- KV cache, FlashAttention-2's arguments: rotary, cache_leftpad, cache_batch_idx, window / ALiBi / softcap ------

def rotary_tables(rng, seqlen_ro, rotary_dim):
    """cos, sin (seqlen_ro, rotary_dim / 2) of random angles, float64."""
    angles = rng.uniform(-np.pi, np.pi, (seqlen_ro, rotary_dim // 2))
    return np.cos(angles), np.sin(angles)


def rotary_by_loop(x, cos, sin, positions, interleaved, ft=np.float64):
    """The rotary embedding one pair of one row at a time, computed in the scalar type ft: x (B, S, H, D), row (b, s)
    at position positions[b, s]; pair f = dims (2f, 2f + 1) interleaved, (f, f + rotary_dim / 2) not;
    (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)."""
    out = np.array(x, dtype=ft)
    half = cos.shape[1]
    for b, s, h, f in itertools.product(*(range(n) for n in x.shape[:3]), range(half)):
        i1, i2 = (2 * f, 2 * f + 1) if interleaved else (f, f + half)
        p = positions[b, s]
        x1, x2, c, sn = ft(out[b, s, h, i1]), ft(out[b, s, h, i2]), ft(cos[p, f]), ft(sin[p, f])
        out[b, s, h, i1] = x1 * c - x2 * sn
        out[b, s, h, i2] = x1 * sn + x2 * c
    return out


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_apply_rotary_matches_a_per_element_loop(interleaved, rotary_dim):
    """float64 and, with a dtype, float32 products rounded once to the dtype; dims past rotary_dim untouched (D = 16:
    rotary_dim 8 rotates half of them). cuflash._xpref gives the same bits."""
    rng = np.random.default_rng(rotary_dim + interleaved)
    x = randn(rng, 2, 3, 2, 16)
    cos, sin = rotary_tables(rng, 10, rotary_dim)
    positions = rng.integers(0, 10, (2, 3))
    got = reference.apply_rotary(x, cos, sin, positions, interleaved)
    np.testing.assert_array_equal(got, rotary_by_loop(x, cos, sin, positions, interleaved))
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])
    assert not np.allclose(got[..., :rotary_dim], x[..., :rotary_dim]), "nothing was rotated"
    np.testing.assert_array_equal(_xpref.apply_rotary(x, cos, sin, positions, interleaved), got)
    for dtype in ("fp16", "bf16"):
        xr = reference._round(x, dtype)
        cos32, sin32 = cos.astype(np.float32), sin.astype(np.float32)
        want = reference._round(rotary_by_loop(xr, cos32, sin32, positions, interleaved, np.float32), dtype)
        got = reference.apply_rotary(xr, cos32, sin32, positions, interleaved, dtype)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want, err_msg=dtype)
        np.testing.assert_array_equal(_xpref.apply_rotary(xr, cos32, sin32, positions, interleaved, dtype), want)


def test_apply_rotary_pairs_dims_as_gptj_and_neox():
    """A quarter turn at position 1 (cos 0, sin 1) maps each pair (x1, x2) to (-x2, x1)."""
    x = np.arange(1.0, 9.0).reshape(1, 1, 1, 8)
    cos, sin = np.array([[1.0, 1.0], [0.0, 0.0]]), np.array([[0.0, 0.0], [1.0, 1.0]])  # rotary_dim 4
    assert reference.apply_rotary(x, cos, sin, [[0]], True).ravel().tolist() == x.ravel().tolist()
    assert reference.apply_rotary(x, cos, sin, [[1]], True).ravel().tolist() == [-2, 1, -4, 3, 5, 6, 7, 8]
    assert reference.apply_rotary(x, cos, sin, [[1]], False).ravel().tolist() == [-3, -4, 1, 2, 5, 6, 7, 8]


def rotary_problem(rng, batch, sq, hq, hkv, d, capacity, page_size, rotary_dim, seqlen_ro=None):
    q, k_cache, v_cache, table, k_new, v_new = kv_problem(rng, batch, sq, hq, hkv, d, capacity, page_size, sq)
    cos, sin = rotary_tables(rng, capacity if seqlen_ro is None else seqlen_ro, rotary_dim)
    return q, k_cache, v_cache, table, k_new, v_new, cos, sin


@pytest.mark.parametrize("causal,window,moving", [(False, None, False), (True, None, True), (False, (-1, -1), False),
                                                  (False, (4, 0), True), (True, (-1, 2), True)])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_kvcache_rotary_rotates_q_at_cache_seqlens_plus_i_only_when_causal_or_windowed(causal, window, moving,
                                                                                       interleaved):
    """New key s of sequence b is rotated at cache_seqlens[b] + s, query i at cache_seqlens[b] + i with causal or a
    window, else at cache_seqlens[b]: equal to attention over q and new keys rotated by hand. The cache holds the
    rotated keys and the values as given."""
    rng = np.random.default_rng(zlib.crc32(repr(("rotary-q", causal, window, interleaved)).encode()))
    q, k_cache, v_cache, _, k_new, v_new, cos, sin = rotary_problem(rng, 2, 3, 4, 2, 8, 12, None, 6)
    cached = np.array([2, 9], dtype=np.int32)
    q_pos = cached[:, None] + (np.arange(3) if moving else np.zeros(3, dtype=np.int64))
    q_rot = rotary_by_loop(q, cos, sin, q_pos, interleaved)
    k_rot = rotary_by_loop(k_new, cos, sin, cached[:, None] + np.arange(3), interleaved)
    rotary = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    o, lse, k_after, v_after = reference.attention_kvcache64(q, k_cache, v_cache, cached, k_new, v_new, None, causal,
                                                             window=window, **rotary)
    o_hand, lse_hand, k_hand, v_hand = reference.attention_kvcache64(q_rot, k_cache, v_cache, cached, k_rot, v_new,
                                                                     None, causal, window=window)
    np.testing.assert_array_equal(o, o_hand)
    np.testing.assert_array_equal(lse, lse_hand)
    np.testing.assert_array_equal(k_after, k_hand)
    np.testing.assert_array_equal(v_after, v_hand)
    np.testing.assert_array_equal(v_after, reference.kvcache_append(k_cache, v_cache, k_new, v_new, cached)[1])
    other_pos = cached[:, None] + (np.zeros(3, dtype=np.int64) if moving else np.arange(3))
    o_other = reference.attention_kvcache64(rotary_by_loop(q, cos, sin, other_pos, interleaved), k_cache, v_cache,
                                            cached, k_rot, v_new, None, causal, window=window)[0]
    assert not np.allclose(o[:, 1:], o_other[:, 1:]), "the query positions make no difference"
    # the low-precision reference rotates the same way, rounding q and the new keys once
    lowp = reference.attention_kvcache_lowp(q, k_cache, v_cache, "bf16", cached, k_new, v_new, None, causal,
                                            window=window, **rotary)
    q_low = reference.apply_rotary(q, cos, sin, q_pos, interleaved, "bf16")
    k_low = reference.apply_rotary(k_new, cos, sin, cached[:, None] + np.arange(3), interleaved, "bf16")
    np.testing.assert_array_equal(lowp, reference.attention_kvcache_lowp(q_low, k_cache, v_cache, "bf16", cached,
                                                                         k_low, v_new, None, causal, window=window))
    # rotary_dtype: the float64 reference of the rounded rotations (the kernel's inputs)
    for got, want in zip(reference.attention_kvcache64(q, k_cache, v_cache, cached, k_new, v_new, None, causal,
                                                       window=window, rotary_dtype="bf16", **rotary),
                         reference.attention_kvcache64(q_low, k_cache, v_cache, cached, k_low, v_new, None, causal,
                                                       window=window)):
        np.testing.assert_array_equal(got, want)


LEFTPAD_CASES = [  # (batch, sq, hq, hkv, capacity, page_size, s_new, cache_seqlens, cache_leftpad)
    (3, 1, 4, 1, 10, None, 0, [0, 7, 10], [0, 3, 10]),
    (3, 3, 2, 2, 12, None, 3, [2, 5, 9], [2, 0, 4]),
    (2, 4, 4, 2, 12, 4, 2, [3, 10], [1, 9]),
    (3, 5, 2, 1, 16, 4, 5, [0, 4, 11], [0, 4, 6]),
]


@pytest.mark.parametrize("case", LEFTPAD_CASES, ids=lambda c: f"page{c[5]}-new{c[6]}-pad{'-'.join(map(str, c[8]))}")
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_leftpad_is_attention_over_the_rows_from_the_padding_on(case, causal):
    """Sequence b attends cache rows [cache_leftpad[b], cache_seqlens[b] + S_new) (the per-row formula on keys
    gathered one at a time), causal aligned to those L_b keys; a dense cache with each sequence's rows moved to the
    front (cache_seqlens reduced by the padding) gives the same bits."""
    batch, sq, hq, hkv, capacity, page, s_new, seqlens, leftpad = case
    rng = np.random.default_rng(zlib.crc32(repr(("leftpad", case, causal)).encode()))
    q, k_cache, v_cache, table, k_new, v_new = kv_problem(rng, batch, sq, hq, hkv, 8, capacity, page, s_new)
    cs, pad = np.asarray(seqlens, dtype=np.int32), np.asarray(leftpad, dtype=np.int32)
    o, lse, k_after, v_after = reference.attention_kvcache64(q, k_cache, v_cache, cs, k_new, v_new, table, causal,
                                                             cache_leftpad=pad)
    np.testing.assert_array_equal(k_after, reference.kvcache_append(k_cache, v_cache, k_new, v_new, cs, table)[0])
    for b in range(batch):
        stop = seqlens[b] + s_new
        keys, values = (keys_by_loop(c, b, stop, table, start=leftpad[b]) for c in (k_after, v_after))
        o_b, lse_b = per_row_attention(q[b:b + 1], keys[None], values[None], causal, 1 / math.sqrt(8))
        np.testing.assert_allclose(o[b], o_b[0], rtol=1e-12, atol=1e-12, err_msg=f"sequence {b}, L={stop - leftpad[b]}")
        np.testing.assert_allclose(lse[b], lse_b[0], rtol=1e-12, atol=1e-12)
    if table is None:
        moved_k, moved_v = np.zeros_like(k_cache), np.zeros_like(v_cache)
        for b in range(batch):
            n = seqlens[b] - leftpad[b]
            moved_k[b, :n], moved_v[b, :n] = k_cache[b, leftpad[b]:seqlens[b]], v_cache[b, leftpad[b]:seqlens[b]]
        o_moved, lse_moved, _, _ = reference.attention_kvcache64(q, moved_k, moved_v, cs - pad, k_new, v_new, None,
                                                                 causal)
        np.testing.assert_array_equal(o, o_moved)
        np.testing.assert_array_equal(lse, lse_moved)


@pytest.mark.parametrize("rows,s_new", [([4, 0, 2], 2), ([1, 1, 3], 0)], ids=["distinct-new", "shared-read"])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_batch_idx_equals_the_permuted_cache(rows, s_new, causal):
    """cache_batch_idx[b] = r: batch entry b reads (and writes) cache row r; equal to the call on k_cache[rows], the
    new keys landing in rows r, every other row unchanged. Without new keys rows may repeat."""
    rng = np.random.default_rng(zlib.crc32(repr(("batch-idx", rows, causal)).encode()))
    q, k_cache, v_cache, _, k_new, v_new = kv_problem(rng, 5, 2, 4, 2, 8, 9, None, s_new)
    q = q[:3]
    k_new, v_new = (None, None) if k_new is None else (k_new[:3], v_new[:3])
    cs, idx = np.array([3, 0, 7], dtype=np.int32), np.asarray(rows, dtype=np.int32)
    o, lse, k_after, v_after = reference.attention_kvcache64(q, k_cache, v_cache, cs, k_new, v_new, None, causal,
                                                             cache_batch_idx=idx)
    o_p, lse_p, k_p, v_p = reference.attention_kvcache64(q, k_cache[idx], v_cache[idx], cs, k_new, v_new, None, causal)
    np.testing.assert_array_equal(o, o_p)
    np.testing.assert_array_equal(lse, lse_p)
    np.testing.assert_array_equal(k_after[idx], k_p)
    np.testing.assert_array_equal(v_after[idx], v_p)
    untouched = np.setdiff1d(np.arange(5), idx)
    np.testing.assert_array_equal(k_after[untouched], k_cache[untouched])
    np.testing.assert_array_equal(v_after[untouched], v_cache[untouched])


MODS = [  # (window, alibi slopes shape "h" / "bh" / None, softcap)
    ((2, 1), None, None), ((0, 0), None, None), ((-1, 3), None, None), (None, "h", None), (None, "bh", None),
    (None, None, 1.5), ((3, -1), "bh", 2.0),
]


@pytest.mark.parametrize("mods", MODS, ids=lambda m: f"w{m[0]}-alibi{m[1]}-cap{m[2]}")
@pytest.mark.parametrize("page,causal", [(None, False), (4, True)])
def test_kvcache_modifiers_are_dense_attention_on_the_gathered_keys(mods, page, causal):
    """window, ALiBi and softcap per sequence over its own keys (rows cache_leftpad[b] .. cache_seqlens[b] + S_new,
    diag = L_b - Sq), slopes (H_q,) shared or row b of (B, H_q): attention_forward64 / attention_lowp on the keys
    gathered one at a time."""
    window, alibi, softcap = mods
    rng = np.random.default_rng(zlib.crc32(repr(("kv-mods", mods, page, causal)).encode()))
    batch, sq, hq, hkv = 3, 3, 4, 2
    q, k_cache, v_cache, table, k_new, v_new = kv_problem(rng, batch, sq, hq, hkv, 8, 16, page, 2)
    cs, pad = np.array([1, 9, 14], dtype=np.int32), np.array([0, 4, 14], dtype=np.int32)  # L_b = 3, 7, 2 < Sq
    slopes = None if alibi is None else rng.random((hq,) if alibi == "h" else (batch, hq)) * 0.5
    kw = dict(cache_leftpad=pad, window=window, alibi_slopes=slopes, softcap=softcap)
    o, lse, k_after, v_after = reference.attention_kvcache64(q, k_cache, v_cache, cs, k_new, v_new, table, causal, **kw)
    qr, kr, vr, knr, vnr = (reference._round(x, "fp16") for x in (q, k_cache, v_cache, k_new, v_new))
    lowp = reference.attention_kvcache_lowp(qr, kr, vr, "fp16", cs, knr, vnr, table, causal, **kw)
    k_low, v_low = reference.kvcache_append(kr, vr, knr, vnr, cs, table)
    for b in range(batch):
        stop = cs[b] + 2
        keys, values = (keys_by_loop(c, b, stop, table, start=pad[b])[None] for c in (k_after, v_after))
        slopes_b = None if slopes is None else slopes if slopes.ndim == 1 else slopes[b]
        mods_b = dict(window=window, alibi_slopes=slopes_b, softcap=softcap)
        o_b, lse_b = reference.attention_forward64(q[b:b + 1], keys, values, causal, **mods_b)
        np.testing.assert_array_equal(o[b], o_b[0], err_msg=f"sequence {b}")
        np.testing.assert_array_equal(lse[b], lse_b[0], err_msg=f"sequence {b}")
        keys, values = (keys_by_loop(c, b, stop, table, start=pad[b])[None] for c in (k_low, v_low))
        np.testing.assert_array_equal(lowp[b], reference.attention_lowp(qr[b:b + 1], keys, values, "fp16", causal,
                                                                        **mods_b)[0])
    if window == (0, 0) and not causal:  # one query row sees exactly its diagonal key: row i -> key i + L_b - Sq
        seen_empty = False
        for b in range(batch):
            length = cs[b] + 2 - pad[b]
            for i in range(sq):
                j = i + length - sq
                if j >= 0:
                    np.testing.assert_allclose(o[b, i], np.repeat(keys_by_loop(v_after, b, pad[b] + j + 1, table,
                                                                               start=pad[b] + j)[0], hq // hkv, 0),
                                               rtol=1e-12, atol=1e-12)
                else:
                    assert np.all(o[b, i] == 0) and np.all(lse[b, :, i] == -np.inf), f"sequence {b} row {i}"
                    seen_empty = True
        assert seen_empty, "no row without a visible key"


XP_KV_NEW = [  # (page_size, options): every new argument on NumPy arrays, the mirror against the reference
    (None, dict(cache_batch_idx=[3, 0, 1], cache_leftpad=[0, 2, 5], rotary="gptj", causal=True)),
    (4, dict(cache_leftpad=[1, 0, 6], rotary="neox", window=(3, 0))),
    (None, dict(alibi="bh", softcap=1.5, rotary="neox")),
    (4, dict(cache_leftpad=[0, 2, 2], rotary="gptj", window=(2, 2), alibi="h", softcap=3.0, causal=True)),
]


@pytest.mark.parametrize("page,opts", XP_KV_NEW, ids=[f"page{c[0]}-" + "-".join(sorted(c[1])) for c in XP_KV_NEW])
def test_xp_kvcache_new_arguments_equal_reference(page, opts):
    rng = np.random.default_rng(zlib.crc32(repr(("xp-kv-new", page, sorted(opts))).encode()))
    batch, sq, hq, hkv, d = 3, 2, 4, 2, 16
    q, k_cache, v_cache, table, k_new, v_new = kv_problem(rng, 4 if page is None else batch, sq, hq, hkv, d, 12, page,
                                                          sq)
    q, k_new, v_new = q[:batch], k_new[:batch], v_new[:batch]
    causal = opts.get("causal", False)
    cos, sin = rotary_tables(rng, 12, 8)
    kw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=opts["rotary"] == "gptj", window=opts.get("window"),
              softcap=opts.get("softcap"))
    for name in ("cache_batch_idx", "cache_leftpad"):
        if name in opts:
            kw[name] = np.asarray(opts[name], dtype=np.int32)
    if "alibi" in opts:
        kw["alibi_slopes"] = rng.random((hq,) if opts["alibi"] == "h" else (batch, hq)).astype(np.float32)
    cs = np.array([5, 2, 9], dtype=np.int32)
    for rotary_dtype in (None, "fp16"):
        want = reference.attention_kvcache64(q, k_cache, v_cache, cs, k_new, v_new, table, causal, **kw,
                                             rotary_dtype=rotary_dtype)
        got = _xpref.attention_kvcache64(q, k_cache, v_cache, cs, k_new, v_new, table, causal, **kw,
                                         rotary_dtype=rotary_dtype)
        for name, g, w in zip(("o", "lse", "k_cache", "v_cache"), got, want):
            np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w), err_msg=f"{name}, {rotary_dtype}")
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=f"{name}, {rotary_dtype}")
    for dtype in ("fp16", "bf16"):
        qr, kr, vr, knr, vnr = (reference._round(x, dtype) for x in (q, k_cache, v_cache, k_new, v_new))
        lowp = reference.attention_kvcache_lowp(qr, kr, vr, dtype, cs, knr, vnr, table, causal, **kw)
        got = _xpref.attention_kvcache_lowp(qr, kr, vr, dtype, cs, knr, vnr, table, causal, **kw)
        assert got.shape == lowp.shape and np.abs(got - lowp).max() <= _ulp(dtype, np.abs(lowp).max()), dtype
        k_want = reference.kvcache_append(kr, vr, knr, vnr, cs, table, cache_batch_idx=kw.get("cache_batch_idx"),
                                          rotary_cos=cos, rotary_sin=sin, rotary_interleaved=kw["rotary_interleaved"],
                                          dtype=dtype)
        k_got = _xpref.kvcache_append(kr, vr, knr, vnr, cs, table, cache_batch_idx=kw.get("cache_batch_idx"),
                                      rotary_cos=cos, rotary_sin=sin, rotary_interleaved=kw["rotary_interleaved"],
                                      dtype=dtype)
        for g, w in zip(k_got, k_want):
            np.testing.assert_array_equal(g, w, err_msg=f"appended caches, {dtype}")


def _bad_kvcache_call(change):
    """A small valid dense call (batch 3, cache rows 4, capacity 12, 2 new keys, rotary_dim 8 of D 16) with one
    argument broken by `change`, which returns the call's keyword arguments."""
    rng = np.random.default_rng(31)
    q, k_cache, v_cache, _, k_new, v_new = kv_problem(rng, 4, 2, 4, 2, 16, 12, None, 2)
    cos, sin = rotary_tables(rng, 12, 8)
    kw = dict(q=q[:3], k_cache=k_cache, v_cache=v_cache, cache_seqlens=np.array([3, 0, 10], dtype=np.int32),
              k=k_new[:3], v=v_new[:3], rotary_cos=cos, rotary_sin=sin)
    return change(kw)


def _paged(kw):
    kw["block_table"] = np.arange(12, dtype=np.int32).reshape(3, 4)
    kw["k_cache"], kw["v_cache"] = kw["k_cache"].reshape(12, 4, 2, 16), kw["v_cache"].reshape(12, 4, 2, 16)
    return kw


KV_REF_BAD = [  # (id, change, exception, message fragments)
    ("batch-idx-out-of-range", lambda kw: {**kw, "cache_batch_idx": np.array([0, 5, 1], np.int32)}, ValueError,
     ["cache_batch_idx[1]=5", "out of range", "< 4"]),
    ("batch-idx-negative", lambda kw: {**kw, "cache_batch_idx": np.array([0, 1, -1], np.int32)}, ValueError,
     ["cache_batch_idx[2]=-1"]),
    ("batch-idx-repeated-with-new-keys", lambda kw: {**kw, "cache_batch_idx": np.array([2, 0, 2], np.int32)},
     ValueError, ["cache_batch_idx[2]=2 repeats cache_batch_idx[0]=2", "distinct"]),
    ("batch-idx-float", lambda kw: {**kw, "cache_batch_idx": np.array([0, 1, 2], np.float32)}, TypeError,
     ["cache_batch_idx has dtype float32"]),
    ("batch-idx-with-block-table", lambda kw: {**_paged(kw), "cache_batch_idx": np.array([0, 1, 2], np.int32)},
     ValueError, ["cache_batch_idx", "block_table"]),
    ("leftpad-over-seqlens", lambda kw: {**kw, "cache_leftpad": np.array([0, 1, 0], np.int32)}, ValueError,
     ["cache_leftpad[1]=1", "cache_seqlens[1]=0"]),
    ("leftpad-negative", lambda kw: {**kw, "cache_leftpad": np.array([-1, 0, 0], np.int32)}, ValueError,
     ["cache_leftpad[0]=-1"]),
    ("leftpad-shape", lambda kw: {**kw, "cache_leftpad": np.array([0, 0], np.int32)}, ValueError,
     ["cache_leftpad has shape (2,)", "(3,)"]),
    ("rotary-without-new-keys", lambda kw: {**kw, "k": None, "v": None}, ValueError, ["rotary_cos", "k=None"]),
    ("rotary-cos-without-sin", lambda kw: {**kw, "rotary_sin": None}, ValueError, ["rotary_sin=None"]),
    ("rotary-sin-shape-differs", lambda kw: {**kw, "rotary_sin": kw["rotary_sin"][:, :2]}, ValueError,
     ["rotary_sin has shape (12, 2)", "rotary_cos has (12, 4)"]),
    ("rotary-dim-over-head-dim", lambda kw: {**kw, "rotary_cos": np.ones((12, 9)), "rotary_sin": np.ones((12, 9))},
     ValueError, ["rotary_dim=18", "head_dim=16"]),
    ("rotary-int-tables", lambda kw: {**kw, "rotary_cos": np.ones((12, 4), np.int32)}, TypeError,
     ["rotary_cos has dtype int32"]),
    ("seqlen-ro-under-positions", lambda kw: {**kw, "rotary_cos": kw["rotary_cos"][:11],
                                              "rotary_sin": kw["rotary_sin"][:11]}, ValueError,
     ["rotary position 11", "seqlen_ro=11"]),
    ("alibi-shape", lambda kw: {**kw, "alibi_slopes": np.ones(3, np.float32)}, ValueError,
     ["alibi_slopes has shape (3,)", "(4,) or (3, 4)"]),
    ("window-left-minus-2", lambda kw: {**kw, "window": (-2, 0)}, ValueError, ["window left=-2"]),
    ("softcap-negative", lambda kw: {**kw, "softcap": -1.0}, ValueError, ["softcap=-1.0"]),
]


@pytest.mark.parametrize("change,exc,parts", [c[1:] for c in KV_REF_BAD], ids=[c[0] for c in KV_REF_BAD])
@pytest.mark.parametrize("mod", [reference, _xpref], ids=["reference", "xpref"])
def test_kvcache_references_reject_bad_new_arguments(mod, change, exc, parts):
    kw = _bad_kvcache_call(change)
    q, k_cache, v_cache = kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache")
    for call in (lambda: mod.attention_kvcache64(q, k_cache, v_cache, **kw),
                 lambda: mod.attention_kvcache_lowp(q, k_cache, v_cache, "fp16", **kw)):
        with pytest.raises(exc) as e:
            call()
        missing = [p for p in parts if p not in str(e.value)]
        assert not missing, f"{mod.__name__}: message lacks {missing}: {str(e.value)!r}"


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (7, 3))])
def test_fp8_emulation_is_attention_with_p_rounded_to_e4m3(causal, window):
    """attention_fp8_emulated64 (the FP8 forward's yardstick): P = exp(S - m) 2^8 rounded to e4m3 moves each
    probability by at most 2^-4 of itself (e4m3 keeps 3 mantissa bits; the scaled P stays in e4m3's normal range
    down to 2^-14 of the row maximum), so O moves by at most 2^-4 max|v|, and by something: the rounding is real."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, n, 3, 16)) for n in (37, 53, 53))
    o64, _ = reference.attention_forward64(q, k, v, causal, window=window)
    emul = reference.attention_fp8_emulated64(q, k, v, causal, window=window)
    err = np.abs(emul - o64).max()
    assert 1e-4 < err <= 2.0 ** -4 * np.abs(v).max() + 2.0 ** -14 * 53 * np.abs(v).max(), err
