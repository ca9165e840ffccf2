"""`python -m cuflash.check sanitize`: compute-sanitizer over a representative set of kernel launches.

    python -m cuflash.check sanitize                      # memcheck, racecheck, initcheck, synccheck; < 6 min on an H100
    python -m cuflash.check sanitize --quick --tools memcheck
    python -m cuflash.check sanitize --out $OUT/sanitize  # logs: one file per tool and shard, plus the reference run
    python -m cuflash.check cases [--quick]               # list the case set (and its cost estimate)

What `sanitize` does:
  1. compiles every kernel the cases need through NVRTC, in parallel processes (NVRTC holds the GIL, so
     threads do not help), into the disk cache (~/.cache/cuflash), so no sanitized process compiles;
  2. runs the driver (`python -m cuflash.check _driver`) once without a sanitizer, checking every case
     against the float64 reference (the pass rule of README.md, Tests) and recording a digest of each output;
  3. runs the driver under `compute-sanitizer --tool T --error-exitcode 99` for each tool, the cases split
     over a few shard processes per tool, all tools at once, and parses each tool's summary
     ("ERROR SUMMARY: N errors", racecheck's "RACECHECK SUMMARY: ... (E errors, W warnings)");
  4. prints one row per tool (cases done, errors, output digests that differ from the unsanitized run,
     seconds), the first findings of any tool that reported one, and exits non-zero on any finding,
     digest mismatch, driver failure or timeout.

The driver is built so that the sanitizers see (almost) only cuflash's kernels, on exactly-sized
allocations: inputs are generated on the host and copied up (no CuPy random/elementwise kernels), CuPy's
memory pool is switched off (every array is its own cudaMalloc, so memcheck sees a read one byte past an
array; `--padding` adds a guard after each allocation where the tool supports it), and outputs are checked
on the host. Strided cases use views into larger, fully initialized buffers (initcheck stays meaningful);
the "misaligned" case makes the library copy its input with one CuPy kernel.

Every case runs the forward, the default backward (atomic dQ) and the deterministic backward, so each
case covers one (head dim, dtype, causal) instantiation of every kernel; the default set covers every
shipped instantiation (6 kernel head dims x 2 dtypes x causal/not) plus zero-padded head dims.

initcheck: the kernels read no uninitialized memory by design (cp.async with src-size 0 zero-fills a
tail row without reading it), so any initcheck report is a finding, not noise.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass

from . import _compile, config

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# Processes per tool. racecheck is by far the slowest (it tracks every shared-memory access), so it gets
# the most shards; all shards of all tools run at once (16 CPUs and one GPU on the H100 machine).
DEFAULT_SHARDS = {"memcheck": 2, "racecheck": 5, "initcheck": 2, "synccheck": 2}
SANITIZER_EXIT = 99
LAYOUTS = ("bshd", "bhsd")
STRIDES = ("contiguous", "padded", "transposed", "misaligned")


# --- the case set ------------------------------------------------------------------------------------

KINDS = ("dense", "varlen", "kvcache")


@dataclass(frozen=True)
class Case:
    """One problem. dense and varlen: forward, default backward and deterministic backward are all run on it;
    kvcache: attention_with_kvcache (forward only), appending seqlen_q new keys into a cache of seqlen_k."""

    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    head_dim: int
    dtype: str     # "fp16" | "bf16"
    causal: bool
    layout: str    # "bshd" | "bhsd" (dense only)
    strides: str   # one of STRIDES, for q, k, v and dout (dense only)
    kind: str = "dense"    # one of KINDS; varlen: batch sequences of lengths cycling through seqlen, 1, 0, 17
    kv_heads: int = 0      # K/V heads (GQA); 0: heads
    paged: bool = False    # kvcache: a paged cache of 64-key pages in shuffled order
    splits: int = 0        # kvcache: num_splits (0: the heuristic)
    mods: int = 0          # dense: score modifiers (config.MOD_* bits), with the values of `mod_options`

    @property
    def heads_kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def kernel_head_dim(self) -> int:
        return config.kernel_head_dim(self.head_dim)

    @property
    def cost(self) -> float:
        """Relative cost under a sanitizer: a fixed part per launch plus the work of the tiles."""
        work = self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.kernel_head_dim
        return 5.0 + work / 1e6

    def mod_options(self, rng=None) -> dict:
        """cuflash keyword arguments of the case's modifiers: window (37, 5), ALiBi slopes (heads,) in [0, 0.3)
        (random with rng, else None as a placeholder), softcap 20, dropout 0.17 with a seed from the name, a bias
        (1, seqlen_q, seqlen_k) shared by the heads (its gradient sums over them: atomics) and a mask
        (seqlen_q, seqlen_k) keeping 90 % of the pairs (NumPy arrays with rng, else None)."""
        kw = {}
        if self.mods & config.MOD_WINDOW:
            kw["window"] = (37, 5)
        if self.mods & config.MOD_ALIBI:
            kw["alibi_slopes"] = None if rng is None else rng.random(self.heads) * 0.3
        if self.mods & config.MOD_SOFTCAP:
            kw["softcap"] = 20.0
        if self.mods & config.MOD_DROPOUT:
            kw.update(dropout_p=0.17, seed=zlib.crc32(self.name.encode()), offset=3)
        if self.mods & config.MOD_BIAS:
            kw["bias"] = None if rng is None else rng.standard_normal((1, self.seqlen_q, self.seqlen_k))
        if self.mods & config.MOD_MASK:
            kw["mask"] = None if rng is None else rng.random((self.seqlen_q, self.seqlen_k)) < 0.9
        return kw

    @property
    def kernel_causal(self) -> bool:
        """The kernels' causal flag: a window carries causal itself (right = 0)."""
        return self.causal and not self.mods & config.MOD_WINDOW

    def configs(self, arch: str = config.DEFAULT_ARCH, kernels: str | None = None) -> list:
        """Every kernel config this case launches on `arch` with the kernel family `kernels` (default:
        CUFLASH_KERNELS, see cuflash.config.KERNELS)."""
        hd = self.kernel_head_dim
        if self.mods:
            c, m = self.kernel_causal, self.mods
            return [config.forward_kernel_config(hd, self.dtype, c, arch, kernels, mods=m, seqlen_k=self.seqlen_k),
                    config.backward_kernel_config(hd, self.dtype, c, False, arch, kernels, mods=m),
                    config.backward_kernel_config(hd, self.dtype, c, True, arch, kernels, mods=m),
                    config.dq_config(hd, self.dtype, c, m),
                    config.ElementwiseConfig("preprocess", self.dtype),
                    config.ElementwiseConfig("convert_dq", self.dtype)] + \
                ([config.DropoutMaskConfig()] if m & config.MOD_DROPOUT else [])
        if self.kind == "kvcache":  # the decode kernels run on every architecture and kernel family
            return [config.AppendConfig(), config.fwd_decode_config(hd, self.dtype, self.causal),
                    config.CombineConfig(self.dtype)]
        return [config.forward_kernel_config(hd, self.dtype, self.causal, arch, kernels, seqlen_k=self.seqlen_k),
                config.backward_kernel_config(hd, self.dtype, self.causal, False, arch, kernels),
                config.backward_kernel_config(hd, self.dtype, self.causal, True, arch, kernels),
                config.dq_config(hd, self.dtype, self.causal),
                config.ElementwiseConfig("preprocess", self.dtype),
                config.ElementwiseConfig("convert_dq", self.dtype)]


_MOD_NAMES = ((config.MOD_WINDOW, "window"), (config.MOD_ALIBI, "alibi"), (config.MOD_SOFTCAP, "softcap"),
              (config.MOD_DROPOUT, "dropout"), (config.MOD_BIAS, "bias"), (config.MOD_MASK, "mask"))


def _case(b, sq, sk, h, d, dtype, causal, layout, strides, kind="dense", kv_heads=0, paged=False, splits=0,
          mods=0) -> Case:
    name = (f"d{d}-{dtype}-{'causal' if causal else 'full'}-{sq}x{sk}-b{b}h{h}"
            + (f"kv{kv_heads}" if kv_heads else "") + (f"-{layout}-{strides}" if kind == "dense" else f"-{kind}")
            + ("-paged" if paged else "") + (f"-split{splits}" if splits else "")
            + "".join(f"-{n}" for bit, n in _MOD_NAMES if mods & bit))
    return Case(name, b, sq, sk, h, d, dtype, causal, layout, strides, kind, kv_heads, paged, splits, mods)


# Seqlen pairs: odd lengths (1, 17, 113, 1023), Sq != Sk both ways, several tiles in each direction, causal
# rows that see no key (Sq > Sk), a single query over many key tiles and a single key under many query blocks.
# Each kernel head dim gets one half: 4 pairs for its 4 (dtype, causal) combinations.
_PAIRS = ([(113, 203), (1023, 17), (17, 1023), (1, 1)],
          [(203, 113), (1023, 1), (1, 1023), (17, 17)])


def default_cases() -> list[Case]:
    cases = []
    i = 0
    for hi, hd in enumerate(config.KERNEL_HEAD_DIMS):
        for ci, (dtype, causal) in enumerate((("fp16", False), ("fp16", True), ("bf16", False), ("bf16", True))):
            sq, sk = _PAIRS[hi % 2][(ci + hi // 2) % 4]  # rotated, so causal and full both meet every pair
            b, h = (2, 1) if i % 2 else (1, 2)
            cases.append(_case(b, sq, sk, h, hd, dtype, causal, LAYOUTS[(i + i // 4) % 2], STRIDES[(ci + hi) % 4]))
            i += 1
    # head dims without their own kernel: zero-padded columns inside the next kernel (reads stop at head_dim)
    cases += [_case(1, 113, 203, 2, 72, "bf16", True, "bhsd", "padded"),
              _case(2, 17, 1023, 1, 8, "fp16", False, "bshd", "misaligned"),
              _case(1, 1023, 17, 2, 200, "bf16", True, "bshd", "transposed"),
              _case(2, 203, 113, 1, 136, "fp16", True, "bhsd", "padded")]
    # grouped-query heads and packed sequences (lengths cycling through seqlen, 1, 0, 17), forward and backward
    cases += [_case(1, 113, 203, 4, 64, "fp16", True, "bshd", "contiguous", kv_heads=2),
              _case(1, 203, 17, 4, 128, "bf16", False, "bhsd", "padded", kv_heads=1),
              _case(4, 113, 203, 2, 128, "bf16", True, "bshd", "contiguous", kind="varlen", kv_heads=1),
              _case(4, 203, 113, 2, 64, "fp16", False, "bshd", "contiguous", kind="varlen")]
    # long key sequences, non-causal: the Hopper forward's long-sequence tiles (config.FWD_SM90_WS_SHORT_KEYS)
    cases += [_case(1, 130, 2100, 1, hd, dtype, False, "bshd", "contiguous") for hd in config.FWD_SM90_WS_SHORT_KEYS
              for dtype in ("fp16", "bf16")]
    # score modifiers: every modifier kernel the compile check builds (window alone, all four with causal folded
    # into the window, all but the window on a causal kernel), for each kernel head dim and dtype
    for hi, hd in enumerate(config.KERNEL_HEAD_DIMS):
        for di, dtype in enumerate(("fp16", "bf16")):
            for mi, (causal, mods) in enumerate(((False, config.MOD_WINDOW), (True, config.MODS_ALL),
                                                 (True, config.MODS_ALL & ~config.MOD_WINDOW))):
                # every row sees keys: with dropout, a row of one key makes dS a difference of two equal terms,
                # whose rounding (delta from the stored O) the pass rule's plain reference does not have
                sq, sk = ((113, 203), (203, 113), (256, 317))[(mi + hi + di) % 3]
                cases.append(_case(1, sq, sk, 2, hd, dtype, causal, "bshd", "contiguous", mods=mods))
    # kv-cache decoding: every decode instantiation (kernel head dim x dtype x causal), paged and dense caches,
    # split-KV with its merge kernel, grouped query heads packed as rows; seqlen_k: cache capacity per sequence
    for hi, hd in enumerate(config.KERNEL_HEAD_DIMS):
        for ci, (dtype, causal) in enumerate((("fp16", False), ("fp16", True), ("bf16", False), ("bf16", True))):
            j = hi * 4 + ci
            cases.append(_case(2, (1, 3, 17)[j % 3], 256 if j % 2 else 320, 4, hd, dtype, causal, "bshd", "contiguous",
                               kind="kvcache", kv_heads=(4, 2, 1)[j % 3], paged=bool(j % 2), splits=(0, 1, 3)[j % 3]))
    return cases


def quick_cases() -> list[Case]:
    return [_case(1, 113, 203, 2, 64, "fp16", True, "bshd", "padded"),
            _case(2, 1023, 17, 1, 128, "bf16", False, "bhsd", "transposed"),
            _case(1, 17, 1023, 2, 256, "fp16", True, "bshd", "contiguous"),
            _case(1, 1, 113, 1, 72, "bf16", True, "bshd", "misaligned"),
            _case(2, 1, 1, 1, 32, "bf16", False, "bhsd", "contiguous"),
            _case(1, 203, 113, 2, 192, "fp16", True, "bhsd", "padded")]


def case_set(name: str) -> list[Case]:
    if name == "default":
        return default_cases()
    if name == "quick":
        return quick_cases()
    raise ValueError(f"case set {name!r}; allowed: 'default', 'quick'")


# --- parallel compilation (also used by the GPU tests) ----------------------------------------------

def _compile_one(job):
    name, arch = job
    t0 = time.perf_counter()
    try:
        _compile.compile_kernel(name, arch)
        return name, None, time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported to the caller
        return name, f"{type(e).__name__}: {e}", time.perf_counter() - t0


def compile_configs(configs, arch: str | None = None, jobs: int | None = None) -> dict:
    """Compile kernel configs into the disk cache, in parallel processes once a cache miss shows up.

    NVRTC holds the GIL (threads gave 2.8 s vs 3.1 s sequential for 4 kernels), so misses go to a process
    pool. Cached kernels load in milliseconds in this process. Returns {cpp name: error or None}."""
    names = list(dict.fromkeys(c.cpp_name() for c in configs))
    if arch is None:
        arch = _compile.device_arch()
    results: dict = {}
    pending = list(names)
    # cheap in-process pass while kernels come from the cache; stop at the first real compile
    while pending:
        name, err, seconds = _compile_one((pending[0], arch))
        results[name] = err
        pending.pop(0)
        if seconds > 0.25:
            break
    if not pending:
        return results
    jobs = jobs or min(len(pending), os.cpu_count() or 1)
    try:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for name, err, _ in pool.map(_compile_one, [(n, arch) for n in pending]):
                results[name] = err
    except Exception:  # noqa: BLE001 - no process pool here (e.g. a sandbox): compile in this process
        for name in pending:
            if name not in results:
                results[name] = _compile_one((name, arch))[1]
    return results


# --- the driver (runs inside the sanitizer) ---------------------------------------------------------

def _lowp_np(rng, shape, dtype: str):
    import numpy as np

    x = rng.standard_normal(shape, dtype=np.float32)
    if dtype == "fp16":
        return x.astype(np.float16)
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16)


def _upload(x_np):
    """Host fp16/bf16 array -> CuPy array of the same dtype, by a plain copy of its bits (no kernel)."""
    import cupy as cp
    import numpy as np

    return cp.asarray(np.ascontiguousarray(x_np).view(np.uint16)).view(x_np.dtype)


def _driver_input(rng, case: Case, seqlen: int, heads: int = 0):
    """A (B, S, H, D) or (B, H, S, D) input with the case's strides (H: heads or, for k and v, heads_kv); its
    whole buffer is initialized."""
    b, h, d = case.batch, heads or case.heads, case.head_dim
    logical = (b, seqlen, h, d) if case.layout == "bshd" else (b, h, seqlen, d)
    if case.strides == "contiguous":
        return _upload(_lowp_np(rng, logical, case.dtype))
    if case.strides == "padded":  # 1 extra batch, 3 extra rows, 1 extra head, 8 extra columns; 16-byte aligned
        pad = (1, 3, 1) if case.layout == "bshd" else (1, 1, 3)
        big = _upload(_lowp_np(rng, tuple(n + p for n, p in zip(logical[:3], pad)) + (d + 8,), case.dtype))
        return big[pad[0]:, pad[1]:, pad[2]:, :d]
    if case.strides == "transposed":
        other = (b, h, seqlen, d) if case.layout == "bshd" else (b, seqlen, h, d)
        return _upload(_lowp_np(rng, other, case.dtype)).transpose(0, 2, 1, 3)
    if case.strides == "misaligned":  # head stride d + 4: not 16-byte aligned, the library copies it
        return _upload(_lowp_np(rng, logical[:3] + (d + 4,), case.dtype))[..., :d]
    raise ValueError(f"strides={case.strides!r}")


def _bits_np(x):
    import cupy as cp

    return cp.asnumpy(x.view(cp.uint16 if x.dtype.itemsize == 2 else cp.uint32))


def _digest(x) -> str:
    return hashlib.sha1(_bits_np(x).tobytes()).hexdigest()[:16]


def _host_problems(name: str, x, is_lse: bool = False) -> list[str]:
    """NaN/inf found on the host (no GPU kernel): every output element must be written and finite
    (lse may be -inf on rows that see no key)."""
    import numpy as np

    bits = _bits_np(x)
    if is_lse:
        f = bits.view(np.float32)
        bad = int(np.isnan(f).sum() + (f == np.inf).sum())
    else:
        exp_mask = 0x7C00 if x.dtype == np.float16 else 0x7F80
        bad = int(((bits & exp_mask) == exp_mask).sum())
    return [f"{name}: {bad} NaN/inf elements"] if bad else []


def _verify(case: Case, q, k, v, dout, o, lse, grads_atomic, grads_det, mods: dict | None = None) -> list[str]:
    """The pass rule (README.md, Tests) against the float64 reference on the GPU (unsanitized run only);
    cases with score modifiers against the NumPy reference (cuflash.reference) with the specified dropout
    mask (cuflash.philox)."""
    import cupy as cp

    from . import _xpref

    def bshd32(x):
        x32 = _xpref.to_float32(x)
        return x32 if case.layout == "bshd" else x32.transpose(0, 2, 1, 3)

    q32, k32, v32, do32 = (bshd32(x) for x in (q, k, v, dout))
    if case.mods:
        import numpy as np

        from . import philox
        from . import reference as ref

        kw = {n: mods[n] for n in ("window", "softcap") if n in mods}
        for n, dtype in (("alibi_slopes", None), ("bias", np.float64), ("mask", bool)):
            if n in mods:
                kw[n] = cp.asnumpy(mods[n]) if dtype is None else cp.asnumpy(mods[n]).astype(dtype)
        if "dropout_p" in mods:
            kw.update(dropout_p=mods["dropout_p"], dropout_mask=philox.dropout_mask(
                case.batch, case.heads, case.seqlen_q, case.seqlen_k, mods["dropout_p"], mods["seed"], mods["offset"]))
        h32 = [cp.asnumpy(x) for x in (q32, k32, v32, do32)]
        o64, lse64 = (cp.asarray(x) for x in ref.attention_forward64(*h32[:3], case.causal, **kw))
        o_lowp = cp.asarray(ref.attention_lowp(*h32[:3], case.dtype, case.causal, **kw))
        g64 = [cp.asarray(x) for x in ref.attention_backward64(h32[3], *h32[:3], case.causal, **kw)]
        glowp = [cp.asarray(x) for x in ref.attention_backward_lowp(h32[3], *h32[:3], case.dtype, case.causal, **kw)]
        if "bias" in kw:  # dbias (float32, shaped like the bias) after dq, dk, dv of the atomic mode
            rule_dbias = (grads_atomic[3], g64[3], glowp[3])
    else:
        o64, lse64 = _xpref.attention_forward64(q32, k32, v32, case.causal)
        o_lowp = _xpref.attention_lowp(q32, k32, v32, case.dtype, case.causal)
        g64 = _xpref.attention_backward64(do32, q32, k32, v32, case.causal)
        glowp = _xpref.attention_backward_lowp(do32, q32, k32, v32, case.dtype, case.causal)
    problems = []

    def rule(name, got, ref, low, factor):
        err = float(cp.abs(bshd32(got) - ref).max()) if got.size else 0.0
        bound = factor * (float(cp.abs(low - ref).max()) if got.size else 0.0) + 1e-5
        if not err <= bound:
            problems.append(f"{name}: {err:.3e} > {bound:.3e}")

    rule("o", o, o64, o_lowp, 2)
    finite = cp.isfinite(lse64)
    if not bool((cp.isfinite(lse) == finite).all()):
        problems.append("lse: -inf rows differ from the reference")
    elif lse.size:
        lse_err = float(cp.abs(cp.where(finite, lse, 0.0) - cp.where(finite, lse64, 0.0)).max())
        if lse_err > 1e-3:
            problems.append(f"lse: {lse_err:.3e} > 1e-3")
    for mode, grads in (("", grads_atomic), ("det ", grads_det)):
        for name, g, ref, low in zip(("dq", "dk", "dv"), grads, g64, glowp):
            rule(mode + name, g, ref, low, 3)
    if case.mods & config.MOD_BIAS:
        got, want, low = rule_dbias
        err = float(cp.abs(got - want).max()) if got.size else 0.0
        bound = 3 * (float(cp.abs(low - want).max()) if got.size else 0.0) + 1e-5
        if not err <= bound:
            problems.append(f"dbias: {err:.3e} > {bound:.3e}")
    return problems


def _rule(problems: list, name: str, got, ref, low, factor: float, to32=None) -> None:
    """The pass rule: max|got - ref64| <= factor * max|low - ref64| + 1e-5 (problems gets a line if not)."""
    import cupy as cp

    from . import _xpref

    got32 = _xpref.to_float32(got) if to32 is None else to32(got)
    err = float(cp.abs(got32 - ref).max()) if got.size else 0.0
    bound = factor * (float(cp.abs(low - ref).max()) if got.size else 0.0) + 1e-5
    if not err <= bound:
        problems.append(f"{name}: {err:.3e} > {bound:.3e}")


def _lse_rule(problems: list, lse, lse64) -> None:
    import cupy as cp

    finite = cp.isfinite(lse64)
    if not bool((cp.isfinite(lse) == finite).all()):
        problems.append("lse: -inf rows differ from the reference")
    elif lse.size:
        lse_err = float(cp.abs(cp.where(finite, lse, 0.0) - cp.where(finite, lse64, 0.0)).max())
        if lse_err > 1e-3:
            problems.append(f"lse: {lse_err:.3e} > 1e-3")


def _varlen_lengths(case: Case):
    """Sequence lengths of a varlen case: (seqlen, 1, 0, 17) for queries and (seqlen_k, 17, 0, 1) for keys,
    cycling over the batch, so it has empty sequences and rows that see no key (causal, len_q > len_k)."""
    lens_q = [(case.seqlen_q, 1, 0, 17)[b % 4] for b in range(case.batch)]
    lens_k = [(case.seqlen_k, 17, 0, 1)[b % 4] for b in range(case.batch)]
    return lens_q, lens_k


def _run_varlen(case: Case, rng, verify: bool):
    import cupy as cp
    import numpy as np

    from . import _xpref, attention_varlen_backward, attention_varlen_forward

    lens_q, lens_k = _varlen_lengths(case)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    tq, tk, d = int(cu_q[-1]), int(cu_k[-1]), case.head_dim
    q, dout = (_upload(_lowp_np(rng, (tq, case.heads, d), case.dtype)) for _ in range(2))
    k, v = (_upload(_lowp_np(rng, (tk, case.heads_kv, d), case.dtype)) for _ in range(2))
    cuq, cuk = cp.asarray(cu_q), cp.asarray(cu_k)
    mq, mk = max(lens_q), max(lens_k)
    o, lse = attention_varlen_forward(q, k, v, cuq, cuk, mq, mk, causal=case.causal)
    grads = attention_varlen_backward(dout, q, k, v, o, lse, cuq, cuk, mq, mk, causal=case.causal)
    grads_det = attention_varlen_backward(dout, q, k, v, o, lse, cuq, cuk, mq, mk, causal=case.causal,
                                          deterministic=True)
    problems = []
    if verify:
        q32, k32, v32, do32 = (_xpref.to_float32(x) for x in (q, k, v, dout))
        o64, lse64 = _xpref.attention_varlen_forward64(q32, k32, v32, cu_q, cu_k, case.causal)
        _rule(problems, "o", o, o64, _xpref.attention_varlen_lowp(q32, k32, v32, cu_q, cu_k, case.dtype, case.causal), 2)
        _lse_rule(problems, lse, lse64)
        g64 = _xpref.attention_varlen_backward64(do32, q32, k32, v32, cu_q, cu_k, case.causal)
        glowp = _xpref.attention_varlen_backward_lowp(do32, q32, k32, v32, cu_q, cu_k, case.dtype, case.causal)
        for mode, gs in (("", grads), ("det ", grads_det)):
            for name, g, ref, low in zip(("dq", "dk", "dv"), gs, g64, glowp):
                _rule(problems, mode + name, g, ref, low, 3)
    return {"o": o, "lse": lse, "dq_atomic": grads[0], "dk": grads[1], "dv": grads[2], "dq_det": grads_det[0],
            "dk_det": grads_det[1], "dv_det": grads_det[2]}, problems


def _run_kvcache(case: Case, rng, verify: bool):
    import cupy as cp
    import numpy as np

    from . import _xpref, attention_with_kvcache

    b, sq, d, capacity = case.batch, case.seqlen_q, case.head_dim, case.seqlen_k
    q = _upload(_lowp_np(rng, (b, sq, case.heads, d), case.dtype))
    k, v = (_upload(_lowp_np(rng, (b, sq, case.heads_kv, d), case.dtype)) for _ in range(2))
    block_table = None
    if case.paged:  # 64-key pages, each sequence's in shuffled order, two spare pages
        pages = capacity // 64
        table = rng.permutation(b * pages + 2)[:b * pages].reshape(b, pages).astype(np.int32)
        cache_shape = (b * pages + 2, 64, case.heads_kv, d)
        block_table = cp.asarray(table)
    else:
        cache_shape = (b, capacity, case.heads_kv, d)
    k_cache, v_cache = (_upload(_lowp_np(rng, cache_shape, case.dtype)) for _ in range(2))
    lens = rng.integers(0, capacity - sq + 1, size=b).astype(np.int32)
    lens[0] = capacity - sq  # one sequence fills its cache
    before = (k_cache.copy(), v_cache.copy()) if verify else None
    o, lse = attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cp.asarray(lens),
                                    block_table=block_table, causal=case.causal, num_splits=case.splits,
                                    return_lse=True)
    problems = []
    if verify:
        table = None if block_table is None else cp.asnumpy(block_table)
        q32, k32, v32, kc32, vc32 = (_xpref.to_float32(x) for x in (q, k, v) + before)
        o64, lse64, _, _ = _xpref.attention_kvcache64(q32, kc32, vc32, lens, k32, v32, table, case.causal)
        low = _xpref.attention_kvcache_lowp(q32, kc32, vc32, case.dtype, lens, k32, v32, table, case.causal)
        _rule(problems, "o", o, o64, low, 2)
        _lse_rule(problems, lse, lse64)
        u16 = cp.uint16
        for name, got, old, new in (("k_cache", k_cache, before[0], k), ("v_cache", v_cache, before[1], v)):
            want, _ = _xpref.kvcache_append(old.view(u16), old.view(u16), new.view(u16), new.view(u16), lens, table)
            if not bool((got.view(u16) == want).all()):
                problems.append(f"{name}: the appended keys/values are not exactly where they belong, or other "
                                f"entries changed")
    return {"o": o, "lse": lse, "k_cache": k_cache, "v_cache": v_cache}, problems


def run_case(case: Case, verify: bool) -> dict:
    """The calls of one case (see Case); digests and problems."""
    import cupy as cp
    import numpy as np

    from . import attention_backward, attention_forward

    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    if case.kind != "dense":
        t0 = time.perf_counter()
        outputs, problems = (_run_varlen if case.kind == "varlen" else _run_kvcache)(case, rng, verify)
        cp.cuda.Device().synchronize()
        seconds = time.perf_counter() - t0
        for name, x in outputs.items():
            problems = _host_problems(name, x, is_lse=(name == "lse")) + problems
        digests = {name: _digest(x) for name, x in outputs.items() if name != "dq_atomic"}
        return {"case": case.name, "seconds": round(seconds, 3), "digests": digests, "problems": problems}
    q = _driver_input(rng, case, case.seqlen_q)
    k = _driver_input(rng, case, case.seqlen_k, case.heads_kv)
    v = _driver_input(rng, case, case.seqlen_k, case.heads_kv)
    dout = _driver_input(rng, case, case.seqlen_q)
    t0 = time.perf_counter()
    mods = case.mod_options(rng)
    if mods.get("alibi_slopes") is not None:
        mods["alibi_slopes"] = cp.asarray(mods["alibi_slopes"], dtype=cp.float32)
    if mods.get("bias") is not None:
        mods["bias"] = cp.asarray(mods["bias"], dtype=cp.float32)
    if mods.get("mask") is not None:
        mods["mask"] = cp.asarray(mods["mask"])
    want_mask = "dropout_p" in mods  # the mask kernel too (compared with cuflash.philox when verifying)
    o, lse, *mask = attention_forward(q, k, v, causal=case.causal, layout=case.layout, return_dropout_mask=want_mask,
                                      **mods)
    with_dbias = {"dbias": True} if "bias" in mods else {}  # atomics: the bias is shared by the heads
    grads = attention_backward(dout, q, k, v, o, lse, causal=case.causal, layout=case.layout, **mods, **with_dbias)
    grads_det = attention_backward(dout, q, k, v, o, lse, causal=case.causal, layout=case.layout, deterministic=True,
                                   **mods)
    cp.cuda.Device().synchronize()
    seconds = time.perf_counter() - t0
    outputs = {"o": o, "lse": lse, "dq_atomic": grads[0], "dk": grads[1], "dv": grads[2],
               "dq_det": grads_det[0], "dk_det": grads_det[1], "dv_det": grads_det[2]}
    if with_dbias:
        outputs["dbias_atomic"] = grads[3]
    problems = []
    for name, x in outputs.items():
        problems += _host_problems(name, x, is_lse=(name == "lse"))
    if verify:
        problems += _verify(case, q, k, v, dout, o, lse, grads, grads_det, mods)
        if mask:
            from . import philox

            want = philox.dropout_mask(case.batch, case.heads, case.seqlen_q, case.seqlen_k, mods["dropout_p"],
                                       mods["seed"], mods["offset"])
            if not np.array_equal(cp.asnumpy(mask[0]), want):
                problems.append("dropout mask differs from cuflash.philox")
    # dq (and a shared bias's dbias) of the default mode is accumulated with fp32 atomics: not bitwise
    # reproducible, so not compared
    digests = {name: _digest(x) for name, x in outputs.items() if not name.endswith("_atomic")}
    return {"case": case.name, "seconds": round(seconds, 3), "digests": digests, "problems": problems}


def driver(args) -> int:
    import cupy as cp

    cases = case_set(args.case_set)
    indices = [int(i) for i in args.cases.split(",")] if args.cases else list(range(len(cases)))
    cp.cuda.set_allocator(None)  # no pool: each array is its own allocation, so memcheck sees its bounds
    failed = 0
    for n, i in enumerate(indices):
        case = cases[i]
        print(f"CASE {n + 1}/{len(indices)} {case.name}", flush=True)
        result = run_case(case, args.verify)
        failed += bool(result["problems"])
        print("RESULT " + json.dumps(result), flush=True)
    print(f"DRIVER DONE {len(indices)} cases, {failed} with problems", flush=True)
    return 1 if failed else 0


# --- the sanitizer runs ------------------------------------------------------------------------------

def find_sanitizer(path: str | None = None) -> str | None:
    candidates = [path] if path else []
    candidates.append(shutil.which("compute-sanitizer"))
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates += [os.path.join(root, "bin", "compute-sanitizer"),
                           os.path.join(root, "compute-sanitizer", "compute-sanitizer")]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def tool_options(tool: str, help_text: str) -> list[str]:
    """Options for one tool, each only if this compute-sanitizer's --help lists it."""
    wanted = [("--error-exitcode", str(SANITIZER_EXIT)), ("--print-limit", "200"), ("--launch-timeout", "300"),
              # CUDA API errors are not counted: a failing call of ours raises in Python (the driver then exits
              # non-zero, which fails the run), and CuPy's own probing calls must not count as findings
              ("--report-api-errors", "no")]
    if tool == "memcheck":
        wanted.append(("--padding", "512"))  # a guard after every allocation: overruns hit it, not a neighbour
    if tool == "racecheck":
        wanted += [("--racecheck-report", "all"),          # hazards and the analysis summary
                   ("--racecheck-memcpy-async", "yes")]    # track cp.async writes to shared memory
    opts = []
    for flag, value in wanted:
        if flag == "--error-exitcode" or re.search(re.escape(flag) + r"\b", help_text):
            opts += [flag, value]
    return opts


_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+error")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")
_BANNER = re.compile(r"^=+ (COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|Target application|LEAK SUMMARY)")


def parse_log(text: str) -> dict:
    """Counts from one sanitized driver log: summary errors, racecheck errors/warnings, cases done,
    driver results, and the sanitizer's finding lines."""
    out = {"errors": None, "race_errors": 0, "race_warnings": 0, "results": [], "findings": [], "done": False}
    for m in _ERROR_SUMMARY.finditer(text):
        out["errors"] = (out["errors"] or 0) + int(m.group(1))
    for m in _RACE_SUMMARY.finditer(text):
        out["race_errors"] += int(m.group(2))
        out["race_warnings"] += int(m.group(3))
        out["race_summary"] = True
    for line in text.splitlines():
        if line.startswith("RESULT "):
            try:
                out["results"].append(json.loads(line[len("RESULT "):]))
            except ValueError:
                pass
        elif line.startswith("DRIVER DONE"):
            out["done"] = True
        elif line.startswith("=") and line.strip("= ") and not _BANNER.match(line):
            out["findings"].append(line)
    return out


def shard(cases: list[Case], indices: list[int], n: int) -> list[list[int]]:
    """Split case indices into n shards of similar cost (longest first, onto the cheapest shard)."""
    shards: list[list[int]] = [[] for _ in range(max(1, min(n, len(indices))))]
    load = [0.0] * len(shards)
    for i in sorted(indices, key=lambda i: -cases[i].cost):
        j = load.index(min(load))
        shards[j].append(i)
        load[j] += cases[i].cost
    return [sorted(s) for s in shards if s]


def _driver_cmd(case_set_name: str, indices: list[int], verify: bool) -> list[str]:
    cmd = [sys.executable, "-m", "cuflash.check", "_driver", "--case-set", case_set_name,
           "--cases", ",".join(map(str, indices))]
    return cmd + (["--verify"] if verify else [])


def _child_env() -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the directory holding cuflash/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _kill(proc: subprocess.Popen) -> None:
    """End one child we started (its own process group: the sanitizer and the Python it runs)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def sanitize(args) -> int:
    tools = list(dict.fromkeys(args.tools))
    set_name = "quick" if args.quick else "default"
    cases = case_set(set_name)
    out_dir = args.out or tempfile.mkdtemp(prefix="cuflash-sanitize-")
    os.makedirs(out_dir, exist_ok=True)
    exe = find_sanitizer(args.sanitizer)
    if exe is None:
        print("cuflash check: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin); "
              "pass --sanitizer PATH", file=sys.stderr)
        return 2
    try:
        import cupy

        if not cupy.is_available():
            print("cuflash check: no CUDA GPU (cupy.is_available() is False)", file=sys.stderr)
            return 2
    except ImportError as e:
        print(f"cuflash check: CuPy is not importable ({e})", file=sys.stderr)
        return 2
    shown = subprocess.run([exe, "--help"], capture_output=True, text=True)
    help_text = shown.stdout + shown.stderr
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"compute-sanitizer: {exe} ({version[-1] if version else 'unknown version'})")
    print(f"{len(cases)} cases ({set_name} set), each: forward, backward (atomic dQ), backward (deterministic); "
          f"kernels: {config.KERNELS} (CUFLASH_KERNELS); logs in {out_dir}")
    t_all = time.perf_counter()

    # 1. compile every needed kernel into the disk cache
    t0 = time.perf_counter()
    arch = _compile.device_arch()
    configs = [cfg for c in cases for cfg in c.configs(arch)]
    errors = {n: e for n, e in compile_configs(configs).items() if e}
    print(f"compiled/loaded {len(set(c.cpp_name() for c in configs))} kernels in {time.perf_counter() - t0:.1f} s")
    for name, err in errors.items():
        print(f"  COMPILE ERROR {name}: {err.splitlines()[0]}")
    if errors:
        return 1

    # 2. the unsanitized reference run: pass rule against float64, output digests
    t0 = time.perf_counter()
    deadline = t_all + args.deadline
    ref_log = os.path.join(out_dir, "reference-run.log")
    with open(ref_log, "w") as f:
        try:
            rc = subprocess.run(_driver_cmd(set_name, list(range(len(cases))), verify=True), stdout=f,
                                stderr=subprocess.STDOUT, env=_child_env(),
                                timeout=max(1.0, deadline - time.perf_counter())).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    ref = parse_log(open(ref_log).read())
    baseline = {r["case"]: r["digests"] for r in ref["results"]}
    ref_problems = [f"{r['case']}: {p}" for r in ref["results"] for p in r["problems"]]
    print(f"reference run (no sanitizer, checked against float64): {len(baseline)}/{len(cases)} cases, "
          f"{len(ref_problems)} problems, exit {rc}, {time.perf_counter() - t0:.1f} s")
    for p in ref_problems[:20]:
        print(f"  PROBLEM {p}")
    if len(baseline) != len(cases):
        print(f"  the reference run did not finish (exit {rc}); see {ref_log}")
        return 1

    # 3. all tools at once, each over its shards
    jobs = []  # (tool, shard index, indices, Popen, log path, start time)
    for tool in tools:
        n = args.shards or DEFAULT_SHARDS[tool]
        for si, indices in enumerate(shard(cases, list(range(len(cases))), n)):
            log = os.path.join(out_dir, f"{tool}-{si}.log")
            cmd = [exe, "--tool", tool] + tool_options(tool, help_text) + _driver_cmd(set_name, indices, verify=False)
            with open(log, "w") as f:
                f.write(" ".join(cmd) + "\n")
                f.flush()
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_child_env(),
                                        start_new_session=True)
            jobs.append((tool, si, indices, proc, log, time.perf_counter()))
    print(f"started {len(jobs)} sanitizer processes ({', '.join(f'{t} x{sum(j[0] == t for j in jobs)}' for t in tools)}); "
          f"stopped, if still running, {deadline - time.perf_counter():.0f} s from now")
    ended: dict = {}
    while len(ended) < len(jobs):
        for j, (tool, si, indices, proc, log, t_start) in enumerate(jobs):
            if j in ended:
                continue
            if proc.poll() is not None:
                ended[j] = (proc.returncode, time.perf_counter() - t_start, False)
            elif time.perf_counter() > deadline:
                _kill(proc)
                ended[j] = (proc.returncode, time.perf_counter() - t_start, True)
        time.sleep(0.5)

    # 4. one row per tool
    header = f"{'tool':<10} {'shards':>6} {'cases':>7} {'errors':>6} {'findings':>8} {'digest diffs':>12} {'seconds':>8}  status"
    print()
    print(header)
    print("-" * len(header))
    failed = False
    details = []
    for tool in tools:
        rows = [(jobs[j], ended[j]) for j in range(len(jobs)) if jobs[j][0] == tool]
        done = errors_total = 0
        findings: list[str] = []
        mismatches: list[str] = []
        statuses = []
        seconds = 0.0
        for (_, si, indices, _, log, _), (rc, secs, timed_out) in rows:
            parsed = parse_log(open(log, errors="replace").read())
            seconds = max(seconds, secs)
            done += len(parsed["results"])
            errors_total += (parsed["errors"] or 0) + parsed["race_errors"] + parsed["race_warnings"]
            findings += parsed["findings"]
            for r in parsed["results"]:
                for p in r["problems"]:
                    mismatches.append(f"{r['case']}: {p}")
                for name, dig in r["digests"].items():
                    if baseline.get(r["case"], {}).get(name) != dig:
                        mismatches.append(f"{r['case']}: {name} differs from the unsanitized run")
            has_summary = parsed["errors"] is not None or parsed.get("race_summary", False)
            if timed_out:
                statuses.append(f"shard {si}: TIMEOUT after {len(parsed['results'])}/{len(indices)} cases")
            elif rc == SANITIZER_EXIT:
                statuses.append(f"shard {si}: errors reported")
            elif rc != 0:
                statuses.append(f"shard {si}: exit {rc}")
            elif not has_summary:
                statuses.append(f"shard {si}: no sanitizer summary in the log")
            elif not parsed["done"]:
                statuses.append(f"shard {si}: driver did not finish")
        # any line the sanitizer printed besides its banner and summaries counts as a finding
        ok = not statuses and errors_total == 0 and not findings and not mismatches and done == len(cases)
        failed |= not ok
        status = "ok" if ok else "; ".join(statuses) or "FINDINGS"
        print(f"{tool:<10} {len(rows):>6} {f'{done}/{len(cases)}':>7} {errors_total:>6} {len(findings):>8} "
              f"{len(mismatches):>12} {seconds:>8.1f}  {status}")
        if findings or mismatches:
            details.append((tool, findings, mismatches))
    if ref_problems:
        failed = True
        print(f"reference run: {len(ref_problems)} pass-rule problems (listed above)")
    print(f"total {time.perf_counter() - t_all:.1f} s; logs in {out_dir}")
    for tool, findings, mismatches in details:
        print(f"\n{tool}: first findings (full logs: {out_dir}/{tool}-*.log)")
        for line in findings[:40]:
            print(f"  {line}")
        for line in mismatches[:20]:
            print(f"  MISMATCH {line}")
    return 1 if failed else 0


def list_cases(args) -> int:
    cases = case_set("quick" if args.quick else "default")
    for i, c in enumerate(cases):
        print(f"{i:>3} cost {c.cost:8.1f}  {c.name}  (kernel head dim {c.kernel_head_dim})")
    print(f"{len(cases)} cases; total cost {sum(c.cost for c in cases):.0f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cuflash.check", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sanitize", help="run compute-sanitizer tools over the case set")
    p.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS), help="default: all four")
    p.add_argument("--quick", action="store_true", help="a 6-case set instead of the full one")
    p.add_argument("--out", help="directory for the logs (default: a new temporary directory)")
    p.add_argument("--shards", type=int, help=f"processes per tool (default: {DEFAULT_SHARDS})")
    p.add_argument("--deadline", type=float, default=330.0,
                   help="seconds for the whole command; sanitizer processes still running then are stopped and "
                        "reported as TIMEOUT (default 330)")
    p.add_argument("--sanitizer", help="path of compute-sanitizer (default: PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    p = sub.add_parser("cases", help="list the case set")
    p.add_argument("--quick", action="store_true")
    p = sub.add_parser("_driver", help="internal: run cases (this is what the sanitizer runs)")
    p.add_argument("--case-set", default="default", choices=("default", "quick"))
    p.add_argument("--cases", help="comma-separated case indices (default: all)")
    p.add_argument("--verify", action="store_true", help="check every output against the float64 reference")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "sanitize":
        return sanitize(args)
    if args.command == "cases":
        return list_cases(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
