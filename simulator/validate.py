"""Validate the analyzer against hardware counters: ncu on cuflash's forward and backward kernels.

    PYTHONPATH=. python -m cuflash.simulator.validate --out docs/IO_VALIDATION.md

Targets are (kernel, configuration) pairs: the mma.sync kernels `fwd_kernel`, the backward's main
`bwd_kernel` (default mode: dQ accumulated by fp32 `red.global.add.v2.f32` into dq_accum) and, for one
deterministic case, `bwd_dq_kernel`, profiled with CUFLASH_KERNELS=mma (on an H100 the library launches
the wgmma kernels by default); the synchronous wgmma kernels `fwd_sm90_kernel` and `bwd_sm90_kernel` and the
warp-specialized TMA kernels `fwd_sm90_ws_kernel` and `bwd_sm90_ws_kernel`, profiled with CUFLASH_KERNELS=auto, on
the metrics that make sense for them (no ldmatrix; their wgmma operand reads are no thread instructions; the TMA
kernels' loads are TMA boxes and bulk copies, compared on the TMA counters). fwd_sm90_ws_kernel and
bwd_sm90_ws_kernel are what the library launches for 16-bit inputs on an H100 (the backward at kernel head dims 32,
64, 96 and 128); a fwd_sm90_kernel or bwd_sm90_kernel driver takes the ws family out of the registry to reach the
synchronous kernel (FWD_SM90_DRIVER_NOTE). bwd_sm90_ws_kernel is profiled in its default mode only, where it adds
dQ by one bulk reduction (`cp.reduce.async.bulk .add.f32`) per visited query block: its deterministic mode's dQ
writer polls a turn counter, a timing-dependent number of global reads. The same holds for bwd_sm90_split_kernel, the
library's 16-bit backward at kernel head dims 192 and 256 (TMA loads by one thread, dQ by `red.global.add.v4.f32`
from registers; its shared memory is counted in program order, not walked, so its LDS / STS rows are reported
only). The float32 and float64 kernels `fwd_wide_kernel` and `bwd_wide_kernel` (cuda/wide.cuh; fp32 as 3xTF32,
CUFLASH_KERNELS=mma) are compared on their global traffic, cp.async instructions, dQ atomics and the shared bytes
their threads request (the sass_data_bytes counters against the analyzer's program-order counts); their LDS / STS
instructions and wavefronts are reported only, and the L2 model does not cover them. First every kernel
instantiation the targets need is compiled once outside ncu (NVRTC, cached on disk; `--no-prewarm` skips it).
Then, per target, a small driver (`python -c ...`: random CuPy inputs; the forward twice, or the forward once for
o and lse and then the backward twice) runs under

    ncu --print-units base --cache-control all --clock-control none --csv
        --kernel-name regex:<kernel_regex(kernel)> --launch-skip 1 --launch-count 1 --metrics <METRICS>

so only the second launch of the target kernel is profiled (the filter counts matching launches only; the
regex matches the kernel's name as a whole identifier, so `bwd_kernel` matches none of
bwd_preprocess_kernel, bwd_convert_dq_kernel, bwd_dq_kernel, bwd_sm90_kernel, and `bwd_sm90_kernel` does not
match bwd_sm90_ws_kernel). ncu's CSV is parsed, the profiled kernel's name checked, and each metric compared with
the analyzer's prediction for the same kernel and config. Raw ncu output and the rows as JSON are kept in
out/ncu_raw/ (git-ignored; `--raw-dir`) so the table can be rebuilt without the GPU (`--from-raw out/ncu_raw`). A
metric that this ncu does not know is dropped: by the name in ncu's error when it gives one, else by probing the
metrics one by one (printed, and listed in the document), so one bad name does not lose the run. `--dry-run`
prints the predictions and the ncu commands without running anything; `--kernels K ...` (and `--only I ...`,
indices of `--list`) selects targets, e.g. `--kernels bwd_sm90_ws_kernel`; `--section TITLE` writes such a run as a
`## TITLE` section (header lines, table, tally, missed targets) to add to a document that a full run wrote.

Targets: L2->SM read bytes within 2% of the predicted global reads; shared wavefronts and bank
conflicts of ld/st and ldmatrix exactly equal; cp.async wavefronts within 10% of the model's band
[lower, upper] (a point for 128-byte panels); DRAM bytes (L2 model) within 10%. The document ends with
MISSES_EXPLAINED, the analysis of the misses of the measuring run. For bwd_kernel also the dQ atomics: reduction
bytes and L2 reduction sectors within 2%, reduction requests exact (they travel SM->L2 as writes, never as L2->SM
reads). For the TMA kernels the TMA load bytes and sectors within 2% and the TMA load instructions exact
(TMA_METRICS); for bwd_sm90_ws_kernel also its dQ bulk reductions: their SM->L2 bytes within 2%, their
instructions exact and no LSU reduction (BULK_RED_METRICS); for bwd_sm90_split_kernel its 16-byte dQ reductions on
the RED rows as bwd_kernel's; for the wide kernels the shared bytes of loads and stores within 2% (WIDE_METRICS;
cp.async's shared bytes reported), the cp.async instructions exact, and the backward's dQ atomics on the RED rows.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cuflash import config as _config

from . import banks, l2 as _l2
from .model import H100_L2_BYTES, H100_SMS, Problem
from .schedules import ARCH, block_sizes, bwd_query_blocks, key_block_ranges, main_adds_dq
from .strategies import _wide_bwd_shared, _wide_cp_async_bytes, _wide_fwd_shared, cuflash_backward_kernels

SECTOR = 32
KERNELS = ("fwd_kernel", "bwd_kernel", "bwd_dq_kernel", "fwd_sm90_kernel", "bwd_sm90_kernel", "fwd_sm90_ws_kernel",
           "bwd_sm90_ws_kernel", "bwd_sm90_split_kernel", "fwd_wide_kernel", "bwd_wide_kernel")
FORWARD_KERNELS = ("fwd_kernel", "fwd_sm90_kernel", "fwd_sm90_ws_kernel", "fwd_wide_kernel")
# the float32 / float64 kernels of cuda/wide.cuh (CUFLASH_KERNELS=mma: on sm_90a float32 would otherwise take the TF32
# wgmma kernels at head dims 32, 64 and 128): their shared memory is counted in program order
# (strategies._wide_fwd_shared, _wide_bwd_shared) and compared on the per-thread shared byte counters (WIDE_METRICS)
WIDE_KERNELS = ("fwd_wide_kernel", "bwd_wide_kernel")
# the wgmma kernels run with CUFLASH_KERNELS=auto (the library's default), the others with
# CUFLASH_KERNELS=mma: bwd_dq_kernel and the elementwise kernels are the same in both families
WGMMA_KERNELS = ("fwd_sm90_kernel", "bwd_sm90_kernel", "fwd_sm90_ws_kernel", "bwd_sm90_ws_kernel",
                 "bwd_sm90_split_kernel")
# the kernels whose global loads are TMA boxes (cp.async.bulk.tensor) and 1-D bulk copies (cp.async.bulk), compared
# on the TMA counters (TMA_METRICS)
TMA_KERNELS = ("fwd_sm90_ws_kernel", "bwd_sm90_ws_kernel", "bwd_sm90_split_kernel")
# the kernels that add dQ by bulk reductions (cp.reduce.async.bulk) instead of red.global, compared on the TMA
# reduction counters (BULK_RED_METRICS)
BULK_RED_KERNELS = ("bwd_sm90_ws_kernel",)
# the kernels whose dQ adds are 16-byte reductions from registers (red.global.add.v4.f32), compared on the LSU
# reduction counters (RED_METRICS) as bwd_kernel's 8-byte ones
RED_V4_KERNELS = ("bwd_sm90_split_kernel",)
# the kernels whose shared-memory accesses are counted in program order (strategies._split_bwd_shared), not walked
# instruction by instruction: their LDS / STS rows are reported, not predicted
UNWALKED_KERNELS = ("bwd_sm90_split_kernel", "fwd_wide_kernel", "bwd_wide_kernel")


class Band(float):
    """A prediction that is a range: the value is the lower bound, `.hi` the upper one (cp.async
    wavefronts, banks.count_cp_async). Behaves as its lower bound wherever a number is expected."""

    def __new__(cls, lo, hi):
        self = super().__new__(cls, lo)
        self.hi = float(hi)
        return self


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "fp16"
    causal: bool = False

    @property
    def name(self) -> str:
        seq = f"{self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"{self.seqlen_q}x{self.seqlen_k}"
        return (f"b{self.batch} h{self.heads} N{seq} d{self.head_dim} {self.dtype}"
                f"{' causal' if self.causal else ''}")

    def problem(self) -> Problem:
        return Problem(self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim, self.dtype, self.causal)

    def config(self, kernels: str = "mma"):
        """The forward kernel's config in kernel family `kernels` ("mma": fwd_kernel)."""
        return _config.forward_kernel_config(_config.kernel_head_dim(self.head_dim), self.dtype, self.causal,
                                             ARCH, kernels, seqlen_k=self.seqlen_k)


@dataclass(frozen=True)
class Target:
    """One profiled kernel: `kernel` of the call that `case` makes (attention_forward, or
    attention_backward after a forward; deterministic=True for attention_backward(deterministic=True),
    always so for bwd_dq_kernel)."""

    kernel: str
    case: Case
    deterministic: bool = False

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}; known: {', '.join(KERNELS)}")
        if self.kernel == "bwd_dq_kernel" and not self.deterministic:
            object.__setattr__(self, "deterministic", True)
        if self.kernel in FORWARD_KERNELS and self.deterministic:
            raise ValueError("deterministic applies to the backward kernels only")
        if self.kernel == "bwd_sm90_ws_kernel" and self.deterministic:
            # the ordered dQ writer polls its query block's turn counter (ld.acquire) until the CTAs before it have
            # added theirs: a number of global reads that depends on timing, so no read row could be predicted
            raise ValueError("bwd_sm90_ws_kernel targets run the default mode (dQ by bulk reductions): its "
                             "deterministic mode's turn-counter polls are timing-dependent reads")
        if self.kernel == "bwd_sm90_split_kernel" and self.deterministic:
            # at head dim 256 the deterministic mode polls turn counters as above; at 192 it leaves dQ to bwd_dq_kernel
            raise ValueError("bwd_sm90_split_kernel targets run the default mode (dQ by red.global.add.v4.f32): its "
                             "deterministic mode's turn-counter polls are timing-dependent reads")
        if self.kernel in WIDE_KERNELS:
            if self.case.dtype not in ("fp32", "fp64"):
                raise ValueError(f"{self.kernel} targets take dtype 'fp32' (3xTF32) or 'fp64' "
                                 f"(got {self.case.dtype!r})")
            if self.deterministic:
                # the ordered backward polls turn counters (ld.acquire) until its turn: timing-dependent reads
                raise ValueError("bwd_wide_kernel targets run the default mode (dQ by atomics): its deterministic "
                                 "mode's turn-counter polls are timing-dependent reads")
            if _config.kernel_head_dim(self.case.head_dim, self.case.dtype) != self.case.head_dim:
                raise ValueError(f"{self.kernel} targets take a kernel head dim (zero-padded columns are "
                                 f"neither read nor counted per element): got head_dim={self.case.head_dim}")
            if not isinstance(self.config(), (_config.FwdWideConfig, _config.BwdWideConfig)):
                raise ValueError(f"the library launches {self.config().cpp_name()} for {self.case.name}")
            return
        hd = _config.kernel_head_dim(self.case.head_dim)
        tiles = {"fwd_sm90_kernel": _config.FWD_SM90_TILES, "bwd_sm90_kernel": _config.BWD_SM90_TILES,
                 "fwd_sm90_ws_kernel": _config.FWD_SM90_WS_TILES,
                 "bwd_sm90_ws_kernel": _config.bwd_sm90_ws_head_dims(),
                 "bwd_sm90_split_kernel": _config.BWD_SM90_SPLIT_HEAD_DIMS}.get(self.kernel)
        if tiles is not None and hd not in tiles:
            raise ValueError(f"{self.kernel} runs kernel head dims {', '.join(map(str, sorted(tiles)))} "
                             f"(got head_dim={self.case.head_dim}: the library launches the mma.sync kernel)")
        if self.kernel in ("bwd_sm90_ws_kernel", "bwd_sm90_split_kernel"):
            # the driver runs the library's choice as it is: the registry (config.FAMILIES) must pick this kernel
            launched = _config.backward_kernel_config(hd, self.case.dtype, self.case.causal, False, ARCH, "auto")
            if launched != self.config():
                raise ValueError(f"the library launches {launched.cpp_name()} for {self.case.name}, not "
                                 f"{self.config().cpp_name()}")
        if self.is_backward and (self.case.head_dim * 2) % SECTOR:
            # the backward predictions are bytes; they equal 32-byte sectors only for sector-aligned rows
            raise ValueError(f"backward targets need head_dim * 2 bytes a multiple of {SECTOR} "
                             f"(got head_dim={self.case.head_dim})")

    @property
    def label(self) -> str:
        main = self.kernel in ("bwd_kernel", "bwd_sm90_kernel")
        return self.kernel + (" (deterministic)" if self.deterministic and main else "")

    @property
    def name(self) -> str:
        return f"{self.label} | {self.case.name}"

    @property
    def is_backward(self) -> bool:
        return self.kernel not in FORWARD_KERNELS

    @property
    def kernels(self) -> str:
        """The kernel family the driver runs (its CUFLASH_KERNELS) and the predictions count."""
        return "auto" if self.kernel in WGMMA_KERNELS else "mma"

    def config(self):
        """The config of the profiled kernel. fwd_sm90_kernel: its own config also where the library launches
        fwd_sm90_ws_kernel (every 16-bit head dim), whose family the driver takes out
        (FWD_SM90_DRIVER_NOTE)."""
        c = self.case
        hd = _config.kernel_head_dim(c.head_dim, c.dtype)
        if self.kernel == "fwd_wide_kernel":
            return _config.forward_kernel_config(hd, c.dtype, c.causal, ARCH, "mma", seqlen_k=c.seqlen_k)
        if self.kernel == "bwd_wide_kernel":
            return _config.backward_kernel_config(hd, c.dtype, c.causal, False, ARCH, "mma")
        if self.kernel == "fwd_sm90_kernel":
            return _config.fwd_sm90_config(hd, c.dtype, c.causal)
        if self.kernel == "bwd_sm90_kernel":  # the driver takes bwd_sm90_ws out (FWD_SM90_DRIVER_NOTE)
            return _config.bwd_sm90_config(hd, c.dtype, c.causal, self.deterministic)
        if self.kernel == "fwd_sm90_ws_kernel":
            return _config.fwd_sm90_ws_config(hd, c.dtype, c.causal, seqlen_k=c.seqlen_k)
        if self.kernel == "bwd_sm90_ws_kernel":  # the library's backward at kernel head dims 32, 64, 96 and 128
            return _config.bwd_sm90_ws_config(hd, c.dtype, c.causal, False)
        if self.kernel == "bwd_sm90_split_kernel":  # the library's backward at kernel head dims 192 and 256
            return _config.BwdSm90SplitConfig(hd, c.dtype, c.causal, False)
        if self.kernel in FORWARD_KERNELS:
            return _config.forward_kernel_config(hd, c.dtype, c.causal, ARCH, self.kernels, seqlen_k=c.seqlen_k)
        if self.kernel == "bwd_dq_kernel":
            return _config.dq_config(hd, c.dtype, c.causal)
        return _config.backward_kernel_config(hd, c.dtype, c.causal, self.deterministic, ARCH, self.kernels)


def _fwd(*cases: Case) -> list[Target]:
    return [Target("fwd_kernel", c) for c in cases]


# Forward: both panel widths (d = 96 uses 64-byte panels), every forward tile shape (d64 (128,64,4),
# d128 (128,32,4) and causal (128,128,8), d96/d192 (128,64,8), d256 (64,32,4), d32), tails (1000 x 1500),
# causal with Sq > Sk (CTAs that see no key), bf16. Backward bwd_kernel: d64 and d128 (32,128,8,1), d96
# (64,64,8,2: D_SPLIT 2), causal, tails with Sq != Sk, bf16 and fp16; deterministic bwd_dq_kernel with
# causal Sq > Sk (query blocks that see no key). Small shapes (N <= 2048, batch*heads <= 32): the whole
# default set takes a few minutes of ncu on an H100. Those are the mma.sync kernels (CUFLASH_KERNELS=mma). The
# wgmma kernels come last: fwd_sm90_kernel with 128-byte (d64, d128 causal bf16) and 64-byte panels (d96, with
# tails); bwd_sm90_kernel at d64 (64-byte panels: PANEL_COLS 32 splits dQ's columns per warpgroup) and d128
# causal bf16, and a deterministic one; then the warp-specialized TMA kernels, fwd_sm90_ws_kernel and
# bwd_sm90_ws_kernel, which the library launches by default.
_QUICK = [
    Target("fwd_kernel", Case(2, 16, 2048, 2048, 64)),
    Target("bwd_kernel", Case(2, 8, 2048, 2048, 64)),
    Target("bwd_dq_kernel", Case(1, 8, 1536, 1024, 128, causal=True)),
]
# most informative first (a run cut short by --budget-s keeps them): the quick three, the backward, the forward
_DEFAULT = _QUICK + [
    Target("bwd_kernel", Case(1, 8, 2048, 2048, 128, "bf16", causal=True)),
    Target("bwd_kernel", Case(2, 4, 1000, 1500, 64, "bf16")),
    Target("bwd_kernel", Case(1, 8, 1536, 1024, 128, causal=True)),
    Target("bwd_kernel", Case(2, 4, 1024, 1024, 96)),
] + _fwd(
    Case(2, 8, 2048, 2048, 128),
    Case(1, 16, 2048, 2048, 128, "bf16", causal=True),
    Case(2, 8, 1000, 1500, 96, causal=True),
    Case(1, 8, 1536, 512, 64, causal=True),
    Case(2, 8, 1024, 1024, 256),
    Case(4, 8, 512, 512, 32),
) + [
    Target("fwd_sm90_kernel", Case(2, 16, 2048, 2048, 64)),
    Target("bwd_sm90_kernel", Case(2, 8, 2048, 2048, 64)),
    Target("fwd_sm90_kernel", Case(1, 16, 2048, 2048, 128, "bf16", causal=True)),
    Target("bwd_sm90_kernel", Case(1, 8, 2048, 2048, 128, "bf16", causal=True)),
    Target("fwd_sm90_kernel", Case(2, 8, 1000, 1500, 96, causal=True)),
    Target("bwd_sm90_kernel", Case(2, 4, 1000, 1500, 128), deterministic=True),
    # the warp-specialized TMA forward: d128 (its H100 default), causal with tails (Q boxes and the last K/V box
    # partly out of bounds: zero-filled, not read), d64 and d256 (4 TMA boxes per tile)
    Target("fwd_sm90_ws_kernel", Case(1, 16, 2048, 2048, 128, "bf16")),
    Target("fwd_sm90_ws_kernel", Case(2, 8, 1000, 1500, 64, causal=True)),
    Target("fwd_sm90_ws_kernel", Case(1, 16, 2048, 2048, 128, "bf16", causal=True)),
    Target("fwd_sm90_ws_kernel", Case(2, 8, 1024, 1024, 256)),
    # the warp-specialized TMA backward, the library's 16-bit backward on an H100, in its default mode (dQ by bulk
    # reductions): d64 in steps of 128 queries (one 64-column box per tile), plain fp16 and causal bf16; d128 in steps
    # of 64 queries, causal bf16 and plain fp16. No tails: every box lies in bounds
    Target("bwd_sm90_ws_kernel", Case(2, 8, 2048, 2048, 64)),
    Target("bwd_sm90_ws_kernel", Case(1, 8, 2048, 2048, 128, "bf16", causal=True)),
    Target("bwd_sm90_ws_kernel", Case(2, 4, 1024, 1024, 64, "bf16", causal=True)),
    Target("bwd_sm90_ws_kernel", Case(2, 4, 1024, 1024, 128)),
    # the wide-head backward (head dims 192 and 256, dQ by red.global.add.v4.f32 from registers), default mode: d256
    # plain bf16 (four 64-column boxes per tile), d192 causal fp16 (six 32-column boxes) and with tails (1000 x 1500:
    # the last Q, dO and K, V boxes partly out of bounds)
    Target("bwd_sm90_split_kernel", Case(1, 8, 2048, 2048, 256, "bf16")),
    Target("bwd_sm90_split_kernel", Case(2, 4, 1024, 1024, 192, causal=True)),
    Target("bwd_sm90_split_kernel", Case(2, 4, 1000, 1500, 192, "bf16")),
    # the float32 / float64 kernels (CUFLASH_KERNELS=mma): the forward in 3xTF32 at d64 and in float64 at d128, causal
    # with tails; the backward in float64 at d128 (two warps per key group splitting S^T by queries) and in 3xTF32 at
    # d64, causal with tails
    Target("fwd_wide_kernel", Case(2, 8, 1024, 1024, 64, "fp32")),
    Target("fwd_wide_kernel", Case(1, 8, 1000, 1500, 128, "fp64", causal=True)),
    Target("bwd_wide_kernel", Case(2, 4, 1024, 1024, 128, "fp64")),
    Target("bwd_wide_kernel", Case(2, 4, 1000, 1500, 64, "fp32", causal=True)),
]

CASES = {
    "quick": _QUICK,
    "default": _DEFAULT,
    # longer: adds large shapes (K/V working sets above the L2 size) and the deterministic bwd_kernel
    "full": _DEFAULT + _fwd(
        Case(2, 16, 2048, 2048, 64, causal=True),
        Case(1, 16, 4096, 4096, 128, "bf16", causal=True),
        Case(4, 8, 1000, 1500, 96),
        Case(1, 8, 1024, 1024, 192, "bf16"),
        Case(1, 32, 16384, 16384, 128),
    ) + [
        Target("bwd_kernel", Case(1, 8, 1536, 1024, 128, causal=True), deterministic=True),
        Target("bwd_kernel", Case(1, 16, 4096, 4096, 128, "bf16", causal=True)),
        Target("fwd_sm90_kernel", Case(1, 32, 16384, 16384, 128)),
        Target("fwd_sm90_kernel", Case(4, 8, 512, 512, 32)),
        Target("bwd_sm90_kernel", Case(1, 16, 4096, 4096, 128, "bf16", causal=True)),
        Target("bwd_sm90_kernel", Case(2, 4, 1000, 1500, 64, causal=True)),
        Target("fwd_sm90_ws_kernel", Case(1, 32, 16384, 16384, 128)),
        Target("fwd_sm90_ws_kernel", Case(1, 16, 4096, 4096, 128, "bf16", causal=True)),
        # tails (the last query and key boxes partly out of bounds) and a working set near the L2's size
        Target("bwd_sm90_ws_kernel", Case(2, 4, 1000, 1500, 64, "bf16")),
        Target("bwd_sm90_ws_kernel", Case(1, 16, 4096, 4096, 128, "bf16", causal=True)),
        Target("bwd_sm90_split_kernel", Case(2, 4, 1000, 1500, 256, "bf16", causal=True)),
        Target("bwd_sm90_split_kernel", Case(1, 16, 4096, 4096, 256, "bf16")),
        # float32 at d256 (O's columns over two CTAs in the forward, four warps per key group in the backward) and d128
        # (two warps per key group, their partial sums through the exchange slots); float64 at d64 causal
        Target("fwd_wide_kernel", Case(1, 8, 1024, 1024, 256, "fp32")),
        Target("bwd_wide_kernel", Case(1, 8, 1024, 1024, 256, "fp32")),
        Target("bwd_wide_kernel", Case(2, 4, 1024, 1024, 128, "fp32", causal=True)),
        Target("bwd_wide_kernel", Case(2, 4, 1024, 1024, 64, "fp64", causal=True)),
    ],
}

# metric -> (what it is, target): "exact", a relative tolerance, or None (reported only)
METRICS = {
    "l1tex__m_xbar2l1tex_read_bytes.sum": ("L2->SM read bytes (global loads)", 0.02),
    "l1tex__m_l1tex2xbar_write_bytes.sum": ("SM->L2 write bytes (global stores)", 0.02),
    "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum": ("global store bytes at L1 (stores only)", 0.02),
    "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum": ("local-memory store bytes (spills)", "exact"),
    "dram__bytes_read.sum": ("DRAM read bytes (L2 model)", 0.10),
    "dram__bytes_write.sum": ("DRAM write bytes", None),
    "smsp__inst_executed_op_shared_ld.sum": ("shared load instructions (LDS, not LDSM)", "exact"),
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": ("shared load wavefronts (LDS + LDSM)", "exact"),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": ("shared load bank conflicts", "exact"),
    "smsp__inst_executed_op_shared_st.sum": ("shared store instructions (STS)", "exact"),
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": ("shared store wavefronts", "exact"),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": ("shared store bank conflicts", "exact"),
    # the same conflicts counted per instruction from its addresses (SASS patching), which excludes what
    # other traffic on the SM adds to the l1tex counters above (added after the 2026-11-22 run)
    "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": ("shared load bank conflicts (SASS)", "exact"),
    "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": ("shared store bank conflicts (SASS)", "exact"),
    "smsp__inst_executed_op_ldsm.sum": ("ldmatrix instructions", "exact"),
    "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum": ("ldmatrix wavefronts", "exact"),
    "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ldsm.sum": ("ldmatrix bank conflicts", "exact"),
    "smsp__sass_inst_executed_op_ldgsts.sum": ("cp.async (LDGSTS) instructions", "exact"),
    # predicted as a band [lower, upper] (banks.count_cp_async); the target is the band widened by 10%
    "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum": ("cp.async shared wavefronts (model)", 0.10),
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": ("tensor pipe active (% of peak)", None),
    "gpu__time_duration.sum": ("kernel duration (ns)", None),
    "launch__grid_size": ("CTAs", "exact"),
    "launch__block_size": ("threads per CTA", "exact"),
}

# bwd_kernel's dQ atomics (red.global.add.v2.f32, SASS RED): each warp instruction sends 32 lanes x 8 bytes,
# 8 rows x one full 32-byte sector, from L1 to the L2, which does the add. They are writes/reductions
# on the SM->L2 path (l1tex2xbar), never L2->SM read bytes.
RED_METRICS = {
    "l1tex__t_requests_pipe_lsu_mem_global_op_red.sum": ("global reduction requests (RED instructions)", "exact"),
    "l1tex__t_bytes_pipe_lsu_mem_global_op_red.sum": ("global reduction bytes at L1 (dQ atomics)", 0.02),
    "l1tex__m_l1tex2xbar_write_bytes_mem_global_op_red.sum": ("SM->L2 reduction bytes (dQ atomics)", 0.02),
    "lts__t_sectors_srcunit_tex_op_red.sum": ("L2 reduction sectors from the SMs (dQ atomics)", 0.02),
    # every L2 reduction sector; on an H100 a request may also be counted where it crosses between the two
    # L2 partitions, so this one is reported, not targeted
    "lts__t_sectors_op_red.sum": ("L2 reduction sectors, all sources", None),
}


# The wgmma kernels issue no ldmatrix (the ldmatrix instruction row stays, predicted 0), and the tensor core
# reads their Q, K, V (dO, dS^T) operands from shared memory without any thread instruction. Whether the l1tex
# data-stage load counters see those operand fetches is not documented, so for these kernels the two rows
# are reported, not targeted (predicted: LDS only); the SASS-attributed load conflicts stay exact.
WGMMA_METRIC_CHANGES = {
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": ("shared load wavefronts (LDS; wgmma operand reads?)",
                                                             None),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": ("shared load bank conflicts (LDS; wgmma?)", None),
    "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum": None,
    "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ldsm.sum": None,
}


# fwd_sm90_ws_kernel's global loads are TMA boxes (cp.async.bulk.tensor, SASS UTMALDG) that one producer thread
# issues: no LSU load instruction. They have counters of their own on sm_90 (names and descriptions from
# `ncu --query-metrics --chip gh100`, Nsight Compute on the H100 of this project; the Nsight Compute docs list no
# TMA-specific L2 source unit: `lts__t_sectors_srcunit_*` has tex, l1 and gcc, no tma):
#   l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld  "bytes read from L2 into L1TEX M-Stage for global TMA
#       loads": the TMA part of the L2 -> SM reads, so what the kernel's global reads become. Targeted (2%).
#   l1tex__m_xbar2l1tex_read_sectors_pipe_tma  the same path in sectors, all TMA traffic (loads only here).
#   sm__sass_inst_executed_op_tma_ld  "warp instructions executed: UTMALDG, UBLKCP.S.G": one per box. Exact.
#   l1tex__tmain_requests  "TMA instructions sent to TMA": reported (prefetch.tensormap may be one too).
#   lts__t_sectors_srcunit_tex_op_read  L2 sectors read by unit TEX, the SM side, which the TMA unit belongs
#       to: reported, not targeted (that TMA requests count as TEX is not documented).
# The all-source row l1tex__m_xbar2l1tex_read_bytes stays targeted: every global read of the kernel is a TMA load,
# so it equals the TMA row if the M-stage total includes the TMA pipe (its breakdown `..._pipe_tma` says so).
# Out-of-bounds box rows (the tail of Q and of the last K/V tile) are zero-filled by TMA; the prediction counts
# in-bounds bytes only, and whether ncu counts bytes for the out-of-bounds part of a box is what the causal
# 1000 x 1500 target shows (every other target has no tail).
# The wgmma operand reads (HGMMA) have counters too: `..._op_gmma` at the l1tex data stage and SASS-level
# instruction and byte counts. Reported for the TMA kernels (predicted: HGMMA per warp, the walk's operand
# bytes, one wavefront per 128 bytes and no conflict under the swizzle), not targeted: how the tensor
# core's operand fetches are split into warps and wavefronts is not documented.
# bwd_sm90_ws_kernel loads the same way (K, V boxes once per CTA; Q, dO boxes per visited query block) and adds two
# 1-D bulk copies (cp.async.bulk, SASS UBLKCP) per visit, lse_log2 and delta: those are in the UTMALDG/UBLKCP
# instruction count above and, as TMA-unit loads, predicted in the TMA read rows too (the note of the row gives the
# boxes' and the copies' bytes apart, should the counter leave the copies out).
TMA_METRICS = {
    "l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum": ("L2->SM read bytes of TMA loads", 0.02),
    "l1tex__m_xbar2l1tex_read_sectors_pipe_tma.sum": ("L2->SM read sectors of the TMA pipe", 0.02),
    "lts__t_sectors_srcunit_tex_op_read.sum": ("L2 sectors read by unit TEX (TMA included?)", None),
    "sm__sass_inst_executed_op_tma_ld.sum": ("TMA load instructions (UTMALDG boxes, UBLKCP copies)", "exact"),
    "l1tex__tmain_requests.sum": ("TMA instructions sent to the TMA unit", None),
}

# bwd_sm90_ws_kernel adds each visit's dQ block to dQ_acc with one bulk reduction (cp.reduce.async.bulk .add.f32,
# SASS UBLKRED, issued by one consumer thread): the TMA unit reads the BLOCK_M x HEAD_DIM fp32 buffer from shared
# memory and sends it SM -> L2, where the L2 adds it; no LSU RED instruction, no L2 -> SM data. The counters (names
# as public Nsight Compute scripts spell them; like every metric here, one that this ncu does not know is dropped
# and listed in the document):
#   l1tex__m_l1tex2xbar_write_bytes_mem_global_op_tma_red  SM -> L2 bytes of global TMA reductions: the payload,
#       BLOCK_M * HEAD_DIM * 4 per visit (pad rows included). Targeted (2%).
#   l1tex__m_l1tex2xbar_write_bytes_pipe_tma  all SM -> L2 writes of the TMA pipe: the same bytes (the kernel's
#       stores of dK, dV are LSU stores). Targeted (2%).
#   smsp__sass_inst_executed_op_tma_red  the UBLKRED instructions: one per visit. Exact.
#   l1tex__t_requests_pipe_lsu_mem_global_op_red  LSU reductions: none (0, exact), which tells the bulk reductions
#       apart from bwd_sm90_kernel's red.global.add.
#   l1tex__m_l1tex2xbar_write_bytes_mem_global_op_red, lts__t_sectors_op_red  reported, not targeted: whether the
#       op_red breakdown and the L2's reduction sectors count the TMA unit's reductions is not documented.
# The all-source write row l1tex__m_l1tex2xbar_write_bytes stays targeted, predicted as the dK, dV stores plus the
# reduction payload, on the assumption that the M-stage write total includes the TMA pipe as the read total does
# (fwd_sm90_ws_kernel's measured L2->SM read bytes equal its TMA load bytes).
BULK_RED_METRICS = {
    "l1tex__m_l1tex2xbar_write_bytes_mem_global_op_tma_red.sum": ("SM->L2 bytes of bulk reductions (dQ)", 0.02),
    "l1tex__m_l1tex2xbar_write_bytes_pipe_tma.sum": ("SM->L2 write bytes of the TMA pipe", 0.02),
    "smsp__sass_inst_executed_op_tma_red.sum": ("bulk reduction instructions (UBLKRED)", "exact"),
    "l1tex__t_requests_pipe_lsu_mem_global_op_red.sum": ("LSU global reduction requests (RED instructions)", "exact"),
    "l1tex__m_l1tex2xbar_write_bytes_mem_global_op_red.sum": ("SM->L2 reduction bytes, op_red (TMA included?)", None),
    "lts__t_sectors_op_red.sum": ("L2 reduction sectors, all sources", None),
}
# the rows that a walk of every shared-memory instruction predicts (_shared_predictions, banks.*_kernel_shared)
SHARED_WALK_METRICS = (
    "smsp__inst_executed_op_shared_ld.sum", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum", "smsp__inst_executed_op_shared_st.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum", "smsp__inst_executed_op_ldsm.sum",
    "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum",
    "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ldsm.sum", "smsp__sass_inst_executed_op_ldgsts.sum",
    "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum",
)
ABSENT_IN_UNWALKED = ("smsp__inst_executed_op_ldsm.sum", "smsp__sass_inst_executed_op_ldgsts.sum")
# the wide kernels' shared traffic in bytes as their threads request it (each thread's loads and stores; cp.async
# chunks zero-filled included), against strategies._wide_fwd_shared / _wide_bwd_shared
WIDE_METRICS = {
    "sm__sass_data_bytes_mem_shared_op_ld.sum": ("shared load bytes (LDS, per thread)", 0.02),
    "sm__sass_data_bytes_mem_shared_op_st.sum": ("shared store bytes (STS, per thread)", 0.02),
    # reported, not targeted: on an H100 (2026-12-07) it read 0.28-0.51 of the bytes the copies write (143-256 bytes
    # per 512-byte warp instruction, not a whole number of chunks), while the cp.async instruction count was exact
    "sm__sass_data_bytes_mem_shared_op_ldgsts.sum": ("cp.async shared bytes (LDGSTS, per thread)", None),
}
GMMA_METRICS = {
    "sm__sass_inst_executed_op_shared_gmma.sum": ("wgmma instructions (HGMMA, per warp)", None),
    "sm__sass_data_bytes_mem_shared_op_gmma.sum": ("wgmma shared operand bytes", None),
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum": ("wgmma shared wavefronts", None),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_gmma.sum": ("wgmma shared bank conflicts", None),
}


def metrics_for(target: Target) -> dict:
    """{metric: (what, tolerance)} compared for one target, in table order."""
    out = dict(METRICS)
    if target.kernel in WGMMA_KERNELS:
        out = {m: WGMMA_METRIC_CHANGES.get(m, v) for m, v in out.items()}
        out = {m: v for m, v in out.items() if v is not None}
    if target.kernel in TMA_KERNELS:
        # after the L2->SM read bytes, so the TMA loads sit next to the reads they are; the wgmma rows after
        # the shared-memory rows
        items = list(out.items())
        at = [m for m, _ in items].index("l1tex__m_xbar2l1tex_read_bytes.sum") + 1
        items = items[:at] + list(TMA_METRICS.items()) + items[at:]
        at = [m for m, _ in items].index("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
        out = dict(items[:at] + list(GMMA_METRICS.items()) + items[at:])
    if target.kernel in UNWALKED_KERNELS:  # reported, not targeted: no instruction walk predicts them (but the
        # instruction kinds such a kernel has none of: ldmatrix, cp.async; or counts exactly: cp.async)
        out = {m: ((what, None) if m in SHARED_WALK_METRICS and m not in ABSENT_IN_UNWALKED else (what, tol))
               for m, (what, tol) in out.items()}
    if target.kernel in WIDE_KERNELS:  # their shared bytes after the shared rows; the L2 model does not cover them
        items = [(m, (what, None) if m.startswith("dram__") else (what, tol)) for m, (what, tol) in out.items()]
        at = [m for m, _ in items].index("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
        out = dict(items[:at] + list(WIDE_METRICS.items()) + items[at:])
    adds = (RED_METRICS if (target.kernel in ("bwd_kernel", "bwd_sm90_kernel", "bwd_wide_kernel")
                            and not target.deterministic)
            or target.kernel in RED_V4_KERNELS
            else BULK_RED_METRICS if target.kernel in BULK_RED_KERNELS else None)
    if adds is not None:
        # after the SM->L2 write bytes, so the dQ adds sit next to the stores in the table
        items = list(out.items())
        at = [m for m, _ in items].index("l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum") + 1
        out = dict(items[:at] + list(adds.items()) + items[at:])
    return out


_UNIT_SCALE = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12, "kib": 1024, "mib": 2 ** 20,
               "gib": 2 ** 30, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "nsecond": 1, "usecond": 1e3,
               "msecond": 1e6, "second": 1e9}


# ----------------------------------------------------------------------------------------------
# ncu CSV
# ----------------------------------------------------------------------------------------------

def parse_number(text: str) -> float | None:
    """A metric value from ncu's CSV: '1,234,567' (thousands separators), '12.5', 'n/a' -> None."""
    t = text.strip().replace("\u202f", "").replace(" ", "")
    if not t or t.lower() in ("n/a", "na", "-", "nan"):
        return None
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    elif "," in t and "." not in t and re.fullmatch(r"[+-]?\d+,\d+", t):
        t = t.replace(",", ".")  # a decimal comma (some locales), e.g. '12,5'
    try:
        return float(t)
    except ValueError:
        return None


def _csv_rows(text: str):
    """(column index by name, data rows) of the CSV block in `text`, or (None, [])."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    header_at = next((i for i, ln in enumerate(lines) if '"Metric Name"' in ln and '"ID"' in ln), None)
    if header_at is None:
        return None, []
    reader = csv.reader(io.StringIO("\n".join(lines[header_at:])))
    header = next(reader)
    col = {name: i for i, name in enumerate(header)}
    if any(n not in col for n in ("ID", "Metric Name", "Metric Value")):
        return None, []
    return col, [row for row in reader if len(row) == len(header) and row[col["ID"]] != "ID"]


def parse_ncu_csv(text: str) -> dict[str, dict[str, float]]:
    """{kernel ID: {metric name: value in base units}} from `ncu --csv` output mixed with other lines.

    Rows: "ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",
    "Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value". Units such as
    Kbyte/Mbyte are converted to bytes (in case --print-units base was not honoured)."""
    col, rows = _csv_rows(text)
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        value = parse_number(row[col["Metric Value"]])
        if value is None:
            continue
        unit = row[col["Metric Unit"]].strip().lower() if "Metric Unit" in col else ""
        value *= _UNIT_SCALE.get(unit, 1)
        out.setdefault(row[col["ID"]], {})[row[col["Metric Name"]].strip()] = value
    return out


def parse_ncu_kernel_names(text: str) -> dict[str, str]:
    """{kernel ID: "Kernel Name" column} of ncu's CSV output."""
    col, rows = _csv_rows(text)
    if col is None or "Kernel Name" not in col:
        return {}
    return {row[col["ID"]]: row[col["Kernel Name"]] for row in rows}


def kernel_matches(kernel: str, name: str) -> bool:
    """Whether ncu's kernel name (function, demangled or mangled) is `kernel`, as a whole identifier
    (bwd_kernel must not match bwd_dq_kernel); mangled names spell it with its length: 10bwd_kernel."""
    if re.search(rf"(?<![A-Za-z0-9_]){re.escape(kernel)}(?![A-Za-z0-9_])", name):
        return True
    return re.search(rf"(?<![0-9]){len(kernel)}{re.escape(kernel)}", name) is not None


def rejected_metrics(text: str, metrics: list[str]) -> list[str]:
    """Metrics of `metrics` that ncu's error output names as unknown, e.g.
    '==ERROR== Failed to find metric regex:^foo__bar\\.(sum|min|max|avg|pct|ratio|max_rate)$' or
    '... metric foo__bar.sum'."""
    lines = [ln for ln in text.splitlines() if re.search(r"metric", ln, re.I) and re.search(r"ERROR|fail|not|invalid|unknown", ln, re.I)]
    out = []
    for m in metrics:
        base = m.split(".")[0]
        pat = rf"(?<![A-Za-z0-9_]){re.escape(base)}(?![A-Za-z0-9_])"
        if any(re.search(pat, ln) for ln in lines):
            out.append(m)
    return out


# ----------------------------------------------------------------------------------------------
# Predictions
# ----------------------------------------------------------------------------------------------

def predicted_global_bytes(case: Case, cfg=None) -> tuple[int, int]:
    """(read, write) bytes between SMs and L2 at 32-byte sector granularity, the forward kernel's accesses
    (cfg: a FwdConfig or FwdSm90Config, default case.config(), fwd_kernel; both kernels access global
    memory the same way, with their own blocks).

    Rows of Q, K, V, O are head_dim*elem_bytes contiguous bytes at a row stride of heads*head_dim
    elements (contiguous bshd inputs); lse rows are 4 bytes, contiguous per (batch, head), written by the
    t == 0 lanes (8 rows per warp instruction) or, in a CTA that sees no key, 32 rows per instruction (stat_bytes
    each: 8 for fp64). fwd_wide_kernel at v_split > 1 reads Q and K once per column part, V once."""
    p = case.problem()
    cfg = case.config() if cfg is None else cfg
    e, d, h, stat = p.elem_bytes, p.head_dim, p.heads, p.stat_bytes
    row_bytes = d * e
    # fwd_wide_kernel at v_split > 1: each column part's CTA reads Q and K whole, V its columns (parts: those that
    # hold a column of the head dim)
    v_split = getattr(cfg, "v_split", 1)
    parts = -(-d // (cfg.head_dim // v_split))

    def rows_sectors(rows_total_per_bh: int) -> int:  # every row of every (b, h) once
        b = np.arange(p.batch)[:, None, None]
        hh = np.arange(h)[None, :, None]
        r = np.arange(rows_total_per_bh)[None, None, :]
        start = ((b * rows_total_per_bh + r) * h + hh) * row_bytes
        return int(((start + row_bytes - 1) // SECTOR - start // SECTOR + 1).sum())

    # per (b, h): Q rows once per live CTA, K/V rows once per visited tile, O rows once
    n_begin, n_end = key_block_ranges(p, cfg.block_m, cfg.block_n)
    live = n_end > n_begin
    q_rows = int((block_sizes(p.seqlen_q, cfg.block_m) * live).sum())
    kv_rows = int(((np.minimum(n_end * cfg.block_n, p.seqlen_k) - n_begin * cfg.block_n) * live).sum())
    per_row = -(-row_bytes // SECTOR) if (row_bytes % SECTOR == 0 and (h * row_bytes) % SECTOR == 0) else None
    if parts > 1 and (per_row is None or (d // parts * e) % SECTOR):
        raise ValueError(f"column parts of {cfg.head_dim // v_split} need sector-aligned rows (head_dim={d})")
    if per_row is not None:  # every row starts on a sector boundary
        reads = (parts * (q_rows + kv_rows) + kv_rows) * per_row * p.batch_heads * SECTOR
        o_writes = p.seqlen_q * per_row * p.batch_heads * SECTOR
    else:  # unaligned rows: average sectors per row from the actual addresses
        avg_q = rows_sectors(p.seqlen_q) / (p.seqlen_q * p.batch_heads)
        avg_k = rows_sectors(p.seqlen_k) / (p.seqlen_k * p.batch_heads)
        reads = int(round((q_rows * avg_q + 2 * kv_rows * avg_k) * p.batch_heads * SECTOR))
        o_writes = rows_sectors(p.seqlen_q) * SECTOR
    # lse: warp instructions (mt, half) of 8 lanes (rows g) or, zero CTAs, 32 consecutive rows; each
    # instruction writes consecutive rows, so its sectors are last // 32 - first // 32 + 1
    rows_q = block_sizes(p.seqlen_q, cfg.block_m)
    lse_sectors = 0
    for m_block, (rq, is_live) in enumerate(zip(rows_q, live)):
        group = 8 if is_live else 32
        g0 = np.arange(0, rq, group)
        first_row = m_block * cfg.block_m + g0
        last_row = m_block * cfg.block_m + np.minimum(g0 + group, rq) - 1
        base = (np.arange(p.batch_heads) * p.seqlen_q * stat)[:, None]
        first, last = base + first_row * stat, base + last_row * stat + stat - 1
        lse_sectors += int((last // SECTOR - first // SECTOR + 1).sum())
    return reads, o_writes + lse_sectors * SECTOR


def _shared_predictions(walk, notes: dict) -> dict:
    """The shared-memory rows of a kernel's walk (banks.*_kernel_shared). notes: SASS class -> text. The
    load rows count thread instructions only; a wgmma kernel's operand reads are named in the note."""
    lds, ldsm, sts, ldgsts, stsm = (walk.by_sass(s) for s in ("LDS", "LDSM", "STS", "LDGSTS", "STSM"))

    def by_role(sass: str) -> str:  # where predicted conflicts come from, to explain a miss
        parts = [f"{r} {s.conflicts:,}" for r, s in walk.roles.items()
                 if walk.role_table[r][1] == sass and s.conflicts]
        return ("; conflicts: " + ", ".join(parts)) if parts else ""

    return {
        # the counter counts LDS (LDSM has its own rows), including the predicated-off LDS that ptxas puts
        # before cp.async blocks (banks.guard_lds_per_warp): issued, so counted, but no wavefront
        "smsp__inst_executed_op_shared_ld.sum": (
            lds.instructions + walk.guard_lds,
            f"LDS {lds.instructions:,} + predicated-off LDS {walk.guard_lds:,} ("
            + notes.get("guard", "3 per cp.async block" + (", 4 per fence.proxy.async" if walk.wgmma_read_bytes else ""))
            + "); no LDSM"),
        "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": (
            lds.wavefronts + ldsm.wavefronts, f"LDS {lds.wavefronts:,} + LDSM {ldsm.wavefronts:,}"
            + (f"; not included: wgmma operand reads, {walk.wgmma_read_bytes:,} B" if walk.wgmma_read_bytes else "")
            + (f"; bulk-reduction reads of the dQ buffer, {walk.bulk_read_bytes:,} B" if walk.bulk_read_bytes
               else "")),
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": (
            lds.conflicts + ldsm.conflicts, f"LDS {lds.conflicts:,} + LDSM {ldsm.conflicts:,}" + by_role("LDS")),
        "smsp__inst_executed_op_shared_st.sum": (sts.instructions, notes["STS"]),
        # stmatrix (STSM) is not an STS instruction but its wavefronts are in this counter (H100, 2026-12-06)
        "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": (
            sts.wavefronts + stsm.wavefronts,
            (f"STS {sts.wavefronts:,} + STSM {stsm.wavefronts:,}" if stsm.instructions else "STS only")
            + f"; + LDGSTS would be {sts.wavefronts + stsm.wavefronts + ldgsts.wavefronts:,}"),
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": (sts.conflicts, "STS only" + by_role("STS")),
        "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": (
            lds.conflicts + ldsm.conflicts, f"LDS {lds.conflicts:,} + LDSM {ldsm.conflicts:,}; addresses only"),
        "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": (sts.conflicts, "STS; addresses only"),
        "smsp__inst_executed_op_ldsm.sum": (ldsm.instructions, notes["LDSM"]),
        "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldsm.sum": (ldsm.wavefronts, ""),
        "smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ldsm.sum": (ldsm.conflicts, by_role("LDSM")[2:]),
        "smsp__sass_inst_executed_op_ldgsts.sum": (ldgsts.instructions, notes["LDGSTS"]),
        "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum": (
            Band(ldgsts.wavefronts, ldgsts.wavefronts_hi),
            "per 8 lanes: max(bank rule, shared lines) .. max(that, global lines)"
            + ("" if ldgsts.wavefronts_hi == ldgsts.wavefronts else
               "; 64-byte panels: 2 global lines into 1 shared line")),
    }


def _measured_only() -> dict:
    return {
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": (None, "measured only"),
        "gpu__time_duration.sum": (None, "measured only"),
    }


def _predict_fwd(target: Target, l2_bytes: int, num_sms: int) -> dict:
    case, cfg = target.case, target.config()
    p = case.problem()
    walk = banks.fwd_kernel_shared(cfg, p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim)
    # the L2 model of the profiled kernel's own config (the library's default family may be another one, see
    # Target.config), with its blocks and residency
    dram = _l2.simulate_l2("cuflash", p, l2_bytes=l2_bytes, block_m=cfg.block_m, block_n=cfg.block_n,
                           num_sms=num_sms, ctas_per_sm_=_l2.config_resident(cfg))
    reads, writes = predicted_global_bytes(case, cfg)
    grid = cfg.grid(p.batch, p.heads, p.seqlen_q)
    is_wgmma = target.kernel in WGMMA_KERNELS
    is_tma = target.kernel in TMA_KERNELS
    warps = cfg.threads // 32
    out = {
        "l1tex__m_xbar2l1tex_read_bytes.sum": (
            reads, "Q once per CTA, K and V once per visited tile"
            + (": TMA boxes, in-bounds rows only (all the kernel's global reads)" if is_tma else "")),
        "l1tex__m_l1tex2xbar_write_bytes.sum": (writes, "O and lse once (32-byte sectors)"),
        "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum": (writes, "O and lse (32-byte sectors)"),
        "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum": (0, "the kernels are spill-free"),
        "dram__bytes_read.sum": (dram.read_bytes, f"LRU L2 of {l2_bytes / 2**20:.0f} MiB, {num_sms} SMs"),
        "dram__bytes_write.sum": (dram.write_bytes,
                                  "model incl. the final write-back; ncu sees only evictions during the kernel"),
        "launch__grid_size": (grid[0] * grid[1] * grid[2], f"grid {grid}"),
        "launch__block_size": (cfg.threads, f"{warps} warps" + (": a TMA producer warpgroup, 2 consumer warpgroups"
                                                                if is_tma else "")),
    }
    notes = {"STS": "st.shared.b32 of the O epilogue",
             "LDSM": "none: wgmma reads Q, K, V through descriptors" if is_wgmma else "ldmatrix.x4 of Q, K, V",
             "LDGSTS": "Q once, K and V per tile, zero-fill included"}
    if is_tma:
        notes.update(STS="st.shared.b32 of the O staging by the 8 consumer warps", LDGSTS="none: TMA loads Q, K, V",
                     guard="none expected: no cp.async, no fence.proxy.async")
    out.update(_shared_predictions(walk, notes))
    if is_tma:
        out.update(_tma_predictions(walk, reads, f"per live CTA HEAD_DIM/{cfg.box_cols} boxes of Q, and of K and of V "
                                                 "per key tile", "A (S = Q K^T) and B operands per warpgroup wgmma"))
    out.update(_measured_only())
    return {m: out[m] for m in metrics_for(target)}


def _tma_predictions(walk, reads: int, count_note: str, gmma_note: str) -> dict:
    """The TMA and wgmma rows of a TMA kernel (TMA_METRICS, GMMA_METRICS) from its walk and its global reads (the
    in-bounds rows of every box and every 1-D bulk copy, in 32-byte sectors). count_note: where the UTMALDG boxes
    and UBLKCP copies come from; gmma_note: which wgmma operands are read from shared memory."""
    tma, copies = walk.by_sass(banks.TMA_CLASS), walk.by_sass(banks.BULK_COPY_CLASS)
    reds, gmma = walk.by_sass(banks.BULK_READ_CLASS), walk.by_sass(banks.TENSOR_CLASS)
    box_note = (f"{tma.instructions:,} boxes of {walk.config.box_cols} columns, {tma.bytes:,} B written to shared "
                f"memory (zero-filled rows included)"
                + (f"; {copies.instructions:,} 1-D bulk copies, {copies.bytes:,} B" if copies.instructions else "")
                + "; read: in-bounds rows only")
    return _tma_rows(tma.instructions, copies.instructions, reds.instructions, reads, gmma.instructions, gmma.bytes,
                     walk.config.box_cols, box_note, count_note, gmma_note)


def _tma_rows(boxes: int, copies: int, bulk_reds: int, reads: int, gmma: int, gmma_bytes: int, box_cols: int,
              box_note: str, count_note: str, gmma_note: str) -> dict:
    """The TMA and wgmma rows from counts: UTMALDG boxes, UBLKCP copies, UBLKRED reductions, the global reads'
    bytes, wgmma instructions per warpgroup and their shared operand bytes."""
    requests = "the UTMALDG boxes" + (", the UBLKCP copies" if copies else "") \
        + (f" and {bulk_reds:,} UBLKRED reductions" if bulk_reds else "")
    return {
        "l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum": (reads, box_note),
        "l1tex__m_xbar2l1tex_read_sectors_pipe_tma.sum": (reads // SECTOR, "the TMA loads in 32-byte sectors"),
        "lts__t_sectors_srcunit_tex_op_read.sum": (reads // SECTOR, "if the L2 counts TMA requests as unit TEX"),
        "sm__sass_inst_executed_op_tma_ld.sum": (boxes + copies, count_note),
        "l1tex__tmain_requests.sum": (boxes + copies + bulk_reds, requests + " (+ prefetch.tensormap if counted)"),
        "sm__sass_inst_executed_op_shared_gmma.sum": (4 * gmma, f"{gmma:,} wgmma per warpgroup x 4 warps"),
        "sm__sass_data_bytes_mem_shared_op_gmma.sum": (gmma_bytes, gmma_note),
        "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum": (gmma_bytes // 128, "one per 128 bytes"),
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_gmma.sum": (0, f"{box_cols * 2}-byte swizzle: none"),
    }


def _red_rows(reds: int, red: int, per: str, sector_note: str, *, sectors: int | None = None,
              carried: int | None = None, tile: str = "fp32") -> dict:
    """The LSU reduction rows (RED_METRICS) of a kernel whose dQ adds are `reds` RED instructions of `red` bytes in
    all: `sectors` L2 sectors (default: whole 32-byte sectors, red / 32) and `carried` bytes on ncu's L1 and SM -> L2
    byte counters (default red; a float64 RED counts 16 bytes a lane there)."""
    sectors = red // SECTOR if sectors is None else sectors
    carried = red if carried is None else carried
    as_counted = f"; {carried // red}x the bytes added, as ncu counts them" if carried != red else ""
    return {
        "l1tex__t_requests_pipe_lsu_mem_global_op_red.sum": (reds, per),
        "l1tex__t_bytes_pipe_lsu_mem_global_op_red.sum": (carried, f"whole [BLOCK_M, HEAD_DIM] {tile} tile per "
                                                                   f"visit, pad rows included{as_counted}"),
        "l1tex__m_l1tex2xbar_write_bytes_mem_global_op_red.sum": (carried, f"the red payload, SM -> L2{as_counted}"),
        "lts__t_sectors_srcunit_tex_op_red.sum": (sectors, sector_note),
        "lts__t_sectors_op_red.sum": (sectors, "as above; more if the L2 partitions both count a request"),
    }


def isolated_kernel_dram(p: Problem, kernel_index: int, deterministic: bool, l2_bytes: int,
                         num_sms: int, kernels: str = "mma", main=None) -> tuple[int, int]:
    """(DRAM read, write) bytes of one launch of the cuflash backward in isolation: the L2 model's trace of
    attention_backward (l2._cuflash_bwd: 0 preprocess, 1 the main kernel, 2 convert or bwd_dq_kernel) cut
    to that launch and started cold, as ncu's --cache-control all flushes the L2 before the kernel."""
    tr = _l2._Trace(p, "tile")
    _l2._cuflash_bwd(tr, p, True, num_sms, deterministic, kernels, main)
    tr.parts = [part for part in tr.parts if part[0].size and int(part[0][0]) == kernel_index]
    res = tr.run(l2_bytes // SECTOR)
    return res.read_bytes, res.write_bytes


def _predict_bwd(target: Target, l2_bytes: int, num_sms: int) -> dict:
    case, det = target.case, target.deterministic
    p = case.problem()
    cfg = target.config()
    # the main kernel's traffic with the profiled kernel's own config: bwd_sm90_kernel (the driver takes the
    # warp-specialized family out) has its own tiles, steps of 64 queries where bwd_sm90_ws_kernel takes 128 at head
    # dims 32 and 64; bwd_sm90_ws_kernel's is the library's choice (Target checks it)
    main = cfg if target.kernel in ("bwd_sm90_kernel", "bwd_sm90_ws_kernel", "bwd_sm90_split_kernel") else None
    kt = {k.name: k for k in cuflash_backward_kernels(p, True, det, target.kernels, main)}[target.kernel]
    is_ws = target.kernel == "bwd_sm90_ws_kernel"
    is_split = target.kernel == "bwd_sm90_split_kernel"
    if is_ws:
        walk = banks.bwd_kernel_shared(cfg, p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim)
        index = 1
        read_note = ("K, V once per CTA (TMA boxes); per visited query block Q, dO (TMA boxes) and BLOCK_M lse_log2, "
                     "delta (1-D bulk copies): all the kernel's global reads, in-bounds rows only")
        notes = {"STS": "per visit the dQ block (16-byte stores, dQ_acc order; at head dim 128 by consumer 1's 4 "
                        "warps); dK, dV epilogue; not dS^T, stored by stmatrix (STSM, not counted here)",
                 "LDSM": "none: wgmma reads K, V, Q, dO, dS^T through descriptors",
                 "LDGSTS": "none: TMA and bulk copies load K, V, Q, dO, lse_log2, delta",
                 "guard": "none expected: no cp.async, and none before this kernel's fence.proxy.async in the "
                          "NVRTC 13.0 SASS"}
        store_note = "dK, dV (valid keys)"
    elif is_split:
        walk = None
        index = 1
        read_note = ("K, V once per CTA with a visit (TMA boxes); per visited query block Q, dO (TMA boxes) and "
                     "BLOCK_M lse_log2, delta (1-D bulk copies): all the kernel's global reads, in-bounds rows only")
        store_note = "dK, dV (valid keys)"
    elif target.kernel in ("bwd_kernel", "bwd_sm90_kernel"):
        is_wgmma = target.kernel in WGMMA_KERNELS
        walk = banks.bwd_kernel_shared(cfg, p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim)
        index = 1
        read_note = ("K, V once per CTA; per visited query block Q, dO (valid rows) and BLOCK_M lse_log2, delta "
                     "(cp.async)")
        writers = "every warp" if is_wgmma else "warps with warp % D_SPLIT == 0"
        notes = {"STS": "dK, dV epilogue" + ("" if det else f" + dS^T ({writers})"),
                 "LDSM": ("none: wgmma reads K, V, Q, dO" + ("" if det else ", dS^T") + " through descriptors")
                 if is_wgmma else "ldmatrix.x4 of K, V, Q, dO" + ("" if det else ", dS^T"),
                 "LDGSTS": "K, V once; Q, dO, lse_log2, delta per visit; zero-fill included"}
        store_note = "dK, dV (valid keys)"
    else:
        walk = banks.dq_kernel_shared(cfg, p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.head_dim)
        index = 2
        read_note = ("per CTA that sees a key: Q, dO (cp.async), BLOCK_M lse_log2 and delta (ld.global, one "
                     "sector per 8 rows); K, V per visited key tile")
        notes = {"STS": "st.shared.b32 of the dQ epilogue", "LDSM": "ldmatrix.x4 of Q, dO, K, V",
                 "LDGSTS": "Q, dO once, K and V per tile, zero-fill included"}
        store_note = "dQ (every row; rows without keys get zeros)"
    dram_r, dram_w = isolated_kernel_dram(p, index, det, l2_bytes, num_sms, target.kernels, main)
    grid = kt.grid
    red = kt.atomic_bytes
    out = {
        "l1tex__m_xbar2l1tex_read_bytes.sum": (kt.read_bytes, read_note),
        "l1tex__m_l1tex2xbar_write_bytes.sum": (
            kt.write_bytes + red,
            store_note + ("" if not red else
                          f" {kt.write_bytes:,} + dQ bulk-reduction payload {red:,} (the TMA unit's writes)" if is_ws
                          else f" {kt.write_bytes:,} + dQ red payload {red:,} (reds leave the SM as writes)")),
        "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum": (kt.write_bytes, store_note + ", 16-byte stores"),
        "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum": (0, "the kernels are spill-free"),
        "dram__bytes_read.sum": (dram_r, f"LRU L2 of {l2_bytes / 2**20:.0f} MiB, this kernel alone, cold"
                                 + (" (dq_accum sectors are read before the L2 adds)" if red else "")),
        "dram__bytes_write.sum": (dram_w, "model incl. the final write-back; ncu sees only evictions during the kernel"),
        "launch__grid_size": (grid[0] * grid[1] * grid[2], f"grid {grid}"),
        "launch__block_size": (cfg.threads, "12 warps: a TMA producer warpgroup, 2 consumer warpgroups" if is_ws
                               else "8 warps: 2 warpgroups (thread 0 issues the TMA loads)" if is_split
                               else f"{cfg.num_warps} warps"),
    }
    if is_split:
        out.update(_split_predictions(cfg, p, kt))
        out.update(_measured_only())
        return {m: out[m] for m in metrics_for(target)}
    if is_ws:
        # one bulk reduction of the whole BLOCK_M x HEAD_DIM fp32 block per visit
        m_begin, m_end = bwd_query_blocks(cfg, p.seqlen_q, p.seqlen_k)
        visits = int(np.maximum(m_end - m_begin, 0).sum()) * p.batch_heads
        assert visits * cfg.block_m * cfg.head_dim * p.stat_bytes == red, (visits, red)
        assert walk.by_sass(banks.BULK_READ_CLASS).instructions == visits
        out.update({
            "l1tex__m_l1tex2xbar_write_bytes_mem_global_op_tma_red.sum": (
                red, f"{visits:,} visits x {cfg.block_m} x {cfg.head_dim} x 4 B (pad rows included)"),
            "l1tex__m_l1tex2xbar_write_bytes_pipe_tma.sum": (red, "the dQ reductions: the TMA pipe's only writes"),
            "smsp__sass_inst_executed_op_tma_red.sum": (visits, "one cp.reduce.async.bulk per visit (one consumer "
                                                                "thread)"),
            "l1tex__t_requests_pipe_lsu_mem_global_op_red.sum": (0, "none: no red.global, dQ by bulk reduction"),
            "l1tex__m_l1tex2xbar_write_bytes_mem_global_op_red.sum": (red, "the payload, if op_red counts the TMA "
                                                                           "unit's reductions"),
            "lts__t_sectors_op_red.sum": (red // SECTOR, "the payload's sectors, if the L2 counts bulk reductions "
                                                         "as reductions"),
        })
        box = cfg.box_cols
        out.update(_tma_predictions(
            walk, kt.read_bytes, f"per live CTA HEAD_DIM/{box} boxes of K and of V; per visit HEAD_DIM/{box} boxes "
                                 "of Q and of dO and 2 bulk copies (lse_log2, delta)",
            "per visit and warpgroup: K, V rows and Q, dO (S^T, dP^T), dO and Q (dV, dK), dS^T and K (dQ)"))
    if target.kernel in ("bwd_kernel", "bwd_sm90_kernel") and not det:
        m_begin, m_end = bwd_query_blocks(cfg, p.seqlen_q, p.seqlen_k)
        visits = int(np.maximum(m_end - m_begin, 0).sum()) * p.batch_heads
        if isinstance(cfg, _config.BwdSm90Config):  # each warp: its 16 query rows x DQ_COLS columns
            per_warp = banks.bwd_sm90_layout(cfg).dq_cols // 8 * 2
        else:  # each warp: DQ_M_TILES x DQ_D_TILES m16n8 tiles of its part of the warp grid
            L = banks.bwd_layout(cfg)
            per_warp = L.dq_m_tiles * L.dq_d_tiles * 2
        reds = visits * cfg.num_warps * per_warp
        assert reds * WARP_RED_BYTES == red, (reds, red)
        out.update(_red_rows(reds, red, f"{visits:,} visits x {cfg.num_warps} warps x {per_warp} RED.v2 of 256 B",
                             "one L2 sector per 4 lanes: 8 per RED"))
    out.update(_shared_predictions(walk, notes))
    out.update(_measured_only())
    return {m: out[m] for m in metrics_for(target)}


WARP_RED_BYTES = 32 * 8  # red.global.add.v2.f32: 32 lanes x 2 floats
WARP_RED_V4_BYTES = 32 * 16  # red.global.add.v4.f32: 32 lanes x 4 floats


def _split_predictions(cfg, p: Problem, kt) -> dict:
    """The rows particular to bwd_sm90_split_kernel (cuda/bwd_sm90_split.cuh, the default mode): its TMA loads, its
    dQ adds (red.global.add.v4.f32 from the accumulator registers) and its wgmma, counted from the kernel's program
    order per CTA and per visited query block; its LDS / STS are not walked (reported only), and it has no ldmatrix
    and no cp.async.

    Per CTA with a visit: thread 0 loads K and V, HEAD_DIM / box_cols TMA boxes each. Per visit: Q and dO, as many
    boxes each, and lse_log2 and delta by one 1-D bulk copy each. Warpgroup w (of 2) issues per visit S^T (w = 0) or
    dP^T (w = 1), HEAD_DIM / 16 m64n64k16 wgmma reading K and Q or V and dO from shared memory; dV += P^T dO[:, half]
    and dK += dS^T Q[:, half], BLOCK_M / 16 wgmma each (warpgroup 0's dV takes P^T from registers, warpgroup 1's
    from the P^T tile); dQ = dS K[:, half] in HALF / DQ_CHUNK chunks of BLOCK_N / 16 wgmma, each chunk reading the
    whole dS^T tile. Each chunk leaves by DQ_CHUNK / 8 red.global.add.v4.f32 per thread (a warp's instruction adds
    512 contiguous bytes of dQ_acc: 16 sectors)."""
    hd, bm, bn, e, s4 = cfg.head_dim, cfg.block_m, cfg.block_n, p.elem_bytes, p.stat_bytes
    half = hd // 2
    chunks = half // cfg.dq_chunk
    panels = hd // cfg.box_cols
    m_begin, m_end = bwd_query_blocks(cfg, p.seqlen_q, p.seqlen_k)
    visits_kb = np.maximum(m_end - m_begin, 0)
    live, visits = int((visits_kb > 0).sum()) * p.batch_heads, int(visits_kb.sum()) * p.batch_heads
    boxes, copies = live * 2 * panels + visits * 2 * panels, 2 * visits
    red = kt.atomic_bytes
    reds = visits * 2 * 4 * (half // 8)  # per visit: 2 warpgroups x 4 warps x HALF / 8 instructions per warp
    assert reds * WARP_RED_V4_BYTES == red, (reds, red)
    per_wg = hd // 16 + 2 * (bm // 16) + chunks * (bn // 16)  # S^T or dP^T, dV, dK, dQ per visit
    q_t, kv_t, ds_t = bm * hd * e, bn * hd * e, bn * bm * e
    gmma_bytes = visits * (2 * (kv_t + q_t)  # S^T: K, Q; dP^T: V, dO
                           + q_t + ds_t  # dV: dO halves, warpgroup 1's P^T tile
                           + q_t + 2 * ds_t  # dK: Q halves, dS^T (each)
                           + kv_t + 2 * chunks * ds_t)  # dQ: K halves, dS^T per chunk (each)
    box_note = (f"{boxes:,} boxes of {cfg.box_cols} columns; {copies:,} 1-D bulk copies of {bm * s4} B; read: "
                "in-bounds rows only")
    return {
        **_tma_rows(boxes, copies, 0, kt.read_bytes, visits * 2 * per_wg, gmma_bytes, cfg.box_cols, box_note,
                    f"per live CTA {panels} boxes of K and of V; per visit {panels} of Q and of dO and 2 bulk copies",
                    "per visit: K, Q (S^T), V, dO (dP^T), dO halves and P^T (dV), Q halves and dS^T x 2 (dK), K halves "
                    f"and dS^T x {2 * chunks} (dQ)"),
        **_red_rows(reds, red, f"{visits:,} visits x 8 warps x {half // 8} RED.v4 of 512 B",
                    "16 L2 sectors per warp instruction"),
        "smsp__inst_executed_op_ldsm.sum": (0, "none: wgmma reads every tile through descriptors"),
        "smsp__sass_inst_executed_op_ldgsts.sum": (0, "none: TMA and bulk copies load K, V, Q, dO, lse_log2, delta"),
        **{m: (None, "not walked (shared bytes in program order: strategies._split_bwd_shared)")
           for m in SHARED_WALK_METRICS if m not in ABSENT_IN_UNWALKED},
    }


# ncu's L1 and SM -> L2 byte counters carry 16 bytes a lane for a float64 RED.E.ADD.F64, twice what it adds (an
# H100, 2026-12-07, with the request and L2 sector counts as predicted)
CARRIED_RED_FACTOR = {"fp64": 2}


def _wide_ldgsts(cfg, p: Problem) -> tuple[int, int]:
    """(cp.async warp instructions, shared bytes) of fwd_wide_kernel or bwd_wide_kernel (strategies'
    _wide_cp_async_bytes): load_wide_tile issues one 16-byte cp.async per thread per chunk of a whole tile, so tiles
    take their bytes / 512 warp instructions; the backward's lse_log2 and delta, BLOCK_M values each in 16-byte
    chunks, one per thread of the first 2 x BLOCK_M x stat / 16 threads (a warp instruction per 32 of them) a step."""
    tiles, vecs = _wide_cp_async_bytes(p, cfg, True)
    step_vecs = 2 * cfg.block_m * p.stat_bytes  # a step's lse_log2 and delta bytes
    instructions = tiles // 512 + vecs // step_vecs * -(-step_vecs // 16 // 32)
    return instructions * p.batch_heads, (tiles + vecs) * p.batch_heads


def _predict_wide(target: Target) -> dict:
    """fwd_wide_kernel and bwd_wide_kernel (cuda/wide.cuh, float32 as 3xTF32 or float64): global reads and writes
    as the 16-bit mma.sync kernels' (cp.async of valid rows and columns, 16-byte chunks; the backward's lse_log2 and
    delta whole BLOCK_M vectors), the dQ adds (float32: red.global.add.v2.f32, 8 bytes a thread; float64: two
    8-byte atomicAdd a thread, RED.E.ADD.F64, whose lanes t cover every other pair of a row's 64 bytes: two sectors
    a row), cp.async instructions and bytes, and the shared bytes in program order (strategies._wide_fwd_shared,
    _wide_bwd_shared: every element a thread loads or stores once per use); LDS / STS instructions, wavefronts and
    bank conflicts are reported, not predicted, and the L2 model does not cover these kernels."""
    case, cfg = target.case, target.config()
    p = case.problem()
    backward = target.is_backward
    warps = cfg.num_warps
    grid = cfg.grid(p.batch, p.heads, p.seqlen_k if backward else p.seqlen_q)
    ldgsts, ldgsts_bytes = _wide_ldgsts(cfg, p)
    if backward:
        kt = {k.name: k for k in cuflash_backward_kernels(p, True, False, "mma")}["bwd_wide_kernel"]
        sram_r, sram_w = _wide_bwd_shared(p, cfg, True)
        reads, writes, red = kt.read_bytes, kt.write_bytes, kt.atomic_bytes
        read_note = ("K, V once per CTA; per visited query block Q, dO (valid rows) and BLOCK_M lse_log2, delta "
                     "(cp.async)")
        store_note = "dK, dV (valid keys)"
    else:
        sram_r, sram_w = _wide_fwd_shared(p, cfg, True)
        reads, writes = predicted_global_bytes(case, cfg)
        red = 0
        read_note = "Q once per CTA, K and V once per visited tile (cp.async" + (
            f"; Q and K once per column part, {cfg.v_split} parts)" if cfg.v_split > 1 else ")")
        store_note = "O and lse once (32-byte sectors)"
    carried = red * CARRIED_RED_FACTOR.get(p.dtype, 1)  # the dQ adds' payload as ncu's byte counters count it
    out = {
        "l1tex__m_xbar2l1tex_read_bytes.sum": (reads, read_note),
        "l1tex__m_l1tex2xbar_write_bytes.sum": (
            writes + carried, store_note + (f" {writes:,} + dQ atomics' payload {carried:,}"
                                            + (" (as ncu counts it)" if carried != red else "") if red else "")),
        "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum": (writes, store_note),
        "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum": (0, "the kernels are spill-free"),
        "dram__bytes_read.sum": (None, "not modelled: the L2 model covers the 16-bit kernels only"),
        "dram__bytes_write.sum": (None, "not modelled"),
        "launch__grid_size": (grid[0] * grid[1] * grid[2], f"grid {grid}"),
        "launch__block_size": (cfg.threads, f"{warps} warps"),
        "smsp__inst_executed_op_ldsm.sum": (0, "none: fragments by scalar LDS (4 or 8 bytes)"),
        "smsp__sass_inst_executed_op_ldgsts.sum": (ldgsts, "whole tiles, one 16-byte chunk a thread per "
                                                           "instruction (zero-fill included)"),
        "sm__sass_data_bytes_mem_shared_op_ld.sum": (
            sram_r, "per thread, program order: S (or S^T, dP^T) operands, P V (dV, dK) B operands"
            + (", lse_log2 / delta, exchange slots, the dQ GEMM's dS and K" if backward else "")),
        "sm__sass_data_bytes_mem_shared_op_st.sum": (
            sram_w - ldgsts_bytes, "exchange slots (partial sums; float64: P^T) and dS" if backward
            else "none: O leaves from registers"),
        "sm__sass_data_bytes_mem_shared_op_ldgsts.sum": (ldgsts_bytes, "whole tiles, 16 bytes a thread"),
        **{m: (None, "not walked (shared bytes in program order: strategies._wide_*_shared)")
           for m in SHARED_WALK_METRICS if m not in ABSENT_IN_UNWALKED},
    }
    if red:
        m_begin, m_end = bwd_query_blocks(cfg, p.seqlen_q, p.seqlen_k)
        visits = int(np.maximum(m_end - m_begin, 0).sum()) * p.batch_heads
        dq_m = min(warps, cfg.block_m // 16)
        tiles = (cfg.block_m // 16 // dq_m) * (cfg.head_dim // 8 // (warps // dq_m))  # m16n8 dQ tiles a warp
        per_tile = 2 * (2 if p.dtype == "fp64" else 1)  # rows g and g + 8; float64: two scalar adds each
        reds = visits * warps * tiles * per_tile
        assert reds * WARP_RED_BYTES == red, (reds, red)
        # float64: each row's four 8-byte adds of an instruction touch 64 bytes (two sectors), and ncu's byte
        # counters carry 16 bytes a lane for RED.E.ADD.F64 (CARRIED_RED_FACTOR)
        out.update(_red_rows(reds, red, f"{visits:,} visits x {warps} warps x {tiles * per_tile} RED of 256 B",
                             "one sector per row of 8 floats" if p.dtype != "fp64" else
                             "two sectors per row: lanes t add doubles 2t or 2t + 1 of 8",
                             sectors=(2 if p.dtype == "fp64" else 1) * red // SECTOR, carried=carried,
                             tile="float64" if p.dtype == "fp64" else "fp32"))
    out.update(_measured_only())
    return {m: out[m] for m in metrics_for(target)}


def predict(target: Target | Case, l2_bytes: int, num_sms: int) -> dict[str, tuple[float | None, str]]:
    """{metric: (predicted value or None, note)} for one target (a bare Case means its fwd_kernel)."""
    if isinstance(target, Case):
        target = Target("fwd_kernel", target)
    if target.kernel in WIDE_KERNELS:
        return _predict_wide(target)
    if not target.is_backward:
        return _predict_fwd(target, l2_bytes, num_sms)
    return _predict_bwd(target, l2_bytes, num_sms)


def kernel_configs(target: Target) -> list:
    """Every kernel instantiation the target's driver launches (to compile them before profiling), in the
    target's kernel family."""
    c = target.case
    hd = _config.kernel_head_dim(c.head_dim, c.dtype)
    if not target.is_backward:  # the profiled forward itself (fwd_sm90_kernel: also where ws is the default)
        return [target.config()]
    if target.kernel == "bwd_wide_kernel":
        main = target.config()
        return [_config.forward_kernel_config(hd, c.dtype, c.causal, ARCH, "mma", seqlen_k=c.seqlen_k),
                _config.ElementwiseConfig("preprocess", c.dtype), main, _config.convert_dq_config(main, c.dtype)]
    main = target.config() if target.kernel in ("bwd_sm90_kernel", "bwd_sm90_ws_kernel") else \
        _config.backward_kernel_config(hd, c.dtype, c.causal, target.deterministic, ARCH, target.kernels)
    return [_config.forward_kernel_config(hd, c.dtype, c.causal, ARCH, target.kernels, seqlen_k=c.seqlen_k),
            _config.ElementwiseConfig("preprocess", c.dtype), main,
            _config.dq_config(hd, c.dtype, c.causal) if target.deterministic and not main_adds_dq(main)
            else _config.convert_dq_config(main, c.dtype)]


# ----------------------------------------------------------------------------------------------
# Running ncu
# ----------------------------------------------------------------------------------------------

# The profiled process: the forward twice (fwd_kernel, fwd_sm90_kernel, fwd_sm90_ws_kernel, fwd_wide_kernel), or the
# forward once (o, lse) and the backward twice (the backward kernels); ncu's
# --launch-skip 1 --launch-count 1 picks the second launch of the target kernel. The kernel family comes from
# CUFLASH_KERNELS, which _env sets per target; the driver stops if it did not arrive (ncu would otherwise profile
# nothing). Inputs are drawn in fp32 and rounded with cuflash._xpref.to_lowp (bf16 without relying on CuPy
# converting to ml_dtypes.bfloat16).
# FWD_SM90_DRIVER_NOTE: at every 16-bit head dim the library launches fwd_sm90_ws_kernel, the first forward family
# of config.FAMILIES; a fwd_sm90_kernel target takes that family out of the registry in its own process, so
# config.select returns the next one (the synchronous kernel, which the library no longer launches). Likewise
# a bwd_sm90_kernel target takes out bwd_sm90_ws, the backward the library launches at kernel head dims 32, 64, 96
# and 128. fwd_sm90_ws_kernel and bwd_sm90_ws_kernel targets run the registry as it is (for bwd_sm90_ws_kernel,
# Target checks that it picks the profiled config).
DRIVER = r"""
import sys
import cupy as cp, cuflash
from cuflash import _xpref, config
kernel, b, h, sq, sk, d, causal, dtype, deterministic, kernels = {args!r}
if config.KERNELS != kernels:
    sys.exit(f"cuflash-validate-driver: CUFLASH_KERNELS={{config.KERNELS}}, but {{kernel}} needs {{kernels}}")
if kernel in ("fwd_sm90_kernel", "bwd_sm90_kernel"):  # (FWD_SM90_DRIVER_NOTE)
    config.FAMILIES = tuple(f for f in config.FAMILIES if f.name not in ("fwd_sm90_ws", "bwd_sm90_ws"))
rs = cp.random.RandomState(0)
q, k, v = (_xpref.to_lowp(rs.standard_normal((b, s, h, d), dtype=cp.float32), dtype) for s in (sq, sk, sk))
if kernel in ("fwd_kernel", "fwd_sm90_kernel", "fwd_sm90_ws_kernel", "fwd_wide_kernel"):
    for _ in range(2):  # warm-up, then the profiled launch
        o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    res = o
else:
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    do = _xpref.to_lowp(rs.standard_normal((b, sq, h, d), dtype=cp.float32), dtype)
    for _ in range(2):  # warm-up, then the profiled launch
        dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=deterministic)
    res = dq
cp.cuda.runtime.deviceSynchronize()
print("cuflash-validate-driver: ok", kernel, float(cp.abs(_xpref.to_float32(res)).mean()), file=sys.stderr)
"""

# Compiles (or finds in the disk cache) every instantiation the targets launch, in parallel, so that the
# profiled processes do not compile under ncu.
PREWARM = r"""
import sys, time
from concurrent.futures import ThreadPoolExecutor
from cuflash import _compile
names = {names!r}
arch = _compile.device_arch()
t0 = time.perf_counter()
def build(n):
    t = time.perf_counter()
    _compile.compile_kernel(n, arch)
    return n, time.perf_counter() - t
with ThreadPoolExecutor(max_workers={jobs}) as pool:
    for n, s in pool.map(build, names):
        print(f"  {{s:6.1f}} s  {{n}}", flush=True)
print(f"compiled or loaded {{len(names)}} kernels for {{arch}} in {{time.perf_counter() - t0:.1f}} s", flush=True)
"""


def driver_code(target: Target | Case) -> str:
    if isinstance(target, Case):
        target = Target("fwd_kernel", target)
    c = target.case
    return DRIVER.format(args=(target.kernel, c.batch, c.heads, c.seqlen_q, c.seqlen_k, c.head_dim, c.causal,
                               c.dtype, target.deterministic, target.kernels))


def kernel_regex(kernel: str) -> str:
    """ncu's --kernel-name regex for `kernel` as a whole identifier: fwd_kernel must not select
    fwd_sm90_kernel (nor bwd_kernel bwd_dq_kernel), whether ncu matches the bare function name or a
    demangled one with namespace and template arguments (kernel_matches checks the profiled name)."""
    return rf"(^|[^A-Za-z0-9_]){re.escape(kernel)}([^A-Za-z0-9_]|$)"


def ncu_command(ncu: str, target: Target | Case, metrics: list[str], print_units: bool = True) -> list[str]:
    if isinstance(target, Case):
        target = Target("fwd_kernel", target)
    cmd = [ncu, "--target-processes", "all", "--cache-control", "all", "--clock-control", "none", "--csv",
           "--kernel-name", f"regex:{kernel_regex(target.kernel)}", "--launch-skip", "1", "--launch-count", "1",
           "--metrics", ",".join(metrics)]
    if print_units:
        cmd[1:1] = ["--print-units", "base"]
    return cmd + [sys.executable, "-c", driver_code(target)]


def _env(kernels: str | None = None) -> dict:
    """The environment of the processes run here: cuflash importable, and CUFLASH_KERNELS = kernels when
    given (the profiled driver's kernel family)."""
    env = dict(os.environ)
    if kernels is not None:
        env["CUFLASH_KERNELS"] = kernels
    root = str(Path(__file__).resolve().parents[1])  # the source tree (cuflash/ and simulator/ live here)
    import cuflash

    pkg_parent = str(Path(cuflash.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([pkg_parent, root] + env.get("PYTHONPATH", "").split(os.pathsep)))
    return env


def _run(cmd: list[str], timeout: int, kernels: str | None = None) -> tuple[int, str, str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(kernels))
        return r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out, f"timed out after {timeout} s"
    except OSError as e:
        return 127, "", f"cannot run {cmd[0]}: {e}"


def prewarm(targets: list[Target], timeout: int, log=print) -> tuple[bool, str]:
    """Compile every kernel the targets launch, outside ncu: one process per instantiation, as many at a
    time as there are CPUs (NVRTC in separate processes runs in parallel whatever the GIL does).
    (ok, message)."""
    from concurrent.futures import ThreadPoolExecutor

    names = list(dict.fromkeys(cfg.cpp_name() for t in targets for cfg in kernel_configs(t)))
    jobs = max(1, min(len(names), os.cpu_count() or 1))
    log(f"compiling {len(names)} kernel instantiations (NVRTC, disk cache), {jobs} at a time, before profiling ...")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda n: _run([sys.executable, "-c", PREWARM.format(names=[n], jobs=1)], timeout),
                                names))
    failed = []
    for name, (rc, out, err) in zip(names, results):
        for ln in out.strip().splitlines()[:1]:
            log(ln)
        if rc != 0:
            failed.append(f"{name}: rc={rc}, " + " / ".join((err.strip().splitlines() or ["no output"])[-2:])[:300])
    took = time.perf_counter() - t0
    if failed:
        return False, f"prewarm: {len(failed)} of {len(names)} kernels failed ({took:.0f} s): {failed[0]}"
    return True, f"{len(names)} kernels compiled or loaded in {took:.0f} s ({jobs} processes)"


class Profiler:
    """Runs ncu per target; finds out which metrics this ncu accepts (once per metric); keeps raw output."""

    def __init__(self, ncu: str, raw_dir: Path, timeout: int, log=print):
        self.ncu, self.raw_dir, self.timeout, self.log = ncu, raw_dir, timeout, log
        self.dropped: dict[str, str] = {}  # metric -> why (ncu rejected it)
        self.accepted: set[str] = set()
        self.print_units = True
        self.runs = 0
        self.seconds = 0.0
        raw_dir.mkdir(parents=True, exist_ok=True)

    def _profile(self, target: Target, metrics: list[str], tag: str) -> tuple[dict, str, str]:
        """(metrics of the profiled launch, short error, ncu's error lines)."""
        cmd = ncu_command(self.ncu, target, metrics, self.print_units)
        t0 = time.perf_counter()
        rc, out, err = _run(cmd, self.timeout, target.kernels)
        dt = time.perf_counter() - t0
        self.runs += 1
        self.seconds += dt
        stem = _stem(target, tag)
        (self.raw_dir / f"{stem}.stdout.txt").write_text(out)
        (self.raw_dir / f"{stem}.stderr.txt").write_text(
            f"$ CUFLASH_KERNELS={target.kernels} {shlex.join(cmd[:-1])} <driver>\nrc={rc} wall={dt:.1f}s\n{err}")
        # what went wrong, without the CSV (whose header says "Metric Name") and the driver's own lines
        errors = "\n".join(ln for ln in (out + "\n" + err).splitlines()
                           if not ln.startswith('"') and re.search(r"error|fail|unknown|invalid|not found|unrecogni",
                                                                   ln, re.I))
        ids = parse_ncu_csv(out)
        if not ids:
            msgs = [ln for ln in (out + "\n" + err).splitlines() if "==ERROR==" in ln or "==WARNING==" in ln]
            last = msgs or err.strip().splitlines() or out.strip().splitlines() or ["no output"]
            return {}, f"rc={rc}; " + " / ".join(last[-3:])[:400], errors
        first = sorted(ids, key=lambda x: int(x) if x.isdigit() else 0)[0]
        name = parse_ncu_kernel_names(out).get(first, "")
        if name and not kernel_matches(target.kernel, name):
            return {}, f"ncu profiled {name[:120]!r}, not {target.kernel}: check the --kernel-name filter", ""
        return ids[first], "", errors

    def _drop(self, metric: str, why: str):
        self.dropped[metric] = why
        self.log(f"  dropped {metric}: {why}")

    @staticmethod
    def _about_metrics(errors: str) -> bool:
        return re.search(r"metric", errors, re.I) is not None

    def measure(self, target: Target) -> tuple[dict, str]:
        metrics = [m for m in metrics_for(target) if m not in self.dropped]
        if not metrics:
            return {}, "no metric left to measure"
        measured, error, errors = self._profile(target, metrics, "all")
        if not measured and self.print_units and re.search(r"print-units", errors):
            self.print_units = False  # an older ncu without --print-units: units are converted from the CSV
            self.log("  note: ncu rejected --print-units base; units are converted from the CSV")
            measured, error, errors = self._profile(target, metrics, "all_nounits")
        # ncu names the metric it does not know: drop it and retry (one run per unknown metric)
        for attempt in range(len(metrics)):
            if measured or not self._about_metrics(errors):
                break
            named = rejected_metrics(errors, metrics)
            if not named or len(named) == len(metrics):
                break
            for m in named:
                self._drop(m, "ncu: " + next((ln.strip() for ln in errors.splitlines()
                                                if m.split(".")[0] in ln), "rejected")[:160])
                metrics.remove(m)
            measured, error, errors = self._profile(target, metrics, f"retry{attempt + 1}")
        if measured:
            self.accepted.update(m for m in metrics if m in measured)
            return measured, ""
        if not self._about_metrics(errors):
            return {}, error  # the driver or the filter failed, not a metric name: probing would not help
        # probe the metrics not known to be good one by one; keep the ones this ncu accepts
        self.log(f"  ncu failed with all metrics ({error}); probing them one by one")
        good = [m for m in metrics if m in self.accepted]
        failed = {}
        for m in [m for m in metrics if m not in self.accepted]:
            one, err, _ = self._profile(target, [m], "probe_" + m.split(".")[0])
            if m in one:
                good.append(m)
                self.accepted.add(m)
            else:
                failed[m] = err or "not reported"
        if not good:  # nothing works alone either: the run is broken, not the names; drop nothing
            return {}, error
        for m, why in failed.items():
            self._drop(m, why)
        merged, error, _ = self._profile(target, good, "good")
        return merged, "" if merged else error


# ----------------------------------------------------------------------------------------------
# Comparison and report
# ----------------------------------------------------------------------------------------------

@dataclass
class Row:
    kernel: str
    case: str
    metric: str
    what: str
    predicted: float | None
    measured: float | None
    target: object
    note: str
    ran: bool = False  # ncu measured this target (so a missing value was not reported, not pending)
    predicted_hi: float | None = None  # a band prediction's upper bound (predicted is the lower one)

    @property
    def is_band(self) -> bool:
        return self.predicted_hi is not None and self.predicted is not None and self.predicted_hi != self.predicted

    @property
    def error(self) -> float | None:
        """(measured - predicted) / predicted; for a band, from the nearer bound (0 inside it)."""
        if self.predicted is None or self.measured is None:
            return None
        ref = self.predicted
        if self.is_band:
            if self.predicted <= self.measured <= self.predicted_hi:
                return 0.0
            ref = self.predicted_hi if self.measured > self.predicted_hi else self.predicted
        if ref == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - ref) / ref

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "info"
        if self.measured is None:
            if self.predicted is None:
                return "-"
            return "not reported" if self.ran else "pending"
        if self.predicted is None:
            return "-"
        if self.target == "exact":
            return "yes" if round(self.measured) == round(self.predicted) else "NO"
        return "yes" if abs(self.error) <= self.target else "NO"


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:,.2f}"


def _fmt_pred(r: Row) -> str:
    return f"{_fmt(r.predicted)} .. {_fmt(r.predicted_hi)}" if r.is_band else _fmt(r.predicted)


def _fmt_err(r: Row) -> str:
    e = r.error
    if e is None:
        return "-"
    if r.is_band:
        pos = (r.measured - r.predicted) / (r.predicted_hi - r.predicted)
        return ("in band" if e == 0 else f"{100 * e:+.2f}% off band") + f" (at {pos:.2f})"
    if r.target == "exact":
        return f"{r.measured - r.predicted:+,.0f}"
    return "inf" if e == float("inf") else f"{100 * e:+.2f}%"


def _target(t, band: bool = False) -> str:
    if band:
        return f"band ±{100 * t:.0f}%"
    return {"exact": "exact", None: "-"}.get(t, f"±{100 * t:.0f}%" if isinstance(t, float) else str(t))


def markdown(rows: list[Row], header: dict, dropped: dict, failures: dict) -> str:
    lines = [
        "# IO validation: analyzer predictions against ncu counters",
        "",
        "Generated by `python -m cuflash.simulator.validate` (simulator/validate.py); do not edit the tables",
        "by hand, re-run the script (or `--from-raw` on the kept ncu output).",
        "",
        "**Where the numbers come from.** The *predicted* column is the analyzer (cuflash.simulator, no GPU:",
        "the same tile configs as the kernels, their shared-memory walks and global-access counts). The",
        "*measured* column comes from running the script on the H100 with Nsight Compute (`ncu`); the `device`",
        "and `ncu` lines below name the GPU and profiler of that run (`measurements: pending` means a dry run",
        "that has predictions only).",
        "",
        "What is compared, per (kernel, configuration): one profiled launch of the kernel after one warm-up",
        "launch (`--kernel-name regex:<kernel> --launch-skip 1 --launch-count 1`, the regex matching the name",
        "as a whole identifier), caches flushed by `--cache-control all`, clocks not locked",
        "(`--clock-control none`). Kernels: `fwd_kernel`; `bwd_kernel`, the backward's K/V-outer main kernel",
        "in the default mode (dQ accumulated by fp32 `red.global.add.v2.f32` into dq_accum), after a forward",
        "that provides o and lse; `bwd_dq_kernel`, the deterministic backward's Q-outer dQ kernel. These are",
        "the mma.sync kernels, run with `CUFLASH_KERNELS=mma`. On an H100 the library launches its wgmma",
        "kernels by default: for 16-bit inputs the warp-specialized TMA kernels `fwd_sm90_ws_kernel` and",
        "`bwd_sm90_ws_kernel` (the backward in its default mode: dQ added to dq_accum by bulk reductions), and",
        "at head dims 192 and 256 the wide-head backward `bwd_sm90_split_kernel` (TMA loads by one thread, dQ",
        "added from registers by `red.global.add.v4.f32`, default mode); the synchronous `fwd_sm90_kernel` and",
        "`bwd_sm90_kernel` are profiled with the warp-specialized family taken out of the registry. The five run",
        "with `CUFLASH_KERNELS=auto` and are compared on global traffic, spills, cp.async and st.shared (their",
        "tensor-core operand reads are no thread instructions: the l1tex shared-load wavefront and conflict rows",
        "are reported, not targeted, for them), the TMA kernels also on the TMA counters.",
        "`bwd_sm90_split_kernel`'s shared memory is counted in program order, not walked: its LDS / STS rows are",
        "reported, not predicted.",
        "",
        "* global traffic: `l1tex__m_xbar2l1tex_read_bytes` (L2 -> SM) is what the kernel's global loads",
        "  become; the L2 absorbs K/V re-reads, so `dram__bytes_read` is compared with the LRU L2 model",
        "  instead (for the backward kernels the model runs the one kernel from a cold L2).",
        "  Stores: `l1tex__m_l1tex2xbar_write_bytes` (SM -> L2; for the backward main kernels it also carries",
        "  the dQ reductions' payload) and `l1tex__t_bytes_pipe_lsu_mem_global_op_st` (stores only). Spills",
        "  would add local stores; expected 0.",
        "* TMA loads of `fwd_sm90_ws_kernel`, `bwd_sm90_ws_kernel` and `bwd_sm90_split_kernel` (one thread:",
        "  tensor-map boxes, and in the backward 1-D bulk copies of lse_log2 and delta): TMA read bytes and sectors",
        "  (`..._op_tma_ld`, `..._pipe_tma`) and the UTMALDG / UBLKCP instruction count.",
        "* dQ atomics of `bwd_kernel`, `bwd_sm90_kernel` (8 bytes a lane) and `bwd_sm90_split_kernel` (16 bytes",
        "  a lane: 512 contiguous bytes a warp instruction): a RED is not a load, it sends its data SM -> L2",
        "  where the L2 adds it, so it is compared with the reduction counters (`..._op_red`: requests, bytes",
        "  at L1, SM -> L2 bytes, L2 sectors), not with the L2 -> SM reads.",
        "* dQ bulk reductions of `bwd_sm90_ws_kernel`: one `cp.reduce.async.bulk .add.f32` of the whole",
        "  BLOCK_M x HEAD_DIM fp32 block per visited query block, carried out by the TMA unit: compared with",
        "  the TMA reduction counters (`..._op_tma_red` SM -> L2 bytes, the TMA pipe's writes, UBLKRED",
        "  instructions) and with zero LSU reductions.",
        "* shared memory: every instruction of the kernel walked by `banks.fwd_kernel_shared`,",
        "  `banks.bwd_kernel_shared` (`banks.bwd_sm90_ws_kernel_shared` for the warp-specialized backward) or",
        "  `banks.dq_kernel_shared` with the hardware bank rule (docs/IO_ANALYSIS.md section 6). The shared",
        "  load *wavefront* and conflict counters (`l1tex__..._op_ld`) count LDS and",
        "  LDSM together; the shared load *instruction* counter (`smsp__inst_executed_op_shared_ld`) counts",
        "  LDS only, including the predicated-off LDS that ptxas puts before cp.async (see section 1 of",
        "  \"What the misses mean\"); LDSM has its own counters. cp.async (LDGSTS) wavefronts follow an",
        "  undocumented rule: the analyzer predicts a band [lower, upper] (banks.count_cp_async; one value",
        "  where every phase reads one global line) and the target is that band widened by 10%; the cp.async",
        "  conflict counter always reads 0, so only wavefronts are compared.",
        "* error = (measured - predicted) / predicted, or measured - predicted for exact counts; for a band,",
        "  from the nearer bound, with the position in the band (0 = lower, 1 = upper bound).",
        "",
    ]
    lines += _run_lines(rows, header, dropped, failures)
    if any(r.measured is not None for r in rows):
        lines += ["", MISSES_EXPLAINED.strip()]
    return "\n".join(lines) + "\n"


def markdown_section(rows: list[Row], header: dict, dropped: dict, failures: dict, title: str) -> str:
    """One run as a `## title` section: its header lines, table, tally and missed targets, without the
    document's introduction and MISSES_EXPLAINED (`--section`: the targets of some kernels measured on their
    own, added to a document that a full run wrote, before its "What the misses mean")."""
    lead = ["Targets of some kernels measured on their own (`--kernels`), written as a section (`--section`): the",
            "introduction describes the metrics and targets, \"What the misses mean\" the misses."]
    return "\n".join([f"## {title}", ""] + lead + [""] + _run_lines(rows, header, dropped, failures)) + "\n"


def _run_lines(rows: list[Row], header: dict, dropped: dict, failures: dict) -> list[str]:
    """The header lines, the table, the tally and the missed targets of one run."""
    lines = [f"- {k}: {v}" for k, v in header.items()]
    lines.append("")
    if dropped:
        lines.append("Metrics this ncu did not accept (dropped): " + ", ".join(f"`{m}` ({e})" for m, e in dropped.items()))
        lines.append("")
    if failures:
        lines.append("Targets without measurements:")
        lines += [f"- {c}: {e}" for c, e in failures.items()]
        lines.append("")
    lines += ["| kernel | config | metric | predicted | measured | error | target | met | note |",
              "|---|---|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.kernel} | {r.case} | {r.what}<br>`{r.metric}` | {_fmt_pred(r)} | {_fmt(r.measured)} | "
                     f"{_fmt_err(r)} | {_target(r.target, r.is_band)} | {r.verdict} | {r.note} |")
    met = [r for r in rows if r.verdict in ("yes", "NO")]
    missed = [r for r in met if r.verdict == "NO"]
    lines += ["", f"Targets met: {len(met) - len(missed)} of {len(met)} compared rows."]
    by_kernel = {}
    for r in met:
        k = by_kernel.setdefault(r.kernel, [0, 0])
        k[0] += r.verdict == "yes"
        k[1] += 1
    if by_kernel:
        lines.append("By kernel: " + "; ".join(f"{k} {a} of {n}" for k, (a, n) in by_kernel.items()) + ".")
    unmeasured = [r for r in rows if r.verdict == "not reported"]
    if unmeasured:
        lines.append(f"{len(unmeasured)} rows have no measurement (\"not reported\": metrics that this ncu dropped or "
                     "that were added to the list after the run) and are not counted.")
    bands = [r for r in met if r.is_band]
    if bands:
        lines.append(f"Of the met rows, {sum(r.verdict == 'yes' for r in bands)} are cp.async wavefronts met against "
                     "a band, not a point (64-byte panels; section 3 below).")
    if missed:
        lines += ["", "Missed targets, each with the section below that explains it:"]
        lines += [f"- {r.kernel} | {r.case}: {r.what}: predicted {_fmt_pred(r)}, measured {_fmt(r.measured)} "
                  f"({_fmt_err(r)}): {miss_reason(r)}" for r in missed]
    return lines


def miss_reason(r: Row) -> str:
    """Why a measured row misses its target, by metric (the sections of MISSES_EXPLAINED)."""
    m = r.metric
    if m == "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum":
        return ("the profiled binary spilled (NVRTC 13.0 build of the pre-43d4992 bwd.cuh); the current kernel "
                "does not (section 4)")
    if m.startswith("l1tex__data_") and "mem_shared" in m:
        return "hardware l1tex counter: conflicts with other shared-memory traffic on the SM (section 2)"
    if m == "smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum":
        return "cp.async outside the modelled band (section 3)"
    if m == "smsp__inst_executed_op_shared_ld.sum":
        return "shared load instructions off the LDS + predicated-off LDS model (section 1)"
    if r.kernel == "bwd_sm90_split_kernel" and m in TMA_READ_ROWS:
        return "the 32-column boxes past the sequence's end are read whole (section 8)"
    if r.kernel in WIDE_KERNELS:
        if m == "l1tex__m_xbar2l1tex_read_bytes.sum":
            return "cp.async into shared rows 16 bytes off a 32-byte sector reads part of a sector again (section 9)"
        if m in ("l1tex__m_l1tex2xbar_write_bytes.sum", "l1tex__t_bytes_pipe_lsu_mem_global_op_st.sum"):
            return "more store instructions than the epilogue issues by the source, open (section 9)"
        if m == "sm__sass_data_bytes_mem_shared_op_ld.sum":
            return "fewer shared load bytes than the program-order count, open (section 9)"
    return "not explained yet"


# the global-read rows of the TMA kernels (in-bounds rows predicted)
TMA_READ_ROWS = ("l1tex__m_xbar2l1tex_read_bytes.sum", "l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum",
                 "l1tex__m_xbar2l1tex_read_sectors_pipe_tma.sum")


# The analysis of the misses of the H100 runs of 2026-11-22 (NVIDIA H100 80GB HBM3, driver 580.159.04,
# ncu 2025.3.1). Numbers quoted here come from out/ncu_raw of the last run (15:59); re-check them after a
# new run. Section 7 and the bwd_sm90_ws_kernel part of section 6 quote the rows of its own run (NVIDIA H200,
# driver 580.159.04, ncu 2025.3.1, 2026-11-30; the section "bwd_sm90_ws_kernel (H200, 2026-11-30)").
MISSES_EXPLAINED = r"""
## What the misses mean

Analysis of the H100 runs of 2026-11-22 (ncu 2025.3.1, raw output in `out/ncu_raw`), with the analyzer
of this commit; figures from the last run (15:59). Sections 1 and 3 were modelling errors and are fixed
in the analyzer; 2, 5 and 6 are properties of the measurement, reported as measured; 4 was a kernel
defect, fixed. Section 7 reads the rows of the warp-specialized backward's own run (H200, 2026-11-30),
sections 8 and 9 those of the wide-head backward's and of the float32 / float64 kernels' (H100, 2026-12-07).

### 1. Shared load instructions: ldmatrix is not counted, ptxas's predicated-off LDS are (fixed)

`smsp__inst_executed_op_shared_ld` counts LDS instructions only; ldmatrix (LDSM) has its own rows,
which match exactly (instructions, wavefronts, conflicts). The analyzer used to predict LDS + LDSM and
missed all 13 mma.sync rows. LDS alone would still have missed them: fwd d64 measures 212,992 where
the kernel issues 16,384 LDS.128 (the O epilogue). The rest are instructions that never touch memory.
In the SASS of every measured instantiation (NVRTC 13.0, the CUDA version of the H100 image; NVRTC
13.5 gives the same counts) ptxas puts three `@!PT LDS RZ, [RZ]` (predicate "not true": never executed
by any thread) at the head of every basic block that issues LDGSTS, and four before a
`fence.proxy.async` (the wgmma kernels). A warp that runs the block issues them, so ncu counts them as
executed shared-load instructions; they make no wavefront (the load wavefront rows match without
them). Public SASS notes describe the same fillers ("3 before each LDGSTS group"); NVIDIA does not
document them.

Rule (banks.guard_lds_per_warp): 3 per LDGSTS basic block a warp runs. A straight-line tile copy
(fixed column, or a panel-order copy of at most 4 chunks per thread, both fully unrolled) shares one
block with the copies next to it: fwd_kernel's prologue (Q, K, V) is one block, each later step's K, V
copy another, so 3 x n_blocks per warp. A longer panel-order copy (`for (idx = tid; idx < CHUNKS; idx
+= THREADS)`, trip count T > 4: d256 Q, T = 16) stays a loop that ptxas unrolls by 4 with the
remainder first: T % 4 + T // 4 blocks. bwd_kernel's lse/delta copy is under `if (tid < 2 * BLOCK_M /
4)`: a block of its own, run only by warp 0. Predicted = LDS + guards, and all 13 mma.sync rows and
all 5 wgmma rows are exact, e.g. fwd d64 16,384 + 3 x 32 steps x 4 warps x 512 CTAs = 212,992;
bwd_kernel d64 N2048 1,064,960 + 448,512 = 1,513,472; bwd_kernel d96 268,288 + 58,368 = 326,656 (an
earlier run, with the d96 copies still rolled loops of T = 3, measured 587,776: 3 blocks per copy
instead of one, which the analyzer then predicted exactly too).

### 2. Small bank conflicts on plain LDS / STS where the per-instruction rule gives 0 (measured, kept)

| kernel, config | CTAs per SM | grid | load conflicts | store conflicts |
|---|---|---:|---:|---:|
| fwd d64 (128,64,4) b2 h16 N2048 | 2 | 512 | 0 (2,121 in the first run) | 0 (8,405 in the first run) |
| fwd d128 (128,32,4) b2 h8 N2048 | 2 | 256 | 944 (20 in the first run) | 0 |
| fwd d256 (64,32,4) b2 h8 N1024 | 2 (96 KiB) | 256 | 23,391 (22,994) | 0 |
| fwd d128 causal, d96 causal, d64 causal 1536x512, d32 | 1-3 | 96-256 | 0 | 0 |
| bwd_kernel d64 (32,128,8,1) b2 h8 N2048 | 1 | 256 | 0 | 448 (1,174) |
| bwd_kernel d64 bf16 1000x1500, d128 causal (both), d96 | 1 | 64-128 | 0 | 0 (66 and 2 in the first run) |
| bwd_dq_kernel d128 causal | 1 | 96 | 0 | 0 |
| fwd_sm90 d64 (128,64,2) b2 h16 N2048 | 2 | 256 | 0 | 795 |

Counters: `l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum` / `_op_st.sum` and the wavefront
rows `l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld` / `_op_st` (in the mma.sync kernels the excess
wavefronts equal the conflicts exactly). These are hardware counters of the L1TEX data stage. The
SASS-attributed ldmatrix counters (`smsp__sass_..._op_ldsm`), which ncu computes per instruction by
SASS patching, read exactly our prediction everywhere (0 conflicts), so the extra load wavefronts are
not ldmatrix's own conflicts.

What the data show: conflicts appear only in configs that run two CTAs per SM (forward) or whose warps
store dS^T with STS while the next block's cp.async fills land (bwd_kernel with D_SPLIT = 1), and their
sizes change from run to run with the same kernels and inputs (fwd d64: 2,121 then 0; bwd d64: 1,174
then 448), as arbitration between concurrent accesses would. The forward's own STS (the O epilogue)
and LDS.128 come after its last cp.async has landed, so inside one CTA nothing else touches shared
memory then; with a second CTA on the SM, that CTA's LDGSTS fills and ldmatrix reads use the same banks
in the same cycles.

Most likely cause: the l1tex counters count a data-stage wavefront split by a collision with any
concurrent shared-memory access (another CTA's, or the CTA's own cp.async fills), while the
per-instruction rule can only see the addresses of one instruction. Public reports of conflict counts
that the accessed addresses do not explain: NVIDIA/Fuser#2263 and the NVIDIA forum thread it cites (ncu
detects bank conflicts in matrix transposition after padding), NVIDIA/cutlass#2212 (switching
cp.async.ca to .cg changes the shared-store conflict count with the same shared addresses), and the
forum thread "Matrix Transposition: Why are the number of Shared Store/Load Transactions different".
No NVIDIA statement on what the l1tex counter includes was found. The SASS-level LDS/STS conflict
counters (`smsp__sass_l1tex_data_bank_conflicts_pipe_lsu_mem_shared_op_ld` / `_op_st`) are in the
metric list but this ncu does not report them for these kernels ("not reported"). A direct check is to
profile fwd d256 at one CTA per SM and see the conflicts vanish. These rows keep their exact targets
and stay missed.

### 3. cp.async wavefronts with 64-byte panels: the model is a band (fixed)

The first model (per 8 lanes: max(bank rule, 128-byte shared lines)) is exact for every 128-byte-panel
tile (d64, d128, d256: one global line per phase). With 64-byte panels (d32, d96) the 8 lanes of a
phase copy two 64-byte segments of two different 128-byte global lines (rows r and r + 1) into one
128-byte shared line, conflict-free:

| target | lower bound | upper bound | first run | last run | per phase (last) |
|---|---:|---:|---:|---:|---:|
| fwd_kernel d32 b4 h8 N512 | 73,728 | 147,456 | 118,784 | 118,784 | 1.61 |
| fwd_kernel d96 causal 1000x1500 | 442,368 | 884,736 | 870,720 | 862,976 | 1.95 |
| bwd_kernel d96 b2 h4 N1024 | 425,984 | 843,776 | 425,984 | 843,776 | 1.98 |
| fwd_sm90_kernel d96 causal 1000x1500 | 442,368 | 884,736 | - | 882,816 | 2.00 |

The phases have the same geometry (two global lines, one shared line, no bank conflict) and cost
between 1.00 and 2.00 wavefronts, so no rule on a phase's addresses fits them all; bwd d96 went from
1.00 to 1.98 per phase when its copies changed from a rolled loop to straight-line code (same
addresses, different issue order). The cost lies between one wavefront per shared line (the data of
both segments written together) and one per global line (each 64-byte segment written as it arrives).
Rule in the analyzer (banks.count_cp_async): a phase costs at least max(bank rule, shared lines) and at
most max(that, distinct 128-byte global lines). The target for these rows is the band widened by 10%;
where the band is a point (all 128-byte-panel tiles) it is the old ±10% and the measurements equal it
exactly. What picks the point inside the band is open; it depends on issue order and timing (when the
two L2 returns arrive). For the kernels: 64-byte panels cost up to twice the cp.async wavefronts of
128-byte ones.

### 4. Local-memory stores in bwd_kernel d128 (fixed in the kernel)

The first run measured 262,144 and 131,072 local-store bytes in bwd_kernel d128 (32,128,8,1): one
8-byte spill per thread, from a build of bwd.cuh that spilled under NVRTC 13.0 (not 13.5). Commit
43d4992 left the dP^T k-loop rolled (253 registers, no spill under either compiler), `python -m cuflash
compile --all` now fails on any spill, and every kernel of the last run measures 0 local bytes.

### 5. DRAM write bytes are reported, not targeted

`dram__bytes_write` counts only what the L2 writes back while the kernel runs. The outputs (O and lse,
dK and dV, dQ) fit in the 50 MiB L2 and are still there when the kernel ends, so the measurement is far
below the model, which includes the final write-back. The rows are "info".

### 6. The wgmma kernels' shared store wavefronts exceed their STS (measured, open)

| target | STS instructions (exact) | store wavefronts | excess | store conflicts |
|---|---:|---:|---:|---:|
| fwd_sm90 d64 b2 h16 N2048 (2 CTAs per SM) | 65,536 | 69,689 | 4,153 | 795 |
| fwd_sm90 d128 causal, d96 causal | 65,536; 24,576 | = STS | 0 | 0 |
| bwd_sm90 d64 b2 h8 N2048 | 1,114,112 | 1,264,960 | 150,848 | 0 |
| bwd_sm90 d128 bf16 causal N2048 | 344,064 | 478,431 | 134,367 | 0 |
| bwd_sm90 deterministic d128 1000x1500 | 49,152 | = STS | 0 | 0 |

The instruction counts are exact, and the walk of their addresses gives one wavefront each. The excess
appears where STS run while wgmma reads its operands from shared memory: the atomic-dQ backward stores
dS^T in the middle of every visit while the wgmma it has just issued (dV += P^T dO, dK += dS^T Q, B
operands dO and Q in shared memory) are still running; the deterministic backward, whose only STS are
the final dK, dV epilogue, and the forward at one CTA per SM, show none. Unlike section 2, the excess is not counted as conflicts.
Most likely cause: a store wavefront split or replayed by a collision with the async proxy's operand
reads in the same data stage (the wgmma reads do not appear as thread instructions, and their
wavefronts are not in `..._op_ld` either: see the "info" rows). Not confirmed; a microbenchmark (one
warpgroup storing while another runs wgmma on other shared tiles, with and without overlap) would
settle it. These rows keep their exact targets and stay missed.

fwd_sm90_ws_kernel (measured 2026-11-24): its only STS are the O staging of the epilogue, one consumer
warpgroup at a time, and they read 25 to 283 more store wavefronts than instructions in two runs (0.04-0.4%),
counted as conflicts; the staging addresses give one wavefront each. A consumer stages O while the other
consumer's last wgmma still reads K, V from shared memory and the producer's TMA writes of the CTA are
done, so the collision candidates are the async proxy's operand reads again. Kept exact, missed.

bwd_sm90_ws_kernel (H200, 2026-11-30, one run; its 8 misses, which the tally files under section 2): per
visit the 8 consumer warps store dS^T (st.shared.b32) and the dQ block (16-byte stores), and the epilogue
stages dK, dV. The STS counts are exact and the walk of their addresses gives no conflict; the store
wavefronts exceed the walk by 8-15%, and most of the excess is not counted as conflicts:

| target | STS instructions (exact) | store wavefronts: walk | measured | excess | store conflicts |
|---|---:|---:|---:|---:|---:|
| d64 b2 h8 N2048 | 1,376,256 | 2,162,688 | 2,390,194 | 227,506 (+10.5%) | 34,429 |
| d128 bf16 causal b1 h8 N2048 | 483,328 | 901,120 | 1,033,685 | 132,565 (+14.7%) | 1,925 |
| d64 bf16 causal b2 h4 N1024 | 108,544 | 163,840 | 177,292 | 13,452 (+8.2%) | 176 |
| d128 b2 h4 N1024 | 229,376 | 425,984 | 491,718 | 65,734 (+15.4%) | 8,993 |

The kernel runs one CTA per SM (about 195 KiB of shared memory), so no second CTA shares the banks; while
one consumer stores, wgmma of the CTA (its own, or the other consumer's) can be reading operands from shared
memory and the producer's TMA can be filling the next stage, both through the async proxy: the candidates
of bwd_sm90_kernel above, plus the TMA writes; not confirmed. One run on one GPU: how much the
excess varies from run to run is not known. Kept exact, missed.

### 7. The warp-specialized backward's TMA and bulk-reduction rows (H200, 2026-11-30)

The `bwd_sm90_ws_kernel` targets were measured once, on their own, on an H200 (the H100's GH100 chip with
more memory: 132 SMs and a 50 MB L2, as the L2 model assumes): the section "bwd_sm90_ws_kernel (H200,
2026-11-30)" above, 76 of 84 targets met. What its rows show, in all four targets:

* Exact (+0.00%, +0): the L2->SM read bytes, all of them TMA (`..._op_tma_ld` bytes equal the total; the TMA
  pipe's sectors too); the UTMALDG + UBLKCP count; the dQ bulk reductions' SM->L2 bytes (`..._op_tma_red`,
  equal to the TMA pipe's writes) and the UBLKRED count, one per visit; no LSU reduction; the dK, dV stores;
  and the SM->L2 write total, which is dK, dV plus the bulk-reduction payload, so that total includes the
  TMA unit's writes.
* `l1tex__m_l1tex2xbar_write_bytes_mem_global_op_red` reads 0: that op_red counter does not include the
  TMA unit's reductions (they are under `op_tma_red`).
* `lts__t_sectors_op_red` reads exactly 1.5 times the payload's 32-byte sectors in all four (6,291,456 for
  4,194,304; 3,342,336 for 2,228,224; 442,368 for 294,912; 1,572,864 for 1,048,576). The red.global
  kernels read the same +50.00% on the H100 in every target (bwd_kernel, bwd_sm90_kernel, whose
  `lts__t_sectors_srcunit_tex_op_red` equals the payload), with the same values for the two shapes that
  bwd_sm90_kernel shares with these targets. So the extra half is not particular to bulk reductions; what
  it counts is not known. Every bulk reduction here is 32 KiB (128 x 64 or 64 x 128 fp32), so these rows
  cannot tell a rule per sector from one per reduction. An observation, reported ("info").
* `l1tex__tmain_requests` exceeds the UTMALDG, UBLKCP and UBLKRED count by 24.4% (d64 N2048), 17.1%
  (d128 causal), 34.7% (d64 causal N1024) and 17.2% (d128 N1024); in all four the excess is 4 per CTA plus
  1 per visit (5,120 = 4 x 256 + 4,096; 2,688 = 4 x 128 + 2,176; 544 = 4 x 64 + 288; 1,280 = 4 x 64 +
  1,024). The producer issues four prefetch.tensormap per CTA (Q, dO, K, V), and fwd_sm90_ws_kernel's excess
  on the H100 is 3 per CTA, its three prefetches; which instruction makes the one per visit (the reduction
  counted twice, or its bulk-group commit) the rows do not say. Reported ("info").
* DRAM reads: +0.13% to +0.54% of the L2 model (this kernel alone, from a cold L2); DRAM writes far below
  the model (section 5).
* wgmma (info): the HGMMA count, the shared operand bytes and wavefronts equal the walk exactly, with no
  conflicts (128-byte swizzle).
* Thread shared accesses: LDS and STS counts exact, no ldmatrix and no LDGSTS; the store wavefronts and
  conflicts are the misses (section 6). The l1tex load wavefronts (info) exceed the LDS walk by 88-264%, as
  bwd_sm90_kernel's did on the H100 (+92%, +174%); the excess is no fixed multiple of the wgmma wavefronts
  or of the dQ buffer's bytes that the bulk reductions read (/ 128). Unexplained.
* `lts__t_sectors_srcunit_tex_op_read` (info) is neither the TMA sectors nor 0 (-44%, +5%, -10% and -39%
  of them), as fwd_sm90_ws_kernel's on the H100 (-51% to +3%): no rule found.

### 8. The wide-head backward's rows (H100, 2026-12-07)

`bwd_sm90_split_kernel` (head dims 192 and 256) measured on its own, three default targets (the section
"bwd_sm90_split_kernel (H100, 2026-12-07)"): 45 of 48 met. Exact: the TMA box and bulk-copy count, the dQ
reductions (RED.v4 requests, bytes at L1, SM -> L2 bytes, L2 sectors from the SMs: 16 per warp instruction),
the dK / dV stores, the SM -> L2 writes (stores + reduction payload), no spill, no ldmatrix, no cp.async, grid and
block; the global reads exact where every box lies in bounds; DRAM reads +0.2% to +3.0% of the L2 model. Info rows:
the HGMMA count and the wgmma operand bytes and wavefronts equal the program-order count exactly, with no
conflicts; `l1tex__tmain_requests` exceeds the boxes and copies by 2 per CTA (the kernel's two
prefetch.tensormap, UTMACCTL.PF in its SASS); `lts__t_sectors_op_red` is 1.5x the reduction sectors from the SMs
in all three (so the all-source L2 row counts part of these 16-byte reductions twice, where bwd_kernel's 8-byte
ones matched); DRAM writes far below the model (section 5).

The 3 misses are the TMA read rows of the target with tails (b2 h4 N1000x1500 d192 bf16): +2.38%, 3,760,128 bytes
over the in-bounds prediction. That is exactly the out-of-bounds rows of the partial boxes read whole: the last
query block's 24 rows past row 1000, in Q and dO, at every one of its 192 visits (2 x 24 x 384 B x 192 =
3,538,944), and the last key block's 36 rows past key 1500, in K and V, in each of its 8 CTAs (2 x 36 x 384 x 8 =
221,184). So on this kernel's 32-column (64-byte swizzled) boxes the TMA unit reads a box's rows past the
tensor's end (and fills shared memory with zeros); the warp-specialized forward's tail target, 64-column boxes,
read in-bounds rows only. Measured, kept: the prediction counts in-bounds rows.
### 9. The float32 / float64 kernels' rows (H100, 2026-12-07)

`fwd_wide_kernel` and `bwd_wide_kernel` measured on their own, the eight targets of `--cases full` (the section
"fwd_wide_kernel and bwd_wide_kernel"). Exact: the cp.async instruction count, the dQ reductions' requests and
L2 sectors (float64: two sectors a row), the spill rows, no ldmatrix, grid and block; the shared load and store
bytes within 2 % but in four backward targets (below); the global reads of the float64 targets.

Two rows are predicted as ncu counts them since that run: a float64 `RED.E.ADD.F64` carries 16 bytes a lane on
the L1 and SM -> L2 byte counters (2x the 8 bytes it adds; requests and L2 sectors as predicted), and the cp.async
shared bytes (`sm__sass_data_bytes_mem_shared_op_ldgsts`) are reported, not targeted: in the validation runs they
read 0.28-0.51 of the bytes the copies write (143-256 bytes per 512-byte warp instruction), and the same counter in
a run with fewer metrics read exactly the copies' bytes for three of four forward shapes.

Global reads of float32 (+49 % to +50 %, open, understood in part). Every float32 target reads 1.5x the
predicted bytes from L2, the float64 ones exactly. A diagnostic run of the forward (`ncu --metrics` on
`l1tex__m_xbar2l1tex_read_sectors`, `lts__t_sectors_srcunit_tex_op_read`, `lts__t_requests_srcunit_tex_op_read`)
counts 24 sectors per cp.async warp instruction where its 32 chunks of 16 bytes fill 16, at head dims 64 and 128
alike; 16-bit `fwd_kernel` at head dim 128 (256-byte rows, as float32 at 64) reads 16. What differs is the shared
row: float32's 4-float pad starts row r at 16 r bytes past a 32-byte sector, float64's 4-double pad at 32 r. A
float64 variant with a 2-double pad on V (rows 16 bytes off, docs/PERFORMANCE.md "What did not pay") read 1.24x
in the same way, its causal target +23.64 % where the shipped kernel's is exact. So cp.async re-reads part of a
sector whose 16-byte chunks land on two 128-byte shared lines; the exact count per instruction is not modelled.

The float64 forward's target (b1 h8 N1000x1500 d128 causal) of that run measured the 2-double V pad variant and
is left out of the section (`--only`); on the shipped kernel, in a default-set run of the same evening (same
H100, ncu 2025.3.1), its global reads were exact (150,208,512 bytes), its shared load bytes exact, its stores
+5.7 % / +6.2 % (as the other forwards'), and its 5,770,496 LDS made 15,542,881 wavefronts with 4,442,721 bank
conflicts: P V's 2-way reads of V (cuda/wide.cuh's comment).

Global stores (+2 % to +12.5 %, open). The O / dK / dV and lse stores are predicted once each; ncu counts more
STG instructions than the epilogues issue by the source (the float32 head-dim-64 forward: 20,480 where the O
stores, 8 bytes a lane, and the lse stores make 18,432, each extra one writing 8 sectors). Not explained yet.

Shared load bytes of four backward targets (-2.4 % to -3.0 %, open). The causal float32 targets at head dims 64
and 128 read 3.0 % fewer shared bytes than the program-order count, the float32 head-dim-256 one and the causal
float64 head-dim-64 one 2.4 % fewer, the float64 head-dim-128 one 1.6 % fewer (within the target). Not explained
yet.
"""


def _print_table(rows: list[Row]) -> None:
    head = ("metric", "predicted", "measured", "error", "target", "met")
    data = [(r.what, _fmt_pred(r), _fmt(r.measured), _fmt_err(r), _target(r.target, r.is_band), r.verdict)
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *data)] if data else [len(h) for h in head]
    for row in [head, tuple("-" * w for w in widths)] + data:
        print("  " + "  ".join(x.ljust(w) for x, w in zip(row, widths)))


def _stem(target: Target | Case, tag: str) -> str:
    """Raw-output file stem: '<kernel>_<config>__<tag>' (the double underscore keeps one config's files
    apart from a config whose name extends it, e.g. '... fp16' and '... fp16 causal')."""
    if isinstance(target, Case):
        target = Target("fwd_kernel", target)
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{target.label} {target.case.name}").strip("_")
    return f"{base}__{tag}"


def read_raw(raw_dir: Path, target: Target | Case) -> dict:
    """Measurements of one target from kept ncu output (the full run, else retries and probes)."""
    merged = {}
    for f in sorted(raw_dir.glob(_stem(target, "") + "*.stdout.txt")):
        ids = parse_ncu_csv(f.read_text())
        if ids:
            merged.update(ids[sorted(ids, key=lambda x: int(x) if x.isdigit() else 0)[0]])
    return merged


def build_rows(target: Target | Case, predicted: dict, measured: dict, ran: bool = False) -> list[Row]:
    if isinstance(target, Case):
        target = Target("fwd_kernel", target)
    return [Row(target.label, target.case.name, m, what, predicted[m][0], measured.get(m), tol, predicted[m][1], ran,
                getattr(predicted[m][0], "hi", None))
            for m, (what, tol) in metrics_for(target).items()]


def _device_header(ncu: str) -> dict:
    out = {}
    rc, text, _ = _run([ncu, "--version"], 60)
    if rc == 0:
        out["ncu"] = text.strip().splitlines()[-1] if text.strip() else "?"
    if shutil.which("nvidia-smi"):
        rc, text, _ = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], 60)
        if rc == 0 and text.strip():
            out["device"] = text.strip().splitlines()[0]
    return out


def select_targets(set_name: str, only: list[int] | None, kernels: list[str] | None) -> list[Target]:
    targets = CASES[set_name]
    if only:
        bad = [i for i in only if not 0 <= i < len(targets)]
        if bad:
            raise ValueError(f"--only {bad}: indices must be in 0..{len(targets) - 1} (see --list)")
        targets = [targets[i] for i in only]
    if kernels:
        targets = [t for t in targets if t.kernel in kernels]
    return targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuflash.simulator.validate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=False, help="markdown file to write (e.g. docs/IO_VALIDATION.md)")
    ap.add_argument("--cases", choices=tuple(CASES), default="default",
                    help="target set (default: default, forward and backward, a few minutes of ncu on an H100)")
    ap.add_argument("--only", type=int, nargs="+", default=None, metavar="I", help="run only these target indices")
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=None, help="run only targets of these kernels")
    ap.add_argument("--list", action="store_true", help="list the targets of --cases with their indices and exit")
    ap.add_argument("--ncu", default=os.environ.get("NCU", "ncu"), help="ncu executable (default: ncu or $NCU)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per ncu run (default 300)")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help="start no new target after S seconds (prewarm included); the rest is listed as skipped")
    ap.add_argument("--no-prewarm", action="store_true", help="do not compile the kernels before profiling")
    ap.add_argument("--prewarm-timeout", type=int, default=900, help="seconds per kernel compile (default 900)")
    ap.add_argument("--l2-bytes", type=int, default=H100_L2_BYTES)
    ap.add_argument("--num-sms", type=int, default=H100_SMS)
    ap.add_argument("--raw-dir", default="out/ncu_raw", help="where raw ncu output and rows.json go (default: out/ncu_raw)")
    ap.add_argument("--from-raw", default=None, metavar="DIR", help="rebuild the table from kept ncu output")
    ap.add_argument("--dry-run", action="store_true", help="print predictions and ncu commands only")
    ap.add_argument("--section", default=None, metavar="TITLE",
                    help="write only a '## TITLE' section (header lines, table, tally, missed targets), e.g. of "
                         "--kernels K --from-raw DIR, for a document written by a full run")
    args = ap.parse_args(argv)

    try:
        targets = select_targets(args.cases, args.only, args.kernels)
    except ValueError as e:
        ap.error(str(e))
    if args.list:
        for i, t in enumerate(CASES[args.cases]):
            print(f"{i:3d}  {t.name}")
        return 0
    if not args.out:
        ap.error("--out is required (e.g. --out docs/IO_VALIDATION.md)")
    if not targets:
        ap.error("no target selected")
    out = Path(args.out)
    raw_dir = Path(args.raw_dir)
    kept_dropped: dict = {}
    header = {"date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
              "command": " ".join(["python -m cuflash.simulator.validate",
                                   shlex.join(argv if argv is not None else sys.argv[1:])]),
              "L2 model": f"{args.l2_bytes / 2**20:.0f} MiB, {args.num_sms} SMs"}
    if args.dry_run:
        header["measurements"] = "pending: predictions only (--dry-run); the measured columns are filled by running " \
                                 "the script on the H100"
    elif args.from_raw:
        kept = Path(args.from_raw) / "run.json"  # the device, ncu and timing lines of the run that measured
        if kept.is_file():
            try:
                run = json.loads(kept.read_text())
                header.update({f"run {k}" if k in ("date", "command") else k: v for k, v in run["header"].items()
                               if k != "measurements"})
                kept_dropped = dict(run.get("dropped", {}))
            except (ValueError, KeyError, TypeError):
                pass
        header["measurements"] = f"rebuilt from the kept ncu output in {args.from_raw}" + \
            ("" if "device" in header else " (the H100 run)")
    if not (args.dry_run or args.from_raw):
        if shutil.which(args.ncu) is None:
            print(f"error: ncu not found ({args.ncu!r}); set --ncu or $NCU", file=sys.stderr)
            return 2
        header.update(_device_header(args.ncu))
        header["measurements"] = "ncu on the device above"
    profiler = None if (args.dry_run or args.from_raw) else Profiler(args.ncu, raw_dir, args.timeout)
    t_start = time.perf_counter()
    if profiler is not None and not args.no_prewarm:
        ok, msg = prewarm(targets, args.prewarm_timeout)
        print(("" if ok else "warning: ") + msg + ("" if ok else "; the drivers compile on first use instead"),
              flush=True)
        header["prewarm"] = msg

    rows, failures = [], {}
    if not args.dry_run:
        raw_dir.mkdir(parents=True, exist_ok=True)
    for i, target in enumerate(targets):
        print(f"[{i + 1}/{len(targets)}] {target.name}", flush=True)
        predicted = predict(target, args.l2_bytes, args.num_sms)
        measured, ran = {}, False
        if profiler is not None and args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            failures[target.name] = f"skipped: --budget-s {args.budget_s:g} reached"
            print("  " + failures[target.name], flush=True)
        elif args.dry_run:
            print(f"  CUFLASH_KERNELS={target.kernels} "
                  + shlex.join(ncu_command(args.ncu, target, list(metrics_for(target)))[:-1]) + " '<driver>'")
        elif args.from_raw:
            measured = read_raw(Path(args.from_raw), target)
            ran = bool(measured)
            if not measured:
                failures[target.name] = f"no ncu rows for this target in {args.from_raw}"
        else:
            t0 = time.perf_counter()
            try:
                measured, error = profiler.measure(target)
            except Exception as e:  # keep going: one target must not cost the whole run
                measured, error = {}, f"{type(e).__name__}: {e}"
            ran = bool(measured)
            print(f"  ncu: {time.perf_counter() - t0:.1f} s", flush=True)
            if not measured:
                failures[target.name] = error
                print(f"  no measurements: {error}", flush=True)
        target_rows = build_rows(target, predicted, measured, ran)
        _print_table(target_rows)
        rows += target_rows
        dropped = profiler.dropped if profiler else kept_dropped
        if profiler is not None:
            header["ncu runs"] = f"{profiler.runs} runs, {profiler.seconds:.0f} s of ncu wall time"
            (raw_dir / "run.json").write_text(json.dumps({"header": header, "dropped": dropped}, indent=1))
        # write after every target: a run cut short keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown(rows, header, dropped, failures) if args.section is None
                       else markdown_section(rows, header, dropped, failures, args.section))
        if not args.dry_run:  # (a dry run must not overwrite the rows of a measuring run)
            with open(raw_dir / "rows.json", "w") as f:
                json.dump([r.__dict__ | {"error": r.error, "verdict": r.verdict} for r in rows], f, indent=1, default=str)
    met = [r for r in rows if r.verdict in ("yes", "NO")]
    print(f"wrote {out} ({len(rows)} rows; targets met {sum(r.verdict == 'yes' for r in met)} of {len(met)})"
          + ("" if args.dry_run else f" and {raw_dir / 'rows.json'}") + f"; {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
