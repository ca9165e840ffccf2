"""Peak rate of each float64 / TF32 `mma.sync` shape on this GPU, and a check of the fragment layouts that
cuda/wide.cuh assumes for them: `python tools/mma_rates.py [--iters 4096]` (needs a GPU).

Rate: every warp of a full grid runs CHAINS independent accumulator chains of the one instruction in a loop (no
memory traffic), timed with CUDA events; TFLOP/s = 2 * M * N * K per instruction. Layout: one warp computes
D = A B from fragments built with the policy's index rules (A element i: row g + 8 (i & 1), column t + 4 (i >> 1);
B element i: row t + 4 i, column g; D: rows g, g + 8, columns 2t, 2t + 1) and the result is compared with NumPy.
"""
from __future__ import annotations

import argparse

import numpy as np

CHAINS = 8
# name: (ptx shape and types, M, N, K, element type, A registers, B registers, C registers, min arch)
SHAPES = {
    "f64 m8n8k4": ("m8n8k4.row.col.f64.f64.f64.f64", 8, 8, 4, "double", 1, 1, 2, 80),
    "f64 m16n8k4": ("m16n8k4.row.col.f64.f64.f64.f64", 16, 8, 4, "double", 2, 1, 4, 90),
    "f64 m16n8k8": ("m16n8k8.row.col.f64.f64.f64.f64", 16, 8, 8, "double", 4, 2, 4, 90),
    "f64 m16n8k16": ("m16n8k16.row.col.f64.f64.f64.f64", 16, 8, 16, "double", 8, 4, 4, 90),
    "tf32 m16n8k8": ("m16n8k8.row.col.f32.tf32.tf32.f32", 16, 8, 8, "float", 4, 2, 4, 80),
}


def _asm(ptx: str, etype: str, na: int, nb: int, nc: int, acc: str, a: str, b: str) -> str:
    """One inline-asm mma statement: acc[0..nc) += a[0..na) b[0..nb)."""
    c_con = "d" if etype == "double" else "f"
    ab_con = "d" if etype == "double" else "r"
    regs = ", ".join(f"%{i}" for i in range(nc))
    a_regs = ", ".join(f"%{nc + i}" for i in range(na))
    b_regs = ", ".join(f"%{nc + na + i}" for i in range(nb))
    outs = ", ".join(f'"+{c_con}"({acc}[{i}])' for i in range(nc))
    cast = "" if etype == "double" else "__float_as_uint"
    ins = ", ".join([f'"{ab_con}"({cast}({a}[{i}]))' for i in range(na)] + [f'"{ab_con}"({cast}({b}[{i}]))' for i in range(nb)])
    return f'asm volatile("mma.sync.aligned.{ptx} {{{regs}}}, {{{a_regs}}}, {{{b_regs}}}, {{{regs}}};\\n" : {outs} : {ins});'


def kernel_source(name: str) -> str:
    ptx, m, n, k, e, na, nb, nc, _ = SHAPES[name]
    mma = _asm(ptx, e, na, nb, nc, "c[j]", "a", "b")
    return f"""
extern "C" __global__ void rate(const {e}* in, {e}* out, int iters) {{
  {e} a[{na}], b[{nb}], c[{CHAINS}][{nc}];
  for (int i = 0; i < {na}; ++i) a[i] = in[(threadIdx.x + i) & 63];
  for (int i = 0; i < {nb}; ++i) b[i] = in[(threadIdx.x + 7 * i) & 63];
  for (int j = 0; j < {CHAINS}; ++j)
    for (int i = 0; i < {nc}; ++i) c[j][i] = 0;
  for (int it = 0; it < iters; ++it) {{
#pragma unroll
    for (int j = 0; j < {CHAINS}; ++j) {{ {mma} }}
  }}
  {e} s = 0;
  for (int j = 0; j < {CHAINS}; ++j)
    for (int i = 0; i < {nc}; ++i) s += c[j][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}}
// one warp: D = A B with A [M][K] and B [K][N] row-major in global memory, D [M][N] row-major
extern "C" __global__ void layout(const {e}* A, const {e}* B, {e}* D) {{
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  {e} a[{na}], b[{nb}], c[1][{nc}];
  for (int i = 0; i < {na}; ++i) a[i] = A[(g + 8 * (i & 1)) * {k} + t + 4 * (i >> 1)];
  for (int i = 0; i < {nb}; ++i) b[i] = B[(t + 4 * i) * {n} + g];
  for (int i = 0; i < {nc}; ++i) c[0][i] = 0;
  {{ const int j = 0; {mma} }}
  for (int i = 0; i < {nc}; ++i) D[(g + 8 * (i >> 1)) * {n} + 2 * t + (i & 1)] = c[0][i];
}}
"""


def main() -> int:
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=4096)
    args = ap.parse_args()
    dev = cp.cuda.Device()
    cc = int(dev.compute_capability)
    sms = dev.attributes["MultiProcessorCount"]
    name_gpu = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    arch = f"-arch=sm_{cc}{'a' if cc == 90 else ''}"
    print(f"{name_gpu}, {sms} SMs, {CHAINS} chains per warp, {args.iters} iterations")
    rng = np.random.default_rng(0)
    for name, (_, m, n, k, e, *_rest, min_cc) in SHAPES.items():
        if cc < min_cc:
            print(f"{name:14s} needs sm_{min_cc}")
            continue
        mod = cp.RawModule(code=kernel_source(name), options=(arch,))
        dt = np.float64 if e == "double" else np.float32
        a = rng.integers(-4, 5, (m, k)).astype(dt)  # small integers: exact in TF32 and in any summation order
        b = rng.integers(-4, 5, (k, n)).astype(dt)
        d = cp.full((m, n), np.nan, dt)
        mod.get_function("layout")((1,), (32,), (cp.asarray(a), cp.asarray(b), d))
        ok = np.array_equal(cp.asnumpy(d), a @ b)
        inp = cp.asarray(rng.standard_normal(64).astype(dt) * 1e-3)
        blocks, threads = sms * 8, 256
        out = cp.empty(blocks * threads, dt)
        f = mod.get_function("rate")
        f((blocks,), (threads,), (inp, out, np.int32(16)))
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(5):
            start.record()
            f((blocks,), (threads,), (inp, out, np.int32(args.iters)))
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
        flops = 2.0 * m * n * k * CHAINS * args.iters * blocks * threads / 32
        print(f"{name:14s} {flops / sorted(times)[2] / 1e12:7.1f} TFLOP/s  layout {'ok' if ok else 'WRONG'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
