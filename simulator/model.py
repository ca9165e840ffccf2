"""The problem a strategy runs on, the counts it produces, and the conventions behind the counts.

Every count is in bytes or FLOPs for the whole problem (all batches and heads). The conventions, so
that a reader can recompute any number by hand:

* Global (HBM) traffic counts the bytes an algorithm moves between HBM and the chip, each access as
  written in the algorithm (an element read twice is counted twice). Tensors Q, K, V, O, dO, dQ, dK,
  dV and the materialised S, P, dP, dS are `elem_bytes` wide (DTYPE_BYTES: 2 for fp16/bf16, 4 for
  fp32/tf32, 8 for fp64, 1 for fp8), except O, which is `out_bytes` wide (OUT_BYTES: 2 for fp8, whose
  forward writes bf16; elem_bytes otherwise); softmax statistics (l, m, lse, D) and the FA2/cuflash dQ
  accumulator are `stat_bytes` wide: fp32 (4 bytes) for the 1-, 2- and 4-byte dtypes, fp64 (8 bytes) for
  fp64, as cuflash's float64 kernels keep lse, lse_log2, delta and dQ_acc in float64 (every strategy counts
  them so).
  cuflash's dQ atomics (red.global.add) count as a read and a write of their bytes (the accumulator's
  read-modify-write in the L2, like FA2's dQ update).
* Shared memory (SRAM) traffic is exact for `cuflash`, forward and backward (every shared instruction
  of the kernels, see banks.fwd_kernel_shared, bwd_kernel_shared, dq_kernel_shared; for the wgmma
  kernels also the tensor core's operand reads, counted once per warpgroup instruction, and for the FP8
  forward its V transpose, banks.fwd_sm90_fp8_kernel_shared). For the paper
  strategies it follows the paper's model: each tile loaded from HBM is written to SRAM once, each
  on-chip matmul reads both operand tiles from SRAM once, FA1 keeps S and P in SRAM while FA2 keeps
  them in registers; `standard` stages each HBM byte once.
* Matmul FLOPs are 2*m*n*k per product over the tiles an algorithm actually computes (the padded
  tiles for `cuflash`, whose kernels compute whole tiles, duplicated and recomputed products
  included); `flops_useful` counts only the (query, key) pairs that the mask keeps (causal and/or
  sliding window: masks.visible_pairs), 4*d per pair forward and 10*d backward.
* Non-matmul FLOPs use the fixed per-element costs in NONMATMUL_FLOPS (an exp counts as one FLOP).
* fp8 (cuflash's FP8 forward only): Q, K, V 1 byte, O 2 (bf16), lse 4; the float32 descale factors of q, k
  and v (DESCALE_BYTES each) count as global reads: q's once per CTA, k's and v's once per visited key tile
  (strategies._cuflash_fp8_fwd).
"""
from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields

from .masks import check_window

# "tf32": float32 elements (cuflash's one-pass TF32 arithmetic); "fp32": float32 (3xTF32 in cuflash's kernels);
# "fp8": e4m3 Q, K, V (cuflash's FP8 forward, fwd_sm90_fp8_kernel; no backward)
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4, "fp64": 8, "fp8": 1}
OUT_BYTES = {"fp8": 2}  # O where it is wider than the inputs: the FP8 forward writes bf16 (Problem.out_bytes)
FP8_DTYPES = ("fp8",)
FP8_STRATEGIES = ("cuflash",)  # the paper's algorithms are 16/32/64-bit: fp8 is counted for cuflash's kernel only
DESCALE_BYTES = 4  # one float32 descale factor of q, k or v (the FP8 forward)
QUANT_BLOCK_ROWS = 128  # rows per block descale factor (cuda/fwd_sm90_fp8.cuh QUANT_BLOCK_ROWS, cuflash.fp8)
STAT_BYTES = 4  # l, m, lse, D and the dQ accumulator are fp32 ...
WIDE_STAT_BYTES = {"fp64": 8}  # ... except for fp64, whose statistics and accumulator are fp64 (Problem.stat_bytes)
STRATEGIES = ("standard", "fa1", "fa2", "cuflash")

# H100 SXM (measured, docs/PERFORMANCE.md): used by the runtime model and as L2 / SRAM defaults.
H100_SMS = 132
H100_L2_BYTES = 50 * 1024 * 1024
H100_SMEM_PER_SM = 228 * 1024
H100_SMEM_PER_BLOCK = 227 * 1024  # the largest dynamic shared memory one CTA may request
H100_HBM_BYTES_PER_S = 3.0e12  # measured device-to-device copy
H100_TENSOR_FLOPS = 767e12  # measured bf16 8192^3 matmul

# FA1's on-chip memory M when neither blocks nor an SRAM size are given: one CTA's shared memory.
DEFAULT_SRAM_BYTES = H100_SMEM_PER_BLOCK
# FA2's blocks when none are given (the FlashAttention-2 paper's usual 128 x 128 tile).
DEFAULT_FA2_BLOCKS = (128, 128)

# Non-matmul FLOPs per element, one place for the whole analyzer.
NONMATMUL_FLOPS = {
    # standard forward, per element of S: scale, row max, subtract, exp, row sum, divide
    "standard_fwd_per_score": 6,
    # standard backward, per element of S: D = rowsum(P * dP) (2), dS = P * (dP - D) (2)
    "standard_bwd_per_score": 4,
    # flash forward, per element of a computed S tile: scale, row max, subtract, exp, row sum
    "flash_fwd_per_score": 5,
    # flash forward, per row of a computed tile: m_new, exp(m - m_new), l update (3) + rescale O (d)
    "flash_fwd_per_row_tile": 3,
    # flash backward, per element of a computed tile: recompute P (scale, subtract, exp) and
    # dS = P * (dP - D) (2), scale dS (1)
    "flash_bwd_per_score": 6,
}


@dataclass(frozen=True)
class Problem:
    """One attention call: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k, heads, head_dim).

    causal: bottom-right causal mask. window: None, or a sliding window (left, right), -1 = unbounded
    (query i sees key j iff i + diag - left <= j <= i + diag + right, diag = seqlen_k - seqlen_q); with
    causal the band is the intersection (masks.band_sides). The window selects no tiles: cuflash's
    kernels run the tiles of the causal flag."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str = "fp16"
    causal: bool = False
    window: tuple[int, int] | None = None

    def __post_init__(self):
        for name in ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
            object.__setattr__(self, name, int(value))  # NumPy integers become Python ints
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; supported: {', '.join(DTYPE_BYTES)}")
        object.__setattr__(self, "window", check_window(self.window))  # a list or NumPy pair becomes a tuple

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def out_bytes(self) -> int:
        """Bytes of an O element: bf16 (2) for fp8, elem_bytes otherwise."""
        return OUT_BYTES.get(self.dtype, self.elem_bytes)

    @property
    def stat_bytes(self) -> int:
        """Bytes of a softmax statistic (l, m, lse, D) and of a dQ-accumulator element."""
        return WIDE_STAT_BYTES.get(self.dtype, STAT_BYTES)

    @property
    def batch_heads(self) -> int:
        return self.batch * self.heads


@dataclass
class Counts:
    """What one strategy moves and computes for one Problem (forward or backward)."""

    strategy: str
    backward: bool
    block_m: int | None
    block_n: int | None
    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    sram_read_bytes: int | None = 0  # None: not modelled
    sram_write_bytes: int | None = 0
    flops_matmul: int = 0
    flops_nonmatmul: int = 0
    flops_useful: int = 0
    launches: int = 0
    peak_extra_bytes: int = 0  # device memory beyond inputs and outputs, alive at one time
    bank_conflicts: int | None = None  # shared-memory bank conflicts (cuflash's fp16/bf16 kernels only)
    dram_read_bytes: int | None = None  # with an L2 model
    dram_write_bytes: int | None = None

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_read_bytes + self.hbm_write_bytes

    @property
    def flops(self) -> int:
        return self.flops_matmul + self.flops_nonmatmul

    @property
    def dram_bytes(self) -> int | None:
        if self.dram_read_bytes is None:
            return None
        return self.dram_read_bytes + self.dram_write_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(hbm_bytes=self.hbm_bytes, flops=self.flops, dram_bytes=self.dram_bytes)
        return d


COUNT_FIELDS = tuple(f.name for f in fields(Counts))
