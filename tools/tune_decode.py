"""Time the decode kernel's pipeline depth, tiles, split factor and merge side by side on one GPU.

    python tools/tune_decode.py [--stages 2 3 4 6] [--tiles 64,64,4 64,128,4] [--splits 0 8 16 32]
        [--merge fused launch] [--batch 1 2 8] [--cache 32768 131072] [--head-dim 64 128] [--page-size 0 16 64]

bf16, 32 query heads over 8 K/V heads, one query token (the shapes of `cuflash.bench --decode`), head dims 128
unless named. For each candidate of config.DECODE_STAGES[head dim] (the shipped count unless named), of
config.DECODE_TILES[head dim] (block_m, block_n, warps; the shipped tile unless named) and of the split merge
(`fused`: the last split of a row block merges, in the decode launch; `launch`: fwd_combine_kernel in a second
launch) the plan cache is cleared and every (batch, cache length, num_splits) is timed like the benchmark does it
(each call between its own two CUDA events, calls back to back, median), with the output compared to the first
candidate's (`diff`, so a wrong candidate shows up). A page size other than 0 reads the same K/V as a paged cache
of pages of that many rows, laid over the dense cache's memory and shuffled over all sequences (block_table a
random permutation). SDPA's fastest backend is timed on the dense data when torch is installed. Results go to
docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _compile, _families, _plan, bench, config  # noqa: E402

HQ, HKV = 32, 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", nargs="+", type=int, default=None,
                    help="K/V stage counts to try (default: the shipped count of each head dim)")
    ap.add_argument("--splits", nargs="+", type=int, default=[0, 8, 16, 32])
    ap.add_argument("--tiles", nargs="+", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                    metavar="BM,BN,WARPS", help="decode tiles to try (default: the shipped tile of each head dim)")
    ap.add_argument("--merge", nargs="+", choices=("fused", "launch"), default=["fused", "launch"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 2, 8])
    ap.add_argument("--cache", nargs="+", type=int, default=[32768, 131072])
    ap.add_argument("--head-dim", nargs="+", type=int, default=[128], choices=sorted(config.DECODE_TILES))
    ap.add_argument("--page-size", nargs="+", type=int, default=[0],
                    help="0: a dense cache; else a paged cache of pages of this many rows (a multiple of "
                         f"{config.DECODE_PAGE_MULTIPLE} that divides every --cache)")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    for page in args.page_size:
        if page and (page % config.DECODE_PAGE_MULTIPLE or any(n % page for n in args.cache)):
            ap.error(f"--page-size {page}: must be a multiple of {config.DECODE_PAGE_MULTIPLE} that divides every "
                     f"--cache ({args.cache})")
    try:
        import torch
    except ImportError:
        torch = None
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16, H_q {HQ}, H_kv {HKV}; "
          f"splits 0 (the heuristic) aims at {_families.decode_ctas_per_sm(0)} CTA(s) per SM (peak DRAM "
          f"{_families.dram_gbps(0)} GB/s over {_families._sm_count(0)} SMs)")
    shipped_stages, shipped_tiles = dict(config.DECODE_STAGES), dict(config.DECODE_TILES)
    try:
        for d in args.head_dim:
            for b in args.batch:
                for n in args.cache:
                    _time_shape(args, torch, d, b, n, shipped_stages[d], shipped_tiles[d])
    finally:
        config.DECODE_STAGES.update(shipped_stages)
        config.DECODE_TILES.update(shipped_tiles)
    return 0


def _paged(kc, vc, page, seed):
    """The dense caches (B, L, H_kv, D) as pages of `page` rows in a random order, and the block table."""
    b, n = kc.shape[:2]
    pages = b * n // page
    table = cp.asarray(cp.random.RandomState(seed).permutation(pages).reshape(b, n // page), dtype=cp.int32)
    return kc.reshape(pages, page, *kc.shape[2:]), vc.reshape(pages, page, *vc.shape[2:]), table


def _time_shape(args, torch, d, b, n, shipped_stages, shipped_tiles):
    """Every candidate at head dim d, batch b, cache length n; the shipped stages and tiles of d where none are named."""
    ev = bench.CupyEvents()
    sets = bench.decode_inputs(b, n, HQ, HKV, d, "bf16", 2, seed=n + b)
    kv_bytes = bench.decode_kv_bytes(b, n, HKV, d)
    line = f"D={d} B={b} L={n} ({kv_bytes / 1e6:.0f} MB):"
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
    for page in args.page_size:
        if page:
            paged = [(q, *_paged(kc, vc, page, seed=i), lens) for i, (q, kc, vc, lens) in enumerate(sets)]
        first = None
        for stages, tiles, merge in ((s, t, m) for s in args.stages or [shipped_stages]
                                     for t in args.tiles or [shipped_tiles]
                                     for m in args.merge):
            config.DECODE_STAGES[d] = stages
            config.DECODE_TILES[d] = tiles
            _families.DECODE_FUSED_MERGE = merge == "fused"
            _plan.plans.clear()
            _families._selected.clear()  # the kernel chosen per signature: reload it with these stages / tiles
            cfg = config.fwd_decode_config(d, "bf16", False)
            cache = f"{page}-row pages" if page else "dense"
            try:
                r = _compile.compile_kernel(cfg.cpp_name(), _compile.device_arch()).resources
            except RuntimeError as e:  # a candidate that does not fit (shared memory, registers): say so, go on
                why = next((ln.strip() for ln in str(e).splitlines() if "error" in ln), str(e).splitlines()[0])
                print(f"  {cache}, stages {stages}, tiles {tiles}, merge {merge}: does not compile: {why}", flush=True)
                continue
            row = [f"  {cache}, stages {stages}, tiles {tiles}, merge {merge} (regs {r['registers']}, "
                   f"spill {r['spill_stores']}):"]
            for ns in args.splits:
                def call(i, ns=ns):
                    if page:
                        q, kc, vc, table, lens = paged[i]
                        return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                              num_splits=ns, check_inputs=False)
                    q, kc, vc, lens = sets[i]
                    return cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=ns,
                                                          check_inputs=False)
                out = call(0).astype(cp.float32)
                first = out if first is None else first
                diff = float(cp.abs(out - first).max())
                ms = bench.median_ms(call, len(sets), ev, args.reps, 20)
                row.append(f"splits {ns}: {ms * 1e3:6.1f} us {kv_bytes / ms / 1e6:5.0f} GB/s diff {diff:.1e}")
            print("\n    ".join(row), flush=True)

if __name__ == "__main__":
    sys.exit(main())
