"""KV-cache decoding with FlashAttention-2's further arguments on the GPU: the rotary embedding (rotary_cos,
rotary_sin, rotary_interleaved), cache_batch_idx, cache_leftpad, window, alibi_slopes and softcap, each alone and
all together, with dense and paged caches (page sizes 16, 48, 64, 80, 256), GQA, split-KV, appended keys, causal or
not, fp16 and bf16, against the float64 reference (cuflash._xpref.attention_kvcache64, the math of
cuflash.reference, of q and the new keys as the kernel rotates them: rounded to the dtype) with the pass rule of
docs/RELIABILITY.md (o within 2x the low-precision error + 1e-5, lse within 1e-3, o = 0 and lse = -inf exactly where
a row sees no key).

The caches afterwards: bit for bit the expected caches (the new keys and values in their cache rows, everything
else as before), except that a new key row written with the rotary embedding may differ from the reference's
rotation (float32 products, rounded once to the dtype: cuflash.reference.apply_rotary) by one unit in the last
place of the dtype; that row is compared by value, with float32's own evaluation error added where the two
products of a pair cancel (a fused multiply-add rounds one product less). Nothing outside the caches' views
changes (NaN-guarded buffers); q, k, v, the rotary tables, the index arrays and the slopes keep their bits; a
rejected call writes nothing.

Semantics under test (cuflash.reference's module docstring, KV cache): cache_seqlens[b] is the cache row where
sequence b's new keys go; cache_batch_idx[b] the dense cache entry batch entry b reads and writes; sequence b's keys
are cache rows [cache_leftpad[b], cache_seqlens[b] + S_new), L_b of them, and causal, the window and ALiBi count
key j from cache_leftpad[b] (diag = L_b - Sq); the first rotary_dim dims of q and of the new keys are rotated, new
key s at position cache_seqlens[b] + s, query i at cache_seqlens[b] + i with causal or a window, else at
cache_seqlens[b]."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _xpref, config, reference  # noqa: E402
from gpu_helpers import (DTYPES, bits, check_lse, check_rule, max_abs, poison_pool, randn, round_up,  # noqa: E402
                         same_bits, seed_of, warm_kernel_cache)
from reliability_helpers import guarded, lowp_dtype  # noqa: E402

pytestmark = pytest.mark.gpu


def decode_mod_configs():
    """The decode kernels of every combination of window, ALiBi and softcap at the grid's head dims 64 and 128 (a
    window kernel carries causal itself, so causal kernels take ALiBi and the softcap only)."""
    bits = (config.MOD_WINDOW, config.MOD_ALIBI, config.MOD_SOFTCAP)
    combos = sorted({sum(c) for n in range(len(bits) + 1) for c in itertools.combinations(bits, n)})
    return [config.fwd_decode_config(hd, dtype, causal, mods) for hd in (64, 128) for dtype in DTYPES
            for causal in (False, True) for mods in combos if not (causal and mods & config.MOD_WINDOW)]


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    warm_kernel_cache(config.all_fwd_configs() + decode_mod_configs())


def bits_to_float32(u16, dtype: str):
    """float32 values of fp16 / bf16 bit patterns (uint16)."""
    if dtype == "fp16":
        return u16.view(cp.float16).astype(cp.float32)
    return (u16.astype(cp.uint32) << cp.uint32(16)).view(cp.float32)


def ulp(x, dtype: str):
    """The spacing of dtype numbers at |x| (fp16: 10 fraction bits, 2^-24 below 2^-14; bf16: 7 fraction bits)."""
    frac, smallest = (10, -14) if dtype == "fp16" else (7, -126)
    return cp.exp2(cp.floor(cp.log2(cp.maximum(cp.abs(x), 2.0 ** smallest))) - frac)


def pair_magnitude(x32, rotary_dim: int, interleaved: bool):
    """|x1| + |x2| of the rotated pair of every element of x32 (0 past rotary_dim)."""
    first, second = reference.rotary_pairs(rotary_dim, interleaved)
    out = cp.zeros_like(x32)
    m = cp.abs(x32[..., first]) + cp.abs(x32[..., second])
    out[..., first], out[..., second] = m, m
    return out


class Problem:
    """One attention_with_kvcache call with FlashAttention-2's further arguments: the inputs (caches dense or paged,
    optionally inside NaN-guarded buffers), the keyword arguments, the expected caches after the call and the
    rotated new keys (computed before it).

    cached: the keys already in each sequence's cache (cache_seqlens); seqlens "array" (int32 (B,)), "int" (every
    entry of cached equal) or "none" (full caches, no new keys). batch_idx: cache entries of a dense cache with
    max(batch_idx) + 2 entries. leftpad: cache_leftpad (the paged table's blocks wholly before it are -1).
    rotary: (rotary_dim, interleaved, "fp32" or the dtype for the tables, extra rows past the capacity).
    alibi: "h" (slopes (H_q,)) or "bh" ((B, H_q))."""

    def __init__(self, *, sq, hq, hkv, d, dtype, cache, capacity, new_kv, cached, seed_key, batch=3, seqlens="array",
                 guard=True, batch_idx=None, leftpad=None, rotary=None, window=None, alibi=None, softcap=None):
        rng = np.random.default_rng(seed_of("kvcache-features", *seed_key))
        seed = seed_of("kvcache-features-data", *seed_key)
        self.dtype, self.batch, self.sq, self.hq, self.d = dtype, batch, sq, hq, d
        self.s_new = sq if new_kv else 0
        self.page = None if cache == "dense" else int(cache[len("paged"):])
        assert len(cached) == batch and all(0 <= c <= capacity - self.s_new for c in cached), (cached, capacity)
        self.cached = [int(c) for c in cached]
        if seqlens == "array":
            self.seqlens_arg = cp.asarray(self.cached, dtype=cp.int32)
        elif seqlens == "int":
            assert len(set(self.cached)) == 1, cached
            self.seqlens_arg = self.cached[0]
        else:
            assert seqlens == "none" and not new_kv and self.cached == [capacity] * batch
            self.seqlens_arg = None
        self.leftpad = [0] * batch if leftpad is None else [int(x) for x in leftpad]
        assert all(0 <= p <= c for p, c in zip(self.leftpad, self.cached)), (leftpad, cached)
        self.leftpad_arg = None if leftpad is None else cp.asarray(self.leftpad, dtype=cp.int32)
        self.lengths = [c + self.s_new - p for c, p in zip(self.cached, self.leftpad)]  # L_b

        self.batch_idx_arg = None if batch_idx is None else cp.asarray(batch_idx, dtype=cp.int32)
        if self.page is None:
            entries = batch if batch_idx is None else max(batch_idx) + 2  # one entry no sequence uses
            cache_shape = (entries, capacity, hkv, d)
            self.block_table = None
        else:
            assert batch_idx is None and capacity % self.page == 0
            max_blocks = capacity // self.page
            num_blocks = batch * max_blocks + 5  # spare blocks that no sequence uses: they must stay untouched
            table = rng.permutation(num_blocks)[:batch * max_blocks].reshape(batch, max_blocks)
            for b, (first, stop) in enumerate(zip(self.leftpad, (c + self.s_new for c in self.cached))):
                table[b, -(-stop // self.page):] = -1  # past the last block a sequence reads: anything
                table[b, :first // self.page] = -1  # wholly before its first key: anything
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

        self.rotary = rotary
        self.cos = self.sin = None
        if rotary is not None:
            rotary_dim, interleaved, table_dtype, extra_rows = rotary
            angles = cp.asarray(rng.uniform(-np.pi, np.pi, (capacity + extra_rows, rotary_dim // 2)))
            self.cos, self.sin = (_xpref.to_lowp(f(angles), table_dtype) for f in (cp.cos, cp.sin))
        self.window, self.softcap = window, softcap
        self.slopes = None
        if alibi is not None:
            shape = (hq,) if alibi == "h" else (batch, hq)
            self.slopes = cp.asarray(rng.random(shape) * 0.3, dtype=cp.float32)
        self.expect()

    def expect(self):
        """The expected caches and the float inputs of the references, from the arrays before the call."""
        self.k_written = None
        if self.k is not None:
            self.k_written = self.k
            if self.rotary is not None:  # the reference's rotation: float32 products, rounded once to the dtype
                rotary_dim, interleaved = self.rotary[:2]
                positions = np.asarray(self.cached)[:, None] + np.arange(self.s_new)
                k32 = _xpref.to_float32(self.k)
                self.k_rotated = _xpref.apply_rotary(k32, self.cos, self.sin, positions, interleaved, self.dtype)
                self.slack = 2.0 ** -22 * pair_magnitude(k32, rotary_dim, interleaved)  # float32's error, cancelling
                self.k_written = _xpref.to_lowp(self.k_rotated, self.dtype)
        new_bits = (None, None) if self.k is None else (bits(self.k_written), bits(self.v))
        self.expected = _xpref.kvcache_append(bits(self.k_cache), bits(self.v_cache), *new_bits, self.seqlens_arg,
                                              self.block_table, cache_batch_idx=self.batch_idx_arg)
        self.f32 = [None if x is None else _xpref.to_float32(x) for x in (self.q, self.k_cache, self.v_cache,
                                                                          self.k, self.v)]
        self.inputs_before = {n: bits(x) for n, x in self.named_inputs().items()}

    def options(self):
        """The call's keyword arguments of FlashAttention-2's kvcache interface (those that are set)."""
        kw = dict(cache_batch_idx=self.batch_idx_arg, cache_leftpad=self.leftpad_arg, rotary_cos=self.cos,
                  rotary_sin=self.sin, window=self.window, alibi_slopes=self.slopes, softcap=self.softcap)
        if self.rotary is not None:
            kw["rotary_interleaved"] = self.rotary[1]
        return {n: x for n, x in kw.items() if x is not None}

    def named_inputs(self):
        named = {"q": self.q, "k": self.k, "v": self.v, "cache_seqlens": self.seqlens_arg,
                 "block_table": self.block_table, "cache_batch_idx": self.batch_idx_arg,
                 "cache_leftpad": self.leftpad_arg, "rotary_cos": self.cos, "rotary_sin": self.sin,
                 "alibi_slopes": self.slopes}
        return {n: x for n, x in named.items() if isinstance(x, cp.ndarray)}

    def call(self, **kw):
        return cuflash.attention_with_kvcache(self.q, self.k_cache, self.v_cache, k=self.k, v=self.v,
                                              cache_seqlens=self.seqlens_arg, block_table=self.block_table,
                                              **self.options(), **kw)

    def references(self, causal):
        q, kc, vc, k, v = self.f32
        kw = self.options()
        args = (self.seqlens_arg, k, v, self.block_table, causal)
        o64, lse64, _, _ = _xpref.attention_kvcache64(q, kc, vc, *args, **kw, rotary_dtype=self.dtype)
        o_lowp = _xpref.attention_kvcache_lowp(q, kc, vc, self.dtype, *args, **kw)
        return o64, lse64, o_lowp

    def poison(self, num_splits):
        """Poison room for o, lse, the rotated copy of q and the split-KV partial results."""
        rows = self.batch * self.sq * self.hq
        splits = num_splits or 128  # 0: the heuristic may pick up to 128
        poison_pool(2 * round_up(self.q.nbytes) + round_up(rows * 4) + round_up(splits * rows * (self.d + 1) * 4)
                    + (1 << 20))

    def describe(self):
        batch_idx = None if self.batch_idx_arg is None else self.batch_idx_arg.tolist()
        return (f"cached={self.cached} leftpad={self.leftpad} L={self.lengths} cache_batch_idx={batch_idx} "
                f"rotary={self.rotary} window={self.window} alibi={None if self.slopes is None else self.slopes.shape} "
                f"softcap={self.softcap}")

    def new_key_slots(self, b):
        return _xpref.kvcache_slots(cp, b, cp.arange(self.cached[b], self.cached[b] + self.s_new),
                                    self.k_cache.shape, self.block_table, cache_batch_idx=self.batch_idx_arg)

    def check_caches(self, what):
        """The caches hold the expected bits (a rotated new key row: within one ulp of the reference's rotation),
        nothing outside the cache views changed, and the other inputs are bit for bit as given."""
        rotated = self.rotary is not None and self.k is not None
        for name, x, want in (("k_cache", self.k_cache, self.expected[0]), ("v_cache", self.v_cache, self.expected[1])):
            wrong = bits(x) != want
            if rotated and name == "k_cache":  # the new key rows: compared by value below
                for b in range(self.batch):
                    wrong[self.new_key_slots(b)] = False
            if bool(wrong.any()):
                where = [tuple(int(i) for i in idx) for idx in cp.argwhere(wrong)[:4].get()]
                raise AssertionError(f"{name} differs from the expected cache at {int(wrong.sum())} elements, first "
                                     f"(block/entry, row, head, dim) {where}, for {what}")
        if rotated:
            got_bits = bits(self.k_cache)
            for b in range(self.batch):
                got = bits_to_float32(got_bits[self.new_key_slots(b)], self.dtype)
                want = self.k_rotated[b]
                err = cp.abs(got - want)
                bound = ulp(cp.maximum(cp.abs(got), cp.abs(want)), self.dtype) + self.slack[b]
                bad = ~(err <= bound)
                if bool(bad.any()):
                    s, h, dim = (int(i) for i in cp.argwhere(bad)[0].get())
                    raise AssertionError(
                        f"rotated new key {s} of sequence {b} (head {h}, dim {dim}) is {float(got[s, h, dim])!r}, the "
                        f"reference's rotation {float(want[s, h, dim])!r}: more than one ulp apart "
                        f"({int(bad.sum())} elements) for {what}")
        for i, (g, snap) in enumerate(self.guarded):
            assert g.outside_unchanged(snap), f"{('k_cache', 'v_cache')[i]}: bytes outside the view changed, {what}"
        for name, x in self.named_inputs().items():
            assert same_bits(x, self.inputs_before[name]), f"{name} was modified, {what}"


def check_outputs(p, o, lse, causal, what):
    assert o.shape == p.q.shape and o.dtype == p.q.dtype, f"o is {o.shape} {o.dtype} for {what}"
    assert lse.shape == (p.batch, p.hq, p.sq) and lse.dtype == cp.float32, f"lse is {lse.shape} {lse.dtype} for {what}"
    o64, lse64, o_lowp = p.references(causal)
    o32 = _xpref.to_float32(o)
    check_rule("o", o32, o64, o_lowp, 2, what)
    check_lse(lse, lse64, what)
    masked = ~cp.isfinite(lse64).transpose(0, 2, 1)  # (B, Sq, H_q): rows that see no key
    assert max_abs(cp.where(masked[..., None], o32, 0.0)) == 0.0, f"rows that see no key must be 0 for {what}"
    return lse64


def run_and_check(p, causal, num_splits, what):
    p.poison(num_splits)
    o, lse = p.call(causal=causal, num_splits=num_splits, return_lse=True)
    lse64 = check_outputs(p, o, lse, causal, what)
    p.check_caches(what)
    return o, lse, lse64


# --- the grid: each new argument alone, then all together, over the cache kinds ---------------------------------

FEATURES = ("batch_idx", "leftpad", "rotary_gptj", "rotary_neox", "window", "alibi", "softcap", "all")
CACHES = ("dense", "paged16", "paged48", "paged64", "paged80", "paged256")
CAPACITY = {"dense": 1000, "paged16": 1024, "paged48": 1008, "paged64": 1024, "paged80": 1040, "paged256": 2048}
WINDOWS = [(16, 0), (5, 3), (-1, 8), (40, -1), (0, 0), (100, 20)]


def grid():
    """Per feature one case per cache kind (cache_batch_idx: dense caches only, four cases), new keys or not x
    causal or not cycling over them (the rotary embedding always appends); Sq, num_splits, the GQA ratio, dtype,
    head dim, cache_seqlens kind and guard buffers cycle too (the test below checks that each feature meets every
    value of each)."""
    cases, n = [], 0
    for feature in FEATURES:
        caches = ("dense",) * 4 if feature == "batch_idx" else CACHES
        for i, cache in enumerate(caches):
            new_kv, causal = ((True, False), (False, True), (True, True), (False, False))[i % 4]
            rotary = feature.startswith("rotary") or feature == "all"
            cases.append(dict(feature=feature, cache=cache, new_kv=new_kv or rotary, causal=causal,
                              sq=(1, 4, 16)[(i + n) % 3], num_splits=(0, 1, 7)[n % 3], ratio=(1, 4)[(n // 2) % 2],
                              dtype=DTYPES[(n // 3) % 2], d=(64, 128)[(i // 2) % 2],
                              seqlens=("array", "array", "int")[n % 3], guard=n % 2 == 0, index=i))
            n += 1
    return cases


GRID = grid()


def case_id(c):
    return (f"{c['feature']}-{c['cache']}-sq{c['sq']}-{'new' if c['new_kv'] else 'read'}-"
            f"{'causal' if c['causal'] else 'full'}-splits{c['num_splits']}-gqa{c['ratio']}-{c['seqlens']}-"
            f"{c['dtype']}-d{c['d']}" + ("-guarded" if c["guard"] else ""))


def feature_problem(c, *, hq=None, d=None, dtype=None):
    """The Problem of grid case c: its feature's arguments (everything for "all"), on a cache of its kind."""
    feature, i = c["feature"], c["index"]
    d = d or c["d"]
    dtype = dtype or c["dtype"]
    capacity = CAPACITY[c["cache"]]
    s_new = c["sq"] if c["new_kv"] else 0
    rng = np.random.default_rng(seed_of("kvcache-features-case", case_id(c), d, dtype))
    hi = capacity - s_new
    if c["seqlens"] == "int":
        cached = [int(rng.integers(1, hi))] * 3
    else:
        cached = [int(x) for x in rng.permutation([0, hi, int(rng.integers(1, hi))])]
    every = feature == "all"
    kw = {}
    if feature == "batch_idx" or (every and c["cache"] == "dense"):
        kw["batch_idx"] = ([4, 0, 2], [3, 3, 0])[0 if c["new_kv"] else i % 2]  # repeats only without new keys
    if feature == "leftpad" or every:
        kw["leftpad"] = [int(rng.integers(0, x + 1)) for x in cached]
        kw["leftpad"][i % 3] = cached[i % 3]  # no cached key left: L_b = S_new (0 without new keys)
    if feature.startswith("rotary") or every:
        rotary_dim = (d // 2, d, 16)[i % 3]
        interleaved = feature != "rotary_neox" and not (every and i % 2)
        kw["rotary"] = (rotary_dim, interleaved, ("fp32", dtype)[(i // 2) % 2], (0, 3)[i % 2])
    if feature == "window" or every:
        kw["window"] = WINDOWS[i % len(WINDOWS)]
    if feature == "alibi" or every:
        kw["alibi"] = ("h", "bh")[i % 2]
    if feature == "softcap" or every:
        kw["softcap"] = (2.5, 10.0, 30.0)[i % 3]
    return Problem(sq=c["sq"], hq=(hq or 2 * c["ratio"]), hkv=2, d=d, dtype=dtype, cache=c["cache"],
                   capacity=capacity, new_kv=c["new_kv"], cached=cached, seed_key=(case_id(c), d, dtype),
                   seqlens=c["seqlens"], guard=c["guard"], **kw)


def test_the_grid_covers_every_option_with_every_feature():
    for feature in FEATURES:
        mine = [c for c in GRID if c["feature"] == feature]
        caches = {"dense"} if feature == "batch_idx" else set(CACHES)
        assert {c["cache"] for c in mine} == caches, feature
        for key, values in (("num_splits", {0, 1, 7}), ("ratio", {1, 4}), ("dtype", set(DTYPES)), ("d", {64, 128}),
                            ("causal", {False, True}), ("sq", {1, 4, 16}), ("guard", {False, True})):
            assert {c[key] for c in mine} == values, f"{feature}: {key} covers only {sorted({c[key] for c in mine})}"
        want_new = {True} if feature.startswith("rotary") or feature == "all" else {False, True}
        assert {c["new_kv"] for c in mine} == want_new, feature


@pytest.mark.parametrize("case", GRID, ids=[case_id(c) for c in GRID])
def test_kvcache_feature_matches_reference_and_writes_exactly_the_new_rows(case):
    p = feature_problem(case)
    run_and_check(p, case["causal"], case["num_splits"], f"{case_id(case)} {p.describe()}")


# --- head dims 32, 96, 192 and 256, every argument at once ---------------------------------------------------------
# (with cache_leftpad, every paged cache here has its key tiles gathered row by row across pages)

@pytest.mark.parametrize("cache,d,dtype,causal", [("paged64", 256, "fp16", True), ("dense", 96, "bf16", False),
                                                  ("paged80", 96, "fp16", False), ("paged16", 32, "bf16", False),
                                                  ("paged48", 192, "fp16", True), ("paged16", 256, "bf16", False)])
def test_kvcache_features_at_head_dims_32_to_256(cache, d, dtype, causal):
    c = dict(feature="all", cache=cache, new_kv=True, causal=causal, sq=4, num_splits=0, ratio=4, dtype=dtype, d=d,
             seqlens="array", guard=True, index=1)
    p = feature_problem(c)
    run_and_check(p, causal, 0, f"all features, {cache} D={d} {dtype} causal={causal} {p.describe()}")


# --- windows that leave rows without a visible key ---------------------------------------------------------------

@pytest.mark.parametrize("window,causal,leftpad", [((0, 0), False, None), ((2, 0), True, [0, 3, 500]),
                                                   ((3, 1), False, [1, 0, 502])])
@pytest.mark.parametrize("cache", ["dense", "paged48"])
def test_window_rows_without_keys_give_zero_and_minus_inf(window, causal, leftpad, cache):
    """Sq = 16 queries over L_b < 16 keys (3 cached, none, or few left after the padding; no new keys): the first
    query rows' windows end before key 0, so they see no key."""
    p = Problem(sq=16, hq=8, hkv=2, d=64, dtype="bf16", cache=cache, capacity=1008, new_kv=False,
                cached=[3, 7, 505] if leftpad else [3, 7, 0],
                seed_key=("empty-rows", window, causal, str(leftpad), cache),
                leftpad=leftpad, window=window, alibi="h")
    what = f"{cache} causal={causal} {p.describe()}"
    for splits in (0, 1, 7):
        _, lse, lse64 = run_and_check(p, causal, splits, f"{what} num_splits={splits}")
        assert bool((~cp.isfinite(lse64)).any()), f"no row without a visible key: the test is vacuous, {what}"


# --- split-KV over every argument at once; a second call repeats bitwise -------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_every_num_splits_gives_the_reference_result_with_every_argument(dtype):
    c = dict(feature="all", cache="paged16", new_kv=True, causal=True, sq=3, num_splits=0, ratio=4, dtype=dtype,
             d=128, seqlens="array", guard=False, index=2)
    p = feature_problem(c)
    for splits in (0, 1, 2, 7, 16, 128):
        what = f"num_splits={splits} {dtype} {p.describe()}"
        o, lse, _ = run_and_check(p, True, splits, what)
        o2, lse2 = p.call(causal=True, num_splits=splits, return_lse=True)  # the same append again: same bits
        assert same_bits(o, o2) and same_bits(lse, lse2), f"a second run differs, {what}"
        p.check_caches(f"second run, {what}")


@pytest.mark.parametrize("causal,window", [(False, None), (False, (-1, -1)), (False, (-1, 0)), (False, (6, -1)),
                                           (True, None), (True, (-1, -1))])
def test_rotary_query_positions_follow_causal_and_the_window(causal, window):
    """Query i rotates at cache_seqlens[b] + i with causal or a window that bounds a side ((-1, 0) is causal
    itself), else every query at cache_seqlens[b] ((-1, -1) is no window): 8 queries, both sides of the rule."""
    p = Problem(sq=8, hq=4, hkv=2, d=64, dtype="bf16", cache="paged16", capacity=256, new_kv=True,
                cached=[0, 37, 248], seed_key=("rotary-q", causal, str(window)), rotary=(64, True, "fp32", 0),
                window=window)
    run_and_check(p, causal, 0, f"rotary causal={causal} {p.describe()}")


def test_rotary_tables_in_q_dtype_and_float32_agree_with_their_reference():
    """The same angles as fp16 tables and as float32 tables: each call matches the reference of its own tables."""
    for table_dtype in ("fp32", "fp16"):
        p = Problem(sq=2, hq=4, hkv=1, d=128, dtype="fp16", cache="paged64", capacity=512, new_kv=True,
                    cached=[0, 77, 510], seed_key=("tables",), rotary=(64, False, table_dtype, 0))
        run_and_check(p, False, 0, f"rotary tables {table_dtype}")


# --- rejected calls write nothing -----------------------------------------------------------------------------------

def rejected_problem(cache):
    """A guarded cache with every argument set and valid (cache_batch_idx on the dense one); each REJECTED entry
    breaks one."""
    return Problem(sq=2, hq=4, hkv=2, d=64, dtype="fp16", cache=cache, capacity=256, new_kv=True,
                   cached=[10, 100, 3], seed_key=("rejected", cache), batch_idx=[3, 0, 1] if cache == "dense" else None,
                   leftpad=[2, 50, 0], rotary=(32, True, "fp32", 0), window=(64, 0), alibi="h", softcap=20.0)


def refresh(p):
    p.inputs_before = {n: bits(x) for n, x in p.named_inputs().items()}


def _set(**attrs):
    def change(p):
        for name, value in attrs.items():
            setattr(p, name, value(p) if callable(value) else value)
        refresh(p)
        return {}
    return change


def _int32(values):
    return lambda p: cp.asarray(values, dtype=cp.int32)


def _tables(rows, half, dtype="float32"):
    return lambda p: cp.ones((rows, half), dtype=dtype)


def _page_size_40(p):
    """A paged cache of 40-row pages (random, guarded): rejected whatever the table says."""
    shape = (12, 40, 2, 64)
    p.guarded = []
    caches = []
    for i in range(2):
        g = guarded(shape, lowp_dtype("fp16"), randn(shape, "fp16", 99 + i))
        p.guarded.append((g, g.snapshot()))
        caches.append(g.view)
    p.k_cache, p.v_cache = caches
    p.block_table = cp.asarray(np.arange(12).reshape(3, 4), dtype=cp.int32)
    p.cos, p.sin = (cp.ones((160, 16), dtype=cp.float32) for _ in range(2))
    refresh(p)
    return {}


REJECTED = [  # (id, cache kind, change the problem (returns extra keyword arguments), message fragments)
    ("batch-idx-out-of-range", "dense", _set(batch_idx_arg=_int32([0, 5, 1])),
     ["cache_batch_idx[1]=5"]),
    ("batch-idx-repeated-with-new-keys", "dense", _set(batch_idx_arg=_int32([2, 0, 2])),
     ["cache_batch_idx[0]=2", "cache_batch_idx[2]=2"]),
    ("batch-idx-with-block-table", "paged64", _set(batch_idx_arg=_int32([0, 1, 2])),
     ["cache_batch_idx", "block_table"]),
    ("leftpad-over-cache-seqlens", "paged64", _set(leftpad_arg=_int32([2, 101, 0])),
     ["cache_leftpad[1]=101"]),
    ("leftpad-negative", "dense", _set(leftpad_arg=_int32([2, 0, -1])), ["cache_leftpad[2]=-1"]),
    ("rotary-without-new-keys", "paged64", _set(k=None, v=None), ["rotary_cos", "k and v"]),
    ("rotary-dim-24", "dense", _set(cos=_tables(256, 12), sin=_tables(256, 12)), ["rotary_dim=24"]),
    ("rotary-dim-over-head-dim", "paged64", _set(cos=_tables(256, 40), sin=_tables(256, 40)), ["rotary_dim=80"]),
    ("cos-sin-shapes-differ", "dense", _set(sin=_tables(256, 8)), ["rotary_sin", "rotary_cos", "(256, 8)"]),
    ("seqlen-ro-under-capacity", "paged64", _set(cos=_tables(255, 16), sin=_tables(255, 16)),
     ["rotary_cos", "seqlen_ro=255"]),
    ("cos-float64", "dense", _set(cos=_tables(256, 16, "float64"), sin=_tables(256, 16, "float64")),
     ["rotary_cos", "float64"]),
    ("window-left-minus-2", "paged64", _set(window=(-2, 0)), ["window", "-2"]),
    ("softcap-0", "dense", _set(softcap=0), ["softcap=0"]),
    ("alibi-slopes-shape", "paged64", _set(slopes=lambda p: cp.ones(5, dtype=cp.float32)), ["alibi_slopes", "(5,)"]),
    ("page-size-40", "paged64", _page_size_40, ["page_size=40"]),
]


@pytest.mark.parametrize("cache,change,parts", [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_rejected_call_raises_before_writing_anything(cache, change, parts):
    p = rejected_problem(cache)
    extra = change(p)
    k_cache_before, v_cache_before = bits(p.k_cache), bits(p.v_cache)
    with pytest.raises((ValueError, TypeError)) as e:
        p.call(**extra)
    missing = [part for part in parts if part not in str(e.value)]
    assert not missing, f"message lacks {missing}: {str(e.value)!r}"
    cp.cuda.Device().synchronize()
    assert same_bits(p.k_cache, k_cache_before) and same_bits(p.v_cache, v_cache_before), "the cache was written"
    for i, (g, snap) in enumerate(p.guarded):
        assert g.unchanged(snap), f"{('k_cache', 'v_cache')[i]} buffer changed (view or guard bytes)"
    for name, x in p.named_inputs().items():
        assert same_bits(x, p.inputs_before[name]), f"{name} was modified by a rejected call"


@pytest.mark.parametrize("cache", ["dense", "paged64"])
def test_the_rejected_problems_themselves_are_accepted(cache):
    """Each REJECTED entry breaks one argument of a call that passes as given."""
    p = rejected_problem(cache)
    run_and_check(p, False, 0, f"the valid rejected_problem({cache!r})")


def test_the_rejection_table_names_every_argument():
    ids = [c[0] for c in REJECTED]
    assert len(ids) == len(set(ids))
    text = " ".join(" ".join(c[3]) for c in REJECTED)
    for name in ("cache_batch_idx", "cache_leftpad", "rotary_cos", "rotary_sin", "rotary_dim", "window", "softcap",
                 "alibi_slopes", "page_size"):
        assert name in text, name

