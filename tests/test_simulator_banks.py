"""Shared-memory bank rule (DESIGN.md section 6) and the walk over fwd_kernel's shared instructions."""
import numpy as np
import pytest

from cuflash import config
from cuflash.simulator import banks

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
    """DESIGN.md: one 128-byte line per 8 lanes costs 1 wavefront per 8 lanes in any order; one row
    per thread (16 B at a 128 B stride) 8x. 144-byte rows measured ~2.5x; the model gives 1.875x."""
    line_rows, chunks = LANES // 8, LANES % 8
    assert banks.count(banks.swizzled_offset(line_rows, chunks * 8, 128, 64), "cp.async16") == (4, 0)
    shuffled = np.random.default_rng(0).permutation(8)
    assert banks.count(line_rows * 128 + shuffled[chunks] * 16, "cp.async16") == (4, 0), "lane order must not matter"
    assert banks.count(banks.row_major_offset(LANES, 0, 64), "cp.async16")[0] == 8 * 4
    padded = sum(banks.count(banks.padded_offset(line_rows + 4 * i, chunks * 8, 64), "cp.async16")[0] for i in range(8))
    assert padded / (8 * 4) == pytest.approx(1.875), "padded-row model changed: update banks.py docs and IO_ANALYSIS.md"


@pytest.mark.parametrize("bad,kind,err", [
    (LANES * 4, "ld16", ValueError), (LANES[:31] * 4, "ld32", ValueError), (LANES * 4 + 2, "ld32", ValueError),
    (LANES * 8 + 4, "ld64", ValueError), (-LANES * 16, "ld128", ValueError), (LANES * 4.0, "ld32", TypeError),
])
def test_count_rejects_bad_input_with_a_message(bad, kind, err):
    with pytest.raises(err):
        banks.count(bad, kind)


# ---- the fwd_kernel walk ------------------------------------------------------------------

def _slow_walk(cfg, batch, heads, sq, sk, head_dim):
    """Every CTA, iteration, warp and lane in plain Python loops, with scalar swizzled_offset calls:
    the brief's description of fwd_kernel, restated independently of banks.fwd_addresses."""
    totals = {}

    def issue(sass, kind, lane_addrs):  # lane_addrs: 32 addresses, None = lane issues nothing
        wf, conf = banks.count_instructions(np.array([-1 if a is None else a for a in lane_addrs]), kind)
        t = totals.setdefault(sass, [0, 0, 0])
        t[0] += 1
        t[1] += wf
        t[2] += conf

    off = config.swizzled_offset
    threads, cpr = cfg.threads, cfg.head_dim // 8
    k_base = [cfg.smem_q_bytes + s * cfg.smem_kv_bytes for s in range(2)]
    v_base = [cfg.smem_q_bytes + 2 * cfg.smem_kv_bytes + s * cfg.smem_kv_bytes for s in range(2)]
    diag = sk - sq
    t_r = -(-sq // cfg.block_m)
    for _ in range(batch * heads):
        for m_block in range(t_r):
            row0 = m_block * cfg.block_m
            rows_q = min(cfg.block_m, sq - row0)
            n_blocks = -(-sk // cfg.block_n)
            if cfg.causal:
                col_last = row0 + rows_q - 1 + diag
                n_blocks = 0 if col_last < 0 else min(n_blocks, col_last // cfg.block_n + 1)
            if n_blocks <= 0:
                continue

            def copy(rows, base, valid_rows=None, valid_cols=None, sass="LDGSTS", kind="cp.async16"):
                for w in range(cfg.num_warps):
                    for i in range(-(-rows * cpr // threads)):
                        lanes_addr = []
                        for lane in range(32):
                            idx = w * 32 + lane + i * threads
                            r, c = idx // cpr, (idx % cpr) * 8
                            ok = idx < rows * cpr and (valid_rows is None or r < valid_rows) and \
                                (valid_cols is None or c < valid_cols)
                            lanes_addr.append(base + off(r, c, rows, cfg.head_dim) if ok else None)
                        if any(a is not None for a in lanes_addr):
                            issue(sass, kind, lanes_addr)

            copy(cfg.block_m, 0)
            for it in range(n_blocks):
                s = it % 2
                copy(cfg.block_n, k_base[s])
                copy(cfg.block_n, v_base[s])
                for w in range(cfg.num_warps):
                    wr0 = w * cfg.m_tiles_per_warp * 16
                    for kk in range(cfg.head_dim // 16):
                        for mt in range(cfg.m_tiles_per_warp):
                            lanes_addr = [off(wr0 + mt * 16 + (l & 15), kk * 16 + (l >> 4) * 8, cfg.block_m, cfg.head_dim)
                                          for l in range(32)]
                            issue("LDSM", "ldmatrix.x4", lanes_addr)
                        for np_ in range(cfg.block_n // 16):
                            lanes_addr = [k_base[s] + off(np_ * 16 + (l & 7) + ((l >> 4) << 3), kk * 16 + ((l >> 3) & 1) * 8,
                                                          cfg.block_n, cfg.head_dim) for l in range(32)]
                            issue("LDSM", "ldmatrix.x4", lanes_addr)
                    for kk in range(cfg.block_n // 16):
                        for dp in range(cfg.head_dim // 16):
                            lanes_addr = [v_base[s] + off(kk * 16 + (l & 7) + ((l >> 3) & 1) * 8, dp * 16 + (l >> 4) * 8,
                                                          cfg.block_n, cfg.head_dim) for l in range(32)]
                            issue("LDSM", "ldmatrix.x4", lanes_addr)
            for w in range(cfg.num_warps):
                wr0 = w * cfg.m_tiles_per_warp * 16
                for mt in range(cfg.m_tiles_per_warp):
                    for h in range(2):
                        for dt in range(cfg.head_dim // 8):
                            lanes_addr = [off(wr0 + mt * 16 + (l >> 2) + 8 * h, dt * 8 + 2 * (l & 3), cfg.block_m,
                                              cfg.head_dim) for l in range(32)]
                            issue("STS", "st32", lanes_addr)
            copy(cfg.block_m, 0, rows_q, head_dim, sass="LDS", kind="ld128")
    return totals


@pytest.mark.parametrize("hd,causal,sq,sk,head_dim", [(64, True, 200, 300, 64), (96, False, 130, 70, 80),
                                                      (256, True, 150, 40, 256), (32, False, 64, 129, 24)])
def test_walk_equals_instruction_by_instruction_enumeration(hd, causal, sq, sk, head_dim):
    cfg = config.fwd_config(hd, "fp16", causal)
    walk = banks.fwd_kernel_shared(cfg, 1, 2, sq, sk, head_dim)
    slow = _slow_walk(cfg, 1, 2, sq, sk, head_dim)
    for sass in ("LDGSTS", "LDSM", "STS", "LDS"):
        s = walk.by_sass(sass)
        assert (s.instructions, s.wavefronts, s.conflicts) == tuple(slow.get(sass, [0, 0, 0])), \
            f"{sass} totals differ for {cfg.cpp_name()} sq={sq} sk={sk} head_dim={head_dim}"


@pytest.mark.parametrize("cfg", config.all_fwd_configs(), ids=lambda c: f"hd{c.head_dim}-{c.dtype}-{'causal' if c.causal else 'full'}")
def test_fragment_loads_and_epilogue_stores_are_conflict_free(cfg):
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 1000, 1000)
    for role in ("q_frag", "k_frag", "v_frag", "o_store"):
        s = walk.roles[role]
        assert s.instructions > 0 and s.conflicts == 0, f"{role} of {cfg.cpp_name()}: {s.conflicts} bank conflicts"


@pytest.mark.parametrize("hd", [hd for hd in config.KERNEL_HEAD_DIMS if config.panel_cols(hd) == 64])
def test_tile_copies_with_128_byte_panels_are_conflict_free(hd):
    cfg = config.fwd_config(hd, "bf16", False)
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 512, 512)
    for role in ("q_load", "k_load", "v_load", "o_read"):
        s = walk.roles[role]
        assert s.wavefronts == 4 * s.instructions, f"{role} of HEAD_DIM={hd}: {s.wavefronts} wavefronts for {s.instructions} instructions"


def test_head_dim_96_tile_copies_conflict_two_way():
    """Finding (docs/IO_ANALYSIS.md): with 64-byte panels and 12 chunks per row, the 8 lanes of a phase
    cover chunks 0-3 of panel 0 and 0-3 of panel 1 of the same row, at equal offsets mod 128 bytes."""
    cfg = config.fwd_config(96, "fp16", False)
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 512, 512)
    o_read = walk.roles["o_read"]
    assert o_read.conflicts > 0, "HEAD_DIM=96 epilogue reads became conflict free: update docs/IO_ANALYSIS.md"


def test_shared_bytes_follow_from_the_instructions():
    cfg = config.fwd_config(64, "fp16", False)
    walk = banks.fwd_kernel_shared(cfg, 2, 3, 1024, 1024)
    t_r = t_c = 1024 // 128
    ctas, iters = 2 * 3 * t_r, 2 * 3 * t_r * t_c
    assert walk.write_bytes == ctas * (cfg.smem_q_bytes + cfg.smem_q_bytes) + iters * 2 * cfg.smem_kv_bytes, \
        "writes: Q copy and O staging once per CTA, K and V copies once per iteration"
    per_iter_ldsm = cfg.num_warps * ((cfg.head_dim // 16) * (1 + cfg.block_n // 16) + (cfg.block_n // 16) * (cfg.head_dim // 16))
    assert walk.by_sass("LDSM").instructions == iters * per_iter_ldsm
    assert walk.read_bytes == iters * per_iter_ldsm * 512 + ctas * cfg.smem_q_bytes
