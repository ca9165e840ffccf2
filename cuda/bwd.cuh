// bwd.cuh: FlashAttention-2 backward (Dao 2023, Algorithm 2) on mma.sync tensor cores.
//
// Nothing of size N^2 is stored: P is recomputed per tile from Q, K and the forward's lse.
//   1. bwd_preprocess_kernel: delta_i = rowsum(dO_i * O_i), lse_log2_i = lse_i * log2(e), dQ_acc = 0 (and its
//      turn counters, dq_turns, = 0)
//   2. bwd_kernel (K/V-outer): dK_j, dV_j in registers, written once; dQ_i += dS K_j by fp32 atomics
//      into dQ_acc (or, deterministic, not at all: then 3b; bwd_sm90_ws_kernel instead adds them in a fixed order,
//      bwd_sm90_ws.cuh "deterministic mode")
//   3. bwd_convert_dq_kernel: dQ = softmax_scale * dQ_acc in the input dtype and layout
//   3b. bwd_dq_kernel (Q-outer, deterministic): dQ_i = softmax_scale * sum_j dS_ij K_j in registers
// Dense or packed (varlen) sequences and GQA as in the forward (seqs.cuh). With GQA, a bwd_kernel CTA
// owns keys of one K/V head and runs the query blocks of every query head of its group in turn, so dK
// and dV are summed over the group in registers and written once (no atomics, no repeated K/V).
#pragma once
#include "ptx.cuh"
#include "traits.cuh"
#include "tiles.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "softmax.cuh"
#include "seqs.cuh"

namespace cuflash {

// Arguments of every backward kernel, passed by value. Mirrored by cuflash/_launch.py:BwdParams.
struct BwdParams {
  const u16* q;     // [batch, seqlen_q, heads, head_dim] (varlen: [total_q, heads, head_dim]) at the strides below
  const u16* k;     // [batch, seqlen_k, kv_heads, head_dim]
  const u16* v;     // [batch, seqlen_k, kv_heads, head_dim]
  const u16* o;     // like q
  const u16* dout;  // like q
  u16* dq;          // like q
  u16* dk;          // like k
  u16* dv;          // like k
  const float* lse; // lse[batch * lse_batch_stride + head * lse_head_stride + (q_row0 + row) * lse_row_stride]
  float* dq_accum;  // [rows of padded_row0, dq_accum_cols] fp32, contiguous (seqs.cuh)
  float* lse_log2;  // [rows of padded_row0]: lse * log2(e); +inf where lse = -inf and on pad rows
  float* delta;     // [rows of padded_row0]: rowsum(dO * O); 0 on pad rows
  SeqParams seq;
  long long q_batch_stride, q_row_stride, q_head_stride;
  long long k_batch_stride, k_row_stride, k_head_stride;
  long long v_batch_stride, v_row_stride, v_head_stride;
  long long o_batch_stride, o_row_stride, o_head_stride;
  long long do_batch_stride, do_row_stride, do_head_stride;
  long long dq_batch_stride, dq_row_stride, dq_head_stride;
  long long dk_batch_stride, dk_row_stride, dk_head_stride;
  long long dv_batch_stride, dv_row_stride, dv_head_stride;
  long long lse_batch_stride, lse_head_stride, lse_row_stride;
  int seqlen_q_pad;   // fp32 rows per (batch, head) (dense) or per head (varlen): seqs.cuh
  int heads;          // query heads
  int head_dim;       // run-time head dim <= the kernel's HEAD_DIM
  int dq_accum_cols;  // the kernel's HEAD_DIM
  float scale_log2;   // softmax_scale * log2(e)
  float softmax_scale;
  ModParams mods;     // score modifiers (mods.cuh), read by kernels instantiated with MODS != 0
  double scale_log2_d, softmax_scale_d;  // the two scales in float64 (the float64 kernels, wide.cuh)
  // deterministic bwd_sm90_ws_kernel: [rows of padded_row0 / 64] the key blocks that have added their dQ into each
  // 64 rows of dQ_acc (its ordered reductions); else null. (Last: inserted after `delta`, the field offsets that
  // moved made NVRTC 13.0 spill 20-24 bytes in two head-dim-128 instantiations of that kernel.)
  int* dq_turns;
};
static_assert(sizeof(BwdParams) == 624, "BwdParams is mirrored field by field in cuflash/_launch.py");

// ---- 1. preprocess: eight lanes per query row, four rows per warp -------------------------------
// Each lane reads 16-byte chunks of O and dO (chunk c of a row goes to lane c % 8 of its eight), so every
// lane has loads in flight at head dim 64 (one warp per row left 24 of 32 lanes idle there, and the kernel
// read and wrote at 41% of the DRAM bandwidth on the H100).
constexpr int PREPROCESS_LANES = 8;                                  // lanes per query row
constexpr int PREPROCESS_ROWS = 256 / PREPROCESS_LANES;              // rows per CTA of 256 threads
static_assert(PAD_ROWS % PREPROCESS_ROWS == 0, "a padded region is a whole number of CTAs");

template <class T>
__global__ void __launch_bounds__(256) bwd_preprocess_kernel(const BwdParams p) {
  const int sub = threadIdx.x % PREPROCESS_LANES;  // this lane's place among its row's eight
  const int row = blockIdx.x * PREPROCESS_ROWS + threadIdx.x / PREPROCESS_LANES;
  const int head = blockIdx.y, batch = blockIdx.z;
  const Seq seq = sequence(p.seq, batch);
  float delta = 0.f;
  if (row < seq.len_q) {
    const long long qrow = seq.q_row0 + row;
    const u16* o_row = p.o + batch * p.o_batch_stride + head * p.o_head_stride + qrow * p.o_row_stride;
    const u16* do_row = p.dout + batch * p.do_batch_stride + head * p.do_head_stride + qrow * p.do_row_stride;
    for (int col = sub * 8; col < p.head_dim; col += PREPROCESS_LANES * 8) {
      const uint4 o8 = *reinterpret_cast<const uint4*>(o_row + col);
      const uint4 do8 = *reinterpret_cast<const uint4*>(do_row + col);
      const u32 ow[4] = {o8.x, o8.y, o8.z, o8.w}, dw[4] = {do8.x, do8.y, do8.z, do8.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        delta += Cvt<T>::unpack(ow[i], 0) * Cvt<T>::unpack(dw[i], 0);
        delta += Cvt<T>::unpack(ow[i], 1) * Cvt<T>::unpack(dw[i], 1);
      }
    }
  }
  // the row's sum over its eight lanes (every lane of the warp takes part: no lane has returned yet)
#pragma unroll
  for (int x = PREPROCESS_LANES / 2; x > 0; x >>= 1) delta += __shfl_xor_sync(0xffffffffu, delta, x);
  // every row of the sequence's padded region, pad rows included, is initialized
  if (row >= (seq.len_q + PAD_ROWS - 1) / PAD_ROWS * PAD_ROWS) return;
  const long long vec = padded_row0(p.seq, batch, head, p.heads, p.seqlen_q_pad) + row;
  if (sub == 0) {
    float lse_log2 = -neg_inf();  // pad rows: P = exp2(S - inf) = 0, no contribution
    if (row < seq.len_q) {
      const float lse = p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride +
                              (seq.q_row0 + row) * p.lse_row_stride];
      // a row that saw no key (lse = -inf) gets +inf, so its P = exp2(S * scale_log2 - inf) = 0
      lse_log2 = (lse == neg_inf()) ? -neg_inf() : lse * LOG2E;
    }
    p.delta[vec] = delta;
    p.lse_log2[vec] = lse_log2;
  }
  if (p.dq_turns != nullptr && sub == 0 && vec % 64 == 0) p.dq_turns[vec / 64] = 0;
  if (p.dq_accum != nullptr) {
    float* acc = p.dq_accum + vec * p.dq_accum_cols;
    for (int col = sub * 4; col < p.dq_accum_cols; col += PREPROCESS_LANES * 4)
      *reinterpret_cast<float4*>(acc + col) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// ---- 2. main backward: one CTA per BLOCK_N keys ---------------------------------------------

// One query block: S^T, P^T, dV, dP^T, dS^T, dK, and (unless deterministic) dQ_i += dS K_j.
template <class Tr, bool IS_CAUSAL, bool IS_DETERMINISTIC, bool IS_MASKED, int MODS>
__device__ __forceinline__ void bwd_query_block(const BwdParams& p, const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                                const ScoreMods<MODS>& mods, unsigned char* smem,
                                                u32 smem_base, int stage, int m_block, int n0, long long vec_row,
                                                int warp, int lane, float (&dk_acc)[Tr::DKV_TILES][4],
                                                float (&dv_acc)[Tr::DKV_TILES][4]) {
  using Mods = ScoreMods<MODS>;
  using T = typename Tr::T;
  const int t = lane & 3, g = lane >> 2;
  const int key_row0 = (warp / Tr::D_SPLIT) * 16;            // this warp's keys in the tile
  const int d_col0 = (warp % Tr::D_SPLIT) * Tr::DKV_COLS;    // this warp's dK/dV columns
  const int m0 = m_block * Tr::BLOCK_M;
  const u32 q_smem = smem_base + Tr::OFF_Q + stage * 2 * Tr::SMEM_Q;
  const u32 do_smem = smem_base + Tr::OFF_DO + stage * 2 * Tr::SMEM_Q;
  const u32 k_smem = smem_base + Tr::OFF_K, v_smem = smem_base + Tr::OFF_V;
  const float* lse_log2_smem = reinterpret_cast<const float*>(smem + Tr::OFF_LSE + stage * 2 * Tr::SMEM_ROWVEC);
  const float* delta_smem = reinterpret_cast<const float*>(smem + Tr::OFF_DELTA + stage * 2 * Tr::SMEM_ROWVEC);

  // the bias and mask of this warp's S^T tile into L1 while it is computed (not at head dim 32: with every
  // modifier but the window its causal kernel spilled 4 bytes for it on sm_80, NVRTC 13.5)
  if ((Mods::HAS_BIAS || Mods::HAS_MASK) && Tr::HEAD_DIM >= 64)
    mods.template prefetch_cols<Tr::BLOCK_M>(n0 + key_row0, m0, lane);
  // S^T = K_j Q_i^T: 16 keys x BLOCK_M queries per warp
  float s_acc[Tr::Q_TILES][4];  // rows key g, g+8; columns query 2t, 2t+1 of each n8 tile
#pragma unroll
  for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
    for (int c = 0; c < 4; ++c) s_acc[qt][c] = 0.f;
#pragma unroll
  for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk) {
    u32 k_regs[4];
    ldmatrix_a<typename Tr::TileKV>(k_regs, k_smem, key_row0, kk * 16, lane);
#pragma unroll
    for (int qp = 0; qp < Tr::Q_TILES / 2; ++qp) {
      u32 q_regs[4];
      ldmatrix_b_nk<typename Tr::TileQ>(q_regs, q_smem, qp * 16, kk * 16, lane);
      Mma<T>::m16n8k16(s_acc[2 * qp], k_regs, q_regs[0], q_regs[1]);
      Mma<T>::m16n8k16(s_acc[2 * qp + 1], k_regs, q_regs[2], q_regs[3]);
    }
  }
  // softcap, ALiBi (mods.cuh); causal diagonal, window, key tail: masked scores = -inf, so P = 0 there
  float dcap[Tr::Q_TILES][4];  // the softcap's d score / d raw score, for dS (dead without the softcap)
  apply_score_mods_transposed(s_acc, dcap, n0 + key_row0, m0, band.diag, mods, lane);
  if (IS_MASKED)
    apply_band_mask_transposed<IS_CAUSAL, Mods::HAS_WINDOW>(s_acc, n0 + key_row0, m0, band, lane);

  // P^T = exp2(S^T * scale_log2 - lse_log2[query])  (lse_log2 = +inf for rows without keys and pad rows)
#pragma unroll
  for (int qt = 0; qt < Tr::Q_TILES; ++qt) {
    const float2 lse2 = *reinterpret_cast<const float2*>(lse_log2_smem + qt * 8 + 2 * t);
    s_acc[qt][0] = ex2_approx(fmaf(s_acc[qt][0], p.scale_log2, -lse2.x));
    s_acc[qt][1] = ex2_approx(fmaf(s_acc[qt][1], p.scale_log2, -lse2.y));
    s_acc[qt][2] = ex2_approx(fmaf(s_acc[qt][2], p.scale_log2, -lse2.x));
    s_acc[qt][3] = ex2_approx(fmaf(s_acc[qt][3], p.scale_log2, -lse2.y));
  }

  // dropout: the forward's keep bits of these elements (bit qt * 4 + c), regenerated
  const u32 keep = dropout_keep_transposed<MODS, Tr::Q_TILES>(n0 + key_row0, m0, mods, lane);
  auto kept = [&](int qt, int c) { return !Mods::HAS_DROPOUT || ((keep >> (4 * qt + c)) & 1); };
  auto p_drop = [&](int qt, int c) { return kept(qt, c) ? s_acc[qt][c] : 0.f; };

  // dV_j += P^T dO_i (dropout: the kept P^T; 1 / (1 - p) applied to dV at the end): A = P^T from the
  // accumulators, B = dO_i [query][d] read transposed
#pragma unroll
  for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk) {
    const u32 p_regs[4] = {Cvt<T>::pack(p_drop(2 * kk, 0), p_drop(2 * kk, 1)),
                           Cvt<T>::pack(p_drop(2 * kk, 2), p_drop(2 * kk, 3)),
                           Cvt<T>::pack(p_drop(2 * kk + 1, 0), p_drop(2 * kk + 1, 1)),
                           Cvt<T>::pack(p_drop(2 * kk + 1, 2), p_drop(2 * kk + 1, 3))};
#pragma unroll
    for (int dp = 0; dp < Tr::DKV_TILES / 2; ++dp) {
      u32 do_regs[4];
      ldmatrix_b_kn_trans<typename Tr::TileQ>(do_regs, do_smem, kk * 16, d_col0 + dp * 16, lane);
      Mma<T>::m16n8k16(dv_acc[2 * dp], p_regs, do_regs[0], do_regs[1]);
      Mma<T>::m16n8k16(dv_acc[2 * dp + 1], p_regs, do_regs[2], do_regs[3]);
    }
  }

  // dP^T = V_j dO_i^T (at HEAD_DIM 128 the k-loop stays rolled: dK, dV, P^T and dP^T are all live here,
  // and NVRTC 13.0 spilled 8 bytes with it unrolled; unrolled elsewhere, where it measured 8 % faster)
  float dp_acc[Tr::Q_TILES][4];
#pragma unroll
  for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
    for (int c = 0; c < 4; ++c) dp_acc[qt][c] = 0.f;
#pragma unroll(Tr::DP_UNROLL)
  for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk) {
    u32 v_regs[4];
    ldmatrix_a<typename Tr::TileKV>(v_regs, v_smem, key_row0, kk * 16, lane);
#pragma unroll
    for (int qp = 0; qp < Tr::Q_TILES / 2; ++qp) {
      u32 do_regs[4];
      ldmatrix_b_nk<typename Tr::TileQ>(do_regs, do_smem, qp * 16, kk * 16, lane);
      Mma<T>::m16n8k16(dp_acc[2 * qp], v_regs, do_regs[0], do_regs[1]);
      Mma<T>::m16n8k16(dp_acc[2 * qp + 1], v_regs, do_regs[2], do_regs[3]);
    }
  }

  // dS^T = P^T * (dP^T - delta[query])   (delta_i = rowsum(dO_i * O_i)); dropout: dP^T * keep / (1 - p) in
  // place of dP^T; softcap: times d score / d raw score
#pragma unroll
  for (int qt = 0; qt < Tr::Q_TILES; ++qt) {
    const float2 delta = *reinterpret_cast<const float2*>(delta_smem + qt * 8 + 2 * t);
#pragma unroll
    for (int c = 0; c < 4; ++c)
      dp_acc[qt][c] = ds_of<MODS>(s_acc[qt][c], dp_acc[qt][c], (c & 1) ? delta.y : delta.x, kept(qt, c),
                                  p.mods.dropout_rp, Mods::HAS_SOFTCAP ? dcap[qt][c] : 1.f);
  }
  // dBias = dS^T (the warps of one key group hold the same elements: the first writes them)
  if (Mods::HAS_BIAS && warp % Tr::D_SPLIT == 0) put_dbias_transposed(dp_acc, n0 + key_row0, m0, mods, lane);

  // dK_j += dS^T Q_i (softmax_scale applied once, at the end): B = Q_i [query][d] read transposed
#pragma unroll
  for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk) {
    const u32 ds_regs[4] = {Cvt<T>::pack(dp_acc[2 * kk][0], dp_acc[2 * kk][1]),
                            Cvt<T>::pack(dp_acc[2 * kk][2], dp_acc[2 * kk][3]),
                            Cvt<T>::pack(dp_acc[2 * kk + 1][0], dp_acc[2 * kk + 1][1]),
                            Cvt<T>::pack(dp_acc[2 * kk + 1][2], dp_acc[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < Tr::DKV_TILES / 2; ++dp) {
      u32 q_regs[4];
      ldmatrix_b_kn_trans<typename Tr::TileQ>(q_regs, q_smem, kk * 16, d_col0 + dp * 16, lane);
      Mma<T>::m16n8k16(dk_acc[2 * dp], ds_regs, q_regs[0], q_regs[1]);
      Mma<T>::m16n8k16(dk_acc[2 * dp + 1], ds_regs, q_regs[2], q_regs[3]);
    }
  }

  if (IS_DETERMINISTIC) return;  // dQ comes from bwd_dq_kernel instead

  // dS^T -> shared memory (one warp per key group writes it), read back transposed as dS for dQ
  if (warp % Tr::D_SPLIT == 0) {
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt) {
      *reinterpret_cast<u32*>(smem + Tr::OFF_DS + Tr::TileDS::offset(key_row0 + g, qt * 8 + 2 * t)) =
          Cvt<T>::pack(dp_acc[qt][0], dp_acc[qt][1]);
      *reinterpret_cast<u32*>(smem + Tr::OFF_DS + Tr::TileDS::offset(key_row0 + g + 8, qt * 8 + 2 * t)) =
          Cvt<T>::pack(dp_acc[qt][2], dp_acc[qt][3]);
    }
  }
  __syncthreads();

  // dQ_i += dS K_j: warp (warp_m, warp_d) of a DQ_WARPS_M x DQ_WARPS_D grid over [BLOCK_M, HEAD_DIM]
  const int warp_m = warp / Tr::DQ_WARPS_D, warp_d = warp % Tr::DQ_WARPS_D;
  float dq_acc[Tr::DQ_M_TILES][Tr::DQ_D_TILES][4];
#pragma unroll
  for (int mt = 0; mt < Tr::DQ_M_TILES; ++mt)
#pragma unroll
    for (int dt = 0; dt < Tr::DQ_D_TILES; ++dt)
#pragma unroll
      for (int c = 0; c < 4; ++c) dq_acc[mt][dt][c] = 0.f;
  // not unrolled: keeps the address registers of the loop body out of the S^T/dP^T register peak
#pragma unroll 1
  for (int kk = 0; kk < Tr::DQ_K_STEPS; ++kk) {
    u32 ds_regs[Tr::DQ_M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < Tr::DQ_M_TILES; ++mt)
      ldmatrix_a_trans<typename Tr::TileDS>(ds_regs[mt], smem_base + Tr::OFF_DS, kk * 16,
                                            (warp_m * Tr::DQ_M_TILES + mt) * 16, lane);
#pragma unroll
    for (int dp = 0; dp < Tr::DQ_D_TILES / 2; ++dp) {
      u32 k_regs[4];
      ldmatrix_b_kn_trans<typename Tr::TileKV>(k_regs, k_smem, kk * 16, (warp_d * Tr::DQ_D_TILES + 2 * dp) * 8, lane);
#pragma unroll
      for (int mt = 0; mt < Tr::DQ_M_TILES; ++mt) {
        Mma<T>::m16n8k16(dq_acc[mt][2 * dp], ds_regs[mt], k_regs[0], k_regs[1]);
        Mma<T>::m16n8k16(dq_acc[mt][2 * dp + 1], ds_regs[mt], k_regs[2], k_regs[3]);
      }
    }
  }
  // fp32 atomics into dQ_acc (pad rows exist in the buffer, so no bounds checks)
  float* acc = p.dq_accum + vec_row * p.dq_accum_cols;  // vec_row: the block's first fp32 row (QueryBlock)
#pragma unroll
  for (int mt = 0; mt < Tr::DQ_M_TILES; ++mt)
#pragma unroll
    for (int dt = 0; dt < Tr::DQ_D_TILES; ++dt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // c0,c1 (row g) and c2,c3 (row g+8): adjacent columns
        const int row = (warp_m * Tr::DQ_M_TILES + mt) * 16 + g + h * 8;
        const int col = (warp_d * Tr::DQ_D_TILES + dt) * 8 + 2 * t;
        red_add_v2_f32(acc + row * p.dq_accum_cols + col, dq_acc[mt][dt][2 * h], dq_acc[mt][dt][2 * h + 1]);
      }
}

// One step of a K/V-outer CTA (bwd_kernel, bwd_sm90_kernel): query block m_block of query head `head`,
// and where its rows are. The steps are the kv_group query heads of the CTA's K/V head in turn, each over
// its query blocks [m_begin, m_end), flattened so that the cp.async pipeline runs on across heads. next()
// moves by pointer increments: BLOCK_M rows on, or from a head's last block to block m_begin of the next
// head (one head stride on, the walked rows back; the fp32 rows of consecutive heads are seqlen_q_pad
// apart, dense and varlen: seqs.cuh). No division, no cu_seqlens load, no row products per step.
template <class Tr>
struct QueryBlock {
  const u16* q;       // row 0 of the block in Q
  const u16* dout;    // row 0 of the block in dO
  long long vec_row;  // its first fp32 row (lse_log2, delta, dQ_acc): padded_row0(head) + m_block * BLOCK_M
  int head, m_block;

  static __device__ __forceinline__ QueryBlock first(const BwdParams& p, const Seq& seq, int batch, int head,
                                                     int m_block) {
    const long long row = static_cast<long long>(seq.q_row0) + m_block * Tr::BLOCK_M;
    QueryBlock b;
    b.q = p.q + batch * p.q_batch_stride + head * p.q_head_stride + row * p.q_row_stride;
    b.dout = p.dout + batch * p.do_batch_stride + head * p.do_head_stride + row * p.do_row_stride;
    b.vec_row = padded_row0(p.seq, batch, head, p.heads, p.seqlen_q_pad) + m_block * Tr::BLOCK_M;
    b.head = head;
    b.m_block = m_block;
    return b;
  }

  __device__ __forceinline__ QueryBlock next(const BwdParams& p, int m_begin, int m_end) const {
    QueryBlock b = *this;
    if (m_block + 1 < m_end) {
      b.q += Tr::BLOCK_M * p.q_row_stride;
      b.dout += Tr::BLOCK_M * p.do_row_stride;
      b.vec_row += Tr::BLOCK_M;
      b.m_block = m_block + 1;
    } else {  // the next query head of the group
      const int back = (m_block - m_begin) * Tr::BLOCK_M;
      b.q += p.q_head_stride - back * p.q_row_stride;
      b.dout += p.do_head_stride - back * p.do_row_stride;
      b.vec_row += p.seqlen_q_pad - back;
      b.head = head + 1;
      b.m_block = m_begin;
    }
    return b;
  }

  // k query blocks further in the same query head (m_block + k < m_end)
  __device__ __forceinline__ QueryBlock skip(const BwdParams& p, int k) const {
    QueryBlock b = *this;
    b.q += static_cast<long long>(k) * Tr::BLOCK_M * p.q_row_stride;
    b.dout += static_cast<long long>(k) * Tr::BLOCK_M * p.do_row_stride;
    b.vec_row += k * Tr::BLOCK_M;
    b.m_block = m_block + k;
    return b;
  }
};

// This thread's part of every query block's loads (bwd_load_query_block), computed once: the chunks of
// the Q and dO copies and, for threads < BLOCK_M / 2, which 16 bytes of lse_log2 or delta it copies.
template <class Tr>
struct QueryBlockCopy {
  static constexpr int VEC_CHUNKS = Tr::BLOCK_M / 4;  // 16-byte chunks of BLOCK_M floats
  TileCopy<typename Tr::TileQ, Tr::THREADS> q, dout;
  const float* vec_gmem;  // lse_log2 or delta + this thread's 4 rows (add the block's first fp32 row)
  u32 vec_smem;           // their offset from smem_base (add the stage's)
  bool has_vec;

  __device__ __forceinline__ QueryBlockCopy(const BwdParams& p, int tid)
      : q(tid, p.q_row_stride), dout(tid, p.do_row_stride) {
    const bool is_delta = tid >= VEC_CHUNKS;
    const int c = is_delta ? tid - VEC_CHUNKS : tid;
    vec_gmem = (is_delta ? p.delta : p.lse_log2) + c * 4;
    vec_smem = (is_delta ? Tr::OFF_DELTA : Tr::OFF_LSE) + c * 16;
    has_vec = tid < 2 * VEC_CHUNKS;
  }
};

// Q_i, dO_i, lse_log2_i and delta_i of one query block into the given stage (one cp.async group's worth): Q_i and
// dO_i by the threads' TileCopy.
template <class Tr>
__device__ __forceinline__ void bwd_load_query_block(const BwdParams& p, u32 smem_base, int stage,
                                                     const QueryBlock<Tr>& qb, const QueryBlockCopy<Tr>& copy,
                                                     int len_q) {
  const int rows = min(Tr::BLOCK_M, len_q - qb.m_block * Tr::BLOCK_M);
  const u32 q_smem = smem_base + Tr::OFF_Q + stage * 2 * Tr::SMEM_Q;
  const u32 do_smem = smem_base + Tr::OFF_DO + stage * 2 * Tr::SMEM_Q;
  copy.q.load(q_smem, qb.q, p.q_row_stride, rows, p.head_dim);
  copy.dout.load(do_smem, qb.dout, p.do_row_stride, rows, p.head_dim);
  // lse_log2 and delta of the block: BLOCK_M floats each, 4 per 16-byte chunk (pad rows included)
  if (copy.has_vec)
    cp_async_cg_16(smem_base + copy.vec_smem + stage * 2 * Tr::SMEM_ROWVEC, copy.vec_gmem + qb.vec_row, true);
}

// The order of a deterministic backward's dQ additions (the ordered bwd_sm90_ws_kernel and bwd_wide_kernel): key
// block n's turn among those that add into the dQ of the query block whose first row is row0. Without a band every
// key block of the sequence, in ascending order (they reach the block together; the lower ones launch first); with
// causal or a window (BAND) the key blocks that see the block, a run [n_lo, n_hi], in descending order (the higher
// ones start at their diagonal, reach the block first, and launch first: their kernels launch key blocks
// last-first), so each waits only on CTAs that started before it. n_hi is the last key block whose first key a row
// of the block sees (its m_begin <= m; its m_end is past m since n's is): n_hi * BLOCK_N - diag - right <= row0 +
// BLOCK_M - 1 (right: 0 when causal), at most the sequence's last key block (last_block). reach: ordered_dq_reach.
template <int BLOCK_N, bool BAND>
__device__ __forceinline__ int ordered_dq_turn(int row0, int n, int last_block, int reach) {
  if (!BAND) return n;
  return min(last_block, (row0 + reach) / BLOCK_N) - n;
}
template <int BLOCK_M, bool IS_CAUSAL, bool HAS_WINDOW>
__device__ __forceinline__ int ordered_dq_reach(const Band<IS_CAUSAL, HAS_WINDOW>& band) {
  return BLOCK_M - 1 + band.diag + (HAS_WINDOW ? band.right : 0);
}

// The work of a K/V-outer CTA (bwd_kernel, bwd_sm90_kernel; grid (key blocks, K/V heads, batch)): keys
// n0 .. n0 + keys - 1 of K/V head kv_head of sequence batch and, for every query head of the group, the
// query blocks [m_begin, m_end) that see them. Prologue and epilogue of both kernels.
// HAS_MAP: the kernel takes a BlockMask's tile map (MOD_MASK or MOD_BLOCKS; mods.cuh TileMap), transposed so that
// the query tiles of one key tile are contiguous bytes: the steps whose tile the map marks empty are skipped.
// REVERSED: key block gridDim.x - 1 - blockIdx.x instead of blockIdx.x (the last key blocks launch first).
// SPLIT: CTAs per key block, blockIdx.x / SPLIT its index (a cluster of CTAs sharing the head dim: bwd_sm90_tf32.cuh)
// DIV_TEST: the map's address divides by its batch_div and head_div only where they are not 1 (broadcast_div: the
// warp-specialized kernels of a mask or a map alone, which compute it at every step)
template <class Tr, bool IS_CAUSAL, bool HAS_WINDOW, bool HAS_MAP = false, bool REVERSED = false, int SPLIT = 1,
          bool DIV_TEST = false>
struct BwdKeyBlock {
  static constexpr bool MAPPED = HAS_MAP;
  Seq seq;
  int batch, kv_head;
  int n0;              // first key of this CTA
  int keys;            // valid keys
  int diag;            // query i sees keys j <= i + diag
  Band<IS_CAUSAL, HAS_WINDOW> band;  // the visible (query, key) pairs (mask.cuh)
  int m_begin, m_end;  // query blocks of each query head that see these keys

  __device__ __forceinline__ explicit BwdKeyBlock(const BwdParams& p)
      : seq(sequence(p.seq, blockIdx.z)), batch(blockIdx.z), kv_head(blockIdx.y), n0(n_block() * Tr::BLOCK_N) {
    keys = min(Tr::BLOCK_N, seq.len_k - n0);
    diag = seq.len_k - seq.len_q;
    band = Band<IS_CAUSAL, HAS_WINDOW>{seq.len_k, diag, p.mods.window_left, p.mods.window_right};
    // the query blocks that see these keys (causal: key n0 is first seen by query n0 - diag; a window also
    // ends them); the others are skipped
    m_begin = band.query_begin(n0) / Tr::BLOCK_M;
    m_end = (band.query_end(n0 + keys - 1, seq.len_q) + Tr::BLOCK_M - 1) / Tr::BLOCK_M;
  }
  // this CTA's key block; reversed, it and the first key (key0) are read anew from the special registers wherever
  // they are used (computed once and kept through the query loop, they made the head-dim-128 warp-specialized
  // kernel spill 4-60 bytes)
  // (unsigned, as blockIdx.x: the unreversed kernels' index arithmetic stays what it was; sign-extended, ptxas
  // spilled 16 bytes in one of them)
  static __device__ __forceinline__ unsigned n_block() {
    static_assert(!REVERSED || SPLIT == 1, "a reversed grid of single CTAs");
    return REVERSED ? static_cast<unsigned>(nctaid_x_reread() - 1 - ctaid_x_reread()) : blockIdx.x / SPLIT;
  }
  __device__ __forceinline__ int key0() const { return REVERSED ? n_block() * Tr::BLOCK_N : n0; }

  // Key block n's turn on query block m's dQ in a deterministic backward (ordered_dq_turn); reach: dq_reach()
  static __device__ __forceinline__ int dq_turn(int m, int n, int last_block, int reach) {
    return ordered_dq_turn<Tr::BLOCK_N, IS_CAUSAL || HAS_WINDOW>(m * Tr::BLOCK_M, n, last_block, reach);
  }
  __device__ __forceinline__ int dq_reach() const { return ordered_dq_reach<Tr::BLOCK_M>(band); }
  __device__ __forceinline__ int last_key_block() const { return (seq.len_k + Tr::BLOCK_N - 1) / Tr::BLOCK_N - 1; }

  // (query head, query block) positions of the CTA: every query head of the group over [m_begin, m_end)
  __device__ __forceinline__ int steps(const BwdParams& p) const { return p.seq.kv_group * (m_end - m_begin); }
  // the positions whose tile a map does not mark empty (steps() without one; 0 if no query block sees these keys),
  // counted by the 32 lanes of a warp together (every lane must call it; each gets the count)
  __device__ __forceinline__ int visible_steps(const BwdParams& p, int lane) const {
    const int blocks = m_end - m_begin;
    if (blocks <= 0) return 0;
    if (!HAS_MAP || p.mods.block_map.ptr == nullptr) return steps(p);
    int n = 0;
#pragma unroll 1
    for (int h = 0; h < p.seq.kv_group; ++h) {
      const unsigned char* s = state_ptr(p, batch, kv_head * p.seq.kv_group + h, m_begin);
#pragma unroll 1
      for (int k = lane; k < blocks; k += 32) n += __ldg(s + k * p.mods.block_map.stride_q) != TILE_EMPTY;
    }
    return static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(n)));
  }

  // the block map's byte of query block qb (a map must be given); read from the params each time, so the map's
  // address takes no registers across the query loop
  __device__ __forceinline__ const unsigned char* state_ptr(const BwdParams& p, const QueryBlock<Tr>& qb) const {
    return state_ptr(p, batch, qb.head, qb.m_block);
  }
  static __device__ __forceinline__ const unsigned char* state_ptr(const BwdParams& p, int batch, int head,
                                                                   int m_block) {
    const Broadcast& b = p.mods.block_map;
    const int bq = DIV_TEST ? broadcast_div(batch, b.batch_div) : batch / b.batch_div;
    const int hq = DIV_TEST ? broadcast_div(head, b.head_div) : head / b.head_div;
    return static_cast<const unsigned char*>(b.ptr) + static_cast<long long>(bq) * b.stride_b +
           static_cast<long long>(n_block()) * b.stride_k + static_cast<long long>(hq) * b.stride_h +
           static_cast<long long>(m_block) * b.stride_q;
  }
  // the block map's state of query block qb (TILE_PARTIAL without a map)
  __device__ __forceinline__ int state(const BwdParams& p, const QueryBlock<Tr>& qb) const {
    if (!HAS_MAP || p.mods.block_map.ptr == nullptr) return TILE_PARTIAL;
    return __ldg(state_ptr(p, qb));
  }
  // Moves qb to the next position whose tile is not empty; `left` counts the positions from qb on (steps() at
  // the first). False when none is left. With a map, the rest of a query head is scanned from one address per
  // head: computing the address (two divisions) for every position made a sparse map's walk take about as long as
  // the steps it found (bf16, D 128, N 16k, 10 % of the tiles, on an H100). (Four states per round, independent
  // loads, spilled 8-72 bytes in the ws kernel.)
  __device__ __forceinline__ bool advance(const BwdParams& p, QueryBlock<Tr>& qb, int& left) const {
    if (!HAS_MAP || p.mods.block_map.ptr == nullptr) {
      if (--left <= 0) return false;
      qb = qb.next(p, m_begin, m_end);
      return true;
    }
    while (--left > 0) {
      qb = qb.next(p, m_begin, m_end);
      const unsigned char* s = state_ptr(p, qb);
      const int stride = p.mods.block_map.stride_q;
      const int room = min(left, m_end - qb.m_block);  // positions of this head from qb on
      int k = 0;
      while (k < room && __ldg(s + k * stride) == TILE_EMPTY) ++k;
      if (k < room) {
        qb = qb.skip(p, k);
        left -= k;
        return true;
      }
      qb = qb.skip(p, room - 1);  // the head's last position: the next round moves on to the next head
      left -= room - 1;
    }
    return false;
  }
  // the first position with a non-empty tile (left: the positions from it on, 0 if there is none)
  __device__ __forceinline__ QueryBlock<Tr> first_step(const BwdParams& p, int& left) const {
    QueryBlock<Tr> qb = QueryBlock<Tr>::first(p, seq, batch, kv_head * p.seq.kv_group, m_begin);
    left = steps(p);
    if (left > 0 && state(p, qb) == TILE_EMPTY && !advance(p, qb, left)) left = 0;
    return qb;
  }

  // row n0 of this CTA's K/V head in K, V, dK or dV
  template <class X>
  __device__ __forceinline__ X* key_rows(X* base, long long batch_stride, long long head_stride,
                                         long long row_stride) const {
    return base + batch * batch_stride + kv_head * head_stride + (static_cast<long long>(seq.k_row0) + n0) * row_stride;
  }

  // K_j, V_j and the first step's query block (first_step) into stage 0, one cp.async group
  __device__ __forceinline__ void load_first(const BwdParams& p, u32 smem_base, const QueryBlockCopy<Tr>& copy,
                                             int tid, const QueryBlock<Tr>& qb) const {
    load_tile_async<typename Tr::TileKV, Tr::THREADS>(
        smem_base + Tr::OFF_K, key_rows(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride), p.k_row_stride, keys,
        p.head_dim, tid);
    load_tile_async<typename Tr::TileKV, Tr::THREADS>(
        smem_base + Tr::OFF_V, key_rows(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride), p.v_row_stride, keys,
        p.head_dim, tid);
    bwd_load_query_block<Tr>(p, smem_base, 0, qb, copy, seq.len_q);
    cp_async_commit_group();
  }

  // The query loop of the synchronous wgmma K/V-outer kernel (bwd_sm90_kernel): the steps from qb (first_step;
  // `left` positions) in order, each first issuing the next step's loads into the other stage (one cp.async group)
  // and waiting for its own, then step(qb, stage, is_masked) between two CTA barriers.
  // is_masked: the step needs the band mask (the causal diagonal, a window edge) or this CTA holds the key tail.
  // (bwd_kernel keeps a loop of its own: its step is a template on is_masked, decided after the barrier; through
  // walk its SASS changed. bwd_sm90_split_kernel loads by TMA and waits on mbarriers: its own loop too.)
  template <class Step>
  __device__ __forceinline__ void walk(const BwdParams& p, u32 smem_base, const QueryBlockCopy<Tr>& copy,
                                       QueryBlock<Tr> qb, int left, Step&& step) const {
    const bool is_key_tail = keys < Tr::BLOCK_N;
    int stage = 0;
    for (;;) {
      QueryBlock<Tr> qb_next = qb;
      int left_next = left;
      const bool more = advance(p, qb_next, left_next);  // the next step (a block map skips empty tiles)
      const int m0 = qb.m_block * Tr::BLOCK_M;
      const bool is_masked = is_key_tail || band.needs_mask(m0, m0 + Tr::BLOCK_M - 1, n0, n0 + Tr::BLOCK_N - 1);
      if (more) bwd_load_query_block<Tr>(p, smem_base, stage ^ 1, qb_next, copy, seq.len_q);
      cp_async_commit_group();
      cp_async_wait_group<1>();
      fence_proxy_async_shared();  // the landed tiles are read by the tensor cores (async proxy)
      __syncthreads();
      step(qb, stage, is_masked);
      __syncthreads();
      if (!more) break;
      stage ^= 1;
      qb = qb_next;
      left = left_next;
    }
  }

  // dK_j and dV_j, staged in the K and V tiles, to global memory (valid keys only), by THREADS threads (tid < THREADS)
  template <int THREADS = Tr::THREADS>
  __device__ __forceinline__ void store_dk_dv(const BwdParams& p, const unsigned char* smem, int tid) const {
    store_tile<typename Tr::TileKV, THREADS>(key_rows(p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride),
                                             p.dk_row_stride, smem + Tr::OFF_K, keys, p.head_dim, tid);
    store_tile<typename Tr::TileKV, THREADS>(key_rows(p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride),
                                             p.dv_row_stride, smem + Tr::OFF_V, keys, p.head_dim, tid);
  }

  // dK_j = dV_j = 0 (no query sees these keys)
  __device__ __forceinline__ void zero_dk_dv(const BwdParams& p, int tid) const {
    zero_tile_gmem<typename Tr::TileKV, Tr::THREADS>(key_rows(p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride),
                                                     p.dk_row_stride, keys, p.head_dim, tid);
    zero_tile_gmem<typename Tr::TileKV, Tr::THREADS>(key_rows(p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride),
                                                     p.dv_row_stride, keys, p.head_dim, tid);
  }
};

// The epilogue's staging of a K/V-outer backward: dK * softmax_scale into the K tile and dV (scaled by the caller for
// dropout) into the V tile, this warp's 16 keys from key_row0 and DKV_TILES n8 tiles of columns from col0, in the
// input dtype; the caller synchronizes before the K tile is overwritten (no dQ GEMM may still read it) and before
// store_dk_dv reads the tiles.
template <class Tr>
__device__ __forceinline__ void bwd_stage_dk_dv(const BwdParams& p, unsigned char* smem, int key_row0, int col0, int lane,
                                                const float (&dk_acc)[Tr::DKV_TILES][4],
                                                const float (&dv_acc)[Tr::DKV_TILES][4]) {
  using T = typename Tr::T;
  const int t = lane & 3, g = lane >> 2;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int dt = 0; dt < Tr::DKV_TILES; ++dt) {
      const u32 off = Tr::TileKV::offset(key_row0 + g + 8 * h, col0 + dt * 8 + 2 * t);
      *reinterpret_cast<u32*>(smem + Tr::OFF_K + off) =
          Cvt<T>::pack(dk_acc[dt][2 * h] * p.softmax_scale, dk_acc[dt][2 * h + 1] * p.softmax_scale);
      *reinterpret_cast<u32*>(smem + Tr::OFF_V + off) = Cvt<T>::pack(dv_acc[dt][2 * h], dv_acc[dt][2 * h + 1]);
    }
}

template <class Tr, bool IS_CAUSAL, bool IS_DETERMINISTIC, int MODS>
__global__ void __launch_bounds__(Tr::THREADS) bwd_kernel(const BwdParams p) {
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const BwdKeyBlock<Tr, IS_CAUSAL, HAS_WINDOW, ScoreMods<MODS>::HAS_MASK> kb(p);
  if (kb.n0 >= kb.seq.len_k) return;  // varlen: past this sequence's keys
  int left;                           // (query head, query block) positions from qb on
  QueryBlock<Tr> qb = kb.first_step(p, left);
  if (kb.m_begin >= kb.m_end || left == 0) {  // no query sees these keys: dK = dV = 0
    kb.zero_dk_dv(p, tid);
    return;
  }
  const u32 smem_base = smem_u32(smem);
  const QueryBlockCopy<Tr> copy(p, tid);
  kb.load_first(p, smem_base, copy, tid, qb);

  float dk_acc[Tr::DKV_TILES][4], dv_acc[Tr::DKV_TILES][4];
#pragma unroll
  for (int dt = 0; dt < Tr::DKV_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk_acc[dt][c] = dv_acc[dt][c] = 0.f;

  // (query head, query block) steps in order; each first issues the next step's loads. A step needs the
  // mask on the causal diagonal, or always when this CTA holds the key tail.
  const bool is_key_tail = kb.keys < Tr::BLOCK_N;
  int stage = 0;
  for (;;) {
    QueryBlock<Tr> qb_next = qb;
    int left_next = left;
    const bool more = kb.advance(p, qb_next, left_next);  // the next step (a block map skips empty tiles)
    if (more) bwd_load_query_block<Tr>(p, smem_base, stage ^ 1, qb_next, copy, kb.seq.len_q);
    cp_async_commit_group();
    cp_async_wait_group<1>();
    __syncthreads();
    ScoreMods<MODS> mods;
    mods.init(p.mods, kb.batch, qb.head, p.heads, kb.seq.len_q, kb.seq.len_k);
    if (ScoreMods<MODS>::HAS_MASK) mods.check_mask = kb.state(p, qb) != TILE_FULL;
    const int m0 = qb.m_block * Tr::BLOCK_M;
    if (is_key_tail || kb.band.needs_mask(m0, m0 + Tr::BLOCK_M - 1, kb.n0, kb.n0 + Tr::BLOCK_N - 1))
      bwd_query_block<Tr, IS_CAUSAL, IS_DETERMINISTIC, /*IS_MASKED=*/true, MODS>(
          p, kb.band, mods, smem, smem_base, stage, qb.m_block, kb.n0, qb.vec_row, warp, lane, dk_acc, dv_acc);
    else
      bwd_query_block<Tr, IS_CAUSAL, IS_DETERMINISTIC, /*IS_MASKED=*/false, MODS>(
          p, kb.band, mods, smem, smem_base, stage, qb.m_block, kb.n0, qb.vec_row, warp, lane, dk_acc, dv_acc);
    __syncthreads();
    if (!more) break;
    stage ^= 1;
    qb = qb_next;
    left = left_next;
  }

  // epilogue: dK = softmax_scale * dK (dV * 1 / (1 - p) with dropout); stage dK in the K tile and dV in the V
  // tile, 16-byte stores
  if (ScoreMods<MODS>::HAS_DROPOUT) scale_acc(dv_acc, p.mods.dropout_rp);
  bwd_stage_dk_dv<Tr>(p, smem, (warp / Tr::D_SPLIT) * 16, (warp % Tr::D_SPLIT) * Tr::DKV_COLS, lane, dk_acc, dv_acc);
  __syncthreads();
  kb.store_dk_dv(p, smem, tid);
}

// ---- 3. dQ = softmax_scale * dQ_acc, to the input dtype and layout --------------------------
constexpr int CONVERT_THREADS = 256;

template <class T>
__global__ void __launch_bounds__(CONVERT_THREADS) bwd_convert_dq_kernel(const BwdParams p) {
  const int head = blockIdx.y, batch = blockIdx.z;
  const Seq seq = sequence(p.seq, batch);
  const int chunks_per_row = p.head_dim / 8;
  const int idx = blockIdx.x * CONVERT_THREADS + threadIdx.x;
  const int row = idx / chunks_per_row, col = (idx % chunks_per_row) * 8;
  if (row >= seq.len_q) return;
  const float* src = p.dq_accum + (padded_row0(p.seq, batch, head, p.heads, p.seqlen_q_pad) + row) * p.dq_accum_cols + col;
  const float4 a = *reinterpret_cast<const float4*>(src), b = *reinterpret_cast<const float4*>(src + 4);
  const float s = p.softmax_scale;
  const uint4 out = make_uint4(Cvt<T>::pack(a.x * s, a.y * s), Cvt<T>::pack(a.z * s, a.w * s),
                               Cvt<T>::pack(b.x * s, b.y * s), Cvt<T>::pack(b.z * s, b.w * s));
  *reinterpret_cast<uint4*>(p.dq + batch * p.dq_batch_stride + head * p.dq_head_stride +
                            static_cast<long long>(seq.q_row0 + row) * p.dq_row_stride + col) = out;
}

// ---- 3b. deterministic dQ, Q-outer ----------------------------------------------------------
template <class Tr, bool IS_CAUSAL, bool IS_MASKED, int MODS>
__device__ __forceinline__ void bwd_dq_key_tile(const BwdParams& p, const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                                const ScoreMods<MODS>& mods, int n_block, u32 q_smem,
                                                u32 do_smem, u32 k_smem,
                                                u32 v_smem, int warp_row0, int row0, int lane,
                                                const float (&lse_log2)[Tr::M_TILES][2],
                                                const float (&delta)[Tr::M_TILES][2],
                                                float (&dq_acc)[Tr::M_TILES][Tr::D_TILES][4]) {
  using T = typename Tr::T;
  float s_acc[Tr::M_TILES][Tr::N_TILES][4], dp_acc[Tr::M_TILES][Tr::N_TILES][4];
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tr::N_TILES; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) s_acc[mt][nt][c] = dp_acc[mt][nt][c] = 0.f;

  // S = Q K^T and dP = dO V^T, sharing the k-loop over the head dim
#pragma unroll
  for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk) {
    u32 q_regs[Tr::M_TILES][4], do_regs[Tr::M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < Tr::M_TILES; ++mt) {
      ldmatrix_a<typename Tr::TileQ>(q_regs[mt], q_smem, warp_row0 + mt * 16, kk * 16, lane);
      ldmatrix_a<typename Tr::TileQ>(do_regs[mt], do_smem, warp_row0 + mt * 16, kk * 16, lane);
    }
#pragma unroll
    for (int np = 0; np < Tr::N_TILES / 2; ++np) {
      u32 k_regs[4], v_regs[4];
      ldmatrix_b_nk<typename Tr::TileKV>(k_regs, k_smem, np * 16, kk * 16, lane);
      ldmatrix_b_nk<typename Tr::TileKV>(v_regs, v_smem, np * 16, kk * 16, lane);
#pragma unroll
      for (int mt = 0; mt < Tr::M_TILES; ++mt) {
        Mma<T>::m16n8k16(s_acc[mt][2 * np], q_regs[mt], k_regs[0], k_regs[1]);
        Mma<T>::m16n8k16(s_acc[mt][2 * np + 1], q_regs[mt], k_regs[2], k_regs[3]);
        Mma<T>::m16n8k16(dp_acc[mt][2 * np], do_regs[mt], v_regs[0], v_regs[1]);
        Mma<T>::m16n8k16(dp_acc[mt][2 * np + 1], do_regs[mt], v_regs[2], v_regs[3]);
      }
    }
  }
  using Mods = ScoreMods<MODS>;
  const int col0 = n_block * Tr::BLOCK_N;
  float dcap[Tr::M_TILES][Tr::N_TILES][4];  // the softcap's d score / d raw score (dead without the softcap)
  apply_score_mods(s_acc, dcap, row0 + warp_row0, col0, band.diag, mods, lane);
  if (IS_MASKED)
    apply_band_mask<IS_CAUSAL, Mods::HAS_WINDOW>(s_acc, row0 + warp_row0, col0, band, lane);

  // P = exp2(S * scale_log2 - lse_log2); dS = P * (dP - delta) (dropout and softcap: ds_of)
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tr::N_TILES; ++nt) {
      u32 keep = ~0u;
      if constexpr (Mods::HAS_DROPOUT)
        keep = mods.template keep_bits<false>(row0 + warp_row0 + mt * 16 + g, col0 + nt * 8 + 2 * t, lane);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float prob = ex2_approx(fmaf(s_acc[mt][nt][c], p.scale_log2, -lse_log2[mt][c >> 1]));
        if constexpr (MODS == 0)
          dp_acc[mt][nt][c] = prob * (dp_acc[mt][nt][c] - delta[mt][c >> 1]);
        else
          dp_acc[mt][nt][c] = ds_of<MODS>(prob, dp_acc[mt][nt][c], delta[mt][c >> 1], (keep >> c) & 1,
                                          p.mods.dropout_rp, Mods::HAS_SOFTCAP ? dcap[mt][nt][c] : 1.f);
      }
    }

  // dQ += dS K: A = dS from the accumulators, B = K [key][d] read transposed
#pragma unroll
  for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) {
    u32 ds_regs[Tr::M_TILES][4];
#pragma unroll
    for (int mt = 0; mt < Tr::M_TILES; ++mt) {
      ds_regs[mt][0] = Cvt<T>::pack(dp_acc[mt][2 * kk][0], dp_acc[mt][2 * kk][1]);
      ds_regs[mt][1] = Cvt<T>::pack(dp_acc[mt][2 * kk][2], dp_acc[mt][2 * kk][3]);
      ds_regs[mt][2] = Cvt<T>::pack(dp_acc[mt][2 * kk + 1][0], dp_acc[mt][2 * kk + 1][1]);
      ds_regs[mt][3] = Cvt<T>::pack(dp_acc[mt][2 * kk + 1][2], dp_acc[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < Tr::D_TILES / 2; ++dp) {
      u32 k_regs[4];
      ldmatrix_b_kn_trans<typename Tr::TileKV>(k_regs, k_smem, kk * 16, dp * 16, lane);
#pragma unroll
      for (int mt = 0; mt < Tr::M_TILES; ++mt) {
        Mma<T>::m16n8k16(dq_acc[mt][2 * dp], ds_regs[mt], k_regs[0], k_regs[1]);
        Mma<T>::m16n8k16(dq_acc[mt][2 * dp + 1], ds_regs[mt], k_regs[2], k_regs[3]);
      }
    }
  }
}

template <class Tr, bool IS_CAUSAL, int MODS>
__global__ void __launch_bounds__(Tr::THREADS) bwd_dq_kernel(const BwdParams p) {
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  extern __shared__ __align__(1024) unsigned char smem[];
  using T = typename Tr::T;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m_block = IS_CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  const Seq seq = sequence(p.seq, batch);
  const int row0 = m_block * Tr::BLOCK_M;
  if (row0 >= seq.len_q) return;  // varlen: past this sequence's end
  const int rows_q = min(Tr::BLOCK_M, seq.len_q - row0);
  const int diag = seq.len_k - seq.len_q;
  const int warp_row0 = warp * Tr::WARP_ROWS;
  const int kv_head = head / p.seq.kv_group;
  const long long vec_off = padded_row0(p.seq, batch, head, p.heads, p.seqlen_q_pad);

  const long long q_row = static_cast<long long>(seq.q_row0) + row0;
  const u16* q_gmem = p.q + batch * p.q_batch_stride + head * p.q_head_stride + q_row * p.q_row_stride;
  const u16* do_gmem = p.dout + batch * p.do_batch_stride + head * p.do_head_stride + q_row * p.do_row_stride;
  const u16* k_gmem = p.k + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                      static_cast<long long>(seq.k_row0) * p.k_row_stride;
  const u16* v_gmem = p.v + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                      static_cast<long long>(seq.k_row0) * p.v_row_stride;
  // dQ of this CTA's rows (a function: computed anew after the key loop, not kept live through it)
  auto dq_rows = [&](long long first_row) {
    return p.dq + batch * p.dq_batch_stride + head * p.dq_head_stride + first_row * p.dq_row_stride;
  };

  // key tiles [n_begin, n_end): tiles outside the causal / window band are skipped
  const Band<IS_CAUSAL, HAS_WINDOW> band{seq.len_k, diag, p.mods.window_left, p.mods.window_right};
  const int n_begin = band.template key_block_begin<Tr::BLOCK_N>(row0);
  const int n_end = band.template key_block_end<Tr::BLOCK_N>(row0 + rows_q - 1);
  if (n_end <= n_begin) {  // rows that see no key have no gradient
    zero_tile_gmem<typename Tr::TileQ, Tr::THREADS>(dq_rows(q_row), p.dq_row_stride, rows_q, p.head_dim, tid);
    return;
  }

  const u32 q_smem = smem_u32(smem), do_smem = q_smem + Tr::SMEM_Q;
  const u32 k_smem0 = q_smem + 2 * Tr::SMEM_Q, v_smem0 = k_smem0 + 2 * Tr::SMEM_KV;
  int n_block = n_end - 1;
  load_tile_async<typename Tr::TileQ, Tr::THREADS>(q_smem, q_gmem, p.q_row_stride, rows_q, p.head_dim, tid);
  load_tile_async<typename Tr::TileQ, Tr::THREADS>(do_smem, do_gmem, p.do_row_stride, rows_q, p.head_dim, tid);
  load_tile_async<typename Tr::TileKV, Tr::THREADS>(k_smem0, k_gmem + n_block * Tr::BLOCK_N * p.k_row_stride,
                                                    p.k_row_stride, seq.len_k - n_block * Tr::BLOCK_N, p.head_dim, tid);
  load_tile_async<typename Tr::TileKV, Tr::THREADS>(v_smem0, v_gmem + n_block * Tr::BLOCK_N * p.v_row_stride,
                                                    p.v_row_stride, seq.len_k - n_block * Tr::BLOCK_N, p.head_dim, tid);
  cp_async_commit_group();

  // this thread's rows: lse_log2 and delta from the preprocess (pad rows: +inf and 0)
  float lse_log2[Tr::M_TILES][2], delta[Tr::M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long r = vec_off + row0 + warp_row0 + mt * 16 + g + 8 * h;
      lse_log2[mt][h] = p.lse_log2[r];
      delta[mt][h] = p.delta[r];
    }
  float dq_acc[Tr::M_TILES][Tr::D_TILES][4];
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
      for (int c = 0; c < 4; ++c) dq_acc[mt][dt][c] = 0.f;

  ScoreMods<MODS> mods;
  mods.init(p.mods, batch, head, p.heads, seq.len_q, seq.len_k);
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
    cp_async_commit_group();
    cp_async_wait_group<1>();
    __syncthreads();
    bwd_dq_key_tile<Tr, IS_CAUSAL, IS_MASKED, MODS>(p, band, mods, n_block, q_smem, do_smem,
                                                    k_smem0 + stage * Tr::SMEM_KV, v_smem0 + stage * Tr::SMEM_KV,
                                                    warp_row0, row0, lane, lse_log2, delta, dq_acc);
    __syncthreads();
    stage ^= 1;
  };
  // as in the forward: right-edge masked tiles, unmasked ones, the window's left edge masked again
  const int row_last = row0 + rows_q - 1;
  for (; n_block >= n_begin && band.needs_mask_right(row0, (n_block + 1) * Tr::BLOCK_N - 1); --n_block)
    step(BoolTag<true>());
  if (HAS_WINDOW) {  // one loop: a third inlined body spilled at HEAD_DIM 256
    for (; n_block >= n_begin; --n_block) {
      if (band.needs_mask_left(row_last, n_block * Tr::BLOCK_N))
        step(BoolTag<true>());
      else
        step(BoolTag<false>());
    }
  } else {
    for (; n_block >= n_begin; --n_block) step(BoolTag<false>());
  }

  // epilogue: dQ = softmax_scale * dQ -> shared (Q tile, own rows) -> 16-byte stores
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int dt = 0; dt < Tr::D_TILES; ++dt)
        *reinterpret_cast<u32*>(smem + Tr::TileQ::offset(warp_row0 + mt * 16 + g + 8 * h, dt * 8 + 2 * t)) =
            Cvt<T>::pack(dq_acc[mt][dt][2 * h] * p.softmax_scale, dq_acc[mt][dt][2 * h + 1] * p.softmax_scale);
  __syncthreads();
  store_tile<typename Tr::TileQ, Tr::THREADS>(dq_rows(opaque(seq.q_row0) + static_cast<long long>(row0)),
                                              p.dq_row_stride, smem, rows_q, p.head_dim, tid);
}

}  // namespace cuflash
