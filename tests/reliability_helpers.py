"""Helpers of the reliability tests: views inside NaN-poisoned buffers (guard bands), and a float64
reference with the kernels' IEEE NaN/Inf semantics.

Guard bands: `guarded(...)` places an array inside a larger buffer whose every other element holds the bit
pattern 0xFF..FF (NaN in fp16, bf16, fp32 and fp64). A kernel that reads outside an input view picks up
NaN and its output shows it; a kernel that writes outside an output view changes the poison, which
`Guarded.outside_unchanged` sees bit for bit.
"""
from __future__ import annotations

import math

import cupy as cp
import numpy as np

from cuflash import _xpref

_BITS = {1: cp.uint8, 2: cp.uint16, 4: cp.uint32, 8: cp.uint64}


class Guarded:
    """`view` (what the library is given) inside `big`, the whole buffer as unsigned integers (bit patterns).
    `region` indexes the view's elements in big (big's axes are in memory order)."""

    def __init__(self, big, view, region):
        self.big = big
        self.view = view
        self.region = region

    def snapshot(self):
        return self.big.copy()

    def unchanged(self, snapshot) -> bool:
        """Every bit of the buffer, view included, as in `snapshot` (for inputs)."""
        return bool(cp.array_equal(self.big, snapshot))

    def outside_unchanged(self, snapshot) -> bool:
        """Every bit outside the view as in `snapshot` (for outputs)."""
        outside = cp.ones(self.big.shape, dtype=cp.bool_)
        outside[self.region] = False
        return bool((self.big == snapshot)[outside].all())


def guarded(shape, dtype, values=None, *, order=None, before=None, after=None) -> Guarded:
    """A view of `shape` and `dtype` inside a NaN-poisoned buffer.

    order: memory order of the logical axes (default: as given; (0, 2, 1, 3) stores a (B, S, H, D) view
        head-major). before / after: poisoned elements before / after the view along each logical axis
        (default 1 before and 2 after on every axis but the last, 8 before and 8 after on the last: 16-byte
        aligned with strides that are multiples of 8 elements for 2-byte dtypes, so the library reads and
        writes the view in place).
    values: a contiguous array of `shape` and `dtype` copied into the view (bit for bit); None leaves the
        poison inside too (for outputs)."""
    dtype = np.dtype(dtype)
    nd = len(shape)
    order = tuple(range(nd)) if order is None else tuple(order)
    before = (1,) * (nd - 1) + (8,) if before is None else tuple(before)
    after = (2,) * (nd - 1) + (8,) if after is None else tuple(after)
    bits = _BITS[dtype.itemsize]
    big_shape = tuple(shape[a] + before[a] + after[a] for a in order)
    big = cp.full(math.prod(big_shape) * dtype.itemsize, 0xFF, dtype=cp.uint8).view(bits).reshape(big_shape)
    region = tuple(slice(before[a], before[a] + shape[a]) for a in order)
    inverse = tuple(order.index(a) for a in range(nd))  # memory axes -> logical axes
    bits_view = big[region].transpose(inverse)
    view = big.view(dtype)[region].transpose(inverse)
    if values is not None:
        assert values.shape == tuple(shape) and values.dtype == dtype, (values.shape, values.dtype, shape, dtype)
        assert values.flags.c_contiguous, "values must be C-contiguous (they are copied bit for bit)"
        bits_view[...] = values.view(bits)
    return Guarded(big, view, region)


def lowp_dtype(name: str) -> np.dtype:
    if name == "fp16":
        return np.dtype(np.float16)
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def attention_forward64_ieee(q, k, v, causal=False, softmax_scale=None):
    """float64 attention ((B, S, H, D) float arrays) with the kernels' NaN/Inf semantics: a row whose softmax
    sum l is exactly 0 (no visible key) gives o = 0 and lse = -inf; a row whose visible scores contain a
    NaN or a +inf (so that l is NaN) gives NaN in o and lse, as IEEE arithmetic does.

    (cuflash.reference and cuflash._xpref test `l > 0`, which is False for NaN, so they return o = 0 and
    lse = -inf for a NaN row: fine for finite inputs, wrong as a model of NaN propagation.)"""
    q, k, v = (cp.asarray(x, dtype=cp.float64) for x in (q, k, v))
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    bh = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    s = (bh(q) @ bh(k).transpose(0, 1, 3, 2)) * scale
    if causal:
        s = cp.where(_xpref.causal_mask(cp, sq, sk), s, -cp.inf)
    m = s.max(axis=-1, keepdims=True)  # NaN if a visible score is NaN
    m = cp.where(m == -cp.inf, 0.0, m)  # no visible key: exp(-inf - 0) = 0
    p = cp.exp(s - m)  # m = +inf: exp(inf - inf) = NaN at that key
    l = p.sum(axis=-1, keepdims=True)
    empty = l == 0
    o = bh((p / cp.where(empty, 1.0, l)) @ bh(v))
    o = cp.where(bh(empty), 0.0, o)
    lse = cp.where(empty[..., 0], -cp.inf, m[..., 0] + cp.log(cp.where(empty, 1.0, l)[..., 0]))
    return o, lse
