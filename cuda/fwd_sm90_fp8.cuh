// fwd_sm90_fp8.cuh: the FP8 (e4m3) forward on sm_90a, FlashAttention-3's low-precision path (Shah et al. 2024,
// section 3.3): S = Q K^T and O = P V on FP8 wgmma (m64nNk32), fp32 accumulators and softmax, O written in bf16
// or fp16. The pipeline is fwd_sm90_ws.cuh's (TMA producer, two consumer warpgroups of 64 query rows, the softmax
// of key tile i under the P V GEMM of tile i - 1), with what FP8 changes:
//
// * FP8 wgmma reads both operands K-major. Q and K are (rows, head_dim) with head_dim contiguous: K-major for
//   S = Q K^T as they are. V is (keys, head_dim): for O = P V its k dimension (keys) is strided, so three producer
//   warps transpose every V tile in shared memory into V^T (head_dim rows of BLOCK_N key bytes) before the consumers'
//   P V GEMM reads it. No pass over V in global memory.
// * P goes from the S accumulators to the A registers of the P V GEMM without a shuffle: thread (g, t) of a warp holds
//   S columns 8j + 2t, 8j + 2t + 1 of n8 tile j, and an e4m3 A fragment wants k = 4t .. 4t + 3 in each 16-column
//   half of a k32 step. Packing the thread's own columns {2t, 2t + 1, 8 + 2t, 9 + 2t} of a 16-key group as its
//   k = 4t .. 4t + 3 permutes the keys of the group (fp8_key_of below); the transposer writes V^T in the same key
//   order, so P V sums the same products.
// * P = exp2(S * scale - m + 8) lies in [0, 256] instead of [0, 1], using e4m3's range (largest finite 448) so that
//   probabilities down to 2^-17 of the row's largest stay representable (the e4m3 subnormals end at 2^-9); the row
//   sum carries the same factor, so O / l is unchanged, and lse takes 8 ln 2 off.
// * Descale factors: the real value of an element is e4m3 * descale, one float per (batch, head) or per block of 128
//   rows of one (batch, head) (Descale). Q's and K's fold into the exp2 argument's scale per key tile; V's per tile
//   is folded into O's per-tile rescale: O is kept in units of the current tile's V descale (O *= alpha *
//   vd_{i-1} / vd_i before the P_i V_i GEMM) and multiplied by the last tile's at the end.
//
// One CTA = BLOCK_M = 64 x CONSUMERS query rows of one (batch, head) (grid (m_blocks, heads, batch), causal: longest
// first; three consumer warpgroups run without pingpong), or, PERSISTENT, at most one CTA per SM walking such work
// items (see the kernel); causal and sliding-window bands (key tiles outside them are
// never loaded), GQA (K/V head = head / kv_group), dense and packed (varlen) sequences as in fwd_sm90_ws.cuh. No
// other score modifier.
//
// ---- shared memory (1-byte elements; each tile is 128-byte (64 at head_dim 64) swizzle panels, the layout of a
// 16-bit SmemTile of half the width, so TMA's swizzled boxes and the wgmma descriptors of tiles.cuh apply) -----
// [Q: BLOCK_M x HEAD_DIM] [K stages] [V stages] [V^T stages: HEAD_DIM x BLOCK_N] [mbarriers]
//
// ---- the barrier protocol ----------------------------------------------------------------------------------
//   q_full                count 1 + tx: the producer's Q load
//   q_empty               PERSISTENT only, count CONSUMER_WARPS: the consumers' last S GEMM of the item retired
//   item_full[2]          PERSISTENT only, count 1: the TMA thread has stored the slot's item index
//   item_empty[2]         PERSISTENT only, count TRANSPOSE_THREADS + CONSUMER_THREADS: each has read the slot
//   k_full[s], v_full[s]  count 1 + tx: the producer's K / V loads of the tile in stage s
//   k_empty[s]            count CONSUMER_WARPS: the consumers' S GEMM of stage s retired
//   v_empty[s]            count TRANSPOSE_THREADS: the transposers have read V of stage s
//   vt_full[s]            count TRANSPOSE_THREADS: V^T of stage s written (each thread fences its writes to the
//                         async proxy, fence.proxy.async, before it arrives: wgmma reads V^T through that proxy)
//   vt_empty[s]           count CONSUMER_WARPS: the consumers' P V GEMM of stage s retired
// Key tile i (counted over the CTA's items when PERSISTENT) uses stage i % STAGES with phase bit (i / STAGES) & 1 on
// every barrier of its stage. The producer
// loads K_i after k_empty of tile i - STAGES and V_i after v_empty of tile i - STAGES; the transposers wait v_full of
// tile i and vt_empty of tile i - STAGES; the consumers wait k_full for S_i and vt_full for P_{i-1} V_{i-1}. The
// producer issues K_{i+1} before V_i. Every wait is for a tile at least STAGES - 1 behind its waiter's, so no cycle
// forms for STAGES >= 2.
#pragma once
#include "fwd_sm90_ws.cuh"

namespace cuflash {

// One tensor's descale factors: the factor of (batch, head, block) (block: rows 128 block .. 128 block + 127 of
// the sequence) is ptr[batch * batch_stride + head * head_stride + block * block_stride]; a stride of 0 broadcasts
// (per-tensor: all three 0; per head: block_stride 0). Mirrored by cuflash/_tma.py:Descale.
struct Descale {
  const float* ptr;
  int batch_stride, head_stride, block_stride, unused;
  __device__ __forceinline__ float at(int batch, int head, int block) const {
    return ptr[batch * batch_stride + head * head_stride + block * block_stride];
  }
};

// Kernel argument of fwd_sm90_fp8_kernel (one `const __grid_constant__` struct, as FwdWsParams). The maps are of
// uint8 (the e4m3 bits) over (head_dim, seqlen, heads, batch), boxes one swizzle panel wide. FwdParams gives o (bf16 or
// fp16), lse, their strides, the sequences, heads, head_dim, scale_log2 and the window; its q, k, v are unused.
struct FwdFp8Params {
  TmaDesc tma_q;
  TmaDesc tma_k;
  TmaDesc tma_v;
  FwdParams fwd;
  Descale q_descale;  // per query head
  Descale k_descale;  // per K/V head
  Descale v_descale;  // per K/V head
  int m_blocks;       // query blocks of BLOCK_M rows per (batch, head) (max_seqlen_q if packed)
  int items;          // m_blocks * heads * batch: the work items a persistent grid walks (read only when PERSISTENT)
  int* queue;         // persistent: null (CTA c takes items c, c + gridDim.x, ...) or a work queue, two int32
                      // counters at zero (the next untaken item less gridDim.x; CTAs done), left at zero
};
// (no offsetof under NVRTC 13.0: the layout follows from the sizes, m_blocks at 976 after three 24-byte descales,
// the 8-byte queue pointer right after items)
static_assert(sizeof(Descale) == 24 && alignof(FwdFp8Params) == 64 && sizeof(FwdFp8Params) == 1024,
              "FwdFp8Params is mirrored in cuflash/_tma.py (FwdFp8Params): maps at 0, 128, 256, FwdParams at 384, "
              "descales at 904, 928, 952, m_blocks and items at 976 and 980, queue at 984, 1024 bytes");

// Rows of a quantization block: a descale's block index is row / QUANT_BLOCK_ROWS (cuflash.fp8.quantize's blocks).
constexpr int QUANT_BLOCK_ROWS = 128;

// The key (0..15) of a 16-key group whose P column a thread packs at A-fragment position k = 4t + i (p = k):
// its own S columns 2t, 2t + 1, 8 + 2t, 9 + 2t. V^T holds key fp8_key_of(p) of each group at column p.
__host__ __device__ constexpr int fp8_key_of(int p) {
  return (p & 3) < 2 ? 2 * (p >> 2) + (p & 3) : 6 + 2 * (p >> 2) + (p & 3);
}

template <int HEAD_DIM_, int BLOCK_N_, int STAGES_, class OutT_, bool PINGPONG_ = false, bool Q_IN_REGS_ = false,
          bool LATE_PACK_ = false, int CONSUMERS_ = 2, bool PERSISTENT_ = false>
struct FwdFp8Traits {
  using OutT = OutT_;                                 // f16 or bf16: O's type
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int CONSUMERS = CONSUMERS_;       // consumer warpgroups: 2, or 3 without pingpong
  static constexpr int BLOCK_M = 64 * CONSUMERS;      // query rows per CTA: 64 per consumer warpgroup
  static constexpr int BLOCK_N = BLOCK_N_;            // key rows per K/V tile
  static constexpr int STAGES = STAGES_;
  static constexpr bool PINGPONG = PINGPONG_;         // order the two consumers' GEMMs through named barriers
  static constexpr bool Q_IN_REGS = Q_IN_REGS_;      // Q as the A registers of S = Q K^T (read from shared memory once)
  static constexpr bool LATE_PACK = LATE_PACK_;      // P's packing and O's rescale at the next round's start
  static constexpr bool PERSISTENT = PERSISTENT_;    // at most one CTA per SM walks work items (see the kernel)
  static constexpr int PINGPONG_BAR = 1;              // + consumer: its turn to issue GEMMs (0 is __syncthreads)
  static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
  static constexpr int CONSUMER_WARPS = 4 * CONSUMERS;
  static constexpr int TRANSPOSE_THREADS = 96;        // producer warps 1-3; warp 0's lane 0 issues the TMA loads
  static constexpr int THREADS = 128 + CONSUMER_THREADS;
  // the TMA thread and the transposers (ldmatrix, prmt, stmatrix; 2 + (KV_CHUNKS + 2 VT_GROUPS) / 2 address
  // registers, Fp8Transposer), and the consumers: at head dim 256 with 128-key tiles a consumer thread's O (128
  // fp32 registers), S (64) and P (16) need 240 (2 x 128 x 240 + 128 x 24 = 384 x 168, the launch's registers;
  // three consumers: 3 x 128 x 152 + 128 x 56 = 64K)
  static constexpr bool WIDE_CONSUMERS = HEAD_DIM == 256 && BLOCK_N == 128 && CONSUMERS == 2;
  static constexpr int PRODUCER_REGS = WIDE_CONSUMERS ? 24 : 56;
  static constexpr int CONSUMER_REGS = CONSUMERS == 3 ? 152 : WIDE_CONSUMERS ? 240 : 224;
  static constexpr int N_TILES = BLOCK_N / 8;
  static constexpr int D_TILES = HEAD_DIM / 8;
  static constexpr int QK_K_STEPS = HEAD_DIM / 32;    // k32 steps of S = Q K^T
  static constexpr int PV_K_STEPS = BLOCK_N / 32;     // k32 steps of O += P V

  // byte tiles as 16-bit SmemTiles of half the columns: the same bytes, swizzle and descriptors
  using TileQ = SmemTile<BLOCK_M, HEAD_DIM / 2>;
  using TileKV = SmemTile<BLOCK_N, HEAD_DIM / 2>;
  using TileVt = SmemTile<HEAD_DIM, BLOCK_N / 2>;
  static constexpr int BOX_BYTES = TileQ::PANEL_BYTES;  // TMA box width: one swizzle panel
  static constexpr int PANELS = HEAD_DIM / BOX_BYTES;
  static constexpr int SMEM_Q = TileQ::BYTES;
  static constexpr int SMEM_KV = TileKV::BYTES;
  // q_full, the stages' six barriers each; persistent: q_empty, item_full[2], item_empty[2] and one 8-byte word of
  // the two item slots after them
  static constexpr int BARRIERS = 1 + 6 * STAGES + (PERSISTENT ? 6 : 0);
  static constexpr int OFF_Q = 0;
  static constexpr int OFF_K = SMEM_Q;
  static constexpr int OFF_V = OFF_K + STAGES * SMEM_KV;
  static constexpr int OFF_VT = OFF_V + STAGES * SMEM_KV;
  static constexpr int OFF_BAR = OFF_VT + STAGES * SMEM_KV;
  static constexpr int SMEM_BYTES = OFF_BAR + 8 * BARRIERS + 1024;  // cuflash/config.py FwdSm90Fp8Config.smem_bytes

  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "FP8 head dims: 64, 128, 256");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "key tiles of 64 or 128 rows (the quantization block's divisors)");
  static_assert(QUANT_BLOCK_ROWS % BLOCK_N == 0 && QUANT_BLOCK_ROWS % 64 == 0,
                "a key tile and a consumer's 64 query rows lie in one quantization block");
  static_assert(CONSUMERS == 2 || (CONSUMERS == 3 && !PINGPONG), "two consumer warpgroups, or three without pingpong");
  static_assert(TileVt::BYTES == SMEM_KV && TileKV::PANEL_BYTES == BOX_BYTES, "V^T is V's bytes; K boxes as Q's");
  static_assert(SMEM_Q % 1024 == 0 && SMEM_KV % 1024 == 0, "tiles start on the 1024-byte swizzle period");
  static_assert(STAGES >= 2 && STAGES <= 4, "K/V circular buffers of 2-4 stages");
  // within what the launch gives the CTA (65536 / THREADS rounded down to 8 per thread): setmaxnreg.inc waits for
  // registers the decrease freed, and beyond that it would wait forever
  static_assert(128 * PRODUCER_REGS + CONSUMER_THREADS * CONSUMER_REGS <= 65536 / THREADS / 8 * 8 * THREADS,
                "setmaxnreg exceeds the CTA's registers");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

template <class Tr>
struct Fp8Smem {
  u32 base;
  __device__ __forceinline__ u32 q() const { return base + Tr::OFF_Q; }
  __device__ __forceinline__ u32 k(int s) const { return base + Tr::OFF_K + s * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 v(int s) const { return base + Tr::OFF_V + s * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 vt(int s) const { return base + Tr::OFF_VT + s * Tr::SMEM_KV; }
  __device__ __forceinline__ u32 bar(int i) const { return base + Tr::OFF_BAR + 8 * i; }
  __device__ __forceinline__ u32 q_full() const { return bar(0); }
  __device__ __forceinline__ u32 k_full(int s) const { return bar(1 + s); }
  __device__ __forceinline__ u32 k_empty(int s) const { return bar(1 + Tr::STAGES + s); }
  __device__ __forceinline__ u32 v_full(int s) const { return bar(1 + 2 * Tr::STAGES + s); }
  __device__ __forceinline__ u32 v_empty(int s) const { return bar(1 + 3 * Tr::STAGES + s); }
  __device__ __forceinline__ u32 vt_full(int s) const { return bar(1 + 4 * Tr::STAGES + s); }
  __device__ __forceinline__ u32 vt_empty(int s) const { return bar(1 + 5 * Tr::STAGES + s); }
  // persistent only: Q's empty barrier and the work item ring (two slots of item indices)
  __device__ __forceinline__ u32 q_empty() const { return bar(1 + 6 * Tr::STAGES); }
  __device__ __forceinline__ u32 item_full(int slot) const { return bar(2 + 6 * Tr::STAGES + slot); }
  __device__ __forceinline__ u32 item_empty(int slot) const { return bar(4 + 6 * Tr::STAGES + slot); }
  __device__ __forceinline__ u32 item_slot(int slot) const { return bar(6 + 6 * Tr::STAGES) + 4 * slot; }
};

// V (BLOCK_N x HEAD_DIM bytes) -> V^T (HEAD_DIM x BLOCK_N bytes, keys permuted within 16-key groups by
// fp8_key_of), by the three transposer warps (warp 0..2, lane). A unit is one 16-key group h and two 16-byte column
// chunks c0, c0 + 1 of V, seen as 16-bit pairs of bytes: one ldmatrix.x4.trans (8 x 8 pair matrices: keys 0-7 and
// 8-15 of chunk c0, then of c0 + 1) gives lane (j = lane / 4, t = lane % 4) the pairs of column j at keys 2t, 2t + 1
// and 8 + 2t, 9 + 2t: two prmt make the 4 bytes of V^T rows 16 c + 2 j (even bytes) and 16 c + 2 j + 1 (odd) at
// positions 4t .. 4t + 3 of the group, exactly fp8_key_of's order; one stmatrix.x4 writes the 16-byte rows. Each
// stored matrix mixes 4 even and 4 odd rows (lanes with j < 4 give the even row of the first matrix, j >= 4 the
// odd one) so its 8 rows fall in 8 distinct swizzled chunks: no bank conflict on either side.
template <class Tr>
struct Fp8Transposer {
  static constexpr int PAIRS = Tr::HEAD_DIM / 32;  // pairs of 16-byte chunks in a V row
  static constexpr int UNITS = (Tr::BLOCK_N / 16) * PAIRS;
  static constexpr int WARPS = Tr::TRANSPOSE_THREADS / 32;
  // A unit's addresses split into this lane's part, which depends on the unit through its chunk pair within a V
  // panel (c0 % KV_CHUNKS) and its key group within a V^T panel (h % VT_GROUPS) only, and a part of the unit alone:
  //   load(u)  = load_lane[(c0 % KV_CHUNKS) / 2] + (c0 / KV_CHUNKS) * KV_PANEL + 16 h * KV_PANEL_BYTES
  //   store(u) = store_lane[h % VT_GROUPS] + (h / VT_GROUPS) * VT_PANEL + 16 c0 * VT_PANEL_BYTES
  // (the swizzle XORs a chunk index with the row mod 8, and the unit's parts move rows by multiples of 8). Each warp
  // runs its own units with u a constant of the unrolled loop, so the unit's part is an immediate offset and a unit
  // costs one ldmatrix, four prmt and one stmatrix on (KV_CHUNKS + 2 VT_GROUPS) / 2 address registers. Where the
  // transposers have fewer registers (Tr::WIDE_CONSUMERS) they keep load_lane[0] and store_lane[0] alone: the others
  // are load_lane[0] ^ (a << 5) and store_lane[0] ^ (b << 4) (the chunk bits of the swizzle), and each warp walks its
  // 16-key groups h = w, w + WARPS, ... in a rolled loop with the group's PAIRS units unrolled (unrolled over every
  // unit, ptxas held them all and spilled 48-100 bytes at 24 registers): one LOP3 per unit, four per group.
  static constexpr int KV_PANEL_BYTES = Tr::TileKV::PANEL_BYTES, VT_PANEL_BYTES = Tr::TileVt::PANEL_BYTES;
  static constexpr int KV_CHUNKS = KV_PANEL_BYTES / 16, VT_GROUPS = VT_PANEL_BYTES / 16;
  static constexpr int KV_PANEL = Tr::BLOCK_N * KV_PANEL_BYTES, VT_PANEL = Tr::HEAD_DIM * VT_PANEL_BYTES;
  static constexpr bool HELD = !Tr::WIDE_CONSUMERS;  // every lane part in a register
  u32 load_lane[HELD ? KV_CHUNKS / 2 : 1], store_lane[HELD ? VT_GROUPS : 1];
  u32 sel_lo, sel_hi;  // prmt selectors: stored matrices 0, 2 take the even (odd) bytes, 1, 3 the others
  int warp;

  __device__ __forceinline__ Fp8Transposer(int warp_, int lane) : warp(warp_) {
    const int i = lane & 7, m = lane >> 3;
    const bool odd_first = (lane >> 2) >= 4;  // this lane's row in stored matrices 0 and 2 is odd
    sel_lo = odd_first ? 0x7531u : 0x6420u;
    sel_hi = odd_first ? 0x6420u : 0x7531u;
#pragma unroll
    for (int a = 0; a < (HELD ? KV_CHUNKS / 2 : 1); ++a)
      load_lane[a] = Tr::TileKV::offset(lane & 15, 8 * (2 * a + (lane >> 4)));
    const int d = 16 * (m >> 1) + 2 * i + (((i >= 4) != ((m & 1) != 0)) ? 1 : 0);  // its V^T row less 16 c0
#pragma unroll
    for (int b = 0; b < (HELD ? VT_GROUPS : 1); ++b) store_lane[b] = Tr::TileVt::offset(d, 8 * b);
  }

  // V -> V^T (the units as above the struct): warp W takes units W, W + WARPS, ...
  __device__ __forceinline__ void unit(u32 ld, u32 st) const {
    u32 r[4];
    ldmatrix_x4_trans(r, ld);
    stmatrix_x4(st, prmt(r[0], r[1], sel_lo), prmt(r[0], r[1], sel_hi), prmt(r[2], r[3], sel_lo),
                prmt(r[2], r[3], sel_hi));
  }
  template <int W>
  __device__ __forceinline__ void units(u32 v_smem, u32 vt_smem) const {
#pragma unroll
    for (int u = W; u < UNITS; u += WARPS) {
      const int h = u / PAIRS, c0 = 2 * (u % PAIRS);
      const u32 ld = load_lane[HELD ? (c0 % KV_CHUNKS) / 2 : 0], st = store_lane[HELD ? h % VT_GROUPS : 0];
      unit(v_smem + ld + ((c0 / KV_CHUNKS) * KV_PANEL + 16 * h * KV_PANEL_BYTES),
           vt_smem + st + ((h / VT_GROUPS) * VT_PANEL + 16 * c0 * VT_PANEL_BYTES));
    }
  }
  __device__ __forceinline__ void operator()(u32 v_smem, u32 vt_smem) const {
    static_assert(WARPS == 3, "three transposer warps");
    if constexpr (HELD) {
      if (warp == 0)
        units<0>(v_smem, vt_smem);
      else if (warp == 1)
        units<1>(v_smem, vt_smem);
      else
        units<2>(v_smem, vt_smem);
    } else {
      // (v_smem and the group's 2048 h bytes leave bits 5-6, which the XORs set, as load_lane[0] has them)
#pragma unroll 1
      for (int h = warp; h < Tr::BLOCK_N / 16; h += WARPS) {
        const u32 ld = v_smem + load_lane[0] + 16 * h * KV_PANEL_BYTES;
        const u32 st = vt_smem + (store_lane[0] ^ ((h % VT_GROUPS) << 4)) + (h / VT_GROUPS) * VT_PANEL;
        // c0 = 2 a + KV_CHUNKS panel: the units of one XOR in a row, so one of them is live at a time
#pragma unroll
        for (int a = 0; a < KV_CHUNKS / 2; ++a) {
          const u32 ld_a = ld ^ (a << 5);
#pragma unroll
          for (int panel = 0; panel < 2 * PAIRS / KV_CHUNKS; ++panel)
            unit(ld_a + panel * KV_PANEL, st + 16 * (2 * a + KV_CHUNKS * panel) * VT_PANEL_BYTES);
        }
      }
    }
  }
};

// The online softmax of one key tile for FP8 P (softmax_probs with the +8 offset): m_new = max(m, rowmax(S) *
// scale_log2), l = l * alpha + rowsum(P), S overwritten by P = exp2(S * scale_log2 - m_new + 8); alpha = exp2(m -
// m_new) for O's rescale.
// part[0] = part[0] op ... op part[N - 1] as a tree (N a power of two; the halving loop unrolls completely)
template <int N, class Op>
__device__ __forceinline__ float tree_reduce(float (&part)[N], Op op) {
  static_assert((N & (N - 1)) == 0, "a power of two");
  if constexpr (N > 1) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) part[i] = op(part[i], part[i + N / 2]);
    return tree_reduce(reinterpret_cast<float(&)[N / 2]>(part), op);
  } else {
    return part[0];
  }
}

template <int N_TILES, int D_TILES>
__device__ __forceinline__ void fp8_softmax_probs(OnlineSoftmax<1, N_TILES, D_TILES>& softmax,
                                                  float (&s)[1][N_TILES][4], float scale_log2, float (&alpha)[2]) {
  // the row max and row sum as trees (depth log2(2 N_TILES), not a chain of 2 N_TILES): with FP8's GEMMs twice as
  // fast as 16-bit ones, the softmax's latency is what the other consumer's GEMMs must hide
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float part[N_TILES];
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt) part[nt] = fmaxf(s[0][nt][2 * h], s[0][nt][2 * h + 1]);
    const float tile_max = tree_reduce(part, [](float a, float b) { return fmaxf(a, b); });
    const float m_new = fmaxf(softmax.row_max[0][h], quad_max(tile_max) * scale_log2);
    const float m_use = (m_new == neg_inf()) ? 0.f : m_new;  // a row masked so far: exp2(-inf) = 0, not NaN
    alpha[h] = ex2_approx(softmax.row_max[0][h] - m_use);
    softmax.row_max[0][h] = m_new;
    const float shift = 8.f - m_use;
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt) {
      s[0][nt][2 * h] = ex2_approx(fmaf(s[0][nt][2 * h], scale_log2, shift));
      s[0][nt][2 * h + 1] = ex2_approx(fmaf(s[0][nt][2 * h + 1], scale_log2, shift));
      part[nt] = s[0][nt][2 * h] + s[0][nt][2 * h + 1];
    }
    softmax.row_sum[0][h] = softmax.row_sum[0][h] * alpha[h] + tree_reduce(part, [](float a, float b) { return a + b; });
  }
}

// P (fp32 S accumulators) -> e4m3 A registers of O += P V: k32 step kk covers n8 tiles 4kk .. 4kk + 3; a thread's
// columns of tiles 4kk, 4kk + 1 are its k = 4t .. 4t + 3, those of 4kk + 2, 4kk + 3 its k = 16 + 4t .. (fp8_key_of).
template <int N_TILES, int PV_K_STEPS>
__device__ __forceinline__ void fp8_probs_to_regs(const float (&s)[1][N_TILES][4], u32 (&p_regs)[PV_K_STEPS][4]) {
#pragma unroll
  for (int kk = 0; kk < PV_K_STEPS; ++kk) {
    p_regs[kk][0] = pack_e4m3x4(s[0][4 * kk][0], s[0][4 * kk][1], s[0][4 * kk + 1][0], s[0][4 * kk + 1][1]);
    p_regs[kk][1] = pack_e4m3x4(s[0][4 * kk][2], s[0][4 * kk][3], s[0][4 * kk + 1][2], s[0][4 * kk + 1][3]);
    p_regs[kk][2] = pack_e4m3x4(s[0][4 * kk + 2][0], s[0][4 * kk + 2][1], s[0][4 * kk + 3][0], s[0][4 * kk + 3][1]);
    p_regs[kk][3] = pack_e4m3x4(s[0][4 * kk + 2][2], s[0][4 * kk + 2][3], s[0][4 * kk + 3][2], s[0][4 * kk + 3][3]);
  }
}

// The TMA thread, one work item: Q, then K and V of the n_tiles key tiles from n_end - 1 down (K_0, then K_{i+1}
// before V_i). t0: key tiles of the CTA's earlier items (tile t0 + i takes stage (t0 + i) % STAGES); q_phase: the
// item's parity on q_full / q_empty (persistent: Q once the consumers have released the previous item's).
template <class Tr>
__device__ __forceinline__ void fwd_fp8_producer(const FwdFp8Params& p, const Fp8Smem<Tr>& sm, const Seq& seq,
                                                 int row0, int head, int batch, int n_end, int n_tiles, int t0,
                                                 u32 q_phase) {
  const int kv_head = head / p.fwd.seq.kv_group;
  const int q_batch = p.fwd.seq.cu_seqlens_q != nullptr ? 0 : batch;
  const int kv_batch = p.fwd.seq.cu_seqlens_k != nullptr ? 0 : batch;
  if (Tr::PERSISTENT) mbarrier_wait_or_trap(sm.q_empty(), q_phase ^ 1);  // the first item passes at once
  mbarrier_arrive_expect_tx(sm.q_full(), Tr::SMEM_Q);
#pragma unroll
  for (int panel = 0; panel < Tr::PANELS; ++panel)
    cp_async_bulk_tensor_4d_global_to_shared(sm.q() + panel * Tr::BLOCK_M * Tr::BOX_BYTES, &p.tma_q, sm.q_full(),
                                             panel * Tr::BOX_BYTES, seq.q_row0 + row0, head, q_batch);
  // K runs one tile ahead of V: K_{i+1} is issued before V_i, as the consumers need them together (S_{i+1} beside
  // P_i V_i), so a V stage still being transposed never holds back the next S GEMM's K
  auto load_k = [&](int i) {
    const int stage = (t0 + i) % Tr::STAGES;
    mbarrier_wait_or_trap(sm.k_empty(stage), (((t0 + i) / Tr::STAGES) & 1) ^ 1);
    mbarrier_arrive_expect_tx(sm.k_full(stage), Tr::SMEM_KV);
#pragma unroll
    for (int panel = 0; panel < Tr::PANELS; ++panel)
      cp_async_bulk_tensor_4d_global_to_shared(sm.k(stage) + panel * Tr::BLOCK_N * Tr::BOX_BYTES, &p.tma_k,
                                               sm.k_full(stage), panel * Tr::BOX_BYTES,
                                               seq.k_row0 + (n_end - 1 - i) * Tr::BLOCK_N, kv_head, kv_batch);
  };
  load_k(0);
  for (int i = 0; i < n_tiles; ++i) {
    if (i + 1 < n_tiles) load_k(i + 1);
    const int stage = (t0 + i) % Tr::STAGES;
    mbarrier_wait_or_trap(sm.v_empty(stage), (((t0 + i) / Tr::STAGES) & 1) ^ 1);
    mbarrier_arrive_expect_tx(sm.v_full(stage), Tr::SMEM_KV);
#pragma unroll
    for (int panel = 0; panel < Tr::PANELS; ++panel)
      cp_async_bulk_tensor_4d_global_to_shared(sm.v(stage) + panel * Tr::BLOCK_N * Tr::BOX_BYTES, &p.tma_v,
                                               sm.v_full(stage), panel * Tr::BOX_BYTES,
                                               seq.k_row0 + (n_end - 1 - i) * Tr::BLOCK_N, kv_head, kv_batch);
  }
}

// The transposers (producer warps 1-3): V_i -> V^T_i for every key tile of one work item (t0: as the producer's).
template <class Tr>
__device__ __forceinline__ void fwd_fp8_transposer(const Fp8Smem<Tr>& sm, int n_tiles, int warp, int lane, int t0) {
  const Fp8Transposer<Tr> transpose(warp, lane);
  int stage = t0 % Tr::STAGES;
  u32 phase = (t0 / Tr::STAGES) & 1;
  for (int i = t0; i < t0 + n_tiles; ++i) {
    if constexpr (Tr::WIDE_CONSUMERS) {  // from i, two registers fewer across the loop (24 in all)
      stage = i % Tr::STAGES;
      phase = (i / Tr::STAGES) & 1;
    }
    mbarrier_wait_or_trap(sm.v_full(stage), phase);
    mbarrier_wait_or_trap(sm.vt_empty(stage), phase ^ 1);
    transpose(sm.v(stage), sm.vt(stage));
    fence_proxy_async_shared();  // V^T's generic writes before the consumers' wgmma (async proxy) reads
    mbarrier_arrive(sm.v_empty(stage));
    mbarrier_arrive(sm.vt_full(stage));
    if (!Tr::WIDE_CONSUMERS && ++stage == Tr::STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
}

// Consumer warpgroup wg (0, 1): query rows row0 + 64 wg .. + 63.
template <class Tr, bool IS_CAUSAL, bool HAS_WINDOW>
__device__ __forceinline__ void fwd_fp8_consumer(const FwdFp8Params& p, const Fp8Smem<Tr>& sm,
                                                 const Band<IS_CAUSAL, HAS_WINDOW>& band, int m_block, int row0,
                                                 int out_row0, int rows_q, int head, int batch, int n_end,
                                                 int n_tiles, int t0, u32 q_phase) {
  const int ctid = threadIdx.x - 128;
  const int wg = ctid / 128, lane = ctid & 31, warp = ctid / 32;
  const int warp_row = row0 + warp * 16, wg_row = row0 + wg * 64;
  const u32 q_smem_wg = sm.q() + Tr::TileQ::offset(wg * 64, 0);
  const int kv_head = head / p.fwd.seq.kv_group;
  // the descales: Q's of this query block, K's and V's per key tile (read a tile ahead of their use)
  // (two consumers: the CTA's 128 rows are one quantization block, m_block; three: this consumer's 64 rows' block, or
  // for a consumer past the sequence's end the last row's, whose factor exists)
  const int q_block = Tr::CONSUMERS == 2 ? m_block : (row0 + min(64 * wg, rows_q - 1)) / QUANT_BLOCK_ROWS;
  const float scale_q = p.fwd.scale_log2 * p.q_descale.at(batch, head, q_block);
  auto k_descale = [&](int n_block) { return p.k_descale.at(batch, kv_head, n_block * Tr::BLOCK_N / QUANT_BLOCK_ROWS); };
  auto v_descale = [&](int n_block) { return p.v_descale.at(batch, kv_head, n_block * Tr::BLOCK_N / QUANT_BLOCK_ROWS); };

  float o_acc[1][Tr::D_TILES][4];
#pragma unroll
  for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) o_acc[0][dt][c] = 0.f;
  OnlineSoftmax<1, Tr::N_TILES, Tr::D_TILES> softmax;
  softmax.init();
  float s_acc[1][Tr::N_TILES][4];
  u32 p_regs[Tr::PV_K_STEPS][4];
  float alpha[2];

  u32 q_regs[Tr::Q_IN_REGS ? Tr::QK_K_STEPS : 1][4];
  auto issue_s = [&](u32 k_smem) {
#pragma unroll
    for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk) {
      if (Tr::Q_IN_REGS)
        Wgmma<Tr::BLOCK_N, e4m3>::rs(s_acc[0], q_regs[Tr::Q_IN_REGS ? kk : 0],
                                     Tr::TileKV::desc_k_major(k_smem, 0, kk * 16), /*scale_d=*/kk > 0);
      else
        Wgmma<Tr::BLOCK_N, e4m3>::ss(s_acc[0], Tr::TileQ::desc_k_major(q_smem_wg, 0, kk * 16),
                                     Tr::TileKV::desc_k_major(k_smem, 0, kk * 16), /*scale_d=*/kk > 0);
    }
    wgmma_commit_group();
  };
  auto issue_pv = [&](u32 vt_smem) {
#pragma unroll
    for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk)
      Wgmma<Tr::HEAD_DIM, e4m3>::rs(o_acc[0], p_regs[kk], Tr::TileVt::desc_k_major(vt_smem, 0, kk * 16), /*scale_d=*/1);
    wgmma_commit_group();
  };
  auto release = [&](u32 bar) {
    if (lane == 0) mbarrier_arrive(bar);
  };
  auto scores_to_probs = [&](int n_block, float scale_log2) {
    const int key0 = n_block * Tr::BLOCK_N;
    if (band.needs_mask_right(wg_row, key0 + Tr::BLOCK_N - 1) || band.needs_mask_left(wg_row + 63, key0))
      apply_band_mask<IS_CAUSAL, HAS_WINDOW>(s_acc, warp_row, key0, band, lane);
    fp8_softmax_probs(softmax, s_acc, scale_log2, alpha);
  };

  // pingpong: consumer 0 issues first (consumer 1 gives it the first token); each consumer runs n_tiles + 1 rounds
  // of GEMMs (S_0 | S_i with P_{i-1} V_{i-1} | P_last V_last) and passes the token after each but its last
  // (consumer 1's last passes nothing), so every named barrier sees as many arrives as syncs (fwd_sm90_ws.cuh)
  auto round_begin = [&]() {
    if (Tr::PINGPONG) named_barrier_sync(Tr::PINGPONG_BAR + wg, 256);
  };
  auto round_end = [&](bool is_last) {
    if (Tr::PINGPONG && !(is_last && wg == 1)) named_barrier_arrive(Tr::PINGPONG_BAR + 1 - wg, 256);
  };
  if (Tr::PINGPONG && wg == 1) named_barrier_arrive(Tr::PINGPONG_BAR, 256);

  mbarrier_wait_or_trap(sm.q_full(), q_phase);
  if (Tr::Q_IN_REGS) {  // this warp's 16 rows of Q, k32 step by step: ldmatrix.x4 gives the e4m3 A fragment
#pragma unroll
    for (int kk = 0; kk < (Tr::Q_IN_REGS ? Tr::QK_K_STEPS : 0); ++kk)
      ldmatrix_x4(q_regs[kk], sm.q() + Tr::TileQ::offset(warp * 16 + (lane & 7) + 8 * ((lane >> 3) & 1),
                                                         16 * kk + 8 * (lane >> 4)));
  }
  int stage = t0 % Tr::STAGES, n_block = n_end - 1;
  u32 phase = (t0 / Tr::STAGES) & 1;
  // persistent: Q's buffer goes back to the producer once this consumer's last S GEMM of the item has retired
  auto release_q = [&](bool last_s) {
    if (Tr::PERSISTENT && last_s) release(sm.q_empty());
  };
  // V descales: vd_cur of the tile whose P is in s_acc, vd_prev of the last P V GEMM issued (O's units)
  float vd_cur = v_descale(n_block), vd_prev = vd_cur;
  auto rescale_and_pack = [&](float units) {  // O *= alpha * units, then P (s_acc) -> the P V GEMM's A registers
    const float a0 = alpha[0] * units, a1 = alpha[1] * units;
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt) {
      o_acc[0][dt][0] *= a0;
      o_acc[0][dt][1] *= a0;
      o_acc[0][dt][2] *= a1;
      o_acc[0][dt][3] *= a1;
    }
    fp8_probs_to_regs(s_acc, p_regs);
  };
  // LATE_PACK: P_j's packing (into the A registers of the last P V GEMM: wait for it, free its V^T stage) and O's
  // rescale to tile j's max and V descale run at the start of the next round, where that GEMM ran under this
  // consumer's softmax (the wait is short), and softmax j follows S_j's wait alone. Without it they follow the
  // softmax in one basic block, and ptxas schedules the wait for P_{j-1} V_{j-1} ahead of the exponentials: the
  // softmax of S_j starts only once P_{j-1} V_{j-1} has retired.
  int pv_stage = -1;  // LATE_PACK: the V^T stage of the P V GEMM issued last, until late_pack has waited for it
  auto late_pack = [&]() {
    wgmma_wait_group<0>();
    wgmma_fence_operand(o_acc[0]);
    if (pv_stage >= 0) release(sm.vt_empty(pv_stage));
    rescale_and_pack(__fdividef(vd_prev, vd_cur));
    vd_prev = vd_cur;
  };
  {
    const float kd = k_descale(n_block);
    round_begin();
    mbarrier_wait_or_trap(sm.k_full(stage), phase);
    wgmma_fence();
    issue_s(sm.k(stage));
    round_end(/*is_last=*/false);
    wgmma_wait_group<0>();
    wgmma_fence_operand(s_acc[0]);
    release(sm.k_empty(stage));
    release_q(n_tiles == 1);
    scores_to_probs(n_block, scale_q * kd);  // alpha = 0: O is still 0
    if (!Tr::LATE_PACK) fp8_probs_to_regs(s_acc, p_regs);
  }
  int v_stage = stage;  // of key tile i - 1
  u32 v_phase = phase;
  if (++stage == Tr::STAGES) {
    stage = 0;
    phase ^= 1;
  }
  for (int i = 1; i < n_tiles; ++i) {
    --n_block;
    const float kd = k_descale(n_block);
    if (Tr::LATE_PACK) late_pack();  // P_{i-1}
    const float vd = v_descale(n_block);
    if (Tr::LATE_PACK) vd_cur = vd;
    round_begin();
    mbarrier_try_wait_parity(sm.k_full(stage), phase);
    wgmma_fence();  // p_regs and o_acc were written since the last wgmma
    issue_s(sm.k(stage));
    mbarrier_try_wait_parity(sm.vt_full(v_stage), v_phase);
    issue_pv(sm.vt(v_stage));
    pv_stage = v_stage;
    round_end(/*is_last=*/false);

    wgmma_wait_group<1>();  // S_i
    wgmma_fence_operand(s_acc[0]);
    release(sm.k_empty(stage));
    release_q(i == n_tiles - 1);
    scores_to_probs(n_block, scale_q * kd);

    if (!Tr::LATE_PACK) {
      wgmma_wait_group<0>();  // P_{i-1} V_{i-1}
      wgmma_fence_operand(o_acc[0]);
      release(sm.vt_empty(v_stage));
      const float units = vd_prev / vd;  // O from tile i-1's V descale to tile i's
      vd_prev = vd;
      rescale_and_pack(units);
    }
    v_stage = stage;
    v_phase = phase;
    if (++stage == Tr::STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
  if (Tr::LATE_PACK) late_pack();
  round_begin();
  mbarrier_try_wait_parity(sm.vt_full(v_stage), v_phase);
  wgmma_fence();
  issue_pv(sm.vt(v_stage));
  round_end(/*is_last=*/true);
  wgmma_wait_group<0>();
  wgmma_fence_operand(o_acc[0]);
  release(sm.vt_empty(v_stage));

  // epilogue: O = O' * vd / l (the last tile's V descale), lse without the +8 of P; straight from registers to
  // global memory (4-byte stores of column pairs; rows past rows_q, e.g. the next packed sequence's, not stored)
  float lse[1][2];
  softmax.finalize(o_acc, lse);
  scale_acc(o_acc, vd_prev);
  const int g = lane >> 2, t = lane & 3;
  using OutT = typename Tr::OutT;
  u16* o_gmem = p.fwd.o + batch * p.fwd.o_batch_stride + static_cast<long long>(out_row0) * p.fwd.o_row_stride +
                head * p.fwd.o_head_stride;
  float* lse_gmem = p.fwd.lse + batch * p.fwd.lse_batch_stride + head * p.fwd.lse_head_stride + out_row0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp * 16 + g + 8 * h;
    if (row >= rows_q) continue;
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt)
      *reinterpret_cast<u32*>(o_gmem + row * p.fwd.o_row_stride + dt * 8 + 2 * t) =
          Cvt<OutT>::pack(o_acc[0][dt][2 * h], o_acc[0][dt][2 * h + 1]);
    if (t == 0 && p.fwd.lse != nullptr) lse_gmem[row] = lse[0][h] - 8.f * LN2;  // -inf stays -inf
  }
}

// One work item of a persistent grid: query block m_block of (batch, head), its sequence and the key tiles its rows
// see. Every thread derives the same item from the same index: index = blockIdx.x, + gridDim.x, ... over m_blocks *
// heads * batch items, query blocks fastest (causal: longest first).
template <class Tr, bool IS_CAUSAL, bool HAS_WINDOW>
struct Fp8Item {
  Seq seq;
  Band<IS_CAUSAL, HAS_WINDOW> band;
  int m_block, head, batch, row0, rows_q, out_row0, n_end, n_tiles;
  bool live;  // false: past this sequence's end (varlen)

  __device__ __forceinline__ void init(const FwdFp8Params& p, int index) {
    const int bh = index / p.m_blocks, m_index = index - bh * p.m_blocks;
    head = bh % p.fwd.heads;
    batch = bh / p.fwd.heads;
    m_block = IS_CAUSAL ? p.m_blocks - 1 - m_index : m_index;
    seq = sequence(p.fwd.seq, batch);
    row0 = m_block * Tr::BLOCK_M;
    live = row0 < seq.len_q;
    rows_q = min(Tr::BLOCK_M, seq.len_q - row0);
    out_row0 = seq.q_row0 + row0;
    band = Band<IS_CAUSAL, HAS_WINDOW>{seq.len_k, seq.len_k - seq.len_q, HAS_WINDOW ? p.fwd.mods.window_left : 0,
                                      HAS_WINDOW ? p.fwd.mods.window_right : 0};
    const int n_begin = band.template key_block_begin<Tr::BLOCK_N>(row0);
    n_end = band.template key_block_end<Tr::BLOCK_N>(row0 + rows_q - 1);
    n_tiles = live ? max(n_end - n_begin, 0) : 0;
  }

  // rows that see no key: O = 0, lse = -inf, by threads tid = 0 .. nthreads - 1
  static __device__ __forceinline__ void write_empty(const FwdFp8Params& p, int batch, int head, int out_row0,
                                                     int rows_q, int tid, int nthreads) {
    u16* o = p.fwd.o + batch * p.fwd.o_batch_stride + static_cast<long long>(out_row0) * p.fwd.o_row_stride +
             head * p.fwd.o_head_stride;
    for (int idx = tid; idx < rows_q * (Tr::HEAD_DIM / 8); idx += nthreads)
      *reinterpret_cast<uint4*>(o + (idx / (Tr::HEAD_DIM / 8)) * p.fwd.o_row_stride + (idx % (Tr::HEAD_DIM / 8)) * 8) =
          make_uint4(0, 0, 0, 0);
    if (p.fwd.lse != nullptr)
      for (int r = tid; r < rows_q; r += nthreads)
        p.fwd.lse[batch * p.fwd.lse_batch_stride + head * p.fwd.lse_head_stride + out_row0 + r] = neg_inf();
  }
};

// The transposers' and consumers' walk of a persistent CTA's items: item u's index from slot u % 2 of the item ring
// (wait item_full[slot] with parity (u / 2) & 1, read, arrive on item_empty[slot]); an index >= items ends the walk.
// role(item, t0, q_phase): t0 the key tiles of the earlier items, q_phase the parity of the items with key tiles so
// far. Each role runs its own loop (one loop shared by both roles made ptxas spill and serialize the wgmma, C7519).
template <class Tr, bool IS_CAUSAL, bool HAS_WINDOW, class Role>
__device__ __forceinline__ void walk_items(const Fp8Smem<Tr>& sm, const FwdFp8Params& p, Role&& role) {
  int t0 = 0;
  u32 q_phase = 0;
  for (u32 u = 0;; ++u) {
    const int index = item_ring_take(sm, u);
    if (index >= p.items) break;
    Fp8Item<Tr, IS_CAUSAL, HAS_WINDOW> it;
    it.init(p, index);
    role(it, t0, q_phase);
    if (it.n_tiles > 0) {
      t0 += it.n_tiles;
      q_phase ^= 1;
    }
  }
}

// Persistent (Tr::PERSISTENT): a grid of at most one CTA per SM. The TMA thread picks the CTA's items (blockIdx.x
// first, then blockIdx.x + gridDim.x, ..., or, with a work queue (p.queue: causal rows, whose items differ in
// length), the next untaken item, taken once it has issued the current item's loads; the last CTA to finish resets
// the queue) and hands each index to the transposers and the consumers through a two-slot ring in shared memory
// (walk_items; an index >= items ends every role). The K/V, V^T rings are not drained between items (each role
// counts the key tiles of its CTA's earlier items, t0, and tile t0 + i takes stage (t0 + i) % STAGES with phase
// ((t0 + i) / STAGES) & 1, as one long key loop), Q has an empty barrier besides its full one (count CONSUMER_WARPS:
// each consumer warp arrives once its last S GEMM of the item has retired, so the next item's Q loads under the
// item's last P V GEMM and epilogue, which writes O from registers), and the item with u earlier items that had key
// tiles waits q_full with parity u & 1 (the producer q_empty with (u & 1) ^ 1). Items without a key tile touch no
// barrier but the ring's: the consumers write their rows. The pingpong tokens balance within each item
// (fwd_fp8_consumer), so they carry across items.
template <class Tr, bool IS_CAUSAL, bool HAS_WINDOW>
__global__ void __launch_bounds__(Tr::THREADS, 1) fwd_sm90_fp8_kernel(const __grid_constant__ FwdFp8Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const Fp8Smem<Tr> sm{align_smem_1024(smem_raw).base};
  if (dynamic_smem_size() < Tr::SMEM_BYTES) __trap();
  using Item = Fp8Item<Tr, IS_CAUSAL, HAS_WINDOW>;
  auto prefetch_maps = [&]() {  // the TMA thread, before its first load
    prefetch_tensormap(&p.tma_q);
    prefetch_tensormap(&p.tma_k);
    prefetch_tensormap(&p.tma_v);
  };
  auto init_barriers = [&]() {
    if (threadIdx.x == 0) {
      mbarrier_init(sm.q_full(), 1);
      if (Tr::PERSISTENT) {
        mbarrier_init(sm.q_empty(), Tr::CONSUMER_WARPS);
        for (int slot = 0; slot < 2; ++slot) {
          mbarrier_init(sm.item_full(slot), 1);
          mbarrier_init(sm.item_empty(slot), Tr::TRANSPOSE_THREADS + Tr::CONSUMER_THREADS);
        }
      }
#pragma unroll
      for (int s = 0; s < Tr::STAGES; ++s) {
        mbarrier_init(sm.k_full(s), 1);
        mbarrier_init(sm.v_full(s), 1);
        mbarrier_init(sm.k_empty(s), Tr::CONSUMER_WARPS);
        mbarrier_init(sm.v_empty(s), Tr::TRANSPOSE_THREADS);
        mbarrier_init(sm.vt_full(s), Tr::TRANSPOSE_THREADS);
        mbarrier_init(sm.vt_empty(s), Tr::CONSUMER_WARPS);
      }
      fence_mbarrier_init();
    }
    __syncthreads();
  };

  if constexpr (!Tr::PERSISTENT) {  // one item: the grid is (m_blocks, heads, batch)
    const int m_block = IS_CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;  // causal: longest first
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
    const int n_tiles = n_end - n_begin;
    if (n_tiles <= 0) {  // these rows see no key: O = 0, lse = -inf
      Item::write_empty(p, batch, head, out_row0, rows_q, threadIdx.x, Tr::THREADS);
      return;
    }
    init_barriers();
    if (threadIdx.x < 128) {
      setmaxnreg_dec<Tr::PRODUCER_REGS>();
      if (threadIdx.x == 0) {
        prefetch_maps();
        fwd_fp8_producer<Tr>(p, sm, seq, row0, head, batch, n_end, n_tiles, 0, 0);
      } else if (threadIdx.x >= 32) {
        fwd_fp8_transposer<Tr>(sm, n_tiles, threadIdx.x / 32 - 1, threadIdx.x & 31, 0);
      }
    } else {
      setmaxnreg_inc<Tr::CONSUMER_REGS>();
      fwd_fp8_consumer<Tr, IS_CAUSAL, HAS_WINDOW>(p, sm, band, m_block, row0, out_row0, rows_q, head, batch, n_end,
                                                  n_tiles, 0, 0);
    }
  } else {
    init_barriers();
    if (threadIdx.x < 128) {
      // every thread of the producer warpgroup gives its registers back here, before the roles split (with the TMA
      // thread's setmaxnreg in a branch of its own the kernel hung)
      setmaxnreg_dec<Tr::PRODUCER_REGS>();
      if (threadIdx.x == 0) {
        prefetch_maps();
        int index = blockIdx.x, t0 = 0;
        u32 q_phase = 0;
        for (u32 u = 0;; ++u) {
          item_ring_put(sm, u, index);  // the transposers and the consumers take it
          if (index >= p.items) break;
          Item it;
          it.init(p, index);
          if (it.n_tiles > 0) {
            fwd_fp8_producer<Tr>(p, sm, it.seq, it.row0, it.head, it.batch, it.n_end, it.n_tiles, t0, q_phase);
            t0 += it.n_tiles;
            q_phase ^= 1;
          }
          // the next item, taken once this item's loads are issued (the consumers are then STAGES tiles from its
          // end, which hides the atomic's round trip), as fwd_sm90_ws_kernel takes its items
          index = p.queue != nullptr ? static_cast<int>(gridDim.x) + atomicAdd(p.queue, 1) : index + gridDim.x;
        }
        if (p.queue != nullptr) work_queue_done(p.queue);
      } else if (threadIdx.x >= 32) {
        walk_items<Tr, IS_CAUSAL, HAS_WINDOW>(sm, p, [&](const Item& it, int t0, u32) {
          if (it.n_tiles > 0) fwd_fp8_transposer<Tr>(sm, it.n_tiles, threadIdx.x / 32 - 1, threadIdx.x & 31, t0);
        });
      }
    } else {
      setmaxnreg_inc<Tr::CONSUMER_REGS>();
      walk_items<Tr, IS_CAUSAL, HAS_WINDOW>(sm, p, [&](const Item& it, int t0, u32 q_phase) {
        if (it.n_tiles > 0)
          fwd_fp8_consumer<Tr, IS_CAUSAL, HAS_WINDOW>(p, sm, it.band, it.m_block, it.row0, it.out_row0, it.rows_q,
                                                      it.head, it.batch, it.n_end, it.n_tiles, t0, q_phase);
        else if (it.live)
          Item::write_empty(p, it.batch, it.head, it.out_row0, it.rows_q, threadIdx.x - 128, Tr::CONSUMER_THREADS);
      });
    }
  }
#else
  static_assert(Tr::HEAD_DIM < 0, "fwd_sm90_fp8_kernel uses TMA and FP8 wgmma: compile it for sm_90a");
#endif
}

}  // namespace cuflash
