"""float32 and float64 inputs: what the public functions refuse, on array metadata (no GPU needed, runs in CI), and
the references tests/test_gpu_wide.py judges the kernels by.

Validation: tests/test_bad_input.py's FakeCupyArray and its `metadata_only` fixture (any use of the GPU, a kernel or
the device's architecture fails the test), so every error must come from metadata alone, before anything is
launched or written. Each case asserts the exception type and message fragments that name the argument and its
value. The contract checked:
  * precision= on attention, attention_forward, attention_backward, attention_varlen, attention_varlen_forward and
    attention_varlen_backward: None, "fp32" or "tf32" for float32 inputs (None means "fp32"); None for float16,
    bfloat16 and float64 inputs; any other value a ValueError naming precision, its value and what is allowed;
  * all inputs of one dtype, lse float32 for float32 inputs and float64 for float64 inputs, a float32 input's bias
    (and dbias) float32, head_dim a multiple of 8 up to 256 (float64: up to 128);
  * float64 refuses alibi_slopes, softcap, bias, mask, key_padding_mask and dropout_p > 0 (ValueError naming the
    argument); attention_with_kvcache stays float16 / bfloat16 (TypeError);
The calls the contract allows get past validation (test_valid_wide_calls_reach_the_gpu, and deterministic=True:
test_deterministic_backward_reaches_the_gpu_for_wide_dtypes), so the bad cases fail for their one defect.

References: cuflash._xpref.round_tf32 (bit patterns), attention_plain / attention_backward_plain and their varlen
forms in "fp64" against cuflash.reference (every modifier), "fp32" / "tf32" / "ext" against "fp64", and "ext"
(np.longdouble) more accurate than float64 where the exact result is known.
"""
from __future__ import annotations

import re
from fractions import Fraction

import numpy as np
import pytest

import cuflash
from cuflash import _xpref, philox
from cuflash import reference as ref
from test_bad_input import BF16, F32, FP16, FakeCupyArray, att, bwd, fakes, fwd, metadata_only  # noqa: F401 (fixture)

F = FakeCupyArray
F64 = np.dtype(np.float64)
I32 = np.dtype(np.int32)
BOOL = np.dtype(np.bool_)

# --- the calls: dense (batch 2, heads 2, seqlen_q 16, seqlen_k 24) and packed (3 sequences, 40 / 50 rows, heads 4 / 2,
# max lengths 20 / 30) problems of metadata-only arrays ---------------------------------------------------------------

MAX_Q, MAX_K = 20, 30


def lse_of(dtype):
    return F64 if np.dtype(dtype) == F64 else F32


def dense(dtype=F32, d=64, **replace):
    """q, k, v, dout, out, lse of a dense problem in `dtype` (lse float64 for float64, else float32)."""
    return fakes(dtype=dtype, d=d, **{"lse": F((2, 2, 16), lse_of(dtype)), **replace})


def packed(dtype=F32, d=64, **replace):
    """q, k, v, dout, out, lse, cu_q, cu_k of a packed problem (GQA 4 / 2) in `dtype`."""
    a = {"q": F((40, 4, d), dtype), "k": F((50, 2, d), dtype), "v": F((50, 2, d), dtype), "dout": F((40, 4, d), dtype),
         "out": F((40, 4, d), dtype), "lse": F((4, 40), lse_of(dtype)), "cu_q": F((4,), I32), "cu_k": F((4,), I32)}
    a.update(replace)
    return a


def v_fwd(a, **kw):
    return cuflash.attention_varlen_forward(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], MAX_Q, MAX_K,
                                            check_inputs=False, **kw)


def v_att(a, **kw):
    return cuflash.attention_varlen(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], MAX_Q, MAX_K, check_inputs=False,
                                    **kw)


def v_bwd(a, **kw):
    return cuflash.attention_varlen_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["cu_q"],
                                             a["cu_k"], MAX_Q, MAX_K, check_inputs=False, **kw)


FUNCTIONS = {  # name -> (the inputs, the call)
    "attention": (dense, att),
    "attention_forward": (dense, fwd),
    "attention_backward": (dense, bwd),
    "attention_varlen": (packed, v_att),
    "attention_varlen_forward": (packed, v_fwd),
    "attention_varlen_backward": (packed, v_bwd),
}


def call(function: str, dtype, d=64, **kw):
    inputs, fn = FUNCTIONS[function]
    return fn(inputs(dtype, d), **kw)


def scores_shape(function: str):
    """(batch, heads, seqlen_q, seqlen_k) of the scores a bias or mask broadcasts to."""
    return (3, 4, MAX_Q, MAX_K) if FUNCTIONS[function][0] is packed else (2, 2, 16, 24)


def check_message(e, parts, words=()):
    """Every fragment of `parts` in the message, and every name of `words` as a whole word (so "mask" is not found
    in "key_padding_mask", nor "bias" in "dbias")."""
    msg = str(e.value)
    missing = [p for p in parts if p not in msg] + [w for w in words if not re.search(rf"\b{w}\b", msg)]
    assert not missing, f"message lacks {missing}: {msg!r}"


# --- precision -------------------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("metadata_only")
@pytest.mark.parametrize("value", ["fp16", "TF32", "highest", "", 32], ids=repr)
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_precision_must_be_none_fp32_or_tf32(function, value):
    """float32 inputs: any precision other than None, "fp32" and "tf32" (other names, other case, non-strings) is a
    ValueError naming precision, its value and the allowed ones."""
    with pytest.raises(ValueError) as e:
        call(function, F32, precision=value)
    check_message(e, [f"precision={value!r}", "'fp32'", "'tf32'"])


@pytest.mark.usefixtures("metadata_only")
@pytest.mark.parametrize("dtype,precision", [(FP16, "fp32"), (BF16, "tf32"), (F64, "fp32"), (F64, "tf32")],
                         ids=["float16-fp32", "bfloat16-tf32", "float64-fp32", "float64-tf32"])
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_precision_is_for_float32_inputs_only(function, dtype, precision):
    """float16, bfloat16 and float64 inputs take precision=None only: a ValueError naming precision, its value, the
    inputs' dtype and None."""
    with pytest.raises(ValueError) as e:
        call(function, dtype, precision=precision)
    check_message(e, [f"precision={precision!r}", str(np.dtype(dtype)), "None"])


# --- float64: the modifiers it refuses, its head dims -------------------------------------------------------------

def refused_modifier(name: str, function: str) -> dict:
    """Keyword arguments giving a float64 call modifier `name` with values that float16 inputs would take (float64
    is the one defect)."""
    b, h, sq, sk = scores_shape(function)
    return {
        "alibi_slopes": dict(alibi_slopes=F((h,), F32)),
        "softcap": dict(softcap=30.0),
        "bias": dict(bias=F((b, h, sq, sk), F64)),
        "bias-float32": dict(bias=F((b, h, sq, sk), F32)),
        "mask": dict(mask=F((b, h, sq, sk), BOOL)),
        "key_padding_mask": dict(key_padding_mask=F((b, sk), BOOL)),
        "dropout_p": dict(dropout_p=0.1, seed=1),
    }[name]


REFUSED = {  # modifier -> (the argument's name, fragments: its value where it is a number)
    "alibi_slopes": ("alibi_slopes", []),
    "softcap": ("softcap", ["softcap=30.0"]),
    "bias": ("bias", []),
    "bias-float32": ("bias", []),
    "mask": ("mask", []),
    "key_padding_mask": ("key_padding_mask", []),
    "dropout_p": ("dropout_p", ["dropout_p=0.1"]),
}


@pytest.mark.usefixtures("metadata_only")
@pytest.mark.parametrize("modifier", list(REFUSED))
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_float64_refuses_modifier(function, modifier):
    """float64 takes causal and window only of the score modifiers: the others are a ValueError naming the argument
    (and its value where it is a number) and float64."""
    name, parts = REFUSED[modifier]
    with pytest.raises(ValueError) as e:
        call(function, F64, **refused_modifier(modifier, function))
    check_message(e, parts + ["float64"], [name])


@pytest.mark.usefixtures("metadata_only")
@pytest.mark.parametrize("d", [136, 256])
@pytest.mark.parametrize("function", list(FUNCTIONS))
def test_float64_head_dim_above_128_is_refused(function, d):
    with pytest.raises(ValueError) as e:
        call(function, F64, d)
    check_message(e, [f"head_dim={d}", "128"])


# --- dtypes: lse, mixed inputs, bias, kv cache, head dims ------------------------------------------------------------

def kvcache(dtype, new_dtype=None):
    """attention_with_kvcache on a dense cache (2 x 32 keys), q of one token; new keys in new_dtype if given."""
    new = {} if new_dtype is None else dict(k=F((2, 1, 2, 64), new_dtype), v=F((2, 1, 2, 64), new_dtype))
    return cuflash.attention_with_kvcache(F((2, 1, 2, 64), dtype), F((2, 32, 2, 64), dtype), F((2, 32, 2, 64), dtype),
                                          check_inputs=False, **new)


# (id, call, exception type, message fragments)
BAD = [
    # lse: float32 for float32 inputs, float64 for float64 inputs
    ("backward-float64-lse-float32", lambda: bwd(dense(F64, lse=F((2, 2, 16), F32))), TypeError,
     ["lse.dtype=float32", "float64"]),
    ("backward-float32-lse-float64", lambda: bwd(dense(F32, lse=F((2, 2, 16), F64))), TypeError,
     ["lse.dtype=float64", "float32"]),
    ("backward-float32-tf32-lse-float64", lambda: bwd(dense(F32, lse=F((2, 2, 16), F64)), precision="tf32"),
     TypeError, ["lse.dtype=float64", "float32"]),
    ("varlen-backward-float64-lse-float32", lambda: v_bwd(packed(F64, lse=F((4, 40), F32))), TypeError,
     ["lse.dtype=float32", "float64"]),
    ("varlen-backward-float32-lse-float64", lambda: v_bwd(packed(F32, lse=F((4, 40), F64))), TypeError,
     ["lse.dtype=float64", "float32"]),
    # one dtype for every input
    ("attention-q-float32-k-float64", lambda: att(dense(F32, k=F((2, 24, 2, 64), F64))), TypeError,
     ["k.dtype=float64", "q.dtype=float32"]),
    ("forward-q-float64-v-float32", lambda: fwd(dense(F64, v=F((2, 24, 2, 64), F32))), TypeError,
     ["v.dtype=float32", "q.dtype=float64"]),
    ("attention-q-float16-k-float32", lambda: att(dense(FP16, k=F((2, 24, 2, 64), F32))), TypeError,
     ["k.dtype=float32", "q.dtype=float16"]),
    ("forward-q-float32-v-bfloat16", lambda: fwd(dense(F32, v=F((2, 24, 2, 64), BF16))), TypeError,
     ["v.dtype=bfloat16", "q.dtype=float32"]),
    ("backward-float32-dout-float64", lambda: bwd(dense(F32, dout=F((2, 16, 2, 64), F64))), TypeError,
     ["dout.dtype=float64", "q.dtype=float32"]),
    ("backward-float64-out-float32", lambda: bwd(dense(F64, out=F((2, 16, 2, 64), F32))), TypeError,
     ["out.dtype=float32", "q.dtype=float64"]),
    ("backward-float32-dq-float64", lambda: bwd(dense(F32), dq=F((2, 16, 2, 64), F64)), TypeError,
     ["dq.dtype=float64", "float32"]),
    ("backward-float64-dv-float32", lambda: bwd(dense(F64), dv=F((2, 24, 2, 64), F32)), TypeError,
     ["dv.dtype=float32", "float64"]),
    ("varlen-forward-q-float32-k-float64", lambda: v_fwd(packed(F32, k=F((50, 2, 64), F64))), TypeError,
     ["k.dtype=float64", "q.dtype=float32"]),
    ("varlen-backward-float64-dout-float32", lambda: v_bwd(packed(F64, dout=F((40, 4, 64), F32))), TypeError,
     ["dout.dtype=float32", "q.dtype=float64"]),
    ("varlen-backward-float32-dk-float64", lambda: v_bwd(packed(F32), dk=F((50, 2, 64), F64)), TypeError,
     ["dk.dtype=float64", "float32"]),
    # a float32 input's bias and dbias are float32
    ("forward-float32-bias-float16", lambda: fwd(dense(F32), bias=F((16, 24), FP16)), TypeError,
     ["bias.dtype=float16", "float32"]),
    ("attention-float32-bias-float64", lambda: att(dense(F32), bias=F((2, 2, 16, 24), F64)), TypeError,
     ["bias.dtype=float64", "float32"]),
    ("backward-float32-dbias-float64", lambda: bwd(dense(F32), bias=F((16, 24), F32), dbias=F((16, 24), F64)),
     TypeError, ["dbias.dtype=float64", "float32"]),
    # head dims: multiples of 8 up to 256 for float32 as for the 16-bit dtypes
    ("forward-float32-head-dim-264", lambda: fwd(dense(F32, d=264)), ValueError, ["head_dim=264", "256"]),
    ("backward-float32-head-dim-12", lambda: bwd(dense(F32, d=12)), ValueError, ["head_dim=12", "multiple of 8"]),
    ("attention-float64-head-dim-12", lambda: att(dense(F64, d=12)), ValueError, ["head_dim=12", "multiple of 8"]),
    ("varlen-forward-float32-head-dim-264", lambda: v_fwd(packed(F32, d=264)), ValueError, ["head_dim=264", "256"]),
    # the KV-cache call stays 16-bit
    ("kvcache-float32", lambda: kvcache(F32), TypeError, ["q.dtype=float32", "float16 or bfloat16"]),
    ("kvcache-float64", lambda: kvcache(F64), TypeError, ["q.dtype=float64", "float16 or bfloat16"]),
    ("kvcache-float16-new-keys-float32", lambda: kvcache(FP16, F32), TypeError, ["k.dtype=float32", "q.dtype=float16"]),
]


@pytest.mark.usefixtures("metadata_only")
@pytest.mark.parametrize("fn,exc,parts", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_wide_call_is_rejected_before_the_gpu(fn, exc, parts):
    with pytest.raises(exc) as e:
        fn()
    check_message(e, parts)


@pytest.mark.usefixtures("metadata_only")
@pytest.mark.parametrize("dtype,precision", [(F32, None), (F32, "tf32"), (F64, None)],
                         ids=["float32", "float32-tf32", "float64"])
@pytest.mark.parametrize("function", ["attention_backward", "attention_varlen_backward"])
def test_deterministic_backward_reaches_the_gpu_for_wide_dtypes(function, dtype, precision):
    """float32 and float64 have a deterministic backward: deterministic=True passes validation."""
    with pytest.raises(AssertionError, match="the GPU was used"):
        call(function, dtype, deterministic=True, precision=precision)


# --- what the contract allows gets past validation ----------------------------------------------------------------

def _valid_calls():
    """(id, call) of calls the contract allows: each reaches the (patched) GPU."""
    mods32 = dict(window=(8, 2), alibi_slopes=F((2, 4), F32), softcap=30.0, bias=F((2, 1, 16, 24), F32),
                  mask=F((2, 4, 16, 24), BOOL), key_padding_mask=F((2, 24), BOOL), dropout_p=0.1, seed=3)

    def dense32():  # GQA 4 / 2 at head dim 256
        return dense(F32, d=256, h=4, k=F((2, 24, 2, 256), F32), v=F((2, 24, 2, 256), F32), lse=F((2, 4, 16), F32))

    def dense64(layout="bshd"):
        shape = (lambda s, h: (2, s, h, 128)) if layout == "bshd" else (lambda s, h: (2, h, s, 128))
        return dense(F64, d=128, layout=layout, q=F(shape(16, 4), F64), k=F(shape(24, 2), F64), v=F(shape(24, 2), F64),
                     dout=F(shape(16, 4), F64), out=F(shape(16, 4), F64), lse=F((2, 4, 16), F64))

    packed_mods = dict(window=(8, 8), alibi_slopes=F((3, 4), F32), softcap=20.0, bias=F((3, 4, MAX_Q, MAX_K), F32),
                       key_padding_mask=F((3, MAX_K), BOOL), dropout_p=0.2, seed=1)
    return [
        ("attention-float32", lambda: att(dense(F32))),
        ("forward-float32-fp32-d8", lambda: fwd(dense(F32, d=8), precision="fp32")),
        ("forward-float32-tf32-every-modifier", lambda: fwd(dense32(), causal=True, precision="tf32",
                                                            return_dropout_mask=True, **mods32)),
        ("backward-float32-every-modifier-dbias", lambda: bwd(dense32(), causal=True, dbias=True, **mods32)),
        ("backward-float32-preallocated", lambda: bwd(dense(F32), precision="fp32", dq=F((2, 16, 2, 64), F32),
                                                      dk=F((2, 24, 2, 64), F32), dv=F((2, 24, 2, 64), F32))),
        ("attention-float64-d8", lambda: att(dense(F64, d=8))),
        ("forward-float64-bhsd-gqa-causal-window", lambda: fwd(dense64("bhsd"), layout="bhsd", causal=True,
                                                               window=(4, 0), softmax_scale=0.2, dropout_p=0.0)),
        ("backward-float64-gqa-window-preallocated", lambda: bwd(dense64(), window=(3, 5), dq=F((2, 16, 4, 128), F64),
                                                                 dk=F((2, 24, 2, 128), F64),
                                                                 dv=F((2, 24, 2, 128), F64))),
        ("varlen-forward-float32-tf32-modifiers", lambda: v_fwd(packed(F32), precision="tf32", **packed_mods)),
        ("varlen-backward-float32-modifiers-dbias", lambda: v_bwd(packed(F32), dbias=True, **packed_mods)),
        ("varlen-float64-causal-window", lambda: v_att(packed(F64, d=128), causal=True, window=(5, 0))),
        ("varlen-backward-float64", lambda: v_bwd(packed(F64, d=128), causal=True)),
    ]


VALID = _valid_calls()


@pytest.mark.usefixtures("metadata_only")
@pytest.mark.parametrize("fn", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_wide_calls_reach_the_gpu(fn):
    """The calls the contract allows pass validation (the fakes are consistent, so each bad case above fails for its
    one defect): float32 with every modifier in both precisions, d 8 and 256, GQA, dbias, preallocated gradients;
    float64 with causal, window, GQA, bhsd, d 8 and 128, dropout_p=0; varlen of both."""
    with pytest.raises(AssertionError, match="the GPU was used"):
        fn()


# --- the references of tests/test_gpu_wide.py ------------------------------------------------------------------------

def test_round_tf32_keeps_10_mantissa_bits_rounding_to_nearest_ties_away():
    """Bit patterns: the low 13 bits cleared, half a TF32 step rounds away from zero (as cvt.rna.tf32.f32), below it
    down; NaN, inf and 0 stay; random values land on the nearest TF32 value (ties away), within 2^-11 relative."""
    one = np.float32(1.0)
    step = np.float32(2.0 ** -10)  # TF32's spacing at 1
    cases = {1 + step / 2: 1 + step, 1 + step / 2 - np.float32(2.0 ** -23): one, 1 + step * 1.5: 1 + 2 * step,
             -(1 + step / 2): -(1 + step), np.float32(np.inf): np.inf, np.float32(-np.inf): -np.inf,
             np.float32(0.0): 0.0, np.float32(2.0 ** -140): 0.0}  # a subnormal below half a step (bit 12)
    for x, want in cases.items():
        got = _xpref.round_tf32(np.array([x], dtype=np.float32))[0]
        assert got == np.float32(want), f"round_tf32({x!r}) = {got!r}, expected {want!r}"
    assert np.isnan(_xpref.round_tf32(np.array([np.nan], np.float32))[0])
    x = (np.random.default_rng(0).standard_normal(100_000) * 10.0 ** np.random.default_rng(1).integers(-30, 30, 100_000)
         ).astype(np.float32)
    r = _xpref.round_tf32(x)
    assert r.dtype == np.float32 and not (r.view(np.uint32) & 0x1FFF).any()
    ulp = np.ldexp(1.0, np.frexp(x.astype(np.float64))[1] - 11)  # TF32 spacing of x's binade
    want = np.sign(x) * np.floor(np.abs(x.astype(np.float64)) / ulp + 0.5) * ulp  # nearest, ties away from zero
    assert np.array_equal(r.astype(np.float64), want)
    assert np.all(np.abs(r - x) <= 2.0 ** -11 * np.abs(x))


def test_round_to_and_to_lowp_know_the_wide_names():
    x = np.random.default_rng(2).standard_normal((3, 5))
    assert _xpref.round_to(x, "fp64").dtype == np.float64 and np.array_equal(_xpref.round_to(x, "fp64"), x)
    assert _xpref.round_to(x, "fp32").dtype == np.float32 and np.array_equal(_xpref.round_to(x, "fp32"),
                                                                             x.astype(np.float32))
    assert np.array_equal(_xpref.round_to(x, "tf32"), _xpref.round_tf32(x.astype(np.float32)))
    assert _xpref.to_lowp(x, "fp32").dtype == np.float32 and _xpref.to_lowp(x, "fp64").dtype == np.float64
    assert _xpref.to_lowp(x, "fp16").dtype == np.float16  # the 16-bit names unchanged


def problem(b, sq, sk, hq, hkv, d, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for shape in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d))]


def options(b, hq, sq, sk, seed, which):
    """attention_plain / cuflash.reference keyword arguments of the named modifiers (NumPy)."""
    rng = np.random.default_rng(seed)
    opts = {}
    if "window" in which:
        opts["window"] = (3, 2)
    if "alibi" in which:
        opts["alibi_slopes"] = rng.random((b, hq)) * 0.3
    if "softcap" in which:
        opts["softcap"] = 2.0
    if "dropout" in which:
        opts.update(dropout_mask=philox.dropout_mask(b, hq, sq, sk, 0.25, seed, 0), dropout_p=0.25)
    if "bias" in which:
        opts["bias"] = rng.standard_normal((b, 1, sq, sk))
    if "mask" in which:
        opts["mask"] = rng.random((b, hq, sq, sk)) < 0.8
    if "padding" in which:
        opts["key_padding_mask"] = rng.random((b, sk)) < 0.85
    return opts


MODIFIER_SETS = [(), ("window",), ("alibi", "softcap"), ("dropout",), ("bias", "mask", "padding"),
                 ("window", "alibi", "softcap", "dropout", "bias", "mask", "padding")]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("which", MODIFIER_SETS, ids=lambda w: "+".join(w) or "plain")
def test_attention_plain_fp64_is_cuflash_reference(which, causal):
    """attention_plain / attention_backward_plain in float64 are cuflash.reference's float64 attention, with every
    modifier, GQA, causal, a scale, rows that see no key (Sq > Sk causal)."""
    b, sq, sk, hq, hkv, d = 2, 9, 7, 4, 2, 8
    q, k, v, do = problem(b, sq, sk, hq, hkv, d, 3)
    opts = options(b, hq, sq, sk, 4, which)
    got = _xpref.attention_plain(q, k, v, "fp64", causal, 0.4, **opts)
    want = ref.attention_forward64(q, k, v, causal, 0.4, **opts)
    assert got[0].dtype == np.float64 and np.array_equal(np.isinf(got[1]), np.isinf(want[1]))
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.where(np.isinf(want[1]), 0, got[1]), np.where(np.isinf(want[1]), 0, want[1]),
                               rtol=0, atol=1e-12)
    got = _xpref.attention_backward_plain(do, q, k, v, "fp64", causal, 0.4, **opts)
    want = ref.attention_backward64(do, q, k, v, causal, 0.4, **opts)
    assert len(got) == len(want) == (4 if "bias" in which else 3)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12, err_msg=name)


def ext_or_skip():
    eps = float(np.finfo(np.longdouble).eps)
    if not eps < 1e-18:
        pytest.skip(f"np.longdouble is not wider than float64 on this host (eps {eps:.3g})")


@pytest.mark.parametrize("which", [(), ("window", "alibi", "softcap", "dropout", "bias", "mask", "padding")],
                         ids=["plain", "every-modifier"])
def test_attention_plain_working_precisions(which):
    """"fp32" and "tf32" compute in float32 (outputs float32), within float32's / TF32's error of "fp64" and not equal
    to each other (the TF32 rounding is applied); "ext" computes in np.longdouble within float64's error of "fp64"."""
    b, sq, sk, hq, hkv, d = 1, 33, 47, 2, 1, 32
    q, k, v, do = problem(b, sq, sk, hq, hkv, d, 5)
    q, k, v, do = (x.astype(np.float32) for x in (q, k, v, do))
    opts = options(b, hq, sq, sk, 6, which)
    o64, lse64 = _xpref.attention_plain(q, k, v, "fp64", True, None, **opts)
    g64 = _xpref.attention_backward_plain(do, q, k, v, "fp64", True, None, **opts)
    seen = np.isfinite(lse64)
    results = {}
    for precision, tol in (("fp32", 2e-5), ("tf32", 2e-2)):
        o, lse = _xpref.attention_plain(q, k, v, precision, True, None, **opts)
        grads = _xpref.attention_backward_plain(do, q, k, v, precision, True, None, **opts)
        assert o.dtype == lse.dtype == np.float32 and all(g.dtype == np.float32 for g in grads), precision
        assert np.array_equal(np.isfinite(lse), seen), precision
        for name, x, x64 in [("o", o, o64), ("lse", lse[seen], lse64[seen])] + list(zip(("dq", "dk", "dv", "dbias"),
                                                                                         grads, g64)):
            err = np.abs(x - x64).max()
            assert err <= tol * max(1.0, np.abs(x64).max()), f"{precision} {name}: {err:.3e}"
        results[precision] = o
    assert not np.array_equal(results["fp32"], results["tf32"]), "tf32 gave float32's result: no TF32 rounding"
    ext_or_skip()
    o, lse = _xpref.attention_plain(q, k, v, "ext", True, None, **opts)
    grads = _xpref.attention_backward_plain(do, q, k, v, "ext", True, None, **opts)
    assert o.dtype == lse.dtype == np.longdouble and all(g.dtype == np.longdouble for g in grads)
    for name, x, x64 in [("o", o, o64), ("lse", lse[seen], lse64[seen])] + list(zip(("dq", "dk", "dv"), grads, g64)):
        assert float(np.abs(x - x64).max()) <= 1e-13, f"ext {name}"


def exact(x) -> Fraction:
    """The exact value of a float64 or np.longdouble number (its float64 part plus the remainder, exact in float64)."""
    hi = np.float64(x)
    return Fraction(float(hi)) + Fraction(float(np.longdouble(x) - np.longdouble(hi)))


def test_ext_reference_is_more_accurate_than_float64():
    """With q = 0 every key has P = 1 / Sk, so o is the mean of v's rows, known exactly (fractions): on values of
    mixed magnitudes float64 is measurably off, and "ext" (np.longdouble) is at least 100x closer (its unit roundoff
    is 2^11 below float64's on x86)."""
    ext_or_skip()
    rng = np.random.default_rng(7)
    sk, d = 300, 8
    v = rng.standard_normal((1, sk, 1, d)) * 10.0 ** rng.integers(-8, 8, (1, sk, 1, 1))
    q, k = np.zeros((1, 1, 1, d)), rng.standard_normal((1, sk, 1, d))
    mean = [sum(Fraction(float(x)) for x in v[0, :, 0, c]) / sk for c in range(d)]
    o_ext = _xpref.attention_plain(q, k, v, "ext")[0][0, 0, 0]
    o_64 = _xpref.attention_plain(q, k, v, "fp64")[0][0, 0, 0]
    err_ext = max(abs(exact(x) - m) for x, m in zip(o_ext, mean))
    err_64 = max(abs(exact(x) - m) for x, m in zip(o_64, mean))
    assert err_64 > 2.0 ** -53 * np.abs(v).max() / sk, "the case does not show float64's rounding (pick other values)"
    assert err_ext <= err_64 / 100, f"ext error {float(err_ext):.3e} is not far below float64's {float(err_64):.3e}"


@pytest.mark.parametrize("which", [(), ("window", "alibi", "softcap", "dropout", "bias", "padding")],
                         ids=["plain", "modifiers"])
def test_varlen_plain_is_cuflash_reference(which):
    """The varlen forms per sequence (lengths 0, 1, odd, a sequence without keys): cuflash.reference's varlen float64
    attention with the same modifiers (dropout: one mask per sequence; bias: the top-left corner per sequence)."""
    lens_q, lens_k = [5, 0, 1, 7, 3], [6, 2, 1, 7, 0]
    hq, hkv, d = 4, 2, 8
    rng = np.random.default_rng(8)
    tq, tk, n = sum(lens_q), sum(lens_k), len(lens_q)
    q, do = rng.standard_normal((tq, hq, d)), rng.standard_normal((tq, hq, d))
    k, v = rng.standard_normal((tk, hkv, d)), rng.standard_normal((tk, hkv, d))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    opts = options(n, hq, max(lens_q), max(lens_k), 9, which)
    opts.pop("dropout_mask", None)
    if "dropout" in which:
        opts["dropout_mask"] = philox.dropout_mask_varlen(lens_q, lens_k, hq, 0.25, 9, 0)
    if "bias" in which:
        opts["bias"] = rng.standard_normal((n, hq, max(lens_q), max(lens_k)))
    for causal in (False, True):
        got = _xpref.attention_varlen_plain(q, k, v, cu_q, cu_k, "fp64", causal, **opts)
        want = ref.attention_varlen_forward64(q, k, v, cu_q, cu_k, causal, **opts)
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-12)
        assert np.array_equal(np.isinf(got[1]), np.isinf(want[1]))
        got = _xpref.attention_varlen_backward_plain(do, q, k, v, cu_q, cu_k, "fp64", causal, **opts)
        want = ref.attention_varlen_backward64(do, q, k, v, cu_q, cu_k, causal, **opts)
        assert len(got) == len(want)
        for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-12, err_msg=f"{name} causal={causal}")
