// fwd.cuh: FlashAttention-2 forward (Dao 2023, Algorithm 1) on mma.sync tensor cores.
//
// One CTA computes O and lse for BLOCK_M query rows of one (batch, head). Each warp owns WARP_ROWS
// of those rows and keeps their O accumulator in registers for the whole key loop, so O is written
// to global memory exactly once. K/V tiles stream through a cp.async pipeline of Tr::STAGES buffers
// (STAGES - 1 tiles in flight; the prefill kernels double-buffer, the decode kernels take config.DECODE_STAGES).
// Sequences may be dense or packed (varlen), and K/V may have fewer heads than Q (GQA); seqs.cuh.
//
// IS_DECODE (attention_with_kvcache) adds what decoding needs, at run time:
//   * keys per sequence from seqused_k, from the cache entry cache_batch_idx[b] (dense caches) and from cache
//     row leftpad_k[b] on, read from a paged cache through block_table: whole tiles from one page when
//     page_size and the first row are multiples of BLOCK_N, else row by row (page sizes multiple of 16);
//   * split-KV: blockIdx.z = batch * num_splits + split; split s takes an equal share of the key tiles
//     and writes its own normalized O and lse (fp32); the last split of a row block to finish merges them
//     (fwd_decode_merge_if_last), or fwd_combine_kernel does in a second launch;
//   * packed query heads: grid.y runs over K/V heads and tile row r is query position r / rows_per_pos
//     of query head kv_head * rows_per_pos + r % rows_per_pos, so one K/V tile read serves every query
//     head of its group (the rows of one position are the group's heads).
#pragma once
#include "ptx.cuh"
#include "traits.cuh"
#include "tiles.cuh"
#include "mask.cuh"
#include "mods.cuh"
#include "softmax.cuh"
#include "seqs.cuh"

namespace cuflash {

// Kernel arguments, passed by value. Mirrored by cuflash/_launch.py:FwdParams (ctypes).
struct FwdParams {
  const u16* q;  // [batch, seqlen_q, heads, head_dim] (varlen: [total_q, heads, head_dim]) at the strides below
  const u16* k;  // [batch, seqlen_k, kv_heads, head_dim] (paged: [num_pages, page_size, kv_heads, head_dim])
  const u16* v;  // like k
  u16* o;        // like q
  float* lse;    // lse[batch * lse_batch_stride + head * lse_head_stride + q_row0 + row], natural log; nullptr:
                 // not written (attention() discards it; the decode kernel always writes it)
  SeqParams seq;
  const int* block_table;  // decode, paged: [batch, block_table_stride] page of each key tile, or nullptr
  float* o_accum;          // decode, num_splits > 1: [num_splits, batch, heads, seqlen_q, HEAD_DIM] fp32
  float* lse_accum;        // decode, num_splits > 1: [num_splits, batch, heads, seqlen_q] fp32
  int* split_counters;     // decode, num_splits > 1: two per row block (splits arrived, published), zero
                           // between launches (the last to arrive merges); nullptr: fwd_combine_kernel merges
                           // in a second launch
  long long q_batch_stride, q_row_stride, q_head_stride;
  long long k_batch_stride, k_row_stride, k_head_stride;
  long long v_batch_stride, v_row_stride, v_head_stride;
  long long o_batch_stride, o_row_stride, o_head_stride;
  long long lse_batch_stride, lse_head_stride;
  long long k_page_stride, v_page_stride;  // decode, paged: elements from one page to the next
  int heads;           // query heads
  int head_dim;        // run-time head dim <= HEAD_DIM; columns beyond it are zero in shared memory
  int block_table_stride;
  int page_size;       // decode, paged: keys per page, a multiple of 16 (config.DECODE_PAGE_MULTIPLE)
  int num_splits;      // decode: CTAs sharing one row block's keys (1: no split)
  int rows_per_pos;    // decode: query heads packed per position (the GQA group size), else 1
  float scale_log2;    // softmax_scale * log2(e)
  int accum_cols;      // decode, num_splits > 1: row length of o_accum (the kernel's HEAD_DIM)
  ModParams mods;      // score modifiers (mods.cuh), read by kernels instantiated with MODS != 0
  double scale_log2_d; // softmax_scale * log2(e) in float64 (the float64 kernels, wide.cuh)
  const int* cache_batch_idx;  // decode, dense cache: [batch] cache entry of each batch entry, or nullptr
  const int* leftpad_k;        // decode: [batch] first cache row of each sequence's keys, or nullptr: 0
};
static_assert(sizeof(FwdParams) == 520, "FwdParams is mirrored field by field in cuflash/_launch.py");

// ALiBi of packed decode rows: tile row r is query position r / rows_per_pos of query head r % rows_per_pos of
// the group, whose slope is group_slopes[r % rows_per_pos] (times alibi_scale: raw score units).
template <int M_TILES, int N_TILES>
__device__ __forceinline__ void apply_alibi_packed(float (&s)[M_TILES][N_TILES][4], int row0, int col0, int diag,
                                                   const float* group_slopes, float alibi_scale, int rows_per_pos,
                                                   int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mt * 16 + g + 8 * h;
      const int pos = row / rows_per_pos;
      const float slope = __ldg(group_slopes + row % rows_per_pos) * alibi_scale;
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int c = 2 * h; c < 2 * h + 2; ++c)
          s[mt][nt][c] -= slope * static_cast<float>(abs(pos + diag - (col0 + nt * 8 + 2 * t + (c & 1))));
    }
}

// One key tile: S = Q K_j^T, online softmax, O += P V_j. The next tile's loads are already in flight.
// q_lane, k_lane, v_lane: this lane's ldmatrix addresses of the (0, 0) blocks (tiles.cuh).
// key0: the tile's first key. group_slopes: packed decode with ALiBi (else unused), see apply_alibi_packed.
template <class Tr, bool IS_CAUSAL, bool IS_MASKED, bool IS_PACKED, int MODS>
__device__ __forceinline__ void fwd_key_tile(const Band<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW>& band,
                                             const ScoreMods<MODS>& mods, const float* group_slopes, float alibi_scale,
                                             int rows_per_pos, float scale_log2, int key0,
                                             u32 q_lane, u32 k_lane, u32 v_lane, int warp_row0, int row0, int lane,
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

  // softcap, ALiBi (mods.cuh); then the tail of K, the causal diagonal, the window: masked scores = -inf
  float unused_dcap[Tr::M_TILES][Tr::N_TILES][4];
  apply_score_mods(s_acc, unused_dcap, row0 + warp_row0, key0, band.diag, mods, lane);
  if constexpr (IS_PACKED && ScoreMods<MODS>::HAS_ALIBI)  // after the softcap, before the masks, as score() orders them
    apply_alibi_packed(s_acc, row0 + warp_row0, key0, band.diag, group_slopes, alibi_scale, rows_per_pos, lane);
  if (IS_MASKED)
    apply_band_mask<IS_CAUSAL, ScoreMods<MODS>::HAS_WINDOW, Tr::M_TILES, Tr::N_TILES, IS_PACKED>(
        s_acc, row0 + warp_row0, key0, band, lane, rows_per_pos);

  // m_new = max(m, rowmax(S)); O *= exp2(m - m_new); P = exp2(S*scale_log2 - m_new)
  softmax.update(s_acc, o_acc, scale_log2);
  apply_dropout(s_acc, row0 + warp_row0, key0, mods, lane);  // after the row sums: lse is undropped

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

// First element of key tile n_block of one sequence and K/V head in a contiguous cache (a paged one: load_kv).
template <class Tr>
__device__ __forceinline__ const u16* kv_tile_gmem(const u16* seq_gmem, long long row_stride, int n_block) {
  return seq_gmem + static_cast<long long>(n_block) * Tr::BLOCK_N * row_stride;
}

// key / page_size for cache rows 0 <= key < 2^31 and page sizes 16 <= d < 2^31: one 32 x 32 -> 64-bit multiply and a
// shift by a multiplier made once per CTA (a division by a run-time value is ~20 instructions, a MUFU reciprocal
// among them, and a paged tile's block-table load waits on it). With s = ceil(log2 d) and m = floor(2^(31+s) / d)
// + 1 = 2^(31+s) / d + e, 0 < e <= 1 (m < 2^32 as 2^s < 2d), key * m / 2^(31+s) exceeds key / d by key e / 2^(31+s)
// < 1 / d, so the floor is key / d's (tests/test_compile.py checks the formula against integer division).
struct PageDivisor {
  u32 mul;
  int shift;
  __device__ __forceinline__ PageDivisor() : mul(0), shift(0) {}
  __device__ __forceinline__ explicit PageDivisor(int d) : shift(31 + 32 - __clz(d - 1)) {
    mul = static_cast<u32>((1ull << shift) / static_cast<u32>(d)) + 1u;
  }
  __device__ __forceinline__ int div(int key) const {
    return static_cast<int>((static_cast<u64>(static_cast<u32>(key)) * mul) >> shift);
  }
};

// The rows of a paged decode cache's key tile that straddles pages (a page size or a first row that is not a
// multiple of the tile's rows), for load_tile_rows_async: cache rows key0 + r. The tile's pages are looked up once
// per warp, lane l loading entry first + l of the sequence's block-table row (a tile of ROWS rows spans at most
// ROWS / 16 + 1 pages of 16 rows or more), and a row takes its page from that lane by a shuffle. rows() gives a
// cursor over the K and V caches (their rows share pages) that keeps a row's place in its page and its page's lane:
// seek() walks from the tile's first row by subtractions (at most ROWS / 16), advance<STEP>() by at most STEP / 16
// of them, with no division and no load. (A division and a block-table load before each 16-byte copy made 16- and
// 48-row pages decode 2.5-2.8x slower than 64-row ones.) Every lane of the warp must call ptr() equally often, as
// load_tile_rows_async does.
template <int ROWS>
struct PagedTileRows {
  static_assert(ROWS / 16 + 1 <= 32, "a tile's pages are one per lane");
  int start, page_size, my_page;  // start: the tile's first row within its first page
  __device__ __forceinline__ PagedTileRows(const FwdParams& p, const PageDivisor& pages, int batch, int key0,
                                           int rows_valid, int lane)
      : page_size(p.page_size) {
    const int* table = p.block_table + static_cast<long long>(batch) * p.block_table_stride;
    const int first = pages.div(key0), last = pages.div(key0 + rows_valid - 1);
    start = key0 - first * page_size;
    my_page = first + lane <= last ? table[first + lane] : 0;  // (page 0 past the tile's pages: valid memory)
  }
  struct Cursor {  // K and V: tiles 0 and 1
    static constexpr int TILES = 2;
    static constexpr bool IN_BOUNDS = true;  // every row, valid or not, lies in a page of the cache
    const u16* my_base[2];  // this lane's page of each cache
    long long row_stride[2];
    int page_size, in_page, idx;  // the row within its page, the page's lane
    __device__ __forceinline__ void seek(int r) {  // r < ROWS: at most ROWS / 16 steps
      idx = 0;
      while (in_page + r >= page_size) {
        r -= page_size;
        ++idx;
      }
      in_page += r;
    }
    template <int STEP>
    __device__ __forceinline__ void advance() {  // pages hold 16 rows or more
      in_page += STEP;
#pragma unroll
      for (int k = 0; k < (STEP + 15) / 16; ++k)
        if (in_page >= page_size) {
          in_page -= page_size;
          ++idx;
        }
    }
    __device__ __forceinline__ const u16* ptr(int j) const {
      const u64 base = reinterpret_cast<u64>(my_base[j]);
      const u32 lo = __shfl_sync(0xffffffffu, static_cast<u32>(base), idx);
      const u32 hi = __shfl_sync(0xffffffffu, static_cast<u32>(base >> 32), idx);
      return reinterpret_cast<const u16*>((static_cast<u64>(hi) << 32) | lo) +
             static_cast<u32>(in_page) * row_stride[j];
    }
  };
  // a cursor over the K and V caches, from the tile's first row
  __device__ __forceinline__ Cursor rows(const FwdParams& p, const u16* k_cache, const u16* v_cache) const {
    return Cursor{{k_cache + my_page * p.k_page_stride, v_cache + my_page * p.v_page_stride},
                  {p.k_row_stride, p.v_row_stride}, page_size, start, 0};
  }
};

// Decode epilogue: each thread writes its own rows straight from registers (a decode tile has few valid
// rows, so no staging through shared memory): the final O and lse when num_splits == 1, else this
// split's normalized O and its lse in fp32 for fwd_combine_kernel. IS_EMPTY: these rows saw no key
// (o_acc, lse not read): O = 0, lse = -inf.
template <class Tr, bool IS_EMPTY>
__device__ __forceinline__ void fwd_decode_epilogue(const FwdParams& p, const float (&o_acc)[Tr::M_TILES][Tr::D_TILES][4],
                                                    const float (&lse)[Tr::M_TILES][2], int batch, int split, int head,
                                                    const Seq& seq, int row0, int rows_q, int warp_row0, int lane) {
  using T = typename Tr::T;
  const int g = lane >> 2, t = lane & 3;
  const int batches = static_cast<int>(gridDim.z) / p.num_splits;
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_row0 + mt * 16 + g + h * 8;
      if (r >= rows_q) continue;
      const int pos = (row0 + r) / p.rows_per_pos;
      const int head_q = head * p.rows_per_pos + (row0 + r) % p.rows_per_pos;  // head: grid.y
      const float row_lse = IS_EMPTY ? neg_inf() : lse[mt][h];
      if (p.num_splits > 1) {
        const long long vec = ((static_cast<long long>(split) * batches + batch) * p.heads + head_q) * p.seq.seqlen_q + pos;
        float* o_row = p.o_accum + vec * p.accum_cols;
#pragma unroll
        for (int dt = 0; dt < Tr::D_TILES; ++dt)
          *reinterpret_cast<float2*>(o_row + dt * 8 + 2 * t) =
              IS_EMPTY ? make_float2(0.f, 0.f) : make_float2(o_acc[mt][dt][2 * h], o_acc[mt][dt][2 * h + 1]);
        if (t == 0) p.lse_accum[vec] = row_lse;
      } else {
        u16* o_row = p.o + batch * p.o_batch_stride + static_cast<long long>(seq.q_row0 + pos) * p.o_row_stride +
                     head_q * p.o_head_stride;
#pragma unroll
        for (int dt = 0; dt < Tr::D_TILES; ++dt)
          if (dt * 8 < p.head_dim)
            *reinterpret_cast<u32*>(o_row + dt * 8 + 2 * t) =
                IS_EMPTY ? 0u : Cvt<T>::pack(o_acc[mt][dt][2 * h], o_acc[mt][dt][2 * h + 1]);
        if (t == 0) p.lse[batch * p.lse_batch_stride + head_q * p.lse_head_stride + seq.q_row0 + pos] = row_lse;
      }
    }
}

// ---- split-KV: merge the splits' partial results ------------------------------------------------------
constexpr int MAX_SPLITS = 128;  // splits per row block; mirrored by cuflash/api.py MAX_SPLITS (the API's cap)
static_assert(MAX_SPLITS == 4 * 32, "merge_split_row keeps four splits' lse per lane");

// lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s (each O_s normalized by its own split's sum);
// splits that saw no key have lse_s = -inf and weight 0; a row that no split saw gets O = 0, lse = -inf.
// One warp merges one row: query head head_q at position pos of sequence batch (of `batches`). The
// partial results come from other CTAs of this or the previous launch: loads bypass L1 (ld.global.cg).
// AHEAD (<= 32): splits whose O is loaded together with the lse (registers: 4 AHEAD per thread).
template <class T, int AHEAD>
__device__ __forceinline__ void merge_split_row(const FwdParams& p, int batch, int batches, int head_q, int pos,
                                                int lane) {
  static_assert(AHEAD >= 1 && AHEAD <= 32, "the weights of the splits loaded ahead come from lanes 0..31");
  const int seqlen_q = p.seq.seqlen_q;
  const long long split_stride = static_cast<long long>(batches) * p.heads * seqlen_q;  // rows of one split
  const long long vec0 = (static_cast<long long>(batch) * p.heads + head_q) * seqlen_q + pos;
  // One round of loads for the common case: the lse of splits lane + 32 i (all splits) and this lane's first
  // four columns of the first AHEAD splits' O, in flight together (a loop over the splits in one thread
  // would wait for each load in turn); then max and sum across the warp.
  const float* lse_s = p.lse_accum + vec0;
  const float* o_s0 = p.o_accum + vec0 * p.accum_cols + lane * 4;
  const bool has_col0 = lane * 4 < p.head_dim;  // head_dim is a multiple of 8: whole float4s
  float l[MAX_SPLITS / 32];
#pragma unroll
  for (int i = 0; i < MAX_SPLITS / 32; ++i) {
    const int s = lane + 32 * i;
    l[i] = s < p.num_splits ? __ldcg(lse_s + s * split_stride) : neg_inf();
  }
  float4 o_ahead[AHEAD];
#pragma unroll
  for (int s = 0; s < AHEAD; ++s)
    o_ahead[s] = (s < p.num_splits && has_col0)
                     ? __ldcg(reinterpret_cast<const float4*>(o_s0 + s * split_stride * p.accum_cols))
                     : make_float4(0.f, 0.f, 0.f, 0.f);
  float m = neg_inf();
#pragma unroll
  for (int i = 0; i < MAX_SPLITS / 32; ++i) m = fmaxf(m, l[i]);
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
  // no split saw a key: m = -inf; use 0 so exp2(-inf - 0) = 0 and the sum stays 0 (not NaN)
  const float m_use = (m == neg_inf()) ? 0.f : m;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < MAX_SPLITS / 32; ++i) sum += ex2_approx((l[i] - m_use) * LOG2E);
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, x);
  const float lse = (sum == 0.f) ? neg_inf() : m_use + __logf(sum);
  // the first AHEAD splits' weights: split s's lse is lane s's l[0] (every lane runs these shuffles)
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    const float lse_of_s = __shfl_sync(0xffffffffu, l[0], s);
    const float w = (sum == 0.f || s >= p.num_splits) ? 0.f : ex2_approx((lse_of_s - lse) * LOG2E);
    acc.x += w * o_ahead[s].x;
    acc.y += w * o_ahead[s].y;
    acc.z += w * o_ahead[s].z;
    acc.w += w * o_ahead[s].w;
  }
  u16* o_row = p.o + batch * p.o_batch_stride + static_cast<long long>(pos) * p.o_row_stride + head_q * p.o_head_stride;
  for (int col = lane * 4; col < p.head_dim; col += 32 * 4) {
    int s = 0;  // the first columns continue after the splits loaded ahead
    if (col != lane * 4) acc = make_float4(0.f, 0.f, 0.f, 0.f);
    else s = AHEAD;
#pragma unroll 8  // eight splits' loads (their lse with their O) in flight
    for (; s < p.num_splits; ++s) {
      const float w = (sum == 0.f) ? 0.f : ex2_approx((__ldcg(lse_s + s * split_stride) - lse) * LOG2E);
      const float4 o_s = __ldcg(reinterpret_cast<const float4*>(p.o_accum + (vec0 + s * split_stride) * p.accum_cols + col));
      acc.x += w * o_s.x;
      acc.y += w * o_s.y;
      acc.z += w * o_s.z;
      acc.w += w * o_s.w;
    }
    *reinterpret_cast<uint2*>(o_row + col) = make_uint2(Cvt<T>::pack(acc.x, acc.y), Cvt<T>::pack(acc.z, acc.w));
  }
  if (lane == 0) p.lse[batch * p.lse_batch_stride + head_q * p.lse_head_stride + pos] = lse;
}

// Splits whose O the decode kernel's merge loads with their lse: 16, the split count of one sequence on an
// H100 (one CTA per SM), so one round of loads serves the common case.
constexpr int MERGE_AHEAD = 16;

// Split-KV in one launch: after writing its partial results, each CTA of a row block counts itself in, and
// the last of the num_splits to do so merges the block's rows. Each row block has two counters: splits
// arrived (partial results stored, not yet known to be visible) and splits published (stored and released).
// A split that is not the last to arrive releases its results and counts itself as published; the last
// one, the split the launch waits for, does not wait for its own stores to be acknowledged before its
// count (a release fence would): its atomic and its read of the published count (acquire) are in flight
// together, and the other splits, which arrived earlier, have normally published by then (else it waits
// for them: they are running, past their key loops). It also puts both counters back to zero for the next
// launch (the host keeps one counter buffer per stream, so launches that share one are ordered). flag: a
// word of shared memory no warp uses any more.
template <class Tr>
__device__ __forceinline__ void fwd_decode_merge_if_last(const FwdParams& p, int* flag, int batch, int head,
                                                         int row0, int rows_q, int tid) {
  __syncthreads();  // every thread has issued its stores of partial results (ordered before thread 0's release)
  if (tid == 0) {
    int* arrived = p.split_counters + 2 * ((static_cast<long long>(batch) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x);
    int* published = arrived + 1;
    const int others = p.num_splits - 1;
    const int before = atomicAdd(arrived, 1);
    const int seen = ld_acquire_gpu(published);  // in flight with the atomic (nothing here waits for its answer)
    const bool last = before == others;
    if (!last) {
      fence_acq_rel_gpu();  // release: this CTA's partial results are visible device-wide before the count
      atomicAdd(published, 1);
    } else {
      if (seen != others)  // a split that arrived before this one is publishing now
        while (ld_acquire_gpu(published) != others) {
        }
      *arrived = 0;
      *published = 0;
    }
    *flag = last;
  }
  __syncthreads();  // thread 0's acquire covers the other splits' results for every thread of the CTA, and the
                    // barriers order this CTA's own stores before its reads (.cg loads included: the PTX ISA
                    // makes cache operators performance hints that leave the memory model unchanged)
  if (!*flag) return;
  const int batches = static_cast<int>(gridDim.z) / p.num_splits;
  for (int r = tid >> 5; r < rows_q; r += Tr::WARPS) {
    const int row = row0 + r;  // packed: position row / rows_per_pos, query head of the group row % rows_per_pos
    merge_split_row<typename Tr::T, MERGE_AHEAD>(p, batch, batches, head * p.rows_per_pos + row % p.rows_per_pos,
                                                 row / p.rows_per_pos, tid & 31);
  }
}

// Decode asks for one CTA per SM in its launch bounds (it runs one per SM, api.DECODE_CTAS_PER_SM): without
// it, ptxas held some decode instantiations to 128 registers and spilled (the merge's loads ahead).
template <class Tr, bool IS_CAUSAL, bool IS_DECODE, int MODS>
__global__ void __launch_bounds__(Tr::THREADS, IS_DECODE ? 1 : 0) fwd_kernel(const FwdParams p) {
  static_assert(!IS_DECODE || (MODS & ~(MOD_WINDOW | MOD_ALIBI | MOD_SOFTCAP)) == 0,
                "the kv-cache forward takes the window, ALiBi and the softcap");
  constexpr bool HAS_WINDOW = ScoreMods<MODS>::HAS_WINDOW;
  extern __shared__ __align__(1024) unsigned char smem[];
  using T = typename Tr::T;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // causal: launch the longest query blocks (most key tiles) first so the last wave is short
  const int m_block = IS_CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  const int head = blockIdx.y;  // packed decode: the K/V head, whose rows_per_pos query heads are packed as rows
  const int split = IS_DECODE ? static_cast<int>(blockIdx.z) % p.num_splits : 0;
  const int batch = IS_DECODE ? static_cast<int>(blockIdx.z) / p.num_splits : blockIdx.z;
  Seq seq = sequence(p.seq, batch);
  long long cache_entry = batch;  // decode, dense cache: the cache entry of this batch entry
  if (IS_DECODE) {
    if (p.leftpad_k != nullptr) {  // keys from cache row leftpad on: positions (masks, ALiBi) count from there
      seq.k_row0 = p.leftpad_k[batch];
      seq.len_k -= seq.k_row0;
    }
    if (p.cache_batch_idx != nullptr) cache_entry = p.cache_batch_idx[batch];
  }
  const int rows_per_pos = IS_DECODE ? p.rows_per_pos : 1;
  const int row0 = m_block * Tr::BLOCK_M;                      // first query row of this CTA
  if (row0 >= seq.len_q * rows_per_pos) return;                // varlen: past this sequence's end
  const int rows_q = min(Tr::BLOCK_M, seq.len_q * rows_per_pos - row0);  // valid query rows
  const int diag = seq.len_k - seq.len_q;                      // query i sees keys j <= i + diag
  const int warp_row0 = warp * Tr::WARP_ROWS;                  // first row of this warp in the tile
  const int kv_head = head / p.seq.kv_group;  // packed decode passes kv_group = 1

  const u16* q_gmem = p.q + batch * p.q_batch_stride + static_cast<long long>(seq.q_row0 + row0) * p.q_row_stride +
                      head * p.q_head_stride;
  const u16* k_cache = p.k + kv_head * p.k_head_stride;  // paged decode: pages are indexed from here
  const u16* v_cache = p.v + kv_head * p.v_head_stride;
  const u16* k_gmem = k_cache + cache_entry * p.k_batch_stride + static_cast<long long>(seq.k_row0) * p.k_row_stride;
  const u16* v_gmem = v_cache + cache_entry * p.v_batch_stride + static_cast<long long>(seq.k_row0) * p.v_row_stride;
  u16* o_gmem = p.o + batch * p.o_batch_stride + static_cast<long long>(seq.q_row0 + row0) * p.o_row_stride +
                head * p.o_head_stride;
  float* lse_gmem = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_row0 + row0;

  // key tiles of this CTA: [n_begin, n_end) (tiles outside the causal / window band are skipped);
  // decode splits share them out in equal runs
  const Band<IS_CAUSAL, HAS_WINDOW> band{seq.len_k, diag, p.mods.window_left, p.mods.window_right};
  const int last_pos = (row0 + rows_q - 1) / rows_per_pos, first_pos = row0 / rows_per_pos;
  int n_begin = band.template key_block_begin<Tr::BLOCK_N>(first_pos);
  int n_end = band.template key_block_end<Tr::BLOCK_N>(last_pos);
  if (IS_DECODE && p.num_splits > 1) {  // equal runs of the band's tiles
    const int per_split = (max(n_end - n_begin, 0) + p.num_splits - 1) / p.num_splits;
    n_begin += split * per_split;
    n_end = min(n_end, n_begin + per_split);
  }
  if (n_end <= n_begin) {  // nothing to see: O = 0, lse = -inf (causal rows before every key, empty splits)
    if (IS_DECODE) {
      const float unused_o[Tr::M_TILES][Tr::D_TILES][4] = {}, unused_lse[Tr::M_TILES][2] = {};
      fwd_decode_epilogue<Tr, /*IS_EMPTY=*/true>(p, unused_o, unused_lse, batch, split, head, seq, row0, rows_q,
                                                 warp_row0, lane);
      if (p.num_splits > 1 && p.split_counters != nullptr)
        fwd_decode_merge_if_last<Tr>(p, reinterpret_cast<int*>(smem), batch, head, row0, rows_q, tid);
      return;
    }
    zero_tile_gmem<typename Tr::TileQ, Tr::THREADS>(o_gmem, p.o_row_stride, rows_q, p.head_dim, tid);
    if (p.lse != nullptr)
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
  int n_block = n_end - 1;
  bool q_gathered = false;
  if constexpr (IS_DECODE) {  // (a constexpr branch: prefill tiles need not suit load_tile_rows_async)
    if (rows_per_pos > 1) {  // row r: position r / rows_per_pos, query head of the group r % rows_per_pos
      const u16* q_pos0 = p.q + batch * p.q_batch_stride + static_cast<long long>(seq.q_row0) * p.q_row_stride +
                          static_cast<long long>(head) * rows_per_pos * p.q_head_stride;
      RowFnCursor q_rows([&](int r) {
        const int row = row0 + r;
        return q_pos0 + static_cast<long long>(row / rows_per_pos) * p.q_row_stride +
               (row % rows_per_pos) * p.q_head_stride;
      });
      load_tile_rows_async<typename Tr::TileQ, Tr::THREADS>(q_smem, 0, q_rows, q_pos0, rows_q, p.head_dim, tid);
      q_gathered = true;
    }
  }
  if (!q_gathered)
    load_tile_async<typename Tr::TileQ, Tr::THREADS>(q_smem, q_gmem, p.q_row_stride, rows_q, p.head_dim, tid);
  // paged decode: a tile lies in one page unless the page size or the first row (leftpad) cuts it
  const bool is_gather = IS_DECODE && p.block_table != nullptr &&
                         (p.page_size % Tr::BLOCK_N != 0 || seq.k_row0 % Tr::BLOCK_N != 0);
  PageDivisor pages;  // paged decode: key / page_size
  if (IS_DECODE && p.block_table != nullptr) pages = PageDivisor(p.page_size);
  // key tile n's K and V into stage `stage` of the pipeline; rows: the tile's valid keys (BLOCK_N but at the tail)
  auto load_kv = [&](int stage, int n, int rows) {
    if constexpr (IS_DECODE) {
      if (is_gather) {
        const PagedTileRows<Tr::BLOCK_N> tile_pages(p, pages, batch, seq.k_row0 + n * Tr::BLOCK_N, rows, lane);
        auto kv_rows = tile_pages.rows(p, k_cache, v_cache);
        load_tile_rows_async<typename Tr::TileKV, Tr::THREADS>(k_smem0 + stage * Tr::SMEM_KV, v_smem0 - k_smem0, kv_rows,
                                                               k_cache, rows, p.head_dim, tid);
        return;
      }
    }
    long long k_stride = p.k_row_stride, v_stride = p.v_row_stride;
    if constexpr (IS_DECODE) {  // opaque here: the chunks' row offsets are not kept across the key loop
      asm volatile("" : "+l"(k_stride));
      asm volatile("" : "+l"(v_stride));
    }
    if constexpr (IS_DECODE) {
      // a paged tile within one page: the page looked up once, for K and V, before K's copies. (Looked up again for
      // V, that load sat behind K's copies, which the compiler may not move it above, and V's copies waited on it:
      // 64- and 256-row pages decoded 1.11-1.20x a dense cache's time at head dims 32 and 64 on an H200, 1.05-1.08x
      // since.)
      if (p.block_table != nullptr) {
        const int key0 = seq.k_row0 + n * Tr::BLOCK_N, page_idx = pages.div(key0);
        const int in_page = key0 - page_idx * p.page_size;
        const int page = p.block_table[static_cast<long long>(batch) * p.block_table_stride + page_idx];
        load_tile_async<typename Tr::TileKV, Tr::THREADS>(k_smem0 + stage * Tr::SMEM_KV,
                                                          k_cache + page * p.k_page_stride + in_page * k_stride,
                                                          k_stride, rows, p.head_dim, tid);
        load_tile_async<typename Tr::TileKV, Tr::THREADS>(v_smem0 + stage * Tr::SMEM_KV,
                                                          v_cache + page * p.v_page_stride + in_page * v_stride,
                                                          v_stride, rows, p.head_dim, tid);
        return;
      }
    }
    load_tile_async<typename Tr::TileKV, Tr::THREADS>(k_smem0 + stage * Tr::SMEM_KV, kv_tile_gmem<Tr>(k_gmem, k_stride, n),
                                                      k_stride, rows, p.head_dim, tid);
    load_tile_async<typename Tr::TileKV, Tr::THREADS>(v_smem0 + stage * Tr::SMEM_KV, kv_tile_gmem<Tr>(v_gmem, v_stride, n),
                                                      v_stride, rows, p.head_dim, tid);
  };
  load_kv(0, n_block, seq.len_k - n_block * Tr::BLOCK_N);
  cp_async_commit_group();
  // deeper pipelines (decode): STAGES - 2 more tiles ahead, one cp.async group each (possibly empty)
#pragma unroll
  for (int s = 1; s < Tr::STAGES - 1; ++s) {
    const int ahead = n_block - s;
    if (ahead >= n_begin) load_kv(s, ahead, Tr::BLOCK_N);
    cp_async_commit_group();
  }

  float o_acc[Tr::M_TILES][Tr::D_TILES][4];  // O of this warp's rows, fp32, in registers throughout
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int dt = 0; dt < Tr::D_TILES; ++dt)
#pragma unroll
      for (int c = 0; c < 4; ++c) o_acc[mt][dt][c] = 0.f;
  OnlineSoftmax<Tr::M_TILES, Tr::N_TILES, Tr::D_TILES> softmax;
  softmax.init();
  ScoreMods<MODS> mods;
  mods.init(p.mods, batch, head, p.heads, seq.len_q, seq.len_k);
  // decode with ALiBi: grid.y is the K/V head and each packed row takes its own query head's slope
  // (apply_alibi_packed); the one-head ALiBi of score() is switched off
  const float* group_slopes = nullptr;
  if constexpr (IS_DECODE && ScoreMods<MODS>::HAS_ALIBI) {
    group_slopes = p.mods.alibi_slopes + batch * p.mods.alibi_batch_stride + static_cast<long long>(head) * rows_per_pos;
    mods.slope = 0.f;
  }

  // Key tiles from the last to the first: the masked ones (K tail, causal diagonal, window's right edge)
  // come first, then an unmasked loop, then the window's left edge masked again. Each iteration first
  // issues the loads of the tile STAGES - 1 ahead into the stage the previous iteration used.
  int stage = 0;
  auto step = [&](auto is_masked_tag) {
    constexpr bool IS_MASKED = decltype(is_masked_tag)::value;
    const int ahead = n_block - (Tr::STAGES - 1);
    if (ahead >= n_begin)  // into the stage the previous iteration used
      load_kv(Tr::STAGES == 2 ? stage ^ 1 : stage == 0 ? Tr::STAGES - 1 : stage - 1, ahead, Tr::BLOCK_N);
    cp_async_commit_group();                  // possibly empty: keeps the group count uniform
    cp_async_wait_group<Tr::STAGES - 1>();    // this stage's K/V (and Q) have landed
    __syncthreads();
    if (!IS_DECODE || warp_row0 < rows_q)  // decode: warps whose rows are all padding skip the arithmetic
      fwd_key_tile<Tr, IS_CAUSAL, IS_MASKED, IS_DECODE, MODS>(band, mods, group_slopes, p.mods.alibi_scale, rows_per_pos,
                                                        p.scale_log2,
                                                        n_block * Tr::BLOCK_N, q_lane,
                                                        k_lane0 + stage * Tr::SMEM_KV, v_lane0 + stage * Tr::SMEM_KV,
                                                        warp_row0, row0, lane, o_acc, softmax);
    __syncthreads();  // every warp is done with this stage before the next iteration refills it
    stage = Tr::STAGES == 2 ? stage ^ 1 : (stage == Tr::STAGES - 1) ? 0 : stage + 1;
  };
  for (; n_block >= n_begin && band.needs_mask_right(first_pos, (n_block + 1) * Tr::BLOCK_N - 1); --n_block)
    step(BoolTag<true>());
  for (; n_block >= n_begin && !band.needs_mask_left(last_pos, n_block * Tr::BLOCK_N); --n_block)
    step(BoolTag<false>());
  if (HAS_WINDOW)
    for (; n_block >= n_begin; --n_block) step(BoolTag<true>());

  // epilogue: O /= l (and * 1 / (1 - p) with dropout), lse
  float lse[Tr::M_TILES][2];
  softmax.finalize(o_acc, lse);
  if (ScoreMods<MODS>::HAS_DROPOUT) scale_acc(o_acc, p.mods.dropout_rp);
  if (IS_DECODE) {
    fwd_decode_epilogue<Tr, /*IS_EMPTY=*/false>(p, o_acc, lse, batch, split, head, seq, row0, rows_q, warp_row0, lane);
    if (p.num_splits > 1 && p.split_counters != nullptr)  // the key loop's last barrier freed shared memory
      fwd_decode_merge_if_last<Tr>(p, reinterpret_cast<int*>(smem), batch, head, row0, rows_q, tid);
    return;
  }
  // O -> shared (the Q tile's space, this warp's own rows) -> 16-byte stores
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row0 + mt * 16 + g + h * 8;
#pragma unroll
      for (int dt = 0; dt < Tr::D_TILES; ++dt)
        *reinterpret_cast<u32*>(smem + Tr::TileQ::offset(row, dt * 8 + 2 * t)) =
            Cvt<T>::pack(o_acc[mt][dt][2 * h], o_acc[mt][dt][2 * h + 1]);
      if (t == 0 && row < rows_q && p.lse != nullptr) lse_gmem[row] = lse[mt][h];
    }
  __syncthreads();
  store_tile<typename Tr::TileQ, Tr::THREADS>(o_gmem, p.o_row_stride, smem, rows_q, p.head_dim, tid);
}

// Split-KV merge as a second launch (p.split_counters == nullptr): one warp per (head, position), grid
// (ceil(heads * seqlen_q / COMBINE_ROWS), batch).
constexpr int COMBINE_ROWS = 8;  // rows (warps) per CTA of 256 threads

template <class T>
__global__ void __launch_bounds__(256) fwd_combine_kernel(const FwdParams p) {
  const int hq = blockIdx.x * COMBINE_ROWS + (threadIdx.x >> 5);  // head * seqlen_q + position
  const int seqlen_q = p.seq.seqlen_q;
  if (hq >= p.heads * seqlen_q) return;
  merge_split_row<T, MERGE_AHEAD>(p, blockIdx.y, gridDim.y, hq / seqlen_q, hq % seqlen_q, threadIdx.x & 31);
}

}  // namespace cuflash
