"""Small FP8 forward calls for compute-sanitizer (tools/gpu_session.sh, stage sanitize_fp8): every FP8 head dim, dense
with sequence tails, causal with rows that see no key, a window, GQA, bhsd, and packed (varlen) sequences with an empty
one, each checked for NaN so that a run which writes nothing fails too. Small shapes: the sanitizers run each launch
10-100x slower.

    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/fp8_sanitize_cases.py
"""
from __future__ import annotations

import sys

import numpy as np


def e4m3(cp, shape, seed):
    import ml_dtypes

    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return cp.asarray(x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def main() -> int:
    import cupy as cp

    import cuflash

    failures = 0
    for d in (64, 128, 256):
        cases = [dict(sq=130, sk=200, h=2, hkv=2, causal=False, window=None, layout="bshd"),
                 dict(sq=200, sk=130, h=4, hkv=2, causal=True, window=None, layout="bhsd"),
                 dict(sq=190, sk=190, h=2, hkv=1, causal=False, window=(50, 20), layout="bshd")]
        for i, c in enumerate(cases):
            lay = c["layout"]
            shp = (lambda s, n: (1, s, n, d)) if lay == "bshd" else (lambda s, n: (1, n, s, d))
            q, k, v = e4m3(cp, shp(c["sq"], c["h"]), i), e4m3(cp, shp(c["sk"], c["hkv"]), i + 1), \
                e4m3(cp, shp(c["sk"], c["hkv"]), i + 2)
            qd = cp.full((1, c["h"], -(-c["sq"] // 128)), 0.5, dtype=cp.float32)
            o, lse = cuflash.attention_forward(q, k, v, causal=c["causal"], window=c["window"], layout=lay,
                                               q_descale=qd, k_descale=0.25)
            bad = bool(cp.isnan(o.astype(cp.float32)).any()) or bool(cp.isnan(lse).any())
            failures += bad
            print(f"d={d} {c}: {'NaN' if bad else 'ok'}")
        lens = [130, 0, 70]
        cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]), dtype=cp.int32)
        q, k, v = (e4m3(cp, (sum(lens), 2, d), 10 + j) for j in range(3))
        o, lse = cuflash.attention_varlen_forward(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        bad = bool(cp.isnan(o.astype(cp.float32)).any())
        failures += bad
        print(f"d={d} varlen {lens}: {'NaN' if bad else 'ok'}")
    cp.cuda.runtime.deviceSynchronize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
