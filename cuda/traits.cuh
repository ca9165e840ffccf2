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
  static_assert(STAGES >= 2 && STAGES <= 8, "the K/V pipeline keeps STAGES - 1 tiles in flight (2: double buffering)");
  static_assert(SMEM_Q % 1024 == 0 && SMEM_KV % 1024 == 0, "tiles start 1024-byte aligned for the swizzle");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

}  // namespace cuflash

namespace cuflash {

// Backward, K/V-outer (FlashAttention-2 Algorithm 2): one CTA owns BLOCK_N keys, loops over query
// blocks of BLOCK_M rows. It works on transposed scores S^T = K Q^T so that P^T and dS^T come out of
// the accumulators already in the A-operand layout of dV += P^T dO and dK += dS^T Q.
// Warp w owns the 16 key rows (w / D_SPLIT) and the head-dim slice (w % D_SPLIT) of dK and dV;
// with D_SPLIT = 2 the two warps of a key group both compute that group's S^T and dP^T (cheaper in
// registers than splitting them, and the only way to fit dK + dV of HEAD_DIM >= 192 in registers).
template <int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int WARPS_, int D_SPLIT_, class T_>
struct BwdTraits {
  using T = T_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;  // query rows per step (B_r)
  static constexpr int BLOCK_N = BLOCK_N_;  // key rows per CTA (B_c)
  static constexpr int WARPS = WARPS_;
  static constexpr int D_SPLIT = D_SPLIT_;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int KEY_WARPS = WARPS / D_SPLIT;   // one m16 key tile per key group
  static constexpr int Q_TILES = BLOCK_M / 8;         // n8 column (query) tiles of S^T, dP^T
  static constexpr int QK_K_STEPS = HEAD_DIM / 16;    // k16 steps of S^T = K Q^T and dP^T = V dO^T
  static constexpr int DKV_COLS = HEAD_DIM / D_SPLIT; // dK/dV columns per warp
  static constexpr int DKV_TILES = DKV_COLS / 8;
  static constexpr int Q_K_STEPS = BLOCK_M / 16;      // k16 steps of dV += P^T dO, dK += dS^T Q
  // dQ_i = dS K_j: all warps split the [BLOCK_M, HEAD_DIM] result in a DQ_WARPS_M x DQ_WARPS_D grid
  static constexpr int DQ_WARPS_M = (WARPS < BLOCK_M / 16) ? WARPS : BLOCK_M / 16;
  static constexpr int DQ_WARPS_D = WARPS / DQ_WARPS_M;
  static constexpr int DQ_M_TILES = BLOCK_M / 16 / DQ_WARPS_M;
  static constexpr int DQ_D_TILES = HEAD_DIM / 8 / DQ_WARPS_D;
  static constexpr int DQ_K_STEPS = BLOCK_N / 16;
  static constexpr int DP_UNROLL = (HEAD_DIM == 128) ? 1 : QK_K_STEPS;  // see bwd.cuh, dP^T

  using TileQ = SmemTile<BLOCK_M, HEAD_DIM>;   // Q_i and dO_i
  using TileKV = SmemTile<BLOCK_N, HEAD_DIM>;  // K_j and V_j; reused to stage dK, dV
  using TileDS = SmemTile<BLOCK_N, BLOCK_M>;   // dS^T (keys x queries), read transposed for dQ
  static constexpr int SMEM_Q = TileQ::BYTES;
  static constexpr int SMEM_KV = TileKV::BYTES;
  static constexpr int SMEM_DS = TileDS::BYTES;
  static constexpr int SMEM_ROWVEC = BLOCK_M * 4;  // lse_log2 or delta of one query block (fp32)
  // K, V, then 2 stages of (Q, dO), dS^T, then 2 stages of (lse_log2, delta)
  static constexpr int OFF_K = 0;
  static constexpr int OFF_V = SMEM_KV;
  static constexpr int OFF_Q = 2 * SMEM_KV;                // + stage * 2 * SMEM_Q
  static constexpr int OFF_DO = OFF_Q + SMEM_Q;            // + stage * 2 * SMEM_Q
  static constexpr int OFF_DS = 2 * SMEM_KV + 4 * SMEM_Q;
  static constexpr int OFF_LSE = OFF_DS + SMEM_DS;         // + stage * 2 * SMEM_ROWVEC
  static constexpr int OFF_DELTA = OFF_LSE + SMEM_ROWVEC;  // + stage * 2 * SMEM_ROWVEC
  static constexpr int SMEM_BYTES = OFF_LSE + 4 * SMEM_ROWVEC;

  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of mma K=16, at most 256");
  static_assert(WARPS % D_SPLIT == 0 && BLOCK_N == 16 * KEY_WARPS, "each key group owns one m16 tile of keys");
  static_assert(BLOCK_M % 16 == 0 && BLOCK_M <= THREADS, "BLOCK_M: k16 steps; one thread per row for lse/delta");
  static_assert(DKV_TILES % 2 == 0 && DQ_D_TILES % 2 == 0, "B fragments are loaded for pairs of n8 tiles");
  static_assert(WARPS % DQ_WARPS_M == 0 && (HEAD_DIM / 8) % DQ_WARPS_D == 0, "dQ warp grid must tile the result");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

// Deterministic dQ (Q-outer, like the forward): one CTA owns BLOCK_M query rows and loops over the
// key tiles, recomputing S, P, dP and dS, and accumulates dQ in registers; no atomics.
template <int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int WARPS_, class T_>
struct DqTraits : FwdTraits<HEAD_DIM_, BLOCK_M_, BLOCK_N_, WARPS_, 2, T_> {
  using Base = FwdTraits<HEAD_DIM_, BLOCK_M_, BLOCK_N_, WARPS_, 2, T_>;
  // Q, dO, then 2 stages of K, then 2 stages of V
  static constexpr int SMEM_BYTES = 2 * Base::SMEM_Q + 4 * Base::SMEM_KV;
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

// ---- Hopper (sm_90a) kernels: warpgroup MMA ---------------------------------------------------------

// wgmma.m64nNk16 takes N = 8..256 in steps of 8; ptx_wgmma.cuh instantiates these:
__host__ __device__ constexpr bool is_wgmma_n(int n) {
  return n == 16 || n == 32 || n == 48 || n == 64 || n == 80 || n == 96 || n == 112 || n == 128 || n == 160 ||
         n == 176 || n == 192 || n == 256;
}

// Forward (fwd_sm90.cuh): each warpgroup (4 warps) owns 64 query rows; S = Q K^T reads Q and K from
// shared memory (both K-major), O += P V takes P from registers and V from shared memory (N-major).
template <int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int CTAS_PER_SM_, class T_>
struct FwdSm90Traits {
  using T = T_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;          // query rows per CTA (B_r)
  static constexpr int BLOCK_N = BLOCK_N_;          // key rows per K/V tile (B_c)
  static constexpr int CTAS_PER_SM = CTAS_PER_SM_;  // __launch_bounds__ minimum: caps registers per thread
  static constexpr int WARPGROUPS = BLOCK_M / 64;
  static constexpr int THREADS = 128 * WARPGROUPS;
  static constexpr int STAGES = 2;                  // K/V shared-memory buffers
  static constexpr int N_TILES = BLOCK_N / 8;       // n8 column tiles of S (per warpgroup: 64 x BLOCK_N)
  static constexpr int D_TILES = HEAD_DIM / 8;      // n8 column tiles of O
  static constexpr int QK_K_STEPS = HEAD_DIM / 16;  // k16 steps of S = Q K^T
  static constexpr int PV_K_STEPS = BLOCK_N / 16;   // k16 steps of O += P V

  using TileQ = SmemTile<BLOCK_M, HEAD_DIM>;  // also stages O for the coalesced store
  using TileKV = SmemTile<BLOCK_N, HEAD_DIM>;
  static constexpr int SMEM_Q = TileQ::BYTES;
  static constexpr int SMEM_KV = TileKV::BYTES;
  // + 1024: the kernel rounds the dynamic shared memory base up to the 1024-byte swizzle period
  static constexpr int SMEM_BYTES = SMEM_Q + 2 * STAGES * SMEM_KV + 1024;

  static_assert(BLOCK_M % 64 == 0 && WARPGROUPS >= 1 && WARPGROUPS <= 3, "64 query rows per warpgroup, 1-3 warpgroups");
  static_assert(is_wgmma_n(BLOCK_N) && is_wgmma_n(HEAD_DIM), "BLOCK_N and HEAD_DIM must be wgmma N sizes");
  static_assert(SMEM_Q % 1024 == 0 && SMEM_KV % 1024 == 0, "tiles start on the 1024-byte swizzle period");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

// Backward main kernel (bwd_sm90.cuh), K/V-outer: each warpgroup owns 64 keys (rows of dK, dV in
// registers); per query block of BLOCK_M = 64: S^T = K Q^T and dP^T = V dO^T (shared x shared),
// dV += P^T dO and dK += dS^T Q (P^T, dS^T from registers), dQ = dS K (dS^T staged in shared memory,
// read M-major; K read N-major), each warpgroup computing DQ_COLS columns of dQ.
template <int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int CTAS_PER_SM_, class T_>
struct BwdSm90Traits {
  using T = T_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;  // query rows per step (B_r)
  static constexpr int BLOCK_N = BLOCK_N_;  // key rows per CTA (B_c)
  static constexpr int CTAS_PER_SM = CTAS_PER_SM_;
  static constexpr int WARPGROUPS = BLOCK_N / 64;
  static constexpr int THREADS = 128 * WARPGROUPS;
  static constexpr int Q_TILES = BLOCK_M / 8;        // n8 (query) tiles of S^T, dP^T
  static constexpr int QK_K_STEPS = HEAD_DIM / 16;   // k16 steps of S^T and dP^T
  static constexpr int Q_K_STEPS = BLOCK_M / 16;     // k16 steps of dV += P^T dO, dK += dS^T Q
  static constexpr int DKV_TILES = HEAD_DIM / 8;     // n8 tiles of dK, dV
  // dQ_i = dS K_j of a step, one m64 wgmma per warpgroup: at BLOCK_M 64 warpgroup w takes DQ_COLS = HEAD_DIM /
  // WARPGROUPS columns (from w * DQ_COLS) of the 64 rows; at BLOCK_M 128 (two warpgroups: the warp-specialized
  // kernel's 128-query steps) it takes rows 64 w .. 64 w + 63, every column
  static constexpr bool DQ_BY_ROWS = BLOCK_M == 128;
  static constexpr int DQ_COLS = DQ_BY_ROWS ? HEAD_DIM : HEAD_DIM / WARPGROUPS;
  static constexpr int DQ_TILES = DQ_COLS / 8;
  static constexpr int dq_row0(int warpgroup) { return DQ_BY_ROWS ? 64 * warpgroup : 0; }
  static constexpr int dq_col0(int warpgroup) { return DQ_BY_ROWS ? 0 : DQ_COLS * warpgroup; }
  static constexpr int DQ_K_STEPS = BLOCK_N / 16;
  // dQ's B operand (K, N-major) starts at column dq_col0(warpgroup): a whole number of panels, or at head dim 32
  // (16 columns a warpgroup) the second half of the one 32-column panel
  static constexpr int PANEL_COLS = DQ_COLS % 64 == 0 ? 64 : 32;

  using TileQ = SmemTile<BLOCK_M, HEAD_DIM, PANEL_COLS>;   // Q_i and dO_i
  using TileKV = SmemTile<BLOCK_N, HEAD_DIM, PANEL_COLS>;  // K_j and V_j; reused to stage dK, dV
  using TileDS = SmemTile<BLOCK_N, BLOCK_M>;               // dS^T (keys x queries), read M-major as dS
  static constexpr int SMEM_Q = TileQ::BYTES;
  static constexpr int SMEM_KV = TileKV::BYTES;
  static constexpr int SMEM_DS = TileDS::BYTES;
  static constexpr int SMEM_ROWVEC = BLOCK_M * 4;  // lse_log2 or delta of one query block (fp32)
  // K, V, then 2 stages of (Q, dO), dS^T, then 2 stages of (lse_log2, delta)
  static constexpr int OFF_K = 0;
  static constexpr int OFF_V = SMEM_KV;
  static constexpr int OFF_Q = 2 * SMEM_KV;                // + stage * 2 * SMEM_Q
  static constexpr int OFF_DO = OFF_Q + SMEM_Q;            // + stage * 2 * SMEM_Q
  static constexpr int OFF_DS = 2 * SMEM_KV + 4 * SMEM_Q;
  static constexpr int OFF_LSE = OFF_DS + SMEM_DS;         // + stage * 2 * SMEM_ROWVEC
  static constexpr int OFF_DELTA = OFF_LSE + SMEM_ROWVEC;  // + stage * 2 * SMEM_ROWVEC
  static constexpr int SMEM_BYTES = OFF_LSE + 4 * SMEM_ROWVEC + 1024;  // + rounding up to 1024
  // no staged bias (the warp-specialized traits stage one: bwd_sm90_dkdv_step)
  static constexpr bool stage_bias(int, bool) { return false; }
  static constexpr int OFF_BIAS = 0, BIAS_PITCH = 0, SMEM_BIAS = 0;
  static __device__ __forceinline__ int bias_offset(int, int) { return 0; }

  static_assert(BLOCK_M == 64 || (BLOCK_M == 128 && WARPGROUPS == 2), "one m64 wgmma of dQ rows per warpgroup");
  static_assert(BLOCK_N % 64 == 0 && WARPGROUPS >= 1 && WARPGROUPS <= 2, "64 keys per warpgroup, 1-2 warpgroups");
  static_assert(HEAD_DIM % WARPGROUPS == 0 && (DQ_COLS % 32 == 0 || HEAD_DIM == 32),
                "dQ columns split into whole 64-byte panels (or halves of head dim 32's one panel)");
  static_assert(is_wgmma_n(BLOCK_M) && is_wgmma_n(HEAD_DIM) && is_wgmma_n(DQ_COLS), "wgmma N sizes");
  static_assert(BLOCK_M / 2 <= THREADS, "one thread per 16-byte chunk of lse_log2 and delta");
  static_assert(OFF_DS % 1024 == 0 && SMEM_Q % 1024 == 0 && SMEM_KV % 1024 == 0, "1024-byte swizzle periods");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

}  // namespace cuflash
