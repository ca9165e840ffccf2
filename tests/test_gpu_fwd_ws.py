"""The warp-specialized Hopper forward (fwd_sm90_ws_kernel: TMA, producer/consumer warpgroups, async wgmma,
pingpong) launched directly, before it is wired into cuflash.attention: O and lse against the float64 reference
under the pass rule of README.md (Tests), over awkward sequence lengths, both dtypes, causal and not, bshd, bhsd and
strided views, GQA. Needs an sm_90 GPU (skipped elsewhere, like every `gpu` test).

    python -m pytest -m gpu tests/test_gpu_fwd_ws.py -q -s     # -s prints the speed reading of the last test
"""
from __future__ import annotations

import math

import pytest

from cuflash import _compile, _launch, _tma, _xpref, config

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
from gpu_helpers import check_lse, check_rule, make_input, seed_of, to_bshd32  # noqa: E402

SEQLEN_PAIRS = [(113, 203), (128, 217), (256, 512), (512, 256), (1023, 1024), (1024, 1023), (1, 239), (127, 513)]
LAYOUTS = [("bshd", "contiguous"), ("bhsd", "contiguous"), ("bshd", "padded"), ("bhsd", "transposed")]


@pytest.fixture(scope="module", autouse=True)
def _hopper_only():
    if _compile.device_arch() != "sm_90a":
        pytest.skip("fwd_sm90_ws_kernel needs an sm_90 GPU (TMA, wgmma, setmaxnreg)")


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


def run_ws(cfg, q, k, v, layout, causal, scale=None, with_lse=True):
    """o (q's layout, contiguous, NaN-poisoned before the launch) and lse (B, H, Sq) float32 (or None)."""
    dq, dk, dv = dims_of(q, layout), dims_of(k, layout), dims_of(v, layout)
    b, sq, h, d = dq.batch, dq.seqlen, dq.heads, dq.head_dim
    o = _xpref.to_lowp(cp.full(q.shape, cp.nan, dtype=cp.float32), cfg.dtype)  # NaN in fp16 / bf16
    do = dims_of(o, layout)
    lse = cp.full((b, h, sq), cp.nan, dtype=cp.float32) if with_lse else None
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    fwd = _launch.FwdParams(
        q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=o.data.ptr, lse=lse.data.ptr if with_lse else 0,
        seq=_launch.seq_params(sq, dk.seqlen, h // dk.heads),
        q_batch_stride=dq.batch_stride, q_row_stride=dq.row_stride, q_head_stride=dq.head_stride,
        k_batch_stride=dk.batch_stride, k_row_stride=dk.row_stride, k_head_stride=dk.head_stride,
        v_batch_stride=dv.batch_stride, v_row_stride=dv.row_stride, v_head_stride=dv.head_stride,
        o_batch_stride=do.batch_stride, o_row_stride=do.row_stride, o_head_stride=do.head_stride,
        lse_batch_stride=h * sq, lse_head_stride=sq, heads=h, head_dim=d, num_splits=1, rows_per_pos=1,
        scale_log2=_launch.scale_log2(scale))
    params = _tma.ws_params(fwd, q, k, v, dq, dk, dv, cfg.dtype, cfg)
    kernel = _launch.get_kernel(cfg, cp.cuda.Device().id)
    kernel.launch(cfg.grid(b, h, sq), params, cp.cuda.get_current_stream().ptr)
    cp.cuda.get_current_stream().synchronize()
    return o, lse


def check_case(cfg, b, sq, sk, h, h_kv, layout, kind, causal):
    d, dtype = cfg.head_dim, cfg.dtype
    seed = seed_of("ws", d, dtype, sq, sk, h, h_kv, layout, kind, causal)
    q = make_input(b, sq, h, d, dtype, layout, kind, seed)
    k = make_input(b, sk, h_kv, d, dtype, layout, kind, seed + 1)
    v = make_input(b, sk, h_kv, d, dtype, layout, kind, seed + 2)
    o, lse = run_ws(cfg, q, k, v, layout, causal)
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
                                                     (64, "bf16", True, False), (256, "fp16", True, True)], ids=str)
def test_ws_forward_gqa(d, dtype, causal, pingpong, sq, sk):
    cfg = config.fwd_sm90_ws_config(d, dtype, causal, pingpong=pingpong)
    check_case(cfg, 2, sq, sk, 4, 2, "bshd", "contiguous", causal)


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
