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
__device__ __forceinline__ double quad_max(double x) {
  x = fmax(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmax(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ double quad_sum(double x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The arithmetic of the softmax in its accumulator type: fp32 (the MUFU approximations) or, in the float64
// kernels (wide.cuh), float64 (libdevice's correctly rounded-to-1-ulp exp2 and log2)
__device__ __forceinline__ float max_of(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_of(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float exp2_of(float x) { return ex2_approx(x); }
__device__ __forceinline__ double exp2_of(double x) { return exp2(x); }
__device__ __forceinline__ float log2_of(float x) { return __log2f(x); }
__device__ __forceinline__ double log2_of(double x) { return log2(x); }
__device__ __forceinline__ float fma_of(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_of(double a, double b, double c) { return fma(a, b, c); }

// A: the accumulator type (float; double in the float64 kernels)
template <int M_TILES, int N_TILES, int D_TILES, class A = float>
struct OnlineSoftmax {
  A row_max[M_TILES][2];  // m: running max of x over the keys seen, log2 units (-inf: none yet)
  A row_sum[M_TILES][2];  // l: this thread's share of sum exp2(x - m); the quad sum is taken once, at the end

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[mt][h] = neg_inf();
        row_sum[mt][h] = A(0);
      }
  }

  // The max over a quad's row (g or g + 8 of m tile mt: h = 0, 1) of a tile's scores
  static __device__ __forceinline__ A tile_max(const A (&s)[M_TILES][N_TILES][4], int mt, int h) {
    A x = neg_inf();
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt) x = max_of(x, max_of(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
    return quad_max(x);
  }
  // S -> P = exp2(x * scale_log2 - m) on this thread's part of a row; returns its sum
  static __device__ __forceinline__ A exp2_and_sum(A (&s)[M_TILES][N_TILES][4], int mt, int h, A scale_log2, A m) {
    A sum = A(0);
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
      for (int c = 2 * h; c < 2 * h + 2; ++c) {
        s[mt][nt][c] = exp2_of(fma_of(s[mt][nt][c], scale_log2, -m));
        sum += s[mt][nt][c];
      }
    return sum;
  }

  // The float64 forward's update (update_lazy): a row keeps its max m while its scores stay below m + LAZY_LOG2, so
  // P = exp2(x - m) may reach 2^LAZY_LOG2, and O and l are rescaled only on tiles where some row of the warp moves its
  // max (a warp vote), on most inputs the first few. In float64 that range costs nothing (lse = (m + log2 l) ln 2
  // holds for any m), and the multiplies of the rescale, D_TILES * 4 per row and tile, and its exponentials run on
  // the FP64 pipe beside the DMMA: on an H100 the head-dim-128 forward gained 10-13 %. The 16-bit forward measured
  // the same idea slower (docs/PERFORMANCE.md, "What did not pay").
  static constexpr int LAZY_LOG2 = 8;
  __device__ __forceinline__ void update_lazy(A (&s)[M_TILES][N_TILES][4], A (&o)[M_TILES][D_TILES][4], A scale_log2) {
    A m_next[M_TILES][2];
    bool moves = false;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const A m_tile = tile_max(s, mt, h) * scale_log2;
        const bool move = m_tile > row_max[mt][h] + A(LAZY_LOG2);  // false while both are -inf
        m_next[mt][h] = move ? m_tile : row_max[mt][h];
        moves |= move;
      }
    if (__any_sync(0xffffffffu, moves)) {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // alpha = 0 on a row's first visible tile (m = -inf), 1 on rows that keep their max
          const A alpha = m_next[mt][h] == neg_inf() ? A(1) : exp2_of(row_max[mt][h] - m_next[mt][h]);
          row_max[mt][h] = m_next[mt][h];
          row_sum[mt][h] *= alpha;
#pragma unroll
          for (int dt = 0; dt < D_TILES; ++dt) {
            o[mt][dt][2 * h] *= alpha;
            o[mt][dt][2 * h + 1] *= alpha;
          }
        }
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // a row without a visible key so far: m = -inf; 0 as the max so exp2(-inf - 0) = 0, not NaN
        const A m_use = row_max[mt][h] == neg_inf() ? A(0) : row_max[mt][h];
        row_sum[mt][h] += exp2_and_sum(s, mt, h, scale_log2, m_use);
      }
  }

  // One key tile: m_new = max(m, rowmax(x)); O *= exp2(m - m_new); l = l * exp2(m - m_new) + rowsum(P);
  // S is overwritten by P = exp2(x - m_new).
  __device__ __forceinline__ void update(A (&s)[M_TILES][N_TILES][4], A (&o)[M_TILES][D_TILES][4], A scale_log2) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const A m_new = max_of(row_max[mt][h], tile_max(s, mt, h) * scale_log2);
        // fully masked row so far: m_new == -inf; use 0 as the max so exp2(-inf - 0) = 0, not NaN
        const A m_use = (m_new == neg_inf()) ? A(0) : m_new;
        const A alpha = exp2_of(row_max[mt][h] - m_use);  // exp2(-inf) = 0 on the first visible tile
        row_max[mt][h] = m_new;
        row_sum[mt][h] = row_sum[mt][h] * alpha + exp2_and_sum(s, mt, h, scale_log2, m_use);
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt) {
          o[mt][dt][2 * h] *= alpha;
          o[mt][dt][2 * h + 1] *= alpha;
        }
      }
  }

  // O /= l; lse = (m + log2 l) * ln 2. A row that saw no key (l == 0) gives O = 0 and lse = -inf.
  // ln2: ln 2 in A's precision.
  __device__ __forceinline__ void finalize(A (&o)[M_TILES][D_TILES][4], A (&lse)[M_TILES][2], A ln2 = LN2) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const A l = quad_sum(row_sum[mt][h]);
        // (l == 0, not l > 0: a NaN from the inputs must propagate, not turn into a masked row)
        const A inv_l = (l == A(0)) ? A(0) : A(1) / l;
        lse[mt][h] = (l == A(0)) ? A(neg_inf()) : (row_max[mt][h] + log2_of(l)) * ln2;
#pragma unroll
        for (int dt = 0; dt < D_TILES; ++dt) {
          o[mt][dt][2 * h] *= inv_l;
          o[mt][dt][2 * h + 1] *= inv_l;
        }
      }
  }
};

}  // namespace cuflash
