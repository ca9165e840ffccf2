"""The float32 Hopper forward (cuda/fwd_sm90_tf32.cuh) without a GPU: the registry sends float32 forwards to it on
sm_90a where it has a kernel (head dims 32, 64 and 128, no score modifier but a window, a bias, ALiBi and a mask) and to
fwd_wide_kernel elsewhere; every shipped instantiation compiles through NVRTC for sm_90a spill-free, with TMA loads,
TF32 warpgroup MMAs and setmaxnreg where it has two consumers; its shared memory fits sm_90; the TMA maps of float32
operands are accepted; the analyzer counts it."""
from __future__ import annotations

import re

import pytest

from cuflash import _compile, _tma, config
from compile_helpers import nvrtc_or_skip, opcode_counter, sass_or_skip

SHIPPED = [c for c in config.all_fwd_configs("sm_90a") if isinstance(c, config.FwdSm90Tf32Config)]


def _name(c: config.FwdSm90Tf32Config) -> str:
    return (f"{c.dtype}-d{c.head_dim}-bn{c.block_n}-s{c.stages}-c{c.consumers}-"
            f"{'causal' if c.causal else 'window' if c.window else 'full'}{'-bias' if c.bias else ''}"
            f"{'-alibi-mask' if c.alibi_mask else ''}")


def test_every_table_entry_is_shipped_plain_causal_and_windowed_with_a_bias_alibi_and_a_mask():
    want = {(dt, d, c, w, b, am) for dt, table in config.FWD_SM90_TF32_TILES.items() for d in table
            for c, w in ((False, False), (True, False), (False, True)) for b in (False, True) for am in (False, True)}
    assert {(c.dtype, c.head_dim, c.causal, c.window, c.bias, c.alibi_mask) for c in SHIPPED} == want
    # ... and the two-consumer tiles of causal rows of up to FWD_SM90_TF32_SHORT_CAUSAL_KEYS keys
    short = {(dt, d) for dt, table in config.FWD_SM90_TF32_TILES_TWO.items() for d in table}
    assert short == {("fp32", 32), ("tf32", 32), ("tf32", 64)}
    assert len(SHIPPED) == len(want) + len(short) == 75
    assert len({c.cpp_name() for c in SHIPPED}) == len(SHIPPED)
    for c in SHIPPED:  # the template's MODS: MOD_WINDOW, MOD_BIAS, MOD_ALIBI | MOD_MASK (one kernel for either)
        bits = (config.MOD_WINDOW * c.window + config.MOD_BIAS * c.bias
                + (config.MOD_ALIBI | config.MOD_MASK) * c.alibi_mask)
        assert c.cpp_name().endswith(f", {bits}>") and c.mods == bits, c


@pytest.mark.parametrize("dtype", ["fp32", "tf32"])
def test_registry_sends_float32_to_the_tf32_kernel_where_it_has_one(dtype):
    for hd in (32, 64, 128):
        for causal, mods in ((False, 0), (True, 0), (False, config.MOD_WINDOW), (False, config.MOD_BIAS),
                             (True, config.MOD_BIAS), (False, config.MOD_WINDOW | config.MOD_BIAS)):
            cfg = config.select("forward", hd, dtype, causal, "sm_90a", mods=mods)
            assert isinstance(cfg, config.FwdSm90Tf32Config), (hd, causal, mods, cfg)
            assert (cfg.head_dim, cfg.dtype, cfg.causal, cfg.mods) == (hd, dtype, causal, mods)
    # ALiBi and a mask, alone, together, beside a bias and a window
    A, M, B, W = config.MOD_ALIBI, config.MOD_MASK, config.MOD_BIAS, config.MOD_WINDOW
    for hd in (32, 64, 128):
        for causal, mods in ((False, A), (True, M), (False, A | M), (True, B | M), (False, W | B | A | M)):
            cfg = config.select("forward", hd, dtype, causal, "sm_90a", mods=mods)
            assert isinstance(cfg, config.FwdSm90Tf32Config), (hd, causal, mods, cfg)
            assert (cfg.head_dim, cfg.causal, cfg.alibi_mask) == (hd, causal, True)
            assert cfg.mods == mods | A | M, (hd, causal, mods, cfg)  # one kernel for ALiBi, a mask or both
    # other head dims, soft-capping, dropout, other targets and CUFLASH_KERNELS=mma: the mma.sync kernels
    assert isinstance(config.select("forward", 256, dtype, False, "sm_90a"), config.FwdWideConfig)
    for m in (config.MOD_SOFTCAP, config.MOD_DROPOUT, config.MOD_SOFTCAP | config.MOD_MASK,
              config.MOD_DROPOUT | config.MOD_ALIBI, config.MOD_BIAS | config.MOD_SOFTCAP):
        assert isinstance(config.select("forward", 64, dtype, False, "sm_90a", mods=m), config.FwdWideConfig), m
    assert isinstance(config.select("forward", 64, dtype, False, "sm_80"), config.FwdWideConfig)
    assert isinstance(config.select("forward", 64, dtype, False, "sm_90a", kernels="mma"), config.FwdWideConfig)
    # the backward: the TF32 one (cuda/bwd_sm90_tf32.cuh) at head dims 32, 64 and 128 with the default kernels,
    # bwd_wide_kernel at head dim 256 and with CUFLASH_KERNELS=mma; float64 stays on its own kernels
    assert isinstance(config.select("backward", 64, dtype, False, "sm_90a"), config.BwdSm90Tf32Config)
    assert isinstance(config.select("backward", 64, dtype, False, "sm_90a", mods=config.MOD_BIAS),
                      config.BwdSm90Tf32Config)
    assert isinstance(config.select("backward", 128, dtype, False, "sm_90a"), config.BwdSm90Tf32Config)
    assert isinstance(config.select("backward", 256, dtype, False, "sm_90a"), config.BwdWideConfig)
    assert isinstance(config.select("backward", 64, dtype, False, "sm_90a", kernels="mma"), config.BwdWideConfig)
    assert isinstance(config.select("forward", 64, "fp64", False, "sm_90a"), config.FwdWideConfig)


def test_three_consumers_where_they_fit_two_for_short_causal_rows_and_a_bias():
    """Three consumer warpgroups (192 rows, no pingpong) for one-pass TF32 at head dims 32 and 64 and 3xTF32 at 32;
    causal rows of up to FWD_SM90_TF32_SHORT_CAUSAL_KEYS keys and a bias keep the two-consumer tiles."""
    short = config.FWD_SM90_TF32_SHORT_CAUSAL_KEYS
    for dt, hd in (("tf32", 32), ("tf32", 64), ("fp32", 32)):
        for causal, window, sk in ((False, False, None), (False, False, 512), (True, False, None),
                                   (True, False, short + 1), (False, True, 512)):
            cfg = config.fwd_sm90_tf32_config(hd, dt, causal, window, seqlen_k=sk)
            assert (cfg.consumers, cfg.block_m, cfg.threads, cfg.pingpong) == (3, 192, 512, False), (dt, hd, causal, sk)
        for causal, bias, sk in ((True, False, short), (True, False, 1), (False, True, None), (True, True, 1 << 20)):
            cfg = config.fwd_sm90_tf32_config(hd, dt, causal, bias=bias, seqlen_k=sk)
            assert (cfg.consumers, cfg.block_m, cfg.pingpong) == (2, 128, True), (dt, hd, causal, bias, sk)
        # the registry passes the call's longest key sequence
        assert config.select("forward", hd, dt, True, "sm_90a", seqlen_k=short).consumers == 2
        assert config.select("forward", hd, dt, True, "sm_90a", seqlen_k=short + 1).consumers == 3
    for dt, hd in (("fp32", 64), ("fp32", 128), ("tf32", 128)):  # P's parts (3xTF32) or O at 128: two consumers
        assert config.fwd_sm90_tf32_config(hd, dt, False).consumers == 2


def test_alibi_and_mask_tiles():
    """ALiBi with a mask takes the bias's tiles but on a band (two consumers, Q from shared memory at 3xTF32 head dim
    64), 16-key tiles in one pass at head dim 128, and beside a bias 32-key tiles in 3xTF32 at 64
    (config.FWD_SM90_TF32_TILES_SCORE, _SCORE_BIAS: where the others spilled)."""
    for causal, window in ((False, False), (True, False), (False, True)):
        for bias in (False, True):
            cfg = config.fwd_sm90_tf32_config(64, "fp32", causal, window, bias, alibi_mask=True)
            banded_bias = bias and (causal or window)
            assert (cfg.block_n, cfg.q_regs) == ((32 if bias else 64), False), (causal, window, bias, cfg)
            assert cfg.stages == (3 if bias else 2) and cfg.consumers == 2 and cfg.pingpong, cfg
            assert banded_bias == (config.fwd_sm90_tf32_config(64, "fp32", causal, window, bias).block_n == 32)
            assert config.fwd_sm90_tf32_config(128, "tf32", causal, window, bias, alibi_mask=True).block_n == 16
            for dt in ("fp32", "tf32"):  # two consumers where the plain tiles have three
                assert config.fwd_sm90_tf32_config(32, dt, causal, window, bias, alibi_mask=True).consumers == 2


def test_q_regs_where_the_consumers_registers_hold_them():
    """Q's A operand in registers (q_regs): 3xTF32's big part at head dims 64 and 128 (pairs of 64 columns) but for a
    window or a bias at 64; one pass's rounded Q at head dim 32 (not on the two-consumer tiles of a bias or of short
    causal rows) and at 128 (its first 32 columns) without a window or a bias; never one pass at 64 (three consumers
    of 152 registers spilled)."""
    modsets = ((False, False, False), (True, False, False), (False, True, False), (False, False, True),
               (True, False, True), (False, True, True))
    want = {("fp32", 32): lambda c, w, b: False,
            ("fp32", 64): lambda c, w, b: not (w or b),
            ("fp32", 128): lambda c, w, b: True,
            ("tf32", 32): lambda c, w, b: not b,
            ("tf32", 64): lambda c, w, b: False,
            ("tf32", 128): lambda c, w, b: not (w or b)}
    for (dt, hd), rule in want.items():
        for causal, window, bias in modsets:
            cfg = config.fwd_sm90_tf32_config(hd, dt, causal, window, bias)
            assert cfg.q_regs == rule(causal, window, bias), (dt, hd, causal, window, bias)
            assert (f", {cfg.split}, true>," in cfg.cpp_name()) == cfg.q_regs, cfg.cpp_name()
        # causal rows of up to FWD_SM90_TF32_SHORT_CAUSAL_KEYS keys: at head dim 32 the two-consumer tiles, without
        short = config.fwd_sm90_tf32_config(hd, dt, True, seqlen_k=config.FWD_SM90_TF32_SHORT_CAUSAL_KEYS)
        assert short.q_regs == (rule(True, False, False) and hd != 32), (dt, hd)
    # the template's defaults stay out of the name: the kernels without q_regs keep their names
    assert config.FwdSm90Tf32Config(64, 64, 2, 2, "fp32", False, pingpong=True).cpp_name().endswith(
        "FwdTf32Traits<64, 64, 2, 2, true, true>, false, 0>")
    assert config.FwdSm90Tf32Config(128, 32, 3, 2, "fp32", False, pingpong=True, q_regs=True).cpp_name().endswith(
        "FwdTf32Traits<64, 32, 3, 2, true, true, 2, true>, false, 0>")
    assert config.FwdSm90Tf32Config(32, 64, 2, 3, "tf32", False, q_regs=True).cpp_name().endswith(
        "FwdTf32Traits<32, 64, 2, 3, false, false, 1, true>, false, 0>")
    for bad in (dict(head_dim=32), dict(consumers=3, pingpong=False)):  # 3xTF32 holds Q's big part at 64 columns
        args = {"head_dim": 64, "block_n": 64, "stages": 2, "consumers": 2, "dtype": "fp32", "causal": False,
                "q_regs": True, **bad}
        with pytest.raises(ValueError, match="q_regs=True"):
            config.FwdSm90Tf32Config(**args)


def test_config_checks_its_arguments():
    with pytest.raises(ValueError, match="dtype='bf16'"):
        config.FwdSm90Tf32Config(64, 64, 2, 2, "bf16", False)
    with pytest.raises(ValueError, match="head_dim=96"):
        config.FwdSm90Tf32Config(96, 64, 2, 2, "fp32", False)
    with pytest.raises(ValueError, match="block_n=128"):
        config.FwdSm90Tf32Config(64, 128, 2, 2, "fp32", False)
    with pytest.raises(ValueError, match="pingpong"):
        config.FwdSm90Tf32Config(64, 64, 2, 1, "fp32", False, pingpong=True)
    with pytest.raises(ValueError, match="pingpong"):
        config.FwdSm90Tf32Config(64, 64, 2, 3, "tf32", False, pingpong=True)
    with pytest.raises(ValueError, match="consumers=4"):
        config.FwdSm90Tf32Config(64, 64, 2, 4, "tf32", False)
    with pytest.raises(ValueError, match="consumers=3 at head_dim=128"):  # a cluster pair
        config.FwdSm90Tf32Config(128, 32, 2, 3, "fp32", False)
    with pytest.raises(ValueError, match="causal=True with window=True"):
        config.FwdSm90Tf32Config(64, 64, 2, 2, "fp32", True, window=True)


def test_shared_memory_fits_sm90_and_follows_the_traits():
    for c in SHIPPED:
        assert c.smem_bytes <= config.SMEM_LIMIT_SM90, c
        parts = 2 if c.dtype == "fp32" else 1
        pair = c.dtype == "fp32" and c.head_dim == 128  # 3xTF32 at 128: two CTAs of 64 columns
        assert c.split == (2 if pair else 1)
        cols = c.head_dim // c.split
        q, kv = 4 * c.block_m * cols, 4 * c.block_n * cols
        # a pair's exchange: S fragments (a float4 per n8 tile and consumer thread), double-buffered, a barrier each
        xchg, xbars = (2 * c.consumers * 128 * 16 * c.block_n // 8, 2 * c.consumers) if pair else (0, 0)
        # Q (+ big part), K stages (+ big), V stages, V^T stages (+ small), exchange, mbarriers, alignment slack
        assert c.smem_bytes == parts * q + parts * c.stages * kv + c.stages * kv + parts * c.stages * kv + xchg + \
            8 * (2 + 7 * c.stages + xbars) + 1024
        assert c.threads == 128 + 128 * c.consumers and c.block_m == 64 * c.consumers
        assert ("fwd_sm90_tf32_pair_kernel<" in c.cpp_name()) == pair
        assert c.grid(2, 3, 1000)[0] == c.split * -(-1000 // c.block_m)


def test_tma_maps_of_float32_operands():
    """Boxes one 128-byte panel (32 floats) wide, 128-byte swizzle, the array's byte strides."""
    from types import SimpleNamespace

    assert _tma.panel_swizzle(32, "fp32") == _tma.panel_swizzle(32, "tf32") == 128
    dims = SimpleNamespace(batch=2, seqlen=300, heads=4, head_dim=64, batch_stride=300 * 4 * 64, row_stride=4 * 64,
                           head_stride=64)
    assert _tma.tma_unsupported(1 << 20, dims, "fp32", 128, 32) is None
    addr, sizes, strides, box = _tma.operand_map(1 << 20, dims, "fp32", 128, 32)
    assert sizes == (64, 300, 4, 2) and strides == (4 * 256, 4 * 64, 4 * 300 * 256) and box == (32, 128, 1, 1)
    assert "16-byte aligned" in _tma._encode_args_problem("fp32", (1 << 20) + 4, sizes, strides, box, 128)
    assert "at most 128 bytes" in _tma._encode_args_problem("fp32", 1 << 20, sizes, strides, (64, 128, 1, 1), 128)
    odd = SimpleNamespace(**{**vars(dims), "row_stride": 4 * 64 + 1})  # a row stride of 1028 bytes: not TMA's
    assert "multiples of 16" in _tma.tma_unsupported(1 << 20, odd, "fp32", 128, 32)


@pytest.mark.parametrize("cfg", SHIPPED, ids=_name)
def test_every_instantiation_compiles_spill_free(cfg):
    nvrtc_or_skip()
    compiled = _compile.compile_kernel(cfg.cpp_name(), "sm_90a")
    res = compiled.resources
    spills = (res["spill_stores"], res["spill_loads"], res["stack"])
    assert spills == (0, 0, 0), f"{cfg} spills (stores, loads, stack) = {spills}\n{compiled.log}"
    # 384 / 512 threads: the launch's share (setmaxnreg then gives the consumers theirs); one consumer: 255
    limit = {1: 255, 2: 168, 3: 128}[cfg.consumers]
    assert res["registers"] is not None and res["registers"] <= limit, f"{cfg}: {res}"
    assert "C7508" not in compiled.log and "serialized" not in compiled.log, compiled.log
    assert res["static_smem"] + cfg.smem_bytes <= 227 * 1024


@pytest.mark.parametrize("cfg", [c for c in SHIPPED if not c.causal and not c.window], ids=_name)
def test_sass_has_tma_loads_and_tf32_warpgroup_mma(cfg):
    nvrtc_or_skip()
    compiled = _compile.compile_kernel(cfg.cpp_name(), "sm_90a")
    text = sass_or_skip(compiled.cubin)
    count = opcode_counter(text)
    cols = cfg.head_dim // cfg.split  # a CTA's columns
    panels = cols // 32
    # Q, K (issued in two places: the first tile, then one tile ahead in the loop), V: one load per 32-float panel
    assert count("UTMALDG") == 4 * panels, f"{cfg}: {count('UTMALDG')} TMA loads, want (Q, K, K, V) x {panels} panels"
    # S: 3 (3xTF32) or 1 product per k8 step; O_tile = P V the same per k8 step of the key tile; each GEMM is issued
    # in two places (S: first tile and loop; P V: loop and last tile)
    products = 3 if cfg.dtype == "fp32" else 1
    assert count("HGMMA") == 2 * products * (cols // 8 + cfg.block_n // 8), f"{cfg}: {count('HGMMA')} HGMMA"
    assert re.search(r"HGMMA\.\w+\.F32\.TF32", text), f"{cfg}: no TF32 HGMMA"
    # A from registers: P in every product of P V; with q_regs also Q, in 3xTF32 its big part in two of S's three
    # products per k8 step, in one pass the rounded Q in its product, at head dim 128 for the first 32 columns
    reg_a = len(re.findall(r"HGMMA\.\S+ R\d+, R\d+, gdesc", text))
    q_rs = 0 if not cfg.q_regs else 2 * cols // 8 if products == 3 else min(cols, 32) // 8
    assert reg_a == 2 * (products * cfg.block_n // 8 + q_rs), f"{cfg}: {reg_a}"
    assert count("USETMAXREG") == (2 if cfg.consumers >= 2 else 0)
    assert count("LDL") == 0 and count("STL") == 0, f"{cfg} touches local memory"
    assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", text), f"{cfg}: no wgmma.wait_group 1 in the SASS"
    # the bias: an L1 prefetch per line of the tile's rows, its key pairs in 8-byte loads where the S GEMM is waited
    # for; the mask: its bits read while the S GEMM runs, key pairs in 2-byte loads (a tile inside the sequence, each
    # row of a thread's two), else per score in byte loads; each in the first tile and the loop. A mask kernel also
    # reads a BlockMask's tile map a byte at a time: the count of visible tiles, the producer's three walks (the first
    # tile, K's and V's in the loop), the consumers' two and their two reads of a tile's state
    prefetches = count("CCTL") - count("CCTL.IVALL")  # (a pair's cluster barriers invalidate L1: CCTL.IVALL)
    assert (prefetches > 0) == cfg.bias, f"{cfg}: {prefetches} prefetches"
    assert count("LDG.E.64") == (2 * 2 * cfg.block_n // 8 if cfg.bias else 0), f"{cfg}: {count('LDG.E.64')} pairs"
    assert count("LDG.E.U16") == (2 * 2 * cfg.block_n // 8 if cfg.alibi_mask else 0), f"{cfg}: mask pairs"
    assert count("LDG.E.U8") == (2 * 4 * cfg.block_n // 8 + 8 if cfg.alibi_mask else 0), f"{cfg}: mask bytes"
    # a pair: its S fragment to the other CTA (st.async, a 16-byte STAS per n8 tile) where S is waited for (the first
    # tile and the loop), and the cluster barriers at the start and at the end of each role's branch
    arrive = len(re.findall(r"\bUCGABAR_ARV\b", text))
    if cfg.split > 1:
        assert count("STAS.128") == 2 * cfg.block_n // 8 and arrive == 3, f"{cfg}: {count('STAS.128')} / {arrive}"
    else:
        assert count("STAS") == 0 and arrive == 0, cfg


def test_analyzer_counts_the_tf32_forward():
    """cuflash-sim's cuflash strategy on sm_90a: the float32 forward is fwd_sm90_tf32_kernel, with 4-byte traffic
    (Q once per query block, K and V once per visited key tile) and its shared-memory bytes; 3xTF32 reads each
    operand three times where one pass reads it once, but for Q, whose big part two of S's products take from
    registers (q_regs: read from shared memory once per CTA)."""
    from simulator import strategies
    from simulator.model import Problem

    counts = {}
    for dt in ("fp32", "tf32"):
        p = Problem(batch=1, heads=1, seqlen_q=1024, seqlen_k=1024, head_dim=64, dtype=dt)
        cfg = strategies.cuflash_config(p)
        assert isinstance(cfg, config.FwdSm90Tf32Config) and strategies.kernel_name(cfg) == "fwd_sm90_tf32_kernel"
        c = strategies.simulate("cuflash", p)
        q_blocks = -(-1024 // cfg.block_m)  # 192 rows (three consumers): the last block part empty
        kv_tiles = q_blocks * (1024 // cfg.block_n)
        assert c.hbm_read_bytes == 4 * 64 * (1024 + 2 * cfg.block_n * kv_tiles)
        assert c.hbm_write_bytes == 1024 * (4 * 64 + 4)
        assert c.bank_conflicts is None and c.sram_read_bytes > 0 and c.sram_write_bytes > 0
        counts[dt] = (c, cfg, q_blocks, kv_tiles)
    (c3, cfg3, qb3, t3), (c1, cfg1, qb1, t1) = counts["fp32"], counts["tf32"]
    q3, kv3 = 4 * cfg3.block_m * 64, 4 * cfg3.block_n * 64
    assert cfg3.q_regs  # the shipped 3xTF32 tiles at head dim 64
    assert c3.sram_read_bytes == qb3 * 2 * q3 + t3 * (2 * kv3 + q3 + 3 * 2 * cfg3.consumers * kv3)
    q1, kv1 = 4 * cfg1.block_m * 64, 4 * cfg1.block_n * 64
    assert c1.sram_read_bytes == qb1 * q1 + t1 * (2 * kv1 + q1 + 2 * cfg1.consumers * kv1)


@pytest.mark.parametrize("hd,held_cols", [(32, 32), (128, 32)])
def test_analyzer_counts_one_pass_q_in_registers(monkeypatch, hd, held_cols):
    """One pass with q_regs: the consumers read the rounded Q's first held_cols columns (all at head dim 32, 32 of 128)
    into registers once per query block and S's product takes them from there: a key tile's Q reads drop by those
    bytes, a query block's reads grow by them once."""
    from simulator import strategies
    from simulator.model import Problem

    p = Problem(batch=1, heads=1, seqlen_q=1024, seqlen_k=1024, head_dim=hd, dtype="tf32")
    cfg = config.fwd_sm90_tf32_config(hd, "tf32", False)
    assert cfg.q_regs
    with_regs = strategies.simulate("cuflash", p)
    monkeypatch.setitem(config.FWD_SM90_TF32_TILES["tf32"], hd, (cfg.block_n, cfg.stages, cfg.consumers, cfg.pingpong))
    without = strategies.simulate("cuflash", p)
    held = 4 * cfg.block_m * held_cols  # bytes of a query block's Q in registers
    blocks = -(-1024 // cfg.block_m)
    tiles = blocks * (1024 // cfg.block_n)  # not causal: every block visits every key tile
    assert without.sram_read_bytes - with_regs.sram_read_bytes == tiles * held - blocks * held
    assert without.sram_write_bytes == with_regs.sram_write_bytes


@pytest.mark.parametrize("cfg", [c for c in SHIPPED if c.q_regs], ids=_name)
def test_forward_keeps_its_register_q(cfg):
    """Q's A registers (q_regs), loaded before the key loop, are not written inside it (see tests/
    test_bwd_tf32_compile.py's dQ test: the ptxas miscompilation that check catches)."""
    from cuflash.__main__ import sass_clobbered_a_operands

    nvrtc_or_skip()
    text = sass_or_skip(_compile.compile_kernel(cfg.cpp_name(), "sm_90a").cubin)
    assert sass_clobbered_a_operands(text) == [], cfg


def _waits_for_pv(text: str) -> list:
    """For every wait for all wgmma groups (WARPGROUP.DEPBAR.LE gsb0, 0x0) that follows a wait for all but one (0x1:
    the key loop's S_i, with P_{i-1} V_{i-1} in flight), the MUFU.EX2 between the two and those after it up to the
    next warpgroup MMA or wait."""
    out, before, after = [], None, None
    for line in text.splitlines():
        if "HGMMA" in line or "WARPGROUP.DEPBAR" in line:
            if after is not None:
                out.append((before, after))
                before = after = None
            if re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1\b", line):
                before = 0
            elif re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b", line) and before is not None:
                after = 0
            else:
                before = None
        elif "MUFU.EX2" in line:
            if after is not None:
                after += 1
            elif before is not None:
                before += 1
    return out


@pytest.mark.parametrize("cfg", [c for c in SHIPPED if c.q_regs and c.dtype == "fp32"], ids=_name)
def test_3xtf32_softmax_runs_under_the_previous_pv_gemm(cfg):
    """In the 3xTF32 forward's key loop the wait for P_{i-1} V_{i-1} comes after every exponential of tile i's
    softmax (ptx.cuh end_basic_block): ptxas otherwise moves it to the top of its basic block, ahead of them."""
    nvrtc_or_skip()
    text = sass_or_skip(_compile.compile_kernel(cfg.cpp_name(), "sm_90a").cubin)
    waits = _waits_for_pv(text)
    assert waits, cfg
    for before, after in waits:
        assert before > 0 and after == 0, (cfg, waits)


def test_pv_wait_parser_tells_the_orders_apart():
    """_waits_for_pv on hand-made listings: the softmax ahead of the wait, and the wait hoisted into it."""
    def listing(lines):
        return "\n".join(f"        /*{16 * i:04x}*/                   {x} ;" for i, x in enumerate(lines))
    mma = "HGMMA.64x64x8.F32.TF32 R24, gdesc[UR4], R24, gsb0"
    ex2 = ["MUFU.EX2 R10, R10", "MUFU.EX2 R11, R11"]
    under = listing([mma, "WARPGROUP.DEPBAR.LE gsb0, 0x1"] + ex2 + ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "FMUL R1, R1, R2",
                                                                     mma])
    hoisted = listing([mma, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R10, R10", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
                       "MUFU.EX2 R11, R11", mma])
    assert _waits_for_pv(under) == [(2, 0)]
    assert _waits_for_pv(hoisted) == [(1, 1)]
    assert _waits_for_pv(listing([mma, "WARPGROUP.DEPBAR.LE gsb0, 0x0"] + ex2 + [mma])) == []
