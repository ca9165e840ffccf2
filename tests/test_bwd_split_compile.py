"""The wide-head Hopper backward (cuda/bwd_sm90_split.cuh) without a GPU: the registry sends 16-bit backwards at
kernel head dims 192 and 256 to it on sm_90a (window, ALiBi, soft-capping, dropout; not a bias or mask) and to the
mma.sync backward elsewhere; its instantiations compile through NVRTC for sm_90a spill-free, issue the wgmma its
step needs, load by TMA, and add dQ (red.global.add) only where it owns dQ; its shared memory fits sm_90; the config
checks its arguments; the analyzer counts it."""
from __future__ import annotations

import pytest

from cuflash import _compile, config
from cuflash.simulator import Problem, simulate
from compile_helpers import nvrtc_or_skip, opcode_counter, sass_or_skip

SPLIT = [c for c in config.all_bwd_configs("sm_90a") if isinstance(c, config.BwdSm90SplitConfig)]


def test_every_dtype_head_dim_and_variant_is_shipped():
    heavy = config.MOD_ALIBI | config.MOD_SOFTCAP | config.MOD_DROPOUT
    want = {(dt, d, c, m, det) for dt in config.DTYPES for d in config.BWD_SM90_SPLIT_HEAD_DIMS
            for c, m in ((False, 0), (True, 0), (False, config.MOD_WINDOW), (False, heavy | config.MOD_WINDOW),
                         (True, heavy)) for det in (False, True)}
    assert {(c.dtype, c.head_dim, c.causal, c.mods, c.deterministic) for c in SPLIT} == want and len(SPLIT) == 40


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_registry_sends_wide_heads_to_the_split_kernel_on_sm90(dtype):
    for hd in (192, 256):
        for causal in (False, True):
            for mods in range(16):  # every combination of window, ALiBi, softcap, dropout
                if causal and mods & config.MOD_WINDOW:
                    continue  # (causal is a window there)
                for det in (False, True):
                    cfg = config.select("backward", hd, dtype, causal, "sm_90a", mods=mods, deterministic=det)
                    assert isinstance(cfg, config.BwdSm90SplitConfig), (hd, causal, mods, det, cfg)
                    assert (cfg.head_dim, cfg.causal, cfg.mods, cfg.deterministic) == (hd, causal, mods, det)
        for m in (config.MOD_BIAS, config.MOD_MASK, config.MOD_BIAS | config.MOD_DROPOUT,
                  config.MOD_WINDOW | config.MOD_MASK):
            assert isinstance(config.select("backward", hd, dtype, False, "sm_90a", mods=m), config.BwdConfig), m
        assert isinstance(config.select("backward", hd, dtype, False, "sm_80"), config.BwdConfig)
        assert isinstance(config.select("backward", hd, dtype, False, "sm_90a", kernels="mma"), config.BwdConfig)
    for hd in (64, 128):  # the warp-specialized kernel keeps these
        assert isinstance(config.select("backward", hd, dtype, False, "sm_90a"), config.BwdSm90WsConfig)


def test_config_checks_its_arguments():
    with pytest.raises(ValueError, match="head_dim=128"):
        config.BwdSm90SplitConfig(128, "bf16", False, False)
    with pytest.raises(ValueError, match=f"mods={config.MOD_BIAS}; .* no bias, mask or block map"):
        config.BwdSm90SplitConfig(256, "bf16", False, False, config.MOD_BIAS)
    with pytest.raises(ValueError, match="dtype='fp32'"):
        config.BwdSm90SplitConfig(256, "fp32", False, False)
    with pytest.raises(ValueError, match=r"\(block_m, block_n, ctas_per_sm\)=\(64, 128, 1\)"):
        config.BwdSm90SplitConfig(256, "bf16", False, False, block_n=128)


@pytest.mark.parametrize("hd", [192, 256])
def test_shared_memory_fits_sm90(hd):
    c = config.BwdSm90SplitConfig(hd, "bf16", False, False)
    # K, V (64 keys), 2 stages of Q, dO (64 rows), P^T and two dS^T buffers (64 x 64), 2 stages of lse_log2, delta,
    # 128 keep-bit words, the deterministic counter's 16 bytes, three mbarriers, 1024 alignment (dQ leaves from
    # registers: no buffer)
    assert c.smem_bytes == 2 * 64 * hd * 2 + 4 * 64 * hd * 2 + 3 * 64 * 64 * 2 + 4 * 64 * 4 + 128 * 4 + 16 + 24 + 1024
    # TMA boxes of whole panels of a warpgroup's half: 64 columns (128-byte swizzle) at 256, 32 (64-byte) at 192
    assert c.box_cols == {192: 32, 256: 64}[hd]
    assert c.smem_bytes <= 227 * 1024 and c.threads == 256
    assert c.grid(3, 5, 129) == (3, 5, 3)


@pytest.mark.parametrize("cfg", [c for c in SPLIT if c.dtype == "bf16"],
                         ids=lambda c: f"d{c.head_dim}-{'causal' if c.causal else 'full'}-mods{c.mods}"
                                       f"-{'det' if c.deterministic else 'atomic'}")
def test_compiles_spill_free_with_its_products(cfg):
    nvrtc_or_skip()
    compiled = _compile.compile_kernel(cfg.cpp_name(), "sm_90a")
    r = compiled.resources
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{cfg.cpp_name()} spills: {r}"
    assert "C75" not in compiled.log, compiled.log  # ptxas serialized the warpgroup MMAs
    text = sass_or_skip(compiled.cubin)
    count = opcode_counter(text)
    # per step, one warpgroup's path: S^T or dP^T (HEAD_DIM / 16 k steps), dV and dK (4 each), dQ chunks (4 each)
    assert count("HGMMA") >= cfg.head_dim // 16 + 8 + (0 if cfg.deterministic else 4)
    # dQ: red.global.add.v4.f32 from the registers (one per n8 tile of a chunk; the chunk loop is rolled) where the
    # kernel adds dQ: not deterministic, from three sites (a step adds the last step's dQ, warpgroup 1 under its dP^T
    # GEMM, warpgroup 0 under warpgroup 1's dS^T, and the last step's comes after the loop), or ordered, in the step,
    # beside the turn counter's red.release (issued by the next step and after the last one); no bulk reductions
    reds = count("REDG")
    per_site = {192: 12, 256: 8}[cfg.head_dim]
    assert reds == (per_site + 2 if cfg.ordered else 0 if cfg.deterministic else 3 * per_site), reds
    assert count("UBLKRED") == 0, "dQ leaves from registers"
    assert count("LDL") == 0 and count("STL") == 0
    # loads by TMA from one thread: K and V once, Q_i and dO_i per step (one box per panel: the first step's copies
    # and the loop's), lse_log2_i and delta_i by bulk copies; no cp.async
    panels = cfg.head_dim // cfg.box_cols
    assert count("UTMALDG") == 2 * panels + 2 * 2 * panels, count("UTMALDG")
    assert count("UBLKCP") == 2 * 2 and count("LDGSTS") == 0


@pytest.mark.parametrize("causal", [False, True])
def test_the_analyzer_counts_the_split_kernel(causal):
    from cuflash.simulator.strategies import cuflash_backward_kernels
    p = Problem(batch=2, heads=3, seqlen_q=300, seqlen_k=517, head_dim=256, dtype="bf16", causal=causal)
    names = [k.name for k in cuflash_backward_kernels(p)]
    assert names == ["bwd_preprocess_kernel", "bwd_sm90_split_kernel", "bwd_convert_dq_ws_kernel"]
    c = simulate("cuflash", p, backward=True)
    assert (c.block_m, c.block_n) == (64, 64) and c.bank_conflicts is None
    assert c.sram_read_bytes > 0 and c.sram_write_bytes > 0
    det = simulate("cuflash", p, backward=True, deterministic=True)  # the same kernel, its dQ adds in turns
    assert det.sram_read_bytes == c.sram_read_bytes and det.hbm_read_bytes > c.hbm_read_bytes  # + the counters
    assert [k.name for k in cuflash_backward_kernels(p, deterministic=True)] == names


@pytest.mark.parametrize("hd", [192, 256])
def test_deterministic_adds_dq_in_turns_at_256(hd):
    """Deterministic at head dim 256 the kernel adds dQ itself in a fixed order of key blocks (config.ordered_dq: turn
    counters, no bwd_dq_kernel); at 192 (BWD_SM90_SPLIT_ORDERED) it leaves dQ to bwd_dq_kernel, unless asked."""
    det = config.BwdSm90SplitConfig(hd, "bf16", True, True)
    assert det.ordered == (hd == 256) and config.ordered_dq(det) == (hd == 256)
    assert det.cpp_name().endswith(", true>") == (hd == 256)
    asked = config.BwdSm90SplitConfig(hd, "bf16", True, True, ordered=True)
    assert config.ordered_dq(asked) and asked.cpp_name().endswith(", true>") and config.turn_rows(asked) == 64
    plain = config.BwdSm90SplitConfig(hd, "bf16", True, False)
    assert not plain.ordered and not config.ordered_dq(plain) and plain.cpp_name().endswith(", 0>")
    with pytest.raises(ValueError, match="ordered=True needs deterministic=True"):
        config.BwdSm90SplitConfig(hd, "bf16", False, False, ordered=True)
    assert config.ordered_dq(config.backward_kernel_config(hd, "bf16", False, True, "sm_90a")) == (hd == 256)
