"""Score modifiers on the GPU: sliding window, ALiBi, soft-capping, dropout, forward and backward,
alone and combined with each other, causal, GQA and varlen, against the float64 NumPy reference
(cuflash.reference, written from the definitions) with the pass rule of docs/RELIABILITY.md: max|out - ref64|
<= 2 * max|out_lowp - ref64| + 1e-5 for o, factor 3 for dq, dk, dv; lse within 1e-3 (-inf exactly where a row
sees no key). Outputs are poisoned before each call.

Dropout: the kernel's keep mask (return_dropout_mask) must equal cuflash.philox.dropout_mask bit for bit (the
specified Philox stream), and the reference is applied with that mask; kept fractions are checked on a large
shape; the same seed gives bitwise equal outputs and gradients."""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import config, philox  # noqa: E402
from cuflash import reference as ref  # noqa: E402
from gpu_helpers import (check_lse, check_replay_matches_full_path, check_rule, cu_seqlens, make_input,  # noqa: E402
                         make_packed, poison_pool, round_up, same_bits, seed_of, to_bshd32, warm_kernel_cache)

pytestmark = pytest.mark.gpu

SEED = 20261122


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    warm_kernel_cache([c for c in config.all_fwd_configs() + config.all_bwd_configs() if getattr(c, "mods", 0)])


def slopes_for(shape, seed):
    """Random ALiBi slopes in [0, 0.3), float32 on the GPU."""
    return cp.asarray(np.random.default_rng(seed).random(shape) * 0.3, dtype=cp.float32)


def mods_kwargs(mods: dict, b: int, hq: int, seed: int) -> dict:
    """cuflash keyword arguments of a modifier set: window (l, r), alibi ("h" or "bh"), softcap c, dropout p."""
    kw = {}
    if "window" in mods:
        kw["window"] = mods["window"]
    if "alibi" in mods:
        kw["alibi_slopes"] = slopes_for((hq,) if mods["alibi"] == "h" else (b, hq), seed + 7)
    if "softcap" in mods:
        kw["softcap"] = mods["softcap"]
    if "dropout" in mods:
        kw.update(dropout_p=mods["dropout"], seed=SEED + seed % 1000, offset=seed % 7)
    return kw


def ref_kwargs(kw: dict, mask) -> dict:
    """The reference's keyword arguments for the same modifiers (NumPy slopes; the kernel's keep mask)."""
    out = {}
    if "window" in kw:
        out["window"] = kw["window"]
    if "alibi_slopes" in kw:
        out["alibi_slopes"] = cp.asnumpy(kw["alibi_slopes"])
    if "softcap" in kw:
        out["softcap"] = kw["softcap"]
    if "dropout_p" in kw:
        out.update(dropout_mask=mask, dropout_p=kw["dropout_p"])
    return out


def check_mask(mask, kw, b, hq, sq, sk, what):
    """The kernel's keep mask is the specified Philox stream (cuflash.philox), bit for bit."""
    want = philox.dropout_mask(b, hq, sq, sk, kw["dropout_p"], kw["seed"], kw["offset"])
    got = cp.asnumpy(mask)
    assert got.dtype == np.bool_ and got.shape == want.shape, f"mask {got.dtype} {got.shape} for {what}"
    assert np.array_equal(got, want), f"dropout mask differs from cuflash.philox in {int((got != want).sum())} " \
                                      f"elements for {what}"


def run_dense(b, sq, sk, hq, hkv, d, dtype, causal, mods, layout="bshd", backward=True, deterministic=False,
              scale_inputs=1.0):
    seed = seed_of("mods", b, sq, sk, hq, hkv, d, dtype, causal, sorted(mods.items()), layout, deterministic)
    what = f"B={b} Sq={sq} Sk={sk} H={hq}/{hkv} D={d} {dtype} causal={causal} mods={mods} {layout}"
    q = make_input(b, sq, hq, d, dtype, layout, "contiguous", seed, scale_inputs)
    k = make_input(b, sk, hkv, d, dtype, layout, "padded", seed + 1, scale_inputs)
    v = make_input(b, sk, hkv, d, dtype, layout, "contiguous", seed + 2)
    dout = make_input(b, sq, hq, d, dtype, layout, "contiguous", seed + 3)
    kw = mods_kwargs(mods, b, hq, seed)
    poison_pool(round_up(q.nbytes) + round_up(b * hq * sq * 4))
    out = cuflash.attention_forward(q, k, v, causal=causal, layout=layout, return_dropout_mask="dropout_p" in kw, **kw)
    o, lse = out[:2]
    mask = None
    if "dropout_p" in kw:
        check_mask(out[2], kw, b, hq, sq, sk, what)
        mask = cp.asnumpy(out[2])
    q32, k32, v32, do32 = (cp.asnumpy(to_bshd32(x, layout)) for x in (q, k, v, dout))
    rk = ref_kwargs(kw, mask)
    o64, lse64 = ref.attention_forward64(q32, k32, v32, causal, **rk)
    o_lowp = ref.attention_lowp(q32, k32, v32, dtype, causal, **rk)
    check_rule("o", to_bshd32(o, layout), cp.asarray(o64), cp.asarray(o_lowp), 2, what)
    check_lse(lse, cp.asarray(lse64), what)
    if not backward:
        return o, lse
    poison_pool(3 * round_up(q.nbytes) + (1 << 20))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, layout=layout,
                                       deterministic=deterministic, **kw)
    g64 = ref.attention_backward64(do32, q32, k32, v32, causal, **rk)
    glowp = ref.attention_backward_lowp(do32, q32, k32, v32, dtype, causal, **rk)
    for name, g, r64, low in zip(("dq", "dk", "dv"), grads, g64, glowp):
        check_rule(name, to_bshd32(g, layout), cp.asarray(r64), cp.asarray(low), 3, what)
    return o, lse, grads


WINDOWS = [(0, 0), (1, 1), (17, 17), (256, 0), (-1, 17), (17, -1), (5, 40)]
PAIRS = [(113, 203), (203, 113), (256, 256), (1, 239)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sq,sk", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_window(window, sq, sk, causal):
    run_dense(1, sq, sk, 2, 2, 64, "bf16", causal, {"window": window})


@pytest.mark.parametrize("d", [32, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_window_head_dims(d, dtype):
    run_dense(1, 203, 317, 2, 1, d, dtype, False, {"window": (33, 9)})


@pytest.mark.parametrize("shape", ["h", "bh"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_alibi(shape, causal, d):
    run_dense(2, 113, 203, 4, 2, d, "fp16", causal, {"alibi": shape})


@pytest.mark.parametrize("softcap,scale_inputs", [(50.0, 1.0), (2.0, 3.0)])  # the second one bites: |s| >> cap
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap(softcap, scale_inputs, causal, d):
    run_dense(1, 203, 113, 2, 2, d, "bf16", causal, {"softcap": softcap}, scale_inputs=scale_inputs)


@pytest.mark.parametrize("p", [0.17, 0.5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(64, "fp16"), (128, "bf16"), (32, "bf16"), (256, "fp16")])
def test_dropout(p, causal, d, dtype):
    run_dense(2, 113, 203, 2, 1, d, dtype, causal, {"dropout": p})


COMBOS = [
    {"window": (37, 5), "alibi": "bh"},
    {"window": (64, 0), "softcap": 30.0, "dropout": 0.17},
    {"alibi": "h", "softcap": 20.0},
    {"alibi": "h", "dropout": 0.5},
    {"window": (20, 20), "alibi": "h", "softcap": 10.0, "dropout": 0.17},
]


@pytest.mark.parametrize("mods", COMBOS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(64, "bf16"), (128, "fp16"), (96, "bf16"), (192, "fp16")])
def test_combinations(mods, causal, d, dtype):
    run_dense(2, 203, 256, 4, 2, d, dtype, causal, mods, layout="bhsd" if d == 96 else "bshd")


@pytest.mark.parametrize("mods", [COMBOS[1], COMBOS[4], {"window": (3, 3)}])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_backward(mods, d):
    """The deterministic dQ kernel applies the same modifiers; two runs are bitwise equal."""
    a = run_dense(1, 203, 317, 2, 2, d, "bf16", True, mods, deterministic=True)
    b = run_dense(1, 203, 317, 2, 2, d, "bf16", True, mods, deterministic=True)
    for x, y in zip(a[2], b[2]):
        assert same_bits(x, y), f"deterministic backward with {mods} is not bitwise reproducible"


@pytest.mark.parametrize("d,dtype,mods", [(256, "bf16", COMBOS[4]), (256, "fp16", COMBOS[2]), (192, "fp16", COMBOS[3]),
                                          (200, "bf16", COMBOS[1])])
@pytest.mark.parametrize("causal", [False, True])
def test_wide_heads_many_query_blocks(d, dtype, mods, causal):
    """Head dims 192 and 256 (200: zero-padded in the 256 kernels) with modifiers on a long query walk: 650 queries
    = 11 query blocks per query head, 4 query heads per K/V head (GQA: every block's dropout stream and ALiBi slope
    its own head's), 530 keys = a key tail; the bhsd layout."""
    run_dense(1, 650, 530, 4, 1, d, dtype, causal, mods, layout="bhsd")


def test_window_rows_without_keys():
    """Sq > Sk with a window (0, 0): the first Sq - Sk rows see no key: o = 0, lse = -inf, no gradient."""
    o, lse, grads = run_dense(1, 300, 100, 2, 2, 64, "fp16", False, {"window": (0, 0)})
    assert bool((o[:, :200] == 0).all()) and bool((lse[:, :, :200] == -cp.inf).all())
    assert bool((grads[0][:, :200] == 0).all())


def test_dropout_kept_fraction_and_seed():
    """Kept fraction within 0.01 of 1 - p on a large shape; the same seed gives bitwise equal results, another
    seed a different mask."""
    b, h, s, d = 1, 4, 1024, 64
    q, k, v = (make_input(b, s, h, d, "bf16", "bshd", "contiguous", 99 + i) for i in range(3))
    for p in (0.17, 0.5):
        o1, _, m1 = cuflash.attention_forward(q, k, v, dropout_p=p, seed=5, return_dropout_mask=True)
        o2, _, m2 = cuflash.attention_forward(q, k, v, dropout_p=p, seed=5, return_dropout_mask=True)
        kept = float(m1.mean())
        assert abs(kept - (1 - p)) <= 0.01, f"kept fraction {kept:.4f} for p={p}"
        assert same_bits(o1, o2) and bool((m1 == m2).all())
        o3, _, m3 = cuflash.attention_forward(q, k, v, dropout_p=p, seed=6, return_dropout_mask=True)
        assert float((m3 != m1).mean()) > 0.1 and not same_bits(o1, o3)


def test_plain_options_are_the_plain_path():
    """window (-1, -1), window (-1, 0) == causal and dropout_p=0 run the plain kernels, bit for bit."""
    q, k, v = (make_input(1, 203, 2, 64, "fp16", "bshd", "contiguous", 7 + i) for i in range(3))
    assert same_bits(cuflash.attention(q, k, v, window=(-1, -1)), cuflash.attention(q, k, v))
    assert same_bits(cuflash.attention(q, k, v, window=(-1, 0)), cuflash.attention(q, k, v, causal=True))
    assert same_bits(cuflash.attention(q, k, v, dropout_p=0.0), cuflash.attention(q, k, v))


@pytest.mark.parametrize("d,dtype", [(64, "fp16"), (128, "bf16")])
@pytest.mark.parametrize("mods", [{"window": (40, 9), "alibi": "h"}, {"softcap": 25.0, "alibi": "bh"},
                                  {"dropout": 0.2, "softcap": 30.0}])
def test_a_planned_modifier_call_equals_the_full_path(d, dtype, mods):
    """The second call of a signature with a window, ALiBi, soft-capping or dropout replays the plan of the first
    (new inputs, slopes, seed and offset written per call): its o, lse, dq, dk, dv equal those of the same call on
    the full path (no plans), bit for bit (the other tests check the full path against the reference)."""
    b, s, hq, hkv = 2, 333, 4, 2

    def call(seed):
        q, dout = (make_input(b, s, hq, d, dtype, "bshd", "contiguous", seed + i) for i in (0, 3))
        k, v = (make_input(b, s, hkv, d, dtype, "bshd", "contiguous", seed + i) for i in (1, 2))
        kw = mods_kwargs(mods, b, hq, seed)
        poison_pool(round_up(q.nbytes) + round_up(b * hq * s * 4))
        o, lse = cuflash.attention_forward(q, k, v, causal=True, **kw)
        poison_pool(3 * round_up(q.nbytes) + (1 << 20))
        # (deterministic: the default mode's dQ sums in whichever order the key blocks arrive)
        return (o, lse, *cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, deterministic=True, **kw))

    check_replay_matches_full_path(call, f"{mods}, D={d}")


@pytest.mark.parametrize("mods", [{"window": (17, 3)}, {"alibi": "bh", "softcap": 20.0},
                                  {"dropout": 0.17, "window": (40, 40)}])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(mods, causal):
    """Packed sequences (lengths 0, 1, odd): each sequence its own attention with the same modifiers; the
    dropout stream of sequence b is that of batch index b."""
    lens_q, lens_k = [113, 0, 1, 77], [203, 5, 1, 77]
    hq, hkv, d, dtype = 4, 2, 64, "bf16"
    seed = seed_of("mods-varlen", sorted(mods.items()), causal)
    what = f"varlen {lens_q}/{lens_k} mods={mods} causal={causal}"
    tq, tk = sum(lens_q), sum(lens_k)
    q, dout = (make_packed(tq, hq, d, dtype, "contiguous", seed + i) for i in (0, 3))
    k, v = (make_packed(tk, hkv, d, dtype, "contiguous", seed + i) for i in (1, 2))
    cuq, cuk = cu_seqlens(lens_q), cu_seqlens(lens_k)
    kw = mods_kwargs(mods, len(lens_q), hq, seed)
    out = cuflash.attention_varlen_forward(q, k, v, cuq, cuk, max(lens_q), max(lens_k), causal=causal,
                                           return_dropout_mask="dropout_p" in kw, **kw)
    o, lse = out[:2]
    masks = None
    if "dropout_p" in kw:
        masks = [cp.asnumpy(m) for m in out[2]]
        want = philox.dropout_mask_varlen(lens_q, lens_k, hq, kw["dropout_p"], kw["seed"], kw["offset"])
        assert all(np.array_equal(a, b) for a, b in zip(masks, want)), f"dropout masks differ for {what}"
    rk = ref_kwargs(kw, masks)
    q32, k32, v32, do32 = (cp.asnumpy(x.astype(cp.float32)) for x in (q, k, v, dout))
    cq, ck = cp.asnumpy(cuq), cp.asnumpy(cuk)
    o64, lse64 = ref.attention_varlen_forward64(q32, k32, v32, cq, ck, causal, **rk)
    o_lowp = ref.attention_varlen_lowp(q32, k32, v32, cq, ck, dtype, causal, **rk)
    check_rule("o", o.astype(cp.float32), cp.asarray(o64), cp.asarray(o_lowp), 2, what)
    check_lse(lse, cp.asarray(lse64), what)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cuq, cuk, max(lens_q), max(lens_k),
                                              causal=causal, **kw)
    g64 = ref.attention_varlen_backward64(do32, q32, k32, v32, cq, ck, causal, **rk)
    glowp = ref.attention_varlen_backward_lowp(do32, q32, k32, v32, cq, ck, dtype, causal, **rk)
    for name, g, r64, low in zip(("dq", "dk", "dv"), grads, g64, glowp):
        check_rule(name, g.astype(cp.float32), cp.asarray(r64), cp.asarray(low), 3, what)
