"""Backward kernels on the GPU against float64 gradients (pass rule: docs/RELIABILITY.md):
max|dX - dX_ref64| <= 3 * max|dX_lowp - dX_ref64| + 1e-5 for X in q, k, v, with dX_lowp from plain
attention in the input dtype; deterministic mode bitwise reproducible; an overflow-prone case stays finite."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _xpref, config  # noqa: E402
from gpu_helpers import (DTYPES, HEAD_DIMS, LAYOUTS, SEQLEN_PAIRS, batch_heads, check_rule, make_input,  # noqa: E402
                         max_abs, poison_pool, round_up, seed_of, to_bshd32, warm_kernel_cache)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hasattr(cuflash, "attention_backward"), reason="cuflash has no attention_backward yet"),
]


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    warm_kernel_cache(config.all_fwd_configs() + list(getattr(config, "all_bwd_configs", list)()))


def make_problem(b, sq, sk, h, d, dtype, layout, kinds=("contiguous",) * 4, scales=(1.0, 1.0, 1.0), seed_key=()):
    """Fresh q, k, v, dout (kinds[3] is dout's stride kind) and the forward's o, lse."""
    seed = seed_of("bwd", b, sq, sk, h, d, dtype, layout, kinds, scales, *seed_key)
    q = make_input(b, sq, h, d, dtype, layout, kinds[0], seed, scales[0])
    k = make_input(b, sk, h, d, dtype, layout, kinds[1], seed + 1, scales[1])
    v = make_input(b, sk, h, d, dtype, layout, kinds[2], seed + 2, scales[2])
    dout = make_input(b, sq, h, d, dtype, layout, kinds[3], seed + 3)
    return q, k, v, dout


def references(q, k, v, dout, dtype, causal, layout):
    """(float64 gradients, low-precision gradients), each (dq, dk, dv) in (B, S, H, D) order."""
    q32, k32, v32, do32 = (to_bshd32(x, layout) for x in (q, k, v, dout))
    return (_xpref.attention_backward64(do32, q32, k32, v32, causal),
            _xpref.attention_backward_lowp(do32, q32, k32, v32, dtype, causal))


def run_backward(q, k, v, dout, causal, layout, **kw):
    """Forward, then backward on a poisoned pool (best effort, see gpu_helpers.poison_pool)."""
    o, lse = cuflash.attention_forward(q, k, v, causal=causal, layout=layout)
    # room for dq, dk, dv, the fp32 dQ accumulator and other workspaces, with a margin
    poison_pool(round_up(4 * (q.nbytes + 2 * k.nbytes)) + (1 << 20))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, layout=layout, **kw)
    return o, lse, grads


def check_grads(grads, q, k, v, refs64, refs_lowp, layout, what, factor=3.0, extra=1e-5):
    for name, g, x, g64, glowp in zip(("dq", "dk", "dv"), grads, (q, k, v), refs64, refs_lowp):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} is {g.shape} {g.dtype} for {what}"
        check_rule(name, to_bshd32(g, layout), g64, glowp, factor, what, extra)


def check_backward(b, sq, sk, h, d, dtype, causal, layout, kinds=("contiguous",) * 4, **kw):
    what = f"B={b} Sq={sq} Sk={sk} H={h} D={d} {dtype} causal={causal} {layout} strides={'/'.join(kinds)}"
    q, k, v, dout = make_problem(b, sq, sk, h, d, dtype, layout, kinds)
    _, _, grads = run_backward(q, k, v, dout, causal, layout, **kw)
    refs64, refs_lowp = references(q, k, v, dout, dtype, causal, layout)
    check_grads(grads, q, k, v, refs64, refs_lowp, layout, what)
    return grads


# --- the grid: seqlen pairs x head dims x dtypes x causal (layouts alternate over the grid) ---------------

GRID = [(sq, sk, d, LAYOUTS[(i + j) % 2]) for i, (sq, sk) in enumerate(SEQLEN_PAIRS) for j, d in enumerate(HEAD_DIMS)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,d,layout", GRID, ids=[f"{sq}x{sk}-d{d}-{lay}" for sq, sk, d, lay in GRID])
def test_backward_matches_reference(sq, sk, d, layout, dtype, causal):
    b, h = batch_heads(sq, sk)
    check_backward(b, sq, sk, h, d, dtype, causal, layout)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 72, 200])
@pytest.mark.parametrize("sq,sk", [(113, 203), (3, 799)])
def test_backward_padded_head_dims(sq, sk, d, dtype, causal):
    b, h = batch_heads(sq, sk)
    check_backward(b, sq, sk, h, d, dtype, causal, "bshd" if d != 72 else "bhsd")


STRIDED = [
    ("contiguous", "contiguous", "contiguous", "padded"),      # only dout non-contiguous
    ("contiguous", "contiguous", "contiguous", "transposed"),
    ("padded", "transposed", "padded", "padded"),              # every tensor with its own strides
    ("misaligned", "contiguous", "contiguous", "misaligned"),  # copied by the library
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kinds", STRIDED, ids=["/".join(k) for k in STRIDED])
def test_backward_non_contiguous_dout_and_inputs(kinds, layout, dtype):
    check_backward(2, 128, 217, 3, 64, dtype, True, layout, kinds=kinds)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_mode_is_bitwise_reproducible(dtype, causal, d):
    """20 runs, bitwise equal dq, dk, dv (many key blocks add into each dQ row), and within the rule."""
    q, k, v, dout = make_problem(1, 1023, 1024, 2, d, dtype, "bshd", seed_key=("det",))
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    first = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=True)
    first_bits = [g.view(cp.uint16).copy() for g in first]
    for run in range(19):
        grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=True)
        for name, g, ref in zip(("dq", "dk", "dv"), grads, first_bits):
            assert bool(cp.array_equal(g.view(cp.uint16), ref)), f"{name} of run {run + 2} differs from run 1"
    refs64, refs_lowp = references(q, k, v, dout, dtype, causal, "bshd")
    check_grads(first, q, k, v, refs64, refs_lowp, "bshd", f"deterministic {dtype} D={d} causal={causal}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_default_mode_is_within_the_rule_on_every_run(dtype, causal):
    q, k, v, dout = make_problem(1, 1023, 1024, 2, 64, dtype, "bhsd", seed_key=("repeat",))
    o, lse = cuflash.attention_forward(q, k, v, causal=causal, layout="bhsd")
    refs64, refs_lowp = references(q, k, v, dout, dtype, causal, "bhsd")
    for run in range(10):
        grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, layout="bhsd")
        check_grads(grads, q, k, v, refs64, refs_lowp, "bhsd", f"run {run + 1}, {dtype} causal={causal}")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_stay_finite(dtype, causal, d):
    """q * 5, k * 3, v * 3: peaked softmax, large dP; finite and within 5x the low-precision error + 1e-3."""
    q, k, v, dout = make_problem(2, 255, 513, 2, d, dtype, "bshd", scales=(5.0, 3.0, 3.0))
    o, lse, grads = run_backward(q, k, v, dout, causal, "bshd")
    assert bool(cp.isfinite(lse).all())
    refs64, refs_lowp = references(q, k, v, dout, dtype, causal, "bshd")
    check_grads(grads, q, k, v, refs64, refs_lowp, "bshd", f"q*5 k*3 v*3 {dtype} D={d} causal={causal}",
                factor=5.0, extra=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_preallocated_outputs_are_filled_in_place(layout, dtype):
    q, k, v, dout = make_problem(2, 200, 300, 2, 128, dtype, layout)
    o, lse = cuflash.attention_forward(q, k, v, causal=True, layout=layout)
    nan = lambda x: _xpref.to_lowp(cp.full(x.shape, cp.nan, dtype=cp.float32), dtype)  # noqa: E731
    outs = (nan(q), nan(k), nan(v))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, layout=layout,
                                       dq=outs[0], dk=outs[1], dv=outs[2])
    for name, g, buf in zip(("dq", "dk", "dv"), grads, outs):
        assert g.data.ptr == buf.data.ptr and g.shape == buf.shape, f"{name} was not written into the given array"
    refs64, refs_lowp = references(q, k, v, dout, dtype, True, layout)
    check_grads(outs, q, k, v, refs64, refs_lowp, layout, f"preallocated {dtype} {layout}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_see_no_key_get_no_gradient(dtype):
    """causal, Sq > Sk: the first Sq - Sk queries see no key: dq = 0 there, and they add nothing to dk, dv."""
    q, k, v, dout = make_problem(2, 300, 100, 2, 64, dtype, "bshd")
    _, lse, grads = run_backward(q, k, v, dout, True, "bshd")
    assert bool((lse[:, :, :200] == -cp.inf).all())
    assert max_abs(_xpref.to_float32(grads[0][:, :200])) == 0.0
    refs64, refs_lowp = references(q, k, v, dout, dtype, True, "bshd")
    check_grads(grads, q, k, v, refs64, refs_lowp, "bshd", f"Sq > Sk causal {dtype}")


ZERO_SIZE = [(0, 16, 16, 2), (2, 0, 16, 2), (2, 16, 0, 2), (2, 16, 16, 0)]  # (batch, seqlen_q, seqlen_k, heads)


@pytest.mark.parametrize("b,sq,sk,h", ZERO_SIZE, ids=[f"b{b}-sq{sq}-sk{sk}-h{h}" for b, sq, sk, h in ZERO_SIZE])
def test_zero_size_gives_empty_or_zero_gradients(b, sq, sk, h):
    """No queries: dk = dv = 0. No keys: dq = 0. Otherwise empty arrays of the inputs' shapes."""
    q, k, v, dout = make_problem(b, sq, sk, h, 64, "bf16", "bshd")
    o, lse = cuflash.attention_forward(q, k, v)
    grads = cuflash.attention_backward(dout, q, k, v, o, lse)
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} is {g.shape} {g.dtype}"
        assert max_abs(_xpref.to_float32(g)) == 0.0, f"{name} must be zero"
