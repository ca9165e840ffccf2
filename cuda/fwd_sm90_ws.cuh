// fwd_sm90_ws.cuh: the FlashAttention-3 forward (Shah et al. 2024) on sm_90a: TMA loads, a producer warpgroup
// and two consumer warpgroups (warp specialization), asynchronous wgmma with the softmax of one key tile under
// the P V GEMM of the previous one (intra-warpgroup overlap), and, optionally, pingpong scheduling of the two
// consumer warpgroups (one's softmax under the other's GEMMs).
//
// One work item = BLOCK_M = 128 query rows of one (batch, head); a CTA (3 warpgroups, 384 threads) runs one item
// (grid (m_blocks, heads, batch)) or, PERSISTENT, walks items on a grid of at most one CTA per SM: blockIdx.x,
// + gridDim.x, ..., or the next untaken item of a work queue (WsItem; see "persistent" below):
//   warpgroup 0 (producer, 24 registers): one thread issues the TMA loads: Q once, then K_j and V_j of every
//     visible key tile (from the last to the first, as fwd_sm90_kernel) into STAGES-deep circular buffers;
//   warpgroups 1, 2 (consumers, 240 registers): consumer w (0, 1) owns query rows 64w..64w+63 of the tile and
//     runs S = Q K_j^T, the online softmax, O += P_j V_j (P from registers: wgmma's RS form), then the epilogue.
// With BLOCK_M = 192 (FwdSm90WsTraits' last parameter; head dims up to 64, no pingpong; one item per CTA or
// persistent) three consumer warpgroups of 160 registers each (512 threads) share each K/V tile: a third more query
// rows per load and per barrier round, and 12 consumer warps to hide the softmax's latency (FlashAttention-3's D 64
// choice).
// The algorithm's math (OnlineSoftmax, Band masks, the score modifiers of mods.cuh in fwd_sm90_key_tile's order:
// softcap, ALiBi, mask, softmax, dropout; the swizzled SmemTile layout and its wgmma descriptors) is
// fwd_sm90.cuh's; what is new is who moves the data and when. K/V heads = heads / kv_group (GQA). No kv cache.
//
// Dense or packed (varlen) sequences (seqs.cuh): a packed operand's tensor map is (head_dim, total, heads, 1) and
// sequence b's rows start at cu_seqlens[b], so the producer adds q_row0 / k_row0 to the row coordinate and uses
// batch coordinate 0. A box then runs past the sequence's end into the next one's rows (TMA zero-fills only past
// the array): the consumers mask keys >= len_k (the Band's tail test, as for the zero-filled tail of a dense
// sequence) and store no query row >= len_q. Rows, keys, ALiBi distances and the dropout stream are counted
// within the sequence (batch index = sequence index), as in fwd_sm90_kernel; O and lse rows at q_row0 + row.
//
// ---- shared memory --------------------------------------------------------------------------------------
// [Q: TileQ (128 x HEAD_DIM)] [K stage 0 .. STAGES-1: TileKV] [V stage 0 .. STAGES-1: TileKV] [mbarriers]
// Each tile is HEAD_DIM / 64 column panels of 64 elements (128 bytes) x ROWS rows, 128-byte swizzled: chunk c
// (16 bytes) of row r sits at chunk c ^ (r % 8) of its line. That is both TMA's CU_TENSOR_MAP_SWIZZLE_128B
// layout of a (64, ROWS) box written at a 1024-byte aligned address and wgmma's 128-byte swizzle (tiles.cuh),
// so one TMA box per panel fills it and the descriptors of fwd_sm90.cuh read it unchanged. A head dim that is not
// a multiple of 64 (32, 96) takes panels of 32 columns (64 bytes), 64-byte swizzled (chunk c of the 64-byte row r
// at chunk c ^ ((r / 2) % 4)): TMA's CU_TENSOR_MAP_SWIZZLE_64B layout of a (32, ROWS) box and wgmma's 64-byte
// swizzle, one box per panel as well (BOX_COLS below; the host's maps take the config's box_cols).
//
// ---- the barrier protocol -------------------------------------------------------------------------------
// mbarriers (8 bytes each, initialized by thread 0 before the role split, then fence + __syncthreads):
//   q_full                 count 1: the producer's arrive.expect_tx(SMEM_Q); TMA completes SMEM_Q bytes
//   k_full[s], v_full[s]   count 1: the producer's arrive.expect_tx(SMEM_KV); TMA completes SMEM_KV bytes
//   k_empty[s], v_empty[s] count CONSUMER_WARPS (8): lane 0 of every consumer warp arrives once per use,
//                          after its wgmma.wait_group has retired the GEMM that read the stage
// The CTA visits the key blocks [n_begin, n_end) of its rows' band (Band::key_block_begin / _end: the causal
// diagonal or the window's right edge bound n_end, the window's left edge n_begin; tiles outside are never
// loaded), from the last: key tile i (i = 0 .. n_tiles-1, n_tiles = n_end - n_begin) is key block
// n_block = n_end - 1 - i, so the window's first block n_begin is the last tile i = n_tiles - 1. Tile i uses
// stage s = i % STAGES, in round u = i / STAGES of that stage, phase bit ph = u & 1 (kept as counters: stage,
// phase ^= 1 on wrap):
//   producer  Q:   arrive.expect_tx(q_full, SMEM_Q), TMA Q (PANELS boxes of BOX_COLS x 128)
//             K_i: wait(k_empty[s], parity ph ^ 1)  -- round 0: a fresh barrier passes parity 1 at once;
//                                                     round u >= 1: waits for the 8 releases of tile i - STAGES
//                  arrive.expect_tx(k_full[s], SMEM_KV), TMA K_i (PANELS boxes of BOX_COLS x BLOCK_N)
//             V_i: the same with v_empty[s], v_full[s]
//   consumer  wait(q_full, parity 0) once
//             S_i: wait(k_full[s], parity ph); S = Q K_i^T; after the wait_group that retires it:
//                  lane 0 of each warp: arrive(k_empty[s])
//             O += P_i V_i: wait(v_full[s], parity ph); after the wait_group that retires it:
//                  lane 0 of each warp: arrive(v_empty[s])
// Each full barrier completes once per use (1 arrival + SMEM_* bytes; zero-filled out-of-bounds rows of a
// tail tile count as transferred bytes) and each empty barrier once per use (8 arrivals: both consumers), so
// phase u of every barrier is use u of its stage and the parities above alternate in step. The producer only
// waits for releases of tile i - STAGES, which both consumers give before they need tile i - 1 (K) or finish
// tile i - STAGES + 1 (V): no cycle, for any STAGES >= 2. No barrier is used across CTAs (no cluster), and a
// CTA whose rows see no key (n_tiles <= 0: it writes O = 0, lse = -inf) or that starts past its sequence's end
// (varlen: row0 >= len_q) returns before the barriers are initialized (both decisions are uniform in the CTA).
//
// ---- persistent: the protocol across work items ----------------------------------------------------------
// The producer thread picks the CTA's items (blockIdx.x first, then a fixed stride of gridDim.x, or the next
// untaken item of a queue in global memory, FwdWsParams.queue, taken once it has issued the current item's last
// loads; the last CTA to finish resets the queue) and passes each index to the consumers through a
// two-slot ring in shared memory: item u goes to slot u % 2 once item_empty[slot] has completed for item u - 2
// (256 arrivals, each consumer thread's after its read of the slot), then the producer arrives on item_full[slot];
// consumers wait item_full[slot] with parity (u / 2) & 1. An index >= items ends both roles (it is passed on too).
// Both roles walk the same items (WsItem::init from the same index) and skip the same ones (the producer every
// item without a visible key tile; the consumers write O = 0, lse = -inf for those with none). The K/V rings are
// not drained between items: the producer's and each consumer's (stage, phase) (WsPipe) carry on, so the tile
// sequence the barriers see is that of one long key loop. Q gets an empty barrier (count CONSUMER_WARPS): item u
// (counting items with key tiles) waits q_full with parity u & 1; the producer waits q_empty with parity
// (u & 1) ^ 1 before loading Q of item u (item 0 passes at once). Each consumer warp arrives on q_empty once per
// item: with O_SEPARATE (O staged in a buffer of its own) as soon as its last S GEMM of the item has retired, so
// the next Q loads under the item's last P V GEMM and epilogue; otherwise after its epilogue has read O out of
// Q's rows (fence.proxy.async first: the next Q is an async-proxy write over generic-proxy ones). With O_SEPARATE a
// warpgroup syncs its epilogue barrier before writing O, so no thread overwrites rows another is still storing.
// The pingpong tokens balance within each item (below), so they carry across items as well.
//
// ---- the consumer's schedule (intra-warpgroup overlap) ----------------------------------------------------
//   S_0 = Q K_0^T; wait; softmax(S_0) -> P_0
//   for i = 1 .. n_tiles-1:   issue S_i = Q K_i^T; issue O += P_{i-1} V_{i-1};
//                             wait_group 1 (S_i done) -> release K_i; softcap, ALiBi, mask; m, l,
//                             P_i = exp2(..); dropout of P_i (all under the P V GEMM)
//                             wait_group 0 (P V done) -> release V_{i-1}; O *= exp2(m_old - m_new)
//   issue O += P_last V_last; wait_group 0 -> release V_last; epilogue
// With PINGPONG, each consumer issues the GEMMs of a round (S_0 | S_i with P_{i-1} V_{i-1} | P_last V_last) only
// while it holds a token passed through two named barriers: consumer w waits bar.sync(PINGPONG_BAR + w, 256)
// before a round and passes the token with bar.arrive(PINGPONG_BAR + 1 - w, 256) after issuing it. Consumer 1
// gives consumer 0 the first token; both run n_tiles + 1 rounds; consumer 1 does not pass the token after its
// last round, so each barrier sees exactly as many arrives as syncs (n_tiles + 1). Between two arrives of one
// consumer on a barrier, the other consumer synced on it once, so no barrier instance mixes two rounds.
// Named barrier 0 is __syncthreads (used once, after the mbarrier init); EPILOGUE_BAR + w (128 threads) orders
// consumer w's O staging writes before its stores.
#pragma once
#include "ptx.cuh"
#include "ptx_wgmma.cuh"
#include "traits.cuh"
#include "tiles.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "seqs.cuh"
#include "softmax.cuh"
#include "fwd.cuh"

namespace cuflash {

// A CUtensorMap (cuda.h: 128 bytes, 64-byte aligned), encoded on the host by cuTensorMapEncodeTiled
// (cuflash/_tma.py); opaque here, read only by the TMA unit through its address.
struct alignas(64) TmaDesc {
  unsigned long long v[16];
};

// Kernel argument of fwd_sm90_ws_kernel, passed as one `const __grid_constant__` struct (so TMA can read the
// maps in parameter space through their generic address). Mirrored by cuflash/_tma.py:FwdWsParams.
struct FwdWsParams {
  TmaDesc tma_q;  // Q as (head_dim, seqlen_q, heads, batch), box (BOX_COLS, BLOCK_M, 1, 1), one panel's swizzle
  TmaDesc tma_k;  // K as (head_dim, seqlen_k, kv_heads, batch), box (BOX_COLS, BLOCK_N, 1, 1), one panel's swizzle
  TmaDesc tma_v;  // V like K
  FwdParams fwd;  // the pointers and strides of fwd_sm90_kernel (o, lse, strides, seq lengths, scale)
  int m_blocks;   // query blocks of BLOCK_M rows per (batch, head): ceil(seqlen_q / BLOCK_M) (max_seqlen_q if packed)
  int items;      // m_blocks * heads * batch: the work items a persistent grid walks (read only when PERSISTENT)
  int* queue;     // persistent: null, each CTA takes items blockIdx.x + k gridDim.x; else two int32 counters, zero
                  // at launch and left at zero (next item - gridDim.x, CTAs done), from which CTAs take items
};
static_assert(sizeof(TmaDesc) == 128 && alignof(TmaDesc) == 64, "a CUtensorMap is 128 bytes, 64-byte aligned");
// (no offsetof: NVRTC 13.0 has no __builtin_offsetof) three 128-byte maps, then FwdParams (8-byte aligned) at
// 384 with no padding in between, m_blocks and items at 904 and 908, queue at 912; the struct rounds up to its
// 64-byte alignment
static_assert(alignof(FwdParams) == 8 && sizeof(FwdParams) == 520 && alignof(FwdWsParams) == 64 &&
                  sizeof(FwdWsParams) == 960,
              "FwdWsParams is mirrored in cuflash/_tma.py (FwdWsParams): maps at 0, 128, 256, FwdParams at 384, 960 bytes");

template <int HEAD_DIM_, int BLOCK_N_, int STAGES_, bool PINGPONG_, class T_, bool PERSISTENT_ = false,
          int BLOCK_M_ = 128>
struct FwdSm90WsTraits {
  using T = T_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;            // query rows per CTA: 64 per consumer warpgroup
  static constexpr int BLOCK_N = BLOCK_N_;            // key rows per K/V tile
  static constexpr int STAGES = STAGES_;              // K (and V) shared-memory buffers
  static constexpr bool PINGPONG = PINGPONG_;         // order the two consumers' GEMMs through named barriers
  static constexpr bool PERSISTENT = PERSISTENT_;     // one CTA per SM walks the work items (see the header)
  static constexpr int CONSUMERS = BLOCK_M / 64;      // consumer warpgroups
  static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
  static constexpr int CONSUMER_WARPS = 4 * CONSUMERS;  // arrivals that release a K or V stage
  static constexpr int THREADS = 128 + CONSUMER_THREADS;  // producer warpgroup + consumers
  // setmaxnreg: the producer gives registers back to the consumers (the pool is 64K per SM at 1 CTA per SM)
  static constexpr int PRODUCER_REGS = 24;
  static constexpr int CONSUMER_REGS = CONSUMERS == 2 ? 240 : 160;  // three: 3 x 128 x 160 + 128 x 24 <= 64K
  static constexpr int N_TILES = BLOCK_N / 8;         // n8 column tiles of S (per consumer: 64 x BLOCK_N)
  static constexpr int D_TILES = HEAD_DIM / 8;        // n8 column tiles of O
  static constexpr int QK_K_STEPS = HEAD_DIM / 16;    // k16 steps of S = Q K^T
  static constexpr int PV_K_STEPS = BLOCK_N / 16;     // k16 steps of O += P V

  using TileQ = SmemTile<BLOCK_M, HEAD_DIM>;  // also the O staging's layout
  using TileKV = SmemTile<BLOCK_N, HEAD_DIM>;
  // TMA box width: one swizzle panel, 64 columns (128-byte swizzle), or 32 (64-byte swizzle) when HEAD_DIM is not a
  // multiple of 64 (head dims 32 and 96)
  static constexpr int BOX_COLS = TileQ::PANEL_COLS;
  static constexpr int PANELS = HEAD_DIM / BOX_COLS;  // TMA boxes per tile
  static constexpr int PANEL_BYTES = TileQ::PANEL_BYTES;
  static constexpr int SMEM_Q = TileQ::BYTES;
  static constexpr int SMEM_KV = TileKV::BYTES;
  // q_full, q_empty (persistent only), k_full[], k_empty[], v_full[], v_empty[], then, persistent only, the work
  // item ring: item_full[2], item_empty[2] and one 8-byte word holding the two slots' item indices
  static constexpr int Q_BARRIERS = PERSISTENT ? 2 : 1;
  static constexpr int ITEM_WORDS = PERSISTENT ? 5 : 0;
  static constexpr int BARRIERS = Q_BARRIERS + 4 * STAGES + ITEM_WORDS;
  // A persistent CTA stages O in a buffer of its own where shared memory allows, so that the next item's Q can
  // load while this item's last tile and epilogue run; otherwise (and always when not persistent) O is staged
  // in Q's rows, and the next Q waits for the epilogue's reads.
  static constexpr bool O_SEPARATE =
      PERSISTENT && 2 * SMEM_Q + 2 * STAGES * SMEM_KV + 8 * BARRIERS + 1024 <= 227 * 1024;
  static constexpr int OFF_Q = 0;
  static constexpr int OFF_K = SMEM_Q;                          // + stage * SMEM_KV
  static constexpr int OFF_V = OFF_K + STAGES * SMEM_KV;        // + stage * SMEM_KV
  static constexpr int OFF_O = O_SEPARATE ? OFF_V + STAGES * SMEM_KV : OFF_Q;
  static constexpr int OFF_BAR = OFF_V + STAGES * SMEM_KV + (O_SEPARATE ? SMEM_Q : 0);
  // + 1024: the kernel rounds the dynamic shared memory base up to the 1024-byte swizzle period
  static constexpr int SMEM_BYTES = OFF_BAR + 8 * BARRIERS + 1024;
  // a 16-bit bias and a mask: each consumer warp stages its 16 rows of a tile (cp.async, 16-byte chunks), row
  // pitches padded by 16 bytes so that the fragment reads of 8 rows hit distinct banks
  static constexpr int BIAS_PITCH = 2 * BLOCK_N + 16, MASK_PITCH = BLOCK_N + 16;
  static constexpr int OFF_STAGE = (OFF_BAR + 8 * BARRIERS + 15) / 16 * 16;
  static constexpr int stage_bytes(bool bias, bool mask) {
    return CONSUMER_WARPS * 16 * ((bias ? BIAS_PITCH : 0) + (mask ? MASK_PITCH : 0));
  }
  static constexpr int smem_bytes(bool bias, bool mask) {  // cuflash/config.py FwdSm90WsConfig.smem_bytes
    return bias || mask ? OFF_STAGE + stage_bytes(bias, mask) + 1024 : SMEM_BYTES;
  }

  // named barriers (0 is __syncthreads)
  static constexpr int PINGPONG_BAR = 1;  // + consumer: that consumer's turn to issue GEMMs
  static constexpr int EPILOGUE_BAR = 3;  // + consumer: its O staging in shared memory is complete

  static_assert(HEAD_DIM % 32 == 0 && TileKV::PANEL_COLS == BOX_COLS,
                "TMA boxes fill whole swizzle panels (64 or 32 columns): HEAD_DIM must be a multiple of 32");
  static_assert(is_wgmma_n(BLOCK_N) && is_wgmma_n(HEAD_DIM), "BLOCK_N and HEAD_DIM must be wgmma N sizes");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256 && BLOCK_M <= 256, "TMA box rows are at most 256");
  static_assert(STAGES >= 2 && STAGES <= 4, "K/V circular buffers of 2-4 stages");
  static_assert(CONSUMERS == 2 || (CONSUMERS == 3 && !PINGPONG),
                "two consumer warpgroups, or three without pingpong");
  static_assert(128 * PRODUCER_REGS + CONSUMER_THREADS * CONSUMER_REGS <= 65536, "setmaxnreg exceeds the register file");
  static_assert(SMEM_Q % 1024 == 0 && SMEM_KV % 1024 == 0 && (BLOCK_N * PANEL_BYTES) % 1024 == 0,
                "tiles and panels start on the 1024-byte swizzle period");
  static_assert(SMEM_Q + 2 * STAGES * SMEM_KV < (1 << 20), "expect_tx counts stay below 2^20");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

// mbarrier_try_wait_parity with a watchdog: a wait that outlasts 2^26 hardware try_wait time-outs (far beyond
// any legitimate wait of this kernel, which is a few tile loads long) traps, so an error in the protocol above
// (a wrong expect_tx byte count, parity or arrival count) fails the launch instead of hanging the GPU. Used by the
// producer and by the consumers' first waits (Q, K_0); the waits inside the consumers' key loop stay plain loops:
// the trap branch there, with S, P and O live, made ptxas spill 248-640 bytes (NVRTC 13.5).
__device__ __forceinline__ void mbarrier_wait_or_trap(u32 bar_smem, u32 parity) {
  for (u32 tries = 0; !mbarrier_try_wait_parity_once(bar_smem, parity); ++tries)
    if (tries == (1u << 26)) __trap();
}

// The online softmax of one key tile without the O rescale, which must wait for the P V GEMM still reading
// and writing O (OnlineSoftmax::update does both at once): m_new = max(m, rowmax(S)), l = l * alpha + rowsum(P),
// S overwritten by P = exp2(S * scale_log2 - m_new); alpha = exp2(m - m_new) for O *= alpha afterwards.
template <int N_TILES, int D_TILES>
__device__ __forceinline__ void softmax_probs(OnlineSoftmax<1, N_TILES, D_TILES>& softmax, float (&s)[1][N_TILES][4],
                                              float scale_log2, float (&alpha)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float tile_max = neg_inf();
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt) tile_max = fmaxf(tile_max, fmaxf(s[0][nt][2 * h], s[0][nt][2 * h + 1]));
    const float m_new = fmaxf(softmax.row_max[0][h], quad_max(tile_max) * scale_log2);
    // fully masked row so far: m_new == -inf; use 0 as the max so exp2(-inf - 0) = 0, not NaN
    const float m_use = (m_new == neg_inf()) ? 0.f : m_new;
    alpha[h] = ex2_approx(softmax.row_max[0][h] - m_use);  // exp2(-inf) = 0 on the first visible tile
    softmax.row_max[0][h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
      for (int c = 2 * h; c < 2 * h + 2; ++c) {
        s[0][nt][c] = ex2_approx(fmaf(s[0][nt][c], scale_log2, -m_use));
        sum += s[0][nt][c];
      }
    softmax.row_sum[0][h] = softmax.row_sum[0][h] * alpha[h] + sum;
  }
}

// P (fp32 accumulators of S) -> A registers of O += P V (the m16n8k16 A layout, per warp).
template <class T, int N_TILES, int PV_K_STEPS>
__device__ __forceinline__ void probs_to_regs(const float (&s)[1][N_TILES][4], u32 (&p_regs)[PV_K_STEPS][4]) {
#pragma unroll
  for (int kk = 0; kk < PV_K_STEPS; ++kk) {
    p_regs[kk][0] = Cvt<T>::pack(s[0][2 * kk][0], s[0][2 * kk][1]);
    p_regs[kk][1] = Cvt<T>::pack(s[0][2 * kk][2], s[0][2 * kk][3]);
    p_regs[kk][2] = Cvt<T>::pack(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
    p_regs[kk][3] = Cvt<T>::pack(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
  }
}

// The shared-memory layout's addresses (smem_base: the 1024-byte aligned base).
template <class Tr>
struct WsSmem {
  u32 base;
  __device__ __forceinline__ u32 q() const { return base + Tr::OFF_Q; }
  __device__ __forceinline__ u32 k(int stage) const { return base + Tr::OFF_K + stage * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 v(int stage) const { return base + Tr::OFF_V + stage * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 q_full() const { return base + Tr::OFF_BAR; }
  __device__ __forceinline__ u32 q_empty() const { return base + Tr::OFF_BAR + 8; }
  __device__ __forceinline__ u32 k_full(int stage) const { return base + Tr::OFF_BAR + 8 * (Tr::Q_BARRIERS + stage); }
  __device__ __forceinline__ u32 k_empty(int stage) const {
    return base + Tr::OFF_BAR + 8 * (Tr::Q_BARRIERS + Tr::STAGES + stage);
  }
  __device__ __forceinline__ u32 v_full(int stage) const {
    return base + Tr::OFF_BAR + 8 * (Tr::Q_BARRIERS + 2 * Tr::STAGES + stage);
  }
  __device__ __forceinline__ u32 v_empty(int stage) const {
    return base + Tr::OFF_BAR + 8 * (Tr::Q_BARRIERS + 3 * Tr::STAGES + stage);
  }
  // persistent: the work item ring (two slots)
  __device__ __forceinline__ u32 item_full(int slot) const {
    return base + Tr::OFF_BAR + 8 * (Tr::Q_BARRIERS + 4 * Tr::STAGES + slot);
  }
  __device__ __forceinline__ u32 item_empty(int slot) const {
    return base + Tr::OFF_BAR + 8 * (Tr::Q_BARRIERS + 4 * Tr::STAGES + 2 + slot);
  }
  __device__ __forceinline__ u32 item_slot(int slot) const {
    return base + Tr::OFF_BAR + 8 * (Tr::Q_BARRIERS + 4 * Tr::STAGES + 4) + 4 * slot;
  }
};

// Where a role is in the K/V circular buffers: the stage of its next key tile and that stage's phase bit. A
// persistent CTA's roles carry it from one work item to the next (the rings are not drained between items).
struct WsPipe {
  int stage = 0;
  u32 phase = 0;
  template <int STAGES>
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The item ring of a persistent CTA (fwd_sm90_ws_kernel, fwd_sm90_fp8_kernel; Smem has item_full, item_empty and
// item_slot): the producer's TMA thread puts item u's index into slot u % 2 once every reader has taken what the
// slot held two items ago; each reading thread takes it and frees the slot. An index >= items ends every role.
template <class Smem>
__device__ __forceinline__ void item_ring_put(const Smem& sm, u32 u, int index) {
  const int slot = u & 1;
  mbarrier_wait_or_trap(sm.item_empty(slot), ((u >> 1) & 1) ^ 1);
  st_shared_s32(sm.item_slot(slot), index);
  mbarrier_arrive(sm.item_full(slot));
}

template <class Smem>
__device__ __forceinline__ int item_ring_take(const Smem& sm, u32 u) {
  const int slot = u & 1;
  // a plain wait: the watchdog's trap branch here made ptxas spill 280-300 bytes at D 128 (NVRTC 13.5)
  mbarrier_try_wait_parity(sm.item_full(slot), (u >> 1) & 1);
  const int index = ld_shared_s32(sm.item_slot(slot));
  mbarrier_arrive(sm.item_empty(slot));  // this thread has read the slot
  return index;
}

// The end of a persistent CTA's walk of a work queue (queue[0]: the next untaken item, queue[1]: the CTAs done): the
// last CTA to finish (every CTA's last atomicAdd on queue[0] is ordered before its count on queue[1]) resets both
// counters, which leaves the queue at zero for the next launch.
__device__ __forceinline__ void work_queue_done(int* queue) {
  fence_acq_rel_gpu();
  if (atomicAdd(queue + 1, 1) == static_cast<int>(gridDim.x) - 1) {
    fence_acq_rel_gpu();
    atomicExch(queue, 0);
    atomicExch(queue + 1, 0);
  }
}

// One work item: query rows row0 .. row0 + BLOCK_M - 1 (query block m_block) of one (batch, head), its
// sequence (varlen), and the key tiles its rows see. Every thread of the CTA derives the same item from the same
// index, so the producer and the consumers walk the same items and the same tiles.
template <class Tr, bool IS_CAUSAL, int MODS>
struct WsItem {
  static constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  Seq seq;                              // varlen: lengths and first rows of sequence `batch`
  Band<IS_CAUSAL, HAS_WINDOW> band;
  TileMap tiles;                        // a BlockMask's map: the tiles it marks empty are skipped as well
  int m_block, head, batch;
  int row0;                             // first query row (in the sequence)
  int rows_q;                           // valid query rows
  int out_row0;                         // ... at this row of q, o and lse
  int n_begin, n_end, n_tiles;          // key tiles [n_begin, n_end) of the band, n_tiles of them visible
  bool live;                            // false: past this sequence's end (varlen), nothing to do

  // Item `index` of a persistent grid, in [0, m_blocks * heads * batch): query blocks fastest; causal: the longest
  // query blocks (most key tiles) first, so that the last ones to run are short.
  __device__ __forceinline__ void init(const FwdParams& f, int index, int m_blocks) {
    const int m_index = index % m_blocks, bh = index / m_blocks;
    head = bh % f.heads;
    batch = bh / f.heads;
    m_block = IS_CAUSAL ? m_blocks - 1 - m_index : m_index;
    seq = sequence(f.seq, batch);
    row0 = m_block * Tr::BLOCK_M;
    live = row0 < seq.len_q;
    rows_q = min(Tr::BLOCK_M, seq.len_q - row0);
    out_row0 = seq.q_row0 + row0;
    band = Band<IS_CAUSAL, HAS_WINDOW>{seq.len_k, seq.len_k - seq.len_q, HAS_WINDOW ? f.mods.window_left : 0,
                                       HAS_WINDOW ? f.mods.window_right : 0};
    n_begin = band.template key_block_begin<Tr::BLOCK_N>(row0);
    n_end = band.template key_block_end<Tr::BLOCK_N>(row0 + rows_q - 1);
    tiles.init(f.mods, ScoreMods<MODS>::HAS_TILE_MAP, batch, head, m_block);
    n_tiles = live && n_end > n_begin ? tiles.count(n_begin, n_end) : 0;
  }
};

// Producer (one thread), one work item: Q once the consumers have released the previous item's Q buffer, then K_i
// and V_i of the item's n_tiles visible key tiles from n_end-1 down (every tile of the band, or those a block
// map does not mark empty), each into the next stage once the consumers have released what it held STAGES tiles
// ago. q_phase: the item's parity on q_full / q_empty (items with key tiles counted from 0).
// A packed operand's maps have batch size 1, so the batch coordinate is 0 for it (seq: the sequence's first rows).
template <class Tr, class Item>
__device__ __forceinline__ void fwd_sm90_ws_producer(const FwdWsParams& p, const WsSmem<Tr>& sm, const Item& it,
                                                     WsPipe& pipe, u32 q_phase) {
  const int kv_head = it.head / p.fwd.seq.kv_group;  // GQA: the K/V head of this query head
  const int q_batch = p.fwd.seq.cu_seqlens_q != nullptr ? 0 : it.batch;
  const int kv_batch = p.fwd.seq.cu_seqlens_k != nullptr ? 0 : it.batch;

  // Q: rows row0 .. row0 + 127 of the sequence (rows past the array are zero-filled by TMA; varlen: rows past
  // the sequence are the next one's, computed but never stored). The first item passes q_empty at once.
  if (Tr::PERSISTENT) mbarrier_wait_or_trap(sm.q_empty(), q_phase ^ 1);
  mbarrier_arrive_expect_tx(sm.q_full(), Tr::SMEM_Q);
#pragma unroll
  for (int panel = 0; panel < Tr::PANELS; ++panel)
    cp_async_bulk_tensor_4d_global_to_shared(sm.q() + panel * Tr::BLOCK_M * Tr::PANEL_BYTES, &p.tma_q, sm.q_full(),
                                             panel * Tr::BOX_COLS, it.seq.q_row0 + it.row0, it.head, q_batch);

  int n_block = it.n_end;
  for (int i = 0; i < it.n_tiles; ++i) {
    n_block = it.tiles.next_down(n_block - 1, it.n_begin);
    // keys >= len_k are masked: zero-filled past the array, the next sequence's rows when packed
    const int key0 = it.seq.k_row0 + n_block * Tr::BLOCK_N;
    // K_i into stage `stage` once both consumers released K_{i - STAGES}
    mbarrier_wait_or_trap(sm.k_empty(pipe.stage), pipe.phase ^ 1);
    mbarrier_arrive_expect_tx(sm.k_full(pipe.stage), Tr::SMEM_KV);
#pragma unroll
    for (int panel = 0; panel < Tr::PANELS; ++panel)
      cp_async_bulk_tensor_4d_global_to_shared(sm.k(pipe.stage) + panel * Tr::BLOCK_N * Tr::PANEL_BYTES, &p.tma_k,
                                               sm.k_full(pipe.stage), panel * Tr::BOX_COLS, key0, kv_head, kv_batch);
    // V_i likewise
    mbarrier_wait_or_trap(sm.v_empty(pipe.stage), pipe.phase ^ 1);
    mbarrier_arrive_expect_tx(sm.v_full(pipe.stage), Tr::SMEM_KV);
#pragma unroll
    for (int panel = 0; panel < Tr::PANELS; ++panel)
      cp_async_bulk_tensor_4d_global_to_shared(sm.v(pipe.stage) + panel * Tr::BLOCK_N * Tr::PANEL_BYTES, &p.tma_v,
                                               sm.v_full(pipe.stage), panel * Tr::BOX_COLS, key0, kv_head, kv_batch);
    pipe.advance<Tr::STAGES>();
  }
}

// Consumer warpgroup `wg` (0, 1), one work item: query rows row0 + 64 wg .. + 63 of the item's tile. Rows and keys
// are counted within the sequence (the band, ALiBi and the dropout stream see them so); out_row0 = the sequence's
// first row in the packed arrays + row0 places O and lse. pipe: the ring position of the item's first key tile
// (left at the next item's); q_phase: the item's parity on q_full / q_empty.
template <class Tr, bool IS_CAUSAL, int MODS>
__device__ __forceinline__ void fwd_sm90_ws_consumer(const FwdParams& p, const WsSmem<Tr>& sm, unsigned char* smem,
                                                     const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                                     int row0, int out_row0, int rows_q, int head, int batch, int n_end,
                                                     int n_tiles, const TileMap& tiles, int n_begin, WsPipe& pipe,
                                                     u32 q_phase) {
  using T = typename Tr::T;
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  const int ctid = threadIdx.x - 128;                // 0 .. CONSUMER_THREADS-1
  const int wg = ctid / 128, lane = ctid & 31;
  const int warp = ctid / 32;                        // 0..7: rows 16 warp .. + 15 of the CTA's tile
  const int warp_row = row0 + warp * 16;             // this warp's first query row (in the sequence)
  const int wg_row = row0 + wg * 64;                 // this warpgroup's first query row
  // this warpgroup's 64 Q rows: whole 8-row swizzle atoms, so the descriptor just starts there
  const u32 q_smem_wg = sm.q() + Tr::TileQ::offset(wg * 64, 0);
  const float scale_log2 = p.scale_log2;

  float o_acc[1][Tr::D_TILES][4];  // O of this warp's 16 rows, fp32, in registers throughout
#pragma unroll
  for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) o_acc[0][dt][c] = 0.f;
  OnlineSoftmax<1, Tr::N_TILES, Tr::D_TILES> softmax;
  softmax.init();
  float s_acc[1][Tr::N_TILES][4];      // S_i, then P_i (fp32)
  u32 p_regs[Tr::PV_K_STEPS][4];       // P_{i-1} as the A operand of the P V GEMM in flight
  float alpha[2];
  using Mods = ScoreMods<MODS>;
  Mods mods;  // softcap, ALiBi, dropout, bias, mask of this (batch, head); nothing when MODS = 0
  mods.init(p.mods, batch, head, p.heads, row0 + rows_q, band.seqlen_k);

  // A 16-bit bias and the mask are staged per warp: its 16 rows of a tile copied to shared memory with 16-byte
  // cp.async while the tile's scores are computed, then read from there. Read straight from global memory, each
  // element was a load of its own and a warp's load touched 8 rows' cache lines (the bias forward measured ~1/5
  // of the plain one's TFLOP/s). A float32 bias, or rows not 16-byte aligned, keep the direct loads (prefetched
  // into L1).
  constexpr bool HAS_ARRAYS = Mods::HAS_BIAS || Mods::HAS_MASK;
  unsigned char* bias_rows = smem + Tr::OFF_STAGE + warp * 16 * ((Mods::HAS_BIAS ? Tr::BIAS_PITCH : 0) +
                                                                  (Mods::HAS_MASK ? Tr::MASK_PITCH : 0));
  unsigned char* mask_rows = bias_rows + (Mods::HAS_BIAS ? 16 * Tr::BIAS_PITCH : 0);
  bool staged_bias = false, staged_mask = false;
  // the bias loop of apply_mods below: per n8 tile with a staged bias alone or beside a window, else per score
  // a bias and a mask (a window aside) at head dims up to 64, Evoformer's pair bias and MSA mask: the bias by
  // SPLIT_BIAS's loop on every tile, the mask as MASK_ONLY's, read only on the tiles that are not full
  constexpr bool BIAS_MASK = Mods::HAS_BIAS && Mods::HAS_MASK && !(MODS & ~(MOD_BIAS | MOD_MASK | MOD_WINDOW)) &&
                             Tr::HEAD_DIM <= 64;
  constexpr bool SPLIT_BIAS = !(MODS & (MOD_ALIBI | MOD_SOFTCAP | MOD_DROPOUT | MOD_MASK)) || BIAS_MASK;
  // a mask with at most a window beside it (the kernels of config.FWD_SM90_WS_TILES_MASK)
  constexpr bool MASK_ONLY = Mods::HAS_MASK && !(MODS & ~(MOD_MASK | MOD_WINDOW)) && Tr::HEAD_DIM < 256;
  constexpr bool MASK_PAIRS = MASK_ONLY || BIAS_MASK;  // a tile that reads the mask has it staged, read by key pairs
  // (a 16-bit bias is in q's dtype, the host's rule; SPLIT_BIAS converts it as such. Tested as bias_kind == T's
  // there only: in the per-score loop that test made ptxas spill 4 bytes at head dim 128 under NVRTC 13.0)
  if (Mods::HAS_BIAS)
    staged_bias = (SPLIT_BIAS ? mods.bias_kind == Cvt<T>::BIAS_KIND : mods.bias_kind != 0) && mods.bias_k == 2 &&
                  mods.bias_q % 16 == 0 &&
                  reinterpret_cast<unsigned long long>(mods.bias_base) % 16 == 0;
  if (Mods::HAS_MASK)
    staged_mask = mods.mask_k == 1 && mods.mask_q % 16 == 0 && reinterpret_cast<unsigned long long>(mods.mask_base) % 16 == 0;
  // this warp's rows of key tile n_block: cp.async of whole 16-byte chunks (the row's tail zero-filled), or an L1
  // prefetch for what is not staged; called right after the tile's S GEMM is issued
  auto fetch_tile = [&](int n_block) {
    if (!HAS_ARRAYS) return;
    const int key0 = n_block * Tr::BLOCK_N;
    __syncwarp();  // every lane has read the previous tile's rows
    if (Mods::HAS_BIAS && staged_bias) {
      constexpr int CHUNKS = Tr::BLOCK_N / 8;  // 8 keys of 2 bytes each
      for (int i = lane; i < 16 * CHUNKS; i += 32) {
        const int r = i / CHUNKS, key = key0 + (i % CHUNKS) * 8;
        const int bytes = max(0, min(16, 2 * (mods.last_k + 1 - key)));
        const unsigned char* row = mods.bias_base + min(warp_row + r, mods.last_q) * mods.bias_q;
        cp_async_cg_16_n(smem_u32(bias_rows + r * Tr::BIAS_PITCH + (i % CHUNKS) * 16), bytes > 0 ? row + 2 * key : row,
                         bytes);
      }
    }
    if (Mods::HAS_MASK && staged_mask && mods.check_mask) {
      constexpr int CHUNKS = Tr::BLOCK_N / 16;  // 16 keys of 1 byte each
      for (int i = lane; i < 16 * CHUNKS; i += 32) {
        const int r = i / CHUNKS, key = key0 + (i % CHUNKS) * 16;
        const int bytes = max(0, min(16, mods.last_k + 1 - key));
        const unsigned char* row = mods.mask_base + min(warp_row + r, mods.last_q) * mods.mask_q;
        cp_async_cg_16_n(smem_u32(mask_rows + r * Tr::MASK_PITCH + (i % CHUNKS) * 16), bytes > 0 ? row + key : row, bytes);
      }
    } else if (MASK_PAIRS && mods.check_mask) {
      // a mask alone whose rows are not whole 16-byte chunks: staged all the same, byte by byte (keys past the
      // sequence 0, as the chunks' zero fill), so that its scores are masked by the one path of apply_mods
#pragma unroll 1
      for (int i = lane; i < 16 * Tr::BLOCK_N; i += 32) {
        const int r = i / Tr::BLOCK_N, key = key0 + i % Tr::BLOCK_N;
        mask_rows[r * Tr::MASK_PITCH + i % Tr::BLOCK_N] = key <= mods.last_k && mods.kept_by_mask(warp_row + r, key);
      }
    }
    cp_async_commit_group();
    if (Tr::HEAD_DIM < 256 && !MASK_PAIRS && ((Mods::HAS_BIAS && !staged_bias) || (Mods::HAS_MASK && !staged_mask)))
      mods.template prefetch_rows<Tr::BLOCK_N>(warp_row, key0, lane);
    else if (BIAS_MASK && !staged_bias)
      mods.template prefetch_rows<Tr::BLOCK_N, /*WITH_MASK=*/false>(warp_row, key0, lane);
  };
  // the modifiers on S of key tile n_block (apply_score_mods, with the staged rows read from shared memory)
  auto apply_mods = [&](int n_block) {
    float unused_dcap[1][Tr::N_TILES][4];
    const int key0 = n_block * Tr::BLOCK_N;
    if (!HAS_ARRAYS) {
      apply_score_mods(s_acc, unused_dcap, warp_row, key0, band.diag, mods, lane);
      return;
    }
    // A mask alone (a window aside, applied with the band): a full tile has nothing to apply and returns here; a
    // partial one, always staged (fetch_tile), takes each thread's two adjacent keys of a row in one 2-byte shared
    // load. Through the per-score loop below, every score kept its branch on check_mask and its own load: the mask
    // kernels ran 1.8x (head dim 128) and 2.5x (64) the plain kernel's time per visited tile, full tiles included.
    // (With that loop's global loads kept for masks not staged, ptxas hoisted them ahead of their tests and spilled
    // 4-40 bytes.)
    if (MASK_ONLY && !mods.check_mask) return;
    cp_async_wait_group<0>();
    __syncwarp();  // the other lanes' chunks have landed too
    const int g = lane >> 2, t = lane & 3;
    auto mask_pairs = [&]() {
#pragma unroll
      for (int nt = 0; nt < Tr::N_TILES; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const u32 pair = *reinterpret_cast<const u16*>(mask_rows + (g + 8 * h) * Tr::MASK_PITCH + nt * 8 + 2 * t);
          if (!(pair & 0xffu)) s_acc[0][nt][2 * h] = neg_inf();
          if (!(pair >> 8)) s_acc[0][nt][2 * h + 1] = neg_inf();
        }
    };
    if (MASK_ONLY) {
      mask_pairs();
      return;
    }
    // A staged bias: beside no ALiBi, soft-capping, dropout or mask (SPLIT_BIAS), each pair of adjacent keys in one
    // 4-byte load, converted from the input dtype (the one 16-bit bias dtype), staged or not decided per n8 tile:
    // tested per score, the branch, a 2-byte load and the dtype test cost 3 instructions beside the conversion and
    // the add. With them, the loop below keeps its test per score: split per tile (or with the pairs loaded
    // ahead), ptxas spilled 4-40 bytes at head dims 128 and 256.
    if constexpr (!SPLIT_BIAS) {
#pragma unroll
      for (int nt = 0; nt < Tr::N_TILES; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int lr = g + 8 * (c >> 1), lc = nt * 8 + 2 * t + (c & 1);  // in this warp's 16 rows of the tile
          const int query = warp_row + lr, key = key0 + lc;
          float b = 0.f;
          if (Mods::HAS_BIAS) {
            if (staged_bias) {
              const u16 h = *reinterpret_cast<const u16*>(bias_rows + lr * Tr::BIAS_PITCH + 2 * lc);
              b = (mods.bias_kind == 1 ? Cvt<f16>::to_float(h) : Cvt<bf16>::to_float(h)) * mods.bias_scale;
            } else {
              b = mods.bias_at(query, key);
            }
          }
          bool kept = true;
          if (Mods::HAS_MASK && mods.check_mask)
            kept = staged_mask ? mask_rows[lr * Tr::MASK_PITCH + lc] != 0 : mods.kept_by_mask(query, key);
          s_acc[0][nt][c] = mods.score_of(s_acc[0][nt][c], query, key, band.diag, unused_dcap[0][nt][c], b, kept);
        }
    } else {
      auto modify = [&](int nt, int c, float b) {  // (the mask, with BIAS_MASK, after the loop)
        s_acc[0][nt][c] = mods.score_of(s_acc[0][nt][c], warp_row + g + 8 * (c >> 1), key0 + nt * 8 + 2 * t + (c & 1),
                                        band.diag, unused_dcap[0][nt][c], b, true);
      };
#pragma unroll
      for (int nt = 0; nt < Tr::N_TILES; ++nt) {
        if (Mods::HAS_BIAS && staged_bias) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const u32 pair =
                *reinterpret_cast<const u32*>(bias_rows + (g + 8 * h) * Tr::BIAS_PITCH + 2 * (nt * 8 + 2 * t));
            modify(nt, 2 * h, Cvt<T>::unpack(pair, 0) * mods.bias_scale);
            modify(nt, 2 * h + 1, Cvt<T>::unpack(pair, 1) * mods.bias_scale);
          }
        } else {
#pragma unroll
          for (int c = 0; c < 4; ++c)
            modify(nt, c, Mods::HAS_BIAS ? mods.bias_at(warp_row + g + 8 * (c >> 1), key0 + nt * 8 + 2 * t + (c & 1))
                                         : 0.f);
        }
      }
      if (BIAS_MASK && mods.check_mask) mask_pairs();
    }
  };

  // pingpong: consumer 0 issues first (consumer 1 gives it the first token)
  auto round_begin = [&]() {
    if (Tr::PINGPONG) named_barrier_sync(Tr::PINGPONG_BAR + wg, 256);
  };
  auto round_end = [&](bool is_last) {
    if (Tr::PINGPONG && !(is_last && wg == 1)) named_barrier_arrive(Tr::PINGPONG_BAR + 1 - wg, 256);
  };
  if (Tr::PINGPONG && wg == 1) named_barrier_arrive(Tr::PINGPONG_BAR, 256);

  // S = Q K^T (unscaled; the scale is folded into the exp2 argument): 64 x BLOCK_N per warpgroup
  auto issue_s = [&](u32 k_smem) {
#pragma unroll
    for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk)
      Wgmma<Tr::BLOCK_N, T>::template ss</*TRANS_A=*/0, /*TRANS_B=*/0>(
          s_acc[0], Tr::TileQ::desc_k_major(q_smem_wg, 0, kk * 16), Tr::TileKV::desc_k_major(k_smem, 0, kk * 16),
          /*scale_d=*/kk > 0);
    wgmma_commit_group();
  };
  // O += P V: V read N-major from shared memory (its rows are the k dimension)
  auto issue_pv = [&](u32 v_smem) {
#pragma unroll
    for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk)
      Wgmma<Tr::HEAD_DIM, T>::template rs</*TRANS_B=*/1>(o_acc[0], p_regs[kk], Tr::TileKV::desc_mn_major(v_smem, kk * 16, 0),
                                                         /*scale_d=*/1);
    wgmma_commit_group();
  };
  // a K or V stage is free again: one arrival per warp (the empty barriers count CONSUMER_WARPS)
  auto release = [&](u32 bar) {
    if (lane == 0) mbarrier_arrive(bar);
  };
  // S_i -> P_i: softcap, ALiBi (mods.cuh); the tail of K, the causal diagonal, the window: masked scores = -inf
  // (only on tiles that hold an invisible pair for some row of this warpgroup: on the right its first row sees
  // the fewest keys, on the left its last row); m_new, l, P = exp2(S * scale_log2 - m_new); then dropout, after
  // the row sums (lse is of the undropped softmax). The same order as fwd_sm90_key_tile.
  auto scores_to_probs = [&](int n_block) {
    const int key0 = n_block * Tr::BLOCK_N;
    apply_mods(n_block);
    if (band.needs_mask_right(wg_row, key0 + Tr::BLOCK_N - 1) || band.needs_mask_left(wg_row + 63, key0))
      apply_band_mask<IS_CAUSAL, HAS_WINDOW>(s_acc, warp_row, key0, band, lane);
    softmax_probs(softmax, s_acc, scale_log2, alpha);
    apply_dropout(s_acc, warp_row, key0, mods, lane);
  };

  mbarrier_wait_or_trap(sm.q_full(), Tr::PERSISTENT ? q_phase : 0);
  // Q's buffer is free for the next item once this warp's last S GEMM has retired (O staged elsewhere), or
  // else once its O staging has been read (after the stores, below)
  auto release_q = [&]() {
    if (Tr::O_SEPARATE) release(sm.q_empty());
  };

  // key tile 0 (the last-indexed key block): S_0, P_0. O is still 0: nothing to rescale.
  int stage = Tr::PERSISTENT ? pipe.stage : 0;  // of key tile i
  u32 phase = Tr::PERSISTENT ? pipe.phase : 0;
  int n_block = tiles.next_down(n_end - 1, n_begin);  // the visible key tiles, from the last down
  round_begin();
  mbarrier_wait_or_trap(sm.k_full(stage), phase);
  wgmma_fence();
  issue_s(sm.k(stage));
  round_end(/*is_last=*/false);
  if (Mods::HAS_MASK) mods.check_mask = tiles.state(n_block) != TILE_FULL;
  fetch_tile(n_block);  // the tile's bias and mask rows, while S is computed
  wgmma_wait_group<0>();
  wgmma_fence_operand(s_acc[0]);
  release(sm.k_empty(stage));
  if (n_tiles == 1) release_q();
  scores_to_probs(n_block);
  probs_to_regs<T>(s_acc, p_regs);

  int v_stage = stage;  // of key tile i - 1
  u32 v_phase = phase;
  if (++stage == Tr::STAGES) {
    stage = 0;
    phase ^= 1;
  }
  for (int i = 1; i < n_tiles; ++i) {
    n_block = tiles.next_down(n_block - 1, n_begin);
    // issue S_i = Q K_i^T, then O += P_{i-1} V_{i-1}
    round_begin();
    mbarrier_try_wait_parity(sm.k_full(stage), phase);
    wgmma_fence();  // p_regs and o_acc were written since the last wgmma
    issue_s(sm.k(stage));
    mbarrier_try_wait_parity(sm.v_full(v_stage), v_phase);
    issue_pv(sm.v(v_stage));
    round_end(/*is_last=*/false);
    if (Mods::HAS_MASK) mods.check_mask = tiles.state(n_block) != TILE_FULL;
    fetch_tile(n_block);

    // S_i done (the P V GEMM may still run): K_i is free; m_new, l, P_i = exp2(S_i * scale_log2 - m_new)
    wgmma_wait_group<1>();
    wgmma_fence_operand(s_acc[0]);
    release(sm.k_empty(stage));
    if (i == n_tiles - 1) release_q();
    scores_to_probs(n_block);

    // P V done: V_{i-1} is free; O *= exp2(m_old - m_new); P_i -> A registers
    wgmma_wait_group<0>();
    wgmma_fence_operand(o_acc[0]);
    release(sm.v_empty(v_stage));
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt) {
      o_acc[0][dt][0] *= alpha[0];
      o_acc[0][dt][1] *= alpha[0];
      o_acc[0][dt][2] *= alpha[1];
      o_acc[0][dt][3] *= alpha[1];
    }
    probs_to_regs<T>(s_acc, p_regs);

    v_stage = stage;
    v_phase = phase;
    if (++stage == Tr::STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
  // the last tile's O += P V
  round_begin();
  mbarrier_try_wait_parity(sm.v_full(v_stage), v_phase);
  wgmma_fence();
  issue_pv(sm.v(v_stage));
  round_end(/*is_last=*/true);
  wgmma_wait_group<0>();
  wgmma_fence_operand(o_acc[0]);
  release(sm.v_empty(v_stage));
  if (Tr::PERSISTENT) {  // the next item's first key tile
    pipe.stage = stage;
    pipe.phase = phase;
  }

  // epilogue: O /= l (and * 1 / (1 - p) with dropout), lse (rows that saw no key: O = 0, lse = -inf); O -> shared
  // (this warpgroup's own rows of the O buffer: Q's rows, which only its own, finished GEMMs read, unless O has a
  // buffer of its own) -> 16-byte stores of the valid rows and columns (varlen: rows past the sequence belong to
  // the next one and are not stored)
  float lse[1][2];
  softmax.finalize(o_acc, lse);
  if (ScoreMods<MODS>::HAS_DROPOUT) scale_acc(o_acc, p.mods.dropout_rp);
  float* lse_gmem = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + out_row0;
  const int g = lane >> 2, t = lane & 3;
  // a persistent warpgroup's own O buffer: every thread has read the previous item's O from it
  if (Tr::O_SEPARATE) named_barrier_sync(Tr::EPILOGUE_BAR + wg, 128);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp * 16 + g + h * 8;  // in the CTA's tile
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt)
      *reinterpret_cast<u32*>(smem + Tr::OFF_O + Tr::TileQ::offset(row, dt * 8 + 2 * t)) =
          Cvt<T>::pack(o_acc[0][dt][2 * h], o_acc[0][dt][2 * h + 1]);
    if (t == 0 && row < rows_q && p.lse != nullptr) lse_gmem[row] = lse[0][h];
  }
  named_barrier_sync(Tr::EPILOGUE_BAR + wg, 128);
  u16* o_gmem = p.o + batch * p.o_batch_stride + static_cast<long long>(out_row0) * p.o_row_stride + head * p.o_head_stride;
  constexpr int CHUNKS_PER_ROW = Tr::HEAD_DIM / 8;
  // 8 lanes read one 128-byte line: row-major over 128-byte panels (8 chunks of one row); over 64-byte panels of a
  // wider row (D 96) panel by panel, so that two rows of one panel, not a row across two panels (the same banks,
  // ROWS * 64 bytes apart), share a phase
  constexpr int PANEL_CHUNKS = Tr::TileQ::PANEL_COLS / 8;
  constexpr bool PANEL_ORDER = PANEL_CHUNKS < 8 && CHUNKS_PER_ROW > PANEL_CHUNKS;
  for (int idx = ctid - wg * 128; idx < 64 * CHUNKS_PER_ROW; idx += 128) {
    const int row = wg * 64 + (PANEL_ORDER ? idx % (64 * PANEL_CHUNKS) / PANEL_CHUNKS : idx / CHUNKS_PER_ROW);
    const int col = PANEL_ORDER ? idx / (64 * PANEL_CHUNKS) * Tr::TileQ::PANEL_COLS + idx % PANEL_CHUNKS * 8
                                : (idx % CHUNKS_PER_ROW) * 8;
    if (row < rows_q && col < p.head_dim)
      *reinterpret_cast<uint4*>(o_gmem + row * p.o_row_stride + col) =
          *reinterpret_cast<const uint4*>(smem + Tr::OFF_O + Tr::TileQ::offset(row, col));
  }
  if (Tr::PERSISTENT && !Tr::O_SEPARATE) {
    // O was staged in Q's rows: the next item's Q (a TMA write: the async proxy) may overwrite them once every
    // lane of the warp has read them and its generic-proxy writes are ordered before the async proxy's
    fence_proxy_async_shared();
    __syncwarp();
    release(sm.q_empty());
  }
}

// Thread 0 initializes the mbarriers (q_empty and the item ring only when persistent); the caller syncs the CTA
// after it.
template <class Tr>
__device__ __forceinline__ void ws_init_barriers(const WsSmem<Tr>& sm) {
  if (threadIdx.x != 0) return;
  mbarrier_init(sm.q_full(), 1);
  if (Tr::PERSISTENT) {
    mbarrier_init(sm.q_empty(), Tr::CONSUMER_WARPS);
    for (int slot = 0; slot < 2; ++slot) {
      mbarrier_init(sm.item_full(slot), 1);
      mbarrier_init(sm.item_empty(slot), Tr::CONSUMER_THREADS);
    }
  }
#pragma unroll
  for (int s = 0; s < Tr::STAGES; ++s) {
    mbarrier_init(sm.k_full(s), 1);
    mbarrier_init(sm.v_full(s), 1);
    mbarrier_init(sm.k_empty(s), Tr::CONSUMER_WARPS);
    mbarrier_init(sm.v_empty(s), Tr::CONSUMER_WARPS);
  }
  fence_mbarrier_init();
}

// An item whose rows see no key (e.g. causal with seqlen_q > seqlen_k): O = 0, lse = -inf, written by THREADS
// threads (tid: this thread's index among them).
template <class Tr, int THREADS>
__device__ __forceinline__ void ws_write_empty_rows(const FwdParams& f, int batch, int head, int out_row0, int rows_q,
                                                    int tid) {
  zero_tile_gmem<typename Tr::TileQ, THREADS>(
      f.o + batch * f.o_batch_stride + static_cast<long long>(out_row0) * f.o_row_stride + head * f.o_head_stride,
      f.o_row_stride, rows_q, f.head_dim, tid);
  if (f.lse != nullptr)
    for (int r = tid; r < rows_q; r += THREADS)
      f.lse[batch * f.lse_batch_stride + head * f.lse_head_stride + out_row0 + r] = neg_inf();
}

template <class Tr, bool IS_CAUSAL, int MODS>
__global__ void __launch_bounds__(Tr::THREADS, 1) fwd_sm90_ws_kernel(const __grid_constant__ FwdWsParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const AlignedSmem aligned = align_smem_1024(smem_raw);
  const u32 smem_base = aligned.base;
  unsigned char* smem = aligned.ptr;
  const WsSmem<Tr> sm{smem_base};
  // the host's shared memory size (cuflash/_tma.py:FwdSm90WsConfig.smem_bytes) must cover this layout
  static_assert(Tr::smem_bytes(ScoreMods<MODS>::HAS_BIAS, ScoreMods<MODS>::HAS_MASK) <= 227 * 1024,
                "shared memory per CTA exceeds the sm_90 limit (the bias and mask staging included)");
  if (dynamic_smem_size() < Tr::smem_bytes(ScoreMods<MODS>::HAS_BIAS, ScoreMods<MODS>::HAS_MASK)) __trap();

  using Item = WsItem<Tr, IS_CAUSAL, MODS>;
  if (!Tr::PERSISTENT) {  // one work item per CTA: the grid is (m_blocks, heads, batch)
    // causal: launch the longest query blocks (most key tiles) first so the last wave is short
    const int m_block = IS_CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
    const int head = blockIdx.y, batch = blockIdx.z;
    const Seq seq = sequence(p.fwd.seq, batch);                   // varlen: lengths and first rows of sequence `batch`
    const int row0 = m_block * Tr::BLOCK_M;                        // first query row of this CTA (in the sequence)
    if (row0 >= seq.len_q) return;                                 // varlen: past this sequence's end
    const int rows_q = min(Tr::BLOCK_M, seq.len_q - row0);         // valid query rows
    const int out_row0 = seq.q_row0 + row0;                        // ... at this row of q, o and lse
    // key tiles [n_begin, n_end): tiles outside the causal / window band of the CTA's rows are skipped
    const Band<IS_CAUSAL, HAS_WINDOW> band{seq.len_k, seq.len_k - seq.len_q, HAS_WINDOW ? p.fwd.mods.window_left : 0,
                                          HAS_WINDOW ? p.fwd.mods.window_right : 0};
    const int n_begin = band.template key_block_begin<Tr::BLOCK_N>(row0);
    const int n_end = band.template key_block_end<Tr::BLOCK_N>(row0 + rows_q - 1);
    // a BlockMask's map: the tiles it marks empty are skipped as well (every thread counts the same tiles)
    TileMap tiles;
    tiles.init(p.fwd.mods, ScoreMods<MODS>::HAS_TILE_MAP, batch, head, m_block);
    const int n_tiles = n_end > n_begin ? tiles.count(n_begin, n_end) : 0;

    if (n_tiles <= 0) {  // e.g. causal with seqlen_q > seqlen_k: these rows see no key
      ws_write_empty_rows<Tr, Tr::THREADS>(p.fwd, batch, head, out_row0, rows_q, threadIdx.x);
      return;
    }

    ws_init_barriers<Tr>(sm);
    __syncthreads();
    WsPipe pipe;

    if (threadIdx.x < 128) {  // producer warpgroup: one thread issues every load; the others are done
      setmaxnreg_dec<Tr::PRODUCER_REGS>();
      if (threadIdx.x == 0) {
        prefetch_tensormap(&p.tma_q);
        prefetch_tensormap(&p.tma_k);
        prefetch_tensormap(&p.tma_v);
        fwd_sm90_ws_producer<Tr>(p, sm, Item{seq, band, tiles, m_block, head, batch, row0, rows_q, out_row0, n_begin,
                                              n_end, n_tiles, true}, pipe, 0);
      }
    } else {  // consumer warpgroups
      setmaxnreg_inc<Tr::CONSUMER_REGS>();
      fwd_sm90_ws_consumer<Tr, IS_CAUSAL, MODS>(p.fwd, sm, smem, band, row0, out_row0, rows_q, head, batch, n_end,
                                                n_tiles, tiles, n_begin, pipe, 0);
    }
  } else {
    // (a tile map's walk in the producer thread's item loop spilled 64-68 bytes at 24 registers: 32 there, the two
    // consumers 232 instead of 240, within the registers the launch gives the CTA)
    constexpr bool MAP = ScoreMods<MODS>::HAS_TILE_MAP;
    constexpr int PRODUCER_REGS = MAP ? 32 : Tr::PRODUCER_REGS;
    constexpr int CONSUMER_REGS = MAP && Tr::CONSUMERS == 2 ? 232 : Tr::CONSUMER_REGS;
    static_assert(128 * PRODUCER_REGS + Tr::CONSUMER_THREADS * CONSUMER_REGS <= 65536 / Tr::THREADS / 8 * 8 * Tr::THREADS,
                  "setmaxnreg exceeds the registers of the launch");
    // Persistent: a grid of at most one CTA per SM walks the m_blocks * heads * batch work items (WsItem), so each
    // role runs into the next item's loads (producer) and GEMMs (consumers) without a new CTA's start, and the
    // next item's Q, K and V load under this item's last key tile and epilogue. The producer thread decides which
    // items its CTA takes and passes each index to the consumers through a two-slot ring in shared memory
    // (item_full: its arrival after the slot's store; item_empty: one arrival per consumer thread after its read);
    // an index >= items ends both roles. CTA c takes item c first, then, without a queue, c + gridDim.x, ...
    // (items of equal cost), or, with one (p.queue), the next untaken item: an atomicAdd on the queue's counter
    // once this item's loads are issued. Both roles skip the same items.
    ws_init_barriers<Tr>(sm);
    __syncthreads();

    WsPipe pipe;
    u32 q_phase = 0;  // items with key tiles so far, mod 2
    if (threadIdx.x < 128) {  // producer warpgroup: one thread issues every load; the others are done
      setmaxnreg_dec<PRODUCER_REGS>();
      if (threadIdx.x != 0) return;
      prefetch_tensormap(&p.tma_q);
      prefetch_tensormap(&p.tma_k);
      prefetch_tensormap(&p.tma_v);
      int index = blockIdx.x;
      for (u32 u = 0;; ++u) {
        item_ring_put(sm, u, index);  // the consumers take it
        if (index >= p.items) break;
        Item it;
        it.init(p.fwd, index, p.m_blocks);
        if (it.n_tiles > 0) {  // else nothing to load (past the sequence's end, or no visible key)
          fwd_sm90_ws_producer<Tr>(p, sm, it, pipe, q_phase);
          q_phase ^= 1;
        }
        // the next item, taken once this item's last loads are issued (the consumers are then STAGES tiles from
        // its end, which hides the atomic's round trip): taken when this item starts, a long item held the next
        // one back behind it, and the CTAs' ends spread by up to an item (D 128 causal N 16k: SMs idle 8 % of the
        // launch under ncu, against 2 % for the one-item grid)
        index = p.queue != nullptr ? gridDim.x + atomicAdd(p.queue, 1) : index + gridDim.x;
      }
      if (p.queue != nullptr) work_queue_done(p.queue);
    } else {  // consumer warpgroups
      setmaxnreg_inc<CONSUMER_REGS>();
      for (u32 u = 0;; ++u) {
        const int index = item_ring_take(sm, u);
        if (index >= p.items) break;
        Item it;
        it.init(p.fwd, index, p.m_blocks);
        if (!it.live) continue;  // varlen: past this sequence's end
        if (it.n_tiles <= 0) {  // these rows see no key
          ws_write_empty_rows<Tr, Tr::CONSUMER_THREADS>(p.fwd, it.batch, it.head, it.out_row0, it.rows_q,
                                                        threadIdx.x - 128);
          continue;
        }
        fwd_sm90_ws_consumer<Tr, IS_CAUSAL, MODS>(p.fwd, sm, smem, it.band, it.row0, it.out_row0, it.rows_q, it.head,
                                                  it.batch, it.n_end, it.n_tiles, it.tiles, it.n_begin, pipe, q_phase);
        q_phase ^= 1;
      }
    }
  }
#else
  static_assert(Tr::HEAD_DIM < 0, "fwd_sm90_ws_kernel uses TMA and wgmma: compile it for sm_90a");
#endif
}

}  // namespace cuflash
