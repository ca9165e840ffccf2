"""Kernel configurations: the one place where tile sizes, warps and shared-memory layouts are chosen.

The CUDA traits (cuda/traits.cuh) derive every constant from the template arguments rendered here,
and the IO analyzer (cuflash.simulator) reads the same dataclasses, so the counts it reports are
the counts of the kernels we ship.

Shared-memory layout of a [rows, HEAD_DIM] tile (Q, K, V, O staging), see cuda/tiles.cuh:
  * the head dimension is cut into column panels of PANEL_COLS elements (64 = 128 bytes when
    HEAD_DIM % 64 == 0, else 32 = 64 bytes); panel p holds columns [p*PANEL_COLS, (p+1)*PANEL_COLS)
    of every row, panels are stored one after another: offset = p * rows * PANEL_BYTES + row * PANEL_BYTES + ...
  * inside a panel the 16-byte chunk index is XOR-swizzled with the 128-byte line index
    (bits 4..6 of the byte offset ^= bits 7..9, masked to the panel width), so 8 rows read at the
    same column by ldmatrix, and 8 lanes writing one 128-byte line with cp.async, hit 8 distinct
    16-byte bank groups.
"""
from __future__ import annotations

from dataclasses import dataclass
import itertools
import math
import os

DTYPES = ("fp16", "bf16")
# Score modifiers (cuda/mods.cuh): bits of the kernels' MODS template argument. The plain path is MODS = 0.
MOD_WINDOW, MOD_ALIBI, MOD_SOFTCAP, MOD_DROPOUT, MOD_BIAS, MOD_MASK = 1, 2, 4, 8, 16, 32
MODS_ALL = MOD_WINDOW | MOD_ALIBI | MOD_SOFTCAP | MOD_DROPOUT | MOD_BIAS | MOD_MASK
# A BlockMask whose tiles, at a kernel's tile shape, are all empty or full (a block-sparse pattern aligned to the
# tiles) needs no element mask: MOD_BLOCKS instead of MOD_MASK gives the plain mainloop that skips the empty tiles
# (the host decides per call, _families.blocks_only; the warp-specialized sm_90a kernels take it). On an H100 the
# mask kernels' full-tile path ran 1.76x slower than the plain kernel (bf16, D 128, N 16k, every tile full; since
# 08bcfa7 it skips the mask's per-score work, 1.16x on an H200, and ~1.45x at D 64, whose plain forward takes three
# consumer warpgroups).
MOD_BLOCKS = 64
# Modifiers that the plain / causal tiles hold: the window (a band, like causal) and a block map alone. A boolean
# mask reads a byte per score and keeps its address state: on the plain tiles it spilled 4-224 bytes (NVRTC 13.5),
# so it is heavy.
MODS_LIGHT = MOD_WINDOW | MOD_BLOCKS
# The modifier sets the compile check builds for every kernel (beside MODS = 0): the window alone on the plain /
# causal tiles, and all of them (all but the window for causal kernels: a window carries causal itself, as
# right = 0) on the heavy tiles. Each adds state and instructions to the same spots of a mainloop, so these are
# the register-heaviest instantiations of each tile table.
MODS_CHECKED = {False: (MOD_WINDOW, MODS_ALL), True: (MODS_ALL & ~MOD_WINDOW,)}


def heavy_mods(mods: int) -> bool:
    """Modifiers with per-element state or work beyond a band (ALiBi, softcap, dropout, bias, mask): their
    kernels take the *_MODS tile tables, whose smaller key tiles leave registers for it (a window alone masks
    like causal and takes the causal tiles)."""
    return bool(mods & ~MODS_LIGHT)


def check_mods(mods: int, causal: bool) -> int:
    if not 0 <= mods <= MODS_ALL | MOD_BLOCKS:
        raise ValueError(f"mods={mods} must be a combination of the MOD_* bits (0..{MODS_ALL | MOD_BLOCKS})")
    if mods & MOD_BLOCKS and mods & ~(MOD_BLOCKS | MOD_WINDOW):
        raise ValueError(f"mods={mods}: MOD_BLOCKS (a BlockMask's tile map alone) takes at most a window beside it")
    if causal and mods & MOD_WINDOW:
        raise ValueError("a window kernel carries causal as window right = 0: instantiate it with causal=False")
    return mods
KERNEL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = KERNEL_HEAD_DIMS[-1]
MMA_M, MMA_N, MMA_K = 16, 8, 16
ELEM_BYTES = 2
CHUNK_ELEMS = 8  # one 16-byte cp.async / ldmatrix row


def _cpp_type(dtype: str) -> str:
    """The C++ element type of a 16-bit dtype's kernel instantiations (cpp_name)."""
    return "cuflash::f16" if dtype == "fp16" else "cuflash::bf16"


def _cpp_bool(x) -> str:
    """A C++ bool template argument (cpp_name)."""
    return "true" if x else "false"


def kernel_head_dim(head_dim: int, dtype: str = "fp16") -> int:
    """The smallest compiled HEAD_DIM that holds `head_dim` (a multiple of 8, at most 256) for `dtype`'s kernels."""
    dims = WIDE_KERNEL_HEAD_DIMS.get(dtype, KERNEL_HEAD_DIMS)
    for hd in dims:
        if head_dim <= hd:
            return hd
    raise ValueError(f"head_dim={head_dim} is larger than the largest kernel head dim {dims[-1]} for {dtype}")


def panel_cols(head_dim: int) -> int:
    return 64 if head_dim % 64 == 0 else 32


def swizzled_offset(row: int, col: int, rows: int, head_dim: int) -> int:
    """Byte offset of element (row, col) inside a swizzled [rows, head_dim] shared tile.

    Mirrors `smem_offset` in cuda/tiles.cuh; col must be a multiple of 8 for chunk starts but any
    column works (the swizzle moves whole 16-byte chunks and keeps the byte inside a chunk)."""
    pc = panel_cols(head_dim)
    panel_bytes = pc * ELEM_BYTES
    panel, c = divmod(col, pc)
    off = row * panel_bytes + c * ELEM_BYTES
    line_mask = 7 if panel_bytes == 128 else 3
    off ^= ((off >> 7) & line_mask) << 4
    return panel * rows * panel_bytes + off


@dataclass(frozen=True)
class FwdConfig:
    """One forward-kernel instantiation: `fwd_kernel<FwdTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, T>,
    IS_CAUSAL, IS_DECODE>` (IS_DECODE: the kv-cache variant, see cuda/fwd.cuh)."""

    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    dtype: str
    causal: bool
    stages: int = 2  # K/V shared-memory buffers (double buffering)
    decode: bool = False
    mods: int = 0  # score modifiers (MOD_* bits)

    def __post_init__(self):
        check_mods(self.mods, self.causal)
        if self.decode and self.mods & ~MODS_DECODE:
            raise ValueError(f"mods={self.mods}: the kv-cache forward takes the window, ALiBi and the softcap only")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: {DTYPES}")
        if self.head_dim % MMA_K or self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim={self.head_dim} must be a multiple of 16 up to {MAX_HEAD_DIM}")
        if self.block_m % (MMA_M * self.num_warps):
            raise ValueError(f"block_m={self.block_m} must be a multiple of 16*num_warps={16 * self.num_warps}")
        if self.block_n % 16:
            raise ValueError(f"block_n={self.block_n} must be a multiple of 16")

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def m_tiles_per_warp(self) -> int:
        return self.block_m // (MMA_M * self.num_warps)

    @property
    def smem_q_bytes(self) -> int:
        return self.block_m * self.head_dim * ELEM_BYTES

    @property
    def smem_kv_bytes(self) -> int:
        return self.block_n * self.head_dim * ELEM_BYTES

    @property
    def smem_bytes(self) -> int:
        # Q tile (reused to stage O), then `stages` K tiles, then `stages` V tiles.
        return self.smem_q_bytes + 2 * self.stages * self.smem_kv_bytes

    def cpp_name(self) -> str:
        t = _cpp_type(self.dtype)
        b = _cpp_bool
        return (f"cuflash::fwd_kernel<cuflash::FwdTraits<{self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.num_warps}, {self.stages}, {t}>, {b(self.causal)}, {b(self.decode)}, {self.mods}>")

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.block_m), heads, batch)


# Forward tiles per kernel head dim: (block_m, block_n, num_warps). First choice, before tuning:
# one m16 row tile per warp keeps the O and S accumulators at <= 96 + 32 fp32 registers per thread
# (no spills at any head dim); see docs/PERFORMANCE.md for the measurements behind each row.
FWD_TILES = {
    32: (128, 64, 4),
    64: (128, 64, 4),    # H100 bf16 N=16k: 333 TFLOP/s vs 273 for (128, 128, 8), 294 for (64, 64, 4)
    96: (128, 64, 8),
    128: (128, 32, 4),   # 342 vs 318 for (128, 128, 8), 293 for (128, 64, 8); 255 registers, no spill
    192: (128, 64, 8),
    256: (64, 32, 4),    # (64, 64, 4) spilled 28-32 bytes: O alone is 128 fp32 registers per thread
}
# Causal kernels carry the masked steps too; where that tips the non-causal choice into spilling:
FWD_TILES_CAUSAL = {
    128: (128, 128, 8),  # (128, 32, 4) spills 56 bytes when causal; 318 TFLOP/s causal N=16k
}
# With ALiBi / softcap / dropout (heavy_mods): smaller key tiles, so the per-element work fits in
# registers (the plain tiles spilled 8-200 bytes with every modifier on; compiled with ptxas -v).
FWD_TILES_MODS = {
    32: (128, 32, 8),   # (128, 32, 4): 4-byte stack frame
    64: (128, 32, 4),   # 245 registers; (128, 32, 8) spilled 16 bytes
    96: (128, 32, 8),
    128: (128, 64, 8),  # 180 registers
    192: (128, 32, 8),
    256: (64, 16, 4),
}
# Before sm_90 ptxas allocates differently: (128, 32, 4) spills 8 bytes at d128 on sm_80.
FWD_TILES_PRE_SM90 = {
    128: (128, 128, 8),
}
DEFAULT_ARCH = "sm_90a"  # the H100/H200 this project targets; analyzer and docs use its configs


def fwd_config(head_dim: int, dtype: str, causal: bool, arch: str = DEFAULT_ARCH, mods: int = 0) -> FwdConfig:
    """The forward config the library launches for a (kernel) head dim, dtype, causal flag, arch and score
    modifiers (a window masks tiles like causal does, so it takes the causal tiles)."""
    tiles = FWD_TILES[head_dim]
    if heavy_mods(mods):
        tiles = FWD_TILES_MODS[head_dim]
    elif causal or mods:
        tiles = FWD_TILES_CAUSAL.get(head_dim, tiles)
    if not arch.startswith("sm_9") and not heavy_mods(mods):
        tiles = FWD_TILES_PRE_SM90.get(head_dim, tiles)
    bm, bn, warps = tiles
    return FwdConfig(head_dim, bm, bn, warps, dtype, causal, mods=mods)


# attention_with_kvcache runs the mma.sync forward with IS_DECODE on every architecture: decoding reads
# K/V once per key tile and does little arithmetic (a few query rows), so the wgmma kernel would not pay.
# (block_m, block_n, num_warps) per kernel head dim, one m16 row tile per warp. A paged cache's page size
# must be a multiple of DECODE_PAGE_MULTIPLE (one 16-row step of the K/V tile): tiles read whole from one page
# when the page size and the sequence's first row are multiples of block_n, else row by row.
# At head dims 32 and 96 the key tiles are wider than the K/V bytes alone would ask (at 32, 256 keys spilled 72-144
# bytes beside the modifiers; 128 keys make pages of 64 rows a gathered read there): on an H200 (2026-12-03, bf16,
# 32 / 8 heads, two CTAs per SM, _families.DECODE_MAX_CTAS_PER_SM) 128-key tiles at 32 took 0.79-0.91x the time
# of 64-key ones (B 1 32k, B 8 8k and 32k, B 64 1k-32k; 9.6 against 9.4 us at B 1 1k), 64-key tiles at 96
# 0.97-0.99x that of 32-key ones. At 64, 128-key tiles took 1.00-1.02x the time of 64-key ones in three stages.
DECODE_TILES = {
    32: (64, 128, 4),
    64: (64, 64, 4),
    96: (64, 64, 4),
    128: (64, 64, 4),
    192: (64, 32, 4),  # block_n 64: 252-254 registers, at the limit
    256: (64, 32, 4),  # block_n 64 spilled 104 bytes: O alone is 128 fp32 registers per thread
}
# K/V shared-memory stages of the decode kernel: STAGES - 1 tiles are in flight while one is used. Measured on
# the H100 (tools/tune_decode.py, bf16 D 128, 32/8 heads, one CTA per SM): double buffering is fastest at every
# batch and cache length; 3, 4 and 6 stages were 1-4% slower (B=1 32k: 59.2 us with 2 stages, 60.1-60.6 with
# more; B=1 128k: 186.0 vs 191.0-196.2; B=8 128k: 1384 vs 1421-1429), so one 32 KB K/V tile in flight per SM
# while another is used is not what limits a decode launch there. On an H200 (2026-11-29) 3 and 4 stages at one
# CTA per SM were no faster either (B=1 32k 45.6 / 46.8 us against 44.9), but two CTAs per SM were (41.8 us: the
# split factor's CTAs per SM, _families.decode_ctas_per_sm). At head dim 64, whose K and V stages are 8 KB each and
# whose arithmetic per tile is short, three stages were faster on an H200 (2026-12-03, two CTAs per SM, B 1 32k /
# B 8 8k / B 64 1k keys, against two stages in the same process): 0.98-1.00x the time on dense caches, 0.97-1.00x
# on 64-row pages; four were no faster. With the 64-key tiles at 32 and 32-key tiles at 96 three stages read
# 0.95-0.97x, but the larger tiles above in two stages were faster still (with three: 0.99-1.21x their time at
# 32, 1.02-1.05x at 96). At 128 three stages read 1.01-1.02x, at 256 1.22-1.55x (an earlier build).
DECODE_STAGES = {32: 2, 64: 3, 96: 2, 128: 2, 192: 2, 256: 2}  # per kernel head dim
DECODE_PAGE_MULTIPLE = 16
# The score modifiers of decoding (attention_with_kvcache): the window, ALiBi and the softcap. The compile check
# builds all of them together (a window carries causal itself, so causal kernels take ALiBi and the softcap).
MODS_DECODE = MOD_WINDOW | MOD_ALIBI | MOD_SOFTCAP
MODS_DECODE_CHECKED = {False: (MODS_DECODE,), True: (MODS_DECODE & ~MOD_WINDOW,)}


def decode_stages(head_dim: int) -> int:
    """K/V shared-memory stages of the decode kernel at a kernel head dim."""
    return DECODE_STAGES[head_dim]


def fwd_decode_config(head_dim: int, dtype: str, causal: bool, mods: int = 0) -> FwdConfig:
    bm, bn, warps = DECODE_TILES[head_dim]
    return FwdConfig(head_dim, bm, bn, warps, dtype, causal, stages=decode_stages(head_dim), decode=True, mods=mods)


@dataclass(frozen=True)
class CombineConfig:
    """Split-KV merge of the decode kernel's partial results: `fwd_combine_kernel<T>` (cuda/fwd.cuh)."""

    dtype: str
    threads: int = 256
    smem_bytes: int = 0
    rows_per_cta: int = 8  # COMBINE_ROWS in fwd.cuh: one warp per (head, position)

    def cpp_name(self) -> str:
        return f"cuflash::fwd_combine_kernel<{'cuflash::f16' if self.dtype == 'fp16' else 'cuflash::bf16'}>"


@dataclass(frozen=True)
class AppendConfig:
    """The kv cache's append of new keys and values (rotated by the rotary embedding when asked, with a rotated
    copy of q): `kvcache_append_kernel<T>` (cuda/kvcache.cuh), one thread per 16-byte chunk."""

    dtype: str = "fp16"
    threads: int = 128  # APPEND_THREADS
    smem_bytes: int = 0

    def cpp_name(self) -> str:
        return f"cuflash::kvcache_append_kernel<{'cuflash::f16' if self.dtype == 'fp16' else 'cuflash::bf16'}>"


@dataclass(frozen=True)
class DropoutMaskConfig:
    """The dropout mask as the kernels draw it, for tests (`return_dropout_mask`): `dropout_mask_kernel`
    (cuda/mods.cuh), one thread per 2x2 group of (query, key) elements."""

    threads: int = 256
    smem_bytes: int = 0

    def cpp_name(self) -> str:
        return f"cuflash::dropout_mask_kernel<{self.threads}>"


@dataclass(frozen=True)
class PaddingTilesConfig:
    """The tile map of a key_padding_mask alone: `padding_tiles_kernel` (cuda/mods.cuh), one thread per (sequence,
    key tile); cuflash._families._PaddingMap launches it per call."""

    threads: int = 128
    smem_bytes: int = 0

    def cpp_name(self) -> str:
        return f"cuflash::padding_tiles_kernel<{self.threads}>"


def all_fwd_configs(arch: str = DEFAULT_ARCH) -> list:
    """Every forward instantiation the library can launch on `arch`: the mma.sync kernels (launched on
    sm_80..sm_89, and on sm_90a with CUFLASH_KERNELS=mma), the decode kernels and their combine kernel,
    and, for sm_90a, the wgmma kernels (synchronous and warp-specialized)."""
    out: list = [fwd_config(hd, dt, c, arch, m) for hd in KERNEL_HEAD_DIMS for dt in DTYPES for c in (False, True)
                 for m in (0, *MODS_CHECKED[c])]
    out += [fwd_decode_config(hd, dt, c, m) for hd in KERNEL_HEAD_DIMS for dt in DTYPES for c in (False, True)
            for m in (0, *MODS_DECODE_CHECKED[c])]
    out += [CombineConfig(dt) for dt in DTYPES] + [AppendConfig(dt) for dt in DTYPES] + [DropoutMaskConfig(),
                                                                                         PaddingTilesConfig()]
    if arch == "sm_90a":
        out += [fwd_sm90_config(hd, dt, c, m) for hd in FWD_SM90_TILES
                if hd not in FWD_SM90_WS_TILES
                for dt in DTYPES for c in (False, True) for m in (0, *MODS_CHECKED[c])]
        out += [fwd_sm90_ws_config(hd, dt, c, m) for hd in FWD_SM90_WS_TILES for dt in DTYPES for c in (False, True)
                for m in (0, *MODS_CHECKED[c])]
        out += [fwd_sm90_ws_config(hd, dt, False, seqlen_k=1) for hd in FWD_SM90_WS_TILES_SHORT for dt in DTYPES]
        out += [fwd_sm90_ws_config(hd, dt, True, seqlen_k=1) for hd in FWD_SM90_WS_TILES_CAUSAL_SHORT for dt in DTYPES]
        out += [fwd_sm90_ws_config(hd, dt, True, seqlen_k=1 << 30) for hd in FWD_SM90_WS_TILES_CAUSAL_LONG
                for dt in DTYPES]
        out += [fwd_sm90_ws_config(hd, dt, c, m) for hd in FWD_SM90_WS_TILES_MASK for dt in DTYPES for c in (False, True)
                for m in MODS_MASK_CHECKED[c]]
        out += [fwd_sm90_ws_config(hd, dt, c, m) for hd in FWD_SM90_WS_TILES_BIAS for dt in DTYPES for c in (False, True)
                for m in MODS_BIAS_CHECKED[c]]
        out += [fwd_sm90_ws_config(hd, dt, c, m) for hd in FWD_SM90_WS_TILES_BIAS_MASK for dt in DTYPES
                for c in (False, True) for m in MODS_BIAS_MASK_CHECKED[c]]
        out += [fwd_sm90_ws_config(hd, dt, c, m) for hd in FWD_SM90_WS_TILES for dt in DTYPES for c in (False, True)
                for m in MODS_BLOCKS_CHECKED[c]]
        out += [fwd_sm90_fp8_config(hd, dt, c, w) for hd in FWD_SM90_FP8_TILES for dt in DTYPES
                for c, w in ((False, False), (True, False), (False, True))]
        out += [fwd_sm90_fp8_config(hd, dt, c, seqlen_k=1 << 30) for hd in FWD_SM90_FP8_TILES for dt in DTYPES
                for c in (False, True)]
        out += [fwd_sm90_tf32_config(hd, dt, c, w, b, alibi_mask=am) for dt in FWD_SM90_TF32_TILES
                for hd in FWD_SM90_TF32_TILES[dt] for c, w in ((False, False), (True, False), (False, True))
                for b in (False, True) for am in (False, True)]
        out += [fwd_sm90_tf32_config(hd, dt, True, seqlen_k=1) for dt in FWD_SM90_TF32_TILES_TWO
                for hd in FWD_SM90_TF32_TILES_TWO[dt]]
    out += [c for c in all_wide_configs(arch) if isinstance(c, FwdWideConfig)]
    return out


# --- Hopper (sm_90a): warpgroup MMA kernels ------------------------------------------------------------
#
# Which kernel family the library launches on an sm_90a GPU: "auto" (default) takes the wgmma kernels
# where one exists for the head dim and the mma.sync kernels elsewhere; "mma" takes mma.sync kernels
# only (as on sm_80), e.g. to compare the two or to run the analyzer's ncu validation of them.
KERNEL_FAMILIES = ("auto", "mma")
KERNELS = os.environ.get("CUFLASH_KERNELS", "auto")
if KERNELS not in KERNEL_FAMILIES:
    raise ValueError(f"CUFLASH_KERNELS={KERNELS!r} is not allowed; allowed: {', '.join(KERNEL_FAMILIES)}")


def uses_wgmma(arch: str, kernels: str | None = None) -> bool:
    """True when the library launches its wgmma kernels on `arch` (sm_90a, unless kernels="mma")."""
    kernels = KERNELS if kernels is None else kernels
    if kernels not in KERNEL_FAMILIES:
        raise ValueError(f"kernels={kernels!r} is not allowed; allowed: {', '.join(KERNEL_FAMILIES)}")
    return arch == "sm_90a" and kernels == "auto"


@dataclass(frozen=True)
class FwdSm90Config:
    """One Hopper forward instantiation:
    `fwd_sm90_kernel<FwdSm90Traits<HEAD_DIM, BLOCK_M, BLOCK_N, CTAS_PER_SM, T>, IS_CAUSAL>`: one warpgroup
    (4 warps) per 64 query rows, S = Q K^T and O += P V on wgmma.m64nNk16."""

    head_dim: int
    block_m: int
    block_n: int
    ctas_per_sm: int  # __launch_bounds__ minimum blocks per SM (caps registers at 64K / (threads * this))
    dtype: str
    causal: bool
    stages: int = 2
    mods: int = 0  # score modifiers (MOD_* bits)

    def __post_init__(self):
        check_mods(self.mods, self.causal)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: {DTYPES}")
        if self.block_m % 64 or not 64 <= self.block_m <= 192:
            raise ValueError(f"block_m={self.block_m} must be 64, 128 or 192 (64 rows per warpgroup)")

    @property
    def num_warps(self) -> int:
        return self.block_m // 16

    @property
    def threads(self) -> int:
        return 2 * self.block_m

    @property
    def smem_bytes(self) -> int:
        q = self.block_m * self.head_dim * ELEM_BYTES
        kv = self.block_n * self.head_dim * ELEM_BYTES
        return q + 2 * self.stages * kv + 1024  # + rounding the base up to the 1024-byte swizzle period

    def cpp_name(self) -> str:
        t = _cpp_type(self.dtype)
        return (f"cuflash::fwd_sm90_kernel<cuflash::FwdSm90Traits<{self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.ctas_per_sm}, {t}>, {_cpp_bool(self.causal)}, {self.mods}>")

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.block_m), heads, batch)


# Hopper forward tiles per kernel head dim: (block_m, block_n, ctas_per_sm). See docs/PERFORMANCE.md.
FWD_SM90_TILES = {
    32: (128, 64, 2),    # (128, 128, 2) spills at the 128-register cap of 2 CTAs x 256 threads
    64: (128, 64, 2),    # H100 bf16 N=8k: 399 TFLOP/s vs 340 for (192, 128, 1), 315 for (128, 128, 1)
    96: (128, 128, 1),
    128: (128, 128, 1),  # 423 vs 424 for (192, 64, 1), 397 for (128, 64, 1)
    192: (128, 64, 1),
    256: (128, 48, 1),   # (128, 64, 1): 473 vs 385 for (128, 32, 1), but it spills 8 bytes causal (255 registers)
}


# --- Hopper (sm_90a): the warp-specialized forward (cuda/fwd_sm90_ws.cuh) ------------------------------------
TMA_BOX_COLS = 64  # one 128-byte swizzle panel of 16-bit elements: the column width of a TMA box
SMEM_LIMIT_SM90 = 227 * 1024  # dynamic shared memory one CTA may have on sm_90
SMEM_LIMIT_SM80 = 163 * 1024  # on sm_80 (A100); sm_86 and sm_89 allow 99 KiB, less than many of cuflash's tiles


def smem_limit(arch: str) -> int:
    """Dynamic shared memory one CTA may have on an NVRTC target: what every shipped tile of that target fits."""
    return SMEM_LIMIT_SM90 if arch.startswith("sm_90") else SMEM_LIMIT_SM80


@dataclass(frozen=True)
class FwdSm90WsConfig:
    """One warp-specialized Hopper forward instantiation:
    `fwd_sm90_ws_kernel<FwdSm90WsTraits<HEAD_DIM, BLOCK_N, STAGES, PINGPONG, T, PERSISTENT, BLOCK_M>, IS_CAUSAL,
    MODS>`: a TMA producer warpgroup and block_m / 64 consumer warpgroups of 64 query rows each, 1 CTA per SM: two
    (block_m 128, 384 threads, 240 registers each), or three (block_m 192, 512 threads, 160 registers each; head
    dims up to 64, no modifier, no pingpong)."""

    head_dim: int
    block_n: int
    stages: int
    dtype: str
    causal: bool
    pingpong: bool = True
    mods: int = 0  # score modifiers (MOD_* bits)
    persistent: bool = False  # one CTA per SM walking the work items (FwdSm90WsTraits::PERSISTENT)
    block_m: int = 128  # query rows per CTA: 64 per consumer warpgroup

    def __post_init__(self):
        check_mods(self.mods, self.causal)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: {DTYPES}")
        if self.head_dim not in FWD_SM90_WS_HEAD_DIMS:
            raise ValueError(f"head_dim={self.head_dim} is not supported; supported: "
                             f"{', '.join(map(str, FWD_SM90_WS_HEAD_DIMS))} (whole 32- or 64-column TMA panels, a "
                             f"wgmma N size)")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"stages={self.stages} must be 2, 3 or 4")
        if self.block_m not in (128, 192):
            raise ValueError(f"block_m={self.block_m} must be 128 (two consumer warpgroups) or 192 (three)")
        if self.block_m == 192 and (self.head_dim > 64 or self.mods or self.pingpong):
            raise ValueError(f"block_m=192 (three consumer warpgroups of 160 registers) takes head_dim up to 64, no "
                             f"score modifier, no pingpong; got head_dim={self.head_dim}, mods={self.mods}, "
                             f"pingpong={self.pingpong}")

    @property
    def box_cols(self) -> int:
        """TMA box width in elements: one swizzle panel (FwdSm90WsTraits::BOX_COLS), 64 columns with a 128-byte
        swizzle, or 32 with a 64-byte one when the head dim is not a multiple of 64."""
        return panel_cols(self.head_dim)

    @property
    def threads(self) -> int:
        return 128 + 2 * self.block_m  # the producer warpgroup and block_m / 64 consumers

    @property
    def smem_bytes(self) -> int:
        """FwdSm90WsTraits::smem_bytes(bias, mask) (the kernel traps if it is given less): Q, the K/V stages, the
        mbarriers, with a bias or a mask each consumer warp's staged rows of them (16 rows, pitch padded by 16
        bytes), and 1024 bytes to round the base up to the swizzle period."""
        q = self.block_m * self.head_dim * ELEM_BYTES
        kv = self.block_n * self.head_dim * ELEM_BYTES
        end = q + 2 * self.stages * kv + (q if self.o_separate else 0) + 8 * self.barriers
        bias, mask = bool(self.mods & MOD_BIAS), bool(self.mods & MOD_MASK)
        if not (bias or mask):
            return end + 1024
        pitches = (2 * self.block_n + 16 if bias else 0) + (self.block_n + 16 if mask else 0)
        return -(-end // 16) * 16 + 8 * 16 * pitches + 1024

    @property
    def barriers(self) -> int:
        """FwdSm90WsTraits::BARRIERS (8-byte words): q_full (and q_empty when persistent), full / empty of K and V per
        stage, and when persistent the work item ring (item_full[2], item_empty[2], one word of two slots)."""
        return (2 + 5 if self.persistent else 1) + 4 * self.stages

    def uses_queue(self, packed: bool) -> bool:
        """Whether a launch takes its work items from a queue (FwdWsParams.queue: a persistent CTA takes the next
        untaken item once it has issued the loads of its current one) rather than in a fixed stride: items of
        unequal cost (causal or windowed query blocks, sequences of different lengths; packed non-causal batches
        measured +16-26 % over the stride at N <= 4k on an H100, docs/PERFORMANCE.md "Variable-length batches")."""
        return self.persistent and (self.causal or bool(self.mods & (MOD_WINDOW | MOD_BLOCKS)) or packed)

    @property
    def o_separate(self) -> bool:
        """FwdSm90WsTraits::O_SEPARATE: a persistent kernel stages O in a buffer of its own where it fits."""
        q = self.block_m * self.head_dim * ELEM_BYTES
        kv = self.block_n * self.head_dim * ELEM_BYTES
        return self.persistent and 2 * q + 2 * self.stages * kv + 8 * self.barriers + 1024 <= SMEM_LIMIT_SM90

    def cpp_name(self) -> str:
        t = _cpp_type(self.dtype)
        tail = f", {_cpp_bool(self.persistent)}, {self.block_m}" if self.block_m != 128 else \
            ", true" if self.persistent else ""
        return (f"cuflash::fwd_sm90_ws_kernel<cuflash::FwdSm90WsTraits<{self.head_dim}, {self.block_n}, {self.stages}, "
                f"{_cpp_bool(self.pingpong)}, {t}{tail}>, {_cpp_bool(self.causal)}, {self.mods}>")

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        """The work items as a grid (query blocks, heads, batch): the launch grid unless persistent."""
        return (math.ceil(seqlen_q / self.block_m), heads, batch)

    def schedule(self, batch: int, heads: int, seqlen_q: int, num_sms: int) -> tuple[tuple[int, int, int], int, int]:
        """(launch grid, m_blocks, items) of a launch: FwdWsParams.m_blocks and .items, and the grid, which a
        persistent kernel sizes at one CTA per SM (at most one per item)."""
        m_blocks = math.ceil(seqlen_q / self.block_m)
        items = m_blocks * heads * batch
        grid = (max(1, min(items, num_sms)), 1, 1) if self.persistent else (m_blocks, heads, batch)
        return grid, m_blocks, items


# Tiles per head dim: (block_n, stages, pingpong), chosen with tools/tune_tiles.py on an H100 (bf16, N = 8192,
# B=2, H = 2048 / D, 2026-11-24; TFLOP/s of the chosen tiles first). Non-causal: D 64 (192, 2) 468 against 448 with
# (128, 2) and pingpong, 440 (128, 3), 407 (64, 2), 402 (128, 2); D 128 (192, 2) 703 against 647 (128, 2), 643
# (128, 3), 640 with pingpong, 628 (96, 2); D 256 (64, 2) 706 against 662 with pingpong, 624 (48, 3), 534 (32, 4).
# Head dims 32 and 96 take 32-column panels (a 64-byte swizzle), measured the same way on 2026-11-28 (H = 64 at D 32,
# 21 at D 96; N 8k / 16k): D 32 (256, 2, pingpong, persistent) 313 / 317 against 290 / 303 on the one-item grid,
# 308 / 309 with 3 stages, 279 / 294 (192, 2), 277 / 283 (256, 2), 263 / 267 (128, 2), 266 / 268 (256, 2,
# persistent; it spills 28 bytes under NVRTC 13.0), and 257 / 259 for fwd_sm90_kernel, which ran D 32 before (the
# same tile wins at N 1k-4k: FWD_SM90_WS_SHORT_KEYS' comment); D 96 (128, 2,
# persistent) at N 2k / 8k 530 / 555 against 503 / 524 with pingpong, 475 / 518 (128, 2), 467 / 516 (192, 2), and
# 488 / 483 for the 128 kernel, which ran D 96 before with its last 32 columns zero-filled. D 192 takes three 64-column
# panels, measured on an H200 (2026-11-28, H 10, N 2k / 8k): (96, 2, pingpong) 675 / 727 against 676 / 713 without
# pingpong, 659 / 685 (64, 2, persistent), 631 / 685 (64, 3), 647 / 627 (64, 2, pingpong), 571 / 514 (48, 3); the 256
# kernel, which ran D 192 before with its last 64 columns zero-filled, takes 1.25-1.36x as long (causal 1.18-1.35x;
# docs/PERFORMANCE.md "Forward at head dim 192"). D 64 takes three consumer warpgroups (block_m 192, the fifth entry;
# 160 registers each, 128-key tiles: 192 keys spilled 448 bytes) past FWD_SM90_WS_SHORT_KEYS, measured on an H200
# (2026-11-28, bf16 FA shapes, A/B in one process, TFLOP/s, N 2k / 4k / 8k / 16k): (128, 2) 427 / 450 / 478 / 506
# against 414 / 443 / 441 for the persistent (128, 2) and 457 at 16k for the two-consumer (192, 2); (128, 3) 425 /
# 463 / 470 / 499, (96, 2) 400 / 428 / 449 / 468; at N 1k 345 against 384 (fewer, larger work items). D 256 takes 80-key
# tiles (FlashAttention-3's choice there; wgmma N 80, 225 KB of shared memory in two stages) since 2026-12-04, for plain
# calls, causal ones too (FWD_SM90_WS_TILES_CAUSAL_PLAIN): on an H200 (bf16 FA shapes, H 8, `tools/tune_tiles.py
# --head-dims 256 --n 1024 2048 4096 8192 16384 --causal both --rounds 4`, TFLOP/s, 80 / 64 in each of the four rounds)
# non-causal N 1k 1.03-1.09x, 2k 0.93-1.12x (three rounds 1.05-1.12x), 4k 0.99-1.03x, 8k 1.05-1.07x, 16k 1.04-1.10x;
# causal N 1k 0.86-0.99x (it keeps 64 there: FWD_SM90_WS_TILES_CAUSAL_SHORT), 2k 1.01-1.03x, 4k 1.01-1.09x, 8k
# 1.02-1.06x, 16k 1.02-1.11x. Key tiles of 160 or 176 rows at D 128 and 112 at D 192 measured no faster than the tiles
# here (docs/PERFORMANCE.md, What did not pay).
FWD_SM90_WS_TILES = {
    32: (256, 2, True, True),
    64: (128, 2, False, False, 192),
    96: (128, 2, False, True),
    128: (192, 2, False),
    192: (96, 2, True),
    256: (80, 2, False),
}
# Causal (and a window, which masks tiles like causal): D 64 (128, 2) with pingpong 421 against 392 (192, 2), 389
# (128, 2), 373 (128, 3), 371 (64, 2); D 128 (128, 3) 621 against 589 (128, 2), 588 (192, 2), 580 with pingpong,
# 545 (96, 2); D 256 (64, 2) 631 against 594 with pingpong, 529 (48, 3), 484 (32, 4). FlashAttention-3 takes
# block_n 176 (d128) and 80 (d256); ptx_wgmma.cuh has N = 16..256 in steps it lists. D 32 and 96 (2026-11-28, N 2k
# / 8k at D 96): a window takes (128, 2) at D 32 (causal N 1k / 4k / 16k 161 / 233 / 265 against 148 / 227 / 263
# for (192, 2)) and (128, 3) at D 96 (causal 421 / 507 against 402 / 485 (128, 2)); plain causal rows take FWD_SM90_WS_TILES_CAUSAL_PLAIN.
# D 192 (H200, 2026-11-28, N 2k / 8k): (96, 2, pingpong) 529 / 675 against 499 / 682 without pingpong, 523 / 634 (64,
# 2, persistent), 443 / 632 (64, 3), 501 / 626 (64, 2, pingpong).
FWD_SM90_WS_TILES_CAUSAL = {
    32: (128, 2, False),
    64: (128, 2, True),
    96: (128, 3, False),
    128: (128, 3, False),
    192: (96, 2, True),
    256: (64, 2, False),
}



@dataclass(frozen=True)
class FwdSm90Fp8Config:
    """One FP8 (e4m3) Hopper forward instantiation:
    `fwd_sm90_fp8_kernel<FwdFp8Traits<HEAD_DIM, BLOCK_N, STAGES, OutT, PINGPONG, Q_IN_REGS, LATE_PACK, CONSUMERS,
    PERSISTENT>, IS_CAUSAL, HAS_WINDOW>` (cuda/fwd_sm90_fp8.cuh): a producer warpgroup (one TMA thread, three warps
    transposing V) and two or three consumer warpgroups of 64 query rows (BLOCK_M = 128 or 192, 384 or 512 threads,
    1 CTA per SM). dtype: the output's ("bf16" or "fp16"); window: a sliding window; persistent: at most one CTA per
    SM walking the work items (query blocks of one (batch, head)) blockIdx.x, + gridDim.x, ...."""

    head_dim: int
    block_n: int
    stages: int
    dtype: str
    causal: bool
    window: bool = False
    pingpong: bool = False  # order the two consumers' GEMMs through named barriers
    q_in_regs: bool = False  # Q as the A registers of S = Q K^T (read from shared memory once)
    late_pack: bool = False  # P's packing and O's rescale at the start of the next round of GEMMs
    consumers: int = 2  # consumer warpgroups of 64 query rows: 2, or 3 without pingpong
    persistent: bool = False  # at most one CTA per SM walking the work items (FwdFp8Traits::PERSISTENT)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} (the output's); allowed: {DTYPES}")
        if self.head_dim not in FWD_SM90_FP8_TILES:
            raise ValueError(f"head_dim={self.head_dim} is not supported by the FP8 forward; supported: "
                             f"{', '.join(map(str, FWD_SM90_FP8_TILES))}")
        if self.block_n not in (64, 128) or not 2 <= self.stages <= 4:
            raise ValueError(f"block_n={self.block_n}, stages={self.stages}: block_n 64 or 128, 2-4 stages")
        if self.causal and self.window:
            raise ValueError("a window carries causal as its right edge 0: causal=True with window=True is not a kernel")
        if self.consumers not in (2, 3) or (self.consumers == 3 and self.pingpong):
            raise ValueError(f"consumers={self.consumers}, pingpong={self.pingpong}: two consumer warpgroups, or three "
                             f"without pingpong")
        if self.persistent and self.wide_consumers:
            raise ValueError("persistent=True at head_dim=256 with 128-key tiles: its producer warpgroup's 24 registers "
                             "do not hold the item walk (the kernels spilled 24-104 bytes)")

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def wide_consumers(self) -> bool:
        """FwdFp8Traits::WIDE_CONSUMERS: head dim 256 with 128-key tiles and two consumers (240 registers per consumer
        thread, 24 per producer thread; the transposers walk their units by 16-key group)."""
        return self.head_dim == 256 and self.block_n == 128 and self.consumers == 2

    @property
    def threads(self) -> int:
        return 128 + 128 * self.consumers

    @property
    def box_bytes(self) -> int:
        """TMA box width in bytes (one swizzle panel): 128, or 64 at head dim 64."""
        return 128 if self.head_dim >= 128 else 64

    @property
    def smem_bytes(self) -> int:
        """FwdFp8Traits::SMEM_BYTES: Q, the K, V and V^T stages (1-byte elements), 1 + 6 * stages mbarriers (persistent:
        6 words more, q_empty and the work item ring), and 1024 bytes to round the base up to the swizzle period."""
        kv = self.block_n * self.head_dim
        barriers = 1 + 6 * self.stages + (6 if self.persistent else 0)
        return self.block_m * self.head_dim + 3 * self.stages * kv + 8 * barriers + 1024

    def cpp_name(self) -> str:
        t = _cpp_type(self.dtype)
        # FwdFp8Traits' defaulted arguments, the trailing defaults left out
        args = [_cpp_bool(self.pingpong), _cpp_bool(self.q_in_regs), _cpp_bool(self.late_pack), str(self.consumers),
                _cpp_bool(self.persistent)]
        defaults = ["false", "false", "false", "2", "false"]
        while args and args[-1] == defaults[len(args) - 1]:
            args.pop()
        extra = "".join(f", {a}" for a in args)
        return (f"cuflash::fwd_sm90_fp8_kernel<cuflash::FwdFp8Traits<{self.head_dim}, {self.block_n}, {self.stages}, "
                f"{t}{extra}>, {_cpp_bool(self.causal)}, {_cpp_bool(self.window)}>")

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        """The work items as a grid (query blocks, heads, batch): the launch grid unless persistent."""
        return (math.ceil(seqlen_q / self.block_m), heads, batch)

    def schedule(self, batch: int, heads: int, seqlen_q: int, num_sms: int) -> tuple[tuple[int, int, int], int, int]:
        """(launch grid, m_blocks, items) of a launch (FwdFp8Params.m_blocks and .items): a persistent kernel's grid
        holds one CTA per SM (at most one per item)."""
        m_blocks = math.ceil(seqlen_q / self.block_m)
        items = m_blocks * heads * batch
        grid = (max(1, min(items, num_sms)), 1, 1) if self.persistent else (m_blocks, heads, batch)
        return grid, m_blocks, items

    def uses_queue(self, packed: bool) -> bool:
        """Whether a persistent launch takes its work items from a queue (FwdFp8Params.queue: the TMA thread takes the
        next untaken item once it has issued the loads of its current one) rather than on a fixed stride: items of
        unequal cost (causal or windowed query blocks, packed sequences of different lengths)."""
        return self.persistent and (self.causal or self.window or packed)


# FP8 forward tiles per head dim: (block_n, stages, pingpong, q_in_regs, late_pack, consumers). Key tiles divide the
# 128-row quantization blocks of cuflash.fp8.quantize; before 2026-12-01 D 256 took 64-key tiles (with 128 the
# consumers spilled 144 bytes at 224 registers, NVRTC 13.5; measurements of that time below). Measured on an H100 (FA
# shapes, N 1k / 4k / 16k, non-causal, TFLOP/s, 2026-11-26): D 128
# (128, 2) with pingpong 558 / 693 / 731 against 542 / 686 / 706 without, 536 / 711 / 732 with 3 stages; D 256 (64,
# 4) with pingpong 541 / 690 / 751 against 540 / 689 / 743 with 3 stages, 539 / 702 / 748 with 2; D 64 (128, 2)
# with pingpong 361 / 441 / 473 against 359 / 429 / 471 without, and with Q in registers 368 / 440 / 489 against 362
# / 438 / 477 (causal 16k 491 against 463); Q in registers spills 16 bytes at D 128 and 128 at D 256 (at D 128 also
# with 24 producer and 240 consumer registers, as D 256 takes them: 16 bytes and every wgmma serialized, ptxas C7512;
# three consumers of 128-key tiles at 160 registers spilled 96-144 bytes, C7512; NVRTC 13.5, 2026-12-01). late_pack (P
# packed and O rescaled at the next round's start; the softmax then runs under the last P V GEMM), on an H200,
# 2026-11-30, two rounds against the kernels without it, N 1k / 4k / 16k: D 64 non-causal 379-383 / 495-501 / 548
# against 366-371 / 481-485 / 535-536, causal 269-270 / 430-434 / 532-534 against 259 / 379-384 / 458-459; D 256
# non-causal 592-631 / 810-852 / 899-913 against 612-634 / 774-783 / 871-876, causal 437-443 / 673-676 / 882-905
# against 441-450 / 671-673 / 843-849; D 128 non-causal even (N 1k-16k), causal 0.93-0.94x from N 4k (607-611 /
# 683-692 / 764 against 645-650 / 712-742 / 817-822; with 3 stages no better), so D 128 keeps the order without
# it. Three consumer warpgroups (192-row CTAs, no pingpong; Q in registers spills 16 bytes there) at D 64, H200,
# same day, N 1k / 2k / 4k / 8k / 16k, two rounds: non-causal 384-386 / 498 / 552 / 608-614 / 626-631 against two
# consumers' 376-379 / 440-441 / 492-496 / 526-527 / 546-551, causal 245-247 / 368 / 443-445 / 518-525 / 557-561
# against 269-272 / 359-362 / 432-433 / 485 / 526-527 (without late_pack: 364-373 / 449-450 / 490-491 / 536-541 /
# 549-554 non-causal; with 3 stages 385 / 492 / 546 / 604-605 / 623-624). Causal rows keep two consumers where
# they are short: a 192-row block wastes more of the band's edge tiles (causal N 1k 0.91x); above 1k keys three
# consumers run them faster (FWD_SM90_FP8_CAUSAL_LONG_KEYS). This table is the one-item grid's: non-causal rows of
# more than FWD_SM90_FP8_SHORT_KEYS keys, and D 256 (causal or a window: FWD_SM90_FP8_TILES_BANDED).
# D 256 since 2026-12-01 (the transposers' addresses as immediates, 24 producer registers and 240 per consumer thread:
# FwdFp8Traits::WIDE_CONSUMERS) takes 128-key tiles, with pingpong (its banded kernels spilled 4-24 bytes: they take
# late_pack): `tools/tune_tiles.py --dtype fp8 --head-dims 256 --n 1024 4096 16384 --causal both`, H200, N 1k / 4k /
# 16k, TFLOP/s: (128, 2, pingpong) 727 / 966 / 1019 against 648 / 858 / 926 for (64, 4, pingpong, late_pack), (128, 2,
# late_pack) 697 / 931 / 1002; causal (128, 2, late_pack) 478 / 813 / 993 against 449 / 717 / 894.
FWD_SM90_FP8_TILES = {
    64: (128, 2, False, False, True, 3),
    128: (128, 2, True, False, False, 2),
    256: (128, 2, True, False, False, 2),
}
# Causal rows and windows at every length: the persistent grid taking its query blocks from a work queue (the TMA
# thread takes the next untaken one once it has issued its current one's loads; causal: longest first per (batch,
# head)), at head dims 64 and 128; head dim 256 keeps the one-item grid (its persistent kernels spilled). On an H200,
# 2026-12-01, one process (block-scaled inputs, FA shapes, TFLOP/s of the band's pairs), persistent with the queue
# against the one-item grid's tiles of that time: causal D 64 N 2k / 4k (`tools/tune_tiles.py --dtype fp8`) 410 / 476
# against 375 / 454, 8k / 16k 539 / 573 against 530 / 566 (three consumers on both grids); causal D 128 (late_pack
# against pingpong) 441 / 582 / 703 at N 1k / 2k / 4k against 397 / 545 / 665, 782 / 809 at 8k / 16k against 753 /
# 800; a window of (512, 0) at N 2k / 8k / 16k: D 64 251 / 257 / 257 (three consumers; 251 / 256 / 256 with two,
# pingpong and Q in registers) against 225 / 232 / 230 (two, pingpong, Q in registers, the one-item banded tiles
# then), D 128 380 / 401 / 395 against 351 / 367 / 359; a window of (1024, 1024): D 64 454 / 460 / 458 against 382 /
# 389 / 389, D 128 648 / 678 / 692 against 625 / 652 / 651.
FWD_SM90_FP8_TILES_BANDED = {
    64: (128, 2, False, False, True, 3, True),
    128: (128, 2, False, False, True, 2, True),
    256: (128, 2, False, False, True, 2),
}
# Non-causal rows without a window of up to FWD_SM90_FP8_SHORT_KEYS keys: the persistent grid (at most one CTA per SM
# walking the query blocks, FwdFp8Traits::PERSISTENT), whose CTAs start once per SM, not once per query block.
# `tools/tune_tiles.py --dtype fp8 --head-dims 64 128 --n 1024 2048 4096 8192 16384 --causal both --only ', True\)$'`
# (H200, 2026-12-01), TFLOP/s at N 1k / 2k / 4k / 8k / 16k against the one-item grid: D 64 (128, 2, three consumers,
# persistent) 443 / 534 / 570 / 614 / 619 against 384 / 502 / 559 / 619 / 632 (two consumers with pingpong, Q in
# registers: 410 / 461 / 504 / 526 / 534); D 128 (128, 2, late_pack, persistent) 623 / 727 / 780 / 820 / 797 against
# 581 / 706 / 771 / 820 / 782 (with pingpong: 607 / 698 / 747 / 761 / 750, with 3 stages 611 / 693 / 737 / 752 /
# 771). Causal rows on this grid (a static stride: every CTA its share of items of unequal length) ran slower at
# every length (D 64 N 4k 278 against 454, D 128 N 16k 560 against 785; with a work queue they run faster,
# FWD_SM90_FP8_TILES_BANDED); head dim 256's persistent kernels spilled 12-104 bytes (its producer's 24 registers).
FWD_SM90_FP8_TILES_SHORT = {
    64: (128, 2, False, False, True, 3, True),
    128: (128, 2, False, False, True, 2, True),
}
FWD_SM90_FP8_SHORT_KEYS = 4096
# Causal rows (no window) of at most FWD_SM90_FP8_CAUSAL_LONG_KEYS keys, where the table has the head dim: the
# persistent grid with the work queue, two consumer warpgroups (a 192-row block wastes more of the diagonal's tiles).
# D 64 on an H200, 2026-12-01, one process, TFLOP/s at N 1024 / 1536: (128, 2, late_pack, two consumers, persistent)
# 331 / 383 against 287 / 386 with three consumers, 304 / 353 with pingpong and Q in registers, 295 / 338 with
# pingpong.
FWD_SM90_FP8_TILES_CAUSAL_SHORT = {
    64: (128, 2, False, False, True, 2, True),
}
# Causal rows of more keys than this take FWD_SM90_FP8_TILES_BANDED (three consumers at head dim 64). Three against
# two consumers on the one-item grid, H200, 2026-11-30, three rounds, N 1024 / 1280 / 1536 / 1792 / 2048, TFLOP/s:
# 247-248 / 301-302 / 344 / 337 / 374-375 against 269-272 / 298 / 320-323 / 343-344 / 357-360 (a 192-row block one
# third full at 1792), and 1.02-1.10x from 4k. A window takes FWD_SM90_FP8_TILES_BANDED at every length.
FWD_SM90_FP8_CAUSAL_LONG_KEYS = {64: 1024}


def fwd_sm90_fp8_table(head_dim: int, causal: bool, window: bool = False, seqlen_k: int | None = None) -> dict:
    """The FP8 tile table a call takes (seqlen_k: the longest key sequence; None counts as short): causal rows or a
    window take FWD_SM90_FP8_TILES_BANDED (FWD_SM90_FP8_TILES_CAUSAL_SHORT for causal rows of at most
    FWD_SM90_FP8_CAUSAL_LONG_KEYS keys, where it has the head dim); other rows FWD_SM90_FP8_TILES_SHORT up to
    FWD_SM90_FP8_SHORT_KEYS keys, where it has the head dim, else FWD_SM90_FP8_TILES."""
    if causal or window:
        within = seqlen_k is None or seqlen_k <= FWD_SM90_FP8_CAUSAL_LONG_KEYS.get(head_dim, -1)
        if causal and not window and within and head_dim in FWD_SM90_FP8_TILES_CAUSAL_SHORT:
            return FWD_SM90_FP8_TILES_CAUSAL_SHORT
        return FWD_SM90_FP8_TILES_BANDED
    short = seqlen_k is None or seqlen_k <= FWD_SM90_FP8_SHORT_KEYS
    return FWD_SM90_FP8_TILES_SHORT if short and head_dim in FWD_SM90_FP8_TILES_SHORT else FWD_SM90_FP8_TILES


def fwd_sm90_fp8_config(head_dim: int, dtype: str, causal: bool, window: bool = False,
                        seqlen_k: int | None = None) -> FwdSm90Fp8Config:
    """The FP8 forward's config (seqlen_k: the longest key sequence; None counts as short)."""
    tiles = fwd_sm90_fp8_table(head_dim, causal, window, seqlen_k)
    return FwdSm90Fp8Config(head_dim, tiles[head_dim][0], tiles[head_dim][1], dtype, causal, window,
                            *tiles[head_dim][2:])


# The head dims fwd_sm90_ws_kernel is compiled for (FwdSm90WsConfig checks them)
FWD_SM90_WS_HEAD_DIMS = tuple(FWD_SM90_WS_TILES)


# With ALiBi / softcap / dropout (heavy_mods): the largest key tile that stays spill-free under the consumers' 240
# registers with every modifier set (NVRTC 13.5 and 13.0). The plain tiles spilled: d128 block_n 128: 8-32 bytes;
# d256 block_n 64: 16-40 bytes, 48: 4-12 bytes; d256 with pingpong kept 4-8 bytes on the stack at block_n 32; d192
# block_n 64: 4-12 bytes, 48: 12-20 bytes.
FWD_SM90_WS_TILES_MODS = {
    32: (128, 2, False),
    64: (128, 2, False),
    96: (96, 3, False),
    128: (96, 3, False),
    192: (32, 4, False),
    256: (32, 4, False),
}

# A boolean mask (or a BlockMask) without other per-element modifiers (a window or causal may come with it): key
# tiles of 128 rows at D 64 and 128 and of 64 at D 192 and 256, spill-free with the mask staged (NVRTC 13.5 and
# 13.0), so that a BlockMask of 128 x 128 blocks maps each block onto whole tiles. On the heavy tiles (96 keys at D
# 128) a 128-key block straddled two tiles, about twice the blocks' tiles were visited and most of them were partial
# (their element mask read), where aligned tiles are full and read no mask.
FWD_SM90_WS_TILES_MASK = {
    32: (128, 2, False),
    64: (128, 2, False),
    96: (128, 2, False),
    128: (128, 2, False),
    192: (64, 2, False),
    256: (64, 2, False),
}
# The heaviest modifier sets of the mask table (the compile check builds them, as MODS_CHECKED for the others)
MODS_MASK_CHECKED = {False: (MOD_MASK | MOD_WINDOW,), True: (MOD_MASK,)}
# ... of the bias table (MOD_BIAS with at most a window)
MODS_BIAS_CHECKED = {False: (MOD_BIAS, MOD_BIAS | MOD_WINDOW), True: (MOD_BIAS,)}
# ... of the bias-with-a-mask table (MOD_BIAS and MOD_MASK with at most a window)
MODS_BIAS_MASK_CHECKED = {False: (MOD_BIAS | MOD_MASK, MOD_BIAS | MOD_MASK | MOD_WINDOW), True: (MOD_BIAS | MOD_MASK,)}
# ... and of the block map alone (MOD_BLOCKS: the plain / causal tiles of the warp-specialized kernels)
MODS_BLOCKS_CHECKED = {False: (MOD_BLOCKS | MOD_WINDOW,), True: (MOD_BLOCKS,)}


# A bias, with at most a window beside it (causal or not): key tiles of 64 rows on the persistent grid, at D 64 only
# up to FWD_SM90_WS_BIAS_MAX_KEYS keys. Measured on an H100 (bf16, the rows of `python -m cuflash.bench --bias`,
# forward ms, 2026-11-28): D 32 evoformer rows (B*N 128-1024 sequences of L 256-768, H 4-8, the pair bias shared by
# the N rows) 0.81-0.87x the synchronous fwd_sm90_kernel it replaced (0.139-3.047 ms against 0.159-3.757), against
# 0.87-0.95x for (128, 2, persistent) and 0.88-1.05x for (128, 2) on the one-item grid (192-key tiles 1.00-1.57x; 3
# or 4 stages of 64 keys within 3 % of 2; 32-key tiles 0.97-1.01x); D 64 evoformer rows (L 256, 512) 0.84 / 0.91x the
# (128, 2) one-item kernel, but 1.03-1.05x on the llm rows (a full (B, H, N, N) bias, N 1k-4k); D 128 llm rows (N
# 1k-4k) 0.93-0.97x (96, 3) on the one-item grid. With pingpong, (64, 2, True, True), 0.2-4 % slower at D 32, 64 and
# 128, N 256-4k (H200, 2026-12-01, `tools/tune_tiles.py --mods bias`, docs/PERFORMANCE.md "What did not pay").
FWD_SM90_WS_TILES_BIAS = {32: (64, 2, False, True), 64: (64, 2, False, True), 128: (64, 2, False, True)}
FWD_SM90_WS_BIAS_MAX_KEYS = {64: 512}
# A bias beside a mask (the Evoformer's pair bias with its MSA mask as a key_padding_mask), with at most a window:
# the bias's 64-key tiles on the persistent grid, with pingpong, at D 32 and 64 (at D 64 up to
# FWD_SM90_WS_BIAS_MAX_KEYS keys); the persistent kernels spilled 68-72 bytes there until the producer thread, which
# walks the mask's tile map for each item, kept 32 registers (fwd_sm90_ws.cuh). Measured in one process on an H200
# (2026-11-30, bf16, a (1, H, L, L) bf16 bias, a key_padding_mask keeping every key or the first 70-100 % of each
# row's, CUDA events, the better median of 30 calls in two rounds), forward ms, the one-item (128, 2) tiles of
# FWD_SM90_WS_TILES_MODS against (64, 2, pingpong, persistent): B*N 1024, L 256, H 8, D 32 1.048 / 0.948 (70-100 %:
# 1.288 / 0.954); 128, 768, 8, 32 0.816 / 0.823 (0.881 / 0.777); 512, 256, 8, 64 0.575 / 0.510 (0.683 / 0.521); 512,
# 512, 4, 64 0.865 / 0.821 (0.987 / 0.809); without pingpong 0-5 % behind (the bias alone: 0.818, 0.742, 0.456,
# 0.765). D 128 keeps FWD_SM90_WS_TILES_MODS (not measured).
FWD_SM90_WS_TILES_BIAS_MASK = {32: (64, 2, True, True), 64: (64, 2, True, True)}


def bias_only(mods: int) -> bool:
    """A bias, with at most a window beside it: the kernels of config.FWD_SM90_WS_TILES_BIAS."""
    return bool(mods & MOD_BIAS) and not mods & ~(MOD_BIAS | MOD_WINDOW)


def bias_mask(mods: int) -> bool:
    """A bias beside a mask, with at most a window: the kernels of config.FWD_SM90_WS_TILES_BIAS_MASK."""
    return bool(mods & MOD_BIAS) and bool(mods & MOD_MASK) and not mods & ~(MOD_BIAS | MOD_MASK | MOD_WINDOW)


def mask_only(mods: int) -> bool:
    """A mask, with at most a window beside it: the kernels of config.FWD_SM90_WS_TILES_MASK."""
    return bool(mods & MOD_MASK) and not mods & ~(MOD_MASK | MOD_WINDOW)


# Short key sequences (seqlen_k at most the bound below), non-causal: key tiles of 128 rows waste less of the last
# tile and fill the pipeline sooner, and a persistent grid (one CTA per SM walking the work items, the next item's
# loads under this one's last tile and epilogue) hides the per-CTA start and drain that weigh most when a CTA has
# few key tiles. Measured on an H100 (bf16, FA shapes, `tools/tune_tiles.py`, 2026-11-25, TFLOP/s), persistent
# (128, 2) against the tiles shipped before: D 128 N 1k 597 against 521 (128, 2), 2k 654 against 611, 4k 688
# against 669 (192, 2), 8k 646 against 721 (so 4k is the bound); D 64 N 1k 397 against 351 (128, 2, pingpong), 2k
# 427 against 415, 4k 449 against 428 (192, 2), 8k 448 (457 with pingpong) against 432, 16k 435 against 473. D 256
# stays on the one-CTA-per-item grid (persistent N 8k 723 against 760); causal rows: FWD_SM90_WS_TILES_CAUSAL_PLAIN.
# (Before: D 128 N 1k 531 TFLOP/s with (128, 2) against 475 with (192, 2), `python -m cuflash.bench`.) D 32 takes
# its long-sequence tiles (FWD_SM90_WS_TILES) at every length (2026-11-28, H = 64): (256, 2, pingpong, persistent)
# N 1k / 2k / 4k 249 / 288 / 305 against 236 / 262 / 270 without pingpong, 229 / 239 / 256 (128, 2, persistent),
# 223 / 247 / 274 (256, 2) on the one-item grid and 226 / 250 / 256 for fwd_sm90_kernel (3 stages: 254 / 285 / 304).
# D 64's bound is 2k since its long rows run three consumer warpgroups (FWD_SM90_WS_TILES' comment); below it the
# persistent grid runs three consumer warpgroups too (block_m 192, the fifth entry) since 2026-11-28 (H200, bf16 FA
# shapes, `tools/tune_tiles.py --head-dims 64 --n 1024 2048 4096 8192 --causal both`, TFLOP/s): N 1k / 2k 403 / 472
# against 403 / 436 for the persistent two-consumer (128, 2) and 359 / 448 for the one-item three-consumer (128, 2);
# at 4k / 8k 488 / 502 against 490 / 504 for the one-item grid, which keeps the long rows. Causal rows measured
# 274 / 376 / 428 / 473 (N 1k / 2k / 4k / 8k) against 286 / 374 / 421 / 481 for the tables' kernels (3 stages: 277 /
# 381 / 434 / 483), within the run's noise except a loss at 1k, so they keep theirs.
FWD_SM90_WS_SHORT_KEYS = {64: 2048, 128: 4096}
FWD_SM90_WS_TILES_SHORT = {64: (128, 2, False, True, 192), 128: (128, 2, False, True)}

# Causal without other modifiers: the persistent grid taking its items from a work queue (longest query blocks
# first; a CTA takes the next item once it has issued the loads of its current one, so the CTAs' sums of key
# tiles even out). Measured on an H100 (bf16, FA shapes, `tools/tune_tiles.py --causal yes`, 2026-11-27, TFLOP/s)
# against the one-item-per-CTA kernels: D 128 (128, 2, pingpong) N 1k / 2k / 4k / 8k / 16k 429 / 531 / 598 / 635 /
# 679 against 352 / 473 / 562 / 627 / 677 for (128, 3) and 388 / 498 / 576 / 611 / 653 for (128, 2, pingpong);
# D 64 (128, 2) 308 / 376 / 422 / 457 / 474 against 274 / 350 / 414 / 452 / 477 for (128, 2, pingpong). With a
# fixed stride instead of the queue the persistent kernel ran causal rows 5-40 % slower than the one-item grid, and
# with the next item taken when the current one started, 2-8 % slower from 8k keys (a long item held the next back).
# D 256 keeps the one-item grid (its persistent causal kernel spills 12 bytes), on 80-key tiles since 2026-12-04 (as
# FWD_SM90_WS_TILES at D 256; up to 1k keys FWD_SM90_WS_TILES_CAUSAL_SHORT); windows and other modifiers keep the tables
# above (not measured persistent; a window on 80-key tiles spilled 4 bytes under NVRTC 13.5, and a BlockMask's 128 x 128
# blocks map onto whole 64-key tiles, not onto 80-key ones). D 32 (2026-11-28, H 64) (128, 2, pingpong) N 1k / 4k / 16k
# 185 / 253 / 282 against 182 / 239 / 261 without pingpong, 164 / 240 / 275 with pingpong on the one-item grid and 177 /
# 230 / 249 for fwd_sm90_kernel; D 96 (H 21) N 2k / 8k 457 / 516 against 421 / 507 (128, 3) and 399 / 466 for the 128
# kernel that ran it before.
FWD_SM90_WS_TILES_CAUSAL_PLAIN = {32: (128, 2, True, True), 64: (128, 2, False, True), 96: (128, 2, True, True),
                                  128: (128, 2, True, True), 256: (80, 2, False)}
# Causal without other modifiers and short key sequences (seqlen_k at most the bound below): at D 192 the persistent
# grid pays only there (H200, 2026-11-28, `tools/tune_tiles.py --head-dims 192 --causal yes`, TFLOP/s): (96, 2,
# pingpong, persistent) N 1k / 2k / 4k / 16k 428 / 541 / 621 / 716 against 364 / 543 / 633 / 761 for the one-item
# grid's (96, 2, pingpong) (and 418 / 536 / 604 / 691 for (64, 2, persistent)). At D 256 the 64-key tiles stay for
# rows of up to 1k keys, where the 80-key tiles read 0.86-0.99x in four rounds (FWD_SM90_WS_TILES' comment).
FWD_SM90_WS_CAUSAL_SHORT_KEYS = {192: 2048, 256: 1024}
FWD_SM90_WS_TILES_CAUSAL_SHORT = {192: (96, 2, True, True), 256: (64, 2, False)}
# Causal without other modifiers and long key sequences (seqlen_k above the bound below): at D 64 three consumer
# warpgroups of 64 rows each (block_m 192, 160 registers each), where the persistent grid's causal kernel ran
# (H200, 2026-11-28, bf16 FA shapes, A/B in one process, TFLOP/s): N 8k / 16k 457 / 474 against 436 / 447; N 1k /
# 2k / 4k 227 / 336 / 403 against 282 / 359 / 412 (fewer, larger work items and no queue), so only long rows.
FWD_SM90_WS_CAUSAL_LONG_KEYS = {64: 4096}
FWD_SM90_WS_TILES_CAUSAL_LONG = {64: (128, 2, False, False, 192)}


# A BlockMask's tile map alone (MOD_BLOCKS, at most a window beside it): key tiles of 128 rows at D 32-128 and of 64
# at D 192 and 256 take 128 x 128 blocks whole. Up to D 128 the persistent grid with its work queue (the query
# blocks' kept tiles differ; the queue evens them out) and pingpong, measured in one process (H200, 2026-11-30,
# bf16, B 1, N 16k, a random 10 % of the 128 x 128 blocks, CUDA events, the better median of two rounds, outputs
# bitwise equal), ms, the one-item causal tiles before against (128, 2, pingpong, persistent): D 128 H 16 0.537 /
# 0.505 (causal 0.320 / 0.283), D 64 H 32 0.861 / 0.811 (0.478 / 0.444), D 32 H 64 1.604 / 1.370 (0.864 / 0.741),
# D 96 H 21 0.633 / 0.599 (0.359 / 0.329); persistent without pingpong or with 3 stages 0-6 % behind. (The
# persistent kernels with a tile map spilled 64-76 bytes until the producer thread, which walks the map for each
# item, kept 32 registers instead of 24.) D 192 (64, 2, pingpong) persistent against one-item (H 10, same run): 0.526
# / 0.541 ms (causal 0.276 / 0.283). D 256 keeps the one-item grid (its persistent kernels with a map spill 44-56
# bytes in the consumers).
FWD_SM90_WS_TILES_BLOCKS = {**FWD_SM90_WS_TILES_CAUSAL, 32: (128, 2, True, True), 64: (128, 2, True, True),
                            96: (128, 2, True, True), 128: (128, 2, True, True), 192: (64, 2, True, True)}


def fwd_sm90_ws_table(head_dim: int, causal: bool, mods: int = 0, seqlen_k: int | None = None) -> dict:
    """The tile table whose entry for `head_dim` the warp-specialized forward takes for these modifiers and key count
    (None: the long-sequence tables; tools/tune_tiles.py tunes the entry it returns)."""
    if head_dim not in FWD_SM90_WS_TILES:
        raise ValueError(f"head_dim={head_dim} is not supported by fwd_sm90_ws_kernel; supported: "
                         f"{', '.join(map(str, FWD_SM90_WS_TILES))}")
    short = seqlen_k is not None and \
        seqlen_k <= (FWD_SM90_WS_CAUSAL_SHORT_KEYS if causal else FWD_SM90_WS_SHORT_KEYS).get(head_dim, 0)
    long = seqlen_k is not None and head_dim in FWD_SM90_WS_CAUSAL_LONG_KEYS and \
        seqlen_k > FWD_SM90_WS_CAUSAL_LONG_KEYS[head_dim]
    return FWD_SM90_WS_TILES_MASK if mask_only(mods) else \
        FWD_SM90_WS_TILES_BIAS if bias_only(mods) and head_dim in FWD_SM90_WS_TILES_BIAS and \
        (seqlen_k is None or seqlen_k <= FWD_SM90_WS_BIAS_MAX_KEYS.get(head_dim, seqlen_k)) else \
        FWD_SM90_WS_TILES_BIAS_MASK if bias_mask(mods) and head_dim in FWD_SM90_WS_TILES_BIAS_MASK and \
        (seqlen_k is None or seqlen_k <= FWD_SM90_WS_BIAS_MAX_KEYS.get(head_dim, seqlen_k)) else \
        FWD_SM90_WS_TILES_MODS if heavy_mods(mods) else \
        FWD_SM90_WS_TILES_BLOCKS if mods & MOD_BLOCKS else \
        FWD_SM90_WS_TILES_CAUSAL_SHORT if causal and not mods and short else \
        FWD_SM90_WS_TILES_CAUSAL_LONG if causal and not mods and long else \
        FWD_SM90_WS_TILES_CAUSAL_PLAIN if causal and not mods and head_dim in FWD_SM90_WS_TILES_CAUSAL_PLAIN else \
        FWD_SM90_WS_TILES_CAUSAL if causal or mods else FWD_SM90_WS_TILES_SHORT if short else FWD_SM90_WS_TILES


def fwd_sm90_ws_config(head_dim: int, dtype: str, causal: bool, mods: int = 0,
                       pingpong: bool | None = None, seqlen_k: int | None = None,
                       persistent: bool | None = None) -> FwdSm90WsConfig:
    """The warp-specialized forward's config (pingpong, persistent None: the table's choice; seqlen_k, when given,
    selects the short- or long-sequence tiles: fwd_sm90_ws_table). On an entry of three consumer warpgroups,
    pingpong True, or a grid other than the entry's (persistent given and different), gives the two-consumer kernel
    of the same key tiles."""
    table = fwd_sm90_ws_table(head_dim, causal, mods, seqlen_k)
    bn, stages, table_pingpong, *rest = table[head_dim]  # (block_n, stages, pingpong[, persistent[, block_m]])
    pingpong = table_pingpong if pingpong is None else pingpong
    table_persistent = bool(rest and rest[0])
    persistent = table_persistent if persistent is None else persistent
    block_m = rest[1] if len(rest) >= 2 and not pingpong and persistent == table_persistent else 128
    return FwdSm90WsConfig(head_dim, bn, stages, dtype, causal, pingpong, mods, persistent=persistent, block_m=block_m)


# With ALiBi / softcap / dropout (heavy_mods, see FWD_TILES_MODS): the plain tiles spilled 28 bytes (dropout
# alone, d128) to 200 bytes (every modifier, d128).
FWD_SM90_TILES_MODS = {
    32: (128, 32, 2),
    64: (128, 32, 2),
    96: (128, 64, 1),
    128: (128, 64, 1),  # 237 registers
    192: (128, 32, 1),
    256: (128, 32, 1),
}


def fwd_sm90_config(head_dim: int, dtype: str, causal: bool, mods: int = 0) -> FwdSm90Config:
    bm, bn, ctas = (FWD_SM90_TILES_MODS if heavy_mods(mods) else FWD_SM90_TILES)[head_dim]
    return FwdSm90Config(head_dim, bm, bn, ctas, dtype, causal, mods=mods)


def forward_kernel_config(head_dim: int, dtype: str, causal: bool, arch: str = DEFAULT_ARCH,
                          kernels: str | None = None, mods: int = 0, seqlen_k: int | None = None):
    """The forward config the library launches on `arch` (the registry's choice, `select`)."""
    return select("forward", head_dim, dtype, causal, arch, mods=mods, kernels=kernels, seqlen_k=seqlen_k)


@dataclass(frozen=True)
class BwdConfig:
    """Main backward instantiation: `bwd_kernel<BwdTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, D_SPLIT, T>,
    IS_CAUSAL, IS_DETERMINISTIC>`: K/V-outer, one CTA per BLOCK_N keys, query blocks of BLOCK_M rows."""

    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    d_split: int  # warps sharing one 16-key group, each with HEAD_DIM / d_split columns of dK and dV
    dtype: str
    causal: bool
    deterministic: bool
    mods: int = 0  # score modifiers (MOD_* bits)

    def __post_init__(self):
        check_mods(self.mods, self.causal)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: {DTYPES}")
        if self.block_n != 16 * self.num_warps // self.d_split:
            raise ValueError(f"block_n={self.block_n} must be 16 * num_warps / d_split")

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def smem_bytes(self) -> int:
        q = self.block_m * self.head_dim * ELEM_BYTES
        kv = self.block_n * self.head_dim * ELEM_BYTES
        ds = self.block_n * self.block_m * ELEM_BYTES
        # K, V, 2 stages of (Q, dO), dS^T, 2 stages of (lse_log2, delta) in fp32
        return 2 * kv + 4 * q + ds + 4 * self.block_m * 4

    def cpp_name(self) -> str:
        t = _cpp_type(self.dtype)
        b = _cpp_bool
        return (f"cuflash::bwd_kernel<cuflash::BwdTraits<{self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.num_warps}, {self.d_split}, {t}>, {b(self.causal)}, {b(self.deterministic)}, {self.mods}>")

    def grid(self, batch: int, heads: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_k / self.block_n), heads, batch)


@dataclass(frozen=True)
class DqConfig:
    """Deterministic dQ instantiation: `bwd_dq_kernel<DqTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, T>, IS_CAUSAL>`
    (Q-outer, like the forward: recomputes S, P, dP, dS per key tile, dQ in registers)."""

    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    dtype: str
    causal: bool
    mods: int = 0  # score modifiers (MOD_* bits)

    def __post_init__(self):
        check_mods(self.mods, self.causal)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def smem_bytes(self) -> int:
        return 2 * self.block_m * self.head_dim * ELEM_BYTES + 4 * self.block_n * self.head_dim * ELEM_BYTES

    def cpp_name(self) -> str:
        t = _cpp_type(self.dtype)
        return (f"cuflash::bwd_dq_kernel<cuflash::DqTraits<{self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.num_warps}, {t}>, {_cpp_bool(self.causal)}, {self.mods}>")

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.block_m), heads, batch)


@dataclass(frozen=True)
class ElementwiseConfig:
    """The backward's preprocess (delta, lse_log2, dQ_acc = 0) and dQ conversion kernels."""

    kind: str  # "preprocess" | "convert_dq" | "convert_dq_ws" (dQ_acc of bwd_sm90_ws_kernel and
    # bwd_sm90_split_kernel, in their accumulator order, per head_dim)
    dtype: str
    threads: int = 256
    smem_bytes: int = 0
    rows_per_cta: int = 32  # preprocess: eight lanes per query row (PREPROCESS_ROWS in bwd.cuh)
    head_dim: int = 0  # convert_dq_ws: the main kernel's head dim (its dQ_acc order)
    block_m: int = 64  # convert_dq_ws: the main kernel's query rows per step (128: dQ split by rows)

    def cpp_name(self) -> str:
        if self.kind == "convert_dq_ws":
            t = _cpp_type(self.dtype)
            m = "" if self.block_m == 64 else f", {self.block_m}"
            return f"cuflash::bwd_convert_dq_ws_kernel<{t}, {self.head_dim}{m}>"
        if self.dtype in WIDE_DTYPES:
            t = "double, double" if self.dtype == "fp64" else "float, float"
            return f"cuflash::bwd_wide_{self.kind}_kernel<{t}>"
        t = _cpp_type(self.dtype)
        return f"cuflash::bwd_{self.kind}_kernel<{t}>"


# Backward tiles per kernel head dim: (block_m, block_n, num_warps, d_split). One m16 key tile per
# warp group keeps dK + dV (2 * 16 * HEAD_DIM / d_split fp32 per warp) plus S^T and dP^T in registers.
# Every entry is the largest spill-free choice found by compiling the candidates (sm_90a, ptxas -v):
# e.g. HEAD_DIM 128 with (64, 128, 8, 1) spilled 72 bytes; d_split > 1 costs duplicated S^T/dP^T work.
BWD_TILES = {
    32: (64, 128, 8, 1),
    64: (32, 128, 8, 1),
    96: (64, 64, 8, 2),
    128: (32, 128, 8, 1),  # H100 bf16 N=16k: 246 TFLOP/s vs 160 for (64, 64, 8, 2) (duplicated S^T, dP^T)
    192: (32, 32, 8, 4),
    256: (32, 32, 8, 4),
}
# Deterministic dQ tiles: (block_m, block_n, num_warps).
DQ_TILES = {
    32: (128, 32, 8),  # (128, 64, 8) came out at 128 registers with an 8-byte spill once the kernel took MODS
    # (the plain path's arithmetic is unchanged; ptxas allocated differently)
    64: (128, 64, 8),
    96: (128, 64, 8),
    128: (128, 32, 8),
    192: (64, 32, 4),
    256: (32, 16, 2),  # block_n 32 spilled 4-28 bytes once varlen and GQA took a few registers (255 in use);
    # (64, 16, 4) spilled 8 bytes non-causal once the kernel took MODS
}
SEQLEN_Q_PAD = 128  # fp32 backward buffers are padded to a multiple of this (>= every block_m but the TF32 dQ
# kernel's 192-row blocks, which read no lse_log2 or delta past their rows)


# With ALiBi / softcap / dropout (heavy_mods): see FWD_TILES_MODS. The plain tiles spilled 20-164 bytes at
# head dims 96, 128 and 192 with every modifier on; smaller key groups (d_split) leave the registers.
BWD_TILES_MODS = {**BWD_TILES,
                  96: (32, 32, 4, 2),   # 217-230 registers; (32, 64, 4, 1) spilled 8 bytes causal with bias and mask
                  128: (32, 64, 8, 2)}  # 204-207 registers
# (192 keeps its plain tiles: 227-236 registers with every modifier; (32, 16, 4, 4) spilled 8 bytes causal
# deterministic once bias and mask were modifiers, NVRTC 13.5)
DQ_TILES_MODS = {**DQ_TILES,
                 32: (128, 16, 8)}  # 124 registers; (128, 32, 8) spilled 32 bytes at 128 with bias and mask


# sm_80-sm_89 (ptxas allocates differently for them): with every modifier the sm_90a tiles spilled 4-8 bytes at
# head dims 32 and 256 (NVRTC 13.5); these are spill-free there. The sm_90a builds keep BWD_TILES_MODS.
BWD_TILES_MODS_PRE_SM90 = {**BWD_TILES_MODS,
                           32: (64, 64, 8, 2),    # 248-255 registers
                           256: (32, 16, 4, 4)}   # 240-252 registers


def bwd_config(head_dim: int, dtype: str, causal: bool, deterministic: bool, mods: int = 0,
               arch: str = DEFAULT_ARCH) -> BwdConfig:
    if heavy_mods(mods):
        table = BWD_TILES_MODS if arch.startswith("sm_9") else BWD_TILES_MODS_PRE_SM90
    else:
        table = BWD_TILES
    bm, bn, warps, split = table[head_dim]
    return BwdConfig(head_dim, bm, bn, warps, split, dtype, causal, deterministic, mods)


def dq_supported(head_dim: int, mods: int, arch: str = DEFAULT_ARCH) -> bool:
    """Whether the deterministic dQ kernel exists for these modifiers on `arch`: not at kernel head dim 256 with a
    window and a bias or mask on sm_80-sm_89 (16-28 bytes of spill with any tile; the sm_90a build fits)."""
    return arch.startswith("sm_9") or not (head_dim == 256 and mods & MOD_WINDOW and mods & (MOD_BIAS | MOD_MASK))


def dq_config(head_dim: int, dtype: str, causal: bool, mods: int = 0) -> DqConfig:
    bm, bn, warps = (DQ_TILES_MODS if heavy_mods(mods) else DQ_TILES)[head_dim]
    return DqConfig(head_dim, bm, bn, warps, dtype, causal, mods)


def all_bwd_configs(arch: str = DEFAULT_ARCH) -> list:
    """Every backward instantiation the library can launch on `arch` (main, deterministic dQ,
    elementwise; for sm_90a also the wgmma main kernels and the float32 ones with their dQ kernels)."""
    out: list = []
    for dt in DTYPES:
        out += [ElementwiseConfig("preprocess", dt), ElementwiseConfig("convert_dq", dt)]
        if arch == "sm_90a":
            out += [ElementwiseConfig("convert_dq_ws", dt, head_dim=hd)
                    for hd in BWD_SM90_WS_HEAD_DIMS + BWD_SM90_SPLIT_HEAD_DIMS]
            out += [ElementwiseConfig("convert_dq_ws", dt, head_dim=hd, block_m=bm)
                    for hd, bm in BWD_SM90_WS_BLOCK_M.items() if bm != 64]
        for hd in KERNEL_HEAD_DIMS:
            for c in (False, True):
                for m in (0, *MODS_CHECKED[c]):
                    out += [bwd_config(hd, dt, c, False, m, arch), bwd_config(hd, dt, c, True, m, arch)]
                    if dq_supported(hd, m, arch):
                        out.append(dq_config(hd, dt, c, m))
                    if arch == "sm_90a" and hd in bwd_sm90_ws_head_dims(m) and hd not in BWD_SM90_WS_PADDED:
                        out += [bwd_sm90_ws_config(hd, dt, c, False, m), bwd_sm90_ws_config(hd, dt, c, True, m)]
                    elif arch == "sm_90a" and hd in bwd_sm90_tiles(m):
                        out += [bwd_sm90_config(hd, dt, c, False, m), bwd_sm90_config(hd, dt, c, True, m)]
                if arch == "sm_90a" and hd in BWD_SM90_WS_HEAD_DIMS:
                    out += [bwd_sm90_ws_config(hd, dt, c, False, m) for m in MODS_BLOCKS_CHECKED[c]]
                if arch == "sm_90a":  # BWD_SM90_WS_EXACT_MODS, each with and without the window
                    out += [bwd_sm90_ws_config(hd, dt, c, det, h | w) for h in BWD_SM90_WS_EXACT_MODS.get(hd, ())
                            for w in ((0,) if c or h in BWD_SM90_WS_EXACT_ALONE.get(hd, ()) else (0, MOD_WINDOW))
                            for det in (False, True)]
    if arch == "sm_90a":  # the wide-head backward: each dtype, plain, causal, windowed, the modifier sets above;
        # atomic and deterministic dQ
        out += [BwdSm90SplitConfig(hd, dt, c, det, m) for dt in DTYPES for hd in BWD_SM90_SPLIT_HEAD_DIMS
                for c, m in ((False, 0), (True, 0), (False, MOD_WINDOW),
                             *((c, m) for c in (False, True) for m in BWD_SM90_SPLIT_MODS_CHECKED[c]))
                for det in (False, True)]
    if arch == "sm_90a":  # the float32 backward's two kernels (dK / dV, dQ)
        for dt in BWD_SM90_TF32_TILES:
            for hd in BWD_SM90_TF32_TILES[dt]:
                for c, w in ((False, False), (True, False), (False, True)):
                    for bias, alibi_mask in itertools.product((False, True), repeat=2):
                        m = bwd_sm90_tf32_config(hd, dt, c, w, bias, alibi_mask=alibi_mask)
                        out += [m, m.dq_config()]
    out += [c for c in all_wide_configs(arch) if not isinstance(c, FwdWideConfig)]
    return out


@dataclass(frozen=True)
class BwdSm90Config:
    """Hopper backward main kernel: `bwd_sm90_kernel<BwdSm90Traits<HEAD_DIM, BLOCK_M, BLOCK_N, CTAS_PER_SM, T>,
    IS_CAUSAL, IS_DETERMINISTIC>`: K/V-outer, one warpgroup per 64 keys, query blocks of BLOCK_M = 64."""

    head_dim: int
    block_m: int
    block_n: int
    ctas_per_sm: int
    dtype: str
    causal: bool
    deterministic: bool
    mods: int = 0  # score modifiers (MOD_* bits)

    block_ms = (64,)  # query rows per step the kernel takes (BwdSm90WsConfig: 64 or 128)

    def __post_init__(self):
        check_mods(self.mods, self.causal)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: {DTYPES}")
        if self.block_m not in self.block_ms or self.block_n not in (64, 128):
            raise ValueError(f"(block_m, block_n)=({self.block_m}, {self.block_n}); the kernel takes block_m "
                             f"{' or '.join(map(str, self.block_ms))}, block_n 64 or 128")

    @property
    def num_warps(self) -> int:
        return self.block_n // 16

    @property
    def threads(self) -> int:
        return 2 * self.block_n

    @property
    def dq_cols(self) -> int:
        """dQ columns per warpgroup (BwdSm90Traits::DQ_COLS): the head dim split across the warpgroups, or at
        block_m 128 (DQ_BY_ROWS: the warpgroups split the rows) all of it."""
        return self.head_dim if self.block_m == 128 else self.head_dim // (self.block_n // 64)

    @property
    def panel_cols(self) -> int:
        """Panel width of the K, V, Q, dO tiles (BwdSm90Traits::PANEL_COLS): dQ's column split must fall
        on a panel boundary."""
        return 64 if self.dq_cols % 64 == 0 else 32

    @property
    def smem_bytes(self) -> int:
        q = self.block_m * self.head_dim * ELEM_BYTES
        kv = self.block_n * self.head_dim * ELEM_BYTES
        ds = self.block_n * self.block_m * ELEM_BYTES
        # K, V, 2 stages of (Q, dO), dS^T, 2 stages of (lse_log2, delta), + 1024 to align the base
        return 2 * kv + 4 * q + ds + 4 * self.block_m * 4 + 1024

    def cpp_name(self) -> str:
        t = _cpp_type(self.dtype)
        b = _cpp_bool
        return (f"cuflash::bwd_sm90_kernel<cuflash::BwdSm90Traits<{self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.ctas_per_sm}, {t}>, {b(self.causal)}, {b(self.deterministic)}, {self.mods}>")

    def grid(self, batch: int, heads: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_k / self.block_n), heads, batch)


# Hopper backward tiles per kernel head dim: (block_m, block_n, ctas_per_sm). Other head dims run the
# mma.sync backward (dK + dV of 64 keys x 192 or 256 columns do not fit a warpgroup's registers).
BWD_SM90_TILES = {
    64: (64, 128, 1),
    128: (64, 128, 1),
}


# With ALiBi / softcap / dropout (heavy_mods): head dim 128 spilled 12-40 bytes (dK + dV of 64 keys hold 128 of
# the 255 registers), so it runs the mma.sync backward (BWD_TILES_MODS) instead.
BWD_SM90_TILES_MODS = {64: BWD_SM90_TILES[64]}


def bwd_sm90_tiles(mods: int = 0) -> dict:
    return BWD_SM90_TILES_MODS if heavy_mods(mods) else BWD_SM90_TILES


def bwd_sm90_config(head_dim: int, dtype: str, causal: bool, deterministic: bool, mods: int = 0) -> BwdSm90Config:
    bm, bn, ctas = bwd_sm90_tiles(mods)[head_dim]
    return BwdSm90Config(head_dim, bm, bn, ctas, dtype, causal, deterministic, mods)


# --- Hopper (sm_90a): the wide-head backward (cuda/bwd_sm90_split.cuh) ---------------------------------------

@dataclass(frozen=True)
class BwdSm90SplitConfig:
    """Hopper backward main kernel at head dims 192 and 256:
    `bwd_sm90_split_kernel<BwdSm90SplitTraits<HEAD_DIM, T>, IS_CAUSAL, IS_DETERMINISTIC, MODS>`: K/V-outer CTAs of
    64 keys and two warpgroups, each keeping dK and dV of one half of the head dim; query blocks of 64, loaded by TMA
    (the argument is _tma.BwdWsParams: Q, dO, K, V tensor maps of box_cols-wide boxes, then BwdParams). Score
    modifiers: window, ALiBi, soft-capping, dropout (BWD_SM90_SPLIT_MODS; a bias or mask runs the mma.sync
    backward). dQ added into dQ_acc from the accumulator registers (red.global.add.v4.f32) in the accumulator order
    of `bwd_sm90_ws_kernel`, converted by `bwd_convert_dq_ws_kernel` (convert_dq_config)."""

    head_dim: int
    dtype: str
    causal: bool
    deterministic: bool
    mods: int = 0  # within BWD_SM90_SPLIT_MODS
    block_m: int = 64
    block_n: int = 64
    ctas_per_sm: int = 1
    # deterministic: dQ added by this kernel in a fixed order of key blocks (turn counters, ordered_dq) rather than by
    # bwd_dq_kernel after it; None: where deterministic at the head dims of BWD_SM90_SPLIT_ORDERED
    ordered: bool | None = None

    def __post_init__(self):
        if self.ordered is None:
            object.__setattr__(self, "ordered", self.deterministic and self.head_dim in BWD_SM90_SPLIT_ORDERED)
        if self.ordered and not self.deterministic:
            raise ValueError("ordered=True needs deterministic=True (the ordered dQ adds are the deterministic mode's)")
        check_mods(self.mods, self.causal)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: {DTYPES}")
        if self.head_dim not in BWD_SM90_SPLIT_HEAD_DIMS:
            raise ValueError(f"head_dim={self.head_dim}; bwd_sm90_split_kernel takes {BWD_SM90_SPLIT_HEAD_DIMS}")
        if self.mods & ~BWD_SM90_SPLIT_MODS:
            raise ValueError(f"mods={self.mods}; bwd_sm90_split_kernel takes the window, ALiBi, soft-capping and "
                             f"dropout (mods within {BWD_SM90_SPLIT_MODS}), no bias, mask or block map")
        if (self.block_m, self.block_n, self.ctas_per_sm) != (64, 64, 1):
            raise ValueError(f"(block_m, block_n, ctas_per_sm)=({self.block_m}, {self.block_n}, {self.ctas_per_sm}); "
                             f"bwd_sm90_split_kernel takes (64, 64, 1)")

    @property
    def num_warps(self) -> int:
        return 8

    @property
    def threads(self) -> int:
        return 256

    @property
    def smem_bytes(self) -> int:
        q = self.block_m * self.head_dim * ELEM_BYTES
        kv = self.block_n * self.head_dim * ELEM_BYTES
        ds = self.block_n * self.block_m * ELEM_BYTES
        # K, V, 2 stages of (Q, dO), P^T, 2 dS^T buffers (the step's and the last step's, whose dQ the step computes),
        # 2 stages of (lse_log2, delta), dropout's keep bits (a word per thread of warpgroup 0), the deterministic
        # mode's counter word (16 bytes), three mbarriers (kv_full, q_full[2]), + 1024 to align the base
        return 2 * kv + 4 * q + 3 * ds + 4 * self.block_m * 4 + 128 * 4 + 16 + 3 * 8 + 1024

    @property
    def dq_chunk(self) -> int:
        """dQ columns per GEMM of a warpgroup (BwdSm90SplitTraits::DQ_CHUNK): its whole half up to 96 columns, else
        64 (a half's 64 accumulators beside dK and dV spilled); each chunk reads the whole dS^T tile."""
        half = self.head_dim // 2
        return half if half <= 96 else 64

    @property
    def box_cols(self) -> int:
        """TMA box width in elements (BwdSm90SplitTraits::PANEL_COLS): whole panels per warpgroup half, 64 columns
        with a 128-byte swizzle at head dim 256, 32 with a 64-byte one at 192."""
        return panel_cols(self.head_dim // 2)

    def cpp_name(self) -> str:
        t = _cpp_type(self.dtype)
        b = _cpp_bool
        return (f"cuflash::bwd_sm90_split_kernel<cuflash::BwdSm90SplitTraits<{self.head_dim}, {t}>, {b(self.causal)}, "
                f"{b(self.deterministic)}, {self.mods}" + (", true>" if self.ordered else ">"))

    def grid(self, batch: int, heads: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_k / self.block_n), heads, batch)


BWD_SM90_SPLIT_HEAD_DIMS = (192, 256)
# The head dims where the deterministic wide-head backward adds dQ itself in turns (BwdSm90SplitConfig.ordered)
# instead of leaving it to bwd_dq_kernel. Measured on an H200 (2026-12-02, bf16 FA shapes, N 1k / 4k / 16k, TFLOP/s,
# the default mode's beside): D 256 in turns 188 / 232 / 251 (causal 179 / 223 / 238) against 168 / 178 / 182 (142 /
# 165 / 180) with bwd_dq_kernel, 0.72-0.85x the default mode against 0.58-0.68x; D 192 167 / 208 / 222 (161 / 201 /
# 215) against 195 / 211 / 217 (162 / 199 / 224): no better, so it keeps bwd_dq_kernel.
BWD_SM90_SPLIT_ORDERED = (256,)
BWD_SM90_SPLIT_MODS = MOD_WINDOW | MOD_ALIBI | MOD_SOFTCAP | MOD_DROPOUT
# The modifier sets of its kernels that the compile check builds beyond plain, causal and windowed: all of them
# (non-causal with the window), the register-heaviest (as MODS_CHECKED). Every combination compiled spill-free at
# head dims 192 and 256 under NVRTC 13.0 and 13.5 (2026-11-27, bf16; fp16 the heaviest): 186-251 registers.
BWD_SM90_SPLIT_MODS_CHECKED = {False: (BWD_SM90_SPLIT_MODS,), True: (BWD_SM90_SPLIT_MODS & ~MOD_WINDOW,)}


def bwd_sm90_split_head_dims(mods: int = 0) -> tuple:
    return BWD_SM90_SPLIT_HEAD_DIMS if not mods & ~BWD_SM90_SPLIT_MODS else ()


# --- Hopper (sm_90a): the warp-specialized backward (cuda/bwd_sm90_ws.cuh) ----------------------------------

@dataclass(frozen=True)
class BwdSm90WsConfig(BwdSm90Config):
    """One warp-specialized Hopper backward instantiation:
    `bwd_sm90_ws_kernel<BwdSm90WsTraits<HEAD_DIM, T, BLOCK_M>, IS_CAUSAL, IS_DETERMINISTIC, MODS>`: bwd_sm90_kernel's
    tiles (block_n 128: two consumer warpgroups of 64 keys; steps of block_m 64 queries, or 128 at head dims 32 and
    64 plain, causal, windowed or with a mask alone, and at head dim 32 with a staged bias: bwd_sm90_ws_block_m) and
    math, plus a TMA
    producer warpgroup (384 threads, 1 CTA per SM); dQ by bulk reductions into dQ_acc in the consumers' accumulator
    order, converted by `bwd_convert_dq_ws_kernel` (convert_dq_config); deterministic, the same reductions in a fixed
    order of key blocks per query block (ordered_dq: a counter per 64 rows of dQ_acc, bwd_sm90_ws_dq_writer). The
    analyzer walks it on its own (simulator/banks.py bwd_sm90_ws_kernel_shared); its global traffic is
    bwd_sm90_kernel's."""

    block_ms = (64, 128)

    def __post_init__(self):
        super().__post_init__()
        if self.head_dim not in BWD_SM90_WS_HEAD_DIMS or (self.block_n, self.ctas_per_sm) != (128, 1):
            raise ValueError(f"bwd_sm90_ws_kernel takes head_dim 32, 64 or 128 with (block_m, block_n, ctas_per_sm) = "
                             f"(64 or 128, 128, 1); got head_dim={self.head_dim}, ({self.block_m}, {self.block_n}, "
                             f"{self.ctas_per_sm})")
        takes = bwd_sm90_ws_mods_128(self.head_dim, self.mods)
        if self.block_m == 128 and (self.head_dim > 64 or self.mods & ~takes):
            raise ValueError(f"block_m=128 takes head_dim 32 or 64 and the modifiers in {takes:#x} "
                             f"(BwdSm90WsTraits::takes_mods); got head_dim={self.head_dim}, mods={self.mods:#x}")

    stages = 2  # of (Q, dO, lse_log2, delta)

    @property
    def box_cols(self) -> int:
        """TMA box width in elements: one swizzle panel of the tiles (panel_cols)."""
        return self.panel_cols

    def sync_equivalent(self) -> BwdSm90Config:
        """bwd_sm90_kernel's config with the same tiles (the synchronous kernel this one is measured against)."""
        return BwdSm90Config(self.head_dim, self.block_m, self.block_n, self.ctas_per_sm, self.dtype, self.causal,
                             self.deterministic, self.mods)

    @property
    def threads(self) -> int:
        return 384

    @property
    def smem_bytes(self) -> int:
        """BwdSm90WsTraits::smem_bytes (the kernel traps if it is given less): K, V, 2 stages of (Q, dO), 2 dS^T
        buffers, the fp32 dQ block, 2 stages of (lse_log2, delta), 7 mbarriers, the deterministic dQ writer's 32-byte
        setup (then, when a bias is staged, two buffers of 8 warps x block_m rows x 32 bytes of it from the next
        128-byte boundary), 1024 to align the base."""
        q = self.block_m * self.head_dim * ELEM_BYTES
        kv = self.block_n * self.head_dim * ELEM_BYTES
        ds = self.block_n * self.block_m * ELEM_BYTES
        end = 2 * kv + 4 * q + 2 * ds + self.block_m * self.head_dim * 4 + 4 * self.block_m * 4 + 8 * 7 + 32
        if bwd_stages_bias(self.head_dim, self.mods, self.causal):  # two buffers: copies issued a step ahead
            end = -(-end // 128) * 128 + 2 * 8 * self.block_m * 32
        return end + 1024

    def cpp_name(self) -> str:
        t = _cpp_type(self.dtype)
        b = _cpp_bool
        m = "" if self.block_m == 64 else f", {self.block_m}"
        return (f"cuflash::bwd_sm90_ws_kernel<cuflash::BwdSm90WsTraits<{self.head_dim}, {t}{m}>, {b(self.causal)}, "
                f"{b(self.deterministic)}, {self.mods}>")


def bwd_stages_bias(head_dim: int, mods: int, causal: bool = False) -> bool:
    """Whether the warp-specialized backward kernel of these modifiers stages a 16-bit bias in shared memory
    (BwdSm90WsTraits::stage_bias): at head dims 32 and 64 without ALiBi, soft-capping or dropout beside the bias, at
    head dim 128 for a bias alone, not causal (beside a window or a mask its registers spilled 12-48 bytes, causal 4
    bytes under NVRTC 13.0). In steps of block_m rows: 64, or 128 at head dim 32 (bwd_sm90_ws_block_m)."""
    if head_dim > 64:
        return head_dim == 128 and mods == MOD_BIAS and not causal
    return bool(mods & MOD_BIAS) and not mods & (MOD_ALIBI | MOD_SOFTCAP | MOD_DROPOUT)


def bwd_ws_dq_one_wg(cfg) -> bool:
    """Whether warp-specialized backward config `cfg` computes a step's dQ in one consumer warpgroup (one m64n128
    wgmma chain, the other consumer going on to the next step) rather than half in each: head dim 128 in 64-query
    steps, not deterministic, and not causal with a bias and a mask together (there the hand-off made ptxas spill).
    Mirrors BwdSm90WsTraits::dq_one_wg (cuda/bwd_sm90_ws.cuh)."""
    return (isinstance(cfg, BwdSm90WsConfig) and cfg.head_dim == 128 and cfg.block_m == 64 and not cfg.deterministic
            and not (cfg.causal and cfg.mods & MOD_BIAS and cfg.mods & MOD_MASK))


def ordered_dq(main) -> bool:
    """Whether backward main kernel `main` (a config) is deterministic and adds dQ to dQ_acc itself, in a fixed order
    counted in turns (the warp-specialized kernel's bwd_sm90_ws_dq_writer; the float32 / float64 bwd_wide_kernel's
    and the wide-head bwd_sm90_split_kernel's ORDERED adds), so that no bwd_dq_kernel runs after it. For the
    warp-specialized kernel mirrors BwdSm90WsTraits::ordered_dq: not with a bias or dropout, nor with a mask at head
    dim 128 (their instantiations spilled with the dQ writer)."""
    if isinstance(main, BwdWideConfig):
        return main.deterministic
    if isinstance(main, BwdSm90SplitConfig):
        return main.ordered
    return (isinstance(main, BwdSm90WsConfig) and main.deterministic and not main.mods & (MOD_BIAS | MOD_DROPOUT)
            and not (main.head_dim >= 128 and main.mods & MOD_MASK))


def turn_rows(main) -> int:
    """Rows of dQ_acc per int32 turn counter of an ordered backward (ordered_dq): one per 64-row block of the
    warp-specialized kernel's reductions, one per WIDE_TURN_ROWS rows (a query block starts on its own) in the wide
    kernel."""
    return WIDE_TURN_ROWS if isinstance(main, BwdWideConfig) else 64


def convert_dq_config(main, dtype: str) -> "ElementwiseConfig":
    """The dQ conversion kernel that reads the dQ_acc of backward main kernel `main` (a config): the ws and split
    kernels write it in their accumulator order (bwd_convert_dq_ws_kernel), the others row-major."""
    if isinstance(main, (BwdSm90WsConfig, BwdSm90SplitConfig)):
        return ElementwiseConfig("convert_dq_ws", dtype, head_dim=main.head_dim, block_m=main.block_m)
    return ElementwiseConfig("convert_dq", dtype)


# Kernel head dims and score modifiers of the warp-specialized backward. Head dims 32 and 64 take every modifier
# (head dim 32's tiles are single 32-column panels; its two consumers split dQ's 32 columns 16 and 16). At head
# dim 128 dK and dV hold 128 of a consumer's 240 registers: it takes the heavy modifier sets below (each with or
# without the light ones), which compile spill-free for fp16 and bf16, causal or not, deterministic or not, under
# NVRTC 13.0 and 13.5 (with dropout or a bias, bwd_sm90_dkdv_step waits for dV before dS^T; soft-capping parks
# its second P^T copy in shared memory instead; a mask without a bias reads its 32 bits per thread into one register
# before the step's S^T is waited for, and a deterministic call with a mask takes its dQ from bwd_dq_kernel). The
# others run the mma.sync backward: a mask beside both ALiBi and soft-capping spilled 8-16 bytes, dropout beside
# ALiBi, soft-capping or a mask, or any of the three beside a bias, 8-320 bytes.
BWD_SM90_WS_HEAD_DIMS = (32, 64, 128)
BWD_SM90_WS_MODS_128 = (MOD_ALIBI, MOD_SOFTCAP, MOD_ALIBI | MOD_SOFTCAP, MOD_DROPOUT, MOD_BIAS, MOD_BIAS | MOD_MASK,
                        MOD_MASK, MOD_ALIBI | MOD_MASK, MOD_SOFTCAP | MOD_MASK)
BWD_SM90_WS_MODS_128_ALONE = ()  # sets taken without a window beside them only (none today)
# Heavy modifier sets whose warp-specialized backward kernels the compile check builds (and the sanitizer cases
# launch) each as they are, with and without the window, beside the heaviest set: head dim 128's (at the register
# limit) and head dims 32 and 64's staged-bias kernels (bwd_stages_bias: a code path the heaviest set does not take).
BWD_SM90_WS_EXACT_MODS = {32: (MOD_BIAS, MOD_BIAS | MOD_MASK), 64: (MOD_BIAS, MOD_BIAS | MOD_MASK),
                          128: BWD_SM90_WS_MODS_128 + BWD_SM90_WS_MODS_128_ALONE}
# ... of which these are built (and launched) without the window only
BWD_SM90_WS_EXACT_ALONE = {128: BWD_SM90_WS_MODS_128_ALONE}


# Kernel head dims that run the warp-specialized backward of the next head dim (where that one takes the modifiers):
# the TMA boxes of the columns past head_dim read zeros (the maps' rows end at head_dim), so S^T, dP^T, dK, dV and
# dQ get zeros there, and the stores stop at head_dim. Measured on an H100 (bf16, FlashAttention benchmark shapes,
# tools/bench_bwd_families.py, N 1k-16k, 2026-11-28): D 96 on the 128 kernel 308-413 TFLOP/s against 139-156 for
# the mma.sync backward (causal 219-396 against 116-154), with a (batch, heads, N, N) bias 59-97 against 46-60.
BWD_SM90_WS_PADDED = {96: 128}


def bwd_sm90_ws_head_dims(mods: int = 0) -> tuple:
    heavy = mods & ~MODS_LIGHT
    dims = (BWD_SM90_WS_HEAD_DIMS if not heavy or heavy in BWD_SM90_WS_MODS_128 or mods in BWD_SM90_WS_MODS_128_ALONE
            else (32, 64))
    return dims + tuple(hd for hd, to in BWD_SM90_WS_PADDED.items() if to in dims)


# Query rows per step of the warp-specialized backward (BwdSm90WsTraits' BLOCK_M) per kernel head dim, for the
# modifiers in BWD_SM90_WS_BLOCK_M_MODS; the others take 64. At 128 each consumer's S^T and dP^T are 64 keys x 128
# queries (128 accumulator registers) and K and V are read once per 128 queries. A mask alone or a BlockMask's map
# alone takes them too (the mask's bits a word per 64 queries; the tile maps, a key padding mask's included, built
# at 128-row tiles). Dropout's keep bits hold 64 queries (BwdSm90WsTraits::takes_mods); with 128-query steps
# soft-capping spilled 32 bytes, ALiBi with a window 4 and ALiBi with soft-capping 120 (NVRTC 13.5, head dim 64).
BWD_SM90_WS_BLOCK_M = {32: 128, 64: 128}
BWD_SM90_WS_BLOCK_M_MODS = MOD_WINDOW | MOD_MASK | MOD_BLOCKS
# With a bias, the modifiers of 128-query steps per kernel head dim: at head dim 32 the staged bias (bwd_stages_bias)
# of 128-row steps, two buffers of 64 KB, fits beside the tiles (195 KB of shared memory), with a mask, a window or
# both beside it (the element mask read as in 64-query steps, a BlockMask's tile map built at 128-row tiles); at
# head dim 64 the buffers would not fit (259 KB).
BWD_SM90_WS_BLOCK_M_BIAS = {32: MOD_BIAS | MOD_MASK | MOD_WINDOW}


def bwd_sm90_ws_mods_128(head_dim: int, mods: int = 0) -> int:
    """The modifier bits that 128-query steps of kernel head dim `head_dim` take where `mods` are called for
    (BWD_SM90_WS_BLOCK_M_BIAS with a bias, else BWD_SM90_WS_BLOCK_M_MODS)."""
    return BWD_SM90_WS_BLOCK_M_BIAS.get(head_dim, 0) if mods & MOD_BIAS else BWD_SM90_WS_BLOCK_M_MODS


def bwd_sm90_ws_block_m(head_dim: int, mods: int = 0) -> int:
    """BwdSm90WsConfig.block_m of kernel head dim `head_dim` with these modifiers."""
    return 64 if mods & ~bwd_sm90_ws_mods_128(head_dim, mods) else BWD_SM90_WS_BLOCK_M.get(head_dim, 64)


def bwd_sm90_ws_config(head_dim: int, dtype: str, causal: bool, deterministic: bool, mods: int = 0) -> BwdSm90WsConfig:
    """The warp-specialized backward of kernel head dim `head_dim` (a padded one, BWD_SM90_WS_PADDED, runs the
    kernel of the next)."""
    hd = BWD_SM90_WS_PADDED.get(head_dim, head_dim)
    return BwdSm90WsConfig(hd, bwd_sm90_ws_block_m(hd, mods), 128, 1, dtype, causal, deterministic, mods)


def backward_kernel_config(head_dim: int, dtype: str, causal: bool, deterministic: bool,
                           arch: str = DEFAULT_ARCH, kernels: str | None = None, mods: int = 0):
    """The backward main-kernel config the library launches on `arch` (the registry's choice, `select`)."""
    return select("backward", head_dim, dtype, causal, arch, mods=mods, deterministic=deterministic, kernels=kernels)


# --- float32 and float64: the wide kernels (cuda/wide.cuh) --------------------------------------------------
#
# "fp32": float32 inputs in 3xTF32 split arithmetic (float32 accuracy); "tf32": float32 inputs, one TF32 pass;
# "fp64": float64 inputs on the FP64 tensor cores. mma.sync kernels for every target (sm_80+). Their shared tiles
# are row-major with a pitch of HEAD_DIM + 4 elements (conflict-free fragment reads), so the kernel head dims are
# multiples of 32: 96 runs on the 128 kernel, 192 on the 256 one; float64 stops at 128 (its O accumulator of a
# 256-column row tile alone would need 256 registers per thread).
WIDE_DTYPES = ("fp32", "tf32", "fp64")
WIDE_MATH = {"fp32": "Tf32x3", "tf32": "Tf32", "fp64": "F64"}
WIDE_ELEM_BYTES = {"fp32": 4, "tf32": 4, "fp64": 8}
WIDE_KERNEL_HEAD_DIMS = {"fp32": (32, 64, 128, 256), "tf32": (32, 64, 128, 256), "fp64": (32, 64, 128)}
WIDE_PITCH_PAD = 4  # elements added to each shared row
WIDE_TURN_ROWS = 16  # rows of dQ_acc per turn counter of the deterministic wide backward (cuda/wide.cuh)
# The float64 kernels take the window alone of the score modifiers (their scores are float64; mods.cuh is float32).
WIDE_FP64_MODS = MOD_WINDOW


def wide_mods_supported(dtype: str, mods: int) -> bool:
    return dtype != "fp64" or not mods & ~WIDE_FP64_MODS


def _check_wide(dtype: str, mods: int, causal: bool) -> None:
    check_mods(mods, causal)
    if dtype not in WIDE_DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {WIDE_DTYPES}")
    if not wide_mods_supported(dtype, mods):
        raise ValueError(f"mods={mods}: the float64 kernels take the window alone")


@dataclass(frozen=True)
class FwdWideConfig:
    """`fwd_wide_kernel<WideFwdTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, Math>, IS_CAUSAL, MODS>` (cuda/wide.cuh)."""

    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    dtype: str
    causal: bool
    mods: int = 0
    v_split: int = 1  # CTAs per query block, each computing head_dim / v_split columns of O
    stages: int = 2  # buffers of K and V

    def __post_init__(self):
        _check_wide(self.dtype, self.mods, self.causal)
        if self.stages not in (1, 2):
            raise ValueError(f"stages={self.stages}: 1 or 2")

    threads = property(lambda self: 32 * self.num_warps)

    @property
    def smem_bytes(self) -> int:
        e = WIDE_ELEM_BYTES[self.dtype]
        row, v_row = (self.head_dim + WIDE_PITCH_PAD) * e, (self.head_dim // self.v_split + WIDE_PITCH_PAD) * e
        return self.block_m * row + self.stages * self.block_n * (row + v_row)  # Q, then the stages of K, then of V

    def cpp_name(self) -> str:
        return (f"cuflash::fwd_wide_kernel<cuflash::WideFwdTraits<{self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.num_warps}, cuflash::{WIDE_MATH[self.dtype]}, {self.v_split}, {self.stages}>, "
                f"{_cpp_bool(self.causal)}, {self.mods}>")

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / self.block_m) * self.v_split, heads, batch)


@dataclass(frozen=True)
class BwdWideConfig:
    """`bwd_wide_kernel<WideBwdTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, D_SPLIT, Math>, IS_CAUSAL, MODS[, ORDERED]>`:
    K/V-outer, dQ summed by atomics; deterministic: the same atomics in a fixed order of key blocks per query block
    (ORDERED: one turn counter per WIDE_TURN_ROWS rows of dQ_acc, cuda/wide.cuh), the key blocks launched last-first
    with causal or a window."""

    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    d_split: int
    dtype: str
    causal: bool
    mods: int = 0
    deterministic: bool = False

    def __post_init__(self):
        _check_wide(self.dtype, self.mods, self.causal)
        if self.block_m % WIDE_TURN_ROWS:
            raise ValueError(f"block_m={self.block_m} must be a multiple of {WIDE_TURN_ROWS} (a turn counter per query "
                             f"block)")
        if self.block_n != 16 * self.num_warps // self.d_split:
            raise ValueError(f"block_n={self.block_n} must be 16 * num_warps / d_split")

    threads = property(lambda self: 32 * self.num_warps)

    @property
    def smem_bytes(self) -> int:
        e = WIDE_ELEM_BYTES[self.dtype]
        acc = 8 if self.dtype == "fp64" else 4
        row = (self.head_dim + WIDE_PITCH_PAD) * e
        # K, V, 2 stages of (Q, dO), dS [query][key], 2 stages of (lse_log2, delta), with d_split > 1 every warp's
        # partial S^T / dP^T (its head-dim slice; the warps of a key group add them)
        xchg = self.num_warps * (self.block_m // 8) * 4 * 32 * acc if self.d_split > 1 else 0
        return (2 * self.block_n * row + 4 * self.block_m * row + self.block_m * (self.block_n + WIDE_PITCH_PAD) * acc
                + 4 * self.block_m * acc + xchg)

    def cpp_name(self) -> str:
        return (f"cuflash::bwd_wide_kernel<cuflash::WideBwdTraits<{self.head_dim}, {self.block_m}, {self.block_n}, "
                f"{self.num_warps}, {self.d_split}, cuflash::{WIDE_MATH[self.dtype]}>, "
                f"{_cpp_bool(self.causal)}, {self.mods}{', true' if self.deterministic else ''}>")

    def grid(self, batch: int, heads: int, seqlen_k: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_k / self.block_n), heads, batch)


# Tiles per (dtype, kernel head dim); *_MODS with ALiBi / softcap / dropout / bias / mask (float32 only). Every entry
# is spill-free under ptxas -v on sm_80 and sm_90a (`python tools/wide_tiles.py`, NVRTC 13), with the window and,
# for *_MODS, every modifier on; the largest such tile was taken (fewer K/V reads per query row, fewer dQ atomics).
# 3xTF32 holds both halves of every fragment and a second accumulator for the bounded chains (cuda/wide.cuh), so it
# takes smaller tiles than one-pass TF32 where registers bind; at head dim 256 its forward splits O's columns over
# two CTAs (the fourth entry, v_split: 128 fp32 registers of O alone spilled at every tile).
# The float64 tiles are the sm_90a ones measured on an H100 (docs/PERFORMANCE.md): the m16n8k8 DMMA of sm_90 runs
# at twice m8n8k4's rate, and 8 warps per CTA beat 4 warps there.
# Forward: (block_m, block_n, num_warps[, v_split[, stages]]). float64 at head dim 128: 32-key tiles in one stage of K
# and V (two stages of 32 keys beside 128 query rows exceed 227 KiB): a sixth fewer shared bytes per DMMA than
# 16-key tiles, and half the softmax rounds and barriers per key; 240-242 registers, spill-free; 1.07-1.12x the
# two-stage 16-key tiles on an H100 (2026-12-07).
FWD_WIDE_TILES = {
    "fp32": {32: (128, 64, 8), 64: (128, 64, 8), 128: (128, 32, 8), 256: (64, 32, 4, 2)},
    "tf32": {32: (128, 64, 8), 64: (128, 64, 8), 128: (128, 64, 8), 256: (64, 16, 4)},
    "fp64": {32: (128, 32, 8), 64: (128, 64, 8), 128: (128, 32, 8, 1, 1)},
}
FWD_WIDE_TILES_MODS = {
    "fp32": {32: (128, 64, 8), 64: (128, 64, 8), 128: (128, 16, 8), 256: (64, 8, 4, 2)},
    "tf32": {32: (128, 64, 8), 64: (128, 64, 8), 128: (128, 32, 8), 256: (64, 8, 4)},
}
# Backward: (block_m, block_n, num_warps, d_split). d_split 1 wherever it fits: a split key group computes S^T and
# dP^T twice. At head dim 128 and above the float32 dK and dV (with their chain registers) need d_split 2 and 4.
BWD_WIDE_TILES = {
    "fp32": {32: (32, 128, 8, 1), 64: (32, 128, 8, 1), 128: (32, 64, 8, 2), 256: (16, 32, 8, 4)},
    "tf32": {32: (32, 128, 8, 1), 64: (32, 128, 8, 1), 128: (32, 64, 8, 2), 256: (16, 32, 8, 4)},
    "fp64": {32: (32, 128, 8, 1), 64: (16, 128, 8, 1), 128: (16, 64, 8, 2)},
}
BWD_WIDE_TILES_MODS = {
    "fp32": {32: (32, 128, 8, 1), 64: (32, 128, 8, 1), 128: (32, 64, 8, 2), 256: (16, 32, 8, 4)},
    "tf32": {32: (32, 128, 8, 1), 64: (32, 128, 8, 1), 128: (32, 64, 8, 2), 256: (16, 32, 8, 4)},
}
# The deterministic float64 backward (ORDERED: the turn wait and its release) spilled 4-48 bytes on the tiles above at
# head dims 64 and 128 (NVRTC 13.5, sm_90a; the wait placed after the dQ GEMM, before it, or at the step's start
# alike); these halve each warp's dK / dV columns (d_split 2 and 4) and fit an A100's shared memory as well. Their
# cost, measured on an H200 (2026-11-28, FA shapes N 2k, TFLOP/s of the deterministic backward against 34.2 / 30.8
# (D 64) and 31.9 / 29.8 (D 128) for the default mode, non-causal / causal): D 64 (16, 64, 8, 2) 19.4 / 19.2,
# (32, 64, 8, 2) 23.8 / 21.9 (spill-free too, 238-252 registers: taken), and 28.3 / 26.1 on the default tile with
# its spills; D 128 (16, 32, 8, 4) 17.0 / 15.5 against 25.7 / 23.9 on the default tile with its spills. The smaller
# tiles, not the order of the adds, are most of the cost. Since its key groups split S^T by queries (2026-12-07) the
# ordered kernel at head dim 128 compiles spill-free on the default tile (248-255 registers) and takes it: on an H100
# 0.79x the default mode's TFLOP/s where (16, 32, 8, 4) ran at 0.52-0.55x (docs/PERFORMANCE.md, "The float64 backward's
# S^T in the forward's order").
BWD_WIDE_TILES_DET = {"fp64": {64: (32, 64, 8, 2), 128: (16, 64, 8, 2)}}
# (D 64 on (32, 64) needs 186 KiB of shared memory, D 128 on (16, 64) 223 KiB)
BWD_WIDE_TILES_DET_SM80 = {"fp64": {64: (16, 64, 8, 2), 128: (16, 32, 8, 4)}}
# The targets before sm_90 take these where a tile above needs more shared memory than an A100 CTA may have
# (SMEM_LIMIT_SM80): spill-free there, not measured on an A100.
FWD_WIDE_TILES_SM80 = {"tf32": {128: (128, 32, 8)}, "fp64": {64: (128, 32, 8), 128: (64, 16, 4)}}
BWD_WIDE_TILES_SM80 = {"fp64": {64: (16, 64, 4, 1), 128: (16, 32, 4, 2)}}


def fwd_wide_config(head_dim: int, dtype: str, causal: bool, mods: int = 0, arch: str = DEFAULT_ARCH) -> FwdWideConfig:
    # 3xTF32 has no register left for a window's state on the plain tiles: any modifier takes the *_MODS tiles
    table = FWD_WIDE_TILES_MODS if heavy_mods(mods) or (dtype == "fp32" and mods) else FWD_WIDE_TILES
    bm, bn, warps, *split = table[dtype][head_dim]
    cfg = FwdWideConfig(head_dim, bm, bn, warps, dtype, causal, mods, *split)
    if cfg.smem_bytes > smem_limit(arch):
        bm, bn, warps, *split = FWD_WIDE_TILES_SM80[dtype][head_dim]
        cfg = FwdWideConfig(head_dim, bm, bn, warps, dtype, causal, mods, *split)
    return cfg


def bwd_wide_config(head_dim: int, dtype: str, causal: bool, mods: int = 0, arch: str = DEFAULT_ARCH,
                    deterministic: bool = False) -> BwdWideConfig:
    table = BWD_WIDE_TILES_MODS if heavy_mods(mods) else BWD_WIDE_TILES
    if deterministic and head_dim in BWD_WIDE_TILES_DET.get(dtype, {}):
        table = BWD_WIDE_TILES_DET
    cfg = BwdWideConfig(head_dim, *table[dtype][head_dim], dtype, causal, mods, deterministic)
    if cfg.smem_bytes > smem_limit(arch):
        small = BWD_WIDE_TILES_DET_SM80 if table is BWD_WIDE_TILES_DET else BWD_WIDE_TILES_SM80
        cfg = BwdWideConfig(head_dim, *small[dtype][head_dim], dtype, causal, mods, deterministic)
    return cfg


def wide_mods_checked(dtype: str, causal: bool) -> tuple:
    """The modifier sets the compile check builds for a wide dtype (beside 0)."""
    if dtype == "fp64":
        return () if causal else (MOD_WINDOW,)
    return MODS_CHECKED[causal]


def all_wide_configs(arch: str = DEFAULT_ARCH) -> list:
    """Every float32 / float64 instantiation of a target."""
    out: list = []
    for dt in WIDE_DTYPES:
        out += [ElementwiseConfig("preprocess", dt), ElementwiseConfig("convert_dq", dt)]
        for hd in WIDE_KERNEL_HEAD_DIMS[dt]:
            for c in (False, True):
                for m in (0, *wide_mods_checked(dt, c)):
                    out += [fwd_wide_config(hd, dt, c, m, arch), bwd_wide_config(hd, dt, c, m, arch),
                            bwd_wide_config(hd, dt, c, m, arch, deterministic=True)]
    return out


def _check_tf32(cfg, head_dims: tuple, kernel: str) -> None:
    """The checks every TF32 wgmma config makes: its dtype, head dim and causal / window pair."""
    if cfg.dtype not in ("fp32", "tf32"):
        raise ValueError(f"dtype={cfg.dtype!r}; allowed: 'fp32', 'tf32'")
    if cfg.head_dim not in head_dims:
        raise ValueError(f"head_dim={cfg.head_dim} is not a head dim of the {kernel}; allowed: "
                         f"{', '.join(map(str, head_dims))}")
    if cfg.causal and cfg.window:
        raise ValueError("a window carries causal as its right edge 0: causal=True with window=True is not a kernel")


def _tf32_mods(cfg) -> int:
    """The MODS template argument of a TF32 wgmma config: its window and bias, and ALiBi with the mask. One kernel
    takes ALiBi and a mask for a call with either (cuda/mods.cuh alibi_mask_f32: no slopes, a slope of 0; no mask,
    none read), which halves the instantiations the compile check builds and the sanitizers launch."""
    return ((MOD_WINDOW if cfg.window else 0) | (MOD_BIAS if cfg.bias else 0)
            | (MOD_ALIBI | MOD_MASK if cfg.alibi_mask else 0))


def _tf32_split(head_dim: int) -> int:
    """CTAs sharing a TF32 backward block's head dim: 2 at head dim 128 (a cluster pair of 64 columns each)."""
    return 2 if head_dim == 128 else 1


def _check_smem_sm90(cfg, tiles: str) -> None:
    if cfg.smem_bytes > SMEM_LIMIT_SM90:
        raise ValueError(f"{tiles} at dtype {cfg.dtype!r} needs {cfg.smem_bytes} bytes of shared memory (the limit is "
                         f"{SMEM_LIMIT_SM90})")


class _ProducerConsumers:
    """threads of a kernel with a producer warpgroup beside `consumers` consumer warpgroups."""

    @property
    def threads(self) -> int:
        return 128 + 128 * self.consumers


class _ConsumerWarpgroups(_ProducerConsumers):
    """... whose consumers take 64 query rows each: block_m. The TF32 forward's and dQ kernel's configs (key tiles
    block_n, stages, consumers; `split` CTAs per block) check their tiles with `_check_tiles`."""

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    def _check_tiles(self) -> None:
        if self.block_n not in (16, 32, 64) or not 2 <= self.stages <= 4 or self.consumers not in (1, 2, 3):
            raise ValueError(f"block_n={self.block_n}, stages={self.stages}, consumers={self.consumers}: block_n 16, 32 "
                             f"or 64, 2-4 stages, 1-3 consumers")
        if self.consumers == 3 and self.split > 1:
            raise ValueError(f"consumers=3 at head_dim={self.head_dim} in {self.dtype!r}: a cluster pair runs two "
                             f"consumer warpgroups per CTA")


@dataclass(frozen=True)
class FwdSm90Tf32Config(_ConsumerWarpgroups):
    """One float32 Hopper forward instantiation:
    `fwd_sm90_tf32_kernel<FwdTf32Traits<HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, X3, PINGPONG>, IS_CAUSAL, MODS>`
    (cuda/fwd_sm90_tf32.cuh): TF32 wgmma, a producer warpgroup (one TMA thread, three warps splitting K and
    transposing V in shared memory) and one to three consumer warpgroups of 64 query rows (each splitting its rows of
    Q). dtype "fp32": 3xTF32 (X3), "tf32": one TF32 pass; window: a sliding window (MOD_WINDOW); bias: an additive
    bias (MOD_BIAS)."""

    head_dim: int
    block_n: int
    stages: int
    consumers: int
    dtype: str
    causal: bool
    window: bool = False
    pingpong: bool = False  # order the two consumers' GEMMs through named barriers
    bias: bool = False
    q_regs: bool = False  # Q's big part (3xTF32: 64 columns per CTA, two consumers) or rounded Q as wgmma A registers
    alibi_mask: bool = False  # ALiBi and an element mask (MOD_ALIBI | MOD_MASK), for a call with either or both

    def __post_init__(self):
        _check_tf32(self, (32, 64, 128), "TF32 forward")
        self._check_tiles()
        if self.pingpong and self.consumers != 2:
            raise ValueError("pingpong orders two consumer warpgroups: consumers=2")
        if self.q_regs and self.dtype == "fp32" and (self.head_dim // self.split != 64 or self.consumers != 2):
            raise ValueError(f"q_regs=True at dtype {self.dtype!r}, head_dim={self.head_dim}, consumers="
                             f"{self.consumers}: Q's big part in registers is 3xTF32's at head dims 64 and 128, two "
                             f"consumers")

    box_cols = 32  # TMA box width in floats: one 128-byte swizzle panel

    @property
    def split(self) -> int:
        """CTAs per query block: 3xTF32 at head dim 128 runs as clusters of two CTAs of 64 columns
        (`fwd_sm90_tf32_pair_kernel`); one TF32 pass keeps one CTA (its operands fit)."""
        return 2 if self.head_dim == 128 and self.dtype == "fp32" else 1

    @property
    def smem_bytes(self) -> int:
        """FwdTf32Traits::SMEM_BYTES: Q, the K stages (each 3xTF32 with its big part beside), the V stages, the V^T
        stages (big and small), a pair's exchange slots of S (16 bytes per consumer thread and n8 tile, per parity and
        consumer), the mbarriers, and 1024 bytes to round the base up to the swizzle period."""
        parts = 2 if self.dtype == "fp32" else 1
        cols = self.head_dim // self.split
        q, kv = 4 * self.block_m * cols, 4 * self.block_n * cols
        xchg, xbars = (2 * self.consumers * (self.block_n // 8) * 128 * 16, 2 * self.consumers) if self.split > 1 \
            else (0, 0)
        return parts * q + (2 * parts + 1) * self.stages * kv + xchg + 8 * (2 + 7 * self.stages + xbars) + 1024

    def cpp_name(self) -> str:
        b = _cpp_bool
        kernel = "fwd_sm90_tf32_pair_kernel" if self.split > 1 else "fwd_sm90_tf32_kernel"
        split = f", {self.split}, true" if self.q_regs else ", 2" if self.split > 1 else ""
        return (f"cuflash::{kernel}<cuflash::FwdTf32Traits<{self.head_dim // self.split}, {self.block_n}, "
                f"{self.stages}, {self.consumers}, {b(self.dtype == 'fp32')}, {b(self.pingpong)}{split}>, "
                f"{b(self.causal)}, {self.mods}>")

    @property
    def mods(self) -> int:
        return _tf32_mods(self)

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (self.split * math.ceil(seqlen_q / self.block_m), heads, batch)


# TF32 forward tiles per (dtype, head dim): (block_n, stages, consumers, pingpong), spill-free under NVRTC 13.0 and
# 13.5. 3xTF32 at head dim 128 keeps its Q and Q's big part (128 KB for 128 rows) and two stages of 16-key K, V, V^T
# (40 KB each) in 208 KB; with one consumer warpgroup (64 rows) and 32-key tiles it ran 10 % slower (H100, FA shapes,
# N 4k / 16k, 2026-11-27: 48.0 / 49.1 against 53.0 / 54.1 TFLOP/s; with pingpong 51.8 / 52.8). Measured the same day
# and about even: 3xTF32 at head dim 64 without pingpong (64.8 / 67.0 against 64.5 / 66.2) or with (32, 3) tiles;
# one-pass TF32 with 2 stages instead of 3 (head dim 64: 97.1 / 100.9 against 97.2 / 100.3; head dim 128 with 32-key
# tiles 105.9 / 110.4 against 106.8 / 111.4) or head dim 64 with (32, 4) tiles (95.1 / 98.8). One-pass TF32 at head
# dim 128 on one consumer with 64-key tiles ran 60 % as fast.
# 3xTF32 at head dim 128 runs as cluster pairs of head-dim-64 CTAs (FwdSm90Tf32Config.split), whose exchange slots of
# S (32 KB at 32-key tiles, double-buffered) leave no room for 64-key tiles: `tools/tune_tiles.py --dtype fp32
# --head-dims 128 --n 4096 --causal both --no-backward` (H200, 2026-11-30): (32, 3, 2, pingpong) 62 / 58 TFLOP/s
# (not causal / causal), (32, 2, 2, pingpong) 62 / 58, (16, 4, 2, pingpong) 47 / 44; the one-CTA (16, 2, 2) tiles it
# replaced 54 (`tools/tune_tiles.py` the same day, before the pairs). Without pingpong ptxas serializes its wgmma.
# Three consumer warpgroups (192 query rows per CTA, no pingpong, 152 registers each) where a consumer's registers
# hold them: one-pass TF32 at head dims 32 and 64, 3xTF32 at 32 (3xTF32 at 64 spilled nothing with 32-key tiles but
# ran 4-21 % slower). Each K / V tile, its split and its transpose then serve 192 rows instead of 128.
# `tools/tune_tiles.py --dtype tf32|fp32 --head-dims 32 64 --n 1024 4096 16384 --causal both --no-backward` (H200,
# 2026-11-30), TFLOP/s at N 1k / 4k / 16k, (64, 2, 3) against the two-consumer tiles before: one-pass TF32 at D 64
# 135 / 159 / 170 against 122 / 131 / 133 (causal 97 / 140 / 158 against 100 / 126 / 137), at D 32 95 / 113 / 117
# against 93 / 103 / 105 (causal 72 / 104 / 118 against 77 / 97 / 106); 3xTF32 at D 32 64 / 74 / 77 against 61 / 65 /
# 66 (causal 48 / 66 / 74 against 51 / 61 / 65); (64, 3, 3) within 2 % of (64, 2, 3) in every row. Causal rows up to
# 1k keys (FWD_SM90_TF32_SHORT_CAUSAL_KEYS) and a bias keep two consumers (FWD_SM90_TF32_TILES_TWO): the short causal
# rows measured slower on three (above), and with a bias three spilled 80-100 bytes at head dim 64.
# A fifth element, q_regs: Q's A operand in registers (3xTF32: its big part; one pass: the rounded Q, at head dim 128
# its first 32 columns). `tools/tune_tiles.py --dtype fp32|tf32 --head-dims 32 64 128 --n 1024 4096 16384 --causal
# both` (H200, 2026-11-30, outputs bitwise those of Q from shared memory), TFLOP/s at N 1k / 4k / 16k: 3xTF32 at D 64
# 77 / 83 / 84 against 75 / 80 / 81, at D 128 65 / 69 / 70 against 58 / 62 / 63; one pass at D 32 98 / 117 / 122
# against 96 / 113 / 118, at D 128 126 / 135 / 137 against 122 / 130 / 132 (causal likewise); one pass at D 64 on two
# consumers with it 124-142 against 135-171 on three without.
FWD_SM90_TF32_TILES = {
    "fp32": {32: (64, 2, 3, False), 64: (64, 2, 2, True, True), 128: (32, 3, 2, True, True)},
    "tf32": {32: (64, 2, 3, False, True), 64: (64, 2, 3, False), 128: (32, 3, 2, True, True)},
}
FWD_SM90_TF32_TILES_TWO = {"fp32": {32: (64, 3, 2, True)}, "tf32": {32: (64, 3, 2, True), 64: (64, 3, 2, True)}}
FWD_SM90_TF32_SHORT_CAUSAL_KEYS = 1024
# With a bias and a causal or windowed band, 3xTF32 at head dim 64 takes 32-key tiles: with 64-key tiles those
# kernels spilled 4 bytes (NVRTC 13.5). (On the full band the 64-key tiles stay: with 32-key ones a bias forward
# of B 512, L 256, H 8 took 1.253 ms against 1.082 without a bias; at head dim 128, on unchanged tiles, a bias cost
# 0.3 %. H200, 2026-11-29.)
FWD_SM90_TF32_TILES_BIAS_BANDED = {"fp32": {64: (32, 3, 2, True)}}
# A window or a bias: Q from shared memory in 3xTF32 at head dim 64 and one pass at 128 (with it in registers, q_regs,
# those kernels spilled 4-16 bytes under NVRTC 13.0 or 13.5)
FWD_SM90_TF32_TILES_MODS = {"fp32": {64: (64, 2, 2, True)}, "tf32": {128: (32, 3, 2, True)}}
# ALiBi with a mask (alibi_mask: computed or read per score, as a bias, they take the bias's tiles but on a band) where
# those spilled 4-32 bytes under NVRTC 13.0 or 13.5: one pass at head dim 128 in 16-key tiles, and beside a bias
# 3xTF32 at 64 in 32-key ones (its 64-key tiles spilled 4-16 bytes there; alone or beside a window they hold)
FWD_SM90_TF32_TILES_SCORE = {"tf32": {128: (16, 3, 2, True)}}
FWD_SM90_TF32_TILES_SCORE_BIAS = {"fp32": {64: (32, 3, 2, True)}}
# The score modifiers it takes: a window (causal is not a modifier), a bias, ALiBi and a mask; soft-capping and
# dropout run on fwd_wide_kernel
FWD_SM90_TF32_MODS = MOD_WINDOW | MOD_BIAS | MOD_ALIBI | MOD_MASK


def fwd_sm90_tf32_config(head_dim: int, dtype: str, causal: bool, window: bool = False,
                         bias: bool = False, seqlen_k: int | None = None, *,
                         alibi_mask: bool = False) -> FwdSm90Tf32Config:
    """The float32 Hopper forward's config; seqlen_k (the call's longest key sequence), when given, lets causal rows
    of up to FWD_SM90_TF32_SHORT_CAUSAL_KEYS keys take the two-consumer tiles."""
    short_causal = causal and seqlen_k is not None and seqlen_k <= FWD_SM90_TF32_SHORT_CAUSAL_KEYS
    per_score = bias or alibi_mask  # modifiers read or computed per score: the bias's tiles
    tiles = FWD_SM90_TF32_TILES_BIAS_BANDED.get(dtype, {}) if bias and (causal or window) else {}
    if per_score or short_causal:
        tiles = {**FWD_SM90_TF32_TILES_TWO.get(dtype, {}), **tiles}
    if per_score or window:
        tiles = {**FWD_SM90_TF32_TILES_MODS.get(dtype, {}), **tiles}
    if alibi_mask:
        tiles = {**tiles, **FWD_SM90_TF32_TILES_SCORE.get(dtype, {}),
                 **(FWD_SM90_TF32_TILES_SCORE_BIAS.get(dtype, {}) if bias else {})}
    bn, stages, consumers, pingpong, *q_regs = tiles.get(head_dim, FWD_SM90_TF32_TILES[dtype][head_dim])
    return FwdSm90Tf32Config(head_dim, bn, stages, consumers, dtype, causal, window, pingpong, bias, *q_regs,
                             alibi_mask=alibi_mask)



@dataclass(frozen=True)
class BwdSm90Tf32Config(_ProducerConsumers):
    """One float32 Hopper backward instantiation, its main kernel (dK, dV):
    `bwd_sm90_tf32_kernel<BwdTf32Traits<HEAD_DIM, BLOCK_M, STAGES, X3[, SPLIT, CONSUMERS[, K_REG_STEPS]]>, IS_CAUSAL,
    MODS>`
    (cuda/bwd_sm90_tf32.cuh): K/V-outer CTAs of 64 * consumers keys, TF32 wgmma, a producer warpgroup (one TMA thread,
    three warps splitting each step's Q, dO and transposing them) and two or three consumer warpgroups of 64 keys
    (each splitting its K and V rows) taking every step of block_m queries together.
    dQ comes from a second kernel, `dq_config()` (Q-outer, no atomics: the backward repeats bitwise). dtype "fp32":
    3xTF32, "tf32": one TF32 pass; window: a sliding window (MOD_WINDOW); bias: an additive bias and its gradient
    (MOD_BIAS: dBias is written by this kernel)."""

    head_dim: int
    block_m: int
    dtype: str
    causal: bool
    window: bool = False
    stages: int = 2
    bias: bool = False
    consumers: int = 2  # consumer warpgroups of 64 keys: two, or three (one CTA per key block, not a pair)
    alibi_mask: bool = False  # ALiBi and an element mask (MOD_ALIBI | MOD_MASK), for a call with either or both
    k_reg_steps: int = 0  # 3xTF32: k8 steps of S^T whose A operand takes K's big part from registers (K_REG_STEPS)

    def __post_init__(self):
        _check_tf32(self, (32, 64, 128), "TF32 backward")
        if self.block_m not in (16, 32) or not 2 <= self.stages <= 4:
            raise ValueError(f"block_m={self.block_m}, stages={self.stages}: block_m 16 or 32, 2-4 stages")
        if self.consumers not in (2, 3) or (self.consumers == 3 and self.split > 1):
            raise ValueError(f"consumers={self.consumers} at head_dim={self.head_dim}: 2, or 3 where a key block is "
                             f"one CTA (head dims 32 and 64)")
        _check_smem_sm90(self, f"block_m={self.block_m}, stages={self.stages}, consumers={self.consumers}")
        if self.k_reg_steps and (self.dtype != "fp32" or not 0 < self.k_reg_steps <= self.head_dim // self.split // 8):
            raise ValueError(f"k_reg_steps={self.k_reg_steps} ({self.dtype}, head_dim={self.head_dim}): 3xTF32 only, "
                             f"at most the {self.head_dim // self.split // 8} k8 steps of a CTA's columns")

    box_cols = 32  # TMA box width in floats: one 128-byte swizzle panel

    @property
    def block_n(self) -> int:
        """Keys per CTA: a consumer warpgroup's 64 each."""
        return 64 * self.consumers

    @property
    def split(self) -> int:
        """CTAs per key block: head dim 128 runs as clusters of two CTAs of 64 columns (`_pair_kernel`)."""
        return _tf32_split(self.head_dim)

    @property
    def smem_bytes(self) -> int:
        """BwdTf32Traits::SMEM_BYTES: K and V (with their big parts: 3xTF32), the stages of Q and dO (each with its
        big part and its transpose, big and small), of lse_log2 and delta and of the step's words (16 bytes), a
        pair's exchange slots (16 bytes per consumer thread and n8 tile, per parity, product and consumer), the
        mbarriers, 1024 to align the base."""
        parts = 2 if self.dtype == "fp32" else 1
        cols = self.head_dim // self.split
        kv, q = 4 * self.block_n * cols, 4 * self.block_m * cols
        xchg, xbars = ((2 * 2 * self.consumers * (self.block_m // 8) * 128 * 16, 4 * self.consumers)
                       if self.split > 1 else (0, 0))
        return (2 * parts * kv + self.stages * (4 * parts * q + 8 * self.block_m + 16) + xchg
                + 8 * (2 + 3 * self.stages + xbars) + 1024)

    def cpp_name(self) -> str:
        b = _cpp_bool
        kernel = "bwd_sm90_tf32_pair_kernel" if self.split > 1 else "bwd_sm90_tf32_kernel"
        tail = (f", {self.split}, {self.consumers}, {self.k_reg_steps}" if self.k_reg_steps else
                f", {self.split}, {self.consumers}" if self.consumers != 2 else ", 2" if self.split > 1 else "")
        return (f"cuflash::{kernel}<cuflash::BwdTf32Traits<{self.head_dim // self.split}, {self.block_m}, "
                f"{self.stages}, {b(self.dtype == 'fp32')}{tail}>, {b(self.causal)}, {self.mods}>")

    @property
    def mods(self) -> int:
        return _tf32_mods(self)

    def grid(self, batch: int, heads_kv: int, seqlen_k: int) -> tuple[int, int, int]:
        return (self.split * math.ceil(seqlen_k / self.block_n), heads_kv, batch)

    def dq_config(self) -> "BwdDqSm90Tf32Config":
        tiles = BWD_DQ_SM90_TF32_TILES[self.dtype]
        per_score = self.bias or self.alibi_mask
        if self.window or per_score:
            tiles = {**tiles, **BWD_DQ_SM90_TF32_TILES_MODS.get(self.dtype, {})}
        if self.window and per_score:
            tiles = {**tiles, **BWD_DQ_SM90_TF32_TILES_WINDOW_BIAS.get(self.dtype, {})}
        if self.alibi_mask and self.bias:
            tiles = {**tiles, **BWD_DQ_SM90_TF32_TILES_SCORE_BIAS.get(self.dtype, {})}
        if self.alibi_mask and self.window:
            tiles = {**tiles, **BWD_DQ_SM90_TF32_TILES_SCORE_WINDOW.get(self.dtype, {})}
        bn, stages, consumers, *a_regs = tiles[self.head_dim]
        return BwdDqSm90Tf32Config(self.head_dim, bn, stages, consumers, self.dtype, self.causal, self.window,
                                   self.bias, *a_regs, alibi_mask=self.alibi_mask)


@dataclass(frozen=True)
class BwdDqSm90Tf32Config(_ConsumerWarpgroups):
    """The dQ kernel of the float32 Hopper backward:
    `bwd_dq_sm90_tf32_kernel<BwdDqTf32Traits<HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, X3>, IS_CAUSAL, MODS>`:
    Q-outer CTAs of 64 * consumers query rows, S and dP again, dQ = dS K with K^T written by the splitters; the
    window and bias of the main kernel (no dBias here)."""

    head_dim: int
    block_n: int
    stages: int
    consumers: int
    dtype: str
    causal: bool
    window: bool = False
    bias: bool = False
    a_regs: int = 0  # the big parts (3xTF32) or rounded values of Q (1) or of Q and dO (2) as wgmma A registers
    alibi_mask: bool = False  # ALiBi and an element mask (MOD_ALIBI | MOD_MASK), for a call with either or both

    def __post_init__(self):
        _check_tf32(self, (32, 64, 128), "TF32 backward's dQ kernel")
        self._check_tiles()
        if self.a_regs not in (0, 1, 2):
            raise ValueError(f"a_regs={self.a_regs}: 0, 1 (Q's A operand in registers) or 2 (Q's and dO's)")
        if self.a_regs and self.dtype == "tf32" and self.head_dim // self.split == 64 and self.block_n == 64:
            # the one variant that computes a wrong dQ on an H200 (tools/tune_tiles.py, 2026-11-30: max |diff| 0.1-1.8
            # against the kernel with Q from shared memory, which its other variants matched bitwise). Reproduced the
            # same day with the check bypassed: nearly every element of dQ wrong, the same bits on every run, from one
            # query block of 128 rows and two key tiles up, on one or two consumers, with Q or Q and dO in registers,
            # and in the cluster pairs at head dim 128; 32-key tiles at 64 columns and 64-key tiles at 32 columns
            # match bitwise; memcheck, racecheck and synccheck clean. The cause is NVRTC 13.0's ptxas (the device
            # image's): it loads Q's fragments before the key loop and reuses those registers for temporaries inside
            # it; NVRTC 13.5's cubin of the same source, run on the same H200, gives dQ bitwise equal to the
            # reference. `cuflash compile --sass` (sass_clobbered_a_operands) finds the pattern; refused under any
            # NVRTC, as a user's may be 13.0
            raise ValueError(f"a_regs={self.a_regs} with block_n=64 at 64 columns in 'tf32': not a kernel (wrong dQ)")
        _check_smem_sm90(self, f"block_n={self.block_n}, stages={self.stages}, consumers={self.consumers}")

    box_cols = 32

    @property
    def split(self) -> int:
        """CTAs per query block: head dim 128 runs as clusters of two CTAs of 64 columns (`_pair_kernel`)."""
        return _tf32_split(self.head_dim)

    @property
    def smem_bytes(self) -> int:
        """BwdDqTf32Traits::SMEM_BYTES: Q and dO (with their big parts: 3xTF32), the stages of K (split, and K^T big
        and small) and V (split), a pair's exchange slots, the mbarriers, 1024 to align the base."""
        parts = 2 if self.dtype == "fp32" else 1
        cols = self.head_dim // self.split
        q, kv = 4 * self.block_m * cols, 4 * self.block_n * cols
        xchg, xbars = ((2 * 2 * self.consumers * (self.block_n // 8) * 128 * 16, 4 * self.consumers)
                       if self.split > 1 else (0, 0))
        return 2 * parts * q + self.stages * 3 * parts * kv + xchg + 8 * (2 + 3 * self.stages + xbars) + 1024

    def cpp_name(self) -> str:
        b = _cpp_bool
        kernel = "bwd_dq_sm90_tf32_pair_kernel" if self.split > 1 else "bwd_dq_sm90_tf32_kernel"
        split = f", {self.split}, {self.a_regs}" if self.a_regs else ", 2" if self.split > 1 else ""
        return (f"cuflash::{kernel}<cuflash::BwdDqTf32Traits<{self.head_dim // self.split}, {self.block_n}, "
                f"{self.stages}, {self.consumers}, {b(self.dtype == 'fp32')}{split}>, {b(self.causal)}, {self.mods}>")

    @property
    def mods(self) -> int:
        return _tf32_mods(self)

    def grid(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
        return (self.split * math.ceil(seqlen_q / self.block_m), heads, batch)


# The float32 Hopper backward's tiles per (dtype, head dim): the dK / dV kernel's (block_m: queries per step, stages),
# the dQ kernel's (block_n, stages, consumers). 3xTF32 keeps 128 keys of K, V and three stages of 16-query Q, dO with
# their transposes (225 KB) and, in the dQ kernel, Q and dO of 128 rows and two stages of 32-key K, K^T, V (225 KB).
# Measured on an H100 (2026-11-27, FA shapes, N 1k-16k): one-pass TF32 with 32-query steps ran 103-116 TFLOP/s, with
# 16-query steps and the next step's products issued under dK (the kernel's OVERLAP) 92-103; 3xTF32, whose 32-query
# steps do not fit with 128 keys, 47-50 either way (and 45-49 with 64 keys per CTA, the two consumers taking
# alternate steps of 32 queries).
# At head dim 32 3xTF32's 32-query steps fit (its K and V take half the bytes of head dim 64's) and were faster on
# an H200 (2026-11-29, `tools/tune_tiles.py --dtype fp32 --head-dims 32 --n 4096 --causal no`, the backward's
# TFLOP/s): dK / dV steps of 32 queries 49 against 42 with 16 (the overlapped steps), dQ with 64-key tiles 46 against
# 43 with 32-key ones; one-pass TF32 at head dim 32 measured its head-dim-64 tiles best (94; 16-query steps 82).
# Head dim 128 runs as cluster pairs of head-dim-64 CTAs, whose exchange slots of S and dP (double-buffered: 32 KB in
# the dK / dV kernel at 16 queries per step) leave 3xTF32 two stages of 16-query steps and, in the dQ kernel, 16-key
# tiles with two consumers or 32-key ones with one. Per kernel on an H200 (2026-11-30, CUDA events around each launch
# as `tools/kernel_times.py` takes them; B 4, N 4096, H 16 against the head-dim-64 kernels at H 32: the same CTA count
# and work per CTA): dK / dV 22.9 ms against 17.6 with the head-dim-64 tiles and 20.3 with the pair's (16, 2); dQ 16.3
# (either dQ tile) against 10.7, and 15.0 with (16, 2, 2): the two stages and the 16-key tiles cost more than the
# exchange. One-pass TF32 at 128 (`tools/tune_tiles.py --dtype tf32 --head-dims 128 --n 4096 --causal no`, same day):
# dK / dV (32, 3) 87 TFLOP/s against 85 with 2 stages and 78 with 16-query steps; dQ (32, 3, 2) 89 against 87 with 2
# stages, 79 with (64, 2, 1).
# The dQ kernel on three consumer warpgroups (192 rows per CTA, 152 registers each; spill-free where listed in
# tools/tune_tiles.py's candidates): `tools/tune_tiles.py --dtype tf32|fp32 --head-dims 32 64 --n 1024 4096 16384
# --causal both` (H200, 2026-11-30, the backward's TFLOP/s at N 1k / 4k / 16k): one-pass TF32 at head dim 32 with
# (64, 3, 3) 89 / 102 / 105 against 85 / 94 / 97 (causal 68 / 92 / 102 against 68 / 87 / 95), so it takes them; at
# head dim 64 (32, 3, 3) 100 / 113 / 118 against 102 / 112 / 114 (causal 79 / 105 / 117 against 81 / 103 / 113) and
# 3xTF32 at 32 (32, 3, 3) 48 / 52 / 53 against 50 / 53 / 54 (causal 38-52 against 41-53) do not.
# The dK / dV kernel on three consumer warpgroups (a third element: 192 keys per CTA, 152 registers each; at head dim
# 64 three spilled 36-228 bytes), the same tuner and day: at head dim 32 one-pass TF32 (32, 3, 3) 93 / 112 / 118
# against 89 / 102 / 105 (causal 73 / 103 / 114 against 68 / 92 / 102; (32, 2, 3) 1-3 % behind), 3xTF32 (32, 3, 3) 50 /
# 55 / 57 against 49 / 53 / 54 (causal 43 / 53 / 57 against 41 / 50 / 53; (16, 3, 3) 43-50), gradients bitwise equal
# to the two-consumer kernel's on those shapes, the 18 head-dim-32 float32 sanitizer cases clean, so head dim 32 takes
# them (with a bias 3xTF32 keeps two: BWD_SM90_TF32_TILES_BIAS).
# The dQ kernel's fourth element, a_regs: Q's (1) or Q's and dO's (2) A operands in registers (3xTF32: the big parts;
# one pass: the rounded values). The tuner the same day (backward TFLOP/s at N 1k / 4k / 16k): 3xTF32 at D 32 with 2
# 51 / 58 / 60 against 49 / 55 / 57, at D 128 36 / 38 / 38 against 33 / 35 / 35; one pass at D 32 with 1 95 / 115 / 121
# against 93 / 113 / 119, at D 64 (32, 3, 2, 2) 103 / 112 / 115 against 102 / 112 / 114, at D 128 with 2 86 / 94 / 97
# against 81 / 88 / 90 (causal likewise); 3xTF32 at D 64: every variant that fits 3-7 % slower. One pass with 64-key
# tiles at 64 columns and Q in registers computed a wrong dQ (max |diff| 0.1-1.8), NVRTC 13.0's ptxas reusing Q's
# registers inside the key loop: BwdDqSm90Tf32Config refuses it.
# A fourth element, k_reg_steps (3xTF32): the first k8 steps of the dK / dV kernel's S^T take K's big part from
# registers (two of their three products' A operand), read from shared memory once per CTA. At 16 queries per step
# S^T's A operand is four times its B, so K's and V's A reads are most of a step's shared-memory reads; with K's big
# part in registers for all 8 k8 steps the kernel spilled 84-200 bytes at head dim 64, with 4 it is spill-free except
# with a bias (4-20 bytes; 2 is spill-free there), and the pairs at 128 spill 12 bytes with 4 under NVRTC 13.5. The
# tuner (`tools/tune_tiles.py --dtype fp32 --head-dims 64 128 --n 1024 4096 --causal both`, H200, 2026-12-01, two
# rounds, gradients bitwise equal), backward ms at N 1k / 4k, causal N 1k / 4k: head dim 64 (16, 3) 7.29-7.34 /
# 28.16 / 4.28 / 14.80, with 2 steps 7.20 / 27.83 / 4.22-4.24 / 14.56-14.59, 3 7.09 / 27.32 / 4.16-4.17 / 14.34-14.35,
# 4 6.98 / 26.88 / 4.11-4.13 / 14.16-14.18; head dim 128 (16, 2) 9.18-9.27 / 35.22 / 5.39-5.41 / 18.21-18.22, with
# 2 9.13-9.20 / 35.08-35.09 / 5.34 / 18.05-18.09 (4: 9.08-9.09 / 34.89 / 5.29-5.30 / 17.91-17.95, not spill-free).
# With the Evoformer's pair bias (`tools/kernel_times.py --dtype fp32 --head-dim 64 --n 256 --batch 512 --heads 8
# --bias-batch 1 --main ...`, same call) the dK / dV kernel took 2.764-2.783 ms, 2.708-2.710 with 2 steps, 2.714-2.731
# with 3 and 2.871-2.889 with 4 (its spill): BWD_SM90_TF32_TILES_BIAS takes 2.
BWD_SM90_TF32_TILES = {"fp32": {32: (32, 3, 3), 64: (16, 3, 2, 4), 128: (16, 2, 2, 2)},
                       "tf32": {32: (32, 3, 3), 64: (32, 3), 128: (32, 3)}}
BWD_DQ_SM90_TF32_TILES = {"fp32": {32: (64, 2, 2, 2), 64: (32, 2, 2), 128: (16, 2, 2, 2)},
                          "tf32": {32: (64, 3, 3, 1), 64: (32, 3, 2, 2), 128: (32, 3, 2, 2)}}
# With a bias, one-pass TF32 at head dims 64 and 128 takes 16-query steps: its 32-query steps spilled 8-68 bytes with
# the bias read and the dBias writes at 64 (NVRTC 13.0 and 13.5), 104-192 bytes in the pairs at 128 (13.5); at head
# dim 32 they do not. 3xTF32 at head dim 32 keeps two consumer warpgroups with a bias: three spilled 8 bytes beside a
# window (NVRTC 13.5)
BWD_SM90_TF32_TILES_BIAS = {"fp32": {32: (32, 3), 64: (16, 3, 2, 2)}, "tf32": {64: (16, 3), 128: (16, 3)}}
BWD_SM90_TF32_MODS = MOD_WINDOW | MOD_BIAS | MOD_ALIBI | MOD_MASK
# The dQ kernel's tiles with a window or a bias (_MODS), and with both (_WINDOW_BIAS), where the A registers of the plain
# tiles spilled (NVRTC 13.0 or 13.5): one pass at head dim 128 keeps Q's alone in registers beside either (with dO's
# too 4-20 bytes), one pass at 32 neither (40-48 bytes with a bias), 3xTF32 at 128 Q's alone beside both (24 bytes)
BWD_DQ_SM90_TF32_TILES_MODS = {"tf32": {32: (64, 3, 3), 128: (32, 3, 2, 1)}}
BWD_DQ_SM90_TF32_TILES_WINDOW_BIAS = {"fp32": {128: (16, 2, 2, 1)}}
# ... with ALiBi and a mask (over the two above) beside a window, and beside a bias, where those spilled 8-24 bytes
# (NVRTC 13.0 or 13.5): 16-key tiles in 3xTF32 at head dim 64 and Q's A registers alone in one pass at 64 beside a
# window, two consumers in one pass at 32 beside a bias
BWD_DQ_SM90_TF32_TILES_SCORE_WINDOW = {"fp32": {64: (16, 3, 2)}, "tf32": {64: (32, 3, 2, 1)}}
BWD_DQ_SM90_TF32_TILES_SCORE_BIAS = {"tf32": {32: (64, 3, 2)}}


def bwd_sm90_tf32_config(head_dim: int, dtype: str, causal: bool, window: bool = False,
                         bias: bool = False, *, alibi_mask: bool = False) -> BwdSm90Tf32Config:
    tiles = BWD_SM90_TF32_TILES_BIAS.get(dtype, {}) if bias or alibi_mask else {}
    block_m, stages, *rest = tiles.get(head_dim, BWD_SM90_TF32_TILES[dtype][head_dim])
    return BwdSm90Tf32Config(head_dim, block_m, dtype, causal, window, stages, bias, *rest[:1], alibi_mask=alibi_mask,
                             k_reg_steps=rest[1] if len(rest) > 1 else 0)

# --- the registry: which kernel family runs an operation ------------------------------------------------
#
# The host path asks `select` for the config of an operation ("forward", "backward": the main kernel of the
# backward, "decode": attention_with_kvcache); nothing else in the library chooses kernels. A new kernel family
# (another architecture's, another dtype's) is one Family entry here, ahead of the ones it should win over,
# and its config dataclass (cpp_name, threads, smem_bytes, grid) beside the others.

@dataclass(frozen=True)
class Family:
    """A kernel family: the operation it runs, the targets and dtypes it has kernels for, the kernel head
    dims it has for a set of score modifiers, and its config for a problem."""

    name: str
    op: str  # "forward" | "backward" | "decode"
    archs: tuple | None  # NVRTC targets it runs on; None: every target cuflash supports
    dtypes: tuple
    head_dims: object  # mods -> the kernel head dims it has with those modifiers
    make: object  # (head_dim, dtype, causal, mods, deterministic, arch, seqlen_k) -> config
    wgmma: bool = False  # a Hopper wgmma family: CUFLASH_KERNELS=mma turns it off
    tile_map: bool = False  # its kernels skip the tiles a block map empties, so MOD_BLOCKS may be given to them

    def runs(self, op: str, head_dim: int, dtype: str, arch: str, mods: int, kernels: str) -> bool:
        if self.op != op or dtype not in self.dtypes or head_dim not in self.head_dims(mods):
            return False
        if mods & MOD_BLOCKS and not self.tile_map:
            return False
        if self.archs is not None and arch not in self.archs:
            return False
        return not self.wgmma or uses_wgmma(arch, kernels)


FAMILIES = (
    Family("fwd_sm90_ws", "forward", ("sm_90a",), DTYPES, lambda mods: tuple(FWD_SM90_WS_TILES),
           lambda hd, dt, c, m, det, arch, sk: fwd_sm90_ws_config(hd, dt, c, m, seqlen_k=sk), wgmma=True,
           tile_map=True),
    Family("fwd_sm90", "forward", ("sm_90a",), DTYPES, lambda mods: FWD_SM90_TILES,
           lambda hd, dt, c, m, det, arch, sk: fwd_sm90_config(hd, dt, c, m), wgmma=True),
    Family("fwd", "forward", None, DTYPES, lambda mods: KERNEL_HEAD_DIMS,
           lambda hd, dt, c, m, det, arch, sk: fwd_config(hd, dt, c, arch, m)),
    Family("bwd_sm90_ws", "backward", ("sm_90a",), DTYPES, bwd_sm90_ws_head_dims,
           lambda hd, dt, c, m, det, arch, sk: bwd_sm90_ws_config(hd, dt, c, det, m), wgmma=True, tile_map=True),
    Family("bwd_sm90", "backward", ("sm_90a",), DTYPES, bwd_sm90_tiles,
           lambda hd, dt, c, m, det, arch, sk: bwd_sm90_config(hd, dt, c, det, m), wgmma=True),
    Family("bwd_sm90_split", "backward", ("sm_90a",), DTYPES, bwd_sm90_split_head_dims,
           lambda hd, dt, c, m, det, arch, sk: BwdSm90SplitConfig(hd, dt, c, det, m), wgmma=True),
    Family("bwd", "backward", None, DTYPES, lambda mods: KERNEL_HEAD_DIMS,
           lambda hd, dt, c, m, det, arch, sk: bwd_config(hd, dt, c, det, m, arch)),
    Family("fwd_sm90_tf32", "forward", ("sm_90a",), ("fp32", "tf32"),
           lambda mods: tuple(FWD_SM90_TF32_TILES["fp32"]) if not mods & ~FWD_SM90_TF32_MODS else (),
           lambda hd, dt, c, m, det, arch, sk: fwd_sm90_tf32_config(hd, dt, c, bool(m & MOD_WINDOW), bool(m & MOD_BIAS),
                                                                     seqlen_k=sk,
                                                                     alibi_mask=bool(m & (MOD_ALIBI | MOD_MASK))),
           wgmma=True),
    Family("fwd_wide", "forward", None, ("fp32", "tf32"), lambda mods: WIDE_KERNEL_HEAD_DIMS["fp32"],
           lambda hd, dt, c, m, det, arch, sk: fwd_wide_config(hd, dt, c, m, arch)),
    Family("fwd_wide_fp64", "forward", None, ("fp64",),
           lambda mods: WIDE_KERNEL_HEAD_DIMS["fp64"] if wide_mods_supported("fp64", mods) else (),
           lambda hd, dt, c, m, det, arch, sk: fwd_wide_config(hd, dt, c, m, arch)),
    Family("bwd_sm90_tf32", "backward", ("sm_90a",), ("fp32", "tf32"),
           lambda mods: tuple(BWD_SM90_TF32_TILES["fp32"]) if not mods & ~BWD_SM90_TF32_MODS else (),
           lambda hd, dt, c, m, det, arch, sk: bwd_sm90_tf32_config(hd, dt, c, bool(m & MOD_WINDOW), bool(m & MOD_BIAS),
                                                                     alibi_mask=bool(m & (MOD_ALIBI | MOD_MASK))),
           wgmma=True),
    Family("bwd_wide", "backward", None, ("fp32", "tf32"), lambda mods: WIDE_KERNEL_HEAD_DIMS["fp32"],
           lambda hd, dt, c, m, det, arch, sk: bwd_wide_config(hd, dt, c, m, arch, det)),
    Family("bwd_wide_fp64", "backward", None, ("fp64",),
           lambda mods: WIDE_KERNEL_HEAD_DIMS["fp64"] if wide_mods_supported("fp64", mods) else (),
           lambda hd, dt, c, m, det, arch, sk: bwd_wide_config(hd, dt, c, m, arch, det)),
    Family("fwd_sm90_fp8", "forward_fp8", ("sm_90a",), DTYPES, lambda mods: FWD_SM90_FP8_TILES if not mods & ~MOD_WINDOW
           else (), lambda hd, dt, c, m, det, arch, sk: fwd_sm90_fp8_config(hd, dt, c, bool(m & MOD_WINDOW),
                                                                              seqlen_k=sk), wgmma=True),
    Family("decode", "decode", None, DTYPES, lambda mods: DECODE_TILES if not mods & ~MODS_DECODE else (),
           lambda hd, dt, c, m, det, arch, sk: fwd_decode_config(hd, dt, c, m)),
)


def select(op: str, head_dim: int, dtype: str, causal: bool, arch: str = DEFAULT_ARCH, *, mods: int = 0,
           deterministic: bool = False, kernels: str | None = None, seqlen_k: int | None = None):
    """The config of the first family in FAMILIES that runs `op` for this (kernel) head dim, dtype, target and
    score modifiers (seqlen_k: the longest key sequence, where a family's tiles depend on it)."""
    kernels = KERNELS if kernels is None else kernels
    for family in FAMILIES:
        if family.runs(op, head_dim, dtype, arch, mods, kernels):
            return family.make(head_dim, dtype, causal, mods, deterministic, arch, seqlen_k)
    raise ValueError(f"no kernel family runs op={op!r} for head_dim={head_dim}, dtype={dtype!r}, arch={arch!r}, "
                     f"mods={mods}; families: {', '.join(f.name for f in FAMILIES)}")
