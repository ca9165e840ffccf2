"""The float32 Hopper backward (cuda/bwd_sm90_tf32.cuh) without a GPU: the registry sends float32 backwards to it on
sm_90a at kernel head dims 32, 64 and 128 (no score modifier but a window, a bias, ALiBi and a mask; 128 as
clusters of two CTAs of 64 columns, the `_pair_kernel`s) and to bwd_wide_kernel elsewhere; its two kernels (dK / dV,
dQ) compile through NVRTC for sm_90a spill-free and without ptxas serializing their warpgroup MMAs, with TMA loads,
the TF32 products their loops issue and, in pairs, the exchange through the other CTA's shared memory; their shared
memory fits sm_90; the configs check their arguments."""
from __future__ import annotations

import re

import pytest

from cuflash import _compile, config
from compile_helpers import nvrtc_or_skip, opcode_counter, sass_or_skip

MAIN = [c for c in config.all_bwd_configs("sm_90a") if isinstance(c, config.BwdSm90Tf32Config)]
DQ = [c for c in config.all_bwd_configs("sm_90a") if isinstance(c, config.BwdDqSm90Tf32Config)]


def _name(c) -> str:
    kind = "dkdv" if isinstance(c, config.BwdSm90Tf32Config) else "dq"
    return (f"{kind}-{c.dtype}-d{c.head_dim}-{'causal' if c.causal else 'window' if c.window else 'full'}"
            f"{'-bias' if c.bias else ''}{'-alibi-mask' if c.alibi_mask else ''}")


def _sass(cfg):
    """The kernel's SASS text and a function counting its instructions that start with a prefix."""
    nvrtc_or_skip()
    text = sass_or_skip(_compile.compile_kernel(cfg.cpp_name(), "sm_90a").cubin)
    return text, opcode_counter(text)


def test_every_table_entry_is_shipped_with_its_dq_kernel():
    want = {(dt, d, c, w, b, am) for dt, table in config.BWD_SM90_TF32_TILES.items() for d in table
            for c, w in ((False, False), (True, False), (False, True)) for b in (False, True) for am in (False, True)}
    assert {(c.dtype, c.head_dim, c.causal, c.window, c.bias, c.alibi_mask) for c in MAIN} == want
    assert len(MAIN) == 72 and set(DQ) == {c.dq_config() for c in MAIN}
    for c in MAIN:
        d = c.dq_config()
        assert (d.dtype, d.head_dim, d.causal, d.window, d.bias, d.alibi_mask) == (
            c.dtype, c.head_dim, c.causal, c.window, c.bias, c.alibi_mask)
        assert c.cpp_name().endswith(f", {c.mods}>") and d.cpp_name().endswith(f", {c.mods}>")
        assert c.mods == (config.MOD_WINDOW * c.window + config.MOD_BIAS * c.bias
                          + (config.MOD_ALIBI | config.MOD_MASK) * c.alibi_mask), c
        # with a bias (or ALiBi and a mask) one-pass TF32 at head dims 64 and 128 takes 16-query steps (its 32-query
        # steps spilled)
        per_score = c.bias or c.alibi_mask
        assert c.block_m == (16 if per_score and c.dtype == "tf32" and c.head_dim >= 64 else
                             config.BWD_SM90_TF32_TILES[c.dtype][c.head_dim][0]), c
        # consumer warpgroups: a table entry's third element (2 without one)
        tiles = config.BWD_SM90_TF32_TILES[c.dtype]
        if per_score:
            tiles = {**tiles, **config.BWD_SM90_TF32_TILES_BIAS.get(c.dtype, {})}
        assert (c.block_m, c.stages) == tiles[c.head_dim][:2], c
        assert c.consumers == (tiles[c.head_dim][2] if len(tiles[c.head_dim]) > 2 else 2), c
        # K's big part in registers for the first k8 steps of S^T: a fourth element (3xTF32 only)
        assert c.k_reg_steps == (tiles[c.head_dim][3] if len(tiles[c.head_dim]) > 3 else 0), c
        assert c.k_reg_steps == 0 or c.dtype == "fp32", c
        traits = re.search(r"BwdTf32Traits<([^>]*)>", c.cpp_name()).group(1).split(", ")
        assert (traits[6:] or ["0"]) == [str(c.k_reg_steps)], c
        assert (c.block_n, c.threads) == (64 * c.consumers, 128 + 128 * c.consumers), c
        assert (f", {c.split}, 3>" in c.cpp_name()) == (c.consumers == 3), c
        # head dim 128: clusters of two CTAs of 64 columns, twice the CTAs of the grid
        assert c.split == d.split == (2 if c.head_dim == 128 else 1)
        assert ("_pair_kernel<" in c.cpp_name()) == ("_pair_kernel<" in d.cpp_name()) == (c.split == 2)
        assert c.grid(3, 5, 1000)[0] == c.split * -(-1000 // c.block_n)
        assert d.grid(3, 5, 1000)[0] == d.split * -(-1000 // d.block_m)


@pytest.mark.parametrize("dtype", ["fp32", "tf32"])
def test_registry_sends_float32_backward_to_the_tf32_kernels_at_head_dims_32_to_128(dtype):
    for hd, causal, mods in ((hd, c, m) for hd in (32, 64, 128) for c, m in (
            (False, 0), (True, 0), (False, config.MOD_WINDOW), (False, config.MOD_BIAS), (True, config.MOD_BIAS),
            (False, config.MOD_WINDOW | config.MOD_BIAS))):
        for det in (False, True):
            cfg = config.select("backward", hd, dtype, causal, "sm_90a", mods=mods, deterministic=det)
            assert isinstance(cfg, config.BwdSm90Tf32Config), (causal, mods, cfg)
            assert (cfg.dtype, cfg.causal, cfg.mods) == (dtype, causal, mods)
    # ALiBi and a mask, alone or together, beside a bias and a window: one instantiation with both bits
    A, M = config.MOD_ALIBI, config.MOD_MASK
    for hd, causal, mods in ((hd, c, m) for hd in (32, 64, 128) for c, m in (
            (False, A), (True, M), (False, A | M), (True, config.MOD_BIAS | M),
            (False, config.MOD_WINDOW | config.MOD_BIAS | A))):
        cfg = config.select("backward", hd, dtype, causal, "sm_90a", mods=mods)
        assert isinstance(cfg, config.BwdSm90Tf32Config) and cfg.alibi_mask, (hd, causal, mods, cfg)
        assert cfg.mods == cfg.dq_config().mods == mods | A | M
    for m in (config.MOD_SOFTCAP, config.MOD_DROPOUT, config.MOD_SOFTCAP | config.MOD_MASK,
              config.MOD_DROPOUT | config.MOD_ALIBI, config.MOD_BIAS | config.MOD_SOFTCAP):
        assert isinstance(config.select("backward", 64, dtype, False, "sm_90a", mods=m), config.BwdWideConfig), m
    assert isinstance(config.select("backward", 32, dtype, False, "sm_90a", mods=config.MOD_BIAS),
                      config.BwdSm90Tf32Config)
    assert isinstance(config.select("backward", 256, dtype, False, "sm_90a"), config.BwdWideConfig)
    for m in (config.MOD_SOFTCAP, config.MOD_BIAS | config.MOD_DROPOUT):
        assert isinstance(config.select("backward", 128, dtype, False, "sm_90a", mods=m), config.BwdWideConfig), m
    assert isinstance(config.select("backward", 64, dtype, False, "sm_80"), config.BwdWideConfig)
    assert isinstance(config.select("backward", 64, dtype, False, "sm_90a", kernels="mma"), config.BwdWideConfig)


def test_dq_kernel_holds_q_and_do_in_registers_where_they_fit_and_paid():
    """The dQ kernel's A operands in registers (a_regs: 1 Q's, 2 Q's and dO's): 3xTF32 at head dims 32 and 128 (at
    128 Q's alone beside a window and a bias), one pass at 32 (not beside a window or a bias), 64 (its 32-key tiles)
    and 128 (Q's alone beside a window or a bias); never 3xTF32 at 64, where every variant measured slower."""
    want = {("fp32", 32): lambda w, b: 2,
            ("fp32", 64): lambda w, b: 0,
            ("fp32", 128): lambda w, b: 1 if w and b else 2,
            ("tf32", 32): lambda w, b: 0 if w or b else 1,
            ("tf32", 64): lambda w, b: 2,
            ("tf32", 128): lambda w, b: 1 if w or b else 2}
    for (dt, hd), rule in want.items():
        for causal, window, bias in ((False, False, False), (True, False, False), (False, True, False),
                                     (False, False, True), (True, False, True), (False, True, True)):
            d = config.bwd_sm90_tf32_config(hd, dt, causal, window, bias).dq_config()
            assert d.a_regs == rule(window, bias), (dt, hd, causal, window, bias)
            assert (f", {d.split}, {d.a_regs}>," in d.cpp_name()) == (d.a_regs > 0), d.cpp_name()
    assert config.BwdDqSm90Tf32Config(64, 32, 2, 2, "fp32", False).cpp_name().endswith(
        "BwdDqTf32Traits<64, 32, 2, 2, true>, false, 0>")
    with pytest.raises(ValueError, match="a_regs=3"):
        config.BwdDqSm90Tf32Config(64, 32, 2, 2, "fp32", False, a_regs=3)
    # ALiBi with a mask: the plain or bias tiles, but beside a window 16-key tiles in 3xTF32 at head dim 64 and Q's A
    # registers alone in one pass at 64, beside a bias two consumers in one pass at 32
    # (config.BWD_DQ_SM90_TF32_TILES_SCORE_WINDOW, _SCORE_BIAS)
    for dt, hd, alone, beside_window, beside_bias in (("fp32", 64, (32, 2, 2, 0), (16, 3, 2, 0), None),
                                                      ("tf32", 32, (64, 3, 3, 0), None, (64, 3, 2, 0)),
                                                      ("tf32", 64, (32, 3, 2, 2), (32, 3, 2, 1), None),
                                                      ("fp32", 32, (64, 2, 2, 2), None, None)):
        for causal, window, bias in ((False, False, False), (True, False, False), (False, True, False),
                                     (False, False, True), (True, False, True), (False, True, True)):
            d = config.bwd_sm90_tf32_config(hd, dt, causal, window, bias, alibi_mask=True).dq_config()
            want = (beside_window if window and beside_window else beside_bias if bias and beside_bias else alone)
            assert (d.block_n, d.stages, d.consumers, d.a_regs) == want, (dt, hd, causal, window, bias, d)
    # one pass with 64-key tiles at 64 columns computed a wrong dQ on an H200: refused
    with pytest.raises(ValueError, match="wrong dQ"):
        config.BwdDqSm90Tf32Config(64, 64, 2, 2, "tf32", False, a_regs=1)


def test_configs_check_their_arguments():
    with pytest.raises(ValueError, match="dtype='bf16'"):
        config.BwdSm90Tf32Config(64, 16, "bf16", False)
    with pytest.raises(ValueError, match="head_dim=256"):
        config.BwdSm90Tf32Config(256, 16, "fp32", False)
    with pytest.raises(ValueError, match="head_dim=96"):
        config.BwdDqSm90Tf32Config(96, 16, 2, 2, "fp32", False)
    # head dim 128 (a pair): 3xTF32 fits two stages of 16-query steps beside the exchange slots, not three
    with pytest.raises(ValueError, match="shared memory"):
        config.BwdSm90Tf32Config(128, 16, "fp32", False, stages=3)
    with pytest.raises(ValueError, match="shared memory"):
        config.BwdDqSm90Tf32Config(128, 32, 2, 2, "fp32", False)
    with pytest.raises(ValueError, match="block_m=64"):
        config.BwdSm90Tf32Config(64, 64, "fp32", False)
    with pytest.raises(ValueError, match="causal=True with window=True"):
        config.BwdSm90Tf32Config(64, 16, "fp32", True, window=True)
    # 3xTF32 at 32 queries per step and three stages: K, V of 128 keys and the split stages exceed 227 KB
    with pytest.raises(ValueError, match="shared memory"):
        config.BwdSm90Tf32Config(64, 32, "fp32", False, stages=3)
    with pytest.raises(ValueError, match="block_n=128"):
        config.BwdDqSm90Tf32Config(64, 128, 2, 2, "fp32", False)
    with pytest.raises(ValueError, match="shared memory"):
        config.BwdDqSm90Tf32Config(64, 64, 2, 2, "fp32", False)
    # the dQ kernel: up to three consumer warpgroups, two in a cluster pair (head dim 128)
    with pytest.raises(ValueError, match="consumers=4"):
        config.BwdDqSm90Tf32Config(32, 64, 3, 4, "tf32", False)
    with pytest.raises(ValueError, match="consumers=3 at head_dim=128"):
        config.BwdDqSm90Tf32Config(128, 16, 2, 3, "tf32", False)
    # the dK / dV kernel: two consumer warpgroups, or three where a key block is one CTA
    with pytest.raises(ValueError, match="consumers=3 at head_dim=128"):
        config.BwdSm90Tf32Config(128, 16, "tf32", False, consumers=3)
    # K's big part in registers: 3xTF32, at most the k8 steps of a CTA's columns (8 at head dims 64 and 128)
    with pytest.raises(ValueError, match="k_reg_steps=2 \\(tf32"):
        config.BwdSm90Tf32Config(64, 16, "tf32", False, k_reg_steps=2)
    with pytest.raises(ValueError, match="k_reg_steps=9 \\(fp32, head_dim=128\\).*at most the 8 k8 steps"):
        config.BwdSm90Tf32Config(128, 16, "fp32", False, k_reg_steps=9)
    assert config.BwdSm90Tf32Config(128, 16, "fp32", False, k_reg_steps=8).cpp_name().endswith(
        "BwdTf32Traits<64, 16, 2, true, 2, 2, 8>, false, 0>")
    with pytest.raises(ValueError, match="consumers=1"):
        config.BwdSm90Tf32Config(32, 32, "tf32", False, consumers=1)
    assert config.BwdSm90Tf32Config(32, 32, "tf32", False, consumers=3).block_n == 192
    assert config.BwdDqSm90Tf32Config(32, 64, 3, 3, "tf32", False).block_m == 192


def test_shared_memory_fits_sm90_and_follows_the_traits():
    for c in MAIN:
        parts = 2 if c.dtype == "fp32" else 1
        cols = 64 if c.head_dim == 128 else c.head_dim  # a pair's CTA: 64 columns
        kv, q = 4 * c.block_n * cols, 4 * c.block_m * cols
        # a pair's exchange: S^T and dP^T fragments (a float4 per n8 tile and consumer thread) of its consumers,
        # double-buffered, and a barrier for each slot
        xchg, xbars = (2 * 2 * c.consumers * 128 * 16 * c.block_m // 8, 4 * c.consumers) if c.head_dim == 128 \
            else (0, 0)
        # K, V (+ big parts); per stage Q, dO with big parts and transposes (big, small), lse_log2 and delta, the
        # step's query head, block and tile state (16 bytes); mbarriers; alignment slack
        assert c.smem_bytes == 2 * parts * kv + c.stages * (2 * 2 * parts * q + 2 * 4 * c.block_m + 16) + xchg + \
            8 * (2 + 3 * c.stages + xbars) + 1024
        assert c.smem_bytes <= config.SMEM_LIMIT_SM90 and c.threads == 128 + 128 * c.consumers, c
        assert c.block_n == 64 * c.consumers, c
    for c in DQ:
        parts = 2 if c.dtype == "fp32" else 1
        cols = 64 if c.head_dim == 128 else c.head_dim
        q, kv = 4 * c.block_m * cols, 4 * c.block_n * cols
        xchg, xbars = (2 * 2 * c.consumers * 128 * 16 * c.block_n // 8, 4 * c.consumers) if c.head_dim == 128 \
            else (0, 0)
        # Q, dO (+ big parts); per stage K (+ big), K^T (big, small), V (+ big); exchange; mbarriers; slack
        assert c.smem_bytes == 2 * parts * q + c.stages * 3 * parts * kv + xchg + 8 * (2 + 3 * c.stages + xbars) + 1024
        assert c.smem_bytes <= config.SMEM_LIMIT_SM90 and c.threads == 128 + 128 * c.consumers, c


@pytest.mark.parametrize("cfg", MAIN + DQ, ids=_name)
def test_every_instantiation_compiles_spill_free_and_unserialized(cfg):
    nvrtc_or_skip()
    compiled = _compile.compile_kernel(cfg.cpp_name(), "sm_90a")
    res = compiled.resources
    spills = (res["spill_stores"], res["spill_loads"], res["stack"])
    assert spills == (0, 0, 0), f"{cfg} spills (stores, loads, stack) = {spills}\n{compiled.log}"
    assert res["registers"] is not None and res["registers"] <= 168, f"{cfg}: {res}"
    # C7515 / C7508: ptxas serializing the wgmma of a loop (e.g. an accumulator also written by other code)
    assert "C7515" not in compiled.log and "C7508" not in compiled.log and "serialized" not in compiled.log, \
        compiled.log
    assert res["static_smem"] + cfg.smem_bytes <= 227 * 1024


@pytest.mark.parametrize("cfg", [c for c in MAIN if not c.causal and not c.window], ids=_name)
def test_sass_of_the_dk_dv_kernel(cfg):
    text, count = _sass(cfg)
    cols = cfg.head_dim // cfg.split  # a CTA's columns
    panels = cols // 32
    # K, V once; Q, dO per step: one TMA load per 32-float panel; lse_log2 and delta by two 1-D bulk copies
    assert count("UTMALDG") == 4 * panels, f"{cfg}: {count('UTMALDG')} TMA loads"
    assert count("UBLKCP") == 2, f"{cfg}: {count('UBLKCP')} bulk copies"
    products = 3 if cfg.dtype == "fp32" else 1
    sdp = 2 * products * cols // 8  # S^T and dP^T: a product per k8 step of the CTA's columns
    dkdv = 2 * products * cfg.block_m // 8  # dV and dK: a product per k8 step of the step's queries
    overlap = cfg.block_m == 16  # the next step's S^T, dP^T issued behind dK: a second copy of their MMAs
    assert count("HGMMA") == (2 if overlap else 1) * sdp + dkdv, f"{cfg}: {count('HGMMA')} HGMMA"
    assert re.search(r"HGMMA\.\w+\.F32\.TF32", text), f"{cfg}: no TF32 HGMMA"
    assert count("USETMAXREG") == 2 and count("LDL") == 0 and count("STL") == 0, cfg
    assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", text), f"{cfg}: no wgmma.wait_group 1 (S^T before dP^T)"
    if overlap:
        assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x2", text), f"{cfg}: dK is not waited for behind S^T, dP^T"
    _check_exchange(cfg, text, count, cfg.block_m // 8)


def _check_exchange(cfg, text, count, tiles):
    """A pair sends its S and dP fragments to the other CTA (st.async: one 16-byte STAS per n8 tile of each) and
    meets it at a cluster barrier at the start and at the end (one in each role's branch); a single CTA has
    neither."""
    if cfg.split == 1:
        assert count("STAS") == 0 and count("UCGABAR") == 0, cfg
        return
    assert count("STAS.128") == 2 * tiles, f"{cfg}: {count('STAS.128')} stores to the other CTA"
    arrive, wait = (len(re.findall(rf"\bUCGABAR_{x}\b", text)) for x in ("ARV", "WAIT"))
    assert arrive == wait == 3, f"{cfg}: {arrive} / {wait} cluster barrier arrives / waits (start; end per role)"


@pytest.mark.parametrize("cfg", [c for c in DQ if not c.causal and not c.window], ids=_name)
def test_sass_of_the_dq_kernel(cfg):
    text, count = _sass(cfg)
    cols = cfg.head_dim // cfg.split
    panels = cols // 32
    assert count("UTMALDG") == 4 * panels, f"{cfg}: {count('UTMALDG')} TMA loads (Q, dO once; K, V per tile)"
    products = 3 if cfg.dtype == "fp32" else 1
    # S and dP (a product per k8 step of the CTA's columns), dQ (per k8 step of the key tile)
    assert count("HGMMA") == products * (2 * cols // 8 + cfg.block_n // 8), f"{cfg}: {count('HGMMA')}"
    # A from registers: dS in every product of dQ; with a_regs Q's (1) or Q's and dO's (2) big parts in two of the
    # three products of S (and dP) per k8 step (3xTF32), or their rounded values in its one product
    reg_a = len(re.findall(r"HGMMA\.\S+ R\d+, R\d+, gdesc", text))
    assert reg_a == products * cfg.block_n // 8 + cfg.a_regs * (2 if products == 3 else 1) * cols // 8, \
        f"{cfg}: {reg_a}"
    # (global reductions: RED.E.ADD...; REDUX, a warp's sum in registers, counts a mask kernel's visible tiles)
    assert count("LDL") == 0 and count("STL") == 0 and count("RED.") == 0 and count("ATOM") == 0, \
        f"{cfg}: local memory or atomics"
    _check_exchange(cfg, text, count, cfg.block_n // 8)


def test_analyzer_counts_the_dq_kernels_register_operands(monkeypatch):
    """cuflash-sim's backward on sm_90a: with a_regs 2 (3xTF32 at head dim 32) the dQ kernel's consumers read Q's and
    dO's big parts from shared memory once per query block, and per key tile one product of S and one of dP read Q
    and dO instead of three each: the shared-memory reads drop by 4 Q tiles per key tile, less 2 per query block."""
    from simulator import strategies
    from simulator.model import Problem

    p = Problem(batch=1, heads=1, seqlen_q=1024, seqlen_k=1024, head_dim=32, dtype="fp32")
    with_regs = strategies.simulate("cuflash", p, backward=True)
    d = config.bwd_sm90_tf32_config(32, "fp32", False).dq_config()
    assert d.a_regs == 2 and (d.block_m, d.block_n) == (128, 64)
    monkeypatch.setitem(config.BWD_DQ_SM90_TF32_TILES["fp32"], 32, (64, 2, 2))
    without = strategies.simulate("cuflash", p, backward=True)
    q_tile, blocks = 4 * 128 * 32, 1024 // 128
    tiles = blocks * (1024 // 64)  # not causal: every query block visits every key tile
    assert without.sram_read_bytes - with_regs.sram_read_bytes == tiles * 4 * q_tile - blocks * 2 * q_tile
    assert without.sram_write_bytes == with_regs.sram_write_bytes and without.hbm_read_bytes == with_regs.hbm_read_bytes


@pytest.mark.parametrize("cfg", [c for c in DQ if c.a_regs], ids=_name)
def test_dq_kernels_keep_their_register_a_operands(cfg):
    """Q's (and dO's) A registers, loaded from shared memory before the key loop, are not written inside it: NVRTC
    13.0's ptxas overwrote them in the refused 64-key variant (every dQ element wrong on an H200; NVRTC 13.5's cubin of
    the same source right). The compile check runs this under NVRTC 13.0 too (`cuflash compile --sass`)."""
    from cuflash.__main__ import sass_clobbered_a_operands

    text, _ = _sass(cfg)
    assert sass_clobbered_a_operands(text) == [], cfg
