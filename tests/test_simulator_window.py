"""Sliding-window attention in the analyzer: the band's tile tests against brute force over
elements, the counts of windowed block skipping, the useful work, and the windowed execute mode against
a float64 reference."""
import math

import numpy as np
import pytest

from cuflash.reference import attention_backward64, attention_forward64
from cuflash.simulator import (
    Problem,
    execute_backward,
    execute_forward,
    key_tile_range,
    query_block_range,
    simulate,
    tile_needs_mask,
    visible_pairs,
)
from cuflash.simulator.schedules import key_block_ranges

TOL = 1e-10


def visible(sq, sk, causal=False, window=None):
    """The spec, element by element: query i sees key j iff j <= i + diag (causal) and
    i + diag - left <= j <= i + diag + right (window, -1 = unbounded), diag = sk - sq."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    diag = sk - sq
    keep = np.ones((sq, sk), dtype=bool)
    if causal:
        keep &= j <= i + diag
    if window is not None:
        left, right = window
        if left != -1:
            keep &= j >= i + diag - left
        if right != -1:
            keep &= j <= i + diag + right
    return keep


# ---- the band's tile tests against brute force ------------------------------------------------------

SIDES = [-1, 0, 1, 2, 5, 17, 64, 1000]  # 1000: larger than any sequence below
EDGE_CASES = [  # (sq, sk, block_m, block_n, causal, window)
    (128, 128, 64, 64, False, (0, 0)),  # the diagonal only
    (128, 128, 64, 64, True, (0, 0)),
    (100, 100, 32, 16, False, (1, 1)),
    (100, 300, 32, 64, False, (0, -1)),  # one-sided windows, Sq < Sk
    (300, 100, 64, 32, False, (-1, 0)),  # = causal, Sq > Sk: rows that see no key
    (300, 100, 64, 32, True, (3, -1)),
    (77, 77, 128, 128, False, (1000, 1000)),  # larger than the sequence: no mask
    (1, 239, 16, 32, True, (7, 0)),
    (239, 1, 32, 16, False, (0, 0)),
    (1000, 1500, 128, 64, True, (256, 0)),
    (1500, 1000, 64, 128, False, (100, 50)),
    (64, 64, 7, 48, False, (-1, -1)),
]


def _random_cases(n, seed=7):
    rng = np.random.default_rng(seed)
    blocks = [7, 16, 32, 48, 64, 80, 128]
    cases = []
    for _ in range(n):
        sq, sk = (int(x) for x in rng.integers(1, 300, size=2))
        if rng.random() < 0.25:
            sk = sq
        window = None if rng.random() < 0.15 else tuple(int(x) for x in rng.choice(SIDES, size=2))
        cases.append((sq, sk, int(rng.choice(blocks)), int(rng.choice(blocks)), bool(rng.random() < 0.4), window))
    return cases


CASES = EDGE_CASES + _random_cases(250)
CASE_IDS = [f"{sq}x{sk}-tile{bm}x{bn}-{'causal' if causal else 'plain'}-window{window}".replace(" ", "")
            for sq, sk, bm, bn, causal, window in CASES]


@pytest.mark.parametrize("sq,sk,bm,bn,causal,window", CASES, ids=CASE_IDS)
def test_block_tests_equal_brute_force(sq, sk, bm, bn, causal, window):
    keep = visible(sq, sk, causal, window)
    cfg = f"sq={sq} sk={sk} bm={bm} bn={bn} causal={causal} window={window}"
    t_r, t_c = math.ceil(sq / bm), math.ceil(sk / bn)
    row0 = np.arange(t_r) * bm
    row_last = np.minimum(row0 + bm, sq) - 1
    key0 = np.arange(t_c) * bn
    key_last = np.minimum(key0 + bn, sk) - 1
    # tile (i, j) holds a visible pair
    seen = np.array([[keep[r0:r1 + 1, k0:k1 + 1].any() for k0, k1 in zip(key0, key_last)]
                     for r0, r1 in zip(row0, row_last)])
    n_begin, n_end = key_tile_range(row0, row_last, sq, sk, bn, causal, window)  # vectorized over blocks
    for i in range(t_r):
        expected = np.flatnonzero(seen[i])
        got = np.arange(n_begin[i], n_end[i])
        assert np.array_equal(got, expected), f"key tiles of query block {i} for {cfg}: {got} != {expected}"
        scalar = key_tile_range(int(row0[i]), int(row_last[i]), sq, sk, bn, causal, window)
        assert (int(scalar[0]), int(scalar[1])) == (int(n_begin[i]), int(n_end[i])), "scalar and array forms agree"
    m_begin, m_end = query_block_range(key0, key_last, sq, sk, bm, causal, window)
    for j in range(t_c):
        expected = np.flatnonzero(seen[:, j])
        got = np.arange(m_begin[j], m_end[j])
        assert np.array_equal(got, expected), f"query blocks of key block {j} for {cfg}: {got} != {expected}"
    # the element mask: needed iff a visited tile (its valid rows x all BLOCK_N key slots, the slots past
    # Sk included) holds a hidden pair
    padded = np.zeros((sq, t_c * bn), dtype=bool)
    padded[:, :sk] = keep
    for i in range(t_r):
        for j in range(t_c):
            needs = tile_needs_mask(int(row0[i]), int(row_last[i]), int(key0[j]), int(key0[j] + bn - 1), sq, sk,
                                    causal, window)
            expected = not padded[row0[i]:row_last[i] + 1, key0[j]:key0[j] + bn].all()
            assert bool(needs) == expected, f"tile_needs_mask of tile ({i}, {j}) for {cfg}: {needs}"
    assert visible_pairs(sq, sk, causal, window) == int(keep.sum()), f"visible_pairs for {cfg}"


def test_visible_pairs_closed_forms():
    n = 4096
    assert visible_pairs(n, n) == n * n
    assert visible_pairs(n, n, causal=True) == n * (n + 1) // 2
    assert visible_pairs(n, n, causal=True, window=(-1, 0)) == n * (n + 1) // 2
    w = 256  # causal window: row i sees min(i, w) + 1 keys
    assert visible_pairs(n, n, causal=True, window=(w, -1)) == (w + 1) * n - w * (w + 1) // 2
    assert visible_pairs(n, n, window=(w, w)) == (2 * w + 1) * n - w * (w + 1)
    assert visible_pairs(n, n, window=(0, 0)) == n
    assert visible_pairs(n, n, window=(5000, 5000)) == n * n, "a window larger than the sequence masks nothing"
    assert visible_pairs(10, 3, causal=True) == 6, "Sq > Sk: the first 7 rows see nothing"
    with pytest.raises(ValueError, match="seqlen_q=0"):
        visible_pairs(0, 5)


# ---- Problem.window ---------------------------------------------------------------------------------

@pytest.mark.parametrize("window,err,match", [
    ((-2, 0), ValueError, "left=-2 must be >= 0, or -1"),
    ((0, -5), ValueError, "right=-5"),
    ((3,), TypeError, "pair"),
    (64, TypeError, "pair"),
    ("ab", TypeError, "pair"),
    ((1.5, 2), TypeError, "left=1.5 must be an integer"),
    ((True, 0), TypeError, "left=True"),
])
def test_bad_windows_are_explained(window, err, match):
    with pytest.raises(err, match=match):
        Problem(1, 1, 64, 64, 64, window=window)


def test_window_is_normalized():
    p = Problem(1, 1, 64, 64, 64, window=[np.int64(3), 4])
    assert p.window == (3, 4) and type(p.window[0]) is int
    assert Problem(1, 1, 64, 64, 64).window is None


# ---- counts -----------------------------------------------------------------------------------------

def P(n, d=64, causal=False, window=None, nk=None, batch=1, heads=2):
    return Problem(batch, heads, n, n if nk is None else nk, d, "fp16", causal, window)


RUNS = [("standard", False, {}), ("standard", True, {}), ("fa1", False, {}), ("fa1", True, {}),
        ("fa2", False, {}), ("fa2", True, {}), ("cuflash", False, {}), ("cuflash", True, {}),
        ("cuflash", True, {"deterministic": True}), ("cuflash", False, {"kernels": "mma"}),
        ("cuflash", True, {"kernels": "mma"})]
RUN_IDS = ["std", "std-bwd", "fa1", "fa1-bwd", "fa2", "fa2-bwd", "cuflash", "cuflash-bwd", "cuflash-det",
           "cuflash-mma", "cuflash-mma-bwd"]


@pytest.mark.parametrize("strategy,backward,kw", RUNS, ids=RUN_IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_unbounded_window_changes_no_count(strategy, backward, kw, causal):
    """window=(-1, -1) is no window: every count equals window=None's, L2 model included."""
    for sq, sk in ((1000, 1500), (1536, 512)):
        runs = [simulate(strategy, P(sq, causal=causal, window=w, nk=sk), backward=backward, l2_bytes=1 << 20, **kw)
                for w in (None, (-1, -1))]
        assert runs[0].as_dict() == runs[1].as_dict(), f"{strategy} sq={sq} sk={sk}: (-1, -1) changed a count"


@pytest.mark.parametrize("strategy,backward", [("fa1", False), ("fa1", True), ("fa2", False), ("fa2", True)])
def test_causal_is_the_window_minus1_0(strategy, backward):
    """The tile tests treat causal as the window (-1, 0): with the same blocks the counts are equal
    (cuflash is left out: its kernels pick other tiles when causal)."""
    for sq, sk in ((1000, 1500), (1500, 1000), (4096, 4096)):
        a = simulate(strategy, P(sq, causal=True, nk=sk), backward=backward, block_m=64, block_n=128)
        b = simulate(strategy, P(sq, window=(-1, 0), nk=sk), backward=backward, block_m=64, block_n=128)
        assert a.as_dict() == b.as_dict(), f"{strategy} sq={sq} sk={sk}"


def test_window_skips_tiles_outside_the_band():
    """Sq = Sk = 4096, 128 x 128 tiles, window (256, 256): a query block sees keys
    [row0 - 256, row0 + 127 + 256], at most 6 key tiles; fa2 reads K and V for exactly those."""
    n, b, w = 4096, 128, 256
    n_begin, n_end = key_block_ranges(P(n, window=(w, w)), b, b)
    assert list(n_end - n_begin) == [3, 4] + [5] * 28 + [4, 3]
    c = simulate("fa2", P(n, window=(w, w), heads=1), block_m=b, block_n=b)
    tiles = int((n_end - n_begin).sum())
    assert c.hbm_read_bytes == (n * 64 + 2 * tiles * b * 64) * 2, "Q once, K and V once per visited tile"
    assert c.flops_matmul == 4 * 64 * tiles * b * b
    assert c.flops_useful == 4 * 64 * visible_pairs(n, n, window=(w, w))
    no_skip = simulate("fa2", P(n, window=(w, w), heads=1), block_m=b, block_n=b, causal_skip=False)
    assert no_skip.hbm_bytes == simulate("fa2", P(n, heads=1), block_m=b, block_n=b).hbm_bytes, \
        "without skipping every tile is visited (and masked)"


LINEAR = [("fa1", False, {"block_m": 64, "block_n": 128}), ("fa1", True, {"block_m": 64, "block_n": 128}),
          ("fa2", False, {}), ("fa2", True, {}), ("cuflash", False, {}), ("cuflash", True, {}),
          ("cuflash", True, {"deterministic": True}), ("cuflash", False, {"kernels": "mma"})]


LINEAR_IDS = ["fa1", "fa1-bwd", "fa2", "fa2-bwd", "cuflash", "cuflash-bwd", "cuflash-det", "cuflash-mma"]


@pytest.mark.parametrize("strategy,backward,kw", LINEAR, ids=LINEAR_IDS)
@pytest.mark.parametrize("causal,window", [(True, (256, 0)), (False, (128, 128)), (False, (1000, 0))])
def test_windowed_traffic_is_linear_in_n(strategy, backward, kw, causal, window):
    """With a fixed window every query block visits a fixed number of key tiles (past the first few),
    so HBM traffic grows linearly in N: equal steps for equal increments of N, where without the
    window it grows quadratically."""
    ns = (8192, 16384, 24576, 32768)
    hbm = [simulate(strategy, P(n, causal=causal, window=window), backward=backward, **kw).hbm_bytes for n in ns]
    steps = [b - a for a, b in zip(hbm, hbm[1:])]
    assert len(set(steps)) == 1, f"{strategy} window {window}: steps {steps} are not equal"
    full = [simulate(strategy, P(n, causal=causal), backward=backward, **kw).hbm_bytes for n in ns[:3]]
    assert full[2] - full[1] > 1.5 * (full[1] - full[0]), "without the window the steps grow (quadratic)"


def test_standard_moves_the_same_bytes_with_a_window():
    """The standard algorithm materializes all of S and P whatever the mask: a window changes only the
    useful FLOPs."""
    for backward in (False, True):
        full = simulate("standard", P(2048), backward=backward)
        win = simulate("standard", P(2048, window=(128, 0)), backward=backward)
        assert {k: v for k, v in win.as_dict().items() if k != "flops_useful"} == \
            {k: v for k, v in full.as_dict().items() if k != "flops_useful"}
        per_pair = 10 if backward else 4
        assert win.flops_useful == 2 * per_pair * 64 * visible_pairs(2048, 2048, window=(128, 0))


@pytest.mark.parametrize("strategy", ["fa1", "fa2", "cuflash"])
def test_window_walks_and_l2_follow_the_visited_tiles(strategy):
    """The shared-memory walk (cuflash), the L2 model and the HBM counts all shrink with the band; the
    L2 model never reports more DRAM traffic than HBM traffic."""
    for backward in (False, True):
        full = simulate(strategy, P(2048), backward=backward, l2_bytes=1 << 20)
        win = simulate(strategy, P(2048, window=(64, 64)), backward=backward, l2_bytes=1 << 20)
        assert win.hbm_bytes < full.hbm_bytes and win.sram_read_bytes < full.sram_read_bytes
        assert win.dram_read_bytes <= win.hbm_read_bytes
        if strategy == "cuflash":
            assert win.bank_conflicts <= full.bank_conflicts


# ---- execute mode against a float64 windowed reference ----------------------------------------------

def reference_forward(q, k, v, causal, window, scale=None):
    """Dense float64 attention with the mask of `visible`: o (B, Sq, H, D), lse (B, H, Sq); a row that
    sees no key has o = 0, lse = -inf."""
    b, sq, h, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    keep = visible(sq, k.shape[1], causal, window)
    s = np.where(keep, np.einsum("bihd,bjhd->bhij", q, k) * scale, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)), -np.inf)
    return np.einsum("bhij,bjhd->bihd", p, v), lse, p


def reference_backward(do, q, k, v, causal, window):
    """dQ, dK, dV of reference_forward: dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(P o dP)),
    dQ = scale dS K, dK = scale dS^T Q."""
    scale = 1 / math.sqrt(q.shape[-1])
    _, _, p = reference_forward(q, k, v, causal, window)
    dv = np.einsum("bhij,bihd->bjhd", p, do)
    dp = np.einsum("bihd,bjhd->bhij", do, v)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    return (np.einsum("bhij,bjhd->bihd", ds, k) * scale, np.einsum("bhij,bihd->bjhd", ds, q) * scale, dv)


def _inputs(sq, sk, d=40, b=1, h=2, seed=3):
    rng = np.random.default_rng(seed + 1000 * sq + sk)
    return (rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, h, d)),
            rng.standard_normal((b, sk, h, d)), rng.standard_normal((b, sq, h, d)))


@pytest.mark.parametrize("causal", [False, True])
def test_local_reference_is_cuflash_reference_without_a_window(causal):
    q, k, v, do = _inputs(113, 203)
    o, lse, _ = reference_forward(q, k, v, causal, None)
    o_ref, lse_ref = attention_forward64(q, k, v, causal)
    assert np.abs(o - o_ref).max() < TOL
    assert (np.isfinite(lse) == np.isfinite(lse_ref)).all()
    for g, ref in zip(reference_backward(do, q, k, v, causal, None), attention_backward64(do, q, k, v, causal)):
        assert np.abs(g - ref).max() < TOL


EXEC = [("standard", {}), ("fa1", {"sram_bytes": 16 * 1024}), ("fa2", {"block_m": 64, "block_n": 32}),
        ("cuflash", {}), ("cuflash", {"kernels": "mma"})]
EXEC_IDS = ["standard", "fa1", "fa2", "cuflash", "cuflash-mma"]
# (sq, sk, causal, window): both Sq != Sk directions, rows that see no key, one-sided windows, the
# diagonal only, a window wider than the sequence, and windows that cut tiles on both sides
EXEC_CASES = [(113, 203, False, (0, 0)), (203, 113, True, (17, 0)), (203, 113, False, (5, -1)),
              (113, 203, False, (-1, 3)), (150, 150, True, (40, 9)), (130, 130, False, (1000, 1000)),
              (160, 96, False, (30, 20))]


@pytest.mark.parametrize("strategy,kw", EXEC, ids=EXEC_IDS)
@pytest.mark.parametrize("sq,sk,causal,window", EXEC_CASES)
def test_windowed_forward_schedule_equals_reference(strategy, kw, sq, sk, causal, window):
    q, k, v, _ = _inputs(sq, sk)
    o, lse = execute_forward(strategy, q, k, v, causal=causal, window=window, **kw)
    o_ref, lse_ref, _ = reference_forward(q, k, v, causal, window)
    cfg = f"{strategy} sq={sq} sk={sk} causal={causal} window={window}"
    err = np.abs(o - o_ref).max()
    assert err < TOL, f"o mismatch for {cfg}: {err:.2e}"
    seen = np.isfinite(lse_ref)
    assert (np.isfinite(lse) == seen).all(), f"rows that see no key must have lse = -inf ({cfg})"
    err = np.abs(lse[seen] - lse_ref[seen]).max() if seen.any() else 0.0
    assert err < TOL, f"lse mismatch for {cfg}: {err:.2e}"


@pytest.mark.parametrize("strategy,kw", EXEC + [("cuflash", {"deterministic": True})],
                         ids=EXEC_IDS + ["cuflash-deterministic"])
@pytest.mark.parametrize("sq,sk,causal,window", EXEC_CASES)
def test_windowed_backward_schedule_equals_reference(strategy, kw, sq, sk, causal, window):
    q, k, v, do = _inputs(sq, sk)
    grads = execute_backward(strategy, do, q, k, v, causal=causal, window=window, **kw)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, reference_backward(do, q, k, v, causal, window)):
        err = np.abs(g - ref).max()
        assert err < TOL, f"{name} mismatch for {strategy} sq={sq} sk={sk} causal={causal} window={window}: {err:.2e}"


@pytest.mark.parametrize("strategy", ["fa1", "fa2", "cuflash"])
def test_without_window_skipping_the_masks_alone_give_the_same_result(strategy):
    q, k, v, do = _inputs(200, 150)
    kw = {} if strategy == "cuflash" else {"block_m": 32, "block_n": 64}
    o, _ = execute_forward(strategy, q, k, v, window=(20, 10), causal_skip=False, **kw)
    assert np.abs(o - reference_forward(q, k, v, False, (20, 10))[0]).max() < TOL
    _, dk, _ = execute_backward(strategy, do, q, k, v, window=(20, 10), causal_skip=False, **kw)
    assert np.abs(dk - reference_backward(do, q, k, v, False, (20, 10))[1]).max() < TOL
