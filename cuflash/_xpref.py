"""cuflash.reference's math for NumPy *or* CuPy arrays, so large checks can run on the GPU.

The functions mirror `cuflash.reference` line by line (same conventions, same rounding points) but use
batched matmuls of the array module `xp` of their inputs: with CuPy arrays a float64 reference of a
(2, 1024, 2, 256) problem takes milliseconds instead of seconds. tests/test_reference.py checks that,
on NumPy arrays, every function here agrees with `cuflash.reference`.

Low-precision rounding is done on float32 bit patterns (round to nearest even, as ml_dtypes does), so
it does not depend on CuPy's bfloat16 arithmetic; only fp16 uses a dtype cast.

Arrays are in the "bshd" layout: q (B, Sq, H, D), k and v (B, Sk, H, D); lse is (B, H, Sq).
"""
from __future__ import annotations

import math

import numpy as np


def array_module(x):
    """numpy or cupy, whichever `x` belongs to (without importing CuPy for NumPy arrays)."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def round_to(x, dtype: str):
    """float32 copy of x rounded to "fp16" or "bf16" (round to nearest even), returned as float32."""
    xp = array_module(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    if dtype in ("fp16", "float16"):
        return x.astype(xp.float16).astype(xp.float32)
    if dtype not in ("bf16", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}; allowed: 'fp16', 'bf16'")
    u = x.view(xp.uint32)
    # bf16 keeps the top 16 bits: add 0x7fff plus the lowest kept bit, then truncate (ties to even)
    r = (u + (xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1)))) & xp.uint32(0xFFFF0000)
    return xp.where(xp.isnan(x), x, r.view(xp.float32))


def _bf16_dtype():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def to_lowp(x, dtype: str):
    """x (any float array) rounded to an fp16 or bf16 array of the same module, contiguous.

    bf16 is produced from the rounded float32 bit pattern (its top 16 bits) and a dtype view, so it
    needs CuPy to know the bfloat16 dtype but not to convert to it."""
    xp = array_module(x)
    r = round_to(x, dtype)
    if dtype in ("fp16", "float16"):
        return r.astype(xp.float16)
    return (r.view(xp.uint32) >> xp.uint32(16)).astype(xp.uint16).view(_bf16_dtype())


def to_float32(x):
    """Contiguous float32 copy of an fp16, bf16 (widened bit-wise) or other float array."""
    xp = array_module(x)
    if x.dtype == _bf16_dtype():
        bits = xp.ascontiguousarray(x.view(xp.uint16)).astype(xp.uint32) << xp.uint32(16)
        return bits.view(xp.float32)
    return xp.ascontiguousarray(x, dtype=xp.float32)


def causal_mask(xp, seqlen_q: int, seqlen_k: int):
    """Boolean (Sq, Sk): True where query i may attend key j (bottom-right aligned)."""
    i = xp.arange(seqlen_q)[:, None]
    j = xp.arange(seqlen_k)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def _scale(softmax_scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _bh(x):
    """(B, S, H, D) -> (B, H, S, D) view."""
    return x.transpose(0, 2, 1, 3)


def _softmax_rows(xp, s):
    """Rows of s (-inf where masked) -> (p, m, l) with the fully-masked-row convention (p = 0)."""
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, xp.zeros((), dtype=s.dtype))  # masked row: exp(-inf - 0) = 0, not NaN
    p = xp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return p, m, l


def attention_forward64(q, k, v, causal=False, softmax_scale=None):
    """float64 attention. Returns (o (B, Sq, H, D), lse (B, H, Sq)), float64 arrays of q's module."""
    xp = array_module(q)
    q, k, v = (xp.asarray(x, dtype=xp.float64) for x in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    s = (_bh(q) @ _bh(k).transpose(0, 1, 3, 2)) * _scale(softmax_scale, q.shape[-1])  # (B, H, Sq, Sk)
    if causal:
        s = xp.where(causal_mask(xp, sq, sk), s, -xp.inf)
    p, m, l = _softmax_rows(xp, s)
    seen = l > 0
    p = xp.where(seen, p / xp.where(seen, l, 1.0), 0.0)
    lse = xp.where(seen[..., 0], m[..., 0] + xp.log(xp.where(seen[..., 0], l[..., 0], 1.0)), -xp.inf)
    o = _bh(p @ _bh(v))
    return o, lse


def attention_backward64(do, q, k, v, causal=False, softmax_scale=None):
    """float64 gradients of attention_forward64's output for the upstream gradient do: (dq, dk, dv)."""
    xp = array_module(q)
    do, q, k, v = (xp.asarray(x, dtype=xp.float64) for x in (do, q, k, v))
    scale = _scale(softmax_scale, q.shape[-1])
    o, lse = attention_forward64(q, k, v, causal, scale)
    s = (_bh(q) @ _bh(k).transpose(0, 1, 3, 2)) * scale
    finite = xp.isfinite(lse)[..., None]
    p = xp.exp(s - xp.where(finite, lse[..., None], 0.0))
    if causal:
        p = xp.where(causal_mask(xp, q.shape[1], k.shape[1]), p, 0.0)
    p = xp.where(finite, p, 0.0)
    dv = _bh(p.transpose(0, 1, 3, 2) @ _bh(do))
    dp = _bh(do) @ _bh(v).transpose(0, 1, 3, 2)
    delta = (do * o).sum(axis=-1).transpose(0, 2, 1)[..., None]  # D_i = rowsum(dO * O), (B, H, Sq, 1)
    ds = p * (dp - delta)
    dq = _bh(ds @ _bh(k)) * scale
    dk = _bh(ds.transpose(0, 1, 3, 2) @ _bh(q)) * scale
    return dq, dk, dv


def attention_lowp(q, k, v, dtype, causal=False, softmax_scale=None):
    """Plain attention in `dtype` ("fp16"/"bf16"): fp32 matmuls, S, P and O rounded to `dtype`."""
    xp = array_module(q)
    q, k, v = (round_to(x, dtype) for x in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    s = round_to((_bh(q) @ _bh(k).transpose(0, 1, 3, 2)) * xp.float32(_scale(softmax_scale, q.shape[-1])), dtype)
    if causal:
        s = xp.where(causal_mask(xp, sq, sk), s, xp.float32(-xp.inf))
    p, _, l = _softmax_rows(xp, s)
    seen = l > 0
    p = round_to(xp.where(seen, p / xp.where(seen, l, xp.float32(1)), xp.float32(0)), dtype)
    return _bh(round_to(p @ _bh(v), dtype))


def attention_backward_lowp(do, q, k, v, dtype, causal=False, softmax_scale=None):
    """Plain attention backward in `dtype`: each matmul output and P, dP, dS rounded to `dtype`."""
    xp = array_module(q)
    do, q, k, v = (round_to(x, dtype) for x in (do, q, k, v))
    scale = xp.float32(_scale(softmax_scale, q.shape[-1]))
    sq, sk = q.shape[1], k.shape[1]
    s = round_to((_bh(q) @ _bh(k).transpose(0, 1, 3, 2)) * scale, dtype)
    if causal:
        s = xp.where(causal_mask(xp, sq, sk), s, xp.float32(-xp.inf))
    p, _, l = _softmax_rows(xp, s)
    seen = l > 0
    p = round_to(xp.where(seen, p / xp.where(seen, l, xp.float32(1)), xp.float32(0)), dtype)
    o = _bh(round_to(p @ _bh(v), dtype))
    dv = _bh(round_to(p.transpose(0, 1, 3, 2) @ _bh(do), dtype))
    dp = round_to(_bh(do) @ _bh(v).transpose(0, 1, 3, 2), dtype)
    delta = (do * o).sum(axis=-1).transpose(0, 2, 1)[..., None]
    ds = round_to(p * (dp - delta), dtype)
    dq = _bh(round_to((ds @ _bh(k)) * scale, dtype))
    dk = _bh(round_to((ds.transpose(0, 1, 3, 2) @ _bh(q)) * scale, dtype))
    return dq, dk, dv
