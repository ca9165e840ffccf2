"""Which (query, key) pairs are visible, at element and at tile level: the mirror of cuda/mask.cuh's Band.

Query i sees key j (0 <= j < seqlen_k) iff first_key(i) <= j < key_end(i), with diag = seqlen_k - seqlen_q
(bottom-right alignment) and a window (left, right), -1 = unbounded:

    no mask   every key
    causal    j <= i + diag
    window    i + diag - left <= j <= i + diag + right

causal and a window combine as the intersection: causal is the window (-1, 0), and a window with causal
keeps its left side and takes right = min(right, 0) (the host folds causal into the window the same way).
The same band gives the tile tests the kernels run: which key tiles a query block visits (the others are
skipped: not loaded, not computed), which query blocks a key block visits (the K/V-outer backward), and
which visited tiles need the element mask. A tile is visited iff it holds a visible pair: the rows' key
intervals slide by one key per row, so their union over a block of rows is one interval.

Every function takes Python ints or NumPy integer arrays for the row and key bounds (vectorized over
blocks); an unbounded side is None inside, never a large number.
"""
from __future__ import annotations

import numbers

import numpy as np

UNBOUNDED = -1  # a window side that does not limit the band


def check_window(window) -> tuple[int, int] | None:
    """window as (left, right) Python ints, each >= 0 or UNBOUNDED; None (no window) stays None."""
    if window is None:
        return None
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"window={window!r} must be None or a pair (left, right) of integers (-1: unbounded)")
    for side, value in zip(("left", "right"), window):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"window={window!r}: {side}={value!r} must be an integer (-1: unbounded)")
        if value < UNBOUNDED:
            raise ValueError(f"window={window!r}: {side}={value} must be >= 0, or -1 for unbounded")
    return int(window[0]), int(window[1])


def band_sides(causal: bool = False, window=None) -> tuple[int | None, int | None]:
    """(left, right) of the band, None where unbounded: causal is the window (-1, 0), combined with a
    window as the intersection."""
    window = check_window(window)
    left, right = (UNBOUNDED, UNBOUNDED) if window is None else window
    if causal:
        right = 0 if right == UNBOUNDED else min(right, 0)
    return (None if left == UNBOUNDED else left), (None if right == UNBOUNDED else right)


def first_key(query, seqlen_q: int, seqlen_k: int, causal: bool = False, window=None):
    """The first key query i sees, before clamping to 0 (may be negative)."""
    left, _ = band_sides(causal, window)
    diag = seqlen_k - seqlen_q
    return query * 0 if left is None else query + diag - left


def key_end(query, seqlen_q: int, seqlen_k: int, causal: bool = False, window=None):
    """One past the last key query i sees, clamped to seqlen_k (<= 0: the query sees no key)."""
    _, right = band_sides(causal, window)
    diag = seqlen_k - seqlen_q
    return query * 0 + seqlen_k if right is None else np.minimum(seqlen_k, query + diag + right + 1)


def key_tile_range(row_first, row_last, seqlen_q: int, seqlen_k: int, block_n: int, causal: bool = False,
                   window=None):
    """Key tiles [n_begin, n_end) that query rows [row_first, row_last] see (the forward's Q-outer loop,
    Band::key_block_begin / key_block_end): the tiles intersecting [row_first + diag - left,
    row_last + diag + right] and [0, seqlen_k). A block that sees no key gets (0, 0)."""
    end = key_end(row_last, seqlen_q, seqlen_k, causal, window)
    n_end = np.where(end > 0, -(-end // block_n), 0)
    n_begin = np.where(end > 0, np.maximum(0, first_key(row_first, seqlen_q, seqlen_k, causal, window)) // block_n, 0)
    return n_begin, n_end


def query_block_range(key_first, key_last, seqlen_q: int, seqlen_k: int, block_m: int, causal: bool = False,
                      window=None):
    """Query blocks [m_begin, m_end) whose rows see some key of [key_first, key_last] (the backward's
    K/V-outer loop, Band::query_begin / query_end): the blocks intersecting [key_first - diag - right,
    key_last - diag + left] and [0, seqlen_q). A key block that no query sees gets (0, 0)."""
    left, right = band_sides(causal, window)
    diag = seqlen_k - seqlen_q
    q_begin = key_first * 0 if right is None else np.maximum(0, key_first - diag - right)
    q_end = key_last * 0 + seqlen_q if left is None else np.maximum(0, np.minimum(seqlen_q, key_last - diag + left + 1))
    m_end = -(-q_end // block_m)
    return np.where(q_end > 0, q_begin // block_m, 0), m_end


def tile_needs_mask(row_first, row_last, key_first, key_last, seqlen_q: int, seqlen_k: int, causal: bool = False,
                    window=None):
    """Whether the tile of query rows [row_first, row_last] x keys [key_first, key_last] holds a pair the
    band hides, so it is computed with the element mask (Band::needs_mask): a key past the first row's
    last key (the key tail when key_last >= seqlen_k, the causal diagonal, the window's right side) or
    before the last row's first key (the window's left side). Tiles outside the band entirely need it too."""
    left, _ = band_sides(causal, window)
    right_side = key_last >= key_end(row_first, seqlen_q, seqlen_k, causal, window)
    if left is None:
        return right_side
    return right_side | (key_first < first_key(row_last, seqlen_q, seqlen_k, causal, window))


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False, window=None) -> int:
    """The number of (query, key) pairs the band keeps, per (batch, head): the useful work of an attention
    call (4 * head_dim FLOPs per pair forward, 10 * head_dim backward). Exact:
    sum over queries i of max(0, key_end(i) - max(0, first_key(i)))."""
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    left, right = band_sides(causal, window)
    if left is None and right is None:
        return int(seqlen_q) * int(seqlen_k)
    i = np.arange(seqlen_q, dtype=np.int64)
    begin = np.maximum(0, first_key(i, seqlen_q, seqlen_k, causal, window))
    return int(np.maximum(0, key_end(i, seqlen_q, seqlen_k, causal, window) - begin).sum())
