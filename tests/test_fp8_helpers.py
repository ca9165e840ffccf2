"""cuflash.fp8: FP8 (e4m3fn, stored as uint8 bits) quantization and the randomized Hadamard transform.

CPU part (runs in CI): the NumPy bit conversion `_e4m3_bits_numpy` against ml_dtypes on a dense sweep of float32
values (every float32 up to 464 in its 20 top bits, each e4m3 value and the ties between neighbours, random floats,
zeros and subnormals, both signs) and the decoding of all 256 bit patterns; the NumPy references of quantize and
dequantize; every argument check from metadata alone (a FakeCupyArray; CuPy and the kernels patched to fail, so each
error is raised before the GPU is touched); the kernel source through NVRTC (needs libnvrtc, no GPU).
GPU part (marker gpu): quantize bit-equal to the reference (and to ml_dtypes) for each scaling, layout and dtype,
with seqlen 300 (not a multiple of 128) and outliers of magnitude 10; dequantize bit-equal to its reference and
within e4m3's error of x; hadamard against a float64 matmul with the explicit R = diag(s) H_D / sqrt(D), q k^T
preserved, seeds; bad inputs rejected before any launch, inputs unchanged.
"""
from __future__ import annotations

import math
import re
import zlib

import ml_dtypes
import numpy as np
import pytest

from cuflash import _compile, _launch, _validate, _xpref, fp8
from cuflash._validate import ArrayInfo

E4M3 = ml_dtypes.float8_e4m3fn
FP16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)
SCALINGS = ["tensor", "head", "block"]
LAYOUTS = ["bshd", "bhsd"]
DTYPES = ["fp16", "bf16", "fp32"]


def ml_dtypes_bits(v) -> np.ndarray:
    """The yardstick: ml_dtypes' float32 -> float8_e4m3fn conversion, as bits."""
    return np.asarray(v, dtype=np.float32).astype(E4M3).view(np.uint8)


def first_mismatches(v, got, want, n=5) -> str:
    bad = np.flatnonzero(got != want)[:n]
    return ", ".join(f"{float(v.flat[i])!r} (0x{int(v.view(np.uint32).flat[i]):08x}): got 0x{int(got.flat[i]):02x}, "
                     f"ml_dtypes 0x{int(want.flat[i]):02x}" for i in bad)


# --- CPU: the bit conversion ----------------------------------------------------------------------------------

def e4m3_finite_values() -> np.ndarray:
    """The 127 non-negative finite e4m3fn values, ascending: k * 2^e (subnormals k * 2^-9, then (8 + m) * 2^(E-10))."""
    v = np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(np.float32)
    assert np.all(np.diff(v) > 0)
    return v


def sweep(kind: str) -> np.ndarray:
    """float32 values with |v| <= 448 (both signs) that exercise one part of the rounding."""
    if kind == "top-bits":  # every float32 pattern up to 448 in its top 20 bits, with the low bits that decide ties
        hi = np.arange((0x43E00000 >> 12) + 1, dtype=np.uint32)
        lo = np.array([0, 1, 2, 0x7FF, 0x800, 0x801, 0xFFE, 0xFFF], dtype=np.uint32)
        v = ((hi[:, None] << np.uint32(12)) | lo[None, :]).reshape(-1).view(np.float32)
    elif kind == "e4m3-ties":  # each e4m3 value, each midpoint between neighbours (a tie), and their float32 neighbours
        e = e4m3_finite_values().astype(np.float64)
        mid = ((e[1:] + e[:-1]) / 2).astype(np.float32)  # exact: a midpoint has 5 significant bits
        pts = np.concatenate([e.astype(np.float32), mid, np.float32(464.0)[None]])
        v = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    elif kind == "random":  # random bit patterns and log-uniform magnitudes from 2^-12 to 448
        rng = np.random.default_rng(8)
        bits = rng.integers(0, 0x43E00001, size=1_000_000, dtype=np.uint32)
        mags = np.exp2(rng.uniform(-12, math.log2(448), size=1_000_000)).astype(np.float32)
        v = np.concatenate([bits.view(np.float32), mags])
    elif kind == "tiny":  # zeros, float32 subnormals, and the e4m3 subnormal range with its ties (k / 2 * 2^-9)
        rng = np.random.default_rng(9)
        sub32 = np.concatenate([np.arange(1, 4096, dtype=np.uint32), rng.integers(1, 0x800000, 100_000,
                                                                                   dtype=np.uint32)])
        half_steps = np.arange(0, 33, dtype=np.float32) * np.float32(2.0**-10)  # 0, ties and values from 0 to 2^-5
        v = np.concatenate([np.zeros(1, np.float32), sub32.view(np.float32), half_steps,
                            np.nextafter(half_steps, np.float32(1)), np.nextafter(half_steps, np.float32(0)),
                            rng.uniform(0, 2.0**-5, 100_000).astype(np.float32)])
    else:
        raise ValueError(kind)
    v = v[np.abs(v) <= 448]
    return np.concatenate([v, -v])


@pytest.mark.parametrize("kind", ["top-bits", "e4m3-ties", "random", "tiny"])
def test_e4m3_bits_equal_ml_dtypes(kind):
    v = sweep(kind)
    got, want = fp8._e4m3_bits_numpy(v), ml_dtypes_bits(v)
    assert got.dtype == np.uint8 and got.shape == v.shape
    n_bad = int((got != want).sum())
    assert n_bad == 0, f"{kind}: {n_bad} of {v.size} differ from ml_dtypes: {first_mismatches(v, got, want)}"


def test_e4m3_bits_keep_the_sign_of_zero_and_the_shape():
    assert fp8._e4m3_bits_numpy(np.float32(-0.0)) == 0x80 and fp8._e4m3_bits_numpy(np.float32(0.0)) == 0
    assert fp8._e4m3_bits_numpy(np.float32(-2.0**-11)) == 0x80  # rounds to -0, as ml_dtypes
    x = np.ones((2, 3, 4), np.float32)
    assert fp8._e4m3_bits_numpy(x).shape == (2, 3, 4) and fp8._e4m3_bits_numpy(np.float32(1.0)).shape == ()


def test_e4m3_bits_saturate_past_448_and_keep_nan():
    """Past 448 quantize saturates to +-448 (0x7E / 0xFE), where ml_dtypes rounds values past 464 to NaN; inf
    saturates too; NaN stays NaN (0x7F | sign)."""
    rng = np.random.default_rng(3)
    big = np.concatenate([np.nextafter(np.float32(448), np.float32(np.inf))[None], np.float32([463.99, 464, 464.01, 480,
                          1e4, 3e38, np.inf]), np.exp2(rng.uniform(8.81, 127.9, 10_000)).astype(np.float32)])
    got = fp8._e4m3_bits_numpy(np.concatenate([big, -big]))
    assert np.all(got[:big.size] == 0x7E) and np.all(got[big.size:] == 0xFE), "no saturation past 448"
    upto_464 = big[big <= 464]  # ml_dtypes rounds these to 448 too
    np.testing.assert_array_equal(fp8._e4m3_bits_numpy(upto_464), ml_dtypes_bits(upto_464))
    assert list(fp8._e4m3_bits_numpy(np.float32([np.nan, -np.nan]))) == [0x7F, 0xFF]


def test_e4m3_values_decode_every_bit_pattern():
    bits = np.arange(256, dtype=np.uint8)
    got, want = fp8._e4m3_values_numpy(bits), bits.view(E4M3).astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)  # NaN == NaN here, and -0.0 == 0.0
    assert np.array_equal(np.signbit(got), np.signbit(want)), "the sign of 0x80 (-0) or of a NaN differs"
    finite = bits[np.isfinite(want)]
    np.testing.assert_array_equal(fp8._e4m3_bits_numpy(fp8._e4m3_values_numpy(finite)), finite)  # a round trip


# --- CPU: the NumPy references of quantize and dequantize ---------------------------------------------------------

def random_x(shape, seed: int, outliers: int = 6) -> np.ndarray:
    """float32 standard normal values with a few outliers of magnitude 10."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    idx = rng.integers(0, x.size, outliers)
    x.flat[idx] = np.float32(10.0) * rng.choice([-1, 1], outliers)
    return x


def groups_bshd(scaling: str, b: int, s: int, h: int, block_rows: int = 128):
    """[(descale index, (b, row slice, h))]: the element sets of each group of a (b, s, h, d) tensor."""
    if scaling == "tensor":
        return [((), (slice(None), slice(None), slice(None)))]
    if scaling == "head":
        return [((i, j), (i, slice(None), j)) for i in range(b) for j in range(h)]
    return [((i, j, t), (i, slice(t * block_rows, (t + 1) * block_rows), j))
            for i in range(b) for j in range(h) for t in range(-(-s // block_rows))]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_quantize_reference_groups(scaling, layout):
    """descale = amax / 448 per group (shapes of the module docstring), the group's largest element maps to +-448,
    an all-zero group has descale 1, and dequantizing gives x back within e4m3's error."""
    b, s, h, d = 2, 300, 3, 64
    x = random_x((b, s, h, d), seed=1)
    x[1, :, 2] = 0  # an all-zero (batch, head): zero groups in every scaling but "tensor"
    xl = x if layout == "bshd" else np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    x_q, descale = fp8.quantize_reference(xl, scaling=scaling, layout=layout)
    assert x_q.dtype == U8 and x_q.shape == xl.shape and descale.dtype == F32
    assert descale.shape == fp8.descale_shape(scaling, b, h, s) == {"tensor": (), "head": (b, h),
                                                                      "block": (b, h, 3)}[scaling]
    q_bshd = x_q if layout == "bshd" else x_q.transpose(0, 2, 1, 3)
    for index, sel in groups_bshd(scaling, b, s, h):
        amax = np.float32(np.abs(x[sel]).max())
        if amax == 0:
            assert descale[index] == 1 and not q_bshd[sel].any(), f"zero group {index}: descale {descale[index]}"
            continue
        assert descale[index] == amax / np.float32(448), f"group {index}: descale {descale[index]} for amax {amax}"
        assert (q_bshd[sel] & 0x7F).max() == fp8.E4M3_MAX_BITS, f"group {index}: its amax does not map to 448"
    y = fp8.dequantize_reference(x_q, descale, layout=layout)
    d_rows = fp8._descale_rows(descale, b, s, h, 128)
    y_bshd = y if layout == "bshd" else y.transpose(0, 2, 1, 3)
    # half an e4m3 step (3 mantissa bits; the subnormal step is 2^-9), plus float32's roundings of x / descale and
    # of the product
    bound = (2.0**-4 + 2.0**-20) * np.abs(x) + 2.0**-10 * d_rows * (1 + 2.0**-20)
    assert np.all(np.abs(y_bshd - x) <= bound), f"dequantize error past e4m3's for {scaling}"


def test_quantize_reference_tiny_and_empty_groups():
    x = np.zeros((1, 5, 2, 32), np.float32)
    x[0, 0, 0, 0] = np.float32(1e-44)  # amax / 448 underflows: descale is the smallest float32, never 0
    x[0, 1, 1, 3] = np.float32(-3e-41)
    x_q, descale = fp8.quantize_reference(x, scaling="head")
    assert descale[0, 0] == np.float32(fp8.DESCALE_MIN) and descale[0, 1] > 0
    assert np.all(np.isfinite(fp8._e4m3_values_numpy(x_q))) and x_q[0, 0, 0, 0] != 0 and x_q[0, 1, 1, 3] >= 0x80
    x_q, descale = fp8.quantize_reference(np.zeros((2, 0, 3, 64), np.float32), scaling="block")
    assert x_q.shape == (2, 0, 3, 64) and descale.shape == (2, 3, 0)
    x_q, descale = fp8.quantize_reference(np.zeros((2, 0, 3, 64), np.float32), scaling="head")
    assert np.all(descale == 1) and descale.shape == (2, 3)


def test_hadamard_signs_follow_the_documented_rule():
    s = fp8.hadamard_signs(7, 128)
    want = 1 - 2 * np.random.default_rng(7).integers(0, 2, size=128)
    assert s.dtype == F32 and not s.flags.writeable
    np.testing.assert_array_equal(s, want)
    assert not np.array_equal(s, fp8.hadamard_signs(8, 128)), "seeds 7 and 8 gave the same signs"


# --- CPU: argument checks from metadata alone ---------------------------------------------------------------------

class FakeCupyArray:
    """What validation reads of a CuPy array (shape, dtype, strides in elements, address, device), no data."""

    def __init__(self, shape, dtype=F32, strides=None, device=0):
        self.shape, self.dtype, self.device = tuple(shape), np.dtype(dtype), device
        if strides is None:
            strides = tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
        self.strides_elems = tuple(strides)

    def info(self, name: str) -> ArrayInfo:
        return ArrayInfo(name, self.shape, self.dtype, self.strides_elems, 1 << 30, self.device)


@pytest.fixture
def metadata_only(monkeypatch):
    """FakeCupyArray accepted as a CuPy array; any use of CuPy or of a kernel fails the test."""
    real = _validate.array_info

    def array_info(x, name):
        return x.info(name) if isinstance(x, FakeCupyArray) else real(x, name)

    def no_gpu(*args, **kwargs):
        raise AssertionError("the GPU was used before the bad input was rejected")

    monkeypatch.setattr(_validate, "array_info", array_info)
    monkeypatch.setattr(_launch, "cupy", no_gpu)
    monkeypatch.setattr(fp8, "_kernel", no_gpu)


F = FakeCupyArray
X = F((2, 300, 3, 64))
XQ = F((2, 300, 3, 64), U8)
D_BLOCK = F((2, 3, 3))

# (id, call, exception type, message fragments)
CPU_CASES = [
    ("quantize-x-numpy", lambda: fp8.quantize(np.zeros((2, 300, 3, 64), np.float32)), TypeError,
     ["x is a numpy.ndarray", "cupy.asarray(x)"]),
    ("quantize-x-int8", lambda: fp8.quantize(F((2, 300, 3, 64), np.int8)), TypeError,
     ["x.dtype=int8", "float16, bfloat16 (ml_dtypes.bfloat16) or float32"]),
    ("quantize-x-float64", lambda: fp8.quantize(F((2, 300, 3, 64), np.float64)), TypeError, ["x.dtype=float64"]),
    ("quantize-x-uint8", lambda: fp8.quantize(XQ), TypeError, ["x.dtype=uint8"]),
    ("quantize-x-rank3", lambda: fp8.quantize(F((2, 300, 64))), ValueError, ["x has shape (2, 300, 64)", "rank 3"]),
    ("quantize-x-half-element-strides", lambda: fp8.quantize(F((2, 4, 3, 64), strides=(768, 192, 64, 0.5))),
     ValueError, ["x has strides (768, 192, 64, 0.5)", "not whole elements"]),
    ("quantize-scaling-row", lambda: fp8.quantize(X, scaling="row"), ValueError,
     ["scaling='row'", "'tensor'", "'head'", "'block'"]),
    ("quantize-scaling-none", lambda: fp8.quantize(X, scaling=None), ValueError, ["scaling=None"]),
    ("quantize-layout-sbhd", lambda: fp8.quantize(X, layout="sbhd"), ValueError, ["layout='sbhd'", "'bshd'", "'bhsd'"]),
    ("quantize-block-rows-0", lambda: fp8.quantize(X, block_rows=0), ValueError, ["block_rows=0", "positive", "128"]),
    ("quantize-block-rows-float", lambda: fp8.quantize(X, block_rows=128.0), TypeError, ["block_rows=128.0", "int"]),
    ("quantize-block-rows-bool", lambda: fp8.quantize(X, block_rows=True), TypeError, ["block_rows=True"]),
    ("quantize-too-many-tiles", lambda: fp8.quantize(F((65536, 2**16, 1, 8)), block_rows=1), ValueError,
     ["tiles", "2147483647"]),
    ("dequantize-x_q-float16", lambda: fp8.dequantize(F((2, 300, 3, 64), FP16), D_BLOCK), TypeError,
     ["x_q.dtype=float16", "uint8"]),
    ("dequantize-x_q-numpy", lambda: fp8.dequantize(np.zeros((2, 300, 3, 64), np.uint8), D_BLOCK), TypeError,
     ["x_q is a numpy.ndarray"]),
    ("dequantize-x_q-rank5", lambda: fp8.dequantize(F((2, 300, 3, 1, 64), U8), D_BLOCK), ValueError,
     ["x_q has shape (2, 300, 3, 1, 64)", "rank 5"]),
    ("dequantize-descale-float16", lambda: fp8.dequantize(XQ, F((2, 3, 3), FP16)), TypeError,
     ["descale.dtype=float16", "float32"]),
    ("dequantize-descale-numpy", lambda: fp8.dequantize(XQ, np.ones((2, 3, 3), np.float32)), TypeError,
     ["descale is a numpy.ndarray"]),
    ("dequantize-descale-blocks-of-256", lambda: fp8.dequantize(XQ, F((2, 3, 2))), ValueError,
     ["descale has shape (2, 3, 2)", "(2, 3, 3)", "(2, 3)", "()"]),
    ("dequantize-descale-bhsd-shape-in-bshd", lambda: fp8.dequantize(XQ, F((2, 300, 3))), ValueError,
     ["descale has shape (2, 300, 3)"]),
    ("dequantize-descale-rank1", lambda: fp8.dequantize(XQ, F((3,))), ValueError, ["descale has shape (3,)"]),
    ("dequantize-descale-block-rows-64", lambda: fp8.dequantize(XQ, D_BLOCK, block_rows=64), ValueError,
     ["descale has shape (2, 3, 3)", "(2, 3, 5)", "block_rows=64"]),
    ("dequantize-descale-device-1", lambda: fp8.dequantize(XQ, F((2, 3, 3), device=1)), ValueError,
     ["descale is on device 1", "x_q is on device 0"]),
    ("dequantize-dtype-float64", lambda: fp8.dequantize(XQ, D_BLOCK, dtype=np.float64), TypeError,
     ["dtype=<class 'numpy.float64'>", "float16, bfloat16"]),
    ("dequantize-dtype-str", lambda: fp8.dequantize(XQ, D_BLOCK, dtype="e4m3"), TypeError, ["dtype='e4m3'"]),
    ("dequantize-layout", lambda: fp8.dequantize(XQ, D_BLOCK, layout="BSHD"), ValueError, ["layout='BSHD'"]),
    ("hadamard-head-dim-96", lambda: fp8.hadamard(F((2, 30, 3, 96)), 0), ValueError,
     ["head_dim=96", "last dim of x", "power of two", "32, 64, 128, 256"]),
    ("hadamard-head-dim-512", lambda: fp8.hadamard(F((2, 30, 3, 512)), 0), ValueError, ["head_dim=512"]),
    ("hadamard-head-dim-16", lambda: fp8.hadamard(F((2, 30, 3, 16)), 0), ValueError, ["head_dim=16"]),
    ("hadamard-seed-negative", lambda: fp8.hadamard(F((2, 30, 3, 64)), -1), ValueError, ["seed=-1", ">= 0"]),
    ("hadamard-seed-float", lambda: fp8.hadamard(F((2, 30, 3, 64)), 1.5), TypeError, ["seed=1.5", "int"]),
    ("hadamard-seed-bool", lambda: fp8.hadamard(F((2, 30, 3, 64)), True), TypeError, ["seed=True"]),
    ("hadamard-seed-none", lambda: fp8.hadamard(F((2, 30, 3, 64)), None), TypeError, ["seed=None"]),
    ("hadamard-x-uint8", lambda: fp8.hadamard(F((2, 30, 3, 64), U8), 0), TypeError, ["x.dtype=uint8"]),
    ("hadamard-x-rank2", lambda: fp8.hadamard(F((30, 64)), 0), ValueError, ["x has shape (30, 64)", "rank 2"]),
    ("hadamard-layout", lambda: fp8.hadamard(F((2, 30, 3, 64)), 0, layout="bsh"), ValueError, ["layout='bsh'"]),
    ("incoherent-head-dims-differ", lambda: fp8.incoherent(F((2, 30, 3, 64)), F((2, 30, 3, 128)), 0), ValueError,
     ["k has head_dim=128", "q has head_dim=64"]),
    ("incoherent-k-numpy", lambda: fp8.incoherent(F((2, 30, 3, 64)), np.zeros((2, 30, 3, 64), np.float32), 0),
     TypeError, ["k is a numpy.ndarray"]),
    ("incoherent-k-head-dim-48", lambda: fp8.incoherent(F((2, 30, 3, 64)), F((2, 30, 3, 48)), 0), ValueError,
     ["head_dim=48", "last dim of k"]),
    ("incoherent-k-device-1", lambda: fp8.incoherent(F((2, 30, 3, 64)), F((2, 30, 3, 64), device=1), 0), ValueError,
     ["k is on device 1", "q is on device 0"]),
]


@pytest.mark.parametrize("call,exc,fragments", [c[1:] for c in CPU_CASES], ids=[c[0] for c in CPU_CASES])
def test_bad_arguments_are_rejected_from_metadata(metadata_only, call, exc, fragments):
    with pytest.raises(exc) as info:
        call()
    missing = [f for f in fragments if f not in str(info.value)]
    assert not missing, f"{exc.__name__} message {str(info.value)!r} lacks {missing}"


# --- CPU: the kernel source through NVRTC -------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_kernels_compile_spill_free(arch):
    """Every template instance of cuflash.fp8's module compiles through NVRTC (no GPU needed), without spills."""
    try:
        nvrtc = _compile._nvrtc()
        nvrtc.getVersion()
    except Exception as e:  # CuPy or libnvrtc missing: nothing to compile with
        pytest.skip(f"NVRTC is not available: {e}")
    prog = nvrtc.createProgram(fp8._source(), "cuflash_fp8.cu", [], [])
    try:
        for name in fp8._INSTANCES:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, list(fp8._options()) + [f"-arch={arch}", "--ptxas-options=-v"])
        except nvrtc.NVRTCError:
            pytest.fail(f"NVRTC failed for {arch}:\n{nvrtc.getProgramLog(prog)}")
        log = nvrtc.getProgramLog(prog)
        lowered = [nvrtc.getLoweredName(prog, name) for name in fp8._INSTANCES]
    finally:
        nvrtc.destroyProgram(prog)
    assert len(set(lowered)) == len(fp8._INSTANCES)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert spills and not any(spills), f"spills for {arch}:\n{log}"


# --- GPU ----------------------------------------------------------------------------------------------------------

def cupy():
    import cupy as cp

    return cp


def device_x(shape, dtype: str, seed: int, outliers: int = 6):
    """CuPy standard normal values with a few outliers of magnitude 10, rounded to dtype (bf16 bit-wise)."""
    cp = cupy()
    return _xpref.to_lowp(cp.asarray(random_x(shape, seed, outliers)), dtype)


def host32(x) -> np.ndarray:
    """float32 NumPy copy of a CuPy fp16 / bf16 / fp32 array."""
    return cupy().asnumpy(_xpref.to_float32(x))


def host_native(x) -> np.ndarray:
    """NumPy copy with x's dtype (a bf16 array through its uint16 bits)."""
    cp = cupy()
    if x.dtype == BF16:
        return cp.asnumpy(x.view(cp.uint16)).view(BF16)
    return cp.asnumpy(x)


def poison_pool():
    """The next allocations (the outputs) are likely carved from a block of 0xFF bytes: NaN in every float dtype,
    and 0xFF (-NaN) in e4m3, so an element never written fails the comparisons (tests/gpu_helpers.poison_pool)."""
    from gpu_helpers import poison_pool as poison

    poison(1 << 24)


SHAPE = (2, 300, 3, 128)  # seqlen 300: a partial last block of 44 rows


def in_layout(shape_bshd, layout):
    b, s, h, d = shape_bshd
    return (b, s, h, d) if layout == "bshd" else (b, h, s, d)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_quantize_bit_equal_to_reference(scaling, layout, dtype):
    cp = cupy()
    what = f"{scaling} {layout} {dtype}"
    x = device_x(in_layout(SHAPE, layout), dtype, seed=zlib.crc32(what.encode()))
    x_before = host_native(x)
    poison_pool()
    x_q, descale = fp8.quantize(x, scaling=scaling, layout=layout)
    b, s, h, _ = SHAPE
    assert x_q.dtype == cp.uint8 and x_q.shape == x.shape and x_q.flags.c_contiguous, f"x_q for {what}"
    assert descale.dtype == cp.float32 and descale.shape == fp8.descale_shape(scaling, b, h, s), f"descale for {what}"
    want_q, want_d = fp8.quantize_reference(x_before, scaling=scaling, layout=layout)
    got_d = cp.asnumpy(descale)
    assert np.array_equal(got_d.view(np.uint32), want_d.view(np.uint32)), \
        f"descale differs for {what}: max |diff| {np.abs(got_d - want_d).max():.3e}"
    got_q = cp.asnumpy(x_q)
    n_bad = int((got_q != want_q).sum())
    assert n_bad == 0, f"{n_bad} of {got_q.size} e4m3 bits differ from the reference for {what}"
    # and ml_dtypes' own conversion of x / descale (|x / descale| <= 448 (1 + 2^-23): no saturation gap)
    xf = x_before.astype(np.float32)
    xf = xf if layout == "bshd" else xf.transpose(0, 2, 1, 3)
    v = xf / fp8._descale_rows(want_d, b, s, h, fp8.BLOCK_ROWS)
    ml = ml_dtypes_bits(v if layout == "bshd" else v.transpose(0, 2, 1, 3))
    assert np.array_equal(got_q, ml), f"e4m3 bits differ from ml_dtypes for {what}"
    assert np.array_equal(host_native(x).view(np.uint8), x_before.view(np.uint8)), f"x changed for {what}"


@pytest.mark.gpu
@pytest.mark.parametrize("block_rows", [1, 64, 100, 300, 512])
def test_quantize_other_block_rows(block_rows):
    """block_rows other than 128 (experiments only: the attention kernels read 128-row blocks)."""
    cp = cupy()
    x = device_x((2, 300, 3, 64), "bf16", seed=block_rows)
    x_q, descale = fp8.quantize(x, block_rows=block_rows)
    want_q, want_d = fp8.quantize_reference(host_native(x), block_rows=block_rows)
    assert descale.shape == (2, 3, -(-300 // block_rows))
    assert np.array_equal(cp.asnumpy(descale), want_d) and np.array_equal(cp.asnumpy(x_q), want_q), \
        f"block_rows={block_rows}"
    y = fp8.dequantize(x_q, descale, block_rows=block_rows)
    assert np.array_equal(cp.asnumpy(y), fp8.dequantize_reference(want_q, want_d, block_rows=block_rows))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [1, 3, 72, 96, 255, 300, 600])
@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_quantize_any_head_dim(scaling, head_dim):
    """quantize and dequantize take any head_dim (the tile walk steps over rows of any length)."""
    cp = cupy()
    x = device_x((2, 130, 3, head_dim), "fp32", seed=head_dim, outliers=2)
    x_q, descale = fp8.quantize(x, scaling=scaling)
    want_q, want_d = fp8.quantize_reference(cp.asnumpy(x), scaling=scaling)
    assert np.array_equal(cp.asnumpy(descale), want_d) and np.array_equal(cp.asnumpy(x_q), want_q), \
        f"{scaling} head_dim={head_dim}"
    y = fp8.dequantize(x_q, descale)
    assert np.array_equal(cp.asnumpy(y), fp8.dequantize_reference(want_q, want_d)), f"dequantize head_dim={head_dim}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["transposed", "padded", "negative-stride", "misaligned"])
@pytest.mark.parametrize("scaling", ["head", "block"])
def test_strided_inputs_equal_contiguous(scaling, kind):
    """Any strides give the bits of the contiguous copy: aligned rows take the kernels' 16-byte path, the others
    ("padded": head_dim strided; "misaligned": rows one element off 16 bytes) one element at a time."""
    cp = cupy()
    base = device_x((2, 3, 300, 64), "fp16", seed=5)
    if kind == "transposed":  # a bhsd array read as bshd
        x = base.transpose(0, 2, 1, 3)
    elif kind == "padded":    # every dim strided, head_dim too
        x = device_x((3, 301, 4, 128), "fp16", seed=6)[1:, 1:, 1:, ::2]
    elif kind == "negative-stride":
        x = base.transpose(0, 2, 1, 3)[:, ::-1]
    else:
        x = device_x((2, 300, 3, 65), "fp16", seed=7)[..., 1:]
    x_q, descale = fp8.quantize(x, scaling=scaling)
    want_q, want_d = fp8.quantize(cp.ascontiguousarray(x), scaling=scaling)
    assert bool((x_q == want_q).all()) and bool((descale == want_d).all()), f"quantize, {kind} {scaling}"
    # dequantize of an x_q view of the same kind
    if kind == "transposed":
        q_view = cp.ascontiguousarray(x_q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    elif kind == "padded":
        big = cp.zeros((3, 301, 4, 128), dtype=cp.uint8)
        big[1:, 1:, 1:, ::2] = x_q
        q_view = big[1:, 1:, 1:, ::2]
    elif kind == "negative-stride":
        q_view = cp.ascontiguousarray(x_q[:, ::-1])[:, ::-1]
    else:
        big = cp.zeros((2, 300, 3, 65), dtype=cp.uint8)
        big[..., 1:] = x_q
        q_view = big[..., 1:]
    for dtype in (np.float32, BF16):
        got, want = fp8.dequantize(q_view, descale, dtype=dtype), fp8.dequantize(x_q, descale, dtype=dtype)
        assert bool((_xpref.to_float32(got) == _xpref.to_float32(want)).all()), f"dequantize, {kind} {dtype}"


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", SCALINGS)
def test_quantize_empty_and_zero(scaling):
    cp = cupy()
    x_q, descale = fp8.quantize(cp.zeros((2, 0, 3, 64), dtype=cp.float32), scaling=scaling)
    assert x_q.shape == (2, 0, 3, 64) and x_q.dtype == cp.uint8
    assert descale.shape == fp8.descale_shape(scaling, 2, 3, 0) and bool((descale == 1).all())
    x_q, descale = fp8.quantize(cp.zeros((1, 200, 2, 64), dtype=cp.float16), scaling=scaling)
    assert not bool(x_q.any()) and bool((descale == 1).all()), f"all-zero input, {scaling}"


@pytest.mark.gpu
@pytest.mark.parametrize("out", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scaling", SCALINGS)
def test_dequantize_of_quantize(scaling, layout, out):
    """dequantize is e4m3_value(x_q) * descale rounded once to its dtype (bit-equal to the reference), and is x
    within e4m3's error: half a step of 3 mantissa bits, 2^-4 |x|, or of the subnormal step, 2^-10 descale (so
    within 2^-4 of the group's amax), plus the output dtype's rounding."""
    cp = cupy()
    what = f"{scaling} {layout} -> {out}"
    x = device_x(in_layout(SHAPE, layout), "fp32", seed=11)
    x_q, descale = fp8.quantize(x, scaling=scaling, layout=layout)
    out_dtype = _validate.NUMPY_DTYPES[out]
    poison_pool()
    y = fp8.dequantize(x_q, descale, layout=layout, dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == x.shape and y.flags.c_contiguous, f"y for {what}"
    ref32 = fp8.dequantize_reference(cp.asnumpy(x_q), cp.asnumpy(descale), layout=layout)
    got = host_native(y)
    assert np.array_equal(got.view(np.uint8), ref32.astype(out_dtype).view(np.uint8)), \
        f"dequantize differs from the reference for {what}"
    xh = cp.asnumpy(x)
    xb, gotb = (xh, got) if layout == "bshd" else (xh.transpose(0, 2, 1, 3), got.transpose(0, 2, 1, 3))
    d_rows = fp8._descale_rows(cp.asnumpy(descale), *xb.shape[:3], fp8.BLOCK_ROWS)
    eps_out = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}[out]  # relative rounding to the output dtype
    tiny_out = 2.0**-25 if out == "fp16" else 0.0                        # half fp16's subnormal step
    err = np.abs(gotb.astype(np.float64) - xb)
    bound = ((2.0**-4 + 2.0**-20 + 2 * eps_out) * np.abs(xb) + 2.0**-10 * d_rows * (1 + 2.0**-20 + 2 * eps_out)
             + tiny_out)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"error past e4m3's for {what}: {err[worst]:.3e} > {bound[worst]:.3e} at {worst}"


def sylvester(n: int) -> np.ndarray:
    """H_n by Sylvester's recursion: H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def explicit_r(seed: int, d: int) -> np.ndarray:
    """float64 R = diag(s) H_D / sqrt(D), s = 1 - 2 * default_rng(seed).integers(0, 2, D)."""
    s = 1.0 - 2.0 * np.random.default_rng(seed).integers(0, 2, size=d)
    return s[:, None] * sylvester(d) / math.sqrt(d)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", fp8.HADAMARD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hadamard_matches_explicit_matrix(dtype, head_dim, layout):
    """y = x R against a float64 matmul: float32 arithmetic (log2(D) butterfly levels of u = 2^-24, on sums bounded
    by sqrt(D) |x_row| before the 1 / sqrt(D)), then one rounding to the dtype."""
    what = f"{dtype} D={head_dim} {layout}"
    x = device_x(in_layout((2, 37, 3, head_dim), layout), dtype, seed=head_dim)
    poison_pool()
    y = fp8.hadamard(x, 1234, layout=layout)
    assert y.dtype == x.dtype and y.shape == x.shape and y.flags.c_contiguous, f"y for {what}"
    x64 = host32(x).astype(np.float64)
    ref = x64 @ explicit_r(1234, head_dim)
    eps_out = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}[dtype]
    row_norm = np.linalg.norm(x64, axis=-1, keepdims=True)
    bound = eps_out * np.abs(ref) + 2 * (math.log2(head_dim) + 1) * 2.0**-24 * row_norm * (1 + eps_out) + 2.0**-24
    err = np.abs(host32(y) - ref)
    assert not np.isnan(err).any(), f"NaN (an unwritten element?) in y for {what}"
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"hadamard mismatch for {what}: {err[worst]:.3e} > {bound[worst]:.3e} at {worst}"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", fp8.HADAMARD_DIMS)
def test_hadamard_preserves_q_k_transpose(head_dim):
    """R is orthogonal: (q R)(k R)^T = q k^T, to float32 accuracy for float32 inputs (outliers included)."""
    cp = cupy()
    q, k = device_x((2, 64, 2, head_dim), "fp32", seed=1), device_x((2, 80, 2, head_dim), "fp32", seed=2)
    qh, kh = fp8.incoherent(q, k, seed=99)
    q64, k64, qh64, kh64 = (cp.asnumpy(a).astype(np.float64).transpose(0, 2, 1, 3) for a in (q, k, qh, kh))
    s, sh = q64 @ k64.transpose(0, 1, 3, 2), qh64 @ kh64.transpose(0, 1, 3, 2)
    norms = np.linalg.norm(q64, axis=-1)[..., :, None] * np.linalg.norm(k64, axis=-1)[..., None, :]
    err = np.abs(sh - s) / norms
    tol = 4 * (math.log2(head_dim) + 2) * 2.0**-24
    assert err.max() <= tol, f"q k^T changed by {err.max():.2e} |q| |k| > {tol:.2e} for D={head_dim}"


@pytest.mark.gpu
def test_hadamard_spreads_an_outlier_over_every_channel():
    """x = 10 e_j gives y = 10 s_j H[j, :] / sqrt(D): every |y| is 10 / sqrt(D)."""
    cp = cupy()
    x = cp.zeros((1, 4, 1, 128), dtype=cp.float32)
    x[0, cp.arange(4), 0, cp.asarray([0, 5, 64, 127])] = 10.0
    y = cp.asnumpy(fp8.hadamard(x, 3))
    np.testing.assert_allclose(np.abs(y), 10 / math.sqrt(128), rtol=2.0**-22)
    np.testing.assert_allclose(y[0, :, 0], 10 * explicit_r(3, 128)[[0, 5, 64, 127]], rtol=2.0**-22)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_hadamard_seeds_and_strides(dtype):
    """One seed gives bit-identical results (and incoherent is hadamard twice), another seed another R; a strided
    input gives the contiguous input's bits."""
    cp = cupy()
    q = device_x((2, 50, 3, 64), dtype, seed=3)
    k = device_x((2, 70, 3, 64), dtype, seed=4)
    a, b = fp8.hadamard(q, 5), fp8.hadamard(q, 5)
    assert bool((a.view(cp.uint16 if dtype != "fp32" else cp.uint32) ==
                 b.view(cp.uint16 if dtype != "fp32" else cp.uint32)).all()), "same seed, different bits"
    c = fp8.hadamard(q, 6)
    assert not bool((_xpref.to_float32(a) == _xpref.to_float32(c)).all()), "seeds 5 and 6 gave the same transform"
    qh, kh = fp8.incoherent(q, k, 5)
    assert bool((_xpref.to_float32(qh) == _xpref.to_float32(a)).all())
    assert bool((_xpref.to_float32(kh) == _xpref.to_float32(fp8.hadamard(k, 5))).all())
    # strided: bhsd data transposed into bshd, and a view with every dim strided
    t = fp8.hadamard(cp.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3), 5)
    assert bool((_xpref.to_float32(t) == _xpref.to_float32(a)).all()), "transposed input"
    big = device_x((3, 51, 4, 128), dtype, seed=7)
    for kind, view in (("strided", big[1:, 1:, 1:, ::2]), ("misaligned", big[1:, 1:, 1:, 1:65])):
        got = fp8.hadamard(view, 5)
        want = fp8.hadamard(cp.ascontiguousarray(view), 5)
        assert bool((_xpref.to_float32(got) == _xpref.to_float32(want)).all()), f"{kind} input"
    # bhsd is the same row-wise transform
    assert bool((_xpref.to_float32(fp8.hadamard(q, 5, layout="bhsd")) == _xpref.to_float32(a)).all())


@pytest.mark.gpu
def test_hadamard_empty():
    cp = cupy()
    y = fp8.hadamard(cp.zeros((2, 0, 3, 64), dtype=cp.float16), 0)
    assert y.shape == (2, 0, 3, 64) and y.dtype == cp.float16


@pytest.fixture
def no_launch(monkeypatch):
    """Real CuPy arrays; allocating through cuflash or fetching a kernel fails the test."""
    def no_gpu(*args, **kwargs):
        raise AssertionError("cuflash.fp8 allocated or launched before rejecting the bad input")

    monkeypatch.setattr(_launch, "cupy", no_gpu)
    monkeypatch.setattr(fp8, "_kernel", no_gpu)


GPU_CASES = [  # (id, call on arrays a = {x, x_q, descale, ...}, exception, fragments)
    ("quantize-x-rank3", lambda a: fp8.quantize(a["x"][0]), ValueError, ["x has shape (300, 3, 64)"]),
    ("quantize-x-int32", lambda a: fp8.quantize(a["x_int"]), TypeError, ["x.dtype=int32"]),
    ("quantize-scaling", lambda a: fp8.quantize(a["x"], scaling="channel"), ValueError, ["scaling='channel'"]),
    ("dequantize-x_q-float32", lambda a: fp8.dequantize(a["x"], a["descale"]), TypeError, ["x_q.dtype=float32"]),
    ("dequantize-descale-shape", lambda a: fp8.dequantize(a["x_q"], a["descale"][:, :, :2]), ValueError,
     ["descale has shape (2, 3, 2)"]),
    ("dequantize-descale-float16", lambda a: fp8.dequantize(a["x_q"], a["descale"].astype("float16")), TypeError,
     ["descale.dtype=float16"]),
    ("hadamard-head-dim-96", lambda a: fp8.hadamard(a["x96"], 0), ValueError, ["head_dim=96"]),
    ("hadamard-seed", lambda a: fp8.hadamard(a["x"], -3), ValueError, ["seed=-3"]),
    ("incoherent-head-dims", lambda a: fp8.incoherent(a["x"], a["x128"], 0), ValueError,
     ["k has head_dim=128", "q has head_dim=64"]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("call,exc,fragments", [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
def test_bad_arrays_are_rejected_before_any_launch(no_launch, call, exc, fragments):
    cp = cupy()
    x = cp.full((2, 300, 3, 64), cp.nan, dtype=cp.float32)  # NaN-poisoned: every input must come back bit-identical
    arrays = {"x": x, "x_int": cp.zeros((2, 300, 3, 64), dtype=cp.int32), "x_q": cp.full(x.shape, 0x7F, cp.uint8),
              "descale": cp.ones((2, 3, 3), dtype=cp.float32), "x96": cp.full((2, 300, 3, 96), cp.nan, cp.float32),
              "x128": cp.full((2, 30, 3, 128), cp.nan, cp.float32)}
    before = {name: cp.asnumpy(a).tobytes() for name, a in arrays.items()}
    with pytest.raises(exc) as info:
        call(arrays)
    missing = [f for f in fragments if f not in str(info.value)]
    assert not missing, f"{exc.__name__} message {str(info.value)!r} lacks {missing}"
    changed = [name for name, a in arrays.items() if cp.asnumpy(a).tobytes() != before[name]]
    assert not changed, f"inputs changed: {changed}"
