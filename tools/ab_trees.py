"""This checkout's attention against another checkout's, timed in one process in alternating rounds:
`python tools/ab_trees.py --against DIR [--pass fwd bwd] [--dtype bf16|fp16|fp32|tf32|fp64] [--head-dims 128 64]
[--n 1024 4096 16384] [--causal no yes] [--rounds 2] [--sustain 0.5] [--json F]`.

DIR is a checkout of the commit or variant to compare with (`git worktree add /tmp/base HEAD`, or a copy of the tree
holding an uncommitted change): its cuflash package is loaded beside this one under another name, with its kernels
from DIR/cuda (tools/launch_overhead.py's `load_other_cuflash`). On each FlashAttention benchmark shape (batch =
16384 / N, heads = 2048 / D) both time the same calls on the same inputs with `cuflash.bench.median_ms` (CUDA events,
inputs rotated out of the L2, calls back to back; `--sustain S`: S seconds of warm-up and at least S seconds of
timed calls per measurement, as `python -m cuflash.bench --sustain`), `--rounds` times, the two in reverse order
every other round: on a GPU at its power cap the clock moves by several percent within a minute, so only timings
taken side by side, in both orders, compare. Separate processes would also do; one process keeps the inputs and the
GPU's state the same for both.

`fwd` times `attention`, `bwd` `attention_backward` (each checkout on its own forward's o and lse); float32 calls
take the bench's precision (fp32: "fp32", tf32: "tf32"). `diff` is the largest absolute difference between the two
checkouts' outputs (o; dq, dk, dv) on the first input set, in float64 for float64 outputs and in float32 otherwise,
so a variant that computes something else shows.
`this/other` is the other checkout's median time over the rounds divided by this one's: above 1, this checkout is the
faster. Results go to docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cuflash.bench import DTYPES  # noqa: E402  (no CuPy: the bench's dtype names)

PASSES = ("fwd", "bwd")
CAUSAL = {"no": False, "yes": True}


def round_orders(rounds: int) -> list[tuple[str, str]]:
    """Which checkout runs first in each round: this one in even rounds, the other in odd ones."""
    return [("this", "other") if r % 2 == 0 else ("other", "this") for r in range(rounds)]


def time_rounds(calls: dict, rounds: int, measure) -> dict[str, list[float]]:
    """measure(calls[name]) of both checkouts ("this", "other") once per round, in round_orders' order: the times of
    each, a list in round order."""
    times = {name: [] for name in calls}
    for order in round_orders(rounds):
        for name in order:
            times[name].append(measure(calls[name]))
    return times


def speedup(this_ms: list[float], other_ms: list[float]) -> float:
    """The other checkout's median time over this one's (> 1: this one is faster)."""
    return statistics.median(other_ms) / statistics.median(this_ms)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--against", required=True, metavar="DIR", help="the other checkout (DIR/cuflash, DIR/cuda)")
    p.add_argument("--pass", dest="passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="as python -m cuflash.bench: fp32 / tf32 are float32 inputs at precision \"fp32\" / \"tf32\"")
    p.add_argument("--head-dims", nargs="+", type=int, default=[128, 64])
    p.add_argument("--n", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument("--causal", nargs="+", choices=tuple(CAUSAL), default=["no", "yes"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sustain", type=float, default=0.5, metavar="S",
                   help="seconds of warm-up and of timed calls per measurement (0: --reps calls)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", metavar="F", help="write the records here")
    args = p.parse_args(argv)
    init = Path(args.against) / "cuflash" / "__init__.py"
    if not init.is_file():
        p.error(f"--against {args.against!r}: {init} does not exist (DIR must be a checkout of cuflash)")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    if args.sustain < 0:
        p.error(f"--sustain {args.sustain}: seconds, 0 or more")
    for n in args.n:
        if not 1 <= n <= 16384:
            p.error(f"--n {n}: a sequence length from 1 to 16384 (the FA shapes' batch = 16384 // N)")
    return args


def compare(args, trees: dict, cp, bench, to_float32) -> list[dict]:
    """Every shape of args for both checkouts (trees: "this" and "other", cuflash modules): the rows printed and
    the records of the JSON. cp: CuPy; bench: cuflash.bench (its Shape, random_array, n_input_sets, CupyEvents,
    median_ms, sustain_s); to_float32: cuflash._xpref's."""
    bench.sustain_s = args.sustain
    events, records = bench.CupyEvents(), []

    def widen(x):  # float64 outputs compared as they are: float32 rounding would hide their differences
        return x if x.dtype == cp.float64 else to_float32(x)

    for d in args.head_dims:
        for causal in (CAUSAL[c] for c in args.causal):
            for n in args.n:
                shape = bench.Shape(args.dtype, d, causal, n)  # the FA shape and its FLOP count
                b, h = shape.batch, shape.heads
                n_sets = bench.n_input_sets(4 * b * n * h * d * 2)
                rng = cp.random.RandomState(n + d)
                sets = [tuple(bench.random_array(rng, (b, n, h, d), args.dtype) for _ in range(4))
                        for _ in range(n_sets)]
                kw = dict(causal=causal, **bench.cuflash_kwargs(args.dtype))
                outs = {name: [t.attention_forward(q, k, v, **kw) for q, k, v, _ in sets] for name, t in trees.items()}

                def calls(name, passname, t):
                    if passname == "fwd":
                        return lambda i: t.attention(*sets[i][:3], **kw)
                    return lambda i: t.attention_backward(sets[i][3], *sets[i][:3], *outs[name][i], **kw)

                for passname in args.passes:
                    first = {name: calls(name, passname, t)(0) for name, t in trees.items()}
                    got = {name: x if isinstance(x, tuple) else (x,) for name, x in first.items()}
                    diff = max(float(cp.abs(widen(a) - widen(o)).max()) for a, o in zip(got["this"], got["other"]))
                    del first, got
                    times = time_rounds({name: calls(name, passname, t) for name, t in trees.items()}, args.rounds,
                                        lambda call: bench.median_ms(call, n_sets, events, args.reps, args.warmup))
                    x = speedup(times["this"], times["other"])
                    rate = {name: shape.flops(passname) / statistics.median(ms) / 1e9 for name, ms in times.items()}
                    print(f"{passname} D {d} causal {'yes' if causal else 'no'} N {n}: this "
                          f"{' / '.join(f'{m:.3f}' for m in times['this'])} ms ({rate['this']:.0f} TFLOP/s), other "
                          f"{' / '.join(f'{m:.3f}' for m in times['other'])} ms ({rate['other']:.0f}); this/other "
                          f"{x:.3f}, diff {diff:.2e}", flush=True)
                    records.append({"pass": passname, "head_dim": d, "causal": causal, "seqlen": n, "batch": b,
                                    "heads": h, "this_ms": times["this"], "other_ms": times["other"],
                                    "this_over_other": x, "diff": diff})
                del sets, outs
                cp.get_default_memory_pool().free_all_blocks()
    return records


def main(argv=None) -> int:
    args = parse_args(argv)
    import cupy as cp

    import cuflash
    from cuflash import _xpref, bench

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from launch_overhead import load_other_cuflash

    other = load_other_cuflash(args.against)
    print(f"this: {Path(cuflash.__file__).parent.parent}, other: {Path(other.__file__).parent.parent}; "
          f"{args.dtype}, {args.rounds} rounds, sustain {args.sustain:g} s", flush=True)
    records = compare(args, {"this": cuflash, "other": other}, cp, bench, _xpref.to_float32)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"against": str(Path(args.against).resolve()), "dtype": args.dtype, "rounds": args.rounds,
                       "sustain_s": args.sustain, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
