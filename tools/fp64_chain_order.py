"""Why a recomputing float64 backward must sum S in the forward's order: `python tools/fp64_chain_order.py`.

A NumPy emulation on the CPU (no GPU) of the float64 kernels' arithmetic on the inputs of tests/test_gpu_wide.py's
test_float64_scores_rising_across_key_tiles (one head, D 128, 130 x 300, scores rising to ~1500): the forward sums
S = q . k as one chain of fused multiply-adds over the head dim (DMMA rounds each one to nearest), keeps m and l in
log2 units and returns the natural-log lse; the backward recomputes P = exp2(S scale_log2 - lse_log2). It prints
dq's largest error against an extended-precision (np.longdouble) reference, beside plain float64 attention's (P
stored, not recomputed), for:

* the backward's S summed as one chain in the forward's order, with lse_log2 from the rounded natural lse (what
  cuda/wide.cuh does since 2026-12-07: a key group's warps split S^T by queries, each score one chain over the head
  dim), with lse_log2 = m + log2(l) unrounded by the conversions, and with m and log2(l) kept apart: the lse's
  roundings do not matter;
* S summed as two chains of 64 columns added at the end (the head-dim-128 backward before, its two warps per key
  group splitting the head dim): S differs from the forward's by ~1e-11 and dq is an order of magnitude further from
  the reference than plain float64's.
"""
from __future__ import annotations

import numpy as np

LD = np.longdouble


def chain(a, b, cols):
    """a @ b.T as one chain of fused multiply-adds over `cols`, each rounded to float64."""
    acc = np.zeros((a.shape[0], b.shape[0]))
    for c in cols:
        acc = (LD(acc) + LD(a[:, c:c + 1]) * LD(b[:, c][None, :])).astype(np.float64)
    return acc


def fma(a, b, c):
    return (LD(a) * LD(b) + LD(c)).astype(np.float64)


def main() -> int:
    rng = np.random.default_rng(0)
    d, sq, sk, spread = 128, 130, 300, 1500.0
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    ramp = spread * np.arange(sk - 1, -1, -1) / (sk - 1)
    q = 0.5 * rng.standard_normal((sq, d)) + np.sqrt(d) * u
    k = 0.5 * rng.standard_normal((sk, d)) + ramp[:, None] * u
    v, do = rng.standard_normal((sk, d)), rng.standard_normal((sq, d))
    scale = 1 / np.sqrt(d)

    def grad_q(dt):  # plain attention's dq in dtype dt (P stored)
        qq, kk, vv, dd = (x.astype(dt) for x in (q, k, v, do))
        s = (qq @ kk.T) * dt(scale)
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        dp = dd @ vv.T
        delta = (dd * (p @ vv)).sum(1, keepdims=True)
        return (p * (dp - delta)) @ kk * dt(scale)

    ref = grad_q(LD)
    print(f"plain float64 attention                      dq error {float(np.abs(grad_q(np.float64) - ref).max()):.2e}")
    log2e, ln2 = np.float64(np.log2(np.e)), np.float64(np.log(2))
    scale_log2 = np.float64(scale) * log2e
    s_fwd = chain(q, k, range(d))  # the forward's S
    m = (s_fwd * scale_log2).max(1, keepdims=True)
    p_fwd = np.exp2(fma(s_fwd, scale_log2, -m))
    l = p_fwd.sum(1, keepdims=True)
    delta = (do * ((p_fwd @ v) / l)).sum(1, keepdims=True)
    dp = do @ v.T
    lse_log2 = ((m + np.log2(l)) * ln2) * log2e  # the natural lse, converted back as the preprocess does

    def dq_err(p):
        return float(np.abs((p * (dp - delta)) @ k * scale - ref).max())

    s_split = chain(q, k, range(d // 2)) + chain(q, k, range(d // 2, d))
    rows = [
        ("S as one chain, lse_log2 from the natural lse", np.exp2(fma(s_fwd, scale_log2, -lse_log2))),
        ("S as one chain, lse_log2 = m + log2(l)", np.exp2(fma(s_fwd, scale_log2, -(m + np.log2(l))))),
        ("S as one chain, m and log2(l) apart", np.exp2(fma(s_fwd, scale_log2, -m) - np.log2(l))),
        ("S as two chains of 64 added", np.exp2(fma(s_split, scale_log2, -lse_log2))),
    ]
    for name, p in rows:
        print(f"{name:44s} dq error {dq_err(p):.2e}")
    print(f"largest |S two chains - S one chain|: {float(np.abs(s_split - s_fwd).max()):.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
