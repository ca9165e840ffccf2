"""The FP8 forward's accuracy in the style of FlashAttention-3's table (Shah et al. 2024, section 4.3): inputs with
outliers, RMSE of O against a float64 reference, for the bf16 forward and FP8 with per-tensor scaling, per-head
scaling, 128-row block scaling, and block scaling after incoherent processing (a randomized Hadamard transform of q
and k, which leaves q k^T unchanged and spreads the outliers before they are quantized).

    python tools/fp8_accuracy.py                       # D 128, N 4096, B 2, H 8
    python tools/fp8_accuracy.py --seqlen 2048 --heads 4 --json acc.json

Inputs (float32 q, k, v), two outlier models, both by default (--outliers):
  gaussian  N(0, 1) + N(0, 100) * Bernoulli(0.001): every entry standard normal, 0.1 % of them with an independent
            normal term of standard deviation 10 added (the paper's model);
  fixed     N(0, 1) with 0.1 % of the entries replaced by +-10. Every outlier is then the tensor's largest magnitude,
            which the scaling maps to 448, an exact e4m3 value: the outliers carry no rounding error, so neither block
            scaling nor incoherent processing (which spreads their mass over all entries) can help; the table shows it.
The reference is float64 attention of those float32 values (computed on the GPU, one (batch, head) at a time); each
method starts from the same float32 values (bf16: rounded to bfloat16; FP8: cuflash.fp8.quantize, with
cuflash.fp8.incoherent first for the two incoherent rows). Needs an sm_90 GPU for the FP8 rows.
"""
from __future__ import annotations

import argparse
import json
import math
import sys


OUTLIER_MODELS = ("gaussian", "fixed")
OUTLIER_TEXT = {"gaussian": "N(0, 1) + N(0, 100) * Bernoulli(0.001)", "fixed": "N(0, 1), 0.1 % of entries set to +-10"}


def outlier_inputs(cp, shape, seed: int, model: str = "gaussian", fraction: float = 1e-3, magnitude: float = 10.0):
    """q, k, v float32, standard normal with outliers in `fraction` of the entries: "gaussian" adds an independent
    N(0, magnitude^2) term to them, "fixed" replaces them by +-magnitude."""
    if model not in OUTLIER_MODELS:
        raise ValueError(f"model={model!r}; allowed: {OUTLIER_MODELS}")
    rng = cp.random.RandomState(seed)
    out = []
    for _ in range(3):
        x = rng.standard_normal(shape, dtype=cp.float32)
        hit = rng.random_sample(shape) < fraction
        if model == "gaussian":
            x = x + cp.where(hit, magnitude * rng.standard_normal(shape, dtype=cp.float32), 0)
        else:
            sign = cp.where(rng.random_sample(shape) < 0.5, -1.0, 1.0).astype(cp.float32)
            x = cp.where(hit, sign * magnitude, x)
        out.append(x.astype(cp.float32))
    return out


def reference64(cp, q, k, v, causal: bool):
    """float64 attention of (B, S, H, D) float32 arrays, one (batch, head) at a time."""
    b, s, h, d = q.shape
    o = cp.empty((b, s, h, d), dtype=cp.float64)
    scale = 1.0 / math.sqrt(d)
    mask = cp.tril(cp.ones((s, s), dtype=bool)) if causal else None
    for bi in range(b):
        for hi in range(h):
            qq, kk, vv = (x[bi, :, hi].astype(cp.float64) for x in (q, k, v))
            sc = (qq @ kk.T) * scale
            if mask is not None:
                sc = cp.where(mask, sc, -cp.inf)
            sc -= sc.max(axis=1, keepdims=True)
            p = cp.exp(sc)
            o[bi, :, hi] = (p @ vv) / p.sum(axis=1, keepdims=True)
    return o


def rmse(cp, got, ref) -> float:
    return float(cp.sqrt(cp.mean((got.astype(cp.float64) - ref) ** 2)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hadamard-seed", type=int, default=1234)
    ap.add_argument("--outliers", nargs="+", choices=OUTLIER_MODELS, default=list(OUTLIER_MODELS),
                    help="outlier models, one table each (default: both)")
    ap.add_argument("--json", metavar="FILE", help="also write the tables as JSON")
    args = ap.parse_args(argv)

    import cupy as cp
    import ml_dtypes

    import cuflash
    from cuflash import fp8

    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    tables = {}
    for model in args.outliers:
        q, k, v = outlier_inputs(cp, shape, args.seed, model)
        ref = reference64(cp, q, k, v, args.causal)
        rows = tables[model] = []

        def add(name: str, o):
            rows.append({"method": name, "rmse": rmse(cp, o, ref)})

        def fp8_attention(qq, kk, scaling: str):
            (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x, scaling=scaling) for x in (qq, kk, v))
            return cuflash.attention(q8, k8, v8, causal=args.causal, q_descale=qd, k_descale=kd, v_descale=vd)

        add("bf16 forward", cuflash.attention(*(x.astype(ml_dtypes.bfloat16) for x in (q, k, v)), causal=args.causal))
        for name, scaling in (("FP8 per-tensor", "tensor"), ("FP8 per-head", "head"), ("FP8 block (128 rows)", "block")):
            add(name, fp8_attention(q, k, scaling))
        qh, kh = fp8.incoherent(q, k, args.hadamard_seed)
        add("FP8 block + incoherent", fp8_attention(qh, kh, "block"))
        add("FP8 per-tensor + incoherent", fp8_attention(qh, kh, "tensor"))

        print(f"{dev}; B={args.batch} N={args.seqlen} H={args.heads} D={args.head_dim} causal={args.causal}; "
              f"outliers {model!r} ({OUTLIER_TEXT[model]}); RMSE of O against float64")
        base = next(r["rmse"] for r in rows if r["method"] == "FP8 per-tensor")
        print("| method | RMSE | vs FP8 per-tensor |\n|---|---:|---:|")
        for r in rows:
            print(f"| {r['method']} | {r['rmse']:.2e} | {base / r['rmse']:.2f}x |")
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "args": vars(args), "tables": tables}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
