// bwd_sm90_ws.cuh: the FlashAttention-2 backward (Dao 2023, Algorithm 2) on sm_90a with FlashAttention-3's data
// movement (Shah et al. 2024): TMA loads by a producer warp, two consumer warpgroups, mbarrier pipelines instead of
// __syncthreads, and dQ accumulated in global memory by bulk reductions (cp.reduce.async.bulk) that run under the
// next query block's GEMMs instead of per-thread atomics.
//
// One CTA = BLOCK_N = 128 keys of one K/V head (K/V-outer, as bwd_sm90_kernel), 3 warpgroups, 384 threads:
//   warpgroup 0 (producer, 24 registers): one thread issues the TMA loads: K and V once,
//     then Q_i, dO_i (tensor maps) and lse_log2_i, delta_i (1-D bulk copies) of every (query head, query block)
//     step into a 2-stage circular buffer; in deterministic mode lane 0 of warp 1 is the dQ writer (below);
//   warpgroups 1, 2 (consumers, 240 registers): consumer w owns keys 64w .. 64w + 63 and their dK, dV rows in
//     registers; per step it runs bwd_sm90_dkdv_step (bwd_sm90.cuh: S^T, dP^T, P^T, dV += P^T dO, dS^T,
//     dK += dS^T Q on asynchronous wgmma), stores dS^T (stmatrix), and computes its part of dQ_i = dS K_j (half the
//     columns of a 64-query step, half the rows of a 128-query one: BwdSm90Traits::DQ_BY_ROWS); at head dim 128
//     in 64-query steps consumer 1 alone computes all of dQ_i (BwdSm90WsTraits::dq_one_wg, default mode) while
//     consumer 0 goes on to the next step.
// The math, the score modifiers, masks, dropout, block maps and GQA walk are bwd_sm90_kernel's (BwdKeyBlock,
// QueryBlock: producer and consumers walk the same steps); what is new is who moves the data and when.
//
// Dense or packed (varlen) sequences as in fwd_sm90_ws.cuh: a packed operand's map is (head_dim, total, heads, 1)
// and the producer adds q_row0 / k_row0 to the row coordinate. Rows of a box past the sequence are zero-filled
// (dense) or the next sequence's (packed): their lse_log2 is +inf (pad rows, seqs.cuh), so P = dS = 0 there, and
// keys past len_k are masked (the key tail), as in bwd_sm90_kernel.
//
// ---- shared memory (BwdSm90WsTraits) -----------------------------------------------------------------------
// [K] [V] [stage 0: Q, dO] [stage 1: Q, dO] [dS^T buffer 0, 1] [dQ: BLOCK_M x HEAD_DIM fp32]
// [stage 0: lse_log2, delta] [stage 1: lse_log2, delta] [mbarriers]
// The 16-bit tiles are bwd_sm90_kernel's swizzled panels (tiles.cuh): 64-column panels with a 128-byte swizzle at
// HEAD_DIM 128, 32-column panels with a 64-byte swizzle at HEAD_DIM 64 and 32 (dQ's B operand of the second consumer
// starts at column 32 there, a panel, and at column 16 at HEAD_DIM 32, inside the one panel: SmemTile::desc_mn_major).
// Each is TMA's CU_TENSOR_MAP_SWIZZLE_128B / _64B layout of a (PANEL_COLS, ROWS) box at a swizzle-period aligned
// address, so one box per panel fills it.
//
// ---- the barrier protocol ------------------------------------------------------------------------------------
// mbarriers (initialized by thread 0, then fence + __syncthreads):
//   kv_full        count 1: the producer's arrive.expect_tx(2 SMEM_KV); K and V once
//   q_full[s]      count 1: arrive.expect_tx(2 SMEM_Q + 2 SMEM_ROWVEC); Q_i, dO_i, lse_log2_i, delta_i
//   q_empty[s]     count CONSUMER_THREADS: every consumer thread, once the step's wgmma that read Q_i and dO_i have
//                  retired (wait_group 0); each arrive releases that thread's own reads of lse_log2_i and delta_i
//                  (one arrive per warp would not order the other lanes' reads before the producer's next copy
//                  into the stage: racecheck reported those as WAR hazards)
// Step i uses stage s = i % 2 in round u = i / 2, parity u & 1; the producer waits q_empty[s] with parity
// (u & 1) ^ 1 (round 0 passes at once on a fresh barrier), as fwd_sm90_ws.cuh's K/V stages.
// Named barriers of the 256 consumer threads (0 is __syncthreads, used once after the mbarrier init):
//   DS_BAR      bar.sync by all: both consumers' dS^T of step i are in dS buffer i % 2 (so dQ_i may read all
//               128 keys), and the dQ buffer is free (the writer thread waited for the previous reduction's reads)
//   DQ_BAR      bar.sync by all: dQ_i is in the dQ buffer; then the writer's (consumer warp 0) lane 0 issues
//               cp.reduce.async.bulk .add.f32 of the whole block into dQ_acc. Only the writer needs to wait, but
//               with the other 7 warps passing by bar.arrive, compute-sanitizer's racecheck loses the ordering of
//               later barriers and reports hazards that are none (tools/racecheck_named_barrier.py shows it on 20
//               lines of CUDA); all 8 warps leave the step's last GEMM within a few cycles of each other anyway.
//               With dq_one_wg consumer 1's 128 threads arrive on the mbarrier dq_full (count 128, one phase per
//               step, parity i % 2) and wait for it, and its warp 4 is the writer: a bar.sync of those 128 threads
//               alone made racecheck report the same kind of hazards (between the epilogue's dK / dV staging and
//               its reads, which EPILOGUE_BAR orders)
//   EPILOGUE_BAR  bar.sync by all, around staging dK, dV in the K, V tiles (the other consumer's last dQ GEMM
//               reads all of K)
// dS^T is double-buffered: consumer A may store dS^T of step i + 1 while consumer B's dQ GEMM of step i still
// reads buffer i % 2; buffer i % 2 is written again at step i + 2, after DS_BAR of step i + 1, which B reaches
// only after its dQ GEMM of step i retired.
//
// ---- deterministic mode: ordered reductions ---------------------------------------------------------------------
// dQ_acc's elements are fp32 sums over key blocks; with the reductions above their order is whichever CTA gets
// there first. deterministic=True fixes it: the consumers' writer thread does not reduce but hands the block over,
// and the dQ writer (bwd_sm90_ws_dq_writer) adds it when the CTA's turn has come, one key block after another per
// query block in the order BwdKeyBlock::dq_turn gives (ascending key blocks without a band; with causal or a window
// descending, the key blocks launched in reverse so that each CTA only waits on CTAs launched before it). A counter
// per 64 rows of dQ_acc (BwdParams::dq_turns, zeroed by the preprocess) counts the turns taken: the writer polls it
// (ld.acquire) until it equals its turn, reduces, waits for the reduction to complete, and adds 1 (red.release).
// Two more mbarriers, count 1 each:
//   dq_full    the consumers' writer thread, after DQ_BAR: dQ_i is in the dQ buffer
//   dq_empty   the dQ writer, once its reduction has read the buffer; the consumers' writer thread waits for it
//              (parity buf ^ 1: one phase per step, as buf flips) before DS_BAR, where the default mode waits for
//              its own reduction's reads
// A block map's empty tiles are skipped by the consumers but still take their turn in the writer (it reads the
// same map); a CTA whose tiles are all empty runs the writer alone. A bias or dropout keeps the other scheme
// (BwdSm90WsTraits::ordered_dq): no dQ here, bwd_dq_kernel after the kernel.
//
// ---- dQ_acc layout ---------------------------------------------------------------------------------------------
// A block's BLOCK_M x HEAD_DIM fp32 values (its rows of dQ_acc, contiguous since dq_accum_cols = HEAD_DIM) are
// stored in the consumers' accumulator order, so that each thread writes whole 16-byte chunks to shared memory
// without bank conflicts and one bulk reduction adds the block: float4 number (w * DQ_TILES + dt) * 128 + c
// (consumer w, its thread c = 32 wq + 4 g + t) holds rows r0 + 16 wq + g and r0 + 16 wq + g + 8, columns c0 + 8 dt +
// 2t, + 1 (elements 0, 1 and 2, 3), with (r0, c0) = (dq_row0(w), dq_col0(w)): (0, w * HEAD_DIM / 2) in 64-query
// steps, (64 w, 0) in 128-query ones. bwd_convert_dq_ws_kernel reads this order. The preprocess zeroes dQ_acc.
#pragma once
#include "ptx.cuh"
#include "ptx_wgmma.cuh"
#include "traits.cuh"
#include "tiles.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "seqs.cuh"
#include "bwd.cuh"
#include "bwd_sm90.cuh"
#include "fwd_sm90_ws.cuh"  // TmaDesc, mbarrier_wait_or_trap

namespace cuflash {

// Kernel argument of bwd_sm90_ws_kernel (`const __grid_constant__`, so TMA reads the maps in parameter space).
// Mirrored by cuflash/_tma.py:BwdWsParams.
struct BwdWsParams {
  TmaDesc tma_q;   // Q as (head_dim, seqlen_q, heads, batch), box (PANEL_COLS, BLOCK_M, 1, 1), swizzled
  TmaDesc tma_do;  // dO like Q
  TmaDesc tma_k;   // K as (head_dim, seqlen_k, kv_heads, batch), box (PANEL_COLS, BLOCK_N, 1, 1)
  TmaDesc tma_v;   // V like K
  BwdParams bwd;   // everything else (bwd_sm90_kernel's argument)
};
static_assert(alignof(BwdParams) == 8 && sizeof(BwdParams) == 624 && alignof(BwdWsParams) == 64 &&
                  sizeof(BwdWsParams) == 1152,
              "BwdWsParams is mirrored in cuflash/_tma.py: maps at 0, 128, 256, 384, BwdParams at 512, 1152 bytes");

// bwd_sm90_kernel's (64, 128) tiles and layout names (which bwd_sm90_dkdv_step reads), with a producer warpgroup,
// a second dS^T buffer, the dQ buffer and the mbarriers.
// BLOCK_M_ 128 takes steps of 128 queries (head dims 32 and 64; the library runs it for plain, causal and windowed
// calls and a mask alone, cuflash/config.py BWD_SM90_WS_BLOCK_M): each consumer's S^T and dP^T are 64 keys x 128
// queries, K and V are read once per 128 queries instead of per 64, half the steps (barriers, dQ reductions) for the
// same work; dQ is split by rows (BwdSm90Traits::DQ_BY_ROWS). Dropout and the other modifiers beside a mask need 64
// (takes_mods), and so does a bias, except at head dim 32, where the staged bias of 128-row steps fits beside the
// tiles (stage_bias).
template <int HEAD_DIM_, class T_, int BLOCK_M_ = 64>
struct BwdSm90WsTraits : BwdSm90Traits<HEAD_DIM_, BLOCK_M_, 128, 1, T_> {
  using Base = BwdSm90Traits<HEAD_DIM_, BLOCK_M_, 128, 1, T_>;
  static constexpr int CONSUMERS = Base::WARPGROUPS;  // 2: 64 keys each
  static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
  static constexpr int THREADS = 128 + CONSUMER_THREADS;
  static constexpr int PRODUCER_REGS = 24;  // (the deterministic dQ writer included)
  static constexpr int CONSUMER_REGS = 240;
  static constexpr int STAGES = 2;  // of (Q, dO, lse_log2, delta); the offsets below are Base's for 2 stages
  static constexpr int PANEL_BYTES = Base::TileQ::PANEL_BYTES;
  static constexpr int PANELS = Base::HEAD_DIM / Base::PANEL_COLS;  // TMA boxes per 16-bit tile
  static constexpr int SMEM_DQ = Base::BLOCK_M * Base::HEAD_DIM * 4;  // one block of dQ, fp32
  static constexpr int OFF_DQ = Base::OFF_DS + 2 * Base::SMEM_DS;
  static constexpr int OFF_LSE = OFF_DQ + SMEM_DQ;                    // + stage * 2 * SMEM_ROWVEC
  static constexpr int OFF_DELTA = OFF_LSE + Base::SMEM_ROWVEC;      // + stage * 2 * SMEM_ROWVEC
  // kv_full, q_full[2], q_empty[2], dq_full, dq_empty
  static constexpr int OFF_BAR = OFF_LSE + 2 * STAGES * Base::SMEM_ROWVEC;
  static constexpr int BARRIERS = 3 + 2 * STAGES;
  // the deterministic dQ writer's setup (DqWriterSetup, 32 bytes), from the thread that runs it
  static constexpr int OFF_WRITER = OFF_BAR + 8 * BARRIERS;
  static constexpr int SMEM_BYTES = OFF_WRITER + 32 + 1024;          // + rounding the base up to 1024
  // A bias (16-bit, contiguous 16-byte aligned rows: bwd_bias_staged decides per call) is staged at head dim 64
  // when no ALiBi, soft-capping or dropout is beside it, and at head dim 128 when it comes alone and not causal
  // (beside a window or a mask there the staging made ptxas spill 12-48 bytes, causal 4 bytes under NVRTC 13.0):
  // each consumer warp copies its 16 keys of the next step's BLOCK_M query rows (two 16-byte cp.async chunks per
  // row, 32-byte rows; issued a step ahead, at the top of the step before) to OFF_BIAS + buffer * SMEM_BIAS +
  // warp * BLOCK_M * BIAS_PITCH (two buffers, step i in i % 2), chunk h of row r at bias_offset(r, h): the halves
  // swap in rows 4-7 of every 8, so that both the copies (8 lanes: 4 rows x 2 halves) and the ldmatrix reads (8
  // rows of one half) hit 8 distinct 16-byte bank groups.
  // In 128-query steps only at head dim 32: its two buffers of 128 rows (64 KB) fit beside the tiles (195 KB in
  // all); at head dim 64 they would not (259 KB).
  // cuflash/config.py bwd_stages_bias mirrors this.
  static constexpr bool stage_bias(int mods, bool causal) {
    if (BLOCK_M_ != 64 && HEAD_DIM_ != 32) return false;
    return HEAD_DIM_ <= 64 ? (mods & MOD_BIAS) && !(mods & (MOD_ALIBI | MOD_SOFTCAP | MOD_DROPOUT))
                           : mods == MOD_BIAS && !causal;
  }
  static constexpr int BIAS_PITCH = 32;
  static __device__ __forceinline__ int bias_offset(int row, int half) {
    return row * BIAS_PITCH + 16 * (half ^ ((row >> 2) & 1));
  }
  static constexpr int OFF_BIAS = (OFF_WRITER + 32 + 127) / 128 * 128;  // 4 rows: one 128-byte line
  static constexpr int SMEM_BIAS = 4 * CONSUMERS * Base::BLOCK_M * BIAS_PITCH;
  static constexpr int smem_bytes(bool bias) {  // cuflash/config.py BwdSm90WsConfig.smem_bytes
    return bias ? OFF_BIAS + 2 * SMEM_BIAS + 1024 : SMEM_BYTES;
  }
  // Deterministic: dQ by ordered reductions (bwd_sm90_ws_dq_writer), except with a bias or dropout, and with a mask
  // at head dim 128, whose element-wise work keeps the consumers at the edge of their registers: there the writer's
  // hand-offs made ptxas spill 4-28 bytes (head dims 64 and 128, under NVRTC 13.0 or 13.5; a mask at 128: 8-12), so
  // those leave dQ to bwd_dq_kernel. cuflash/config.py ordered_dq mirrors this.
  static constexpr bool ordered_dq(int mods, bool /*causal*/) {
    return !(mods & (MOD_BIAS | MOD_DROPOUT)) && !(HEAD_DIM_ >= 128 && (mods & MOD_MASK));
  }
  // dQ of a 64-query step at head dim 128 by one consumer, as one m64n128 wgmma chain (half the wgmma instructions
  // of two m64n64 chains), the other consumer free to start the next step (bwd_sm90_ws_consumer), in the default
  // mode (the deterministic mode's hand-offs keep both) and not causal with a bias and a mask together, where its
  // hand-off made ptxas spill 4 bytes (NVRTC 13.0 and 13.5). cuflash/config.py bwd_ws_dq_one_wg mirrors this.
  static constexpr bool dq_one_wg(int mods, bool causal, bool deterministic) {
    return HEAD_DIM_ == 128 && BLOCK_M_ == 64 && !deterministic &&
           !(causal && (mods & MOD_BIAS) && (mods & MOD_MASK));
  }
  static constexpr int Q_TX = 2 * Base::SMEM_Q + 2 * Base::SMEM_ROWVEC;  // transaction bytes of one step
  // named barriers (0 is __syncthreads)
  static constexpr int DS_BAR = 1, DQ_BAR = 2, EPILOGUE_BAR = 3;

  static_assert(CONSUMERS == 2 && (Base::BLOCK_M == 64 || (Base::BLOCK_M == 128 && HEAD_DIM_ <= 64)),
                "two consumers of 64 keys; steps of 64 queries, or 128 at head dims up to 64 (their registers)");
  // the score modifiers a step of 128 queries takes: dropout's keep bits (dropout_keep_transposed) hold 8 query
  // tiles; a mask with at most a window beside it (its bits a word per 8 query tiles, bwd_sm90_dkdv_step; a
  // BlockMask's or key padding mask's tile map is built at the kernel's tiles, cuflash/_families.py _block_map with
  // the config's block_m); at head dim 32 also a staged bias (stage_bias) with a window or a mask beside it (the
  // element mask read as in 64-query steps)
  static constexpr bool takes_mods(int mods) {
    if (BLOCK_M_ != 64 && HEAD_DIM_ == 32 && (mods & MOD_BIAS)) return !(mods & ~(MOD_BIAS | MOD_MASK | MOD_WINDOW));
    return BLOCK_M_ == 64 || !(mods & (MOD_DROPOUT | MOD_BIAS | MOD_MASK | MOD_BLOCKS)) ||
           !(mods & ~(MOD_MASK | MOD_WINDOW | MOD_BLOCKS));
  }
  // setmaxnreg moves registers between the CTA's warps, within what the launch gave it (__launch_bounds__(THREADS,
  // 1): 168 per thread): a consumer's setmaxnreg.inc beyond that waits forever
  static_assert(128 * PRODUCER_REGS + CONSUMER_THREADS * CONSUMER_REGS <= THREADS * (65536 / THREADS / 8 * 8),
                "setmaxnreg exceeds the registers of the launch");
  static_assert(Base::DQ_TILES * 128 * 4 * CONSUMERS == Base::BLOCK_M * Base::HEAD_DIM, "dQ_acc order covers the block");
  static_assert(OFF_DQ % 1024 == 0 && SMEM_DQ % 16 == 0 && OFF_LSE % 16 == 0, "bulk copy alignment");
  static_assert(Q_TX < (1 << 20) && 2 * Base::SMEM_KV < (1 << 20), "expect_tx counts stay below 2^20");
  static_assert(smem_bytes(stage_bias(MOD_BIAS, false)) <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

template <class Tr>
struct BwdWsSmem {
  u32 base;
  __device__ __forceinline__ u32 kv_full() const { return base + Tr::OFF_BAR; }
  __device__ __forceinline__ u32 q_full(int stage) const { return base + Tr::OFF_BAR + 8 * (1 + stage); }
  __device__ __forceinline__ u32 q_empty(int stage) const { return base + Tr::OFF_BAR + 8 * (1 + Tr::STAGES + stage); }
  __device__ __forceinline__ u32 dq_full() const { return base + Tr::OFF_BAR + 8 * (1 + 2 * Tr::STAGES); }
  __device__ __forceinline__ u32 dq_empty() const { return base + Tr::OFF_BAR + 8 * (2 + 2 * Tr::STAGES); }
  __device__ __forceinline__ u32 q(int stage) const { return base + Tr::OFF_Q + stage * 2 * Tr::SMEM_Q; }
  __device__ __forceinline__ u32 dout(int stage) const { return base + Tr::OFF_DO + stage * 2 * Tr::SMEM_Q; }
  __device__ __forceinline__ u32 lse(int stage) const { return base + Tr::OFF_LSE + stage * 2 * Tr::SMEM_ROWVEC; }
  __device__ __forceinline__ u32 delta(int stage) const { return base + Tr::OFF_DELTA + stage * 2 * Tr::SMEM_ROWVEC; }
};

// Producer (one thread): K and V of the CTA's keys, then the steps from qb on (left of them), each into the next
// stage once the consumers released what it held two steps ago.
template <class Tr, class KeyBlock>
__device__ __forceinline__ void bwd_sm90_ws_producer(const BwdWsParams& P, const BwdWsSmem<Tr>& sm, const KeyBlock& kb,
                                                     QueryBlock<Tr> qb, int left) {
  const BwdParams& p = P.bwd;
  prefetch_tensormap(&P.tma_q);
  prefetch_tensormap(&P.tma_do);
  prefetch_tensormap(&P.tma_k);
  prefetch_tensormap(&P.tma_v);
  const int q_batch = p.seq.cu_seqlens_q != nullptr ? 0 : kb.batch;
  const int kv_batch = p.seq.cu_seqlens_k != nullptr ? 0 : kb.batch;
  constexpr u32 PANEL_KV = Tr::BLOCK_N * Tr::PANEL_BYTES, PANEL_Q = Tr::BLOCK_M * Tr::PANEL_BYTES;

  const int key0 = kb.seq.k_row0 + kb.n0;
  mbarrier_arrive_expect_tx(sm.kv_full(), 2 * Tr::SMEM_KV);
#pragma unroll
  for (int panel = 0; panel < Tr::PANELS; ++panel) {
    cp_async_bulk_tensor_4d_global_to_shared(sm.base + Tr::OFF_K + panel * PANEL_KV, &P.tma_k, sm.kv_full(),
                                             panel * Tr::PANEL_COLS, key0, kb.kv_head, kv_batch);
    cp_async_bulk_tensor_4d_global_to_shared(sm.base + Tr::OFF_V + panel * PANEL_KV, &P.tma_v, sm.kv_full(),
                                             panel * Tr::PANEL_COLS, key0, kb.kv_head, kv_batch);
  }

  int stage = 0;
  u32 phase = 0;
  for (;;) {
    mbarrier_wait_or_trap(sm.q_empty(stage), phase ^ 1);
    mbarrier_arrive_expect_tx(sm.q_full(stage), Tr::Q_TX);
    const int row = kb.seq.q_row0 + qb.m_block * Tr::BLOCK_M;
#pragma unroll
    for (int panel = 0; panel < Tr::PANELS; ++panel) {
      cp_async_bulk_tensor_4d_global_to_shared(sm.q(stage) + panel * PANEL_Q, &P.tma_q, sm.q_full(stage),
                                               panel * Tr::PANEL_COLS, row, qb.head, q_batch);
      cp_async_bulk_tensor_4d_global_to_shared(sm.dout(stage) + panel * PANEL_Q, &P.tma_do, sm.q_full(stage),
                                               panel * Tr::PANEL_COLS, row, qb.head, q_batch);
    }
    // BLOCK_M fp32 rows each, pad rows included (the buffers are padded per head: seqs.cuh)
    cp_async_bulk_global_to_shared(sm.lse(stage), p.lse_log2 + qb.vec_row, Tr::SMEM_ROWVEC, sm.q_full(stage));
    cp_async_bulk_global_to_shared(sm.delta(stage), p.delta + qb.vec_row, Tr::SMEM_ROWVEC, sm.q_full(stage));
    if (!kb.advance(p, qb, left)) break;
    if (++stage == Tr::STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
}

// The deterministic dQ writer (lane 0 of producer warp 1): adds the consumers' dQ blocks to dQ_acc in a fixed order
// of key blocks per query block (BwdKeyBlock::dq_turn), so each element of dQ_acc is summed in the same order in
// every run. It walks every (query head, query block) position of the CTA, the empty tiles of a block map included
// (the consumers skip those; here the CTA only takes its turn), and per position: waits for the block the
// consumers left in the dQ buffer (dq_full) and for its turn on the query block's counter, adds the block, lets
// the consumers refill the buffer once the add has read it (dq_empty), and passes the turn on once the add is done.
// Its walk comes from shared memory (DqWriterSetup, stored by the same thread in the prologue and read back through
// asm): computed from the prologue's values in the writer, those stayed live into the producer warpgroup's 24
// registers and ptxas spilled them (8-28 bytes).
struct DqWriterSetup {
  long long vec_row;   // the first position's first fp32 row (QueryBlock::vec_row)
  int m_begin, m_end;  // query blocks of each query head (BwdKeyBlock)
  int steps;           // positions: query heads of the group x (m_end - m_begin)
  int last_block;      // with a band: the sequence's last key block (BwdKeyBlock::dq_turn)
  int reach;           // with a band: BwdKeyBlock::dq_reach
  int n;               // this key block
};
static_assert(sizeof(DqWriterSetup) == 32, "BwdSm90WsTraits::OFF_WRITER holds 32 bytes");

template <class Tr, class KeyBlock>
__device__ __forceinline__ void bwd_sm90_ws_dq_writer_setup(const BwdParams& p, unsigned char* smem,
                                                            const KeyBlock& kb) {
  DqWriterSetup w;
  w.vec_row = QueryBlock<Tr>::first(p, kb.seq, kb.batch, kb.kv_head * p.seq.kv_group, kb.m_begin).vec_row;
  w.m_begin = kb.m_begin;
  w.m_end = kb.m_end;
  w.steps = kb.steps(p);
  w.last_block = kb.last_key_block();
  w.reach = kb.dq_reach();
  w.n = kb.n0 / Tr::BLOCK_N;
  *reinterpret_cast<DqWriterSetup*>(smem + Tr::OFF_WRITER) = w;
}

// ADDS false: a CTA whose tiles a block map empties, all of them (it only takes its turns)
template <class Tr, class KeyBlock, bool ADDS = true>
__device__ __forceinline__ void bwd_sm90_ws_dq_writer(const BwdParams& p, const BwdWsSmem<Tr>& sm) {
  // read back through asm (not forwarded from the stores: that would keep the prologue's registers live)
  const u32 at = sm.base + Tr::OFF_WRITER;
  long long vec_row = static_cast<long long>(static_cast<u32>(ld_shared_s32(at))) |
                      (static_cast<long long>(ld_shared_s32(at + 4)) << 32);
  const int m_begin = ld_shared_s32(at + 8), m_end = ld_shared_s32(at + 12), steps = ld_shared_s32(at + 16);
  const int last_block = ld_shared_s32(at + 20), reach = ld_shared_s32(at + 24), n = ld_shared_s32(at + 28);
  const int head0 = blockIdx.y * p.seq.kv_group;
  int m = m_begin, head = head0;
  u32 phase = 0;
  for (int left = steps; left > 0; --left) {
    int* turns = p.dq_turns + vec_row / 64;
    // the consumers' walk skips a block map's empty tiles (no map: every position adds)
    const bool adds = ADDS && (!KeyBlock::MAPPED || p.mods.block_map.ptr == nullptr ||
                               __ldg(KeyBlock::state_ptr(p, blockIdx.z, head, m)) != TILE_EMPTY);
    if (adds) mbarrier_wait_or_trap(sm.dq_full(), phase);
    wait_counter_or_trap(turns, KeyBlock::dq_turn(m, n, last_block, reach));
    if (adds) {
      fence_proxy_async_global();  // the earlier turns' adds, seen through the counter, before this one
      cp_reduce_async_bulk_add_f32(p.dq_accum + vec_row * Tr::HEAD_DIM, sm.base + Tr::OFF_DQ, Tr::SMEM_DQ);
      cp_async_bulk_commit_group();
      cp_async_bulk_wait_group_read<0>();
      mbarrier_arrive(sm.dq_empty());
      cp_async_bulk_wait_group<0>();
      fence_proxy_async_global();  // this add before the counter's release
      phase ^= 1;
    }
    red_release_gpu_add(turns, 1);
    if (m + 1 < m_end) {  // QueryBlock::next
      ++m;
      vec_row += Tr::BLOCK_M;
    } else {
      vec_row += p.seqlen_q_pad - (m - m_begin) * Tr::BLOCK_M;
      m = m_begin;
      ++head;
    }
  }
}

// Consumer warpgroup cwg (0, 1): keys n0 + 64 cwg .. + 63; every step of the CTA; then dK, dV.
template <class Tr, bool IS_CAUSAL, bool IS_DETERMINISTIC, int MODS, class KeyBlock>
__device__ __forceinline__ void bwd_sm90_ws_consumer(const BwdParams& p, const BwdWsSmem<Tr>& sm, unsigned char* smem,
                                                     const KeyBlock& kb, QueryBlock<Tr> qb, int left) {
  using T = typename Tr::T;
  static_assert(Tr::takes_mods(MODS), "these score modifiers take 64-query steps (BwdSm90WsTraits::takes_mods)");
  constexpr bool ORDERED = IS_DETERMINISTIC && Tr::ordered_dq(MODS, IS_CAUSAL);  // else bwd_dq_kernel's dQ
  const int ctid = threadIdx.x - 128;  // 0 .. CONSUMER_THREADS-1
  const int lane = ctid & 31, warp = ctid >> 5, t = lane & 3, g = lane >> 2;
  // from lane 0, so ptxas knows it is warp-uniform (the K/V descriptors in uniform registers, as bwd_sm90_kernel)
  const int cwg = __shfl_sync(0xffffffffu, warp / 4, 0);
  const int key_row0 = cwg * 64 + (warp % 4) * 16;  // this warp's first key row in the tile
  // dQ of a step by consumer 1 alone (Tr::dq_one_wg)
  constexpr bool ONE_WG_DQ = Tr::dq_one_wg(MODS, IS_CAUSAL, IS_DETERMINISTIC);
  // issues the dQ reductions (deterministic: hands each block to the dQ writer, bwd_sm90_ws_dq_writer)
  const bool is_writer = warp == (ONE_WG_DQ ? 4 : 0);
  const u32 k_smem = sm.base + Tr::OFF_K;

  float dk_acc[Tr::DKV_TILES][4], dv_acc[Tr::DKV_TILES][4];  // this warp's 16 keys x HEAD_DIM, fp32
#pragma unroll
  for (int dt = 0; dt < Tr::DKV_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk_acc[dt][c] = dv_acc[dt][c] = 0.f;

  const bool is_key_tail = kb.keys < Tr::BLOCK_N;
  // a staged bias (Tr::stage_bias): this warp's rows of buffer 0 / 1, step i's in buffer i % 2 (= its stage)
  const u32 bias_rows = sm.base + Tr::OFF_BIAS + (key_row0 / 16) * Tr::BLOCK_M * Tr::BIAS_PITCH;
  if (Tr::stage_bias(MODS, IS_CAUSAL)) {  // the first step's (the others' are issued during the step before)
    ScoreMods<MODS> mods;
    mods.init(p.mods, kb.batch, qb.head, p.heads, kb.seq.len_q, kb.seq.len_k);
    if (bwd_bias_staged<Tr, IS_CAUSAL>(mods))
      bwd_stage_bias<Tr>(mods, bias_rows, qb.m_block * Tr::BLOCK_M, kb.key0() + key_row0, lane);
  }
  mbarrier_wait_or_trap(sm.kv_full(), 0);
  int stage = 0, buf = 0;
  u32 phase = 0;
  for (;;) {
    QueryBlock<Tr> qb_next = qb;
    int left_next = left;
    const bool more = kb.advance(p, qb_next, left_next);
    const int m0 = qb.m_block * Tr::BLOCK_M;
    const bool is_masked =
        is_key_tail || kb.band.needs_mask(m0, m0 + Tr::BLOCK_M - 1, kb.key0(), kb.key0() + Tr::BLOCK_N - 1);
    ScoreMods<MODS> mods;
    mods.init(p.mods, kb.batch, qb.head, p.heads, kb.seq.len_q, kb.seq.len_k);
    if (ScoreMods<MODS>::HAS_MASK) mods.check_mask = kb.state(p, qb) != TILE_FULL;
    // the next step's bias into the other buffer, before this step's S^T and dP^T accumulators are live (issued
    // after bwd_sm90_issue_sdp or after the step, its registers made ptxas spill at head dim 128)
    bool bias_next = false;
    if (Tr::stage_bias(MODS, IS_CAUSAL) && more) {
      ScoreMods<MODS> next;
      next.init(p.mods, kb.batch, qb_next.head, p.heads, kb.seq.len_q, kb.seq.len_k);
      bias_next = bwd_bias_staged<Tr, IS_CAUSAL>(next);
      if (bias_next)
        bwd_stage_bias<Tr>(next, bias_rows + (stage ^ 1) * Tr::SMEM_BIAS, qb_next.m_block * Tr::BLOCK_M,
                           kb.key0() + key_row0, lane);
    }
    mbarrier_try_wait_parity(sm.q_full(stage), phase);
    float s_acc[Tr::Q_TILES][4], dp_acc[Tr::Q_TILES][4];
    bwd_sm90_issue_sdp<Tr>(sm.base, stage, cwg, s_acc, dp_acc);

    u32 ds_regs[Tr::Q_K_STEPS][4];
    // the step's second P^T copy, where it takes one (bwd_sm90_dkdv_step's STASH), is parked in this warp's 16 rows
    // of the dS^T buffer it stores to below: 2 KB that no other warp reads or writes until DS_BAR
    static_assert(Tr::BLOCK_M * 2 * 16 == 32 * 4 * 16 || Tr::HEAD_DIM < 128,
                  "a warp's rows of the dS^T buffer hold its 4 x 16 bytes per lane");
    const int ps_stash = Tr::OFF_DS + buf * Tr::SMEM_DS + Tr::TileDS::offset(key_row0, 0);
    bwd_sm90_dkdv_step<Tr, IS_CAUSAL, MODS, /*STASH_PS=*/true>(p, is_masked, kb.band, mods, smem, sm.base, stage,
                                                               qb.m_block, kb.key0(), cwg, warp, lane, s_acc, dp_acc,
                                                               dk_acc, dv_acc, ds_regs, stage, bias_next, ps_stash);
    if (IS_DETERMINISTIC && !ORDERED) {  // dQ comes from bwd_dq_kernel
      wgmma_wait_group<0>();
      wgmma_fence_operand(dv_acc);
      wgmma_fence_operand(dk_acc);
      mbarrier_arrive(sm.q_empty(stage));
    } else {
      // dS^T -> buffer `buf`, visible to the tensor cores after DS_BAR: one stmatrix.x4 per 16 x 16 fragment (its
      // four 8 x 8 matrices are ds_regs[kk][0..3]: rows +0 / +8, columns +0 / +8), lane l giving the 16-byte row
      // (l & 7) of matrix l >> 3; the 8 rows of a matrix are 8 distinct 16-byte bank groups of the swizzled tile
      const u32 ds_off = Tr::OFF_DS + buf * Tr::SMEM_DS;
      __syncwarp();  // every lane has read its parked P^T copy back (the stores below overwrite it)
#pragma unroll
      for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk)
        stmatrix_x4(sm.base + ds_off +
                        Tr::TileDS::offset(key_row0 + (lane & 7) + ((lane >> 3) & 1) * 8, kk * 16 + (lane >> 4) * 8),
                    ds_regs[kk][0], ds_regs[kk][1], ds_regs[kk][2], ds_regs[kk][3]);
      fence_proxy_async_shared();
      if (is_writer) {  // the previous block's reduction has read the dQ buffer
        if (lane == 0) {
          if (ORDERED)
            mbarrier_try_wait_parity(sm.dq_empty(), buf ^ 1);  // (the writer's: once per step, as buf flips)
          else
            cp_async_bulk_wait_group_read<0>();
        }
        __syncwarp();
      }
      named_barrier_sync(Tr::DS_BAR, Tr::CONSUMER_THREADS);

      if constexpr (ONE_WG_DQ) {
        // consumer 1 alone computes dQ_i = dS K_j, all HEAD_DIM columns in one m64n128 chain; consumer 0 goes on to
        // the next step. The step's dV and dK GEMMs retire first: issued behind them, the chain made ptxas
        // serialize the kernel's wgmma (C7512).
        wgmma_wait_group<0>();
        wgmma_fence_operand(dv_acc);
        wgmma_fence_operand(dk_acc);
        if (cwg == 0) {
          mbarrier_arrive(sm.q_empty(stage));
        } else {
          float dq_acc[2 * Tr::DQ_TILES][4];
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < Tr::DQ_K_STEPS; ++kk)
            Wgmma<Tr::HEAD_DIM, T>::template ss</*TRANS_A=*/1, /*TRANS_B=*/1>(
                dq_acc, Tr::TileDS::desc_mn_major(sm.base + ds_off, kk * 16, 0),
                Tr::TileKV::desc_mn_major(k_smem, kk * 16, 0), /*scale_d=*/kk > 0);
          wgmma_commit_group();
          wgmma_wait_group<0>();
          wgmma_fence_operand(dv_acc);
          wgmma_fence_operand(dk_acc);
          wgmma_fence_operand(dq_acc);
          mbarrier_arrive(sm.q_empty(stage));
          // the dQ_acc order of two consumers (the file comment): fragment dt holds columns 8 dt ..
#pragma unroll
          for (int dt = 0; dt < 2 * Tr::DQ_TILES; ++dt)
            *reinterpret_cast<float4*>(smem + Tr::OFF_DQ + (dt * 128 + (ctid & 127)) * 16) =
                make_float4(dq_acc[dt][0], dq_acc[dt][1], dq_acc[dt][2], dq_acc[dt][3]);
          // each thread's stores before its arrive on dq_full (one phase per step, parity buf); all 128 wait for
          // the phase (the writer warp alone waiting made ptxas spill), then the writer thread reduces. A bar.sync
          // of consumer 1's 128 threads orders the same, but compute-sanitizer's racecheck then reported hazards
          // that are none between the epilogue's staging and its reads, both behind bar.sync of all 256 consumers
          fence_proxy_async_shared();
          mbarrier_arrive(sm.dq_full());
          mbarrier_try_wait_parity(sm.dq_full(), buf);
          if (is_writer) {
            if (lane == 0) {
              cp_reduce_async_bulk_add_f32(p.dq_accum + qb.vec_row * Tr::HEAD_DIM, sm.base + Tr::OFF_DQ, Tr::SMEM_DQ);
              cp_async_bulk_commit_group();
            }
          }
        }
      } else {
        // dQ_i[rows dq_row0.., DQ_COLS columns from dq_col0] = dS K_j: A = dS^T read M-major, B = K_j read N-major,
        // queued behind dV and dK
        float dq_acc[Tr::DQ_TILES][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Tr::DQ_K_STEPS; ++kk)
          Wgmma<Tr::DQ_COLS, T>::template ss</*TRANS_A=*/1, /*TRANS_B=*/1>(
              dq_acc, Tr::TileDS::desc_mn_major(sm.base + ds_off, kk * 16, Tr::dq_row0(cwg)),
              Tr::TileKV::desc_mn_major(k_smem, kk * 16, Tr::dq_col0(cwg)), /*scale_d=*/kk > 0);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        wgmma_fence_operand(dv_acc);
        wgmma_fence_operand(dk_acc);
        wgmma_fence_operand(dq_acc);
        // Q_i, dO_i, lse_log2_i, delta_i are read
        mbarrier_arrive(sm.q_empty(stage));
        // -> the dQ buffer in dQ_acc order (the file comment): 16-byte stores, consecutive threads consecutive chunks
#pragma unroll
        for (int dt = 0; dt < Tr::DQ_TILES; ++dt)
          *reinterpret_cast<float4*>(smem + Tr::OFF_DQ + ((cwg * Tr::DQ_TILES + dt) * 128 + (ctid & 127)) * 16) =
              make_float4(dq_acc[dt][0], dq_acc[dt][1], dq_acc[dt][2], dq_acc[dt][3]);
        fence_proxy_async_shared();
        named_barrier_sync(Tr::DQ_BAR, Tr::CONSUMER_THREADS);
        if (is_writer && lane == 0) {
          if (ORDERED) {
            mbarrier_arrive(sm.dq_full());
          } else {
            cp_reduce_async_bulk_add_f32(p.dq_accum + qb.vec_row * Tr::HEAD_DIM, sm.base + Tr::OFF_DQ, Tr::SMEM_DQ);
            cp_async_bulk_commit_group();
          }
        }
      }
      buf ^= 1;
    }
    if (!more) break;
    if (++stage == Tr::STAGES) {
      stage = 0;
      phase ^= 1;
    }
    qb = qb_next;
    left = left_next;
  }
  // the last reduction has read the dQ buffer and written dQ_acc before the CTA (and its shared memory) ends
  if (!IS_DETERMINISTIC && is_writer && lane == 0) cp_async_bulk_wait_group<0>();

  // epilogue, as bwd_sm90_kernel's: dK = softmax_scale * dK (dV / (1 - p) with dropout) staged in the K and V tiles
  // once neither consumer's dQ GEMM reads K, then 16-byte stores by the 256 consumer threads
  if (ScoreMods<MODS>::HAS_DROPOUT) scale_acc(dv_acc, p.mods.dropout_rp);
  named_barrier_sync(Tr::EPILOGUE_BAR, Tr::CONSUMER_THREADS);
  bwd_stage_dk_dv<Tr>(p, smem, key_row0, 0, lane, dk_acc, dv_acc);
  named_barrier_sync(Tr::EPILOGUE_BAR, Tr::CONSUMER_THREADS);
  kb.template store_dk_dv<Tr::CONSUMER_THREADS>(p, smem, tid_x_reread() - 128);
}

template <class Tr, bool IS_CAUSAL, bool IS_DETERMINISTIC, int MODS>
__global__ void __launch_bounds__(Tr::THREADS, 1) bwd_sm90_ws_kernel(const __grid_constant__ BwdWsParams P) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const BwdParams& p = P.bwd;
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const AlignedSmem aligned = align_smem_1024(smem_raw);
  const BwdWsSmem<Tr> sm{aligned.base};
  unsigned char* smem = aligned.ptr;
  // the host's shared memory size (cuflash/config.py BwdSm90WsConfig.smem_bytes) must cover this layout
  if (dynamic_smem_size() < Tr::smem_bytes(Tr::stage_bias(MODS, IS_CAUSAL))) __trap();

  // keys, query blocks and the no-work exits as bwd_sm90_kernel's (uniform in the CTA, before any barrier)
  // deterministic, dQ by ordered reductions, with a band: the last key blocks first (BwdKeyBlock::dq_turn)
  constexpr bool ORDERED = IS_DETERMINISTIC && Tr::ordered_dq(MODS, IS_CAUSAL);
  using KeyBlock = BwdKeyBlock<Tr, IS_CAUSAL, HAS_WINDOW, ScoreMods<MODS>::HAS_TILE_MAP, ORDERED && (IS_CAUSAL || HAS_WINDOW),
                               1, /*DIV_TEST=*/!(MODS & ~(MOD_MASK | MOD_WINDOW | MOD_BLOCKS))>;
  const KeyBlock kb(p);
  if (kb.n0 >= kb.seq.len_k) return;  // varlen: past this sequence's keys
  int left;
  const QueryBlock<Tr> qb = kb.first_step(p, left);
  // no query sees these keys, or a block map empties all their tiles: dK = dV = 0, and (deterministic) the dQ writer
  // alone takes the turns of the map's empty tiles
  if (ORDERED && threadIdx.x == 32 && kb.m_begin < kb.m_end) bwd_sm90_ws_dq_writer_setup<Tr>(p, smem, kb);
  if (kb.m_begin >= kb.m_end || left == 0) {
    kb.zero_dk_dv(p, threadIdx.x);
    if (ORDERED && kb.m_begin < kb.m_end && threadIdx.x == 32) bwd_sm90_ws_dq_writer<Tr, KeyBlock, false>(p, sm);
    return;
  }

  if (threadIdx.x == 0) {
    mbarrier_init(sm.kv_full(), 1);
#pragma unroll
    for (int s = 0; s < Tr::STAGES; ++s) {
      mbarrier_init(sm.q_full(s), 1);
      mbarrier_init(sm.q_empty(s), Tr::CONSUMER_THREADS);
    }
    if (Tr::dq_one_wg(MODS, IS_CAUSAL, IS_DETERMINISTIC)) mbarrier_init(sm.dq_full(), 128);  // consumer 1's dQ stores
    if (ORDERED) {
      mbarrier_init(sm.dq_full(), 1);
      mbarrier_init(sm.dq_empty(), 1);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  if (threadIdx.x < 128) {  // producer warpgroup: one thread issues every load; deterministic: one the dQ adds
    setmaxnreg_dec<Tr::PRODUCER_REGS>();
    if (threadIdx.x == 0) bwd_sm90_ws_producer<Tr>(P, sm, kb, qb, left);
    if (ORDERED && threadIdx.x == 32) bwd_sm90_ws_dq_writer<Tr, KeyBlock>(p, sm);
  } else {
    setmaxnreg_inc<Tr::CONSUMER_REGS>();
    bwd_sm90_ws_consumer<Tr, IS_CAUSAL, IS_DETERMINISTIC, MODS>(p, sm, smem, kb, qb, left);
  }
#else
  static_assert(Tr::HEAD_DIM < 0, "bwd_sm90_ws_kernel uses TMA and wgmma: compile it for sm_90a");
#endif
}

// ---- dQ = softmax_scale * dQ_acc from bwd_sm90_ws_kernel's dQ_acc order (the file comment) -----------------
// One CTA per block of BLOCK_M query rows (BLOCK_M: the main kernel's query step; 64: consumer w holds columns
// w * HEAD_DIM / 2 .., 128: rows 64 w ..). The block's float4s are read in dQ_acc order (coalesced 16-byte loads),
// each value pair scaled, packed and stored at its row and column of a row-major tile in shared memory (rows padded by
// 16 bytes, so that the 8 rows x 4 column pairs of a warp's stores fall on 32 distinct banks), then the tile goes out
// in 16-byte chunks, consecutive threads consecutive chunks of a row. (One thread per float4 storing its two pairs
// straight to dQ wrote 16 bytes per row per warp store, 8 rows a store: 79-107 us for 201 MB on an H200 at
// head dim 128, 2.5 of its 4.3 TB/s.)
template <class T, int HEAD_DIM, int BLOCK_M = 64>
__global__ void __launch_bounds__(CONVERT_THREADS) bwd_convert_dq_ws_kernel(const BwdParams p) {
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "the ws kernel's query steps");
  constexpr bool BY_ROWS = BLOCK_M == 128;
  constexpr int DQ_COLS = BY_ROWS ? HEAD_DIM : HEAD_DIM / 2, DQ_TILES = DQ_COLS / 8;
  constexpr int VECS = BLOCK_M * HEAD_DIM / 4;  // float4 per block of rows
  constexpr int PITCH = HEAD_DIM * 2 + 16;       // bytes per staged row
  constexpr int CHUNKS = HEAD_DIM / 8;           // 16-byte chunks of an output row
  static_assert(VECS % CONVERT_THREADS == 0 && BLOCK_M * CHUNKS % CONVERT_THREADS == 0, "whole passes of the CTA");
  static_assert(BLOCK_M * PITCH <= 48 * 1024, "the staged block fits static shared memory");
  __shared__ __align__(16) unsigned char tile[BLOCK_M * PITCH];
  const int block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const Seq seq = sequence(p.seq, batch);
  if (block * BLOCK_M >= seq.len_q) return;
  const float4* acc = reinterpret_cast<const float4*>(
      p.dq_accum + (padded_row0(p.seq, batch, head, p.heads, p.seqlen_q_pad) + block * BLOCK_M) * HEAD_DIM);
  const float s = p.softmax_scale;
#pragma unroll
  for (int i = 0; i < VECS / CONVERT_THREADS; ++i) {
    const int v = i * CONVERT_THREADS + threadIdx.x;
    const float4 a = acc[v];
    const int c = v % 128, tile_no = v / 128;  // consumer thread, (consumer, n8 tile)
    const int lane = c & 31, w = tile_no / DQ_TILES;
    const int row = (BY_ROWS ? 64 * w : 0) + (c >> 5) * 16 + (lane >> 2);
    const int col = (BY_ROWS ? 0 : w * DQ_COLS) + (tile_no % DQ_TILES) * 8 + 2 * (lane & 3);
    *reinterpret_cast<u32*>(tile + row * PITCH + col * 2) = Cvt<T>::pack(a.x * s, a.y * s);
    *reinterpret_cast<u32*>(tile + (row + 8) * PITCH + col * 2) = Cvt<T>::pack(a.z * s, a.w * s);
  }
  __syncthreads();
  const int rows = min(BLOCK_M, seq.len_q - block * BLOCK_M);
  u16* out = p.dq + batch * p.dq_batch_stride + head * p.dq_head_stride +
             static_cast<long long>(seq.q_row0 + block * BLOCK_M) * p.dq_row_stride;
#pragma unroll
  for (int i = 0; i < BLOCK_M * CHUNKS / CONVERT_THREADS; ++i) {
    const int idx = i * CONVERT_THREADS + threadIdx.x;
    const int row = idx / CHUNKS, chunk = idx % CHUNKS;
    if (row < rows && chunk * 8 < p.head_dim)
      *reinterpret_cast<uint4*>(out + static_cast<long long>(row) * p.dq_row_stride + chunk * 8) =
          *reinterpret_cast<const uint4*>(tile + row * PITCH + chunk * 16);
  }
}

}  // namespace cuflash
