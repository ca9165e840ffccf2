"""Benchmark: cuflash against plain CuPy attention and torch SDPA's backends, in one run, on one GPU.

    python -m cuflash.bench                                  # fwd, bf16 + fp16, D 64/128, causal and not, N 512..16k
    python -m cuflash.bench --backward --dtype bf16          # + bwd and fwd+bwd
    python -m cuflash.bench --seqlen 4096 --head-dim 128 --causal yes --json out.json --plot out.png

Shapes are the FlashAttention benchmark's: batch = 16384 // N, heads = 2048 // D (16k tokens, hidden 2048).
FLOPs: fwd = 4 * B * H * N^2 * D, halved when causal; bwd = 2.5 x fwd; fwd+bwd = 3.5 x fwd.

Timing: CUDA events around each call, median of --reps calls after --warmup calls. Calls rotate over
several independently drawn random input sets, so the inputs of one call are not in the L2 from the one
before (the plain attention's N^2 intermediates dwarf the L2 anyway: it uses one set).
Peak memory: device memory above the inputs during one call (for bwd and fwd+bwd: during a forward and a
backward, so the tensors the forward saves count), from CuPy's memory pool or torch.cuda.max_memory_allocated.

Methods:
  cuflash        this library
  plain          "standard attention" of the paper in CuPy: S = QK^T, softmax, O = PV with cuBLAS matmuls,
                 S and P materialized in HBM; in the input dtype (bf16 runs in fp16 when CuPy cannot
                 multiply bf16 matrices: the row says so)
  sdpa-flash, sdpa-cudnn, sdpa-efficient
                 torch.nn.functional.scaled_dot_product_attention with one backend forced (when torch is
                 importable); a backend that raises is skipped with a note
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

TOKENS = 16384
HIDDEN = 2048
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SDPA_BACKENDS = (("sdpa-flash", "FLASH_ATTENTION"), ("sdpa-cudnn", "CUDNN_ATTENTION"),
                 ("sdpa-efficient", "EFFICIENT_ATTENTION"))
METHODS = ("cuflash", "plain") + tuple(name for name, _ in SDPA_BACKENDS)
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


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
    batch: int = field(init=False)
    heads: int = field(init=False)

    def __post_init__(self):
        self.batch = TOKENS // self.seqlen
        self.heads = HIDDEN // self.head_dim

    def flops(self, passname: str) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        return f * (0.5 if self.causal else 1.0) * PASS_FLOP_FACTOR[passname]

    def record(self, method, passname, **kw) -> Record:
        return Record(method, passname, self.dtype, self.head_dim, self.causal, self.seqlen, self.batch,
                      self.heads, **kw)

    def __str__(self):
        return (f"{self.dtype} D={self.head_dim} {'causal' if self.causal else 'full'} N={self.seqlen} "
                f"(B={self.batch}, H={self.heads})")


# --- timing and memory ------------------------------------------------------------------------------

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


# Timed calls of one measurement stop after about this many seconds (at least MIN_REPS calls): the slow
# methods (plain attention at N = 16k takes ~0.3 s a call) would otherwise dominate a whole run.
MEASURE_BUDGET_S = 1.0
MIN_REPS = 5


def median_ms(call, n_sets: int, events, reps: int, warmup: int) -> float:
    """Median time of call(i) (i selects the input set, rotating), each call between its own two events;
    `reps` calls, or fewer (at least MIN_REPS) when they would take longer than MEASURE_BUDGET_S."""
    for i in range(warmup):
        call(i % n_sets)
    probe = (events.event(), events.event())
    events.record(probe[0])
    call(warmup % n_sets)
    events.record(probe[1])
    events.synchronize(probe[1])
    reps = max(MIN_REPS, min(reps, int(MEASURE_BUDGET_S * 1e3 / max(events.elapsed_ms(*probe), 1e-3))))
    pairs = [(events.event(), events.event()) for _ in range(reps)]
    for i, (start, stop) in enumerate(pairs):
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

def cupy_inputs(shape: Shape, dtype: str, layout: str, n_sets: int, with_dout: bool, seed: int):
    """n_sets tuples (q, k, v[, dout]) of fresh standard-normal values in `dtype`, (B, S, H, D) or (B, H, S, D)."""
    import cupy as cp

    from . import _xpref

    dims = (shape.batch, shape.seqlen, shape.heads, shape.head_dim) if layout == "bshd" else \
        (shape.batch, shape.heads, shape.seqlen, shape.head_dim)
    rng = cp.random.RandomState(seed)
    count = 4 if with_dout else 3
    return [tuple(_xpref.to_lowp(rng.standard_normal(dims, dtype=cp.float32), dtype) for _ in range(count))
            for _ in range(n_sets)]


def bench_cuflash(shape: Shape, args, out: list):
    import cupy as cp

    import cuflash

    set_bytes = 3 * shape.batch * shape.seqlen * shape.heads * shape.head_dim * 2
    n_sets = n_input_sets(set_bytes)
    backward = args.backward and hasattr(cuflash, "attention_backward")
    sets = cupy_inputs(shape, shape.dtype, "bshd", n_sets, backward, seed=shape.seqlen)
    events, causal = CupyEvents(), shape.causal

    def fwd(i):
        q, k, v = sets[i][:3]
        return cuflash.attention(q, k, v, causal=causal)

    ms = median_ms(fwd, n_sets, events, args.reps, args.warmup)
    mem = cupy_peak_bytes(lambda: fwd(0))
    out.append(shape.record("cuflash", "fwd", ms=ms, tflops=shape.flops("fwd") / ms / 1e9, peak_mem_bytes=mem))
    if not backward:
        return
    saved = [cuflash.attention_forward(*s[:3], causal=causal) for s in sets]  # (o, lse) per set

    def bwd(i):
        q, k, v, dout = sets[i]
        o, lse = saved[i]
        return cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=args.deterministic)

    def fwd_bwd(i):
        q, k, v, dout = sets[i]
        o, lse = cuflash.attention_forward(q, k, v, causal=causal)
        return cuflash.attention_backward(dout, q, k, v, o, lse, causal=causal, deterministic=args.deterministic)

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
    """dtype itself when CuPy runs plain attention in it (matmul, exp, sums), else "fp16"."""
    if dtype == "fp16":
        return "fp16"
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
    """Standard attention on (B, H, N, D) arrays: S = scale Q K^T, P = softmax(S), O = P V. Returns (O, P)."""
    import cupy as cp

    s = cp.matmul(q, k.transpose(0, 1, 3, 2))  # (B, H, N, N) in HBM
    s *= s.dtype.type(scale)
    if causal:
        s += bias
    s -= s.max(axis=-1, keepdims=True)
    cp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)  # P, kept for the backward
    return cp.matmul(s, v), s


def plain_backward(dout, q, k, v, o, p, scale: float):
    """Standard attention backward from the saved P: dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO*O)),
    dQ = scale dS K, dK = scale dS^T Q."""
    import cupy as cp

    dv = cp.matmul(p.transpose(0, 1, 3, 2), dout)
    dp = cp.matmul(dout, v.transpose(0, 1, 3, 2))
    dp -= (dout.astype(cp.float32) * o.astype(cp.float32)).sum(axis=-1, keepdims=True).astype(dp.dtype)
    dp *= p  # dS
    dq = cp.matmul(dp, k)
    dq *= dq.dtype.type(scale)
    dk = cp.matmul(dp.transpose(0, 1, 3, 2), q)
    dk *= dk.dtype.type(scale)
    return dq, dk, dv


def bench_plain(shape: Shape, args, out: list):
    compute = plain_compute_dtype(shape.dtype)
    note = f"computed in {compute}: CuPy cannot run it in {shape.dtype}" if compute != shape.dtype else ""
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


def bench_sdpa(shape: Shape, args, method: str, backend_name: str, out: list, torch):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    tdtype = torch.bfloat16 if shape.dtype == "bf16" else torch.float16
    dims = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    set_bytes = 3 * math.prod(dims) * 2
    n_sets = n_input_sets(set_bytes)
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
    out.append(shape.record(method, "fwd", ms=ms, tflops=shape.flops("fwd") / ms / 1e9, peak_mem_bytes=mem))
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
    out.append(shape.record(method, "bwd", ms=ms, tflops=shape.flops("bwd") / ms / 1e9, peak_mem_bytes=mem))
    out.append(shape.record(method, "fwd+bwd", ms=ms2, tflops=shape.flops("fwd+bwd") / ms2 / 1e9,
                            peak_mem_bytes=mem))


def run_method(name, fn, shape, records, backward: bool, torch=None):
    """Run one method's measurements; an error (out of memory, a backend that cannot run the shape)
    becomes a skipped row with a note for each pass not measured, instead of ending the benchmark."""
    t0 = time.perf_counter()
    before = len(records)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported, never silent
        why = "out of memory" if is_oom(e) else f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
        done = {r.passname for r in records[before:]}
        missing = [p for p in (("fwd", "bwd", "fwd+bwd") if backward else ("fwd",)) if p not in done]
        print(f"    note: {name} {'/'.join(missing)} skipped for {shape}: {why}")
        records.extend(shape.record(name, p, note=f"skipped: {why}") for p in missing)
    finally:
        free_memory(torch)
    return time.perf_counter() - t0


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
             "sdpa-efficient": "effic"}
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


# --- command line -------------------------------------------------------------------------------------

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


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be >= 1")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuflash.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--dtype", nargs="+", choices=("bf16", "fp16"), default=["bf16", "fp16"])
    p.add_argument("--head-dim", nargs="+", type=_head_dim, default=[64, 128])
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--seqlen", nargs="+", type=_seqlen, default=list(DEFAULT_SEQLENS))
    p.add_argument("--backward", action="store_true", help="also time bwd and fwd+bwd")
    p.add_argument("--deterministic", action="store_true", help="cuflash backward with deterministic=True")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None, metavar="METHOD",
                   help=f"methods to run (default: all that are available): {', '.join(METHODS)}")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="run plain CuPy attention and torch SDPA next to cuflash (default; --no-compare: cuflash only)")
    p.add_argument("--reps", type=_positive, default=20, help="timed calls per measurement (median); default 20")
    p.add_argument("--warmup", type=_positive, default=3, help="untimed calls first; default 3")
    p.add_argument("--plot", metavar="FILE.png", help="TFLOP/s against N, one panel per dtype/head dim/causal")
    p.add_argument("--json", metavar="FILE", help="write every record (and the device) as JSON")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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

    methods = ["cuflash"] + (["plain"] if args.compare else []) + \
        ([name for name, _ in SDPA_BACKENDS] if torch is not None else [])
    if args.methods is not None:
        missing = [m for m in args.methods if m not in methods]
        if missing:
            print(f"note: {', '.join(missing)} not available here (torch missing or --no-compare): skipped")
        methods = [m for m in methods if m in args.methods]
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    device_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {device_name} (sm_{dev.compute_capability}), cupy {cp.__version__}"
          + (f", torch {torch.__version__}" if torch is not None else "") + f", cuflash {cuflash.__version__}")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    backward = args.backward and hasattr(cuflash, "attention_backward")

    records: list[Record] = []
    t_start = time.perf_counter()
    for dtype in args.dtype:
        for d in args.head_dim:
            for causal in causals:
                for n in args.seqlen:
                    shape = Shape(dtype, d, causal, n)
                    times = {}
                    if "cuflash" in methods:
                        times["cuflash"] = run_method("cuflash", lambda s=shape: bench_cuflash(s, args, records),
                                                      shape, records, backward, torch)
                    if "plain" in methods:
                        times["plain"] = run_method("plain", lambda s=shape: bench_plain(s, args, records), shape,
                                                    records, args.backward, torch)
                    for name, backend in SDPA_BACKENDS:
                        if name in methods:
                            times[name] = run_method(
                                name, lambda s=shape, n=name, b=backend: bench_sdpa(s, args, n, b, records, torch),
                                shape, records, args.backward, torch)
                    for p in ("fwd", "bwd", "fwd+bwd") if backward else ("fwd",):
                        tf = {r.method: r.tflops for r in records if r.passname == p and r.tflops and
                              (r.dtype, r.head_dim, r.causal, r.seqlen) == (dtype, d, causal, n)}
                        print(f"{shape} {p}: " + ", ".join(f"{m} {tf[m]:.0f}" for m in methods if m in tf)
                              + " TFLOP/s" + (f" ({sum(times.values()):.1f} s)" if p == "fwd" else ""), flush=True)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    print_table(records, methods)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "compute_capability": dev.compute_capability,
                       "cupy": cp.__version__, "torch": torch.__version__ if torch is not None else None,
                       "cuflash": cuflash.__version__, "reps": args.reps, "warmup": args.warmup,
                       "records": [asdict(r) for r in records]}, f, indent=1)
        print(f"records written to {args.json}")
    if args.plot:
        plot(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
