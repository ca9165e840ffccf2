"""Large random sweep: 2000 seeded configurations, forward and backward, each against the float64 and
the low-precision reference computed on the GPU, with the pass rule of docs/RELIABILITY.md:
    max|out - ref64| <= 2 * max|out_lowp - ref64| + 1e-5  (o),   factor 3 for dq, dk, dv,   lse within 1e-3.

Marker `gpu_slow`: not part of the default run nor of `-m gpu` (tests/conftest.py skips it unless the marker
expression names gpu_slow). Run it, with the table of worst ratios per feature printed at the end:

    python -m pytest -m gpu_slow tests/test_gpu_sweep.py -q -s

Each configuration draws batch 1-3, heads 1-4 (with grouped-query K/V heads for a third of them), seqlens
1..4096 (log-uniform and uniform, edge values around powers of two, primes), head dims (multiples of 8 up to
256), fp16/bf16, causal, layout, deterministic mode, softmax_scale, the entry point (dense forward + backward;
varlen forward + backward on packed sequences of random lengths, 0 included, for 10%; kv-cache decoding, dense
or paged cache, split-KV, with or without appended keys, for 10%), score modifiers (half of the dense
configurations of at most 2^14 scores: sliding window, ALiBi, softcap, dropout, alone or combined, checked
against the NumPy reference with the dropout mask of cuflash.philox), and strides (dense): inputs as views inside NaN-poisoned buffers with random padding and axis order
(guard bands: the buffers must come back unchanged and a read outside a view would bring NaN into the
results), or head-dim offsets that are not 16-byte aligned (the library copies those); dq/dk/dv preallocated
inside poisoned buffers for a third of the configurations. Most configurations are small; about 8% have
seqlens above 1300 (batch * heads * Sq * Sk is capped at 2^26 so the float64 reference fits in memory).
The GPU work is small (about 5e9 attention scores in all, a few seconds of references); the time goes to
Python and CuPy call overhead, about 5-10 ms per configuration.

Reproducible: the configurations and their data depend only on CUFLASH_SWEEP_SEED (default 20261108);
CUFLASH_SWEEP_COUNT changes how many (default 2000); `-k 0123-` reruns configuration 123.
CUFLASH_SWEEP_REPORT=path.json also writes the per-feature table there.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cuflash  # noqa: E402
from cuflash import _xpref, config, philox  # noqa: E402
from cuflash import reference as refmod  # noqa: E402
from cuflash.check import compile_configs  # noqa: E402
from gpu_helpers import max_abs, poison_pool, randn, round_up, seed_of, to_bshd32  # noqa: E402
from reliability_helpers import guarded, lowp_dtype  # noqa: E402

pytestmark = pytest.mark.gpu_slow

SEED = int(os.environ.get("CUFLASH_SWEEP_SEED", "20261108"))
COUNT = int(os.environ.get("CUFLASH_SWEEP_COUNT", "2000"))
MAX_SCORES = 1 << 26  # batch * heads * seqlen_q * seqlen_k: a float64 (B, H, Sq, Sk) array is 512 MiB at most
MAX_MOD_SCORES = 1 << 14  # modifier configurations: the NumPy reference runs on the host (einsum, not BLAS)

PRIMES = [2, 3, 5, 7, 11, 13, 17, 31, 61, 101, 127, 211, 257, 509, 521, 1021, 1031, 2039, 2053, 3067, 4093]
EDGES = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1023, 1024,
         1025, 2047, 2048, 2049, 4095, 4096]
SIZES = {"small": (1, 300), "medium": (301, 1300), "large": (1301, 4096)}
STRIDES = ("contiguous", "guarded", "guarded-permuted", "misaligned")


MODES = ("dense", "varlen", "kvcache")


@dataclass(frozen=True)
class SweepConfig:
    idx: int
    batch: int
    seqlen_q: int           # varlen: the longest query sequence; kvcache: new query tokens per sequence
    seqlen_k: int           # varlen: the longest key sequence; kvcache: cache capacity per sequence
    heads: int
    head_dim: int
    dtype: str
    causal: bool
    layout: str
    deterministic: bool
    strides: str            # one of STRIDES (for q, k, v, dout, out)
    preallocated: bool      # dq, dk, dv given as views inside poisoned buffers
    softmax_scale: float | None
    size: str               # the seqlen class the configuration was drawn from
    kv_heads: int = 0       # K/V heads (grouped-query attention); 0: heads
    mode: str = "dense"     # one of MODES
    paged: bool = False     # kvcache: a paged cache (64-key pages, shuffled)
    splits: int = 0         # kvcache: num_splits
    append: bool = False    # kvcache: new keys/values appended (S_new = seqlen_q)
    window: tuple | None = None  # dense: sliding window (left, right)
    alibi: str = ""         # dense: ALiBi slopes "h" (heads,) or "bh" (batch, heads); "" none
    softcap: float | None = None
    dropout_p: float = 0.0

    @property
    def heads_kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def id(self) -> str:
        return (f"{self.idx:04d}-{self.dtype}-d{self.head_dim}-{self.seqlen_q}x{self.seqlen_k}-b{self.batch}h{self.heads}-"
                + (f"kv{self.kv_heads}-" if self.kv_heads else "")
                + f"{'causal' if self.causal else 'full'}-"
                + (f"{self.layout}-{self.strides}" if self.mode == "dense" else self.mode)
                + ("-paged" if self.paged else "") + (f"-split{self.splits}" if self.splits else "")
                + ("-append" if self.append else "")
                + ("-det" if self.deterministic else "") + ("-prealloc" if self.preallocated else "")
                + (f"-window{self.window[0]},{self.window[1]}" if self.window else "")
                + (f"-alibi{self.alibi}" if self.alibi else "") + (f"-softcap{self.softcap:g}" if self.softcap else "")
                + (f"-dropout{self.dropout_p:g}" if self.dropout_p else "")
                + (f"-scale{self.softmax_scale:.3f}" if self.softmax_scale is not None else ""))

    def features(self) -> dict:
        """The feature values this configuration reports its ratios under."""
        khd = config.kernel_head_dim(self.head_dim)
        rel = "Sq=Sk" if self.seqlen_q == self.seqlen_k else ("Sq<Sk" if self.seqlen_q < self.seqlen_k else "Sq>Sk")
        out = {"dtype": self.dtype, "kernel head dim": str(khd),
               "head dim": "kernel's own" if self.head_dim == khd else "zero-padded",
               "causal": str(self.causal), "entry point": self.mode,
               "query heads / K/V head": str(self.heads // self.heads_kv),
               "softmax_scale": "default" if self.softmax_scale is None else "custom", "size": self.size}
        if self.mode == "dense":
            mods = [n for n, on in (("window", self.window), ("alibi", self.alibi), ("softcap", self.softcap),
                                    ("dropout", self.dropout_p)) if on]
            out["score modifiers"] = "+".join(mods) if mods else "none"
            out.update({"layout": self.layout, "Sq vs Sk": rel, "strides": self.strides,
                        "preallocated dq/dk/dv": str(self.preallocated)})
        if self.mode != "kvcache":
            out["deterministic"] = str(self.deterministic)
        else:
            out.update({"kv cache": "paged" if self.paged else "dense", "num_splits": str(self.splits),
                        "appended k/v": str(self.append)})
        return out


def _seqlen(rng, size: str) -> int:
    lo, hi = SIZES[size]
    r = rng.random()
    pool = PRIMES if r < 0.2 else EDGES if r < 0.4 else None
    if pool is not None:
        candidates = [x for x in pool if lo <= x <= hi]
        if candidates:
            return int(rng.choice(candidates))
    if r < 0.7:  # log-uniform: plenty of short sequences
        return int(min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))
    return int(rng.integers(lo, hi + 1))


def _draw(rng, idx: int) -> SweepConfig:
    size = rng.choice(["small", "medium", "large"], p=[0.72, 0.20, 0.08])
    sq = _seqlen(rng, size)
    r = rng.random()
    sk = sq if r < 0.3 else _seqlen(rng, size if r < 0.8 else str(rng.choice(list(SIZES))))
    b, h = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    while b * h * sq * sk > MAX_SCORES and b * h > 1:
        if h > 1:
            h -= 1
        else:
            b -= 1
    d = int(rng.choice(config.KERNEL_HEAD_DIMS)) if rng.random() < 0.55 else 8 * int(rng.integers(1, 33))
    cfg = SweepConfig(
        idx=idx, batch=b, seqlen_q=sq, seqlen_k=sk, heads=h, head_dim=d,
        dtype=str(rng.choice(["fp16", "bf16"])), causal=bool(rng.random() < 0.5),
        layout=str(rng.choice(["bshd", "bhsd"])), deterministic=bool(rng.random() < 0.3),
        strides=str(rng.choice(STRIDES, p=[0.35, 0.35, 0.15, 0.15])), preallocated=bool(rng.random() < 0.3),
        softmax_scale=None if rng.random() < 0.85 else float(rng.uniform(0.3, 2.0) / math.sqrt(d)),
        size=str(size))
    # grouped-query K/V heads for a third: a proper divisor of heads (1: multi-query)
    divisors = [x for x in range(1, h) if h % x == 0]
    kv_heads = int(rng.choice(divisors)) if divisors and rng.random() < 0.33 else 0
    mode = str(rng.choice(MODES, p=[0.8, 0.1, 0.1]))
    extra = {"kv_heads": kv_heads, "mode": mode}
    if mode == "kvcache":  # a few new tokens over a cache of up to seqlen_k keys (paged: 64-key pages)
        paged = bool(rng.random() < 0.5)
        capacity = max(64, -(-sk // 64) * 64) if paged else max(1, sk)
        s_q = int(rng.choice([1, 1, 2, 3, 7, 16, 64]))
        extra.update(seqlen_q=min(s_q, capacity), seqlen_k=capacity, paged=paged,
                     splits=int(rng.choice([0, 0, 1, 2, 5, 16])), append=bool(rng.random() < 0.5),
                     deterministic=False, preallocated=False, strides="contiguous", layout="bshd")
    elif mode == "varlen":
        extra.update(preallocated=False, strides="contiguous", layout="bshd")
    elif b * h * sq * sk <= MAX_MOD_SCORES:  # score modifiers (own generator: the other draws stay as they were)
        mr = np.random.default_rng(seed_of("sweep-mods", SEED, idx))
        if mr.random() < 0.5:
            sides = [-1, 0, 1, 17, 256, int(mr.integers(0, max(2, sk)))]
            window = (int(mr.choice(sides)), int(mr.choice(sides))) if mr.random() < 0.5 else None
            extra.update(window=window, alibi=str(mr.choice(["", "h", "bh"])),
                         softcap=float(mr.choice([5.0, 30.0, 50.0])) if mr.random() < 0.4 else None,
                         dropout_p=float(mr.choice([0.17, 0.5])) if mr.random() < 0.4 else 0.0)
    from dataclasses import replace

    return replace(cfg, **extra)


def _anchors() -> list[SweepConfig]:
    """A few fixed extremes first: the longest sequences, the largest head dims, one query or key of 4093."""
    rows = [(1, 4096, 4096, 1, 128, "bf16", True, "bshd", False, "contiguous", False),
            (1, 4096, 4096, 2, 256, "fp16", False, "bhsd", True, "guarded", True),
            (1, 4093, 1, 2, 64, "bf16", True, "bshd", False, "guarded-permuted", False),
            (2, 1, 4093, 3, 96, "fp16", True, "bhsd", True, "misaligned", True),
            (1, 4096, 2039, 2, 200, "bf16", True, "bshd", False, "guarded", False),
            (3, 2053, 4096, 1, 8, "fp16", False, "bshd", False, "contiguous", True)]
    return [SweepConfig(i, *row[:10], preallocated=row[10], softmax_scale=None, size="large")
            for i, row in enumerate(rows)]


def sweep_configs(seed: int = SEED, count: int = COUNT) -> list[SweepConfig]:
    anchors = _anchors()[:count]
    rng = np.random.default_rng(seed)
    return anchors + [_draw(rng, i) for i in range(len(anchors), count)]


CONFIGS = sweep_configs()


# --- inputs and outputs ------------------------------------------------------------------------------------

def _placement(cfg: SweepConfig, rng) -> dict:
    """guarded() options of an input view: random padding around it (and axis order / misalignment)."""
    if cfg.strides == "contiguous":
        return {}
    before = [int(x) for x in rng.integers(0, 3, 3)] + [int(rng.choice([0, 8, 16]))]
    after = [int(x) for x in rng.integers(0, 3, 3)] + [int(rng.choice([0, 8]))]
    opts = {"before": tuple(before), "after": tuple(after)}
    if cfg.strides == "guarded-permuted":
        opts["order"] = (0, 2, 1, 3)
    if cfg.strides == "misaligned":  # head-dim offset of 4 elements: the library copies the view
        opts["before"] = tuple(before[:3] + [int(rng.choice([4, 12]))])
        opts["after"] = tuple(after[:3] + [4])
    return opts


def _shape(cfg: SweepConfig, seqlen: int, heads: int = 0) -> tuple:
    b, h, d = cfg.batch, heads or cfg.heads, cfg.head_dim
    return (b, seqlen, h, d) if cfg.layout == "bshd" else (b, h, seqlen, d)


def _input(cfg: SweepConfig, seqlen: int, seed: int, rng, heads: int = 0):
    """(array the library gets, Guarded or None)."""
    values = randn(_shape(cfg, seqlen, heads), cfg.dtype, seed)
    if cfg.strides == "contiguous":
        return values, None
    g = guarded(values.shape, values.dtype, values, **_placement(cfg, rng))
    return g.view, g


def _ratio(got32, ref64, lowp, factor: float) -> float:
    """max|got - ref64| / (factor * max|lowp - ref64| + 1e-5); inf when got has NaN or inf."""
    if got32.size == 0:
        return 0.0
    if not bool(cp.isfinite(got32).all()):
        return math.inf
    err, low = (float(x) for x in cp.stack([cp.abs(got32 - ref64).max(), cp.abs(lowp - ref64).max()]).get())
    return err / (factor * low + 1e-5)


def _lse_ratio(lse, lse64) -> float:
    """max |lse - lse64| / 1e-3 over rows that see a key; inf if the -inf rows differ or lse has NaN."""
    finite64 = cp.isfinite(lse64)
    if bool(cp.isnan(lse).any()) or not bool((cp.isfinite(lse) == finite64).all()):
        return math.inf
    if not bool((lse[~finite64] == -cp.inf).all()):
        return math.inf
    return max_abs(cp.where(finite64, lse, 0.0) - cp.where(finite64, lse64, 0.0)) / 1e-3


# --- the report ----------------------------------------------------------------------------------------------

OUTPUTS = ("o", "lse", "dq", "dk", "dv")


class SweepReport:
    def __init__(self):
        self.rows: list[tuple[SweepConfig, dict]] = []
        self.t0 = time.perf_counter()

    def record(self, cfg: SweepConfig, ratios: dict) -> None:
        self.rows.append((cfg, ratios))

    def table(self) -> tuple[list[str], dict]:
        """Lines of the per-feature table, and the same as a dict (for CUFLASH_SWEEP_REPORT)."""
        worst: dict = {}
        for cfg, ratios in self.rows:
            for feature, value in cfg.features().items():
                entry = worst.setdefault((feature, value), {"configs": 0, **{o: (0.0, None) for o in OUTPUTS}})
                entry["configs"] += 1
                for o in OUTPUTS:
                    if entry[o][1] is None or ratios[o] > entry[o][0]:
                        entry[o] = (ratios[o], cfg.idx)
        failed = [cfg.id for cfg, r in self.rows if max(r.values()) > 1.0]
        lines = [f"cuflash sweep: {len(self.rows)} configurations (seed {SEED}), {len(failed)} failed, "
                 f"{time.perf_counter() - self.t0:.0f} s",
                 "worst ratio per feature: error / bound (pass rule of README.md, Tests; lse: error / 1e-3); "
                 "<= 1 passes; [config index of the worst dq/dk/dv]",
                 f"{'feature':<22} {'value':<14} {'configs':>7} " + " ".join(f"{o:>7}" for o in OUTPUTS) + "  worst"]
        def order(item):
            (feature, value), _ = item
            return feature, value.zfill(6) if value.isdigit() else value

        for (feature, value), e in sorted(worst.items(), key=order):
            grad_worst = max(("dq", "dk", "dv"), key=lambda o: e[o][0])
            lines.append(f"{feature:<22} {value:<14} {e['configs']:>7} "
                         + " ".join(f"{e[o][0]:>7.3f}" for o in OUTPUTS) + f"  [{e[grad_worst][1]}]")
        overall = {o: max((r[o] for _, r in self.rows), default=0.0) for o in OUTPUTS}
        lines.append(f"{'all':<22} {'':<14} {len(self.rows):>7} " + " ".join(f"{overall[o]:>7.3f}" for o in OUTPUTS))
        for name in failed[:20]:
            lines.append(f"FAILED {name}")
        data = {"seed": SEED, "count": len(self.rows), "failed": failed, "overall": overall,
                "features": [{"feature": f, "value": v, "configs": e["configs"],
                              **{o: {"ratio": e[o][0], "config": e[o][1]} for o in OUTPUTS}}
                             for (f, v), e in sorted(worst.items())]}
        return lines, data


@pytest.fixture(scope="module")
def sweep_report(request):
    errors = {n: e for n, e in compile_configs(config.all_fwd_configs() + config.all_bwd_configs()).items() if e}
    assert not errors, f"kernels failed to compile: {errors}"
    report = SweepReport()
    yield report
    lines, data = report.table()
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print("\n" + "\n".join(lines))
    else:
        print("\n" + "\n".join(lines))
    path = os.environ.get("CUFLASH_SWEEP_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({**data, "configs": [asdict(c) for c, _ in report.rows]}, f, indent=1)


# --- the test ------------------------------------------------------------------------------------------------

def _sweep_varlen(cfg: SweepConfig) -> dict:
    """Packed sequences: batch lengths drawn up to seqlen_q / seqlen_k (0 included), forward and backward."""
    rng = np.random.default_rng(seed_of("sweep-varlen", SEED, cfg.idx))
    lens_q = rng.integers(0, cfg.seqlen_q + 1, cfg.batch)
    lens_k = rng.integers(0, cfg.seqlen_k + 1, cfg.batch)
    lens_q[0], lens_k[-1] = cfg.seqlen_q, cfg.seqlen_k  # the maxima occur
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    tq, tk, d, seed = int(cu_q[-1]), int(cu_k[-1]), cfg.head_dim, seed_of("sweep", SEED, cfg.idx)
    q, dout = randn((tq, cfg.heads, d), cfg.dtype, seed), randn((tq, cfg.heads, d), cfg.dtype, seed + 3)
    k, v = randn((tk, cfg.heads_kv, d), cfg.dtype, seed + 1), randn((tk, cfg.heads_kv, d), cfg.dtype, seed + 2)
    cuq, cuk = cp.asarray(cu_q), cp.asarray(cu_k)
    mq, mk = int(lens_q.max()), int(lens_k.max())
    poison_pool(round_up(tq * cfg.heads * d * 2) + round_up(tq * cfg.heads * 4))
    o, lse = cuflash.attention_varlen_forward(q, k, v, cuq, cuk, mq, mk, causal=cfg.causal,
                                              softmax_scale=cfg.softmax_scale)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, o, lse, cuq, cuk, mq, mk, causal=cfg.causal,
                                              softmax_scale=cfg.softmax_scale, deterministic=cfg.deterministic)
    q32, k32, v32, do32 = (_xpref.to_float32(x) for x in (q, k, v, dout))
    o64, lse64 = _xpref.attention_varlen_forward64(q32, k32, v32, cu_q, cu_k, cfg.causal, cfg.softmax_scale)
    low = _xpref.attention_varlen_lowp(q32, k32, v32, cu_q, cu_k, cfg.dtype, cfg.causal, cfg.softmax_scale)
    ratios = {"o": _ratio(_xpref.to_float32(o), o64, low, 2), "lse": _lse_ratio(lse, lse64)}
    g64 = _xpref.attention_varlen_backward64(do32, q32, k32, v32, cu_q, cu_k, cfg.causal, cfg.softmax_scale)
    glowp = _xpref.attention_varlen_backward_lowp(do32, q32, k32, v32, cu_q, cu_k, cfg.dtype, cfg.causal,
                                                  cfg.softmax_scale)
    for name, g, ref, lo in zip(("dq", "dk", "dv"), grads, g64, glowp):
        ratios[name] = _ratio(_xpref.to_float32(g), ref, lo, 3)
    return ratios


def _sweep_kvcache(cfg: SweepConfig) -> dict:
    """Decoding over a dense or paged cache with random valid lengths; the appended keys land exactly."""
    rng = np.random.default_rng(seed_of("sweep-kvcache", SEED, cfg.idx))
    b, sq, d, capacity, seed = cfg.batch, cfg.seqlen_q, cfg.head_dim, cfg.seqlen_k, seed_of("sweep", SEED, cfg.idx)
    s_new = sq if cfg.append else 0
    q = randn((b, sq, cfg.heads, d), cfg.dtype, seed)
    k = v = None
    if s_new:
        k, v = (randn((b, s_new, cfg.heads_kv, d), cfg.dtype, seed + i) for i in (1, 2))
    table = None
    if cfg.paged:
        pages = capacity // 64
        table = rng.permutation(b * pages + 3)[:b * pages].reshape(b, pages).astype(np.int32)
        shape = (b * pages + 3, 64, cfg.heads_kv, d)
    else:
        shape = (b, capacity, cfg.heads_kv, d)
    k_cache, v_cache = randn(shape, cfg.dtype, seed + 4), randn(shape, cfg.dtype, seed + 5)
    lens = rng.integers(0, capacity - s_new + 1, b).astype(np.int32)
    before = (k_cache.copy(), v_cache.copy())
    poison_pool(round_up(b * sq * cfg.heads * d * 2) + round_up(b * cfg.heads * sq * 4))
    o, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cp.asarray(lens),
                                            block_table=None if table is None else cp.asarray(table),
                                            causal=cfg.causal, softmax_scale=cfg.softmax_scale,
                                            num_splits=cfg.splits, return_lse=True)
    q32, kc32, vc32 = (_xpref.to_float32(x) for x in (q,) + before)
    k32, v32 = (None, None) if k is None else (_xpref.to_float32(k), _xpref.to_float32(v))
    o64, lse64, _, _ = _xpref.attention_kvcache64(q32, kc32, vc32, lens, k32, v32, table, cfg.causal,
                                                  cfg.softmax_scale)
    low = _xpref.attention_kvcache_lowp(q32, kc32, vc32, cfg.dtype, lens, k32, v32, table, cfg.causal,
                                        cfg.softmax_scale)
    ratios = {"o": _ratio(_xpref.to_float32(o), o64, low, 2), "lse": _lse_ratio(lse, lse64),
              "dq": 0.0, "dk": 0.0, "dv": 0.0}
    u16 = cp.uint16
    want_k, want_v = _xpref.kvcache_append(before[0].view(u16), before[1].view(u16),
                                           None if k is None else k.view(u16), None if v is None else v.view(u16),
                                           lens, table)
    assert bool((k_cache.view(u16) == want_k).all()) and bool((v_cache.view(u16) == want_v).all()), \
        f"the cache after the append differs from the expected one (new keys misplaced or other entries changed) " \
        f"for {cfg.id}"
    return ratios


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
def test_sweep(cfg: SweepConfig, sweep_report):
    if cfg.mode != "dense":
        ratios = (_sweep_varlen if cfg.mode == "varlen" else _sweep_kvcache)(cfg)
        sweep_report.record(cfg, ratios)
        bad = {n: r for n, r in ratios.items() if not r <= 1.0}
        assert not bad, f"pass rule broken for {cfg.id}: " + ", ".join(f"{n} ratio {r:.3g}" for n, r in bad.items())
        return
    rng = np.random.default_rng(seed_of("sweep-placement", SEED, cfg.idx))
    seed = seed_of("sweep", SEED, cfg.idx)
    b, sq, sk, h, d = cfg.batch, cfg.seqlen_q, cfg.seqlen_k, cfg.heads, cfg.head_dim
    q, qg = _input(cfg, sq, seed, rng)
    k, kg = _input(cfg, sk, seed + 1, rng, cfg.heads_kv)
    v, vg = _input(cfg, sk, seed + 2, rng, cfg.heads_kv)
    dout, dog = _input(cfg, sq, seed + 3, rng)
    in_guards = {n: (g, g.snapshot()) for n, g in (("q", qg), ("k", kg), ("v", vg), ("dout", dog)) if g is not None}

    mods, ref_mods = {}, {}
    if cfg.window is not None:
        mods["window"] = ref_mods["window"] = cfg.window
    if cfg.alibi:
        slopes = np.random.default_rng(seed + 7).random((h,) if cfg.alibi == "h" else (b, h)) * 0.3
        mods["alibi_slopes"], ref_mods["alibi_slopes"] = cp.asarray(slopes, dtype=cp.float32), slopes.astype(np.float32)
    if cfg.softcap:
        mods["softcap"] = ref_mods["softcap"] = cfg.softcap
    if cfg.dropout_p:
        mods.update(dropout_p=cfg.dropout_p, seed=seed, offset=cfg.idx)
        ref_mods.update(dropout_p=cfg.dropout_p, dropout_mask=philox.dropout_mask(b, h, sq, sk, cfg.dropout_p, seed,
                                                                                  cfg.idx))
    poison_pool(round_up(b * sq * h * d * 2) + round_up(b * h * sq * 4))
    o, lse = cuflash.attention_forward(q, k, v, causal=cfg.causal, softmax_scale=cfg.softmax_scale, layout=cfg.layout,
                                       **mods)
    out = o
    if cfg.strides != "contiguous":  # the backward's out, too, as a view inside a poisoned buffer
        og = guarded(o.shape, o.dtype, o, **_placement(cfg, rng))
        out = og.view
        in_guards["out"] = (og, og.snapshot())
    out_guards = {}
    kwargs = {}
    if cfg.preallocated:
        order = (0, 2, 1, 3) if cfg.strides == "guarded-permuted" else None
        for name, x in (("dq", q), ("dk", k), ("dv", v)):
            g = guarded(x.shape, lowp_dtype(cfg.dtype), None, order=order)
            out_guards[name] = (g, g.snapshot())
            kwargs[name] = g.view
    else:
        poison_pool(round_up(4 * (q.nbytes + 2 * k.nbytes)) + round_up(b * h * (sq + 128) * (d + 8) * 4) + (1 << 20))
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=cfg.causal, softmax_scale=cfg.softmax_scale,
                                       layout=cfg.layout, deterministic=cfg.deterministic, **kwargs, **mods)

    q32, k32, v32, do32 = (to_bshd32(x, cfg.layout) for x in (q, k, v, dout))
    if mods:  # the NumPy reference (float64 and low precision) with the same modifiers
        h32 = [cp.asnumpy(x) for x in (q32, k32, v32, do32)]
        o64, lse64 = (cp.asarray(x) for x in refmod.attention_forward64(*h32[:3], cfg.causal, cfg.softmax_scale,
                                                                     **ref_mods))
        o_lowp = cp.asarray(refmod.attention_lowp(*h32[:3], cfg.dtype, cfg.causal, cfg.softmax_scale, **ref_mods))
        ratios = {"o": _ratio(to_bshd32(o, cfg.layout), o64, o_lowp, 2), "lse": _lse_ratio(lse, lse64)}
        g64 = refmod.attention_backward64(h32[3], *h32[:3], cfg.causal, cfg.softmax_scale, **ref_mods)
        glowp = refmod.attention_backward_lowp(h32[3], *h32[:3], cfg.dtype, cfg.causal, cfg.softmax_scale, **ref_mods)
        for name, g, r64, low in zip(("dq", "dk", "dv"), grads, g64, glowp):
            ratios[name] = _ratio(to_bshd32(g, cfg.layout), cp.asarray(r64), cp.asarray(low), 3)
        sweep_report.record(cfg, ratios)
        _check_guards_and_ratios(cfg, in_guards, out_guards, ratios)
        return
    o64, lse64 = _xpref.attention_forward64(q32, k32, v32, cfg.causal, cfg.softmax_scale)
    o_lowp = _xpref.attention_lowp(q32, k32, v32, cfg.dtype, cfg.causal, cfg.softmax_scale)
    ratios = {"o": _ratio(to_bshd32(o, cfg.layout), o64, o_lowp, 2), "lse": _lse_ratio(lse, lse64)}
    del o64, o_lowp
    g64 = _xpref.attention_backward64(do32, q32, k32, v32, cfg.causal, cfg.softmax_scale)
    glowp = _xpref.attention_backward_lowp(do32, q32, k32, v32, cfg.dtype, cfg.causal, cfg.softmax_scale)
    for name, g, ref, low in zip(("dq", "dk", "dv"), grads, g64, glowp):
        ratios[name] = _ratio(to_bshd32(g, cfg.layout), ref, low, 3)
    del g64, glowp
    sweep_report.record(cfg, ratios)
    _check_guards_and_ratios(cfg, in_guards, out_guards, ratios)


def _check_guards_and_ratios(cfg: SweepConfig, in_guards: dict, out_guards: dict, ratios: dict) -> None:
    changed = [n for n, (g, snap) in in_guards.items() if not g.unchanged(snap)]
    written_outside = [n for n, (g, snap) in out_guards.items() if not g.outside_unchanged(snap)]
    assert not changed, f"inputs' buffers changed (view or guard band): {changed} for {cfg.id}"
    assert not written_outside, f"wrote outside the preallocated views {written_outside} for {cfg.id}"
    bad = {n: r for n, r in ratios.items() if not r <= 1.0}
    assert not bad, f"pass rule broken for {cfg.id}: " + ", ".join(f"{n} ratio {r:.3g}" for n, r in bad.items())


def test_sweep_is_reproducible_and_large_enough():
    """The configuration list depends only on the seed; >= 2000 configurations covering the ranges."""
    again = sweep_configs()
    assert again == CONFIGS
    if COUNT >= 2000:
        assert len(CONFIGS) >= 2000
        assert {c.dtype for c in CONFIGS} == {"fp16", "bf16"} and {c.layout for c in CONFIGS} == {"bshd", "bhsd"}
        assert min(c.seqlen_q for c in CONFIGS) == 1 and max(c.seqlen_k for c in CONFIGS) == 4096
        assert {c.head_dim for c in CONFIGS} >= set(config.KERNEL_HEAD_DIMS)
        assert any(c.seqlen_q in PRIMES and c.seqlen_q > 1000 for c in CONFIGS)
        assert {c.mode for c in CONFIGS} == set(MODES) and any(c.kv_heads == 1 for c in CONFIGS)
        kv = [c for c in CONFIGS if c.mode == "kvcache"]
        assert {c.paged for c in kv} == {False, True} and {c.append for c in kv} == {False, True}
        assert len({c.splits for c in kv}) > 2
        modded = [c for c in CONFIGS if c.window or c.alibi or c.softcap or c.dropout_p]
        assert len(modded) >= 200 and all(any(getattr(c, f) for c in modded)
                                          for f in ("window", "alibi", "softcap", "dropout_p"))
