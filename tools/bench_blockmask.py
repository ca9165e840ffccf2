"""Block-sparse attention with a BlockMask, or a key padding mask, against the dense call and the same mask as a plain
bool array, on one GPU.

    python tools/bench_blockmask.py [--keep 0.1] [--block 128] [--seqlen 16384] [--dtype bf16|fp32|tf32]
    python tools/bench_blockmask.py --key-padding [--keep 0.5] [--batch 8] [--seqlen 4096]

B = 1 (--batch), N = 16k, D 128 (16 heads) and D 64 (32 heads). A BlockMask: a random pattern of block x block blocks
keeps a fraction `keep` of them. --key-padding: a key_padding_mask in which each sequence keeps the first `keep` of its
keys (rounded to --block keys), against the same mask as a (batch, 1, 1, N) `mask=`. Times (median of
CUDA-event-timed calls, cuflash.bench.median_ms) the forward and forward+backward of the dense call, of the mask
call and (forward) of the plain mask, and checks that the two mask calls' forwards are equal. --dtype: bf16 inputs
(default), or float32 inputs with precision "fp32" (3xTF32) or "tf32" (one pass)."""
from __future__ import annotations

import argparse

import cupy as cp
import ml_dtypes
import numpy as np

import cuflash
from cuflash.bench import CupyEvents, median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", type=float, default=None,
                    help="fraction of blocks (or, --key-padding, of each sequence's keys) kept (default 0.1; 0.5)")
    ap.add_argument("--block", type=int, default=128, help="block size of the mask pattern (default 128)")
    ap.add_argument("--seqlen", type=int, default=None, help="N (default 16384; --key-padding 4096)")
    ap.add_argument("--batch", type=int, default=None, help="B (default 1; --key-padding 8)")
    ap.add_argument("--key-padding", action="store_true",
                    help="a key_padding_mask keeping a prefix of each sequence's keys instead of a BlockMask")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "tf32"), default="bf16",
                    help="bf16, or float32 inputs with precision fp32 (3xTF32) or tf32 (default bf16)")
    args = ap.parse_args()
    kp = args.key_padding
    keep = args.keep if args.keep is not None else 0.5 if kp else 0.1
    n = args.seqlen or (4096 if kp else 16384)
    b = args.batch or (8 if kp else 1)
    blk = args.block
    ev = CupyEvents()
    dtype = ml_dtypes.bfloat16 if args.dtype == "bf16" else cp.float32
    kw = {} if args.dtype == "bf16" else {"precision": args.dtype}
    for d, h in ((128, 16), (64, 32)):
        q, k, v = (cp.random.standard_normal((b, n, h, d), dtype=cp.float32).astype(dtype) for _ in range(3))
        if kp:
            kept = max(blk, round(keep * n / blk) * blk)
            kpm = cp.asarray(np.arange(n)[None, :] < np.full((b, 1), kept))
            m = kpm[:, None, None, :]
            masked, what = {"key_padding_mask": kpm}, f"key_padding_mask {kept}/{n} keys"
        else:
            blocks = np.random.default_rng(0).random((-(-n // blk), -(-n // blk))) < keep
            m = cp.asarray(np.repeat(np.repeat(blocks, blk, 0), blk, 1)[:n, :n])
            masked, what = {"mask": cuflash.BlockMask(m)}, f"BlockMask {keep:.0%}"
        dense = median_ms(lambda i: cuflash.attention(q, k, v, **kw), 1, ev, 20, 3)
        sparse = median_ms(lambda i: cuflash.attention(q, k, v, **masked, **kw), 1, ev, 20, 3)
        plain = median_ms(lambda i: cuflash.attention(q, k, v, mask=m, **kw), 1, ev, 10, 2)
        equal = bool((cuflash.attention(q, k, v, **masked, **kw) == cuflash.attention(q, k, v, mask=m, **kw)).all())
        print(f"{args.dtype} D{d} H{h} B{b} N{n}: fwd dense {dense:.3f} ms, {what} {sparse:.3f} ms "
              f"({dense / sparse:.2f}x), plain mask {plain:.3f} ms ({plain / sparse:.2f}x); equal {equal}", flush=True)

        def fwd_bwd(extra):
            o, lse = cuflash.attention_forward(q, k, v, **extra, **kw)
            return cuflash.attention_backward(o, q, k, v, o, lse, **extra, **kw)

        t_dense = median_ms(lambda i: fwd_bwd({}), 1, ev, 5, 1)
        t_sparse = median_ms(lambda i: fwd_bwd(masked), 1, ev, 5, 1)
        t_plain = median_ms(lambda i: fwd_bwd({"mask": m}), 1, ev, 5, 1)
        print(f"  fwd+bwd dense {t_dense:.3f} ms, {what} {t_sparse:.3f} ms ({t_dense / t_sparse:.2f}x), plain mask "
              f"{t_plain:.3f} ms", flush=True)

if __name__ == "__main__":
    main()
