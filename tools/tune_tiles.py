"""Time candidate tile configs (forward and backward) side by side on one GPU: `python tools/tune_tiles.py`.

Each candidate replaces the entry of cuflash.config.FWD_TILES / BWD_TILES for its head dim, is compiled
(registers and spills printed from ptxas) and timed with CUDA events; `diff` is the largest difference to
the first candidate's output (a wrong candidate shows up there). Results go to docs/PERFORMANCE.md."""
import sys
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
import numpy as np, cupy as cp, ml_dtypes
import cuflash
from cuflash import config, _compile

BF16 = np.dtype(ml_dtypes.bfloat16)
arch = _compile.device_arch()


def rand(shape, dt=BF16):
    return cp.random.standard_normal(shape, dtype=cp.float32).astype(dt)


def bench(fn, reps=15):
    for _ in range(2):
        fn()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e))
    return float(np.median(ts))


# The shipped choice first (the reference of `diff`), then the candidates it was chosen over.
SHIPPED = (dict(config.FWD_TILES), dict(config.FWD_TILES_CAUSAL), dict(config.BWD_TILES))
FWD = {64: [(128, 64, 4), (128, 128, 8), (128, 128, 4), (64, 64, 4), (128, 64, 8)],
       128: [(128, 32, 4), (128, 128, 8), (128, 64, 8), (128, 64, 4), (64, 64, 4)]}
BWD = {64: [config.BWD_TILES[64], (64, 64, 8, 2), (32, 64, 4, 1), (64, 128, 8, 1)],
       128: [config.BWD_TILES[128], (64, 64, 8, 2), (32, 64, 8, 2), (64, 32, 4, 2), (32, 64, 4, 1)]}


def res(cfg):
    r = _compile.compile_kernel(cfg.cpp_name(), arch).resources
    return f"regs={r['registers']} spill={r['spill_stores']}/{r['spill_loads']}"


for d in (64, 128):
    for causal in (False, True):
        for n in (4096, 16384):
            b, h = 16384 // n, 2048 // d
            q, k, v, do = (rand((b, n, h, d)) for _ in range(4))
            fl = 4 * b * h * n * n * d / (2 if causal else 1)
            o_ref, lse_ref = None, None
            shipped = config.fwd_config(d, "bf16", causal)
            for cand in dict.fromkeys([(shipped.block_m, shipped.block_n, shipped.num_warps)] + FWD[d]):
                config.FWD_TILES[d] = cand
                config.FWD_TILES_CAUSAL.pop(d, None)
                cfg = config.fwd_config(d, "bf16", causal)
                try:
                    t = bench(lambda: cuflash.attention_forward(q, k, v, causal=causal))
                    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
                    if o_ref is None:
                        o_ref = o.astype(cp.float32)
                    diff = float(cp.abs(o.astype(cp.float32) - o_ref).max())
                    print(f"FWD d={d} causal={causal} n={n} tiles={cand} {fl / t / 1e9:.0f} TFLOP/s {res(cfg)} diff={diff:.1e}", flush=True)
                except Exception as ex:
                    print(f"FWD d={d} causal={causal} n={n} tiles={cand} ERROR {str(ex)[:200]}", flush=True)
            config.FWD_TILES.update(SHIPPED[0])
            config.FWD_TILES_CAUSAL.update(SHIPPED[1])
            o, lse = cuflash.attention_forward(q, k, v, causal=causal)
            dq_ref = None
            for cand in BWD[d]:
                config.BWD_TILES[d] = cand
                cfg = config.bwd_config(d, "bf16", causal, False)
                try:
                    t = bench(lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal))
                    dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
                    if dq_ref is None:
                        dq_ref = [x.astype(cp.float32) for x in (dq, dk, dv)]
                    diff = max(float(cp.abs(x.astype(cp.float32) - r).max()) for x, r in zip((dq, dk, dv), dq_ref))
                    td = bench(lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=True))
                    print(f"BWD d={d} causal={causal} n={n} tiles={cand} {2.5 * fl / t / 1e9:.0f} TFLOP/s "
                          f"(deterministic {2.5 * fl / td / 1e9:.0f}) {res(cfg)} diff={diff:.1e}", flush=True)
                except Exception as ex:
                    print(f"BWD d={d} causal={causal} n={n} tiles={cand} ERROR {str(ex)[:200]}", flush=True)
            config.BWD_TILES.update(SHIPPED[2])
            print(flush=True)
