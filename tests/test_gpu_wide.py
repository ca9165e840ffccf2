"""float32 and float64 inputs on the GPU, forward and backward, against references (the pass rules of
docs/RELIABILITY.md, "float32 and float64"). Outputs are poisoned (NaN) before each call, inputs are fresh per
case (seed_of), over the awkward seqlen pairs, head dims, causal, both layouts, strides, GQA, windows, varlen, and
for float32 the bias (with dbias), masks, ALiBi, softcap and dropout.

Pass rules (each a maximum over all elements; every output also free of NaN and inf, of the documented shape and
dtype; X is o, lse, dq, dk, dv or dbias; F = 2 for o and lse, 3 for dq, dk, dv and dbias):

  float32, precision="fp32" (what precision=None means for float32):
      max|X - X_ref64| <= F * max|X_fp32 - X_ref64| + 1e-6 * max(1, max|X_ref64|)
      X_ref64: float64 attention of the same inputs on the GPU; X_fp32: plain float32 attention, CuPy's cuBLAS
      float32 matmuls. CuPy rounds float32 matmul inputs to TF32 with CUPY_TF32=1: the module's fixture switches
      that off and checks that CuPy's float32 matmul is exact (cuBLAS's NVIDIA_TF32_OVERRIDE=1 fails it).
  float32, precision="tf32": the same with X_tf32, plain TF32 attention, in place of X_fp32: every matmul input
      (q, k, P, v; dO, V, P, dS, K, Q) rounded to TF32 to nearest, the products (exact in float32) accumulated in
      float32, everything else float32.
  float64 (precision None, the only value float64 takes):
      max|X - X_ext| <= F * max|X_fp64 - X_ext| + 1e-13 * max(1, max|X_ext|)
      X_ext: attention in extended precision on the CPU (NumPy np.longdouble: 64 mantissa bits on x86, so its own
      error is ~2^11 below float64's; where np.longdouble is no wider than float64 the float64 tests skip, saying
      so); X_fp64: plain float64 attention (CuPy float64 matmuls). Shapes keep B * H * Sq * Sk <= 2e5 (one forward
      case 1e6) so the host reference stays quick.
  lse: the rule with F = 2 on the rows that see a key, and -inf exactly on the rows that see none; float32 for
      float32 inputs, float64 for float64 inputs. A row that sees no key has o = 0 and dq = 0 exactly.

All references are cuflash._xpref.attention_plain / attention_backward_plain (and their varlen forms): plain
attention in one working precision with every option of cuflash.reference, which tests/test_validation_wide.py
checks against cuflash.reference on the CPU.

The floors are relative to the largest reference value (at least 1), so they follow the outputs' scale:
  1e-6 for float32 (about 8 float32 ulps of the largest value): plain float32 attention can be exact where the
      kernel is not, e.g. a row that sees one key (o = v exactly, P = 1), while 3xTF32 keeps about 21 bits of each
      operand's low part, an error of up to ~2^-22 |v| there (~1e-6 at |v| ~ 4). One TF32 step anywhere in the
      fp32 mode (an error ~2^-11 ~ 5e-4) stays ~500x above the floor.
  1e-13 for float64 (about 450 float64 ulps of 1): correct float64 kernels and plain float64 attention are off by
      1e-16..1e-15 (exp2 of a rescaled argument, other summation orders); one float32 step (~1e-7) is 1e6x above.
A NumPy model of the kernels (online softmax with exp2 and log2-domain lse, dQ summed by key blocks; 3xTF32 with
float32 accumulators, TF32 rounded to nearest, float64) gave error / plain error <= 1.8 for o and lse and <= 1.9
for the gradients before the floors. The same model fails the rules (by design) when it truncates to TF32 instead of
rounding (tf32 mode: 2.3-6x for o, 4-24x for lse), or when its tensor-core sums round toward zero, as NVIDIA's
tensor cores do (Fasi et al., 2021), along a whole key loop into one accumulator (fp32 mode: 3-15x for o, growing
with the keys); summing each tile's products into zeroed registers and adding those to the running accumulator with
a rounded float32 add brought that back to 0.6-1.1x.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _xpref, config, philox  # noqa: E402
from gpu_helpers import (HEAD_DIMS, LAYOUTS, SEQLEN_PAIRS, batch_heads, check_lse_wide, check_replay_matches_full_path,  # noqa: E402
                         check_rule_wide, cu_seqlens, float32_matmul_rounds_to_tf32, make_input, make_packed, max_abs,
                         poison_pool, round_up, same_bits, seed_of, to_bshd, warm_kernel_cache)
from test_gpu_bias import make_bias, padding_mask, random_mask  # noqa: E402
from test_gpu_mods import check_mask, mods_kwargs  # noqa: E402

pytestmark = pytest.mark.gpu

PRECISIONS = ["fp32", "tf32", "fp64"]  # float32 inputs with precision "fp32" / "tf32"; float64 inputs
FLOATS32 = ["fp32", "tf32"]
FLOORS = {"fp32": 1e-6, "tf32": 1e-6, "fp64": 1e-13}
HEAD_DIMS_FP64 = [32, 64, 96, 128]  # float64 takes head dims up to 128
CONTIGUOUS = ("contiguous",) * 4
MAX_HOST_SCORES = 200_000  # B * H * Sq * Sk of a float64 case: the extended-precision reference runs on the CPU


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Compile the float32 / float64 kernels up front (the configs whose dtype is not a 16-bit one)."""
    warm_kernel_cache([c for c in config.all_fwd_configs() + config.all_bwd_configs()
                       if getattr(c, "dtype", "fp16") not in ("fp16", "bf16")])


@pytest.fixture(scope="module", autouse=True)
def float32_matmuls_without_tf32():
    """The fp32 rule's plain attention must be float32: with CUPY_TF32=1 CuPy rounds float32 matmul inputs to TF32;
    this switches CuPy's float32 compute type back to its default for the module (and restores it), then checks
    that a float32 matmul is exact, which also fails under cuBLAS's NVIDIA_TF32_OVERRIDE=1."""
    restore = None
    if float32_matmul_rounds_to_tf32():
        try:
            from cupy._core import _routines_linalg as linalg

            saved = linalg.get_compute_type(np.dtype(np.float32))
            linalg.set_compute_type(np.dtype(np.float32), linalg.COMPUTE_TYPE_DEFAULT)
            restore = lambda: linalg.set_compute_type(np.dtype(np.float32), saved)  # noqa: E731
        except (ImportError, AttributeError):  # a CuPy without the switch: the check below reports it
            pass
    assert not float32_matmul_rounds_to_tf32(), (
        "CuPy's float32 matmul rounds its inputs to TF32 here (NVIDIA_TF32_OVERRIDE=1 or CUPY_TF32=1 in the "
        "environment?): unset it, the plain float32 attention of the fp32 rule must be float32")
    yield
    if restore is not None:
        restore()


def need_extended_reference():
    """The float64 rule's reference is np.longdouble, which must be wider than float64 (x86: 80-bit extended, eps
    1.1e-19; aarch64 Linux: IEEE quad) and keep its bits through matmul (NumPy's generic loop, no BLAS). Where
    np.longdouble is float64 (MSVC, Apple silicon) the float64 tests skip with this reason instead of comparing
    float64 with itself."""
    eps = float(np.finfo(np.longdouble).eps)
    if not eps < 1e-18:
        pytest.skip(f"np.longdouble is not wider than float64 on this host (eps {eps:.3g}): no extended-precision "
                    f"reference for the float64 rule")
    a = np.array([[[1.0, 2.0 ** -60]]], dtype=np.longdouble)
    assert (a @ np.ones((1, 2, 1), dtype=np.longdouble))[0, 0, 0] != 1, "np.longdouble matmul drops bits below float64"


# --- the check ------------------------------------------------------------------------------------------------

def input_dtype(precision: str) -> str:
    return "fp64" if precision == "fp64" else "fp32"


def api_precision(precision: str):
    """precision= of the cuflash calls: "fp32" / "tf32" for float32 inputs, None for float64 inputs."""
    return None if precision == "fp64" else precision


def lse_dtype(precision: str):
    return cp.float64 if precision == "fp64" else cp.float32


def host_scores_ok(b, hq, sq, sk, precision, limit=MAX_HOST_SCORES):
    assert precision != "fp64" or b * hq * sq * sk <= limit, \
        f"float64 case with {b * hq * sq * sk} scores: the host reference is kept to {limit}"


def fp64_batch_heads(sq: int, sk: int) -> tuple[int, int]:
    """The largest of (2, 3), (2, 2), (1, 2), (1, 1) keeping B * H * Sq * Sk <= MAX_HOST_SCORES."""
    for b, h in ((2, 3), (2, 2), (1, 2), (1, 1)):
        if b * h * sq * sk <= MAX_HOST_SCORES:
            return b, h
    return 1, 1


class References(NamedTuple):
    o: object  # the reference (float64 on the GPU, or np.longdouble on the host for float64 inputs)
    lse: object
    o_plain: object  # plain attention in the rule's precision (CuPy)
    lse_plain: object
    grads: tuple = ()
    grads_plain: tuple = ()


def references(precision, q, k, v, dout, causal, options, backward, varlen=None) -> References:
    """The reference and the plain attention of the rule: float32 inputs: float64 and plain "fp32" / "tf32", both
    on the GPU; float64 inputs: np.longdouble on the host and plain float64 on the GPU. q, k, v, dout in bshd
    order (or packed, with varlen = (cu_seqlens_q, cu_seqlens_k)); options: attention_plain's keyword arguments."""
    if precision == "fp64":
        need_extended_reference()
        ref_precision, conv = "ext", cp.asnumpy
    else:
        ref_precision, conv = "fp64", (lambda x: x)
    fwd, bwd = ((_xpref.attention_varlen_plain, _xpref.attention_varlen_backward_plain) if varlen else
                (_xpref.attention_plain, _xpref.attention_backward_plain))
    pre = tuple(varlen or ())
    o_ref, lse_ref = fwd(*(conv(x) for x in (q, k, v)), *pre, ref_precision, causal, **options)
    o_plain, lse_plain = fwd(q, k, v, *pre, precision, causal, **options)
    if not backward:
        return References(o_ref, lse_ref, o_plain, lse_plain)
    grads = bwd(*(conv(x) for x in (dout, q, k, v)), *pre, ref_precision, causal, **options)
    grads_plain = bwd(dout, q, k, v, *pre, precision, causal, **options)
    return References(o_ref, lse_ref, o_plain, lse_plain, grads, grads_plain)


def dead_rows(lse_ref):
    """Rows that see no key (lse_ref = -inf), as a CuPy bool array of lse's shape."""
    return cp.asarray(~_xpref.array_module(lse_ref).isfinite(lse_ref))


def check_outputs(precision, o, lse, refs, what, o_rows):
    """o and lse by the rule; o rows that see no key exactly 0. o_rows(x): x's rows in lse's order (..., D)."""
    floor = FLOORS[precision]
    check_rule_wide("o", o, refs.o, refs.o_plain, 2, what, floor)
    check_lse_wide(lse, refs.lse, refs.lse_plain, what, floor, lse_dtype(precision))
    dead = dead_rows(refs.lse)
    assert max_abs(o_rows(o)[dead]) == 0.0, f"o rows that see no key must be 0 for {what}"


def check_grads(precision, grads, inputs, refs, what, dq_rows, bias=None):
    """dq, dk, dv (and dbias) by the rule, of the inputs' shapes and dtypes (dbias: float32, bias's shape); dq rows
    that see no key exactly 0. dq_rows(x): x's rows in lse's order."""
    floor = FLOORS[precision]
    for name, g, x in zip(("dq", "dk", "dv"), grads, inputs):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} is {g.shape} {g.dtype} for {what}"
    for name, g, g_ref, g_plain in zip(("dq", "dk", "dv"), grads[:3], refs.grads, refs.grads_plain):
        check_rule_wide(name, g, g_ref, g_plain, 3, what, floor)
    if bias is not None:
        assert len(grads) == 4, f"{len(grads)} gradients with dbias=True for {what}"
        assert grads[3].shape == bias.shape and grads[3].dtype == cp.float32, \
            f"dbias is {grads[3].shape} {grads[3].dtype}, expected float32 {bias.shape} for {what}"
        check_rule_wide("dbias", grads[3], refs.grads[3], refs.grads_plain[3], 3, what, floor)
    else:
        assert len(grads) == 3, f"{len(grads)} gradients for {what}"
    dead = dead_rows(refs.lse)
    assert max_abs(dq_rows(grads[0])[dead]) == 0.0, f"dq rows that see no key must be 0 for {what}"


def check_repeats(grads, again, what):
    """A deterministic backward run again (`again()`, on memory poisoned anew) gives the same bits."""
    first = [g.copy() for g in grads]
    poison_pool(sum(round_up(g.nbytes) for g in grads) + (1 << 20))
    second = again()
    assert all(same_bits(a, b) for a, b in zip(second, first)), f"deterministic=True: the backward differs between " \
                                                                f"runs for {what}"


class Result(NamedTuple):
    o: object
    lse: object
    grads: tuple
    lse_ref: object


def nan_like(x):
    return cp.full(x.shape, cp.nan, dtype=x.dtype)


def run_dense(precision, b, sq, sk, hq, hkv, d, *, causal=False, layout="bshd", kinds=CONTIGUOUS, mods=None,
              bias_shape=None, mask=None, padding=None, scale_inputs=1.0, backward=True, prealloc=False,
              host_limit=MAX_HOST_SCORES, deterministic=False, bias_view=None) -> Result:
    """Forward (and backward) of one dense problem on poisoned memory, checked by the rule of `precision`.
    mods: test_gpu_mods.mods_kwargs's dict (window, alibi, softcap, dropout); bias_shape: a float32 bias (dbias
    asked for), bias_view: None (contiguous), "odd-rows" (a slice of wider rows: an odd number of floats from one
    row to the next) or "transposed" (keys strided, queries contiguous); mask: a maker (b, h, sq, sk, seed) -> bool
    mask; padding: None, "random" or "dead" (batch 0 sees
    no key); prealloc: NaN-filled dq, dk, dv given to the backward; deterministic: the backward with
    deterministic=True, run twice on poisoned memory, the second's bits equal to the first's."""
    host_scores_ok(b, hq, sq, sk, precision, host_limit)
    dtype = input_dtype(precision)
    seed = seed_of("wide", precision, b, sq, sk, hq, hkv, d, causal, layout, kinds, sorted((mods or {}).items()),
                   bias_shape, getattr(mask, "__name__", None), padding, scale_inputs, prealloc, bias_view)
    what = (f"{precision} B={b} Sq={sq} Sk={sk} H={hq}/{hkv} D={d} causal={causal} {layout} "
            f"strides={'/'.join(kinds)} mods={mods} bias={bias_shape} {bias_view or ''} "
            f"mask={getattr(mask, '__name__', None)} padding={padding}")
    q = make_input(b, sq, hq, d, dtype, layout, kinds[0], seed, scale_inputs)
    k = make_input(b, sk, hkv, d, dtype, layout, kinds[1], seed + 1, scale_inputs)
    v = make_input(b, sk, hkv, d, dtype, layout, kinds[2], seed + 2)
    dout = make_input(b, sq, hq, d, dtype, layout, kinds[3], seed + 3)
    kw = mods_kwargs(mods or {}, b, hq, seed)
    if bias_shape is not None:
        *lead, bq, bk = bias_shape
        if bias_view == "odd-rows":  # rows of bk + 1 or + 2 floats, an odd number
            kw["bias"] = make_bias((*lead, bq, bk + 1 + bk % 2), "fp32", "fp32", seed + 4, 2.0)[..., :bk]
        elif bias_view == "transposed":
            kw["bias"] = cp.swapaxes(make_bias((*lead, bk, bq), "fp32", "fp32", seed + 4, 2.0), -1, -2)
        else:
            kw["bias"] = make_bias(bias_shape, "fp32", "fp32", seed + 4, 2.0)
    if mask is not None:
        kw["mask"] = mask(b, hq, sq, sk, seed + 5)
    if padding is not None:
        kw["key_padding_mask"] = padding_mask(b, sk, seed + 6, dead_batch=padding == "dead")
    with_dropout = "dropout_p" in kw

    poison_pool(round_up(q.nbytes) + round_up(b * hq * sq * 8))
    out = cuflash.attention_forward(q, k, v, causal=causal, layout=layout, precision=api_precision(precision),
                                    return_dropout_mask=with_dropout, **kw)
    o, lse = out[:2]
    assert o.shape == q.shape and o.dtype == q.dtype, f"o is {o.shape} {o.dtype} for {what}"
    assert lse.shape == (b, hq, sq), f"lse shape {lse.shape} for {what}"
    options = {name: kw[name] for name in ("window", "alibi_slopes", "softcap", "dropout_p", "bias", "mask",
                                           "key_padding_mask") if name in kw}
    if with_dropout:
        check_mask(out[2], kw, b, hq, sq, sk, what)
        options["dropout_mask"] = out[2]
    qb, kb, vb, dob = (to_bshd(x, layout) for x in (q, k, v, dout))
    refs = references(precision, qb, kb, vb, dob, causal, options, backward)
    check_outputs(precision, to_bshd(o, layout), lse, refs, what, lambda x: x.transpose(0, 2, 1, 3))
    if not backward:
        return Result(o, lse, (), refs.lse)
    given = dict(dq=nan_like(q), dk=nan_like(k), dv=nan_like(v)) if prealloc else {}
    extra = dict(kw, dbias=True) if bias_shape is not None else kw
    poison_pool(round_up(8 * (q.nbytes + 2 * k.nbytes)) + (round_up(4 * kw["bias"].size) if bias_shape else 0)
                + (1 << 20))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, layout=layout,
                                       precision=api_precision(precision), deterministic=deterministic, **given,
                                       **extra)
    for name, g in given.items():
        i = ("dq", "dk", "dv").index(name)
        assert grads[i].data.ptr == g.data.ptr and grads[i].shape == g.shape, \
            f"{name} was not written into the given array for {what}"
    if deterministic:
        check_repeats(grads, lambda: cuflash.attention_backward(
            dout, q, k, v, o, lse, causal=causal, layout=layout, precision=api_precision(precision),
            deterministic=True, **extra), what)
    check_grads(precision, [to_bshd(g, layout) for g in grads[:3]] + list(grads[3:]), (qb, kb, vb), refs, what,
                lambda x: x.transpose(0, 2, 1, 3), bias=kw.get("bias"))
    return Result(o, lse, grads, refs.lse)


# --- the grids: seqlen pairs x head dims x causal (layouts alternate over the grid) ---------------------------

FWD_GRID = [(sq, sk, HEAD_DIMS[(i + j) % len(HEAD_DIMS)], LAYOUTS[(i + j) % 2], precision)
            for i, (sq, sk) in enumerate(SEQLEN_PAIRS) for j, precision in enumerate(FLOATS32)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk,d,layout,precision", FWD_GRID,
                         ids=[f"{p}-{sq}x{sk}-d{d}-{lay}" for sq, sk, d, lay, p in FWD_GRID])
def test_float32_forward_matches_reference(sq, sk, d, layout, precision, causal):
    """Every seqlen pair in both float32 modes, each with two of the head dims 32..256."""
    b, h = batch_heads(sq, sk)
    run_dense(precision, b, sq, sk, h, h, d, causal=causal, layout=layout, backward=False)


FP64_PAIRS = [(sq, sk) for sq, sk in SEQLEN_PAIRS if sq * sk <= MAX_HOST_SCORES]
FWD64_GRID = [(sq, sk, HEAD_DIMS_FP64[i % len(HEAD_DIMS_FP64)], LAYOUTS[i % 2])
              for i, (sq, sk) in enumerate(FP64_PAIRS)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk,d,layout", FWD64_GRID, ids=[f"{sq}x{sk}-d{d}-{lay}" for sq, sk, d, lay in FWD64_GRID])
def test_float64_forward_matches_reference(sq, sk, d, layout, causal):
    """The seqlen pairs whose scores fit the host reference, head dims 32..128 (float64's range)."""
    b, h = fp64_batch_heads(sq, sk)
    run_dense("fp64", b, sq, sk, h, h, d, causal=causal, layout=layout, backward=False)


@pytest.mark.parametrize("sq,sk,causal", [(1023, 1024, False), (1024, 1023, True)])
def test_float64_forward_long_sequences(sq, sk, causal):
    """The longest pairs (many key tiles per row) in one head at D 32: 1e6 scores for the host reference."""
    run_dense("fp64", 1, sq, sk, 1, 1, 32, causal=causal, backward=False, host_limit=1_100_000)


@pytest.mark.parametrize("spread", [40.0, 1500.0], ids=["moving-max", "underflow"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float64_scores_rising_across_key_tiles(spread, d, causal):
    """The float64 forward keeps a row's max while its scores stay below it + 8 (log2 units) and rescales O only
    on tiles where some row of a warp moves it (cuda/softmax.cuh, update_lazy). Scores that rise by `spread` (natural
    units) from the last key to the first, the order the forward walks its key tiles, move the max past that margin
    every few tiles (40) or on every tile, with most exponentials below float64's range (1500). Forward and backward
    (default and deterministic) by the float64 rule. At 1500 the backward's P^T must be the forward's P to the last
    bit: dQ multiplies dS by keys of norm ~1500, so S^T summed in another order than the forward's S (the
    head-dim-128 backward's two warps per key group each summing half of the head dim, before they split S^T by
    queries: cuda/wide.cuh) put dq 30-40x further from the exact gradient than plain float64."""
    b, h, sq, sk = 1, 2, 130, 300
    rng = np.random.default_rng(seed_of("wide-rising", spread, d, causal))
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    ramp = spread * np.arange(sk - 1, -1, -1) / (sk - 1)  # the score of key j is about ramp[j]
    q = 0.5 * rng.standard_normal((b, sq, h, d)) + np.sqrt(d) * u
    k = 0.5 * rng.standard_normal((b, sk, h, d)) + ramp[None, :, None, None] * u
    v, dout = rng.standard_normal((b, sk, h, d)), rng.standard_normal((b, sq, h, d))
    q, k, v, dout = (cp.asarray(x) for x in (q, k, v, dout))
    what = f"fp64 scores rising by {spread} D={d} causal={causal}"
    poison_pool(round_up(q.nbytes) + round_up(b * h * sq * 8))
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    refs = references("fp64", q, k, v, dout, causal, {}, True)
    check_outputs("fp64", o, lse, refs, what, lambda x: x.transpose(0, 2, 1, 3))
    # the default backward and the deterministic one (its own kernel: the dQ adds in a fixed order)
    for deterministic in (False, True):
        poison_pool(round_up(8 * (q.nbytes + 2 * k.nbytes)) + (1 << 20))
        grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=deterministic)
        check_grads("fp64", grads, (q, k, v), refs, f"{what} deterministic={deterministic}",
                    lambda x: x.transpose(0, 2, 1, 3))


BWD_PAIRS = [(113, 203), (256, 512), (1023, 1024), (1, 239), (512, 256), (127, 513)]
BWD_GRID = [(sq, sk, HEAD_DIMS[(i + 2 * j) % len(HEAD_DIMS)], LAYOUTS[(i + j) % 2], precision)
            for i, (sq, sk) in enumerate(BWD_PAIRS) for j, precision in enumerate(FLOATS32)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk,d,layout,precision", BWD_GRID,
                         ids=[f"{p}-{sq}x{sk}-d{d}-{lay}" for sq, sk, d, lay, p in BWD_GRID])
def test_float32_backward_matches_reference(sq, sk, d, layout, precision, causal):
    b, h = batch_heads(sq, sk)
    run_dense(precision, b, sq, sk, h, h, d, causal=causal, layout=layout)


BWD64_PAIRS = [(113, 203), (108, 256), (1, 239), (512, 256), (127, 513)]
BWD64_GRID = [(sq, sk, HEAD_DIMS_FP64[i % len(HEAD_DIMS_FP64)], LAYOUTS[(i + 1) % 2])
              for i, (sq, sk) in enumerate(BWD64_PAIRS)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk,d,layout", BWD64_GRID, ids=[f"{sq}x{sk}-d{d}-{lay}" for sq, sk, d, lay in BWD64_GRID])
def test_float64_backward_matches_reference(sq, sk, d, layout, causal):
    b, h = fp64_batch_heads(sq, sk)
    run_dense("fp64", b, sq, sk, h, h, d, causal=causal, layout=layout)


# --- the Hopper TF32 forward ----------------------------------------------------------------------------------

def test_hopper_float32_forward_runs_on_tf32_wgmma():
    """On an sm_90a GPU the float32 forward at kernel head dims 32, 64 and 128 (plain, causal, windowed) is
    fwd_sm90_tf32_kernel (3xTF32 at 128: its cluster pairs of 64 columns), so the forward tests above run it there;
    elsewhere fwd_wide_kernel is the only one."""
    from cuflash import _launch

    arch = _launch.device_arch(cp.cuda.Device().id)
    if arch != "sm_90a" or config.KERNELS == "mma":
        pytest.skip(f"the TF32 wgmma forward runs on sm_90a with the default kernels (here {arch}, {config.KERNELS})")
    for precision in FLOATS32:
        for d in (8, 24, 32, 40, 64, 72, 128):
            for causal, mods in ((False, 0), (True, 0), (False, config.MOD_WINDOW)):
                cfg = config.select("forward", config.kernel_head_dim(d, precision), precision, causal, arch, mods=mods)
                assert isinstance(cfg, config.FwdSm90Tf32Config), (precision, d, causal, mods, cfg)
                assert cfg.split == (2 if d > 64 and precision == "fp32" else 1), cfg


@pytest.mark.parametrize("precision", FLOATS32)
@pytest.mark.parametrize("d", [40, 104, 120])
def test_float32_forward_head_dims_between_kernels(d, precision):
    """Head dims below a kernel's run the next one (on Hopper the TF32 kernels of 64 and 128): TMA zero-fills the
    columns past head_dim in shared memory, and O's columns past it are not stored (poisoned memory around them)."""
    run_dense(precision, 2, 203, 113 if d != 120 else 1024, 3, 3, d, causal=d == 104, layout=LAYOUTS[d % 16 // 8],
              backward=False)



# (precision, b, sq, sk, hq, hkv, d, causal, mods): the three-consumer tiles (192 query rows per CTA): query lengths
# that leave the last block part empty (1100 = 5 x 192 + 140, 385, 193), causal rows past the short-causal rule,
# GQA / MQA, a window, head dims below the kernel's
THREE_CONSUMERS = [("tf32", 1, 1100, 1100, 4, 2, 64, True, None), ("tf32", 2, 385, 1500, 2, 1, 64, False, None),
                   ("fp32", 1, 1300, 1100, 3, 3, 32, True, None), ("tf32", 1, 1537, 1537, 2, 2, 24, True, None),
                   ("tf32", 2, 700, 900, 2, 2, 56, False, {"window": (100, 50)}),
                   ("fp32", 2, 193, 191, 4, 4, 32, False, None), ("fp32", 1, 1025, 1030, 2, 1, 16, True, None),
                   # one-pass TF32 at head dim 32: the dQ kernel's 192-row blocks too, the last one past the 128-row
                   # padding of lse_log2 and delta at the end of their arrays (1024 rows, one head)
                   ("tf32", 1, 1024, 1024, 1, 1, 32, False, None), ("tf32", 2, 640, 1100, 2, 2, 32, True, None)]


@pytest.mark.parametrize("precision,b,sq,sk,hq,hkv,d,causal,mods", THREE_CONSUMERS,
                         ids=[f"{c[0]}-b{c[1]}-{c[2]}x{c[3]}-h{c[4]}_{c[5]}-d{c[6]}-{'causal' if c[7] else 'full'}"
                              f"{'-window' if c[8] else ''}" for c in THREE_CONSUMERS])
def test_float32_on_three_consumer_warpgroups(precision, b, sq, sk, hq, hkv, d, causal, mods):
    """On an sm_90a GPU one-pass TF32 at head dims 32 and 64 and 3xTF32 at 32 run fwd_sm90_tf32_kernel with three
    consumer warpgroups (config.FWD_SM90_TF32_TILES), and one-pass TF32 at 32 its backward's dQ kernel too
    (config.BWD_DQ_SM90_TF32_TILES): each case asserts the registry picks them, then checks the forward and backward
    by the rule of its precision (elsewhere the same cases run the wide kernels)."""
    from cuflash import _launch

    arch = _launch.device_arch(cp.cuda.Device().id)
    if arch == "sm_90a" and config.KERNELS != "mma":
        mods_bits = config.MOD_WINDOW if mods else 0
        hd = config.kernel_head_dim(d, precision)
        cfg = config.select("forward", hd, precision, causal, arch, mods=mods_bits, seqlen_k=sk)
        assert isinstance(cfg, config.FwdSm90Tf32Config) and cfg.consumers == 3, cfg
        main = config.select("backward", hd, precision, causal, arch, mods=mods_bits, seqlen_k=sk)
        assert isinstance(main, config.BwdSm90Tf32Config), main
        assert main.dq_config().consumers == (3 if (precision, hd) == ("tf32", 32) else 2), main.dq_config()
    run_dense(precision, b, sq, sk, hq, hkv, d, causal=causal, layout=LAYOUTS[(sq + d) % 2], mods=mods)


def test_hopper_float32_backward_runs_on_tf32_wgmma():
    """On an sm_90a GPU the float32 backward at kernel head dims 32, 64 and 128 (plain, causal, windowed) is
    bwd_sm90_tf32_kernel with its dQ kernel (at 128 their cluster pairs, 64 columns per CTA), so the backward tests
    at head dims up to 128 run them there; elsewhere bwd_wide_kernel."""
    from cuflash import _launch

    arch = _launch.device_arch(cp.cuda.Device().id)
    if arch != "sm_90a" or config.KERNELS == "mma":
        pytest.skip(f"the TF32 wgmma backward runs on sm_90a with the default kernels (here {arch}, {config.KERNELS})")
    for precision in FLOATS32:
        for d in (8, 24, 32, 40, 64, 72, 96, 128):
            for causal, mods in ((False, 0), (True, 0), (False, config.MOD_WINDOW)):
                cfg = config.select("backward", config.kernel_head_dim(d, precision), precision, causal, arch, mods=mods)
                assert isinstance(cfg, config.BwdSm90Tf32Config), (precision, d, causal, mods, cfg)
                assert cfg.split == (2 if d > 64 else 1)
        assert isinstance(config.select("backward", 256, precision, False, arch), config.BwdWideConfig)


# (precision, b, sq, sk, hq, hkv, d, causal, layout): head dims below 64 (zero-filled columns), many query steps of
# the dK / dV kernel and key tiles of the dQ kernel, GQA and MQA, key and query tails
TF32_BWD = [("fp32", 2, 203, 113, 3, 3, 40, False, "bshd"), ("tf32", 2, 203, 113, 3, 3, 48, True, "bhsd"),
            ("fp32", 1, 1023, 1024, 4, 2, 56, True, "bshd"), ("tf32", 1, 1024, 1023, 4, 1, 64, False, "bhsd"),
            ("fp32", 3, 64, 65, 2, 1, 64, False, "bhsd"), ("tf32", 1, 2048, 2048, 2, 2, 64, True, "bshd"),
            ("fp32", 2, 203, 113, 3, 3, 8, True, "bhsd"), ("tf32", 2, 113, 203, 4, 2, 24, False, "bshd"),
            ("fp32", 1, 1024, 1023, 4, 1, 32, False, "bshd"), ("tf32", 3, 65, 64, 2, 2, 32, True, "bhsd"),
            # head dims 72-128: the cluster pairs (rank 1's columns partly or wholly past head_dim below 128)
            ("fp32", 2, 203, 113, 3, 3, 128, False, "bshd"), ("tf32", 1, 1023, 1024, 4, 2, 128, True, "bhsd"),
            ("fp32", 1, 1024, 1023, 4, 1, 72, True, "bhsd"), ("tf32", 3, 64, 65, 2, 1, 96, False, "bshd"),
            ("fp32", 1, 2048, 2048, 2, 2, 128, True, "bshd"), ("tf32", 2, 113, 203, 4, 4, 80, False, "bhsd")]


@pytest.mark.parametrize("precision,b,sq,sk,hq,hkv,d,causal,layout", TF32_BWD,
                         ids=[f"{c[0]}-b{c[1]}-{c[2]}x{c[3]}-h{c[4]}_{c[5]}-d{c[6]}-{'causal' if c[7] else 'full'}"
                              for c in TF32_BWD])
def test_float32_backward_head_dims_and_lengths(precision, b, sq, sk, hq, hkv, d, causal, layout):
    run_dense(precision, b, sq, sk, hq, hkv, d, causal=causal, layout=layout)


# --- deterministic=True: dq's additions in a fixed order (bwd_wide_kernel's ORDERED form; the float32 Hopper backward
# has no atomics) ------------------------------------------------------------------------------------------------

# (precision, b, sq, sk, hq, hkv, d, causal, mods): every kernel head dim of each dtype, causal and not, GQA, windows
# (the key blocks launched last-first, turns counted from the highest), tails, Sq > Sk (query blocks no key
# reaches), and one case of more CTAs than an H100's SMs hold at once (a CTA waits on CTAs that have finished)
DETERMINISTIC = [("fp32", 2, 203, 517, 3, 3, 32, False, None), ("fp32", 1, 517, 203, 4, 2, 128, True, None),
                 ("fp32", 1, 300, 700, 2, 2, 256, False, {"window": (100, 37)}),
                 ("tf32", 2, 517, 517, 2, 1, 128, False, None), ("tf32", 1, 113, 700, 2, 2, 64, True, None),
                 ("fp32", 1, 700, 517, 4, 1, 64, False, {"window": (64, 0)}),
                 ("fp64", 1, 203, 300, 2, 1, 32, True, None), ("fp64", 1, 300, 203, 2, 2, 64, False, None),
                 ("fp64", 1, 256, 300, 2, 2, 128, True, None), ("fp64", 1, 250, 300, 2, 1, 64, False, {"window": (40, 9)}),
                 ("fp32", 2, 2048, 2048, 8, 4, 128, False, None), ("fp32", 2, 2048, 2048, 8, 8, 128, True, None)]


@pytest.mark.parametrize("precision,b,sq,sk,hq,hkv,d,causal,mods", DETERMINISTIC,
                         ids=[f"{c[0]}-b{c[1]}-{c[2]}x{c[3]}-h{c[4]}_{c[5]}-d{c[6]}-{'causal' if c[7] else 'full'}"
                              f"{'-window' if c[8] else ''}" for c in DETERMINISTIC])
def test_deterministic_backward(precision, b, sq, sk, hq, hkv, d, causal, mods):
    """deterministic=True: dq, dk, dv by the rule, and the same bits on a second run (dq_accum's additions in a fixed
    order of key blocks per query block on bwd_wide_kernel; the float32 Hopper backward has no atomics)."""
    run_dense(precision, b, sq, sk, hq, hkv, d, causal=causal, layout=LAYOUTS[(sq + d) % 2], mods=mods,
              deterministic=True)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_deterministic_varlen_backward(precision):
    """Packed sequences (an empty one, queries without keys), deterministic: each sequence's query blocks have
    counters of their own in the padded rows."""
    run_varlen(precision, precision != "tf32", deterministic=True)


def test_deterministic_backward_kernels():
    """deterministic=True takes the ordered bwd_wide_kernel wherever the wide family runs the backward (no dQ kernel
    after it; float64 on tiles of its own at head dims 64 and 128), and the float32 Hopper backward as it is."""
    from cuflash import _launch

    arch = _launch.device_arch(cp.cuda.Device().id)
    for precision in PRECISIONS:
        for d in config.WIDE_KERNEL_HEAD_DIMS[precision]:
            for causal in (False, True):
                cfg = config.select("backward", d, precision, causal, arch, deterministic=True)
                if isinstance(cfg, config.BwdSm90Tf32Config):
                    assert arch == "sm_90a" and d in (32, 64, 128) and precision != "fp64", cfg
                    continue
                assert isinstance(cfg, config.BwdWideConfig) and cfg.deterministic and config.ordered_dq(cfg), cfg
                assert cfg.cpp_name().endswith(", true>"), cfg.cpp_name()

# --- strides, GQA, windows -------------------------------------------------------------------------------------

STRIDED = [
    ("padded", "padded", "padded", "padded"),
    ("transposed", "transposed", "padded", "contiguous"),
    ("misaligned", "contiguous", "contiguous", "misaligned"),  # copied by the library (4- / 8-byte head offsets)
    ("contiguous", "misaligned", "transposed", "padded"),
]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kinds", STRIDED, ids=["/".join(k) for k in STRIDED])
def test_non_contiguous_inputs(kinds, precision):
    """q, k, v, dout views with their own strides (dout is kinds[3]); layouts alternate."""
    i = STRIDED.index(kinds)
    b = 1 if precision == "fp64" else 2
    run_dense(precision, b, 128, 217, 3, 3, [64, 128, 32, 96][i], causal=i % 2 == 1, layout=LAYOUTS[i % 2],
              kinds=kinds)


GQA = [(4, 2, 113, 203, 64, "bshd", False), (6, 3, 128, 217, 128, "bhsd", True), (4, 1, 203, 113, 32, "bshd", True)]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("hq,hkv,sq,sk,d,layout,causal", GQA,
                         ids=[f"hq{hq}-hkv{hkv}-{sq}x{sk}-d{d}-{lay}-{'causal' if c else 'full'}"
                              for hq, hkv, sq, sk, d, lay, c in GQA])
def test_grouped_query_attention(hq, hkv, sq, sk, d, layout, causal, precision):
    """heads_q = 2 * heads_kv (and MQA): dk, dv sum the query heads of each group."""
    b = 2 if precision != "fp64" or 2 * hq * sq * sk <= MAX_HOST_SCORES else 1
    run_dense(precision, b, sq, sk, hq, hkv, d, causal=causal, layout=layout)


WINDOWS = [((17, 17), False, 203, 113), ((37, 5), True, 113, 203), ((-1, 9), False, 256, 256)]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("window,causal,sq,sk", WINDOWS, ids=[f"w{w[0]}_{w[1]}-{'causal' if c else 'full'}-{sq}x{sk}"
                                                             for w, c, sq, sk in WINDOWS])
def test_sliding_window(window, causal, sq, sk, precision):
    run_dense(precision, 1, sq, sk, 2, 2, 64 if precision != "tf32" else 128, causal=causal, mods={"window": window})


# --- float32: bias, masks, ALiBi, softcap, dropout ---------------------------------------------------------------

def mask_random(b, h, sq, sk, seed):
    return random_mask((b, h, sq, sk), seed)


def mask_dead_rows(b, h, sq, sk, seed):
    return random_mask((b, h, sq, sk), seed, dead_rows=min(sq, 7))


HQ, HKV, SQ, SK = 4, 2, 113, 203
MODIFIERS = {  # name -> run_dense keyword arguments (B 2, H 4 / 2, 113 x 203)
    "bias-full": dict(bias_shape=(2, HQ, SQ, SK)),
    "bias-broadcast": dict(bias_shape=(1, HQ, 1, SK), causal=True),
    "bias-2d": dict(bias_shape=(SQ, SK)),
    "mask": dict(mask=mask_random),
    "key-padding": dict(padding="random", causal=True),
    "bias+mask+padding": dict(bias_shape=(2, 1, SQ, SK), mask=mask_random, padding="random"),
    "alibi-heads": dict(mods={"alibi": "h"}, causal=True),
    "alibi-batch-heads": dict(mods={"alibi": "bh"}),
    "softcap": dict(mods={"softcap": 5.0}, scale_inputs=3.0),  # |scores| >> cap: the cap bites
    "dropout": dict(mods={"dropout": 0.17}),
    "dropout-causal": dict(mods={"dropout": 0.5}, causal=True),
    "everything": dict(mods={"window": (40, 10), "alibi": "h", "softcap": 20.0, "dropout": 0.17},
                       bias_shape=(2, HQ, SQ, SK), mask=mask_random),
}


@pytest.mark.parametrize("precision", FLOATS32)
@pytest.mark.parametrize("name", list(MODIFIERS))
def test_float32_with_modifiers(name, precision):
    """float32 takes every option of the 16-bit path: a float32 bias (with dbias), masks, ALiBi, softcap and dropout
    (the kernel's keep mask, checked bit for bit against cuflash.philox, applied to the references), with GQA."""
    i = list(MODIFIERS).index(name)
    run_dense(precision, 2, SQ, SK, HQ, HKV, HEAD_DIMS[(i + FLOATS32.index(precision)) % len(HEAD_DIMS)],
              layout=LAYOUTS[i % 2], **MODIFIERS[name])


# --- a float32 bias on the Hopper TF32 kernels ---------------------------------------------------------------------

# (precision, b, sq, sk, hq, hkv, d, causal, mods, bias_shape, bias_view): on sm_90a the forward at kernel head dims
# 32, 64 and 128 and the backward at the same (128: cluster pairs) run fwd_sm90_tf32_kernel, bwd_sm90_tf32_kernel and
# bwd_dq_sm90_tf32_kernel with the bias (8-byte key pairs where the rows allow, per score otherwise) and dBias (stores,
# or red.add where broadcast): key and query tails, GQA, causal, windows, every broadcast kind, the folded batch,
# strided views
TF32_BIAS = [
    ("fp32", 2, 203, 113, 4, 2, 64, False, None, (2, 4, 203, 113), None),
    ("tf32", 2, 113, 203, 4, 4, 48, True, None, (1, 4, 113, 203), None),
    ("fp32", 1, 300, 517, 2, 1, 128, False, {"window": (100, 37)}, (1, 1, 300, 517), None),
    ("tf32", 2, 256, 256, 2, 2, 128, True, None, (256, 256), None),
    ("fp32", 2, 203, 203, 4, 4, 64, False, None, (2, 4, 203, 203), "odd-rows"),
    ("tf32", 1, 256, 320, 2, 2, 64, True, None, (1, 2, 256, 320), "transposed"),
    ("fp32", 2, 1024, 1024, 2, 2, 64, False, None, (1, 2, 1, 1024), None),
    ("tf32", 1, 517, 300, 2, 2, 64, False, {"window": (64, 0)}, (1, 2, 517, 300), None),
    ("fp32", 6, 113, 113, 4, 4, 64, False, None, (2, 4, 113, 113), None),  # the Evoformer fold: bias b // 3
    ("fp32", 1, 1024, 1024, 4, 1, 128, True, None, (1, 4, 1024, 1024), None),
    ("fp32", 8, 256, 256, 4, 4, 32, False, None, (2, 4, 256, 256), None),  # Evoformer rows at head dim 32
    ("tf32", 4, 203, 113, 4, 2, 24, True, None, (1, 4, 203, 113), "odd-rows"),
    ("fp32", 2, 300, 517, 2, 2, 32, False, {"window": (64, 64)}, (2, 1, 1, 517), None),
    ("tf32", 3, 203, 203, 4, 4, 128, False, None, (3, 4, 203, 203), "odd-rows"),  # a pair: one CTA writes dBias
    ("fp32", 2, 256, 300, 4, 2, 96, False, None, (1, 4, 1, 300), None),  # key-only bias: red.add
]


@pytest.mark.parametrize("precision,b,sq,sk,hq,hkv,d,causal,mods,bias_shape,bias_view", TF32_BIAS,
                         ids=[f"{c[0]}-b{c[1]}-{c[2]}x{c[3]}-h{c[4]}_{c[5]}-d{c[6]}-{'causal' if c[7] else 'full'}"
                              f"{'-window' if c[8] else ''}-bias{'x'.join(map(str, c[9]))}"
                              f"{'-' + c[10] if c[10] else ''}"
                              for c in TF32_BIAS])
def test_float32_bias_on_the_tf32_kernels(precision, b, sq, sk, hq, hkv, d, causal, mods, bias_shape, bias_view):
    """o, lse, dq, dk, dv and dbias by the rule; on sm_90a these shapes run the TF32 wgmma kernels (checked)."""
    from cuflash import _launch

    arch = _launch.device_arch(cp.cuda.Device().id)
    if arch == "sm_90a" and config.KERNELS != "mma":
        bits = config.MOD_BIAS | (config.MOD_WINDOW if mods else 0)
        hd = config.kernel_head_dim(d, precision)
        assert isinstance(config.select("forward", hd, precision, causal, arch, mods=bits), config.FwdSm90Tf32Config)
        assert isinstance(config.select("backward", hd, precision, causal, arch, mods=bits), config.BwdSm90Tf32Config)
    run_dense(precision, b, sq, sk, hq, hkv, d, causal=causal, layout=LAYOUTS[(sq + d) % 2], mods=mods,
              bias_shape=bias_shape, bias_view=bias_view)


# --- ALiBi and masks on the Hopper TF32 kernels --------------------------------------------------------------------

def mask_2d(b, h, sq, sk, seed):
    """A (sq, sk) mask, broadcast over batch and heads."""
    return random_mask((sq, sk), seed)


def mask_odd_rows(b, h, sq, sk, seed):
    """A (b, 1, sq, sk) view of rows of sk + 1 bytes: the kernels' per-score path (rows not 2-byte aligned)."""
    return random_mask((b, 1, sq, sk + 1), seed)[..., :sk]


# (precision, b, sq, sk, hq, hkv, d, causal, mods, mask, padding, bias_shape): on sm_90a these run fwd_sm90_tf32_kernel,
# bwd_sm90_tf32_kernel and bwd_dq_sm90_tf32_kernel (their cluster pairs at head dim 128) with ALiBi, a mask, a key
# padding mask, alone and beside a bias and a window: key and query tails, GQA, rows that see no key, broadcast masks,
# masks whose rows take the key-pair loads (even row length) and the per-score loads (odd row length, odd-rows view)
TF32_MODS = [
    ("fp32", 2, 203, 113, 4, 2, 64, False, {"alibi": "h"}, None, None, None),
    ("tf32", 2, 113, 203, 4, 4, 32, True, None, mask_random, None, None),
    ("fp32", 1, 300, 517, 2, 1, 128, False, {"window": (100, 37), "alibi": "bh"}, mask_random, None, None),
    ("tf32", 2, 256, 256, 2, 2, 128, True, None, None, "random", None),
    ("fp32", 2, 203, 203, 4, 4, 32, False, None, mask_dead_rows, None, (2, 4, 203, 203)),
    ("tf32", 1, 517, 300, 2, 2, 64, False, {"window": (64, 0), "alibi": "h"}, None, "random", (1, 2, 517, 300)),
    ("fp32", 2, 1024, 1024, 2, 2, 64, True, {"alibi": "h"}, mask_2d, None, None),
    ("tf32", 3, 203, 203, 4, 4, 128, False, {"alibi": "h"}, mask_random, "random", (3, 4, 203, 203)),
    ("fp32", 4, 203, 113, 4, 2, 24, True, None, None, "dead", None),
    ("fp32", 2, 256, 320, 4, 2, 96, False, {"alibi": "bh"}, mask_odd_rows, None, None),
    ("tf32", 2, 300, 256, 4, 2, 64, False, None, mask_odd_rows, None, (1, 4, 300, 256)),
    ("fp32", 2, 256, 256, 4, 4, 128, True, {"alibi": "h"}, mask_2d, "random", (2, 4, 256, 256)),
    ("tf32", 2, 203, 113, 4, 4, 32, False, {"window": (16, 16), "alibi": "bh"}, mask_random, "random",
     (2, 4, 203, 113)),
    ("fp32", 1, 1024, 1024, 4, 1, 32, True, {"alibi": "h"}, None, "random", (1, 4, 1024, 1024)),
]


@pytest.mark.parametrize("precision,b,sq,sk,hq,hkv,d,causal,mods,mask,padding,bias_shape", TF32_MODS,
                         ids=[f"{c[0]}-b{c[1]}-{c[2]}x{c[3]}-h{c[4]}_{c[5]}-d{c[6]}-{'causal' if c[7] else 'full'}"
                              f"{''.join('-' + k for k in (c[8] or {}))}{'-' + c[9].__name__ if c[9] else ''}"
                              f"{'-padding-' + c[10] if c[10] else ''}{'-bias' if c[11] else ''}" for c in TF32_MODS])
def test_float32_alibi_and_masks_on_the_tf32_kernels(precision, b, sq, sk, hq, hkv, d, causal, mods, mask, padding,
                                                      bias_shape):
    """o, lse, dq, dk, dv (and dbias) by the rule; on sm_90a these calls run the TF32 wgmma kernels (checked)."""
    from cuflash import _launch

    arch = _launch.device_arch(cp.cuda.Device().id)
    if arch == "sm_90a" and config.KERNELS != "mma":
        bits = ((config.MOD_WINDOW if "window" in (mods or {}) else 0) | (config.MOD_ALIBI if "alibi" in (mods or {})
                else 0) | (config.MOD_MASK if mask or padding else 0) | (config.MOD_BIAS if bias_shape else 0))
        hd = config.kernel_head_dim(d, precision)
        fwd = config.select("forward", hd, precision, causal, arch, mods=bits, seqlen_k=sk)
        bwd = config.select("backward", hd, precision, causal, arch, mods=bits)
        kernel_bits = bits | config.MOD_ALIBI | config.MOD_MASK  # one kernel takes ALiBi, a mask or both
        assert isinstance(fwd, config.FwdSm90Tf32Config) and fwd.mods == kernel_bits, fwd
        assert isinstance(bwd, config.BwdSm90Tf32Config) and bwd.mods == bwd.dq_config().mods == kernel_bits, bwd
    res = run_dense(precision, b, sq, sk, hq, hkv, d, causal=causal, layout=LAYOUTS[(sq + d) % 2], mods=mods,
                    mask=mask, padding=padding, bias_shape=bias_shape)
    dead = dead_rows(res.lse_ref)
    if mask is mask_dead_rows or padding == "dead":
        assert bool(dead.any()), "the case has no row that sees no key"
    assert bool((res.lse[dead] == -cp.inf).all()), "rows that see no key must have lse = -inf"
    assert all(not bool(cp.isnan(g).any()) for g in res.grads), "NaN in the gradients"


@pytest.mark.parametrize("extra", ["alibi", "mask+key_padding_mask", "alibi+bias+key_padding_mask"])
@pytest.mark.parametrize("precision,d", [("fp32", 64), ("tf32", 32), ("fp32", 128)])
def test_a_planned_float32_alibi_or_mask_call_equals_the_full_path(precision, d, extra):
    """The second call of a float32 signature with ALiBi, masks (their intersection made per call) or both beside a
    bias replays the plans of the first (new inputs, slopes, masks and bias bound per call) on the TF32 kernels: o,
    lse, dq, dk, dv (and dbias) equal those of the same call on the full path, bit for bit."""
    b, s, hq, hkv = 2, 203, 4, 2

    def call(seed):
        q, dout = (make_input(b, s, hq, d, input_dtype(precision), "bshd", "contiguous", seed + i) for i in (0, 3))
        k, v = (make_input(b, s, hkv, d, input_dtype(precision), "bshd", "contiguous", seed + i) for i in (1, 2))
        kw = mods_kwargs({"alibi": "bh"} if "alibi" in extra else {}, b, hq, seed)
        if "bias" in extra:
            kw["bias"] = make_bias((b, hq, s, s), "fp32", "fp32", seed + 4, 2.0)
        if "mask+" in extra:
            kw["mask"] = random_mask((b, 1, s, s), seed + 5)
        if "key_padding_mask" in extra:
            kw["key_padding_mask"] = padding_mask(b, s, seed + 6)
        prec = api_precision(precision)
        poison_pool(round_up(q.nbytes) + round_up(b * hq * s * 8))
        o, lse = cuflash.attention_forward(q, k, v, causal=True, precision=prec, **kw)
        poison_pool(3 * round_up(q.nbytes) + round_up(4 * b * hq * s * s) + (1 << 20))
        return (o, lse, *cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, precision=prec,
                                                    dbias="bias" in kw, **kw))

    check_replay_matches_full_path(call, f"{precision} D={d} {extra}")


@pytest.mark.parametrize("precision", FLOATS32)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float32_varlen_alibi_and_padding_on_the_tf32_kernels(precision, causal):
    """Packed sequences (an empty one, one without keys) with ALiBi, a key padding mask and a bias."""
    run_varlen(precision, causal, mods={"alibi": "h"}, bias=True, padding=True, d=128 if precision == "fp32" else 32)


# --- rows that see no key -----------------------------------------------------------------------------------------

FULLY_MASKED = {  # name -> (precision, run_dense keyword arguments); each has rows that see no key
    "fp32-mask-rows": ("fp32", dict(sq=113, sk=203, mask=mask_dead_rows, bias_shape=(2, HQ, 113, 203))),
    "tf32-dead-batch": ("tf32", dict(sq=113, sk=203, padding="dead", mask=mask_random, bias_shape=(2, HQ, 113, 203))),
    "fp32-causal-sq>sk": ("fp32", dict(sq=300, sk=100, causal=True, mods={"dropout": 0.17})),
    "tf32-window-sq>sk": ("tf32", dict(sq=300, sk=100, mods={"window": (0, 0), "softcap": 10.0})),
    # without other modifiers: on Hopper the TF32 wgmma forward (query blocks whose band holds no key tile)
    "fp32-plain-causal-sq>sk": ("fp32", dict(sq=300, sk=100, causal=True)),
    "tf32-plain-window-sq>sk": ("tf32", dict(sq=300, sk=100, mods={"window": (0, 0)})),
    "fp64-causal-sq>sk": ("fp64", dict(sq=300, sk=100, causal=True)),
    "fp64-window-sq>sk": ("fp64", dict(sq=300, sk=100, mods={"window": (0, 0)})),
}


@pytest.mark.parametrize("name", list(FULLY_MASKED))
def test_rows_that_see_no_key(name):
    """A row that sees no key: o = 0 exactly, lse = -inf, dq = 0 exactly (and dbias 0 on that row), no NaN anywhere."""
    precision, case = FULLY_MASKED[name]
    case = dict(case)
    sq, sk = case.pop("sq"), case.pop("sk")
    res = run_dense(precision, 1 if precision == "fp64" else 2, sq, sk, HQ, HKV, 64, **case)
    dead = dead_rows(res.lse_ref)  # (B, H, Sq)
    assert bool(dead.any()), f"{name}: no row sees no key, the case tests nothing"
    assert bool((res.lse[dead] == -cp.inf).all()), f"{name}: rows that see no key must have lse = -inf"
    assert all(not bool(cp.isnan(g).any()) for g in res.grads), f"{name}: NaN in the gradients"
    if "bias_shape" in case:
        assert max_abs(res.grads[3][dead]) == 0.0, f"{name}: dbias of rows that see no key is not 0"


# --- varlen -------------------------------------------------------------------------------------------------------

LENS_Q, LENS_K = [113, 0, 1, 77, 20], [203, 5, 1, 77, 0]  # an empty query sequence, and 20 queries without keys
VARLEN_D = {"fp32": 64, "tf32": 96, "fp64": 128}


def run_varlen(precision, causal, lens_q=LENS_Q, lens_k=LENS_K, hq=HQ, hkv=HKV, kind="contiguous", mods=None,
               bias=False, padding=False, prealloc=False, deterministic=False, d=None):
    """attention_varlen_forward and attention_varlen_backward of packed sequences, by the rule of `precision`.
    bias: a float32 (num_seqs, H_q, max_q, max_k) bias with dbias; padding: a random key padding mask;
    deterministic: as run_dense's; d: the head dim (VARLEN_D's by default)."""
    dtype, d = input_dtype(precision), VARLEN_D[precision] if d is None else d
    tq, tk, n = sum(lens_q), sum(lens_k), len(lens_q)
    max_q, max_k = max(lens_q), max(lens_k)
    host_scores_ok(1, hq, 1, sum(a * b for a, b in zip(lens_q, lens_k)), precision)
    seed = seed_of("wide-varlen", precision, causal, lens_q, lens_k, hq, hkv, kind, sorted((mods or {}).items()),
                   bias, padding, prealloc)
    what = f"varlen {precision} {lens_q}/{lens_k} H={hq}/{hkv} D={d} causal={causal} {kind} mods={mods} bias={bias} " \
           f"padding={padding}"
    q, dout = (make_packed(tq, hq, d, dtype, kind, seed + i) for i in (0, 3))
    k, v = (make_packed(tk, hkv, d, dtype, kind, seed + i) for i in (1, 2))
    cuq, cuk = cu_seqlens(lens_q), cu_seqlens(lens_k)
    kw = mods_kwargs(mods or {}, n, hq, seed)
    if bias:
        kw["bias"] = make_bias((n, hq, max_q, max_k), "fp32", "fp32", seed + 4, 2.0)
    if padding:
        kw["key_padding_mask"] = padding_mask(n, max_k, seed + 6)
    with_dropout = "dropout_p" in kw

    poison_pool(round_up(q.nbytes) + round_up(tq * hq * 8) + (1 << 20))
    out = cuflash.attention_varlen_forward(q, k, v, cuq, cuk, max_q, max_k, causal=causal,
                                           precision=api_precision(precision), return_dropout_mask=with_dropout, **kw)
    o, lse = out[:2]
    assert o.shape == q.shape and o.dtype == q.dtype, f"o is {o.shape} {o.dtype} for {what}"
    assert lse.shape == (hq, tq), f"lse shape {lse.shape}, expected (H_q, total_q) for {what}"
    options = {name: kw[name] for name in ("window", "alibi_slopes", "softcap", "dropout_p", "bias",
                                           "key_padding_mask") if name in kw}
    if with_dropout:
        want = philox.dropout_mask_varlen(lens_q, lens_k, hq, kw["dropout_p"], kw["seed"], kw["offset"])
        got = [cp.asnumpy(m) for m in out[2]]
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), f"dropout masks differ for {what}"
        options["dropout_mask"] = out[2]
    refs = references(precision, q, k, v, dout, causal, options, True, varlen=(cuq, cuk))
    check_outputs(precision, o, lse, refs, what, lambda x: x.transpose(1, 0, 2))

    given = dict(dq=nan_like(q), dk=nan_like(k), dv=nan_like(v)) if prealloc else {}
    extra = dict(kw, dbias=True) if bias else kw
    poison_pool(round_up(8 * (q.nbytes + 2 * k.nbytes)) + (round_up(4 * kw["bias"].size) if bias else 0) + (1 << 20))
    grads = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cuq, cuk, max_q, max_k, causal=causal,
                                              precision=api_precision(precision), deterministic=deterministic,
                                              **given, **extra)
    for name, g in given.items():
        i = ("dq", "dk", "dv").index(name)
        assert grads[i].data.ptr == g.data.ptr, f"{name} was not written into the given array for {what}"
    if deterministic:
        check_repeats(grads, lambda: cuflash.attention_varlen_backward(
            dout, q, k, v, o, lse, cuq, cuk, max_q, max_k, causal=causal, precision=api_precision(precision),
            deterministic=True, **extra), what)
    check_grads(precision, grads, (q, k, v), refs, what, lambda x: x.transpose(1, 0, 2), bias=kw.get("bias"))
    return o, lse, grads


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_varlen(precision, causal):
    """Packed sequences of lengths 0, 1, odd, GQA 4 / 2: each sequence its own attention (causal per sequence); the
    20 queries of the sequence without keys get o = 0, lse = -inf, dq = 0."""
    run_varlen(precision, causal, kind="padded" if causal else "contiguous")


@pytest.mark.parametrize("precision,d", [("tf32", 64), ("tf32", 32), ("fp32", 32)])
def test_varlen_causal_past_the_short_rule(precision, d):
    """Causal packed sequences whose longest is past config.FWD_SM90_TF32_SHORT_CAUSAL_KEYS keys, at the TF32
    kernels' head dims of three consumer warpgroups: 192-row blocks inside each sequence (one-pass TF32 at 32: the
    dQ kernel's too)."""
    run_varlen(precision, True, lens_q=[1100, 0, 385, 1], lens_k=[1200, 7, 385, 300], d=d)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_varlen_with_window_and_modifiers(precision):
    """A window per sequence; float32 also with a bias (dbias), key padding and dropout (the stream of batch index b
    for sequence b)."""
    if precision == "fp64":
        run_varlen(precision, True, mods={"window": (17, 0)}, kind="transposed")
    else:
        run_varlen(precision, False, mods={"window": (40, 40), "dropout": 0.17}, bias=True, padding=True)
        run_varlen(precision, True, bias=True)  # fp32 at head dim 64: the TF32 kernels with the bias on sm_90a


# --- preallocated gradients, the default precision, repeatability, empty problems ----------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
def test_preallocated_gradients_are_filled_in_place(precision):
    """NaN-filled dq, dk, dv (GQA: dk, dv with H_kv heads) given to the backward: returned, fully written, by the rule;
    dense (bhsd) and varlen."""
    run_dense(precision, 1, 113, 203, 4, 2, 64, causal=True, layout="bhsd", prealloc=True)
    run_varlen(precision, False, prealloc=True)


def test_float32_default_precision_is_fp32():
    """precision=None with float32 inputs is "fp32": bitwise the same o, lse and gradients."""
    q, k, v, dout = (make_input(2, s, 2, 64, "fp32", "bshd", "contiguous", seed_of("wide-default", i))
                     for i, s in enumerate((203, 113, 113, 203)))
    o, lse = cuflash.attention_forward(q, k, v, causal=True)
    o_fp32, lse_fp32 = cuflash.attention_forward(q, k, v, causal=True, precision="fp32")
    assert same_bits(o, o_fp32) and same_bits(lse, lse_fp32), "precision=None differs from 'fp32' in the forward"
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True)
    grads_fp32 = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, precision="fp32")
    assert all(same_bits(a, b) for a, b in zip(grads[1:], grads_fp32[1:])), "dk, dv differ between None and 'fp32'"
    # dq sums key blocks with float32 atomics (order varies): within the rule instead of bitwise
    refs = references("fp32", q, k, v, dout, True, {}, True)
    for g in (grads[0], grads_fp32[0]):
        check_rule_wide("dq", g, refs.grads[0], refs.grads_plain[0], 3, "precision None / 'fp32'", FLOORS["fp32"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_attention_returns_the_forward_output_and_repeats_bitwise(precision):
    """attention() gives attention_forward's o bit for bit, and three forwards give the same o and lse bits."""
    dtype = input_dtype(precision)
    q, k, v = (make_input(1, s, 2, 64, dtype, "bshd", "contiguous", seed_of("wide-repeat", precision, i))
               for i, s in enumerate((300, 517, 517)))
    o, lse = cuflash.attention_forward(q, k, v, causal=True, precision=api_precision(precision))
    assert same_bits(cuflash.attention(q, k, v, causal=True, precision=api_precision(precision)), o)
    for _ in range(2):
        o2, lse2 = cuflash.attention_forward(q, k, v, causal=True, precision=api_precision(precision))
        assert same_bits(o2, o) and same_bits(lse2, lse), f"{precision}: the forward differs between runs"


ZERO_SIZE = [(0, 16, 16, 2), (2, 0, 16, 2), (2, 16, 0, 2)]  # (batch, seqlen_q, seqlen_k, heads)


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
@pytest.mark.parametrize("b,sq,sk,h", ZERO_SIZE, ids=[f"b{b}-sq{sq}-sk{sk}-h{h}" for b, sq, sk, h in ZERO_SIZE])
def test_empty_problems(b, sq, sk, h, precision):
    """Empty arrays of the inputs' shapes and dtypes (lse float32 / float64); no keys: o = 0, lse = -inf, dq = 0; no
    queries: dk = dv = 0."""
    dtype = input_dtype(precision)
    q, k, v, dout = (make_input(b, s, h, 64, dtype, "bshd", "contiguous", seed_of("wide-empty", i))
                     for i, s in enumerate((sq, sk, sk, sq)))
    o, lse = cuflash.attention_forward(q, k, v, precision=api_precision(precision))
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (b, h, sq) and lse.dtype == lse_dtype(precision)
    assert max_abs(o) == 0.0 and bool((lse == -cp.inf).all()), "no keys: o must be 0 and lse -inf"
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, precision=api_precision(precision))
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} is {g.shape} {g.dtype}"
        assert max_abs(g) == 0.0, f"{name} must be zero"
