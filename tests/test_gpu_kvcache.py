"""KV-cache decoding on the GPU: attention_with_kvcache against the float64 reference over each
sequence's valid prefix (docs/RELIABILITY.md: o within 2x the low-precision error + 1e-5, lse within 1e-3,
-inf exactly where a row sees no key), and the cache bit for bit: the new keys and values land in exactly their
slots (through the block table when paged), every other element, block and guard byte keeps its bits, and a
rejected call writes nothing.

Semantics under test: q (B, Sq, H_q, D); a dense cache (B, S_cache, H_kv, D) or a paged one (num_blocks,
page_size, H_kv, D) with block_table (B, max_blocks) int32, logical key j of sequence b at
[block_table[b, j // page_size], j % page_size]; cache_seqlens None / int / int32 (B,) array; new k, v
(B, S_new, H_kv, D) written at cache_seqlens[b] .. cache_seqlens[b] + S_new - 1; attention over L_b =
cache_seqlens[b] + S_new keys, causal bottom-right (query i sees j <= i + L_b - Sq); num_splits 0 (heuristic)
or 1..128, same result."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _xpref, config  # noqa: E402
from gpu_helpers import (DTYPES, bits, check_lse, check_rule, max_abs, poison_pool, randn, round_up,  # noqa: E402
                         same_bits, seed_of, warm_kernel_cache)
from reliability_helpers import guarded, lowp_dtype  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    warm_kernel_cache(config.all_fwd_configs())


class Problem:
    """One attention_with_kvcache call: inputs (caches dense or paged, optionally inside NaN-guarded buffers),
    the keyword arguments, and the expected state of the caches after the call (computed before it)."""

    def __init__(self, *, batch, sq, hq, hkv, d, dtype, cache, capacity, new_kv, seqlens, guard, seed_key,
                 cached=None):
        rng = np.random.default_rng(seed_of("kvcache", *seed_key))
        seed = seed_of("kvcache-data", *seed_key)
        self.dtype, self.sq, self.hq = dtype, sq, hq
        self.s_new = sq if new_kv else 0
        self.page = None if cache == "dense" else int(cache[len("paged"):])
        # keys already cached per sequence (unless given): an empty cache, one full after the append, a random one
        if seqlens == "array":
            hi = capacity - self.s_new
            if cached is None:
                cached = rng.permutation([0, hi, int(rng.integers(1, hi))])[:batch]
            assert len(cached) == batch and all(0 <= c <= hi for c in cached), (cached, hi)
            self.cached = [int(x) for x in cached]
            self.seqlens_arg = cp.asarray(self.cached, dtype=cp.int32)
        elif seqlens == "int":
            self.cached = [capacity // 2 + 1 - self.s_new] * batch  # L = capacity / 2 + 1: not a tile multiple
            self.seqlens_arg = self.cached[0]
        else:
            assert seqlens == "none" and not new_kv, "cache_seqlens=None leaves no room for new keys"
            self.cached, self.seqlens_arg = [capacity] * batch, None
        self.lengths = [c + self.s_new for c in self.cached]

        if self.page is None:
            cache_shape = (batch, capacity, hkv, d)
            self.block_table = None
        else:
            max_blocks = capacity // self.page
            num_blocks = batch * max_blocks + 5  # spare blocks that no sequence uses: they must stay untouched
            table = rng.permutation(num_blocks)[:batch * max_blocks].reshape(batch, max_blocks)
            for b, length in enumerate(self.lengths):  # entries past a sequence's last block may be anything
                table[b, -(-length // self.page):] = -1
            self.block_table = cp.asarray(table, dtype=cp.int32)
            cache_shape = (num_blocks, self.page, hkv, d)
        self.guarded = []
        caches = []
        for i in range(2):
            values = randn(cache_shape, dtype, seed + i)
            if guard:
                g = guarded(cache_shape, lowp_dtype(dtype), values)
                self.guarded.append((g, g.snapshot()))
                caches.append(g.view)
            else:
                caches.append(values)
        self.k_cache, self.v_cache = caches
        self.q = randn((batch, sq, hq, d), dtype, seed + 2)
        self.k = self.v = None
        if new_kv:
            self.k, self.v = (randn((batch, self.s_new, hkv, d), dtype, seed + 3 + i) for i in range(2))

        # what the call must leave behind, and the float inputs of the references, from the arrays before the call
        new_bits = (None, None) if self.k is None else (bits(self.k), bits(self.v))
        self.expected = _xpref.kvcache_append(bits(self.k_cache), bits(self.v_cache), *new_bits, self.seqlens_arg,
                                              self.block_table)  # equal to the caches when there are no new keys
        self.f32 = [None if x is None else _xpref.to_float32(x) for x in (self.q, self.k_cache, self.v_cache,
                                                                          self.k, self.v)]
        self.inputs_before = {n: bits(x) for n, x in self.named_inputs().items()}

    def named_inputs(self):
        named = {"q": self.q, "k": self.k, "v": self.v, "cache_seqlens": self.seqlens_arg,
                 "block_table": self.block_table}
        return {n: x for n, x in named.items() if isinstance(x, cp.ndarray)}

    def call(self, **kw):
        return cuflash.attention_with_kvcache(self.q, self.k_cache, self.v_cache, k=self.k, v=self.v,
                                              cache_seqlens=self.seqlens_arg, block_table=self.block_table, **kw)

    def references(self, causal):
        q, kc, vc, k, v = self.f32
        o64, lse64, _, _ = _xpref.attention_kvcache64(q, kc, vc, self.seqlens_arg, k, v, self.block_table, causal)
        o_lowp = _xpref.attention_kvcache_lowp(q, kc, vc, self.dtype, self.seqlens_arg, k, v, self.block_table, causal)
        return o64, lse64, o_lowp

    def poison(self, num_splits):
        """Poison room for o, lse and the split-KV partial results (float32 o and lse per split)."""
        rows = self.q.shape[0] * self.sq * self.hq
        splits = num_splits or 128  # 0: the heuristic may pick up to 128
        poison_pool(round_up(self.q.nbytes) + round_up(rows * 4) + round_up(splits * rows * (self.q.shape[-1] + 1) * 4)
                    + (1 << 20))

    def check_caches(self, what):
        """The caches hold exactly the expected bits (the new keys in their slots, all else as before), nothing
        outside the cache views changed, and the other inputs are bit for bit as given."""
        for name, x, want in (("k_cache", self.k_cache, self.expected[0]), ("v_cache", self.v_cache, self.expected[1])):
            wrong = bits(x) != want
            if bool(wrong.any()):
                where = [tuple(int(i) for i in idx) for idx in cp.argwhere(wrong)[:4].get()]
                raise AssertionError(f"{name} differs from the expected cache at {int(wrong.sum())} elements, first "
                                     f"(block/batch, row, head, dim) {where}, for {what}")
        for i, (g, snap) in enumerate(self.guarded):
            assert g.outside_unchanged(snap), f"{('k_cache', 'v_cache')[i]}: bytes outside the view changed, {what}"
        for name, x in self.named_inputs().items():
            assert same_bits(x, self.inputs_before[name]), f"{name} was modified, {what}"


def check_outputs(p, o, lse, causal, what):
    batch = p.q.shape[0]
    assert o.shape == p.q.shape and o.dtype == p.q.dtype, f"o is {o.shape} {o.dtype} for {what}"
    assert lse.shape == (batch, p.hq, p.sq) and lse.dtype == cp.float32, f"lse is {lse.shape} {lse.dtype} for {what}"
    o64, lse64, o_lowp = p.references(causal)
    o32 = _xpref.to_float32(o)
    check_rule("o", o32, o64, o_lowp, 2, what)
    check_lse(lse, lse64, what)
    masked = ~cp.isfinite(lse64).transpose(0, 2, 1)  # (B, Sq, H_q): rows that see no key
    assert max_abs(cp.where(masked[..., None], o32, 0.0)) == 0.0, f"rows that see no key must be 0 for {what}"


# --- the grid: every Sq x cache kind x new keys or not x causal, with the other options cycling over it ---------

def grid():
    """36 cases: per cache kind, every Sq x new keys or not x causal; num_splits, GQA ratio, cache_seqlens kind
    (None only without new keys), dtype, head dim and guard buffers cycle over them (the test below checks
    that each cache kind meets every value of each)."""
    cases = []
    for c, cache in enumerate(("dense", "paged64", "paged256")):
        for i, (sq, new_kv, causal) in enumerate(itertools.product((1, 3, 64), (False, True), (False, True))):
            seqlens = ("array", "int", "none")[i % 3]
            if seqlens == "none" and new_kv:
                seqlens = "array"
            n = i + c
            cases.append(dict(sq=sq, cache=cache, new_kv=new_kv, causal=causal, num_splits=(0, 1, 7)[n % 3],
                              ratio=(1, 4)[(n // 2) % 2], seqlens=seqlens, dtype=DTYPES[(n // 3) % 2],
                              d=(128, 64)[(i // 6) % 2], guard=(i // 4 + i) % 2 == 0))
    return cases


GRID = grid()


def case_id(c):
    return (f"sq{c['sq']}-{c['cache']}-{'new' if c['new_kv'] else 'read'}-{'causal' if c['causal'] else 'full'}"
            f"-splits{c['num_splits']}-gqa{c['ratio']}-{c['seqlens']}-{c['dtype']}-d{c['d']}"
            + ("-guarded" if c["guard"] else ""))


def test_the_grid_covers_every_option_with_every_cache_kind():
    for cache in ("dense", "paged64", "paged256"):
        mine = [c for c in GRID if c["cache"] == cache]
        for key, values in (("num_splits", {0, 1, 7}), ("ratio", {1, 4}), ("seqlens", {"array", "int", "none"}),
                            ("dtype", set(DTYPES)), ("d", {64, 128}), ("guard", {False, True}), ("sq", {1, 3, 64})):
            assert {c[key] for c in mine} == values, f"{cache}: {key} covers only {sorted({c[key] for c in mine})}"
        assert {(c["guard"], c["causal"]) for c in mine} == set(itertools.product((False, True), repeat=2))
        assert {(c["num_splits"], c["new_kv"]) for c in mine} == set(itertools.product((0, 1, 7), (False, True)))


@pytest.mark.parametrize("case", GRID, ids=[case_id(c) for c in GRID])
def test_kvcache_matches_reference_and_writes_exactly_the_new_slots(case):
    c = case
    capacity = 1000 if c["cache"] == "dense" else 1024  # dense: not a multiple of the 64-key tile
    p = Problem(batch=3, sq=c["sq"], hq=2 * c["ratio"], hkv=2, d=c["d"], dtype=c["dtype"], cache=c["cache"],
                capacity=capacity, new_kv=c["new_kv"], seqlens=c["seqlens"], guard=c["guard"],
                seed_key=tuple(sorted(c.items())))
    what = f"{case_id(c)} cached={p.cached} L={p.lengths}"
    p.poison(c["num_splits"])
    o, lse = p.call(causal=c["causal"], num_splits=c["num_splits"], return_lse=True)
    check_outputs(p, o, lse, c["causal"], what)
    p.check_caches(what)


# --- long caches (up to 128k keys): few, batch 1, few heads --------------------------------------------------------

LONG = [  # (cache, capacity, Sq, H_q, H_kv, new k/v, causal, num_splits, cache_seqlens, dtype)
    ("dense", 131072, 1, 4, 1, True, False, 0, [131071], "bf16"),      # the new key fills the last slot
    ("paged256", 131072, 3, 4, 1, True, True, 7, "int", "fp16"),       # L = 65537
    ("dense", 65536 + 37, 64, 1, 1, False, True, 1, "none", "bf16"),   # one split over 65573 keys
    ("paged64", 131072, 1, 1, 1, False, False, 0, [77777], "fp16"),   # 2048 pages of 64, shuffled
]


@pytest.mark.parametrize("cache,capacity,sq,hq,hkv,new_kv,causal,splits,seqlens,dtype", LONG,
                         ids=[f"{c[0]}-{c[1]}-sq{c[2]}-splits{c[7]}-{c[8]}" for c in LONG])
def test_kvcache_long_caches(cache, capacity, sq, hq, hkv, new_kv, causal, splits, seqlens, dtype):
    """Batch 1, few heads: caches up to 128k keys, dense and paged, the heuristic split count among them."""
    given = seqlens if isinstance(seqlens, list) else None
    p = Problem(batch=1, sq=sq, hq=hq, hkv=hkv, d=128, dtype=dtype, cache=cache, capacity=capacity, new_kv=new_kv,
                seqlens="array" if given else seqlens, guard=False, seed_key=("long", cache, capacity, sq),
                cached=given)
    what = (f"long {cache} capacity={capacity} Sq={sq} H_q={hq} H_kv={hkv} cached={p.cached} L={p.lengths} "
            f"splits={splits} causal={causal} {dtype}")
    p.poison(splits)
    o, lse = p.call(causal=causal, num_splits=splits, return_lse=True)
    check_outputs(p, o, lse, causal, what)
    p.check_caches(what)


WIDE = [(d, cache) for d in sorted(config.DECODE_TILES) for cache in ("dense", "paged64", "paged256")]


@pytest.mark.parametrize("d,cache", WIDE, ids=[f"d{d}-{cache}" for d, cache in WIDE])
def test_every_decode_head_dim_over_more_than_a_wave(d, cache):
    """Every kernel head dim's decode tile at a batch whose CTAs fill more than a wave at two CTAs per SM (96 x 4 K/V
    heads), unsplit: 64-row pages are read row by row where the tile is wider than a page (head dim 32). The kernel
    runs at most _families.DECODE_MAX_CTAS_PER_SM CTAs per SM (padded shared memory where it would fit more)."""
    from cuflash import _families

    p = Problem(batch=96, sq=1, hq=16, hkv=4, d=d, dtype="bf16", cache=cache, capacity=512, new_kv=True,
                seqlens="int", guard=False, seed_key=("wide", d, cache))
    what = f"batch 96 over {cache} cache of 512 keys, head dim {d}"
    p.poison(0)
    o, lse = p.call(causal=True, return_lse=True)
    check_outputs(p, o, lse, True, what)
    p.check_caches(what)
    cfg, kernel = _families._kernel("decode", 0, d, "bf16", True)
    capped = kernel.at_most(_families.DECODE_MAX_CTAS_PER_SM, 0)
    assert capped.ctas_per_sm <= _families.DECODE_MAX_CTAS_PER_SM, (cfg.cpp_name(), capped.ctas_per_sm)
    assert (capped is kernel) == (kernel.ctas_per_sm <= _families.DECODE_MAX_CTAS_PER_SM), cfg.cpp_name()
    assert capped.smem_bytes >= cfg.smem_bytes and capped.function is kernel.function


# --- split-KV, return_lse, check_inputs -----------------------------------------------------------------------------

def split_problem(dtype):
    """Sequence lengths 0, 5 and 300: with 128 splits most splits of a sequence see no key."""
    return Problem(batch=3, sq=3, hq=8, hkv=2, d=128, dtype=dtype, cache="paged256", capacity=1024, new_kv=False,
                   seqlens="array", guard=False, seed_key=("splits", dtype), cached=[0, 5, 300])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_num_splits_gives_the_reference_result_and_repeats_bitwise(dtype):
    p = split_problem(dtype)
    for splits in (0, 1, 2, 3, 7, 16, 128):
        what = f"num_splits={splits} L={p.lengths} {dtype}"
        p.poison(splits)
        o, lse = p.call(causal=True, num_splits=splits, return_lse=True)
        check_outputs(p, o, lse, True, what)
        o2, lse2 = p.call(causal=True, num_splits=splits, return_lse=True)
        assert same_bits(o, o2) and same_bits(lse, lse2), f"a second run differs, {what}"
    p.check_caches("split sweep")


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_in_a_second_launch_equals_the_merge_in_the_decode_launch(dtype, monkeypatch):
    """_families.DECODE_FUSED_MERGE: the last split of a row block merges (one launch), or fwd_combine_kernel does
    (a second launch). Both sum the splits in the same order: the same bits, for every split count."""
    from cuflash import _families

    p = split_problem(dtype)
    for splits in (2, 7, 128):
        fused = p.call(causal=True, num_splits=splits, return_lse=True)
        monkeypatch.setattr(_families, "DECODE_FUSED_MERGE", False)
        p.poison(splits)
        launched = p.call(causal=True, num_splits=splits, return_lse=True)
        monkeypatch.setattr(_families, "DECODE_FUSED_MERGE", True)
        check_outputs(p, *launched, True, f"merge in a second launch, num_splits={splits} {dtype}")
        assert same_bits(fused[0], launched[0]) and same_bits(fused[1], launched[1]), f"num_splits={splits}"


def test_split_counters_on_several_streams():
    """Decode launches on different streams may overlap, so each stream has its own merge counters (which every
    launch leaves at zero): many launches on three streams at once all give the single-stream result."""
    p = split_problem("bf16")
    want, want_lse = p.call(causal=True, num_splits=7, return_lse=True)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
    cp.cuda.Device().synchronize()
    results = []
    for i in range(12):
        with streams[i % 3]:
            results.append(p.call(causal=True, num_splits=7, return_lse=True, check_inputs=False))
    cp.cuda.Device().synchronize()
    for i, (o, lse) in enumerate(results):
        assert same_bits(o, want) and same_bits(lse, want_lse), f"launch {i} on stream {i % 3} differs"
    from cuflash import _families

    # (arrived, published) per row block; keys (device, stream[, host thread on the per-thread default stream])
    for (device, stream, *thread), counters in _families._split_counters.items():
        assert not counters.any(), f"the merge counters of stream {stream:#x} are not back at zero"


def test_merge_under_back_to_back_launches_repeats_bitwise():
    """The last split to arrive merges as soon as every other split has published; whether it finds them all
    published or waits for one depends on timing. 200 back-to-back launches of a long sequence (16 splits over
    the whole machine, loop ends microseconds apart, as in a real decode step) and of the short split problem
    (most splits see no key and finish at once): every launch gives the bits of the first, checked against the
    reference, and every counter is back at zero afterwards."""
    from cuflash import _families

    long = Problem(batch=1, sq=1, hq=32, hkv=8, d=128, dtype="bf16", cache="dense", capacity=16384, new_kv=False,
                   seqlens="array", guard=False, seed_key=("merge-stress",), cached=[16384])
    short = split_problem("fp16")
    for p, splits in ((long, 16), (short, 7), (short, 128)):
        want, want_lse = p.call(num_splits=splits, return_lse=True)
        check_outputs(p, want, want_lse, False, f"merge stress, num_splits={splits}")
        results = [p.call(num_splits=splits, return_lse=True, check_inputs=False) for _ in range(200)]
        cp.cuda.Device().synchronize()
        for i, (o, lse) in enumerate(results):
            assert same_bits(o, want) and same_bits(lse, want_lse), f"launch {i} of 200 differs, num_splits={splits}"
    for (device, stream, *thread), counters in _families._split_counters.items():
        assert not counters.any(), f"the merge counters of stream {stream:#x} are not back at zero"


def test_return_lse_false_returns_only_o_and_check_inputs_false_the_same_bits():
    p = split_problem("bf16")
    o, lse = p.call(causal=False, num_splits=3, return_lse=True)
    o_only = p.call(causal=False, num_splits=3)
    assert isinstance(o_only, cp.ndarray), f"return_lse=False must return o alone, got {type(o_only)}"
    assert same_bits(o_only, o)
    o_unchecked, lse_unchecked = p.call(causal=False, num_splits=3, return_lse=True, check_inputs=False)
    assert same_bits(o_unchecked, o) and same_bits(lse_unchecked, lse)


def test_kvcache_softmax_scale():
    p = split_problem("fp16")
    o, lse = p.call(causal=True, softmax_scale=0.3, return_lse=True)
    q, kc, vc, _, _ = p.f32
    o64, lse64, _, _ = _xpref.attention_kvcache64(q, kc, vc, p.seqlens_arg, None, None, p.block_table, True, 0.3)
    o_lowp = _xpref.attention_kvcache_lowp(q, kc, vc, "fp16", p.seqlens_arg, None, None, p.block_table, True, 0.3)
    check_rule("o", _xpref.to_float32(o), o64, o_lowp, 2, "softmax_scale=0.3")
    check_lse(lse, lse64, "softmax_scale=0.3")


def test_appending_twice_continues_the_cache():
    """Decode two steps: the second call's cache_seqlens counts the first call's new key."""
    p = Problem(batch=2, sq=1, hq=4, hkv=1, d=64, dtype="bf16", cache="dense", capacity=200, new_kv=True,
                seqlens="array", guard=False, seed_key=("twice",), cached=[10, 150])
    p.call()
    p.check_caches("first decode step")
    k2, v2 = (randn(p.k.shape, "bf16", 77 + i) for i in range(2))
    seqlens2 = (p.seqlens_arg + 1).astype(cp.int32)
    expected = _xpref.kvcache_append(*p.expected, bits(k2), bits(v2), seqlens2, None)
    o = cuflash.attention_with_kvcache(p.q, p.k_cache, p.v_cache, k=k2, v=v2, cache_seqlens=seqlens2)
    assert same_bits(p.k_cache, expected[0]) and same_bits(p.v_cache, expected[1]), "second append misplaced"
    kc, vc, q32 = (_xpref.to_float32(x) for x in (p.k_cache, p.v_cache, p.q))  # the cache after both steps
    o64, _, _, _ = _xpref.attention_kvcache64(q32, kc, vc, seqlens2 + 1)  # L = cached + 2
    o_lowp = _xpref.attention_kvcache_lowp(q32, kc, vc, "bf16", seqlens2 + 1)
    check_rule("o", _xpref.to_float32(o), o64, o_lowp, 2, "second decode step")


# --- rejected calls write nothing -----------------------------------------------------------------------------------

def rejected_problem():
    """A paged, guarded cache with room for the 2 new keys of every sequence; each REJECTED entry breaks it."""
    return Problem(batch=3, sq=2, hq=4, hkv=2, d=64, dtype="fp16", cache="paged64", capacity=256, new_kv=True,
                   seqlens="array", guard=True, seed_key=("rejected",), cached=[10, 100, 3])


def refresh(p):
    p.inputs_before = {n: bits(x) for n, x in p.named_inputs().items()}


def set_block(p, b, j, value):
    table = p.block_table.get()
    table[b, j] = value
    p.block_table = cp.asarray(table)
    refresh(p)


def _seqlens_over_capacity(p):
    p.seqlens_arg = cp.asarray([10, 255, 3], dtype=cp.int32)  # 255 + S_new = 257 > 256
    refresh(p)
    return {}


def _block_out_of_range(p):
    set_block(p, 1, 1, p.k_cache.shape[0])  # == num_blocks; sequence 1 (102 keys) reads blocks 0 and 1
    return {}


def _block_minus_one_in_use(p):
    set_block(p, 1, 1, -1)
    return {}


def _shared_slot(p):
    p.seqlens_arg = cp.asarray([10, 10, 3], dtype=cp.int32)
    set_block(p, 1, 0, int(p.block_table[0, 0]))  # sequences 0 and 1 would both write rows 10, 11 of one block
    return {}


def _int_seqlens_over_capacity(p):
    p.seqlens_arg = 255
    return {}


def _none_seqlens_with_new_keys(p):
    p.seqlens_arg = None
    return {}


def _k_without_v(p):
    p.v = None
    return {}


def _page_size_40(p):
    """A paged cache of 40-row pages (its content random, guarded): rejected whatever the table says."""
    shape = (12, 40, 2, 64)
    p.guarded = []
    caches = []
    for i in range(2):
        g = guarded(shape, lowp_dtype("fp16"), randn(shape, "fp16", 99 + i))
        p.guarded.append((g, g.snapshot()))
        caches.append(g.view)
    p.k_cache, p.v_cache = caches
    p.block_table = cp.asarray(np.arange(12).reshape(3, 4), dtype=cp.int32)
    refresh(p)
    return {}


def _num_splits_129(p):
    return {"num_splits": 129}


REJECTED = [  # (id, change the problem (returns extra keyword arguments), message fragments)
    ("cache-seqlens-plus-new-over-capacity", _seqlens_over_capacity, ["cache_seqlens[1]=255", "capacity"]),
    ("block-table-entry-num-blocks", _block_out_of_range, ["block_table[1, 1]", "out of range"]),
    ("block-table-minus-one-in-a-used-block", _block_minus_one_in_use, ["block_table[1, 1]=-1", "out of range"]),
    ("two-sequences-write-one-slot", _shared_slot, ["same cache slot"]),
    ("int-cache-seqlens-over-capacity", _int_seqlens_over_capacity, ["cache_seqlens=255", "capacity"]),
    ("cache-seqlens-none-with-new-keys", _none_seqlens_with_new_keys, ["cache_seqlens=None"]),
    ("k-without-v", _k_without_v, ["k", "v", "both or neither"]),
    ("page-size-40", _page_size_40, ["page_size=40", "multiple of 16"]),
    ("num-splits-129", _num_splits_129, ["num_splits=129"]),
]


@pytest.mark.parametrize("change,parts", [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_rejected_call_raises_before_writing_anything(change, parts):
    p = rejected_problem()
    extra = change(p)
    k_cache_before, v_cache_before = bits(p.k_cache), bits(p.v_cache)
    with pytest.raises(ValueError) as e:
        p.call(**extra)
    missing = [part for part in parts if part not in str(e.value)]
    assert not missing, f"message lacks {missing}: {str(e.value)!r}"
    cp.cuda.Device().synchronize()
    assert same_bits(p.k_cache, k_cache_before) and same_bits(p.v_cache, v_cache_before), "the cache was written"
    for i, (g, snap) in enumerate(p.guarded):
        assert g.unchanged(snap), f"{('k_cache', 'v_cache')[i]} buffer changed (view or guard bytes)"
    for name, x in p.named_inputs().items():
        assert same_bits(x, p.inputs_before[name]), f"{name} was modified by a rejected call"
