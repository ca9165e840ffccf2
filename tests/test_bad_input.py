"""Bad calls of the public API: a table of calls across `attention`, `attention_forward` and
`attention_backward`, each asserting the exception type, message fragments that name the argument and its
value, and that no user array changed.

CPU part (no GPU needed, runs in CI): array metadata comes from `FakeCupyArray` through a patched
`_validate.array_info`; `_launch.cupy` and `_launch.get_kernel` are patched to fail, so every error must be
raised from metadata alone, before the GPU is touched. NumPy arguments are compared before/after.
GPU part (marker gpu): real CuPy arrays for what needs them (preallocated outputs, aliasing), each array a view
inside a NaN-poisoned buffer that must come back bit-for-bit unchanged.

Entries marked xfail(strict=True) document known gaps (see docs/RELIABILITY.md); when one is fixed the entry
XPASSes and fails, so the marker gets removed.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _launch, _validate
from cuflash._validate import ArrayInfo

FP16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


# --- CPU part: metadata-only arrays ------------------------------------------------------------------------

class FakeCupyArray:
    """What validation reads of a CuPy array (shape, dtype, strides in elements, address, device), no data."""

    _next_ptr = 1 << 30

    def __init__(self, shape, dtype=FP16, strides=None, device=0):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        if strides is None:
            strides, step = [], 1
            for n in reversed(self.shape):
                strides.insert(0, step)
                step *= max(n, 1)
        self.strides_elems = tuple(strides)
        FakeCupyArray._next_ptr += 1 << 24  # distinct, 16-byte aligned addresses
        self.ptr = FakeCupyArray._next_ptr
        self.device = device

    def info(self, name: str) -> ArrayInfo:
        return ArrayInfo(name, self.shape, self.dtype, self.strides_elems, self.ptr, self.device)


class FakeTorchTensor:
    """Looks like a torch.Tensor to a type check: its type's __module__ is 'torch'."""


FakeTorchTensor.__module__ = "torch"


class FakeJaxArray:
    pass


FakeJaxArray.__module__ = "jaxlib.xla_extension"


@pytest.fixture
def metadata_only(monkeypatch):
    """FakeCupyArray accepted as a CuPy array; any GPU use (CuPy, a kernel) fails the test."""
    real = _validate.array_info

    def array_info(x, name):
        return x.info(name) if isinstance(x, FakeCupyArray) else real(x, name)

    def no_gpu(*args, **kwargs):
        raise AssertionError("the GPU was used before the bad input was rejected")

    monkeypatch.setattr(_validate, "array_info", array_info)
    monkeypatch.setattr(_launch, "cupy", no_gpu)
    monkeypatch.setattr(_launch, "get_kernel", no_gpu)
    monkeypatch.setattr(_launch, "device_arch", no_gpu)  # asks the device


def fakes(b=2, sq=16, sk=24, h=2, d=64, dtype=FP16, layout="bshd", **replace):
    """q, k, v, dout, out, lse of a consistent problem; keyword arguments replace any of them."""
    def shape(s):
        return (b, s, h, d) if layout == "bshd" else (b, h, s, d)

    a = {"q": FakeCupyArray(shape(sq), dtype), "k": FakeCupyArray(shape(sk), dtype), "v": FakeCupyArray(shape(sk), dtype),
         "dout": FakeCupyArray(shape(sq), dtype), "out": FakeCupyArray(shape(sq), dtype),
         "lse": FakeCupyArray((b, h, sq), F32)}
    a.update(replace)
    return a


def fwd(a, **kw):
    return cuflash.attention_forward(a["q"], a["k"], a["v"], **kw)


def att(a, **kw):
    return cuflash.attention(a["q"], a["k"], a["v"], **kw)


def bwd(a, **kw):
    return cuflash.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **kw)


def gap(reason):
    return pytest.mark.xfail(strict=True, reason=reason)


NP_Q = np.zeros((2, 16, 2, 64), np.float16)
F = FakeCupyArray

# (id, call, exception type, message fragments[, marks])
CPU_CASES = [
    # array types: where the data is, and how to convert it
    ("attention-q-numpy", lambda: att(fakes(q=NP_Q)), TypeError, ["q is a numpy.ndarray", "cupy.asarray(q)"]),
    ("forward-k-numpy", lambda: fwd(fakes(k=np.zeros((2, 24, 2, 64), np.float16))), TypeError,
     ["k is a numpy.ndarray", "cupy.asarray(k)"]),
    ("backward-dout-numpy", lambda: bwd(fakes(dout=np.zeros((2, 16, 2, 64), np.float16))), TypeError,
     ["dout is a numpy.ndarray", "cupy.asarray(dout)"]),
    ("backward-lse-numpy", lambda: bwd(fakes(lse=np.zeros((2, 2, 16), np.float32))), TypeError,
     ["lse is a numpy.ndarray", "cupy.asarray(lse)"]),
    ("attention-v-torch", lambda: att(fakes(v=FakeTorchTensor())), TypeError, ["v is a torch.", "cupy.from_dlpack(v)"]),
    ("backward-out-jax", lambda: bwd(fakes(out=FakeJaxArray())), TypeError, ["out is a jaxlib", "cupy.from_dlpack(out)"]),
    ("attention-q-none", lambda: att(fakes(q=None)), TypeError, ["q is a builtins.NoneType", "cupy.ndarray"]),
    ("forward-q-list", lambda: fwd(fakes(q=[[1.0]])), TypeError, ["q is a builtins.list"]),
    # options
    ("attention-causal-str", lambda: att(fakes(), causal="yes"), TypeError, ["causal='yes'", "True or False"]),
    ("backward-causal-int", lambda: bwd(fakes(), causal=1), TypeError, ["causal=1", "True or False"]),
    ("backward-deterministic-str", lambda: bwd(fakes(), deterministic="no"), TypeError, ["deterministic='no'"]),
    ("forward-layout-upper", lambda: fwd(fakes(), layout="BSHD"), ValueError, ["layout='BSHD'", "'bshd'", "'bhsd'"]),
    ("backward-layout-sbhd", lambda: bwd(fakes(), layout="sbhd"), ValueError, ["layout='sbhd'"]),
    # dtypes
    ("attention-all-complex64", lambda: att(fakes(dtype=np.dtype(np.complex64))), TypeError,
     ["q.dtype=complex64", "float16, bfloat16 (ml_dtypes.bfloat16), float32 or float64"]),
    ("forward-k-bf16-q-fp16", lambda: fwd(fakes(k=F((2, 24, 2, 64), BF16))), TypeError,
     ["k.dtype=bfloat16", "q.dtype=float16"]),
    ("attention-v-float64", lambda: att(fakes(v=F((2, 24, 2, 64), np.float64))), TypeError,
     ["v.dtype=float64", "q.dtype=float16"]),
    ("attention-q-int8", lambda: att(fakes(q=F((2, 16, 2, 64), np.int8))), TypeError, ["q.dtype=int8"]),
    ("backward-fp8", lambda: bwd(fakes(d=128, dtype=np.uint8, out=F((2, 16, 2, 128), BF16),
                                       dout=F((2, 16, 2, 128), BF16))), TypeError,
     ["dtype=uint8 is not supported", "FP8 e4m3 inputs, which only the forward takes"]),
    ("backward-dout-float32", lambda: bwd(fakes(dout=F((2, 16, 2, 64), F32))), TypeError,
     ["dout.dtype=float32", "q.dtype=float16"]),
    ("backward-out-bf16", lambda: bwd(fakes(out=F((2, 16, 2, 64), BF16))), TypeError,
     ["out.dtype=bfloat16", "q.dtype=float16"]),
    ("backward-lse-float16", lambda: bwd(fakes(lse=F((2, 2, 16), FP16))), TypeError, ["lse.dtype=float16", "float32"]),
    # ranks, shapes, strides
    ("attention-q-rank3", lambda: att(fakes(q=F((2, 16, 64)))), ValueError, ["q has shape (2, 16, 64)", "rank 3"]),
    ("backward-k-rank5", lambda: bwd(fakes(k=F((2, 24, 2, 1, 64)))), ValueError, ["k has shape (2, 24, 2, 1, 64)", "rank 5"]),
    ("backward-out-rank3", lambda: bwd(fakes(out=F((2, 16, 128)))), ValueError, ["out has shape (2, 16, 128)", "rank 3"]),
    ("forward-q-last-dim-strided", lambda: fwd(fakes(q=F((2, 16, 2, 64), strides=(4096, 256, 128, 2)))), ValueError,
     ["q has strides (4096, 256, 128, 2)", "contiguous (stride 1)"]),
    ("attention-batch-mismatch", lambda: att(fakes(k=F((3, 24, 2, 64)))), ValueError,
     ["k has shape (3, 24, 2, 64)", "batch and head_dim must match"]),
    ("forward-heads-mismatch-bhsd", lambda: fwd(fakes(layout="bhsd", v=F((2, 3, 24, 64))), layout="bhsd"), ValueError,
     ["v has shape (2, 3, 24, 64)", "(bhsd)"]),
    # grouped-query attention: k and v may have fewer heads than q, a divisor of its head count, both alike
    ("attention-heads-q-not-a-multiple-of-heads-kv", lambda: att(fakes(h=4, k=F((2, 24, 3, 64)), v=F((2, 24, 3, 64)))),
     ValueError, ["k has shape (2, 24, 3, 64)", "heads_kv=3", "heads_q=4", "multiple of heads_kv"]),
    ("forward-heads-kv-more-than-q", lambda: fwd(fakes(h=2, k=F((2, 24, 4, 64)), v=F((2, 24, 4, 64)))), ValueError,
     ["heads_kv=4", "heads_q=2", "multiple"]),
    ("backward-v-heads-differ-from-k", lambda: bwd(fakes(h=4, k=F((2, 24, 2, 64)), v=F((2, 24, 1, 64)))), ValueError,
     ["v has shape (2, 24, 1, 64)", "k has (2, 24, 2, 64)", "same number of heads"]),
    ("attention-head-dim-mismatch", lambda: att(fakes(k=F((2, 24, 2, 128)))), ValueError,
     ["k has shape (2, 24, 2, 128)", "head_dim"]),
    ("forward-kv-seqlen-mismatch", lambda: fwd(fakes(v=F((2, 23, 2, 64)))), ValueError,
     ["v has shape (2, 23, 2, 64)", "same seqlen"]),
    ("backward-dout-seqlen", lambda: bwd(fakes(dout=F((2, 17, 2, 64)))), ValueError,
     ["dout has shape (2, 17, 2, 64)", "shape of q"]),
    ("backward-out-heads", lambda: bwd(fakes(out=F((2, 16, 3, 64)))), ValueError,
     ["out has shape (2, 16, 3, 64)", "shape of q"]),
    ("backward-lse-shape-bsh", lambda: bwd(fakes(lse=F((2, 16, 2), F32))), ValueError,
     ["lse has shape (2, 16, 2)", "(batch, heads, seqlen_q) = (2, 2, 16)"]),
    ("backward-lse-rank2", lambda: bwd(fakes(lse=F((2, 16), F32))), ValueError, ["lse has shape (2, 16)"]),
    ("backward-lse-half-element-strides", lambda: bwd(fakes(lse=F((2, 2, 16), F32, strides=(32, 16, 0.5)))),
     ValueError, ["lse has strides (32, 16, 0.5)", "not whole elements"]),
    # out-of-range values
    ("attention-head-dim-4", lambda: att(fakes(d=4)), ValueError, ["head_dim=4", "last dim of q", "multiple of 8"]),
    ("forward-head-dim-12", lambda: fwd(fakes(d=12)), ValueError, ["head_dim=12", "multiple of 8"]),
    ("backward-head-dim-264", lambda: bwd(fakes(d=264)), ValueError, ["head_dim=264", "256"]),
    ("attention-scale-zero", lambda: att(fakes(), softmax_scale=0), ValueError, ["softmax_scale=0", "> 0"]),
    ("forward-scale-negative", lambda: fwd(fakes(), softmax_scale=-0.125), ValueError, ["softmax_scale=-0.125"]),
    ("backward-scale-nan", lambda: bwd(fakes(), softmax_scale=math.nan), ValueError, ["softmax_scale=nan", "finite"]),
    ("attention-scale-inf", lambda: att(fakes(), softmax_scale=math.inf), ValueError, ["softmax_scale=inf", "finite"]),
    ("forward-scale-str", lambda: fwd(fakes(), softmax_scale="0.1"), TypeError, ["softmax_scale='0.1'", "real number"]),
    ("backward-scale-bool", lambda: bwd(fakes(), softmax_scale=True), TypeError, ["softmax_scale=True"]),
    ("attention-scale-complex", lambda: att(fakes(), softmax_scale=0.5j), TypeError, ["softmax_scale=0.5j"]),
    # devices
    ("attention-k-device-1", lambda: att(fakes(k=F((2, 24, 2, 64), device=1))), ValueError,
     ["k is on device 1", "q is on device 0"]),
    ("backward-lse-device-1", lambda: bwd(fakes(lse=F((2, 2, 16), F32, device=1))), ValueError,
     ["lse is on device 1", "q is on device 0"]),
    # limits of the float32 scale and of the grid
    ("attention-scale-overflows-fp32", lambda: att(fakes(), softmax_scale=1e39), ValueError, ["softmax_scale=1e+39"],
),
    ("attention-batch-65536", lambda: att(fakes(b=65536, sq=1, sk=1, h=1, d=8)), ValueError, ["batch=65536", "65535"],
),
    ("forward-heads-65536", lambda: fwd(fakes(b=1, sq=1, sk=1, h=65536, d=8)), ValueError, ["heads=65536", "65535"],
),
    # bias, masks, dbias (scores (batch 2, heads 2, seqlen_q 16, seqlen_k 24))
    ("forward-bias-numpy", lambda: fwd(fakes(), bias=np.zeros((16, 24), np.float32)), TypeError,
     ["bias is a numpy.ndarray", "cupy.asarray(bias)"]),
    ("attention-bias-rank5", lambda: att(fakes(), bias=F((1, 2, 2, 16, 24), F32)), ValueError,
     ["bias has shape (1, 2, 2, 16, 24)", "2 to 4 dims", "(2, 2, 16, 24)"]),
    ("attention-bias-rank1", lambda: att(fakes(), bias=F((24,), F32)), ValueError, ["bias has shape (24,)", "2 to 4"]),
    ("forward-bias-seqlen-k", lambda: fwd(fakes(), bias=F((2, 2, 16, 23), FP16)), ValueError,
     ["bias has shape (2, 2, 16, 23)", "seqlen_k dim (size 23)", "1 or 24"]),
    ("forward-bias-seqlen-q", lambda: fwd(fakes(), bias=F((2, 8, 24), FP16)), ValueError,
     ["bias has shape (2, 8, 24)", "seqlen_q dim (size 8)", "1 or 16"]),
    ("attention-bias-batch-not-a-divisor", lambda: att(fakes(b=4), bias=F((3, 2, 16, 24), F32)), ValueError,
     ["bias has shape (3, 2, 16, 24)", "batch dim (size 3)", "divisor of 4"]),
    ("attention-bias-heads-not-a-divisor", lambda: att(fakes(h=4), bias=F((1, 3, 16, 24), F32)), ValueError,
     ["heads dim (size 3)", "divisor of 4"]),
    ("forward-bias-float64", lambda: fwd(fakes(), bias=F((16, 24), np.float64)), TypeError,
     ["bias.dtype=float64", "float16 (the dtype of q) or float32"]),
    ("forward-bias-bf16-q-fp16", lambda: fwd(fakes(), bias=F((16, 24), BF16)), TypeError, ["bias.dtype=bfloat16"]),
    ("attention-bias-device-1", lambda: att(fakes(), bias=F((16, 24), F32, device=1)), ValueError,
     ["bias is on device 1", "q is on device 0"]),
    ("attention-bias-half-element-strides", lambda: att(fakes(), bias=F((16, 24), F32, strides=(24, 0.5))), ValueError,
     ["bias has strides (24, 0.5)", "whole elements"]),
    ("forward-mask-uint8", lambda: fwd(fakes(), mask=F((16, 24), np.uint8)), TypeError,
     ["mask.dtype=uint8", "must be bool"]),
    ("attention-mask-shape", lambda: att(fakes(), mask=F((2, 2, 15, 24), np.bool_)), ValueError,
     ["mask has shape (2, 2, 15, 24)", "seqlen_q dim (size 15)"]),
    ("forward-key-padding-mask-shape", lambda: fwd(fakes(), key_padding_mask=F((2, 16), np.bool_)), ValueError,
     ["key_padding_mask has shape (2, 16)", "(batch, seqlen_k) = (2, 24)"]),
    ("attention-key-padding-mask-float", lambda: att(fakes(), key_padding_mask=F((2, 24), F32)), TypeError,
     ["key_padding_mask.dtype=float32", "must be bool"]),
    ("backward-bias-shape", lambda: bwd(fakes(), bias=F((2, 3, 16, 24), F32)), ValueError,
     ["bias has shape (2, 3, 16, 24)", "heads dim (size 3)"]),
    ("backward-dbias-without-bias", lambda: bwd(fakes(), dbias=True), ValueError, ["dbias needs bias="]),
    ("backward-dbias-float16", lambda: bwd(fakes(), bias=F((2, 2, 16, 24), FP16), dbias=F((2, 2, 16, 24), FP16)),
     TypeError, ["dbias.dtype=float16", "must be float32"]),
    ("backward-dbias-shape", lambda: bwd(fakes(), bias=F((1, 2, 16, 24), F32), dbias=F((2, 2, 16, 24), F32)),
     ValueError, ["dbias has shape (2, 2, 16, 24)", "shape of bias: (1, 2, 16, 24)"]),
    ("backward-dbias-broadcast-view", lambda: bwd(fakes(), bias=F((2, 16, 24), F32),
                                                   dbias=F((2, 16, 24), F32, strides=(0, 24, 1))), ValueError,
     ["dbias has strides (0, 24, 1)", "broadcast view"]),
    ("backward-dbias-device-1", lambda: bwd(fakes(), bias=F((16, 24), F32), dbias=F((16, 24), F32, device=1)),
     ValueError, ["dbias is on device 1"]),
    ("backward-dbias-deterministic-broadcast", lambda: bwd(fakes(), bias=F((16, 24), F32), dbias=True,
                                                           deterministic=True), ValueError,
     ["deterministic=True with dbias of a broadcast bias", "(16, 24)", "(2, 2, 16, 24)"]),
    ("forward-bias-slice-over-2gb", lambda: fwd(fakes(sq=32768, sk=32768, b=1, h=1), bias=F((32768, 32768), F32)),
     ValueError, ["bias: one (batch, head) slice of shape (32768, 32768)", "32-bit offsets"]),
    ("backward-dbias-slice-over-2gb", lambda: bwd(fakes(sq=32768, sk=32768, b=1, h=1), bias=F((32768, 32768), FP16),
                                                  dbias=True), ValueError,
     ["dbias: one (batch, head) slice of shape (32768, 32768)", "32-bit offsets"]),
    ("backward-dbias-numpy", lambda: bwd(fakes(), bias=F((16, 24), F32), dbias=np.zeros((16, 24), np.float32)),
     TypeError, ["dbias is a numpy.ndarray"]),
]


def _params(cases):
    return [pytest.param(*c[1:4], id=c[0], marks=c[4] if len(c) > 4 else ()) for c in cases]


@pytest.mark.usefixtures("metadata_only")
@pytest.mark.parametrize("call,exc,parts", _params(CPU_CASES))
def test_bad_call_is_rejected_before_the_gpu(call, exc, parts):
    before = NP_Q.copy()
    with pytest.raises(exc) as e:
        call()
    msg = str(e.value)
    missing = [p for p in parts if p not in msg]
    assert not missing, f"message lacks {missing}: {msg!r}"
    assert np.array_equal(NP_Q, before), "a NumPy argument was modified"


@pytest.mark.usefixtures("metadata_only")
def test_numpy_arguments_are_not_modified():
    """A call that is rejected never writes into the arrays it was given (NumPy here, CuPy in the GPU part)."""
    q, k = np.random.default_rng(0).standard_normal((2, 2, 16, 2, 64)).astype(np.float16)
    q0, k0 = q.copy(), k.copy()
    with pytest.raises(TypeError):
        cuflash.attention(q, k, k)
    with pytest.raises(TypeError):
        cuflash.attention_backward(q, q, k, k, q, np.zeros((2, 2, 16), np.float32))
    assert np.array_equal(q, q0) and np.array_equal(k, k0)


@pytest.mark.usefixtures("metadata_only")
def test_valid_metadata_reaches_the_gpu():
    """The fakes themselves are valid: without a defect the call gets past validation (to the patched GPU)."""
    gqa = dict(h=8, k=F((2, 24, 2, 64)), v=F((2, 24, 2, 64)))  # 8 query heads over 2 key/value heads
    for call in (lambda: att(fakes()), lambda: fwd(fakes(layout="bhsd"), layout="bhsd"), lambda: bwd(fakes()),
                 lambda: bwd(fakes(dtype=BF16), causal=True, deterministic=True, softmax_scale=0.1),
                 lambda: att(fakes(**gqa)), lambda: bwd(fakes(**gqa)),
                 lambda: att(fakes(b=4), bias=F((2, 2, 16, 24), FP16), mask=F((4, 1, 1, 24), np.bool_)),
                 lambda: fwd(fakes(), bias=F((16, 24), F32), key_padding_mask=F((2, 24), np.bool_)),
                 lambda: bwd(fakes(), bias=F((2, 1, 16, 24), F32), dbias=True),
                 lambda: bwd(fakes(), bias=F((2, 2, 16, 24), F32), dbias=F((2, 2, 16, 24), F32), deterministic=True)):
        with pytest.raises(AssertionError, match="the GPU was used"):
            call()


# --- GPU part: real CuPy arrays inside poisoned buffers -----------------------------------------------------

def gpu_arrays(b=2, sq=16, sk=24, h=2, d=64, dtype="fp16", layout="bshd"):
    """Guarded q, k, v, dout, out (random, fp16/bf16) and lse (float32), keyed by name."""
    import cupy as cp

    from gpu_helpers import randn, seed_of
    from reliability_helpers import guarded, lowp_dtype

    def shape(s):
        return (b, s, h, d) if layout == "bshd" else (b, h, s, d)

    g = {}
    for i, (name, s) in enumerate((("q", sq), ("k", sk), ("v", sk), ("dout", sq), ("out", sq))):
        g[name] = guarded(shape(s), lowp_dtype(dtype), randn(shape(s), dtype, seed_of("bad-input", name, i)))
    lse = cp.random.RandomState(7).standard_normal((b, h, sq), dtype=cp.float32)
    g["lse"] = guarded(lse.shape, lse.dtype, lse)
    return g


def new(g, name, shape, dtype, *, values=True, **placement):
    """Add a guarded array `name` to g (random values, or poison only for outputs)."""
    import cupy as cp

    from gpu_helpers import randn, seed_of
    from reliability_helpers import guarded

    dtype = np.dtype(dtype)
    data = None
    if values:
        if dtype in (FP16, BF16):
            data = randn(shape, "fp16" if dtype == FP16 else "bf16", seed_of("bad-input-new", name))
        else:
            data = cp.random.RandomState(3).standard_normal(shape).astype(dtype)
    g[name] = guarded(shape, dtype, data, **placement)


def V(g):  # noqa: N802 - the views, by name
    return {name: x.view for name, x in g.items()}


def gfwd(g, q="q", k="k", v="v", **kw):
    a = V(g)
    return cuflash.attention_forward(a[q], a[k], a[v], **kw)


def gbwd(g, dout="dout", q="q", k="k", v="v", out="out", lse="lse", **kw):
    a = V(g)
    return cuflash.attention_backward(a[dout], a[q], a[k], a[v], a[out], a[lse], **kw)


def _none(g):
    pass


# (id, gpu_arrays kwargs, build(g): add arrays, call(g), exception type, message fragments[, marks])
GPU_CASES = [
    ("gpu-attention-q-float32", {}, lambda g: new(g, "q32", (2, 16, 2, 64), F32),
     lambda g: cuflash.attention(V(g)["q32"], V(g)["k"], V(g)["v"]), TypeError,
     ["k.dtype=float16 differs from q.dtype=float32"]),
    ("gpu-forward-k-bf16", {}, lambda g: new(g, "kb", (2, 24, 2, 64), BF16),
     lambda g: gfwd(g, k="kb"), TypeError, ["k.dtype=bfloat16", "q.dtype=float16"]),
    ("gpu-attention-q-last-dim-strided", {}, lambda g: new(g, "wide", (2, 16, 2, 128), FP16),
     lambda g: cuflash.attention(V(g)["wide"][..., ::2], V(g)["k"], V(g)["v"]), ValueError, ["q has strides", "contiguous"]),
    ("gpu-forward-head-dim-12", {"d": 12}, _none, gfwd, ValueError, ["head_dim=12", "multiple of 8"]),
    ("gpu-attention-q-rank3", {}, _none, lambda g: cuflash.attention(V(g)["q"][0], V(g)["k"], V(g)["v"]), ValueError,
     ["q has shape (16, 2, 64)", "rank 3"]),
    ("gpu-forward-bshd-arrays-as-bhsd", {}, _none, lambda g: gfwd(g, layout="bhsd"), ValueError,
     ["k has shape (2, 24, 2, 64)", "(bhsd)"]),
    ("gpu-attention-scale-negative", {}, _none, lambda g: gfwd(g, softmax_scale=-1.0), ValueError, ["softmax_scale=-1.0"]),
    ("gpu-forward-kv-seqlen", {}, lambda g: new(g, "v23", (2, 23, 2, 64), FP16),
     lambda g: gfwd(g, v="v23"), ValueError, ["v has shape (2, 23, 2, 64)", "same seqlen"]),
    ("gpu-backward-deterministic-none", {}, _none, lambda g: gbwd(g, deterministic=None), TypeError,
     ["deterministic=None"]),
    ("gpu-backward-lse-float64", {}, lambda g: new(g, "lse64", (2, 2, 16), np.float64),
     lambda g: gbwd(g, lse="lse64"), TypeError, ["lse.dtype=float64", "float32"]),
    ("gpu-backward-lse-bsh", {}, lambda g: new(g, "lse_bsh", (2, 16, 2), F32),
     lambda g: gbwd(g, lse="lse_bsh"), ValueError, ["lse has shape (2, 16, 2)", "(2, 2, 16)"]),
    ("gpu-backward-out-float32", {}, lambda g: new(g, "o32", (2, 16, 2, 64), F32),
     lambda g: gbwd(g, out="o32"), TypeError, ["out.dtype=float32", "q.dtype=float16"]),
    ("gpu-backward-dout-seqlen", {}, lambda g: new(g, "do17", (2, 17, 2, 64), FP16),
     lambda g: gbwd(g, dout="do17"), ValueError, ["dout has shape (2, 17, 2, 64)", "shape of q"]),
    # preallocated outputs
    ("gpu-backward-dq-wrong-shape", {}, lambda g: new(g, "dq", (2, 17, 2, 64), FP16, values=False),
     lambda g: gbwd(g, dq=V(g)["dq"]), ValueError, ["dq has shape (2, 17, 2, 64)", "shape of q"]),
    ("gpu-backward-dk-bf16", {}, lambda g: new(g, "dk", (2, 24, 2, 64), BF16, values=False),
     lambda g: gbwd(g, dk=V(g)["dk"]), TypeError, ["dk.dtype=bfloat16", "must be float16"]),
    ("gpu-backward-dv-float32", {}, lambda g: new(g, "dv", (2, 24, 2, 64), F32, values=False),
     lambda g: gbwd(g, dv=V(g)["dv"]), TypeError, ["dv.dtype=float32", "must be float16"]),
    ("gpu-backward-dv-misaligned", {},
     lambda g: new(g, "dv", (2, 24, 2, 64), FP16, values=False, before=(1, 1, 1, 4), after=(2, 2, 2, 4)),
     lambda g: gbwd(g, dv=V(g)["dv"]), ValueError, ["dv (preallocated) must be 16-byte aligned"]),
    ("gpu-backward-dq-last-dim-strided", {}, lambda g: new(g, "wide", (2, 16, 2, 128), FP16, values=False),
     lambda g: gbwd(g, dq=V(g)["wide"][..., ::2]), ValueError, ["dq has strides", "contiguous"]),
    ("gpu-backward-dq-numpy", {}, _none, lambda g: gbwd(g, dq=np.zeros((2, 16, 2, 64), np.float16)), TypeError,
     ["dq is a numpy.ndarray", "cupy.asarray(dq)"]),
    # preallocated outputs aliasing an input
    ("gpu-backward-dq-is-q", {}, _none, lambda g: gbwd(g, dq=V(g)["q"]), ValueError,
     ["dq (preallocated) overlaps the memory of q", "must not alias"]),
    ("gpu-backward-dk-is-v", {}, _none, lambda g: gbwd(g, dk=V(g)["v"]), ValueError,
     ["dk (preallocated) overlaps the memory of v"]),
    ("gpu-backward-dv-is-dout", {"sk": 16}, _none, lambda g: gbwd(g, dv=V(g)["dout"]), ValueError,
     ["dv (preallocated) overlaps the memory of dout"]),
    ("gpu-backward-dq-is-out", {}, _none, lambda g: gbwd(g, dq=V(g)["out"]), ValueError,
     ["dq (preallocated) overlaps the memory of out"]),
    # q and dq interleaved in one buffer (columns 0-63 and 64-127): no element is shared, but the address
    # ranges overlap, and the check is on address ranges: rejected (conservative)
    ("gpu-backward-dq-interleaved-with-q", {}, lambda g: new(g, "wide", (2, 16, 2, 128), FP16),
     lambda g: cuflash.attention_backward(V(g)["dout"], V(g)["wide"][..., :64], V(g)["k"], V(g)["v"], V(g)["out"],
                                          V(g)["lse"], dq=V(g)["wide"][..., 64:]), ValueError,
     ["dq (preallocated) overlaps the memory of q"]),
    # preallocated outputs must not overlap each other either
    ("gpu-backward-dq-is-dk", {"sk": 16}, lambda g: new(g, "grad", (2, 16, 2, 64), FP16, values=False),
     lambda g: gbwd(g, dq=V(g)["grad"], dk=V(g)["grad"]), ValueError, ["overlaps"],
),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs,build,call,exc,parts",
                         [pytest.param(*c[1:6], id=c[0], marks=c[6] if len(c) > 6 else ()) for c in GPU_CASES])
def test_bad_call_on_the_gpu_is_rejected_and_changes_nothing(kwargs, build, call, exc, parts):
    g = gpu_arrays(**kwargs)
    build(g)
    snaps = {name: x.snapshot() for name, x in g.items()}
    with pytest.raises(exc) as e:
        call(g)
    msg = str(e.value)
    missing = [p for p in parts if p not in msg]
    assert not missing, f"message lacks {missing}: {msg!r}"
    changed = [name for name, x in g.items() if not x.unchanged(snaps[name])]
    assert not changed, f"arrays changed by a rejected call: {changed}"


def test_the_table_has_at_least_30_bad_calls():
    expected_to_raise = [c for c in CPU_CASES + GPU_CASES if not isinstance(c[-1], pytest.MarkDecorator)]
    assert len(expected_to_raise) >= 30, len(expected_to_raise)
    ids = [c[0] for c in CPU_CASES + GPU_CASES]
    assert len(ids) == len(set(ids)), "duplicate ids"


@pytest.mark.usefixtures("metadata_only")
def test_deterministic_window_bias_at_d256_is_refused_before_sm90(monkeypatch):
    """sm_80-sm_89 have no deterministic dQ kernel for a window with a bias or mask at head dim 256 (it spilled):
    the call says so before anything is allocated or launched; sm_90a has it, and other combinations pass."""
    monkeypatch.setattr(_launch, "device_arch", lambda device: "sm_80")
    a = fakes(d=256)
    bias = F((2, 2, 16, 24), F32)
    with pytest.raises(ValueError, match=r"deterministic=True with a sliding window and a bias or mask at "
                                         r"head_dim=256 is not available on sm_80"):
        bwd(a, bias=bias, window=(4, 4), deterministic=True)
    for kw in ({"bias": bias, "window": (4, 4)}, {"bias": bias, "deterministic": True},
               {"window": (4, 4), "deterministic": True}):
        with pytest.raises(AssertionError, match="the GPU was used"):
            bwd(a, **kw)
    monkeypatch.setattr(_launch, "device_arch", lambda device: "sm_90a")
    with pytest.raises(AssertionError, match="the GPU was used"):
        bwd(a, bias=bias, window=(4, 4), deterministic=True)


# --- FP8 inputs: metadata only ---------------------------------------------------------------------------------

U8 = np.dtype(np.uint8)


@pytest.fixture
def fp8_metadata_only(metadata_only, monkeypatch):
    """metadata_only, with FakeCupyArray uint8 arrays taken as FP8 (e4m3 bits) like CuPy uint8 arrays."""
    from cuflash import _fp8

    real = _fp8.is_fp8
    monkeypatch.setattr(_fp8, "is_fp8", lambda x: (isinstance(x, FakeCupyArray) and x.dtype == U8) or real(x))


def fp8_fakes(**replace):
    return fakes(d=128, dtype=U8, **replace)


# (id, call, exception type, message fragments): each rejected before any GPU use, even where an earlier descale
# is a number (put on the GPU only at the launch)
FP8_CPU_CASES = [
    ("fp8-q-descale-nan", lambda: att(fp8_fakes(), q_descale=float("nan")), ValueError,
     ["q_descale=nan", "finite and > 0"]),
    ("fp8-k-descale-inf", lambda: att(fp8_fakes(), q_descale=0.5, k_descale=math.inf), ValueError,
     ["k_descale=inf", "finite and > 0"]),
    ("fp8-v-descale-zero", lambda: fwd(fp8_fakes(), v_descale=0.0), ValueError, ["v_descale=0.0", "finite and > 0"]),
    ("fp8-k-bf16", lambda: att(fp8_fakes(k=F((2, 24, 2, 128), BF16))), TypeError,
     ["k.dtype=bfloat16", "FP8 attention takes q, k and v as CuPy uint8"]),
    ("fp8-k-descale-shape", lambda: att(fp8_fakes(), k_descale=F((2, 3), F32)), ValueError,
     ["k_descale has shape (2, 3)", "(batch, heads_kv) = (2, 2)"]),
    ("fp8-q-descale-blocks", lambda: att(fp8_fakes(), q_descale=F((2, 2, 2), F32)), ValueError,
     ["q_descale has shape (2, 2, 2)", "ceil(seqlen / 128)) = (2, 2, 1)"]),
    ("fp8-v-descale-float64", lambda: att(fp8_fakes(), v_descale=F((2, 2), np.float64)), TypeError,
     ["v_descale.dtype=float64"]),
    ("fp8-descale-other-device", lambda: att(fp8_fakes(), q_descale=F((2, 2), F32, device=1)), ValueError,
     ["q_descale is on device 1", "q is on device 0"]),
    ("fp8-alibi", lambda: att(fp8_fakes(), alibi_slopes=F((2,), F32)), ValueError,
     ["alibi_slopes", "not supported with FP8 inputs"]),
    ("fp8-head-dim-96", lambda: att(fakes(d=96, dtype=U8)), ValueError, ["head_dim=96", "not supported for FP8"]),
    ("fp8-out-dtype", lambda: att(fp8_fakes(), out_dtype="float32"), ValueError,
     ["out_dtype='float32'", "'bf16'", "'fp16'"]),
    ("bf16-with-descale", lambda: att(fakes(dtype=BF16), k_descale=0.5), ValueError,
     ["k_descale applies to FP8 inputs only"]),
]


@pytest.mark.usefixtures("fp8_metadata_only")
@pytest.mark.parametrize("call,exc,parts", _params(FP8_CPU_CASES))
def test_bad_fp8_call_is_rejected_before_the_gpu(call, exc, parts):
    with pytest.raises(exc) as e:
        call()
    msg = str(e.value)
    missing = [p for p in parts if p not in msg]
    assert not missing, f"message lacks {missing}: {msg!r}"


@pytest.mark.usefixtures("fp8_metadata_only")
@pytest.mark.parametrize("arch,kernels,why", [("sm_80", "auto", "this GPU is sm_80"),
                                              ("sm_89", "auto", "this GPU is sm_89"),
                                              ("sm_90a", "mma", "CUFLASH_KERNELS=mma turns them off")])
def test_fp8_where_its_kernels_do_not_run_is_refused_before_the_gpu(monkeypatch, arch, kernels, why):
    """FP8 inputs run on the Hopper FP8 kernels only: on another GPU, or with CUFLASH_KERNELS=mma, the call says so
    after the argument checks and before anything is allocated; dense and packed. On sm_90a with the default kernels
    the call goes on (and here reaches the fake GPU)."""
    from cuflash import config

    monkeypatch.setattr(_launch, "device_arch", lambda device: arch)
    monkeypatch.setattr(config, "KERNELS", kernels)
    a = fp8_fakes()
    packed = [FakeCupyArray((48, 2, 128), U8) for _ in range(3)]
    cu = FakeCupyArray((3,), np.int32)
    calls = (lambda: att(a), lambda: fwd(a, q_descale=0.5),
             lambda: cuflash.attention_varlen_forward(*packed, cu, cu, 24, 24, check_inputs=False))
    for call in calls:
        with pytest.raises(TypeError) as e:
            call()
        assert "q.dtype=uint8" in str(e.value) and why in str(e.value), str(e.value)
    # an argument error still comes first
    with pytest.raises(ValueError, match="v_descale=0.0"):
        fwd(a, v_descale=0.0)
    monkeypatch.setattr(_launch, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(config, "KERNELS", "auto")
    for call in calls:
        with pytest.raises(AssertionError, match="the GPU was used"):
            call()
