"""The tile schedules every model of the analyzer reads: which kernel configuration cuflash launches, the
blocks a strategy runs with, and which blocks each loop visits (causal and sliding-window skipping).

The closed-form counts (strategies), the shared-memory walks (banks), the L2 model (l2), the float64
execution (execute) and the ncu validation (validate) all walk these same schedules, so this module imports
none of them: only masks, model and cuflash.config. The models import it; strategies.simulate, the top,
imports the models.
"""
from __future__ import annotations

import dataclasses

import math

import numpy as np

from cuflash import config as _config

from .masks import band_sides, key_tile_range, query_block_range
from .model import DEFAULT_FA2_BLOCKS, DEFAULT_SRAM_BYTES, FP8_DTYPES, Problem


# The GPU the analyzer counts for: the H100 (sm_90a), whose kernel family cuflash picks by CUFLASH_KERNELS;
# the analyzer takes the family as an argument instead, "auto" being the library's default.
ARCH = _config.DEFAULT_ARCH
DEFAULT_KERNELS = "auto"


def check_kernels(kernels: str) -> str:
    if kernels not in _config.KERNEL_FAMILIES:
        raise ValueError(f"kernels={kernels!r} is not a kernel family; allowed: {', '.join(_config.KERNEL_FAMILIES)}")
    return kernels


# ----------------------------------------------------------------------------------------------
# Visited blocks (all per (batch, head); the models multiply by batch*heads).
# ----------------------------------------------------------------------------------------------

def block_sizes(seqlen: int, block: int) -> np.ndarray:
    """Rows in each of the ceil(seqlen/block) blocks: full blocks, then the tail."""
    n = math.ceil(seqlen / block)
    sizes = np.full(n, block, dtype=np.int64)
    sizes[-1] = seqlen - (n - 1) * block
    return sizes


def key_block_ranges(p: Problem, block_m: int, block_n: int, causal_skip: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Key blocks [n_begin, n_end) visited by each query block m_block, as in fwd_kernel: those holding a
    key that some row of the block sees (masks.key_tile_range over rows row0 .. min(row0 + BLOCK_M, Sq) - 1;
    causal: n_begin = 0, n_end = min(ceil(Sk / BLOCK_N), floor((last_row + Sk - Sq) / BLOCK_N) + 1)).
    n_end <= n_begin means the block sees no key at all: O = 0, lse = -inf are written and nothing is
    read. causal_skip=False: every block visits all ceil(Sk / BLOCK_N) key blocks."""
    t_r = math.ceil(p.seqlen_q / block_m)
    t_c = math.ceil(p.seqlen_k / block_n)
    if not causal_skip:
        return np.zeros(t_r, dtype=np.int64), np.full(t_r, t_c, dtype=np.int64)
    row0 = np.arange(t_r, dtype=np.int64) * block_m
    last_row = np.minimum(row0 + block_m, p.seqlen_q) - 1
    n_begin, n_end = key_tile_range(row0, last_row, p.seqlen_q, p.seqlen_k, block_n, p.causal, p.window)
    return n_begin.astype(np.int64), n_end.astype(np.int64)


def bwd_query_blocks(cfg, seqlen_q: int, seqlen_k: int, causal_skip: bool = True,
                     window=None) -> tuple[np.ndarray, np.ndarray]:
    """(m_begin, m_end) of every key block n_block of bwd_kernel: query blocks m_begin .. m_end-1 are
    visited, those whose rows see a key of [n0, min(n0 + BLOCK_N, Sk) - 1] (masks.query_block_range with
    cfg.causal and the window; causal: m_begin = max(0, n0 - diag) / BLOCK_M, diag = Sk - Sq, m_end = all).
    causal_skip=False: every key block visits every query block."""
    n0 = np.arange(-(-seqlen_k // cfg.block_n), dtype=np.int64) * cfg.block_n
    if not causal_skip:
        return np.zeros_like(n0), np.full(n0.shape, -(-seqlen_q // cfg.block_m), dtype=np.int64)
    key_last = np.minimum(n0 + cfg.block_n, seqlen_k) - 1
    m_begin, m_end = query_block_range(n0, key_last, seqlen_q, seqlen_k, cfg.block_m, cfg.causal, window)
    return m_begin.astype(np.int64), m_end.astype(np.int64)


def seqlen_q_pad(seqlen_q: int) -> int:
    """Rows of the fp32 backward buffers (lse_log2, delta, dq_accum): seqlen_q rounded up to SEQLEN_Q_PAD."""
    return -(-seqlen_q // _config.SEQLEN_Q_PAD) * _config.SEQLEN_Q_PAD


def dq_turns_bytes(cfg, seqlen_q: int) -> int:
    """Bytes of the turn counters (BwdParams::dq_turns) of ordered backward main kernel `cfg` (config.ordered_dq)
    per (batch, head): one int32 per config.turn_rows(cfg) rows of the padded rows (seqlen_q_pad), 64 for
    bwd_sm90_ws_kernel and WIDE_TURN_ROWS = 16 for bwd_wide_kernel."""
    return -(-seqlen_q_pad(seqlen_q) // _config.turn_rows(cfg)) * 4


def main_adds_dq(cfg) -> bool:
    """Whether backward main kernel `cfg` adds dQ into dq_accum itself: by atomics or bulk reductions unless
    deterministic, and deterministic on the ordered paths of the warp-specialized kernel and of bwd_wide_kernel
    (config.ordered_dq: the same adds in a fixed order of key blocks). The others leave dQ to a Q-outer kernel:
    bwd_dq_kernel after a deterministic 16-bit main kernel, bwd_dq_sm90_tf32_kernel after the float32 Hopper one
    (BwdSm90Tf32Config, in both modes)."""
    if isinstance(cfg, _config.BwdSm90Tf32Config):
        return False
    return not getattr(cfg, "deterministic", False) or _config.ordered_dq(cfg)


def bwd_key_blocks_reversed(cfg, window=None) -> bool:
    """Whether backward main kernel `cfg` launches its key blocks last first (key block gridDim.x - 1 - blockIdx.x):
    the ordered deterministic kernels (config.ordered_dq: bwd_sm90_ws_kernel, bwd_wide_kernel) with causal or a
    window (cfg.causal and `window` folded as masks.band_sides), whose dQ turns per query block run from the highest
    key block down, so that each CTA waits only on CTAs launched before it."""
    if not _config.ordered_dq(cfg):
        return False
    return bool(cfg.mods & _config.MOD_WINDOW) or band_sides(cfg.causal, window) != (None, None)


# ----------------------------------------------------------------------------------------------
# Block sizes and the kernel configuration
# ----------------------------------------------------------------------------------------------

def fa1_blocks(head_dim: int, sram_bytes: int, elem_bytes: int) -> tuple[int, int]:
    """FlashAttention Algorithm 1: B_c = ceil(M / 4d), B_r = min(B_c, d), M = SRAM size in elements."""
    m_elems = sram_bytes // elem_bytes
    b_c = math.ceil(m_elems / (4 * head_dim))
    return min(b_c, head_dim), b_c


def resolve_blocks(strategy: str, p: Problem, block_m: int | None, block_n: int | None,
                   sram_bytes: int | None, backward: bool = False,
                   kernels: str = DEFAULT_KERNELS) -> tuple[int | None, int | None]:
    """(block_m, block_n) a strategy runs with; validates the user's choice."""
    if (block_m is None) != (block_n is None):
        raise ValueError(f"give both block_m and block_n or neither (got block_m={block_m}, block_n={block_n})")
    if block_m is not None and sram_bytes is not None:
        raise ValueError("give either block_m/block_n or sram_bytes, not both")
    for name, value in (("block_m", block_m), ("block_n", block_n), ("sram_bytes", sram_bytes)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if strategy == "standard":
        return None, None
    if strategy == "cuflash":
        cfg = cuflash_config(p, backward, kernels=kernels)
        return cfg.block_m, cfg.block_n
    if block_m is not None:
        return int(block_m), int(block_n)
    if strategy == "fa1" or sram_bytes is not None:
        blocks = fa1_blocks(p.head_dim, DEFAULT_SRAM_BYTES if sram_bytes is None else sram_bytes, p.elem_bytes)
        if blocks[1] < 1 or sram_bytes is not None and sram_bytes < 4 * p.head_dim * p.elem_bytes:
            raise ValueError(f"sram_bytes={sram_bytes} is too small for head_dim={p.head_dim}: "
                             f"need at least 4*d*elem_bytes = {4 * p.head_dim * p.elem_bytes}")
        return blocks
    return DEFAULT_FA2_BLOCKS


# ----------------------------------------------------------------------------------------------
# The FP8 forward (cuda/fwd_sm90_fp8.cuh, fwd_sm90_fp8_kernel)
# ----------------------------------------------------------------------------------------------

FP8_OUT_DTYPE = "bf16"  # O of the FP8 forward the analyzer counts: the library's default out_dtype (fp16: same bytes)


def fp8_config(p: Problem, backward: bool = False, kernels: str = DEFAULT_KERNELS):
    """The FP8 (e4m3) forward's config for p (dtype fp8), as the library selects it (config.select of op
    "forward_fp8": a config.FwdSm90Fp8Config, fwd_sm90_fp8_kernel, O in FP8_OUT_DTYPE): forward only, on the Hopper
    family only, on the tiles the library takes for the problem's key count (config.FWD_SM90_FP8_CAUSAL_LONG_KEYS). A
    sliding window selects the window instantiation (causal folded in, as the library does); the counts take the
    causal flag and the window from the problem, as cuflash_config's window kernels."""
    if backward:
        raise ValueError(f"backward=True: cuflash has no FP8 backward (dtype={p.dtype!r} counts the FP8 forward "
                         f"fwd_sm90_fp8_kernel only)")
    if kernels != DEFAULT_KERNELS:
        raise ValueError(f"kernels={kernels!r}: the FP8 forward is a wgmma kernel (fwd_sm90_fp8_kernel), with no "
                         f"mma.sync variant; dtype={p.dtype!r} needs kernels={DEFAULT_KERNELS!r}")
    if p.head_dim not in _config.FWD_SM90_FP8_TILES:
        raise ValueError(f"head_dim={p.head_dim} is not supported by the FP8 forward (fwd_sm90_fp8_kernel); "
                         f"supported: {', '.join(map(str, _config.FWD_SM90_FP8_TILES))}")
    if not runs_window_kernel(p):
        return _config.select("forward_fp8", p.head_dim, FP8_OUT_DTYPE, p.causal, ARCH, kernels=kernels,
                              seqlen_k=p.seqlen_k)
    cfg = _config.select("forward_fp8", p.head_dim, FP8_OUT_DTYPE, False, ARCH, mods=_config.MOD_WINDOW,
                         kernels=kernels)
    return dataclasses.replace(cfg, causal=p.causal, window=False)


def cuflash_config(p: Problem, backward: bool = False, deterministic: bool = False, kernels: str = DEFAULT_KERNELS):
    """The kernel configuration cuflash launches for this problem on an H100: forward_kernel_config, or for
    the backward the main kernel's backward_kernel_config (deterministic selects the deterministic instantiation:
    dQ added in a fixed order, config.ordered_dq, or not at all, bwd_dq_kernel then computing it; main_adds_dq).
    kernels: "auto" (the library's default: the registry's first family that runs the call, for 16-bit inputs
    a FwdSm90WsConfig (fwd_sm90_ws_kernel, TMA) at every head dim and a BwdSm90WsConfig (bwd_sm90_ws_kernel) at
    kernel head dims 32 to 128 or a BwdSm90SplitConfig (bwd_sm90_split_kernel) at 192 and 256, a BwdConfig where
    the modifiers rule those out) or "mma" (FwdConfig / BwdConfig, as with CUFLASH_KERNELS=mma). The analyzer
    counts dense contiguous inputs, which TMA describes; a sliding window is a score modifier (MOD_WINDOW,
    runs_window_kernel): a windowed forward counts the tiles of the library's window kernel. For fp32, tf32 and
    fp64 the registry picks the wide kernels (FwdWideConfig / BwdWideConfig, cuda/wide.cuh), whose tiles are the same
    on every target and for both families, except, with "auto", the fp32 / tf32 forward and backward at kernel head
    dims 32, 64 and 128 (no score modifier but a window and a bias), which are the TF32 wgmma kernels
    (FwdSm90Tf32Config, cuda/fwd_sm90_tf32.cuh; BwdSm90Tf32Config, cuda/bwd_sm90_tf32.cuh, whose dQ kernel is its
    dq_config; a window selects the same tiles). Deterministic, the wide backward is the ordered bwd_wide_kernel
    (BwdWideConfig deterministic, config.ordered_dq; the float64 one on config.BWD_WIDE_TILES_DET's tiles at head
    dims 64 and 128), and the TF32 one, which sums dQ without atomics, is its default instantiation (deterministic
    as it is). For fp8 the FP8 forward (config.FwdSm90Fp8Config, fp8_config): forward only."""
    check_kernels(kernels)
    if p.dtype in FP8_DTYPES:
        return fp8_config(p, backward, kernels)
    dtypes = _config.DTYPES + _config.WIDE_DTYPES
    if p.dtype not in dtypes:
        raise ValueError(f"strategy 'cuflash' runs dtype {'/'.join(dtypes)} only (got dtype={p.dtype!r})")
    hd = _config.kernel_head_dim(p.head_dim, p.dtype)
    if p.head_dim % _config.CHUNK_ELEMS:
        raise ValueError(f"strategy 'cuflash' needs head_dim a multiple of {_config.CHUNK_ELEMS}, as the library "
                         f"(got head_dim={p.head_dim})")
    if backward:  # the main backward kernel: K/V-outer, dQ into dq_accum where main_adds_dq
        return _config.backward_kernel_config(hd, p.dtype, p.causal, deterministic, ARCH, kernels)
    if not runs_window_kernel(p):
        return _config.forward_kernel_config(hd, p.dtype, p.causal, ARCH, kernels, seqlen_k=p.seqlen_k)
    # the library's kernel of the window (MOD_WINDOW, causal folded in as right = 0) gives the tiles; the counts
    # take the causal flag and the window from the problem
    cfg = _config.forward_kernel_config(hd, p.dtype, False, ARCH, kernels, mods=_config.MOD_WINDOW)
    if isinstance(cfg, _config.FwdSm90Tf32Config):  # its window is a flag (the tiles are the same)
        return dataclasses.replace(cfg, causal=p.causal, window=False)
    return dataclasses.replace(cfg, causal=p.causal, mods=0)


def bwd_main_config(p: Problem, deterministic: bool = False, kernels: str = DEFAULT_KERNELS, main=None):
    """The backward main kernel's config: `main` where given (in place of the library's choice; its deterministic
    flag must be the call's), else cuflash_config's."""
    if main is None:
        return cuflash_config(p, backward=True, deterministic=deterministic, kernels=kernels)
    if getattr(main, "deterministic", False) != bool(deterministic):
        raise ValueError(f"main={main!r} has deterministic={getattr(main, 'deterministic', False)}, the call "
                         f"deterministic={deterministic}")
    return main


def runs_window_kernel(p: Problem) -> bool:
    """Whether the library runs p's window as a score modifier (MOD_WINDOW), as cuflash._validate.check_mods
    folds it: with causal folded in (masks.band_sides), (-1, -1) is no window and (-1, 0) plain causal."""
    left, right = band_sides(p.causal, p.window)
    return left is not None or right not in (None, 0)
