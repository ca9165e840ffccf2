"""Host cost of one cuflash call on a GPU: `python tools/launch_overhead.py`.

Rows: attention, attention_backward (plain, with a window, soft-capping and ALiBi, and with a bias and its
gradient, new or preallocated), attention with a mask and a key_padding_mask and with a BlockMask,
attention_varlen and attention_varlen_backward (three packed sequences, check_inputs=False),
attention_with_kvcache, and attention on FP8 inputs with per-head descale arrays and with descales given as numbers
(on Hopper, and with --fake).
Columns: the wall time per call of many back-to-back calls with one synchronization at the end (bound by
the host or by the GPU, whichever is slower); the CUDA-event span of one call alone on an idle GPU (it includes
the host's launch work between the two events, so it bounds the GPU time from above); and the Python time of
one call: 200 calls issued on an idle GPU, few enough that no call waits for the launch queue, per call. The
last one is what a call adds on the host. Printed for attention (forward),
attention_backward, and attention_with_kvcache (decode, check_inputs=False); results go to
docs/PERFORMANCE.md. `--profile` adds a cProfile table (top functions by own time) per call.

Two reference rows measure the same host in the same run (hosts of the same GPU model differ by 2x, and one host drifts
from minute to minute, so only same-run comparisons mean anything): CuPy alone (cupy.empty of the output and one
cuLaunchKernel of an empty kernel: the floor of any CuPy call that allocates its result) and, when torch is
installed, torch's scaled_dot_product_attention (flash backend) on the same shape. The Python column is the
median over 15 rounds that interleave all rows. `--against DIR` loads the cuflash package of another checkout
(DIR/cuflash, with its DIR/cuda kernels) into the same process under another name and interleaves its calls with
this checkout's: a host-path change measured against an older commit, each round paired (the host's speed
drifts by tens of percent between processes, so separate runs cannot resolve a 1-2 us change).

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
from cuflash import _compile  # noqa: E402

FAKE = "--fake" in sys.argv[1:]
if not FAKE:
    import cupy as cp  # noqa: E402
AGAINST = sys.argv[sys.argv.index("--against") + 1] if "--against" in sys.argv[1:-1] else None


def load_other_cuflash(checkout: str):
    """checkout/cuflash as the module `cuflash_against` (its relative imports resolve inside it; its kernels
    come from checkout/cuda, which cuflash finds next to its package)."""
    import importlib.util

    pkg = Path(checkout).resolve() / "cuflash"
    spec = importlib.util.spec_from_file_location("cuflash_against", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["cuflash_against"] = module
    spec.loader.exec_module(module)
    return module


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
    mods = dict(window=(64, 0), softcap=30.0, alibi_slopes=fc.FakeArray((2,), np.float32))
    bias = fc.FakeArray((1, 2, 128, 128), f16)
    pq, pdo, po = (fc.FakeArray((300, 2, 64), f16) for _ in range(3))
    plse, cu = fc.FakeArray((2, 300), np.float32), fc.FakeArray((4,), np.int32)
    q8, d8 = fc.FakeArray((1, 128, 2, 128), np.uint8), fc.FakeArray((1, 2), np.float32)  # e4m3 bits, descales
    dbias = fc.FakeArray((1, 2, 128, 128), np.float32)
    mask, kpm = fc.FakeArray((1, 1, 128, 128), np.bool_), fc.FakeArray((1, 128), np.bool_)
    bm = fc.block_mask((1, 1, 128, 128), aligned=False)  # partial tiles: the mask kernels
    calls = {
        "attention (B=1, N=128, H=2, D=64)": lambda: cuflash.attention(q, k, v),
        "attention_backward (same)": lambda: cuflash.attention_backward(do, q, k, v, o, lse),
        "attention, window + softcap + ALiBi": lambda: cuflash.attention(q, k, v, **mods),
        "attention_backward, the same modifiers": lambda: cuflash.attention_backward(do, q, k, v, o, lse, **mods),
        "attention_backward, a (1, 2, 128, 128) bias, dbias":
            lambda: cuflash.attention_backward(do, q, k, v, o, lse, bias=bias, dbias=True),
        "attention_backward, the bias, a preallocated dbias":
            lambda: cuflash.attention_backward(do, q, k, v, o, lse, bias=bias, dbias=dbias),
        "attention, a key_padding_mask alone":
            lambda: cuflash.attention(q, k, v, key_padding_mask=kpm),
        "attention, a mask and a key_padding_mask": lambda: cuflash.attention(q, k, v, mask=mask, key_padding_mask=kpm),
        "attention, a BlockMask": lambda: cuflash.attention(q, k, v, mask=bm),
        "attention_varlen (3 sequences, 300 tokens, H=2, D=64)":
            lambda: cuflash.attention_varlen(pq, pq, pq, cu, cu, 128, 128, check_inputs=False),
        "attention_varlen_backward (same)":
            lambda: cuflash.attention_varlen_backward(pdo, pq, pq, pq, po, plse, cu, cu, 128, 128, check_inputs=False),
        "attention_with_kvcache (1 query, 32k cache, D128)":
            lambda: cuflash.attention_with_kvcache(q1, kc, vc, cache_seqlens=lens, check_inputs=False),
        "attention, FP8 (B=1, N=128, H=2, D=128)":
            lambda: cuflash.attention(q8, q8, q8, q_descale=d8, k_descale=d8, v_descale=d8),
        "attention, FP8, descales as numbers": lambda: cuflash.attention(q8, q8, q8, q_descale=0.5, k_descale=0.25),
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


FLOOR = "CuPy alone: cupy.empty + launch of an empty kernel"


def reference_calls(q, k, v) -> dict:
    """The floor of a CuPy call (allocate the output, launch one kernel with a params struct of cuflash's size)
    and, if torch is installed, torch's SDPA (flash backend) on the same shape: what the host costs others."""
    import ctypes

    from cupy.cuda import driver

    module = cp.RawModule(code='struct P { char bytes[328]; };\nextern "C" __global__ void empty(const P p) {}')
    fptr = module.get_function("empty").kernel.ptr
    block = (ctypes.c_char * 336)()
    params = (ctypes.c_void_p * 1)(ctypes.addressof(block))

    def floor():
        o = cp.empty(q.shape, dtype=q.dtype)
        driver.launchKernel(fptr, 1, 2, 1, 128, 1, 1, 0, cp.cuda.get_current_stream().ptr, ctypes.addressof(params), 0)
        return o

    calls = {FLOOR: floor}
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return calls
    tq, tk, tv = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.set_grad_enabled(False)
    sdpa_kernel(SDPBackend.FLASH_ATTENTION).__enter__()  # entered once: its cost is not SDPA's
    calls["torch SDPA, flash backend (same shape)"] = lambda: F.scaled_dot_product_attention(tq, tk, tv)
    return calls


def main() -> int:
    if FAKE:
        return fake_main()
    rnd = cp.random.RandomState(0)
    q, k, v, do = (rnd.standard_normal((1, 128, 2, 64), dtype=cp.float32).astype(cp.float16) for _ in range(4))
    o, lse = cuflash.attention_forward(q, k, v)
    kc, vc = (rnd.standard_normal((1, 4096, 2, 64), dtype=cp.float32).astype(cp.float16) for _ in range(2))
    lens = cp.asarray([1000], dtype=cp.int32)
    q1 = q[:, :1]
    slopes = cp.asarray([0.25, 0.125], dtype=cp.float32)
    mods = dict(window=(64, 0), softcap=30.0, alibi_slopes=slopes)
    bias = rnd.standard_normal((1, 2, 128, 128), dtype=cp.float32).astype(cp.float16)
    dbias = cp.empty((1, 2, 128, 128), dtype=cp.float32)
    mask, kpm = rnd.rand(1, 1, 128, 128) < 0.5, cp.ones((1, 128), dtype=cp.bool_)
    pq, pdo = (rnd.standard_normal((300, 2, 64), dtype=cp.float32).astype(cp.float16) for _ in range(2))
    cu = cp.asarray([0, 100, 172, 300], dtype=cp.int32)
    po, plse = cuflash.attention_varlen_forward(pq, pq, pq, cu, cu, 128, 128)
    fp8 = _compile.device_arch() == "sm_90a"  # the FP8 forward runs on Hopper
    if fp8:
        import ml_dtypes

        q8 = cp.asarray(np.random.default_rng(0).standard_normal((1, 128, 2, 128)).astype(ml_dtypes.float8_e4m3fn)
                        .view(np.uint8))
        d8 = cp.full((1, 2), 0.5, dtype=cp.float32)

    def calls_of(m, tag=""):
        bm = m.BlockMask(mask)
        rows = {
            f"attention (B=1, N=128, H=2, D=64){tag}": lambda: m.attention(q, k, v),
            f"attention_backward (same){tag}": lambda: m.attention_backward(do, q, k, v, o, lse),
            f"attention, window + softcap + ALiBi{tag}": lambda: m.attention(q, k, v, **mods),
            f"attention_backward, the same modifiers{tag}": lambda: m.attention_backward(do, q, k, v, o, lse, **mods),
            f"attention_backward, a (1, 2, 128, 128) bias, dbias{tag}":
                lambda: m.attention_backward(do, q, k, v, o, lse, bias=bias, dbias=True),
            f"attention_backward, the bias, a preallocated dbias{tag}":
                lambda: m.attention_backward(do, q, k, v, o, lse, bias=bias, dbias=dbias),
            f"attention, a key_padding_mask alone{tag}":
                lambda: m.attention(q, k, v, key_padding_mask=kpm),
            f"attention, a mask and a key_padding_mask{tag}":
                lambda: m.attention(q, k, v, mask=mask, key_padding_mask=kpm),
            f"attention, a BlockMask{tag}": lambda: m.attention(q, k, v, mask=bm),
            f"attention_varlen (3 sequences, 300 tokens, H=2, D=64){tag}":
                lambda: m.attention_varlen(pq, pq, pq, cu, cu, 128, 128, check_inputs=False),
            f"attention_varlen_backward (same){tag}":
                lambda: m.attention_varlen_backward(pdo, pq, pq, pq, po, plse, cu, cu, 128, 128, check_inputs=False),
            f"attention_with_kvcache (1 query, 1000 cached keys){tag}":
                lambda: m.attention_with_kvcache(q1, kc, vc, cache_seqlens=lens, check_inputs=False),
        }
        if fp8:
            rows[f"attention, FP8 (B=1, N=128, H=2, D=128){tag}"] = \
                lambda: m.attention(q8, q8, q8, q_descale=d8, k_descale=d8, v_descale=d8)
            rows[f"attention, FP8, descales as numbers{tag}"] = \
                lambda: m.attention(q8, q8, q8, q_descale=0.5, k_descale=0.25)
        return rows

    calls = calls_of(cuflash)
    other = calls_of(load_other_cuflash(AGAINST), " [--against]") if AGAINST else {}
    calls.update(other)
    calls.update(reference_calls(q, k, v))
    rounds: dict = {name: [] for name in calls}
    for _ in range(15):  # interleaved: a drift of the host's speed hits every row alike
        for name, fn in calls.items():
            rounds[name].append(python_us(fn, reps=3))
    print(f"cuflash from {Path(cuflash.__file__).parent}")
    print(f"{'call':<52} {'host us/call':>13} {'event span us':>16} {'python us/call':>15}")
    for name, fn in calls.items():
        print(f"{name:<52} {per_call_us(fn):>13.1f} {gpu_us(fn):>16.1f} {np.median(rounds[name]):>15.1f}", flush=True)
    floor = np.median(rounds[FLOOR])
    print(f"cuflash's own Python per attention call, over CuPy's floor: "
          f"{np.median(rounds['attention (B=1, N=128, H=2, D=64)']) - floor:.1f} us")
    for name in other:  # paired per round: this checkout minus the other one
        mine = name.replace(" [--against]", "")
        diff = np.subtract(rounds[mine], rounds[name])
        print(f"{mine}: this checkout - {AGAINST}: median {np.median(diff):+.1f} us per call over 15 paired rounds")
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
