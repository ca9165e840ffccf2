"""cuflash.reference's math for NumPy *or* CuPy arrays, so large checks can run on the GPU.

The functions mirror `cuflash.reference` line by line (same conventions, same rounding points) but use
batched matmuls of the array module `xp` of their inputs: with CuPy arrays a float64 reference of a
(2, 1024, 2, 256) problem takes milliseconds instead of seconds. tests/test_reference.py checks that,
on NumPy arrays, every function here agrees with `cuflash.reference`.

Low-precision rounding is done on float32 bit patterns (round to nearest even, as ml_dtypes does), so
it does not depend on CuPy's bfloat16 arithmetic; only fp16 uses a dtype cast. TF32 rounding (`round_tf32`) is
done on the bit patterns too.

Arrays are in the "bshd" layout: q (B, Sq, H_q, D), k and v (B, Sk, H_kv, D) with H_q a multiple of H_kv
(grouped-query attention: query head h uses key/value head h // (H_q // H_kv)); lse is (B, H_q, Sq).
The varlen and KV-cache references work one sequence at a time on top of the dense ones, as in
`cuflash.reference`.

KV cache (`attention_kvcache*`, `kvcache_append`): every argument of `cuflash.reference`'s (cache_batch_idx,
cache_leftpad, rotary_cos / rotary_sin / rotary_interleaved, window, alibi_slopes, softcap), with its semantics and
validation (the checks run on host copies of the index arrays). q and the new keys are rotated on their module by
`apply_rotary` (float32 products, rounded once to the dtype, in the low-precision reference); a window, ALiBi or
soft-cap goes through `attention_plain` in "fp64" (float64 reference) or `cuflash.reference.attention_lowp` on
host copies of each sequence (low precision, small decode shapes), the results on q's module.

Of the score modifiers the fp16/bf16 and float64 dense, varlen and backward functions mirror only the additive bias
and the boolean masks (bias, mask, key_padding_mask, with the broadcast rule and dbias of `cuflash.reference`); the
others need `cuflash.reference` or `attention_plain` (below). The bias may be float16, bfloat16 (widened bit-wise),
float32 or float64; the masks bool; either module.

float32 and float64 inputs (`attention_plain`, `attention_backward_plain` and their varlen forms) have plain,
unfused attention in one working precision with every option of `cuflash.reference` (window, ALiBi, softcap,
dropout with a given keep mask, bias, masks): "fp32" (float32 throughout: with CuPy, cuBLAS float32 matmuls),
"tf32" (float32, every matmul input rounded to TF32 first), "fp64" (float64 throughout) and "ext" (NumPy's
np.longdouble throughout: 64 mantissa bits on x86, the yardstick of float64 results).
"""
from __future__ import annotations

import math

import numpy as np

from . import reference
from .reference import (_check_softcap, _visible, broadcast_shape4, check_rotary, check_rotary_positions,
                        kvcache_leftpad, kvcache_rotary_positions, kvcache_rows, kvcache_slopes, rotary_pairs,
                        rotary_window_given, varlen_bias_index)


def array_module(x):
    """numpy or cupy, whichever `x` belongs to (without importing CuPy for NumPy arrays)."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def round_tf32(x):
    """float32 copy of x rounded to TF32 (10 explicit mantissa bits; the exponent range of float32) to nearest,
    ties away from zero (cvt.rna.tf32.f32's rule; the kernels round to nearest with Veltkamp's split, cuda/wide.cuh,
    which may break an exact tie the other way): the low 13 bits of every result are 0. NaN stays NaN, +-inf
    stays; a value within half a TF32 step of the float32 maximum rounds to inf."""
    xp = array_module(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    u = x.view(xp.uint32)
    r = (u + xp.uint32(0x1000)) & xp.uint32(0xFFFFE000)  # half a TF32 step added to the magnitude, then truncated
    return xp.where(xp.isnan(x), x, r.view(xp.float32))


def round_to(x, dtype: str):
    """float32 copy of x rounded to "fp16" or "bf16" (round to nearest even) or "tf32" (`round_tf32`), returned as
    float32; "fp32": a float32 copy of x; "fp64": a float64 copy of x."""
    xp = array_module(x)
    if dtype in ("fp64", "float64"):
        return xp.array(to_float32(x) if x.dtype == _bf16_dtype() else x, dtype=xp.float64)
    if dtype in ("fp32", "float32"):
        return xp.array(to_float32(x) if x.dtype == _bf16_dtype() else x, dtype=xp.float32)
    if dtype == "tf32":
        return round_tf32(to_float32(x))
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    if dtype in ("fp16", "float16"):
        return x.astype(xp.float16).astype(xp.float32)
    if dtype not in ("bf16", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}; allowed: 'fp16', 'bf16', 'tf32', 'fp32', 'fp64'")
    u = x.view(xp.uint32)
    # bf16 keeps the top 16 bits: add 0x7fff plus the lowest kept bit, then truncate (ties to even)
    r = (u + (xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1)))) & xp.uint32(0xFFFF0000)
    return xp.where(xp.isnan(x), x, r.view(xp.float32))


def _bf16_dtype():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def to_lowp(x, dtype: str):
    """x (any float array) rounded to an fp16 or bf16 array of the same module, contiguous ("fp32", "tf32": a
    float32 array holding float32 / TF32 values; "fp64": a float64 array).

    bf16 is produced from the rounded float32 bit pattern (its top 16 bits) and a dtype view, so it
    needs CuPy to know the bfloat16 dtype but not to convert to it."""
    xp = array_module(x)
    r = round_to(x, dtype)
    if dtype in ("fp32", "float32", "tf32", "fp64", "float64"):
        return r
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


def repeat_kv(x, heads_q: int):
    """(B, S, H_kv, D) -> (B, S, H_q, D) with query head h reading head h // (H_q // H_kv) of x."""
    xp = array_module(x)
    heads_kv = x.shape[2]
    if heads_kv == heads_q:
        return x
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}")
    return xp.repeat(x, heads_q // heads_kv, axis=2)


def sum_kv_groups(dx, heads_kv: int):
    """Gradient of `repeat_kv`: (B, S, H_q, D) -> (B, S, H_kv, D), each head the sum over its query group."""
    b, s, heads_q, d = dx.shape
    if heads_q == heads_kv:
        return dx
    return dx.reshape(b, s, heads_kv, heads_q // heads_kv, d).sum(axis=3)


def _bh(x):
    """(B, S, H, D) -> (B, H, S, D) view."""
    return x.transpose(0, 2, 1, 3)


def expand_broadcast(x, batch: int, heads: int, seqlen_q: int, seqlen_k: int, *, name: str = "x"):
    """x (a bias or mask, ndim 2..4) as a (B, H, Sq, Sk) view of x's module and dtype, element [b, h, i, j] =
    x[b // (B // Bb), h // (H // Hb), i if Sqb > 1 else 0, j if Skb > 1 else 0]
    (`cuflash.reference.expand_broadcast`)."""
    xp = array_module(x)
    bb, hb, sqb, skb = broadcast_shape4(x.shape, batch, heads, seqlen_q, seqlen_k, name)
    x = x.reshape(bb, hb, sqb, skb)
    if bb != batch:
        x = xp.repeat(x, batch // bb, axis=0)
    if hb != heads:
        x = xp.repeat(x, heads // hb, axis=1)
    return xp.broadcast_to(x, (batch, heads, seqlen_q, seqlen_k))


def reduce_broadcast(full, shape):
    """The adjoint of `expand_broadcast`: full (B, H, Sq, Sk) summed into `shape`
    (`cuflash.reference.reduce_broadcast`)."""
    batch, heads, sq, sk = full.shape
    bb, hb, sqb, skb = broadcast_shape4(shape, batch, heads, sq, sk, "shape")
    out = full.reshape(bb, batch // bb if bb else 0, hb, heads // hb if hb else 0, sq, sk).sum(axis=(1, 3))
    if sqb != sq:
        out = out.sum(axis=2, keepdims=True)
    if skb != sk:
        out = out.sum(axis=3, keepdims=True)
    return out.reshape(tuple(shape))


def _as_float(xp, x, dtype):
    """x (an fp16, bf16, fp32 or fp64 array of either module) as an array of module xp and float dtype."""
    if x.dtype == _bf16_dtype():
        x = to_float32(x)
    return xp.asarray(x, dtype=dtype)


def _bias_mask(xp, shape_bhqk, bias, mask, key_padding_mask, dtype):
    """(the bias as a (B, H_q, Sq, Sk) array of `dtype` or None, attend: bool (B, H_q, Sq, Sk), True where both
    mask and key_padding_mask let the key through, or None), arrays of module xp (`cuflash.reference._bias_mask`)."""
    if bias is not None:
        bias = expand_broadcast(_as_float(xp, bias, dtype), *shape_bhqk, name="bias")
    attend = None
    if mask is not None:
        mask = xp.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask has dtype {mask.dtype}; expected bool (True = attend)")
        attend = expand_broadcast(mask, *shape_bhqk, name="mask")
    if key_padding_mask is not None:
        key_padding_mask = xp.asarray(key_padding_mask)
        batch, seqlen_k = shape_bhqk[0], shape_bhqk[3]
        if key_padding_mask.dtype != np.bool_ or key_padding_mask.shape != (batch, seqlen_k):
            raise ValueError(f"key_padding_mask is {key_padding_mask.dtype} {key_padding_mask.shape}; expected bool "
                             f"({batch}, {seqlen_k})")
        padding = key_padding_mask[:, None, None, :]
        attend = padding if attend is None else attend & padding
    if attend is not None:
        attend = xp.broadcast_to(attend, tuple(shape_bhqk))
    return bias, attend


def _softmax_rows(xp, s):
    """Rows of s (-inf where masked) -> (p, m, l) with the fully-masked-row convention (p = 0)."""
    if s.shape[-1] == 0:  # no keys at all: every row is fully masked (and max() has no identity)
        m = xp.zeros(s.shape[:-1] + (1,), dtype=s.dtype)
        return s, m, xp.zeros_like(m)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, xp.zeros((), dtype=s.dtype))  # masked row: exp(-inf - 0) = 0, not NaN
    p = xp.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return p, m, l


def attention_forward64(q, k, v, causal=False, softmax_scale=None, *, bias=None, mask=None, key_padding_mask=None):
    """float64 attention (bias before the masks). Returns (o (B, Sq, H_q, D), lse (B, H_q, Sq)), float64 arrays of
    q's module."""
    xp = array_module(q)
    q, k, v = (xp.asarray(x, dtype=xp.float64) for x in (q, k, v))
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    sq, sk = q.shape[1], k.shape[1]
    bias, attend = _bias_mask(xp, (q.shape[0], q.shape[2], sq, sk), bias, mask, key_padding_mask, xp.float64)
    s = (_bh(q) @ _bh(k).transpose(0, 1, 3, 2)) * _scale(softmax_scale, q.shape[-1])  # (B, H, Sq, Sk)
    if bias is not None:
        s = s + bias
    if causal:
        s = xp.where(causal_mask(xp, sq, sk), s, -xp.inf)
    if attend is not None:
        s = xp.where(attend, s, -xp.inf)
    p, m, l = _softmax_rows(xp, s)
    seen = l > 0
    p = xp.where(seen, p / xp.where(seen, l, 1.0), 0.0)
    lse = xp.where(seen[..., 0], m[..., 0] + xp.log(xp.where(seen[..., 0], l[..., 0], 1.0)), -xp.inf)
    o = _bh(p @ _bh(v))
    return o, lse


def attention_backward64(do, q, k, v, causal=False, softmax_scale=None, *, bias=None, mask=None,
                         key_padding_mask=None):
    """float64 gradients of attention_forward64's output for the upstream gradient do: (dq, dk, dv), shaped
    like q, k, v (dk, dv summed over the query heads of each group); with a bias (dq, dk, dv, dbias), dbias
    float64 shaped like bias."""
    xp = array_module(q)
    do, q, k, v = (xp.asarray(x, dtype=xp.float64) for x in (do, q, k, v))
    heads_kv = k.shape[2]
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    scale = _scale(softmax_scale, q.shape[-1])
    o, lse = attention_forward64(q, k, v, causal, scale, bias=bias, mask=mask, key_padding_mask=key_padding_mask)
    bias_full, attend = _bias_mask(xp, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), bias, mask, key_padding_mask,
                                 xp.float64)
    s = (_bh(q) @ _bh(k).transpose(0, 1, 3, 2)) * scale
    if bias_full is not None:
        s = s + bias_full
    if attend is not None:
        s = xp.where(attend, s, -xp.inf)  # masked keys: exp(-inf - lse) = 0
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
    grads = dq, sum_kv_groups(dk, heads_kv), sum_kv_groups(dv, heads_kv)
    return grads if bias is None else (*grads, reduce_broadcast(ds, bias.shape))


def attention_lowp(q, k, v, dtype, causal=False, softmax_scale=None, *, bias=None, mask=None, key_padding_mask=None):
    """Plain attention in `dtype` ("fp16"/"bf16"): fp32 matmuls, S, P and O rounded to `dtype`; the float32 bias
    is added to the rounded S and the sum rounded."""
    xp = array_module(q)
    q, k, v = (round_to(x, dtype) for x in (q, k, v))
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    sq, sk = q.shape[1], k.shape[1]
    bias, attend = _bias_mask(xp, (q.shape[0], q.shape[2], sq, sk), bias, mask, key_padding_mask, xp.float32)
    s = round_to((_bh(q) @ _bh(k).transpose(0, 1, 3, 2)) * xp.float32(_scale(softmax_scale, q.shape[-1])), dtype)
    if bias is not None:
        s = round_to(s + bias, dtype)
    if causal:
        s = xp.where(causal_mask(xp, sq, sk), s, xp.float32(-xp.inf))
    if attend is not None:
        s = xp.where(attend, s, xp.float32(-xp.inf))
    p, _, l = _softmax_rows(xp, s)
    seen = l > 0
    p = round_to(xp.where(seen, p / xp.where(seen, l, xp.float32(1)), xp.float32(0)), dtype)
    return _bh(round_to(p @ _bh(v), dtype))


def attention_backward_lowp(do, q, k, v, dtype, causal=False, softmax_scale=None, *, bias=None, mask=None,
                            key_padding_mask=None):
    """Plain attention backward in `dtype`: each matmul output and P, dP, dS rounded to `dtype`; with fewer
    key/value heads, the rounded per-query-head dk, dv are summed over each group and rounded again; with a
    bias also dbias, the rounded dS summed over its broadcast dims in float64, float32 shaped like bias."""
    xp = array_module(q)
    do, q, k, v = (round_to(x, dtype) for x in (do, q, k, v))
    heads_kv = k.shape[2]
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    scale = xp.float32(_scale(softmax_scale, q.shape[-1]))
    sq, sk = q.shape[1], k.shape[1]
    bias_full, attend = _bias_mask(xp, (q.shape[0], q.shape[2], sq, sk), bias, mask, key_padding_mask, xp.float32)
    s = round_to((_bh(q) @ _bh(k).transpose(0, 1, 3, 2)) * scale, dtype)
    if bias_full is not None:
        s = round_to(s + bias_full, dtype)
    if causal:
        s = xp.where(causal_mask(xp, sq, sk), s, xp.float32(-xp.inf))
    if attend is not None:
        s = xp.where(attend, s, xp.float32(-xp.inf))
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
    if heads_kv != q.shape[2]:
        dk, dv = round_to(sum_kv_groups(dk, heads_kv), dtype), round_to(sum_kv_groups(dv, heads_kv), dtype)
    if bias is None:
        return dq, dk, dv
    return dq, dk, dv, reduce_broadcast(ds.astype(xp.float64), bias.shape).astype(xp.float32)


# --- variable-length (packed) batches: one sequence at a time ---------------------------------------------

def to_host(x):
    """NumPy copy of a CuPy array (x itself for NumPy arrays and Python values)."""
    return x.get() if type(x).__module__.startswith("cupy") else x


def sequences(cu_seqlens_q, cu_seqlens_k):
    """[(rows of q, rows of k)] as slices, one pair per sequence b: cu[b] .. cu[b + 1] - 1."""
    cu_q, cu_k = (np.asarray(to_host(c)).astype(np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    return [(slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1])))
            for b in range(len(cu_q) - 1)]


def _sequence_bias_mask(b, num_seqs, heads_q, rows_q, rows_k, bias, mask, key_padding_mask):
    """(bias / mask keyword arguments of the dense call for sequence b, the index of its bias in the bias's 4-D
    form or None) (`cuflash.reference._sequence_bias_mask`)."""
    len_q, len_k = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
    kwargs, index = {}, None

    def part(x, name):  # x[b', :, :len_q, :len_k] as (1, Hb, len_q or 1, len_k or 1), and its index
        shape4, index = varlen_bias_index(x.shape, b, num_seqs, heads_q, len_q, len_k, name)
        return x.reshape(shape4)[index][None], index

    if bias is not None:
        kwargs["bias"], index = part(bias, "bias")
    if mask is not None:
        kwargs["mask"] = part(mask, "mask")[0]
    if key_padding_mask is not None:
        if key_padding_mask.ndim != 2 or key_padding_mask.shape[0] != num_seqs or key_padding_mask.shape[1] < len_k:
            raise ValueError(f"key_padding_mask has shape {key_padding_mask.shape}; expected ({num_seqs}, "
                             f"max_seqlen_k) with max_seqlen_k >= {len_k} (sequence {b})")
        kwargs["key_padding_mask"] = key_padding_mask[b:b + 1, :len_k]
    return kwargs, index


def _bias4(xp, bias):
    """A zero float64 accumulator (module xp) of bias's 4-D form (for a varlen dbias), or None."""
    return None if bias is None else xp.zeros((1,) * (4 - bias.ndim) + tuple(bias.shape), dtype=xp.float64)


def attention_varlen_forward64(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None, *, bias=None,
                               mask=None, key_padding_mask=None):
    """float64 attention of packed sequences q (total_q, H_q, D), k, v (total_k, H_kv, D), per sequence; bias, mask
    and key_padding_mask as in `cuflash.reference`. Returns (o (total_q, H_q, D), lse (H_q, total_q))."""
    xp = array_module(q)
    o = xp.zeros(q.shape, dtype=xp.float64)
    lse = xp.full((q.shape[1], q.shape[0]), -xp.inf, dtype=xp.float64)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k)
    for b, (rq, rk) in enumerate(seqs):
        extra, _ = _sequence_bias_mask(b, len(seqs), q.shape[1], rq, rk, bias, mask, key_padding_mask)
        o_b, lse_b = attention_forward64(q[None, rq], k[None, rk], v[None, rk], causal, softmax_scale, **extra)
        o[rq], lse[:, rq] = o_b[0], lse_b[0]
    return o, lse


def attention_varlen_backward64(do, q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None, *,
                                bias=None, mask=None, key_padding_mask=None):
    """float64 (dq, dk, dv), packed like q, k, v; with a bias (dq, dk, dv, dbias), dbias float64 shaped like bias."""
    xp = array_module(q)
    grads = [xp.zeros(x.shape, dtype=xp.float64) for x in (q, k, v)]
    dbias = _bias4(xp, bias)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k)
    for b, (rq, rk) in enumerate(seqs):
        extra, index = _sequence_bias_mask(b, len(seqs), q.shape[1], rq, rk, bias, mask, key_padding_mask)
        g = attention_backward64(do[None, rq], q[None, rq], k[None, rk], v[None, rk], causal, softmax_scale, **extra)
        grads[0][rq], grads[1][rk], grads[2][rk] = g[0][0], g[1][0], g[2][0]
        if dbias is not None:
            dbias[index] += g[3][0]
    return tuple(grads) if bias is None else (*grads, dbias.reshape(bias.shape))


def attention_varlen_lowp(q, k, v, cu_seqlens_q, cu_seqlens_k, dtype, causal=False, softmax_scale=None, *, bias=None,
                          mask=None, key_padding_mask=None):
    """`attention_lowp` per sequence: o (total_q, H_q, D) float32."""
    xp = array_module(q)
    o = xp.zeros(q.shape, dtype=xp.float32)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k)
    for b, (rq, rk) in enumerate(seqs):
        extra, _ = _sequence_bias_mask(b, len(seqs), q.shape[1], rq, rk, bias, mask, key_padding_mask)
        o[rq] = attention_lowp(q[None, rq], k[None, rk], v[None, rk], dtype, causal, softmax_scale, **extra)[0]
    return o


def attention_varlen_backward_lowp(do, q, k, v, cu_seqlens_q, cu_seqlens_k, dtype, causal=False, softmax_scale=None,
                                   *, bias=None, mask=None, key_padding_mask=None):
    """`attention_backward_lowp` per sequence: (dq, dk, dv) float32, packed like q, k, v; with a bias also dbias,
    float32 shaped like bias (the sequences' float32 dbias summed in float64)."""
    xp = array_module(q)
    grads = [xp.zeros(x.shape, dtype=xp.float32) for x in (q, k, v)]
    dbias = _bias4(xp, bias)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k)
    for b, (rq, rk) in enumerate(seqs):
        extra, index = _sequence_bias_mask(b, len(seqs), q.shape[1], rq, rk, bias, mask, key_padding_mask)
        g = attention_backward_lowp(do[None, rq], q[None, rq], k[None, rk], v[None, rk], dtype, causal, softmax_scale,
                                    **extra)
        grads[0][rq], grads[1][rk], grads[2][rk] = g[0][0], g[1][0], g[2][0]
        if dbias is not None:
            dbias[index] += g[3][0]
    return tuple(grads) if bias is None else (*grads, dbias.reshape(bias.shape).astype(xp.float32))


# --- KV cache: rotate, append into a copy, then dense attention over each sequence's keys ------------------------

def kvcache_capacity(cache_shape, block_table=None) -> int:
    """Keys one sequence can hold: S_cache (dense) or max_blocks_per_seq * page_size (paged)."""
    return cache_shape[1] if block_table is None else block_table.shape[1] * cache_shape[1]


def kvcache_seqlens(cache_seqlens, batch: int, capacity: int) -> np.ndarray:
    """cache_seqlens as a host int64 (batch,) array: None -> capacity, an int -> that for every sequence."""
    if cache_seqlens is None:
        return np.full(batch, capacity, dtype=np.int64)
    if np.ndim(to_host(cache_seqlens)) == 0:
        return np.full(batch, int(cache_seqlens), dtype=np.int64)
    return np.asarray(to_host(cache_seqlens)).astype(np.int64).reshape(batch)


def kvcache_slots(xp, b: int, positions, cache_shape, block_table=None, *, cache_batch_idx=None):
    """Index of cache rows (an xp int array of logical key positions) of sequence b in the cache:
    (cache_batch_idx[b] (b when None), positions) for a dense cache (B_cache, S_cache, H_kv, D);
    (block_table[b, p // page_size], p % page_size) for a paged one."""
    if block_table is None:
        row = b if cache_batch_idx is None else int(to_host(cache_batch_idx)[b])
        return xp.full(positions.shape, row, dtype=positions.dtype), positions
    page_size = cache_shape[1]
    table = xp.asarray(block_table)  # a host (NumPy) table works with device positions too
    return table[b, positions // page_size].astype(positions.dtype), positions % page_size


def _host_or_none(x):
    return None if x is None else np.asarray(to_host(x))


def apply_rotary(x, cos, sin, positions, interleaved, dtype=None):
    """`cuflash.reference.apply_rotary` on arrays of x's module: x (..., S, H, D) rotated at positions (..., S)
    (host or device ints) by cos, sin (seqlen_ro, rotary_dim / 2) (fp16, bf16 or float, either module). dtype None:
    float64; "fp16" / "bf16": float32 products and sums (each a separate array operation, so no fused
    multiply-add), rounded once to dtype (float32 holding dtype values)."""
    xp = array_module(x)
    ft = xp.float64 if dtype is None else xp.float32
    x = _cast(xp, x, ft).copy()
    rotary_dim = check_rotary(cos, sin, x.shape[-1])
    positions = xp.asarray(check_rotary_positions(to_host(positions), cos.shape[0]))
    c, s = (_cast(xp, t, ft)[positions][..., None, :] for t in (cos, sin))  # (..., S, 1, rotary_dim / 2)
    first, second = rotary_pairs(rotary_dim, interleaved)
    x1, x2 = x[..., first].copy(), x[..., second].copy()
    x[..., first] = x1 * c - x2 * s
    x[..., second] = x1 * s + x2 * c
    return x if dtype is None else round_to(x, dtype)


def kvcache_append(k_cache, v_cache, k, v, cache_seqlens, block_table=None, *, cache_batch_idx=None, rotary_cos=None,
                   rotary_sin=None, rotary_interleaved=True, dtype=None):
    """Copies of the caches with k, v (B, S_new, H_kv, D) written at cache rows cache_seqlens[b] ..
    cache_seqlens[b] + S_new - 1 of each sequence b (of cache row cache_batch_idx[b] when given). Any dtype: pass
    uint16 views to compare bit patterns. With rotary_cos, rotary_sin (float k and caches) the keys are rotated
    first (`apply_rotary`, new key s at position cache_seqlens[b] + s), as in `cuflash.reference.kvcache_append`."""
    xp = array_module(k_cache)
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    if k is None:
        return k_cache, v_cache
    batch, s_new = k.shape[:2]
    rows = kvcache_rows(_host_or_none(cache_batch_idx), batch, k_cache.shape, block_table, new_keys=True)
    cached = kvcache_seqlens(cache_seqlens, batch, kvcache_capacity(k_cache.shape, block_table))
    if rotary_cos is not None or rotary_sin is not None:
        if k.dtype.kind in "iub":
            raise TypeError(f"k has dtype {k.dtype}: rotary needs float keys (rotate them with apply_rotary first to "
                            "append bit patterns)")
        k = apply_rotary(k, rotary_cos, rotary_sin, cached[:, None] + np.arange(s_new), rotary_interleaved, dtype)
    for b in range(batch):
        slots = kvcache_slots(xp, b, xp.arange(int(cached[b]), int(cached[b]) + s_new), k_cache.shape, block_table,
                              cache_batch_idx=rows)
        k_cache[slots] = k[b]
        v_cache[slots] = v[b]
    return k_cache, v_cache


def kvcache_keys(cache, b: int, start: int, stop: int, block_table=None, *, cache_batch_idx=None):
    """Cache rows start .. stop - 1 of sequence b (keys or values): (stop - start, H_kv, D)."""
    xp = array_module(cache)
    positions = xp.arange(int(start), int(stop))
    return cache[kvcache_slots(xp, b, positions, cache.shape, block_table, cache_batch_idx=cache_batch_idx)]


def _kvcache_modified(window, alibi_slopes, softcap) -> bool:
    """Whether a window, ALiBi or a soft-cap is on (validating the window and the soft-cap)."""
    return rotary_window_given(window) or alibi_slopes is not None or _check_softcap(softcap) is not None


def _kvcache_attention(attend, q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, dtype, *,
                       cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved, window,
                       alibi_slopes):
    """`cuflash.reference._kvcache_attention` on arrays of q's module: rotate, append, then attend(q_b, keys_b,
    values_b, slopes_b) per sequence. Returns (per-sequence results, appended k_cache, appended v_cache)."""
    xp = array_module(q)
    batch, seqlen_q, heads_q = q.shape[:3]
    s_new = 0 if k is None else k.shape[1]
    rows = kvcache_rows(_host_or_none(cache_batch_idx), batch, k_cache.shape, block_table, new_keys=k is not None)
    cached = kvcache_seqlens(cache_seqlens, batch, kvcache_capacity(k_cache.shape, block_table))
    leftpad = kvcache_leftpad(_host_or_none(cache_leftpad), cached)
    slopes = kvcache_slopes(alibi_slopes, batch, heads_q)
    rotary = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved)
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            raise ValueError("rotary_cos and rotary_sin rotate q and the new keys: they need k and v (got k=None)")
        q_positions, _ = kvcache_rotary_positions(cached, seqlen_q, s_new, causal, window)
        q = apply_rotary(q, rotary_cos, rotary_sin, q_positions, rotary_interleaved, dtype)
        if dtype is None:  # the float64 reference keeps the rotated keys unrounded: float64 caches
            k_cache, v_cache = (_cast(xp, c, xp.float64) for c in (k_cache, v_cache))
    k_cache, v_cache = kvcache_append(k_cache, v_cache, k, v, cache_seqlens, block_table,
                                      cache_batch_idx=cache_batch_idx, dtype=dtype, **rotary)
    results = []
    for b in range(batch):
        keys, values = (kvcache_keys(c, b, leftpad[b], cached[b] + s_new, block_table, cache_batch_idx=rows)[None]
                        for c in (k_cache, v_cache))
        results.append(attend(q[b:b + 1], keys, values, None if slopes is None else slopes[b]))
    return results, k_cache, v_cache


def attention_kvcache64(q, k_cache, v_cache, cache_seqlens=None, k=None, v=None, block_table=None, causal=False,
                        softmax_scale=None, *, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
                        rotary_sin=None, rotary_interleaved=True, window=None, alibi_slopes=None, softcap=None,
                        rotary_dtype=None):
    """float64 reference of attention_with_kvcache (see cuflash.reference.attention_kvcache64), float inputs:
    returns (o (B, Sq, H_q, D), lse (B, H_q, Sq), appended k_cache, appended v_cache). rotary_dtype: None rotates in
    float64; "fp16" / "bf16" rounds the rotated q and new keys as the kernel does. A window, ALiBi or soft-cap is
    computed by `attention_plain` in "fp64" (on q's module)."""
    xp = array_module(q)
    modified = _kvcache_modified(window, alibi_slopes, softcap)

    def attend(qb, kb, vb, slopes):
        if not modified:
            return attention_forward64(qb, kb, vb, causal, softmax_scale)
        return attention_plain(qb, kb, vb, "fp64", causal, softmax_scale, window=window, alibi_slopes=slopes,
                               softcap=softcap)

    per_seq, k_cache, v_cache = _kvcache_attention(
        attend, q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, rotary_dtype,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, window=window, alibi_slopes=alibi_slopes)
    o = xp.zeros(q.shape, dtype=xp.float64)
    lse = xp.zeros((q.shape[0], q.shape[2], q.shape[1]), dtype=xp.float64)
    for b, (o_b, lse_b) in enumerate(per_seq):
        o[b], lse[b] = o_b[0], lse_b[0]
    return o, lse, k_cache, v_cache


def attention_kvcache_lowp(q, k_cache, v_cache, dtype, cache_seqlens=None, k=None, v=None, block_table=None,
                           causal=False, softmax_scale=None, *, cache_batch_idx=None, cache_leftpad=None,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=True, window=None, alibi_slopes=None,
                           softcap=None):
    """`attention_lowp` over each sequence's keys after the append, q and the new keys rotated and rounded to
    `dtype` as the kernel does: o (B, Sq, H_q, D) float32. A window, ALiBi or soft-cap is computed by
    `cuflash.reference.attention_lowp` on host copies of the sequence (the result back on q's module)."""
    xp = array_module(q)
    modified = _kvcache_modified(window, alibi_slopes, softcap)

    def attend(qb, kb, vb, slopes):
        if not modified:
            return attention_lowp(qb, kb, vb, dtype, causal, softmax_scale)
        return xp.asarray(reference.attention_lowp(
            to_host(qb), to_host(kb), to_host(vb), dtype, causal, softmax_scale, window=window,
            alibi_slopes=_host_or_none(slopes), softcap=softcap))

    per_seq, _, _ = _kvcache_attention(
        attend, q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, dtype, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, window=window, alibi_slopes=alibi_slopes)
    o = xp.zeros(q.shape, dtype=xp.float32)
    for b, o_b in enumerate(per_seq):
        o[b] = o_b[0]
    return o


# --- float32 and float64 inputs: plain attention in one working precision, with every score modifier ---------

PRECISIONS = ("fp32", "tf32", "fp64", "ext")


def working_dtype(xp, precision: str):
    """The dtype `attention_plain` computes in: float32 for "fp32" and "tf32", float64 for "fp64", np.longdouble
    for "ext" (NumPy only: CuPy has no extended type)."""
    if precision in ("fp32", "tf32"):
        return xp.float32
    if precision == "fp64":
        return xp.float64
    if precision == "ext":
        if xp is not np:
            raise ValueError("precision='ext' (np.longdouble) needs NumPy arrays")
        return np.longdouble
    raise ValueError(f"precision={precision!r}; allowed: {', '.join(map(repr, PRECISIONS))}")


def _cast(xp, x, dtype):
    """x (an array of either module, fp16 / bf16 / float, or a scalar) as an array of module xp and `dtype`."""
    if xp is np:
        x = to_host(x)
    if getattr(x, "dtype", None) == _bf16_dtype():
        x = to_float32(x)
    return xp.asarray(x, dtype=dtype)


def _plain_options(xp, ft, shape_bhqk, causal, window, alibi_slopes, dropout_mask, dropout_p, bias, mask,
                   key_padding_mask):
    """(visible (Sq, Sk) bool or None, the ALiBi scores (B, H, Sq, Sk) or None, keep = Z / (1 - dropout_p) or None,
    the bias (B, H, Sq, Sk) or None, attend (B, H, Sq, Sk) bool or None): arrays of module xp, floats of dtype ft."""
    batch, heads, sq, sk = shape_bhqk
    visible = _visible(sq, sk, causal, window)  # NumPy (validates the window)
    visible = None if visible is None else xp.asarray(visible)
    alibi = None
    if alibi_slopes is not None:
        slopes = _cast(xp, alibi_slopes, ft)
        if slopes.shape not in ((heads,), (batch, heads)):
            raise ValueError(f"alibi_slopes has shape {slopes.shape}; expected ({heads},) or ({batch}, {heads})")
        slopes = xp.broadcast_to(slopes, (batch, heads))
        distance = xp.abs(xp.arange(sq)[:, None] + (sk - sq) - xp.arange(sk)[None, :]).astype(ft)
        alibi = -slopes[:, :, None, None] * distance  # S += -slope * |i + Sk - Sq - j|
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} is not allowed; expected 0 <= dropout_p < 1")
    keep = None
    if dropout_mask is not None:
        z = _cast(xp, dropout_mask, bool)
        if z.shape != tuple(shape_bhqk):
            raise ValueError(f"dropout_mask has shape {z.shape}; expected {tuple(shape_bhqk)}")
        keep = xp.where(z, ft(1.0 / (1.0 - dropout_p)), ft(0))
    elif dropout_p > 0:
        raise ValueError(f"dropout_p={dropout_p} needs dropout_mask (bool {tuple(shape_bhqk)})")
    if bias is not None:
        bias = _cast(xp, bias, ft)
    mask = None if mask is None else _cast(xp, mask, bool)
    key_padding_mask = None if key_padding_mask is None else _cast(xp, key_padding_mask, bool)
    bias, attend = _bias_mask(xp, shape_bhqk, bias, mask, key_padding_mask, ft)
    return visible, alibi, keep, bias, attend


def _plain_scores(xp, ft, qm, km, scale, visible, alibi, bias, attend, softcap):
    """(S (B, H, Sq, Sk) in dtype ft with -inf where masked, tanh(S / softcap) of the biased uncapped S or None),
    in `cuflash.reference`'s order: scale * q . k + bias, softcap, ALiBi, the masks. qm, km: (B, S, H, D) matmul
    inputs (already rounded for "tf32")."""
    s = (_bh(qm) @ _bh(km).transpose(0, 1, 3, 2)) * ft(scale)
    if bias is not None:
        s = s + bias
    t = None
    if softcap:
        t = xp.tanh(s / ft(softcap))
        s = ft(softcap) * t
    if alibi is not None:
        s = s + alibi
    if visible is not None:
        s = xp.where(visible, s, ft(-np.inf))
    if attend is not None:
        s = xp.where(attend, s, ft(-np.inf))
    return s, t


def _matmul_input(precision: str):
    """The rounding of every matmul input: TF32 for "tf32", none otherwise."""
    return round_tf32 if precision == "tf32" else (lambda x: x)


def attention_plain(q, k, v, precision: str, causal=False, softmax_scale=None, *, window=None, alibi_slopes=None,
                    softcap=None, dropout_mask=None, dropout_p=0.0, bias=None, mask=None, key_padding_mask=None):
    """Plain (unfused) attention computed in one working precision (`working_dtype`), with the options and
    conventions of `cuflash.reference.attention_forward64` (window, ALiBi slopes, softcap, dropout with the given
    keep mask Z (B, H_q, Sq, Sk), bias, mask, key_padding_mask; GQA; causal bottom-right):
      "fp32"  float32 throughout (with CuPy: cuBLAS float32 matmuls, TF32 only if CuPy was told to use it);
      "tf32"  as "fp32" with q, k, v and P (after dropout) rounded to TF32 before their matmuls: products of TF32
              values are exact in float32, so this is a TF32 tensor core's matmul with float32 accumulation;
      "fp64"  float64 throughout; "ext": np.longdouble throughout (NumPy arrays only).
    Inputs of any float dtype and module. Returns (o (B, Sq, H_q, D), lse (B, H_q, Sq)) of the working dtype;
    lse is of the scores before dropout; a row that sees no key gets o = 0, lse = -inf."""
    xp = array_module(q)
    ft = working_dtype(xp, precision)
    mm = _matmul_input(precision)
    q, k, v = (_cast(xp, x, ft) for x in (q, k, v))
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    shape_bhqk = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    visible, alibi, keep, bias, attend = _plain_options(xp, ft, shape_bhqk, causal, window, alibi_slopes,
                                                        dropout_mask, dropout_p, bias, mask, key_padding_mask)
    s, _ = _plain_scores(xp, ft, mm(q), mm(k), _scale(softmax_scale, q.shape[-1]), visible, alibi, bias, attend,
                         softcap)
    p, m, l = _softmax_rows(xp, s)
    seen = l > 0
    p = xp.where(seen, p / xp.where(seen, l, ft(1)), ft(0))
    lse = xp.where(seen[..., 0], m[..., 0] + xp.log(xp.where(seen[..., 0], l[..., 0], ft(1))), ft(-np.inf))
    if keep is not None:
        p = p * keep  # dropout after lse: P Z / (1 - p)
    return _bh(mm(p) @ _bh(mm(v))), lse


def attention_backward_plain(do, q, k, v, precision: str, causal=False, softmax_scale=None, *, window=None,
                             alibi_slopes=None, softcap=None, dropout_mask=None, dropout_p=0.0, bias=None, mask=None,
                             key_padding_mask=None):
    """Gradients of `attention_plain` for the upstream gradient do, computed in the same working precision the
    way `cuflash.reference.attention_backward64` does: P = exp(S - lse), dV = (P Z')^T dO, dP = (dO V^T) Z',
    dS = P (dP - D) with D = rowsum(dO * O) (O the plain forward's output), through the softcap, dQ = scale dS K,
    dK = scale dS^T Q (Z' = Z / (1 - dropout_p)). For "tf32" every matmul input (P Z', dO, V, dS, K, Q) is rounded
    to TF32. Returns (dq, dk, dv) shaped like q, k, v (dk, dv summed over each query group), and dbias shaped like
    bias (dS summed over its broadcast dims) after them with a bias; all of the working dtype."""
    xp = array_module(q)
    ft = working_dtype(xp, precision)
    mm = _matmul_input(precision)
    do, q, k, v = (_cast(xp, x, ft) for x in (do, q, k, v))
    heads_kv = k.shape[2]
    options = dict(window=window, alibi_slopes=alibi_slopes, softcap=softcap, dropout_mask=dropout_mask,
                   dropout_p=dropout_p, bias=bias, mask=mask, key_padding_mask=key_padding_mask)
    o, lse = attention_plain(q, k, v, precision, causal, softmax_scale, **options)
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    scale = _scale(softmax_scale, q.shape[-1])
    shape_bhqk = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    visible, alibi, keep, bias_full, attend = _plain_options(xp, ft, shape_bhqk, causal, window, alibi_slopes,
                                                             dropout_mask, dropout_p, bias, mask, key_padding_mask)
    qm, km, vm, dom = (mm(x) for x in (q, k, v, do))
    s, t = _plain_scores(xp, ft, qm, km, scale, visible, alibi, bias_full, attend, softcap)
    finite = xp.isfinite(lse)[..., None]
    p = xp.where(finite, xp.exp(s - xp.where(finite, lse[..., None], ft(0))), ft(0))  # masked keys: exp(-inf) = 0
    p_kept = p if keep is None else p * keep
    dv = _bh(mm(p_kept).transpose(0, 1, 3, 2) @ _bh(dom))
    dp = _bh(dom) @ _bh(vm).transpose(0, 1, 3, 2)
    if keep is not None:
        dp = dp * keep
    delta = (do * o).sum(axis=-1).transpose(0, 2, 1)[..., None]  # D_i = rowsum(dO * O), (B, H, Sq, 1)
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (ft(1) - t * t)  # through S = softcap * tanh(S / softcap)
    dsm = mm(ds)
    dq = _bh(dsm @ _bh(km)) * ft(scale)
    dk = _bh(dsm.transpose(0, 1, 3, 2) @ _bh(qm)) * ft(scale)
    grads = dq, sum_kv_groups(dk, heads_kv), sum_kv_groups(dv, heads_kv)
    return grads if bias is None else (*grads, reduce_broadcast(ds, bias.shape))


def _sequence_options(b, num_seqs, heads_q, rows_q, rows_k, alibi_slopes, dropout_mask, bias, mask,
                      key_padding_mask):
    """(the dense keyword arguments of sequence b, the index of its bias in the bias's 4-D form or None): its bias,
    mask and key padding corner (`_sequence_bias_mask`), its ALiBi slopes ((H,) shared, or row b of (B, H)) and its
    dropout keep mask (dropout_mask[b], (H_q, len_q, len_k), as cuflash.philox.dropout_mask_varlen gives them)."""
    kwargs, index = _sequence_bias_mask(b, num_seqs, heads_q, rows_q, rows_k, bias, mask, key_padding_mask)
    if alibi_slopes is not None:
        kwargs["alibi_slopes"] = alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b:b + 1]
    if dropout_mask is not None:
        kwargs["dropout_mask"] = dropout_mask[b][None]
    return kwargs, index


def attention_varlen_plain(q, k, v, cu_seqlens_q, cu_seqlens_k, precision: str, causal=False, softmax_scale=None, *,
                           window=None, alibi_slopes=None, softcap=None, dropout_mask=None, dropout_p=0.0, bias=None,
                           mask=None, key_padding_mask=None):
    """`attention_plain` of packed sequences q (total_q, H_q, D), k, v (total_k, H_kv, D), one sequence at a time
    (window and causal per sequence; dropout_mask a list of one (H_q, len_q, len_k) mask per sequence; bias, mask
    and key_padding_mask as in `attention_varlen_forward64`). Returns (o (total_q, H_q, D), lse (H_q, total_q))."""
    xp = array_module(q)
    ft = working_dtype(xp, precision)
    o = xp.zeros(q.shape, dtype=ft)
    lse = xp.full((q.shape[1], q.shape[0]), -np.inf, dtype=ft)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k)
    for b, (rq, rk) in enumerate(seqs):
        extra, _ = _sequence_options(b, len(seqs), q.shape[1], rq, rk, alibi_slopes, dropout_mask, bias, mask,
                                     key_padding_mask)
        o_b, lse_b = attention_plain(q[None, rq], k[None, rk], v[None, rk], precision, causal, softmax_scale,
                                     window=window, softcap=softcap, dropout_p=dropout_p, **extra)
        o[rq], lse[:, rq] = o_b[0], lse_b[0]
    return o, lse


def attention_varlen_backward_plain(do, q, k, v, cu_seqlens_q, cu_seqlens_k, precision: str, causal=False,
                                    softmax_scale=None, *, window=None, alibi_slopes=None, softcap=None,
                                    dropout_mask=None, dropout_p=0.0, bias=None, mask=None, key_padding_mask=None):
    """`attention_backward_plain` per sequence: (dq, dk, dv) packed like q, k, v, and dbias shaped like bias (the
    sequences' parts summed in the working precision) after them with a bias."""
    xp = array_module(q)
    ft = working_dtype(xp, precision)
    grads = [xp.zeros(x.shape, dtype=ft) for x in (q, k, v)]
    dbias = None if bias is None else xp.zeros((1,) * (4 - bias.ndim) + tuple(bias.shape), dtype=ft)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k)
    for b, (rq, rk) in enumerate(seqs):
        extra, index = _sequence_options(b, len(seqs), q.shape[1], rq, rk, alibi_slopes, dropout_mask, bias, mask,
                                         key_padding_mask)
        g = attention_backward_plain(do[None, rq], q[None, rq], k[None, rk], v[None, rk], precision, causal,
                                     softmax_scale, window=window, softcap=softcap, dropout_p=dropout_p, **extra)
        grads[0][rq], grads[1][rk], grads[2][rk] = g[0][0], g[1][0], g[2][0]
        if dbias is not None:
            dbias[index] += g[3][0]
    return tuple(grads) if bias is None else (*grads, dbias.reshape(bias.shape))
