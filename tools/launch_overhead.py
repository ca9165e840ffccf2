"""Host cost of one cuflash call on a GPU: `python tools/launch_overhead.py`.

Columns: the wall time per call of many back-to-back calls with one synchronization at the end (bound by
the host or by the GPU, whichever is slower); the CUDA-event span of one call alone on an idle GPU (it includes
the host's launch work between the two events, so it bounds the GPU time from above); and the Python time of
one call: 200 calls issued on an idle GPU, few enough that no call waits for the launch queue, per call. The
last one is what a call adds on the host. Printed for attention (forward),
attention_backward, and attention_with_kvcache (decode, check_inputs=False); results go to
docs/PERFORMANCE.md. `--profile` adds a cProfile table (top functions by own time) per call.

`--fake` runs anywhere, no GPU: CuPy's allocation, stream lookup and the driver launch are replaced by
counting fakes (tools/fake_cupy.py), so the time per call is cuflash's own Python work, plus what each call
asked of CuPy (allocations, launches, device switches). Use it to compare host-path changes on a CPU box.
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import cuflash  # noqa: E402

FAKE = "--fake" in sys.argv[1:]
if not FAKE:
    import cupy as cp  # noqa: E402


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def python_us(fn, n=200, reps=5):
    """Host time of one call alone: n calls issued back to back on an idle GPU (few enough that the launch
    queue never fills, so no call waits for the GPU), best of reps, per call."""
    best = float("inf")
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    cp.cuda.Device().synchronize()
    return best / n * 1e6


def gpu_us(fn, n=200):
    ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(n)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
        b.synchronize()
    return float(np.median([cp.cuda.get_elapsed_time(a, b) for a, b in ev])) * 1e3


def fake_main() -> int:
    """Host time per call with CuPy faked (see the module docstring): best of 5 runs of n calls."""
    import fake_cupy as fc

    fc.install(setattr)
    f16 = np.float16
    q, k, v, do, o = (fc.FakeArray((1, 128, 2, 64), f16) for _ in range(5))
    lse = fc.FakeArray((1, 2, 128), np.float32)
    q1 = fc.FakeArray((1, 1, 2, 128), f16)
    kc, vc = (fc.FakeArray((1, 32768, 2, 128), f16) for _ in range(2))
    lens = fc.FakeArray((1,), np.int32)
    calls = {
        "attention (B=1, N=128, H=2, D=64)": lambda: cuflash.attention(q, k, v),
        "attention_backward (same)": lambda: cuflash.attention_backward(do, q, k, v, o, lse),
        "attention_with_kvcache (1 query, 32k cache, D128)":
            lambda: cuflash.attention_with_kvcache(q1, kc, vc, cache_seqlens=lens, check_inputs=False),
    }
    n = 20000
    print(f"{'call (CuPy faked)':<52} {'host us/call':>13}  asked of CuPy per call")
    for name, fn in calls.items():
        for _ in range(100):
            fn()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        fc.COUNTS.clear()
        fn()
        asked = ", ".join(f"{k} {v}" for k, v in sorted(fc.COUNTS.items()))
        print(f"{name:<52} {best:>13.2f}  {asked}", flush=True)
    if "--profile" in sys.argv[1:]:
        for name, fn in calls.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                fn()
            prof.disable()
            print(f"\n{name}: {n} calls under cProfile (its own overhead inflates the times)")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)
    return 0


def main() -> int:
    if FAKE:
        return fake_main()
    rnd = cp.random.RandomState(0)
    q, k, v, do = (rnd.standard_normal((1, 128, 2, 64), dtype=cp.float32).astype(cp.float16) for _ in range(4))
    o, lse = cuflash.attention_forward(q, k, v)
    kc, vc = (rnd.standard_normal((1, 4096, 2, 64), dtype=cp.float32).astype(cp.float16) for _ in range(2))
    lens = cp.asarray([1000], dtype=cp.int32)
    q1 = q[:, :1]
    calls = {
        "attention (B=1, N=128, H=2, D=64)": lambda: cuflash.attention(q, k, v),
        "attention_backward (same)": lambda: cuflash.attention_backward(do, q, k, v, o, lse),
        "attention_with_kvcache (1 query, 1000 cached keys)":
            lambda: cuflash.attention_with_kvcache(q1, kc, vc, cache_seqlens=lens, check_inputs=False),
    }
    print(f"{'call':<52} {'host us/call':>13} {'event span us':>16} {'python us/call':>15}")
    for name, fn in calls.items():
        print(f"{name:<52} {per_call_us(fn):>13.1f} {gpu_us(fn):>16.1f} {python_us(fn):>15.1f}", flush=True)
    if "--profile" in sys.argv[1:]:
        for name, fn in calls.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(1000):
                fn()
            prof.disable()
            cp.cuda.Device().synchronize()
            print(f"\n{name}: 1000 calls under cProfile (its own overhead inflates the times)")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
