"""Time the backward main-kernel families side by side on one GPU:
`python tools/bench_bwd_families.py [--families bwd_sm90_ws bwd_sm90 bwd] [--head-dims 64 128] [--n 1024 4096 16384]
[--mods none alibi softcap dropout alibi+softcap+dropout bias bias+mask mask alibi+mask ...]`.

Each family is put first in the registry (cuflash.config.FAMILIES; the other backward families that would win
over it are left out), the selection and plan caches are cleared, and `attention_backward` is timed with CUDA
events (median of --reps calls after warm-up calls), bf16, FlashAttention benchmark shapes (batch = 16384 / N,
heads = 2048 / D). TFLOP/s count the backward as 2.5x the forward's FLOPs (half when causal). `diff` is the
largest difference of dQ, dK, dV to the first family's, so a wrong kernel shows up. This times the GPU work of
one call (preprocess, main kernel, dQ conversion) as the benchmark does (`cuflash.bench.median_ms`: calls queued
behind a hold, CUDA events around each, so the host's time per call is not in the figures); use it to measure a
kernel family against the one it replaces. --mods times the backward with a score modifier: ALiBi slopes in
[0, 0.3), softcap 30, dropout 0.1, a sliding window of 512 keys each side (its FLOPs: the visible pairs only), a
(batch, heads, N, N) bf16 bias with its dbias, a random boolean mask keeping 90 % of the scores (the bias and mask
rows skip N above 4096); a family without kernels for a set shows "-".
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _families, _plan, bench, config  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
FAMILY_CONFIG = {"bwd_sm90_ws": config.BwdSm90WsConfig, "bwd_sm90": config.BwdSm90Config,
                 "bwd_sm90_split": config.BwdSm90SplitConfig, "bwd": config.BwdConfig}


def use_family(name: str, original: tuple) -> None:
    """Registry with family `name` first among the backward families (the others after it, in their order)."""
    fam = next((f for f in original if f.name == name), None)
    if fam is None or fam.op != "backward":
        raise SystemExit(f"--families: {name!r} is not a backward family; backward families: "
                         f"{', '.join(f.name for f in original if f.op == 'backward')}")
    config.FAMILIES = (fam,) + tuple(f for f in original if f is not fam)
    _families._selected.clear()
    _plan.plans.clear()


def median_ms(fn, reps: int) -> float:
    return bench.median_ms(lambda i: fn(), 1, bench.CupyEvents(), reps, 2)


def mod_kwargs(name: str, b: int, h: int, n: int, rng) -> dict | None:
    """attention_backward keywords of a --mods set (None: too large at this N)."""
    kw: dict = {}
    for part in name.split("+"):
        if part == "alibi":
            kw["alibi_slopes"] = rng.random(h, dtype=cp.float32) * 0.3
        elif part == "softcap":
            kw["softcap"] = 30.0
        elif part == "dropout":
            kw.update(dropout_p=0.1, seed=1)
        elif part == "window":
            kw["window"] = (512, 512)
        elif part == "bias":
            if n > 4096:
                return None
            kw["bias"] = rng.standard_normal((b, h, n, n), dtype=cp.float32).astype(BF16)
        elif part == "mask":
            if n > 4096:
                return None
            kw["mask"] = rng.random((b, h, n, n), dtype=cp.float32) < 0.9
    return kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=["bwd_sm90_ws", "bwd_sm90"])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--n", nargs="+", type=int, default=[1024, 4096, 16384])
    ap.add_argument("--causal", nargs="+", choices=("no", "yes"), default=["no", "yes"])
    ap.add_argument("--mods", nargs="+", default=["none"],
                    choices=("none", "alibi", "softcap", "dropout", "alibi+softcap", "softcap+window",
                             "alibi+softcap+dropout", "bias", "bias+mask", "mask", "alibi+mask", "softcap+mask"))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    original = config.FAMILIES
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, bf16, TFLOP/s (ms)")
    print(f"{'mods':>14} {'D':>4} {'causal':>6} {'N':>6}  " + "  ".join(f"{f:>22}" for f in args.families) + "  diff")
    for mods, d, causal, n in ((m, d, c == "yes", n) for m in args.mods for d in args.head_dims
                       for c in args.causal for n in args.n):
        b, h = 16384 // n, 2048 // d
        rng = cp.random.default_rng(0)
        kw = {} if mods == "none" else mod_kwargs(mods, b, h, n, rng)
        if kw is None:
            continue
        q, k, v, do = (rng.standard_normal((b, n, h, d), dtype=cp.float32).astype(BF16) for _ in range(4))
        o, lse = cuflash.attention_forward(q, k, v, causal=causal, **kw)
        bits = sum(bit for key, bit in (("alibi_slopes", config.MOD_ALIBI), ("softcap", config.MOD_SOFTCAP),
                                        ("dropout_p", config.MOD_DROPOUT), ("bias", config.MOD_BIAS),
                                        ("mask", config.MOD_MASK), ("window", config.MOD_WINDOW)) if key in kw)
        if "bias" in kw:
            kw["dbias"] = True
        pairs = n * n / (2 if causal else 1) if "window" not in kw else bench.visible_pairs(n, n, causal, kw["window"])
        flops = 2.5 * 4 * b * h * d * pairs
        cells, first, grads, diff = [], None, None, 0.0
        for name in args.families:
            use_family(name, original)
            try:
                # (a window carries causal as its right edge: the kernel is not the causal one)
                cfg = config.backward_kernel_config(d, "bf16", causal and "window" not in kw, False, "sm_90a",
                                                    mods=bits)
            except ValueError:
                cfg = None
            if type(cfg) is not FAMILY_CONFIG[name]:  # the family has no kernel for these mods
                cells.append(f"{'-':>22}")
                continue
            def call(args=(do, q, k, v, o, lse), causal=causal, kw=kw):
                return cuflash.attention_backward(*args, causal=causal, **kw)
            grads = [x.astype(cp.float32) for x in call()]
            if first is None:
                first = grads
            else:
                diff = max(diff, *(float(cp.abs(a - b_).max()) for a, b_ in zip(grads, first)))
            ms = median_ms(call, args.reps)
            cells.append(f"{flops / ms / 1e9:7.1f} ({ms:7.3f}) {type(cfg).__name__[:6]}")
        print(f"{mods:>14} {d:>4} {str(causal):>6} {n:>6}  " + "  ".join(f"{c:>22}" for c in cells) +
              f"  {diff:.2e}", flush=True)
        del q, k, v, do, o, lse, kw, grads, first
        cp.get_default_memory_pool().free_all_blocks()
    config.FAMILIES = original
    return 0


if __name__ == "__main__":
    sys.exit(main())
