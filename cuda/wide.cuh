// wide.cuh: attention in float32 and float64 on the tensor cores (mma.sync, every sm_80+ GPU).
//
// The same algorithms as fwd.cuh and bwd.cuh (FlashAttention-2's forward, Q-outer, and its K/V-outer backward
// with dQ summed by atomics), for 4- and 8-byte elements. What differs is the arithmetic, a policy (Math):
//   Tf32    float32 inputs, one TF32 product per term: the TF32 tensor cores (m16n8k8), TF32's error;
//   Tf32x3  float32 inputs, each operand split into x = big + small (both TF32) and the three products
//           small*big + big*small + big*big summed in fp32 (the fourth, small*small, is below fp32's rounding):
//           float32-level accuracy on the TF32 tensor cores, at three times the mma work;
//   F64     float64 inputs on the FP64 tensor cores, float64 softmax: one m16n8k8 DMMA per step on sm_90+, pairs
//           of m8n8k4 (the only FP64 shape there) on sm_80 - sm_89.
// All three keep the m16n8 accumulator layout of the 16-bit kernels (rows g, g + 8, columns 2t, 2t + 1), so the
// masks and, for float32, the score modifiers (mods.cuh) and the online softmax are the same code.
//
// Shared memory: tiles are row-major, PITCH = HEAD_DIM + 4 elements per row. Every fragment read is one 4-byte
// (float32) or 8-byte (float64) load per element. In float32 that pitch makes each of them conflict-free: the reads
// along k (row g, column t: bank 4g + t) and across rows (row t or 2t, column g: bank 8t + g) alike; the one
// exception is dQ's B operand (row t, column g: 2-way). An 8-byte load is served half a warp (g < 4, g >= 4) at a
// time: rows g stay conflict-free, rows 2t (the B operands read by load_b_acc: V in P V, dO and Q in the backward)
// are 2-way (rows 0 and 4 share banks). A 2-double pad for the forward's V removed them (ncu: 29 % fewer shared
// wavefronts) and ran no faster on an H100 (docs/PERFORMANCE.md, "What did not pay"). Rows whose start is 16 bytes
// off a 32-byte sector (float32's 4-float pad, that 2-double pad) also make cp.async read more from L2 (ncu: 1.5x
// and 1.24x the bytes; docs/IO_VALIDATION.md).
//
// A GEMM whose A operand is an accumulator (P V, P^T dO, dS^T Q) takes A straight from registers: in an n8 tile
// a thread holds columns 2t and 2t + 1, and the reduction order inside an mma is free, so the mma's k index is
// mapped onto those columns (Math::a_of_acc; an m16n8k16 A spans two n8 tiles, an m8n8k4 one half of a tile) and
// B's rows are read in the same order (Math::load_b_acc).
#pragma once
#include "ptx.cuh"
#include "traits.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "softmax.cuh"
#include "seqs.cuh"
#include "fwd.cuh"
#include "bwd.cuh"

namespace cuflash {

constexpr double LOG2E_D = 1.4426950408889634074;
constexpr double LN2_D = 0.69314718055994530942;

// ---- arithmetic policies -----------------------------------------------------------------------

// x rounded to the nearest TF32 value (11 significant bits), as float32 bits whose low 13 mantissa bits are zero:
// Veltkamp's split, c = x * (2^13 + 1), x_hi = c - (c - x), three float32 operations on the FMA pipe, where
// cvt.rna.tf32.f32 is emulated on sm_80 and sm_90 (no hardware conversion: a compare, an add, a select and a mask,
// about three instructions per value in the 3xTF32 forward, mostly on the half-rate integer pipe). The
// _rn intrinsics keep the compiler from contracting x * 8193 - x into one (exact) FMA. NaN stays NaN; |x| above
// 4e34 (x * 8193 overflows) gives NaN instead of x: such float32 inputs overflow q . k themselves.
__device__ __forceinline__ u32 round_tf32(float x) {
  const float c = __fmul_rn(x, 8193.0f);
  return __float_as_uint(__fsub_rn(c, __fsub_rn(c, x)));
}
// A fragment (16 x K, row-major): load_a(at) with at(row, k); B fragment (K x 8): load_b(at) with at(k, n);
// a_of_acc(c, s): k-step s of the ACC_TILES n8 accumulator tiles c[0..ACC_TILES) as A (ACC_STEPS steps per tile);
// load_b_acc(at, s): the B rows that go with it, at(k, n) with k counted from the first tile's first column.

struct Tf32 {
  using E = float;
  using Acc = float;
  static constexpr int K = 8;          // k of one mma
  static constexpr int ACC_TILES = 1;  // n8 accumulator tiles per A operand
  static constexpr int ACC_STEPS = 1;  // A operands per n8 accumulator tile
  static constexpr int CHAIN_K = 64;   // k summed in one chain of mmas (0: any), see "Bounded chains" below
  struct A { u32 x[4]; };
  struct B { u32 x[2]; };
  static __device__ __forceinline__ A make_a(float a0, float a1, float a2, float a3) {
    return A{{round_tf32(a0), round_tf32(a1), round_tf32(a2), round_tf32(a3)}};
  }
  static __device__ __forceinline__ B make_b(float b0, float b1) { return B{{round_tf32(b0), round_tf32(b1)}}; }
  template <class F>
  static __device__ __forceinline__ A load_a(F at, int g, int t) { return make_a(at(g, t), at(g + 8, t), at(g, t + 4), at(g + 8, t + 4)); }
  template <class F>
  static __device__ __forceinline__ B load_b(F at, int g, int t) { return make_b(at(t, g), at(t + 4, g)); }
  // k = t <-> column 2t, k = t + 4 <-> column 2t + 1
  static __device__ __forceinline__ A a_of_acc(const float (*c)[4], int) { return make_a(c[0][0], c[0][2], c[0][1], c[0][3]); }
  template <class F>
  static __device__ __forceinline__ B load_b_acc(F at, int, int g, int t) { return make_b(at(2 * t, g), at(2 * t + 1, g)); }
  static __device__ __forceinline__ void mma(float (&c)[4], const A& a, const B& b) { mma_m16n8k8_tf32(c, a.x, b.x[0], b.x[1]); }
};

struct Tf32x3 {
  using E = float;
  using Acc = float;
  static constexpr int K = 8;
  static constexpr int ACC_TILES = 1;
  static constexpr int ACC_STEPS = 1;
  static constexpr int CHAIN_K = 64;
  struct A { u32 big[4], small[4]; };
  struct B { u32 big[2], small[2]; };
  // x = big + small: big = x rounded to TF32, small = the rest (exact) rounded to TF32: x to about 22 bits
  static __device__ __forceinline__ void split(float x, u32& big, u32& small) {
    const float b = __uint_as_float(round_tf32(x));
    big = __float_as_uint(b);
    small = round_tf32(__fsub_rn(x, b));
  }
  static __device__ __forceinline__ A make_a(float a0, float a1, float a2, float a3) {
    A a;
    split(a0, a.big[0], a.small[0]);
    split(a1, a.big[1], a.small[1]);
    split(a2, a.big[2], a.small[2]);
    split(a3, a.big[3], a.small[3]);
    return a;
  }
  static __device__ __forceinline__ B make_b(float b0, float b1) {
    B b;
    split(b0, b.big[0], b.small[0]);
    split(b1, b.big[1], b.small[1]);
    return b;
  }
  template <class F>
  static __device__ __forceinline__ A load_a(F at, int g, int t) { return make_a(at(g, t), at(g + 8, t), at(g, t + 4), at(g + 8, t + 4)); }
  template <class F>
  static __device__ __forceinline__ B load_b(F at, int g, int t) { return make_b(at(t, g), at(t + 4, g)); }
  static __device__ __forceinline__ A a_of_acc(const float (*c)[4], int) { return make_a(c[0][0], c[0][2], c[0][1], c[0][3]); }
  template <class F>
  static __device__ __forceinline__ B load_b_acc(F at, int, int g, int t) { return make_b(at(2 * t, g), at(2 * t + 1, g)); }
  // the small terms first, so they are not lost against the big product's rounding
  static __device__ __forceinline__ void mma(float (&c)[4], const A& a, const B& b) {
    mma_m16n8k8_tf32(c, a.small, b.big[0], b.big[1]);
    mma_m16n8k8_tf32(c, a.big, b.small[0], b.small[1]);
    mma_m16n8k8_tf32(c, a.big, b.big[0], b.big[1]);
  }
};

// K = 4, 8 or 16: the k of one step. A element i sits at row g + 8 (i & 1), column t + 4 (i >> 1); B element i at row
// t + 4 i, column g. As A, an accumulator's columns 2t, 2t + 1 of tile j / 2 give k = t + 4 j (K >= 8; K = 4: k = t is
// column 2t + s in step s of a tile).
template <int K_>
struct F64T {
  using E = double;
  using Acc = double;
  static constexpr int K = K_;
  static constexpr int ACC_TILES = K >= 8 ? K / 8 : 1;
  static constexpr int ACC_STEPS = K >= 8 ? 1 : 8 / K;
  static constexpr int CHAIN_K = 0;  // DMMA's fused multiply-adds round to nearest
  static_assert(K == 4 || K == 8 || K == 16, "the m16n8k4, m16n8k8 and m16n8k16 layouts");
  struct A { double x[K / 2]; };
  struct B { double x[K / 4]; };
  template <class F>
  static __device__ __forceinline__ A load_a(F at, int g, int t) {
    A a;
#pragma unroll
    for (int i = 0; i < K / 2; ++i) a.x[i] = at(g + 8 * (i & 1), t + 4 * (i >> 1));
    return a;
  }
  template <class F>
  static __device__ __forceinline__ B load_b(F at, int g, int t) {
    B b;
#pragma unroll
    for (int i = 0; i < K / 4; ++i) b.x[i] = at(t + 4 * i, g);
    return b;
  }
  static __device__ __forceinline__ A a_of_acc(const double (*c)[4], int s) {
    A a;
    if constexpr (K == 4) {
      a.x[0] = c[0][s];
      a.x[1] = c[0][2 + s];
    } else {
#pragma unroll
      for (int j = 0; j < K / 4; ++j) {
        a.x[2 * j] = c[j >> 1][j & 1];
        a.x[2 * j + 1] = c[j >> 1][2 + (j & 1)];
      }
    }
    return a;
  }
  template <class F>
  static __device__ __forceinline__ B load_b_acc(F at, int s, int g, int t) {
    B b;
    if constexpr (K == 4) {
      b.x[0] = at(2 * t + s, g);
    } else {
#pragma unroll
      for (int j = 0; j < K / 4; ++j) b.x[j] = at(8 * (j >> 1) + 2 * t + (j & 1), g);
    }
    return b;
  }
  static __device__ __forceinline__ void mma(double (&c)[4], const A& a, const B& b) {
#if __CUDA_ARCH__ >= 900
    mma_m16n8k_f64<K>(c, a.x, b.x);
#else
#pragma unroll
    for (int j = 0; j < K / 4; ++j) {
      mma_m8n8k4_f64(c[0], c[1], a.x[2 * j], b.x[j]);
      mma_m8n8k4_f64(c[2], c[3], a.x[2 * j + 1], b.x[j]);
    }
#endif
  }
};
// On an H100 (tools/mma_rates.py) m8n8k4 runs at half the FP64 tensor-core rate (33 TFLOP/s), m16n8k4, k8 and k16 at
// the full 66; in these kernels m16n8k8 measured fastest (m16n8k16's 16-register A made the backward spill and the
// head-dim-128 forward slower). See docs/PERFORMANCE.md.
#if __CUDA_ARCH__ >= 900
using F64 = F64T<8>;
#else
using F64 = F64T<4>;
#endif

// Bounded chains. The TF32 tensor cores add each mma's products to its fp32 accumulator with truncation, not
// rounding to nearest (measured: a 3xTF32 forward accumulating O in one chain over the whole key loop was 3-11x
// less accurate than plain float32 attention at 128-1024 keys, its dK and dV up to 14x, and the error grew with
// the keys). So no chain sums more than CHAIN_K products per output: longer sums (S and dP over head dims above
// 64, O over the key loop, dK and dV over the query loop, dQ over 128 keys) are split into chains of CHAIN_K that
// start from zero, and the chains are added with ordinary rounded float32 adds. Zero-initialized accumulators of
// the first chain are used directly.
template <class A, int N>
__device__ __forceinline__ void add_acc(A (&x)[N][4], const A (&y)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) x[i][c] += y[i][c];
}
template <class A, int N>
__device__ __forceinline__ void zero_acc(A (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) x[i][c] = A(0);
}
// The chains over [0, LEN) of a policy: `chain(acc, begin, end)` adds the products of [begin, end) to acc.
template <class M, int LEN, class Acc, int N, class F>
__device__ __forceinline__ void bounded_chains(Acc (&acc)[N][4], F chain) {
  constexpr int STEP = (M::CHAIN_K == 0 || M::CHAIN_K >= LEN) ? LEN : M::CHAIN_K;
  chain(acc, 0, STEP);
#pragma unroll
  for (int k0 = STEP; k0 < LEN; k0 += STEP) {
    Acc part[N][4];
    zero_acc(part);
    chain(part, k0, k0 + STEP);
    add_acc(acc, part);
  }
}

template <class Acc>
struct AccOps;
template <>
struct AccOps<float> {
  static __device__ __forceinline__ float log2e() { return LOG2E; }
  static __device__ __forceinline__ float ln2() { return LN2; }
  static __device__ __forceinline__ float scale_log2(float f, double) { return f; }
  static __device__ __forceinline__ void red_add2(float* p, float a, float b) { red_add_v2_f32(p, a, b); }
};
template <>
struct AccOps<double> {
  static __device__ __forceinline__ double log2e() { return LOG2E_D; }
  static __device__ __forceinline__ double ln2() { return LN2_D; }
  static __device__ __forceinline__ double scale_log2(float, double d) { return d; }
  static __device__ __forceinline__ void red_add2(double* p, double a, double b) {
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
  }
};

// Element pairs (two adjacent columns) for the direct stores of the epilogues
__device__ __forceinline__ void store_pair(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void store_pair(double* p, double a, double b) { *reinterpret_cast<double2*>(p) = make_double2(a, b); }

// A [ROWS, HEAD_DIM] tile of E from global memory (row stride in elements) into shared memory at PITCH elements per
// row, in 16-byte cp.async chunks; rows >= rows_valid and columns >= cols_valid are zero-filled without a read.
// Each thread keeps one column and steps down the rows by pointer increments (addresses precomputed per chunk
// held dozens of registers across the key loop).
template <class E, int ROWS, int HEAD_DIM, int PITCH, int THREADS>
__device__ __forceinline__ void load_wide_tile(u32 smem, const E* gmem, long long row_stride, int rows_valid,
                                               int cols_valid, int tid) {
  constexpr int PER_CHUNK = 16 / sizeof(E);
  constexpr int CHUNKS_PER_ROW = HEAD_DIM / PER_CHUNK;
  constexpr int ROW_STEP = THREADS / CHUNKS_PER_ROW;
  static_assert(HEAD_DIM % PER_CHUNK == 0 && (PITCH * sizeof(E)) % 16 == 0, "whole, aligned 16-byte chunks");
  static_assert(THREADS % CHUNKS_PER_ROW == 0, "each thread copies one column of chunks");
  const int col = (tid % CHUNKS_PER_ROW) * PER_CHUNK;
  int r = tid / CHUNKS_PER_ROW;
  const bool col_valid = col < cols_valid;
  u32 dst = smem + (r * PITCH + col) * static_cast<int>(sizeof(E));
  const E* src = gmem + r * row_stride + col;
#pragma unroll 4
  for (; r < ROWS; r += ROW_STEP) {
    const bool valid = col_valid && r < rows_valid;
    cp_async_cg_16(dst, valid ? src : gmem, valid);
    dst += ROW_STEP * PITCH * static_cast<int>(sizeof(E));
    src += ROW_STEP * row_stride;
  }
}

// ---- forward ------------------------------------------------------------------------------------

// V_SPLIT > 1: each CTA computes V_COLS = HEAD_DIM / V_SPLIT columns of O (grid.x = query blocks x V_SPLIT), so the
// O accumulator fits the registers at head dim 256 in 3xTF32; S = Q K^T over the whole head dim is computed by each
// of the V_SPLIT CTAs of a query block (1.5x the work at V_SPLIT 2).
// STAGES: buffers of K and V. 2: the next tile's K and V load during this one; 1: one buffer each (half the shared
// memory of K and V); the next K loads during this tile's softmax and P V, the next V during the next S (two CTA
// barriers per tile either way).
template <int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int WARPS_, class M_, int V_SPLIT_ = 1, int STAGES_ = 2>
struct WideFwdTraits {
  using M = M_;
  using E = typename M::E;
  using Acc = typename M::Acc;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;
  static constexpr int BLOCK_N = BLOCK_N_;
  static constexpr int WARPS = WARPS_;
  static constexpr int V_SPLIT = V_SPLIT_;
  static constexpr int STAGES = STAGES_;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int M_TILES = BLOCK_M / (16 * WARPS);
  static constexpr int WARP_ROWS = 16 * M_TILES;
  static constexpr int N_TILES = BLOCK_N / 8;
  static constexpr int V_COLS = HEAD_DIM / V_SPLIT;  // columns of V and O per CTA
  static constexpr int D_TILES = V_COLS / 8;
  static constexpr int PITCH = HEAD_DIM + 4;    // Q and K rows
  static constexpr int V_PITCH = V_COLS + 4;    // V rows
  static constexpr int SMEM_Q = BLOCK_M * PITCH * sizeof(E);
  static constexpr int SMEM_K = BLOCK_N * PITCH * sizeof(E);
  static constexpr int SMEM_V = BLOCK_N * V_PITCH * sizeof(E);
  static constexpr int SMEM_BYTES = SMEM_Q + STAGES * (SMEM_K + SMEM_V);  // Q, then the stages of K, then of V

  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM: a multiple of 32 (the pitch rule), at most 256");
  static_assert(V_SPLIT >= 1 && V_COLS % 32 == 0, "V_SPLIT parts of whole 32-column blocks");
  static_assert(STAGES == 1 || STAGES == 2, "one or two buffers of K and V");
  static_assert(BLOCK_M % (16 * WARPS) == 0 && BLOCK_N % 8 == 0, "whole m16 row tiles per warp, n8 key tiles");
  static_assert((BLOCK_N / 8) % M::ACC_TILES == 0 && HEAD_DIM % M::K == 0, "whole mma k-steps over keys and head dim");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

// One key tile: S = Q K^T, after_s() (the one-stage pipeline's barrier), the modifiers and masks, the online
// softmax, O += P V (next tile's loads in flight).
template <class Tr, bool IS_CAUSAL, bool IS_MASKED, int MODS, class AfterS>
__device__ __forceinline__ void fwd_wide_key_tile(const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                                  const ScoreMods<MODS>& mods, typename Tr::Acc scale_log2,
                                                  int n_block, const typename Tr::E* q_s, const typename Tr::E* k_s,
                                                  const typename Tr::E* v_s, int warp_row0, int row0, int lane,
                                                  typename Tr::Acc (&o_acc)[Tr::M_TILES][Tr::D_TILES][4],
                                                  OnlineSoftmax<Tr::M_TILES, Tr::N_TILES, Tr::D_TILES, typename Tr::Acc>& softmax,
                                                  AfterS after_s) {
  using M = typename Tr::M;
  using Acc = typename Tr::Acc;
  const int g = lane >> 2, t = lane & 3;
  // S = Q K^T (one row tile per warp: M_TILES == 1, so S is [N_TILES][4])
  static_assert(Tr::M_TILES == 1, "the wide forward keeps one m16 row tile per warp");
  Acc s_acc[1][Tr::N_TILES][4];
  zero_acc(s_acc[0]);
  bounded_chains<M, Tr::HEAD_DIM>(s_acc[0], [&](Acc (&acc)[Tr::N_TILES][4], int k_begin, int k_end) {
#pragma unroll 1
    for (int k0 = k_begin; k0 < k_end; k0 += M::K) {
      const typename M::A a = M::load_a([&](int r, int k) { return q_s[(warp_row0 + r) * Tr::PITCH + k0 + k]; }, g, t);
#pragma unroll
      for (int nt = 0; nt < Tr::N_TILES; ++nt)
        M::mma(acc[nt], a, M::load_b([&](int k, int n) { return k_s[(nt * 8 + n) * Tr::PITCH + k0 + k]; }, g, t));
    }
  });
  after_s();

  if constexpr (ScoreMods<MODS>::CHANGES_SCORES) {  // float32 only (the float64 kernels take the window alone)
    float unused_dcap[Tr::M_TILES][Tr::N_TILES][4];
    apply_score_mods(s_acc, unused_dcap, row0 + warp_row0, n_block * Tr::BLOCK_N, band.diag, mods, lane);
  }
  if (IS_MASKED)
    apply_band_mask<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW, Tr::M_TILES, Tr::N_TILES>(
        s_acc, row0 + warp_row0, n_block * Tr::BLOCK_N, band, lane);
  if constexpr (sizeof(Acc) == 8) softmax.update_lazy(s_acc, o_acc, scale_log2);
  else softmax.update(s_acc, o_acc, scale_log2);
  if constexpr (ScoreMods<MODS>::HAS_DROPOUT) apply_dropout(s_acc, row0 + warp_row0, n_block * Tr::BLOCK_N, mods, lane);

  // O += P V, P from the accumulators. The tile's P V is summed in zeroed registers, PV_TILES column tiles at a time
  // (registers), and added to O (bounded chains); the float64 kernels add into O directly.
  // (16 column tiles: ptxas kept the 128-column forwards spill-free with one pass; 8 and 4, two and four passes that
  // re-split P, spilled 16-108 bytes at the same tiles)
  constexpr int PV_TILES = M::CHAIN_K == 0 ? Tr::D_TILES : (Tr::D_TILES < 16 ? Tr::D_TILES : 16);
  static_assert(Tr::BLOCK_N <= 64 || M::CHAIN_K == 0, "one chain of P V per key tile of at most 64 keys");
#pragma unroll
  for (int d0 = 0; d0 < Tr::D_TILES; d0 += PV_TILES) {
    Acc part[PV_TILES][4];
    if (M::CHAIN_K != 0) zero_acc(part);
    auto target = [&](int dt) -> Acc(&)[4] {
      if constexpr (M::CHAIN_K == 0) return o_acc[0][d0 + dt];
      else return part[dt];
    };
#pragma unroll
    for (int nt = 0; nt < Tr::N_TILES; nt += M::ACC_TILES)
#pragma unroll
      for (int s = 0; s < M::ACC_STEPS; ++s) {
        const typename M::A a = M::a_of_acc(&s_acc[0][nt], s);
#pragma unroll
        for (int dt = 0; dt < PV_TILES; ++dt)
          M::mma(target(dt), a,
                 M::load_b_acc([&](int k, int n) { return v_s[(nt * 8 + k) * Tr::V_PITCH + (d0 + dt) * 8 + n]; }, s, g, t));
      }
    if (M::CHAIN_K != 0)
#pragma unroll
      for (int dt = 0; dt < PV_TILES; ++dt)
#pragma unroll
        for (int c = 0; c < 4; ++c) o_acc[0][d0 + dt][c] += part[dt][c];
  }
}

// Grid (query blocks, heads, batch); FwdParams as for fwd_kernel, its pointers to E (lse: to Acc).
template <class Tr, bool IS_CAUSAL, int MODS>
__global__ void __launch_bounds__(Tr::THREADS, 1) fwd_wide_kernel(const FwdParams p) {
  using E = typename Tr::E;
  using Acc = typename Tr::Acc;
  static_assert(sizeof(Acc) == 4 || (MODS & ~MOD_WINDOW) == 0, "the float64 kernels take the window alone");
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int v_part = static_cast<int>(blockIdx.x) % Tr::V_SPLIT;  // O columns [v_part * V_COLS, + V_COLS)
  const int m_blocks = static_cast<int>(gridDim.x) / Tr::V_SPLIT;
  const int m_block = IS_CAUSAL ? (m_blocks - 1 - static_cast<int>(blockIdx.x) / Tr::V_SPLIT)  // longest blocks first
                                : static_cast<int>(blockIdx.x) / Tr::V_SPLIT;
  const int v_col0 = v_part * Tr::V_COLS;
  const int v_cols = min(Tr::V_COLS, p.head_dim - v_col0);  // valid columns of this part (<= 0: none)
  const int head = blockIdx.y, batch = blockIdx.z;
  const Seq seq = sequence(p.seq, batch);
  const int row0 = m_block * Tr::BLOCK_M;
  if (row0 >= seq.len_q) return;
  const int rows_q = min(Tr::BLOCK_M, seq.len_q - row0);
  const int warp_row0 = warp * Tr::WARP_ROWS;
  const int kv_head = head / p.seq.kv_group;

  const E* q_gmem = reinterpret_cast<const E*>(p.q) + batch * p.q_batch_stride +
                    static_cast<long long>(seq.q_row0 + row0) * p.q_row_stride + head * p.q_head_stride;
  const E* k_gmem = reinterpret_cast<const E*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride +
                    static_cast<long long>(seq.k_row0) * p.k_row_stride;
  const E* v_gmem = reinterpret_cast<const E*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride +
                    static_cast<long long>(seq.k_row0) * p.v_row_stride + v_col0;
  E* o_gmem = reinterpret_cast<E*>(p.o) + batch * p.o_batch_stride + static_cast<long long>(seq.q_row0 + row0) * p.o_row_stride +
              head * p.o_head_stride + v_col0;
  if (v_cols <= 0) return;  // a zero-padded head dim whose last part holds no column
  Acc* lse_gmem = p.lse == nullptr || v_part != 0 ? nullptr
                                   : reinterpret_cast<Acc*>(p.lse) + batch * p.lse_batch_stride + head * p.lse_head_stride +
                                         seq.q_row0 + row0;

  const Band<IS_CAUSAL, HAS_WINDOW> band{seq.len_k, seq.len_k - seq.len_q, p.mods.window_left, p.mods.window_right};
  const int n_begin = band.template key_block_begin<Tr::BLOCK_N>(row0);
  const int n_end = band.template key_block_end<Tr::BLOCK_N>(row0 + rows_q - 1);
  if (n_end <= n_begin) {  // these rows see no key: O = 0, lse = -inf
    for (int i = tid; i < rows_q * v_cols; i += Tr::THREADS) o_gmem[(i / v_cols) * p.o_row_stride + i % v_cols] = E(0);
    if (lse_gmem != nullptr)
      for (int r = tid; r < rows_q; r += Tr::THREADS) lse_gmem[r] = neg_inf();
    return;
  }

  const u32 q_smem = smem_u32(smem), k_smem0 = q_smem + Tr::SMEM_Q, v_smem0 = k_smem0 + Tr::STAGES * Tr::SMEM_K;
  const E* q_s = reinterpret_cast<const E*>(smem);
  const E* k_s0 = reinterpret_cast<const E*>(smem + Tr::SMEM_Q);
  const E* v_s0 = reinterpret_cast<const E*>(smem + Tr::SMEM_Q + Tr::STAGES * Tr::SMEM_K);
  load_wide_tile<E, Tr::BLOCK_M, Tr::HEAD_DIM, Tr::PITCH, Tr::THREADS>(q_smem, q_gmem, p.q_row_stride, rows_q, p.head_dim, tid);
  auto load_k = [&](int stage, int n) {
    const long long key0 = static_cast<long long>(n) * Tr::BLOCK_N;
    load_wide_tile<E, Tr::BLOCK_N, Tr::HEAD_DIM, Tr::PITCH, Tr::THREADS>(
        k_smem0 + stage * Tr::SMEM_K, k_gmem + key0 * p.k_row_stride, p.k_row_stride,
        min(Tr::BLOCK_N, seq.len_k - n * Tr::BLOCK_N), p.head_dim, tid);
  };
  auto load_v = [&](int stage, int n) {
    const long long key0 = static_cast<long long>(n) * Tr::BLOCK_N;
    load_wide_tile<E, Tr::BLOCK_N, Tr::V_COLS, Tr::V_PITCH, Tr::THREADS>(
        v_smem0 + stage * Tr::SMEM_V, v_gmem + key0 * p.v_row_stride, p.v_row_stride,
        min(Tr::BLOCK_N, seq.len_k - n * Tr::BLOCK_N), v_cols, tid);
  };
  int n_block = n_end - 1;
  load_k(0, n_block);
  if constexpr (Tr::STAGES == 1) {  // Q and K as one group, V as the next: S waits for the first only
    cp_async_commit_group();
    load_v(0, n_block);
    cp_async_commit_group();
    cp_async_wait_group<1>();
    __syncthreads();
  } else {
    load_v(0, n_block);
    cp_async_commit_group();
  }

  Acc o_acc[Tr::M_TILES][Tr::D_TILES][4];
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
      for (int c = 0; c < 4; ++c) o_acc[mt][dt][c] = Acc(0);
  OnlineSoftmax<Tr::M_TILES, Tr::N_TILES, Tr::D_TILES, Acc> softmax;
  softmax.init();
  ScoreMods<MODS> mods;
  mods.init(p.mods, batch, head, p.heads, seq.len_q, seq.len_k);
  const Acc scale_log2 = AccOps<Acc>::scale_log2(p.scale_log2, p.scale_log2_d);

  // key tiles from the last to the first, each with the element mask where the band cuts it (the tail, the causal
  // diagonal, the window's edges). One loop with the choice made per tile, not fwd_kernel's three loops: two inlined
  // copies of the key tile instead of three, which NVRTC 13.0 needed to keep the window kernels' accumulators in
  // registers (with three it spilled 280-420 bytes at head dim 256)
  // One stage: the tile's K (and Q) have landed when a step starts, its V is awaited after S; the next K is issued
  // once every warp is past S and awaited at the step's end, where every warp is past P V and the next V is issued.
  int stage = 0;
  auto step = [&](auto is_masked_tag) {
    constexpr bool IS_MASKED = decltype(is_masked_tag)::value;
    const bool has_next = n_block - 1 >= n_begin;
    if constexpr (Tr::STAGES == 2) {
      if (has_next) {
        load_k(stage ^ 1, n_block - 1);
        load_v(stage ^ 1, n_block - 1);
      }
      cp_async_commit_group();
      cp_async_wait_group<1>();
      __syncthreads();
    }
    fwd_wide_key_tile<Tr, IS_CAUSAL, IS_MASKED, MODS>(band, mods, scale_log2, n_block, q_s, k_s0 + stage * (Tr::SMEM_K / sizeof(E)),
                                                      v_s0 + stage * (Tr::SMEM_V / sizeof(E)), warp_row0, row0, lane,
                                                      o_acc, softmax, [&] {
                                                        if constexpr (Tr::STAGES == 1) {
                                                          cp_async_wait_group<0>();  // this tile's V
                                                          __syncthreads();           // ... seen by all; K free
                                                          if (has_next) load_k(0, n_block - 1);
                                                          cp_async_commit_group();
                                                        }
                                                      });
    if constexpr (Tr::STAGES == 1) {
      cp_async_wait_group<0>();  // the next K
      __syncthreads();           // ... seen by all; V free
      if (has_next) load_v(0, n_block - 1);
      cp_async_commit_group();
    } else {
      __syncthreads();
      stage ^= 1;
    }
  };
  for (; n_block >= n_begin; --n_block) {
    if (band.needs_mask_right(row0, (n_block + 1) * Tr::BLOCK_N - 1) ||
        band.needs_mask_left(row0 + rows_q - 1, n_block * Tr::BLOCK_N))
      step(BoolTag<true>());
    else
      step(BoolTag<false>());
  }

  Acc lse[Tr::M_TILES][2];
  softmax.finalize(o_acc, lse, AccOps<Acc>::ln2());
  if constexpr (ScoreMods<MODS>::HAS_DROPOUT) scale_acc(o_acc, p.mods.dropout_rp);
  // O straight from the registers: each quad writes 8 (16) contiguous bytes per row and n8 tile
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row0 + mt * 16 + g + 8 * h;
      if (row >= rows_q) continue;
      E* o_row = o_gmem + static_cast<long long>(row) * p.o_row_stride;
#pragma unroll
      for (int dt = 0; dt < Tr::D_TILES; ++dt)
        if (dt * 8 < v_cols) store_pair(o_row + dt * 8 + 2 * t, o_acc[mt][dt][2 * h], o_acc[mt][dt][2 * h + 1]);
      if (t == 0 && lse_gmem != nullptr) lse_gmem[row] = lse[mt][h];
    }
}

// ---- backward -----------------------------------------------------------------------------------
//   bwd_wide_preprocess_kernel: delta = rowsum(dO * O), lse_log2 = lse * log2(e), dQ_acc = 0 (in Acc), and the
//     turn counters of an ordered backward = 0
//   bwd_wide_kernel (K/V-outer): dK, dV in registers; dQ_acc += dS K by atomics (float32 red.add / float64 atomicAdd)
//   bwd_wide_convert_dq_kernel: dQ = softmax_scale * dQ_acc
// BwdParams as for the 16-bit kernels, its pointers to E (lse, lse_log2, delta, dq_accum: to Acc).
//
// Deterministic (ORDERED): the same atomics, issued in a fixed order of key blocks per query block, so every
// element of dQ_acc receives its additions in the same order on every run. One int32 counter per WIDE_TURN_ROWS
// rows of dQ_acc (BwdParams::dq_turns, zeroed by the preprocess; a query block of BLOCK_M rows uses the counter of
// its first row) counts the key blocks that have added into the block. A CTA whose dQ block for query block m is
// computed waits (thread 0, ld.acquire polling) until the counter equals its turn, then all its threads add, then,
// after a CTA barrier, thread 0 fences and increments the counter (red.release). Turns (bwd.cuh's ordered_dq_turn):
// without a band, key block n's turn is n (every key block adds into every query block; the lower ones launch
// first); with causal or a window, the key blocks that see m form a run [n_lo, n_hi] and take turns from n_hi
// down, and the kernel launches its key blocks last-first (n = gridDim.x - 1 - blockIdx.x), so a CTA only waits
// on CTAs launched before it, and those start at their diagonal, where they come first.
constexpr int WIDE_TURN_ROWS = 16;  // rows of dQ_acc per turn counter: every BLOCK_M of the wide backward

template <class E, class Acc>
__global__ void __launch_bounds__(256) bwd_wide_preprocess_kernel(const BwdParams p) {
  const int sub = threadIdx.x % PREPROCESS_LANES;
  const int row = blockIdx.x * PREPROCESS_ROWS + threadIdx.x / PREPROCESS_LANES;
  const int head = blockIdx.y, batch = blockIdx.z;
  const Seq seq = sequence(p.seq, batch);
  Acc delta = Acc(0);
  if (row < seq.len_q) {
    const long long qrow = seq.q_row0 + row;
    const E* o_row = reinterpret_cast<const E*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride + qrow * p.o_row_stride;
    const E* do_row =
        reinterpret_cast<const E*>(p.dout) + batch * p.do_batch_stride + head * p.do_head_stride + qrow * p.do_row_stride;
    for (int col = sub; col < p.head_dim; col += PREPROCESS_LANES) delta += Acc(o_row[col]) * Acc(do_row[col]);
  }
#pragma unroll
  for (int x = PREPROCESS_LANES / 2; x > 0; x >>= 1) delta += __shfl_xor_sync(0xffffffffu, delta, x);
  if (row >= (seq.len_q + PAD_ROWS - 1) / PAD_ROWS * PAD_ROWS) return;
  const long long vec = padded_row0(p.seq, batch, head, p.heads, p.seqlen_q_pad) + row;
  if (sub == 0) {
    Acc lse_log2 = -neg_inf();  // pad rows and rows without keys: P = exp2(S - inf) = 0
    if (row < seq.len_q) {
      const Acc lse = reinterpret_cast<const Acc*>(p.lse)[batch * p.lse_batch_stride + head * p.lse_head_stride +
                                                          (seq.q_row0 + row) * p.lse_row_stride];
      if (lse != Acc(neg_inf())) lse_log2 = lse * AccOps<Acc>::log2e();
    }
    reinterpret_cast<Acc*>(p.delta)[vec] = delta;
    reinterpret_cast<Acc*>(p.lse_log2)[vec] = lse_log2;
  }
  if (p.dq_turns != nullptr && sub == 0 && vec % WIDE_TURN_ROWS == 0) p.dq_turns[vec / WIDE_TURN_ROWS] = 0;
  if (p.dq_accum != nullptr) {
    Acc* acc = reinterpret_cast<Acc*>(p.dq_accum) + vec * p.dq_accum_cols;
    for (int col = sub; col < p.dq_accum_cols; col += PREPROCESS_LANES) acc[col] = Acc(0);
  }
}

template <class E, class Acc>
__global__ void __launch_bounds__(CONVERT_THREADS) bwd_wide_convert_dq_kernel(const BwdParams p) {
  const int head = blockIdx.y, batch = blockIdx.z;
  const Seq seq = sequence(p.seq, batch);
  const int idx = blockIdx.x * CONVERT_THREADS + threadIdx.x;
  const int pairs = p.head_dim / 2;
  const int row = idx / pairs, col = (idx % pairs) * 2;
  if (row >= seq.len_q) return;
  const Acc* src = reinterpret_cast<const Acc*>(p.dq_accum) +
                   (padded_row0(p.seq, batch, head, p.heads, p.seqlen_q_pad) + row) * p.dq_accum_cols + col;
  const Acc s = AccOps<Acc>::scale_log2(p.softmax_scale, p.softmax_scale_d);
  store_pair(reinterpret_cast<E*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride +
                 static_cast<long long>(seq.q_row0 + row) * p.dq_row_stride + col,
             src[0] * s, src[1] * s);
}

template <int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int WARPS_, int D_SPLIT_, class M_>
struct WideBwdTraits {
  using M = M_;
  using E = typename M::E;
  using Acc = typename M::Acc;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;  // query rows per step
  static constexpr int BLOCK_N = BLOCK_N_;  // keys per CTA
  static constexpr int WARPS = WARPS_;
  static constexpr int D_SPLIT = D_SPLIT_;  // warps sharing 16 keys, each with HEAD_DIM / D_SPLIT columns of dK, dV
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int KEY_WARPS = WARPS / D_SPLIT;
  static constexpr int Q_TILES = BLOCK_M / 8;
  static constexpr int DKV_COLS = HEAD_DIM / D_SPLIT;
  static constexpr int DKV_TILES = DKV_COLS / 8;
  static constexpr int DQ_WARPS_M = (WARPS < BLOCK_M / 16) ? WARPS : BLOCK_M / 16;
  static constexpr int DQ_WARPS_D = WARPS / DQ_WARPS_M;
  static constexpr int DQ_M_TILES = BLOCK_M / 16 / DQ_WARPS_M;
  static constexpr int DQ_D_TILES = HEAD_DIM / 8 / DQ_WARPS_D;
  static constexpr int PITCH = HEAD_DIM + 4;
  static constexpr int DS_PITCH = BLOCK_N + 4;  // dS [query][key]
  static constexpr int SMEM_KV = BLOCK_N * PITCH * sizeof(E);
  static constexpr int SMEM_Q = BLOCK_M * PITCH * sizeof(E);
  static constexpr int SMEM_ROWVEC = BLOCK_M * sizeof(Acc);
  // K, V, 2 stages of (Q, dO), dS, 2 stages of (lse_log2, delta)
  static constexpr int OFF_K = 0;
  static constexpr int OFF_V = SMEM_KV;
  static constexpr int OFF_Q = 2 * SMEM_KV;  // + stage * 2 * SMEM_Q
  static constexpr int OFF_DO = OFF_Q + SMEM_Q;
  static constexpr int OFF_DS = 2 * SMEM_KV + 4 * SMEM_Q;
  static constexpr int OFF_LSE = OFF_DS + BLOCK_M * DS_PITCH * sizeof(Acc);  // + stage * 2 * SMEM_ROWVEC
  static constexpr int OFF_DELTA = OFF_LSE + SMEM_ROWVEC;
  // D_SPLIT > 1: each warp's partial S^T / dP^T (its head-dim slice), [warp][Q_TILES * 4][lane], read by the other
  // warps of its key group
  static constexpr int OFF_XCHG = OFF_LSE + 4 * SMEM_ROWVEC;
  static constexpr int SMEM_XCHG = D_SPLIT > 1 ? WARPS * Q_TILES * 4 * 32 * static_cast<int>(sizeof(Acc)) : 0;
  static constexpr int SMEM_BYTES = OFF_XCHG + SMEM_XCHG;

  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "HEAD_DIM: a multiple of 32 (the pitch rule), at most 256");
  static_assert(WARPS % D_SPLIT == 0 && BLOCK_N == 16 * KEY_WARPS, "each key group owns 16 keys");
  static_assert(KEY_WARPS <= 15, "one named barrier (1..15) per key group");
  static_assert(Q_TILES % M::ACC_TILES == 0 && BLOCK_N % M::K == 0, "whole mma k-steps over queries and keys");
  static_assert(BLOCK_M % 16 == 0 && (DS_PITCH * sizeof(Acc)) % 16 == 0, "m16 dQ tiles; 16-byte rows of dS");
  static_assert(WARPS % DQ_WARPS_M == 0 && (HEAD_DIM / 8) % DQ_WARPS_D == 0, "the dQ warp grid tiles the result");
  static_assert(SMEM_ROWVEC % 16 == 0 && OFF_LSE % 16 == 0, "16-byte chunks of lse_log2 and delta");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory per CTA exceeds the sm_90 limit");
};

// Key block n0 / BLOCK_N's turn on the dQ of the query block that starts at row m0 (an ordered backward; bwd.cuh's
// ordered_dq_turn).
template <class Tr, bool IS_CAUSAL, bool HAS_WINDOW>
__device__ __forceinline__ int wide_dq_turn(const Band<IS_CAUSAL, HAS_WINDOW>& band, int m0, int n0) {
  return ordered_dq_turn<Tr::BLOCK_N, IS_CAUSAL || HAS_WINDOW>(m0, n0 / Tr::BLOCK_N,
                                                               (band.seqlen_k + Tr::BLOCK_N - 1) / Tr::BLOCK_N - 1,
                                                               ordered_dq_reach<Tr::BLOCK_M>(band));
}

// One query block of a K/V-outer CTA: S^T, P^T, dV, dP^T, dS^T, dK, and dQ_acc += dS K. ORDERED: the dQ GEMM and
// its adds wait until the block's turn counter equals this key block's turn (the caller increments it after the
// step's closing barrier); the turn is computed then, by the waiting thread, so that it holds no register through
// the block.
template <class Tr, bool IS_CAUSAL, bool IS_MASKED, int MODS, bool ORDERED>
__device__ __forceinline__ void bwd_wide_query_block(const BwdParams& p,
                                                     const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                                     const ScoreMods<MODS>& mods, unsigned char* smem, int stage, int m0,
                                                     int n0, long long vec_row, int warp, int lane,
                                                     typename Tr::Acc (&dk_acc)[Tr::DKV_TILES][4],
                                                     typename Tr::Acc (&dv_acc)[Tr::DKV_TILES][4]) {
  using M = typename Tr::M;
  using E = typename Tr::E;
  using Acc = typename Tr::Acc;
  using Mods = ScoreMods<MODS>;
  const int g = lane >> 2, t = lane & 3;
  const int key_row0 = (warp / Tr::D_SPLIT) * 16;
  const int d_col0 = (warp % Tr::D_SPLIT) * Tr::DKV_COLS;
  const E* k_s = reinterpret_cast<const E*>(smem + Tr::OFF_K);
  const E* v_s = reinterpret_cast<const E*>(smem + Tr::OFF_V);
  const E* q_s = reinterpret_cast<const E*>(smem + Tr::OFF_Q + stage * 2 * Tr::SMEM_Q);
  const E* do_s = reinterpret_cast<const E*>(smem + Tr::OFF_DO + stage * 2 * Tr::SMEM_Q);
  Acc* ds_s = reinterpret_cast<Acc*>(smem + Tr::OFF_DS);
  const Acc* lse_log2_s = reinterpret_cast<const Acc*>(smem + Tr::OFF_LSE + stage * 2 * Tr::SMEM_ROWVEC);
  const Acc* delta_s = reinterpret_cast<const Acc*>(smem + Tr::OFF_DELTA + stage * 2 * Tr::SMEM_ROWVEC);
  const Acc scale_log2 = AccOps<Acc>::scale_log2(p.scale_log2, p.scale_log2_d);

  // S^T = K Q^T (16 keys x BLOCK_M queries per warp); dP^T = V dO^T the same way (bounded chains over the head dim).
  // With D_SPLIT > 1 the warps of a key group each sum their own head-dim slice [d_col0, + DKV_COLS) and add the
  // group's partial sums through shared memory, every warp in the same order (slice 0 first), so all of them hold
  // the same S^T: each product is computed once instead of D_SPLIT times. For float32 the slices are whole bounded
  // chains (DKV_COLS is a multiple of CHAIN_K), so the sums are those of the unsplit chains; float64's one DMMA chain
  // over the head dim would become D_SPLIT chains added in order: its dP^T does, its S^T is split by queries (below).
  static_assert(Tr::D_SPLIT == 1 || M::CHAIN_K == 0 || Tr::DKV_COLS % M::CHAIN_K == 0, "slices of whole chains");
  Acc* xchg = reinterpret_cast<Acc*>(smem + Tr::OFF_XCHG);
  auto gemm_nt = [&](Acc (&acc)[Tr::Q_TILES][4], const E* a_s, const E* b_s) {
    constexpr int COLS = Tr::HEAD_DIM / Tr::D_SPLIT;
    const int col0 = Tr::D_SPLIT > 1 ? d_col0 : 0;
    zero_acc(acc);
    bounded_chains<M, COLS>(acc, [&](Acc (&part)[Tr::Q_TILES][4], int k_begin, int k_end) {
#pragma unroll 4
      for (int k0 = col0 + k_begin; k0 < col0 + k_end; k0 += M::K) {
        const typename M::A a = M::load_a([&](int r, int k) { return a_s[(key_row0 + r) * Tr::PITCH + k0 + k]; }, g, t);
#pragma unroll
        for (int qt = 0; qt < Tr::Q_TILES; ++qt)
          M::mma(part[qt], a, M::load_b([&](int k, int n) { return b_s[(qt * 8 + n) * Tr::PITCH + k0 + k]; }, g, t));
      }
    });
  };
  // the partial sums of a key group's warps, added in slice order (bar.sync of the group's D_SPLIT warps, ids 1..)
  auto sum_slices = [&](Acc (&acc)[Tr::Q_TILES][4]) {
    if constexpr (Tr::D_SPLIT > 1) {
      const int group = warp / Tr::D_SPLIT, slice = warp % Tr::D_SPLIT;
#pragma unroll
      for (int i = 0; i < Tr::Q_TILES * 4; ++i) xchg[(warp * Tr::Q_TILES * 4 + i) * 32 + lane] = acc[i / 4][i % 4];
      named_barrier_sync(1 + group, 32 * Tr::D_SPLIT);
#pragma unroll
      for (int i = 0; i < Tr::Q_TILES * 4; ++i) {
        Acc sum = slice == 0 ? acc[i / 4][i % 4] : xchg[((group * Tr::D_SPLIT) * Tr::Q_TILES * 4 + i) * 32 + lane];
#pragma unroll
        for (int s = 1; s < Tr::D_SPLIT; ++s)
          sum += s == slice ? acc[i / 4][i % 4] : xchg[((group * Tr::D_SPLIT + s) * Tr::Q_TILES * 4 + i) * 32 + lane];
        acc[i / 4][i % 4] = sum;
      }
    }
  };
  // before a warp overwrites its exchange slot: the other warps of its group have read the previous sums
  auto slots_free = [&]() {
    if constexpr (Tr::D_SPLIT > 1) named_barrier_sync(1 + warp / Tr::D_SPLIT, 32 * Tr::D_SPLIT);
  };
  // acc (dK or dV columns d_col0..) += X^T Y: X^T from the accumulators x[Q_TILES][4], Y [query][d] in shared memory.
  // One chain per query block (BLOCK_M <= 64), summed in zeroed registers ACC_TILES column tiles at a time and added
  // to acc (bounded chains: acc sums over the whole query loop); the float64 kernels add into acc directly.
  static_assert(Tr::BLOCK_M <= 64 || M::CHAIN_K == 0, "one chain of dK / dV per query block of at most 64 rows");
  constexpr int ACC_TILES = M::CHAIN_K == 0 ? Tr::DKV_TILES : (Tr::DKV_TILES < 8 ? Tr::DKV_TILES : 8);
  auto gemm_acc = [&](Acc (&acc)[Tr::DKV_TILES][4], const Acc (&x)[Tr::Q_TILES][4], const E* y_s) {
#pragma unroll
    for (int d0 = 0; d0 < Tr::DKV_TILES; d0 += ACC_TILES) {
      Acc part[ACC_TILES][4];
      if (M::CHAIN_K != 0) zero_acc(part);
      auto target = [&](int dt) -> Acc(&)[4] {
        if constexpr (M::CHAIN_K == 0) return acc[d0 + dt];
        else return part[dt];
      };
#pragma unroll
      for (int qt = 0; qt < Tr::Q_TILES; qt += M::ACC_TILES)
#pragma unroll
        for (int s = 0; s < M::ACC_STEPS; ++s) {
          const typename M::A a = M::a_of_acc(&x[qt], s);
#pragma unroll
          for (int dt = 0; dt < ACC_TILES; ++dt)
            M::mma(target(dt), a, M::load_b_acc([&](int k, int n) {
              return y_s[(qt * 8 + k) * Tr::PITCH + d_col0 + (d0 + dt) * 8 + n];
            }, s, g, t));
        }
      if (M::CHAIN_K != 0)
#pragma unroll
        for (int dt = 0; dt < ACC_TILES; ++dt)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[d0 + dt][c] += part[dt][c];
    }
  };

  // float64 with D_SPLIT > 1: S^T split by queries, not by head dim, among the warps of a key group, so that each
  // score is one DMMA chain over the head dim in column order, as the forward sums S: P^T = exp2(S^T scale_log2 -
  // lse_log2) is then the forward's P to the last bit. (As D_SPLIT chains added at the end, S^T differed from the
  // forward's S by rounding, ~1e-11 at scores of ~1500, and dQ, which multiplies dS by keys of that size, was 30-40x
  // further from the exact gradient than plain float64 attention: test_float64_scores_rising_across_key_tiles in
  // tests/test_gpu_wide.py.) A warp owns QS query tiles (where a group has more warps than query tiles, as the
  // deterministic head dim 128 on sm_80, its first Q_TILES warps one tile each), computes their S^T and P^T and passes
  // P^T through its exchange slot; every warp reads the group's whole P^T for dV on its own head-dim slice. dP^T has
  // no forward to match and keeps the head-dim split (sum_slices), every warp computing the whole dS^T. On an H100 the
  // head-dim-128 backward takes the time of the S^T split by head dim (and a chain passed from warp to warp of the
  // group, 17 % more; dP^T split by queries too, 5 % more: a warp's one query tile per K fragment reads 1.5x the
  // shared bytes per DMMA).
  constexpr bool OWN_QUERIES = sizeof(Acc) == 8 && Tr::D_SPLIT > 1;
  if constexpr (OWN_QUERIES) {
    static_assert(!Mods::CHANGES_SCORES && !Mods::HAS_DROPOUT && !Mods::HAS_BIAS, "float64 takes the window alone");
    constexpr int QS = Tr::Q_TILES >= Tr::D_SPLIT ? Tr::Q_TILES / Tr::D_SPLIT : 1;  // query tiles a warp owns
    constexpr int OWNERS = Tr::Q_TILES / QS;                                         // owners in a key group
    static_assert(Tr::Q_TILES % QS == 0 && OWNERS <= Tr::D_SPLIT, "whole query tiles per owner");
    const int group = warp / Tr::D_SPLIT, slice = warp % Tr::D_SPLIT, qt0 = slice * QS;
    // element i of warp w's P^T tiles in its exchange slot (sum_slices' slots, [warp][Q_TILES * 4][lane], so that
    // a group's sums below never write into another group's P^T)
    auto slot = [&](int w, int i) -> Acc& { return xchg[(w * Tr::Q_TILES * 4 + i) * 32 + lane]; };
    if (OWNERS == Tr::D_SPLIT || slice < OWNERS) {
      Acc p_own[QS][4];
      zero_acc(p_own);
#pragma unroll 4
      for (int k0 = 0; k0 < Tr::HEAD_DIM; k0 += M::K) {
        const typename M::A a = M::load_a([&](int r, int k) { return k_s[(key_row0 + r) * Tr::PITCH + k0 + k]; }, g, t);
#pragma unroll
        for (int qt = 0; qt < QS; ++qt)
          M::mma(p_own[qt], a,
                 M::load_b([&](int k, int n) { return q_s[((qt0 + qt) * 8 + n) * Tr::PITCH + k0 + k]; }, g, t));
      }
      if (IS_MASKED)
        apply_band_mask_transposed<IS_CAUSAL, Mods::HAS_WINDOW, QS>(p_own, n0 + key_row0, m0 + qt0 * 8, band, lane);
#pragma unroll
      for (int qt = 0; qt < QS; ++qt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          slot(warp, qt * 4 + c) =
              exp2_of(fma_of(p_own[qt][c], scale_log2, -lse_log2_s[(qt0 + qt) * 8 + 2 * t + (c & 1)]));
    }
    // this warp's slice of dP^T while the group's other owners finish their P^T
    Acc dp_acc[Tr::Q_TILES][4];
    gemm_nt(dp_acc, v_s, do_s);
    named_barrier_sync(1 + group, 32 * Tr::D_SPLIT);
    Acc p_all[Tr::Q_TILES][4];
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
      for (int c = 0; c < 4; ++c) p_all[qt][c] = slot(group * Tr::D_SPLIT + qt / QS, (qt % QS) * 4 + c);
    gemm_acc(dv_acc, p_all, do_s);  // dV += P^T dO
    slots_free();
    sum_slices(dp_acc);
    // dS^T = P^T (dP^T - delta[query])
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
      for (int c = 0; c < 4; ++c) dp_acc[qt][c] = p_all[qt][c] * (dp_acc[qt][c] - delta_s[qt * 8 + 2 * t + (c & 1)]);
    gemm_acc(dk_acc, dp_acc, q_s);  // dK += dS^T Q (softmax_scale applied at the end)
    if (slice == 0) {  // dS [query][key] for the dQ GEMM, one warp per key group
#pragma unroll
      for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          ds_s[(qt * 8 + 2 * t + (c & 1)) * Tr::DS_PITCH + key_row0 + g + 8 * (c >> 1)] = dp_acc[qt][c];
    }
  } else {
    Acc s_acc[Tr::Q_TILES][4];
    gemm_nt(s_acc, k_s, q_s);
    sum_slices(s_acc);
    float dcap[Tr::Q_TILES][4];  // the softcap's derivative (float32 kernels with MOD_SOFTCAP)
    if constexpr (Mods::CHANGES_SCORES) apply_score_mods_transposed(s_acc, dcap, n0 + key_row0, m0, band.diag, mods, lane);
    if (IS_MASKED)
      apply_band_mask_transposed<IS_CAUSAL, Mods::HAS_WINDOW, Tr::Q_TILES>(s_acc, n0 + key_row0, m0, band, lane);
    // P^T = exp2(S^T * scale_log2 - lse_log2[query])
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        s_acc[qt][c] = exp2_of(fma_of(s_acc[qt][c], scale_log2, -lse_log2_s[qt * 8 + 2 * t + (c & 1)]));

    u32 keep = ~0u;
    if constexpr (Mods::HAS_DROPOUT) keep = dropout_keep_transposed<MODS, Tr::Q_TILES>(n0 + key_row0, m0, mods, lane);
    // dV += P^T dO (dropout: the kept P^T; 1 / (1 - p) applied at the end)
    if constexpr (Mods::HAS_DROPOUT) {
      Acc p_drop[Tr::Q_TILES][4];
#pragma unroll
      for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
        for (int c = 0; c < 4; ++c) p_drop[qt][c] = ((keep >> (4 * qt + c)) & 1) ? s_acc[qt][c] : Acc(0);
      gemm_acc(dv_acc, p_drop, do_s);
    } else {
      gemm_acc(dv_acc, s_acc, do_s);
    }

    Acc dp_acc[Tr::Q_TILES][4];
    gemm_nt(dp_acc, v_s, do_s);
    slots_free();
    sum_slices(dp_acc);
    // dS^T = P^T (dP^T - delta[query]) (dropout, softcap: ds_of)
#pragma unroll
    for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const Acc delta = delta_s[qt * 8 + 2 * t + (c & 1)];
        if constexpr (sizeof(Acc) == 4)
          dp_acc[qt][c] = ds_of<MODS>(s_acc[qt][c], dp_acc[qt][c], delta, (keep >> (4 * qt + c)) & 1, p.mods.dropout_rp,
                                      Mods::HAS_SOFTCAP ? dcap[qt][c] : 1.f);
        else
          dp_acc[qt][c] = s_acc[qt][c] * (dp_acc[qt][c] - delta);
      }
    if constexpr (Mods::HAS_BIAS)
      if (warp % Tr::D_SPLIT == 0) put_dbias_transposed(dp_acc, n0 + key_row0, m0, mods, lane);
    // dK += dS^T Q (softmax_scale applied at the end)
    gemm_acc(dk_acc, dp_acc, q_s);

    // dS [query][key] into shared memory (one warp per key group), then dQ_acc += dS K over a warp grid
    if (warp % Tr::D_SPLIT == 0) {
#pragma unroll
      for (int qt = 0; qt < Tr::Q_TILES; ++qt)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          ds_s[(qt * 8 + 2 * t + (c & 1)) * Tr::DS_PITCH + key_row0 + g + 8 * (c >> 1)] = dp_acc[qt][c];
    }
  }
  // ordered: this CTA's turn on the block (the key blocks before it have added theirs), waited for by thread 0
  // before the barrier that opens the dQ GEMM (waited for after it, with the dQ tile live, the float64 kernels
  // spilled 4-48 bytes)
  if (ORDERED && threadIdx.x == 0)
    wait_counter_or_trap(p.dq_turns + vec_row / WIDE_TURN_ROWS, wide_dq_turn<Tr>(band, m0, n0));
  __syncthreads();
  const int warp_m = warp / Tr::DQ_WARPS_D, warp_d = warp % Tr::DQ_WARPS_D;
  constexpr int DQ_TILES = Tr::DQ_M_TILES * Tr::DQ_D_TILES;  // [mt][dt] flattened: mt * DQ_D_TILES + dt
  Acc dq_acc[DQ_TILES][4];
  zero_acc(dq_acc);
  bounded_chains<M, Tr::BLOCK_N>(dq_acc, [&](Acc (&part)[DQ_TILES][4], int k_begin, int k_end) {
#pragma unroll 2
    for (int k0 = k_begin; k0 < k_end; k0 += M::K) {
      typename M::A a[Tr::DQ_M_TILES];
#pragma unroll
      for (int mt = 0; mt < Tr::DQ_M_TILES; ++mt)
        a[mt] = M::load_a(
            [&](int r, int k) { return ds_s[((warp_m * Tr::DQ_M_TILES + mt) * 16 + r) * Tr::DS_PITCH + k0 + k]; }, g, t);
#pragma unroll
      for (int dt = 0; dt < Tr::DQ_D_TILES; ++dt) {
        const typename M::B b = M::load_b(
            [&](int k, int n) { return k_s[(k0 + k) * Tr::PITCH + (warp_d * Tr::DQ_D_TILES + dt) * 8 + n]; }, g, t);
#pragma unroll
        for (int mt = 0; mt < Tr::DQ_M_TILES; ++mt) M::mma(part[mt * Tr::DQ_D_TILES + dt], a[mt], b);
      }
    }
  });
  Acc* acc = reinterpret_cast<Acc*>(p.dq_accum) + vec_row * p.dq_accum_cols;  // pad rows exist: no bounds checks
#pragma unroll
  for (int mt = 0; mt < Tr::DQ_M_TILES; ++mt)
#pragma unroll
    for (int dt = 0; dt < Tr::DQ_D_TILES; ++dt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = (warp_m * Tr::DQ_M_TILES + mt) * 16 + g + 8 * h;
        const int col = (warp_d * Tr::DQ_D_TILES + dt) * 8 + 2 * t;
        const Acc(&d)[4] = dq_acc[mt * Tr::DQ_D_TILES + dt];
        AccOps<Acc>::red_add2(acc + row * p.dq_accum_cols + col, d[2 * h], d[2 * h + 1]);
      }
}

// Grid (key blocks, K/V heads, batch). With GQA a CTA runs the query blocks of every query head of its group, so
// dK and dV are summed over the group in registers and written once.
// ORDERED: deterministic, dQ_acc's additions in a fixed order of key blocks (the backward section's header).
template <class Tr, bool IS_CAUSAL, int MODS, bool ORDERED = false>
__global__ void __launch_bounds__(Tr::THREADS, 1) bwd_wide_kernel(const BwdParams p) {
  using E = typename Tr::E;
  using Acc = typename Tr::Acc;
  static_assert(sizeof(Acc) == 4 || (MODS & ~MOD_WINDOW) == 0, "the float64 kernels take the window alone");
  static_assert(Tr::BLOCK_M % WIDE_TURN_ROWS == 0, "a query block starts on a turn counter of its own");
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  constexpr bool BAND = IS_CAUSAL || HAS_WINDOW;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  // ordered with a band: the last key blocks launch first (their turns come first)
  const int n_block = ORDERED && BAND ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  const int batch = blockIdx.z, kv_head = blockIdx.y, n0 = n_block * Tr::BLOCK_N;
  const Seq seq = sequence(p.seq, batch);
  if (n0 >= seq.len_k) return;
  const int keys = min(Tr::BLOCK_N, seq.len_k - n0);
  const Band<IS_CAUSAL, HAS_WINDOW> band{seq.len_k, seq.len_k - seq.len_q, p.mods.window_left, p.mods.window_right};
  const int m_begin = band.query_begin(n0) / Tr::BLOCK_M;
  const int m_end = (band.query_end(n0 + keys - 1, seq.len_q) + Tr::BLOCK_M - 1) / Tr::BLOCK_M;
  const int blocks = max(0, m_end - m_begin);
  const int steps = p.seq.kv_group * blocks;
  const long long key_row = static_cast<long long>(seq.k_row0) + n0;
  E* dk_gmem = reinterpret_cast<E*>(p.dk) + batch * p.dk_batch_stride + kv_head * p.dk_head_stride + key_row * p.dk_row_stride;
  E* dv_gmem = reinterpret_cast<E*>(p.dv) + batch * p.dv_batch_stride + kv_head * p.dv_head_stride + key_row * p.dv_row_stride;
  if (steps == 0) {  // no query sees these keys: dK = dV = 0
    for (int i = tid; i < keys * p.head_dim; i += Tr::THREADS) {
      dk_gmem[(i / p.head_dim) * p.dk_row_stride + i % p.head_dim] = E(0);
      dv_gmem[(i / p.head_dim) * p.dv_row_stride + i % p.head_dim] = E(0);
    }
    return;
  }
  const u32 smem_base = smem_u32(smem);
  load_wide_tile<E, Tr::BLOCK_N, Tr::HEAD_DIM, Tr::PITCH, Tr::THREADS>(
      smem_base + Tr::OFF_K,
      reinterpret_cast<const E*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride + key_row * p.k_row_stride,
      p.k_row_stride, keys, p.head_dim, tid);
  load_wide_tile<E, Tr::BLOCK_N, Tr::HEAD_DIM, Tr::PITCH, Tr::THREADS>(
      smem_base + Tr::OFF_V,
      reinterpret_cast<const E*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride + key_row * p.v_row_stride,
      p.v_row_stride, keys, p.head_dim, tid);
  // step i: query head kv_head * kv_group + i / blocks, query block m_begin + i % blocks
  auto head_of = [&](int i) { return kv_head * p.seq.kv_group + i / blocks; };
  auto m_of = [&](int i) { return m_begin + i % blocks; };
  auto load_step = [&](int stage, int i) {
    const int head = head_of(i), m0 = m_of(i) * Tr::BLOCK_M;
    const long long row = static_cast<long long>(seq.q_row0) + m0;
    const int rows = min(Tr::BLOCK_M, seq.len_q - m0);
    load_wide_tile<E, Tr::BLOCK_M, Tr::HEAD_DIM, Tr::PITCH, Tr::THREADS>(
        smem_base + Tr::OFF_Q + stage * 2 * Tr::SMEM_Q,
        reinterpret_cast<const E*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride + row * p.q_row_stride,
        p.q_row_stride, rows, p.head_dim, tid);
    load_wide_tile<E, Tr::BLOCK_M, Tr::HEAD_DIM, Tr::PITCH, Tr::THREADS>(
        smem_base + Tr::OFF_DO + stage * 2 * Tr::SMEM_Q,
        reinterpret_cast<const E*>(p.dout) + batch * p.do_batch_stride + head * p.do_head_stride + row * p.do_row_stride,
        p.do_row_stride, rows, p.head_dim, tid);
    // lse_log2 and delta of the block (pad rows included), 16-byte chunks
    constexpr int VEC_CHUNKS = Tr::SMEM_ROWVEC / 16;
    const long long vec = padded_row0(p.seq, batch, head, p.heads, p.seqlen_q_pad) + m0;
    if (tid < 2 * VEC_CHUNKS) {
      const bool is_delta = tid >= VEC_CHUNKS;
      const int c = is_delta ? tid - VEC_CHUNKS : tid;
      const Acc* src = reinterpret_cast<const Acc*>(is_delta ? p.delta : p.lse_log2) + vec + c * (16 / sizeof(Acc));
      cp_async_cg_16(smem_base + (is_delta ? Tr::OFF_DELTA : Tr::OFF_LSE) + stage * 2 * Tr::SMEM_ROWVEC + c * 16, src, true);
    }
  };
  load_step(0, 0);
  cp_async_commit_group();

  Acc dk_acc[Tr::DKV_TILES][4], dv_acc[Tr::DKV_TILES][4];
#pragma unroll
  for (int dt = 0; dt < Tr::DKV_TILES; ++dt)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk_acc[dt][c] = dv_acc[dt][c] = Acc(0);
  const bool is_key_tail = keys < Tr::BLOCK_N;
  for (int i = 0; i < steps; ++i) {
    const int stage = i & 1;
    if (i + 1 < steps) load_step(stage ^ 1, i + 1);
    cp_async_commit_group();
    cp_async_wait_group<1>();
    __syncthreads();
    const int head = head_of(i), m0 = m_of(i) * Tr::BLOCK_M;
    ScoreMods<MODS> mods;
    mods.init(p.mods, batch, head, p.heads, seq.len_q, seq.len_k);
    const long long vec_row = padded_row0(p.seq, batch, head, p.heads, p.seqlen_q_pad) + m0;
    if (is_key_tail || band.needs_mask(m0, m0 + Tr::BLOCK_M - 1, n0, n0 + Tr::BLOCK_N - 1))
      bwd_wide_query_block<Tr, IS_CAUSAL, true, MODS, ORDERED>(p, band, mods, smem, stage, m0, n0, vec_row, warp, lane,
                                                               dk_acc, dv_acc);
    else
      bwd_wide_query_block<Tr, IS_CAUSAL, false, MODS, ORDERED>(p, band, mods, smem, stage, m0, n0, vec_row, warp, lane,
                                                                dk_acc, dv_acc);
    __syncthreads();
    if (ORDERED && tid == 0) {  // every thread's adds are issued (the barrier): the next key block's turn
      fence_acq_rel_gpu();
      red_release_gpu_add(p.dq_turns + vec_row / WIDE_TURN_ROWS, 1);
    }
  }

  // dK = softmax_scale * dK, dV (* 1 / (1 - p) with dropout), straight from the registers
  const Acc scale = AccOps<Acc>::scale_log2(p.softmax_scale, p.softmax_scale_d);
  const Acc dv_scale = ScoreMods<MODS>::HAS_DROPOUT ? Acc(p.mods.dropout_rp) : Acc(1);
  const int key_row0 = (warp / Tr::D_SPLIT) * 16, d_col0 = (warp % Tr::D_SPLIT) * Tr::DKV_COLS;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key_row0 + g + 8 * h;
    if (key >= keys) continue;
#pragma unroll
    for (int dt = 0; dt < Tr::DKV_TILES; ++dt) {
      const int col = d_col0 + dt * 8 + 2 * t;
      if (col >= p.head_dim) continue;
      store_pair(dk_gmem + static_cast<long long>(key) * p.dk_row_stride + col, dk_acc[dt][2 * h] * scale,
                 dk_acc[dt][2 * h + 1] * scale);
      store_pair(dv_gmem + static_cast<long long>(key) * p.dv_row_stride + col, dv_acc[dt][2 * h] * dv_scale,
                 dv_acc[dt][2 * h + 1] * dv_scale);
    }
  }
}

}  // namespace cuflash
