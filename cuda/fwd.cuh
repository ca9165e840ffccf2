// fwd.cuh: FlashAttention-2 forward (Dao 2023, Algorithm 1) on mma.sync tensor cores.
//
// One CTA computes O and lse for BLOCK_M query rows of one (batch, head). Each warp owns WARP_ROWS
// of those rows and keeps their O accumulator in registers for the whole key loop, so O is written
// to global memory exactly once. K/V tiles stream through a double-buffered cp.async pipeline.
#pragma once
#include "ptx.cuh"
#include "traits.cuh"
#include "tiles.cuh"
#include "mask.cuh"
#include "softmax.cuh"

namespace cuflash {

// Kernel arguments, passed by value. Mirrored by cuflash/_launch.py:FwdParams (ctypes).
struct FwdParams {
  const u16* q;  // [batch, seqlen_q, heads, head_dim] at the strides below (elements)
  const u16* k;  // [batch, seqlen_k, heads, head_dim]
  const u16* v;  // [batch, seqlen_k, heads, head_dim]
  u16* o;        // [batch, seqlen_q, heads, head_dim]
  float* lse;    // [batch, heads, seqlen_q], contiguous, natural log
  long long q_batch_stride, q_row_stride, q_head_stride;
  long long k_batch_stride, k_row_stride, k_head_stride;
  long long v_batch_stride, v_row_stride, v_head_stride;
  long long o_batch_stride, o_row_stride, o_head_stride;
  int seqlen_q, seqlen_k;
  int heads;
  int head_dim;      // run-time head dim <= HEAD_DIM; columns beyond it are zero in shared memory
  float scale_log2;  // softmax_scale * log2(e)
};
static_assert(sizeof(FwdParams) == 160, "FwdParams is mirrored field by field in cuflash/_launch.py");

// One key tile: S = Q K_j^T, online softmax, O += P V_j. The next tile's loads are already in flight.
// q_lane, k_lane, v_lane: this lane's ldmatrix addresses of the (0, 0) blocks (tiles.cuh).
template <class Tr, bool IS_CAUSAL, bool IS_MASKED>
__device__ __forceinline__ void fwd_key_tile(const FwdParams& p, int n_block, u32 q_lane, u32 k_lane, u32 v_lane,
                                             int warp_row0, int row0, int lane,
                                             float (&o_acc)[Tr::M_TILES][Tr::D_TILES][4],
                                             OnlineSoftmax<Tr::M_TILES, Tr::N_TILES, Tr::D_TILES>& softmax) {
  using T = typename Tr::T;
  // S = Q K^T (unscaled; the scale is folded into the exp2 argument)
  float s_acc[Tr::M_TILES][Tr::N_TILES][4];  // m16n8 accumulators: c0,c1 row g; c2,c3 row g+8
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tr::N_TILES; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) s_acc[mt][nt][c] = 0.f;

#pragma unroll
  for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk) {
    u32 q_regs[Tr::M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < Tr::M_TILES; ++mt)
      ldmatrix_x4(q_regs[mt], Tr::TileQ::frag(q_lane, mt * 16, kk * 16));
#pragma unroll
    for (int np = 0; np < Tr::N_TILES / 2; ++np) {
      u32 k_regs[4];
      ldmatrix_x4(k_regs, Tr::TileKV::frag(k_lane, np * 16, kk * 16));
#pragma unroll
      for (int mt = 0; mt < Tr::M_TILES; ++mt) {
        Mma<T>::m16n8k16(s_acc[mt][2 * np], q_regs[mt], k_regs[0], k_regs[1]);
        Mma<T>::m16n8k16(s_acc[mt][2 * np + 1], q_regs[mt], k_regs[2], k_regs[3]);
      }
    }
  }

  // tail of K and the causal diagonal: masked scores = -inf
  if (IS_MASKED)
    apply_mask<IS_CAUSAL>(s_acc, row0 + warp_row0, n_block * Tr::BLOCK_N, p.seqlen_k, p.seqlen_k - p.seqlen_q, lane);

  // m_new = max(m, rowmax(S)); O *= exp2(m - m_new); P = exp2(S*scale_log2 - m_new)
  softmax.update(s_acc, o_acc, p.scale_log2);

  // O += P V: P goes from the S accumulators straight into A fragments (no shared memory)
#pragma unroll
  for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) {
    u32 p_regs[Tr::M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < Tr::M_TILES; ++mt) {
      p_regs[mt][0] = Cvt<T>::pack(s_acc[mt][2 * kk][0], s_acc[mt][2 * kk][1]);
      p_regs[mt][1] = Cvt<T>::pack(s_acc[mt][2 * kk][2], s_acc[mt][2 * kk][3]);
      p_regs[mt][2] = Cvt<T>::pack(s_acc[mt][2 * kk + 1][0], s_acc[mt][2 * kk + 1][1]);
      p_regs[mt][3] = Cvt<T>::pack(s_acc[mt][2 * kk + 1][2], s_acc[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < Tr::D_TILES / 2; ++dp) {
      u32 v_regs[4];
      ldmatrix_x4_trans(v_regs, Tr::TileKV::frag(v_lane, kk * 16, dp * 16));
#pragma unroll
      for (int mt = 0; mt < Tr::M_TILES; ++mt) {
        Mma<T>::m16n8k16(o_acc[mt][2 * dp], p_regs[mt], v_regs[0], v_regs[1]);
        Mma<T>::m16n8k16(o_acc[mt][2 * dp + 1], p_regs[mt], v_regs[2], v_regs[3]);
      }
    }
  }
}

template <class Tr, bool IS_CAUSAL>
__global__ void __launch_bounds__(Tr::THREADS) fwd_kernel(const FwdParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // causal: launch the longest query blocks (most key tiles) first so the last wave is short
  const int m_block = IS_CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int row0 = m_block * Tr::BLOCK_M;                      // first query row of this CTA
  const int rows_q = min(Tr::BLOCK_M, p.seqlen_q - row0);      // valid query rows
  const int diag = p.seqlen_k - p.seqlen_q;                    // query i sees keys j <= i + diag
  const int warp_row0 = warp * Tr::WARP_ROWS;                  // first row of this warp in the tile

  const u16* q_gmem = p.q + batch * p.q_batch_stride + head * p.q_head_stride + row0 * p.q_row_stride;
  const u16* k_gmem = p.k + batch * p.k_batch_stride + head * p.k_head_stride;
  const u16* v_gmem = p.v + batch * p.v_batch_stride + head * p.v_head_stride;
  u16* o_gmem = p.o + batch * p.o_batch_stride + head * p.o_head_stride + row0 * p.o_row_stride;
  float* lse_gmem = p.lse + (static_cast<long long>(batch) * p.heads + head) * p.seqlen_q + row0;

  const int n_blocks = num_key_blocks<IS_CAUSAL, Tr::BLOCK_N>(row0 + rows_q - 1, p.seqlen_k, diag);
  if (n_blocks <= 0) {  // causal with seqlen_q > seqlen_k: these rows see no key: O = 0, lse = -inf
    zero_tile_gmem<typename Tr::TileQ, Tr::THREADS>(o_gmem, p.o_row_stride, rows_q, p.head_dim, tid);
    for (int r = tid; r < rows_q; r += Tr::THREADS) lse_gmem[r] = neg_inf();
    return;
  }

  const u32 q_smem = smem_u32(smem);
  const u32 k_smem0 = q_smem + Tr::SMEM_Q;                      // K stages, then V stages
  const u32 v_smem0 = k_smem0 + Tr::STAGES * Tr::SMEM_KV;
  // ldmatrix lane addresses (tiles.cuh); a stage is a whole number of 1024-byte swizzle periods away
  const u32 q_lane = q_smem + Tr::TileQ::offset(warp_row0, 0) + lane_offset_a<typename Tr::TileQ>(lane);
  const u32 k_lane0 = k_smem0 + lane_offset_b_nk<typename Tr::TileKV>(lane);
  const u32 v_lane0 = v_smem0 + lane_offset_b_kn_trans<typename Tr::TileKV>(lane);

  // prologue: Q and the first (last-indexed) K/V tile in one cp.async group
  int n_block = n_blocks - 1;
  load_tile_async<typename Tr::TileQ, Tr::THREADS>(q_smem, q_gmem, p.q_row_stride, rows_q, p.head_dim, tid);
  load_tile_async<typename Tr::TileKV, Tr::THREADS>(k_smem0, k_gmem + n_block * Tr::BLOCK_N * p.k_row_stride,
                                                    p.k_row_stride, p.seqlen_k - n_block * Tr::BLOCK_N, p.head_dim, tid);
  load_tile_async<typename Tr::TileKV, Tr::THREADS>(v_smem0, v_gmem + n_block * Tr::BLOCK_N * p.v_row_stride,
                                                    p.v_row_stride, p.seqlen_k - n_block * Tr::BLOCK_N, p.head_dim, tid);
  cp_async_commit_group();

  float o_acc[Tr::M_TILES][Tr::D_TILES][4];  // O of this warp's rows, fp32, in registers throughout
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
      for (int c = 0; c < 4; ++c) o_acc[mt][dt][c] = 0.f;
  OnlineSoftmax<Tr::M_TILES, Tr::N_TILES, Tr::D_TILES> softmax;
  softmax.init();

  // Key tiles from the last to the first: the masked ones (K tail, causal diagonal) come first, then
  // an unmasked loop. Each iteration first issues the next tile's loads into the other stage.
  int stage = 0;
  auto step = [&](auto is_masked_tag) {
    constexpr bool IS_MASKED = decltype(is_masked_tag)::value;
    if (n_block > 0) {
      const int next = n_block - 1;
      const u32 off = (stage ^ 1) * Tr::SMEM_KV;
      load_tile_async<typename Tr::TileKV, Tr::THREADS>(k_smem0 + off, k_gmem + next * Tr::BLOCK_N * p.k_row_stride,
                                                        p.k_row_stride, Tr::BLOCK_N, p.head_dim, tid);
      load_tile_async<typename Tr::TileKV, Tr::THREADS>(v_smem0 + off, v_gmem + next * Tr::BLOCK_N * p.v_row_stride,
                                                        p.v_row_stride, Tr::BLOCK_N, p.head_dim, tid);
    }
    cp_async_commit_group();   // possibly empty: keeps the group count uniform
    cp_async_wait_group<1>();  // this stage's K/V (and Q) have landed
    __syncthreads();
    fwd_key_tile<Tr, IS_CAUSAL, IS_MASKED>(p, n_block, q_lane, k_lane0 + stage * Tr::SMEM_KV,
                                           v_lane0 + stage * Tr::SMEM_KV, warp_row0, row0, lane, o_acc, softmax);
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
    stage ^= 1;
  };
  for (; n_block >= 0 && key_block_needs_mask<IS_CAUSAL, Tr::BLOCK_N>(n_block, row0, p.seqlen_k, diag); --n_block)
    step(BoolTag<true>());
  for (; n_block >= 0; --n_block) step(BoolTag<false>());

  // epilogue: O /= l, lse; O -> shared (the Q tile's space, this warp's own rows) -> 16-byte stores
  float lse[Tr::M_TILES][2];
  softmax.finalize(o_acc, lse);
  const int g = lane >> 2, t = lane & 3;
  using T = typename Tr::T;
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row0 + mt * 16 + g + h * 8;
#pragma unroll
      for (int dt = 0; dt < Tr::D_TILES; ++dt)
        *reinterpret_cast<u32*>(smem + Tr::TileQ::offset(row, dt * 8 + 2 * t)) =
            Cvt<T>::pack(o_acc[mt][dt][2 * h], o_acc[mt][dt][2 * h + 1]);
      if (t == 0 && row < rows_q) lse_gmem[row] = lse[mt][h];
    }
  __syncthreads();
  store_tile<typename Tr::TileQ, Tr::THREADS>(o_gmem, p.o_row_stride, smem, rows_q, p.head_dim, tid);
}

}  // namespace cuflash
