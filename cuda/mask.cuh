// mask.cuh: which (query, key) pairs are visible, at element and at tile level.
//
// Query i sees key j iff first_key(i) <= j < key_end(i), with diag = seqlen_k - seqlen_q (bottom-right
// alignment) and keys j >= seqlen_k being tail padding of the last tile:
//   plain            j < seqlen_k
//   causal           j <= i + diag
//   window (mods.cuh, MOD_WINDOW)   i + diag - left <= j <= i + diag + right
// A window carries causal as right = 0 (the host folds it in), and an unbounded side as a bound past any
// sequence, so the kernels never test for -1. The same band gives the tile-level tests: which key tiles a
// query block visits (the others are skipped, not masked) and which of those need the element mask.
#pragma once
#include "traits.cuh"

namespace cuflash {

template <bool IS_CAUSAL, bool HAS_WINDOW>
struct Band {
  static_assert(!(IS_CAUSAL && HAS_WINDOW), "a window carries causal as right = 0");
  int seqlen_k, diag;
  int left, right;  // window only

  __device__ __forceinline__ int first_key(int query) const { return HAS_WINDOW ? query + diag - left : 0; }
  // one past the last key the query sees (<= 0: none)
  __device__ __forceinline__ int key_end(int query) const {
    if (IS_CAUSAL) return min(seqlen_k, query + diag + 1);
    if (HAS_WINDOW) return min(seqlen_k, query + diag + right + 1);
    return seqlen_k;
  }
  // Key tiles [begin, end) that query rows [row_first, row_last] see.
  template <int BLOCK_N>
  __device__ __forceinline__ int key_block_begin(int row_first) const {
    return HAS_WINDOW ? max(0, first_key(row_first)) / BLOCK_N : 0;
  }
  template <int BLOCK_N>
  __device__ __forceinline__ int key_block_end(int row_last) const {
    const int end = key_end(row_last);
    return end <= 0 ? 0 : (end + BLOCK_N - 1) / BLOCK_N;
  }
  // Query rows [begin, end) that see some key of [key_first, key_last] (the backward's K/V-outer loop).
  __device__ __forceinline__ int query_begin(int key_first) const {
    if (IS_CAUSAL) return max(0, key_first - diag);
    if (HAS_WINDOW) return max(0, key_first - diag - right);
    return 0;
  }
  __device__ __forceinline__ int query_end(int key_last, int seqlen_q) const {
    return HAS_WINDOW ? max(0, min(seqlen_q, key_last - diag + left + 1)) : seqlen_q;
  }
  // The block of query rows [row_first, row_last] x keys [key_first, key_last] holds an invisible pair
  // (an element mask is needed): past a row's last key (tail, causal, window) or before its first.
  __device__ __forceinline__ bool needs_mask(int row_first, int row_last, int key_first, int key_last) const {
    return key_last >= key_end(row_first) || (HAS_WINDOW && key_first < first_key(row_last));
  }
  // ... the right side alone (the tiles visited first, from the last one down) and the left side alone
  __device__ __forceinline__ bool needs_mask_right(int row_first, int key_last) const {
    return key_last >= key_end(row_first);
  }
  __device__ __forceinline__ bool needs_mask_left(int row_last, int key_first) const {
    return HAS_WINDOW && key_first < first_key(row_last);
  }
};

// S[M_TILES][N_TILES][4] (mma accumulators of rows row0 + mt*16 + g (+8), columns col0 + nt*8 + 2t (+1))
// set to -inf where masked. Per row the visible columns are one run [first_key, key_end), so each thread
// compares the compile-time column offset nt*8 + (c&1) with two thresholds per row.
// IS_PACKED (decode with grouped query heads packed as rows): tile row r is query position r / rows_per_pos.
// (A: the accumulator type, float or, in the float64 kernels, double)
template <bool IS_CAUSAL, bool HAS_WINDOW, int M_TILES, int N_TILES, bool IS_PACKED = false, class A = float>
__device__ __forceinline__ void apply_band_mask(A (&s)[M_TILES][N_TILES][4], int row0, int col0,
                                                const Band<IS_CAUSAL, HAS_WINDOW>& band, int lane, int rows_per_pos = 1) {
  const int g = lane >> 2, t = lane & 3;
  const int col_base = col0 + 2 * t;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = IS_PACKED ? (row0 + mt * 16 + g + h * 8) / rows_per_pos : row0 + mt * 16 + g + h * 8;
      const int end = band.key_end(row) - col_base;  // first masked offset on the right
      const int begin = band.first_key(row) - col_base;  // first visible offset (window)
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int c = 2 * h; c < 2 * h + 2; ++c) {
          const int off = nt * 8 + (c & 1);
          if (off >= end || (HAS_WINDOW && off < begin)) s[mt][nt][c] = neg_inf();
        }
    }
}

// Transposed scores S^T[KEY_TILE 16 rows][Q_TILES n8 columns] of the backward: rows are keys
// key0 + g (+8), columns queries query0 + qt*8 + 2t (+1). Masked entries = -inf. A key row is visible to
// the queries [key - diag - right, key - diag + left] (causal: from key - diag on), none when the key is
// padding (>= seqlen_k).
template <bool IS_CAUSAL, bool HAS_WINDOW, int Q_TILES, class A = float>
__device__ __forceinline__ void apply_band_mask_transposed(A (&s)[Q_TILES][4], int key0, int query0,
                                                           const Band<IS_CAUSAL, HAS_WINDOW>& band, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int query_base = query0 + 2 * t;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + g + h * 8;
    const int rel = key - band.diag - query_base;  // the query on this key's diagonal, relative
    // first visible query offset; past every column when the key is padding
    const int begin = key >= band.seqlen_k ? Q_TILES * 8 : IS_CAUSAL ? rel : HAS_WINDOW ? rel - band.right : -1;
    const int end = rel + band.left;  // window: last visible query offset
#pragma unroll
    for (int qt = 0; qt < Q_TILES; ++qt)
#pragma unroll
      for (int c = 2 * h; c < 2 * h + 2; ++c) {
        const int off = qt * 8 + (c & 1);
        if (off < begin || (HAS_WINDOW && off > end)) s[qt][c] = neg_inf();
      }
  }
}

}  // namespace cuflash
