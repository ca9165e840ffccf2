"""The public functions: their arguments and docstrings. Each one validates its arguments into a problem
(_problem.py) and has the plan layer (_families.py) launch it; a warm call of a known signature replays the plan
its first call recorded (_plan.py) and skips both."""
from __future__ import annotations

from numbers import Integral

from . import _families, _fp8, _plan, _problem, _validate
from ._plan import (ARRAY, BOUND, COUNT, DEFAULT, FLAG_OR_ARRAY, MASK, NUMBER_OR_ARRAY, OPTION, OPTIONAL_ARRAY,
                    Signature)

# What the plan key holds of the score modifiers: a window, the softcap and the dropout probability by value, the
# ALiBi slopes, a bias, a boolean mask and a key_padding_mask as arrays (their addresses bound per call; with both
# masks, their intersection is made per call), a BlockMask by its identity, dbias when it is True or False or as a
# preallocated array, the dropout seed and offset by type (their values checked and written per call). FP8 descales
# enter as arrays or by value (None or a number), out_dtype by value. Calls that return the dropout mask are not
# planned: they go the full path. The varlen functions' cu_seqlens are arrays of their plans, max_seqlen and
# check_inputs options (check_inputs=True reads cu_seqlens back on every call, planned or not).
_PLAIN = dict(return_dropout_mask=False)
_FP8_ARGS = (("q_descale", NUMBER_OR_ARRAY), ("k_descale", NUMBER_OR_ARRAY), ("v_descale", NUMBER_OR_ARRAY),
             ("out_dtype", OPTION))
_VALUE_MODS = (("window", OPTION), ("alibi_slopes", OPTIONAL_ARRAY), ("softcap", OPTION), ("bias", OPTIONAL_ARRAY))
_MASKS = (("mask", MASK), ("key_padding_mask", OPTIONAL_ARRAY))
_DROPOUT = (("dropout_p", OPTION), ("seed", BOUND), ("offset", BOUND))
_FWD_MODS = (*_VALUE_MODS, *_MASKS, *_DROPOUT, ("return_dropout_mask", DEFAULT))
_BWD_MODS = (*_VALUE_MODS, ("dbias", FLAG_OR_ARRAY), *_MASKS, *_DROPOUT)
_ATTENTION = Signature("attention", (("q", ARRAY), ("k", ARRAY), ("v", ARRAY), ("causal", OPTION),
                                     ("softmax_scale", OPTION), ("layout", OPTION), ("precision", OPTION), *_FWD_MODS,
                                     *_FP8_ARGS), _PLAIN)
_FORWARD = Signature("attention_forward", _ATTENTION.params, _PLAIN)
_BACKWARD = Signature("attention_backward", (
    ("dout", ARRAY), ("q", ARRAY), ("k", ARRAY), ("v", ARRAY), ("out", ARRAY), ("lse", ARRAY), ("causal", OPTION),
    ("softmax_scale", OPTION), ("layout", OPTION), ("precision", OPTION), ("deterministic", OPTION),
    ("dq", OPTIONAL_ARRAY),
    ("dk", OPTIONAL_ARRAY), ("dv", OPTIONAL_ARRAY), *_BWD_MODS), _PLAIN)
_VARLEN_FORWARD = Signature("attention_varlen_forward", (
    ("q", ARRAY), ("k", ARRAY), ("v", ARRAY), ("cu_seqlens_q", ARRAY), ("cu_seqlens_k", ARRAY),
    ("max_seqlen_q", OPTION), ("max_seqlen_k", OPTION), ("causal", OPTION), ("softmax_scale", OPTION),
    ("check_inputs", OPTION), ("precision", OPTION), *_FWD_MODS, *_FP8_ARGS), _PLAIN)
_VARLEN_BACKWARD = Signature("attention_varlen_backward", (
    ("dout", ARRAY), ("q", ARRAY), ("k", ARRAY), ("v", ARRAY), ("out", ARRAY), ("lse", ARRAY), ("cu_seqlens_q", ARRAY),
    ("cu_seqlens_k", ARRAY), ("max_seqlen_q", OPTION), ("max_seqlen_k", OPTION), ("causal", OPTION),
    ("softmax_scale", OPTION), ("deterministic", OPTION), ("dq", OPTIONAL_ARRAY), ("dk", OPTIONAL_ARRAY),
    ("dv", OPTIONAL_ARRAY), ("check_inputs", OPTION), ("precision", OPTION), *_BWD_MODS))
_KVCACHE = Signature("attention_with_kvcache", (
    ("q", ARRAY), ("k_cache", ARRAY), ("v_cache", ARRAY), ("k", OPTIONAL_ARRAY), ("v", OPTIONAL_ARRAY),
    ("cache_seqlens", COUNT), ("block_table", OPTIONAL_ARRAY), ("causal", OPTION), ("softmax_scale", OPTION),
    ("num_splits", OPTION), ("return_lse", OPTION), ("check_inputs", OPTION), ("rotary_cos", OPTIONAL_ARRAY),
    ("rotary_sin", OPTIONAL_ARRAY), ("rotary_interleaved", OPTION), ("cache_batch_idx", OPTIONAL_ARRAY),
    ("cache_leftpad", OPTIONAL_ARRAY), ("window", OPTION), ("alibi_slopes", OPTIONAL_ARRAY), ("softcap", OPTION)))


def attention_forward(q, k, v, *, causal=False, softmax_scale=None, layout="bshd", window=None, alibi_slopes=None,
                      softcap=None, bias=None, mask=None, key_padding_mask=None, dropout_p=0.0, seed=None, offset=0,
                      return_dropout_mask=False, precision=None, q_descale=None, k_descale=None, v_descale=None,
                      out_dtype=None):
    """Fused attention forward, returning the output and the log-sum-exp of each query row.

    Args:
        q: CuPy array (batch, seqlen_q, heads, head_dim) for layout "bshd", or (batch, heads,
            seqlen_q, head_dim) for "bhsd"; float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64. Any
            strides for batch/seqlen/heads; the last dim must be contiguous. head_dim: a multiple of 8, <= 256
            (float64: <= 128).
        k, v: same dtype and layout, seqlen_k rows: (batch, seqlen_k, heads_kv, head_dim) for "bshd".
            heads_kv may be smaller than q's heads (grouped-query / multi-query attention): heads must be
            a multiple of heads_kv, and query head h uses key/value head h // (heads // heads_kv).
        causal: mask aligned to the bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q.
            A query that sees no key gets o = 0 and lse = -inf.
        softmax_scale: multiplies q k^T before the softmax; default 1/sqrt(head_dim).
        layout: "bshd" or "bhsd", for the inputs and the output.
        window: sliding window (left, right), -1 = unbounded on that side: query i sees key j iff
            i + Sk - Sq - left <= j <= i + Sk - Sq + right (and, with causal, j <= i + Sk - Sq). Key tiles
            outside the band are skipped. None (default): no window.
        alibi_slopes: CuPy float32 (heads,) or (batch, heads): score_ij += -slope * |i + Sk - Sq - j|.
        softcap: float > 0: score = softcap * tanh(score / softcap) (applied before ALiBi and the masks).
        bias: additive score bias, a CuPy array in q's dtype or float32 of 2 to 4 dims that broadcasts to
            (batch, heads, seqlen_q, seqlen_k) from the right; never materialized. Size-1 dims broadcast; the
            batch (heads) dim may also divide batch (heads): batch b uses bias[b // (batch // bias.shape[0])],
            which runs row attention over a folded batch directly (q (B, N, L, H, D) reshaped to
            (B * N, L, H, D), bias (B, H, L, L) shared by the N rows of each group). Added to
            softmax_scale * q . k before the softcap.
        mask: bool CuPy array broadcast to (batch, heads, seqlen_q, seqlen_k) like bias: False = masked.
        key_padding_mask: bool CuPy array (batch, seqlen_k): False keys are ignored. With mask: both apply.
            A row whose keys are all masked gets o = 0 and lse = -inf.
        dropout_p: drops each P_ij with probability dropout_p and scales the kept ones by 1 / (1 - dropout_p);
            the mask comes from Philox4x32-10 keyed by `seed` (required when dropout_p > 0) and `offset`, so
            the same seed gives the same result on every run, and the backward regenerates it (nothing of
            size N^2 is stored). lse is that of the undropped softmax.
        return_dropout_mask: also return the keep mask, bool (batch, heads, seqlen_q, seqlen_k) (for tests:
            small shapes only).
        precision: float32 inputs only: None or "fp32" (default: 3xTF32 split arithmetic on the TF32 tensor
            cores, accurate to float32's level) or "tf32" (one TF32 pass: faster, with TF32's 10-bit mantissa
            error, like CuPy's CUPY_TF32=1). float64 runs on the FP64 tensor cores with a float64 softmax, and
            takes causal and window of the score modifiers.
        The score is softmax_scale * q_i . k_j + bias_ij, then softcap, ALiBi, the masks (causal, window, mask,
        key_padding_mask), the softmax, dropout.
        q_descale, k_descale, v_descale, out_dtype: FP8 inputs only. FP8 (e4m3) attention takes q, k, v as CuPy
            uint8 arrays of e4m3 bits (CuPy cannot hold float8 arrays; `cuflash.fp8.quantize` makes them) with
            head_dim 64, 128 or 256, on an sm_90 GPU; element values are e4m3 * descale. Each descale is None (1.0),
            a number > 0 or a CuPy float32 array of shape (), (batch, heads) or (batch, heads,
            ceil(seqlen / 128)) (one factor per block of 128 rows), heads being the K/V heads for k_descale and
            v_descale. out_dtype: o's dtype, bfloat16 (default) or float16; lse is float32. FP8 takes causal,
            window and GQA; the other score modifiers, dropout and precision are refused.

    Returns:
        (o, lse), or (o, lse, dropout_mask) with return_dropout_mask: o like q (same dtype, layout and shape,
        a new contiguous array); lse float32 (float64 for float64 inputs) (batch, heads, seqlen_q), natural log: lse_i = log sum_j exp(s_ij)
        of the (modified) scores s_ij = softmax_scale * q_i . k_j.

    Runs on the current CuPy stream, without host synchronization; allocates only o and lse.

    Example:
        >>> import cupy as cp, cuflash
        >>> q, k, v = (cp.random.randn(2, 1024, 8, 64).astype(cp.float16) for _ in range(3))
        >>> o, lse = cuflash.attention_forward(q, k, v, causal=True)
        >>> o.shape, lse.shape
        ((2, 1024, 8, 64), (2, 8, 1024))
    """
    key = _FORWARD.key(q, k, v, causal, softmax_scale, layout, precision, window, alibi_slopes, softcap, bias, mask,
                       key_padding_mask, dropout_p, seed, offset, return_dropout_mask, q_descale, k_descale, v_descale,
                       out_dtype)
    plan = _plan.plans.get(key)
    if plan is not None:
        out = _plan.replay(plan, (q, k, v, alibi_slopes, bias, mask, key_padding_mask, q_descale, k_descale, v_descale),
                           (seed, offset))
        if out is not None:
            return out
    return _forward(q, k, v, causal, softmax_scale, layout, window, alibi_slopes, softcap, dropout_p, seed, offset,
                    return_dropout_mask, key, with_lse=True, bias=bias, mask=mask, key_padding_mask=key_padding_mask,
                    precision=precision, fp8=(q_descale, k_descale, v_descale, out_dtype))


def attention(q, k, v, *, causal=False, softmax_scale=None, layout="bshd", window=None, alibi_slopes=None,
              softcap=None, bias=None, mask=None, key_padding_mask=None, dropout_p=0.0, seed=None, offset=0,
              return_dropout_mask=False, precision=None, q_descale=None, k_descale=None, v_descale=None,
              out_dtype=None):
    """Fused attention: softmax(softmax_scale * q k^T [+ causal mask]) v, exact, O(N) extra memory.

    Same arguments as `attention_forward` (sliding window, ALiBi, softcap, bias, masks, dropout and precision included); returns
    only o (like q: same dtype, layout and shape), or (o, dropout_mask) with return_dropout_mask.

    Example:
        >>> import cupy as cp, ml_dtypes, cuflash
        >>> q = cp.random.randn(1, 4096, 16, 128).astype(ml_dtypes.bfloat16)
        >>> o = cuflash.attention(q, q, q, causal=True)
    """
    key = _ATTENTION.key(q, k, v, causal, softmax_scale, layout, precision, window, alibi_slopes, softcap, bias, mask,
                         key_padding_mask, dropout_p, seed, offset, return_dropout_mask, q_descale, k_descale,
                         v_descale, out_dtype)
    plan = _plan.plans.get(key)
    if plan is not None:
        o = _plan.replay(plan, (q, k, v, alibi_slopes, bias, mask, key_padding_mask, q_descale, k_descale, v_descale),
                         (seed, offset))
        if o is not None:
            return o
    return _forward(q, k, v, causal, softmax_scale, layout, window, alibi_slopes, softcap, dropout_p, seed, offset,
                    return_dropout_mask, key, with_lse=False, bias=bias, mask=mask, key_padding_mask=key_padding_mask,
                    precision=precision, fp8=(q_descale, k_descale, v_descale, out_dtype))


_NO_FP8 = (None, None, None, None)


def _forward(q, k, v, causal, softmax_scale, layout, window, alibi_slopes, softcap, dropout_p, seed, offset,
             return_dropout_mask, key, with_lse, bias=None, mask=None, key_padding_mask=None, precision=None,
             fp8=_NO_FP8):
    """The full path of attention / attention_forward: o without lse (the kernel then writes none). fp8: q_descale,
    k_descale, v_descale, out_dtype."""
    if any(x is not None for x in fp8) or _fp8.is_fp8(q):
        return _fp8_forward(q, k, v, causal, softmax_scale, layout, window, alibi_slopes, softcap, bias, mask,
                            key_padding_mask, dropout_p, return_dropout_mask, precision, *fp8, with_lse=with_lse,
                            key=key)
    return_mask = _validate.check_flag(return_dropout_mask, "return_dropout_mask")
    a = _problem.attention(q, k, v, causal, softmax_scale, layout, window, alibi_slopes, softcap, dropout_p, seed,
                           offset, bias, mask, key_padding_mask, precision)
    mask = (_families.dropout_mask(a.mods, a.batch, a.heads_q, a.seqlen_q, a.seqlen_k, a.device),) if return_mask else ()
    out = _families.forward(a, (q, k, v), with_lse=with_lse, key=key)
    if with_lse:
        return (*out, *mask)
    return (out, *mask) if return_mask else out


def _fp8_forward(q, k, v, causal, softmax_scale, layout, window, alibi_slopes, softcap, bias, mask, key_padding_mask,
                 dropout_p, return_dropout_mask, precision, q_descale, k_descale, v_descale, out_dtype, with_lse,
                 key=None):
    """attention / attention_forward on FP8 inputs (descales given, or q a uint8 array); key: the call's plan key."""
    if not _fp8.is_fp8(q):
        _fp8.refuse_descales(q_descale, k_descale, v_descale, out_dtype)
    refused = dict(alibi_slopes=alibi_slopes, softcap=softcap, bias=bias, mask=mask, key_padding_mask=key_padding_mask,
                   dropout_p=dropout_p, return_dropout_mask=return_dropout_mask, precision=precision)
    return _fp8.attention(q, k, v, causal, softmax_scale, layout, window, q_descale, k_descale, v_descale, out_dtype,
                          refused, with_lse, key=key)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, layout="bshd",
                       deterministic=False, dq=None, dk=None, dv=None, window=None, alibi_slopes=None, softcap=None,
                       bias=None, dbias=False, mask=None, key_padding_mask=None, dropout_p=0.0, seed=None, offset=0,
                       precision=None):
    """Gradients of attention with respect to q, k and v, recomputing P tile by tile (no N x N memory).

    Args:
        dout: gradient of the loss with respect to `out`, shaped like q (any strides, last dim contiguous).
        q, k, v: the forward's inputs (same conventions as `attention_forward`).
        out, lse: the forward's outputs, from `attention_forward(q, k, v, ...)` with the same options.
            lse: float32 (float64 for float64 inputs) (batch, heads, seqlen_q).
        causal, softmax_scale, layout, precision: as given to the forward.
        deterministic: False (default) accumulates dq with fp32 atomics, whose order varies from run to
            run (results differ in the last bits); True makes the gradients bitwise reproducible: on Hopper's
            warp-specialized backward and for float32 and float64 inputs the same additions in a fixed order of
            key blocks (a CTA waits for its turn on each query block; the float32 Hopper backward at head dims up
            to 64 has no atomics and repeats bitwise in either mode), elsewhere a second kernel that owns each
            query block and recomputes S and dP (about 1.4x the backward's FLOPs).
        dq, dk, dv: optional preallocated outputs shaped like q, k, v, in their dtype, not aliasing an input.
        window, alibi_slopes, softcap, bias, mask, key_padding_mask, dropout_p, seed, offset: the forward's score
            modifiers, exactly as given to it (dropout regenerates the forward's mask from seed and offset; the
            slopes and masks are not differentiated).
        dbias: with bias, True returns its gradient dL/dbias as well, or a preallocated float32 CuPy array of
            bias's shape receives it (overwritten). dL/dbias is the gradient of the scores (dS, through the
            softcap) summed over the dims that bias broadcasts, accumulated in float32: the only N x N output.
            A broadcast bias sums with float32 atomics, so deterministic=True refuses it.

    Returns:
        (dq, dk, dv) in the inputs' dtype and layout, and dbias (float32, shaped like bias) after them when
        dbias is given. With grouped-query attention (k, v with fewer heads than q), dk and dv hold each
        key/value head's gradient summed over the query heads that use it.

    Extra device memory: lse_log2 and delta (float32, batch*heads*seqlen_q each) and a float32 dq accumulator
    of batch*heads*seqlen_q*head_dim (float64 for float64 inputs; deterministic: also one int32 turn counter per
    64 of its rows on Hopper's warp-specialized backward, per 16 rows for float32 and float64, no accumulator
    elsewhere): O(N), never O(N^2).

    Example:
        >>> o, lse = cuflash.attention_forward(q, k, v, causal=True)
        >>> dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    """
    key = _BACKWARD.key(dout, q, k, v, out, lse, causal, softmax_scale, layout, precision, deterministic, dq, dk, dv,
                        window, alibi_slopes, softcap, bias, dbias, mask, key_padding_mask, dropout_p, seed,
                        offset)
    plan = _plan.plans.get(key)
    if plan is not None:
        grads = _plan.replay(plan, (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, bias, mask, key_padding_mask,
                                    _dbias_array(dbias)), (seed, offset))
        if grads is not None:
            return grads
    a = _problem.attention(q, k, v, causal, softmax_scale, layout, window, alibi_slopes, softcap, dropout_p, seed,
                           offset, bias, mask, key_padding_mask, precision)
    p = _problem.backward(a, dout, out, lse, deterministic, dq, dk, dv, dbias)
    return _families.backward(p, (dout, q, k, v, out, lse, dq, dk, dv), key=key, dbias=_dbias_array(dbias))


def _dbias_array(dbias):
    """The preallocated dbias array of a call, or None (dbias False / True)."""
    return None if dbias is None or isinstance(dbias, bool) else dbias


# --- variable-length (packed) batches ----------------------------------------------------------------

def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                             softmax_scale=None, check_inputs=True, window=None, alibi_slopes=None, softcap=None,
                             bias=None, mask=None, key_padding_mask=None, dropout_p=0.0, seed=None, offset=0,
                             return_dropout_mask=False, precision=None, q_descale=None, k_descale=None,
                             v_descale=None, out_dtype=None):
    """Fused attention over a batch of sequences of different lengths, packed without padding.

    Args:
        q: CuPy array (total_q, heads, head_dim): the query rows of all sequences, one after another;
            float16, bfloat16, float32 or float64, last dim contiguous, any token/head strides.
        k, v: (total_k, heads_kv, head_dim), heads a multiple of heads_kv (grouped-query attention).
        cu_seqlens_q, cu_seqlens_k: CuPy int32 (batch + 1,): sequence b is q rows cu_seqlens_q[b] ..
            cu_seqlens_q[b + 1] - 1 and k/v rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1; cu[0] = 0,
            non-decreasing, cu[-1] = total. Zero-length sequences are allowed.
        max_seqlen_q, max_seqlen_k: ints >= the longest query / key sequence (they size the launch).
        causal: per sequence, bottom-right aligned: query i of sequence b sees key j iff
            j <= i + len_k(b) - len_q(b).
        softmax_scale: default 1/sqrt(head_dim).
        check_inputs: read cu_seqlens back to the host (one synchronization) and check their values;
            False skips that (wrong values are then undefined behaviour).
        window, alibi_slopes, softcap, dropout_p, seed, offset: as in `attention_forward`, per sequence
            (bottom-right aligned to each sequence's lengths); alibi_slopes (heads,) or (batch, heads) with
            batch = the number of sequences; sequence b draws the dropout stream of batch index b.
        bias, mask, key_padding_mask: as in `attention_forward`, for scores of shape (batch, heads,
            max_seqlen_q, max_seqlen_k) (key_padding_mask (batch, max_seqlen_k)): sequence b reads the top-left
            (len_q(b), len_k(b)) corner of its (batch, head) slice.
        return_dropout_mask: also return a list of one bool (heads, len_q(b), len_k(b)) keep mask per sequence.
        precision: float32 inputs: None / "fp32" or "tf32", as in `attention_forward`.
        q_descale, k_descale, v_descale, out_dtype: FP8 inputs (uint8 e4m3 bits), as in `attention_forward`;
            per-block descales are (batch, heads, ceil(max_seqlen / 128)), blocks counted within each sequence.

    Returns:
        (o, lse) (and the masks): o (total_q, heads, head_dim) like q; lse float32 (float64 for float64 inputs)
        (heads, total_q), natural
        log. A query that sees no key (an empty key sequence, or causal with len_q > len_k) gets o = 0,
        lse = -inf.

    Example:
        >>> cu = cp.asarray([0, 100, 100, 357], dtype=cp.int32)          # 3 sequences, one empty
        >>> q = cp.random.randn(357, 8, 64).astype(cp.float16)
        >>> o, lse = cuflash.attention_varlen_forward(q, q, q, cu, cu, 257, 257, causal=True)
    """
    key = _VARLEN_FORWARD.key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                              check_inputs, precision, window, alibi_slopes, softcap, bias, mask, key_padding_mask,
                              dropout_p, seed, offset, return_dropout_mask, q_descale, k_descale, v_descale, out_dtype)
    out = _varlen_replay(key, (q, k, v, alibi_slopes, bias, mask, key_padding_mask, q_descale, k_descale, v_descale,
                               cu_seqlens_q, cu_seqlens_k), (seed, offset), check_inputs, q, k, max_seqlen_q,
                         max_seqlen_k)
    if out is not None:
        return out
    if q_descale is not None or k_descale is not None or v_descale is not None or out_dtype is not None or \
            _fp8.is_fp8(q):
        if not _fp8.is_fp8(q):
            _fp8.refuse_descales(q_descale, k_descale, v_descale, out_dtype)
        refused = dict(alibi_slopes=alibi_slopes, softcap=softcap, bias=bias, mask=mask,
                       key_padding_mask=key_padding_mask, dropout_p=dropout_p, return_dropout_mask=return_dropout_mask,
                       precision=precision)
        return _fp8.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                     softmax_scale, check_inputs, window, q_descale, k_descale, v_descale, out_dtype,
                                     refused, with_lse=True, key=key)
    return_mask = _validate.check_flag(return_dropout_mask, "return_dropout_mask")
    a = _problem.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, check_inputs, window, alibi_slopes, softcap, dropout_p, seed, offset,
                                  bias, mask, key_padding_mask, precision)
    masks = ()
    if return_mask:  # sequence b's mask is the top-left corner of batch index b's (the stream ignores lengths)
        masks = (_families.varlen_dropout_masks(a, cu_seqlens_q, cu_seqlens_k),)
    o, lse = _families.forward(a, (q, k, v), with_lse=True, cu_seqlens=(cu_seqlens_q, cu_seqlens_k), key=key)
    return (o, lse, *masks)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, check_inputs=True, window=None, alibi_slopes=None, softcap=None, bias=None,
                     mask=None, key_padding_mask=None, dropout_p=0.0, seed=None, offset=0, return_dropout_mask=False,
                     precision=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """`attention_varlen_forward` returning only o (total_q, heads, head_dim) (and the dropout masks with
    return_dropout_mask).

    Example:
        >>> cu = cp.asarray([0, 3, 10], dtype=cp.int32)
        >>> q = cp.random.randn(10, 4, 32).astype(cp.float16)
        >>> o = cuflash.attention_varlen(q, q, q, cu, cu, 7, 7)
    """
    out = attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                   softmax_scale=softmax_scale, check_inputs=check_inputs, window=window,
                                   alibi_slopes=alibi_slopes, softcap=softcap, bias=bias, mask=mask,
                                   key_padding_mask=key_padding_mask, dropout_p=dropout_p, seed=seed, offset=offset,
                                   return_dropout_mask=return_dropout_mask, precision=precision, q_descale=q_descale,
                                   k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype)
    return (out[0], out[2]) if return_dropout_mask else out[0]


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, deterministic=False, dq=None, dk=None, dv=None,
                              check_inputs=True, window=None, alibi_slopes=None, softcap=None, bias=None, dbias=False,
                              mask=None, key_padding_mask=None, dropout_p=0.0, seed=None, offset=0, precision=None):
    """Gradients of `attention_varlen_forward` with respect to q, k and v.

    Args:
        dout: (total_q, heads, head_dim), the gradient of the loss with respect to out (any strides, last dim
            contiguous).
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, check_inputs:
            as given to the forward; out, lse: its outputs (lse float32 (heads, total_q)).
        deterministic, dq, dk, dv: as in `attention_backward` (preallocated outputs packed like q, k, v).
        window, alibi_slopes, softcap, bias, mask, key_padding_mask, dropout_p, seed, offset, precision: the
            forward's score modifiers and precision, as given to it.
        dbias: as in `attention_backward` (shaped like bias; the corners no sequence reaches stay 0).

    Returns:
        (dq, dk, dv) packed like q, k, v (dk, dv summed over the query heads of a group with GQA), and dbias
        after them when asked for. Rows of zero-length sequences do not exist; a query that sees no key gets dq = 0.

    Example:
        >>> o, lse = cuflash.attention_varlen_forward(q, k, v, cu, cu, 257, 257, causal=True)
        >>> dq, dk, dv = cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu, cu, 257, 257, causal=True)
    """
    key = _VARLEN_BACKWARD.key(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                               softmax_scale, deterministic, dq, dk, dv, check_inputs, precision, window, alibi_slopes,
                               softcap, bias, dbias, mask, key_padding_mask, dropout_p, seed, offset)
    grads = _varlen_replay(key, (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, bias, mask, key_padding_mask,
                                 _dbias_array(dbias), cu_seqlens_q, cu_seqlens_k), (seed, offset), check_inputs, q, k,
                           max_seqlen_q, max_seqlen_k)
    if grads is not None:
        return grads
    a = _problem.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, check_inputs, window, alibi_slopes, softcap, dropout_p, seed, offset,
                                  bias, mask, key_padding_mask, precision)
    p = _problem.backward(a, dout, out, lse, deterministic, dq, dk, dv, dbias)
    return _families.backward(p, (dout, q, k, v, out, lse, dq, dk, dv), cu_seqlens=(cu_seqlens_q, cu_seqlens_k),
                              key=key, dbias=_dbias_array(dbias))


def _varlen_replay(key, arrays, extra, check_inputs, q, k, max_seqlen_q, max_seqlen_k):
    """A varlen call replayed from its plan (arrays: the plan's, cu_seqlens_q and cu_seqlens_k last), or None: no
    plan, or a per-call check sent the call down the full path. check_inputs=True reads cu_seqlens back first, as
    the full path does (the key holds check_inputs by type and value: True or False here)."""
    plan = _plan.plans.get(key)
    if plan is None:
        return None
    if check_inputs is True:
        _problem.check_cu_seqlens(arrays[-2], arrays[-1], q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
                                  plan.device)
    return _plan.replay(plan, arrays, extra)


# --- KV-cache decoding ----------------------------------------------------------------------------------

def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, block_table=None,
                           causal=False, softmax_scale=None, num_splits=0, return_lse=False, check_inputs=True,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=True, cache_batch_idx=None,
                           cache_leftpad=None, window=None, alibi_slopes=None, softcap=None):
    """Attention of a few new query tokens over a key/value cache (decoding), appending new keys/values.

    Args:
        q: CuPy array (batch, seqlen_q, heads, head_dim) ("bshd"; any strides, last dim contiguous).
        k_cache, v_cache: (batch, S_cache, heads_kv, head_dim), heads a multiple of heads_kv (with cache_batch_idx
            any number of entries); or, with block_table, a paged cache (num_blocks, page_size, heads_kv,
            head_dim), page_size a multiple of 16.
        k, v: optional new keys/values (batch, S_new, heads_kv, head_dim), written into the cache in place at
            cache rows cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 before the attention.
        cache_seqlens: keys already in each sequence's cache, i.e. the cache row where its new keys go: None (the
            whole cache), an int, or a CuPy int32 (batch,) array. It is not modified.
        block_table: CuPy int32 (batch, max_blocks_per_seq): cache row j of sequence b lives in physical block
            block_table[b, j // page_size], row j % page_size (None: a dense cache).
        causal: bottom-right aligned: query i sees key j iff j <= i + L_b - seqlen_q, L_b = cache_seqlens[b] + S_new
            - cache_leftpad[b] (key j: cache row cache_leftpad[b] + j).
        rotary_cos, rotary_sin: rotary embedding tables (seqlen_ro, rotary_dim // 2) in q's dtype or float32
            (rotary_dim a multiple of 16, at most head_dim; seqlen_ro >= the cache capacity); need k and v. The
            first rotary_dim dims of q and of the new keys are rotated (in fp32, rounded once) before the attention
            and before k is written into the cache: new key s at position cache_seqlens[b] + s; query i at
            cache_seqlens[b] + i with causal or a window, else every query at cache_seqlens[b]. q is not modified.
        rotary_interleaved: True (GPT-J): dims (2f, 2f + 1) rotate together by angle f; False (GPT-NeoX): dims
            (f, f + rotary_dim // 2). Pair (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos).
        cache_batch_idx: CuPy int32 (batch,), dense caches only: batch entry b reads and writes cache entry
            cache_batch_idx[b] (distinct entries when k, v are appended). None: entry b.
        cache_leftpad: CuPy int32 (batch,): sequence b's keys start at cache row cache_leftpad[b] (0 <= leftpad
            <= cache_seqlens[b]); positions for causal, the window and ALiBi count from there. None: 0.
        window, alibi_slopes, softcap: the score modifiers of `attention`, per sequence over its L_b keys
            (window (left, right), -1 unbounded; alibi_slopes float32 (heads,) or (batch, heads); softcap > 0).
        softmax_scale: default 1/sqrt(head_dim).
        num_splits: split-KV factor, 0 (default: chosen from the launch size, see num_splits_heuristic) or
            1..128: each split reads part of the keys; the last split of each row block to finish merges the
            partial results, in the same launch and in a fixed order (the result repeats bitwise).
        return_lse: also return lse float32 (batch, heads, seqlen_q).
        check_inputs: read cache_seqlens / block_table back to the host (one synchronization) and check them
            before anything is written; False skips that (wrong values are then undefined behaviour).

    Returns:
        o (batch, seqlen_q, heads, head_dim), or (o, lse) with return_lse. A rejected call writes nothing.

    Example:
        >>> k_cache = cp.zeros((4, 4096, 8, 128), dtype=cp.float16); v_cache = cp.zeros_like(k_cache)
        >>> lens = cp.asarray([10, 200, 3000, 0], dtype=cp.int32)
        >>> q, k, v = (cp.random.randn(4, 1, n, 128).astype(cp.float16) for n in (32, 8, 8))
        >>> o = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, causal=True)
    """
    key = _KVCACHE.key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits,
                       return_lse, check_inputs, rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx,
                       cache_leftpad, window, alibi_slopes, softcap)
    plan = _plan.plans.get(key)
    lens = None if cache_seqlens is None or isinstance(cache_seqlens, Integral) else cache_seqlens
    arrays = (q, k_cache, v_cache, k, v, lens, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
              alibi_slopes)
    if plan is not None:
        out = _plan.replay(plan, arrays, cache_seqlens)
        if out is not None:
            return out
    p = _problem.kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits,
                         return_lse, check_inputs, rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx,
                         cache_leftpad, window, alibi_slopes, softcap)
    return _families.decode(p, arrays, cache_seqlens, key=key)
