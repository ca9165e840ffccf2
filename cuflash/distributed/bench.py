"""Context-parallel scaling: ring attention forward + backward on P GPUs against the same attention on one GPU.

    python -m cuflash.bench --ring                                    # all GPUs of this node, N 128k .. 1M
    python -m cuflash.bench --ring --seqlen 262144 --heads 16 --head-dim 128 --causal no --json ring.json

(`--ring` starts `python -m cuflash.distributed.launch --nproc-per-node P -m cuflash.distributed.bench ...`.)
Shape: batch 1, --heads heads (16), --head-dim (128), bf16, global length N, causal (zigzag sharding) unless
--causal no. One GPU: cuflash.attention_forward then attention_backward on the whole sequence, on rank 0 while the
other ranks wait. P GPUs: ring_attention_forward then ring_attention_backward on each rank's shard. Each timing:
CUDA events around one forward + backward after a barrier, the slowest rank's time, median of --reps after
--warmup (fewer reps where one call takes longer than --rep-seconds: at least 2). Inputs are drawn once per N
and shape; every tensor is far larger than the L2, so no call finds another's data there.
FLOPs: fwd + bwd = 3.5 x 4 B H N^2 D, halved when causal. Parallel efficiency = t(1 GPU) / (P t(P GPUs)).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

DEFAULT_SEQLENS = (131072, 262144, 524288, 1048576)


def build_parser(prog="python -m cuflash.distributed.bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=list(DEFAULT_SEQLENS), metavar="N")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", choices=("yes", "no"), default="yes")
    p.add_argument("--reps", type=int, default=5, help="timed runs per measurement (median); default 5")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first; default 1")
    p.add_argument("--rep-seconds", type=float, default=20.0,
                   help="fewer reps (>= 2) where one run takes longer than this; default 20")
    p.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline")
    p.add_argument("--simulate", type=int, default=None, metavar="P",
                   help="one GPU, no launcher: time the one-process simulation of a ring of P ranks (the same "
                        "kernels, merges and sums, run one rank after another, no NCCL) against one call: "
                        "t(1 call) / t(simulation) is the ring's efficiency without communication")
    p.add_argument("--json", metavar="FILE", help="write the records as JSON (rank 0)")
    return p


def launch(argv) -> int:
    """`python -m cuflash.bench --ring ...`: this benchmark under the launcher, one process per GPU."""
    import subprocess

    import cupy as cp

    args = build_parser("python -m cuflash.bench --ring").parse_args(argv)  # errors here, not in P processes
    if args.simulate is not None:
        return main(argv)
    gpus = cp.cuda.runtime.getDeviceCount()
    if gpus < 2:
        print(f"note: this node has {gpus} GPU; the ring runs with one rank (no communication)")
    return subprocess.call([sys.executable, "-m", "cuflash.distributed.launch", "--nproc-per-node", str(gpus), "-m",
                            "cuflash.distributed.bench", *argv])


def _time(fn, reps, warmup, rep_seconds, group=None):
    """(median over reps of fn()'s CUDA-event time in ms, reps run). With a group: every rank runs fn after a
    barrier and each run counts the slowest rank's time."""
    import cupy as cp

    def once():
        if group is not None:
            group.barrier()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        ms = cp.cuda.get_elapsed_time(start, end)
        return ms if group is None else float(group.all_reduce_max([ms])[0])

    first = None
    for _ in range(warmup):
        first = once()
    if first is not None and first > 1e3 * rep_seconds:
        reps = min(reps, 2)
    return statistics.median([once() for _ in range(reps)]), reps


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import cupy as cp
    from cupy.cuda import nccl

    import cuflash
    import cuflash.distributed as cfd

    if args.simulate is not None:
        return main_simulate(args)
    group = cfd.init_process_group()
    p, rank = group.world_size, group.rank
    causal = args.causal == "yes"
    h, d = args.heads, args.head_dim
    props = cp.cuda.runtime.getDeviceProperties(group.device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    if rank == 0:
        print(f"device: {p} x {name}, cupy {cp.__version__}, NCCL {nccl.get_version()}, cuflash {cuflash.__version__}")
        print(f"ring attention fwd+bwd, B=1 H={h} D={d} bf16, {'causal (zigzag)' if causal else 'not causal'}")
        print(f"{'N':>8} {'1 GPU ms':>10} {'TFLOP/s':>8} {f'{p} GPUs ms':>10} {'TFLOP/s':>8} {'speedup':>8} "
              f"{'efficiency':>10} {'reps':>5}")
    records = []

    for n in args.seqlen:
        flops = 3.5 * 4 * h * n * n * d / (2 if causal else 1)
        t1 = reps1 = None
        if not args.no_single:
            if rank == 0:
                q, k, v, do = (_randn((1, n, h, d), 10 * n + i) for i in range(4))

                def single():
                    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
                    cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)

                t1, reps1 = _time(single, args.reps, args.warmup, args.rep_seconds)
                q = k = v = do = None  # free them before the next size
                cp.get_default_memory_pool().free_all_blocks()
            group.barrier()
        local = n // p
        q, k, v, do = (_randn((1, local, h, d), 10 * n + 4 + 4 * rank + i) for i in range(4))

        def ring():
            o, lse = cfd.ring_attention_forward(q, k, v, group, causal=causal)
            cfd.ring_attention_backward(do, q, k, v, o, lse, group, causal=causal)

        tp, reps_p = _time(ring, args.reps, args.warmup, args.rep_seconds, group)
        q = k = v = do = None  # free them before the next size
        cp.get_default_memory_pool().free_all_blocks()
        if rank == 0:
            rec = {"seqlen": n, "world_size": p, "heads": h, "head_dim": d, "causal": causal,
                   "ms_1gpu": t1, "ms_ring": tp, "tflops_1gpu": flops / t1 / 1e9 if t1 else None,
                   "tflops_ring": flops / tp / 1e9, "speedup": t1 / tp if t1 else None,
                   "efficiency": t1 / (p * tp) if t1 else None, "reps_1gpu": reps1, "reps_ring": reps_p}
            records.append(rec)
            f = (lambda x, w, fmt: f"{x:>{w}{fmt}}" if x is not None else f"{'-':>{w}}")
            print(f"{n:>8} {f(t1, 10, '.1f')} {f(rec['tflops_1gpu'], 8, '.0f')} {tp:>10.1f} "
                  f"{rec['tflops_ring']:>8.0f} {f(rec['speedup'], 8, '.2f')} {f(rec['efficiency'], 10, '.1%')} "
                  f"{reps_p:>5}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": name, "gpus": p, "cupy": cp.__version__, "nccl": nccl.get_version(),
                       "cuflash": cuflash.__version__, "date": time.strftime("%Y-%m-%d"), "records": records}, fh,
                      indent=1)
    group.barrier()
    group.destroy()
    return 0


def _randn(shape, seed):
    """Normal values rounded to bf16, a fresh CuPy array."""
    import cupy as cp

    from .._xpref import to_lowp

    return to_lowp(cp.random.RandomState(seed).standard_normal(shape, dtype=cp.float32), "bf16")


def main_simulate(args) -> int:
    """--simulate P: the ring's compute alone, on this GPU (see --help)."""
    import cupy as cp

    import cuflash
    import cuflash.distributed as cfd

    p, causal, h, d = args.simulate, args.causal == "yes", args.heads, args.head_dim
    if p < 1:
        raise SystemExit(f"--simulate {p}: must be >= 1")
    print(f"one-process simulation of a ring of {p}, fwd+bwd, B=1 H={h} D={d} bf16, "
          f"{'causal (zigzag)' if causal else 'not causal'}, cuflash {cuflash.__version__}")
    print(f"{'N':>8} {'1 call ms':>10} {'ring sim ms':>12} {'compute efficiency':>19}")
    records = []
    for n in args.seqlen:
        q, k, v, do = (_randn((1, n, h, d), 10 * n + i) for i in range(4))

        def single():
            o, lse = cuflash.attention_forward(q, k, v, causal=causal)
            cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)

        def simulated():
            o, lse = cfd.simulate_ring_attention_forward(q, k, v, p, causal=causal)
            cfd.simulate_ring_attention_backward(do, q, k, v, o, lse, p, causal=causal)

        t1, _ = _time(single, args.reps, args.warmup, args.rep_seconds)
        ts, reps = _time(simulated, args.reps, args.warmup, args.rep_seconds)
        q = k = v = do = None  # free them before the next size
        cp.get_default_memory_pool().free_all_blocks()
        records.append({"seqlen": n, "world_size": p, "ms_1call": t1, "ms_simulated": ts, "reps": reps})
        print(f"{n:>8} {t1:>10.1f} {ts:>12.1f} {t1 / ts:>19.1%}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"mode": "simulate", "date": time.strftime("%Y-%m-%d"), "records": records}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
