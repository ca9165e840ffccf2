// bwd_sm90.cuh: FlashAttention-2 backward main kernel (Dao 2023, Algorithm 2) on Hopper warpgroup
// MMA (sm_90a). The preprocess, dQ conversion and deterministic dQ kernels are bwd.cuh's.
//
// One CTA owns BLOCK_N keys and loops over query blocks of BLOCK_M = 64 rows, as bwd_kernel does; each
// warpgroup owns 64 of the keys, i.e. 64 rows of dK and dV in registers. Per query block:
//   S^T = K_j Q_i^T, dP^T = V_j dO_i^T      wgmma, A (K or V rows) and B (Q or dO) from shared memory
//   P^T = exp2(S^T * scale_log2 - lse_log2), dS^T = P^T * (dP^T - delta)     in the accumulators
//   dV += P^T dO_i, dK += dS^T Q_i          wgmma, A from registers, B (dO, Q) N-major from shared
//   dQ_i += dS K_j                          dS^T -> shared, read M-major; K N-major; fp32 atomics
// The K-outer order keeps dK, dV on chip for the whole query loop; the transposed products leave P^T and
// dS^T in the accumulator layout that the next two products take as their A registers.
#pragma once
#include "ptx.cuh"
#include "ptx_wgmma.cuh"
#include "traits.cuh"
#include "tiles.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "bwd.cuh"

namespace cuflash {

// One k16 step's A registers (keys x the step's 16 queries) from two n8 accumulator tiles x[0], x[1] of values: each
// pair of adjacent elements packed into the input dtype, in the register order of the k16 A layout
template <class T>
__device__ __forceinline__ void pack_k16_a(const float (&x)[2][4], u32 (&a)[4]) {
  a[0] = Cvt<T>::pack(x[0][0], x[0][1]);
  a[1] = Cvt<T>::pack(x[0][2], x[0][3]);
  a[2] = Cvt<T>::pack(x[1][0], x[1][1]);
  a[3] = Cvt<T>::pack(x[1][2], x[1][3]);
}

// P^T of k16 step kk (the queries of n8 tiles 2 kk, 2 kk + 1) from the modified scores s (ScoreMods applied, masked
// scores -inf): pv, the kept P^T (dV's A operand: dropped elements 0), and ps, P^T undropped times the softcap's
// derivative (dS^T's factor; ps = pv without dropout and softcap). P^T = exp2(s * scale_log2 - lse_log2[query]);
// keep: dropout_keep_transposed's bits; g_key: this thread's first key (the second is + 8).
template <int MODS, int Q_TILES>
__device__ __forceinline__ void bwd_probs_step(const float (&s)[Q_TILES][4], int kk, const float* lse_log2_smem,
                                               float scale_log2, u32 keep, const ScoreMods<MODS>& mods, int m0,
                                               int g_key, int diag, int lane, float (&pv)[2][4], float (&ps)[2][4]) {
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float2 lse2 = *reinterpret_cast<const float2*>(lse_log2_smem + (2 * kk + j) * 8 + 2 * t);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int qt = 2 * kk + j;
      const float prob = ex2_approx(fmaf(s[qt][c], scale_log2, (c & 1) ? -lse2.y : -lse2.x));
      pv[j][c] = (!ScoreMods<MODS>::HAS_DROPOUT || ((keep >> (4 * qt + c)) & 1)) ? prob : 0.f;
      ps[j][c] = prob;
      if (ScoreMods<MODS>::HAS_SOFTCAP)
        ps[j][c] = prob == 0.f ? 0.f
                               : prob * mods.softcap_grad(s[qt][c], m0 + qt * 8 + 2 * t + (c & 1), g_key + 8 * (c >> 1),
                                                          diag);
    }
  }
}

// S^T = K_j Q_i^T and dP^T = V_j dO_i^T of one query block for one warpgroup (its 64 keys x BLOCK_M queries), each
// its own wgmma commit group (S^T first), not waited for: bwd_sm90_dkdv_step takes them from here. This warp holds
// keys key_row0 + g (+8), queries 8 * qt + 2t (+1) of each n8 tile qt. Reads K, V and Q, dO of `stage`.
template <class Tr>
__device__ __forceinline__ void bwd_sm90_issue_sdp(u32 smem_base, int stage, int warpgroup,
                                                   float (&s_acc)[Tr::Q_TILES][4], float (&dp_acc)[Tr::Q_TILES][4]) {
  using T = typename Tr::T;
  const u32 q_smem = smem_base + Tr::OFF_Q + stage * 2 * Tr::SMEM_Q;
  const u32 do_smem = smem_base + Tr::OFF_DO + stage * 2 * Tr::SMEM_Q;
  // this warpgroup's 64 key rows of K and V: whole swizzle atoms, the descriptors start there
  const u32 k_smem_wg = smem_base + Tr::OFF_K + Tr::TileKV::offset(warpgroup * 64, 0);
  const u32 v_smem_wg = smem_base + Tr::OFF_V + Tr::TileKV::offset(warpgroup * 64, 0);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk)
    Wgmma<Tr::BLOCK_M, T>::template ss</*TRANS_A=*/0, /*TRANS_B=*/0>(
        s_acc, Tr::TileKV::desc_k_major(k_smem_wg, 0, kk * 16), Tr::TileQ::desc_k_major(q_smem, 0, kk * 16),
        /*scale_d=*/kk > 0);
  wgmma_commit_group();
#pragma unroll
  for (int kk = 0; kk < Tr::QK_K_STEPS; ++kk)
    Wgmma<Tr::BLOCK_M, T>::template ss</*TRANS_A=*/0, /*TRANS_B=*/0>(
        dp_acc, Tr::TileKV::desc_k_major(v_smem_wg, 0, kk * 16), Tr::TileQ::desc_k_major(do_smem, 0, kk * 16),
        /*scale_d=*/kk > 0);
  wgmma_commit_group();
}

// Whether the bias of this step is staged in shared memory (bwd_sm90_dkdv_step): Tr::stage_bias and a bias in the
// input dtype (the one 16-bit dtype the host allows beside float32) with contiguous, 16-byte aligned rows (decided
// per call; the caller of bwd_stage_bias and the step agree).
template <class Tr, bool IS_CAUSAL, int MODS>
__device__ __forceinline__ bool bwd_bias_staged(const ScoreMods<MODS>& mods) {
  return Tr::stage_bias(MODS, IS_CAUSAL) && mods.bias_kind == Cvt<typename Tr::T>::BIAS_KIND && mods.bias_k == 2 &&
         mods.bias_q % 16 == 0 && reinterpret_cast<unsigned long long>(mods.bias_base) % 16 == 0;
}

// One warp's staged bias of one step: its 16 keys from key0 of the BLOCK_M query rows from m0, into `rows`
// (a shared address; cp.async, two 16-byte chunks per row in Tr::bias_offset's layout; a key tail zero-filled), one
// commit group. The warp-specialized consumer issues it a step ahead, into the other of two buffers.
template <class Tr, int MODS>
__device__ __forceinline__ void bwd_stage_bias(const ScoreMods<MODS>& mods, u32 rows, int m0, int key0, int lane) {
  __syncwarp();  // every lane has read what the buffer held two steps ago
#pragma unroll
  for (int i = lane; i < 2 * Tr::BLOCK_M; i += 32) {
    const int r = i >> 1, key = key0 + 8 * (i & 1);
    const int bytes = max(0, min(16, 2 * (mods.last_k + 1 - key)));
    const unsigned char* row = mods.bias_base + min(m0 + r, mods.last_q) * mods.bias_q;
    cp_async_cg_16_n(rows + Tr::bias_offset(r, i & 1), bytes > 0 ? row + 2 * key : row, bytes);
  }
  cp_async_commit_group();
}

// The dK / dV part of one query block for one warpgroup (see the file comment), shared by bwd_sm90_kernel and
// the warp-specialized bwd_sm90_ws_kernel (bwd_sm90_ws.cuh), after bwd_sm90_issue_sdp issued S^T and dP^T into
// s_acc, dp_acc as the last two wgmma groups: P^T, dV += P^T dO, dS^T, dK += dS^T Q. Each step starts as soon as
// its operand is done while the next product runs. Returns with dV and dK issued as the last two wgmma groups (not
// waited for) and dS^T in ds_regs (the A layout of the k16 steps over the block's queries). is_masked: apply the
// causal / key-tail mask to S^T. Reads from shared memory: Q, dO, lse_log2, delta of `stage` (Tr's offsets +
// stage strides). A staged bias (bwd_bias_staged: the warp-specialized kernel's) is read from its buffer bias_buf;
// bias_next_pending: the next step's copies are in flight behind it. ps_stash (STASH_PS, the warp-specialized
// kernel's): the byte offset of 2 KB of shared memory that only this warp touches until it stores dS^T, where
// the softcap's P^T copy for dS^T (P^T times the softcap's derivative) is parked between the two loops at head
// dim 128 (STASH, DV_FIRST below).
template <class Tr, bool IS_CAUSAL, int MODS, bool STASH_PS = false>
__device__ __forceinline__ void bwd_sm90_dkdv_step(const BwdParams& p, bool is_masked,
                                                   const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                                   const ScoreMods<MODS>& mods, unsigned char* smem, u32 smem_base,
                                                   int stage, int m_block, int n0, int warpgroup, int warp, int lane,
                                                   float (&s_acc)[Tr::Q_TILES][4], float (&dp_acc)[Tr::Q_TILES][4],
                                                   float (&dk_acc)[Tr::DKV_TILES][4], float (&dv_acc)[Tr::DKV_TILES][4],
                                                   u32 (&ds_regs)[Tr::Q_K_STEPS][4], int bias_buf = 0,
                                                   bool bias_next_pending = false, int ps_stash = 0) {
  using T = typename Tr::T;
  using Mods = ScoreMods<MODS>;
  // dS needs P^T undropped and times the softcap's derivative: a second packed copy when dV's differs. With a
  // bias, dS is an output (dBias, summed over many rows when the bias is broadcast): it is computed from P^T in
  // fp32, kept in s_acc (dead otherwise once P^T is packed), instead of the packed copy.
  constexpr bool FP32_P = Mods::HAS_BIAS;
  constexpr bool HAS_PS = (Mods::HAS_DROPOUT || Mods::HAS_SOFTCAP) && !FP32_P;
  // At head dim 128 dK and dV hold 128 of the 240 registers a warp-specialized consumer has: the softcap's second
  // packed copy (16 registers) is stored to shared memory after the probabilities and read back by the dS^T loop
  // (each thread its own 16-byte chunk per k16 step, consecutive lanes consecutive chunks: no bank conflict), so
  // that dV still runs under dS^T; held in registers, it made the step wait for dV first (DV_FIRST). Dropout's
  // copy stays in registers: parked the same way, the kernel spilled 8-16 bytes (NVRTC 13.0 and 13.5).
  constexpr bool STASH = STASH_PS && HAS_PS && Mods::HAS_SOFTCAP && !Mods::HAS_DROPOUT && Tr::HEAD_DIM >= 128;
  const int t = lane & 3, g = lane >> 2;
  const int key_row0 = warpgroup * 64 + (warp % 4) * 16;  // this warp's first key row in the tile
  const int m0 = m_block * Tr::BLOCK_M;
  const u32 q_smem = smem_base + Tr::OFF_Q + stage * 2 * Tr::SMEM_Q;
  const u32 do_smem = smem_base + Tr::OFF_DO + stage * 2 * Tr::SMEM_Q;
  const float* lse_log2_smem = reinterpret_cast<const float*>(smem + Tr::OFF_LSE + stage * 2 * Tr::SMEM_ROWVEC);
  const float* delta_smem = reinterpret_cast<const float*>(smem + Tr::OFF_DELTA + stage * 2 * Tr::SMEM_ROWVEC);

  // The bias of this warp's S^T tile (its 16 keys of the block's 64 query rows): where it is staged
  // (bwd_bias_staged), the caller has copied it to shared memory buffer bias_buf a step ahead (bwd_stage_bias; with
  // bias_next_pending the next step's copy group is in flight behind it) and it is read from there; otherwise the
  // bias (and the mask) are pulled into L1 for the element loads after the S^T GEMM. Element loads straight from
  // the bias touched 4 rows' lines per warp load and cost the backward ~3x its plain time; copies issued under this
  // step's own S^T GEMM waited for their L2 latency. Dropout's keep bits of these elements (bit qt * 4 + c)
  // meanwhile.
  constexpr bool STAGE = Tr::stage_bias(MODS, IS_CAUSAL);
  const u32 bias_rows =
      smem_base + Tr::OFF_BIAS + bias_buf * Tr::SMEM_BIAS + (key_row0 / 16) * Tr::BLOCK_M * Tr::BIAS_PITCH;
  const bool staged = bwd_bias_staged<Tr, IS_CAUSAL>(mods);
  const u32 keep = dropout_keep_transposed<MODS, Tr::Q_TILES>(n0 + key_row0, m0, mods, lane);
  // A mask alone (a window aside): its bits by mask_keep_transposed at every head dim (a word per 64 queries),
  // applied only on tiles that read the mask. Through the per-score path (apply_score_mods_transposed) each score
  // kept a branch on check_mask and, on partial tiles, a byte load of its own.
  constexpr bool MASK_ONLY = Mods::HAS_MASK && !(MODS & ~(MOD_MASK | MOD_WINDOW));
  // A staged bias and a mask (a window aside; Evoformer's pair bias and MSA mask): the bias as alone, then the
  // mask's bits where the tile reads the mask; per score, each kept its branch on check_mask and a byte load.
  constexpr bool BIAS_MASK = STAGE && Mods::HAS_MASK && !(MODS & ~(MOD_BIAS | MOD_MASK | MOD_WINDOW));
  constexpr bool MASK_BITS = Mods::HAS_MASK && ((!Mods::HAS_BIAS && (Tr::HEAD_DIM >= 128 || MASK_ONLY)) || BIAS_MASK);
  constexpr int MASK_WORDS = MASK_BITS ? (Tr::Q_TILES + 7) / 8 : 1;  // 8 query tiles per word
  static_assert(!MASK_BITS || Tr::Q_TILES % MASK_WORDS == 0, "whole words of mask bits");
  if ((Mods::HAS_BIAS && !staged) || (Mods::HAS_MASK && (!(MASK_ONLY || BIAS_MASK) || mods.check_mask)))
    mods.template prefetch_cols<Tr::BLOCK_M>(n0 + key_row0, m0, lane);
  u32 mask_bits[MASK_WORDS] = {~0u};  // (instantiated where used only)
  if constexpr (MASK_BITS) {
#pragma unroll
    for (int w = 0; w < MASK_WORDS; ++w)
      mask_bits[w] = mask_keep_transposed<MODS, Tr::Q_TILES / MASK_WORDS>(
          n0 + key_row0, m0 + w * 8 * (Tr::Q_TILES / MASK_WORDS), mods, lane);
  }
  wgmma_wait_group<1>();  // S^T is done (dP^T may still run)
  wgmma_fence_operand(s_acc);
  // the scores the mask's bits clear (a mask alone, or beside a staged bias), on tiles that read the mask
  auto clear_masked = [&]() {
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (!((mask_bits[qt / 8] >> (4 * (qt % 8) + c)) & 1u)) s_acc[qt][c] = neg_inf();
  };

  // softcap, ALiBi (mods.cuh); causal diagonal, window, key tail: masked scores = -inf, so P = 0 there
  float unused_dcap[Tr::Q_TILES][4];  // recovered from the modified score below (softcap_grad): fewer registers
  if (STAGE) {
    // ldmatrix .trans of the staged rows hands each thread its elements in the S^T layout, two per register: of
    // 8 x 8 block (queries qt * 8.., keys 8 h..), queries 2t, 2t + 1 of key g. One x4 load per two query tiles
    // (lanes 8m .. 8m + 7 address block m's rows: query tile 2j + m / 2, key half m % 2).
    // Each load just before its query tiles (.x2 at head dim 128, one tile: 2 live registers; loading all 16 first
    // spilled there).
    // staged or not is decided per load, not per score: tested per score, the branch and the dtype test took 5
    // instructions per score where the staged bias needs 2
    auto modify = [&](int qt, int c, float b) {
      const int query = m0 + qt * 8 + 2 * t + (c & 1), key = n0 + key_row0 + g + 8 * (c >> 1);
      const bool kept = BIAS_MASK || !(Mods::HAS_MASK && mods.check_mask) || mods.kept_by_mask(query, key);
      s_acc[qt][c] = mods.score_of(s_acc[qt][c], query, key, band.diag, unused_dcap[qt][c], b, kept);
    };
    if (staged) {
      if (bias_next_pending)
        cp_async_wait_group<1>();
      else
        cp_async_wait_group<0>();
      __syncwarp();  // the other lanes' chunks have landed too
    }
    constexpr int QT_PER_LOAD = Tr::HEAD_DIM > 64 ? 1 : 2;  // x2 loads at head dim 128: 2 live registers
#pragma unroll
    for (int j = 0; j < Tr::Q_TILES / QT_PER_LOAD; ++j) {
      // (a branch per load: in one straight run of code ptxas moved all loads to the front, and spilled)
      if (staged) {
        u32 pairs[2 * QT_PER_LOAD];
        const u32 at = bias_rows + Tr::bias_offset((QT_PER_LOAD * j + (lane >> 4)) * 8 + (lane & 7), (lane >> 3) & 1);
        if constexpr (QT_PER_LOAD == 2)
          ldmatrix_x4_trans(pairs, at);
        else
          ldmatrix_x2_trans(pairs, at);
#pragma unroll
        for (int qt = QT_PER_LOAD * j; qt < QT_PER_LOAD * (j + 1); ++qt)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            modify(qt, c, Cvt<T>::unpack(pairs[2 * (qt % QT_PER_LOAD) + (c >> 1)], c & 1) * mods.bias_scale);
      } else {
#pragma unroll
        for (int qt = QT_PER_LOAD * j; qt < QT_PER_LOAD * (j + 1); ++qt)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            modify(qt, c, mods.bias_at(m0 + qt * 8 + 2 * t + (c & 1), n0 + key_row0 + g + 8 * (c >> 1)));
      }
    }
    if (BIAS_MASK && mods.check_mask) clear_masked();
  } else if (MASK_ONLY) {
    if (mods.check_mask) clear_masked();
  } else if (MASK_BITS) {
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        s_acc[qt][c] = mods.score_of(s_acc[qt][c], m0 + qt * 8 + 2 * t + (c & 1), n0 + key_row0 + g + 8 * (c >> 1),
                                     band.diag, unused_dcap[qt][c], 0.f, (mask_bits[qt / 8] >> (4 * (qt % 8) + c)) & 1);
  } else {
    apply_score_mods_transposed(s_acc, unused_dcap, n0 + key_row0, m0, band.diag, mods, lane);
  }
  if (is_masked)
    apply_band_mask_transposed<IS_CAUSAL, Mods::HAS_WINDOW>(s_acc, n0 + key_row0, m0, band, lane);

  // P^T = exp2(S^T * scale_log2 - lse_log2[query])  (lse_log2 = +inf for rows without keys and pad rows),
  // straight into A registers (m16n8k16 A layout: rows = this warp's keys, k = queries). From here P^T is
  // in the input dtype, as in plain attention, and dS^T below is computed from it: keeping P^T in fp32
  // too would cost 16 more registers per thread, and d128 runs at the 255 limit.
  // With dropout or softcap, p_regs hold the kept P^T (dV's A operand) and ps_regs P^T * dcap, undropped (dS).
  u32 p_regs[Tr::Q_K_STEPS][4];
  u32 ps_regs[HAS_PS && !STASH ? Tr::Q_K_STEPS : 1][4];
  const int g_key = n0 + key_row0 + g;  // this thread's first key (the second is + 8)
#pragma unroll
  for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk) {
    float pv[2][4], ps[2][4];
    bwd_probs_step<MODS>(s_acc, kk, lse_log2_smem, p.scale_log2, keep, mods, m0, g_key, band.diag, lane, pv, ps);
    if (FP32_P) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) s_acc[2 * kk + j][c] = ps[j][c];
    }
    pack_k16_a<T>(pv, p_regs[kk]);
    if (STASH) {
      u32 packed[4];
      pack_k16_a<T>(ps, packed);
      *reinterpret_cast<uint4*>(smem + ps_stash + (kk * 32 + lane) * 16) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
    } else if (HAS_PS) {
      pack_k16_a<T>(ps, ps_regs[kk]);
    }
  }

  // dV_j += P^T dO_i, running while dS^T is computed. dO_i is [query][d] in shared memory: the k
  // dimension (queries) is its rows, so it is read N-major
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk)
    Wgmma<Tr::HEAD_DIM, T>::template rs</*TRANS_B=*/1>(dv_acc, p_regs[kk], Tr::TileQ::desc_mn_major(do_smem, kk * 16, 0),
                                                       /*scale_d=*/1);
  wgmma_commit_group();

  // dS^T = P^T * (dP^T - delta[query])   (delta_i = rowsum(dO_i * O_i)), into A registers as well. dP^T is done;
  // dV runs on under this work, its A registers (p_regs) held, except at head dim 128 with a modifier that keeps
  // values beyond P^T in registers (a bias's fp32 P^T, dropout's second copy, the softcap's where it is not
  // parked): there dK and dV hold 128 of the 240 registers a warp-specialized consumer has, and waiting for dV
  // here frees p_regs (no spill; the other warpgroup's GEMMs keep the tensor cores busy meanwhile)
  constexpr bool DV_FIRST = Tr::HEAD_DIM >= 128 && (FP32_P || (HAS_PS && !STASH));
  wgmma_wait_group<DV_FIRST ? 0 : 1>();
  wgmma_fence_operand(dp_acc);
  if (DV_FIRST) wgmma_fence_operand(dv_acc);
#pragma unroll
  for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk) {
    float ds[2][4];
    u32 stashed[4];
    if (STASH) {
      const uint4 v = *reinterpret_cast<const uint4*>(smem + ps_stash + (kk * 32 + lane) * 16);
      stashed[0] = v.x, stashed[1] = v.y, stashed[2] = v.z, stashed[3] = v.w;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 delta = *reinterpret_cast<const float2*>(delta_smem + (2 * kk + j) * 8 + 2 * t);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const u32 packed = STASH    ? stashed[2 * j + (c >> 1)]
                           : HAS_PS ? ps_regs[HAS_PS ? kk : 0][2 * j + (c >> 1)]
                                    : p_regs[kk][2 * j + (c >> 1)];
        const int qt = 2 * kk + j;
        // (the softcap's factor is in ps already: ds_of's dcap = 1)
        ds[j][c] = ds_of<MODS & ~MOD_SOFTCAP>(FP32_P ? s_acc[qt][c] : Cvt<T>::unpack(packed, c & 1), dp_acc[qt][c],
                                              (c & 1) ? delta.y : delta.x,
                                              !Mods::HAS_DROPOUT || ((keep >> (4 * qt + c)) & 1),
                                              p.mods.dropout_rp, 1.f);
      }
    }
    // dBias: the block's address and the way it is written (ScoreMods::dbias_rows), made per k16 step: kept for the
    // whole step, its registers made ptxas spill
    if (Mods::HAS_BIAS)
      mods.put_dbias_tiles(mods.dbias_rows(m0, Tr::BLOCK_M, n0 + key_row0, lane), 2 * kk, m0, n0 + key_row0, lane, ds);
    pack_k16_a<T>(ds, ds_regs[kk]);
  }

  // dK_j += dS^T Q_i (softmax_scale applied to dK once, at the end); Q_i read N-major like dO_i
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk)
    Wgmma<Tr::HEAD_DIM, T>::template rs</*TRANS_B=*/1>(dk_acc, ds_regs[kk], Tr::TileQ::desc_mn_major(q_smem, kk * 16, 0),
                                                       /*scale_d=*/1);
  wgmma_commit_group();
}

// dS^T (ds_regs, the A layout of bwd_sm90_dkdv_step) of this warp's 16 keys into the dS^T tile at ds_smem_off: the
// 4 packed registers of each k16 step at rows g, g+8, columns 2t, 8+2t (all 8 rows of a phase land in 8 different
// 16-byte chunks: no bank conflict); ds_pair_offset is where register r of step kk goes, bwd_sm90_store_ds_step one
// step's four. The caller fences (fence.proxy.async) and synchronizes before wgmma reads it.
template <class Tr>
__device__ __forceinline__ u32 ds_pair_offset(int key_row0, int kk, int r, int lane) {  // (see bwd_sm90_store_ds)
  return Tr::TileDS::offset(key_row0 + (lane >> 2) + (r & 1) * 8, kk * 16 + (r >> 1) * 8 + 2 * (lane & 3));
}
template <class Tr>
__device__ __forceinline__ void bwd_sm90_store_ds_step(unsigned char* smem, u32 ds_smem_off, int key_row0, int kk,
                                                       int lane, const u32 (&a)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r)
    *reinterpret_cast<u32*>(smem + ds_smem_off + ds_pair_offset<Tr>(key_row0, kk, r, lane)) = a[r];
}
template <class Tr>
__device__ __forceinline__ void bwd_sm90_store_ds(unsigned char* smem, u32 ds_smem_off, int key_row0, int lane,
                                                  const u32 (&ds_regs)[Tr::Q_K_STEPS][4]) {
#pragma unroll
  for (int kk = 0; kk < Tr::Q_K_STEPS; ++kk)
    bwd_sm90_store_ds_step<Tr>(smem, ds_smem_off, key_row0, kk, lane, ds_regs[kk]);
}

// One query block for one warpgroup of bwd_sm90_kernel: bwd_sm90_dkdv_step, then (unless deterministic) dS^T to
// shared memory, a CTA barrier, dQ_i += dS K_j by wgmma and fp32 atomics.
template <class Tr, bool IS_CAUSAL, bool IS_DETERMINISTIC, int MODS>
__device__ __forceinline__ void bwd_sm90_query_block(const BwdParams& p, bool is_masked,
                                                     const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                                     const ScoreMods<MODS>& mods,
                                                     unsigned char* smem, u32 smem_base, int stage, int m_block, int n0,
                                                     long long vec_row, int warpgroup, int warp, int lane,
                                                     float (&dk_acc)[Tr::DKV_TILES][4],
                                                     float (&dv_acc)[Tr::DKV_TILES][4]) {
  using T = typename Tr::T;
  static_assert(!Tr::DQ_BY_ROWS, "64-query steps: every warpgroup's dQ columns of the block's rows");
  const int t = lane & 3, g = lane >> 2;
  const int key_row0 = warpgroup * 64 + (warp % 4) * 16;  // this warp's first key row in the tile
  const u32 k_smem = smem_base + Tr::OFF_K;
  const u32 ds_smem = smem_base + Tr::OFF_DS;
  u32 ds_regs[Tr::Q_K_STEPS][4];
  float s_acc[Tr::Q_TILES][4], dp_acc[Tr::Q_TILES][4];
  bwd_sm90_issue_sdp<Tr>(smem_base, stage, warpgroup, s_acc, dp_acc);
  bwd_sm90_dkdv_step<Tr, IS_CAUSAL, MODS>(p, is_masked, band, mods, smem, smem_base, stage, m_block, n0, warpgroup,
                                          warp, lane, s_acc, dp_acc, dk_acc, dv_acc, ds_regs);

  if (IS_DETERMINISTIC) {  // dQ comes from bwd_dq_kernel instead
    wgmma_wait_group<0>();
    wgmma_fence_operand(dv_acc);
    wgmma_fence_operand(dk_acc);
    return;
  }

  bwd_sm90_store_ds<Tr>(smem, Tr::OFF_DS, key_row0, lane, ds_regs);
  fence_proxy_async_shared();  // st.shared -> visible to the tensor cores (async proxy) after the barrier
  __syncthreads();             // dS^T of every warpgroup is in place
  // dV, dK done (they overlapped the stores and the barrier): P^T and dS^T registers are free for dQ's
  // accumulators
  wgmma_wait_group<0>();
  wgmma_fence_operand(dv_acc);
  wgmma_fence_operand(dk_acc);

  // dQ_i[:, DQ_COLS columns of this warpgroup] = dS K_j: A = dS^T read M-major (queries are its
  // contiguous dimension), B = K_j [key][d] read N-major
  float dq_acc[Tr::DQ_TILES][4];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Tr::DQ_K_STEPS; ++kk)
    Wgmma<Tr::DQ_COLS, T>::template ss</*TRANS_A=*/1, /*TRANS_B=*/1>(
        dq_acc, Tr::TileDS::desc_mn_major(ds_smem, kk * 16, 0),
        Tr::TileKV::desc_mn_major(k_smem, kk * 16, warpgroup * Tr::DQ_COLS), /*scale_d=*/kk > 0);
  wgmma_commit_group();
  wgmma_wait_group<0>();
  wgmma_fence_operand(dq_acc);

  // fp32 atomics into dQ_acc (pad rows exist in the buffer, so no bounds checks)
  float* acc = p.dq_accum + vec_row * p.dq_accum_cols;  // vec_row: the block's first fp32 row (QueryBlock)
#pragma unroll
  for (int dt = 0; dt < Tr::DQ_TILES; ++dt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // c0,c1 (row g) and c2,c3 (row g+8): adjacent columns
      const int row = (warp % 4) * 16 + g + h * 8;
      const int col = warpgroup * Tr::DQ_COLS + dt * 8 + 2 * t;
      red_add_v2_f32(acc + row * p.dq_accum_cols + col, dq_acc[dt][2 * h], dq_acc[dt][2 * h + 1]);
    }
}

template <class Tr, bool IS_CAUSAL, bool IS_DETERMINISTIC, int MODS>
__global__ void __launch_bounds__(Tr::THREADS, Tr::CTAS_PER_SM) bwd_sm90_kernel(const BwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const AlignedSmem aligned = align_smem_1024(smem_raw);
  const u32 smem_base = aligned.base;
  unsigned char* smem = aligned.ptr;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // broadcast from lane 0: ptxas then knows warpgroup is warp-uniform and builds the K/V descriptors of
  // the query loop in uniform registers, instead of recomputing them per step in vector registers
  const int warpgroup = __shfl_sync(0xffffffffu, warp / 4, 0);
  // keys, query blocks, prologue and epilogue as bwd_kernel's
  const BwdKeyBlock<Tr, IS_CAUSAL, HAS_WINDOW, ScoreMods<MODS>::HAS_TILE_MAP> kb(p);
  if (kb.n0 >= kb.seq.len_k) return;       // varlen: past this sequence's keys
  int left;  // (query head, query block) positions from qb on (GQA: the query heads of this K/V head in turn)
  QueryBlock<Tr> qb = kb.first_step(p, left);
  if (kb.m_begin >= kb.m_end || left == 0) {  // no query sees these keys: dK = dV = 0
    kb.zero_dk_dv(p, tid);
    return;
  }
  const QueryBlockCopy<Tr> copy(p, tid);
  kb.load_first(p, smem_base, copy, tid, qb);

  float dk_acc[Tr::DKV_TILES][4], dv_acc[Tr::DKV_TILES][4];  // this warp's 16 keys x HEAD_DIM, fp32
#pragma unroll
  for (int dt = 0; dt < Tr::DKV_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk_acc[dt][c] = dv_acc[dt][c] = 0.f;

  // (query head, query block) steps in order (walk). Unlike bwd_kernel, the mask is a run-time flag of one loop
  // body (causal diagonal; every block when this CTA holds the key tail): two inlined copies of the body (masked and
  // unmasked) pushed d128 causal past 255 registers.
  kb.walk(p, smem_base, copy, qb, left, [&](const QueryBlock<Tr>& qb, int stage, bool is_masked) {
    ScoreMods<MODS> mods;
    mods.init(p.mods, kb.batch, qb.head, p.heads, kb.seq.len_q, kb.seq.len_k);
    if (ScoreMods<MODS>::HAS_MASK) mods.check_mask = kb.state(p, qb) != TILE_FULL;
    bwd_sm90_query_block<Tr, IS_CAUSAL, IS_DETERMINISTIC, MODS>(p, is_masked, kb.band, mods, smem, smem_base, stage,
                                                                qb.m_block, kb.n0, qb.vec_row, warpgroup, warp, lane,
                                                                dk_acc, dv_acc);
  });

  // epilogue: dK = softmax_scale * dK (dV * 1 / (1 - p) with dropout); stage dK in the K tile and dV in the V
  // tile, 16-byte stores
  if (ScoreMods<MODS>::HAS_DROPOUT) scale_acc(dv_acc, p.mods.dropout_rp);
  bwd_stage_dk_dv<Tr>(p, smem, warpgroup * 64 + (warp % 4) * 16, 0, lane, dk_acc, dv_acc);
  __syncthreads();
  // tid read anew: the copy offsets are the prologue's K/V ones; kept live across the query loop they
  // cost d128 causal a 4-byte spill under NVRTC 13.0
  kb.store_dk_dv(p, smem, tid_x_reread());
#else
  static_assert(Tr::HEAD_DIM < 0, "bwd_sm90_kernel uses wgmma: compile it for sm_90a");
#endif
}

}  // namespace cuflash
