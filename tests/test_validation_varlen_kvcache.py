"""Validation of the variable-length and KV-cache calls, on array metadata (ArrayInfo) and host copies
of the index arrays, so CI checks every message without a GPU: check_varlen, check_cu_seqlens_values,
check_kvcache, check_kvcache_values. Each bad case names the exception type and message fragments (the
argument, its value, what is allowed); the accepted cases check what the launcher reads back."""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from cuflash import _validate as V
from cuflash._validate import ArrayInfo, Dims, KvcacheDims, VarlenDims

FP16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
I32 = np.dtype(np.int32)
_addresses = itertools.count(1 << 32, 1 << 28)  # distinct, 16-byte aligned, far apart: no accidental overlap


def info(name, shape, dtype=FP16, strides=None, ptr=None, device=0) -> ArrayInfo:
    """Metadata of a hypothetical CuPy array; C-contiguous strides (elements) and a fresh address unless given."""
    if strides is None:
        strides, step = [], 1
        for n in reversed(shape):
            strides.insert(0, step)
            step *= max(n, 1)
    return ArrayInfo(name, tuple(shape), np.dtype(dtype), tuple(strides), next(_addresses) if ptr is None else ptr,
                     device)


# --- varlen: metadata ---------------------------------------------------------------------------------------

def varlen(total_q=40, total_k=50, hq=4, hkv=2, d=64, batch=3, max_q=20, max_k=30, **kw):
    """check_varlen on a consistent packed problem; kw replaces q, k, v, cu_q, cu_k by an ArrayInfo."""
    a = {"q": info("q", (total_q, hq, d)), "k": info("k", (total_k, hkv, d)), "v": info("v", (total_k, hkv, d)),
         "cu_q": info("cu_seqlens_q", (batch + 1,), I32), "cu_k": info("cu_seqlens_k", (batch + 1,), I32)}
    a.update(kw)
    return V.check_varlen(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], max_q, max_k)


VARLEN_BAD = [
    ("q-complex64", lambda: varlen(q=info("q", (40, 4, 64), np.complex64)), TypeError,
     ["q.dtype=complex64", "bfloat16", "float32"]),
    ("q-float32-k-fp16", lambda: varlen(q=info("q", (40, 4, 64), np.float32)), TypeError,
     ["k.dtype=float16 differs from q.dtype=float32"]),
    ("v-bf16", lambda: varlen(v=info("v", (50, 2, 64), BF16)), TypeError, ["v.dtype=bfloat16", "q.dtype=float16"]),
    ("q-rank4", lambda: varlen(q=info("q", (2, 20, 4, 64))), ValueError,
     ["q has shape (2, 20, 4, 64) (rank 4)", "packed rank-3", "(total_q, heads_q, head_dim)"]),
    ("k-rank2", lambda: varlen(k=info("k", (50, 64))), ValueError, ["k has shape (50, 64) (rank 2)", "total_k"]),
    ("q-last-dim-strided", lambda: varlen(q=info("q", (40, 4, 64), strides=(512, 128, 2))), ValueError,
     ["q has strides (512, 128, 2)", "contiguous (stride 1)"]),
    ("head-dim-12", lambda: varlen(q=info("q", (40, 4, 12)), k=info("k", (50, 2, 12)), v=info("v", (50, 2, 12))),
     ValueError, ["head_dim=12", "multiple of 8"]),
    ("k-head-dim-differs", lambda: varlen(k=info("k", (50, 2, 128))), ValueError,
     ["k has shape (50, 2, 128)", "q has (40, 4, 64)", "head_dim must match"]),
    ("v-rows-differ", lambda: varlen(v=info("v", (49, 2, 64))), ValueError,
     ["v has shape (49, 2, 64)", "k has (50, 2, 64)", "same shape"]),
    ("v-heads-differ", lambda: varlen(v=info("v", (50, 1, 64))), ValueError, ["v has shape (50, 1, 64)", "same shape"]),
    ("heads-q-not-multiple", lambda: varlen(hkv=3), ValueError,
     ["k has shape (50, 3, 64)", "heads_kv=3", "heads_q=4", "multiple of heads_kv"]),
    ("cu-q-int64", lambda: varlen(cu_q=info("cu_seqlens_q", (4,), np.int64)), TypeError,
     ["cu_seqlens_q.dtype=int64 must be int32", "cupy.asarray(cu_seqlens_q, dtype=cupy.int32)"]),
    ("cu-k-float", lambda: varlen(cu_k=info("cu_seqlens_k", (4,), np.float32)), TypeError,
     ["cu_seqlens_k.dtype=float32 must be int32"]),
    ("cu-q-rank2", lambda: varlen(cu_q=info("cu_seqlens_q", (2, 2), I32)), ValueError,
     ["cu_seqlens_q has shape (2, 2)", "1-D of length batch + 1"]),
    ("cu-k-one-entry", lambda: varlen(cu_k=info("cu_seqlens_k", (1,), I32)), ValueError,
     ["cu_seqlens_k has shape (1,)", "batch + 1 >= 2 entries"]),
    ("cu-q-strided", lambda: varlen(cu_q=info("cu_seqlens_q", (4,), I32, strides=(2,))), ValueError,
     ["cu_seqlens_q has strides (2,)", "contiguous", "cupy.ascontiguousarray(cu_seqlens_q)"]),
    ("cu-lengths-differ", lambda: varlen(cu_k=info("cu_seqlens_k", (5,), I32)), ValueError,
     ["cu_seqlens_k has shape (5,) but cu_seqlens_q has (4,)", "batch + 1"]),
    ("max-seqlen-q-bool", lambda: varlen(max_q=True), TypeError, ["max_seqlen_q=True must be an int"]),
    ("max-seqlen-k-float", lambda: varlen(max_k=30.0), TypeError, ["max_seqlen_k=30.0 must be an int"]),
    ("max-seqlen-k-none", lambda: varlen(max_k=None), TypeError, ["max_seqlen_k=None must be an int"]),
    ("max-seqlen-q-negative", lambda: varlen(max_q=-1), ValueError,
     ["max_seqlen_q=-1 is out of range", "0 <= max_seqlen_q <= 2147483647"]),
    ("max-seqlen-k-too-big", lambda: varlen(max_k=2**31), ValueError, ["max_seqlen_k=2147483648 is out of range"]),
    ("max-seqlen-q-too-small-for-total", lambda: varlen(max_q=10), ValueError,
     ["max_seqlen_q=10 is too small", "total_q=40 rows in batch=3 sequences", "at least 14 rows"]),
    ("max-seqlen-k-zero-with-keys", lambda: varlen(max_k=0), ValueError, ["max_seqlen_k=0 is too small", "total_k=50"]),
    ("batch-65536", lambda: varlen(batch=65536, total_q=0, total_k=0), ValueError, ["batch=65536", "65535"]),
    ("heads-65536", lambda: varlen(hq=65536, hkv=1, d=8, total_q=1, total_k=1), ValueError, ["heads_q=65536", "65535"]),
    ("k-device-1", lambda: varlen(k=info("k", (50, 2, 64), device=1)), ValueError,
     ["k is on device 1", "q is on device 0"]),
    ("cu-k-device-1", lambda: varlen(cu_k=info("cu_seqlens_k", (4,), I32, device=1)), ValueError,
     ["cu_seqlens_k is on device 1"]),
]


@pytest.mark.parametrize("call,exc,parts", [c[1:] for c in VARLEN_BAD], ids=[c[0] for c in VARLEN_BAD])
def test_bad_varlen_metadata_is_rejected_with_a_clear_message(call, exc, parts):
    with pytest.raises(exc) as e:
        call()
    missing = [p for p in parts if p not in str(e.value)]
    assert not missing, f"message lacks {missing}: {str(e.value)!r}"


def test_varlen_metadata_gives_what_the_launcher_needs():
    """Any token/head strides (here a head-major q and k and v padded views), GQA 8 over 2 heads."""
    q = info("q", (100, 8, 128), BF16, strides=(128, 100 * 128, 1))  # (H, total, D) storage, transposed
    k = info("k", (70, 2, 128), BF16, strides=(3 * 136, 136, 1))  # a view into (70, 3, 136)
    v = info("v", (70, 2, 128), BF16)
    cu_q, cu_k = info("cu_seqlens_q", (5,), I32), info("cu_seqlens_k", (5,), I32)
    dims = V.check_varlen(q, k, v, cu_q, cu_k, 40, np.int64(33))
    assert isinstance(dims, VarlenDims)
    assert dims == VarlenDims("bf16", 4, 100, 70, 8, 2, 128, 40, 33, (128, 12800), (408, 136), (256, 128), 0)


def test_varlen_empty_batches_and_zero_length_sequences_pass():
    dims = varlen(total_q=0, total_k=0, max_q=0, max_k=0)
    assert (dims.batch, dims.total_q, dims.total_k, dims.max_seqlen_q) == (3, 0, 0, 0)
    dims = V.check_varlen(info("q", (0, 4, 64), strides=(0, 0, 0)), info("k", (5, 4, 64)), info("v", (5, 4, 64)),
                          info("cu_seqlens_q", (2,), I32), info("cu_seqlens_k", (2,), I32), 0, 5)
    assert (dims.batch, dims.total_q, dims.total_k) == (1, 0, 5)


def test_needs_aligned_copy_rows_for_packed_arrays():
    assert not V.needs_aligned_copy_rows(info("q", (10, 4, 64), ptr=1 << 20))
    assert not V.needs_aligned_copy_rows(info("q", (10, 4, 64), strides=(4 * 72, 72, 1), ptr=1 << 20))
    assert V.needs_aligned_copy_rows(info("q", (10, 4, 64), strides=(4 * 68, 68, 1), ptr=1 << 20))  # 136-byte heads
    assert V.needs_aligned_copy_rows(info("q", (10, 4, 64), ptr=(1 << 20) + 2))  # address not 16-byte aligned
    assert not V.needs_aligned_copy_rows(info("q", (1, 1, 64), strides=(3, 3, 1), ptr=1 << 20))  # never stepped


# --- varlen: values of cu_seqlens (host copies) -------------------------------------------------------------

def cu(*values):
    return np.array(values, dtype=np.int32)


CU_BAD = [
    ("q-first-not-zero", (cu(1, 5, 9), cu(0, 3, 6), 9, 6, 8, 8), ["cu_seqlens_q[0]=1 must be 0"]),
    ("k-first-not-zero", (cu(0, 5, 9), cu(-2, 3, 6), 9, 6, 8, 8), ["cu_seqlens_k[0]=-2 must be 0"]),
    ("q-decreasing", (cu(0, 5, 4, 9), cu(0, 1, 2, 3), 9, 3, 8, 8),
     ["cu_seqlens_q must be non-decreasing", "cu_seqlens_q[2]=4 < cu_seqlens_q[1]=5", "sequence 1", "length -1"]),
    ("k-decreasing", (cu(0, 1, 2), cu(0, 7, 3), 2, 3, 8, 8), ["cu_seqlens_k[2]=3 < cu_seqlens_k[1]=7"]),
    ("q-last-not-total", (cu(0, 5, 9), cu(0, 3, 6), 10, 6, 8, 8),
     ["cu_seqlens_q[2]=9 (the last entry) must equal total_q=10", "q.shape[0]"]),
    ("k-last-not-total", (cu(0, 5, 9), cu(0, 3, 6), 9, 5, 8, 8),
     ["cu_seqlens_k[2]=6 (the last entry) must equal total_k=5", "k.shape[0]"]),
    ("q-longer-than-max", (cu(0, 2, 9, 9), cu(0, 3, 6, 6), 9, 6, 5, 8),
     ["sequence 1 has length 7", "cu_seqlens_q[2] - cu_seqlens_q[1]", "max_seqlen_q=5", ">= the longest sequence"]),
    ("k-longer-than-max", (cu(0, 2, 9), cu(0, 0, 6), 9, 6, 8, 4), ["sequence 1 has length 6", "max_seqlen_k=4"]),
]


@pytest.mark.parametrize("args,parts", [c[1:] for c in CU_BAD], ids=[c[0] for c in CU_BAD])
def test_bad_cu_seqlens_values_are_rejected(args, parts):
    with pytest.raises(ValueError) as e:
        V.check_cu_seqlens_values(*args)
    missing = [p for p in parts if p not in str(e.value)]
    assert not missing, f"message lacks {missing}: {str(e.value)!r}"


def test_cu_seqlens_values_return_the_lengths():
    lens_q, lens_k = V.check_cu_seqlens_values(cu(0, 0, 1, 4, 4), cu(0, 3, 3, 10, 11), 4, 11, 3, 7)
    assert lens_q.tolist() == [0, 1, 3, 0] and lens_k.tolist() == [3, 0, 7, 1]


# --- kvcache: metadata --------------------------------------------------------------------------------------

def kv(b=2, sq=1, hq=4, hkv=2, d=128, s_cache=1000, s_new=0, paged=None, max_blocks=4, cache_seqlens="array",
       num_splits=0, **kw):
    """check_kvcache on a consistent problem: a dense cache (b, s_cache, hkv, d) or, with paged=page_size, a paged
    cache (b * max_blocks + 1, page_size, hkv, d) and its block_table; kw replaces any argument's ArrayInfo."""
    cache_shape = (b, s_cache, hkv, d) if paged is None else (b * max_blocks + 1, paged, hkv, d)
    a = {"q": info("q", (b, sq, hq, d)), "k_cache": info("k_cache", cache_shape), "v_cache": info("v_cache", cache_shape),
         "k": info("k", (b, s_new, hkv, d)) if s_new else None, "v": info("v", (b, s_new, hkv, d)) if s_new else None,
         "cache_seqlens": info("cache_seqlens", (b,), I32) if cache_seqlens == "array" else cache_seqlens,
         "block_table": info("block_table", (b, max_blocks), I32) if paged is not None else None}
    a.update(kw)
    return V.check_kvcache(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["cache_seqlens"], a["block_table"],
                           num_splits)


KV_BAD = [
    # arrays and dtypes
    ("k-without-v", lambda: kv(s_new=1, v=None), ValueError, ["k=an array", "v=None", "both or neither"]),
    ("v-without-k", lambda: kv(v=info("v", (2, 1, 2, 128))), ValueError, ["k=None", "v=an array"]),
    ("q-float32", lambda: kv(q=info("q", (2, 1, 4, 128), np.float32)), TypeError, ["q.dtype=float32"]),
    ("k-cache-bf16", lambda: kv(k_cache=info("k_cache", (2, 1000, 2, 128), BF16)), TypeError,
     ["k_cache.dtype=bfloat16", "q.dtype=float16"]),
    ("new-v-bf16", lambda: kv(s_new=1, v=info("v", (2, 1, 2, 128), BF16)), TypeError, ["v.dtype=bfloat16"]),
    ("q-rank3", lambda: kv(q=info("q", (2, 4, 128))), ValueError, ["q has shape (2, 4, 128) (rank 3)", "rank 4"]),
    ("k-cache-rank3", lambda: kv(k_cache=info("k_cache", (2, 1000, 256))), ValueError, ["k_cache has shape (2, 1000, 256)"]),
    ("q-last-dim-strided", lambda: kv(q=info("q", (2, 1, 4, 128), strides=(1024, 1024, 256, 2))), ValueError,
     ["q has strides (1024, 1024, 256, 2)", "contiguous"]),
    ("head-dim-12", lambda: kv(d=12), ValueError, ["head_dim=12", "multiple of 8"]),
    # shapes of the caches
    ("v-cache-shape-differs", lambda: kv(v_cache=info("v_cache", (2, 999, 2, 128))), ValueError,
     ["v_cache has shape (2, 999, 2, 128) but k_cache has (2, 1000, 2, 128)", "same shape"]),
    ("cache-head-dim-differs", lambda: kv(k_cache=info("k_cache", (2, 1000, 2, 64)), v_cache=info("v_cache", (2, 1000, 2, 64))),
     ValueError, ["k_cache has shape (2, 1000, 2, 64)", "head_dim must match"]),
    ("heads-q-not-multiple", lambda: kv(hq=4, hkv=3), ValueError,
     ["k_cache has shape (2, 1000, 3, 128)", "heads_kv=3", "heads_q=4", "multiple of heads_kv"]),
    ("dense-cache-batch-differs", lambda: kv(k_cache=info("k_cache", (3, 1000, 2, 128)),
                                             v_cache=info("v_cache", (3, 1000, 2, 128))), ValueError,
     ["k_cache has shape (3, 1000, 2, 128) but q has batch=2", "(batch, S_cache, heads_kv, head_dim)"]),
    ("cache-misaligned-strides", lambda: kv(k_cache=info("k_cache", (2, 1000, 2, 128), strides=(1000 * 260, 260, 130, 1))),
     ValueError, ["k_cache must be 16-byte aligned", "cannot be copied", "(260000, 260, 130, 1)"]),
    ("cache-misaligned-address", lambda: kv(v_cache=info("v_cache", (2, 1000, 2, 128), ptr=(1 << 40) + 8)), ValueError,
     ["v_cache must be 16-byte aligned", "0x10000000008"]),
    # paged caches
    ("block-table-int64", lambda: kv(paged=64, block_table=info("block_table", (2, 4), np.int64)), TypeError,
     ["block_table.dtype=int64 must be int32"]),
    ("block-table-rank1", lambda: kv(paged=64, block_table=info("block_table", (8,), I32)), ValueError,
     ["block_table has shape (8,)", "(batch, max_blocks_per_seq)", "batch=2"]),
    ("block-table-batch-differs", lambda: kv(paged=64, block_table=info("block_table", (3, 4), I32)), ValueError,
     ["block_table has shape (3, 4)", "batch=2"]),
    ("block-table-last-dim-strided", lambda: kv(paged=64, block_table=info("block_table", (2, 4), I32, strides=(8, 2))),
     ValueError, ["block_table has strides (8, 2)", "contiguous"]),
    ("page-size-40", lambda: kv(paged=40), ValueError,
     ["page_size=40", "k_cache.shape[1]", "must be a positive multiple of 16"]),
    ("page-size-8", lambda: kv(paged=8), ValueError, ["page_size=8", "multiple of 16"]),
    ("page-size-72", lambda: kv(paged=72), ValueError, ["page_size=72", "multiple of 16"]),
    ("page-size-0", lambda: kv(paged=0), ValueError, ["page_size=0", "positive multiple of 16"]),
    # new keys and values
    ("new-k-heads-differ", lambda: kv(s_new=2, k=info("k", (2, 2, 4, 128))), ValueError,
     ["k has shape (2, 2, 4, 128)", "(batch, S_new, heads_kv, head_dim) = (2, S_new, 2, 128)"]),
    ("new-v-seqlen-differs", lambda: kv(s_new=2, v=info("v", (2, 3, 2, 128))), ValueError,
     ["v has shape (2, 3, 2, 128)", "k has (2, 2, 2, 128)"]),
    ("new-k-batch-differs", lambda: kv(s_new=1, k=info("k", (1, 1, 2, 128)), v=info("v", (1, 1, 2, 128))), ValueError,
     ["k has shape (1, 1, 2, 128)"]),
    ("s-new-over-capacity", lambda: kv(s_new=300, paged=64, max_blocks=4), ValueError,
     ["S_new=300 new keys", "capacity=256"]),
    # cache_seqlens
    ("seqlens-none-with-new-keys", lambda: kv(s_new=3, cache_seqlens=None), ValueError,
     ["cache_seqlens=None", "full (1000 keys)", "no room for the S_new=3 new keys"]),
    ("seqlens-int-over-capacity", lambda: kv(s_new=3, cache_seqlens=998), ValueError,
     ["cache_seqlens=998 with S_new=3", "capacity=1000", "0 <= cache_seqlens <= 997"]),
    ("seqlens-int-negative", lambda: kv(cache_seqlens=-1), ValueError, ["cache_seqlens=-1", "0 <= cache_seqlens <= 1000"]),
    ("seqlens-int-over-paged-capacity", lambda: kv(paged=64, max_blocks=4, cache_seqlens=257), ValueError,
     ["cache_seqlens=257", "capacity=256"]),
    ("seqlens-float", lambda: kv(cache_seqlens=5.0), TypeError, ["cache_seqlens=5.0", "None, an int or a CuPy int32"]),
    ("seqlens-bool", lambda: kv(cache_seqlens=True), TypeError, ["cache_seqlens=True"]),
    ("seqlens-int64-array", lambda: kv(cache_seqlens=info("cache_seqlens", (2,), np.int64)), TypeError,
     ["cache_seqlens.dtype=int64 must be int32"]),
    ("seqlens-array-shape", lambda: kv(cache_seqlens=info("cache_seqlens", (3,), I32)), ValueError,
     ["cache_seqlens has shape (3,)", "(batch,) = (2,)"]),
    ("seqlens-array-2d", lambda: kv(cache_seqlens=info("cache_seqlens", (2, 1), I32)), ValueError,
     ["cache_seqlens has shape (2, 1)"]),
    ("seqlens-array-strided", lambda: kv(cache_seqlens=info("cache_seqlens", (2,), I32, strides=(2,))), ValueError,
     ["cache_seqlens has strides (2,)", "contiguous"]),
    # num_splits
    ("num-splits-129", lambda: kv(num_splits=129), ValueError, ["num_splits=129 is out of range", "0 <= num_splits <= 128"]),
    ("num-splits-negative", lambda: kv(num_splits=-1), ValueError, ["num_splits=-1"]),
    ("num-splits-float", lambda: kv(num_splits=2.0), TypeError, ["num_splits=2.0 must be an int"]),
    ("num-splits-bool", lambda: kv(num_splits=True), TypeError, ["num_splits=True must be an int"]),
    # grid limits, devices
    ("batch-65536", lambda: kv(b=65536, hq=1, hkv=1, d=8, s_cache=1), ValueError, ["batch=65536", "65535"]),
    ("heads-65536", lambda: kv(b=1, hq=65536, hkv=1, d=8, s_cache=1), ValueError, ["heads=65536", "65535"]),
    ("v-cache-device-1", lambda: kv(v_cache=info("v_cache", (2, 1000, 2, 128), device=1)), ValueError,
     ["v_cache is on device 1", "q is on device 0"]),
    ("block-table-device-1", lambda: kv(paged=64, block_table=info("block_table", (2, 4), I32, device=1)), ValueError,
     ["block_table is on device 1"]),
    ("seqlens-device-1", lambda: kv(cache_seqlens=info("cache_seqlens", (2,), I32, device=1)), ValueError,
     ["cache_seqlens is on device 1"]),
]


def _aliasing_cases():
    """The caches are written in place when new keys come: nothing else may share their memory."""
    shape = (2, 1000, 2, 128)
    base = 1 << 44
    kc = info("k_cache", shape, ptr=base)
    return [
        ("v-cache-is-k-cache", lambda: kv(s_new=1, k_cache=kc, v_cache=info("v_cache", shape, ptr=base)), ValueError,
         ["v_cache overlaps the memory of k_cache", "separate arrays"]),
        ("new-k-inside-k-cache", lambda: kv(s_new=1, k_cache=kc, k=info("k", (2, 1, 2, 128), ptr=base + 4096)),
         ValueError, ["k overlaps the memory of k_cache", "must not alias the cache"]),
        ("q-inside-v-cache", lambda: kv(s_new=1, v_cache=kc._replace(name="v_cache"),
                                        q=info("q", (2, 1, 4, 128), ptr=base + 2 * 1000 * 2 * 128 * 2 - 4096)),
         ValueError, ["q overlaps the memory of v_cache"]),
        ("seqlens-inside-k-cache", lambda: kv(s_new=1, k_cache=kc,
                                              cache_seqlens=info("cache_seqlens", (2,), I32, ptr=base + 256)),
         ValueError, ["cache_seqlens overlaps the memory of k_cache"]),
    ]


KV_BAD += _aliasing_cases()


@pytest.mark.parametrize("call,exc,parts", [c[1:] for c in KV_BAD], ids=[c[0] for c in KV_BAD])
def test_bad_kvcache_metadata_is_rejected_with_a_clear_message(call, exc, parts):
    with pytest.raises(exc) as e:
        call()
    missing = [p for p in parts if p not in str(e.value)]
    assert not missing, f"message lacks {missing}: {str(e.value)!r}"


def test_the_tables_are_not_trivial():
    for cases in (VARLEN_BAD, CU_BAD, KV_BAD, KV_VALUES_BAD):
        ids = [c[0] for c in cases]
        assert len(ids) == len(set(ids)), "duplicate ids"
    assert len(KV_BAD) >= 40 and len(VARLEN_BAD) >= 25


def test_dense_kvcache_metadata():
    dims = kv(b=3, sq=2, hq=8, hkv=2, d=96, s_cache=777, s_new=2, cache_seqlens=700, num_splits=7)
    assert isinstance(dims, KvcacheDims)
    assert (dims.dtype, dims.batch, dims.seqlen_q, dims.heads_q, dims.heads_kv, dims.head_dim) == ("fp16", 3, 2, 8, 2, 96)
    assert (dims.s_new, dims.paged, dims.page_size, dims.num_blocks, dims.max_blocks, dims.capacity) == \
        (2, False, 777, 3, 1, 777)
    assert (dims.cache_seqlen, dims.num_splits, dims.block_table_stride, dims.device) == (700, 7, 0, 0)
    assert dims.k_cache == Dims(3, 777, 2, 96, 777 * 2 * 96, 2 * 96, 96)
    assert dims.q == Dims(3, 2, 8, 96, 2 * 8 * 96, 8 * 96, 96) and dims.k == Dims(3, 2, 2, 96, 2 * 2 * 96, 2 * 96, 96)


def test_paged_kvcache_metadata():
    bt = info("block_table", (2, 5), I32, strides=(8, 1))  # rows of a wider table
    dims = kv(b=2, hq=4, hkv=4, paged=256, max_blocks=5, block_table=bt, cache_seqlens=None, num_splits=0)
    assert (dims.paged, dims.page_size, dims.num_blocks, dims.max_blocks, dims.capacity) == (True, 256, 11, 5, 1280)
    assert (dims.cache_seqlen, dims.block_table_stride, dims.s_new, dims.k, dims.v) == (1280, 8, 0, None, None)
    assert (dims.k_cache.batch, dims.k_cache.seqlen, dims.k_cache.batch_stride) == (11, 256, 256 * 4 * 128)


@pytest.mark.parametrize("page", [64, 128, 256, 512])
def test_page_sizes_that_are_multiples_of_64_are_accepted(page):
    assert kv(paged=page, s_new=1).page_size == page


def test_kvcache_accepts_per_sequence_seqlens_strided_caches_and_read_only_aliasing():
    dims = kv(cache_seqlens=info("cache_seqlens", (2,), I32))
    assert dims.cache_seqlen is None
    # a cache that is a view with padded strides (multiples of 8 elements) is read and written in place
    kv(k_cache=info("k_cache", (2, 1000, 2, 128), strides=(1001 * 3 * 136, 3 * 136, 136, 1)))
    # without new keys nothing is written: k_cache may be v_cache, q may live inside the cache
    shared = info("k_cache", (2, 1000, 2, 128), ptr=1 << 45)
    kv(k_cache=shared, v_cache=shared._replace(name="v_cache"), q=info("q", (2, 1, 4, 128), ptr=(1 << 45) + 1024))
    assert kv(sq=0, b=0, s_cache=0, cache_seqlens=0).batch == 0  # empty problems pass


# --- kvcache: values (host copies), checked before anything is written ------------------------------------------

def table(*rows):
    return np.array(rows, dtype=np.int32)


KV_VALUES_BAD = [
    ("seqlens-negative", (np.array([3, -1], np.int32), None, 100, 0, 2, 100),
     ["cache_seqlens[1]=-1 must be >= 0", "sequence 1"]),
    ("seqlens-plus-new-over-capacity", (np.array([10, 98], np.int32), None, 100, 3, 2, 100),
     ["cache_seqlens[1]=98 plus S_new=3 new keys = 101", "capacity of 100", "0 <= cache_seqlens <= 97"]),
    ("seqlens-int-over-capacity", (101, None, 100, 0, 2, 100), ["cache_seqlens=101", "capacity of 100"]),
    ("block-out-of-range", (np.array([64, 130], np.int32), table([0, 1, 2], [3, 5, 9]), 192, 0, 5, 64),
     ["block_table[1, 1]=5 is out of range", "sequence 1 holds 130 keys", "block_table[1, 0..2]", "page_size=64",
      "[0, num_blocks=5)"]),
    ("block-minus-one-in-use", (np.array([65, 0], np.int32), table([0, -1, -1], [-1, -1, -1]), 192, 0, 5, 64),
     ["block_table[0, 1]=-1 is out of range", "sequence 0 holds 65 keys"]),
    ("block-in-use-after-append", (np.array([64, 0], np.int32), table([0, -1], [1, -1]), 128, 1, 5, 64),
     ["block_table[0, 1]=-1", "holds 65 keys"]),
    ("full-cache-none", (None, table([0, 1], [2, 7]), 128, 0, 5, 64), ["block_table[1, 1]=7"]),
    ("new-keys-share-a-slot", (np.array([10, 10], np.int32), table([0, 1], [0, 2]), 128, 2, 3, 64),
     ["sequence 0 (position 10) and sequence 1 (position 10)", "same cache slot (block 0, row 10)", "overwrite"]),
    ("new-keys-share-a-block-within-a-sequence", (np.array([0], np.int32), table([4, 4]), 128, 65, 5, 64),
     ["sequence 0 (position 0) and sequence 0 (position 64)", "(block 4, row 0)"]),
]


@pytest.mark.parametrize("args,parts", [c[1:] for c in KV_VALUES_BAD], ids=[c[0] for c in KV_VALUES_BAD])
def test_bad_kvcache_values_are_rejected(args, parts):
    with pytest.raises(ValueError) as e:
        V.check_kvcache_values(*args)
    missing = [p for p in parts if p not in str(e.value)]
    assert not missing, f"message lacks {missing}: {str(e.value)!r}"


def test_kvcache_values_allow_anything_in_unused_blocks_and_return_the_longest_sequence():
    # sequence 0 uses blocks 0..1 (100 + 2 keys), sequence 1 none (0 + 2 keys -> block 0), the rest may be -1 or junk
    assert V.check_kvcache_values(np.array([100, 0], np.int32), table([3, 0, -1, 99], [1, -7, 12345, -1]),
                                  256, 2, 4, 64) == 102
    assert V.check_kvcache_values(np.array([0, 0], np.int32), table([-1, -1], [-1, -1]), 128, 0, 4, 64) == 0
    assert V.check_kvcache_values(None, None, 300, 0, 2, 300) == 300
    assert V.check_kvcache_values(7, None, 300, 5, 2, 300) == 12
    # prefix sharing: two sequences may read one block, as long as their new keys land in different slots
    assert V.check_kvcache_values(np.array([64, 64], np.int32), table([0, 1], [0, 2]), 128, 1, 3, 64) == 65


# --- kvcache: FlashAttention-2's further arguments (rotary tables, cache_batch_idx, cache_leftpad) ------------------

def kv_extra(sq=1, s_new=1, paged=None, cos=(1000, 32), sin="same", cos_dtype=np.float32, batch_idx=None,
             leftpad=None, moves_q=False):
    """check_kvcache of kv()'s dense problem (batch 2, capacity 1000, head_dim 128; paged: 64-row pages, capacity
    256) with rotary tables of shape cos (None: none), cache_batch_idx / cache_leftpad ArrayInfo or None."""
    b, hkv, d = 2, 2, 128
    cache_shape = (b, 1000, hkv, d) if paged is None else (b * 4 + 1, paged, hkv, d)
    tables = [None if shape is None else info(name, shape, cos_dtype)
              for name, shape in (("rotary_cos", cos), ("rotary_sin", cos if sin == "same" else sin))]
    return V.check_kvcache(info("q", (b, sq, 4, d)), info("k_cache", cache_shape), info("v_cache", cache_shape),
                           info("k", (b, s_new, hkv, d)) if s_new else None,
                           info("v", (b, s_new, hkv, d)) if s_new else None, info("cache_seqlens", (b,), I32),
                           None if paged is None else info("block_table", (b, 4), I32), 0, cache_batch_idx=batch_idx,
                           cache_leftpad=leftpad, rotary_cos=tables[0], rotary_sin=tables[1], moves_q=moves_q)


KV_EXTRA_BAD = [
    ("rotary-dim-24", lambda: kv_extra(cos=(1000, 12)), ValueError, ["rotary_dim=24", "multiple of 16"]),
    ("rotary-dim-over-head-dim", lambda: kv_extra(cos=(1000, 72)), ValueError, ["rotary_dim=144", "head_dim=128"]),
    ("rotary-seqlen-ro-under-capacity", lambda: kv_extra(cos=(999, 32)), ValueError, ["seqlen_ro=999", "1000"]),
    ("rotary-seqlen-ro-under-moving-queries", lambda: kv_extra(sq=3, moves_q=True), ValueError,
     ["seqlen_ro=1000", "1002"]),
    ("rotary-float64", lambda: kv_extra(cos_dtype=np.float64), TypeError, ["rotary_cos.dtype=float64"]),
    ("rotary-sin-shape-differs", lambda: kv_extra(sin=(1000, 16)), ValueError, ["rotary_sin", "(1000, 16)"]),
    ("rotary-cos-without-sin", lambda: kv_extra(sin=None), ValueError, ["rotary_sin=None"]),
    ("rotary-without-new-keys", lambda: kv_extra(s_new=0), ValueError, ["rotary_cos", "k and v"]),
    ("batch-idx-with-block-table", lambda: kv_extra(paged=64, cos=None, batch_idx=info("cache_batch_idx", (2,), I32)),
     ValueError, ["cache_batch_idx", "block_table"]),
    ("batch-idx-int64", lambda: kv_extra(cos=None, batch_idx=info("cache_batch_idx", (2,), np.int64)), TypeError,
     ["cache_batch_idx.dtype=int64"]),
    ("leftpad-shape", lambda: kv_extra(cos=None, leftpad=info("cache_leftpad", (3,), I32)), ValueError,
     ["cache_leftpad has shape (3,)", "(2,)"]),
]

KV_EXTRA_VALUES_BAD = [  # check_kvcache_values(..., leftpad_host, batch_idx_host)
    ("leftpad-over-seqlens", (np.array([5, 7], np.int32), None, 100, 1, 2, 100, np.array([0, 8], np.int32), None),
     ["cache_leftpad[1]=8"]),
    ("leftpad-negative", (np.array([5, 7], np.int32), None, 100, 1, 2, 100, np.array([-1, 0], np.int32), None),
     ["cache_leftpad[0]=-1"]),
    ("batch-idx-out-of-range", (np.array([5, 7], np.int32), None, 100, 1, 4, 100, None, np.array([1, 4], np.int32)),
     ["cache_batch_idx[1]=4"]),
    ("batch-idx-repeated-with-new-keys",
     (np.array([5, 7], np.int32), None, 100, 1, 4, 100, None, np.array([3, 3], np.int32)),
     ["cache_batch_idx[0]=3", "cache_batch_idx[1]=3"]),
]


@pytest.mark.parametrize("call,exc,parts", [c[1:] for c in KV_EXTRA_BAD], ids=[c[0] for c in KV_EXTRA_BAD])
def test_bad_kvcache_rotary_and_index_metadata_is_rejected(call, exc, parts):
    with pytest.raises(exc) as e:
        call()
    missing = [p for p in parts if p not in str(e.value)]
    assert not missing, f"message lacks {missing}: {str(e.value)!r}"


@pytest.mark.parametrize("args,parts", [c[1:] for c in KV_EXTRA_VALUES_BAD], ids=[c[0] for c in KV_EXTRA_VALUES_BAD])
def test_bad_kvcache_leftpad_and_batch_idx_values_are_rejected(args, parts):
    with pytest.raises(ValueError) as e:
        V.check_kvcache_values(*args)
    missing = [p for p in parts if p not in str(e.value)]
    assert not missing, f"message lacks {missing}: {str(e.value)!r}"


def test_kvcache_rotary_and_index_arrays_that_pass():
    dims = kv_extra(cos=(1000, 32))  # float32 tables, rotary_dim 64 of head_dim 128
    assert (dims.rotary.dim, dims.rotary.interleaved) == (64, True)
    # cache_batch_idx: a dense cache with more entries than the batch; repeated entries when nothing is written
    lens = np.array([5, 7], np.int32)
    assert V.check_kvcache_values(lens, None, 100, 0, 4, 100, None, np.array([3, 3], np.int32)) == 7
    # cache_leftpad: the keys a sequence attends start there; blocks wholly before it may hold anything (-1)
    assert V.check_kvcache_values(np.array([130, 10], np.int32), table([-1, -1, 2], [0, -1, -1]), 192, 2, 3, 64,
                                  np.array([128, 4], np.int32), None) == 8
