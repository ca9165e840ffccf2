"""BlockMask: a boolean attention mask with its tile map, so that the kernels skip the tiles it masks entirely.

`mask=` of the attention functions takes a bool CuPy array (the kernels read it element by element on every
tile) or a `BlockMask` of one. A BlockMask adds, per kernel tile shape, the state of each (query tile, key tile)
pair: every pair masked (the tile is skipped: no loads, no GEMMs), some masked (the element mask applies) or
none masked (the mask is not read). So a block-sparse mask costs in proportion to the tiles it keeps. The maps are
computed on the GPU the first time a kernel with that tile shape runs on the mask, and kept for later calls:
build the BlockMask once and pass it to every call that uses the mask (its values must not change meanwhile).
Where every tile of a map is empty or full (a block pattern aligned to the kernel's tiles, e.g. 128 x 128 blocks
on an H100), the call runs the plain kernels with tile skipping alone (config.MOD_BLOCKS), at their speed per
kept tile.
"""
from __future__ import annotations

import threading

from . import _launch, _validate

TILE_EMPTY, TILE_PARTIAL, TILE_FULL = 0, 1, 2  # cuda/mods.cuh TileMap


class BlockMask:
    """A bool mask broadcastable to the scores (batch, heads, seqlen_q, seqlen_k), as `mask=` takes it, and its
    tile maps.

    Example:
        >>> keep = cp.random.rand(1, 1, 16384, 16384) < 0.1            # or a block pattern
        >>> bm = cuflash.BlockMask(keep)
        >>> o = cuflash.attention(q, k, v, mask=bm)                      # fully masked tiles are skipped
    """

    def __init__(self, mask):
        info = _validate.array_info(mask, "mask")
        if info.dtype != bool:
            raise TypeError(f"mask.dtype={info.dtype} must be bool (True: attend, False: masked)")
        if not 2 <= len(info.shape) <= 4:
            raise ValueError(f"mask has shape {tuple(info.shape)}; it must have 2 to 4 dims, broadcastable to "
                             f"(batch, heads, seqlen_q, seqlen_k)")
        self._mask = mask
        self._maps: dict = {}
        self._lock = threading.Lock()

    @property
    def mask(self):
        """The bool CuPy array (read-only: the tile maps, and the plans of calls that used them, stand for it)."""
        return self._mask

    @property
    def shape(self) -> tuple:
        return tuple(self._mask.shape)

    def tile_map(self, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, transposed: bool = False):
        """uint8 (Bm, Hm, ceil(Sq / block_m) or 1, ceil(Sk / block_n) or 1): the state of each tile (TILE_*) for a
        kernel of block_m x block_n tiles, computed on first use (a size-1 seqlen dim of the mask gives one tile
        along it). transposed: a contiguous (Bm, Hm, key tiles, query tiles) copy, for the backward, whose CTAs
        walk the query tiles of one key tile."""
        key = (block_m, block_n, seqlen_q, seqlen_k, transposed)
        m = self._maps.get(key)
        if m is None:
            m = tile_states(self._mask, block_m, block_n)
            if transposed:
                m = _launch.cupy().ascontiguousarray(m.transpose(0, 1, 3, 2))
            with self._lock:
                self._maps[key] = m
        return m

    def aligned(self, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int) -> bool:
        """True when no tile of the block_m x block_n map is partial (every tile empty or full), so a kernel that only
        skips the empty tiles computes this mask exactly. Found once per tile shape (one device-to-host copy)."""
        key = ("aligned", block_m, block_n, seqlen_q, seqlen_k)
        a = self._maps.get(key)
        if a is None:
            a = not bool((self.tile_map(block_m, block_n, seqlen_q, seqlen_k) == TILE_PARTIAL).any())
            with self._lock:
                self._maps[key] = a
        return a

    def tiles_visited(self, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int) -> int:
        """How many tiles of the block_m x block_n map are not empty: those a kernel that skips the empty ones visits.
        Found once per tile shape (one device-to-host copy)."""
        key = ("visited", block_m, block_n, seqlen_q, seqlen_k)
        v = self._maps.get(key)
        if v is None:
            v = int((self.tile_map(block_m, block_n, seqlen_q, seqlen_k) != TILE_EMPTY).sum())
            with self._lock:
                self._maps[key] = v
        return v


def tile_states(mask, block_m: int, block_n: int):
    """The TILE_* state of each block_m x block_n tile of a bool mask (2 to 4 dims, padded to 4 from the left):
    uint8 (B, H, tiles along seqlen_q, tiles along seqlen_k). Pairs past the mask's end (the last tiles' padding)
    count as neither kept nor masked."""
    cp = _launch.cupy()
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    b, h, sq, sk = m.shape
    tm = 1 if sq == 1 else block_m
    tn = 1 if sk == 1 else block_n
    nm, nn = -(-sq // tm), -(-sk // tn)
    with _launch.on_device(cp, mask.device.id):
        def tiles(fill):  # padded with `fill` to whole tiles, then (b, h, nm, tm, nn, tn)
            x = cp.full((b, h, nm * tm, nn * tn), fill, dtype=cp.bool_)
            x[:, :, :sq, :sk] = m
            return x.reshape(b, h, nm, tm, nn, tn)

        any_kept = tiles(False).any(axis=(3, 5))
        all_kept = tiles(True).all(axis=(3, 5))
        return cp.where(all_kept, TILE_FULL, cp.where(any_kept, TILE_PARTIAL, TILE_EMPTY)).astype(cp.uint8)
