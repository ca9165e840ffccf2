"""Time candidate tile configs side by side on one GPU: `python tools/tune_tiles.py [--n N] [--heads-dims 64 128]`.

For each kernel head dim, the shipped config (first) and its candidates replace the config table entry,
are compiled (registers and spills from ptxas) and timed with CUDA events, bf16, FlashAttention benchmark
shapes (batch = 16384 / N, heads = 2048 / D). `diff` is the largest difference to the first candidate's
output, so a wrong candidate shows up. On sm_90a the wgmma kernels are tuned (FWD_SM90_WS_TILES, else
FWD_SM90_TILES; BWD_SM90_TILES), elsewhere the mma.sync ones (FWD_TILES, BWD_TILES). `--dtype fp32` / `tf32`
tunes the float32 Hopper kernels instead (FWD_SM90_TF32_TILES, and unless --no-backward BWD_SM90_TF32_TILES and
BWD_DQ_SM90_TF32_TILES, the backward timed whole; float32 inputs, precision "fp32" or "tf32"). `--dtype fp8` tunes the
FP8 forward (the table a call takes: config.fwd_sm90_fp8_table) on block-scaled e4m3 inputs.
`--mods blocks|kpm|mask|bias|bias-kpm` times the forward of a call with a mask or a bias instead, on the
warp-specialized forward's table for the call's modifier bits (MODS_KINDS: a BlockMask, a key padding mask, an
element mask, a bias, a bias beside a key padding mask).
`--rounds R` times every candidate R times, every other round in reverse order, and ends with each candidate's
TFLOP/s over the shipped tiles' of the same round (a single pass favours whichever is timed first).
Results go to docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _compile, _families, _plan, bench, config  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)

# wgmma kernels (sm_90a): forward (block_m, block_n, ctas_per_sm), backward (block_m, block_n, ctas_per_sm)
FWD_SM90 = {32: [(192, 128, 1), (192, 64, 1)],
            64: [(192, 128, 1), (128, 128, 1), (192, 64, 1)],
            96: [(192, 64, 1)],
            128: [(128, 64, 1), (192, 64, 1)],
            192: [(128, 32, 1)],
            256: [(128, 64, 1), (128, 32, 1)]}
BWD_SM90 = {64: [(64, 64, 2)], 128: []}
# the warp-specialized forward (sm_90a): (block_n, stages, pingpong[, persistent[, block_m]]); block_m 192: three
# consumer warpgroups (no pingpong, head dims up to 64)
FWD_SM90_WS = {32: [(192, 2, False), (256, 2, False), (128, 2, False), (256, 2, True, True), (128, 2, True, True),
                    (128, 2, False, True), (256, 3, True, True), (64, 2, False, True), (64, 2, True, True)],
               64: [(128, 2, False), (128, 2, True), (128, 3, False), (192, 2, False), (192, 2, True), (192, 3, False),
                    (192, 3, True), (256, 2, False), (256, 2, True), (128, 2, True, True), (128, 2, False, True),
                    (192, 2, False, True), (64, 2, False, True), (64, 3, False, True), (64, 3, True, True),
                    (128, 2, False, False, 192), (128, 3, False, False, 192), (96, 2, False, False, 192),
                    (192, 2, False, False), (128, 2, False, True, 192), (128, 3, False, True, 192),
                    (64, 2, True, True)],
               128: [(128, 2, False), (128, 2, True), (128, 3, False), (128, 3, True), (192, 2, False),
                     (192, 2, True), (128, 2, False, True), (128, 2, True, True), (128, 3, False, True),
                     (192, 2, False, True), (64, 2, True, True), (64, 3, True, True), (64, 3, False, True),
                     (64, 4, True, True), (176, 2, False), (176, 2, True), (160, 2, False), (160, 2, False, True),
                     (160, 2, True, True), (176, 2, False, True)],
               96: [(128, 2, False, True), (128, 2, True, True), (128, 2, True), (128, 2, False), (128, 3, False),
                    (192, 2, False)],
               192: [(64, 2, False), (64, 3, False), (96, 2, False), (64, 2, True), (96, 2, True), (48, 3, False),
                     (64, 2, False, True), (64, 2, True, True), (96, 2, False, True), (96, 2, True, True),
                     (64, 3, False, True), (112, 2, True), (112, 2, False)],
               256: [(64, 2, False), (64, 2, True), (48, 3, False), (64, 2, False, True), (64, 2, True, True),
                     (48, 2, False, True), (48, 3, False, True), (48, 2, True, True), (80, 2, False), (80, 2, True)]}
# mma.sync kernels (sm_80..sm_89, or CUFLASH_KERNELS=mma): forward (block_m, block_n, warps), backward
# (block_m, block_n, warps, d_split)
FWD_MMA = {64: [(128, 128, 8), (64, 64, 4)], 128: [(128, 128, 8), (128, 64, 8)]}
# the float32 Hopper forward (sm_90a): (block_n, stages, consumers, pingpong[, q_regs]), the alternatives measured
# against the shipped tiles (config.FWD_SM90_TF32_TILES)
FWD_SM90_TF32 = {"fp32": {32: [(64, 2, 2, True), (32, 3, 2, True), (64, 4, 2, True), (64, 3, 2, False),
                               (64, 3, 3, False), (64, 2, 3, False)],
                          64: [(64, 2, 2, False), (32, 3, 2, True), (32, 3, 3, False), (64, 2, 2, True, True)],
                          128: [(32, 2, 2, True), (16, 4, 2, True), (32, 3, 2, True, True)]},
                 "tf32": {32: [(64, 2, 2, True), (32, 4, 2, True), (64, 4, 2, True), (64, 3, 3, False),
                               (64, 2, 3, False), (64, 2, 3, False, True)],
                          64: [(64, 2, 2, True), (32, 4, 2, True), (64, 3, 3, False), (64, 2, 3, False),
                               (32, 3, 3, False), (64, 3, 2, True, True)],
                          128: [(32, 2, 2, True), (64, 2, 1, False), (32, 3, 2, True, True)]}}
# the float32 Hopper backward (sm_90a): the dK / dV kernel's (block_m, stages) and the dQ kernel's (block_n, stages,
# consumers[, a_regs]), each tuned with the other's shipped tiles
# (head dim 128: the cluster pairs, whose exchange slots leave 3xTF32 one dK / dV tile, (16, 2))
# (a third element: consumer warpgroups of 64 keys, 2 by default)
# (block_m, stages[, consumers[, k_reg_steps]]): k_reg_steps, 3xTF32's first k8 steps of S^T with K's big part in
# registers (BwdSm90Tf32Config.k_reg_steps)
BWD_SM90_TF32 = {"fp32": {32: [(32, 2), (16, 3), (16, 2), (16, 4), (32, 3, 3), (16, 3, 3)],
                          64: [(16, 2), (16, 3, 2, 2), (16, 3, 2, 3), (16, 3, 2, 4)],
                          128: [(16, 2, 2, 2), (16, 2, 2, 4)]},
                 "tf32": {32: [(16, 3), (32, 2), (32, 4), (32, 3, 3), (32, 2, 3)], 64: [(32, 2), (16, 3)],
                          128: [(32, 2), (16, 3)]}}
BWD_DQ_SM90_TF32 = {"fp32": {32: [(32, 2, 2), (32, 3, 2), (64, 3, 2), (64, 2, 1), (32, 3, 3), (64, 2, 2, 1),
                                  (64, 2, 2, 2)],
                             64: [(16, 3, 2), (16, 3, 2, 1), (16, 4, 2, 1), (32, 2, 1, 2), (32, 3, 1, 2)],
                             128: [(32, 2, 1), (16, 3, 1), (16, 2, 2, 1), (16, 2, 2, 2)]},
                    "tf32": {32: [(64, 3, 2), (32, 2, 2), (64, 4, 2), (64, 3, 3), (64, 3, 3, 1), (64, 3, 2, 2),
                                  (64, 2, 2, 2)],
                             64: [(64, 3, 2), (32, 3, 2), (32, 3, 3), (64, 2, 2), (32, 3, 2, 1)],
                             128: [(32, 3, 2), (64, 2, 1), (16, 3, 2), (32, 3, 2, 1), (32, 3, 2, 2)]}}
BWD_MMA = {64: [(32, 64, 4, 1)], 128: [(64, 64, 8, 2), (32, 64, 4, 1)]}
# the FP8 forward (sm_90a): (block_n, stages, pingpong, q_in_regs, late_pack, consumers[, persistent]), the alternatives
# measured against the table a call takes (config.fwd_sm90_fp8_table: the banded tiles for causal rows and windows,
# the short ones for non-causal rows of up to FWD_SM90_FP8_SHORT_KEYS keys, else FWD_SM90_FP8_TILES)
FWD_SM90_FP8 = {64: [(128, 2, True, True, True, 2), (128, 3, False, False, True, 3), (128, 2, False, False, True, 3, True),
                     (128, 2, True, True, True, 2, True), (128, 2, False, False, True, 3),
                     (128, 2, False, False, True, 2, True)],
                128: [(128, 2, False, False, False, 2), (128, 3, True, False, False, 2), (128, 2, True, False, False, 2, True),
                      (128, 2, False, False, True, 2, True), (128, 3, True, False, False, 2, True),
                      (64, 3, False, False, False, 3), (64, 4, False, False, True, 3), (128, 2, True, False, False, 2)],
                256: [(64, 4, True, False, False, 2), (128, 2, False, False, True, 2), (128, 2, True, False, False, 2)]}


def rand(shape, dtype: str = "bf16"):
    x = cp.random.standard_normal(shape, dtype=cp.float32)
    return x if dtype in ("fp32", "tf32") else x.astype(BF16)


# --mods: the forward of a call with a bias or a mask, timed on the warp-specialized forward's table for the call's
# modifier bits (config.fwd_sm90_ws_table with them): "blocks" a BlockMask keeping a random 10 % of the 128 x 128
# blocks (MOD_BLOCKS: the tile map alone), "kpm" a key_padding_mask by which every other sequence keeps the first half
# of its keys, "mask" an element mask of random 64 x 64 blocks, half of them kept (the mask kernels, MOD_MASK, their
# map with partial tiles), "bias" a (1, H, N, N) bias, "bias-kpm" the bias beside a key padding mask keeping the first
# 70-100 % of each row's keys (MOD_BIAS | MOD_MASK: the Evoformer's pair bias and MSA mask)
MODS_KINDS = {"blocks": config.MOD_BLOCKS, "kpm": config.MOD_MASK, "mask": config.MOD_MASK, "bias": config.MOD_BIAS,
              "bias-kpm": config.MOD_BIAS | config.MOD_MASK}


def mods_kwargs(kind: str, b: int, n: int, h: int, seed: int = 0) -> dict:
    """The call's keyword arguments for --mods `kind` (see MODS_KINDS), on (b, n, h, d) inputs."""
    rng = np.random.default_rng(seed)
    if kind == "blocks":
        blocks = rng.random((-(-n // 128), -(-n // 128))) < 0.1
        return {"mask": cuflash.BlockMask(cp.asarray(np.repeat(np.repeat(blocks, 128, 0), 128, 1)[:n, :n]))}
    if kind == "kpm":
        kept = np.full((b, 1), n)
        kept[1::2] = max(128, n // 2 // 128 * 128)
        return {"key_padding_mask": cp.asarray(np.arange(n)[None, :] < kept)}
    if kind == "mask":
        blocks = rng.random((-(-n // 64), -(-n // 64))) < 0.5
        return {"mask": cp.asarray(np.repeat(np.repeat(blocks, 64, 0), 64, 1)[:n, :n])}
    if kind == "bias":
        return {"bias": rand((1, h, n, n))}
    if kind == "bias-kpm":
        kept = np.clip(np.ceil(rng.uniform(0.7, 1.0, b) * n), 1, n).astype(np.int64)
        return {"bias": rand((1, h, n, n)), "key_padding_mask": cp.asarray(np.arange(n)[None, :] < kept[:, None])}
    raise ValueError(f"--mods {kind!r}: one of {', '.join(MODS_KINDS)}")


def bench_ms(fn, reps=15):
    """Median GPU time of fn() between CUDA events, the calls queued behind a hold kernel (cuflash.bench.median_ms),
    so the host's launch cost does not fall between the events."""
    return bench.median_ms(lambda i: fn(), 1, bench.CupyEvents(), reps, 2)


def resources(cfg, arch):
    r = _compile.compile_kernel(cfg.cpp_name(), arch).resources
    return f"regs={r['registers']} spill={r['spill_stores']}/{r['spill_loads']}"


ONLY = None  # --only: a compiled regex on str(candidate)
ROUNDS = 1  # --rounds


def tune(table: dict, candidates: list, d: int, kind: str, run, arch: str, make_cfg):
    """Time table[d] = each candidate (shipped first), restore the table, print one row each. With --rounds R the
    candidates are timed R times, every other round in reverse order (the shipped tiles last), so that a variant is not
    always the first one timed after the inputs were made (which tends to read fastest)."""
    shipped = table[d]
    if ONLY is not None:
        candidates = [c for c in candidates if ONLY.search(str(c))]
    order = list(dict.fromkeys([shipped] + candidates))
    ref = None
    rates = {cand: [] for cand in order}  # TFLOP/s per round (None: an error)
    for r in range(ROUNDS):
        if ROUNDS > 1:
            print(f"  round {r + 1} of {ROUNDS}", flush=True)
        for cand in order if r % 2 == 0 else order[::-1]:
            table[d] = cand
            _families._selected.clear()
            _plan.plans.clear()  # plans hold the kernel of the old tile choice
            try:
                res = resources(make_cfg(), arch)
                ms, out = run()
                outs = [x.astype(cp.float32) for x in out]
                ref = outs if ref is None else ref  # the shipped tiles' output (the first timed in round 1)
                diff = max(float(cp.abs(x - y).max()) for x, y in zip(outs, ref))
                print(f"  {kind} tiles={cand}{' (shipped)' if cand == shipped else ''}: {ms[1]:.0f} TFLOP/s "
                      f"({ms[0]:.3f} ms) {res} diff={diff:.1e}", flush=True)
                rates[cand].append(ms[1])
            except Exception as ex:  # noqa: BLE001 - a candidate that does not compile or run is reported
                print(f"  {kind} tiles={cand}: ERROR {str(ex).strip().splitlines()[0][:200]}", flush=True)
                rates[cand].append(None)
    if ROUNDS > 1:  # each candidate against the shipped tiles timed in the same round
        for cand in order[1:]:
            ratios = [c / s for c, s in zip(rates[cand], rates[shipped]) if c is not None and s]
            if ratios:
                print(f"  {kind} tiles={cand} / shipped: {min(ratios):.2f}-{max(ratios):.2f}x "
                      f"({' '.join(f'{x:.2f}' for x in ratios)})", flush=True)
    table[d] = shipped
    _families._selected.clear()
    _plan.plans.clear()


def tune_float32(args, arch: str, wgmma: bool) -> int:
    """--dtype fp32 / tf32: the float32 Hopper forward's tiles (config.FWD_SM90_TF32_TILES) and, unless --no-backward,
    the backward's (config.BWD_SM90_TF32_TILES, BWD_DQ_SM90_TF32_TILES) where it has them."""
    table = config.FWD_SM90_TF32_TILES[args.dtype]
    kw = {"precision": args.dtype}
    for d in args.head_dims:
        if not wgmma or d not in table:
            print(f"D={d}: no float32 Hopper forward tiles on {arch} (fwd_wide_kernel runs it)")
            continue
        for causal in {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]:
            for n in args.n:
                b, h = 16384 // n, 2048 // d
                q, k, v = (rand((b, n, h, d), args.dtype) for _ in range(3))
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                print(f"D={d} causal={causal} N={n} (B={b}, H={h}) {args.dtype}", flush=True)

                def fwd():
                    ms = bench_ms(lambda: cuflash.attention_forward(q, k, v, causal=causal, **kw))
                    return (ms, flops / ms / 1e9), cuflash.attention_forward(q, k, v, causal=causal, **kw)

                tune(table, FWD_SM90_TF32[args.dtype].get(d, []), d, f"fwd {args.dtype}", fwd, arch,
                     lambda: config.fwd_sm90_tf32_config(d, args.dtype, causal))
                if not args.no_backward and d in config.BWD_SM90_TF32_TILES[args.dtype]:
                    do = rand((b, n, h, d), args.dtype)
                    o, lse = cuflash.attention_forward(q, k, v, causal=causal, **kw)

                    def bwd():
                        ms = bench_ms(lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, **kw))
                        return (ms, 2.5 * flops / ms / 1e9), cuflash.attention_backward(do, q, k, v, o, lse,
                                                                                         causal=causal, **kw)

                    main_cfg = lambda: config.bwd_sm90_tf32_config(d, args.dtype, causal)  # noqa: E731
                    tune(config.BWD_SM90_TF32_TILES[args.dtype], BWD_SM90_TF32[args.dtype].get(d, []), d,
                         f"bwd dk/dv {args.dtype}", bwd, arch, main_cfg)
                    tune(config.BWD_DQ_SM90_TF32_TILES[args.dtype], BWD_DQ_SM90_TF32[args.dtype].get(d, []), d,
                         f"bwd dq {args.dtype}", bwd, arch, lambda: main_cfg().dq_config())
                    del do, o, lse
                del q, k, v
                cp.get_default_memory_pool().free_all_blocks()
    return 0


def tune_fp8(args, arch: str, wgmma: bool) -> int:
    """--dtype fp8: the FP8 forward's tiles (config.fwd_sm90_fp8_table) on inputs quantized with 128-row block scaling
    (cuflash.fp8.quantize), as `python -m cuflash.bench --fp8` times them; `diff` against the shipped tiles' output."""
    if not wgmma:
        print(f"--dtype fp8: the FP8 forward is a Hopper (sm_90a) kernel, not on {arch}")
        return 1
    from cuflash import fp8

    for d in args.head_dims:
        if d not in config.FWD_SM90_FP8_TILES:
            print(f"D={d}: no FP8 forward (head dims {', '.join(map(str, config.FWD_SM90_FP8_TILES))})")
            continue
        for causal in {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]:
            for n in args.n:
                b, h = max(1, 16384 // n), 2048 // d
                q8, qd, k8, kd, v8, vd = (y for _ in range(3)
                                          for y in fp8.quantize(rand((b, n, h, d)), scaling="block"))
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                print(f"D={d} causal={causal} N={n} (B={b}, H={h}) fp8", flush=True)

                def call():
                    return cuflash.attention_forward(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                                     v_descale=vd)

                def fwd():
                    ms = bench_ms(call)
                    return (ms, flops / ms / 1e9), call()

                tune(config.fwd_sm90_fp8_table(d, causal, seqlen_k=n), FWD_SM90_FP8.get(d, []), d, "fwd fp8", fwd, arch,
                     lambda: config.fwd_sm90_fp8_config(d, "bf16", causal, seqlen_k=n))
                del q8, qd, k8, kd, v8, vd
                cp.get_default_memory_pool().free_all_blocks()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[8192])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[32, 64, 96, 128, 192, 256])
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    ap.add_argument("--only", default=None, help="regex on the candidate tuple: time only the shipped tiles and these")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the candidates this many times, every other round in reverse order (default 1)")
    ap.add_argument("--no-backward", action="store_true", help="tune the forward only")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "tf32", "fp8"), default="bf16",
                    help="fp32 / tf32: the float32 Hopper kernels; fp8: the FP8 forward (sm_90a)")
    ap.add_argument("--mods", choices=tuple(MODS_KINDS), default=None,
                    help="time the forward with a bias or mask on the table its modifiers take (sm_90a, bf16; forward "
                         "only; TFLOP/s count the dense work): blocks, kpm, mask, bias or bias-kpm (MODS_KINDS)")
    args = ap.parse_args()
    global ONLY, ROUNDS
    ONLY = re.compile(args.only) if args.only else None
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    ROUNDS = args.rounds
    arch = _compile.device_arch()
    wgmma = config.uses_wgmma(arch)
    print(f"arch {arch}, {'wgmma' if wgmma else 'mma.sync'} kernels")
    if args.dtype == "fp8":
        return tune_fp8(args, arch, wgmma)
    if args.dtype != "bf16":
        return tune_float32(args, arch, wgmma)
    if args.mods is not None and not wgmma:
        print(f"--mods tunes the warp-specialized forward's tables: not on {arch}")
        return 1
    for d in args.head_dims:
        for causal in {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]:
            for n in args.n:
                b, h = 16384 // n, 2048 // d
                q, k, v, do = (rand((b, n, h, d)) for _ in range(4))
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                kw = mods_kwargs(args.mods, b, n, h) if args.mods else {}
                mods = MODS_KINDS[args.mods] if args.mods else 0
                print(f"D={d} causal={causal} N={n} (B={b}, H={h}){' mods ' + args.mods if args.mods else ''}",
                      flush=True)

                def fwd():
                    ms = bench_ms(lambda: cuflash.attention_forward(q, k, v, causal=causal, **kw))
                    return (ms, flops / ms / 1e9), cuflash.attention_forward(q, k, v, causal=causal, **kw)

                # the backward's inputs (not with --mods: its backward is not tuned here)
                o, lse = cuflash.attention_forward(q, k, v, causal=causal) if not args.mods else (None, None)

                def bwd():
                    ms = bench_ms(lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal))
                    return (ms, 2.5 * flops / ms / 1e9), cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)

                if wgmma:
                    if d in config.FWD_SM90_WS_TILES:  # the table the call's config comes from
                        table = config.fwd_sm90_ws_table(d, causal, mods, seqlen_k=n)
                        tune(table, FWD_SM90_WS.get(d, []), d, "fwd ws", fwd, arch,
                             lambda: config.fwd_sm90_ws_config(d, "bf16", causal, mods, seqlen_k=n))
                    elif d in config.FWD_SM90_TILES and not args.mods:
                        tune(config.FWD_SM90_TILES, FWD_SM90.get(d, []), d, "fwd", fwd, arch,
                             lambda: config.fwd_sm90_config(d, "bf16", causal))
                    # (the backward's tables with modifiers are other ones: not tuned here)
                    if d in config.BWD_SM90_TILES and not args.no_backward and not args.mods:
                        tune(config.BWD_SM90_TILES, BWD_SM90.get(d, []), d, "bwd", bwd, arch,
                             lambda: config.bwd_sm90_config(d, "bf16", causal, False))
                else:
                    tune(config.FWD_TILES, FWD_MMA.get(d, []), d, "fwd", fwd, arch,
                         lambda: config.fwd_config(d, "bf16", causal, arch))
                    tune(config.BWD_TILES, BWD_MMA.get(d, []), d, "bwd", bwd, arch,
                         lambda: config.bwd_config(d, "bf16", causal, False))
                del q, k, v, do, o, lse
                cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
