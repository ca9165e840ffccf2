// softmax.cuh: the online softmax of FlashAttention-2 on mma accumulators.
//
// Scores are kept in log2 units: x = S * scale_log2 with scale_log2 = softmax_scale * log2(e), so
// exp(S*scale - m) = exp2(x - m2) and one FFMA + EX2 per element suffices. Each thread holds two rows
// per m16 tile (g and g+8); the 4 threads of a quad share a row, so row reductions are two shuffles.
#pragma once
#include "ptx.cuh"
#include "traits.cuh"

namespace cuflash {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int M_TILES, int N_TILES, int D_TILES>
struct OnlineSoftmax {
  float row_max[M_TILES][2];  // m: running max of x over the keys seen, log2 units (-inf: none yet)
  float row_sum[M_TILES][2];  // l: this thread's share of sum exp2(x - m); the quad sum is taken once, at the end

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[mt][h] = neg_inf();
        row_sum[mt][h] = 0.f;
      }
  }

  // One key tile: m_new = max(m, rowmax(x)); O *= exp2(m - m_new); l = l * exp2(m - m_new) + rowsum(P);
  // S is overwritten by P = exp2(x - m_new).
  __device__ __forceinline__ void update(float (&s)[M_TILES][N_TILES][4], float (&o)[M_TILES][D_TILES][4],
                                         float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float tile_max = neg_inf();
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt) tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        const float m_new = fmaxf(row_max[mt][h], quad_max(tile_max) * scale_log2);
        // fully masked row so far: m_new == -inf; use 0 as the max so exp2(-inf - 0) = 0, not NaN
        const float m_use = (m_new == neg_inf()) ? 0.f : m_new;
        const float alpha = ex2_approx(row_max[mt][h] - m_use);  // exp2(-inf) = 0 on the first visible tile
        row_max[mt][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
          for (int c = 2 * h; c < 2 * h + 2; ++c) {
            s[mt][nt][c] = ex2_approx(fmaf(s[mt][nt][c], scale_log2, -m_use));
            sum += s[mt][nt][c];
          }
        row_sum[mt][h] = row_sum[mt][h] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt) {
          o[mt][dt][2 * h] *= alpha;
          o[mt][dt][2 * h + 1] *= alpha;
        }
      }
  }

  // O /= l; lse = (m + log2 l) * ln 2. A row that saw no key (l == 0) gives O = 0 and lse = -inf.
  __device__ __forceinline__ void finalize(float (&o)[M_TILES][D_TILES][4], float (&lse)[M_TILES][2]) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float l = quad_sum(row_sum[mt][h]);
        // (l == 0, not l > 0: a NaN from the inputs must propagate, not turn into a masked row)
        const float inv_l = (l == 0.f) ? 0.f : 1.f / l;
        lse[mt][h] = (l == 0.f) ? neg_inf() : (row_max[mt][h] + __log2f(l)) * LN2;
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt) {
          o[mt][dt][2 * h] *= inv_l;
          o[mt][dt][2 * h + 1] *= inv_l;
        }
      }
  }
};

}  // namespace cuflash
