"""Time the decode kernel's pipeline depth, tiles, split factor and merge side by side on one GPU.

    python tools/tune_decode.py [--stages 2 3 4 6] [--tiles 64,64,4 64,128,4] [--splits 0 8 16 32]
        [--merge fused launch] [--batch 1 2 8] [--cache 32768 131072]

bf16, D 128, 32 query heads over 8 K/V heads, one query token (the shapes of `cuflash.bench --decode`). For each
candidate of config.DECODE_STAGES, of config.DECODE_TILES[128] (block_m, block_n, warps) and of the split merge (`fused`: the last split of a row block merges, in the
decode launch; `launch`: fwd_combine_kernel in a second launch) the plan cache is cleared and every (batch, cache length, num_splits) is timed
like the benchmark does it (each call between its own two CUDA events, calls back to back, median), with the
output compared to the first candidate's (`diff`, so a wrong candidate shows up). SDPA's fastest backend is timed
on the same data when torch is installed. Results go to docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _compile, _families, _plan, bench, config  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", nargs="+", type=int, default=[config.DECODE_STAGES])
    ap.add_argument("--splits", nargs="+", type=int, default=[0, 8, 16, 32])
    ap.add_argument("--tiles", nargs="+", type=lambda t: tuple(int(x) for x in t.split(",")),
                    default=[config.DECODE_TILES[D]], metavar="BM,BN,WARPS")
    ap.add_argument("--merge", nargs="+", choices=("fused", "launch"), default=["fused", "launch"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 2, 8])
    ap.add_argument("--cache", nargs="+", type=int, default=[32768, 131072])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16, D {D}, H_q {HQ}, H_kv {HKV}; "
          f"splits 0 (the heuristic) aims at {_families.decode_ctas_per_sm(0)} CTA(s) per SM (peak DRAM "
          f"{_families.dram_gbps(0)} GB/s over {_families._sm_count(0)} SMs)")
    ev = bench.CupyEvents()
    for b in args.batch:
        for n in args.cache:
            sets = bench.decode_inputs(b, n, HQ, HKV, D, "bf16", 2, seed=n + b)
            kv_bytes = bench.decode_kv_bytes(b, n, HKV, D)
            first = None
            line = f"B={b} L={n} ({kv_bytes / 1e6:.0f} MB):"
            if torch is not None:
                import torch.nn.functional as F
                from torch.nn.attention import SDPBackend, sdpa_kernel
                cp.cuda.Device().synchronize()
                tsets = [tuple(bench.to_torch(x, torch).transpose(1, 2) for x in s[:3]) for s in sets]
                best = None
                for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
                    try:
                        with torch.no_grad(), sdpa_kernel(getattr(SDPBackend, name)):
                            ms = bench.median_ms(lambda i: F.scaled_dot_product_attention(*tsets[i], enable_gqa=True),
                                                 2, bench.TorchEvents(), args.reps, 20)
                    except Exception:  # noqa: BLE001 - a backend that cannot run the shape
                        continue
                    best = min(best or (ms, name), (ms, name))
                if best:
                    line += f" sdpa {best[0] * 1e3:.1f} us ({best[1].split('_')[0].lower()})"
            print(line, flush=True)
            for stages, tiles, merge in ((s, t, m) for s in args.stages for t in args.tiles for m in args.merge):
                config.DECODE_STAGES = stages
                config.DECODE_TILES[D] = tiles
                _families.DECODE_FUSED_MERGE = merge == "fused"
                _plan.plans.clear()
                _families._selected.clear()  # the kernel chosen per signature: reload it with these stages / tiles
                cfg = config.fwd_decode_config(D, "bf16", False)
                r = _compile.compile_kernel(cfg.cpp_name(), _compile.device_arch()).resources
                row = [f"  stages {stages}, tiles {tiles}, merge {merge} (regs {r['registers']}, spill {r['spill_stores']}):"]
                for ns in args.splits:
                    def call(i, ns=ns):
                        q, kc, vc, lens = sets[i]
                        return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=ns,
                                                              check_inputs=False)
                    out = call(0).astype(cp.float32)
                    first = out if first is None else first
                    diff = float(cp.abs(out - first).max())
                    ms = bench.median_ms(call, len(sets), ev, args.reps, 20)
                    row.append(f"splits {ns}: {ms * 1e3:6.1f} us {kv_bytes / ms / 1e6:5.0f} GB/s diff {diff:.1e}")
                print("\n    ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
