"""Shared-memory bank rule (docs/IO_ANALYSIS.md) and the walk over fwd_kernel's shared instructions."""
import dataclasses

import numpy as np
import pytest

from cuflash import config
from cuflash.simulator import banks
from cuflash.simulator.model import Problem
from cuflash.simulator.schedules import bwd_query_blocks, key_block_ranges

LANES = np.arange(32)


@pytest.mark.parametrize("kind,addrs,expected", [
    # 32-bit: one phase of 32 lanes
    ("ld32", LANES * 4, (1, 0)),  # 32 consecutive words: 32 banks
    ("ld32", np.zeros(32, int), (1, 0)),  # one word: broadcast
    ("ld32", LANES * 128, (32, 31)),  # 32 words in bank 0
    ("st32", (LANES % 2) * 128, (2, 1)),  # two words in bank 0, each broadcast to 16 lanes
    ("ld32", LANES * 8, (2, 1)),  # stride 2 words: 2-way
    # 64-bit: phases lanes 0-15, 16-31
    ("ld64", LANES * 8, (2, 0)),
    ("ld64", (LANES % 16) * 8, (2, 0)),  # both halves the same 128 bytes
    ("st64", LANES * 16, (4, 2)),  # 16 lanes x 8 B at a 16 B stride span 256 B: 2-way per phase
    # 128-bit: 4 phases of 8 lanes
    ("ld128", LANES * 16, (4, 0)),
    ("st128", (LANES % 8) * 256, (32, 28)),  # 8 lanes in the same 4 banks, distinct words: 8-way
    ("ld128", np.zeros(32, int), (4, 0)),  # broadcast within each phase
    # ldmatrix: phase m = the 8 row addresses of lanes 8m..8m+7, 16 bytes each
    ("ldmatrix.x4", LANES * 16, (4, 0)),
    ("ldmatrix.x4", LANES * 128, (32, 28)),  # unswizzled 128-byte rows: 8-way
    ("ldmatrix.x2", LANES[:16] * 128, (16, 14)),
    ("ldmatrix.x1", LANES[:8] * 144, (1, 0)),  # 144-byte padded rows: conflict free
    ("ldmatrix.x1", LANES * 16, (1, 0)),  # 32 addresses given: lanes 8-31 ignored
])
def test_bank_rule(kind, addrs, expected):
    assert banks.count(addrs, kind) == expected, f"{kind} on {list(addrs[:9])}..."


def _brute_force(addrs, kind):
    """Slow restatement of the rule: split into phases, distinct words per bank, max, sum."""
    bpl, lanes_per_phase, phases, _ = banks.KINDS[kind]
    wavefronts = 0
    for ph in range(phases):
        words = {(a >> 2) + w for a in addrs[ph * lanes_per_phase:(ph + 1) * lanes_per_phase] for w in range(bpl // 4)}
        per_bank = [sum(1 for w in words if w % 32 == b) for b in range(32)]
        wavefronts += max(per_bank)
    return wavefronts, wavefronts - phases


@pytest.mark.parametrize("kind", [k for k in banks.KINDS if k != "cp.async16"])
def test_bank_rule_matches_brute_force_on_random_addresses(kind):
    rng = np.random.default_rng(7)
    size = banks.KINDS[kind][0]
    for _ in range(200):
        addrs = rng.integers(0, 4096 // size, 32) * size
        assert banks.count(addrs, kind) == _brute_force(addrs, kind), f"{kind} {addrs.tolist()}"


def test_layouts_for_ldmatrix_row_reads():
    """8 consecutive rows at the same 16-byte column: row-major 128-byte rows conflict 8-way, 16-byte
    padding and the kernels' XOR swizzle are conflict free."""
    rows = LANES % 8 + 8 * (LANES // 8)
    col = np.zeros(32, int)
    assert banks.count(banks.row_major_offset(rows, col, 64), "ldmatrix.x4") == (32, 28)
    assert banks.count(banks.padded_offset(rows, col, 64), "ldmatrix.x4") == (4, 0)
    for hd in (32, 64, 96, 128, 256):
        for c in range(0, hd, 8):
            addrs = banks.swizzled_offset(rows, np.full(32, c), 128, hd)
            assert banks.count(addrs, "ldmatrix.x4") == (4, 0), f"swizzled HEAD_DIM={hd} col={c}"


def test_cp_async_model_reproduces_the_measurements():
    """The measured cp.async rule (docs/IO_ANALYSIS.md): one 128-byte line per 8 lanes costs 1 wavefront per 8
    lanes in any order; one row per thread (16 B at a 128 B stride) 8x. 144-byte rows measured ~2.5x; the model gives 1.875x."""
    line_rows, chunks = LANES // 8, LANES % 8
    assert banks.count(banks.swizzled_offset(line_rows, chunks * 8, 128, 64), "cp.async16") == (4, 0)
    shuffled = np.random.default_rng(0).permutation(8)
    assert banks.count(line_rows * 128 + shuffled[chunks] * 16, "cp.async16") == (4, 0), "lane order must not matter"
    assert banks.count(banks.row_major_offset(LANES, 0, 64), "cp.async16")[0] == 8 * 4
    padded = sum(banks.count(banks.padded_offset(line_rows + 4 * i, chunks * 8, 64), "cp.async16")[0] for i in range(8))
    assert padded / (8 * 4) == pytest.approx(1.875), "padded-row model changed: update banks.py docs and IO_ANALYSIS.md"


def test_cp_async_band_from_global_lines():
    """count_cp_async: the lower bound is count(); the upper adds one wavefront per extra 128-byte global
    line a phase reads (H100: 1.00, 1.61 and 1.97 wavefronts per phase measured for 64-byte panels,
    docs/IO_VALIDATION.md section 3)."""
    line_rows, chunks = LANES // 8, LANES % 8
    shared = banks.swizzled_offset(line_rows, chunks * 8, 128, 64)
    assert banks.count_cp_async(shared, line_rows * 4096 + chunks * 16) == (4, 4), "one global line per phase"
    # 64-byte panel: lanes 0-3 row r, lanes 4-7 row r + 1 (two global lines) into one shared line
    two = (LANES // 4) * 4096 + (LANES % 4) * 16
    assert banks.count_cp_async(LANES * 16, two) == (4, 8)
    assert banks.count_cp_async(LANES * 16, two)[0] == banks.count(LANES * 16, "cp.async16")[0]
    # one row per thread: 8 shared lines and 8 global lines per phase, both bounds 8
    assert banks.count_cp_async(LANES * 128, LANES * 4096) == (32, 32)
    # inactive lanes (-1) read nothing; a phase with none costs nothing
    half = np.where(LANES < 8, LANES * 16, -1)
    assert banks.count_cp_async(half, two) == (1, 2)
    with pytest.raises(ValueError):
        banks.count_cp_async(LANES * 16, LANES * 8)


@pytest.mark.parametrize("hd,two_lines", [(32, True), (64, False), (96, True), (128, False), (192, False),
                                          (256, False)])
def test_walk_bands_follow_the_panel_width(hd, two_lines):
    """128-byte panels: each cp.async phase reads one global line, the band is a point. 64-byte panels
    (d32, d96): each phase reads two, the upper bound is twice the lower one."""
    cfg = config.fwd_config(hd, "fp16", False)
    walk = banks.fwd_kernel_shared(cfg, 1, 2, 256, 256)
    g = walk.by_sass("LDGSTS")
    assert g.wavefronts == 4 * g.instructions
    assert g.wavefronts_hi == (2 if two_lines else 1) * g.wavefronts


def test_copy_code_blocks_mirror_the_sass():
    """The basic blocks with LDGSTS per warp, as in the SASS of the kernels (nvcc 13.0 / NVRTC 13.5,
    sm_90a): fixed-column copies and short panel-order copies (<= 4 chunks per thread, unrolled) are
    straight-line (None); longer panel-order copies loop over panel steps, a block per step, and where
    their steps are not exact run T % 4 + T // 4 blocks."""
    assert banks.copy_code_blocks(128, 128, 64) is None  # fwd d64 Q
    assert banks.copy_code_blocks(256, 32, 64) is None  # bwd d64 Q (32 rows, 8 chunks: one per thread)
    assert banks.copy_code_blocks(256, 128, 64, 32) is None  # bwd_sm90 d64 K over 64-byte panels: 4 unrolled
    assert banks.copy_code_blocks(256, 64, 64, 32) is None  # ... Q: 2 unrolled
    assert banks.copy_code_blocks(128, 64, 256).tolist() == [4] * 4  # fwd d256 Q: 16 chunks, 4 steps of 4 rows
    assert banks.copy_code_blocks(128, 32, 256).tolist() == [4] * 4  # fwd d256 K: 8 chunks, 4 steps of 2 rows
    assert banks.copy_code_blocks(256, 128, 96).tolist() == [3] * 8  # fwd d96 Q: 6 chunks, 3 steps of 2 rows
    assert banks.copy_code_blocks(128, 64, 192).tolist() == [3] * 4  # bwd_dq d192 K: 12 chunks, 3 steps of 4 rows
    assert banks.copy_code_blocks(256, 64, 96) is None  # d96 K: T = 3, unrolled
    # uneven trip counts: a warp runs a block when any of its threads does
    assert banks.copy_code_blocks(64, 8, 96).tolist() == [2, 1]  # 96 chunks: T = 2 for tid < 32, else 1
    # (both loops over panel steps: 3 panels of 32 over 64 threads, 2 per step; 32 x 96 over 256 threads, fwd d96
    # with modifiers: the last step's second half of the threads leaves the loop)
    assert banks.copy_code_blocks(256, 32, 96).tolist() == [2] * 4 + [1] * 4
    assert banks.copy_code_blocks(64, 10, 96).tolist() == [2, 2]  # 120 chunks: T = 2 for tid < 56
    vec = ("guarded", np.array([True, False, False, False]))
    per_warp = banks.guard_lds_per_warp(128, [(128, 64), (64, 64), vec, (64, 64), (64, 256)])
    # [Q, K] one block, the guarded copy one (warp 0), K a new block after it, the d256 loop 4 (T = 16)
    assert per_warp.tolist() == [3 * (1 + 1 + 1 + 4)] + [3 * (1 + 1 + 4)] * 3


@pytest.mark.parametrize("cfg", [config.fwd_config(hd, "bf16", c) for hd in (32, 64, 96, 128, 256)
                                 for c in (False, True)], ids=str)
def test_guard_lds_of_the_forward(cfg):
    """fwd_kernel: 3 predicated-off LDS per LDGSTS block per warp: the prologue (Q, K, V) and every
    step but the last (the next K, V); straight-line copies share a block."""
    b, h, s = 1, 2, 640
    walk = banks.fwd_kernel_shared(cfg, b, h, s, s)
    n_begin, n_end = key_block_ranges(Problem(b, h, s, s, cfg.head_dim, cfg.dtype, cfg.causal), cfg.block_m,
                                      cfg.block_n)
    n = n_end - n_begin
    n = n[n > 0]
    q, kv = (cfg.block_m, cfg.head_dim), (cfg.block_n, cfg.head_dim)
    w = cfg.num_warps
    q_loop, kv_loop = (banks.copy_code_blocks(cfg.threads, *t) for t in (q, kv))
    # blocks per warp: straight-line copies in a row share one block; a rolled loop brings its own blocks
    kv_blocks = 2 * int(kv_loop.sum()) if kv_loop is not None else w  # the K and V copies of one step
    if q_loop is None:  # Q joins the block of K, V when those are straight-line too
        prologue = w if kv_loop is None else w + kv_blocks
    else:
        prologue = int(q_loop.sum()) + kv_blocks
    assert walk.guard_lds == 3 * (len(n) * prologue + int((n - 1).sum()) * kv_blocks) * b * h


@pytest.mark.parametrize("bad,kind,err", [
    (LANES * 4, "ld16", ValueError), (LANES[:31] * 4, "ld32", ValueError), (LANES * 4 + 2, "ld32", ValueError),
    (LANES * 8 + 4, "ld64", ValueError), (-LANES * 16, "ld128", ValueError), (LANES * 4.0, "ld32", TypeError),
])
def test_count_rejects_bad_input_with_a_message(bad, kind, err):
    with pytest.raises(err):
        banks.count(bad, kind)


# ---- literal ports of cuda/tiles.cuh, independent of banks.py --------------------------------

def _offset(row, col, rows, cols, pc=None):
    """SmemTile<rows, cols, pc>::offset, scalar (pc None: the default panel width)."""
    pc = pc or (64 if cols % 64 == 0 else 32)
    pb = pc * 2
    off = row * pb + (col % pc) * 2
    off ^= ((off >> 7) & (7 if pb == 128 else 3)) << 4
    return (col // pc) * rows * pb + off


def _frag(lane_addr, row0, col0, rows, cols):
    """SmemTile::frag, scalar."""
    pc = 64 if cols % 64 == 0 else 32
    return (lane_addr ^ (((col0 % pc) // 8) << 4)) + (col0 // pc) * rows * pc * 2 + row0 * pc * 2


LANE_OFFSET = {  # lane_offset_* of tiles.cuh: lane -> (row, col) of its ldmatrix row address
    "a": lambda l: (l & 15, (l >> 4) * 8),
    "b_nk": lambda l: ((l & 7) + ((l >> 4) << 3), ((l >> 3) & 1) * 8),
    "b_kn_trans": lambda l: ((l & 7) + ((l >> 3) & 1) * 8, (l >> 4) * 8),
    "a_trans": lambda l: ((l & 7) + (l >> 4) * 8, ((l >> 3) & 1) * 8),
}


def _copy_per_thread(threads, rows, cols, base, store=False, rows_valid=0, cols_valid=0, pc=None):
    """load_tile_async / store_tile: per thread the list of its copy instructions' shared addresses
    (None: this thread is predicated off in that instruction)."""
    cpr, pc = cols // 8, pc or (64 if cols % 64 == 0 else 32)
    # SmemTile::fixed_column: the 8 lanes of a phase within one 128-byte line of one panel
    fixed = (threads % cpr == 0 and (pc == 64 or cpr == pc // 8)
             and ((threads // cpr) % 8 == 0 or threads // cpr >= rows))
    out = []
    for tid in range(threads):
        seq = []
        if not fixed:  # chunks in panel order
            idx = tid
            while idx < rows * cpr:
                panel, rest = divmod(idx, rows * (pc // 8))
                r, c = rest // (pc // 8), panel * pc + (rest % (pc // 8)) * 8
                seq.append(base + _offset(r, c, rows, cols, pc) if not store or (r < rows_valid and c < cols_valid)
                           else None)
                idx += threads
        else:  # one column chunk per thread, rows step by ROWS_PER_ITER
            rpi = threads // cpr
            r0, c = tid // cpr, (tid % cpr) * 8
            dst = base + _offset(r0, c, rows, cols, pc)
            for i in range(-(-rows // rpi)):
                ok = (rows % rpi == 0 or r0 + i * rpi < rows) and (not store or (c < cols_valid and r0 + i * rpi < rows_valid))
                seq.append(dst + i * rpi * pc * 2 if ok else None)
        out.append(seq)
    return out


class _Totals(dict):
    def issue(self, sass, kind, lane_addrs):  # 32 addresses, None = lane issues nothing
        if all(a is None for a in lane_addrs):
            return  # a warp with no active lane issues nothing
        wf, conf = banks.count_instructions(np.array([-1 if a is None else a for a in lane_addrs]), kind)
        t = self.setdefault(sass, [0, 0, 0, 0])
        t[0] += 1
        t[1] += wf
        t[2] += conf
        t[3] += sum(a is not None for a in lane_addrs) * banks.KINDS[kind][0]

    def copy(self, threads, rows, cols, base, store=False, rows_valid=0, cols_valid=0, pc=None):
        per_thread = _copy_per_thread(threads, rows, cols, base, store, rows_valid, cols_valid, pc)
        sass, kind = ("LDS", "ld128") if store else ("LDGSTS", "cp.async16")
        for w in range(threads // 32):
            lanes = per_thread[32 * w:32 * w + 32]
            for i in range(max(len(s) for s in lanes)):
                self.issue(sass, kind, [s[i] if i < len(s) else None for s in lanes])

    def ldmatrix(self, pattern, base, rows, cols, row0, col0):
        lane_addrs = [_frag(base + _offset(*LANE_OFFSET[pattern](l), rows, cols), row0, col0, rows, cols)
                      for l in range(32)]
        self.issue("LDSM", "ldmatrix.x4", lane_addrs)

    def st_acc(self, base, rows, cols, row0, col0, pc=None):  # st.shared.b32 of (row0 + g, col0 + 2t)
        self.issue("STS", "st32", [base + _offset(row0 + (l >> 2), col0 + 2 * (l & 3), rows, cols, pc)
                                   for l in range(32)])


def _n_blocks(causal, row0, rows_q, sq, sk, bn):
    n = -(-sk // bn)
    if causal:
        col_last = row0 + rows_q - 1 + sk - sq
        n = 0 if col_last < 0 else min(n, col_last // bn + 1)
    return n


def _check(walk, totals, what):
    for sass in banks.SASS_CLASSES:
        s = walk.by_sass(sass)
        assert (s.instructions, s.wavefronts, s.conflicts, s.bytes) == tuple(totals.get(sass, [0, 0, 0, 0])), \
            f"{sass} totals differ for {what}"


# ---- the fwd_kernel walk ------------------------------------------------------------------

def _slow_walk(cfg, batch, heads, sq, sk, head_dim):
    """Every CTA, iteration, warp and lane of fwd_kernel (cuda/fwd.cuh) in plain Python loops."""
    tot = _Totals()
    hd, bm, bn, threads = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.threads
    m_tiles = bm // (16 * cfg.num_warps)
    q_bytes, kv_bytes = bm * hd * 2, bn * hd * 2
    for _ in range(batch * heads):
        for m_block in range(-(-sq // bm)):
            row0 = m_block * bm
            rows_q = min(bm, sq - row0)
            n_blocks = _n_blocks(cfg.causal, row0, rows_q, sq, sk, bn)
            if n_blocks <= 0:
                continue
            tot.copy(threads, bm, hd, 0)
            for it in range(n_blocks):
                k_base, v_base = q_bytes + (it % 2) * kv_bytes, q_bytes + (2 + it % 2) * kv_bytes
                tot.copy(threads, bn, hd, k_base)
                tot.copy(threads, bn, hd, v_base)
                for w in range(cfg.num_warps):
                    wr0 = w * m_tiles * 16
                    for kk in range(hd // 16):
                        for mt in range(m_tiles):  # Q A-fragments: once per m-tile and k-step
                            tot.ldmatrix("a", 0, bm, hd, wr0 + mt * 16, kk * 16)
                        for np_ in range(bn // 16):  # K B-fragments: once per n-pair, used for every m-tile
                            tot.ldmatrix("b_nk", k_base, bn, hd, np_ * 16, kk * 16)
                    for kk in range(bn // 16):
                        for dp in range(hd // 16):
                            tot.ldmatrix("b_kn_trans", v_base, bn, hd, kk * 16, dp * 16)
            for w in range(cfg.num_warps):
                for mt in range(m_tiles):
                    for h in range(2):
                        for dt in range(hd // 8):
                            tot.st_acc(0, bm, hd, w * m_tiles * 16 + mt * 16 + 8 * h, dt * 8)
            tot.copy(threads, bm, hd, 0, store=True, rows_valid=rows_q, cols_valid=head_dim)
    return tot


FWD_WALK_CASES = [  # (config, sq, sk, head_dim): M_TILES 1 and 2, fixed-column and panel-order copies
    (config.fwd_config(64, "fp16", True), 200, 300, 64),  # M_TILES 2, 128 threads
    (config.fwd_config(96, "fp16", False), 130, 70, 80),  # panel order, 64-byte panels
    (config.fwd_config(128, "fp16", False), 150, 90, 128),  # M_TILES 2, BLOCK_N 32
    (config.fwd_config(128, "bf16", True), 150, 300, 120),  # M_TILES 1
    (config.fwd_config(192, "fp16", False), 70, 70, 192),  # panel order, 128-byte panels
    (config.fwd_config(256, "fp16", True), 150, 40, 256),  # panel order (4 rows per iteration)
    (config.fwd_config(32, "fp16", False), 64, 129, 24),
    (config.FwdConfig(64, 128, 64, 8, "fp16", False), 140, 100, 64),  # M_TILES 1 at d = 64
    (config.FwdConfig(64, 64, 32, 1, "fp16", True), 100, 90, 64),  # M_TILES 4, one warp
]


@pytest.mark.parametrize("cfg,sq,sk,head_dim", FWD_WALK_CASES,
                         ids=lambda x: f"hd{x.head_dim}-m{x.m_tiles_per_warp}" if isinstance(x, config.FwdConfig) else str(x))
def test_walk_equals_instruction_by_instruction_enumeration(cfg, sq, sk, head_dim):
    walk = banks.fwd_kernel_shared(cfg, 1, 2, sq, sk, head_dim)
    _check(walk, _slow_walk(cfg, 1, 2, sq, sk, head_dim), f"{cfg.cpp_name()} sq={sq} sk={sk} head_dim={head_dim}")


def _cfg_id(c):
    family = "sm90" if isinstance(c, (config.FwdSm90Config, config.BwdSm90Config)) else "mma"
    det = "-det" if getattr(c, "deterministic", False) else ""
    return f"{family}-hd{c.head_dim}-{c.dtype}-{'causal' if c.causal else 'full'}{det}"


# the forward kernels the walks model: fwd_kernel and fwd_sm90_kernel (not the kv-cache decode variant)
WALKED_FWD = [c for c in config.all_fwd_configs() if isinstance(c, (config.FwdConfig, config.FwdSm90Config))
              and not getattr(c, "decode", False)]


@pytest.mark.parametrize("cfg", WALKED_FWD, ids=_cfg_id)
def test_fragment_loads_and_epilogue_stores_are_conflict_free(cfg):
    """mma.sync: the ldmatrix fragments and the O staging stores; wgmma: no ldmatrix at all (the tensor core
    reads Q, K, V through descriptors) and conflict-free O staging stores."""
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 1000, 1000)
    is_wgmma = isinstance(cfg, config.FwdSm90Config)
    for role in ("o_store",) if is_wgmma else ("q_frag", "k_frag", "v_frag", "o_store"):
        s = walk.roles[role]
        assert s.instructions > 0 and s.conflicts == 0, f"{role} of {cfg.cpp_name()}: {s.conflicts} bank conflicts"
    assert (walk.by_sass("LDSM").instructions == 0) == is_wgmma, cfg.cpp_name()
    assert (walk.wgmma_read_bytes > 0) == is_wgmma, cfg.cpp_name()


@pytest.mark.parametrize("hd", config.KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_copies_are_conflict_free(hd, causal):
    """Fixed-column copies and panel-order copies (HEAD_DIM 96, 192, 256) alike: each phase of 8 lanes
    is one 128-byte line, so cp.async (model) and the 16-byte epilogue loads take 4 wavefronts."""
    cfg = config.fwd_config(hd, "bf16", causal)
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 512, 512)
    for role in ("q_load", "k_load", "v_load", "o_read"):
        s = walk.roles[role]
        assert s.wavefronts == 4 * s.instructions and s.conflicts == 0, \
            f"{role} of HEAD_DIM={hd}: {s.wavefronts} wavefronts for {s.instructions} instructions"


@pytest.mark.parametrize("threads,rows,cols,fixed", [
    (256, 128, 96, False), (256, 64, 96, False),  # 12 chunks per row
    (256, 128, 192, False),  # 24 chunks per row
    (128, 64, 256, False), (128, 32, 256, False),  # 4 rows per iteration, not a multiple of 8
    (256, 32, 256, True),  # 8 rows per iteration
    (128, 32, 32, True),  # 32 rows per iteration >= ROWS
    (256, 128, 64, True), (128, 128, 128, True),
])
def test_copy_mapping_mirrors_tiles_cuh(threads, rows, cols, fixed):
    """fixed_column and the chunk order against the literal port above, chunk for chunk."""
    assert banks.fixed_column(threads, rows, cols) == fixed
    addrs = banks.copy_addresses(threads, rows, cols, 4096)
    per_thread = _copy_per_thread(threads, rows, cols, 4096)
    for tid, seq in enumerate(per_thread):
        got = [int(a) for a in addrs[tid // 32, :, tid % 32]]
        want = [a if a is not None else -1 for a in seq] + [-1] * (len(got) - len(seq))
        assert got == want, f"thread {tid}"
    issued = addrs[addrs >= 0]
    assert sorted(issued.tolist()) == list(range(4096, 4096 + rows * cols * 2, 16)), "every chunk once"


def test_head_dim_96_copies_were_conflicting_in_row_major_order():
    """Finding (docs/IO_ANALYSIS.md), found by this analyzer and fixed in tiles.cuh: the old HEAD_DIM = 96
    copy order (chunk idx row-major: the 8 lanes of a phase = chunks 0-3 of panels 0 and 1 of one row,
    ROWS * 64 bytes apart, equal modulo 128 bytes) conflicted 2-way in the 16-byte epilogue loads (6.67
    wavefronts per instruction) and cost 2 lines per phase (8 wavefronts) in the cp.async model. Panel
    order (SmemTile::panel_order) makes each phase one 128-byte line: 4 wavefronts, 0 conflicts."""
    cfg = config.fwd_config(96, "fp16", False)
    assert not banks.fixed_column(cfg.threads, cfg.block_m, 96)
    tid = np.arange(cfg.threads).reshape(-1, 1, 32)
    idx = tid + np.arange(cfg.block_m * 12 // cfg.threads).reshape(1, -1, 1) * cfg.threads
    old = banks.swizzled_offset(idx // 12, (idx % 12) * 8, cfg.block_m, 96)
    assert banks.count_instructions(old, "ld128") == (320, 128), "row-major: 48 instructions, 2-way in 2 of 3"
    assert banks.count_instructions(old, "cp.async16") == (384, 192)
    new = banks.copy_addresses(cfg.threads, cfg.block_m, 96, 0)
    assert banks.count_instructions(new, "ld128") == (192, 0)
    assert banks.count_instructions(new, "cp.async16") == (192, 0)
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 512, 512)
    for role in ("o_read", "q_load", "k_load", "v_load"):
        s = walk.roles[role]
        assert s.conflicts == 0 and s.wavefronts == 4 * s.instructions, f"{role}: {s}"


FWD_BYTES_CASES = [config.fwd_config(64, "fp16", False), config.fwd_config(128, "fp16", False),  # M_TILES 2
                   config.fwd_config(96, "fp16", False), config.FwdConfig(128, 128, 128, 8, "fp16", False),  # M_TILES 1
                   config.FwdConfig(64, 128, 64, 8, "fp16", False)]


@pytest.mark.parametrize("cfg", FWD_BYTES_CASES, ids=lambda c: f"hd{c.head_dim}-{c.block_m}x{c.block_n}x{c.num_warps}")
def test_shared_bytes_follow_from_the_instructions(cfg):
    """Per warp and k-step of S = Q K^T: M_TILES Q A-fragments and BLOCK_N/16 K B-fragments (shared by
    the m-tiles); per k-step of O += P V: HEAD_DIM/16 V B-fragments. ldmatrix.x4 moves 512 bytes."""
    walk = banks.fwd_kernel_shared(cfg, 2, 3, 1024, 1024)
    t_r, t_c = -(-1024 // cfg.block_m), -(-1024 // cfg.block_n)
    ctas, iters = 2 * 3 * t_r, 2 * 3 * t_r * t_c
    assert walk.write_bytes == ctas * (cfg.smem_q_bytes + cfg.smem_q_bytes) + iters * 2 * cfg.smem_kv_bytes, \
        "writes: Q copy and O staging once per CTA, K and V copies once per iteration"
    m, qk, pv = cfg.m_tiles_per_warp, cfg.head_dim // 16, cfg.block_n // 16
    per_iter_ldsm = cfg.num_warps * (qk * (m + pv) + pv * qk)
    assert walk.by_sass("LDSM").instructions == iters * per_iter_ldsm
    assert walk.roles["q_frag"].instructions == iters * cfg.num_warps * qk * m
    assert walk.read_bytes == iters * per_iter_ldsm * 512 + ctas * cfg.smem_q_bytes


@pytest.mark.parametrize("rows,cols", [(128, 64), (64, 96), (32, 256), (128, 32), (32, 192), (128, 64)])
@pytest.mark.parametrize("pattern", sorted(banks.LANE_PATTERNS))
def test_frag_equals_offset(rows, cols, pattern):
    """Tile::frag (XOR of the chunk bits from the lane's (0, 0) address) = Tile::offset of the element."""
    base = 3 * 1024
    lane0 = base + banks.swizzled_offset(*banks.LANE_PATTERNS[pattern], rows, cols)
    for row0 in range(0, rows - 15, 8):
        for col0 in range(0, cols, 16):
            assert (banks.tile_frag(lane0, row0, col0, rows, cols)
                    == banks.frag_addresses(pattern, base, rows, cols, row0, col0)).all(), (row0, col0)


# ---- the bwd_kernel and bwd_dq_kernel walks -----------------------------------------------------

def _slow_bwd_walk(cfg, batch, heads, sq, sk, head_dim):
    """Every CTA, query block, warp and lane of bwd_kernel (cuda/bwd.cuh), literally."""
    tot = _Totals()
    hd, bm, bn, nw, D = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.d_split
    threads = 32 * nw
    smem_q, smem_kv, smem_ds, rowvec = bm * hd * 2, bn * hd * 2, bn * bm * 2, bm * 4
    off_k, off_v, off_q, off_do = 0, smem_kv, 2 * smem_kv, 2 * smem_kv + smem_q
    off_ds = 2 * smem_kv + 4 * smem_q
    off_lse, off_delta = off_ds + smem_ds, off_ds + smem_ds + rowvec
    dkv_cols = hd // D
    dq_warps_m = min(nw, bm // 16)
    dq_warps_d = nw // dq_warps_m
    dq_m_tiles, dq_d_tiles = bm // 16 // dq_warps_m, hd // 8 // dq_warps_d
    diag = sk - sq

    def load_query_block(stage):
        tot.copy(threads, bm, hd, off_q + stage * 2 * smem_q)
        tot.copy(threads, bm, hd, off_do + stage * 2 * smem_q)
        chunks = bm // 4
        for w in range(nw):
            lanes = []
            for lane in range(32):
                tid = 32 * w + lane
                if tid < 2 * chunks:
                    is_delta = tid >= chunks
                    c = tid - chunks if is_delta else tid
                    lanes.append((off_delta if is_delta else off_lse) + stage * 2 * rowvec + c * 16)
                else:
                    lanes.append(None)
            tot.issue("LDGSTS", "cp.async16", lanes)

    for _ in range(batch * heads):
        for n_block in range(-(-sk // bn)):
            n0 = n_block * bn
            keys = min(bn, sk - n0)
            m_begin = max(0, n0 - diag) // bm if cfg.causal else 0
            m_end = -(-sq // bm)
            if m_begin >= m_end:
                continue
            tot.copy(threads, bn, hd, off_k)
            tot.copy(threads, bn, hd, off_v)
            load_query_block(0)
            stage = 0
            for m_block in range(m_begin, m_end):
                if m_block + 1 < m_end:
                    load_query_block(stage ^ 1)
                q_smem, do_smem = off_q + stage * 2 * smem_q, off_do + stage * 2 * smem_q
                for w in range(nw):
                    key_row0, d_col0 = (w // D) * 16, (w % D) * dkv_cols
                    for kk in range(hd // 16):  # S^T = K Q^T
                        tot.ldmatrix("a", off_k, bn, hd, key_row0, kk * 16)
                        for qp in range(bm // 16):
                            tot.ldmatrix("b_nk", q_smem, bm, hd, qp * 16, kk * 16)
                    for qt in range(bm // 8):  # float2 lse_log2
                        tot.issue("LDS", "ld64", [off_lse + stage * 2 * rowvec + (qt * 8 + 2 * (l & 3)) * 4 for l in range(32)])
                    for kk in range(bm // 16):  # dV += P^T dO
                        for dp in range(dkv_cols // 16):
                            tot.ldmatrix("b_kn_trans", do_smem, bm, hd, kk * 16, d_col0 + dp * 16)
                    for kk in range(hd // 16):  # dP^T = V dO^T
                        tot.ldmatrix("a", off_v, bn, hd, key_row0, kk * 16)
                        for qp in range(bm // 16):
                            tot.ldmatrix("b_nk", do_smem, bm, hd, qp * 16, kk * 16)
                    for qt in range(bm // 8):  # float2 delta
                        tot.issue("LDS", "ld64", [off_delta + stage * 2 * rowvec + (qt * 8 + 2 * (l & 3)) * 4 for l in range(32)])
                    for kk in range(bm // 16):  # dK += dS^T Q
                        for dp in range(dkv_cols // 16):
                            tot.ldmatrix("b_kn_trans", q_smem, bm, hd, kk * 16, d_col0 + dp * 16)
                if not cfg.deterministic:
                    for w in range(nw):
                        if w % D == 0:
                            for qt in range(bm // 8):
                                for h in range(2):
                                    tot.st_acc(off_ds, bn, bm, (w // D) * 16 + 8 * h, qt * 8)
                    for w in range(nw):
                        warp_m, warp_d = w // dq_warps_d, w % dq_warps_d
                        for kk in range(bn // 16):
                            for mt in range(dq_m_tiles):
                                tot.ldmatrix("a_trans", off_ds, bn, bm, kk * 16, (warp_m * dq_m_tiles + mt) * 16)
                            for dp in range(dq_d_tiles // 2):
                                tot.ldmatrix("b_kn_trans", off_k, bn, hd, kk * 16, (warp_d * dq_d_tiles + 2 * dp) * 8)
                stage ^= 1
            for w in range(nw):
                key_row0, d_col0 = (w // D) * 16, (w % D) * dkv_cols
                for h in range(2):
                    for dt in range(dkv_cols // 8):
                        tot.st_acc(off_k, bn, hd, key_row0 + 8 * h, d_col0 + dt * 8)
                        tot.st_acc(off_v, bn, hd, key_row0 + 8 * h, d_col0 + dt * 8)
            tot.copy(threads, bn, hd, off_k, store=True, rows_valid=keys, cols_valid=head_dim)
            tot.copy(threads, bn, hd, off_v, store=True, rows_valid=keys, cols_valid=head_dim)
    return tot


BWD_WALK_CASES = [(hd, causal, det, sq, sk) for hd, causal, det, sq, sk in [
    (32, False, False, 70, 150), (64, True, False, 100, 150), (64, False, True, 40, 130),
    (96, True, False, 90, 70), (128, False, False, 40, 140), (128, True, True, 70, 50),
    (192, False, False, 40, 40), (256, True, False, 50, 40)]]


@pytest.mark.parametrize("hd,causal,det,sq,sk", BWD_WALK_CASES)
def test_bwd_walk_equals_instruction_by_instruction_enumeration(hd, causal, det, sq, sk):
    cfg = config.bwd_config(hd, "fp16", causal, det)
    head_dim = hd - 8
    walk = banks.bwd_kernel_shared(cfg, 1, 2, sq, sk, head_dim)
    _check(walk, _slow_bwd_walk(cfg, 1, 2, sq, sk, head_dim), f"{cfg.cpp_name()} sq={sq} sk={sk}")
    assert banks.bwd_layout(cfg).smem_bytes == cfg.smem_bytes


def _slow_dq_walk(cfg, batch, heads, sq, sk, head_dim):
    """bwd_dq_kernel (deterministic dQ), literally."""
    tot = _Totals()
    hd, bm, bn, threads = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.threads
    m_tiles = bm // (16 * cfg.num_warps)
    q_bytes, kv_bytes = bm * hd * 2, bn * hd * 2
    for _ in range(batch * heads):
        for m_block in range(-(-sq // bm)):
            row0 = m_block * bm
            rows_q = min(bm, sq - row0)
            n_blocks = _n_blocks(cfg.causal, row0, rows_q, sq, sk, bn)
            if n_blocks <= 0:
                continue
            tot.copy(threads, bm, hd, 0)
            tot.copy(threads, bm, hd, q_bytes)
            for it in range(n_blocks):
                k_base, v_base = 2 * q_bytes + (it % 2) * kv_bytes, 2 * q_bytes + (2 + it % 2) * kv_bytes
                tot.copy(threads, bn, hd, k_base)
                tot.copy(threads, bn, hd, v_base)
                for w in range(cfg.num_warps):
                    wr0 = w * m_tiles * 16
                    for kk in range(hd // 16):
                        for mt in range(m_tiles):
                            tot.ldmatrix("a", 0, bm, hd, wr0 + mt * 16, kk * 16)
                            tot.ldmatrix("a", q_bytes, bm, hd, wr0 + mt * 16, kk * 16)
                        for np_ in range(bn // 16):
                            tot.ldmatrix("b_nk", k_base, bn, hd, np_ * 16, kk * 16)
                            tot.ldmatrix("b_nk", v_base, bn, hd, np_ * 16, kk * 16)
                    for kk in range(bn // 16):
                        for dp in range(hd // 16):
                            tot.ldmatrix("b_kn_trans", k_base, bn, hd, kk * 16, dp * 16)
            for w in range(cfg.num_warps):
                for mt in range(m_tiles):
                    for h in range(2):
                        for dt in range(hd // 8):
                            tot.st_acc(0, bm, hd, w * m_tiles * 16 + mt * 16 + 8 * h, dt * 8)
            tot.copy(threads, bm, hd, 0, store=True, rows_valid=rows_q, cols_valid=head_dim)
    return tot


@pytest.mark.parametrize("hd,causal,sq,sk", [(64, True, 200, 150), (96, False, 130, 70), (128, True, 150, 300),
                                             (192, False, 70, 40), (256, True, 100, 60)])
def test_dq_walk_equals_instruction_by_instruction_enumeration(hd, causal, sq, sk):
    cfg = config.dq_config(hd, "bf16", causal)
    walk = banks.dq_kernel_shared(cfg, 1, 2, sq, sk, hd)
    _check(walk, _slow_dq_walk(cfg, 1, 2, sq, sk, hd), f"{cfg.cpp_name()} sq={sq} sk={sk}")


@pytest.mark.parametrize("hd", config.KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("det", [False, True])
def test_bwd_instruction_counts_and_conflicts(hd, det):
    """Per visited (key block, query block) and warp: ldmatrix 2 * (HEAD_DIM/16) * (1 + BLOCK_M/16)
    for S^T and dP^T, 2 * (BLOCK_M/16) * (DKV_COLS/16) for dV and dK, (BLOCK_N/16) * (DQ_M_TILES +
    DQ_D_TILES/2) for dQ; 2 * BLOCK_M/8 float2 loads of lse_log2 and delta."""
    cfg = config.bwd_config(hd, "fp16", False, det)
    L = banks.bwd_layout(cfg)
    sq, sk = 1024, 512
    walk = banks.bwd_kernel_shared(cfg, 1, 2, sq, sk)
    visits = 2 * (sk // cfg.block_n) * (sq // cfg.block_m)
    per_warp = (2 * (hd // 16) * (1 + cfg.block_m // 16) + 2 * (cfg.block_m // 16) * (L.dkv_cols // 16)
                + (0 if det else (cfg.block_n // 16) * (L.dq_m_tiles + L.dq_d_tiles // 2)))
    assert walk.by_sass("LDSM").instructions == visits * cfg.num_warps * per_warp
    assert walk.roles["lse_load"].instructions == visits * cfg.num_warps * cfg.block_m // 8
    assert walk.roles["ds_store"].instructions == (0 if det else visits * L.key_warps * cfg.block_m // 4)
    assert walk.roles["vec_load"].bytes == visits * 2 * cfg.block_m * 4
    assert walk.roles["q_load"].bytes == visits * L.smem_q
    # the swizzle keeps every ldmatrix, 16-byte copy, float2 load and accumulator store conflict free
    for role in banks.BWD_ROLES:
        s = walk.roles[role]
        assert s.conflicts == 0, f"{role} of HEAD_DIM={hd}: {s}"


# ---- the wgmma kernels: fwd_sm90_kernel and bwd_sm90_kernel ------------------------------------------

# the synchronous wgmma forward (the library launches the warp-specialized one at every head dim; the analyzer
# still models this kernel and validates it against ncu): 64-byte panels (d32, d96) and 128-byte ones (d64)
SM90_FWD = [config.fwd_sm90_config(hd, dt, c, m) for hd in (32, 64, 96) for dt in config.DTYPES
            for c in (False, True) for m in (0, *config.MODS_CHECKED[c])]
# the synchronous wgmma backward with the shipped tiles (the library launches the warp-specialized kernel, which
# has the same tiles where it takes 64-query steps, at those head dims: SM90_BWD_WS)
SM90_BWD = list(dict.fromkeys(c.sync_equivalent() if isinstance(c, config.BwdSm90WsConfig) else c
                              for c in config.all_bwd_configs() if isinstance(c, config.BwdSm90Config)
                              and c.block_m == 64))
SM90_BWD_WS = [c for c in config.all_bwd_configs() if isinstance(c, config.BwdSm90WsConfig)]


def test_the_h100_config_lists_hold_wgmma_kernels():
    assert SM90_BWD and SM90_BWD_WS, "all_bwd_configs lists the sm_90a wgmma kernels"
    assert any(isinstance(c, config.FwdSm90WsConfig) for c in config.all_fwd_configs("sm_90a"))
    assert not any(isinstance(c, config.FwdSm90Config) for c in config.all_fwd_configs("sm_80"))


@pytest.mark.parametrize("hd,pc", [(64, 32), (128, 32), (128, 64), (256, 64), (96, 32)])
def test_swizzled_offset_with_a_panel_width(hd, pc):
    """SmemTile<ROWS, HEAD_DIM, PANEL_COLS>::offset (the literal port above) for a chosen panel width, and
    the default width equal to cuflash.config.swizzled_offset."""
    rows, cols = np.meshgrid(np.arange(64), np.arange(0, hd, 2), indexing="ij")
    got = banks.swizzled_offset(rows, cols, 64, hd, pc)
    want = np.vectorize(lambda r, c: _offset(r, c, 64, hd, pc))(rows, cols)
    assert (got == want).all(), f"HEAD_DIM={hd} PANEL_COLS={pc}"
    assert (banks.swizzled_offset(rows, cols, 64, hd) == config.swizzled_offset(rows, cols, 64, hd)).all()
    with pytest.raises(ValueError, match="panel_cols=48"):
        banks.swizzled_offset(0, 0, 64, hd, 48)


def _slow_fwd_sm90_walk(cfg, batch, heads, sq, sk, head_dim):
    """Every CTA, key tile, warp and lane of fwd_sm90_kernel (cuda/fwd_sm90.cuh), literally: the thread
    instructions, and the wgmma operand bytes (per key tile and warpgroup: its 64 Q rows and K for S,
    V for O)."""
    tot, wgmma = _Totals(), 0
    hd, bm, bn, threads = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.threads
    q_bytes, kv_bytes = bm * hd * 2, bn * hd * 2
    for _ in range(batch * heads):
        for m_block in range(-(-sq // bm)):
            row0 = m_block * bm
            rows_q = min(bm, sq - row0)
            n_blocks = _n_blocks(cfg.causal, row0, rows_q, sq, sk, bn)
            if n_blocks <= 0:
                continue
            tot.copy(threads, bm, hd, 0)
            for it in range(n_blocks):
                tot.copy(threads, bn, hd, q_bytes + (it % 2) * kv_bytes)
                tot.copy(threads, bn, hd, q_bytes + (2 + it % 2) * kv_bytes)
                for _wg in range(bm // 64):
                    wgmma += (64 * hd + bn * hd) * 2 + bn * hd * 2
            for w in range(threads // 32):  # O staging: rows 16w + g (+8), columns dt*8 + 2t
                for h in range(2):
                    for dt in range(hd // 8):
                        tot.st_acc(0, bm, hd, w * 16 + 8 * h, dt * 8)
            tot.copy(threads, bm, hd, 0, store=True, rows_valid=rows_q, cols_valid=head_dim)
    return tot, wgmma


@pytest.mark.parametrize("hd,causal,sq,sk,head_dim", [(64, True, 200, 300, 64), (96, False, 130, 70, 80),
                                                      (128, True, 150, 300, 120), (256, False, 70, 40, 256),
                                                      (32, True, 300, 129, 24)])
def test_fwd_sm90_walk_equals_instruction_by_instruction_enumeration(hd, causal, sq, sk, head_dim):
    cfg = config.fwd_sm90_config(hd, "fp16", causal)
    walk = banks.fwd_kernel_shared(cfg, 1, 2, sq, sk, head_dim)
    tot, wgmma = _slow_fwd_sm90_walk(cfg, 1, 2, sq, sk, head_dim)
    _check(walk, tot, f"{cfg.cpp_name()} sq={sq} sk={sk}")
    assert walk.wgmma_read_bytes == wgmma, f"wgmma operand bytes of {cfg.cpp_name()}"
    assert walk.read_bytes == walk.thread_read_bytes + wgmma


def _slow_bwd_sm90_walk(cfg, batch, heads, sq, sk, head_dim):
    """Every CTA, query block, warp and lane of bwd_sm90_kernel (cuda/bwd_sm90.cuh), literally, with the
    offsets of BwdSm90Traits written out here; wgmma operand bytes per visit and warpgroup: its 64 K and
    V rows, Q and dO twice (S^T / dP^T, then dV / dK), dS^T and its DQ_COLS columns of K for dQ."""
    tot, wgmma = _Totals(), 0
    hd, bm, bn, threads, det = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.threads, cfg.deterministic
    warpgroups = bn // 64
    dq_cols = hd // warpgroups
    pc = 64 if dq_cols % 64 == 0 else 32  # BwdSm90Traits::PANEL_COLS (K, V, Q, dO; dS^T keeps the default)
    smem_q, smem_kv, smem_ds, rowvec = bm * hd * 2, bn * hd * 2, bn * bm * 2, bm * 4
    off_k, off_v, off_q, off_do = 0, smem_kv, 2 * smem_kv, 2 * smem_kv + smem_q
    off_ds = 2 * smem_kv + 4 * smem_q
    off_lse, off_delta = off_ds + smem_ds, off_ds + smem_ds + rowvec
    diag = sk - sq

    def load_query_block(stage):
        tot.copy(threads, bm, hd, off_q + stage * 2 * smem_q, pc=pc)
        tot.copy(threads, bm, hd, off_do + stage * 2 * smem_q, pc=pc)
        chunks = bm // 4
        for w in range(threads // 32):
            lanes = []
            for lane in range(32):
                tid = 32 * w + lane
                is_delta = tid >= chunks
                c = tid - chunks if is_delta else tid
                lanes.append((off_delta if is_delta else off_lse) + stage * 2 * rowvec + c * 16
                             if tid < 2 * chunks else None)
            tot.issue("LDGSTS", "cp.async16", lanes)

    for _ in range(batch * heads):
        for n_block in range(-(-sk // bn)):
            n0 = n_block * bn
            keys = min(bn, sk - n0)
            m_begin = max(0, n0 - diag) // bm if cfg.causal else 0
            m_end = -(-sq // bm)
            if m_begin >= m_end:
                continue
            tot.copy(threads, bn, hd, off_k, pc=pc)
            tot.copy(threads, bn, hd, off_v, pc=pc)
            load_query_block(0)
            stage = 0
            for m_block in range(m_begin, m_end):
                if m_block + 1 < m_end:
                    load_query_block(stage ^ 1)
                for w in range(threads // 32):  # float2 lse_log2, then float2 delta, per n8 query tile
                    for vec in (off_lse, off_delta):
                        for qt in range(bm // 8):
                            tot.issue("LDS", "ld64", [vec + stage * 2 * rowvec + (qt * 8 + 2 * (l & 3)) * 4
                                                      for l in range(32)])
                if not det:
                    for w in range(threads // 32):
                        key_row0 = (w // 4) * 64 + (w % 4) * 16
                        for kk in range(bm // 16):
                            for r in range(4):
                                tot.st_acc(off_ds, bn, bm, key_row0 + (r & 1) * 8, kk * 16 + (r >> 1) * 8)
                for _wg in range(warpgroups):
                    wgmma += 2 * (64 + bm) * hd * 2 + 2 * bm * hd * 2 + (0 if det else (bn * bm + bn * dq_cols) * 2)
                stage ^= 1
            for w in range(threads // 32):
                key_row0 = (w // 4) * 64 + (w % 4) * 16
                for h in range(2):
                    for dt in range(hd // 8):
                        tot.st_acc(off_k, bn, hd, key_row0 + 8 * h, dt * 8, pc)
                        tot.st_acc(off_v, bn, hd, key_row0 + 8 * h, dt * 8, pc)
            tot.copy(threads, bn, hd, off_k, store=True, rows_valid=keys, cols_valid=head_dim, pc=pc)
            tot.copy(threads, bn, hd, off_v, store=True, rows_valid=keys, cols_valid=head_dim, pc=pc)
    return tot, wgmma


@pytest.mark.parametrize("hd,causal,det,sq,sk", [(64, False, False, 100, 150), (64, True, True, 150, 100),
                                                 (128, True, False, 70, 200), (128, False, True, 130, 70)])
def test_bwd_sm90_walk_equals_instruction_by_instruction_enumeration(hd, causal, det, sq, sk):
    cfg = config.bwd_sm90_config(hd, "bf16", causal, det)
    head_dim = hd - 8
    walk = banks.bwd_kernel_shared(cfg, 1, 2, sq, sk, head_dim)
    tot, wgmma = _slow_bwd_sm90_walk(cfg, 1, 2, sq, sk, head_dim)
    _check(walk, tot, f"{cfg.cpp_name()} sq={sq} sk={sk}")
    assert walk.wgmma_read_bytes == wgmma, f"wgmma operand bytes of {cfg.cpp_name()}"
    assert banks.bwd_sm90_layout(cfg).smem_bytes == cfg.smem_bytes


@pytest.mark.parametrize("cfg", SM90_BWD, ids=_cfg_id)
def test_bwd_sm90_stores_and_vector_loads_are_conflict_free(cfg):
    """dS^T stores (each phase: 8 keys x 4 column pairs of one 16-byte chunk), dK/dV staging (64- and
    128-byte panels), the float2 lse_log2 / delta loads (2 wavefronts: the phases of a 64-bit access, 4
    distinct float2 broadcast per half-warp) and the lse/delta cp.async; no ldmatrix."""
    walk = banks.bwd_kernel_shared(cfg, 1, 2, 1024, 1024)
    m_begin, m_end = bwd_query_blocks(cfg, 1024, 1024)
    visits = 2 * int((m_end - m_begin).sum())
    for role in ("ds_store", "dk_store", "dv_store", "lse_load", "delta_load", "vec_load"):
        s = walk.roles[role]
        if role == "ds_store" and cfg.deterministic:
            assert s.instructions == 0, "the deterministic kernel stages no dS^T"
            continue
        assert s.instructions > 0 and s.conflicts == 0, f"{role} of {cfg.cpp_name()}: {s}"
    assert walk.roles["lse_load"].instructions == visits * cfg.num_warps * cfg.block_m // 8
    assert walk.roles["lse_load"].wavefronts == 2 * walk.roles["lse_load"].instructions
    ds_stores = 0 if cfg.deterministic else visits * cfg.num_warps * cfg.block_m // 4
    assert walk.roles["ds_store"].instructions == ds_stores
    assert walk.by_sass("LDSM").instructions == 0


@pytest.mark.parametrize("cfg", SM90_BWD_WS, ids=_cfg_id)
def test_bwd_sm90_ws_walk(cfg):
    """bwd_sm90_ws_kernel: its layout is the config's shared-memory size; every thread instruction conflict-free
    (the float2 lse / delta loads 2 wavefronts, the dQ buffer's 16-byte stores and store_tile's loads 4); per visit
    Q, dO through TMA (whole boxes) and lse_log2, delta by bulk copy, per live CTA K, V; the bulk reduction reads
    the dQ buffer once per visit; the wgmma operand reads and the dS^T / epilogue stores are bwd_sm90_kernel's
    (same tiles), and no guard LDS; cp.async and ldmatrix only for a staged bias (4 of each per consumer warp and
    visit, conflict-free: 32-byte rows whose halves swap in rows 4-7 of every 8). The dS^T and dQ roles are there
    unless deterministic, and deterministic on the ordered path (config.ordered_dq: the same reductions in a fixed
    order), as in bwd_sm90_kernel's default mode."""
    L = banks.bwd_sm90_ws_layout(cfg)
    assert L.smem_bytes == cfg.smem_bytes
    # kv_full, q_full[2], q_empty[2], dq_full, dq_empty right after the 2 stages of (lse_log2, delta), then the dQ
    # writer's 32-byte setup
    assert L.barriers == 7 and L.off_bar == L.off_lse + 2 * 2 * cfg.block_m * 4
    assert L.off_writer == L.off_bar + 8 * 7
    assert L.off_bias in (-1, -(-(L.off_bar + 8 * 7 + 32) // 128) * 128)
    no_dq = cfg.deterministic and not config.ordered_dq(cfg)  # dQ left to bwd_dq_kernel
    staged = config.bwd_stages_bias(cfg.head_dim, cfg.mods, cfg.causal)
    assert (L.off_bias >= 0) == staged and (not staged or L.off_bias % 128 == 0)
    walk = banks.bwd_kernel_shared(cfg, 1, 2, 1024, 1000)
    m_begin, m_end = bwd_query_blocks(cfg, 1024, 1000)
    n_visits = np.maximum(m_end - m_begin, 0)
    visits, ctas = 2 * int(n_visits.sum()), 2 * int((n_visits > 0).sum())
    assert walk.conflicts == 0 and walk.guard_lds == 0
    bias_instr = visits * 8 * cfg.block_m // 16 if staged else 0  # 4 copies and 4 x4 loads per warp and visit
    x2 = cfg.head_dim > 64  # 8 x2 loads instead
    assert walk.by_sass("LDGSTS").instructions == bias_instr
    assert walk.by_sass("LDSM").instructions == bias_instr * (2 if x2 else 1)
    if staged:
        for role, per in (("bias_stage", 4), ("bias_frag2", 2) if x2 else ("bias_frag", 4)):
            s = walk.roles[role]
            assert s.wavefronts == per * s.instructions and s.conflicts == 0, f"{role}: {s}"
    for role in ("lse_load", "delta_load"):
        s = walk.roles[role]
        assert s.instructions == visits * 8 * cfg.block_m // 8 and s.wavefronts == 2 * s.instructions
    for role in ("dk_read", "dv_read") + (() if no_dq else ("dq_store",)):
        s = walk.roles[role]
        assert s.instructions > 0 and s.wavefronts == 4 * s.instructions, f"{role}: {s}"
    dq = 0 if no_dq else visits * L.smem_dq
    assert walk.roles["dq_store"].instructions == (0 if no_dq else visits * 8 * L.dq_tiles)
    assert walk.roles["dq_store"].bytes == walk.bulk_read_bytes == dq
    assert walk.tma_write_bytes == visits * 2 * (L.base.smem_q + L.base.rowvec) + ctas * 2 * L.base.smem_kv
    # dS^T by stmatrix.x4: one per 16 keys x 16 queries, 4 conflict-free wavefronts each
    ds = walk.roles["ds_store"]
    assert ds.instructions == (0 if no_dq else visits * 8 * cfg.block_m // 16), ds
    assert ds.wavefronts == 4 * ds.instructions and ds.conflicts == 0 and ds.bytes == 512 * ds.instructions
    if cfg.block_m == 64:  # bwd_sm90_kernel with dQ as this kernel's: its default mode on the ordered path
        twin = dataclasses.replace(cfg.sync_equivalent(), deterministic=no_dq)
        sync = banks.bwd_kernel_shared(twin, 1, 2, 1024, 1000)
        for role in ("st_wgmma", "dpt_wgmma", "dv_wgmma", "dk_wgmma", "dk_store", "dv_store"):
            assert walk.roles[role] == sync.roles[role], role
        assert ds.bytes == sync.roles["ds_store"].bytes  # the same dS^T, in 4x fewer instructions
        dq_gemm, sync_dq = walk.roles["dq_wgmma"], sync.roles["dq_wgmma"]
        if config.bwd_ws_dq_one_wg(cfg):
            # consumer 1 alone: 8 m64n128 wgmma a visit reading dS once (64 x 128) and all of K: 48 KB at head dim
            # 128 against the two consumers' 2 x 8 m64n64 reading 64 KB
            assert cfg.head_dim == 128 and not cfg.deterministic
            assert (dq_gemm.instructions, dq_gemm.bytes) == (visits * 8, visits * 128 * (64 + 128) * 2), dq_gemm
            assert (sync_dq.instructions, sync_dq.bytes) == (visits * 16, visits * 2 * 128 * (64 + 64) * 2), sync_dq
            assert walk.read_bytes == sync.read_bytes + dq + bias_instr * 512 - visits * 16384
        else:
            assert dq_gemm == sync_dq
            assert walk.read_bytes == sync.read_bytes + dq + bias_instr * 512
        return
    # 128-query steps (no synchronous twin): per visit and consumer (64 keys), S^T and dP^T read its 64 rows of K
    # (V) and all 128 rows of Q (dO) in HEAD_DIM / 16 wgmma each; dV and dK all 128 rows of dO (Q) in 8; dQ its 64
    # rows of dS (as dS^T's columns) and all of K in 8
    hd, e = cfg.head_dim, 2
    want = {"st_wgmma": (hd // 16, (64 + 128) * hd * e), "dpt_wgmma": (hd // 16, (64 + 128) * hd * e),
            "dv_wgmma": (8, 128 * hd * e), "dk_wgmma": (8, 128 * hd * e)}
    if not no_dq:
        want["dq_wgmma"] = (8, 128 * (64 + hd) * e)
    for role, (n, b) in want.items():
        s = walk.roles[role]
        assert (s.instructions, s.bytes) == (visits * 2 * n, visits * 2 * b), f"{role}: {s}"


@pytest.mark.parametrize("cfg", SM90_FWD[::2] + SM90_BWD, ids=_cfg_id)
def test_sm90_tile_copies(cfg):
    """128-byte panels: 4 wavefronts per cp.async and 16-byte store_tile load, conflict free, as in the
    mma.sync kernels; default 64-byte panels (forward d32, d96) too, with a cp.async band up to 2x.

    bwd_sm90_kernel at HEAD_DIM 64 gives its K, V, Q, dO tiles 64-byte panels (PANEL_COLS = 32, so that each
    warpgroup's 32 dQ columns of K start on a panel). Copied fixed-column (8 chunks per row), the 8 lanes of
    a phase would span two panels ROWS * 64 bytes apart, on the same 16 banks: 8 wavefronts per instruction
    (this walk found it); SmemTile::fixed_column now sends such tiles to the panel-order copy, 4."""
    is_bwd = isinstance(cfg, config.BwdSm90Config)
    walk = (banks.bwd_kernel_shared if is_bwd else banks.fwd_kernel_shared)(cfg, 1, 2, 1024, 1024)
    roles = ("k_load", "v_load", "q_load", "do_load", "dk_read", "dv_read") if is_bwd else \
        ("q_load", "k_load", "v_load", "o_read")
    for role in roles:
        s = walk.roles[role]
        assert s.wavefronts == 4 * s.instructions, f"{role} of {cfg.cpp_name()}: {s}"
        assert s.conflicts == 0, f"{role} of {cfg.cpp_name()}: {s}"
    if is_bwd and cfg.panel_cols < 64 <= cfg.head_dim:
        assert not banks.fixed_column(cfg.threads, cfg.block_n, cfg.head_dim, cfg.panel_cols)
        # what the fixed-column copy of the same tile would cost: one 128-byte row over two panels per phase
        rows, threads, cpr = cfg.block_n, cfg.threads, cfg.head_dim // 8
        tid = np.arange(threads).reshape(-1, 1, 32)
        r = tid // cpr + np.arange(rows * cpr // threads).reshape(1, -1, 1) * (threads // cpr)
        addrs = banks.swizzled_offset(r, (tid % cpr) * 8, rows, cfg.head_dim, cfg.panel_cols)
        assert banks.count_instructions(addrs, "ld128") == (8 * addrs.size // 32, 4 * addrs.size // 32)


@pytest.mark.parametrize("cfg", SM90_FWD[:4], ids=_cfg_id)
def test_guard_lds_of_the_sm90_forward(cfg):
    """fwd_sm90_kernel: as fwd_kernel, 3 predicated-off LDS per LDGSTS block per warp, plus 4 before the
    fence.proxy.async of every key tile (SASS of nvcc 13.0, sm_90a: `DEPBAR.LE SB0, 0x1; @!PT LDS RZ, [RZ]
    x 4; MEMBAR.ALL.CTA; FENCE.VIEW.ASYNC.S`)."""
    b, h, s = 1, 2, 640
    walk = banks.fwd_kernel_shared(cfg, b, h, s, s)
    n_begin, n_end = key_block_ranges(Problem(b, h, s, s, cfg.head_dim, cfg.dtype, cfg.causal), cfg.block_m,
                                      cfg.block_n)
    n = n_end - n_begin
    n = n[n > 0]
    q, kv = (cfg.block_m, cfg.head_dim), (cfg.block_n, cfg.head_dim)
    warps = cfg.threads // 32
    if banks.fixed_column(cfg.threads, *q) and banks.fixed_column(cfg.threads, *kv):
        copies = 3 * int(n.sum()) * warps
    else:
        blocks = lambda t: int(banks.copy_code_blocks(cfg.threads, *t).sum())  # noqa: E731
        copies = 3 * (len(n) * blocks(q) + int(n.sum()) * 2 * blocks(kv))
    assert walk.guard_lds == (copies + 4 * int(n.sum()) * warps) * b * h


@pytest.mark.parametrize("det", [False, True])
def test_guard_lds_of_the_sm90_backward(det):
    """bwd_sm90_kernel: the copies' guards as bwd_kernel (prologue: K, V one block, then the first query
    block's Q, dO a block of their own after its head's address arithmetic, lse/delta its own block run by
    warp 0; per later visit Q, dO and lse/delta), plus 4 per fence.proxy.async: after each visit's cp.async
    wait and, unless deterministic, after the dS^T stores (static SASS, nvcc 13.0)."""
    cfg = config.bwd_sm90_config(128, "fp16", False, det)
    sq = sk = 512
    walk = banks.bwd_kernel_shared(cfg, 1, 1, sq, sk)
    ctas, visits = sk // cfg.block_n, (sk // cfg.block_n) * (sq // cfg.block_m)
    per_visit_fences = 1 if det else 2
    want = ctas * (6 * cfg.num_warps + 3) + (visits - ctas) * (3 * cfg.num_warps + 3) \
        + visits * per_visit_fences * 4 * cfg.num_warps
    assert walk.guard_lds == want


def test_wgmma_reads_are_counted_apart_from_thread_instructions():
    """The walk's shared reads are thread instructions (ncu's LDS/LDSM counters) plus the tensor core's
    operand reads: per key tile and warpgroup 64 Q rows + K for S, V for O."""
    cfg = config.fwd_sm90_config(128, "bf16", False)
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 1024, 1024)
    tiles = (1024 // cfg.block_m) * (1024 // cfg.block_n)
    wg = cfg.block_m // 64
    assert walk.wgmma_read_bytes == tiles * wg * (64 + 2 * cfg.block_n) * 128 * 2
    assert walk.thread_read_bytes == walk.by_sass("LDS").bytes == (1024 // cfg.block_m) * cfg.block_m * 128 * 2
    assert walk.conflicts == 0 and walk.roles["s_wgmma"].wavefronts == 0
    with pytest.raises(TypeError, match="FwdSm90Config"):
        banks.fwd_sm90_kernel_shared(config.fwd_config(128, "bf16", False), 1, 1, 64, 64)
    with pytest.raises(TypeError, match="BwdConfig or BwdSm90Config"):
        banks.bwd_kernel_shared(cfg, 1, 1, 64, 64)


@pytest.mark.parametrize("cfg", SM90_FWD[::2] + SM90_BWD, ids=_cfg_id)
def test_sm90_staging_stores_write_each_word_of_their_tile_once(cfg):
    """The 32-bit staging stores of one CTA (O into the Q tile; dS^T into its tile; dK, dV into the K, V
    tiles) write every 4-byte word of the tile exactly once: the accumulator layout of 16 rows per warp,
    g and g + 8, column pairs 2t, mapped through the tile's swizzle, is a permutation of the tile."""
    if isinstance(cfg, config.FwdSm90Config):
        addrs = banks.fwd_sm90_addresses(cfg, 0)
        tiles = {"o_store": (0, cfg.block_m * cfg.head_dim * 2)}
    else:
        L = banks.bwd_sm90_layout(cfg)
        addrs = banks.bwd_sm90_addresses(cfg, 0)
        tiles = {"dk_store": (L.off_k, L.smem_kv), "dv_store": (L.off_v, L.smem_kv)}
        if not cfg.deterministic:
            tiles["ds_store"] = (L.off_ds, L.smem_ds)
    for role, (base, nbytes) in tiles.items():
        a = np.sort(addrs[role][addrs[role] >= 0].ravel())
        assert (a == np.arange(base, base + nbytes, 4)).all(), f"{role} of {cfg.cpp_name()}"
