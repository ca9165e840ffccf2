"""Closed-form, tile-loop counts of HBM/SRAM traffic and FLOPs for each tiling strategy.

Strategies (docs/IO_ANALYSIS.md):
  standard  S = QK^T, P = softmax(S), O = PV as separate passes, S and P in HBM (FlashAttention paper
            Algorithm 0; backward Algorithm 3 with dP and dS in HBM).
  fa1       FlashAttention-1, Algorithm 1 / 4: K/V blocks outer, Q blocks inner; O, l, m (forward) and
            dQ (backward) are re-read and re-written in HBM on every outer step.
            B_c = ceil(M / 4d), B_r = min(B_c, d) from an SRAM size M (elements) when blocks are not given.
  fa2       FlashAttention-2: Q blocks outer in the forward (O, m, l in registers, lse written once);
            K/V blocks outer in the backward, dQ accumulated in an fp32 buffer by read-modify-write.
  cuflash   what our kernels do on an H100 (sm_90a): the forward and backward main kernels that
            cuflash.config's forward_kernel_config / backward_kernel_config pick, by default
            (kernels="auto") the Hopper kernels where the head dim and modifiers have one (config.FAMILIES,
            the first family that runs the call; forward: the warp-specialized TMA kernel fwd_sm90_ws_kernel at
            every 16-bit head dim; backward, 16-bit: the warp-specialized TMA kernel bwd_sm90_ws_kernel at
            head dims 32 to 128 (96 on the 128 kernel, config.BWD_SM90_WS_PADDED; some modifier sets at 32 and
            64 only, config.bwd_sm90_ws_head_dims) and bwd_sm90_split_kernel at 192 and 256) and the mma.sync
            fwd_kernel / bwd_kernel elsewhere (e.g. the backward with a bias at 192 and 256); kernels="mma" counts the
            mma.sync kernels only (CUFLASH_KERNELS=mma). The synchronous bwd_sm90_kernel is counted where a
            caller passes its config (cuflash_backward_kernels' `main`: the ncu validation profiles it).
            Tiles, warps, stages and padding come from the config; the shared-memory counts and bank
            conflicts from walking every shared instruction (banks.fwd_kernel_shared, which adds the wgmma
            operand reads of the sm90 kernels and the TMA box writes of fwd_sm90_ws_kernel). The
            backward counts the launches of cuda/bwd.cuh (cuflash_backward_kernels: preprocess, the
            K/V-outer main kernel with fp32 dQ atomics (bulk reductions in bwd_sm90_ws_kernel and
            bwd_sm90_split_kernel), convert; deterministic, the warp-specialized
            bwd_sm90_ws_kernel adds the same dQ in a fixed order (config.ordered_dq) and the others run
            without atomics, followed by the Q-outer bwd_dq_kernel of dq_config), with the fp32 vectors padded
            to SEQLEN_Q_PAD rows, and walks the shared instructions of the main kernel
            (banks.bwd_kernel_shared; banks.bwd_sm90_ws_kernel_shared for bwd_sm90_ws_kernel;
            bwd_sm90_split_kernel's shared bytes are counted in its program order, not walked) and
            bwd_dq_kernel.
            fp32, tf32, fp64: the wide kernels of cuda/wide.cuh (fwd_wide_kernel, bwd_wide_kernel and their
            preprocess / convert launches, with config.select's tiles, the same on every target; deterministic,
            the ordered bwd_wide_kernel, its dQ atomics in a fixed order): global traffic, FLOPs and their
            shared-memory bytes counted in program order (_wide_fwd_shared, _wide_bwd_shared; bank_conflicts None:
            not walked).
            On sm_90a the fp32 / tf32 forward at kernel head dims 32, 64 and 128 (no modifier but a window and a
            bias) is fwd_sm90_tf32_kernel (config.FwdSm90Tf32Config, _cuflash_tf32_fwd), and the backward at the same
            head dims (128: clusters of two CTAs, `_pair_kernel`) is bwd_sm90_tf32_kernel (dK, dV;
            config.BwdSm90Tf32Config) and bwd_dq_sm90_tf32_kernel (dQ, its dq_config), no dQ accumulator and no
            atomics, deterministic as they are (deterministic=True counts the same launches): their shared-memory
            bytes are counted from their program order (_tf32_bwd_shared; bank_conflicts None).
            fp8: the FP8 forward fwd_sm90_fp8_kernel (config.FwdSm90Fp8Config, schedules.fp8_config: e4m3 Q, K,
            V, bf16 O, fwd_sm90_ws_kernel's schedule with the config's key tiles, V transposed in shared memory,
            float32 descale factors); forward only, and the only strategy that counts fp8.

Block skipping (causal and sliding window): a tile that holds no visible (query, key) pair is not
visited (masks.key_tile_range, the tile test of cuda/mask.cuh that fwd_kernel runs; the K/V-outer
backward runs masks.query_block_range); with `causal_skip=False` every tile is visited and masked in
registers. All counts loop over tiles (never elements), so N = 65536 costs microseconds. The blocks, the
visited tiles and cuflash's kernel configs come from schedules.py, which the walks (banks) and the L2
model (l2) read too.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cuflash import config as _config

from . import banks, l2
from .masks import visible_pairs
from .model import (DESCALE_BYTES, FP8_DTYPES, FP8_STRATEGIES, NONMATMUL_FLOPS, QUANT_BLOCK_ROWS, STRATEGIES, Counts,
                    Problem)
from .schedules import (
    DEFAULT_KERNELS,
    block_sizes,
    bwd_main_config,
    bwd_query_blocks,
    check_kernels,
    cuflash_config,
    dq_turns_bytes,
    key_block_ranges,
    main_adds_dq,
    resolve_blocks,
    seqlen_q_pad,
)


# ----------------------------------------------------------------------------------------------
# Block bookkeeping shared by the strategies (all per (batch, head); multiplied by batch*heads).
# ----------------------------------------------------------------------------------------------

def allowed_pairs(p: Problem) -> int:
    """(query, key) pairs the mask keeps, per (batch, head) (masks.visible_pairs: causal and window)."""
    return visible_pairs(p.seqlen_q, p.seqlen_k, p.causal, p.window)


class _Tiles:
    """The visited tiles of one (batch, head) for row blocks of block_m and key blocks of block_n."""

    def __init__(self, p: Problem, block_m: int, block_n: int, causal_skip: bool):
        self.rows = block_sizes(p.seqlen_q, block_m)  # r_i
        self.cols = block_sizes(p.seqlen_k, block_n)  # c_j
        self.n_begin, self.n_end = key_block_ranges(p, block_m, block_n, causal_skip)
        self.n_tiles = np.maximum(self.n_end - self.n_begin, 0)  # tiles visited by row block i
        # key rows read by row block i: blocks n_begin..n_end-1, only the last block of K can be a tail
        cols_cum = np.concatenate([[0], np.cumsum(self.cols)])
        self.kv_rows = np.where(self.n_tiles > 0, cols_cum[self.n_end] - cols_cum[np.minimum(self.n_begin, self.n_end)],
                                0)
        self.visits_q = self.n_tiles > 0
        # K/V-outer view: row blocks visiting column block j are those with n_begin_i <= j < n_end_i
        # (difference arrays: +1 / +r_i at n_begin_i, -1 / -r_i at n_end_i)
        t_c, live = len(self.cols), self.visits_q
        count = np.zeros(t_c + 1, dtype=np.int64)
        rows = np.zeros(t_c + 1, dtype=np.int64)
        np.add.at(count, self.n_begin[live], 1)
        np.add.at(count, self.n_end[live], -1)
        np.add.at(rows, self.n_begin[live], self.rows[live])
        np.add.at(rows, self.n_end[live], -self.rows[live])
        self.row_blocks_per_col = np.cumsum(count)[:t_c]  # count_j
        self.rows_per_col = np.cumsum(rows)[:t_c]  # R_j
        self.visits_kv = self.row_blocks_per_col > 0
        self.tiles = int(self.n_tiles.sum())
        self.area = int((self.rows * self.kv_rows).sum())  # sum over visited tiles of r_i * c_j

    def row_tiles(self) -> int:
        """sum over visited tiles of r_i (rows x tiles, for per-row-per-tile work)."""
        return int((self.rows * self.n_tiles).sum())


def _scaled(c: Counts, factor: int) -> Counts:
    for name in ("hbm_read_bytes", "hbm_write_bytes", "sram_read_bytes", "sram_write_bytes",
                 "flops_matmul", "flops_nonmatmul", "flops_useful", "peak_extra_bytes"):
        setattr(c, name, int(getattr(c, name)) * factor)
    return c


KERNEL_NAMES = {  # config type -> the __global__ function it instantiates
    _config.FwdConfig: "fwd_kernel",
    _config.FwdSm90Config: "fwd_sm90_kernel",
    _config.FwdSm90WsConfig: "fwd_sm90_ws_kernel",
    _config.BwdConfig: "bwd_kernel",
    _config.BwdSm90Config: "bwd_sm90_kernel",
    _config.BwdSm90WsConfig: "bwd_sm90_ws_kernel",
    _config.BwdSm90SplitConfig: "bwd_sm90_split_kernel",
    _config.DqConfig: "bwd_dq_kernel",
    _config.FwdWideConfig: "fwd_wide_kernel",
    _config.BwdWideConfig: "bwd_wide_kernel",
    _config.FwdSm90Fp8Config: "fwd_sm90_fp8_kernel",
    _config.FwdSm90Tf32Config: "fwd_sm90_tf32_kernel",
    _config.BwdSm90Tf32Config: "bwd_sm90_tf32_kernel",
    _config.BwdDqSm90Tf32Config: "bwd_dq_sm90_tf32_kernel",
}


def kernel_name(cfg) -> str:
    """The kernel function a config instantiates (what ncu and the launch list call it); the float32 Hopper backward
    at head dim 128 runs clusters of two CTAs, `..._pair_kernel`."""
    if type(cfg) not in KERNEL_NAMES:
        raise TypeError(f"cfg must be one of {', '.join(t.__name__ for t in KERNEL_NAMES)}, got {type(cfg).__name__}")
    name = KERNEL_NAMES[type(cfg)]
    return name.replace("_kernel", "_pair_kernel") if getattr(cfg, "split", 1) > 1 else name


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

def _standard_fwd(p: Problem) -> Counts:
    sq, sk, d, e = p.seqlen_q, p.seqlen_k, p.head_dim, p.elem_bytes
    c = Counts("standard", False, None, None)
    # S = QK^T: read Q, K, write S; P = softmax(S): read S, write P; O = PV: read P, V, write O
    c.hbm_read_bytes = e * ((sq * d + sk * d) + sq * sk + (sq * sk + sk * d))
    c.hbm_write_bytes = e * (sq * sk + sq * sk + sq * d)
    c.sram_read_bytes = c.sram_write_bytes = c.hbm_read_bytes + c.hbm_write_bytes  # staged once
    c.flops_matmul = 4 * sq * sk * d
    c.flops_nonmatmul = NONMATMUL_FLOPS["standard_fwd_per_score"] * sq * sk
    c.flops_useful = 4 * d * allowed_pairs(p)
    c.launches = 3
    c.peak_extra_bytes = 2 * sq * sk * e  # S and P are both alive while the softmax runs
    return _scaled(c, p.batch_heads)


def _fa1_fwd(p: Problem, bm: int, bn: int, causal_skip: bool) -> Counts:
    t = _Tiles(p, bm, bn, causal_skip)
    sq, d, e, s4 = p.seqlen_q, p.head_dim, p.elem_bytes, p.stat_bytes
    c = Counts("fa1", False, bm, bn)
    # K/V outer (j), Q inner (i): per visited (i, j) read Q_i, O_i, l_i, m_i; write O_i, l_i, m_i
    pair_rows = int(t.rows_per_col.sum())  # sum over visited (i, j) of r_i
    kv_loaded = int((t.cols * t.visits_kv).sum())
    c.hbm_read_bytes = 2 * kv_loaded * d * e + pair_rows * (2 * d * e + 2 * s4)
    # initialise O = 0, l = 0, m = -inf in HBM, then the per-step write-backs
    c.hbm_write_bytes = sq * (d * e + 2 * s4) + pair_rows * (d * e + 2 * s4)
    area = int((t.cols * t.rows_per_col).sum())
    # SRAM: K_j, V_j once per j; per step Q_i, O_i, l_i, m_i, S_ij (fp32), P_ij written; S = Q_i K_j^T,
    # softmax(S), P V_j and the O_i update read their operands
    c.sram_write_bytes = (2 * kv_loaded * d * e + pair_rows * (2 * d * e + 2 * s4) + area * (s4 + e))
    kv_reads = int((t.cols * t.row_blocks_per_col).sum()) * d * e  # K_j or V_j once per visited (i, j)
    c.sram_read_bytes = pair_rows * d * e + 2 * kv_reads + area * (s4 + e) + pair_rows * (d * e + 2 * s4)
    c.flops_matmul = 4 * d * area
    c.flops_nonmatmul = (NONMATMUL_FLOPS["flash_fwd_per_score"] * area
                         + pair_rows * (NONMATMUL_FLOPS["flash_fwd_per_row_tile"] + 3 + 3 * d))
    c.flops_useful = 4 * d * allowed_pairs(p)
    c.launches = 2  # memset of O, l, m; the fused kernel
    c.peak_extra_bytes = 2 * sq * s4  # l and m
    return _scaled(c, p.batch_heads)


def _fa2_fwd(p: Problem, bm: int, bn: int, causal_skip: bool, strategy: str = "fa2",
             tile_dims: tuple[int, int, int] | None = None) -> Counts:
    """Q outer (one CTA per row block), K/V blocks inner, O/m/l in registers, O and lse written once.

    tile_dims = (BLOCK_M, BLOCK_N, HEAD_DIM) counts FLOPs on whole padded tiles (cuflash); None counts
    the real tail sizes (the paper's algorithm)."""
    t = _Tiles(p, bm, bn, causal_skip)
    sq, d, e, s4 = p.seqlen_q, p.head_dim, p.elem_bytes, p.stat_bytes
    c = Counts(strategy, False, bm, bn)
    q_rows = int((t.rows * t.visits_q).sum())
    kv_rows = int(t.kv_rows.sum())
    c.hbm_read_bytes = (q_rows + 2 * kv_rows) * d * e  # Q once, K and V once per Q block
    c.hbm_write_bytes = sq * (d * p.out_bytes + s4)  # O and lse once
    c.sram_write_bytes = (q_rows + 2 * kv_rows + sq) * d * e  # Q, K, V loads; O staged for the store
    c.sram_read_bytes = (t.row_tiles() + 2 * kv_rows + sq) * d * e  # Q per tile, K, V once, O
    if tile_dims is None:
        area, row_tiles, dh = t.area, t.row_tiles(), d
    else:
        tm, tn, dh = tile_dims
        area, row_tiles = t.tiles * tm * tn, t.tiles * tm
    c.flops_matmul = 4 * dh * area
    c.flops_nonmatmul = (NONMATMUL_FLOPS["flash_fwd_per_score"] * area
                         + row_tiles * (NONMATMUL_FLOPS["flash_fwd_per_row_tile"] + dh) + sq * (d + 2))
    c.flops_useful = 4 * d * allowed_pairs(p)
    c.launches = 1
    c.peak_extra_bytes = 0
    return _scaled(c, p.batch_heads)


def _cuflash_fwd(p: Problem, causal_skip: bool, kernels: str = DEFAULT_KERNELS) -> Counts:
    """fwd_kernel, fwd_sm90_kernel or fwd_sm90_ws_kernel: FA2's global traffic with the config's blocks (all
    three read Q once per CTA that sees a key and K, V once per visited key tile, valid rows only: cp.async
    zero-fills the tails without reading, TMA fills out-of-bounds box rows with zeros); SRAM from the walk
    (wgmma operand reads and TMA box writes included). fp8: _cuflash_fp8_fwd; float32 on Hopper: _cuflash_tf32_fwd."""
    cfg = cuflash_config(p, kernels=kernels)
    if isinstance(cfg, _config.FwdSm90Fp8Config):
        return _cuflash_fp8_fwd(p, cfg, causal_skip)
    if isinstance(cfg, _config.FwdSm90Tf32Config):
        return _cuflash_tf32_fwd(p, cfg, causal_skip)
    if isinstance(cfg, _config.FwdWideConfig):
        return _cuflash_wide_fwd(p, cfg, causal_skip)
    c = _fa2_fwd(p, cfg.block_m, cfg.block_n, causal_skip, "cuflash", (cfg.block_m, cfg.block_n, cfg.head_dim))
    walk = banks.fwd_kernel_shared(cfg, p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim, causal_skip, p.window)
    c.sram_read_bytes = walk.read_bytes
    c.sram_write_bytes = walk.write_bytes
    c.bank_conflicts = walk.conflicts
    return c


def _cuflash_fp8_fwd(p: Problem, cfg, causal_skip: bool) -> Counts:
    """fwd_sm90_fp8_kernel: fwd_sm90_ws_kernel's global traffic with the config's tiles and 1-byte Q, K, V (TMA reads
    Q once per CTA that sees a key and K, V once per visited key tile, in-bounds rows only), O in bf16 and lse in
    float32 once, plus the float32 descale factors: q's once per CTA that sees a key (with three consumer warpgroups,
    192-row CTAs, the factors of the 128-row blocks their rows fall in: each consumer reads the block of its first
    row, or of the CTA's last row when it has none, so two distinct floats), k's and v's of each visited key tile
    (per (batch, head) factors are the same float each time, per 128-row block factors one per block: the same
    reads). FLOPs on whole tiles as the 16-bit kernels. SRAM from the walk (banks.fwd_sm90_fp8_kernel_shared: TMA
    box writes, the V transpose, wgmma operand reads)."""
    c = _fa2_fwd(p, cfg.block_m, cfg.block_n, causal_skip, "cuflash", (cfg.block_m, cfg.block_n, cfg.head_dim))
    t = _Tiles(p, cfg.block_m, cfg.block_n, causal_skip)
    row0 = np.arange(len(t.rows)) * cfg.block_m
    first = row0[:, None] + np.minimum(64 * np.arange(cfg.consumers)[None, :], t.rows[:, None] - 1)
    blocks = first // QUANT_BLOCK_ROWS
    q_floats = 1 + (blocks[:, 1:] != blocks[:, :-1]).sum(axis=1)  # distinct blocks (consumers' rows ascend)
    c.hbm_read_bytes += (int(q_floats[t.visits_q].sum()) + 2 * t.tiles) * DESCALE_BYTES * p.batch_heads
    walk = banks.fwd_kernel_shared(cfg, p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim, causal_skip, p.window)
    c.sram_read_bytes = walk.read_bytes
    c.sram_write_bytes = walk.write_bytes
    c.bank_conflicts = walk.conflicts
    return c


def _cuflash_tf32_fwd(p: Problem, cfg, causal_skip: bool) -> Counts:
    """fwd_sm90_tf32_kernel (cuda/fwd_sm90_tf32.cuh; fp32 as 3xTF32, tf32): fwd_sm90_ws_kernel's global traffic with
    the config's tiles and 4-byte Q, K, V (TMA reads Q once per CTA that sees a key and K, V once per visited key tile,
    in-bounds rows only; O and lse written once). FLOPs on whole tiles (3xTF32's three passes count as one product,
    as in _cuflash_wide_fwd). Shared memory in the kernel's program order, per CTA that sees a key: TMA writes whole
    Q, K and V boxes (HEAD_DIM columns); each is read once and its parts written (Q by the consumer warpgroups, each
    its own rows, K and V by the splitters; 3xTF32: Q's and K's small part in place and the big one beside it, V^T
    big and small; one pass: the rounded value); per visited key tile
    each consumer warpgroup's wgmma reads its 64 Q rows and the K tile for S and the V^T tile for P V, once per
    product (three with 3xTF32). Counted from these sizes, not walked: bank_conflicts is None (ncu on an H100 found
    none in the loads, and 2-way conflicts in the V^T stores of 16-key tiles, docs/PERFORMANCE.md). 3xTF32 at head
    dim 128 (cfg.split 2, `fwd_sm90_tf32_pair_kernel`): two CTAs per query block, each with 64 of the columns (the
    same global bytes; lse from one of them), and per visited key tile each consumer thread stores its S fragment
    into the other CTA's exchange slot (16 bytes per n8 tile, counted as writes of the receiving CTA) and reads the
    other's back. With cfg.q_regs the consumers read Q's A operand into registers once per CTA (ld.shared): in 3xTF32
    its big part, which two of S's three products per k8 step then take from there (Q is read by one product per key
    tile, not three); in one pass the rounded Q, which S's product takes from there (at head dim 128 the first 32
    columns only)."""
    c = _fa2_fwd(p, cfg.block_m, cfg.block_n, causal_skip, "cuflash", (cfg.block_m, cfg.block_n, cfg.head_dim))
    t = _Tiles(p, cfg.block_m, cfg.block_n, causal_skip)
    parts, products = (2, 3) if cfg.dtype == "fp32" else (1, 1)
    split = cfg.split
    ctas, tiles = split * int(t.visits_q.sum()), split * int(t.tiles)
    cols = cfg.head_dim // split  # a CTA's columns
    q_tile, kv_tile = 4 * cfg.block_m * cols, 4 * cfg.block_n * cols
    xchg = cfg.consumers * 128 * (cfg.block_n // 8) * 16 if split > 1 else 0
    c.sram_write_bytes = (ctas * q_tile * (1 + parts) + tiles * (kv_tile * (2 + 2 * parts) + xchg)) * p.batch_heads
    # Q's bytes held in registers (FwdTf32Traits::Q_REG_STEPS) and the products that take them from there
    q_held = 0 if not cfg.q_regs else q_tile if products == 3 or cols <= 64 else q_tile * 32 // cols
    q_reads = products * q_tile - (2 if products == 3 else 1) * q_held  # S's reads of Q from shared memory
    c.sram_read_bytes = (ctas * (q_tile + q_held)
                         + tiles * (2 * kv_tile + q_reads + products * 2 * cfg.consumers * kv_tile
                                    + xchg)) * p.batch_heads
    c.bank_conflicts = None
    return c


def _cuflash_wide_fwd(p: Problem, cfg, causal_skip: bool) -> Counts:
    """fwd_wide_kernel (cuda/wide.cuh; fp32, tf32, fp64): Q-outer, one CTA per (query block, v_split column part)
    that holds a column of O (parts = ceil(head_dim / (HEAD_DIM / v_split)); a part past the real head dim returns
    at once). A CTA that sees a key reads its Q rows (whole head dim) once and, per visited key tile, K (whole head
    dim) and its columns of V, valid rows and columns only (load_wide_tile zero-fills the rest without a read); it
    writes its columns of O once and part 0 writes lse (stat_bytes: float32, float64 for fp64). So Q and K are read
    `parts` times, V once. FLOPs on whole tiles: each part computes S = Q K^T over HEAD_DIM and P V over its
    HEAD_DIM / v_split columns (3xTF32's three passes count as one product). Shared-memory bytes from its program
    order (_wide_fwd_shared); bank conflicts are not walked (None)."""
    t = _Tiles(p, cfg.block_m, cfg.block_n, causal_skip)
    sq, d, e, s = p.seqlen_q, p.head_dim, p.elem_bytes, p.stat_bytes
    v_cols = cfg.head_dim // cfg.v_split
    parts = -(-d // v_cols)
    c = Counts("cuflash", False, cfg.block_m, cfg.block_n)
    q_rows = int((t.rows * t.visits_q).sum())
    kv_rows = int(t.kv_rows.sum())
    c.hbm_read_bytes = (parts * (q_rows + kv_rows) + kv_rows) * d * e
    c.hbm_write_bytes = sq * (d * e + s)
    area, row_tiles = t.tiles * cfg.block_m * cfg.block_n, t.tiles * cfg.block_m
    c.flops_matmul = 2 * area * parts * (cfg.head_dim + v_cols)
    c.flops_nonmatmul = (parts * (NONMATMUL_FLOPS["flash_fwd_per_score"] * area
                                  + row_tiles * (NONMATMUL_FLOPS["flash_fwd_per_row_tile"] + v_cols)) + sq * (d + 2))
    c.flops_useful = 4 * d * allowed_pairs(p)
    c.launches = 1
    c = _scaled(c, p.batch_heads)
    c.sram_read_bytes, c.sram_write_bytes = _wide_fwd_shared(p, cfg, causal_skip)
    c.bank_conflicts = None
    return c


def _wide_fwd_shared(p: Problem, cfg, causal_skip: bool) -> tuple[int, int]:
    """(read, write) shared-memory bytes of fwd_wide_kernel (cuda/wide.cuh), all batches and heads, counted in its
    program order: every element a thread loads or stores once per use, e the element size (4 or 8), kernel
    HEAD_DIM columns. Per CTA that sees a key (`parts` CTAs per query block, _cuflash_wide_fwd): cp.async writes
    its Q tile (BLOCK_M x HEAD_DIM, rows and columns past the data zero-filled, so whole tiles) once and, per
    visited key tile, the K tile (BLOCK_N x HEAD_DIM) and its V columns (BLOCK_N x V_COLS). Per key tile each warp
    (16 query rows) reads its Q rows and the whole K tile for S = Q K^T (A and B fragments, HEAD_DIM columns) and
    the V tile for P V (P from its accumulators): WARPS x (16 + BLOCK_N) x HEAD_DIM + WARPS x BLOCK_N x V_COLS
    elements. The softmax keeps to registers and shuffles; O and lse leave from registers."""
    t = _Tiles(p, cfg.block_m, cfg.block_n, causal_skip)
    hd, bn, nw, e = cfg.head_dim, cfg.block_n, cfg.num_warps, p.elem_bytes
    v_cols = hd // cfg.v_split
    tiles = -(-p.head_dim // v_cols) * t.tiles  # key tiles of all column parts
    write, _ = _wide_cp_async_bytes(p, cfg, causal_skip)
    read = tiles * nw * ((16 + bn) * hd + bn * v_cols) * e
    return read * p.batch_heads, write * p.batch_heads


def _wide_cp_async_bytes(p: Problem, cfg, causal_skip: bool) -> tuple[int, int]:
    """(tile bytes, row-vector bytes) that cp.async writes into shared memory in fwd_wide_kernel (a FwdWideConfig) or
    bwd_wide_kernel (a BwdWideConfig), one (batch, head): whole tiles of kernel HEAD_DIM columns (load_wide_tile
    zero-fills what lies past the data). The forward: per CTA that sees a key (every column part) its Q tile, per
    visited key tile K and its columns of V. The backward: per CTA with a step K and V, per step Q and dO; and its
    row vectors, per step BLOCK_M values each of lse_log2 and delta (the forward: 0)."""
    hd, bm, bn, e = cfg.head_dim, cfg.block_m, cfg.block_n, p.elem_bytes
    if isinstance(cfg, _config.FwdWideConfig):
        t = _Tiles(p, bm, bn, causal_skip)
        v_cols = hd // cfg.v_split
        parts = -(-p.head_dim // v_cols)
        return parts * (int(t.visits_q.sum()) * bm * hd + t.tiles * bn * (hd + v_cols)) * e, 0
    visits, _ = _bwd_visits(cfg, p, causal_skip)
    ctas, steps = int((visits > 0).sum()), int(visits.sum())
    return (ctas * 2 * bn + steps * 2 * bm) * hd * e, steps * 2 * bm * p.stat_bytes


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

def _standard_bwd(p: Problem) -> Counts:
    sq, sk, d, e = p.seqlen_q, p.seqlen_k, p.head_dim, p.elem_bytes
    c = Counts("standard", True, None, None)
    # Algorithm 3: dV = P^T dO | dP = dO V^T | dS = P o (dP - D), D = rowsum(P o dP) | dQ = dS K | dK = dS^T Q
    reads = (sq * sk + sq * d) + (sq * d + sk * d) + 2 * sq * sk + (sq * sk + sk * d) + (sq * sk + sq * d)
    writes = sk * d + sq * sk + sq * sk + sq * d + sk * d
    c.hbm_read_bytes, c.hbm_write_bytes = e * reads, e * writes
    c.sram_read_bytes = c.sram_write_bytes = c.hbm_read_bytes + c.hbm_write_bytes
    c.flops_matmul = 8 * sq * sk * d
    c.flops_nonmatmul = NONMATMUL_FLOPS["standard_bwd_per_score"] * sq * sk
    c.flops_useful = 10 * d * allowed_pairs(p)  # the problem's FLOPs (2.5 x forward), as for every strategy
    c.launches = 5
    c.peak_extra_bytes = 3 * sq * sk * e  # P (kept from the forward), dP, dS
    return _scaled(c, p.batch_heads)


def _fa1_bwd(p: Problem, bm: int, bn: int, causal_skip: bool) -> Counts:
    t = _Tiles(p, bm, bn, causal_skip)
    sq, sk, d, e, s4 = p.seqlen_q, p.seqlen_k, p.head_dim, p.elem_bytes, p.stat_bytes
    c = Counts("fa1", True, bm, bn)
    pair_rows = int(t.rows_per_col.sum())
    kv_loaded = int((t.cols * t.visits_kv).sum())
    area = int((t.cols * t.rows_per_col).sum())
    # Algorithm 4: per j load K_j, V_j; per visited (i, j) load Q_i, O_i, dO_i, dQ_i, l_i, m_i and
    # write dQ_i; per j write dK_j, dV_j. dQ, dK, dV are initialised to 0 in HBM first.
    c.hbm_read_bytes = 2 * kv_loaded * d * e + pair_rows * (4 * d * e + 2 * s4)
    c.hbm_write_bytes = (sq + 2 * sk) * d * e + pair_rows * d * e + 2 * sk * d * e
    # SRAM: loads written once; S, P (fp32 + elem), dP (fp32), dS (elem) tiles written; the five
    # products read both operands, the dS elementwise step reads P and dP
    c.sram_write_bytes = (2 * kv_loaded * d * e + pair_rows * (4 * d * e + 2 * s4)
                          + area * (s4 + e + s4 + e))
    kv_reads = int((t.cols * t.row_blocks_per_col).sum()) * d * e  # K_j or V_j once per visited (i, j)
    c.sram_read_bytes = (pair_rows * d * e * 5 + 3 * kv_reads + area * (3 * e + s4))
    c.flops_matmul = 10 * d * area
    c.flops_nonmatmul = NONMATMUL_FLOPS["flash_bwd_per_score"] * area + 2 * d * pair_rows  # D_i per step
    c.flops_useful = 10 * d * allowed_pairs(p)
    c.launches = 2  # memset of dQ, dK, dV; the fused kernel
    c.peak_extra_bytes = 0
    return _scaled(c, p.batch_heads)


def _fa2_bwd(p: Problem, bm: int, bn: int, causal_skip: bool, strategy: str = "fa2",
             tile_dims: tuple[int, int, int] | None = None) -> Counts:
    t = _Tiles(p, bm, bn, causal_skip)
    sq, sk, d, e, s4 = p.seqlen_q, p.seqlen_k, p.head_dim, p.elem_bytes, p.stat_bytes
    c = Counts(strategy, True, bm, bn)
    pair_rows = int(t.rows_per_col.sum())
    kv_loaded = int((t.cols * t.visits_kv).sum())
    # preprocess: D = rowsum(dO o O) (read O, dO, write D) and zero the fp32 dQ accumulator
    pre_r, pre_w = 2 * sq * d * e, sq * s4 + sq * d * s4
    # main (K/V outer): K_j, V_j once; per visited (i, j): Q_i, dO_i, lse_i, D_i, and dQacc_i += dS K_j
    main_r = 2 * kv_loaded * d * e + pair_rows * (2 * d * e + 2 * s4 + d * s4)
    main_w = pair_rows * d * s4 + 2 * sk * d * e  # dQacc_i per step, dK_j and dV_j once
    # convert: dQ = dQacc (fp32 -> elem)
    conv_r, conv_w = sq * d * s4, sq * d * e
    c.hbm_read_bytes = pre_r + main_r + conv_r
    c.hbm_write_bytes = pre_w + main_w + conv_w
    kv_reads = int((t.cols * t.row_blocks_per_col).sum()) * d * e
    area_real = int((t.cols * t.rows_per_col).sum())
    # SRAM: K_j, V_j, Q_i, dO_i, lse_i, D_i loaded; P and dS staged (elem) for the transposed products;
    # S = QK^T, dP = dO V^T, dV += P^T dO, dQ += dS K, dK += dS^T Q read their operands
    c.sram_write_bytes = 2 * kv_loaded * d * e + pair_rows * (2 * d * e + 2 * s4) + area_real * 2 * e
    c.sram_read_bytes = pair_rows * d * e * 4 + 3 * kv_reads + area_real * 3 * e
    if tile_dims is None:
        area, dh = area_real, d
    else:
        tm, tn, dh = tile_dims
        area = int(t.row_blocks_per_col.sum()) * tm * tn
    c.flops_matmul = 10 * dh * area
    c.flops_nonmatmul = NONMATMUL_FLOPS["flash_bwd_per_score"] * area + 2 * sq * d
    c.flops_useful = 10 * d * allowed_pairs(p)
    c.launches = 3
    c.peak_extra_bytes = sq * s4 + sq * d * s4  # D and the fp32 dQ accumulator
    return _scaled(c, p.batch_heads)


@dataclass
class KernelTraffic:
    """Global-memory traffic of one launch of the cuflash backward, all batches and heads."""

    name: str
    grid: tuple
    threads: int
    read_bytes: int  # loads (ld.global and cp.async; zero-filled chunks read nothing)
    write_bytes: int  # stores
    atomic_bytes: int = 0  # red.global.add.v2.f32 payload: the L2 reads, adds and writes these bytes


def _bwd_visits(cfg, p: Problem, causal_skip: bool) -> tuple[np.ndarray, np.ndarray]:
    """(query blocks visited, query rows loaded) per key block of bwd_kernel (schedules.bwd_query_blocks)."""
    m_begin, m_end = bwd_query_blocks(cfg, p.seqlen_q, p.seqlen_k, causal_skip, p.window)
    rows_cum = np.concatenate([[0], np.cumsum(block_sizes(p.seqlen_q, cfg.block_m))])
    visits = np.maximum(m_end - m_begin, 0)
    return visits, np.where(visits > 0, rows_cum[m_end] - rows_cum[np.minimum(m_begin, m_end)], 0)


def _dq_kernel_config(cfg, p: Problem):
    """The config of the Q-outer dQ kernel that follows the main kernel cfg: the float32 Hopper backward's own
    (BwdSm90Tf32Config.dq_config, bwd_dq_sm90_tf32_kernel), else dq_config's bwd_dq_kernel (deterministic)."""
    if isinstance(cfg, _config.BwdSm90Tf32Config):
        return cfg.dq_config()
    # the kernel head dim of the call (a padded main kernel, config.BWD_SM90_WS_PADDED, runs the next one's)
    return _config.dq_config(_config.kernel_head_dim(p.head_dim, p.dtype), p.dtype, p.causal)


def cuflash_backward_kernels(p: Problem, causal_skip: bool = True, deterministic: bool = False,
                             kernels: str = DEFAULT_KERNELS, main=None) -> list[KernelTraffic]:
    """The launches of cuflash.attention_backward and what each reads and writes (cuda/bwd.cuh; the main
    kernel is bwd_sm90_kernel (cuda/bwd_sm90.cuh) where cuflash_config picks a BwdSm90Config, with the
    same global accesses: each of its warpgroups adds DQ_COLS columns of the dQ tile, the whole tile in all):

    1. bwd_preprocess_kernel, grid (SEQLEN_Q_PAD-padded rows / 32, heads, batch): reads O and dO rows
       (head_dim columns) and lse for rows < seqlen_q; writes delta and lse_log2 for every padded row;
       where the main kernel adds dQ (schedules.main_adds_dq) zeroes dq_accum [padded rows, HEAD_DIM] fp32, and
       on the ordered path (deterministic bwd_sm90_ws_kernel or bwd_wide_kernel, config.ordered_dq) its turn
       counters dq_turns (one int32 per config.turn_rows padded rows: 64, 16 for bwd_wide_kernel).
    2. bwd_kernel (or bwd_sm90_ws_kernel / bwd_sm90_kernel / bwd_sm90_split_kernel, the last at kernel head
       dims 192 and 256 with BLOCK_N = 64 keys, its two warpgroups adding half the dQ columns each), grid
       (ceil(Sk / BLOCK_N), heads, batch): K_j, V_j (valid keys) once; per visited query block Q_i and dO_i
       (valid rows), lse_log2 and delta (BLOCK_M floats, pad rows included) and, where it adds dQ,
       red.global.add.v2.f32 of the whole [BLOCK_M, HEAD_DIM] dQ tile into dq_accum (pad rows and padded
       columns included); writes dK_j, dV_j (or zeros when no query sees the block). On the ordered path the
       same bulk reductions, issued in a fixed order of key blocks per query block, plus per visited query block
       one 4-byte red.release add to its counter (counted as atomic bytes; the ld.acquire polls of the counter,
       at least one 4-byte read per visit, are not counted).
    3. bwd_convert_dq_kernel (where the main kernel adds dQ): reads dq_accum (head_dim columns of rows < Sq),
       writes dQ; bwd_convert_dq_ws_kernel after bwd_sm90_ws_kernel and bwd_sm90_split_kernel (whose dQ adds are
       bulk reductions, or 16-byte red.global.add.v4.f32, of the same bytes): the same, for every row of the
       BLOCK_M-row blocks that hold a row < Sq.
    3b. bwd_dq_kernel (deterministic, but for the ordered path), grid (ceil(Sq / BLOCK_M), heads, batch) of
       dq_config: per CTA that sees a key Q_i, dO_i, BLOCK_M lse_log2 and delta values, K_j and V_j per visited
       key tile; writes dQ_i.

    fp32, tf32 and fp64 (cuda/wide.cuh, a BwdWideConfig) run the same three launches with the same accesses:
    bwd_wide_preprocess_kernel, bwd_wide_kernel (K/V-outer; dQ tile atomics, float64 atomicAdd for fp64) and
    bwd_wide_convert_dq_kernel (one thread per pair of elements); lse, lse_log2, delta and dq_accum are
    stat_bytes wide (float32, float64 for fp64). Deterministic, the same three launches with the ordered
    bwd_wide_kernel (BwdWideConfig deterministic; at fp64 head dims 64 and 128 on config.BWD_WIDE_TILES_DET's
    tiles): the preprocess also zeroes the turn counters (an int32 per WIDE_TURN_ROWS = 16 padded rows), and the main
    kernel issues the same dQ atomics in a fixed order of key blocks, plus per visited query block one 4-byte
    red.release add to the block's counter (atomic bytes; the ld.acquire polls are not counted), its key blocks
    launched last-first with causal or a window (schedules.bwd_key_blocks_reversed).

    fp32 and tf32 at kernel head dims 32, 64 and 128 on sm_90a (a BwdSm90Tf32Config, cuda/bwd_sm90_tf32.cuh; at 128
    the `_pair_kernel`s, clusters of two CTAs of 64 columns, each reading the lse_log2 and delta of its block) have
    no dQ accumulator: bwd_wide_preprocess_kernel (1. without dq_accum to zero), bwd_sm90_tf32_kernel, grid
    (ceil(Sk / BLOCK_N), heads, batch; BLOCK_N 64 per consumer warpgroup), with 2.'s accesses without atomics (TMA reads K_j, V_j once and Q_i, dO_i of
    every step of BLOCK_M queries, in-bounds rows only), and bwd_dq_sm90_tf32_kernel of cfg.dq_config() with 3b.'s
    accesses (TMA reads Q_i, dO_i once per CTA that sees a key and K_j, V_j per visited key tile): dQ, dK and dV
    are written once each (zeros where no query or key is seen). They have no atomics and are deterministic as they
    are: deterministic=True runs (and counts) the same launches.

    main: the main kernel's config in place of the library's choice, deterministic as the call (the ncu validation
    profiles the synchronous bwd_sm90_kernel, whose steps are 64 queries where the library's warp-specialized kernel
    takes 128; schedules.bwd_main_config)."""
    cfg = bwd_main_config(p, deterministic, kernels, main)
    tf32 = isinstance(cfg, _config.BwdSm90Tf32Config)
    wide = isinstance(cfg, _config.BwdWideConfig) or tf32
    dq_kernel = not main_adds_dq(cfg)  # dQ from a Q-outer kernel: no accumulator, no atomics
    ordered = _config.ordered_dq(cfg)  # dQ adds in a fixed order, counted in dq_turns
    bh, sq, sk, d, e, s4 = p.batch_heads, p.seqlen_q, p.seqlen_k, p.head_dim, p.elem_bytes, p.stat_bytes
    hd, pad = cfg.head_dim, seqlen_q_pad(sq)
    # dq_accum per (batch, head), and its counters on the ordered path
    acc_bytes = (0 if dq_kernel else pad * hd * s4) + (dq_turns_bytes(cfg, sq) if ordered else 0)
    pre = _config.ElementwiseConfig("preprocess", p.dtype)
    out = [KernelTraffic("bwd_wide_preprocess_kernel" if wide else "bwd_preprocess_kernel",
                         (pad // pre.rows_per_cta, p.heads, p.batch), pre.threads,
                         bh * (2 * sq * d * e + sq * s4), bh * (2 * pad * s4 + acc_bytes))]
    visits, q_rows = _bwd_visits(cfg, p, causal_skip)
    keys = block_sizes(sk, cfg.block_n)
    split = getattr(cfg, "split", 1)  # CTAs sharing a block's head dim (each reads the block's lse_log2, delta)
    reads = 2 * int((keys * (visits > 0)).sum()) * d * e + 2 * int(q_rows.sum()) * d * e \
        + 2 * int(visits.sum()) * cfg.block_m * s4 * split
    atomics = 0 if dq_kernel else int(visits.sum()) * (cfg.block_m * hd * s4 + (4 if ordered else 0))
    out.append(KernelTraffic(kernel_name(cfg), cfg.grid(p.batch, p.heads, sk), cfg.threads, bh * reads,
                             bh * 2 * sk * d * e, bh * atomics))
    if dq_kernel:
        dcfg = _dq_kernel_config(cfg, p)
        t = _Tiles(p, dcfg.block_m, dcfg.block_n, causal_skip)
        reads = (2 * int((t.rows * t.visits_q).sum()) * d * e
                 + 2 * int(t.visits_q.sum()) * dcfg.block_m * s4 * getattr(dcfg, "split", 1)
                 + 2 * int(t.kv_rows.sum()) * d * e)
        out.append(KernelTraffic(kernel_name(dcfg), dcfg.grid(p.batch, p.heads, sq), dcfg.threads, bh * reads,
                                 bh * sq * d * e))
    elif isinstance(cfg, (_config.BwdSm90WsConfig, _config.BwdSm90SplitConfig)):
        # one CTA of 256 threads per BLOCK_M-row block of dQ_acc (in the main kernel's accumulator order, staged in
        # shared memory to rows): head_dim columns of every row of the blocks that hold a row < Sq
        rows = -(-sq // cfg.block_m) * cfg.block_m
        out.append(KernelTraffic("bwd_convert_dq_ws_kernel", (rows // cfg.block_m, p.heads, p.batch), 256,
                                 bh * rows * d * s4, bh * sq * d * e))
    else:  # one thread per 8 elements (a 16-byte chunk), per pair of elements in the wide kernel
        per_thread = 2 if wide else 8
        out.append(KernelTraffic("bwd_wide_convert_dq_kernel" if wide else "bwd_convert_dq_kernel",
                                 (-(-sq * (d // per_thread) // 256), p.heads, p.batch), 256,
                                 bh * sq * d * s4, bh * sq * d * e))
    return out


def _tf32_bwd_shared(p: Problem, cfg, causal_skip: bool) -> tuple[int, int]:
    """(read, write) shared-memory bytes of the float32 Hopper backward's two kernels (cuda/bwd_sm90_tf32.cuh; fp32 as
    3xTF32, tf32), all batches and heads, counted in the kernels' program order as _cuflash_tf32_fwd counts the
    forward's (parts: 2 with 3xTF32, its big and small part, else 1, the rounded value; products: 3 with 3xTF32,
    else 1; every tile float32, HEAD_DIM columns, whole boxes).

    Each TMA box is read once and its parts written (3xTF32: the small part in place and the big one beside it; one
    pass: the rounded value in place), and for the tiles a GEMM takes transposed also the transpose in as many parts:
    the boxes a CTA loads once (K and V here, Q and dO in the dQ kernel) by the consumer warpgroups, each its own 64
    rows, the per-step or per-tile boxes by the splitters.
    bwd_sm90_tf32_kernel, per CTA with a step (a CTA whose keys no query sees stores zeros without shared memory):
    TMA writes the K and V boxes (BLOCK_N = 128 rows) once and, every step, the Q and dO boxes (BLOCK_M rows) and
    BLOCK_M floats each of lse_log2 and delta; the consumers prepare K, V and the splitters, per step, Q, dO with
    Q^T, dO^T; per step each of the two consumer warpgroups (64 keys each) reads its lse_log2 and delta columns (two
    floats per n8 tile and thread) and its wgmma read its K rows and Q for S^T, its V rows and dO for dP^T, dO^T for
    dV and Q^T for dK, once per product. dK and dV leave from registers.
    bwd_dq_sm90_tf32_kernel, per CTA that sees a key: TMA writes the Q and dO boxes (BLOCK_M = 64 * CONSUMERS rows)
    once and the K and V boxes of every visited key tile; the consumers prepare Q, dO and the splitters, per key
    tile, K with K^T and V; per key tile each consumer warpgroup's wgmma reads its 64 rows of Q and the K tile for S,
    its rows of dO and the V tile for dP, and K^T for dQ, once per product. dQ leaves from registers.
    Head dim 128 (cfg.split 2, the `_pair_kernel`s): each CTA of a pair does the above on its 64 columns, and per step
    (dK / dV) or key tile (dQ) each consumer thread stores its fragments of S and dP into the other CTA's exchange
    slots (st.async, 16 bytes per n8 tile each; counted as writes of the receiving CTA) and reads the other's back.
    The dQ kernel's a_regs: the consumers read Q's (1) or Q's and dO's (2) A operands into registers once per CTA, and
    two of the three products of S (dP) per k8 step take their big parts from there (3xTF32), or its one product the
    rounded values (one pass)."""
    parts, products = (2, 3) if cfg.dtype == "fp32" else (1, 1)
    split = cfg.split
    hd, bm, bn = cfg.head_dim // split, cfg.block_m, cfg.block_n  # a CTA's columns
    visits, _ = _bwd_visits(cfg, p, causal_skip)
    ctas, steps = split * int((visits > 0).sum()), split * int(visits.sum())
    q_tile, kv_tile = 4 * bm * hd, 4 * bn * hd
    consumers = bn // 64
    xchg = consumers * 128 * 2 * (bm // 8) * 16 if split > 1 else 0  # a step's S^T and dP^T fragments
    # per CTA: TMA K, V and their parts; per step: TMA Q, dO, lse_log2, delta, the parts and transposes of Q, dO
    write = ctas * kv_tile * (2 + 2 * parts) + steps * (q_tile * (2 + 4 * parts) + 2 * 4 * bm + xchg)
    # per CTA: the consumers' split of K, V (and K's big part into registers over the config's k_reg_steps of the
    # hd / 8 k8 steps); per step: the splitters' Q, dO, each consumer thread's lse_log2 and delta (bm / 8 float2
    # each), the wgmma operands (K, Q; V, dO; dO^T; Q^T) of each consumer, but K's big part where it is in registers
    # (two of the three products of those k8 steps)
    k_big_regs = kv_tile * cfg.k_reg_steps * 8 // hd  # bytes of K's big part held in registers
    read = ctas * (2 * kv_tile + k_big_regs) + steps * (2 * q_tile + consumers * 128 * 2 * (bm // 8) * 8
                                                         + products * (2 * kv_tile + consumers * 4 * q_tile)
                                                         - 2 * k_big_regs + xchg)
    dcfg = cfg.dq_config()
    t = _Tiles(p, dcfg.block_m, dcfg.block_n, causal_skip)
    ctas, tiles = split * int(t.visits_q.sum()), split * int(t.tiles)
    q_tile, kv_tile = 4 * dcfg.block_m * hd, 4 * dcfg.block_n * hd
    xchg = dcfg.consumers * 128 * 2 * (dcfg.block_n // 8) * 16 if split > 1 else 0  # a key tile's S and dP
    # per CTA: TMA Q, dO and their parts; per key tile: TMA K, V, their parts and K^T's
    write += ctas * q_tile * (2 + 2 * parts) + tiles * (kv_tile * (2 + 3 * parts) + xchg)
    # per CTA: the consumers' split of Q, dO; per key tile: the splitters' K, V, each consumer's wgmma operands (its
    # Q rows and K; its dO rows and V; K^T)
    # the products of S and dP that read Q or dO from shared memory
    q_products = 2 * products - dcfg.a_regs * (2 if products == 3 else 1)
    read += ctas * (2 + dcfg.a_regs) * q_tile + tiles * (2 * kv_tile + q_products * q_tile
                                                          + products * 3 * dcfg.consumers * kv_tile + xchg)
    return read * p.batch_heads, write * p.batch_heads


def _split_bwd_shared(p: Problem, cfg, causal_skip: bool, no_dq: bool) -> tuple[int, int]:
    """(read, write) shared-memory bytes of bwd_sm90_split_kernel (cuda/bwd_sm90_split.cuh: head dims 192 and 256;
    two warpgroups share a CTA's BLOCK_N = 64 keys, each with half the head dim of dK and dV), all batches and heads,
    counted in its program order (16-bit tiles, HEAD_DIM columns). Per CTA with a step (a CTA whose keys no query
    sees stores zeros without shared memory): TMA writes K and V once and the epilogue stages dK and dV in their
    tiles and reads them back for the global stores. Per step: TMA writes Q, dO and BLOCK_M floats each of
    lse_log2 and delta; warpgroup 0's S^T wgmma reads K and Q, warpgroup 1's dP^T reads V and dO; warpgroup 0 reads
    its lse_log2 columns and writes P^T, warpgroup 1 reads its delta columns and P^T and writes dS^T (two floats of
    each vector per n8 tile and thread, 4 bytes of P^T and of dS^T per element); the dV GEMMs read dO (a half each)
    and, warpgroup 1's, P^T; the dK GEMMs read dS^T (each) and Q (a half each); where the kernel adds dQ (not no_dq:
    not deterministic, or ordered) the dQ GEMMs read dS^T (each, once per chunk of cfg.dq_chunk columns) and K (a
    half each); dQ leaves from their registers
    (red.global.add.v4.f32). Bank conflicts are not walked."""
    hd, bm, bn = cfg.head_dim, cfg.block_m, cfg.block_n
    visits, _ = _bwd_visits(cfg, p, causal_skip)
    ctas, steps = int((visits > 0).sum()), int(visits.sum())
    q_tile, kv_tile, ds_tile, vecs = 2 * bm * hd, 2 * bn * hd, 2 * bn * bm, 128 * 8 * (bm // 8)
    write = ctas * 2 * kv_tile * 2 + steps * (2 * q_tile + 2 * 4 * bm + 2 * ds_tile)
    dq = 0 if no_dq else 2 * (hd // 2 // cfg.dq_chunk) * ds_tile + kv_tile  # dS^T per chunk, each warpgroup
    read = ctas * 2 * kv_tile + steps * (2 * (kv_tile + q_tile) + 2 * vecs + ds_tile + (q_tile + ds_tile)
                                         + (2 * ds_tile + q_tile) + dq)
    return read * p.batch_heads, write * p.batch_heads


def _wide_bwd_shared(p: Problem, cfg, causal_skip: bool) -> tuple[int, int]:
    """(read, write) shared-memory bytes of bwd_wide_kernel (cuda/wide.cuh; fp32, tf32, fp64, ordered or not), all
    batches and heads, counted in its program order: every element a thread loads or stores once per use (a value
    two fragment slots share, as lse_log2[2t] for c = 0 and 2, once), e the element size, a the accumulator's
    (sizeof(Acc): 4, 8 for fp64), kernel HEAD_DIM columns, whole tiles (cp.async zero-fills what lies past the data).

    Per CTA with a step (a CTA whose keys no query sees stores zeros without shared memory): cp.async writes the K
    and V tiles (BLOCK_N x HEAD_DIM) once. Per step (a visited query block): cp.async writes the Q and dO tiles
    (BLOCK_M x HEAD_DIM) and BLOCK_M values each of lse_log2 and delta. A key group (16 keys) has D_SPLIT warps, each
    with HEAD_DIM / D_SPLIT columns of dK and dV. Per warp:
      S^T = K Q^T and dP^T = V dO^T over its head-dim slice: its 16 key rows and the BLOCK_M query rows of that slice;
      with D_SPLIT > 1 each of the two sums passes through the exchange slots (sum_slices: the warp stores its
      16 x BLOCK_M partial sums, reads the D_SPLIT - 1 others');
      P^T and dS^T read two lse_log2 / delta values per n8 query tile and thread;
      dV += P^T dO and dK += dS^T Q: BLOCK_M x HEAD_DIM / D_SPLIT of dO and of Q (A from its accumulators);
      the group's first warp stores dS (16 x BLOCK_M, accumulator type) for the dQ GEMM, in which each warp of the
      DQ_WARPS_M x DQ_WARPS_D grid reads its dS rows (A, all BLOCK_N keys) and its K^T columns (B).
    float64 with D_SPLIT > 1 splits S^T by queries instead (the forward's order of sums): OWNERS warps of a group
    (all, or the first Q_TILES where a group has more warps than n8 query tiles) each read the 16 key rows and their
    BLOCK_M / OWNERS query rows over the whole head dim, read their lse_log2 values and store their P^T tiles in the
    exchange slots, from which every warp of the group reads the whole 16 x BLOCK_M P^T; dP^T as above.
    dK and dV leave from registers; dQ's adds go to global memory."""
    hd, bm, bn, nw, ds = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.d_split
    e, a = p.elem_bytes, p.stat_bytes
    key_warps = nw // ds
    q_tiles = bm // 8
    dq_warps_m = min(nw, bm // 16)
    dq_warps_d = nw // dq_warps_m
    visits, _ = _bwd_visits(cfg, p, causal_skip)
    steps = int(visits.sum())
    own_queries = p.dtype == "fp64" and ds > 1
    sums = 16 * bm * a  # one warp's 16 x BLOCK_M partial sums (or P^T)
    slice_gemm = key_warps * (16 + bm) * hd * e  # S^T or dP^T over the warps' head-dim slices
    vec = nw * 8 * bm * a  # each warp: 2 values per n8 query tile and thread
    if own_queries:
        qs = max(1, q_tiles // ds)
        owners = q_tiles // qs
        s_read = key_warps * (owners * 16 + bm) * hd * e + nw * sums + key_warps * 8 * bm * a
        s_write = key_warps * sums
    else:
        s_read = slice_gemm + (nw * (ds - 1) * sums if ds > 1 else 0) + vec
        s_write = nw * sums if ds > 1 else 0
    dp_read = slice_gemm + (nw * (ds - 1) * sums if ds > 1 else 0) + vec
    dp_write = nw * sums if ds > 1 else 0
    dkv_read = 2 * key_warps * bm * hd * e  # dV (dO) and dK (Q), each warp its slice's columns
    dq_read = dq_warps_d * bm * bn * a + dq_warps_m * hd * bn * e
    tiles, vecs = _wide_cp_async_bytes(p, cfg, causal_skip)
    write = tiles + vecs + steps * (s_write + dp_write + key_warps * sums)  # cp.async, then the STS
    read = steps * (s_read + dp_read + dkv_read + dq_read)
    return read * p.batch_heads, write * p.batch_heads


def _cuflash_bwd(p: Problem, causal_skip: bool, deterministic: bool = False,
                 kernels: str = DEFAULT_KERNELS) -> Counts:
    """cuflash.attention_backward: the launches of cuflash_backward_kernels. Atomics count as a read and
    a write of their bytes (the accumulator's read-modify-write, as FA2's dQ); SRAM traffic and bank
    conflicts from walking every shared access of the main kernel (and bwd_dq_kernel). The wide kernels
    (fp32, tf32, fp64): global traffic, FLOPs (3xTF32 counted as one product) and shared-memory bytes from their
    program order (_wide_bwd_shared; bank_conflicts None: not walked). The float32 Hopper backward (bwd_sm90_tf32_kernel and
    bwd_dq_sm90_tf32_kernel): global traffic and FLOPs as a 16-bit deterministic backward's with bwd_dq_kernel (S^T
    and dP^T in the dK / dV kernel, S and dP again in the dQ kernel: 7 products instead of 5, 3xTF32's passes
    counted as one), shared-memory bytes from its program order (_tf32_bwd_shared), bank_conflicts None (not
    walked). peak_extra_bytes: lse_log2 and delta, and where the main kernel adds dQ (schedules.main_adds_dq)
    dq_accum, with its turn counters on the ordered path (config.ordered_dq: an int32 per config.turn_rows padded
    rows)."""
    cfg = cuflash_config(p, backward=True, deterministic=deterministic, kernels=kernels)
    launches = cuflash_backward_kernels(p, causal_skip, deterministic, kernels)
    c = Counts("cuflash", True, cfg.block_m, cfg.block_n)
    c.hbm_read_bytes = sum(k.read_bytes + k.atomic_bytes for k in launches)
    c.hbm_write_bytes = sum(k.write_bytes + k.atomic_bytes for k in launches)
    tf32 = isinstance(cfg, _config.BwdSm90Tf32Config)
    wide = isinstance(cfg, _config.BwdWideConfig)
    split = isinstance(cfg, _config.BwdSm90SplitConfig)
    dq_kernel = not main_adds_dq(cfg)  # dQ from a Q-outer kernel instead of atomics
    walks = [] if wide or tf32 or split else [banks.bwd_kernel_shared(cfg, p.batch, p.heads, p.seqlen_q, p.seqlen_k,
                                                             p.head_dim, causal_skip, p.window)]
    hd, bm, bn = cfg.head_dim, cfg.block_m, cfg.block_n
    # S^T and dP^T are computed by each of the D_SPLIT warps of a key group in bwd_kernel; bwd_wide_kernel's warps
    # each sum their head-dim slice and add the slices (the softmax work stays per warp); a wgmma warpgroup owns its
    # 64 keys whole, so bwd_sm90_kernel and bwd_sm90_tf32_kernel compute them once
    ds = cfg.d_split if isinstance(cfg, (_config.BwdConfig, _config.BwdWideConfig)) else 1
    ds_mm = 1 if wide else ds
    visits = int(_bwd_visits(cfg, p, causal_skip)[0].sum())
    # per visit: S^T and dP^T (D_SPLIT times but in the wide kernels), dV and dK, dQ (atomic mode)
    c.flops_matmul = visits * 2 * bm * bn * hd * (2 * ds_mm + 2 + (0 if dq_kernel else 1))
    scores = visits * ds * bm * bn
    if dq_kernel:
        dcfg = _dq_kernel_config(cfg, p)
        if not tf32:
            walks.append(banks.dq_kernel_shared(dcfg, p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim,
                                                causal_skip, p.window))
        tiles = _Tiles(p, dcfg.block_m, dcfg.block_n, causal_skip).tiles
        c.flops_matmul += tiles * 3 * 2 * dcfg.block_m * dcfg.block_n * hd  # S, dP and dQ recomputed per tile
        scores += tiles * dcfg.block_m * dcfg.block_n
    c.flops_matmul *= p.batch_heads
    c.flops_nonmatmul = (NONMATMUL_FLOPS["flash_bwd_per_score"] * scores + 2 * p.seqlen_q * p.head_dim) * p.batch_heads
    c.flops_useful = 10 * p.head_dim * allowed_pairs(p) * p.batch_heads
    if wide:  # counted from the program order, not walked
        c.sram_read_bytes, c.sram_write_bytes = _wide_bwd_shared(p, cfg, causal_skip)
        c.bank_conflicts = None
    elif tf32:  # counted from the program order, not walked
        c.sram_read_bytes, c.sram_write_bytes = _tf32_bwd_shared(p, cfg, causal_skip)
        c.bank_conflicts = None
    elif split:  # the same, for the main kernel; bwd_dq_kernel (deterministic, not ordered) walked
        r, w = _split_bwd_shared(p, cfg, causal_skip, not main_adds_dq(cfg))
        c.sram_read_bytes = r + sum(x.read_bytes for x in walks)
        c.sram_write_bytes = w + sum(x.write_bytes for x in walks)
        c.bank_conflicts = None
    else:
        c.sram_read_bytes = sum(w.read_bytes for w in walks)
        c.sram_write_bytes = sum(w.write_bytes for w in walks)
        c.bank_conflicts = sum(w.conflicts for w in walks)
    c.launches = len(launches)
    pad = seqlen_q_pad(p.seqlen_q)
    s = p.stat_bytes
    turns = dq_turns_bytes(cfg, p.seqlen_q) if _config.ordered_dq(cfg) else 0  # the ordered path's counters
    c.peak_extra_bytes = p.batch_heads * (2 * pad * s + (0 if dq_kernel else pad * hd * s) + turns)
    return c


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------

def simulate(strategy: str, problem: Problem, *, backward: bool = False, block_m: int | None = None,
             block_n: int | None = None, sram_bytes: int | None = None, causal_skip: bool = True,
             l2_bytes: int | None = None, num_sms: int | None = None, deterministic: bool = False,
             kernels: str = DEFAULT_KERNELS) -> Counts:
    """Count what `strategy` moves and computes for `problem` (forward, or backward with backward=True).

    problem.causal and problem.window (sliding window) skip the tiles outside the band (masks.py);
    causal_skip=False visits every tile and masks in registers instead.
    block_m/block_n (B_r/B_c) or sram_bytes (M, from which FA1's rule derives the blocks) apply to fa1
    and fa2; `standard` has no blocks and `cuflash` takes its blocks from cuflash.config. With
    l2_bytes, an LRU model of an L2 of that size (see l2.py) adds dram_read_bytes / dram_write_bytes.
    deterministic=True (cuflash backward only) counts attention_backward(..., deterministic=True): on
    bwd_sm90_ws_kernel and, for fp32 / tf32 / fp64, bwd_wide_kernel (config.ordered_dq) the default launches, their
    dQ adds in a fixed order with a turn counter per 64 rows of dq_accum (16 in bwd_wide_kernel); on the other
    16-bit main kernels the kernel without dQ atomics plus bwd_dq_kernel instead of the conversion kernel
    (cuflash_backward_kernels); the float32 Hopper backward (BwdSm90Tf32Config) has no atomics and counts as in the
    default mode. kernels (cuflash only): "auto", what the library launches on an H100 by default (the wgmma kernels
    where the head dim has one), or "mma", the mma.sync kernels (CUFLASH_KERNELS=mma). problem.dtype "fp8" counts
    cuflash's FP8 forward (fwd_sm90_fp8_kernel; no backward, no other strategy)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not known; known: {', '.join(STRATEGIES)}")
    check_kernels(kernels)
    if kernels != DEFAULT_KERNELS and strategy != "cuflash":
        raise ValueError(f"kernels={kernels!r} selects cuflash's kernel family: it needs strategy='cuflash' "
                         f"(got strategy={strategy!r})")
    if not isinstance(problem, Problem):
        raise TypeError(f"problem must be a cuflash.simulator.Problem, got {type(problem).__name__}")
    if problem.dtype in FP8_DTYPES:
        if strategy not in FP8_STRATEGIES:
            raise ValueError(f"dtype={problem.dtype!r} is counted for strategy {', '.join(map(repr, FP8_STRATEGIES))} "
                             f"only (cuflash's FP8 forward, fwd_sm90_fp8_kernel); got strategy={strategy!r}")
        if backward:
            raise ValueError(f"backward=True: cuflash has no FP8 backward; dtype={problem.dtype!r} counts the "
                             f"forward only")
    if deterministic and not (strategy == "cuflash" and backward):
        raise ValueError("deterministic=True selects cuflash's deterministic backward: it needs strategy='cuflash' "
                         f"and backward=True (got strategy={strategy!r}, backward={backward})")
    bm, bn = resolve_blocks(strategy, problem, block_m, block_n, sram_bytes, backward, kernels)
    if strategy == "standard":
        counts = _standard_bwd(problem) if backward else _standard_fwd(problem)
    elif strategy == "fa1":
        counts = (_fa1_bwd if backward else _fa1_fwd)(problem, bm, bn, causal_skip)
    elif strategy == "fa2":
        counts = (_fa2_bwd if backward else _fa2_fwd)(problem, bm, bn, causal_skip)
    else:
        counts = (_cuflash_bwd(problem, causal_skip, deterministic, kernels) if backward
                  else _cuflash_fwd(problem, causal_skip, kernels))
    if l2_bytes is not None:
        dram = l2.simulate_l2(strategy, problem, l2_bytes=l2_bytes, backward=backward, block_m=bm, block_n=bn,
                              causal_skip=causal_skip, num_sms=num_sms, deterministic=deterministic, kernels=kernels)
        counts.dram_read_bytes, counts.dram_write_bytes = dram.read_bytes, dram.write_bytes
    return counts
