// tiles.cuh: shared-memory tile layout, global -> shared copies, shared -> register fragments.
//
// A [ROWS, HEAD_DIM] tile of 16-bit elements is stored as HEAD_DIM / PANEL_COLS column panels
// (PANEL_COLS = 64 elements = 128 bytes, or 32 = 64 bytes when HEAD_DIM % 64 != 0), panel after
// panel. Inside a panel the 16-byte chunk index is XOR-ed with the 128-byte line index, so the 8
// row addresses of an ldmatrix phase (same column, 8 consecutive rows) and the 8 lanes of a
// cp.async phase (one 128-byte line) each hit 8 distinct 16-byte bank groups: no bank conflicts.
// cuflash/config.py:swizzled_offset is the Python mirror used by the analyzer.
#pragma once
#include "ptx.cuh"

namespace cuflash {

template <int ROWS_, int HEAD_DIM_>
struct SmemTile {
  static constexpr int ROWS = ROWS_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int PANEL_COLS = (HEAD_DIM % 64 == 0) ? 64 : 32;
  static constexpr int PANEL_BYTES = PANEL_COLS * 2;
  static constexpr int LINE_MASK = (PANEL_BYTES == 128) ? 7 : 3;  // 128-byte lines a swizzle period spans
  static constexpr int BYTES = ROWS * HEAD_DIM * 2;
  static constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;  // 16-byte chunks
  static constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
  static_assert(HEAD_DIM % PANEL_COLS == 0, "HEAD_DIM must be a whole number of panels");

  // Byte offset of element (row, col) from the tile base.
  static __device__ __forceinline__ u32 offset(int row, int col) {
    const int panel = col / PANEL_COLS;
    u32 off = row * PANEL_BYTES + (col % PANEL_COLS) * 2;
    off ^= ((off >> 7) & LINE_MASK) << 4;
    return panel * (ROWS * PANEL_BYTES) + off;
  }
};

// Tile [ROWS, HEAD_DIM] from global memory (row r at gmem + r * row_stride) into shared memory,
// 16 bytes per cp.async. Rows >= rows_valid and columns >= cols_valid are zero-filled without a
// read, so a tail tile holds zeros (never NaN garbage that 0 * x would turn into NaN).
template <class Tile, int THREADS>
__device__ __forceinline__ void load_tile_async(u32 tile_smem, const u16* tile_gmem, long long row_stride,
                                                int rows_valid, int cols_valid, int tid) {
  constexpr int ITERS = (Tile::CHUNKS + THREADS - 1) / THREADS;
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int idx = tid + i * THREADS;
    if (Tile::CHUNKS % THREADS == 0 || idx < Tile::CHUNKS) {
      const int row = idx / Tile::CHUNKS_PER_ROW;
      const int col = (idx % Tile::CHUNKS_PER_ROW) * 8;
      const bool valid = row < rows_valid && col < cols_valid;
      const u16* src = valid ? tile_gmem + row * row_stride + col : tile_gmem;
      cp_async_cg_16(tile_smem + Tile::offset(row, col), src, valid);
    }
  }
}

// Tile from shared memory to global memory, 16 bytes per thread and instruction, valid part only.
template <class Tile, int THREADS>
__device__ __forceinline__ void store_tile(u16* tile_gmem, long long row_stride, const unsigned char* tile_smem,
                                           int rows_valid, int cols_valid, int tid) {
  constexpr int ITERS = (Tile::CHUNKS + THREADS - 1) / THREADS;
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int idx = tid + i * THREADS;
    if (Tile::CHUNKS % THREADS == 0 || idx < Tile::CHUNKS) {
      const int row = idx / Tile::CHUNKS_PER_ROW;
      const int col = (idx % Tile::CHUNKS_PER_ROW) * 8;
      if (row < rows_valid && col < cols_valid) {
        const uint4 chunk = *reinterpret_cast<const uint4*>(tile_smem + Tile::offset(row, col));
        *reinterpret_cast<uint4*>(tile_gmem + row * row_stride + col) = chunk;
      }
    }
  }
}

// Zeros into the valid part of a global tile (used for query rows that see no key at all).
template <class Tile, int THREADS>
__device__ __forceinline__ void zero_tile_gmem(u16* tile_gmem, long long row_stride, int rows_valid,
                                               int cols_valid, int tid) {
  for (int idx = tid; idx < Tile::CHUNKS; idx += THREADS) {
    const int row = idx / Tile::CHUNKS_PER_ROW;
    const int col = (idx % Tile::CHUNKS_PER_ROW) * 8;
    if (row < rows_valid && col < cols_valid) {
      *reinterpret_cast<uint4*>(tile_gmem + row * row_stride + col) = make_uint4(0, 0, 0, 0);
    }
  }
}

// ---- shared -> register fragments of mma.m16n8k16 (lane l, g = l / 4, t = l % 4) --------------

// A fragment (row-major 16 x 16) of rows [row0, row0+16), columns [col0, col0+16).
// ldmatrix.x4 matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
template <class Tile>
__device__ __forceinline__ void ldmatrix_a(u32 (&a)[4], u32 tile_smem, int row0, int col0, int lane) {
  ldmatrix_x4(a, tile_smem + Tile::offset(row0 + (lane & 15), col0 + (lane >> 4) * 8));
}

// B fragments of two n8 tiles from a tile stored [n][k] (K as the B of Q K^T): rows
// [n0, n0+16), columns [k0, k0+16). b[0], b[1]: n-tile 0 (k 0-7, 8-15); b[2], b[3]: n-tile 1.
template <class Tile>
__device__ __forceinline__ void ldmatrix_b_nk(u32 (&b)[4], u32 tile_smem, int n0, int k0, int lane) {
  ldmatrix_x4(b, tile_smem + Tile::offset(n0 + (lane & 7) + ((lane >> 4) << 3), k0 + ((lane >> 3) & 1) * 8));
}

// B fragments of two n8 tiles from a tile stored [k][n] (V as the B of P V), transposed on load:
// rows (k) [k0, k0+16), columns (n) [n0, n0+16). b[0], b[1]: n-tile 0; b[2], b[3]: n-tile 1.
template <class Tile>
__device__ __forceinline__ void ldmatrix_b_kn_trans(u32 (&b)[4], u32 tile_smem, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, tile_smem + Tile::offset(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8));
}

}  // namespace cuflash
