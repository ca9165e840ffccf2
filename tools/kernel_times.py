"""GPU time of each launch of one `attention_backward` (or `attention_forward`) call:
`python tools/kernel_times.py --dtype fp32 --head-dim 128 --heads 16 [--batch 4] [--n 4096] [--causal] [--forward]
[--bias-batch BB [--no-dbias]] [--main 16,2] [--dq 16,2,2] [--reps 10]`.

Where the benchmark times a whole call, this splits it: every kernel launch of the call is bracketed by CUDA events
(plans are bypassed, so each call takes the full path and its launches), and the median over --reps calls (after three
warm-up calls) is printed per kernel and for the whole call (its CuPy fills and copies included), with the kernels'
TFLOP/s (the backward as 2.5x the forward's FLOPs; half when causal). --main / --dq set the float32 Hopper backward's
tiles for the run (config.BWD_SM90_TF32_TILES, BWD_DQ_SM90_TF32_TILES at this dtype and head dim), to compare a kernel
with other tiles or with another head dim's kernel at the same CTA count (e.g. head dim 128 at 16 heads, whose cluster
pairs run 64 columns per CTA, against head dim 64 at 32 heads). float32 / tf32 / bf16 / fp16 inputs from a standard
normal. --bias-batch BB adds a bias of shape (BB, heads, N, N) in the inputs' dtype, each shared by batch / BB
sequences (BB 1 with a batch of B*N rows is the Evoformer's pair bias), and the backward returns its gradient (a
broadcast one summed with float32 atomics) unless --no-dbias.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _families, _launch, _plan, config  # noqa: E402

_events: dict = collections.defaultdict(list)
_recording = [False]


def _instrument() -> None:
    """Event pairs around every launch while recording; no plans (each call launches through the full path)."""
    launch, init = _launch._Kernel.launch, _launch._Kernel.__init__

    def timed_launch(self, grid, params, stream_ptr):
        if not _recording[0]:
            return launch(self, grid, params, stream_ptr)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        launch(self, grid, params, stream_ptr)
        end.record()
        _events[self.kernel_label].append((start, end))

    def named_init(self, compiled, threads, smem_bytes):
        init(self, compiled, threads, smem_bytes)
        self.kernel_label = compiled.name_expression.split("<")[0].split("::")[-1]

    _launch._Kernel.launch, _launch._Kernel.__init__ = timed_launch, named_init
    _plan.plans.get = lambda key: None


def _tiles(text: str | None) -> tuple | None:
    return None if text is None else tuple(int(x) for x in text.split(","))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("fp32", "tf32", "bf16", "fp16"), default="fp32")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--forward", action="store_true", help="time attention_forward instead of the backward")
    ap.add_argument("--bias-batch", type=int, default=0,
                    help="a (BB, heads, N, N) bias shared by batch / BB sequences (0: no bias)")
    ap.add_argument("--no-dbias", action="store_true", help="with a bias, the backward without its gradient")
    ap.add_argument("--main", default=None, help="float32 backward dK / dV tiles: block_m,stages")
    ap.add_argument("--dq", default=None, help="float32 backward dQ tiles: block_n,stages,consumers")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dt, d = args.dtype, args.head_dim
    if args.bias_batch < 0 or (args.bias_batch and args.batch % args.bias_batch):
        ap.error(f"--bias-batch {args.bias_batch}: 0 (no bias) or a divisor of --batch {args.batch}")
    if args.no_dbias and not args.bias_batch:
        ap.error("--no-dbias needs a bias (--bias-batch)")
    if args.main or args.dq:
        if dt not in ("fp32", "tf32"):
            ap.error("--main / --dq set the float32 Hopper backward's tiles: --dtype fp32 or tf32")
        if args.main:
            config.BWD_SM90_TF32_TILES[dt][d] = _tiles(args.main)
        if args.dq:
            config.BWD_DQ_SM90_TF32_TILES[dt][d] = _tiles(args.dq)
        _families._selected.clear()
    _instrument()
    kw = {"precision": dt} if dt in ("fp32", "tf32") else {}
    cp_dtype = {"fp32": cp.float32, "tf32": cp.float32, "bf16": np.dtype(ml_dtypes.bfloat16), "fp16": cp.float16}[dt]
    shape = (args.batch, args.n, args.heads, d)
    q, k, v, do = (cp.random.standard_normal(shape, dtype=cp.float32).astype(cp_dtype) for _ in range(4))
    if args.bias_batch:
        bias = cp.random.standard_normal((args.bias_batch, args.heads, args.n, args.n), dtype=cp.float32)
        kw["bias"] = bias.astype(cp_dtype)
    o, lse = cuflash.attention_forward(q, k, v, causal=args.causal, **kw)
    bkw = dict(kw, dbias=True) if args.bias_batch and not args.no_dbias else kw
    call = ((lambda: cuflash.attention_forward(q, k, v, causal=args.causal, **kw)) if args.forward else
            (lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=args.causal, **bkw)))
    for _ in range(3):
        call()
    _recording[0] = True
    calls = []
    for _ in range(args.reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        call()
        end.record()
        calls.append((start, end))
    cp.cuda.Device().synchronize()
    _recording[0] = False
    whole = statistics.median(cp.cuda.get_elapsed_time(s, e) for s, e in calls)
    medians = {name: statistics.median(cp.cuda.get_elapsed_time(s, e) for s, e in evs) for name, evs in _events.items()}
    total = sum(medians.values())
    flops = (1 if args.forward else 2.5) * 4 * args.batch * args.heads * args.n ** 2 * d / (2 if args.causal else 1)
    bias = f" bias=({args.bias_batch}, H, N, N){' no dbias' if args.no_dbias else ''}" if args.bias_batch else ""
    print(f"{dt} D={d} B={args.batch} H={args.heads} N={args.n} causal={args.causal}{bias} "
          f"{'forward' if args.forward else 'backward'}: {total:.3f} ms, {flops / total / 1e9:.1f} TFLOP/s")
    for name, ms in medians.items():
        print(f"  {name:40s} {ms:9.3f} ms")
    print(f"  {'the whole call (with allocations, fills)':40s} {whole:9.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
