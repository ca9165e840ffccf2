"""Compile candidate tiles of the float32 / float64 kernels (cuda/wide.cuh) and print registers and spills; no GPU
needed: `python tools/wide_tiles.py [--arch sm_80 sm_90a] [--dtypes fp32 fp64] [--jobs 2]`.

For each (dtype, kernel head dim, causal, modifier set of the compile check) every candidate below is compiled with
ptxas -v; the shipped tables (cuflash/config.py FWD_WIDE_TILES*, BWD_WIDE_TILES*) take, per entry, a candidate that
is spill-free on every architecture, preferring larger tiles (fewer K/V re-reads per query row, fewer dQ atomics).
"""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuflash import _compile, config  # noqa: E402

# forward (block_m, block_n, warps); backward (block_m, block_n, warps, d_split)
FWD = {32: [(128, 64, 8), (128, 32, 8)], 64: [(128, 64, 8), (128, 32, 8), (64, 32, 4)],
       128: [(128, 64, 8), (128, 32, 8), (64, 64, 4), (128, 16, 8)], 256: [(64, 32, 4), (64, 16, 4), (64, 8, 4)]}
BWD = {32: [(32, 128, 8, 1), (32, 64, 8, 2), (16, 64, 4, 1)],
       64: [(32, 128, 8, 1), (16, 128, 8, 1), (32, 64, 8, 2), (16, 64, 4, 1)],
       128: [(32, 128, 8, 1), (16, 128, 8, 1), (32, 64, 8, 2), (16, 64, 8, 2), (16, 64, 4, 1)],
       256: [(16, 64, 8, 2), (16, 32, 8, 4), (16, 32, 4, 2)]}


def candidates(dtypes, head_dims=None, ops=("fwd", "bwd")):
    for dt in dtypes:
        for hd in config.WIDE_KERNEL_HEAD_DIMS[dt]:
            if head_dims and hd not in head_dims:
                continue
            for causal in (False, True):
                for mods in (0, *config.wide_mods_checked(dt, causal)):
                    for bm, bn, w in FWD[hd] if "fwd" in ops else ():
                        yield config.FwdWideConfig(hd, bm, bn, w, dt, causal, mods)
                    for bm, bn, w, s in BWD[hd] if "bwd" in ops else ():
                        cfg = config.BwdWideConfig(hd, bm, bn, w, s, dt, causal, mods)
                        if cfg.smem_bytes <= 227 * 1024:
                            yield cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["sm_80", "sm_90a"])
    ap.add_argument("--dtypes", nargs="+", default=list(config.WIDE_DTYPES))
    ap.add_argument("--head-dims", nargs="+", type=int, default=None)
    ap.add_argument("--ops", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    jobs = [(arch, cfg) for cfg in candidates(args.dtypes, args.head_dims, args.ops) for arch in args.arch]

    def one(job):
        arch, cfg = job
        try:
            return job, _compile.parse_ptxas_log(_compile.compile_kernel(cfg.cpp_name(), arch).log)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported, not fatal
            return job, {"error": str(e).splitlines()[0][:200]}

    with ThreadPoolExecutor(args.jobs) as ex:
        for (arch, cfg), r in ex.map(one, jobs):
            spill = r.get("spill_stores", 0) + r.get("spill_loads", 0) + r.get("stack", 0)
            flag = "SPILL" if spill else ("ERROR" if "error" in r else "ok")
            print(f"{flag:5} {arch:6} regs {r.get('registers')!s:>4} stack {r.get('stack', '-')!s:>4} "
                  f"smem {cfg.smem_bytes // 1024:3d}K {cfg.cpp_name()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
