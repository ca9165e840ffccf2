"""The plan cache of the public API (_plan.plans), on CPU: CuPy's allocation, stream and launch are faked
(tools/fake_cupy.py) and every launch's grid and params bytes are recorded.

The spec: a warm call (a plan replayed) launches exactly what the full path launches for the same arrays; a
plan is found only for the same shapes, strides, dtypes, devices and options (with their types); what
depends on addresses is checked on every call, so a misaligned input is still copied and a preallocated
output that overlaps an input is still rejected with the full path's message.
"""
from __future__ import annotations

import ctypes
import inspect
import sys
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _families, _fp8, _launch, _plan, _tma, api, config

TOOLS = Path(__file__).resolve().parents[1] / "tools"
if not (TOOLS / "fake_cupy.py").exists():  # pragma: no cover - an installed cuflash without tools/
    pytest.skip("tools/ is not part of this installation", allow_module_level=True)
sys.path.insert(0, str(TOOLS))
import fake_cupy as fc  # noqa: E402

F16, BF16, F32, I32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.int32)
BOOL = np.dtype(np.bool_)
A = fc.FakeArray


@pytest.fixture(autouse=True)
def fake_gpu(monkeypatch):
    fc.install(monkeypatch.setattr)
    fc.COUNTS.clear()
    fc.LAUNCHES.clear()
    fc.RECORD[0] = True
    yield
    fc.RECORD[0] = False
    fc.LAUNCHES.clear()


def launches_of(call, alloc_base):
    """(kernel, grid, params bytes) of each launch of call(), with allocations from alloc_base on."""
    fc.FakeArray._next = alloc_base
    fc.LAUNCHES.clear()
    result = call()
    return list(fc.LAUNCHES), result


def check_replay_equals_full_path(first, second):
    """first() makes the plan; second() (same signature, other arrays) replays it: its launches must equal
    those of second() on the full path (plans cleared), byte for byte."""
    _plan.plans.clear()
    first()
    assert len(_plan.plans) == 1, "the first call made no plan"
    fc.COUNTS.clear()
    replayed, _ = launches_of(second, 1 << 50)
    assert fc.COUNTS["getDevice"] == 1 and not fc.COUNTS["device switch"]
    _plan.plans.clear()
    full, _ = launches_of(second, 1 << 50)
    assert replayed and [(n, g) for n, g, _ in replayed] == [(n, g) for n, g, _ in full]
    for i, ((name, _, got), (_, _, want)) in enumerate(zip(replayed, full)):
        assert got == want, f"launch {i} ({name}): the replayed params differ from the full path's"


def qkv(b=2, sq=40, sk=72, h=4, hkv=2, d=64, dtype=F16, layout="bshd", **strides):
    def shape(s, n):
        return (b, s, n, d) if layout == "bshd" else (b, n, s, d)
    return (A(shape(sq, h), dtype, strides.get("q")), A(shape(sk, hkv), dtype, strides.get("k")),
            A(shape(sk, hkv), dtype, strides.get("v")))


def wide(shape, dtype=F16, pad=128):
    """A view of shape inside rows of pad more elements (non-contiguous, aligned strides)."""
    item = np.dtype(dtype).itemsize
    last = shape[-1] + pad
    strides, step = [], item * last
    strides.append(item)
    for n in reversed(shape[:-1]):
        strides.insert(0, step)
        step *= n
    return A(shape, dtype, tuple(strides))


# --- replay == full path -----------------------------------------------------------------------------------

FORWARD_CASES = {
    "bshd": dict(),
    "bhsd-causal-bf16": dict(dtype=BF16, layout="bhsd", opts=dict(causal=True, layout="bhsd")),
    "mqa-d128-scale": dict(h=8, hkv=1, d=128, opts=dict(softmax_scale=0.3)),
    "d72": dict(d=72, opts=dict(causal=True)),
}


@pytest.mark.parametrize("case", FORWARD_CASES, ids=list(FORWARD_CASES))
def test_forward_replay_launches_what_the_full_path_launches(case):
    kw = dict(FORWARD_CASES[case])
    opts = kw.pop("opts", {})
    a, b = qkv(**kw), qkv(**kw)
    check_replay_equals_full_path(lambda: cuflash.attention_forward(*a, **opts),
                                  lambda: cuflash.attention_forward(*b, **opts))


U8 = np.dtype(np.uint8)
FP8_CASES = {  # descales as arrays of each accepted shape, or None; out_dtype, causal, window, layout
    "none": dict(),
    "per-head-fp16": dict(desc=((2, 4), (2, 2), (2, 2)), opts=dict(causal=True, out_dtype="fp16")),
    "blocks-window-bhsd": dict(desc=((2, 4, 1), (2, 2, 1), (2, 2, 1)), layout="bhsd",
                               opts=dict(window=(8, 8), layout="bhsd")),
    "tensor-d128": dict(d=128, desc=((), (1,), ())),
}


@pytest.mark.parametrize("case", FP8_CASES, ids=list(FP8_CASES))
@pytest.mark.parametrize("fn", ["attention", "attention_forward"])
def test_fp8_replay_launches_what_the_full_path_launches(case, fn):
    """FP8 calls whose descales are arrays (or None) are planned: the replay's launch (tensor maps of the new q, k, v,
    the new descales' addresses, the new outputs) equals the full path's byte for byte."""
    kw = dict(FP8_CASES[case])
    opts, desc = kw.pop("opts", {}), kw.pop("desc", None)

    def args():
        q, k, v = qkv(dtype=U8, **kw)
        names = ("q_descale", "k_descale", "v_descale")
        return (q, k, v), ({} if desc is None else {n: A(shape, F32) for n, shape in zip(names, desc)})

    (a, da), (b, db) = args(), args()
    f = getattr(cuflash, fn)
    check_replay_equals_full_path(lambda: f(*a, **da, **opts), lambda: f(*b, **db, **opts))


@pytest.mark.parametrize("fn", ["attention", "attention_forward"])
def test_fp8_numbers_as_descales_are_planned_by_value(fn):
    """A descale given as a number enters the key by value: the same numbers replay the plan (the launch equals the
    full path's byte for byte, its one-element arrays of those values held by the plan even when the cache of such
    arrays is emptied), other numbers, or the same value as an int, make their own plans."""
    f = getattr(cuflash, fn)
    opts = dict(q_descale=0.5, k_descale=2, v_descale=None)
    check_replay_equals_full_path(lambda: f(*qkv(dtype=U8), **opts), lambda: f(*qkv(dtype=U8), **opts))
    plan = next(iter(_plan.plans._plans.values()))
    held = {x.data.ptr for x in plan.held}
    assert len(plan.held) == 3, "the arrays of 0.5, 2.0 and 1.0"
    _fp8._ONES.clear()  # their cache may drop them: the plan still holds the arrays its launch points at
    replayed, _ = launches_of(lambda: f(*qkv(dtype=U8), **opts), 1 << 50)
    params = _tma.FwdFp8Params.from_buffer_copy(replayed[0][2])
    assert {params.q_descale.ptr, params.k_descale.ptr, params.v_descale.ptr} == held
    q, k, v = qkv(dtype=U8)
    for other in (dict(opts, q_descale=0.25), dict(opts, k_descale=2.0), dict(opts, v_descale=1.0)):
        f(q, k, v, **other)
    assert len(_plan.plans) == 4, "each descale value (and its type) makes its own plan"


def test_fp8_descales_of_other_types_have_no_key():
    q, k, v = qkv(dtype=U8)
    for bad in (np.float32(0.5), True, [0.5]):
        assert api._FORWARD.key(q, k, v, False, None, "bshd", None, None, None, None, None, None, None, 0.0, None, 0,
                                False, bad, None, None, None) is None, bad


def _params(blob):
    """The params struct a forward launch passed: FwdWsParams (tensor maps, then FwdParams) or FwdParams."""
    if len(blob) == ctypes.sizeof(_tma.FwdWsParams):
        return _tma.FwdWsParams.from_buffer_copy(blob)
    return _launch.FwdParams.from_buffer_copy(blob)


@pytest.mark.parametrize("d", [64, 96], ids=["tma-kernel", "fwd_sm90_kernel"])
def test_attention_launches_the_forward_without_lse(d):
    """attention() (o only) launches attention_forward's kernel with lse = nullptr (the kernels then write no lse)
    and one allocation, on its full path and on replays; everything else in its launch is the forward's."""
    a, b = qkv(d=d), qkv(d=d)
    _plan.plans.clear()
    cuflash.attention(*a, causal=True)
    fc.COUNTS.clear()
    replayed, o = launches_of(lambda: cuflash.attention(*b, causal=True), 1 << 50)
    assert fc.COUNTS["empty"] == 1 and isinstance(o, fc.FakeArray) and o.shape == b[0].shape
    _plan.plans.clear()
    full_o, _ = launches_of(lambda: cuflash.attention(*b, causal=True), 1 << 50)
    assert replayed == full_o, "attention(): the replayed launch differs from the full path's"
    _plan.plans.clear()
    full, _ = launches_of(lambda: cuflash.attention_forward(*b, causal=True), 1 << 50)
    assert [(n, g) for n, g, _ in replayed] == [(n, g) for n, g, _ in full]
    got, want = (_params(x[0][2]) for x in (replayed, full))
    got_fwd, want_fwd = (getattr(x, "fwd", x) for x in (got, want))
    assert not got_fwd.lse and want_fwd.lse, "attention() must launch without lse, attention_forward with it"
    want_fwd.lse = None
    if hasattr(want, "fwd"):
        want.fwd = want_fwd
    assert bytes(got) == bytes(want)


def test_a_queued_forward_takes_the_queue_of_the_calls_stream(monkeypatch):
    """A persistent forward over work items of unequal cost (causal rows) takes its items from a work queue: two
    counters kept per (device, stream), which each launch leaves at zero. Launches on different streams may overlap,
    so the full path and every replay pass the queue of the call's own stream."""
    monkeypatch.setitem(config.FWD_SM90_WS_TILES_CAUSAL_PLAIN, 128, (128, 2, False, True))
    monkeypatch.setattr(_families, "_split_counters", {})
    _families._selected.clear()
    try:
        a, b = qkv(d=128, dtype=BF16), qkv(d=128, dtype=BF16)
        check_replay_equals_full_path(lambda: cuflash.attention_forward(*a, causal=True),
                                      lambda: cuflash.attention_forward(*b, causal=True))
        queues = []
        for stream in (0, 7, 0, 7):  # the first two replay the plan, the last two as well
            monkeypatch.setattr(fc._Stream, "ptr", stream)
            got, _ = launches_of(lambda: cuflash.attention_forward(*b, causal=True), 1 << 50)
            p = _params(got[0][2])
            assert "true>, true, 0>" in got[0][0], got[0][0]  # the persistent causal kernel
            assert p.queue and p.queue == _families._split_counters[(0, stream)].data.ptr
            queues.append(p.queue)
        assert queues[0] == queues[2] != queues[1] == queues[3]
        # the per-thread default stream: one handle, a stream per host thread, so a queue per (live) thread
        pts = _families.PER_THREAD_STREAM
        monkeypatch.setattr(fc._Stream, "ptr", pts)
        both = threading.Barrier(2)

        def queue_of_this_thread():
            _families._queue_ptr(0, pts)
            both.wait()  # both threads alive while they take theirs

        threads = [threading.Thread(target=queue_of_this_thread) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        per_thread = {k: buf for k, buf in _families._split_counters.items() if k[1] == pts}
        assert len(per_thread) == 2 and len({id(buf) for buf in per_thread.values()}) == 2, per_thread
        replayed, _ = launches_of(lambda: cuflash.attention_forward(*b, causal=True), 1 << 50)
        mine = _families._split_counters[(0, pts, threading.get_ident())]
        assert _params(replayed[0][2]).queue == mine.data.ptr and len(_families._split_counters) == 5
        # a causal call of the one-item-per-CTA kernel, and a persistent non-causal one (items of equal cost): no queue
        monkeypatch.setitem(config.FWD_SM90_WS_TILES_CAUSAL_PLAIN, 128, (128, 2, False))
        _families._selected.clear()
        _plan.plans.clear()
        got, _ = launches_of(lambda: cuflash.attention_forward(*b, causal=True), 1 << 50)
        assert not _params(got[0][2]).queue
        got, _ = launches_of(lambda: cuflash.attention_forward(*b), 1 << 50)  # 72 keys: the short-key kernel
        assert "true>, false, 0>" in got[0][0] and not _params(got[0][2]).queue
    finally:
        _families._selected.clear()
        _plan.plans.clear()


def test_tma_maps_follow_the_arrays():
    """A replay of the TMA kernel's plan encodes the tensor maps of the call's own arrays (a map holds its
    array's address): each launch's maps name the q, k, v it was called with."""
    _plan.plans.clear()
    calls = [qkv() for _ in range(3)]
    for q, k, v in calls:
        launches, _ = launches_of(lambda: cuflash.attention_forward(q, k, v), 1 << 50)
        params = _params(launches[0][2])
        assert [m.v[0] for m in (params.tma_q, params.tma_k, params.tma_v)] == [q.data.ptr, k.data.ptr, v.data.ptr]
    assert len(_plan.plans) == 1, "the three calls share one plan"


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_float32_forward_takes_the_tf32_kernel_with_float32_maps(precision):
    """float32 at head dim 64 on the faked sm_90a: fwd_sm90_tf32_kernel, its grid of 128-row query blocks, maps of the
    call's own arrays as float32 (CU_TENSOR_MAP_DATA_TYPE_FLOAT32) in boxes of 32 floats, 128-byte swizzle; a
    replay launches the same bytes as the full path, and a window keeps the kernel (its window flag)."""
    cfg = config.select("forward", 64, precision, False, "sm_90a")
    _plan.plans.clear()
    for _ in range(2):
        q, k, v = qkv(dtype=F32)
        launches, _ = launches_of(lambda: cuflash.attention_forward(q, k, v, precision=precision), 1 << 50)
        assert len(launches) == 1 and launches[0][0] == cfg.cpp_name() and "fwd_sm90_tf32_kernel" in launches[0][0]
        assert launches[0][1] == cfg.grid(2, 4, 40) == (1, 4, 2)
        params = _params(launches[0][2])
        for m, x, rows in ((params.tma_q, q, cfg.block_m), (params.tma_k, k, cfg.block_n), (params.tma_v, v, cfg.block_n)):
            # the fake encoder's words: address, dtype, rank, dims (4), strides (3), box (4), swizzle
            assert m.v[0] == x.data.ptr and m.v[1] == 7 and m.v[2] == 4
            assert list(m.v[10:14]) == [32, rows, 1, 1] and m.v[14] == 3, list(m.v)
        assert params.fwd.o and params.fwd.lse and params.fwd.head_dim == 64
    assert len(_plan.plans) == 1, "the two calls share one plan"
    check_replay_equals_full_path(lambda: cuflash.attention_forward(*qkv(dtype=F32), precision=precision),
                                  lambda: cuflash.attention_forward(*qkv(dtype=F32), precision=precision))
    launches, _ = launches_of(lambda: cuflash.attention_forward(*qkv(dtype=F32), precision=precision,
                                                                window=(8, 8)), 1 << 50)
    assert launches[0][0] == config.fwd_sm90_tf32_config(64, precision, False, True).cpp_name()


def backward_args(b=2, sq=40, sk=72, h=4, hkv=2, d=64, dtype=F16):
    q, k, v = qkv(b, sq, sk, h, hkv, d, dtype)
    return dict(dout=A(q.shape, dtype), q=q, k=k, v=v, out=A(q.shape, dtype), lse=A((b, h, sq), F32))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("prealloc", ["none", "dq", "all"])
def test_backward_replay_launches_what_the_full_path_launches(deterministic, prealloc):
    def call(a):
        grads = {}
        if prealloc != "none":
            grads["dq"] = A(a["q"].shape, F16)
        if prealloc == "all":
            grads["dk"], grads["dv"] = A(a["k"].shape, F16), A(a["v"].shape, F16)
        return lambda: cuflash.attention_backward(*a.values(), causal=True, deterministic=deterministic, **grads)

    check_replay_equals_full_path(call(backward_args()), call(backward_args()))


MOD_CASES = {  # score modifiers that a plan takes: values in the key, slopes bound, seed and offset written
    "window": dict(window=(16, 0)),
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi_slopes=(4,)),
    "alibi-batch": dict(alibi_slopes=(2, 4)),
    "dropout": dict(dropout_p=0.1, seed=(1, 7), offset=(0, 5)),
    "all": dict(window=(16, 8), softcap=20.0, alibi_slopes=(4,), dropout_p=0.2, seed=(3, 2**64 - 1),
                offset=(9, 2**32 - 1)),
}


BIAS_CASES = {  # (bias shape, its dtype, dbias): broadcast through size-1 dims or full; float32 or q's dtype
    "full": ((2, 4, 40, 72), F16, True),
    "pair-bias": ((2, 1, 4, 40, 72), F32, True),  # a 5-D pair bias: (batch, 1, heads, Sq, Sk), q folded to batch
    "key-row": ((2, 1, 1, 72), F16, True),
    "no-dbias": ((1, 4, 40, 72), F32, False),
}


@pytest.mark.parametrize("d", [64, 96], ids=["tma-kernel", "fwd_sm90_kernel"])
@pytest.mark.parametrize("case", BIAS_CASES, ids=list(BIAS_CASES))
def test_bias_calls_replay_what_the_full_path_launches(case, d):
    """A call with a bias makes a plan that binds each call's bias (and allocates each call's dbias, zeroed where
    the kernels add into it); the next call replays it with its full path's launches and allocations."""
    shape, dtype, dbias = BIAS_CASES[case]
    if len(shape) == 5:
        shape = shape[:1] + shape[2:]  # the fold: a bias of batch 2 for q's batch 2 (one row of each group)
    a, b = qkv(d=d), qkv(d=d)
    ga, gb = backward_args(d=d), backward_args(d=d)
    bias_a, bias_b = A(shape, dtype), A(shape, dtype)
    check_replay_equals_full_path(lambda: cuflash.attention_forward(*a, bias=bias_a),
                                  lambda: cuflash.attention_forward(*b, bias=bias_b))
    check_replay_equals_full_path(lambda: cuflash.attention(*a, bias=bias_a, window=(9, 0)),
                                  lambda: cuflash.attention(*b, bias=bias_b, window=(9, 0)))
    for causal in (False, True):
        check_replay_equals_full_path(
            lambda: cuflash.attention_backward(*ga.values(), bias=bias_a, dbias=dbias, causal=causal),
            lambda: cuflash.attention_backward(*gb.values(), bias=bias_b, dbias=dbias, causal=causal))
    # the allocations of a replayed call are the full path's: dbias zeroed where the kernels add into it
    for causal in (False, True):
        _plan.plans.clear()
        counts = []
        for _ in range(2):  # the full path, then the replay
            fc.COUNTS.clear()
            out = cuflash.attention_backward(*gb.values(), bias=bias_b, dbias=dbias, causal=causal)
            counts.append((fc.COUNTS["zeros"], fc.COUNTS["empty"]))
            assert len(out) == (4 if dbias else 3) and (not dbias or out[3].shape == shape)
        assert counts[0] == counts[1], f"causal={causal}: allocations (zeros, empty) {counts}"
        full_shape = len(shape) == 4 and shape[:2] == (2, 4)
        assert counts[0][0] == (1 if dbias and (causal or not full_shape) else 0), counts


MASK_CASES = {  # the mask arguments of a call: a bool mask broadcast to the scores, a key_padding_mask, with a bias
    "mask": dict(mask=((2, 1, 40, 72), BOOL)),
    "mask-2d": dict(mask=((40, 72), BOOL)),
    "key-padding": dict(key_padding_mask=((2, 72), BOOL)),
    "pair-bias+key-padding": dict(bias=((2, 4, 40, 72), F16), key_padding_mask=((2, 72), BOOL)),
    # both masks: their intersection is made per call, as the full path makes it (the same allocations)
    "mask+key-padding": dict(mask=((2, 1, 40, 72), BOOL), key_padding_mask=((2, 72), BOOL)),
    "mask-2d+key-padding": dict(mask=((40, 72), BOOL), key_padding_mask=((2, 72), BOOL)),
    "mask-of-batch-1+key-padding": dict(mask=((1, 4, 40, 72), BOOL), key_padding_mask=((2, 72), BOOL)),
}


def _arrays_of(kw):
    return {name: A(shape, dtype) for name, (shape, dtype) in kw.items()}


@pytest.mark.parametrize("d", [64, 96], ids=["tma-kernel", "fwd_sm90_kernel"])
@pytest.mark.parametrize("case", MASK_CASES, ids=list(MASK_CASES))
def test_mask_calls_replay_what_the_full_path_launches(case, d):
    """One boolean mask (or a key_padding_mask) is an array of the plan: each call's address is bound; with both, the
    plan makes their intersection on every call, its address in the launch."""
    first, second = _arrays_of(MASK_CASES[case]), _arrays_of(MASK_CASES[case])
    a, b = qkv(d=d), qkv(d=d)
    ga, gb = backward_args(d=d), backward_args(d=d)
    check_replay_equals_full_path(lambda: cuflash.attention_forward(*a, **first),
                                  lambda: cuflash.attention_forward(*b, **second))
    check_replay_equals_full_path(lambda: cuflash.attention(*a, causal=True, **first),
                                  lambda: cuflash.attention(*b, causal=True, **second))
    dbias = {"dbias": True} if "bias" in first else {}
    check_replay_equals_full_path(lambda: cuflash.attention_backward(*ga.values(), **first, **dbias),
                                  lambda: cuflash.attention_backward(*gb.values(), **second, **dbias))


def test_a_warm_call_with_both_masks_makes_their_intersection_only():
    masks = dict(mask=A((2, 1, 40, 72), BOOL), key_padding_mask=A((2, 72), BOOL))
    q, k, v = qkv()
    cuflash.attention_forward(q, k, v, **masks)
    fc.COUNTS.clear()
    cuflash.attention_forward(q, k, v, **masks)
    assert fc.COUNTS["logical_and"] == 1 and fc.COUNTS["encode"] == 0 and fc.COUNTS["empty"] == 2, fc.COUNTS


@pytest.mark.parametrize("dtype,maps", [(F16, (1, 1)), (F32, (1, 2))], ids=["fp16", "fp32"])
def test_a_warm_call_with_a_key_padding_mask_makes_its_tile_maps_per_call(dtype, maps):
    """A key_padding_mask alone: the kernels that read tile maps (on sm_90a the warp-specialized forward and backward,
    in float32 the TF32 forward, dK / dV and dQ kernels) get a map made from the mask on every call, one small launch
    per kernel tile shape, on the full path and in the replay alike; beside a mask (their intersection), none; and
    none where the keys fit one key tile (16 keys)."""
    kpm = A((2, 600), BOOL)
    q, k, v = qkv(sk=600, dtype=dtype)
    ga = backward_args(sk=600, dtype=dtype)
    for i, call in enumerate((lambda m: cuflash.attention_forward(q, k, v, **m),
                              lambda m: cuflash.attention_backward(*ga.values(), **m))):
        _plan.plans.clear()
        for replay in (False, True):
            launched, _ = launches_of(lambda: call({"key_padding_mask": kpm}), 1 << 50)
            names = [n for n, _, _ in launched]
            assert sum("padding_tiles_kernel" in n for n in names) == maps[i], (i, replay, names)
        # the replay's launches (maps included, made per call into their own allocations) are the full path's
        other = (qkv(sk=600, dtype=dtype), backward_args(sk=600, dtype=dtype))[i]
        second = (lambda: cuflash.attention_forward(*other, key_padding_mask=A((2, 600), BOOL)),
                  lambda: cuflash.attention_backward(*other.values(), key_padding_mask=A((2, 600), BOOL)))[i]
        check_replay_equals_full_path(lambda: call({"key_padding_mask": kpm}), second)
        both = {"mask": A((2, 1, 40, 600), BOOL), "key_padding_mask": kpm}
        call(both)
        fc.COUNTS.clear()
        launched, _ = launches_of(lambda: call(both), 1 << 50)
        assert not any("padding_tiles_kernel" in n for n, _, _ in launched) and fc.COUNTS["logical_and"] == 1
    if dtype == F32:  # 100 keys: one key tile of the dK / dV kernel (128 keys), several of the dQ kernel's
        mid, other = backward_args(sk=100, dtype=dtype), backward_args(sk=100, dtype=dtype)
        for replay in (False, True):
            launched, _ = launches_of(lambda: cuflash.attention_backward(*mid.values(),
                                                                         key_padding_mask=A((2, 100), BOOL)), 1 << 50)
            assert sum("padding_tiles_kernel" in n for n, _, _ in launched) == 1, (replay, launched)
        check_replay_equals_full_path(
            lambda: cuflash.attention_backward(*mid.values(), key_padding_mask=A((2, 100), BOOL)),
            lambda: cuflash.attention_backward(*other.values(), key_padding_mask=A((2, 100), BOOL)))
    short = qkv(sk=16, dtype=dtype)  # one key tile of every kernel
    launched, _ = launches_of(lambda: cuflash.attention_forward(*short, key_padding_mask=A((2, 16), BOOL)), 1 << 50)
    assert not any("padding_tiles_kernel" in n for n, _, _ in launched)


@pytest.mark.parametrize("aligned", [True, False], ids=["tile-skipping", "mask-kernels"])
def test_blockmask_calls_replay_for_that_blockmask_only(aligned):
    """A BlockMask enters the key by identity: a second call with the same BlockMask replays the full path's launch
    byte for byte (its mask and tile maps as the first call found them); another BlockMask of the same shape makes
    its own plan, and a plan never replays for an object that is not its BlockMask (a guard, not the key alone:
    an id can be reused once the first one is gone)."""
    bm, other = (fc.block_mask((2, 1, 40, 72), aligned) for _ in range(2))
    ga, gb = backward_args(), backward_args()
    check_replay_equals_full_path(lambda: cuflash.attention_forward(*qkv(), mask=bm),
                                  lambda: cuflash.attention_forward(*qkv(), mask=bm))
    check_replay_equals_full_path(lambda: cuflash.attention_backward(*ga.values(), mask=bm),
                                  lambda: cuflash.attention_backward(*gb.values(), mask=bm))
    check_replay_equals_full_path(lambda: cuflash.attention(*qkv(), mask=bm, key_padding_mask=A((2, 72), BOOL)),
                                  lambda: cuflash.attention(*qkv(), mask=bm, key_padding_mask=A((2, 72), BOOL)))
    _plan.plans.clear()
    q, k, v = qkv()
    cuflash.attention_forward(q, k, v, mask=bm)
    cuflash.attention_forward(q, k, v, mask=other)
    assert len(_plan.plans) == 2
    plan = _plan.plans.get(api._FORWARD.key(q, k, v, False, None, "bshd", None, None, None, None, None, bm, None, 0.0,
                                            None, 0, False, None, None, None, None))
    arrays = (q, k, v, None, None, bm, None, None, None, None)
    assert _plan.replay(plan, arrays, (None, 0)) is not None
    assert _plan.replay(plan, arrays[:5] + (other,) + arrays[6:], (None, 0)) is None, "replayed for another object"
    with pytest.raises(AttributeError):
        bm.mask = A((2, 1, 40, 72), BOOL)  # (the mask a BlockMask stands for does not change)
    assert api._FORWARD.key(q, k, v, False, None, "bshd", None, None, None, None, None, object(), None, 0.0, None, 0,
                            False, None, None, None, None) is None, "a mask that is neither array nor BlockMask"


def test_an_exclusive_group_gives_no_key_when_two_of_it_are_given():
    """Signature's `exclusive` groups: a call with two arguments of one group gets no key, with one or none it
    gets one; a group must name two or more of the signature's parameters."""
    sig = _plan.Signature("f", (("x", _plan.OPTIONAL_ARRAY), ("y", _plan.OPTIONAL_ARRAY), ("z", _plan.OPTION)),
                          exclusive=(("x", "y"),))
    a, b = A((4,), np.float32), A((4,), np.float32)
    assert sig.key(a, b, 1) is None
    assert sig.key(a, None, 1) is not None and sig.key(None, b, 1) is not None and sig.key(None, None, 1) is not None
    assert sig.key(a, None, 1) != sig.key(None, b, 1)
    for bad in ((("x",),), (("x", "w"),)):
        with pytest.raises(ValueError, match="exclusive group"):
            _plan.Signature("f", (("x", _plan.OPTIONAL_ARRAY), ("y", _plan.OPTIONAL_ARRAY)), exclusive=bad)


def packed(lens_q=(5, 0, 12), lens_k=(9, 4, 7), h=4, hkv=2, d=64, dtype=F16):
    """Packed q, k, v and their cu_seqlens (int32) for sequences of these lengths."""
    tq, tk = sum(lens_q), sum(lens_k)
    return (A((tq, h, d), dtype), A((tk, hkv, d), dtype), A((tk, hkv, d), dtype), A((len(lens_q) + 1,), I32),
            A((len(lens_k) + 1,), I32), max(lens_q), max(lens_k))


VARLEN_CASES = {
    "plain": dict(),
    "both-masks": dict(opts=dict(mask="mask", key_padding_mask="kpm")),
    "causal-bf16-d128": dict(args=dict(dtype=BF16, d=128), opts=dict(causal=True)),
    "window-alibi": dict(opts=dict(window=(3, 0), alibi_slopes="slopes")),
    "d72-dropout": dict(args=dict(d=72), opts=dict(dropout_p=0.2, seed=5)),
}


@pytest.mark.parametrize("case", VARLEN_CASES, ids=list(VARLEN_CASES))
def test_varlen_forward_replays_what_the_full_path_launches(case):
    """attention_varlen_forward and attention_varlen replay a plan: cu_seqlens are arrays of it (their addresses
    bound per call), max_seqlen_q / max_seqlen_k and check_inputs enter the key by value."""
    kw = VARLEN_CASES[case]
    first, second = packed(**kw.get("args", {})), packed(**kw.get("args", {}))
    def opts():  # (a fresh slopes array for each call)
        o = dict(kw.get("opts", {}), check_inputs=False)
        if o.get("alibi_slopes") == "slopes":
            o["alibi_slopes"] = A((4,), F32)
        if "mask" in o:  # scores (3, 4, 12, 9)
            o.update(mask=A((3, 1, 12, 9), BOOL), key_padding_mask=A((3, 9), BOOL))
        return o
    for fn in (cuflash.attention_varlen_forward, cuflash.attention_varlen):
        check_replay_equals_full_path(lambda: fn(*first, **opts()), lambda: fn(*second, **opts()))


@pytest.mark.parametrize("descales", [False, True], ids=["descales-none", "descale-arrays"])
@pytest.mark.parametrize("fn", ["attention_varlen", "attention_varlen_forward"])
def test_fp8_varlen_replays_what_the_full_path_launches(fn, descales):
    """Packed FP8 sequences: cu_seqlens and the descale arrays are arrays of the plan, bound per call."""
    def call(p):
        q, k, v, cu_q, cu_k, mq, mk = p
        d = {} if not descales else dict(q_descale=A((3, 4), F32), k_descale=A((3, 2, 1), F32), v_descale=A((), F32))
        return getattr(cuflash, fn)(q, k, v, cu_q, cu_k, mq, mk, check_inputs=False, causal=True, **d)
    first, second = packed(dtype=U8, d=128), packed(dtype=U8, d=128)
    check_replay_equals_full_path(lambda: call(first), lambda: call(second))


@pytest.mark.parametrize("case", ["plain", "deterministic-bf16-d128", "prealloc-dq-alibi", "bias-masks"])
def test_varlen_backward_replays_what_the_full_path_launches(case):
    args = dict(dtype=BF16, d=128) if "d128" in case else {}
    def call(p):
        q, k, v, cu_q, cu_k, mq, mk = p
        dout, out, lse = A(q.shape, q.dtype), A(q.shape, q.dtype), A((q.shape[1], q.shape[0]), F32)
        kw = dict(check_inputs=False, causal=True, deterministic="deterministic" in case)
        if "prealloc" in case:
            kw.update(dq=A(q.shape, q.dtype), alibi_slopes=A((q.shape[1],), F32))
        if "bias-masks" in case:  # a preallocated dbias and both masks (made per call) of scores (3, 4, 12, 9)
            kw.update(bias=A((1, 4, mq, mk), q.dtype), dbias=A((1, 4, mq, mk), F32), mask=A((mq, mk), BOOL),
                      key_padding_mask=A((3, mk), BOOL))
        return cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, **kw)
    first, second = packed(**args), packed(**args)
    check_replay_equals_full_path(lambda: call(first), lambda: call(second))


def test_a_warm_varlen_call_checks_cu_seqlens_values_when_asked(monkeypatch):
    """check_inputs=True reads cu_seqlens back on every call, planned or not; a bad value raises on a warm call as
    on the first; check_inputs=False reads nothing."""
    from cuflash import _validate

    seen = []
    real = _validate.check_cu_seqlens_values
    monkeypatch.setattr(_validate, "check_cu_seqlens_values",
                        lambda *args: seen.append(args[2:]) or real(np.array([0, 5, 5, 17]), np.array([0, 9, 13, 20]),
                                                                     *args[2:]))
    _plan.plans.clear()
    args = packed()
    for _ in range(3):
        cuflash.attention_varlen_forward(*args)
    assert len(_plan.plans) == 1 and len(seen) == 3 and seen[-1] == (17, 20, 12, 9)
    monkeypatch.setattr(_validate, "check_cu_seqlens_values", lambda *args: real(np.array([0, 5, 5, 16]),
                                                                                  np.array([0, 9, 13, 20]), *args[2:]))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        cuflash.attention_varlen_forward(*args)
    seen.clear()
    monkeypatch.setattr(_validate, "check_cu_seqlens_values", lambda *args: seen.append(args))
    cuflash.attention_varlen_forward(*args, check_inputs=False)
    cuflash.attention_varlen_forward(*args, check_inputs=False)
    assert not seen and len(_plan.plans) == 2


@pytest.mark.parametrize("shape,causal", [((2, 4, 40, 72), False), ((2, 4, 40, 72), True), ((1, 4, 40, 72), False)],
                         ids=["full-stored", "full-causal", "pair-summed"])
def test_a_preallocated_dbias_is_an_array_of_the_plan(shape, causal):
    """A preallocated dbias is bound per call and returned; it is filled with zeros first exactly where the full path
    fills it (the kernels add into it, or store only where some pair is visible), and a warm call whose dbias
    overlaps an input raises the full path's error."""
    bias_a, bias_b = A(shape, F16), A(shape, F16)
    ga, gb = backward_args(), backward_args()
    db_a, db_b = A(shape, F32), A(shape, F32)
    kw = dict(causal=causal)
    check_replay_equals_full_path(lambda: cuflash.attention_backward(*ga.values(), bias=bias_a, dbias=db_a, **kw),
                                  lambda: cuflash.attention_backward(*gb.values(), bias=bias_b, dbias=db_b, **kw))
    fills = []
    for _ in range(2):  # the replay, then the full path
        fc.COUNTS.clear()
        out = cuflash.attention_backward(*gb.values(), bias=bias_b, dbias=db_b, causal=causal)
        assert out[3] is db_b and fc.COUNTS["zeros"] == 0
        fills.append(fc.COUNTS["fill"])
        _plan.plans.clear()
    assert fills[0] == fills[1] == (0 if shape[0] == 2 and not causal else 1), fills
    cuflash.attention_backward(*gb.values(), bias=bias_b, dbias=db_b, causal=causal)  # the plan again
    assert len(_plan.plans) == 1
    over = A(shape, F32, ptr=bias_b.data.ptr)  # dbias over the bias's memory
    with pytest.raises(ValueError, match="dbias .preallocated. overlaps the memory of bias"):
        cuflash.attention_backward(*gb.values(), bias=bias_b, dbias=over, causal=causal)


def _mod_kwargs(case, call):
    """The keywords of MOD_CASES[case] for call 0 or 1: slopes a new float32 array per call, (a, b) pairs of seeds
    and offsets taken per call."""
    kw = {}
    for name, value in MOD_CASES[case].items():
        if name == "alibi_slopes":
            kw[name] = A(value, F32)
        elif name in ("seed", "offset"):
            kw[name] = value[call]
        else:
            kw[name] = value
    return kw


@pytest.mark.parametrize("d", [64, 96], ids=["tma-kernel", "fwd_sm90_kernel"])
@pytest.mark.parametrize("case", MOD_CASES, ids=list(MOD_CASES))
def test_modifier_calls_replay_what_the_full_path_launches(case, d):
    """A call with a window, softcap, ALiBi or dropout makes a plan; the next call (new arrays, slopes, seed and
    offset) replays it with the launches of its own full path, byte for byte."""
    first, second = (_mod_kwargs(case, i) for i in (0, 1))
    a, b = qkv(d=d), qkv(d=d)
    ga, gb = backward_args(d=d), backward_args(d=d)
    dqa, dqb = A(ga["q"].shape, F16), A(gb["q"].shape, F16)
    check_replay_equals_full_path(lambda: cuflash.attention_forward(*a, **first),
                                  lambda: cuflash.attention_forward(*b, **second))
    check_replay_equals_full_path(lambda: cuflash.attention(*a, causal=True, **first),
                                  lambda: cuflash.attention(*b, causal=True, **second))
    check_replay_equals_full_path(lambda: cuflash.attention_backward(*ga.values(), **first),
                                  lambda: cuflash.attention_backward(*gb.values(), **second))
    check_replay_equals_full_path(
        lambda: cuflash.attention_backward(*ga.values(), dq=dqa, deterministic=True, **first),
        lambda: cuflash.attention_backward(*gb.values(), dq=dqb, deterministic=True, **second))


def test_a_modifier_plan_writes_each_calls_seed_offset_and_slopes():
    q, k, v = qkv()
    _plan.plans.clear()
    for seed, offset in ((1, 0), (2**63 + 5, 17), (0, 2**32 - 1)):
        slopes = A((4,), F32)
        fc.LAUNCHES.clear()
        cuflash.attention_forward(q, k, v, alibi_slopes=slopes, dropout_p=0.25, seed=seed, offset=offset)
        m = _params(fc.LAUNCHES[-1][2])
        m = getattr(m, "fwd", m).mods
        assert (m.seed, m.dropout_offset, m.alibi_slopes) == (seed, offset, slopes.data.ptr)
    assert len(_plan.plans) == 1, "one plan for the calls of one signature"


def test_a_warm_call_checks_its_seed_and_offset():
    """The seed and offset are not in the key by value: each warm call checks them as the full path does."""
    q, k, v = qkv()
    ok = dict(dropout_p=0.1, seed=5, offset=0)
    cuflash.attention_forward(q, k, v, **ok)
    for bad, err, msg in ((dict(seed=-1), ValueError, "seed=-1 is out of range"),
                          (dict(seed=2**64), ValueError, "is out of range"),
                          (dict(offset=-3), ValueError, "offset=-3 is out of range"),
                          (dict(offset=2**32), ValueError, "is out of range"),
                          (dict(seed=True), TypeError, "seed=True must be an int"),
                          (dict(offset=1.0), TypeError, "offset=1.0 must be an int")):
        with pytest.raises(err, match=msg):
            cuflash.attention_forward(q, k, v, **{**ok, **bad})
    # without dropout the seed is checked all the same (the plan of a call without modifiers)
    cuflash.attention_forward(q, k, v, seed=5)
    with pytest.raises(ValueError, match="seed=-1 is out of range"):
        cuflash.attention_forward(q, k, v, seed=-1)
    # a NumPy integer seed is an int of another type: the full path takes it, launching what an int gives
    fc.LAUNCHES.clear()
    cuflash.attention_forward(q, k, v, **{**ok, "seed": np.uint64(2**64 - 2)})
    m = _params(fc.LAUNCHES[-1][2])
    assert getattr(m, "fwd", m).mods.seed == 2**64 - 2


def test_a_window_given_as_a_list_is_not_planned():
    q, k, v = qkv()
    _plan.plans.clear()
    o = cuflash.attention_forward(q, k, v, window=[8, 8])
    assert len(_plan.plans) == 0 and o[0].shape == q.shape
    cuflash.attention_forward(q, k, v, window=(8, 8))
    fc.LAUNCHES.clear()
    cuflash.attention_forward(q, k, v, window=[8, 8])  # (the tuple's plan is not found: a list is unhashable)
    assert len(_plan.plans) == 1 and len(fc.LAUNCHES) == 1


def test_a_gradient_overlapping_the_alibi_slopes_is_rejected_warm_or_not():
    args = backward_args()
    slopes = A((4,), F32)
    cuflash.attention_backward(*args.values(), dq=A(args["q"].shape, F16), alibi_slopes=A((4,), F32))
    dq = A(args["q"].shape, F16)
    dq.data.ptr = slopes.data.ptr  # dq's memory starts at the slopes'
    for _ in range(2):
        with pytest.raises(ValueError, match="dq \\(preallocated\\) overlaps the memory of alibi_slopes"):
            cuflash.attention_backward(*args.values(), dq=dq, alibi_slopes=slopes)


def test_backward_tma_maps_follow_the_arrays():
    """The warp-specialized backward (head dim 64 on the faked sm_90a): each call's main launch, replayed or not,
    carries maps of its own q, dout, k, v and the same addresses in its BwdParams copy; the preprocess and dQ
    conversion launches take plain BwdParams with the same pointers (dq, the workspace)."""
    _plan.plans.clear()
    for _ in range(3):
        a = backward_args()
        launches, (dq, dk, dv) = launches_of(lambda: cuflash.attention_backward(*a.values(), causal=True), 1 << 50)
        names = [n for n, _, _ in launches]
        assert "bwd_sm90_ws_kernel" in names[1] and "bwd_convert_dq_ws_kernel" in names[2], names
        ws = _tma.BwdWsParams.from_buffer_copy(launches[1][2])
        assert [m.v[0] for m in (ws.tma_q, ws.tma_do, ws.tma_k, ws.tma_v)] == \
            [a["q"].data.ptr, a["dout"].data.ptr, a["k"].data.ptr, a["v"].data.ptr]
        assert (ws.bwd.q, ws.bwd.dout, ws.bwd.k, ws.bwd.v) == \
            (a["q"].data.ptr, a["dout"].data.ptr, a["k"].data.ptr, a["v"].data.ptr)
        plain = _launch.BwdParams.from_buffer_copy(launches[2][2])
        assert (ws.bwd.dq, ws.bwd.dk, ws.bwd.dv) == (plain.dq, plain.dk, plain.dv) == \
            (dq.data.ptr, dk.data.ptr, dv.data.ptr)
        assert ws.bwd.dq_accum == plain.dq_accum and ws.bwd.lse_log2 == plain.lse_log2 and ws.bwd.dq_accum
    assert len(_plan.plans) == 1, "the three calls share one plan"


@pytest.mark.parametrize("d", [256, 200, 192])
def test_wide_head_backward_takes_tma_maps_of_its_panels(d):
    """The wide-head backward (bwd_sm90_split_kernel, kernel head dims 192 and 256; 200 runs the 256 kernel on the
    faked sm_90a) reads Q, dO, K, V through TMA: its launch carries BwdWsParams with maps of the call's own arrays,
    each over the call's head dim (columns past it read as zeros) in boxes of one panel (64 columns at 256, 32 at 192)
    by 64 rows, and its BwdParams copy holds the same pointers as the conversion's; a replay launches the same bytes
    as the full path."""
    main = config.select("backward", config.kernel_head_dim(d), "fp16", True, "sm_90a")
    assert isinstance(main, config.BwdSm90SplitConfig) and main.box_cols == (32 if main.head_dim == 192 else 64)
    _plan.plans.clear()
    for _ in range(2):
        a = backward_args(d=d)
        launches, (dq, dk, dv) = launches_of(lambda: cuflash.attention_backward(*a.values(), causal=True), 1 << 50)
        names = [n for n, _, _ in launches]
        assert names[1] == main.cpp_name() and "bwd_convert_dq_ws_kernel" in names[2], names
        assert len(launches[1][2]) == ctypes.sizeof(_tma.BwdWsParams)
        ws = _tma.BwdWsParams.from_buffer_copy(launches[1][2])
        for m, x in ((ws.tma_q, a["q"]), (ws.tma_do, a["dout"]), (ws.tma_k, a["k"]), (ws.tma_v, a["v"])):
            # words: address, dtype, rank, dims (head_dim, seqlen, heads, batch), 3 strides, box, the swizzle's enum
            # (CU_TENSOR_MAP_SWIZZLE_128B = 3 for 64-column boxes, _64B = 2 for 32-column ones)
            assert m.v[0] == x.data.ptr and m.v[2] == 4 and m.v[3] == d, list(m.v)
            assert list(m.v[10:14]) == [main.box_cols, 64, 1, 1], list(m.v)
            assert m.v[14] == {64: 3, 32: 2}[main.box_cols], list(m.v)
        plain = _launch.BwdParams.from_buffer_copy(launches[2][2])
        assert (ws.bwd.dq, ws.bwd.dk, ws.bwd.dv) == (plain.dq, plain.dk, plain.dv) == \
            (dq.data.ptr, dk.data.ptr, dv.data.ptr)
        assert ws.bwd.dq_accum == plain.dq_accum and ws.bwd.dq_accum and ws.bwd.head_dim == d
    assert len(_plan.plans) == 1, "the two calls share one plan"

    def call():
        a = backward_args(d=d)
        return lambda: cuflash.attention_backward(*a.values(), causal=True)

    check_replay_equals_full_path(call(), call())


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_float32_backward_takes_the_tf32_kernels_with_their_own_maps(precision):
    """float32 at head dim 64 on the faked sm_90a: the preprocess, bwd_sm90_tf32_kernel (grid of 128-key blocks per
    K/V head) and bwd_dq_sm90_tf32_kernel (grid of query blocks per head), each with float32 maps of the call's own
    q, dout, k, v in its own boxes; no dQ accumulator (dQ is the dQ kernel's output) and no conversion launch; a
    replay launches the same bytes as the full path."""
    main = config.select("backward", 64, precision, True, "sm_90a")
    dqc = main.dq_config()
    _plan.plans.clear()
    for _ in range(2):
        a = backward_args(dtype=F32)
        launches, (dq, dk, dv) = launches_of(
            lambda: cuflash.attention_backward(*a.values(), causal=True, precision=precision), 1 << 50)
        names = [n for n, _, _ in launches]
        assert len(names) == 3 and "preprocess" in names[0] and names[1:] == [main.cpp_name(), dqc.cpp_name()], names
        assert launches[1][1] == main.grid(2, 2, 72) == (1, 2, 2) and launches[2][1] == dqc.grid(2, 4, 40)
        for blob, cfg in ((launches[1][2], main), (launches[2][2], dqc)):
            ws = _tma.BwdWsParams.from_buffer_copy(blob)
            for m, x, rows in ((ws.tma_q, a["q"], cfg.block_m), (ws.tma_do, a["dout"], cfg.block_m),
                               (ws.tma_k, a["k"], cfg.block_n), (ws.tma_v, a["v"], cfg.block_n)):
                assert m.v[0] == x.data.ptr and m.v[1] == 7 and list(m.v[10:14]) == [32, rows, 1, 1], list(m.v)
            assert (ws.bwd.dq, ws.bwd.dk, ws.bwd.dv) == (dq.data.ptr, dk.data.ptr, dv.data.ptr)
            assert not ws.bwd.dq_accum and ws.bwd.lse_log2 and ws.bwd.delta
    assert len(_plan.plans) == 1, "the two calls share one plan"

    def call():
        a = backward_args(dtype=F32)
        return lambda: cuflash.attention_backward(*a.values(), causal=True, precision=precision)

    check_replay_equals_full_path(call(), call())

def kvcache_args(b=2, s_cache=4096, h=8, hkv=2, d=128, s_new=0, paged=False, lens="array"):
    q = A((b, 1, h, d), F16)
    if paged:
        kc, vc = A((64, 256, hkv, d), F16), A((64, 256, hkv, d), F16)
        table = A((b, 16), I32)
        table.host = np.arange(b * 16, dtype=np.int32).reshape(b, 16) % 64
    else:
        kc, vc, table = A((b, s_cache, hkv, d), F16), A((b, s_cache, hkv, d), F16), None
    kw = dict(block_table=table)
    if s_new:
        kw["k"], kw["v"] = A((b, s_new, hkv, d), F16), A((b, s_new, hkv, d), F16)
    if lens == "array":
        kw["cache_seqlens"] = A((b,), I32)
        kw["cache_seqlens"].host = np.arange(b, dtype=np.int32) * 100 + 7
    elif lens == "int":
        kw["cache_seqlens"] = 1000
    return (q, kc, vc), kw


KVCACHE_CASES = {
    "dense-lens-array": dict(),
    "dense-int-lens": dict(lens="int"),
    "dense-full-cache": dict(lens=None),
    "append": dict(s_new=3, opts=dict(causal=True)),
    "paged-append": dict(paged=True, s_new=2),
    "split-forced": dict(opts=dict(num_splits=5, return_lse=True)),
    "checked-inputs": dict(paged=True, opts=dict(check_inputs=True)),
    "checked-int": dict(lens="int", opts=dict(check_inputs=True)),
    # the rotary embedding (the append launch writes q's rotated copy, a new array per call, for the decode),
    # the index arrays and the modifiers a plan takes (a window goes the full path)
    "rotary": dict(s_new=1, opts=dict(causal=True, rotary_cos=(4096, 32), rotary_sin=(4096, 32))),
    "rotary-paged-neox": dict(paged=True, s_new=2, opts=dict(rotary_cos=(4096, 64), rotary_sin=(4096, 64),
                                                            rotary_interleaved=False)),
    "indices": dict(s_new=1, opts=dict(cache_batch_idx=(2,), cache_leftpad=(2,))),
    "alibi-softcap": dict(opts=dict(alibi_slopes=(8,), softcap=30.0)),
    "window": dict(opts=dict(window=(1000, 0))),
    "window-append-alibi": dict(s_new=3, opts=dict(window=(100, 0), alibi_slopes=(2, 8))),
}


def _option_arrays(opts):
    """Fake arrays for the options given as shapes: float32 tables and slopes, int32 index arrays."""
    ints = ("cache_batch_idx", "cache_leftpad")
    return {n: A(v, I32 if n in ints else F32) if isinstance(v, tuple) and n != "window" else v
            for n, v in opts.items()}


@pytest.mark.parametrize("case", KVCACHE_CASES, ids=list(KVCACHE_CASES))
def test_kvcache_replay_launches_what_the_full_path_launches(case):
    kw = dict(KVCACHE_CASES[case])
    opts = dict(check_inputs=False)
    opts.update(_option_arrays(kw.pop("opts", {})))
    (a, ka), (b, kb) = kvcache_args(**kw), kvcache_args(**kw)
    check_replay_equals_full_path(lambda: cuflash.attention_with_kvcache(*a, **ka, **opts),
                                  lambda: cuflash.attention_with_kvcache(*b, **kb, **opts))


def test_kvcache_replay_without_splits_after_a_call_with_them():
    """A plan's calls reuse their thread's argument block; a call that needs no split-KV (short caches) after
    one that did must launch without the split workspace's pointers, as the full path does."""
    (a, ka), (b, kb) = kvcache_args(), kvcache_args()
    ka["cache_seqlens"].host = np.array([4000, 3000], dtype=np.int32)  # 4 CTAs over 63 key tiles: split
    kb["cache_seqlens"].host = np.array([50, 60], dtype=np.int32)      # one key tile: no split

    def long():
        return cuflash.attention_with_kvcache(*a, **ka, check_inputs=True)

    def short():
        return cuflash.attention_with_kvcache(*b, **kb, check_inputs=True)

    _plan.plans.clear()
    long(), long()  # the plan, then a replay that fills this thread's block with the split workspace
    assert len(_plan.plans) == 1
    replayed, _ = launches_of(short, 1 << 50)
    _plan.plans.clear()
    full, _ = launches_of(short, 1 << 50)
    assert len(replayed) == len(full) == 1 and replayed[0][2] == full[0][2]
    p = _launch.FwdParams.from_buffer_copy(replayed[0][2])
    assert p.num_splits == 1 and not (p.o_accum or p.lse_accum or p.split_counters)


def test_kvcache_int_lens_enter_the_key_by_type_and_are_written_per_call():
    """A decode loop passing the position as an int replays one plan; each call launches with its own count."""
    (a, kw) = kvcache_args(lens="int")
    for n in (10, 11, 3000):
        kw["cache_seqlens"] = n
        fc.LAUNCHES.clear()
        cuflash.attention_with_kvcache(*a, **kw, check_inputs=False)
        seq = _launch.FwdParams.from_buffer_copy(fc.LAUNCHES[0][2]).seq
        assert seq.seqlen_k == n, f"cache_seqlens={n} launched with seqlen_k={seq.seqlen_k}"
    assert len(_plan.plans) == 1
    kw["cache_seqlens"] = 4097  # past the capacity: the full path's message
    with pytest.raises(ValueError, match="cache_seqlens=4097 with S_new=0 new keys does not fit"):
        cuflash.attention_with_kvcache(*a, **kw, check_inputs=False)


# --- hits and misses ---------------------------------------------------------------------------------------

def test_a_warm_call_skips_validation_and_the_kernel_lookup(monkeypatch):
    q, k, v = qkv()
    cuflash.attention(q, k, v)

    def fail(*args, **kwargs):
        raise AssertionError("the full path ran on a warm call")

    monkeypatch.setattr(_families._validate, "check_qkv", fail)
    monkeypatch.setattr(_families, "_kernel", fail)
    q2, k2, v2 = qkv()
    o = cuflash.attention(q2, k2, v2)
    assert o.shape == q.shape and o.dtype == q.dtype


def _plans_after(*calls):
    _plan.plans.clear()
    for call in calls:
        call()
    return len(_plan.plans)


def test_the_key_holds_shapes_strides_dtypes_and_options():
    base = qkv()
    fwd = cuflash.attention_forward
    assert _plans_after(lambda: fwd(*base), lambda: fwd(*qkv())) == 1, "same signature, new arrays: one plan"
    variants = [
        lambda: fwd(*qkv(sq=41)),  # shape
        lambda: fwd(*qkv(dtype=BF16)),  # dtype
        lambda: fwd(wide(base[0].shape), *base[1:]),  # strides
        lambda: fwd(*base, causal=True),
        lambda: fwd(*base, softmax_scale=0.125),
        lambda: fwd(*base, softmax_scale=np.float32(0.125)),  # an equal value of another type
        lambda: fwd(*qkv(layout="bhsd"), layout="bhsd"),
        lambda: fwd(*qkv()[:2], A(base[2].shape, F16, device=1)),  # device (rejected: not cached)
    ]
    for i, call in enumerate(variants):
        try:
            call()
        except ValueError:
            assert i == len(variants) - 1
    assert len(_plan.plans) == 1 + len(variants) - 1, "each signature gets its own plan"


def test_an_option_of_another_type_is_validated_again():
    """causal=1 hashes like causal=True, but it is an error: the cached plan of True must not hide it."""
    q, k, v = qkv()
    cuflash.attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal=1 must be True or False"):
        cuflash.attention(q, k, v, causal=1)
    cuflash.attention(q, k, v, softmax_scale=1.0)
    with pytest.raises(TypeError, match="softmax_scale=True must be a real number"):
        cuflash.attention(q, k, v, softmax_scale=True)
    with pytest.raises(TypeError, match=r"softmax_scale=\[0.1\] must be a real number"):  # unhashable
        cuflash.attention(q, k, v, softmax_scale=[0.1])


def test_replaced_kernel_table_or_full_cache_drops_plans(monkeypatch):
    q, k, v = qkv()
    cuflash.attention(q, k, v)
    monkeypatch.setattr(_launch, "_kernels", {})  # what a test that counts kernel loads does
    assert _plan.plans.get(api._FORWARD.key(q, k, v, False, None, "bshd", None, None, None, None, None, None, None, 0.0, None, 0,
                                            False, None, None, None, None)) is None
    small = _plan.PlanCache(size=3)
    for i in range(5):
        small.put(i, types_plan())
    assert len(small) == 3 and small.get(0) is None and small.get(4) is not None


def types_plan():
    class P:
        kernels = _launch._kernels
    return P()


# --- per-call checks on a warm call ------------------------------------------------------------------------

def test_a_misaligned_input_is_still_copied_on_a_warm_call():
    q, k, v = qkv()
    cuflash.attention(q, k, v)
    fc.COUNTS.clear()
    odd = A(q.shape, F16, ptr=q.data.ptr + 2)  # same signature, address 2 bytes off
    fc.LAUNCHES.clear()
    cuflash.attention(odd, k, v)
    assert fc.COUNTS["copy"] == 1, "the misaligned q was not copied"
    assert _launch.FwdParams.from_buffer_copy(fc.LAUNCHES[0][2]).q != odd.data.ptr


def test_preallocated_outputs_are_checked_on_every_call():
    a = backward_args()
    dq = A(a["q"].shape, F16)
    cuflash.attention_backward(*a.values(), dq=dq)
    assert len(_plan.plans) == 1
    alias = A(a["q"].shape, F16, ptr=a["out"].data.ptr)  # same signature as dq, at out's address
    with pytest.raises(ValueError, match="dq \\(preallocated\\) overlaps the memory of out; outputs must not alias"):
        cuflash.attention_backward(*a.values(), dq=alias)
    odd = A(a["q"].shape, F16, ptr=dq.data.ptr + 8)
    with pytest.raises(ValueError, match="dq \\(preallocated\\) must be 16-byte aligned"):
        cuflash.attention_backward(*a.values(), dq=odd)
    grads = dict(dq=A(a["q"].shape, F16), dk=A(a["k"].shape, F16), dv=A(a["v"].shape, F16))
    cuflash.attention_backward(*a.values(), **grads)
    grads["dv"] = A(a["v"].shape, F16, ptr=grads["dk"].data.ptr)
    with pytest.raises(ValueError, match="dv \\(preallocated\\) overlaps the memory of dk"):
        cuflash.attention_backward(*a.values(), **grads)
    assert fc.COUNTS["launch"] == 2 * 3, "a rejected call launched"


def test_kvcache_aliasing_the_cache_is_rejected_on_a_warm_call():
    (a, kw) = kvcache_args(s_new=1)
    cuflash.attention_with_kvcache(*a, **kw, check_inputs=False)
    q, kc, vc = a
    inside = A(q.shape, F16, ptr=kc.data.ptr + 4096)  # q inside k_cache, which the call writes
    with pytest.raises(ValueError, match="q overlaps the memory of k_cache, which the call writes into"):
        cuflash.attention_with_kvcache(inside, kc, vc, **kw, check_inputs=False)
    with pytest.raises(ValueError, match="v_cache overlaps the memory of k_cache"):
        cuflash.attention_with_kvcache(q, kc, A(vc.shape, F16, ptr=kc.data.ptr), **kw, check_inputs=False)


def test_checked_kvcache_values_are_read_on_every_warm_call():
    (a, kw) = kvcache_args()
    cuflash.attention_with_kvcache(*a, **kw)
    kw["cache_seqlens"].host = np.array([5, 4097], dtype=np.int32)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\]=4097 plus S_new=0"):
        cuflash.attention_with_kvcache(*a, **kw)


# --- the argument blocks ----------------------------------------------------------------------------------

def test_each_thread_gets_its_own_argument_block():
    """Warm calls reuse their thread's block (the driver has read it when the launch returns); two threads
    never write one block, and the template itself is never written."""
    import ctypes

    params = _launch.FwdParams(q=1, k=2, heads=7)
    template = _launch.ArgsTemplate(params)
    seen: dict = {}
    barrier = threading.Barrier(4)

    def work():
        barrier.wait()  # all four threads alive at once: their idents differ
        for _ in range(100):
            p, address, _ = template.mine()
            assert p.q in (1, threading.get_ident()), "another thread wrote this thread's block"
            p.q = threading.get_ident()
            seen.setdefault(threading.get_ident(), set()).add(address)
            # the block at address: kernelParams[0] (its first word) points at its own params struct
            assert ctypes.c_void_p.from_address(address).value == ctypes.addressof(p)
            assert ctypes.addressof(p) == address + template.offset

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 4 and all(len(a) == 1 for a in seen.values()), "one block per thread, reused"
    assert len(set().union(*seen.values())) == 4, "threads shared a block"
    fresh = template.new()
    assert fresh.arg == ctypes.addressof(fresh.params) and fresh.params.heads == 7 and fresh.params.k == 2
    assert _launch.FwdParams.from_buffer_copy(template.bytes[template.offset:]).q == 1, "the template was written"


# --- a new option must reach the key ----------------------------------------------------------------------

OTHER_VALUES = {  # a valid non-default value of each keyword option of the functions that have plans
    "causal": True, "softmax_scale": 0.2, "layout": "bhsd", "deterministic": True, "precision": "tf32",
    "dq": "grad", "dk": "grad", "dv": "grad",
    "k": "new", "v": "new", "cache_seqlens": 5, "block_table": "table", "num_splits": 3, "return_lse": True,
    "check_inputs": False,
    # score modifiers: window, softcap, dropout_p by value, the slopes, the bias and a mask as arrays, dbias by value
    # when it is a bool, seed and offset by type; calls with the others are not planned (the key is None)
    "window": (4, 4), "alibi_slopes": "slopes", "softcap": 30.0, "dropout_p": 0.1, "seed": 3, "offset": 1,
    "return_dropout_mask": True, "bias": "bias", "mask": "mask", "key_padding_mask": "kpm", "dbias": True,
    # the kv cache's rotary embedding and index arrays: not planned either
    "rotary_cos": "cos", "rotary_sin": "sin", "rotary_interleaved": False, "cache_batch_idx": "idx",
    "cache_leftpad": "leftpad",
    # FP8 (e4m3) inputs' descales as arrays (a number: no key, the full path), the output dtype by value
    "q_descale": "qd", "k_descale": 0.5, "v_descale": "vd", "out_dtype": "fp16",
}


@pytest.mark.parametrize("fn", ["attention", "attention_forward", "attention_backward", "attention_with_kvcache",
                                "attention_varlen_forward", "attention_varlen_backward"])
def test_every_keyword_option_is_part_of_the_plan_key(fn):
    """A keyword option that the key misses would replay a plan made for another value. When this fails
    for a new option: add it to the function's Signature (api.py) and a value here."""
    key_fn = {"attention": api._ATTENTION.key, "attention_forward": api._FORWARD.key,
              "attention_backward": api._BACKWARD.key, "attention_with_kvcache": api._KVCACHE.key,
              "attention_varlen_forward": api._VARLEN_FORWARD.key,
              "attention_varlen_backward": api._VARLEN_BACKWARD.key}[fn]
    sig = inspect.signature(getattr(api, fn))
    options = [p for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
    missing = [p.name for p in options if p.name not in OTHER_VALUES]
    assert not missing, f"{fn}: no test value for the options {missing}: add them to the plan key and here"
    kinds = dict({"attention": api._ATTENTION, "attention_forward": api._FORWARD, "attention_backward": api._BACKWARD,
                  "attention_with_kvcache": api._KVCACHE, "attention_varlen_forward": api._VARLEN_FORWARD,
                  "attention_varlen_backward": api._VARLEN_BACKWARD}[fn].params)
    key_params = list(inspect.signature(key_fn).parameters)
    absent = [p.name for p in options if p.name not in key_params]
    assert not absent, f"{fn}: the options {absent} are not passed to {key_fn.__name__}"
    positional = {name: A((1, 8, 2, 64), F16) for name in key_params}
    defaults = {p.name: p.default for p in options}
    base = key_fn(**{**positional, **defaults})
    assert base is not None
    for p in options:
        value = OTHER_VALUES[p.name]
        if isinstance(value, str) and p.name not in ("layout", "precision", "out_dtype"):
            value = A((1, 8, 2, 64), F16)
        changed = key_fn(**{**positional, **defaults, p.name: value})
        if kinds[p.name] == _plan.BOUND:  # by type only: the plan writes the value per call (tests below)
            assert changed == key_fn(**{**positional, **defaults, p.name: value + 1})
            assert changed != key_fn(**{**positional, **defaults, p.name: True}), "a bool is not an int here"
            continue
        assert changed != base, f"{fn}: {p.name}={value!r} gives the key of its default"


def test_fp8_arguments_reach_the_fp8_path(monkeypatch):
    """A descale given as an array (or a number) or an out_dtype sends attention / attention_forward to the FP8
    forward, whatever q is: the full path routes on them (here no plan exists: the first call of each key)."""
    from cuflash import _fp8

    seen = []
    monkeypatch.setattr(api, "_fp8_forward", lambda *args, **kw: seen.append(args[15:19]) or "fp8")
    q = A((1, 8, 2, 64), F16)
    arr = np.ones((1, 2), np.float32)  # an array argument: its truth value is ambiguous, never asked
    for fn in (cuflash.attention, cuflash.attention_forward):
        for kw in ({"q_descale": arr}, {"k_descale": 0.5}, {"v_descale": arr}, {"out_dtype": "fp16"}):
            assert fn(q, q, q, **kw) == "fp8", (fn.__name__, kw)
    assert len(seen) == 8 and all(any(x is not None for x in args) for args in seen)
    assert not _fp8.is_fp8(q)
