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

// PANEL_COLS_ = 0: the default panel width (64 columns when HEAD_DIM % 64 == 0, else 32); a kernel that
// must start an operand at column 32 of a 64-column head dim (the Hopper backward's dQ at HEAD_DIM 64)
// asks for 32.
template <int ROWS_, int HEAD_DIM_, int PANEL_COLS_ = 0>
struct SmemTile {
  static constexpr int ROWS = ROWS_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int PANEL_COLS = PANEL_COLS_ ? PANEL_COLS_ : ((HEAD_DIM % 64 == 0) ? 64 : 32);
  static constexpr int PANEL_BYTES = PANEL_COLS * 2;
  static constexpr int LINE_MASK = (PANEL_BYTES == 128) ? 7 : 3;  // 128-byte lines a swizzle period spans
  static constexpr int BYTES = ROWS * HEAD_DIM * 2;
  static constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;  // 16-byte chunks
  static constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
  static_assert(PANEL_COLS == 64 || PANEL_COLS == 32, "panels are 128 or 64 bytes wide");
  static_assert(HEAD_DIM % PANEL_COLS == 0, "HEAD_DIM must be a whole number of panels");

  // Byte offset of element (row, col) from the tile base.
  static __device__ __forceinline__ u32 offset(int row, int col) {
    const int panel = col / PANEL_COLS;
    u32 off = row * PANEL_BYTES + (col % PANEL_COLS) * 2;
    off ^= ((off >> 7) & LINE_MASK) << 4;
    return panel * (ROWS * PANEL_BYTES) + off;
  }

  // THREADS threads copy the tile with each thread on one column chunk, stepping rows by a multiple
  // of 8 (the swizzle period), so its shared and global addresses advance by constants. The 8 lanes of
  // a copy phase (8 consecutive chunks of one row) must then fall in one 128-byte line of one panel:
  // with 64-byte panels of a wider row they would span two panels whose lines share the banks (2-way
  // conflicts, found by the analyzer), so those tiles copy in panel order.
  template <int THREADS>
  static constexpr bool fixed_column() {
    return THREADS % CHUNKS_PER_ROW == 0 && (PANEL_COLS == 64 || CHUNKS_PER_ROW == PANEL_COLS / 8) &&
           ((THREADS / CHUNKS_PER_ROW) % 8 == 0 || THREADS / CHUNKS_PER_ROW >= ROWS);
  }

  // Panel-order copies of at most 4 chunks per thread (and the same count for every thread) are fully
  // unrolled: a rolled `idx += THREADS` loop cost the d64 Hopper backward (64-byte panels, 2 and 4 chunks
  // per thread) 46 % more instructions and ~20 % of its speed (H100, 2026-11-22). Longer copies (d96,
  // d192, d256 tiles: 6-16 chunks per thread) stay rolled, over panel steps (load_tile_async): unrolled, their
  // addresses spilled.
  template <int THREADS>
  static constexpr bool panel_order_unrolled() {
    return CHUNKS % THREADS == 0 && CHUNKS / THREADS <= 4;
  }
  template <int THREADS>
  static constexpr bool chunk_steps_exact() {  // the premise of chunk_rows / chunk_cols below
    return (THREADS % CHUNKS_PER_PANEL == 0 || CHUNKS_PER_PANEL % THREADS == 0) && THREADS % (8 * PANEL_CHUNKS) == 0;
  }

  // Chunk idx in panel order: panel by panel, rows within a panel, chunks within a row. 8 consecutive
  // chunks are one 128-byte line of one panel, so 8 lanes never collide on a bank group (row-major
  // order would put chunks of two 64-byte panels, ROWS * 64 bytes apart, in the same phase).
  static constexpr int PANEL_CHUNKS = PANEL_COLS / 8;        // 16-byte chunks per panel row
  static constexpr int CHUNKS_PER_PANEL = ROWS * PANEL_CHUNKS;
  static __device__ __forceinline__ void panel_order(int idx, int& row, int& col) {
    const int panel = idx / CHUNKS_PER_PANEL, rest = idx % CHUNKS_PER_PANEL;
    row = rest / PANEL_CHUNKS;
    col = panel * PANEL_COLS + (rest % PANEL_CHUNKS) * 8;
  }

  // Chunk tid + i * THREADS of an unrolled panel-order copy is chunk tid moved by chunk_rows<THREADS>(i)
  // rows and chunk_cols<THREADS>(i) columns, both known at compile time: THREADS and CHUNKS_PER_PANEL
  // are powers of two, so adding i * THREADS to tid < THREADS carries into neither the chunk digit nor,
  // when THREADS < CHUNKS_PER_PANEL, the panel digit. The row step is a multiple of 8 (the swizzle
  // period) and the column step whole panels, so the shared offset moves by chunk_smem<THREADS>(i) too:
  // a copy computes its thread's first chunk once and each further chunk with an immediate.
  template <int THREADS>
  static constexpr int chunk_rows(int i) {
    return (i * THREADS) % CHUNKS_PER_PANEL / PANEL_CHUNKS;
  }
  template <int THREADS>
  static constexpr int chunk_cols(int i) {
    return (i * THREADS) / CHUNKS_PER_PANEL * PANEL_COLS;
  }
  template <int THREADS>
  static constexpr u32 chunk_smem(int i) {
    return chunk_rows<THREADS>(i) * PANEL_BYTES + (chunk_cols<THREADS>(i) / PANEL_COLS) * (ROWS * PANEL_BYTES);
  }

  // ---- wgmma operand descriptors (sm_90a; PTX ISA 9.7.15.5.1.2) -----------------------------
  // This layout is wgmma's canonical one with a PANEL_BYTES swizzle (the swizzle pattern repeats every
  // 8 rows = SWIZZLE_ATOM bytes; the tile base must be a multiple of SWIZZLE_ATOM):
  //  * K-major, when the tile's columns are the k dimension (Q and K in S = Q K^T): each 8-row group of
  //    a panel is one swizzle atom, the next 8 rows are SWIZZLE_ATOM bytes on (stride byte offset), and
  //    k steps of 16 inside a panel move the start address by 32 bytes (the hardware applies the XOR);
  //  * MN-major, when the tile's rows are the k dimension (V in O += P V): 8 k rows of 128 (or 64)
  //    contiguous MN elements form an atom, the next 8 k rows are SWIZZLE_ATOM bytes on (stride byte
  //    offset) and the next panel of MN columns ROWS * PANEL_BYTES bytes on (leading byte offset).
  static constexpr int SWIZZLE_ATOM = 8 * PANEL_BYTES;
  // rows row0.. (M or N; row0 % 8 == 0) by k columns k0..k0+15 (k0 % 16 == 0)
  static __device__ __forceinline__ u64 desc_k_major(u32 tile_smem, int row0, int k0) {
    return desc_plus(wgmma_desc<PANEL_BYTES>(tile_smem, 16, SWIZZLE_ATOM),
                     (k0 / PANEL_COLS) * (ROWS * PANEL_BYTES) + row0 * PANEL_BYTES + (k0 % PANEL_COLS) * 2);
  }
  // k rows k0..k0+15 (k0 % 8 == 0) by MN columns n0.. (n0 % 8 == 0): any number of whole panels from a panel
  // boundary, or, from inside a panel, at most the rest of that panel (the head-dim-32 backward's dQ halves: 16
  // columns from column 16). The start address moves by whole 16-byte chunks of the unswizzled row, as a K-major
  // k step does; the hardware applies the XOR to the address it forms, so the chunks it reads are the stored ones.
  static __device__ __forceinline__ u64 desc_mn_major(u32 tile_smem, int k0, int n0) {
    return desc_plus(wgmma_desc<PANEL_BYTES>(tile_smem, ROWS * PANEL_BYTES, SWIZZLE_ATOM),
                     (n0 / PANEL_COLS) * (ROWS * PANEL_BYTES) + k0 * PANEL_BYTES + (n0 % PANEL_COLS) * 2);
  }
  // The descriptor of tile_smem + bytes from that of tile_smem: the start address field (bits 0-13, the
  // address / 16) plus bytes / 16, which never carries into the next field (shared addresses stay below
  // 2^18) nor into the high word. So written, the descriptors of one tile share one base and each costs
  // one 32-bit add; built from each address, every wgmma of the backward's query loop cost ~5 integer ops.
  static __device__ __forceinline__ u64 desc_plus(u64 desc, u32 bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | static_cast<u32>(static_cast<u32>(desc) + (bytes >> 4));
  }

  // Address of the 16 x 16 block at (row0, col0), row0 % 8 == 0 and col0 % 16 == 0, for a lane whose
  // address of the block at (0, 0) is lane_addr (tile base 1024-byte aligned). 16-column steps inside
  // a panel flip swizzled chunk bits (XOR); 8-row steps and panels add whole lines.
  static __device__ __forceinline__ u32 frag(u32 lane_addr, int row0, int col0) {
    return (lane_addr ^ (((col0 % PANEL_COLS) / 8) << 4)) + (col0 / PANEL_COLS) * (ROWS * PANEL_BYTES) +
           row0 * PANEL_BYTES;
  }
};

// The panel-step order of a tile copy by THREADS threads (load_tile_async's rolled copies, load_tile_rows_async): a
// thread's chunks are ROW_COPIES rows ROW_STEP apart in one panel, their columns in that panel, then STEPS such groups
// whole panels apart (STEP_COLS columns, STEP_SMEM bytes in shared memory); first_row / first_col: its first chunk.
// The chunks are those of panel order (chunk tid + i * THREADS), so a warp's copy instruction writes what panel
// order's does. EVEN: every thread has STEPS groups (else the last step's threads past the last panel have none).
template <class Tile, int THREADS>
struct PanelSteps {
  static_assert(Tile::template chunk_steps_exact<THREADS>(), "chunk_rows / chunk_cols need power-of-two sizes");
  static constexpr int ROW_COPIES = Tile::CHUNKS_PER_PANEL > THREADS ? Tile::CHUNKS_PER_PANEL / THREADS : 1;
  static constexpr int STEPS = (Tile::CHUNKS / ROW_COPIES + THREADS - 1) / THREADS;
  static constexpr bool EVEN = Tile::CHUNKS % (THREADS * ROW_COPIES) == 0;
  static constexpr int ROW_STEP = Tile::template chunk_rows<THREADS>(1);  // (meaningful when ROW_COPIES > 1)
  static constexpr int STEP_COLS = Tile::template chunk_cols<THREADS>(ROW_COPIES);
  static constexpr u32 STEP_SMEM = Tile::template chunk_smem<THREADS>(ROW_COPIES);
  // (t unsigned: the divisions are shifts)
  static __device__ __forceinline__ int first_row(u32 t) { return (t % Tile::CHUNKS_PER_PANEL) / Tile::PANEL_CHUNKS; }
  static __device__ __forceinline__ int first_col(u32 t) {
    return (t / Tile::CHUNKS_PER_PANEL) * Tile::PANEL_COLS + (t % Tile::PANEL_CHUNKS) * 8;
  }
};

// Tile [ROWS, HEAD_DIM] from global memory (row r at gmem + r * row_stride) into shared memory,
// 16 bytes per cp.async. Rows >= rows_valid and columns >= cols_valid are zero-filled without a
// read, so a tail tile holds zeros (never NaN garbage that 0 * x would turn into NaN).
template <class Tile, int THREADS>
__device__ __forceinline__ void load_tile_async(u32 tile_smem, const u16* tile_gmem, long long row_stride,
                                                int rows_valid, int cols_valid, int tid) {
  if constexpr (!Tile::template fixed_column<THREADS>()) {  // e.g. HEAD_DIM 96: chunks in panel order
    if constexpr (Tile::template panel_order_unrolled<THREADS>()) {
      static_assert(Tile::template chunk_steps_exact<THREADS>(), "chunk_rows / chunk_cols need power-of-two sizes");
      int row, col;  // this thread's first chunk; the others are compile-time steps from it
      Tile::panel_order(tid, row, col);
      const u32 dst = tile_smem + Tile::offset(row, col);
      const u16* src = tile_gmem + row * row_stride + col;
#pragma unroll
      for (int i = 0; i < Tile::CHUNKS / THREADS; ++i) {
        const bool valid = row + Tile::template chunk_rows<THREADS>(i) < rows_valid &&
                           col + Tile::template chunk_cols<THREADS>(i) < cols_valid;
        cp_async_cg_16(dst + Tile::template chunk_smem<THREADS>(i),
                       valid ? src + Tile::template chunk_rows<THREADS>(i) * row_stride + Tile::template chunk_cols<THREADS>(i)
                             : tile_gmem,
                       valid);
      }
    } else if constexpr (Tile::template chunk_steps_exact<THREADS>() &&
                         (Tile::CHUNKS % THREADS == 0 || THREADS % Tile::CHUNKS_PER_PANEL == 0)) {
      // rolled over panel steps: the thread's chunks of a panel (ROW_COPIES, at constant row steps) unrolled, and
      // the loop moves the first of them by whole panels (STEP_COLS columns, STEP_SMEM bytes), so a chunk costs a
      // few instructions; rolled over the chunk index with each chunk's row, column and swizzled offset derived
      // anew, a copy took ~40 instructions per cp.async (and the same code in bwd_sm90_split_kernel's Q / dO copy
      // 27 % of its time: ncu, H200, 2026-12-02). Unrolled whole, the row offsets of these 6-16 chunks spilled.
      // Where the threads cover whole panels per step but not the tile evenly (32 x 96 over 256 threads: 3 panels,
      // 2 per step), the last step's threads past the last panel copy nothing.
      using PS = PanelSteps<Tile, THREADS>;
      const int row0 = PS::first_row(static_cast<u32>(tid));
      int col = PS::first_col(static_cast<u32>(tid));
      u32 dst = tile_smem + Tile::offset(row0, col);
      const u16* src = tile_gmem + row0 * row_stride + col;
#pragma unroll 1
      for (int i = 0; i < PS::STEPS; ++i) {
        if (!PS::EVEN && col >= Tile::HEAD_DIM) break;  // (uneven: the last step, past the last panel)
#pragma unroll
        for (int r = 0; r < PS::ROW_COPIES; ++r) {
          const int row_step = Tile::template chunk_rows<THREADS>(r);
          const bool valid = row0 + row_step < rows_valid && col < cols_valid;
          cp_async_cg_16(dst + Tile::template chunk_smem<THREADS>(r), valid ? src + row_step * row_stride : tile_gmem,
                         valid);
        }
        src += PS::STEP_COLS;
        dst += PS::STEP_SMEM;
        col += PS::STEP_COLS;
      }
    } else {
      for (int idx = tid; idx < Tile::CHUNKS; idx += THREADS) {
        int row, col;
        Tile::panel_order(idx, row, col);
        const bool valid = row < rows_valid && col < cols_valid;
        cp_async_cg_16(tile_smem + Tile::offset(row, col), valid ? tile_gmem + row * row_stride + col : tile_gmem,
                       valid);
      }
    }
    return;
  }
  // each thread keeps one column chunk; row steps of ROWS_PER_ITER (a multiple of 8) keep the swizzle
  constexpr int ROWS_PER_ITER = THREADS / Tile::CHUNKS_PER_ROW;
  const int row = tid / Tile::CHUNKS_PER_ROW, col = (tid % Tile::CHUNKS_PER_ROW) * 8;
  const u32 dst = tile_smem + Tile::offset(row, col);
  const u16* src = tile_gmem + row * row_stride + col;
  const bool col_ok = col < cols_valid;
#pragma unroll
  for (int i = 0; i < (Tile::ROWS + ROWS_PER_ITER - 1) / ROWS_PER_ITER; ++i) {
    if (Tile::ROWS % ROWS_PER_ITER == 0 || row + i * ROWS_PER_ITER < Tile::ROWS) {
      const bool valid = col_ok && row + i * ROWS_PER_ITER < rows_valid;
      cp_async_cg_16(dst + i * ROWS_PER_ITER * Tile::PANEL_BYTES, valid ? src + i * ROWS_PER_ITER * row_stride : tile_gmem,
                     valid);
    }
  }
}

// load_tile_async split in two for a kernel that copies many tiles of one shape and row stride (the
// backward's Q and dO blocks): the constructor computes, once, where this thread's first chunk is (row,
// column, shared offset, global offset row * row_stride + col; the others are compile-time steps from it:
// fixed-column, i * ROWS_PER_ITER rows; panel order, chunk_rows / chunk_cols); load() then costs an add
// and a select per chunk, with no divisions or row products. Same chunks, same order as load_tile_async.
// It selects the offset, where load_tile_async selects the pointer: ptxas then keeps one base per copy
// (the pointer form cost the d128 backward 23 more integer ops per query block), but the offset form in
// load_tile_async made NVRTC 13.0 spill 44 bytes in fwd_kernel d128, so that one stays as it is.
template <class Tile, int THREADS>
struct TileCopy {
  static constexpr bool FIXED_COLUMN = Tile::template fixed_column<THREADS>();
  // otherwise (e.g. HEAD_DIM 192 over 128 threads: 6 chunks each, not a power of two) load() is
  // load_tile_async's rolled panel-order loop, from the thread index kept in `row`
  static constexpr bool STEPPED = FIXED_COLUMN || (Tile::template panel_order_unrolled<THREADS>() &&
                                                   Tile::template chunk_steps_exact<THREADS>());
  static constexpr int ROWS_PER_ITER = FIXED_COLUMN ? THREADS / Tile::CHUNKS_PER_ROW : 0;
  static constexpr int CHUNKS = FIXED_COLUMN ? (Tile::ROWS + ROWS_PER_ITER - 1) / ROWS_PER_ITER : Tile::CHUNKS / THREADS;
  int row, col;        // this thread's first chunk (not STEPPED: row = the thread index)
  u32 smem_off;        // its byte offset in the shared tile
  long long gmem_off;  // its element offset from the global tile's row 0: row * row_stride + col

  __device__ __forceinline__ TileCopy(int tid, long long row_stride) {
    if constexpr (!STEPPED) {
      row = tid;
      col = 0;
      smem_off = 0;
      gmem_off = 0;
      return;
    } else if constexpr (FIXED_COLUMN) {
      row = tid / Tile::CHUNKS_PER_ROW;
      col = (tid % Tile::CHUNKS_PER_ROW) * 8;
    } else {
      Tile::panel_order(tid, row, col);
    }
    smem_off = Tile::offset(row, col);
    gmem_off = row * row_stride + col;
  }
  static constexpr int chunk_rows(int i) { return FIXED_COLUMN ? i * ROWS_PER_ITER : Tile::template chunk_rows<THREADS>(i); }
  static constexpr int chunk_cols(int i) { return FIXED_COLUMN ? 0 : Tile::template chunk_cols<THREADS>(i); }
  static constexpr u32 chunk_smem(int i) {
    return FIXED_COLUMN ? i * ROWS_PER_ITER * Tile::PANEL_BYTES : Tile::template chunk_smem<THREADS>(i);
  }

  // the tile at tile_gmem (the row stride given to the constructor) into tile_smem; chunks outside
  // rows_valid x cols_valid are zero-filled without a read (tile_gmem is their placeholder address)
  __device__ __forceinline__ void load(u32 tile_smem, const u16* tile_gmem, long long row_stride, int rows_valid,
                                       int cols_valid) const {
    if constexpr (!STEPPED) {
      load_tile_async<Tile, THREADS>(tile_smem, tile_gmem, row_stride, rows_valid, cols_valid, row);
      return;
    }
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      if (!FIXED_COLUMN || Tile::ROWS % ROWS_PER_ITER == 0 || row + chunk_rows(i) < Tile::ROWS) {
        const bool valid = row + chunk_rows(i) < rows_valid && col + chunk_cols(i) < cols_valid;
        const long long off = gmem_off + chunk_rows(i) * row_stride + chunk_cols(i);
        cp_async_cg_16(tile_smem + smem_off + chunk_smem(i), tile_gmem + (valid ? off : 0), valid);
      }
    }
  }
};

// The same copy for tiles whose rows are not evenly spaced in global memory (the decode kernel's Q tile, whose rows
// are (position, query head) pairs; a paged cache's K and V tiles that straddle pages). A thread's chunks are in
// PanelSteps order: ROW_COPIES rows at constant row steps from its first, and in each row STEPS chunks whole panels
// apart, so it asks `rows` for one row pointer per row, not per chunk (per chunk, with the chunk's row
// and column derived anew, a copy took 63-77 instructions per cp.async and 16-row pages decoded 1.6-1.9x slower
// than 64-row ones). `rows` is a cursor over Rows::TILES tiles of the same rows (K and V), the shared-memory tile j
// at tile_smem + j * tile_step: seek(row) once, advance<STEP>() to the next of the thread's rows, ptr(j) the row's
// first element in tile j; every lane of the warp calls each of them equally often (a cursor may shuffle), the rows
// past rows_valid included. Chunks outside rows_valid x cols_valid are zero-filled and read nothing: the row's
// first element stands in (Rows::IN_BOUNDS: every row, valid or not, is readable), else `placeholder`.
template <class Tile, int THREADS, class Rows>
__device__ __forceinline__ void load_tile_rows_async(u32 tile_smem, u32 tile_step, Rows& rows, const u16* placeholder,
                                                     int rows_valid, int cols_valid, int tid) {
  using PS = PanelSteps<Tile, THREADS>;
  static_assert(PS::EVEN, "every lane copies as many chunks (a cursor may shuffle)");
  int row = PS::first_row(static_cast<u32>(tid));
  const int col = PS::first_col(static_cast<u32>(tid));
  u32 dst = tile_smem + Tile::offset(row, col);
  rows.seek(row);
#pragma unroll 1
  for (int r = 0; r < PS::ROW_COPIES; ++r) {
    const bool row_ok = row < rows_valid;
#pragma unroll
    for (int j = 0; j < Rows::TILES; ++j) {
      const u16* src = rows.ptr(j);
#pragma unroll
      for (int s = 0; s < PS::STEPS; ++s) {
        const bool valid = row_ok && col + s * PS::STEP_COLS < cols_valid;
        const u32 to = dst + j * tile_step + s * PS::STEP_SMEM;
        if constexpr (Rows::IN_BOUNDS)
          cp_async_cg_16(to, src + (valid ? col + s * PS::STEP_COLS : 0), valid);
        else
          cp_async_cg_16(to, valid ? src + col + s * PS::STEP_COLS : placeholder, valid);
      }
    }
    if (PS::ROW_COPIES > 1) {
      rows.template advance<PS::ROW_STEP>();
      row += PS::ROW_STEP;
      dst += PS::ROW_STEP * Tile::PANEL_BYTES;  // a multiple of 8 rows: the swizzle is the same
    }
  }
}

// A row cursor for load_tile_rows_async over the rows of one tile given by a function: ptr(0) is row_ptr(row).
template <class RowPtr>
struct RowFnCursor {
  static constexpr int TILES = 1;
  static constexpr bool IN_BOUNDS = false;  // rows past rows_valid may point anywhere
  RowPtr row_ptr;
  int row;
  __device__ __forceinline__ explicit RowFnCursor(RowPtr f) : row_ptr(f), row(0) {}
  __device__ __forceinline__ void seek(int r) { row = r; }
  template <int STEP>
  __device__ __forceinline__ void advance() { row += STEP; }
  __device__ __forceinline__ const u16* ptr(int) const { return row_ptr(row); }
};

// Tile from shared memory to global memory, 16 bytes per thread and instruction, valid part only.
template <class Tile, int THREADS>
__device__ __forceinline__ void store_tile(u16* tile_gmem, long long row_stride, const unsigned char* tile_smem,
                                           int rows_valid, int cols_valid, int tid) {
  if constexpr (!Tile::template fixed_column<THREADS>()) {  // panel order, as in load_tile_async
    if constexpr (Tile::template panel_order_unrolled<THREADS>()) {
      static_assert(Tile::template chunk_steps_exact<THREADS>(), "chunk_rows / chunk_cols need power-of-two sizes");
      int row, col;  // this thread's first chunk; the others are compile-time steps from it
      Tile::panel_order(tid, row, col);
      const unsigned char* src = tile_smem + Tile::offset(row, col);
      u16* dst = tile_gmem + row * row_stride + col;
#pragma unroll
      for (int i = 0; i < Tile::CHUNKS / THREADS; ++i)
        if (row + Tile::template chunk_rows<THREADS>(i) < rows_valid &&
            col + Tile::template chunk_cols<THREADS>(i) < cols_valid)
          *reinterpret_cast<uint4*>(dst + Tile::template chunk_rows<THREADS>(i) * row_stride +
                                    Tile::template chunk_cols<THREADS>(i)) =
              *reinterpret_cast<const uint4*>(src + Tile::template chunk_smem<THREADS>(i));
    } else {
      for (int idx = tid; idx < Tile::CHUNKS; idx += THREADS) {
        int row, col;
        Tile::panel_order(idx, row, col);
        if (row < rows_valid && col < cols_valid)
          *reinterpret_cast<uint4*>(tile_gmem + row * row_stride + col) =
              *reinterpret_cast<const uint4*>(tile_smem + Tile::offset(row, col));
      }
    }
    return;
  }
  constexpr int ROWS_PER_ITER = THREADS / Tile::CHUNKS_PER_ROW;
  const int row = tid / Tile::CHUNKS_PER_ROW, col = (tid % Tile::CHUNKS_PER_ROW) * 8;
  const unsigned char* src = tile_smem + Tile::offset(row, col);
  u16* dst = tile_gmem + row * row_stride + col;
  if (col >= cols_valid) return;
#pragma unroll
  for (int i = 0; i < (Tile::ROWS + ROWS_PER_ITER - 1) / ROWS_PER_ITER; ++i) {
    if ((Tile::ROWS % ROWS_PER_ITER == 0 || row + i * ROWS_PER_ITER < Tile::ROWS) && row + i * ROWS_PER_ITER < rows_valid)
      *reinterpret_cast<uint4*>(dst + i * ROWS_PER_ITER * row_stride) =
          *reinterpret_cast<const uint4*>(src + i * ROWS_PER_ITER * Tile::PANEL_BYTES);
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

// The first 1024-byte aligned byte of the dynamic shared memory: the 128-byte swizzle of wgmma's descriptors (and
// of TMA's boxes) is a function of the address, so swizzled tiles start on its 1024-byte period. The kernels ask
// for 1024 bytes more than their tiles (the configs' smem_bytes) to leave room for the shift.
struct AlignedSmem {
  u32 base;            // shared-window address
  unsigned char* ptr;  // generic pointer to the same byte
};
__device__ __forceinline__ AlignedSmem align_smem_1024(unsigned char* smem_raw) {
  const u32 raw = smem_u32(smem_raw);
  const u32 base = (raw + 1023u) & ~1023u;
  return {base, smem_raw + (base - raw)};
}

// ---- shared -> register fragments of mma.m16n8k16 (lane l, g = l / 4, t = l % 4) --------------
//
// Each ldmatrix variant gives every lane one row address inside a 16 x 16 block. A kernel computes
// a lane's address of the block at (0, 0) once (`lane_addr = tile_smem + lane_offset_*<Tile>(lane)`,
// plus any run-time row offset that is a multiple of 8); `Tile::frag` moves it to the block at
// (row0, col0) with one XOR and an immediate, so unrolled loops keep a handful of address registers.

// A (row-major 16 x 16, rows m, columns k). x4 matrices: (m 0-7, k 0-7), (m 8-15, k 0-7),
// (m 0-7, k 8-15), (m 8-15, k 8-15) -> a0..a3.
template <class Tile>
__device__ __forceinline__ u32 lane_offset_a(int lane) {
  return Tile::offset(lane & 15, (lane >> 4) * 8);
}
// B of two n8 tiles from a tile stored [n][k] (K as the B of Q K^T). x4 matrices: (n 0-7, k 0-7),
// (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) -> b[0], b[1] of n-tile 0, b[2], b[3] of n-tile 1.
template <class Tile>
__device__ __forceinline__ u32 lane_offset_b_nk(int lane) {
  return Tile::offset((lane & 7) + ((lane >> 4) << 3), ((lane >> 3) & 1) * 8);
}
// B of two n8 tiles from a tile stored [k][n] (V as the B of P V), read with .trans. x4 matrices:
// (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
template <class Tile>
__device__ __forceinline__ u32 lane_offset_b_kn_trans(int lane) {
  return Tile::offset((lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8);
}
// A (16 x 16, rows m, columns k) from a tile stored [k][m] (dS^T read as dS), with .trans. x4
// matrices: (k 0-7, m 0-7) -> a0, (k 0-7, m 8-15) -> a1, (k 8-15, m 0-7) -> a2, (k 8-15, m 8-15) -> a3.
template <class Tile>
__device__ __forceinline__ u32 lane_offset_a_trans(int lane) {
  return Tile::offset((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8);
}

// The same loads by (tile, block position); equivalent, for code that does not keep lane addresses.
template <class Tile>
__device__ __forceinline__ void ldmatrix_a(u32 (&a)[4], u32 tile_smem, int row0, int col0, int lane) {
  ldmatrix_x4(a, Tile::frag(tile_smem + lane_offset_a<Tile>(lane), row0, col0));
}
template <class Tile>
__device__ __forceinline__ void ldmatrix_b_nk(u32 (&b)[4], u32 tile_smem, int n0, int k0, int lane) {
  ldmatrix_x4(b, Tile::frag(tile_smem + lane_offset_b_nk<Tile>(lane), n0, k0));
}
template <class Tile>
__device__ __forceinline__ void ldmatrix_b_kn_trans(u32 (&b)[4], u32 tile_smem, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, Tile::frag(tile_smem + lane_offset_b_kn_trans<Tile>(lane), k0, n0));
}
template <class Tile>
__device__ __forceinline__ void ldmatrix_a_trans(u32 (&a)[4], u32 tile_smem, int k0, int m0, int lane) {
  ldmatrix_x4_trans(a, Tile::frag(tile_smem + lane_offset_a_trans<Tile>(lane), k0, m0));
}

}  // namespace cuflash
