"""Host side of the warp-specialized Hopper kernels (cuda/fwd_sm90_ws.cuh, cuda/bwd_sm90_ws.cuh, and the FP8 and
float32 forwards, cuda/fwd_sm90_fp8.cuh, cuda/fwd_sm90_tf32.cuh): TMA tensor maps, the params structs with the maps in
front of FwdParams / BwdParams (their configs are config.FwdSm90WsConfig, config.BwdSm90WsConfig,
config.FwdSm90Fp8Config and config.FwdSm90Tf32Config; the float32 forward takes FwdWsParams).

A tensor map (CUtensorMap, 128 opaque bytes) describes one operand to the TMA unit: its global address, sizes and
byte strides, the box one copy moves and the shared-memory swizzle. The driver's `cuTensorMapEncodeTiled` makes
it; CuPy does not expose it, so it is called here through ctypes from libcuda.so.1 (the driver CuPy itself runs
on): no new dependency, and a call costs about a microsecond, where `cuda.bindings.driver` would add a package
and its own per-call conversions. The maps hold the array addresses, so they are encoded for every call.

Each operand is a 4-d map over (head_dim, seqlen, heads, batch) with the array's real strides, in either layout
(bshd or bhsd) and for strided views; a packed (varlen) operand (total, heads, head_dim) is the same map with
seqlen = total and batch = 1, and the kernel adds cu_seqlens[b] to the row coordinate of sequence b. TMA must accept
the strides: base address 16-byte aligned, every byte
stride a multiple of 16 (row, head and batch strides multiples of 8 elements). `tma_unsupported` says why an
array does not qualify; the caller then copies it to a contiguous array. Boxes are one swizzle panel wide (64
columns with a 128-byte swizzle; where the head dim is not a multiple of 64, and in the backward at head dim 64,
32-column panels with a 64-byte swizzle) by
BLOCK_M (Q, dO) or BLOCK_N (K, V) rows; rows past the array and columns past head_dim are zero-filled by TMA
(sequence tails, a head_dim below the kernel's). In a packed array the rows past a sequence's end are the
next sequence's: the kernel masks those keys and does not store those query rows.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from . import _launch, config

# cuda.h: CUtensorMapDataType, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
# CUtensorMapFloatOOBfill
# CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16, _UINT8 (e4m3 bits), _FLOAT32 (the float32 forward's operands, "tf32"
# precision included)
_DATA_TYPE = {"fp16": 6, "bf16": 9, "fp8": 0, "fp32": 7, "tf32": 7}
_INTERLEAVE_NONE = 0
_SWIZZLE = {0: 0, 64: 2, 128: 3}  # bytes -> CU_TENSOR_MAP_SWIZZLE_NONE, _64B, _128B
_L2_PROMOTION_256B = 3
_OOB_FILL_ZERO = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zeros

TENSOR_MAP_BYTES = 128
ELEM_BYTES = 2
_ELEM_BYTES = {"fp16": 2, "bf16": 2, "fp8": 1, "fp32": 4, "tf32": 4}  # bytes per element of each map dtype
BOX_COLS = config.TMA_BOX_COLS


class TmaDesc(ctypes.Structure):
    """Mirror of cuflash::TmaDesc: one CUtensorMap (128 bytes; 64-byte aligned on the C++ side, where the
    offsets in FwdWsParams below keep it so)."""

    _fields_ = [("v", ctypes.c_uint64 * 16)]


class FwdWsParams(ctypes.Structure):
    """Mirror of cuflash::FwdWsParams (cuda/fwd_sm90_ws.cuh): the Q, K, V tensor maps at byte offsets 0, 128,
    256, then FwdParams at 384, m_blocks and items (the work items, config.FwdSm90WsConfig.schedule) at 904 and
    908, the work queue's two int32 counters (or null) at 912; 960 bytes in all (the C++ struct is padded to its
    64-byte alignment)."""

    _fields_ = [("tma_q", TmaDesc), ("tma_k", TmaDesc), ("tma_v", TmaDesc), ("fwd", _launch.FwdParams),
                ("m_blocks", ctypes.c_int32), ("items", ctypes.c_int32), ("queue", ctypes.c_void_p),
                ("_pad", ctypes.c_ubyte * (960 - 3 * TENSOR_MAP_BYTES - ctypes.sizeof(_launch.FwdParams) - 16))]


class BwdWsParams(ctypes.Structure):
    """Mirror of cuflash::BwdWsParams (cuda/bwd_sm90_ws.cuh): the Q, dO, K, V tensor maps at byte offsets 0, 128,
    256, 384, then BwdParams at 512; 1152 bytes in all (the C++ struct is padded to its 64-byte alignment)."""

    _fields_ = [("tma_q", TmaDesc), ("tma_do", TmaDesc), ("tma_k", TmaDesc), ("tma_v", TmaDesc),
                ("bwd", _launch.BwdParams),
                ("_pad", ctypes.c_ubyte * (1152 - 4 * TENSOR_MAP_BYTES - ctypes.sizeof(_launch.BwdParams)))]


class Descale(ctypes.Structure):
    """Mirror of cuflash::Descale (cuda/fwd_sm90_fp8.cuh): one tensor's float32 descale factors, element (batch,
    head, 128-row block) at ptr + batch * batch_stride + head * head_stride + block * block_stride (elements; 0
    broadcasts)."""

    _fields_ = [("ptr", ctypes.c_uint64), ("batch_stride", ctypes.c_int32), ("head_stride", ctypes.c_int32),
                ("block_stride", ctypes.c_int32), ("unused", ctypes.c_int32)]


class FwdFp8Params(ctypes.Structure):
    """Mirror of cuflash::FwdFp8Params (cuda/fwd_sm90_fp8.cuh): the Q, K, V tensor maps (uint8) at 0, 128, 256,
    FwdParams at 384, the q, k, v descales at 904, 928, 952, m_blocks and items at 976, 980, the work queue's two int32
    counters (or null) at 984; 1024 bytes in all."""

    _fields_ = [("tma_q", TmaDesc), ("tma_k", TmaDesc), ("tma_v", TmaDesc), ("fwd", _launch.FwdParams),
                ("q_descale", Descale), ("k_descale", Descale), ("v_descale", Descale),
                ("m_blocks", ctypes.c_int32), ("items", ctypes.c_int32), ("queue", ctypes.c_void_p),
                ("_pad", ctypes.c_ubyte * (1024 - 3 * TENSOR_MAP_BYTES - ctypes.sizeof(_launch.FwdParams) - 3 * 24 - 16))]


# The C++ side static_asserts the same layouts.
assert ctypes.sizeof(TmaDesc) == 128 and ctypes.sizeof(FwdWsParams) == 960 and ctypes.sizeof(BwdWsParams) == 1152
assert ctypes.sizeof(Descale) == 24 and ctypes.sizeof(FwdFp8Params) == 1024
assert (FwdFp8Params.fwd.offset, FwdFp8Params.q_descale.offset, FwdFp8Params.k_descale.offset,
        FwdFp8Params.v_descale.offset, FwdFp8Params.m_blocks.offset, FwdFp8Params.items.offset,
        FwdFp8Params.queue.offset) == (384, 904, 928, 952, 976, 980, 984)
assert (FwdWsParams.tma_q.offset, FwdWsParams.tma_k.offset, FwdWsParams.tma_v.offset, FwdWsParams.fwd.offset,
        FwdWsParams.m_blocks.offset, FwdWsParams.items.offset) == (0, 128, 256, 384, 904, 908)
assert (BwdWsParams.tma_q.offset, BwdWsParams.tma_do.offset, BwdWsParams.tma_k.offset, BwdWsParams.tma_v.offset,
        BwdWsParams.bwd.offset) == (0, 128, 256, 384, 512)


# --- cuTensorMapEncodeTiled -------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _encode_fn():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"TMA tensor maps need the CUDA driver (libcuda.so.1), which could not be loaded: {e}") from e
    fn = lib.cuTensorMapEncodeTiled
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _encode_args_problem(dtype, global_address, dims, byte_strides, box, swizzle) -> str | None:
    """Why cuTensorMapEncodeTiled would reject these arguments (its documented rules), or None."""
    if dtype not in _DATA_TYPE:
        return f"dtype={dtype!r}; allowed: {tuple(_DATA_TYPE)}"
    rank = len(dims)
    if not 1 <= rank <= 5 or len(byte_strides) != rank - 1 or len(box) != rank:
        return f"rank {rank} with {len(byte_strides)} strides and {len(box)} box sizes (want 1-5, rank-1, rank)"
    if global_address % 16:
        return f"address {global_address:#x} is not 16-byte aligned"
    if any(not 1 <= d <= 2**32 for d in dims):
        return f"dims {tuple(dims)} must be in 1..2^32"
    if any(s <= 0 or s % 16 or s >= 2**40 for s in byte_strides):
        return f"byte strides {tuple(byte_strides)} must be positive multiples of 16 below 2^40"
    elem = _ELEM_BYTES[dtype]
    if any(not 1 <= b <= 256 for b in box) or (box[0] * elem) % 16:
        return f"box {tuple(box)}: sizes 1..256, the first a multiple of 16 bytes"
    if swizzle not in _SWIZZLE:
        return f"swizzle={swizzle!r}; allowed: {tuple(_SWIZZLE)} (bytes)"
    if swizzle and box[0] * elem > swizzle:
        return f"box {tuple(box)}: a {swizzle}-byte swizzle takes at most {swizzle} bytes per box row"
    return None


def encode_tiled(dtype: str, global_address: int, dims, byte_strides, box, swizzle: int = 128) -> bytes:
    """The 128 bytes of a tiled CUtensorMap of `dtype` ("fp16"/"bf16"; "fp8": bytes) elements at `global_address`:
    dims innermost first (elements), byte_strides of dims 1.. (dim 0 is contiguous), box sizes per dim; a `swizzle`
    of 128 or 64 bytes in shared memory (0: none), L2 promotion 256 bytes, out-of-bounds elements read as zeros."""
    problem = _encode_args_problem(dtype, global_address, dims, byte_strides, box, swizzle)
    if problem is not None:
        raise ValueError(f"cuTensorMapEncodeTiled: {problem}")
    rank = len(dims)
    buf = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)  # the driver wants the map 64-byte aligned
    addr = (ctypes.addressof(buf) + 63) & ~63
    c_dims = (ctypes.c_uint64 * rank)(*dims)
    c_strides = (ctypes.c_uint64 * max(rank - 1, 1))(*byte_strides)
    c_box = (ctypes.c_uint32 * rank)(*box)
    c_elem_strides = (ctypes.c_uint32 * rank)(*([1] * rank))
    err = _encode_fn()(addr, _DATA_TYPE[dtype], rank, global_address, c_dims, c_strides, c_box, c_elem_strides,
                       _INTERLEAVE_NONE, _SWIZZLE[swizzle], _L2_PROMOTION_256B,
                       _OOB_FILL_ZERO)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err} for dtype={dtype}, address="
                           f"{global_address:#x}, dims={tuple(dims)}, byte_strides={tuple(byte_strides)}, box={tuple(box)}")
    return ctypes.string_at(addr, TENSOR_MAP_BYTES)


# --- the maps of one call ---------------------------------------------------------------------------------------

def _pointer(x) -> int:
    """An array's device address (a CuPy array, or an int address)."""
    return x if isinstance(x, int) else x.data.ptr


def operand_map(address: int, dims, dtype: str, box_rows: int, box_cols: int = BOX_COLS):
    """(head_dim, seqlen, heads, batch) dims, byte strides and box of one operand; `dims` is Dims-like: batch,
    seqlen, heads, head_dim and batch_stride, row_stride, head_stride in elements. Its swizzle is the box row's
    bytes (`panel_swizzle`)."""
    sizes = (dims.head_dim, dims.seqlen, dims.heads, dims.batch)
    elem = _ELEM_BYTES[dtype]
    strides = [dims.row_stride * elem, dims.head_stride * elem, dims.batch_stride * elem]
    # a dimension of size 1 never steps: any valid stride describes it (CuPy may give such dims stride 0)
    for i, n in enumerate(sizes[1:]):
        if n == 1 and (strides[i] <= 0 or strides[i] % 16):
            strides[i] = 16
    return address, sizes, tuple(strides), (box_cols, box_rows, 1, 1)


def panel_swizzle(box_cols: int, dtype: str = "bf16") -> int:
    """The shared-memory swizzle (bytes) of a box one panel of `box_cols` elements wide: 16-bit 64 -> 128, 32 -> 64
    (the kernels' SmemTile panels, cuda/tiles.cuh); fp8 128 -> 128, 64 -> 64; float32 32 -> 128."""
    return box_cols * _ELEM_BYTES[dtype]


def tma_unsupported(x, dims, dtype: str, box_rows: int = 128, box_cols: int = BOX_COLS) -> str | None:
    """Why one operand (array or address, Dims-like) cannot be read through a TMA map, or None: the host then
    copies it to a contiguous array (e.g. a head stride of head_dim + 4 elements: not a multiple of 16 bytes)."""
    if dims.seqlen == 0 or dims.batch == 0 or dims.heads == 0:
        return "an empty array"
    if dims.head_dim % 8:
        return f"head_dim={dims.head_dim} is not a multiple of 8 (16-byte rows)"
    return _encode_args_problem(dtype, *operand_map(_pointer(x), dims, dtype, box_rows, box_cols),
                                panel_swizzle(box_cols, dtype))


def ws_params(fwd_params: _launch.FwdParams, q, k, v, dims_q, dims_k, dims_v, dtype: str,
              cfg: config.FwdSm90WsConfig) -> FwdWsParams:
    """FwdWsParams of a call: Q, K, V maps (q, k, v: CuPy arrays or addresses; dims_*: Dims-like, strides in
    elements, K/V heads = heads / kv_group) and a copy of `fwd_params`, which holds everything else (o, lse, their
    strides, seq lengths and cu_seqlens, kv_group, scale, score modifiers). A packed (varlen) call, fwd_params.seq
    with cu_seqlens_q and cu_seqlens_k, passes the packed arrays' dims as batch=1, seqlen=total, batch_stride=0
    (_validate.Dims of layout "packed"). Raises ValueError naming the operand TMA cannot read (tma_unsupported),
    or for a kv cache (seqused_k), which this kernel does not read."""
    seq = fwd_params.seq
    if seq.seqused_k:
        raise ValueError("fwd_sm90_ws_kernel does not read a kv cache (seqused_k must be null)")
    if bool(seq.cu_seqlens_q) != bool(seq.cu_seqlens_k):
        raise ValueError("fwd_sm90_ws_kernel takes cu_seqlens_q and cu_seqlens_k together (a packed call) or neither")
    for name, dims in (("q", dims_q), ("k", dims_k), ("v", dims_v)):
        if seq.cu_seqlens_q and dims.batch != 1:
            raise ValueError(f"{name}: a packed call's arrays are (total, heads, head_dim): pass dims with batch=1, "
                             f"not batch={dims.batch}")
    maps = []
    for name, x, dims, rows in (("q", q, dims_q, cfg.block_m), ("k", k, dims_k, cfg.block_n), ("v", v, dims_v, cfg.block_n)):
        problem = tma_unsupported(x, dims, dtype, rows, cfg.box_cols)
        if problem is not None:
            raise ValueError(f"{name} cannot be read through a TMA tensor map: {problem}")
        maps.append(encode_tiled(dtype, *operand_map(_pointer(x), dims, dtype, rows, cfg.box_cols),
                                 panel_swizzle(cfg.box_cols, dtype)))
    params = FwdWsParams()
    for field, blob in zip(("tma_q", "tma_k", "tma_v"), maps):
        ctypes.memmove(ctypes.addressof(params) + getattr(FwdWsParams, field).offset, blob, TENSOR_MAP_BYTES)
    params.fwd = fwd_params
    return params
