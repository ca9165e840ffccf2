"""Grouped-query attention and variable-length batches on the GPU, against float64 references
(pass rule of docs/RELIABILITY.md): max|out - ref64| <= 2 * max|out_lowp - ref64| + 1e-5 for o, factor 3 for dq, dk, dv,
lse within 1e-3 where a row sees a key (-inf exactly where it sees none), outputs poisoned before each call.

GQA: k and v have H_kv heads, H_q % H_kv == 0, query head h uses kv head h // (H_q // H_kv); dk, dv sum the
query heads of each group. Varlen: packed q (total_q, H_q, D), k, v (total_k, H_kv, D), cu_seqlens int32;
each sequence is its own attention (causal bottom-right per sequence); lse is (H_q, total_q). The references
run one sequence at a time (cuflash._xpref.attention_varlen_*), on the dense references."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _xpref, config  # noqa: E402
from gpu_helpers import (DTYPES, LAYOUTS, check_lse, check_rule, cu_seqlens, make_input,  # noqa: E402
                         make_packed, max_abs, poison_pool, random_lengths, round_up, same_bits, seed_of, to_bshd32,
                         warm_kernel_cache)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    warm_kernel_cache(config.all_fwd_configs() + config.all_bwd_configs())


def backward_poison_bytes(*arrays) -> int:
    """Room for the gradients and the backward's float32 workspaces (query-head sized), with a margin."""
    return round_up(8 * sum(x.size * x.dtype.itemsize for x in arrays)) + (1 << 20)


# --- GQA / MQA in attention_forward and attention_backward ---------------------------------------------------

def gqa_problem(b, sq, sk, hq, hkv, d, dtype, layout, kinds, seed_key):
    seed = seed_of("gqa", b, sq, sk, hq, hkv, d, dtype, layout, kinds, *seed_key)
    q = make_input(b, sq, hq, d, dtype, layout, kinds[0], seed)
    k = make_input(b, sk, hkv, d, dtype, layout, kinds[1], seed + 1)
    v = make_input(b, sk, hkv, d, dtype, layout, kinds[2], seed + 2)
    dout = make_input(b, sq, hq, d, dtype, layout, kinds[3] if len(kinds) > 3 else "contiguous", seed + 3)
    return q, k, v, dout


def describe(b, sq, sk, hq, hkv, d, dtype, causal, layout, kinds=None):
    return (f"B={b} Sq={sq} Sk={sk} H_q={hq} H_kv={hkv} (group {hq // hkv}) D={d} {dtype} causal={causal} {layout}"
            + (f" strides={'/'.join(kinds)}" if kinds else ""))


def check_gqa_forward(b, sq, sk, hq, hkv, d, dtype, causal, layout, kinds=("contiguous",) * 3, seed_key=()):
    what = describe(b, sq, sk, hq, hkv, d, dtype, causal, layout, kinds)
    q, k, v, _ = gqa_problem(b, sq, sk, hq, hkv, d, dtype, layout, kinds, seed_key)
    poison_pool(round_up(q.nbytes) + round_up(b * hq * sq * 4))
    o, lse = cuflash.attention_forward(q, k, v, causal=causal, layout=layout)

    assert o.shape == q.shape and o.dtype == q.dtype, f"o is {o.shape} {o.dtype} for {what}"
    assert lse.shape == (b, hq, sq), f"lse shape {lse.shape}, expected (batch, H_q, Sq) for {what}"
    q32, k32, v32 = (to_bshd32(x, layout) for x in (q, k, v))
    o64, lse64 = _xpref.attention_forward64(q32, k32, v32, causal)
    o_lowp = _xpref.attention_lowp(q32, k32, v32, dtype, causal)
    o32 = to_bshd32(o, layout)
    check_rule("o", o32, o64, o_lowp, 2, what)
    check_lse(lse, lse64, what)
    masked = ~cp.isfinite(lse64).transpose(0, 2, 1)  # (B, Sq, H_q): rows that see no key
    assert max_abs(cp.where(masked[..., None], o32, 0.0)) == 0.0, f"rows that see no key must be 0 for {what}"
    return o, lse


def check_gqa_backward(b, sq, sk, hq, hkv, d, dtype, causal, layout, kinds=("contiguous",) * 4, seed_key=(), **kw):
    what = describe(b, sq, sk, hq, hkv, d, dtype, causal, layout, kinds)
    q, k, v, dout = gqa_problem(b, sq, sk, hq, hkv, d, dtype, layout, kinds, seed_key)
    o, lse = cuflash.attention_forward(q, k, v, causal=causal, layout=layout)
    poison_pool(backward_poison_bytes(q, q, q))  # dq and the dk, dv work at query-head size at most
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, layout=layout, **kw)

    q32, k32, v32, do32 = (to_bshd32(x, layout) for x in (q, k, v, dout))
    refs64 = _xpref.attention_backward64(do32, q32, k32, v32, causal)
    refs_lowp = _xpref.attention_backward_lowp(do32, q32, k32, v32, dtype, causal)
    for name, g, x, g64, glowp in zip(("dq", "dk", "dv"), grads, (q, k, v), refs64, refs_lowp):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} is {g.shape} {g.dtype}, {x.shape} expected, {what}"
        check_rule(name, to_bshd32(g, layout), g64, glowp, 3, what)
    return grads


# (H_q, H_kv, Sq, Sk, D, layout): group sizes 1, 2, 3, 4, 8 and MQA (H_kv = 1, H_q up to 8), awkward seqlen pairs,
# every head dim with its own kernel
GQA_GRID = [
    (4, 4, 113, 203, 64, "bshd"),
    (4, 2, 128, 217, 128, "bhsd"),
    (8, 1, 1, 239, 64, "bshd"),       # MQA, one query row
    (8, 1, 1023, 1024, 128, "bshd"),  # MQA
    (16, 2, 3, 799, 96, "bhsd"),      # group 8
    (6, 3, 512, 256, 256, "bshd"),
    (6, 1, 127, 513, 32, "bhsd"),     # MQA, group 6
    (8, 2, 256, 512, 64, "bhsd"),
    (12, 3, 1024, 1023, 64, "bshd"),
    (4, 1, 108, 256, 128, "bshd"),    # MQA
]
GQA_IDS = [f"hq{hq}-hkv{hkv}-{sq}x{sk}-d{d}-{lay}" for hq, hkv, sq, sk, d, lay in GQA_GRID]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,sq,sk,d,layout", GQA_GRID, ids=GQA_IDS)
def test_gqa_forward_matches_reference(hq, hkv, sq, sk, d, layout, dtype, causal):
    check_gqa_forward(1 if sq * sk > 300_000 else 2, sq, sk, hq, hkv, d, dtype, causal, layout)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,sq,sk,d,layout", GQA_GRID, ids=GQA_IDS)
def test_gqa_backward_matches_reference(hq, hkv, sq, sk, d, layout, dtype, causal):
    """dk, dv (H_kv heads) are the sums over the query heads of each group."""
    check_gqa_backward(1 if sq * sk > 300_000 else 2, sq, sk, hq, hkv, d, dtype, causal, layout)


GQA_STRIDED = [
    ("padded", "padded", "padded", "padded"),
    ("transposed", "transposed", "padded", "contiguous"),
    ("contiguous", "misaligned", "misaligned", "transposed"),  # k, v copied by the library
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kinds", GQA_STRIDED, ids=["/".join(k) for k in GQA_STRIDED])
def test_gqa_non_contiguous_inputs(kinds, layout):
    dtype = "bf16" if layout == "bshd" else "fp16"
    check_gqa_forward(2, 128, 217, 6, 2, 64, dtype, True, layout, kinds=kinds[:3])
    check_gqa_backward(2, 128, 217, 6, 2, 64, dtype, True, layout, kinds=kinds)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_causal_rows_that_see_no_key(dtype):
    """Sq > Sk, causal, bottom-right: the first Sq - Sk queries of every head see no key: o = 0, lse = -inf,
    dq = 0 there, and they add nothing to dk, dv."""
    o, lse = check_gqa_forward(2, 300, 100, 4, 1, 64, dtype, True, "bshd", seed_key=("masked",))
    assert max_abs(_xpref.to_float32(o[:, :200])) == 0.0
    assert bool((lse[:, :, :200] == -cp.inf).all()) and bool(cp.isfinite(lse[:, :, 200:]).all())
    dq, _, _ = check_gqa_backward(2, 300, 100, 4, 1, 64, dtype, True, "bshd", seed_key=("masked",))
    assert max_abs(_xpref.to_float32(dq[:, :200])) == 0.0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_deterministic_backward_is_bitwise_reproducible(dtype, causal):
    """Several query heads add into each dk, dv row: deterministic=True fixes the order, 3 runs bitwise equal."""
    q, k, v, dout = gqa_problem(1, 1023, 1024, 8, 2, 128, dtype, "bshd", ("contiguous",) * 4, ("det",))
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    first = [g.copy() for g in cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=True)]
    for run in range(2, 4):
        grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=True)
        for name, g, ref in zip(("dq", "dk", "dv"), grads, first):
            assert same_bits(g, ref), f"{name} of run {run} differs from run 1 ({dtype}, causal={causal})"
    q32, k32, v32, do32 = (to_bshd32(x, "bshd") for x in (q, k, v, dout))
    for name, g, g64, glowp in zip(("dq", "dk", "dv"), first, _xpref.attention_backward64(do32, q32, k32, v32, causal),
                                   _xpref.attention_backward_lowp(do32, q32, k32, v32, dtype, causal)):
        check_rule(name, to_bshd32(g, "bshd"), g64, glowp, 3, f"deterministic GQA 8/2 {dtype} causal={causal}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gqa_preallocated_gradients_have_the_kv_head_count(layout):
    q, k, v, dout = gqa_problem(2, 200, 300, 8, 2, 128, "bf16", layout, ("contiguous",) * 4, ("prealloc",))
    o, lse = cuflash.attention_forward(q, k, v, causal=True, layout=layout)
    nan = lambda x: _xpref.to_lowp(cp.full(x.shape, cp.nan, dtype=cp.float32), "bf16")  # noqa: E731
    outs = (nan(q), nan(k), nan(v))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, layout=layout,
                                       dq=outs[0], dk=outs[1], dv=outs[2])
    q32, k32, v32, do32 = (to_bshd32(x, layout) for x in (q, k, v, dout))
    for name, g, buf, g64, glowp in zip(("dq", "dk", "dv"), grads, outs,
                                        _xpref.attention_backward64(do32, q32, k32, v32, True),
                                        _xpref.attention_backward_lowp(do32, q32, k32, v32, "bf16", True)):
        assert g.data.ptr == buf.data.ptr and g.shape == buf.shape, f"{name} was not written into the given array"
        check_rule(name, to_bshd32(buf, layout), g64, glowp, 3, f"preallocated GQA 8/2 {layout}")


# --- variable-length batches ----------------------------------------------------------------------------------

N_SEQS = 8


def varlen_lengths(seed_key):
    """8 (len_q, len_k) drawn from [0, 300] (odd ones among them), with forced edge cases: sequence 1 empty,
    sequence 2 queries but no keys (rows that see no key), sequence 4 one query and one key, sequence 6 keys
    but no queries (no gradient), sequence 7 one query over many keys."""
    seed = seed_of("varlen-lengths", *seed_key)
    lens_q = random_lengths(seed, N_SEQS, 300, {1: 0, 2: 37, 4: 1, 6: 0, 7: 1})
    lens_k = random_lengths(seed + 1, N_SEQS, 300, {1: 0, 2: 0, 4: 1, 6: 29, 7: 255})
    return lens_q, lens_k


def varlen_problem(hq, hkv, d, dtype, kind, seed_key, lens=None):
    lens_q, lens_k = varlen_lengths(seed_key) if lens is None else lens
    seed = seed_of("varlen", hq, hkv, d, dtype, kind, *seed_key)
    total_q, total_k = sum(lens_q), sum(lens_k)
    q = make_packed(total_q, hq, d, dtype, kind, seed)
    k = make_packed(total_k, hkv, d, dtype, kind, seed + 1)
    v = make_packed(total_k, hkv, d, dtype, "contiguous" if kind == "transposed" else kind, seed + 2)
    dout = make_packed(total_q, hq, d, dtype, kind, seed + 3)
    return q, k, v, dout, cu_seqlens(lens_q), cu_seqlens(lens_k), lens_q, lens_k


def rows_of(cu, b):
    return slice(int(cu[b]), int(cu[b + 1]))


# (H_q, H_kv, D, stride kind of the packed arrays, extra added to max_seqlen): GQA and MQA mixed in
VARLEN_CASES = [
    (4, 4, 64, "contiguous", 0),
    (6, 2, 128, "padded", 0),
    (8, 1, 96, "transposed", 37),  # max_seqlen larger than the longest sequence is allowed
    (4, 2, 256, "contiguous", 0),
    (2, 2, 32, "padded", 5),
    (4, 1, 128, "transposed", 0),
]
VARLEN_IDS = [f"hq{hq}-hkv{hkv}-d{d}-{kind}" + (f"-max+{x}" if x else "") for hq, hkv, d, kind, x in VARLEN_CASES]


def run_varlen_forward(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, extra=0, **kw):
    poison_pool(round_up(q.size * 2) + round_up(q.shape[1] * q.shape[0] * 4) + (1 << 20))
    return cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q) + extra, max(lens_k) + extra,
                                            causal=causal, **kw)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,kind,extra", VARLEN_CASES, ids=VARLEN_IDS)
def test_varlen_forward_matches_per_sequence_reference(hq, hkv, d, kind, extra, dtype, causal):
    q, k, v, _, cu_q, cu_k, lens_q, lens_k = varlen_problem(hq, hkv, d, dtype, kind, (hq, d, dtype, causal))
    what = f"varlen lens_q={lens_q} lens_k={lens_k} H_q={hq} H_kv={hkv} D={d} {dtype} causal={causal} {kind}"
    o, lse = run_varlen_forward(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, extra)

    assert o.shape == q.shape and o.dtype == q.dtype, f"o is {o.shape} {o.dtype} for {what}"
    assert lse.shape == (hq, sum(lens_q)) and lse.dtype == cp.float32, f"lse is {lse.shape}, (H_q, total_q) for {what}"
    q32, k32, v32 = (_xpref.to_float32(x) for x in (q, k, v))
    o64, lse64 = _xpref.attention_varlen_forward64(q32, k32, v32, cu_q, cu_k, causal)
    o_lowp = _xpref.attention_varlen_lowp(q32, k32, v32, cu_q, cu_k, dtype, causal)
    o32 = _xpref.to_float32(o)
    check_rule("o", o32, o64, o_lowp, 2, what)
    check_lse(lse, lse64, what)
    masked = ~cp.isfinite(lse64).T  # (total_q, H_q): rows that see no key (sequence 2 at least)
    assert bool(masked[rows_of(cu_q, 2)].all()), f"sequence 2 has queries and no keys: every row masked, {what}"
    assert max_abs(cp.where(masked[..., None], o32, 0.0)) == 0.0, f"rows that see no key must be 0 for {what}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,kind,extra", VARLEN_CASES, ids=VARLEN_IDS)
def test_varlen_backward_matches_per_sequence_reference(hq, hkv, d, kind, extra, dtype, causal):
    """dq, dk, dv packed like q, k, v; a sequence without keys has dq = 0, one without queries dk = dv = 0."""
    q, k, v, dout, cu_q, cu_k, lens_q, lens_k = varlen_problem(hq, hkv, d, dtype, kind, (hq, d, dtype, causal, "bwd"))
    what = f"varlen lens_q={lens_q} lens_k={lens_k} H_q={hq} H_kv={hkv} D={d} {dtype} causal={causal} {kind}"
    mq, mk = max(lens_q) + extra, max(lens_k) + extra
    o, lse = cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, causal=causal)
    poison_pool(backward_poison_bytes(q, q, q))
    grads = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, mq, mk, causal=causal)

    q32, k32, v32, do32 = (_xpref.to_float32(x) for x in (q, k, v, dout))
    refs64 = _xpref.attention_varlen_backward64(do32, q32, k32, v32, cu_q, cu_k, causal)
    refs_lowp = _xpref.attention_varlen_backward_lowp(do32, q32, k32, v32, cu_q, cu_k, dtype, causal)
    for name, g, x, g64, glowp in zip(("dq", "dk", "dv"), grads, (q, k, v), refs64, refs_lowp):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} is {g.shape} {g.dtype}, {x.shape} expected, {what}"
        check_rule(name, _xpref.to_float32(g), g64, glowp, 3, what)
    dq, dk, dv = (_xpref.to_float32(g) for g in grads)
    for b in range(N_SEQS):
        if lens_k[b] == 0:
            assert max_abs(dq[rows_of(cu_q, b)]) == 0.0, f"dq of sequence {b} (no keys) must be 0, {what}"
        if lens_q[b] == 0:
            assert max_abs(dk[rows_of(cu_k, b)]) == 0.0 and max_abs(dv[rows_of(cu_k, b)]) == 0.0, \
                f"dk, dv of sequence {b} (no queries) must be 0, {what}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_check_inputs_false_gives_the_same_bits(dtype):
    """check_inputs=False only skips reading cu_seqlens back: same results, bit for bit."""
    q, k, v, dout, cu_q, cu_k, lens_q, lens_k = varlen_problem(4, 2, 128, dtype, "contiguous", ("no-check",))
    mq, mk = max(lens_q), max(lens_k)
    o, lse = cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    o2, lse2 = cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, causal=True, check_inputs=False)
    assert same_bits(o, o2) and same_bits(lse, lse2)
    assert same_bits(o, cuflash.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True, check_inputs=False))
    g1 = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, mq, mk, causal=True, deterministic=True)
    g2 = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, mq, mk, causal=True, deterministic=True,
                                           check_inputs=False)
    for name, a, b in zip(("dq", "dk", "dv"), g1, g2):
        assert same_bits(a, b), f"{name} differs with check_inputs=False"


@pytest.mark.parametrize("d,dtype,kind", [(64, "fp16", "contiguous"), (128, "bf16", "padded"), (96, "bf16", "transposed")])
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_a_planned_varlen_call_equals_the_full_path(d, dtype, kind, check):
    """The second call of a varlen signature replays the plans of the first (new inputs and new cu_seqlens arrays of
    the same lengths, their addresses written per call; check_inputs=True reads them back each time): its o, lse,
    dq, dk, dv equal those of the same call on the full path (no plans), bit for bit. GQA 4:2, a zero-length
    sequence, causal (the persistent forward's work queue at these head dims)."""
    from gpu_helpers import check_replay_matches_full_path

    lens = ([70, 0, 131, 9], [64, 5, 200, 9])

    def call(seed):
        q, k, v, dout, cu_q, cu_k, lens_q, lens_k = varlen_problem(4, 2, d, dtype, kind, ("plan", seed), lens)
        mq, mk = max(lens_q), max(lens_k)
        poison_pool(round_up(q.nbytes) + round_up(4 * 4 * q.shape[0]))
        o, lse = cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, causal=True, check_inputs=check)
        poison_pool(backward_poison_bytes(q, k, v))
        return (o, lse, *cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, mq, mk, causal=True,
                                                           deterministic=True, check_inputs=check))

    check_replay_matches_full_path(call, f"varlen D={d} {dtype} {kind} check_inputs={check}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_deterministic_backward_is_bitwise_reproducible(causal):
    q, k, v, dout, cu_q, cu_k, lens_q, lens_k = varlen_problem(8, 2, 64, "bf16", "padded", ("det", causal))
    mq, mk = max(lens_q), max(lens_k)
    o, lse = cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, causal=causal)
    first = [g.copy() for g in cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, mq, mk,
                                                                   causal=causal, deterministic=True)]
    for run in range(2, 4):
        grads = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, mq, mk, causal=causal,
                                                  deterministic=True)
        for name, g, ref in zip(("dq", "dk", "dv"), grads, first):
            assert same_bits(g, ref), f"{name} of run {run} differs from run 1 (causal={causal})"


def test_varlen_preallocated_gradients_are_filled_in_place():
    q, k, v, dout, cu_q, cu_k, lens_q, lens_k = varlen_problem(6, 2, 128, "fp16", "contiguous", ("prealloc",))
    mq, mk = max(lens_q), max(lens_k)
    o, lse = cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    outs = tuple(cp.full(x.shape, cp.nan, dtype=cp.float16) for x in (q, k, v))
    grads = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, mq, mk, causal=True,
                                              dq=outs[0], dk=outs[1], dv=outs[2])
    q32, k32, v32, do32 = (_xpref.to_float32(x) for x in (q, k, v, dout))
    for name, g, buf, g64, glowp in zip(("dq", "dk", "dv"), grads, outs,
                                        _xpref.attention_varlen_backward64(do32, q32, k32, v32, cu_q, cu_k, True),
                                        _xpref.attention_varlen_backward_lowp(do32, q32, k32, v32, cu_q, cu_k, "fp16",
                                                                              True)):
        assert g.data.ptr == buf.data.ptr, f"{name} was not written into the given array"
        check_rule(name, _xpref.to_float32(buf), g64, glowp, 3, "varlen preallocated")


def test_varlen_without_queries_gives_empty_outputs_and_zero_key_gradients():
    """Every sequence empty on the query side: o (0, H_q, D), lse (H_q, 0), dq empty, dk = dv = 0 (written)."""
    lens = ([0, 0, 0], [5, 0, 130])
    q, k, v, dout, cu_q, cu_k, _, _ = varlen_problem(4, 2, 64, "bf16", "contiguous", ("no-q",), lens=lens)
    o, lse = cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, 0, 130)
    assert o.shape == (0, 4, 64) and lse.shape == (4, 0)
    poison_pool(backward_poison_bytes(k, k, k))
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, 0, 130)
    assert dq.shape == (0, 4, 64) and dk.shape == k.shape and dv.shape == v.shape
    assert max_abs(_xpref.to_float32(dk)) == 0.0 and max_abs(_xpref.to_float32(dv)) == 0.0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_without_keys_gives_zero_output_and_minus_inf_lse(causal):
    lens = ([3, 0, 17], [0, 0, 0])
    q, k, v, dout, cu_q, cu_k, _, _ = varlen_problem(4, 4, 64, "fp16", "contiguous", ("no-k",), lens=lens)
    o, lse = run_varlen_forward(q, k, v, cu_q, cu_k, *lens, causal)
    assert o.shape == q.shape and max_abs(_xpref.to_float32(o)) == 0.0
    assert lse.shape == (4, 20) and bool((lse == -cp.inf).all())
    poison_pool(backward_poison_bytes(q, q, q))
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, 17, 0, causal=causal)
    assert dq.shape == q.shape and max_abs(_xpref.to_float32(dq)) == 0.0 and dk.shape == (0, 4, 64)


BAD_CU = [  # (id, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, message fragments); total_q 20, total_k 40
    ("q-last-not-total", [0, 10, 19], [0, 20, 40], 10, 20, ["cu_seqlens_q[2]=19", "total_q=20"]),
    ("k-decreasing", [0, 10, 20], [0, 25, 20], 10, 25,
     ["cu_seqlens_k must be non-decreasing", "cu_seqlens_k[2]=20 < cu_seqlens_k[1]=25"]),
    ("q-longer-than-max", [0, 2, 20], [0, 20, 40], 12, 20, ["sequence 1 has length 18", "max_seqlen_q=12"]),
    ("k-first-not-zero", [0, 10, 20], [3, 20, 40], 10, 20, ["cu_seqlens_k[0]=3 must be 0"]),
]


@pytest.mark.parametrize("cq,ck,mq,mk,parts", [c[1:] for c in BAD_CU], ids=[c[0] for c in BAD_CU])
def test_varlen_bad_cu_seqlens_values_are_rejected(cq, ck, mq, mk, parts):
    """check_inputs=True (the default) reads cu_seqlens back and rejects bad values before any launch."""
    q = make_packed(20, 2, 64, "fp16", "contiguous", 1)
    k = make_packed(40, 2, 64, "fp16", "contiguous", 2)
    cu_q, cu_k = (cp.asarray(x, dtype=cp.int32) for x in (cq, ck))
    lse = cp.zeros((2, 20), dtype=cp.float32)
    for call in (lambda: cuflash.attention_varlen(q, k, k, cu_q, cu_k, mq, mk),
                 lambda: cuflash.attention_varlen_backward(q, q, k, k, q, lse, cu_q, cu_k, mq, mk)):
        with pytest.raises(ValueError) as e:
            call()
        missing = [p for p in parts if p not in str(e.value)]
        assert not missing, f"message lacks {missing}: {str(e.value)!r}"
