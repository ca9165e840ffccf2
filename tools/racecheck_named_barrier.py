"""Does compute-sanitizer's racecheck honour a named barrier that only some warps of a CTA use?

The warp-specialized Hopper backward stages dK and dV in shared memory and reads them back across
`bar.sync 3, 256`, a barrier of its 256 consumer threads (the 128 producer threads never take part), and racecheck
reports RAW hazards between those stores and loads. This script runs the same pattern in a few lines of CUDA,
one variant per process under `compute-sanitizer --tool racecheck`, and prints the hazards of each:

  consumers-exit   384 threads; warps 0-3 return at once; warps 4-11 store, bar.sync 3, 256, load another warp's
  consumers-stay   the same, warps 0-3 stay resident (they skip the barrier and end with the others)
  whole-cta-256    256 threads, all of them in bar.sync 3, 256
  whole-cta-384    384 threads, all of them in bar.sync 3, 384 (256 store and load)
  arrive-first     consumers-stay, after a bar.sync / bar.arrive hand-off on barrier 2 (one warp syncs, seven
                   arrive), the backward's dQ pattern
  subset-sync      consumers-stay, after `bar.sync 2, 128` by the second 128 consumers alone (the first skip it),
                   the head-dim-128 backward's dQ by one consumer warpgroup
Each variant checks its loads (a wrong value exits 1), so a variant without hazards also ran correctly.

    python tools/racecheck_named_barrier.py            # needs a GPU and compute-sanitizer on PATH (or --sanitizer)
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

VARIANTS = {  # name: (threads, first consumer thread (the barrier counts threads from it on), producers exit,
    #                  barrier 2 first: 0 no, 1 the bar.sync / bar.arrive hand-off, 2 bar.sync by half the consumers)
    "consumers-exit": (384, 128, True, 0),
    "consumers-stay": (384, 128, False, 0),
    "whole-cta-256": (256, 0, False, 0),
    "whole-cta-384": (384, 0, False, 0),
    "arrive-first": (384, 128, False, 1),
    "subset-sync": (384, 128, False, 2),
}

SOURCE = r"""
extern "C" __global__ void staged_exchange(float* out, int first_consumer, int producers_exit, int dq_handoff) {
  __shared__ float tile[256];
  const int tid = threadIdx.x;
  if (tid < first_consumer && producers_exit) return;
  const int c = tid - first_consumer;        // consumer index; the barrier counts every consumer
  const bool active = c >= 0 && c < 256;     // the 256 that store and load
  if (active) {
    if (dq_handoff == 1) {
      tile[c] = -1.0f;
      if (c < 32) asm volatile("bar.sync 2, 256;" ::: "memory");
      else asm volatile("bar.arrive 2, 256;" ::: "memory");
    } else if (dq_handoff == 2 && c >= 128) {
      tile[c] = -1.0f;
      asm volatile("bar.sync 2, 128;" ::: "memory");
    }
    tile[c] = 2.0f * c + blockIdx.x;          // the staging store
  }
  if (c >= 0) asm volatile("bar.sync 3, %0;" :: "r"((int)blockDim.x - first_consumer) : "memory");
  if (active) out[blockIdx.x * 256 + c] = tile[(c + 64) % 256];  // another warp's value
}
"""


def run_variant(name: str) -> int:
    import cupy as cp

    threads, first, exits, handoff = VARIANTS[name]
    kernel = cp.RawKernel(SOURCE, "staged_exchange")
    blocks = 4
    out = cp.full(blocks * 256, -7.0, cp.float32)
    kernel((blocks,), (threads,), (out, cp.int32(first), cp.int32(int(exits)), cp.int32(handoff)))
    got = cp.asnumpy(out).reshape(blocks, 256)
    import numpy as np

    c = np.arange(256)
    want = 2.0 * ((c + 64) % 256)[None, :] + np.arange(blocks)[:, None]
    if not np.array_equal(got, want):
        print(f"{name}: wrong values: {got[0, :8]} ...", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS, help="run one variant here (the sanitizer runs this)")
    p.add_argument("--sanitizer", default=shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer")
    args = p.parse_args(argv)
    if args.variant:
        return run_variant(args.variant)
    worst = 0
    for name in VARIANTS:
        run = subprocess.run([args.sanitizer, "--tool", "racecheck", "--racecheck-report", "all", sys.executable,
                              __file__, "--variant", name], capture_output=True, text=True, timeout=300)
        summary = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)",
                            run.stdout + run.stderr)
        kinds = sorted(set(re.findall(r"(RAW|WAR|WAW) hazard", run.stdout + run.stderr)))
        print(f"{name:16} exit {run.returncode}: " + (f"{summary.group(1)} hazards ({summary.group(2)} errors, "
              f"{summary.group(3)} warnings) {' '.join(kinds)}" if summary else "no summary: "
              + (run.stdout + run.stderr)[-400:].replace("\n", " | ")))
        worst = max(worst, run.returncode)
    return worst


if __name__ == "__main__":
    sys.exit(main())
