"""FlashAttention-2's score modifiers in cuflash.reference (sliding window, ALiBi, soft-capping, dropout):
the float64 forward against a per-element loop written from the definitions, the backward against central
differences, the masks' edge cases, the low-precision references against float64, and packed batches."""
from __future__ import annotations

import itertools
import math
import zlib

import numpy as np
import pytest

from cuflash import philox, reference
from test_reference import _central_difference, packed_problem, randn


def broadcast_element(x4, batch, heads, b, h, i, j):
    """The element of a 4-D bias or mask (Bb, Hb, Sqb, Skb) that score (b, h, i, j) reads, from the definition:
    batch b // (B // Bb), head h // (H // Hb), row i unless Sqb = 1, column j unless Skb = 1."""
    bb, hb, sqb, skb = x4.shape
    return x4[b // (batch // bb), h // (heads // hb), i if sqb > 1 else 0, j if skb > 1 else 0]


def per_element_attention(q, k, v, scale, causal=False, window=None, slopes=None, softcap=None, keep=None, p=0.0,
                          bias=None, mask=None, key_padding_mask=None):
    """Attention with the modifiers, one (b, h, i, j) at a time in plain Python, from the definitions:
    key j is visible to query i iff (causal: j <= i + diag) and (left != -1: j >= i + diag - left) and
    (right != -1: j <= i + diag + right) and mask[b, h, i, j] and key_padding_mask[b, j]; its score is
    scale * q_i . k_j + bias[b, h, i, j], soft-capped, minus slope * |i + diag - j|; the softmax weight of a
    visible key is multiplied by keep[b, h, i, j] / (1 - p). bias and mask (ndim 2..4) are read through
    `broadcast_element`."""
    batch, sq, heads, d = q.shape
    sk = k.shape[1]
    group = heads // k.shape[2]
    diag = sk - sq
    left, right = window if window is not None else (-1, -1)
    bias4, mask4 = (None if x is None else np.asarray(x).reshape((1,) * (4 - np.ndim(x)) + np.shape(x))
                    for x in (bias, mask))
    o = np.zeros((batch, sq, heads, d))
    lse = np.full((batch, heads, sq), -np.inf)
    for b, h, i in itertools.product(range(batch), range(heads), range(sq)):
        kv = h // group
        scores = {}
        for j in range(sk):
            if causal and j > i + diag:
                continue
            if left != -1 and j < i + diag - left:
                continue
            if right != -1 and j > i + diag + right:
                continue
            if mask4 is not None and not broadcast_element(mask4, batch, heads, b, h, i, j):
                continue
            if key_padding_mask is not None and not key_padding_mask[b, j]:
                continue
            s = scale * sum(q[b, i, h, c] * k[b, j, kv, c] for c in range(d))
            if bias4 is not None:
                s += float(broadcast_element(bias4, batch, heads, b, h, i, j))
            if softcap:
                s = softcap * math.tanh(s / softcap)
            if slopes is not None:
                slope = float(slopes[h] if np.ndim(slopes) == 1 else slopes[b, h])
                s -= slope * abs(i + diag - j)
            scores[j] = s
        if not scores:
            continue  # no visible key: o = 0, lse = -inf
        m = max(scores.values())
        total = sum(math.exp(s - m) for s in scores.values())
        lse[b, h, i] = m + math.log(total)
        for j, s in scores.items():
            weight = math.exp(s - m) / total
            if keep is not None:
                weight *= keep[b, h, i, j] / (1 - p)
            o[b, i, h] += weight * v[b, j, kv]
    return o, lse


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
SHAPES = [(2, 5, 7, 4, 2, 8), (1, 7, 5, 2, 1, 4), (1, 6, 6, 3, 3, 4), (1, 1, 9, 2, 2, 4), (1, 9, 2, 2, 1, 4)]

# name -> keyword arguments (slopes and dropout masks are made per problem from these markers)
MODS = {
    "window-2-1": dict(window=(2, 1)),
    "window-0-0": dict(window=(0, 0)),  # one key per row: o = v_j exactly, no gradient for q and k
    "window-0-1": dict(window=(0, 1)),
    "window-left-3": dict(window=(3, -1)),
    "window-right-0": dict(window=(-1, 0)),
    "window-causal": dict(window=(1, 2), causal=True),
    "alibi-h": dict(alibi="h"),
    "alibi-bh-causal": dict(alibi="bh", causal=True),
    "softcap": dict(softcap=1.5),
    "dropout": dict(dropout=0.3),
    "dropout-causal": dict(dropout=0.5, causal=True),
    "all": dict(window=(3, 1), causal=True, alibi="bh", softcap=2.0, dropout=0.25),
    "all-no-causal": dict(window=(2, 4), alibi="h", softcap=0.8, dropout=0.1),
}


def make_mods(name, batch, heads, sq, sk, seed):
    """(causal, keyword arguments of the reference) for MODS[name]: ALiBi slopes in float32 as the API takes
    them, dropout masks from cuflash.philox."""
    spec = dict(MODS[name])
    causal = spec.pop("causal", False)
    kwargs = {}
    if "window" in spec:
        kwargs["window"] = spec["window"]
    if "alibi" in spec:
        shape = (heads,) if spec["alibi"] == "h" else (batch, heads)
        kwargs["alibi_slopes"] = (0.25 + np.arange(np.prod(shape)).reshape(shape) / 3).astype(np.float32)
    if "softcap" in spec:
        kwargs["softcap"] = spec["softcap"]
    if "dropout" in spec:
        kwargs["dropout_p"] = spec["dropout"]
        kwargs["dropout_mask"] = philox.dropout_mask(batch, heads, sq, sk, spec["dropout"], seed)
    return causal, kwargs


def loop_kwargs(kwargs):
    return dict(window=kwargs.get("window"), slopes=kwargs.get("alibi_slopes"), softcap=kwargs.get("softcap"),
                keep=kwargs.get("dropout_mask"), p=kwargs.get("dropout_p", 0.0))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(MODS))
def test_forward64_matches_the_per_element_loop(shape, name):
    b, sq, sk, hq, hkv, d = shape
    rng = np.random.default_rng(zlib.crc32(repr((shape, name)).encode()))
    q, k, v = randn(rng, b, sq, hq, d), randn(rng, b, sk, hkv, d), randn(rng, b, sk, hkv, d)
    causal, kwargs = make_mods(name, b, hq, sq, sk, seed=sq * sk)
    o, lse = reference.attention_forward64(q, k, v, causal, 0.6, **kwargs)
    o_loop, lse_loop = per_element_attention(q, k, v, 0.6, causal, **loop_kwargs(kwargs))
    np.testing.assert_allclose(o, o_loop, rtol=1e-12, atol=1e-12, err_msg=f"o mismatch for {name} {shape}")
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_loop), err_msg=f"-inf rows differ for {name}")
    np.testing.assert_allclose(lse, lse_loop, rtol=1e-12, atol=1e-12, err_msg=f"lse mismatch for {name} {shape}")


# --- masks ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sq,sk", [(1, 1), (4, 4), (3, 7), (7, 3), (1, 6), (6, 1), (0, 3), (3, 0)])
@pytest.mark.parametrize("left,right", [(-1, -1), (0, 0), (1, 0), (0, 1), (2, -1), (-1, 2), (1, 3), (20, 20), (20, -1),
                                        (-1, 20)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_mask_is_the_definition(sq, sk, left, right, causal):
    diag = sk - sq
    want = np.zeros((sq, sk), dtype=bool)
    for i, j in itertools.product(range(sq), range(sk)):
        want[i, j] = ((left == -1 or j >= i + diag - left) and (right == -1 or j <= i + diag + right)
                      and (not causal or j <= i + diag))
    got = reference.window_mask(sq, sk, left, right, causal=causal)
    assert got.dtype == bool and got.shape == (sq, sk)
    np.testing.assert_array_equal(got, want, err_msg=f"window ({left}, {right}) causal={causal} for {sq}x{sk}")


def test_window_mask_examples():
    assert reference.window_mask(3, 3, 0, 0).tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    assert reference.window_mask(2, 4, 1, 0).tolist() == [[0, 1, 1, 0], [0, 0, 1, 1]]  # bottom-right: diag = 2
    assert reference.window_mask(4, 2, 0, 1).tolist() == [[0, 0], [1, 0], [1, 1], [0, 1]]  # row 0 sees nothing
    assert reference.window_mask(2, 3, -1, 0).tolist() == reference.causal_mask(2, 3).tolist()
    assert reference.window_mask(3, 3, 1, 5, causal=True).tolist() == reference.window_mask(3, 3, 1, 0).tolist()
    assert reference.window_mask(3, 5, 9, 9).all() and reference.window_mask(3, 5, -1, -1).all()


@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 8), (8, 3)])
def test_window_equivalences(sq, sk):
    """No window, (-1, -1) and sides wider than the sequence are plain attention; (-1, 0) is causal; causal with
    a window is the window with right = min(right, 0)."""
    rng = np.random.default_rng(sq * 10 + sk)
    q, k, v = randn(rng, 1, sq, 2, 4), randn(rng, 1, sk, 2, 4), randn(rng, 1, sk, 2, 4)
    plain = reference.attention_forward64(q, k, v)
    for window in [(-1, -1), (sq + sk, sk + sq), (sk, -1), (-1, sq)]:
        for got, want in zip(reference.attention_forward64(q, k, v, window=window), plain):
            np.testing.assert_array_equal(got, want, err_msg=f"window {window}")
    for got, want in zip(reference.attention_forward64(q, k, v, window=(-1, 0)),
                         reference.attention_forward64(q, k, v, causal=True)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(reference.attention_forward64(q, k, v, True, window=(2, 3)),
                         reference.attention_forward64(q, k, v, window=(2, 0))):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sq,sk,window,causal,empty", [
    (6, 3, (0, 0), False, [0, 1, 2]),      # i + diag < 0: rows 0-2 have no key on their diagonal
    (6, 3, (-1, 1), False, [0, 1]),        # j <= i - 3 + 1
    (3, 6, (-1, -1), False, []),
    (3, 8, (0, 0), True, []),
    (3, 3, (0, -1), False, []),
    (4, 2, (1, 5), True, [0, 1]),
])
def test_rows_without_a_visible_key_give_zero_minus_inf_and_no_gradient(sq, sk, window, causal, empty):
    rng = np.random.default_rng(sq + 7 * sk)
    q, k, v, do = randn(rng, 1, sq, 2, 4), randn(rng, 1, sk, 1, 4), randn(rng, 1, sk, 1, 4), randn(rng, 1, sq, 2, 4)
    kwargs = dict(window=window, alibi_slopes=np.array([0.5, 0.25], np.float32), softcap=3.0,
                  dropout_mask=philox.dropout_mask(1, 2, sq, sk, 0.2, 5), dropout_p=0.2)
    o, lse = reference.attention_forward64(q, k, v, causal, **kwargs)
    seen = [i for i in range(sq) if i not in empty]
    assert np.all(o[:, empty] == 0) and np.all(lse[:, :, empty] == -np.inf), f"rows {empty} should see nothing"
    assert np.all(np.isfinite(lse[:, :, seen])), f"rows {seen} should see a key"
    dq, dk, dv = reference.attention_backward64(do, q, k, v, causal, **kwargs)
    assert np.all(dq[:, empty] == 0) and np.all(np.isfinite(dq)) and np.all(np.isfinite(dk))
    for dtype in ("fp16", "bf16"):
        assert np.all(reference.attention_lowp(q, k, v, dtype, causal, **kwargs)[:, empty] == 0)
        assert np.all(reference.attention_backward_lowp(do, q, k, v, dtype, causal, **kwargs)[0][:, empty] == 0)


def test_alibi_bias_is_the_definition():
    slopes = np.array([[0.5, 0.125, 1.0], [2.0, 0.25, 0.75]], dtype=np.float32)
    for sq, sk in [(3, 5), (5, 3), (4, 4)]:
        bias = reference.alibi_bias(slopes, 2, sq, sk)
        assert bias.shape == (2, 3, sq, sk) and bias.dtype == np.float64
        for b, h, i, j in np.ndindex(bias.shape):
            assert bias[b, h, i, j] == -float(slopes[b, h]) * abs(i + sk - sq - j)
        np.testing.assert_array_equal(reference.alibi_bias(slopes[1], 2, sq, sk)[0], bias[1])  # (H,): every batch


def test_softcap_off_and_dropout_keep_all_are_plain_attention():
    rng = np.random.default_rng(3)
    q, k, v, do = randn(rng, 2, 5, 4, 8), randn(rng, 2, 6, 2, 8), randn(rng, 2, 6, 2, 8), randn(rng, 2, 5, 4, 8)
    plain = reference.attention_forward64(q, k, v, True), reference.attention_backward64(do, q, k, v, True)
    keep_all = np.ones((2, 4, 5, 6), dtype=bool)
    for kwargs in [dict(softcap=None), dict(softcap=0), dict(softcap=0.0), dict(dropout_mask=keep_all),
                   dict(dropout_mask=philox.dropout_mask(2, 4, 5, 6, 0.0, 11), dropout_p=0.0)]:
        got = reference.attention_forward64(q, k, v, True, **kwargs), reference.attention_backward64(do, q, k, v, True,
                                                                                                      **kwargs)
        for g, w in zip(got[0] + got[1], plain[0] + plain[1]):
            np.testing.assert_array_equal(g, w, err_msg=str(kwargs))


def test_dropout_scales_the_kept_probabilities_and_leaves_lse():
    """O = (P Z / (1 - p)) V with P the undropped softmax; lse is that of the undropped scores."""
    rng = np.random.default_rng(4)
    q, k, v = randn(rng, 1, 6, 2, 8), randn(rng, 1, 9, 2, 8), randn(rng, 1, 9, 2, 8)
    mask = philox.dropout_mask(1, 2, 6, 9, 0.4, seed=17)
    o, lse = reference.attention_forward64(q, k, v, dropout_mask=mask, dropout_p=0.4)
    o_plain, lse_plain = reference.attention_forward64(q, k, v)
    np.testing.assert_array_equal(lse, lse_plain)
    s = np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(8)
    p = np.exp(s - lse[..., None])
    np.testing.assert_allclose(o, np.einsum("bhij,bjhd->bihd", p * mask / 0.6, v), rtol=1e-12, atol=1e-12)
    assert np.abs(o - o_plain).max() > 0.1


def test_softcap_bounds_the_scores():
    """With a tiny soft-cap every score lies in (-cap, cap): attention is nearly uniform, lse ~ log(Sk)."""
    rng = np.random.default_rng(5)
    q, k, v = 10 * randn(rng, 1, 4, 2, 8), 10 * randn(rng, 1, 7, 2, 8), randn(rng, 1, 7, 2, 8)
    o, lse = reference.attention_forward64(q, k, v, softcap=1e-3)
    assert np.all(np.abs(lse - math.log(7)) <= 1e-3 + 1e-12)
    np.testing.assert_allclose(o, np.broadcast_to(v.mean(axis=1, keepdims=True), o.shape), atol=2e-3)


# --- backward: central differences of the float64 forward ------------------------------------------------------

FD_CASES = [  # (name, sq, sk, heads_q, heads_kv)
    ("window-2-1", 4, 5, 2, 2), ("window-0-1", 5, 4, 2, 1), ("window-left-3", 5, 5, 2, 2),
    ("window-right-0", 3, 6, 2, 2), ("window-causal", 5, 5, 4, 2), ("alibi-h", 4, 3, 2, 2),
    ("alibi-bh-causal", 4, 5, 2, 1), ("softcap", 4, 4, 2, 2), ("dropout", 4, 5, 2, 2), ("dropout-causal", 5, 3, 2, 1),
    ("all", 5, 6, 4, 2), ("all", 6, 4, 3, 1), ("all-no-causal", 4, 6, 4, 2),
]


@pytest.mark.parametrize("name,sq,sk,hq,hkv", FD_CASES, ids=lambda x: str(x))
def test_backward64_matches_central_finite_differences(name, sq, sk, hq, hkv):
    rng = np.random.default_rng(zlib.crc32(repr(("fd", name, sq, sk, hq)).encode()))
    b, d, scale = 2, 4, 0.7
    q, do = randn(rng, b, sq, hq, d), randn(rng, b, sq, hq, d)
    k, v = randn(rng, b, sk, hkv, d), randn(rng, b, sk, hkv, d)
    causal, kwargs = make_mods(name, b, hq, sq, sk, seed=sq + sk)
    grads = reference.attention_backward64(do, q, k, v, causal, scale, **kwargs)

    def loss():
        return float(np.sum(reference.attention_forward64(q, k, v, causal, scale, **kwargs)[0] * do))

    for which, x, g in zip("qkv", (q, k, v), grads):
        assert g.shape == x.shape, f"d{which} has shape {g.shape}, {which} has {x.shape}"
        numeric = _central_difference(x, loss, 1e-6)
        err = np.abs(g - numeric).max()
        assert err <= 1e-7 * max(1.0, np.abs(numeric).max()), f"{name}: d{which} vs finite differences: {err:.2e}"
        assert np.abs(numeric).max() > 1e-3, f"{name}: d{which} is all but zero, the check says nothing"


def test_backward64_delta_is_rowsum_of_p_dp_with_dropout():
    """D_i = rowsum(dO * O) with the dropped O equals rowsum(P * dP) with the dropped dP."""
    rng = np.random.default_rng(6)
    q, k, v, do = randn(rng, 1, 5, 2, 8), randn(rng, 1, 7, 2, 8), randn(rng, 1, 7, 2, 8), randn(rng, 1, 5, 2, 8)
    mask = philox.dropout_mask(1, 2, 5, 7, 0.3, seed=8)
    o, lse = reference.attention_forward64(q, k, v, dropout_mask=mask, dropout_p=0.3)
    p = np.exp(np.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(8) - lse[..., None])
    dp = np.einsum("bihd,bjhd->bhij", do, v) * mask / 0.7
    np.testing.assert_allclose(np.einsum("bihd,bihd->bhi", do, o), (p * dp).sum(-1), rtol=1e-12, atol=1e-12)


# --- low precision --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [("fp16", 5e-3), ("bf16", 4e-2)])
@pytest.mark.parametrize("name", [name for name in MODS if name != "window-0-0"])  # that one is exact in lowp
def test_lowp_references_are_close_to_float64_but_not_equal(name, dtype, tol):
    rng = np.random.default_rng(zlib.crc32(repr(("lowp", name, dtype)).encode()))
    b, sq, sk, hq, hkv, d = 2, 33, 47, 4, 2, 64
    q, k, v, do = (reference._round(randn(rng, b, s, h, d), dtype)
                   for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    causal, kwargs = make_mods(name, b, hq, sq, sk, seed=1)
    o64, _ = reference.attention_forward64(q, k, v, causal, **kwargs)
    o = reference.attention_lowp(q, k, v, dtype, causal, **kwargs)
    assert o.dtype == np.float32 and np.array_equal(reference._round(o, dtype), o), "o is not a dtype value"
    err = np.abs(o - o64).max()
    assert 0 < err <= tol * np.abs(o64).max(), f"{name} {dtype} o: {err:.2e} vs max {np.abs(o64).max():.2e}"
    for which, g, g64 in zip("qkv", reference.attention_backward_lowp(do, q, k, v, dtype, causal, **kwargs),
                             reference.attention_backward64(do, q, k, v, causal, **kwargs)):
        err = np.abs(g - g64).max()
        assert 0 < err <= 2 * tol * np.abs(g64).max(), \
            f"{name} {dtype} d{which}: {err:.2e} vs max {np.abs(g64).max():.2e}"


def test_lowp_dropout_rounds_the_scaled_probabilities():
    """attention_lowp with dropout = plain lowp attention on V with P replaced by round(round(P) Z / (1 - p)):
    checked through one kept key per row (window (0, 0)), where P = 1 and O = round(round(1 / (1 - p)) V)."""
    rng = np.random.default_rng(9)
    q, k, v = (reference._round(randn(rng, 1, 4, 2, 8), "bf16") for _ in range(3))
    mask = np.ones((1, 2, 4, 4), dtype=bool)
    mask[0, 1, 2] = False
    o = reference.attention_lowp(q, k, v, "bf16", window=(0, 0), dropout_mask=mask, dropout_p=0.3)
    factor = reference._round(np.float32(1 / 0.7), "bf16")
    want = reference._round(factor * v, "bf16")
    want[0, 2, 1] = 0
    np.testing.assert_array_equal(o, want)


# --- packed batches -------------------------------------------------------------------------------------------

VARLEN_MODS = ["window-2-1", "alibi-bh-causal", "softcap", "dropout-causal", "all"]


def varlen_kwargs(name, lens_q, lens_k, heads, seed):
    """(causal, kwargs) for a packed batch: slopes (num_seqs, H) for "bh", masks from dropout_mask_varlen."""
    causal, kwargs = make_mods(name, len(lens_q), heads, 1, 1, seed)
    if "dropout_mask" in kwargs:
        kwargs["dropout_mask"] = philox.dropout_mask_varlen(lens_q, lens_k, heads, kwargs["dropout_p"], seed)
    return causal, kwargs


@pytest.mark.parametrize("name", VARLEN_MODS)
def test_varlen_is_the_per_element_loop_per_sequence(name):
    lens_q, lens_k = [3, 0, 5, 1, 4], [6, 2, 0, 1, 3]
    rng = np.random.default_rng(zlib.crc32(repr(("varlen", name)).encode()))
    q, k, v, do, cu_q, cu_k = packed_problem(rng, lens_q, lens_k, 4, 2, 4)
    causal, kwargs = varlen_kwargs(name, lens_q, lens_k, 4, seed=21)
    o, lse = reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, causal, 0.5, **kwargs)
    for b in range(len(lens_q)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        loop = loop_kwargs(kwargs)
        if loop["keep"] is not None:
            loop["keep"] = loop["keep"][b][None]
        if loop["slopes"] is not None and loop["slopes"].ndim == 2:
            loop["slopes"] = loop["slopes"][b]
        o_b, lse_b = per_element_attention(q[None, rq], k[None, rk], v[None, rk], 0.5, causal, **loop)
        np.testing.assert_allclose(o[rq], o_b[0], rtol=1e-12, atol=1e-12, err_msg=f"{name}: sequence {b}")
        np.testing.assert_allclose(lse[:, rq], lse_b[0], rtol=1e-12, atol=1e-12, err_msg=f"{name}: sequence {b}")


@pytest.mark.parametrize("name", VARLEN_MODS)
def test_varlen_with_equal_lengths_is_batched_dense_attention(name):
    """Equal-length sequences packed == the dense (B, S, H, D) call; the varlen masks of dropout_mask_varlen are
    the dense batch's masks (the sequence index is the batch index)."""
    rng = np.random.default_rng(zlib.crc32(repr(("varlen-dense", name)).encode()))
    b, sq, sk, hq, hkv, d = 3, 5, 7, 4, 2, 8
    q, k, v, do, cu_q, cu_k = packed_problem(rng, [sq] * b, [sk] * b, hq, hkv, d)
    causal, kwargs = make_mods(name, b, hq, sq, sk, seed=31)
    packed = dict(kwargs)
    if "dropout_mask" in kwargs:
        packed["dropout_mask"] = philox.dropout_mask_varlen([sq] * b, [sk] * b, hq, kwargs["dropout_p"], 31)
        np.testing.assert_array_equal(np.stack(packed["dropout_mask"]), kwargs["dropout_mask"])
    dense = lambda x, s: x.reshape(b, s, *x.shape[1:])  # noqa: E731
    qd, kd, vd, dod = dense(q, sq), dense(k, sk), dense(v, sk), dense(do, sq)
    o, lse = reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, causal, **packed)
    o_d, lse_d = reference.attention_forward64(qd, kd, vd, causal, **kwargs)
    np.testing.assert_array_equal(o, o_d.reshape(o.shape))
    np.testing.assert_array_equal(lse, lse_d.transpose(1, 0, 2).reshape(hq, b * sq))
    for g, gd in zip(reference.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, causal, **packed),
                     reference.attention_backward64(dod, qd, kd, vd, causal, **kwargs)):
        np.testing.assert_allclose(g, gd.reshape(g.shape), rtol=1e-13, atol=1e-14)
    np.testing.assert_array_equal(reference.attention_varlen_lowp(q, k, v, cu_q, cu_k, "bf16", causal, **packed),
                                  reference.attention_lowp(qd, kd, vd, "bf16", causal, **kwargs).reshape(q.shape))
    for g, gd in zip(reference.attention_varlen_backward_lowp(do, q, k, v, cu_q, cu_k, "fp16", causal, **packed),
                     reference.attention_backward_lowp(dod, qd, kd, vd, "fp16", causal, **kwargs)):
        np.testing.assert_array_equal(g, gd.reshape(g.shape))


def test_varlen_backward64_matches_central_finite_differences():
    lens_q, lens_k = [3, 0, 4], [4, 2, 3]
    rng = np.random.default_rng(41)
    q, k, v, do, cu_q, cu_k = packed_problem(rng, lens_q, lens_k, 2, 1, 4)
    causal, kwargs = varlen_kwargs("all", lens_q, lens_k, 2, seed=41)
    grads = reference.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, causal, 0.8, **kwargs)

    def loss():
        return float(np.sum(reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, causal, 0.8, **kwargs)[0] * do))

    for which, x, g in zip("qkv", (q, k, v), grads):
        numeric = _central_difference(x, loss, 1e-6)
        err = np.abs(g - numeric).max()
        assert err <= 1e-7 * max(1.0, np.abs(numeric).max()), f"varlen d{which} vs finite differences: {err:.2e}"


# --- bad arguments --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_p=0.1), ValueError, "dropout_p=0.1 needs dropout_mask"),
    (dict(dropout_p=1.0, dropout_mask=np.ones((1, 2, 3, 4), bool)), ValueError, "dropout_p=1.0 is not allowed"),
    (dict(dropout_p=0.1, dropout_mask=np.ones((1, 2, 4, 3), bool)), ValueError,
     r"dropout_mask has shape \(1, 2, 4, 3\)"),
    (dict(dropout_p=0.1, dropout_mask=np.ones((1, 2, 3, 4))), TypeError, "dropout_mask has dtype float64"),
    (dict(window=(-2, 0)), ValueError, "window left=-2"),
    (dict(window=(1, 2, 3)), ValueError, "window="),
    (dict(window=(1.5, 2)), TypeError, "window left=1.5"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes has shape \(3,\)"),
    (dict(alibi_slopes=np.ones(2, np.int32)), TypeError, "alibi_slopes has dtype int32"),
    (dict(softcap=-1.0), ValueError, "softcap=-1.0"),
])
def test_bad_modifiers_name_the_argument(kwargs, error, match):
    q, k = np.ones((1, 3, 2, 4)), np.ones((1, 4, 1, 4))
    with pytest.raises(error, match=match):
        reference.attention_forward64(q, k, k, **kwargs)
    with pytest.raises(error, match=match):
        reference.attention_lowp(q, k, k, "fp16", **kwargs)


def test_varlen_dropout_needs_one_mask_per_sequence():
    rng = np.random.default_rng(0)
    q, k, v, _, cu_q, cu_k = packed_problem(rng, [2, 3], [3, 3], 2, 2, 4)
    masks = philox.dropout_mask_varlen([2, 3], [3, 3], 2, 0.2, 1)
    with pytest.raises(ValueError, match="dropout_mask holds 1 masks for 2 sequences"):
        reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, dropout_mask=masks[:1], dropout_p=0.2)
    with pytest.raises(ValueError, match=r"alibi_slopes has shape \(3, 2\)"):
        reference.attention_varlen_forward64(q, k, v, cu_q, cu_k, alibi_slopes=np.ones((3, 2), np.float32))
