"""FP8 (e4m3) attention forward (fwd_sm90_fp8_kernel, through cuflash.attention and attention_forward) against the
float64 reference on the dequantized inputs (e4m3 value * descale).

The pass rule of the other dtypes, with the low-precision computation being FP8's: beyond its inputs, the kernel
rounds P to e4m3 before the P V product (and O to the output dtype). `emulate` does that one rounding in float64
(P = exp(S - m) * 256 rounded to e4m3, O = P_e4m3 V / l); the kernel must stay within twice its error plus the output
rounding. Inputs are random e4m3 bit patterns drawn here (through ml_dtypes), with random descale factors of every
accepted shape, so these tests do not depend on cuflash.fp8's quantizer. Needs an sm_90 GPU.

    python -m pytest -m gpu tests/test_gpu_fp8.py -q
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cuflash
from cuflash import _compile, config
from cuflash import reference as ref

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")
from gpu_helpers import check_lse, max_abs, poison_pool, seed_of  # noqa: E402

E4M3 = ml_dtypes.float8_e4m3fn


@pytest.fixture(scope="module", autouse=True)
def _hopper_only():
    arch = _compile.device_arch()
    if not config.uses_wgmma(arch):  # another GPU, or CUFLASH_KERNELS=mma: the wgmma kernels do not run
        pytest.skip(f"fwd_sm90_fp8_kernel needs an sm_90 GPU (TMA, FP8 wgmma) with the wgmma kernels on "
                    f"(here {arch}, CUFLASH_KERNELS={config.KERNELS})")


def e4m3_bits(shape, seed: int, scale: float = 1.0):
    """(uint8 e4m3 bits, their float64 values) of standard-normal * scale draws."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * np.float32(scale)
    bits = x.astype(E4M3).view(np.uint8)
    return bits, bits.view(E4M3).astype(np.float64)


def descale_arg(kind: str, b: int, h: int, s: int, seed: int):
    """A descale argument of `kind` and its float64 factors per (b, h, block)."""
    rng = np.random.default_rng(seed)
    blocks = math.ceil(s / 128)
    if kind == "none":
        return None, np.ones((1, 1, 1))
    if kind == "number":
        return 0.375, np.full((1, 1, 1), 0.375)
    if kind == "tensor":
        a = np.float32(rng.uniform(0.25, 2.0))
        return cp.asarray(a), np.full((1, 1, 1), float(a))
    if kind == "head":
        a = rng.uniform(0.25, 2.0, (b, h)).astype(np.float32)
        return cp.asarray(a), a[:, :, None].astype(np.float64)
    if kind == "v-spread":  # per block, log-uniform over 2^-20 .. 2^4 (v only: q and k "block")
        a = np.exp2(rng.uniform(-20.0, 4.0, (b, h, blocks))).astype(np.float32)
        return cp.asarray(a), a.astype(np.float64)
    if kind == "qk-spread":  # per block, log-uniform over 2^-6 .. 2^2 (q and k: v "block")
        a = np.exp2(rng.uniform(-6.0, 2.0, (b, h, blocks))).astype(np.float32)
        return cp.asarray(a), a.astype(np.float64)
    a = rng.uniform(0.25, 2.0, (b, h, blocks)).astype(np.float32)  # "block"
    return cp.asarray(a), a.astype(np.float64)


def dequantize(values, factors, s: int):
    """(B, S, H, D) float64 values times their (B, H, block) factors."""
    blocks = np.arange(s) // 128
    f = np.broadcast_to(factors, (values.shape[0], values.shape[2], factors.shape[2]))
    f = f[:, :, np.minimum(blocks, f.shape[2] - 1)] if f.shape[2] > 1 else np.broadcast_to(f, f.shape[:2] + (s,))
    return values * np.transpose(f, (0, 2, 1))[..., None]


def lse_tolerance(q64, k64, scale: float):
    """Per row (B, H, Sq): the FP8 lse bound max(1e-2, 2^-12 A), A = max over the row's keys of scale * sum_d |q_d k_d|.
    The FP8 tensor cores accumulate S = Q K^T with about 14 bits (docs/RELIABILITY.md), so a score's error grows with
    the magnitude of its products, not with the score: 2^-12 is that precision with a factor 2 of margin."""
    group = q64.shape[2] // k64.shape[2]
    a = np.einsum("bqhd,bkhd->bhqk", np.abs(q64), np.repeat(np.abs(k64), group, axis=2)).max(axis=-1)
    return np.maximum(1e-2, 2.0 ** -12 * scale * a)


def emulate(q, k, v, causal, window, scale):
    """The kernel's one FP8 rounding in float64 (cuflash.reference.attention_fp8_emulated64)."""
    return ref.attention_fp8_emulated64(q, k, v, causal, scale, window=window)


def to_layout(x, layout):
    return x if layout == "bshd" else np.ascontiguousarray(np.transpose(x, (0, 2, 1, 3)))


def from_layout(x, layout):
    return x if layout == "bshd" else np.transpose(x, (0, 2, 1, 3))


CASES = [
    # (d, sq, sk, heads, heads_kv, causal, window, layout, scaling)
    (128, 113, 203, 4, 4, False, None, "bshd", "none"),
    (128, 256, 512, 4, 2, True, None, "bshd", "head"),
    (128, 512, 256, 2, 2, True, None, "bhsd", "block"),
    (128, 1023, 1024, 2, 1, False, None, "bshd", "block"),
    (128, 1, 239, 4, 4, False, None, "bshd", "tensor"),
    (128, 300, 300, 2, 2, False, (64, 32), "bshd", "block"),
    (128, 384, 700, 2, 2, True, (200, -1), "bhsd", "number"),
    (64, 128, 217, 4, 4, False, None, "bshd", "head"),
    (64, 1024, 1023, 2, 2, True, None, "bshd", "block"),
    (64, 257, 515, 4, 2, False, (100, 100), "bhsd", "block"),
    (64, 1800, 2000, 2, 1, True, None, "bhsd", "block"),  # causal, > FWD_SM90_FP8_CAUSAL_LONG_KEYS: three consumers
    (64, 2100, 1601, 2, 2, True, None, "bshd", "head"),
    (256, 113, 203, 2, 2, False, None, "bshd", "block"),
    (256, 512, 1024, 2, 1, True, None, "bshd", "head"),
    (256, 1000, 1000, 2, 2, False, None, "bhsd", "tensor"),
    # V descales far apart from block to block: the kernel keeps O in units of the current tile's V descale, so O
    # moves by up to 2^24 between tiles (q and k keep the "block" factors: the scores stay at the other cases' scale)
    (128, 640, 1500, 2, 2, False, None, "bshd", "v-spread"),
    (64, 1500, 1700, 2, 1, True, None, "bshd", "v-spread"),
    (256, 300, 900, 2, 2, True, None, "bhsd", "v-spread"),
    # Q and K descales far apart from block to block: the exp2 argument's scale (Q's descale times K's) changes from
    # key tile to key tile and from query block to query block (scores from 2^-12 to 16 times the "block" cases'), so
    # the running row max meets tiles of another scale (v keeps the "block" factors)
    (128, 640, 1500, 2, 2, False, None, "bshd", "qk-spread"),
    (64, 1500, 1700, 2, 1, True, None, "bshd", "qk-spread"),
    (64, 700, 1100, 4, 2, False, (300, 40), "bhsd", "qk-spread"),
    (256, 300, 900, 2, 2, True, None, "bhsd", "qk-spread"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("out_dtype", ["bf16", "fp16"])
def test_fp8_forward_matches_reference(case, out_dtype):
    check_forward(case, out_dtype)


def check_forward(case, out_dtype):
    """attention_forward and attention on FP8 inputs of `case` against the float64 reference (the FP8 rule)."""
    d, sq, sk, h, hkv, causal, window, layout, scaling = case
    b = 2
    seed = seed_of("fp8", case, out_dtype)
    (qb, qv), (kb, kv), (vb, vv) = (e4m3_bits((b, s, n, d), seed + i) for i, (s, n) in
                                    enumerate(((sq, h), (sk, hkv), (sk, hkv))))
    kinds = {"v-spread": ("block", "block", "v-spread"), "qk-spread": ("qk-spread", "qk-spread", "block")}.get(
        scaling, (scaling,) * 3)
    (qd, qf), (kd, kf), (vd, vf) = (descale_arg(kind, b, n, s, seed + 10 + i) for i, (kind, s, n) in
                                    enumerate(zip(kinds, (sq, sk, sk), (h, hkv, hkv))))
    q64, k64, v64 = dequantize(qv, qf, sq), dequantize(kv, kf, sk), dequantize(vv, vf, sk)
    scale = 1.0 / math.sqrt(d)
    o64, lse64 = ref.attention_forward64(q64, k64, v64, causal, scale, window=window)
    emul = emulate(q64, k64, v64, causal, window, scale)
    q, k, v = (cp.asarray(to_layout(x, layout)) for x in (qb, kb, vb))
    before = [x.copy() for x in (q, k, v)]
    poison_pool(2 * b * sq * h * d * 2 + 4 * b * h * sq + (1 << 16))
    o, lse = cuflash.attention_forward(q, k, v, causal=causal, window=window, layout=layout, q_descale=qd,
                                       k_descale=kd, v_descale=vd, out_dtype=out_dtype)
    want_dtype = np.float16 if out_dtype == "fp16" else np.dtype(ml_dtypes.bfloat16)
    assert o.dtype == want_dtype and o.shape == q.shape and lse.shape == (b, h, sq)
    got = from_layout(cp.asnumpy(o).astype(np.float64), layout)
    assert not np.isnan(got).any(), f"o has NaN (unwritten?) for {case}"
    err = float(np.abs(got - o64).max())
    emul_err = float(np.abs(emul - o64).max())
    out_round = (2.0 ** -8 if out_dtype == "bf16" else 2.0 ** -11) * float(np.abs(o64).max())
    bound = 2.0 * emul_err + out_round + 1e-5
    assert err <= bound, f"o mismatch for {case}: {err:.3e} > {bound:.3e} (emulated FP8 error {emul_err:.3e})"
    tol = lse_tolerance(q64, k64, scale)
    check_lse(lse, cp.asarray(lse64), str(case), atol=float(tol.max()))
    lse_err = np.abs(np.where(np.isfinite(lse64), cp.asnumpy(lse) - np.where(np.isfinite(lse64), lse64, 0.0), 0.0))
    worst = np.unravel_index(np.argmax(lse_err / tol), tol.shape)
    assert lse_err[worst] <= tol[worst], f"lse mismatch for {case} at {worst}: {lse_err[worst]:.3e} > {tol[worst]:.3e}"
    # o alone from attention(); the inputs are untouched
    o2 = cuflash.attention(q, k, v, causal=causal, window=window, layout=layout, q_descale=qd, k_descale=kd,
                           v_descale=vd, out_dtype=out_dtype)
    assert bool((o2.view(cp.uint16) == o.view(cp.uint16)).all()), "attention and attention_forward differ"
    for x, y in zip((q, k, v), before):
        assert bool((x == y).all()), "an input was modified"


def test_fp8_strided_views_and_copies():
    """Inputs that are views: a head slice (TMA reads it in place) and an odd row stride (copied first)."""
    b, s, h, d = 2, 300, 4, 128
    bits, vals = e4m3_bits((b, s, 2 * h, d + 16), 7)
    full = cp.asarray(bits)
    q = full[:, :, :h, :d]  # strides (s * 2h * (d+16), 2h * (d+16), d+16) bytes: multiples of 16: in place
    k = full[:, :, h:, :d]
    odd, odd_vals = e4m3_bits((b, s, h, d + 3), 8)
    v = cp.asarray(odd)[..., :d]  # row stride d + 3 bytes: not TMA-readable, copied
    o64, lse64 = ref.attention_forward64(vals[:, :, :h, :d], vals[:, :, h:, :d], odd_vals[..., :d], False)
    o, lse = cuflash.attention_forward(q, k, v)
    err = max_abs(o.astype(cp.float32) - cp.asarray(o64))
    emul = emulate(vals[:, :, :h, :d], vals[:, :, h:, :d], odd_vals[..., :d], False, None, 1 / math.sqrt(d))
    bound = 2 * float(np.abs(emul - o64).max()) + 2.0 ** -8 * float(np.abs(o64).max())
    assert err <= bound, f"strided FP8 inputs: {err:.3e} > {bound:.3e}"
    check_lse(lse, cp.asarray(lse64), "strided", atol=1e-2)


def test_fp8_bad_inputs_raise_before_launch():
    b, s, h, d = 1, 64, 2, 128
    q = cp.zeros((b, s, h, d), dtype=cp.uint8)
    bf = cp.zeros((b, s, h, d), dtype=ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=r"k.dtype=bfloat16: FP8 attention takes q, k and v as CuPy uint8"):
        cuflash.attention(q, bf, q)
    with pytest.raises(ValueError, match=r"q_descale applies to FP8 inputs only"):
        cuflash.attention(bf, bf, bf, q_descale=1.0)
    with pytest.raises(ValueError, match=r"softcap=30.0 is not supported with FP8 inputs"):
        cuflash.attention(q, q, q, softcap=30.0)
    with pytest.raises(ValueError, match=r"dropout_p=0.1 is not supported with FP8 inputs"):
        cuflash.attention(q, q, q, dropout_p=0.1, seed=1)
    with pytest.raises(ValueError, match=r"head_dim=96 \(last dim of q\) is not supported for FP8"):
        x = cp.zeros((b, s, h, 96), dtype=cp.uint8)
        cuflash.attention(x, x, x)
    with pytest.raises(ValueError, match=r"k_descale has shape \(1, 3\); allowed"):
        cuflash.attention(q, q, q, k_descale=cp.ones((1, 3), dtype=cp.float32))
    with pytest.raises(ValueError, match=r"q_descale has shape \(1, 2, 2\); allowed"):  # blocks: ceil(64 / 128) = 1
        cuflash.attention(q, q, q, q_descale=cp.ones((1, 2, 2), dtype=cp.float32))
    with pytest.raises(TypeError, match=r"v_descale.dtype=float64 is not supported"):
        cuflash.attention(q, q, q, v_descale=cp.ones((1, 2), dtype=cp.float64))
    with pytest.raises(ValueError, match=r"q_descale=-1.0 must be finite and > 0"):
        cuflash.attention(q, q, q, q_descale=-1.0)
    with pytest.raises(ValueError, match=r"out_dtype='float32' is not supported for FP8"):
        cuflash.attention(q, q, q, out_dtype="float32")
    with pytest.raises(ValueError, match=r"precision='tf32' is not supported with FP8"):
        cuflash.attention(q, q, q, precision="tf32")
    assert int(q.sum()) == 0 and float(bf.astype(cp.float32).sum()) == 0.0


VARLEN_SHORT = ([130, 0, 257, 1, 300], [200, 5, 129, 64, 300])
VARLEN_LONG = ([130, 1700, 1, 300], [200, 1601, 64, 2000])  # causal D 64: the three-consumer tiles for every sequence


@pytest.mark.parametrize("d,causal,lens", [(d, c, VARLEN_SHORT) for d in (64, 128, 256) for c in (False, True)]
                         + [(64, True, VARLEN_LONG)], ids=lambda x: "long" if x is VARLEN_LONG else
                         "short" if x is VARLEN_SHORT else str(x))
def test_fp8_varlen_matches_per_sequence_reference(d, causal, lens):
    """Packed sequences (one empty, lengths off the 128-row blocks, q shorter and longer than k), GQA, per-block
    descales counted within each sequence: each sequence against the dense float64 reference of its own rows."""
    check_varlen(d, causal, lens)


def check_varlen(d, causal, lens):
    lens_q, lens_k = lens
    h, hkv = 4, 2
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    mq, mk, b = max(lens_q), max(lens_k), len(lens_q)
    seed = seed_of("fp8 varlen", d, causal) + (0 if lens is VARLEN_SHORT else 1)
    (qb, qv), (kb, kv), (vb, vv) = (e4m3_bits((int(c[-1]), n, d), seed + i) for i, (c, n) in
                                    enumerate(((cq, h), (ck, hkv), (ck, hkv))))
    (qd, qf), (kd, kf), (vd, vf) = (descale_arg("block", b, n, s, seed + 10 + i) for i, (s, n) in
                                    enumerate(((mq, h), (mk, hkv), (mk, hkv))))
    cu_q, cu_k = cp.asarray(cq, dtype=cp.int32), cp.asarray(ck, dtype=cp.int32)
    poison_pool(2 * int(cq[-1]) * h * d * 2 + 4 * h * int(cq[-1]) + (1 << 16))
    o, lse = cuflash.attention_varlen_forward(cp.asarray(qb), cp.asarray(kb), cp.asarray(vb), cu_q, cu_k, mq, mk,
                                              causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert o.shape == (int(cq[-1]), h, d) and lse.shape == (h, int(cq[-1]))
    o_host, lse_host = cp.asnumpy(o).astype(np.float64), cp.asnumpy(lse)
    for s in range(b):
        if lens_q[s] == 0:
            continue
        rq, rk = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        q64 = dequantize(qv[None, rq], qf[s:s + 1], lens_q[s])
        k64 = dequantize(kv[None, rk], kf[s:s + 1], lens_k[s])
        v64 = dequantize(vv[None, rk], vf[s:s + 1], lens_k[s])
        o64, lse64 = ref.attention_forward64(q64, k64, v64, causal)
        emul = emulate(q64, k64, v64, causal, None, 1 / math.sqrt(d))
        got = o_host[None, rq]
        assert not np.isnan(got).any(), f"o has NaN in sequence {s}"
        err = float(np.abs(got - o64).max())
        bound = 2.0 * float(np.abs(emul - o64).max()) + 2.0 ** -8 * float(np.abs(o64).max()) + 1e-5
        assert err <= bound, f"sequence {s} (d={d}, causal={causal}): {err:.3e} > {bound:.3e}"
        check_lse(cp.asarray(lse_host[:, rq][None]), cp.asarray(lse64), f"sequence {s}", atol=1e-2)


# The persistent kernels (FwdFp8Traits::PERSISTENT: at most one CTA per SM walking the work items, the K/V rings and
# the pingpong tokens carried from item to item, Q released after an item's last S GEMM): the tile tables patched to
# each persistent instantiation, on grids of 3 CTAs (many items per CTA, every ring position and Q parity) and of
# all SMs; dense calls of every band and descale kind, GQA, both layouts, and packed sequences (an empty one, items
# past a sequence's end, which every role skips). Causal, windowed and packed calls take their items from a work
# queue (FwdFp8Params.queue), which each launch must leave at zero.
PERSISTENT_TILES = [(64, (128, 2, False, False, True, 3, True)), (64, (128, 2, False, False, True, 2, True)),
                    (64, (128, 2, True, True, True, 2, True)), (128, (128, 2, True, False, False, 2, True)),
                    (128, (128, 2, False, False, True, 2, True))]
PERSISTENT_CASES = [  # (d, sq, sk, heads, heads_kv, causal, window, layout, scaling) less d
    (1023, 1024, 2, 1, False, None, "bshd", "block"),
    (640, 1500, 2, 2, False, None, "bhsd", "qk-spread"),
    (300, 777, 4, 2, True, None, "bshd", "head"),
    (700, 300, 2, 1, True, None, "bhsd", "block"),  # causal, Sq > Sk: the queue hands out blocks that see no key
    (257, 515, 4, 2, False, (100, 100), "bhsd", "v-spread"),
    (1, 239, 4, 4, False, None, "bshd", "tensor"),
]


@pytest.fixture
def persistent_tiles(monkeypatch, request):
    """Patch every FP8 tile table entry of head dim d to `tiles` and the GPU's SM count to num_sms (None: as is)."""
    d, tiles, num_sms = request.param
    from cuflash import _families, _plan, config

    for table in (config.FWD_SM90_FP8_TILES, config.FWD_SM90_FP8_TILES_BANDED, config.FWD_SM90_FP8_TILES_SHORT,
                  config.FWD_SM90_FP8_TILES_CAUSAL_SHORT):
        monkeypatch.setitem(table, d, tiles)
    if num_sms is not None:
        monkeypatch.setitem(_families._num_sms, cp.cuda.Device().id, num_sms)
    _families._selected.clear()
    _plan.plans.clear()
    yield d, tiles
    _families._selected.clear()
    _plan.plans.clear()


@pytest.mark.parametrize("persistent_tiles", [(d, t, n) for d, t in PERSISTENT_TILES for n in (3, None)],
                         indirect=True, ids=lambda p: f"d{p[0]}-{'-'.join(map(str, p[1][:6]))}-sms{p[2]}")
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_fp8_persistent_forward(persistent_tiles, case):
    d, tiles = persistent_tiles
    cfg = config.fwd_sm90_fp8_config(d, "bf16", case[4], case[5] is not None, seqlen_k=case[1])
    assert (cfg.block_n, cfg.stages, cfg.pingpong, cfg.q_in_regs, cfg.late_pack, cfg.consumers, cfg.persistent) == \
        tiles, cfg
    check_forward((d,) + case, "bf16")
    if cfg.uses_queue(False):  # each launch leaves its work queue's two counters at zero for the next
        from cuflash import _families

        stream = cp.cuda.get_current_stream()
        queue = _families._queue_ptr(cp.cuda.Device().id, stream.ptr)
        counters = cp.ndarray((2,), cp.int32, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(queue, 8, None), 0))
        stream.synchronize()
        assert counters.tolist() == [0, 0], f"the work queue was left at {counters.tolist()}"


@pytest.mark.parametrize("persistent_tiles", [(d, t, 3) for d, t in PERSISTENT_TILES], indirect=True,
                         ids=lambda p: f"d{p[0]}-{'-'.join(map(str, p[1][:6]))}-sms{p[2]}")
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_persistent_varlen(persistent_tiles, causal):
    check_varlen(persistent_tiles[0], causal, VARLEN_SHORT)


PLANNED = [  # (d, sq, sk, heads, heads_kv, causal, window, layout, scaling, out_dtype)
    (128, 300, 517, 4, 2, True, None, "bshd", "block", "bf16"),
    (64, 129, 255, 2, 2, False, (40, 8), "bhsd", "head", "fp16"),
    (256, 64, 1000, 2, 1, False, None, "bshd", "tensor", "bf16"),
    (128, 1, 333, 4, 4, False, None, "bshd", "none", "fp16"),
]


@pytest.mark.parametrize("case", PLANNED, ids=lambda c: "-".join(map(str, c)))
def test_fp8_warm_calls_replay_the_full_path(case):
    """attention and attention_forward on FP8 inputs record a plan on their first call (descales as arrays or None)
    and later calls of that signature replay it: on new inputs and descales the replay gives the bits of the full
    path (plans cleared) and the reference result; so do descales given as numbers (planned by value)."""
    from cuflash import _plan, api

    d, sq, sk, h, hkv, causal, window, layout, scaling, out_dtype = case
    b = 2
    kw = dict(causal=causal, window=window, layout=layout, out_dtype=out_dtype)

    def inputs(salt):
        seed = seed_of("fp8-plan", case, salt)
        bits = [e4m3_bits((b, s, n, d), seed + i) for i, (s, n) in enumerate(((sq, h), (sk, hkv), (sk, hkv)))]
        desc = [descale_arg(scaling, b, n, s, seed + 10 + i)
                for i, (s, n) in enumerate(((sq, h), (sk, hkv), (sk, hkv)))]
        arrays = tuple(cp.asarray(to_layout(x, layout)) for x, _ in bits)
        values = tuple(dequantize(v, f, s) for (_, v), (_, f), s in zip(bits, desc, (sq, sk, sk)))
        return arrays, dict(q_descale=desc[0][0], k_descale=desc[1][0], v_descale=desc[2][0]), values

    _plan.plans.clear()
    first, first_desc, _ = inputs(0)
    cuflash.attention_forward(*first, **kw, **first_desc)
    cuflash.attention(*first, **kw, **first_desc)
    assert len(_plan.plans) == 2, f"the first calls made {len(_plan.plans)} plans, not 2"
    arrays, desc, (q64, k64, v64) = inputs(1)
    key = api._FORWARD.key(*arrays, causal, None, layout, None, window, None, None, None, None, None, 0.0, None, 0,
                           False, desc["q_descale"], desc["k_descale"], desc["v_descale"], out_dtype)
    assert _plan.plans.get(key) is not None, "the second call's key finds no plan"
    poison_pool(2 * b * sq * h * d * 2 + 4 * b * h * sq + (1 << 16))
    o, lse = cuflash.attention_forward(*arrays, **kw, **desc)
    o_only = cuflash.attention(*arrays, **kw, **desc)
    _plan.plans.clear()
    want_o, want_lse = cuflash.attention_forward(*arrays, **kw, **desc)
    assert bool((o.view(cp.uint16) == want_o.view(cp.uint16)).all()), f"replayed o differs from the full path's, {case}"
    assert bool((o_only.view(cp.uint16) == want_o.view(cp.uint16)).all()), f"replayed attention() differs, {case}"
    assert bool((lse.view(cp.uint32) == want_lse.view(cp.uint32)).all()), f"replayed lse differs, {case}"
    o64, lse64 = ref.attention_forward64(q64, k64, v64, causal, 1.0 / math.sqrt(d), window=window)
    emul_err = float(np.abs(emulate(q64, k64, v64, causal, window, 1.0 / math.sqrt(d)) - o64).max())
    err = float(np.abs(from_layout(cp.asnumpy(o).astype(np.float64), layout) - o64).max())
    out_round = (2.0 ** -8 if out_dtype == "bf16" else 2.0 ** -11) * float(np.abs(o64).max())
    assert err <= 2.0 * emul_err + out_round + 1e-5, f"o mismatch for {case}: {err:.3e}"
    check_lse(lse, cp.asarray(lse64), str(case), atol=1e-2)
    # a descale given as a number enters the key by value: the second call replays, with the full path's bits
    _plan.plans.clear()
    numbers = dict(desc, q_descale=0.5, v_descale=2)
    cuflash.attention_forward(*first, **kw, **numbers)
    assert len(_plan.plans) == 1, "a call with descales given as numbers made no plan"
    o, lse = cuflash.attention_forward(*arrays, **kw, **numbers)
    assert len(_plan.plans) == 1, "the second call with the same numbers made a plan of its own"
    _plan.plans.clear()
    want_o, want_lse = cuflash.attention_forward(*arrays, **kw, **numbers)
    assert bool((o.view(cp.uint16) == want_o.view(cp.uint16)).all()), f"replayed o (numbers) differs, {case}"
    assert bool((lse.view(cp.uint32) == want_lse.view(cp.uint32)).all()), f"replayed lse (numbers) differs, {case}"


@pytest.mark.parametrize("d,causal,scaling", [(128, True, "block"), (64, False, "none")])
def test_fp8_varlen_warm_calls_replay_the_full_path(d, causal, scaling):
    """attention_varlen_forward / attention_varlen on FP8 inputs record a plan (cu_seqlens and the descale arrays
    bound per call, check_inputs reading cu_seqlens back on every call): a later call on new data and descales gives
    the bits of the full path (plans cleared) and each sequence's reference result."""
    from cuflash import _plan

    lens_q, lens_k = [130, 0, 257, 1], [200, 5, 129, 64]
    h, hkv, b = 4, 2, len(lens_q)
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    mq, mk = max(lens_q), max(lens_k)

    def inputs(salt):
        seed = seed_of("fp8 varlen plan", d, causal, salt)
        bits = [e4m3_bits((int(c[-1]), n, d), seed + i) for i, (c, n) in enumerate(((cq, h), (ck, hkv), (ck, hkv)))]
        desc = [descale_arg(scaling, b, n, s, seed + 10 + i)
                for i, (s, n) in enumerate(((mq, h), (mk, hkv), (mk, hkv)))]
        args = (*(cp.asarray(x) for x, _ in bits), cp.asarray(cq, dtype=cp.int32), cp.asarray(ck, dtype=cp.int32),
                mq, mk)
        return args, dict(q_descale=desc[0][0], k_descale=desc[1][0], v_descale=desc[2][0]), bits, desc

    _plan.plans.clear()
    args, kw, _, _ = inputs(0)
    cuflash.attention_varlen_forward(*args, causal=causal, **kw)
    assert len(_plan.plans) == 1, "the first call made no plan"
    args, kw, bits, desc = inputs(1)
    o, lse = cuflash.attention_varlen_forward(*args, causal=causal, **kw)
    o_only = cuflash.attention_varlen(*args, causal=causal, **kw)
    _plan.plans.clear()
    want_o, want_lse = cuflash.attention_varlen_forward(*args, causal=causal, **kw)
    assert bool((o.view(cp.uint16) == want_o.view(cp.uint16)).all()), "replayed o differs from the full path's"
    assert bool((o_only.view(cp.uint16) == want_o.view(cp.uint16)).all()), "replayed attention_varlen differs"
    assert bool((lse.view(cp.uint32) == want_lse.view(cp.uint32)).all()), "replayed lse differs from the full path's"
    o_host = cp.asnumpy(o).astype(np.float64)
    (_, qv), (_, kv), (_, vv) = bits
    (_, qf), (_, kf), (_, vf) = desc
    for s in range(b):
        if lens_q[s] == 0:
            continue
        rq, rk = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        q64, k64, v64 = (dequantize(x[None, r], f[min(s, f.shape[0] - 1):][:1], n) for x, r, f, n in
                         ((qv, rq, qf, lens_q[s]), (kv, rk, kf, lens_k[s]), (vv, rk, vf, lens_k[s])))
        o64, _ = ref.attention_forward64(q64, k64, v64, causal)
        emul = emulate(q64, k64, v64, causal, None, 1 / math.sqrt(d))
        err = float(np.abs(o_host[None, rq] - o64).max())
        bound = 2.0 * float(np.abs(emul - o64).max()) + 2.0 ** -8 * float(np.abs(o64).max()) + 1e-5
        assert err <= bound, f"sequence {s} (d={d}, causal={causal}): {err:.3e} > {bound:.3e}"


def test_fp8_bench_takes_the_window_in_both_calls():
    """`python -m cuflash.bench --fp8 --window L R`: the bf16 and the FP8 call both take the window, and the TFLOP/s
    count the band's pairs (a bench that dropped the window timed the full rows under the window's label)."""
    import argparse
    import types

    from cuflash import bench

    seen = []

    def attention(*args, **kw):
        seen.append((args[0].dtype.name, kw.get("window"), kw.get("causal")))
        return cuflash.attention(*args, **kw)

    spy = types.SimpleNamespace(attention=attention)
    args = argparse.Namespace(head_dim=[64], seqlen=[1024], causal="no", window=[128, 0], reps=3, warmup=1)
    records = bench.run_fp8(args, spy)
    assert {(w, c) for _, w, c in seen} == {((128, 0), False)}, f"calls without the window: {set(seen)}"
    names = {name for name, _, _ in seen}
    assert len(names) == 2 and "bfloat16" in names, f"calls: {set(seen)}"  # the bf16 call and the e4m3 one
    assert len(records) == 2
    pairs = bench.visible_pairs(1024, 1024, False, (128, 0))
    assert pairs < 1024 * 1024 // 4
    for r in records:
        want = 4.0 * r.batch * r.heads * r.head_dim * pairs / r.ms / 1e9
        assert math.isclose(r.tflops, want, rel_tol=1e-9), (r, want)
