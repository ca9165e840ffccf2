"""Ring attention on one GPU: the simulated ring (the kernels, the merges and the exchanges of
cuflash.distributed run for P ranks in one process) against float64 attention of the unsharded problem, by the
pass rule (docs/RELIABILITY.md: o factor 2, gradients factor 3, against plain attention in the input dtype);
deterministic mode bitwise reproducible; the bytes passed equal the analyzer's count."""
from __future__ import annotations

import pytest

cp = pytest.importorskip("cupy")

import cuflash.distributed as cfd  # noqa: E402
from cuflash import _xpref  # noqa: E402
from cuflash.simulator import ring as ring_model  # noqa: E402
from gpu_helpers import check_lse, check_rule, check_rule_wide, poison_pool, randn, same_bits, seed_of  # noqa: E402

pytestmark = pytest.mark.gpu


def make(b, n, h, h_kv, d, dtype, layout, key):
    """Fresh q, k, v, dout of the global problem in `layout`, and their float32 (B, S, H, D) copies."""
    seed = seed_of("ring", *key)
    shapes = ((b, n, h, d), (b, n, h_kv, d), (b, n, h_kv, d), (b, n, h, d))
    xs = [randn(s, dtype, seed + i) for i, s in enumerate(shapes)]
    as_layout = (lambda x: x) if layout == "bshd" else (lambda x: cp.ascontiguousarray(x.transpose(0, 2, 1, 3)))
    bits = {2: cp.uint16, 4: cp.uint32}[xs[0].dtype.itemsize]  # bf16 has no CuPy copy kernel: move its bits
    laid = [as_layout(x.view(bits)).view(x.dtype) for x in xs]
    return laid, [_xpref.to_float32(x) for x in xs]


def to_bshd(x, layout):
    return x if layout == "bshd" else x.transpose(0, 2, 1, 3)


RING_CASES = [  # world size, causal, sharding, layout, dtype, head dim, (H_q, H_kv), chunk length
    (2, True, "zigzag", "bshd", "bf16", 128, (4, 4), 200),
    (2, False, "zigzag", "bshd", "fp16", 64, (4, 2), 160),
    (3, True, "zigzag", "bhsd", "bf16", 64, (6, 2), 96),
    (4, True, "zigzag", "bshd", "fp16", 128, (2, 1), 136),
    (4, False, "contiguous", "bhsd", "bf16", 128, (4, 4), 64),
    (3, True, "contiguous", "bshd", "bf16", 64, (4, 4), 100),
    (1, True, "zigzag", "bshd", "bf16", 128, (4, 4), 256),
    (2, True, "zigzag", "bshd", "bf16", 256, (2, 2), 128),
    (2, True, "zigzag", "bshd", "bf16", 96, (4, 4), 72),
]


@pytest.mark.parametrize("world_size,causal,sharding,layout,dtype,d,heads,chunk", RING_CASES)
def test_simulated_ring_matches_float64_attention(world_size, causal, sharding, layout, dtype, d, heads, chunk):
    b, (h, h_kv) = 2, heads
    n = 2 * world_size * chunk
    what = f"P={world_size} causal={causal} {sharding} {layout} {dtype} D={d} H={h}/{h_kv} N={n}"
    (q, k, v, do), (q32, k32, v32, do32) = make(b, n, h, h_kv, d, dtype, layout, (what,))
    poison_pool(8 * q.nbytes + 16 * k.nbytes)
    kw = dict(causal=causal, sharding=sharding, layout=layout)
    o, lse = cfd.simulate_ring_attention_forward(q, k, v, world_size, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype, f"o is {o.shape} {o.dtype} for {what}"
    o64, lse64 = _xpref.attention_forward64(q32, k32, v32, causal)
    check_rule("o", to_bshd(_xpref.to_float32(o), layout), o64, _xpref.attention_lowp(q32, k32, v32, dtype, causal),
               2.0, what)
    check_lse(lse, lse64, what)
    poison_pool(8 * q.nbytes + 16 * k.nbytes)
    grads = cfd.simulate_ring_attention_backward(do, q, k, v, o, lse, world_size, **kw)
    refs64 = _xpref.attention_backward64(do32, q32, k32, v32, causal)
    refs_lowp = _xpref.attention_backward_lowp(do32, q32, k32, v32, dtype, causal)
    for name, g, x, g64, glowp in zip(("dq", "dk", "dv"), grads, (q, k, v), refs64, refs_lowp):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} is {g.shape} {g.dtype} for {what}"
        check_rule(name, to_bshd(_xpref.to_float32(g), layout), g64, glowp, 3.0, what)


@pytest.mark.parametrize("precision,softcap", [("fp32", None), ("fp32", 8.0), ("tf32", None)])
def test_simulated_ring_float32(precision, softcap):
    world_size, b, h, h_kv, d, n, causal = 2, 1, 4, 2, 64, 512, True
    what = f"P={world_size} float32 precision={precision} softcap={softcap}"
    (q, k, v, do), _ = make(b, n, h, h_kv, d, "fp32", "bshd", (what,))
    kw = dict(causal=causal, softcap=softcap, precision=precision)
    o, lse = cfd.simulate_ring_attention_forward(q, k, v, world_size, **kw)
    o64, lse64 = _xpref.attention_plain(q, k, v, "fp64", causal, softcap=softcap)
    o_plain, lse_plain = _xpref.attention_plain(q, k, v, precision, causal, softcap=softcap)
    check_rule_wide("o", o, o64, o_plain, 2, what, 1e-6)
    check_rule_wide("lse", lse, lse64, lse_plain, 2, what, 1e-6)  # TF32 scores: lse off by ~1e-3, as plain TF32
    grads = cfd.simulate_ring_attention_backward(do, q, k, v, o, lse, world_size, **kw)
    refs64 = _xpref.attention_backward_plain(do, q, k, v, "fp64", causal, softcap=softcap)
    refs_plain = _xpref.attention_backward_plain(do, q, k, v, precision, causal, softcap=softcap)
    for name, g, g64, gp in zip(("dq", "dk", "dv"), grads, refs64, refs_plain):
        check_rule_wide(name, g, g64, gp, 3, what, 1e-6)


def test_deterministic_ring_backward_is_bitwise_reproducible():
    world_size, b, h, d, n = 3, 1, 4, 128, 1152
    (q, k, v, do), _ = make(b, n, h, h, d, "bf16", "bshd", ("det",))
    o, lse = cfd.simulate_ring_attention_forward(q, k, v, world_size, causal=True)
    first = cfd.simulate_ring_attention_backward(do, q, k, v, o, lse, world_size, causal=True, deterministic=True)
    again = cfd.simulate_ring_attention_backward(do, q, k, v, o, lse, world_size, causal=True, deterministic=True)
    for name, x, y in zip(("dq", "dk", "dv"), first, again):
        assert same_bits(x, y), f"{name} differs between two deterministic ring backwards"


@pytest.mark.parametrize("backward", [False, True])
def test_ring_passes_the_bytes_the_analyzer_counts(backward):
    world_size, b, h, h_kv, d, n = 4, 1, 4, 2, 64, 1024
    (q, k, v, do), _ = make(b, n, h, h_kv, d, "bf16", "bshd", ("trace", backward))
    trace = []
    o, lse = cfd.simulate_ring_attention_forward(q, k, v, world_size, causal=True, trace=None if backward else trace)
    if backward:
        cfd.simulate_ring_attention_backward(do, q, k, v, o, lse, world_size, causal=True, trace=trace)
    counts = ring_model.ring_counts(n, world_size, batch=b, heads_q=h, heads_kv=h_kv, head_dim=d, causal=True,
                                    elem_bytes=2, acc_bytes=4, backward=backward)
    assert counts.sent_bytes == trace, f"analyzer {counts.sent_bytes} != ring {trace}"


def test_ring_refuses_bad_shards_before_any_launch():
    q = randn((1, 65, 2, 64), "bf16", 1)
    with pytest.raises(ValueError, match=r"seqlen=65 must be a multiple of 4"):
        cfd.simulate_ring_attention_forward(q, q, q, 2)
    with pytest.raises(TypeError, match="not a mix"):
        cfd.simulate_ring_attention_forward(q, cp.asnumpy(q.view(cp.uint16)), q, 2)
    x = randn((1, 64, 2, 72), "fp16", 2)
    with pytest.raises(ValueError, match="head_dim"):
        cfd.simulate_ring_attention_forward(x[..., :60], x[..., :60], x[..., :60], 2)


VARLEN_CASES = [  # world size, causal, sharding, dtype, head dim, (H_q, H_kv), sequence lengths / (2 world size)
    (2, True, "zigzag", "bf16", 128, (4, 2), (50, 3, 0, 128, 17)),
    (3, False, "zigzag", "fp16", 64, (2, 2), (40, 1, 77)),
    (2, True, "contiguous", "bf16", 64, (4, 4), (64, 9, 33)),
]


@pytest.mark.parametrize("world_size,causal,sharding,dtype,d,heads,chunks", VARLEN_CASES)
def test_simulated_varlen_ring_matches_float64_attention(world_size, causal, sharding, dtype, d, heads, chunks):
    (h, h_kv) = heads
    lengths = [2 * world_size * c for c in chunks]
    cu_host = [0]
    for n in lengths:
        cu_host.append(cu_host[-1] + n)
    total = cu_host[-1]
    cu = cp.asarray(cu_host, dtype=cp.int32)
    what = f"varlen P={world_size} causal={causal} {sharding} {dtype} D={d} H={h}/{h_kv} lengths={lengths}"
    seed = seed_of("ring-varlen", what)
    q, k, v, do = (randn((total, hh, d), dtype, seed + i) for i, hh in enumerate((h, h_kv, h_kv, h)))
    q32, k32, v32, do32 = (_xpref.to_float32(x) for x in (q, k, v, do))
    poison_pool(8 * q.nbytes + 16 * k.nbytes)
    kw = dict(causal=causal, sharding=sharding)
    o, lse = cfd.simulate_ring_attention_varlen_forward(q, k, v, cu, world_size, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (h, total), f"shapes for {what}"
    o64, lse64 = _xpref.attention_varlen_forward64(q32, k32, v32, cu, cu, causal)
    check_rule("o", _xpref.to_float32(o), o64, _xpref.attention_varlen_lowp(q32, k32, v32, cu, cu, dtype, causal),
               2.0, what)
    check_lse(lse, lse64, what)
    grads = cfd.simulate_ring_attention_varlen_backward(do, q, k, v, o, lse, cu, world_size, **kw)
    refs64 = _xpref.attention_varlen_backward64(do32, q32, k32, v32, cu, cu, causal)
    refs_lowp = _xpref.attention_varlen_backward_lowp(do32, q32, k32, v32, cu, cu, dtype, causal)
    for name, g, x, g64, glowp in zip(("dq", "dk", "dv"), grads, (q, k, v), refs64, refs_lowp):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} is {g.shape} {g.dtype} for {what}"
        check_rule(name, _xpref.to_float32(g), g64, glowp, 3.0, what)
