"""The warp-specialized Hopper forward (fwd_sm90_ws_kernel: TMA, producer/consumer warpgroups, async wgmma,
pingpong) launched directly, before it is wired into cuflash.attention: O and lse against the float64 reference
under the pass rule of README.md (Tests), over awkward sequence lengths, both dtypes, causal and not, bshd, bhsd and
strided views, GQA; the score modifiers (window with and without causal, ALiBi, softcap, dropout, alone and
combined) against cuflash.reference with the ModParams the library builds (_families.mod_params); the dropout keep
mask element for element against cuflash.philox and fwd_sm90_kernel; packed (varlen) batches with empty
sequences, GQA, causal and modifiers. Needs an sm_90 GPU (skipped elsewhere, like every `gpu` test).

    python -m pytest -m gpu tests/test_gpu_fwd_ws.py -q -s     # -s prints the speed reading of the last test
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cuflash import _compile, _families, _launch, _tma, _validate, _xpref, config, philox
from cuflash import reference as ref

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
from gpu_helpers import (check_lse, check_rule, cu_seqlens, make_input, make_packed, max_abs, seed_of,  # noqa: E402
                         to_bshd32, warm_kernel_cache)
from test_gpu_gqa_varlen import rows_of, varlen_lengths  # noqa: E402
from test_gpu_mods import mods_kwargs, ref_kwargs  # noqa: E402
from ws_helpers import ws_kernel  # noqa: E402

SEQLEN_PAIRS = [(113, 203), (128, 217), (256, 512), (512, 256), (1023, 1024), (1024, 1023), (1, 239), (127, 513)]
LAYOUTS = [("bshd", "contiguous"), ("bhsd", "contiguous"), ("bshd", "padded"), ("bhsd", "transposed")]


@pytest.fixture(scope="module", autouse=True)
def _hopper_only():
    arch = _compile.device_arch()
    if not config.uses_wgmma(arch):  # another GPU, or CUFLASH_KERNELS=mma: the wgmma kernels do not run
        pytest.skip(f"fwd_sm90_ws_kernel needs an sm_90 GPU (TMA, wgmma, setmaxnreg) with the wgmma kernels on "
                    f"(here {arch}, CUFLASH_KERNELS={config.KERNELS})")


class _Dims:
    """Dims-like (cuflash._validate.Dims): batch, seqlen, heads, head_dim and element strides."""

    def __init__(self, b, s, h, d, bs, rs, hs):
        self.batch, self.seqlen, self.heads, self.head_dim = b, s, h, d
        self.batch_stride, self.row_stride, self.head_stride = bs, rs, hs


def dims_of(x, layout) -> _Dims:
    """_Dims of a (B, S, H, D) ("bshd") or (B, H, S, D) ("bhsd") array."""
    st = [s // x.itemsize for s in x.strides]
    if layout == "bshd":
        b, s, h, d = x.shape
        return _Dims(b, s, h, d, st[0], st[1], st[2])
    b, h, s, d = x.shape
    return _Dims(b, s, h, d, st[0], st[2], st[1])


def packed_dims(x) -> _Dims:
    """_Dims of a packed (total, H, D) array: batch 1, seqlen = total, batch stride 0 (as _validate's "packed")."""
    st = [s // x.itemsize for s in x.strides]
    return _Dims(1, x.shape[0], x.shape[1], x.shape[2], 0, st[0], st[1])


def fwd_params(q, k, v, o, lse, dims, seq, lse_strides, scale, mods=None):
    """_launch.FwdParams of a forward: dims = (q, k, v, o) _Dims, seq the SeqParams, mods a ModParams or None."""
    dq, dk, dv, do = dims
    fwd = _launch.FwdParams(
        q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=o.data.ptr, lse=0 if lse is None else lse.data.ptr, seq=seq,
        q_batch_stride=dq.batch_stride, q_row_stride=dq.row_stride, q_head_stride=dq.head_stride,
        k_batch_stride=dk.batch_stride, k_row_stride=dk.row_stride, k_head_stride=dk.head_stride,
        v_batch_stride=dv.batch_stride, v_row_stride=dv.row_stride, v_head_stride=dv.head_stride,
        o_batch_stride=do.batch_stride, o_row_stride=do.row_stride, o_head_stride=do.head_stride,
        lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[1], heads=dq.heads, head_dim=dq.head_dim,
        num_splits=1, rows_per_pos=1, scale_log2=_launch.scale_log2(scale))
    if mods is not None:
        fwd.mods = mods
    return fwd


def launch_ws(kern, fwd, q, k, v, dims, batch, heads, seqlen_q, num_sms=None, queue=None):
    """Launch fwd_sm90_ws_kernel on FwdParams `fwd` with the TMA maps of q, k, v (dims: their _Dims) over the work
    items of (batch, heads, seqlen_q); a persistent kernel on num_sms CTAs at most (None: the GPU's SMs), taking its
    items from a work queue (queue True; None: where the library would, FwdSm90WsConfig.uses_queue) or in a fixed
    stride. A queue's counters are poisoned around the two words the launch may use and must be back at zero after
    it (the next launch on the stream starts from them)."""
    params = _tma.ws_params(fwd, q, k, v, *dims, kern.dtype, kern)
    dev = cp.cuda.Device()
    sms = num_sms or dev.attributes["MultiProcessorCount"]
    grid, params.m_blocks, params.items = kern.schedule(batch, heads, seqlen_q, sms)
    if queue is None:
        queue = kern.uses_queue(bool(fwd.seq.cu_seqlens_q))
    counters = None
    if queue:
        counters = cp.full(6, 77, dtype=cp.int32)
        counters[2:4] = 0
        params.queue = counters.data.ptr + 8
    _launch.get_kernel(kern, dev.id).launch(grid, params, cp.cuda.get_current_stream().ptr)
    cp.cuda.get_current_stream().synchronize()
    if counters is not None:
        assert counters.tolist() == [77, 77, 0, 0, 77, 77], f"{kern}: the work queue after the launch {counters}"


def nan_like(x, dtype):
    return _xpref.to_lowp(cp.full(x.shape, cp.nan, dtype=cp.float32), dtype)  # NaN in fp16 / bf16


def run_ws(cfg, q, k, v, layout, causal, scale=None, with_lse=True, mods=None, num_sms=None, queue=None):
    """o (q's layout, contiguous, NaN-poisoned before the launch) and lse (B, H, Sq) float32 (or None).
    cfg: a FwdSm90WsConfig; mods: the ModParams of its MODS; num_sms, queue: launch_ws's."""
    kern = cfg
    dq, dk, dv = dims_of(q, layout), dims_of(k, layout), dims_of(v, layout)
    b, sq, h, d = dq.batch, dq.seqlen, dq.heads, dq.head_dim
    o = nan_like(q, kern.dtype)
    lse = cp.full((b, h, sq), cp.nan, dtype=cp.float32) if with_lse else None
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dims = (dq, dk, dv, dims_of(o, layout))
    fwd = fwd_params(q, k, v, o, lse, dims, _launch.seq_params(sq, dk.seqlen, h // dk.heads), (h * sq, sq), scale, mods)
    launch_ws(kern, fwd, q, k, v, dims[:3], b, h, sq, num_sms, queue)
    return o, lse


def warm(kernels):
    """Compile the instantiations a test module launches on all CPUs up front (gpu_helpers.warm_kernel_cache)."""
    warm_kernel_cache(kernels)


def check_case(cfg, b, sq, sk, h, h_kv, layout, kind, causal, num_sms=None, queue=None):
    d, dtype = cfg.head_dim, cfg.dtype
    seed = seed_of("ws", d, dtype, sq, sk, h, h_kv, layout, kind, causal)
    q = make_input(b, sq, h, d, dtype, layout, kind, seed)
    k = make_input(b, sk, h_kv, d, dtype, layout, kind, seed + 1)
    v = make_input(b, sk, h_kv, d, dtype, layout, kind, seed + 2)
    o, lse = run_ws(cfg, q, k, v, layout, causal, num_sms=num_sms, queue=queue)
    q32, k32, v32 = (to_bshd32(x, layout) for x in (q, k, v))
    o64, lse64 = _xpref.attention_forward64(q32, k32, v32, causal)
    lowp = _xpref.attention_lowp(q32, k32, v32, dtype, causal)
    what = f"{cfg} b={b} sq={sq} sk={sk} h={h}/{h_kv} {layout}/{kind}"
    check_rule("o", to_bshd32(o, layout), o64, lowp, 2.0, what)
    check_lse(lse, lse64, what)


CONFIGS = [(d, dt, c, pp) for d in config.FWD_SM90_WS_TILES for dt in ("fp16", "bf16") for c in (False, True)
           for pp in (False, True)]


@pytest.mark.parametrize("layout,kind", LAYOUTS, ids=lambda x: x)
@pytest.mark.parametrize("sq,sk", SEQLEN_PAIRS, ids=lambda x: str(x))
@pytest.mark.parametrize("d,dtype,causal,pingpong", CONFIGS,
                         ids=lambda x: x if isinstance(x, str) else str(x))
def test_ws_forward_matches_reference(d, dtype, causal, pingpong, sq, sk, layout, kind):
    cfg = config.fwd_sm90_ws_config(d, dtype, causal, pingpong=pingpong)
    check_case(cfg, 2, sq, sk, 3, 3, layout, kind, causal)


@pytest.mark.parametrize("sq,sk", [(113, 203), (1024, 1023), (127, 513), (512, 256)], ids=str)
@pytest.mark.parametrize("d,dtype,causal,pingpong", [(128, "bf16", True, True), (128, "fp16", False, True),
                                                     (64, "bf16", True, False), (256, "fp16", True, True),
                                                     (32, "bf16", False, False), (96, "fp16", True, True),
                                                     (192, "bf16", True, False)], ids=str)
def test_ws_forward_gqa(d, dtype, causal, pingpong, sq, sk):
    cfg = config.fwd_sm90_ws_config(d, dtype, causal, pingpong=pingpong)
    check_case(cfg, 2, sq, sk, 4, 2, "bshd", "contiguous", causal)


# Three consumer warpgroups (block_m 192: D 64's long rows, config.FWD_SM90_WS_TILES / _CAUSAL_LONG): 192-row work
# items, so the sequence pairs put the last one partial, past the sequence or seeing no key (causal, Sq > Sk)
@pytest.mark.parametrize("layout,kind", LAYOUTS, ids=lambda x: x)
@pytest.mark.parametrize("sq,sk", [(113, 203), (193, 217), (384, 385), (1023, 1024), (700, 300), (1, 239)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_three_consumer_forward_matches_reference(dtype, causal, sq, sk, layout, kind):
    cfg = config.FwdSm90WsConfig(64, 128, 2, dtype, causal, False, block_m=192)
    assert cfg.threads == 512
    check_case(cfg, 2, sq, sk, 3, 3, layout, kind, causal)
    check_case(cfg, 2, sq, sk, 4, 2, "bshd", "contiguous", causal)  # GQA


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_library_runs_three_consumers_on_long_d64_rows(causal):
    """Through cuflash.attention_forward: D 64 rows of more than FWD_SM90_WS_SHORT_KEYS keys (non-causal) or
    FWD_SM90_WS_CAUSAL_LONG_KEYS (causal) take the three-consumer kernel; against the float64 reference."""
    import cuflash

    sk = (config.FWD_SM90_WS_CAUSAL_LONG_KEYS if causal else config.FWD_SM90_WS_SHORT_KEYS)[64] + 77
    cfg = config.forward_kernel_config(64, "bf16", causal, _compile.device_arch(), seqlen_k=sk)
    assert isinstance(cfg, config.FwdSm90WsConfig) and cfg.block_m == 192, cfg
    q = make_input(1, 300, 2, 64, "bf16", "bshd", "contiguous", seed_of("three", causal))
    k, v = (make_input(1, sk, 2, 64, "bf16", "bshd", "contiguous", seed_of("three", causal, i)) for i in (1, 2))
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    q32, k32, v32 = (to_bshd32(x, "bshd") for x in (q, k, v))
    o64, lse64 = _xpref.attention_forward64(q32, k32, v32, causal)
    check_rule("o", to_bshd32(o, "bshd"), o64, _xpref.attention_lowp(q32, k32, v32, "bf16", causal), 2.0,
               f"three consumers causal={causal} 300 x {sk}")
    check_lse(lse, lse64, f"three consumers causal={causal}")


# The persistent kernels (one CTA per SM walking the work items; FwdSm90WsTraits::PERSISTENT): the instantiations the
# tables may choose, each on grids of 1 and 3 CTAs (every CTA walks many items, so the rings, the Q buffer's phases
# and the pingpong tokens carry across items, and items without keys sit between items with keys) and on the whole
# GPU, the items taken in a fixed stride or from the work queue.
PERSISTENT = [(64, 192, 2, False), (64, 128, 2, True), (64, 128, 2, False), (128, 128, 2, False), (128, 128, 2, True),
              (128, 128, 3, False), (128, 192, 2, False), (256, 64, 2, False), (32, 256, 2, True), (32, 128, 2, True),
              (96, 128, 2, False), (96, 128, 2, True), (192, 96, 2, True)]


@pytest.mark.parametrize("queue", [False, True], ids=["stride", "queue"])
@pytest.mark.parametrize("num_sms", [1, 3, None], ids=lambda x: f"ctas{x or 'all'}")
@pytest.mark.parametrize("sq,sk", [(113, 203), (1000, 257), (257, 1000), (1, 239), (384, 384)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,bn,stages,pingpong", PERSISTENT, ids=str)
def test_ws_forward_persistent(d, bn, stages, pingpong, causal, sq, sk, num_sms, queue):
    cfg = config.FwdSm90WsConfig(d, bn, stages, "bf16", causal, pingpong, persistent=True)
    check_case(cfg, 2, sq, sk, 3, 3, "bshd", "contiguous", causal, num_sms=num_sms, queue=queue)


# three consumer warpgroups (192-row items, 512 threads) on the persistent grid: the item ring and the Q barrier
# count 384 consumer threads and 12 warps; sq 1000 leaves a last item of 40 rows (two consumers' rows all past the
# end), 113 one item with rows of the first consumer only
@pytest.mark.parametrize("queue", [False, True], ids=["stride", "queue"])
@pytest.mark.parametrize("num_sms", [1, 3, None], ids=lambda x: f"ctas{x or 'all'}")
@pytest.mark.parametrize("sq,sk", [(113, 203), (1000, 257), (257, 1000), (1, 239), (384, 384)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("stages", [2, 3])
def test_ws_forward_persistent_three_consumers(stages, causal, sq, sk, num_sms, queue):
    cfg = config.FwdSm90WsConfig(64, 128, stages, "bf16", causal, False, persistent=True, block_m=192)
    check_case(cfg, 2, sq, sk, 3, 3, "bshd", "contiguous", causal, num_sms=num_sms, queue=queue)
    check_case(cfg, 2, sq, sk, 4, 2, "bshd", "contiguous", causal, num_sms=num_sms, queue=queue)  # GQA


@pytest.fixture
def queued_causal(monkeypatch):
    """q, k, v (2 x 1000 x 6 x 128, bf16) whose causal calls through the library run the persistent D 128 kernel
    with its work queue (the table entry set here, kernel choices and plans cleared before and after)."""
    from cuflash import _plan

    monkeypatch.setitem(config.FWD_SM90_WS_TILES_CAUSAL_PLAIN, 128, (128, 2, False, True))
    _families._selected.clear()
    _plan.plans.clear()
    cfg = config.forward_kernel_config(128, "bf16", True, seqlen_k=1000)
    assert cfg.persistent and cfg.uses_queue(False), cfg
    try:
        yield tuple(make_input(2, 1000, 6, 128, "bf16", "bshd", "contiguous", seed_of("queue", i)) for i in range(3))
    finally:
        _families._selected.clear()
        _plan.plans.clear()


def test_queued_forward_through_the_library_on_two_streams(queued_causal):
    """Causal calls of the persistent kernel through the library (full path, then plan replays), queued back to back
    on two streams: each launch takes its work items from its own stream's queue and leaves it at zero for the next,
    so every output is bitwise the first one, which passes the accuracy rule."""
    import cuflash

    q, k, v = queued_causal
    cp.cuda.Device().synchronize()
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = []
    for i in range(12):
        with streams[i % 2]:
            outs.append(cuflash.attention(q, k, v, causal=True))
    for st in streams:
        st.synchronize()
    for i, o in enumerate(outs[1:], 1):
        assert bool((o == outs[0]).all()), f"call {i} (stream {i % 2}) differs from the first"
    q32, k32, v32 = (to_bshd32(x, "bshd") for x in (q, k, v))
    check_rule("o", to_bshd32(outs[0], "bshd"), _xpref.attention_forward64(q32, k32, v32, True)[0],
               _xpref.attention_lowp(q32, k32, v32, "bf16", True), 2.0, "queued, two streams")


def test_queued_forward_on_per_thread_default_streams(queued_causal):
    """Four host threads on the per-thread default stream (one handle, a stream per thread) run causal calls of the
    persistent kernel at once: each thread's launches take their own work queue, so every output is bitwise the one
    computed alone."""
    import threading

    import cuflash

    q, k, v = queued_causal
    want = cuflash.attention(q, k, v, causal=True)
    cp.cuda.Device().synchronize()
    errors, start = [], threading.Barrier(4)

    def work():
        try:
            with cp.cuda.Stream.ptds:
                start.wait()
                outs = [cuflash.attention(q, k, v, causal=True) for _ in range(6)]
                cp.cuda.Stream.ptds.synchronize()
                errors.extend(i for i, o in enumerate(outs) if not bool((o == want).all()))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"calls differing from the one computed alone (or failing): {errors}"


def test_ws_forward_without_lse_and_rejects_misaligned_strides():
    cfg = config.fwd_sm90_ws_config(128, "bf16", True)
    q, k, v = (make_input(2, 200, 3, 128, "bf16", "bshd", "contiguous", seed_of("nolse", i)) for i in range(3))
    o, _ = run_ws(cfg, q, k, v, "bshd", True, with_lse=False)
    q32, k32, v32 = (to_bshd32(x, "bshd") for x in (q, k, v))
    check_rule("o", to_bshd32(o, "bshd"), _xpref.attention_forward64(q32, k32, v32, True)[0],
               _xpref.attention_lowp(q32, k32, v32, "bf16", True), 2.0, "lse=nullptr")
    bad = make_input(2, 200, 3, 128, "bf16", "bshd", "misaligned", seed_of("bad"))
    assert _tma.tma_unsupported(bad, dims_of(bad, "bshd"), "bf16") is not None
    with pytest.raises(ValueError, match="TMA"):
        run_ws(cfg, bad, k, v, "bshd", True)


# --- score modifiers -------------------------------------------------------------------------------------------

def library_mods(kw: dict, causal: bool, batch: int, heads: int):
    """The validated modifiers (_validate.Mods: MODS bits, the kernel's causal flag with a window folded in) of
    cuflash keyword arguments `kw` (test_gpu_mods.mods_kwargs), as the library derives them."""
    slopes = kw.get("alibi_slopes")
    return _validate.check_mods(causal, kw.get("window"), None if slopes is None else _validate.array_info(slopes, "alibi_slopes"),
                                kw.get("softcap"), kw.get("dropout_p", 0.0), kw.get("seed"), kw.get("offset", 0),
                                batch, heads, cp.cuda.Device().id)


def check_mods_case(d, dtype, causal, mods, sq, sk, b=2, hq=4, hkv=2, layout="bshd", pingpong=True, scale_inputs=1.0):
    """One dense problem with score modifiers (test_gpu_mods' dict form) through fwd_sm90_ws_kernel, against
    cuflash.reference (float64 and low precision) with the same modifiers; the dropout reference uses the
    specified Philox mask (cuflash.philox), so passing means the kernel drops the same elements."""
    seed = seed_of("ws-mods", d, dtype, causal, sorted(mods.items()), sq, sk, b, hq, hkv, layout, pingpong)
    q = make_input(b, sq, hq, d, dtype, layout, "contiguous", seed, scale_inputs)
    k = make_input(b, sk, hkv, d, dtype, layout, "padded", seed + 1, scale_inputs)
    v = make_input(b, sk, hkv, d, dtype, layout, "contiguous", seed + 2)
    kw = mods_kwargs(mods, b, hq, seed)
    m = library_mods(kw, causal, b, hq)
    kern = ws_kernel(d, dtype, m.causal, m.bits, pingpong)
    scale = 1.0 / math.sqrt(d)
    o, lse = run_ws(kern, q, k, v, layout, m.causal, scale, mods=_families.mod_params(m, scale, max(sq, sk)))
    mask = philox.dropout_mask(b, hq, sq, sk, kw["dropout_p"], kw["seed"], kw["offset"]) if "dropout_p" in kw else None
    q32, k32, v32 = (cp.asnumpy(to_bshd32(x, layout)) for x in (q, k, v))
    rk = ref_kwargs(kw, mask)
    o64, lse64 = ref.attention_forward64(q32, k32, v32, causal, **rk)
    o_lowp = ref.attention_lowp(q32, k32, v32, dtype, causal, **rk)
    what = f"{kern} B={b} Sq={sq} Sk={sk} H={hq}/{hkv} causal={causal} mods={mods} {layout}"
    check_rule("o", to_bshd32(o, layout), cp.asarray(o64), cp.asarray(o_lowp), 2, what)
    check_lse(lse, cp.asarray(lse64), what)
    return o, lse


# (d, dtype, causal, mods, sq, sk): each modifier alone and combined (test_gpu_mods.COMBOS), window with and without
# causal (causal folds into right = 0), both pingpong settings, every head dim and tile table
MOD_CASES = [
    (64, "bf16", False, {"window": (17, 17)}, 113, 203),
    (128, "fp16", False, {"window": (256, 0)}, 203, 113),
    (256, "bf16", False, {"window": (-1, 17)}, 256, 256),
    (64, "fp16", False, {"window": (17, -1)}, 1, 239),
    (128, "bf16", True, {"window": (37, 5)}, 203, 317),      # causal + window: (37, 0), IS_CAUSAL false
    (64, "fp16", True, {"window": (0, 0)}, 300, 100),        # rows that see no key
    (256, "fp16", True, {"window": (5, 40)}, 1023, 1024),
    (64, "fp16", True, {"alibi": "h"}, 113, 203),
    (128, "bf16", False, {"alibi": "bh"}, 217, 128),
    (256, "bf16", False, {"softcap": 50.0}, 203, 113),
    (128, "bf16", True, {"softcap": 2.0}, 203, 113),         # with scale_inputs 3: |s| >> cap
    (64, "fp16", True, {"dropout": 0.17}, 113, 203),
    (128, "bf16", False, {"dropout": 0.5}, 256, 512),
    (256, "fp16", True, {"dropout": 0.17}, 127, 513),
    (64, "bf16", False, {"window": (37, 5), "alibi": "bh"}, 203, 256),
    (128, "fp16", True, {"window": (64, 0), "softcap": 30.0, "dropout": 0.17}, 203, 256),
    (256, "bf16", True, {"alibi": "h", "softcap": 20.0}, 203, 256),
    (192, "bf16", False, {"window": (40, 7), "alibi": "bh", "softcap": 20.0, "dropout": 0.17}, 203, 256),
    (128, "bf16", False, {"alibi": "h", "dropout": 0.5}, 1024, 1023),
    (64, "fp16", False, {"window": (20, 20), "alibi": "h", "softcap": 10.0, "dropout": 0.17}, 203, 256),
    (128, "bf16", True, {"window": (20, 20), "alibi": "h", "softcap": 10.0, "dropout": 0.17}, 512, 256),
    (256, "fp16", False, {"window": (20, 20), "alibi": "bh", "softcap": 10.0, "dropout": 0.17}, 113, 203),
    (128, "fp16", True, {"alibi": "bh", "softcap": 5.0, "dropout": 0.17}, 1, 239),
]


def mod_case_kernel(d, dtype, causal, mods, pingpong):
    """The instantiation a case of MOD_CASES / VARLEN_CASES launches (to compile them all up front): the MODS bits
    and causal flag of library_mods, without arrays (a window folds causal in as _validate.check_mods does)."""
    bits = (config.MOD_ALIBI * ("alibi" in mods) | config.MOD_SOFTCAP * ("softcap" in mods)
            | config.MOD_DROPOUT * ("dropout" in mods))
    if "window" in mods:
        left, right = mods["window"]
        right = (0 if right == -1 else min(right, 0)) if causal else right
        if (left, right) not in ((-1, -1), (-1, 0)):
            bits, causal = bits | config.MOD_WINDOW, False
    return ws_kernel(d, dtype, causal, bits, pingpong)


@pytest.fixture(scope="module")
def mods_compiled():
    warm({mod_case_kernel(d, dt, c, m, pp) for d, dt, c, m, _, _ in MOD_CASES for pp in (False, True)}
         | {ws_kernel(128, dt, c, config.MOD_DROPOUT | w) for dt in ("fp16", "bf16") for c, w in ((False, 0), (True, 0),
                                                                                              (False, config.MOD_WINDOW))})


@pytest.mark.parametrize("pingpong", [False, True], ids=["plain", "pingpong"])
@pytest.mark.parametrize("d,dtype,causal,mods,sq,sk", MOD_CASES,
                         ids=[f"d{c[0]}-{c[1]}-{'causal' if c[2] else 'full'}-{'+'.join(c[3])}-{c[4]}x{c[5]}"
                              for c in MOD_CASES])
def test_ws_mods_match_reference(mods_compiled, d, dtype, causal, mods, sq, sk, pingpong):
    scale_inputs = 3.0 if mods.get("softcap") == 2.0 else 1.0
    b = 1 if sq * sk > 300_000 else 2
    check_mods_case(d, dtype, causal, mods, sq, sk, b=b, pingpong=pingpong, scale_inputs=scale_inputs)


def test_ws_window_rows_without_keys_are_zero():
    """Window (0, 0) with Sq > Sk: the first Sq - Sk rows see no key: o = 0, lse = -inf (whole CTAs and rows
    inside a CTA that sees keys)."""
    o, lse = check_mods_case(64, "fp16", False, {"window": (0, 0)}, 300, 100, b=1)
    assert max_abs(_xpref.to_float32(o[:, :200])) == 0.0 and bool((lse[:, :, :200] == -cp.inf).all())


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (40, 7))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_ws_dropout_keep_mask_is_the_philox_stream_and_fwd_sm90s(mods_compiled, dtype, causal, window):
    """V = identity rows (v_j = e_j, Sk <= D) makes O[i, :] = P_i * keep_i / (1 - p): the elements O keeps
    non-zero are exactly the kept, visible (i, j). They must equal cuflash.philox's mask and fwd_sm90_kernel's
    (same FwdParams, same launch arguments), and lse must be the undropped softmax's (the reference's without
    dropout, and fwd_sm90_kernel's)."""
    b, h, sq, sk, d, p = 2, 3, 203, 121, 128, 0.5
    seed = seed_of("ws-dropout-mask", dtype, causal, window)
    q = make_input(b, sq, h, d, dtype, "bshd", "contiguous", seed, 0.5)
    k = make_input(b, sk, h, d, dtype, "bshd", "contiguous", seed + 1, 0.5)
    eye = cp.zeros((b, sk, h, d), dtype=cp.float32)
    eye[:, cp.arange(sk), :, cp.arange(sk)] = 1.0
    v = _xpref.to_lowp(eye, dtype)
    kw = {"dropout_p": p, "seed": 1234567 + seed % 1000, "offset": seed % 7}
    if window is not None:
        kw["window"] = window
    m = library_mods(kw, causal, b, h)
    scale = 1.0 / math.sqrt(d)
    mp = _families.mod_params(m, scale, max(sq, sk))
    kern = ws_kernel(d, dtype, m.causal, m.bits)
    o, lse = run_ws(kern, q, k, v, "bshd", m.causal, scale, mods=mp)
    what = f"{kern} B={b} H={h} Sq={sq} Sk={sk} p={p} causal={causal} window={window}"

    visible = ref._visible(sq, sk, causal, window)
    visible = np.ones((sq, sk), dtype=bool) if visible is None else visible
    want = philox.dropout_mask(b, h, sq, sk, p, kw["seed"], kw["offset"]) & visible[None, None]
    got = cp.asnumpy(_xpref.to_float32(o)[..., :sk] != 0).transpose(0, 2, 1, 3)  # (B, H, Sq, Sk)
    assert not bool(cp.isnan(_xpref.to_float32(o)).any()), f"o has NaN for {what}"
    assert np.array_equal(got, want), f"kept elements differ from cuflash.philox in {int((got != want).sum())} " \
                                      f"places for {what}"

    # fwd_sm90_kernel on the same FwdParams (its own tiles and launch shape)
    old = config.fwd_sm90_config(d, dtype, m.causal, m.bits)
    o_old, lse_old = nan_like(q, dtype), cp.full((b, h, sq), cp.nan, dtype=cp.float32)
    dims = (dims_of(q, "bshd"), dims_of(k, "bshd"), dims_of(v, "bshd"), dims_of(o_old, "bshd"))
    fwd = fwd_params(q, k, v, o_old, lse_old, dims, _launch.seq_params(sq, sk, 1), (h * sq, sq), scale, mp)
    _launch.get_kernel(old, cp.cuda.Device().id).launch(old.grid(b, h, sq), fwd, cp.cuda.get_current_stream().ptr)
    cp.cuda.get_current_stream().synchronize()
    got_old = cp.asnumpy(_xpref.to_float32(o_old)[..., :sk] != 0).transpose(0, 2, 1, 3)
    assert np.array_equal(got, got_old), f"kept elements differ from fwd_sm90_kernel's in " \
                                         f"{int((got != got_old).sum())} places for {what}"
    check_lse(lse, lse_old, f"{what} (against fwd_sm90_kernel)", atol=1e-4)
    q32, k32, v32 = (cp.asnumpy(to_bshd32(x, "bshd")) for x in (q, k, v))
    _, lse64 = ref.attention_forward64(q32, k32, v32, causal, window=window)  # no dropout: lse is undropped
    check_lse(lse, cp.asarray(lse64), f"{what} (lse of the undropped softmax)")
    o64, _ = ref.attention_forward64(q32, k32, v32, causal, window=window, dropout_mask=want, dropout_p=p)
    o_lowp = ref.attention_lowp(q32, k32, v32, dtype, causal, window=window, dropout_mask=want, dropout_p=p)
    check_rule("o", to_bshd32(o, "bshd"), cp.asarray(o64), cp.asarray(o_lowp), 2, what)


# --- packed (varlen) batches ---------------------------------------------------------------------------------

def run_ws_varlen(kern, q, k, v, cu_q, cu_k, max_q, max_k, mods=None, with_lse=True, num_sms=None):
    """o (total_q, H, D), NaN-poisoned before the launch, and lse (H, total_q) of a packed batch."""
    total_q, hq, d = q.shape
    o = nan_like(q, kern.dtype)
    lse = cp.full((hq, total_q), cp.nan, dtype=cp.float32) if with_lse else None
    dims = (packed_dims(q), packed_dims(k), packed_dims(v), packed_dims(o))
    seq = _launch.seq_params(max_q, max_k, hq // k.shape[1], cu_q.data.ptr, cu_k.data.ptr)
    scale = 1.0 / math.sqrt(d)
    fwd = fwd_params(q, k, v, o, lse, dims, seq, (0, total_q), scale, mods)
    launch_ws(kern, fwd, q, k, v, dims[:3], len(cu_q) - 1, hq, max_q, num_sms)
    return o, lse


# (H_q, H_kv, D, dtype, causal, stride kind of the packed arrays, modifiers, extra added to max_seqlen)
VARLEN_CASES = [
    (4, 4, 64, "bf16", False, "contiguous", {}, 0),
    (4, 4, 64, "fp16", True, "contiguous", {}, 0),
    (6, 2, 128, "fp16", True, "padded", {}, 0),
    (6, 2, 128, "bf16", False, "transposed", {}, 37),  # max_seqlen beyond the longest sequence
    (4, 1, 256, "bf16", True, "transposed", {}, 0),
    (4, 2, 256, "fp16", False, "padded", {}, 0),
    (8, 2, 128, "bf16", False, "contiguous", {"window": (37, 5), "alibi": "bh", "dropout": 0.17}, 0),
    (4, 2, 64, "fp16", True, "padded", {"softcap": 20.0, "dropout": 0.5}, 0),
    (6, 3, 128, "fp16", True, "contiguous", {"window": (64, 3)}, 0),
    (4, 1, 256, "bf16", True, "contiguous", {"alibi": "h", "dropout": 0.17}, 0),
]
VARLEN_IDS = [f"hq{c[0]}-hkv{c[1]}-d{c[2]}-{c[3]}-{'causal' if c[4] else 'full'}-{c[5]}"
              + ("-" + "+".join(c[6]) if c[6] else "") + (f"-max+{c[7]}" if c[7] else "") for c in VARLEN_CASES]


@pytest.fixture(scope="module")
def varlen_compiled():
    warm({mod_case_kernel(d, dt, c, m, True) for _, _, d, dt, c, _, m, _ in VARLEN_CASES})


@pytest.mark.parametrize("persistent,num_sms", [(False, None), (True, 2), (True, None)],
                         ids=["one-item", "persistent-ctas2", "persistent-ctasall"])
@pytest.mark.parametrize("hq,hkv,d,dtype,causal,kind,mods,extra", VARLEN_CASES, ids=VARLEN_IDS)
def test_ws_varlen_matches_per_sequence_reference(varlen_compiled, hq, hkv, d, dtype, causal, kind, mods, extra,
                                                  persistent, num_sms):
    """8 packed sequences of random lengths up to 300 with the edge cases of test_gpu_gqa_varlen.varlen_lengths
    (an empty sequence, queries without keys, keys without queries, 1 x 1, 1 query over 255 keys): the rows of a
    box past a sequence's end are the next sequence's, so a wrong mask or store shows up in a neighbour. Also on
    the persistent kernel (grids of 2 and of all SMs): items past a sequence's end are skipped by every role, the
    empty sequence's items write O = 0 and lse = -inf between items with keys."""
    lens_q, lens_k = varlen_lengths(("ws", hq, d, dtype, causal, kind))
    seed = seed_of("ws-varlen", hq, hkv, d, dtype, causal, kind, sorted(mods.items()))
    n = len(lens_q)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = make_packed(sum(lens_q), hq, d, dtype, kind, seed)
    k = make_packed(sum(lens_k), hkv, d, dtype, kind, seed + 1)
    v = make_packed(sum(lens_k), hkv, d, dtype, "contiguous" if kind == "transposed" else kind, seed + 2)
    kw = mods_kwargs(mods, n, hq, seed)
    m = library_mods(kw, causal, n, hq)
    kern = dataclasses.replace(ws_kernel(d, dtype, m.causal, m.bits), persistent=persistent)
    max_q, max_k = max(lens_q) + extra, max(lens_k) + extra
    o, lse = run_ws_varlen(kern, q, k, v, cu_q, cu_k, max_q, max_k,
                           _families.mod_params(m, 1.0 / math.sqrt(d), max(max_q, max_k)), num_sms=num_sms)
    what = f"{kern} varlen lens_q={lens_q} lens_k={lens_k} H={hq}/{hkv} causal={causal} {kind} mods={mods}"

    masks = (philox.dropout_mask_varlen(lens_q, lens_k, hq, kw["dropout_p"], kw["seed"], kw["offset"])
             if "dropout_p" in kw else None)
    rk = ref_kwargs(kw, None)
    if masks is not None:
        rk["dropout_mask"] = masks
    q32, k32, v32 = (cp.asnumpy(_xpref.to_float32(x)) for x in (q, k, v))
    cq, ck = cp.asnumpy(cu_q), cp.asnumpy(cu_k)
    o64, lse64 = ref.attention_varlen_forward64(q32, k32, v32, cq, ck, causal, **rk)
    o_lowp = ref.attention_varlen_lowp(q32, k32, v32, cq, ck, dtype, causal, **rk)
    o32 = _xpref.to_float32(o)
    check_rule("o", o32, cp.asarray(o64), cp.asarray(o_lowp), 2, what)
    check_lse(lse, cp.asarray(lse64), what)
    assert bool((lse[:, rows_of(cq, 2)] == -cp.inf).all()), f"sequence 2 has queries and no keys: lse -inf, {what}"
    assert max_abs(o32[rows_of(cq, 2)]) == 0.0, f"sequence 2 has queries and no keys: o = 0, {what}"


def test_ws_varlen_without_lse_and_packed_map_rules(varlen_compiled):
    """lse = nullptr in a packed call; ws_params rejects a kv cache (seqused_k) and a half-packed SeqParams."""
    lens_q, lens_k = [130, 0, 77], [64, 5, 300]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q, k, v = (make_packed(sum(n), 4, 128, "bf16", "contiguous", seed_of("ws-varlen-nolse", i))
               for i, n in enumerate((lens_q, lens_k, lens_k)))
    kern = ws_kernel(128, "bf16", True)
    o, _ = run_ws_varlen(kern, q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), with_lse=False)
    q32, k32, v32 = (_xpref.to_float32(x) for x in (q, k, v))
    check_rule("o", _xpref.to_float32(o), _xpref.attention_varlen_forward64(q32, k32, v32, cu_q, cu_k, True)[0],
               _xpref.attention_varlen_lowp(q32, k32, v32, cu_q, cu_k, "bf16", True), 2, "varlen lse=nullptr")
    dims = (packed_dims(q), packed_dims(k), packed_dims(v), packed_dims(o))
    for seq in (_launch.seq_params(130, 300, 1, cu_q.data.ptr, cu_k.data.ptr, seqused_k=cu_k.data.ptr),
                _launch.seq_params(130, 300, 1, cu_q.data.ptr, None)):
        fwd = fwd_params(q, k, v, o, None, dims, seq, (0, 0), 1.0)
        with pytest.raises(ValueError, match="fwd_sm90_ws_kernel"):
            _tma.ws_params(fwd, q, k, v, *dims[:3], "bf16", kern)


def _median_ms(launch, reps=20, warmup=5):
    for _ in range(warmup):
        launch()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ws_speed_reading(causal):
    """FlashAttention benchmark shape (batch 4, N 4096, heads 16, D 128, bf16): TFLOP/s of fwd_sm90_ws_kernel
    (plain and pingpong) against fwd_sm90_kernel, printed (run with -s), not asserted."""
    from cuflash.config import fwd_sm90_config

    b, n, h, d = 4, 4096, 16, 128
    q, k, v = (make_input(b, n, h, d, "bf16", "bshd", "contiguous", seed_of("speed", i)) for i in range(3))
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    stream = cp.cuda.get_current_stream()
    dq = dims_of(q, "bshd")
    o = cp.empty_like(q)
    lse = cp.empty((b, h, n), dtype=cp.float32)
    fwd = _launch.FwdParams(
        q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=o.data.ptr, lse=lse.data.ptr, seq=_launch.seq_params(n, n, 1),
        q_batch_stride=dq.batch_stride, q_row_stride=dq.row_stride, q_head_stride=dq.head_stride,
        k_batch_stride=dq.batch_stride, k_row_stride=dq.row_stride, k_head_stride=dq.head_stride,
        v_batch_stride=dq.batch_stride, v_row_stride=dq.row_stride, v_head_stride=dq.head_stride,
        o_batch_stride=dq.batch_stride, o_row_stride=dq.row_stride, o_head_stride=dq.head_stride,
        lse_batch_stride=h * n, lse_head_stride=n, heads=h, head_dim=d, num_splits=1, rows_per_pos=1,
        scale_log2=_launch.scale_log2(1 / math.sqrt(d)))
    dev = cp.cuda.Device().id
    results = {}
    old = fwd_sm90_config(d, "bf16", causal)
    old_kernel = _launch.get_kernel(old, dev)
    results["fwd_sm90_kernel"] = _median_ms(lambda: old_kernel.launch(old.grid(b, h, n), fwd, stream.ptr))
    o_ref = o.copy()
    for pingpong in (False, True):
        cfg = config.fwd_sm90_ws_config(d, "bf16", causal, pingpong=pingpong)
        params = _tma.ws_params(fwd, q, k, v, dq, dq, dq, "bf16", cfg)
        kernel = _launch.get_kernel(cfg, dev)
        results[f"fwd_sm90_ws_kernel pingpong={pingpong}"] = _median_ms(
            lambda: kernel.launch(cfg.grid(b, h, n), params, stream.ptr))
        diff = float(cp.abs(o.astype(cp.float32) - o_ref.astype(cp.float32)).max())
        assert diff < 2e-2, f"ws kernel (pingpong={pingpong}) disagrees with fwd_sm90_kernel by {diff}"
    name = cp.cuda.runtime.getDeviceProperties(dev)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"\nbf16 b={b} N={n} h={h} d={d} causal={causal} ({name}):")
    for name, ms in results.items():
        print(f"  {name:40s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
