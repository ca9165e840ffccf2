"""Slow, obviously correct attention in NumPy: the yardstick for the kernels and the analyzer.

All functions take NumPy arrays in the "bshd" layout, q (B, Sq, H_q, D), k and v (B, Sk, H_kv, D), and
follow the library's conventions:
  * grouped-query attention: H_q is a multiple of H_kv and query head h uses key/value head
    h // (H_q // H_kv) (`repeat_kv`); dk and dv sum the gradients of the query heads of a group
    (`sum_kv_groups`); H_kv == H_q is plain multi-head attention;
  * causal masks align to the bottom-right: query i sees key j iff j <= i + Sk - Sq;
  * a query row that sees no key outputs 0 and has lse = -inf, and contributes no gradient.

`attention_forward64` / `attention_backward64` compute in float64. `attention_lowp` /
`attention_backward_lowp` compute plain (unfused) attention rounding every intermediate to the input
dtype, the way a framework's fp16/bf16 attention does; the test pass rule compares the kernel's error
against theirs (DESIGN.md section 5).

Variable-length batches (`attention_varlen_*`): packed q (total_q, H_q, D), k and v (total_k, H_kv, D),
sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1, computed one sequence at a time with the dense
functions; lse is (H_q, total_q). KV cache (`attention_kvcache*`): the new keys are written into a copy of
the cache, then each sequence is dense attention over the first L_b = cache_seqlens[b] + S_new keys of its
cache (gathered through the block table when the cache is paged).
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


def repeat_kv(x, heads_q: int):
    """(B, S, H_kv, D) -> (B, S, H_q, D) with query head h reading head h // (H_q // H_kv) of x."""
    heads_kv = x.shape[2]
    if heads_kv == heads_q:
        return x
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}")
    return np.repeat(x, heads_q // heads_kv, axis=2)  # [kv0, kv0, .., kv1, kv1, ..]: index h holds kv h // group


def sum_kv_groups(dx, heads_kv: int):
    """Gradient of `repeat_kv`: (B, S, H_q, D) -> (B, S, H_kv, D), head g the sum over query heads
    g * group .. (g + 1) * group - 1."""
    b, s, heads_q, d = dx.shape
    if heads_q == heads_kv:
        return dx
    return dx.reshape(b, s, heads_kv, heads_q // heads_kv, d).sum(axis=3)


def _scores(q, k, scale):
    # S[b, h, i, j] = scale * sum_d q[b, i, h, d] k[b, j, h, d]
    return np.einsum("bihd,bjhd->bhij", q, k) * scale


def _scale(softmax_scale, head_dim):
    return 1.0 / np.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def attention_forward64(q, k, v, causal=False, softmax_scale=None):
    """float64 attention. Returns (o (B, Sq, H_q, D) float64, lse (B, H_q, Sq) float64)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
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
    """float64 gradients of attention_forward64's output. Returns (dq, dk, dv), each float64, shaped like
    q, k, v (dk, dv summed over the query heads of each group)."""
    do, q, k, v = (np.asarray(x, dtype=np.float64) for x in (do, q, k, v))
    heads_kv = k.shape[2]
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
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
    return dq, sum_kv_groups(dk, heads_kv), sum_kv_groups(dv, heads_kv)


def _round(x, dtype):
    return np.asarray(x, dtype=np.float32).astype(_LOWP[dtype]).astype(np.float32)


def attention_lowp(q, k, v, dtype, causal=False, softmax_scale=None):
    """Plain attention in `dtype` ("fp16"/"bf16"): fp32 accumulation, each intermediate rounded."""
    q, k, v = (_round(x, dtype) for x in (q, k, v))
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    sq, sk = q.shape[1], k.shape[1]
    s = _round(np.einsum("bihd,bjhd->bhij", q, k) * np.float32(_scale(softmax_scale, q.shape[-1])), dtype)
    if causal:
        s = np.where(causal_mask(sq, sk), s, -np.inf)
    p = _round(_softmax_lowp(s), dtype)
    return _round(np.einsum("bhij,bjhd->bihd", p, v), dtype)


def _softmax_lowp(s):
    """Row softmax of float32 scores (-inf where masked); a row that sees no key (or has no keys) gives 0."""
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.zeros(s.shape[:-1] + (1,), s.dtype)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return np.where(l > 0, p / np.where(l > 0, l, 1), 0)


def attention_backward_lowp(do, q, k, v, dtype, causal=False, softmax_scale=None):
    """Plain attention backward in `dtype`: each matmul output and P, dP, dS rounded to `dtype`. With fewer
    key/value heads, the per-query-head dk, dv (rounded) are summed over each group and rounded again, as a
    framework's backward through a head repeat does."""
    do, q, k, v = (_round(x, dtype) for x in (do, q, k, v))
    heads_kv = k.shape[2]
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    scale = np.float32(_scale(softmax_scale, q.shape[-1]))
    sq, sk = q.shape[1], k.shape[1]
    s = _round(np.einsum("bihd,bjhd->bhij", q, k) * scale, dtype)
    if causal:
        s = np.where(causal_mask(sq, sk), s, -np.inf)
    p = _round(_softmax_lowp(s), dtype)
    o = _round(np.einsum("bhij,bjhd->bihd", p, v), dtype)
    dv = _round(np.einsum("bhij,bihd->bjhd", p, do), dtype)
    dp = _round(np.einsum("bihd,bjhd->bhij", do, v), dtype)
    delta = np.einsum("bihd,bihd->bhi", do, o)[..., None]
    ds = _round(p * (dp - delta), dtype)
    dq = _round(np.einsum("bhij,bjhd->bihd", ds, k) * scale, dtype)
    dk = _round(np.einsum("bhij,bihd->bjhd", ds, q) * scale, dtype)
    if heads_kv != q.shape[2]:
        dk, dv = _round(sum_kv_groups(dk, heads_kv), dtype), _round(sum_kv_groups(dv, heads_kv), dtype)
    return dq, dk, dv


# --- variable-length (packed) batches: one sequence at a time, with the dense functions above ---------------

def sequences(cu_seqlens_q, cu_seqlens_k):
    """[(rows of q, rows of k)] as slices, one pair per sequence b: cu[b] .. cu[b + 1] - 1."""
    cu_q, cu_k = (np.asarray(c).astype(np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    return [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(len(cu_q) - 1)]


def attention_varlen_forward64(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None):
    """float64 attention of packed sequences: q (total_q, H_q, D), k, v (total_k, H_kv, D). Returns
    (o (total_q, H_q, D), lse (H_q, total_q)); causal is bottom-right aligned per sequence."""
    o = np.zeros(q.shape, dtype=np.float64)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for rq, rk in sequences(cu_seqlens_q, cu_seqlens_k):
        o_b, lse_b = attention_forward64(q[None, rq], k[None, rk], v[None, rk], causal, softmax_scale)
        o[rq], lse[:, rq] = o_b[0], lse_b[0]
    return o, lse


def attention_varlen_backward64(do, q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None):
    """float64 gradients of attention_varlen_forward64's output: (dq, dk, dv) packed like q, k, v."""
    grads = [np.zeros(x.shape, dtype=np.float64) for x in (q, k, v)]
    for rq, rk in sequences(cu_seqlens_q, cu_seqlens_k):
        g = attention_backward64(do[None, rq], q[None, rq], k[None, rk], v[None, rk], causal, softmax_scale)
        grads[0][rq], grads[1][rk], grads[2][rk] = g[0][0], g[1][0], g[2][0]
    return tuple(grads)


def attention_varlen_lowp(q, k, v, cu_seqlens_q, cu_seqlens_k, dtype, causal=False, softmax_scale=None):
    """`attention_lowp` one sequence at a time: o (total_q, H_q, D) float32 holding `dtype` values."""
    o = np.zeros(q.shape, dtype=np.float32)
    for rq, rk in sequences(cu_seqlens_q, cu_seqlens_k):
        o[rq] = attention_lowp(q[None, rq], k[None, rk], v[None, rk], dtype, causal, softmax_scale)[0]
    return o


def attention_varlen_backward_lowp(do, q, k, v, cu_seqlens_q, cu_seqlens_k, dtype, causal=False, softmax_scale=None):
    """`attention_backward_lowp` one sequence at a time: (dq, dk, dv) packed like q, k, v."""
    grads = [np.zeros(x.shape, dtype=np.float32) for x in (q, k, v)]
    for rq, rk in sequences(cu_seqlens_q, cu_seqlens_k):
        g = attention_backward_lowp(do[None, rq], q[None, rq], k[None, rk], v[None, rk], dtype, causal, softmax_scale)
        grads[0][rq], grads[1][rk], grads[2][rk] = g[0][0], g[1][0], g[2][0]
    return tuple(grads)


# --- KV cache: append into a copy of the cache, then dense attention over each sequence's valid prefix ------

def kvcache_seqlens(cache_seqlens, batch: int, capacity: int) -> np.ndarray:
    """cache_seqlens as an int64 (batch,) array: None -> capacity (full caches), an int -> that for all."""
    if cache_seqlens is None:
        return np.full(batch, capacity, dtype=np.int64)
    if np.ndim(cache_seqlens) == 0:
        return np.full(batch, int(cache_seqlens), dtype=np.int64)
    return np.asarray(cache_seqlens).astype(np.int64).reshape(batch)


def kvcache_slots(b: int, positions, cache_shape, block_table=None):
    """Index of logical key positions of sequence b in the cache array: (b, positions) for a dense cache
    (B, S_cache, H_kv, D); (block_table[b, p // page_size], p % page_size) for a paged cache
    (num_blocks, page_size, H_kv, D)."""
    positions = np.asarray(positions, dtype=np.int64)
    if block_table is None:
        return np.full(positions.shape, b), positions
    page_size = cache_shape[1]
    return np.asarray(block_table)[b, positions // page_size].astype(np.int64), positions % page_size


def kvcache_capacity(cache_shape, block_table=None) -> int:
    """Keys one sequence can hold: S_cache (dense) or max_blocks_per_seq * page_size (paged)."""
    return cache_shape[1] if block_table is None else np.asarray(block_table).shape[1] * cache_shape[1]


def kvcache_append(k_cache, v_cache, k, v, cache_seqlens, block_table=None):
    """Copies of the caches with the new keys/values k, v (B, S_new, H_kv, D) written at logical positions
    cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 of each sequence b; everything else unchanged. Works on
    any dtype (compare bit patterns by passing integer views)."""
    k_cache, v_cache = np.array(k_cache), np.array(v_cache)
    if k is None:
        return k_cache, v_cache
    batch, s_new = k.shape[:2]
    cached = kvcache_seqlens(cache_seqlens, batch, kvcache_capacity(k_cache.shape, block_table))
    for b in range(batch):
        slots = kvcache_slots(b, cached[b] + np.arange(s_new), k_cache.shape, block_table)
        k_cache[slots], v_cache[slots] = k[b], v[b]
    return k_cache, v_cache


def kvcache_prefix(cache, b: int, length: int, block_table=None):
    """The first `length` logical keys (or values) of sequence b: (length, H_kv, D)."""
    return cache[kvcache_slots(b, np.arange(length), cache.shape, block_table)]


def _kvcache_attention(attend, q, k_cache, v_cache, cache_seqlens, k, v, block_table):
    """Append, then attend(q_b (1, Sq, H_q, D), keys (1, L_b, H_kv, D), values) for each sequence b.
    Returns (per-sequence results, appended k_cache, appended v_cache)."""
    k_cache, v_cache = kvcache_append(k_cache, v_cache, k, v, cache_seqlens, block_table)
    batch = q.shape[0]
    lengths = kvcache_seqlens(cache_seqlens, batch, kvcache_capacity(k_cache.shape, block_table))
    lengths = lengths + (0 if k is None else k.shape[1])
    results = [attend(q[b:b + 1], kvcache_prefix(k_cache, b, lengths[b], block_table)[None],
                      kvcache_prefix(v_cache, b, lengths[b], block_table)[None]) for b in range(batch)]
    return results, k_cache, v_cache


def attention_kvcache64(q, k_cache, v_cache, cache_seqlens=None, k=None, v=None, block_table=None, causal=False,
                        softmax_scale=None):
    """float64 reference of attention_with_kvcache: q (B, Sq, H_q, D); caches dense (B, S_cache, H_kv, D) or
    paged (num_blocks, page_size, H_kv, D) with block_table (B, max_blocks); cache_seqlens None / int /
    (B,) array; optional new k, v (B, S_new, H_kv, D). Query i of sequence b attends keys [0, L_b),
    L_b = cache_seqlens[b] + S_new (causal: j <= i + L_b - Sq). Returns (o (B, Sq, H_q, D), lse (B, H_q, Sq),
    k_cache after the append, v_cache after the append); the arguments are not modified."""
    per_seq, k_cache, v_cache = _kvcache_attention(
        lambda qb, kb, vb: attention_forward64(qb, kb, vb, causal, softmax_scale), q, k_cache, v_cache,
        cache_seqlens, k, v, block_table)
    o = np.concatenate([r[0] for r in per_seq]) if per_seq else np.zeros(q.shape)
    lse = np.concatenate([r[1] for r in per_seq]) if per_seq else np.zeros((0, q.shape[2], q.shape[1]))
    return o, lse, k_cache, v_cache


def attention_kvcache_lowp(q, k_cache, v_cache, dtype, cache_seqlens=None, k=None, v=None, block_table=None,
                           causal=False, softmax_scale=None):
    """`attention_lowp` over each sequence's valid keys (after the append): o (B, Sq, H_q, D) float32."""
    per_seq, _, _ = _kvcache_attention(
        lambda qb, kb, vb: attention_lowp(qb, kb, vb, dtype, causal, softmax_scale), q, k_cache, v_cache,
        cache_seqlens, k, v, block_table)
    return np.concatenate(per_seq) if per_seq else np.zeros(q.shape, dtype=np.float32)
