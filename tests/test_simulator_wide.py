"""4- and 8-byte elements (fp32, tf32, fp64): the paper strategies scale with the element size, the cuflash strategy
counts the wide kernels of cuda/wide.cuh from their configs, and the HBM-vs-N plot draws several dtypes."""
import math

import numpy as np
import pytest

from cuflash import config
from cuflash.simulator import Problem, simulate
from cuflash.simulator.cli import main
from cuflash.simulator.model import DTYPE_BYTES

SCALE = {"fp32": 2, "tf32": 2, "fp64": 4}  # element bytes relative to fp16


def P(n, d=64, causal=False, batch=2, heads=3, nk=None, dtype="fp16"):
    return Problem(batch, heads, n, n if nk is None else nk, d, dtype, causal)


def test_element_and_statistic_sizes():
    assert {k: DTYPE_BYTES[k] for k in ("fp16", "bf16", "fp32", "tf32", "fp64")} == \
        {"fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4, "fp64": 8}
    assert [P(64, dtype=dt).stat_bytes for dt in ("fp16", "bf16", "fp32", "tf32", "fp64")] == [4, 4, 4, 4, 8], \
        "statistics and the dQ accumulator: fp32, fp64 for fp64 (as the float64 kernels keep them)"


@pytest.mark.parametrize("dtype", ["fp32", "tf32", "fp64"])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("n,d,causal", [(1024, 64, False), (1000, 96, True)])
def test_standard_traffic_scales_with_the_element_size(dtype, backward, n, d, causal):
    half, wide = (simulate("standard", P(n, d, causal, dtype=dt), backward=backward) for dt in ("fp16", dtype))
    assert wide.hbm_read_bytes == SCALE[dtype] * half.hbm_read_bytes
    assert wide.hbm_write_bytes == SCALE[dtype] * half.hbm_write_bytes
    assert wide.peak_extra_bytes == SCALE[dtype] * half.peak_extra_bytes
    assert wide.flops == half.flops


def _fa2_stat_bytes(p: Problem, backward: bool) -> int:
    """fa2's statistics traffic by hand (128 x 128 blocks, no mask): lse written once forward; backward: D written
    and dQ_acc zeroed (preprocess), lse, D and dQ_acc read-modify-written per visited (i, j), dQ_acc read (convert)."""
    sq, sk, d, s = p.seqlen_q, p.seqlen_k, p.head_dim, p.stat_bytes
    if not backward:
        return p.batch_heads * sq * s
    pair_rows = math.ceil(sk / 128) * sq  # every key block visits every query row
    return p.batch_heads * s * ((sq + sq * d) + pair_rows * (2 + d) + pair_rows * d + sq * d)


@pytest.mark.parametrize("dtype", ["fp32", "tf32", "fp64"])
@pytest.mark.parametrize("backward", [False, True])
def test_fa2_element_traffic_scales_with_the_element_size(dtype, backward):
    ph, pw = P(1000, 64), P(1000, 64, dtype=dtype)
    half, wide = simulate("fa2", ph, backward=backward), simulate("fa2", pw, backward=backward)
    elems_half = half.hbm_bytes - _fa2_stat_bytes(ph, backward)
    elems_wide = wide.hbm_bytes - _fa2_stat_bytes(pw, backward)
    assert elems_wide == SCALE[dtype] * elems_half, "Q, K, V, O, dO, dQ, dK, dV bytes double (fp32) / quadruple (fp64)"
    if dtype == "fp64":  # elements and statistics both twice fp32's
        assert wide.hbm_bytes == 2 * simulate("fa2", P(1000, 64, dtype="fp32"), backward=backward).hbm_bytes


def test_cuflash_wide_forward_is_a_hand_count_of_its_tiles():
    """fwd_wide_kernel, no mask: each query block reads Q once, K and V once per key tile; O and lse written once.
    (On sm_90a with the default kernels float32 runs fwd_sm90_tf32_kernel at this head dim: the same global
    traffic for its query blocks, and its shared-memory bytes counted; tests/test_fwd_tf32_compile.py.)"""
    b, h, n, d = 2, 3, 300, 64
    for dtype, e, s in (("fp32", 4, 4), ("tf32", 4, 4), ("fp64", 8, 8)):
        cfg = config.select("forward", 64, dtype, False, "sm_90a", kernels="mma")
        assert isinstance(cfg, config.FwdWideConfig) and cfg.v_split == 1
        bm, bn = cfg.block_m, cfg.block_n
        q_blocks, k_blocks = math.ceil(n / bm), math.ceil(n / bn)
        c = simulate("cuflash", P(n, d, batch=b, heads=h, dtype=dtype), kernels="mma")
        assert (c.block_m, c.block_n) == (bm, bn)
        assert c.hbm_read_bytes == b * h * (n * d + 2 * q_blocks * n * d) * e
        assert c.hbm_write_bytes == b * h * (n * d * e + n * s)
        assert c.flops_matmul == b * h * q_blocks * k_blocks * 4 * bm * bn * 64, "whole tiles"
        assert c.sram_read_bytes is None and c.sram_write_bytes is None and c.bank_conflicts is None, "not modelled"
        assert c.launches == 1 and c.peak_extra_bytes == 0
        auto = simulate("cuflash", P(n, d, batch=b, heads=h, dtype=dtype))
        tf32 = config.select("forward", 64, dtype, False, "sm_90a")
        if dtype == "fp64":
            assert auto.hbm_bytes == c.hbm_bytes and auto.sram_read_bytes is None
        else:
            assert isinstance(tf32, config.FwdSm90Tf32Config) and auto.sram_read_bytes > 0
            assert auto.hbm_read_bytes == b * h * (n * d + 2 * math.ceil(n / tf32.block_m) * n * d) * e
            assert auto.hbm_write_bytes == c.hbm_write_bytes


def test_cuflash_wide_forward_with_split_o_columns():
    """fp32 at head dim 256 splits O's columns over v_split CTAs: each reads Q and K whole, V its columns. With
    d = 200 on the 256 kernel both 128-column parts hold a real column (part 1: 72)."""
    n, d, e = 300, 200, 4
    cfg = config.select("forward", 256, "fp32", False, "sm_90a")
    assert cfg.v_split == 2
    q_blocks, k_blocks, parts = math.ceil(n / cfg.block_m), math.ceil(n / cfg.block_n), 2
    c = simulate("cuflash", P(n, d, batch=1, heads=1, dtype="fp32"))
    assert c.hbm_read_bytes == (parts * (n + q_blocks * n) + q_blocks * n) * d * e
    assert c.hbm_write_bytes == n * (d * e + 4)
    # each part: S over the 256-column head dim, P V over its 128 columns
    assert c.flops_matmul == q_blocks * k_blocks * parts * 2 * cfg.block_m * cfg.block_n * (256 + 128)


def test_cuflash_wide_backward_is_a_hand_count_of_its_tiles():
    """preprocess + bwd_wide_kernel (K/V-outer, dQ atomics) + convert, float64 (statistics and dQ_acc float64)."""
    b, h, n, d, e, s = 2, 3, 300, 64, 8, 8
    cfg = config.select("backward", 64, "fp64", False, "sm_90a")
    assert isinstance(cfg, config.BwdWideConfig)
    bm, bn, hd = cfg.block_m, cfg.block_n, cfg.head_dim
    q_blocks, k_blocks = math.ceil(n / bm), math.ceil(n / bn)
    pad = math.ceil(n / config.SEQLEN_Q_PAD) * config.SEQLEN_Q_PAD
    visits = k_blocks * q_blocks
    atomics = visits * bm * hd * s  # the whole [block_m, HEAD_DIM] tile per visit, read and written in the L2
    pre_r, pre_w = 2 * n * d * e + n * s, 2 * pad * s + pad * hd * s
    main_r = 2 * n * d * e + k_blocks * 2 * n * d * e + visits * 2 * bm * s + atomics
    main_w = 2 * n * d * e + atomics
    conv_r, conv_w = n * d * s, n * d * e
    c = simulate("cuflash", P(n, d, batch=b, heads=h, dtype="fp64"), backward=True)
    assert (c.block_m, c.block_n) == (bm, bn)
    assert c.hbm_read_bytes == b * h * (pre_r + main_r + conv_r)
    assert c.hbm_write_bytes == b * h * (pre_w + main_w + conv_w)
    assert c.launches == 3
    assert c.peak_extra_bytes == b * h * (2 * pad + pad * hd) * s
    assert c.flops_matmul == b * h * visits * 2 * bm * bn * hd * (2 * cfg.d_split + 3)
    assert c.sram_read_bytes is None and c.bank_conflicts is None


def test_cuflash_wide_backward_launch_names():
    """bwd_wide_kernel's three launches where the registry picks it (kernels="mma"; fp32 at head dim 128); on sm_90a
    fp32 and tf32 at head dim 64 the TF32 backward's: the preprocess, bwd_sm90_tf32_kernel over the 128-key blocks
    and bwd_dq_sm90_tf32_kernel over its query blocks of 128 rows, no dQ conversion and no atomics."""
    from cuflash.simulator.strategies import cuflash_backward_kernels, kernel_name

    for d, kernels in ((64, "mma"), (128, "auto")):
        ks = cuflash_backward_kernels(P(300, d, dtype="fp32"), kernels=kernels)
        assert [k.name for k in ks] == ["bwd_wide_preprocess_kernel", "bwd_wide_kernel", "bwd_wide_convert_dq_kernel"]
        assert ks[2].grid == (math.ceil(300 * d // 2 / 256), 3, 2), "one thread per pair of elements"
        assert ks[1].atomic_bytes > 0
    for dtype in ("fp32", "tf32"):
        main = config.select("backward", 64, dtype, False, "sm_90a")
        assert isinstance(main, config.BwdSm90Tf32Config)
        assert kernel_name(main) == "bwd_sm90_tf32_kernel"
        assert kernel_name(main.dq_config()) == "bwd_dq_sm90_tf32_kernel"
        for d in (64, 40):  # 40: the kernel head dim is 64 too
            ks = cuflash_backward_kernels(P(300, d, nk=517, dtype=dtype))
            assert [k.name for k in ks] == ["bwd_wide_preprocess_kernel", "bwd_sm90_tf32_kernel",
                                            "bwd_dq_sm90_tf32_kernel"]
            # 384 padded rows / 32 per CTA; 517 keys in 5 blocks of 128; 300 rows in 3 blocks of 128
            assert [k.grid for k in ks] == [(12, 3, 2), (5, 3, 2), (3, 3, 2)]
            assert [k.threads for k in ks] == [256, 384, 384]
            assert all(k.atomic_bytes == 0 for k in ks)


def _visible(sq, sk, causal, window):
    """[sq, sk] bool, element by element: query i sees key j (diag = sk - sq; causal: j <= i + diag; a window
    (left, right), -1 unbounded: i + diag - left <= j <= i + diag + right)."""
    i, j, diag = np.arange(sq)[:, None], np.arange(sk)[None, :], sk - sq
    ok = np.ones((sq, sk), dtype=bool)
    if causal:
        ok &= j <= i + diag
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= i + diag - left
        if right >= 0:
            ok &= j <= i + diag + right
    return ok


def _seen(vis, bm, bn):
    """[query blocks, key blocks] bool: the pair of blocks holds a visible (query, key) pair."""
    sq, sk = vis.shape
    return np.array([[vis[i:i + bm, j:j + bn].any() for j in range(0, sk, bn)] for i in range(0, sq, bm)])


def _sizes(n, block):
    return np.array([min(block, n - i) for i in range(0, n, block)])


@pytest.mark.parametrize("dtype", ["fp32", "tf32"])
@pytest.mark.parametrize("sq,sk,d", [(1000, 1000, 64), (300, 517, 64), (517, 300, 48)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (100, 20)), (True, (200, -1))])
def test_cuflash_tf32_backward_is_a_hand_count_of_its_tiles(dtype, sq, sk, d, causal, window):
    """The float32 Hopper backward by hand, its visited blocks from an element-by-element mask:
    bwd_wide_preprocess_kernel (no dq_accum to zero); bwd_sm90_tf32_kernel reads K and V once per 128-key block
    that some query sees, Q and dO (and BM lse_log2 and delta floats) once per (key block, BM-row query block)
    step (BM 16 for fp32, 32 for tf32), writes dK, dV once; bwd_dq_sm90_tf32_kernel reads Q and dO (and 128
    lse_log2 and delta floats) once per 128-row query block that sees a key and K, V once per visited key tile,
    writes dQ once. FLOPs: 4 products per step, 3 per dQ tile. Shared memory: the TMA boxes (lse_log2 and delta
    too), the splitters' reads and the parts they write (the kernels' shared layouts: K, V's parts once, a stage's
    tiles per step or key tile), the consumers' lse_log2 and delta reads, the wgmma operand reads of each of the
    two consumers."""
    b, h, e, s = 2, 3, 4, 4
    p = Problem(b, h, sq, sk, d, dtype, causal, window)
    main = config.select("backward", 64, dtype, False, "sm_90a")
    dqc = main.dq_config()
    bm = {"fp32": 16, "tf32": 32}[dtype]
    assert (main.block_m, main.block_n, dqc.block_m) == (bm, 128, 128)
    bn2 = dqc.block_n
    vis = _visible(sq, sk, causal, window)
    steps = _seen(vis, bm, 128)  # [query blocks of bm, key blocks of 128]
    tiles = _seen(vis, 128, bn2)  # [query blocks of 128, key tiles of bn2]
    rows_bm, keys128 = _sizes(sq, bm), _sizes(sk, 128)
    rows128, keys_t = _sizes(sq, 128), _sizes(sk, bn2)
    kv_blocks = steps.any(axis=0)
    q_blocks = tiles.any(axis=1)
    pad = math.ceil(sq / config.SEQLEN_Q_PAD) * config.SEQLEN_Q_PAD

    pre_r, pre_w = 2 * sq * d * e + sq * s, 2 * pad * s
    main_r = (2 * keys128[kv_blocks].sum() * d * e + 2 * (steps * rows_bm[:, None]).sum() * d * e
              + 2 * steps.sum() * bm * s)
    main_w = 2 * sk * d * e
    dq_r = (2 * rows128[q_blocks].sum() * d * e + 2 * q_blocks.sum() * 128 * s
            + 2 * (tiles * keys_t[None, :]).sum() * d * e)
    dq_w = sq * d * e
    c = simulate("cuflash", p, backward=True)
    assert (c.block_m, c.block_n, c.launches) == (bm, 128, 3)
    assert c.hbm_read_bytes == b * h * (pre_r + main_r + dq_r)
    assert c.hbm_write_bytes == b * h * (pre_w + main_w + dq_w)
    assert c.peak_extra_bytes == b * h * 2 * pad * s, "lse_log2 and delta, no dQ accumulator"
    assert c.flops_matmul == b * h * 2 * 64 * (4 * steps.sum() * bm * 128 + 3 * tiles.sum() * 128 * bn2)

    parts, products = (2, 3) if dtype == "fp32" else (1, 1)

    def bars(cfg):  # the mbarriers and the 1024 bytes that align the base
        return 8 * (2 + 3 * cfg.stages) + 1024

    kv, q = 4 * 128 * 64, 4 * bm * 64  # float32 tiles of HEAD_DIM columns: 128 keys, bm queries
    kv_parts = 2 * parts * kv  # K and V as the wgmma read them
    stage = (main.smem_bytes - bars(main) - kv_parts) // main.stages  # Q, dO split and transposed, lse_log2, delta
    ctas = kv_blocks.sum()
    w1 = ctas * (2 * kv + kv_parts) + steps.sum() * (2 * q + stage)
    vec_reads = 2 * 256 * (bm // 8) * 8  # lse_log2 and delta: a float2 per n8 tile and thread of 256
    r1 = (ctas * 2 * kv
          + steps.sum() * (2 * q + vec_reads + products * ((kv + 2 * q) + (kv + 2 * q) + 2 * q + 2 * q)))
    q2, kv2 = 4 * 128 * 64, 4 * bn2 * 64
    q_parts = 2 * parts * q2  # Q and dO as the wgmma read them
    stage2 = (dqc.smem_bytes - bars(dqc) - q_parts) // dqc.stages  # K split and K^T, V split
    w2 = q_blocks.sum() * (2 * q2 + q_parts) + tiles.sum() * (2 * kv2 + stage2)
    r2 = q_blocks.sum() * 2 * q2 + tiles.sum() * (2 * kv2 + products * ((q2 + 2 * kv2) + (q2 + 2 * kv2) + 2 * kv2))
    assert c.sram_write_bytes == b * h * (w1 + w2)
    assert c.sram_read_bytes == b * h * (r1 + r2)
    assert c.bank_conflicts is None, "not walked"


def test_cuflash_tf32_backward_visits_every_block_without_causal_skip():
    """causal_skip=False: the masked backward moves and computes what the unmasked one does."""
    full = simulate("cuflash", P(700, 64, nk=900, dtype="fp32"), backward=True)
    causal = simulate("cuflash", P(700, 64, causal=True, nk=900, dtype="fp32"), backward=True)
    noskip = simulate("cuflash", P(700, 64, causal=True, nk=900, dtype="fp32"), backward=True, causal_skip=False)
    assert causal.hbm_read_bytes < full.hbm_read_bytes and causal.sram_read_bytes < full.sram_read_bytes
    for field in ("hbm_read_bytes", "hbm_write_bytes", "sram_read_bytes", "sram_write_bytes", "flops_matmul"):
        assert getattr(noskip, field) == getattr(full, field), field


def test_cuflash_wide_causal_skips_tiles_and_l2_is_refused():
    full, causal = (simulate("cuflash", P(4096, 128, c, dtype="fp32")) for c in (False, True))
    assert causal.hbm_read_bytes < 0.6 * full.hbm_read_bytes
    with pytest.raises(ValueError, match="L2 model covers cuflash's fp16/bf16 kernels only"):
        simulate("cuflash", P(256, 64, dtype="fp32"), l2_bytes=50 << 20)
    with pytest.raises(ValueError, match="L2 model covers cuflash's fp16/bf16 kernels only"):
        simulate("cuflash", P(256, 64, dtype="fp32"), backward=True, l2_bytes=50 << 20)


def test_plot_hbm_vs_n_draws_each_strategy_once_per_dtype(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    labels = []
    save = Figure.savefig

    def savefig(fig, *args, **kw):
        labels.extend(t.get_text() for t in fig.axes[0].get_legend().get_texts())
        return save(fig, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    out = tmp_path / "hbm_dtypes.png"
    assert main(["plot", "hbm-vs-n", "--dtype", "fp16", "fp32", "--strategy", "fa2", "--strategy", "cuflash",
                 "--seqlen", "256", "1024", "4096", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [x for x in labels if not x.startswith("slope")]
    assert [x.split(" (")[0] for x in lines] == ["fa2 fp16", "cuflash fp16", "fa2 fp32", "cuflash fp32"]
    labels.clear()
    assert main(["plot", "hbm-vs-n", "--strategy", "fa2", "--seqlen", "256", "1024", "--out", str(out)]) == 0
    assert labels[0] == "fa2 (B_r=128, B_c=128)", "one dtype: the labels of before"
