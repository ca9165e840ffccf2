"""Claims of the FlashAttention papers as exact counts, and the counting conventions."""
import math

import pytest

from cuflash import config
from cuflash.simulator import Problem, simulate
from cuflash.simulator.model import STAT_BYTES


def P(n, d=64, causal=False, batch=1, heads=1, nk=None, dtype="fp16"):
    return Problem(batch, heads, n, n if nk is None else nk, d, dtype, causal)


@pytest.mark.parametrize("n,d", [(256, 64), (1024, 64), (1000, 96), (4096, 128)])
def test_standard_forward_moves_4n2_plus_4nd_elements_per_head(n, d):
    c = simulate("standard", P(n, d, batch=2, heads=3))
    expected = 2 * 3 * (4 * n * n + 4 * n * d) * 2
    assert c.hbm_bytes == expected, f"standard forward N={n} d={d}: {c.hbm_bytes} != {expected}"
    assert c.launches == 3 and c.peak_extra_bytes == 2 * 3 * 2 * n * n * 2, "S and P live in HBM"


@pytest.mark.parametrize("n,d", [(256, 64), (1024, 64), (1000, 96)])
def test_standard_backward_moves_7n2_plus_8nd_elements_per_head(n, d):
    """Algorithm 3: dV = P^T dO (N^2 + Nd read, Nd write), dP = dO V^T (2Nd, N^2), dS from P and dP
    (2N^2, N^2), dQ = dS K (N^2 + Nd, Nd), dK = dS^T Q (N^2 + Nd, Nd)."""
    c = simulate("standard", P(n, d), backward=True)
    assert c.hbm_read_bytes == (5 * n * n + 5 * n * d) * 2
    assert c.hbm_write_bytes == (2 * n * n + 3 * n * d) * 2
    assert c.hbm_bytes == (7 * n * n + 8 * n * d) * 2


def test_fa1_blocks_follow_algorithm_1():
    c = simulate("fa1", P(1024, 64), sram_bytes=64 * 1024)  # M = 32768 fp16 elements
    assert (c.block_m, c.block_n) == (64, 128), "B_c = ceil(M/4d) = 128, B_r = min(B_c, d) = 64"
    c = simulate("fa1", P(1024, 256), sram_bytes=64 * 1024)
    assert (c.block_m, c.block_n) == (32, 32)


@pytest.mark.parametrize("backward", [False, True])
def test_fa1_traffic_is_theta_n2_d2_over_m(backward):
    """Theorem 2 / 5: halving the SRAM size M about doubles FA1's HBM traffic (while B_r = d)."""
    p = P(16384, 64)
    sizes = [256 * 1024, 128 * 1024, 64 * 1024]
    traffic = [simulate("fa1", p, sram_bytes=m, backward=backward).hbm_bytes for m in sizes]
    for big, small, m in zip(traffic, traffic[1:], sizes[1:]):
        assert 1.8 < small / big < 2.1, f"M {m * 2} -> {m}: traffic x{small / big:.2f}, expected about 2"
    # and it grows as N^2 for fixed M
    t1, t2 = (simulate("fa1", P(n, 64), sram_bytes=64 * 1024, backward=backward).hbm_bytes for n in (8192, 16384))
    assert 3.8 < t2 / t1 < 4.1, f"doubling N: x{t2 / t1:.2f}, expected about 4"


@pytest.mark.parametrize("sq,sk,bm,bn", [(1024, 1024, 128, 128), (1000, 1500, 64, 128), (113, 203, 128, 64)])
def test_fa2_forward_reads_q_once_and_kv_once_per_q_block(sq, sk, bm, bn):
    d, e = 64, 2
    c = simulate("fa2", P(sq, d, batch=2, heads=2, nk=sk), block_m=bm, block_n=bn)
    t_r = math.ceil(sq / bm)
    assert c.hbm_read_bytes == 4 * (sq * d + t_r * 2 * sk * d) * e
    assert c.hbm_write_bytes == 4 * (sq * d * e + sq * STAT_BYTES), "O and lse written once"
    assert c.peak_extra_bytes == 0 and c.launches == 1


def test_causal_block_skipping_halves_kv_reads():
    """Sq = Sk, B_r = B_c: row block i visits i + 1 key blocks, T(T+1)/2 of T^2 tiles."""
    n, b, d = 4096, 128, 64
    full = simulate("fa2", P(n, d), block_m=b, block_n=b)
    causal = simulate("fa2", P(n, d, causal=True), block_m=b, block_n=b)
    t = n // b
    kv = lambda c: c.hbm_read_bytes - n * d * 2  # noqa: E731  (minus the Q reads)
    assert kv(causal) * 2 * t == kv(full) * (t + 1)
    assert causal.flops_matmul * 2 * t == full.flops_matmul * (t + 1)
    no_skip = simulate("fa2", P(n, d, causal=True), block_m=b, block_n=b, causal_skip=False)
    assert no_skip.hbm_bytes == full.hbm_bytes, "without skipping every tile is visited (and masked)"


def test_causal_rows_that_see_no_key_read_nothing():
    # Sq > Sk, bottom-right: queries 0 .. Sq-Sk-1 see no key
    c = simulate("fa2", P(512, 64, causal=True, nk=128), block_m=128, block_n=128)
    assert c.hbm_read_bytes == (128 * 64 + 2 * 128 * 64) * 2, "only the last row block reads Q, K, V"
    assert c.hbm_write_bytes == 512 * (64 * 2 + 4), "every row still writes O = 0 and lse = -inf"


@pytest.mark.parametrize("strategy", ["standard", "fa1", "fa2", "cuflash"])
@pytest.mark.parametrize("causal", [False, True])
def test_useful_flops_are_the_problems(strategy, causal):
    n, d = 1000, 64
    f = simulate(strategy, P(n, d, causal=causal))
    b = simulate(strategy, P(n, d, causal=causal), backward=True)
    pairs = n * (n + 1) // 2 if causal else n * n
    assert f.flops_useful == 4 * d * pairs
    assert b.flops_useful == 10 * d * pairs, "backward = 2.5 x forward (docs/PERFORMANCE.md)"
    assert f.flops_matmul >= f.flops_useful and b.flops_matmul >= 0.8 * b.flops_useful, \
        "an algorithm computes at least the kept pairs (standard's backward skips the S recompute)"


def _expected_tiles(hd, causal, kernels, backward=False, seqlen_k=None):
    """The tile table entry the library launches on an H100, looked up by hand."""
    if kernels == "auto" and not backward and hd in config.FWD_SM90_WS_TILES:  # fwd_sm90_ws_kernel
        short = seqlen_k is not None and seqlen_k <= (config.FWD_SM90_WS_CAUSAL_SHORT_KEYS if causal
                                                      else config.FWD_SM90_WS_SHORT_KEYS).get(hd, 0)
        long = seqlen_k is not None and seqlen_k > config.FWD_SM90_WS_CAUSAL_LONG_KEYS.get(hd, 1 << 40)
        table = (config.FWD_SM90_WS_TILES_CAUSAL_SHORT[hd] if short else config.FWD_SM90_WS_TILES_CAUSAL_LONG[hd]
                 if long else config.FWD_SM90_WS_TILES_CAUSAL_PLAIN.get(hd, config.FWD_SM90_WS_TILES_CAUSAL[hd])) \
            if causal else (config.FWD_SM90_WS_TILES_SHORT if short else config.FWD_SM90_WS_TILES)[hd]
        return (table[4] if len(table) > 4 else 128, table[0])  # (block_m: 192 for three consumer warpgroups)
    if kernels == "auto" and backward and hd in config.bwd_sm90_ws_head_dims():  # 96 on the 128 ws kernel
        hd = config.BWD_SM90_WS_PADDED.get(hd, hd)
        if hd in (32, 64):  # bwd_sm90_ws_kernel: steps of 128 queries, 128 keys per CTA
            return (128, 128)
    if kernels == "auto" and hd in (config.BWD_SM90_TILES if backward else config.FWD_SM90_TILES):
        return (config.BWD_SM90_TILES if backward else config.FWD_SM90_TILES)[hd][:2]
    if kernels == "auto" and backward and hd in config.BWD_SM90_SPLIT_HEAD_DIMS:  # bwd_sm90_split_kernel
        return (64, 64)
    if backward:
        return config.BWD_TILES[hd][:2]
    return (config.FWD_TILES_CAUSAL.get(hd, config.FWD_TILES[hd]) if causal else config.FWD_TILES[hd])[:2]


@pytest.mark.parametrize("head_dim", [40, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernels", ["auto", "mma"])
def test_cuflash_takes_its_tiles_from_the_config(head_dim, causal, kernels):
    """kernels="auto" (default): the wgmma kernels' tiles where the head dim has them, as the library on
    an H100; "mma": the mma.sync kernels' (CUFLASH_KERNELS=mma)."""
    hd = config.kernel_head_dim(head_dim)
    p = P(777, head_dim, causal=causal, dtype="bf16", nk=901)
    c = simulate("cuflash", p, kernels=kernels)
    assert (c.block_m, c.block_n) == _expected_tiles(hd, causal, kernels, seqlen_k=901)
    if kernels == "auto":
        default = simulate("cuflash", p)
        assert (default.block_m, default.block_n) == (c.block_m, c.block_n), "the default family is auto"
    ref = simulate("fa2", p, block_m=c.block_m, block_n=c.block_n)
    assert (c.hbm_read_bytes, c.hbm_write_bytes) == (ref.hbm_read_bytes, ref.hbm_write_bytes), \
        "fwd_kernel and fwd_sm90_kernel read only valid rows and the real head_dim columns, like FA2"
    khd = config.forward_kernel_config(hd, "bf16", causal, kernels=kernels, seqlen_k=901).head_dim  # the kernel's
    tiles = c.flops_matmul // (4 * c.block_m * c.block_n * khd)
    assert tiles * 4 * c.block_m * c.block_n * khd == c.flops_matmul, "cuflash computes whole padded tiles"
    bwd = simulate("cuflash", p, backward=True, kernels=kernels)
    assert (bwd.block_m, bwd.block_n) == _expected_tiles(hd, causal, kernels, backward=True)


@pytest.mark.parametrize("sq,sk,d", [(1000, 1500, 64), (777, 901, 128), (1024, 300, 96)])
@pytest.mark.parametrize("causal", [False, True])
def test_cuflash_sm90_forward_reads_q_once_and_kv_once_per_block_m(sq, sk, d, causal):
    """The Hopper forward the library launches (fwd_sm90_ws_kernel; at d96 its 128 kernel) by
    hand: Q and O once, lse once, K and V once per query block of BLOCK_M rows (the key tiles it visits,
    tails exact); and its shared reads: the O staging loads plus the wgmma operands (per visited key tile
    and warpgroup 64 Q rows and K for S, V for O)."""
    cfg = config.forward_kernel_config(d, "fp16", causal, kernels="auto", seqlen_k=sk)
    assert isinstance(cfg, config.FwdSm90WsConfig)  # d 96: the 128 kernel, its extra columns zero-filled by TMA
    b, h, e = 2, 3, 2
    reads = writes = wgmma = o_reads = 0
    for m_block in range(-(-sq // cfg.block_m)):
        row0 = m_block * cfg.block_m
        rows = min(cfg.block_m, sq - row0)
        n_blocks = -(-sk // cfg.block_n)
        if causal:
            last = row0 + rows - 1 + sk - sq
            n_blocks = 0 if last < 0 else min(n_blocks, last // cfg.block_n + 1)
        writes += rows * d * e + rows * 4
        if n_blocks > 0:  # (a CTA that sees no key writes zeros to O without shared memory)
            reads += rows * d * e + 2 * min(n_blocks * cfg.block_n, sk) * d * e
            wgmma += n_blocks * (cfg.block_m // 64) * (64 + 2 * cfg.block_n) * cfg.head_dim * e
            o_reads += rows * d * e  # store_tile: the valid rows and columns, 16 bytes per lane
    c = simulate("cuflash", P(sq, d, causal=causal, batch=b, heads=h, nk=sk))
    assert (c.block_m, c.block_n) == (cfg.block_m, cfg.block_n)
    assert (c.hbm_read_bytes, c.hbm_write_bytes) == (b * h * reads, b * h * writes)
    assert c.launches == 1 and c.bank_conflicts == 0
    assert c.sram_read_bytes == b * h * (o_reads + wgmma)
    mma = simulate("cuflash", P(sq, d, causal=causal, batch=b, heads=h, nk=sk), kernels="mma")
    assert mma.sram_read_bytes > c.sram_read_bytes, "every mma.sync warp loads its own K and V fragments"


def _bwd_expected(sq, sk, d, causal, deterministic, kernels, b=2, h=3, e=2):
    """cuda/bwd.cuh (main kernel: bwd_sm90.cuh where the tiles have one) by hand, one loop per kernel (no
    analyzer helper): (reads, writes, atomics, peak). Deterministic, bwd_sm90_ws_kernel (no bias or dropout here:
    its ordered path) and bwd_sm90_split_kernel at head dim 256 add dQ as in the default mode, and per visit 1 to a
    counter (an int32 per 64 padded rows, zeroed by the preprocess); the other main kernels leave dQ to
    bwd_dq_kernel."""
    hd = config.kernel_head_dim(d)
    bm, bn = _expected_tiles(hd, causal, kernels, backward=True)
    main = config.backward_kernel_config(hd, "fp16", causal, False, kernels=kernels)
    acc_hd = main.head_dim  # dq_accum's columns: the main kernel's (d 32 and 96 run the 64 and 128 kernels)
    # (the deterministic kernel the library picks adds dQ in turns, or leaves it to bwd_dq_kernel)
    ordered = deterministic and config.ordered_dq(config.backward_kernel_config(hd, "fp16", causal, True,
                                                                                kernels=kernels))
    adds = not deterministic or ordered  # the main kernel adds dQ into dq_accum
    pad = -(-sq // config.SEQLEN_Q_PAD) * config.SEQLEN_Q_PAD
    turns = pad // 64 * 4 if ordered else 0  # the counters
    reads = 2 * sq * d * e + sq * 4  # preprocess: O, dO, lse
    writes = 2 * pad * 4 + (pad * acc_hd * 4 if adds else 0) + turns  # delta, lse_log2, dq_accum = 0, counters = 0
    atomics = 0
    diag = sk - sq
    for n_block in range(-(-sk // bn)):  # bwd_kernel / bwd_sm90_kernel
        n0 = n_block * bn
        keys = min(bn, sk - n0)
        m_begin = max(0, n0 - diag) // bm if causal else 0
        m_end = -(-sq // bm)
        writes += 2 * keys * d * e  # dK, dV (zeros when no query sees the keys)
        if m_begin >= m_end:
            continue
        reads += 2 * keys * d * e
        for m_block in range(m_begin, m_end):
            rows = min(bm, sq - m_block * bm)
            reads += 2 * rows * d * e + 2 * bm * 4  # Q, dO; lse_log2, delta incl. pad rows
            if adds:
                atomics += bm * acc_hd * 4  # the whole dQ tile's adds (element atomics or bulk reductions)
            if ordered:
                atomics += 4  # red.release.gpu.add of 1 to the block's counter
    if not adds:  # bwd_dq_kernel
        dcfg = config.dq_config(hd, "fp16", causal)
        for m_block in range(-(-sq // dcfg.block_m)):
            row0 = m_block * dcfg.block_m
            rows = min(dcfg.block_m, sq - row0)
            n_blocks = -(-sk // dcfg.block_n)
            if causal:
                last = row0 + rows - 1 + diag
                n_blocks = 0 if last < 0 else min(n_blocks, last // dcfg.block_n + 1)
            writes += rows * d * e
            if n_blocks > 0:
                reads += 2 * rows * d * e + 2 * dcfg.block_m * 4
                reads += 2 * sum(min(dcfg.block_n, sk - n * dcfg.block_n) for n in range(n_blocks)) * d * e
    else:  # convert (after bwd_sm90_ws_kernel and bwd_sm90_split_kernel: every row of their BLOCK_M-row blocks
        # (128 at head dims 32 and 64, else 64), in their accumulator order)
        rows = -(-sq // bm) * bm if isinstance(main, (config.BwdSm90WsConfig, config.BwdSm90SplitConfig)) else sq
        reads += rows * d * 4
        writes += sq * d * e
    peak = 2 * pad * 4 + (pad * acc_hd * 4 if adds else 0) + turns
    return b * h * reads, b * h * writes, b * h * atomics, b * h * peak


@pytest.mark.parametrize("sq,sk,d", [(1000, 1000, 64), (300, 517, 40), (517, 300, 128), (200, 150, 96),
                                     (130, 70, 256), (64, 1000, 192), (1, 239, 32)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kernels", ["auto", "mma"])
def test_cuflash_backward_counts_what_the_kernels_move(sq, sk, d, causal, deterministic, kernels):
    reads, writes, atomics, peak = _bwd_expected(sq, sk, d, causal, deterministic, kernels)
    c = simulate("cuflash", P(sq, d, causal=causal, batch=2, heads=3, nk=sk), backward=True,
                 deterministic=deterministic, kernels=kernels)
    assert c.hbm_read_bytes == reads + atomics, "atomics count as a read and a write of the accumulator"
    assert c.hbm_write_bytes == writes + atomics
    assert c.peak_extra_bytes == peak and c.launches == 3
    assert c.sram_read_bytes > 0
    cfg = config.backward_kernel_config(config.kernel_head_dim(d), "fp16", causal, deterministic, kernels=kernels)
    if isinstance(cfg, config.BwdSm90SplitConfig):  # shared bytes from its program order, banks not walked
        assert c.bank_conflicts is None
        return
    # (incl. bwd_sm90 at d64, whose 64-byte-panel tiles copy in panel order: test_sm90_tile_copies)
    assert c.bank_conflicts == 0, f"{cfg.cpp_name()}: {c.bank_conflicts} bank conflicts"


@pytest.mark.parametrize("kernels,main,convert", [("auto", "bwd_sm90_ws_kernel", "bwd_convert_dq_ws_kernel"),
                                                  ("mma", "bwd_kernel", "bwd_convert_dq_kernel")])
def test_cuflash_backward_kernels_and_the_deterministic_cost(kernels, main, convert):
    """Deterministic, bwd_sm90_ws_kernel (its ordered path, config.ordered_dq) adds dQ as in the default mode, in a
    fixed order: the same launches and FLOPs, plus an int32 counter per 64 rows (zeroed by the preprocess) and a
    4-byte add to it per visit; bwd_kernel leaves dQ to bwd_dq_kernel (no dq_accum, no atomics, about 1.4x the
    FLOPs)."""
    from cuflash.simulator.strategies import cuflash_backward_kernels

    p = P(4096, 64, batch=1, heads=16)
    default = cuflash_backward_kernels(p, kernels=kernels)
    assert [k.name for k in default] == ["bwd_preprocess_kernel", main, convert]
    det = cuflash_backward_kernels(p, deterministic=True, kernels=kernels)
    a = simulate("cuflash", p, backward=True, kernels=kernels)
    b = simulate("cuflash", p, backward=True, deterministic=True, kernels=kernels)
    lse_delta, acc = 16 * 2 * 4096 * 4, 16 * 4096 * 64 * 4
    if kernels == "auto":
        assert [k.name for k in det] == ["bwd_preprocess_kernel", main, convert]
        turns = 16 * 4096 // 64 * 4  # an int32 per 64 rows
        visits = 16 * (4096 // 128) ** 2  # 128-key blocks x 128-query steps, per head
        assert det[0].write_bytes == default[0].write_bytes + turns
        assert det[1].atomic_bytes == default[1].atomic_bytes + visits * 4 == visits * (128 * 64 * 4 + 4)
        assert [(k.read_bytes, k.grid) for k in det] == [(k.read_bytes, k.grid) for k in default]
        assert [k.write_bytes for k in det[1:]] == [k.write_bytes for k in default[1:]]
        assert b.flops_matmul == a.flops_matmul and b.flops == a.flops
        assert (b.sram_read_bytes, b.sram_write_bytes, b.bank_conflicts) == \
            (a.sram_read_bytes, a.sram_write_bytes, a.bank_conflicts)
        assert b.peak_extra_bytes == lse_delta + acc + turns, "lse_log2, delta, dq_accum and its counters"
        assert b.hbm_write_bytes == a.hbm_write_bytes + turns + visits * 4
    else:
        assert [k.name for k in det] == ["bwd_preprocess_kernel", main, "bwd_dq_kernel"]
        assert all(k.atomic_bytes == 0 for k in det)
        assert 1.3 < b.flops_matmul / a.flops_matmul < 1.5, "api.py: about 1.4x the backward's FLOPs"
        assert b.peak_extra_bytes == lse_delta, "no fp32 dq accumulator, only lse_log2 and delta"
    assert a.peak_extra_bytes == lse_delta + acc
    # atomic mode: 10 d per pair of matmul FLOPs with D_SPLIT = 1 (no duplicated S^T, dP^T) or one
    # warpgroup per 64 keys (wgmma)
    assert a.flops_matmul == a.flops_useful
    with pytest.raises(ValueError, match="deterministic"):
        simulate("fa2", p, backward=True, deterministic=True)
    with pytest.raises(ValueError, match="deterministic"):
        simulate("cuflash", p, deterministic=True)


@pytest.mark.parametrize("causal,mods,ordered", [(True, config.MOD_BIAS, False), (False, config.MOD_WINDOW |
                                                 config.MOD_DROPOUT, False), (False, config.MOD_BIAS, False),
                                                 (True, config.MOD_ALIBI, True), (False, config.MOD_WINDOW, True)])
def test_deterministic_ws_kernel_off_the_ordered_path_runs_bwd_dq_kernel(causal, mods, ordered):
    """A bias or dropout keeps the deterministic ws kernel without dQ:
    bwd_dq_kernel computes it (no dq_accum, no counters, no atomics, no dS^T or dQ in shared memory); the others
    add it in order and are converted. Counted for main configs in place of the library's choice (the analyzer's
    problems have no bias or dropout), against the hand counts of the d 128 tiles (64-query steps, 128 keys)."""
    import numpy as np

    from cuflash.simulator import banks, l2
    from cuflash.simulator.strategies import cuflash_backward_kernels

    cfg = config.bwd_sm90_ws_config(128, "bf16", causal, True, mods)
    assert config.ordered_dq(cfg) is ordered
    p = Problem(2, 3, 512, 512, 128, "bf16", causal)
    launches = cuflash_backward_kernels(p, True, True, "auto", main=cfg)
    pad, bh = 512, 6
    # 4 key blocks of 128 x 8 query blocks of 64; causal (diag 0): key block n from query block 2 n
    visits = bh * (8 + 6 + 4 + 2 if causal else 4 * 8)
    names = [k.name for k in launches]
    if ordered:
        assert names == ["bwd_preprocess_kernel", "bwd_sm90_ws_kernel", "bwd_convert_dq_ws_kernel"]
        assert launches[0].write_bytes == bh * (2 * pad * 4 + pad * 128 * 4 + pad // 64 * 4)
        assert launches[1].atomic_bytes == visits * (64 * 128 * 4 + 4)
    else:
        assert names == ["bwd_preprocess_kernel", "bwd_sm90_ws_kernel", "bwd_dq_kernel"]
        assert launches[0].write_bytes == bh * 2 * pad * 4, "lse_log2 and delta only"
        assert all(k.atomic_bytes == 0 for k in launches)
    walk = banks.bwd_kernel_shared(cfg, 2, 3, 512, 512)
    dq_tile = 64 * 128 * 4  # the fp32 dQ buffer, stored and read by the bulk reduction once per visit
    assert walk.bulk_read_bytes == walk.roles["dq_store"].bytes == (visits * dq_tile if ordered else 0)
    assert (walk.roles["ds_store"].instructions > 0) is ordered
    assert ("dq_wgmma" in walk.roles and walk.roles["dq_wgmma"].instructions > 0) is ordered
    tr = l2._Trace(p, "tile")
    l2._cuflash_bwd(tr, p, True, 132, True, "auto", cfg)
    assert ("dq_acc" in tr.tensors and "dq_turns" in tr.tensors) is ordered
    # the tensors of the third launch: convert reads dq_accum and writes dQ; bwd_dq_kernel reads Q, dO, lse_log2,
    # delta, K, V and writes dQ
    ids = np.concatenate([part[5] for part in tr.parts if part[0].size and part[0][0] == 2])
    third = {name for name, (first, per_bh, *_) in tr.tensors.items()
             if ((ids >= first) & (ids < first + per_bh * bh)).any()}
    assert third == ({"dq_acc", "dq"} if ordered else {"q", "do", "lse_log2", "delta", "k", "v", "dq"})
    with pytest.raises(ValueError, match="deterministic"):
        cuflash_backward_kernels(p, True, False, "auto", main=cfg)


def test_every_attention_kernel_has_its_name():
    """Every attention kernel config the library instantiates on the H100 (config.all_fwd_configs, all_bwd_configs)
    is one the analyzer names, and by the function its cpp_name instantiates: a kernel family added to the library
    fails here until the analyzer knows it. (The preprocess, convert, combine, append, dropout-mask and key-padding
    map kernels are named by the launch lists themselves, or not counted: the padding map's launch reads a byte per
    key of the mask.)"""
    import re

    from cuflash.simulator.strategies import kernel_name

    aux = (config.ElementwiseConfig, config.CombineConfig, config.AppendConfig, config.DropoutMaskConfig,
           config.PaddingTilesConfig)
    cfgs = [c for c in config.all_fwd_configs("sm_90a") + config.all_bwd_configs("sm_90a") if not isinstance(c, aux)]
    assert {type(c) for c in cfgs} >= {config.BwdSm90Tf32Config, config.BwdDqSm90Tf32Config, config.FwdSm90Tf32Config}
    for c in cfgs:
        assert kernel_name(c) == re.match(r"cuflash::(\w+)<", c.cpp_name()).group(1), c.cpp_name()


def test_figure_2_configuration():
    """GPT-2 medium (N=1024, d=64, 16 heads, batch 64, fp16), forward + backward. The paper reports
    40.3 GB (standard) vs 4.4 GB (FlashAttention); exact algorithm counts give 25.2 GB vs 4.65 GB
    (docs/IO_ANALYSIS.md explains the difference)."""
    p = Problem(64, 16, 1024, 1024, 64, "fp16", False)
    std = sum(simulate("standard", p, backward=b).hbm_bytes for b in (False, True))
    fa1 = sum(simulate("fa1", p, backward=b).hbm_bytes for b in (False, True))
    assert std == 64 * 16 * (4 * 1024**2 + 4 * 1024 * 64 + 7 * 1024**2 + 8 * 1024 * 64) * 2
    assert round(std / 1e9, 1) == 25.2
    assert round(fa1 / 1e9, 2) == 4.65
    assert std / fa1 > 5


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(strategy="fa3"), ValueError, "strategy='fa3'"),
    (dict(strategy="cuflash", kernels="wgmma"), ValueError, "kernels='wgmma'.*allowed: auto, mma"),
    (dict(strategy="fa2", kernels="mma"), ValueError, "kernels='mma'.*strategy='cuflash'"),
    (dict(strategy="fa2", block_m=64), ValueError, "both block_m and block_n"),
    (dict(strategy="fa1", block_m=64, block_n=64, sram_bytes=1 << 16), ValueError, "either"),
    (dict(strategy="fa1", sram_bytes=100), ValueError, "too small"),
    (dict(strategy="fa2", block_m=0, block_n=64), ValueError, "block_m=0"),
    (dict(strategy="cuflash", dtype="fp64", d=256), ValueError, "largest kernel head dim 128 for fp64"),
])
def test_bad_arguments_are_explained(kwargs, err, match):
    dtype = kwargs.pop("dtype", "fp16")
    d = kwargs.pop("d", 64)
    strategy = kwargs.pop("strategy")
    with pytest.raises(err, match=match):
        simulate(strategy, P(256, d, dtype=dtype), **kwargs)


@pytest.mark.parametrize("field,value", [("seqlen_q", 0), ("head_dim", -1), ("batch", 1.5), ("dtype", "int8")])
def test_bad_problems_are_explained(field, value):
    kw = dict(batch=1, heads=1, seqlen_q=8, seqlen_k=8, head_dim=64, dtype="fp16")
    kw[field] = value
    with pytest.raises(ValueError, match=field if field != "dtype" else "dtype='int8'"):
        Problem(**kw)
