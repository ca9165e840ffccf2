// bwd_sm90_tf32.cuh: the float32 backward on sm_90a, TF32 wgmma (m64nNk8), fp32 accumulators, dQ, dK, dV in float32.
// Two kernels after the preprocess (bwd_wide_preprocess_kernel: delta = rowsum(dO * O), lse_log2), each with the
// data movement of fwd_sm90_tf32.cuh (a TMA thread, three "splitter" warps preparing the operands in shared memory,
// consumer warpgroups of 64 rows) and its arithmetic (3xTF32 or one TF32 pass, chains of at most k 64 summed into
// fp32 registers, P and dS straight from the accumulators to A registers with the keys or queries of each 8-group
// permuted by tf32_key_of):
//
//   bwd_sm90_tf32_kernel (K/V-outer; grid (key blocks of 128, K/V heads, batch)): dK and dV of 128 keys. Per step
//     (query head, BLOCK_M queries):  S^T = K Q^T, dP^T = V dO^T (B = Q, dO as loaded: K-major);
//     P^T = exp2(S^T scale_log2 - lse_log2), dS^T = P^T (dP^T - delta);  dV += P^T dO, dK += dS^T Q, where TF32
//     wants the B operands K-major over the queries: the splitters write Q^T and dO^T (head_dim rows of BLOCK_M
//     queries, permuted as P^T's columns) beside the split Q and dO. Two consumer warpgroups of 64 keys each (128
//     keys per CTA) take every step together, so each split and transposed Q, dO serves 128 keys.
//   bwd_dq_sm90_tf32_kernel (Q-outer; grid (query blocks, heads, batch)): dQ of 64 * CONSUMERS rows:
//     S = Q K^T, dP = dO V^T, P, dS as above, dQ += dS K with B = K^T, written by the splitters per key tile
//     (K split in place, K^T big and small, V split in place), as the forward writes V^T. A_REGS: Q's (and dO's) A
//     operands in registers, read once, as the forward's Q_REGS.
//
// Head dim 128 runs both kernels as cluster pairs of 64 columns per CTA (SPLIT 2, the `_pair_kernel`s: below).
//
// No atomics: each output element is summed by one thread in a fixed order, so the backward repeats bitwise
// (deterministic=True launches the same kernels). S and dP are
// computed twice (once per kernel): 7 GEMMs instead of 5, against a dQ accumulated across CTAs, which needs dS in
// shared memory and K^T beside K in the K/V-outer CTA (more than the 227 KB of shared memory with 3xTF32's split
// operands).
//
// Key and query tails: TMA zero-fills rows past a dense tensor (a packed sequence's next rows are read instead),
// lse_log2 is +inf on the pad rows of the fp32 buffers (seqs.cuh) and keys past len_k are masked, so P = dS = 0
// wherever a row or key does not exist; nothing past them is stored. Causal and sliding-window bands, GQA (the
// K/V-outer CTA walks every query head of its group: BwdKeyBlock), dense and packed (varlen) sequences, a float32
// bias (MODS & MOD_BIAS: added to S^T and S as the forward adds it; dBias = dS^T written by the dK / dV kernel,
// which sees each (query head, query, key) once: plain stores, or red.add where the bias is broadcast), ALiBi and an
// element mask (MOD_ALIBI, MOD_MASK: after the bias, as the forward; with a BlockMask's map, each kernel at its own
// tiles, the steps and key tiles it marks empty are skipped and the mask is not read on those it marks full);
// soft-capping and dropout run on wide.cuh's bwd_wide_kernel.
#pragma once
#include "fwd_sm90_tf32.cuh"
#include "bwd_sm90_ws.cuh"  // BwdWsParams; bwd.cuh's BwdKeyBlock, QueryBlock

namespace cuflash {

// ROWS x COLS float32 tile `tile` (SmemTile<ROWS, 2 COLS>, from TMA) prepared for TF32 wgmma by THREADS threads: each
// value becomes its small part in place and its big part at the same offset of `big` (X3), or its rounded value in
// place; with TRANSPOSE also X^T (SmemTile<COLS, 2 ROWS>: COLS rows of ROWS values, the rows of X permuted within
// 8-row groups by tf32_column_of, as P's columns are) big or rounded at t_big, small at t_small. Without TRANSPOSE
// 8 consecutive chunks per phase (tf32_split_tile's order); with it fwd_sm90_tf32.cuh's transpose units (a lane's
// 16-byte chunk: 4 columns of one row, 8 lanes of a phase on 8 rows of one chunk), unit u taken by warp
// (u + rot) % WARPS: a second tile prepared with another rot evens out the units per warp.
template <int ROWS, int COLS, bool X3, bool TRANSPOSE, int THREADS>
__device__ __forceinline__ void tf32_prepare(u32 tile, u32 big, u32 t_big, u32 t_small, int tid, int rot = 0) {
  using Tile = SmemTile<ROWS, 2 * COLS>;
  using TileT = SmemTile<COLS, 2 * ROWS>;
  constexpr int WARPS = THREADS / 32;
  auto put = [&](u32 off, float4 x, u32 (&b)[4], u32 (&sm)[4]) {
    tf32_parts<X3>(x.x, b[0], sm[0]);
    tf32_parts<X3>(x.y, b[1], sm[1]);
    tf32_parts<X3>(x.z, b[2], sm[2]);
    tf32_parts<X3>(x.w, b[3], sm[3]);
    if constexpr (X3) {
      st_shared_u32x4(big + off, b[0], b[1], b[2], b[3]);
      st_shared_u32x4(tile + off, sm[0], sm[1], sm[2], sm[3]);
    } else {
      st_shared_u32x4(tile + off, b[0], b[1], b[2], b[3]);
    }
  };
  if constexpr (!TRANSPOSE) {
    for (int c = tid; c < ROWS * COLS / 4; c += THREADS) tf32_split_chunk<X3>(tile, big, 16 * c);
  } else {
    constexpr int KEYS = ROWS < 32 ? ROWS : 32, CHUNKS_PER_UNIT = 32 / KEYS;
    constexpr int ROW_UNITS = ROWS / KEYS, UNITS = ROW_UNITS * (COLS / 4) / CHUNKS_PER_UNIT;
    static_assert(KEYS == 16 || KEYS == 32, "16 or 32 rows per unit");
    const int warp = tid / 32, lane = tid & 31;
    for (int u = (warp + WARPS - rot % WARPS) % WARPS; u < UNITS; u += WARPS) {
      const int row = KEYS * (u % ROW_UNITS) + lane % KEYS, chunk = CHUNKS_PER_UNIT * (u / ROW_UNITS) + lane / KEYS;
      const u32 off = Tile::offset(row, 8 * chunk);
      u32 b[4], sm[4];
      put(off, ld_shared_f32x4(tile + off), b, sm);  // the parts once, for both layouts
      const int col = (row & ~7) + tf32_column_of(row & 7);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 toff = TileT::offset(4 * chunk + j, 2 * col);
        st_shared_s32(t_big + toff, static_cast<int>(b[j]));
        if constexpr (X3) st_shared_s32(t_small + toff, static_cast<int>(sm[j]));
      }
    }
  }
}

// One k8 step of X3 (or one-pass) TF32 wgmma from shared memory: acc (+)= a b^T, the small terms first (Tf32x3::mma).
template <int N, bool X3, int NT>
__device__ __forceinline__ void tf32_ss(float (&acc)[NT][4], u64 a_small, u64 a_big, u64 b_small, u64 b_big, int more) {
  using W = Wgmma<N, tf32>;
  if constexpr (X3) {
    W::ss(acc, a_small, b_big, more);
    W::ss(acc, a_big, b_small, 1);
    W::ss(acc, a_big, b_big, 1);
  } else {
    W::ss(acc, a_small, b_small, more);
  }
}
// ... with A from registers (big, small: tf32_probs_to_regs) and B's big (or rounded) and small parts
template <int N, bool X3, int NT>
__device__ __forceinline__ void tf32_rs(float (&acc)[NT][4], const u32 (&a_big)[4], const u32 (&a_small)[4],
                                        u64 b_big, u64 b_small, int more) {
  using W = Wgmma<N, tf32>;
  if constexpr (X3) {
    W::rs(acc, a_small, b_big, more);
    W::rs(acc, a_big, b_small, 1);
    W::rs(acc, a_big, b_big, 1);
  } else {
    W::rs(acc, a_big, b_big, more);
  }
}

template <int N_TILES>
__device__ __forceinline__ void add_tile(float (&acc)[N_TILES][4], const float (&tile)[N_TILES][4]) {
#pragma unroll
  for (int i = 0; i < N_TILES; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[i][c] += tile[i][c];
}

// ==== head dim 128: a pair of CTAs, 64 columns each (pair_send, pair_wait, pair_tile: fwd_sm90_tf32.cuh) ==========
//
// At head dim 128 the 3xTF32 operands of a CTA's keys or rows (K and V with their big parts: 128 KB per 64 keys) and
// its float32 outputs (dK and dV of 64 keys: 128 registers per consumer thread) do not fit one CTA. SPLIT 2 runs
// each CTA of the head-dim-64 kernels as a cluster of two (__cluster_dims__(2, 1, 1)): CTA r loads and splits columns
// 64 r .. 64 r + 63 of every operand and writes those columns of its outputs; S and dP (S^T, dP^T) are exchanged
// and added as the forward's pairs add S.

// ==== dK, dV: bwd_sm90_tf32_kernel ================================================================================
//
// ---- shared memory (float32 elements; each tile starts on the 1024-byte swizzle period) ----------------------------
// [K] [K big] [V] [V big] then per stage: [Q] [Q big] [Q^T big] [Q^T small] [dO] [dO big] [dO^T big] [dO^T small]
// (one pass: [K] [V], per stage [Q] [Q^T] [dO] [dO^T]), [per stage: lse_log2, delta], [SPLIT 2: the exchange slots,
// per parity, product (S^T, dP^T) and consumer], [mbarriers]. K, V, Q, dO receive TMA's float32 and then hold the
// small part or the rounded value in place.
//
// ---- the barrier protocol ------------------------------------------------------------------------------------
//   kv_full      count 1 + tx: K and V          kv_ready   count CONSUMER_THREADS: K and V split, each consumer
//                                                           warpgroup its own 64 keys (tf32_split_own_rows)
//   q_full[s]    count 1 + tx: Q_i, dO_i, lse_log2_i, delta_i
//   q_ready[s]   count SPLIT_THREADS: Q_i, dO_i split and transposed
//   q_empty[s]   count CONSUMER_THREADS: every consumer thread, once its last GEMM on stage s retired
//   xbar[b][x][wg] (SPLIT 2) count 4 + tx: the consumer's warps announce their bytes, the other CTA's st.async of
//                its S^T (x 0) or dP^T (x 1) fragments of step i (b = i & 1, phase (i >> 1) & 1) complete them
// Step i uses stage i % STAGES, phase (i / STAGES) & 1. The producer loads step i after q_empty of step i - STAGES;
// the splitters' writes to a stage's derived tiles follow q_full, so they too wait for that release.
template <int HEAD_DIM_, int BLOCK_M_, int STAGES_, bool X3_, int SPLIT_ = 1, int CONSUMERS_ = 2,
          int K_REG_STEPS_ = 0>
struct BwdTf32Traits {
  static constexpr int HEAD_DIM = HEAD_DIM_;           // columns of this CTA (of HEAD_DIM * SPLIT)
  static constexpr int BLOCK_M = BLOCK_M_;             // queries per step
  static constexpr int STAGES = STAGES_;
  static constexpr bool X3 = X3_;
  static constexpr int SPLIT = SPLIT_;                 // CTAs of a cluster sharing the head dim (PairExchange)
  static constexpr int CONSUMERS = CONSUMERS_;         // 64 keys each (one warpgroup's M), every step
  // the first K_REG_STEPS k8 steps of S^T take K's big part (3xTF32) from registers, read from shared memory once per
  // CTA, as two of their three products' A operand: at 16 queries per step S^T's A (64 keys x 8 floats per k8 step)
  // is 4x its B, so K's and V's A reads are most of a step's shared-memory reads (config.BWD_SM90_TF32_TILES)
  static constexpr int K_REG_STEPS = K_REG_STEPS_;
  static constexpr int BLOCK_N = 64 * CONSUMERS;       // keys per CTA
  static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
  static constexpr int SPLIT_THREADS = 96;
  static constexpr int THREADS = 128 + CONSUMER_THREADS;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = CONSUMERS == 3 ? 152 : 232;  // three: 128 x 40 + 384 x 152 <= 64K
  static constexpr int Q_TILES = BLOCK_M / 8;          // n8 tiles of S^T, dP^T; k8 steps of dV, dK
  static constexpr int D_TILES = HEAD_DIM / 8;
  static constexpr int QK_K_STEPS = HEAD_DIM / 8;
  using TileQ = SmemTile<BLOCK_M, 2 * HEAD_DIM>;       // Q, dO: BLOCK_M rows of HEAD_DIM floats
  using TileKV = SmemTile<BLOCK_N, 2 * HEAD_DIM>;
  using TileQt = SmemTile<HEAD_DIM, 2 * BLOCK_M>;      // Q^T, dO^T
  static constexpr int BOX_COLS = 32;                  // TMA box width in floats: one 128-byte panel
  static constexpr int PANELS = HEAD_DIM / BOX_COLS;
  static constexpr int PARTS = X3 ? 2 : 1;
  static constexpr int SMEM_Q = TileQ::BYTES;
  static constexpr int SMEM_KV = TileKV::BYTES;
  static constexpr int OFF_K = 0;                                   // small (X3) or rounded
  static constexpr int OFF_KB = OFF_K + SMEM_KV;                    // big (X3)
  static constexpr int OFF_V = OFF_K + PARTS * SMEM_KV;
  static constexpr int OFF_VB = OFF_V + SMEM_KV;
  static constexpr int OFF_STAGES = OFF_V + PARTS * SMEM_KV;
  // within a stage: Q (small or rounded), Q big, Q^T big (or rounded), Q^T small; then dO's four
  static constexpr int TENSOR_BYTES = 2 * PARTS * SMEM_Q;
  static constexpr int STAGE_BYTES = 2 * TENSOR_BYTES;
  static constexpr int SMEM_ROWVEC = 4 * BLOCK_M;                   // a step's lse_log2 or delta
  static constexpr int OFF_VEC = OFF_STAGES + STAGES * STAGE_BYTES; // per stage: lse_log2, delta
  // per stage: the step's query head, query block and whether a BlockMask's map marks its tile full (16 bytes)
  static constexpr int OFF_STEP = OFF_VEC + STAGES * 2 * SMEM_ROWVEC;
  // a pair's exchange (SPLIT 2): per parity, product (S^T, dP^T) and consumer, Q_TILES float4 per consumer thread
  static constexpr int XCHG_SLOT = SPLIT > 1 ? Q_TILES * 128 * 16 : 0;
  static constexpr int OFF_XCHG = OFF_STEP + STAGES * 16;
  static constexpr int BARRIERS = 2 + 3 * STAGES + (SPLIT > 1 ? 2 * 2 * CONSUMERS : 0);
  static constexpr int OFF_BAR = OFF_XCHG + 2 * 2 * CONSUMERS * XCHG_SLOT;
  static constexpr int SMEM_BYTES = OFF_BAR + 8 * BARRIERS + 1024;  // cuflash/config.py BwdSm90Tf32Config.smem_bytes
  static constexpr int Q_TX = 2 * SMEM_Q + 2 * SMEM_ROWVEC;         // transaction bytes of a step

  static_assert(HEAD_DIM == 32 || HEAD_DIM == 64,
                "dK and dV of 64 keys x 32 or 64 columns per CTA (128 would exceed a consumer's registers: SPLIT 2)");
  static_assert(SPLIT == 1 || (SPLIT == 2 && HEAD_DIM == 64), "head dim 128 as a pair of CTAs of 64 columns");
  static_assert(BLOCK_M == 16 || BLOCK_M == 32, "steps of 16 or 32 queries");
  static_assert(CONSUMERS == 2 || (CONSUMERS == 3 && SPLIT == 1), "two consumers, or three in one CTA per key block");
  static_assert(K_REG_STEPS == 0 || (X3 && K_REG_STEPS <= HEAD_DIM / 8), "K's big part in registers: 3xTF32");
  static_assert(STAGES >= 2 && STAGES <= 4, "2-4 stages of Q, dO");
  static_assert(SMEM_Q % 1024 == 0 && SMEM_KV % 1024 == 0 && TileQt::BYTES == SMEM_Q, "tiles on the swizzle period");
  // (setmaxnreg.inc waits for registers within the launch's: 65536 / THREADS rounded down to 8 per thread)
  static_assert(128 * PRODUCER_REGS + CONSUMER_THREADS * CONSUMER_REGS <= 65536 / THREADS / 8 * 8 * THREADS,
                "setmaxnreg exceeds the CTA's registers");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

template <class Tr>
struct BwdTf32Smem {
  u32 base;
  __device__ __forceinline__ u32 k() const { return base + Tr::OFF_K; }
  __device__ __forceinline__ u32 k_big() const { return base + Tr::OFF_KB; }
  __device__ __forceinline__ u32 v() const { return base + Tr::OFF_V; }
  __device__ __forceinline__ u32 v_big() const { return base + Tr::OFF_VB; }
  // tensor 0 (Q) or 1 (dO) of stage s: part 0 small / rounded, 1 big, 2 transposed big / rounded, 3 transposed small
  __device__ __forceinline__ u32 part(int s, int tensor, int part) const {
    return base + Tr::OFF_STAGES + s * Tr::STAGE_BYTES + tensor * Tr::TENSOR_BYTES + part * Tr::SMEM_Q;
  }
  __device__ __forceinline__ u32 x(int s, int tensor) const { return part(s, tensor, 0); }
  __device__ __forceinline__ u32 x_big(int s, int tensor) const { return part(s, tensor, 1); }
  __device__ __forceinline__ u32 xt(int s, int tensor) const { return part(s, tensor, Tr::X3 ? 2 : 1); }
  __device__ __forceinline__ u32 xt_small(int s, int tensor) const { return part(s, tensor, 3); }
  __device__ __forceinline__ u32 lse(int s) const { return base + Tr::OFF_VEC + s * 2 * Tr::SMEM_ROWVEC; }
  __device__ __forceinline__ u32 delta(int s) const { return lse(s) + Tr::SMEM_ROWVEC; }
  // word w of stage s's step: 0 the query head, 1 the query block, 2 its tile is full (a map's TILE_FULL)
  __device__ __forceinline__ u32 step(int s, int w) const { return base + Tr::OFF_STEP + 16 * s + 4 * w; }
  __device__ __forceinline__ u32 bar(int i) const { return base + Tr::OFF_BAR + 8 * i; }
  __device__ __forceinline__ u32 kv_full() const { return bar(0); }
  __device__ __forceinline__ u32 kv_ready() const { return bar(1); }
  __device__ __forceinline__ u32 q_full(int s) const { return bar(2 + s); }
  __device__ __forceinline__ u32 q_ready(int s) const { return bar(2 + Tr::STAGES + s); }
  __device__ __forceinline__ u32 q_empty(int s) const { return bar(2 + 2 * Tr::STAGES + s); }
  // the pair's exchange slot and barrier of parity b, product x (0: S^T, 1: dP^T), consumer wg
  __device__ __forceinline__ u32 xchg(int b, int x, int wg) const {
    return base + Tr::OFF_XCHG + ((b * 2 + x) * Tr::CONSUMERS + wg) * Tr::XCHG_SLOT;
  }
  __device__ __forceinline__ u32 xbar(int b, int x, int wg) const {
    return bar(2 + 3 * Tr::STAGES + (b * 2 + x) * Tr::CONSUMERS + wg);
  }
};

// Where a dK / dV CTA counts the steps a BlockMask's map leaves (BwdKeyBlock::visible_steps, 0 or more): once before
// its roles split, or in 32-query steps by each role itself (counted once, a head-dim-32 kernel spilled under NVRTC
// 13.0; counted by the consumers, the 16-query steps' wgmma were serialized, ptxas C7518)
template <class Tr, class KeyBlock>
constexpr bool bwd_tf32_roles_count() {
  return KeyBlock::MAPPED && Tr::BLOCK_M != 16;
}

// The TMA thread: K, V, then Q_i and dO_i of every step into the next stage, with the step's query head and block
// (the steps whose tile a BlockMask's map empties are skipped: BwdKeyBlock::advance).
template <class Tr, class KeyBlock>
__device__ __forceinline__ void bwd_tf32_producer(const BwdWsParams& P, const BwdTf32Smem<Tr>& sm, const KeyBlock& kb,
                                                  int col0) {
  const BwdParams& p = P.bwd;
  prefetch_tensormap(&P.tma_q);
  prefetch_tensormap(&P.tma_do);
  prefetch_tensormap(&P.tma_k);
  prefetch_tensormap(&P.tma_v);
  const int q_batch = p.seq.cu_seqlens_q != nullptr ? 0 : kb.batch;
  const int kv_batch = p.seq.cu_seqlens_k != nullptr ? 0 : kb.batch;
  constexpr int BOX_BYTES = 4 * Tr::BOX_COLS;
  const int key0 = kb.seq.k_row0 + kb.n0;
  mbarrier_arrive_expect_tx(sm.kv_full(), 2 * Tr::SMEM_KV);
#pragma unroll
  for (int panel = 0; panel < Tr::PANELS; ++panel) {
    cp_async_bulk_tensor_4d_global_to_shared(sm.k() + panel * Tr::BLOCK_N * BOX_BYTES, &P.tma_k, sm.kv_full(),
                                             col0 + panel * Tr::BOX_COLS, key0, kb.kv_head, kv_batch);
    cp_async_bulk_tensor_4d_global_to_shared(sm.v() + panel * Tr::BLOCK_N * BOX_BYTES, &P.tma_v, sm.kv_full(),
                                             col0 + panel * Tr::BOX_COLS, key0, kb.kv_head, kv_batch);
  }
  int left;  // positions from qb on
  QueryBlock<Tr> qb = kb.first_step(p, left);
  for (int i = 0; !KeyBlock::MAPPED || left > 0; ++i) {  // (with a map, left may be 0: no step)
    const int s = i % Tr::STAGES;
    mbarrier_wait_or_trap(sm.q_empty(s), ((i / Tr::STAGES) & 1) ^ 1);
    if constexpr (KeyBlock::MAPPED) {  // the step for the consumers (q_full's arrive releases the stores)
      st_shared_s32(sm.step(s, 0), qb.head);
      st_shared_s32(sm.step(s, 1), qb.m_block);
      st_shared_s32(sm.step(s, 2), kb.state(p, qb) == TILE_FULL);
    }
    mbarrier_arrive_expect_tx(sm.q_full(s), Tr::Q_TX);
    const int row = kb.seq.q_row0 + qb.m_block * Tr::BLOCK_M;
    // BLOCK_M fp32 rows each, pad rows included (the buffers are padded per head: seqs.cuh)
    cp_async_bulk_global_to_shared(sm.lse(s), p.lse_log2 + qb.vec_row, Tr::SMEM_ROWVEC, sm.q_full(s));
    cp_async_bulk_global_to_shared(sm.delta(s), p.delta + qb.vec_row, Tr::SMEM_ROWVEC, sm.q_full(s));
#pragma unroll
    for (int panel = 0; panel < Tr::PANELS; ++panel) {
      cp_async_bulk_tensor_4d_global_to_shared(sm.x(s, 0) + panel * Tr::BLOCK_M * BOX_BYTES, &P.tma_q, sm.q_full(s),
                                               col0 + panel * Tr::BOX_COLS, row, qb.head, q_batch);
      cp_async_bulk_tensor_4d_global_to_shared(sm.x(s, 1) + panel * Tr::BLOCK_M * BOX_BYTES, &P.tma_do, sm.q_full(s),
                                               col0 + panel * Tr::BOX_COLS, row, qb.head, q_batch);
    }
    if (!kb.advance(p, qb, left)) break;
  }
}

// The splitters: Q_i and dO_i of every step (split, and transposed for dK's and dV's B operands; the consumers split
// K and V: tf32_split_own_rows).
template <class Tr, class KeyBlock>
__device__ __forceinline__ void bwd_tf32_splitter(const BwdParams& p, const BwdTf32Smem<Tr>& sm, const KeyBlock& kb,
                                                  int all_steps, int tid) {
  constexpr int THREADS = Tr::SPLIT_THREADS;
  const int steps = bwd_tf32_roles_count<Tr, KeyBlock>() ? kb.visible_steps(p, tid & 31) : all_steps;
  for (int i = 0; i < steps; ++i) {
    const int s = i % Tr::STAGES;
    mbarrier_wait_or_trap(sm.q_full(s), (i / Tr::STAGES) & 1);
    // Q's units from warp 0 on, dO's from the warp after Q's last (rot): the warps get equal shares of the two
#pragma unroll
    for (int x = 0; x < 2; ++x)
      tf32_prepare<Tr::BLOCK_M, Tr::HEAD_DIM, Tr::X3, true, THREADS>(sm.x(s, x), sm.x_big(s, x), sm.xt(s, x),
                                                                     sm.xt_small(s, x), tid,
                                                                     x * (Tr::BLOCK_M * Tr::HEAD_DIM / 128));
    fence_proxy_async_shared();  // generic writes before the consumers' wgmma (async proxy) reads
    mbarrier_arrive(sm.q_ready(s));
  }
}

// A consumer's dK (times softmax_scale) and dV to global memory: this warp's 16 keys (key_row0 in the CTA's), the valid
// keys and head_dim columns only
template <class Tr, class KeyBlock>
__device__ __forceinline__ void bwd_tf32_store_dk_dv(const BwdParams& p, const KeyBlock& kb,
                                                     const float (&dk_acc)[Tr::D_TILES][4],
                                                     const float (&dv_acc)[Tr::D_TILES][4], int key_row0, int lane,
                                                     int col0) {
  const int g = lane >> 2, t = lane & 3;
  const long long row0 = static_cast<long long>(kb.seq.k_row0) + kb.n0;  // (BwdKeyBlock::key_rows steps u16)
  float* dk = reinterpret_cast<float*>(p.dk) + kb.batch * p.dk_batch_stride + kb.kv_head * p.dk_head_stride +
              row0 * p.dk_row_stride;
  float* dv = reinterpret_cast<float*>(p.dv) + kb.batch * p.dv_batch_stride + kb.kv_head * p.dv_head_stride +
              row0 * p.dv_row_stride;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key_row0 + g + 8 * h;
    if (key >= kb.keys) continue;
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt) {
      if (col0 + dt * 8 >= p.head_dim) continue;  // head_dim is a multiple of 8
      const int col = col0 + dt * 8 + 2 * t;
      *reinterpret_cast<float2*>(dk + key * p.dk_row_stride + col) =
          make_float2(dk_acc[dt][2 * h] * p.softmax_scale, dk_acc[dt][2 * h + 1] * p.softmax_scale);
      *reinterpret_cast<float2*>(dv + key * p.dv_row_stride + col) = make_float2(dv_acc[dt][2 * h], dv_acc[dt][2 * h + 1]);
    }
  }
}

// Consumer warpgroup cwg: keys 64 cwg .. 64 cwg + 63 of the CTA, every step; then its dK, dV. Per step i, as wgmma
// groups in this order: S^T_i and dP^T_i, dV_i once P^T_i is in registers, dK_i once dS^T_i is. OVERLAP (where the
// registers allow it: 16 queries per step; at 32, 20-28 bytes spilled) issues S^T_{i+1} and dP^T_{i+1} right behind
// dK_i and waits for dK_i behind them, so the tensor cores have the next step's products while this step's dK ends,
// and computes dS^T under the dV GEMM into registers of its own (dV still reads P^T's).
template <class Tr, bool IS_CAUSAL, int MODS, class KeyBlock>
__device__ __forceinline__ void bwd_tf32_consumer(const BwdParams& p, const BwdTf32Smem<Tr>& sm, unsigned char* smem,
                                                  const KeyBlock& kb, int all_steps) {
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW, HAS_BIAS = ScoreMods<MODS>::HAS_BIAS;
  constexpr bool OVERLAP = Tr::BLOCK_M == 16;
  // the steps: all_steps (every query block of the group's heads that sees these keys, or with a BlockMask's map
  // those whose tile it does not mark empty), or counted here (bwd_tf32_roles_count: 0 or more)
  const int steps = bwd_tf32_roles_count<Tr, KeyBlock>() ? kb.visible_steps(p, threadIdx.x & 31) : all_steps;
  const int ctid = threadIdx.x - 128;
  const int cwg = __shfl_sync(0xffffffffu, ctid / 128, 0);
  const int wtid = ctid & 127, lane = ctid & 31, warp = wtid / 32, t = lane & 3;
  const int key_row0 = cwg * 64 + warp * 16;  // this warp's first key in the CTA's
  const float scale_log2 = p.scale_log2;
  constexpr bool PAIR = Tr::SPLIT > 1;
  auto rank = [] { return PAIR ? static_cast<int>(cluster_ctarank()) : 0; };  // columns 64 rank .. of the pair

  float dk_acc[Tr::D_TILES][4], dv_acc[Tr::D_TILES][4];
#pragma unroll
  for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk_acc[dt][c] = dv_acc[dt][c] = 0.f;
  float tile[Tr::D_TILES][4];  // one step's dV or dK (a chain of k BLOCK_M), added to dv_acc / dk_acc in fp32
  float s_acc[1][Tr::Q_TILES][4], dp_acc[Tr::Q_TILES][4];
  u32 p_big[Tr::Q_TILES][4], p_small[Tr::X3 ? Tr::Q_TILES : 1][4];  // P^T's A registers for dV (and dS^T's for dK)
  u32 ds_big[OVERLAP ? Tr::Q_TILES : 1][4], ds_small[OVERLAP && Tr::X3 ? Tr::Q_TILES : 1][4];
  u32 k_regs[Tr::K_REG_STEPS > 0 ? Tr::K_REG_STEPS : 1][4];  // K_REG_STEPS: this warp's 16 keys of K's big part

  // S^T_i = K Q_i^T and dP^T_i = V dO_i^T, two commit groups, once step i's operands are ready
  auto issue_sdp = [&](int i) {
    const int s = i % Tr::STAGES;
    mbarrier_wait_or_trap(sm.q_ready(s), (i / Tr::STAGES) & 1);
    mbarrier_wait_or_trap(sm.q_full(s), (i / Tr::STAGES) & 1);  // (done: q_ready follows it) lse_log2, delta
    // K's and V's descriptors from an address the optimizer cannot see through: else it keeps all of them (loop
    // invariants, 2 per k step and part) in registers across the query loop, which spilled
    const u32 k_small = static_cast<u32>(opaque(static_cast<int>(sm.k()))) + Tr::TileKV::offset(cwg * 64, 0);
    const u32 k_big = k_small + (Tr::OFF_KB - Tr::OFF_K), v_small = k_small + (Tr::OFF_V - Tr::OFF_K),
              v_big = k_small + (Tr::OFF_VB - Tr::OFF_K);
    const u32 q_small = sm.x(s, 0), q_big = sm.x_big(s, 0), do_small = sm.x(s, 1), do_big = sm.x_big(s, 1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk)
      if (kk < Tr::K_REG_STEPS)  // (kk is a constant of the unrolled loop)
        tf32x3_sr<Tr::BLOCK_M>(s_acc[0], Tr::TileKV::desc_k_major(k_small, 0, 16 * kk),
                               k_regs[kk < Tr::K_REG_STEPS ? kk : 0], Tr::TileQ::desc_k_major(q_small, 0, 16 * kk),
                               Tr::TileQ::desc_k_major(q_big, 0, 16 * kk), kk > 0);
      else
        tf32_ss<Tr::BLOCK_M, Tr::X3>(
            s_acc[0], Tr::TileKV::desc_k_major(k_small, 0, 16 * kk), Tr::TileKV::desc_k_major(k_big, 0, 16 * kk),
            Tr::TileQ::desc_k_major(q_small, 0, 16 * kk), Tr::TileQ::desc_k_major(q_big, 0, 16 * kk), kk > 0);
    wgmma_commit_group();
#pragma unroll
    for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk)
      tf32_ss<Tr::BLOCK_M, Tr::X3>(
          dp_acc, Tr::TileKV::desc_k_major(v_small, 0, 16 * kk), Tr::TileKV::desc_k_major(v_big, 0, 16 * kk),
          Tr::TileQ::desc_k_major(do_small, 0, 16 * kk), Tr::TileQ::desc_k_major(do_big, 0, 16 * kk), kk > 0);
    wgmma_commit_group();
  };

  // this warpgroup's 64 keys of K and V
  tf32_split_own_rows<Tr::BLOCK_N, Tr::HEAD_DIM, Tr::X3, 2>(sm.kv_full(), sm.kv_ready(), sm.k(), sm.k_big(), sm.v(),
                                                            sm.v_big());
  mbarrier_wait_or_trap(sm.kv_ready(), 0);
  if constexpr (Tr::K_REG_STEPS > 0) tf32_load_a<typename Tr::TileKV>(k_regs, sm.k_big(), key_row0, lane);
  // step i is query block m_begin + i % blocks of the group's query head i / blocks (the producer's walk, qb.next);
  // with a BlockMask's map, the step the producer wrote beside the stage (it skips the empty tiles)
  const int blocks = kb.m_end - kb.m_begin;
  if (bwd_tf32_roles_count<Tr, KeyBlock>() && steps == 0) {  // a map left no step: dK = dV = 0
    bwd_tf32_store_dk_dv<Tr>(p, kb, dk_acc, dv_acc, key_row0, lane, rank() * Tr::HEAD_DIM);
    return;
  }
  if (OVERLAP) issue_sdp(0);
  for (int i = 0; i < steps; ++i) {
    const int s = i % Tr::STAGES;
    if (!OVERLAP) issue_sdp(i);  // (step i's q_full waited for: its step words are visible)
    const int* step = reinterpret_cast<const int*>(smem + (sm.step(s, 0) - sm.base));
    const int head = KeyBlock::MAPPED ? step[0] : kb.kv_head * p.seq.kv_group + i / blocks;
    const int m0 = (KeyBlock::MAPPED ? step[1] : kb.m_begin + i % blocks) * Tr::BLOCK_M;
    // the bias of this step's query head, pulled into L1 while S^T runs;
    // dBias written from dS^T below (each (query head, query, key) is this CTA's alone: stores, or red.add where
    // the bias is broadcast)
    ScoreMods<MODS> mods;
    u32 kept = ~0u;  // the mask's bits, read while S^T runs (a pair: rank 0 applies the bias, ALiBi and the mask)
    if (ScoreMods<MODS>::CHANGES_SCORES) {
      mods.template init<true>(p.mods, kb.batch, head, p.heads, kb.seq.len_q, kb.seq.len_k);
      // (MOD_MASK serves calls with ALiBi alone too: no mask, nothing read)
      mods.check_mask = p.mods.mask.ptr != nullptr && !(KeyBlock::MAPPED && step[2]);
      if (HAS_BIAS && rank() == 0) mods.template prefetch_cols<Tr::BLOCK_M, false>(kb.n0 + key_row0, m0, lane);
      if (ScoreMods<MODS>::HAS_MASK && rank() == 0)
        kept = mask_keep_transposed<MODS, Tr::Q_TILES>(kb.n0 + key_row0, m0, mods, lane);
    }
    // lse_log2 of this thread's query columns (pad rows: +inf)
    const float* lse_smem = reinterpret_cast<const float*>(smem + (sm.lse(s) - sm.base));
    float2 lse[Tr::Q_TILES], delta[Tr::Q_TILES];
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt) lse[qt] = *reinterpret_cast<const float2*>(lse_smem + qt * 8 + 2 * t);
    wgmma_wait_group<1>();  // S^T_i (dP^T_i may run on)
    wgmma_fence_operand(s_acc[0]);
    // P^T in registers of its own: no other instruction than wgmma defines s_acc, whose next product is issued while
    // dK_i runs (written in place, ptxas serialized the wgmma of the whole loop, C7515)
    float prob[1][Tr::Q_TILES][4];
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
      for (int c = 0; c < 4; ++c) prob[0][qt][c] = s_acc[0][qt][c];
    // the bias, ALiBi and the mask before the band's -inf; a pair applies them once, rank 0 to its part before the
    // exchange: (S0 + bias - ALiBi, or -inf) + S1
    if (rank() == 0) {
      if (HAS_BIAS) add_bias_f32_transposed(mods, prob[0], kb.n0 + key_row0, m0, lane);
      alibi_mask_f32_transposed(mods, prob[0], kb.n0 + key_row0, m0, kb.band.diag, kept, lane);
    }
    if constexpr (PAIR) {  // S^T over the other CTA's 64 columns, added
      pair_send(sm.xchg(i & 1, 0, cwg), sm.xbar(i & 1, 0, cwg), prob[0], wtid);
      pair_wait<Tr::Q_TILES>(sm.xbar(i & 1, 0, cwg), (i >> 1) & 1, wtid);
#pragma unroll
      for (int qt = 0; qt < Tr::Q_TILES; ++qt) {
        const float4 v = pair_tile(sm.xchg(i & 1, 0, cwg), qt, wtid);
        prob[0][qt][0] += v.x;
        prob[0][qt][1] += v.y;
        prob[0][qt][2] += v.z;
        prob[0][qt][3] += v.w;
      }
    }
    if (kb.keys < Tr::BLOCK_N || kb.band.needs_mask(m0, m0 + Tr::BLOCK_M - 1, kb.n0, kb.n0 + Tr::BLOCK_N - 1))
      apply_band_mask_transposed<IS_CAUSAL, HAS_WINDOW>(prob[0], kb.n0 + key_row0, m0, kb.band, lane);
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        prob[0][qt][c] = ex2_approx(fmaf(prob[0][qt][c], scale_log2, (c & 1) ? -lse[qt].y : -lse[qt].x));
    tf32_probs_to_regs<Tr::X3>(prob, p_big, p_small);
    // delta of the same columns (pad rows: 0)
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt)
      delta[qt] = *reinterpret_cast<const float2*>(lse_smem + Tr::BLOCK_M + qt * 8 + 2 * t);
    // dV_i = P^T dO_i: B = dO^T (head_dim rows of the step's queries in P^T's column order)
    const u32 dot_big = sm.xt(s, 1), dot_small = sm.xt_small(s, 1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::Q_TILES; ++kk)
      tf32_rs<Tr::HEAD_DIM, Tr::X3>(tile, p_big[kk], p_small[Tr::X3 ? kk : 0],
                                    Tr::TileQt::desc_k_major(dot_big, 0, 16 * kk),
                                    Tr::TileQt::desc_k_major(dot_small, 0, 16 * kk), kk > 0);
    wgmma_commit_group();

    // dP^T_i; without OVERLAP also dV_i, which frees P's registers for dS's (the other consumer's GEMMs keep the
    // tensor cores busy meanwhile)
    if constexpr (OVERLAP) {
      wgmma_wait_group<1>();
    } else {
      wgmma_wait_group<0>();
      wgmma_fence_operand(tile);
      add_tile(dv_acc, tile);
    }
    wgmma_fence_operand(dp_acc);
    if constexpr (PAIR) {  // dP^T over the other CTA's columns, read per n8 tile below (dp_acc is wgmma's alone)
      pair_send(sm.xchg(i & 1, 1, cwg), sm.xbar(i & 1, 1, cwg), dp_acc, wtid);
      pair_wait<Tr::Q_TILES>(sm.xbar(i & 1, 1, cwg), (i >> 1) & 1, wtid);
    }
    // dS^T = P^T (dP^T - delta), in place of P^T (softmax_scale goes on dK at the end). 3xTF32 takes P^T as big + small
    // (about 22 bits) from the A registers, so that the fp32 P^T need not stay live under the dV GEMM (it spilled)
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt) {
      const float4 peer = PAIR ? pair_tile(sm.xchg(i & 1, 1, cwg), qt, wtid) : make_float4(0.f, 0.f, 0.f, 0.f);
      const float dp_peer[4] = {peer.x, peer.y, peer.z, peer.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int r = (c == 1) ? 2 : (c == 2) ? 1 : c;  // tf32_probs_to_regs's register of element c
        const float pr = Tr::X3 ? __uint_as_float(p_big[qt][r]) + __uint_as_float(p_small[Tr::X3 ? qt : 0][r])
                                : prob[0][qt][c];
        const float dp = PAIR ? dp_acc[qt][c] + dp_peer[c] : dp_acc[qt][c];
        prob[0][qt][c] = pr * (dp - ((c & 1) ? delta[qt].y : delta[qt].x));
      }
    }
    if (HAS_BIAS && rank() == 0)  // dBias = dS (the pair's CTAs hold the same dS^T: one writes it)
      mods.put_dbias_tiles(mods.dbias_rows(m0, Tr::BLOCK_M, kb.n0 + key_row0, lane), 0, m0, kb.n0 + key_row0, lane,
                           prob[0]);
    if constexpr (OVERLAP) {
      tf32_probs_to_regs<Tr::X3>(prob, ds_big, ds_small);
      wgmma_wait_group<0>();  // dV_i
      wgmma_fence_operand(tile);
      add_tile(dv_acc, tile);
    } else {
      tf32_probs_to_regs<Tr::X3>(prob, p_big, p_small);
    }
    // dK_i = dS^T Q_i: B = Q^T
    const u32 qt_big = sm.xt(s, 0), qt_small = sm.xt_small(s, 0);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::Q_TILES; ++kk) {
      if constexpr (OVERLAP)
        tf32_rs<Tr::HEAD_DIM, Tr::X3>(tile, ds_big[kk], ds_small[Tr::X3 ? kk : 0],
                                      Tr::TileQt::desc_k_major(qt_big, 0, 16 * kk),
                                      Tr::TileQt::desc_k_major(qt_small, 0, 16 * kk), kk > 0);
      else
        tf32_rs<Tr::HEAD_DIM, Tr::X3>(tile, p_big[kk], p_small[Tr::X3 ? kk : 0],
                                      Tr::TileQt::desc_k_major(qt_big, 0, 16 * kk),
                                      Tr::TileQt::desc_k_major(qt_small, 0, 16 * kk), kk > 0);
    }
    wgmma_commit_group();
    // the next step's S^T and dP^T behind dK_i (s_acc, dp_acc are free: dS^T is in the A registers)
    if (OVERLAP && i + 1 < steps) {
      issue_sdp(i + 1);
      wgmma_wait_group<2>();  // dK_i
    } else {
      wgmma_wait_group<0>();
    }
    wgmma_fence_operand(tile);
    add_tile(dk_acc, tile);
    // stage s is read: every thread arrives, which orders its own reads of lse_log2_i and delta_i before the producer's
    // next copies into the stage (one arrive per warp left the other lanes' reads unordered: racecheck's WAR hazards)
    mbarrier_arrive(sm.q_empty(s));
  }

  bwd_tf32_store_dk_dv<Tr>(p, kb, dk_acc, dv_acc, key_row0, lane, rank() * Tr::HEAD_DIM);
}

// The kernel's body: bwd_sm90_tf32_kernel (one CTA per key block), bwd_sm90_tf32_pair_kernel (SPLIT 2: a cluster of
// two per key block, blockIdx.x / 2 its index)
template <class Tr, bool IS_CAUSAL, int MODS>
__device__ __forceinline__ void bwd_tf32_main(const BwdWsParams& P) {
  static_assert((MODS & ~(MOD_WINDOW | MOD_BIAS | MOD_ALIBI | MOD_MASK)) == 0,
                "bwd_sm90_tf32_kernel takes a window, a bias, ALiBi and a mask");
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const BwdParams& p = P.bwd;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const AlignedSmem aligned = align_smem_1024(smem_raw);
  const BwdTf32Smem<Tr> sm{aligned.base};
  if (dynamic_smem_size() < Tr::SMEM_BYTES) __trap();

  // (a mask: with a BlockMask's map, whose empty tiles are skipped)
  using KeyBlock = BwdKeyBlock<Tr, IS_CAUSAL, HAS_WINDOW, ScoreMods<MODS>::HAS_MASK, false, Tr::SPLIT>;
  const KeyBlock kb(p);
  if (kb.n0 >= kb.seq.len_k) return;  // varlen: past this sequence's keys (both CTAs of a pair)
  // the steps: every query block of the group's heads that sees these keys, less those a BlockMask's map empties
  // (or 1: the roles count them, bwd_tf32_roles_count)
  const int steps = kb.m_begin >= kb.m_end ? 0
                    : bwd_tf32_roles_count<Tr, KeyBlock>() ? 1
                    : KeyBlock::MAPPED ? kb.visible_steps(p, threadIdx.x & 31) : kb.steps(p);
  if (steps == 0) {  // no query sees these keys: dK = dV = 0 (a pair's rank 0 writes every column)
    if (Tr::SPLIT > 1 && cluster_ctarank() != 0) return;
    const long long row0 = static_cast<long long>(kb.seq.k_row0) + kb.n0;
    float* dk = reinterpret_cast<float*>(p.dk) + kb.batch * p.dk_batch_stride + kb.kv_head * p.dk_head_stride +
                row0 * p.dk_row_stride;
    float* dv = reinterpret_cast<float*>(p.dv) + kb.batch * p.dv_batch_stride + kb.kv_head * p.dv_head_stride +
                row0 * p.dv_row_stride;
    for (int idx = threadIdx.x; idx < kb.keys * p.head_dim; idx += Tr::THREADS) {
      const int r = idx / p.head_dim, c = idx % p.head_dim;
      dk[r * p.dk_row_stride + c] = 0.f;
      dv[r * p.dv_row_stride + c] = 0.f;
    }
    return;
  }

  if (threadIdx.x == 0) {
    mbarrier_init(sm.kv_full(), 1);
    mbarrier_init(sm.kv_ready(), Tr::CONSUMER_THREADS);
#pragma unroll
    for (int s = 0; s < Tr::STAGES; ++s) {
      mbarrier_init(sm.q_full(s), 1);
      mbarrier_init(sm.q_ready(s), Tr::SPLIT_THREADS);
      mbarrier_init(sm.q_empty(s), Tr::CONSUMER_THREADS);
    }
    if constexpr (Tr::SPLIT > 1)  // exchange slots: a consumer's 4 warps arrive, the other CTA's stores complete bytes
#pragma unroll
      for (int x = 0; x < 2 * 2 * Tr::CONSUMERS; ++x) mbarrier_init(sm.xbar(0, 0, 0) + 8 * x, 4);
    fence_mbarrier_init();
  }
  if constexpr (Tr::SPLIT > 1)
    cluster_sync();  // both CTAs' barriers initialized before any remote arrival
  else
    __syncthreads();

  if (threadIdx.x < 128) {
    setmaxnreg_dec<Tr::PRODUCER_REGS>();
    if (threadIdx.x == 0)
      bwd_tf32_producer<Tr>(P, sm, kb, Tr::SPLIT > 1 ? static_cast<int>(cluster_ctarank()) * Tr::HEAD_DIM : 0);
    else if (threadIdx.x >= 32)
      bwd_tf32_splitter<Tr>(p, sm, kb, steps, threadIdx.x - 32);
    if constexpr (Tr::SPLIT > 1) cluster_sync();  // (in each role's branch: after their join ptxas serialized wgmma)
  } else {
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    bwd_tf32_consumer<Tr, IS_CAUSAL, MODS>(p, sm, aligned.ptr, kb, steps);
    if constexpr (Tr::SPLIT > 1) cluster_sync();  // the other CTA may still be writing to this one's shared memory
  }
#else
  static_assert(Tr::HEAD_DIM < 0, "bwd_sm90_tf32_kernel uses TMA and TF32 wgmma: compile it for sm_90a");
#endif
}

template <class Tr, bool IS_CAUSAL, int MODS>
__global__ void __launch_bounds__(Tr::THREADS, 1) bwd_sm90_tf32_kernel(const __grid_constant__ BwdWsParams P) {
  static_assert(Tr::SPLIT == 1, "SPLIT 2 runs as bwd_sm90_tf32_pair_kernel");
  bwd_tf32_main<Tr, IS_CAUSAL, MODS>(P);
}
template <class Tr, bool IS_CAUSAL, int MODS>
__global__ void CUFLASH_CLUSTER_PAIR __launch_bounds__(Tr::THREADS, 1)
    bwd_sm90_tf32_pair_kernel(const __grid_constant__ BwdWsParams P) {
  static_assert(Tr::SPLIT == 2, "a pair of CTAs: SPLIT 2");
  bwd_tf32_main<Tr, IS_CAUSAL, MODS>(P);
}

// ==== dQ: bwd_dq_sm90_tf32_kernel ===================================================================================
//
// ---- shared memory ------------------------------------------------------------------------------------------------
// [Q] [Q big] [dO] [dO big] then per stage: [K] [K big] [K^T big] [K^T small] [V] [V big] (one pass: [Q] [dO], per
// stage [K] [K^T] [V]), [SPLIT 2: the exchange slots, per parity, product (S, dP) and consumer], [mbarriers].
//
// ---- the barrier protocol ------------------------------------------------------------------------------------
//   q_full         count 1 + tx: Q, dO         q_ready      count CONSUMER_THREADS: split, each consumer warpgroup
//                                                             its own 64 rows (tf32_split_own_rows)
//   kv_full[s]     count 1 + tx: K_i, V_i      kv_ready[s]  count SPLIT_THREADS: split, K^T written
//   kv_empty[s]    count CONSUMER_WARPS: every consumer's GEMMs on stage s retired
//   xbar[b][x][wg] (SPLIT 2) count 4 + tx: as the dK / dV kernel's, S (x 0) and dP (x 1) of key tile i
// Key tile i uses stage i % STAGES, phase (i / STAGES) & 1; the producer loads tile i after kv_empty of tile
// i - STAGES, and the splitters' writes to the stage follow kv_full of tile i.
template <int HEAD_DIM_, int BLOCK_N_, int STAGES_, int CONSUMERS_, bool X3_, int SPLIT_ = 1, int A_REGS_ = 0>
struct BwdDqTf32Traits {
  static constexpr int HEAD_DIM = HEAD_DIM_;           // columns of this CTA (of HEAD_DIM * SPLIT)
  static constexpr int SPLIT = SPLIT_;                 // CTAs of a cluster sharing the head dim (pair_send)
  static constexpr int BLOCK_N = BLOCK_N_;             // keys per tile
  static constexpr int STAGES = STAGES_;
  static constexpr int CONSUMERS = CONSUMERS_;
  static constexpr bool X3 = X3_;
  // The big parts (3xTF32: the A operand of two of the three products per k8 step) or the rounded values (one pass)
  // of Q (A_REGS 1) or of Q and dO (2) as wgmma A registers of S (and dP), read from shared memory once, so those
  // products read only K's (V's) part from shared memory per k8 step
  static constexpr int A_REGS = A_REGS_;
  // the consumers split Q and dO before setmaxnreg (3xTF32 with both in registers) or at their q_ready wait
  // (tf32_split_own_rows)
  static constexpr bool OWN_SPLIT_FIRST = X3 && A_REGS == 2;
  static constexpr int BLOCK_M = 64 * CONSUMERS;
  static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
  static constexpr int CONSUMER_WARPS = 4 * CONSUMERS;
  static constexpr int SPLIT_THREADS = 96;
  static constexpr int THREADS = 128 + CONSUMER_THREADS;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = CONSUMERS == 3 ? 152 : 232;  // three: 128 x 40 + 384 x 152 <= 64K
  static constexpr int N_TILES = BLOCK_N / 8;          // n8 tiles of S, dP; k8 steps of dQ
  static constexpr int D_TILES = HEAD_DIM / 8;
  static constexpr int QK_K_STEPS = HEAD_DIM / 8;
  using TileQ = SmemTile<BLOCK_M, 2 * HEAD_DIM>;
  using TileKV = SmemTile<BLOCK_N, 2 * HEAD_DIM>;
  using TileKt = SmemTile<HEAD_DIM, 2 * BLOCK_N>;
  static constexpr int BOX_COLS = 32;
  static constexpr int PANELS = HEAD_DIM / BOX_COLS;
  static constexpr int PARTS = X3 ? 2 : 1;
  static constexpr int SMEM_Q = TileQ::BYTES;
  static constexpr int SMEM_KV = TileKV::BYTES;
  static constexpr int OFF_Q = 0, OFF_QB = SMEM_Q;
  static constexpr int OFF_DO = PARTS * SMEM_Q, OFF_DOB = OFF_DO + SMEM_Q;
  static constexpr int OFF_STAGES = 2 * PARTS * SMEM_Q;
  // within a stage: K (small or rounded), K big, K^T big (or rounded), K^T small, V, V big
  static constexpr int STAGE_BYTES = 3 * PARTS * SMEM_KV;
  // a pair's exchange (SPLIT 2): per parity, product (S, dP) and consumer, N_TILES float4 per consumer thread
  static constexpr int XCHG_SLOT = SPLIT > 1 ? N_TILES * 128 * 16 : 0;
  static constexpr int OFF_XCHG = OFF_STAGES + STAGES * STAGE_BYTES;
  static constexpr int BARRIERS = 2 + 3 * STAGES + (SPLIT > 1 ? 2 * 2 * CONSUMERS : 0);
  static constexpr int OFF_BAR = OFF_XCHG + 2 * 2 * CONSUMERS * XCHG_SLOT;
  static constexpr int SMEM_BYTES = OFF_BAR + 8 * BARRIERS + 1024;  // cuflash/config.py BwdDqSm90Tf32Config.smem_bytes

  static_assert(HEAD_DIM == 32 || HEAD_DIM == 64, "32 or 64 columns per CTA");
  static_assert(SPLIT == 1 || (SPLIT == 2 && HEAD_DIM == 64), "head dim 128 as a pair of CTAs of 64 columns");
  static_assert(BLOCK_N == 16 || BLOCK_N == 32 || BLOCK_N == 64, "key tiles of 16-64 rows (one chain of dQ)");
  static_assert(CONSUMERS >= 1 && CONSUMERS <= 3, "one to three consumer warpgroups");
  static_assert(CONSUMERS < 3 || SPLIT == 1, "three consumers: one CTA per query block");
  static_assert(A_REGS >= 0 && A_REGS <= 2, "Q's (1) or Q's and dO's (2) A operands in registers");
  static_assert(STAGES >= 2 && STAGES <= 4, "K/V circular buffers of 2-4 stages");
  static_assert(SMEM_Q % 1024 == 0 && SMEM_KV % 1024 == 0 && TileKt::BYTES == SMEM_KV, "tiles on the swizzle period");
  static_assert(128 * PRODUCER_REGS + CONSUMER_THREADS * CONSUMER_REGS <= 65536 / THREADS / 8 * 8 * THREADS ||
                    CONSUMERS == 1,
                "setmaxnreg exceeds the CTA's registers");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

template <class Tr>
struct DqTf32Smem {
  u32 base;
  __device__ __forceinline__ u32 q() const { return base + Tr::OFF_Q; }
  __device__ __forceinline__ u32 q_big() const { return base + Tr::OFF_QB; }
  __device__ __forceinline__ u32 dout() const { return base + Tr::OFF_DO; }
  __device__ __forceinline__ u32 dout_big() const { return base + Tr::OFF_DOB; }
  __device__ __forceinline__ u32 stage(int s) const { return base + Tr::OFF_STAGES + s * Tr::STAGE_BYTES; }
  __device__ __forceinline__ u32 k(int s) const { return stage(s); }
  __device__ __forceinline__ u32 k_big(int s) const { return stage(s) + Tr::SMEM_KV; }
  __device__ __forceinline__ u32 kt(int s) const { return stage(s) + (Tr::PARTS == 2 ? 2 : 1) * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 kt_small(int s) const { return stage(s) + 3 * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 v(int s) const { return stage(s) + 2 * Tr::PARTS * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 v_big(int s) const { return v(s) + Tr::SMEM_KV; }
  __device__ __forceinline__ u32 bar(int i) const { return base + Tr::OFF_BAR + 8 * i; }
  __device__ __forceinline__ u32 q_full() const { return bar(0); }
  __device__ __forceinline__ u32 q_ready() const { return bar(1); }
  __device__ __forceinline__ u32 kv_full(int s) const { return bar(2 + s); }
  __device__ __forceinline__ u32 kv_ready(int s) const { return bar(2 + Tr::STAGES + s); }
  __device__ __forceinline__ u32 kv_empty(int s) const { return bar(2 + 2 * Tr::STAGES + s); }
  // the pair's exchange slot and barrier of parity b, product x (0: S, 1: dP), consumer wg
  __device__ __forceinline__ u32 xchg(int b, int x, int wg) const {
    return base + Tr::OFF_XCHG + ((b * 2 + x) * Tr::CONSUMERS + wg) * Tr::XCHG_SLOT;
  }
  __device__ __forceinline__ u32 xbar(int b, int x, int wg) const {
    return bar(2 + 3 * Tr::STAGES + (b * 2 + x) * Tr::CONSUMERS + wg);
  }
};

// The TMA thread: Q and dO, then K and V of the n_tiles visible key tiles from n_begin up (the tiles a BlockMask's
// map empties are skipped: TileMap::next_up).
template <class Tr>
__device__ __forceinline__ void dq_tf32_producer(const BwdWsParams& P, const DqTf32Smem<Tr>& sm, const Seq& seq,
                                                 int row0, int head, int batch, const TileMap& tiles, int n_begin,
                                                 int n_end, int n_tiles, int col0) {
  const BwdParams& p = P.bwd;
  prefetch_tensormap(&P.tma_q);
  prefetch_tensormap(&P.tma_do);
  prefetch_tensormap(&P.tma_k);
  prefetch_tensormap(&P.tma_v);
  const int kv_head = head / p.seq.kv_group;
  const int q_batch = p.seq.cu_seqlens_q != nullptr ? 0 : batch;
  const int kv_batch = p.seq.cu_seqlens_k != nullptr ? 0 : batch;
  constexpr int BOX_BYTES = 4 * Tr::BOX_COLS;
  mbarrier_arrive_expect_tx(sm.q_full(), 2 * Tr::SMEM_Q);
#pragma unroll
  for (int panel = 0; panel < Tr::PANELS; ++panel) {
    cp_async_bulk_tensor_4d_global_to_shared(sm.q() + panel * Tr::BLOCK_M * BOX_BYTES, &P.tma_q, sm.q_full(),
                                             col0 + panel * Tr::BOX_COLS, seq.q_row0 + row0, head, q_batch);
    cp_async_bulk_tensor_4d_global_to_shared(sm.dout() + panel * Tr::BLOCK_M * BOX_BYTES, &P.tma_do, sm.q_full(),
                                             col0 + panel * Tr::BOX_COLS, seq.q_row0 + row0, head, q_batch);
  }
  int n_block = n_begin - 1;
  for (int i = 0; i < n_tiles; ++i) {
    const int s = i % Tr::STAGES;
    n_block = tiles.next_up(n_block + 1, n_end);
    mbarrier_wait_or_trap(sm.kv_empty(s), ((i / Tr::STAGES) & 1) ^ 1);
    mbarrier_arrive_expect_tx(sm.kv_full(s), 2 * Tr::SMEM_KV);
    const int key = seq.k_row0 + n_block * Tr::BLOCK_N;
#pragma unroll
    for (int panel = 0; panel < Tr::PANELS; ++panel) {
      cp_async_bulk_tensor_4d_global_to_shared(sm.k(s) + panel * Tr::BLOCK_N * BOX_BYTES, &P.tma_k, sm.kv_full(s),
                                               col0 + panel * Tr::BOX_COLS, key, kv_head, kv_batch);
      cp_async_bulk_tensor_4d_global_to_shared(sm.v(s) + panel * Tr::BLOCK_N * BOX_BYTES, &P.tma_v, sm.kv_full(s),
                                               col0 + panel * Tr::BOX_COLS, key, kv_head, kv_batch);
    }
  }
}

// The splitters: K_i (split, and K^T big and small) and V_i (split) of every key tile (the consumers split Q and dO:
// tf32_split_own_rows).
template <class Tr>
__device__ __forceinline__ void dq_tf32_splitter(const DqTf32Smem<Tr>& sm, int n_tiles, int tid) {
  constexpr int THREADS = Tr::SPLIT_THREADS;
  for (int i = 0; i < n_tiles; ++i) {
    const int s = i % Tr::STAGES;
    mbarrier_wait_or_trap(sm.kv_full(s), (i / Tr::STAGES) & 1);
    tf32_prepare<Tr::BLOCK_N, Tr::HEAD_DIM, Tr::X3, true, THREADS>(sm.k(s), sm.k_big(s), sm.kt(s), sm.kt_small(s), tid);
    tf32_prepare<Tr::BLOCK_N, Tr::HEAD_DIM, Tr::X3, false, THREADS>(sm.v(s), sm.v_big(s), 0, 0, tid);
    fence_proxy_async_shared();
    mbarrier_arrive(sm.kv_ready(s));
  }
}

template <class Tr, bool IS_CAUSAL, int MODS>
__device__ __forceinline__ void dq_tf32_consumer(const BwdParams& p, const DqTf32Smem<Tr>& sm,
                                                 const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                                 long long vec_row0, long long out_row0, int row0, int rows_q,
                                                 int head, int batch, const TileMap& tiles, int n_begin, int n_end,
                                                 int n_tiles) {
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW, HAS_BIAS = ScoreMods<MODS>::HAS_BIAS;
  const int ctid = threadIdx.x - 128;
  const int wg = ctid / 128, lane = ctid & 31, warp = ctid / 32, g = lane >> 2, t = lane & 3;
  const int warp_row = row0 + warp * 16, wg_row = row0 + wg * 64;
  const float scale_log2 = p.scale_log2;
  constexpr bool PAIR = Tr::SPLIT > 1;
  const int rank = PAIR ? static_cast<int>(cluster_ctarank()) : 0;  // columns 64 rank .. of the pair's head dim
  float peer[PAIR ? Tr::N_TILES : 1][4];  // S or dP over the other CTA's columns
  // the bias and the mask, as the forward reads them (the bias pulled into L1 and the mask's bits read while S runs,
  // on the tiles a BlockMask's map does not mark full), and ALiBi
  ScoreMods<MODS> mods;
  if (ScoreMods<MODS>::CHANGES_SCORES)
    mods.template init<true>(p.mods, batch, head, p.heads, row0 + rows_q, band.seqlen_k);
  // lse_log2 and delta of this thread's rows g, g + 8 of its warp (pad rows: +inf and 0). The padded region ends at a
  // multiple of PAD_ROWS (128), which the last of three consumers' 192-row blocks may pass: rows past rows_q (never
  // stored) take the pad values without a load
  float lse[2], delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + g + 8 * h;
    const bool padded = Tr::BLOCK_M > PAD_ROWS && r >= rows_q;
    lse[h] = padded ? __int_as_float(0x7f800000) : __ldg(p.lse_log2 + vec_row0 + r);
    delta[h] = padded ? 0.f : __ldg(p.delta + vec_row0 + r);
  }
  float dq_acc[Tr::D_TILES][4], tile[Tr::D_TILES][4];
#pragma unroll
  for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) dq_acc[dt][c] = 0.f;
  float s_acc[1][Tr::N_TILES][4], dp_acc[Tr::N_TILES][4];
  u32 ds_big[Tr::N_TILES][4], ds_small[Tr::X3 ? Tr::N_TILES : 1][4];
  // A_REGS: this warp's 16 rows of Q's (and dO's) big parts (3xTF32) or rounded values (one pass), wgmma A registers
  u32 q_regs[Tr::A_REGS >= 1 ? Tr::QK_K_STEPS : 1][4], do_regs[Tr::A_REGS >= 2 ? Tr::QK_K_STEPS : 1][4];

  if constexpr (!Tr::OWN_SPLIT_FIRST)  // this warpgroup's rows of Q and dO
    tf32_split_own_rows<Tr::BLOCK_M, Tr::HEAD_DIM, Tr::X3, 2>(sm.q_full(), sm.q_ready(), sm.q(), sm.q_big(),
                                                              sm.dout(), sm.dout_big());
  mbarrier_wait_or_trap(sm.q_ready(), 0);
  if constexpr (Tr::A_REGS >= 1)
    tf32_load_a<typename Tr::TileQ>(q_regs, Tr::X3 ? sm.q_big() : sm.q(), 16 * warp, lane);
  if constexpr (Tr::A_REGS >= 2)
    tf32_load_a<typename Tr::TileQ>(do_regs, Tr::X3 ? sm.dout_big() : sm.dout(), 16 * warp, lane);
  const u32 q_small = static_cast<u32>(opaque(static_cast<int>(sm.q())));
  int n_block = n_begin - 1;
  for (int i = 0; i < n_tiles; ++i) {
    const int s = i % Tr::STAGES;
    n_block = tiles.next_up(n_block + 1, n_end);  // the visible key tiles, from the first up
    const int key0 = n_block * Tr::BLOCK_N;
    mbarrier_wait_or_trap(sm.kv_ready(s), (i / Tr::STAGES) & 1);
    const u32 q_big = q_small + (Tr::OFF_QB - Tr::OFF_Q), do_small = q_small + (Tr::OFF_DO - Tr::OFF_Q),
              do_big = q_small + (Tr::OFF_DOB - Tr::OFF_Q);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk)
      if constexpr (Tr::A_REGS >= 1 && Tr::X3)
        tf32x3_sr<Tr::BLOCK_N>(s_acc[0], Tr::TileQ::desc_k_major(q_small, 64 * wg, 16 * kk), q_regs[kk],
                               Tr::TileKV::desc_k_major(sm.k(s), 0, 16 * kk),
                               Tr::TileKV::desc_k_major(sm.k_big(s), 0, 16 * kk), kk > 0);
      else if constexpr (Tr::A_REGS >= 1)
        Wgmma<Tr::BLOCK_N, tf32>::rs(s_acc[0], q_regs[kk], Tr::TileKV::desc_k_major(sm.k(s), 0, 16 * kk), kk > 0);
      else
        tf32_ss<Tr::BLOCK_N, Tr::X3>(s_acc[0], Tr::TileQ::desc_k_major(q_small, 64 * wg, 16 * kk),
                                     Tr::TileQ::desc_k_major(q_big, 64 * wg, 16 * kk),
                                     Tr::TileKV::desc_k_major(sm.k(s), 0, 16 * kk),
                                     Tr::TileKV::desc_k_major(sm.k_big(s), 0, 16 * kk), kk > 0);
    wgmma_commit_group();
#pragma unroll
    for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk)
      if constexpr (Tr::A_REGS >= 2 && Tr::X3)
        tf32x3_sr<Tr::BLOCK_N>(dp_acc, Tr::TileQ::desc_k_major(do_small, 64 * wg, 16 * kk), do_regs[kk],
                               Tr::TileKV::desc_k_major(sm.v(s), 0, 16 * kk),
                               Tr::TileKV::desc_k_major(sm.v_big(s), 0, 16 * kk), kk > 0);
      else if constexpr (Tr::A_REGS >= 2)
        Wgmma<Tr::BLOCK_N, tf32>::rs(dp_acc, do_regs[kk], Tr::TileKV::desc_k_major(sm.v(s), 0, 16 * kk), kk > 0);
      else
        tf32_ss<Tr::BLOCK_N, Tr::X3>(dp_acc, Tr::TileQ::desc_k_major(do_small, 64 * wg, 16 * kk),
                                     Tr::TileQ::desc_k_major(do_big, 64 * wg, 16 * kk),
                                     Tr::TileKV::desc_k_major(sm.v(s), 0, 16 * kk),
                                     Tr::TileKV::desc_k_major(sm.v_big(s), 0, 16 * kk), kk > 0);
    wgmma_commit_group();
    if (HAS_BIAS && rank == 0) mods.template prefetch_rows<Tr::BLOCK_N, false>(warp_row, key0, lane);
    // (MOD_MASK serves calls with ALiBi alone too: no mask, nothing read)
    if (ScoreMods<MODS>::HAS_MASK) mods.check_mask = p.mods.mask.ptr != nullptr && tiles.state(n_block) != TILE_FULL;
    const u32 kept = rank == 0 ? mask_keep_rows<MODS, Tr::N_TILES>(warp_row, key0, mods, lane) : ~0u;

    wgmma_wait_group<1>();  // S
    wgmma_fence_operand(s_acc[0]);
    // the bias, ALiBi and the mask before the band's -inf; a pair applies them once, rank 0 to its part before the
    // exchange: (S0 + bias - ALiBi, or -inf) + S1
    if (rank == 0) {
      if (HAS_BIAS) add_bias_f32(mods, s_acc[0], warp_row, key0, lane);
      alibi_mask_f32(mods, s_acc[0], warp_row, key0, band.diag, kept, lane);
    }
    if constexpr (PAIR) {
      pair_send(sm.xchg(i & 1, 0, wg), sm.xbar(i & 1, 0, wg), s_acc[0], ctid & 127);
      pair_receive(sm.xchg(i & 1, 0, wg), sm.xbar(i & 1, 0, wg), (i >> 1) & 1, peer, ctid & 127);
#pragma unroll
      for (int nt = 0; nt < Tr::N_TILES; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s_acc[0][nt][c] += peer[PAIR ? nt : 0][c];
    }
    if (band.needs_mask_right(wg_row, key0 + Tr::BLOCK_N - 1) || band.needs_mask_left(wg_row + 63, key0))
      apply_band_mask<IS_CAUSAL, HAS_WINDOW>(s_acc, warp_row, key0, band, lane);
#pragma unroll
    for (int nt = 0; nt < Tr::N_TILES; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) s_acc[0][nt][c] = ex2_approx(fmaf(s_acc[0][nt][c], scale_log2, -lse[c >> 1]));
    wgmma_wait_group<0>();  // dP
    wgmma_fence_operand(dp_acc);
    if constexpr (PAIR) {
      pair_send(sm.xchg(i & 1, 1, wg), sm.xbar(i & 1, 1, wg), dp_acc, ctid & 127);
      pair_receive(sm.xchg(i & 1, 1, wg), sm.xbar(i & 1, 1, wg), (i >> 1) & 1, peer, ctid & 127);
    }
#pragma unroll
    for (int nt = 0; nt < Tr::N_TILES; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        s_acc[0][nt][c] *= (PAIR ? dp_acc[nt][c] + peer[PAIR ? nt : 0][c] : dp_acc[nt][c]) - delta[c >> 1];
    tf32_probs_to_regs<Tr::X3>(s_acc, ds_big, ds_small);
    // dQ_i = dS K: B = K^T (head_dim rows of the tile's keys in dS's column order)
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::N_TILES; ++kk)
      tf32_rs<Tr::HEAD_DIM, Tr::X3>(tile, ds_big[kk], ds_small[Tr::X3 ? kk : 0],
                                    Tr::TileKt::desc_k_major(sm.kt(s), 0, 16 * kk),
                                    Tr::TileKt::desc_k_major(sm.kt_small(s), 0, 16 * kk), kk > 0);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operand(tile);
    if (lane == 0) mbarrier_arrive(sm.kv_empty(s));
    add_tile(dq_acc, tile);
  }

  float* dq = reinterpret_cast<float*>(p.dq) + batch * p.dq_batch_stride + out_row0 * p.dq_row_stride +
              head * p.dq_head_stride;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp * 16 + g + 8 * h;
    if (row >= rows_q) continue;
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt)
      if (rank * Tr::HEAD_DIM + dt * 8 < p.head_dim)
        *reinterpret_cast<float2*>(dq + row * p.dq_row_stride + rank * Tr::HEAD_DIM + dt * 8 + 2 * t) =
            make_float2(dq_acc[dt][2 * h] * p.softmax_scale, dq_acc[dt][2 * h + 1] * p.softmax_scale);
  }
}

// The kernel's body: bwd_dq_sm90_tf32_kernel (one CTA per query block), bwd_dq_sm90_tf32_pair_kernel (SPLIT 2: a
// cluster of two per query block, blockIdx.x / 2 its index)
template <class Tr, bool IS_CAUSAL, int MODS>
__device__ __forceinline__ void bwd_dq_tf32_main(const BwdWsParams& P) {
  static_assert((MODS & ~(MOD_WINDOW | MOD_BIAS | MOD_ALIBI | MOD_MASK)) == 0,
                "bwd_dq_sm90_tf32_kernel takes a window, a bias, ALiBi and a mask");
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const BwdParams& p = P.bwd;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const AlignedSmem aligned = align_smem_1024(smem_raw);
  const DqTf32Smem<Tr> sm{aligned.base};
  if (dynamic_smem_size() < Tr::SMEM_BYTES) __trap();

  const int m_block = IS_CAUSAL ? (gridDim.x / Tr::SPLIT - 1 - blockIdx.x / Tr::SPLIT)
                                : blockIdx.x / Tr::SPLIT;  // causal: longest first
  const int head = blockIdx.y, batch = blockIdx.z;
  const Seq seq = sequence(p.seq, batch);
  const int row0 = m_block * Tr::BLOCK_M;
  if (row0 >= seq.len_q) return;  // varlen: past this sequence's end
  const int rows_q = min(Tr::BLOCK_M, seq.len_q - row0);
  const long long out_row0 = static_cast<long long>(seq.q_row0) + row0;
  const Band<IS_CAUSAL, HAS_WINDOW> band{seq.len_k, seq.len_k - seq.len_q, HAS_WINDOW ? p.mods.window_left : 0,
                                        HAS_WINDOW ? p.mods.window_right : 0};
  const int n_begin = band.template key_block_begin<Tr::BLOCK_N>(row0);
  const int n_end = band.template key_block_end<Tr::BLOCK_N>(row0 + rows_q - 1);
  // the key tiles these rows see: the band's, less those a BlockMask's map marks empty (every warp counts them)
  TileMap tiles;
  tiles.init(p.mods, ScoreMods<MODS>::HAS_MASK, batch, head, m_block);
  const int n_tiles = n_end > n_begin ? tiles.count_warp(n_begin, n_end, threadIdx.x & 31) : 0;
  if (n_tiles <= 0) {  // these rows see no key: dQ = 0 (a pair's rank 0 writes every column)
    if (Tr::SPLIT > 1 && cluster_ctarank() != 0) return;
    float* dq = reinterpret_cast<float*>(p.dq) + batch * p.dq_batch_stride + out_row0 * p.dq_row_stride +
                head * p.dq_head_stride;
    for (int idx = threadIdx.x; idx < rows_q * p.head_dim; idx += Tr::THREADS)
      dq[(idx / p.head_dim) * p.dq_row_stride + idx % p.head_dim] = 0.f;
    return;
  }
  const long long vec_row0 = padded_row0(p.seq, batch, head, p.heads, p.seqlen_q_pad) + row0;

  if (threadIdx.x == 0) {
    mbarrier_init(sm.q_full(), 1);
    mbarrier_init(sm.q_ready(), Tr::CONSUMER_THREADS);
#pragma unroll
    for (int s = 0; s < Tr::STAGES; ++s) {
      mbarrier_init(sm.kv_full(s), 1);
      mbarrier_init(sm.kv_ready(s), Tr::SPLIT_THREADS);
      mbarrier_init(sm.kv_empty(s), Tr::CONSUMER_WARPS);
    }
    if constexpr (Tr::SPLIT > 1)  // exchange slots: a consumer's 4 warps arrive, the other CTA's stores complete bytes
#pragma unroll
      for (int x = 0; x < 2 * 2 * Tr::CONSUMERS; ++x) mbarrier_init(sm.xbar(0, 0, 0) + 8 * x, 4);
    fence_mbarrier_init();
  }
  if constexpr (Tr::SPLIT > 1)
    cluster_sync();  // both CTAs' barriers initialized before any remote arrival
  else
    __syncthreads();

  if (threadIdx.x < 128) {
    if constexpr (Tr::CONSUMERS > 1) setmaxnreg_dec<Tr::PRODUCER_REGS>();
    if (threadIdx.x == 0)
      dq_tf32_producer<Tr>(P, sm, seq, row0, head, batch, tiles, n_begin, n_end, n_tiles,
                           Tr::SPLIT > 1 ? static_cast<int>(cluster_ctarank()) * Tr::HEAD_DIM : 0);
    else if (threadIdx.x >= 32)
      dq_tf32_splitter<Tr>(sm, n_tiles, threadIdx.x - 32);
    if constexpr (Tr::SPLIT > 1) cluster_sync();  // (in each role's branch: after their join ptxas serialized wgmma)
  } else {
    if constexpr (Tr::OWN_SPLIT_FIRST)  // this warpgroup's rows of Q and dO
      tf32_split_own_rows<Tr::BLOCK_M, Tr::HEAD_DIM, Tr::X3, 2>(sm.q_full(), sm.q_ready(), sm.q(), sm.q_big(),
                                                                sm.dout(), sm.dout_big());
    if constexpr (Tr::CONSUMERS > 1) setmaxnreg_inc<Tr::CONSUMER_REGS>();
    dq_tf32_consumer<Tr, IS_CAUSAL, MODS>(p, sm, band, vec_row0, out_row0, row0, rows_q, head, batch, tiles, n_begin,
                                          n_end, n_tiles);
    if constexpr (Tr::SPLIT > 1) cluster_sync();  // the other CTA may still be writing to this one's shared memory
  }
#else
  static_assert(Tr::HEAD_DIM < 0, "bwd_dq_sm90_tf32_kernel uses TMA and TF32 wgmma: compile it for sm_90a");
#endif
}

template <class Tr, bool IS_CAUSAL, int MODS>
__global__ void __launch_bounds__(Tr::THREADS, 1) bwd_dq_sm90_tf32_kernel(const __grid_constant__ BwdWsParams P) {
  static_assert(Tr::SPLIT == 1, "SPLIT 2 runs as bwd_dq_sm90_tf32_pair_kernel");
  bwd_dq_tf32_main<Tr, IS_CAUSAL, MODS>(P);
}
template <class Tr, bool IS_CAUSAL, int MODS>
__global__ void CUFLASH_CLUSTER_PAIR __launch_bounds__(Tr::THREADS, 1)
    bwd_dq_sm90_tf32_pair_kernel(const __grid_constant__ BwdWsParams P) {
  static_assert(Tr::SPLIT == 2, "a pair of CTAs: SPLIT 2");
  bwd_dq_tf32_main<Tr, IS_CAUSAL, MODS>(P);
}

}  // namespace cuflash
