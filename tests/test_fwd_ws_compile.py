"""The warp-specialized Hopper forward (cuda/fwd_sm90_ws.cuh) without a GPU: every instantiation (plain, and with
the score-modifier sets of config.MODS_CHECKED on their tiles, tests/ws_helpers.py) compiles through NVRTC for sm_90a
spill-free, with setmaxnreg honoured (no ptxas warning C7508) and wgmma kept asynchronous (no serialization
warning); its SASS holds the TMA loads and warpgroup MMAs, and the plain path (MODS = 0) the same key-loop work as
before the modifiers (HGMMA, MUFU.EX2, FMNMX counts); the params struct that Python fills (cuflash/_tma.py) has
the layout the C++ static_asserts; the host-side TMA argument checks accept and reject the strides they should,
and ws_params builds packed (varlen) maps."""
from __future__ import annotations

import itertools
import re
from types import SimpleNamespace

import pytest

from cuflash import _compile, _launch, _tma, config
from compile_helpers import nvrtc_or_skip, opcodes, sass_or_skip
from ws_helpers import ws_kernel

CONFIGS = [ws_kernel(d, dt, c, pingpong=pp)
           for d, dt, c, pp in itertools.product(config.FWD_SM90_WS_TILES, ("fp16", "bf16"), (False, True), (False, True))]
MOD_CONFIGS = [ws_kernel(d, dt, c, m, pingpong=pp)
               for d, dt, c, pp in itertools.product(config.FWD_SM90_WS_TILES, ("fp16", "bf16"), (False, True),
                                                     (False, True))
               for m in config.MODS_CHECKED[c]]
MOD_CONFIGS += [ws_kernel(d, dt, c, m, pingpong=False) for d in config.FWD_SM90_WS_TILES_MASK for dt in ("fp16", "bf16")
                for c in (False, True) for m in config.MODS_MASK_CHECKED[c]]
MOD_CONFIGS = list(dict.fromkeys(MOD_CONFIGS))  # d256 with heavy mods has no pingpong variant (tests/ws_helpers.py)
# the persistent kernels (tests/test_gpu_fwd_ws.py PERSISTENT) that stay spill-free: d128 with 192-key tiles (24-28
# bytes) and d256 causal (12 bytes) spill under the persistent loop and are not among the tables' choices (d256
# non-causal keeps 4 bytes on the stack under NVRTC 13.0, not a table choice either)
PERSISTENT_CONFIGS = [config.FwdSm90WsConfig(d, bn, st, dt, c, pp, persistent=True)
                      for d, bn, st, pp in ((64, 192, 2, False), (64, 128, 2, True), (64, 128, 2, False),
                                            (128, 128, 2, False), (128, 128, 2, True), (128, 128, 3, False),
                                            (256, 64, 2, False))
                      for dt in ("fp16", "bf16") for c in (False, True) if not (d == 256 and c)]
# ... and D 64 with three consumer warpgroups (192-row items)
PERSISTENT_CONFIGS += [config.FwdSm90WsConfig(64, 128, st, dt, c, False, persistent=True, block_m=192)
                       for st in (2, 3) for dt in ("fp16", "bf16") for c in (False, True)]


def _name(c: config.FwdSm90WsConfig):
    return (f"d{c.head_dim}-bn{c.block_n}-s{c.stages}-{c.dtype}-{'causal' if c.causal else 'full'}-"
            f"{'pingpong' if c.pingpong else 'plain'}-mods{c.mods}{'-persistent' if c.persistent else ''}"
            f"{'' if c.block_m == 128 else f'-m{c.block_m}'}")


@pytest.mark.parametrize("cfg", CONFIGS + MOD_CONFIGS + PERSISTENT_CONFIGS, ids=_name)
def test_every_instantiation_compiles_spill_free(cfg):
    nvrtc_or_skip()
    compiled = _compile.compile_kernel(cfg.cpp_name(), "sm_90a")
    res = compiled.resources
    spills = (res["spill_stores"], res["spill_loads"], res["stack"])
    assert spills == (0, 0, 0), f"{cfg} spills (stores, loads, stack) = {spills}\n{compiled.log}"
    # 384 threads at 1 CTA per SM: ptxas allots 168 at launch; setmaxnreg moves them to the consumers
    assert res["registers"] is not None and res["registers"] <= 168, f"{cfg}: {res}"
    assert "C7508" not in compiled.log, f"{cfg}: ptxas ignored setmaxnreg\n{compiled.log}"
    assert "serialized" not in compiled.log, f"{cfg}: ptxas serialized the wgmma\n{compiled.log}"
    assert res["static_smem"] + cfg.smem_bytes <= 227 * 1024


@pytest.mark.parametrize("cfg", [c for c in CONFIGS + MOD_CONFIGS + PERSISTENT_CONFIGS if c.dtype == "bf16" and not c.causal],
                         ids=_name)
def test_sass_has_tma_loads_and_async_wgmma(cfg):
    nvrtc_or_skip()
    text = sass_or_skip(_compile.compile_kernel(cfg.cpp_name(), "sm_90a").cubin)
    ops = opcodes(text)
    count = lambda prefix: sum(1 for o in ops if o.startswith(prefix))  # noqa: E731
    panels = cfg.head_dim // cfg.box_cols  # 64-column panels, 32-column ones at head dims 32 and 96
    assert count("UTMALDG") == 3 * panels, f"{cfg}: {count('UTMALDG')} TMA loads, want Q, K, V x {panels} panels"
    assert count("HGMMA") > 0 and count("USETMAXREG") == 2, f"{cfg}: HGMMA {count('HGMMA')}, USETMAXREG {count('USETMAXREG')}"
    assert count("LDL") == 0 and count("STL") == 0, f"{cfg} touches local memory"
    # the P V GEMM stays in flight during the softmax: a wait that leaves one group pending
    assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", text), f"{cfg}: no wgmma.wait_group 1 in the SASS"


# The plain path's per-kernel work as measured before the score modifiers and varlen came in (NVRTC 13.5, key tiles
# of 128 rows at d64/d128, 64 at d256): the
# modifiers are compile-time (MODS = 0 compiles none of them) and varlen only adds a few instructions before the key
# loop, so the GEMMs, exponentials and row maxima must stay exactly these.
PLAIN_SASS = {64: {"HGMMA": 24, "MUFU.EX2": 132, "FMNMX": 140}, 128: {"HGMMA": 32, "MUFU.EX2": 132, "FMNMX": 140},
              256: {"HGMMA": 40, "MUFU.EX2": 68, "FMNMX": 76}}


@pytest.mark.parametrize("cfg", [config.FwdSm90WsConfig(d, 64 if d == 256 else 128, 2, "bf16", False, pp, persistent=pers)
                                 for d in PLAIN_SASS for pp in (False, True) for pers in (False, True)], ids=_name)
def test_plain_path_keeps_its_work(cfg):
    nvrtc_or_skip()
    ops = opcodes(sass_or_skip(_compile.compile_kernel(cfg.cpp_name(), "sm_90a").cubin))
    got = {prefix: sum(1 for o in ops if o.startswith(prefix)) for prefix in PLAIN_SASS[cfg.head_dim]}
    assert got == PLAIN_SASS[cfg.head_dim], f"{cfg}: {got}, before the modifiers {PLAIN_SASS[cfg.head_dim]}"
    # named barriers: __syncthreads and the epilogue's (+ the pingpong token's; + the persistent O buffer's reuse)
    want = (9 if cfg.pingpong else 2) + (1 if cfg.o_separate else 0)
    assert sum(1 for o in ops if o.startswith("BAR")) == want, f"{cfg}"


def test_params_layout_matches_the_kernel():
    # cuda/fwd_sm90_ws.cuh static_asserts the same numbers (offsets 0, 128, 256, 384; 960 bytes)
    import ctypes

    assert ctypes.sizeof(_tma.FwdWsParams) == 960
    assert [getattr(_tma.FwdWsParams, f).offset for f in ("tma_q", "tma_k", "tma_v", "fwd", "m_blocks", "items",
                                                          "queue")] == [0, 128, 256, 384, 904, 908, 912]
    assert _tma.FwdWsParams.fwd.size == ctypes.sizeof(_launch.FwdParams) == 520
    src = (_compile.cuda_dir() / "fwd_sm90_ws.cuh").read_text()
    assert "sizeof(FwdWsParams) == 960" in src and "alignof(FwdParams) == 8 && sizeof(FwdParams) == 520" in src


def test_config_names_and_shared_memory():
    cfg = config.FwdSm90WsConfig(128, 128, 2, "bf16", True, pingpong=True)
    # the kernel takes MODS as its third template argument (no default)
    assert cfg.cpp_name() == ("cuflash::fwd_sm90_ws_kernel<cuflash::FwdSm90WsTraits<128, 128, 2, true, cuflash::bf16>, "
                              "true, 0>")
    assert ws_kernel(128, "bf16", False, config.MODS_ALL).cpp_name() == (
        "cuflash::fwd_sm90_ws_kernel<cuflash::FwdSm90WsTraits<128, 96, 3, false, cuflash::bf16>, false, 63>")
    assert cfg.threads == 384 and cfg.grid(2, 3, 257) == (3, 3, 2)
    # Q 32 KB + 2 stages x (K + V) 32 KB each + 9 mbarriers + 1 KB alignment slack
    assert cfg.smem_bytes == 32768 + 4 * 32768 + 72 + 1024
    # with a bias and a mask: + each consumer warp's 16 staged rows (pitches 2 * 96 + 16 and 96 + 16 bytes), after
    # the 13 mbarriers rounded up to 16 bytes (FwdSm90WsTraits::smem_bytes)
    heavy = ws_kernel(128, "bf16", False, config.MODS_ALL)
    assert heavy.smem_bytes == (32768 + 6 * 96 * 256 + 104 + 8) + 8 * 16 * (208 + 112) + 1024 == 222320
    # persistent: O gets a buffer of its own where it fits (a work grid of items, a launch grid of at most the SMs)
    pers = config.FwdSm90WsConfig(128, 128, 2, "bf16", False, False, persistent=True)
    # (15 8-byte words: q_full, q_empty, 4 x 2 stages of K/V barriers, the work item ring's 4 barriers and slots)
    assert pers.o_separate and pers.barriers == 15 and pers.smem_bytes == 32768 + 4 * 32768 + 32768 + 120 + 1024
    assert pers.cpp_name() == ("cuflash::fwd_sm90_ws_kernel<cuflash::FwdSm90WsTraits<128, 128, 2, false, cuflash::bf16, "
                               "true>, false, 0>")
    assert pers.schedule(2, 3, 257, 132) == ((18, 1, 1), 3, 18)
    assert pers.schedule(16, 16, 1024, 132) == ((132, 1, 1), 8, 2048)
    assert cfg.schedule(16, 16, 1024, 132) == ((8, 16, 16), 8, 2048) and cfg.grid(16, 16, 1024) == (8, 16, 16)
    big = config.FwdSm90WsConfig(128, 192, 2, "bf16", False, False, persistent=True)  # 256 KB with its own O
    assert not big.o_separate and big.smem_bytes == 32768 + 4 * 49152 + 120 + 1024
    # the work queue for items of unequal cost: causal or windowed rows, packed sequences (persistent kernels only)
    assert not pers.uses_queue(False) and pers.uses_queue(True) and not cfg.uses_queue(True)
    assert config.FwdSm90WsConfig(128, 128, 2, "bf16", True, False, persistent=True).uses_queue(False)
    assert config.FwdSm90WsConfig(128, 128, 2, "bf16", False, False, config.MOD_WINDOW, True).uses_queue(False)
    # causal rows at D 192 up to FWD_SM90_WS_CAUSAL_SHORT_KEYS keys on the persistent grid, longer ones and the
    # non-causal rows on the one-item grid
    short, long = (config.fwd_sm90_ws_config(192, "bf16", True, seqlen_k=n) for n in (2048, 2049))
    assert short.persistent and short.uses_queue(False) and not long.persistent and short.block_n == long.block_n == 96
    assert not config.fwd_sm90_ws_config(192, "bf16", False, seqlen_k=1024).persistent
    assert not config.fwd_sm90_ws_config(192, "bf16", False, config.MOD_WINDOW, seqlen_k=1024).persistent
    # D 256: 80-key tiles for plain calls, but 64 for causal rows of up to 1k keys, windows and block maps (a
    # BlockMask's 128 x 128 blocks cover whole 64-key tiles)
    for n in (512, 1024, 1025, 16384):
        assert config.fwd_sm90_ws_config(256, "bf16", False, seqlen_k=n).block_n == 80, n
        assert config.fwd_sm90_ws_config(256, "bf16", True, seqlen_k=n).block_n == (64 if n <= 1024 else 80), n
        assert config.fwd_sm90_ws_config(256, "bf16", False, config.MOD_WINDOW, seqlen_k=n).block_n == 64, n
        for causal in (False, True):
            assert config.fwd_sm90_ws_config(256, "bf16", causal, config.MOD_BLOCKS, seqlen_k=n).block_n == 64, n
    d256 = config.fwd_sm90_ws_config(256, "fp16", False)
    assert (d256.stages, d256.persistent, d256.smem_bytes <= 227 * 1024) == (2, False, True)
    d192 = config.FwdSm90WsConfig(192, 64, 3, "bf16", False, False)  # three 64-column panels
    assert d192.box_cols == 64 and d192.smem_bytes == 128 * 192 * 2 + 2 * 3 * 64 * 192 * 2 + 8 * 13 + 1024
    # D 64's long rows: three consumer warpgroups of 64 rows (block_m 192, 512 threads), 128-key tiles; short
    # non-causal rows as well, on the persistent grid; causal rows up to FWD_SM90_WS_CAUSAL_LONG_KEYS keys on the
    # persistent two-consumer kernel
    three = config.fwd_sm90_ws_config(64, "bf16", False, seqlen_k=2049)
    assert (three.block_m, three.block_n, three.stages, three.threads, three.pingpong, three.persistent) == \
        (192, 128, 2, 512, False, False)
    assert three.smem_bytes == 192 * 64 * 2 + 2 * 2 * 128 * 64 * 2 + 8 * 9 + 1024
    assert three.grid(2, 3, 1000) == (6, 3, 2) and three.schedule(2, 3, 1000, 132) == ((6, 3, 2), 6, 36)
    assert three.cpp_name() == ("cuflash::fwd_sm90_ws_kernel<cuflash::FwdSm90WsTraits<64, 128, 2, false, cuflash::bf16, "
                                "false, 192>, false, 0>")
    # short non-causal rows: three consumers on the persistent grid (items in a fixed stride)
    short = config.fwd_sm90_ws_config(64, "bf16", False, seqlen_k=2048)
    assert (short.block_m, short.persistent, short.threads, short.uses_queue(False), short.o_separate) == \
        (192, True, 512, False, True)
    assert short.smem_bytes == 2 * 192 * 64 * 2 + 2 * 2 * 128 * 64 * 2 + 8 * 15 + 1024
    assert short.cpp_name() == ("cuflash::fwd_sm90_ws_kernel<cuflash::FwdSm90WsTraits<64, 128, 2, false, cuflash::bf16, "
                                "true, 192>, false, 0>")
    assert config.fwd_sm90_ws_config(64, "bf16", False, seqlen_k=2048, persistent=False).block_m == 128
    assert config.fwd_sm90_ws_config(64, "bf16", True, seqlen_k=4096).block_m == 128
    assert config.fwd_sm90_ws_config(64, "bf16", True, seqlen_k=4097).block_m == 192
    for mods in (config.MOD_WINDOW, config.MOD_ALIBI, config.MOD_BIAS):  # the modifiers keep two consumers
        assert config.fwd_sm90_ws_config(64, "bf16", False, mods, seqlen_k=16384).block_m == 128, mods
    # pingpong (or a persistent grid) asked for: the two-consumer kernel of the same key tiles
    pp = config.fwd_sm90_ws_config(64, "bf16", False, pingpong=True)
    assert (pp.block_m, pp.block_n, pp.pingpong) == (128, 128, True)
    with pytest.raises(ValueError, match="block_m=192"):
        config.FwdSm90WsConfig(128, 128, 2, "bf16", False, False, block_m=192)
    with pytest.raises(ValueError, match="block_m=192"):
        config.FwdSm90WsConfig(64, 128, 2, "bf16", False, True, block_m=192)
    with pytest.raises(ValueError, match="block_m=256"):
        config.FwdSm90WsConfig(64, 128, 2, "bf16", False, False, block_m=256)
    with pytest.raises(ValueError, match="head_dim=160"):
        config.FwdSm90WsConfig(160, 64, 2, "bf16", False)
    with pytest.raises(ValueError, match="head_dim=48"):
        config.FwdSm90WsConfig(48, 128, 2, "bf16", False)


def _dims(b, s, h, d, bs, rs, hs):
    return SimpleNamespace(batch=b, seqlen=s, heads=h, head_dim=d, batch_stride=bs, row_stride=rs, head_stride=hs)


def test_tma_argument_rules():
    b, s, h, d = 2, 100, 3, 128
    bshd = _dims(b, s, h, d, s * h * d, h * d, d)
    bhsd = _dims(b, s, h, d, h * s * d, d, s * d)
    assert _tma.tma_unsupported(0x10000, bshd, "bf16") is None
    assert _tma.tma_unsupported(0x10000, bhsd, "fp16") is None
    # head stride d + 4 elements = 264 bytes: not a multiple of 16
    assert "strides" in _tma.tma_unsupported(0x10000, _dims(b, s, h, d, s * h * (d + 4), h * (d + 4), d + 4), "bf16")
    assert "aligned" in _tma.tma_unsupported(0x10008, bshd, "bf16")
    # a size-1 dim with stride 0 (CuPy broadcast) is harmless
    assert _tma.tma_unsupported(0x10000, _dims(1, s, h, d, 0, h * d, d), "bf16") is None
    with pytest.raises(ValueError, match="128-byte swizzle"):
        _tma.encode_tiled("bf16", 0x10000, (128, 100), (256,), (128, 64))


def test_ws_params_packed_rules():
    """ws_params takes packed calls (cu_seqlens_q and _k, arrays as batch 1) and rejects a kv cache, a half-packed
    SeqParams and packed dims with batch > 1, before it encodes any map (no driver needed)."""
    cfg = ws_kernel(128, "bf16", True)
    packed = _dims(1, 1000, 4, 128, 0, 4 * 128, 128)
    cases = [(_launch.seq_params(300, 300, 1, 0x1000, 0x2000, seqused_k=0x3000), packed, "kv cache"),
             (_launch.seq_params(300, 300, 1, 0x1000, None), packed, "together"),
             (_launch.seq_params(300, 300, 1, 0x1000, 0x2000), _dims(2, 1000, 4, 128, 0, 4 * 128, 128), "batch=1")]
    for seq, dims, message in cases:
        fwd = _launch.FwdParams(seq=seq, heads=4, head_dim=128)
        with pytest.raises(ValueError, match=message):
            _tma.ws_params(fwd, 0x10000, 0x20000, 0x30000, dims, dims, dims, "bf16", cfg)
    # a packed operand's map: (head_dim, total, heads, 1), the unit batch dim given a valid stride
    assert _tma.operand_map(0x10000, packed, "bf16", 128) == (0x10000, (128, 1000, 4, 1), (1024, 256, 16),
                                                               (64, 128, 1, 1))


@pytest.mark.parametrize("d,cols,swizzle", [(32, 32, 64), (64, 64, 128), (96, 32, 64), (128, 64, 128), (256, 64, 128)])
def test_ws_params_boxes_are_one_panel_wide(monkeypatch, d, cols, swizzle):
    """ws_params encodes each operand's box one shared-memory panel wide with that panel's swizzle: 64 columns
    (128-byte swizzle), or 32 (64-byte) at head dims 32 and 96, the kernel's FwdSm90WsTraits::BOX_COLS. (A box of 64
    columns at D 32 lands twice the bytes each stage's barrier expects, past the tile.)"""
    calls = []
    monkeypatch.setattr(_tma, "encode_tiled", lambda dtype, address, dims, strides, box, swizzle=128:
                        calls.append((box, swizzle)) or bytes(_tma.TENSOR_MAP_BYTES))
    cfg = config.fwd_sm90_ws_config(d, "bf16", False)
    assert cfg.box_cols == cols
    dims = _dims(2, 300, 4, d, 300 * 4 * d, 4 * d, d)
    fwd = _launch.FwdParams(seq=_launch.seq_params(300, 300, 1), heads=4, head_dim=d)
    _tma.ws_params(fwd, 0x10000, 0x20000, 0x30000, dims, dims, dims, "bf16", cfg)
    assert calls == [((cols, cfg.block_m, 1, 1), swizzle), ((cols, cfg.block_n, 1, 1), swizzle),
                     ((cols, cfg.block_n, 1, 1), swizzle)]
