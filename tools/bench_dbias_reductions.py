"""Throughput of float32 reductions into a broadcast dBias by warp access pattern:
`python tools/bench_dbias_reductions.py [--seqlen 256] [--heads 8] [--batch 512] [--reps 20]`.

A backward with a bias broadcast over the batch adds every sequence's dS into one (heads, L, L) float32 array. This
times that traffic alone: a grid of (L / 128 key blocks, heads, batch) CTAs of 8 warps, each walking the L / 16 steps
of 16 query rows of its 128 keys and adding one value per (query, key) into the shared array (a few dependent FMAs
per step stand in for the kernel's other work), in four layouts of a warp's `red.global.add`:

  fragment   the backward's S^T accumulator layout (put_dbias_tile): lane (g, t) adds keys g and g + 8 of queries
             2t and 2t + 1, so one warp instruction covers 4 query rows x 8 keys (four 32-byte requests)
  rotated    the same, each CTA starting its walk at step (batch index mod steps), so concurrent CTAs of one head
             and key block add into different rows
  quad-v4    the fragment transposed among each quad's four lanes (three shuffles), one `red.add.v4.f32` of 4 keys
             per lane: 8 query rows x 16 keys per instruction (64-byte requests)
  line       one query row x 32 keys per instruction (`red.add.f32`, one 128-byte line), as rows staged in shared
             memory would give
  line-v4    one query row x 128 keys per instruction (`red.add.v4.f32`, four lines)

Each layout adds the same values the same number of times; the medians of --reps launches (CUDA events) are printed
in microseconds. docs/PERFORMANCE.md ("Bias and masks" in Known gaps) has the H200 figures.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import cupy as cp
import numpy as np

SOURCE = r'''
extern "C" __global__ void reduce_dbias(float* dbias, int layout, int L) {
  const int kb = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;  // warp w: keys 16 w .. 16 w + 15 of the block
  const int steps = L / 16;
  float* base = dbias + (size_t)head * L * L + kb * 128;
  float v = 1.0f + lane * 1e-3f;
  for (int i = 0; i < steps; ++i) {
    const int q0 = 16 * (layout == 1 ? (i + batch) % steps : i);
    if (layout == 0 || layout == 1) {
      const int g = lane >> 2, t = lane & 3;
      for (int qt = 0; qt < 2; ++qt)
        for (int c = 0; c < 4; ++c) {
          float* at = base + (size_t)(q0 + 8 * qt + 2 * t + (c & 1)) * L + 16 * warp + g + 8 * (c >> 1);
          asm volatile("red.global.add.f32 [%0], %1;" ::"l"(at), "f"(v) : "memory");
        }
    } else if (layout == 2) {
      // lane 16 a + 4 j + t holds slot c of keys 4 a + j (+ 8 for c >= 2), queries 2 t + (c & 1); after the
      // transpose lane j holds slot j of keys 4 a .. 4 a + 3
      const int g = lane >> 2, t = lane & 3, j = g & 3, a = g >> 2;
      for (int qt = 0; qt < 2; ++qt) {
        const float x0 = v, x1 = v + 1.f, x2 = v + 2.f, x3 = v + 3.f;
        auto pick = [&](int s) { return s == 0 ? x0 : s == 1 ? x1 : s == 2 ? x2 : x3; };
        const float r0 = pick(j), r1 = __shfl_xor_sync(0xffffffffu, pick(j ^ 1), 4),
                    r2 = __shfl_xor_sync(0xffffffffu, pick(j ^ 2), 8),
                    r3 = __shfl_xor_sync(0xffffffffu, pick(j ^ 3), 12);
        auto from = [&](int k) { const int r = j ^ k; return r == 0 ? r0 : r == 1 ? r1 : r == 2 ? r2 : r3; };
        float* at = base + (size_t)(q0 + 8 * qt + 2 * t + (j & 1)) * L + 16 * warp + 4 * a + 8 * (j >> 1);
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(at), "f"(from(0)), "f"(from(1)),
                     "f"(from(2)), "f"(from(3)) : "memory");
      }
    } else if (layout == 3) {
      for (int r = 0; r < 8; ++r) {
        float* at = base + (size_t)(q0 + 2 * warp + (r >> 2)) * L + 32 * (r & 3) + lane;
        asm volatile("red.global.add.f32 [%0], %1;" ::"l"(at), "f"(v) : "memory");
      }
    } else {
      for (int r = 0; r < 2; ++r) {
        float* at = base + (size_t)(q0 + 2 * warp + r) * L + 4 * lane;
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(at), "f"(v), "f"(v), "f"(v), "f"(v)
                     : "memory");
      }
    }
    for (int k = 0; k < 64; ++k) v = v * 0.999f + 1e-6f;  // the step's other work, in a dependent chain
  }
}
'''
LAYOUTS = ("fragment", "rotated", "quad-v4", "line", "line-v4")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=256, help="L, a multiple of 128")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=512, help="sequences sharing the bias")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.seqlen < 128 or args.seqlen % 128:
        ap.error(f"--seqlen {args.seqlen}: a multiple of 128")
    if args.heads < 1 or args.batch < 1 or args.reps < 1:
        ap.error("--heads, --batch and --reps must be >= 1")
    kernel = cp.RawKernel(SOURCE, "reduce_dbias", options=("-std=c++17",))
    dbias = cp.zeros((args.heads, args.seqlen, args.seqlen), dtype=cp.float32)
    grid = (args.seqlen // 128, args.heads, args.batch)
    adds = args.batch * args.heads * args.seqlen ** 2
    print(f"{adds / 1e6:.0f} M float32 adds into ({args.heads}, {args.seqlen}, {args.seqlen}), grid {grid}")
    for layout, label in enumerate(LAYOUTS):
        for _ in range(3):
            kernel(grid, (256,), (dbias, np.int32(layout), np.int32(args.seqlen)))
        times = []
        for _ in range(args.reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            kernel(grid, (256,), (dbias, np.int32(layout), np.int32(args.seqlen)))
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        print(f"  {label:10s} {statistics.median(times):8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
