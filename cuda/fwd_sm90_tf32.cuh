// fwd_sm90_tf32.cuh: the float32 forward on sm_90a: S = Q K^T and O = P V on TF32 wgmma (m64nNk8), fp32 accumulators
// and softmax, O and lse in float32. The pipeline is fwd_sm90_fp8.cuh's (a TMA producer warp, three producer warps
// preparing the operands, consumer warpgroups of 64 query rows, the softmax of key tile i under the P V GEMM of tile
// i - 1), with what float32 changes:
//
// * The arithmetic is wide.cuh's. X3 (precision "fp32"): every operand x is split into x = big + small, both TF32
//   (round_tf32), and each product is small*big + big*small + big*big in fp32 accumulators (3xTF32: float32-level
//   accuracy at three times the tensor work); otherwise (precision "tf32") one TF32 product of x rounded to TF32.
//   The tensor cores truncate while they accumulate, so no chain of products sums more than 64 k (wide.cuh's
//   CHAIN_K): S at head dim 128 is two chains (S and S2, added after the GEMM), and every key tile's P V goes to a
//   fresh accumulator O_tile that is added to O in fp32 (O = (O + O_tile) * alpha), never summed over the key loop.
// * The operands are prepared once per CTA in shared memory, not per warp: TMA brings Q, K, V as float32; the three
//   preparing warps ("splitters") split (or round) K in place (small or rounded where the float32 was, big beside
//   it), the consumers their rows of Q the same way, and the splitters transpose V: TF32 wgmma reads both operands
//   K-major, and V (keys, head_dim) is not K-major for O = P V, so V^T (head_dim rows of BLOCK_N keys) is written,
//   big and small, from V's stage. No pass over global memory.
// * P goes from the S accumulators to the A registers of the P V GEMM without a shuffle: thread (g, t) holds S
//   columns 2t, 2t + 1 of n8 tile j, and a TF32 A fragment wants k = t and t + 4 of k8 step j. Taking column 2t as
//   k = t and 2t + 1 as k = t + 4 permutes the keys of each 8-key group (tf32_key_of below); the splitters write V^T
//   in the same key order, so P V sums the same products.
// * Shared memory: a float32 tile of C columns is stored as the 16-bit SmemTile of 2C columns (the same bytes, 128-byte
//   swizzle panels of 32 floats), so TMA's swizzled boxes and the wgmma descriptors of tiles.cuh apply as they are:
//   a k8 step of TF32 is 32 bytes, as a k16 step of a 16-bit type.
// * Q_REGS: each consumer reads its rows of Q's big part (or of the rounded Q) into A registers once (tf32_load_a), so
//   the S products that take them read only K from shared memory: an A operand of 64 rows x 8 floats is 2 KB, which a
//   wgmma from shared memory reads again for every key tile, more than shared memory delivers per tensor-core clock
//   beside K's 0.5-2 KB.
//
// One CTA = BLOCK_M = 64 * CONSUMERS query rows of one (batch, head) (grid (m_blocks, heads, batch), causal: longest
// first; 3xTF32 at head dim 128: a cluster pair of CTAs of 64 columns each, SPLIT 2, fwd_sm90_tf32_pair_kernel);
// causal and sliding-window bands (key tiles outside them are never loaded), GQA (K/V head = head / kv_group), dense
// and packed (varlen) sequences, head_dim up to HEAD_DIM (TMA zero-fills the columns past it; only head_dim columns
// are stored), a float32 bias (MODS & MOD_BIAS: mods.cuh's add_bias_f32 on S before the band mask, its rows pulled
// into L1 while the S GEMM runs), ALiBi and an element mask (MOD_ALIBI, MOD_MASK: mods.cuh's alibi_mask_f32 after the
// bias; the mask's bits read while the S GEMM runs, mask_keep_rows; with a BlockMask's map (mods.cuh TileMap) the key
// tiles it marks empty are never loaded and the mask is not read on those it marks full). Soft-capping and dropout
// run on wide.cuh's kernels.
//
// ---- shared memory (float32 elements; each tile starts on the 1024-byte swizzle period) ----------------------------
// [Q: BLOCK_M x HEAD_DIM] [Q big (X3)] [K stages] [K big stages (X3)] [V stages] [V^T stages] [V^T small stages (X3)]
// [SPLIT 2: the exchange slots of S, per parity and consumer] [mbarriers]. Q and K stages receive TMA's float32 and
// then hold the small part (X3) or the rounded value in place.
//
// ---- the barrier protocol ----------------------------------------------------------------------------------
//   q_full                count 1 + tx: the producer's Q load
//   q_ready               count CONSUMER_THREADS: Q split, each consumer warpgroup its own rows (each thread fences
//                         its writes to the async proxy, fence.proxy.async, before it arrives: wgmma reads shared
//                         memory through that proxy; so do the splitters before their arrivals)
//   k_full[s], v_full[s]  count 1 + tx: the producer's K / V loads of the tile in stage s
//   k_ready[s]            count SPLIT_THREADS: K of stage s split
//   k_empty[s]            count CONSUMER_WARPS: the consumers' S GEMM of stage s retired
//   v_empty[s]            count SPLIT_THREADS: the splitters have read V of stage s
//   vt_full[s]            count SPLIT_THREADS: V^T of stage s written
//   vt_empty[s]           count CONSUMER_WARPS: the consumers' P V GEMM of stage s retired
//   xbar[b][wg]           (SPLIT 2) count 4 + tx: consumer wg's warps announce their bytes, the other CTA's st.async
//                         of its S fragments of key tile i (b = i & 1, phase (i >> 1) & 1) complete them
// Key tile i uses stage i % STAGES with phase bit (i / STAGES) & 1 on every barrier of its stage. The producer loads
// K_i after k_empty of tile i - STAGES (which frees K's big part too: the splitters write it only after k_full of
// tile i) and V_i after v_empty of tile i - STAGES; the splitters take the tiles in the consumers' order (K_0, then
// K_{i+1} before V_i), each V_i after vt_empty of tile i - STAGES; the consumers wait k_ready for S_i and vt_full for
// P_{i-1} V_{i-1}. Every wait is for a tile at least STAGES - 1 behind its waiter's, so no cycle forms for
// STAGES >= 2.
#pragma once
#include "fwd_sm90_ws.cuh"
#include "wide.cuh"

namespace cuflash {

// The key (0..7) of an 8-key group whose P column a thread packs at A-fragment position k = p: its own S columns 2t
// (k = t) and 2t + 1 (k = t + 4). V^T holds key tf32_key_of(p) of each group at column p.
__host__ __device__ constexpr int tf32_key_of(int p) { return p < 4 ? 2 * p : 2 * (p - 4) + 1; }
// ... and the column of key `key` (0..7) of a group: the inverse
__host__ __device__ constexpr int tf32_column_of(int key) { return (key & 1) ? 4 + (key >> 1) : key >> 1; }
__host__ __device__ constexpr bool tf32_columns_invert_keys() {
  for (int p = 0; p < 8; ++p)
    if (tf32_column_of(tf32_key_of(p)) != p) return false;
  return true;
}
static_assert(tf32_columns_invert_keys(), "tf32_column_of is the inverse of tf32_key_of");

template <int HEAD_DIM_, int BLOCK_N_, int STAGES_, int CONSUMERS_, bool X3_, bool PINGPONG_ = false, int SPLIT_ = 1,
          bool Q_REGS_ = false>
struct FwdTf32Traits {
  static constexpr int HEAD_DIM = HEAD_DIM_;          // columns of this CTA (of HEAD_DIM * SPLIT)
  static constexpr int SPLIT = SPLIT_;                // CTAs of a cluster sharing the head dim (pair_send)
  static constexpr int BLOCK_N = BLOCK_N_;            // key rows per K/V tile
  static constexpr int STAGES = STAGES_;
  static constexpr int CONSUMERS = CONSUMERS_;        // consumer warpgroups of 64 query rows
  static constexpr bool X3 = X3_;                     // 3xTF32 (precision "fp32"); false: one TF32 pass ("tf32")
  static constexpr bool PINGPONG = PINGPONG_;         // order the two consumers' GEMMs through named barriers
  // Q's big part (3xTF32: the A registers of two of S's three products) or its rounded value (one pass) in registers,
  // read from shared memory once, so those products read only K's part from shared memory per k8 step
  static constexpr bool Q_REGS = Q_REGS_;
  static constexpr int PINGPONG_BAR = 1;              // + consumer: its turn to issue GEMMs (0 is __syncthreads)
  // the consumers split Q before setmaxnreg (pairs) or at their q_ready wait (tf32_split_own_rows)
  static constexpr bool OWN_SPLIT_FIRST = SPLIT > 1;
  static constexpr int BLOCK_M = 64 * CONSUMERS;
  static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
  static constexpr int CONSUMER_WARPS = 4 * CONSUMERS;
  static constexpr int SPLIT_THREADS = 96;            // producer warps 1-3; warp 0's lane 0 issues the TMA loads
  static constexpr int THREADS = 128 + CONSUMER_THREADS;
  // two or three consumers: the register file is shared out by setmaxnreg (as fwd_sm90_fp8); one: 256 threads may
  // each hold 255 registers, no redistribution needed. Three: 128 x 56 + 384 x 152 = 64K
  static constexpr int PRODUCER_REGS = 56;
  static constexpr int CONSUMER_REGS = CONSUMERS == 3 ? 152 : 224;
  static constexpr int N_TILES = BLOCK_N / 8;
  static constexpr int D_TILES = HEAD_DIM / 8;
  static constexpr int QK_K_STEPS = HEAD_DIM / 8;     // k8 steps of S = Q K^T
  // ... whose Q comes from registers (Q_REGS): all, but the first 32 columns of one pass at head dim 128 (with 64 or
  // all 128 the consumers spilled)
  static constexpr int Q_REG_STEPS = !Q_REGS ? 0 : (X3 || HEAD_DIM <= 64) ? QK_K_STEPS : 4;
  static constexpr int PV_K_STEPS = BLOCK_N / 8;      // k8 steps of O_tile = P V
  static constexpr int CHAIN_STEPS = 8;               // k8 steps summed in one accumulator chain (k 64)
  static constexpr int S_CHAINS = (QK_K_STEPS + CHAIN_STEPS - 1) / CHAIN_STEPS;

  // float32 tiles as 16-bit SmemTiles of twice the columns: the same bytes, swizzle and descriptors
  using TileQ = SmemTile<BLOCK_M, 2 * HEAD_DIM>;
  using TileKV = SmemTile<BLOCK_N, 2 * HEAD_DIM>;
  using TileVt = SmemTile<HEAD_DIM, 2 * BLOCK_N>;
  static constexpr int BOX_COLS = 32;                 // TMA box width in floats: one 128-byte panel
  static constexpr int PANELS = HEAD_DIM / BOX_COLS;
  static constexpr int PARTS = X3 ? 2 : 1;            // big and small, or the rounded value alone
  static constexpr int SMEM_Q = TileQ::BYTES;
  static constexpr int SMEM_KV = TileKV::BYTES;
  // a pair's exchange of S (SPLIT 2): per parity and consumer, N_TILES float4 per consumer thread
  static constexpr int XCHG_SLOT = SPLIT > 1 ? N_TILES * 128 * 16 : 0;
  static constexpr int BARRIERS = 2 + 7 * STAGES + (SPLIT > 1 ? 2 * CONSUMERS : 0);
  static constexpr int OFF_Q = 0;                                      // small (X3) or rounded
  static constexpr int OFF_QB = OFF_Q + SMEM_Q;                        // big (X3)
  static constexpr int OFF_K = OFF_Q + PARTS * SMEM_Q;                 // small (X3) or rounded
  static constexpr int OFF_KB = OFF_K + STAGES * SMEM_KV;              // big (X3)
  static constexpr int OFF_V = OFF_K + PARTS * STAGES * SMEM_KV;       // float32 from TMA
  static constexpr int OFF_VT = OFF_V + STAGES * SMEM_KV;              // big (X3) or rounded
  static constexpr int OFF_VTS = OFF_VT + STAGES * SMEM_KV;            // small (X3)
  static constexpr int OFF_XCHG = OFF_VT + PARTS * STAGES * SMEM_KV;
  static constexpr int OFF_BAR = OFF_XCHG + 2 * CONSUMERS * XCHG_SLOT;
  static constexpr int SMEM_BYTES = OFF_BAR + 8 * BARRIERS + 1024;     // cuflash/config.py FwdSm90Tf32Config.smem_bytes

  static_assert(HEAD_DIM == 32 || HEAD_DIM == 64 || HEAD_DIM == 128, "TF32 head dims: 32, 64, 128");
  static_assert(SPLIT == 1 || (SPLIT == 2 && HEAD_DIM == 64), "head dim 128 as a pair of CTAs of 64 columns");
  static_assert(BLOCK_N == 16 || BLOCK_N == 32 || BLOCK_N == 64, "key tiles of 16-64 rows (one chain of P V)");
  static_assert((QK_K_STEPS < CHAIN_STEPS || QK_K_STEPS % CHAIN_STEPS == 0) && S_CHAINS <= 2,
                "S in at most two chains of k 64");
  static_assert(CONSUMERS >= 1 && CONSUMERS <= 3, "one to three consumer warpgroups");
  static_assert(CONSUMERS < 3 || SPLIT == 1, "three consumers: one CTA per query block");
  static_assert(!PINGPONG || CONSUMERS == 2, "pingpong orders two consumers");
  static_assert(!Q_REGS || !X3 || (HEAD_DIM == 64 && CONSUMERS == 2), "Q's big part in registers: 64 columns");
  static_assert(TileVt::BYTES == SMEM_KV && TileKV::PANEL_BYTES == 4 * BOX_COLS, "V^T is V's bytes; boxes are panels");
  static_assert(SMEM_Q % 1024 == 0 && SMEM_KV % 1024 == 0, "tiles start on the 1024-byte swizzle period");
  static_assert(STAGES >= 2 && STAGES <= 4, "K/V circular buffers of 2-4 stages");
  static_assert(CONSUMERS == 1 ||  // (setmaxnreg.inc waits for registers within the launch's; beyond, forever)
                    128 * PRODUCER_REGS + CONSUMER_THREADS * CONSUMER_REGS <= 65536 / THREADS / 8 * 8 * THREADS,
                "setmaxnreg exceeds the CTA's registers");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

template <class Tr>
struct Tf32Smem {
  u32 base;
  __device__ __forceinline__ u32 q() const { return base + Tr::OFF_Q; }
  __device__ __forceinline__ u32 q_big() const { return base + Tr::OFF_QB; }
  __device__ __forceinline__ u32 k(int s) const { return base + Tr::OFF_K + s * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 k_big(int s) const { return base + Tr::OFF_KB + s * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 v(int s) const { return base + Tr::OFF_V + s * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 vt(int s) const { return base + Tr::OFF_VT + s * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 vt_small(int s) const { return base + Tr::OFF_VTS + s * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 bar(int i) const { return base + Tr::OFF_BAR + 8 * i; }
  __device__ __forceinline__ u32 q_full() const { return bar(0); }
  __device__ __forceinline__ u32 q_ready() const { return bar(1); }
  __device__ __forceinline__ u32 k_full(int s) const { return bar(2 + s); }
  __device__ __forceinline__ u32 k_ready(int s) const { return bar(2 + Tr::STAGES + s); }
  __device__ __forceinline__ u32 k_empty(int s) const { return bar(2 + 2 * Tr::STAGES + s); }
  __device__ __forceinline__ u32 v_full(int s) const { return bar(2 + 3 * Tr::STAGES + s); }
  __device__ __forceinline__ u32 v_empty(int s) const { return bar(2 + 4 * Tr::STAGES + s); }
  __device__ __forceinline__ u32 vt_full(int s) const { return bar(2 + 5 * Tr::STAGES + s); }
  __device__ __forceinline__ u32 vt_empty(int s) const { return bar(2 + 6 * Tr::STAGES + s); }
  // the pair's exchange slot and barrier of parity b, consumer wg
  __device__ __forceinline__ u32 xchg(int b, int wg) const {
    return base + Tr::OFF_XCHG + (b * Tr::CONSUMERS + wg) * Tr::XCHG_SLOT;
  }
  __device__ __forceinline__ u32 xbar(int b, int wg) const { return bar(2 + 7 * Tr::STAGES + b * Tr::CONSUMERS + wg); }
};

__device__ __forceinline__ float4 ld_shared_f32x4(u32 addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_u32x4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// ==== head dim 128 in 3xTF32: a pair of CTAs, 64 columns each ================================================
//
// A kernel with SPLIT 2 (the forward here, the backward's two kernels in bwd_sm90_tf32.cuh) runs each block of rows
// or keys as a cluster of two CTAs (__cluster_dims__(2, 1, 1), blockIdx.x / 2 the block): CTA r loads and splits
// columns 64 r .. 64 r + 63 of every operand and writes those columns of its outputs; rank 0 writes what both hold
// whole (lse, dBias) and adds a bias, to its partial S before the exchange. A product over the head dim (S, dP) is
// then a partial sum in each CTA: each sends its fragment into the other's exchange slot (st.async, one float4 per
// n8 tile, thread for thread: the other CTA's thread of the same index holds the same elements; each store completes
// its bytes on the slot's mbarrier there), waits on its own slot's barrier (each warp's lane 0 announces the warp's
// bytes) and adds: own + peer, the same bits in both CTAs (addition commutes), and the sum of two chains of k 64 that
// the one-CTA kernels take at head dim 128, so the softmax and everything after it agree in both. Slots and barriers
// alternate by step parity: a CTA writes step i's slot of the other only after receiving the other's step i - 1,
// which the other sent after its loads from the slot of step i - 2 had returned (their values feed the products it
// sends).
template <int N_TILES>
__device__ __forceinline__ void pair_send(u32 slot, u32 bar, const float (&acc)[N_TILES][4], int wtid) {
  const u32 peer = cluster_ctarank() ^ 1u;
  const u32 dst = map_shared_rank(slot + 16 * wtid, peer), peer_bar = map_shared_rank(bar, peer);
#pragma unroll
  for (int nt = 0; nt < N_TILES; ++nt)
    st_async_f32x4(dst + nt * 128 * 16, acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3], peer_bar);
}
// ... the wait for the other's fragment (phase parity `parity` of bar, whose count is the 4 warps) ...
template <int N_TILES>
__device__ __forceinline__ void pair_wait(u32 bar, u32 parity, int wtid) {
  if ((wtid & 31) == 0) mbarrier_arrive_expect_tx(bar, 32 * N_TILES * 16);
  while (!mbarrier_try_wait_parity_once(bar, parity)) {
  }
}
// ... its n8 tile nt ...
__device__ __forceinline__ float4 pair_tile(u32 slot, int nt, int wtid) {
  return ld_shared_f32x4(slot + 16 * wtid + nt * 128 * 16);
}
// ... or all of it
template <int N_TILES>
__device__ __forceinline__ void pair_receive(u32 slot, u32 bar, u32 parity, float (&peer)[N_TILES][4], int wtid) {
  pair_wait<N_TILES>(bar, parity, wtid);
#pragma unroll
  for (int nt = 0; nt < N_TILES; ++nt) {
    const float4 v = pair_tile(slot, nt, wtid);
    peer[nt][0] = v.x;
    peer[nt][1] = v.y;
    peer[nt][2] = v.z;
    peer[nt][3] = v.w;
  }
}

// x as TF32 (X3: big and small, Tf32x3::split; else rounded)
template <bool X3>
__device__ __forceinline__ void tf32_parts(float x, u32& big, u32& small) {
  if constexpr (X3) {
    Tf32x3::split(x, big, small);
  } else {
    big = round_tf32(x);
    small = 0;
  }
}

// A float32 tile split in place, by the splitters (tid 0..SPLIT_THREADS-1), chunk by chunk (tf32_split_chunk): each
// 16-byte chunk of `tile` becomes its small part (X3; big to the same offset of `big`) or its rounded value. Both
// tiles have one layout, so a chunk keeps its offset and the swizzle does not matter; 8 consecutive chunks per phase:
// no bank conflict. (Loading 4 chunks before storing any, against the program order the volatile shared accesses
// keep, was slower on an H100: 3xTF32 at head dim 64 66 against 73 TFLOP/s, one-pass TF32 at head dim 128 111
// against 128.)
template <bool X3>
__device__ __forceinline__ void tf32_split_chunk(u32 tile, u32 big, u32 off) {
  const float4 x = ld_shared_f32x4(tile + off);
  u32 b0, b1, b2, b3, s0, s1, s2, s3;
  tf32_parts<X3>(x.x, b0, s0);
  tf32_parts<X3>(x.y, b1, s1);
  tf32_parts<X3>(x.z, b2, s2);
  tf32_parts<X3>(x.w, b3, s3);
  if constexpr (X3) {
    st_shared_u32x4(big + off, b0, b1, b2, b3);
    st_shared_u32x4(tile + off, s0, s1, s2, s3);
  } else {
    st_shared_u32x4(tile + off, b0, b1, b2, b3);
  }
}
template <class Tr, int BYTES>
__device__ __forceinline__ void tf32_split_tile(u32 tile, u32 big, int tid) {
  for (int c = tid; c < BYTES / 16; c += Tr::SPLIT_THREADS) tf32_split_chunk<Tr::X3>(tile, big, 16 * c);
}

// A consumer warpgroup's own 64 rows (64 wg .., wg = (threadIdx.x - 128) / 128) of TILES operand tiles of ROWS rows
// and COLS floats each (SmemTile<ROWS, 2 COLS>: COLS / 32 panels of ROWS x 128 bytes, as TMA wrote them), split in
// place, big beside (X3), or rounded, once the load's barrier `full` (phase 0) completes; each of the warpgroup's 128
// threads fences its writes to the async proxy and arrives on `ready` (count CONSUMER_THREADS). The operands a CTA
// loads once (the forward's Q, the dQ kernel's Q and dO, the dK / dV kernel's K and V) are so prepared by the
// consumers that read them, while the splitters already take the first key tile (or query step): by the splitters
// they came first on their path, at 128 rows and 64 columns 21 chunks of a tile per splitter thread before the
// consumers' first GEMM could start, here 8 per consumer thread. Called where the consumer waits for `ready`, or, where
// the traits say OWN_SPLIT_FIRST, in the consumers' branch before setmaxnreg: the two places compute the same, and
// each left some kernels with 4-20 bytes of spills in their main loop (ptxas's allocation, under NVRTC 13.5), so each
// kernel family takes the place where every instantiation the library builds is spill-free.
template <int ROWS, int COLS, bool X3, int TILES = 1>
__device__ __forceinline__ void tf32_split_own_rows(u32 full, u32 ready, u32 tile, u32 big, u32 tile2 = 0,
                                                    u32 big2 = 0) {
  constexpr int PANEL_BYTES = ROWS * 128, CHUNKS = 64 * 128 / 16;  // a panel's chunks of 64 rows
  static_assert(COLS % 32 == 0 && ROWS % 64 == 0 && (TILES == 1 || TILES == 2),
                "one or two tiles, panels of 32 floats, warpgroups of 64 rows");
  const int wg = (threadIdx.x - 128) / 128, wtid = threadIdx.x & 127;
  mbarrier_wait_or_trap(full, 0);
#pragma unroll 1
  for (int x = 0; x < TILES; ++x)
#pragma unroll 1
    for (int panel = 0; panel < COLS / 32; ++panel)
#pragma unroll
      for (int c = wtid; c < CHUNKS; c += 128)
        tf32_split_chunk<X3>(x ? tile2 : tile, x ? big2 : big, panel * PANEL_BYTES + wg * 64 * 128 + 16 * c);
  fence_proxy_async_shared();  // generic writes before wgmma's (async proxy) reads
  mbarrier_arrive(ready);
}

// V (BLOCK_N keys x HEAD_DIM floats, from TMA) -> V^T (HEAD_DIM rows x BLOCK_N keys, keys permuted within 8-key
// groups by tf32_column_of), big (X3) and small, by the splitters. A unit is 32 (key, 16-byte chunk) pairs of V: KEYS
// = min(32, BLOCK_N) consecutive keys of 32 / KEYS consecutive chunks (4 columns each). Lane l reads its pair's
// chunk (8 lanes of a phase: 8 consecutive rows of one chunk, 8 distinct swizzled chunks) and writes its 4 values to
// 4 V^T rows at its key's column. A warp store is 32 distinct columns of one 128-byte row (32 banks); with 16-key
// tiles (64-byte V^T rows, two to a 128-byte line) it is 16 columns of two rows 4 apart, which have one parity and
// so share one half of the banks: 2 wavefronts (ncu counts them, docs/PERFORMANCE.md; a row order without them
// measured no faster, the kernel being latency-bound).
template <class Tr>
__device__ __forceinline__ void tf32_transpose_v(u32 v, u32 vt, u32 vt_small, int warp, int lane) {
  constexpr int KEYS = Tr::BLOCK_N < 32 ? Tr::BLOCK_N : 32, CHUNKS_PER_UNIT = 32 / KEYS;
  constexpr int KEY_UNITS = Tr::BLOCK_N / KEYS, UNITS = KEY_UNITS * (Tr::HEAD_DIM / 4) / CHUNKS_PER_UNIT;
  constexpr int WARPS = Tr::SPLIT_THREADS / 32;
  static_assert(KEYS == 16 || KEYS == 32, "16 or 32 keys per unit");
  for (int u = warp; u < UNITS; u += WARPS) {
    const int key = KEYS * (u % KEY_UNITS) + lane % KEYS, chunk = CHUNKS_PER_UNIT * (u / KEY_UNITS) + lane / KEYS;
    const float4 x = ld_shared_f32x4(v + Tr::TileKV::offset(key, 8 * chunk));
    const int col = (key & ~7) + tf32_column_of(key & 7);
    const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      u32 big, small;
      tf32_parts<Tr::X3>(xs[j], big, small);
      const u32 off = Tr::TileVt::offset(4 * chunk + j, 2 * col);
      st_shared_s32(vt + off, static_cast<int>(big));
      if constexpr (Tr::X3) st_shared_s32(vt_small + off, static_cast<int>(small));
    }
  }
}

// The TMA thread: Q, then K and V of the n_tiles visible key tiles from n_end - 1 down (K_0, then K_{i+1} before
// V_i; the tiles a BlockMask's map empties are skipped: TileMap::next_down_rolled).
template <class Tr>
__device__ __forceinline__ void fwd_tf32_producer(const FwdWsParams& p, const Tf32Smem<Tr>& sm, const Seq& seq,
                                                  int row0, int head, int batch, const TileMap& tiles, int n_begin,
                                                  int n_end, int n_tiles, int col0) {
  const int kv_head = head / p.fwd.seq.kv_group;
  const int q_batch = p.fwd.seq.cu_seqlens_q != nullptr ? 0 : batch;
  const int kv_batch = p.fwd.seq.cu_seqlens_k != nullptr ? 0 : batch;
  constexpr int BOX_BYTES = 4 * Tr::BOX_COLS;
  mbarrier_arrive_expect_tx(sm.q_full(), Tr::SMEM_Q);
#pragma unroll
  for (int panel = 0; panel < Tr::PANELS; ++panel)
    cp_async_bulk_tensor_4d_global_to_shared(sm.q() + panel * Tr::BLOCK_M * BOX_BYTES, &p.tma_q, sm.q_full(),
                                             col0 + panel * Tr::BOX_COLS, seq.q_row0 + row0, head, q_batch);
  auto load = [&](int i, int n_block, u32 empty, u32 full, u32 dst, const TmaDesc* map) {
    mbarrier_wait_or_trap(empty, ((i / Tr::STAGES) & 1) ^ 1);
    mbarrier_arrive_expect_tx(full, Tr::SMEM_KV);
#pragma unroll
    for (int panel = 0; panel < Tr::PANELS; ++panel)
      cp_async_bulk_tensor_4d_global_to_shared(dst + panel * Tr::BLOCK_N * BOX_BYTES, map, full,
                                               col0 + panel * Tr::BOX_COLS, seq.k_row0 + n_block * Tr::BLOCK_N,
                                               kv_head, kv_batch);
  };
  auto load_k = [&](int i, int n_block) {
    const int s = i % Tr::STAGES;
    load(i, n_block, sm.k_empty(s), sm.k_full(s), sm.k(s), &p.tma_k);
  };
  int n_k = tiles.next_down_rolled(n_end - 1, n_begin), n_v = n_k;  // the key tiles of the next K and V loads
  load_k(0, n_k);
  for (int i = 0; i < n_tiles; ++i) {
    if (i + 1 < n_tiles) {
      n_k = tiles.next_down_rolled(n_k - 1, n_begin);
      load_k(i + 1, n_k);
    }
    const int s = i % Tr::STAGES;
    load(i, n_v, sm.v_empty(s), sm.v_full(s), sm.v(s), &p.tma_v);
    n_v = tiles.next_down_rolled(n_v - 1, n_begin);
  }
}

// The splitters (producer warps 1-3): K_0, then for every tile K_{i+1} and V_i -> V^T_i (the consumers split Q:
// tf32_split_own_rows).
template <class Tr>
__device__ __forceinline__ void fwd_tf32_splitter(const Tf32Smem<Tr>& sm, int n_tiles, int tid) {
  const int warp = tid / 32, lane = tid & 31;
  auto split_k = [&](int i) {
    const int s = i % Tr::STAGES;
    mbarrier_wait_or_trap(sm.k_full(s), (i / Tr::STAGES) & 1);
    tf32_split_tile<Tr, Tr::SMEM_KV>(sm.k(s), sm.k_big(s), tid);
    fence_proxy_async_shared();  // generic writes before the consumers' wgmma (async proxy) reads
    mbarrier_arrive(sm.k_ready(s));
  };
  split_k(0);
  for (int i = 0; i < n_tiles; ++i) {
    if (i + 1 < n_tiles) split_k(i + 1);
    const int s = i % Tr::STAGES;
    const u32 phase = (i / Tr::STAGES) & 1;
    mbarrier_wait_or_trap(sm.v_full(s), phase);
    mbarrier_wait_or_trap(sm.vt_empty(s), phase ^ 1);
    tf32_transpose_v<Tr>(sm.v(s), sm.vt(s), sm.vt_small(s), warp, lane);
    fence_proxy_async_shared();
    mbarrier_arrive(sm.v_empty(s));
    mbarrier_arrive(sm.vt_full(s));
  }
}

// A's registers of k8 steps 0 .. K_STEPS - 1 (columns 8 kk ..) from a K-major Tile of TF32 values, a warp's 16 rows
// from row0: a0 (row g, k t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4), as wgmma takes A from registers
template <class Tile, int K_STEPS>
__device__ __forceinline__ void tf32_load_a(u32 (&a)[K_STEPS][4], u32 tile, int row0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < K_STEPS; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      a[kk][r] = static_cast<u32>(
          ld_shared_s32(tile + Tile::offset(row0 + g + 8 * (r & 1), 2 * (8 * kk + t + 4 * (r >> 1)))));
}

// One k8 step of 3xTF32 wgmma, acc (+)= a b^T, with A's small part from shared memory and its big part from registers
// (tf32_load_a): the products of tf32_ss (bwd_sm90_tf32.cuh) in the same order, the small terms first, so the same
// sums, with two of the three reading only B from shared memory
template <int N, int NT>
__device__ __forceinline__ void tf32x3_sr(float (&acc)[NT][4], u64 a_small, const u32 (&a_big)[4], u64 b_small,
                                          u64 b_big, int more) {
  using W = Wgmma<N, tf32>;
  W::ss(acc, a_small, b_big, more);
  W::rs(acc, a_big, b_small, 1);
  W::rs(acc, a_big, b_big, 1);
}

// P (fp32 S accumulators) -> TF32 A registers of O_tile = P V: k8 step kk is n8 tile kk, a thread's column 2t its
// k = t, 2t + 1 its k = t + 4 (tf32_key_of). X3: big and small parts.
template <bool X3, int N_TILES>
__device__ __forceinline__ void tf32_probs_to_regs(const float (&s)[1][N_TILES][4], u32 (&big)[N_TILES][4],
                                                   u32 (&small)[X3 ? N_TILES : 1][4]) {
#pragma unroll
  for (int kk = 0; kk < N_TILES; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      // a0 (row g, k t) = c0, a1 (g + 8, t) = c2, a2 (g, t + 4) = c1, a3 (g + 8, t + 4) = c3
      const int c = (r == 1) ? 2 : (r == 2) ? 1 : r;
      u32 b, sm;
      tf32_parts<X3>(s[0][kk][c], b, sm);
      big[kk][r] = b;
      if constexpr (X3) small[kk][r] = sm;
    }
  }
}

// Consumer warpgroup wg: query rows row0 + 64 wg .. + 63.
template <class Tr, bool IS_CAUSAL, int MODS>
__device__ __forceinline__ void fwd_tf32_consumer(const FwdWsParams& p, const Tf32Smem<Tr>& sm,
                                                  const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band, int row0,
                                                  int out_row0, int rows_q, int head, int batch,
                                                  const TileMap& tiles, int n_begin, int n_end, int n_tiles) {
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  using Mods = ScoreMods<MODS>;
  const int ctid = threadIdx.x - 128;
  const int wg = ctid / 128, lane = ctid & 31, warp = ctid / 32;
  const int warp_row = row0 + warp * 16, wg_row = row0 + wg * 64;
  const float scale_log2 = p.fwd.scale_log2;
  constexpr bool PAIR = Tr::SPLIT > 1;  // rank(): columns 64 rank .. of the pair's head dim
  auto rank = [] { return PAIR ? static_cast<int>(cluster_ctarank()) : 0; };
  // the bias: read after the tile's S GEMM retires, from L1, where prefetch_rows pulled it while the GEMM ran; the
  // mask: its bits (kept) read while the GEMM runs (a pair: rank 0 applies both), on the tiles a BlockMask's map
  // does not mark full
  Mods mods;
  if (Mods::CHANGES_SCORES)
    mods.template init<true>(p.fwd.mods, batch, head, p.fwd.heads, row0 + rows_q, band.seqlen_k);
  u32 kept = ~0u;
  auto prefetch_mods = [&](int n_block) {
    if (Mods::HAS_BIAS && rank() == 0)
      mods.template prefetch_rows<Tr::BLOCK_N, false>(warp_row, n_block * Tr::BLOCK_N, lane);
    if (Mods::HAS_MASK && rank() == 0) {
      // (MOD_MASK serves calls with ALiBi alone too: no mask, nothing read)
      mods.check_mask = p.fwd.mods.mask.ptr != nullptr && tiles.state(n_block) != TILE_FULL;
      kept = mask_keep_rows<MODS, Tr::N_TILES>(warp_row, n_block * Tr::BLOCK_N, mods, lane);
    }
  };

  float o_acc[1][Tr::D_TILES][4];
#pragma unroll
  for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) o_acc[0][dt][c] = 0.f;
  float o_tile[1][Tr::D_TILES][4];  // one key tile's P V: a chain of k BLOCK_N <= 64
  OnlineSoftmax<1, Tr::N_TILES, Tr::D_TILES> softmax;
  softmax.init();
  float s_acc[1][Tr::N_TILES][4];
  float s2_acc[1][Tr::N_TILES][4];  // the second chain of S (k 64..127; unused, and dropped, at head dim 64)
  u32 p_big[Tr::PV_K_STEPS][4];
  u32 p_small[Tr::X3 ? Tr::PV_K_STEPS : 1][4];
  float alpha[2];

  using WS = Wgmma<Tr::BLOCK_N, tf32>;
  using WO = Wgmma<Tr::HEAD_DIM, tf32>;
  u32 q_regs[Tr::Q_REGS ? Tr::Q_REG_STEPS : 1][4];  // Q_REGS: this warp's 16 rows of Q's big part or rounded Q
  // one k8 step of S into acc (scale_d = more: 0 starts a chain)
  auto mma_s = [&](float (&acc)[Tr::N_TILES][4], u32 q, u32 k_small, u32 k_big, int kk, int more) {
    const u64 qd = Tr::TileQ::desc_k_major(q, 64 * wg, 16 * kk), kd = Tr::TileKV::desc_k_major(k_small, 0, 16 * kk);
    if constexpr (Tr::Q_REGS && Tr::X3) {
      tf32x3_sr<Tr::BLOCK_N>(acc, qd, q_regs[Tr::Q_REGS ? kk : 0], kd, Tr::TileKV::desc_k_major(k_big, 0, 16 * kk),
                             more);
    } else if constexpr (Tr::Q_REGS) {
      if (kk < Tr::Q_REG_STEPS)  // (kk is a constant of the unrolled loop)
        WS::rs(acc, q_regs[kk < Tr::Q_REG_STEPS ? kk : 0], kd, more);
      else
        WS::ss(acc, qd, kd, more);
    } else if constexpr (Tr::X3) {
      const u64 qbd = Tr::TileQ::desc_k_major(q + (Tr::OFF_QB - Tr::OFF_Q), 64 * wg, 16 * kk);
      const u64 kbd = Tr::TileKV::desc_k_major(k_big, 0, 16 * kk);
      // the small terms first, as Tf32x3::mma, so they are not lost against the big product's rounding
      WS::ss(acc, qd, kbd, more);
      WS::ss(acc, qbd, kd, 1);
      WS::ss(acc, qbd, kbd, 1);
    } else {
      WS::ss(acc, qd, kd, more);
    }
  };
  auto issue_s = [&](int stage) {
    const u32 k_small = sm.k(stage), k_big = sm.k_big(stage);
    // Q's descriptors from an address the optimizer cannot see through: else it keeps all of them (2 per k step
    // and part, loop invariants) in registers across the key loop, which spilled the head-dim-128 consumers
    const u32 q = static_cast<u32>(opaque(static_cast<int>(sm.q())));
#pragma unroll
    for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk) {
      if (kk < Tr::CHAIN_STEPS)
        mma_s(s_acc[0], q, k_small, k_big, kk, kk > 0);
      else
        mma_s(s2_acc[0], q, k_small, k_big, kk, kk > Tr::CHAIN_STEPS);
    }
    wgmma_commit_group();
  };
  auto issue_pv = [&](int stage) {
    const u32 vt = sm.vt(stage), vt_small = sm.vt_small(stage);
#pragma unroll
    for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) {
      const u64 vd = Tr::TileVt::desc_k_major(vt, 0, 16 * kk);
      if constexpr (Tr::X3) {
        WO::rs(o_tile[0], p_small[Tr::X3 ? kk : 0], vd, kk > 0);
        WO::rs(o_tile[0], p_big[kk], Tr::TileVt::desc_k_major(vt_small, 0, 16 * kk), 1);
        WO::rs(o_tile[0], p_big[kk], vd, 1);
      } else {
        WO::rs(o_tile[0], p_big[kk], vd, kk > 0);
      }
    }
    wgmma_commit_group();
  };
  auto release = [&](u32 bar) {
    if (lane == 0) mbarrier_arrive(bar);
  };
  // the bias, ALiBi and the mask on S of the tile at key0 (a pair: rank 0, on its part before the exchange, so the
  // sum is (S0 + bias - ALiBi, or -inf) + S1)
  auto apply_mods = [&](int key0) {
    if (Mods::HAS_BIAS) add_bias_f32(mods, s_acc[0], warp_row, key0, lane);
    alibi_mask_f32(mods, s_acc[0], warp_row, key0, band.diag, kept, lane);
  };
  auto scores_to_probs = [&](int n_block) {
    if constexpr (Tr::S_CHAINS > 1) {
#pragma unroll
      for (int nt = 0; nt < Tr::N_TILES; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) s_acc[0][nt][c] += s2_acc[0][nt][c];
    }
    const int key0 = n_block * Tr::BLOCK_N;
    if (!PAIR) apply_mods(key0);  // before the band's -inf
    if (band.needs_mask_right(wg_row, key0 + Tr::BLOCK_N - 1) || band.needs_mask_left(wg_row + 63, key0))
      apply_band_mask<IS_CAUSAL, HAS_WINDOW>(s_acc, warp_row, key0, band, lane);
    softmax_probs(softmax, s_acc, scale_log2, alpha);  // fwd_sm90_ws.cuh's: O's rescale waits for P V
  };
  auto fence_s = [&]() {
    wgmma_fence_operand(s_acc[0]);
    if constexpr (Tr::S_CHAINS > 1) wgmma_fence_operand(s2_acc[0]);
  };
  // a pair: S of key tile i over the other CTA's 64 columns, added (slots by the tile's parity); the bias, ALiBi and
  // the mask once per pair, by rank 0 to its part before the exchange: (S0 + bias - ALiBi, or -inf) + S1
  auto exchange_s = [&](int i, int n_block) {
    if constexpr (PAIR) {
      if (rank() == 0) apply_mods(n_block * Tr::BLOCK_N);
      const int wtid = ctid & 127;
      pair_send(sm.xchg(i & 1, wg), sm.xbar(i & 1, wg), s_acc[0], wtid);
      pair_wait<Tr::N_TILES>(sm.xbar(i & 1, wg), (i >> 1) & 1, wtid);
#pragma unroll
      for (int nt = 0; nt < Tr::N_TILES; ++nt) {
        const float4 v = pair_tile(sm.xchg(i & 1, wg), nt, wtid);
        s_acc[0][nt][0] += v.x;
        s_acc[0][nt][1] += v.y;
        s_acc[0][nt][2] += v.z;
        s_acc[0][nt][3] += v.w;
      }
    }
  };

  // pingpong (fwd_sm90_fp8.cuh): consumer 0 issues first; each consumer runs n_tiles + 1 rounds of GEMMs and passes
  // the token after each but its last (consumer 1's last passes nothing)
  auto round_begin = [&]() {
    if (Tr::PINGPONG) named_barrier_sync(Tr::PINGPONG_BAR + wg, Tr::CONSUMER_THREADS);
  };
  auto round_end = [&](bool is_last) {
    if (Tr::PINGPONG && !(is_last && wg == 1)) named_barrier_arrive(Tr::PINGPONG_BAR + 1 - wg, Tr::CONSUMER_THREADS);
  };
  if (Tr::PINGPONG && wg == 1) named_barrier_arrive(Tr::PINGPONG_BAR, Tr::CONSUMER_THREADS);

  if constexpr (!Tr::OWN_SPLIT_FIRST)  // this warpgroup's rows of Q
    tf32_split_own_rows<Tr::BLOCK_M, Tr::HEAD_DIM, Tr::X3>(sm.q_full(), sm.q_ready(), sm.q(), sm.q_big());
  mbarrier_wait_or_trap(sm.q_ready(), 0);
  if constexpr (Tr::Q_REGS) tf32_load_a<typename Tr::TileQ>(q_regs, Tr::X3 ? sm.q_big() : sm.q(), 16 * warp, lane);
  int stage = 0, n_block = tiles.next_down_rolled(n_end - 1, n_begin);  // the visible key tiles, from the last down
  u32 phase = 0;
  round_begin();
  mbarrier_wait_or_trap(sm.k_ready(stage), phase);
  wgmma_fence();
  issue_s(stage);
  round_end(/*is_last=*/false);
  prefetch_mods(n_block);
  wgmma_wait_group<0>();
  fence_s();
  release(sm.k_empty(stage));
  exchange_s(0, n_block);
  scores_to_probs(n_block);
  tf32_probs_to_regs<Tr::X3>(s_acc, p_big, p_small);
  int v_stage = stage;
  u32 v_phase = phase;
  if (++stage == Tr::STAGES) {
    stage = 0;
    phase ^= 1;
  }
  for (int i = 1; i < n_tiles; ++i) {
    n_block = tiles.next_down_rolled(n_block - 1, n_begin);
    round_begin();
    mbarrier_try_wait_parity(sm.k_ready(stage), phase);
    wgmma_fence();
    issue_s(stage);
    mbarrier_try_wait_parity(sm.vt_full(v_stage), v_phase);
    issue_pv(v_stage);
    round_end(/*is_last=*/false);
    prefetch_mods(n_block);

    wgmma_wait_group<1>();  // S_i
    fence_s();
    release(sm.k_empty(stage));
    exchange_s(i, n_block);
    scores_to_probs(n_block);

    // 3xTF32: the softmax above runs under P_{i-1} V_{i-1} (the wait in a basic block of its own, ptx.cuh), 1.00-1.02x
    // the forward's speed on an H200; one pass was 0.96-0.99x that way, the 16-bit kernels within noise
    if (Tr::X3) end_basic_block(p.fwd.heads);
    wgmma_wait_group<0>();  // P_{i-1} V_{i-1}
    wgmma_fence_operand(o_tile[0]);
    release(sm.vt_empty(v_stage));
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
      for (int c = 0; c < 4; ++c) o_acc[0][dt][c] = (o_acc[0][dt][c] + o_tile[0][dt][c]) * alpha[c >> 1];
    tf32_probs_to_regs<Tr::X3>(s_acc, p_big, p_small);
    v_stage = stage;
    v_phase = phase;
    if (++stage == Tr::STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
  round_begin();
  mbarrier_try_wait_parity(sm.vt_full(v_stage), v_phase);
  wgmma_fence();
  issue_pv(v_stage);
  round_end(/*is_last=*/true);
  wgmma_wait_group<0>();
  wgmma_fence_operand(o_tile[0]);
  release(sm.vt_empty(v_stage));
#pragma unroll
  for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) o_acc[0][dt][c] += o_tile[0][dt][c];

  // epilogue: O / l and lse, straight from registers to global memory (8-byte stores of column pairs; columns past
  // head_dim and rows past rows_q, e.g. the next packed sequence's, not stored)
  float lse[1][2];
  softmax.finalize(o_acc, lse);
  const int g = lane >> 2, t = lane & 3;
  const int col0 = rank() * Tr::HEAD_DIM;
  float* o_gmem = reinterpret_cast<float*>(p.fwd.o) + batch * p.fwd.o_batch_stride +
                  static_cast<long long>(out_row0) * p.fwd.o_row_stride + head * p.fwd.o_head_stride + col0;
  float* lse_gmem = p.fwd.lse + batch * p.fwd.lse_batch_stride + head * p.fwd.lse_head_stride + out_row0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp * 16 + g + 8 * h;
    if (row >= rows_q) continue;
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt)
      if (col0 + dt * 8 < p.fwd.head_dim)  // head_dim is a multiple of 8 (cuflash's rule for every head dim)
        *reinterpret_cast<float2*>(o_gmem + row * p.fwd.o_row_stride + dt * 8 + 2 * t) =
            make_float2(o_acc[0][dt][2 * h], o_acc[0][dt][2 * h + 1]);
    if (t == 0 && p.fwd.lse != nullptr && col0 == 0) lse_gmem[row] = lse[0][h];  // (a pair: rank 0)
  }
}

// The kernel's body: fwd_sm90_tf32_kernel (one CTA per query block), fwd_sm90_tf32_pair_kernel (SPLIT 2: a cluster of
// two per query block, blockIdx.x / 2 its index)
template <class Tr, bool IS_CAUSAL, int MODS>
__device__ __forceinline__ void fwd_tf32_main(const FwdWsParams& p) {
  static_assert((MODS & ~(MOD_WINDOW | MOD_BIAS | MOD_ALIBI | MOD_MASK)) == 0,
                "fwd_sm90_tf32_kernel takes a window, a bias, ALiBi and a mask");
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const AlignedSmem aligned = align_smem_1024(smem_raw);
  const Tf32Smem<Tr> sm{aligned.base};
  if (dynamic_smem_size() < Tr::SMEM_BYTES) __trap();

  const int m_block = IS_CAUSAL ? (gridDim.x / Tr::SPLIT - 1 - blockIdx.x / Tr::SPLIT)
                                : blockIdx.x / Tr::SPLIT;  // causal: longest first
  const int head = blockIdx.y, batch = blockIdx.z;
  const Seq seq = sequence(p.fwd.seq, batch);
  const int row0 = m_block * Tr::BLOCK_M;
  if (row0 >= seq.len_q) return;  // varlen: past this sequence's end
  const int rows_q = min(Tr::BLOCK_M, seq.len_q - row0);
  const int out_row0 = seq.q_row0 + row0;
  const Band<IS_CAUSAL, HAS_WINDOW> band{seq.len_k, seq.len_k - seq.len_q, HAS_WINDOW ? p.fwd.mods.window_left : 0,
                                        HAS_WINDOW ? p.fwd.mods.window_right : 0};
  const int n_begin = band.template key_block_begin<Tr::BLOCK_N>(row0);
  const int n_end = band.template key_block_end<Tr::BLOCK_N>(row0 + rows_q - 1);
  // the key tiles these rows see: the band's, less those a BlockMask's map marks empty (every warp counts them)
  TileMap tiles;
  tiles.init(p.fwd.mods, ScoreMods<MODS>::HAS_MASK, batch, head, m_block);
  const int n_tiles = n_end > n_begin ? tiles.count_warp(n_begin, n_end, threadIdx.x & 31) : 0;
  if (n_tiles <= 0) {  // these rows see no key: O = 0, lse = -inf (a pair's rank 0 writes every column)
    if (Tr::SPLIT > 1 && cluster_ctarank() != 0) return;
    float* o = reinterpret_cast<float*>(p.fwd.o) + batch * p.fwd.o_batch_stride +
               static_cast<long long>(out_row0) * p.fwd.o_row_stride + head * p.fwd.o_head_stride;
    const int cols = p.fwd.head_dim;
    for (int idx = threadIdx.x; idx < rows_q * cols; idx += Tr::THREADS) o[(idx / cols) * p.fwd.o_row_stride + idx % cols] = 0.f;
    if (p.fwd.lse != nullptr)
      for (int r = threadIdx.x; r < rows_q; r += Tr::THREADS)
        p.fwd.lse[batch * p.fwd.lse_batch_stride + head * p.fwd.lse_head_stride + out_row0 + r] = neg_inf();
    return;
  }

  if (threadIdx.x == 0) {
    mbarrier_init(sm.q_full(), 1);
    mbarrier_init(sm.q_ready(), Tr::CONSUMER_THREADS);
#pragma unroll
    for (int s = 0; s < Tr::STAGES; ++s) {
      mbarrier_init(sm.k_full(s), 1);
      mbarrier_init(sm.v_full(s), 1);
      mbarrier_init(sm.k_ready(s), Tr::SPLIT_THREADS);
      mbarrier_init(sm.k_empty(s), Tr::CONSUMER_WARPS);
      mbarrier_init(sm.v_empty(s), Tr::SPLIT_THREADS);
      mbarrier_init(sm.vt_full(s), Tr::SPLIT_THREADS);
      mbarrier_init(sm.vt_empty(s), Tr::CONSUMER_WARPS);
    }
    if constexpr (Tr::SPLIT > 1)  // exchange slots: a consumer's 4 warps arrive, the other CTA's stores complete bytes
#pragma unroll
      for (int x = 0; x < 2 * Tr::CONSUMERS; ++x) mbarrier_init(sm.xbar(0, 0) + 8 * x, 4);
    fence_mbarrier_init();
  }
  if constexpr (Tr::SPLIT > 1)
    cluster_sync();  // both CTAs' barriers initialized before any store into the other
  else
    __syncthreads();

  if (threadIdx.x < 128) {
    if constexpr (Tr::CONSUMERS > 1) setmaxnreg_dec<Tr::PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      prefetch_tensormap(&p.tma_q);
      prefetch_tensormap(&p.tma_k);
      prefetch_tensormap(&p.tma_v);
      fwd_tf32_producer<Tr>(p, sm, seq, row0, head, batch, tiles, n_begin, n_end, n_tiles,
                            Tr::SPLIT > 1 ? static_cast<int>(cluster_ctarank()) * Tr::HEAD_DIM : 0);
    } else if (threadIdx.x >= 32) {
      fwd_tf32_splitter<Tr>(sm, n_tiles, threadIdx.x - 32);
    }
    if constexpr (Tr::SPLIT > 1) cluster_sync();  // (in each role's branch, as the backward's pairs)
  } else {
    if constexpr (Tr::OWN_SPLIT_FIRST)  // this warpgroup's rows of Q
      tf32_split_own_rows<Tr::BLOCK_M, Tr::HEAD_DIM, Tr::X3>(sm.q_full(), sm.q_ready(), sm.q(), sm.q_big());
    if constexpr (Tr::CONSUMERS > 1) setmaxnreg_inc<Tr::CONSUMER_REGS>();
    fwd_tf32_consumer<Tr, IS_CAUSAL, MODS>(p, sm, band, row0, out_row0, rows_q, head, batch, tiles, n_begin, n_end,
                                           n_tiles);
    if constexpr (Tr::SPLIT > 1) cluster_sync();  // the other CTA may still be writing to this one's shared memory
  }
#else
  static_assert(Tr::HEAD_DIM < 0, "fwd_sm90_tf32_kernel uses TMA and TF32 wgmma: compile it for sm_90a");
#endif
}

template <class Tr, bool IS_CAUSAL, int MODS>
__global__ void __launch_bounds__(Tr::THREADS, 1) fwd_sm90_tf32_kernel(const __grid_constant__ FwdWsParams p) {
  static_assert(Tr::SPLIT == 1, "SPLIT 2 runs as fwd_sm90_tf32_pair_kernel");
  fwd_tf32_main<Tr, IS_CAUSAL, MODS>(p);
}
template <class Tr, bool IS_CAUSAL, int MODS>
__global__ void CUFLASH_CLUSTER_PAIR __launch_bounds__(Tr::THREADS, 1)
    fwd_sm90_tf32_pair_kernel(const __grid_constant__ FwdWsParams p) {
  static_assert(Tr::SPLIT == 2, "a pair of CTAs: SPLIT 2");
  fwd_tf32_main<Tr, IS_CAUSAL, MODS>(p);
}

}  // namespace cuflash
