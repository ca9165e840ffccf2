// mask.cuh: which (query, key) pairs are visible, at element and at tile level.
//
// Causal masks align to the bottom-right: query row i sees key column j iff j <= i + diag, with
// diag = seqlen_k - seqlen_q. Keys j >= seqlen_k are tail padding of the last tile.
#pragma once
#include "traits.cuh"

namespace cuflash {

// Key tile n_block, seen from query rows >= row_first, contains a masked element.
template <bool IS_CAUSAL, int BLOCK_N>
__device__ __forceinline__ bool key_block_needs_mask(int n_block, int row_first, int seqlen_k, int diag) {
  const int col_last = (n_block + 1) * BLOCK_N - 1;
  return col_last >= seqlen_k || (IS_CAUSAL && col_last > row_first + diag);
}

// Number of key tiles that query rows <= row_last see: tiles above the causal diagonal are skipped.
template <bool IS_CAUSAL, int BLOCK_N>
__device__ __forceinline__ int num_key_blocks(int row_last, int seqlen_k, int diag) {
  const int n_blocks = (seqlen_k + BLOCK_N - 1) / BLOCK_N;
  if (!IS_CAUSAL) return n_blocks;
  const int col_last = row_last + diag;  // last key the last row sees; < 0: the rows see nothing
  return col_last < 0 ? 0 : min(n_blocks, col_last / BLOCK_N + 1);
}

// S[M_TILES][N_TILES][4] (mma accumulators of rows row0 + mt*16 + g (+8), columns col0 + nt*8 + 2t (+1))
// set to -inf where masked. Per row, the visible columns are a prefix: col < min(seqlen_k, row + diag + 1),
// so each thread compares the compile-time column offset nt*8 + (c&1) with one threshold per row.
// IS_PACKED (decode with grouped query heads packed as rows): tile row r is query position r / rows_per_pos.
template <bool IS_CAUSAL, int M_TILES, int N_TILES, bool IS_PACKED = false>
__device__ __forceinline__ void apply_mask(float (&s)[M_TILES][N_TILES][4], int row0, int col0, int seqlen_k,
                                           int diag, int lane, int rows_per_pos = 1) {
  const int g = lane >> 2, t = lane & 3;
  const int col_base = col0 + 2 * t;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = IS_PACKED ? (row0 + mt * 16 + g + h * 8) / rows_per_pos : row0 + mt * 16 + g + h * 8;
      const int end = (IS_CAUSAL ? min(seqlen_k, row + diag + 1) : seqlen_k) - col_base;  // first masked offset
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int c = 2 * h; c < 2 * h + 2; ++c)
          if (nt * 8 + (c & 1) >= end) s[mt][nt][c] = neg_inf();
    }
}

}  // namespace cuflash

namespace cuflash {

// Transposed scores S^T[KEY_TILE 16 rows][Q_TILES n8 columns] of the backward: rows are keys
// key0 + g (+8), columns queries query0 + qt*8 + 2t (+1). Masked entries = -inf. A key row is visible
// to a suffix of the queries: query >= key - diag (causal), none when key >= seqlen_k.
template <bool IS_CAUSAL, int Q_TILES>
__device__ __forceinline__ void apply_mask_transposed(float (&s)[Q_TILES][4], int key0, int query0, int seqlen_k,
                                                      int diag, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int query_base = query0 + 2 * t;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + g + h * 8;
    // first visible query offset (relative to query_base); past every column when the key is padding
    const int begin = key >= seqlen_k ? Q_TILES * 8 : (IS_CAUSAL ? key - diag - query_base : -1);
#pragma unroll
    for (int qt = 0; qt < Q_TILES; ++qt)
#pragma unroll
      for (int c = 2 * h; c < 2 * h + 2; ++c)
        if (qt * 8 + (c & 1) < begin) s[qt][c] = neg_inf();
  }
}

}  // namespace cuflash
