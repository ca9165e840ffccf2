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
    """softmax(scale * q_i . k_j over visible j) . v, one query row at a time, in plain Python loops."""
    b_, sq, h_, d = q.shape
    sk = k.shape[1]
    o = np.zeros((b_, sq, h_, d))
    lse = np.full((b_, h_, sq), -np.inf)
    for b, h, i in itertools.product(range(b_), range(h_), range(sq)):
        visible = [j for j in range(sk) if not causal or j <= i + sk - sq]
        if not visible:
            continue  # a row that sees no key: o = 0, lse = -inf
        scores = [scale * sum(q[b, i, h, c] * k[b, j, h, c] for c in range(d)) for j in visible]
        m = max(scores)
        weights = [math.exp(s - m) for s in scores]
        total = sum(weights)
        lse[b, h, i] = m + math.log(total)
        for w, j in zip(weights, visible):
            o[b, i, h] += (w / total) * v[b, j, h]
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
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            plus = _loss(q, k, v, do, causal, scale)
            x[idx] = orig - eps
            minus = _loss(q, k, v, do, causal, scale)
            x[idx] = orig
            numeric[idx] = (plus - minus) / (2 * eps)
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
