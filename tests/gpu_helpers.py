"""Helpers of the GPU tests: random inputs in either layout with awkward strides, best-effort output
poisoning, and the pass rule of docs/RELIABILITY.md with float64 / low-precision references computed on
the GPU (cuflash._xpref: the math of cuflash.reference in CuPy matmuls; tests/test_reference.py checks
that they agree with cuflash.reference on NumPy arrays)."""
from __future__ import annotations

import zlib

import cupy as cp
import numpy as np

from cuflash import _compile, _xpref

# Awkward (seqlen_q, seqlen_k) pairs and the head dims with their own kernels
SEQLEN_PAIRS = [(113, 203), (128, 217), (108, 256), (256, 512), (512, 256), (1023, 1024), (1024, 1023), (1, 239),
                (3, 799), (127, 513)]
HEAD_DIMS = [32, 64, 96, 128, 256]
DTYPES = ["fp16", "bf16"]
LAYOUTS = ["bshd", "bhsd"]
STRIDE_KINDS = ["contiguous", "padded", "transposed", "misaligned"]


def seed_of(*key) -> int:
    """A stable seed per test case (fresh inputs for every case, reproducible across runs)."""
    return zlib.crc32(repr(key).encode())


def batch_heads(seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """Small batch and head counts; one batch for the largest pairs keeps the references quick."""
    return (1, 2) if seqlen_q * seqlen_k > 300_000 else (2, 3)


def randn(shape, dtype: str, seed: int, scale: float = 1.0):
    """Standard normal values (times scale) rounded to dtype ("fp16"/"bf16"/"fp32"; "fp64": drawn in float64, all
    53 bits random): a contiguous CuPy array."""
    if 0 in shape:  # nothing to draw (and cuRAND is not asked for zero numbers)
        return _xpref.to_lowp(cp.empty(shape, dtype=cp.float32), dtype)
    if dtype == "fp64":
        x = cp.random.RandomState(seed).standard_normal(shape, dtype=cp.float64)
        return x * scale if scale != 1.0 else x
    x = cp.random.RandomState(seed).standard_normal(shape, dtype=cp.float32)
    if scale != 1.0:
        x *= scale
    return _xpref.to_lowp(x, dtype)


def make_input(b, s, h, d, dtype, layout, kind, seed, scale=1.0):
    """A (B, S, H, D) ("bshd") or (B, H, S, D) ("bhsd") array whose strides follow `kind`:
      contiguous  a fresh C-contiguous array
      padded      a view into a larger buffer: every batch/row/head stride padded, start offset (16-byte aligned)
      transposed  the other layout's contiguous array, transposed into this layout
      misaligned  head stride D + 4 elements (fp16/bf16; D + 1 for fp32/fp64): not 16-byte aligned, so the library
                  copies it (still correct)
    """
    logical = (b, s, h, d) if layout == "bshd" else (b, h, s, d)
    if kind == "contiguous":
        return randn(logical, dtype, seed, scale)
    if kind == "padded":
        pad = (1, 3, 1) if layout == "bshd" else (1, 1, 3)  # 1 extra batch, 3 extra rows, 1 extra head
        big = randn(tuple(n + p for n, p in zip(logical[:3], pad)) + (d + 8,), dtype, seed, scale)
        return big[pad[0]:, pad[1]:, pad[2]:, :d]
    if kind == "transposed":
        other = (b, h, s, d) if layout == "bshd" else (b, s, h, d)
        return randn(other, dtype, seed, scale).transpose(0, 2, 1, 3)
    if kind == "misaligned":
        return randn(logical[:3] + (d + (1 if dtype in ("fp32", "fp64") else 4),), dtype, seed, scale)[..., :d]
    raise ValueError(f"kind={kind!r}")


def to_bshd32(x, layout: str):
    """float32 copy of an fp16/bf16 array in (B, S, H, D) order."""
    x32 = _xpref.to_float32(x)
    return x32 if layout == "bshd" else x32.transpose(0, 2, 1, 3)


def poison_pool(nbytes: int):
    """Best-effort output poisoning: the CuPy pool is emptied, then one block of `nbytes` filled with 0xFF
    bytes (NaN in fp16, bf16 and fp32) is allocated and freed. The pool keeps it, and the next allocations
    (the outputs and workspaces of the call under test) are usually carved from it, so an element the
    kernel never writes shows up as NaN. Not guaranteed by CuPy; test_poisoning_reaches_the_outputs
    checks that it happens. Returns the block's address."""
    pool = cp.get_default_memory_pool()
    cp.cuda.get_current_stream().synchronize()
    pool.free_all_blocks()
    junk = cp.full(int(nbytes), 0xFF, dtype=cp.uint8)
    ptr = junk.data.ptr
    del junk
    return ptr


def round_up(n: int, to: int = 512) -> int:
    """CuPy's pool rounds each allocation up to 512 bytes."""
    return -(-n // to) * to


def max_abs(x) -> float:
    return float(cp.abs(x).max()) if x.size else 0.0


def check_rule(name: str, got, ref64, lowp, factor: float, what: str, extra: float = 1e-5):
    """The pass rule (docs/RELIABILITY.md): max|got - ref64| <= factor * max|lowp - ref64| + extra, and no NaN/inf."""
    assert not bool(cp.isnan(got).any()), f"{name} has NaN (unwritten or invalid) for {what}"
    assert bool(cp.isfinite(got).all()), f"{name} has inf for {what}"
    err = max_abs(got - ref64)
    bound = factor * max_abs(lowp - ref64) + extra
    assert err <= bound, (f"{name} mismatch for {what}: {err:.3e} > {bound:.3e} "
                          f"({factor:g} x low-precision error + {extra:g})")
    return err, bound


def backward_problem(tag: str, b, sq, sk, hq, hkv, d, dtype, causal, kinds=("contiguous",) * 4, key=()):
    """q, k, v, dout (bshd, the given stride kinds) and the forward's o, lse of one backward test case."""
    import cuflash
    seed = seed_of(tag, b, sq, sk, hq, hkv, d, dtype, causal, kinds, *key)
    q = make_input(b, sq, hq, d, dtype, "bshd", kinds[0], seed)
    k = make_input(b, sk, hkv, d, dtype, "bshd", kinds[1], seed + 1)
    v = make_input(b, sk, hkv, d, dtype, "bshd", kinds[2], seed + 2)
    dout = make_input(b, sq, hq, d, dtype, "bshd", kinds[3], seed + 3)
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    return q, k, v, dout, o, lse


def check_backward(grads, q, k, v, dout, dtype, causal, what):
    """dq, dk, dv (bshd) by the pass rule with factor 3, against the float64 and plain low-precision backward (GQA:
    dk, dv summed over each group); shapes and dtypes those of q, k, v."""
    q32, k32, v32, do32 = (to_bshd32(x, "bshd") for x in (q, k, v, dout))
    refs64 = _xpref.attention_backward64(do32, q32, k32, v32, causal)
    lowp = _xpref.attention_backward_lowp(do32, q32, k32, v32, dtype, causal)
    for name, g, x, g64, glowp in zip(("dq", "dk", "dv"), grads, (q, k, v), refs64, lowp):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name} is {g.shape} {g.dtype} for {what}"
        check_rule(name, to_bshd32(g, "bshd"), g64, glowp, 3.0, what)


def check_lse(lse, lse64, what: str, atol: float = 1e-3):
    """lse (B, H, Sq) float32 against float64: -inf exactly where the row sees no key, else within atol."""
    assert lse.dtype == cp.float32, f"lse dtype {lse.dtype} for {what}"
    assert lse.shape == lse64.shape, f"lse shape {lse.shape} != {lse64.shape} for {what}"
    finite64 = cp.isfinite(lse64)
    assert not bool(cp.isnan(lse).any()), f"lse has NaN for {what}"
    assert bool((cp.isfinite(lse) == finite64).all()), f"lse is -inf in other rows than the reference for {what}"
    assert bool((lse[~finite64] == -cp.inf).all()), f"fully masked rows must have lse = -inf for {what}"
    err = max_abs(cp.where(finite64, lse, 0.0) - cp.where(finite64, lse64, 0.0))
    assert err <= atol, f"lse mismatch for {what}: {err:.3e} > {atol:g}"


def warm_kernel_cache(configs, arch: str | None = None) -> None:
    """Compile (or load from the disk cache) the given kernel configs on all CPUs before the tests, so the tests do
    not compile one kernel at a time. The misses go to processes (cuflash.check.compile_configs: NVRTC holds the GIL,
    so threads compiled one kernel at a time), and pytest-xdist's workers take turns through a lock file in the
    kernel cache: the first compiles what is missing on all CPUs, the next find it cached (each worker compiling
    everything in threads made a run of the float32 test files without a filled cache compile-bound for minutes).
    A config that fails to compile is left to its tests."""
    import fcntl

    from cuflash import check

    arch = arch or _compile.device_arch()
    cache = _compile.cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".warm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            check.compile_configs(configs, arch)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --- packed (varlen) inputs, KV caches, bit-for-bit comparisons --------------------------------------------

def bits(x):
    """A copy of x's bit pattern as unsigned integers of its item size (compare fp16/bf16/fp32 exactly)."""
    width = {1: cp.uint8, 2: cp.uint16, 4: cp.uint32, 8: cp.uint64}[x.dtype.itemsize]
    return cp.ascontiguousarray(x.view(width))


def same_bits(a, b) -> bool:
    return a.shape == b.shape and bool(cp.array_equal(bits(a), bits(b)))


def check_replay_matches_full_path(call, what: str, names=("o", "lse", "dq", "dk", "dv", "dbias")) -> None:
    """call(seed) runs a forward and a backward of one call signature on inputs made from seed and returns their
    outputs. The first call makes the two plans and the second replays them on new inputs; the same second call on
    the full path (plans cleared) must give the same outputs, bit for bit."""
    from cuflash import _plan

    _plan.plans.clear()
    try:
        call(100)
        assert len(_plan.plans) == 2, f"the first call made {len(_plan.plans)} plans ({what})"
        replayed = call(200)
        assert len(_plan.plans) == 2, f"the second call made plans of its own ({what})"
        _plan.plans.clear()
        full = call(200)
    finally:
        _plan.plans.clear()
    assert len(replayed) == len(full)
    for name, x, y in zip(names, replayed, full):
        assert same_bits(x, y), f"{name} of the replayed call differs from the full path's ({what})"


def make_packed(total: int, h: int, d: int, dtype: str, kind: str, seed: int, scale: float = 1.0):
    """A packed (total, H, D) array (varlen layout) whose token/head strides follow `kind`:
      contiguous  a fresh C-contiguous array
      padded      a view into (total + 3, H + 1, D + 8): token and head strides padded, start offset (16-byte aligned)
      transposed  a head-major (H, total, D) array transposed: token stride D, head stride total * D
    """
    if kind == "contiguous":
        return randn((total, h, d), dtype, seed, scale)
    if kind == "padded":
        return randn((total + 3, h + 1, d + 8), dtype, seed, scale)[3:, 1:, :d]
    if kind == "transposed":
        return randn((h, total, d), dtype, seed, scale).transpose(1, 0, 2)
    raise ValueError(f"kind={kind!r}")


def cu_seqlens(lengths):
    """int32 CuPy cumulative lengths [0, l0, l0 + l1, ...] (batch + 1 entries)."""
    import numpy as np

    return cp.asarray(np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int32))


def random_lengths(seed: int, n: int, high: int, forced: dict):
    """n sequence lengths drawn uniformly from [0, high], with lengths[i] = forced[i] for the given positions."""
    import numpy as np

    lengths = np.random.default_rng(seed).integers(0, high + 1, n)
    for i, length in forced.items():
        lengths[i] = length
    return [int(x) for x in lengths]


# --- float32 and float64 inputs (tests/test_gpu_wide.py) ----------------------------------------------------------

def to_bshd(x, layout: str):
    """x (any dtype) in (B, S, H, D) order: a view, no conversion (to_bshd32 would round float64 to float32)."""
    return x if layout == "bshd" else x.transpose(0, 2, 1, 3)


def float32_matmul_rounds_to_tf32() -> bool:
    """Whether CuPy's float32 matmul (a batched one, as the references do) rounds its inputs to TF32: CuPy does with
    CUPY_TF32=1, cuBLAS with NVIDIA_TF32_OVERRIDE=1. (1 + 2^-20) times the identity is exact in float32, 1 in TF32."""
    a = cp.full((1, 2, 16, 16), 1 + 2.0 ** -20, dtype=cp.float32)
    eye = cp.broadcast_to(cp.eye(16, dtype=cp.float32), (1, 2, 16, 16))
    return not bool(cp.array_equal(a @ eye, a))


def _on_module_of(ref, x):
    """x (CuPy or NumPy) as an array of ref's module and dtype: host arrays for a NumPy (e.g. np.longdouble) ref."""
    if isinstance(ref, np.ndarray):
        return np.asarray(_xpref.to_host(x)).astype(ref.dtype)
    return cp.asarray(x, dtype=cp.float64)


def _max_abs_any(x) -> float:
    if not x.size:
        return 0.0
    return float(abs(x).max())


def check_rule_wide(name: str, got, ref, plain, factor: float, what: str, floor: float):
    """The pass rule of float32 / float64 inputs: max|got - ref| <= factor * max|plain - ref| + floor * max(1,
    max|ref|), and no NaN or inf in got. ref: a CuPy float64 array (got and plain then compared in float64 on the
    GPU) or a NumPy one (np.longdouble: got and plain are copied to the host and compared in its dtype). Returns
    (error, bound)."""
    assert not bool(cp.isnan(got).any()), f"{name} has NaN (unwritten or invalid) for {what}"
    assert bool(cp.isfinite(got).all()), f"{name} has inf for {what}"
    assert got.shape == ref.shape, f"{name} has shape {got.shape}, the reference {ref.shape}, for {what}"
    err = _max_abs_any(_on_module_of(ref, got) - ref)
    plain_err = _max_abs_any(_on_module_of(ref, plain) - ref)
    bound = factor * plain_err + floor * max(1.0, _max_abs_any(ref))
    assert err <= bound, (f"{name} mismatch for {what}: {err:.3e} > {bound:.3e} ({factor:g} x the plain error "
                          f"{plain_err:.3e} + {floor:g} x max(1, max|ref|))")
    return err, bound


def check_lse_wide(lse, ref, plain, what: str, floor: float, dtype):
    """lse of float32 / float64 inputs: of `dtype` (cp.float32 or cp.float64) and ref's shape, no NaN, -inf exactly
    where the reference row sees no key, and on the other rows the pass rule with factor 2 against the plain lse."""
    assert lse.dtype == dtype, f"lse dtype {lse.dtype}, expected {cp.dtype(dtype)}, for {what}"
    assert lse.shape == ref.shape, f"lse shape {lse.shape} != {ref.shape} for {what}"
    assert not bool(cp.isnan(lse).any()), f"lse has NaN for {what}"
    got, plain = _on_module_of(ref, lse), _on_module_of(ref, plain)
    xp = _xpref.array_module(ref)
    seen = xp.isfinite(ref)
    assert bool((xp.isfinite(got) == seen).all()), f"lse is -inf in other rows than the reference's for {what}"
    assert bool((got[~seen] == -xp.inf).all()), f"rows that see no key must have lse = -inf for {what}"
    zero = xp.zeros((), dtype=ref.dtype)
    ref_seen = xp.where(seen, ref, zero)  # -inf rows out of the differences (-inf - -inf is NaN)
    err = _max_abs_any(xp.where(seen, got, zero) - ref_seen)
    plain_err = _max_abs_any(xp.where(seen, plain, zero) - ref_seen)
    bound = 2 * plain_err + floor * max(1.0, _max_abs_any(ref_seen))
    assert err <= bound, (f"lse mismatch for {what}: {err:.3e} > {bound:.3e} (2 x the plain error {plain_err:.3e} + "
                          f"{floor:g} x max(1, max|lse_ref|))")
