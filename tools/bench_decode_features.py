"""Time attention_with_kvcache with its further arguments against the plain decode step, on one GPU.

    python tools/bench_decode_features.py [--batch 8] [--cache 8192] [--reps 200]

bf16, D 128, 32 query heads over 8 K/V heads, one new token appended per call (k, v), cache_seqlens as an int32
array, check_inputs=False, the split heuristic: the plain step, then the same step with the rotary embedding
(float32 tables, interleaved and not), cache_leftpad, cache_batch_idx (a permutation), softcap, ALiBi, a causal
window of 1024 keys, and paged caches of 16, 48, 64 and 256 rows (each sequence's pages shuffled). Each call is
timed between its own two CUDA events, calls back to back, median (cuflash.bench.median_ms). Results go to
docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _xpref, bench  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cache", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    b, n = args.batch, args.cache
    rng = np.random.default_rng(0)

    def lowp(*shape):
        return _xpref.to_lowp(cp.asarray(rng.standard_normal(shape), dtype=cp.float32), "bf16")

    q, k_new, v_new = lowp(b, 1, HQ, D), lowp(b, 1, HKV, D), lowp(b, 1, HKV, D)
    k_cache, v_cache = lowp(b, n, HKV, D), lowp(b, n, HKV, D)
    lens = cp.full((b,), n - 1, dtype=cp.int32)
    angles = np.arange(n)[:, None] * 10000.0 ** (-np.arange(D // 2) / (D // 2))
    cos, sin = (cp.asarray(f(angles), dtype=cp.float32) for f in (np.cos, np.sin))
    cases = {
        "plain": {},
        "rotary (interleaved)": dict(rotary_cos=cos, rotary_sin=sin),
        "rotary (not interleaved)": dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False),
        "cache_leftpad": dict(cache_leftpad=cp.asarray(rng.integers(0, n // 2, b), dtype=cp.int32)),
        "cache_batch_idx": dict(cache_batch_idx=cp.asarray(rng.permutation(b), dtype=cp.int32)),
        "softcap": dict(softcap=30.0),
        "alibi": dict(alibi_slopes=cp.asarray(rng.random(HQ) * 0.1, dtype=cp.float32)),
        "window (1024, 0), causal": dict(window=(1024, 0), causal=True),
    }
    ev = bench.CupyEvents()
    kv_bytes = bench.decode_kv_bytes(b, n, HKV, D)
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16, D {D}, H_q {HQ}, H_kv {HKV}, "
          f"B {b}, cache {n}, one new token per call; K/V {kv_bytes / 1e6:.0f} MB")

    def report(name, call):
        call(0)
        ms = bench.median_ms(call, 1, ev, args.reps, 20)
        print(f"  {name:<28} {ms * 1e3:8.1f} us {kv_bytes / ms / 1e6:6.0f} GB/s", flush=True)

    for name, kw in cases.items():
        report(name, lambda i, kw=kw: cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                                                     cache_seqlens=lens, check_inputs=False, **kw))
    for page in (16, 48, 64, 256):
        pages = -(-n // page)
        table = cp.asarray(rng.permutation(b * pages).reshape(b, pages), dtype=cp.int32)
        kc = k_cache.reshape(-1, HKV, D)[:b * pages * page].reshape(b * pages, page, HKV, D) if n % page == 0 else \
            lowp(b * pages, page, HKV, D)
        vc = v_cache.reshape(-1, HKV, D)[:b * pages * page].reshape(b * pages, page, HKV, D) if n % page == 0 else \
            lowp(b * pages, page, HKV, D)
        report(f"paged, {page}-row pages", lambda i, kc=kc, vc=vc, table=table: cuflash.attention_with_kvcache(
            q, kc, vc, k=k_new, v=v_new, cache_seqlens=lens, block_table=table, check_inputs=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
