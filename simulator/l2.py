"""L2 model: predict DRAM bytes from the global accesses of a strategy's kernels.

Model: one LRU cache of `l2_bytes` over 32-byte sectors, write-back and write-allocate (a store does not
read DRAM; a dirty sector costs a DRAM write when it is evicted or, at the end, flushed). The kernels of
a strategy run one after another; within a kernel the CTAs run in launch order (blockIdx.x fastest) in
waves of `num_sms * ctas_per_sm` CTAs, and the CTAs of one wave advance in lock step: step t of every
CTA of the wave (its t-th tile access group, e.g. "load K_j and V_j") before step t+1.

Approximation (why it stays fast at N = 65536): the cache is simulated per *tile* (the rows a kernel
loads or stores with one tile copy: a [BLOCK_N, d] K tile, a 128 x 128 S tile) instead of per sector.
Sectors of one tile are always touched together, so they sit next to each other in LRU order and an
exact sector LRU differs from the tile LRU only at the eviction boundary: by at most one tile per
eviction decision, i.e. a relative error of about tile_bytes / l2_bytes (16 KB / 50 MB = 0.03%).
`granularity="row"` simulates every row (every d*elem_bytes run of sectors) instead, which the tests
use to check the tile model. A tile's weight is rows * ceil(row_bytes / 32) sectors: exact when
d * elem_bytes is a multiple of 32 bytes (every head dim the kernels support).

The FP8 forward (fwd_sm90_fp8_kernel) runs fwd_sm90_ws_kernel's accesses with 1-byte Q, K, V and a bf16 O; its
float32 descale factors (a few bytes per CTA) are left out.

Not modelled: the two L2 partitions of an H100 (each SM sees its near half first; data can be
duplicated), hashing of addresses to sets (the model is fully associative) and prefetching.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from cuflash import config as _config

from .model import FP8_DTYPES, FP8_STRATEGIES, H100_SMEM_PER_SM, H100_SMS, Problem
from .schedules import (
    DEFAULT_KERNELS,
    block_sizes,
    bwd_key_blocks_reversed,
    bwd_main_config,
    bwd_query_blocks,
    cuflash_config,
    key_block_ranges,
    main_adds_dq,
    resolve_blocks,
    seqlen_q_pad,
)

SECTOR = 32
STANDARD_TILE = 128  # the standard strategy's GEMM / softmax tiles: 128 rows (x 128 columns for S)


@njit(cache=True)
def _lru(units, is_write, weight, capacity):
    """Run the access stream through a fully associative LRU of `capacity` sectors.

    Returns (read-miss sectors, dirty sectors evicted, dirty sectors left at the end)."""
    n = weight.shape[0]
    head = n  # sentinel of a circular doubly linked list: nxt[head] = most recent, prv[head] = least
    nxt = np.full(n + 1, -1, np.int64)
    prv = np.full(n + 1, -1, np.int64)
    nxt[head] = head
    prv[head] = head
    resident = np.zeros(n, np.bool_)
    dirty = np.zeros(n, np.bool_)
    occupied = 0
    read_miss = 0
    written_back = 0
    for e in range(units.shape[0]):
        u = units[e]
        w = weight[u]
        if resident[u]:
            nxt[prv[u]] = nxt[u]  # unlink
            prv[nxt[u]] = prv[u]
        else:
            if not is_write[e]:
                read_miss += w
            resident[u] = True
            occupied += w
        nxt[u] = nxt[head]  # link as most recent
        prv[u] = head
        prv[nxt[head]] = u
        nxt[head] = u
        if is_write[e]:
            dirty[u] = True
        while occupied > capacity:
            t = prv[head]
            if t == u:
                break
            nxt[prv[t]] = head
            prv[head] = prv[t]
            resident[t] = False
            occupied -= weight[t]
            if dirty[t]:
                written_back += weight[t]
                dirty[t] = False
    left_dirty = 0
    for u in range(n):
        if dirty[u] and resident[u]:
            left_dirty += weight[u]
    return read_miss, written_back, left_dirty


@dataclass
class L2Result:
    read_bytes: int  # DRAM reads: read misses
    write_bytes: int  # DRAM writes: dirty evictions plus the dirty sectors flushed after the last kernel
    write_back_during_bytes: int  # the part of write_bytes evicted while the kernels ran
    accesses: int  # tile (or row) accesses simulated


class _Trace:
    """Tile accesses of a sequence of kernels, ordered (kernel, wave, step, cta, sub)."""

    def __init__(self, p: Problem, granularity: str):
        self.p = p
        self.granularity = granularity
        self.tensors = {}  # name -> (first unit id, units per (b,h), weights per (b,h) unit, rows per unit, row weight)
        self.n_units = 0
        self.parts = []

    def tensor(self, name: str, rows: int, block: int, row_bytes: int, contiguous_rows: bool = False):
        """A per-(batch, head) tensor of `rows` rows cut into units of `block` rows.

        contiguous_rows: the rows of one (b, h) are contiguous (lse, D, S); else each row is its own
        run of row_bytes (bshd layout)."""
        sizes = block_sizes(rows, block)
        if contiguous_rows:
            w_unit, row_w = -(-sizes * row_bytes // SECTOR), 0
        else:
            row_w = -(-row_bytes // SECTOR)
            w_unit = sizes * row_w
        # granularity="row" splits bshd tensors into rows; contiguous fp32 vectors (several rows per
        # sector) keep their tile units
        expand = self.granularity == "row" and not contiguous_rows
        w_u = np.full(rows, row_w, np.int64) if expand else w_unit
        self.tensors[name] = (self.n_units, len(w_u), w_u, block, expand)
        self.n_units += self.p.batch_heads * len(w_u)

    def sector_units(self, name: str, rows: int, block: int):
        """A per-(batch, head) array over `rows` rows cut into units of `block` rows, each unit a few bytes that
        weigh one sector (the turn counters of the ordered dQ reductions: neighbouring units share a sector in
        memory, which the model does not merge)."""
        n = -(-rows // block)
        self.tensors[name] = (self.n_units, n, np.ones(n, np.int64), block, False)
        self.n_units += self.p.batch_heads * n

    def access(self, kernel: int, cta, step, sub, name: str, bh, unit, is_write: bool, wave_ctas: int):
        first, per_bh, _, block, expand = self.tensors[name]
        cta, step, sub, bh, unit = (np.broadcast_to(np.asarray(x, np.int64), np.broadcast(cta, step, sub, bh, unit).shape)
                                    .ravel() for x in (cta, step, sub, bh, unit))
        if expand:  # expand each tile access into its rows, in row order
            rows_total = per_bh
            r0 = unit * block
            nrows = np.minimum(block, rows_total - r0)
            rep = np.repeat(np.arange(len(unit)), nrows)
            offs = np.arange(rep.size) - np.repeat(np.cumsum(nrows) - nrows, nrows)
            cta, step, bh = cta[rep], step[rep], bh[rep]
            sub = sub[rep] * (block + 1) + offs
            unit = r0[rep] + offs
        ids = first + bh * per_bh + unit
        self.parts.append((np.full(ids.size, kernel), cta // wave_ctas, step, cta % wave_ctas, sub, ids,
                           np.full(ids.size, is_write)))

    def weights(self) -> np.ndarray:
        w = np.empty(self.n_units, np.int64)
        for first, per_bh, w_u, _, _ in self.tensors.values():
            w[first:first + per_bh * self.p.batch_heads] = np.tile(w_u, self.p.batch_heads)
        return w

    def run(self, capacity_sectors: int) -> L2Result:
        cols = [np.concatenate([part[i] for part in self.parts]) for i in range(7)]
        kernel, wave, step, cta, sub, ids, is_write = cols
        order = np.lexsort((sub, cta, step, wave, kernel))
        r, wb, left = _lru(ids[order], is_write[order], self.weights(), capacity_sectors)
        return L2Result(int(r) * SECTOR, int(wb + left) * SECTOR, int(wb) * SECTOR, int(ids.size))


def _grid(p: Problem, x_blocks: int):
    """CTA launch index c = (b*H + h)*x_blocks + x (x fastest) -> (bh, x)."""
    c = np.arange(p.batch_heads * x_blocks)
    return c, c // x_blocks, c % x_blocks


def _ragged(counts):
    """For counts [n_c]: (owner index repeated n_c times, position 0..n_c-1 within the owner)."""
    owner = np.repeat(np.arange(len(counts)), counts)
    pos = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, pos


def _q_outer_fwd(tr: _Trace, p, bm, bn, causal_skip, wave, reverse_n, reverse_m, kernel=0):
    """fwd_kernel / FA2 forward: CTA (m_block, h, b): Q; K_n, V_n per step (n_begin .. n_end - 1); O, lse.

    cuflash's kernels (reverse_n: key tiles from n_end - 1 down; reverse_m when causal: m_block = gridDim.x - 1
    - blockIdx.x, the longest query blocks first) all follow it, fwd_sm90_ws_kernel too: its producer issues
    the TMA boxes of Q, then K_n and V_n per key tile in the same order, and a box reads only its in-bounds
    rows (a tail tile's units weigh its valid rows); its STAGES-deep prefetch runs ahead of the consumers,
    which the lock-step waves do not model (as the cp.async prefetch of the other kernels)."""
    n_begin, n_end = key_block_ranges(p, bm, bn, causal_skip)
    t_r = len(n_end)
    c, bh, x = _grid(p, t_r)
    m_block = t_r - 1 - x if reverse_m else x
    n = np.maximum(n_end - n_begin, 0)[m_block]
    live = n > 0
    tr.access(kernel, c[live], 0, 0, "q", bh[live], m_block[live], False, wave)
    owner, it = _ragged(n)
    n_block = n_end[m_block][owner] - 1 - it if reverse_n else n_begin[m_block][owner] + it
    for sub, name in enumerate(("k", "v")):
        tr.access(kernel, c[owner], 1 + it, sub, name, bh[owner], n_block, False, wave)
    for sub, name in enumerate(("o", "lse")):
        tr.access(kernel, c, n + 1, sub, name, bh, m_block, True, wave)


def _fwd_tensors(tr, p, bm, bn):
    d_bytes = p.head_dim * p.elem_bytes
    tr.tensor("q", p.seqlen_q, bm, d_bytes)
    tr.tensor("o", p.seqlen_q, bm, p.head_dim * p.out_bytes)  # bf16 for the FP8 forward
    tr.tensor("k", p.seqlen_k, bn, d_bytes)
    tr.tensor("v", p.seqlen_k, bn, d_bytes)
    tr.tensor("lse", p.seqlen_q, bm, p.stat_bytes, contiguous_rows=True)


def _pairs_kv_outer(p, bm, bn, causal_skip):
    """Visited (i, j) pairs in K/V-outer order: arrays (j, i) sorted by j then i."""
    n_begin, n_end = key_block_ranges(p, bm, bn, causal_skip)
    t_c = math.ceil(p.seqlen_k / bn)
    jj, ii = np.meshgrid(np.arange(t_c), np.arange(len(n_end)), indexing="ij")
    keep = (n_begin[ii] <= jj) & (jj < n_end[ii])
    return jj[keep], ii[keep]


def _stream(tr, kernel, p, names_read, names_write, rows, block, wave):
    """An elementwise kernel: CTA per (row block, h, b) reads then writes its tiles."""
    c, bh, x = _grid(p, math.ceil(rows / block))
    for sub, name in enumerate(names_read):
        tr.access(kernel, c, 0, sub, name, bh, x, False, wave)
    for sub, name in enumerate(names_write):
        tr.access(kernel, c, 1, sub, name, bh, x, True, wave)


def _fa1_fwd(tr, p, bm, bn, causal_skip, wave):
    _fwd_tensors(tr, p, bm, bn)
    tr.tensor("m", p.seqlen_q, bm, p.stat_bytes, contiguous_rows=True)
    _stream(tr, 0, p, (), ("o", "lse", "m"), p.seqlen_q, bm, wave)  # O = 0, l = 0, m = -inf ("lse" holds l)
    jj, ii = _pairs_kv_outer(p, bm, bn, causal_skip)
    # one CTA per (b, h) runs the whole double loop: step = index of the (j, i) pair
    n_pairs = len(jj)
    c = np.repeat(np.arange(p.batch_heads), n_pairs)
    step = np.tile(np.arange(n_pairs), p.batch_heads)
    j, i = np.tile(jj, p.batch_heads), np.tile(ii, p.batch_heads)
    first_of_j = np.tile(np.r_[True, jj[1:] != jj[:-1]], p.batch_heads)
    tr.access(1, c[first_of_j], step[first_of_j], 0, "k", c[first_of_j], j[first_of_j], False, wave)
    tr.access(1, c[first_of_j], step[first_of_j], 1, "v", c[first_of_j], j[first_of_j], False, wave)
    for sub, name in enumerate(("q", "o", "lse", "m"), start=2):
        tr.access(1, c, step, sub, name, c, i, False, wave)
    for sub, name in enumerate(("o", "lse", "m"), start=6):
        tr.access(1, c, step, sub, name, c, i, True, wave)


def _bwd_tensors(tr, p, bm, bn, dq_acc_bytes):
    _fwd_tensors(tr, p, bm, bn)
    d_bytes = p.head_dim * p.elem_bytes
    for name in ("do", "dq"):
        tr.tensor(name, p.seqlen_q, bm, d_bytes)
    for name in ("dk", "dv"):
        tr.tensor(name, p.seqlen_k, bn, d_bytes)
    tr.tensor("dq_acc", p.seqlen_q, bm, p.head_dim * dq_acc_bytes)
    tr.tensor("d", p.seqlen_q, bm, p.stat_bytes, contiguous_rows=True)


def _kv_outer_bwd(tr, p, bm, bn, causal_skip, wave, fa1: bool):
    """FA2 backward (preprocess, main, convert) or FA1 Algorithm 4 (memset, main)."""
    _bwd_tensors(tr, p, bm, bn, p.elem_bytes if fa1 else p.stat_bytes)
    if fa1:
        tr.tensor("m", p.seqlen_q, bm, p.stat_bytes, contiguous_rows=True)
        _stream(tr, 0, p, (), ("dq",), p.seqlen_q, bm, wave)
        _stream(tr, 0, p, (), ("dk", "dv"), p.seqlen_k, bn, wave)
    else:
        _stream(tr, 0, p, ("o", "do"), ("d", "dq_acc"), p.seqlen_q, bm, wave)
    jj, ii = _pairs_kv_outer(p, bm, bn, causal_skip)
    t_c = math.ceil(p.seqlen_k / bn)
    # CTA (n_block, h, b): step 0 K_j, V_j; step 1 + k: the k-th visited row block; last: dK_j, dV_j
    per_j = np.bincount(jj, minlength=t_c)
    start_j = np.cumsum(per_j) - per_j
    c, bh, x = _grid(p, t_c)
    tr.access(1, c, 0, 0, "k", bh, x, False, wave)
    tr.access(1, c, 0, 1, "v", bh, x, False, wave)
    cc = (np.arange(p.batch_heads)[:, None] * t_c + jj[None, :]).ravel()
    bhh = np.repeat(np.arange(p.batch_heads), len(jj))
    i = np.tile(ii, p.batch_heads)
    step = 1 + np.tile(np.arange(len(jj)) - start_j[jj], p.batch_heads)
    reads = ("q", "o", "do", "dq", "lse", "m") if fa1 else ("q", "do", "lse", "d", "dq_acc")
    for sub, name in enumerate(reads):
        tr.access(1, cc, step, sub, name, bhh, i, False, wave)
    tr.access(1, cc, step, len(reads), "dq" if fa1 else "dq_acc", bhh, i, True, wave)
    for sub, name in enumerate(("dk", "dv")):
        tr.access(1, c, 1 + per_j[x], sub, name, bh, x, True, wave)
    if not fa1:
        _stream(tr, 2, p, ("dq_acc",), ("dq",), p.seqlen_q, bm, wave)


def _access_tiles(tr, kernel, cta, step, sub, name, bh, tile, tile_rows, is_write, wave):
    """Tile `tile` of tile_rows rows of tensor `name` (whose units are a divisor of tile_rows): its units
    in row order; units past the tensor's end (a tail tile) are left out."""
    _, per_bh, _, block, expand = tr.tensors[name]
    n_units = -(-per_bh // block) if expand else per_bh
    k = tile_rows // block
    cta, step, bh, tile = (np.broadcast_to(np.asarray(x, np.int64), np.broadcast(cta, step, bh, tile).shape).ravel()
                           for x in (cta, step, bh, tile))
    unit = tile[:, None] * k + np.arange(k)[None, :]
    keep = unit < n_units
    rep = lambda a: np.broadcast_to(a[:, None], unit.shape)[keep]  # noqa: E731
    subs = np.broadcast_to(sub * k + np.arange(k)[None, :], unit.shape)[keep]
    tr.access(kernel, rep(cta), rep(step), subs, name, rep(bh), unit[keep], is_write, wave)


def _resident(smem_bytes: int, threads: int) -> int:
    """CTAs per SM from shared memory (1 KiB reserved per CTA) and threads; registers assumed not to limit."""
    return max(1, min(H100_SMEM_PER_SM // (smem_bytes + 1024), 2048 // threads, 32))


def config_resident(cfg) -> int:
    """CTAs per SM of a kernel config: _resident, and for the wgmma kernels at most CTAS_PER_SM. Their
    launch bounds size the registers for exactly that many (a warpgroup keeps 64 rows of accumulators:
    ptxas -v, sm_90a, gives 184-255 registers per thread at CTAS_PER_SM = 1, i.e. one 256-thread CTA),
    so registers, which _resident leaves out, are what limits them."""
    n = _resident(cfg.smem_bytes, cfg.threads)
    if isinstance(cfg, (_config.FwdSm90Config, _config.BwdSm90Config, _config.BwdSm90SplitConfig)):
        n = min(n, cfg.ctas_per_sm)
    if isinstance(cfg, (_config.FwdSm90WsConfig, _config.FwdSm90Fp8Config)):
        # __launch_bounds__(384, 1) and setmaxnreg size the registers for one CTA: 128 producer threads x 24
        # + 256 consumer threads x 240 = 64,512 of the SM's 65,536 (FwdSm90WsTraits' static_assert; FwdFp8Traits:
        # 128 x 56 + 256 x 224 = 64,512)
        n = 1
    return n


def _cuflash_bwd(tr, p, causal_skip, num_sms, deterministic, kernels=DEFAULT_KERNELS, main=None):
    """The launches of cuflash.attention_backward (strategies.cuflash_backward_kernels), each with its own
    grid and residency: preprocess; bwd_kernel or bwd_sm90_kernel (same accesses, its own blocks);
    convert, or (deterministic, but for the ordered paths of bwd_sm90_ws_kernel and bwd_wide_kernel:
    schedules.main_adds_dq) bwd_dq_kernel. Units are gcd-sized row blocks, so the main and dQ kernels' tiles of
    different heights touch the same units. main: the main kernel's config in place of the library's choice
    (strategies.cuflash_backward_kernels).

    The ordered deterministic main kernels (config.ordered_dq: bwd_sm90_ws_kernel; bwd_wide_kernel, whose trace
    this builds though simulate_l2 takes no float32 / float64 problem) run the default mode's accesses plus their
    turn counters (dq_turns, one int32 per config.turn_rows padded rows: 64, 16 in bwd_wide_kernel; a unit of
    BLOCK_M rows of them, BLOCK_M / turn_rows counters, weighs a sector, _Trace.sector_units): the preprocess writes
    them and each visited query block adds 1 to its block's counter (a read-modify-write, as the dQ adds; the
    ld.acquire polls before it, reads of the same sector, are left out).
    The lock-step waves do not model a CTA waiting for its turn. With causal or a window its key blocks launch last
    first (key block gridDim.x - 1 - blockIdx.x: schedules.bwd_key_blocks_reversed), and the CTAs are taken in that
    launch order."""
    cfg = bwd_main_config(p, deterministic, kernels, main)
    dq_kernel = not main_adds_dq(cfg)
    ordered = _config.ordered_dq(cfg)
    dcfg = _config.dq_config(_config.kernel_head_dim(p.head_dim, p.dtype), p.dtype, p.causal) if dq_kernel else None
    uq = math.gcd(cfg.block_m, dcfg.block_m) if dq_kernel else cfg.block_m
    uk = math.gcd(cfg.block_n, dcfg.block_n) if dq_kernel else cfg.block_n
    d_bytes, pad = p.head_dim * p.elem_bytes, seqlen_q_pad(p.seqlen_q)
    for name in ("q", "do", "o", "dq"):
        tr.tensor(name, p.seqlen_q, uq, d_bytes)
    for name in ("k", "v", "dk", "dv"):
        tr.tensor(name, p.seqlen_k, uk, d_bytes)
    tr.tensor("lse", p.seqlen_q, uq, p.stat_bytes, contiguous_rows=True)
    for name in ("lse_log2", "delta"):
        tr.tensor(name, pad, uq, p.stat_bytes, contiguous_rows=True)
    acc = () if dq_kernel else ("dq_acc",)
    if not dq_kernel:
        tr.tensor("dq_acc", pad, uq, cfg.head_dim * p.stat_bytes, contiguous_rows=True)
    if ordered:  # a unit of uq = BLOCK_M rows holds BLOCK_M / turn_rows counters; a step adds to the first
        tr.sector_units("dq_turns", pad, uq)
        acc += ("dq_turns",)
    small = num_sms * _resident(0, 256)  # preprocess and convert: 256 threads, no shared memory
    # 1. preprocess, a unit of rows per CTA: O, dO, lse of real rows; delta, lse_log2 (, dq_acc = 0, dq_turns = 0)
    #    of all
    c, bh, x = _grid(p, pad // uq)
    real = x * uq < p.seqlen_q
    for sub, name in enumerate(("o", "do", "lse")):
        tr.access(0, c[real], 0, sub, name, bh[real], x[real], False, small)
    for sub, name in enumerate(("delta", "lse_log2") + acc):
        tr.access(0, c, 1, sub, name, bh, x, True, small)
    # 2. bwd_kernel: CTA (n_block, h, b): K_j, V_j; per visited query block Q_i, dO_i, lse_log2_i,
    #    delta_i and the dQ_acc atomics (an L2 read-modify-write: read, then dirty; on the ordered path then the
    #    counter's add); dK_j, dV_j
    wave = num_sms * config_resident(cfg)
    m_begin, m_end = bwd_query_blocks(cfg, p.seqlen_q, p.seqlen_k, causal_skip, p.window)
    visits = np.maximum(m_end - m_begin, 0)
    c, bh, x = _grid(p, len(visits))
    n = len(visits) - 1 - x if bwd_key_blocks_reversed(cfg, p.window) else x  # the CTA's key block
    for sub, name in enumerate(("k", "v")):
        _access_tiles(tr, 1, c, 0, sub, name, bh, n, cfg.block_n, False, wave)
    owner, k = _ragged(visits[n])
    m_block = m_begin[n[owner]] + k
    reads = ("q", "do", "lse_log2", "delta") + acc
    for sub, name in enumerate(reads):
        _access_tiles(tr, 1, c[owner], 1 + k, sub, name, bh[owner], m_block, cfg.block_m, False, wave)
    for sub, name in enumerate(acc, start=len(reads)):
        _access_tiles(tr, 1, c[owner], 1 + k, sub, name, bh[owner], m_block, cfg.block_m, True, wave)
    for sub, name in enumerate(("dk", "dv")):
        _access_tiles(tr, 1, c, 1 + visits[n], sub, name, bh, n, cfg.block_n, True, wave)
    if not dq_kernel:  # 3. convert: dq_acc of real rows -> dQ
        c, bh, x = _grid(p, math.ceil(p.seqlen_q / uq))
        tr.access(2, c, 0, 0, "dq_acc", bh, x, False, small)
        tr.access(2, c, 1, 0, "dq", bh, x, True, small)
        return
    # 3b. bwd_dq_kernel: CTA (m_block, h, b), causal grids reversed; Q, dO, lse_log2, delta; K_n, V_n from
    #     the last key tile to the first; dQ
    wave = num_sms * config_resident(dcfg)
    n_begin, n_end = key_block_ranges(p, dcfg.block_m, dcfg.block_n, causal_skip)
    t_r = len(n_end)
    c, bh, x = _grid(p, t_r)
    m_block = t_r - 1 - x if p.causal else x
    n = np.maximum(n_end - n_begin, 0)[m_block]
    live = n > 0
    for sub, name in enumerate(("q", "do", "lse_log2", "delta")):
        _access_tiles(tr, 2, c[live], 0, sub, name, bh[live], m_block[live], dcfg.block_m, False, wave)
    owner, it = _ragged(n)
    for sub, name in enumerate(("k", "v")):
        _access_tiles(tr, 2, c[owner], 1 + it, sub, name, bh[owner], n_end[m_block][owner] - 1 - it, dcfg.block_n,
                      False, wave)
    _access_tiles(tr, 2, c, n + 1, 0, "dq", bh, m_block, dcfg.block_m, True, wave)


def _standard(tr, p, backward, wave):
    """Each pass a tiled kernel over 128-row blocks and 128 x 128 tiles of the N x N matrices."""
    if tr.granularity == "row":
        raise ValueError("granularity='row' is available for the flash strategies only")
    t = STANDARD_TILE
    d_bytes = p.head_dim * p.elem_bytes
    for name in ("q", "o", "do", "dq"):
        tr.tensor(name, p.seqlen_q, t, d_bytes)
    for name in ("k", "v", "dk", "dv"):
        tr.tensor(name, p.seqlen_k, t, d_bytes)
    t_r, t_c = math.ceil(p.seqlen_q / t), math.ceil(p.seqlen_k / t)
    col_bytes = block_sizes(p.seqlen_k, t) * p.elem_bytes
    for name in ("s", "p", "dp", "ds"):  # [Sq, Sk] matrices, unit = one 128 x 128 tile (row-major i, j)
        rows = np.repeat(block_sizes(p.seqlen_q, t), t_c)
        w = rows * -(-np.tile(col_bytes, t_r) // SECTOR)
        tr.tensors[name] = (tr.n_units, t_r * t_c, w, 1, False)
        tr.n_units += p.batch_heads * t_r * t_c
    ii, jj = np.meshgrid(np.arange(t_r), np.arange(t_c), indexing="ij")
    ii, jj = ii.ravel(), jj.ravel()

    def gemm_tiles(kernel, a, b, out):  # out[i, j] = a_i b_j^T: CTA per tile
        c, bh, x = _grid(p, t_r * t_c)
        tr.access(kernel, c, 0, 0, a, bh, ii[x], False, wave)
        tr.access(kernel, c, 0, 1, b, bh, jj[x], False, wave)
        tr.access(kernel, c, 1, 0, out, bh, x, True, wave)

    def row_pass(kernel, mats_in, mat_out, b_name=None, out=None, by_col=False):
        """CTA per row block i (or column block j when by_col): step k reads tile (i, k) of each
        matrix (and row block k of b_name); writes mat_out tiles or the out block at the end."""
        outer, inner = (t_c, t_r) if by_col else (t_r, t_c)
        c, bh, x = _grid(p, outer)
        owner = np.repeat(np.arange(c.size), inner)
        k = np.tile(np.arange(inner), c.size)
        tile = k * t_c + x[owner] if by_col else x[owner] * t_c + k
        for sub, m in enumerate(mats_in):
            tr.access(kernel, c[owner], k, sub, m, bh[owner], tile, False, wave)
        if b_name is not None:
            tr.access(kernel, c[owner], k, len(mats_in), b_name, bh[owner], k, False, wave)
        if mat_out is not None:
            tr.access(kernel, c[owner], k, len(mats_in) + 1, mat_out, bh[owner], tile, True, wave)
        if out is not None:
            tr.access(kernel, c, inner, 0, out, bh, x, True, wave)

    if not backward:
        gemm_tiles(0, "q", "k", "s")  # S = Q K^T
        row_pass(1, ("s",), "p")  # P = softmax(S): each S tile read once, each P tile written once
        row_pass(2, ("p",), None, b_name="v", out="o")  # O = P V
    else:
        row_pass(0, ("p",), None, b_name="do", out="dv", by_col=True)  # dV = P^T dO
        gemm_tiles(1, "do", "v", "dp")  # dP = dO V^T
        row_pass(2, ("p", "dp"), "ds")  # dS = P o (dP - rowsum(P o dP))
        row_pass(3, ("ds",), None, b_name="k", out="dq")  # dQ = dS K
        row_pass(4, ("ds",), None, b_name="q", out="dk", by_col=True)  # dK = dS^T Q


def ctas_per_sm(strategy: str, p: Problem, kernels: str = DEFAULT_KERNELS) -> int:
    """Resident CTAs per SM: cuflash's forward from its config (config_resident), one for the others
    (cuflash's backward kernels use their own, see _cuflash_bwd)."""
    if strategy != "cuflash":
        return 1
    return config_resident(cuflash_config(p, kernels=kernels))


def simulate_l2(strategy: str, p: Problem, *, l2_bytes: int, backward: bool = False, block_m=None, block_n=None,
                causal_skip: bool = True, num_sms: int | None = None, ctas_per_sm_: int | None = None,
                granularity: str = "tile", deterministic: bool = False, kernels: str = DEFAULT_KERNELS) -> L2Result:
    """Predict DRAM traffic of `strategy` on `p` through an LRU L2 of l2_bytes (see module docstring);
    kernels: cuflash's kernel family (strategies.simulate)."""
    if not isinstance(l2_bytes, (int, np.integer)) or l2_bytes < SECTOR:
        raise ValueError(f"l2_bytes={l2_bytes!r} must be an integer of at least {SECTOR} bytes")
    if granularity not in ("tile", "row"):
        raise ValueError(f"granularity={granularity!r}; allowed: 'tile', 'row'")
    num_sms = H100_SMS if num_sms is None else num_sms
    if not isinstance(num_sms, (int, np.integer)) or num_sms < 1:
        raise ValueError(f"num_sms={num_sms!r} must be a positive integer")
    if strategy == "cuflash" and p.dtype in _config.WIDE_DTYPES:
        raise ValueError(f"the L2 model covers cuflash's fp16/bf16 kernels only, not the float32 / float64 kernels "
                         f"(dtype={p.dtype!r}): leave l2_bytes out")
    if p.dtype in FP8_DTYPES and (strategy not in FP8_STRATEGIES or backward):
        raise ValueError(f"dtype={p.dtype!r} is cuflash's FP8 forward only (got strategy={strategy!r}, "
                         f"backward={backward})")
    wave = num_sms * (ctas_per_sm(strategy, p, kernels) if ctas_per_sm_ is None else ctas_per_sm_)
    tr = _Trace(p, granularity)
    if strategy == "cuflash" and backward:
        _cuflash_bwd(tr, p, causal_skip, num_sms, deterministic, kernels)
    elif strategy == "standard":
        _standard(tr, p, backward, wave)
    else:
        if block_m is None:
            block_m, block_n = resolve_blocks(strategy, p, None, None, None, backward, kernels)
        if strategy == "fa1":
            (_kv_outer_bwd(tr, p, block_m, block_n, causal_skip, wave, fa1=True) if backward
             else _fa1_fwd(tr, p, block_m, block_n, causal_skip, wave))
        elif backward:
            _kv_outer_bwd(tr, p, block_m, block_n, causal_skip, wave, fa1=False)
        else:
            is_cuflash = strategy == "cuflash"
            _fwd_tensors(tr, p, block_m, block_n)
            _q_outer_fwd(tr, p, block_m, block_n, causal_skip, wave, reverse_n=is_cuflash,
                         reverse_m=is_cuflash and p.causal)
    return tr.run(l2_bytes // SECTOR)
