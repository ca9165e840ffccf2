"""Argument checks, on array metadata only, so CI can test every message without a GPU.

`array_info(x, name)` turns a user argument into an `ArrayInfo` (or raises TypeError naming the
argument and saying how to convert it); the `check_*` functions work on ArrayInfo alone, except
`check_cu_seqlens_values` and `check_kvcache_values`, which check the values of index arrays on host
(NumPy) copies that the caller reads back when check_inputs=True.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from .config import DECODE_PAGE_MULTIPLE, MAX_HEAD_DIM

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BF16 = None

FP16 = np.dtype(np.float16)
FP32 = np.dtype(np.float32)
FP64 = np.dtype(np.float64)
DTYPE_NAMES = {FP16: "fp16"}
if BF16 is not None:
    DTYPE_NAMES[BF16] = "bf16"
DTYPE_NAMES[FP32] = "fp32"
DTYPE_NAMES[FP64] = "fp64"
# the NumPy dtype of each kernel dtype name ("tf32": float32 inputs in one TF32 pass, `check_precision`)
NUMPY_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()}
NUMPY_DTYPES["tf32"] = FP32
PRECISIONS = ("fp32", "tf32")
MAX_HEAD_DIM_FP64 = 128
LAYOUTS = ("bshd", "bhsd")
MAX_SCALE_LOG2 = float(np.finfo(np.float32).max)
MAX_GRID_YZ = 65535  # heads is gridDim.y and batch gridDim.z of every launch


class ArrayInfo(NamedTuple):
    """What validation needs to know of an array: shape, dtype, strides in elements, address, device.
    (A NamedTuple: built on every call, it must be cheap; see docs/PERFORMANCE.md, launch overhead.)"""

    name: str
    shape: tuple
    dtype: np.dtype
    strides: tuple  # in elements
    ptr: int
    device: int


def _type_name(x) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


_ndarray = None  # cupy.ndarray, imported on first use so that validation runs without CuPy


def array_info(x, name: str) -> ArrayInfo:
    """Metadata of a CuPy array; a clear TypeError for anything else."""
    global _ndarray
    if _ndarray is None:
        try:
            import cupy
        except ImportError:  # pragma: no cover
            cupy = None
        _ndarray = cupy.ndarray if cupy is not None else ()
    if isinstance(x, _ndarray):  # the common case first: four attribute reads
        item = x.dtype.itemsize
        st = x.strides
        strides = tuple([s // item if s % item == 0 else s / item for s in st])
        return ArrayInfo(name, x.shape, x.dtype, strides, x.data.ptr, x.device.id)
    mod = type(x).__module__ or ""
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} is a numpy.ndarray on the host; cuflash needs a CuPy array on the GPU: "
                        f"use cupy.asarray({name})")
    if mod.startswith("torch"):
        raise TypeError(f"{name} is a {_type_name(x)}; cuflash needs a CuPy array: convert it without a copy "
                        f"with cupy.from_dlpack({name}) (the tensor must be on a CUDA device)")
    if mod.startswith("jax") or mod.startswith("jaxlib"):
        raise TypeError(f"{name} is a {_type_name(x)}; cuflash needs a CuPy array: use cupy.from_dlpack({name})")
    if _ndarray == ():  # pragma: no cover
        raise TypeError(f"{name} is a {_type_name(x)}; cuflash needs a CuPy array, and CuPy is not installed")
    raise TypeError(f"{name} is a {_type_name(x)}; cuflash needs a cupy.ndarray "
                    f"(cupy.asarray for host data, cupy.from_dlpack for other GPU frameworks)")


def check_dtype(*infos: ArrayInfo, wide: bool = True) -> str:
    """All arrays of one dtype: float16, bfloat16 or (wide) float32, float64; returns "fp16" / "bf16" / "fp32" /
    "fp64"."""
    first = infos[0]
    if first.dtype not in DTYPE_NAMES or (not wide and DTYPE_NAMES[first.dtype] in ("fp32", "fp64")):
        allowed = "float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64" if wide else \
            "float16 or bfloat16 (ml_dtypes.bfloat16)"
        fp8 = (" (uint8 arrays are FP8 e4m3 inputs, which only the forward takes: attention, attention_forward and "
               "the varlen forward functions)") if first.dtype == np.uint8 else ""
        raise TypeError(f"{first.name}.dtype={first.dtype} is not supported{fp8}; allowed: {allowed}")
    for info in infos[1:]:
        if info.dtype != first.dtype:
            raise TypeError(f"{info.name}.dtype={info.dtype} differs from {first.name}.dtype={first.dtype}; "
                            f"all inputs must have the same dtype")
    return DTYPE_NAMES[first.dtype]


def check_precision(precision, dtype: str) -> str:
    """The kernels' dtype name of a call: `dtype` (check_dtype's) with float32's precision applied: "fp32" (None
    or "fp32": 3xTF32, float32 accuracy) or "tf32" (one TF32 pass). Other dtypes take precision=None."""
    if precision is None:
        return dtype
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; allowed: None, 'fp32' (float32 inputs: 3xTF32 "
                         f"split arithmetic, float32 accuracy; the default) or 'tf32' (one TF32 pass)")
    if dtype != "fp32":
        raise ValueError(f"precision={precision!r} applies to float32 inputs only; these are "
                         f"{NUMPY_DTYPES[dtype]}: pass precision=None")
    return precision


def check_wide_head_dim(dtype: str, d: int, name: str = "q") -> None:
    if dtype == "fp64" and d > MAX_HEAD_DIM_FP64:
        raise ValueError(f"head_dim={d} (last dim of {name}) is not supported for float64; allowed: a multiple of 8 "
                         f"from 8 to {MAX_HEAD_DIM_FP64}")


def check_fp64_mods(dtype: str, alibi, softcap, dropout_p, bias, mask, key_padding_mask) -> None:
    """float64 takes causal and window alone of the score modifiers (its kernels compute the scores in float64)."""
    if dtype != "fp64":
        return
    for name, value, given in (("alibi_slopes", alibi, alibi is not None), ("softcap", softcap, bool(softcap)),
                               ("dropout_p", dropout_p, isinstance(dropout_p, numbers.Real) and dropout_p != 0),
                               ("bias", bias, bias is not None), ("mask", mask, mask is not None),
                               ("key_padding_mask", key_padding_mask, key_padding_mask is not None)):
        if given:
            shown = value if isinstance(value, numbers.Real) else f"<{type(value).__name__}>"
            raise ValueError(f"{name}={shown} is not supported with float64 inputs: float64 attention takes causal "
                             f"and window; alibi_slopes, softcap, bias, mask, key_padding_mask and dropout need "
                             f"float32, float16 or bfloat16 inputs")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; allowed: 'bshd' (batch, seqlen, heads, head_dim) "
                         f"or 'bhsd' (batch, heads, seqlen, head_dim)")
    return layout


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale={softmax_scale!r} must be a real number or None (default 1/sqrt(head_dim))")
    s = float(softmax_scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"softmax_scale={softmax_scale!r} must be finite and > 0")
    if s * 1.4426950408889634 >= MAX_SCALE_LOG2:  # the kernels take softmax_scale * log2(e) as float32
        raise ValueError(f"softmax_scale={softmax_scale!r} is too large: softmax_scale * log2(e) must fit a float32 "
                         f"(softmax_scale < {MAX_SCALE_LOG2 / 1.4426950408889634:.3g})")
    return s


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be True or False")
    return bool(value)


class Dims(NamedTuple):
    """(batch, seqlen, heads, head_dim) of one array and its strides in elements, in bshd order."""

    batch: int
    seqlen: int
    heads: int
    head_dim: int
    batch_stride: int
    row_stride: int
    head_stride: int


def bshd_dims(info: ArrayInfo, layout: str) -> Dims:
    """Read (B, S, H, D) and strides of a 4-d array in `layout`; checks rank and the last stride."""
    if len(info.shape) != 4:
        want = "(batch, seqlen, heads, head_dim)" if layout == "bshd" else "(batch, heads, seqlen, head_dim)"
        raise ValueError(f"{info.name} has shape {info.shape} (rank {len(info.shape)}); "
                         f"layout={layout!r} needs rank 4: {want}")
    if info.shape[-1] > 1 and info.strides[-1] != 1 and 0 not in info.shape:  # CuPy gives size-0 arrays strides 0
        raise ValueError(f"{info.name} has strides {info.strides} (elements): its last dim (head_dim) must be "
                         f"contiguous (stride 1); use cupy.ascontiguousarray({info.name})")
    if layout == "bshd":
        b, s, h, d = info.shape
        bs, ss, hs, _ = info.strides
    else:
        b, h, s, d = info.shape
        bs, hs, ss, _ = info.strides
    return Dims(b, s, h, d, bs, ss, hs)


def check_head_dim(d: int, name: str = "q") -> None:
    if d % 8 or d < 8 or d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim={d} (last dim of {name}) is not supported; allowed: a multiple of 8 from 8 "
                         f"to {MAX_HEAD_DIM} (kernels for 32, 64, 96, 128, 192, 256; others are zero-padded "
                         f"inside the kernel)")


def check_same_device(*infos: ArrayInfo) -> int:
    first = infos[0]
    for info in infos[1:]:
        if info.device != first.device:
            raise ValueError(f"{info.name} is on device {info.device} but {first.name} is on device "
                             f"{first.device}; all arrays must be on one GPU")
    return first.device


def check_gqa_heads(heads_q: int, heads_kv: int, q: ArrayInfo, k: ArrayInfo, layout: str | None = None) -> int:
    """Grouped-query attention: heads_q a multiple of heads_kv (both 0 allowed). Returns the group size
    heads_q // heads_kv (query head h reads key/value head h // group), 1 when both are 0."""
    where = f" ({layout})" if layout else ""
    if heads_kv == 0 and heads_q == 0:
        return 1
    if heads_kv == 0 or heads_q == 0 or heads_q % heads_kv:
        raise ValueError(f"{k.name} has shape {k.shape}{where} with heads_kv={heads_kv}, {q.name} has shape {q.shape} "
                         f"with heads_q={heads_q}: heads_q must be a positive multiple of heads_kv (grouped-query "
                         f"attention: query head h uses key/value head h // (heads_q // heads_kv))")
    return heads_q // heads_kv


def check_qkv(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, layout: str):
    """Shapes of q, k, v agree (k and v may have fewer heads than q: heads_q % heads_kv == 0, grouped-query
    attention); returns (dtype name, dims of q, k, v)."""
    layout = check_layout(layout)
    dtype = check_dtype(q, k, v)
    dq, dk, dv = bshd_dims(q, layout), bshd_dims(k, layout), bshd_dims(v, layout)
    check_head_dim(dq.head_dim, q.name)
    for other, d in ((k, dk), (v, dv)):
        if d.batch != dq.batch or d.head_dim != dq.head_dim:
            raise ValueError(f"{other.name} has shape {other.shape} but q has {q.shape} ({layout}): batch and "
                             f"head_dim must match")
    if dv.heads != dk.heads:
        raise ValueError(f"{v.name} has shape {v.shape} but {k.name} has {k.shape} ({layout}): k and v need the same "
                         f"number of heads (heads_kv)")
    check_gqa_heads(dq.heads, dk.heads, q, k, layout)
    for name, n in (("batch", dq.batch), ("heads", dq.heads)):
        if n > MAX_GRID_YZ:
            raise ValueError(f"{name}={n} (from q.shape={q.shape}) is too large: at most {MAX_GRID_YZ} "
                             f"(a CUDA grid dimension); split the call")
    if dv.seqlen != dk.seqlen:
        raise ValueError(f"v has shape {v.shape} but k has {k.shape}: k and v need the same seqlen")
    check_same_device(q, k, v)
    return dtype, dq, dk, dv


def chunk_mask(info: ArrayInfo) -> int:
    """Elements of one 16-byte chunk, minus 1 (a stride in elements is a whole number of chunks iff stride & mask
    is 0): 7 for 16-bit, 3 for float32, 1 for float64."""
    return 16 // info.dtype.itemsize - 1


def needs_aligned_copy(info: ArrayInfo, dims: Dims) -> bool:
    """The kernels read 16-byte chunks: the address and the batch/row/head strides must be multiples of
    16 bytes (8 elements of 16 bits, 4 of float32, 2 of float64). Arrays that are not (rare: views at odd element
    offsets) are copied, not rejected."""
    # a dim of size 1 is never stepped over, so its stride does not matter
    if info.ptr & 15:
        return True
    mask = chunk_mask(info)
    for stride, n in ((dims.batch_stride, dims.batch), (dims.row_stride, dims.seqlen), (dims.head_stride, dims.heads)):
        if n > 1 and (type(stride) is not int or stride & mask):
            return True
    return False


def needs_aligned_copy_rows(info: ArrayInfo) -> bool:
    """`needs_aligned_copy` for an array of any rank (packed varlen arrays): the address and the stride of
    every dim but the last (when that dim has more than one element) must be multiples of 8 elements."""
    if info.ptr & 15:
        return True
    mask = chunk_mask(info)
    for stride, n in zip(info.strides[:-1], info.shape[:-1]):
        if n > 1 and (type(stride) is not int or stride & mask):
            return True
    return False


def byte_extent(info: ArrayInfo) -> tuple:
    """[first, last) byte range that an array's elements occupy (empty arrays: an empty range)."""
    item = info.dtype.itemsize
    lo = hi = 0
    for n, s in zip(info.shape, info.strides):
        if n == 0:
            return info.ptr, info.ptr
        if s >= 0:
            hi += (n - 1) * s * item
        else:
            lo += (n - 1) * s * item
    return int(info.ptr + lo), int(info.ptr + hi + item)


def overlaps(a: ArrayInfo, b: ArrayInfo) -> bool:
    """True when the byte ranges of a and b intersect (conservative: interleaved views count as overlapping)."""
    a0, a1 = byte_extent(a)
    b0, b1 = byte_extent(b)
    return a0 < b1 and b0 < a1


INT32_MAX = 2**31 - 1


def check_int(value, name: str, lo: int = 0, hi: int = INT32_MAX) -> int:
    """A Python or NumPy integer (not a bool) in [lo, hi]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    n = int(value)
    if n < lo or n > hi:
        raise ValueError(f"{name}={n} is out of range: allowed {lo} <= {name} <= {hi}")
    return n


def check_last_dim_contiguous(info: ArrayInfo, what: str) -> None:
    if len(info.shape) and info.shape[-1] > 1 and info.strides[-1] != 1 and 0 not in info.shape:
        raise ValueError(f"{info.name} has strides {info.strides} (elements): its last dim ({what}) must be "
                         f"contiguous (stride 1); use cupy.ascontiguousarray({info.name})")


def _check_int32(info: ArrayInfo, what: str) -> None:
    if info.dtype != np.int32:
        raise TypeError(f"{info.name}.dtype={info.dtype} must be int32 ({what}); use "
                        f"cupy.asarray({info.name}, dtype=cupy.int32)")


# --- variable-length (packed) batches ---------------------------------------------------------------------

class VarlenDims(NamedTuple):
    """What a varlen launch needs, from `check_varlen`. Strides in elements, as (token stride, head stride)."""

    dtype: str  # "fp16" | "bf16"
    batch: int  # len(cu_seqlens) - 1
    total_q: int  # q.shape[0]
    total_k: int  # k.shape[0]
    heads_q: int
    heads_kv: int
    head_dim: int
    max_seqlen_q: int
    max_seqlen_k: int
    q_strides: tuple  # (token, head)
    k_strides: tuple
    v_strides: tuple
    device: int


def _packed(info: ArrayInfo, total: str, heads: str) -> None:
    if len(info.shape) != 3:
        raise ValueError(f"{info.name} has shape {info.shape} (rank {len(info.shape)}); the varlen functions take "
                         f"packed rank-3 arrays ({total}, {heads}, head_dim): sequence b is rows "
                         f"cu_seqlens[b] .. cu_seqlens[b + 1] - 1")
    check_last_dim_contiguous(info, "head_dim")


def check_cu_seqlens(cu_q: ArrayInfo, cu_k: ArrayInfo) -> int:
    """Metadata of cu_seqlens_q / cu_seqlens_k: int32, 1-D, contiguous, equal length >= 2. Returns batch."""
    for cu in (cu_q, cu_k):
        _check_int32(cu, "cumulative sequence lengths")
        if len(cu.shape) != 1:
            raise ValueError(f"{cu.name} has shape {cu.shape}; it must be 1-D of length batch + 1")
        if cu.shape[0] < 2:
            raise ValueError(f"{cu.name} has shape {cu.shape}: it needs batch + 1 >= 2 entries "
                             f"(cu_seqlens[0] = 0, then the end row of each sequence)")
        if cu.strides[0] != 1:
            raise ValueError(f"{cu.name} has strides {cu.strides} (elements); it must be contiguous (stride 1): "
                             f"use cupy.ascontiguousarray({cu.name})")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"{cu_k.name} has shape {cu_k.shape} but {cu_q.name} has {cu_q.shape}: both hold batch + 1 "
                         f"entries")
    return cu_q.shape[0] - 1


def check_varlen(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, cu_q: ArrayInfo, cu_k: ArrayInfo,
                 max_seqlen_q, max_seqlen_k, fp8: bool = False) -> VarlenDims:
    """Packed q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim), cu_seqlens int32 (batch + 1,),
    max_seqlen ints >= 0: metadata only (the values of cu_seqlens: `check_cu_seqlens_values`). fp8: the arrays are
    uint8 e4m3 bits (the caller checked their dtype; head dims are the FP8 kernel's to check)."""
    dtype = "fp8" if fp8 else check_dtype(q, k, v)
    _packed(q, "total_q", "heads_q")
    _packed(k, "total_k", "heads_kv")
    _packed(v, "total_k", "heads_kv")
    if not fp8:
        check_head_dim(q.shape[2], q.name)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"{k.name} has shape {k.shape} but {q.name} has {q.shape}: head_dim must match")
    if v.shape != k.shape:
        raise ValueError(f"{v.name} has shape {v.shape} but {k.name} has {k.shape}: k and v must have the same shape "
                         f"(total_k, heads_kv, head_dim)")
    total_q, heads_q, head_dim = q.shape
    total_k, heads_kv, _ = k.shape
    check_gqa_heads(heads_q, heads_kv, q, k)
    batch = check_cu_seqlens(cu_q, cu_k)
    max_q = check_int(max_seqlen_q, "max_seqlen_q")
    max_k = check_int(max_seqlen_k, "max_seqlen_k")
    for name, total, total_name, mx, mx_name in ((cu_q.name, total_q, "total_q", max_q, "max_seqlen_q"),
                                                 (cu_k.name, total_k, "total_k", max_k, "max_seqlen_k")):
        if total > batch * mx:  # some sequence is longer than mx: caught here without reading cu_seqlens
            raise ValueError(f"{mx_name}={mx} is too small: {total_name}={total} rows in batch={batch} sequences "
                             f"({name} has {batch + 1} entries) means a sequence of at least "
                             f"{-(-total // batch)} rows; {mx_name} must be >= the longest sequence")
    for name, n in (("batch", batch), ("heads_q", heads_q)):
        if n > MAX_GRID_YZ:
            raise ValueError(f"{name}={n} is too large: at most {MAX_GRID_YZ} (a CUDA grid dimension); split the call")
    check_same_device(q, k, v, cu_q, cu_k)
    return VarlenDims(dtype, batch, total_q, total_k, heads_q, heads_kv, head_dim, max_q, max_k,
                      tuple(q.strides[:2]), tuple(k.strides[:2]), tuple(v.strides[:2]), q.device)


def check_cu_seqlens_values(cu_q, cu_k, total_q: int, total_k: int, max_seqlen_q: int, max_seqlen_k: int):
    """Values of cu_seqlens_q / cu_seqlens_k, host copies (NumPy int arrays): cu[0] == 0, non-decreasing,
    cu[-1] == total, every length <= max_seqlen. Returns (seqlens_q, seqlens_k), int64 arrays of length batch."""
    out = []
    for name, cu, total, total_name, mx, mx_name in (
            ("cu_seqlens_q", cu_q, total_q, "total_q", max_seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", cu_k, total_k, "total_k", max_seqlen_k, "max_seqlen_k")):
        cu = np.asarray(cu).astype(np.int64).reshape(-1)
        if cu[0] != 0:
            raise ValueError(f"{name}[0]={cu[0]} must be 0 (the first sequence starts at row 0)")
        lens = np.diff(cu)
        bad = np.flatnonzero(lens < 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name} must be non-decreasing: {name}[{i + 1}]={cu[i + 1]} < {name}[{i}]={cu[i]} "
                             f"(sequence {i} would have length {lens[i]})")
        last = len(cu) - 1
        if cu[last] != total:
            what = "q.shape[0]" if name.endswith("q") else "k.shape[0]"
            raise ValueError(f"{name}[{last}]={cu[last]} (the last entry) must equal {total_name}={total} ({what}, "
                             f"the number of packed rows)")
        if lens.size and lens.max() > mx:
            b = int(np.argmax(lens))
            raise ValueError(f"sequence {b} has length {lens[b]} ({name}[{b + 1}] - {name}[{b}]) but {mx_name}={mx}: "
                             f"{mx_name} must be >= the longest sequence")
        out.append(lens)
    return out[0], out[1]


# --- KV-cache decoding --------------------------------------------------------------------------------------

MAX_SPLITS = 128


class KvcacheDims(NamedTuple):
    """What a KV-cache launch needs, from `check_kvcache`. Dims are in bshd order with strides in elements;
    for a paged cache, k_cache/v_cache Dims read (num_blocks, page_size, heads_kv, head_dim)."""

    dtype: str  # "fp16" | "bf16"
    batch: int
    seqlen_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    s_new: int  # new keys per sequence in k, v (0 without them)
    paged: bool
    page_size: int  # rows per physical block (paged); S_cache for a dense cache
    num_blocks: int  # k_cache.shape[0]: physical blocks (paged), batch (dense)
    max_blocks: int  # block_table.shape[1] (paged); 1 for a dense cache
    capacity: int  # keys one sequence can hold: S_cache, or max_blocks * page_size
    cache_seqlen: int | None  # the keys already cached in every sequence when cache_seqlens is None (capacity)
    #                           or an int; None when it is a per-sequence array
    num_splits: int  # 0 (heuristic) or 1..MAX_SPLITS
    q: Dims
    k_cache: Dims
    v_cache: Dims
    k: Dims | None  # the new keys / values, or None
    v: Dims | None
    block_table_stride: int  # elements between rows of block_table; 0 for a dense cache
    device: int
    rotary: Rotary | None = None  # the rotary embedding's tables, or None


class Rotary(NamedTuple):
    """The rotary embedding of an attention_with_kvcache call (`check_rotary`)."""

    cos: ArrayInfo
    sin: ArrayInfo
    dim: int  # rotary_dim: the leading dims of q and k that rotate (2 * cos.shape[1])
    interleaved: bool
    kind: int  # the tables' dtype: 0 float32, 1 float16, 2 bfloat16 (cuda/kvcache.cuh rotary_kind)
    row_stride: int  # elements between rows of the tables


def _check_index_array(info: ArrayInfo, batch: int, what: str) -> None:
    """An int32 (batch,) contiguous array of per-sequence values."""
    _check_int32(info, what)
    if info.shape != (batch,):
        raise ValueError(f"{info.name} has shape {info.shape}; expected (batch,) = ({batch},) ({what})")
    if batch > 1 and info.strides[0] != 1:
        raise ValueError(f"{info.name} has strides {info.strides} (elements); it must be contiguous: use "
                         f"cupy.ascontiguousarray({info.name})")


def check_rotary(cos: ArrayInfo | None, sin: ArrayInfo | None, interleaved, dtype: str, head_dim: int, has_new: bool,
                 capacity: int, seqlen_q: int, s_new: int, moves_q: bool) -> Rotary | None:
    """rotary_cos / rotary_sin: (seqlen_ro, rotary_dim / 2) in q's dtype or float32, rotary_dim a multiple of 16 and
    <= head_dim, rows for every position the call rotates (moves_q: query i at cache_seqlens + i)."""
    interleaved = check_flag(interleaved, "rotary_interleaved")
    if cos is None and sin is None:
        return None
    if (cos is None) != (sin is None):
        raise ValueError(f"rotary_cos and rotary_sin go together: got rotary_cos={'None' if cos is None else 'an array'}"
                         f" and rotary_sin={'None' if sin is None else 'an array'}; pass both or neither")
    if not has_new:
        raise ValueError("rotary_cos / rotary_sin rotate q and the new keys k at their cache positions: pass the new "
                         "keys and values k and v with them")
    for x in (cos, sin):
        if x.dtype != FP32 and DTYPE_NAMES.get(x.dtype) != dtype:
            raise TypeError(f"{x.name}.dtype={x.dtype} is not supported: the rotary tables are float32 or q's dtype "
                            f"({dtype})")
        if len(x.shape) != 2:
            raise ValueError(f"{x.name} has shape {x.shape}; expected (seqlen_ro, rotary_dim // 2)")
        check_last_dim_contiguous(x, "rotary_dim // 2")
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(f"rotary_sin is {sin.shape} {sin.dtype} but rotary_cos is {cos.shape} {cos.dtype}: the two "
                         f"tables must have one shape and dtype")
    if cos.strides != sin.strides:
        raise ValueError(f"rotary_sin has strides {sin.strides} but rotary_cos {cos.strides} (elements): give the two "
                         f"tables the same strides (e.g. cupy.ascontiguousarray)")
    dim = 2 * cos.shape[1]
    if dim == 0 or dim % 16 or dim > head_dim:
        raise ValueError(f"rotary_dim={dim} (2 * rotary_cos.shape[1], rotary_cos.shape={cos.shape}) is not supported: "
                         f"it must be a positive multiple of 16 and at most head_dim={head_dim}")
    need = capacity + (max(0, seqlen_q - s_new) if moves_q else 0)
    if cos.shape[0] < need:
        raise ValueError(f"rotary_cos has seqlen_ro={cos.shape[0]} rows (shape {cos.shape}); the call rotates up to "
                         f"position {need - 1} (cache capacity={capacity}"
                         + (f", {seqlen_q} queries after {s_new} new keys" if need > capacity else "")
                         + f"), so it needs at least {need} rows")
    return Rotary(cos, sin, dim, interleaved, bias_kind(cos.dtype), int(cos.strides[0]) if cos.shape[0] > 1 else 0)


def check_kvcache(q: ArrayInfo, k_cache: ArrayInfo, v_cache: ArrayInfo, k: ArrayInfo | None, v: ArrayInfo | None,
                  cache_seqlens, block_table: ArrayInfo | None, num_splits, cache_batch_idx: ArrayInfo | None = None,
                  cache_leftpad: ArrayInfo | None = None, rotary_cos: ArrayInfo | None = None,
                  rotary_sin: ArrayInfo | None = None, rotary_interleaved=True, moves_q: bool = False) -> KvcacheDims:
    """Metadata of an attention_with_kvcache call. cache_seqlens: None, an int, or the ArrayInfo of an int32
    (batch,) array (its values, and those of the index arrays: `check_kvcache_values`); block_table: None (dense
    cache) or ArrayInfo; cache_batch_idx, cache_leftpad: None or int32 (batch,) ArrayInfo; rotary_cos / rotary_sin:
    `check_rotary` (moves_q: causal or a window, so query i is rotated at cache_seqlens + i)."""
    if (k is None) != (v is None):
        raise ValueError(f"k and v (new keys and values) go together: got k={'None' if k is None else 'an array'} "
                         f"and v={'None' if v is None else 'an array'}; pass both or neither")
    new = [x for x in (k, v) if x is not None]
    dtype = check_dtype(q, k_cache, v_cache, *new, wide=False)
    dq, dkc, dvc = bshd_dims(q, "bshd"), bshd_dims(k_cache, "bshd"), bshd_dims(v_cache, "bshd")
    check_head_dim(dq.head_dim, q.name)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{v_cache.name} has shape {v_cache.shape} but {k_cache.name} has {k_cache.shape}: the key and "
                         f"value caches must have the same shape")
    if dkc.head_dim != dq.head_dim:
        raise ValueError(f"{k_cache.name} has shape {k_cache.shape} but {q.name} has {q.shape}: head_dim must match")
    check_gqa_heads(dq.heads, dkc.heads, q, k_cache)
    batch, heads_kv, head_dim = dq.batch, dkc.heads, dq.head_dim

    paged = block_table is not None
    if paged:
        _check_int32(block_table, "physical block indices")
        if len(block_table.shape) != 2 or block_table.shape[0] != batch:
            raise ValueError(f"{block_table.name} has shape {block_table.shape}; expected (batch, max_blocks_per_seq) "
                             f"with batch={batch} (q.shape[0])")
        check_last_dim_contiguous(block_table, "max_blocks_per_seq")
        page_size, max_blocks = dkc.seqlen, block_table.shape[1]
        if page_size < DECODE_PAGE_MULTIPLE or page_size % DECODE_PAGE_MULTIPLE:
            raise ValueError(f"page_size={page_size} ({k_cache.name}.shape[1] of the paged cache (num_blocks, "
                             f"page_size, heads_kv, head_dim)) is not supported: it must be a positive multiple of "
                             f"{DECODE_PAGE_MULTIPLE}")
        if cache_batch_idx is not None:
            raise ValueError(f"{cache_batch_idx.name} (an array) and block_table (an array) do not go together: with a "
                             f"paged cache the block table already says which pages each sequence uses; pass "
                             f"cache_batch_idx=None")
        capacity, bt_stride = max_blocks * page_size, int(block_table.strides[0]) if max_blocks else 0
    elif cache_batch_idx is not None:
        _check_index_array(cache_batch_idx, batch, "the dense cache entry of each batch entry")
        page_size, max_blocks, capacity, bt_stride = dkc.seqlen, 1, dkc.seqlen, 0
    else:
        if dkc.batch != batch:
            raise ValueError(f"{k_cache.name} has shape {k_cache.shape} but q has batch={batch} ({q.shape}): a dense "
                             f"cache (no block_table) holds one sequence per batch entry, (batch, S_cache, heads_kv, "
                             f"head_dim)")
        page_size, max_blocks, capacity, bt_stride = dkc.seqlen, 1, dkc.seqlen, 0
    for c, d in ((k_cache, dkc), (v_cache, dvc)):
        if needs_aligned_copy(c, d):
            raise ValueError(f"{c.name} must be 16-byte aligned with strides that are multiples of 8 elements (the "
                             f"cache is read in 16-byte chunks and written in place, so it cannot be copied); got "
                             f"strides {c.strides} at address {c.ptr:#x}")

    dk = dv = None
    s_new = 0
    if k is not None:
        dk, dv = bshd_dims(k, "bshd"), bshd_dims(v, "bshd")
        s_new = dk.seqlen
        for x, d in ((k, dk), (v, dv)):
            if (d.batch, d.heads, d.head_dim) != (batch, heads_kv, head_dim) or d.seqlen != s_new:
                raise ValueError(f"{x.name} has shape {x.shape}; the new keys/values must be (batch, S_new, heads_kv, "
                                 f"head_dim) = ({batch}, S_new, {heads_kv}, {head_dim}), k and v alike "
                                 f"(k has {k.shape})")
        if s_new > capacity:
            raise ValueError(f"k has S_new={s_new} new keys per sequence but the cache holds at most capacity="
                             f"{capacity} keys per sequence")

    cache_seqlen = None
    if cache_seqlens is None:
        cache_seqlen = capacity
        if s_new:
            raise ValueError(f"cache_seqlens=None means every sequence's cache is full ({capacity} keys): there is no "
                             f"room for the S_new={s_new} new keys of k and v; pass cache_seqlens (the keys already "
                             f"cached per sequence)")
    elif isinstance(cache_seqlens, ArrayInfo):
        _check_int32(cache_seqlens, "keys already cached per sequence")
        if cache_seqlens.shape != (batch,):
            raise ValueError(f"{cache_seqlens.name} has shape {cache_seqlens.shape}; expected (batch,) = ({batch},)")
        if batch > 1 and cache_seqlens.strides[0] != 1:
            raise ValueError(f"{cache_seqlens.name} has strides {cache_seqlens.strides} (elements); it must be "
                             f"contiguous: use cupy.ascontiguousarray({cache_seqlens.name})")
    elif isinstance(cache_seqlens, (bool, np.bool_)) or not isinstance(cache_seqlens, numbers.Integral):
        raise TypeError(f"cache_seqlens={cache_seqlens!r} must be None, an int or a CuPy int32 array of shape "
                        f"(batch,)")
    else:
        cache_seqlen = int(cache_seqlens)
        if cache_seqlen < 0 or cache_seqlen + s_new > capacity:
            raise ValueError(f"cache_seqlens={cache_seqlen} with S_new={s_new} new keys does not fit the cache of "
                             f"capacity={capacity} keys per sequence: allowed 0 <= cache_seqlens <= "
                             f"{capacity - s_new}")

    if cache_leftpad is not None:
        _check_index_array(cache_leftpad, batch, "the first cache row of each sequence's keys")
    rotary = check_rotary(rotary_cos, rotary_sin, rotary_interleaved, dtype, head_dim, k is not None, capacity,
                          dq.seqlen, s_new, moves_q)
    splits = check_int(num_splits, "num_splits", 0, MAX_SPLITS)
    for name, n in (("batch", batch), ("heads", dq.heads)):
        if n > MAX_GRID_YZ:
            raise ValueError(f"{name}={n} (from q.shape={q.shape}) is too large: at most {MAX_GRID_YZ} "
                             f"(a CUDA grid dimension); split the call")
    extra = [x for x in (cache_seqlens, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin)
             if isinstance(x, ArrayInfo)]
    check_same_device(q, k_cache, v_cache, *new, *extra)
    if s_new:  # the call writes into the caches: nothing it reads or writes may share their memory
        if overlaps(k_cache, v_cache):
            raise ValueError(f"{v_cache.name} overlaps the memory of {k_cache.name}; the new keys and values are "
                             f"written into them, so they must be separate arrays")
        for c in (k_cache, v_cache):
            for x in (q, k, v, *extra):
                if overlaps(x, c):
                    raise ValueError(f"{x.name} overlaps the memory of {c.name}, which the call writes into; "
                                     f"{x.name} must not alias the cache")
    return KvcacheDims(dtype, batch, dq.seqlen, dq.heads, heads_kv, head_dim, s_new, paged, page_size, dkc.batch,
                       max_blocks, capacity, cache_seqlen, splits, dq, dkc, dvc, dk, dv, bt_stride, q.device, rotary)


def check_kvcache_values(cache_seqlens_host, block_table_host, capacity: int, s_new: int, num_blocks: int,
                         page_size: int, leftpad_host=None, batch_idx_host=None) -> int:
    """Values of cache_seqlens, block_table and the index arrays, host copies, before anything is written.

    cache_seqlens_host: None (every cache full), an int, or a NumPy int array (batch,): 0 <= cache_seqlens[b]
        and cache_seqlens[b] + s_new <= capacity.
    block_table_host: None (dense cache) or a NumPy int array (batch, max_blocks): the blocks holding sequence b's
        rows [leftpad[b], cache_seqlens[b] + s_new) must be in [0, num_blocks); the other entries may hold anything
        (-1, say). The new keys of all sequences must land in distinct slots.
    leftpad_host: None or a NumPy int array (batch,): 0 <= cache_leftpad[b] <= cache_seqlens[b].
    batch_idx_host: None or a NumPy int array (batch,) of dense cache entries: in [0, num_blocks) (the cache's
        batch), distinct when new keys are written.
    Returns max_b of the keys a sequence attends, cache_seqlens[b] + s_new - leftpad[b] (0 for an empty batch)."""
    table = None if block_table_host is None else np.asarray(block_table_host).astype(np.int64)
    scalar = cache_seqlens_host is None or isinstance(cache_seqlens_host, numbers.Integral)
    if scalar:  # the same count for every sequence
        start = capacity if cache_seqlens_host is None else int(cache_seqlens_host)
        cached = np.full(1 if table is None else table.shape[0], start, dtype=np.int64)
    else:
        cached = np.asarray(cache_seqlens_host).astype(np.int64).reshape(-1)

    def label(b):
        return "cache_seqlens" if scalar else f"cache_seqlens[{b}]"

    bad = np.flatnonzero(cached < 0)
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{label(b)}={cached[b]} must be >= 0 (the keys already in the cache of "
                         f"{'every sequence' if scalar else f'sequence {b}'})")
    bad = np.flatnonzero(cached + s_new > capacity)
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{label(b)}={cached[b]} plus S_new={s_new} new keys = {cached[b] + s_new} exceeds the cache "
                         f"capacity of {capacity} keys per sequence: allowed 0 <= cache_seqlens <= {capacity - s_new}")
    lengths = cached + s_new
    first = np.zeros_like(lengths)
    if leftpad_host is not None:
        first = np.asarray(leftpad_host).astype(np.int64).reshape(-1)
        bad = np.flatnonzero((first < 0) | (first > cached))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cache_leftpad[{b}]={first[b]} is out of range: sequence {b}'s keys start at cache row "
                             f"cache_leftpad[{b}], which must be in [0, {label(b)}={cached[b]}]")
    if batch_idx_host is not None:
        entries = np.asarray(batch_idx_host).astype(np.int64).reshape(-1)
        bad = np.flatnonzero((entries < 0) | (entries >= num_blocks))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"cache_batch_idx[{b}]={entries[b]} is out of range: it names the dense cache entry of "
                             f"batch entry {b} and must be in [0, {num_blocks}) (k_cache.shape[0])")
        if s_new:
            order = np.argsort(entries, kind="stable")
            dup = np.flatnonzero(entries[order][1:] == entries[order][:-1])
            if dup.size:
                b0, b1 = int(order[dup[0]]), int(order[dup[0] + 1])
                raise ValueError(f"cache_batch_idx[{b0}]={entries[b0]} and cache_batch_idx[{b1}]={entries[b1]} name "
                                 f"the same cache entry, and the call writes new keys into it for both; give each "
                                 f"batch entry its own cache entry")
    if table is not None:
        used = -(-lengths // page_size)  # blocks sequence b reads: from its first row's to ceil(L_b / page_size)
        blocks = np.arange(table.shape[1])[None, :]
        in_use = (blocks < used[:, None]) & (blocks >= (first // page_size)[:, None])
        wrong = in_use & ((table < 0) | (table >= num_blocks))
        if wrong.any():
            b, j = (int(i) for i in np.argwhere(wrong)[0])
            raise ValueError(f"block_table[{b}, {j}]={table[b, j]} is out of range: sequence {b} holds "
                             f"{lengths[b]} keys in blocks block_table[{b}, 0..{used[b] - 1}] (page_size={page_size}), "
                             f"and each must be in [0, num_blocks={num_blocks})")
        if s_new:  # physical slots of the new keys: block_table[b, p // page_size] * page_size + p % page_size
            starts = lengths - s_new
            pos = starts[:, None] + np.arange(s_new)[None, :]
            slots = np.take_along_axis(table, pos // page_size, axis=1) * page_size + pos % page_size
            flat = slots.reshape(-1)
            order = np.argsort(flat, kind="stable")
            dup = np.flatnonzero(flat[order][1:] == flat[order][:-1])
            if dup.size:
                first, second = (divmod(int(order[dup[0] + i]), s_new) for i in (0, 1))
                slot = int(flat[order[dup[0]]])
                raise ValueError(f"block_table sends new keys of sequence {first[0]} (position {pos[first]}) and "
                                 f"sequence {second[0]} (position {pos[second]}) to the same cache slot (block "
                                 f"{slot // page_size}, row {slot % page_size}): k and v would overwrite each other "
                                 f"there; give each sequence its own blocks for the positions it writes")
    return int((lengths - first).max()) if lengths.size else 0


# --- score modifiers: sliding window, ALiBi, softcap, dropout (cuda/mods.cuh) -------------------------------

class Broadcast(NamedTuple):
    """An array broadcast to the scores (batch, heads, seqlen_q, seqlen_k) (`check_broadcast`): its ArrayInfo,
    its shape padded to 4-D, its strides in elements (0 on a size-1 dim), and the divisors that map a batch /
    head index onto its own (b // batch_div)."""

    info: ArrayInfo
    shape: tuple
    strides: tuple
    batch_div: int
    head_div: int
    scores: tuple  # (batch, heads, seqlen_q, seqlen_k) of the problem
    array: object = None  # the array itself (set by the problem builders: the launch may combine two masks)
    blocks: object = None  # the BlockMask the mask came in, if any (its tile maps let kernels skip tiles)

    @property
    def reduces(self) -> bool:
        """Whether several scores share an element (its gradient is a sum over them)."""
        return any(n < w for n, w in zip(self.shape, self.scores))


class Mods(NamedTuple):
    """The score modifiers of a call, validated and normalized (`check_mods`).

    bits: the kernels' MODS (config.MOD_*); causal: the kernels' causal flag (False when a window carries it);
    window: (left, right) with causal folded in (right <= 0), -1 unbounded, or None; bias, mask: Broadcast or
    None (mask: the intersection of `mask` and `key_padding_mask`, see `masks`); the rest as given."""

    bits: int
    causal: bool
    window: tuple | None
    alibi: ArrayInfo | None
    softcap: float | None
    dropout_p: float
    seed: int
    offset: int
    bias: Broadcast | None = None
    masks: tuple = ()  # Broadcast of mask and / or key_padding_mask


_BIAS_KIND = {np.dtype(np.float32): 0, FP16: 1}
if BF16 is not None:
    _BIAS_KIND[BF16] = 2


def bias_kind(dtype) -> int:
    """The kernels' code of a bias dtype (ModParams.bias_kind)."""
    return _BIAS_KIND[np.dtype(dtype)]


def check_broadcast(x: ArrayInfo, name: str, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                    device: int) -> Broadcast:
    """An array of 2 to 4 dims broadcast to (batch, heads, seqlen_q, seqlen_k) from the right: batch and heads
    sizes that divide the problem's (1 broadcasts; in between, batch b uses index b // (batch // size)), seqlen
    sizes 1 or the problem's; whole-element strides (the seqlen strides below 2**31); on the inputs' device."""
    dims = ("batch", "heads", "seqlen_q", "seqlen_k")
    want = (batch, heads, seqlen_q, seqlen_k)
    if not 2 <= len(x.shape) <= 4:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; it must have 2 to 4 dims, broadcastable to "
                         f"(batch, heads, seqlen_q, seqlen_k) = {want}")
    pad = 4 - len(x.shape)
    shape = (1,) * pad + tuple(int(n) for n in x.shape)
    strides = (0,) * pad + tuple(x.strides)
    if any(not float(s).is_integer() for s in strides):
        raise ValueError(f"{name} has strides {x.strides} (elements) that are not whole elements")
    for i, (n, w) in enumerate(zip(shape, want)):
        ok = n == 1 or n == w or (i < 2 and w > 0 and w % n == 0)
        if not ok:
            allowed = f"1 or a divisor of {w}" if i < 2 else f"1 or {w}"
            raise ValueError(f"{name} has shape {tuple(x.shape)}: its {dims[i]} dim (size {n}) does not broadcast to "
                             f"{dims[i]}={w} of the scores {want}; allowed: {allowed}")
    strides = tuple(0 if n == 1 else int(s) for n, s in zip(shape, strides))
    if any(abs(s) > INT32_MAX for s in strides[2:]):
        raise ValueError(f"{name} has seqlen strides {strides[2:]} (elements): at most {INT32_MAX}")
    check_slice_span(name, shape, strides, x.dtype.itemsize)
    if x.device != device:
        raise ValueError(f"{name} is on device {x.device} but q is on device {device}")
    return Broadcast(x, shape, strides, max(1, batch // shape[0]), max(1, heads // shape[1]), want)


def check_slice_span(name: str, shape: tuple, strides: tuple, itemsize: int) -> None:
    """The kernels address one (batch, head) slice of a bias, mask or dbias with 32-bit byte offsets: its extent
    over the two seqlen dims must stay below 2**31 bytes."""
    span = sum((n - 1) * abs(int(s)) for n, s in zip(shape[-2:], strides[-2:])) * itemsize
    if span > INT32_MAX:
        raise ValueError(f"{name}: one (batch, head) slice of shape {tuple(shape[-2:])} spans {span} bytes; the "
                         f"kernels address it with 32-bit offsets (at most {INT32_MAX} bytes): split the call along "
                         f"the queries, or use a 16-bit bias")


def check_bias(bias: ArrayInfo | None, dtype: str, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
               device: int) -> Broadcast | None:
    """None, or the bias: q's dtype or float32, broadcast to the scores (`check_broadcast`)."""
    if bias is None:
        return None
    allowed = NUMPY_DTYPES[dtype]
    if bias.dtype not in (allowed, FP32):
        raise TypeError(f"bias.dtype={bias.dtype} is not allowed; allowed: {allowed} (the dtype of q) or float32")
    return check_broadcast(bias, "bias", batch, heads, seqlen_q, seqlen_k, device)


def check_masks(mask: ArrayInfo | None, key_padding_mask: ArrayInfo | None, batch: int, heads: int, seqlen_q: int,
                seqlen_k: int, device: int) -> tuple:
    """Broadcast of mask (bool, broadcast to the scores) and of key_padding_mask (bool (batch, seqlen_k)), the
    ones given."""
    out = []
    if mask is not None:
        if mask.dtype != np.bool_:
            raise TypeError(f"mask.dtype={mask.dtype} must be bool (True: attend, False: masked)")
        out.append(check_broadcast(mask, "mask", batch, heads, seqlen_q, seqlen_k, device))
    if key_padding_mask is not None:
        k = key_padding_mask
        if k.dtype != np.bool_:
            raise TypeError(f"key_padding_mask.dtype={k.dtype} must be bool (True: a valid key, False: ignored)")
        if tuple(k.shape) != (batch, seqlen_k):
            raise ValueError(f"key_padding_mask has shape {tuple(k.shape)}; expected (batch, seqlen_k) = "
                             f"{(batch, seqlen_k)}")
        b = check_broadcast(k._replace(shape=(k.shape[0], 1, 1, k.shape[1]), strides=(k.strides[0], 0, 0, k.strides[1])),
                            "key_padding_mask", batch, heads, seqlen_q, seqlen_k, device)
        out.append(b._replace(info=k))
    return tuple(out)


def check_dbias(dbias, bias: Broadcast | None, deterministic: bool, inputs) -> ArrayInfo | bool:
    """False (no dBias), True (a new array) or the ArrayInfo of a preallocated float32 array shaped like bias."""
    if dbias is None or dbias is False:
        return False
    if bias is None:
        raise ValueError("dbias needs bias=<the forward's bias>: dbias is its gradient")
    if deterministic and bias.reduces:
        raise ValueError(f"deterministic=True with dbias of a broadcast bias (shape {tuple(bias.info.shape)} for "
                         f"scores {bias.scores}) is not supported: its sum over the broadcast dims uses atomics; "
                         f"pass deterministic=False, or a bias of the full shape")
    if dbias is True:  # a new contiguous float32 array of the bias's shape
        check_slice_span("dbias", bias.shape, (bias.shape[3], 1), 4)
        return True
    if isinstance(dbias, (bool, np.bool_)):
        return bool(dbias)
    info = array_info(dbias, "dbias")
    if info.dtype != np.float32:
        raise TypeError(f"dbias.dtype={info.dtype} must be float32 (dBias is accumulated and returned in float32)")
    if tuple(info.shape) != tuple(bias.info.shape):
        raise ValueError(f"dbias has shape {tuple(info.shape)} but must have the shape of bias: "
                         f"{tuple(bias.info.shape)}")
    if any(not float(s).is_integer() for s in info.strides):
        raise ValueError(f"dbias has strides {info.strides} (elements) that are not whole elements")
    if info.device != bias.info.device:
        raise ValueError(f"dbias is on device {info.device} but q is on device {bias.info.device}")
    if any(s == 0 and n > 1 for s, n in zip(info.strides, info.shape)):
        raise ValueError(f"dbias has strides {info.strides}: a broadcast view (stride 0) cannot hold a gradient")
    check_slice_span("dbias", tuple(info.shape), tuple(info.strides), 4)
    for other in inputs:
        if other is not None and overlaps(info, other):
            raise ValueError(f"dbias (preallocated) overlaps the memory of {other.name}; outputs must not alias "
                             f"inputs")
    return info


def check_window(window) -> tuple | None:
    """None, or (left, right) of ints >= -1 (-1: unbounded on that side)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window={window!r} must be None or a pair (left, right) of ints >= -1 (-1 = unbounded)")
    out = []
    for side, v in zip(("left", "right"), window):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise TypeError(f"window={tuple(window)!r}: {side}={v!r} must be an int >= -1 (-1 = unbounded)")
        if int(v) < -1 or int(v) > INT32_MAX:
            raise ValueError(f"window={tuple(window)!r}: {side}={int(v)} is out of range: allowed -1 (unbounded) "
                             f"or 0 <= {side} <= {INT32_MAX}")
        out.append(int(v))
    return tuple(out)


def check_softcap(softcap) -> float | None:
    """None (off) or a finite float > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap={softcap!r} must be a real number > 0, or None (no soft-capping)")
    c = float(softcap)
    if not math.isfinite(c) or c <= 0:
        raise ValueError(f"softcap={softcap!r} must be finite and > 0 (None turns soft-capping off)")
    return c


def check_dropout(dropout_p, seed, offset) -> tuple:
    """(p, seed, offset): p a float in [0, 1); seed an int in [0, 2**64), required when p > 0; offset an int
    in [0, 2**32)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p={dropout_p!r} must be a real number in [0, 1)")
    p = float(dropout_p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"dropout_p={dropout_p!r} is out of range: allowed 0 <= dropout_p < 1")
    if seed is None:
        if p > 0:
            raise ValueError(f"dropout_p={p} needs seed=<int in [0, 2**64)>: the backward regenerates the dropout "
                             f"mask from the same seed and offset")
        seed = 0
    elif isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed={seed!r} must be an int in [0, 2**64)")
    elif not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed={int(seed)} is out of range: allowed 0 <= seed < 2**64")
    if isinstance(offset, (bool, np.bool_)) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"offset={offset!r} must be an int in [0, 2**32)")
    if not 0 <= int(offset) < 2**32:
        raise ValueError(f"offset={int(offset)} is out of range: allowed 0 <= offset < 2**32")
    return p, int(seed), int(offset)


def check_alibi(slopes: ArrayInfo | None, batch: int, heads: int, device: int) -> ArrayInfo | None:
    """float32 (heads,) or (batch, heads), contiguous along heads, on the inputs' device."""
    if slopes is None:
        return None
    if slopes.dtype != np.float32:
        raise TypeError(f"alibi_slopes.dtype={slopes.dtype} must be float32")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes has shape {tuple(slopes.shape)}; allowed: (heads,) = {(heads,)} or "
                         f"(batch, heads) = {(batch, heads)}")
    if heads > 1 and slopes.strides[-1] != 1:
        raise ValueError(f"alibi_slopes has strides {slopes.strides} (elements): the heads dim must be contiguous")
    if len(slopes.shape) == 2 and not float(slopes.strides[0]).is_integer():
        raise ValueError(f"alibi_slopes has strides {slopes.strides} (elements) that are not whole elements")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes is on device {slopes.device} but q is on device {device}")
    return slopes


def check_mods(causal: bool, window, alibi: ArrayInfo | None, softcap, dropout_p, seed, offset, batch: int,
               heads: int, device: int, bias: Broadcast | None = None, masks: tuple = ()) -> Mods:
    """Validate and normalize the score modifiers of a call (see `Mods`). A window with causal=True keeps
    right <= 0; window (-1, 0) is causal itself, (-1, -1) no window. bias, masks: from check_bias, check_masks."""
    from .config import MOD_ALIBI, MOD_BIAS, MOD_DROPOUT, MOD_MASK, MOD_SOFTCAP, MOD_WINDOW

    window = check_window(window)
    softcap = check_softcap(softcap)
    p, seed, offset = check_dropout(dropout_p, seed, offset)
    alibi = check_alibi(alibi, batch, heads, device)
    bits = 0
    if window is not None:
        left, right = window
        if causal:
            right = 0 if right == -1 else min(right, 0)
        if (left, right) == (-1, -1):
            window = None
        elif (left, right) == (-1, 0):
            window, causal = None, True
        else:
            window, causal, bits = (left, right), False, MOD_WINDOW
    bits |= (MOD_ALIBI if alibi is not None else 0) | (MOD_SOFTCAP if softcap is not None else 0)
    bits |= MOD_DROPOUT if p > 0 else 0
    bits |= (MOD_BIAS if bias is not None else 0) | (MOD_MASK if masks else 0)
    return Mods(bits, causal, window, alibi, softcap, p, seed, offset, bias, tuple(masks))
