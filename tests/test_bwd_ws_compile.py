"""The warp-specialized Hopper backward (cuda/bwd_sm90_ws.cuh) without a GPU: its configs, where the registry
chooses it, the params struct Python fills (cuflash/_tma.py) against the C++ static_asserts, the 64-byte swizzle
maps of head dim 64, and every shipped instantiation compiled for sm_90a: spill-free, setmaxnreg honoured, its
SASS holding the TMA loads, the 1-D bulk copies of lse_log2 / delta and (unless deterministic) one bulk reduction
per query block; the shared-memory size the host asks for equal to the kernel's layout (it traps when given less)."""
from __future__ import annotations

import ctypes
import re
from types import SimpleNamespace

import pytest

from cuflash import _compile, _launch, _tma, config
from compile_helpers import nvrtc_or_skip, sass_or_skip

WS = [c for c in config.all_bwd_configs("sm_90a") if isinstance(c, config.BwdSm90WsConfig)]


def test_registry_chooses_the_ws_backward_where_it_has_kernels():
    for d in (32, 64, 128):
        for causal, mods in ((False, 0), (True, 0), (False, config.MOD_WINDOW)):
            cfg = config.backward_kernel_config(d, "bf16", causal, False, "sm_90a", mods=mods)
            assert isinstance(cfg, config.BwdSm90WsConfig) and cfg.head_dim == d, cfg
            # steps of 128 queries at head dims 32 and 64 (plain, causal, windowed), dQ_acc in their order
            bm = 128 if d <= 64 else 64
            assert cfg.block_m == bm, cfg
            assert config.convert_dq_config(cfg, "bf16") == config.ElementwiseConfig("convert_dq_ws", "bf16",
                                                                                      head_dim=d, block_m=bm)
        for mods in (config.MOD_ALIBI, config.MOD_SOFTCAP | config.MOD_WINDOW, config.MOD_DROPOUT, config.MOD_BIAS,
                     config.MOD_MASK, config.MOD_BLOCKS, config.MOD_BIAS | config.MOD_ALIBI,
                     config.MOD_BIAS | config.MOD_SOFTCAP, config.MOD_BIAS | config.MOD_DROPOUT):
            # 64-query steps (BwdSm90WsTraits::takes_mods, spills), except head dim 32's staged bias and a mask
            # or a BlockMask's map alone at head dims 32 and 64
            bm = 128 if (d == 32 and mods == config.MOD_BIAS) or (d <= 64 and mods in (config.MOD_MASK,
                                                                                        config.MOD_BLOCKS)) else 64
            assert config.bwd_sm90_ws_config(d, "bf16", False, False, mods).block_m == bm, (d, mods)
    # head dim 32: a staged bias in 128-query steps, with a mask, a window or both beside it, deterministic or not
    for mods in (config.MOD_BIAS, config.MOD_BIAS | config.MOD_WINDOW, config.MOD_BIAS | config.MOD_MASK,
                 config.MOD_BIAS | config.MOD_MASK | config.MOD_WINDOW):
        for causal, det in ((False, False), (True, False), (False, True), (True, True)):
            if not (causal and mods & config.MOD_WINDOW):
                cfg = config.backward_kernel_config(32, "fp16", causal, det, "sm_90a", mods=mods)
                assert isinstance(cfg, config.BwdSm90WsConfig) and cfg.block_m == 128, (mods, causal, det)
                assert config.bwd_stages_bias(32, mods, causal) and not config.ordered_dq(cfg)
    # every modifier at head dims 32 and 64; head dim 128 with the heavy sets that fit its registers, the others on
    # mma.sync; head dim 96 on the 128 kernel
    for d in (32, 64):
        cfg = config.backward_kernel_config(d, "fp16", False, True, "sm_90a", mods=config.MODS_ALL)
        assert isinstance(cfg, config.BwdSm90WsConfig) and cfg.head_dim == d, cfg
    assert config.backward_kernel_config(96, "bf16", True, False, "sm_90a").head_dim == 128
    for mods in (config.MOD_ALIBI, config.MOD_DROPOUT | config.MOD_WINDOW, config.MOD_BIAS,
                 config.MOD_BIAS | config.MOD_MASK | config.MOD_WINDOW, config.MOD_SOFTCAP,
                 config.MOD_SOFTCAP | config.MOD_WINDOW, config.MOD_ALIBI | config.MOD_SOFTCAP, config.MOD_MASK,
                 config.MOD_MASK | config.MOD_WINDOW, config.MOD_ALIBI | config.MOD_MASK,
                 config.MOD_SOFTCAP | config.MOD_MASK | config.MOD_WINDOW):
        assert isinstance(config.backward_kernel_config(128, "fp16", False, False, "sm_90a", mods=mods),
                          config.BwdSm90WsConfig), mods
    for mods in (config.MOD_SOFTCAP | config.MOD_DROPOUT, config.MOD_ALIBI | config.MOD_SOFTCAP | config.MOD_MASK,
                 config.MOD_ALIBI | config.MOD_DROPOUT, config.MOD_MASK | config.MOD_DROPOUT,
                 config.MOD_BIAS | config.MOD_DROPOUT, config.MODS_ALL):
        heavy = config.backward_kernel_config(128, "fp16", False, False, "sm_90a", mods=mods)
        assert type(heavy) is config.BwdConfig, mods
        assert config.convert_dq_config(heavy, "fp16").kind == "convert_dq"
    # off Hopper, and with CUFLASH_KERNELS=mma, the mma.sync backward
    assert type(config.backward_kernel_config(128, "bf16", False, False, "sm_80")) is config.BwdConfig
    assert type(config.backward_kernel_config(128, "bf16", False, False, "sm_90a", kernels="mma")) is config.BwdConfig
    assert not [c for c in config.all_bwd_configs("sm_80")
                if isinstance(c, config.BwdSm90Config) or getattr(c, "kind", "") == "convert_dq_ws"]


def test_ws_config_geometry_and_errors():
    c = config.bwd_sm90_ws_config(128, "bf16", True, False)
    assert (c.block_m, c.block_n, c.threads, c.panel_cols, c.stages) == (64, 128, 384, 64, 2)
    # dQ's split at column 32 in 64-query steps
    assert config.bwd_sm90_ws_config(64, "fp16", False, True, config.MOD_ALIBI).panel_cols == 32
    # head dim 32: one 32-column panel per tile, dQ's split at column 16 inside it; K, V 128 x 32, 2 x (Q, dO)
    # 64 x 32, 2 dS^T (128 x 64), dQ fp32 (64 x 32), 2 x (lse, delta), 7 mbarriers, the writer's setup
    c32 = config.bwd_sm90_ws_config(32, "bf16", False, False, config.MOD_ALIBI)
    assert (c32.head_dim, c32.block_m, c32.panel_cols, c32.box_cols) == (32, 64, 32, 32)
    assert c32.smem_bytes == 2 * 8192 + 4 * 4096 + 2 * 16384 + 8192 + 4 * 256 + 88 + 1024
    # 128-query steps: dQ split by rows, so head dim 64 takes one 64-column panel (32 one 32-column panel); K, V
    # 128 x 64, 2 x (Q, dO) 128 x 64, 2 dS^T (128 x 128), dQ fp32 (128 x 64), 2 x (lse, delta), 7 mbarriers, the
    # writer's setup
    c64 = config.bwd_sm90_ws_config(64, "bf16", True, True)
    assert (c64.block_m, c64.panel_cols, c64.box_cols, c64.threads) == (128, 64, 64, 384)
    assert c64.smem_bytes == 2 * 16384 + 4 * 16384 + 2 * 32768 + 32768 + 4 * 512 + 88 + 1024
    assert c64.cpp_name() == \
        "cuflash::bwd_sm90_ws_kernel<cuflash::BwdSm90WsTraits<64, cuflash::bf16, 128>, true, true, 0>"
    assert config.bwd_sm90_ws_config(32, "fp16", False, False, config.MOD_WINDOW).panel_cols == 32
    assert config.convert_dq_config(c64, "bf16").cpp_name() == "cuflash::bwd_convert_dq_ws_kernel<cuflash::bf16, 64, 128>"
    # K, V (128 x 128), 2 x (Q, dO) (64 x 128), 2 dS^T (128 x 64), dQ fp32 (64 x 128), 2 x (lse, delta), 7 mbarriers,
    # the writer's setup
    assert c.smem_bytes == 2 * 32768 + 4 * 16384 + 2 * 16384 + 32768 + 4 * 256 + 88 + 1024
    # head dim 64 with a bias (and a mask, a window) stages it: two buffers of 8 warps x 64 rows x 32 bytes from the
    # 128-byte boundary after the mbarriers
    plain64 = config.BwdSm90WsConfig(64, 64, 128, 1, "bf16", False, False)  # 64-query steps, no modifier
    for mods, staged in ((config.MOD_BIAS, True), (config.MOD_BIAS | config.MOD_MASK | config.MOD_WINDOW, True),
                         (config.MOD_BIAS | config.MOD_DROPOUT, False), (config.MOD_MASK | config.MOD_ALIBI, False)):
        cfg = config.bwd_sm90_ws_config(64, "bf16", False, False, mods)
        assert cfg.smem_bytes == plain64.smem_bytes + (40 + 2 * 8 * 64 * 32 if staged else 0), mods
    # a mask alone takes 128-query steps, as the plain kernel (nothing staged)
    assert config.bwd_sm90_ws_config(64, "bf16", False, False, config.MOD_MASK).smem_bytes == \
        config.bwd_sm90_ws_config(64, "bf16", False, False).smem_bytes
    # head dim 128 stages a bias alone, not causal (c is causal)
    assert config.bwd_sm90_ws_config(128, "bf16", True, False, config.MOD_BIAS).smem_bytes == c.smem_bytes
    assert config.bwd_sm90_ws_config(128, "bf16", True, False, config.MOD_BIAS | config.MOD_MASK).smem_bytes == \
        c.smem_bytes
    assert config.bwd_sm90_ws_config(128, "bf16", False, False, config.MOD_BIAS).smem_bytes == \
        c.smem_bytes + 40 + 2 * 8 * 64 * 32 <= config.SMEM_LIMIT_SM90
    # head dim 32 stages a bias in 128-query steps: two buffers of 8 warps x 128 rows x 32 bytes beside K, V
    # (128 x 32), 2 x (Q, dO) (128 x 32), 2 dS^T (128 x 128), dQ fp32 (128 x 32), 2 x (lse, delta), 7 mbarriers, the
    # writer's setup; at head dim 64 they would pass the limit
    plain32 = config.bwd_sm90_ws_config(32, "bf16", False, False)
    assert plain32.block_m == 128
    assert plain32.smem_bytes == 2 * 8192 + 4 * 8192 + 2 * 32768 + 16384 + 4 * 512 + 88 + 1024
    for causal, mods in ((False, config.MOD_BIAS), (True, config.MOD_BIAS | config.MOD_MASK),
                         (False, config.MOD_BIAS | config.MOD_MASK | config.MOD_WINDOW)):
        b32 = config.bwd_sm90_ws_config(32, "bf16", causal, False, mods)
        assert b32.smem_bytes == plain32.smem_bytes + 40 + 2 * 8 * 128 * 32 == 199808 <= config.SMEM_LIMIT_SM90
    assert config.BwdSm90WsConfig(64, 128, 128, 1, "bf16", False, False).smem_bytes + 40 + 2 * 8 * 128 * 32 > \
        config.SMEM_LIMIT_SM90
    assert c.sync_equivalent() == config.bwd_sm90_config(128, "bf16", True, False)
    assert c.cpp_name() == "cuflash::bwd_sm90_ws_kernel<cuflash::BwdSm90WsTraits<128, cuflash::bf16>, true, false, 0>"
    with pytest.raises(ValueError, match="head_dim 32, 64 or 128"):
        config.BwdSm90WsConfig(96, 64, 128, 1, "bf16", False, False)
    with pytest.raises(ValueError, match="block_n"):
        config.BwdSm90WsConfig(128, 64, 64, 1, "bf16", False, False)
    with pytest.raises(ValueError, match="block_m=128 takes head_dim 32 or 64"):
        config.BwdSm90WsConfig(128, 128, 128, 1, "bf16", False, False)
    with pytest.raises(ValueError, match="block_m=128 takes"):
        config.BwdSm90WsConfig(64, 128, 128, 1, "bf16", False, False, config.MOD_DROPOUT)
    with pytest.raises(ValueError, match="block_m"):
        config.BwdSm90WsConfig(64, 96, 128, 1, "bf16", False, False)
    # a bias in 128-query steps: head dim 32 only (its staged rows fit), with at most a mask and a window beside it
    with pytest.raises(ValueError, match="block_m=128 takes"):
        config.BwdSm90WsConfig(64, 128, 128, 1, "bf16", False, False, config.MOD_BIAS)
    with pytest.raises(ValueError, match="block_m=128 takes"):
        config.BwdSm90WsConfig(32, 128, 128, 1, "bf16", False, False, config.MOD_BIAS | config.MOD_ALIBI)
    with pytest.raises(ValueError, match="block_m=128 takes"):
        config.BwdSm90WsConfig(32, 128, 128, 1, "bf16", False, False, config.MOD_MASK | config.MOD_ALIBI)
    config.BwdSm90WsConfig(32, 128, 128, 1, "bf16", False, False, config.MOD_MASK)  # a mask alone: 128 takes it


def test_bwd_ws_params_layout_mirrors_the_cpp_struct():
    assert ctypes.sizeof(_tma.BwdWsParams) == 1152
    assert [getattr(_tma.BwdWsParams, f).offset for f in ("tma_q", "tma_do", "tma_k", "tma_v", "bwd")] == \
        [0, 128, 256, 384, 512]
    assert ctypes.sizeof(_launch.BwdParams) == 624


def test_64_byte_swizzle_maps():
    assert (_tma.panel_swizzle(64), _tma.panel_swizzle(32)) == (128, 64)
    b, s, h, d = 2, 100, 3, 64
    dims = SimpleNamespace(batch=b, seqlen=s, heads=h, head_dim=d, batch_stride=s * h * d, row_stride=h * d,
                           head_stride=d)
    assert _tma.tma_unsupported(0x10000, dims, "bf16", 64, 32) is None
    assert _tma.operand_map(0x10000, dims, "bf16", 64, 32)[3] == (32, 64, 1, 1)
    with pytest.raises(ValueError, match="64-byte swizzle"):  # a 64-column box does not fit a 64-byte swizzle row
        _tma.encode_tiled("bf16", 0x10000, (64, 100), (128,), (64, 64), 64)
    with pytest.raises(ValueError, match="swizzle=32"):
        _tma.encode_tiled("bf16", 0x10000, (64, 100), (128,), (16, 64), 32)


def _name(c):
    return (f"d{c.head_dim}-m{c.block_m}-{c.dtype}-{'causal' if c.causal else 'full'}-det{int(c.deterministic)}"
            f"-mods{c.mods}")


@pytest.mark.parametrize("cfg", WS, ids=_name)
def test_every_instantiation_compiles_spill_free_with_its_data_movement(cfg):
    nvrtc_or_skip()
    compiled = _compile.compile_kernel(cfg.cpp_name(), "sm_90a")
    r = compiled.resources
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, f"{cfg.cpp_name()}: {r}"
    assert "C7508" not in compiled.log, "setmaxnreg ignored (the roles are not one uniform branch)"
    sass = sass_or_skip(compiled.cubin)
    ops = re.findall(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    count = lambda op: sum(o.split(".")[0] == op for o in ops)  # noqa: E731
    panels = cfg.head_dim // cfg.panel_cols
    assert count("UTMALDG") == 4 * panels, "K, V once and Q, dO per step: one box per panel each"
    assert count("UBLKCP") == 2, "lse_log2 and delta: one 1-D bulk copy each"
    # dQ: one bulk reduction per query block (deterministic: by the dQ writer in a fixed order, config.ordered_dq,
    # or none where bwd_dq_kernel computes dQ)
    assert count("UBLKRED") == (1 if not cfg.deterministic or config.ordered_dq(cfg) else 0)
    assert count("USETMAXREG") == 2
