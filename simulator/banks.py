"""Shared-memory bank conflicts: the hardware rule for one warp instruction, and a walk over every
shared-memory instruction fwd_kernel issues.

The rule (DESIGN.md section 6; matches ncu exactly for ld/st/ldmatrix): 32 banks of 4 bytes,
bank = (addr >> 2) & 31. A warp instruction is split into phases served one after another:

  kind                     bytes/lane  phases            lanes of phase m
  ld32  / st32             4           1                 0..31
  ld64  / st64             8           2                 16m..16m+15
  ld128 / st128            16          4                 8m..8m+7
  ldmatrix.x1 / .x2 / .x4  16 (a row)  1 / 2 / 4         8m..8m+7 (the row addresses of matrix m)
  cp.async16               16          4                 8m..8m+7  (model, see below)

Wavefronts of a phase = the largest number of distinct 4-byte words one bank must serve (lanes that
read the same word are served by one broadcast); conflicts = wavefronts - phases.

cp.async (LDGSTS) writes follow a different rule that is not documented. What was measured (H100,
DESIGN.md section 6): 8 lanes copying one 128-byte global line into one 128-byte-aligned shared row cost 1
wavefront per 8 lanes in any lane order; rows padded to 144 bytes cost about 2.5x; one row per thread
(16 B at a 128 B stride) costs 8x. Our model: phases of 8 lanes, and a phase costs
max(bank-rule wavefronts, number of distinct 128-byte shared lines it writes). It reproduces the
first and the last measurement exactly and gives 1.875x (not 2.5x) for 144-byte rows; the XOR-swizzled
tiles our kernels use are the first case. ncu's cp.async conflict counter always reads 0, so the
validation compares wavefronts only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from numba import njit

from cuflash import config as _config

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


# ----------------------------------------------------------------------------------------------
# Layouts of a [rows, head_dim] 16-bit tile: byte offset of element (row, col)
# ----------------------------------------------------------------------------------------------

def row_major_offset(row, col, head_dim: int, elem_bytes: int = 2):
    return (row * head_dim + col) * elem_bytes


def padded_offset(row, col, head_dim: int, pad_elems: int = 8, elem_bytes: int = 2):
    """Rows padded by pad_elems (8 x 2 bytes = 16 bytes: a 128-byte row becomes 144 bytes)."""
    return (row * (head_dim + pad_elems) + col) * elem_bytes


def swizzled_offset(row, col, rows: int, head_dim: int):
    """The kernels' layout (cuflash.config.swizzled_offset, which also takes NumPy arrays)."""
    return _config.swizzled_offset(row, col, rows, head_dim)


# ----------------------------------------------------------------------------------------------
# Walk of fwd_kernel's shared-memory instructions
# ----------------------------------------------------------------------------------------------

@dataclass
class InstrStats:
    kind: str
    instructions: int = 0  # warp instructions
    wavefronts: int = 0
    conflicts: int = 0
    bytes: int = 0  # bytes moved by active lanes

    def add(self, other: "InstrStats", times: int = 1):
        self.instructions += other.instructions * times
        self.wavefronts += other.wavefronts * times
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


@dataclass
class SharedWalk:
    """Totals over the whole grid of fwd_kernel, per role (see FWD_ROLES) and per SASS class."""

    config: object
    roles: dict = field(default_factory=dict)

    def by_sass(self, sass: str) -> InstrStats:
        out = InstrStats(sass)
        for role, (_, s) in FWD_ROLES.items():
            if s == sass:
                out.add(self.roles[role])
        return out

    @property
    def read_bytes(self) -> int:
        return self.by_sass("LDSM").bytes + self.by_sass("LDS").bytes

    @property
    def write_bytes(self) -> int:
        return self.by_sass("LDGSTS").bytes + self.by_sass("STS").bytes

    @property
    def conflicts(self) -> int:
        """Bank conflicts of ld/st/ldmatrix (the exact rule; cp.async is modelled separately)."""
        return sum(self.by_sass(s).conflicts for s in ("LDSM", "LDS", "STS"))


def _stats(kind: str, addrs: np.ndarray) -> InstrStats:
    addrs = addrs.reshape(-1, WARP)
    addrs = addrs[(addrs >= 0).any(axis=1)]  # a warp with no active lane issues nothing
    wf, conf = count_instructions(addrs, kind)
    return InstrStats(kind, addrs.shape[0], wf, conf, int((addrs >= 0).sum()) * KINDS[kind][0])


def tile_copy_addresses(cfg, rows: int, base: int, rows_valid: int | None = None,
                        cols_valid: int | None = None) -> np.ndarray:
    """Shared addresses of a [rows, HEAD_DIM] tile copy (load_tile_async / store_tile in tiles.cuh):
    [warp, i, lane], -1 where the lane issues nothing.

    A thread keeps one 16-byte column: row = tid / (HEAD_DIM/8) + i * ROWS_PER_ITER,
    col = (tid % (HEAD_DIM/8)) * 8, the same chunks as idx = tid + i*THREADS. cp.async issues every
    chunk (rows >= seqlen and cols >= head_dim are zero-filled, still written); store_tile reads only
    rows < rows_valid and cols < cols_valid (pass them for the store)."""
    chunks_per_row = cfg.head_dim // _config.CHUNK_ELEMS
    n_chunks = rows * chunks_per_row
    iters = -(-n_chunks // cfg.threads)
    tid = np.arange(cfg.threads).reshape(cfg.num_warps, 1, WARP)
    idx = tid + np.arange(iters).reshape(1, iters, 1) * cfg.threads
    row, chunk = np.divmod(np.minimum(idx, n_chunks - 1), chunks_per_row)
    col = chunk * _config.CHUNK_ELEMS
    addr = base + swizzled_offset(row, col, rows, cfg.head_dim)
    issued = idx < n_chunks
    if rows_valid is not None:
        issued &= row < rows_valid
    if cols_valid is not None:
        issued &= col < cols_valid
    return np.where(issued, addr, -1)


def _warp_rows0(cfg) -> np.ndarray:
    return np.arange(cfg.num_warps) * cfg.m_tiles_per_warp * _config.MMA_M


def fwd_addresses(cfg, stage: int, rows_q: int | None = None, head_dim: int | None = None) -> dict[str, np.ndarray]:
    """Byte addresses of every shared instruction one CTA of fwd_kernel issues, per role.

    Per-iteration roles (k_load, v_load, q_frag, k_frag, v_frag) are given for one iteration using
    K/V stage buffer `stage`; q_load, o_store and o_read happen once per CTA, o_read (store_tile) only
    for the CTA's valid rows rows_q and columns < head_dim (default: all)."""
    lane = np.arange(WARP)
    hd, bm, bn = cfg.head_dim, cfg.block_m, cfg.block_n
    k_base = cfg.smem_q_bytes + stage * cfg.smem_kv_bytes
    v_base = cfg.smem_q_bytes + cfg.stages * cfg.smem_kv_bytes + stage * cfg.smem_kv_bytes
    warp_row0 = _warp_rows0(cfg).reshape(-1, 1, 1, 1)  # [warp, ...]
    out = {
        "q_load": tile_copy_addresses(cfg, bm, 0),
        "k_load": tile_copy_addresses(cfg, bn, k_base),
        "v_load": tile_copy_addresses(cfg, bn, v_base),
        "o_read": tile_copy_addresses(cfg, bm, 0, rows_q, head_dim),
    }
    kk = np.arange(hd // 16).reshape(1, -1, 1, 1)
    # S = Q K^T, A fragments: for kk, for mt: row warp_row0 + mt*16 + (l & 15), col kk*16 + (l >> 4)*8
    mt = np.arange(cfg.m_tiles_per_warp).reshape(1, 1, -1, 1)
    out["q_frag"] = swizzled_offset(warp_row0 + mt * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8, bm, hd)
    # B fragments, per pair of n-tiles np: row np*16 + (l & 7) + ((l >> 4) << 3), col kk*16 + ((l >> 3) & 1)*8
    npair = np.arange(bn // 16).reshape(1, 1, -1, 1)
    k_frag = swizzled_offset(npair * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 16 + ((lane >> 3) & 1) * 8, bn, hd)
    out["k_frag"] = k_base + np.broadcast_to(k_frag, (cfg.num_warps,) + k_frag.shape[1:])
    # O += P V, .trans: for kk over keys, for dp: row kk*16 + (l & 7) + ((l >> 3) & 1)*8, col dp*16 + (l >> 4)*8
    kk_n = np.arange(bn // 16).reshape(1, -1, 1, 1)
    dp = np.arange(hd // 16).reshape(1, 1, -1, 1)
    v_frag = swizzled_offset(kk_n * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dp * 16 + (lane >> 4) * 8, bn, hd)
    out["v_frag"] = v_base + np.broadcast_to(v_frag, (cfg.num_warps,) + v_frag.shape[1:])
    # epilogue: lane (g = l >> 2, t = l & 3) writes rows warp_row0 + mt*16 + g (+8), col dt*8 + 2t
    g, t = lane >> 2, lane & 3
    mt = np.arange(cfg.m_tiles_per_warp).reshape(1, -1, 1, 1, 1)
    dt = np.arange(hd // 8).reshape(1, 1, -1, 1, 1)
    half = np.arange(2).reshape(1, 1, 1, -1, 1)
    out["o_store"] = swizzled_offset(warp_row0.reshape(-1, 1, 1, 1, 1) + mt * 16 + g + 8 * half,
                                     dt * 8 + 2 * t, bm, hd)
    return {role: np.asarray(a, dtype=np.int64) for role, a in out.items()}


PER_ITERATION_ROLES = ("k_load", "v_load", "q_frag", "k_frag", "v_frag")
PER_CTA_ROLES = ("q_load", "o_store", "o_read")


@lru_cache(maxsize=256)
def fwd_cta_stats(cfg, rows_q: int | None = None, head_dim: int | None = None) -> tuple[dict, list]:
    """(per-CTA stats, per-iteration stats per stage): role -> InstrStats (per_iter[stage][role]).

    Cached: callers must not modify the returned stats."""
    per_iter = []
    for stage in range(cfg.stages):
        addrs = fwd_addresses(cfg, stage)
        per_iter.append({r: _stats(FWD_ROLES[r][0], addrs[r]) for r in PER_ITERATION_ROLES})
    addrs = fwd_addresses(cfg, 0, rows_q, head_dim)
    per_cta = {r: _stats(FWD_ROLES[r][0], addrs[r]) for r in PER_CTA_ROLES}
    return per_cta, per_iter


def fwd_kernel_shared(cfg, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int | None = None,
                      causal_skip: bool = True) -> SharedWalk:
    """Every shared-memory instruction of fwd_kernel<cfg> over the grid (ceil(Sq/BLOCK_M), heads, batch).

    head_dim: the run-time head dim (<= cfg.head_dim, default cfg.head_dim). A CTA with n_blocks > 0
    issues the Q copy, n_blocks iterations (iteration it uses K/V stage buffer it % STAGES) and the
    epilogue; a CTA that sees no key writes O = 0 / lse = -inf straight to global memory and issues no
    shared instruction."""
    from .model import Problem
    from .strategies import block_sizes, n_block_max

    if not isinstance(cfg, _config.FwdConfig):
        raise TypeError(f"cfg must be a cuflash.config.FwdConfig, got {type(cfg).__name__}")
    head_dim = cfg.head_dim if head_dim is None else head_dim
    if not 1 <= head_dim <= cfg.head_dim:
        raise ValueError(f"head_dim={head_dim} must be in 1..{cfg.head_dim} for a HEAD_DIM={cfg.head_dim} kernel")
    p = Problem(batch, heads, seqlen_q, seqlen_k, head_dim, cfg.dtype, cfg.causal)
    n_max = n_block_max(p, cfg.block_m, cfg.block_n, causal_skip)
    rows_q = block_sizes(seqlen_q, cfg.block_m)
    walk = SharedWalk(cfg, {r: InstrStats(FWD_ROLES[r][0]) for r in FWD_ROLES})
    per_iter = None
    for rows in np.unique(rows_q[n_max > 0]):  # full blocks, and the tail block when it has keys
        live = (rows_q == rows) & (n_max > 0)
        per_cta, per_iter = fwd_cta_stats(cfg, int(rows), head_dim)
        for r in PER_CTA_ROLES:
            walk.roles[r].add(per_cta[r], int(live.sum()) * batch * heads)
    if per_iter is not None:
        for s in range(cfg.stages):
            iters = int(((n_max - s + cfg.stages - 1) // cfg.stages).sum()) * batch * heads  # it % STAGES == s
            for r in PER_ITERATION_ROLES:
                walk.roles[r].add(per_iter[s][r], iters)
    return walk
