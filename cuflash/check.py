"""`python -m cuflash.check sanitize`: compute-sanitizer over a representative set of kernel launches.

    python -m cuflash.check sanitize                      # memcheck, racecheck, initcheck, synccheck; < 6 min on an H100
    python -m cuflash.check sanitize --quick --tools memcheck
    python -m cuflash.check sanitize --out $OUT/sanitize  # logs: one file per tool and shard, plus the reference run
    python -m cuflash.check sanitize --only 'fp32|tf32|fp64'  # the float32 / float64 cases alone
    python -m cuflash.check cases [--quick] [--only REGEX]  # list the case set (and its cost estimate)

What `sanitize` does:
  1. compiles every kernel the cases need through NVRTC, in parallel processes (NVRTC holds the GIL, so
     threads do not help), into the disk cache (~/.cache/cuflash), so no sanitized process compiles;
  2. runs the driver (`python -m cuflash.check _driver`) once without a sanitizer, checking every case
     against the float64 reference (the pass rule of README.md, Tests) and recording a digest of each output;
  3. runs the driver under `compute-sanitizer --tool T --error-exitcode 99` for each tool, the cases split
     over a few shard processes per tool, all tools at once, and parses each tool's summary
     ("ERROR SUMMARY: N errors", racecheck's "RACECHECK SUMMARY: ... (E errors, W warnings)");
  4. prints one row per tool (cases done, errors, output digests that differ from the unsanitized run,
     seconds), the first findings of any tool that reported one, and exits non-zero on any finding,
     digest mismatch, driver failure or timeout.

The driver is built so that the sanitizers see (almost) only cuflash's kernels, on exactly-sized
allocations: inputs are generated on the host and copied up as raw bits (no CuPy random/elementwise kernels),
CuPy's memory pool is switched off (every array is its own cudaMalloc, so memcheck sees a read one byte past an
array; `--padding` adds a guard after each allocation where the tool supports it), and outputs are checked
on the host. Strided cases use views into larger, fully initialized buffers (initcheck stays meaningful);
the "misaligned" case (strides not a multiple of 16 bytes) makes the library copy its input with one CuPy kernel.

Every case runs the forward, the default backward (atomic dQ) and the deterministic backward, so each
case covers one (head dim, dtype, causal) instantiation of every kernel; the default set covers every
shipped instantiation (6 kernel head dims x 2 dtypes x causal/not) plus zero-padded head dims. The float32
("fp32": 3xTF32, "tf32": precision="tf32") and float64 ("fp64") cases cover every wide instantiation
(config.all_wide_configs, the ordered deterministic backward among them); they are checked against a float64
(float64 inputs: extended-precision) reference by their own rule (`_wide_rules`), the deterministic gradients too.
The FP8 cases ("fp8", "fp8_varlen": e4m3 inputs with random descales) run the FP8 forward only (Hopper; elsewhere,
and with CUFLASH_KERNELS=mma, they launch nothing and their result says so) and cover every FP8 instantiation;
they are checked by the FP8 tests' rule (`_run_fp8`).

initcheck: the kernels read no uninitialized memory by design (cp.async with src-size 0 zero-fills a
tail row without reading it), so any initcheck report is a finding, not noise.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass

from . import _compile, config

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# Processes per tool. racecheck is by far the slowest (it tracks every shared-memory access), so it gets
# the most shards; all shards of all tools run at once (16 CPUs and one GPU on the H100 machine).
DEFAULT_SHARDS = {"memcheck": 2, "racecheck": 5, "initcheck": 2, "synccheck": 2}
SANITIZER_EXIT = 99
LAYOUTS = ("bshd", "bhsd")
STRIDES = ("contiguous", "padded", "transposed", "misaligned")
# Sanitizer work per (score x kernel head dim) of a dtype's kernels, relative to the 16-bit ones: an estimate (not
# measured) from the instructions the sanitizers instrument per multiply-add. The 16-bit kernels read shared memory
# with ldmatrix (16 bytes a lane) into m16n8k16 MMAs; the wide kernels read fragments with 4- or 8-byte loads
# (about 4x the shared loads per multiply-add for float32, 8x for float64, whose m8n8k4 MMA on sm_80-sm_89 also
# does 1/8 of the work of an m16n8k16, its m16n8k8 on sm_90 1/2) and stage 2x / 4x the bytes through cp.async.
WORK_WEIGHT = {"fp32": 4.0, "tf32": 4.0, "fp64": 8.0}


# --- the case set ------------------------------------------------------------------------------------

KINDS = ("dense", "varlen", "kvcache", "fp8", "fp8_varlen")
FP8_KINDS = ("fp8", "fp8_varlen")


@dataclass(frozen=True)
class Case:
    """One problem. dense and varlen: forward, default backward and (16-bit dtypes) deterministic backward are all
    run on it; kvcache: attention_with_kvcache (forward only, 16-bit), appending seqlen_q new keys into a cache of
    seqlen_k; fp8 and fp8_varlen: the FP8 forward (e4m3 inputs with descales, forward only; dtype is O's), dense or
    packed as varlen. dtype is the kernels' dtype name: "fp16", "bf16", or a wide one (config.WIDE_DTYPES): "fp32"
    (float32 inputs, precision None: 3xTF32), "tf32" (float32 inputs, precision="tf32"), "fp64" (float64 inputs)."""

    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    head_dim: int
    dtype: str     # "fp16" | "bf16" | "fp32" | "tf32" | "fp64"
    causal: bool
    layout: str    # "bshd" | "bhsd" (dense only)
    strides: str   # one of STRIDES, for q, k, v and dout (dense only)
    kind: str = "dense"    # one of KINDS; varlen: batch sequences of lengths cycling through seqlen, 1, 0, 17
    kv_heads: int = 0      # K/V heads (GQA); 0: heads
    paged: bool = False    # kvcache: a paged cache of 64-key pages in shuffled order
    splits: int = 0        # kvcache: num_splits (0: the heuristic)
    mods: int = 0          # dense: score modifiers (config.MOD_* bits), with the values of `mod_options`
    padding: bool = False  # dense, MOD_MASK: the mask is a key_padding_mask alone (its tile map made per call)

    @property
    def heads_kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def kernel_head_dim(self) -> int:
        return config.kernel_head_dim(self.head_dim, self.dtype)

    @property
    def wide(self) -> bool:
        """float32 / float64 inputs (the wide kernels of cuda/wide.cuh)."""
        return self.dtype in config.WIDE_DTYPES

    @property
    def precision(self):
        """The cuflash calls' precision= argument: "tf32" for the one-pass TF32 kernels, else None (the default)."""
        return "tf32" if self.dtype == "tf32" else None

    @property
    def cost(self) -> float:
        """Relative cost under a sanitizer: a fixed part per launch plus the work of the tiles, weighted by dtype
        (varlen: of the sequences' lengths)."""
        if self.kind == "varlen":
            scores = sum(lq * lk for lq, lk in zip(*_varlen_lengths(self)))
        else:
            scores = self.batch * self.seqlen_q * self.seqlen_k
        work = self.heads * scores * self.kernel_head_dim
        return 5.0 + WORK_WEIGHT.get(self.dtype, 1.0) * work / 1e6

    def mod_options(self, rng=None) -> dict:
        """cuflash keyword arguments of the case's modifiers: window (37, 5), ALiBi slopes (heads,) in [0, 0.3)
        (random with rng, else None as a placeholder), softcap 20, dropout 0.17 with a seed from the name, a bias
        (1, seqlen_q, seqlen_k) shared by the heads (its gradient sums over them: atomics; run_case passes it in
        float32, or in the case's 16-bit dtype when seqlen_k is a multiple of 8) and a mask
        (seqlen_q, seqlen_k) keeping 90 % of the pairs, or with `padding` a key_padding_mask (batch, seqlen_k) keeping a
        prefix of each sequence's keys (NumPy arrays with rng, else None)."""
        kw = {}
        if self.mods & config.MOD_WINDOW:
            kw["window"] = (37, 5)
        if self.mods & config.MOD_ALIBI:
            kw["alibi_slopes"] = None if rng is None else rng.random(self.heads) * 0.3
        if self.mods & config.MOD_SOFTCAP:
            kw["softcap"] = 20.0
        if self.mods & config.MOD_DROPOUT:
            kw.update(dropout_p=0.17, seed=zlib.crc32(self.name.encode()), offset=3)
        if self.mods & config.MOD_BIAS:
            kw["bias"] = None if rng is None else rng.standard_normal((1, self.seqlen_q, self.seqlen_k))
        if self.mods & config.MOD_MASK and self.padding:
            import numpy as np

            kw["key_padding_mask"] = None if rng is None else \
                np.arange(self.seqlen_k)[None, :] < rng.integers(1, self.seqlen_k + 1, (self.batch, 1))
        elif self.mods & config.MOD_MASK:
            kw["mask"] = None if rng is None else rng.random((self.seqlen_q, self.seqlen_k)) < 0.9
        if self.mods & config.MOD_BLOCKS:  # whole 128 x 128 blocks, half of them kept (run_case makes a BlockMask)
            import numpy as np

            kw["mask"] = None if rng is None else np.repeat(np.repeat(
                rng.random((-(-self.seqlen_q // 128), -(-self.seqlen_k // 128))) < 0.5, 128, 0), 128, 1)[
                    :self.seqlen_q, :self.seqlen_k]
        return kw

    @property
    def kernel_causal(self) -> bool:
        """The kernels' causal flag: a window carries causal itself (right = 0)."""
        return self.causal and not self.mods & config.MOD_WINDOW

    def configs(self, arch: str = config.DEFAULT_ARCH, kernels: str | None = None) -> list:
        """Every kernel config this case launches on `arch` with the kernel family `kernels` (default:
        CUFLASH_KERNELS, see cuflash.config.KERNELS)."""
        maps = [config.PaddingTilesConfig()] if self.padding else []  # (where a kernel reads the map: enough here)
        return self._configs(arch, kernels) + maps

    def _configs(self, arch: str, kernels: str | None) -> list:
        hd = self.kernel_head_dim
        if self.kind in FP8_KINDS:  # Hopper's wgmma kernels only: nothing to launch on other targets or with mma
            try:
                return [config.select("forward_fp8", hd, self.dtype, self.kernel_causal, arch, mods=self.mods,
                                      kernels=kernels, seqlen_k=self.seqlen_k)]
            except ValueError:
                return []
        if self.wide:  # the registry's wide families (every target)
            c, m = self.kernel_causal, self.mods
            if m & config.MOD_BLOCKS:  # float32 reads a BlockMask's map in its mask kernels (the TF32 ones skip tiles)
                m = (m & ~config.MOD_BLOCKS) | config.MOD_MASK
            bwd = config.backward_kernel_config(hd, self.dtype, c, False, arch, kernels, mods=m)
            det = config.backward_kernel_config(hd, self.dtype, c, True, arch, kernels, mods=m)
            # the float32 Hopper backward's dQ comes from its own kernel (deterministic as it is); the others convert
            # a dQ accumulator, deterministic mode's summed in a fixed order by the ordered bwd_wide_kernel
            tail = [bwd.dq_config()] if isinstance(bwd, config.BwdSm90Tf32Config) else \
                [config.ElementwiseConfig("convert_dq", self.dtype)]
            return [config.forward_kernel_config(hd, self.dtype, c, arch, kernels, mods=m, seqlen_k=self.seqlen_k),
                    bwd] + ([det] if det != bwd else []) + [config.ElementwiseConfig("preprocess", self.dtype)] + \
                tail + ([config.DropoutMaskConfig()] if m & config.MOD_DROPOUT else [])
        if self.kind == "kvcache":  # the decode kernels run on every architecture and kernel family
            return [config.AppendConfig(self.dtype),
                    config.fwd_decode_config(hd, self.dtype, self.kernel_causal, self.mods),
                    config.CombineConfig(self.dtype)]
        if self.mods:
            c, m = self.kernel_causal, self.mods
            # a block-aligned BlockMask: MOD_BLOCKS where a family takes the map (not the deterministic backward),
            # else the mask (cuflash._families.blocks_only)
            masked = (m & ~config.MOD_BLOCKS) | config.MOD_MASK if m & config.MOD_BLOCKS else m

            def pick(select):
                try:
                    return select(m)
                except ValueError:
                    return select(masked)

            bwd = pick(lambda x: config.backward_kernel_config(hd, self.dtype, c, False, arch, kernels, mods=x))
            return [pick(lambda x: config.forward_kernel_config(hd, self.dtype, c, arch, kernels, mods=x,
                                                               seqlen_k=self.seqlen_k)),
                    bwd, config.backward_kernel_config(hd, self.dtype, c, True, arch, kernels, mods=masked),
                    config.dq_config(hd, self.dtype, c, masked),
                    config.ElementwiseConfig("preprocess", self.dtype),
                    config.convert_dq_config(bwd, self.dtype)] + \
                ([config.DropoutMaskConfig()] if m & config.MOD_DROPOUT else [])
        bwd = config.backward_kernel_config(hd, self.dtype, self.causal, False, arch, kernels)
        return [config.forward_kernel_config(hd, self.dtype, self.causal, arch, kernels, seqlen_k=self.seqlen_k),
                bwd, config.backward_kernel_config(hd, self.dtype, self.causal, True, arch, kernels),
                config.dq_config(hd, self.dtype, self.causal),
                config.ElementwiseConfig("preprocess", self.dtype),
                config.convert_dq_config(bwd, self.dtype)]


_MOD_NAMES = ((config.MOD_WINDOW, "window"), (config.MOD_ALIBI, "alibi"), (config.MOD_SOFTCAP, "softcap"),
              (config.MOD_DROPOUT, "dropout"), (config.MOD_BIAS, "bias"), (config.MOD_MASK, "mask"),
              (config.MOD_BLOCKS, "blocks"))


def _case(b, sq, sk, h, d, dtype, causal, layout, strides, kind="dense", kv_heads=0, paged=False, splits=0,
          mods=0, padding=False) -> Case:
    name = (f"d{d}-{dtype}-{'causal' if causal else 'full'}-{sq}x{sk}-b{b}h{h}"
            + (f"kv{kv_heads}" if kv_heads else "") + (f"-{layout}-{strides}" if kind in ("dense", "fp8") else "")
            + ("" if kind == "dense" else f"-{kind}")
            + ("-paged" if paged else "") + (f"-split{splits}" if splits else "")
            + "".join(f"-{n}" for bit, n in _MOD_NAMES if mods & bit) + ("-padding" if padding else ""))
    return Case(name, b, sq, sk, h, d, dtype, causal, layout, strides, kind, kv_heads, paged, splits, mods, padding)


# Seqlen pairs: odd lengths (1, 17, 113, 1023), Sq != Sk both ways, several tiles in each direction, causal
# rows that see no key (Sq > Sk), a single query over many key tiles and a single key under many query blocks.
# Each kernel head dim gets one half: 4 pairs for its 4 (dtype, causal) combinations.
_PAIRS = ([(113, 203), (1023, 17), (17, 1023), (1, 1)],
          [(203, 113), (1023, 1), (1, 1023), (17, 17)])


def default_cases() -> list[Case]:
    cases = []
    i = 0
    for hi, hd in enumerate(config.KERNEL_HEAD_DIMS):
        for ci, (dtype, causal) in enumerate((("fp16", False), ("fp16", True), ("bf16", False), ("bf16", True))):
            sq, sk = _PAIRS[hi % 2][(ci + hi // 2) % 4]  # rotated, so causal and full both meet every pair
            b, h = (2, 1) if i % 2 else (1, 2)
            cases.append(_case(b, sq, sk, h, hd, dtype, causal, LAYOUTS[(i + i // 4) % 2], STRIDES[(ci + hi) % 4]))
            i += 1
    # head dims without their own kernel: zero-padded columns inside the next kernel (reads stop at head_dim)
    cases += [_case(1, 113, 203, 2, 72, "bf16", True, "bhsd", "padded"),
              _case(2, 17, 1023, 1, 8, "fp16", False, "bshd", "misaligned"),
              _case(1, 1023, 17, 2, 200, "bf16", True, "bshd", "transposed"),
              _case(2, 203, 113, 1, 136, "fp16", True, "bhsd", "padded")]
    # grouped-query heads and packed sequences (lengths cycling through seqlen, 1, 0, 17), forward and backward
    cases += [_case(1, 113, 203, 4, 64, "fp16", True, "bshd", "contiguous", kv_heads=2),
              _case(1, 203, 17, 4, 128, "bf16", False, "bhsd", "padded", kv_heads=1),
              _case(4, 113, 203, 2, 128, "bf16", True, "bshd", "contiguous", kind="varlen", kv_heads=1),
              _case(4, 203, 113, 2, 64, "fp16", False, "bshd", "contiguous", kind="varlen")]
    # long key sequences: the Hopper forward's long-sequence tiles (past config.FWD_SM90_WS_SHORT_KEYS, non-causal,
    # and FWD_SM90_WS_CAUSAL_SHORT_KEYS and _LONG_KEYS, causal; the shorter cases above run its persistent kernels)
    cases += [_case(1, 130, keys + 52, 1, hd, dtype, causal, "bshd", "contiguous")
              for causal, bounds in ((False, config.FWD_SM90_WS_SHORT_KEYS),
                                     (True, config.FWD_SM90_WS_CAUSAL_SHORT_KEYS),
                                     (True, config.FWD_SM90_WS_CAUSAL_LONG_KEYS))
              for hd, keys in bounds.items() for dtype in ("fp16", "bf16")]
    # score modifiers: every modifier kernel the compile check builds (window alone, all four with causal folded
    # into the window, all but the window on a causal kernel), for each kernel head dim and dtype
    for hi, hd in enumerate(config.KERNEL_HEAD_DIMS):
        for di, dtype in enumerate(("fp16", "bf16")):
            for mi, (causal, mods) in enumerate(((False, config.MOD_WINDOW), (True, config.MODS_ALL),
                                                 (True, config.MODS_ALL & ~config.MOD_WINDOW))):
                # every row sees keys: with dropout, a row of one key makes dS a difference of two equal terms,
                # whose rounding (delta from the stored O) the pass rule's plain reference does not have
                sq, sk = ((113, 203), (203, 113), (256, 317))[(mi + hi + di) % 3]
                cases.append(_case(1, sq, sk, 2, hd, dtype, causal, "bshd", "contiguous", mods=mods))
    # the warp-specialized backward kernels built one by one (config.BWD_SM90_WS_EXACT_MODS: head dim 128's heavy
    # sets, soft-capping there without a window, head dim 64's staged bias), each launched: 3 query blocks, a key
    # tail in a tile; seqlen_k a multiple of 8, so run_case passes the bias in the case's 16-bit dtype (the staged
    # path)
    for hd, sets in config.BWD_SM90_WS_EXACT_MODS.items():
        for mi, heavy in enumerate(sets):
            for di, dtype in enumerate(("fp16", "bf16")):
                for ci, (causal, window) in enumerate(((False, config.MOD_WINDOW), (False, 0), (True, 0))):
                    if window and heavy in config.BWD_SM90_WS_EXACT_ALONE.get(hd, ()):
                        continue
                    # a mask without a bias: rows of a multiple of 16 keys, so that the head-dim-128 kernel reads
                    # them in 16-byte chunks (mask_keep_transposed), a key tail of 16 keys past the last full tile
                    shapes = ((136, 272), (264, 144)) if heavy & config.MOD_MASK and not heavy & config.MOD_BIAS else \
                        ((136, 264), (264, 136))
                    sq, sk = shapes[(mi + di + ci) % 2]
                    cases.append(_case(1, sq, sk, 2, hd, dtype, causal, "bshd", "contiguous", mods=heavy | window))
    # the wide-head backward's modifier kernels (config.BWD_SM90_SPLIT_MODS_CHECKED: window, ALiBi, softcap and
    # dropout; the sets above carry a bias and mask, which run the mma.sync backward there), each launched: 3 query
    # blocks, a key tail in a tile, every row sees keys
    for hi, hd in enumerate(config.BWD_SM90_SPLIT_HEAD_DIMS):
        for di, dtype in enumerate(("fp16", "bf16")):
            for causal in (False, True):
                sq, sk = ((136, 264), (130, 200))[(hi + di) % 2]
                cases.append(_case(1, sq, sk, 2, hd, dtype, causal, "bshd", "contiguous",
                                   mods=config.BWD_SM90_SPLIT_MODS_CHECKED[causal][0]))
    # a mask alone (with a window, or causal): the Hopper forward's mask tiles (config.FWD_SM90_WS_TILES_MASK)
    for hi, hd in enumerate(config.FWD_SM90_WS_TILES_MASK):
        for di, dtype in enumerate(("fp16", "bf16")):
            for mi, causal in enumerate((False, True)):
                sq, sk = ((113, 203), (203, 113), (256, 317))[(mi + hi + di) % 3]
                cases.append(_case(1, sq, sk, 1, hd, dtype, causal, "bshd", "contiguous",
                                   mods=config.MODS_MASK_CHECKED[causal][0]))
    # a bias alone (with a window, or causal): the Hopper forward's bias tiles (config.FWD_SM90_WS_TILES_BIAS, a
    # persistent grid); seqlen_k a multiple of 8, so the bias comes in the case's 16-bit dtype (the staged path); a
    # case the backward's sets above already have is not repeated
    names = {c.name for c in cases}
    for hi, hd in enumerate(config.FWD_SM90_WS_TILES_BIAS):
        for di, dtype in enumerate(("fp16", "bf16")):
            for mi, (causal, mods) in enumerate((causal, m) for causal in (False, True)
                                                for m in config.MODS_BIAS_CHECKED[causal]):
                sq, sk = ((136, 264), (264, 136), (256, 320))[(mi + hi + di) % 3]
                case = _case(1, sq, sk, 2, hd, dtype, causal, "bshd", "contiguous", mods=mods)
                if case.name not in names:
                    cases.append(case)
    # a BlockMask of whole 128 x 128 blocks (with a window, or causal): the Hopper kernels that skip its empty tiles
    # without an element mask (config.MOD_BLOCKS, config.FWD_SM90_WS_TILES_BLOCKS)
    for hi, hd in enumerate(config.FWD_SM90_WS_TILES_BLOCKS):
        for di, dtype in enumerate(("fp16", "bf16")):
            for mi, causal in enumerate((False, True)):
                sq, sk = ((300, 517), (517, 300), (256, 420))[(mi + hi + di) % 3]
                cases.append(_case(1, sq, sk, 2, hd, dtype, causal, "bshd", "contiguous",
                                   mods=config.MODS_BLOCKS_CHECKED[causal][0]))
    # kv-cache decoding: every decode instantiation (kernel head dim x dtype x causal), paged and dense caches,
    # split-KV with its merge kernel, grouped query heads packed as rows; seqlen_k: cache capacity per sequence
    for hi, hd in enumerate(config.KERNEL_HEAD_DIMS):
        for ci, (dtype, causal) in enumerate((("fp16", False), ("fp16", True), ("bf16", False), ("bf16", True))):
            j = hi * 4 + ci
            cases.append(_case(2, (1, 3, 17)[j % 3], 256 if j % 2 else 320, 4, hd, dtype, causal, "bshd", "contiguous",
                               kind="kvcache", kv_heads=(4, 2, 1)[j % 3], paged=bool(j % 2), splits=(0, 1, 3)[j % 3]))
    # decoding with the window, ALiBi and the softcap (all but the window when causal), every decode modifier
    # kernel, with the kv cache's other options: cache_leftpad, the rotary embedding, 48-row pages (rows gathered
    # across pages) or a dense cache indexed by cache_batch_idx
    for hi, hd in enumerate(config.KERNEL_HEAD_DIMS):
        for ci, (dtype, causal) in enumerate((("fp16", False), ("fp16", True), ("bf16", False), ("bf16", True))):
            j = hi * 4 + ci
            mods = config.MODS_DECODE & ~(config.MOD_WINDOW if causal else 0)
            cases.append(_case(2, (3, 1, 17)[j % 3], 288 if j % 2 else 336, 4, hd, dtype, causal, "bshd", "contiguous",
                               kind="kvcache", kv_heads=(2, 4, 1)[j % 3], paged=bool(j % 2), splits=(1, 0, 3)[j % 3],
                               mods=mods))
    return cases + fp8_cases() + wide_cases()


def fp8_cases() -> list[Case]:
    """The FP8 forward: every instantiation (head dim x output dtype x full (persistent where the rows are short),
    causal and window (persistent with a work queue at head dims 64 and 128), causal past 1k keys (three consumers at
    head dim 64) and full on long rows),
    each on a seqlen pair of _PAIRS (the long rows on their own), both layouts, every stride kind (padded, misaligned
    and transposed views are copied before the TMA loads), grouped-query heads; and packed sequences (with an empty
    one and causal rows that see no key)."""
    cases = []
    pairs = _PAIRS[0] + _PAIRS[1]
    for hi, hd in enumerate(config.FWD_SM90_FP8_TILES):
        for di, dtype in enumerate(("fp16", "bf16")):
            for mi, (causal, mods) in enumerate(((False, 0), (True, 0), (False, config.MOD_WINDOW))):
                j = 6 * hi + 3 * di + mi
                sq, sk = pairs[(j + hi) % len(pairs)]
                cases.append(_case(1 + j % 2, sq, sk, 2, hd, dtype, causal, LAYOUTS[j % 2], STRIDES[j % 4],
                                   kind="fp8", kv_heads=1 if j % 3 == 0 else 0, mods=mods))
    # causal rows of more than config.FWD_SM90_FP8_CAUSAL_LONG_KEYS keys: three consumers at head dim 64
    cases += [_case(1, 1700, sk + 64, 2, hd, dtype, True, layout, "contiguous", kind="fp8", kv_heads=kv)
              for hd, sk in config.FWD_SM90_FP8_CAUSAL_LONG_KEYS.items()
              for dtype, layout, kv in (("fp16", "bshd", 0), ("bf16", "bhsd", 1))]
    # non-causal rows of more than config.FWD_SM90_FP8_SHORT_KEYS keys: the one-item grid (shorter rows: persistent)
    cases += [_case(1, 200, config.FWD_SM90_FP8_SHORT_KEYS + 16, 1, hd, dtype, False, layout, "contiguous", kind="fp8")
              for hd in config.FWD_SM90_FP8_TILES_SHORT for dtype, layout in (("fp16", "bshd"), ("bf16", "bhsd"))]
    cases += [_case(4, 203, 113, 2, 128, "bf16", True, "bshd", "contiguous", kind="fp8_varlen", kv_heads=1),
              _case(4, 113, 203, 2, 64, "fp16", False, "bshd", "contiguous", kind="fp8_varlen"),
              _case(4, 130, 130, 2, 256, "bf16", False, "bshd", "contiguous", kind="fp8_varlen", mods=config.MOD_WINDOW)]
    return cases


# The seqlen pairs of _PAIRS in one list; a wide dtype's (kernel head dim, causal) cases take every third one, so
# each dtype meets long-and-thin pairs, single rows and Sq > Sk / Sq < Sk both causal and not.
_WIDE_PAIRS = _PAIRS[0] + _PAIRS[1]


def wide_cases() -> list[Case]:
    """float32 (precision "fp32" and "tf32") and float64 cases (at the end of the default set, so the 16-bit cases
    keep their indices): every shipped wide instantiation (config.all_wide_configs: each kernel head dim and causal
    flag without modifiers, and the modifier sets of config.wide_mods_checked), over both layouts, every stride kind,
    the odd seqlen pairs, zero-padded head dims, grouped-query heads and packed sequences. No kv-cache cases (the
    decode kernels are 16-bit only). A sanitizer spends more per score on the wide kernels (WORK_WEIGHT), so their
    problems are smaller than the 16-bit ones where that loses no coverage: one head and one sequence on the pairs
    of many scores from kernel head dim 128 (64 for float64) up, and the modifier cases on 71 x 137 / 137 x 71 (a
    full and a partial tile of the largest tiles, 128 rows, on the long side, several tiles of every smaller
    one)."""
    cases = []
    for di, dtype in enumerate(config.WIDE_DTYPES):
        for n, (hd, causal) in enumerate((hd, c) for hd in config.WIDE_KERNEL_HEAD_DIMS[dtype] for c in (False, True)):
            sq, sk = _WIDE_PAIRS[(3 * n + di) % 8]
            if hd * WORK_WEIGHT[dtype] >= 512 and sq * sk >= 4096:
                b, h = 1, 1
            else:
                b, h = (2, 1) if (n + di) % 2 else (1, 2)
            cases.append(_case(b, sq, sk, h, hd, dtype, causal, LAYOUTS[(n + n // 4 + di) % 2],
                               STRIDES[(n + di) % 4]))
    # score modifiers: the compile check's sets (float32: window alone, all four with causal folded into the window,
    # all but the window on a causal kernel; float64: the window alone), per kernel head dim. Two heads with the
    # heavy modifiers (a slope per head; the bias is shared by the heads, so its gradient sums over them: atomics);
    # the causal (dropout) cases on Sq < Sk, where every row sees many keys (see the 16-bit modifier cases above)
    for di, dtype in enumerate(config.WIDE_DTYPES):
        for hi, hd in enumerate(config.WIDE_KERNEL_HEAD_DIMS[dtype]):
            for causal in (False, True):
                for mods in config.wide_mods_checked(dtype, causal):
                    sq, sk = (71, 137) if causal or (hi + di) % 2 else (137, 71)
                    cases.append(_case(1, sq, sk, 2 if config.heavy_mods(mods) else 1, hd, dtype, causal, "bshd",
                                       "contiguous", mods=mods))
    # a bias alone, causal or beside a window, per float32 dtype and TF32 head dim: on sm_90a the TF32 wgmma kernels'
    # bias and dBias (head dims 32, 64 and 128: at 128 the backward's cluster pairs); the bias shared by two heads
    # (dBias by red.add)
    for i, (dtype, hd, (causal, mods)) in enumerate(
            (dt, hd, cm) for dt in ("fp32", "tf32") for hd in (32, 64, 128)
            for cm in ((False, config.MOD_BIAS), (True, config.MOD_BIAS), (False, config.MOD_BIAS | config.MOD_WINDOW))):
        sq, sk = ((137, 71), (71, 137))[i % 2]
        cases.append(_case(1, sq, sk, 2, hd, dtype, causal, "bshd", "contiguous", mods=mods))
    # head dims without their own wide kernel (zero-padded columns), grouped-query heads, packed sequences (lengths
    # cycling through seqlen, 1, 0, 17)
    cases += [_case(1, 113, 203, 1, 96, "fp32", True, "bhsd", "misaligned"),
              _case(1, 17, 1023, 1, 200, "tf32", False, "bshd", "padded"),
              _case(1, 203, 113, 1, 72, "fp64", True, "bshd", "transposed"),
              _case(2, 1023, 17, 1, 8, "fp64", False, "bhsd", "misaligned"),
              _case(1, 71, 137, 4, 64, "fp32", True, "bshd", "padded", kv_heads=2),
              _case(1, 203, 17, 4, 128, "tf32", False, "bhsd", "contiguous", kv_heads=1),
              _case(1, 17, 203, 4, 32, "fp64", True, "bshd", "contiguous", kv_heads=1),
              _case(4, 113, 203, 2, 96, "fp32", True, "bshd", "contiguous", kind="varlen", kv_heads=1),
              _case(4, 203, 113, 2, 64, "tf32", False, "bshd", "contiguous", kind="varlen"),
              _case(4, 113, 203, 2, 40, "fp64", True, "bshd", "contiguous", kind="varlen", kv_heads=1)]
    # causal rows past config.FWD_SM90_TF32_SHORT_CAUSAL_KEYS: the TF32 forward's three consumer warpgroups with a
    # band (the shorter causal cases above take its two-consumer tiles), 1100 rows: the last 192-row block part empty
    cases += [_case(1, 1100, 1100, 1, 64, "tf32", True, "bhsd", "contiguous"),
              _case(1, 1100, 1030, 1, 32, "fp32", True, "bshd", "contiguous", kv_heads=1),
              _case(1, 1030, 1100, 1, 24, "tf32", True, "bshd", "padded")]
    # ALiBi with a mask (one TF32 kernel takes either or both), plain, causal and beside a window, with and without a
    # bias, per float32 dtype and TF32 head dim: on sm_90a the TF32 wgmma kernels' alibi_mask_f32 (rows of 70 and 136
    # keys take the mask's key-pair loads, rows of 71 and 137 the per-score loads)
    W, B, AM = config.MOD_WINDOW, config.MOD_BIAS, config.MOD_ALIBI | config.MOD_MASK
    for i, (dtype, hd, (causal, mods)) in enumerate(
            (dt, hd, cm) for dt in ("fp32", "tf32") for hd in (32, 64, 128)
            for cm in ((False, AM), (True, AM), (False, AM | W), (False, AM | B), (True, AM | B), (False, AM | B | W))):
        sq, sk = ((137, 70), (71, 136), (136, 71))[i % 3]
        cases.append(_case(1, sq, sk, 2, hd, dtype, causal, "bshd", "contiguous", mods=mods))
    # a BlockMask (128 x 128 blocks, half kept: empty, full and partial tiles at the TF32 kernels' tiles), per float32
    # dtype and TF32 head dim, causal or not, two query heads on one K/V head for half of them: on sm_90a the TF32
    # kernels' tile skipping (the dK / dV producer's step words, the walks of the forward and dQ kernels)
    for i, (dtype, hd) in enumerate((dt, hd) for dt in ("fp32", "tf32") for hd in (32, 64, 128)):
        cases.append(_case(1, (300, 520)[i % 2], (520, 300)[i % 2], 2, hd, dtype, bool(i % 2), "bshd", "contiguous",
                           kv_heads=1 if i % 3 == 1 else 0, mods=config.MOD_BLOCKS))
    # a key_padding_mask alone (a prefix of each sequence's keys kept): its tile map made per call
    # (padding_tiles_kernel), which the Hopper 16-bit and TF32 kernels read to skip the padded key tiles
    for i, (dtype, hd) in enumerate((("fp16", 64), ("bf16", 128), ("fp32", 64), ("tf32", 128))):
        cases.append(_case(2, (300, 520)[i % 2], (520, 300)[i % 2], 1, hd, dtype, bool(i % 2), "bshd", "contiguous",
                           mods=config.MOD_MASK, padding=True))
    # the same beside a bias (Evoformer's pair bias and MSA mask) at head dims 32 and 64, rows of whole 16-byte chunks
    # and not: on sm_90a the 16-bit forward's bias loop on every tile and its staged mask on the partial ones
    for i, (dtype, hd) in enumerate((("bf16", 32), ("fp16", 64))):
        cases.append(_case(2, (256, 200)[i], (256, 200)[i], 1, hd, dtype, False, "bshd", "contiguous",
                           mods=config.MOD_BIAS | config.MOD_MASK, padding=True))
    return cases


def quick_cases() -> list[Case]:
    return [_case(1, 113, 203, 2, 64, "fp16", True, "bshd", "padded"),
            _case(2, 1023, 17, 1, 128, "bf16", False, "bhsd", "transposed"),
            _case(1, 17, 1023, 2, 256, "fp16", True, "bshd", "contiguous"),
            _case(1, 1, 113, 1, 72, "bf16", True, "bshd", "misaligned"),
            _case(2, 1, 1, 1, 32, "bf16", False, "bhsd", "contiguous"),
            _case(1, 203, 113, 2, 192, "fp16", True, "bhsd", "padded"),
            _case(1, 113, 203, 1, 96, "fp32", True, "bhsd", "misaligned"),
            _case(2, 17, 1023, 1, 64, "tf32", False, "bshd", "padded"),
            _case(1, 203, 113, 1, 40, "fp64", True, "bshd", "transposed")]


def case_set(name: str) -> list[Case]:
    if name == "default":
        return default_cases()
    if name == "quick":
        return quick_cases()
    raise ValueError(f"case set {name!r}; allowed: 'default', 'quick'")


# --- parallel compilation (also used by the GPU tests) ----------------------------------------------

def _compile_one(job):
    name, arch = job
    t0 = time.perf_counter()
    try:
        _compile.compile_kernel(name, arch)
        return name, None, time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported to the caller
        return name, f"{type(e).__name__}: {e}", time.perf_counter() - t0


def compile_configs(configs, arch: str | None = None, jobs: int | None = None) -> dict:
    """Compile kernel configs into the disk cache, in parallel processes once a cache miss shows up.

    NVRTC holds the GIL (threads gave 2.8 s vs 3.1 s sequential for 4 kernels), so misses go to a process
    pool. Cached kernels load in milliseconds in this process. Returns {cpp name: error or None}."""
    names = list(dict.fromkeys(c.cpp_name() for c in configs))
    if arch is None:
        arch = _compile.device_arch()
    results: dict = {}
    pending = list(names)
    # cheap in-process pass while kernels come from the cache; stop at the first real compile
    while pending:
        name, err, seconds = _compile_one((pending[0], arch))
        results[name] = err
        pending.pop(0)
        if seconds > 0.25:
            break
    if not pending:
        return results
    jobs = jobs or min(len(pending), os.cpu_count() or 1)
    try:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for name, err, _ in pool.map(_compile_one, [(n, arch) for n in pending]):
                results[name] = err
    except Exception:  # noqa: BLE001 - no process pool here (e.g. a sandbox): compile in this process
        for name in pending:
            if name not in results:
                results[name] = _compile_one((name, arch))[1]
    return results


# --- the driver (runs inside the sanitizer) ---------------------------------------------------------

# bytes of an element of each kernel dtype name, and the unsigned type of its bits (uploads, digests, NaN checks)
_ELEM_BYTES = {"fp16": 2, "bf16": 2, **config.WIDE_ELEM_BYTES}
_UINT = {2: "uint16", 4: "uint32", 8: "uint64"}
# the exponent field (all ones: inf or NaN) of each input / output dtype, by NumPy dtype name
_EXP_MASKS = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000, "float64": 0x7FF0000000000000}


def _lowp_np(rng, shape, dtype: str):
    """Standard normal host data of a kernel dtype name: float16, bfloat16, float32 ("fp32", "tf32": the kernels
    round to TF32 themselves) or float64 (drawn in float64, all 53 bits)."""
    import numpy as np

    if dtype == "fp64":
        return rng.standard_normal(shape, dtype=np.float64)
    x = rng.standard_normal(shape, dtype=np.float32)
    if dtype in ("fp32", "tf32"):
        return x
    if dtype == "fp16":
        return x.astype(np.float16)
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16)


def _upload(x_np):
    """Host array (fp16, bf16, float32, float64) -> CuPy array of the same dtype, by a plain copy of its bits: a
    cudaMemcpy, no kernel. The driver launches nothing but cuflash's kernels before and between the attention calls
    (no CuPy random, cast or elementwise kernel), so the sanitizers' reports, and initcheck's view of which bytes
    were written, are the library's; the bits go up as unsigned integers of the element's width (CuPy has no
    bfloat16 arithmetic, and a typed copy could convert)."""
    import cupy as cp
    import numpy as np

    x = np.ascontiguousarray(x_np)
    return cp.asarray(x.view(np.dtype(_UINT[x.dtype.itemsize]))).view(x.dtype)


def _chunk_elems(dtype: str) -> int:
    """Elements of one 16-byte chunk (the kernels' read unit): 8 for 16-bit, 4 for float32, 2 for float64."""
    return 16 // _ELEM_BYTES[dtype]


def strided_view(case: Case, seqlen: int, heads: int, make):
    """The (B, S, H, D) or (B, H, S, D) view of a dense case's stride kind over an array of shape s from make(s), a
    fully initialized buffer (initcheck stays meaningful). padded: 1 extra batch, 3 extra rows, 1 extra head and
    one 16-byte chunk of extra columns (8 / 4 / 2 elements), every stride a multiple of 16 bytes; transposed: the
    other layout's contiguous array, transposed; misaligned: a head stride of D + half a chunk (D + 4 for 16-bit,
    D + 2 for float32, D + 1 for float64), not a multiple of 16 bytes, so the library copies the view
    (_validate.needs_aligned_copy)."""
    b, d = case.batch, case.head_dim
    logical = (b, seqlen, heads, d) if case.layout == "bshd" else (b, heads, seqlen, d)
    chunk = _chunk_elems(case.dtype)
    if case.strides == "contiguous":
        return make(logical)
    if case.strides == "padded":
        pad = (1, 3, 1) if case.layout == "bshd" else (1, 1, 3)
        big = make(tuple(n + p for n, p in zip(logical[:3], pad)) + (d + chunk,))
        return big[pad[0]:, pad[1]:, pad[2]:, :d]
    if case.strides == "transposed":
        other = (b, heads, seqlen, d) if case.layout == "bshd" else (b, seqlen, heads, d)
        return make(other).transpose(0, 2, 1, 3)
    if case.strides == "misaligned":
        return make(logical[:3] + (d + chunk // 2,))[..., :d]
    raise ValueError(f"strides={case.strides!r}")


def _driver_input(rng, case: Case, seqlen: int, heads: int = 0):
    """A (B, S, H, D) or (B, H, S, D) input with the case's strides (H: heads or, for k and v, heads_kv); its
    whole buffer is initialized (`strided_view`)."""
    return strided_view(case, seqlen, heads or case.heads, lambda shape: _upload(_lowp_np(rng, shape, case.dtype)))


def _bits_np(x):
    import cupy as cp

    return cp.asnumpy(x.view(cp.dtype(_UINT[x.dtype.itemsize])))


def _digest(x) -> str:
    return hashlib.sha1(_bits_np(x).tobytes()).hexdigest()[:16]


def _host_problems(name: str, x, is_lse: bool = False) -> list[str]:
    """NaN/inf found on the host (no GPU kernel): every output element must be written and finite
    (lse, float32 or float64, may be -inf on rows that see no key)."""
    import numpy as np

    bits = _bits_np(x)
    if is_lse:
        f = bits.view(np.float64 if x.dtype.itemsize == 8 else np.float32)
        bad = int(np.isnan(f).sum() + (f == np.inf).sum())
    else:
        exp_mask = bits.dtype.type(_EXP_MASKS[np.dtype(x.dtype).name])
        bad = int(((bits & exp_mask) == exp_mask).sum())
    return [f"{name}: {bad} NaN/inf elements"] if bad else []


def _verify(case: Case, q, k, v, dout, o, lse, grads_atomic, grads_det, mods: dict | None = None) -> list[str]:
    """The pass rule (README.md, Tests) against the float64 reference on the GPU (unsanitized run only);
    cases with score modifiers against the NumPy reference (cuflash.reference) with the specified dropout
    mask (cuflash.philox)."""
    import cupy as cp

    from . import _xpref

    def bshd32(x):
        x32 = _xpref.to_float32(x)
        return x32 if case.layout == "bshd" else x32.transpose(0, 2, 1, 3)

    q32, k32, v32, do32 = (bshd32(x) for x in (q, k, v, dout))
    if case.mods:
        from . import reference as refmod

        kw = _model_options(case, mods, host=True)
        h32 = [cp.asnumpy(x) for x in (q32, k32, v32, do32)]
        o64, lse64 = (cp.asarray(x) for x in refmod.attention_forward64(*h32[:3], case.causal, **kw))
        o_lowp = cp.asarray(refmod.attention_lowp(*h32[:3], case.dtype, case.causal, **kw))
        g64 = [cp.asarray(x) for x in refmod.attention_backward64(h32[3], *h32[:3], case.causal, **kw)]
        glowp = [cp.asarray(x) for x in refmod.attention_backward_lowp(h32[3], *h32[:3], case.dtype, case.causal, **kw)]
        if "bias" in kw:  # dbias (float32, shaped like the bias) after dq, dk, dv of the atomic mode
            rule_dbias = (grads_atomic[3], g64[3], glowp[3])
    else:
        o64, lse64 = _xpref.attention_forward64(q32, k32, v32, case.causal)
        o_lowp = _xpref.attention_lowp(q32, k32, v32, case.dtype, case.causal)
        g64 = _xpref.attention_backward64(do32, q32, k32, v32, case.causal)
        glowp = _xpref.attention_backward_lowp(do32, q32, k32, v32, case.dtype, case.causal)
    problems = []

    def rule(name, got, ref, low, factor):
        err = float(cp.abs(bshd32(got) - ref).max()) if got.size else 0.0
        bound = factor * (float(cp.abs(low - ref).max()) if got.size else 0.0) + 1e-5
        if not err <= bound:
            problems.append(f"{name}: {err:.3e} > {bound:.3e}")

    rule("o", o, o64, o_lowp, 2)
    finite = cp.isfinite(lse64)
    if not bool((cp.isfinite(lse) == finite).all()):
        problems.append("lse: -inf rows differ from the reference")
    elif lse.size:
        lse_err = float(cp.abs(cp.where(finite, lse, 0.0) - cp.where(finite, lse64, 0.0)).max())
        if lse_err > 1e-3:
            problems.append(f"lse: {lse_err:.3e} > 1e-3")
    for mode, grads in (("", grads_atomic), ("det ", grads_det)):
        for name, g, ref, low in zip(("dq", "dk", "dv"), grads, g64, glowp):
            rule(mode + name, g, ref, low, 3)
    if case.mods & config.MOD_BIAS:
        got, want, low = rule_dbias
        err = float(cp.abs(got - want).max()) if got.size else 0.0
        bound = 3 * (float(cp.abs(low - want).max()) if got.size else 0.0) + 1e-5
        if not err <= bound:
            problems.append(f"dbias: {err:.3e} > {bound:.3e}")
    return problems


def _model_options(case: Case, mods: dict, host: bool) -> dict:
    """The case's score modifiers (`mods`: the cuflash keyword arguments) as keyword arguments of the references:
    window, softcap, ALiBi slopes, bias, mask, and dropout as dropout_p with the keep mask of cuflash.philox.
    host: NumPy arrays for cuflash.reference (the bias in float64, the slopes as given); else the CuPy arrays the
    kernels read, for cuflash._xpref.attention_plain on the GPU."""
    import cupy as cp
    import numpy as np

    from . import philox

    kw = {n: mods[n] for n in ("window", "softcap") if n in mods}
    for n, dtype in (("alibi_slopes", None), ("bias", np.float64), ("mask", bool), ("key_padding_mask", bool)):
        if n in mods:
            if not host:
                kw[n] = mods[n]
            else:
                kw[n] = cp.asnumpy(mods[n]) if dtype is None else cp.asnumpy(mods[n]).astype(dtype)
    if "dropout_p" in mods:
        keep = philox.dropout_mask(case.batch, case.heads, case.seqlen_q, case.seqlen_k, mods["dropout_p"],
                                   mods["seed"], mods["offset"])
        kw.update(dropout_p=mods["dropout_p"], dropout_mask=keep if host else cp.asarray(keep))
    return kw


# --- the float32 / float64 pass rule --------------------------------------------------------------------------
#
# For each output X (o, dq, dk, dv, dbias), a maximum over its elements:
#     max|X - X_ref| <= F * max|X_plain - X_ref| + floor * max(1, max|X_ref|)
# F = 2 for o, 3 for the gradients (the 16-bit rule's factors); X_plain is plain, unfused attention in the case's
# precision on the GPU (cuflash._xpref.attention_plain, and its backward and varlen forms): "fp32" float32
# throughout (cuBLAS float32 matmuls: `_float32_matmuls_exact`), "tf32" every matmul input rounded to TF32 (the
# kernels' one TF32 pass: the bound follows TF32's 2^-11 steps rather than float32's), "fp64" float64 throughout.
# X_ref: float32 inputs: float64 attention (cuflash._xpref on the GPU; with score modifiers cuflash.reference on
# the host); float64 inputs: extended precision on the host (np.longdouble through _xpref.attention_plain's "ext",
# 64 mantissa bits on x86), or, where np.longdouble is no wider than float64, float64 attention, whose own error
# then makes the plain error ~0 and the floor the bound. The floors (WIDE_FLOORS) scale with the largest reference
# value: 1e-5 for float32 (~80 float32 ulps of it; a row that sees one key has an exact plain result while 3xTF32
# keeps ~21 bits of each operand's low part), 1e-12 for float64 (~4500 ulps; the kernels and plain float64 are off
# by 1e-16..1e-15). lse: -inf exactly on the rows the reference has -inf, and elsewhere
#     max|lse - lse_ref| <= 2 * max|lse_plain - lse_ref| + tol * max(1, max|lse_ref|)
# tol (WIDE_LSE_TOL) 1e-3 for float32, 1e-9 for float64; lse float32 for float32 inputs, float64 for float64 ones.
# This is a check that the sanitized kernels compute the right thing; tests/test_gpu_wide.py checks accuracy with
# tighter floors.
WIDE_FLOORS = {"fp32": 1e-5, "tf32": 1e-5, "fp64": 1e-12}
WIDE_LSE_TOL = {"fp32": 1e-3, "tf32": 1e-3, "fp64": 1e-9}
_FLOAT32_MATMUL: dict = {}


def _extended_precision() -> bool:
    """np.longdouble is wider than float64 (x86: 80-bit extended, eps 1.1e-19) and keeps its bits through matmul."""
    import numpy as np

    if not float(np.finfo(np.longdouble).eps) < 1e-18:
        return False
    a = np.array([[[1.0, 2.0 ** -60]]], dtype=np.longdouble)
    return bool((a @ np.ones((1, 2, 1), dtype=np.longdouble))[0, 0, 0] != 1)


def _float32_matmuls_exact() -> bool:
    """Whether CuPy's float32 matmul is float32, as the "fp32" plain attention needs: CUPY_TF32=1 makes CuPy round
    its inputs to TF32 (then this switches CuPy's float32 compute type back to its default), cuBLAS's
    NVIDIA_TF32_OVERRIDE=1 does too (not switchable: the check fails). (1 + 2^-20) times the identity is exact in
    float32 and 1 in TF32. Checked once per process (a cuBLAS call: the unsanitized reference run only)."""
    if "exact" not in _FLOAT32_MATMUL:
        import cupy as cp
        import numpy as np

        def exact():
            a = cp.full((1, 2, 16, 16), 1 + 2.0 ** -20, dtype=cp.float32)
            eye = cp.broadcast_to(cp.eye(16, dtype=cp.float32), (1, 2, 16, 16))
            return bool(cp.array_equal(a @ eye, a))

        ok = exact()
        if not ok:
            try:
                from cupy._core import _routines_linalg as linalg

                linalg.set_compute_type(np.dtype(np.float32), linalg.COMPUTE_TYPE_DEFAULT)
                ok = exact()
            except (ImportError, AttributeError):
                pass
        _FLOAT32_MATMUL["exact"] = ok
    return _FLOAT32_MATMUL["exact"]


def _wide_references(case: Case, inputs, options: dict, varlen=None):
    """(reference, plain) of a wide case, each (o, lse, grads): see the pass rule above. inputs: (q, k, v, dout), CuPy
    arrays in the bshd order (dense) or packed (varlen = (cu_seqlens_q, cu_seqlens_k), NumPy int32); options: the
    score modifiers (`_model_options`, host=False)."""
    import cupy as cp

    from . import _xpref
    from . import reference as refmod

    q, k, v, dout = inputs
    pre = tuple(varlen or ())
    fwd, bwd = ((_xpref.attention_varlen_plain, _xpref.attention_varlen_backward_plain) if varlen else
                (_xpref.attention_plain, _xpref.attention_backward_plain))
    plain = (*fwd(q, k, v, *pre, case.dtype, case.causal, **options),
             bwd(dout, q, k, v, *pre, case.dtype, case.causal, **options))
    if case.dtype == "fp64":
        if _extended_precision():
            host = [cp.asnumpy(x) for x in inputs]
            opts = {n: cp.asnumpy(x) if isinstance(x, cp.ndarray) else x for n, x in options.items()}
            ref = (*fwd(*host[:3], *pre, "ext", case.causal, **opts),
                   bwd(host[3], *host[:3], *pre, "ext", case.causal, **opts))
        else:
            ref = (*fwd(q, k, v, *pre, "fp64", case.causal, **options),
                   bwd(dout, q, k, v, *pre, "fp64", case.causal, **options))
    elif options:  # float32 with score modifiers (dense): the NumPy float64 reference
        host = [cp.asnumpy(x) for x in inputs]
        opts = {n: cp.asnumpy(x) if isinstance(x, cp.ndarray) else x for n, x in options.items()}
        if "bias" in opts:
            opts["bias"] = opts["bias"].astype("float64")
        o64, lse64 = (cp.asarray(x) for x in refmod.attention_forward64(*host[:3], case.causal, **opts))
        ref = (o64, lse64, [cp.asarray(x) for x in refmod.attention_backward64(host[3], *host[:3], case.causal,
                                                                                **opts)])
    elif varlen:
        ref = (*_xpref.attention_varlen_forward64(q, k, v, *pre, case.causal),
               _xpref.attention_varlen_backward64(dout, q, k, v, *pre, case.causal))
    else:
        ref = (*_xpref.attention_forward64(q, k, v, case.causal),
               _xpref.attention_backward64(dout, q, k, v, case.causal))
    return ref, plain


def _on_module_of(ref, x):
    """x (CuPy or NumPy) as an array of ref's module: the host in ref's dtype (np.longdouble) for a NumPy ref, else a
    CuPy float64 array."""
    import cupy as cp
    import numpy as np

    if isinstance(ref, np.ndarray):
        return np.asarray(cp.asnumpy(x) if isinstance(x, cp.ndarray) else x).astype(ref.dtype)
    return cp.asarray(x, dtype=cp.float64)


def _wide_rule(problems: list, name: str, got, ref, plain, factor: float, floor: float) -> None:
    """max|got - ref| <= factor * max|plain - ref| + floor * max(1, max|ref|) (problems gets a line if not)."""
    if tuple(got.shape) != tuple(ref.shape):
        problems.append(f"{name}: shape {tuple(got.shape)}, the reference's {tuple(ref.shape)}")
        return
    if not got.size:
        return
    got, plain = _on_module_of(ref, got), _on_module_of(ref, plain)
    err, plain_err, top = (float(abs(x).max()) for x in (got - ref, plain - ref, ref))
    bound = factor * plain_err + floor * max(1.0, top)
    if not err <= bound:
        problems.append(f"{name}: {err:.3e} > {bound:.3e} ({factor:g} x the plain error {plain_err:.3e} + {floor:g} "
                        f"x max(1, {top:.3g}))")


def _wide_lse_rule(problems: list, case: Case, lse, ref, plain) -> None:
    import cupy as cp
    import numpy as np

    want = np.float64 if case.dtype == "fp64" else np.float32
    if lse.dtype != want:
        problems.append(f"lse: dtype {lse.dtype}, expected {np.dtype(want)}")
    if tuple(lse.shape) != tuple(ref.shape):
        problems.append(f"lse: shape {tuple(lse.shape)}, the reference's {tuple(ref.shape)}")
        return
    xp = np if isinstance(ref, np.ndarray) else cp
    got, plain = _on_module_of(ref, lse), _on_module_of(ref, plain)
    seen = xp.isfinite(ref)
    if not bool((xp.isfinite(got) == seen).all()) or not bool((got[~seen] == -np.inf).all()):
        problems.append("lse: -inf rows differ from the reference (or NaN)")
        return
    if not lse.size:
        return
    zero = xp.zeros((), dtype=ref.dtype)
    ref_seen = xp.where(seen, ref, zero)  # -inf rows out of the differences
    err, plain_err, top = (float(abs(x).max()) for x in (xp.where(seen, got, zero) - ref_seen,
                                                        xp.where(seen, plain, zero) - ref_seen, ref_seen))
    tol = WIDE_LSE_TOL[case.dtype]
    bound = 2 * plain_err + tol * max(1.0, top)
    if not err <= bound:
        problems.append(f"lse: {err:.3e} > {bound:.3e} (2 x the plain error {plain_err:.3e} + {tol:g} x "
                        f"max(1, {top:.3g}))")


def _wide_rules(case: Case, o, lse, grads, ref, plain, mode: str = "") -> list[str]:
    """The float32 / float64 pass rule on o, lse and the gradients (dq, dk, dv and, with a bias, dbias), all in the
    references' order (bshd or packed); o None: the gradients only (mode: a prefix of their names, "det ")."""
    problems = []
    if case.dtype == "fp32" and not _float32_matmuls_exact():
        problems.append("CuPy's float32 matmul rounds to TF32 here (NVIDIA_TF32_OVERRIDE=1?): the plain float32 "
                        "attention of the pass rule would be TF32")
    floor = WIDE_FLOORS[case.dtype]
    if o is not None:
        _wide_rule(problems, "o", o, ref[0], plain[0], 2, floor)
        _wide_lse_rule(problems, case, lse, ref[1], plain[1])
    for name, g, r, p in zip(("dq", "dk", "dv", "dbias"), grads, ref[2], plain[2]):
        _wide_rule(problems, mode + name, g, r, p, 3, floor)
    return problems


def _verify_wide(case: Case, q, k, v, dout, o, lse, grads, grads_det, mods: dict) -> list[str]:
    """The float32 / float64 pass rule (above) for a dense case (unsanitized run only), on the default and the
    deterministic gradients."""
    def bshd(x):
        return x if case.layout == "bshd" else x.transpose(0, 2, 1, 3)

    ref, plain = _wide_references(case, [bshd(x) for x in (q, k, v, dout)], _model_options(case, mods, host=False))
    return _wide_rules(case, bshd(o), lse, [bshd(g) for g in grads[:3]] + list(grads[3:]), ref, plain) + \
        _wide_rules(case, None, None, [bshd(g) for g in grads_det[:3]], ref, plain, "det ")


def _rule(problems: list, name: str, got, ref, low, factor: float, to32=None) -> None:
    """The pass rule: max|got - ref64| <= factor * max|low - ref64| + 1e-5 (problems gets a line if not)."""
    import cupy as cp

    from . import _xpref

    got32 = _xpref.to_float32(got) if to32 is None else to32(got)
    err = float(cp.abs(got32 - ref).max()) if got.size else 0.0
    bound = factor * (float(cp.abs(low - ref).max()) if got.size else 0.0) + 1e-5
    if not err <= bound:
        problems.append(f"{name}: {err:.3e} > {bound:.3e}")


def _lse_rule(problems: list, lse, lse64) -> None:
    import cupy as cp

    finite = cp.isfinite(lse64)
    if not bool((cp.isfinite(lse) == finite).all()):
        problems.append("lse: -inf rows differ from the reference")
    elif lse.size:
        lse_err = float(cp.abs(cp.where(finite, lse, 0.0) - cp.where(finite, lse64, 0.0)).max())
        if lse_err > 1e-3:
            problems.append(f"lse: {lse_err:.3e} > 1e-3")


def _varlen_lengths(case: Case):
    """Sequence lengths of a varlen case: (seqlen, 1, 0, 17) for queries and (seqlen_k, 17, 0, 1) for keys,
    cycling over the batch, so it has empty sequences and rows that see no key (causal, len_q > len_k)."""
    lens_q = [(case.seqlen_q, 1, 0, 17)[b % 4] for b in range(case.batch)]
    lens_k = [(case.seqlen_k, 17, 0, 1)[b % 4] for b in range(case.batch)]
    return lens_q, lens_k


def _run_varlen(case: Case, rng, verify: bool):
    import cupy as cp
    import numpy as np

    from . import _xpref, attention_varlen_backward, attention_varlen_forward

    lens_q, lens_k = _varlen_lengths(case)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    tq, tk, d = int(cu_q[-1]), int(cu_k[-1]), case.head_dim
    q, dout = (_upload(_lowp_np(rng, (tq, case.heads, d), case.dtype)) for _ in range(2))
    k, v = (_upload(_lowp_np(rng, (tk, case.heads_kv, d), case.dtype)) for _ in range(2))
    cuq, cuk = cp.asarray(cu_q), cp.asarray(cu_k)
    mq, mk = max(lens_q), max(lens_k)
    prec = {"precision": case.precision} if case.precision else {}
    o, lse = attention_varlen_forward(q, k, v, cuq, cuk, mq, mk, causal=case.causal, **prec)
    grads = attention_varlen_backward(dout, q, k, v, o, lse, cuq, cuk, mq, mk, causal=case.causal, **prec)
    outputs = {"o": o, "lse": lse, "dq_atomic": grads[0], "dk": grads[1], "dv": grads[2]}
    grads_det = attention_varlen_backward(dout, q, k, v, o, lse, cuq, cuk, mq, mk, causal=case.causal,
                                          deterministic=True, **prec)
    outputs.update(dq_det=grads_det[0], dk_det=grads_det[1], dv_det=grads_det[2])
    problems = []
    if verify and case.wide:
        ref, plain = _wide_references(case, (q, k, v, dout), {}, varlen=(cu_q, cu_k))
        problems += _wide_rules(case, o, lse, grads, ref, plain)
        problems += _wide_rules(case, None, None, grads_det, ref, plain, "det ")
    elif verify:
        q32, k32, v32, do32 = (_xpref.to_float32(x) for x in (q, k, v, dout))
        o64, lse64 = _xpref.attention_varlen_forward64(q32, k32, v32, cu_q, cu_k, case.causal)
        _rule(problems, "o", o, o64, _xpref.attention_varlen_lowp(q32, k32, v32, cu_q, cu_k, case.dtype, case.causal), 2)
        _lse_rule(problems, lse, lse64)
        g64 = _xpref.attention_varlen_backward64(do32, q32, k32, v32, cu_q, cu_k, case.causal)
        glowp = _xpref.attention_varlen_backward_lowp(do32, q32, k32, v32, cu_q, cu_k, case.dtype, case.causal)
        for mode, gs in (("", grads), ("det ", grads_det)):
            for name, g, ref, low in zip(("dq", "dk", "dv"), gs, g64, glowp):
                _rule(problems, mode + name, g, ref, low, 3)
    return outputs, problems


FP8_SCALINGS = ("tensor", "head", "block")


def _fp8_scaling(case: Case) -> str:
    """The descale granularity of an FP8 case (from its name, so each kind meets all three): a float for the
    tensor, one per (batch, head), or one per (batch, head, 128-row block)."""
    return FP8_SCALINGS[zlib.crc32(case.name.encode()) % 3]


def _fp8_descale(rng, scaling: str, batch: int, heads: int, seqlen: int):
    """Descale factors in [1/16, 1/4) of a scaling: a Python float or a float32 CuPy array ((batch, heads) or (batch,
    heads, ceil(seqlen / 128))), and the same as float64 NumPy (batch, seqlen, heads, 1) row factors."""
    import cupy as cp
    import numpy as np

    if scaling == "tensor":
        f = float(np.float32(rng.uniform(1 / 16, 1 / 4)))
        return f, np.full((batch, seqlen, heads, 1), f)
    blocks = 1 if scaling == "head" else max(1, -(-seqlen // 128))
    f = rng.uniform(1 / 16, 1 / 4, (batch, heads, blocks)).astype(np.float32)
    rows = np.transpose(f[:, :, np.minimum(np.arange(seqlen) // 128, blocks - 1)], (0, 2, 1))[..., None]
    return cp.asarray(f if blocks > 1 else f[:, :, 0]), rows.astype(np.float64)


def _fp8_bits(rng, shape):
    """e4m3 bits (uint8 NumPy) of standard normal values: every byte a finite e4m3 number."""
    import ml_dtypes
    import numpy as np

    return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _fp8_values(x, layout: str):
    """float64 NumPy (B, S, H, D) values of e4m3 bits (a CuPy array, any strides, in `layout`)."""
    import cupy as cp
    import ml_dtypes
    import numpy as np

    vals = cp.asnumpy(x).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return vals if layout == "bshd" else vals.transpose(0, 2, 1, 3)


def _run_fp8(case: Case, rng, verify: bool):
    """The FP8 forward of a case (attention_forward, or attention_varlen_forward for fp8_varlen) on e4m3 bits with
    random descales; the pass rule of the FP8 tests (README.md, Tests): O within 2x the emulated FP8 error (P rounded
    to e4m3, reference.attention_fp8_emulated64) plus O's own rounding of the float64 reference of the dequantized
    inputs, lse within 1e-2. Where no FP8 kernel runs (not Hopper, or CUFLASH_KERNELS=mma) nothing is launched and
    no output returned: run_case notes it in the result (the FP8 API refuses those targets with a clear error)."""
    import cupy as cp
    import numpy as np

    from . import _compile, attention_forward, attention_varlen_forward
    from . import reference as refmod

    if not case.configs(_compile.device_arch()):
        return {}, []
    scaling = _fp8_scaling(case)
    window = case.mod_options().get("window")
    kw = {"causal": case.causal, "window": window, "out_dtype": case.dtype}
    if case.kind == "fp8":
        q, k, v = (strided_view(case, s, h, lambda shape: cp.asarray(_fp8_bits(rng, shape)))
                   for s, h in ((case.seqlen_q, case.heads), (case.seqlen_k, case.heads_kv),
                                (case.seqlen_k, case.heads_kv)))
        (qd, qr), (kd, kr), (vd, vr) = (_fp8_descale(rng, scaling, case.batch, h, s)
                                        for s, h in ((case.seqlen_q, case.heads), (case.seqlen_k, case.heads_kv),
                                                     (case.seqlen_k, case.heads_kv)))
        o, lse = attention_forward(q, k, v, layout=case.layout, q_descale=qd, k_descale=kd, v_descale=vd, **kw)
        if not verify:
            return {"o": o, "lse": lse}, []
        q64, k64, v64 = (_fp8_values(x, case.layout) * r for x, r in ((q, qr), (k, kr), (v, vr)))
        o64, lse64 = refmod.attention_forward64(q64, k64, v64, case.causal, window=window)
        emul = refmod.attention_fp8_emulated64(q64, k64, v64, case.causal, window=window)
        got = _fp8_out64(o)
        got = got if case.layout == "bshd" else got.transpose(0, 2, 1, 3)
        lse64_cmp, lse_cmp = lse64, lse
    else:  # packed: a descale per sequence (its batch index), head and 128-row block of the sequence's rows
        lens_q, lens_k = _varlen_lengths(case)
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
        tq, tk = int(cu_q[-1]), int(cu_k[-1])
        q, k, v = (cp.asarray(_fp8_bits(rng, (t, h, case.head_dim)))
                   for t, h in ((tq, case.heads), (tk, case.heads_kv), (tk, case.heads_kv)))

        def packed(lens, heads):  # (descale argument, float64 (1, total, heads, 1) row factors)
            arg, per_seq = _fp8_descale(rng, scaling, case.batch, heads, max(lens))  # per_seq (B, S_max, H, 1)
            seq = np.repeat(np.arange(case.batch), lens)
            local = np.concatenate([np.arange(n) for n in lens]) if sum(lens) else np.zeros(0, dtype=np.int64)
            return arg, per_seq[seq, local][None]

        (qd, qr), (kd, kr), (vd, vr) = packed(lens_q, case.heads), packed(lens_k, case.heads_kv), \
            packed(lens_k, case.heads_kv)
        o, lse = attention_varlen_forward(q, k, v, cp.asarray(cu_q), cp.asarray(cu_k), max(lens_q), max(lens_k),
                                          q_descale=qd, k_descale=kd, v_descale=vd, **kw)
        if not verify:
            return {"o": o, "lse": lse}, []
        q64, k64, v64 = (_fp8_values(x[None], "bshd") * r for x, r in ((q, qr), (k, kr), (v, vr)))
        o64 = np.zeros((1, tq, case.heads, case.head_dim))
        emul = np.zeros_like(o64)
        lse64 = np.full((1, case.heads, tq), -np.inf)
        for b in range(case.batch):
            sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if cu_q[b + 1] > cu_q[b]:
                o64[:, sq_], lse64[:, :, sq_] = refmod.attention_forward64(q64[:, sq_], k64[:, sk_], v64[:, sk_],
                                                                           case.causal, window=window)
                emul[:, sq_] = refmod.attention_fp8_emulated64(q64[:, sq_], k64[:, sk_], v64[:, sk_], case.causal,
                                                               window=window)
        got = _fp8_out64(o)[None]
        lse64_cmp, lse_cmp = lse64[0], lse  # lse (heads, total_q)
    problems = []
    out_round = (2.0 ** -8 if case.dtype == "bf16" else 2.0 ** -11) * float(np.abs(o64).max(initial=0.0))
    err = float(np.abs(np.nan_to_num(got, nan=np.inf) - o64).max(initial=0.0))
    bound = 2.0 * float(np.abs(emul - o64).max(initial=0.0)) + out_round + 1e-5
    if not err <= bound:
        problems.append(f"o: {err:.3e} > {bound:.3e} (FP8: 2x the emulated P rounding + O's rounding)")
    lse_h = cp.asnumpy(lse_cmp).astype(np.float64)
    finite = np.isfinite(lse64_cmp)
    if not (np.isfinite(lse_h) == finite).all():
        problems.append("lse: -inf rows differ from the reference")
    elif lse_h.size:
        lse_err = float(np.abs(np.where(finite, lse_h, 0.0) - np.where(finite, lse64_cmp, 0.0)).max())
        if lse_err > 1e-2:
            problems.append(f"lse: {lse_err:.3e} > 1e-2")
    return {"o": o, "lse": lse}, problems


def _fp8_out64(o):
    """float64 NumPy of an FP8 forward's O (float16 or bfloat16: converted on the host, no kernel)."""
    import cupy as cp
    import numpy as np

    return cp.asnumpy(o).astype(np.float64)


def _run_kvcache(case: Case, rng, verify: bool):
    import cupy as cp
    import numpy as np

    from . import _xpref, attention_with_kvcache

    b, sq, d, capacity = case.batch, case.seqlen_q, case.head_dim, case.seqlen_k
    q = _upload(_lowp_np(rng, (b, sq, case.heads, d), case.dtype))
    k, v = (_upload(_lowp_np(rng, (b, sq, case.heads_kv, d), case.dtype)) for _ in range(2))
    # the modifier cases also take the cache's other options: 48-row pages (tiles gathered across pages) or a dense
    # cache with a spare entry read through cache_batch_idx, cache_leftpad, and a float32 rotary table
    page = 48 if case.mods else 64
    block_table = batch_idx = leftpad = None
    kw = {}
    if case.paged:  # pages of each sequence in shuffled order, two spare pages
        pages = capacity // page
        table = rng.permutation(b * pages + 2)[:b * pages].reshape(b, pages).astype(np.int32)
        cache_shape = (b * pages + 2, page, case.heads_kv, d)
        block_table = cp.asarray(table)
    else:
        cache_shape = (b + bool(case.mods), capacity, case.heads_kv, d)
        if case.mods:
            batch_idx = np.arange(b, 0, -1, dtype=np.int32)  # entries b .. 1; entry 0 is never touched
            kw["cache_batch_idx"] = cp.asarray(batch_idx)
    k_cache, v_cache = (_upload(_lowp_np(rng, cache_shape, case.dtype)) for _ in range(2))
    lens = rng.integers(0, capacity - sq + 1, size=b).astype(np.int32)
    lens[0] = capacity - sq  # one sequence fills its cache
    if case.mods:
        leftpad = (rng.random(b) * lens).astype(np.int32)
        kw["cache_leftpad"] = cp.asarray(leftpad)
        angles = np.arange(capacity + sq)[:, None] * 0.5 ** np.arange(d // 4)[None, :]  # rotary_dim = d // 2
        kw.update(rotary_cos=cp.asarray(np.cos(angles), dtype=cp.float32),
                  rotary_sin=cp.asarray(np.sin(angles), dtype=cp.float32), rotary_interleaved=not case.causal)
        for name, value in case.mod_options(rng).items():
            kw[name] = cp.asarray(value, dtype=cp.float32) if name == "alibi_slopes" else value
    before = (k_cache.copy(), v_cache.copy()) if verify else None
    o, lse = attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cp.asarray(lens),
                                    block_table=block_table, causal=case.causal, num_splits=case.splits,
                                    return_lse=True, **kw)
    problems = []
    if verify:
        table = None if block_table is None else cp.asnumpy(block_table)
        ref_kw = {n: cp.asnumpy(x) if n in ("cache_batch_idx", "cache_leftpad") else x for n, x in kw.items()}
        q32, k32, v32, kc32, vc32 = (_xpref.to_float32(x) for x in (q, k, v) + before)
        rounding = {"rotary_dtype": case.dtype} if "rotary_cos" in kw else {}  # the kernel attends rounded rotations
        o64, lse64, _, _ = _xpref.attention_kvcache64(q32, kc32, vc32, lens, k32, v32, table, case.causal, **ref_kw,
                                                      **rounding)
        low = _xpref.attention_kvcache_lowp(q32, kc32, vc32, case.dtype, lens, k32, v32, table, case.causal, **ref_kw)
        _rule(problems, "o", o, o64, low, 2)
        _lse_rule(problems, lse, lse64)
        u16 = cp.uint16
        if "rotary_cos" in kw:  # the rotated keys by value (one unit in the last place), all else bit for bit
            rot = {n: kw[n] for n in ("rotary_cos", "rotary_sin", "rotary_interleaved")}
            want_k, _ = _xpref.kvcache_append(kc32, vc32, k32, v32, lens, table, cache_batch_idx=batch_idx,
                                              dtype=case.dtype, **rot)
            ulp = 2.0 ** (-7 if case.dtype == "bf16" else -10)
            if not bool((cp.abs(_xpref.to_float32(k_cache) - want_k) <= ulp * cp.abs(want_k)).all()):
                problems.append("k_cache: the rotated new keys are more than one unit in the last place off, or other "
                                "entries changed")
        for name, got, old, new in (("k_cache", k_cache, before[0], k), ("v_cache", v_cache, before[1], v)):
            if name == "k_cache" and "rotary_cos" in kw:
                continue
            want, _ = _xpref.kvcache_append(old.view(u16), old.view(u16), new.view(u16), new.view(u16), lens, table,
                                            cache_batch_idx=batch_idx)
            if not bool((got.view(u16) == want).all()):
                problems.append(f"{name}: the appended keys/values are not exactly where they belong, or other "
                                f"entries changed")
    return {"o": o, "lse": lse, "k_cache": k_cache, "v_cache": v_cache}, problems


def run_case(case: Case, verify: bool) -> dict:
    """The calls of one case (see Case); digests and problems."""
    import cupy as cp
    import numpy as np

    from . import attention_backward, attention_forward

    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    if case.kind != "dense":
        t0 = time.perf_counter()
        run = {"varlen": _run_varlen, "kvcache": _run_kvcache, "fp8": _run_fp8, "fp8_varlen": _run_fp8}[case.kind]
        outputs, problems = run(case, rng, verify)
        cp.cuda.Device().synchronize()
        seconds = time.perf_counter() - t0
        for name, x in outputs.items():
            problems = _host_problems(name, x, is_lse=(name == "lse")) + problems
        digests = {name: _digest(x) for name, x in outputs.items() if name != "dq_atomic"}
        result = {"case": case.name, "seconds": round(seconds, 3), "digests": digests, "problems": problems}
        if not outputs:
            result["note"] = "no FP8 kernel on this target (Hopper's wgmma kernels only): nothing launched"
        return result
    q = _driver_input(rng, case, case.seqlen_q)
    k = _driver_input(rng, case, case.seqlen_k, case.heads_kv)
    v = _driver_input(rng, case, case.seqlen_k, case.heads_kv)
    dout = _driver_input(rng, case, case.seqlen_q)
    t0 = time.perf_counter()
    mods = case.mod_options(rng)
    if mods.get("alibi_slopes") is not None:
        mods["alibi_slopes"] = cp.asarray(mods["alibi_slopes"], dtype=cp.float32)
    bias16 = None
    if mods.get("bias") is not None:
        bias = np.asarray(mods["bias"], dtype=np.float32)
        if case.dtype in ("fp16", "bf16") and case.seqlen_k % 8 == 0:
            # rows of whole 16-byte chunks: the bias in the case's 16-bit dtype (the Hopper backward stages such a bias
            # in shared memory at head dim 64); the references read its values
            import ml_dtypes

            bias16 = bias.astype(np.float16 if case.dtype == "fp16" else ml_dtypes.bfloat16)
            bias = bias16.astype(np.float32)
        mods["bias"] = _upload(bias)
    for name in ("mask", "key_padding_mask"):
        if mods.get(name) is not None:
            mods[name] = cp.asarray(mods[name])
    want_mask = "dropout_p" in mods  # the mask kernel too (compared with cuflash.philox when verifying)
    prec = {"precision": case.precision} if case.precision else {}
    call = dict(mods)  # what the calls get: the references read `mods`
    if bias16 is not None:
        call["bias"] = _upload(bias16)
    if case.mods & config.MOD_BLOCKS:
        from . import BlockMask

        call["mask"] = BlockMask(mods["mask"])
    o, lse, *mask = attention_forward(q, k, v, causal=case.causal, layout=case.layout, return_dropout_mask=want_mask,
                                      **call, **prec)
    with_dbias = {"dbias": True} if "bias" in mods else {}  # atomics: the bias is shared by the heads
    grads = attention_backward(dout, q, k, v, o, lse, causal=case.causal, layout=case.layout, **call, **with_dbias,
                               **prec)
    outputs = {"o": o, "lse": lse, "dq_atomic": grads[0], "dk": grads[1], "dv": grads[2]}
    grads_det = attention_backward(dout, q, k, v, o, lse, causal=case.causal, layout=case.layout,
                                   deterministic=True, **call, **prec)
    outputs.update(dq_det=grads_det[0], dk_det=grads_det[1], dv_det=grads_det[2])
    cp.cuda.Device().synchronize()
    seconds = time.perf_counter() - t0
    if with_dbias:
        outputs["dbias_atomic"] = grads[3]
    problems = []
    for name, x in outputs.items():
        problems += _host_problems(name, x, is_lse=(name == "lse"))
    if verify and case.wide:
        problems += _verify_wide(case, q, k, v, dout, o, lse, grads, grads_det, mods)
    elif verify:
        problems += _verify(case, q, k, v, dout, o, lse, grads, grads_det, mods)
        if mask:
            from . import philox

            want = philox.dropout_mask(case.batch, case.heads, case.seqlen_q, case.seqlen_k, mods["dropout_p"],
                                       mods["seed"], mods["offset"])
            if not np.array_equal(cp.asnumpy(mask[0]), want):
                problems.append("dropout mask differs from cuflash.philox")
    # dq (and a shared bias's dbias) of the default mode is accumulated with atomics (float32; float64 for float64
    # inputs): not bitwise reproducible, so not compared
    digests = {name: _digest(x) for name, x in outputs.items() if not name.endswith("_atomic")}
    return {"case": case.name, "seconds": round(seconds, 3), "digests": digests, "problems": problems}


def driver(args) -> int:
    import cupy as cp

    cases = case_set(args.case_set)
    indices = [int(i) for i in args.cases.split(",")] if args.cases else list(range(len(cases)))
    cp.cuda.set_allocator(None)  # no pool: each array is its own allocation, so memcheck sees its bounds
    failed = 0
    for n, i in enumerate(indices):
        case = cases[i]
        print(f"CASE {n + 1}/{len(indices)} {case.name}", flush=True)
        result = run_case(case, args.verify)
        failed += bool(result["problems"])
        print("RESULT " + json.dumps(result), flush=True)
    print(f"DRIVER DONE {len(indices)} cases, {failed} with problems", flush=True)
    return 1 if failed else 0


# --- the sanitizer runs ------------------------------------------------------------------------------

def find_sanitizer(path: str | None = None) -> str | None:
    candidates = [path] if path else []
    candidates.append(shutil.which("compute-sanitizer"))
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates += [os.path.join(root, "bin", "compute-sanitizer"),
                           os.path.join(root, "compute-sanitizer", "compute-sanitizer")]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def tool_options(tool: str, help_text: str) -> list[str]:
    """Options for one tool, each only if this compute-sanitizer's --help lists it."""
    wanted = [("--error-exitcode", str(SANITIZER_EXIT)), ("--print-limit", "200"), ("--launch-timeout", "300"),
              # CUDA API errors are not counted: a failing call of ours raises in Python (the driver then exits
              # non-zero, which fails the run), and CuPy's own probing calls must not count as findings
              ("--report-api-errors", "no")]
    if tool == "memcheck":
        wanted.append(("--padding", "512"))  # a guard after every allocation: overruns hit it, not a neighbour
    if tool == "racecheck":
        wanted += [("--racecheck-report", "all"),          # hazards and the analysis summary
                   ("--racecheck-memcpy-async", "yes")]    # track cp.async writes to shared memory
    opts = []
    for flag, value in wanted:
        if flag == "--error-exitcode" or re.search(re.escape(flag) + r"\b", help_text):
            opts += [flag, value]
    return opts


_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+error")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")
_BANNER = re.compile(r"^=+ (COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|Target application|LEAK SUMMARY)")


def parse_log(text: str) -> dict:
    """Counts from one sanitized driver log: summary errors, racecheck errors/warnings, cases done,
    driver results, and the sanitizer's finding lines."""
    out = {"errors": None, "race_errors": 0, "race_warnings": 0, "results": [], "findings": [], "done": False}
    for m in _ERROR_SUMMARY.finditer(text):
        out["errors"] = (out["errors"] or 0) + int(m.group(1))
    for m in _RACE_SUMMARY.finditer(text):
        out["race_errors"] += int(m.group(2))
        out["race_warnings"] += int(m.group(3))
        out["race_summary"] = True
    for line in text.splitlines():
        if line.startswith("RESULT "):
            try:
                out["results"].append(json.loads(line[len("RESULT "):]))
            except ValueError:
                pass
        elif line.startswith("DRIVER DONE"):
            out["done"] = True
        elif line.startswith("=") and line.strip("= ") and not _BANNER.match(line):
            out["findings"].append(line)
    return out


_HAZARD = re.compile(r"Potential (\w+) hazard detected")
_HAZARD_ACCESS = re.compile(r"(Read|Write) Thread \([^)]*\) at (?:void )?(.+)\+(0x[0-9a-fA-F]+)")
_PARAM_LIST = re.compile(r"\([^()]*\)$")  # the kernel's parameter list at the end of its name


def hazard_sites(findings: list[str]) -> list[tuple[int, str]]:
    """The distinct racecheck hazards among finding lines, most frequent first: (count, "WAR kernel: Read +0x1740,
    Write +0x5150"), one per (hazard type, kernel, the two accesses' program counters). A hazard is reported per
    shared byte and block, so thousands of findings are usually a handful of instruction pairs; their PCs locate
    the instructions in the kernel's SASS (`python -m cuflash compile --sass`)."""
    sites: dict[str, int] = {}
    kind, accesses = None, []
    for line in findings:
        m = _HAZARD.search(line)
        if m:
            kind, accesses = m.group(1), []
            continue
        m = _HAZARD_ACCESS.search(line)
        if m and kind is not None:
            accesses.append((_PARAM_LIST.sub("", m.group(2).strip()), f"{m.group(1)} +{m.group(3)}"))
            if len(accesses) == 2:
                kernel = accesses[0][0] if accesses[0][0] == accesses[1][0] else " / ".join(a[0] for a in accesses)
                key = f"{kind} {kernel}: {accesses[0][1]}, {accesses[1][1]}"
                sites[key] = sites.get(key, 0) + 1
                kind = None
    return sorted(((n, k) for k, n in sites.items()), key=lambda x: -x[0])


def shard(cases: list[Case], indices: list[int], n: int) -> list[list[int]]:
    """Split case indices into n shards of similar cost (longest first, onto the cheapest shard)."""
    shards: list[list[int]] = [[] for _ in range(max(1, min(n, len(indices))))]
    load = [0.0] * len(shards)
    for i in sorted(indices, key=lambda i: -cases[i].cost):
        j = load.index(min(load))
        shards[j].append(i)
        load[j] += cases[i].cost
    return [sorted(s) for s in shards if s]


def _driver_cmd(case_set_name: str, indices: list[int], verify: bool) -> list[str]:
    cmd = [sys.executable, "-m", "cuflash.check", "_driver", "--case-set", case_set_name,
           "--cases", ",".join(map(str, indices))]
    return cmd + (["--verify"] if verify else [])


def _child_env() -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the directory holding cuflash/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _kill(proc: subprocess.Popen) -> None:
    """End one child we started (its own process group: the sanitizer and the Python it runs)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def sanitize(args) -> int:
    tools = list(dict.fromkeys(args.tools))
    set_name = "quick" if args.quick else "default"
    cases = case_set(set_name)
    selected = select_cases(cases, args.only)  # indices into the set (the driver's --cases)
    if not selected:
        print(f"cuflash check: no case of the {set_name} set matches --only {args.only!r}", file=sys.stderr)
        return 2
    out_dir = args.out or tempfile.mkdtemp(prefix="cuflash-sanitize-")
    os.makedirs(out_dir, exist_ok=True)
    exe = find_sanitizer(args.sanitizer)
    if exe is None:
        print("cuflash check: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin); "
              "pass --sanitizer PATH", file=sys.stderr)
        return 2
    try:
        import cupy

        if not cupy.is_available():
            print("cuflash check: no CUDA GPU (cupy.is_available() is False)", file=sys.stderr)
            return 2
    except ImportError as e:
        print(f"cuflash check: CuPy is not importable ({e})", file=sys.stderr)
        return 2
    shown = subprocess.run([exe, "--help"], capture_output=True, text=True)
    help_text = shown.stdout + shown.stderr
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"compute-sanitizer: {exe} ({version[-1] if version else 'unknown version'})")
    only = f", --only {args.only!r}" if args.only else ""
    print(f"{len(selected)} cases ({set_name} set{only}), each: forward, backward (atomic dQ), backward "
          f"(deterministic); FP8: forward only; "
          f"kernels: {config.KERNELS} (CUFLASH_KERNELS); logs in {out_dir}")
    t_all = time.perf_counter()

    # 1. compile every needed kernel into the disk cache
    t0 = time.perf_counter()
    arch = _compile.device_arch()
    configs = [cfg for i in selected for cfg in cases[i].configs(arch)]
    errors = {n: e for n, e in compile_configs(configs).items() if e}
    print(f"compiled/loaded {len(set(c.cpp_name() for c in configs))} kernels in {time.perf_counter() - t0:.1f} s")
    for name, err in errors.items():
        print(f"  COMPILE ERROR {name}: {err.splitlines()[0]}")
    if errors:
        return 1

    # 2. the unsanitized reference run: pass rule against float64, output digests
    t0 = time.perf_counter()
    deadline = t_all + args.deadline
    ref_log = os.path.join(out_dir, "reference-run.log")
    with open(ref_log, "w") as f:
        try:
            rc = subprocess.run(_driver_cmd(set_name, selected, verify=True), stdout=f,
                                stderr=subprocess.STDOUT, env=_child_env(),
                                timeout=max(1.0, deadline - time.perf_counter())).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    ref = parse_log(open(ref_log).read())
    baseline = {r["case"]: r["digests"] for r in ref["results"]}
    ref_problems = [f"{r['case']}: {p}" for r in ref["results"] for p in r["problems"]]
    print(f"reference run (no sanitizer, checked against float64): {len(baseline)}/{len(selected)} cases, "
          f"{len(ref_problems)} problems, exit {rc}, {time.perf_counter() - t0:.1f} s")
    for p in ref_problems[:20]:
        print(f"  PROBLEM {p}")
    if len(baseline) != len(selected):
        print(f"  the reference run did not finish (exit {rc}); see {ref_log}")
        return 1

    # 3. all tools at once, each over its shards
    jobs = []  # (tool, shard index, indices, Popen, log path, start time)
    for tool in tools:
        n = args.shards or DEFAULT_SHARDS[tool]
        for si, indices in enumerate(shard(cases, selected, n)):
            log = os.path.join(out_dir, f"{tool}-{si}.log")
            cmd = [exe, "--tool", tool] + tool_options(tool, help_text) + _driver_cmd(set_name, indices, verify=False)
            with open(log, "w") as f:
                f.write(" ".join(cmd) + "\n")
                f.flush()
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_child_env(),
                                        start_new_session=True)
            jobs.append((tool, si, indices, proc, log, time.perf_counter()))
    print(f"started {len(jobs)} sanitizer processes ({', '.join(f'{t} x{sum(j[0] == t for j in jobs)}' for t in tools)}); "
          f"stopped, if still running, {deadline - time.perf_counter():.0f} s from now")
    ended: dict = {}
    while len(ended) < len(jobs):
        for j, (tool, si, indices, proc, log, t_start) in enumerate(jobs):
            if j in ended:
                continue
            if proc.poll() is not None:
                ended[j] = (proc.returncode, time.perf_counter() - t_start, False)
            elif time.perf_counter() > deadline:
                _kill(proc)
                ended[j] = (proc.returncode, time.perf_counter() - t_start, True)
        time.sleep(0.5)

    # 4. one row per tool
    header = f"{'tool':<10} {'shards':>6} {'cases':>7} {'errors':>6} {'findings':>8} {'digest diffs':>12} {'seconds':>8}  status"
    print()
    print(header)
    print("-" * len(header))
    failed = False
    details = []
    for tool in tools:
        rows = [(jobs[j], ended[j]) for j in range(len(jobs)) if jobs[j][0] == tool]
        done = errors_total = 0
        findings: list[str] = []
        mismatches: list[str] = []
        statuses = []
        seconds = 0.0
        for (_, si, indices, _, log, _), (rc, secs, timed_out) in rows:
            parsed = parse_log(open(log, errors="replace").read())
            seconds = max(seconds, secs)
            done += len(parsed["results"])
            errors_total += (parsed["errors"] or 0) + parsed["race_errors"] + parsed["race_warnings"]
            findings += parsed["findings"]
            for r in parsed["results"]:
                for p in r["problems"]:
                    mismatches.append(f"{r['case']}: {p}")
                for name, dig in r["digests"].items():
                    if baseline.get(r["case"], {}).get(name) != dig:
                        mismatches.append(f"{r['case']}: {name} differs from the unsanitized run")
            has_summary = parsed["errors"] is not None or parsed.get("race_summary", False)
            if timed_out:
                statuses.append(f"shard {si}: TIMEOUT after {len(parsed['results'])}/{len(indices)} cases")
            elif rc == SANITIZER_EXIT:
                statuses.append(f"shard {si}: errors reported")
            elif rc != 0:
                statuses.append(f"shard {si}: exit {rc}")
            elif not has_summary:
                statuses.append(f"shard {si}: no sanitizer summary in the log")
            elif not parsed["done"]:
                statuses.append(f"shard {si}: driver did not finish")
        # any line the sanitizer printed besides its banner and summaries counts as a finding
        ok = not statuses and errors_total == 0 and not findings and not mismatches and done == len(selected)
        failed |= not ok
        status = "ok" if ok else "; ".join(statuses) or "FINDINGS"
        print(f"{tool:<10} {len(rows):>6} {f'{done}/{len(selected)}':>7} {errors_total:>6} {len(findings):>8} "
              f"{len(mismatches):>12} {seconds:>8.1f}  {status}")
        if findings or mismatches:
            details.append((tool, findings, mismatches))
    if ref_problems:
        failed = True
        print(f"reference run: {len(ref_problems)} pass-rule problems (listed above)")
    print(f"total {time.perf_counter() - t_all:.1f} s; logs in {out_dir}")
    for tool, findings, mismatches in details:
        print(f"\n{tool}: first findings (full logs: {out_dir}/{tool}-*.log)")
        for line in findings[:40]:
            print(f"  {line}")
        sites = hazard_sites(findings)
        if sites:
            print(f"{tool}: {len(sites)} distinct hazard sites (hazard, kernel: the two accesses' program counters)")
            for n, site in sites[:20]:
                print(f"  {n:>7} x {site}")
        for line in mismatches[:20]:
            print(f"  MISMATCH {line}")
    return 1 if failed else 0


def select_cases(cases: list[Case], only: str | None) -> list[int]:
    """Indices of the cases whose name matches the regular expression `only` (all cases for None)."""
    return [i for i, c in enumerate(cases) if not only or re.search(only, c.name)]


def list_cases(args) -> int:
    cases = case_set("quick" if args.quick else "default")
    selected = select_cases(cases, args.only)
    for i in selected:
        c = cases[i]
        print(f"{i:>3} cost {c.cost:8.1f}  {c.name}  (kernel head dim {c.kernel_head_dim})")
    print(f"{len(selected)} cases; total cost {sum(cases[i].cost for i in selected):.0f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cuflash.check", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sanitize", help="run compute-sanitizer tools over the case set")
    p.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS), help="default: all four")
    p.add_argument("--quick", action="store_true", help="a 9-case set instead of the full one")
    p.add_argument("--out", help="directory for the logs (default: a new temporary directory)")
    p.add_argument("--shards", type=int, help=f"processes per tool (default: {DEFAULT_SHARDS})")
    p.add_argument("--deadline", type=float, default=330.0,
                   help="seconds for the whole command; sanitizer processes still running then are stopped and "
                        "reported as TIMEOUT (default 330)")
    p.add_argument("--sanitizer", help="path of compute-sanitizer (default: PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    only_help = ("only the cases whose name matches this regular expression, e.g. 'fp32|tf32|fp64' for the "
                 "float32 / float64 cases (default: all)")
    p.add_argument("--only", help=only_help)
    p = sub.add_parser("cases", help="list the case set")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help=only_help)
    p = sub.add_parser("_driver", help="internal: run cases (this is what the sanitizer runs)")
    p.add_argument("--case-set", default="default", choices=("default", "quick"))
    p.add_argument("--cases", help="comma-separated case indices (default: all)")
    p.add_argument("--verify", action="store_true", help="check every output against the float64 reference")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "sanitize":
        return sanitize(args)
    if args.command == "cases":
        return list_cases(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
