"""BlockMask on the GPU: the tile states it computes (against NumPy), and attention with a BlockMask against the same
mask passed as a plain bool array, which tests/test_gpu_bias.py checks against the float64 reference. Skipping the
tiles a mask empties and not reading the mask on tiles it keeps whole changes no arithmetic (a fully masked tile adds
exp2(-inf) = 0 to every sum and leaves every maximum), so the outputs must be equal, not just close."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _families, _launch, blockmask, config  # noqa: E402
from gpu_helpers import check_replay_matches_full_path, make_input, poison_pool, round_up, seed_of  # noqa: E402
from test_gpu_bias import check_dense, padding_mask  # noqa: E402

pytestmark = pytest.mark.gpu


def block_pattern(shape, seed: int, block=(64, 64), keep: float = 0.2, partial: float = 0.3):
    """Bool CuPy mask of `block` blocks: a fraction `keep` of the blocks kept, a fraction `partial` of those with
    random holes (partial tiles), the rest dropped whole."""
    rng = np.random.default_rng(seed)
    *lead, sq, sk = shape
    nb = (*lead, -(-sq // block[0]), -(-sk // block[1]))
    kept = rng.random(nb) < keep
    holes = rng.random(nb) < partial
    expand = lambda x: np.repeat(np.repeat(x, block[0], axis=-2), block[1], axis=-1)[..., :sq, :sk]  # noqa: E731
    m = expand(kept) & ~(expand(holes) & (rng.random(shape) < 0.3))
    return cp.asarray(m)


def numpy_states(mask: np.ndarray, bm: int, bn: int) -> np.ndarray:
    m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    b, h, sq, sk = m.shape
    tm, tn = (1 if sq == 1 else bm), (1 if sk == 1 else bn)
    out = np.zeros((b, h, -(-sq // tm), -(-sk // tn)), np.uint8)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            t = m[:, :, i * tm:(i + 1) * tm, j * tn:(j + 1) * tn]
            out[:, :, i, j] = np.where(t.all(axis=(2, 3)), 2, np.where(t.any(axis=(2, 3)), 1, 0))
    return out


@pytest.mark.parametrize("shape", [(2, 3, 300, 517), (1000, 1000), (2, 1, 1, 700), (1, 4, 129, 1)])
@pytest.mark.parametrize("tile", [(128, 192), (128, 96), (64, 128)])
def test_tile_states_match_numpy(shape, tile):
    m = block_pattern(shape, seed_of("states", shape, tile), keep=0.5) if shape[-2] > 1 and shape[-1] > 1 else \
        cp.asarray(np.random.default_rng(1).random(shape) < 0.5)
    got = cp.asnumpy(cuflash.BlockMask(m).tile_map(*tile, shape[-2], shape[-1]))
    assert np.array_equal(got, numpy_states(cp.asnumpy(m), *tile))


def test_tile_maps_are_computed_once_per_tile_shape():
    bm = cuflash.BlockMask(cp.ones((256, 256), dtype=cp.bool_))
    a = bm.tile_map(128, 128, 256, 256)
    assert bm.tile_map(128, 128, 256, 256) is a
    assert bm.tile_map(128, 64, 256, 256) is not a
    assert int(a.min()) == blockmask.TILE_FULL


def test_blockmask_rejects_non_bool():
    with pytest.raises(TypeError, match="mask.dtype=uint8"):
        cuflash.BlockMask(cp.ones((4, 4), dtype=cp.uint8))


def compare(b, sq, sk, hq, hkv, d, dtype, mask_shape, *, causal=False, window=None, bias=False, padding=False,
            block=(64, 64), keep=0.2):
    """The reference check of the plain-mask call (check_dense), then the BlockMask call equal to it."""
    seed = seed_of("blockmask", b, sq, sk, hq, hkv, d, dtype, mask_shape, causal, window, bias, padding, block, keep)
    q = make_input(b, sq, hq, d, dtype, "bshd", "contiguous", seed)
    k = make_input(b, sk, hkv, d, dtype, "bshd", "contiguous", seed + 1)
    v = make_input(b, sk, hkv, d, dtype, "bshd", "contiguous", seed + 2)
    dout = make_input(b, sq, hq, d, dtype, "bshd", "contiguous", seed + 3)
    m = block_pattern(mask_shape, seed + 4, block, keep)
    extra = {}
    if bias:
        extra["bias"] = cp.asarray(np.random.default_rng(seed + 5).standard_normal((hq, sq, sk)), dtype=cp.float32)
    if padding:
        extra["key_padding_mask"] = padding_mask(b, sk, seed + 6)
    mods = {"window": window} if window is not None else None
    what = f"B={b} Sq={sq} Sk={sk} H={hq}/{hkv} D={d} {dtype} mask={mask_shape} causal={causal} window={window}"
    o, lse, _, _ = check_dense(q, k, v, dout, dtype, what, causal=causal, mask=m, mods=mods, seed=seed,
                               backward=False, **extra)
    kw = dict(causal=causal, **({"window": window} if window is not None else {}), **extra)
    poison_pool(round_up(q.nbytes) + round_up(b * hq * sq * 4))
    o_bm, lse_bm = cuflash.attention_forward(q, k, v, mask=cuflash.BlockMask(m), **kw)
    assert bool((o_bm == o).all()), f"o with a BlockMask differs from the plain mask's: {what}"
    assert bool(((lse_bm == lse) | (cp.isinf(lse_bm) & cp.isinf(lse))).all()), f"lse differs: {what}"
    # the backward reads the same mask through the BlockMask (deterministic: bitwise comparable)
    g = cuflash.attention_backward(dout, q, k, v, o, lse, mask=m, deterministic=True, **kw)
    g_bm = cuflash.attention_backward(dout, q, k, v, o, lse, mask=cuflash.BlockMask(m), deterministic=True, **kw)
    for name, x, y in zip(("dq", "dk", "dv"), g, g_bm):
        assert bool((x == y).all()), f"{name} with a BlockMask differs: {what}"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
def test_head_dims(d, dtype):
    compare(2, 700, 1100, 2, 2, d, dtype, (2, 2, 700, 1100))


@pytest.mark.parametrize("mask_shape", [(1, 1, 1000, 1000), (1000, 1000), (2, 1, 1000, 1000), (1, 4, 1000, 1000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_broadcast_masks(mask_shape):
    compare(2, 1000, 1000, 4, 2, 128, "bf16", mask_shape)


@pytest.mark.parametrize("block,keep", [((128, 128), 0.1), ((64, 64), 0.0), ((64, 64), 1.0), ((32, 256), 0.3)])
def test_densities_and_block_shapes(block, keep):
    compare(1, 1024, 2048, 2, 1, 64, "fp16", (1, 2, 1024, 2048), block=block, keep=keep)


@pytest.mark.parametrize("causal,window", [(True, None), (False, (300, 40)), (True, (500, -1))],
                         ids=["causal", "window", "causal+window"])
def test_with_causal_and_window(causal, window):
    compare(2, 900, 1300, 2, 2, 128, "bf16", (2, 2, 900, 1300), causal=causal, window=window)


def test_with_bias_and_padding():
    compare(2, 640, 640, 2, 1, 64, "bf16", (640, 640), bias=True)
    compare(2, 640, 640, 2, 1, 64, "bf16", (640, 640), padding=True)  # the intersection: no tile map, still right


def test_query_blocks_with_no_visible_tile():
    """Every tile of some query blocks empty: those rows get o = 0, lse = -inf (the kernel's no-key path)."""
    m = np.ones((512, 768), bool)
    m[:256] = False
    m = cp.asarray(m)
    q, k, v = (make_input(1, n, 2, 128, "bf16", "bshd", "contiguous", seed_of("dead", n, i))
               for i, n in enumerate((512, 768, 768)))
    o, lse = cuflash.attention_forward(q, k, v, mask=cuflash.BlockMask(m))
    assert bool((o[:, :256] == 0).all()) and bool(cp.isneginf(lse[:, :, :256]).all())
    o2, lse2 = cuflash.attention_forward(q, k, v, mask=m)
    assert bool((o == o2).all())


def test_varlen_with_a_blockmask():
    cu = cp.asarray([0, 300, 300, 1000], dtype=cp.int32)
    q, k, v = (make_input(1, 1000, 2, 64, "fp16", "bshd", "contiguous", seed_of("varlen-bm", i))[0] for i in range(3))
    m = block_pattern((3, 1, 700, 700), seed_of("varlen-bm-mask"), keep=0.4)
    o, lse = cuflash.attention_varlen_forward(q, k, v, cu, cu, 700, 700, mask=m)
    o_bm, lse_bm = cuflash.attention_varlen_forward(q, k, v, cu, cu, 700, 700, mask=cuflash.BlockMask(m))
    assert bool((o == o_bm).all())


@pytest.mark.parametrize("d", [32, 64])
def test_a_fine_pattern_takes_64_query_steps_in_the_backward(d):
    """A BlockMask of 64 x 64 blocks (10 % kept, some with holes): at head dims 32 and 64 the backward takes 64-query
    steps, whose map skips more of it than the 128-query steps' would (_families._steps_for_the_map): forward and
    backward (not deterministic) against the float64 reference, and equal to the plain mask's forward."""
    b, sq, sk, h, dtype = 2, 1000, 1100, 2, "bf16"
    seed = seed_of("fine-blocks", d)
    q, k, v, dout = (make_input(b, s, h, d, dtype, "bshd", "contiguous", seed + i)
                     for i, s in enumerate((sq, sk, sk, sq)))
    m = block_pattern((b, 1, sq, sk), seed + 4, (64, 64), keep=0.1)
    bm = cuflash.BlockMask(m)
    fine = bm.tiles_visited(64, 128, sq, sk) * _families.STEPS_128_GAIN < 2 * bm.tiles_visited(128, 128, sq, sk)
    assert fine, "the pattern must be one that 64-query steps skip more of"
    o, lse, _, _ = check_dense(q, k, v, dout, dtype, f"fine BlockMask D={d}", mask=m, call_mask=bm, seed=seed)
    assert bool((cuflash.attention_forward(q, k, v, mask=m)[0] == o).all())


def aligned_problem(b, sq, sk, hq, hkv, d, dtype, mask_shape, causal, window, keep, block=(128, 128)):
    """Inputs and a block pattern without partial blocks (every block kept whole or dropped whole)."""
    seed = seed_of("aligned", b, sq, sk, hq, hkv, d, dtype, mask_shape, causal, window, keep, block)
    q = make_input(b, sq, hq, d, dtype, "bshd", "contiguous", seed)
    k = make_input(b, sk, hkv, d, dtype, "bshd", "contiguous", seed + 1)
    v = make_input(b, sk, hkv, d, dtype, "bshd", "contiguous", seed + 2)
    dout = make_input(b, sq, hq, d, dtype, "bshd", "contiguous", seed + 3)
    return q, k, v, dout, block_pattern(mask_shape, seed + 4, block, keep, partial=0.0), seed


def launched_bits(op, q, k, v, mask, causal=False, window=None) -> int:
    """The modifier bits the library launches `op` with for this call (_families.blocks_only)."""
    from cuflash import _families, _problem

    a = _problem.attention(q, k, v, causal, None, "bshd", window, None, None, 0.0, None, 0, mask=mask)
    return _families.blocks_only(op, a, config.kernel_head_dim(q.shape[-1], a.dtype))


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (300, 40))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_aligned_blocks_skip_tiles_without_the_element_mask(d, dtype, causal, window):
    """A pattern of whole 128 x 128 blocks: on an H100 the call runs the plain kernels that skip the empty tiles
    (MOD_BLOCKS, no element mask); forward and atomic-dQ backward against the float64 reference, and the forward
    equal to the plain mask's (the same tiles in the same order, only the element mask left out)."""
    q, k, v, dout, m, seed = aligned_problem(2, 700, 1100, 4, 2, d, dtype, (2, 1, 700, 1100), causal, window, 0.4)
    bm = cuflash.BlockMask(m)
    fwd_bits = launched_bits("forward", q, k, v, bm, causal, window)
    bwd_bits = launched_bits("backward", q, k, v, bm, causal, window)
    if config.uses_wgmma(_launch.device_arch(q.device.id)):
        assert fwd_bits & config.MOD_BLOCKS and not fwd_bits & config.MOD_MASK
        assert bool(bwd_bits & config.MOD_BLOCKS) == (d in config.BWD_SM90_WS_HEAD_DIMS)
    what = f"aligned blocks D={d} {dtype} causal={causal} window={window}"
    mods = {"window": window} if window is not None else None
    o, lse, _, _ = check_dense(q, k, v, dout, dtype, what, causal=causal, mask=m, mods=mods, seed=seed,
                               call_mask=bm)
    kw = dict(causal=causal, **({"window": window} if window is not None else {}))
    o_plain, lse_plain = cuflash.attention_forward(q, k, v, mask=m, **kw)
    assert bool((o == o_plain).all()), f"o differs from the plain mask's: {what}"
    assert bool(((lse == lse_plain) | (cp.isinf(lse) & cp.isinf(lse_plain))).all()), f"lse differs: {what}"


def test_partial_tiles_keep_the_element_mask():
    """One hole in one kept block makes its tile partial: the call keeps MOD_MASK (the element mask is read)."""
    q, k, v, dout, m, seed = aligned_problem(1, 512, 512, 2, 2, 128, "bf16", (512, 512), False, None, 0.5)
    m[0] = True  # query row 0 keeps every key: its blocks are full or, where the pattern dropped them, partial
    bits = launched_bits("forward", q, k, v, cuflash.BlockMask(m))
    assert bits & config.MOD_MASK and not bits & config.MOD_BLOCKS
    check_dense(q, k, v, dout, "bf16", "partial tiles", mask=m, seed=seed, call_mask=cuflash.BlockMask(m))


def test_aligned_blocks_with_rows_that_see_nothing_and_gqa():
    """Query blocks whose every block is dropped (o = 0, lse = -inf), MQA, and 64 x 128 blocks (whole query tiles
    of the backward, halves of the forward's)."""
    q, k, v, dout, m, seed = aligned_problem(1, 640, 896, 4, 1, 128, "fp16", (1, 4, 640, 896), False, None, 0.3,
                                             block=(64, 128))
    m[:, :, 128:256] = False
    bm = cuflash.BlockMask(m)
    o, lse, _, _ = check_dense(q, k, v, dout, "fp16", "aligned, dead rows, MQA", mask=m, seed=seed, call_mask=bm)
    assert bool((o[:, 128:256] == 0).all()) and bool(cp.isneginf(lse[:, :, 128:256]).all())


def test_blocks_only_keeps_the_mask_where_no_family_takes_the_map():
    """The deterministic backward (its dQ kernel reads no map) and a mask with a key_padding_mask keep MOD_MASK."""
    from cuflash import _families, _problem

    q, k, v, dout, m, _ = aligned_problem(1, 256, 256, 2, 2, 64, "bf16", (256, 256), False, None, 0.5)
    a = _problem.attention(q, k, v, False, None, "bshd", None, None, None, 0.0, None, 0, mask=cuflash.BlockMask(m))
    assert _families.blocks_only("backward", a, 64, deterministic=True) == a.mods.bits
    kpm = cp.ones((1, 256), dtype=cp.bool_)
    a = _problem.attention(q, k, v, False, None, "bshd", None, None, None, 0.0, None, 0,
                           mask=cuflash.BlockMask(m), key_padding_mask=kpm)
    assert _families.blocks_only("forward", a, 64) == a.mods.bits


def test_ws_family_reads_the_map():
    """The warp-specialized forward is the family that takes the tile map (the others read the element mask)."""
    cfg = config.select("forward", 128, "bf16", False, "sm_90a", mods=config.MOD_MASK)
    assert isinstance(cfg, config.FwdSm90WsConfig) or config.KERNELS == "mma"


# --- float32: the TF32 wgmma kernels (sm_90a) read the maps too ------------------------------------------------------

def equal_values(a, b) -> bool:
    """Equal element by element (-inf equals -inf, +0 equals -0; NaN equals nothing)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())


def float32_kernels_run(precision, d, causal, bits, sk) -> bool:
    """On sm_90a (wgmma kernels on) the forward and both backward kernels of this call are the TF32 ones (True);
    elsewhere, or with CUFLASH_KERNELS=mma, the mma.sync float32 kernels run (False)."""
    arch = _launch.device_arch(cp.cuda.Device().id)
    if arch != "sm_90a" or config.KERNELS == "mma":
        return False
    hd = config.kernel_head_dim(d, precision)
    fwd = config.select("forward", hd, precision, causal, arch, mods=bits, seqlen_k=sk)
    bwd = config.select("backward", hd, precision, causal, arch, mods=bits)
    assert isinstance(fwd, config.FwdSm90Tf32Config) and isinstance(bwd, config.BwdSm90Tf32Config), (fwd, bwd)
    return True


def compare_float32(precision, b, sq, sk, hq, hkv, d, mask_shape, *, causal=False, window=None, alibi=False,
                    bias=False, block=(64, 64), keep=0.3, partial=0.3):
    """float32 (precision "fp32": 3xTF32, "tf32": one pass): the plain-mask call by the float32 rule against the
    float64 reference (tests/test_gpu_wide.py), then the BlockMask call, forward and backward, equal to it value for
    value (the TF32 kernels are deterministic without a broadcast dbias; the mma.sync float32 backward adds dQ with
    atomics in the default mode, so where it runs both backward calls are deterministic=True)."""
    from test_gpu_mods import mods_kwargs
    from test_gpu_wide import check_grads, check_outputs, references

    seed = seed_of("blockmask-f32", precision, b, sq, sk, hq, hkv, d, mask_shape, causal, window, alibi, bias, block,
                   keep, partial)
    q = make_input(b, sq, hq, d, "fp32", "bshd", "contiguous", seed)
    k = make_input(b, sk, hkv, d, "fp32", "bshd", "contiguous", seed + 1)
    v = make_input(b, sk, hkv, d, "fp32", "bshd", "contiguous", seed + 2)
    dout = make_input(b, sq, hq, d, "fp32", "bshd", "contiguous", seed + 3)
    m = block_pattern(mask_shape, seed + 4, block, keep, partial)
    kw = mods_kwargs(dict(({"window": window} if window is not None else {}), **({"alibi": "h"} if alibi else {})),
                     b, hq, seed)
    if bias:  # full shape: dBias by plain stores, so the backward repeats bitwise
        kw["bias"] = cp.asarray(np.random.default_rng(seed + 5).standard_normal((b, hq, sq, sk)), dtype=cp.float32)
    bits = (config.MOD_MASK | (config.MOD_WINDOW if window is not None else 0) | (config.MOD_ALIBI if alibi else 0)
            | (config.MOD_BIAS if bias else 0))
    det = not float32_kernels_run(precision, d, causal, bits, sk)
    what = (f"{precision} B={b} Sq={sq} Sk={sk} H={hq}/{hkv} D={d} mask={mask_shape} block={block} keep={keep} "
            f"causal={causal} window={window} alibi={alibi} bias={bias}")
    poison_pool(round_up(q.nbytes) + round_up(b * hq * sq * 8))
    o, lse = cuflash.attention_forward(q, k, v, causal=causal, precision=precision, mask=m, **kw)
    options = dict({n: kw[n] for n in ("window", "alibi_slopes", "bias") if n in kw}, mask=m)
    refs = references(precision, q, k, v, dout, causal, options, True)
    check_outputs(precision, o, lse, refs, what, lambda x: x.transpose(0, 2, 1, 3))
    grad_kw = dict(kw, dbias=True) if bias else kw
    poison_pool(round_up(4 * (q.nbytes + 2 * k.nbytes)) + (1 << 20))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, precision=precision, mask=m,
                                       deterministic=det, **grad_kw)
    check_grads(precision, grads, (q, k, v), refs, what, lambda x: x.transpose(0, 2, 1, 3), bias=kw.get("bias"))

    bm = cuflash.BlockMask(m)
    poison_pool(round_up(q.nbytes) + round_up(b * hq * sq * 8))
    o_bm, lse_bm = cuflash.attention_forward(q, k, v, causal=causal, precision=precision, mask=bm, **kw)
    assert equal_values(o_bm, o), f"o with a BlockMask differs from the plain mask's: {what}"
    assert equal_values(lse_bm, lse), f"lse with a BlockMask differs: {what}"
    poison_pool(round_up(4 * (q.nbytes + 2 * k.nbytes)) + (1 << 20))
    grads_bm = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, precision=precision, mask=bm,
                                          deterministic=det, **grad_kw)
    for name, x, y in zip(("dq", "dk", "dv", "dbias"), grads, grads_bm):
        assert equal_values(y, x), f"{name} with a BlockMask differs: {what}"


# (precision, b, sq, sk, hq, hkv, d, mask_shape, options): per-head masks under GQA (the dK / dV kernel walks the
# group's heads), broadcast masks (one map row for every batch or head), cluster pairs (head dim 128), three-consumer
# tiles (head dim 32 and 64), causal, a window, ALiBi and a bias beside the map, block shapes that leave partial, empty
# and full tiles at every kernel's tile shape, and densities 0 and 1
FLOAT32_CASES = [
    ("fp32", 2, 700, 1100, 4, 2, 64, (2, 4, 700, 1100), {}),
    ("tf32", 1, 640, 896, 2, 2, 128, (640, 896), {"causal": True, "block": (128, 128), "keep": 0.5}),
    ("fp32", 2, 517, 300, 2, 1, 32, (2, 1, 517, 300), {"window": (100, 37), "alibi": True}),
    ("fp32", 1, 1024, 1024, 2, 2, 128, (1, 1, 1024, 1024), {"bias": True, "block": (128, 128), "keep": 0.1}),
    ("tf32", 2, 384, 1152, 4, 4, 64, (2, 4, 384, 1152), {"block": (32, 256), "keep": 0.3, "partial": 0.0}),
    ("fp32", 1, 1000, 1000, 4, 1, 96, (1, 4, 1000, 1000), {"block": (256, 256), "keep": 0.5, "partial": 0.2}),
    ("tf32", 1, 300, 700, 2, 2, 32, (300, 700), {"block": (64, 64), "keep": 0.0}),
    ("fp32", 1, 300, 700, 2, 2, 64, (300, 700), {"block": (64, 64), "keep": 1.0, "partial": 0.0,
                                                 "causal": True}),
]


@pytest.mark.parametrize("precision,b,sq,sk,hq,hkv,d,mask_shape,opts", FLOAT32_CASES,
                         ids=[f"{c[0]}-b{c[1]}-{c[2]}x{c[3]}-h{c[4]}_{c[5]}-d{c[6]}-m{'x'.join(map(str, c[7]))}"
                              f"{''.join('-' + k for k in c[8])}" for c in FLOAT32_CASES])
def test_float32_blockmask(precision, b, sq, sk, hq, hkv, d, mask_shape, opts):
    compare_float32(precision, b, sq, sk, hq, hkv, d, mask_shape, **opts)


@pytest.mark.parametrize("precision,d", [("fp32", 64), ("tf32", 32), ("fp32", 128)])
def test_float32_empty_tiles_are_not_read(precision, d):
    """Keys 384-767 masked for every query: every kernel's tiles over them are empty (384 and 768 are multiples of
    each kernel's key tile: 16-64 keys, 128 or 192 per dK / dV CTA), so with a BlockMask no kernel reads them. NaN in
    those rows of K and V leaves o, lse, dq, dk, dv equal to the same call with the rows zeroed (the plain mask's call
    reads them: 0 * NaN in P V); dk, dv of those keys are 0."""
    b, sq, sk, hq, hkv = 1, 500, 1000, 2, 2
    seed = seed_of("blockmask-f32-nan", precision, d)
    q, dout = (make_input(b, sq, hq, d, "fp32", "bshd", "contiguous", seed + i) for i in (0, 3))
    k, v = (make_input(b, sk, hkv, d, "fp32", "bshd", "contiguous", seed + i) for i in (1, 2))
    m = block_pattern((sq, sk), seed + 4, (64, 64), keep=0.6)
    m[:, 384:768] = False
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[:, 384:768] = cp.nan
    v_nan[:, 384:768] = cp.nan
    k[:, 384:768] = 0
    v[:, 384:768] = 0
    if not float32_kernels_run(precision, d, False, config.MOD_MASK, sk):
        pytest.skip("float32's mma.sync kernels (off Hopper, CUFLASH_KERNELS=mma) read every tile of a BlockMask "
                    "(README); skipping empty tiles is the TF32 kernels' property")
    bm = cuflash.BlockMask(m)
    o, lse = cuflash.attention_forward(q, k, v, precision=precision, mask=bm)
    o_nan, lse_nan = cuflash.attention_forward(q, k_nan, v_nan, precision=precision, mask=bm)
    assert equal_values(o_nan, o) and equal_values(lse_nan, lse), "a BlockMask's empty tiles were read (forward)"
    o_plain, _ = cuflash.attention_forward(q, k_nan, v_nan, precision=precision, mask=m)
    assert bool(cp.isnan(o_plain).any()), "the plain mask's call should read the NaN rows (0 * NaN)"
    g = cuflash.attention_backward(dout, q, k, v, o, lse, precision=precision, mask=bm)
    g_nan = cuflash.attention_backward(dout, q, k_nan, v_nan, o, lse, precision=precision, mask=bm)
    for name, x, y in zip(("dq", "dk", "dv"), g, g_nan):
        assert equal_values(y, x), f"{name}: a BlockMask's empty tiles were read (backward)"
    assert bool((g_nan[1][:, 384:768] == 0).all()) and bool((g_nan[2][:, 384:768] == 0).all())


def test_float32_varlen_with_a_blockmask():
    cu = cp.asarray([0, 300, 300, 1000], dtype=cp.int32)
    q, k, v, dout = (make_input(1, 1000, 2, 64, "fp32", "bshd", "contiguous", seed_of("varlen-bm-f32", i))[0]
                     for i in range(4))
    m = block_pattern((3, 1, 700, 700), seed_of("varlen-bm-f32-mask"), keep=0.4)
    o, lse = cuflash.attention_varlen_forward(q, k, v, cu, cu, 700, 700, mask=m)
    o_bm, lse_bm = cuflash.attention_varlen_forward(q, k, v, cu, cu, 700, 700, mask=cuflash.BlockMask(m))
    assert equal_values(o_bm, o) and equal_values(lse_bm, lse)
    det = not float32_kernels_run("fp32", 64, False, config.MOD_MASK, 700)  # (mma.sync: dQ by atomics)
    g = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu, cu, 700, 700, mask=m, deterministic=det)
    g_bm = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu, cu, 700, 700, mask=cuflash.BlockMask(m),
                                             deterministic=det)
    for name, x, y in zip(("dq", "dk", "dv"), g, g_bm):
        assert equal_values(y, x), f"{name} with a BlockMask differs (varlen)"


# --- key_padding_mask: a tile map made per call (cuflash._families._PaddingMap) ----------------------------------------

def padding_problem(b, sk, seed):
    """A (b, sk) key_padding_mask keeping a prefix of each sequence's keys (lengths in [1, sk], one of them 1) with a
    few holes, viewed out of wider rows (not contiguous)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, sk + 1, b)
    lens[0] = 1
    keep = (np.arange(sk)[None, :] < lens[:, None]) & (rng.random((b, sk)) < 0.95)
    wide = np.zeros((b, sk + 5), bool)
    wide[:, :sk] = keep
    return cp.asarray(wide)[:, :sk], lens


@pytest.mark.parametrize("block_n", [16, 64, 96, 128, 192])
def test_padding_tile_states_match_numpy(block_n):
    from cuflash import _families, _problem

    b, sq, sk = 5, 33, 1000
    kpm, _ = padding_problem(b, sk, seed_of("padding-states", block_n))
    q, k, v = (make_input(b, n, 2, 64, "bf16", "bshd", "contiguous", seed_of("padding-states-qkv", i))
               for i, n in enumerate((sq, sk, sk)))
    a = _problem.attention(q, k, v, False, None, "bshd", None, None, None, 0.0, None, 0, key_padding_mask=kpm)
    pm = _families.padding_map(a.mods, block_n)
    got = cp.asnumpy(pm(kpm))
    want = numpy_states(cp.asnumpy(kpm).reshape(b, 1, 1, sk), 1, block_n).reshape(b, -1)
    assert np.array_equal(got, want), (got, want)


def nan_rows(x, lens, unit=384):
    """x (b, s, h, d) with the rows from each sequence's length rounded up to `unit` on set to NaN, and with them
    zeroed: those rows lie in key tiles a prefix padding mask empties at every kernel's tile shape (16-192 keys; 384
    is a multiple of each)."""
    nan, zero = x.copy(), x.copy()
    for i, n in enumerate(lens):
        start = -(-int(n) // unit) * unit
        nan[i, start:] = cp.nan
        zero[i, start:] = 0
    return nan, zero


@pytest.mark.parametrize("precision,d", [("bf16", 64), ("bf16", 128), ("fp32", 64), ("tf32", 128), ("fp32", 32)])
def test_padded_key_tiles_are_not_read(precision, d):
    """A key_padding_mask alone: on sm_90a (wgmma kernels) the forward and the backward skip the key tiles it empties,
    so NaN in K and V rows there leaves o, lse, dq, dk, dv finite and equal to the call with those rows zeroed (a
    kernel that read them would give 0 * NaN = NaN). Two rounds with other lengths on the same shapes: the second
    call of each replays its plan, whose map is made from that call's mask."""
    from cuflash import _launch

    if _launch.device_arch(cp.cuda.Device().id) != "sm_90a" or config.KERNELS == "mma":
        pytest.skip("the kernels that read tile maps in the forward run on sm_90a (wgmma kernels)")
    b, sq, sk, hq, hkv = 3, 300, 2000, 4, 2
    dtype = "bf16" if precision == "bf16" else "fp32"
    kw = {} if precision == "bf16" else {"precision": precision}
    for r in range(2):
        seed = seed_of("padding-nan", precision, d, r)
        kpm, lens = padding_problem(b, sk, seed)
        q, dout = (make_input(b, sq, hq, d, dtype, "bshd", "contiguous", seed + i) for i in (1, 2))
        (k_nan, k), (v_nan, v) = (nan_rows(make_input(b, sk, hkv, d, dtype, "bshd", "contiguous", seed + i), lens)
                                  for i in (3, 4))
        o, lse = cuflash.attention_forward(q, k, v, key_padding_mask=kpm, **kw)
        o_nan, lse_nan = cuflash.attention_forward(q, k_nan, v_nan, key_padding_mask=kpm, **kw)
        assert equal_values(o_nan, o) and equal_values(lse_nan, lse), f"padded key tiles were read (forward), {r}"
        g = cuflash.attention_backward(dout, q, k, v, o, lse, key_padding_mask=kpm, **kw)
        g_nan = cuflash.attention_backward(dout, q, k_nan, v_nan, o, lse, key_padding_mask=kpm, **kw)
        for name, x, y in zip(("dq", "dk", "dv"), g, g_nan):
            assert not bool(cp.isnan(y).any()), f"{name}: padded key tiles were read (backward), round {r}"
            if precision == "bf16":  # (dQ by atomics: the order of the adds differs between calls)
                x32, y32 = x.astype(cp.float32), y.astype(cp.float32)
                assert float(cp.abs(x32 - y32).max()) <= 1e-2 * max(1.0, float(cp.abs(x32).max())), name
            else:  # the TF32 backward repeats bitwise
                assert equal_values(y, x), f"{name} differs with NaN in the padded tiles, round {r}"


@pytest.mark.parametrize("precision,sk", [("fp32", 100), ("tf32", 700), ("bf16", 700)])
def test_a_planned_key_padding_call_equals_the_full_path(precision, sk):
    """Warm calls with a key_padding_mask replay plans that make each kernel's map from the call's mask: o, lse, dq, dk,
    dv of the replay equal the full path's bit for bit (100 keys in float32: one dK / dV block, several dQ tiles, so
    only the dQ kernel gets a map)."""
    b, sq, h = 3, 150, 2
    dtype = "bf16" if precision == "bf16" else "fp32"
    kw = {} if precision == "bf16" else {"precision": precision}

    def call(seed):
        q, dout = (make_input(b, sq, h, 64, dtype, "bshd", "contiguous", seed + i) for i in (0, 3))
        k, v = (make_input(b, sk, h, 64, dtype, "bshd", "contiguous", seed + i) for i in (1, 2))
        kpm, _ = padding_problem(b, sk, seed + 4)
        o, lse = cuflash.attention_forward(q, k, v, key_padding_mask=kpm, **kw)
        # (deterministic: the 16-bit backward's dQ in a fixed order, comparable bit for bit)
        return (o, lse, *cuflash.attention_backward(dout, q, k, v, o, lse, key_padding_mask=kpm, deterministic=True,
                                                    **kw))

    check_replay_matches_full_path(call, f"{precision} key_padding_mask, {sk} keys")
