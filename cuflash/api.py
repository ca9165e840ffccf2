"""Public API: validate -> pick the kernel config -> compile (cached) -> launch on the current stream."""
from __future__ import annotations

from . import _launch, _validate
from .config import fwd_config, kernel_head_dim


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
    qi, ki, vi = (_validate.array_info(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    dtype, dq, dk, dv = _validate.check_qkv(qi, ki, vi, layout)
    scale = _validate.check_softmax_scale(softmax_scale, dq.head_dim)
    cp = _cupy()

    with cp.cuda.Device(qi.device):
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
        do_ = _validate.bshd_dims(_validate.array_info(o, "o"), layout)

        cfg = fwd_config(kernel_head_dim(dq.head_dim), dtype, causal)
        kernel = _launch.get_kernel(cfg, qi.device)
        params = _launch.FwdParams(
            q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr,
            dq.batch_stride, dq.row_stride, dq.head_stride,
            dk.batch_stride, dk.row_stride, dk.head_stride,
            dv.batch_stride, dv.row_stride, dv.head_stride,
            do_.batch_stride, do_.row_stride, do_.head_stride,
            dq.seqlen, dk.seqlen, dq.heads, dq.head_dim, _launch.scale_log2(scale))
        kernel.launch(cfg.grid(dq.batch, dq.heads, dq.seqlen), params, cp.cuda.get_current_stream().ptr)
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
