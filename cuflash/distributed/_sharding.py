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
    bits = {1: xp.uint8, 2: xp.uint16, 4: xp.uint32, 8: xp.uint64}[dtype.itemsize]
    return xp.concatenate([p.view(bits) for p in pieces], axis=axis).view(dtype)


def _module(x):
    try:
        import cupy
        if isinstance(x, cupy.ndarray):
            return cupy
    except ImportError:
        pass
    import numpy
    return numpy
