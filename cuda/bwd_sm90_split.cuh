// bwd_sm90_split.cuh: the 16-bit backward at head dims 192 and 256 on sm_90a wgmma, dK and dV split across two
// warpgroups by head-dim halves (FlashAttention-3's layout for wide heads: Shah et al. 2024).
//
// bwd_sm90_kernel gives each warpgroup 64 keys and their whole dK and dV rows in registers: 2 x 64 x HEAD_DIM fp32
// values per warpgroup, 128 registers a thread at HEAD_DIM 128, 256 at 256, which do not fit. Here one CTA owns 64
// keys (BLOCK_N) and two warpgroups share them: warpgroup w keeps dK and dV of all 64 keys for the columns
// w * HALF .. w * HALF + HALF - 1 (HALF = HEAD_DIM / 2: 128 registers a thread at HEAD_DIM 256). Per query block
// (BLOCK_M = 64 queries), every product once (the five of FlashAttention-2's backward):
//   warpgroup 0: S^T = K Q^T (keys x queries, the whole head dim), the score modifiers, P^T = exp2(S^T scale_log2
//                - lse_log2)
//   warpgroup 1: dP^T = V dO^T                                           (both at once on the tensor cores)
//   P^T (input dtype) -> shared memory; warpgroup 1 reads it back in its own accumulator positions (the two
//   warpgroups' fragments of a 64 x 64 tile cover the same elements thread by thread) and computes
//   dS^T = P^T (dP^T - delta) -> shared memory
//   With dropout or soft-capping the P^T tile holds the kept P^T (dV's operand) and warpgroup 0 also writes P^T
//   undropped, times the softcap's derivative, into the dS^T tile, where warpgroup 1 reads it and overwrites it
//   with dS^T (each thread the elements it read); dropout's keep bits, computed by warpgroup 0 under its S^T
//   GEMM, go to warpgroup 1 through shared memory (one word per thread).
//   both: dV[:, half w] += P^T dO[:, half w] (A: warpgroup 0's P^T registers, warpgroup 1's P^T tile), then
//   dK[:, half w] += dS^T Q[:, half w] (A: the dS^T tile); B N-major
//   both: dQ[:, half w] += dS K[:, half w] (dS^T read M-major, K N-major) in chunks of DQ_CHUNK columns, each chunk
//   added to dQ_acc from the accumulator registers (red.global.add.v4.f32, one 16-byte add per n8 tile and thread),
//   one step late: in the next step, where the warpgroup would otherwise wait for the other (warpgroup 1 while
//   warpgroup 0 computes P^T, warpgroup 0 while warpgroup 1 computes dS^T; two dS^T buffers, the step's and the
//   last step's), and the last step's after the query loop. IS_DETERMINISTIC without ORDERED: no dQ (bwd_dq_kernel
//   computes it); ORDERED (deterministic): the same adds within the step, each CTA's on a query block in its turn
//   (below). dQ_acc is in bwd_sm90_ws_kernel's accumulator order
//   (its "dQ_acc layout": a warpgroup here is a consumer there, HALF its DQ_COLS), converted by
//   bwd_convert_dq_ws_kernel.
//   ORDERED: one int32 counter per 64 rows of dQ_acc (BwdParams::dq_turns, zeroed by the preprocess) counts the key
//   blocks that have added into the query block; thread 0 waits (ld.acquire) until it equals this CTA's turn
//   (bwd.cuh ordered_dq_turn: ascending key blocks, or with causal or a window descending from the highest key block
//   that sees the query block, the grid then launched last-first) under warpgroup 1's dS^T, before the dS^T
//   barrier; after the step's closing CTA barrier (every thread's adds issued) thread 0 fences and increments the
//   counter (red.release), as bwd_wide_kernel's ordered adds, but in the next step, under its S^T GEMM (after the
//   last step, at the kernel's end), so that neither the fence's wait for the adds nor an extra barrier stalls the
//   CTA: every element of dQ_acc receives its adds in the same order on every run.
// Query walk (GQA, varlen, causal and window bands), prologue and epilogue are bwd_sm90_kernel's (bwd.cuh
// BwdKeyBlock, QueryBlock). Loads are TMA copies issued by thread 0, as bwd_sm90_ws_kernel's producer issues them
// (the same tensor maps, BwdWsParams, and boxes of PANEL_COLS columns): K and V once, then per step Q_i, dO_i and
// lse_log2_i, delta_i (1-D bulk copies) into a stage, completing on that stage's mbarrier (transaction bytes), which
// every thread waits on before the step. Thread 0 issues the next step's copies into the other stage once its last
// readers have retired: after the P^T barrier (the default mode), or after its S^T GEMM (the deterministic modes,
// whose steps end at a CTA barrier). Rows of a box past the
// sequence are zero-filled (dense) or the next sequence's (packed): their lse_log2 is +inf (pad rows, seqs.cuh), so
// P = dS = 0 there, as in bwd_sm90_ws_kernel. (Copies by the 256 threads' cp.async queued behind the last step's dQ
// reds in the load-store path: PERFORMANCE.md "Hopper wide-head backward".) Score modifiers: window, ALiBi, soft-capping, dropout (a bias or mask runs on the mma.sync backward).
//
// ---- shared memory (BwdSm90SplitTraits) -------------------------------------------------------------------
// [K] [V] [stage 0: Q, dO] [stage 1: Q, dO] [P^T] [dS^T 0] [dS^T 1] [stage 0: lse_log2, delta] [stage 1: ...]
// [keep bits: one word per thread of warpgroup 0] [deterministic: the dQ counter thread 0 releases next, 16 bytes]
// [mbarriers: kv_full, q_full[2]]
// 16-bit tiles in the swizzled panels of tiles.cuh (64-column panels at HEAD_DIM 256, 32-column at 192, so that a
// half starts on a panel); dS^T and P^T are 64 x 64 tiles written in the layout bwd_sm90_store_ds writes.
//
// ---- synchronization per step (all 256 threads; a CTA has no other warps) ----------------------------------
//   q_full[stage]  every thread waits: the step's Q, dO, lse_log2, delta have landed (K and V: kv_full, before the
//                  first step); the parity flips each time a stage comes round again
//   __syncthreads  P^T is in shared memory (warpgroup 0 wrote it, fenced: warpgroup 1's dV wgmma reads it). Each
//                  warpgroup has waited for every GEMM it issued in the last step (its dK GEMMs retire at this step's
//                  first wait), so thread 0 then loads the next step into the other stage, the last step's
//   __syncthreads  dS^T is in shared memory (fenced: the dK wgmma and the next step's dQ wgmma read it). Warpgroup 1
//                  has retired its dV GEMM, the last reader of P^T; the last step's dQ, the last reader of the other
//                  dS^T buffer, has retired (warpgroup 1's before the P^T barrier, warpgroup 0's before this one)
//   The default mode has no third barrier: what the next step writes before its P^T barrier (P^T, the keep bits,
//   with dropout or softcap the second P^T in the other dS^T buffer) was last read before this step's dS^T
//   barrier, and what it writes after (its dS^T, the TMA copies) waits for that barrier.
//   The deterministic modes end each step at a third __syncthreads, every GEMM of the step retired, and thread 0
//   loads the next step after its S^T GEMM (ORDERED: the barrier also orders the step's dQ adds before thread 0's
//   release of them).
#pragma once
#include "ptx.cuh"
#include "ptx_wgmma.cuh"
#include "traits.cuh"
#include "tiles.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "bwd.cuh"
#include "bwd_sm90.cuh"     // bwd_sm90_store_ds
#include "bwd_sm90_ws.cuh"  // BwdWsParams (the tensor maps)

namespace cuflash {

template <int HEAD_DIM_, class T_>
struct BwdSm90SplitTraits {
  using T = T_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = 64;                // query rows per step
  static constexpr int BLOCK_N = 64;                // keys per CTA, shared by both warpgroups
  static constexpr int CTAS_PER_SM = 1;
  static constexpr int WARPGROUPS = 2;              // head-dim halves of dK, dV, dQ
  static constexpr int THREADS = 128 * WARPGROUPS;
  static constexpr int HALF = HEAD_DIM / 2;         // dK, dV, dQ columns per warpgroup
  static constexpr int Q_TILES = BLOCK_M / 8;       // n8 (query) tiles of S^T, dP^T
  static constexpr int QK_K_STEPS = HEAD_DIM / 16;  // k16 steps of S^T and dP^T
  static constexpr int Q_K_STEPS = BLOCK_M / 16;    // k16 steps of dV += P^T dO, dK += dS^T Q
  static constexpr int DKV_TILES = HALF / 8;        // n8 tiles of a warpgroup's dK, dV
  static constexpr int DQ_CHUNK = HALF <= 96 ? HALF : 64;  // dQ columns per GEMM (bwd_split_query_block)
  static constexpr int DQ_CHUNKS = HALF / DQ_CHUNK;
  static constexpr int DQ_TILES = DQ_CHUNK / 8;
  static constexpr int DQ_K_STEPS = BLOCK_N / 16;
  static constexpr int PANEL_COLS = HALF % 64 == 0 ? 64 : 32;  // a half starts on a panel boundary

  using TileQ = SmemTile<BLOCK_M, HEAD_DIM, PANEL_COLS>;   // Q_i and dO_i
  using TileKV = SmemTile<BLOCK_N, HEAD_DIM, PANEL_COLS>;  // K_j and V_j; reused to stage dK, dV
  using TileDS = SmemTile<BLOCK_N, BLOCK_M>;               // dS^T or P^T (keys x queries)
  static constexpr int SMEM_Q = TileQ::BYTES;
  static constexpr int SMEM_KV = TileKV::BYTES;
  static constexpr int SMEM_DS = TileDS::BYTES;
  static constexpr int SMEM_ROWVEC = BLOCK_M * 4;  // lse_log2 or delta of one query block (fp32)
  static constexpr int PANELS = HEAD_DIM / PANEL_COLS;  // TMA boxes per 16-bit tile
  static constexpr int PANEL_BYTES = TileQ::PANEL_BYTES;
  static constexpr int Q_TX = 2 * TileQ::BYTES + 2 * BLOCK_M * 4;  // transaction bytes of one step
  static constexpr int OFF_K = 0;
  static constexpr int OFF_V = SMEM_KV;
  static constexpr int OFF_Q = 2 * SMEM_KV;                // + stage * 2 * SMEM_Q
  static constexpr int OFF_DO = OFF_Q + SMEM_Q;            // + stage * 2 * SMEM_Q
  static constexpr int OFF_P = 2 * SMEM_KV + 4 * SMEM_Q;
  static constexpr int OFF_DS = OFF_P + SMEM_DS;           // + buffer * SMEM_DS (two: the step's and the last step's)
  static constexpr int OFF_LSE = OFF_DS + 2 * SMEM_DS;     // + stage * 2 * SMEM_ROWVEC
  static constexpr int OFF_DELTA = OFF_LSE + SMEM_ROWVEC;  // + stage * 2 * SMEM_ROWVEC
  static constexpr int OFF_KEEP = OFF_LSE + 4 * SMEM_ROWVEC;  // dropout's keep bits (u32 per thread of warpgroup 0)
  static constexpr int OFF_RELEASE = OFF_KEEP + 128 * 4;      // deterministic: the dQ counter to release (thread 0)
  static constexpr int OFF_BAR = OFF_RELEASE + 16;            // kv_full, q_full[2]
  static constexpr int SMEM_BYTES = OFF_BAR + 8 * 3 + 1024;   // (cuflash/config.py BwdSm90SplitConfig.smem_bytes)

  static_assert(HEAD_DIM == 192 || HEAD_DIM == 256, "head dims 192 and 256 (narrower ones: bwd_sm90_kernel)");
  static_assert(is_wgmma_n(BLOCK_M) && is_wgmma_n(HALF) && is_wgmma_n(DQ_CHUNK), "wgmma N sizes");
  static_assert(DQ_CHUNK % PANEL_COLS == 0 && HALF % DQ_CHUNK == 0, "dQ's chunks of K start on panels");
  static_assert(HALF % PANEL_COLS == 0, "a warpgroup's columns are whole panels");
  static_assert(OFF_P % 1024 == 0 && SMEM_Q % 1024 == 0 && SMEM_KV % 1024 == 0 && SMEM_DS % 1024 == 0,
                "1024-byte swizzle periods");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
  static_assert(OFF_LSE % 16 == 0 && OFF_DELTA % 16 == 0 && OFF_BAR % 8 == 0, "bulk copy and mbarrier alignment");
  static_assert(Q_TX < (1 << 20) && 2 * SMEM_KV < (1 << 20), "expect_tx counts stay below 2^20");
};

// Thread 0's copies of one step (query block qb) into `stage`, completing on its q_full barrier: Q_i and dO_i by
// their tensor maps (row coordinate q_row0 + m_block * BLOCK_M: a packed operand's map is one batch of all rows),
// lse_log2_i and delta_i (BLOCK_M floats each, pad rows included) by 1-D bulk copies.
template <class Tr, class KeyBlock>
__device__ __forceinline__ void bwd_split_load_step(const BwdWsParams& P, u32 smem_base, int stage,
                                                    const QueryBlock<Tr>& qb, const KeyBlock& kb) {
  constexpr u32 PANEL_Q = Tr::BLOCK_M * Tr::PANEL_BYTES;
  const u32 bar = smem_base + Tr::OFF_BAR + 8 * (1 + stage);
  const u32 q_smem = smem_base + Tr::OFF_Q + stage * 2 * Tr::SMEM_Q;
  const u32 do_smem = smem_base + Tr::OFF_DO + stage * 2 * Tr::SMEM_Q;
  const int q_batch = P.bwd.seq.cu_seqlens_q != nullptr ? 0 : kb.batch;
  const int row = kb.seq.q_row0 + qb.m_block * Tr::BLOCK_M;
  mbarrier_arrive_expect_tx(bar, Tr::Q_TX);
#pragma unroll
  for (int panel = 0; panel < Tr::PANELS; ++panel) {
    cp_async_bulk_tensor_4d_global_to_shared(q_smem + panel * PANEL_Q, &P.tma_q, bar, panel * Tr::PANEL_COLS, row,
                                             qb.head, q_batch);
    cp_async_bulk_tensor_4d_global_to_shared(do_smem + panel * PANEL_Q, &P.tma_do, bar, panel * Tr::PANEL_COLS, row,
                                             qb.head, q_batch);
  }
  cp_async_bulk_global_to_shared(smem_base + Tr::OFF_LSE + stage * 2 * Tr::SMEM_ROWVEC, P.bwd.lse_log2 + qb.vec_row,
                                 Tr::SMEM_ROWVEC, bar);
  cp_async_bulk_global_to_shared(smem_base + Tr::OFF_DELTA + stage * 2 * Tr::SMEM_ROWVEC, P.bwd.delta + qb.vec_row,
                                 Tr::SMEM_ROWVEC, bar);
}

// dQ_i[:, half wg] = dS K_j[:, half wg] of one step (its dS^T tile at smem_base + ds_off) added to dQ_acc from the
// block's first fp32 row vec_row (QueryBlock). Returns with every GEMM this warpgroup issued retired.
template <class Tr>
__device__ __forceinline__ void bwd_split_dq(const BwdParams& p, u32 smem_base, u32 ds_off, long long vec_row, int wg,
                                             int warp, int lane, float (&dk_acc)[Tr::DKV_TILES][4],
                                             float (&dv_acc)[Tr::DKV_TILES][4]) {
  using T = typename Tr::T;
  // dQ_i[:, half] = dS K_j[:, half] in chunks of DQ_CHUNK columns (at HEAD_DIM 256 a whole half's 64 accumulators
  // beside dK and dV spilled): A = dS^T read M-major (queries are its contiguous dimension), B = K_j N-major; each
  // chunk added to dQ_acc straight from the accumulators, one red.global.add.v4.f32 per n8 tile and thread, in dQ_acc
  // order (consecutive threads consecutive 16 bytes: a warp's add covers 512 contiguous bytes; pad rows exist in
  // dQ_acc: whole blocks). Through shared memory and one bulk reduction per chunk (cp.reduce.async.bulk, the warp-
  // specialized kernel's way) the D 256 backward was 8-12 % slower, D 192 1-2 %: a step's reductions took most of
  // the next step to read their buffers, which the next loads or chunk stores then waited for; red.global.add.v2.f32
  // per pair of elements, twice the instructions, was slower than the bulk reductions (PERFORMANCE.md "Hopper
  // wide-head backward").
  // this warpgroup's columns start at float4 wg * HALF / 8 * 128
  float* dq = p.dq_accum + vec_row * Tr::HEAD_DIM + wg * Tr::HALF * Tr::BLOCK_M + ((warp % 4) * 32 + lane) * 4;
  const u32 k_smem = smem_base + Tr::OFF_K;
#pragma unroll 1
  for (int chunk = 0; chunk < Tr::DQ_CHUNKS; ++chunk) {
    const int col0 = wg * Tr::HALF + chunk * Tr::DQ_CHUNK;
    float dq_acc[Tr::DQ_TILES][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::DQ_K_STEPS; ++kk)
      Wgmma<Tr::DQ_CHUNK, T>::template ss</*TRANS_A=*/1, /*TRANS_B=*/1>(
          dq_acc, Tr::TileDS::desc_mn_major(smem_base + ds_off, kk * 16, 0),
          Tr::TileKV::desc_mn_major(k_smem, kk * 16, col0), /*scale_d=*/kk > 0);
    wgmma_commit_group();
    wgmma_wait_group<0>();  // (the first also retires the GEMMs issued before it)
    wgmma_fence_operand(dv_acc);
    wgmma_fence_operand(dk_acc);
    wgmma_fence_operand(dq_acc);
    float* dst = dq + chunk * Tr::DQ_CHUNK * Tr::BLOCK_M;
#pragma unroll
    for (int dt = 0; dt < Tr::DQ_TILES; ++dt)
      red_add_v4_f32(dst + dt * 128 * 4, dq_acc[dt][0], dq_acc[dt][1], dq_acc[dt][2], dq_acc[dt][3]);
  }
}

// One query block for warpgroup wg (see the file comment), its dS^T into buffer `buf`. DEFER (the default mode):
// the step's dQ is left to the next step, and the last step's (buffer buf ^ 1, rows from prev_vec_row; none where
// prev_vec_row < 0) computed here where this warpgroup would wait for the other: warpgroup 1 while warpgroup 0
// computes P^T, warpgroup 0 while warpgroup 1 computes dS^T. Returns with every GEMM it issued retired, except
// DEFER's dK GEMMs (the next step's first wait, or the last step's dQ after the query loop, retires them).
template <class Tr, bool IS_CAUSAL, bool ADDS_DQ, bool ORDERED, int MODS, class LoadNext>
__device__ __forceinline__ void bwd_split_query_block(const BwdParams& p, bool is_masked, int turn,
                                                      const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                                      const ScoreMods<MODS>& mods, unsigned char* smem, u32 smem_base,
                                                      int stage, int buf, int m_block, int n0, long long vec_row,
                                                      long long prev_vec_row, int wg, int warp, int lane,
                                                      float (&dk_acc)[Tr::DKV_TILES][4],
                                                      float (&dv_acc)[Tr::DKV_TILES][4], LoadNext&& load_next) {
  using T = typename Tr::T;
  using Mods = ScoreMods<MODS>;
  // a second P^T (undropped, times the softcap's derivative) for dS^T, in the dS^T tile
  constexpr bool HAS_PS = Mods::HAS_DROPOUT || Mods::HAS_SOFTCAP;
  // dQ one step late (ORDERED adds in the step, in its turn)
  constexpr bool DEFER = ADDS_DQ && !ORDERED;
  // the tiles' addresses from a value the optimizer cannot see through: else it keeps the K, V (loop invariants) and
  // per-stage Q, dO descriptors of every k step in registers across the query loop, which spilled
  smem_base = static_cast<u32>(opaque(static_cast<int>(smem_base)));
  const int t = lane & 3, g = lane >> 2;
  const int key_row0 = (warp % 4) * 16;  // this warp's first key row in the tile (both warpgroups hold all 64)
  const int m0 = m_block * Tr::BLOCK_M;
  const u32 q_smem = smem_base + Tr::OFF_Q + stage * 2 * Tr::SMEM_Q;
  const u32 do_smem = smem_base + Tr::OFF_DO + stage * 2 * Tr::SMEM_Q;
  const int ds_off = Tr::OFF_DS + buf * Tr::SMEM_DS;  // this step's dS^T; buf ^ 1: the last step's
  const float* lse_log2_smem = reinterpret_cast<const float*>(smem + Tr::OFF_LSE + stage * 2 * Tr::SMEM_ROWVEC);
  const float* delta_smem = reinterpret_cast<const float*>(smem + Tr::OFF_DELTA + stage * 2 * Tr::SMEM_ROWVEC);
  u32* keep_smem = reinterpret_cast<u32*>(smem + Tr::OFF_KEEP) + (warp % 4) * 32 + lane;  // this thread's position

  // S^T = K Q^T (warpgroup 0) or dP^T = V dO^T (warpgroup 1), over the whole head dim
  float acc[Tr::Q_TILES][4];
  {
    const u32 a_smem = smem_base + (wg == 0 ? Tr::OFF_K : Tr::OFF_V);
    const u32 b_smem = wg == 0 ? q_smem : do_smem;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk)
      Wgmma<Tr::BLOCK_M, T>::template ss</*TRANS_A=*/0, /*TRANS_B=*/0>(
          acc, Tr::TileKV::desc_k_major(a_smem, 0, kk * 16), Tr::TileQ::desc_k_major(b_smem, 0, kk * 16),
          /*scale_d=*/kk > 0);
    wgmma_commit_group();
  }
  // ORDERED: the last step's dQ adds (issued before the barrier that ended it) released to the next key block, under
  // this step's GEMM: thread 0's fence waits for them to reach the L2, here while the tensor cores work, not at the
  // end of the last step with the CTA waiting at a barrier behind it
  if (ORDERED && threadIdx.x == 0) {
    const int release = ld_shared_s32(smem_base + Tr::OFF_RELEASE);
    if (release >= 0) {
      fence_acq_rel_gpu();
      red_release_gpu_add(p.dq_turns + release, 1);
    }
    st_shared_s32(smem_base + Tr::OFF_RELEASE, static_cast<int>(vec_row / 64));  // this step's, for the next
  }
  // thread 0: the next step's Q, dO, lse_log2, delta into the other stage (TMA). DEFER: after the P^T barrier (the
  // last step's dK GEMMs, which read that stage, retire at this step's first wait)
  if (!DEFER) load_next();
  u32 keep = ~0u;  // dropout's keep bits of this thread's S^T elements (Philox), under the GEMM
  if (Mods::HAS_DROPOUT && wg == 0) keep = dropout_keep_transposed<MODS, Tr::Q_TILES>(n0 + key_row0, m0, mods, lane);
  // warpgroup 1: the last step's dQ under its dP^T GEMM and warpgroup 0's P^T (retires dP^T too)
  if (DEFER && wg == 1 && prev_vec_row >= 0)
    bwd_split_dq<Tr>(p, smem_base, Tr::OFF_DS + (buf ^ 1) * Tr::SMEM_DS, prev_vec_row, wg, warp, lane, dk_acc, dv_acc);
  wgmma_wait_group<0>();  // (DEFER: also the last step's dK GEMMs)
  wgmma_fence_operand(acc);
  wgmma_fence_operand(dk_acc);
  wgmma_fence_operand(dv_acc);

  // P^T (warpgroup 0) into A registers, and into shared memory, where warpgroup 1 reads it as its dV's A operand and
  // for dS^T (registers held across both exchanges spilled: warpgroup 0 takes dS^T for dK from shared memory too)
  if (wg == 0) {
    u32 p_regs[Tr::Q_K_STEPS][4];
    float unused_dcap[Tr::Q_TILES][4];  // (bwd_probs_step recovers the softcap's derivative from the score)
    apply_score_mods_transposed(acc, unused_dcap, n0 + key_row0, m0, band.diag, mods, lane);
    if (is_masked) apply_band_mask_transposed<IS_CAUSAL, Mods::HAS_WINDOW>(acc, n0 + key_row0, m0, band, lane);
    if (Mods::HAS_DROPOUT) *keep_smem = keep;
#pragma unroll
    for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk) {
      float pv[2][4], ps[2][4];
      bwd_probs_step<MODS>(acc, kk, lse_log2_smem, p.scale_log2, keep, mods, m0, n0 + key_row0 + g, band.diag, lane,
                           pv, ps);
      pack_k16_a<T>(pv, p_regs[kk]);
      if (HAS_PS) {
        u32 ps_a[4];
        pack_k16_a<T>(ps, ps_a);
        bwd_sm90_store_ds_step<Tr>(smem, ds_off, key_row0, kk, lane, ps_a);
      }
    }
    // dV[:, half 0] += P^T dO_i[:, half 0]: dO_i is [query][d], the k dimension (queries) its rows: read N-major
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk)
      Wgmma<Tr::HALF, T>::template rs</*TRANS_B=*/1>(dv_acc, p_regs[kk], Tr::TileQ::desc_mn_major(do_smem, kk * 16, 0),
                                                     /*scale_d=*/1);
    wgmma_commit_group();
    bwd_sm90_store_ds<Tr>(smem, Tr::OFF_P, key_row0, lane, p_regs);
    fence_proxy_async_shared();  // st.shared -> visible to warpgroup 1's wgmma (async proxy) after the barrier
  }
  __syncthreads();  // P^T is in shared memory
  if (DEFER) load_next();  // every GEMM of the last step has retired: its stage is free
  if (wg == 1) {
    // dV[:, half 1] += P^T dO_i[:, half 1], A = P^T from shared memory (keys x queries: K-major)
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk)
      Wgmma<Tr::HALF, T>::template ss</*TRANS_A=*/0, /*TRANS_B=*/1>(
          dv_acc, Tr::TileDS::desc_k_major(smem_base + Tr::OFF_P, 0, kk * 16),
          Tr::TileQ::desc_mn_major(do_smem, kk * 16, Tr::HALF), /*scale_d=*/1);
    wgmma_commit_group();
    // dS^T = P^T (dP^T - delta), from the input dtype's P^T (as bwd_sm90_kernel's), into shared memory one k16 step
    // at a time (both warpgroups' dK and dQ read it there: held in A registers beside dP^T it spilled). With dropout
    // or softcap, from the second P^T in the dS^T tile, overwritten in place (ds_of: dropout's dP^T / (1 - p)).
    if (Mods::HAS_DROPOUT) keep = *keep_smem;
#pragma unroll
    for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk) {
      float ds[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float2 delta = *reinterpret_cast<const float2*>(delta_smem + (2 * kk + j) * 8 + 2 * t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const u32 pr =  // P^T's pair in A register 2 j + h of step kk
              *reinterpret_cast<const u32*>(smem + (HAS_PS ? ds_off : Tr::OFF_P) +
                                            ds_pair_offset<Tr>(key_row0, kk, 2 * j + h, lane));
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = 2 * h + e, qt = 2 * kk + j;
            // (the softcap's factor is in the second P^T already: ds_of's dcap = 1)
            ds[j][c] = ds_of<MODS & ~MOD_SOFTCAP>(Cvt<T>::unpack(pr, e), acc[qt][c], e ? delta.y : delta.x,
                                                  (keep >> (4 * qt + c)) & 1, p.mods.dropout_rp, 1.f);
          }
        }
      }
      u32 ds_a[4];
      pack_k16_a<T>(ds, ds_a);
      bwd_sm90_store_ds_step<Tr>(smem, ds_off, key_row0, kk, lane, ds_a);
    }
    fence_proxy_async_shared();  // st.shared -> visible to the wgmma that read dS^T after the barrier
    // DEFER: the dV GEMM (long done) retired before the dS^T barrier, after which warpgroup 0 may overwrite P^T
    if (DEFER) {
      wgmma_wait_group<0>();
      wgmma_fence_operand(dv_acc);
    }
  } else if (DEFER && prev_vec_row >= 0) {
    // warpgroup 0: the last step's dQ under its dV GEMM and warpgroup 1's dS^T (retires dV too)
    bwd_split_dq<Tr>(p, smem_base, Tr::OFF_DS + (buf ^ 1) * Tr::SMEM_DS, prev_vec_row, wg, warp, lane, dk_acc, dv_acc);
  }
  // ORDERED: this CTA's turn on the query block's dQ (waited for under warpgroup 1's dS^T; the barrier passes it on)
  if (ORDERED && threadIdx.x == 0) wait_counter_or_trap(p.dq_turns + vec_row / 64, turn);
  __syncthreads();  // dS^T is in shared memory
  // dK[:, half] += dS^T Q_i[:, half], A = dS^T from shared memory (softmax_scale applied to dK once, at the end)
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk)
    Wgmma<Tr::HALF, T>::template ss</*TRANS_A=*/0, /*TRANS_B=*/1>(
        dk_acc, Tr::TileDS::desc_k_major(smem_base + ds_off, 0, kk * 16),
        Tr::TileQ::desc_mn_major(q_smem, kk * 16, wg * Tr::HALF), /*scale_d=*/1);
  wgmma_commit_group();
  // DEFER: dQ comes from the next step, and the dK GEMMs retire there, at its first wait (no barrier ends the step)
  if (DEFER) return;
  if (!ADDS_DQ) {  // dQ comes from bwd_dq_kernel
    wgmma_wait_group<0>();
    wgmma_fence_operand(dv_acc);
    wgmma_fence_operand(dk_acc);
    return;
  }

  bwd_split_dq<Tr>(p, smem_base, ds_off, vec_row, wg, warp, lane, dk_acc, dv_acc);
  // (ORDERED: the next step releases these adds, or the kernel after its last step)
}

// ORDERED (deterministic only): dQ added here in a fixed order of key blocks (the file comment), else a deterministic
// kernel leaves dQ to bwd_dq_kernel.
template <class Tr, bool IS_CAUSAL, bool IS_DETERMINISTIC, int MODS, bool ORDERED = false>
__global__ void __launch_bounds__(Tr::THREADS, 1) bwd_sm90_split_kernel(const __grid_constant__ BwdWsParams P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert((MODS & ~(MOD_WINDOW | MOD_ALIBI | MOD_SOFTCAP | MOD_DROPOUT)) == 0,
                "bwd_sm90_split_kernel takes the window, ALiBi, soft-capping and dropout (no bias, mask or block map)");
  static_assert(!ORDERED || IS_DETERMINISTIC, "ORDERED is the deterministic mode's dQ");
  const BwdParams& p = P.bwd;
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  // ordered with a band: key blocks launched last-first (their turns run from the highest key block down)
  constexpr bool REVERSED = ORDERED && (IS_CAUSAL || HAS_WINDOW);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const AlignedSmem aligned = align_smem_1024(smem_raw);
  const u32 smem_base = aligned.base;
  unsigned char* smem = aligned.ptr;
  // the host's shared memory size (cuflash/config.py BwdSm90SplitConfig.smem_bytes) must cover this layout
  if (dynamic_smem_size() < Tr::SMEM_BYTES) __trap();

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);  // warp-uniform: its descriptors in uniform registers
  using KeyBlock = BwdKeyBlock<Tr, IS_CAUSAL, HAS_WINDOW, /*HAS_MAP=*/false, REVERSED>;
  const KeyBlock kb(p);
  if (kb.n0 >= kb.seq.len_k) return;  // varlen: past this sequence's keys
  int left;
  QueryBlock<Tr> qb = kb.first_step(p, left);
  if (kb.m_begin >= kb.m_end || left == 0) {  // no query sees these keys: dK = dV = 0
    kb.zero_dk_dv(p, tid);
    return;
  }
  const u32 kv_full = smem_base + Tr::OFF_BAR;
  if (tid == 0) {
    mbarrier_init(kv_full, 1);
    mbarrier_init(kv_full + 8, 1);
    mbarrier_init(kv_full + 16, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (tid == 0) {  // K_j, V_j and the first step's query block into stage 0
    prefetch_tensormap(&P.tma_q);
    prefetch_tensormap(&P.tma_do);
    constexpr u32 PANEL_KV = Tr::BLOCK_N * Tr::PANEL_BYTES;
    const int kv_batch = p.seq.cu_seqlens_k != nullptr ? 0 : kb.batch;
    const int key0 = kb.seq.k_row0 + kb.n0;
    mbarrier_arrive_expect_tx(kv_full, 2 * Tr::SMEM_KV);
#pragma unroll
    for (int panel = 0; panel < Tr::PANELS; ++panel) {
      cp_async_bulk_tensor_4d_global_to_shared(smem_base + Tr::OFF_K + panel * PANEL_KV, &P.tma_k, kv_full,
                                               panel * Tr::PANEL_COLS, key0, kb.kv_head, kv_batch);
      cp_async_bulk_tensor_4d_global_to_shared(smem_base + Tr::OFF_V + panel * PANEL_KV, &P.tma_v, kv_full,
                                               panel * Tr::PANEL_COLS, key0, kb.kv_head, kv_batch);
    }
    bwd_split_load_step<Tr>(P, smem_base, 0, qb, kb);
  }

  float dk_acc[Tr::DKV_TILES][4], dv_acc[Tr::DKV_TILES][4];  // 16 keys x HALF columns of this warp, fp32
#pragma unroll
  for (int dt = 0; dt < Tr::DKV_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk_acc[dt][c] = dv_acc[dt][c] = 0.f;

  // ORDERED: the dq_turns counter of the last step's query block, released by the next step (thread 0's word of
  // shared memory: a register across the query loop spilled the heaviest kernel)
  if (ORDERED && threadIdx.x == 0) st_shared_s32(smem_base + Tr::OFF_RELEASE, -1);
  mbarrier_wait_or_trap(kv_full, 0);
  // the query loop: the steps from qb (`left` positions), each waiting for its stage (deterministic: ending at a CTA
  // barrier)
  const bool is_key_tail = kb.keys < Tr::BLOCK_N;
  int stage = 0, buf = 0;
  u32 phase = 0;
  long long prev_vec_row = -1;  // the last step's query block (the default mode adds its dQ in the next step)
  for (;;) {
    QueryBlock<Tr> qb_next = qb;
    int left_next = left;
    const bool more = kb.advance(p, qb_next, left_next);
    const int m0 = qb.m_block * Tr::BLOCK_M;
    const bool is_masked = is_key_tail || kb.band.needs_mask(m0, m0 + Tr::BLOCK_M - 1, kb.n0, kb.n0 + Tr::BLOCK_N - 1);
    auto load_next = [&] {
      if (more && threadIdx.x == 0) bwd_split_load_step<Tr>(P, smem_base, stage ^ 1, qb_next, kb);
    };
    mbarrier_try_wait_parity(smem_base + Tr::OFF_BAR + 8 * (1 + stage), phase);
    ScoreMods<MODS> mods;
    mods.init(p.mods, kb.batch, qb.head, p.heads);
    const int turn = ORDERED ? kb.dq_turn(qb.m_block, kb.n0 / Tr::BLOCK_N, kb.last_key_block(), kb.dq_reach()) : 0;
    bwd_split_query_block<Tr, IS_CAUSAL, !IS_DETERMINISTIC || ORDERED, ORDERED, MODS>(
        p, is_masked, turn, kb.band, mods, smem, smem_base, stage, buf, qb.m_block, kb.n0, qb.vec_row, prev_vec_row,
        wg, warp, lane, dk_acc, dv_acc, load_next);
    // deterministic modes: every GEMM that read this stage, P^T or the last step's dS^T has retired, the next step
    // may overwrite them (the default mode needs no barrier here: the file comment's synchronization)
    if (IS_DETERMINISTIC) __syncthreads();
    if (!more) break;
    prev_vec_row = qb.vec_row;
    buf ^= 1;
    stage ^= 1;
    phase ^= stage == 0;
    qb = qb_next;
    left = left_next;
  }
  // ORDERED: the last step's adds (issued before the loop's last barrier) to the next key block
  if (ORDERED && threadIdx.x == 0) {
    fence_acq_rel_gpu();
    red_release_gpu_add(p.dq_turns + ld_shared_s32(smem_base + Tr::OFF_RELEASE), 1);
  }
  // the default mode: the last step's dQ (its K columns are this warpgroup's, which only it overwrites below)
  if (!IS_DETERMINISTIC)
    bwd_split_dq<Tr>(p, smem_base, Tr::OFF_DS + buf * Tr::SMEM_DS, qb.vec_row, wg, warp, lane, dk_acc, dv_acc);

  // epilogue: dK * softmax_scale and dV (* 1 / (1 - p) with dropout) into the K and V tiles (this warpgroup's
  // columns), then 16-byte stores
  if (ScoreMods<MODS>::HAS_DROPOUT) scale_acc(dv_acc, p.mods.dropout_rp);
  bwd_stage_dk_dv<Tr>(p, smem, (warp % 4) * 16, wg * Tr::HALF, lane, dk_acc, dv_acc);
  __syncthreads();
  kb.store_dk_dv(p, smem, tid_x_reread());
#else
  static_assert(Tr::HEAD_DIM < 0, "bwd_sm90_split_kernel uses TMA and wgmma: compile it for sm_90a");
#endif
}

}  // namespace cuflash
