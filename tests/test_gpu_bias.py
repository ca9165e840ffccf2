"""Additive attention bias (with its gradient dbias) and boolean masks on the GPU, forward and backward, against the
float64 reference with the pass rule of docs/RELIABILITY.md: max|out - ref64| <= 2 * max|out_lowp - ref64| + 1e-5 for
o, factor 3 for dq, dk, dv and dbias; lse within 1e-3 (-inf exactly where a row sees no key). Outputs are poisoned
before each call.

The references are cuflash._xpref on the GPU when only bias and masks are used (large shapes stay quick), and
cuflash.reference in NumPy with window, ALiBi, soft-capping or dropout (the kernel's keep mask, which must be the
cuflash.philox stream bit for bit). Covered: every broadcast pattern of a 4-D bias (size-1 dims, batch and head
divisors), 2-D and 3-D biases, bias in q's dtype and float32, the Evoformer 5-D fold, masks (random, whole kernel tiles
off, key padding, both, with a bias), fully masked rows, the score modifiers, GQA, both layouts, every head dim,
awkward lengths, varlen, a preallocated dbias, and deterministic mode (bitwise repeatable; a broadcast bias's dbias
refused)."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _xpref, config, philox  # noqa: E402
from cuflash import reference as ref  # noqa: E402
from gpu_helpers import (DTYPES, HEAD_DIMS, LAYOUTS, SEQLEN_PAIRS, check_lse,  # noqa: E402
                         check_replay_matches_full_path, check_rule, cu_seqlens, make_input, make_packed, max_abs,
                         poison_pool, randn, round_up, same_bits, seed_of, to_bshd32, warm_kernel_cache)
from test_gpu_mods import check_mask, mods_kwargs, ref_kwargs  # noqa: E402

pytestmark = pytest.mark.gpu

MOD_BIAS, MOD_MASK = getattr(config, "MOD_BIAS", 16), getattr(config, "MOD_MASK", 32)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    warm_kernel_cache([c for c in config.all_fwd_configs() + config.all_bwd_configs()
                       if getattr(c, "mods", 0) & (MOD_BIAS | MOD_MASK)])


# --- inputs ---------------------------------------------------------------------------------------------------

def make_bias(shape, dtype: str, bias_dtype: str, seed: int, scale: float = 1.0):
    """A contiguous CuPy bias of `shape`: standard normal times scale, in q's dtype (bias_dtype "q") or float32."""
    if bias_dtype == "q":
        return randn(tuple(shape), dtype, seed, scale)
    return cp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype=cp.float32)


def random_mask(shape, seed: int, keep: float = 0.75, dead_rows: int = 0):
    """Bool CuPy mask, True with probability `keep`; the first `dead_rows` rows (last-but-one dim) of the first
    (batch, head) entry all False."""
    mask = np.random.default_rng(seed).random(shape) < keep
    mask.reshape(-1, *shape[-2:])[0, :dead_rows] = False
    return cp.asarray(mask)


def tile_mask(shape, seed: int, tile=(64, 128)):
    """Bool CuPy mask whose (tile[0] queries x tile[1] keys) blocks are, a third each, all False (a kernel tile with
    nothing to do), all True, or random: the kernels' skip of fully masked tiles and their partial tiles."""
    rng = np.random.default_rng(seed)
    *lead, sq, sk = shape
    state = rng.integers(0, 3, (*lead, -(-sq // tile[0]), -(-sk // tile[1])))
    state = np.repeat(np.repeat(state, tile[0], axis=-2), tile[1], axis=-1)[..., :sq, :sk]
    return cp.asarray((state == 1) | ((state == 2) & (rng.random(shape) < 0.5)))


def padding_mask(b: int, sk: int, seed: int, dead_batch: bool = False):
    """key_padding_mask (B, Sk): batch b keeps a random prefix of its keys with a few holes; with dead_batch,
    batch 0 keeps none (every row of it sees no key)."""
    rng = np.random.default_rng(seed)
    kpm = (np.arange(sk)[None, :] < rng.integers(1, sk + 1, (b, 1))) & (rng.random((b, sk)) < 0.9)
    if dead_batch:
        kpm[0] = False
    return cp.asarray(kpm)


# --- the check --------------------------------------------------------------------------------------------------

def references(q32, k32, v32, do32, dtype, causal, rk, backward, varlen=None):
    """(o64, lse64, o_lowp, grads64, grads_lowp) as CuPy arrays: cuflash._xpref on the GPU when rk (the reference's
    keyword arguments) holds only bias / masks, else cuflash.reference in NumPy. varlen: (cu_seqlens_q,
    cu_seqlens_k)."""
    on_gpu = set(rk) <= {"bias", "mask", "key_padding_mask"}
    mod, conv = (_xpref, cp.asarray) if on_gpu else (ref, cp.asnumpy)
    args = [conv(x) for x in (q32, k32, v32, do32)]
    kw = {name: conv(x) if isinstance(x, cp.ndarray) else x for name, x in rk.items()}
    pre = [conv(c) for c in varlen] if varlen else []
    fwd64, fwd_lowp, bwd64, bwd_lowp = (
        (mod.attention_varlen_forward64, mod.attention_varlen_lowp, mod.attention_varlen_backward64,
         mod.attention_varlen_backward_lowp) if varlen else
        (mod.attention_forward64, mod.attention_lowp, mod.attention_backward64, mod.attention_backward_lowp))
    o64, lse64 = fwd64(*args[:3], *pre, causal, **kw)
    o_lowp = fwd_lowp(*args[:3], *pre, dtype, causal, **kw)
    g64 = glowp = ()
    if backward:
        g64 = bwd64(args[3], *args[:3], *pre, causal, **kw)
        glowp = bwd_lowp(args[3], *args[:3], *pre, dtype, causal, **kw)
    return (cp.asarray(o64), cp.asarray(lse64), cp.asarray(o_lowp), [cp.asarray(g) for g in g64],
            [cp.asarray(g) for g in glowp])


def bias_kwargs(bias, mask, key_padding_mask) -> dict:
    return {name: x for name, x in (("bias", bias), ("mask", mask), ("key_padding_mask", key_padding_mask))
            if x is not None}


def check_dense(q, k, v, dout, dtype, what, *, causal=False, layout="bshd", bias=None, mask=None, key_padding_mask=None,
                mods=None, seed=0, backward=True, dbias=True, deterministic=False, call_mask=None):
    """Forward (and backward) of one problem on poisoned memory against the references with the pass rule.
    Returns (o, lse, grads, lse64): grads (dq, dk, dv) or (dq, dk, dv, dbias) as the call returned them.
    call_mask: what cuflash gets as `mask=` (e.g. a BlockMask of `mask`; default `mask` itself)."""
    b, hq = q.shape[0], q.shape[2 if layout == "bshd" else 1]
    sq, sk = q.shape[1 if layout == "bshd" else 2], k.shape[1 if layout == "bshd" else 2]
    what = f"{what} bias={None if bias is None else (bias.shape, str(bias.dtype))} " \
           f"mask={None if mask is None else mask.shape} padding={key_padding_mask is not None} mods={mods}"
    kw = mods_kwargs(mods or {}, b, hq, seed)
    extra = bias_kwargs(bias, mask, key_padding_mask)
    call = dict(extra, **({"mask": call_mask} if call_mask is not None else {}))
    with_dropout = "dropout_p" in kw
    poison_pool(round_up(q.nbytes) + round_up(b * hq * sq * 4))
    out = cuflash.attention_forward(q, k, v, causal=causal, layout=layout, return_dropout_mask=with_dropout, **kw,
                                    **call)
    o, lse = out[:2]
    keep = None
    if with_dropout:
        check_mask(out[2], kw, b, hq, sq, sk, what)
        keep = cp.asnumpy(out[2])
    rk = ref_kwargs(kw, keep)
    rk.update(extra)
    if bias is not None:
        rk["bias"] = _xpref.to_float32(bias)  # the reference reads the bias's values
    q32, k32, v32, do32 = (to_bshd32(x, layout) for x in (q, k, v, dout))
    o64, lse64, o_lowp, g64, glowp = references(q32, k32, v32, do32, dtype, causal, rk, backward)
    assert o.shape == q.shape and o.dtype == q.dtype, f"o is {o.shape} {o.dtype} for {what}"
    check_rule("o", to_bshd32(o, layout), o64, o_lowp, 2, what)
    check_lse(lse, lse64, what)
    if not backward:
        return o, lse, (), lse64
    want_dbias = bias is not None and dbias is not False
    poison_pool(round_up(4 * (q.nbytes + 2 * k.nbytes)) + (round_up(4 * bias.size) if want_dbias else 0) + (1 << 20))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, layout=layout, deterministic=deterministic,
                                       **({"dbias": dbias} if bias is not None else {}), **kw, **call)
    assert len(grads) == (4 if want_dbias else 3), f"{len(grads)} gradients for {what}"
    for name, g, x, r64, low in zip(("dq", "dk", "dv"), grads, (q, k, v), g64, glowp):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} is {g.shape} {g.dtype} for {what}"
        check_rule(name, to_bshd32(g, layout), r64, low, 3, what)
    if want_dbias:
        assert grads[3].shape == bias.shape and grads[3].dtype == cp.float32, \
            f"dbias is {grads[3].shape} {grads[3].dtype}, expected float32 {bias.shape} for {what}"
        check_rule("dbias", grads[3], g64[3], glowp[3], 3, what)
    return o, lse, grads, lse64


def run_dense(b, sq, sk, hq, hkv, d, dtype, *, layout="bshd", bias_shape=None, bias_dtype="q", bias_scale=1.0,
              mask=None, padding=None, scale_inputs=1.0, **kw):
    """check_dense on fresh inputs: bias_shape a shape or None; mask a function (shape-free) of the seed or None;
    padding None, "random" or "dead" (batch 0 sees no key)."""
    seed = seed_of("bias", b, sq, sk, hq, hkv, d, dtype, layout, bias_shape, bias_dtype, bias_scale,
                   mask.__name__ if mask else None, padding, scale_inputs, sorted(kw.items(), key=str))
    q = make_input(b, sq, hq, d, dtype, layout, "contiguous", seed, scale_inputs)
    k = make_input(b, sk, hkv, d, dtype, layout, "padded", seed + 1, scale_inputs)
    v = make_input(b, sk, hkv, d, dtype, layout, "contiguous", seed + 2)
    dout = make_input(b, sq, hq, d, dtype, layout, "contiguous", seed + 3)
    bias = None if bias_shape is None else make_bias(bias_shape, dtype, bias_dtype, seed + 4, bias_scale)
    m = None if mask is None else mask(b, hq, sq, sk, seed + 5)
    kpm = None if padding is None else padding_mask(b, sk, seed + 6, dead_batch=padding == "dead")
    what = f"B={b} Sq={sq} Sk={sk} H={hq}/{hkv} D={d} {dtype} causal={kw.get('causal', False)} {layout}"
    return check_dense(q, k, v, dout, dtype, what, layout=layout, bias=bias, mask=m, key_padding_mask=kpm,
                       seed=seed, **kw)


# mask makers: (B, H, Sq, Sk, seed) -> bool CuPy mask
def mask_random(b, h, sq, sk, seed):
    return random_mask((b, h, sq, sk), seed)


def mask_dead_rows(b, h, sq, sk, seed):
    return random_mask((b, h, sq, sk), seed, dead_rows=min(sq, 7))


def mask_rows_broadcast(b, h, sq, sk, seed):
    return random_mask((b, 1, 1, sk), seed, keep=0.6)


def mask_heads_broadcast(b, h, sq, sk, seed):
    return random_mask((1, h, sq, sk), seed)


def mask_2d(b, h, sq, sk, seed):
    return random_mask((sq, sk), seed, keep=0.5)


def mask_tiles(b, h, sq, sk, seed):
    return tile_mask((b, h, sq, sk), seed)


def mask_tiles_shared(b, h, sq, sk, seed):
    return tile_mask((1, 1, sq, sk), seed, tile=(128, 64))


def mask_sparse(b, h, sq, sk, seed):
    return random_mask((b, h, sq, sk), seed, keep=0.03)  # many rows see one key or none


def mask_keys_strided(b, h, sq, sk, seed):
    """Every other key of a mask twice as wide: keys 2 bytes apart, rows that are no 16-byte chunks."""
    return random_mask((b, h, sq, 2 * sk), seed)[..., ::2]


def mask_square_tiles(b, h, sq, sk, seed):
    return tile_mask((b, h, sq, sk), seed, tile=(128, 128))


# --- every broadcast pattern of a bias ------------------------------------------------------------------------

B, HQ, HKV, SQ, SK = 4, 4, 2, 113, 203
PATTERNS = [(bb, hb, sqb, skb) for bb in (1, 2, B) for hb in (1, 2, HQ) for sqb in (1, SQ) for skb in (1, SK)]


@pytest.mark.parametrize("bias_dtype", ["q", "fp32"])
@pytest.mark.parametrize("shape", PATTERNS, ids=lambda s: "x".join(map(str, s)))
def test_bias_broadcast_patterns(shape, bias_dtype):
    """Each combination of size-1 dims, and batch / head divisors 2 (1 < 2 < 4): batch b reads bias b // (B // Bb).
    A bias constant along the keys (Skb = 1) only shifts lse and has dbias 0, unless a soft-cap follows it: the
    float32 ones get one."""
    dtype = DTYPES[PATTERNS.index(shape) % 2]
    mods = {"softcap": 5.0} if bias_dtype == "fp32" and shape[3] == 1 else None
    if shape[3] == 1 and mods is None:
        key_constant_dbias(shape, dtype)
        return
    run_dense(B, SQ, SK, HQ, HKV, 64, dtype, bias_shape=shape, bias_dtype=bias_dtype, bias_scale=2.0,
              causal=bias_dtype == "fp32" and shape[3] > 1, mods=mods)


def key_constant_dbias(shape, dtype):
    """A bias constant along the keys: o, lse and dq/dk/dv by the pass rule; its dbias is sum_j dS_ij = rowsum(P dP)
    - delta_i per row, 0 in exact arithmetic, so the kernel's value is rounding alone (mainly delta's, computed from
    the stored O as every FlashAttention backward does) and the low-precision reference's is rounding of another
    path: comparing the two is comparing noise. Bound it instead: a row's rounding is at most r_i = sum_d |dO_id| |O_id|
    u (u the unit roundoff of the dtype); rows round independently, so an entry summing rows gets about the root of
    the sum of their r_i^2, here with a margin of 8. A dS without its delta term would leave sum_i delta_i, far
    above that."""
    seed = seed_of("key-constant", shape, dtype)
    q = make_input(B, SQ, HQ, 64, dtype, "bshd", "contiguous", seed)
    k = make_input(B, SK, HKV, 64, dtype, "bshd", "contiguous", seed + 1)
    v = make_input(B, SK, HKV, 64, dtype, "bshd", "contiguous", seed + 2)
    dout = make_input(B, SQ, HQ, 64, dtype, "bshd", "contiguous", seed + 3)
    bias = make_bias(shape, dtype, "q", seed + 4, 2.0)
    o, lse, _, _ = check_dense(q, k, v, dout, dtype, f"key-constant bias {shape}", bias=bias, seed=seed, dbias=False)
    dbias = cuflash.attention_backward(dout, q, k, v, o, lse, bias=bias, dbias=True)[3]
    u = 2.0 ** -11 if dtype == "fp16" else 2.0 ** -8
    rows = cp.abs(_xpref.to_float32(dout) * _xpref.to_float32(o)).sum(axis=-1).transpose(0, 2, 1)[..., None]  # (B,H,Sq,1)
    bound = 8 * u * cp.sqrt(_xpref.reduce_broadcast(rows.astype(cp.float64) ** 2, shape)) + 1e-5
    assert bool(cp.isfinite(dbias).all()) and bool((cp.abs(dbias) <= bound).all()), \
        f"dbias of a key-constant bias {shape}: {float(cp.abs(dbias).max()):.3e} exceeds its rounding bound " \
        f"{float(bound.min()):.3e}..{float(bound.max()):.3e} ({dtype})"


LOW_NDIM = [(SQ, SK), (1, SK), (SQ, 1), (1, 1), (HQ, SQ, SK), (2, 1, SK), (1, SQ, SK), (HQ, SQ, 1)]


@pytest.mark.parametrize("shape", LOW_NDIM, ids=lambda s: "x".join(map(str, s)))
def test_bias_with_two_or_three_dims(shape):
    """Left-padded with size-1 dims: (Sq, Sk) is shared by every batch and head, (H, Sq, Sk) by every batch."""
    i = LOW_NDIM.index(shape)
    run_dense(2, SQ, SK, HQ, HKV, 64, DTYPES[i % 2], bias_shape=shape, bias_dtype=["q", "fp32"][i // 2 % 2],
              causal=i % 3 == 0)


# --- head dims, layouts, sequence lengths, the Evoformer fold ---------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_head_dims_and_layouts(d, layout, dtype):
    """bshd: a full bias in q's dtype; bhsd: a head-shared float32 bias with a random mask (the bias and mask are
    (B, H, Sq, Sk) whatever the layout)."""
    if layout == "bshd":
        run_dense(2, 128, 217, HQ, HKV, d, dtype, layout=layout, bias_shape=(2, HQ, 128, 217), causal=d % 64 == 0)
    else:
        run_dense(2, 203, 113, HQ, HKV, d, dtype, layout=layout, bias_shape=(2, 1, 203, 113), bias_dtype="fp32",
                  mask=mask_random, causal=d % 64 != 0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [8, 24])
def test_small_head_dims(d, causal):
    """Head dims below 32 (the head-dim-32 kernels; on an H100 the backward with a bias runs the 64 kernel, whose
    columns past d read zeros): a full bias (every dbias element stored, none zeroed first) and, causal, a
    head-shared one (summed)."""
    shape = (2, 1, 203, 113) if causal else (2, HQ, 203, 113)
    run_dense(2, 203, 113, HQ, HKV, d, DTYPES[d // 8 % 2], bias_shape=shape, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SEQLEN_PAIRS, ids=[f"{sq}x{sk}" for sq, sk in SEQLEN_PAIRS])
def test_awkward_sequence_lengths(sq, sk, causal):
    """Partial tiles at both ends; non-causal: a full bias and key padding; causal: a head-shared bias and a mask."""
    b = 1 if sq * sk > 300_000 else 2
    i = SEQLEN_PAIRS.index((sq, sk))
    if causal:
        run_dense(b, sq, sk, HQ, HKV, 64 if i % 2 else 128, DTYPES[i % 2], bias_shape=(b, 1, sq, sk), mask=mask_random,
                  causal=True)
    else:
        run_dense(b, sq, sk, HQ, HKV, 128 if i % 2 else 64, DTYPES[(i + 1) % 2], bias_shape=(b, HQ, sq, sk),
                  bias_dtype="fp32", padding="random")


@pytest.mark.parametrize("padding", [False, True], ids=["bias", "bias+padding"])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("length", [113, 256])
def test_evoformer_fold(length, d, padding):
    """q, k, v (B0, N, L, H, D) folded to (B0 * N, L, H, D) with a pair bias (B0, H, L, L): sequence b reads bias
    b // N; the per-sequence mask is a key padding mask (B0 * N, L)."""
    b0, n, h = 2, 3, 4
    dtype = DTYPES[d // 32 % 2]
    seed = seed_of("evoformer", length, d, padding)
    q, k, v, dout = (randn((b0, n, length, h, d), dtype, seed + i).reshape(b0 * n, length, h, d) for i in range(4))
    bias = make_bias((b0, h, length, length), dtype, "fp32" if padding else "q", seed + 4, 2.0)
    kpm = padding_mask(b0 * n, length, seed + 5) if padding else None
    check_dense(q, k, v, dout, dtype, f"Evoformer B0={b0} N={n} L={length} H={h} D={d} {dtype}", bias=bias,
                key_padding_mask=kpm, seed=seed)


@pytest.mark.parametrize("bias_dtype", ["q", "fp32"])
@pytest.mark.parametrize("d,length", [(32, 256), (64, 200), (64, 384)])
def test_evoformer_fold_with_padded_key_tiles(d, length, bias_dtype):
    """The pair bias beside a key padding mask whose map has full, partial and empty key tiles: sequence b keeps the
    prefix keep[b] of its keys, whole tiles or not, some with holes (rows of 200 keys: no whole 16-byte chunks). On
    Hopper at head dims 32 and 64 the forward adds the bias on every tile and reads the mask on the partial ones."""
    b0, n, h = 2, 4, 4
    dtype = DTYPES[d // 32 % 2]
    seed = seed_of("evoformer-tiles", length, d, bias_dtype)
    q, k, v, dout = (randn((b0, n, length, h, d), dtype, seed + i).reshape(b0 * n, length, h, d) for i in range(4))
    bias = make_bias((b0, h, length, length), dtype, bias_dtype, seed + 4, 2.0)
    keep = np.array([length, 128, 64, length - 1, 1, 192, length, 130])[:b0 * n]
    kpm = np.arange(length)[None, :] < keep[:, None]
    kpm[3, 5:length:7] = False  # holes in a long prefix
    check_dense(q, k, v, dout, dtype, f"Evoformer B0={b0} N={n} L={length} H={h} D={d} {dtype} keep={keep.tolist()}",
                bias=bias, key_padding_mask=cp.asarray(kpm), seed=seed)


# --- masks --------------------------------------------------------------------------------------------------------

MASK_CASES = {  # name -> run_dense keyword arguments
    "random": dict(mask=mask_random),
    "rows-broadcast": dict(mask=mask_rows_broadcast),
    "heads-broadcast": dict(mask=mask_heads_broadcast),
    "2d": dict(mask=mask_2d),
    "sparse": dict(mask=mask_sparse),
    "padding": dict(padding="random"),
    "padding+mask": dict(padding="random", mask=mask_heads_broadcast),
    "strided": dict(mask=mask_keys_strided),
    "mask+bias": dict(mask=mask_random, bias_shape=(2, HQ, 256, 512), bias_scale=2.0),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(MASK_CASES))
def test_masks(name, causal):
    i = list(MASK_CASES).index(name)
    run_dense(2, 256, 512, HQ, HKV, 64 if (i + causal) % 2 else 128, DTYPES[i % 2], causal=causal, **MASK_CASES[name])


@pytest.mark.parametrize("mask", [mask_tiles, mask_tiles_shared])
@pytest.mark.parametrize("sq,sk", [(256, 512), (1023, 1024)])
def test_masks_that_skip_whole_tiles(sq, sk, mask):
    """64 x 128 (and 128 x 64) blocks of (query, key) all False, all True or random, with a bias."""
    run_dense(1, sq, sk, HQ, HKV, 64, "bf16" if sq == 256 else "fp16", mask=mask, bias_shape=(1, HQ, sq, sk),
              bias_dtype="fp32", causal=mask is mask_tiles)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
def test_a_mask_alone_at_every_head_dim(d):
    """A mask and no other modifier (the mask kernels' own path, config.mask_only): rows of 1000 bytes (no whole
    16-byte chunks) with full, empty and partial 128 x 128 tiles, causal at half of the head dims."""
    run_dense(2, 300, 1000, HQ, HKV, d, DTYPES[d // 32 % 2], mask=mask_square_tiles, causal=d % 64 == 0)


FULLY_MASKED = {  # name -> run_dense keyword arguments; each has rows that see no key
    "mask-rows": dict(sq=113, sk=203, mask=mask_dead_rows),
    "dead-batch": dict(sq=113, sk=203, padding="dead", mask=mask_random),
    "causal-sq>sk": dict(sq=300, sk=100, causal=True, mask=mask_sparse),
    "softcap-rows": dict(sq=256, sk=256, mask=mask_dead_rows, mods={"softcap": 5.0}),
}


@pytest.mark.parametrize("name", list(FULLY_MASKED))
def test_fully_masked_rows(name):
    """A row that sees no key: o = 0 exactly, lse = -inf, dq = 0 and dbias = 0 on that row, nothing NaN."""
    case = dict(FULLY_MASKED[name])
    sq, sk = case.pop("sq"), case.pop("sk")
    b, d = 2, 64
    o, lse, grads, lse64 = run_dense(b, sq, sk, HQ, HKV, d, "fp16", bias_shape=(b, HQ, sq, sk), **case)
    dead = ~cp.isfinite(lse64)  # (B, H, Sq)
    assert bool(dead.any()), f"{name}: no row is fully masked, the case tests nothing"
    assert bool((lse[dead] == -cp.inf).all()), f"{name}: fully masked rows must have lse = -inf"
    o_rows = to_bshd32(o, "bshd").transpose(0, 2, 1, 3)[dead]
    dq_rows = to_bshd32(grads[0], "bshd").transpose(0, 2, 1, 3)[dead]
    assert max_abs(o_rows) == 0.0, f"{name}: o of fully masked rows is not 0"
    assert max_abs(dq_rows) == 0.0, f"{name}: dq of fully masked rows is not 0"
    assert max_abs(grads[3][dead]) == 0.0, f"{name}: dbias of fully masked rows is not 0"
    assert all(not bool(cp.isnan(g).any()) for g in grads), f"{name}: NaN in the gradients"


# --- with the score modifiers, GQA, and the plain path ---------------------------------------------------------

MOD_COMBOS = [
    {"window": (37, 5)},
    {"alibi": "bh"},
    {"softcap": 20.0},
    {"dropout": 0.17},
    {"alibi": "h", "dropout": 0.5, "window": (64, 64)},
    {"window": (64, 0), "alibi": "h", "softcap": 30.0, "dropout": 0.17},
]


@pytest.mark.parametrize("variant", ["full", "broadcast+masks"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mods", MOD_COMBOS, ids=lambda m: "+".join(m))
def test_with_modifiers(mods, causal, variant):
    """Bias before the soft-cap, then ALiBi, then the masks (causal, window, mask, key padding), dropout last;
    GQA (H 4, H_kv 2)."""
    i = MOD_COMBOS.index(mods)
    d, dtype = (64, "bf16") if (i + causal) % 2 else (128, "fp16")
    if variant == "full":
        run_dense(2, 203, 256, HQ, HKV, d, dtype, causal=causal, mods=mods, bias_shape=(2, HQ, 203, 256))
    else:
        run_dense(2, 203, 256, HQ, HKV, d, dtype, causal=causal, mods=mods, bias_shape=(1, HQ, 1, 256),
                  bias_dtype="fp32", mask=mask_rows_broadcast, padding="random")


@pytest.mark.parametrize("d", [64, 128])
def test_softcap_that_bites(d):
    """|scale * q . k + bias| >> softcap: the soft-cap's derivative (1 - tanh^2) is part of dbias."""
    run_dense(1, 203, 113, 2, 2, d, "bf16", mods={"softcap": 2.0}, scale_inputs=3.0, bias_shape=(1, 2, 203, 113),
              bias_scale=4.0)


def test_plain_options_are_the_plain_path():
    """bias=None, mask=None, key_padding_mask=None run the plain kernels, bit for bit, forward and backward."""
    q, k, v, dout = (make_input(1, 203, 2, 64, "fp16", "bshd", "contiguous", 7 + i) for i in range(4))
    none = dict(bias=None, mask=None, key_padding_mask=None)
    o, lse = cuflash.attention_forward(q, k, v, causal=True)
    o_none, lse_none = cuflash.attention_forward(q, k, v, causal=True, **none)
    assert same_bits(o, o_none) and same_bits(lse, lse_none)
    assert same_bits(cuflash.attention(q, k, v, **none), cuflash.attention(q, k, v))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, deterministic=True)
    grads_none = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, deterministic=True, dbias=False, **none)
    assert len(grads_none) == 3 and all(same_bits(a, b) for a, b in zip(grads, grads_none))


def test_bias_without_dbias_returns_three_gradients():
    run_dense(2, 113, 203, HQ, HKV, 64, "bf16", bias_shape=(2, 1, 113, 203), mask=mask_random, dbias=False)


# --- varlen ---------------------------------------------------------------------------------------------------------

LENS_Q, LENS_K = [113, 0, 1, 77], [203, 5, 1, 77]
MAX_Q, MAX_K = max(LENS_Q), max(LENS_K)
VARLEN_CASES = {  # name -> (bias shape, bias dtype, mask shape, key padding, modifiers)
    "bias-full": ((4, HQ, MAX_Q, MAX_K), "q", None, False, None),
    "bias-divisor+padding": ((2, 1, MAX_Q, MAX_K), "fp32", None, True, None),
    "bias-keys+mask": ((1, HQ, 1, MAX_K), "q", (4, 1, MAX_Q, MAX_K), False, None),
    "mask": (None, "q", (4, HQ, MAX_Q, MAX_K), False, None),
    "padding": (None, "q", None, True, None),
    "bias+alibi+softcap": ((4, 2, MAX_Q, MAX_K), "fp32", None, False, {"alibi": "bh", "softcap": 20.0}),
    "bias+mask+dropout+window": ((4, HQ, MAX_Q, MAX_K), "q", (MAX_Q, MAX_K), True, {"dropout": 0.17,
                                                                                     "window": (40, 40)}),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen(name, causal):
    """Packed sequences (lengths 0, 1, odd) with the dense shapes for B = num_seqs, Sq, Sk = the max lengths:
    sequence b reads bias[b', h', :len_q, :len_k] and key padding row b."""
    bias_shape, bias_dtype, mask_shape, padding, mods = VARLEN_CASES[name]
    hq, hkv, d = HQ, HKV, 64
    dtype = DTYPES[(list(VARLEN_CASES).index(name) + causal) % 2]
    seed = seed_of("bias-varlen", name, causal)
    what = f"varlen {LENS_Q}/{LENS_K} {name} causal={causal} {dtype}"
    tq, tk = sum(LENS_Q), sum(LENS_K)
    q, dout = (make_packed(tq, hq, d, dtype, "contiguous", seed + i) for i in (0, 3))
    k, v = (make_packed(tk, hkv, d, dtype, "contiguous", seed + i) for i in (1, 2))
    cuq, cuk = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    bias = None if bias_shape is None else make_bias(bias_shape, dtype, bias_dtype, seed + 4)
    mask = None if mask_shape is None else random_mask(mask_shape, seed + 5)
    kpm = padding_mask(len(LENS_Q), MAX_K, seed + 6) if padding else None
    extra = bias_kwargs(bias, mask, kpm)
    kw = mods_kwargs(mods or {}, len(LENS_Q), hq, seed)
    with_dropout = "dropout_p" in kw
    poison_pool(round_up(q.nbytes) + round_up(tq * hq * 4) + (1 << 20))
    out = cuflash.attention_varlen_forward(q, k, v, cuq, cuk, MAX_Q, MAX_K, causal=causal,
                                           return_dropout_mask=with_dropout, **kw, **extra)
    o, lse = out[:2]
    keep = None
    if with_dropout:
        keep = [cp.asnumpy(m) for m in out[2]]
        want = philox.dropout_mask_varlen(LENS_Q, LENS_K, hq, kw["dropout_p"], kw["seed"], kw["offset"])
        assert all(np.array_equal(a, b) for a, b in zip(keep, want)), f"dropout masks differ for {what}"
    rk = ref_kwargs(kw, keep)
    rk.update(extra)
    if bias is not None:
        rk["bias"] = _xpref.to_float32(bias)
    q32, k32, v32, do32 = (_xpref.to_float32(x) for x in (q, k, v, dout))
    o64, lse64, o_lowp, g64, glowp = references(q32, k32, v32, do32, dtype, causal, rk, True, varlen=(cuq, cuk))
    check_rule("o", _xpref.to_float32(o), o64, o_lowp, 2, what)
    check_lse(lse, lse64, what)
    poison_pool(round_up(8 * (q.nbytes + 2 * k.nbytes)) + (round_up(4 * bias.size) if bias is not None else 0)
                + (1 << 20))
    grads = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cuq, cuk, MAX_Q, MAX_K, causal=causal,
                                              **({"dbias": True} if bias is not None else {}), **kw, **extra)
    assert len(grads) == (3 if bias is None else 4), f"{len(grads)} gradients for {what}"
    for gname, g, r64, low in zip(("dq", "dk", "dv", "dbias"), grads, g64, glowp):
        check_rule(gname, _xpref.to_float32(g), r64, low, 3, what)
    if bias is not None:
        assert grads[3].shape == bias.shape and grads[3].dtype == cp.float32, f"dbias {grads[3].shape} for {what}"


# --- preallocated dbias, deterministic mode ----------------------------------------------------------------------

def dense_inputs(b, sq, sk, hq, hkv, d, dtype, bias_shape, seed_key):
    seed = seed_of("bias-inputs", b, sq, sk, hq, hkv, d, dtype, bias_shape, seed_key)
    q = make_input(b, sq, hq, d, dtype, "bshd", "contiguous", seed)
    k, v = (make_input(b, sk, hkv, d, dtype, "bshd", "contiguous", seed + i) for i in (1, 2))
    dout = make_input(b, sq, hq, d, dtype, "bshd", "contiguous", seed + 3)
    return q, k, v, dout, make_bias(bias_shape, dtype, "q", seed + 4)


@pytest.mark.parametrize("bias_shape", [(2, HQ, 113, 203), (1, HQ, 1, 203)], ids=["full", "broadcast"])
def test_preallocated_dbias_is_overwritten_and_returned(bias_shape):
    """dbias = a float32 array of bias's shape (NaN-filled, then holding the first call's values): it is the
    array returned, and each call overwrites it (a second call does not add to it)."""
    q, k, v, dout, bias = dense_inputs(2, 113, 203, HQ, HKV, 64, "bf16", bias_shape, "prealloc")
    o, lse = cuflash.attention_forward(q, k, v, bias=bias)
    q32, k32, v32, do32 = (to_bshd32(x, "bshd") for x in (q, k, v, dout))
    bias32 = _xpref.to_float32(bias)
    want64 = _xpref.attention_backward64(do32, q32, k32, v32, bias=bias32)[3]
    want_lowp = _xpref.attention_backward_lowp(do32, q32, k32, v32, "bf16", bias=bias32)[3]
    pre = cp.full(bias_shape, cp.nan, dtype=cp.float32)
    for call in range(2):
        grads = cuflash.attention_backward(dout, q, k, v, o, lse, bias=bias, dbias=pre)
        assert len(grads) == 4 and grads[3] is pre, f"call {call + 1}: dbias is not the preallocated array"
        check_rule("dbias", pre, want64, want_lowp, 3, f"preallocated dbias {bias_shape}, call {call + 1}")


@pytest.mark.parametrize("view", ["odd-offset", "transposed"])
@pytest.mark.parametrize("bias_shape", [(2, HQ, 113, 203), (1, HQ, 113, 203)], ids=["full", "broadcast"])
@pytest.mark.parametrize("d", [64, 128])
def test_preallocated_dbias_views(d, bias_shape, view):
    """A preallocated dbias that is a view one element into a wider array (rows only 4-byte aligned) or a transposed
    view (keys strided), of a full and of a shared bias (stores, atomic adds): NaN-filled around and inside the
    view; the values by the rule, and nothing written outside the view."""
    q, k, v, dout, bias = dense_inputs(2, 113, 203, HQ, HKV, d, "bf16", bias_shape, f"view-{view}")
    o, lse = cuflash.attention_forward(q, k, v, bias=bias)
    q32, k32, v32, do32 = (to_bshd32(x, "bshd") for x in (q, k, v, dout))
    bias32 = _xpref.to_float32(bias)
    want64 = _xpref.attention_backward64(do32, q32, k32, v32, bias=bias32)[3]
    want_lowp = _xpref.attention_backward_lowp(do32, q32, k32, v32, "bf16", bias=bias32)[3]
    if view == "odd-offset":
        base = cp.full(bias_shape[:3] + (bias_shape[3] + 2,), cp.nan, dtype=cp.float32)
        pre = base[..., 1:bias_shape[3] + 1]
    else:
        base = cp.full(bias_shape[:2] + (bias_shape[3], bias_shape[2]), cp.nan, dtype=cp.float32)
        pre = base.transpose(0, 1, 3, 2)
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, bias=bias, dbias=pre)
    assert grads[3] is pre
    check_rule("dbias", pre, want64, want_lowp, 3, f"preallocated dbias {view} {bias_shape} d={d}")
    if view == "odd-offset":
        assert bool(cp.isnan(base[..., 0]).all()) and bool(cp.isnan(base[..., -1]).all()), \
            "dbias written outside its view"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_with_a_full_bias_is_bitwise_reproducible(d, causal):
    """deterministic=True with a bias that is not broadcast: two runs give the same bits for dq, dk, dv, dbias."""
    kw = dict(bias_shape=(1, 2, 1023, 1024), mask=mask_random, deterministic=True, causal=causal)
    first = run_dense(1, 1023, 1024, 2, 2, d, "bf16", **kw)[2]
    second = run_dense(1, 1023, 1024, 2, 2, d, "bf16", **kw)[2]
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), first, second):
        assert same_bits(a, b), f"deterministic {name} differs between two runs (D={d} causal={causal})"


BROADCAST = [(1, HQ, 113, 203), (2, 2, 113, 203), (2, HQ, 1, 203), (2, HQ, 113, 1), (113, 203)]


@pytest.mark.parametrize("bias_shape", BROADCAST, ids=lambda s: "x".join(map(str, s)))
def test_deterministic_dbias_of_a_broadcast_bias_is_refused(bias_shape):
    """Its reduction over the broadcast dims uses atomics: ValueError, not a silently non-deterministic result."""
    q, k, v, dout, bias = dense_inputs(2, 113, 203, HQ, HKV, 64, "fp16", bias_shape, "det-refused")
    o, lse = cuflash.attention_forward(q, k, v, bias=bias)
    with pytest.raises(ValueError):
        cuflash.attention_backward(dout, q, k, v, o, lse, bias=bias, dbias=True, deterministic=True)


def test_deterministic_broadcast_bias_without_dbias_is_allowed():
    """Without dbias nothing is reduced: deterministic=True works and is bitwise reproducible."""
    q, k, v, dout, bias = dense_inputs(2, 113, 203, HQ, HKV, 64, "fp16", (1, HQ, 1, 203), "det-no-dbias")
    o, lse = cuflash.attention_forward(q, k, v, bias=bias)
    a, b = (cuflash.attention_backward(dout, q, k, v, o, lse, bias=bias, deterministic=True) for _ in range(2))
    assert len(a) == 3 and all(same_bits(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("extra", ["bias", "bias+key_padding_mask", "mask", "bias+given-dbias", "mask+key_padding_mask",
                                   "blockmask"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,dtype", [(64, "fp16"), (128, "bf16")])
def test_a_planned_bias_call_equals_the_full_path(d, dtype, causal, extra):
    """The second call of a signature with a bias (and dbias=True, or a preallocated dbias full of NaN), a
    key_padding_mask beside it, a mask, a mask and a key_padding_mask, or a BlockMask (the same object in both calls)
    replays the plan of the first (new inputs, bias and masks bound per call, the two masks' intersection made per
    call, dbias allocated or zeroed per call where the kernels store only the visible pairs): its o, lse, dq, dk, dv
    and dbias equal those of the same call on the full path (no plans), bit for bit, with the pool poisoned before
    each call (deterministic: the default mode's dQ sums in any order; a full-shape bias's dbias is stored, not
    summed)."""
    b, s, h = 2, 200, 2
    block_mask = cuflash.BlockMask(random_mask((b, 1, s, s), seed_of("planned blockmask", d, causal)))

    def call(seed):
        q, k, v, dout = (make_input(b, s, h, d, dtype, "bshd", "contiguous", seed + i) for i in range(4))
        kw = {}
        if "bias" in extra:
            kw["bias"] = make_bias((b, h, s, s), dtype, "q", seed + 5)
        if "key_padding_mask" in extra:
            kw["key_padding_mask"] = padding_mask(b, s, seed + 6)
        if extra.startswith("mask"):
            kw["mask"] = random_mask((b, 1, s, s), seed + 7)
        if extra == "blockmask":
            kw["mask"] = block_mask
        dbias = "bias" in kw
        if extra == "bias+given-dbias":
            dbias = cp.full((b, h, s, s), cp.nan, dtype=cp.float32)
        poison_pool(round_up(q.nbytes) + round_up(b * h * s * 4))
        o, lse = cuflash.attention_forward(q, k, v, causal=causal, **kw)
        poison_pool(3 * round_up(q.nbytes) + round_up(b * h * s * s * 4) + (1 << 20))
        grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=True, dbias=dbias, **kw)
        if dbias is not True and dbias is not False:
            assert grads[3] is dbias
        return (o, lse, *grads)

    check_replay_matches_full_path(call, f"{extra}, D={d}, causal={causal}")
