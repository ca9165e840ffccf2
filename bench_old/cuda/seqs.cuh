// seqs.cuh: which rows of the inputs belong to which sequence and head.
//
//   dense   q [batch, seqlen_q, heads, d]: sequence b starts at q + b * q_batch_stride
//   varlen  q [total_q, heads, d] (batch stride 0): sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1
//   GQA     query head h reads K/V head h / kv_group (kv_group = H_q / H_kv; 1 for plain multi-head)
//   kv cache (forward only): sequence b uses the first seqused_k[b] + seqlen_k_new keys of its cache rows
//     (the keys cached before this call, then the ones it appended)
// The fp32 row vectors of the backward (lse_log2, delta, dQ accumulator) give every sequence a region
// that starts at a multiple of PAD_ROWS and holds its last query block whole: dense, (b * heads + h) *
// seqlen_q_pad; varlen, h * seqlen_q_pad + padded_start(b) with padded_start(b) = floor((cu_q[b] +
// PAD_ROWS * b) / PAD_ROWS) * PAD_ROWS, which grows by at least len_q(b) + 1 from b to b + 1, i.e. by a
// whole number of PAD_ROWS that is >= round_up(len_q(b), PAD_ROWS).
#pragma once
#include "ptx.cuh"

namespace cuflash {

constexpr int PAD_ROWS = 128;  // cuflash/config.py SEQLEN_Q_PAD: >= every BLOCK_M of the backward

// Sequence geometry shared by the forward and backward params (mirrored in cuflash/_launch.py).
struct SeqParams {
  const int* cu_seqlens_q;  // [batch + 1] first packed row of each sequence (varlen), or nullptr: dense
  const int* cu_seqlens_k;  // [batch + 1] (varlen), or nullptr
  const int* seqused_k;     // [batch] keys in use per sequence (kv cache), or nullptr: seqlen_k each
  int seqlen_q, seqlen_k;   // dense lengths (varlen: the maxima, which size the grid)
  int kv_group;             // query heads per K/V head
  int seqlen_k_new;         // kv cache: keys appended to every sequence this call (added to its cached keys)
};

// One sequence: its lengths and, for varlen, its first rows in the packed arrays (0 when dense).
struct Seq {
  int len_q, len_k;
  int q_row0, k_row0;
};

__device__ __forceinline__ Seq sequence(const SeqParams& sp, int batch) {
  Seq s;
  if (sp.cu_seqlens_q != nullptr) {
    s.q_row0 = sp.cu_seqlens_q[batch];
    s.len_q = sp.cu_seqlens_q[batch + 1] - s.q_row0;
  } else {
    s.q_row0 = 0;
    s.len_q = sp.seqlen_q;
  }
  if (sp.cu_seqlens_k != nullptr) {
    s.k_row0 = sp.cu_seqlens_k[batch];
    s.len_k = sp.cu_seqlens_k[batch + 1] - s.k_row0;
  } else {
    s.k_row0 = 0;
    s.len_k = (sp.seqused_k != nullptr ? sp.seqused_k[batch] : sp.seqlen_k) + sp.seqlen_k_new;
  }
  return s;
}

// First fp32 row (lse_log2, delta, dQ accumulator) of (batch, head): see the file comment.
__device__ __forceinline__ long long padded_row0(const SeqParams& sp, int batch, int head, int heads, int seqlen_q_pad) {
  if (sp.cu_seqlens_q != nullptr) {
    const long long start = (static_cast<long long>(sp.cu_seqlens_q[batch]) + PAD_ROWS * batch) / PAD_ROWS * PAD_ROWS;
    return static_cast<long long>(head) * seqlen_q_pad + start;
  }
  return (static_cast<long long>(batch) * heads + head) * seqlen_q_pad;
}

}  // namespace cuflash
