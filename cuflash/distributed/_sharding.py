"""How a sequence is split over the ranks of a ring, and which (query rows, key rows) pairs each ring step computes.

Pure Python and NumPy/CuPy slicing: no GPU needed, so CI tests every rule here.

Shardings of a global sequence of N positions over P ranks:
  contiguous  rank r holds positions [r N/P, (r + 1) N/P).
  zigzag      the sequence is cut into 2P chunks of c = N / (2P) positions; rank r holds chunk r followed by
              chunk 2P - 1 - r. With a causal mask every rank then owns the same number of visible (query, key)
              pairs: an early chunk (few keys before it) travels with a late one (many keys before it).

Ring steps: at step s rank r holds the K/V block of rank src = (r - s) mod P (blocks travel r -> r + 1). Which
of its local queries see which rows of that block follows from the global positions:
  not causal            every query sees every key                                  [all rows x all rows]
  causal, src == r      the rank's own block: causal inside it (the zigzag's two chunks keep their order, so the
                        plain causal mask over the local rows is exact)               [all x all, causal]
  causal, contiguous    src < r: every key precedes every query  [all x all]; src > r: nothing visible
  causal, zigzag        src < r: both local chunks see src's early chunk fully, neither sees its late chunk
                        [all x first c];  src > r: the late local chunk sees both of src's chunks fully, the early
                        one neither  [last c x all]. Half a block each: the balance.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHARDINGS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Block:
    """One attention call of a ring step: local query rows x rows of the visiting K/V block."""
    q_rows: slice
    k_rows: slice
    causal: bool


def check_sharding(sharding) -> str:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} is not supported; supported: {', '.join(map(repr, SHARDINGS))}")
    return sharding


def local_length(seqlen: int, world_size: int, sharding: str, name: str = "seqlen") -> int:
    """Positions per rank; a clear error when the global length does not split evenly."""
    parts = 2 * world_size if sharding == "zigzag" else world_size
    if seqlen % parts:
        raise ValueError(f"{name}={seqlen} must be a multiple of {parts} to shard it {sharding} over "
                         f"{world_size} rank{'s' if world_size > 1 else ''} ({'2 x ' if sharding == 'zigzag' else ''}"
                         f"world_size chunks of equal length)")
    return seqlen // world_size


def rank_positions(rank: int, world_size: int, seqlen: int, sharding: str) -> list[range]:
    """The global positions of rank's local rows, in local order, as one or two ranges."""
    n = local_length(seqlen, world_size, sharding)
    if sharding == "contiguous":
        return [range(rank * n, (rank + 1) * n)]
    c = n // 2
    late = 2 * world_size - 1 - rank
    return [range(rank * c, (rank + 1) * c), range(late * c, (late + 1) * c)]


def shard_sequence(x, rank: int, world_size: int, *, axis: int = 1, sharding: str = "zigzag"):
    """rank's local part of a global sequence along `axis` (a view for contiguous; a new array for zigzag)."""
    check_sharding(sharding)
    _check_rank(rank, world_size)
    parts = rank_positions(rank, world_size, x.shape[axis], sharding)
    pieces = [_take(x, axis, r.start, r.stop) for r in parts]
    return pieces[0] if len(pieces) == 1 else _concatenate(pieces, axis)


def unshard_sequence(parts, *, axis: int = 1, sharding: str = "zigzag"):
    """The global sequence from the local parts of ranks 0..P-1 (inverse of shard_sequence)."""
    check_sharding(sharding)
    world_size = len(parts)
    if world_size == 0:
        raise ValueError("parts is empty: pass the local parts of ranks 0 .. world_size - 1")
    if sharding == "contiguous":
        return _concatenate(list(parts), axis)
    n = parts[0].shape[axis]
    if n % 2:
        raise ValueError(f"zigzag parts hold an even number of positions; got {n} along axis {axis}")
    c = n // 2
    early = [_take(p, axis, 0, c) for p in parts]
    late = [_take(p, axis, c, n) for p in parts]
    return _concatenate(early + late[::-1], axis)


def step_source(rank: int, step: int, world_size: int) -> int:
    """The rank whose K/V block rank holds at ring step `step`."""
    return (rank - step) % world_size


def step_blocks(rank: int, src: int, world_size: int, causal: bool, sharding: str, n: int) -> tuple[Block, ...]:
    """The attention calls of rank's step holding src's block (module docstring); n local rows per rank."""
    full = slice(0, n)
    if not causal:
        return (Block(full, full, False),)
    if src == rank:
        return (Block(full, full, True),)
    if sharding == "contiguous":
        return (Block(full, full, False),) if src < rank else ()
    c = n // 2
    if src < rank:
        return (Block(full, slice(0, c), False),)
    return (Block(slice(c, n), full, False),)


# --- packed (varlen) batches: every sequence is sharded on its own -------------------------------------------------
#
# A packed batch holds sequences of lengths L_0, L_1, ... back to back (cu_seqlens). Each sequence is sharded over the
# ranks as a dense one would be, and a rank's local batch packs its part of every sequence in the same order, so
# every rank's local cu_seqlens are the same: L_i / P each. The step plans are the dense ones applied to every
# sequence at once: "all local rows", "the early half of every sequence's local rows", "the late half", each a
# packed sub-batch of its own (cu_seqlens of the halves: L_i / 2P each).

@dataclass(frozen=True)
class PackedBlock:
    """One varlen attention call of a ring step: rows of the local packed batch (a slice for all of them, else an
    index array) and the cumulative lengths of the two sub-batches."""
    q_rows: object
    k_rows: object
    causal: bool
    cu_q: tuple
    cu_k: tuple


def packed_local_lengths(lengths, world_size: int, sharding: str) -> tuple:
    """Local lengths of every sequence (L_i / P); a clear error when one does not split evenly."""
    return tuple(local_length(int(n), world_size, sharding, name=f"the length of sequence {i}")
                 for i, n in enumerate(lengths))


def _cumulative(lengths) -> tuple:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return tuple(out)


def packed_rank_rows(rank: int, world_size: int, cu_seqlens, sharding: str) -> np.ndarray:
    """Global packed rows of rank's local packed batch, in local order."""
    cu = [int(c) for c in cu_seqlens]
    rows = [np.arange(cu[i] + r.start, cu[i] + r.stop) for i in range(len(cu) - 1)
            for r in rank_positions(rank, world_size, cu[i + 1] - cu[i], sharding)]
    return np.concatenate(rows) if rows else np.zeros(0, np.int64)


def shard_packed(x, cu_seqlens, rank: int, world_size: int, *, sharding: str = "zigzag", axis: int = 0):
    """rank's local packed batch of a global packed array x (sequences at cu_seqlens along axis), and its local
    cu_seqlens (a tuple; L_i / P per sequence)."""
    check_sharding(sharding)
    _check_rank(rank, world_size)
    cu = [int(c) for c in cu_seqlens]
    local = packed_local_lengths(np.diff(cu), world_size, sharding)
    return take_rows(x, packed_rank_rows(rank, world_size, cu, sharding), axis), _cumulative(local)


def unshard_packed(parts, cu_seqlens, *, sharding: str = "zigzag", axis: int = 0):
    """The global packed array from the local packed batches of ranks 0..P-1 (inverse of shard_packed)."""
    check_sharding(sharding)
    world_size = len(parts)
    if world_size == 0:
        raise ValueError("parts is empty: pass the local parts of ranks 0 .. world_size - 1")
    cu = [int(c) for c in cu_seqlens]
    rows = np.concatenate([packed_rank_rows(r, world_size, cu, sharding) for r in range(world_size)])
    order = np.argsort(rows, kind="stable")  # position j of the concatenated parts holds global row rows[j]
    return take_rows(_concatenate(list(parts), axis), order, axis)


def packed_step_blocks(rank: int, src: int, world_size: int, causal: bool, sharding: str,
                       local_lengths: tuple) -> tuple[PackedBlock, ...]:
    """The varlen calls of rank's step holding src's block: the dense plan in halves of every sequence."""
    cu = _cumulative(local_lengths)
    halves = tuple(n // 2 for n in local_lengths)
    cu_half = _cumulative(halves)
    early = np.concatenate([np.arange(cu[i], cu[i] + halves[i]) for i in range(len(halves))] or [np.zeros(0, int)])
    late = np.concatenate([np.arange(cu[i] + halves[i], cu[i + 1]) for i in range(len(halves))] or [np.zeros(0, int)])
    pick = {(0, 2): (slice(0, cu[-1]), cu), (0, 1): (early, cu_half), (1, 2): (late, cu_half)}
    out = []
    for b in step_blocks(rank, src, world_size, causal, sharding, 2):  # rows in units of halves: 0..2
        (q_rows, cu_q), (k_rows, cu_k) = pick[(b.q_rows.start, b.q_rows.stop)], pick[(b.k_rows.start, b.k_rows.stop)]
        out.append(PackedBlock(q_rows, k_rows, b.causal, cu_q, cu_k))
    return tuple(out)


def take_rows(x, rows, axis: int):
    """x's entries at `rows` (a slice: a view; an index array: a copy) along axis; CuPy arrays by their bits."""
    if isinstance(rows, slice):
        return _take(x, axis, rows.start, rows.stop)
    xp = _module(x)
    if xp.__name__ == "numpy":
        return np.take(x, rows, axis=axis)
    return xp.take(x.view(bits_dtype(xp, x.dtype)), xp.asarray(rows), axis=axis).view(x.dtype)


def _check_rank(rank, world_size):
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be an integer in [0, {world_size})")


def _take(x, axis, start, stop):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def _concatenate(pieces, axis):
    """Concatenation along axis; CuPy arrays go by their bits (no element-wise kernel of, e.g., bfloat16 needed)."""
    xp = _module(pieces[0])
    if xp.__name__ == "numpy":
        return xp.concatenate(pieces, axis=axis)
    dtype = pieces[0].dtype
    bits = bits_dtype(xp, dtype)
    return xp.concatenate([p.view(bits) for p in pieces], axis=axis).view(dtype)


def bits_dtype(xp, dtype):
    """The unsigned integer dtype of dtype's size: CuPy moves arrays of any dtype (e.g. bfloat16, which it cannot
    copy element-wise) as these bits."""
    return {1: xp.uint8, 2: xp.uint16, 4: xp.uint32, 8: xp.uint64}[dtype.itemsize]


def _module(x):
    try:
        import cupy
        if isinstance(x, cupy.ndarray):
            return cupy
    except ImportError:
        pass
    import numpy
    return numpy
