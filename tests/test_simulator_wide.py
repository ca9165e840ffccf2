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


# Shared-memory bytes of the wide kernels by hand: their loops over warps, mma k-steps (k 8: TF32 m16n8k8, float64
# m16n8k8 on sm_90a) and n8 tiles, each fragment element loaded once per use (A: 16 x 8, B: 8 x 8; an accumulator
# fragment: 4 values per thread), cp.async tiles written whole.
MMA_K = 8


def _wide_fwd_shared_by_hand(cfg, seen, e, d):
    """fwd_wide_kernel over the visited (query block, key block) pairs `seen`, all column parts."""
    hd, bm, bn, nw = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.num_warps
    v_cols = hd // cfg.v_split
    read = write = 0
    for part in range(cfg.v_split):
        if part * v_cols >= d:
            continue  # a part past the head dim returns at once
        for i in range(seen.shape[0]):
            if not seen[i].any():
                continue
            write += bm * hd * e  # Q
            for j in np.flatnonzero(seen[i]):
                write += bn * hd * e + bn * v_cols * e  # K, V's columns
                for _warp in range(nw):
                    for _k0 in range(0, hd, MMA_K):
                        read += 16 * MMA_K * e  # A: the warp's Q rows
                        read += (bn // 8) * 8 * MMA_K * e  # B: K, per n8 key tile
                    for _nt in range(bn // 8):
                        read += (v_cols // 8) * 8 * 8 * e  # B of P V: 8 keys x 8 columns per tile
    return read, write


def _wide_bwd_step_by_hand(cfg, e, a, fp64):
    """bwd_wide_kernel, one step (query block) of one CTA: (read, write)."""
    hd, bm, bn, nw, ds = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.d_split
    q_tiles, cols = bm // 8, hd // ds
    frag = 32 * 4 * a  # one n8 accumulator tile of a warp
    read = 0
    write = 2 * bm * hd * e + 2 * bm * a  # Q, dO, lse_log2, delta

    def by_head_dim():  # S^T or dP^T over the warp's head-dim slice, sum_slices, then lse_log2 or delta
        r = w = 0
        for _k0 in range(0, cols, MMA_K):
            r += 16 * MMA_K * e + q_tiles * 8 * MMA_K * e
        if ds > 1:
            w += q_tiles * frag
            r += (ds - 1) * q_tiles * frag
        return r + q_tiles * 32 * 2 * a, w

    for warp in range(nw):
        slice_ = warp % ds
        if fp64 and ds > 1:  # S^T by queries: owners of whole n8 query tiles, one chain over the head dim
            qs = max(1, q_tiles // ds)
            if slice_ < q_tiles // qs:
                for _k0 in range(0, hd, MMA_K):
                    read += 16 * MMA_K * e + qs * 8 * MMA_K * e
                read += qs * 32 * 2 * a  # lse_log2
                write += qs * frag  # P^T into the slot
            read += q_tiles * frag  # the group's whole P^T
        else:
            r, w = by_head_dim()  # S^T
            read, write = read + r, write + w
        read += q_tiles * (cols // 8) * 8 * 8 * e  # dV += P^T dO
        r, w = by_head_dim()  # dP^T
        read, write = read + r, write + w
        read += q_tiles * (cols // 8) * 8 * 8 * e  # dK += dS^T Q
        if slice_ == 0:
            write += q_tiles * frag  # dS for the dQ GEMM
    dq_m = min(nw, bm // 16)
    dq_d = nw // dq_m
    for _warp in range(nw):  # dQ += dS K over the warp grid
        for _k0 in range(0, bn, MMA_K):
            read += (bm // 16 // dq_m) * 16 * MMA_K * a + (hd // 8 // dq_d) * 8 * MMA_K * e
    return read, write


def _wide_bwd_shared_by_hand(cfg, seen, e, a, fp64):
    """bwd_wide_kernel over the visited (query block, key block) pairs `seen`."""
    step_r, step_w = _wide_bwd_step_by_hand(cfg, e, a, fp64)
    ctas = int(seen.any(axis=0).sum())
    return int(seen.sum()) * step_r, ctas * 2 * cfg.block_n * cfg.head_dim * e + int(seen.sum()) * step_w


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
        every = np.ones((q_blocks, k_blocks), dtype=bool)
        assert (c.sram_read_bytes, c.sram_write_bytes) == tuple(
            b * h * x for x in _wide_fwd_shared_by_hand(cfg, every, e, d)), "shared bytes in program order"
        assert c.bank_conflicts is None, "not walked"
        assert c.launches == 1 and c.peak_extra_bytes == 0
        auto = simulate("cuflash", P(n, d, batch=b, heads=h, dtype=dtype))
        tf32 = config.select("forward", 64, dtype, False, "sm_90a")
        if dtype == "fp64":
            assert (auto.hbm_bytes, auto.sram_read_bytes, auto.sram_write_bytes) == \
                (c.hbm_bytes, c.sram_read_bytes, c.sram_write_bytes)
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
    every = np.ones((q_blocks, k_blocks), dtype=bool)
    assert (c.sram_read_bytes, c.sram_write_bytes) == tuple(
        b * h * x for x in _wide_bwd_shared_by_hand(cfg, every, e, s, True))
    assert c.bank_conflicts is None



@pytest.mark.parametrize("dtype,d", [("fp32", 64), ("fp64", 64), ("fp64", 128), ("fp32", 256), ("fp32", 200)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (100, 20))])
def test_cuflash_wide_shared_bytes_are_a_hand_count(dtype, d, causal, window):
    """fwd_wide_kernel and bwd_wide_kernel (kernels="mma"), their shared-memory bytes against the kernels' loops by
    hand over the blocks an element-by-element mask visits: float32 at head dim 256 splits O over two CTAs in the
    forward (d 200: both parts hold columns) and gives each key group four warps in the backward (sum_slices of
    three partial sums), float64 splits the backward's S^T by queries."""
    b, h, sq, sk = 2, 3, 300, 517
    e = s = 8 if dtype == "fp64" else 4
    kd = config.kernel_head_dim(d, dtype)
    p = Problem(b, h, sq, sk, d, dtype, causal, window)
    vis = _visible(sq, sk, causal, window)
    fcfg = config.select("forward", kd, dtype, causal, "sm_90a", kernels="mma",
                         mods=config.MOD_WINDOW if window else 0)
    c = simulate("cuflash", p, kernels="mma")
    assert (c.block_m, c.block_n) == (fcfg.block_m, fcfg.block_n)
    assert (c.sram_read_bytes, c.sram_write_bytes) == tuple(
        b * h * x for x in _wide_fwd_shared_by_hand(fcfg, _seen(vis, fcfg.block_m, fcfg.block_n), e, d))
    bcfg = config.select("backward", kd, dtype, causal, "sm_90a", kernels="mma",
                         mods=config.MOD_WINDOW if window else 0)
    c = simulate("cuflash", p, backward=True, kernels="mma")
    assert (c.block_m, c.block_n) == (bcfg.block_m, bcfg.block_n)
    assert (c.sram_read_bytes, c.sram_write_bytes) == tuple(
        b * h * x for x in _wide_bwd_shared_by_hand(bcfg, _seen(vis, bcfg.block_m, bcfg.block_n), e, s,
                                                    dtype == "fp64"))


def test_cuflash_wide_backward_shared_bytes_with_idle_s_warps():
    """The deterministic float64 backward at head dim 128 on sm_80 (16 x 32 tiles, four warps per key group, two n8
    query tiles): the first two warps of a group compute S^T, all four read its P^T. By hand: per step and CTA (two
    key groups) the S^T products read 2 groups x (2 owners x 16 + 16 query rows) x 128 columns, and every warp reads
    the whole 16 x 16 P^T of its group."""
    from cuflash.simulator.strategies import _wide_bwd_shared

    cfg = config.bwd_wide_config(128, "fp64", False, 0, "sm_80", deterministic=True)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.d_split) == (16, 32, 8, 4)
    n = 64
    p = Problem(1, 1, n, n, 128, "fp64", False)
    steps, ctas = (n // 16) * (n // 32), n // 32
    assert _wide_bwd_shared(p, cfg, True) == _wide_bwd_shared_by_hand(cfg, np.ones((n // 16, n // 32), dtype=bool),
                                                                      8, 8, True)
    read, write = _wide_bwd_shared(p, cfg, True)
    s_products = 2 * (2 * 16 + 16) * 128 * 8
    p_reads, p_writes, lse = 8 * 16 * 16 * 8, 2 * 16 * 16 * 8, 2 * 2 * 32 * 2 * 8
    slices = 2 * 4 * (16 + 16) * 32 * 8  # dP^T over each warp's 32 columns
    sums = 8 * 3 * 16 * 16 * 8  # dP^T's partial sums: three other slices per warp
    vecs = 8 * 2 * 32 * 2 * 8  # delta: each warp, 2 n8 tiles
    dkv = 2 * 8 * 16 * 32 * 8  # dV and dK: each warp its 32 columns of 16 rows of dO / Q
    dq = 8 * (16 * 32 * 8 + 16 * 32 * 8)  # each warp: all 16 dS rows x 32 keys, 16 of K^T's columns x 32 keys
    assert read == steps * (s_products + p_reads + lse + slices + sums + vecs + dkv + dq)
    step_w = 2 * 16 * 128 * 8 + 2 * 16 * 8 + p_writes + 8 * 16 * 16 * 8 + 2 * 16 * 16 * 8
    assert write == ctas * 2 * 32 * 128 * 8 + steps * step_w

def test_cuflash_wide_backward_launch_names():
    """bwd_wide_kernel's three launches where the registry picks it (kernels="mma"; fp32 at head dim 256); on sm_90a
    fp32 and tf32 at head dim 64 the TF32 backward's: the preprocess, bwd_sm90_tf32_kernel over the 128-key blocks
    and bwd_dq_sm90_tf32_kernel over its query blocks of 128 rows, no dQ conversion and no atomics; at head dim 128
    their cluster pairs (twice the CTAs, each pair reading its block's lse_log2 and delta twice)."""
    from cuflash.simulator.strategies import cuflash_backward_kernels, kernel_name

    for d, kernels in ((64, "mma"), (128, "mma"), (256, "auto")):
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
        main = config.select("backward", 128, dtype, False, "sm_90a")
        assert isinstance(main, config.BwdSm90Tf32Config) and main.split == main.dq_config().split == 2
        assert kernel_name(main) == "bwd_sm90_tf32_pair_kernel"
        assert kernel_name(main.dq_config()) == "bwd_dq_sm90_tf32_pair_kernel"
        for d in (128, 96):  # 96: the kernel head dim is 128 too
            ks = cuflash_backward_kernels(P(300, d, nk=517, dtype=dtype))
            assert [k.name for k in ks] == ["bwd_wide_preprocess_kernel", "bwd_sm90_tf32_pair_kernel",
                                            "bwd_dq_sm90_tf32_pair_kernel"]
            # two CTAs per 128-key block (5) and per 128-row query block (3)
            assert [k.grid for k in ks] == [(12, 3, 2), (10, 3, 2), (6, 3, 2)]
            # K, V once per key block, Q, dO once per step (each CTA its half of the columns: whole rows per pair),
            # lse_log2 and delta per step by both CTAs of a pair
            steps = 5 * math.ceil(300 / main.block_m)
            assert ks[1].read_bytes == 2 * 3 * (2 * 517 * d * 4 + 5 * 2 * 300 * d * 4
                                                 + 2 * 2 * steps * main.block_m * 4)
            assert ks[1].write_bytes == 2 * 3 * 2 * 517 * d * 4 and ks[2].write_bytes == 2 * 3 * 300 * d * 4


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
    too), the reads of the split and the parts it writes (the kernels' shared layouts: K, V's parts once, a stage's
    tiles per step or key tile), the consumers' lse_log2 and delta reads, the wgmma operand reads of each of the
    two consumers (the dQ kernel's Q and dO, the dK / dV kernel's K where it holds them in registers)."""
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
    # Q, dO split and transposed, lse_log2, delta (less the stage's 16 bytes of step words: a mask kernel's producer
    # writes them, for the steps a BlockMask's map leaves)
    stage = (main.smem_bytes - bars(main) - kv_parts) // main.stages - 16
    ctas = kv_blocks.sum()
    w1 = ctas * (2 * kv + kv_parts) + steps.sum() * (2 * q + stage)
    vec_reads = 2 * 256 * (bm // 8) * 8  # lse_log2 and delta: a float2 per n8 tile and thread of 256
    # K's big part (3xTF32) as A registers over main.k_reg_steps of the 8 k8 steps: read once per key block, then
    # by two of the three products of S^T fewer per step in those k8 steps
    k_big = kv * main.k_reg_steps // 8
    r1 = (ctas * (2 * kv + k_big)
          + steps.sum() * (2 * q + vec_reads + products * ((kv + 2 * q) + (kv + 2 * q) + 2 * q + 2 * q) - 2 * k_big))
    q2, kv2 = 4 * 128 * 64, 4 * bn2 * 64
    q_parts = 2 * parts * q2  # Q and dO as the wgmma read them
    stage2 = (dqc.smem_bytes - bars(dqc) - q_parts) // dqc.stages  # K split and K^T, V split
    w2 = q_blocks.sum() * (2 * q2 + q_parts) + tiles.sum() * (2 * kv2 + stage2)
    # Q and dO (a_regs of them) as A registers: read once per query block, and then by one product of S (dP) fewer
    # per key tile in one pass, two fewer in 3xTF32
    held = {"fp32": 0, "tf32": 2}[dtype]  # the shipped tiles at head dim 64
    assert dqc.a_regs == held
    r2 = q_blocks.sum() * (2 + held) * q2 + tiles.sum() * (
        2 * kv2 + products * ((q2 + 2 * kv2) + (q2 + 2 * kv2) + 2 * kv2) - held * (2 if products == 3 else 1) * q2)
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


# The deterministic wide backward's tiles (block_m, block_n) on sm_90a: fp32 and fp64 at head dim 128 as in the
# default mode, fp64 at head dim 64 its own (32 x 64, half of each warp's dK / dV columns), and the rows of dQ_acc per
# turn counter (a 32-row query block has two counters, one release add per visit).
DET_TILES = {("fp32", 128): (32, 64), ("fp64", 64): (32, 64), ("fp64", 128): (16, 64)}
TURN_ROWS = 16


@pytest.mark.parametrize("dtype,d", list(DET_TILES))
@pytest.mark.parametrize("sq,sk", [(300, 517), (517, 300), (256, 256)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (100, 20)), (True, (200, -1))])
def test_cuflash_wide_deterministic_backward_is_a_hand_count(dtype, d, sq, sk, causal, window):
    """Deterministic, fp32 / tf32 / fp64 run the ordered bwd_wide_kernel: the default mode's three launches and
    accesses, plus an int32 turn counter per 16 padded rows (zeroed by the preprocess, and part of the workspace)
    and per visited (key block, query block) one 4-byte release add to the query block's counter, counted as an
    atomic (a read and a write). The visits come from an element-by-element mask."""
    from cuflash.simulator.strategies import cuflash_backward_kernels

    b, h = 2, 3
    e = s = 8 if dtype == "fp64" else 4
    bm, bn = DET_TILES[dtype, d]
    p = Problem(b, h, sq, sk, d, dtype, causal, window)
    # (fp32 at head dim 128 runs the TF32 cluster pairs on sm_90a by default: the wide kernels with kernels="mma")
    kernels = "mma" if dtype == "fp32" else "auto"
    cfg = config.select("backward", d, dtype, causal, "sm_90a", deterministic=True, kernels=kernels)
    assert isinstance(cfg, config.BwdWideConfig) and cfg.deterministic and config.ordered_dq(cfg)
    assert (cfg.block_m, cfg.block_n) == (bm, bn)
    steps = _seen(_visible(sq, sk, causal, window), bm, bn)  # [query blocks, key blocks]: the visits
    rows, keys = _sizes(sq, bm), _sizes(sk, bn)
    pad = math.ceil(sq / 128) * 128
    turns = math.ceil(pad / TURN_ROWS) * 4
    visits = int(steps.sum())
    pre_r, pre_w = 2 * sq * d * e + sq * s, 2 * pad * s + pad * d * s + turns
    main_r = (2 * keys[steps.any(axis=0)].sum() * d * e + 2 * (steps * rows[:, None]).sum() * d * e
              + 2 * visits * bm * s)
    main_w = 2 * sk * d * e
    atomics = visits * (bm * d * s + 4)  # the dQ tile's adds and the counter's add
    conv_r, conv_w = sq * d * s, sq * d * e
    ks = cuflash_backward_kernels(p, deterministic=True, kernels=kernels)
    assert [k.name for k in ks] == ["bwd_wide_preprocess_kernel", "bwd_wide_kernel", "bwd_wide_convert_dq_kernel"]
    assert ks[0].write_bytes == b * h * pre_w, "delta, lse_log2, dq_accum and the counters zeroed"
    assert ks[1].atomic_bytes == b * h * atomics
    assert ks[1].grid == (math.ceil(sk / bn), h, b)
    c = simulate("cuflash", p, backward=True, deterministic=True, kernels=kernels)
    assert (c.block_m, c.block_n, c.launches) == (bm, bn, 3)
    assert c.hbm_read_bytes == b * h * (pre_r + main_r + atomics + conv_r)
    assert c.hbm_write_bytes == b * h * (pre_w + main_w + atomics + conv_w)
    assert c.peak_extra_bytes == b * h * (2 * pad * s + pad * d * s + turns), "lse_log2, delta, dq_accum, counters"
    # S^T, dP^T (the warps of a key group sum their head-dim slices), dV, dK, dQ
    assert c.flops_matmul == b * h * visits * 2 * bm * bn * d * 5
    # shared bytes: float64 splits S^T by queries (fp64 D 64 on 32 x 64: two query tiles per warp; D 128: one)
    assert (c.sram_read_bytes, c.sram_write_bytes) == tuple(
        b * h * x for x in _wide_bwd_shared_by_hand(cfg, steps, e, s, dtype == "fp64"))
    assert c.bank_conflicts is None
    if dtype == "fp32":  # the default mode's tiles: the same traffic but the counters and their adds
        default = cuflash_backward_kernels(p, kernels=kernels)
        assert [(k.name, k.grid, k.read_bytes) for k in ks] == [(k.name, k.grid, k.read_bytes) for k in default]
        assert ks[0].write_bytes == default[0].write_bytes + b * h * turns
        assert ks[1].atomic_bytes == default[1].atomic_bytes + b * h * visits * 4
        a = simulate("cuflash", p, backward=True, kernels=kernels)
        assert c.hbm_write_bytes == a.hbm_write_bytes + b * h * (turns + visits * 4)
        assert c.peak_extra_bytes == a.peak_extra_bytes + b * h * turns and c.flops == a.flops


@pytest.mark.parametrize("causal,window,visits", [(False, None, 32), (True, None, 8 + 6 + 4 + 2),
                                                  (False, (100, 20), 6 + 7 + 5 + 3)])
def test_cuflash_fp64_deterministic_backward_by_hand(causal, window, visits):
    """fp64 at head dim 64, 256 x 256, deterministic (sm_90a): 32-row query blocks, 64-key blocks (4 x 8 blocks).
    Causal, key block n is seen by query blocks 2n..7; with the window (100, 20) by those whose rows 32m..32m+31 see
    a key of [64n, 64n + 63] (i - 100 <= j <= i + 20, i.e. some row i in [64n - 20, 64n + 163]): 0-5, 1-7, 3-7, 5-7.
    256 padded rows: 256 / 16 = 16 counters per head (two per query block); each visit adds 32 x 64 float64 dQ
    atomics and one 4-byte release add."""
    from cuflash.simulator.strategies import cuflash_backward_kernels

    b, h, n, d = 1, 2, 256, 64
    p = Problem(b, h, n, n, d, "fp64", causal, window)
    c = simulate("cuflash", p, backward=True, deterministic=True)
    a = simulate("cuflash", p, backward=True)
    assert (a.block_m, a.block_n) == (16, 128) and (c.block_m, c.block_n) == (32, 64)
    assert c.peak_extra_bytes == h * (2 * 256 * 8 + 256 * 64 * 8 + 16 * 4)
    assert c.peak_extra_bytes - a.peak_extra_bytes == h * 16 * 4
    ks = cuflash_backward_kernels(p, deterministic=True)
    assert len(ks) == 3
    assert ks[0].write_bytes == h * (2 * 256 * 8 + 256 * 64 * 8 + 16 * 4)
    assert ks[1].atomic_bytes == h * visits * (32 * 64 * 8 + 4)
    assert ks[1].grid == (4, h, b)


@pytest.mark.parametrize("dtype", ["fp32", "tf32"])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (100, 20))])
def test_cuflash_tf32_backward_is_deterministic_as_it_is(dtype, causal, window):
    """On sm_90a fp32 and tf32 at head dim 64 run the float32 Hopper backward (no atomics) in either mode:
    deterministic=True counts what the default mode counts. With kernels="mma" the same problem runs the ordered
    bwd_wide_kernel (counters and their adds)."""
    import dataclasses

    from cuflash.simulator.strategies import cuflash_backward_kernels

    p = Problem(2, 3, 300, 517, 64, dtype, causal, window)
    assert isinstance(config.select("backward", 64, dtype, causal, "sm_90a", deterministic=True),
                      config.BwdSm90Tf32Config)
    det, default = (simulate("cuflash", p, backward=True, deterministic=x) for x in (True, False))
    assert dataclasses.asdict(det) == dataclasses.asdict(default)
    assert cuflash_backward_kernels(p, deterministic=True) == cuflash_backward_kernels(p)
    mma = cuflash_backward_kernels(p, deterministic=True, kernels="mma")
    assert mma[1].name == "bwd_wide_kernel" and mma[1].atomic_bytes > \
        cuflash_backward_kernels(p, kernels="mma")[1].atomic_bytes


@pytest.mark.parametrize("dtype,d", list(DET_TILES))
@pytest.mark.parametrize("causal,window,deterministic,reversed_", [
    (True, None, True, True), (False, (100, 0), True, True), (False, (-1, 30), True, True),
    (False, None, True, False), (True, None, False, False)])
def test_ordered_wide_backward_launches_the_last_key_blocks_first(dtype, d, causal, window, deterministic,
                                                                  reversed_):
    """The ordered bwd_wide_kernel with causal or a window runs key block gridDim.x - 1 - blockIdx.x (its turns per
    query block count down from the last key block that the block sees): the L2 model's trace takes its CTAs in that
    launch order (CTA 0 loads the last K block); without a band, or not deterministic, key block blockIdx.x."""
    from cuflash.simulator import l2

    n = 512
    bm, bn = DET_TILES[dtype, d]
    p = Problem(1, 1, n, n, d, dtype, causal, window)
    tr = l2._Trace(p, "tile")
    # (fp32 at head dim 128 runs the TF32 cluster pairs on sm_90a by default: the wide kernels with kernels="mma")
    l2._cuflash_bwd(tr, p, True, 132, deterministic, "mma" if dtype == "fp32" else "auto")
    assert ("dq_turns" in tr.tensors) is deterministic
    first, per_bh, _, rows, _ = tr.tensors["k"]
    if not deterministic:  # the default mode's tiles
        bn = config.bwd_wide_config(d, dtype, causal).block_n
    blocks = n // bn
    assert rows * per_bh == n
    # kernel 1, in launch order (one wave: cta = blockIdx.x): the key block of the first unit of K each CTA reads
    k_block = {}
    for kernel, _, _, cta, _, ids, _ in tr.parts:
        sel = (kernel == 1) & (ids >= first) & (ids < first + per_bh)
        for c, u in zip(cta[sel], ids[sel] - first):
            k_block.setdefault(int(c), int(u) * rows // bn)
    want = list(range(blocks))[::-1] if reversed_ else list(range(blocks))
    assert [k_block[c] for c in range(blocks)] == want


@pytest.mark.parametrize("dtype,d", list(DET_TILES))
@pytest.mark.parametrize("causal", [False, True])
def test_ordered_wide_backward_counters_in_the_l2_trace(dtype, d, causal):
    """An L2 of one sector misses every access of the ordered bwd_wide_kernel's trace (whole blocks: 512 x 512):
    what the counts list, except that a counter's unit (one per 16- or 32-row query block) weighs a 32-byte sector
    where the counts take its 4 bytes: written by the preprocess, read and written by each visit's add."""
    from cuflash.simulator import l2

    b, h, n = 1, 2, 512
    bm, bn = DET_TILES[dtype, d]
    p = Problem(b, h, n, n, d, dtype, causal)
    tr = l2._Trace(p, "tile")
    l2._cuflash_bwd(tr, p, True, 132, True, "mma" if dtype == "fp32" else "auto")  # (wide at fp32 128: mma)
    assert tr.tensors["dq_turns"][1] == n // bm, "a unit per query block"
    r = tr.run(1)
    c = simulate("cuflash", p, backward=True, deterministic=True, kernels="mma" if dtype == "fp32" else "auto")
    k_blocks, q_blocks = n // bn, n // bm
    # causal (diag 0): key block j is seen by query blocks j * bn / bm .. q_blocks - 1
    visits = sum(q_blocks - j * bn // bm for j in range(k_blocks)) if causal else k_blocks * q_blocks
    preprocess = q_blocks * 32 - n // TURN_ROWS * 4
    assert r.read_bytes == c.hbm_read_bytes + b * h * visits * (32 - 4)
    assert r.write_bytes == c.hbm_write_bytes + b * h * (visits * (32 - 4) + preprocess)
