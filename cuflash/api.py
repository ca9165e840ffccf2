"""Public API: validate -> pick the kernel config -> compile (cached) -> launch on the current stream."""
from __future__ import annotations

import contextlib
import math
import numbers
import threading
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from . import _launch, _validate, config
from .config import (SEQLEN_Q_PAD, AppendConfig, CombineConfig, DropoutMaskConfig, ElementwiseConfig,
                     backward_kernel_config, dq_config, forward_kernel_config, fwd_decode_config, kernel_head_dim)
from .philox import dropout_threshold


_cupy_module = None


def _cupy():
    global _cupy_module
    if _cupy_module is None:
        import cupy

        _cupy_module = cupy
    return _cupy_module


# --- plan cache ------------------------------------------------------------------------------------------
# A warm call replays a *plan*: what the first call of its signature worked out (validated dims, config,
# loaded kernel, grid, output shapes, the params struct as an `ArgsTemplate`). The key of a signature holds
# everything that decides validation and launch except the array addresses: per array (shape, byte strides,
# dtype, device), and every option with its type (True == 1 but causal=1 is an error). Each public function
# builds its key in one place (`_forward_key`, ...): a new option goes there, and into the params struct
# built on the full path, which the plan records. What depends on addresses (16-byte alignment, which decides
# a copy; overlap of preallocated outputs with inputs) is checked on every call: when a check would not pass,
# the call takes the full path, which copies or raises exactly as without a plan. Plans are made only for
# calls that launch kernels on their arguments in place (no copy).

class _PlanCache:
    """Plans by key, at most `size` of them (the oldest goes first); thread-safe."""

    def __init__(self, size: int = 512):
        self.size = size
        self._plans: dict = {}
        self._lock = threading.Lock()

    def get(self, key):
        """The plan of key, or None (no key: arguments that are not all CuPy arrays; an unhashable option;
        a plan whose kernels came from an in-memory kernel table that has since been replaced)."""
        if key is None:
            return None
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable option (a list as softmax_scale, ...): the full path reports it
            return None
        if plan is None or plan.kernels is not _launch._kernels:
            return None
        return plan

    def put(self, key, plan) -> None:
        with self._lock:
            if len(self._plans) >= self.size:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


_plans = _PlanCache()


def _array_key(x):
    """What validation reads of a CuPy array except its address: (shape, byte strides, dtype, device)."""
    return x.shape, x.strides, x.dtype, x.data.device_id


def _relative_extent(info):
    """_extent(info) as byte offsets from info.ptr (they do not depend on the address)."""
    a0, a1 = _extent(info)
    return a0 - info.ptr, a1 - info.ptr


def _same(arrays, others) -> bool:
    """Whether each array is the same object as its counterpart (no copy was made)."""
    return all(a is b for a, b in zip(arrays, others))


def _any_overlap(outs, ins) -> bool:
    """Whether an output's bytes meet an input's or another output's: outs, ins are (address, (lo, hi))."""
    for i, (p, (lo, hi)) in enumerate(outs):
        a0, a1 = p + lo, p + hi
        for q, (qlo, qhi) in ins + outs[i + 1:]:
            if a0 < q + qhi and q + qlo < a1:
                return True
    return False


def _as_kernel_operand(x, info, dims, layout):
    """x itself when the kernel can read it in place; else an aligned contiguous copy (rare, see
    _validate.needs_aligned_copy) with its new metadata."""
    if not _validate.needs_aligned_copy(info, dims):
        return x, dims
    # a copy, always: ascontiguousarray returns a misaligned view unchanged when it is already C-contiguous
    # (every outer dim of size 1), and the kernels would then read 16-byte chunks at an odd address
    x = x.copy()
    info = _validate.array_info(x, info.name)
    return x, _validate.bshd_dims(info, layout)


_forward_kernels: dict = {}  # (device, kernel head dim, dtype, causal, mods, family) -> (config, loaded kernel)


def _forward_kernel(device, head_dim, dtype, causal, mods=0):
    """Config and loaded kernel of a forward call, looked up once (the warm path is one dict get)."""
    key = (device, head_dim, dtype, causal, mods, config.KERNELS)
    entry = _forward_kernels.get(key)
    if entry is None:
        cfg = forward_kernel_config(head_dim, dtype, causal, _launch.device_arch(device), mods=mods)
        entry = _forward_kernels[key] = (cfg, _launch.get_kernel(cfg, device))
    return entry


# --- score modifiers (cuda/mods.cuh) ------------------------------------------------------------------------

def _check_mods(causal, window, alibi_slopes, softcap, dropout_p, seed, offset, batch, heads, device):
    alibi = None if alibi_slopes is None else _validate.array_info(alibi_slopes, "alibi_slopes")
    return _validate.check_mods(causal, window, alibi, softcap, dropout_p, seed, offset, batch, heads, device)


def _mod_params(m: _validate.Mods, scale: float, max_seqlen: int) -> _launch.ModParams:
    """ModParams of a launch. An unbounded window side becomes a bound no sequence reaches (the kernels
    never test for -1)."""
    left, right = m.window if m.window is not None else (-1, -1)
    far = max(1, max_seqlen)
    a = m.alibi
    return _launch.ModParams(
        0 if a is None else a.ptr, int(a.strides[0]) if a is not None and len(a.shape) == 2 else 0, m.seed,
        far if left == -1 else left, far if right == -1 else right,
        scale / m.softcap if m.softcap else 0.0, m.softcap / scale if m.softcap else 0.0, 1.0 / scale,
        m.offset, dropout_threshold(m.dropout_p), 1.0 / (1.0 - m.dropout_p))


def _dropout_mask(m: _validate.Mods, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device: int):
    """bool (batch, heads, seqlen_q, seqlen_k): True where the kernels keep P (return_dropout_mask)."""
    cp = _cupy()
    if batch * heads * seqlen_q * seqlen_k > MAX_DROPOUT_MASK:
        raise ValueError(f"return_dropout_mask=True would return {batch * heads * seqlen_q * seqlen_k} elements "
                         f"(batch * heads * seqlen_q * seqlen_k); it is for testing small shapes, at most "
                         f"{MAX_DROPOUT_MASK}")
    mask = cp.empty((batch, heads, seqlen_q, seqlen_k), dtype=cp.uint8)
    if mask.size == 0:
        return mask.view(cp.bool_)
    if m.dropout_p == 0:  # nothing dropped
        mask.fill(1)
        return mask.view(cp.bool_)
    params = _launch.DropoutMaskParams(mask.data.ptr, _mod_params(m, 1.0, 1), seqlen_q, seqlen_k, heads)
    cfg = DropoutMaskConfig()
    groups = ((seqlen_q + 1) // 2) * ((seqlen_k + 1) // 2)
    _launch.get_kernel(cfg, device).launch((-(-groups // cfg.threads), heads, batch), params,
                                           cp.cuda.get_current_stream().ptr)
    return mask.view(cp.bool_)


MAX_DROPOUT_MASK = 2**30


def _on_device(cp, device):
    """`with cupy.cuda.Device(device)`, skipped when it is already the current device (saves ~2 us)."""
    return _NO_SWITCH if cp.cuda.runtime.getDevice() == device else cp.cuda.Device(device)


_NO_SWITCH = contextlib.nullcontext()


def _fwd_params(q, k, v, o, lse, seq, dq, dk, dv, o_strides, lse_strides, heads, head_dim, scale, **decode):
    """FwdParams of a launch: array pointers, (batch, row, head) strides of q, k, v (Dims) and o (a tuple),
    lse (batch, head) strides; `decode` fills the kv-cache fields (block_table, o_accum, lse_accum, split_counters,
    page_strides, block_table_stride, page_size, num_splits, rows_per_pos, accum_cols)."""
    page_strides = decode.get("page_strides", (0, 0))
    return _launch.FwdParams(
        q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, seq,
        decode.get("block_table", 0), decode.get("o_accum", 0), decode.get("lse_accum", 0),
        decode.get("split_counters", 0),
        dq.batch_stride, dq.row_stride, dq.head_stride,
        dk.batch_stride, dk.row_stride, dk.head_stride,
        dv.batch_stride, dv.row_stride, dv.head_stride,
        *o_strides, *lse_strides, *page_strides, heads, head_dim, decode.get("block_table_stride", 0),
        decode.get("page_size", 0), decode.get("num_splits", 1), decode.get("rows_per_pos", 1),
        scale * _launch.LOG2E, decode.get("accum_cols", 0))


def _contiguous_strides(dims, layout):
    """(batch, row, head) strides in elements of a new contiguous array shaped like `dims` in `layout`."""
    s, h, d = dims.seqlen, dims.heads, dims.head_dim
    return (s * h * d, h * d, d) if layout == "bshd" else (h * s * d, d, s * d)


def _empty_like_layout(dims, seqlen, dtype, layout):
    cp = _cupy()
    shape = (dims.batch, seqlen, dims.heads, dims.head_dim) if layout == "bshd" else \
        (dims.batch, dims.heads, seqlen, dims.head_dim)
    return cp.empty(shape, dtype=dtype)


class _ForwardPlan(NamedTuple):
    device: int
    o_shape: tuple
    o_dtype: object
    lse_shape: tuple
    kernel: object
    grid: tuple
    args: _launch.ArgsTemplate
    kernels: dict  # the kernel table the kernel came from


def _plain_mods(window, alibi_slopes, softcap, dropout_p, seed, offset, return_dropout_mask=False) -> bool:
    """The score-modifier options all at their defaults: only such calls are planned (a modifier's values,
    the slopes' address, the dropout seed go the full path, which validates them)."""
    return (window is None and alibi_slopes is None and softcap is None and type(dropout_p) is float
            and dropout_p == 0.0 and seed is None and type(offset) is int and offset == 0
            and return_dropout_mask is False)


def _forward_key(q, k, v, causal, softmax_scale, layout, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                 seed=None, offset=0, return_dropout_mask=False):
    """Plan key of an attention_forward call (None unless q, k, v are CuPy arrays and no modifier is asked).

    Flat, unlike the other keys: every warm forward call builds, hashes and compares it, and a tuple of
    per-array tuples cost ~1 us more of that."""
    nd = _validate._ndarray
    if type(q) is not nd or type(k) is not nd or type(v) is not nd:
        return None
    if not _plain_mods(window, alibi_slopes, softcap, dropout_p, seed, offset, return_dropout_mask):
        return None
    qd, kd, vd = q.data, k.data, v.data
    return ("forward", q.shape, q.strides, q.dtype, qd.device_id, k.shape, k.strides, k.dtype, kd.device_id,
            v.shape, v.strides, v.dtype, vd.device_id, type(causal), causal, type(softmax_scale), softmax_scale,
            layout, config.KERNELS)


def _forward_planned(q, k, v, key, with_lse):
    """The planned launch of a forward call with this key on q, k, v, or None (no plan, or an input the full
    path would copy: not 16-byte aligned)."""
    plan = _plans.get(key)
    if plan is None:
        return None
    q_ptr, k_ptr, v_ptr = q.data.ptr, k.data.ptr, v.data.ptr
    if (q_ptr | k_ptr | v_ptr) & 15:
        return None
    return _forward_replay(plan, q_ptr, k_ptr, v_ptr, with_lse)


def _forward_replay(plan, q_ptr, k_ptr, v_ptr, with_lse=True):
    """The plan's launch on these arrays: (o, lse), or o alone without lse (the kernel then writes none)."""
    cp = _cupy()
    with _on_device(cp, plan.device):
        o = cp.empty(plan.o_shape, dtype=plan.o_dtype)
        p, address = plan.args.mine()
        p.q, p.k, p.v, p.o = q_ptr, k_ptr, v_ptr, o.data.ptr
        if with_lse:
            lse = cp.empty(plan.lse_shape, dtype=cp.float32)
            p.lse = lse.data.ptr
        else:
            p.lse = None
        plan.kernel.launch_at(plan.grid, address, cp.cuda.get_current_stream().ptr)
    return (o, lse) if with_lse else o


def attention_forward(q, k, v, *, causal=False, softmax_scale=None, layout="bshd", window=None, alibi_slopes=None,
                      softcap=None, dropout_p=0.0, seed=None, offset=0, return_dropout_mask=False):
    """Fused attention forward, returning the output and the log-sum-exp of each query row.

    Args:
        q: CuPy array (batch, seqlen_q, heads, head_dim) for layout "bshd", or (batch, heads,
            seqlen_q, head_dim) for "bhsd"; float16 or bfloat16 (ml_dtypes.bfloat16). Any strides
            for batch/seqlen/heads; the last dim must be contiguous. head_dim: a multiple of 8, <= 256.
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
        dropout_p: drops each P_ij with probability dropout_p and scales the kept ones by 1 / (1 - dropout_p);
            the mask comes from Philox4x32-10 keyed by `seed` (required when dropout_p > 0) and `offset`, so
            the same seed gives the same result on every run, and the backward regenerates it (nothing of
            size N^2 is stored). lse is that of the undropped softmax.
        return_dropout_mask: also return the keep mask, bool (batch, heads, seqlen_q, seqlen_k) (for tests:
            small shapes only).
        The score is softmax_scale * q_i . k_j, then softcap, ALiBi, the masks, the softmax, dropout.

    Returns:
        (o, lse), or (o, lse, dropout_mask) with return_dropout_mask: o like q (same dtype, layout and shape,
        a new contiguous array); lse float32 (batch, heads, seqlen_q), natural log: lse_i = log sum_j exp(s_ij)
        of the (modified) scores s_ij = softmax_scale * q_i . k_j.

    Runs on the current CuPy stream, without host synchronization; allocates only o and lse.

    Example:
        >>> import cupy as cp, cuflash
        >>> q, k, v = (cp.random.randn(2, 1024, 8, 64).astype(cp.float16) for _ in range(3))
        >>> o, lse = cuflash.attention_forward(q, k, v, causal=True)
        >>> o.shape, lse.shape
        ((2, 1024, 8, 64), (2, 8, 1024))
    """
    key = _forward_key(q, k, v, causal, softmax_scale, layout, window, alibi_slopes, softcap, dropout_p, seed, offset,
                       return_dropout_mask)
    out = _forward_planned(q, k, v, key, with_lse=True)
    if out is not None:
        return out

    causal = _validate.check_flag(causal, "causal")
    return_mask = _validate.check_flag(return_dropout_mask, "return_dropout_mask")
    qi, ki, vi = _validate.array_info(q, "q"), _validate.array_info(k, "k"), _validate.array_info(v, "v")
    dtype, dq, dk, dv = _validate.check_qkv(qi, ki, vi, layout)
    scale = _validate.check_softmax_scale(softmax_scale, dq.head_dim)
    mods = _check_mods(causal, window, alibi_slopes, softcap, dropout_p, seed, offset, dq.batch, dq.heads, qi.device)
    cp = _cupy()

    with _on_device(cp, qi.device):
        o = _empty_like_layout(dq, dq.seqlen, q.dtype, layout)
        lse = cp.empty((dq.batch, dq.heads, dq.seqlen), dtype=cp.float32)
        extra = (_dropout_mask(mods, dq.batch, dq.heads, dq.seqlen, dk.seqlen, qi.device),) if return_mask else ()
        if o.size == 0:
            return (o, lse, *extra)
        if dk.seqlen == 0:  # no keys at all: every row is fully masked
            o.fill(0)
            lse.fill(-cp.inf)
            return (o, lse, *extra)
        given = (q, k, v)
        q, dq = _as_kernel_operand(q, qi, dq, layout)
        k, dk = _as_kernel_operand(k, ki, dk, layout)
        v, dv = _as_kernel_operand(v, vi, dv, layout)
        o_strides = _contiguous_strides(dq, layout)

        cfg, kernel = _forward_kernel(qi.device, kernel_head_dim(dq.head_dim), dtype, mods.causal, mods.bits)
        params = _fwd_params(q, k, v, o, lse, _launch.seq_params(dq.seqlen, dk.seqlen, dq.heads // dk.heads),
                             dq, dk, dv, o_strides, (dq.heads * dq.seqlen, dq.seqlen), dq.heads, dq.head_dim, scale)
        if mods.bits:
            params.mods = _mod_params(mods, scale, max(dq.seqlen, dk.seqlen))
        grid = (-(-dq.seqlen // cfg.block_m), dq.heads, dq.batch)
        if key is not None and _same(given, (q, k, v)):  # no operand copied: later calls replay this launch
            _plans.put(key, _ForwardPlan(qi.device, o.shape, o.dtype, lse.shape, kernel, grid,
                                         _launch.ArgsTemplate(params), _launch._kernels))
        kernel.launch(grid, params, cp.cuda.get_current_stream().ptr)
    return (o, lse, *extra)


def attention(q, k, v, *, causal=False, softmax_scale=None, layout="bshd", window=None, alibi_slopes=None,
              softcap=None, dropout_p=0.0, seed=None, offset=0, return_dropout_mask=False):
    """Fused attention: softmax(softmax_scale * q k^T [+ causal mask]) v, exact, O(N) extra memory.

    Same arguments as `attention_forward` (sliding window, ALiBi, softcap and dropout included); returns
    only o (like q: same dtype, layout and shape), or (o, dropout_mask) with return_dropout_mask.

    Example:
        >>> import cupy as cp, ml_dtypes, cuflash
        >>> q = cp.random.randn(1, 4096, 16, 128).astype(ml_dtypes.bfloat16)
        >>> o = cuflash.attention(q, q, q, causal=True)
    """
    # a planned call (attention_forward's plans) launches without lse: the kernel skips its writes
    o = _forward_planned(q, k, v, _forward_key(q, k, v, causal, softmax_scale, layout, window, alibi_slopes, softcap,
                                               dropout_p, seed, offset, return_dropout_mask), with_lse=False)
    if o is not None:
        return o
    out = attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, window=window,
                            alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed, offset=offset,
                            return_dropout_mask=return_dropout_mask)
    return (out[0], out[2]) if return_dropout_mask else out[0]


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


def _run_backward(device, dtype, mods, deterministic, scale, head_dim, batch, heads_q, heads_kv, seq, max_seqlen_q,
                  max_seqlen_k, pad_rows, pad_batches, q, k, v, out, dout, dq, dk, dv, lse, lse_strides):
    """Launch the backward kernels. Each of q ... dv is (array, Dims with (batch, row, head) strides);
    seq: SeqParams; pad_rows: fp32 rows per (batch, head) (dense) or per head (varlen, pad_batches = 1);
    mods: the validated score modifiers (their causal flag is the kernels').
    Returns (params, [(kernel, grid) in launch order], workspace floats) for a plan to replay."""
    causal = mods.causal
    cp = _cupy()
    hd = kernel_head_dim(head_dim)
    rows = pad_batches * heads_q * pad_rows
    work_floats = _backward_workspace(rows, hd, deterministic)
    work = cp.empty(work_floats, dtype=cp.float32)
    lse_log2, delta, dq_accum = _backward_workspace_ptrs(work.data.ptr, rows, deterministic)
    params = _launch.BwdParams(
        q[0].data.ptr, k[0].data.ptr, v[0].data.ptr, out[0].data.ptr, dout[0].data.ptr, dq[0].data.ptr,
        dk[0].data.ptr, dv[0].data.ptr, lse.data.ptr, dq_accum, lse_log2, delta, seq,
        *(s for _, d in (q, k, v, out, dout, dq, dk, dv) for s in (d.batch_stride, d.row_stride, d.head_stride)),
        *lse_strides, pad_rows, heads_q, head_dim, hd, _launch.scale_log2(scale), scale)
    if mods.bits:
        params.mods = _mod_params(mods, scale, max(max_seqlen_q, max_seqlen_k))
    stream = cp.cuda.get_current_stream().ptr
    launches = []
    pre = ElementwiseConfig("preprocess", dtype)
    rows_pad = -(-max_seqlen_q // SEQLEN_Q_PAD) * SEQLEN_Q_PAD  # padded region of the longest sequence
    launches.append((_launch.get_kernel(pre, device), (rows_pad // pre.rows_per_cta, heads_q, batch)))
    main = backward_kernel_config(hd, dtype, causal, deterministic, _launch.device_arch(device), mods=mods.bits)
    if max_seqlen_k > 0:
        launches.append((_launch.get_kernel(main, device), main.grid(batch, heads_kv, max_seqlen_k)))
    if deterministic:
        dqc = dq_config(hd, dtype, causal, mods.bits)
        launches.append((_launch.get_kernel(dqc, device), dqc.grid(batch, heads_q, max_seqlen_q)))
    else:
        conv = ElementwiseConfig("convert_dq", dtype)
        chunks = max_seqlen_q * (head_dim // 8)
        launches.append((_launch.get_kernel(conv, device), (-(-chunks // conv.threads), heads_q, batch)))
    for kernel, grid in launches:
        kernel.launch(grid, params, stream)
    return params, launches, work_floats


def _backward_workspace(rows: int, kernel_head_dim: int, deterministic: bool) -> int:
    """float32 elements of the backward's one workspace: lse_log2 and delta (`rows` each), then, unless
    deterministic, the dq accumulator (rows x kernel_head_dim). rows is a multiple of SEQLEN_Q_PAD, so each
    part starts 512-byte aligned."""
    return rows * (2 if deterministic else 2 + kernel_head_dim)


def _backward_workspace_ptrs(base: int, rows: int, deterministic: bool) -> tuple:
    """(lse_log2, delta, dq_accum or 0) addresses inside the workspace at `base`."""
    return base, base + 4 * rows, 0 if deterministic else base + 8 * rows


class _BackwardPlan(NamedTuple):
    device: int
    new_grads: tuple  # per dq, dk, dv: (shape, dtype) of the array to allocate, or None (preallocated)
    in_extents: tuple  # byte ranges of q, k, v, dout, out, lse relative to their addresses
    grad_extents: tuple  # the same of dq, dk, dv (None where not preallocated)
    rows: int  # fp32 rows of lse_log2 / delta in the workspace
    work_floats: int
    deterministic: bool
    launches: tuple  # (kernel, grid) in launch order
    args: _launch.ArgsTemplate
    kernels: dict


def _backward_key(dout, q, k, v, out, lse, causal, softmax_scale, layout, deterministic, dq, dk, dv, window=None,
                  alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None, offset=0):
    """Plan key of an attention_backward call (None unless every array argument is a CuPy array)."""
    nd = _validate._ndarray
    arrays = [dout, q, k, v, out, lse]
    arrays += [x for x in (dq, dk, dv) if x is not None]
    for x in arrays:
        if type(x) is not nd:
            return None
    if not _plain_mods(window, alibi_slopes, softcap, dropout_p, seed, offset):
        return None
    return ("backward", _array_key(dout), _array_key(q), _array_key(k), _array_key(v), _array_key(out),
            _array_key(lse), type(causal), causal, type(softmax_scale), softmax_scale, layout, type(deterministic),
            deterministic, *(None if x is None else _array_key(x) for x in (dq, dk, dv)), config.KERNELS)


def _backward_replay(plan, dout, q, k, v, out, lse, grads):
    """The plan's launches on these arrays, or None when an address check fails (the full path then copies
    an input, or raises for a preallocated output)."""
    ins = (q.data.ptr, k.data.ptr, v.data.ptr, dout.data.ptr, out.data.ptr)
    if (ins[0] | ins[1] | ins[2] | ins[3] | ins[4]) & 15:
        return None
    lse_ptr = lse.data.ptr
    given = [(x.data.ptr, ext) for x, ext in zip(grads, plan.grad_extents) if x is not None]
    if given:
        if any(ptr & 15 for ptr, _ in given):
            return None
        if _any_overlap(given, list(zip(ins + (lse_ptr,), plan.in_extents))):
            return None
    cp = _cupy()
    with _on_device(cp, plan.device):
        grads = [x if spec is None else cp.empty(spec[0], dtype=spec[1]) for x, spec in zip(grads, plan.new_grads)]
        work = cp.empty(plan.work_floats, dtype=cp.float32)
        p, address = plan.args.mine()
        p.q, p.k, p.v, p.dout, p.o, p.lse = ins[0], ins[1], ins[2], ins[3], ins[4], lse_ptr
        p.dq, p.dk, p.dv = grads[0].data.ptr, grads[1].data.ptr, grads[2].data.ptr
        p.lse_log2, p.delta, p.dq_accum = _backward_workspace_ptrs(work.data.ptr, plan.rows, plan.deterministic)
        stream = cp.cuda.get_current_stream().ptr
        for kernel, grid in plan.launches:
            kernel.launch_at(grid, address, stream)
    return grads[0], grads[1], grads[2]


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, layout="bshd",
                       deterministic=False, dq=None, dk=None, dv=None, window=None, alibi_slopes=None, softcap=None,
                       dropout_p=0.0, seed=None, offset=0):
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
        window, alibi_slopes, softcap, dropout_p, seed, offset: the forward's score modifiers, exactly as given
            to it (dropout regenerates the forward's mask from seed and offset; the slopes are not
            differentiated).

    Returns:
        (dq, dk, dv) in the inputs' dtype and layout. With grouped-query attention (k, v with fewer heads
        than q), dk and dv hold each key/value head's gradient summed over the query heads that use it.

    Extra device memory: lse_log2 and delta (float32, batch*heads*seqlen_q each) and, unless
    deterministic, a float32 dq accumulator of batch*heads*seqlen_q*head_dim: O(N), never O(N^2).

    Example:
        >>> o, lse = cuflash.attention_forward(q, k, v, causal=True)
        >>> dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    """
    key = _backward_key(dout, q, k, v, out, lse, causal, softmax_scale, layout, deterministic, dq, dk, dv, window,
                        alibi_slopes, softcap, dropout_p, seed, offset)
    plan = _plans.get(key)
    if plan is not None:
        grads = _backward_replay(plan, dout, q, k, v, out, lse, (dq, dk, dv))
        if grads is not None:
            return grads

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
    mods = _check_mods(causal, window, alibi_slopes, softcap, dropout_p, seed, offset, dq_.batch, dq_.heads, qi.device)
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
        given = (q, k, v, dout, out)
        q, dq_ = _as_kernel_operand(q, qi, dq_, layout)
        k, dk_ = _as_kernel_operand(k, ki, dk_, layout)
        v, dv_ = _as_kernel_operand(v, vi, dv_, layout)
        dout, ddo = _as_kernel_operand(dout, doi, ddo, layout)
        out, do_ = _as_kernel_operand(out, oi, do_, layout)
        ls = tuple(int(s) for s in li.strides)
        b, sq = dq_.batch, dq_.seqlen
        pad_rows = -(-sq // SEQLEN_Q_PAD) * SEQLEN_Q_PAD
        params, launches, work_floats = _run_backward(
            qi.device, dtype, mods, deterministic, scale, dq_.head_dim, b, dq_.heads, dk_.heads,
            _launch.seq_params(sq, dk_.seqlen, dq_.heads // dk_.heads), sq, dk_.seqlen, pad_rows, b,
            (q, dq_), (k, dk_), (v, dv_), (out, do_), (dout, ddo), (dq, ddq), (dk, ddk), (dv, ddv), lse, ls)
        if key is not None and _same(given, (q, k, v, dout, out)):  # no operand copied: later calls replay this
            args = (dq_arg, dk_arg, dv_arg)
            new_grads = tuple(None if a is not None else (x.shape, x.dtype) for a, x in zip(args, (dq, dk, dv)))
            grad_extents = tuple(None if a is None else _relative_extent(_validate.array_info(a, "grad"))
                                 for a in args)
            _plans.put(key, _BackwardPlan(qi.device, new_grads, tuple(_relative_extent(i) for i in inputs),
                                          grad_extents, b * dq_.heads * pad_rows, work_floats, deterministic,
                                          tuple(launches), _launch.ArgsTemplate(params), _launch._kernels))
    return dq, dk, dv


# --- variable-length (packed) batches ----------------------------------------------------------------

def _packed_operand(x, info, name):
    """x itself when the kernel can read it in place (16-byte aligned rows and strides), else an aligned
    contiguous copy; returns (array, token stride, head stride) in elements."""
    if _validate.needs_aligned_copy_rows(info):
        x = x.copy()  # a copy, always (see _as_kernel_operand)
        info = _validate.array_info(x, name)
    return x, int(info.strides[0]), int(info.strides[1])


def _packed_dims(total, heads, head_dim, token_stride, head_stride):
    """Dims of a packed (total, heads, head_dim) array: one 'batch' of `total` rows (batch stride 0: varlen
    kernels find sequence b's rows through cu_seqlens)."""
    return _validate.Dims(1, total, heads, head_dim, 0, token_stride, head_stride)


def _varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_inputs):
    """Validate a varlen call's q, k, v and sequence offsets; returns (VarlenDims, infos of q, k, v)."""
    check_inputs = _validate.check_flag(check_inputs, "check_inputs")
    qi, ki, vi = (_validate.array_info(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    cqi, cki = _validate.array_info(cu_seqlens_q, "cu_seqlens_q"), _validate.array_info(cu_seqlens_k, "cu_seqlens_k")
    m = _validate.check_varlen(qi, ki, vi, cqi, cki, max_seqlen_q, max_seqlen_k)
    if check_inputs:  # one device -> host copy of batch + 1 ints each (a synchronization)
        cp = _cupy()
        with _on_device(cp, m.device):
            _validate.check_cu_seqlens_values(cp.asnumpy(cu_seqlens_q), cp.asnumpy(cu_seqlens_k), m.total_q,
                                              m.total_k, m.max_seqlen_q, m.max_seqlen_k)
    return m, (qi, ki, vi)


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                             softmax_scale=None, check_inputs=True, window=None, alibi_slopes=None, softcap=None,
                             dropout_p=0.0, seed=None, offset=0, return_dropout_mask=False):
    """Fused attention over a batch of sequences of different lengths, packed without padding.

    Args:
        q: CuPy array (total_q, heads, head_dim): the query rows of all sequences, one after another;
            fp16 or bf16, last dim contiguous, any token/head strides.
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
        return_dropout_mask: also return a list of one bool (heads, len_q(b), len_k(b)) keep mask per sequence.

    Returns:
        (o, lse) (and the masks): o (total_q, heads, head_dim) like q; lse float32 (heads, total_q), natural
        log. A query that sees no key (an empty key sequence, or causal with len_q > len_k) gets o = 0,
        lse = -inf.

    Example:
        >>> cu = cp.asarray([0, 100, 100, 357], dtype=cp.int32)          # 3 sequences, one empty
        >>> q = cp.random.randn(357, 8, 64).astype(cp.float16)
        >>> o, lse = cuflash.attention_varlen_forward(q, q, q, cu, cu, 257, 257, causal=True)
    """
    causal = _validate.check_flag(causal, "causal")
    return_mask = _validate.check_flag(return_dropout_mask, "return_dropout_mask")
    m, (qi, ki, vi) = _varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_inputs)
    scale = _validate.check_softmax_scale(softmax_scale, m.head_dim)
    mods = _check_mods(causal, window, alibi_slopes, softcap, dropout_p, seed, offset, m.batch, m.heads_q, m.device)
    cp = _cupy()
    with _on_device(cp, m.device):
        o = cp.empty((m.total_q, m.heads_q, m.head_dim), dtype=q.dtype)
        lse = cp.empty((m.heads_q, m.total_q), dtype=cp.float32)
        extra = ()
        if return_mask:  # sequence b's mask is the top-left corner of batch index b's (the stream ignores lengths)
            dense = _dropout_mask(mods, m.batch, m.heads_q, m.max_seqlen_q, m.max_seqlen_k, m.device)
            cq, ck = cp.asnumpy(cu_seqlens_q), cp.asnumpy(cu_seqlens_k)
            extra = ([dense[b, :, :int(cq[b + 1] - cq[b]), :int(ck[b + 1] - ck[b])].copy() for b in range(m.batch)],)
        if o.size == 0:
            return (o, lse, *extra)
        q, qs, qh = _packed_operand(q, qi, "q")
        k, ks, kh = _packed_operand(k, ki, "k")
        v, vs, vh = _packed_operand(v, vi, "v")
        group = m.heads_q // m.heads_kv
        seq = _launch.seq_params(m.max_seqlen_q, m.max_seqlen_k, group, cu_seqlens_q.data.ptr, cu_seqlens_k.data.ptr)
        cfg, kernel = _forward_kernel(m.device, kernel_head_dim(m.head_dim), m.dtype, mods.causal, mods.bits)
        params = _fwd_params(
            q, k, v, o, lse, seq, _packed_dims(m.total_q, m.heads_q, m.head_dim, qs, qh),
            _packed_dims(m.total_k, m.heads_kv, m.head_dim, ks, kh), _packed_dims(m.total_k, m.heads_kv, m.head_dim, vs, vh),
            (0, m.heads_q * m.head_dim, m.head_dim), (0, m.total_q), m.heads_q, m.head_dim, scale)
        if mods.bits:
            params.mods = _mod_params(mods, scale, max(m.max_seqlen_q, m.max_seqlen_k))
        kernel.launch((-(-m.max_seqlen_q // cfg.block_m), m.heads_q, m.batch), params, cp.cuda.get_current_stream().ptr)
    return (o, lse, *extra)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, check_inputs=True, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                     seed=None, offset=0, return_dropout_mask=False):
    """`attention_varlen_forward` returning only o (total_q, heads, head_dim) (and the dropout masks with
    return_dropout_mask).

    Example:
        >>> cu = cp.asarray([0, 3, 10], dtype=cp.int32)
        >>> q = cp.random.randn(10, 4, 32).astype(cp.float16)
        >>> o = cuflash.attention_varlen(q, q, q, cu, cu, 7, 7)
    """
    out = attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                   softmax_scale=softmax_scale, check_inputs=check_inputs, window=window,
                                   alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
                                   offset=offset, return_dropout_mask=return_dropout_mask)
    return (out[0], out[2]) if return_dropout_mask else out[0]


def _check_packed_like(info, shape, what):
    if tuple(info.shape) != tuple(shape):
        raise ValueError(f"{info.name} has shape {info.shape} but must have the shape of {what}: {tuple(shape)}")


def _grad_output(x, name, like, like_info, inputs):
    """A new array shaped like `like` (packed), or the preallocated x after its checks."""
    cp = _cupy()
    if x is None:
        return cp.empty(like_info.shape, dtype=like.dtype)
    info = _validate.array_info(x, name)
    if info.dtype != like_info.dtype:
        raise TypeError(f"{name}.dtype={info.dtype} must be {like_info.dtype}, the dtype of {like_info.name}")
    _check_packed_like(info, like_info.shape, like_info.name)
    _validate.check_last_dim_contiguous(info, "head_dim")
    if _validate.needs_aligned_copy_rows(info):
        raise ValueError(f"{name} (preallocated) must be 16-byte aligned with token/head strides that are multiples "
                         f"of 8 elements; got strides {info.strides} at address {info.ptr:#x}")
    for other in inputs:
        if _validate.overlaps(info, other):
            raise ValueError(f"{name} (preallocated) overlaps the memory of {other.name}; outputs must not alias inputs")
    return x


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, deterministic=False, dq=None, dk=None, dv=None,
                              check_inputs=True, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                              seed=None, offset=0):
    """Gradients of `attention_varlen_forward` with respect to q, k and v.

    Args:
        dout: (total_q, heads, head_dim), the gradient of the loss with respect to out (any strides, last dim
            contiguous).
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, check_inputs:
            as given to the forward; out, lse: its outputs (lse float32 (heads, total_q)).
        deterministic, dq, dk, dv: as in `attention_backward` (preallocated outputs packed like q, k, v).
        window, alibi_slopes, softcap, dropout_p, seed, offset: the forward's score modifiers, as given to it.

    Returns:
        (dq, dk, dv) packed like q, k, v (dk, dv summed over the query heads of a group with GQA). Rows of
        zero-length sequences do not exist; a query that sees no key gets dq = 0.

    Example:
        >>> o, lse = cuflash.attention_varlen_forward(q, k, v, cu, cu, 257, 257, causal=True)
        >>> dq, dk, dv = cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu, cu, 257, 257, causal=True)
    """
    causal = _validate.check_flag(causal, "causal")
    deterministic = _validate.check_flag(deterministic, "deterministic")
    m, (qi, ki, vi) = _varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_inputs)
    doi, oi, li = (_validate.array_info(x, n) for x, n in ((dout, "dout"), (out, "out"), (lse, "lse")))
    _validate.check_dtype(qi, doi, oi)
    for info in (doi, oi):
        _check_packed_like(info, qi.shape, "q")
        _validate.check_last_dim_contiguous(info, "head_dim")
    if li.dtype != np.float32:
        raise TypeError(f"lse.dtype={li.dtype} must be float32 (the lse returned by attention_varlen_forward)")
    if li.shape != (m.heads_q, m.total_q):
        raise ValueError(f"lse has shape {li.shape}; expected (heads, total_q) = {(m.heads_q, m.total_q)}")
    if any(not float(s).is_integer() for s in li.strides):
        raise ValueError(f"lse has strides {li.strides} (elements) that are not whole elements")
    _validate.check_same_device(qi, doi, oi, li)
    scale = _validate.check_softmax_scale(softmax_scale, m.head_dim)
    mods = _check_mods(causal, window, alibi_slopes, softcap, dropout_p, seed, offset, m.batch, m.heads_q, m.device)
    cp = _cupy()
    inputs = (qi, ki, vi, doi, oi, li)

    with _on_device(cp, m.device):
        dq = _grad_output(dq, "dq", q, qi, inputs)
        dk = _grad_output(dk, "dk", k, ki, inputs)
        dv = _grad_output(dv, "dv", v, vi, inputs)
        given = [(_validate.array_info(x, n), n) for x, n, a in ((dq, "dq", dq), (dk, "dk", dk), (dv, "dv", dv))]
        for i, (a, na) in enumerate(given):
            for b, nb in given[i + 1:]:
                if _validate.overlaps(a, b):
                    raise ValueError(f"{nb} (preallocated) overlaps the memory of {na}; dq, dk and dv must be "
                                     f"separate arrays")
        if dq.size + dk.size == 0:
            return dq, dk, dv
        if m.total_q == 0 or m.total_k == 0:  # no query or no key row at all: no pair contributes
            for x in (dq, dk, dv):
                x.fill(0)
            return dq, dk, dv
        packed = []
        for x, info, name, total, heads in ((q, qi, "q", m.total_q, m.heads_q), (k, ki, "k", m.total_k, m.heads_kv),
                                            (v, vi, "v", m.total_k, m.heads_kv), (out, oi, "out", m.total_q, m.heads_q),
                                            (dout, doi, "dout", m.total_q, m.heads_q)):
            x, ts, hs = _packed_operand(x, info, name)
            packed.append((x, _packed_dims(total, heads, m.head_dim, ts, hs)))
        grads = []
        for x, total, heads in ((dq, m.total_q, m.heads_q), (dk, m.total_k, m.heads_kv), (dv, m.total_k, m.heads_kv)):
            st = _validate.array_info(x, "grad").strides
            grads.append((x, _packed_dims(total, heads, m.head_dim, int(st[0]), int(st[1]))))
        # fp32 rows: every sequence gets a region from a multiple of SEQLEN_Q_PAD (cuda/seqs.cuh)
        pad_rows = (m.total_q + SEQLEN_Q_PAD * m.batch) // SEQLEN_Q_PAD * SEQLEN_Q_PAD
        seq = _launch.seq_params(m.max_seqlen_q, m.max_seqlen_k, m.heads_q // m.heads_kv, cu_seqlens_q.data.ptr,
                                 cu_seqlens_k.data.ptr)
        ls = tuple(int(s) for s in li.strides)
        _run_backward(m.device, m.dtype, mods, deterministic, scale, m.head_dim, m.batch, m.heads_q, m.heads_kv, seq,
                      m.max_seqlen_q, m.max_seqlen_k, pad_rows, 1, *packed[:3], packed[3], packed[4], *grads, lse,
                      (0, ls[0], ls[1]))
    return dq, dk, dv


# --- KV-cache decoding ----------------------------------------------------------------------------------

_num_sms: dict = {}


def _sm_count(device: int) -> int:
    if device not in _num_sms:
        from cupy.cuda import runtime

        _num_sms[device] = runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device)
    return _num_sms[device]


MAX_SPLITS = 128  # the merge keeps the lse of 4 x 32 splits in registers: cuda/fwd.cuh MAX_SPLITS
# The split-KV launch aims at one CTA per SM, whatever the occupancy would allow: measured on the H100 (bf16,
# D 128, 32/8 heads), one full wave of single CTAs beat two CTAs per SM at every batch: B=1 32k keys 57.0 us
# (16 splits, 128 CTAs) vs 62.1 (32 splits, 256 CTAs); 128k keys 184 vs 194 us; B=2 32k 99 vs 117 us; B=8 32k
# 357 vs 364 us; B=8 128k 1369 vs 1409 us. A decode CTA keeps enough K/V loads in flight to use its SM's share
# of the bandwidth alone; a second one halves each split's work and doubles the merge's.
DECODE_CTAS_PER_SM = 1
# Split-KV merge in the decode launch itself (the last split of each row block merges; cuda/fwd.cuh
# fwd_decode_finish) rather than in a second launch of fwd_combine_kernel.
DECODE_FUSED_MERGE = True

# Counters of the one-launch merge: one int32 buffer per (device, stream). Launches on one stream run in
# order and each leaves its counters at zero, so they can share a buffer; launches on different streams may
# overlap, so they get their own.
_split_counters: dict = {}
_split_counters_lock = threading.Lock()


def _split_workspace(cp, device: int, stream: int, splits: int, accum_rows: int, hd: int, counter_rows: int):
    """(workspace, o_accum, lse_accum, split_counters) of a split-KV launch: one fp32 workspace holding o_accum
    (splits, batch, heads, seqlen_q, hd), then lse_accum (splits, batch, heads, seqlen_q), 128-byte aligned (hd is a
    multiple of 32); the counters of the merge in the decode launch (0 when fwd_combine_kernel merges). The caller
    keeps the workspace referenced until its launches are queued."""
    rows = splits * accum_rows
    work = cp.empty(rows * (hd + 1), dtype=cp.float32)
    counters = _split_counter_ptr(cp, device, stream, 2 * counter_rows) if DECODE_FUSED_MERGE else 0
    return work, work.data.ptr, work.data.ptr + 4 * rows * hd, counters


def _split_counter_ptr(cp, device: int, stream: int, n: int) -> int:
    """Address of at least n zeroed split counters for launches on `stream` of `device` (the current one)."""
    buf = _split_counters.get((device, stream))
    if buf is None or buf.size < n:
        with _split_counters_lock:
            buf = _split_counters.get((device, stream))
            if buf is None or buf.size < n:  # zeroed on this stream, before the launch that uses it
                buf = cp.zeros(max(n, 1024), dtype=cp.int32)
                _split_counters[(device, stream)] = buf
    return buf.data.ptr


@lru_cache(maxsize=4096)  # on the host path of every decode call: a dict lookup, not 128 trials
def num_splits_heuristic(ctas: int, key_blocks: int, num_sms: int, ctas_per_sm: int = 2) -> int:
    """Split-KV factor for a decode launch of `ctas` CTAs (row blocks x heads x batch) over `key_blocks`
    key tiles per sequence, on `num_sms` SMs that each hold `ctas_per_sm` of these CTAs at once.

    Decoding reads K/V once and is bound by memory bandwidth, which takes many loads in flight on every
    SM, so the launch should fill the machine, and fill it evenly: a launch of 1.2 waves leaves most SMs
    idle for its last 0.2 wave (on an H100, 64 CTAs split 5 ways made 320 CTAs for 264 slots and read the
    cache at 77-81% of the bandwidth that a 1-wave launch reaches). The factor is the smallest one whose
    waves are at least 95% full (a wave of `num_sms * ctas_per_sm` CTAs), or else the fullest, among
    those that leave each split at least 4 key tiles (256 keys), so the merge stays a small fraction of
    the work. A launch of one wave or more is split only to even out its last wave, and one of 4 waves
    or more is left whole (the SMs' schedulers already smooth the last of many waves)."""
    slots = max(1, num_sms * max(1, ctas_per_sm))
    if ctas <= 0 or key_blocks <= 0 or ctas >= 4 * slots:
        return 1
    most = max(1, min(key_blocks // 4, MAX_SPLITS))

    def fill(s: int) -> float:  # work of the launch over the slot-time it occupies
        waves = ctas * s / slots
        return waves / math.ceil(waves)

    fills = {s: fill(s) for s in range(1, most + 1)}
    good = [s for s, f in fills.items() if f >= 0.95]
    return good[0] if good else max(fills, key=lambda s: (fills[s], -s))


class _KvcachePlan(NamedTuple):
    device: int
    m: _validate.KvcacheDims
    check_inputs: bool
    is_count: bool  # cache_seqlens is None or an int (its value is checked and written per call)
    o_dtype: object
    append: tuple | None  # (kernel, grid, ArgsTemplate) of the append launch, None without new keys
    extents: tuple | None  # with new keys: byte ranges of q, k, v, cache_seqlens, block_table, k_cache, v_cache
    kernel: object
    row_blocks: int
    grid_heads: int
    block_n: int
    num_sms: int
    accum_rows: int  # splits x accum_rows rows of hd floats in o_accum, then as many floats of lse_accum
    hd: int
    combine: tuple  # (CombineConfig, grid) of the merge of split results
    args: _launch.ArgsTemplate
    kernels: dict


def _kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits,
                 return_lse, check_inputs):
    """Plan key of an attention_with_kvcache call (None unless every array argument is a CuPy array). An int
    cache_seqlens enters by its type only: its value is checked and written per call."""
    nd = _validate._ndarray
    if type(q) is not nd or type(k_cache) is not nd or type(v_cache) is not nd:
        return None
    for x in (k, v, block_table):
        if x is not None and type(x) is not nd:
            return None
    if cache_seqlens is None or isinstance(cache_seqlens, numbers.Integral):
        lens = type(cache_seqlens)
    elif type(cache_seqlens) is nd:
        lens = _array_key(cache_seqlens)
    else:
        return None
    return ("kvcache", _array_key(q), _array_key(k_cache), _array_key(v_cache),
            *(None if x is None else _array_key(x) for x in (k, v, block_table)), lens, type(causal), causal,
            type(softmax_scale), softmax_scale, type(num_splits), num_splits, type(return_lse), return_lse,
            type(check_inputs), check_inputs)


def _kvcache_replay(plan, q, k_cache, v_cache, k, v, cache_seqlens, block_table):
    """The plan's launches on these arrays, or None when a per-call check fails (the full path then copies,
    or raises exactly as without a plan)."""
    m = plan.m
    ptrs = (q.data.ptr, k_cache.data.ptr, v_cache.data.ptr)
    if (ptrs[0] | ptrs[1] | ptrs[2]) & 15:
        return None
    cache_seqlen = 0 if m.cache_seqlen is None else m.cache_seqlen  # the keys cached in every sequence, or 0
    if plan.is_count:
        lens_ptr = None
        if cache_seqlens is not None:
            cache_seqlen = int(cache_seqlens)
            if cache_seqlen < 0 or cache_seqlen + m.s_new > m.capacity:
                return None
    else:
        lens_ptr = cache_seqlens.data.ptr
    bt_ptr = None if block_table is None else block_table.data.ptr
    if m.s_new:
        new = (k.data.ptr, v.data.ptr)
        if (new[0] | new[1]) & 15:
            return None
        # the caches are written: they must not meet each other or anything the call reads
        at = (ptrs[0], new[0], new[1], lens_ptr, bt_ptr, ptrs[1], ptrs[2])
        ranges = [(a, e) for a, e in zip(at, plan.extents) if a is not None]
        if _any_overlap(ranges[-2:], ranges[:-2]):
            return None
    cp = _cupy()
    with _on_device(cp, plan.device):
        max_len = m.capacity
        if plan.check_inputs:  # before anything is written: a rejected call leaves the caches untouched
            lens_host = cache_seqlens if plan.is_count else cp.asnumpy(cache_seqlens)
            max_len = _validate.check_kvcache_values(lens_host, None if bt_ptr is None else cp.asnumpy(block_table),
                                                     m.capacity, m.s_new, m.num_blocks, m.page_size)
        o = cp.empty((m.batch, m.seqlen_q, m.heads_q, m.head_dim), dtype=plan.o_dtype)
        lse = cp.empty((m.batch, m.heads_q, m.seqlen_q), dtype=cp.float32)
        stream = cp.cuda.get_current_stream().ptr
        if plan.append is not None:
            kernel, grid, template = plan.append
            p, address = template.mine()
            p.k_new, p.v_new, p.k_cache, p.v_cache, p.cache_seqlens, p.block_table = (
                new[0], new[1], ptrs[1], ptrs[2], lens_ptr, bt_ptr)
            p.cache_seqlen = cache_seqlen
            kernel.launch_at(grid, address, stream)
        kernel = plan.kernel
        splits = m.num_splits or num_splits_heuristic(plan.row_blocks * plan.grid_heads * m.batch,
                                                      -(-max_len // plan.block_n), plan.num_sms, DECODE_CTAS_PER_SM)
        p, address = plan.args.mine()  # this thread's block: every field a call may change is set below
        p.q, p.k, p.v, p.o, p.lse, p.block_table = ptrs[0], ptrs[1], ptrs[2], o.data.ptr, lse.data.ptr, bt_ptr
        seq = p.seq
        seq.seqused_k, seq.seqlen_k = lens_ptr, cache_seqlen
        p.num_splits = splits
        if splits > 1:
            work, p.o_accum, p.lse_accum, p.split_counters = _split_workspace(
                cp, plan.device, stream, splits, plan.accum_rows, plan.hd, plan.row_blocks * plan.grid_heads * m.batch)
        else:
            p.o_accum = p.lse_accum = p.split_counters = None
        kernel.launch_at((plan.row_blocks, plan.grid_heads, m.batch * splits), address, stream)
        if splits > 1 and not DECODE_FUSED_MERGE:
            _launch.get_kernel(plan.combine[0], plan.device).launch_at(plan.combine[1], address, stream)
    return o, lse


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, block_table=None,
                           causal=False, softmax_scale=None, num_splits=0, return_lse=False, check_inputs=True):
    """Attention of a few new query tokens over a key/value cache (decoding), appending new keys/values.

    Args:
        q: CuPy array (batch, seqlen_q, heads, head_dim) ("bshd"; any strides, last dim contiguous).
        k_cache, v_cache: (batch, S_cache, heads_kv, head_dim), heads a multiple of heads_kv; or, with
            block_table, a paged cache (num_blocks, page_size, heads_kv, head_dim), page_size a multiple of 64.
        k, v: optional new keys/values (batch, S_new, heads_kv, head_dim), written into the cache in place at
            positions cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 before the attention.
        cache_seqlens: keys already in each sequence's cache: None (the whole cache), an int, or a CuPy
            int32 (batch,) array. It is not modified.
        block_table: CuPy int32 (batch, max_blocks_per_seq): key j of sequence b lives in physical block
            block_table[b, j // page_size], row j % page_size (None: a dense cache).
        causal: bottom-right aligned: query i sees key j iff j <= i + L_b - seqlen_q, L_b = cache_seqlens[b] + S_new.
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
    key = _kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, num_splits,
                       return_lse, check_inputs)
    plan = _plans.get(key)
    if plan is not None:
        out = _kvcache_replay(plan, q, k_cache, v_cache, k, v, cache_seqlens, block_table)
        if out is not None:
            return out if return_lse else out[0]

    causal = _validate.check_flag(causal, "causal")
    return_lse = _validate.check_flag(return_lse, "return_lse")
    check_inputs = _validate.check_flag(check_inputs, "check_inputs")
    qi = _validate.array_info(q, "q")
    kci, vci = _validate.array_info(k_cache, "k_cache"), _validate.array_info(v_cache, "v_cache")
    ki = None if k is None else _validate.array_info(k, "k")
    vi = None if v is None else _validate.array_info(v, "v")
    is_count = cache_seqlens is None or isinstance(cache_seqlens, numbers.Integral)
    lens_info = cache_seqlens if is_count else _validate.array_info(cache_seqlens, "cache_seqlens")
    bti = None if block_table is None else _validate.array_info(block_table, "block_table")
    m = _validate.check_kvcache(qi, kci, vci, ki, vi, lens_info, bti, num_splits)
    scale = _validate.check_softmax_scale(softmax_scale, m.head_dim)
    cp = _cupy()

    with _on_device(cp, m.device):
        max_len = m.capacity
        if check_inputs:  # before anything is written: a rejected call leaves the caches untouched
            lens_host = cache_seqlens if is_count else cp.asnumpy(cache_seqlens)
            max_len = _validate.check_kvcache_values(lens_host, None if bti is None else cp.asnumpy(block_table),
                                                     m.capacity, m.s_new, m.num_blocks, m.page_size)
        o = cp.empty((m.batch, m.seqlen_q, m.heads_q, m.head_dim), dtype=q.dtype)
        lse = cp.empty((m.batch, m.heads_q, m.seqlen_q), dtype=cp.float32)
        if m.batch == 0:
            return (o, lse) if return_lse else o
        stream = cp.cuda.get_current_stream().ptr
        lens_ptr = None if is_count else cache_seqlens.data.ptr  # keys cached per sequence (device), or ...
        cache_seqlen = 0 if m.cache_seqlen is None else m.cache_seqlen  # ... the same count for all
        bt_ptr = block_table.data.ptr if m.paged else None
        dkc, dvc = m.k_cache, m.v_cache  # paged: Dims of (num_pages, page_size, heads_kv, head_dim)
        given = (q, k, v)
        append = None
        if m.s_new:  # append k, v at positions cache_seqlens[b] .. + S_new - 1: one launch, no host sync
            k, dk = _as_kernel_operand(k, ki, m.k, "bshd")
            v, dv = _as_kernel_operand(v, vi, m.v, "bshd")
            params = _launch.AppendParams(
                k.data.ptr, v.data.ptr, k_cache.data.ptr, v_cache.data.ptr, lens_ptr, bt_ptr,
                *(s for d in (dk, dv, dkc, dvc) for s in (d.batch_stride, d.row_stride, d.head_stride)),
                cache_seqlen, m.s_new, m.heads_kv, m.head_dim, m.page_size if m.paged else 0,
                m.block_table_stride)
            app = AppendConfig()
            chunks = m.s_new * m.heads_kv * (m.head_dim // 8)
            append = (_launch.get_kernel(app, m.device), (-(-chunks // app.threads), m.batch, 1))
            append[0].launch(append[1], params, stream)
            append += (_launch.ArgsTemplate(params),)
        if o.size == 0:
            return (o, lse) if return_lse else o
        q, dq = _as_kernel_operand(q, qi, m.q, "bshd")

        # Grouped query heads are packed as rows (cuda/fwd.cuh): one K/V tile read serves the whole group.
        group = m.heads_q // m.heads_kv
        rows_per_pos, grid_heads = (group, m.heads_kv) if group > 1 else (1, m.heads_q)
        hd = kernel_head_dim(m.head_dim)
        cfg = fwd_decode_config(hd, m.dtype, causal)
        row_blocks = -(-m.seqlen_q * rows_per_pos // cfg.block_m)
        key_blocks = -(-max_len // cfg.block_n)
        kernel = _launch.get_kernel(cfg, m.device)
        splits = m.num_splits or num_splits_heuristic(row_blocks * grid_heads * m.batch, key_blocks,
                                                      _sm_count(m.device), DECODE_CTAS_PER_SM)
        o_accum = lse_accum = counters = 0
        accum_rows = m.batch * m.heads_q * m.seqlen_q
        if splits > 1:
            work, o_accum, lse_accum, counters = _split_workspace(cp, m.device, stream, splits, accum_rows, hd,
                                                                  row_blocks * grid_heads * m.batch)
        page = {}
        if m.paged:  # pages are indexed from the cache base (no batch stride)
            page = dict(block_table=bt_ptr, block_table_stride=m.block_table_stride, page_size=m.page_size,
                        page_strides=(dkc.batch_stride, dvc.batch_stride))
            dkc, dvc = dkc._replace(batch_stride=0), dvc._replace(batch_stride=0)
        # packed rows: grid.y runs over K/V heads, so no further query-head -> K/V-head division
        seq = _launch.seq_params(m.seqlen_q, cache_seqlen, 1 if rows_per_pos > 1 else group, seqused_k=lens_ptr,
                                 seqlen_k_new=m.s_new)
        params = _fwd_params(
            q, k_cache, v_cache, o, lse, seq, dq, dkc, dvc,
            (m.seqlen_q * m.heads_q * m.head_dim, m.heads_q * m.head_dim, m.head_dim),
            (m.heads_q * m.seqlen_q, m.seqlen_q), m.heads_q, m.head_dim, scale, num_splits=splits,
            rows_per_pos=rows_per_pos, o_accum=o_accum, lse_accum=lse_accum, split_counters=counters,
            accum_cols=hd, **page)
        kernel.launch((row_blocks, grid_heads, m.batch * splits), params, stream)
        comb = CombineConfig(m.dtype)
        combine = (comb, (-(-m.heads_q * m.seqlen_q // comb.rows_per_cta), m.batch, 1))
        if splits > 1 and not DECODE_FUSED_MERGE:
            _launch.get_kernel(comb, m.device).launch(combine[1], params, stream)
        if key is not None and _same(given, (q, k, v)):  # no operand copied: later calls replay this
            extents = None
            if m.s_new:
                extents = tuple(None if i is None else _relative_extent(i)
                                for i in (qi, ki, vi, None if is_count else lens_info, bti, kci, vci))
            _plans.put(key, _KvcachePlan(m.device, m, check_inputs, is_count, o.dtype, append, extents, kernel,
                                         row_blocks, grid_heads, cfg.block_n, _sm_count(m.device), accum_rows, hd,
                                         combine, _launch.ArgsTemplate(params), _launch._kernels))
    return (o, lse) if return_lse else o
