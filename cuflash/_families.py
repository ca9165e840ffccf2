"""The plan of a problem: its kernel family and config (config.select), launch arguments and launches.

One function per operation: `forward`, `backward`, `decode`. Each makes the outputs and the kernels' params
structs from a validated problem (_problem.py), launches, and, when the call can be replayed (CuPy arrays, no
copy made, no score modifier), records a `_plan.Plan` under the call's key so later calls skip everything here.
A new kernel family or dtype is a `config.FAMILIES` entry and its kernel; the params it takes are built here once.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from functools import lru_cache, partial

from . import _launch, _plan, _problem, _tma, _validate, config
from .blockmask import BlockMask
from .config import (SEQLEN_Q_PAD, AppendConfig, CombineConfig, DropoutMaskConfig, ElementwiseConfig, dq_config,
                     kernel_head_dim)
from .philox import dropout_threshold

_selected: dict = {}  # (op, device, kernel head dim, dtype, causal, mods, deterministic, families) -> (config, kernel)


def _kernel(op: str, device: int, head_dim: int, dtype: str, causal: bool, mods: int = 0, deterministic: bool = False,
            seqlen_k: int | None = None):
    """Config and loaded kernel of an operation, chosen by config.select once per signature."""
    key = (op, device, head_dim, dtype, causal, mods, deterministic, seqlen_k, config.KERNELS)
    entry = _selected.get(key)
    if entry is None:
        cfg = config.select(op, head_dim, dtype, causal, _launch.device_arch(device), mods=mods,
                            deterministic=deterministic, seqlen_k=seqlen_k)
        entry = _selected[key] = (cfg, _launch.get_kernel(cfg, device))
    return entry


# --- operands -------------------------------------------------------------------------------------------

def _operand(x, info, dims, layout):
    """x itself when the kernel can read it in place; else an aligned contiguous copy (rare: views at odd element
    offsets, see _validate.needs_aligned_copy) and its new Dims."""
    packed = layout == "packed"
    if not (_validate.needs_aligned_copy_rows(info) if packed else _validate.needs_aligned_copy(info, dims)):
        return x, dims
    # a copy, always: ascontiguousarray returns a misaligned view unchanged when it is already C-contiguous
    # (every outer dim of size 1), and the kernels would then read 16-byte chunks at an odd address
    x = x.copy()
    info = _validate.array_info(x, info.name)
    if packed:
        return x, dims._replace(row_stride=int(info.strides[0]), head_stride=int(info.strides[1]))
    return x, _validate.bshd_dims(info, layout)


def _contiguous(x, layout):
    """A contiguous copy of x and its Dims."""
    x = _launch.cupy().ascontiguousarray(x)
    info = _validate.array_info(x, "copy")
    return x, _problem.packed_dims(info) if layout == "packed" else _validate.bshd_dims(info, layout)


def _new_like(dims, layout, dtype, cp):
    """A new contiguous array shaped like dims in layout, and its Dims."""
    b, s, h, d = dims.batch, dims.seqlen, dims.heads, dims.head_dim
    if layout == "packed":
        return cp.empty((s, h, d), dtype=dtype), _validate.Dims(1, s, h, d, 0, h * d, d)
    if layout == "bshd":
        return cp.empty((b, s, h, d), dtype=dtype), _validate.Dims(b, s, h, d, s * h * d, h * d, d)
    return cp.empty((b, h, s, d), dtype=dtype), _validate.Dims(b, s, h, d, h * s * d, d, s * d)


def _same(arrays, others) -> bool:
    """Whether each array is the same object as its counterpart (no copy was made)."""
    return all(a is b for a, b in zip(arrays, others))


def _strides(d):
    return d.batch_stride, d.row_stride, d.head_stride


def _broadcast(b: _validate.Broadcast, ptr: int | None = None, strides: tuple | None = None) -> _launch.Broadcast:
    """The kernels' view of an array broadcast to the scores (its own address and strides unless given)."""
    s = b.strides if strides is None else strides
    return _launch.Broadcast(b.info.ptr if ptr is None else ptr, s[0], s[1], s[2], s[3], b.batch_div, b.head_div)


def _mask(masks: tuple, keep: list) -> _validate.Broadcast:
    """The one mask the kernels read: mask or key_padding_mask, or, with both, their intersection (a new bool
    array of their broadcast shape, `_MaskAnd`; `keep` holds it until the launch is queued)."""
    if len(masks) == 1:
        return masks[0]
    both = _MaskAnd(masks[0])(masks[0].array, masks[1].array)
    keep.append(both)
    info = _validate.array_info(both, "mask")
    return _validate.check_broadcast(info, "mask", *masks[0].scores, info.device)


class _MaskAnd:
    """The intersection of a mask (the Broadcast `m`) with a key_padding_mask, as one bool array of their
    broadcast shape: `_mask` makes it for a launch, a plan once per call (`_plan.PlanBuilder.make`)."""

    def __init__(self, m: _validate.Broadcast):
        self.shape, self.batch = m.shape, m.scores[0]
        self.rows = m.batch_div > 1 and m.shape[0] > 1  # a batch that divides the problem's: a row per batch entry
        self.batch_div = m.batch_div

    def __call__(self, mask, key_padding_mask):
        cp = _launch.cupy()
        x = (mask.mask if isinstance(mask, BlockMask) else mask).reshape(self.shape)
        if self.rows:
            x = x[cp.arange(self.batch) // self.batch_div]
        return cp.logical_and(x, key_padding_mask.reshape(self.batch, 1, 1, -1))


def mod_params(m: _validate.Mods, scale: float, max_seqlen: int, keep: list | None = None,
               dbias: _validate.ArrayInfo | None = None) -> _launch.ModParams:
    """ModParams of a launch. An unbounded window side becomes a bound no sequence reaches (the kernels
    never test for -1). keep: arrays made here (a combined mask) go there, to live until the launch is queued;
    dbias: the float32 gradient of the bias that the backward writes."""
    left, right = m.window if m.window is not None else (-1, -1)
    far = max(1, max_seqlen)
    a = m.alibi
    params = _launch.ModParams(
        0 if a is None else a.ptr, int(a.strides[0]) if a is not None and len(a.shape) == 2 else 0, m.seed,
        far if left == -1 else left, far if right == -1 else right,
        scale / m.softcap if m.softcap else 0.0, m.softcap / scale if m.softcap else 0.0, 1.0 / scale,
        m.offset, dropout_threshold(m.dropout_p), 1.0 / (1.0 - m.dropout_p))
    if m.bias is not None:
        params.bias = _broadcast(m.bias)
        params.bias_kind = _validate.bias_kind(m.bias.info.dtype)
        if dbias is not None:
            pad = (0,) * (4 - len(dbias.shape))
            strides = tuple(0 if n == 1 else int(s) for n, s in zip(m.bias.shape, pad + tuple(dbias.strides)))
            params.dbias = _broadcast(m.bias, dbias.ptr, strides)
            params.dbias_atomic = int(m.bias.reduces)
    if m.masks:
        params.mask = _broadcast(_mask(m.masks, [] if keep is None else keep))
    return params


def _block_map(m: _validate.Mods, block_m: int, block_n: int, keep: list, transposed: bool = False,
               padding: bool = True) -> _launch.Broadcast | None:
    """The tile map of a BlockMask mask for a kernel of block_m x block_n tiles, or of a key_padding_mask alone
    (_PaddingMap, made now) (None without either; with both masks the kernels read their intersection, which has no
    map). transposed: query tiles contiguous (the backward's walk); padding: False where the kernel reads no map
    (no _PaddingMap is made for it)."""
    pm = padding_map(m, block_n) if padding else None
    if pm is not None:
        states = pm(m.masks[0].array)
        keep.append(states)
        return pm.broadcast(states)
    if len(m.masks) != 1 or m.masks[0].blocks is None:
        return None
    b = m.masks[0]
    tiles = b.blocks.tile_map(block_m, block_n, b.scores[2], b.scores[3], transposed)
    keep.append(tiles)
    bm, hm = tiles.shape[:2]
    nm, nn = tiles.shape[2:][::-1] if transposed else tiles.shape[2:]
    per_m, per_n = (1, nm) if transposed else (nn, 1)
    return _launch.Broadcast(tiles.data.ptr, hm * nm * nn if bm > 1 else 0, nm * nn if hm > 1 else 0,
                             per_m if nm > 1 else 0, per_n if nn > 1 else 0, b.batch_div, b.head_div)


# Steps of 128 queries in the warp-specialized backward (head dims 32 and 64) ran 1.35-1.37x faster per visited tile
# than steps of 64 with a mask's map (bf16, H200, 2026-11-30: a key padding mask, a BlockMask of whole 128 x 128
# blocks), but their map, at 128-row tiles, skips less of a block pattern finer than 128 queries: a BlockMask keeping
# 10 % of its 64 x 64 blocks (N 8k, D 64) took 26 % longer.
STEPS_128_GAIN = 1.35


def _steps_for_the_map(a, main, kernel, bits: int, deterministic: bool):
    """The backward's main config and kernel for a BlockMask that is not whole tiles (its element mask read, its map
    skipping the empty tiles): 64-query steps where their map visits less than 2 / STEPS_128_GAIN as many tiles
    as the 128-query steps' (the tile counts: one device-to-host copy per BlockMask and tile shape); else (main,
    kernel) as chosen. Deterministic calls keep the chosen steps (their results do not depend on the mask's
    contents)."""
    if deterministic or not isinstance(main, config.BwdSm90WsConfig) or main.block_m != 128 or \
            not config.mask_only(bits) or len(a.mods.masks) != 1 or a.mods.masks[0].blocks is None:
        return main, kernel
    b = a.mods.masks[0]
    visited = {m: b.blocks.tiles_visited(m, main.block_n, b.scores[2], b.scores[3]) for m in (64, 128)}
    if visited[64] * STEPS_128_GAIN >= 2 * visited[128]:
        return main, kernel
    small = dataclasses.replace(main, block_m=64)
    return small, _launch.get_kernel(small, a.device)


_PADDING_TILES = config.PaddingTilesConfig()  # (one instance: its kernel lookup on every call hashes it)


class _PaddingMap:
    """The tile map of a key_padding_mask alone (no `mask` beside it) for kernels of block_n-key tiles: uint8 (batch,
    key tiles), the state of each sequence's key tile (no key kept: TILE_EMPTY, some: TILE_PARTIAL, all: TILE_FULL),
    the same for every head and query tile, so the kernels that read a BlockMask's map (cuflash.blockmask) skip the
    key tiles a padded batch empties. Made on the GPU per call (one small launch of `padding_tiles_kernel`: the mask's
    values change between calls; a plan makes it per call too, `PlanBuilder.make`)."""

    def __init__(self, kpm: _validate.Broadcast, block_n: int):
        self.rows, self.seqlen_k = kpm.shape[0], kpm.scores[3]
        self.block_n, self.tiles = block_n, -(-kpm.scores[3] // block_n)
        self.batch_div = kpm.batch_div

    def __call__(self, key_padding_mask):
        """The map of this call's mask (on the current device and stream: the call's)."""
        cp = _launch.cupy()
        states = cp.empty((self.rows, self.tiles), dtype=cp.uint8)
        cfg = _PADDING_TILES
        params = _launch.PaddingTilesParams(key_padding_mask.data.ptr, states.data.ptr, *key_padding_mask.strides,
                                            self.rows, self.seqlen_k, self.block_n, self.tiles)
        _launch.get_kernel(cfg, key_padding_mask.device.id).launch(
            (-(-self.rows * self.tiles // cfg.threads), 1, 1), params, cp.cuda.get_current_stream().ptr)
        return states

    def broadcast(self, states) -> _launch.Broadcast:
        """The map as the kernels read it: (batch, 1, 1, key tiles), transposed or not (one query tile)."""
        return _launch.Broadcast(states.data.ptr, self.tiles if self.rows > 1 else 0, 0, 0, 1 if self.tiles > 1 else 0,
                                 self.batch_div, 1)


def padding_map(m: _validate.Mods, block_n: int) -> _PaddingMap | None:
    """The _PaddingMap of a launch whose one mask is a key_padding_mask and whose keys span two or more of the
    kernel's key tiles (None otherwise: with one tile a map could skip only whole sequences, and it costs a launch,
    ~16 us of host time per call on an H200 host)."""
    if len(m.masks) != 1 or m.masks[0].info.name != "key_padding_mask" or m.masks[0].scores[3] <= block_n:
        return None
    return _PaddingMap(m.masks[0], block_n)


def blocks_only(op: str, a, head_dim: int, deterministic: bool = False) -> int:
    """The modifier bits a launch of `op` on problem `a` runs with: a.mods.bits, or, where the one mask is a
    BlockMask whose map at the tiles of the kernel that would run is all empty or full tiles, MOD_BLOCKS instead
    of MOD_MASK (the plain mainloop with tile skipping; config.MOD_BLOCKS). The deterministic backward keeps the
    mask: its separate dQ kernel reads no map."""
    m = a.mods
    bits = m.bits
    if deterministic or not config.mask_only(bits) or len(m.masks) != 1 or m.masks[0].blocks is None:
        return bits
    blocks = (bits & ~config.MOD_MASK) | config.MOD_BLOCKS
    try:
        cfg = config.select(op, head_dim, a.dtype, m.causal, _launch.device_arch(a.device), mods=blocks,
                            deterministic=deterministic, seqlen_k=a.seqlen_k)
    except ValueError:  # no family with a tile map runs this problem
        return bits
    b = m.masks[0]
    return blocks if b.blocks.aligned(cfg.block_m, cfg.block_n, b.scores[2], b.scores[3]) else bits


def _seq(a, cu_seqlens):
    """SeqParams of a forward or backward problem; cu_seqlens: (q, k) CuPy arrays of a packed call, or None."""
    group = a.heads_q // a.heads_kv
    if cu_seqlens is None:
        return _launch.seq_params(a.seqlen_q, a.seqlen_k, group)
    return _launch.seq_params(a.seqlen_q, a.seqlen_k, group, cu_seqlens[0].data.ptr, cu_seqlens[1].data.ptr)


MAX_DROPOUT_MASK = 2**30


def dropout_mask(m: _validate.Mods, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device: int):
    """bool (batch, heads, seqlen_q, seqlen_k): True where the kernels keep P (return_dropout_mask)."""
    cp = _launch.cupy()
    if batch * heads * seqlen_q * seqlen_k > MAX_DROPOUT_MASK:
        raise ValueError(f"return_dropout_mask=True would return {batch * heads * seqlen_q * seqlen_k} elements "
                         f"(batch * heads * seqlen_q * seqlen_k); it is for testing small shapes, at most "
                         f"{MAX_DROPOUT_MASK}")
    with _launch.on_device(cp, device):
        mask = cp.empty((batch, heads, seqlen_q, seqlen_k), dtype=cp.uint8)
        if mask.size == 0:
            return mask.view(cp.bool_)
        if m.dropout_p == 0:  # nothing dropped
            mask.fill(1)
            return mask.view(cp.bool_)
        params = _launch.DropoutMaskParams(mask.data.ptr, mod_params(m, 1.0, 1), seqlen_q, seqlen_k, heads)
        cfg = DropoutMaskConfig()
        groups = ((seqlen_q + 1) // 2) * ((seqlen_k + 1) // 2)
        _launch.get_kernel(cfg, device).launch((-(-groups // cfg.threads), heads, batch), params,
                                               cp.cuda.get_current_stream().ptr)
    return mask.view(cp.bool_)


def varlen_dropout_masks(a, cu_seqlens_q, cu_seqlens_k) -> list:
    """One bool (heads, len_q(b), len_k(b)) keep mask per sequence of a packed problem: the top-left corner of
    batch index b's mask (the dropout stream does not depend on the lengths)."""
    cp = _launch.cupy()
    dense = dropout_mask(a.mods, a.batch, a.heads_q, a.seqlen_q, a.seqlen_k, a.device)
    with _launch.on_device(cp, a.device):
        cq, ck = cp.asnumpy(cu_seqlens_q), cp.asnumpy(cu_seqlens_k)
        return [dense[b, :, :int(cq[b + 1] - cq[b]), :int(ck[b + 1] - ck[b])].copy() for b in range(a.batch)]


# --- forward --------------------------------------------------------------------------------------------

def forward(a, arrays, *, with_lse: bool, cu_seqlens=None, key=None):
    """Launch the forward of problem `a` on arrays = (q, k, v); returns (o, lse), or o alone without lse (the
    kernel then writes none). cu_seqlens: (q, k) offsets of a packed problem. key: the call's plan key, or None."""
    cp = _launch.cupy()
    layout = a.layout
    with _launch.on_device(cp, a.device):
        o, od = _new_like(a.q, layout, arrays[0].dtype, cp)
        lse = None
        if with_lse:
            lse = cp.empty((a.heads_q, a.total_q) if a.packed else (a.batch, a.heads_q, a.seqlen_q),
                           dtype=cp.float64 if a.dtype == "fp64" else cp.float32)
        if o.size == 0:
            return (o, lse) if with_lse else o
        if (a.total_k if a.packed else a.seqlen_k) == 0:  # no keys at all: every row is fully masked
            o.fill(0)
            if with_lse:
                lse.fill(-cp.inf)
            return (o, lse) if with_lse else o
        (q, dq), (k, dk), (v, dv) = (_operand(x, i, d, layout) for x, i, d in zip(arrays, a.infos, (a.q, a.k, a.v)))
        hd = kernel_head_dim(a.head_dim, a.dtype)
        bits = blocks_only("forward", a, hd)
        cfg, kernel = _kernel("forward", a.device, hd, a.dtype, a.mods.causal, bits, seqlen_k=a.seqlen_k)
        maps = None
        ws = isinstance(cfg, config.FwdSm90WsConfig)
        tf32 = isinstance(cfg, config.FwdSm90Tf32Config)
        if ws or tf32:  # Q, K, V through TMA
            boxes = ((cfg.block_m, cfg.box_cols), (cfg.block_n, cfg.box_cols), (cfg.block_n, cfg.box_cols))
            maps = _TmaMaps(a.dtype, (dq, dk, dv), boxes, _tma.FwdWsParams, "fwd")
            if not maps.usable((q, k, v)):  # a view no tensor map describes (negative strides): contiguous copies
                (q, dq), (k, dk), (v, dv) = (_contiguous(x, layout) for x in (q, k, v))
                maps = _TmaMaps(a.dtype, (dq, dk, dv), boxes, _tma.FwdWsParams, "fwd")
        lse_strides = (0, a.total_q) if a.packed else (a.heads_q * a.seqlen_q, a.seqlen_q)
        params = _launch.FwdParams(
            q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, 0 if lse is None else lse.data.ptr, _seq(a, cu_seqlens),
            0, 0, 0, 0, *_strides(dq), *_strides(dk), *_strides(dv), *_strides(od), *lse_strides, 0, 0,
            a.heads_q, a.head_dim, 0, 0, 1, 1, a.scale * _launch.LOG2E, 0)
        params.scale_log2_d = a.scale * _launch.LOG2E  # the float64 kernels' (ctypes keeps the double)
        keep = []  # a combined mask lives until the launch is queued
        if a.mods.bits:
            params.mods = mod_params(a.mods, a.scale, max(a.seqlen_q, a.seqlen_k), keep)
            if ws or tf32:  # the kernels that skip the tiles a BlockMask empties
                tiles = _block_map(a.mods, cfg.block_m, cfg.block_n, keep)
                if tiles is not None:
                    params.mods.block_map = tiles
        grid = cfg.grid(a.batch, a.heads_q, a.seqlen_q)
        fields, queue = "", False
        if maps is not None:  # the kernel takes the tensor maps in front of FwdParams, then its work items
            params = maps.params(params, (q, k, v))
            fields = "fwd."
            if ws:
                grid, params.m_blocks, params.items = cfg.schedule(a.batch, a.heads_q, a.seqlen_q, _sm_count(a.device))
                queue = cfg.uses_queue(a.packed)
            if queue:  # two counters that each launch on the stream leaves at zero (the decode's buffer)
                params.queue = _queue_ptr(a.device, cp.cuda.get_current_stream().ptr)
        if key is not None and _same((q, k, v), arrays):  # no operand copied: later calls replay this launch
            # arrays of a replay: q, k, v, the ALiBi slopes, the bias, the mask and the key_padding_mask (or None),
            # the FP8 descales (None here), and of a packed call cu_seqlens_q, cu_seqlens_k; extra: the dropout seed
            # and offset
            n = 10 if cu_seqlens is None else 12
            b = _plan.PlanBuilder(a.device, n)
            for i, name in enumerate("qkv"):
                b.bind(i, params, fields + name)
            if cu_seqlens is not None:
                b.bind(10, params, fields + "seq.cu_seqlens_q")
                b.bind(11, params, fields + "seq.cu_seqlens_k")
            _bind_mods(b, a.mods, 3, ((params, fields),))
            if (ws or tf32) and (pm := padding_map(a.mods, cfg.block_n)) is not None:  # its map, made per call
                b.make(pm, (6,), (params, fields + "mods.block_map.ptr"))
            b.alloc(o.shape, o.dtype, (params, fields + "o"))
            if with_lse:
                b.alloc(lse.shape, lse.dtype, (params, fields + "lse"))
            if maps is not None:
                b.derive((0, 1, 2), params, "tma_q", maps.words)
                if queue:
                    b.per_stream(params, "queue", partial(_queue_ptr, a.device))
            b.launch(kernel, grid, params)
            _plan.plans.put(key, b.plan(aligned=(0, 1, 2), returns=(n, n + 1) if with_lse else n))
        kernel.launch(grid, params, cp.cuda.get_current_stream().ptr)
    return (o, lse) if with_lse else o


def _bind_mods(b: _plan.PlanBuilder, m: _validate.Mods, first: int, targets) -> None:
    """What a plan writes per call of the score modifiers into the ModParams of each (params, field prefix) target:
    the addresses of the ALiBi slopes, the bias, and the mask or key_padding_mask (array numbers first, first + 1,
    first + 2, first + 3 of the replay), or, with both masks, of their intersection made per call; the dropout seed
    and offset (extra[0], extra[1]; checked on every call, written where the launch has modifiers). A BlockMask
    (array first + 2) is not bound: the plan replays for that BlockMask only (`PlanBuilder.guard`), whose mask and
    tile maps the launch arguments already hold. The other modifiers are in the plan key."""
    targets = tuple(targets) if m.bits else ()  # (without modifiers the kernels read no ModParams)
    for x in m.masks:
        if x.blocks is not None:
            b.guard(first + 2, x.blocks)
    if len(m.masks) == 2 and targets:
        b.make(_MaskAnd(m.masks[0]), (first + 2, first + 3),
               *((prm, prefix + "mods.mask.ptr") for prm, prefix in targets))
    for prm, prefix in targets:
        if m.alibi is not None:
            b.bind(first, prm, prefix + "mods.alibi_slopes")
        if m.bias is not None:
            b.bind(first + 1, prm, prefix + "mods.bias.ptr")
        if len(m.masks) == 1 and m.masks[0].blocks is None:
            b.bind(first + (3 if m.masks[0].info.name == "key_padding_mask" else 2), prm, prefix + "mods.mask.ptr")
    b.value(0, 2**64, *((prm, prefix + "mods.seed") for prm, prefix in targets))
    b.value(1, 2**32, *((prm, prefix + "mods.dropout_offset") for prm, prefix in targets))


class _TmaMaps:
    """The tensor maps of a launch through TMA (the forward's Q, K, V: config.FwdSm90WsConfig, and in float32
    config.FwdSm90Tf32Config; the backward's Q, dO, K, V: config.BwdSm90WsConfig, config.BwdSm90SplitConfig), one
    per operand with its box (rows, columns): a map holds its array's address, so every call needs its own (a plan
    derives them from the addresses, `words`). The maps of the last address tuples seen are kept (a loop over the
    same buffers, or CuPy's pool handing the same blocks back, reuses them: one dict lookup and one copy instead of a
    cuTensorMapEncodeTiled call of ~1 us per map). Threads replaying one plan share the cache: a hit is one dict
    read, a miss changes it under a lock. params_type: the kernel's argument struct (_tma.FwdWsParams,
    _tma.BwdWsParams), maps first, then the plain params in its field `inner`."""

    CACHED = 16  # address tuples kept

    def __init__(self, dtype: str, dims: tuple, boxes: tuple, params_type, inner: str):
        self.dtype, self.dims, self.boxes = dtype, dims, boxes
        self.params_type, self.inner = params_type, inner
        self.cache: dict = {}
        self.lock = threading.Lock()

    def usable(self, arrays) -> bool:
        return all(_tma.tma_unsupported(x, d, self.dtype, r, c) is None
                   for x, d, (r, c) in zip(arrays, self.dims, self.boxes))

    def words(self, ptrs: tuple):
        """The maps of these addresses (one per operand, in order), as 16 words each."""
        m = self.cache.get(ptrs)
        if m is None:
            blob = b"".join(_tma.encode_tiled(self.dtype, *_tma.operand_map(p, d, self.dtype, r, c),
                                              _tma.panel_swizzle(c, self.dtype))
                            for p, d, (r, c) in zip(ptrs, self.dims, self.boxes))
            m = memoryview(blob).cast("Q")
            with self.lock:
                if len(self.cache) >= self.CACHED:
                    del self.cache[next(iter(self.cache))]
                self.cache[ptrs] = m
        return m

    def params(self, inner_params, arrays):
        """The argument struct of the full path: these arrays' maps, then inner_params."""
        params = self.params_type()
        first = self.params_type.tma_q.offset // 8
        memoryview(params).cast("B").cast("Q")[first:first + 16 * len(self.boxes)] = \
            self.words(tuple(x.data.ptr for x in arrays))
        setattr(params, self.inner, inner_params)
        return params


# --- backward -------------------------------------------------------------------------------------------

def _backward_workspace(rows: int, kernel_head_dim: int, dq_acc: bool, turn_rows: int = 0, acc: int = 4) -> int:
    """Elements of the backward's one workspace: lse_log2 and delta (`rows` each), then with dq_acc the dq
    accumulator (rows x kernel_head_dim) and with turn_rows its ordered reductions' counters (one int32 per turn_rows
    rows); elements of `acc` bytes (float32, float64 for float64 inputs). rows is a multiple of SEQLEN_Q_PAD, so each
    part starts 512-byte aligned."""
    return rows * (2 + (kernel_head_dim if dq_acc else 0)) + (-(-rows // turn_rows * 4 // acc) if turn_rows else 0)


def backward(p, arrays, *, cu_seqlens=None, key=None, dbias=None):
    """Launch the backward of problem p (_problem.Backward) on arrays = (dout, q, k, v, out, lse, dq, dk, dv),
    the gradients None where the call did not preallocate them; returns (dq, dk, dv), and dbias after them when
    the call asks for it (p.dbias; `dbias`: the preallocated array, or None)."""
    a = p.fwd
    if p.deterministic and a.mods.bits and a.dtype in config.DTYPES and \
            not config.dq_supported(kernel_head_dim(a.head_dim, a.dtype), a.mods.bits, _launch.device_arch(a.device)):
        raise ValueError(f"deterministic=True with a sliding window and a bias or mask at head_dim={a.head_dim} is "
                         f"not available on {_launch.device_arch(a.device)} (its deterministic dQ kernel does not fit "
                         f"the registers there; Hopper has it): pass deterministic=False")
    cp = _launch.cupy()
    if p.dbias is False:
        return _backward(p, arrays, cp, cu_seqlens, key, None)
    with _launch.on_device(cp, a.device):
        stores_all = _stores_every_dbias(a)
        new = None  # dbias=True: a new array, zeroed unless the kernels store every element (what a plan repeats)
        if p.dbias is True:
            new = not stores_all
            dbias = (cp.zeros if new else cp.empty)(a.mods.bias.info.shape, dtype=cp.float32)
        elif not stores_all:
            dbias.fill(0)  # summed into (broadcast biases) or stored where some pair is visible
    return (*_backward(p, arrays, cp, cu_seqlens, key, dbias, new, not stores_all), dbias)


def _stores_every_dbias(a) -> bool:
    """Whether the main kernel of the backward of problem `a` stores every element of its dbias, so that none needs
    zeros first: a bias of the full shape (each element one pair's: plain stores, not atomic adds) in a dense call
    whose kernels visit every pair (no causal or window bound, no mask and so no tile skipped, not varlen) and that
    launches. (A zero fill of a (B, H, N, N) float32 dbias writes as many bytes as the kernel's stores.)"""
    m = a.mods
    return (not m.bias.reduces and not m.causal and m.window is None and not m.masks and not a.packed
            and min(a.batch, a.heads_q, a.seqlen_q, a.seqlen_k) > 0)


def _backward(p, arrays, cp, cu_seqlens, key, dbias, dbias_zeroed=None, dbias_cleared=False):
    """backward's launches; dbias: the float32 gradient of the bias the main kernel writes (or None), dbias_zeroed:
    None where the call passed it, else whether this call allocated it zeroed; dbias_cleared: a dbias the call passed
    was filled with zeros first (a plan does the same)."""
    a = p.fwd
    layout = a.layout
    with _launch.on_device(cp, a.device):
        grads, grad_dims = [], []
        for x, g, ref in zip(arrays[6:], p.grads, (a.q, a.k, a.v)):
            if g is None:
                x, d = _new_like(ref, layout, arrays[1].dtype, cp)
            else:
                d = g[1]
            grads.append(x)
            grad_dims.append(d)
        dq, dk, dv = grads
        if dq.size + dk.size == 0:
            return dq, dk, dv
        if (a.total_q == 0 or a.total_k == 0) if a.packed else (a.seqlen_q == 0 or a.seqlen_k == 0):
            for x in grads:  # no query or no key: no pair contributes
                x.fill(0)
            return dq, dk, dv
        dout, q, k, v, out, lse = arrays[:6]
        (q, d_q), (k, d_k), (v, d_v) = (_operand(x, i, d, layout) for x, i, d in zip((q, k, v), a.infos, (a.q, a.k, a.v)))
        doi, oi, li = p.infos
        dout, d_do = _operand(dout, doi, p.dout, layout)
        out, d_o = _operand(out, oi, p.out, layout)
        hd = kernel_head_dim(a.head_dim, a.dtype)
        bits = blocks_only("backward", a, hd, p.deterministic)
        main, kernel = _kernel("backward", a.device, hd, a.dtype, a.mods.causal, bits, p.deterministic)
        main, kernel = _steps_for_the_map(a, main, kernel, bits, p.deterministic)
        acc_hd = main.head_dim  # dQ_acc's columns: the main kernel's head dim (a padded one runs the next one's)
        tf32 = isinstance(main, config.BwdSm90Tf32Config)  # dK, dV and then dQ, both through TMA, no dQ_acc
        dqc = main.dq_config() if tf32 else None
        ordered = config.ordered_dq(main)  # deterministic dQ_acc: reductions in a fixed order, counted in turns
        has_acc = not tf32 and (ordered or not p.deterministic)
        # the kernels that read Q, dO, K, V through TMA, each with the maps of its own boxes
        tma_cfgs = (main, dqc) if tf32 else \
            (main,) if isinstance(main, (config.BwdSm90WsConfig, config.BwdSm90SplitConfig)) else ()

        def make_maps():
            return [_TmaMaps(a.dtype, (d_q, d_do, d_k, d_v),
                             ((c.block_m, c.box_cols), (c.block_m, c.box_cols), (c.block_n, c.box_cols),
                              (c.block_n, c.box_cols)), _tma.BwdWsParams, "bwd") for c in tma_cfgs]

        tma_maps = make_maps()
        if not all(m.usable((q, dout, k, v)) for m in tma_maps):
            # a view no tensor map describes (negative strides): contiguous copies
            (q, d_q), (dout, d_do), (k, d_k), (v, d_v) = (_contiguous(x, layout) for x in (q, dout, k, v))
            tma_maps = make_maps()
        maps, dq_maps = (tma_maps + [None, None])[:2]
        if a.packed:  # fp32 rows: every sequence gets a region from a multiple of SEQLEN_Q_PAD (cuda/seqs.cuh)
            pad_rows, pad_batches = (a.total_q + SEQLEN_Q_PAD * a.batch) // SEQLEN_Q_PAD * SEQLEN_Q_PAD, 1
        else:
            pad_rows, pad_batches = -(-a.seqlen_q // SEQLEN_Q_PAD) * SEQLEN_Q_PAD, a.batch
        rows = pad_batches * a.heads_q * pad_rows
        acc = 8 if a.dtype == "fp64" else 4  # bytes of a workspace element (float64 for float64 inputs)
        work_floats = _backward_workspace(rows, acc_hd, has_acc, config.turn_rows(main) if ordered else 0, acc) * acc // 4
        work = cp.empty(work_floats, dtype=cp.float32)
        dq_accum = work.data.ptr + 2 * acc * rows if has_acc else 0
        turns_off = (2 + acc_hd) * acc * rows  # (ordered: float32 workspace, int32 counters)
        params = _launch.BwdParams(
            q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr,
            lse.data.ptr, dq_accum, work.data.ptr, work.data.ptr + acc * rows, _seq(a, cu_seqlens),
            *(s for d in (d_q, d_k, d_v, d_o, d_do, *grad_dims) for s in _strides(d)),
            *p.lse_strides, pad_rows, a.heads_q, a.head_dim, acc_hd, _launch.scale_log2(a.scale), a.scale)
        params.scale_log2_d = a.scale * _launch.LOG2E  # the float64 kernels'
        params.softmax_scale_d = a.scale
        params.dq_turns = work.data.ptr + turns_off if ordered else 0
        keep = []  # a combined mask lives until the launches are queued
        if a.mods.bits:
            params.mods = mod_params(a.mods, a.scale, max(a.seqlen_q, a.seqlen_k), keep,
                                     None if dbias is None else _validate.array_info(dbias, "dbias"))
        launches = []
        pre = ElementwiseConfig("preprocess", a.dtype)
        rows_pad = -(-a.seqlen_q // SEQLEN_Q_PAD) * SEQLEN_Q_PAD  # padded region of the longest sequence
        launches.append((_launch.get_kernel(pre, a.device), (rows_pad // pre.rows_per_cta, a.heads_q, a.batch), params))
        # the main kernels (K/V-outer) that skip the query tiles a BlockMask's map, or the key blocks a key_padding_mask's,
        # empties
        main_maps = isinstance(main, (config.BwdConfig, config.BwdSm90Config, config.BwdSm90Tf32Config))
        if a.mods.masks:
            tiles = _block_map(a.mods, main.block_m, main.block_n, keep, transposed=True, padding=main_maps)
            if tiles is not None:
                params.mods.block_map = tiles
        # the TMA kernels take the tensor maps in front of (a copy of) the completed params
        main_params = params if maps is None else maps.params(params, (q, dout, k, v))
        dq_params = None if dq_maps is None else dq_maps.params(params, (q, dout, k, v))
        if dq_params is not None:  # the TF32 dQ kernel (Q-outer) skips the key tiles of its own map, or reads none
            tiles = _block_map(a.mods, dqc.block_m, dqc.block_n, keep) if a.mods.masks else None
            dq_params.bwd.mods.block_map = tiles if tiles is not None else _launch.Broadcast()
        if a.seqlen_k > 0:
            launches.append((kernel, main.grid(a.batch, a.heads_kv, a.seqlen_k), main_params))
        if tf32:  # dQ straight from its own kernel (Q-outer)
            launches.append((_launch.get_kernel(dqc, a.device), dqc.grid(a.batch, a.heads_q, a.seqlen_q), dq_params))
        elif p.deterministic and not ordered:
            dqc = dq_config(hd, a.dtype, a.mods.causal, a.mods.bits)
            launches.append((_launch.get_kernel(dqc, a.device), dqc.grid(a.batch, a.heads_q, a.seqlen_q), params))
        elif (conv := config.convert_dq_config(main, a.dtype)).kind == "convert_dq_ws":
            # dQ_acc in the ws and split kernels' order: one CTA per block of their query rows
            launches.append((_launch.get_kernel(conv, a.device), (-(-a.seqlen_q // main.block_m), a.heads_q, a.batch),
                             params))
        else:  # row-major dQ_acc (conv: convert_dq)
            # 16-bit: one 16-byte chunk (8 elements) per thread; float32 / float64: one pair of elements
            chunks = a.seqlen_q * (a.head_dim // (2 if a.dtype in config.WIDE_DTYPES else 8))
            launches.append((_launch.get_kernel(conv, a.device), (-(-chunks // conv.threads), a.heads_q, a.batch),
                             params))
        stream = cp.cuda.get_current_stream().ptr
        for kern, grid, prm in launches:
            kern.launch(grid, prm, stream)
        if key is not None and _same((dout, q, k, v, out), arrays):  # no operand copied: replay this
            # arrays of a replay: dout, q, k, v, out, lse, dq, dk, dv (None where not given), the ALiBi slopes, the
            # bias, the mask and the key_padding_mask, a preallocated dbias (or None), and of a packed call
            # cu_seqlens_q, cu_seqlens_k; extra: the dropout seed and offset
            n = 14 if cu_seqlens is None else 16
            given_dbias = dbias is not None and dbias_zeroed is None
            b = _plan.PlanBuilder(a.device, n)
            # every pointer goes to params and, for a TMA kernel, to its copy of them
            targets = ((params, ""),) if maps is None else ((params, ""), (main_params, "bwd."))
            if dq_params is not None:
                targets += ((dq_params, "bwd."),)
            _bind_mods(b, a.mods, 9, targets)
            # the maps, made per call as above: the main kernels' and the TF32 dQ kernel's each where its keys span
            # two or more of its key tiles (the dQ kernel's tiles are narrower: it may have one where the main has none)
            if main_maps and (pm := padding_map(a.mods, main.block_n)) is not None:
                b.make(pm, (12,), *((prm, pre_ + "mods.block_map.ptr") for prm, pre_ in targets[:2]))
            if dq_params is not None and (pm := padding_map(a.mods, dqc.block_n)) is not None:
                b.make(pm, (12,), (dq_params, "bwd.mods.block_map.ptr"))
            for i, field in enumerate(("dout", "q", "k", "v", "o", "lse")):
                for prm, pre_ in targets:
                    b.bind(i, prm, pre_ + field)
            if cu_seqlens is not None:
                for i, field in ((14, "seq.cu_seqlens_q"), (15, "seq.cu_seqlens_k")):
                    for prm, pre_ in targets:
                        b.bind(i, prm, pre_ + field)
            if dbias_zeroed is not None:  # dbias=True: the new gradient (allocated first, as backward does)
                b.alloc(dbias.shape, dbias.dtype, *((prm, pre_ + "mods.dbias.ptr") for prm, pre_ in targets),
                        zeroed=dbias_zeroed)
            elif given_dbias:  # array 13, zeroed per call where the kernels add into it
                for prm, pre_ in targets:
                    b.bind(13, prm, pre_ + "mods.dbias.ptr")
                if dbias_cleared:
                    b.clear(13)
            for i, (g, field) in enumerate(zip(p.grads, ("dq", "dk", "dv"))):
                if g is None:
                    b.alloc(grads[i].shape, grads[i].dtype, *((prm, pre_ + field) for prm, pre_ in targets))
                else:
                    for prm, pre_ in targets:
                        b.bind(6 + i, prm, pre_ + field)
            work_fields = (("lse_log2", 0), ("delta", acc * rows)) + \
                ((("dq_accum", 2 * acc * rows),) if has_acc else ()) + ((("dq_turns", turns_off),) if ordered else ())
            b.scratch(work_floats, *((prm, pre_ + f, off) for prm, pre_ in targets for f, off in work_fields))
            if maps is not None:  # the maps hold the addresses of q, dout, k, v (arrays 1, 0, 2, 3)
                b.derive((1, 0, 2, 3), main_params, "tma_q", maps.words)
            if dq_maps is not None:
                b.derive((1, 0, 2, 3), dq_params, "tma_q", dq_maps.words)
            for kern, grid, prm in launches:
                b.launch(kern, grid, prm)
            given = [6 + i for i, g in enumerate(p.grads) if g is not None]
            infos = (doi, *a.infos, oi, li, *(None if g is None else g[0] for g in p.grads), a.mods.alibi)
            if given_dbias:  # checked against every array of the call, as the full path checks it
                masks = {x.info.name: x.info for x in a.mods.masks}
                infos += (a.mods.bias.info, masks.get("mask"), masks.get("key_padding_mask"), p.dbias)
            new = iter(range(n + (dbias_zeroed is not None), n + 4))
            returns = tuple(6 + i if g is not None else next(new) for i, g in enumerate(p.grads))
            if dbias is not None:  # (backward returns it after dq, dk, dv)
                returns += (13 if given_dbias else n,)
            writes = (*given, 13) if given_dbias else tuple(given)
            _plan.plans.put(key, b.plan(aligned=(0, 1, 2, 3, 4, *given), writes=writes,
                                        extents=tuple(None if i is None else _plan.relative_extent(i)
                                                      for i in (*infos, *(None,) * (n - len(infos)))),
                                        returns=returns))
    return dq, dk, dv


# --- KV-cache decoding ----------------------------------------------------------------------------------

_num_sms: dict = {}


def _sm_count(device: int) -> int:
    if device not in _num_sms:
        from cupy.cuda import runtime

        _num_sms[device] = runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device)
    return _num_sms[device]


MAX_SPLITS = 128  # the merge keeps the lse of 4 x 32 splits in registers: cuda/fwd.cuh MAX_SPLITS
# CTAs per SM that the split-KV launch aims at, by the DRAM bandwidth per SM. A decode CTA keeps one 32 KB K/V tile
# in flight while it computes on another (config.DECODE_STAGES), so one CTA per SM moves about one tile per load
# latency. Measured with tools/tune_decode.py (bf16, D 128, 32/8 heads), one full wave either way:
#   H100 80GB HBM3 (3.35 TB/s over 132 SMs, 25 GB/s per SM): one CTA per SM faster at every batch: B=1 32k keys
#     57.0 us (16 splits, 128 CTAs) vs 62.1 (32 splits, 256 CTAs); 128k 184 vs 194 us; B=2 32k 99 vs 117 us; B=8
#     32k 357 vs 364 us; B=8 128k 1369 vs 1409 us (a second CTA halves each split's work and doubles the merge's);
#   H200 (4.8 TB/s, 37 GB/s per SM), 2026-11-29: two CTAs per SM faster: B=1 32k 41.8 us vs 44.9, 128k 129.1 vs
#     145.8; B=8 8k 69.8 vs 78.4, 32k 244.4 vs 284.3, 128k 945 vs 1086 (cuDNN through SDPA: 41.3, 128.1, 69.5,
#     243.2, 936.2); deeper pipelines (3 or 4 stages) at one CTA per SM were no faster (44.9-46.8 us at B=1 32k).
# So from DECODE_TWO_CTAS_GBPS_PER_SM of peak DRAM bandwidth per SM on (between the two), two CTAs per SM.
DECODE_TWO_CTAS_GBPS_PER_SM = 30.0
# CTAs of the decode kernel one SM holds at most: the splits above plan waves of one or two CTAs per SM, and a decode
# kernel whose registers and shared memory would let three share an SM (head dims 32 to 96) is launched with padded
# shared memory so that two do (_launch._Kernel.at_most). Uncapped, a launch of a wave or more (large batches: no
# split) ran as 1.3 waves of three CTAs per SM, the last 0.3 at one CTA per SM: on an H200 (2026-12-03, bf16, 32 / 8
# heads, B 64, 1k / 8k / 32k keys, side by side in one process) capped launches took 0.80-0.98x the time of the
# same kernels uncapped at head dims 32, 64 and 96 (0.72-0.91x with the 128-key tiles at 32); launches of less than
# a wave (B 1 and 8) are unchanged. Leaving three and telling the split heuristic so was slower with the shipped tiles:
# 1.10-1.29x the capped time at B 64 with 1k keys, 0.99-1.14x elsewhere. Not measured on an H100.
DECODE_MAX_CTAS_PER_SM = 2
_decode_ctas: dict = {}


def dram_gbps(device: int) -> float | None:
    """Peak DRAM bandwidth of `device` in GB/s (2 transfers per memory clock x bus width), None if the driver does not
    report the memory clock or bus width."""
    from cupy.cuda import runtime

    try:
        clock_khz = runtime.deviceGetAttribute(runtime.cudaDevAttrMemoryClockRate, device)
        bus_bits = runtime.deviceGetAttribute(runtime.cudaDevAttrGlobalMemoryBusWidth, device)
    except Exception:  # noqa: BLE001 - an attribute this driver does not report
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz > 0 and bus_bits > 0 else None


def decode_ctas_per_sm(device: int) -> int:
    """CTAs per SM the split-KV decode launch aims at on `device` (see DECODE_TWO_CTAS_GBPS_PER_SM): 2 where the DRAM
    bandwidth per SM needs two K/V tiles in flight per SM, else 1 (also when the bandwidth is not reported)."""
    if device not in _decode_ctas:
        gbps = dram_gbps(device)
        _decode_ctas[device] = 2 if gbps is not None and gbps / _sm_count(device) >= DECODE_TWO_CTAS_GBPS_PER_SM else 1
    return _decode_ctas[device]


# Split-KV merge in the decode launch itself (the last split of each row block merges; cuda/fwd.cuh
# fwd_decode_finish) rather than in a second launch of fwd_combine_kernel.
DECODE_FUSED_MERGE = True

# Counters of the one-launch merge and of the persistent forward's work queue: one int32 buffer per (device,
# stream). Launches on one stream run in order and each leaves its counters at zero, so they can share a buffer;
# launches on different streams may overlap, so they get their own. The per-thread default stream is one handle
# (cudaStreamPerThread) for a different stream in every host thread: its buffers are kept per thread as well.
_split_counters: dict = {}
_split_counters_lock = threading.Lock()
PER_THREAD_STREAM = 2  # cudaStreamPerThread (CuPy: cupy.cuda.Stream.ptds)


def _counters_key(device: int, stream: int) -> tuple:
    return (device, stream, threading.get_ident()) if stream == PER_THREAD_STREAM else (device, stream)


def _split_workspace(cp, device: int, stream: int, splits: int, accum_rows: int, hd: int, counter_rows: int):
    """(workspace, o_accum, lse_accum, split_counters) of a split-KV launch: one fp32 workspace holding o_accum
    (splits, batch, heads, seqlen_q, hd), then lse_accum (splits, batch, heads, seqlen_q), 128-byte aligned (hd is a
    multiple of 32); the counters of the merge in the decode launch (0 when fwd_combine_kernel merges). The caller
    keeps the workspace referenced until its launches are queued."""
    rows = splits * accum_rows
    work = cp.empty(rows * (hd + 1), dtype=cp.float32)
    counters = _split_counter_ptr(cp, device, stream, 2 * counter_rows) if DECODE_FUSED_MERGE else 0
    return work, work.data.ptr, work.data.ptr + 4 * rows * hd, counters


def _split_counter_ptr(cp, device: int, stream: int, n: int) -> int:
    """Address of at least n zeroed split counters for launches on `stream` of `device` (the current one)."""
    key = _counters_key(device, stream)
    buf = _split_counters.get(key)
    if buf is None or buf.size < n:
        with _split_counters_lock:
            buf = _split_counters.get(key)
            if buf is None or buf.size < n:  # zeroed on this stream, before the launch that uses it
                buf = cp.zeros(max(n, 1024), dtype=cp.int32)
                _split_counters[key] = buf
    return buf.data.ptr


def _queue_ptr(device: int, stream: int) -> int:
    """Address of a persistent forward's work queue (two int32 counters, zero between launches) for launches on
    `stream` of `device`: the first two split counters of that stream (launches on one stream run in order, and
    each leaves the counters it used at zero)."""
    buf = _split_counters.get(_counters_key(device, stream))
    return buf.data.ptr if buf is not None else _split_counter_ptr(_launch.cupy(), device, stream, 2)


@lru_cache(maxsize=4096)  # on the host path of every decode call: a dict lookup, not 128 trials
def num_splits_heuristic(ctas: int, key_blocks: int, num_sms: int, ctas_per_sm: int = 2) -> int:
    """Split-KV factor for a decode launch of `ctas` CTAs (row blocks x heads x batch) over `key_blocks`
    key tiles per sequence, on `num_sms` SMs that each hold `ctas_per_sm` of these CTAs at once.

    Decoding reads K/V once and is bound by memory bandwidth, which takes many loads in flight on every
    SM, so the launch should fill the machine, and fill it evenly: a launch of 1.2 waves leaves most SMs
    idle for its last 0.2 wave (on an H100, 64 CTAs split 5 ways made 320 CTAs for 264 slots and read the
    cache at 77-81% of the bandwidth that a 1-wave launch reaches). The factor is the smallest one whose
    waves are at least 95% full (a wave of `num_sms * ctas_per_sm` CTAs), or else the fullest, among
    those that leave each split at least 4 key tiles (256 keys), so the merge stays a small fraction of
    the work. A launch of one wave or more is split only to even out its last wave, and one of 4 waves
    or more is left whole (the SMs' schedulers already smooth the last of many waves). A short cache that
    leaves SMs idle even at 4 tiles per split is split further, down to one tile per split, up to one
    wave: there a split's time is its first load and its tiles' arithmetic, not bandwidth (on an H100, B=1,
    1024 keys: 11.2 us at 16 splits of one tile against 14.2 us at 4 splits of four)."""
    slots = max(1, num_sms * max(1, ctas_per_sm))
    if ctas <= 0 or key_blocks <= 0 or ctas >= 4 * slots:
        return 1
    most = max(1, min(key_blocks // 4, MAX_SPLITS))
    if ctas * most < slots:
        most = max(most, min(key_blocks, MAX_SPLITS, slots // ctas))

    def fill(s: int) -> float:  # work of the launch over the slot-time it occupies
        waves = ctas * s / slots
        return waves / math.ceil(waves)

    fills = {s: fill(s) for s in range(1, most + 1)}
    good = [s for s, f in fills.items() if f >= 0.95]
    return good[0] if good else max(fills, key=lambda s: (fills[s], -s))


def _decode_lengths(cp, p, cache_seqlens, block_table, index_arrays=(None, None)):
    """The most keys a sequence attends (the capacity without check_inputs); with check_inputs, the host check of
    the values of cache_seqlens, block_table, cache_batch_idx and cache_leftpad (one synchronization) first."""
    m = p.dims
    max_len = m.capacity
    if p.check_inputs:  # before anything is written: a rejected call leaves the caches untouched
        lens_host = cache_seqlens if p.is_count else cp.asnumpy(cache_seqlens)
        batch_idx, leftpad = (None if x is None else cp.asnumpy(x) for x in index_arrays)
        max_len = _validate.check_kvcache_values(lens_host, None if block_table is None else cp.asnumpy(block_table),
                                                 m.capacity, m.s_new, m.num_blocks, m.page_size, leftpad, batch_idx)
    return max_len


def _band_keys(mods, max_len: int, seqlen_q: int) -> int:
    """Keys one query row block of a decode launch visits at most: a window bounds them."""
    if mods is None or mods.window is None:
        return max_len
    left, right = mods.window
    if left < 0 or right < 0:
        return max_len
    return min(max_len, left + right + seqlen_q)


def _decode_splits(cp, device, stream, m, max_len, block_n, grid_rows, hd):
    """(splits, workspace or None, o_accum, lse_accum, counters) of a decode launch."""
    ctas = grid_rows
    splits = m.num_splits or num_splits_heuristic(ctas, -(-max_len // block_n), _sm_count(device),
                                                  decode_ctas_per_sm(device))
    if splits == 1:
        return 1, None, 0, 0, 0
    work, o_accum, lse_accum, counters = _split_workspace(cp, device, stream, splits, m.batch * m.heads_q * m.seqlen_q,
                                                          hd, ctas)
    return splits, work, o_accum, lse_accum, counters


class _DecodeStep:
    """A decode plan's per-call step (`_plan.replay`): the cache lengths (an int cache_seqlens is bound by value;
    check_inputs reads the values back), and the split factor and workspace they decide."""

    def __init__(self, p, device, block_n, row_blocks, grid_heads, hd, before, kernel, main_t, combine):
        m = p.dims
        self.p, self.block_n, self.row_blocks, self.grid_heads, self.hd = p, block_n, row_blocks, grid_heads, hd
        self.before, self.kernel, self.main_t, self.combine = before, kernel, main_t, combine
        self.ctas = row_blocks * grid_heads * m.batch
        self.cache_seqlen = 0 if m.cache_seqlen is None else m.cache_seqlen
        self.num_sms, self.ctas_per_sm = _sm_count(device), decode_ctas_per_sm(device)

    def __call__(self, plan, arrays, cache_seqlens, blocks, stream):
        p = self.p
        m = p.dims
        cache_seqlen = self.cache_seqlen
        if p.is_count and cache_seqlens is not None:
            cache_seqlen = int(cache_seqlens)
            if cache_seqlen < 0 or cache_seqlen + m.s_new > m.capacity:
                return None
        cp = _launch.cupy()
        max_len = _decode_lengths(cp, p, cache_seqlens, arrays[6], arrays[7:9]) if p.check_inputs else m.capacity
        if self.before:
            blocks[self.before[0][2]][0].cache_seqlen = cache_seqlen
        main = blocks[self.main_t][0]
        main.seq.seqlen_k = cache_seqlen
        splits = m.num_splits or num_splits_heuristic(self.ctas, -(-_band_keys(p.mods, max_len, m.seqlen_q) //
                                                                   self.block_n), self.num_sms, self.ctas_per_sm)
        main.num_splits = splits
        work = None
        if splits == 1:  # this thread's block may hold an earlier call's workspace
            main.o_accum = main.lse_accum = main.split_counters = None
        else:
            work, main.o_accum, main.lse_accum, main.split_counters = _split_workspace(
                cp, plan.device, stream, splits, m.batch * m.heads_q * m.seqlen_q, self.hd, self.ctas)
        launches = self.before + ((self.kernel, (self.row_blocks, self.grid_heads, m.batch * splits), self.main_t),)
        if splits > 1 and not DECODE_FUSED_MERGE:
            comb, grid = self.combine
            launches += ((_launch.get_kernel(comb, plan.device), grid, self.main_t),)
        return launches, work


KVCACHE_ARRAYS = 12  # the arrays an attention_with_kvcache plan is replayed on (`decode`)


def decode(p, arrays, cache_seqlens, *, key=None):
    """Launch attention_with_kvcache of problem p (_problem.Kvcache) on arrays = (q, k_cache, v_cache, k, v,
    cache_seqlens array or None, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, alibi_slopes,
    each None when absent); cache_seqlens: the call's argument (None, an int or the array)."""
    m = p.dims
    cp = _launch.cupy()
    q, k_cache, v_cache, k, v, lens, block_table, batch_idx, leftpad, cos, sin, _ = arrays
    qi, kci, vci, ki, vi, lens_info, bti = p.infos
    with _launch.on_device(cp, m.device):
        max_len = _decode_lengths(cp, p, cache_seqlens, block_table, (batch_idx, leftpad))
        o = cp.empty((m.batch, m.seqlen_q, m.heads_q, m.head_dim), dtype=q.dtype)
        lse = cp.empty((m.batch, m.heads_q, m.seqlen_q), dtype=cp.float32)
        if m.batch == 0:
            return (o, lse) if p.return_lse else o
        stream = cp.cuda.get_current_stream().ptr
        lens_ptr = None if p.is_count else lens.data.ptr  # keys cached per sequence (device), or ...
        cache_seqlen = 0 if m.cache_seqlen is None else m.cache_seqlen  # ... the same count for all
        bt_ptr = block_table.data.ptr if m.paged else None
        dkc, dvc = m.k_cache, m.v_cache  # paged: Dims of (num_pages, page_size, heads_kv, head_dim)
        given = (q, k, v)
        batch_idx_ptr = 0 if batch_idx is None else batch_idx.data.ptr
        append = q_rot = None
        q, dq = _operand(q, qi, m.q, "bshd")
        operands = [q]  # as given, or copies (then the call is not planned)
        if m.s_new:  # append k, v at positions cache_seqlens[b] .. + S_new - 1: one launch, no host sync
            k, dk = _operand(k, ki, m.k, "bshd")
            v, dv = _operand(v, vi, m.v, "bshd")
            operands += [k, v]
            append = _launch.AppendParams(
                k.data.ptr, v.data.ptr, k_cache.data.ptr, v_cache.data.ptr, lens_ptr, bt_ptr,
                *(s for d in (dk, dv, dkc, dvc) for s in _strides(d)),
                cache_seqlen, m.s_new, m.heads_kv, m.head_dim, m.page_size if m.paged else 0, m.block_table_stride,
                batch_idx_ptr)
            chunks = m.s_new * m.heads_kv * (m.head_dim // 8)
            r = m.rotary
            if r is not None:  # rotate the new keys on their way into the cache, and q into a copy that the decode reads
                q_rot = cp.empty((m.batch, m.seqlen_q, m.heads_q, m.head_dim), dtype=q.dtype)
                append.rotary_cos, append.rotary_sin = cos.data.ptr, sin.data.ptr
                append.q, append.q_rot = q.data.ptr, q_rot.data.ptr
                append.q_batch_stride, append.q_row_stride, append.q_head_stride = _strides(dq)
                append.rotary_row_stride, append.rotary_dim = r.row_stride, r.dim
                append.rotary_interleaved, append.rotary_kind = int(r.interleaved), r.kind
                append.seqlen_q, append.heads_q = m.seqlen_q, m.heads_q
                append.q_pos_step = int(p.causal or (p.mods is not None and p.mods.window is not None))
                chunks += m.seqlen_q * m.heads_q * (m.head_dim // 8)
                q = q_rot
                dq = dq._replace(batch_stride=m.seqlen_q * m.heads_q * m.head_dim, row_stride=m.heads_q * m.head_dim,
                                 head_stride=m.head_dim)
            app = AppendConfig(m.dtype)
            append_launch = (_launch.get_kernel(app, m.device), (-(-chunks // app.threads), m.batch, 1))
            append_launch[0].launch(append_launch[1], append, stream)
        if o.size == 0:
            return (o, lse) if p.return_lse else o

        # Grouped query heads are packed as rows (cuda/fwd.cuh): one K/V tile read serves the whole group (with
        # ALiBi each row takes its own query head's slope).
        group = m.heads_q // m.heads_kv
        mods = p.mods
        bits = 0 if mods is None else mods.bits
        rows_per_pos, grid_heads = (group, m.heads_kv) if group > 1 else (1, m.heads_q)
        hd = kernel_head_dim(m.head_dim)
        cfg, kernel = _kernel("decode", m.device, hd, m.dtype, p.causal, bits)
        kernel = kernel.at_most(DECODE_MAX_CTAS_PER_SM, m.device)
        row_blocks = -(-m.seqlen_q * rows_per_pos // cfg.block_m)
        splits, work, o_accum, lse_accum, counters = _decode_splits(
            cp, m.device, stream, m, _band_keys(mods, max_len, m.seqlen_q), cfg.block_n,
            row_blocks * grid_heads * m.batch, hd)
        page_strides, bt_stride, page_size = (0, 0), 0, 0
        if m.paged:  # pages are indexed from the cache base (no batch stride)
            page_strides, bt_stride, page_size = (dkc.batch_stride, dvc.batch_stride), m.block_table_stride, m.page_size
            dkc, dvc = dkc._replace(batch_stride=0), dvc._replace(batch_stride=0)
        # packed rows: grid.y runs over K/V heads, so no further query-head -> K/V-head division
        seq = _launch.seq_params(m.seqlen_q, cache_seqlen, 1 if rows_per_pos > 1 else group, seqused_k=lens_ptr,
                                 seqlen_k_new=m.s_new)
        params = _launch.FwdParams(
            q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, o.data.ptr, lse.data.ptr, seq, bt_ptr, o_accum,
            lse_accum, counters, *_strides(dq), *_strides(dkc), *_strides(dvc),
            m.seqlen_q * m.heads_q * m.head_dim, m.heads_q * m.head_dim, m.head_dim, m.heads_q * m.seqlen_q, m.seqlen_q,
            *page_strides, m.heads_q, m.head_dim, bt_stride, page_size, splits, rows_per_pos,
            p.scale * _launch.LOG2E, hd)
        if mods is not None:
            params.mods = mod_params(mods, p.scale, m.capacity + m.seqlen_q)
        params.cache_batch_idx = batch_idx_ptr
        params.leftpad_k = 0 if leftpad is None else leftpad.data.ptr
        kernel.launch((row_blocks, grid_heads, m.batch * splits), params, stream)
        comb = CombineConfig(m.dtype)
        combine = (comb, (-(-m.heads_q * m.seqlen_q // comb.rows_per_cta), m.batch, 1))
        if splits > 1 and not DECODE_FUSED_MERGE:
            _launch.get_kernel(comb, m.device).launch(combine[1], params, stream)
        if key is not None and _same(tuple(operands), given[:len(operands)]):  # no operand copied: replay this
            n = KVCACHE_ARRAYS
            b = _plan.PlanBuilder(m.device, n)
            if q_rot is None:
                b.bind(0, params, "q")
            for i, field in ((1, "k"), (2, "v"), (5, "seq.seqused_k"), (6, "block_table"), (7, "cache_batch_idx"),
                             (8, "leftpad_k"), (11, "mods.alibi_slopes")):
                b.bind(i, params, field)
            b.alloc(o.shape, o.dtype, (params, "o"))
            b.alloc(lse.shape, lse.dtype, (params, "lse"))
            before = ()
            if append is not None:
                for i, field in ((1, "k_cache"), (2, "v_cache"), (3, "k_new"), (4, "v_new"), (5, "cache_seqlens"),
                                 (6, "block_table"), (7, "cache_batch_idx"), (9, "rotary_cos"), (10, "rotary_sin")):
                    b.bind(i, append, field)
                if q_rot is not None:  # the decode reads the rotated copy of q, a new array per call
                    b.bind(0, append, "q")
                    b.alloc(q_rot.shape, q_rot.dtype, (append, "q_rot"), (params, "q"))
                b.launch(*append_launch, append)
                before = ((*append_launch, b.template(append)),)
            b.launch(kernel, (row_blocks, grid_heads, m.batch), params)
            step = _DecodeStep(p, m.device, cfg.block_n, row_blocks, grid_heads, hd, before, kernel, b.template(params),
                               combine)
            aligned = (0, 1, 2, 3, 4) if m.s_new else (0, 1, 2)
            writes, extents = (), ()
            if m.s_new:  # the caches are written: they must not meet each other or anything the call reads
                writes = (1, 2)
                r = m.rotary
                infos = p.infos + p.index_infos + ((None, None) if r is None else (r.cos, r.sin)) + (
                    None if p.mods is None else p.mods.alibi,)
                extents = tuple(None if i is None else _plan.relative_extent(i) for i in infos)
            _plan.plans.put(key, b.plan(aligned=aligned, writes=writes, extents=extents,
                                        returns=(n, n + 1) if p.return_lse else n, step=step))
    return (o, lse) if p.return_lse else o
