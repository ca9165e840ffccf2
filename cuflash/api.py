"""Public API: validate -> pick the kernel config -> compile (cached) -> launch on the current stream."""
from __future__ import annotations

import contextlib

import numpy as np

from . import _launch, _validate, config
from .config import (SEQLEN_Q_PAD, ElementwiseConfig, backward_kernel_config, dq_config, forward_kernel_config,
                     kernel_head_dim)


def _cupy():
    import cupy

    return cupy


def _as_kernel_operand(x, info, dims, layout):
    """x itself when the kernel can read it in place; else an aligned contiguous copy (rare, see
    _validate.needs_aligned_copy) with its new metadata."""
    if not _validate.needs_aligned_copy(info, dims):
        return x, dims
    x = _cupy().ascontiguousarray(x)
    info = _validate.array_info(x, info.name)
    return x, _validate.bshd_dims(info, layout)


_forward_kernels: dict = {}  # (device, kernel head dim, dtype, causal, family) -> (config, loaded kernel)


def _forward_kernel(device, head_dim, dtype, causal):
    """Config and loaded kernel of a forward call, looked up once (the warm path is one dict get)."""
    key = (device, head_dim, dtype, causal, config.KERNELS)
    entry = _forward_kernels.get(key)
    if entry is None:
        cfg = forward_kernel_config(head_dim, dtype, causal, _launch.device_arch(device))
        entry = _forward_kernels[key] = (cfg, _launch.get_kernel(cfg, device))
    return entry


def _on_device(cp, device):
    """`with cupy.cuda.Device(device)`, skipped when it is already the current device (saves ~2 us)."""
    return _NO_SWITCH if cp.cuda.runtime.getDevice() == device else cp.cuda.Device(device)


_NO_SWITCH = contextlib.nullcontext()


def _contiguous_strides(dims, layout):
    """(batch, row, head) strides in elements of a new contiguous array shaped like `dims` in `layout`."""
    s, h, d = dims.seqlen, dims.heads, dims.head_dim
    return (s * h * d, h * d, d) if layout == "bshd" else (h * s * d, d, s * d)


def _empty_like_layout(dims, seqlen, dtype, layout):
    cp = _cupy()
    shape = (dims.batch, seqlen, dims.heads, dims.head_dim) if layout == "bshd" else \
        (dims.batch, dims.heads, seqlen, dims.head_dim)
    return cp.empty(shape, dtype=dtype)


def attention_forward(q, k, v, *, causal=False, softmax_scale=None, layout="bshd"):
    """Fused attention forward, returning the output and the log-sum-exp of each query row.

    Args:
        q: CuPy array (batch, seqlen_q, heads, head_dim) for layout "bshd", or (batch, heads,
            seqlen_q, head_dim) for "bhsd"; float16 or bfloat16 (ml_dtypes.bfloat16). Any strides
            for batch/seqlen/heads; the last dim must be contiguous. head_dim: a multiple of 8, <= 256.
        k, v: same dtype and layout, seqlen_k rows: (batch, seqlen_k, heads, head_dim) for "bshd".
        causal: mask aligned to the bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q.
            A query that sees no key gets o = 0 and lse = -inf.
        softmax_scale: multiplies q k^T before the softmax; default 1/sqrt(head_dim).
        layout: "bshd" or "bhsd", for the inputs and the output.

    Returns:
        (o, lse): o like q (same dtype, layout and shape, a new contiguous array); lse float32
        (batch, heads, seqlen_q), natural log: lse_i = log sum_j exp(softmax_scale * q_i . k_j).

    Runs on the current CuPy stream, without host synchronization; allocates only o and lse.

    Example:
        >>> import cupy as cp, cuflash
        >>> q, k, v = (cp.random.randn(2, 1024, 8, 64).astype(cp.float16) for _ in range(3))
        >>> o, lse = cuflash.attention_forward(q, k, v, causal=True)
        >>> o.shape, lse.shape
        ((2, 1024, 8, 64), (2, 8, 1024))
    """
    causal = _validate.check_flag(causal, "causal")
    qi, ki, vi = _validate.array_info(q, "q"), _validate.array_info(k, "k"), _validate.array_info(v, "v")
    dtype, dq, dk, dv = _validate.check_qkv(qi, ki, vi, layout)
    scale = _validate.check_softmax_scale(softmax_scale, dq.head_dim)
    cp = _cupy()

    with _on_device(cp, qi.device):
        o = _empty_like_layout(dq, dq.seqlen, q.dtype, layout)
        lse = cp.empty((dq.batch, dq.heads, dq.seqlen), dtype=cp.float32)
        if o.size == 0:
            return o, lse
        if dk.seqlen == 0:  # no keys at all: every row is fully masked
            o.fill(0)
            lse.fill(-cp.inf)
            return o, lse
        q, dq = _as_kernel_operand(q, qi, dq, layout)
        k, dk = _as_kernel_operand(k, ki, dk, layout)
        v, dv = _as_kernel_operand(v, vi, dv, layout)
        o_strides = _contiguous_strides(dq, layout)

        cfg, kernel = _forward_kernel(qi.device, kernel_head_dim(dq.head_dim), dtype, causal)
        params = _launch.FwdParams(
            q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr,
            dq.batch_stride, dq.row_stride, dq.head_stride,
            dk.batch_stride, dk.row_stride, dk.head_stride,
            dv.batch_stride, dv.row_stride, dv.head_stride,
            *o_strides, dq.seqlen, dk.seqlen, dq.heads, dq.head_dim, scale * _launch.LOG2E)
        kernel.launch((-(-dq.seqlen // cfg.block_m), dq.heads, dq.batch), params, cp.cuda.get_current_stream().ptr)
    return o, lse


def attention(q, k, v, *, causal=False, softmax_scale=None, layout="bshd"):
    """Fused attention: softmax(softmax_scale * q k^T [+ causal mask]) v, exact, O(N) extra memory.

    Same arguments as `attention_forward`; returns only o (like q: same dtype, layout and shape).

    Example:
        >>> import cupy as cp, ml_dtypes, cuflash
        >>> q = cp.random.randn(1, 4096, 16, 128).astype(ml_dtypes.bfloat16)
        >>> o = cuflash.attention(q, q, q, causal=True)
    """
    return attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout)[0]


def _check_like(info, dims, ref_dims, what):
    if (dims.batch, dims.seqlen, dims.heads, dims.head_dim) != (ref_dims.batch, ref_dims.seqlen, ref_dims.heads,
                                                                ref_dims.head_dim):
        raise ValueError(f"{info.name} has shape {info.shape} but must have the shape of {what}")


def _extent(info):
    """[first, last) byte range an array's elements occupy."""
    item = info.dtype.itemsize
    lo = hi = 0
    for n, s in zip(info.shape, info.strides):
        if n == 0:
            return info.ptr, info.ptr
        (hi, lo) = (hi + (n - 1) * s * item, lo) if s >= 0 else (hi, lo + (n - 1) * s * item)
    return info.ptr + lo, info.ptr + hi + item


def _check_out(x, name, ref_dims, like_name, dtype, layout, inputs):
    info = _validate.array_info(x, name)
    if info.dtype != dtype:
        raise TypeError(f"{name}.dtype={info.dtype} must be {dtype}, the dtype of {like_name}")
    dims = _validate.bshd_dims(info, layout)
    _check_like(info, dims, ref_dims, like_name)
    if _validate.needs_aligned_copy(info, dims):
        raise ValueError(f"{name} (preallocated) must be 16-byte aligned with batch/seqlen/head strides that are "
                         f"multiples of 8 elements; got strides {info.strides} at address {info.ptr:#x}")
    a0, a1 = _extent(info)
    for other in inputs:
        b0, b1 = _extent(other)
        if a0 < b1 and b0 < a1:
            raise ValueError(f"{name} (preallocated) overlaps the memory of {other.name}; outputs must not alias inputs")
    return info, dims


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, layout="bshd",
                       deterministic=False, dq=None, dk=None, dv=None):
    """Gradients of attention with respect to q, k and v, recomputing P tile by tile (no N x N memory).

    Args:
        dout: gradient of the loss with respect to `out`, shaped like q (any strides, last dim contiguous).
        q, k, v: the forward's inputs (same conventions as `attention_forward`).
        out, lse: the forward's outputs, from `attention_forward(q, k, v, ...)` with the same options.
            lse: float32 (batch, heads, seqlen_q).
        causal, softmax_scale, layout: as given to the forward.
        deterministic: False (default) accumulates dq with fp32 atomics, whose order varies from run to
            run (results differ in the last bits); True computes dq in a second kernel that owns each
            query block, bitwise reproducible, at the cost of recomputing S and dP (about 1.4x the
            backward's FLOPs).
        dq, dk, dv: optional preallocated outputs shaped like q, k, v, in their dtype, not aliasing an input.

    Returns:
        (dq, dk, dv) in the inputs' dtype and layout.

    Extra device memory: lse_log2 and delta (float32, batch*heads*seqlen_q each) and, unless
    deterministic, a float32 dq accumulator of batch*heads*seqlen_q*head_dim: O(N), never O(N^2).

    Example:
        >>> o, lse = cuflash.attention_forward(q, k, v, causal=True)
        >>> dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    """
    causal = _validate.check_flag(causal, "causal")
    deterministic = _validate.check_flag(deterministic, "deterministic")
    qi, ki, vi = (_validate.array_info(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    dtype, dq_, dk_, dv_ = _validate.check_qkv(qi, ki, vi, layout)
    doi, oi = _validate.array_info(dout, "dout"), _validate.array_info(out, "out")
    _validate.check_dtype(qi, doi, oi)
    ddo, do_ = _validate.bshd_dims(doi, layout), _validate.bshd_dims(oi, layout)
    _check_like(doi, ddo, dq_, "q")
    _check_like(oi, do_, dq_, "q")
    li = _validate.array_info(lse, "lse")
    if li.dtype != np.float32:
        raise TypeError(f"lse.dtype={li.dtype} must be float32 (the lse returned by attention_forward)")
    want = (dq_.batch, dq_.heads, dq_.seqlen)
    if li.shape != want:
        raise ValueError(f"lse has shape {li.shape}; expected (batch, heads, seqlen_q) = {want}")
    if any(not float(s).is_integer() for s in li.strides):
        raise ValueError(f"lse has strides {li.strides} (elements) that are not whole elements")
    _validate.check_same_device(qi, ki, vi, doi, oi, li)
    scale = _validate.check_softmax_scale(softmax_scale, dq_.head_dim)
    cp = _cupy()
    inputs = (qi, ki, vi, doi, oi, li)

    with cp.cuda.Device(qi.device):
        outs = []
        dq_arg, dk_arg, dv_arg = dq, dk, dv
        for x, name, ref, like in ((dq, "dq", dq_, "q"), (dk, "dk", dk_, "k"), (dv, "dv", dv_, "v")):
            if x is None:
                x = _empty_like_layout(ref, ref.seqlen, q.dtype, layout)
                info = _validate.array_info(x, name)
                outs.append((x, _validate.bshd_dims(info, layout)))
            else:
                outs.append((x, _check_out(x, name, ref, like, q.dtype, layout, inputs)[1]))
        (dq, ddq), (dk, ddk), (dv, ddv) = outs
        if sum(x is not None for x in (dq_arg, dk_arg, dv_arg)) > 1:
            ranges = [(_extent(_validate.array_info(x, n)), n) for x, n, arg in
                      ((dq, "dq", dq_arg), (dk, "dk", dk_arg), (dv, "dv", dv_arg)) if arg is not None]
            for i, ((a0, a1), na) in enumerate(ranges):
                for (b0, b1), nb in ranges[i + 1:]:
                    if a0 < b1 and b0 < a1:
                        raise ValueError(f"{nb} (preallocated) overlaps the memory of {na}; dq, dk and dv must be "
                                         f"separate arrays")
        if dq.size + dk.size == 0:
            return dq, dk, dv
        if dq_.seqlen == 0 or dk_.seqlen == 0:  # no query or no key: no pair contributes
            for x in (dq, dk, dv):
                x.fill(0)
            return dq, dk, dv
        q, dq_ = _as_kernel_operand(q, qi, dq_, layout)
        k, dk_ = _as_kernel_operand(k, ki, dk_, layout)
        v, dv_ = _as_kernel_operand(v, vi, dv_, layout)
        dout, ddo = _as_kernel_operand(dout, doi, ddo, layout)
        out, do_ = _as_kernel_operand(out, oi, do_, layout)
        ls = tuple(int(s) for s in li.strides)

        hd = kernel_head_dim(dq_.head_dim)
        b, h, sq, sk = dq_.batch, dq_.heads, dq_.seqlen, dk_.seqlen
        sq_pad = -(-sq // SEQLEN_Q_PAD) * SEQLEN_Q_PAD
        lse_log2 = cp.empty((b, h, sq_pad), dtype=cp.float32)
        delta = cp.empty((b, h, sq_pad), dtype=cp.float32)
        dq_accum = None if deterministic else cp.empty((b, h, sq_pad, hd), dtype=cp.float32)

        params = _launch.BwdParams(
            q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr,
            lse.data.ptr, 0 if dq_accum is None else dq_accum.data.ptr, lse_log2.data.ptr, delta.data.ptr,
            *(s for d in (dq_, dk_, dv_, do_, ddo, ddq, ddk, ddv) for s in (d.batch_stride, d.row_stride, d.head_stride)),
            ls[0], ls[1], ls[2],
            sq, sk, sq_pad, h, dq_.head_dim, hd, _launch.scale_log2(scale), scale)
        stream = cp.cuda.get_current_stream().ptr
        pre = ElementwiseConfig("preprocess", dtype)
        _launch.get_kernel(pre, qi.device).launch((sq_pad // pre.rows_per_cta, h, b), params, stream)
        main = backward_kernel_config(hd, dtype, causal, deterministic, _launch.device_arch(qi.device))
        _launch.get_kernel(main, qi.device).launch(main.grid(b, h, sk), params, stream)
        if deterministic:
            dqc = dq_config(hd, dtype, causal)
            _launch.get_kernel(dqc, qi.device).launch(dqc.grid(b, h, sq), params, stream)
        else:
            conv = ElementwiseConfig("convert_dq", dtype)
            chunks = sq * (dq_.head_dim // 8)
            _launch.get_kernel(conv, qi.device).launch((-(-chunks // conv.threads), h, b), params, stream)
    return dq, dk, dv
