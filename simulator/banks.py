"""Shared-memory bank conflicts: the hardware rule for one warp instruction, and walks over every
shared-memory instruction that fwd_kernel, bwd_kernel and bwd_dq_kernel (cuda/*.cuh) issue, and over the
thread-issued ones of the Hopper kernels fwd_sm90_kernel, fwd_sm90_ws_kernel, bwd_sm90_kernel and
bwd_sm90_ws_kernel (cp.async, st.shared, ld.shared). Those kernels' tensor-core operand reads (wgmma from shared-memory descriptors) are no
thread instructions: the walks report their bytes apart (roles *_wgmma, SharedWalk.wgmma_read_bytes) with no
bank model, and ncu counts them as neither LDS nor LDSM (it has HGMMA counters of their own, `..._op_gmma`).
Likewise the TMA loads of the warp-specialized kernels (roles *_tma, and the backward's 1-D bulk copies:
SharedWalk.tma_write_bytes): the TMA unit writes whole boxes into shared memory, no LSU instruction, no bank
model; and the backward's bulk reductions, which read its dQ buffer (SharedWalk.bulk_read_bytes).
The FP8 forward fwd_sm90_fp8_kernel runs fwd_sm90_ws_kernel's schedule with 1-byte operands; its producer
warps transpose every V tile in shared memory (ldmatrix.x4.trans / stmatrix.x4, roles v_read and vt_store), and
with Q_IN_REGS its consumers load Q once per CTA with ldmatrix.x4 (role q_frag): walked with the rule.

The rule (docs/IO_ANALYSIS.md; matches ncu exactly for ld/st/ldmatrix): 32 banks of 4 bytes,
bank = (addr >> 2) & 31. A warp instruction is split into phases served one after another:

  kind                     bytes/lane  phases            lanes of phase m
  ld32  / st32             4           1                 0..31
  ld64  / st64             8           2                 16m..16m+15
  ld128 / st128            16          4                 8m..8m+7
  ldmatrix.x1 / .x2 / .x4  16 (a row)  1 / 2 / 4         8m..8m+7 (the row addresses of matrix m)
  stmatrix.x4              16 (a row)  4                 8m..8m+7 (the row addresses of matrix m; model)
  cp.async16               16          4                 8m..8m+7  (model, see below)

Wavefronts of a phase = the largest number of distinct 4-byte words one bank must serve (lanes that
read the same word are served by one broadcast); conflicts = wavefronts - phases. stmatrix (SASS STSM, sm_90)
writes the 8 rows of 16 bytes of one matrix per phase as ldmatrix reads them; no ncu run has checked it (no
validated kernel issues it).

cp.async (LDGSTS) writes follow a different rule that is not documented. Measured (H100, docs/IO_ANALYSIS.md
section 6): 8 lanes copying one 128-byte global line into one 128-byte-aligned shared row cost 1
wavefront per 8 lanes in any lane order; rows padded to 144 bytes cost about 2.5x; one row per thread
(16 B at a 128 B stride) costs 8x. Our model: phases of 8 lanes; a phase costs at least
max(bank-rule wavefronts, distinct 128-byte shared lines it writes) (`count`, the lower bound) and at
most max(that, distinct 128-byte global lines it reads) (`count_cp_async`, the upper bound). The
validation run (docs/IO_VALIDATION.md, "What the misses mean") calibrates it:
  * one global line per phase (every 128-byte panel tile: d64, d128, d256, 10 configs): the bounds are
    equal and the measurement equals them exactly (1 wavefront per phase);
  * two 64-byte global segments (two different 128-byte lines) into one shared line, conflict-free
    (64-byte panels: d32, d96): measured 1.61 (fwd d32), 1.97 (fwd d96) and 1.00 (bwd d96) wavefronts
    per phase, although the phase geometry is the same in all three. So the cost lies between the
    bounds and is not a function of the addresses of one phase alone; the analyzer reports the band.
The 144-byte-row case (1.875 by the lower bound, 2.5 measured) stays outside the model. ncu's
cp.async conflict counter always reads 0, so the validation compares wavefronts only.

ptxas (CUDA 13.0 and 13.5, sm_90a) puts three predicated-off `@!PT LDS RZ, [RZ]` at the head of every
basic block that issues LDGSTS. They never touch shared memory (0 wavefronts) but are issued, so ncu's
smsp__inst_executed_op_shared_ld counts them (it does not count LDSM). The walks count them as
`guard_lds` (see `copy_code_blocks`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from numba import njit

from cuflash import config as _config

from .model import Problem
from .schedules import block_sizes, bwd_query_blocks, key_block_ranges, main_adds_dq

# kind -> (bytes per lane, lanes per phase, phases, is cp.async)
KINDS = {
    "ld32": (4, 32, 1, False),
    "ld64": (8, 16, 2, False),
    "ld128": (16, 8, 4, False),
    "st32": (4, 32, 1, False),
    "st64": (8, 16, 2, False),
    "st128": (16, 8, 4, False),
    "ldmatrix.x1": (16, 8, 1, False),
    "ldmatrix.x2": (16, 8, 2, False),
    "ldmatrix.x4": (16, 8, 4, False),
    "stmatrix.x4": (16, 8, 4, False),
    "cp.async16": (16, 8, 4, True),
}
WARP = 32
NUM_BANKS = 32


@njit(cache=True)
def _instruction_wavefronts(addr, bytes_per_lane, lanes_per_phase, phases, is_cp_async):
    """(wavefronts, phases with an active lane) of one warp instruction; addr[lane] < 0 = inactive."""
    words_per_lane = bytes_per_lane // 4
    words = np.empty(WARP, np.int64)
    lines = np.empty(8, np.int64)
    per_bank = np.zeros(NUM_BANKS, np.int64)
    total = 0
    active_phases = 0
    for ph in range(phases):
        n = 0
        n_lines = 0
        per_bank[:] = 0
        for lane in range(ph * lanes_per_phase, (ph + 1) * lanes_per_phase):
            a = addr[lane]
            if a < 0:
                continue
            if is_cp_async:
                line = a >> 7
                seen = False
                for i in range(n_lines):
                    if lines[i] == line:
                        seen = True
                if not seen:
                    lines[n_lines] = line
                    n_lines += 1
            for w in range(words_per_lane):
                word = (a >> 2) + w
                seen = False
                for i in range(n):
                    if words[i] == word:  # same word: one broadcast
                        seen = True
                        break
                if not seen:
                    words[n] = word
                    n += 1
                    per_bank[word & (NUM_BANKS - 1)] += 1
        if n == 0:
            continue
        active_phases += 1
        wf = per_bank.max()
        if is_cp_async and n_lines > wf:
            wf = n_lines
        total += wf
    return total, active_phases


@njit(cache=True)
def _count_many(addrs, bytes_per_lane, lanes_per_phase, phases, is_cp_async):
    """Sum of (wavefronts, phases) over instructions addrs[i, lane]."""
    wavefronts = 0
    active = 0
    for i in range(addrs.shape[0]):
        wf, ph = _instruction_wavefronts(addrs[i], bytes_per_lane, lanes_per_phase, phases, is_cp_async)
        wavefronts += wf
        active += ph
    return wavefronts, active


def count(byte_addresses, kind: str) -> tuple[int, int]:
    """(wavefronts, conflicts) of one warp instruction of `kind` whose lane i accesses byte_addresses[i].

    byte_addresses: 32 shared-memory byte addresses, lane order (for ldmatrix.x1 / .x2 the 8 / 16 row
    addresses are enough; the other lanes' addresses are ignored, as by the hardware). Each address must
    be aligned to the access size (4, 8 or 16 bytes)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not known; known: {', '.join(KINDS)}")
    bpl, lpp, phases, is_cp = KINDS[kind]
    used = lpp * phases
    a = np.asarray(byte_addresses)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"byte_addresses must be a 1-D sequence of integers, got {a.dtype} with shape {a.shape}")
    if len(a) not in (used, WARP):
        raise ValueError(f"{kind} needs {used if used == WARP else f'{used} or {WARP}'} lane addresses, got {len(a)}")
    a = a[:used].astype(np.int64)
    if (a < 0).any():
        raise ValueError(f"byte addresses must be non-negative; got {a[a < 0][:4].tolist()}")
    misaligned = a % bpl != 0
    if misaligned.any():
        raise ValueError(f"{kind} accesses {bpl} bytes per lane, so addresses must be multiples of {bpl}; "
                         f"lane {int(np.argmax(misaligned))} has {int(a[misaligned][0])}")
    full = np.full(WARP, -1, dtype=np.int64)
    full[:used] = a
    wf, active = _instruction_wavefronts(full, bpl, lpp, phases, is_cp)
    return int(wf), int(wf - active)


def count_instructions(addrs: np.ndarray, kind: str) -> tuple[int, int]:
    """(wavefronts, conflicts) summed over warp instructions addrs[i, lane] (-1 = inactive lane)."""
    bpl, lpp, phases, is_cp = KINDS[kind]
    addrs = np.ascontiguousarray(addrs, dtype=np.int64).reshape(-1, WARP)
    wf, active = _count_many(addrs, bpl, lpp, phases, is_cp)
    return int(wf), int(wf - active)


@njit(cache=True)
def _cp_async_bounds_many(saddrs, gaddrs):
    """(lower, upper) wavefronts summed over cp.async16 instructions saddrs[i, lane] (shared, -1 = inactive)
    with global source addresses gaddrs[i, lane]: per phase of 8 lanes, lower = max(bank rule, shared
    lines), upper = max(lower, distinct 128-byte global lines)."""
    lo_total = 0
    hi_total = 0
    one = np.full(WARP, -1, np.int64)
    glines = np.empty(8, np.int64)
    for i in range(saddrs.shape[0]):
        for ph in range(4):
            one[:] = -1
            n_g = 0
            for lane in range(8 * ph, 8 * ph + 8):
                a = saddrs[i, lane]
                if a < 0:
                    continue
                one[lane] = a
                line = gaddrs[i, lane] >> 7
                seen = False
                for k in range(n_g):
                    if glines[k] == line:
                        seen = True
                if not seen:
                    glines[n_g] = line
                    n_g += 1
            if n_g == 0:
                continue
            lo, _ = _instruction_wavefronts(one, 16, 8, 4, True)
            lo_total += lo
            hi_total += max(lo, n_g)
    return lo_total, hi_total


def count_cp_async(shared_addresses, global_addresses) -> tuple[int, int]:
    """(lower, upper) bound on the shared-memory wavefronts of cp.async16 warp instruction(s).

    shared_addresses, global_addresses: [..., 32] byte addresses per lane (shared -1 = lane inactive).
    lower = `count(shared, "cp.async16")[0]` (bank rule, at least one wavefront per 128-byte shared line);
    upper = per phase max(lower, distinct 128-byte global lines the 8 lanes read). Equal when every
    phase reads one global line (128-byte panels); see the module docstring for what was measured
    between them."""
    s = np.asarray(shared_addresses, dtype=np.int64).reshape(-1, WARP)
    g = np.broadcast_to(np.asarray(global_addresses, dtype=np.int64), np.shape(shared_addresses)).reshape(-1, WARP)
    if (s[s >= 0] % 16).any() or (g[s >= 0] % 16).any():
        raise ValueError("cp.async16 moves 16 bytes per lane: shared and global addresses must be multiples of 16")
    lo, hi = _cp_async_bounds_many(np.ascontiguousarray(s), np.ascontiguousarray(g))
    return int(lo), int(hi)


# ----------------------------------------------------------------------------------------------
# Layouts of a [rows, head_dim] 16-bit tile: byte offset of element (row, col)
# ----------------------------------------------------------------------------------------------

def row_major_offset(row, col, head_dim: int, elem_bytes: int = 2):
    return (row * head_dim + col) * elem_bytes


def padded_offset(row, col, head_dim: int, pad_elems: int = 8, elem_bytes: int = 2):
    """Rows padded by pad_elems (8 x 2 bytes = 16 bytes: a 128-byte row becomes 144 bytes)."""
    return (row * (head_dim + pad_elems) + col) * elem_bytes


def swizzled_offset(row, col, rows: int, head_dim: int, panel_cols: int | None = None):
    """The kernels' layout, SmemTile<rows, head_dim, PANEL_COLS>::offset of cuda/tiles.cuh (NumPy arrays work).

    panel_cols None: the default panel width (cuflash.config.swizzled_offset); 32 or 64: a tile that asks
    for its own width (BwdSm90Traits::PANEL_COLS, `BwdSm90Config.panel_cols`)."""
    if panel_cols is None:
        return _config.swizzled_offset(row, col, rows, head_dim)
    if panel_cols not in (32, 64) or head_dim % panel_cols:
        raise ValueError(f"panel_cols={panel_cols} must be 32 or 64 and divide head_dim={head_dim}")
    panel_bytes = panel_cols * _config.ELEM_BYTES
    panel, c = np.divmod(col, panel_cols)
    off = row * panel_bytes + c * _config.ELEM_BYTES
    off = off ^ (((off >> 7) & (7 if panel_bytes == 128 else 3)) << 4)
    return panel * rows * panel_bytes + off


# ----------------------------------------------------------------------------------------------
# Mirrors of cuda/tiles.cuh: tile copies, ldmatrix lane addresses
# ----------------------------------------------------------------------------------------------

def fixed_column(threads: int, rows: int, tile_cols: int, panel_cols: int | None = None) -> bool:
    """SmemTile<rows, tile_cols, panel_cols>::fixed_column<threads>(): each thread keeps one 16-byte column
    chunk and steps rows by ROWS_PER_ITER = threads / CHUNKS_PER_ROW, a multiple of 8 (or one step); only
    when the 8 lanes of a phase stay in one 128-byte line of one panel (128-byte panels, or a row that is
    one 64-byte panel)."""
    cpr = tile_cols // _config.CHUNK_ELEMS
    pc = _config.panel_cols(tile_cols) if panel_cols is None else panel_cols
    return (threads % cpr == 0 and (pc == 64 or cpr == pc // _config.CHUNK_ELEMS)
            and ((threads // cpr) % 8 == 0 or threads // cpr >= rows))


def panel_order(idx, rows: int, tile_cols: int, panel_cols: int | None = None):
    """SmemTile::panel_order: chunk idx -> (row, col), panel by panel, then rows, then the chunks of
    that panel row (NumPy arrays work; panel_cols as in swizzled_offset)."""
    pc = _config.panel_cols(tile_cols) if panel_cols is None else panel_cols
    panel_chunks = pc // _config.CHUNK_ELEMS
    panel, rest = np.divmod(idx, rows * panel_chunks)
    row, chunk = np.divmod(rest, panel_chunks)
    return row, panel * pc + chunk * _config.CHUNK_ELEMS


def copy_addresses(threads: int, rows: int, tile_cols: int, base: int, rows_valid: int | None = None,
                   cols_valid: int | None = None, panel_cols: int | None = None) -> np.ndarray:
    """Shared addresses of a [rows, tile_cols] tile copy by `threads` threads, load_tile_async or
    store_tile of cuda/tiles.cuh: [warp, i, lane], -1 where the lane issues nothing.

    fixed_column: thread tid keeps column chunk tid % CHUNKS_PER_ROW, rows tid / CHUNKS_PER_ROW +
    i * ROWS_PER_ITER for i < ceil(ROWS / ROWS_PER_ITER), rows >= ROWS skipped. Otherwise chunks
    idx = tid + i * THREADS < CHUNKS in panel order (panel_order). cp.async issues every chunk of the
    tile (rows >= rows_valid and columns >= cols_valid are zero-filled, still written); store_tile
    reads only rows < rows_valid and cols < cols_valid (pass them for a store). panel_cols: the tile's
    panel width when it is not the default (swizzled_offset)."""
    row, col, issued = _copy_lanes(threads, rows, tile_cols, panel_cols)
    addr = base + swizzled_offset(np.minimum(row, rows - 1), col, rows, tile_cols, panel_cols)
    if rows_valid is not None:
        issued = issued & (row < rows_valid)
    if cols_valid is not None:
        issued = issued & (col < cols_valid)
    return np.where(issued, addr, -1)


def _copy_lanes(threads: int, rows: int, tile_cols: int, panel_cols: int | None = None):
    """(row, col, issued) of every [warp, i, lane] of a tile copy (copy_addresses)."""
    cpr = tile_cols // _config.CHUNK_ELEMS
    n_chunks = rows * cpr
    tid = np.arange(threads).reshape(threads // WARP, 1, WARP)
    if fixed_column(threads, rows, tile_cols, panel_cols):
        rows_per_iter = threads // cpr
        iters = -(-rows // rows_per_iter)
        row = tid // cpr + np.arange(iters).reshape(1, iters, 1) * rows_per_iter
        col = np.broadcast_to((tid % cpr) * _config.CHUNK_ELEMS, row.shape)
        return row, col, row < rows
    iters = -(-n_chunks // threads)
    idx = tid + np.arange(iters).reshape(1, iters, 1) * threads
    row, col = panel_order(np.minimum(idx, n_chunks - 1), rows, tile_cols, panel_cols)
    return row, col, idx < n_chunks


# global rows of a copied tile never share a 128-byte line and start on one (true for every kernel head
# dim at its own run-time head_dim: the row segments of one panel are 64 or 128 bytes at a 64-byte-aligned
# offset); only the distinct-line count per phase matters, so any stride >= the row length works
GLOBAL_ROW_PITCH = 1 << 20


def copy_global_offsets(threads: int, rows: int, tile_cols: int, panel_cols: int | None = None) -> np.ndarray:
    """Global source byte offsets (from the tile's first row) of the lanes of load_tile_async, shaped as
    copy_addresses: row * GLOBAL_ROW_PITCH + col * 2."""
    row, col, _ = _copy_lanes(threads, rows, tile_cols, panel_cols)
    return row * GLOBAL_ROW_PITCH + col * _config.ELEM_BYTES


def panel_order_unrolled(threads: int, rows: int, tile_cols: int) -> bool:
    """SmemTile::panel_order_unrolled<threads>(): a panel-order copy of at most 4 chunks per thread, the
    same for every thread, is a fully unrolled (straight-line) copy."""
    n_chunks = rows * (tile_cols // _config.CHUNK_ELEMS)
    return n_chunks % threads == 0 and n_chunks // threads <= 4


def panel_steps(threads: int, rows: int, tile_cols: int, panel_cols: int | None = None) -> int | None:
    """The trip count of load_tile_async's loop over panel steps (cuda/tiles.cuh), or None where the copy does not
    take that loop: a panel-order copy of more than 4 chunks per thread whose chunk steps are exact
    (SmemTile::chunk_steps_exact: the threads cover a whole number of panel rows of 8-row periods, and either divide
    a panel's chunks or are a multiple of them), the same count for every thread or whole panels per step. Each step
    issues the thread's chunks of threads-worth of panel rows (ROW_COPIES, unrolled), so the loop runs
    ceil(CHUNKS / ROW_COPIES / THREADS) times; where that does not divide, the last step's threads past the last
    panel leave the loop."""
    pc = _config.panel_cols(tile_cols) if panel_cols is None else panel_cols
    panel_chunks = pc // _config.CHUNK_ELEMS
    chunks_per_panel = rows * panel_chunks
    n_chunks = rows * (tile_cols // _config.CHUNK_ELEMS)
    if fixed_column(threads, rows, tile_cols, panel_cols) or panel_order_unrolled(threads, rows, tile_cols):
        return None
    if not ((threads % chunks_per_panel == 0 or chunks_per_panel % threads == 0)
            and threads % (8 * panel_chunks) == 0):
        return None
    if n_chunks % threads and threads % chunks_per_panel:
        return None
    row_copies = chunks_per_panel // threads if chunks_per_panel > threads else 1
    return -(-n_chunks // row_copies // threads)


def copy_code_blocks(threads: int, rows: int, tile_cols: int, panel_cols: int | None = None) -> np.ndarray | None:
    """Basic blocks with LDGSTS that each warp executes for one load_tile_async, or None when the copy
    is straight-line code (fixed_column, or a short panel-order copy that is fully unrolled: it shares
    one block with the copies next to it). The loop over panel steps (panel_steps) is one block per
    step. The rolled panel-order loop of the other copies, `for (idx = tid; idx < CHUNKS; idx += THREADS)`,
    has a per-thread trip count T; ptxas unrolls it by 4 with the remainder first: T % 4 single-copy
    blocks and T // 4 four-copy blocks, and a warp runs a block when any of its threads does (both
    checked against the SASS of every validated instantiation, NVRTC 13.0 and 13.5). Returns [warp]
    counts. panel_cols: the tile's panel width when not the default (bwd_sm90_kernel at HEAD_DIM 64)."""
    if fixed_column(threads, rows, tile_cols, panel_cols) or panel_order_unrolled(threads, rows, tile_cols):
        return None
    steps = panel_steps(threads, rows, tile_cols, panel_cols)
    n_chunks = rows * (tile_cols // _config.CHUNK_ELEMS)
    tid = np.arange(threads).reshape(threads // WARP, WARP)
    trips = np.maximum(n_chunks - tid + threads - 1, 0) // threads
    if steps is not None:  # a warp runs the steps where any of its threads has a chunk (an uneven copy's last)
        return np.full(threads // WARP, steps, dtype=np.int64) if n_chunks % threads == 0 else trips.max(axis=1)
    return (trips % 4).max(axis=1) + (trips // 4).max(axis=1)


GUARD_LDS_PER_BLOCK = 3  # `@!PT LDS RZ, [RZ]` x 3 at the head of every basic block that issues LDGSTS
# ... and x 4 before every fence.proxy.async.shared::cta (SASS: MEMBAR.ALL.CTA; FENCE.VIEW.ASYNC.S) of the
# wgmma kernels: after each cp.async wait and, in bwd_sm90_kernel, after the dS^T stores (nvcc 13.0 SASS of
# fwd_sm90 d64, d96, d256 causal and bwd_sm90 d64, d128 causal and deterministic, sources of a0bccd8)
FENCE_GUARD_LDS = 4


BLOCK_BREAK = ("break",)  # a copies entry of guard_lds_per_warp: the next straight-line copy starts a new block


def guard_lds_per_warp(threads: int, copies) -> np.ndarray:
    """Predicated-off LDS per warp of a sequence of tile copies in program order: copies = [(rows,
    tile_cols[, panel_cols]) or ("guarded", warps_entering)], e.g. [(BLOCK_M, HD), (BLOCK_N, HD), (BLOCK_N, HD)].
    Adjacent straight-line (fixed_column) copies share one block; a loop copy contributes its own
    blocks and ends the run; ("guarded", mask) is one block of its own (an `if (tid < n)` copy) run by
    the warps where mask is True."""
    warps = threads // WARP
    blocks = np.zeros(warps, dtype=np.int64)
    in_run = False
    for c in copies:
        if c == BLOCK_BREAK:  # code between two copies ends the straight-line block
            in_run = False
            continue
        if c[0] == "guarded":
            blocks += np.asarray(c[1], dtype=np.int64)
            in_run = False
            continue
        b = copy_code_blocks(threads, *c)
        if b is None:
            if not in_run:
                blocks += 1
            in_run = True
        else:
            blocks += b
            in_run = False
    return GUARD_LDS_PER_BLOCK * blocks


# lane l -> (row, col) inside a 16 x 16 block, per lane_offset_* function of cuda/tiles.cuh
_L = np.arange(WARP)
LANE_PATTERNS = {
    "a": (_L & 15, (_L >> 4) * 8),  # lane_offset_a: A row-major (Q, K, V as A)
    "b_nk": ((_L & 7) + ((_L >> 4) << 3), ((_L >> 3) & 1) * 8),  # lane_offset_b_nk: B from [n][k]
    "b_kn_trans": ((_L & 7) + ((_L >> 3) & 1) * 8, (_L >> 4) * 8),  # lane_offset_b_kn_trans (.trans)
    "a_trans": ((_L & 7) + (_L >> 4) * 8, ((_L >> 3) & 1) * 8),  # lane_offset_a_trans (.trans)
}


def frag_addresses(pattern: str, base: int, rows: int, tile_cols: int, row0, col0) -> np.ndarray:
    """ldmatrix.x4 lane addresses of the 16 x 16 block at (row0, col0) of a [rows, tile_cols] tile
    at `base`: Tile::frag(base + lane_offset_<pattern>(lane), row0, col0), which equals
    base + Tile::offset(row0 + r, col0 + c) for the lane's (r, c) (test_frag_equals_offset).
    row0 and col0 broadcast; the result has a trailing lane axis."""
    r, c = LANE_PATTERNS[pattern]
    row0 = np.asarray(row0)[..., None]
    col0 = np.asarray(col0)[..., None]
    return base + swizzled_offset(row0 + r, col0 + c, rows, tile_cols)


def tile_frag(lane_addr, row0: int, col0: int, rows: int, tile_cols: int):
    """Literal mirror of SmemTile::frag (XOR of the chunk bits, panels and 8-row steps added)."""
    pc = _config.panel_cols(tile_cols)
    return ((lane_addr ^ (((col0 % pc) // 8) << 4)) + (col0 // pc) * (rows * pc * _config.ELEM_BYTES)
            + row0 * pc * _config.ELEM_BYTES)


def accumulator_store_addresses(base: int, rows: int, tile_cols: int, row0, col0,
                                panel_cols: int | None = None) -> np.ndarray:
    """st.shared.b32 of one m16n8 accumulator half: lane (g = l >> 2, t = l & 3) writes the packed pair
    (row0 + g, col0 + 2t) of a [rows, tile_cols] tile; row0, col0 broadcast, trailing lane axis."""
    row0 = np.asarray(row0)[..., None]
    col0 = np.asarray(col0)[..., None]
    return base + swizzled_offset(row0 + (_L >> 2), col0 + 2 * (_L & 3), rows, tile_cols, panel_cols)


# ----------------------------------------------------------------------------------------------
# Walks: every shared-memory instruction of a kernel over its grid
# ----------------------------------------------------------------------------------------------

@dataclass
class InstrStats:
    kind: str
    instructions: int = 0  # warp instructions (kind "wgmma": wgmma.mma_async per warpgroup)
    wavefronts: int = 0
    conflicts: int = 0
    bytes: int = 0  # bytes moved by active lanes
    wavefronts_hi: int | None = None  # cp.async: upper bound (count_cp_async); None = wavefronts

    def __post_init__(self):
        if self.wavefronts_hi is None:
            self.wavefronts_hi = self.wavefronts

    def add(self, other: "InstrStats", times: int = 1):
        self.instructions += other.instructions * times
        self.wavefronts += other.wavefronts * times
        self.wavefronts_hi += other.wavefronts_hi * times
        self.conflicts += other.conflicts * times
        self.bytes += other.bytes * times


# role -> kind, and what ncu calls it (the SASS instruction)
FWD_ROLES = {
    "q_load": ("cp.async16", "LDGSTS"),  # Q tile gmem -> smem
    "k_load": ("cp.async16", "LDGSTS"),
    "v_load": ("cp.async16", "LDGSTS"),
    "q_frag": ("ldmatrix.x4", "LDSM"),  # A fragments of S = Q K^T
    "k_frag": ("ldmatrix.x4", "LDSM"),  # B fragments of S = Q K^T
    "v_frag": ("ldmatrix.x4", "LDSM"),  # B fragments of O += P V (.trans)
    "o_store": ("st32", "STS"),  # O (fp32 regs -> T) into the Q region
    "o_read": ("ld128", "LDS"),  # O smem -> regs for the 16-byte global stores
}

# bwd_kernel (cuda/bwd.cuh), in program order
BWD_ROLES = {
    "k_load": ("cp.async16", "LDGSTS"),  # K_j, V_j once per CTA
    "v_load": ("cp.async16", "LDGSTS"),
    "q_load": ("cp.async16", "LDGSTS"),  # Q_i, dO_i per query block, into stage (visit % 2)
    "do_load": ("cp.async16", "LDGSTS"),
    "vec_load": ("cp.async16", "LDGSTS"),  # lse_log2_i, delta_i: BLOCK_M / 4 chunks each
    "k_frag_a": ("ldmatrix.x4", "LDSM"),  # S^T = K Q^T: A = K (lane_offset_a)
    "q_frag_b": ("ldmatrix.x4", "LDSM"),  # B = Q [query][d] (lane_offset_b_nk)
    "lse_load": ("ld64", "LDS"),  # float2 lse_log2 per n8 query tile
    "do_frag_t": ("ldmatrix.x4", "LDSM"),  # dV += P^T dO: B = dO .trans (lane_offset_b_kn_trans)
    "v_frag_a": ("ldmatrix.x4", "LDSM"),  # dP^T = V dO^T: A = V
    "do_frag_b": ("ldmatrix.x4", "LDSM"),  # B = dO
    "delta_load": ("ld64", "LDS"),  # float2 delta per n8 query tile
    "q_frag_t": ("ldmatrix.x4", "LDSM"),  # dK += dS^T Q: B = Q .trans
    "ds_store": ("st32", "STS"),  # dS^T (packed pairs) by the warps with warp % D_SPLIT == 0
    "ds_frag_t": ("ldmatrix.x4", "LDSM"),  # dQ += dS K: A = dS^T .trans (lane_offset_a_trans)
    "k_frag_t": ("ldmatrix.x4", "LDSM"),  # B = K .trans
    "dk_store": ("st32", "STS"),  # epilogue: dK into the K tile, dV into the V tile
    "dv_store": ("st32", "STS"),
    "dk_read": ("ld128", "LDS"),  # store_tile of dK, dV (valid keys and columns)
    "dv_read": ("ld128", "LDS"),
}

# bwd_dq_kernel (deterministic dQ, Q-outer)
DQ_ROLES = {
    "q_load": ("cp.async16", "LDGSTS"),  # Q_i, dO_i once per CTA
    "do_load": ("cp.async16", "LDGSTS"),
    "k_load": ("cp.async16", "LDGSTS"),  # K_j, V_j per key tile, into stage (iteration % 2)
    "v_load": ("cp.async16", "LDGSTS"),
    "q_frag": ("ldmatrix.x4", "LDSM"),  # S = Q K^T: A = Q
    "do_frag": ("ldmatrix.x4", "LDSM"),  # dP = dO V^T: A = dO
    "k_frag": ("ldmatrix.x4", "LDSM"),  # B = K
    "v_frag": ("ldmatrix.x4", "LDSM"),  # B = V
    "k_frag_t": ("ldmatrix.x4", "LDSM"),  # dQ += dS K: B = K .trans
    "dq_store": ("st32", "STS"),  # epilogue: dQ into the Q tile
    "dq_read": ("ld128", "LDS"),  # store_tile of dQ
}

# fwd_sm90_kernel (cuda/fwd_sm90.cuh), in program order. The wgmma roles are no thread instructions: the
# tensor core reads its shared-memory operands through the descriptors, once per warpgroup instruction
# (kind "wgmma": bytes only, no bank model; ncu counts no LDS or LDSM for them)
FWD_SM90_ROLES = {
    "q_load": ("cp.async16", "LDGSTS"),  # Q tile once per CTA
    "k_load": ("cp.async16", "LDGSTS"),  # K, V per key tile, into stage (iteration % 2)
    "v_load": ("cp.async16", "LDGSTS"),
    "s_wgmma": ("wgmma", "HGMMA"),  # S = Q K^T: the warpgroup's 64 Q rows and all of K (K-major)
    "o_wgmma": ("wgmma", "HGMMA"),  # O += P V: V (N-major); P from registers
    "o_store": ("st32", "STS"),  # O (fp32 regs -> T) into the Q tile, warp w rows 16w + g (+8)
    "o_read": ("ld128", "LDS"),  # store_tile of O
}

# bwd_sm90_kernel (cuda/bwd_sm90.cuh), in program order; every warp owns 16 keys (64 per warpgroup)
BWD_SM90_ROLES = {
    "k_load": ("cp.async16", "LDGSTS"),  # K_j, V_j once per CTA
    "v_load": ("cp.async16", "LDGSTS"),
    "q_load": ("cp.async16", "LDGSTS"),  # Q_i, dO_i, lse_log2_i, delta_i per query block (bwd_load_query_block)
    "do_load": ("cp.async16", "LDGSTS"),
    "vec_load": ("cp.async16", "LDGSTS"),
    "st_wgmma": ("wgmma", "HGMMA"),  # S^T = K Q^T: the warpgroup's 64 K rows, all of Q (both K-major)
    "dpt_wgmma": ("wgmma", "HGMMA"),  # dP^T = V dO^T: 64 V rows, all of dO
    "lse_load": ("ld64", "LDS"),  # float2 lse_log2 per n8 query tile
    "delta_load": ("ld64", "LDS"),  # float2 delta per n8 query tile
    "dv_wgmma": ("wgmma", "HGMMA"),  # dV += P^T dO: dO N-major; P^T from registers
    "dk_wgmma": ("wgmma", "HGMMA"),  # dK += dS^T Q: Q N-major; dS^T from registers
    "ds_store": ("st32", "STS"),  # dS^T (packed pairs) by every warp, unless deterministic
    "dq_wgmma": ("wgmma", "HGMMA"),  # dQ = dS K: all of dS^T (M-major), the warpgroup's DQ_COLS of K
    "dk_store": ("st32", "STS"),  # epilogue: dK into the K tile, dV into the V tile
    "dv_store": ("st32", "STS"),
    "dk_read": ("ld128", "LDS"),  # store_tile of dK, dV (valid keys and columns)
    "dv_read": ("ld128", "LDS"),
}

# bwd_sm90_ws_kernel (cuda/bwd_sm90_ws.cuh), in program order: bwd_sm90_kernel's math on two consumer warpgroups
# (8 warps), its loads by one producer thread through TMA (K, V once; Q, dO per visited query block: one box per
# swizzle panel, the whole box written) and 1-D bulk copies (lse_log2, delta: BLOCK_M floats each), dS^T in two
# buffers (visit k uses buffer k % 2, as its stage), and dQ through a shared fp32 buffer (16-byte stores in the
# consumers' accumulator order) that one bulk reduction per visit adds into dQ_acc (the bulk engine reads the whole
# buffer: no LSU instruction, no bank model). No cp.async.
BWD_SM90_WS_ROLES = {
    "k_tma": ("tma", "UTMALDG"),  # K_j, V_j once per CTA
    "v_tma": ("tma", "UTMALDG"),
    "q_tma": ("tma", "UTMALDG"),  # Q_i, dO_i per visited query block
    "do_tma": ("tma", "UTMALDG"),
    "vec_bulk": ("tma", "UBLKCP"),  # lse_log2_i and delta_i: two 1-D bulk copies
    "st_wgmma": ("wgmma", "HGMMA"),
    "dpt_wgmma": ("wgmma", "HGMMA"),
    "lse_load": ("ld64", "LDS"),
    "delta_load": ("ld64", "LDS"),
    "dv_wgmma": ("wgmma", "HGMMA"),
    "dk_wgmma": ("wgmma", "HGMMA"),
    # dS^T, dQ = dS K, its stores and the bulk reduction: unless deterministic, and deterministic on the ordered path
    # (config.ordered_dq: the producer warpgroup's dQ writer issues the same reduction in its turn)
    "ds_store": ("stmatrix.x4", "STSM"),  # dS^T into buffer k % 2: one stmatrix.x4 per 16 keys x 16 queries
    "dq_wgmma": ("wgmma", "HGMMA"),  # per consumer, or consumer 1 alone (config.bwd_ws_dq_one_wg)
    "dq_store": ("st128", "STS"),  # dQ_i into the dQ buffer (config.bwd_ws_dq_one_wg: consumer 1's 4 warps)
    "dq_bulk": ("tma", "UBLKRED"),  # the dQ buffer read by the bulk reduction into dQ_acc
    # a staged 16-bit bias (config.bwd_stages_bias): each consumer warp copies its 16 keys of the block's rows (two
    # 16-byte chunks per row, bias_offset's layout) and reads them back as the S^T layout with ldmatrix .x4 .trans
    # (two query tiles per load; head dim 128: .x2, one query tile, bias_frag2)
    "bias_stage": ("cp.async16", "LDGSTS"),
    "bias_frag": ("ldmatrix.x4", "LDSM"),
    "bias_frag2": ("ldmatrix.x2", "LDSM"),
    "dk_store": ("st32", "STS"),  # epilogue: dK into the K tile, dV into the V tile (the 8 consumer warps)
    "dv_store": ("st32", "STS"),
    "dk_read": ("ld128", "LDS"),  # store_tile of dK, dV by the 256 consumer threads
    "dv_read": ("ld128", "LDS"),
}

# fwd_sm90_ws_kernel (cuda/fwd_sm90_ws.cuh), in program order. One producer thread issues the TMA loads
# (cp.async.bulk.tensor, SASS UTMALDG): each writes one 64-column x ROWS box, the 128-byte swizzled panel of
# SmemTile, and every box byte lands in shared memory (rows past seqlen and columns past head_dim as zeros; the
# mbarrier's expect_tx counts them). They are no LSU instructions (kind "tma": bytes and boxes only, no bank
# model, no wavefront in the l1tex LSU shared counters). The wgmma roles are those of fwd_sm90_kernel with two
# consumer warpgroups; the O staging goes through the Q tile as in fwd_sm90_kernel, by the 8 consumer warps.
FWD_SM90_WS_ROLES = {
    "q_tma": ("tma", "UTMALDG"),  # Q tile once per CTA: HEAD_DIM/64 boxes of 64 x BLOCK_M
    "k_tma": ("tma", "UTMALDG"),  # K_i, V_i per key tile into stage i % STAGES: HEAD_DIM/64 boxes of 64 x BLOCK_N
    "v_tma": ("tma", "UTMALDG"),
    "s_wgmma": ("wgmma", "HGMMA"),  # S = Q K^T: each consumer's 64 Q rows and all of K (K-major)
    "o_wgmma": ("wgmma", "HGMMA"),  # O += P V: V (MN-major); P from registers
    "o_store": ("st32", "STS"),  # O (fp32 regs -> T) into the Q tile, consumer warp w rows 16w + g (+8)
    "o_read": ("ld128", "LDS"),  # 16-byte chunks of each consumer's 64 rows for the global stores
}

SASS_CLASSES = ("LDGSTS", "LDSM", "LDS", "STS", "STSM")  # the shared-memory instructions threads issue
TENSOR_CLASS = "HGMMA"  # wgmma operand reads (tensor core, through descriptors)
TMA_CLASS = "UTMALDG"  # TMA tile loads global -> shared (the TMA unit writes shared memory, no thread does)
BULK_COPY_CLASS = "UBLKCP"  # 1-D bulk copies global -> shared (cp.async.bulk)
BULK_READ_CLASS = "UBLKRED"  # bulk reductions shared -> global (cp.reduce.async.bulk): read shared memory


@dataclass
class SharedWalk:
    """Totals over the whole grid of one kernel, per role (role_table: role -> (kind, SASS class))."""

    config: object
    roles: dict = field(default_factory=dict)
    role_table: dict = field(default_factory=lambda: FWD_ROLES)
    # predicted-off `@!PT LDS RZ, [RZ]` that ptxas puts before LDGSTS (GUARD_LDS_PER_BLOCK per block) and
    # before fence.proxy.async (FENCE_GUARD_LDS): issued, so smsp__inst_executed_op_shared_ld counts them;
    # no wavefront, no byte
    guard_lds: int = 0

    def by_sass(self, sass: str) -> InstrStats:
        out = InstrStats(sass)
        for role, (_, s) in self.role_table.items():
            if s == sass and role in self.roles:
                out.add(self.roles[role])
        return out

    @property
    def thread_read_bytes(self) -> int:
        """Bytes read by thread instructions (LDSM, LDS): what ncu's shared-load counters see."""
        return self.by_sass("LDSM").bytes + self.by_sass("LDS").bytes

    @property
    def wgmma_read_bytes(self) -> int:
        """Shared-memory operand bytes the tensor core reads for wgmma (0 in the mma.sync kernels). These
        are not thread instructions: no bank rule applies and ncu counts them as neither LDS nor LDSM."""
        return self.by_sass(TENSOR_CLASS).bytes

    @property
    def bulk_read_bytes(self) -> int:
        """Shared-memory bytes the bulk-copy engine reads (cp.reduce.async.bulk, SASS UBLKRED: the ws backward's dQ
        buffer; 0 elsewhere). No thread instruction: no bank rule."""
        return self.by_sass(BULK_READ_CLASS).bytes

    @property
    def read_bytes(self) -> int:
        """Every byte read from shared memory: thread instructions, wgmma operands and bulk reductions."""
        return self.thread_read_bytes + self.wgmma_read_bytes + self.bulk_read_bytes

    @property
    def tma_write_bytes(self) -> int:
        """Shared-memory bytes the TMA unit writes (whole boxes, zero-filled rows included, and 1-D bulk copies; 0
        without TMA). No thread instruction: no bank rule, and the l1tex LSU shared counters do not see them."""
        return self.by_sass(TMA_CLASS).bytes + self.by_sass(BULK_COPY_CLASS).bytes

    @property
    def write_bytes(self) -> int:
        return (self.by_sass("LDGSTS").bytes + self.by_sass("STS").bytes + self.by_sass("STSM").bytes
                + self.tma_write_bytes)

    @property
    def conflicts(self) -> int:
        """Bank conflicts of ld/st/ldmatrix/stmatrix (the exact rule; cp.async is modelled separately)."""
        return sum(self.by_sass(s).conflicts for s in ("LDSM", "LDS", "STS", "STSM"))


def _stats(kind: str, addrs: np.ndarray, gaddrs: np.ndarray | None = None) -> InstrStats:
    """Totals of the warp instructions addrs[..., lane]; gaddrs (broadcast to addrs): the global sources
    of cp.async, for the upper bound (without them the bound equals the lower one)."""
    shape = np.shape(addrs)
    addrs = np.asarray(addrs, dtype=np.int64).reshape(-1, WARP)
    live = (addrs >= 0).any(axis=1)  # a warp with no active lane issues nothing
    addrs = addrs[live]
    wf, conf = count_instructions(addrs, kind)
    hi = wf
    if gaddrs is not None:
        g = np.broadcast_to(np.asarray(gaddrs, dtype=np.int64), shape).reshape(-1, WARP)[live]
        lo, hi = count_cp_async(addrs, g)
        assert lo == wf, (lo, wf)
    return InstrStats(kind, addrs.shape[0], wf, conf, int((addrs >= 0).sum()) * KINDS[kind][0], hi)


def _per_warp(a: np.ndarray, num_warps: int) -> np.ndarray:
    """The same addresses for every warp: [warp, ...]."""
    return np.broadcast_to(a, (num_warps,) + np.shape(a))


def _ax(n: int, pos: int, ndim: int) -> np.ndarray:
    """arange(n) shaped to broadcast along axis pos of ndim axes."""
    shape = [1] * ndim
    shape[pos] = n
    return np.arange(n).reshape(shape)


# ---- fwd_kernel --------------------------------------------------------------------------------

def _warp_rows0(cfg) -> np.ndarray:
    return np.arange(cfg.num_warps) * (cfg.block_m // cfg.num_warps)


def _fwd_copy_addresses(cfg, stage: int, rows_q: int | None, head_dim: int | None) -> dict[str, np.ndarray]:
    """The copies of both forward kernels (fwd_kernel, fwd_sm90_kernel), which share one shared-memory
    layout: the Q tile (reused to stage O), then 2 stages of K, then 2 of V. q_load, k_load and v_load
    (K/V of stage `stage`) are cp.async fills; o_read is the O store's read-back of the valid rows."""
    hd, bm, bn = cfg.head_dim, cfg.block_m, cfg.block_n
    k_base, v_base = _fwd_kv_bases(cfg, stage)
    return {
        "q_load": copy_addresses(cfg.threads, bm, hd, 0),
        "k_load": copy_addresses(cfg.threads, bn, hd, k_base),
        "v_load": copy_addresses(cfg.threads, bn, hd, v_base),
        "o_read": copy_addresses(cfg.threads, bm, hd, 0, rows_q, head_dim),
    }


def _fwd_kv_bases(cfg, stage: int) -> tuple[int, int]:
    """Byte offsets of stage `stage`'s K and V tiles in the forward kernels' shared memory."""
    q_bytes = cfg.block_m * cfg.head_dim * _config.ELEM_BYTES
    kv_bytes = cfg.block_n * cfg.head_dim * _config.ELEM_BYTES
    return q_bytes + stage * kv_bytes, q_bytes + (2 + stage) * kv_bytes


def fwd_addresses(cfg, stage: int, rows_q: int | None = None, head_dim: int | None = None) -> dict[str, np.ndarray]:
    """Byte addresses of every shared instruction one CTA of fwd_kernel issues, per role.

    Per-iteration roles (k_load, v_load, q_frag, k_frag, v_frag) are given for one iteration using
    K/V stage buffer `stage`; q_load, o_store and o_read happen once per CTA, o_read (store_tile) only
    for the CTA's valid rows rows_q and columns < head_dim (default: all). Per warp and k-step the Q
    A fragments are loaded once per m-tile (M_TILES of them); the K (and V) B fragments once per
    n-pair (d-pair) and used for every m-tile."""
    hd, bm, bn, nw = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.num_warps
    m_tiles = bm // (_config.MMA_M * nw)
    k_base, v_base = _fwd_kv_bases(cfg, stage)
    out = _fwd_copy_addresses(cfg, stage, rows_q, head_dim)
    w_row0 = _warp_rows0(cfg).reshape(-1, 1, 1)
    # S = Q K^T: for kk: for mt: A(Q, warp_row0 + mt*16, kk*16); for np: B(K, np*16, kk*16)
    out["q_frag"] = frag_addresses("a", 0, bm, hd, w_row0 + _ax(m_tiles, 2, 3) * 16, _ax(hd // 16, 1, 3) * 16)
    out["k_frag"] = _per_warp(frag_addresses("b_nk", k_base, bn, hd, _ax(bn // 16, 1, 2) * 16,
                                             _ax(hd // 16, 0, 2) * 16), nw)
    # O += P V: for kk over keys: for dp: B(V .trans, kk*16, dp*16)
    out["v_frag"] = _per_warp(frag_addresses("b_kn_trans", v_base, bn, hd, _ax(bn // 16, 0, 2) * 16,
                                             _ax(hd // 16, 1, 2) * 16), nw)
    # epilogue: for mt, h, dt: rows warp_row0 + mt*16 + 8h + g, col dt*8 + 2t
    w_row0 = _warp_rows0(cfg).reshape(-1, 1, 1, 1)
    out["o_store"] = accumulator_store_addresses(0, bm, hd, w_row0 + _ax(m_tiles, 1, 4) * 16 + 8 * _ax(2, 2, 4),
                                                 _ax(hd // 8, 3, 4) * 8)
    return {role: np.asarray(a, dtype=np.int64) for role, a in out.items()}


PER_ITERATION_ROLES = ("k_load", "v_load", "q_frag", "k_frag", "v_frag")
PER_CTA_ROLES = ("q_load", "o_store", "o_read")


@lru_cache(maxsize=256)
def fwd_cta_stats(cfg, rows_q: int | None = None, head_dim: int | None = None) -> tuple[dict, list]:
    """(per-CTA stats, per-iteration stats per stage): role -> InstrStats (per_iter[stage][role]).

    Cached: callers must not modify the returned stats."""
    kv = (cfg.block_n, cfg.head_dim)
    src = _tile_sources(cfg.threads, {"q_load": (cfg.block_m, cfg.head_dim), "k_load": kv, "v_load": kv})
    per_iter = []
    for stage in range(2):
        addrs = fwd_addresses(cfg, stage)
        per_iter.append({r: _stats(FWD_ROLES[r][0], addrs[r], src.get(r)) for r in PER_ITERATION_ROLES})
    addrs = fwd_addresses(cfg, 0, rows_q, head_dim)
    per_cta = {r: _stats(FWD_ROLES[r][0], addrs[r], src.get(r)) for r in PER_CTA_ROLES}
    return per_cta, per_iter


def _tile_sources(threads: int, tiles: dict) -> dict:
    """{role: global source offsets} of the cp.async tile copies tiles = {role: (rows, tile_cols[,
    panel_cols])}."""
    return {r: copy_global_offsets(threads, *tile) for r, tile in tiles.items()}


def _check_head_dim(cfg, head_dim):
    head_dim = cfg.head_dim if head_dim is None else head_dim
    if not 1 <= head_dim <= cfg.head_dim:
        raise ValueError(f"head_dim={head_dim} must be in 1..{cfg.head_dim} for a HEAD_DIM={cfg.head_dim} kernel")
    return head_dim


def _q_outer_walk(cfg, role_table, cta_stats, per_iter_roles, per_cta_roles, batch, heads, seqlen_q, seqlen_k,
                  head_dim, causal_skip, window, prologue_copies, step_copies, fences_per_step: int = 0) -> SharedWalk:
    """Shared driver of the Q-outer kernels (fwd_kernel, fwd_sm90_kernel, bwd_dq_kernel): CTA m_block with
    n_blocks > 0 key tiles (schedules.key_block_ranges: causal and window skipping) issues its per-CTA
    roles once (those that depend on the valid rows from cta_stats(cfg, rows, d)) and n_blocks iterations,
    iteration it on K/V stage it % 2. The prologue copies (Q, ..., and the first K/V tile), in every
    iteration but the last the next tile's copies (step_copies), and fences_per_step fence.proxy.async per
    iteration set the guard LDS count (guard_lds_per_warp, FENCE_GUARD_LDS)."""
    p = Problem(batch, heads, seqlen_q, seqlen_k, head_dim, cfg.dtype, cfg.causal, window)
    n_begin, n_end = key_block_ranges(p, cfg.block_m, cfg.block_n, causal_skip)
    n_blocks = np.maximum(n_end - n_begin, 0)  # key tiles of each CTA
    rows_q = block_sizes(seqlen_q, cfg.block_m)
    walk = SharedWalk(cfg, {r: InstrStats(role_table[r][0]) for r in role_table}, role_table)
    per_iter = None
    for rows in np.unique(rows_q[n_blocks > 0]):  # full blocks, and the tail block when it has keys
        live = (rows_q == rows) & (n_blocks > 0)
        per_cta, per_iter = cta_stats(cfg, int(rows), head_dim)
        for r in per_cta_roles:
            walk.roles[r].add(per_cta[r], int(live.sum()) * batch * heads)
    if per_iter is not None:
        for s in range(2):
            iters = int(((n_blocks - s + 1) // 2).sum()) * batch * heads  # it % 2 == s
            for r in per_iter_roles:
                walk.roles[r].add(per_iter[s][r], iters)
    live = n_blocks > 0
    walk.guard_lds = (int(live.sum()) * int(guard_lds_per_warp(cfg.threads, prologue_copies).sum())
                      + int((n_blocks[live] - 1).sum()) * int(guard_lds_per_warp(cfg.threads, step_copies).sum())
                      + int(n_blocks[live].sum()) * fences_per_step * FENCE_GUARD_LDS * (cfg.threads // WARP)
                      ) * batch * heads
    return walk


def fwd_kernel_shared(cfg, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int | None = None,
                      causal_skip: bool = True, window=None) -> SharedWalk:
    """Every shared-memory instruction of fwd_kernel<cfg> over the grid (ceil(Sq/BLOCK_M), heads, batch).

    head_dim: the run-time head dim (<= cfg.head_dim, default cfg.head_dim). A CTA with n_blocks > 0
    issues the Q copy, n_blocks iterations (iteration it uses K/V stage buffer it % STAGES) and the
    epilogue; a CTA that sees no key writes O = 0 / lse = -inf straight to global memory and issues no
    shared instruction."""
    if isinstance(cfg, _config.FwdSm90Config):
        return fwd_sm90_kernel_shared(cfg, batch, heads, seqlen_q, seqlen_k, head_dim, causal_skip, window)
    if isinstance(cfg, _config.FwdSm90WsConfig):
        return fwd_sm90_ws_kernel_shared(cfg, batch, heads, seqlen_q, seqlen_k, head_dim, causal_skip, window)
    if isinstance(cfg, _config.FwdSm90Fp8Config):
        return fwd_sm90_fp8_kernel_shared(cfg, batch, heads, seqlen_q, seqlen_k, head_dim, causal_skip, window)
    if not isinstance(cfg, _config.FwdConfig):
        raise TypeError(f"cfg must be a cuflash.config.FwdConfig, FwdSm90Config, FwdSm90WsConfig or FwdSm90Fp8Config, "
                        f"got {type(cfg).__name__}")
    if getattr(cfg, "decode", False):  # its O leaves from registers, its Q rows are gathered: another walk
        raise ValueError("cfg.decode=True: the kv-cache decode variant of fwd_kernel is not walked; "
                         "allowed: the prefill fwd_kernel (decode=False) and fwd_sm90_kernel")
    head_dim = _check_head_dim(cfg, head_dim)
    q, kv = (cfg.block_m, cfg.head_dim), (cfg.block_n, cfg.head_dim)
    return _q_outer_walk(cfg, FWD_ROLES, fwd_cta_stats, PER_ITERATION_ROLES, PER_CTA_ROLES, batch, heads,
                         seqlen_q, seqlen_k, head_dim, causal_skip, window, [q, kv, kv], [kv, kv])


# ---- fwd_sm90_kernel (Hopper, wgmma) -----------------------------------------------------------------

def wgmma_stats(instructions: int, nbytes: int) -> InstrStats:
    """A wgmma role: `instructions` wgmma.mma_async (per warpgroup, summed over warpgroups) reading
    `nbytes` of shared-memory operands; no wavefronts or conflicts (no thread instruction, no bank rule)."""
    return InstrStats("wgmma", instructions, 0, 0, nbytes, 0)


def fwd_sm90_addresses(cfg, stage: int, rows_q: int | None = None,
                       head_dim: int | None = None) -> dict[str, np.ndarray]:
    """Byte addresses (from the 1024-byte-aligned base) of every thread-issued shared instruction of one
    CTA of fwd_sm90_kernel, per role: the copies and O staging as fwd_addresses (same tiles and layout:
    Q, then 2 stages of K, then 2 of V), with 4 warps per 64 query rows, warp w owning rows 16w.. of the
    tile. The wgmma operand reads are in fwd_sm90_wgmma."""
    hd, bm = cfg.head_dim, cfg.block_m
    out = _fwd_copy_addresses(cfg, stage, rows_q, head_dim)
    # epilogue: for h, dt: (16w + g + 8h, dt*8 + 2t) into the Q tile
    rows = (np.arange(cfg.num_warps) * 16).reshape(-1, 1, 1) + 8 * _ax(2, 1, 3)
    out["o_store"] = accumulator_store_addresses(0, bm, hd, rows, _ax(hd // 8, 2, 3) * 8)
    return {role: np.asarray(a, dtype=np.int64) for role, a in out.items()}


def fwd_sm90_wgmma(cfg) -> dict[str, InstrStats]:
    """wgmma operand reads of one key tile, all warpgroups: S = Q K^T is HEAD_DIM/16 wgmma per warpgroup,
    each reading a 64 x 16 slice of the warpgroup's Q rows and a BLOCK_N x 16 slice of K; O += P V is
    BLOCK_N/16 wgmma reading 16 x HEAD_DIM of V each."""
    wg, hd, bn, e = cfg.block_m // 64, cfg.head_dim, cfg.block_n, _config.ELEM_BYTES
    return {"s_wgmma": wgmma_stats(wg * hd // 16, wg * (64 + bn) * hd * e),
            "o_wgmma": wgmma_stats(wg * bn // 16, wg * bn * hd * e)}


FWD_SM90_PER_ITERATION_ROLES = ("k_load", "v_load", "s_wgmma", "o_wgmma")
FWD_SM90_PER_CTA_ROLES = ("q_load", "o_store", "o_read")


@lru_cache(maxsize=256)
def fwd_sm90_cta_stats(cfg, rows_q: int | None = None, head_dim: int | None = None) -> tuple[dict, list]:
    """(per-CTA stats, per-iteration stats per stage) of fwd_sm90_kernel, as fwd_cta_stats; cached."""
    q, kv = (cfg.block_m, cfg.head_dim), (cfg.block_n, cfg.head_dim)
    src = _tile_sources(cfg.threads, {"q_load": q, "k_load": kv, "v_load": kv})
    per_iter = []
    for stage in range(2):
        addrs = fwd_sm90_addresses(cfg, stage)
        per_iter.append({r: _stats(FWD_SM90_ROLES[r][0], addrs[r], src.get(r)) for r in ("k_load", "v_load")}
                        | fwd_sm90_wgmma(cfg))
    addrs = fwd_sm90_addresses(cfg, 0, rows_q, head_dim)
    per_cta = {r: _stats(FWD_SM90_ROLES[r][0], addrs[r], src.get(r)) for r in FWD_SM90_PER_CTA_ROLES}
    return per_cta, per_iter


def fwd_sm90_kernel_shared(cfg, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int | None = None,
                           causal_skip: bool = True, window=None) -> SharedWalk:
    """Every shared-memory access of fwd_sm90_kernel<cfg> over the grid (ceil(Sq/BLOCK_M), heads, batch):
    the thread-issued instructions (cp.async of Q once and K, V per key tile; the O staging st.shared.b32
    and store_tile's 16-byte loads), walked with the bank rule, and the wgmma operand reads (roles
    s_wgmma, o_wgmma: bytes only). Same grid, key-tile order and skipping as fwd_kernel; each iteration
    also issues one fence.proxy.async (4 guard LDS per warp, FENCE_GUARD_LDS)."""
    if not isinstance(cfg, _config.FwdSm90Config):
        raise TypeError(f"cfg must be a cuflash.config.FwdSm90Config, got {type(cfg).__name__}")
    head_dim = _check_head_dim(cfg, head_dim)
    q, kv = (cfg.block_m, cfg.head_dim), (cfg.block_n, cfg.head_dim)
    return _q_outer_walk(cfg, FWD_SM90_ROLES, fwd_sm90_cta_stats, FWD_SM90_PER_ITERATION_ROLES,
                         FWD_SM90_PER_CTA_ROLES, batch, heads, seqlen_q, seqlen_k, head_dim, causal_skip, window,
                         [q, kv, kv], [kv, kv], fences_per_step=1)


# ---- fwd_sm90_ws_kernel (Hopper: TMA producer, two wgmma consumer warpgroups) ----------------------------

@dataclass(frozen=True)
class FwdSm90WsLayout:
    """The constants of FwdSm90WsTraits (cuda/fwd_sm90_ws.cuh) for one FwdSm90WsConfig: offsets from the
    1024-byte aligned base ([Q] [K stage 0 .. STAGES-1] [V stage 0 .. STAGES-1] [O, a persistent kernel's where it
    fits] [mbarriers])."""

    consumers: int  # consumer warpgroups, 64 query rows each
    consumer_warps: int
    panels: int  # TMA boxes per tile: HEAD_DIM / BOX_COLS
    smem_q: int  # TileQ::BYTES: also the O staging's size
    smem_kv: int  # TileKV::BYTES
    off_q: int
    off_k: int  # + stage * smem_kv
    off_v: int  # + stage * smem_kv
    off_o: int  # the O staging: off_q unless the config's o_separate
    off_bar: int
    smem_bytes: int  # dynamic shared memory requested (+ 1024 for rounding the base up)


def fwd_sm90_ws_layout(cfg) -> FwdSm90WsLayout:
    hd, bm, bn, e = cfg.head_dim, cfg.block_m, cfg.block_n, _config.ELEM_BYTES
    smem_q, smem_kv = bm * hd * e, bn * hd * e
    off_k = smem_q
    off_v = off_k + cfg.stages * smem_kv
    off_o = off_v + cfg.stages * smem_kv if cfg.o_separate else 0
    off_bar = off_v + cfg.stages * smem_kv + (smem_q if cfg.o_separate else 0)
    consumers = bm // 64
    return FwdSm90WsLayout(consumers=consumers, consumer_warps=4 * consumers, panels=hd // cfg.box_cols,
                           smem_q=smem_q, smem_kv=smem_kv, off_q=0, off_k=off_k, off_v=off_v, off_o=off_o,
                           off_bar=off_bar, smem_bytes=off_bar + 8 * cfg.barriers + 1024)


def tma_stats(boxes: int, nbytes: int) -> InstrStats:
    """A TMA role: `boxes` cp.async.bulk.tensor (UTMALDG, one thread each) writing `nbytes` of shared memory;
    no wavefronts or conflicts (the TMA unit writes shared memory, no LSU instruction)."""
    return InstrStats("tma", boxes, 0, 0, nbytes, 0)


def fwd_sm90_ws_addresses(cfg, rows_q: int | None = None, head_dim: int | None = None) -> dict[str, np.ndarray]:
    """Byte addresses (from the 1024-byte-aligned base) of the thread-issued shared instructions of one CTA of
    fwd_sm90_ws_kernel, [consumer warp, i, lane] (-1: lane inactive): the O staging stores of consumer warp
    w (rows 16w + g + 8h, columns dt*8 + 2t of TileQ) and the epilogue's 16-byte reads: consumer wg's thread
    ltid = ctid - 128 wg reads chunks idx = ltid + 128 i < 64 * HEAD_DIM/8 of its rows, row wg*64 + idx /
    (HEAD_DIM/8), column (idx % (HEAD_DIM/8)) * 8 (over 64-byte panels of a wider row, D 96, panel by panel: idx
    / (64 * 4) the panel, then rows, then the 4 chunks of a panel row), for rows < rows_q and columns < head_dim."""
    L = fwd_sm90_ws_layout(cfg)
    hd, bm = cfg.head_dim, cfg.block_m
    rows_q = bm if rows_q is None else rows_q
    head_dim = hd if head_dim is None else head_dim
    rows = (np.arange(L.consumer_warps) * 16).reshape(-1, 1, 1) + 8 * _ax(2, 1, 3)
    out = {"o_store": accumulator_store_addresses(L.off_o, bm, hd, rows, _ax(hd // 8, 2, 3) * 8)}
    chunks_per_row = hd // _config.CHUNK_ELEMS
    iters = -(-64 * chunks_per_row // 128)
    ctid = np.arange(128 * L.consumers).reshape(L.consumer_warps, 1, WARP)
    wg = ctid // 128
    idx = ctid - wg * 128 + np.arange(iters).reshape(1, iters, 1) * 128
    panel_chunks = _config.panel_cols(hd) // _config.CHUNK_ELEMS
    if panel_chunks < 8 and chunks_per_row > panel_chunks:  # 64-byte panels of a wider row (D 96): panel order
        row = wg * 64 + idx % (64 * panel_chunks) // panel_chunks
        col = (idx // (64 * panel_chunks) * panel_chunks + idx % panel_chunks) * _config.CHUNK_ELEMS
    else:
        row, col = wg * 64 + idx // chunks_per_row, (idx % chunks_per_row) * _config.CHUNK_ELEMS
    valid = (idx < 64 * chunks_per_row) & (row < rows_q) & (col < head_dim)
    out["o_read"] = np.where(valid, L.off_o + swizzled_offset(np.minimum(row, bm - 1), col, bm, hd), -1)
    return {role: np.asarray(a, dtype=np.int64) for role, a in out.items()}


def fwd_sm90_ws_tma(cfg) -> dict[str, InstrStats]:
    """TMA loads of one key tile: K_i and V_i, HEAD_DIM / BOX_COLS boxes of BOX_COLS x BLOCK_N each (one swizzle panel
    wide: 64 columns, 32 at head dims 32 and 96), the whole box written."""
    L = fwd_sm90_ws_layout(cfg)
    return {"k_tma": tma_stats(L.panels, L.smem_kv), "v_tma": tma_stats(L.panels, L.smem_kv)}


FWD_SM90_WS_PER_ITERATION_ROLES = ("k_tma", "v_tma", "s_wgmma", "o_wgmma")
FWD_SM90_WS_PER_CTA_ROLES = ("q_tma", "o_store", "o_read")


@lru_cache(maxsize=256)
def fwd_sm90_ws_cta_stats(cfg, rows_q: int | None = None, head_dim: int | None = None) -> tuple[dict, list]:
    """(per-CTA stats, per-key-tile stats) of fwd_sm90_ws_kernel, shaped as fwd_cta_stats (two identical
    per-tile entries: nothing a key tile does depends on its stage's bank alignment); cached."""
    L = fwd_sm90_ws_layout(cfg)
    per_tile = fwd_sm90_ws_tma(cfg) | fwd_sm90_wgmma(cfg)
    addrs = fwd_sm90_ws_addresses(cfg, rows_q, head_dim)
    per_cta = {r: _stats(FWD_SM90_WS_ROLES[r][0], addrs[r]) for r in ("o_store", "o_read")}
    per_cta["q_tma"] = tma_stats(L.panels, L.smem_q)
    return per_cta, [per_tile, per_tile]


def fwd_sm90_ws_kernel_shared(cfg, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int | None = None,
                              causal_skip: bool = True, window=None) -> SharedWalk:
    """Every shared-memory access of fwd_sm90_ws_kernel<cfg> over the grid (ceil(Sq/128), heads, batch), with
    fwd_sm90_kernel's key-tile range (key tiles n_end-1 down to 0; causal tiles past the last row's diagonal
    skipped; a CTA that sees no key writes O = 0, lse = -inf straight to global memory and touches no shared
    memory): per live CTA the Q TMA load (SMEM_Q bytes) and the O staging (st.shared.b32 by the 8 consumer
    warps, ld.shared.v4 of the valid rows and columns), walked with the bank rule; per key tile the K and V
    TMA loads (SMEM_KV bytes each) and the wgmma operand reads. No cp.async and no fence.proxy.async: no
    predicated-off LDS are expected (guard_lds = 0; an assumption the ncu LDS instruction row checks). The
    mbarrier operations (init, arrive.expect_tx, try_wait, arrive) are SYNCS instructions on sm_90, not
    LDS/STS, and are not counted."""
    if not isinstance(cfg, _config.FwdSm90WsConfig):
        raise TypeError(f"cfg must be a cuflash.config.FwdSm90WsConfig, got {type(cfg).__name__}")
    head_dim = _check_head_dim(cfg, head_dim)
    return _q_outer_walk(cfg, FWD_SM90_WS_ROLES, fwd_sm90_ws_cta_stats, FWD_SM90_WS_PER_ITERATION_ROLES,
                         FWD_SM90_WS_PER_CTA_ROLES, batch, heads, seqlen_q, seqlen_k, head_dim, causal_skip, window,
                         [], [])


# ---- fwd_sm90_fp8_kernel (Hopper, e4m3: fwd_sm90_ws_kernel's schedule, V transposed in shared memory) --------

# fwd_sm90_fp8_kernel (cuda/fwd_sm90_fp8.cuh), in program order. One producer thread issues the TMA loads (Q once,
# K_i and V_i per key tile: HEAD_DIM / BOX_BYTES boxes each, whole boxes written); FP8 wgmma takes both operands
# K-major, so producer warps 1-3 transpose every V tile (keys x HEAD_DIM bytes) into V^T (HEAD_DIM x BLOCK_N bytes,
# keys permuted within 16-key groups) with ldmatrix.x4.trans and stmatrix.x4. With Q_IN_REGS each consumer warp loads
# its 16 Q rows once per CTA (ldmatrix.x4 per k32 step) as the A registers of S = Q K^T, whose wgmma then reads only K
# through a descriptor; without it S = Q K^T reads Q and K. O += P V reads V^T (P from registers). Byte tiles are
# 16-bit SmemTiles of half the columns (FwdFp8Traits: TileQ, TileKV, TileVt). O and lse leave from registers: no
# epilogue in shared memory. PINGPONG orders the two consumers' GEMMs (named barriers): no shared-memory byte. The
# consumer warpgroups (64 query rows each) are the config's: two (BLOCK_M 128) or three (192).
FWD_SM90_FP8_ROLES = {
    "q_tma": ("tma", "UTMALDG"),  # Q tile once per CTA
    "k_tma": ("tma", "UTMALDG"),  # K_i, V_i per key tile into stage i % STAGES
    "v_tma": ("tma", "UTMALDG"),
    "v_read": ("ldmatrix.x4", "LDSM"),  # Fp8Transposer: one ldmatrix.x4.trans per unit (16 keys x 32 bytes of V_i)
    "vt_store": ("stmatrix.x4", "STSM"),  # ... and one stmatrix.x4 per unit (32 rows x 16 bytes of V_i^T)
    "q_frag": ("ldmatrix.x4", "LDSM"),  # Q_IN_REGS: per consumer warp and k32 step, its 16 rows x 32 bytes; per CTA
    "s_wgmma": ("wgmma", "HGMMA"),  # S = Q K^T: all of K (K-major), and each consumer's 64 Q rows unless Q_IN_REGS
    "o_wgmma": ("wgmma", "HGMMA"),  # O += P V: all of V^T (K-major); P (e4m3) from registers
}
FWD_SM90_FP8_PER_ITERATION_ROLES = ("k_tma", "v_tma", "v_read", "vt_store", "s_wgmma", "o_wgmma")
FWD_SM90_FP8_PER_CTA_ROLES = ("q_tma", "q_frag")
FP8_TRANSPOSE_THREADS = 96  # FwdFp8Traits::TRANSPOSE_THREADS: producer warps 1-3
FP8_WGMMA_K = 32  # m64nNk32: an e4m3 wgmma reduces over 32 bytes


def fp8_key_of(p):
    """fp8_key_of (cuda/fwd_sm90_fp8.cuh): the key (0..15) of a 16-key group at V^T column p of the group."""
    return np.where((p & 3) < 2, 2 * (p >> 2) + (p & 3), 6 + 2 * (p >> 2) + (p & 3))


def fwd_sm90_fp8_transpose_addresses(cfg) -> dict[str, np.ndarray]:
    """Byte addresses of Fp8Transposer over one key tile, from the V and V^T tile bases (every stage starts on the
    1024-byte swizzle period: the banks of stage 0's), [transposer warp, k, lane] (-1: the warp has left the loop).
    Warp w (0..2) takes units u = w + 3k < UNITS = (BLOCK_N / 16) PAIRS (PAIRS = HEAD_DIM / 32): h = u / PAIRS (the
    16-key group), c0 = 2 (u % PAIRS) (the first of two 16-byte column chunks). Per unit, lane L (i = L % 8, m =
    L / 8) gives the address of row i of matrix m of
      one ldmatrix.x4.trans  TileKV::offset(16 h + L % 16, 8 (c0 + L / 16)): keys 0-7 and 8-15 of chunk c0, then
                             of c0 + 1;
      one stmatrix.x4        TileVt::offset(d, 8 h), d = 16 (c0 + m / 2) + 2 i + ((i >= 4) != (m odd)): the V^T rows
                             of chunk c0 + m / 2, each matrix 4 even and 4 odd rows (bytes 16 h .. 16 h + 15).
    Offsets are those of the 16-bit SmemTiles of half the columns (TileKV = SmemTile<BLOCK_N, HEAD_DIM / 2>, TileVt =
    SmemTile<HEAD_DIM, BLOCK_N / 2>). Instruction k of a warp is its k-th unit: program order. With
    FwdFp8Traits::WIDE_CONSUMERS (head dim 256, 128-key tiles, two consumers) warp w takes the 16-key groups h = w,
    w + 3, ... instead, each group's units in the order c0 = 2 a + 8 panel, panel within a (the chunk pair a of the
    128-byte panel, outer), so its units are 24, 24 and 16."""
    hd, bn = cfg.head_dim, cfg.block_n
    pairs = hd // 32
    units = (bn // 16) * pairs
    warps = FP8_TRANSPOSE_THREADS // WARP
    if cfg.wide_consumers:
        chunks = 8  # 16-byte chunks of a 128-byte panel of V
        order = [[(h, 2 * a + chunks * panel) for h in range(w, bn // 16, warps) for a in range(chunks // 2)
                  for panel in range(2 * pairs // chunks)] for w in range(warps)]
        steps = max(len(o) for o in order)
        live = np.array([[k < len(o) for k in range(steps)] for o in order]).reshape(warps, steps, 1)
        hc = np.array([[o[min(k, len(o) - 1)] for k in range(steps)] for o in order])  # [warp, k, (h, c0)]
        h, c0 = hc[:, :, 0:1], hc[:, :, 1:2]
    else:
        steps = -(-units // warps)
        u = np.arange(warps).reshape(warps, 1, 1) + warps * np.arange(steps).reshape(1, steps, 1)  # [warp, k, 1]
        live = u < units
        u = np.minimum(u, units - 1)
        h, c0 = u // pairs, 2 * (u % pairs)
    lane = np.arange(WARP)
    i, m = lane & 7, lane >> 3
    loads = swizzled_offset(16 * h + (lane & 15), 8 * (c0 + (lane >> 4)), bn, hd // 2)
    d = 16 * (c0 + (m >> 1)) + 2 * i + ((i >= 4) != ((m & 1) == 1)).astype(np.int64)
    stores = swizzled_offset(d, 8 * h, hd, bn // 2)
    return {"v_read": np.where(live, loads, -1).astype(np.int64),
            "vt_store": np.where(live, stores, -1).astype(np.int64)}


def fwd_sm90_fp8_q_addresses(cfg) -> np.ndarray:
    """Byte addresses (from TileQ's base, OFF_Q = 0) of the Q_IN_REGS loads of one CTA, [consumer warp, kk, lane]:
    consumer warp w (0 .. 4 consumers - 1) loads its rows 16 w .. 16 w + 15 for each k32 step kk < HEAD_DIM / 32 with
    one ldmatrix.x4, lane L giving TileQ::offset(16 w + L % 8 + 8 ((L / 8) % 2), 16 kk + 8 (L / 16)) (matrices: rows
    0-7 and 8-15 of the 16-byte chunk 2 kk, then of 2 kk + 1: the e4m3 A fragment of m64nNk32). TileQ =
    SmemTile<BLOCK_M, HEAD_DIM / 2>."""
    hd, bm = cfg.head_dim, cfg.block_m
    w = np.arange(4 * cfg.consumers).reshape(-1, 1, 1)
    kk = np.arange(hd // FP8_WGMMA_K).reshape(1, -1, 1)
    lane = np.arange(WARP)
    return np.asarray(swizzled_offset(16 * w + (lane & 7) + 8 * ((lane >> 3) & 1), 16 * kk + 8 * (lane >> 4), bm,
                                      hd // 2), dtype=np.int64)


def fwd_sm90_fp8_wgmma(cfg) -> dict[str, InstrStats]:
    """wgmma operand reads of one key tile, every consumer: S = Q K^T is HEAD_DIM/32 wgmma per consumer, each reading
    BLOCK_N x 32 bytes of K and, unless Q_IN_REGS (A from registers), 64 x 32 of its Q rows; O += P V is BLOCK_N/32
    wgmma reading HEAD_DIM x 32 of V^T."""
    hd, bn, wg = cfg.head_dim, cfg.block_n, cfg.consumers
    q_rows = 0 if cfg.q_in_regs else 64
    return {"s_wgmma": wgmma_stats(wg * hd // FP8_WGMMA_K, wg * (q_rows + bn) * hd),
            "o_wgmma": wgmma_stats(wg * bn // FP8_WGMMA_K, wg * hd * bn)}


@lru_cache(maxsize=64)
def fwd_sm90_fp8_cta_stats(cfg, rows_q: int | None = None, head_dim: int | None = None) -> tuple[dict, list]:
    """(per-CTA stats, per-key-tile stats) of fwd_sm90_fp8_kernel, shaped as fwd_cta_stats (two identical per-tile
    entries: every stage starts on the 1024-byte swizzle period, so each has the same banks); cached. Nothing
    depends on the CTA's valid rows: TMA writes whole boxes, the Q_IN_REGS loads read all BLOCK_M rows, and no thread
    touches an O row in shared memory. Without Q_IN_REGS q_frag is empty."""
    panels, tile = cfg.head_dim // cfg.box_bytes, cfg.block_n * cfg.head_dim
    addrs = fwd_sm90_fp8_transpose_addresses(cfg)
    per_tile = {"k_tma": tma_stats(panels, tile), "v_tma": tma_stats(panels, tile),
                "v_read": _stats("ldmatrix.x4", addrs["v_read"]), "vt_store": _stats("stmatrix.x4", addrs["vt_store"])}
    per_tile |= fwd_sm90_fp8_wgmma(cfg)
    q_frag = _stats("ldmatrix.x4", fwd_sm90_fp8_q_addresses(cfg)) if cfg.q_in_regs else InstrStats("ldmatrix.x4")
    return {"q_tma": tma_stats(panels, cfg.block_m * cfg.head_dim), "q_frag": q_frag}, [per_tile, per_tile]


def fwd_sm90_fp8_kernel_shared(cfg, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                               head_dim: int | None = None, causal_skip: bool = True, window=None) -> SharedWalk:
    """Every shared-memory access of fwd_sm90_fp8_kernel<cfg> over the grid (ceil(Sq/BLOCK_M), heads, batch), with
    fwd_sm90_ws_kernel's key-tile range (key tiles n_end-1 down to n_begin, causal and window skipping; a CTA that
    sees no key writes O = 0, lse = -inf straight to global memory and touches no shared memory): per live CTA the Q
    TMA load and, with Q_IN_REGS, the consumers' ldmatrix.x4 of Q (walked with the bank rule); per key tile the K and
    V TMA loads, the V transpose (ldmatrix.x4.trans and stmatrix.x4, walked with the bank rule) and the wgmma operand
    reads. Each transposer warp issues one fence.proxy.async per key tile (FENCE_GUARD_LDS guard LDS each, the
    pattern of the other wgmma kernels' fences, not yet checked on this kernel's SASS). The descale factors are read
    from global memory into registers, and the mbarrier operations are SYNCS and the pingpong named barriers BAR
    instructions: none is counted."""
    if not isinstance(cfg, _config.FwdSm90Fp8Config):
        raise TypeError(f"cfg must be a cuflash.config.FwdSm90Fp8Config, got {type(cfg).__name__}")
    head_dim = _check_head_dim(cfg, head_dim)
    walk = _q_outer_walk(cfg, FWD_SM90_FP8_ROLES, fwd_sm90_fp8_cta_stats, FWD_SM90_FP8_PER_ITERATION_ROLES,
                         FWD_SM90_FP8_PER_CTA_ROLES, batch, heads, seqlen_q, seqlen_k, head_dim, causal_skip, window,
                         [], [])
    tiles = walk.roles["k_tma"].instructions // (cfg.head_dim // cfg.box_bytes)
    walk.guard_lds = tiles * (FP8_TRANSPOSE_THREADS // WARP) * FENCE_GUARD_LDS
    return walk


# ---- bwd_dq_kernel (deterministic dQ) ------------------------------------------------------------

def dq_addresses(cfg, stage: int, rows_q: int | None = None, head_dim: int | None = None) -> dict[str, np.ndarray]:
    """Byte addresses of every shared instruction one CTA of bwd_dq_kernel issues, per role (as
    fwd_addresses): shared memory holds Q, dO, then 2 stages of K, then 2 stages of V."""
    hd, bm, bn, nw = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.num_warps
    m_tiles = bm // (_config.MMA_M * nw)
    q_bytes, kv_bytes = bm * hd * _config.ELEM_BYTES, bn * hd * _config.ELEM_BYTES
    do_base = q_bytes
    k_base = 2 * q_bytes + stage * kv_bytes
    v_base = 2 * q_bytes + 2 * kv_bytes + stage * kv_bytes
    out = {
        "q_load": copy_addresses(cfg.threads, bm, hd, 0),
        "do_load": copy_addresses(cfg.threads, bm, hd, do_base),
        "k_load": copy_addresses(cfg.threads, bn, hd, k_base),
        "v_load": copy_addresses(cfg.threads, bn, hd, v_base),
        "dq_read": copy_addresses(cfg.threads, bm, hd, 0, rows_q, head_dim),
    }
    w_row0 = _warp_rows0(cfg).reshape(-1, 1, 1)
    # S = Q K^T and dP = dO V^T: for kk: for mt: A(Q), A(dO); for np: B(K), B(V)
    a_rows, a_cols = w_row0 + _ax(m_tiles, 2, 3) * 16, _ax(hd // 16, 1, 3) * 16
    out["q_frag"] = frag_addresses("a", 0, bm, hd, a_rows, a_cols)
    out["do_frag"] = frag_addresses("a", do_base, bm, hd, a_rows, a_cols)
    b_rows, b_cols = _ax(bn // 16, 1, 2) * 16, _ax(hd // 16, 0, 2) * 16
    out["k_frag"] = _per_warp(frag_addresses("b_nk", k_base, bn, hd, b_rows, b_cols), nw)
    out["v_frag"] = _per_warp(frag_addresses("b_nk", v_base, bn, hd, b_rows, b_cols), nw)
    # dQ += dS K: for kk over keys: for dp: B(K .trans, kk*16, dp*16)
    out["k_frag_t"] = _per_warp(frag_addresses("b_kn_trans", k_base, bn, hd, _ax(bn // 16, 0, 2) * 16,
                                               _ax(hd // 16, 1, 2) * 16), nw)
    w_row0 = _warp_rows0(cfg).reshape(-1, 1, 1, 1)
    out["dq_store"] = accumulator_store_addresses(0, bm, hd, w_row0 + _ax(m_tiles, 1, 4) * 16 + 8 * _ax(2, 2, 4),
                                                  _ax(hd // 8, 3, 4) * 8)
    return {role: np.asarray(a, dtype=np.int64) for role, a in out.items()}


DQ_PER_ITERATION_ROLES = ("k_load", "v_load", "q_frag", "do_frag", "k_frag", "v_frag", "k_frag_t")
DQ_PER_CTA_ROLES = ("q_load", "do_load", "dq_store", "dq_read")


@lru_cache(maxsize=256)
def dq_cta_stats(cfg, rows_q: int | None = None, head_dim: int | None = None) -> tuple[dict, list]:
    q, kv = (cfg.block_m, cfg.head_dim), (cfg.block_n, cfg.head_dim)
    src = _tile_sources(cfg.threads, {"q_load": q, "do_load": q, "k_load": kv, "v_load": kv})
    per_iter = []
    for stage in range(2):
        addrs = dq_addresses(cfg, stage)
        per_iter.append({r: _stats(DQ_ROLES[r][0], addrs[r], src.get(r)) for r in DQ_PER_ITERATION_ROLES})
    addrs = dq_addresses(cfg, 0, rows_q, head_dim)
    per_cta = {r: _stats(DQ_ROLES[r][0], addrs[r], src.get(r)) for r in DQ_PER_CTA_ROLES}
    return per_cta, per_iter


def dq_kernel_shared(cfg, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int | None = None,
                     causal_skip: bool = True, window=None) -> SharedWalk:
    """Every shared-memory instruction of bwd_dq_kernel<cfg> (deterministic dQ) over its grid: like
    fwd_kernel, a CTA that sees no key zero-fills dQ in global memory and issues nothing shared."""
    if not isinstance(cfg, _config.DqConfig):
        raise TypeError(f"cfg must be a cuflash.config.DqConfig, got {type(cfg).__name__}")
    head_dim = _check_head_dim(cfg, head_dim)
    q, kv = (cfg.block_m, cfg.head_dim), (cfg.block_n, cfg.head_dim)
    return _q_outer_walk(cfg, DQ_ROLES, dq_cta_stats, DQ_PER_ITERATION_ROLES, DQ_PER_CTA_ROLES, batch, heads,
                         seqlen_q, seqlen_k, head_dim, causal_skip, window, [q, q, kv, kv], [kv, kv])


# ---- bwd_kernel (K/V-outer) ----------------------------------------------------------------------

@dataclass(frozen=True)
class BwdLayout:
    """The constants of BwdTraits (cuda/traits.cuh) for one BwdConfig: warp roles and shared-memory
    offsets (K, V, then 2 stages of (Q, dO), dS^T, then 2 stages of (lse_log2, delta))."""

    key_warps: int  # one m16 key tile per group of D_SPLIT warps
    dkv_cols: int  # dK/dV columns per warp
    dq_warps_m: int  # dQ_i = dS K_j: a DQ_WARPS_M x DQ_WARPS_D warp grid over [BLOCK_M, HEAD_DIM]
    dq_warps_d: int
    dq_m_tiles: int
    dq_d_tiles: int
    smem_q: int
    smem_kv: int
    smem_ds: int
    rowvec: int  # BLOCK_M fp32 values
    off_k: int
    off_v: int
    off_q: int  # + stage * 2 * smem_q
    off_do: int  # + stage * 2 * smem_q
    off_ds: int
    off_lse: int  # + stage * 2 * rowvec
    off_delta: int  # + stage * 2 * rowvec
    smem_bytes: int


def bwd_layout(cfg) -> BwdLayout:
    hd, bm, bn, nw = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.num_warps
    dq_warps_m = min(nw, bm // 16)
    smem_q, smem_kv, smem_ds = (r * c * _config.ELEM_BYTES for r, c in ((bm, hd), (bn, hd), (bn, bm)))
    off_ds = 2 * smem_kv + 4 * smem_q
    off_lse = off_ds + smem_ds
    return BwdLayout(
        key_warps=nw // cfg.d_split, dkv_cols=hd // cfg.d_split, dq_warps_m=dq_warps_m,
        dq_warps_d=nw // dq_warps_m, dq_m_tiles=bm // 16 // dq_warps_m, dq_d_tiles=hd // 8 // (nw // dq_warps_m),
        smem_q=smem_q, smem_kv=smem_kv, smem_ds=smem_ds, rowvec=bm * 4, off_k=0, off_v=smem_kv,
        off_q=2 * smem_kv, off_do=2 * smem_kv + smem_q, off_ds=off_ds, off_lse=off_lse, off_delta=off_lse + bm * 4,
        smem_bytes=off_lse + 4 * bm * 4)


def bwd_addresses(cfg, stage: int, keys: int | None = None, head_dim: int | None = None) -> dict[str, np.ndarray]:
    """Byte addresses of every shared instruction one CTA of bwd_kernel issues, per role (BWD_ROLES).

    Per-visit roles (query-block loads and bwd_query_block) are for one query block on stage `stage`;
    the per-CTA roles (K/V loads, dK/dV staging and stores) once, the stores for `keys` valid keys and
    columns < head_dim. Warp w owns keys (w / D_SPLIT) * 16 .. +15 and dK/dV columns
    (w % D_SPLIT) * DKV_COLS ..; for dQ it is (w / DQ_WARPS_D, w % DQ_WARPS_D) of a grid over
    [BLOCK_M, HEAD_DIM]. In the deterministic kernel the dS^T and dQ roles are absent."""
    L = bwd_layout(cfg)
    hd, bm, bn, nw, ds = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.d_split
    q_base = L.off_q + stage * 2 * L.smem_q
    do_base = L.off_do + stage * 2 * L.smem_q
    lse_base = L.off_lse + stage * 2 * L.rowvec
    delta_base = L.off_delta + stage * 2 * L.rowvec
    out = {
        "k_load": copy_addresses(cfg.threads, bn, hd, L.off_k),
        "v_load": copy_addresses(cfg.threads, bn, hd, L.off_v),
        "q_load": copy_addresses(cfg.threads, bm, hd, q_base),
        "do_load": copy_addresses(cfg.threads, bm, hd, do_base),
        "dk_read": copy_addresses(cfg.threads, bn, hd, L.off_k, keys, head_dim),
        "dv_read": copy_addresses(cfg.threads, bn, hd, L.off_v, keys, head_dim),
    }
    # lse_log2 and delta: threads tid < 2 * BLOCK_M/4 copy one 16-byte chunk each; delta follows lse
    chunks = bm // 4
    tid = np.arange(cfg.threads).reshape(nw, WARP)
    out["vec_load"] = np.where(tid < 2 * chunks, lse_base + tid * 16, -1)
    w = np.arange(nw)
    key_row0 = (w // ds) * 16
    d_col0 = (w % ds) * L.dkv_cols
    kr = key_row0.reshape(-1, 1)
    # S^T = K Q^T: for kk (head dim): A(K, key_row0, kk*16); for qp: B(Q, qp*16, kk*16)
    out["k_frag_a"] = frag_addresses("a", L.off_k, bn, hd, kr, np.arange(hd // 16).reshape(1, -1) * 16)
    out["v_frag_a"] = frag_addresses("a", L.off_v, bn, hd, kr, np.arange(hd // 16).reshape(1, -1) * 16)
    qb_rows, qb_cols = _ax(bm // 16, 1, 2) * 16, _ax(hd // 16, 0, 2) * 16
    out["q_frag_b"] = _per_warp(frag_addresses("b_nk", q_base, bm, hd, qb_rows, qb_cols), nw)
    out["do_frag_b"] = _per_warp(frag_addresses("b_nk", do_base, bm, hd, qb_rows, qb_cols), nw)
    # P^T and dS^T: float2 of lse_log2 / delta at query qt*8 + 2t, per n8 query tile qt
    t = _L & 3
    qt = np.arange(bm // 8).reshape(-1, 1)
    out["lse_load"] = _per_warp(lse_base + (qt * 8 + 2 * t) * 4, nw)
    out["delta_load"] = _per_warp(delta_base + (qt * 8 + 2 * t) * 4, nw)
    # dV += P^T dO and dK += dS^T Q: for kk (queries): for dp: B(dO/Q .trans, kk*16, d_col0 + dp*16)
    dc = d_col0.reshape(-1, 1, 1) + _ax(L.dkv_cols // 16, 2, 3) * 16
    out["do_frag_t"] = frag_addresses("b_kn_trans", do_base, bm, hd, _ax(bm // 16, 1, 3) * 16, dc)
    out["q_frag_t"] = frag_addresses("b_kn_trans", q_base, bm, hd, _ax(bm // 16, 1, 3) * 16, dc)
    if not cfg.deterministic:
        # dS^T -> TileDS [BLOCK_N keys, BLOCK_M queries] by warps with w % D_SPLIT == 0: for qt: h = 0, 1
        writer = (w % ds == 0).reshape(-1, 1, 1, 1)
        st = accumulator_store_addresses(L.off_ds, bn, bm, key_row0.reshape(-1, 1, 1) + 8 * _ax(2, 2, 3),
                                         _ax(bm // 8, 1, 3) * 8)
        out["ds_store"] = np.where(writer, st, -1)
        # dQ += dS K: for kk (keys): for mt: A(dS^T .trans, kk*16, m-tile*16); for dp: B(K .trans, kk*16, d)
        warp_m, warp_d = w // L.dq_warps_d, w % L.dq_warps_d
        m_cols = (warp_m * L.dq_m_tiles).reshape(-1, 1, 1) + _ax(L.dq_m_tiles, 2, 3)
        out["ds_frag_t"] = frag_addresses("a_trans", L.off_ds, bn, bm, _ax(bn // 16, 1, 3) * 16, m_cols * 16)
        d_cols = (warp_d * L.dq_d_tiles).reshape(-1, 1, 1) + 2 * _ax(L.dq_d_tiles // 2, 2, 3)
        out["k_frag_t"] = frag_addresses("b_kn_trans", L.off_k, bn, hd, _ax(bn // 16, 1, 3) * 16, d_cols * 8)
    # epilogue: for h, dt: (key_row0 + g + 8h, d_col0 + dt*8 + 2t) into the K tile (dK) and V tile (dV)
    rows = key_row0.reshape(-1, 1, 1) + 8 * _ax(2, 1, 3)
    cols = d_col0.reshape(-1, 1, 1) + _ax(L.dkv_cols // 8, 2, 3) * 8
    out["dk_store"] = accumulator_store_addresses(L.off_k, bn, hd, rows, cols)
    out["dv_store"] = accumulator_store_addresses(L.off_v, bn, hd, rows, cols)
    return {role: np.asarray(a, dtype=np.int64) for role, a in out.items()}


BWD_PER_CTA_ROLES = ("k_load", "v_load", "dk_store", "dv_store", "dk_read", "dv_read")
BWD_PER_VISIT_ROLES = tuple(r for r in BWD_ROLES if r not in BWD_PER_CTA_ROLES)


@lru_cache(maxsize=256)
def bwd_cta_stats(cfg, keys: int | None = None, head_dim: int | None = None) -> tuple[dict, list]:
    """(per-CTA stats, per-visit stats per stage) of bwd_kernel; cached, do not modify."""
    q, kv = (cfg.block_m, cfg.head_dim), (cfg.block_n, cfg.head_dim)
    src = _tile_sources(cfg.threads, {"q_load": q, "do_load": q, "k_load": kv, "v_load": kv})
    # lse_log2 then delta: BLOCK_M / 4 contiguous 16-byte chunks each, in two arrays
    chunks, tid = cfg.block_m // 4, np.arange(cfg.threads).reshape(cfg.num_warps, WARP)
    src["vec_load"] = np.where(tid < chunks, tid * 16, GLOBAL_ROW_PITCH + (tid - chunks) * 16)
    per_visit = []
    for stage in range(2):
        addrs = bwd_addresses(cfg, stage)
        per_visit.append({r: _stats(BWD_ROLES[r][0], addrs[r], src.get(r)) for r in BWD_PER_VISIT_ROLES
                          if r in addrs})
    addrs = bwd_addresses(cfg, 0, keys, head_dim)
    per_cta = {r: _stats(BWD_ROLES[r][0], addrs[r], src.get(r)) for r in BWD_PER_CTA_ROLES}
    return per_cta, per_visit


def bwd_kernel_shared(cfg, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int | None = None,
                      causal_skip: bool = True, window=None) -> SharedWalk:
    """Every shared-memory instruction of bwd_kernel<cfg> over the grid (ceil(Sk/BLOCK_N), heads, batch)
    (bwd_sm90_kernel_shared for a BwdSm90Config).

    A CTA that no query sees (m_begin >= m_end) zero-fills dK, dV in global memory and issues nothing
    shared; otherwise K and V copies, one visit per query block (visit k on stage k % 2: the Q, dO,
    lse_log2, delta copies and bwd_query_block), then the dK/dV staging and stores of its valid keys."""
    if isinstance(cfg, _config.BwdSm90WsConfig):
        return bwd_sm90_ws_kernel_shared(cfg, batch, heads, seqlen_q, seqlen_k, head_dim, causal_skip, window)
    if isinstance(cfg, _config.BwdSm90Config):
        return bwd_sm90_kernel_shared(cfg, batch, heads, seqlen_q, seqlen_k, head_dim, causal_skip, window)
    if not isinstance(cfg, _config.BwdConfig):
        raise TypeError(f"cfg must be a cuflash.config.BwdConfig or BwdSm90Config, got {type(cfg).__name__}")
    head_dim = _check_head_dim(cfg, head_dim)
    return _kv_outer_walk(cfg, BWD_ROLES, bwd_cta_stats, BWD_PER_CTA_ROLES, batch, heads, seqlen_q, seqlen_k,
                          head_dim, causal_skip, window)


def _kv_outer_walk(cfg, role_table, cta_stats, per_cta_roles, batch, heads, seqlen_q, seqlen_k, head_dim,
                   causal_skip, window, fences_per_visit: int = 0, thread_copies: bool = True) -> SharedWalk:
    """Shared driver of the K/V-outer kernels (bwd_kernel, bwd_sm90_kernel): per live CTA the per-CTA roles
    of its valid keys (cta_stats(cfg, keys, d)), per visit the per-visit roles of stage visit % 2. Guard
    LDS: prologue K, V, Q, dO (+ the lse/delta copy, `if (tid < 2 * BLOCK_M / 4)`: its own block, run by
    the warps holding such threads); every visit but the last prefetches the next Q, dO, lse, delta; each
    visit issues fences_per_visit fence.proxy.async (FENCE_GUARD_LDS each)."""
    m_begin, m_end = bwd_query_blocks(cfg, seqlen_q, seqlen_k, causal_skip, window)
    visits = np.maximum(m_end - m_begin, 0)
    keys = block_sizes(seqlen_k, cfg.block_n)
    walk = SharedWalk(cfg, {r: InstrStats(role_table[r][0]) for r in role_table}, role_table)
    per_visit = None
    for k in np.unique(keys[visits > 0]):
        live = (keys == k) & (visits > 0)
        per_cta, per_visit = cta_stats(cfg, int(k), head_dim)
        for r in per_cta_roles:
            walk.roles[r].add(per_cta[r], int(live.sum()) * batch * heads)
    if per_visit is not None:
        for s in range(2):
            n = int(((visits - s + 1) // 2).sum()) * batch * heads  # visit % 2 == s
            for r, st in per_visit[s].items():
                walk.roles[r].add(st, n)
    if not thread_copies:  # TMA loads: no cp.async blocks, and ptxas puts no guard LDS before these fences
        return walk
    pc = getattr(cfg, "panel_cols", None)  # BwdSm90Config: 64-byte panels at HEAD_DIM 64
    q, kv = (cfg.block_m, cfg.head_dim, pc), (cfg.block_n, cfg.head_dim, pc)
    warps = cfg.threads // WARP
    vec = ("guarded", np.arange(warps) * WARP < 2 * (cfg.block_m // 4))
    live = visits > 0
    # prologue: K, V, then the first query block's Q, dO after its head's address arithmetic (GQA / varlen,
    # QueryBlock::first in bwd.cuh), which ptxas puts in a block of its own (nvcc 13.0 SASS; with NVRTC 13.5
    # the break can fall a few copies earlier, inside V: the same number of blocks per warp)
    walk.guard_lds = (int(live.sum()) * int(guard_lds_per_warp(cfg.threads, [kv, kv, BLOCK_BREAK, q, q, vec]).sum())
                      + int((visits[live] - 1).sum()) * int(guard_lds_per_warp(cfg.threads, [q, q, vec]).sum())
                      + int(visits.sum()) * fences_per_visit * FENCE_GUARD_LDS * warps
                      ) * batch * heads
    return walk


# ---- bwd_sm90_kernel (Hopper, wgmma) -----------------------------------------------------------------

@dataclass(frozen=True)
class BwdSm90Layout:
    """The constants of BwdSm90Traits (cuda/traits.cuh) for one BwdSm90Config: offsets from the 1024-byte
    aligned base (K, V, 2 stages of (Q, dO), dS^T, 2 stages of (lse_log2, delta)), as bwd_kernel's."""

    warpgroups: int  # 64 keys each
    dq_cols: int  # dQ columns per warpgroup
    panel_cols: int  # panel width of the K, V, Q, dO tiles (dS^T keeps the default)
    smem_q: int
    smem_kv: int
    smem_ds: int
    rowvec: int
    off_k: int
    off_v: int
    off_q: int  # + stage * 2 * smem_q
    off_do: int
    off_ds: int
    off_lse: int  # + stage * 2 * rowvec
    off_delta: int
    smem_bytes: int  # dynamic shared memory requested (+ 1024 for rounding the base up)


def as_sync(cfg):
    """bwd_sm90_kernel's config with the tiles of `cfg` (a BwdSm90WsConfig: the synchronous kernel with the same
    tiles, whose layout, addresses and wgmma reads the ws walk builds on), any other config itself."""
    return cfg.sync_equivalent() if isinstance(cfg, _config.BwdSm90WsConfig) else cfg


def bwd_sm90_layout(cfg) -> BwdSm90Layout:
    """BwdSm90Traits' constants of a BwdSm90Config or BwdSm90WsConfig (whose 128-query steps split dQ by rows:
    every warpgroup takes all HEAD_DIM columns of its 64 rows)."""
    hd, bm, bn = cfg.head_dim, cfg.block_m, cfg.block_n
    smem_q, smem_kv, smem_ds = (r * c * _config.ELEM_BYTES for r, c in ((bm, hd), (bn, hd), (bn, bm)))
    off_ds = 2 * smem_kv + 4 * smem_q
    off_lse = off_ds + smem_ds
    wg = bn // 64
    return BwdSm90Layout(
        warpgroups=wg, dq_cols=cfg.dq_cols, panel_cols=cfg.panel_cols, smem_q=smem_q, smem_kv=smem_kv,
        smem_ds=smem_ds, rowvec=bm * 4, off_k=0, off_v=smem_kv, off_q=2 * smem_kv, off_do=2 * smem_kv + smem_q,
        off_ds=off_ds, off_lse=off_lse, off_delta=off_lse + bm * 4, smem_bytes=off_lse + 4 * bm * 4 + 1024)


def bwd_sm90_addresses(cfg, stage: int, keys: int | None = None, head_dim: int | None = None) -> dict[str, np.ndarray]:
    """Byte addresses of every thread-issued shared instruction of one CTA of bwd_sm90_kernel, per role
    (BWD_SM90_ROLES less the wgmma roles, see bwd_sm90_wgmma). Warp w owns keys 16w .. 16w + 15
    (key_row0 = warpgroup * 64 + (w % 4) * 16) and all HEAD_DIM columns of dK, dV. Copies and stores of
    the K, V, Q, dO tiles use the tiles' panel width (BwdSm90Config.panel_cols); dS^T is
    SmemTile<BLOCK_N, BLOCK_M> with the default width."""
    cfg = as_sync(cfg)
    L = bwd_sm90_layout(cfg)
    hd, bm, bn, nw, pc = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.num_warps, L.panel_cols
    q_base = L.off_q + stage * 2 * L.smem_q
    do_base = L.off_do + stage * 2 * L.smem_q
    lse_base = L.off_lse + stage * 2 * L.rowvec
    delta_base = L.off_delta + stage * 2 * L.rowvec
    out = {
        "k_load": copy_addresses(cfg.threads, bn, hd, L.off_k, panel_cols=pc),
        "v_load": copy_addresses(cfg.threads, bn, hd, L.off_v, panel_cols=pc),
        "q_load": copy_addresses(cfg.threads, bm, hd, q_base, panel_cols=pc),
        "do_load": copy_addresses(cfg.threads, bm, hd, do_base, panel_cols=pc),
        "dk_read": copy_addresses(cfg.threads, bn, hd, L.off_k, keys, head_dim, panel_cols=pc),
        "dv_read": copy_addresses(cfg.threads, bn, hd, L.off_v, keys, head_dim, panel_cols=pc),
    }
    # lse_log2 and delta (bwd_load_query_block): threads tid < 2 * BLOCK_M/4 copy one 16-byte chunk each
    tid = np.arange(cfg.threads).reshape(nw, WARP)
    out["vec_load"] = np.where(tid < 2 * (bm // 4), lse_base + tid * 16, -1)
    # P^T and dS^T: float2 of lse_log2 / delta at query qt*8 + 2t, per n8 query tile qt
    qt = np.arange(bm // 8).reshape(-1, 1)
    out["lse_load"] = _per_warp(lse_base + (qt * 8 + 2 * (_L & 3)) * 4, nw)
    out["delta_load"] = _per_warp(delta_base + (qt * 8 + 2 * (_L & 3)) * 4, nw)
    key_row0 = (np.arange(nw) * 16).reshape(-1, 1, 1, 1)  # = warpgroup * 64 + (w % 4) * 16
    if not cfg.deterministic:
        # dS^T: for kk, r: (key_row0 + g + (r & 1) * 8, kk*16 + (r >> 1) * 8 + 2t)
        r = _ax(4, 2, 4)
        out["ds_store"] = accumulator_store_addresses(L.off_ds, bn, bm, key_row0 + (r & 1) * 8,
                                                      _ax(bm // 16, 1, 4) * 16 + (r >> 1) * 8)
    # epilogue: for h, dt: (key_row0 + g + 8h, dt*8 + 2t) into the K tile (dK) and V tile (dV)
    rows, cols = key_row0[..., 0] + 8 * _ax(2, 1, 3), _ax(hd // 8, 2, 3) * 8
    out["dk_store"] = accumulator_store_addresses(L.off_k, bn, hd, rows, cols, pc)
    out["dv_store"] = accumulator_store_addresses(L.off_v, bn, hd, rows, cols, pc)
    return {role: np.asarray(a, dtype=np.int64) for role, a in out.items()}


def bwd_sm90_wgmma(cfg) -> dict[str, InstrStats]:
    """wgmma operand reads of one query block, all warpgroups (each: 64 keys). S^T = K Q^T and dP^T = V dO^T
    (HEAD_DIM/16 wgmma each): the warpgroup's 64 rows of K (V) and all BLOCK_M rows of Q (dO); dV += P^T dO
    and dK += dS^T Q (BLOCK_M/16 each): all of dO (Q), read N-major; where the kernel adds dQ (schedules.main_adds_dq:
    unless deterministic, or on bwd_sm90_ws_kernel's ordered path) dQ = dS K (BLOCK_N/16): the warpgroup's DQ_COLS
    columns of K and its rows of dS (all BLOCK_M of a 64-query step, 64 of a 128-query one)."""
    L = bwd_sm90_layout(cfg)
    wg, hd, bm, bn, e = L.warpgroups, cfg.head_dim, cfg.block_m, cfg.block_n, _config.ELEM_BYTES
    out = {"st_wgmma": wgmma_stats(wg * hd // 16, wg * (64 + bm) * hd * e),
           "dpt_wgmma": wgmma_stats(wg * hd // 16, wg * (64 + bm) * hd * e),
           "dv_wgmma": wgmma_stats(wg * bm // 16, wg * bm * hd * e),
           "dk_wgmma": wgmma_stats(wg * bm // 16, wg * bm * hd * e)}
    if main_adds_dq(cfg) and _config.bwd_ws_dq_one_wg(cfg):  # one warpgroup: all 64 rows x HEAD_DIM columns
        out["dq_wgmma"] = wgmma_stats(bn // 16, bn * (bm + hd) * e)
    elif main_adds_dq(cfg):
        out["dq_wgmma"] = wgmma_stats(wg * bn // 16, wg * bn * (min(bm, 64) + L.dq_cols) * e)
    return out


BWD_SM90_PER_CTA_ROLES = ("k_load", "v_load", "dk_store", "dv_store", "dk_read", "dv_read")


@lru_cache(maxsize=256)
def bwd_sm90_cta_stats(cfg, keys: int | None = None, head_dim: int | None = None) -> tuple[dict, list]:
    """(per-CTA stats, per-visit stats per stage) of bwd_sm90_kernel; cached, do not modify."""
    cfg = as_sync(cfg)
    pc = cfg.panel_cols
    q, kv = (cfg.block_m, cfg.head_dim, pc), (cfg.block_n, cfg.head_dim, pc)
    src = _tile_sources(cfg.threads, {"q_load": q, "do_load": q, "k_load": kv, "v_load": kv})
    chunks, tid = cfg.block_m // 4, np.arange(cfg.threads).reshape(cfg.num_warps, WARP)
    src["vec_load"] = np.where(tid < chunks, tid * 16, GLOBAL_ROW_PITCH + (tid - chunks) * 16)
    per_visit = []
    for stage in range(2):
        addrs = bwd_sm90_addresses(cfg, stage)
        stats = {r: _stats(BWD_SM90_ROLES[r][0], a, src.get(r)) for r, a in addrs.items()
                 if r not in BWD_SM90_PER_CTA_ROLES}
        per_visit.append(stats | bwd_sm90_wgmma(cfg))
    addrs = bwd_sm90_addresses(cfg, 0, keys, head_dim)
    per_cta = {r: _stats(BWD_SM90_ROLES[r][0], addrs[r], src.get(r)) for r in BWD_SM90_PER_CTA_ROLES}
    return per_cta, per_visit


def bwd_sm90_kernel_shared(cfg, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int | None = None,
                           causal_skip: bool = True, window=None) -> SharedWalk:
    """Every shared-memory access of bwd_sm90_kernel<cfg> over the grid (ceil(Sk/BLOCK_N), heads, batch),
    with bwd_kernel's grid, query-block loop and causal skipping: the thread-issued instructions (cp.async
    of K, V once and Q, dO, lse_log2, delta per visit; the float2 lse_log2 / delta loads; unless
    deterministic the dS^T stores; the dK/dV staging stores and store_tile's 16-byte loads), walked with
    the bank rule, and the wgmma operand reads (bwd_sm90_wgmma: bytes only). Each visit issues one
    fence.proxy.async after the cp.async wait and, unless deterministic, one after the dS^T stores."""
    if not isinstance(cfg, _config.BwdSm90Config):
        raise TypeError(f"cfg must be a cuflash.config.BwdSm90Config, got {type(cfg).__name__}")
    cfg = as_sync(cfg)
    head_dim = _check_head_dim(cfg, head_dim)
    return _kv_outer_walk(cfg, BWD_SM90_ROLES, bwd_sm90_cta_stats, BWD_SM90_PER_CTA_ROLES, batch, heads, seqlen_q,
                          seqlen_k, head_dim, causal_skip, window, fences_per_visit=1 if cfg.deterministic else 2)


# ---- bwd_sm90_ws_kernel (Hopper: TMA producer, two consumer warpgroups, dQ by bulk reductions) -------------

@dataclass(frozen=True)
class BwdSm90WsLayout:
    """The constants of BwdSm90WsTraits (cuda/bwd_sm90_ws.cuh) for one BwdSm90WsConfig: bwd_sm90_kernel's K, V,
    2 stages of (Q, dO) and dS^T (`base`), then a second dS^T buffer, the fp32 dQ buffer, 2 stages of (lse_log2,
    delta), 7 mbarriers (BARRIERS = 3 + 2 * STAGES: kv_full, q_full[2], q_empty[2], dq_full, dq_empty; the last two
    are used by the ordered deterministic dQ writer only), the writer's 32-byte setup (OFF_WRITER; DqWriterSetup)
    and, when the config stages a bias
    (config.bwd_stages_bias), two buffers of 8 warps x BLOCK_M rows x BIAS_PITCH bytes of it from the next 128-byte
    boundary (visit k's in buffer k % 2: its copies are issued during visit k - 1)."""

    base: BwdSm90Layout
    panels: int  # TMA boxes per 16-bit tile: HEAD_DIM / PANEL_COLS
    dq_tiles: int  # n8 tiles of dQ per consumer (DQ_COLS / 8)
    smem_dq: int
    off_dq: int
    off_lse: int  # + stage * 2 * rowvec
    off_delta: int
    off_bar: int  # mbarrier b at off_bar + 8 b
    barriers: int
    off_writer: int  # the deterministic dQ writer's setup (32 bytes), after the mbarriers
    smem_bytes: int  # dynamic shared memory requested (+ 1024 for rounding the base up)
    off_bias: int = -1  # staged bias (-1: none); warp w's rows of buffer b at off_bias + (8 b + w) * BLOCK_M * BIAS_PITCH


BIAS_PITCH = 32  # BwdSm90WsTraits::BIAS_PITCH: 16 keys of 2 bytes per staged row
WRITER_SETUP_BYTES = 32  # sizeof(DqWriterSetup) at BwdSm90WsTraits::OFF_WRITER


def bias_offset(row, half):
    """BwdSm90WsTraits::bias_offset: chunk `half` of staged row `row`, the halves swapped in rows 4-7 of every 8."""
    return row * BIAS_PITCH + 16 * (half ^ ((row >> 2) & 1))


def bwd_sm90_ws_layout(cfg) -> BwdSm90WsLayout:
    B = bwd_sm90_layout(cfg)
    smem_dq = cfg.block_m * cfg.head_dim * 4
    off_dq = B.off_ds + 2 * B.smem_ds
    off_lse = off_dq + smem_dq
    off_bar = off_lse + 4 * B.rowvec
    barriers = 3 + 2 * cfg.stages
    off_writer = off_bar + 8 * barriers
    end, off_bias = off_writer + WRITER_SETUP_BYTES, -1
    if _config.bwd_stages_bias(cfg.head_dim, cfg.mods, cfg.causal):
        off_bias = (end + 127) // 128 * 128
        end = off_bias + 2 * 8 * cfg.block_m * BIAS_PITCH
    return BwdSm90WsLayout(base=B, panels=cfg.head_dim // B.panel_cols, dq_tiles=B.dq_cols // 8, smem_dq=smem_dq,
                           off_dq=off_dq, off_lse=off_lse, off_delta=off_lse + B.rowvec, off_bar=off_bar,
                           barriers=barriers, off_writer=off_writer, smem_bytes=end + 1024, off_bias=off_bias)


def bwd_sm90_ws_addresses(cfg, stage: int, keys: int | None = None, head_dim: int | None = None) -> dict:
    """Byte addresses of the thread-issued shared instructions of one CTA of bwd_sm90_ws_kernel (the 8 consumer
    warps; consumer warp w owns keys 16w .. 16w + 15), per role: the float2 lse_log2 / delta loads of `stage`, where
    the kernel adds dQ (schedules.main_adds_dq: unless deterministic, or on the ordered path) the dS^T stores into
    buffer `stage` (visit k uses stage and buffer k % 2: stmatrix.x4 per 16 x 16 block, lane l giving row
    (l & 7) + 8 ((l >> 3) & 1), columns 8 (l >> 4) ..) and the dQ buffer's 16-byte stores (consumer cwg's thread c
    writes n8 tile dt at float4 (cwg * DQ_TILES + dt) * 128 + c; with config.bwd_ws_dq_one_wg consumer 1's thread c
    writes all 2 DQ_TILES tiles, dt at float4 dt * 128 + c, the same order), and the epilogue (dK, dV staging;
    store_tile by the 256 consumer threads)."""
    L = bwd_sm90_ws_layout(cfg)
    B = L.base
    hd, bm, bn, pc, nw = cfg.head_dim, cfg.block_m, cfg.block_n, B.panel_cols, 8
    qt = np.arange(bm // 8).reshape(-1, 1)
    out = {"lse_load": _per_warp(L.off_lse + stage * 2 * B.rowvec + (qt * 8 + 2 * (_L & 3)) * 4, nw),
           "delta_load": _per_warp(L.off_delta + stage * 2 * B.rowvec + (qt * 8 + 2 * (_L & 3)) * 4, nw)}
    key_row0 = (np.arange(nw) * 16).reshape(-1, 1, 1, 1)
    if main_adds_dq(cfg):
        out["ds_store"] = frag_addresses("b_kn_trans", B.off_ds + stage * B.smem_ds, bn, bm,
                                         key_row0.reshape(-1, 1), _ax(bm // 16, 1, 2) * 16)
        ctid = (np.arange(nw) * WARP).reshape(-1, 1, 1) + _L.reshape(1, 1, -1)
        if _config.bwd_ws_dq_one_wg(cfg):
            dt = np.arange(2 * L.dq_tiles).reshape(1, -1, 1)
            out["dq_store"] = np.where(ctid >= 128, L.off_dq + (dt * 128 + ctid % 128) * 16, -1)
        else:
            dt = np.arange(L.dq_tiles).reshape(1, -1, 1)
            out["dq_store"] = L.off_dq + ((ctid // 128 * L.dq_tiles + dt) * 128 + ctid % 128) * 16
    if L.off_bias >= 0:  # warp w: chunk i = lane + 32 j of its rows (row i / 2, half i % 2); ldmatrix j: block
        rows_w = L.off_bias + (stage * nw + np.arange(nw).reshape(-1, 1, 1)) * bm * BIAS_PITCH  # 2j + m / 2, half m % 2
        i = _ax(2 * bm // WARP, 1, 3) * WARP + _L.reshape(1, 1, -1)
        out["bias_stage"] = rows_w + bias_offset(i >> 1, i & 1)
        if hd <= 64:
            j = _ax(bm // 16, 1, 3)
            out["bias_frag"] = rows_w + bias_offset((2 * j + (_L >> 4)) * 8 + (_L & 7), (_L >> 3) & 1)
        else:  # lanes 0-15 address the 2 matrices (the others' addresses are not read: -1)
            j = _ax(bm // 8, 1, 3)
            out["bias_frag2"] = np.where(_L < 16, rows_w + bias_offset(j * 8 + (_L & 7), (_L >> 3) & 1), -1)
    rows, cols = key_row0[..., 0] + 8 * _ax(2, 1, 3), _ax(hd // 8, 2, 3) * 8
    out["dk_store"] = accumulator_store_addresses(B.off_k, bn, hd, rows, cols, pc)
    out["dv_store"] = accumulator_store_addresses(B.off_v, bn, hd, rows, cols, pc)
    out["dk_read"] = copy_addresses(256, bn, hd, B.off_k, keys, head_dim, panel_cols=pc)
    out["dv_read"] = copy_addresses(256, bn, hd, B.off_v, keys, head_dim, panel_cols=pc)
    return {role: np.asarray(a, dtype=np.int64) for role, a in out.items()}


BWD_SM90_WS_PER_CTA_ROLES = ("k_tma", "v_tma", "dk_store", "dv_store", "dk_read", "dv_read")


@lru_cache(maxsize=256)
def bwd_sm90_ws_cta_stats(cfg, keys: int | None = None, head_dim: int | None = None) -> tuple[dict, list]:
    """(per-CTA stats, per-visit stats per stage) of bwd_sm90_ws_kernel; cached, do not modify. Per visit: Q_i and
    dO_i (PANELS boxes of SMEM_Q bytes each), lse_log2_i and delta_i (two bulk copies of BLOCK_M floats), the
    thread instructions of bwd_sm90_ws_addresses, the wgmma operand reads of bwd_sm90_kernel, and where the kernel
    adds dQ (schedules.main_adds_dq: unless deterministic, or on the ordered path, whose dQ writer issues it) the bulk
    reduction's read of the dQ buffer."""
    L = bwd_sm90_ws_layout(cfg)
    B = L.base
    bulk = {"q_tma": tma_stats(L.panels, B.smem_q), "do_tma": tma_stats(L.panels, B.smem_q),
            "vec_bulk": tma_stats(2, 2 * B.rowvec)}
    if main_adds_dq(cfg):
        bulk["dq_bulk"] = tma_stats(1, L.smem_dq)
    per_visit = []
    for stage in range(2):
        addrs = bwd_sm90_ws_addresses(cfg, stage)
        stats = {r: _stats(BWD_SM90_WS_ROLES[r][0], a) for r, a in addrs.items() if r not in BWD_SM90_WS_PER_CTA_ROLES}
        per_visit.append(stats | bulk | bwd_sm90_wgmma(cfg))
    addrs = bwd_sm90_ws_addresses(cfg, 0, keys, head_dim)
    per_cta = {r: _stats(BWD_SM90_WS_ROLES[r][0], addrs[r]) for r in ("dk_store", "dv_store", "dk_read", "dv_read")}
    per_cta["k_tma"] = tma_stats(L.panels, B.smem_kv)
    per_cta["v_tma"] = tma_stats(L.panels, B.smem_kv)
    return per_cta, per_visit


def bwd_sm90_ws_kernel_shared(cfg, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int | None = None,
                              causal_skip: bool = True, window=None) -> SharedWalk:
    """Every shared-memory access of bwd_sm90_ws_kernel<cfg> over bwd_sm90_kernel's grid and query-block walk: per
    live CTA the K, V TMA loads and the epilogue, per visit the TMA / bulk loads, the thread instructions (walked
    with the bank rule), the wgmma operand reads and the dQ bulk reduction (bwd_sm90_ws_cta_stats). No cp.async:
    no guard LDS (the NVRTC 13.0 SASS has none before its fence.proxy.async either). The mbarrier operations are
    SYNCS instructions, not counted; the ordered deterministic dQ writer (config.ordered_dq) touches shared memory
    only through them and its bulk reductions (counted as the default mode's)."""
    if not isinstance(cfg, _config.BwdSm90WsConfig):
        raise TypeError(f"cfg must be a cuflash.config.BwdSm90WsConfig, got {type(cfg).__name__}")
    head_dim = _check_head_dim(cfg, head_dim)
    return _kv_outer_walk(cfg, BWD_SM90_WS_ROLES, bwd_sm90_ws_cta_stats, BWD_SM90_WS_PER_CTA_ROLES, batch, heads,
                          seqlen_q, seqlen_k, head_dim, causal_skip, window, thread_copies=False)
