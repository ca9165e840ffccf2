"""Slow, obviously correct attention in NumPy: the yardstick for the kernels and the analyzer.

All functions take NumPy arrays in the "bshd" layout, q (B, Sq, H, D), k and v (B, Sk, H, D), and follow
the library's conventions:
  * causal masks align to the bottom-right: query i sees key j iff j <= i + Sk - Sq;
  * a query row that sees no key outputs 0 and has lse = -inf, and contributes no gradient.

`attention_forward64` / `attention_backward64` compute in float64. `attention_lowp` /
`attention_backward_lowp` compute plain (unfused) attention rounding every intermediate to the input
dtype, the way a framework's fp16/bf16 attention does; the test pass rule compares the kernel's error
against theirs (DESIGN.md section 5).
"""
from __future__ import annotations

import numpy as np

try:
    import ml_dtypes

    _LOWP = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    _LOWP = {"fp16": np.float16, "float16": np.float16}


def causal_mask(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Boolean (Sq, Sk): True where query i may attend key j (bottom-right aligned)."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def _scores(q, k, scale):
    # S[b, h, i, j] = scale * sum_d q[b, i, h, d] k[b, j, h, d]
    return np.einsum("bihd,bjhd->bhij", q, k) * scale


def _scale(softmax_scale, head_dim):
    return 1.0 / np.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def attention_forward64(q, k, v, causal=False, softmax_scale=None):
    """float64 attention. Returns (o (B, Sq, H, D) float64, lse (B, H, Sq) float64)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    s = _scores(q, k, _scale(softmax_scale, q.shape[-1]))
    if causal:
        s = np.where(causal_mask(sq, sk), s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if sk else np.full(s.shape[:-1] + (1,), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)  # fully masked row: exp(-inf - 0) = 0, not NaN
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0)
        lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(l[..., 0]), -np.inf)
    o = np.einsum("bhij,bjhd->bihd", p, v)
    return o, lse


def attention_backward64(do, q, k, v, causal=False, softmax_scale=None):
    """float64 gradients of attention_forward64's output. Returns (dq, dk, dv), each float64."""
    do, q, k, v = (np.asarray(x, dtype=np.float64) for x in (do, q, k, v))
    scale = _scale(softmax_scale, q.shape[-1])
    o, lse = attention_forward64(q, k, v, causal, scale)
    s = _scores(q, k, scale)
    lse_safe = np.where(np.isfinite(lse), lse, 0.0)[..., None]
    p = np.exp(s - lse_safe)
    if causal:
        p = np.where(causal_mask(q.shape[1], k.shape[1]), p, 0.0)
    p = np.where(np.isfinite(lse)[..., None], p, 0.0)
    dv = np.einsum("bhij,bihd->bjhd", p, do)
    dp = np.einsum("bihd,bjhd->bhij", do, v)
    delta = np.einsum("bihd,bihd->bhi", do, o)[..., None]  # D_i = rowsum(dO * O)
    ds = p * (dp - delta)
    dq = np.einsum("bhij,bjhd->bihd", ds, k) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    return dq, dk, dv


def _round(x, dtype):
    return np.asarray(x, dtype=np.float32).astype(_LOWP[dtype]).astype(np.float32)


def attention_lowp(q, k, v, dtype, causal=False, softmax_scale=None):
    """Plain attention in `dtype` ("fp16"/"bf16"): fp32 accumulation, each intermediate rounded."""
    q, k, v = (_round(x, dtype) for x in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    s = _round(np.einsum("bihd,bjhd->bhij", q, k) * np.float32(_scale(softmax_scale, q.shape[-1])), dtype)
    if causal:
        s = np.where(causal_mask(sq, sk), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = _round(np.where(l > 0, p / np.where(l > 0, l, 1), 0), dtype)
    return _round(np.einsum("bhij,bjhd->bihd", p, v), dtype)


def attention_backward_lowp(do, q, k, v, dtype, causal=False, softmax_scale=None):
    """Plain attention backward in `dtype`: each matmul output and P, dP, dS rounded to `dtype`."""
    do, q, k, v = (_round(x, dtype) for x in (do, q, k, v))
    scale = np.float32(_scale(softmax_scale, q.shape[-1]))
    sq, sk = q.shape[1], k.shape[1]
    s = _round(np.einsum("bihd,bjhd->bhij", q, k) * scale, dtype)
    if causal:
        s = np.where(causal_mask(sq, sk), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = _round(np.where(l > 0, p / np.where(l > 0, l, 1), 0), dtype)
    o = _round(np.einsum("bhij,bjhd->bihd", p, v), dtype)
    dv = _round(np.einsum("bhij,bihd->bjhd", p, do), dtype)
    dp = _round(np.einsum("bihd,bjhd->bhij", do, v), dtype)
    delta = np.einsum("bihd,bihd->bhi", do, o)[..., None]
    ds = _round(p * (dp - delta), dtype)
    dq = _round(np.einsum("bhij,bjhd->bihd", ds, k) * scale, dtype)
    dk = _round(np.einsum("bhij,bihd->bjhd", ds, q) * scale, dtype)
    return dq, dk, dv
