"""Execute mode: run a strategy's tile schedule with real float64 arithmetic on small inputs.

The schedules are the ones the counts describe (same blocks, same causal / sliding-window block
skipping, same loop order, zero-filled tails, cuflash's padding of head_dim to the kernel head dim), so
equality with cuflash.reference proves the tiling math (online softmax, -inf hazards, block skipping,
tails and the backward recomputation) on a CPU. The Q-outer and K/V-outer schedules apply the element
mask only to the tiles that masks.tile_needs_mask selects, as the kernels do, so a wrong tile test
shows as a wrong result. Inputs are bshd NumPy arrays, (batch, seqlen, heads, head_dim).
"""
from __future__ import annotations

import math

import numpy as np

from cuflash import config as _config

from .masks import first_key, key_end, query_block_range, tile_needs_mask
from .model import STRATEGIES, Problem
from .schedules import (
    DEFAULT_KERNELS,
    block_sizes,
    bwd_key_blocks_reversed,
    check_kernels,
    cuflash_config,
    key_block_ranges,
    main_adds_dq,
    resolve_blocks,
)

LOG2E = math.log2(math.e)


def _check(strategy, arrays, names):
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not known; known: {', '.join(STRATEGIES)}")
    for name, a in zip(names, arrays):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(a).__name__}")
        if a.ndim != 4:
            raise ValueError(f"{name} must be (batch, seqlen, heads, head_dim), got shape {a.shape}")
    q, k, v = arrays[-3:]
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}")


def _problem(q, k, dtype, causal, window):
    b, sq, h, d = q.shape
    return Problem(b, h, sq, k.shape[1], d, dtype, bool(causal), window)


def _tile(x, start, rows, width):
    """x[start:start+rows, :] zero-filled to [rows, width] (cp.async zero-fill of tails and padded cols)."""
    t = np.zeros((rows, width))
    part = x[start:start + rows]
    t[: part.shape[0], : part.shape[1]] = part
    return t


def _mask(s, row0, col0, p: Problem):
    """-inf where the query does not see the key: the key is past Sk, after the query's last visible key
    (causal: j <= i + Sk - Sq; window: j <= i + Sk - Sq + right) or before its first (j >= i + Sk - Sq - left)."""
    rows = row0 + np.arange(s.shape[0])[:, None]
    cols = col0 + np.arange(s.shape[1])[None, :]
    keep = (cols >= first_key(rows, p.seqlen_q, p.seqlen_k, p.causal, p.window)) & \
        (cols < key_end(rows, p.seqlen_q, p.seqlen_k, p.causal, p.window))
    return np.where(keep, s, -np.inf)


def _mask_tile(s, row0, col0, p: Problem):
    """The kernels' step: the element mask only on a tile that holds a hidden pair (masks.tile_needs_mask
    over its valid rows and all BLOCK_N key slots, the tail included); other tiles are used as computed."""
    row_last = min(row0 + s.shape[0], p.seqlen_q) - 1
    if tile_needs_mask(row0, row_last, col0, col0 + s.shape[1] - 1, p.seqlen_q, p.seqlen_k, p.causal, p.window):
        return _mask(s, row0, col0, p)
    return s


def _check_kernels(strategy, kernels):
    check_kernels(kernels)
    if kernels != DEFAULT_KERNELS and strategy != "cuflash":
        raise ValueError(f"kernels={kernels!r} selects cuflash's kernel family (got strategy={strategy!r})")


def _blocks_and_width(strategy, p, block_m, block_n, sram_bytes, backward, kernels=DEFAULT_KERNELS):
    bm, bn = resolve_blocks(strategy, p, block_m, block_n, sram_bytes, backward, kernels)
    width = _config.kernel_head_dim(p.head_dim) if strategy == "cuflash" else p.head_dim
    return bm, bn, width


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

def _standard_fwd(q, k, v, p, scale):
    o = np.zeros(q.shape)
    lse = np.full((p.batch, p.heads, p.seqlen_q), -np.inf)
    for b in range(p.batch):
        for h in range(p.heads):
            s = _mask(q[b, :, h] @ k[b, :, h].T * scale, 0, 0, p)  # S in HBM
            m = s.max(axis=1, keepdims=True)
            m_safe = np.where(np.isfinite(m), m, 0.0)  # fully masked row: exp(-inf - 0) = 0
            e = np.exp(s - m_safe)
            l = e.sum(axis=1, keepdims=True)
            pm = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)  # P in HBM
            o[b, :, h] = pm @ v[b, :, h]
            with np.errstate(divide="ignore"):
                lse[b, h] = np.where(l[:, 0] > 0, m_safe[:, 0] + np.log(l[:, 0]), -np.inf)
    return o, lse


def _q_outer_fwd(q, k, v, p, scale, bm, bn, width, causal_skip, is_cuflash):
    """FA2 / fwd_kernel / fwd_sm90_kernel: one CTA per (m_block, h, b); O, m, l in registers; exp2 with
    log2(e) folded in."""
    o = np.zeros(q.shape)
    lse = np.full((p.batch, p.heads, p.seqlen_q), -np.inf)
    n_begin, n_end = key_block_ranges(p, bm, bn, causal_skip)
    t_r = len(n_end)
    scale_log2 = scale * LOG2E
    for b in range(p.batch):
        for h in range(p.heads):
            for block_x in range(t_r):
                # fwd_kernel runs causal grids longest rows first: m_block = gridDim.x - 1 - blockIdx.x
                m_block = t_r - 1 - block_x if (is_cuflash and p.causal) else block_x
                row0 = m_block * bm
                if n_end[m_block] <= n_begin[m_block]:
                    continue  # no visible key: O = 0, lse = -inf
                q_smem = _tile(q[b, :, h], row0, bm, width)
                m_i = np.full(bm, -np.inf)  # running max of S*log2(e)*scale
                l_i = np.zeros(bm)
                acc_o = np.zeros((bm, width))
                n_blocks = range(n_begin[m_block], n_end[m_block])
                for n_block in (reversed(n_blocks) if is_cuflash else n_blocks):
                    k_smem = _tile(k[b, :, h], n_block * bn, bn, width)
                    v_smem = _tile(v[b, :, h], n_block * bn, bn, width)
                    # S = Q K^T (scaled by log2(e)/sqrt(d))
                    s = _mask_tile(q_smem @ k_smem.T * scale_log2, row0, n_block * bn, p)
                    # m_new = max(m, rowmax(S)); O *= exp2(m - m_new)
                    m_new = np.maximum(m_i, s.max(axis=1))
                    m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # fully masked so far: use 0
                    corr = np.exp2(m_i - m_safe)
                    p_regs = np.exp2(s - m_safe[:, None])
                    l_i = l_i * corr + p_regs.sum(axis=1)
                    acc_o = acc_o * corr[:, None] + p_regs @ v_smem
                    m_i = m_new
                rows = min(bm, p.seqlen_q - row0)
                ok = l_i[:rows] > 0
                inv_l = np.where(ok, 1.0 / np.where(ok, l_i[:rows], 1.0), 0.0)
                o[b, row0:row0 + rows, h] = (acc_o[:rows] * inv_l[:, None])[:, : p.head_dim]
                with np.errstate(divide="ignore"):
                    lse[b, h, row0:row0 + rows] = np.where(ok, (m_i[:rows] + np.log2(np.where(ok, l_i[:rows], 1.0)))
                                                           / LOG2E, -np.inf)
    return o, lse


def _fa1_fwd(q, k, v, p, scale, bm, bn, causal_skip, with_stats=False):
    """Algorithm 1: K/V outer (j), Q inner (i); O, l, m live in HBM and are updated every step."""
    o = np.zeros(q.shape)  # O = 0, l = 0, m = -inf in HBM
    l_hbm = np.zeros((p.batch, p.heads, p.seqlen_q))
    m_hbm = np.full((p.batch, p.heads, p.seqlen_q), -np.inf)
    n_begin, n_end = key_block_ranges(p, bm, bn, causal_skip)
    rows_i = block_sizes(p.seqlen_q, bm)
    for b in range(p.batch):
        for h in range(p.heads):
            for j in range(math.ceil(p.seqlen_k / bn)):
                k_j, v_j = k[b, j * bn:(j + 1) * bn, h], v[b, j * bn:(j + 1) * bn, h]
                for i in range(len(rows_i)):
                    if not n_begin[i] <= j < n_end[i]:
                        continue  # block skipping (causal, window)
                    sl = slice(i * bm, i * bm + rows_i[i])
                    q_i, o_i, l_i, m_i = q[b, sl, h], o[b, sl, h], l_hbm[b, h, sl], m_hbm[b, h, sl]
                    s_ij = _mask(q_i @ k_j.T * scale, i * bm, j * bn, p)
                    # m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij)
                    m_t = s_ij.max(axis=1)
                    m_t_safe = np.where(np.isfinite(m_t), m_t, 0.0)
                    p_t = np.exp(s_ij - m_t_safe[:, None])
                    l_t = p_t.sum(axis=1)
                    # m_new = max(m_i, m~_ij), l_new = e^(m_i - m_new) l_i + e^(m~_ij - m_new) l~_ij
                    m_new = np.maximum(m_i, m_t)
                    m_new_safe = np.where(np.isfinite(m_new), m_new, 0.0)
                    a_old, a_new = np.exp(m_i - m_new_safe), np.exp(m_t_safe - m_new_safe) * (l_t > 0)
                    l_new = a_old * l_i + a_new * l_t
                    ok = l_new > 0
                    inv = np.where(ok, 1.0 / np.where(ok, l_new, 1.0), 0.0)
                    # O_i = diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~ - m_new) P~_ij V_j)
                    o[b, sl, h] = inv[:, None] * ((l_i * a_old)[:, None] * o_i + a_new[:, None] * (p_t @ v_j))
                    l_hbm[b, h, sl], m_hbm[b, h, sl] = l_new, m_new
    with np.errstate(divide="ignore"):
        lse = np.where(l_hbm > 0, np.where(np.isfinite(m_hbm), m_hbm, 0.0) + np.log(np.where(l_hbm > 0, l_hbm, 1.0)),
                       -np.inf)
    return (o, lse, l_hbm, m_hbm) if with_stats else (o, lse)


def execute_forward(strategy: str, q, k, v, *, causal: bool = False, window=None, softmax_scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, sram_bytes: int | None = None,
                    causal_skip: bool = True, dtype: str = "fp16", kernels: str = DEFAULT_KERNELS):
    """Run `strategy`'s forward schedule in float64. Returns (o (B, Sq, H, D), lse (B, H, Sq)).

    window: None or a sliding window (left, right), -1 = unbounded (as Problem.window; with causal, the
    intersection). dtype only selects the blocks (FA1's M in elements, cuflash's config); arithmetic is float64.
    kernels (cuflash only): the kernel family whose tiles run, as in simulate ("auto": the wgmma kernels'
    tiles where the head dim has them, "mma": the mma.sync kernels')."""
    _check(strategy, (q, k, v), ("q", "k", "v"))
    _check_kernels(strategy, kernels)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    p = _problem(q, k, dtype, causal, window)
    scale = 1.0 / math.sqrt(p.head_dim) if softmax_scale is None else float(softmax_scale)
    if strategy == "standard":
        return _standard_fwd(q, k, v, p, scale)
    bm, bn, width = _blocks_and_width(strategy, p, block_m, block_n, sram_bytes, False, kernels)
    if strategy == "fa1":
        return _fa1_fwd(q, k, v, p, scale, bm, bn, causal_skip)
    return _q_outer_fwd(q, k, v, p, scale, bm, bn, width, causal_skip, strategy == "cuflash")


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

def _standard_bwd(do, q, k, v, p, scale):
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(p.batch):
        for h in range(p.heads):
            s = _mask(q[b, :, h] @ k[b, :, h].T * scale, 0, 0, p)
            m = s.max(axis=1, keepdims=True)
            e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
            l = e.sum(axis=1, keepdims=True)
            pm = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)  # P, kept from the forward
            do_ = do[b, :, h]
            dv[b, :, h] = pm.T @ do_  # dV = P^T dO
            dp = do_ @ v[b, :, h].T  # dP = dO V^T
            d_i = (pm * dp).sum(axis=1, keepdims=True)  # D_i = rowsum(P o dP)
            ds = pm * (dp - d_i)  # dS = P o (dP - D)
            dq[b, :, h] = ds @ k[b, :, h] * scale
            dk[b, :, h] = ds.T @ q[b, :, h] * scale
    return dq, dk, dv


def _kv_outer_bwd(do, q, k, v, o, lse, p, scale, bm, bn, width, causal_skip, reverse_n=False):
    """FA2 backward: D = rowsum(dO o O); per column block j (K_j, V_j in SRAM) loop over row blocks,
    recompute P = exp(S - lse), accumulate dV_j, dK_j on chip and dQ_i in an HBM accumulator. The column blocks
    run in ascending order, or with reverse_n from the last to the first (so each dQ_i sums its key blocks in
    descending order)."""
    dq_acc = np.zeros((p.batch, p.seqlen_q, p.heads, width))  # fp32 dQ accumulator, zeroed
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    delta = np.einsum("bihd,bihd->bhi", do, o)  # D_i = rowsum(dO_i o O_i), the preprocess kernel
    t_r = math.ceil(p.seqlen_q / bm)
    for b in range(p.batch):
        for h in range(p.heads):
            n_blocks = range(math.ceil(p.seqlen_k / bn))
            for n_block in (reversed(n_blocks) if reverse_n else n_blocks):
                col0 = n_block * bn
                k_smem, v_smem = _tile(k[b, :, h], col0, bn, width), _tile(v[b, :, h], col0, bn, width)
                dk_acc, dv_acc = np.zeros((bn, width)), np.zeros((bn, width))
                # query blocks whose rows see a key of this block (bwd_kernel; all without skipping)
                m_blocks = range(*query_block_range(col0, min(col0 + bn, p.seqlen_k) - 1, p.seqlen_q, p.seqlen_k,
                                                    bm, p.causal, p.window)) if causal_skip else range(t_r)
                for m_block in m_blocks:
                    row0 = m_block * bm
                    q_smem, do_smem = _tile(q[b, :, h], row0, bm, width), _tile(do[b, :, h], row0, bm, width)
                    lse_i = np.full(bm, -np.inf)
                    lse_i[: min(bm, p.seqlen_q - row0)] = lse[b, h, row0:row0 + bm]
                    d_i = np.zeros(bm)
                    d_i[: min(bm, p.seqlen_q - row0)] = delta[b, h, row0:row0 + bm]
                    s = _mask_tile(q_smem @ k_smem.T * scale, row0, col0, p)
                    # P = exp(S - lse); a row that sees nothing (lse = -inf) has P = 0
                    p_ij = np.where(np.isfinite(lse_i)[:, None], np.exp(s - np.where(np.isfinite(lse_i), lse_i, 0.0)[:, None]), 0.0)
                    dv_acc += p_ij.T @ do_smem  # dV_j += P^T dO_i
                    dp = do_smem @ v_smem.T  # dP = dO_i V_j^T
                    ds = p_ij * (dp - d_i[:, None])  # dS = P o (dP - D_i)
                    rows = min(bm, p.seqlen_q - row0)
                    dq_acc[b, row0:row0 + rows, h] += (ds @ k_smem * scale)[:rows]  # dQ_i += dS K_j (RMW)
                    dk_acc += ds.T @ q_smem * scale  # dK_j += dS^T Q_i
                cols = min(bn, p.seqlen_k - col0)
                dk[b, col0:col0 + cols, h] = dk_acc[:cols, : p.head_dim]
                dv[b, col0:col0 + cols, h] = dv_acc[:cols, : p.head_dim]
    return dq_acc[..., : p.head_dim], dk, dv


def _q_outer_dq(do, q, k, v, o, lse, p, scale, bm, bn, width, causal_skip):
    """bwd_dq_kernel (deterministic): one CTA per query block (causal grids longest rows first), key
    tiles from the last to the first, dQ_i = scale * sum_j dS_ij K_j in registers; rows that see no key
    get dQ = 0. lse_log2 / delta of pad rows are +inf / 0 (P = 0 there)."""
    dq = np.zeros(q.shape)
    delta = np.einsum("bihd,bihd->bhi", do, o)
    n_begin, n_end = key_block_ranges(p, bm, bn, causal_skip)
    t_r = len(n_end)
    for b in range(p.batch):
        for h in range(p.heads):
            for block_x in range(t_r):
                m_block = t_r - 1 - block_x if p.causal else block_x
                row0 = m_block * bm
                rows = min(bm, p.seqlen_q - row0)
                if n_end[m_block] <= n_begin[m_block]:
                    continue
                q_smem, do_smem = _tile(q[b, :, h], row0, bm, width), _tile(do[b, :, h], row0, bm, width)
                lse_i = np.full(bm, np.inf)  # lse_log2 of pad rows and rows without keys: +inf
                lse_i[:rows] = np.where(np.isfinite(lse[b, h, row0:row0 + rows]), lse[b, h, row0:row0 + rows], np.inf)
                d_i = np.zeros(bm)
                d_i[:rows] = delta[b, h, row0:row0 + rows]
                acc = np.zeros((bm, width))
                for n_block in reversed(range(n_begin[m_block], n_end[m_block])):
                    k_smem = _tile(k[b, :, h], n_block * bn, bn, width)
                    v_smem = _tile(v[b, :, h], n_block * bn, bn, width)
                    s = _mask_tile(q_smem @ k_smem.T * scale, row0, n_block * bn, p)
                    p_ij = np.exp(s - lse_i[:, None])  # exp(-inf) = exp(x - inf) = 0
                    ds = p_ij * (do_smem @ v_smem.T - d_i[:, None])
                    acc += ds @ k_smem
                dq[b, row0:row0 + rows, h] = (acc * scale)[:rows, : p.head_dim]
    return dq


def _fa1_bwd(do, q, k, v, p, scale, bm, bn, causal_skip):
    """Algorithm 4: K/V outer, Q inner; P recomputed from l, m; dQ_i read-modify-written in HBM."""
    o, _, l_hbm, m_hbm = _fa1_fwd(q, k, v, p, scale, bm, bn, causal_skip, with_stats=True)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)  # initialised in HBM
    n_begin, n_end = key_block_ranges(p, bm, bn, causal_skip)
    rows_i = block_sizes(p.seqlen_q, bm)
    for b in range(p.batch):
        for h in range(p.heads):
            for j in range(math.ceil(p.seqlen_k / bn)):
                cs = slice(j * bn, (j + 1) * bn)
                k_j, v_j = k[b, cs, h], v[b, cs, h]
                dk_j, dv_j = np.zeros(k_j.shape), np.zeros(v_j.shape)
                for i in range(len(rows_i)):
                    if not n_begin[i] <= j < n_end[i]:
                        continue
                    sl = slice(i * bm, i * bm + rows_i[i])
                    q_i, o_i, do_i = q[b, sl, h], o[b, sl, h], do[b, sl, h]
                    l_i, m_i = l_hbm[b, h, sl], m_hbm[b, h, sl]
                    s_ij = _mask(q_i @ k_j.T * scale, i * bm, j * bn, p)
                    ok = l_i > 0
                    # P_ij = diag(l_i)^-1 exp(S_ij - m_i)
                    p_ij = np.where(ok[:, None], np.exp(s_ij - np.where(ok, m_i, 0.0)[:, None])
                                    / np.where(ok, l_i, 1.0)[:, None], 0.0)
                    dv_j += p_ij.T @ do_i
                    dp = do_i @ v_j.T
                    d_i = (do_i * o_i).sum(axis=1)  # D_i = rowsum(dO_i o O_i)
                    ds = p_ij * (dp - d_i[:, None])
                    dq[b, sl, h] += ds @ k_j * scale  # dQ_i read, updated, written to HBM
                    dk_j += ds.T @ q_i * scale
                dk[b, cs, h], dv[b, cs, h] = dk_j, dv_j
    return dq, dk, dv


def execute_backward(strategy: str, do, q, k, v, *, causal: bool = False, window=None,
                     softmax_scale: float | None = None, block_m: int | None = None, block_n: int | None = None,
                     sram_bytes: int | None = None, causal_skip: bool = True, dtype: str = "fp16",
                     deterministic: bool = False, kernels: str = DEFAULT_KERNELS):
    """Run `strategy`'s backward schedule (after its own forward) in float64. Returns (dq, dk, dv).

    deterministic=True (cuflash only), on the main kernel that cuflash_config picks (as the counts): where it adds
    dQ itself (schedules.main_adds_dq: the ordered adds of bwd_sm90_ws_kernel and bwd_wide_kernel,
    config.ordered_dq) dQ from the K/V-outer accumulation with each query block's key blocks in the kernel's fixed
    order (ascending, or with causal or a window descending: schedules.bwd_key_blocks_reversed); the float32 Hopper
    backward (BwdSm90Tf32Config, no atomics) as without it; else from the Q-outer schedule of bwd_dq_kernel
    (dq_config blocks). window, kernels: as in execute_forward (bwd_sm90_kernel and bwd_sm90_ws_kernel run
    bwd_kernel's K/V-outer schedule with their own blocks)."""
    _check(strategy, (do, q, k, v), ("do", "q", "k", "v"))
    _check_kernels(strategy, kernels)
    if do.shape != q.shape:
        raise ValueError(f"do must have q's shape {q.shape}, got {do.shape}")
    if deterministic and strategy != "cuflash":
        raise ValueError(f"deterministic=True is cuflash's deterministic backward (got strategy={strategy!r})")
    do, q, k, v = (np.asarray(x, dtype=np.float64) for x in (do, q, k, v))
    p = _problem(q, k, dtype, causal, window)
    scale = 1.0 / math.sqrt(p.head_dim) if softmax_scale is None else float(softmax_scale)
    if strategy == "standard":
        return _standard_bwd(do, q, k, v, p, scale)
    if strategy == "fa1":
        bm, bn, _ = _blocks_and_width(strategy, p, block_m, block_n, sram_bytes, True)
        return _fa1_bwd(do, q, k, v, p, scale, bm, bn, causal_skip)
    # the forward runs with the forward blocks, the backward with the backward blocks
    o, lse = execute_forward(strategy, q, k, v, causal=causal, window=window, softmax_scale=scale, block_m=block_m,
                             block_n=block_n, sram_bytes=sram_bytes, causal_skip=causal_skip, dtype=dtype,
                             kernels=kernels)
    bm, bn, width = _blocks_and_width(strategy, p, block_m, block_n, sram_bytes, True, kernels)
    main = cuflash_config(p, backward=True, deterministic=True, kernels=kernels) if deterministic else None
    if isinstance(main, _config.BwdSm90Tf32Config):  # deterministic as it is: the default run
        main = None
    if main is not None:  # the deterministic instantiation's blocks (the float64 wide one has its own tiles)
        bm, bn = main.block_m, main.block_n
    reverse_n = main is not None and bwd_key_blocks_reversed(main, p.window)
    dq, dk, dv = _kv_outer_bwd(do, q, k, v, o, lse, p, scale, bm, bn, width, causal_skip, reverse_n)
    if main is not None and not main_adds_dq(main):
        dcfg = _config.dq_config(width, p.dtype, p.causal)
        dq = _q_outer_dq(do, q, k, v, o, lse, p, scale, dcfg.block_m, dcfg.block_n, width, causal_skip)
    return dq, dk, dv
