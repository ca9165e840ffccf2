// traits.cuh: every constant a kernel uses, derived from its template arguments, with the checks
// that keep them consistent. Python renders the template arguments from cuflash/config.py.
#pragma once
#include "ptx.cuh"
#include "tiles.cuh"

namespace cuflash {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
// A compile-time flag passed as a value, for generic lambdas: step(BoolTag<true>()).
template <bool B>
struct BoolTag {
  static constexpr bool value = B;
};

// -inf: "no key seen yet" and masked scores (a function: NVRTC has no constexpr infinity)
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

template <int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int WARPS_, int STAGES_, class T_>
struct FwdTraits {
  using T = T_;
  static constexpr int HEAD_DIM = HEAD_DIM_;  // kernel head dim; the run-time head_dim may be smaller
  static constexpr int BLOCK_M = BLOCK_M_;    // query rows per CTA (B_r)
  static constexpr int BLOCK_N = BLOCK_N_;    // key rows per K/V tile (B_c)
  static constexpr int WARPS = WARPS_;
  static constexpr int STAGES = STAGES_;      // K/V shared-memory buffers
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int M_TILES = BLOCK_M / (16 * WARPS);  // m16 row tiles owned by one warp
  static constexpr int WARP_ROWS = 16 * M_TILES;
  static constexpr int N_TILES = BLOCK_N / 8;             // n8 column tiles of S
  static constexpr int D_TILES = HEAD_DIM / 8;            // n8 column tiles of O
  static constexpr int QK_K_STEPS = HEAD_DIM / 16;        // k16 steps of S = Q K^T
  static constexpr int PV_K_STEPS = BLOCK_N / 16;         // k16 steps of O += P V

  using TileQ = SmemTile<BLOCK_M, HEAD_DIM>;  // also stages O for the coalesced store
  using TileKV = SmemTile<BLOCK_N, HEAD_DIM>;
  static constexpr int SMEM_Q = TileQ::BYTES;
  static constexpr int SMEM_KV = TileKV::BYTES;
  static constexpr int SMEM_BYTES = SMEM_Q + 2 * STAGES * SMEM_KV;

  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of mma K=16, at most 256");
  static_assert(BLOCK_M % (16 * WARPS) == 0, "each warp owns whole m16 row tiles");
  static_assert(BLOCK_N % 16 == 0, "BLOCK_N must be a multiple of 16 (ldmatrix.x4 loads n16 of K)");
  static_assert(STAGES == 2, "the K/V pipeline is written for double buffering");
  static_assert(SMEM_Q % 1024 == 0 && SMEM_KV % 1024 == 0, "tiles start 1024-byte aligned for the swizzle");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

}  // namespace cuflash
