// kvcache.cuh: new keys and values appended into a KV cache (attention_with_kvcache), dense or paged, in
// one launch before the decode attention (fwd_kernel with IS_DECODE), on the same stream.
//
// New key s of sequence b goes to logical position cache_seqlens[b] + s: row pos of the dense cache
// [batch, capacity, kv_heads, head_dim], or row pos % page_size of page block_table[b, pos / page_size]
// of a paged cache [num_pages, page_size, kv_heads, head_dim]. The copy moves bits (16-byte chunks), so
// one kernel serves fp16 and bf16.
#pragma once
#include "ptx.cuh"

namespace cuflash {

// Arguments, passed by value. Mirrored by cuflash/_launch.py:AppendParams (ctypes).
struct AppendParams {
  const u16* k_new;          // [batch, s_new, kv_heads, head_dim] at the strides below (elements)
  const u16* v_new;
  u16* k_cache;              // dense [batch, capacity, ...] or paged [num_pages, page_size, ...]
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
};
static_assert(sizeof(AppendParams) == 168, "AppendParams is mirrored field by field in cuflash/_launch.py");

constexpr int APPEND_THREADS = 128;

// One thread per 16-byte chunk of one new key and its value: grid (ceil(s_new * kv_heads * head_dim / 8 /
// APPEND_THREADS), batch).
__global__ void __launch_bounds__(APPEND_THREADS) kvcache_append_kernel(const AppendParams p) {
  const int batch = blockIdx.y;
  const int chunks_per_row = p.head_dim / 8;
  const long long idx = static_cast<long long>(blockIdx.x) * APPEND_THREADS + threadIdx.x;
  if (idx >= static_cast<long long>(p.s_new) * p.kv_heads * chunks_per_row) return;
  const int col = static_cast<int>(idx % chunks_per_row) * 8;
  const int head = static_cast<int>(idx / chunks_per_row) % p.kv_heads;
  const int s = static_cast<int>(idx / (static_cast<long long>(chunks_per_row) * p.kv_heads));
  const int pos = (p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.cache_seqlen) + s;
  long long slot_k, slot_v;  // element offset of the (sequence, position) row in each cache
  if (p.block_table != nullptr) {
    const long long page = p.block_table[static_cast<long long>(batch) * p.block_table_stride + pos / p.page_size];
    slot_k = page * p.kc_batch_stride + static_cast<long long>(pos % p.page_size) * p.kc_row_stride;
    slot_v = page * p.vc_batch_stride + static_cast<long long>(pos % p.page_size) * p.vc_row_stride;
  } else {
    slot_k = batch * p.kc_batch_stride + static_cast<long long>(pos) * p.kc_row_stride;
    slot_v = batch * p.vc_batch_stride + static_cast<long long>(pos) * p.vc_row_stride;
  }
  const uint4 k8 = *reinterpret_cast<const uint4*>(p.k_new + batch * p.kn_batch_stride + s * p.kn_row_stride +
                                                   head * p.kn_head_stride + col);
  const uint4 v8 = *reinterpret_cast<const uint4*>(p.v_new + batch * p.vn_batch_stride + s * p.vn_row_stride +
                                                   head * p.vn_head_stride + col);
  *reinterpret_cast<uint4*>(p.k_cache + slot_k + head * p.kc_head_stride + col) = k8;
  *reinterpret_cast<uint4*>(p.v_cache + slot_v + head * p.vc_head_stride + col) = v8;
}

}  // namespace cuflash
