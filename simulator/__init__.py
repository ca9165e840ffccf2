"""cuflash IO analyzer (installed as cuflash.simulator): HBM/SRAM traffic, FLOPs and shared-memory bank
conflicts of attention tiling strategies, counted from the same configuration code as the kernels.

    from cuflash.simulator import Problem, simulate
    c = simulate("cuflash", Problem(batch=1, heads=16, seqlen_q=4096, seqlen_k=4096, head_dim=128))
    c.hbm_read_bytes, c.sram_read_bytes, c.bank_conflicts

    from cuflash.simulator import visible_pairs        # useful work of a causal / sliding-window mask
    visible_pairs(4096, 4096, causal=True, window=(1024, 0))

Modules: masks (the band of visible pairs and the kernels' tile tests), schedules (kernel configs, block
sizes and the blocks each loop visits, which every model below reads), banks (bank-conflict rule and the
walks of fwd_kernel, bwd_kernel, bwd_dq_kernel and the wgmma kernels fwd_sm90_kernel, fwd_sm90_ws_kernel,
bwd_sm90_kernel, bwd_sm90_ws_kernel), l2
(LRU L2 model), strategies (counts; `simulate` adds the walks and the L2 model), execute (the tile
schedules run in float64), cli (`cuflash-sim`), validate (ncu on the H100). Imports run one way:
strategies imports banks and l2, and all three import schedules. `cuflash` counts what the library
launches on an H100 (`kernels="auto"`, the wgmma kernels where the head dim has one);
`simulate(..., kernels="mma")` counts the mma.sync kernels; `Problem(..., dtype="fp8")` the FP8 (e4m3) forward
fwd_sm90_fp8_kernel (cuflash only, no backward).
"""
from .masks import key_tile_range, query_block_range, tile_needs_mask, visible_pairs
from .model import COUNT_FIELDS, STRATEGIES, Counts, Problem
from .strategies import simulate
from . import banks
from .execute import execute_backward, execute_forward

__all__ = ["Problem", "Counts", "COUNT_FIELDS", "STRATEGIES", "simulate", "banks", "execute_forward",
           "execute_backward", "visible_pairs", "key_tile_range", "query_block_range", "tile_needs_mask"]
