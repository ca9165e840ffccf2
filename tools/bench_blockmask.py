"""Block-sparse attention with a BlockMask against the dense call and the same mask as a plain bool array, on one GPU.

    python tools/bench_blockmask.py [--keep 0.1] [--block 128] [--seqlen 16384] [--dtype bf16|fp32|tf32]

B = 1, N = 16k, D 128 (16 heads) and D 64 (32 heads); a random pattern of block x block blocks keeps a fraction `keep`
of them. Times (median of CUDA-event-timed calls, cuflash.bench.median_ms) the forward and forward+backward of the
dense call, of mask=BlockMask(m) and (forward) of mask=m, and checks that the BlockMask forward equals the plain
mask's. --dtype: bf16 inputs (default), or float32 inputs with precision "fp32" (3xTF32) or "tf32" (one pass)."""
from __future__ import annotations

import argparse

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash
from cuflash.bench import CupyEvents, median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=float, default=0.1, help="fraction of blocks kept (default 0.1)")
    ap.add_argument("--block", type=int, default=128, help="block size of the mask pattern (default 128)")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--dtype", choices=("bf16", "fp32", "tf32"), default="bf16",
                    help="bf16, or float32 inputs with precision fp32 (3xTF32) or tf32 (default bf16)")
    args = ap.parse_args()
    ev = CupyEvents()
    n, blk = args.seqlen, args.block
    dtype = ml_dtypes.bfloat16 if args.dtype == "bf16" else cp.float32
    kw = {} if args.dtype == "bf16" else {"precision": args.dtype}
    for d, h in ((128, 16), (64, 32)):
        q, k, v = (cp.random.standard_normal((1, n, h, d), dtype=cp.float32).astype(dtype) for _ in range(3))
        blocks = np.random.default_rng(0).random((-(-n // blk), -(-n // blk))) < args.keep
        m = cp.asarray(np.repeat(np.repeat(blocks, blk, 0), blk, 1)[:n, :n])
        bm = cuflash.BlockMask(m)
        dense = median_ms(lambda i: cuflash.attention(q, k, v, **kw), 1, ev, 20, 3)
        sparse = median_ms(lambda i: cuflash.attention(q, k, v, mask=bm, **kw), 1, ev, 20, 3)
        plain = median_ms(lambda i: cuflash.attention(q, k, v, mask=m, **kw), 1, ev, 10, 2)
        equal = bool((cuflash.attention(q, k, v, mask=bm, **kw) == cuflash.attention(q, k, v, mask=m, **kw)).all())
        print(f"{args.dtype} D{d} H{h} N{n}: fwd dense {dense:.3f} ms, BlockMask {args.keep:.0%} {sparse:.3f} ms "
              f"({dense / sparse:.2f}x), plain mask {plain:.3f} ms ({plain / sparse:.2f}x); equal {equal}", flush=True)

        def fwd_bwd(mask):
            o, lse = cuflash.attention_forward(q, k, v, mask=mask, **kw)
            return cuflash.attention_backward(o, q, k, v, o, lse, mask=mask, **kw)

        t_dense = median_ms(lambda i: fwd_bwd(None), 1, ev, 5, 1)
        t_sparse = median_ms(lambda i: fwd_bwd(bm), 1, ev, 5, 1)
        t_plain = median_ms(lambda i: fwd_bwd(m), 1, ev, 5, 1)
        print(f"  fwd+bwd dense {t_dense:.3f} ms, BlockMask {t_sparse:.3f} ms ({t_dense / t_sparse:.2f}x), plain mask "
              f"{t_plain:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
