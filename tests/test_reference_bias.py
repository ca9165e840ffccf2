"""Additive attention bias and boolean masks in cuflash.reference (and its CuPy mirror cuflash._xpref, checked here
on NumPy arrays): the broadcast rule (expand_broadcast) and its adjoint (reduce_broadcast), the float64 forward
against a per-element loop written from the definitions, dbias and dq, dk, dv against central differences, fully
masked rows, the low-precision references against float64, packed batches, and the plain path left bit for bit
when the new arguments are None (or a zero bias and all-True masks)."""
from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest

from cuflash import _xpref, philox, reference
from test_reference import _central_difference, _ulp, packed_problem, randn
from test_reference_mods import broadcast_element, per_element_attention


def problem(rng, b, sq, sk, hq, hkv, d):
    """Random q (B, Sq, H_q, D), k, v (B, Sk, H_kv, D) and do (like q)."""
    return randn(rng, b, sq, hq, d), randn(rng, b, sk, hkv, d), randn(rng, b, sk, hkv, d), randn(rng, b, sq, hq, d)


def as4(x):
    """x (ndim 2..4) left-padded with size-1 dims to 4-D (None stays None)."""
    return None if x is None else np.asarray(x).reshape((1,) * (4 - np.ndim(x)) + np.shape(x))


# --- the broadcast rule ---------------------------------------------------------------------------------------

B, H, SQ, SK = 4, 6, 3, 5
BROADCAST_SHAPES = [  # every size-1 pattern of a 4-D bias, batch / head divisors, 3-D and 2-D
    *[(bb, hb, sqb, skb) for bb in (1, 2, 4) for hb in (1, 3, 6) for sqb in (1, SQ) for skb in (1, SK)],
    (H, SQ, SK), (2, SQ, SK), (1, 1, SK), (3, SQ, 1), (SQ, SK), (1, SK), (SQ, 1), (1, 1),
]


@pytest.mark.parametrize("shape", BROADCAST_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_expand_broadcast_is_the_definition(shape):
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    full = reference.expand_broadcast(x, B, H, SQ, SK)
    assert full.shape == (B, H, SQ, SK) and full.dtype == x.dtype
    x4 = as4(x)
    for b, h, i, j in np.ndindex(full.shape):
        assert full[b, h, i, j] == broadcast_element(x4, B, H, b, h, i, j), f"{shape}: element {(b, h, i, j)}"
    np.testing.assert_array_equal(_xpref.expand_broadcast(x, B, H, SQ, SK), full)
    assert reference.expand_broadcast(x > 7, B, H, SQ, SK).dtype == bool


@pytest.mark.parametrize("shape", BROADCAST_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reduce_broadcast_is_the_adjoint(shape):
    """<expand(x), y> == <x, reduce(y)> for every x, y; reduce(ones) counts the scores that read each element."""
    rng = np.random.default_rng(zlib.crc32(repr(shape).encode()))
    x, y = rng.standard_normal(shape), rng.standard_normal((B, H, SQ, SK))
    reduced = reference.reduce_broadcast(y, shape)
    assert reduced.shape == tuple(shape)
    np.testing.assert_allclose(np.sum(reference.expand_broadcast(x, B, H, SQ, SK) * y), np.sum(x * reduced), rtol=1e-12)
    readers = B * H * SQ * SK // math.prod(shape)
    np.testing.assert_array_equal(reference.reduce_broadcast(np.ones((B, H, SQ, SK)), shape), np.full(shape, readers))
    np.testing.assert_allclose(_xpref.reduce_broadcast(y, shape), reduced, rtol=1e-13, atol=1e-13)


def test_evoformer_fold_reads_bias_batch_b_over_n():
    """q (B0, N, L, H, D) folded to (B0 * N, L, H, D) with a bias (B0, H, L, L): sequence b reads bias b // N."""
    b0, n, heads, length = 2, 3, 4, 5
    bias = np.random.default_rng(0).standard_normal((b0, heads, length, length))
    full = reference.expand_broadcast(bias, b0 * n, heads, length, length)
    for b in range(b0 * n):
        np.testing.assert_array_equal(full[b], bias[b // n])


@pytest.mark.parametrize("shape,match", [
    ((5,), "expected 2 to 4 dims"), ((1, 1, 1, SQ, SK), "expected 2 to 4 dims"),
    ((3, H, SQ, SK), "batch dim 3 does not divide 4"), ((0, H, SQ, SK), "batch dim 0 does not divide 4"),
    ((4, H, SQ, SK), None), ((B, 4, SQ, SK), "heads dim 4 does not divide 6"),
    ((B, H, 2, SK), "seqlen_q dim is 2; expected 1 or 3"), ((SQ, SK + 1), "seqlen_k dim is 6; expected 1 or 5"),
])
def test_broadcast_shape_errors_name_the_argument(shape, match):
    if match is None:
        assert reference.broadcast_shape4(shape, B, H, SQ, SK) == shape
        return
    with pytest.raises(ValueError, match=match):
        reference.broadcast_shape4(shape, B, H, SQ, SK, "bias")
    q, k = np.ones((B, SQ, H, 4)), np.ones((B, SK, H, 4))
    with pytest.raises(ValueError, match="bias has shape"):
        reference.attention_forward64(q, k, k, bias=np.zeros(shape))
    with pytest.raises(ValueError, match="mask has shape"):
        reference.attention_lowp(q, k, k, "fp16", mask=np.ones(shape, bool))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(bias=np.zeros((3, 4), np.int32)), TypeError, "bias has dtype int32"),
    (dict(mask=np.ones((3, 4))), TypeError, "mask has dtype float64"),
    (dict(key_padding_mask=np.ones((1, 4))), TypeError, "key_padding_mask has dtype float64"),
    (dict(key_padding_mask=np.ones((1, 3), bool)), ValueError,
     r"key_padding_mask has shape \(1, 3\); expected \(1, 4\)"),
    (dict(key_padding_mask=np.ones((4,), bool)), ValueError, r"key_padding_mask has shape \(4,\)"),
])
def test_bad_bias_and_masks_name_the_argument(kwargs, error, match):
    q, k = np.ones((1, 3, 2, 4)), np.ones((1, 4, 1, 4))
    with pytest.raises(error, match=match):
        reference.attention_forward64(q, k, k, **kwargs)
    with pytest.raises(error, match=match):
        reference.attention_backward_lowp(q, q, k, k, "bf16", **kwargs)


# --- float64 forward against the per-element loop --------------------------------------------------------------

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
SHAPES = [(4, 5, 7, 4, 2, 4), (2, 7, 4, 2, 1, 4), (2, 1, 6, 2, 2, 4)]

# name -> (bias shape as a function of (B, H, Sq, Sk) or None, mask shape or None, key padding?, modifiers)
CASES = {
    "bias-full": (lambda b, h, sq, sk: (b, h, sq, sk), None, False, {}),
    "bias-divisors": (lambda b, h, sq, sk: (b // 2, h // 2, sq, sk), None, False, {}),
    "bias-keys": (lambda b, h, sq, sk: (b, 1, 1, sk), None, False, {}),
    "bias-rows": (lambda b, h, sq, sk: (1, h, sq, 1), None, False, {}),
    "bias-2d": (lambda b, h, sq, sk: (sq, sk), None, False, {}),
    "bias-3d": (lambda b, h, sq, sk: (h, 1, sk), None, False, {}),
    "mask": (None, lambda b, h, sq, sk: (b, h, sq, sk), False, {}),
    "mask-broadcast": (None, lambda b, h, sq, sk: (1, h // 2, sq, sk), False, {}),
    "padding": (None, None, True, {}),
    "mask-padding-bias": (lambda b, h, sq, sk: (b, h, sq, sk), lambda b, h, sq, sk: (sq, sk), True, {}),
    "bias-causal": (lambda b, h, sq, sk: (b // 2, h, sq, sk), None, True, dict(causal=True)),
    "bias-softcap": (lambda b, h, sq, sk: (b, h, sq, sk), None, False, dict(softcap=1.5)),
    "bias-rows-softcap": (lambda b, h, sq, sk: (b, 1, sq, 1), None, False, dict(softcap=1.5)),
    "bias-window-alibi": (lambda b, h, sq, sk: (1, h, 1, sk), lambda b, h, sq, sk: (b, 1, sq, sk), False,
                          dict(window=(2, 1), alibi=True)),
    "all": (lambda b, h, sq, sk: (b, h // 2, sq, sk), lambda b, h, sq, sk: (b, h, sq, sk), True,
            dict(causal=True, window=(3, 0), alibi=True, softcap=2.0, dropout=0.25)),
}


def make_case(name, shape, seed, bias_dtype=np.float64):
    """(causal, reference keyword arguments, per-element loop keyword arguments) of CASES[name]: bias normal * 1.5
    in bias_dtype, masks keeping ~70% (a mask row of batch 0 and the padding of the last batch keep nothing)."""
    b, sq, sk, hq, _, _ = shape
    bias_shape, mask_shape, padding, mods = CASES[name]
    rng = np.random.default_rng(seed)
    kw = {}
    if bias_shape is not None:
        kw["bias"] = (1.5 * rng.standard_normal(bias_shape(b, hq, sq, sk))).astype(bias_dtype)
    if mask_shape is not None:
        mask = rng.random(mask_shape(b, hq, sq, sk)) < 0.7
        mask.reshape(-1, mask.shape[-1])[0] = False  # one fully masked row
        kw["mask"] = mask
    if padding:
        kpm = rng.random((b, sk)) < 0.7
        kpm[-1] = False  # the last batch sees no key at all
        kw["key_padding_mask"] = kpm
    if "window" in mods:
        kw["window"] = mods["window"]
    if "alibi" in mods:
        kw["alibi_slopes"] = (0.25 + np.arange(hq) / 3).astype(np.float32)
    if "softcap" in mods:
        kw["softcap"] = mods["softcap"]
    if "dropout" in mods:
        kw.update(dropout_p=mods["dropout"], dropout_mask=philox.dropout_mask(b, hq, sq, sk, mods["dropout"], seed))
    loop = dict(window=kw.get("window"), slopes=kw.get("alibi_slopes"), softcap=kw.get("softcap"), bias=kw.get("bias"),
                mask=kw.get("mask"), key_padding_mask=kw.get("key_padding_mask"), keep=kw.get("dropout_mask"),
                p=kw.get("dropout_p", 0.0))
    return mods.get("causal", False), kw, loop


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(CASES))
def test_forward64_matches_the_per_element_loop(shape, name):
    b, sq, sk, hq, hkv, d = shape
    seed = zlib.crc32(repr((shape, name)).encode())
    rng = np.random.default_rng(seed)
    q, k, v = randn(rng, b, sq, hq, d), randn(rng, b, sk, hkv, d), randn(rng, b, sk, hkv, d)
    causal, kw, loop = make_case(name, shape, seed)
    o, lse = reference.attention_forward64(q, k, v, causal, 0.6, **kw)
    o_loop, lse_loop = per_element_attention(q, k, v, 0.6, causal, **loop)
    np.testing.assert_allclose(o, o_loop, rtol=1e-12, atol=1e-12, err_msg=f"o mismatch for {name} {shape}")
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_loop), err_msg=f"-inf rows differ for {name}")
    np.testing.assert_allclose(lse, lse_loop, rtol=1e-12, atol=1e-12, err_msg=f"lse mismatch for {name} {shape}")


@pytest.mark.parametrize("bias_dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_bias_of_any_float_dtype_is_its_values(bias_dtype):
    rng = np.random.default_rng(2)
    q, k, v = randn(rng, 2, 5, 2, 4), randn(rng, 2, 6, 2, 4), randn(rng, 2, 6, 2, 4)
    bias = rng.standard_normal((2, 1, 5, 6)).astype(bias_dtype)
    for got, want in zip(reference.attention_forward64(q, k, v, bias=bias),
                         reference.attention_forward64(q, k, v, bias=bias.astype(np.float64))):
        np.testing.assert_array_equal(got, want)


def test_mask_is_a_minus_inf_bias_and_key_padding_is_a_broadcast_mask():
    rng = np.random.default_rng(3)
    q, k, v, do = randn(rng, 2, 5, 2, 4), randn(rng, 2, 6, 1, 4), randn(rng, 2, 6, 1, 4), randn(rng, 2, 5, 2, 4)
    mask = rng.random((2, 2, 5, 6)) < 0.6
    minus_inf = np.where(mask, 0.0, -np.inf)
    for got, want in zip(reference.attention_forward64(q, k, v, mask=mask),
                         reference.attention_forward64(q, k, v, bias=minus_inf)):
        np.testing.assert_array_equal(got, want)
    kpm = rng.random((2, 6)) < 0.6
    for fn, args in ((reference.attention_forward64, (q, k, v)), (reference.attention_backward64, (do, q, k, v))):
        for got, want in zip(fn(*args, True, key_padding_mask=kpm), fn(*args, True, mask=kpm[:, None, None, :])):
            np.testing.assert_array_equal(got, want)
    both = reference.attention_forward64(q, k, v, mask=mask, key_padding_mask=kpm)
    for got, want in zip(both, reference.attention_forward64(q, k, v, mask=mask & kpm[:, None, None, :])):
        np.testing.assert_array_equal(got, want)


# --- backward: central differences ---------------------------------------------------------------------------

FD_CASES = [("bias-full", SHAPES[0]), ("bias-divisors", SHAPES[0]), ("bias-keys", SHAPES[1]), ("bias-rows", SHAPES[1]),
            ("bias-2d", SHAPES[2]), ("bias-3d", SHAPES[0]), ("bias-rows-softcap", SHAPES[0]),
            ("mask-padding-bias", SHAPES[0]),
            ("bias-causal", SHAPES[1]), ("bias-softcap", SHAPES[0]), ("bias-window-alibi", SHAPES[1]),
            ("all", SHAPES[0])]


@pytest.mark.parametrize("name,shape", FD_CASES, ids=lambda x: str(x))
def test_backward64_matches_central_finite_differences(name, shape):
    """dq, dk, dv and dbias (every bias element) = the central difference of sum(o * do)."""
    b, sq, sk, hq, hkv, d = shape
    seed = zlib.crc32(repr(("fd", name, shape)).encode())
    rng = np.random.default_rng(seed)
    q, k, v, do = problem(rng, b, sq, sk, hq, hkv, d)
    causal, kw, _ = make_case(name, shape, seed)
    grads = reference.attention_backward64(do, q, k, v, causal, 0.7, **kw)
    assert len(grads) == 4 and grads[3].shape == kw["bias"].shape and grads[3].dtype == np.float64

    def loss():
        return float(np.sum(reference.attention_forward64(q, k, v, causal, 0.7, **kw)[0] * do))

    for which, x, g in zip(("dq", "dk", "dv", "dbias"), (q, k, v, kw["bias"]), grads):
        numeric = _central_difference(x, loss, 1e-6)
        err = np.abs(g - numeric).max()
        assert err <= 1e-7 * max(1.0, np.abs(numeric).max()), f"{name}: {which} vs finite differences: {err:.2e}"
        if which == "dbias" and x.shape[-1] == 1 and "softcap" not in kw:
            # a bias constant along a row shifts its scores: softmax ignores it, dbias = rowsum(dS) = 0
            assert np.abs(g).max() <= 1e-12, f"{name}: dbias of a row-constant bias is {np.abs(g).max():.2e}"
        else:
            assert np.abs(numeric).max() > 1e-3, f"{name}: {which} is all but zero, the check says nothing"


def test_dbias_of_a_broadcast_bias_is_the_reduced_dbias_of_its_expansion():
    """Backward with a broadcast bias == backward with the expanded (B, H, Sq, Sk) bias, dbias reduced."""
    rng = np.random.default_rng(4)
    q, k, v, do = randn(rng, 4, 5, 4, 4), randn(rng, 4, 6, 2, 4), randn(rng, 4, 6, 2, 4), randn(rng, 4, 5, 4, 4)
    for shape in [(2, 2, 1, 6), (1, 4, 5, 1), (5, 6), (2, 1, 1)]:
        bias = rng.standard_normal(shape)
        full = np.ascontiguousarray(reference.expand_broadcast(bias, 4, 4, 5, 6))
        got = reference.attention_backward64(do, q, k, v, True, softcap=3.0, bias=bias)
        want = reference.attention_backward64(do, q, k, v, True, softcap=3.0, bias=full)
        for g, w in zip(got[:3], want[:3]):
            np.testing.assert_array_equal(g, w)
        np.testing.assert_allclose(got[3], reference.reduce_broadcast(want[3], shape), rtol=1e-12, atol=1e-15)


# --- fully masked rows, and the plain path -----------------------------------------------------------------------

def test_fully_masked_rows_give_zero_minus_inf_and_no_gradient():
    """Rows whose mask is all False, and a batch whose key padding is all False: o = 0, lse = -inf, dq = 0 and
    dbias = 0 on those rows, everything finite, in every reference."""
    rng = np.random.default_rng(5)
    b, sq, sk, hq, hkv, d = 2, 6, 5, 2, 1, 4
    q, k, v, do = problem(rng, b, sq, sk, hq, hkv, d)
    bias = rng.standard_normal((b, hq, sq, sk))
    mask = np.ones((b, hq, sq, sk), dtype=bool)
    mask[0, :, [1, 4]] = False  # batch 0, rows 1 and 4 of every head
    mask[0, 1, 2, :] = False  # batch 0, head 1, row 2
    kpm = np.ones((b, sk), dtype=bool)
    kpm[1] = False  # batch 1 sees nothing
    dead = ~(mask & kpm[:, None, None, :]).any(axis=-1)  # (B, H, Sq)
    kw = dict(bias=bias, mask=mask, key_padding_mask=kpm)
    for mod in (reference, _xpref):
        o, lse = mod.attention_forward64(q, k, v, **kw)
        assert np.all(lse[dead] == -np.inf) and np.all(np.isfinite(lse[~dead])), mod.__name__
        assert np.all(o.transpose(0, 2, 1, 3)[dead] == 0), mod.__name__
        for grads in (mod.attention_backward64(do, q, k, v, **kw),
                      mod.attention_backward_lowp(do, q, k, v, "bf16", **kw)):
            dq, dk, dv, dbias = grads
            assert all(np.all(np.isfinite(g)) for g in grads), mod.__name__
            assert np.all(dq.transpose(0, 2, 1, 3)[dead] == 0) and np.all(dbias[dead] == 0), mod.__name__
            assert np.all(dk[1] == 0) and np.all(dv[1] == 0), "batch 1 sees no key: no gradient for its keys"
            assert np.abs(dbias[~dead]).max() > 0
        assert np.all(mod.attention_lowp(q, k, v, "fp16", **kw).transpose(0, 2, 1, 3)[dead] == 0), mod.__name__


def test_none_zero_bias_and_all_true_masks_are_the_plain_path_bit_for_bit():
    """bias=None, mask=None, key_padding_mask=None change nothing; a zero bias and all-True masks give the plain
    results bit for bit (s + 0 = s, exactly), in float64 and low precision."""
    rng = np.random.default_rng(6)
    b, sq, sk, hq, hkv, d = 2, 5, 7, 4, 2, 8
    q, k, v, do = problem(rng, b, sq, sk, hq, hkv, d)
    slopes = np.array([0.5, 0.25, 0.1, 0.3], np.float32)
    for mods in (dict(), dict(window=(2, 1), softcap=2.0, alibi_slopes=slopes)):
        plain = (reference.attention_forward64(q, k, v, True, **mods),
                 reference.attention_backward64(do, q, k, v, True, **mods),
                 reference.attention_lowp(q, k, v, "bf16", True, **mods),
                 reference.attention_backward_lowp(do, q, k, v, "fp16", True, **mods))
        for extra in (dict(bias=None, mask=None, key_padding_mask=None),
                      dict(bias=np.zeros((1, 1)), mask=np.ones((b, hq, sq, sk), bool),
                           key_padding_mask=np.ones((b, sk), bool))):
            got = (reference.attention_forward64(q, k, v, True, **mods, **extra),
                   reference.attention_backward64(do, q, k, v, True, **mods, **extra)[:3],
                   reference.attention_lowp(q, k, v, "bf16", True, **mods, **extra),
                   reference.attention_backward_lowp(do, q, k, v, "fp16", True, **mods, **extra)[:3])
            for g, w in zip(got[0] + got[1] + (got[2],) + got[3], plain[0] + plain[1] + (plain[2],) + plain[3]):
                np.testing.assert_array_equal(g, w, err_msg=f"{sorted(mods)} with {sorted(extra)}")
    for extra in (dict(bias=None, mask=None, key_padding_mask=None), dict(bias=np.zeros((1, 1)))):
        for g, w in zip(_xpref.attention_backward64(do, q, k, v, True, **extra),
                        _xpref.attention_backward64(do, q, k, v, True)):
            np.testing.assert_array_equal(g, w)


# --- low precision ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [("fp16", 5e-3), ("bf16", 4e-2)])
@pytest.mark.parametrize("name", ["bias-full", "bias-divisors", "bias-keys", "mask-padding-bias", "bias-softcap",
                                  "all"])
def test_lowp_references_are_close_to_float64_but_not_equal(name, dtype, tol):
    rng = np.random.default_rng(zlib.crc32(repr(("lowp", name, dtype)).encode()))
    shape = (4, 33, 47, 4, 2, 64)
    b, sq, sk, hq, hkv, d = shape
    q, k, v, do = (reference._round(x, dtype) for x in problem(rng, b, sq, sk, hq, hkv, d))
    causal, kw, _ = make_case(name, shape, seed=1, bias_dtype=np.float32)
    o64, _ = reference.attention_forward64(q, k, v, causal, **kw)
    o = reference.attention_lowp(q, k, v, dtype, causal, **kw)
    assert o.dtype == np.float32 and np.array_equal(reference._round(o, dtype), o), "o is not a dtype value"
    err = np.abs(o - o64).max()
    assert 0 < err <= tol * np.abs(o64).max(), f"{name} {dtype} o: {err:.2e} vs max {np.abs(o64).max():.2e}"
    grads = reference.attention_backward_lowp(do, q, k, v, dtype, causal, **kw)
    assert grads[3].dtype == np.float32 and grads[3].shape == kw["bias"].shape
    grads64 = reference.attention_backward64(do, q, k, v, causal, **kw)
    for which, g, g64 in zip(("dq", "dk", "dv", "dbias"), grads, grads64):
        err = np.abs(g - g64).max()
        assert 0 < err <= 2 * tol * np.abs(g64).max(), \
            f"{name} {dtype} {which}: {err:.2e} vs max {np.abs(g64).max():.2e}"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_lowp_adds_the_bias_to_the_rounded_scores_and_rounds(dtype):
    """With q = 0 the scores are 0 and S = round(0 + bias): o = round(round(softmax(round(bias))) v), and dbias is
    the rounded dS = round(P (dP - D)) of those S."""
    rng = np.random.default_rng(7)
    q = np.zeros((1, 4, 2, 8))
    k, v, do = (reference._round(randn(rng, 1, s, 2, 8), dtype) for s in (6, 6, 4))
    bias = (3 * rng.standard_normal((1, 2, 4, 6))).astype(np.float32)
    s = reference._round(bias, dtype)
    p = reference._round(reference._softmax_lowp(s), dtype)
    o = reference._round(np.einsum("bhij,bjhd->bihd", p, v), dtype)
    np.testing.assert_array_equal(reference.attention_lowp(q, k, v, dtype, bias=bias), o)
    dp = reference._round(np.einsum("bihd,bjhd->bhij", do, v), dtype)
    ds = reference._round(p * (dp - np.einsum("bihd,bihd->bhi", do, o)[..., None]), dtype)
    np.testing.assert_array_equal(reference.attention_backward_lowp(do, q, k, v, dtype, bias=bias)[3], ds)


# --- packed batches --------------------------------------------------------------------------------------------

LENS_Q, LENS_K = [3, 0, 5, 1], [6, 2, 0, 4]
VARLEN_BIAS = [  # (bias shape, mask shape, key padding?) with num_seqs 4, H_q 4, max lengths 5, 6
    ((4, 4, 5, 6), None, False), ((2, 1, 5, 6), None, True), ((1, 4, 1, 6), (4, 2, 5, 6), False),
    ((4, 2, 5, 1), (5, 6), True), ((5, 6), None, False),
]


def varlen_kwargs(case, seed):
    bias_shape, mask_shape, padding = case
    rng = np.random.default_rng(seed)
    kw = dict(bias=rng.standard_normal(bias_shape))
    if mask_shape is not None:
        kw["mask"] = rng.random(mask_shape) < 0.7
    if padding:
        kw["key_padding_mask"] = rng.random((len(LENS_Q), max(LENS_K))) < 0.7
    return kw


@pytest.mark.parametrize("case", VARLEN_BIAS,
                         ids=lambda c: f"bias{'x'.join(map(str, c[0]))}-mask{c[1] is not None}-kpm{c[2]}")
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_is_dense_attention_per_sequence_on_the_bias_corner(case, causal):
    """Sequence b is the dense call on bias[b', h', :len_q, :len_k] (size-1 dims whole) and the first len_k
    entries of key padding row b; dbias is the sum of the sequences' dbias at those places."""
    rng = np.random.default_rng(zlib.crc32(repr(("varlen", case, causal)).encode()))
    q, k, v, do, cu_q, cu_k = packed_problem(rng, LENS_Q, LENS_K, 4, 2, 4)
    kw = varlen_kwargs(case, 8)
    o, lse = reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, causal, 0.5, **kw)
    dq, dk, dv, dbias = reference.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, causal, 0.5, **kw)
    assert dbias.shape == kw["bias"].shape
    want_dbias = np.zeros_like(as4(kw["bias"]))
    for b in range(len(LENS_Q)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        part = {}
        for name in ("bias", "mask"):
            if name in kw:
                x4 = as4(kw[name])
                part[name] = x4[b // (4 // x4.shape[0]):][:1, :, :LENS_Q[b] if x4.shape[2] > 1 else 1,
                                                         :LENS_K[b] if x4.shape[3] > 1 else 1]
        if "key_padding_mask" in kw:
            part["key_padding_mask"] = kw["key_padding_mask"][b:b + 1, :LENS_K[b]]
        o_b, lse_b = per_element_attention(q[None, rq], k[None, rk], v[None, rk], 0.5, causal, **part)
        np.testing.assert_allclose(o[rq], o_b[0], rtol=1e-12, atol=1e-12, err_msg=f"o of sequence {b}")
        np.testing.assert_allclose(lse[:, rq], lse_b[0], rtol=1e-12, atol=1e-12, err_msg=f"lse of sequence {b}")
        g = reference.attention_backward64(do[None, rq], q[None, rq], k[None, rk], v[None, rk], causal, 0.5, **part)
        for name, got, want in (("dq", dq[rq], g[0][0]), ("dk", dk[rk], g[1][0]), ("dv", dv[rk], g[2][0])):
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14, err_msg=f"{name} of sequence {b}")
        x4 = as4(kw["bias"])
        want_dbias[b // (4 // x4.shape[0]), :, :LENS_Q[b] if x4.shape[2] > 1 else 1,
                   :LENS_K[b] if x4.shape[3] > 1 else 1] += g[3][0]
    np.testing.assert_allclose(dbias, want_dbias.reshape(dbias.shape), rtol=1e-12, atol=1e-14)


def test_varlen_dbias_matches_central_finite_differences():
    rng = np.random.default_rng(9)
    q, k, v, do, cu_q, cu_k = packed_problem(rng, LENS_Q, LENS_K, 4, 2, 4)
    kw = varlen_kwargs(VARLEN_BIAS[1], 10)
    kw.update(softcap=2.0)
    dbias = reference.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, True, 0.8, **kw)[3]

    def loss():
        return float(np.sum(reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, True, 0.8, **kw)[0] * do))

    numeric = _central_difference(kw["bias"], loss, 1e-6)
    err = np.abs(dbias - numeric).max()
    assert err <= 1e-7 * max(1.0, np.abs(numeric).max()) and np.abs(numeric).max() > 1e-3, f"varlen dbias: {err:.2e}"


def test_varlen_with_equal_lengths_is_batched_dense_attention():
    """Equal-length sequences packed == the dense (B, S, H, D) call with the same bias and masks, dbias included."""
    rng = np.random.default_rng(11)
    b, sq, sk, hq, hkv, d = 4, 5, 6, 4, 2, 8
    q, k, v, do, cu_q, cu_k = packed_problem(rng, [sq] * b, [sk] * b, hq, hkv, d)
    kw = dict(bias=rng.standard_normal((2, 1, sq, sk)), mask=rng.random((b, hq, 1, sk)) < 0.8,
              key_padding_mask=rng.random((b, sk)) < 0.8)
    dense = lambda x, s: x.reshape(b, s, *x.shape[1:])  # noqa: E731
    qd, kd, vd, dod = dense(q, sq), dense(k, sk), dense(v, sk), dense(do, sq)
    o, lse = reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, True, **kw)
    o_d, lse_d = reference.attention_forward64(qd, kd, vd, True, **kw)
    np.testing.assert_array_equal(o, o_d.reshape(o.shape))
    np.testing.assert_array_equal(lse, lse_d.transpose(1, 0, 2).reshape(hq, b * sq))
    for g, gd in zip(reference.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, True, **kw),
                     reference.attention_backward64(dod, qd, kd, vd, True, **kw)):
        np.testing.assert_allclose(g, gd.reshape(g.shape), rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(reference.attention_varlen_lowp(q, k, v, cu_q, cu_k, "bf16", True, **kw),
                                  reference.attention_lowp(qd, kd, vd, "bf16", True, **kw).reshape(q.shape))
    got = reference.attention_varlen_backward_lowp(do, q, k, v, cu_q, cu_k, "fp16", True, **kw)
    want = reference.attention_backward_lowp(dod, qd, kd, vd, "fp16", True, **kw)
    for g, gd in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(g, gd.reshape(g.shape))
    assert got[3].dtype == np.float32 and got[3].shape == kw["bias"].shape
    np.testing.assert_allclose(got[3], want[3], rtol=1e-6, atol=1e-6)


def test_varlen_bias_shorter_than_a_sequence_is_an_error():
    rng = np.random.default_rng(12)
    q, k, v, _, cu_q, cu_k = packed_problem(rng, [2, 4], [3, 3], 2, 2, 4)
    with pytest.raises(ValueError, match="bias has shape"):
        reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, bias=np.zeros((2, 2, 3, 3)))
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 2\)"):
        reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, key_padding_mask=np.ones((2, 2), bool))


# --- cuflash._xpref: the same math in batched matmuls ---------------------------------------------------------

XP_CASES = ["bias-full", "bias-divisors", "bias-keys", "bias-rows", "bias-2d", "mask", "mask-broadcast", "padding",
            "mask-padding-bias", "bias-causal"]


@pytest.mark.parametrize("name", XP_CASES)
def test_xp_references_equal_reference(name):
    shape = (4, 37, 53, 4, 2, 16)
    b, sq, sk, hq, hkv, d = shape
    rng = np.random.default_rng(zlib.crc32(repr(("xp", name)).encode()))
    q, k, v, do = (randn(rng, b, s, h, d) for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    causal, kw, _ = make_case(name, shape, seed=13, bias_dtype=np.float32)
    for got, want in zip(_xpref.attention_forward64(q, k, v, causal, **kw),
                         reference.attention_forward64(q, k, v, causal, **kw)):
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    got, want = _xpref.attention_backward64(do, q, k, v, causal, 0.3, **kw), \
        reference.attention_backward64(do, q, k, v, causal, 0.3, **kw)
    assert len(got) == len(want) == (4 if "bias" in kw else 3)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    for dtype in ("fp16", "bf16"):
        qr, kr, vr, dor = (reference._round(x, dtype) for x in (q, k, v, do))
        got, want = _xpref.attention_lowp(qr, kr, vr, dtype, causal, **kw), \
            reference.attention_lowp(qr, kr, vr, dtype, causal, **kw)
        assert np.abs(got - want).max() <= _ulp(dtype, np.abs(want).max()), f"{name} {dtype} o"
        got = _xpref.attention_backward_lowp(dor, qr, kr, vr, dtype, causal, **kw)
        want = reference.attention_backward_lowp(dor, qr, kr, vr, dtype, causal, **kw)
        for which, g, w in zip(("dq", "dk", "dv"), got, want):
            assert g.shape == w.shape and np.abs(g - w).max() <= 2 * _ulp(dtype, np.abs(w).max()), f"{name} {which}"
        if "bias" in kw:  # sums of rounded dS: a few elements of dS differ by one unit in the last place
            g, w, g64 = got[3], want[3], reference.attention_backward64(dor, qr, kr, vr, causal, **kw)[3]
            assert g.dtype == np.float32 and g.shape == w.shape
            err_got, err_want = np.abs(g - g64).max(), np.abs(w - g64).max()
            assert 0.5 * err_want <= err_got <= 2 * err_want + 1e-6, \
                f"{name} {dtype} dbias: {err_got:.2e} vs {err_want:.2e}"


@pytest.mark.parametrize("case", VARLEN_BIAS[:3], ids=["full", "divisor-padding", "mask"])
def test_xp_varlen_references_equal_reference(case):
    rng = np.random.default_rng(14)
    q, k, v, do, cu_q, cu_k = packed_problem(rng, LENS_Q, LENS_K, 4, 2, 8)
    kw = varlen_kwargs(case, 15)
    for got, want in zip(_xpref.attention_varlen_forward64(q, k, v, cu_q, cu_k, True, **kw),
                         reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, True, **kw)):
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for got, want in zip(_xpref.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, True, **kw),
                         reference.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, True, **kw)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    qr, kr, vr, dor = (reference._round(x, "bf16") for x in (q, k, v, do))
    got = _xpref.attention_varlen_lowp(qr, kr, vr, cu_q, cu_k, "bf16", True, **kw)
    want = reference.attention_varlen_lowp(qr, kr, vr, cu_q, cu_k, "bf16", True, **kw)
    assert np.abs(got - want).max() <= 2 * _ulp("bf16", np.abs(want).max())
    got = _xpref.attention_varlen_backward_lowp(dor, qr, kr, vr, cu_q, cu_k, "bf16", True, **kw)
    want = reference.attention_varlen_backward_lowp(dor, qr, kr, vr, cu_q, cu_k, "bf16", True, **kw)
    assert len(got) == 4 and got[3].shape == kw["bias"].shape and got[3].dtype == np.float32
    for g, w in zip(got, want):
        assert np.abs(g - w).max() <= 4 * _ulp("bf16", np.abs(w).max())
