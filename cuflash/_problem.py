"""A call's validated description: the problem the plan layer (_families.py) launches kernels for.

Each builder takes a public function's arguments, checks them (`_validate`: clear errors naming the argument,
its value and what is allowed, raised before any launch) and returns a NamedTuple with everything the launch
needs except the arrays themselves: dims and strides, dtype, layout, scale, the score modifiers, the device.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from . import _validate
from .blockmask import BlockMask
from ._validate import ArrayInfo, Dims, Mods


class Attention(NamedTuple):
    """The forward (or the forward part of a backward) of dense or packed (varlen) attention.

    Dense: q, k, v Dims in bshd order with strides in elements, `layout` the user's ("bshd" | "bhsd").
    Packed: layout "packed", each Dims one 'batch' of total rows (batch stride 0: the kernels find sequence b's
    rows through cu_seqlens), seqlen_q / seqlen_k the longest sequences, `batch` the number of sequences."""

    dtype: str  # the kernels': "fp16" | "bf16" | "fp32" | "tf32" (float32 in one TF32 pass) | "fp64"
    layout: str  # "bshd" | "bhsd" | "packed"
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    q: Dims
    k: Dims
    v: Dims
    infos: tuple  # ArrayInfo of q, k, v
    scale: float
    mods: Mods
    device: int
    total_q: int = 0  # packed: rows of q and k; 0 for dense calls
    total_k: int = 0

    @property
    def packed(self) -> bool:
        return self.layout == "packed"


class Backward(NamedTuple):
    """A backward call: the forward's problem, the forward's outputs and the gradient outputs."""

    fwd: Attention
    out: Dims
    dout: Dims
    infos: tuple  # ArrayInfo of dout, out, lse
    lse_strides: tuple  # (batch, head, row) strides of lse in elements (packed: (0, head, row))
    deterministic: bool
    grads: tuple  # per dq, dk, dv: (ArrayInfo, Dims) of a preallocated output, or None
    dbias: object = False  # False, True (a new float32 array) or the ArrayInfo of a preallocated one


def _mods(causal, window, alibi_slopes, softcap, dropout_p, seed, offset, batch, heads, device, dtype="fp16",
          seqlen_q=0, seqlen_k=0, bias=None, mask=None, key_padding_mask=None) -> Mods:
    _validate.check_fp64_mods(dtype, alibi_slopes, softcap, dropout_p, bias, mask, key_padding_mask)
    alibi = None if alibi_slopes is None else _validate.array_info(alibi_slopes, "alibi_slopes")
    b = None if bias is None else _validate.check_bias(_validate.array_info(bias, "bias"), dtype, batch, heads,
                                                        seqlen_q, seqlen_k, device)
    blocks = mask if isinstance(mask, BlockMask) else None
    if blocks is not None:
        mask = blocks.mask
    mi = None if mask is None else _validate.array_info(mask, "mask")
    ki = None if key_padding_mask is None else _validate.array_info(key_padding_mask, "key_padding_mask")
    masks = tuple(m._replace(array=x, blocks=blocks if x is mask else None) for m, x in zip(
        _validate.check_masks(mi, ki, batch, heads, seqlen_q, seqlen_k, device),
        [x for x in (mask, key_padding_mask) if x is not None]))
    return _validate.check_mods(causal, window, alibi, softcap, dropout_p, seed, offset, batch, heads, device, b,
                                masks)


def attention(q, k, v, causal, softmax_scale, layout, window, alibi_slopes, softcap, dropout_p, seed,
              offset, bias=None, mask=None, key_padding_mask=None, precision=None) -> Attention:
    """The problem of attention / attention_forward (dense batches)."""
    causal = _validate.check_flag(causal, "causal")
    qi, ki, vi = _validate.array_info(q, "q"), _validate.array_info(k, "k"), _validate.array_info(v, "v")
    dtype, dq, dk, dv = _validate.check_qkv(qi, ki, vi, layout)
    dtype = _validate.check_precision(precision, dtype)
    _validate.check_wide_head_dim(dtype, dq.head_dim)
    scale = _validate.check_softmax_scale(softmax_scale, dq.head_dim)
    mods = _mods(causal, window, alibi_slopes, softcap, dropout_p, seed, offset, dq.batch, dq.heads, qi.device, dtype,
                 dq.seqlen, dk.seqlen, bias, mask, key_padding_mask)
    return Attention(dtype, layout, dq.batch, dq.heads, dk.heads, dq.head_dim, dq.seqlen, dk.seqlen, dq, dk, dv,
                     (qi, ki, vi), scale, mods, qi.device)


def packed_dims(info: ArrayInfo) -> Dims:
    """Dims of a packed (total, heads, head_dim) array: one 'batch' of `total` rows."""
    total, heads, head_dim = info.shape
    return Dims(1, total, heads, head_dim, 0, info.strides[0], info.strides[1])


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int, max_seqlen_k: int,
                     device: int) -> None:
    """check_inputs of the varlen functions: the values of cu_seqlens, read back (one device -> host copy of
    batch + 1 ints each: a synchronization). A warm call that replays a plan runs it too."""
    from ._launch import cupy, on_device

    cp = cupy()
    with on_device(cp, device):
        _validate.check_cu_seqlens_values(cp.asnumpy(cu_seqlens_q), cp.asnumpy(cu_seqlens_k), total_q, total_k,
                                          max_seqlen_q, max_seqlen_k)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     check_inputs, window, alibi_slopes, softcap, dropout_p, seed, offset, bias=None, mask=None,
                     key_padding_mask=None, precision=None) -> Attention:
    """The problem of the varlen functions; check_inputs reads cu_seqlens back (one synchronization)."""
    causal = _validate.check_flag(causal, "causal")
    check_inputs = _validate.check_flag(check_inputs, "check_inputs")
    qi, ki, vi = (_validate.array_info(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    cqi, cki = _validate.array_info(cu_seqlens_q, "cu_seqlens_q"), _validate.array_info(cu_seqlens_k, "cu_seqlens_k")
    m = _validate.check_varlen(qi, ki, vi, cqi, cki, max_seqlen_q, max_seqlen_k)
    m = m._replace(dtype=_validate.check_precision(precision, m.dtype))
    _validate.check_wide_head_dim(m.dtype, m.head_dim)
    if check_inputs:
        check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, m.total_q, m.total_k, m.max_seqlen_q, m.max_seqlen_k, m.device)
    scale = _validate.check_softmax_scale(softmax_scale, m.head_dim)
    mods = _mods(causal, window, alibi_slopes, softcap, dropout_p, seed, offset, m.batch, m.heads_q, m.device, m.dtype,
                 m.max_seqlen_q, m.max_seqlen_k, bias, mask, key_padding_mask)
    return Attention(m.dtype, "packed", m.batch, m.heads_q, m.heads_kv, m.head_dim, m.max_seqlen_q, m.max_seqlen_k,
                     packed_dims(qi), packed_dims(ki), packed_dims(vi), (qi, ki, vi), scale, mods, m.device,
                     m.total_q, m.total_k)


def _check_like(info: ArrayInfo, dims: Dims, ref: Dims, what: str) -> None:
    if (dims.batch, dims.seqlen, dims.heads, dims.head_dim) != (ref.batch, ref.seqlen, ref.heads, ref.head_dim):
        raise ValueError(f"{info.name} has shape {info.shape} but must have the shape of {what}")


def _check_lse(li: ArrayInfo, want: tuple, names: str, fn: str, dtype: str) -> None:
    need = np.float64 if dtype == "fp64" else np.float32
    if li.dtype != need:
        raise TypeError(f"lse.dtype={li.dtype} must be {np.dtype(need)} (the lse returned by {fn} for these "
                        f"inputs)")
    if li.shape != want:
        raise ValueError(f"lse has shape {li.shape}; expected {names} = {want}")
    if any(not float(s).is_integer() for s in li.strides):
        raise ValueError(f"lse has strides {li.strides} (elements) that are not whole elements")


def _check_packed_like(info: ArrayInfo, like: ArrayInfo) -> None:
    if tuple(info.shape) != tuple(like.shape):
        raise ValueError(f"{info.name} has shape {info.shape} but must have the shape of {like.name}: "
                         f"{tuple(like.shape)}")
    _validate.check_last_dim_contiguous(info, "head_dim")


def _check_grad(x, name: str, ref: Dims, like: ArrayInfo, layout: str, inputs) -> tuple | None:
    """(ArrayInfo, Dims) of a preallocated gradient output after its checks, or None."""
    if x is None:
        return None
    info = _validate.array_info(x, name)
    if info.dtype != like.dtype:
        raise TypeError(f"{name}.dtype={info.dtype} must be {like.dtype}, the dtype of {like.name}")
    if layout == "packed":
        _check_packed_like(info, like)
        dims, misaligned, what = packed_dims(info), _validate.needs_aligned_copy_rows(info), "token/head"
    else:
        dims = _validate.bshd_dims(info, layout)
        _check_like(info, dims, ref, like.name)
        misaligned, what = _validate.needs_aligned_copy(info, dims), "batch/seqlen/head"
    if misaligned:
        raise ValueError(f"{name} (preallocated) must be 16-byte aligned with {what} strides that are multiples of "
                         f"{_validate.chunk_mask(info) + 1} elements (16 bytes); got strides {info.strides} at "
                         f"address {info.ptr:#x}")
    for other in inputs:
        if _validate.overlaps(info, other):
            raise ValueError(f"{name} (preallocated) overlaps the memory of {other.name}; outputs must not alias inputs")
    return info, dims


def backward(fwd: Attention, dout, out, lse, deterministic, dq, dk, dv, dbias=False) -> Backward:
    """The problem of attention_backward / attention_varlen_backward, given the forward's problem."""
    deterministic = _validate.check_flag(deterministic, "deterministic")
    qi, ki, vi = fwd.infos
    doi, oi = _validate.array_info(dout, "dout"), _validate.array_info(out, "out")
    _validate.check_dtype(qi, doi, oi)
    li = _validate.array_info(lse, "lse")
    if fwd.packed:
        for info in (doi, oi):
            _check_packed_like(info, qi)
        ddo, do_ = packed_dims(doi), packed_dims(oi)
        _check_lse(li, (fwd.heads_q, fwd.total_q), "(heads, total_q)", "attention_varlen_forward", fwd.dtype)
    else:
        ddo, do_ = _validate.bshd_dims(doi, fwd.layout), _validate.bshd_dims(oi, fwd.layout)
        _check_like(doi, ddo, fwd.q, "q")
        _check_like(oi, do_, fwd.q, "q")
        _check_lse(li, (fwd.batch, fwd.heads_q, fwd.seqlen_q), "(batch, heads, seqlen_q)", "attention_forward",
                   fwd.dtype)
    _validate.check_same_device(qi, ki, vi, doi, oi, li)
    ls = tuple(int(s) for s in li.strides)
    inputs = (qi, ki, vi, doi, oi, li) + ((fwd.mods.alibi,) if fwd.mods.alibi is not None else ())
    grads = tuple(_check_grad(x, name, ref, like, fwd.layout, inputs)
                  for x, name, ref, like in ((dq, "dq", fwd.q, qi), (dk, "dk", fwd.k, ki), (dv, "dv", fwd.v, vi)))
    given = [(g[0], n) for g, n in zip(grads, ("dq", "dk", "dv")) if g is not None]
    for i, (a, na) in enumerate(given):
        for b, nb in given[i + 1:]:
            if _validate.overlaps(a, b):
                raise ValueError(f"{nb} (preallocated) overlaps the memory of {na}; dq, dk and dv must be separate "
                                 f"arrays")
    extra = tuple(x.info for x in (fwd.mods.bias, *fwd.mods.masks) if x is not None)
    db = _validate.check_dbias(dbias, fwd.mods.bias, deterministic, inputs + extra + tuple(g[0] for g in given))
    return Backward(fwd, do_, ddo, (doi, oi, li), (0, *ls) if fwd.packed else ls, deterministic, grads, db)


class Kvcache(NamedTuple):
    """An attention_with_kvcache call."""

    dims: _validate.KvcacheDims
    infos: tuple  # ArrayInfo of q, k_cache, v_cache, k, v (None when absent), cache_seqlens (array) or None,
    #               block_table or None
    is_count: bool  # cache_seqlens is None or an int (its value is checked per call)
    causal: bool  # the kernels' causal flag (False when a window carries it)
    return_lse: bool
    check_inputs: bool
    scale: float
    mods: Mods | None = None  # window, ALiBi, softcap (None: none of them)
    index_infos: tuple = (None, None)  # ArrayInfo of cache_batch_idx and cache_leftpad, or None


def kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits, return_lse,
            check_inputs, rotary_cos=None, rotary_sin=None, rotary_interleaved=True, cache_batch_idx=None,
            cache_leftpad=None, window=None, alibi_slopes=None, softcap=None) -> Kvcache:
    causal = _validate.check_flag(causal, "causal")
    return_lse = _validate.check_flag(return_lse, "return_lse")
    check_inputs = _validate.check_flag(check_inputs, "check_inputs")
    bii = None if cache_batch_idx is None else _validate.array_info(cache_batch_idx, "cache_batch_idx")
    lpi = None if cache_leftpad is None else _validate.array_info(cache_leftpad, "cache_leftpad")
    cosi = None if rotary_cos is None else _validate.array_info(rotary_cos, "rotary_cos")
    sini = None if rotary_sin is None else _validate.array_info(rotary_sin, "rotary_sin")
    qi = _validate.array_info(q, "q")
    kci, vci = _validate.array_info(k_cache, "k_cache"), _validate.array_info(v_cache, "v_cache")
    ki = None if k is None else _validate.array_info(k, "k")
    vi = None if v is None else _validate.array_info(v, "v")
    is_count = cache_seqlens is None or isinstance(cache_seqlens, numbers.Integral)
    lens_info = cache_seqlens if is_count else _validate.array_info(cache_seqlens, "cache_seqlens")
    bti = None if block_table is None else _validate.array_info(block_table, "block_table")
    w = _validate.check_window(window)  # rotary: queries move along with causal or a window (FlashAttention-2's rule)
    m = _validate.check_kvcache(qi, kci, vci, ki, vi, lens_info, bti, num_splits, bii, lpi, cosi, sini,
                                rotary_interleaved, moves_q=causal or (w is not None and w != (-1, -1)))
    scale = _validate.check_softmax_scale(softmax_scale, m.head_dim)
    mods = None
    if window is not None or alibi_slopes is not None or softcap is not None:
        mods = _mods(causal, window, alibi_slopes, softcap, 0.0, None, 0, m.batch, m.heads_q, m.device, m.dtype)
        causal = mods.causal
    return Kvcache(m, (qi, kci, vci, ki, vi, None if is_count else lens_info, bti), is_count, causal, return_lse,
                   check_inputs, scale, mods, (bii, lpi))
