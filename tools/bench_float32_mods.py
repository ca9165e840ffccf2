"""float32 attention with a key padding mask, a boolean mask or ALiBi, side by side in one process: cuflash with its
default kernels (on sm_90a the TF32 wgmma kernels), cuflash with CUFLASH_KERNELS=mma (the mma.sync kernels of
cuda/wide.cuh, which ran these calls on Hopper before the TF32 kernels took ALiBi and masks) and PyTorch SDPA's
memory-efficient backend in float32 with the same modifiers as a float attn_mask (0 or -inf, minus the ALiBi
distances, plus the bias).

    python tools/bench_float32_mods.py [--precision fp32|tf32] [--cases NAME ...] [--reps 10] [--warmup 2]

Forward and forward + backward (dq, dk, dv, and dbias where the case has a bias), median of --reps calls between
CUDA events after --warmup (cuflash.bench.median_ms, input sets rotated past the L2), TFLOP/s at 4 B H N^2 D (x 3.5
for forward + backward; the masked scores counted as if computed). The two cuflash columns' outputs are compared
(max |difference| over o, or the gradients) as a check that both ran the same problem.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _families, _plan, bench, config  # noqa: E402

# name -> (batch, seqlen, heads, head_dim, modifiers): kpm a key padding mask (each batch row keeps a prefix of
# 70-100 % of its keys), mask a (N, N) boolean mask keeping 90 %, alibi one slope per head, bias a (1, H, N, N)
# float32 bias broadcast over the batch (the Evoformer's pair bias, with its gradient)
CASES = {
    "llm-d64-kpm": (16, 1024, 16, 64, ("kpm",)),
    "llm-d128-kpm": (8, 2048, 16, 128, ("kpm",)),
    "llm-d64-mask": (16, 1024, 16, 64, ("mask",)),
    "llm-d128-alibi": (8, 2048, 16, 128, ("alibi",)),
    "evoformer-d32-bias-kpm": (1024, 256, 8, 32, ("bias", "kpm")),
    "evoformer-d64-bias-kpm": (512, 256, 8, 64, ("bias", "kpm")),
}


def make_case(name: str, precision: str, seed: int = 0):
    """cuflash keyword arguments and the SDPA float attn_mask of a case (its modifiers on fresh random data)."""
    b, n, h, d, mods = CASES[name]
    rng = np.random.default_rng(seed)
    kw: dict = {"precision": precision}
    add = cp.zeros((1, 1, n, n), dtype=cp.float32)  # SDPA's additive mask, broadcast to (B, H, N, N)
    if "kpm" in mods:
        keep = rng.integers(int(0.7 * n), n + 1, size=(b, 1))
        kpm = np.arange(n)[None, :] < keep
        kw["key_padding_mask"] = cp.asarray(kpm)
        add = add + cp.asarray(np.where(kpm, 0.0, -np.inf).astype(np.float32))[:, None, None, :]
    if "mask" in mods:
        mask = rng.random((n, n)) < 0.9
        kw["mask"] = cp.asarray(mask)
        add = add + cp.asarray(np.where(mask, 0.0, -np.inf).astype(np.float32))
    if "alibi" in mods:
        slopes = (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)
        kw["alibi_slopes"] = cp.asarray(slopes)
        dist = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :]).astype(np.float32)
        add = add - cp.asarray(slopes[:, None, None] * dist)[None]
    if "bias" in mods:
        kw["bias"] = cp.asarray(rng.standard_normal((1, h, n, n), dtype=np.float32))
    return kw, add


def time_cuflash(name, precision, kernels, reps, warmup):
    b, n, h, d, mods = CASES[name]
    config.KERNELS = kernels  # read by config.select at each selection; the caches hold the other family's choice
    _families._selected.clear()
    _plan.plans.clear()
    kw, _ = make_case(name, precision)
    n_sets = bench.n_input_sets(4 * 4 * b * n * h * d)
    rs = cp.random.RandomState(1)  # the same inputs for both kernel families: their outputs are compared
    sets = [[rs.standard_normal((b, n, h, d), dtype=cp.float32) for _ in range(4)] for _ in range(n_sets)]
    bias = "bias" in kw

    def fwd(i):
        q, k, v, _ = sets[i]
        return cuflash.attention_forward(q, k, v, **kw)

    def fwd_bwd(i):
        q, k, v, do = sets[i]
        o, lse = cuflash.attention_forward(q, k, v, **kw)
        return cuflash.attention_backward(do, q, k, v, o, lse, dbias=bias, **kw)

    events = bench.CupyEvents()
    ms = [bench.median_ms(call, n_sets, events, reps, warmup) for call in (fwd, fwd_bwd)]
    outs = (fwd(0)[0], *fwd_bwd(0))
    return ms, [x.copy() for x in outs]


def time_sdpa(name, precision, reps, warmup):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, n, h, d, mods = CASES[name]
    kw, add = make_case(name, precision)
    n_sets = bench.n_input_sets(4 * 4 * b * n * h * d)
    sets = [[torch.randn(b, h, n, d, device="cuda", dtype=torch.float32, requires_grad=True) for _ in range(3)]
            + [torch.randn(b, h, n, d, device="cuda", dtype=torch.float32)] for _ in range(n_sets)]
    add_t = bench.to_torch(add, torch)
    bias_t = bench.to_torch(kw["bias"], torch).detach().requires_grad_() if "bias" in kw else None

    def mask():
        m = add_t if bias_t is None else add_t + bias_t  # the bias's gradient flows through the sum
        return m.expand(b, h, n, n)

    def fwd(i):
        with torch.no_grad():
            return F.scaled_dot_product_attention(*sets[i][:3], attn_mask=mask())

    def fwd_bwd(i):
        leaves = sets[i][:3] + ([bias_t] if bias_t is not None else [])
        return torch.autograd.grad(F.scaled_dot_product_attention(*sets[i][:3], attn_mask=mask()), leaves, sets[i][3])

    events = bench.TorchEvents()
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return [bench.median_ms(call, n_sets, events, reps, warmup) for call in (fwd, fwd_bwd)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", choices=("fp32", "tf32"), default="fp32")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-sdpa", action="store_true", help="skip the SDPA column (no torch)")
    args = ap.parse_args()
    default = config.KERNELS
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, precision {args.precision}; ms (TFLOP/s); "
          f"x: cuflash default over the other column")
    print(f"{'case':<24} {'pass':<8} {'cuflash':>16} {'mma.sync':>16} {'x':>5} {'sdpa-mem':>16} {'x':>5}  max|diff|")
    for name in args.cases:
        b, n, h, d, _ = CASES[name]
        flops = 4 * b * h * n * n * d
        ours, outs = time_cuflash(name, args.precision, default, args.reps, args.warmup)
        mma, outs_mma = time_cuflash(name, args.precision, "mma", args.reps, args.warmup)
        config.KERNELS = default
        sdpa = [None, None] if args.no_sdpa else time_sdpa(name, args.precision, args.reps, args.warmup)
        diff = [float(cp.nan_to_num(cp.abs(x - y)).max()) for x, y in zip(outs, outs_mma)]
        for i, (p, f) in enumerate((("fwd", 1.0), ("fwd+bwd", 3.5))):
            cell = lambda ms: "" if ms is None else f"{ms:7.3f} ({f * flops / ms / 1e9:5.1f})"  # noqa: E731
            x_sdpa = f"{sdpa[i] / ours[i]:5.2f}" if sdpa[i] else ""
            print(f"{name:<24} {p:<8} {cell(ours[i]):>16} {cell(mma[i]):>16} {mma[i] / ours[i]:5.2f} "
                  f"{cell(sdpa[i]):>16} {x_sdpa:>5}  {diff[0] if i == 0 else max(diff[1:]):.1e}", flush=True)
        del outs, outs_mma
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
