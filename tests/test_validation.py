"""Bad input gets a clear error before any launch: the exception type, and a message that names the argument
and its value. Runs on array metadata (ArrayInfo), so no GPU is needed."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _validate as V
from cuflash._validate import ArrayInfo

FP16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)


def info(name, shape, dtype=FP16, strides=None, ptr=0, device=0) -> ArrayInfo:
    """Metadata of a hypothetical CuPy array; C-contiguous strides (in elements) unless given."""
    if strides is None:
        strides, step = [], 1
        for n in reversed(shape):
            strides.insert(0, step)
            step *= max(n, 1)
    return ArrayInfo(name, tuple(shape), np.dtype(dtype), tuple(strides), ptr, device)


def qkv(q_shape=(2, 16, 4, 64), k_shape=(2, 32, 4, 64), v_shape=None, **kw):
    """q, k, v ArrayInfos with per-array overrides: kw like q_dtype=..., k_device=..., v_strides=..."""
    v_shape = k_shape if v_shape is None else v_shape
    out = []
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        extra = {key[2:]: val for key, val in kw.items() if key.startswith(name + "_")}
        out.append(info(name, shape, **extra))
    return out


def check_qkv(layout="bshd", **kw):
    return V.check_qkv(*qkv(**kw), layout)


class FakeTorchTensor:
    """Looks like a torch.Tensor to a type check: its type's __module__ is 'torch'."""


FakeTorchTensor.__module__ = "torch"


class FakeJaxArray:
    pass


FakeJaxArray.__module__ = "jaxlib.xla_extension"

# (id, call, exception type, substrings the message must contain: the argument, its value, the fix)
BAD_INPUTS = [
    ("numpy-q", lambda: V.array_info(np.zeros((1, 8, 2, 64), np.float16), "q"), TypeError,
     ["q", "numpy.ndarray", "cupy.asarray(q)"]),
    ("numpy-v", lambda: V.array_info(np.zeros((1, 8, 2, 64), np.float16), "v"), TypeError,
     ["v", "cupy.asarray(v)"]),
    ("torch-k", lambda: V.array_info(FakeTorchTensor(), "k"), TypeError,
     ["k", "torch.FakeTorchTensor", "cupy.from_dlpack(k)"]),
    ("jax-q", lambda: V.array_info(FakeJaxArray(), "q"), TypeError, ["q", "jaxlib", "cupy.from_dlpack(q)"]),
    ("list-q", lambda: V.array_info([[1.0]], "q"), TypeError, ["q", "builtins.list", "cupy"]),
    ("rank3-q", lambda: check_qkv(q_shape=(2, 16, 64)), ValueError, ["q", "(2, 16, 64)", "rank 3", "rank 4"]),
    ("rank5-k", lambda: check_qkv(k_shape=(2, 32, 4, 1, 64)), ValueError, ["k", "(2, 32, 4, 1, 64)", "rank 5"]),
    ("rank2-v-bhsd", lambda: check_qkv(layout="bhsd", q_shape=(2, 4, 16, 64), k_shape=(2, 4, 32, 64),
                                       v_shape=(32, 64)), ValueError,
     ["v", "(32, 64)", "(batch, heads, seqlen, head_dim)"]),
    ("dtype-complex64", lambda: check_qkv(q_dtype=np.complex64, k_dtype=np.complex64, v_dtype=np.complex64),
     TypeError, ["q.dtype=complex64", "float16", "bfloat16", "float32", "float64"]),
    ("dtype-int8", lambda: check_qkv(q_dtype=np.int8), TypeError, ["q.dtype=int8"]),
    ("dtype-mixed-k-float64", lambda: check_qkv(k_dtype=np.float64), TypeError,
     ["k.dtype=float64", "q.dtype=float16"]),
    ("dtype-mixed-v-bf16", lambda: check_qkv(v_dtype=BF16), TypeError, ["v.dtype=bfloat16", "q.dtype=float16"]),
    ("dtype-mixed-k-fp16-vs-bf16", lambda: check_qkv(q_dtype=BF16, v_dtype=BF16), TypeError,
     ["k.dtype=float16", "q.dtype=bfloat16"]),
    ("batch-mismatch-k", lambda: check_qkv(k_shape=(3, 32, 4, 64)), ValueError, ["k", "(3, 32, 4, 64)", "batch"]),
    ("heads-mismatch-v", lambda: check_qkv(v_shape=(2, 32, 8, 64)), ValueError, ["v", "(2, 32, 8, 64)", "heads"]),
    # grouped-query attention: heads_q must be a positive multiple of heads_kv, and v must have k's heads
    ("gqa-heads-q-not-multiple", lambda: check_qkv(q_shape=(2, 16, 6, 64), k_shape=(2, 32, 4, 64)), ValueError,
     ["k has shape (2, 32, 4, 64)", "heads_kv=4", "heads_q=6", "heads_q must be a positive multiple of heads_kv"]),
    ("gqa-heads-kv-zero", lambda: check_qkv(q_shape=(2, 16, 4, 64), k_shape=(2, 32, 0, 64)), ValueError,
     ["heads_kv=0", "heads_q=4"]),
    ("gqa-heads-q-zero", lambda: check_qkv(q_shape=(2, 16, 0, 64), k_shape=(2, 32, 2, 64)), ValueError,
     ["heads_kv=2", "heads_q=0"]),
    ("gqa-v-heads-differ", lambda: check_qkv(q_shape=(2, 16, 8, 64), k_shape=(2, 32, 2, 64), v_shape=(2, 32, 4, 64)),
     ValueError, ["v has shape (2, 32, 4, 64)", "k has (2, 32, 2, 64)", "same number of heads"]),
    ("gqa-bhsd-heads-q-not-multiple", lambda: check_qkv(layout="bhsd", q_shape=(2, 4, 16, 64), k_shape=(2, 3, 32, 64)),
     ValueError, ["k has shape (2, 3, 32, 64) (bhsd)", "heads_kv=3", "heads_q=4"]),
    ("head-dim-mismatch-k", lambda: check_qkv(k_shape=(2, 32, 4, 128), v_shape=(2, 32, 4, 64)), ValueError,
     ["k", "(2, 32, 4, 128)", "head_dim"]),
    ("seqlen-k-vs-v", lambda: check_qkv(v_shape=(2, 31, 4, 64)), ValueError, ["v", "(2, 31, 4, 64)", "seqlen"]),
    ("bhsd-heads-mismatch", lambda: check_qkv(layout="bhsd", q_shape=(2, 4, 16, 64), k_shape=(2, 5, 32, 64)),
     ValueError, ["k", "(2, 5, 32, 64)"]),
    ("head-dim-4", lambda: check_qkv(q_shape=(2, 16, 4, 4), k_shape=(2, 32, 4, 4)), ValueError, ["head_dim=4", "q"]),
    ("head-dim-12", lambda: check_qkv(q_shape=(2, 16, 4, 12), k_shape=(2, 32, 4, 12)), ValueError,
     ["head_dim=12", "multiple of 8"]),
    ("head-dim-264", lambda: check_qkv(q_shape=(2, 16, 4, 264), k_shape=(2, 32, 4, 264)), ValueError,
     ["head_dim=264", "256"]),
    ("head-dim-0", lambda: V.check_head_dim(0, "q"), ValueError, ["head_dim=0"]),
    ("last-dim-strided-q", lambda: check_qkv(q_strides=(16 * 4 * 128, 4 * 128, 128, 2)), ValueError,
     ["q", "(8192, 512, 128, 2)", "contiguous"]),
    ("last-dim-strided-v", lambda: check_qkv(v_strides=(1, 2, 64, 128)), ValueError,
     ["v", "(1, 2, 64, 128)", "contiguous"]),
    ("device-k", lambda: check_qkv(k_device=1), ValueError, ["k", "device 1", "device 0"]),
    ("device-v", lambda: check_qkv(v_device=2), ValueError, ["v", "device 2", "device 0"]),
    ("layout-upper", lambda: check_qkv(layout="BSHD"), ValueError, ["layout='BSHD'", "'bshd'", "'bhsd'"]),
    ("layout-sbhd", lambda: V.check_layout("sbhd"), ValueError, ["layout='sbhd'"]),
    ("layout-none", lambda: V.check_layout(None), ValueError, ["layout=None"]),
    ("scale-nan", lambda: V.check_softmax_scale(float("nan"), 64), ValueError, ["softmax_scale=nan", "finite"]),
    ("scale-inf", lambda: V.check_softmax_scale(math.inf, 64), ValueError, ["softmax_scale=inf"]),
    ("scale-neg-inf", lambda: V.check_softmax_scale(-math.inf, 64), ValueError, ["softmax_scale=-inf"]),
    ("scale-zero", lambda: V.check_softmax_scale(0, 64), ValueError, ["softmax_scale=0", "> 0"]),
    ("scale-minus-one", lambda: V.check_softmax_scale(-1, 64), ValueError, ["softmax_scale=-1", "> 0"]),
    ("scale-str", lambda: V.check_softmax_scale("a", 64), TypeError, ["softmax_scale='a'"]),
    ("scale-bool", lambda: V.check_softmax_scale(True, 64), TypeError, ["softmax_scale=True"]),
    ("scale-complex", lambda: V.check_softmax_scale(1j, 64), TypeError, ["softmax_scale=1j"]),
    ("causal-str", lambda: V.check_flag("yes", "causal"), TypeError, ["causal='yes'", "True or False"]),
    ("causal-int", lambda: V.check_flag(1, "causal"), TypeError, ["causal=1"]),
    ("causal-none", lambda: V.check_flag(None, "causal"), TypeError, ["causal=None"]),
    # the public API reports the same errors before touching the GPU
    ("api-numpy-q", lambda: cuflash.attention(*(np.ones((1, 8, 2, 64), np.float16),) * 3), TypeError,
     ["q", "cupy.asarray(q)"]),
    ("api-forward-causal-str", lambda: cuflash.attention_forward(*(np.ones((1, 8, 2, 64), np.float16),) * 3,
                                                                 causal="yes"), TypeError, ["causal='yes'"]),
]


@pytest.mark.parametrize("call,exc,parts", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_rejected_with_a_clear_message(call, exc, parts):
    with pytest.raises(exc) as e:
        call()
    msg = str(e.value)
    missing = [p for p in parts if p not in msg]
    assert not missing, f"message lacks {missing}: {msg!r}"


def test_there_are_at_least_25_bad_input_cases():
    assert len(BAD_INPUTS) >= 25


@pytest.mark.parametrize("head_dim", [8, 16, 32, 40, 64, 72, 96, 128, 136, 192, 200, 256])
def test_head_dims_that_are_multiples_of_8_up_to_256_are_accepted(head_dim):
    dtype, dq, dk, dv = check_qkv(q_shape=(2, 16, 4, head_dim), k_shape=(2, 32, 4, head_dim))
    assert (dtype, dq.head_dim, dk.seqlen, dv.seqlen) == ("fp16", head_dim, 32, 32)


def test_bhsd_reads_batch_seqlen_heads_and_strides():
    q, k, v = qkv(q_shape=(2, 4, 16, 64), k_shape=(2, 4, 32, 64), q_dtype=BF16, k_dtype=BF16, v_dtype=BF16)
    dtype, dq, dk, _ = V.check_qkv(q, k, v, "bhsd")
    assert dtype == "bf16"
    assert (dq.batch, dq.seqlen, dq.heads, dq.head_dim) == (2, 16, 4, 64)
    assert (dq.batch_stride, dq.row_stride, dq.head_stride) == (4 * 16 * 64, 64, 16 * 64)
    assert (dk.seqlen, dk.row_stride, dk.head_stride) == (32, 64, 32 * 64)


def test_zero_size_batch_and_seqlen_pass_validation():
    _, dq, dk, _ = check_qkv(q_shape=(0, 16, 4, 64), k_shape=(0, 0, 4, 64))
    assert (dq.batch, dk.seqlen) == (0, 0)
    # CuPy (like NumPy >= 1.23) gives every zero-size array all-zero strides
    _, dq, dk, _ = check_qkv(q_shape=(2, 16, 4, 64), k_shape=(2, 0, 4, 64), k_strides=(0, 0, 0, 0),
                             v_strides=(0, 0, 0, 0))
    assert (dq.seqlen, dk.seqlen) == (16, 0)


def test_default_softmax_scale_and_numpy_scalars():
    assert V.check_softmax_scale(None, 64) == pytest.approx(0.125)
    assert V.check_softmax_scale(np.float32(0.5), 64) == 0.5
    assert V.check_softmax_scale(2, 64) == 2.0
    assert V.check_flag(np.bool_(True), "causal") is True


@pytest.mark.parametrize("strides,ptr,needs_copy", [
    ((16 * 4 * 64, 4 * 64, 64, 1), 0, False),          # contiguous bshd
    ((16 * 4 * 128, 4 * 128, 128, 1), 64 * 2, False),  # a head_dim slice of a (2, 16, 4, 128) buffer
    ((16 * 4 * 65, 4 * 65, 65, 1), 0, True),           # rows of 65 elements: 16-byte chunks misaligned
    ((16 * 4 * 64, 4 * 64, 64, 1), 2, True),           # base address not 16-byte aligned
])
def test_misaligned_views_are_copied_not_rejected(strides, ptr, needs_copy):
    q = info("q", (2, 16, 4, 64), strides=strides, ptr=ptr)
    assert V.needs_aligned_copy(q, V.bshd_dims(q, "bshd")) is needs_copy


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 8), (8, 4), (8, 2), (8, 1), (6, 3), (6, 1), (0, 0)])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_gqa_heads_that_divide_the_query_heads_are_accepted(heads_q, heads_kv, layout):
    """Grouped-query (H_kv < H_q) and multi-query (H_kv = 1) attention: q keeps its heads, k and v theirs."""
    shape = (lambda s, h: (2, s, h, 64)) if layout == "bshd" else (lambda s, h: (2, h, s, 64))
    dtype, dq, dk, dv = check_qkv(layout=layout, q_shape=shape(16, heads_q), k_shape=shape(32, heads_kv))
    assert (dq.heads, dk.heads, dv.heads) == (heads_q, heads_kv, heads_kv)
    assert V.check_gqa_heads(heads_q, heads_kv, *qkv()[:2]) == (heads_q // heads_kv if heads_kv else 1)
