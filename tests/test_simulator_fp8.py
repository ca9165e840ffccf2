"""The FP8 (e4m3) forward (cuda/fwd_sm90_fp8.cuh, fwd_sm90_fp8_kernel) in the analyzer: 1-byte Q, K, V, a bf16 O,
float32 lse and descale factors, fwd_sm90_ws_kernel's schedule on the config's tiles (BLOCK_M = 64 per consumer
warpgroup: 128, or 192 with three), and V
transposed in shared memory every key tile (ldmatrix.x4.trans, stmatrix.x4), Q loaded into registers once per CTA
where the config says q_in_regs. Its counts against a closed form (aligned problems) and a hand loop over CTAs
(tails, Sq != Sk, rows without keys), the transpose's and the Q loads' addresses against literal ports of the
kernel (whose data movement, run byte by byte, gives V^T in fp8_key_of order and Q's A fragments), its K/V traffic
against the 16-bit kernel's, and what it refuses."""
import dataclasses

import numpy as np
import pytest

from cuflash import config as C
from cuflash.simulator import Problem, banks, simulate
from cuflash.simulator.model import DTYPE_BYTES
from cuflash.simulator.schedules import cuflash_config, key_block_ranges
from cuflash.simulator.strategies import kernel_name

E8, E16, F32 = 1, 2, 4  # e4m3 (Q, K, V), bf16 (O), float32 (lse, descale factors)
QB = 128  # rows per block descale factor (cuda/fwd_sm90_fp8.cuh QUANT_BLOCK_ROWS)


def cfg_of(d, causal=False, sk=None):
    """The library's FP8 forward config for head dim d and sk keys (FWD_SM90_FP8_TILES, FWD_SM90_FP8_TILES_BANDED when
    causal with at most FWD_SM90_FP8_CAUSAL_LONG_KEYS keys; sk None: short)."""
    return C.fwd_sm90_fp8_config(d, "bf16", causal, seqlen_k=sk)


def bn_of(d, causal=False, sk=None):
    """Keys per K/V tile."""
    return cfg_of(d, causal, sk).block_n


def bm_of(d, causal=False, sk=None):
    """Query rows per CTA: 64 per consumer warpgroup."""
    return cfg_of(d, causal, sk).block_m


def q_in_regs_of(d, causal=False, sk=None):
    """Whether the consumers hold Q in registers."""
    return cfg_of(d, causal, sk).q_in_regs


def q_floats(row0, rows, consumers):
    """q descale factors one CTA reads: each consumer warpgroup the factor of its first row's 128-row block, or of the
    CTA's last row when it has none (fwd_fp8_consumer's q_block); distinct floats."""
    return len({(row0 + min(64 * w, rows - 1)) // QB for w in range(consumers)})


def closed_form(b, h, n, d, causal):
    """Sq = Sk = n, a multiple of BM (128 or 192: 64 per consumer warpgroup, W of them) and of 128; key tiles of BN rows
    (BN divides 128). T = n / BM CTAs per (batch, head), each visits n / BN key tiles (causal: CTA m visits
    ceil((m + 1) BM / BN)), V = the visits summed over CTAs; q = 1 with Q in registers, else 0; F = the q descale
    factors a CTA reads (1 with two consumers; 2 with three: its 192 rows span two 128-row blocks). Per (batch, head):
      HBM read   n D (Q) + 2 BN D V (K, V per visit) + 4 (F T + 2 V) (descale: q's per CTA, k's and v's per visit)
      HBM write  n (2 D + 4) (O in bf16, lse)
      SRAM write BM D T (Q by TMA) + V (2 BN D + BN D) (K, V by TMA; V^T by the transposers)
      SRAM read  q BM D T (Q by the consumers' ldmatrix, once per CTA)
                 + V (BN D + W ((1 - q) 64 + BN) D + W D BN) (V by the transposers; per consumer S = Q K^T, its Q
                 rows from shared memory only without Q in registers, and O += P V)
      FLOPs      4 BM BN D V"""
    cfg = cfg_of(d, causal, n)
    bm, bn, w, q = cfg.block_m, cfg.block_n, cfg.consumers, int(cfg.q_in_regs)
    assert n % bm == 0 and n % QB == 0, "the closed form is of aligned problems"
    t, f = n // bm, 1 if w == 2 else 2
    v = sum(-(-(m + 1) * bm // bn) for m in range(t)) if causal else t * (n // bn)
    return {k: b * h * x for k, x in dict(
        read=n * d * E8 + 2 * bn * d * E8 * v + F32 * (f * t + 2 * v),
        write=n * (d * E16 + F32),
        sram_write=bm * d * E8 * t + v * (2 * bn * d * E8 + bn * d * E8),
        sram_read=q * bm * d * E8 * t + v * (bn * d * E8 + w * ((1 - q) * 64 + bn) * d * E8 + w * d * bn * E8),
        flops=4 * bm * bn * d * v, visits=v).items()}


def set_q_in_regs(monkeypatch, d, q_in_regs):
    """The library's FP8 tiles for d with q_in_regs set (the other fields as shipped), banded ones too."""
    for table in (C.FWD_SM90_FP8_TILES, C.FWD_SM90_FP8_TILES_BANDED, C.FWD_SM90_FP8_TILES_SHORT,
                  C.FWD_SM90_FP8_TILES_CAUSAL_SHORT):
        if d in table:
            bn, stages, pingpong, _, *rest = table[d]
            monkeypatch.setitem(table, d, (bn, stages, pingpong, q_in_regs, *rest))


def hand_counts(b, h, sq, sk, d, causal):
    """fwd_sm90_fp8_kernel by hand, one loop over CTAs (no analyzer helper): CTA m_block sees key tiles n_end - 1 .. 0,
    n_end = ceil(Sk / BN), causal: min(that, (last row + Sk - Sq) // BN + 1); a CTA without keys writes O and lse
    only. TMA reads in-bounds rows and writes whole boxes; the transposers read V and write V^T, whole tiles; with Q
    in registers the consumers read all BM Q rows once per CTA and S = Q K^T reads only K."""
    cfg = cfg_of(d, causal, sk)
    bm, bn, w, q = cfg.block_m, cfg.block_n, cfg.consumers, int(cfg.q_in_regs)
    out = dict(read=0, write=0, q_read=0, kv_read=0, descale=0, tma=0, transpose=0, q_frag=0, wgmma=0, flops=0)
    for m_block in range(-(-sq // bm)):
        row0 = m_block * bm
        rows = min(bm, sq - row0)
        n_end = -(-sk // bn)
        if causal:
            last = row0 + rows - 1 + sk - sq
            n_end = 0 if last < 0 else min(n_end, last // bn + 1)
        out["write"] += rows * (d * E16 + F32)
        if n_end <= 0:
            continue
        keys = min(n_end * bn, sk)  # the last tile may reach past Sk: TMA zero-fills, nothing read
        out["q_read"] += rows * d * E8
        out["kv_read"] += 2 * keys * d * E8
        descale = F32 * (q_floats(row0, rows, w) + 2 * n_end)  # q's once, k's and v's per key tile
        out["descale"] += descale
        out["read"] += rows * d * E8 + 2 * keys * d * E8 + descale
        out["tma"] += bm * d * E8 + n_end * 2 * bn * d * E8
        out["transpose"] += n_end * bn * d * E8  # V read once and V^T written once
        out["q_frag"] += q * bm * d * E8  # Q into registers, once per CTA
        out["wgmma"] += n_end * w * (((1 - q) * 64 + bn) * d + d * bn) * E8  # per consumer: (Q rows and) K; V^T
        out["flops"] += n_end * 4 * bm * bn * d
    return {k: v * b * h for k, v in out.items()}


def test_fp8_element_sizes():
    p = Problem(1, 1, 256, 256, 128, "fp8")
    assert (DTYPE_BYTES["fp8"], p.elem_bytes, p.out_bytes, p.stat_bytes) == (1, 1, 2, 4), \
        "e4m3 Q, K, V; O in bf16; lse in float32"
    assert [Problem(1, 1, 8, 8, 64, dt).out_bytes for dt in ("fp16", "bf16", "fp32", "fp64")] == [2, 2, 4, 8], \
        "every other dtype writes O in its own element"


def test_the_shipped_tiles():
    """The tile tables the closed forms read: (block_n, stages, pingpong, q_in_regs, late_pack, consumers[, persistent])
    per head dim: the one-item grid's for long non-causal rows, the persistent grid's for short non-causal rows and
    (with a work queue) for causal rows and windows at d64 and d128; three consumer warpgroups at d64 but on causal
    rows of at most 1k keys (late_pack and pingpong move work within and between consumers, not traffic; the
    persistent grid walks the same tiles); the analyzer counts the config it names."""
    assert C.FWD_SM90_FP8_TILES == {64: (128, 2, False, False, True, 3), 128: (128, 2, True, False, False, 2),
                                    256: (128, 2, True, False, False, 2)}
    assert C.FWD_SM90_FP8_TILES_BANDED == {64: (128, 2, False, False, True, 3, True),
                                           128: (128, 2, False, False, True, 2, True),
                                           256: (128, 2, False, False, True, 2)}
    # FwdFp8Traits::WIDE_CONSUMERS (240-register consumers, the transposers' units by key group): head dim 256 only
    assert [C.fwd_sm90_fp8_config(d, "bf16", c).wide_consumers for d in (64, 128, 256) for c in (False, True)] == \
        [False, False, False, False, True, True]
    # non-causal rows of up to FWD_SM90_FP8_SHORT_KEYS keys: the persistent grid at head dims 64 and 128
    assert C.FWD_SM90_FP8_TILES_SHORT == {64: (128, 2, False, False, True, 3, True),
                                          128: (128, 2, False, False, True, 2, True)}
    assert C.FWD_SM90_FP8_SHORT_KEYS == 4096
    # causal rows of at most FWD_SM90_FP8_CAUSAL_LONG_KEYS keys at d64: two consumers (on the queue too)
    assert C.FWD_SM90_FP8_TILES_CAUSAL_SHORT == {64: (128, 2, False, False, True, 2, True)}
    assert C.FWD_SM90_FP8_CAUSAL_LONG_KEYS == {64: 1024}
    short = {**C.FWD_SM90_FP8_TILES, **C.FWD_SM90_FP8_TILES_SHORT}
    causal_short = {**C.FWD_SM90_FP8_TILES_BANDED, **C.FWD_SM90_FP8_TILES_CAUSAL_SHORT}
    for d in C.FWD_SM90_FP8_TILES:
        banded = C.FWD_SM90_FP8_TILES_BANDED
        for causal, sk, table in ((False, 256, short), (False, 4096, short), (False, 4097, C.FWD_SM90_FP8_TILES),
                                  (True, 256, causal_short), (True, 1024, causal_short), (True, 1025, banded),
                                  (True, 1 << 20, banded)):
            cfg = cuflash_config(Problem(1, 1, 256, sk, d, "fp8", causal))
            got = (cfg.block_n, cfg.stages, cfg.pingpong, cfg.q_in_regs, cfg.late_pack, cfg.consumers)
            assert got + ((True,) if cfg.persistent else ()) == table[d], f"d{d} causal={causal} sk={sk}"
            assert cfg.block_m == 64 * cfg.consumers
            assert cfg.uses_queue(False) == (causal and cfg.persistent), f"d{d} causal={causal} sk={sk}"
    for d in C.FWD_SM90_FP8_TILES:  # a window: the banded tiles at every length, on the queue where persistent
        for sk in (256, 4096, 1 << 20):
            windowed = cuflash_config(Problem(1, 1, 256, sk, d, "fp8", False, window=(256, 0)))
            got = (windowed.block_n, windowed.stages, windowed.pingpong, windowed.q_in_regs, windowed.late_pack,
                   windowed.consumers)
            assert got + ((True,) if windowed.persistent else ()) == C.FWD_SM90_FP8_TILES_BANDED[d], (d, sk)
            lib = C.fwd_sm90_fp8_config(d, "bf16", False, True, seqlen_k=sk)  # (the analyzer's copy drops the flag)
            assert lib.window and lib.uses_queue(False) == lib.persistent, (d, sk)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [384, 1536, 4608])
@pytest.mark.parametrize("q_in_regs", [False, True])
def test_counts_equal_the_closed_form(d, causal, n, q_in_regs, monkeypatch):
    """Both settings of q_in_regs at every head dim (the shipped one among them)."""
    set_q_in_regs(monkeypatch, d, q_in_regs)
    b, h = 2, 3
    want = closed_form(b, h, n, d, causal)
    c = simulate("cuflash", Problem(b, h, n, n, d, "fp8", causal))
    cfg = f"d{d} N{n} causal={causal} q_in_regs={q_in_regs}"
    assert (c.block_m, c.block_n) == (bm_of(d, causal, n), bn_of(d, causal, n)), cfg
    assert c.hbm_read_bytes == want["read"], f"HBM reads for {cfg}: {c.hbm_read_bytes} != {want['read']}"
    assert c.hbm_write_bytes == want["write"], f"HBM writes for {cfg}: {c.hbm_write_bytes} != {want['write']}"
    assert c.sram_write_bytes == want["sram_write"], f"SRAM writes for {cfg}: {c.sram_write_bytes}"
    assert c.sram_read_bytes == want["sram_read"], f"SRAM reads for {cfg}: {c.sram_read_bytes}"
    assert c.flops_matmul == want["flops"], f"FLOPs for {cfg}"
    assert c.flops_useful == 4 * d * b * h * (n * (n + 1) // 2 if causal else n * n), cfg
    # the transpose and the Q loads are conflict-free at every head dim (test_transpose_banks, test_q_loads)
    assert c.bank_conflicts == 0, f"bank conflicts for {cfg}: {c.bank_conflicts}"


def test_b1_h1_n256_d128_by_the_numbers():
    """B=1 H=1 N=256 D=128, non-causal, 128-key tiles: 2 CTAs of 128 rows, each Q once and 2 key tiles of K and V."""
    p = Problem(1, 1, 256, 256, 128, "fp8")
    cfg = cuflash_config(p)
    assert isinstance(cfg, C.FwdSm90Fp8Config) and cfg.block_n == 128
    c = simulate("cuflash", p)
    q_bytes = 256 * 128  # 32,768: Q once
    kv_bytes = 2 * 2 * 256 * 128  # 131,072: 2 CTAs x (K and V of 256 keys)
    assert c.hbm_read_bytes == q_bytes + kv_bytes + 2 * (1 + 2 * 2) * 4 == 163_880
    assert c.hbm_write_bytes == 256 * 128 * 2 + 256 * 4 == 66_560  # O bf16, lse
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 256, 256)
    assert walk.tma_write_bytes == q_bytes + kv_bytes == 163_840  # no tail: what TMA writes is what it reads
    assert walk.by_sass(banks.TMA_CLASS).instructions == 2 * (1 + 2 * 2)  # one 128-byte box per tile
    # the transpose: per key tile 8 groups x 4 pairs of 16-byte chunks = 32 units, one ldmatrix.x4 and one
    # stmatrix.x4 (512 bytes) each, 4 wavefronts (one per matrix)
    assert walk.roles["v_read"].bytes == walk.roles["vt_store"].bytes == 4 * 128 * 128 == 65_536
    assert (walk.roles["v_read"].instructions, walk.roles["vt_store"].instructions) == (4 * 32, 4 * 32)
    assert walk.by_sass("LDSM").wavefronts == walk.by_sass("STSM").wavefronts == 4 * 4 * 32
    assert walk.roles["q_frag"].instructions == 0, "d128 reads Q through the S wgmma's descriptor"
    assert walk.wgmma_read_bytes == 4 * 2 * ((64 + 128) * 128 + 128 * 128) == 327_680
    assert walk.roles["s_wgmma"].instructions == 4 * 2 * 128 // 32  # k32 per instruction
    assert c.sram_write_bytes == 163_840 + 65_536 and c.sram_read_bytes == 327_680 + 65_536
    assert c.bank_conflicts == 0 and walk.guard_lds == 4 * 3 * banks.FENCE_GUARD_LDS


def test_b1_h1_n384_d64_three_consumers_by_the_numbers():
    """B=1 H=1 N=384 D=64, non-causal: three consumer warpgroups, 2 CTAs of 192 rows (Q through the S wgmma's
    descriptor), each Q once and 3 key tiles of K and V; q descale factors: rows 0-191 span blocks 0 and 1, rows
    192-383 blocks 1 and 2, two floats per CTA."""
    p = Problem(1, 1, 384, 384, 64, "fp8")
    cfg = cuflash_config(p)
    assert (cfg.consumers, cfg.block_m, cfg.block_n, cfg.q_in_regs, cfg.pingpong) == (3, 192, 128, False, False)
    c = simulate("cuflash", p)
    q_bytes, kv_bytes = 384 * 64, 2 * 2 * 384 * 64  # Q once; 2 CTAs x (K and V of 384 keys)
    assert c.hbm_read_bytes == q_bytes + kv_bytes + (2 * 2 + 2 * 2 * 3) * 4 == 122_944
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 384, 384)
    assert walk.roles["q_frag"].instructions == 0
    assert walk.roles["s_wgmma"].bytes == 6 * 3 * (64 + 128) * 64 == 221_184  # 6 key tiles x 3 consumers x (Q, K)
    assert walk.roles["o_wgmma"].bytes == 6 * 3 * 64 * 128 == 147_456
    assert c.sram_write_bytes == q_bytes + kv_bytes + 6 * 128 * 64 and c.bank_conflicts == 0


def test_b1_h1_n256_d64_q_in_registers_by_the_numbers(monkeypatch):
    """B=1 H=1 N=256 D=64 with a window wider than the sequence on two consumers with Q in registers (the banded
    tiles until 2026-12-01, set here): each of the 2 CTAs' 8 consumer warps loads its 16 Q rows with one ldmatrix.x4
    per k32 step (2), so Q is read from shared memory once per CTA; S = Q K^T then reads only K."""
    monkeypatch.setitem(C.FWD_SM90_FP8_TILES_BANDED, 64, (128, 2, True, True, True, 2))
    p = Problem(1, 1, 256, 256, 64, "fp8", False, (256, 256))
    cfg = cuflash_config(p)
    assert cfg.q_in_regs and cfg.block_n == 128 and cfg.consumers == 2
    walk = banks.fwd_kernel_shared(cfg, 1, 1, 256, 256)
    q_frag = walk.roles["q_frag"]
    assert (q_frag.instructions, q_frag.bytes, q_frag.wavefronts) == (2 * 8 * 2, 256 * 64, 2 * 8 * 2 * 4)
    assert walk.roles["s_wgmma"].bytes == 4 * 2 * 128 * 64 == 65_536  # 4 key tiles x 2 consumers x K
    assert walk.roles["o_wgmma"].bytes == 4 * 2 * 64 * 128 == 65_536
    assert (walk.roles["v_read"].instructions, walk.roles["vt_store"].instructions) == (4 * 16, 4 * 16)
    c = simulate("cuflash", p)
    assert c.sram_read_bytes == 16_384 + 65_536 + 65_536 + 4 * 128 * 64 == 180_224 and c.bank_conflicts == 0


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(256, 256), (1000, 1500), (1500, 1000), (1, 239), (513, 128)])
def test_counts_equal_the_hand_loop(d, causal, sq, sk):
    """Tails (Q and the last K/V box partly out of bounds: in-bounds rows read, whole boxes written), causal
    skipping and CTAs that see no key (causal, Sq > Sk)."""
    b, h = 2, 3
    want = hand_counts(b, h, sq, sk, d, causal)
    p = Problem(b, h, sq, sk, d, "fp8", causal)
    c = simulate("cuflash", p)
    assert (c.hbm_read_bytes, c.hbm_write_bytes) == (want["read"], want["write"]), p
    assert c.flops_matmul == want["flops"], p
    walk = banks.fwd_kernel_shared(cuflash_config(p), b, h, sq, sk)
    assert walk.tma_write_bytes == want["tma"], p
    assert (walk.roles["v_read"].bytes, walk.roles["vt_store"].bytes) == (want["transpose"],) * 2, p
    assert walk.wgmma_read_bytes == want["wgmma"], p
    assert walk.roles["q_frag"].bytes == want["q_frag"], p
    assert c.sram_write_bytes == want["tma"] + want["transpose"], p
    assert c.sram_read_bytes == want["wgmma"] + want["transpose"] + want["q_frag"], p


def key_of(p: int) -> int:
    """fp8_key_of of cuda/fwd_sm90_fp8.cuh, as written there."""
    return 2 * (p >> 2) + (p & 3) if (p & 3) < 2 else 6 + 2 * (p >> 2) + (p & 3)


def smem_tile_offset(row: int, col: int, rows: int, cols: int) -> int:
    """SmemTile<rows, cols>::offset of cuda/tiles.cuh (16-bit elements), as written there."""
    panel_cols = 64 if cols % 64 == 0 else 32
    panel_bytes = panel_cols * 2
    off = row * panel_bytes + (col % panel_cols) * 2
    off ^= ((off >> 7) & (7 if panel_bytes == 128 else 3)) << 4
    return (col // panel_cols) * rows * panel_bytes + off


def transpose_units(d: int, bn: int, wide: bool = False):
    """Fp8Transposer over one tile, literally: per transposer warp (0..2) its units in program order, each as
    (warp, ldmatrix.x4.trans lane addresses, stmatrix.x4 lane addresses). Warp w takes units w, w + 3, ...; `wide`
    (FwdFp8Traits::WIDE_CONSUMERS) the 16-key groups h = w, w + 3, ..., each in chunk pairs a of its 128-byte
    panels, both panels of a pair in a row (c0 = 2 a + 8 panel)."""
    pairs = d // 32
    out = []
    for warp in range(3):
        if wide:
            hc0 = [(h, 2 * a + 8 * panel) for h in range(warp, bn // 16, 3) for a in range(4)
                   for panel in range(pairs // 4)]
        else:
            hc0 = [(u // pairs, 2 * (u % pairs)) for u in range(warp, (bn // 16) * pairs, 3)]
        for h, c0 in hc0:
            loads = [smem_tile_offset(16 * h + (lane & 15), 8 * (c0 + (lane >> 4)), bn, d // 2) for lane in range(32)]
            stores = []
            for lane in range(32):
                i, m = lane & 7, lane >> 3
                row = 16 * (c0 + (m >> 1)) + 2 * i + (1 if (i >= 4) != ((m & 1) != 0) else 0)
                stores.append(smem_tile_offset(row, 8 * h, d, bn // 2))
            out.append((warp, loads, stores))
    return out


def q_loads(d: int, bm: int):
    """The Q_IN_REGS loads of fwd_fp8_consumer, literally: per consumer warp (0 .. bm / 16 - 1) and k32 step kk, the
    ldmatrix.x4 lane addresses."""
    return [[smem_tile_offset(warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), 16 * kk + 8 * (lane >> 4), bm, d // 2)
             for lane in range(32)] for warp in range(bm // 16) for kk in range(d // 32)]


def ldmatrix_x4(smem, addrs, trans: bool):
    """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (PTX ISA "ldmatrix"): lanes 8m..8m+7 give the row addresses of
    matrix m (8 rows of 8 16-bit elements); lane (g = L / 4, t = L % 4) gets in r[m] elements (g, 2t), (g, 2t + 1) of
    matrix m, with .trans (2t, g), (2t + 1, g), the first in the low half. Returns r per lane."""
    def elem(m, row, col):
        a = addrs[8 * m + row] + 2 * col
        return smem[a] | smem[a + 1] << 8
    regs = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        pairs = [(elem(m, 2 * t, g), elem(m, 2 * t + 1, g)) if trans else (elem(m, g, 2 * t), elem(m, g, 2 * t + 1))
                 for m in range(4)]
        regs.append([lo | hi << 16 for lo, hi in pairs])
    return regs


def stmatrix_x4(smem, addrs, regs):
    """stmatrix.sync.aligned.m8n8.x4.shared.b16: lane (g, t)'s r[m] lands at row g, columns 2t, 2t + 1 of matrix m."""
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for m in range(4):
            a = addrs[8 * m + g] + 4 * t
            smem[a:a + 4] = regs[lane][m].to_bytes(4, "little")


def prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 (default mode): byte k of the result = byte (sel >> 4k) & 7 of {b, a}, a bytes 0-3."""
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(src[(sel >> 4 * k) & 7] for k in range(4)), "little")


def wavefronts(instr: dict, bytes_per_lane: int) -> int:
    """The bank rule of one warp instruction: phases of 128 / bytes_per_lane lanes (16 bytes: the 8 row addresses of
    one ldmatrix / stmatrix matrix), each costing the largest number of distinct 4-byte words one of the 32 banks
    serves."""
    per_phase, total = 128 // bytes_per_lane, 0
    for phase in range(32 // per_phase):
        words = {a // 4 + k for ln, a in instr.items() if ln // per_phase == phase for k in range(bytes_per_lane // 4)}
        total += max(sum(1 for w in words if w % 32 == bank) for bank in range(32)) if words else 0
    return total


@pytest.mark.parametrize("d", [64, 128, 256])
def test_transpose_walk_equals_the_literal_loop(d):
    """The vectorized transpose addresses and their bank costs equal a lane-by-lane port of Fp8Transposer (warp w
    takes units w, w + 3, ...); every V byte is read once and every V^T byte written once."""
    cfg = C.fwd_sm90_fp8_config(d, "bf16", False)
    units = transpose_units(d, cfg.block_n, wide=cfg.wide_consumers)
    addrs = banks.fwd_sm90_fp8_transpose_addresses(cfg)
    for role, k in (("v_read", 1), ("vt_store", 2)):
        got = [(w, [int(a) for a in row]) for w in range(3) for row in addrs[role][w] if (row >= 0).any()]
        assert got == [(u[0], u[k]) for u in units], f"d{d} {role}"
    tile = cfg.block_n * d
    for k in (1, 2):
        touched = sorted(a + j for u in units for a in u[k] for j in range(16))
        assert touched == list(range(tile)), f"d{d}: {'V' if k == 1 else 'V^T'} is not covered once"
    per_tile, _ = banks.fwd_sm90_fp8_cta_stats(cfg)[1]
    for role, k in (("v_read", 1), ("vt_store", 2)):
        assert per_tile[role].wavefronts == sum(wavefronts(dict(enumerate(u[k])), 16) for u in units), f"d{d} {role}"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_transpose_writes_v_transposed_in_key_order(d):
    """Run the literal port byte by byte (ldmatrix.x4.trans, two prmt per register pair, stmatrix.x4 with the
    even/odd interleave): V^T row r holds, at column p of 16-key group h, V[16 h + fp8_key_of(p), r]. So the walked
    addresses are the kernel's data movement, not only its footprint."""
    cfg = C.fwd_sm90_fp8_config(d, "bf16", False)
    bn = cfg.block_n
    v = np.random.default_rng(d).integers(0, 256, (bn, d), dtype=np.uint8)
    v_smem, vt_smem = bytearray(bn * d), bytearray(bn * d)
    for key in range(bn):
        for col in range(d):  # byte col of a row: 16-bit element col / 2, byte col % 2 of it
            v_smem[smem_tile_offset(key, col // 2, bn, d // 2) + col % 2] = v[key, col]
    for _, loads, stores in transpose_units(d, bn):
        r = ldmatrix_x4(v_smem, loads, trans=True)
        regs = []
        for lane in range(32):
            e0, o0 = prmt(r[lane][0], r[lane][1], 0x6420), prmt(r[lane][0], r[lane][1], 0x7531)
            e1, o1 = prmt(r[lane][2], r[lane][3], 0x6420), prmt(r[lane][2], r[lane][3], 0x7531)
            regs.append([o0, e0, o1, e1] if (lane >> 2) >= 4 else [e0, o0, e1, o1])
        stmatrix_x4(vt_smem, stores, regs)
    vt = np.array([[vt_smem[smem_tile_offset(row, col // 2, d, bn // 2) + col % 2] for col in range(bn)]
                   for row in range(d)], dtype=np.uint8)
    want = v[[16 * (col // 16) + key_of(col % 16) for col in range(bn)], :].T
    assert np.array_equal(vt, want), f"d{d}: V^T differs at {np.argwhere(vt != want)[:4].tolist()}"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_transpose_banks(d):
    """ldmatrix.x4.trans and stmatrix.x4 take 4 wavefronts (one per matrix), no conflict, at every head dim: a loaded
    matrix is 8 consecutive keys of one 16-byte chunk (8 distinct swizzled chunks), and each stored matrix mixes 4
    even and 4 odd V^T rows. Storing the even rows in matrix 0 and the odd ones in matrix 1 instead (d = 16 (c0 +
    m / 2) + 2 i + m % 2) would put rows 2i and 2i + 8 of a matrix on the same banks: 2 wavefronts per matrix."""
    cfg = C.fwd_sm90_fp8_config(d, "bf16", False)
    per_tile, _ = banks.fwd_sm90_fp8_cta_stats(cfg)[1]
    for role in ("v_read", "vt_store"):
        s = per_tile[role]
        assert (s.wavefronts, s.conflicts) == (4 * s.instructions, 0), f"d{d} {role}"
    pairs = d // 32
    naive = [[smem_tile_offset(16 * (2 * (u % pairs) + (lane >> 4)) + 2 * (lane & 7) + ((lane >> 3) & 1),
                               8 * (u // pairs), d, cfg.block_n // 2) for lane in range(32)]
             for u in range((cfg.block_n // 16) * pairs)]
    wf, conflicts = banks.count_instructions(np.array(naive), "stmatrix.x4")
    assert (wf, conflicts) == (8 * len(naive), 4 * len(naive)), f"d{d}: the interleave's reason"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_q_loads(d):
    """With Q in registers (shipped at d64; set here at every head dim) each consumer warp loads its 16 Q rows with
    one ldmatrix.x4 per k32 step: the walk's addresses are a literal port's, every Q byte is read once per CTA, the
    registers are the e4m3 A fragment of m64nNk32 (r[0], r[1]: bytes 4t .. 4t + 3 of the step in rows g, g + 8; r[2],
    r[3]: bytes 16 + 4t ..), and no load conflicts."""
    cfg = dataclasses.replace(C.fwd_sm90_fp8_config(d, "bf16", False), q_in_regs=True)
    BM, warps = cfg.block_m, 4 * cfg.consumers
    loads = q_loads(d, BM)
    assert banks.fwd_sm90_fp8_q_addresses(cfg).reshape(-1, 32).tolist() == loads, f"d{d}"
    assert sorted(a + j for i in loads for a in i for j in range(16)) == list(range(BM * d)), f"d{d}: Q not once"
    q = np.random.default_rng(d).integers(0, 256, (BM, d), dtype=np.uint8)
    q_smem = bytearray(BM * d)
    for row in range(BM):
        for col in range(d):
            q_smem[smem_tile_offset(row, col // 2, BM, d // 2) + col % 2] = q[row, col]
    for n, lanes in enumerate(loads):
        warp, kk = divmod(n, d // 32)
        regs = ldmatrix_x4(q_smem, lanes, trans=False)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            want = [int.from_bytes(bytes(q[16 * warp + g + 8 * (m & 1), 32 * kk + 16 * (m >> 1) + 4 * t:][:4]),
                                   "little") for m in range(4)]
            assert regs[lane] == want, f"d{d} warp {warp} kk {kk} lane {lane}"
    per_cta, _ = banks.fwd_sm90_fp8_cta_stats(cfg)
    s = per_cta["q_frag"]
    assert (s.instructions, s.bytes, s.wavefronts, s.conflicts) == (warps * d // 32, BM * d, 4 * warps * d // 32, 0), \
        f"d{d}"
    assert s.wavefronts == sum(wavefronts(dict(enumerate(i)), 16) for i in loads), f"d{d}"
    without, _ = banks.fwd_sm90_fp8_cta_stats(dataclasses.replace(cfg, q_in_regs=False))
    assert without["q_frag"].instructions == 0, "without Q in registers the S wgmma reads Q from shared memory"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(4096, 4096), (1000, 1500), (1500, 1000)])
def test_kv_traffic_is_half_the_16_bit_kernels(d, causal, sq, sk, monkeypatch):
    """On the same key tiles (the bf16 kernel's set to the FP8 kernel's here: the shipped ones may differ, which
    changes causal skipping; the FP8 kernel on its two-consumer tiles, 128 query rows per CTA as the bf16 kernel's)
    FP8 reads exactly half the K/V bytes and half the Q bytes of fwd_sm90_ws_kernel, and writes the same O (bf16) and
    lse. K/V bytes: the reads less Q and (FP8) the descale factors of the hand loop."""
    # every FP8 table on two consumers (d64: the short causal rows' tiles, one-item; the persistent grid and the
    # queue walk the same tiles)
    two = C.FWD_SM90_FP8_TILES_CAUSAL_SHORT[d][:6] if d in C.FWD_SM90_FP8_TILES_CAUSAL_SHORT else \
        C.FWD_SM90_FP8_TILES[d]
    assert two[5] == 2
    for table in (C.FWD_SM90_FP8_TILES, C.FWD_SM90_FP8_TILES_BANDED, C.FWD_SM90_FP8_TILES_SHORT,
                  C.FWD_SM90_FP8_TILES_CAUSAL_SHORT):
        if d in table:
            monkeypatch.setitem(table, d, two)
    for table in (C.FWD_SM90_WS_TILES, C.FWD_SM90_WS_TILES_CAUSAL, C.FWD_SM90_WS_TILES_SHORT,
                  C.FWD_SM90_WS_TILES_CAUSAL_PLAIN, C.FWD_SM90_WS_TILES_CAUSAL_SHORT, C.FWD_SM90_WS_TILES_CAUSAL_LONG):
        if d in table:  # (and 128 query rows per CTA, as the FP8 kernel's: no three-consumer entry)
            monkeypatch.setitem(table, d, (bn_of(d), *table[d][1:4]))
    p8, p16 = (Problem(2, 3, sq, sk, d, dt, causal) for dt in ("fp8", "bf16"))
    assert cuflash_config(p16).block_n == cuflash_config(p8).block_n
    c8, c16 = simulate("cuflash", p8), simulate("cuflash", p16)
    hand = hand_counts(2, 3, sq, sk, d, causal)
    kv8 = c8.hbm_read_bytes - hand["q_read"] - hand["descale"]
    kv16 = c16.hbm_read_bytes - 2 * hand["q_read"]
    assert kv8 == hand["kv_read"], p8
    assert 2 * kv8 == kv16, f"K/V bytes for {p8}: fp8 {kv8}, bf16 {kv16}"
    assert c8.hbm_write_bytes == c16.hbm_write_bytes, "O (bf16 in both) and lse"
    assert c8.flops_matmul == c16.flops_matmul


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("n", [2048, 16384])
def test_non_causal_kv_traffic_is_half_on_the_shipped_tiles(d, n):
    """Without a mask every CTA reads all of K and V whatever its key tile, so the halving holds against the 16-bit
    kernel's shipped tiles too where their CTAs have as many query rows (where not, K and V are read by a different
    number of CTAs: ceil(N / BLOCK_M) each)."""
    p8, p16 = (Problem(1, 4, n, n, d, dt) for dt in ("fp8", "bf16"))
    hand = hand_counts(1, 4, n, n, d, False)
    kv8 = simulate("cuflash", p8).hbm_read_bytes - hand["q_read"] - hand["descale"]
    kv16 = simulate("cuflash", p16).hbm_read_bytes - 2 * hand["q_read"]
    bm8, bm16 = cuflash_config(p8).block_m, cuflash_config(p16).block_m
    assert kv8 == 4 * -(-n // bm8) * 2 * n * d * E8
    assert kv16 == 4 * -(-n // bm16) * 2 * n * d * 2 * E8
    assert (2 * kv8 == kv16) == (bm16 == bm8)


@pytest.mark.parametrize("window,causal", [((256, 0), False), ((300, 100), False), ((512, -1), True)])
def test_a_window_skips_the_tiles_fa2_skips(window, causal):
    """The sliding window's tile skipping is the 16-bit kernels' (schedules.key_block_ranges, which fa2 runs too):
    on the same blocks FP8 reads half fa2's bf16 K/V bytes, and less than without the window. Every CTA sees a key
    in these bands: Q once per CTA, descale factors 1 + 2 per visited tile."""
    b, h, sq, sk, d = 2, 2, 2000, 3000, 128
    BM = bm_of(d, True)
    p8, p16 = (Problem(b, h, sq, sk, d, dt, causal, window) for dt in ("fp8", "bf16"))
    n_begin, n_end = key_block_ranges(p8, BM, bn_of(d))
    assert np.all(n_end > n_begin)
    descale = b * h * F32 * (len(n_end) + 2 * int((n_end - n_begin).sum()))
    c8 = simulate("cuflash", p8)
    fa2 = simulate("fa2", p16, block_m=BM, block_n=bn_of(d))
    assert 2 * (c8.hbm_read_bytes - b * h * sq * d * E8 - descale) == fa2.hbm_read_bytes - b * h * sq * d * E16, \
        f"window {window}"
    assert c8.hbm_read_bytes < simulate("cuflash", Problem(b, h, sq, sk, d, "fp8", causal)).hbm_read_bytes


def test_l2_model_reads_q_k_v_once_with_a_large_l2():
    """The L2 model runs the 16-bit kernel's accesses with 1-byte Q, K, V and a bf16 O, one CTA per SM; it leaves the
    descale factors out (a few bytes per CTA)."""
    p = Problem(2, 4, 1000, 1500, 128, "fp8", True)
    c = simulate("cuflash", p, l2_bytes=1 << 30)
    assert c.dram_read_bytes == 2 * 4 * (1000 + 2 * 1500) * 128 * E8
    assert c.dram_write_bytes == 2 * 4 * 1000 * (128 * E16 + F32)


def test_the_config_is_the_librarys():
    """The library's FP8 forward config (config.select of "forward_fp8", O in bf16), with the problem's causal flag;
    a window selects the window instantiation's tiles."""
    cfg = cuflash_config(Problem(1, 1, 300, 300, 128, "fp8", True))
    assert cfg == C.select("forward_fp8", 128, "bf16", True)
    assert kernel_name(cfg) == "fwd_sm90_fp8_kernel"
    windowed = cuflash_config(Problem(1, 1, 300, 300, 256, "fp8", True, window=(64, 0)))
    want = C.select("forward_fp8", 256, "bf16", False, mods=C.MOD_WINDOW)
    assert (windowed.block_n, windowed.stages, windowed.causal) == (want.block_n, want.stages, True)
    long = cuflash_config(Problem(1, 1, 4096, 4096, 64, "fp8", True))
    assert long == C.select("forward_fp8", 64, "bf16", True, seqlen_k=4096) and long.consumers == 3


@pytest.mark.parametrize("strategy,kwargs,problem,message", [
    ("cuflash", dict(backward=True), Problem(1, 1, 256, 256, 128, "fp8"), "no FP8 backward"),
    ("fa2", dict(), Problem(1, 1, 256, 256, 128, "fp8"), "strategy 'cuflash' only"),
    ("standard", dict(), Problem(1, 1, 256, 256, 128, "fp8"), "strategy 'cuflash' only"),
    ("cuflash", dict(kernels="mma"), Problem(1, 1, 256, 256, 128, "fp8"), "no mma.sync variant"),
    ("cuflash", dict(), Problem(1, 1, 256, 256, 96, "fp8"), "head_dim=96 is not supported by the FP8 forward"),
])
def test_what_fp8_refuses(strategy, kwargs, problem, message):
    with pytest.raises(ValueError, match=message):
        simulate(strategy, problem, **kwargs)
    if strategy == "cuflash" and not kwargs.get("backward"):
        with pytest.raises(ValueError, match=message):  # and with the L2 model
            simulate(strategy, problem, l2_bytes=1 << 20, **kwargs)
