"""Argument checks, on array metadata only, so CI can test every message without a GPU.

`array_info(x, name)` turns a user argument into an `ArrayInfo` (or raises TypeError naming the
argument and saying how to convert it); the `check_*` functions work on ArrayInfo alone.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from .config import MAX_HEAD_DIM

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BF16 = None

FP16 = np.dtype(np.float16)
DTYPE_NAMES = {FP16: "fp16"}
if BF16 is not None:
    DTYPE_NAMES[BF16] = "bf16"
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


def check_dtype(*infos: ArrayInfo) -> str:
    """All arrays fp16 or all bf16; returns "fp16" / "bf16"."""
    first = infos[0]
    if first.dtype not in DTYPE_NAMES:
        allowed = "float16 or bfloat16 (ml_dtypes.bfloat16)"
        raise TypeError(f"{first.name}.dtype={first.dtype} is not supported; allowed: {allowed}")
    for info in infos[1:]:
        if info.dtype != first.dtype:
            raise TypeError(f"{info.name}.dtype={info.dtype} differs from {first.name}.dtype={first.dtype}; "
                            f"all inputs must have the same dtype")
    return DTYPE_NAMES[first.dtype]


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


def check_qkv(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, layout: str):
    """Shapes of q, k, v agree; returns (dtype name, dims of q, k, v)."""
    layout = check_layout(layout)
    dtype = check_dtype(q, k, v)
    dq, dk, dv = bshd_dims(q, layout), bshd_dims(k, layout), bshd_dims(v, layout)
    check_head_dim(dq.head_dim, q.name)
    for other, d in ((k, dk), (v, dv)):
        if d.batch != dq.batch or d.heads != dq.heads or d.head_dim != dq.head_dim:
            raise ValueError(f"{other.name} has shape {other.shape} but q has {q.shape} ({layout}): batch, heads "
                             f"and head_dim must match")
    for name, n in (("batch", dq.batch), ("heads", dq.heads)):
        if n > MAX_GRID_YZ:
            raise ValueError(f"{name}={n} (from q.shape={q.shape}) is too large: at most {MAX_GRID_YZ} "
                             f"(a CUDA grid dimension); split the call")
    if dv.seqlen != dk.seqlen:
        raise ValueError(f"v has shape {v.shape} but k has {k.shape}: k and v need the same seqlen")
    check_same_device(q, k, v)
    return dtype, dq, dk, dv


def needs_aligned_copy(info: ArrayInfo, dims: Dims) -> bool:
    """The kernels read 16-byte chunks: the address and the batch/row/head strides must be multiples of
    8 elements. Arrays that are not (rare: views at odd element offsets) are copied, not rejected."""
    # a dim of size 1 is never stepped over, so its stride does not matter
    if info.ptr & 15:
        return True
    for stride, n in ((dims.batch_stride, dims.batch), (dims.row_stride, dims.seqlen), (dims.head_stride, dims.heads)):
        if n > 1 and (type(stride) is not int or stride & 7):
            return True
    return False
