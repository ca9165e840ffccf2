// fwd_sm90.cuh: FlashAttention-2 forward (Dao 2023, Algorithm 1) on Hopper warpgroup MMA (sm_90a).
//
// The algorithm, tiling and pipeline are those of fwd.cuh; what changes is the matrix unit. Each
// warpgroup (4 warps) owns 64 query rows and issues one wgmma.m64nNk16 per k16 step for its whole
// 64 x BLOCK_N score tile, reading Q and K straight from shared memory (no ldmatrix: the tensor core
// fetches each K fragment once per warpgroup instead of once per warp). P goes from the S accumulators
// into A registers as in fwd.cuh, and O += P V reads V from shared memory N-major (its rows are the k
// dimension). The shared-memory tiles keep fwd.cuh's swizzled panel layout, which is wgmma's canonical
// 128-byte (or 64-byte) swizzle layout (tiles.cuh), so the cp.async copies are unchanged.
#pragma once
#include "ptx.cuh"
#include "ptx_wgmma.cuh"
#include "traits.cuh"
#include "tiles.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "softmax.cuh"
#include "fwd.cuh"

namespace cuflash {

// One key tile for one warpgroup: S = Q K_j^T, online softmax, O += P V_j.
// q_smem: this warpgroup's first Q row; warp_row: the first query row (absolute) of this warp.
template <class Tr, bool IS_CAUSAL, bool IS_MASKED, int MODS>
__device__ __forceinline__ void fwd_sm90_key_tile(const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                                  const ScoreMods<MODS>& mods, float scale_log2, int n_block, u32 q_smem,
                                                  u32 k_smem, u32 v_smem, int warp_row, int lane,
                                                  float (&o_acc)[1][Tr::D_TILES][4],
                                                  OnlineSoftmax<1, Tr::N_TILES, Tr::D_TILES>& softmax) {
  using T = typename Tr::T;
  // S = Q K^T (unscaled; the scale is folded into the exp2 argument). 64 x BLOCK_N per warpgroup:
  // this warp holds rows warp_row + g (+8) of it, in mma.m16n8 accumulator order.
  float s_acc[1][Tr::N_TILES][4];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk)
    Wgmma<Tr::BLOCK_N, T>::template ss</*TRANS_A=*/0, /*TRANS_B=*/0>(
        s_acc[0], Tr::TileQ::desc_k_major(q_smem, 0, kk * 16), Tr::TileKV::desc_k_major(k_smem, 0, kk * 16),
        /*scale_d=*/kk > 0);
  wgmma_commit_group();
  wgmma_wait_group<0>();
  wgmma_fence_operand(s_acc[0]);

  // softcap, ALiBi (mods.cuh); then the tail of K, the causal diagonal, the window: masked scores = -inf
  float unused_dcap[1][Tr::N_TILES][4];
  apply_score_mods(s_acc, unused_dcap, warp_row, n_block * Tr::BLOCK_N, band.diag, mods, lane);
  if (IS_MASKED)
    apply_band_mask<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>(s_acc, warp_row, n_block * Tr::BLOCK_N, band, lane);

  // m_new = max(m, rowmax(S)); O *= exp2(m - m_new); P = exp2(S*scale_log2 - m_new)
  softmax.update(s_acc, o_acc, scale_log2);
  apply_dropout(s_acc, warp_row, n_block * Tr::BLOCK_N, mods, lane);  // after the row sums: lse is undropped

  // O += P V: P from the S accumulators into A registers (the m16n8k16 A layout, per warp)
  u32 p_regs[Tr::PV_K_STEPS][4];
#pragma unroll
  for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) {
    p_regs[kk][0] = Cvt<T>::pack(s_acc[0][2 * kk][0], s_acc[0][2 * kk][1]);
    p_regs[kk][1] = Cvt<T>::pack(s_acc[0][2 * kk][2], s_acc[0][2 * kk][3]);
    p_regs[kk][2] = Cvt<T>::pack(s_acc[0][2 * kk + 1][0], s_acc[0][2 * kk + 1][1]);
    p_regs[kk][3] = Cvt<T>::pack(s_acc[0][2 * kk + 1][2], s_acc[0][2 * kk + 1][3]);
  }
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk)
    Wgmma<Tr::HEAD_DIM, T>::template rs</*TRANS_B=*/1>(o_acc[0], p_regs[kk], Tr::TileKV::desc_mn_major(v_smem, kk * 16, 0),
                                                       /*scale_d=*/1);
  wgmma_commit_group();
  wgmma_wait_group<0>();
  wgmma_fence_operand(o_acc[0]);
}

template <class Tr, bool IS_CAUSAL, int MODS>
__global__ void __launch_bounds__(Tr::THREADS, Tr::CTAS_PER_SM) fwd_sm90_kernel(const FwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const AlignedSmem aligned = align_smem_1024(smem_raw);
  const u32 smem_base = aligned.base;
  unsigned char* smem = aligned.ptr;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warpgroup = warp / 4;
  // causal: launch the longest query blocks (most key tiles) first so the last wave is short
  const int m_block = IS_CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  const Seq seq = sequence(p.seq, batch);
  const int row0 = m_block * Tr::BLOCK_M;                      // first query row of this CTA
  if (row0 >= seq.len_q) return;                               // varlen: past this sequence's end
  const int rows_q = min(Tr::BLOCK_M, seq.len_q - row0);       // valid query rows
  const int diag = seq.len_k - seq.len_q;                      // query i sees keys j <= i + diag
  const int warp_row0 = warp * 16;                             // this warp's first row in the tile
  const int kv_head = head / p.seq.kv_group;                   // GQA: the K/V head of this query head

  const u16* q_gmem = p.q + batch * p.q_batch_stride + static_cast<long long>(seq.q_row0 + row0) * p.q_row_stride +
                      head * p.q_head_stride;
  const u16* k_gmem = p.k + batch * p.k_batch_stride + static_cast<long long>(seq.k_row0) * p.k_row_stride +
                      kv_head * p.k_head_stride;
  const u16* v_gmem = p.v + batch * p.v_batch_stride + static_cast<long long>(seq.k_row0) * p.v_row_stride +
                      kv_head * p.v_head_stride;
  // O and lse of this CTA's rows (a function: computed anew after the key loop, not kept live through it)
  auto o_rows = [&](int first_row) {
    return p.o + batch * p.o_batch_stride + static_cast<long long>(first_row) * p.o_row_stride + head * p.o_head_stride;
  };
  auto lse_rows = [&](int first_row) { return p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + first_row; };

  // key tiles [n_begin, n_end): tiles outside the causal / window band are skipped
  const Band<IS_CAUSAL, HAS_WINDOW> band{seq.len_k, diag, p.mods.window_left, p.mods.window_right};
  const int n_begin = band.template key_block_begin<Tr::BLOCK_N>(row0);
  const int n_end = band.template key_block_end<Tr::BLOCK_N>(row0 + rows_q - 1);
  if (n_end <= n_begin) {  // e.g. causal with seqlen_q > seqlen_k: these rows see no key: O = 0, lse = -inf
    zero_tile_gmem<typename Tr::TileQ, Tr::THREADS>(o_rows(seq.q_row0 + row0), p.o_row_stride, rows_q, p.head_dim, tid);
    if (p.lse != nullptr)
      for (int r = tid; r < rows_q; r += Tr::THREADS) lse_rows(seq.q_row0 + row0)[r] = neg_inf();
    return;
  }

  const u32 q_smem = smem_base;
  const u32 k_smem0 = q_smem + Tr::SMEM_Q;  // K stages, then V stages
  const u32 v_smem0 = k_smem0 + Tr::STAGES * Tr::SMEM_KV;
  // this warpgroup's 64 Q rows: whole 8-row swizzle atoms, so the descriptor just starts there
  const u32 q_smem_wg = q_smem + Tr::TileQ::offset(warpgroup * 64, 0);

  // prologue: Q and the first (last-indexed) K/V tile in one cp.async group
  int n_block = n_end - 1;
  load_tile_async<typename Tr::TileQ, Tr::THREADS>(q_smem, q_gmem, p.q_row_stride, rows_q, p.head_dim, tid);
  load_tile_async<typename Tr::TileKV, Tr::THREADS>(k_smem0, k_gmem + n_block * Tr::BLOCK_N * p.k_row_stride,
                                                    p.k_row_stride, seq.len_k - n_block * Tr::BLOCK_N, p.head_dim, tid);
  load_tile_async<typename Tr::TileKV, Tr::THREADS>(v_smem0, v_gmem + n_block * Tr::BLOCK_N * p.v_row_stride,
                                                    p.v_row_stride, seq.len_k - n_block * Tr::BLOCK_N, p.head_dim, tid);
  cp_async_commit_group();

  float o_acc[1][Tr::D_TILES][4];  // O of this warp's 16 rows, fp32, in registers throughout
#pragma unroll
  for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) o_acc[0][dt][c] = 0.f;
  OnlineSoftmax<1, Tr::N_TILES, Tr::D_TILES> softmax;
  softmax.init();
  ScoreMods<MODS> mods;
  mods.init(p.mods, batch, head, p.heads, seq.len_q, seq.len_k);

  // Key tiles from the last to the first: the masked ones (K tail, causal diagonal, window's right edge)
  // come first, then an unmasked loop, then the window's left edge masked again. Each iteration first
  // issues the next tile's loads into the other stage.
  int stage = 0;
  auto step = [&](auto is_masked_tag) {
    constexpr bool IS_MASKED = decltype(is_masked_tag)::value;
    if (n_block > n_begin) {
      const int next = n_block - 1;
      const u32 off = (stage ^ 1) * Tr::SMEM_KV;
      load_tile_async<typename Tr::TileKV, Tr::THREADS>(k_smem0 + off, k_gmem + next * Tr::BLOCK_N * p.k_row_stride,
                                                        p.k_row_stride, Tr::BLOCK_N, p.head_dim, tid);
      load_tile_async<typename Tr::TileKV, Tr::THREADS>(v_smem0 + off, v_gmem + next * Tr::BLOCK_N * p.v_row_stride,
                                                        p.v_row_stride, Tr::BLOCK_N, p.head_dim, tid);
    }
    cp_async_commit_group();     // possibly empty: keeps the group count uniform
    cp_async_wait_group<1>();    // this stage's K/V (and Q) have landed
    fence_proxy_async_shared();  // ... and are visible to the tensor cores' (async proxy) reads
    __syncthreads();
    fwd_sm90_key_tile<Tr, IS_CAUSAL, IS_MASKED, MODS>(band, mods, p.scale_log2, n_block, q_smem_wg,
                                                k_smem0 + stage * Tr::SMEM_KV, v_smem0 + stage * Tr::SMEM_KV,
                                                row0 + warp_row0, lane, o_acc, softmax);
    __syncthreads();  // every warpgroup is done with this stage before the next iteration refills it
    stage ^= 1;
  };
  const int row_last = row0 + rows_q - 1;
  for (; n_block >= n_begin && band.needs_mask_right(row0, (n_block + 1) * Tr::BLOCK_N - 1); --n_block)
    step(BoolTag<true>());
  for (; n_block >= n_begin && !band.needs_mask_left(row_last, n_block * Tr::BLOCK_N); --n_block)
    step(BoolTag<false>());
  if (HAS_WINDOW)
    for (; n_block >= n_begin; --n_block) step(BoolTag<true>());

  // epilogue: O /= l (and * 1 / (1 - p) with dropout), lse; O -> shared (the Q tile's space, this warp's
  // own rows) -> 16-byte stores
  float lse[1][2];
  softmax.finalize(o_acc, lse);
  if (ScoreMods<MODS>::HAS_DROPOUT) scale_acc(o_acc, p.mods.dropout_rp);
  const int out_row0 = seq.q_row0 + row0;
  float* lse_gmem = lse_rows(out_row0);
  const int g = lane >> 2, t = lane & 3;
  using T = typename Tr::T;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp_row0 + g + h * 8;
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt)
      *reinterpret_cast<u32*>(smem + Tr::TileQ::offset(row, dt * 8 + 2 * t)) =
          Cvt<T>::pack(o_acc[0][dt][2 * h], o_acc[0][dt][2 * h + 1]);
    if (t == 0 && row < rows_q && p.lse != nullptr) lse_gmem[row] = lse[0][h];
  }
  __syncthreads();
  store_tile<typename Tr::TileQ, Tr::THREADS>(o_rows(out_row0), p.o_row_stride, smem, rows_q, p.head_dim, tid);
#else
  static_assert(Tr::HEAD_DIM < 0, "fwd_sm90_kernel uses wgmma: compile it for sm_90a");
#endif
}

}  // namespace cuflash
