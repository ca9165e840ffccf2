// kvcache.cuh: the append launch of attention_with_kvcache, before the decode attention (fwd_kernel with
// IS_DECODE) on the same stream: new keys and values written into the KV cache (dense or paged), with the
// rotary embedding applied to the new keys and to a copy of q when the call gives rotary_cos / rotary_sin.
//
// New key s of sequence b goes to cache row pos = cache_seqlens[b] + s: row pos of dense cache entry
// cache_batch_idx[b] (b without an index array) [batch_cache, capacity, kv_heads, head_dim], or row
// pos % page_size of page block_table[b, pos / page_size] of a paged cache [num_pages, page_size, kv_heads,
// head_dim]. Without rotary the copy moves bits (16-byte chunks).
//
// Rotary embedding (RoPE) of a row at position pos, angle index f in [0, rotary_dim / 2):
//   interleaved (GPT-J):     dims (2f, 2f + 1)
//   not interleaved (NeoX):  dims (f, f + rotary_dim / 2)
// each pair (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos), cos = rotary_cos[pos, f], computed in fp32 and
// rounded once to the element type; dims >= rotary_dim are copied. New key s sits at position
// cache_seqlens[b] + s (its cache row); query i at cache_seqlens[b] + i * q_pos_step (q_pos_step 1 with causal
// or a window, else 0: every query of the call at cache_seqlens[b]).
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Arguments, passed by value. Mirrored by cuflash/_launch.py:AppendParams (ctypes).
struct AppendParams {
  const u16* k_new;          // [batch, s_new, kv_heads, head_dim] at the strides below (elements)
  const u16* v_new;
  u16* k_cache;              // dense [batch_cache, capacity, ...] or paged [num_pages, page_size, ...]
  u16* v_cache;
  const int* cache_seqlens;  // [batch] keys already cached per sequence, or nullptr: cache_seqlen for all
  const int* block_table;    // [batch, block_table_stride] pages of a paged cache, or nullptr: dense
  long long kn_batch_stride, kn_row_stride, kn_head_stride;
  long long vn_batch_stride, vn_row_stride, vn_head_stride;
  long long kc_batch_stride, kc_row_stride, kc_head_stride;  // paged: batch stride = page stride
  long long vc_batch_stride, vc_row_stride, vc_head_stride;
  int cache_seqlen;
  int s_new;
  int kv_heads;
  int head_dim;              // a multiple of 8: whole 16-byte chunks
  int page_size;
  int block_table_stride;
  const int* cache_batch_idx;  // dense: [batch] cache entry of each batch entry, or nullptr: the entry's own
  // rotary embedding (rotary_dim > 0): the tables, and q with its rotated copy
  const void* rotary_cos;    // [seqlen_ro, rotary_dim / 2] at rotary_row_stride, fp32 / fp16 / bf16 by rotary_kind
  const void* rotary_sin;
  const u16* q;              // [batch, seqlen_q, heads_q, head_dim] at the strides below
  u16* q_rot;                // [batch, seqlen_q, heads_q, head_dim], contiguous: q rotated
  long long q_batch_stride, q_row_stride, q_head_stride;
  long long rotary_row_stride;
  int rotary_dim;            // 0: no rotary embedding (and no q work)
  int rotary_interleaved;
  int rotary_kind;           // 0: float32, 1: float16, 2: bfloat16
  int seqlen_q;
  int heads_q;
  int q_pos_step;
};
static_assert(sizeof(AppendParams) == 264, "AppendParams is mirrored field by field in cuflash/_launch.py");

constexpr int APPEND_THREADS = 128;

__device__ __forceinline__ float rotary_at(const void* table, int kind, long long index) {
  if (kind == 0) return __ldg(static_cast<const float*>(table) + index);
  const u16 h = __ldg(static_cast<const unsigned short*>(table) + index);
  return kind == 1 ? Cvt<f16>::to_float(h) : Cvt<bf16>::to_float(h);
}

// One element pair (x1, x2) rotated by angle (c, s), rounded to T and packed.
template <class T>
__device__ __forceinline__ u32 rotate_pair(float x1, float x2, float c, float s) {
  return Cvt<T>::pack(x1 * c - x2 * s, x1 * s + x2 * c);
}

// Word w (elements 2w, 2w + 1) of the chunk at dims [col, col + 8) of a row, rotated at table row `table_row`:
// mine = the chunk's word, other = the partner chunk's word (not interleaved; unused when interleaved).
template <class T>
__device__ __forceinline__ u32 rotated_word(const AppendParams& p, u32 mine, u32 other, int col, int w,
                                            long long table_row) {
  if (p.rotary_interleaved) {  // the word is one pair: angle f = col / 2 + w
    const long long f = table_row + col / 2 + w;
    return rotate_pair<T>(Cvt<T>::unpack(mine, 0), Cvt<T>::unpack(mine, 1), rotary_at(p.rotary_cos, p.rotary_kind, f),
                          rotary_at(p.rotary_sin, p.rotary_kind, f));
  }
  const int half = p.rotary_dim / 2;  // a multiple of 8: the partner is another whole chunk of the row
  const bool is_first = col < half;   // this chunk holds the pairs' x1 (the partner x2), or their x2
  const long long f = table_row + (is_first ? col : col - half) + 2 * w;
  // element e of the word: x1 cos - x2 sin in the first half, x1 sin + x2 cos in the second (x = this chunk's)
  auto rotated = [&](int e) {
    const float c = rotary_at(p.rotary_cos, p.rotary_kind, f + e), s = rotary_at(p.rotary_sin, p.rotary_kind, f + e);
    const float x = Cvt<T>::unpack(mine, e), y = Cvt<T>::unpack(other, e);
    return is_first ? x * c - y * s : y * s + x * c;
  };
  return Cvt<T>::pack(rotated(0), rotated(1));
}

// The 16-byte chunk of dims [col, col + 8) of one row (row: its element 0), rotated at position pos.
template <class T>
__device__ __forceinline__ uint4 rotated_chunk(const AppendParams& p, const u16* row, int col, int pos) {
  const uint4 x = *reinterpret_cast<const uint4*>(row + col);
  if (col >= p.rotary_dim) return x;
  const int half = p.rotary_dim / 2;
  const uint4 y = p.rotary_interleaved ? x : *reinterpret_cast<const uint4*>(row + (col < half ? col + half : col - half));
  const long long table_row = static_cast<long long>(pos) * p.rotary_row_stride;
  return make_uint4(rotated_word<T>(p, x.x, y.x, col, 0, table_row), rotated_word<T>(p, x.y, y.y, col, 1, table_row),
                    rotated_word<T>(p, x.z, y.z, col, 2, table_row), rotated_word<T>(p, x.w, y.w, col, 3, table_row));
}

// One thread per 16-byte chunk: first the chunks of the new keys and values (s_new * kv_heads rows), then, with
// rotary, those of q (seqlen_q * heads_q rows); grid (ceil(chunks / APPEND_THREADS), batch).
template <class T>
__global__ void __launch_bounds__(APPEND_THREADS) kvcache_append_kernel(const AppendParams p) {
  const int batch = blockIdx.y;
  const int chunks_per_row = p.head_dim / 8;
  const long long idx = static_cast<long long>(blockIdx.x) * APPEND_THREADS + threadIdx.x;
  const long long kv_chunks = static_cast<long long>(p.s_new) * p.kv_heads * chunks_per_row;
  const int col = static_cast<int>(idx % chunks_per_row) * 8;
  const int cached = p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.cache_seqlen;
  if (idx >= kv_chunks) {  // q, rotated into q_rot
    const long long qi = idx - kv_chunks;
    if (p.rotary_dim == 0 || qi >= static_cast<long long>(p.seqlen_q) * p.heads_q * chunks_per_row) return;
    const int head = static_cast<int>(qi / chunks_per_row) % p.heads_q;
    const int i = static_cast<int>(qi / (static_cast<long long>(chunks_per_row) * p.heads_q));
    const u16* row = p.q + batch * p.q_batch_stride + i * p.q_row_stride + head * p.q_head_stride;
    *reinterpret_cast<uint4*>(p.q_rot + ((static_cast<long long>(batch) * p.seqlen_q + i) * p.heads_q + head) * p.head_dim +
                              col) = rotated_chunk<T>(p, row, col, cached + i * p.q_pos_step);
    return;
  }
  const int head = static_cast<int>(idx / chunks_per_row) % p.kv_heads;
  const int s = static_cast<int>(idx / (static_cast<long long>(chunks_per_row) * p.kv_heads));
  const int pos = cached + s;
  long long slot_k, slot_v;  // element offset of the (sequence, position) row in each cache
  if (p.block_table != nullptr) {
    const long long page = p.block_table[static_cast<long long>(batch) * p.block_table_stride + pos / p.page_size];
    slot_k = page * p.kc_batch_stride + static_cast<long long>(pos % p.page_size) * p.kc_row_stride;
    slot_v = page * p.vc_batch_stride + static_cast<long long>(pos % p.page_size) * p.vc_row_stride;
  } else {
    const long long entry = p.cache_batch_idx != nullptr ? p.cache_batch_idx[batch] : batch;
    slot_k = entry * p.kc_batch_stride + static_cast<long long>(pos) * p.kc_row_stride;
    slot_v = entry * p.vc_batch_stride + static_cast<long long>(pos) * p.vc_row_stride;
  }
  const u16* k_row = p.k_new + batch * p.kn_batch_stride + s * p.kn_row_stride + head * p.kn_head_stride;
  const uint4 k8 = p.rotary_dim > 0 ? rotated_chunk<T>(p, k_row, col, pos) : *reinterpret_cast<const uint4*>(k_row + col);
  const uint4 v8 = *reinterpret_cast<const uint4*>(p.v_new + batch * p.vn_batch_stride + s * p.vn_row_stride +
                                                   head * p.vn_head_stride + col);
  *reinterpret_cast<uint4*>(p.k_cache + slot_k + head * p.kc_head_stride + col) = k8;
  *reinterpret_cast<uint4*>(p.v_cache + slot_v + head * p.vc_head_stride + col) = v8;
}

}  // namespace cuflash
