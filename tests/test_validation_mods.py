"""Score-modifier options (sliding window, ALiBi, softcap, dropout): bad values get a clear error naming the
argument, its value and what is allowed; good ones normalize as documented (a window with causal keeps
right <= 0, window (-1, 0) is causal, (-1, -1) no window). Metadata only: no GPU needed."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cuflash import _validate as V
from cuflash import config
from cuflash.philox import dropout_threshold
from test_validation import info


def mods(causal=False, window=None, alibi=None, softcap=None, dropout_p=0.0, seed=None, offset=0, batch=2, heads=4):
    return V.check_mods(causal, window, alibi, softcap, dropout_p, seed, offset, batch, heads, 0)


BAD = [
    ("window-left", dict(window=(-2, 3)), ValueError, ["window=(-2, 3)", "left=-2", "-1"]),
    ("window-right", dict(window=(3, -5)), ValueError, ["right=-5"]),
    ("window-type", dict(window=5), TypeError, ["window=5", "pair"]),
    ("window-length", dict(window=(1, 2, 3)), TypeError, ["window=(1, 2, 3)"]),
    ("window-float", dict(window=(1.5, 2)), TypeError, ["left=1.5", "int"]),
    ("window-bool", dict(window=(True, 2)), TypeError, ["left=True"]),
    ("softcap-zero", dict(softcap=0.0), ValueError, ["softcap=0.0", "> 0"]),
    ("softcap-negative", dict(softcap=-3), ValueError, ["softcap=-3"]),
    ("softcap-inf", dict(softcap=math.inf), ValueError, ["softcap=inf", "finite"]),
    ("softcap-nan", dict(softcap=math.nan), ValueError, ["softcap=nan"]),
    ("softcap-type", dict(softcap="50"), TypeError, ["softcap='50'"]),
    ("dropout-one", dict(dropout_p=1.0, seed=1), ValueError, ["dropout_p=1.0", "0 <= dropout_p < 1"]),
    ("dropout-negative", dict(dropout_p=-0.1, seed=1), ValueError, ["dropout_p=-0.1"]),
    ("dropout-nan", dict(dropout_p=math.nan, seed=1), ValueError, ["dropout_p=nan"]),
    ("dropout-type", dict(dropout_p="0.1", seed=1), TypeError, ["dropout_p='0.1'"]),
    ("dropout-no-seed", dict(dropout_p=0.1), ValueError, ["dropout_p=0.1", "seed"]),
    ("seed-negative", dict(dropout_p=0.1, seed=-1), ValueError, ["seed=-1", "2**64"]),
    ("seed-large", dict(dropout_p=0.1, seed=2**64), ValueError, ["seed=18446744073709551616"]),
    ("seed-type", dict(dropout_p=0.1, seed=1.0), TypeError, ["seed=1.0"]),
    ("offset-large", dict(dropout_p=0.1, seed=1, offset=2**32), ValueError, ["offset=4294967296", "2**32"]),
    ("offset-type", dict(dropout_p=0.1, seed=1, offset="3"), TypeError, ["offset='3'"]),
    ("alibi-dtype", dict(alibi=info("alibi_slopes", (4,), np.float16)), TypeError, ["alibi_slopes.dtype=float16",
                                                                                   "float32"]),
    ("alibi-shape", dict(alibi=info("alibi_slopes", (3,), np.float32)), ValueError, ["alibi_slopes", "(3,)", "(4,)",
                                                                                    "(2, 4)"]),
    ("alibi-batch", dict(alibi=info("alibi_slopes", (3, 4), np.float32)), ValueError, ["(3, 4)"]),
    ("alibi-strided", dict(alibi=info("alibi_slopes", (4,), np.float32, strides=(2,))), ValueError,
     ["strides (2,)", "contiguous"]),
    ("alibi-device", dict(alibi=info("alibi_slopes", (4,), np.float32, device=1)), ValueError, ["device 1"]),
]


@pytest.mark.parametrize("name,kw,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_modifier_options(name, kw, exc, words):
    with pytest.raises(exc) as e:
        mods(**kw)
    for w in words:
        assert w in str(e.value), f"{name}: {w!r} not in {str(e.value)!r}"


@pytest.mark.parametrize("causal,window,bits,kernel_causal,norm", [
    (False, None, 0, False, None),
    (False, (-1, -1), 0, False, None),
    (False, (-1, 0), 0, True, None),             # the causal mask itself
    (True, (-1, -1), 0, True, None),
    (True, (-1, 7), 0, True, None),              # causal cuts the right side to 0
    (True, (5, 7), config.MOD_WINDOW, False, (5, 0)),
    (False, (5, 7), config.MOD_WINDOW, False, (5, 7)),
    (False, (0, 0), config.MOD_WINDOW, False, (0, 0)),
    (False, (5, -1), config.MOD_WINDOW, False, (5, -1)),
    (False, (-1, 3), config.MOD_WINDOW, False, (-1, 3)),
])
def test_window_normalization(causal, window, bits, kernel_causal, norm):
    m = mods(causal=causal, window=window)
    assert (m.bits, m.causal, m.window) == (bits, kernel_causal, norm)


def test_modifier_bits_and_defaults():
    assert mods().bits == 0 and mods(dropout_p=0.0, seed=3).bits == 0
    m = mods(alibi=info("alibi_slopes", (2, 4), np.float32), softcap=30, dropout_p=0.25, seed=2**64 - 1, offset=7)
    assert m.bits == config.MOD_ALIBI | config.MOD_SOFTCAP | config.MOD_DROPOUT
    assert (m.softcap, m.dropout_p, m.seed, m.offset) == (30.0, 0.25, 2**64 - 1, 7)
    assert dropout_threshold(0.25) == 2**30


def test_every_modifier_config_is_compile_checked():
    """The compile check builds, per kernel, MODS 0 and the heaviest modifier sets (config.MODS_CHECKED); a
    launch with any other set uses the tiles of one of them (window alone: the plain/causal tiles, anything
    with ALiBi / softcap / dropout: the *_MODS tiles; on the Hopper warp-specialized forward a mask with at most a
    window: the mask tiles, checked with config.MODS_MASK_CHECKED, a bias with at most a window, at the head dims
    of config.FWD_SM90_WS_TILES_BIAS: the bias tiles, each set built as it is, config.MODS_BIAS_CHECKED, and a bias
    beside a mask, at the head dims of config.FWD_SM90_WS_TILES_BIAS_MASK: its tiles, each set built as it is,
    config.MODS_BIAS_MASK_CHECKED)."""
    names = {c.cpp_name() for c in config.all_fwd_configs() + config.all_bwd_configs()}
    for hd in config.KERNEL_HEAD_DIMS:
        for m in range(1, config.MODS_ALL + 1):
            for causal in (False, True):
                if causal and m & config.MOD_WINDOW:
                    continue
                cfg = config.forward_kernel_config(hd, "bf16", causal, mods=m)
                if isinstance(cfg, config.FwdSm90WsConfig) and config.bias_only(m) and \
                        hd in config.FWD_SM90_WS_TILES_BIAS:
                    assert m in config.MODS_BIAS_CHECKED[causal] and cfg.cpp_name() in names, (hd, m, causal)
                    continue
                if isinstance(cfg, config.FwdSm90WsConfig) and config.bias_mask(m) and \
                        hd in config.FWD_SM90_WS_TILES_BIAS_MASK:
                    assert m in config.MODS_BIAS_MASK_CHECKED[causal] and cfg.cpp_name() in names, (hd, m, causal)
                    continue
                mask_table = config.mask_only(m) and isinstance(cfg, config.FwdSm90WsConfig)
                heavy = (config.MODS_MASK_CHECKED if mask_table else config.MODS_CHECKED)[causal][-1]
                checked = config.forward_kernel_config(hd, "bf16", causal, mods=heavy if config.heavy_mods(m) else m)
                assert (cfg.block_m, cfg.block_n) == (checked.block_m, checked.block_n)
                assert checked.cpp_name() in names or not config.heavy_mods(m)


def test_head_dim_128_ws_backward_modifier_sets_are_each_compile_checked():
    """Head dim 128's warp-specialized backward runs only the modifier sets listed in config.BWD_SM90_WS_MODS_128
    (spill-free there, with or without a window) and BWD_SM90_WS_MODS_128_ALONE (without one), and the compile check
    builds each of them exactly (they sit at the register limit, so no other set stands in for one); every other
    heavy set runs the mma.sync backward."""
    names = {c.cpp_name() for c in config.all_bwd_configs("sm_90a")}
    taken = set()
    for m in range(config.MODS_ALL + 1):
        for causal in (False, True):
            if causal and m & config.MOD_WINDOW:
                continue
            for det in (False, True):
                cfg = config.backward_kernel_config(128, "bf16", causal, det, "sm_90a", mods=m)
                heavy = m & ~config.MODS_LIGHT
                alone = m in config.BWD_SM90_WS_MODS_128_ALONE
                if isinstance(cfg, config.BwdSm90WsConfig):
                    assert not heavy or heavy in config.BWD_SM90_WS_MODS_128 or alone, m
                    if heavy:
                        assert cfg.cpp_name() in names, cfg.cpp_name()
                        taken.add(m)
                else:
                    assert heavy not in (0, *config.BWD_SM90_WS_MODS_128) and not alone, (m, cfg)
                    assert type(cfg) is config.BwdConfig, (m, cfg)
    light = (0, config.MOD_WINDOW)
    assert taken == {h | w for h in config.BWD_SM90_WS_MODS_128 for w in light} | set(config.BWD_SM90_WS_MODS_128_ALONE)
    # soft-capping parks its second P^T copy in shared memory: beside a window and ALiBi too; dropout beside ALiBi
    # or soft-capping keeps its copy in registers and runs mma.sync
    every = config.MOD_SOFTCAP | config.MOD_ALIBI | config.MOD_WINDOW
    cfg = config.backward_kernel_config(128, "bf16", False, False, "sm_90a", mods=every)
    assert isinstance(cfg, config.BwdSm90WsConfig) and cfg.mods == every, cfg
    for pair in (config.MOD_DROPOUT | config.MOD_ALIBI, config.MOD_DROPOUT | config.MOD_SOFTCAP):
        assert type(config.backward_kernel_config(128, "bf16", False, False, "sm_90a", mods=pair)) is config.BwdConfig


def test_block_map_bits_select_the_families_that_read_a_map():
    """MOD_BLOCKS (a BlockMask's tile map without its element mask) runs only on the families that read a map (the
    warp-specialized Hopper forward and backward), on tiles that take 128 x 128 blocks whole; elsewhere the library
    keeps MOD_MASK (select raises, _families.blocks_only catches it)."""
    blocks = config.MOD_BLOCKS
    for hd in config.FWD_SM90_WS_TILES_BLOCKS:
        for causal, m in ((False, blocks), (False, blocks | config.MOD_WINDOW), (True, blocks)):
            cfg = config.select("forward", hd, "bf16", causal, "sm_90a", mods=m, kernels="auto")
            assert isinstance(cfg, config.FwdSm90WsConfig) and cfg.mods == m, (hd, causal, m)
            assert 128 % cfg.block_n == 0 and 128 % cfg.block_m == 0, cfg
            assert cfg.smem_bytes == dataclasses.replace(cfg, mods=0).smem_bytes, "no mask staging"
    for hd in config.BWD_SM90_WS_HEAD_DIMS:
        cfg = config.select("backward", hd, "fp16", False, "sm_90a", mods=blocks, kernels="auto")
        assert isinstance(cfg, config.BwdSm90WsConfig) and cfg.mods == blocks
    for op, hd, arch, kernels in (("forward", 128, "sm_80", "auto"), ("forward", 128, "sm_90a", "mma"),
                                  ("backward", 256, "sm_90a", "auto"), ("backward", 128, "sm_86", "auto")):
        with pytest.raises(ValueError, match="no kernel family"):
            config.select(op, hd, "bf16", False, arch, mods=blocks, kernels=kernels)
    with pytest.raises(ValueError, match="MOD_BLOCKS"):
        config.check_mods(blocks | config.MOD_MASK, False)
    with pytest.raises(ValueError, match="MOD_BLOCKS"):
        config.check_mods(blocks | config.MOD_BIAS, False)
    assert not config.heavy_mods(blocks | config.MOD_WINDOW) and config.heavy_mods(config.MOD_MASK)


def test_a_fine_blockmask_takes_64_query_steps_in_the_backward(monkeypatch):
    """A BlockMask whose map is not whole tiles (its element mask read): the warp-specialized backward at head dims 32
    and 64 takes 64-query steps where their map visits fewer than 2 / STEPS_128_GAIN as many tiles as the 128-query
    steps' (a pattern finer than 128 queries), else the 128-query steps it chose; deterministic calls, other masks
    and other modifier sets keep the chosen steps."""
    from types import SimpleNamespace as NS

    from cuflash import _families

    class Blocks:
        def __init__(self, v64, v128):
            self.visited = {64: v64, 128: v128}

        def tiles_visited(self, block_m, block_n, seqlen_q, seqlen_k):
            assert (block_n, seqlen_q, seqlen_k) == (128, 1000, 1100)
            return self.visited[block_m]

    monkeypatch.setattr(_families._launch, "get_kernel", lambda cfg, device: ("kernel", cfg))

    def steps(blocks, bits=config.MOD_MASK, deterministic=False, d=64):
        a = NS(device=0, mods=NS(masks=(NS(blocks=blocks, scores=(2, 1, 1000, 1100)),)))
        main = config.bwd_sm90_ws_config(d, "bf16", False, deterministic, bits)
        got, kernel = _families._steps_for_the_map(a, main, ("kernel", main), bits, deterministic)
        assert kernel == ("kernel", got) and dataclasses.replace(got, block_m=main.block_m) == main
        return got.block_m

    fine, coarse = Blocks(10, 10), Blocks(20, 10)  # 10 x 1.35 < 2 x 10; 20 x 1.35 >= 2 x 10
    assert steps(fine) == 64 and steps(fine, d=32) == 64 and steps(fine, config.MOD_MASK | config.MOD_WINDOW) == 64
    assert steps(coarse) == 128
    assert steps(fine, deterministic=True) == 128
    assert steps(None) == 128  # an element mask or a key padding mask: no BlockMask
    assert steps(fine, config.MOD_MASK | config.MOD_ALIBI) == 64  # chosen as 64 already (ALiBi takes 64)
    assert steps(fine, d=128) == 64  # head dim 128 steps by 64 anyway
