"""The warp-specialized Hopper forward (cuda/fwd_sm90_ws.cuh, fwd_sm90_ws_kernel) in the analyzer: its counts on
small problems against hand-computed ones (TMA boxes of Q once and of K, V per visited key tile, in-bounds rows
read, whole boxes written to shared memory; O and lse once; wgmma operands; O staging), causal tile skipping,
the O staging without bank conflicts, the config the analyzer picks, the L2 model and the ncu rows."""
import numpy as np
import pytest

from cuflash import config as C
from cuflash.simulator import Problem, banks, simulate, validate
from cuflash.simulator.cli import main
from cuflash.simulator.l2 import config_resident, simulate_l2
from cuflash.simulator.schedules import cuflash_config

E = 2  # fp16 / bf16 bytes


def ws(d, causal=False, dtype="fp16", seqlen_k=None):
    """The library's config (seqlen_k: the key length it is chosen for; None: the long-sequence tiles)."""
    return C.fwd_sm90_ws_config(d, dtype, causal, seqlen_k=seqlen_k)


def hand_counts(cfg, b, h, sq, sk, d):
    """fwd_sm90_ws_kernel by hand, one loop over CTAs (no analyzer helper): per CTA m_block that sees a key,
    key tiles n_end - 1 .. 0 with n_end = ceil(Sk / BLOCK_N), causal: min(that, (last row + Sk - Sq) // BLOCK_N
    + 1). Returns global reads and writes, TMA boxes and bytes written to shared memory, wgmma operand bytes,
    O staging bytes (st.shared, ld.shared) and the matmul FLOPs of the whole tiles."""
    bm, bn, hd = cfg.block_m, cfg.block_n, cfg.head_dim
    out = dict(reads=0, writes=0, boxes=0, tma_bytes=0, wgmma=0, o_staged=0, o_read=0, flops=0)
    for m_block in range(-(-sq // bm)):
        row0 = m_block * bm
        rows = min(bm, sq - row0)
        n_end = -(-sk // bn)
        if cfg.causal:
            last = row0 + rows - 1 + sk - sq
            n_end = 0 if last < 0 else min(n_end, last // bn + 1)
        out["writes"] += rows * d * E + rows * 4  # O (16-byte stores of the valid rows) and lse
        if n_end <= 0:
            continue  # O = 0, lse = -inf straight to global memory: no TMA, no shared memory
        keys = min(n_end * bn, sk)  # the last box may reach past Sk: those rows are zero-filled, not read
        out["reads"] += rows * d * E + 2 * keys * d * E
        out["boxes"] += hd // cfg.box_cols * (1 + 2 * n_end)  # panels of 64 columns (32 at D 32 and 96)
        out["tma_bytes"] += bm * hd * E + 2 * n_end * bn * hd * E  # whole boxes land in shared memory
        # per key tile, each consumer warpgroup (bm / 64 of them): S = Q K^T reads its 64 Q rows and K; O += P V
        # reads V
        out["wgmma"] += n_end * (bm // 64) * ((64 + bn) * hd + bn * hd) * E
        out["o_staged"] += bm * hd * E  # every consumer warp stores its 16 rows x HEAD_DIM
        out["o_read"] += rows * d * E  # 16-byte reads of the valid rows and columns
        out["flops"] += n_end * 4 * bm * bn * hd
    return {k: v * b * h for k, v in out.items()}


def test_b1_h1_n256_d128_by_hand(monkeypatch):
    """B=1 H=1 N=256 D=128, non-causal, on key tiles of 128 rows (set here: the shipped tile may differ): 2 CTAs of
    128 query rows, each Q once (2 boxes of 64 x 128) and 2 key tiles (K and V: 2 boxes each per tile)."""
    monkeypatch.setitem(C.FWD_SM90_WS_TILES, 128, (128, 2, False))
    cfg = ws(128)
    c = simulate("cuflash", Problem(1, 1, 256, 256, 128))
    assert (c.block_m, c.block_n) == (128, 128) and isinstance(cuflash_config(Problem(1, 1, 256, 256, 128)),
                                                               C.FwdSm90WsConfig)
    q_bytes = 256 * 128 * E  # 65,536: Q once
    kv_per_cta = 2 * 256 * 128 * E  # 131,072: K and V, 2 tiles of 128 keys each
    assert c.hbm_read_bytes == q_bytes + 2 * kv_per_cta == 327_680
    assert c.hbm_write_bytes == 256 * 128 * E + 256 * 4 == 66_560  # O and lse
    assert c.flops_matmul == 2 * 2 * 4 * 128 * 128 * 128  # 2 CTAs x 2 tiles x (S and PV: 4 m n k)
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 256, 256)
    assert walk.by_sass(banks.TMA_CLASS).instructions == 2 * (2 + 2 * 2 * 2) == 20  # boxes
    assert walk.tma_write_bytes == 327_680  # no tail: what TMA writes is what it reads
    assert walk.wgmma_read_bytes == 2 * 2 * 2 * ((64 + 128) * 128 + 128 * 128) * E == 655_360
    assert walk.by_sass("STS").bytes == walk.by_sass("LDS").bytes == 256 * 128 * E  # O staging
    assert c.sram_write_bytes == 327_680 + 65_536 and c.sram_read_bytes == 655_360 + 65_536
    assert c.bank_conflicts == 0 and walk.guard_lds == 0 and walk.by_sass("LDGSTS").instructions == 0


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(256, 256), (1000, 1500), (1500, 1000), (1, 239), (513, 128)])
def test_counts_equal_the_hand_loop(d, causal, sq, sk):
    """Tails (Q boxes and the last K/V box partly out of bounds: read in-bounds rows, write whole boxes),
    causal skipping and CTAs that see no key (causal, Sq > Sk)."""
    b, h = 2, 3
    cfg = ws(d, causal, seqlen_k=sk)
    p = Problem(b, h, sq, sk, d, causal=causal)
    want = hand_counts(cfg, b, h, sq, sk, d)
    c = simulate("cuflash", p)
    assert (c.hbm_read_bytes, c.hbm_write_bytes) == (want["reads"], want["writes"]), p
    assert c.flops_matmul == want["flops"], p
    walk = banks.fwd_kernel_shared(cfg, b, h, sq, sk)
    tma = walk.by_sass(banks.TMA_CLASS)
    assert (tma.instructions, tma.bytes) == (want["boxes"], want["tma_bytes"]), p
    assert walk.wgmma_read_bytes == want["wgmma"], p
    assert (walk.by_sass("STS").bytes, walk.by_sass("LDS").bytes) == (want["o_staged"], want["o_read"]), p
    assert c.sram_write_bytes == want["tma_bytes"] + want["o_staged"]
    assert c.sram_read_bytes == want["wgmma"] + want["o_read"]
    assert c.bank_conflicts == 0


def test_causal_skips_the_tiles_past_the_diagonal(monkeypatch):
    """N=512, d128, causal: CTA m sees key tiles 0..m (BLOCK_M = BLOCK_N = 128, set here for both), 1+2+3+4 = 10 of
    16 tiles."""
    monkeypatch.setitem(C.FWD_SM90_WS_TILES, 128, (128, 2, False))
    monkeypatch.setitem(C.FWD_SM90_WS_TILES_CAUSAL, 128, (128, 2, False))
    full = simulate("cuflash", Problem(1, 1, 512, 512, 128))
    causal = simulate("cuflash", Problem(1, 1, 512, 512, 128, causal=True))
    tile = 128 * 128 * E
    assert full.hbm_read_bytes == 512 * 128 * E + 2 * 16 * tile
    assert causal.hbm_read_bytes == 512 * 128 * E + 2 * 10 * tile
    assert causal.flops_matmul * 16 == full.flops_matmul * 10
    walk = banks.fwd_kernel_shared(ws(128, True), 1, 1, 512, 512)
    assert walk.roles["k_tma"].instructions == 10 * 2 and walk.roles["q_tma"].instructions == 4 * 2
    # no_causal_skip visits every tile (and masks in registers)
    assert simulate("cuflash", Problem(1, 1, 512, 512, 128, causal=True), causal_skip=False).hbm_read_bytes == \
        full.hbm_read_bytes


# (kernel head dim, rows_q, run-time head_dim): every run-time head dim at most its kernel's
O_STAGING = [(d, rq, hd) for d in (32, 64, 96, 128, 256) for rq, hd in ((None, None), (77, None), (128, 48), (1, 200))
             if hd is None or hd <= d]


@pytest.mark.parametrize("d,rows_q,head_dim", O_STAGING)
def test_o_staging_has_no_bank_conflicts_and_reads_each_valid_chunk_once(d, rows_q, head_dim):
    """st.shared.b32 of the accumulators (8 or 12 consumer warps) and the epilogue's 16-byte reads are conflict-free by
    the 128-byte swizzle (64-byte at D 32 and 96; banks.py's rule); the reads cover every valid (row, 8-column
    chunk) of TileQ once."""
    cfg = ws(d)
    addrs = banks.fwd_sm90_ws_addresses(cfg, rows_q, head_dim)
    for role, kind in (("o_store", "st32"), ("o_read", "ld128")):
        wavefronts, conflicts = banks.count_instructions(addrs[role], kind)
        assert conflicts == 0, f"{role} d{d}: {conflicts} bank conflicts"
    bm = cfg.block_m  # 128, or 192 (three consumer warpgroups: D 64's long rows)
    rq, hdv = rows_q or bm, head_dim or d
    rows, cols = np.meshgrid(np.arange(rq), np.arange(0, hdv, 8), indexing="ij")
    want = np.sort(banks.swizzled_offset(rows, cols, bm, d).ravel()) + banks.fwd_sm90_ws_layout(cfg).off_o
    got = addrs["o_read"][addrs["o_read"] >= 0]
    assert np.array_equal(np.sort(got), want), f"o_read d{d} rows_q={rq} head_dim={hdv}"
    stored = addrs["o_store"].ravel()
    assert stored.size == bm * d // 2 and np.unique(stored).size == stored.size  # every packed pair once


def test_the_config_is_the_librarys():
    """kernels="auto": fwd_sm90_ws_kernel at head dims 32, 64, 96, 128, 256 (40 -> 64, 80 -> 96; 32 and 96 with
    64-byte panels); kernels="mma": fwd_kernel; a sliding window (a score modifier) counts the
    family the registry gives MOD_WINDOW, an unbounded one (no modifier) the ws kernel."""
    for d, want, hd in ((32, C.FwdSm90WsConfig, 32), (40, C.FwdSm90WsConfig, 64), (64, C.FwdSm90WsConfig, 64),
                        (80, C.FwdSm90WsConfig, 96), (96, C.FwdSm90WsConfig, 96), (128, C.FwdSm90WsConfig, 128),
                        (256, C.FwdSm90WsConfig, 256)):
        assert C.forward_kernel_config(C.kernel_head_dim(d), "fp16", False, kernels="auto").__class__ is want, d
        cfg = cuflash_config(Problem(1, 1, 300, 300, d))
        assert isinstance(cfg, want) and cfg.head_dim == hd, (d, cfg)
    assert isinstance(cuflash_config(Problem(1, 1, 300, 300, 128), kernels="mma"), C.FwdConfig)
    windowed = C.forward_kernel_config(128, "fp16", False, kernels="auto", mods=C.MOD_WINDOW)
    want = C.FwdSm90WsConfig if isinstance(windowed, C.FwdSm90WsConfig) else C.FwdSm90Config
    assert isinstance(cuflash_config(Problem(1, 1, 300, 300, 128, window=(64, 0))), want)
    assert isinstance(cuflash_config(Problem(1, 1, 300, 300, 128, window=(-1, -1))), C.FwdSm90WsConfig)
    assert isinstance(cuflash_config(Problem(1, 1, 300, 300, 128, causal=True, window=(-1, 5))), C.FwdSm90WsConfig)
    from cuflash.simulator.strategies import kernel_name
    assert kernel_name(ws(128)) == "fwd_sm90_ws_kernel"


def test_l2_model_runs_one_cta_per_sm_in_launch_order():
    """One CTA per SM (the register split of setmaxnreg); with an L2 that holds everything DRAM reads are the
    compulsory bytes (Q, K, V once), and the causal launch order (longest query blocks first) is the cuflash
    forward's."""
    assert all(config_resident(ws(d, c)) == 1 for d in (64, 128, 256) for c in (False, True))
    p = Problem(2, 4, 1000, 1500, 64, causal=True)
    c = simulate("cuflash", p, l2_bytes=1 << 30)
    assert c.dram_read_bytes == 2 * 4 * (1000 + 2 * 1500) * 64 * E
    small = simulate("cuflash", p, l2_bytes=1 << 20)
    same = simulate_l2("cuflash", p, l2_bytes=1 << 20, block_m=128, block_n=128, ctas_per_sm_=1)
    assert small.dram_read_bytes == same.read_bytes


def test_sweep_and_plot_take_the_ws_kernel(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(C.FWD_SM90_WS_TILES, 128, (128, 2, False))  # the tile the byte count below assumes
    assert main(["sweep", "--strategy", "cuflash", "--seqlen", "256", "1000", "--head-dim", "128", "--batch", "1",
                 "--heads", "1", "--json"]) == 0
    import json
    recs = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(r["block_m"], r["block_n"]) for r in recs] == [(128, 128)] * 2
    assert recs[0]["hbm_read_bytes"] == 327_680 and recs[0]["bank_conflicts"] == 0
    out = tmp_path / "hbm.png"
    assert main(["plot", "hbm-vs-n", "--head-dim", "128", "--seqlen", "256", "1024", "--out", str(out)]) == 0
    assert out.stat().st_size > 0


WS_TARGETS = [t for t in validate.CASES["full"] if t.kernel == "fwd_sm90_ws_kernel"]


def test_the_validation_sets_hold_ws_targets():
    assert len([t for t in validate.CASES["default"] if t.kernel == "fwd_sm90_ws_kernel"]) >= 4
    assert any(t.case.causal and t.case.seqlen_q % 128 for t in WS_TARGETS), "a causal target with tails"
    assert {t.case.head_dim for t in WS_TARGETS} == {64, 128, 256}
    for t in validate.CASES["full"]:  # the TMA and HGMMA rows belong to the TMA kernels only
        has = "sm__sass_inst_executed_op_tma_ld.sum" in validate.metrics_for(t)
        assert has == (t.kernel in ("fwd_sm90_ws_kernel", "bwd_sm90_ws_kernel", "bwd_sm90_split_kernel")) and \
            ("sm__sass_data_bytes_mem_shared_op_gmma.sum" in validate.metrics_for(t)) == has, t.name


@pytest.mark.parametrize("target", WS_TARGETS, ids=lambda t: t.name)
def test_ws_predictions_by_hand(target):
    """The ncu rows: TMA bytes = the in-bounds global reads, boxes exact, the O staging's STS/LDS, no cp.async,
    no ldmatrix, 384 threads."""
    cfg, c = target.config(), target.case
    assert isinstance(cfg, C.FwdSm90WsConfig) and target.kernels == "auto"
    want = hand_counts(cfg, c.batch, c.heads, c.seqlen_q, c.seqlen_k, c.head_dim)
    pred = {m: v for m, (v, _) in validate.predict(target, validate.H100_L2_BYTES, validate.H100_SMS).items()}
    assert pred["l1tex__m_xbar2l1tex_read_bytes.sum"] == want["reads"]  # every row 32-byte aligned here
    assert pred["l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum"] == want["reads"]
    assert pred["l1tex__m_xbar2l1tex_read_sectors_pipe_tma.sum"] * 32 == want["reads"]
    assert pred["sm__sass_inst_executed_op_tma_ld.sum"] == want["boxes"]
    assert pred["smsp__inst_executed_op_shared_st.sum"] * 128 == want["o_staged"]  # 32 lanes x 4 bytes
    assert pred["smsp__inst_executed_op_shared_ld.sum"] * 512 >= want["o_read"]  # 16 B per lane, tails partial
    assert pred["smsp__sass_inst_executed_op_ldgsts.sum"] == pred["smsp__inst_executed_op_ldsm.sum"] == 0
    assert pred["sm__sass_data_bytes_mem_shared_op_gmma.sum"] == want["wgmma"]
    assert pred["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"] == 0
    assert pred["launch__block_size"] == 384 and pred["launch__grid_size"] == -(-c.seqlen_q // 128) * c.batch * c.heads
