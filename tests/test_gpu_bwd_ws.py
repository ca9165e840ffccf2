"""The warp-specialized Hopper backward (bwd_sm90_ws_kernel: TMA producer, two consumer warpgroups, dQ by bulk
reductions in its accumulator order, bwd_convert_dq_ws_kernel): that the library launches it on an H100, and what
the general backward tests (test_gpu_backward.py and the GQA / varlen / modifier / bias files, which run on it
there) do not reach: many query blocks per CTA (the 2-stage ring wraps many times, GQA steps across heads), a view
no tensor map describes (negative strides: copied first), the synchronous bwd_sm90_kernel beside it on the same
inputs, and deterministic mode. Pass rule as everywhere (docs/RELIABILITY.md): max|dX - dX_ref64| <= 3 *
max|dX_lowp - dX_ref64| + 1e-5. Needs an sm_90 GPU (skipped elsewhere, like every `gpu` test).
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _compile, _families, _plan, _xpref, config  # noqa: E402
from gpu_helpers import (backward_problem, check_backward, make_input, max_abs, poison_pool, round_up,  # noqa: E402
                         same_bits, seed_of)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _hopper_only():
    arch = _compile.device_arch()
    if not config.uses_wgmma(arch):  # another GPU, or CUFLASH_KERNELS=mma: the wgmma kernels do not run
        pytest.skip(f"bwd_sm90_ws_kernel needs an sm_90 GPU (TMA, wgmma, setmaxnreg) with the wgmma kernels on "
                    f"(here {arch}, CUFLASH_KERNELS={config.KERNELS})")


@pytest.fixture
def sync_family(monkeypatch):
    """A registry without bwd_sm90_ws (so bwd_sm90_kernel serves head dims 64 and 128), caches cleared."""
    monkeypatch.setattr(config, "FAMILIES", tuple(f for f in config.FAMILIES if f.name != "bwd_sm90_ws"))
    monkeypatch.setattr(_families, "_selected", {})
    monkeypatch.setattr(_plan, "plans", _plan.PlanCache())


def problem(b, sq, sk, hq, hkv, d, dtype, causal, kinds=("contiguous",) * 4, key=()):
    return backward_problem("bwd-ws", b, sq, sk, hq, hkv, d, dtype, causal, kinds, key)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_library_launches_the_ws_backward_on_hopper(d, dtype):
    for causal, mods, det in ((False, 0, False), (True, 0, False), (False, config.MOD_WINDOW, True)):
        cfg = config.backward_kernel_config(d, dtype, causal, det, _compile.device_arch(), mods=mods)
        assert isinstance(cfg, config.BwdSm90WsConfig), cfg
        assert config.convert_dq_config(cfg, dtype).kind == "convert_dq_ws"


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_many_query_blocks_and_gqa_steps(d, causal, dtype):
    """1000 queries = 16 query blocks per query head, 4 query heads per K/V head: 64 steps per CTA through the
    2-stage ring; 700 keys = a key tail; poisoned pool (dQ_acc, dQ's pad rows)."""
    q, k, v, dout, o, lse = problem(2, 1000, 700, 8, 2, d, dtype, causal)
    poison_pool(round_up(4 * (q.nbytes + 2 * k.nbytes)) + (1 << 20))
    grads = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal)
    check_backward(grads, q, k, v, dout, dtype, causal, f"ws D={d} {dtype} causal={causal} GQA 8/2")


@pytest.mark.parametrize("d", [32, 64, 128])
def test_a_negative_stride_view_is_copied_and_correct(d):
    """q and dout reversed along the sequence (negative row stride): no tensor map describes them, so the library
    copies them to contiguous arrays first."""
    q, k, v, dout, _, _ = problem(2, 300, 400, 4, 4, d, "bf16", False, key=("neg",))
    q, dout = q[:, ::-1], dout[:, ::-1]
    o, lse = cuflash.attention_forward(q, k, v)
    grads = cuflash.attention_backward(dout, q, k, v, o, lse)
    check_backward(grads, q, k, v, dout, "bf16", False, f"negative strides D={d}")


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ws_and_sync_kernels_agree(d, causal, request):
    """The same inputs through bwd_sm90_ws_kernel and bwd_sm90_kernel (at head dim 32, which that kernel lacks, the
    mma.sync bwd_kernel): both within the rule, and close to each other (dK, dV: the same per-block math; dQ: fp32
    adds in another order)."""
    q, k, v, dout, o, lse = problem(2, 517, 1030, 4, 4, d, "bf16", causal, key=("sync",))
    ws = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal)
    request.getfixturevalue("sync_family")
    assert not isinstance(config.backward_kernel_config(d, "bf16", causal, False, "sm_90a"), config.BwdSm90WsConfig)
    sync = cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal)
    check_backward(ws, q, k, v, dout, "bf16", causal, f"ws D={d} causal={causal}")
    check_backward(sync, q, k, v, dout, "bf16", causal, f"sync D={d} causal={causal}")
    for name, a, b in zip(("dq", "dk", "dv"), ws, sync):
        a32, b32 = _xpref.to_float32(a), _xpref.to_float32(b)
        assert max_abs(a32 - b32) <= 0.02 * max_abs(b32), f"{name}: ws and sync kernels differ"


@pytest.fixture
def steps_of_64(monkeypatch):
    """The warp-specialized backward with 64-query steps at every head dim (config.BWD_SM90_WS_BLOCK_M emptied),
    caches cleared."""
    monkeypatch.setattr(config, "BWD_SM90_WS_BLOCK_M", {})
    monkeypatch.setattr(_families, "_selected", {})
    monkeypatch.setattr(_plan, "plans", _plan.PlanCache())


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("causal,window,det", [(False, None, False), (True, None, False), (False, (100, 37), False),
                                               (True, None, True)], ids=["full", "causal", "window", "causal-det"])
def test_128_and_64_query_steps_agree(d, causal, window, det, request):
    """Head dims 32 and 64 take steps of 128 queries (dQ split by rows, its own dQ_acc order): on the same inputs
    (GQA 6/2, 777 queries = 6 blocks of 128 with a tail, 1030 keys = a key tail) both step sizes within the rule and
    close to each other (the same math, fp32 sums in another order)."""
    q, k, v, dout, o, lse = problem(2, 777, 1030, 6, 2, d, "bf16", causal, key=("steps", window))
    kw = {"causal": causal, **({"window": window} if window else {})}
    if window:
        o, lse = cuflash.attention_forward(q, k, v, **kw)
    kw["deterministic"] = det
    mods = config.MOD_WINDOW if window else 0
    assert config.backward_kernel_config(d, "bf16", causal, det, "sm_90a", mods=mods).block_m == 128
    poison_pool(round_up(4 * (q.nbytes + 2 * k.nbytes)) + (1 << 20))
    big = cuflash.attention_backward(dout, q, k, v, o, lse, **kw)
    request.getfixturevalue("steps_of_64")
    assert config.backward_kernel_config(d, "bf16", causal, det, "sm_90a", mods=mods).block_m == 64
    small = cuflash.attention_backward(dout, q, k, v, o, lse, **kw)
    if not window:  # (the reference has no window; the window's reference runs are in test_gpu_mods.py)
        check_backward(big, q, k, v, dout, "bf16", causal, f"128-query steps D={d} causal={causal} det={det}")
        check_backward(small, q, k, v, dout, "bf16", causal, f"64-query steps D={d} causal={causal} det={det}")
    for name, a, b in zip(("dq", "dk", "dv"), big, small):
        a32, b32 = _xpref.to_float32(a), _xpref.to_float32(b)
        assert max_abs(a32 - b32) <= 0.02 * max_abs(b32), f"{name}: 128- and 64-query steps differ"


@pytest.mark.parametrize("bias_shape,causal,window,masked", [
    ("pair", False, None, False), ("full", True, None, True), ("pair", False, (100, 37), True),
    ("full", False, (-1, 0), False)], ids=["pair", "full-causal-mask", "pair-window-mask", "full-window"])
def test_128_query_steps_with_a_staged_bias(bias_shape, causal, window, masked, request):
    """Head dim 32 with a bias (a pair bias shared by the batch, its dbias summed with atomics, or a full one, stored)
    and a mask or a window beside it takes steps of 128 queries with the bias staged in two 64 KB buffers: against the
    float64 reference (o, lse, dq, dk, dv and dbias; GQA 6/2, 777 queries = 6 blocks of 128 with a tail, 1030 keys =
    a key tail) and close to the 64-query steps' gradients on the same inputs (fp32 sums in another order)."""
    from test_gpu_bias import check_dense, make_bias, mask_random

    b, sq, sk, hq, hkv, d, dtype = 2, 777, 1030, 6, 2, 32, "bf16"
    seed = seed_of("bwd-ws-bias-128", bias_shape, causal, window, masked)
    q, k, v, dout = (make_input(b, s, h, d, dtype, "bshd", "contiguous", seed + i)
                     for i, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv), (sq, hq))))
    bias = make_bias((1 if bias_shape == "pair" else b, hq, sq, sk), dtype, "q", seed + 4)
    mask = mask_random(b, 1, sq, sk, seed + 5) if masked else None
    mods = config.MOD_BIAS | (config.MOD_MASK if masked else 0) | (config.MOD_WINDOW if window else 0)
    kernel_causal = causal and not window
    assert config.backward_kernel_config(d, dtype, kernel_causal, False, "sm_90a", mods=mods).block_m == 128
    assert config.bwd_stages_bias(d, mods, kernel_causal)
    o, lse, big, _ = check_dense(q, k, v, dout, dtype, f"128-query steps, staged bias {bias_shape}", causal=causal,
                                 bias=bias, mask=mask, mods={"window": window} if window else None, seed=seed)
    request.getfixturevalue("steps_of_64")
    assert config.backward_kernel_config(d, dtype, kernel_causal, False, "sm_90a", mods=mods).block_m == 64
    kw = dict(causal=causal, bias=bias, dbias=True, **({"mask": mask} if masked else {}),
              **({"window": window} if window else {}))
    small = cuflash.attention_backward(dout, q, k, v, o, lse, **kw)
    for name, x, y in zip(("dq", "dk", "dv", "dbias"), big, small):
        x32, y32 = _xpref.to_float32(x), _xpref.to_float32(y)
        assert max_abs(x32 - y32) <= 0.02 * max_abs(y32), f"{name}: 128- and 64-query steps differ"


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("kind,causal,window,det", [
    ("mask", False, None, False), ("mask", True, None, False), ("mask", False, (100, 37), False),
    ("mask", True, None, True), ("blocks", False, None, False), ("blocks", True, None, False),
    ("padding", False, None, False)],
    ids=["mask", "mask-causal", "mask-window", "mask-causal-det", "blockmask", "blockmask-causal", "key-padding"])
def test_128_query_steps_with_a_mask(d, kind, causal, window, det, request):
    """Head dims 32 and 64 with a mask alone take steps of 128 queries, the mask's bits a word per 64 queries; a
    BlockMask's and a key padding mask's tile maps are built at 128-row tiles (the BlockMask of whole 128 x 128 blocks
    on the plain mainloop, MOD_BLOCKS): against the float64 reference (GQA 6/2, 777 queries = 6 blocks of 128 with a
    tail, 1030 keys = a key tail; the mask with full, empty and partial tiles) and close to the 64-query steps'
    gradients on the same inputs (fp32 sums in another order)."""
    from test_gpu_bias import check_dense, mask_square_tiles, padding_mask

    b, sq, sk, hq, hkv, dtype = 2, 777, 1030, 6, 2, "bf16"
    seed = seed_of("bwd-ws-mask-128", d, kind, causal, window, det)
    q, k, v, dout = (make_input(b, s, h, d, dtype, "bshd", "contiguous", seed + i)
                     for i, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv), (sq, hq))))
    mods = config.MOD_WINDOW | config.MOD_MASK if window else config.MOD_MASK
    ref, call = {}, {}
    if kind == "padding":
        ref["key_padding_mask"] = padding_mask(b, sk, seed + 4)
    elif kind == "mask":
        ref["mask"] = mask_square_tiles(b, 1, sq, sk, seed + 4)
    else:  # whole 128 x 128 blocks, half of them kept: the map's kernel (MOD_BLOCKS), no element mask
        blocks = np.random.default_rng(seed + 4).random((b, 1, -(-sq // 128), -(-sk // 128))) < 0.5
        ref["mask"] = cp.asarray(np.repeat(np.repeat(blocks, 128, -2), 128, -1)[..., :sq, :sk])
        call["call_mask"] = cuflash.BlockMask(ref["mask"])
        mods = mods & ~config.MOD_MASK | config.MOD_BLOCKS
    kernel_causal = causal and not window
    assert config.backward_kernel_config(d, dtype, kernel_causal, det, "sm_90a", mods=mods).block_m == 128
    o, lse, big, _ = check_dense(q, k, v, dout, dtype, f"128-query steps, {kind} D={d}", causal=causal,
                                 mods={"window": window} if window else None, seed=seed, deterministic=det,
                                 **ref, **call)
    request.getfixturevalue("steps_of_64")
    assert config.backward_kernel_config(d, dtype, kernel_causal, det, "sm_90a", mods=mods).block_m == 64
    kw = dict(causal=causal, deterministic=det, **ref, **({"window": window} if window else {}))
    if call:
        kw["mask"] = call["call_mask"]
    small = cuflash.attention_backward(dout, q, k, v, o, lse, **kw)
    for name, x, y in zip(("dq", "dk", "dv"), big, small):
        x32, y32 = _xpref.to_float32(x), _xpref.to_float32(y)
        assert max_abs(x32 - y32) <= 0.02 * max_abs(y32), f"{name}: 128- and 64-query steps differ ({kind})"


@pytest.mark.parametrize("d", [32, 64, 128])
def test_deterministic_mode_on_the_ws_kernel(d):
    q, k, v, dout, o, lse = problem(1, 1023, 1024, 2, 2, d, "fp16", True, key=("det",))
    first = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, deterministic=True)
    for _ in range(4):
        again = cuflash.attention_backward(dout, q, k, v, o, lse, causal=True, deterministic=True)
        for a, b in zip(first, again):
            assert bool(cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)))
    check_backward(first, q, k, v, dout, "fp16", True, f"deterministic ws D={d}")


# Deterministic mode on this kernel adds each block of dQ in a fixed order of key blocks (bwd_sm90_ws_dq_writer,
# BwdKeyBlock::dq_turn): the band decides which key blocks add into a query block and which goes first (without one
# ascending; with causal or a window descending, the key blocks launched in reverse). A turn that the waiting CTA
# and those before it count differently traps (a launch error, not a hang); an order that varied would show as
# bits that differ between runs. Each case against the float64 reference (run_dense), twice; GQA 4/2, up to 9 key
# blocks of 128 per query block.
ORDERED = {"full": (300, 1100, False, {}), "causal": (400, 900, True, {}), "causal-sq>sk": (900, 400, True, {}),
           "window": (600, 500, False, {"window": (300, 40)}), "window-left": (500, 500, False, {"window": (200, -1)}),
           "window-right": (500, 500, False, {"window": (-1, 150)}),
           "causal+window": (400, 600, True, {"window": (256, -1)}), "causal-alibi": (300, 700, True, {"alibi": "h"})}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", ORDERED)
def test_ordered_dq_reductions(case, d):
    from test_gpu_mods import run_dense

    sq, sk, causal, mods = ORDERED[case]
    bits = (config.MOD_WINDOW if "window" in mods else 0) | (config.MOD_ALIBI if "alibi" in mods else 0)
    cfg = config.backward_kernel_config(d, "bf16", causal and not bits & config.MOD_WINDOW, True,
                                        _compile.device_arch(), mods=bits)
    assert isinstance(cfg, config.BwdSm90WsConfig) and config.ordered_dq(cfg), cfg
    first = run_dense(1, sq, sk, 4, 2, d, "bf16", causal, mods, deterministic=True)[2]
    again = run_dense(1, sq, sk, 4, 2, d, "bf16", causal, mods, deterministic=True)[2]
    for name, x, y in zip(("dq", "dk", "dv"), first, again):
        assert same_bits(x, y), f"deterministic {name} differs between two runs: {case}, D={d}"


@pytest.mark.parametrize("what", ["bias", "mask"])
def test_deterministic_with_a_bias_keeps_the_dq_kernel(what):
    """The exceptions of BwdSm90WsTraits::ordered_dq (a bias or dropout; a mask at head dim 128): the deterministic
    dQ kernel after the main kernel, bitwise repeatable and within the rule (head dim 128, causal, a bias of the
    full shape or a random mask)."""
    from test_gpu_bias import mask_random, run_dense as run_bias

    mods = config.MOD_BIAS if what == "bias" else config.MOD_MASK
    cfg = config.backward_kernel_config(128, "bf16", True, True, _compile.device_arch(), mods=mods)
    assert isinstance(cfg, config.BwdSm90WsConfig) and not config.ordered_dq(cfg), cfg
    b, sq, sk = 1, 333, 400
    kw = {"bias_shape": (b, 2, sq, sk)} if what == "bias" else {"mask": mask_random}
    first, again = (run_bias(b, sq, sk, 2, 2, 128, "bf16", causal=True, deterministic=True, **kw)[2]
                    for _ in range(2))
    for name, x, y in zip(("dq", "dk", "dv", "dbias"), first, again):
        if x is not None or y is not None:
            assert same_bits(x, y), f"deterministic {name} differs between two runs ({what})"


# Head dim 128 with each heavy modifier set its warp-specialized kernel takes (config.BWD_SM90_WS_MODS_128), the
# window beside some; the mask on a (B, H, Sq, Sk) bias and a random mask, and masks without a bias (random; whole
# tiles kept or dropped, so that full tiles skip the element reads; dead rows beside a key padding mask); a softcap
# of 2 on scores scaled up 3x, so that most scores are capped hard and its derivative (1 - tanh^2), parked in shared
# memory between the step's two loops, matters. GQA 4/2, a key tail, 9 query blocks. `bias`: False (none), True (a
# full bias), "mask" (a full bias and a random mask), or a mask alone: "random", "tiles", "dead". The random and tile
# masks come with 304 keys, rows of a multiple of 16 bytes, which the kernel reads in 16-byte chunks
# (mask_keep_transposed); the others with 300, read byte by byte.
WS_128_MODS = [({"alibi": "bh"}, False), ({"dropout": 0.17, "window": (64, 64)}, False), ({}, True),
               ({"window": (37, 5)}, "mask"), ({"softcap": 2.0}, False), ({"softcap": 2.0, "window": (64, 64)}, False),
               ({"softcap": 2.0, "alibi": "bh"}, False), ({}, "random"), ({"window": (37, 5)}, "tiles"),
               ({"alibi": "bh"}, "dead"), ({"softcap": 2.0, "window": (64, 64)}, "random")]
WS_128_IDS = ["alibi", "dropout+window", "bias", "bias+mask+window", "softcap", "softcap+window", "alibi+softcap",
              "mask", "tile-mask+window", "dead-rows-mask+padding+alibi", "mask+softcap+window"]


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mods,bias", WS_128_MODS, ids=WS_128_IDS)
def test_head_dim_128_with_a_heavy_modifier(mods, bias, causal, det):
    from test_gpu_bias import mask_dead_rows, mask_random, mask_tiles, run_dense as run_bias

    bits = sum(bit for name, bit in (("window", config.MOD_WINDOW), ("alibi", config.MOD_ALIBI),
                                     ("dropout", config.MOD_DROPOUT), ("softcap", config.MOD_SOFTCAP)) if name in mods)
    mask = {"mask": mask_random, "random": mask_random, "tiles": mask_tiles, "dead": mask_dead_rows}.get(bias)
    has_bias = bias is True or bias == "mask"
    bits |= (config.MOD_BIAS if has_bias else 0) | (config.MOD_MASK if mask else 0)
    kernel_causal = causal and not bits & config.MOD_WINDOW
    dtype = "bf16" if causal else "fp16"
    cfg = config.backward_kernel_config(128, dtype, kernel_causal, det, _compile.device_arch(), mods=bits)
    assert isinstance(cfg, config.BwdSm90WsConfig) and cfg.mods == bits, cfg
    b, sq, sk, hq, hkv = 2, 517, 304 if bias in ("random", "tiles") else 300, 4, 2
    run_bias(b, sq, sk, hq, hkv, 128, dtype, causal=causal, mods=mods, deterministic=det,
             bias_shape=(b, hq, sq, sk) if has_bias else None, mask=mask,
             padding="random" if bias == "dead" else None, scale_inputs=3.0 if "softcap" in mods else 1.0)


@pytest.mark.parametrize("case", ["bf16", "fp16+mask", "broadcast", "key-slice", "fp32", "unaligned-view"])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_staged_bias(d, case):
    """Head dims 32, 64 and 128 copy a 16-bit bias with contiguous, 16-byte aligned rows to
    shared memory, a step ahead into one of two buffers (200 keys: a key tail inside a tile, 130 queries: a query
    tail and three steps per query head, GQA 2:1: the next step's head differs; key-slice: 197 keys of 208-key rows,
    the last chunk of a row partly zero-filled); a float32 bias and a view whose rows are not 16-byte aligned take
    the element loads in the same kernel, and so does head dim 128 with a mask beside the bias. All against the
    float64 reference, dbias included."""
    from test_gpu_bias import check_dense, make_bias, mask_random

    b, sq, sk, hq, hkv = 2, 130, 197 if case == "key-slice" else 200, 4, 2
    dtype = "fp16" if case.startswith("fp16") else "bf16"
    seed = seed_of("bwd-ws-staged-bias", d, case)
    q, k, v, dout = (make_input(b, s, h, d, dtype, "bshd", "contiguous", seed + i)
                     for i, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv), (sq, hq))))
    shape = (1, hq, sq, sk) if case == "broadcast" else (b, hq, sq, sk)
    if case == "unaligned-view":  # keys 1 .. sk of a wider bias: rows start 2 bytes past a 16-byte boundary
        bias = make_bias((b, hq, sq, sk + 8), dtype, "q", seed + 4)[..., 1:sk + 1]
    elif case == "key-slice":  # keys 0 .. sk - 1 of 208-key rows: 16-byte aligned, a partial last chunk
        bias = make_bias((b, hq, sq, 208), dtype, "q", seed + 4)[..., :sk]
    else:
        bias = make_bias(shape, dtype, "fp32" if case == "fp32" else "q", seed + 4)
    mask = mask_random(b, hq, sq, sk, seed + 5) if case.endswith("mask") else None
    mods = config.MOD_BIAS | (config.MOD_MASK if mask is not None else 0)
    cfg = config.backward_kernel_config(d, dtype, False, False, _compile.device_arch(), mods=mods)
    assert isinstance(cfg, config.BwdSm90WsConfig) and cfg.head_dim == d, cfg
    assert config.bwd_stages_bias(cfg.head_dim, mods) == (d < 128 or mask is None), cfg
    check_dense(q, k, v, dout, dtype, f"staged bias d={d} {case}", bias=bias, mask=mask, seed=seed)
