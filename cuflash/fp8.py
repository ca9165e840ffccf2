"""FP8 (e4m3) inputs for attention: quantize, dequantize, and the randomized Hadamard transform that tames outliers.

Storage. CuPy cannot hold ml_dtypes.float8_e4m3fn arrays (`cupy.zeros(4, dtype=ml_dtypes.float8_e4m3fn)` raises
"Unsupported dtype float8_e4m3fn" in CuPy 14), so cuflash keeps e4m3 data in CuPy *uint8* arrays holding the e4m3fn
bit patterns: the bits of `a.astype(ml_dtypes.float8_e4m3fn).view(numpy.uint8)` for a NumPy array a. e4m3fn is
S.EEEE.MMM with exponent bias 7: normal values 2^(E-7) * (1 + M/8) from 2^-6 to 448 = 1.75 * 2^8, subnormals M * 2^-9,
S.1111.111 is NaN and there are no infinities. To read such data on the host: `cupy.asnumpy(x_q).view(
ml_dtypes.float8_e4m3fn)`.

Scaling. An FP8 tensor travels with a float32 *descale* array: the real value of element x is e4m3_value(x) * descale
of x's group. `quantize` picks each group's descale = amax / 448 (amax the group's largest |x|), so the group's largest
element maps to +-448 and the rest keep e4m3's 3 mantissa bits relative to it. The groups of a (batch, seqlen, heads,
head_dim) tensor ("bshd"; "bhsd" is (batch, heads, seqlen, head_dim), with the same descale shapes):
    scaling="tensor"  one group:                               descale shape ()
    scaling="head"    one per (batch, head):                   descale shape (batch, heads)
    scaling="block"   one per block_rows = 128 consecutive     descale shape (batch, heads, ceil(seqlen / 128))
                      rows (tokens) of one (batch, head):
                      FlashAttention-3's block quantization (the default: an outlier costs only its block's precision)
Those three shapes are what the attention kernels accept as q_descale, k_descale, v_descale.

From bf16 / fp32 data to FP8 attention:
    q8, qd = cuflash.fp8.quantize(q)              # uint8 e4m3 bits, float32 descale (batch, heads, ceil(seqlen / 128))
    k8, kd = cuflash.fp8.quantize(k)
    v8, vd = cuflash.fp8.quantize(v)
    o = cuflash.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
With outliers (a few channels of q or k much larger than the rest, which block scaling cannot isolate along
head_dim), rotate q and k first by the same random orthogonal matrix, which leaves Q K^T unchanged and spreads each
outlier over every channel (QuIP's "incoherence processing", FlashAttention-3's FP8 recipe):
    qh, kh = cuflash.fp8.incoherent(q, k, seed=0)       # q R and k R, R = diag(s) H_D / sqrt(D)
    q8, qd = cuflash.fp8.quantize(qh); k8, kd = cuflash.fp8.quantize(kh); ...

The rounding (`quantize`, `_e4m3_bits_numpy`): x / descale (an IEEE float32 division) rounded to the nearest e4m3fn,
ties to even, bit-equal to ml_dtypes' `numpy.float32(v).astype(ml_dtypes.float8_e4m3fn)` for |v| <= 448; beyond,
quantize saturates to +-448 (0x7E / 0xFE) where ml_dtypes rounds past 464 to NaN, so finite inputs never give NaN.
descale is amax / 448 in float32, at least 2^-149 (the smallest float32, so that a group of tiny values never divides
by 0), and 1 for an all-zero group. Inputs must be finite: a NaN is ignored by the group's amax and quantizes to NaN
(0x7F / 0xFF); an inf makes its group's descale inf. Every conversion is done in software on the float32 bits, so it
runs on every GPU cuflash runs on (no cvt.e4m3 instruction needed).

Kernels: one NVRTC module (`_SOURCE`, every template instance in `_INSTANCES`), compiled by CuPy on first use with
cuda/ on its include path (ptx.cuh's cvt wrappers for the 16-bit loads and stores). quantize / dequantize give one
256-thread CTA a tile of rows of one (batch, head), moved 16 bytes at a time where head_dim is contiguous and the rows
aligned (one element at a time otherwise: any strides work); hadamard gives 4 rows to each warp. On an H200 with bf16
(4, 8192, 32, 128) (a copy: 4.1 TB/s): quantize "block" 0.21 ms (1.9 TB/s, x read and x_q written), "tensor" or
"head" 0.25 ms, dequantize to bf16 0.15 ms, hadamard 0.20 ms (2.6 TB/s).
`quantize_reference` and `dequantize_reference` are the NumPy references of the tests.
"""
from __future__ import annotations

import hashlib
import math
import threading
from functools import lru_cache

import numpy as np

from . import _compile, _launch, _validate

E4M3_MAX = 448.0          # e4m3fn's largest finite value, 1.75 * 2^8
E4M3_MAX_BITS = 0x7E      # its bit pattern (0x7F is NaN)
BLOCK_ROWS = 128          # rows per descale block that the attention kernels read (FlashAttention-3's block size)
SCALINGS = ("tensor", "head", "block")
HADAMARD_DIMS = (32, 64, 128, 256)  # head_dim of `hadamard`: a power of two, HEAD_DIM / 32 values a lane
DESCALE_MIN = 2.0**-149   # smallest float32 (a subnormal): the least descale of a group with a nonzero element

_THREADS = 256            # CTA size of every kernel (8 warps)
_HADAMARD_ROWS_PER_WARP = 4  # rows a warp of hadamard_kernel loads before it transforms any
_TILE_ROWS = 128          # rows a quantize / dequantize CTA owns when groups span several tiles ("tensor", "head")
_MAX_CTAS = 2**31 - 1     # gridDim.x
_MAX_TILE_ELEMENTS = 2**31 - 1 - _THREADS  # a tile's int32 element index, plus one step, stays below 2^31
_FLOAT_DTYPES = {np.dtype(np.float16): "fp16", _validate.BF16: "bf16", np.dtype(np.float32): "fp32"}
_ALLOWED_DTYPES = "float16, bfloat16 (ml_dtypes.bfloat16) or float32"

_SOURCE = r"""
#include "ptx.cuh"

namespace cuflash {
namespace fp8 {

typedef unsigned char u8;

constexpr int THREADS = 256;         // every kernel's CTA: 8 warps (cuflash/fp8.py _THREADS)
constexpr int WARPS = THREADS / 32;
constexpr u32 FULL_MASK = 0xffffffffu;
constexpr float E4M3_MAX = 448.f;    // e4m3fn's largest finite value, 1.75 * 2^8 (S.1111.111 is NaN, no infinities)
constexpr int HADAMARD_ROWS_PER_WARP = 4;  // cuflash/fp8.py _HADAMARD_ROWS_PER_WARP

// ---- element types: storage in global memory, float32 loads and stores (round to nearest even) -------------
template <class T>
struct Elem;
template <>
struct Elem<float> {
  typedef float storage;
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float y) { return y; }
};
template <>
struct Elem<f16> {
  typedef u16 storage;
  static __device__ __forceinline__ float load(u16 x) { return Cvt<f16>::to_float(x); }
  static __device__ __forceinline__ u16 store(float y) { return static_cast<u16>(Cvt<f16>::pack(y, 0.f)); }
};
template <>
struct Elem<bf16> {
  typedef u16 storage;
  static __device__ __forceinline__ float load(u16 x) { return Cvt<bf16>::to_float(x); }
  static __device__ __forceinline__ u16 store(float y) { return static_cast<u16>(Cvt<bf16>::pack(y, 0.f)); }
};

// ---- e4m3fn <-> float32, in software on the bits (cuflash/fp8.py _e4m3_bits_numpy / _e4m3_values_numpy) ---
// float32 -> e4m3fn bits, round to nearest even. |v| past 448 (inf too) saturates to +-448 (0x7E); NaN -> 0x7F.
__device__ __forceinline__ u8 e4m3_bits(float v) {
  const u32 u = __float_as_uint(v);
  const u32 sign = (u >> 24) & 0x80u;
  const u32 a = u & 0x7fffffffu;  // |v|
  u32 r;
  if (a > 0x7f800000u) {  // NaN
    r = 0x7fu;
  } else if (a >= 0x3c800000u) {  // |v| >= 2^-6, e4m3's least normal
    // rebias the exponent (127 -> 7), then round the 20 dropped mantissa bits to nearest even: a carry out of the
    // mantissa moves into the exponent, as it should
    const u32 rebiased = a - (120u << 23);
    r = min((rebiased + 0x7ffffu + ((rebiased >> 20) & 1u)) >> 20, 0x7eu);  // saturate below 0x7f (NaN)
  } else {  // a subnormal e4m3 (or 0x08 = 2^-6 after rounding up): round(|v| * 2^9) = round(mant * 2^(e - 141))
    const u32 e = a >> 23;                         // float32's biased exponent, <= 120 here
    const u32 mant = (a & 0x7fffffu) | 0x800000u;  // 1.m * 2^23 (float32 subnormals: e = 0, shift 25 gives 0)
    const u32 shift = min(141u - e, 25u);          // >= 21; 25: mant * 2^-25 < 1/2 always rounds to 0
    const u32 q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  }
  return static_cast<u8>(sign | r);
}

// e4m3fn bits -> float32 (exact)
__device__ __forceinline__ float e4m3_value(u32 bits) {
  const u32 e = (bits >> 3) & 0xfu, m = bits & 7u;
  float v;
  if (e == 0) {
    v = static_cast<float>(m) * (1.f / 512.f);  // subnormal: m * 2^-9
  } else if (e == 15 && m == 7) {
    v = __uint_as_float(0x7fc00000u);            // NaN
  } else {
    v = __uint_as_float(((e + 120u) << 23) | (m << 20));  // 2^(e - 7) (1 + m / 8): rebias 7 -> 127
  }
  return (bits & 0x80u) ? -v : v;
}

// descale of a group: amax / 448 (IEEE division), at least 2^-149 (never 0: x / descale stays finite); 1 for an
// all-zero group. cuflash/fp8.py _descale_numpy is the same.
__device__ __forceinline__ float descale_of_amax(float amax) {
  return amax > 0.f ? fmaxf(amax / E4M3_MAX, __uint_as_float(1u)) : 1.f;
}

// ---- tiles: the rows of one (batch, head) a CTA owns ---------------------------------------------------------
// Tensors are read as (batch, seqlen, heads, head_dim) through element strides, whatever their layout.
struct Strides4 {
  long long b, s, h, d;
};
// blockIdx.x = (b * heads + h) * num_tiles + t; tile t holds rows row0 = t * tile_rows .. row0 + rows - 1.
struct Tile {
  int b, h, t, row0, rows;
};
__device__ __forceinline__ Tile tile_of_cta(int seqlen, int heads, int tile_rows, int num_tiles) {
  Tile tile;
  const int bh = blockIdx.x / num_tiles;
  tile.t = blockIdx.x - bh * num_tiles;
  tile.b = bh / heads;
  tile.h = bh - tile.b * heads;
  tile.row0 = tile.t * tile_rows;
  tile.rows = min(tile_rows, seqlen - tile.row0);
  return tile;
}

// VEC consecutive elements of a row, moved as one aligned access (VEC > 1: 16 bytes on the wider side; the host
// picks VEC > 1 only where head_dim is contiguous and every chunk is aligned, cuflash/fp8.py _vec_width)
template <class S, int VEC>
struct alignas(sizeof(S) * VEC) Chunk {
  S v[VEC];
};
template <int VEC, class S>
__device__ __forceinline__ Chunk<S, VEC> load_chunk(const S* p) {
  if constexpr (VEC == 1) {
    return Chunk<S, 1>{{*p}};
  } else {
    return *reinterpret_cast<const Chunk<S, VEC>*>(p);
  }
}

// f(row, c) for every chunk c (columns c * VEC .. c * VEC + VEC - 1) of every row of the tile, consecutive threads
// on consecutive chunks of a row; (row, c) of the flat index steps by THREADS without a division. Measured for
// scaling "block", bf16 (4, 8192, 32, 128), on an H100 (x read once and x_q written, over the time): one element
// a step, 880 GB/s; unrolled to 4 or 8 elements a thread in flight, slower (667, 592 GB/s); 16-byte chunks,
// 1.68 TB/s (an H200: 1.92 TB/s, where a copy runs at 4.1 TB/s).
template <class F>
__device__ __forceinline__ void for_each_chunk(const Tile& tile, int chunks, F&& f) {
  const int n = tile.rows * chunks;  // < 2^31 - THREADS: checked by cuflash/fp8.py _check_tiles
  const int step_rows = THREADS / chunks, step_cols = THREADS % chunks;
  int row = tile.row0 + threadIdx.x / chunks, c = threadIdx.x % chunks;
  for (int i = threadIdx.x; i < n; i += THREADS) {
    f(row, c);
    row += step_rows;
    c += step_cols;
    if (c >= chunks) {  // step_cols < chunks: one wrap at most
      c -= chunks;
      ++row;
    }
  }
}

// max over the CTA of one value a thread, returned to every thread; red_smem: WARPS floats, used once
__device__ __forceinline__ float cta_max(float v, float* red_smem) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
  if (threadIdx.x % 32 == 0) red_smem[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x % 32 < WARPS ? red_smem[threadIdx.x % 32] : 0.f;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
  return v;
}

// amax = max |x| over the tile (fmaxf: a NaN element is ignored)
template <class T, int VEC>
__device__ __forceinline__ float tile_amax(const typename Elem<T>::storage* x, const Strides4& xs, const Tile& tile,
                                           int head_dim, float* red_smem) {
  const typename Elem<T>::storage* x_tile = x + tile.b * xs.b + tile.h * xs.h;
  float amax = 0.f;
  for_each_chunk(tile, head_dim / VEC, [&](int row, int c) {
    const auto in = load_chunk<VEC>(x_tile + row * xs.s + c * VEC * xs.d);
#pragma unroll
    for (int e = 0; e < VEC; ++e) amax = fmaxf(amax, fabsf(Elem<T>::load(in.v[e])));
  });
  return cta_max(amax, red_smem);
}

// ---- amax of each tile (the first pass of scaling "tensor" and "head") ----------------------------------------
template <class T, int VEC>
__global__ void __launch_bounds__(THREADS) amax_kernel(
    const typename Elem<T>::storage* x,  // [batch, seqlen, heads, head_dim] through strides x_s*
    long long x_sb, long long x_ss, long long x_sh, long long x_sd,
    int seqlen, int heads, int head_dim, int tile_rows, int num_tiles,
    float* tile_amax_out) {              // [batch, heads, num_tiles]
  __shared__ float red_smem[WARPS];
  const Tile tile = tile_of_cta(seqlen, heads, tile_rows, num_tiles);
  const float amax = tile_amax<T, VEC>(x, Strides4{x_sb, x_ss, x_sh, x_sd}, tile, head_dim, red_smem);
  if (threadIdx.x == 0) tile_amax_out[blockIdx.x] = amax;
}

// ---- x_q = e4m3(x / descale) ----------------------------------------------------------------------------------
// IS_TILE_GROUP (scaling "block"): the group is this CTA's tile, whose amax it computes itself; else the group's
// amax is read from group_amax (amax_kernel's tiles, reduced over the group).
template <class T, bool IS_TILE_GROUP, int VEC>
__global__ void __launch_bounds__(THREADS) quantize_kernel(
    const typename Elem<T>::storage* x,  // [batch, seqlen, heads, head_dim] through strides x_s*
    long long x_sb, long long x_ss, long long x_sh, long long x_sd,
    u8* x_q,                             // same logical dims through strides q_s*, head_dim contiguous
    long long q_sb, long long q_ss, long long q_sh,
    int seqlen, int heads, int head_dim, int tile_rows, int num_tiles,
    const float* group_amax,             // [groups] (!IS_TILE_GROUP; unread otherwise)
    long long g_b, long long g_h, long long g_t,  // group of tile (b, h, t): g_b * b + g_h * h + g_t * t
    float* descale) {                    // [groups], written by the first tile of each group
  __shared__ float red_smem[WARPS];
  const Tile tile = tile_of_cta(seqlen, heads, tile_rows, num_tiles);
  const long long group = g_b * tile.b + g_h * tile.h + g_t * tile.t;
  float amax;
  if constexpr (IS_TILE_GROUP) {
    amax = tile_amax<T, VEC>(x, Strides4{x_sb, x_ss, x_sh, x_sd}, tile, head_dim, red_smem);
  } else {
    amax = group_amax[group];
  }
  const float d = descale_of_amax(amax);
  const bool is_group_first = (g_t != 0 || tile.t == 0) && (g_h != 0 || tile.h == 0) && (g_b != 0 || tile.b == 0);
  if (threadIdx.x == 0 && is_group_first) descale[group] = d;

  // x / descale is an IEEE division (not x * (1 / descale)), as in the NumPy reference
  const typename Elem<T>::storage* x_tile = x + tile.b * x_sb + tile.h * x_sh;
  u8* q_tile = x_q + tile.b * q_sb + tile.h * q_sh;
  for_each_chunk(tile, head_dim / VEC, [&](int row, int c) {
    const auto in = load_chunk<VEC>(x_tile + row * x_ss + c * VEC * x_sd);
    Chunk<u8, VEC> out;
#pragma unroll
    for (int e = 0; e < VEC; ++e) out.v[e] = e4m3_bits(Elem<T>::load(in.v[e]) / d);
    *reinterpret_cast<Chunk<u8, VEC>*>(q_tile + row * q_ss + c * VEC) = out;
  });
}

// ---- y = e4m3_value(x_q) * descale, rounded once to T ---------------------------------------------------------
template <class T, int VEC>
__global__ void __launch_bounds__(THREADS) dequantize_kernel(
    const u8* x_q,                       // [batch, seqlen, heads, head_dim] through strides q_s*
    long long q_sb, long long q_ss, long long q_sh, long long q_sd,
    typename Elem<T>::storage* y,        // same logical dims through strides y_s*, head_dim contiguous
    long long y_sb, long long y_ss, long long y_sh,
    int seqlen, int heads, int head_dim, int tile_rows, int num_tiles,
    const float* descale,                // the group of tile (b, h, t) at g_b * b + g_h * h + g_t * t
    long long g_b, long long g_h, long long g_t) {
  typedef typename Elem<T>::storage S;
  const Tile tile = tile_of_cta(seqlen, heads, tile_rows, num_tiles);
  const float d = descale[g_b * tile.b + g_h * tile.h + g_t * tile.t];
  const u8* q_tile = x_q + tile.b * q_sb + tile.h * q_sh;
  S* y_tile = y + tile.b * y_sb + tile.h * y_sh;
  for_each_chunk(tile, head_dim / VEC, [&](int row, int c) {
    const auto in = load_chunk<VEC>(q_tile + row * q_ss + c * VEC * q_sd);
    Chunk<S, VEC> out;
#pragma unroll
    for (int e = 0; e < VEC; ++e) out.v[e] = Elem<T>::store(e4m3_value(in.v[e]) * d);
    *reinterpret_cast<Chunk<S, VEC>*>(y_tile + row * y_ss + c * VEC) = out;
  });
}

// ---- randomized Hadamard transform along head_dim: y = x R, R = diag(s) H_D / sqrt(D) --------------------------
// H_D v for one row held by a warp, lane l holding v[e] = element j = l * PER_LANE + e. H_D (Sylvester, H[i][j] =
// (-1)^popcount(i & j)) is one butterfly (a, b) -> (a + b, a - b) on the pairs (j, j | bit) per bit of j: the low
// log2(PER_LANE) bits (e) in place, the 5 high bits (the lane) through shuffles.
template <int PER_LANE>
__device__ __forceinline__ void fwht_row(float (&v)[PER_LANE], int lane) {
  // register bits: pairs (e, e | stride) in this lane
#pragma unroll
  for (int stride = 1; stride < PER_LANE; stride <<= 1) {
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) {
      if (!(e & stride)) {
        const float a = v[e], b = v[e | stride];
        v[e] = a + b;
        v[e | stride] = a - b;
      }
    }
  }
  // lane bits: the partner of j is lane ^ bit, same e; the lane with the bit set keeps a - b
#pragma unroll
  for (int bit = 1; bit < 32; bit <<= 1) {
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) {
      const float other = __shfl_xor_sync(FULL_MASK, v[e], bit);
      v[e] = (lane & bit) ? other - v[e] : v[e] + other;
    }
  }
}

// One warp per ROWS consecutive rows, all loaded before any is transformed (their loads in flight together); lane l
// holds the PER_LANE = HEAD_DIM / 32 consecutive elements l * PER_LANE + e of a row, one chunk (IS_CHUNKED: head_dim
// contiguous and aligned, one vector load; else PER_LANE strided loads; y, contiguous, is stored a chunk at a time).
// float32 throughout. Measured on an H200 (bf16 (4, 8192, 32, 128); a copy runs at 4.1 TB/s): one row a warp with
// its (batch, seqlen, head) found by 64-bit divisions, 1.87 TB/s; rows of a flat x at row * x_s2, 2.37 TB/s; and 4
// rows a warp, 2.73 TB/s (8: 2.74; D = 64: 2.63, D = 256: 2.07).
template <class T, int HEAD_DIM, bool IS_CHUNKED>
__global__ void __launch_bounds__(THREADS) hadamard_kernel(
    const typename Elem<T>::storage* x,  // [n0, n1, n2, HEAD_DIM] through strides x_s*
    long long x_s0, long long x_s1, long long x_s2, long long x_sd,
    typename Elem<T>::storage* y,        // [n0, n1, n2, HEAD_DIM], contiguous
    int n1, int n2, long long rows,      // rows = n0 * n1 * n2
    int is_flat,                         // x_s0 == n1 * x_s1 and x_s1 == n2 * x_s2: row r starts at r * x_s2
    const float* signs,                  // [HEAD_DIM]: s, +-1
    float scale) {                       // 1 / sqrt(HEAD_DIM)
  static_assert(HEAD_DIM >= 32 && (HEAD_DIM & (HEAD_DIM - 1)) == 0, "HEAD_DIM must be a power of two >= 32");
  constexpr int PER_LANE = HEAD_DIM / 32;
  constexpr int ROWS = HADAMARD_ROWS_PER_WARP;
  typedef typename Elem<T>::storage S;
  const int lane = threadIdx.x % 32;
  const long long row0 = (static_cast<long long>(blockIdx.x) * WARPS + threadIdx.x / 32) * ROWS;
  if (row0 >= rows) return;  // the whole warp: rows are warp-uniform, so the shuffles see all 32 lanes

  // v = s * x (diag(s) first)
  Chunk<S, PER_LANE> in[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long row = min(row0 + r, rows - 1);  // past the end: a copy of the last row, not stored
    long long offset = row * x_s2;  // (64-bit divisions cost more than the row's transform: only where needed)
    if (!is_flat) {
      const long long i2 = row % n2, i1 = (row / n2) % n1, i0 = row / (static_cast<long long>(n1) * n2);
      offset = i0 * x_s0 + i1 * x_s1 + i2 * x_s2;
    }
    const S* x_lane = x + offset + lane * PER_LANE * x_sd;
    if constexpr (IS_CHUNKED) {
      in[r] = load_chunk<PER_LANE>(x_lane);
    } else {
#pragma unroll
      for (int e = 0; e < PER_LANE; ++e) in[r].v[e] = x_lane[e * x_sd];
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float v[PER_LANE];
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) v[e] = Elem<T>::load(in[r].v[e]) * signs[lane * PER_LANE + e];
    fwht_row(v, lane);
    Chunk<S, PER_LANE> out;
#pragma unroll
    for (int e = 0; e < PER_LANE; ++e) out.v[e] = Elem<T>::store(v[e] * scale);
    if (row0 + r < rows) *reinterpret_cast<Chunk<S, PER_LANE>*>(y + (row0 + r) * HEAD_DIM + lane * PER_LANE) = out;
  }
}

}  // namespace fp8
}  // namespace cuflash
"""

_CPP_TYPES = {"fp16": "cuflash::f16", "bf16": "cuflash::bf16", "fp32": "float"}
_CHUNK = {"fp16": 8, "bf16": 8, "fp32": 4}  # elements in 16 bytes: the VEC of aligned rows (1 otherwise)
_INSTANCES = tuple(
    [f"cuflash::fp8::amax_kernel<{t}, {v}>" for n, t in _CPP_TYPES.items() for v in (1, _CHUNK[n])]
    + [f"cuflash::fp8::quantize_kernel<{t}, {flag}, {v}>" for n, t in _CPP_TYPES.items() for flag in ("true", "false")
       for v in (1, _CHUNK[n])]
    + [f"cuflash::fp8::dequantize_kernel<{t}, {v}>" for n, t in _CPP_TYPES.items() for v in (1, _CHUNK[n])]
    + [f"cuflash::fp8::hadamard_kernel<{t}, {d}, {flag}>" for t in _CPP_TYPES.values() for d in HADAMARD_DIMS
       for flag in ("true", "false")])


@lru_cache(maxsize=None)
def _source() -> str:
    """_SOURCE headed by ptx.cuh's hash: CuPy keys its kernel cache on the source text and would miss an edited
    header pulled in through -I."""
    digest = hashlib.sha256((_compile.cuda_dir() / "ptx.cuh").read_bytes()).hexdigest()
    return f"// cuflash.fp8 kernels; ptx.cuh sha256 {digest}\n" + _SOURCE


def _options() -> tuple:
    return ("-std=c++17", f"-I{_compile.cuda_dir()}")


_module = None
_module_lock = threading.Lock()


def _kernel(name: str):
    """The compiled kernel `name` (one of _INSTANCES); CuPy compiles the module for each device it is used on."""
    global _module
    if _module is None:
        cp = _launch.cupy()
        with _module_lock:
            if _module is None:
                _module = cp.RawModule(code=_source(), options=_options(), name_expressions=_INSTANCES)
    return _module.get_function(name)


# ---- argument checks (on metadata only: every error is raised before anything is allocated or launched) ------

def _check_scaling(scaling) -> str:
    if not isinstance(scaling, str) or scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r} is not supported; allowed: 'tensor' (one descale), 'head' (one per "
                         f"(batch, head)) or 'block' (one per block_rows rows of a (batch, head))")
    return scaling


def _check_block_rows(block_rows) -> int:
    if isinstance(block_rows, (bool, np.bool_)) or not isinstance(block_rows, (int, np.integer)):
        raise TypeError(f"block_rows={block_rows!r} must be an int ({BLOCK_ROWS}: what the attention kernels read)")
    if not 1 <= block_rows <= _validate.INT32_MAX:
        raise ValueError(f"block_rows={block_rows} is not allowed; expected a positive int ({BLOCK_ROWS}: what the "
                         f"attention kernels read; other values for experiments)")
    return int(block_rows)


def _check_float_array(x, name: str) -> tuple:
    """(ArrayInfo, dtype name) of a 4-d float16 / bfloat16 / float32 CuPy array."""
    info = _validate.array_info(x, name)
    if info.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}.dtype={info.dtype} is not supported; allowed: {_ALLOWED_DTYPES}")
    _check_rank4(info)
    return info, _FLOAT_DTYPES[info.dtype]


def _check_rank4(info) -> None:
    if len(info.shape) != 4:
        raise ValueError(f"{info.name} has shape {tuple(info.shape)} (rank {len(info.shape)}); expected rank 4: "
                         f"(batch, seqlen, heads, head_dim) for layout 'bshd' or (batch, heads, seqlen, head_dim) "
                         f"for 'bhsd'")
    if any(not float(s).is_integer() for s in info.strides):
        raise ValueError(f"{info.name} has strides {info.strides} (elements) that are not whole elements")
    if any(n > _validate.INT32_MAX for n in info.shape):
        raise ValueError(f"{info.name} has shape {tuple(info.shape)}: every dim must be below 2**31")


def _dims(info, layout: str) -> tuple:
    """(batch, seqlen, heads, head_dim) of a rank-4 array in `layout`."""
    b, n1, n2, d = (int(n) for n in info.shape)
    return (b, n1, n2, d) if layout == "bshd" else (b, n2, n1, d)


def _bshd_strides(strides, layout: str) -> tuple:
    """Element strides of the logical (batch, seqlen, heads, head_dim) dims."""
    sb, s1, s2, sd = (int(s) for s in strides)
    return (sb, s1, s2, sd) if layout == "bshd" else (sb, s2, s1, sd)


def _check_tiles(name: str, batch: int, seqlen: int, heads: int, head_dim: int, tile_rows: int) -> int:
    """Number of tiles per (batch, head); checks the grid and the int32 element index of a tile."""
    num_tiles = -(-seqlen // tile_rows)
    if batch * heads * num_tiles > _MAX_CTAS:
        raise ValueError(f"{name}: batch * heads * ceil(seqlen / {tile_rows}) = {batch * heads * num_tiles} tiles "
                         f"exceeds the grid's {_MAX_CTAS}")
    if min(tile_rows, seqlen) * head_dim > _MAX_TILE_ELEMENTS:
        raise ValueError(f"{name}: block_rows * head_dim = {min(tile_rows, seqlen) * head_dim} elements a tile; at "
                         f"most {_MAX_TILE_ELEMENTS}")
    return num_tiles


def _vec_width(ptr: int, itemsize: int, strides: tuple, head_dim: int, chunk: int) -> int:
    """`chunk` where every run of `chunk` consecutive elements of a row starts on a chunk * itemsize boundary (head_dim
    contiguous, a multiple of chunk; the base and the other strides aligned), so that the kernels move 16 bytes at
    once; else 1 (any strides, one element at a time). strides: of the logical (batch, seqlen, heads, head_dim)."""
    is_aligned = (head_dim % chunk == 0 and strides[3] == 1 and ptr % (chunk * itemsize) == 0
                  and all(st % chunk == 0 for st in strides[:3]))
    return chunk if is_aligned else 1


def descale_shape(scaling: str, batch: int, heads: int, seqlen: int, block_rows: int = BLOCK_ROWS) -> tuple:
    """The descale shape of one scaling: () "tensor", (batch, heads) "head", (batch, heads, ceil(seqlen /
    block_rows)) "block"."""
    _check_scaling(scaling)
    return {"tensor": (), "head": (batch, heads), "block": (batch, heads, -(-seqlen // block_rows))}[scaling]


# ---- quantize / dequantize -------------------------------------------------------------------------------------

def quantize(x, *, scaling: str = "block", layout: str = "bshd", block_rows: int = BLOCK_ROWS):
    """FP8 (e4m3fn) copy of x with its descale: returns (x_q, descale).

    x: a CuPy float16, bfloat16 (ml_dtypes.bfloat16) or float32 array, (batch, seqlen, heads, head_dim) for layout
    "bshd" or (batch, heads, seqlen, head_dim) for "bhsd", any strides. scaling: "tensor", "head" or "block"
    (default; groups of block_rows rows of one (batch, head)). block_rows: 128, the block the attention kernels read;
    other positive values only for experiments (the attention kernels reject their descale).

    x_q: uint8, x's shape, C-contiguous, the e4m3fn bits of x / descale (round to nearest even, saturating at
    +-448). descale: float32, shape () / (batch, heads) / (batch, heads, ceil(seqlen / block_rows)), each group's
    amax / 448 (1 for an all-zero group). See the module docstring for the exact rounding.

    Scaling "block" is one fused kernel (each CTA reduces its block's amax, then converts the block); "tensor" and
    "head" reduce per-tile amax first, then convert.
    """
    _check_scaling(scaling)
    _validate.check_layout(layout)
    block_rows = _check_block_rows(block_rows)
    info, dtype = _check_float_array(x, "x")
    batch, seqlen, heads, head_dim = _dims(info, layout)
    tile_rows = block_rows if scaling == "block" else _TILE_ROWS
    num_tiles = _check_tiles("x", batch, seqlen, heads, head_dim, tile_rows)
    # the group index of tile (b, h, t) in the contiguous descale array
    group_strides = {"tensor": (0, 0, 0), "head": (heads, 1, 0), "block": (heads * num_tiles, num_tiles, 1)}[scaling]

    cp = _launch.cupy()
    with _launch.on_device(cp, info.device):
        x_q = cp.empty(info.shape, dtype=cp.uint8)
        descale = cp.empty(descale_shape(scaling, batch, heads, seqlen, block_rows), dtype=cp.float32)
        if x_q.size == 0:  # every group is empty: amax 0, descale 1 (and no kernel can launch on an empty grid)
            descale.fill(1.0)
            return x_q, descale
        x_strides = [np.int64(s) for s in _bshd_strides(info.strides, layout)]
        vec = _vec_width(info.ptr, info.dtype.itemsize, _bshd_strides(info.strides, layout), head_dim, _CHUNK[dtype])
        q_strides = [np.int64(s) for s in _bshd_strides(x_q.strides, layout)[:3]]  # uint8: bytes are elements
        dims = (np.int32(seqlen), np.int32(heads), np.int32(head_dim), np.int32(tile_rows), np.int32(num_tiles))
        grid = (batch * heads * num_tiles,)
        if scaling == "block":
            group_amax = descale  # unread by the fused kernel
        else:
            tile_amax = cp.empty((batch, heads, num_tiles), dtype=cp.float32)
            _kernel(f"cuflash::fp8::amax_kernel<{_CPP_TYPES[dtype]}, {vec}>")(
                grid, (_THREADS,), (x, *x_strides, *dims, tile_amax))
            group_amax = tile_amax.max(axis=2) if scaling == "head" else tile_amax.max()
        is_tile_group = "true" if scaling == "block" else "false"
        _kernel(f"cuflash::fp8::quantize_kernel<{_CPP_TYPES[dtype]}, {is_tile_group}, {vec}>")(
            grid, (_THREADS,),
            (x, *x_strides, x_q, *q_strides, *dims, group_amax, *(np.int64(g) for g in group_strides), descale))
    return x_q, descale


def _check_out_dtype(dtype) -> tuple:
    """(numpy dtype, name) of dequantize's output dtype."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in _FLOAT_DTYPES:
        raise TypeError(f"dtype={dtype!r} is not supported; allowed: {_ALLOWED_DTYPES}")
    return dt, _FLOAT_DTYPES[dt]


def _check_descale(descale, x_q_info, batch: int, heads: int, seqlen: int, block_rows: int, name: str = "descale"):
    """ArrayInfo and group strides (g_b, g_h, g_t) of a descale array of one of the three shapes."""
    info = _validate.array_info(descale, name)
    if info.dtype != np.float32:
        raise TypeError(f"{name}.dtype={info.dtype} must be float32 (the descale `quantize` returns)")
    shapes = {0: (), 2: (batch, heads), 3: (batch, heads, -(-seqlen // block_rows))}
    if shapes.get(len(info.shape)) != tuple(info.shape):
        raise ValueError(f"{name} has shape {tuple(info.shape)}; for {x_q_info.name} of (batch, seqlen, heads) = "
                         f"({batch}, {seqlen}, {heads}) allowed: () (one scale), {shapes[2]} (one per (batch, head)) "
                         f"or {shapes[3]} (one per {block_rows} rows of a (batch, head), block_rows={block_rows})")
    if any(not float(s).is_integer() for s in info.strides):
        raise ValueError(f"{name} has strides {info.strides} (elements) that are not whole elements")
    _validate.check_same_device(x_q_info, info)
    strides = tuple(int(s) for s in info.strides) + (0,) * (3 - len(info.shape))
    return info, strides


def dequantize(x_q, descale, *, layout: str = "bshd", dtype=np.float32, block_rows: int = BLOCK_ROWS):
    """Floats back from FP8: e4m3_value(x_q) * descale of each element's group, computed in float32 and rounded
    once to dtype (float32, the default; float16; bfloat16). Returns a C-contiguous array of x_q's shape.

    x_q: uint8 e4m3fn bits in `layout` (any strides); descale: float32 of shape () / (batch, heads) / (batch,
    heads, ceil(seqlen / block_rows)), the scaling told by its rank (block_rows as given to `quantize`).
    """
    _validate.check_layout(layout)
    block_rows = _check_block_rows(block_rows)
    out_dtype, out_name = _check_out_dtype(dtype)
    info = _validate.array_info(x_q, "x_q")
    if info.dtype != np.uint8:
        raise TypeError(f"x_q.dtype={info.dtype} must be uint8 (e4m3fn bit patterns, as `quantize` returns)")
    _check_rank4(info)
    batch, seqlen, heads, head_dim = _dims(info, layout)
    d_info, group_strides = _check_descale(descale, info, batch, heads, seqlen, block_rows)
    tile_rows = block_rows if len(d_info.shape) == 3 else _TILE_ROWS
    num_tiles = _check_tiles("x_q", batch, seqlen, heads, head_dim, tile_rows)

    cp = _launch.cupy()
    with _launch.on_device(cp, info.device):
        y = cp.empty(info.shape, dtype=out_dtype)
        if y.size == 0:
            return y
        q_strides = [np.int64(s) for s in _bshd_strides(info.strides, layout)]
        vec = _vec_width(info.ptr, 1, _bshd_strides(info.strides, layout), head_dim, _CHUNK[out_name])
        y_strides = [np.int64(s // out_dtype.itemsize) for s in _bshd_strides(y.strides, layout)[:3]]
        dims = (np.int32(seqlen), np.int32(heads), np.int32(head_dim), np.int32(tile_rows), np.int32(num_tiles))
        _kernel(f"cuflash::fp8::dequantize_kernel<{_CPP_TYPES[out_name]}, {vec}>")(
            (batch * heads * num_tiles,), (_THREADS,),
            (x_q, *q_strides, y, *y_strides, *dims, descale, *(np.int64(g) for g in group_strides)))
    return y


# ---- randomized Hadamard transform -----------------------------------------------------------------------------

def _check_seed(seed) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed={seed!r} must be an int (it seeds numpy.random.default_rng)")
    if seed < 0:
        raise ValueError(f"seed={seed} is not allowed; expected an int >= 0")
    return int(seed)


def _check_hadamard_dim(head_dim: int, name: str) -> None:
    if head_dim not in HADAMARD_DIMS:
        raise ValueError(f"head_dim={head_dim} (last dim of {name}) is not supported by the Hadamard transform; "
                         f"allowed: a power of two, {', '.join(map(str, HADAMARD_DIMS))}")


@lru_cache(maxsize=64)
def _signs_cached(seed: int, head_dim: int) -> np.ndarray:
    s = 1.0 - 2.0 * np.random.default_rng(seed).integers(0, 2, size=head_dim)
    s = s.astype(np.float32)
    s.flags.writeable = False
    return s


@lru_cache(maxsize=64)
def _signs_on_device(device: int, seed: int, head_dim: int):
    """`hadamard_signs` uploaded to a device once (call under that device); read-only from then on."""
    return _launch.cupy().asarray(_signs_cached(seed, head_dim))


def hadamard_signs(seed, head_dim: int) -> np.ndarray:
    """s of R = diag(s) H_D / sqrt(D): float32 +-1, `1 - 2 * numpy.random.default_rng(seed).integers(0, 2,
    size=head_dim)` (a NumPy array, read-only)."""
    return _signs_cached(_check_seed(seed), int(head_dim))


def _check_hadamard_input(x, name: str, layout: str) -> tuple:
    info, dtype = _check_float_array(x, name)
    head_dim = _dims(info, layout)[3]
    _check_hadamard_dim(head_dim, name)
    rows = math.prod(int(n) for n in info.shape[:3])
    rows_per_cta = _THREADS // 32 * _HADAMARD_ROWS_PER_WARP
    if -(-rows // rows_per_cta) > _MAX_CTAS:
        raise ValueError(f"{name} has {rows} rows; at most {_MAX_CTAS * rows_per_cta}")
    return info, dtype


def _hadamard_launch(x, info, dtype: str, seed: int):
    cp = _launch.cupy()
    n0, n1, n2, head_dim = (int(n) for n in info.shape)
    with _launch.on_device(cp, info.device):
        y = cp.empty(info.shape, dtype=info.dtype)
        rows = n0 * n1 * n2
        if rows == 0:
            return y
        signs = _signs_on_device(info.device, seed, head_dim)
        rows_per_cta = _THREADS // 32 * _HADAMARD_ROWS_PER_WARP
        strides = tuple(int(s) for s in info.strides)
        is_flat = strides[1] == n2 * strides[2] and strides[0] == n1 * strides[1]  # row r at r * strides[2]
        per_lane = head_dim // 32  # each lane's chunk of consecutive elements
        is_chunked = _vec_width(info.ptr, info.dtype.itemsize, strides, head_dim, per_lane) == per_lane
        _kernel(f"cuflash::fp8::hadamard_kernel<{_CPP_TYPES[dtype]}, {head_dim}, {str(is_chunked).lower()}>")(
            (-(-rows // rows_per_cta),), (_THREADS,),
            (x, *(np.int64(s) for s in strides), y, np.int32(n1), np.int32(n2), np.int64(rows), np.int32(is_flat),
             signs, np.float32(1.0 / math.sqrt(head_dim))))
    return y


def hadamard(x, seed, *, layout: str = "bshd"):
    """y = x R along head_dim, R = diag(s) H_D / sqrt(D): H_D the Sylvester Hadamard matrix (H[i, j] =
    (-1)^popcount(i & j)), s = `hadamard_signs(seed, D)`. R is orthogonal, so hadamard(q, s) hadamard(k, s)^T = q k^T
    in exact arithmetic, while an outlier channel is spread evenly over all D.

    x: a CuPy float16, bfloat16 or float32 array in `layout` (head_dim last in both), any strides, head_dim one of
    32, 64, 128, 256. Returns a C-contiguous array of x's shape and dtype: a fast Walsh-Hadamard transform per row
    (D log2 D additions) in float32, rounded once to the dtype.
    """
    seed = _check_seed(seed)
    _validate.check_layout(layout)
    info, dtype = _check_hadamard_input(x, "x", layout)
    return _hadamard_launch(x, info, dtype, seed)


def incoherent(q, k, seed, *, layout: str = "bshd"):
    """(hadamard(q, seed), hadamard(k, seed)): q and k rotated by one random orthogonal R, so that softmax(q k^T)
    is unchanged while outlier channels are spread out before `quantize`. q and k must share head_dim."""
    seed = _check_seed(seed)
    _validate.check_layout(layout)
    q_info, q_dtype = _check_hadamard_input(q, "q", layout)
    k_info, k_dtype = _check_hadamard_input(k, "k", layout)
    if q_info.shape[-1] != k_info.shape[-1]:
        raise ValueError(f"k has head_dim={k_info.shape[-1]} but q has head_dim={q_info.shape[-1]}; q k^T needs one "
                         f"head_dim")
    _validate.check_same_device(q_info, k_info)
    return _hadamard_launch(q, q_info, q_dtype, seed), _hadamard_launch(k, k_info, k_dtype, seed)


# ---- NumPy: the same bit algorithms and references of quantize / dequantize (the tests' yardsticks) -------------

def _e4m3_bits_numpy(v) -> np.ndarray:
    """uint8 e4m3fn bits of float32(v), round to nearest even, saturating at +-448 (0x7E / 0xFE; inf too), NaN
    0x7F | sign: the kernels' e4m3_bits, line for line."""
    v = np.array(v, dtype=np.float32)
    u = v.reshape(-1).view(np.uint32)  # 1-d even for a scalar: NumPy wraps uint32 arrays silently, 0-d ones warn
    sign = (u >> np.uint32(24)) & np.uint32(0x80)
    a = u & np.uint32(0x7FFFFFFF)
    # |v| >= 2^-6: rebias the exponent (127 -> 7), round the 20 dropped mantissa bits to nearest even, saturate
    rebiased = a - np.uint32(120 << 23)  # wraps for small a, which take the other branch
    normal = np.minimum((rebiased + np.uint32(0x7FFFF) + ((rebiased >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20),
                        np.uint32(E4M3_MAX_BITS))
    # |v| < 2^-6: round(mant * 2^(e - 141)), mant = 1.m * 2^23, e float32's biased exponent
    e = (a >> np.uint32(23)).astype(np.int64)
    mant = ((a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)).astype(np.int64)
    shift = np.clip(141 - e, 21, 25)  # the clip's low end only matters where the normal branch is taken
    q = mant >> shift
    rem = mant & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1)))
    r = np.where(a > np.uint32(0x7F800000), np.uint32(0x7F),
                 np.where(a >= np.uint32(0x3C800000), normal, sub.astype(np.uint32)))
    return (sign | r).astype(np.uint8).reshape(v.shape)


def _e4m3_values_numpy(bits) -> np.ndarray:
    """float32 values of e4m3fn bits (exact): the kernels' e4m3_value."""
    b = np.asarray(bits, dtype=np.uint8).astype(np.uint32)
    e, m = (b >> np.uint32(3)) & np.uint32(0xF), b & np.uint32(7)
    normal = (((e + np.uint32(120)) << np.uint32(23)) | (m << np.uint32(20))).view(np.float32)
    v = np.where(e == 0, m.astype(np.float32) * np.float32(1.0 / 512.0), normal)
    v = np.where((e == 15) & (m == 7), np.float32(np.nan), v).astype(np.float32)
    return np.where(b & np.uint32(0x80), -v, v)


def _descale_numpy(amax) -> np.ndarray:
    """float32 descale of float32 group amaxes: the kernels' descale_of_amax."""
    amax = np.asarray(amax, dtype=np.float32)
    d = np.maximum(amax / np.float32(E4M3_MAX), np.float32(DESCALE_MIN))
    return np.where(amax > 0, d, np.float32(1.0)).astype(np.float32)


def _float32_bshd(x, layout: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"x has shape {x.shape}; expected rank 4")
    _validate.check_layout(layout)
    x = x.astype(np.float32)
    return x if layout == "bshd" else x.transpose(0, 2, 1, 3)


def _descale_rows(descale, batch: int, seqlen: int, heads: int, block_rows: int) -> np.ndarray:
    """float32 (batch, seqlen, heads, 1): the descale of each row of a (batch, seqlen, heads, head_dim) tensor."""
    d = np.asarray(descale, dtype=np.float32)
    if d.ndim == 0:
        rows = np.broadcast_to(d, (batch, seqlen, heads))
    elif d.ndim == 2:
        rows = np.broadcast_to(d[:, None, :], (batch, seqlen, heads))
    else:
        rows = d[:, :, np.arange(seqlen) // block_rows].transpose(0, 2, 1)
    return rows[..., None]


def quantize_reference(x, *, scaling: str = "block", layout: str = "bshd", block_rows: int = BLOCK_ROWS):
    """`quantize` on a NumPy float16 / bfloat16 / float32 array, in NumPy: (x_q uint8, descale float32 NumPy
    arrays), bit for bit what the kernels return."""
    _check_scaling(scaling)
    block_rows = _check_block_rows(block_rows)
    xf = _float32_bshd(x, layout)
    batch, seqlen, heads, head_dim = xf.shape
    a = np.abs(xf)
    if scaling == "tensor":
        amax = a.max() if a.size else np.float32(0)
    elif scaling == "head":
        amax = a.max(axis=(1, 3), initial=np.float32(0))
    else:  # zero rows pad the last block (they never raise an amax)
        num_tiles = -(-seqlen // block_rows)
        padded = np.zeros((batch, num_tiles * block_rows, heads, head_dim), dtype=np.float32)
        padded[:, :seqlen] = a
        amax = padded.reshape(batch, num_tiles, block_rows, heads, head_dim).max(axis=(2, 4), initial=np.float32(0))
        amax = amax.transpose(0, 2, 1)
    descale = _descale_numpy(amax)
    x_q = _e4m3_bits_numpy(xf / _descale_rows(descale, batch, seqlen, heads, block_rows))
    if layout == "bhsd":
        x_q = x_q.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(x_q), descale


def dequantize_reference(x_q, descale, *, layout: str = "bshd", block_rows: int = BLOCK_ROWS) -> np.ndarray:
    """float32 e4m3_value(x_q) * descale on NumPy arrays (what `dequantize` computes before rounding to its
    dtype)."""
    _validate.check_layout(layout)
    v = _e4m3_values_numpy(x_q)
    if v.ndim != 4:
        raise ValueError(f"x_q has shape {v.shape}; expected rank 4")
    v = v if layout == "bshd" else v.transpose(0, 2, 1, 3)
    y = (v * _descale_rows(descale, *v.shape[:3], block_rows)).astype(np.float32)
    return np.ascontiguousarray(y if layout == "bshd" else y.transpose(0, 2, 1, 3))
