"""Benchmark: cuflash against plain CuPy attention and torch SDPA's backends, in one run, on one GPU.

    python -m cuflash.bench                                  # fwd, bf16 + fp16, D 64/128, causal and not, N 512..16k
    python -m cuflash.bench --backward --dtype bf16          # + bwd and fwd+bwd
    python -m cuflash.bench --seqlen 4096 --head-dim 128 --causal yes --json out.json --plot out.png
    python -m cuflash.bench --bias                           # additive bias and its gradient (Evoformer, LLM)
    python -m cuflash.bench --ring                           # ring attention over this node's GPUs vs one GPU

--ring hands its other options to cuflash.distributed.bench (python -m cuflash.distributed.bench --help): one
process per GPU, context-parallel forward + backward at N 128k .. 1M against the same attention on one GPU.

Shapes are the FlashAttention benchmark's: batch = 16384 // N, heads = 2048 // D (16k tokens, hidden 2048).
FLOPs: fwd = 4 * B * H * N^2 * D, halved when causal; bwd = 2.5 x fwd; fwd+bwd = 3.5 x fwd.

Timing: CUDA events around each call, median of --reps calls after --warmup calls, queued behind a short
GPU hold so that the GPU runs them back to back and the events time GPU work, not the host. Calls rotate over
several independently drawn random input sets, so the inputs of one call are not in the L2 from the one
before (the plain attention's N^2 intermediates dwarf the L2 anyway: it uses one set).
Peak memory: device memory above the inputs during one call (for bwd and fwd+bwd: during a forward and a
backward, so the tensors the forward saves count), from CuPy's memory pool or torch.cuda.max_memory_allocated.

Decoding (--decode): attention_with_kvcache throughput, one query token per sequence (Sq = 1) over a dense
KV cache of L keys, all valid (no new keys appended), bf16, D = 128 (--head-dim: each one given),
H_q = 32 over H_kv = 8 key/value heads (grouped-query, Llama-3-8B-like; --decode-heads 32:32 for multi-head),
batch 1/8/64 x L 1k/8k/32k/128k, skipping shapes whose K/V exceed --decode-max-gb (20 GB). Reported: time,
the K/V bytes read once (2 * B * L * H_kv * D * 2) per second, and that as a % of the device-copy ceiling
measured in the same run (a 2 GiB device-to-device copy: bytes read + written per second); the same for
torch SDPA (the best of its backends that run) on the same cache through DLPack (no copy): q as
(B, H_q, 1, D), the cache as a (B, H_kv, L, D) view, enable_gqa=True when H_q != H_kv (torch >= 2.5).
cuflash runs with num_splits=0 (its heuristic) and check_inputs=False (no host synchronization per call),
twice: over the whole cache (cache_seqlens=None, the attention SDPA is asked for) and with cache_seqlens = L
as an int32 device array (as a decoding loop passes it: the kernel reads each sequence's length first).
A pure read can exceed the copy ceiling by a few %. Calls are timed on a busy GPU (see median_ms and
HOLD_BATCH), so the smallest shapes measure the GPU work, not the host's launch path (for that:
tools/launch_overhead.py).

Variable length (--varlen): 16384 tokens in sequences of random lengths (uniform in [1, N] for each --seqlen N),
attention_varlen forward and backward against the dense call on the same sequences padded to N; both in
useful-token TFLOP/s: 4 * H * D * sum_b L_b^2 (halved when causal), bwd 2.5 x that (check_inputs=False).

Additive bias (--bias): attention with a bias added to the scores (bias=, and dbias=True in the backward),
forward (fwd) and forward + backward with the bias's gradient (fwd+bwd), not causal, bf16 (--dtype fp16 and fp32
too: float32 inputs and bias, cuflash precision "fp32"), against torch SDPA's memory-efficient backend given the
same bias as attn_mask (sdpa-mem) and plain CuPy attention with the bias added (plain); same timing, FLOPs (4*B*H*S^2*D, fwd+bwd 3.5x; the bias add not counted)
and input-set rotation as above. Two families (--bias-shapes):
  evoformer  row attention with a pair bias: q (B0, N, L, H, D) folded to (B0*N, L, H, D), bias (B0, H, L, L)
             shared by the N rows of each group (cuflash takes it as is: Bb = B0 divides the batch; SDPA gets
             a stride-0 .expand view when B0 = 1, a copy otherwise). Default, B0 = 1, as N:L:H:D:
             1024:256:8:32 256:256:4:32 512:512:8:32 512:512:4:32 128:768:8:32 768:768:4:32 512:256:8:64
             512:512:4:64: MSA row attention (H 8) and triangle attention over an L x L pair representation
             (N = L rows, H 4); --evoformer-shapes [B0:]N:L:H:D replaces them, --seqlen / --head-dim keep the
             defaults with that L / D. --msa-mask KEEP adds the MSA mask: a key_padding_mask (B0*N, L) in which
             row r keeps its first ceil(u_r L) keys, u_r uniform in [KEEP, 1] (cuflash: key_padding_mask=; SDPA:
             the bias plus -inf on the masked keys, a (B, H, S, S) attn_mask made in each call; plain: the same
             sum, added to the scores)
  llm        a full (B, H, N, N) bias: B = 16384 // N, H = 16, N = --seqlen (1024 2048 4096), D = --head-dim
             (64 128); shapes whose bias + float32 dbias exceed --bias-max-gb (16) are skipped
Reported per pass: ms, TFLOP/s, cuflash's speedup over sdpa-mem (time ratio), and each method's peak extra
memory: device memory allocated during one call beyond the inputs, the bias and the dbias it returns (outputs
o, lse, dq, dk, dv included): O(N) for cuflash, against the (B, H, S, S) score-sized buffers of the others.
--deterministic: with a broadcast bias (evoformer) the API refuses dbias (its reduction uses atomics): skipped.

Wide dtypes (--dtype fp32 tf32 fp64, the default mode only): float32 and float64 inputs, same shapes, FLOPs and timing.
  fp32   float32 inputs, cuflash precision="fp32" (3xTF32 split products: float32 accuracy on the TF32 tensor cores)
  tf32   float32 inputs, cuflash precision="tf32" (one TF32 product: ~1e-3 relative error)
  fp64   float64 inputs, cuflash on the FP64 tensor cores (DMMA)
Their anchors in the same run: plain CuPy attention in float32 / float64 (cuBLAS batched matmuls with the float32
compute type: no TF32, whatever CUPY_TF32 says; checked at run time against float64), SDPA's memory-efficient
backend (float32 only: CUTLASS's 3xTF32 on sm_80+, its own choice) and math backend (float32 matmuls at
float32_matmul_precision "highest", i.e. no TF32; float64); SDPA's flash and cuDNN backends take 16-bit inputs
only and are reported unsupported (probed once per dtype). The tf32 rows have no TF32 anchor: their plain and
SDPA columns are the float32 measurements (taken once, shared with the fp32 rows when both run) and say so.
Ceilings (--ceilings, the default with a wide dtype): cuBLAS GEMMs of --ceiling-size^3 (8192) timed the same way:
FP32 SGEMM on the CUDA cores (CUBLAS_COMPUTE_32F) and TF32 tensor-core GEMM (CUBLAS_COMPUTE_32F_FAST_TF32) for
fp32/tf32, FP64 DGEMM (CUBLAS_COMPUTE_64F: the FP64 tensor cores on sm_80+) for fp64, each with its relative
error against float64 (FP32 ~1e-6, TF32 ~3e-4: which arithmetic ran). The wide table gives cuflash's TFLOP/s as
% of its dtype's ceiling (fp32: SGEMM, tf32: TF32 GEMM, fp64: DGEMM) and its speedup over the fastest anchor.
--time-limit S stops starting new shapes after S seconds (the rest are reported skipped).

Methods:
  cuflash        this library
  plain          "standard attention" of the paper in CuPy: S = QK^T, softmax, O = PV with cuBLAS matmuls,
                 S and P materialized in HBM; in the input dtype (bf16 runs in fp16 when CuPy cannot
                 multiply bf16 matrices: the row says so; tf32 rows: float32)
  sdpa-flash, sdpa-cudnn, sdpa-efficient
                 torch.nn.functional.scaled_dot_product_attention with one backend forced (when torch is
                 importable); a backend that raises is skipped with a note
  sdpa-math      SDPA's math backend (unfused matmuls and softmax); run by default for the wide dtypes only
                 (--methods sdpa-math adds it to bf16/fp16)
  sdpa-mem       (--bias) SDPA's memory-efficient backend with attn_mask = the bias (requires_grad for fwd+bwd)
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field

TOKENS = 16384
HIDDEN = 2048
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SDPA_BACKENDS = (("sdpa-flash", "FLASH_ATTENTION"), ("sdpa-cudnn", "CUDNN_ATTENTION"),
                 ("sdpa-efficient", "EFFICIENT_ATTENTION"))
SDPA_MATH = ("sdpa-math", "MATH")  # not in SDPA_BACKENDS: --decode's best-of-SDPA leaves the math backend out
SDPA_METHODS = dict(SDPA_BACKENDS + (SDPA_MATH,))  # method -> torch.nn.attention.SDPBackend name
METHODS = ("cuflash", "plain") + tuple(name for name, _ in SDPA_BACKENDS) + (SDPA_MATH[0],)
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
PASSES = tuple(PASS_FLOP_FACTOR)

LOWP_DTYPES = ("bf16", "fp16")
WIDE_DTYPES = ("fp32", "tf32", "fp64")  # float32 inputs at cuflash precision "fp32" / "tf32", float64 inputs
DTYPES = LOWP_DTYPES + WIDE_DTYPES
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp64": 8}
TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "tf32": "float32", "fp64": "float64"}
CUFLASH_PRECISION = {"fp32": "fp32", "tf32": "tf32"}  # precision= of the cuflash calls (none for the others)


def cuflash_kwargs(dtype: str) -> dict:
    """The precision keyword of the cuflash calls for a bench dtype: {"precision": "fp32" | "tf32"} or {}."""
    return {"precision": CUFLASH_PRECISION[dtype]} if dtype in CUFLASH_PRECISION else {}


def anchor_dtype(dtype: str) -> str:
    """The dtype the other methods compute in for a bench dtype: tf32 rows have float32 anchors (no TF32)."""
    return "fp32" if dtype == "tf32" else dtype


def ordered_dtypes(dtypes) -> list:
    """dtypes in the order given, except that tf32 follows fp32 when both run (its anchors are the fp32 ones)."""
    out = [d for d in dtypes if d != "tf32"]
    if "tf32" in dtypes:
        out.insert(out.index("fp32") + 1 if "fp32" in out else dtypes.index("tf32"), "tf32")
    return out


@dataclass
class Record:
    method: str
    passname: str  # "fwd" | "bwd" | "fwd+bwd"
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    ms: float | None = None
    tflops: float | None = None
    peak_mem_bytes: int | None = None
    compute_dtype: str | None = None  # when a method computes in another dtype than asked (plain bf16)
    note: str = ""


@dataclass
class Shape:
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int
    window: tuple | None = None  # sliding window (left, right) of the cuflash runs (--window)
    batch: int = field(init=False)
    heads: int = field(init=False)

    def __post_init__(self):
        self.batch = TOKENS // self.seqlen
        self.heads = HIDDEN // self.head_dim

    def flops(self, passname: str) -> float:
        """Useful FLOPs: 4 * B * H * D per visible (query, key) pair (causal: half of N^2, counted as the FA
        benchmarks do; window: the pairs inside the band, counted exactly)."""
        if self.window is None:
            f = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
            return f * (0.5 if self.causal else 1.0) * PASS_FLOP_FACTOR[passname]
        pairs = visible_pairs(self.seqlen, self.seqlen, self.causal, self.window)
        return 4.0 * self.batch * self.heads * pairs * self.head_dim * PASS_FLOP_FACTOR[passname]

    def record(self, method, passname, **kw) -> Record:
        return Record(method, passname, self.dtype, self.head_dim, self.causal, self.seqlen, self.batch,
                      self.heads, **kw)

    def __str__(self):
        return (f"{self.dtype} D={self.head_dim} {'causal' if self.causal else 'full'} N={self.seqlen} "
                f"(B={self.batch}, H={self.heads})" + (f" window={self.window}" if self.window else ""))


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window) -> int:
    """(query, key) pairs inside the band (the analyzer's exact count, cuflash.simulator.masks)."""
    from .simulator.masks import visible_pairs as count

    return int(count(seqlen_q, seqlen_k, causal, window))


# --- timing and memory ------------------------------------------------------------------------------

# A call whose GPU work is shorter than its host path (a decode step of a few microseconds, SDPA's ~20-35 us of
# Python and dispatch) would be timed from an idle GPU: its start event runs at once and its kernel only when
# the host gets to launch it, so the events would time the host. The timed calls are therefore queued in
# batches behind a hold, one thread spinning on %globaltimer for as long as the host takes to launch the
# batch (twice its measured launch time): the GPU then runs the batch's calls back to back, as a program that
# keeps the GPU busy does, and each call's two events time its GPU work (nvbench's blocking kernel does the
# same). Only the first batch waits for the host's whole launch time; a later batch waits for the host's lead
# over the GPU, twice the batch's launch time less its GPU time, and not at all where the calls' GPU time is the
# longer (the host, once ahead, stays ahead). A hold of the whole launch time before every batch left the GPU idle
# for that long between batches, and under the power cap an idle GPU runs the next calls at a higher clock: the
# idle share followed each method's host time (SDPA's is two to three times cuflash's), and so did the clock each
# was timed at. The probe call that sizes the holds runs behind a hold too, so that it times GPU work.
HOLD_BATCH = 32          # timed calls queued behind one hold
HOLD_MAX_S = 0.05        # a hold never spins longer than this
_HOLD_SOURCE = r"""
extern "C" __global__ void cuflash_bench_hold(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
"""
_hold_kernel = None  # a cupy.RawKernel: CuPy compiles and loads it for each device it first runs on


class _StreamHandle:
    """A raw cudaStream_t in the CUDA stream protocol (what cupy.cuda.Stream.from_external takes)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def hold_stream(stream_ptr: int, seconds: float) -> None:
    """Keep the GPU stream `stream_ptr` busy for `seconds` (at most HOLD_MAX_S): what is launched on it
    meanwhile runs after, back to back."""
    global _hold_kernel
    import cupy as cp

    if _hold_kernel is None:
        _hold_kernel = cp.RawKernel(_HOLD_SOURCE, "cuflash_bench_hold")
    args = ((1,), (1,), (cp.uint64(int(min(seconds, HOLD_MAX_S) * 1e9)),))
    if stream_ptr == cp.cuda.get_current_stream().ptr:  # torch's and CuPy's default: the legacy stream
        _hold_kernel(*args)
        return
    from_external = getattr(cp.cuda.Stream, "from_external", None)  # CuPy >= 14; ExternalStream before
    with from_external(_StreamHandle(stream_ptr)) if from_external else cp.cuda.ExternalStream(stream_ptr):
        _hold_kernel(*args)


class CupyEvents:
    def __init__(self):
        import cupy

        self.cp = cupy

    def event(self):
        return self.cp.cuda.Event()

    def record(self, e):
        e.record()

    def elapsed_ms(self, a, b):
        return self.cp.cuda.get_elapsed_time(a, b)

    def synchronize(self, e):
        e.synchronize()

    def hold(self, seconds):
        hold_stream(self.cp.cuda.get_current_stream().ptr, seconds)


class TorchEvents:
    def __init__(self):
        import torch

        self.torch = torch

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def record(self, e):
        e.record()

    def elapsed_ms(self, a, b):
        return a.elapsed_time(b)

    def synchronize(self, e):
        e.synchronize()

    def hold(self, seconds):
        hold_stream(self.torch.cuda.current_stream().cuda_stream, seconds)


# Timed calls of one measurement stop after about this many seconds (at least MIN_REPS calls): the slow
# methods (plain attention at N = 16k takes ~0.3 s a call) would otherwise dominate a whole run.
MEASURE_BUDGET_S = 1.0
MIN_REPS = 5
# The untimed calls before a measurement last at least this long, in rounds of `warmup` calls each followed by
# a synchronize: three calls of a 0.1 ms decode step right after its inputs were made timed 15 % slow in the
# first of two measurements of the same row (B 64, 1k keys: 113.9 us, then 99.0; 98.0-98.5 in five medians of
# a process that timed the row alone).
WARMUP_MIN_S = 0.05
# --sustain S raises that floor for a whole run. Under back-to-back calls an H100 holds its 700 W power cap after
# a fraction of a second, at SM clocks of 1.5-1.7 GHz instead of the 1.98 GHz boost (nvidia-smi, 2026-12-05):
# a measurement of ~0.1 s catches the clock on its way down, and which method ran just before decides how far.
# Seconds of warm-up time every method at the sustained clock, as a long training run sees it, and the timed calls
# then span S seconds too (more than --reps where needed): the clock keeps swinging by hundreds of MHz while the
# cap holds, so a median over 10-40 ms of calls still depends on when they ran. 0: neither applies.
sustain_s = 0.0
MAX_REPS = 20000


def median_ms(call, n_sets: int, events, reps: int, warmup: int) -> float:
    """Median GPU time of call(i) (i selects the input set, rotating), each call between its own two events,
    after untimed calls in rounds of `warmup` for at least WARMUP_MIN_S or sustain_s; `reps` calls, or fewer (at
    least MIN_REPS) when they would take longer than MEASURE_BUDGET_S, or more (at most MAX_REPS) when they would
    take less than sustain_s; queued in batches of HOLD_BATCH behind holds (see HOLD_BATCH) sized from the host
    time of the warm-up calls and the GPU time of a probe call."""
    host_s = []
    probe = (events.event(), events.event())
    start, done, warmup_s = time.perf_counter(), 0, max(WARMUP_MIN_S, sustain_s)
    while done == 0 or time.perf_counter() - start < warmup_s:
        for _ in range(max(warmup, 1)):
            t0 = time.perf_counter()
            call(done % n_sets)
            host_s.append(time.perf_counter() - t0)
            done += 1
        events.record(probe[1])  # (recorded again below, around the probe call)
        events.synchronize(probe[1])
    warmup = done
    events.hold(2 * sorted(host_s)[len(host_s) // 2] + 20e-6)  # the probe's events time its GPU work
    t0 = time.perf_counter()
    events.record(probe[0])
    call(warmup % n_sets)
    events.record(probe[1])
    host_s.append(time.perf_counter() - t0)  # with the two event records of a timed call
    events.synchronize(probe[1])
    probe_ms = max(events.elapsed_ms(*probe), 1e-3)
    reps = max(MIN_REPS, min(reps, int(MEASURE_BUDGET_S * 1e3 / probe_ms)))
    reps = min(MAX_REPS, max(reps, math.ceil(sustain_s * 1e3 / probe_ms)))
    per_call_s = max(sorted(host_s)[len(host_s) // 2], host_s[-1])
    lead_s = max(per_call_s - probe_ms * 1e-3, 0.0)  # what the host loses to the GPU per call
    pairs = [(events.event(), events.event()) for _ in range(reps)]
    for first in range(0, reps, HOLD_BATCH):
        batch = pairs[first:first + HOLD_BATCH]
        if first == 0 or lead_s > 0:
            events.hold(2 * (per_call_s if first == 0 else lead_s) * len(batch) + 20e-6)
        for i, (start, stop) in enumerate(batch, first):
            events.record(start)
            call(i % n_sets)
            events.record(stop)
    events.synchronize(pairs[-1][1])
    times = sorted(events.elapsed_ms(a, b) for a, b in pairs)
    return times[len(times) // 2]


def cupy_peak_bytes(call) -> int:
    """Device memory the call allocates at its high-water mark: the call runs with a fresh CuPy memory pool
    as the allocator, which keeps every block it hands out cached after it is freed and reuses a cached
    block only when no live one fits, so its total afterwards is the call's peak (outputs included)."""
    import cupy as cp

    cp.cuda.Device().synchronize()
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        result = call()
        cp.cuda.Device().synchronize()
    peak = pool.total_bytes()
    del result
    pool.free_all_blocks()
    return peak


def torch_peak_bytes(call) -> int:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak


def free_memory(torch=None):
    import cupy as cp

    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "outofmemory" in text or "out of memory" in text or "alloc_failed" in text


def n_input_sets(set_bytes: int) -> int:
    """Enough input sets that rotating through them streams more than twice the L2 between reuses."""
    import cupy as cp

    l2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id).get("l2CacheSize", 50 << 20)
    return int(min(8, max(2, math.ceil(2 * l2 / max(set_bytes, 1)) + 1)))


# --- the methods --------------------------------------------------------------------------------------

def random_array(rng, dims, dtype: str):
    """Standard-normal values in a bench dtype: drawn in float32 and rounded for bf16/fp16 (so a seed gives the
    same values as before the wide dtypes), float32 for fp32/tf32, drawn in float64 for fp64."""
    import cupy as cp

    from . import _xpref

    if dtype == "fp64":
        return rng.standard_normal(dims, dtype=cp.float64)
    x = rng.standard_normal(dims, dtype=cp.float32)
    return x if dtype in ("fp32", "tf32") else _xpref.to_lowp(x, dtype)


def cupy_inputs(shape: Shape, dtype: str, layout: str, n_sets: int, with_dout: bool, seed: int):
    """n_sets tuples (q, k, v[, dout]) of fresh standard-normal values in `dtype`, (B, S, H, D) or (B, H, S, D)."""
    import cupy as cp

    dims = (shape.batch, shape.seqlen, shape.heads, shape.head_dim) if layout == "bshd" else \
        (shape.batch, shape.heads, shape.seqlen, shape.head_dim)
    rng = cp.random.RandomState(seed)
    count = 4 if with_dout else 3
    return [tuple(random_array(rng, dims, dtype) for _ in range(count)) for _ in range(n_sets)]


def bench_cuflash(shape: Shape, args, out: list, torch=None):
    import cupy as cp

    import cuflash

    set_bytes = 3 * shape.batch * shape.seqlen * shape.heads * shape.head_dim * ITEMSIZE[shape.dtype]
    n_sets = n_input_sets(set_bytes)
    backward = args.backward and hasattr(cuflash, "attention_backward")
    sets = cupy_inputs(shape, shape.dtype, "bshd", n_sets, backward, seed=shape.seqlen)
    events, causal = CupyEvents(), shape.causal
    mods = {"window": shape.window} if shape.window else {}
    mods.update(cuflash_kwargs(shape.dtype))  # precision="fp32" / "tf32" for float32 inputs

    def fwd(i):
        q, k, v = sets[i][:3]
        return cuflash.attention(q, k, v, causal=causal, **mods)

    ms = median_ms(fwd, n_sets, events, args.reps, args.warmup)
    mem = cupy_peak_bytes(lambda: fwd(0))
    out.append(shape.record("cuflash", "fwd", ms=ms, tflops=shape.flops("fwd") / ms / 1e9, peak_mem_bytes=mem))
    if not backward:
        return
    saved = [cuflash.attention_forward(*s[:3], causal=causal, **mods) for s in sets]  # (o, lse) per set

    def bwd(i):
        q, k, v, dout = sets[i]
        o, lse = saved[i]
        return cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=args.deterministic,
                                          **mods)

    def fwd_bwd(i):
        q, k, v, dout = sets[i]
        o, lse = cuflash.attention_forward(q, k, v, causal=causal, **mods)
        return cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=args.deterministic,
                                          **mods)

    ms = median_ms(bwd, n_sets, events, args.reps, args.warmup)
    ms2 = median_ms(fwd_bwd, n_sets, events, args.reps, args.warmup)
    saved.clear()
    cp.get_default_memory_pool().free_all_blocks()
    mem = cupy_peak_bytes(lambda: fwd_bwd(0))
    label = "deterministic" if args.deterministic else ""
    out.append(shape.record("cuflash", "bwd", ms=ms, tflops=shape.flops("bwd") / ms / 1e9, peak_mem_bytes=mem,
                            note=label))
    out.append(shape.record("cuflash", "fwd+bwd", ms=ms2, tflops=shape.flops("fwd+bwd") / ms2 / 1e9,
                            peak_mem_bytes=mem, note=label))


_PLAIN_DTYPE_CACHE: dict = {}


def plain_compute_dtype(dtype: str) -> str:
    """dtype itself when CuPy runs plain attention in it (matmul, exp, sums), else "fp16" (bf16 without CuPy bf16
    GEMMs); "fp32" for tf32 (CuPy's batched float32 matmul has no TF32 mode: the anchor is float32)."""
    if dtype in ("fp16", "fp32", "fp64"):
        return dtype
    if dtype == "tf32":
        return "fp32"
    if dtype not in _PLAIN_DTYPE_CACHE:
        import cupy as cp

        from . import _xpref

        try:
            q = _xpref.to_lowp(cp.ones((1, 1, 16, 16), dtype=cp.float32), dtype)
            o, p = plain_forward(q, q, q, True, 0.25, causal_bias(16, q.dtype))
            plain_backward(q, q, q, q, o, p, 0.25)
            cp.cuda.Device().synchronize()
            _PLAIN_DTYPE_CACHE[dtype] = dtype
        except Exception:  # e.g. no bf16 GEMM or bf16 reduction in this CuPy: compute in fp16
            _PLAIN_DTYPE_CACHE[dtype] = "fp16"
    return _PLAIN_DTYPE_CACHE[dtype]


def causal_bias(n: int, dtype):
    """(N, N) additive mask: 0 where query i sees key j <= i, -inf above the diagonal."""
    import cupy as cp

    import numpy as np

    return cp.where(cp.tri(n, dtype=bool), np.float32(0), np.float32(-np.inf)).astype(dtype)


def plain_forward(q, k, v, causal: bool, scale: float, bias):
    """Standard attention on (..., N, D) arrays (B, H, N, D): S = scale Q K^T [+ bias], P = softmax(S), O = P V.
    bias: None, or an additive term broadcast onto S: the causal mask (causal=True) or an attention bias.
    Returns (O, P)."""
    import cupy as cp

    s = cp.matmul(q, k.swapaxes(-1, -2))  # (B, H, N, N) in HBM
    s *= s.dtype.type(scale)
    if bias is not None:
        s += bias
    s -= s.max(axis=-1, keepdims=True)
    cp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)  # P, kept for the backward
    return cp.matmul(s, v), s


def plain_backward(dout, q, k, v, o, p, scale: float, return_ds: bool = False):
    """Standard attention backward from the saved P: dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO*O)),
    dQ = scale dS K, dK = scale dS^T Q. With return_ds, also dS (the gradient of S, so of an additive bias)."""
    import cupy as cp

    dv = cp.matmul(p.swapaxes(-1, -2), dout)
    dp = cp.matmul(dout, v.swapaxes(-1, -2))
    acc = cp.promote_types(dp.dtype, cp.float32)  # the rowsum in float32 (float64 for float64 inputs)
    dp -= (dout.astype(acc, copy=False) * o.astype(acc, copy=False)).sum(axis=-1, keepdims=True).astype(dp.dtype)
    dp *= p  # dS
    dq = cp.matmul(dp, k)
    dq *= dq.dtype.type(scale)
    dk = cp.matmul(dp.swapaxes(-1, -2), q)
    dk *= dk.dtype.type(scale)
    return (dq, dk, dv, dp) if return_ds else (dq, dk, dv)


def bench_plain(shape: Shape, args, out: list, torch=None):
    compute = plain_compute_dtype(shape.dtype)
    note = "" if compute == shape.dtype else TF32_ANCHOR_NOTE if shape.dtype == "tf32" else \
        f"computed in {compute}: CuPy cannot run it in {shape.dtype}"
    sets = cupy_inputs(shape, compute, "bhsd", 1, args.backward, seed=shape.seqlen + 1)
    q, k, v = sets[0][:3]
    bias = causal_bias(shape.seqlen, q.dtype) if shape.causal else None
    scale = 1.0 / math.sqrt(shape.head_dim)
    events = CupyEvents()
    kw = dict(compute_dtype=compute if compute != shape.dtype else None, note=note)

    def fwd(_):
        return plain_forward(q, k, v, shape.causal, scale, bias)

    ms = median_ms(fwd, 1, events, args.reps, args.warmup)
    mem = cupy_peak_bytes(lambda: fwd(0))
    out.append(shape.record("plain", "fwd", ms=ms, tflops=shape.flops("fwd") / ms / 1e9, peak_mem_bytes=mem, **kw))
    if not args.backward:
        return
    dout = sets[0][3]
    saved = [fwd(0)]  # (O, P): standard attention keeps P for the backward

    def bwd(_):
        o, p = saved[0]
        return plain_backward(dout, q, k, v, o, p, scale)

    ms = median_ms(bwd, 1, events, args.reps, args.warmup)
    saved.clear()
    free_memory()

    def fwd_bwd(_):
        o_, p_ = plain_forward(q, k, v, shape.causal, scale, bias)
        return plain_backward(dout, q, k, v, o_, p_, scale)

    ms2 = median_ms(fwd_bwd, 1, events, args.reps, args.warmup)
    mem = cupy_peak_bytes(lambda: fwd_bwd(0))
    out.append(shape.record("plain", "bwd", ms=ms, tflops=shape.flops("bwd") / ms / 1e9, peak_mem_bytes=mem, **kw))
    out.append(shape.record("plain", "fwd+bwd", ms=ms2, tflops=shape.flops("fwd+bwd") / ms2 / 1e9,
                            peak_mem_bytes=mem, **kw))


class float32_matmul_precision:
    """Context: torch's float32 matmul precision set to `value` ("highest": no TF32), restored after."""

    def __init__(self, torch, value: str = "highest"):
        self.torch, self.value, self.before = torch, value, None

    def __enter__(self):
        with warnings.catch_warnings():  # newer torch may call the setter legacy: the setting is what counts
            warnings.simplefilter("ignore")
            self.before = self.torch.get_float32_matmul_precision()
            self.torch.set_float32_matmul_precision(self.value)
        return self

    def __exit__(self, *exc):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.torch.set_float32_matmul_precision(self.before)
        return False


def bench_sdpa(shape: Shape, args, method: str, backend_name: str, out: list, torch):
    if shape.dtype in WIDE_DTYPES:  # float32 anchors never use TF32 (tf32 rows included: noted)
        with float32_matmul_precision(torch, "highest"):
            return _bench_sdpa(shape, args, method, backend_name, out, torch)
    return _bench_sdpa(shape, args, method, backend_name, out, torch)


def _bench_sdpa(shape: Shape, args, method: str, backend_name: str, out: list, torch):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    tdtype = getattr(torch, TORCH_DTYPE[shape.dtype])
    dims = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    set_bytes = 3 * math.prod(dims) * ITEMSIZE[shape.dtype]
    n_sets = n_input_sets(set_bytes)
    kw = dict(compute_dtype="fp32", note=TF32_ANCHOR_NOTE) if shape.dtype == "tf32" else {}
    gen = torch.Generator(device="cuda").manual_seed(shape.seqlen)
    # (B, S, H, D) tensors like cuflash's inputs; SDPA wants (B, H, S, D): transposed views, no copies
    leaves = [[torch.randn(dims, dtype=tdtype, device="cuda", generator=gen).requires_grad_(args.backward)
               for _ in range(3)] for _ in range(n_sets)]
    douts = [torch.randn(dims, dtype=tdtype, device="cuda", generator=gen).transpose(1, 2) for _ in range(n_sets)]
    events, causal = TorchEvents(), shape.causal

    def sdpa(i):
        q, k, v = (x.transpose(1, 2) for x in leaves[i])
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd(i):
        with torch.no_grad():
            return sdpa(i)

    ms = median_ms(fwd, n_sets, events, args.reps, args.warmup)
    mem = torch_peak_bytes(lambda: fwd(0))
    out.append(shape.record(method, "fwd", ms=ms, tflops=shape.flops("fwd") / ms / 1e9, peak_mem_bytes=mem, **kw))
    if not args.backward:
        return
    outs = [sdpa(i) for i in range(n_sets)]

    def bwd(i):
        return torch.autograd.grad(outs[i], leaves[i], douts[i], retain_graph=True)

    def fwd_bwd(i):
        return torch.autograd.grad(sdpa(i), leaves[i], douts[i])

    ms = median_ms(bwd, n_sets, events, args.reps, args.warmup)
    outs.clear()
    free_memory(torch)
    ms2 = median_ms(fwd_bwd, n_sets, events, args.reps, args.warmup)
    mem = torch_peak_bytes(lambda: fwd_bwd(0))
    out.append(shape.record(method, "bwd", ms=ms, tflops=shape.flops("bwd") / ms / 1e9, peak_mem_bytes=mem, **kw))
    out.append(shape.record(method, "fwd+bwd", ms=ms2, tflops=shape.flops("fwd+bwd") / ms2 / 1e9,
                            peak_mem_bytes=mem, **kw))


def run_method(name, fn, shape, records, backward: bool, torch=None, passes=None):
    """Run one method's measurements; an error (out of memory, a backend that cannot run the shape)
    becomes a skipped row with a note for each pass not measured, instead of ending the benchmark.
    passes: the passes fn measures (default: fwd, and bwd and fwd+bwd when backward)."""
    t0 = time.perf_counter()
    before = len(records)
    if passes is None:
        passes = ("fwd", "bwd", "fwd+bwd") if backward else ("fwd",)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported, never silent
        why = "out of memory" if is_oom(e) else f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
        done = {r.passname for r in records[before:]}
        missing = [p for p in passes if p not in done]
        print(f"    note: {name} {'/'.join(missing)} skipped for {shape}: {why}")
        records.extend(shape.record(name, p, note=f"skipped: {why}") for p in missing)
    finally:
        free_memory(torch)
    return time.perf_counter() - t0


# --- wide dtypes: the SDPA support probe, float32 arithmetic checks, cuBLAS GEMM ceilings ----------------------

TF32_ANCHOR_NOTE = "float32 anchor (no TF32)"
TF32_SHARED_NOTE = "float32 anchor (no TF32): the fp32 row's measurement"
_SDPA_SUPPORT: dict = {}


def unsupported_reason(run) -> str:
    """"" when run() returns, else why not, on one line: the warning that names a dtype (torch explains there why a
    forced backend refuses the inputs), else the first warning, else the error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run()
            return ""
        except Exception as e:  # noqa: BLE001 - the reason is the result
            if is_oom(e):
                return ""  # not a refusal: the measurement itself will say
            texts = [re.sub(r"\s*\(Triggered internally at [^)]*\)", "", str(w.message).strip().splitlines()[0])
                     for w in caught if str(w.message).strip()]
            why = next((t for t in texts if "dtype" in t.lower()), texts[0] if texts else "")
            return (why or f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")[:200]


def probe_sdpa(torch, method: str, dtype: str, head_dim: int, backward: bool) -> str:
    """"" when SDPA with `method`'s backend forced runs a small (1, 2, 128, D) problem in dtype (and its backward
    when asked), else why not (cached per method, dtype, D and pass)."""
    key = (method, dtype, head_dim, backward)
    if key not in _SDPA_SUPPORT:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tdtype = getattr(torch, TORCH_DTYPE[dtype])

        def run():
            q, k, v = (torch.randn(1, 2, 128, head_dim, dtype=tdtype, device="cuda", requires_grad=backward)
                       for _ in range(3))
            with sdpa_kernel(getattr(SDPBackend, SDPA_METHODS[method])), float32_matmul_precision(torch):
                o = F.scaled_dot_product_attention(q, k, v)
                if backward:
                    o.sum().backward()
            torch.cuda.synchronize()

        _SDPA_SUPPORT[key] = unsupported_reason(run)
    return _SDPA_SUPPORT[key]


ARITH_CHECK_K = 1024      # the inner dimension of the products whose error tells FP32 from TF32 arithmetic
FP32_MAX_REL_ERROR = 1e-5  # max|C - C64| / max|C64| at K = 1024: FP32 ~1.5e-6, TF32 ~3e-4 (H100, cuBLAS 13)
FP64_MAX_REL_ERROR = 1e-12


def rel_error(c, ref) -> float:
    """max|c - ref| / max|ref| (NumPy or CuPy arrays)."""
    return float(abs(c - ref).max() / abs(ref).max())


def arithmetic_label(err, dtype: str = "float32") -> str:
    """Which arithmetic a product's relative error against float64 shows: "FP32" / "TF32-like", "FP64" / "not FP64"."""
    if err is None:
        return "?"
    if dtype == "float64":
        return "FP64" if err < FP64_MAX_REL_ERROR else "not FP64"
    return "FP32" if err < FP32_MAX_REL_ERROR else "TF32-like"


def cupy_float32_without_tf32() -> str:
    """Set CuPy's float32 matmul compute type to its default (no TF32), whatever CUPY_TF32 asked at import (it
    applies to CuPy's 2-D products; the batched ones of plain attention never use TF32 in CuPy 13-14). Returns a
    note for the run's log, or ""."""
    notes = []
    try:
        asked = int(os.environ.get("CUPY_TF32", "0") or 0) > 0
    except ValueError:
        asked = False
    try:
        import numpy as np
        from cupy._core import _routines_linalg as linalg

        linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_DEFAULT)
        if asked:
            notes.append("CUPY_TF32 is set: CuPy's float32 matmul compute type reset to its default (no TF32) "
                         "for this run")
    except Exception as e:  # noqa: BLE001 - a CuPy without this (private) switch: the check below still runs
        if asked:
            notes.append(f"CUPY_TF32 is set and CuPy's compute type could not be reset ({type(e).__name__}): "
                         f"see the float32 matmul check")
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        notes.append("NVIDIA_TF32_OVERRIDE=0 disables TF32 in cuBLAS: the TF32 ceiling runs in FP32 (its error "
                     "says so)")
    return "; ".join(notes)


def float32_matmul_checks(torch=None) -> dict:
    """Relative error against float64 of a batched float32 product (2, 256, K) @ (2, K, 256), K = ARITH_CHECK_K,
    made as the float32 anchors make theirs: CuPy's matmul (plain) and, given torch, torch.matmul at float32 matmul
    precision "highest" (sdpa-math). FP32 arithmetic gives ~1e-6, TF32 ~3e-4."""
    import cupy as cp

    rng = cp.random.RandomState(11)
    a = rng.standard_normal((2, 256, ARITH_CHECK_K), dtype=cp.float32)
    b = rng.standard_normal((2, ARITH_CHECK_K, 256), dtype=cp.float32)
    out = {"plain": rel_error(cp.matmul(a, b), cp.matmul(a.astype(cp.float64), b.astype(cp.float64)))}
    if torch is not None:
        cp.cuda.Device().synchronize()
        with float32_matmul_precision(torch, "highest"):
            ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
            c = torch.matmul(ta, tb).double()
            ref = torch.matmul(ta.double(), tb.double())
            out["sdpa-math"] = float(((c - ref).abs().max() / ref.abs().max()).item())
    return out


def print_matmul_checks(checks: dict):
    if not checks:
        return
    how = {"plain": "plain (cupy.matmul, batched)", "sdpa-math": "sdpa-math (torch.matmul at precision 'highest')"}
    print(f"float32 matmul check (max|C - C_float64| / max|C_float64|, K = {ARITH_CHECK_K}; FP32 ~1e-6, TF32 ~3e-4): "
          + ", ".join(f"{how.get(m, m)} {e:.1e} {arithmetic_label(e)}" for m, e in checks.items()))
    bad = [m for m, e in checks.items() if arithmetic_label(e) != "FP32"]
    if bad:
        print(f"warning: {', '.join(bad)} multiplied float32 matrices with TF32-level error: those float32 anchors are "
              f"not FP32 (unset CUPY_TF32 / TF32 overrides and rerun)")


@dataclass
class Ceiling:
    name: str          # "sgemm" | "tf32-gemm" | "dgemm"
    label: str
    compute_type: str  # the cublasComputeType_t of the cublasGemmEx calls
    size: int          # M = N = K
    ms: float | None = None
    tflops: float | None = None
    rel_error: float | None = None  # an ARITH_CHECK_K^3 product of the same call against NumPy's float64 one
    arithmetic: str = ""            # what rel_error shows: FP32 / TF32-like / FP64
    note: str = ""


# name: (label, dtype, cublasComputeType_t, cublasGemmAlgo_t)
CEILINGS = {
    "sgemm": ("FP32 SGEMM, CUDA cores", "float32", "CUBLAS_COMPUTE_32F", "CUBLAS_GEMM_DEFAULT"),
    "tf32-gemm": ("TF32 tensor-core GEMM", "float32", "CUBLAS_COMPUTE_32F_FAST_TF32", "CUBLAS_GEMM_DEFAULT_TENSOR_OP"),
    "dgemm": ("FP64 DGEMM, FP64 tensor cores on sm_80+", "float64", "CUBLAS_COMPUTE_64F", "CUBLAS_GEMM_DEFAULT"),
}
CEILING_OF = {"fp32": "sgemm", "tf32": "tf32-gemm", "fp64": "dgemm"}  # the wide table's %gemm reference
CEILING_SIZE = 8192


def ceilings_for(dtypes) -> list[str]:
    """The ceilings of the wide dtypes asked for: SGEMM and TF32 GEMM for fp32 / tf32, DGEMM for fp64."""
    names = set()
    for d in dtypes:
        if d in ("fp32", "tf32"):
            names |= {"sgemm", "tf32-gemm"}
        elif d == "fp64":
            names.add("dgemm")
    return [n for n in CEILINGS if n in names]


def measure_ceiling(name: str, size: int, args) -> Ceiling:
    """One cuBLAS GEMM ceiling: cublasGemmEx with the compute type named in CEILINGS on size x size matrices, timed
    like the attention calls (median_ms); its arithmetic checked on an ARITH_CHECK_K^3 product against float64."""
    label, dtype_name, compute_name, algo_name = CEILINGS[name]
    ceiling = Ceiling(name, label, compute_name, size)
    try:
        import cupy as cp
        import numpy as np
        from cupy.cuda import device
        from cupy_backends.cuda.libs import cublas

        dtype = np.dtype(dtype_name)
        cuda_dtype = cp.cuda.runtime.CUDA_R_64F if dtype == np.float64 else cp.cuda.runtime.CUDA_R_32F
        compute, algo = getattr(cublas, compute_name), getattr(cublas, algo_name)
        one, zero = np.ones(1, dtype), np.zeros(1, dtype)  # alpha, beta: host scalars of the compute type

        def gemm(a, b, c):  # column-major C = A B, i.e. c = b @ a read row-major (square matrices)
            n = a.shape[0]
            cublas.gemmEx(device.get_cublas_handle(), cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, n, n,
                          one.ctypes.data, a.data.ptr, cuda_dtype, n, b.data.ptr, cuda_dtype, n,
                          zero.ctypes.data, c.data.ptr, cuda_dtype, n, compute, algo)
            return c

        rng = cp.random.RandomState(size)
        a, b = (rng.standard_normal((ARITH_CHECK_K, ARITH_CHECK_K), dtype=dtype) for _ in range(2))
        ref = b.get().astype(np.float64) @ a.get().astype(np.float64)  # on the host: not the cuBLAS under test
        ceiling.rel_error = rel_error(gemm(a, b, cp.empty_like(a)).get(), ref)
        ceiling.arithmetic = arithmetic_label(ceiling.rel_error, dtype_name)
        del a, b
        mats = [rng.standard_normal((size, size), dtype=dtype) for _ in range(3)]
        ceiling.ms = median_ms(lambda i: gemm(*mats), 1, CupyEvents(), args.reps, args.warmup)
        ceiling.tflops = 2.0 * size ** 3 / ceiling.ms / 1e9
        mats.clear()
    except Exception as e:  # noqa: BLE001 - reported, never silent
        ceiling.note = "skipped: " + ("out of memory" if is_oom(e) else
                                      f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}")
    finally:
        free_memory()
    return ceiling


def print_ceilings(ceilings):
    if not ceilings:
        return
    print(f"\ncuBLAS GEMM ceilings, M = N = K = {ceilings[0].size} (cublasGemmEx, median time, measured in this run; "
          f"rel. error: a {ARITH_CHECK_K}^3 product of the same call against NumPy's float64 one, FP32 ~1e-6, TF32 "
          f"~3e-4, FP64 ~1e-15):")
    for c in ceilings:
        what = f"{c.label} ({c.compute_type})"
        if c.tflops is None:
            print(f"  {c.name:<9} {what}: {c.note}")
            continue
        print(f"  {c.name:<9} {what:<62} {c.tflops:7.1f} TFLOP/s {c.ms:8.2f} ms   rel. error {c.rel_error:.1e} "
              f"({c.arithmetic})")
        if c.name == "tf32-gemm":
            print(f"  {'':<9} {'TF32 GEMM / 3: the tensor-core ceiling of 3xTF32 (three products per useful one)':<62} "
                  f"{c.tflops / 3:7.1f} TFLOP/s")


# --- the default mode's sweep ------------------------------------------------------------------------------

def _sdpa_bench(method):
    return lambda shape, args, out, torch: bench_sdpa(shape, args, method, SDPA_METHODS[method], out, torch)


SWEEP_BENCH = {"cuflash": bench_cuflash, "plain": bench_plain, **{m: _sdpa_bench(m) for m in SDPA_METHODS}}


def sweep_methods(args, torch) -> list[str]:
    """cuflash, plain (unless --no-compare), SDPA's flash, cuDNN and memory-efficient backends (torch with CUDA) and
    its math backend (with a wide dtype, or named in --methods); --window keeps cuflash only; --methods narrows."""
    methods = ["cuflash"] + (["plain"] if args.compare else [])
    if torch is not None:
        methods += [name for name, _ in SDPA_BACKENDS]
        if any(d in WIDE_DTYPES for d in args.dtype) or (args.methods and SDPA_MATH[0] in args.methods):
            methods.append(SDPA_MATH[0])
    if args.window is not None:
        print(f"note: window={tuple(args.window)}: only cuflash runs (the other methods have no sliding window); "
              f"TFLOP/s below count only the (query, key) pairs inside the band (the tables' N^2 captions do not "
              f"apply)")
        methods = ["cuflash"]
    if args.methods is not None:
        missing = [m for m in args.methods if m not in methods]
        if missing:
            print(f"note: {', '.join(missing)} not available here (torch missing or --no-compare): skipped")
        methods = [m for m in methods if m in args.methods]
    return methods


def methods_for(dtype: str, methods, args) -> list[str]:
    """The methods of one dtype's rows: sdpa-math joins bf16/fp16 only when --methods names it."""
    if dtype in WIDE_DTYPES or (args.methods and SDPA_MATH[0] in args.methods):
        return list(methods)
    return [m for m in methods if m != SDPA_MATH[0]]


def tf32_rows_from_fp32(records, shape: Shape, method: str) -> list[Record]:
    """The tf32 rows of an anchor (plain, SDPA): copies of its fp32 rows of the same shape (float32 arithmetic, the
    same measurement), relabelled."""
    out = []
    for r in records:
        if (r.method, r.dtype, r.head_dim, r.causal, r.seqlen) == (method, "fp32", shape.head_dim, shape.causal,
                                                                    shape.seqlen):
            note = r.note if r.note.startswith("skipped") else TF32_SHARED_NOTE
            out.append(Record(**{**asdict(r), "dtype": "tf32", "compute_dtype": "fp32", "note": note}))
    return out


def run_sweep(args, methods, torch, backward: bool, t_start: float | None = None) -> list[Record]:
    """Every (dtype, D, causal, N) of the arguments, each method in turn (run_method), one progress line per pass."""
    t_start = time.perf_counter() if t_start is None else t_start
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    window = tuple(args.window) if args.window else None
    records: list[Record] = []
    refused, out_of_time = set(), 0
    for dtype in ordered_dtypes(args.dtype):
        dtype_methods = methods_for(dtype, methods, args)
        for d in args.head_dim:
            for causal in causals:
                for n in args.seqlen:
                    shape = Shape(dtype, d, causal, n, window)
                    if args.time_limit is not None and time.perf_counter() - t_start > args.time_limit:
                        out_of_time += 1
                        why = f"skipped: --time-limit {args.time_limit:g} s reached"
                        records.extend(shape.record(m, p, note=why) for m in dtype_methods
                                       for p in (PASSES if (backward if m == "cuflash" else args.backward) else
                                                 ("fwd",)))
                        continue
                    times = {}
                    for m in dtype_methods:
                        m_backward = backward if m == "cuflash" else args.backward
                        if dtype == "tf32" and m != "cuflash" and "fp32" in args.dtype:
                            records.extend(tf32_rows_from_fp32(records, shape, m))
                            continue
                        if m in SDPA_METHODS and dtype in WIDE_DTYPES:
                            why = probe_sdpa(torch, m, dtype, d, m_backward)
                            if why:
                                if (m, dtype) not in refused:
                                    refused.add((m, dtype))
                                    print(f"    note: {m} does not run {TORCH_DTYPE[dtype]} ({dtype} rows): {why}")
                                records.extend(shape.record(m, p, note=f"skipped: unsupported: {why}")
                                               for p in (PASSES if m_backward else ("fwd",)))
                                continue
                        times[m] = run_method(m, lambda s=shape, f=SWEEP_BENCH[m]: f(s, args, records, torch), shape,
                                              records, m_backward, torch)
                    for p in PASSES if backward else ("fwd",):
                        tf = {r.method: r.tflops for r in records if r.passname == p and r.tflops and
                              (r.dtype, r.head_dim, r.causal, r.seqlen) == (dtype, d, causal, n)}
                        print(f"{shape} {p}: " + ", ".join(f"{m} {tf[m]:.0f}" for m in dtype_methods if m in tf)
                              + " TFLOP/s" + (f" ({sum(times.values()):.1f} s)" if p == "fwd" else ""), flush=True)
    if out_of_time:
        print(f"note: --time-limit {args.time_limit:g} s reached: {out_of_time} shapes not run (their rows say so)")
    return records


# --- report -------------------------------------------------------------------------------------------

def _fmt(value, spec):
    """value in `spec` ("8.2f"), or "-" right-aligned in the same width."""
    return format(value, spec) if value is not None else format("-", f">{spec.split('.')[0]}")


def print_table(records: list[Record], methods: list[str]):
    passes = [p for p in ("fwd", "bwd", "fwd+bwd") if any(r.passname == p and r.ms for r in records)]
    index = {(r.method, r.passname, r.dtype, r.head_dim, r.causal, r.seqlen): r for r in records}
    keys = sorted({(r.dtype, r.head_dim, r.causal, r.seqlen) for r in records},
                  key=lambda k: (k[0], k[1], k[2], k[3]))
    short = {"cuflash": "cuflash", "plain": "plain", "sdpa-flash": "flash", "sdpa-cudnn": "cudnn",
             "sdpa-efficient": "effic", "sdpa-math": "math"}
    for p in passes:
        print(f"\n{p} TFLOP/s (FLOPs: {PASS_FLOP_FACTOR[p]:g} x 4*B*H*N^2*D, halved when causal); "
              f"peak extra memory in MiB")
        cols = [short[m] for m in methods]
        head = (f"{'dtype':<5} {'D':>3} {'causal':<6} {'N':>6} | " + " ".join(f"{c:>7}" for c in cols)
                + " | cf/flash | " + " ".join(f"{'MiB ' + c:>12}" for c in cols))
        print(head)
        print("-" * len(head))
        for key in keys:
            rows = [index.get((m, p) + key) for m in methods]
            if not any(r is not None and r.ms for r in rows):
                continue
            tf = [r.tflops if r is not None else None for r in rows]
            flash, ours = index.get(("sdpa-flash", p) + key), index.get(("cuflash", p) + key)
            ratio = (ours.tflops / flash.tflops if ours is not None and ours.tflops and flash is not None
                     and flash.tflops else None)
            mem = [r.peak_mem_bytes / 2**20 if r is not None and r.peak_mem_bytes is not None else None for r in rows]
            plain = index.get(("plain", p) + key)
            mark = "*" if plain is not None and plain.compute_dtype else " "
            print(f"{key[0]:<5} {key[1]:>3} {'yes' if key[2] else 'no':<6} {key[3]:>6} | "
                  + " ".join(f"{_fmt(x, '7.1f')}" for x in tf)
                  + f" | {_fmt(ratio, '8.2f')} | " + " ".join(f"{_fmt(x, '12.0f')}" for x in mem) + mark)
    if any(r.compute_dtype for r in records):
        print("* plain attention for this dtype was computed in "
              f"{next(r.compute_dtype for r in records if r.compute_dtype)} (CuPy could not run it in the input dtype)")
    skipped = [r for r in records if r.note.startswith("skipped")]
    for r in skipped:
        print(f"skipped: {r.method} {r.dtype} D={r.head_dim} causal={r.causal} N={r.seqlen}: {r.note[9:]}")


WIDE_LEGEND = (
    "arithmetic: cuflash fp32 = precision 'fp32' (3xTF32 split products, float32 accuracy), tf32 = precision 'tf32' "
    "(one TF32 product), fp64 = float64 on the FP64 tensor cores;",
    "  plain = CuPy attention, cuBLAS batched matmuls in float32 (no TF32) / float64, S and P in HBM; math = SDPA's "
    "math backend, torch matmuls at float32 precision 'highest' (no TF32) / float64;",
    "  effic = SDPA's memory-efficient backend (CUTLASS), float32 only: 3xTF32 on sm_80+ (the kernel's own choice, "
    "no setting changes it);",
    "  tf32 rows: no anchor is a one-pass TF32 computation (only the TF32 GEMM ceiling is); their plain and SDPA "
    "columns are the float32 measurements.",
)


def skipped_summary(records) -> list[str]:
    """One line per (method, dtype, reason, passes) of the skipped rows, naming the shapes it covers."""
    passes_of: dict = {}  # (method, dtype, reason, shape) -> the passes skipped there
    for r in records:
        if r.note.startswith("skipped"):
            passes_of.setdefault((r.method, r.dtype, r.note[9:], (r.head_dim, r.causal, r.seqlen)), set()).add(
                r.passname)
    groups: dict = {}
    for (method, dtype, why, shape), skipped in passes_of.items():
        passes = "/".join(p for p in PASSES if p in skipped)
        groups.setdefault((method, dtype, why, passes), []).append(shape)
    lines = []
    for (method, dtype, why, passes), shapes in groups.items():
        shapes = sorted(shapes)
        every = len(shapes) > 1 and set(shapes) == {(r.head_dim, r.causal, r.seqlen) for r in records
                                                     if r.dtype == dtype}
        where = "every shape" if every else ", ".join(
            f"D={d} {'causal' if c else 'full'} N={n}" for d, c, n in shapes[:6]) + (
            f" and {len(shapes) - 6} more" if len(shapes) > 6 else "")
        lines.append(f"skipped: {method} {dtype} {passes}, {len(shapes)} shape{'s' if len(shapes) > 1 else ''} "
                     f"({where}): {why}")
    return lines


def print_wide_table(records: list[Record], methods: list[str], ceilings=()):
    """The fp32 / tf32 / fp64 rows: TFLOP/s and ms of each method that ran, cuflash's speedup over the fastest other
    method (cf/best, a time ratio) and its TFLOP/s as % of its dtype's cuBLAS GEMM ceiling (%gemm), peak memory."""
    if not records:
        return
    short = {"cuflash": "cuflash", "plain": "plain", "sdpa-flash": "flash", "sdpa-cudnn": "cudnn",
             "sdpa-efficient": "effic", "sdpa-math": "math"}
    ceiling = {c.name: c.tflops for c in ceilings if c.tflops}
    passes = [p for p in PASSES if any(r.passname == p and r.ms for r in records)]
    cols = [m for m in methods if m == "cuflash" or any(r.method == m and r.ms for r in records)]
    index = {(r.method, r.passname, r.dtype, r.head_dim, r.causal, r.seqlen): r for r in records}
    keys = sorted({(r.dtype, r.head_dim, r.causal, r.seqlen) for r in records},
                  key=lambda k: (DTYPES.index(k[0]), k[1], k[2], k[3]))
    for p in passes:
        print(f"\n{p}, float32 / float64 inputs: TFLOP/s (FLOPs: {PASS_FLOP_FACTOR[p]:g} x 4*B*H*N^2*D, halved when "
              f"causal) and ms per call; cf/best: the fastest other method's time / cuflash's; %gemm: cuflash's "
              f"TFLOP/s as % of its dtype's cuBLAS GEMM ceiling (fp32: SGEMM, tf32: TF32 GEMM, fp64: DGEMM); peak "
              f"extra memory in MiB")
        head = (f"{'dtype':<5} {'D':>3} {'causal':<6} {'N':>6} | " + " ".join(f"{short[m]:>7}" for m in cols)
                + " | " + " ".join(f"{'ms ' + short[m]:>10}" for m in cols) + " | cf/best  %gemm | "
                + " ".join(f"{'MiB ' + short[m]:>12}" for m in cols))
        print(head)
        print("-" * len(head))
        for key in keys:
            rows = [index.get((m, p) + key) for m in cols]
            if not any(r is not None and r.ms for r in rows):
                continue
            ours = index.get(("cuflash", p) + key)
            others = [r for m, r in zip(cols, rows) if m != "cuflash" and r is not None and r.ms]
            best = min(others, key=lambda r: r.ms) if others else None
            ratio = best.ms / ours.ms if best is not None and ours is not None and ours.ms else None
            gemm = ceiling.get(CEILING_OF[key[0]])
            pct = 100 * ours.tflops / gemm if gemm and ours is not None and ours.tflops else None
            tf = [r.tflops if r is not None else None for r in rows]
            ms = [r.ms if r is not None else None for r in rows]
            mem = [r.peak_mem_bytes / 2**20 if r is not None and r.peak_mem_bytes is not None else None for r in rows]
            print(f"{key[0]:<5} {key[1]:>3} {'yes' if key[2] else 'no':<6} {key[3]:>6} | "
                  + " ".join(_fmt(x, "7.1f") for x in tf) + " | " + " ".join(_fmt(x, "10.3f") for x in ms)
                  + f" | {_fmt(ratio, '7.2f')} {_fmt(pct, '6.0f')} | " + " ".join(_fmt(x, "12.0f") for x in mem))
    if passes:
        print("\n".join(WIDE_LEGEND))
    for line in skipped_summary(records):
        print(line)


def plot(records: list[Record], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.dtype, r.head_dim, r.causal) for r in records})
    cols = min(4, len(groups))
    rows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    styles = {"fwd": "-", "bwd": "--", "fwd+bwd": ":"}
    for ax, (dtype, d, causal) in zip(axes.flat, groups):
        for method in METHODS:
            for p, ls in styles.items():
                pts = sorted((r.seqlen, r.tflops) for r in records if (r.method, r.passname, r.dtype, r.head_dim,
                             r.causal) == (method, p, dtype, d, causal) and r.tflops)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], ls, marker="o", ms=3, label=f"{method} {p}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype}, D={d}, {'causal' if causal else 'full'}", fontsize=9)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


# --- decoding: attention_with_kvcache against the device-copy ceiling and torch SDPA -----------------------

DECODE_BATCHES = (1, 8, 64)
DECODE_CACHE_LENS = (1024, 8192, 32768, 131072)
DECODE_HEADS = ("32:8",)  # H_q:H_kv; the default is grouped-query (Llama-3-8B-like); "32:32" is multi-head
DECODE_HEAD_DIM = 128
DECODE_MAX_GB = 20.0
COPY_BYTES = 2 << 30  # the device-copy ceiling: one 2 GiB copy, bytes read + written


@dataclass
class DecodeRecord:
    method: str  # "cuflash" (cache_seqlens=None) | "cuflash-lens" (an int32 length array) | "sdpa"
    dtype: str
    batch: int
    cache_len: int
    heads_q: int
    heads_kv: int
    head_dim: int
    kv_bytes: int  # K and V of the valid prefix, read once
    ms: float | None = None
    gbps: float | None = None  # kv_bytes / time
    pct_of_copy: float | None = None  # gbps / the device-copy ceiling
    note: str = ""  # the SDPA backend that was fastest, or why a row was skipped


def decode_kv_bytes(batch: int, cache_len: int, heads_kv: int, head_dim: int, elem_bytes: int = 2) -> int:
    return 2 * batch * cache_len * heads_kv * head_dim * elem_bytes


def parse_heads(text: str) -> tuple[int, int]:
    """"32:8" -> (32, 8): H_q:H_kv with H_q a multiple of H_kv."""
    try:
        hq, hkv = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"heads {text!r}: expected H_q:H_kv, e.g. 32:8") from None
    if hq < 1 or hkv < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"heads {text!r}: H_q must be a positive multiple of H_kv")
    return hq, hkv


def decode_shapes(batches, cache_lens, heads, head_dim, max_gb):
    """(batch, L, H_q, H_kv, skip reason or "") for every combination; K/V above max_gb are skipped."""
    out = []
    for hq, hkv in heads:
        for b in batches:
            for n in cache_lens:
                gb = decode_kv_bytes(b, n, hkv, head_dim) / 1e9
                out.append((b, n, hq, hkv, f"skipped: K/V {gb:.1f} GB > --decode-max-gb {max_gb:g}"
                            if gb > max_gb else ""))
    return out


def copy_ceiling_gbps(args) -> float:
    """Device-to-device copy of COPY_BYTES: (bytes read + bytes written) / median time, in GB/s."""
    import cupy as cp

    src = cp.ones(COPY_BYTES // 4, dtype=cp.float32)
    bufs = {"src": src, "dst": cp.empty_like(src)}  # cleared below: the closure holds no array after
    del src

    def copy(_):
        cp.cuda.runtime.memcpyAsync(bufs["dst"].data.ptr, bufs["src"].data.ptr, COPY_BYTES,
                                    cp.cuda.runtime.memcpyDeviceToDevice, cp.cuda.get_current_stream().ptr)

    ms = median_ms(copy, 1, CupyEvents(), args.reps, args.warmup)
    bufs.clear()
    free_memory()
    return 2 * COPY_BYTES / ms / 1e6


def decode_inputs(b, n, hq, hkv, d, dtype, n_sets, seed):
    """n_sets (q, k_cache, v_cache, cache_seqlens): q (B, 1, H_q, D), full dense caches (B, L, H_kv, D)."""
    import cupy as cp

    from . import _xpref

    rng = cp.random.RandomState(seed)
    lens = cp.full((b,), n, dtype=cp.int32)
    return [(_xpref.to_lowp(rng.standard_normal((b, 1, hq, d), dtype=cp.float32), dtype),
             _xpref.to_lowp(rng.standard_normal((b, n, hkv, d), dtype=cp.float32), dtype),
             _xpref.to_lowp(rng.standard_normal((b, n, hkv, d), dtype=cp.float32), dtype), lens)
            for _ in range(n_sets)]


def to_torch(x, torch):
    """A torch view of a CuPy array through DLPack (no copy); bf16 through an int16 view if needed; float32 and
    float64 as they are."""
    import cupy as cp

    if x.dtype.itemsize != 2:
        return torch.from_dlpack(x)
    try:
        t = torch.from_dlpack(x)
        if t.dtype in (torch.float16, torch.bfloat16):
            return t
    except Exception:  # noqa: BLE001 - an older CuPy or torch without bf16 DLPack: go through int16
        pass
    t = torch.from_dlpack(x.view(cp.int16))
    return t.view(torch.bfloat16 if x.dtype != cp.float16 else torch.float16)


def bench_decode(rec: DecodeRecord, args, out: list, torch, ceiling: float):
    import cupy as cp

    import cuflash

    n_sets = n_input_sets(rec.kv_bytes)
    sets = decode_inputs(rec.batch, rec.cache_len, rec.heads_q, rec.heads_kv, rec.head_dim, rec.dtype, n_sets,
                         seed=rec.cache_len + rec.batch)
    cuflash.attention_with_kvcache(*sets[0][:3], cache_seqlens=sets[0][3])  # once with the value checks

    def whole(i):  # attention over the whole cache: what SDPA is asked below
        q, kc, vc, _ = sets[i]
        return cuflash.attention_with_kvcache(q, kc, vc, num_splits=0, check_inputs=False)

    def with_lens(i):  # the same keys, named by a per-sequence length array that the kernel reads
        q, kc, vc, lens = sets[i]
        return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=0, check_inputs=False)

    for method, call in (("cuflash", whole), ("cuflash-lens", with_lens)):
        ms = median_ms(call, n_sets, CupyEvents(), args.reps, args.warmup)
        gbps = rec.kv_bytes / ms / 1e6
        out.append(DecodeRecord(**{**asdict(rec), "method": method, "ms": ms, "gbps": gbps,
                                   "pct_of_copy": 100 * gbps / ceiling}))
    if torch is None:
        return
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cp.cuda.Device().synchronize()
    tsets = [tuple(to_torch(x, torch).transpose(1, 2) for x in s[:3]) for s in sets]  # (B, H, S, D) views
    extra = {"enable_gqa": True} if rec.heads_q != rec.heads_kv else {}
    best, notes = None, []
    def sdpa(i):
        q, k, v = tsets[i]
        return F.scaled_dot_product_attention(q, k, v, **extra)

    for name, backend_name in SDPA_BACKENDS:
        try:  # the backend context is entered once, outside the timed calls (its cost is not SDPA's)
            with torch.no_grad(), sdpa_kernel(getattr(SDPBackend, backend_name)), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "backend X cannot run this shape" warnings: noted below
                t_ms = median_ms(sdpa, n_sets, TorchEvents(), args.reps, args.warmup)
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this shape: noted, not fatal
            notes.append(f"{name[5:]}: {'out of memory' if is_oom(e) else type(e).__name__}")
            free_memory(torch)
            continue
        if best is None or t_ms < best[1]:
            best = (name, t_ms)
    if best is None:
        out.append(DecodeRecord(**{**asdict(rec), "method": "sdpa", "note": "skipped: " + "; ".join(notes)}))
        return
    gbps = rec.kv_bytes / best[1] / 1e6
    out.append(DecodeRecord(**{**asdict(rec), "method": "sdpa", "ms": best[1], "gbps": gbps,
                               "pct_of_copy": 100 * gbps / ceiling, "note": best[0][5:]}))


def print_decode_table(records: list[DecodeRecord], ceiling: float):
    print(f"\ndecode, Sq = 1: K/V read once = 2*B*L*H_kv*D*2 bytes; device-copy ceiling {ceiling:.0f} GB/s "
          f"(bytes read + written); cuflash num_splits=0, check_inputs=False, over the whole cache (cf) and with "
          f"cache_seqlens as an int32 array (+lens); sdpa: its fastest backend")
    head = (f"{'dtype':<5} {'H_q/H_kv':>8} {'D':>3} {'B':>3} {'L':>7} {'K/V MB':>8} | {'cf us':>8} {'GB/s':>6} {'%copy':>5} | "
            f"{'+lens us':>8} | {'sdpa us':>8} {'GB/s':>6} {'%copy':>5} {'backend':<9} | {'cf/sdpa':>7} "
            f"{'+lens/sdpa':>10}")
    print(head)
    print("-" * len(head))
    index = {(r.method, r.dtype, r.head_dim, r.batch, r.cache_len, r.heads_q, r.heads_kv): r for r in records}
    keys = sorted({(r.dtype, r.heads_q, r.heads_kv, r.head_dim, r.batch, r.cache_len) for r in records})

    def speedup(a, b):
        return a.gbps / b.gbps if a is not None and a.gbps and b is not None and b.gbps else None

    for dtype, hq, hkv, d, b, n in keys:
        ours, lens, sd = (index.get((m, dtype, d, b, n, hq, hkv)) for m in ("cuflash", "cuflash-lens", "sdpa"))
        first = ours or lens or sd
        if ours is not None and ours.note.startswith("skipped"):
            print(f"{dtype:<5} {f'{hq}/{hkv}':>8} {d:>3} {b:>3} {n:>7} {first.kv_bytes / 1e6:>8.0f} | {ours.note}")
            continue
        cols = [(r.ms * 1e3 if r.ms else None, r.gbps, r.pct_of_copy) if r is not None else (None, None, None)
                for r in (ours, sd)]
        lens_us = lens.ms * 1e3 if lens is not None and lens.ms else None
        backend = sd.note if sd is not None and sd.ms else ("-" if sd is None else "skipped")
        print(f"{dtype:<5} {f'{hq}/{hkv}':>8} {d:>3} {b:>3} {n:>7} {first.kv_bytes / 1e6:>8.0f} | "
              f"{_fmt(cols[0][0], '8.1f')} {_fmt(cols[0][1], '6.0f')} {_fmt(cols[0][2], '5.0f')} | "
              f"{_fmt(lens_us, '8.1f')} | "
              f"{_fmt(cols[1][0], '8.1f')} {_fmt(cols[1][1], '6.0f')} {_fmt(cols[1][2], '5.0f')} {backend:<9} | "
              f"{_fmt(speedup(ours, sd), '7.2f')} {_fmt(speedup(lens, sd), '10.2f')}")
    for r in records:
        if r.method == "sdpa" and r.note.startswith("skipped"):
            print(f"sdpa skipped for D={r.head_dim} B={r.batch} L={r.cache_len} H={r.heads_q}/{r.heads_kv}: "
                  f"{r.note[9:]}")


def run_decode(args, torch) -> tuple[list, float]:
    import cupy as cp

    from . import _families

    ceiling = copy_ceiling_gbps(args)
    print(f"device-copy ceiling: {ceiling:.0f} GB/s (a {COPY_BYTES >> 30} GiB copy, bytes read + written)")
    dev = cp.cuda.Device().id
    peak = _families.dram_gbps(dev)
    print(f"split-KV launches aim at {_families.decode_ctas_per_sm(dev)} CTA(s) per SM: peak DRAM "
          f"{'not reported' if peak is None else f'{peak:.0f} GB/s'} over {_families._sm_count(dev)} SMs")
    records: list[DecodeRecord] = []
    for dtype, d in itertools.product(args.dtype, args.head_dim):
        for b, n, hq, hkv, skip in decode_shapes(args.decode_batch, args.decode_cache, args.decode_heads, d,
                                                 args.decode_max_gb):
            rec = DecodeRecord("cuflash", dtype, b, n, hq, hkv, d, decode_kv_bytes(b, n, hkv, d))
            if skip:
                records.append(DecodeRecord(**{**asdict(rec), "note": skip}))
                continue
            before = len(records)
            try:
                bench_decode(rec, args, records, torch, ceiling)
            except Exception as e:  # noqa: BLE001 - reported as a skipped row, never silent
                why = "out of memory" if is_oom(e) else f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
                if not any(r.method == "cuflash" for r in records[before:]):
                    records.append(DecodeRecord(**{**asdict(rec), "note": f"skipped: {why}"}))
                print(f"    note: D={d} B={b} L={n} H={hq}/{hkv}: {why}")
            finally:
                free_memory(torch)
            done = {r.method: r for r in records[before:] if r.gbps}
            print(f"{dtype} D={d} B={b} L={n} H={hq}/{hkv}: " + ", ".join(
                f"{m} {r.ms * 1e3:.1f} us {r.gbps:.0f} GB/s ({r.pct_of_copy:.0f}% of copy)" for m, r in done.items()),
                flush=True)
    print_decode_table(records, ceiling)
    return records, ceiling


# --- variable-length batches: attention_varlen against the padded dense call ---------------------------------

def varlen_lengths(max_len: int, tokens: int = TOKENS, seed: int = 0) -> list[int]:
    """Sequence lengths uniform in [1, max_len] until they hold `tokens` tokens (the last one trimmed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < tokens:
        n = min(int(rng.integers(1, max_len + 1)), tokens - total)
        lengths.append(n)
        total += n
    return lengths


def varlen_useful_flops(lengths, heads: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of the sequences' own attention: 4 * H * D * sum_b L_b^2, halved when causal."""
    return 4.0 * heads * head_dim * sum(n * n for n in lengths) * (0.5 if causal else 1.0)


def bench_varlen(shape: Shape, args, out: list):
    import cupy as cp

    import cuflash

    from . import _xpref

    lengths = varlen_lengths(shape.seqlen, seed=shape.seqlen)
    b, n, h, d = len(lengths), shape.seqlen, shape.heads, shape.head_dim
    cu = cp.asarray([0] + list(itertools.accumulate(lengths)), dtype=cp.int32)
    rng = cp.random.RandomState(shape.seqlen)
    draw = lambda *dims: _xpref.to_lowp(rng.standard_normal(dims, dtype=cp.float32), shape.dtype)  # noqa: E731
    n_sets = n_input_sets(3 * TOKENS * h * d * 2)
    packed = [tuple(draw(TOKENS, h, d) for _ in range(4)) for _ in range(n_sets)]
    padded = [tuple(draw(b, n, h, d) for _ in range(4)) for _ in range(n_sets)]
    flops = varlen_useful_flops(lengths, h, d, shape.causal)
    note = f"{b} sequences, {TOKENS} tokens ({b * n} padded)"
    causal, events = shape.causal, CupyEvents()

    def varlen_fwd(i):
        q, k, v = packed[i][:3]
        return cuflash.attention_varlen_forward(q, k, v, cu, cu, n, n, causal=causal, check_inputs=False)

    def padded_fwd(i):
        q, k, v = padded[i][:3]
        return cuflash.attention_forward(q, k, v, causal=causal)

    cuflash.attention_varlen_forward(*packed[0][:3], cu, cu, n, n, causal=causal)  # once with the value checks
    for method, fwd, sets in (("cuflash-varlen", varlen_fwd, packed), ("cuflash-padded", padded_fwd, padded)):
        ms = median_ms(fwd, n_sets, events, args.reps, args.warmup)
        out.append(Record(method, "fwd", shape.dtype, d, causal, n, b, h, ms=ms, tflops=flops / ms / 1e9, note=note))
        if not args.backward:
            continue
        saved = [fwd(i) for i in range(n_sets)]
        if method == "cuflash-varlen":
            def bwd(i):
                q, k, v, dout = packed[i]
                return cuflash.attention_varlen_backward(dout, q, k, v, *saved[i], cu, cu, n, n, causal=causal,
                                                         deterministic=args.deterministic, check_inputs=False)
        else:
            def bwd(i):
                q, k, v, dout = padded[i]
                return cuflash.attention_backward(dout, q, k, v, *saved[i], causal=causal,
                                                  deterministic=args.deterministic)
        ms = median_ms(bwd, n_sets, events, args.reps, args.warmup)
        out.append(Record(method, "bwd", shape.dtype, d, causal, n, b, h, ms=ms,
                          tflops=PASS_FLOP_FACTOR["bwd"] * flops / ms / 1e9, note=note))
        saved.clear()


def print_varlen_table(records: list[Record]):
    print(f"\nvarlen: {TOKENS} tokens in random-length sequences (uniform in [1, N]) vs the same sequences padded to N; "
          f"useful-token TFLOP/s (4*H*D*sum L_b^2, halved when causal; bwd 2.5x)")
    passes = [p for p in ("fwd", "bwd") if any(r.passname == p for r in records)]
    head = f"{'dtype':<5} {'D':>3} {'causal':<6} {'N':>6} {'seqs':>5} | " + " | ".join(
        f"{p + ' varlen':>10} {'padded':>7} {'ratio':>6}" for p in passes)
    print(head)
    print("-" * len(head))
    index = {(r.method, r.passname, r.dtype, r.head_dim, r.causal, r.seqlen): r for r in records}
    for key in sorted({(r.dtype, r.head_dim, r.causal, r.seqlen) for r in records}):
        cells = []
        for p in passes:
            var, pad = index.get(("cuflash-varlen", p) + key), index.get(("cuflash-padded", p) + key)
            tv, tp = (r.tflops if r is not None else None for r in (var, pad))
            cells.append(f"{_fmt(tv, '10.1f')} {_fmt(tp, '7.1f')} {_fmt(tv / tp if tv and tp else None, '6.2f')}")
        seqs = next(r.batch for r in records if (r.dtype, r.head_dim, r.causal, r.seqlen) == key)
        print(f"{key[0]:<5} {key[1]:>3} {'yes' if key[2] else 'no':<6} {key[3]:>6} {seqs:>5} | " + " | ".join(cells))
    for r in records:
        if r.note.startswith("skipped"):
            print(f"skipped: {r.method} {r.passname} {r.dtype} D={r.head_dim} causal={r.causal} N={r.seqlen}: "
                  f"{r.note[9:]}")


def run_varlen(args) -> list:
    records: list[Record] = []
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for dtype in args.dtype:
        for d in args.head_dim:
            for causal in causals:
                for n in args.seqlen:
                    shape = Shape(dtype, d, causal, n)
                    t = run_method("cuflash-varlen", lambda s=shape: bench_varlen(s, args, records), shape, records,
                                   args.backward)
                    tf = {(r.method, r.passname): r.tflops for r in records if r.tflops and
                          (r.dtype, r.head_dim, r.causal, r.seqlen) == (dtype, d, causal, n)}
                    seqs = len(varlen_lengths(n, seed=n))
                    print(f"{dtype} D={d} {'causal' if causal else 'full'} N<={n} ({seqs} sequences, "
                          f"H={shape.heads}): " + ", ".join(f"{m[8:]} {p} {x:.0f}" for (m, p), x in tf.items())
                          + f" useful TFLOP/s ({t:.1f} s)", flush=True)
    print_varlen_table(records)
    return records


# --- additive bias: cuflash with bias= and dbias against SDPA's memory-efficient backend and plain attention ------

BIAS_METHODS = ("cuflash", "sdpa-mem", "plain")
BIAS_PASSES = ("fwd", "fwd+bwd")
BIAS_FAMILIES = ("evoformer", "llm")
# (B0, N, L, H, D): q (B0, N, L, H, D) folded to (B0*N, L, H, D), the pair bias (B0, H, L, L) shared by N rows.
# MSA row attention (N MSA rows, H 8) and triangle attention (the N = L rows of an L x L pair representation, H 4).
EVOFORMER_SHAPES = ((1, 1024, 256, 8, 32), (1, 256, 256, 4, 32), (1, 512, 512, 8, 32), (1, 512, 512, 4, 32),
                    (1, 128, 768, 8, 32), (1, 768, 768, 4, 32), (1, 512, 256, 8, 64), (1, 512, 512, 4, 64))
LLM_BIAS_SEQLENS = (1024, 2048, 4096)
LLM_BIAS_HEAD_DIMS = (64, 128)
LLM_BIAS_HEADS = 16
BIAS_MAX_GB = 16.0


@dataclass
class BiasRecord:
    method: str  # "cuflash" | "sdpa-mem" | "plain"
    passname: str  # "fwd" | "fwd+bwd" (with dbias)
    family: str  # "evoformer" | "llm"
    dtype: str
    batch: int  # B: the attention's batch (evoformer: the B0*N folded rows)
    bias_batch: int  # Bb: the bias's batch (evoformer: B0, each shared by B // Bb rows; llm: B)
    seqlen: int  # S = Sq = Sk (evoformer: L)
    heads: int
    head_dim: int
    bias_bytes: int  # the bias, (Bb, H, S, S) in the input dtype
    ms: float | None = None
    tflops: float | None = None
    peak_mem_bytes: int | None = None  # allocated during one call (outputs included)
    extra_mem_bytes: int | None = None  # peak_mem_bytes less the dbias the call returns
    compute_dtype: str | None = None  # plain bf16 computed in fp16
    note: str = ""
    msa_keep: float | None = None  # evoformer rows with an MSA key padding mask (BiasShape.msa_keep)


@dataclass
class BiasShape:
    family: str
    dtype: str
    batch: int
    bias_batch: int
    seqlen: int
    heads: int
    head_dim: int
    skip: str = ""  # "skipped: why" for a shape over the memory cap
    msa_keep: float | None = None  # evoformer with an MSA key padding mask: each row keeps >= this fraction of keys

    @property
    def rows(self) -> int:
        """N: the rows (sequences of the batch) that share one bias batch entry."""
        return self.batch // self.bias_batch

    def bias_dims(self) -> tuple:
        return (self.bias_batch, self.heads, self.seqlen, self.seqlen)

    def bias_bytes(self, itemsize: int | None = None) -> int:
        """Bytes of a (Bb, H, S, S) array of `itemsize`-byte elements (default: the input dtype's, the bias's)."""
        return math.prod(self.bias_dims()) * (ITEMSIZE[self.dtype] if itemsize is None else itemsize)

    def flops(self, passname: str) -> float:
        """4 * B * H * S^2 * D (the bias add not counted), times the pass's factor (fwd+bwd: 3.5)."""
        return 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim * PASS_FLOP_FACTOR[passname]

    def record(self, method, passname, **kw) -> BiasRecord:
        return BiasRecord(method, passname, self.family, self.dtype, self.batch, self.bias_batch, self.seqlen,
                          self.heads, self.head_dim, self.bias_bytes(), msa_keep=self.msa_keep, **kw)

    def __str__(self):
        bias = f"bias ({self.bias_batch}, {self.heads}, {self.seqlen}, {self.seqlen})"
        if self.family == "evoformer":
            msa = "" if self.msa_keep is None else f", MSA mask keeping {100 * self.msa_keep:g}-100 % of each row's keys"
            return (f"evoformer {self.dtype} B0*N={self.bias_batch}*{self.rows} L={self.seqlen} H={self.heads} "
                    f"D={self.head_dim}, {bias}{msa}")
        return f"{self.family} {self.dtype} B={self.batch} N={self.seqlen} H={self.heads} D={self.head_dim}, {bias}"


def parse_evoformer(text: str) -> tuple:
    """"N:L:H:D" or "B0:N:L:H:D" -> (B0, N, L, H, D) (B0 = 1 when left out)."""
    try:
        dims = tuple(int(x) for x in text.split(":"))
    except ValueError:
        dims = ()
    if len(dims) not in (4, 5):
        raise argparse.ArgumentTypeError(f"evoformer shape {text!r}: expected [B0:]N:L:H:D, e.g. 512:256:8:32")
    b0, n, l, h, d = dims if len(dims) == 5 else (1, *dims)
    if min(b0, n, l, h, d) < 1:
        raise argparse.ArgumentTypeError(f"evoformer shape {text!r}: every size must be >= 1")
    if d < 8 or d > 256 or d % 8:
        raise argparse.ArgumentTypeError(f"evoformer shape {text!r}: D must be a multiple of 8 from 8 to 256")
    return b0, n, l, h, d


def bias_shapes(families, dtypes, seqlens=None, head_dims=None, evoformer=None, max_gb: float = BIAS_MAX_GB,
                msa_keep: float | None = None):
    """The --bias shapes, per dtype: the evoformer list (`evoformer` as given, else EVOFORMER_SHAPES with L in
    `seqlens` and D in `head_dims` when those are given; with an MSA mask keeping msa_keep or more of each row's
    keys when given), then the llm shapes (N in seqlens, D in head_dims, defaults LLM_BIAS_SEQLENS and
    LLM_BIAS_HEAD_DIMS), those whose bias + float32 dbias exceed max_gb marked."""
    out = []
    for dtype in dtypes:
        if "evoformer" in families:
            for b0, n, l, h, d in evoformer if evoformer is not None else EVOFORMER_SHAPES:
                if evoformer is None and ((seqlens and l not in seqlens) or (head_dims and d not in head_dims)):
                    continue
                out.append(BiasShape("evoformer", dtype, b0 * n, b0, l, h, d, msa_keep=msa_keep))
        if "llm" in families:
            for d in head_dims or LLM_BIAS_HEAD_DIMS:
                for n in seqlens or LLM_BIAS_SEQLENS:
                    shape = BiasShape("llm", dtype, TOKENS // n, TOKENS // n, n, LLM_BIAS_HEADS, d)
                    gb = shape.bias_bytes(ITEMSIZE[dtype] + 4) / 1e9  # the bias and its float32 dbias
                    if gb > max_gb:
                        shape.skip = f"skipped: bias + float32 dbias {gb:.1f} GB > --bias-max-gb {max_gb:g}"
                    out.append(shape)
    return out


def bias_inputs(shape: BiasShape, dtype: str, layout: str, n_sets: int, seed: int):
    """n_sets tuples (q, k, v, dout, bias): cupy_inputs' four arrays and a standard-normal (Bb, H, S, S) bias."""
    import cupy as cp

    from . import _xpref

    rng = cp.random.RandomState(seed + 1)
    return [s + (_xpref.to_lowp(rng.standard_normal(shape.bias_dims(), dtype=cp.float32), dtype),)
            for s in cupy_inputs(shape, dtype, layout, n_sets, True, seed)]


def msa_mask(shape: BiasShape, seed: int):
    """The MSA mask of an evoformer shape with msa_keep (None without): bool (B, S), row r True on its first
    ceil(u_r S) keys, u_r uniform in [msa_keep, 1]; every row keeps at least one key."""
    if shape.msa_keep is None:
        return None
    import cupy as cp
    import numpy as np

    u = np.random.default_rng(seed).uniform(shape.msa_keep, 1.0, shape.batch)
    kept = np.clip(np.ceil(u * shape.seqlen), 1, shape.seqlen).astype(np.int64)
    return cp.asarray(np.arange(shape.seqlen)[None, :] < kept[:, None])


def msa_term(kpm, dtype, bias_batch: int):
    """The MSA mask (B, S) as an additive term of plain attention's folded scores (Bb, N, H, S, S): (Bb, N, 1, 1,
    S) of `dtype`, 0 on kept keys and -inf on the others."""
    import cupy as cp

    return cp.where(kpm, 0.0, -math.inf).astype(dtype).reshape(bias_batch, kpm.shape[0] // bias_batch, 1, 1, -1)


def bias_n_sets(shape: BiasShape) -> int:
    return n_input_sets(4 * shape.batch * shape.seqlen * shape.heads * shape.head_dim * ITEMSIZE[shape.dtype]
                        + shape.bias_bytes())


def bench_cuflash_bias(shape: BiasShape, args, out: list, torch=None):
    import cuflash

    n_sets = bias_n_sets(shape)
    sets = bias_inputs(shape, shape.dtype, "bshd", n_sets, seed=shape.seqlen + shape.batch)
    events, deterministic = CupyEvents(), args.deterministic
    kw = cuflash_kwargs(shape.dtype)  # precision="fp32" for float32 inputs
    kpm = msa_mask(shape, seed=shape.seqlen + shape.batch)
    if kpm is not None:
        kw["key_padding_mask"] = kpm

    def fwd(i):
        q, k, v, _, bias = sets[i]
        return cuflash.attention(q, k, v, bias=bias, **kw)

    def fwd_bwd(i):
        q, k, v, dout, bias = sets[i]
        o, lse = cuflash.attention_forward(q, k, v, bias=bias, **kw)
        return cuflash.attention_backward(dout, q, k, v, o, lse, bias=bias, dbias=True, deterministic=deterministic,
                                          **kw)

    for p, call, dbias_bytes in (("fwd", fwd, 0), ("fwd+bwd", fwd_bwd, shape.bias_bytes(4))):  # dbias: float32
        ms = median_ms(call, n_sets, events, args.reps, args.warmup)
        free_memory()  # the timed calls' cached blocks: not in the way of the measured call
        mem = cupy_peak_bytes(lambda c=call: c(0))
        out.append(shape.record("cuflash", p, ms=ms, tflops=shape.flops(p) / ms / 1e9, peak_mem_bytes=mem,
                                extra_mem_bytes=mem - dbias_bytes,
                                note="deterministic" if deterministic and p != "fwd" else ""))


def expand_bias(bias, batch: int):
    """The torch bias (Bb, H, S, S) as the (B, H, S, S) attn_mask of a batch of `batch`: batch b uses bias
    b // (B // Bb). A stride-0 view for Bb = 1 (and Bb = B: the bias itself); a copy for 1 < Bb < B (no strides
    give b // N)."""
    bb = bias.shape[0]
    if bb in (1, batch):
        return bias.expand(batch, -1, -1, -1)
    return bias[:, None].expand(bb, batch // bb, *bias.shape[1:]).reshape(batch, *bias.shape[1:])


def bench_sdpa_bias(shape: BiasShape, args, out: list, torch):
    import cupy as cp
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n_sets = bias_n_sets(shape)
    sets = bias_inputs(shape, shape.dtype, "bshd", n_sets, seed=shape.seqlen + shape.batch)
    cp.cuda.Device().synchronize()
    # torch views of the same memory (DLPack, no copy) as autograd leaves: q, k, v and the bias (its gradient is
    # computed in fwd+bwd); SDPA wants (B, H, S, D): transposed views
    leaves = [[to_torch(x, torch).detach().requires_grad_() for x in (q, k, v, bias)] for q, k, v, _, bias in sets]
    douts = [to_torch(s[3], torch).transpose(1, 2) for s in sets]
    note = "bias copied to (B, H, S, S) (1 < B0 < B: no broadcast view)" if 1 < shape.bias_batch < shape.batch else ""
    events, batch = TorchEvents(), shape.batch
    kpm = msa_mask(shape, seed=shape.seqlen + shape.batch)
    msa = None
    if kpm is not None:  # the MSA mask as an additive (B, 1, 1, S) term: 0 on kept keys, -inf on the others
        bias_t = leaves[0][3]
        masked = torch.from_dlpack(kpm.astype(cp.uint8)) == 0
        msa = torch.zeros(masked.shape, dtype=bias_t.dtype, device=bias_t.device).masked_fill(masked, float("-inf"))
        msa = msa[:, None, None, :]
        note = ((note + "; ") if note else "") + "attn_mask = bias + the MSA mask's -inf, (B, H, S, S), made per call"

    def sdpa(i):
        q, k, v, bias = leaves[i]
        mask = expand_bias(bias, batch) if msa is None else expand_bias(bias, batch) + msa
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask)

    def fwd(i):
        with torch.no_grad():
            return sdpa(i)

    def fwd_bwd(i):
        return torch.autograd.grad(sdpa(i), leaves[i], douts[i])  # dq, dk, dv, dbias (in the bias's dtype)

    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # entered once, outside the timed calls
        for p, call, dbias_bytes in (("fwd", fwd, 0), ("fwd+bwd", fwd_bwd, shape.bias_bytes())):  # the bias's dtype
            ms = median_ms(call, n_sets, events, args.reps, args.warmup)
            mem = torch_peak_bytes(lambda c=call: c(0))
            out.append(shape.record("sdpa-mem", p, ms=ms, tflops=shape.flops(p) / ms / 1e9, peak_mem_bytes=mem,
                                    extra_mem_bytes=mem - dbias_bytes, note=note))


def plain_bias_grad(ds):
    """dbias from dS (Bb, N, H, S, S): summed over the N rows that share each bias entry (N = 1: dS itself)."""
    return ds[:, 0] if ds.shape[1] == 1 else ds.sum(axis=1)


def bench_plain_bias(shape: BiasShape, args, out: list, torch=None):
    compute = plain_compute_dtype(shape.dtype)
    note = f"computed in {compute}: CuPy cannot run it in {shape.dtype}" if compute != shape.dtype else ""
    q, k, v, dout, bias = bias_inputs(shape, compute, "bhsd", 1, seed=shape.seqlen + shape.batch + 1)[0]
    # (B, H, S, D) as (Bb, N, H, S, D) views, the bias as (Bb, 1, H, S, S): S = (Bb, N, H, S, S) gets its bias added
    # by broadcasting, and dS summed over N is dbias (in the compute dtype, as autograd would give it)
    q, k, v, dout = (x.reshape(shape.bias_batch, shape.rows, *x.shape[1:]) for x in (q, k, v, dout))
    bias = bias[:, None]
    scale = 1.0 / math.sqrt(shape.head_dim)
    events = CupyEvents()
    kw = dict(compute_dtype=compute if compute != shape.dtype else None, note=note)
    kpm = msa_mask(shape, seed=shape.seqlen + shape.batch)
    msa = None if kpm is None else msa_term(kpm, bias.dtype, shape.bias_batch)  # added to the bias in each call

    def scores_bias():
        return bias if msa is None else bias + msa

    def fwd(_):
        return plain_forward(q, k, v, False, scale, scores_bias())

    def fwd_bwd(_):
        o, p = plain_forward(q, k, v, False, scale, scores_bias())
        dq, dk, dv, ds = plain_backward(dout, q, k, v, o, p, scale, return_ds=True)
        return dq, dk, dv, plain_bias_grad(ds)

    for p, call, dbias_bytes in (("fwd", fwd, 0), ("fwd+bwd", fwd_bwd, shape.bias_bytes(ITEMSIZE[compute]))):
        ms = median_ms(call, 1, events, args.reps, args.warmup)
        free_memory()  # the timed calls' cached blocks: not in the way of the measured call
        mem = cupy_peak_bytes(lambda c=call: c(0))
        out.append(shape.record("plain", p, ms=ms, tflops=shape.flops(p) / ms / 1e9, peak_mem_bytes=mem,
                                extra_mem_bytes=mem - dbias_bytes, **kw))


BIAS_BENCH = {"cuflash": bench_cuflash_bias, "sdpa-mem": bench_sdpa_bias, "plain": bench_plain_bias}


def bias_key(r: BiasRecord) -> tuple:
    return (r.family, r.dtype, r.head_dim, r.seqlen, r.heads, r.batch, r.bias_batch)


def bias_speedup(ours, sdpa):
    """cuflash's speedup over sdpa-mem: sdpa-mem's time / cuflash's (None unless both ran)."""
    return sdpa.ms / ours.ms if ours is not None and ours.ms and sdpa is not None and sdpa.ms else None


def print_bias_table(records: list[BiasRecord], methods: list[str]):
    short = {"cuflash": "cf", "sdpa-mem": "sdpa", "plain": "plain"}
    passes = [p for p in BIAS_PASSES if any(r.passname == p and r.ms for r in records)]
    index = {(r.method, r.passname) + bias_key(r): r for r in records}
    keys = sorted({bias_key(r) for r in records})
    for p in passes:
        print(f"\nbias {p}: ms, TFLOP/s ({PASS_FLOP_FACTOR[p]:g} x 4*B*H*S^2*D), cuflash speedup over sdpa-mem "
              f"(cf/sdpa), peak extra MiB beyond the inputs, bias and dbias; B = batch (evoformer: B0*N rows), "
              f"Bb = bias batch; BHS^2 MiB: one (B, H, S, S) score matrix in the input dtype")
        head = (f"{'shape':<9} {'dtype':<5} {'B':>5} {'Bb':>5} {'S':>5} {'H':>3} {'D':>3} {'bias MiB':>8} "
                f"{'BHS^2 MiB':>9} | " + " ".join(f"{'ms ' + short[m]:>10}" for m in methods) + " | "
                + " ".join(f"{'TF ' + short[m]:>8}" for m in methods) + " | cf/sdpa | "
                + " ".join(f"{'MiB ' + short[m]:>10}" for m in methods))
        print(head)
        print("-" * len(head))
        for key in keys:
            rows = [index.get((m, p) + key) for m in methods]
            if not any(r is not None and r.ms for r in rows):
                continue
            family, dtype, d, s, h, b, bb = key
            ms = [r.ms if r is not None else None for r in rows]
            tf = [r.tflops if r is not None else None for r in rows]
            mem = [r.extra_mem_bytes / 2**20 if r is not None and r.extra_mem_bytes is not None else None
                   for r in rows]
            ratio = bias_speedup(index.get(("cuflash", p) + key), index.get(("sdpa-mem", p) + key))
            plain = index.get(("plain", p) + key)
            mark = "*" if plain is not None and plain.compute_dtype else " "
            size = ITEMSIZE[dtype]
            print(f"{family:<9} {dtype:<5} {b:>5} {bb:>5} {s:>5} {h:>3} {d:>3} {bb * h * s * s * size / 2**20:>8.1f} "
                  f"{b * h * s * s * size / 2**20:>9.0f} | " + " ".join(_fmt(x, "10.3f") for x in ms) + " | "
                  + " ".join(_fmt(x, "8.1f") for x in tf) + f" | {_fmt(ratio, '7.2f')} | "
                  + " ".join(_fmt(x, "10.1f") for x in mem) + mark)
    keeps = {r.msa_keep for r in records if r.msa_keep is not None}
    if keeps:
        print(f"evoformer rows with an MSA mask: a key_padding_mask in which each row keeps its first "
              f"{100 * min(keeps):g}-100 % of the keys (SDPA and plain: added to the bias as -inf)")
    if any(r.compute_dtype for r in records):
        print("* plain attention for this dtype was computed in "
              f"{next(r.compute_dtype for r in records if r.compute_dtype)} (CuPy could not run it in the input dtype)")
    notes = {}
    for r in records:
        if r.note and not r.note.startswith("skipped") and not r.compute_dtype:
            notes.setdefault((r.method, r.note), []).append(r)
    for (method, note), rs in notes.items():
        print(f"note: {method}: {note} ({len({bias_key(r) for r in rs})} shapes)")
    skipped = {}
    for r in records:
        if r.note.startswith("skipped"):
            skipped.setdefault((bias_key(r), r.note[9:]), []).append(f"{r.method} {r.passname}")
    for (key, why), what in skipped.items():
        family, dtype, d, s, h, b, bb = key
        print(f"skipped: {family} {dtype} B={b} Bb={bb} S={s} H={h} D={d} ({', '.join(what)}): {why}")


def bias_methods(args, torch) -> list[str]:
    """cuflash, sdpa-mem (torch with CUDA), plain (unless --no-compare), narrowed by --methods."""
    methods = ["cuflash"] + (["sdpa-mem"] if torch is not None else []) + (["plain"] if args.compare else [])
    if args.methods is not None:
        missing = [m for m in args.methods if m not in methods]
        if missing:
            print(f"note: {', '.join(missing)} not available here (torch missing or --no-compare): skipped")
        methods = [m for m in methods if m in args.methods]
    return methods


def run_bias(args, torch, cuflash) -> list:
    import inspect

    methods = bias_methods(args, torch)
    if args.window is not None:
        print("note: --window is not used by --bias (no sliding window: every (query, key) pair counts)")
    if "bias" not in inspect.signature(cuflash.attention_forward).parameters:
        print("note: this cuflash's attention_forward has no bias= keyword: its rows are skipped")
    shapes = bias_shapes(args.bias_shapes, args.dtype, args.seqlen, args.head_dim, args.evoformer_shapes,
                         args.bias_max_gb, args.msa_mask)
    for family in args.bias_shapes:
        if not any(s.family == family for s in shapes):
            print(f"note: no {family} shape left (--seqlen / --head-dim keep only the default shapes with that "
                  f"L / D; --evoformer-shapes names others)")
    records: list[BiasRecord] = []
    for shape in shapes:
        if shape.skip:
            print(f"{shape}: {shape.skip}", flush=True)
            records.extend(shape.record(m, p, note=shape.skip) for m in methods for p in BIAS_PASSES)
            continue
        before, t = len(records), 0.0
        for m in methods:
            t += run_method(m, lambda s=shape, f=BIAS_BENCH[m]: f(s, args, records, torch), shape, records, True,
                            torch, passes=BIAS_PASSES)
        done = {(r.method, r.passname): r for r in records[before:] if r.ms}
        for p in BIAS_PASSES:
            ratio = bias_speedup(done.get(("cuflash", p)), done.get(("sdpa-mem", p)))
            print(f"{shape} {p}: " + ", ".join(f"{m} {done[m, p].ms:.3f} ms {done[m, p].tflops:.0f} TFLOP/s"
                                               for m in methods if (m, p) in done)
                  + (f", cuflash {ratio:.2f}x sdpa-mem" if ratio else "") + (f" ({t:.1f} s)" if p == "fwd" else ""),
                  flush=True)
    print_bias_table(records, methods)
    return records


# --- command line -------------------------------------------------------------------------------------

# --- --fp8: the FP8 forward against the bf16 one -------------------------------------------------------------

@dataclass
class Fp8Record:
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    method: str  # "bf16" (cuflash's bf16 forward) | "fp8" (cuflash's FP8 forward, 128-row block descales)
    ms: float
    tflops: float


def run_fp8(args, cuflash) -> list:
    """Each FA shape (batch = 16384 // N, heads = 2048 // D), causal as --causal: cuflash.attention on bf16 inputs,
    then on the same values quantized to e4m3 with 128-row block scaling (cuflash.fp8.quantize), in the same run;
    fresh input sets rotate as in the default mode; --window applies to both calls. TFLOP/s count 4 * B * H * D *
    (visible pairs)."""
    import cupy as cp

    from . import fp8

    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    window = tuple(args.window) if args.window is not None else None
    mods = {"window": window} if window else {}
    if window:
        print(f"note: window={window}: both the bf16 and the FP8 call take it; TFLOP/s count the band's pairs only")
    events, records = CupyEvents(), []
    for d, causal, n in itertools.product(args.head_dim, causals, args.seqlen):
        b, h = max(1, TOKENS // n), 2048 // d
        n_sets = n_input_sets(3 * b * n * h * d * 2)
        rng = cp.random.RandomState(n + d)
        bf = [tuple(random_array(rng, (b, n, h, d), "bf16") for _ in range(3)) for _ in range(n_sets)]
        f8 = [tuple(y for x in s for y in fp8.quantize(x, scaling="block")) for s in bf]  # (q8, qd, k8, kd, v8, vd)
        flops = 4.0 * b * h * d * visible_pairs(n, n, causal, window)
        calls = {"bf16": lambda i: cuflash.attention(*bf[i], causal=causal, **mods),
                 "fp8": lambda i: cuflash.attention(f8[i][0], f8[i][2], f8[i][4], causal=causal, q_descale=f8[i][1],
                                                    k_descale=f8[i][3], v_descale=f8[i][5], **mods)}
        line = []
        for method, call in calls.items():
            ms = median_ms(call, n_sets, events, args.reps, args.warmup)
            records.append(Fp8Record(d, n, causal, b, h, method, ms, flops / ms / 1e9))
            line.append(f"{method} {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s")
        print(f"D {d} N {n} causal {causal}: " + ", ".join(line), flush=True)
        bf.clear()
        f8.clear()
        cp.get_default_memory_pool().free_all_blocks()
    print_fp8_table(records)
    return records


def print_fp8_table(records: list) -> None:
    print("\n| D | N | causal | bf16 ms | bf16 TFLOP/s | FP8 ms | FP8 TFLOP/s | FP8 / bf16 |")
    print("|---:|---:|:---:|---:|---:|---:|---:|---:|")
    by = {(r.head_dim, r.seqlen, r.causal, r.method): r for r in records}
    for d, n, c in dict.fromkeys((r.head_dim, r.seqlen, r.causal) for r in records):
        a, f = by.get((d, n, c, "bf16")), by.get((d, n, c, "fp8"))
        if a is None or f is None:
            continue
        print(f"| {d} | {n} | {'yes' if c else 'no'} | {a.ms:.3f} | {a.tflops:.0f} | {f.ms:.3f} | {f.tflops:.0f} | "
              f"{a.ms / f.ms:.2f}x |")


def _seqlen(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seqlen {text!r} is not an integer") from None
    if n < 1 or n > TOKENS:
        raise argparse.ArgumentTypeError(f"seqlen {n} must be between 1 and {TOKENS} (batch = {TOKENS} // N)")
    return n


def _head_dim(text: str) -> int:
    try:
        d = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"head dim {text!r} is not an integer") from None
    if d < 8 or d > 256 or d % 8:
        raise argparse.ArgumentTypeError(f"head dim {d}: a multiple of 8 from 8 to 256 (heads = {HIDDEN} // D)")
    return d


def _keep_fraction(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"{x:g} must be a fraction in (0, 1]")
    return x


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be >= 1")
    return n


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not s > 0:
        raise argparse.ArgumentTypeError(f"{s:g} must be > 0")
    return s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuflash.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=None,
                   help="default: bf16 and fp16 (--decode, --varlen, --bias: bf16); fp32 (float32, cuflash precision "
                        "'fp32': 3xTF32; the default mode and --bias), tf32 (float32, precision 'tf32'), fp64 "
                        "(float64): the default mode only")
    p.add_argument("--head-dim", nargs="+", type=_head_dim, default=None,
                   help=f"default: 64 and 128 (--decode: {DECODE_HEAD_DIM}; --bias: "
                        f"the llm shapes' D, default {' '.join(map(str, LLM_BIAS_HEAD_DIMS))}, and the default "
                        f"evoformer shapes kept)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="(--bias: not causal)")
    p.add_argument("--seqlen", nargs="+", type=_seqlen, default=None,
                   help=f"default: {' '.join(map(str, DEFAULT_SEQLENS))} (--varlen: the longest sequence, default "
                        f"{' '.join(map(str, VARLEN_SEQLENS))}; --bias: the llm shapes' N, default "
                        f"{' '.join(map(str, LLM_BIAS_SEQLENS))}, and the L of the default evoformer shapes kept)")
    p.add_argument("--backward", action="store_true", help="also time bwd and fwd+bwd (--bias: fwd+bwd always)")
    p.add_argument("--deterministic", action="store_true", help="cuflash backward with deterministic=True")
    p.add_argument("--window", nargs=2, type=int, metavar=("LEFT", "RIGHT"), default=None,
                   help="sliding window of the cuflash runs, and of both calls of --fp8 (-1 = unbounded); TFLOP/s "
                        "count the band's pairs only; the other methods have no window and are skipped")
    p.add_argument("--methods", nargs="+", choices=METHODS + BIAS_METHODS[1:2], default=None, metavar="METHOD",
                   help=f"methods to run (default: all that are available): {', '.join(METHODS)} (--bias: "
                        f"{', '.join(BIAS_METHODS)})")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="run plain CuPy attention and torch SDPA next to cuflash (default; --no-compare: cuflash only)")
    p.add_argument("--reps", type=_positive, default=20, help="timed calls per measurement (median); default 20")
    p.add_argument("--warmup", type=_positive, default=3, help="untimed calls first; default 3")
    p.add_argument("--sustain", type=_seconds, default=None, metavar="S",
                   help=f"warm each measurement up for at least S seconds of back-to-back calls (default "
                        f"{WARMUP_MIN_S:g}) and time calls for at least S seconds, so every method is timed at the "
                        f"GPU's sustained, power-capped clock")
    p.add_argument("--ceilings", action=argparse.BooleanOptionalAction, default=True,
                   help="with fp32 / tf32 / fp64: measure the cuBLAS GEMM ceilings of those dtypes first (SGEMM, "
                        "TF32 GEMM, DGEMM; default; --no-ceilings: not)")
    p.add_argument("--ceiling-size", type=_positive, default=CEILING_SIZE, metavar="N",
                   help=f"the ceilings' M = N = K (default {CEILING_SIZE})")
    p.add_argument("--time-limit", type=_seconds, default=None, metavar="S",
                   help="start no new shape after S seconds (default mode; the rest are reported skipped)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--ring", action="store_true",
                      help="ring attention over this node's GPUs against one GPU (options: python -m "
                           "cuflash.distributed.bench --help)")
    mode.add_argument("--decode", action="store_true",
                      help="KV-cache decoding: attention_with_kvcache GB/s against the device-copy ceiling and SDPA")
    mode.add_argument("--varlen", action="store_true",
                      help="variable-length batches: attention_varlen against the padded dense call")
    mode.add_argument("--fp8", action="store_true",
                      help="FP8 (e4m3, 128-row block scaling) forward against cuflash's bf16 forward, FA shapes, "
                           "--head-dim (default 128 256), --seqlen, --causal")
    mode.add_argument("--bias", action="store_true",
                      help="additive bias: cuflash with bias= (fwd, fwd+bwd with dbias) against SDPA's "
                           "memory-efficient backend with attn_mask and plain CuPy attention")
    p.add_argument("--decode-batch", nargs="+", type=_positive, default=list(DECODE_BATCHES), metavar="B",
                   help=f"--decode batch sizes (default {' '.join(map(str, DECODE_BATCHES))})")
    p.add_argument("--decode-cache", nargs="+", type=_positive, default=list(DECODE_CACHE_LENS), metavar="L",
                   help=f"--decode cache lengths (default {' '.join(map(str, DECODE_CACHE_LENS))})")
    p.add_argument("--decode-heads", nargs="+", type=parse_heads, default=[parse_heads(h) for h in DECODE_HEADS],
                   metavar="HQ:HKV", help=f"--decode query:key/value heads (default {' '.join(DECODE_HEADS)})")
    p.add_argument("--decode-max-gb", type=float, default=DECODE_MAX_GB,
                   help=f"--decode skips shapes whose K/V exceed this many GB (default {DECODE_MAX_GB:g})")
    p.add_argument("--bias-shapes", nargs="+", choices=BIAS_FAMILIES, default=list(BIAS_FAMILIES),
                   metavar="FAMILY", help="--bias shape families: evoformer (pair bias broadcast over the rows), "
                                          "llm (full (B, H, N, N) bias); default both")
    p.add_argument("--evoformer-shapes", nargs="+", type=parse_evoformer, default=None, metavar="[B0:]N:L:H:D",
                   help="--bias evoformer shapes instead of the default ones: q (B0, N, L, H, D) folded to "
                        "(B0*N, L, H, D), bias (B0, H, L, L); B0 defaults to 1")
    p.add_argument("--msa-mask", type=_keep_fraction, default=None, metavar="KEEP",
                   help="--bias: the evoformer rows with an MSA mask too, a key_padding_mask (B0*N, L) in which each "
                        "row keeps its first keys, a uniform fraction from KEEP to 1 of them (e.g. 0.7)")
    p.add_argument("--bias-max-gb", type=float, default=BIAS_MAX_GB,
                   help=f"--bias skips llm shapes whose bias + float32 dbias exceed this many GB "
                        f"(default {BIAS_MAX_GB:g})")
    p.add_argument("--plot", metavar="FILE.png", help="TFLOP/s against N, one panel per dtype/head dim/causal")
    p.add_argument("--json", metavar="FILE", help="write every record (and the device) as JSON")
    return p


VARLEN_SEQLENS = (1024, 4096, 16384)


def resolve_defaults(args):
    """Defaults that depend on the mode: --decode, --varlen and --bias measure bf16 (decode at D=128, varlen up to
    16k). --bias leaves --seqlen and --head-dim None when not given: bias_shapes uses its own defaults then."""
    special = args.decode or args.varlen or args.bias or args.fp8
    if args.dtype is None:
        args.dtype = ["bf16"] if special else ["bf16", "fp16"]
    if args.bias:
        return args
    if args.fp8:
        args.head_dim = args.head_dim or [128, 256]
        args.seqlen = args.seqlen or [n for n in DEFAULT_SEQLENS if n >= 1024]
        return args
    if args.head_dim is None:
        args.head_dim = [DECODE_HEAD_DIM] if args.decode else [64, 128]
    if args.seqlen is None:
        args.seqlen = list(VARLEN_SEQLENS if args.varlen else DEFAULT_SEQLENS)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--ring" in argv:  # its own options and processes: cuflash.distributed.bench
        from .distributed import bench as ring_bench

        return ring_bench.launch([a for a in argv if a != "--ring"])
    parser = build_parser()
    args = resolve_defaults(parser.parse_args(argv))
    allowed = BIAS_METHODS if args.bias else METHODS
    if args.methods is not None and any(m not in allowed for m in args.methods):
        parser.error(f"--methods {' '.join(m for m in args.methods if m not in allowed)}: "
                     f"{'--bias' if args.bias else 'this mode'} runs {', '.join(allowed)}")
    wide = [d for d in args.dtype if d in WIDE_DTYPES]
    if wide and (args.decode or args.varlen or args.fp8):
        parser.error(f"--dtype {' '.join(wide)}: the default mode and --bias only (--decode, --varlen and --fp8 "
                     f"take bf16 / fp16)")
    if args.msa_mask is not None and not (args.bias and "evoformer" in args.bias_shapes):
        parser.error(f"--msa-mask {args.msa_mask:g}: the MSA mask is of the --bias evoformer rows (add --bias, and "
                     f"evoformer to --bias-shapes)")
    if args.bias and set(wide) - {"fp32"}:
        parser.error(f"--bias --dtype {' '.join(d for d in wide if d != 'fp32')}: --bias takes bf16, fp16 and fp32")
    if args.window is not None and (args.decode or args.varlen):
        parser.error(f"--window {' '.join(map(str, args.window))}: the default mode and --fp8 take a sliding window "
                     f"(--decode and --varlen do not)")
    if args.fp8 and any(d not in (64, 128, 256) for d in args.head_dim):
        parser.error(f"--fp8 --head-dim {' '.join(map(str, args.head_dim))}: the FP8 forward has head dims 64, 128, 256")
    try:
        import cupy as cp

        available = cp.is_available()
    except ImportError:
        available = False
    if not available:
        print("cuflash.bench: no CUDA GPU found (cupy.is_available() is False); the benchmark needs one.\n"
              "Without a GPU the IO analyzer counts the traffic instead: cuflash-sim --help", file=sys.stderr)
        return 1

    import cuflash

    global sustain_s
    sustain_s = args.sustain or 0.0
    if args.sustain is not None:
        print(f"note: --sustain {args.sustain:g}: each measurement runs {args.sustain:g} s of untimed calls, then "
              f"times calls for at least {args.sustain:g} s (median)")
    torch = None
    if args.compare:
        try:
            import torch as _torch

            if _torch.cuda.is_available():
                torch = _torch
            else:
                print("note: torch is importable but sees no CUDA device: SDPA columns skipped")
        except ImportError:
            print("note: torch is not importable: SDPA columns skipped")
    if args.backward and not hasattr(cuflash, "attention_backward"):
        print("note: this cuflash has no attention_backward: backward columns skipped")

    if args.decode or args.varlen or args.bias or args.fp8:
        return main_decode_varlen(args, cuflash, torch)
    return main_sweep(args, cuflash, torch)


def main_sweep(args, cuflash, torch) -> int:
    """The default mode: the sweep of run_sweep, after the wide dtypes' float32 checks and GEMM ceilings; the tables,
    then the JSON and the plot when asked."""
    import cupy as cp

    methods = sweep_methods(args, torch)
    device_name, dev = device_line(cp, torch, cuflash)
    backward = args.backward and hasattr(cuflash, "attention_backward")
    wide = [d for d in args.dtype if d in WIDE_DTYPES]
    t_start = time.perf_counter()
    ceilings, checks = [], {}
    if wide:
        note = cupy_float32_without_tf32()
        if note:
            print(f"note: {note}")
        if any(d in ("fp32", "tf32") for d in wide) and ("plain" in methods or SDPA_MATH[0] in methods):
            try:
                checks = float32_matmul_checks(torch if SDPA_MATH[0] in methods else None)
            except Exception as e:  # noqa: BLE001 - the check is informative, the run goes on
                print(f"note: float32 matmul check failed: {type(e).__name__}: {e}")
            print_matmul_checks(checks)
        if args.ceilings:
            ceilings = [measure_ceiling(name, args.ceiling_size, args) for name in ceilings_for(wide)]
            print_ceilings(ceilings)
    records = run_sweep(args, methods, torch, backward, t_start)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    print_table([r for r in records if r.dtype in LOWP_DTYPES], methods_for("bf16", methods, args))
    if wide:
        print_ceilings(ceilings)
        print_wide_table([r for r in records if r.dtype in WIDE_DTYPES], methods, ceilings)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "compute_capability": dev.compute_capability,
                       "cupy": cp.__version__, "torch": torch.__version__ if torch is not None else None,
                       "cuflash": cuflash.__version__, "reps": args.reps, "warmup": args.warmup,
                       "sustain_s": sustain_s,
                       **({"ceilings": [asdict(c) for c in ceilings], "float32_matmul_checks": checks}
                          if wide else {}),
                       **({"time_limit_s": args.time_limit} if args.time_limit is not None else {}),
                       "records": [asdict(r) for r in records]}, f, indent=1)
        print(f"records written to {args.json}")
    if args.plot:
        plot(records, args.plot)
    return 0


def device_line(cp, torch, cuflash) -> tuple[str, object]:
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {name} (sm_{dev.compute_capability}), cupy {cp.__version__}"
          + (f", torch {torch.__version__}" if torch is not None else "") + f", cuflash {cuflash.__version__}")
    return name, dev


def main_decode_varlen(args, cuflash, torch) -> int:
    import cupy as cp

    device_name, dev = device_line(cp, torch, cuflash)
    t_start = time.perf_counter()
    extra = {}
    if args.decode:
        if torch is not None and "enable_gqa" not in torch.nn.functional.scaled_dot_product_attention.__doc__ and \
                any(hq != hkv for hq, hkv in args.decode_heads):
            print(f"note: torch {torch.__version__} has no enable_gqa (needs >= 2.5): SDPA runs multi-head shapes only")
        records, ceiling = run_decode(args, torch)
        extra = {"mode": "decode", "copy_ceiling_gbps": ceiling}
    elif args.bias:
        records = run_bias(args, torch, cuflash)
        extra = {"mode": "bias", "deterministic": args.deterministic}
    elif args.fp8:
        records = run_fp8(args, cuflash)
        extra = {"mode": "fp8"}
    else:
        records = run_varlen(args)
        extra = {"mode": "varlen", "tokens": TOKENS}
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "compute_capability": dev.compute_capability, "cupy": cp.__version__,
                       "torch": torch.__version__ if torch is not None else None, "cuflash": cuflash.__version__,
                       "reps": args.reps, "warmup": args.warmup, "sustain_s": sustain_s, **extra,
                       "records": [asdict(r) for r in records]}, f, indent=1)
        print(f"records written to {args.json}")
    if args.plot:
        print("note: --plot draws the TFLOP/s sweep of the default mode; not drawn for --decode / --varlen / --bias / "
              "--fp8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
