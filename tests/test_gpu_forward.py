"""Forward kernel on the GPU against float64 attention (pass rule: docs/RELIABILITY.md):
max|o - o_ref64| <= 2 * max|o_lowp - o_ref64| + 1e-5, with o_lowp plain attention in the input dtype,
and lse against the float64 lse; over seqlen pairs, head dims, dtypes, causal, layouts and strides."""
from __future__ import annotations

import math

import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _xpref  # noqa: E402
from cuflash.config import all_fwd_configs  # noqa: E402
from gpu_helpers import (DTYPES, HEAD_DIMS, LAYOUTS, SEQLEN_PAIRS, batch_heads, check_lse, check_rule,  # noqa: E402
                         make_input, max_abs, poison_pool, randn, round_up, seed_of, to_bshd32, warm_kernel_cache)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def compiled_forward_kernels():
    warm_kernel_cache(all_fwd_configs())


def check_forward(b, sq, sk, h, d, dtype, causal, layout, kinds=("contiguous",) * 3, softmax_scale=None,
                  seed_key=()):
    """Run attention_forward on fresh inputs (poisoned pool), compare o and lse with the references."""
    what = (f"B={b} Sq={sq} Sk={sk} H={h} D={d} {dtype} causal={causal} {layout} strides={'/'.join(kinds)}"
            + (f" scale={softmax_scale}" if softmax_scale is not None else ""))
    seed = seed_of("fwd", b, sq, sk, h, d, dtype, causal, layout, kinds, softmax_scale, *seed_key)
    q = make_input(b, sq, h, d, dtype, layout, kinds[0], seed)
    k = make_input(b, sk, h, d, dtype, layout, kinds[1], seed + 1)
    v = make_input(b, sk, h, d, dtype, layout, kinds[2], seed + 2)

    poison_pool(round_up(b * sq * h * d * 2) + round_up(b * h * sq * 4))
    o, lse = cuflash.attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout)

    assert o.shape == q.shape and o.dtype == q.dtype, f"o is {o.shape} {o.dtype} for {what}"
    assert lse.shape == (b, h, sq), f"lse shape {lse.shape} for {what}"
    q32, k32, v32 = (to_bshd32(x, layout) for x in (q, k, v))
    o64, lse64 = _xpref.attention_forward64(q32, k32, v32, causal, softmax_scale)
    o_lowp = _xpref.attention_lowp(q32, k32, v32, dtype, causal, softmax_scale)
    o32 = to_bshd32(o, layout)
    check_rule("o", o32, o64, o_lowp, 2, what)
    check_lse(lse, lse64, what)
    masked = ~cp.isfinite(lse64).transpose(0, 2, 1)  # (B, Sq, H): rows that see no key
    assert max_abs(cp.where(masked[..., None], o32, 0.0)) == 0.0, f"rows that see no key must be 0 for {what}"
    return o, lse


# --- the grid: seqlen pairs x head dims x dtypes x causal (layouts alternate over the grid) ---------------

GRID = [(sq, sk, d, LAYOUTS[(i + j) % 2]) for i, (sq, sk) in enumerate(SEQLEN_PAIRS) for j, d in enumerate(HEAD_DIMS)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,d,layout", GRID, ids=[f"{sq}x{sk}-d{d}-{lay}" for sq, sk, d, lay in GRID])
def test_forward_matches_reference(sq, sk, d, layout, dtype, causal):
    b, h = batch_heads(sq, sk)
    check_forward(b, sq, sk, h, d, dtype, causal, layout)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 72, 200])
@pytest.mark.parametrize("sq,sk", [(113, 203), (3, 799), (1024, 1023)])
def test_forward_padded_head_dims(sq, sk, d, dtype, causal):
    """head dims without their own kernel run on the next larger one (zero columns in shared memory)."""
    b, h = batch_heads(sq, sk)
    check_forward(b, sq, sk, h, d, dtype, causal, "bshd" if d != 72 else "bhsd")


STRIDED = [
    (("padded",) * 3, 128),
    (("transposed",) * 3, 64),
    (("misaligned",) * 3, 96),
    (("padded", "transposed", "contiguous"), 32),  # every tensor with its own strides
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kinds,d", STRIDED, ids=["/".join(k) + f"-d{d}" for k, d in STRIDED])
def test_forward_non_contiguous_inputs(kinds, d, layout, dtype, causal):
    check_forward(2, 128, 217, 3, d, dtype, causal, layout, kinds=kinds)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_c_contiguous_views_at_an_odd_address_are_copied(causal, d):
    """Found by the sweep (2026-11-22, config 232: Sk = 1, batch 1, one head): a view 4 elements into its
    buffer whose outer dims are all 1 is C-contiguous, so cupy.ascontiguousarray returned it unchanged and
    the kernel's 16-byte loads faulted on the misaligned address. The library must copy it."""
    what = f"k, v of shape (1, 1, 1, {d}) at an 8-byte offset, causal={causal}"
    q = make_input(1, 98, 1, d, "fp16", "bshd", "contiguous", seed_of("odd-address", d, causal))
    k, v = (randn((d + 4,), "fp16", seed_of("odd-address", d, causal, i))[4:].reshape(1, 1, 1, d) for i in (1, 2))
    assert k.flags.c_contiguous and k.data.ptr % 16 == 8, "the test needs a C-contiguous view at an odd address"
    poison_pool(round_up(98 * d * 2) + round_up(98 * 4))
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    q32, k32, v32 = (to_bshd32(x, "bshd") for x in (q, k, v))
    o64, lse64 = _xpref.attention_forward64(q32, k32, v32, causal)
    check_rule("o", to_bshd32(o, "bshd"), o64, _xpref.attention_lowp(q32, k32, v32, "fp16", causal), 2, what)
    check_lse(lse, lse64, what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.3, 1.5])
def test_forward_softmax_scale(scale, dtype):
    check_forward(2, 108, 256, 2, 64, dtype, True, "bshd", softmax_scale=scale)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_rows_that_see_no_key_give_zero_and_minus_inf(dtype, layout):
    """Sq > Sk, causal, bottom-right: query i sees keys j <= i - (Sq - Sk), so the first 200 rows see none."""
    o, lse = check_forward(2, 300, 100, 2, 64, dtype, True, layout)
    rows = o[:, :200] if layout == "bshd" else o[:, :, :200]
    assert max_abs(_xpref.to_float32(rows)) == 0.0
    assert bool((lse[:, :, :200] == -cp.inf).all()) and bool(cp.isfinite(lse[:, :, 200:]).all())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_repeat_runs_are_bitwise_identical(dtype, causal):
    q, k, v = (make_input(1, s, 2, 128, dtype, "bshd", "contiguous", seed_of("repeat", dtype, causal, i))
               for i, s in enumerate((1023, 1024, 1024)))
    o0, lse0 = cuflash.attention_forward(q, k, v, causal=causal)
    for _ in range(3):
        o, lse = cuflash.attention_forward(q, k, v, causal=causal)
        assert bool(cp.array_equal(o.view(cp.uint16), o0.view(cp.uint16))), "o differs between runs"
        assert bool(cp.array_equal(lse, lse0)), "lse differs between runs"


ZERO_SIZE = [  # (batch, seqlen_q, seqlen_k, heads)
    (0, 16, 16, 2),
    (2, 0, 16, 2),
    (2, 16, 16, 0),
    (0, 0, 0, 2),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("b,sq,sk,h", ZERO_SIZE, ids=[f"b{b}-sq{sq}-sk{sk}-h{h}" for b, sq, sk, h in ZERO_SIZE])
def test_zero_size_inputs_give_empty_results(b, sq, sk, h, layout):
    q, k, v = (make_input(b, s, h, 64, "fp16", layout, "contiguous", 1) for s in (sq, sk, sk))
    o, lse = cuflash.attention_forward(q, k, v, layout=layout)
    assert o.shape == q.shape and o.dtype == q.dtype and o.size == 0
    assert lse.shape == (b, h, sq) and lse.dtype == cp.float32


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_keys_gives_zero_output_and_minus_inf_lse(layout, causal):
    q = make_input(2, 16, 3, 64, "bf16", layout, "contiguous", 2)
    k = make_input(2, 0, 3, 64, "bf16", layout, "contiguous", 3)
    poison_pool(round_up(q.nbytes) + round_up(2 * 3 * 16 * 4))
    o, lse = cuflash.attention_forward(q, k, k, causal=causal, layout=layout)
    assert o.shape == q.shape and max_abs(_xpref.to_float32(o)) == 0.0
    assert lse.shape == (2, 3, 16) and bool((lse == -cp.inf).all())


def test_poisoning_reaches_the_outputs():
    """The pool poisoning of these tests works: o and lse are carved from the poisoned block (if CuPy's pool
    stops doing that, the other tests still check values but no longer catch unwritten elements)."""
    q, k, v = (make_input(2, 256, 2, 64, "fp16", "bshd", "contiguous", 4) for _ in range(3))
    cuflash.attention_forward(q, k, v)  # once first: a fresh worker's one-time work stays out of the poisoned block
    size = round_up(q.nbytes) + round_up(2 * 2 * 256 * 4)
    ptr = poison_pool(size)
    o, lse = cuflash.attention_forward(q, k, v)
    inside = [ptr <= x.data.ptr < ptr + size for x in (o, lse)]
    if not all(inside):
        pytest.skip(f"CuPy's pool did not hand the poisoned block back to every output ((o, lse) inside: {inside}): "
                    f"outputs are not reliably poisoned in this suite")
    assert not bool(cp.isnan(_xpref.to_float32(o)).any()) and not bool(cp.isnan(lse).any())


def test_attention_returns_the_forward_output():
    q, k, v = (make_input(2, 200, 2, 64, "bf16", "bshd", "contiguous", 5 + i) for i in range(3))
    o = cuflash.attention(q, k, v, causal=True)
    o2, _ = cuflash.attention_forward(q, k, v, causal=True)
    assert bool(cp.array_equal(o.view(cp.uint16), o2.view(cp.uint16)))


@pytest.mark.parametrize("causal", [False, True])
def test_planned_attention_equals_attention_forward(causal):
    """A warm attention() call replays the forward's plan without lse (the kernels skip the lse writes):
    its output equals attention_forward's bitwise, also for causal rows that see no key (seqlen_q > seqlen_k)."""
    q = make_input(2, 300, 2, 64, "fp16", "bshd", "contiguous", 31)
    k, v = (make_input(2, 130, 2, 64, "fp16", "bshd", "contiguous", 32 + i) for i in range(2))
    o_fwd, lse = cuflash.attention_forward(q, k, v, causal=causal)  # makes the plan
    for _ in range(2):  # both calls replay it, into a poisoned output
        poison_pool(round_up(q.nbytes))
        o = cuflash.attention(q, k, v, causal=causal)
        assert bool(cp.array_equal(o.view(cp.uint16), o_fwd.view(cp.uint16)))
    assert bool(cp.isfinite(lse[:, :, -1]).all())


def test_runs_on_the_current_stream():
    q, k, v = (make_input(2, 512, 2, 128, "fp16", "bshd", "contiguous", 9 + i) for i in range(3))
    ref = cuflash.attention(q, k, v)
    cp.cuda.Device().synchronize()  # the inputs were made on the legacy default stream
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        o = cuflash.attention(q, k, v)
    stream.synchronize()
    assert bool(cp.array_equal(o.view(cp.uint16), ref.view(cp.uint16)))


def test_default_scale_is_one_over_sqrt_head_dim():
    q, k, v = (make_input(1, 64, 2, 128, "fp16", "bshd", "contiguous", 20 + i) for i in range(3))
    o_default = cuflash.attention(q, k, v)
    o_explicit = cuflash.attention(q, k, v, softmax_scale=1 / math.sqrt(128))
    assert bool(cp.array_equal(o_default.view(cp.uint16), o_explicit.view(cp.uint16)))
