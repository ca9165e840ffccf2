"""Slow, obviously correct attention in NumPy: the yardstick for the kernels and the analyzer.

All functions take NumPy arrays in the "bshd" layout, q (B, Sq, H_q, D), k and v (B, Sk, H_kv, D), and
follow the library's conventions:
  * grouped-query attention: H_q is a multiple of H_kv and query head h uses key/value head
    h // (H_q // H_kv) (`repeat_kv`); dk and dv sum the gradients of the query heads of a group
    (`sum_kv_groups`); H_kv == H_q is plain multi-head attention;
  * causal masks align to the bottom-right: query i sees key j iff j <= i + Sk - Sq;
  * a query row that sees no key outputs 0 and has lse = -inf, and contributes no gradient.

FlashAttention-2's score modifiers and an additive bias with boolean masks, keyword arguments of every attention
function (all off by default, and then the results are bit-identical to the plain functions). With
diag = Sk - Sq, query i and key j (0-based within the sequence), in this order:
  1. S = softmax_scale * q_i . k_j + bias[b, h, i, j] (bias: None = off; see below);
  2. softcap (float > 0; None or 0 = off): S = softcap * tanh(S / softcap);
  3. alibi_slopes (float, (H_q,) or (B, H_q); None = off): S += -slope[b, h] * |i + diag - j| (`alibi_bias`);
  4. masks: causal keeps j <= i + diag; window = (left, right), -1 = that side unbounded, keeps
     i + diag - left <= j <= i + diag + right (`window_mask`); mask keeps mask[b, h, i, j]; key_padding_mask
     keeps key_padding_mask[b, j]; several given: the intersection; masked S = -inf;
  5. P = softmax_j(S), lse = log sum_j exp S (of the scores before dropout);
  6. dropout: with a keep mask Z (bool (B, H_q, Sq, Sk), e.g. `cuflash.philox.dropout_mask`) and
     dropout_p in [0, 1), O = (P * Z / (1 - dropout_p)) V; lse is unchanged. dropout_p > 0 needs a mask.
Backward (slopes and masks are constants): dV = (P Z/(1-p))^T dO; dP = (dO V^T) Z/(1-p); dS = P (dP - D) with
D_i = rowsum(dO * O) (= rowsum(P dP), O the dropped output); through the soft-cap dS *= 1 - tanh^2(S / softcap)
(S the scaled, biased, uncapped score); dQ = scale dS K, dK = scale dS^T Q; dbias = dS summed over the
dimensions the bias is broadcast along (`reduce_broadcast`).

bias (float, ndim 2..4) and mask (bool, True = attend) are broadcast to (B, H_q, Sq, Sk) by `expand_broadcast`:
left-padded with size-1 dims to (Bb, Hb, Sqb, Skb), batch b reads bias batch b // (B // Bb) and head h reads
bias head h // (H_q // Hb) (Bb divides B, Hb divides H_q; 1 broadcasts), Sqb is 1 or Sq, Skb is 1 or Sk.
key_padding_mask is bool (B, Sk), False = key j ignored (mask[:, None, None, :]). A backward with a bias
returns (dq, dk, dv, dbias), dbias shaped like the bias.

`attention_forward64` / `attention_backward64` compute in float64. `attention_lowp` /
`attention_backward_lowp` compute plain (unfused) attention rounding every intermediate to the input
dtype, the way a framework's fp16/bf16 attention does; the test pass rule compares the kernel's error
against theirs (the pass rule of README.md, Tests).

Variable-length batches (`attention_varlen_*`): packed q (total_q, H_q, D), k and v (total_k, H_kv, D),
sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1, computed one sequence at a time with the dense
functions; lse is (H_q, total_q). The modifiers apply per sequence (diag = len_k[b] - len_q[b]); alibi_slopes
(num_seqs, H_q) gives sequence b row b; the dropout mask is a list with one bool (H_q, len_q[b], len_k[b])
array per sequence b (`cuflash.philox.dropout_mask_varlen`). bias and mask have the dense shapes with
B = num_seqs and Sq, Sk = max_seqlen_q, max_seqlen_k (taken from their own dims, which are 1 or the max):
sequence b reads [b', h', :len_q[b], :len_k[b]] (b', h' as above); key_padding_mask (num_seqs, max_seqlen_k)
gives sequence b row b's first len_k[b] entries.

KV cache (`attention_kvcache*`, `kvcache_append`: FlashAttention-2's flash_attn_with_kvcache): q (B, Sq, H_q, D),
caches dense (B_cache, S_cache, H_kv, D) or paged (num_blocks, page_size, H_kv, D) with block_table
(B, max_blocks), capacity S_cache or max_blocks * page_size; new keys and values k, v (B, S_new, H_kv, D) or none.
  * cache_seqlens[b] (None = capacity, an int, or (B,)) is the absolute cache row where sequence b's new keys go:
    new key s at row cache_seqlens[b] + s (row p of a paged cache: block block_table[b, p // page_size], row
    p % page_size);
  * cache_batch_idx (int (B,), dense caches only): batch entry b reads and writes cache batch row
    cache_batch_idx[b] (distinct values with new keys); everything else stays indexed by b;
  * cache_leftpad (int (B,), 0 <= cache_leftpad[b] <= cache_seqlens[b]): sequence b's keys are cache rows
    [cache_leftpad[b], cache_seqlens[b] + S_new), L_b of them, key j at row cache_leftpad[b] + j; causal, window
    and ALiBi use j (diag = L_b - Sq);
  * rotary_cos, rotary_sin ((seqlen_ro, rotary_dim / 2), need k and v; `apply_rotary`): the first rotary_dim dims
    of q and of the new keys (never v, never keys already cached) are rotated, new key s of sequence b at position
    cache_seqlens[b] + s, query i at cache_seqlens[b] + i when causal or a window is given, else at
    cache_seqlens[b] (`kvcache_rotary_positions`); rotary_interleaved pairs dims (2f, 2f + 1), else (f, f +
    rotary_dim / 2). The low-precision references rotate in float32 and round once to the dtype, as the kernel does;
  * window, alibi_slopes ((H_q,) or (B, H_q)) and softcap as above, per sequence with its own L_b.
In order: rotate q and the new keys, write the keys and values into a copy of the caches, then each sequence is
dense attention of its (rotated) queries over its keys, gathered from its cache row or through the block table.
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


def window_mask(seqlen_q: int, seqlen_k: int, left: int, right: int, causal: bool = False) -> np.ndarray:
    """Boolean (Sq, Sk): True where query i may attend key j under the sliding window (left, right), aligned to
    the bottom-right like causal: i + diag - left <= j <= i + diag + right, diag = Sk - Sq; -1 leaves that side
    unbounded. causal=True also requires j <= i + diag (the intersection)."""
    left, right = _check_window((left, right))
    i_aligned = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)  # the key column on query i's diagonal
    j = np.arange(seqlen_k)[None, :]
    visible = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        visible &= j >= i_aligned - left
    if right >= 0:
        visible &= j <= i_aligned + right
    if causal:
        visible &= j <= i_aligned
    return visible


def alibi_bias(alibi_slopes, batch: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """float64 (B, H, Sq, Sk): -slope[b, h] * |i + diag - j|, diag = Sk - Sq, for slopes (H,) (shared by the
    batch) or (B, H)."""
    slopes = np.asarray(alibi_slopes, dtype=np.float64)
    slopes = np.broadcast_to(slopes, (batch, slopes.shape[-1]))
    distance = np.abs(np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q) - np.arange(seqlen_k)[None, :])
    return -slopes[:, :, None, None] * distance


def broadcast_shape4(shape, batch: int, heads: int, seqlen_q: int, seqlen_k: int, name: str = "x") -> tuple:
    """(Bb, Hb, Sqb, Skb): `shape` (ndim 2..4) left-padded with 1s, checked against the broadcast rule of bias and
    mask for scores (B, H, Sq, Sk): Bb divides B, Hb divides H, Sqb is 1 or Sq, Skb is 1 or Sk."""
    shape = tuple(int(n) for n in shape)
    full = (batch, heads, seqlen_q, seqlen_k)
    if not 2 <= len(shape) <= 4:
        raise ValueError(f"{name} has shape {shape}; expected 2 to 4 dims broadcasting to (B, H, Sq, Sk) = {full}")
    shape4 = (1,) * (4 - len(shape)) + shape
    for dim, n, size in zip(("batch", "heads"), shape4[:2], full[:2]):
        if n != size and (n < 1 or size % n):
            raise ValueError(f"{name} has shape {shape}: its {dim} dim {n} does not divide {size}; expected a "
                             f"divisor of {size} (1 broadcasts)")
    for dim, n, size in zip(("seqlen_q", "seqlen_k"), shape4[2:], full[2:]):
        if n not in (1, size):
            raise ValueError(f"{name} has shape {shape}: its {dim} dim is {n}; expected 1 or {size}")
    return shape4


def expand_broadcast(x, batch: int, heads: int, seqlen_q: int, seqlen_k: int, *, name: str = "x"):
    """x (a bias or mask, ndim 2..4) as a read-only (B, H, Sq, Sk) view of x's dtype: x left-padded with size-1 dims
    to (Bb, Hb, Sqb, Skb) (`broadcast_shape4`), element [b, h, i, j] is x[b // (B // Bb), h // (H // Hb),
    i if Sqb > 1 else 0, j if Skb > 1 else 0]."""
    x = np.asarray(x)
    bb, hb, sqb, skb = broadcast_shape4(x.shape, batch, heads, seqlen_q, seqlen_k, name)
    x = x.reshape(bb, hb, sqb, skb)
    if bb != batch:
        x = np.repeat(x, batch // bb, axis=0)  # [x0, x0, .., x1, x1, ..]: index b holds x b // (B // Bb)
    if hb != heads:
        x = np.repeat(x, heads // hb, axis=1)
    return np.broadcast_to(x, (batch, heads, seqlen_q, seqlen_k))


def reduce_broadcast(full, shape):
    """The adjoint of `expand_broadcast`: full (B, H, Sq, Sk) summed into `shape` (ndim 2..4), each element the
    sum of the elements of `full` that `expand_broadcast` fills from it (the gradient of a broadcast bias)."""
    full = np.asarray(full)
    batch, heads, sq, sk = full.shape
    bb, hb, sqb, skb = broadcast_shape4(shape, batch, heads, sq, sk, "shape")
    out = full.reshape(bb, batch // bb if bb else 0, hb, heads // hb if hb else 0, sq, sk).sum(axis=(1, 3))
    if sqb != sq:
        out = out.sum(axis=2, keepdims=True)
    if skb != sk:
        out = out.sum(axis=3, keepdims=True)
    return out.reshape(shape)


def _check_window(window):
    """(left, right) as ints >= -1, or None for no window (None and (-1, -1) are the same)."""
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window={window!r} is not allowed; expected (left, right), ints >= -1 "
                         "(-1: unbounded)") from None
    for side, n in (("left", left), ("right", right)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"window {side}={n!r} has type {type(n).__name__}; expected an int >= -1")
        if n < -1:
            raise ValueError(f"window {side}={n} is not allowed; expected an int >= -1 (-1: unbounded)")
    return int(left), int(right)


def _check_softcap(softcap):
    """softcap as a float > 0, or None for no soft-cap (None and 0 are the same)."""
    if softcap is not None and not softcap >= 0:
        raise ValueError(f"softcap={softcap!r} is not allowed; expected a float > 0 (0 or None: off)")
    return float(softcap) if softcap else None


def _visible(seqlen_q, seqlen_k, causal, window):
    """Boolean (Sq, Sk) mask of the visible keys, or None when every key is visible."""
    window = _check_window(window)
    if window is None or window == (-1, -1):
        return causal_mask(seqlen_q, seqlen_k) if causal else None
    return window_mask(seqlen_q, seqlen_k, *window, causal=causal)


def _modifiers(shape_bhqk, window, alibi_slopes, softcap, dropout_mask, dropout_p):
    """Validated modifiers of a dense problem with scores of shape (B, H_q, Sq, Sk): (window, slopes or None,
    softcap or None, keep = Z / (1 - dropout_p) as float64 or None)."""
    batch, heads = shape_bhqk[:2]
    window = _check_window(window)
    if alibi_slopes is not None:
        alibi_slopes = np.asarray(alibi_slopes)
        if alibi_slopes.shape not in ((heads,), (batch, heads)):
            raise ValueError(f"alibi_slopes has shape {alibi_slopes.shape}; expected ({heads},) or ({batch}, {heads})")
        if not np.issubdtype(alibi_slopes.dtype, np.floating):
            raise TypeError(f"alibi_slopes has dtype {alibi_slopes.dtype}; expected a float array")
    softcap = _check_softcap(softcap)
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} is not allowed; expected 0 <= dropout_p < 1")
    keep = None
    if dropout_mask is not None:
        dropout_mask = np.asarray(dropout_mask)
        if dropout_mask.dtype != np.bool_:
            raise TypeError(f"dropout_mask has dtype {dropout_mask.dtype}; expected bool (True = kept)")
        if dropout_mask.shape != tuple(shape_bhqk):
            raise ValueError(f"dropout_mask has shape {dropout_mask.shape}; expected {tuple(shape_bhqk)}")
        keep = dropout_mask / (1.0 - dropout_p)  # Z / (1 - p) in float64
    elif dropout_p > 0:
        raise ValueError(f"dropout_p={dropout_p} needs dropout_mask (bool {tuple(shape_bhqk)}, e.g. "
                         "cuflash.philox.dropout_mask)")
    return window, alibi_slopes, softcap, keep


def _bias_mask(shape_bhqk, bias, mask, key_padding_mask):
    """Validated bias and masks of a dense problem with scores (B, H_q, Sq, Sk): (the bias as a float64
    (B, H_q, Sq, Sk) array or None, attend: bool (B, H_q, Sq, Sk), True where both mask and key_padding_mask let
    the key through, or None)."""
    if bias is not None:
        bias = np.asarray(bias)
        if bias.dtype.kind != "f" and bias.dtype not in _LOWP.values():
            raise TypeError(f"bias has dtype {bias.dtype}; expected a float array (float16, bfloat16 or float32)")
        bias = expand_broadcast(bias, *shape_bhqk, name="bias").astype(np.float64)
    attend = None
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask has dtype {mask.dtype}; expected bool (True = attend)")
        attend = expand_broadcast(mask, *shape_bhqk, name="mask")
    if key_padding_mask is not None:
        key_padding_mask = np.asarray(key_padding_mask)
        if key_padding_mask.dtype != np.bool_:
            raise TypeError(f"key_padding_mask has dtype {key_padding_mask.dtype}; expected bool (False = ignored)")
        batch, seqlen_k = shape_bhqk[0], shape_bhqk[3]
        if key_padding_mask.shape != (batch, seqlen_k):
            raise ValueError(f"key_padding_mask has shape {key_padding_mask.shape}; expected ({batch}, {seqlen_k})")
        padding = key_padding_mask[:, None, None, :]
        attend = padding if attend is None else attend & padding
    if attend is not None:
        attend = np.broadcast_to(attend, tuple(shape_bhqk))
    return bias, attend


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


def _logits64(q, k, scale, causal, window, alibi_slopes, softcap, bias=None, attend=None):
    """The scores in float64, modifiers applied: (S (B, H_q, Sq, Sk) with -inf where masked, tanh(S / softcap)
    of the biased, uncapped S, or None without a soft-cap). k already has H_q heads; bias and attend are the
    (B, H_q, Sq, Sk) arrays of `_bias_mask`."""
    s = _scores(q, k, scale)
    if bias is not None:
        s = s + bias  # S += bias, before the soft-cap
    t = None
    if softcap:
        t = np.tanh(s / softcap)  # S = softcap * tanh(S / softcap)
        s = softcap * t
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, q.shape[0], q.shape[1], k.shape[1])  # S += -slope * |i + diag - j|
    visible = _visible(q.shape[1], k.shape[1], causal, window)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    if attend is not None:
        s = np.where(attend, s, -np.inf)
    return s, t


def attention_forward64(q, k, v, causal=False, softmax_scale=None, *, window=None, alibi_slopes=None,
                        softcap=None, dropout_mask=None, dropout_p=0.0, bias=None, mask=None, key_padding_mask=None):
    """float64 attention, with the modifiers, bias and masks of the module docstring. Returns (o (B, Sq, H_q, D)
    float64, lse (B, H_q, Sq) float64); lse is of the scores before dropout."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    sq, sk = q.shape[1], k.shape[1]
    window, alibi_slopes, softcap, keep = _modifiers((q.shape[0], q.shape[2], sq, sk), window, alibi_slopes, softcap,
                                                     dropout_mask, dropout_p)
    bias, attend = _bias_mask((q.shape[0], q.shape[2], sq, sk), bias, mask, key_padding_mask)
    s, _ = _logits64(q, k, _scale(softmax_scale, q.shape[-1]), causal, window, alibi_slopes, softcap, bias, attend)
    m = s.max(axis=-1, keepdims=True) if sk else np.full(s.shape[:-1] + (1,), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)  # fully masked row: exp(-inf - 0) = 0, not NaN
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0)
        lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(l[..., 0]), -np.inf)
    if keep is not None:
        p = p * keep  # dropout: P Z / (1 - p), after lse
    o = np.einsum("bhij,bjhd->bihd", p, v)
    return o, lse


def attention_fp8_emulated64(q, k, v, causal=False, softmax_scale=None, *, window=None):
    """The FP8 forward's own rounding, emulated in float64 on real-valued (dequantized) q, k, v of shape (B, S, H,
    D): P = exp(S - m) * 256 rounded to e4m3 (the kernel scales P by 2^8 to use e4m3's range), O = P V / sum(P) with
    the row sum of the unrounded P. m is the row's maximum here; the kernel uses its running maximum, so the two
    differ by where P's rounding falls, not by how large it is. Returns O (B, Sq, H_q, D) float64."""
    import ml_dtypes

    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    s, _ = _logits64(q, k, _scale(softmax_scale, q.shape[-1]), causal, window, None, None)
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0)) * 256.0
    l = p.sum(axis=-1, keepdims=True)
    p8 = p.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.einsum("bhij,bjhd->bihd", p8, v) / np.transpose(np.where(l > 0, l, 1.0), (0, 2, 1, 3))


def attention_backward64(do, q, k, v, causal=False, softmax_scale=None, *, window=None, alibi_slopes=None,
                         softcap=None, dropout_mask=None, dropout_p=0.0, bias=None, mask=None, key_padding_mask=None):
    """float64 gradients of attention_forward64's output (same modifiers; the slopes and masks are not
    differentiated). Returns (dq, dk, dv), each float64, shaped like q, k, v (dk, dv summed over the query heads
    of each group); with a bias (dq, dk, dv, dbias), dbias float64 shaped like bias (dS summed over its
    broadcast dims)."""
    do, q, k, v = (np.asarray(x, dtype=np.float64) for x in (do, q, k, v))
    heads_kv = k.shape[2]
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    scale = _scale(softmax_scale, q.shape[-1])
    mods = dict(window=window, alibi_slopes=alibi_slopes, softcap=softcap, dropout_mask=dropout_mask,
                dropout_p=dropout_p)
    o, lse = attention_forward64(q, k, v, causal, scale, **mods, bias=bias, mask=mask,
                                 key_padding_mask=key_padding_mask)  # o: the dropped output
    shape_bhqk = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    window, alibi_slopes, softcap, keep = _modifiers(shape_bhqk, **mods)
    bias_full, attend = _bias_mask(shape_bhqk, bias, mask, key_padding_mask)
    s, t = _logits64(q, k, scale, causal, window, alibi_slopes, softcap, bias_full, attend)
    lse_safe = np.where(np.isfinite(lse), lse, 0.0)[..., None]
    p = np.exp(s - lse_safe)  # masked keys: exp(-inf) = 0
    p = np.where(np.isfinite(lse)[..., None], p, 0.0)
    dv = np.einsum("bhij,bihd->bjhd", p if keep is None else p * keep, do)  # dV = (P Z / (1 - p))^T dO
    dp = np.einsum("bihd,bjhd->bhij", do, v)
    if keep is not None:
        dp = dp * keep  # dP = (dO V^T) Z / (1 - p)
    delta = np.einsum("bihd,bihd->bhi", do, o)[..., None]  # D_i = rowsum(dO * O)
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)  # through S = softcap * tanh(S / softcap)
    dq = np.einsum("bhij,bjhd->bihd", ds, k) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    grads = dq, sum_kv_groups(dk, heads_kv), sum_kv_groups(dv, heads_kv)
    return grads if bias is None else (*grads, reduce_broadcast(ds, np.shape(bias)))  # dbias = dS, reduced


def _round(x, dtype):
    return np.asarray(x, dtype=np.float32).astype(_LOWP[dtype]).astype(np.float32)


def _logits_lowp(q, k, dtype, scale, causal, window, alibi_slopes, softcap, bias=None, attend=None):
    """The scores as a framework computes them in `dtype`: (S float32 holding `dtype` values, -inf where masked;
    the rounded tanh(S / softcap), or None). The bias (its float32 values) is added to the rounded scores and
    the sum rounded, before the soft-cap; the soft-cap is three rounded steps (divide, tanh, multiply); the
    ALiBi bias is made in float32 and added to the rounded scores, the sum rounded."""
    s = _round(np.einsum("bihd,bjhd->bhij", q, k) * np.float32(scale), dtype)
    if bias is not None:
        s = _round(s + bias.astype(np.float32), dtype)
    t = None
    if softcap:
        t = _round(np.tanh(_round(s / np.float32(softcap), dtype)), dtype)
        s = _round(t * np.float32(softcap), dtype)
    if alibi_slopes is not None:
        bias = alibi_bias(alibi_slopes, q.shape[0], q.shape[1], k.shape[1]).astype(np.float32)
        s = _round(s + bias, dtype)
    visible = _visible(q.shape[1], k.shape[1], causal, window)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    if attend is not None:
        s = np.where(attend, s, -np.inf)
    return s, t


def attention_lowp(q, k, v, dtype, causal=False, softmax_scale=None, *, window=None, alibi_slopes=None,
                   softcap=None, dropout_mask=None, dropout_p=0.0, bias=None, mask=None, key_padding_mask=None):
    """Plain attention in `dtype` ("fp16"/"bf16"): fp32 accumulation, each intermediate rounded; dropout
    multiplies the rounded P by Z / (1 - p) (the factor in float32) and rounds."""
    q, k, v = (_round(x, dtype) for x in (q, k, v))
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    shape_bhqk = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    window, alibi_slopes, softcap, keep = _modifiers(shape_bhqk, window, alibi_slopes, softcap, dropout_mask,
                                                     dropout_p)
    bias, attend = _bias_mask(shape_bhqk, bias, mask, key_padding_mask)
    s, _ = _logits_lowp(q, k, dtype, _scale(softmax_scale, q.shape[-1]), causal, window, alibi_slopes, softcap, bias,
                        attend)
    p = _round(_softmax_lowp(s), dtype)
    if keep is not None:
        p = _round(p * keep.astype(np.float32), dtype)
    return _round(np.einsum("bhij,bjhd->bihd", p, v), dtype)


def _softmax_lowp(s):
    """Row softmax of float32 scores (-inf where masked); a row that sees no key (or has no keys) gives 0."""
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.zeros(s.shape[:-1] + (1,), s.dtype)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return np.where(l > 0, p / np.where(l > 0, l, 1), 0)


def attention_backward_lowp(do, q, k, v, dtype, causal=False, softmax_scale=None, *, window=None,
                            alibi_slopes=None, softcap=None, dropout_mask=None, dropout_p=0.0, bias=None, mask=None,
                            key_padding_mask=None):
    """Plain attention backward in `dtype`: each matmul output and P, dP, dS rounded to `dtype`; dropout scales
    P and dP by Z / (1 - p) (rounded after); the soft-cap's dS * (1 - t^2) (t the rounded tanh) is rounded.
    With fewer key/value heads, the per-query-head dk, dv (rounded) are summed over each group and rounded
    again, as a framework's backward through a head repeat does. With a bias, also dbias: the rounded dS summed
    over the bias's broadcast dims in float64, returned as float32 shaped like bias."""
    do, q, k, v = (_round(x, dtype) for x in (do, q, k, v))
    heads_kv = k.shape[2]
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    scale = np.float32(_scale(softmax_scale, q.shape[-1]))
    shape_bhqk = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    window, alibi_slopes, softcap, keep = _modifiers(shape_bhqk, window, alibi_slopes, softcap, dropout_mask,
                                                     dropout_p)
    bias_full, attend = _bias_mask(shape_bhqk, bias, mask, key_padding_mask)
    s, t = _logits_lowp(q, k, dtype, scale, causal, window, alibi_slopes, softcap, bias_full, attend)
    p = _round(_softmax_lowp(s), dtype)
    keep = None if keep is None else keep.astype(np.float32)
    p_kept = p if keep is None else _round(p * keep, dtype)
    o = _round(np.einsum("bhij,bjhd->bihd", p_kept, v), dtype)
    dv = _round(np.einsum("bhij,bihd->bjhd", p_kept, do), dtype)
    dp = _round(np.einsum("bihd,bjhd->bhij", do, v), dtype)
    if keep is not None:
        dp = _round(dp * keep, dtype)
    delta = np.einsum("bihd,bihd->bhi", do, o)[..., None]
    ds = _round(p * (dp - delta), dtype)
    if t is not None:
        ds = _round(ds * (1 - t * t), dtype)
    dq = _round(np.einsum("bhij,bjhd->bihd", ds, k) * scale, dtype)
    dk = _round(np.einsum("bhij,bihd->bjhd", ds, q) * scale, dtype)
    if heads_kv != q.shape[2]:
        dk, dv = _round(sum_kv_groups(dk, heads_kv), dtype), _round(sum_kv_groups(dv, heads_kv), dtype)
    if bias is None:
        return dq, dk, dv
    return dq, dk, dv, reduce_broadcast(ds.astype(np.float64), np.shape(bias)).astype(np.float32)


# --- variable-length (packed) batches: one sequence at a time, with the dense functions above ---------------

def sequences(cu_seqlens_q, cu_seqlens_k):
    """[(rows of q, rows of k)] as slices, one pair per sequence b: cu[b] .. cu[b + 1] - 1."""
    cu_q, cu_k = (np.asarray(c).astype(np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    return [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(len(cu_q) - 1)]


def _sequence_modifiers(b, num_seqs, heads_q, window, alibi_slopes, softcap, dropout_mask, dropout_p):
    """The keyword arguments of the dense call for sequence b of a packed batch: slopes (H_q,) or row b of
    (num_seqs, H_q); dropout mask dropout_mask[b][None] (one (H_q, len_q, len_k) array per sequence)."""
    if alibi_slopes is not None:
        alibi_slopes = np.asarray(alibi_slopes)
        if alibi_slopes.shape not in ((heads_q,), (num_seqs, heads_q)):
            raise ValueError(f"alibi_slopes has shape {alibi_slopes.shape}; expected ({heads_q},) or "
                             f"({num_seqs}, {heads_q}) for {num_seqs} sequences")
        alibi_slopes = alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b]
    if dropout_mask is not None:
        if len(dropout_mask) != num_seqs:
            raise ValueError(f"dropout_mask holds {len(dropout_mask)} masks for {num_seqs} sequences; expected one "
                             "bool (H_q, len_q, len_k) array per sequence")
        dropout_mask = np.asarray(dropout_mask[b])[None]
    return dict(window=window, alibi_slopes=alibi_slopes, softcap=softcap, dropout_mask=dropout_mask,
                dropout_p=dropout_p)


def varlen_bias_index(shape, b: int, num_seqs: int, heads_q: int, len_q: int, len_k: int, name: str = "bias"):
    """(4-D shape, index) of sequence b's part of a varlen bias or mask of `shape` (ndim 2..4, the dense broadcast
    rule with B = num_seqs and Sq, Sk = max_seqlen_q, max_seqlen_k, read from its own dims, which are 1 or the
    max): x.reshape(shape4)[index] is x[b', :, :len_q, :len_k], b' = b // (num_seqs // Bb), a size-1 dim whole."""
    shape = tuple(shape)
    dims = shape[-2:] if len(shape) >= 2 else (0, 0)
    shape4 = broadcast_shape4(shape, num_seqs, heads_q, *dims, name)
    sqb, skb = shape4[2:]
    if (sqb != 1 and sqb < len_q) or (skb != 1 and skb < len_k):
        raise ValueError(f"{name} has shape {shape}: sequence {b} has {len_q} queries and {len_k} keys; expected "
                         "its seqlen dims 1 or max_seqlen_q, max_seqlen_k")
    index = (b // (num_seqs // shape4[0]), slice(None), slice(None) if sqb == 1 else slice(0, len_q),
             slice(None) if skb == 1 else slice(0, len_k))
    return shape4, index


def _sequence_part(x, b, num_seqs, heads_q, len_q, len_k, name):
    """(x[b', :, :len_q, :len_k] as a (1, Hb, len_q or 1, len_k or 1) array for the dense call, its index in x's
    4-D form) (`varlen_bias_index`)."""
    x = np.asarray(x)
    shape4, index = varlen_bias_index(x.shape, b, num_seqs, heads_q, len_q, len_k, name)
    return x.reshape(shape4)[index][None], index


def _sequence_bias_mask(b, num_seqs, heads_q, rows_q, rows_k, bias, mask, key_padding_mask):
    """(bias / mask keyword arguments of the dense call for sequence b, the index of its bias in the bias's 4-D
    form or None); key_padding_mask (num_seqs, max_seqlen_k) gives row b's first len_k entries."""
    len_q, len_k = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
    kwargs, index = {}, None
    if bias is not None:
        kwargs["bias"], index = _sequence_part(bias, b, num_seqs, heads_q, len_q, len_k, "bias")
    if mask is not None:
        kwargs["mask"] = _sequence_part(mask, b, num_seqs, heads_q, len_q, len_k, "mask")[0]
    if key_padding_mask is not None:
        key_padding_mask = np.asarray(key_padding_mask)
        if key_padding_mask.ndim != 2 or key_padding_mask.shape[0] != num_seqs or key_padding_mask.shape[1] < len_k:
            raise ValueError(f"key_padding_mask has shape {key_padding_mask.shape}; expected ({num_seqs}, "
                             f"max_seqlen_k) with max_seqlen_k >= {len_k} (sequence {b})")
        kwargs["key_padding_mask"] = key_padding_mask[b:b + 1, :len_k]
    return kwargs, index


def _bias4(bias):
    """A zero float64 accumulator of bias's 4-D form (Bb, Hb, Sqb, Skb) (for a varlen dbias), or None."""
    return None if bias is None else np.zeros((1,) * (4 - np.ndim(bias)) + np.shape(bias), dtype=np.float64)


def attention_varlen_forward64(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None, *, window=None,
                               alibi_slopes=None, softcap=None, dropout_mask=None, dropout_p=0.0, bias=None, mask=None,
                               key_padding_mask=None):
    """float64 attention of packed sequences: q (total_q, H_q, D), k, v (total_k, H_kv, D). Returns
    (o (total_q, H_q, D), lse (H_q, total_q)); causal, window and ALiBi are bottom-right aligned per sequence;
    dropout_mask: one bool (H_q, len_q[b], len_k[b]) array per sequence b; bias, mask, key_padding_mask as in the
    module docstring."""
    o = np.zeros(q.shape, dtype=np.float64)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k)
    for b, (rq, rk) in enumerate(seqs):
        mods = _sequence_modifiers(b, len(seqs), q.shape[1], window, alibi_slopes, softcap, dropout_mask, dropout_p)
        extra, _ = _sequence_bias_mask(b, len(seqs), q.shape[1], rq, rk, bias, mask, key_padding_mask)
        o_b, lse_b = attention_forward64(q[None, rq], k[None, rk], v[None, rk], causal, softmax_scale, **mods,
                                         **extra)
        o[rq], lse[:, rq] = o_b[0], lse_b[0]
    return o, lse


def attention_varlen_backward64(do, q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None, *,
                                window=None, alibi_slopes=None, softcap=None, dropout_mask=None, dropout_p=0.0,
                                bias=None, mask=None, key_padding_mask=None):
    """float64 gradients of attention_varlen_forward64's output: (dq, dk, dv) packed like q, k, v; with a bias
    (dq, dk, dv, dbias), dbias float64 shaped like bias (zero where no sequence reads it)."""
    grads = [np.zeros(x.shape, dtype=np.float64) for x in (q, k, v)]
    dbias = _bias4(bias)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k)
    for b, (rq, rk) in enumerate(seqs):
        mods = _sequence_modifiers(b, len(seqs), q.shape[1], window, alibi_slopes, softcap, dropout_mask, dropout_p)
        extra, index = _sequence_bias_mask(b, len(seqs), q.shape[1], rq, rk, bias, mask, key_padding_mask)
        g = attention_backward64(do[None, rq], q[None, rq], k[None, rk], v[None, rk], causal, softmax_scale, **mods,
                                 **extra)
        grads[0][rq], grads[1][rk], grads[2][rk] = g[0][0], g[1][0], g[2][0]
        if dbias is not None:
            dbias[index] += g[3][0]
    return tuple(grads) if bias is None else (*grads, dbias.reshape(np.shape(bias)))


def attention_varlen_lowp(q, k, v, cu_seqlens_q, cu_seqlens_k, dtype, causal=False, softmax_scale=None, *,
                          window=None, alibi_slopes=None, softcap=None, dropout_mask=None, dropout_p=0.0, bias=None,
                          mask=None, key_padding_mask=None):
    """`attention_lowp` one sequence at a time: o (total_q, H_q, D) float32 holding `dtype` values."""
    o = np.zeros(q.shape, dtype=np.float32)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k)
    for b, (rq, rk) in enumerate(seqs):
        mods = _sequence_modifiers(b, len(seqs), q.shape[1], window, alibi_slopes, softcap, dropout_mask, dropout_p)
        extra, _ = _sequence_bias_mask(b, len(seqs), q.shape[1], rq, rk, bias, mask, key_padding_mask)
        o[rq] = attention_lowp(q[None, rq], k[None, rk], v[None, rk], dtype, causal, softmax_scale, **mods,
                               **extra)[0]
    return o


def attention_varlen_backward_lowp(do, q, k, v, cu_seqlens_q, cu_seqlens_k, dtype, causal=False, softmax_scale=None,
                                   *, window=None, alibi_slopes=None, softcap=None, dropout_mask=None, dropout_p=0.0,
                                   bias=None, mask=None, key_padding_mask=None):
    """`attention_backward_lowp` one sequence at a time: (dq, dk, dv) packed like q, k, v; with a bias also dbias,
    float32 shaped like bias (the sequences' float32 dbias summed in float64)."""
    grads = [np.zeros(x.shape, dtype=np.float32) for x in (q, k, v)]
    dbias = _bias4(bias)
    seqs = sequences(cu_seqlens_q, cu_seqlens_k)
    for b, (rq, rk) in enumerate(seqs):
        mods = _sequence_modifiers(b, len(seqs), q.shape[1], window, alibi_slopes, softcap, dropout_mask, dropout_p)
        extra, index = _sequence_bias_mask(b, len(seqs), q.shape[1], rq, rk, bias, mask, key_padding_mask)
        g = attention_backward_lowp(do[None, rq], q[None, rq], k[None, rk], v[None, rk], dtype, causal, softmax_scale,
                                    **mods, **extra)
        grads[0][rq], grads[1][rk], grads[2][rk] = g[0][0], g[1][0], g[2][0]
        if dbias is not None:
            dbias[index] += g[3][0]
    return tuple(grads) if bias is None else (*grads, dbias.reshape(np.shape(bias)).astype(np.float32))


# --- KV cache: rotate, append into a copy of the cache, then dense attention over each sequence's keys --------

def kvcache_seqlens(cache_seqlens, batch: int, capacity: int) -> np.ndarray:
    """cache_seqlens as an int64 (batch,) array: None -> capacity (full caches), an int -> that for all."""
    if cache_seqlens is None:
        return np.full(batch, capacity, dtype=np.int64)
    if np.ndim(cache_seqlens) == 0:
        return np.full(batch, int(cache_seqlens), dtype=np.int64)
    return np.asarray(cache_seqlens).astype(np.int64).reshape(batch)


def kvcache_capacity(cache_shape, block_table=None) -> int:
    """Keys one sequence can hold: S_cache (dense) or max_blocks_per_seq * page_size (paged)."""
    return cache_shape[1] if block_table is None else np.asarray(block_table).shape[1] * cache_shape[1]


def _index_array(x, name: str, batch: int) -> np.ndarray:
    """An int (batch,) argument (cache_batch_idx, cache_leftpad) as an int64 NumPy array."""
    x = np.asarray(x)
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name} has dtype {x.dtype}; expected an int array (batch,)")
    if x.shape != (batch,):
        raise ValueError(f"{name} has shape {x.shape}; expected (batch,) = ({batch},)")
    return x.astype(np.int64)


def kvcache_rows(cache_batch_idx, batch: int, cache_shape, block_table=None, new_keys: bool = False) -> np.ndarray:
    """The cache row (batch index of a dense cache) of each batch entry b as int64 (batch,): b itself, or
    cache_batch_idx[b]. cache_batch_idx needs a dense cache, values in [0, cache_shape[0]), and distinct values when
    new keys are written (two sequences would write one cache row)."""
    if cache_batch_idx is None:
        return np.arange(batch, dtype=np.int64)
    if block_table is not None:
        raise ValueError("cache_batch_idx picks rows of a dense cache (B_cache, S_cache, H_kv, D); with block_table "
                         "the table picks each sequence's blocks: pass cache_batch_idx or block_table, not both")
    rows = _index_array(cache_batch_idx, "cache_batch_idx", batch)
    bad = np.flatnonzero((rows < 0) | (rows >= cache_shape[0]))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"cache_batch_idx[{b}]={rows[b]} is out of range: allowed 0 <= cache_batch_idx < "
                         f"{cache_shape[0]} (k_cache.shape[0])")
    if new_keys:
        first = {}
        for b, row in enumerate(rows.tolist()):
            if row in first:
                raise ValueError(f"cache_batch_idx[{b}]={row} repeats cache_batch_idx[{first[row]}]={row}: with new "
                                 "keys k, v the values must be distinct (two sequences would write one cache row)")
            first[row] = b
    return rows


def kvcache_leftpad(cache_leftpad, cached) -> np.ndarray:
    """cache_leftpad as int64 (batch,) (None: zeros), checked against the cached counts (`kvcache_seqlens`):
    0 <= cache_leftpad[b] <= cache_seqlens[b]."""
    cached = np.asarray(cached, dtype=np.int64)
    if cache_leftpad is None:
        return np.zeros_like(cached)
    pad = _index_array(cache_leftpad, "cache_leftpad", cached.shape[0])
    bad = np.flatnonzero((pad < 0) | (pad > cached))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"cache_leftpad[{b}]={pad[b]} is out of range: allowed 0 <= cache_leftpad[{b}] <= "
                         f"cache_seqlens[{b}]={cached[b]}")
    return pad


def kvcache_slots(b: int, positions, cache_shape, block_table=None, *, cache_batch_idx=None):
    """Index of cache rows (logical key positions) of sequence b in the cache array: (cache_batch_idx[b] (b when
    None), positions) for a dense cache (B_cache, S_cache, H_kv, D); (block_table[b, p // page_size],
    p % page_size) for a paged cache (num_blocks, page_size, H_kv, D)."""
    positions = np.asarray(positions, dtype=np.int64)
    if block_table is None:
        row = b if cache_batch_idx is None else int(np.asarray(cache_batch_idx)[b])
        return np.full(positions.shape, row), positions
    page_size = cache_shape[1]
    return np.asarray(block_table)[b, positions // page_size].astype(np.int64), positions % page_size


def kvcache_keys(cache, b: int, start: int, stop: int, block_table=None, *, cache_batch_idx=None):
    """Cache rows start .. stop - 1 of sequence b (keys or values): (stop - start, H_kv, D)."""
    positions = np.arange(int(start), int(stop))
    return cache[kvcache_slots(b, positions, cache.shape, block_table, cache_batch_idx=cache_batch_idx)]


def check_rotary(cos, sin, head_dim: int) -> int:
    """rotary_dim = 2 * rotary_cos.shape[1] of rotary_cos, rotary_sin: float arrays (any objects with shape and
    dtype) of one shape (seqlen_ro, rotary_dim / 2), 2 <= rotary_dim <= head_dim."""
    if (cos is None) != (sin is None):
        given = {name: "None" if x is None else "an array" for name, x in (("cos", cos), ("sin", sin))}
        raise ValueError(f"rotary_cos and rotary_sin go together: got rotary_cos={given['cos']} and "
                         f"rotary_sin={given['sin']}; pass both or neither")
    for name, x in (("rotary_cos", cos), ("rotary_sin", sin)):
        dtype = np.dtype(x.dtype)
        if dtype.kind != "f" and dtype not in _LOWP.values():
            raise TypeError(f"{name} has dtype {dtype}; expected a float array")
    shape = tuple(cos.shape)
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"rotary_cos has shape {shape}; expected (seqlen_ro, rotary_dim // 2) with rotary_dim >= 2")
    if tuple(sin.shape) != shape:
        raise ValueError(f"rotary_sin has shape {tuple(sin.shape)} but rotary_cos has {shape}: they must have the "
                         "same shape")
    if 2 * shape[1] > head_dim:
        raise ValueError(f"rotary_dim={2 * shape[1]} (2 * rotary_cos.shape[1]) exceeds head_dim={head_dim}; expected "
                         "rotary_dim <= head_dim")
    return 2 * shape[1]


def check_rotary_positions(positions, seqlen_ro: int) -> np.ndarray:
    """positions (a host int array) as int64, each in [0, seqlen_ro) (the rows of rotary_cos and rotary_sin)."""
    positions = np.asarray(positions).astype(np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= seqlen_ro):
        p = int(positions.min()) if positions.min() < 0 else int(positions.max())
        raise ValueError(f"rotary position {p} is out of range of rotary_cos and rotary_sin with seqlen_ro={seqlen_ro} "
                         f"rows: allowed 0 <= position < {seqlen_ro}")
    return positions


def rotary_pairs(rotary_dim: int, interleaved: bool) -> tuple:
    """(first, second): the dims of the rotated pairs, pair f = (first[f], second[f]), f < rotary_dim / 2, as slices:
    (2f, 2f + 1) interleaved (GPT-J), (f, f + rotary_dim / 2) not (GPT-NeoX)."""
    half = rotary_dim // 2
    if interleaved:
        return slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    return slice(0, half), slice(half, rotary_dim)


def apply_rotary(x, cos, sin, positions, interleaved, dtype=None):
    """Rotary embedding of x (..., S, H, D) at per-row positions (an int array (..., S), broadcast against x's
    leading dims): the first rotary_dim = 2 * cos.shape[1] dims, in the pairs of `rotary_pairs`; pair f of the row
    at position p, (x1, x2) -> (x1 cos[p, f] - x2 sin[p, f], x1 sin[p, f] + x2 cos[p, f]); the other dims as
    given. cos, sin: (seqlen_ro, rotary_dim / 2) (`check_rotary`). dtype None: in float64, a float64 result.
    dtype "fp16" / "bf16": as the kernel does, in float32 from the inputs' values (each product and the sum
    rounded to float32, no fused multiply-add), the result rounded once to dtype (float32 holding dtype values)."""
    ft = np.float64 if dtype is None else np.float32
    x = np.array(x, dtype=ft)  # a copy
    rotary_dim = check_rotary(cos, sin, x.shape[-1])
    positions = check_rotary_positions(positions, cos.shape[0])
    c, s = (np.asarray(t, dtype=ft)[positions][..., None, :] for t in (cos, sin))  # (..., S, 1, rotary_dim / 2)
    first, second = rotary_pairs(rotary_dim, interleaved)
    x1, x2 = x[..., first].copy(), x[..., second].copy()
    x[..., first] = x1 * c - x2 * s
    x[..., second] = x1 * s + x2 * c
    return x if dtype is None else _round(x, dtype)


def rotary_window_given(window) -> bool:
    """Whether `window` bounds a side (not None, not (-1, -1)): then queries rotate at successive positions."""
    return _check_window(window) not in (None, (-1, -1))


def kvcache_rotary_positions(cached, seqlen_q: int, s_new: int, causal: bool, window) -> tuple:
    """(positions of q (B, Sq), positions of the new keys (B, S_new)), int64, for cached = cache_seqlens (B,): new
    key s of sequence b at cached[b] + s; query i at cached[b] + i when causal or a window is given, else every
    query at cached[b] (FlashAttention-2's flash_attn_with_kvcache)."""
    cached = np.asarray(cached, dtype=np.int64)[:, None]
    moving = causal or rotary_window_given(window)
    return cached + (np.arange(seqlen_q) if moving else np.zeros(seqlen_q, dtype=np.int64)), cached + np.arange(s_new)


def kvcache_slopes(alibi_slopes, batch: int, heads_q: int):
    """The ALiBi slopes of each sequence: None, or a list of batch (H_q,) arrays from slopes (H_q,) (shared) or
    (B, H_q) (row b)."""
    if alibi_slopes is None:
        return None
    slopes = alibi_slopes if hasattr(alibi_slopes, "shape") else np.asarray(alibi_slopes)  # NumPy or CuPy arrays stay
    if tuple(slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes has shape {tuple(slopes.shape)}; expected ({heads_q},) or ({batch}, {heads_q})")
    return [slopes if slopes.ndim == 1 else slopes[b] for b in range(batch)]


def kvcache_append(k_cache, v_cache, k, v, cache_seqlens, block_table=None, *, cache_batch_idx=None, rotary_cos=None,
                   rotary_sin=None, rotary_interleaved=True, dtype=None):
    """Copies of the caches with the new keys/values k, v (B, S_new, H_kv, D) written at cache rows
    cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 of each sequence b (of cache row cache_batch_idx[b] when given;
    through the block table when paged); everything else unchanged. Works on any dtype (compare bit patterns by
    passing integer views). With rotary_cos, rotary_sin (float k) the keys are rotated first (`apply_rotary`, new
    key s at position cache_seqlens[b] + s; dtype: rounded as the kernel does), the values never."""
    k_cache, v_cache = np.array(k_cache), np.array(v_cache)
    if k is None:
        return k_cache, v_cache
    batch, s_new = k.shape[:2]
    rows = kvcache_rows(cache_batch_idx, batch, k_cache.shape, block_table, new_keys=True)
    cached = kvcache_seqlens(cache_seqlens, batch, kvcache_capacity(k_cache.shape, block_table))
    if rotary_cos is not None or rotary_sin is not None:
        if np.asarray(k).dtype.kind in "iub":
            raise TypeError(f"k has dtype {np.asarray(k).dtype}: rotary needs float keys (rotate them with "
                            "apply_rotary first to append bit patterns)")
        k = apply_rotary(k, rotary_cos, rotary_sin, cached[:, None] + np.arange(s_new), rotary_interleaved, dtype)
    for b in range(batch):
        slots = kvcache_slots(b, cached[b] + np.arange(s_new), k_cache.shape, block_table, cache_batch_idx=rows)
        k_cache[slots], v_cache[slots] = k[b], v[b]
    return k_cache, v_cache


def _kvcache_attention(attend, q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, dtype, *,
                       cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved, window,
                       alibi_slopes):
    """Rotate q and the new keys (rounded to dtype unless None), append, then attend(q_b (1, Sq, H_q, D),
    keys (1, L_b, H_kv, D), values, slopes_b) for each sequence b over its cache rows [cache_leftpad[b],
    cache_seqlens[b] + S_new). Returns (per-sequence results, appended k_cache, appended v_cache)."""
    batch, seqlen_q, heads_q = q.shape[:3]
    s_new = 0 if k is None else k.shape[1]
    rows = kvcache_rows(cache_batch_idx, batch, np.shape(k_cache), block_table, new_keys=k is not None)
    cached = kvcache_seqlens(cache_seqlens, batch, kvcache_capacity(np.shape(k_cache), block_table))
    leftpad = kvcache_leftpad(cache_leftpad, cached)
    _check_window(window)
    slopes = kvcache_slopes(alibi_slopes, batch, heads_q)
    rotary = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved)
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            raise ValueError("rotary_cos and rotary_sin rotate q and the new keys: they need k and v (got k=None)")
        q_positions, _ = kvcache_rotary_positions(cached, seqlen_q, s_new, causal, window)
        q = apply_rotary(q, rotary_cos, rotary_sin, q_positions, rotary_interleaved, dtype)
        if dtype is None:  # the float64 reference keeps the rotated keys unrounded: float64 caches
            k_cache, v_cache = (np.asarray(c, dtype=np.float64) for c in (k_cache, v_cache))
    k_cache, v_cache = kvcache_append(k_cache, v_cache, k, v, cache_seqlens, block_table,
                                      cache_batch_idx=cache_batch_idx, dtype=dtype, **rotary)
    results = []
    for b in range(batch):
        keys, values = (kvcache_keys(c, b, leftpad[b], cached[b] + s_new, block_table, cache_batch_idx=rows)
                        for c in (k_cache, v_cache))
        results.append(attend(q[b:b + 1], keys[None], values[None], None if slopes is None else slopes[b]))
    return results, k_cache, v_cache


def attention_kvcache64(q, k_cache, v_cache, cache_seqlens=None, k=None, v=None, block_table=None, causal=False,
                        softmax_scale=None, *, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
                        rotary_sin=None, rotary_interleaved=True, window=None, alibi_slopes=None, softcap=None,
                        rotary_dtype=None):
    """float64 reference of attention_with_kvcache: q (B, Sq, H_q, D); caches dense (B_cache, S_cache, H_kv, D) or
    paged (num_blocks, page_size, H_kv, D) with block_table (B, max_blocks); cache_seqlens None / int /
    (B,) array; optional new k, v (B, S_new, H_kv, D); the other options as in the module docstring. Query i of
    sequence b attends its keys j in [0, L_b), cache rows cache_leftpad[b] + j, L_b = cache_seqlens[b] + S_new -
    cache_leftpad[b] (causal: j <= i + L_b - Sq). rotary_dtype: None rotates q and the new keys in float64, not
    rounded (the returned caches are then float64); "fp16" / "bf16" rounds them as the kernel does (`apply_rotary`),
    the kernel's actual inputs, for a reference of a low-precision call. Returns (o (B, Sq, H_q, D), lse (B, H_q,
    Sq), k_cache after the append, v_cache after the append); the arguments are not modified."""
    per_seq, k_cache, v_cache = _kvcache_attention(
        lambda qb, kb, vb, slopes: attention_forward64(qb, kb, vb, causal, softmax_scale, window=window,
                                                       alibi_slopes=slopes, softcap=softcap),
        q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, rotary_dtype, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, window=window, alibi_slopes=alibi_slopes)
    o = np.concatenate([r[0] for r in per_seq]) if per_seq else np.zeros(q.shape)
    lse = np.concatenate([r[1] for r in per_seq]) if per_seq else np.zeros((0, q.shape[2], q.shape[1]))
    return o, lse, k_cache, v_cache


def attention_kvcache_lowp(q, k_cache, v_cache, dtype, cache_seqlens=None, k=None, v=None, block_table=None,
                           causal=False, softmax_scale=None, *, cache_batch_idx=None, cache_leftpad=None,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=True, window=None, alibi_slopes=None,
                           softcap=None):
    """`attention_lowp` over each sequence's keys (after the append), q and the new keys rotated and rounded to
    `dtype` as the kernel does (`apply_rotary`): o (B, Sq, H_q, D) float32."""
    per_seq, _, _ = _kvcache_attention(
        lambda qb, kb, vb, slopes: attention_lowp(qb, kb, vb, dtype, causal, softmax_scale, window=window,
                                                  alibi_slopes=slopes, softcap=softcap),
        q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, dtype, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, window=window, alibi_slopes=alibi_slopes)
    return np.concatenate(per_seq) if per_seq else np.zeros(q.shape, dtype=np.float32)
