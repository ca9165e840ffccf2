"""Check on a Hopper GPU that the wgmma descriptors of cuda/tiles.cuh match the kernels' shared-memory layouts.

    python tools/check_wgmma_layouts.py

Each case is one warpgroup computing D = A B (m64nNk16 steps over K) with A and B stored in SmemTile layouts
the way the attention kernels store them (K-major Q/K tiles, N-major V/dO tiles, the M-major dS^T tile,
128- and 64-byte panels, a column offset at a panel boundary and one inside a 64-byte panel), compared with a
float64 NumPy product.
It isolates descriptor or swizzle mistakes from the rest of a kernel: if an attention test fails, run
this first. Needs CuPy, NVRTC and an sm_90 GPU.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SOURCE = r"""
#include "ptx.cuh"
#include "ptx_wgmma.cuh"
#include "tiles.cuh"
namespace cuflash {
// A: K_MAJOR_A ? [M=64][K] tile (rows m) : [K][MN_COLS_A] tile (rows k, columns m from column A_COL0);
// B: K_MAJOR_B ? [N][K] tile : [K][MN_COLS_B] tile (columns n from B_COL0). RS: A from registers.
template <int N, int K, bool K_MAJOR_A, bool K_MAJOR_B, bool RS, int MN_COLS_A, int A_COL0, int MN_COLS_B,
          int B_COL0, int PANEL_A, int PANEL_B>
__global__ void __launch_bounds__(128) wgmma_layout_test(const u16* a, const u16* b, float* d) {
  using TileA = SmemTile<K_MAJOR_A ? 64 : K, K_MAJOR_A ? K : MN_COLS_A, PANEL_A>;
  using TileB = SmemTile<K_MAJOR_B ? N : K, K_MAJOR_B ? K : MN_COLS_B, PANEL_B>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const u32 a_smem = base, b_smem = base + ((TileA::BYTES + 1023) / 1024) * 1024;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  // a: row-major [64][K] (m, k); b: row-major [K][N] (k, n)
  for (int i = tid; i < 64 * K; i += 128) {
    const int m = i / K, k = i % K;
    const u32 off = K_MAJOR_A ? TileA::offset(m, k) : TileA::offset(k, A_COL0 + m);
    *reinterpret_cast<u16*>(smem + (a_smem - base) + off) = a[i];
  }
  for (int i = tid; i < K * N; i += 128) {
    const int k = i / N, n = i % N;
    const u32 off = K_MAJOR_B ? TileB::offset(n, k) : TileB::offset(k, B_COL0 + n);
    *reinterpret_cast<u16*>(smem + (b_smem - base) + off) = b[i];
  }
  fence_proxy_async_shared();
  __syncthreads();
  float acc[N / 8][4];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const u64 desc_b = K_MAJOR_B ? TileB::desc_k_major(b_smem, 0, kk * 16) : TileB::desc_mn_major(b_smem, kk * 16, B_COL0);
    if constexpr (RS) {
      u32 a_regs[4];
      const int r = warp * 16 + g;
      auto pair = [&](int row, int col) { return static_cast<u32>(a[row * K + col]) | (static_cast<u32>(a[row * K + col + 1]) << 16); };
      a_regs[0] = pair(r, kk * 16 + 2 * t);
      a_regs[1] = pair(r + 8, kk * 16 + 2 * t);
      a_regs[2] = pair(r, kk * 16 + 8 + 2 * t);
      a_regs[3] = pair(r + 8, kk * 16 + 8 + 2 * t);
      Wgmma<N, bf16>::template rs<K_MAJOR_B ? 0 : 1>(acc, a_regs, desc_b, kk > 0);
    } else {
      const u64 desc_a = K_MAJOR_A ? TileA::desc_k_major(a_smem, 0, kk * 16) : TileA::desc_mn_major(a_smem, kk * 16, A_COL0);
      Wgmma<N, bf16>::template ss<K_MAJOR_A ? 0 : 1, K_MAJOR_B ? 0 : 1>(acc, desc_a, desc_b, kk > 0);
    }
  }
  wgmma_commit_group();
  wgmma_wait_group<0>();
  wgmma_fence_operand(acc);
  for (int j = 0; j < N / 8; ++j)
    for (int c = 0; c < 4; ++c) d[(warp * 16 + g + (c >> 1) * 8) * N + j * 8 + 2 * t + (c & 1)] = acc[j][c];
}
}  // namespace cuflash
"""

# (label, N, K, K_MAJOR_A, K_MAJOR_B, RS, MN_COLS_A, A_COL0, MN_COLS_B, B_COL0, PANEL_A, PANEL_B)
CASES = [
    ("S = Q K^T, d128 (K-major x K-major, 128B)", 128, 128, True, True, False, 0, 0, 0, 0, 0, 0),
    ("S = Q K^T, d96 (K-major x K-major, 64B panels)", 128, 96, True, True, False, 0, 0, 0, 0, 0, 0),
    ("S^T = K Q^T, d64 32-col panels (bwd)", 64, 64, True, True, False, 0, 0, 0, 0, 32, 32),
    ("O += P V, d128 (regs x N-major, 2 panels)", 128, 64, True, False, True, 0, 0, 128, 0, 0, 0),
    ("O += P V, d96 (regs x N-major, 3 64B panels)", 96, 128, True, False, True, 0, 0, 96, 0, 0, 0),
    ("O += P V, d256 (regs x N-major, 4 panels)", 256, 64, True, False, True, 0, 0, 256, 0, 0, 0),
    ("dQ = dS K, d128 half 1 (M-major x N-major, col 64)", 64, 128, False, False, False, 64, 0, 128, 64, 0, 0),
    ("dQ = dS K, d64 half 1 (M-major x N-major 32-col panels, col 32)", 32, 128, False, False, False, 64, 0, 64, 32, 0, 32),
    ("S^T = K Q^T, d32 (K-major x K-major, one 32-col panel)", 64, 32, True, True, False, 0, 0, 0, 0, 32, 32),
    ("dV += P^T dO, d32 (regs x N-major, one 32-col panel)", 32, 64, True, False, True, 0, 0, 32, 0, 0, 32),
    ("dQ = dS K, d32 half 1 (M-major x N-major, col 16 inside the panel)", 16, 128, False, False, False, 64, 0, 32, 16,
     0, 32),
]


def compile_case(case):
    """(lowered name, cubin) of one case, or raise RuntimeError with NVRTC's log."""
    from cupy_backends.cuda.libs import nvrtc

    from cuflash import _compile

    _, n, k, ka, kb, rs, mca, a0, mcb, b0, pa, pb = case
    name = (f"cuflash::wgmma_layout_test<{n}, {k}, {str(ka).lower()}, {str(kb).lower()}, {str(rs).lower()}, "
            f"{mca}, {a0}, {mcb}, {b0}, {pa}, {pb}>")
    prog = nvrtc.createProgram(SOURCE, "wgmma_layout_test.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, list(_compile.BASE_OPTIONS) + ["-arch=sm_90a", f"-I{_compile.cuda_dir()}"])
        except nvrtc.NVRTCError:
            raise RuntimeError(nvrtc.getProgramLog(prog)) from None
        return name, nvrtc.getLoweredName(prog, name), bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


def main() -> int:
    if "--compile-only" in sys.argv:  # no GPU needed
        for case in CASES:
            compile_case(case)
            print(f"compiled: {case[0]}")
        return 0
    import cupy as cp
    import ml_dtypes

    from cuflash import _compile, _launch

    arch = _compile.device_arch()
    if arch != "sm_90a":
        print(f"this check needs an sm_90 GPU (wgmma); this one is {arch}")
        return 2
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    failures = 0
    for label, n, k, ka, kb, rs, mca, a0, mcb, b0, pa, pb in CASES:
        try:
            name, lowered, cubin = compile_case((label, n, k, ka, kb, rs, mca, a0, mcb, b0, pa, pb))
        except RuntimeError as e:
            print(f"{label}: compile error\n{e}")
            failures += 1
            continue
        compiled = _compile.Compiled(name, lowered, arch, cubin, "")
        kernel = _launch._Kernel(compiled, 128, 96 * 1024)
        a = rng.standard_normal((64, k)).astype(bf16)
        b = rng.standard_normal((k, n)).astype(bf16)
        a_d, b_d = cp.asarray(a.view(np.uint16)), cp.asarray(b.view(np.uint16))
        d_d = cp.full((64, n), cp.nan, dtype=cp.float32)
        kernel.function((1, 1, 1), (128, 1, 1), (a_d, b_d, d_d), shared_mem=96 * 1024)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        err = float(np.abs(cp.asnumpy(d_d) - ref).max())
        ok = err < 1e-2 * max(1.0, float(np.abs(ref).max()))
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}: max|err| = {err:.2e}")
    print(f"{len(CASES) - failures}/{len(CASES)} layouts correct")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
