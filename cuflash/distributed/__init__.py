"""Context parallelism: one attention over a sequence sharded across GPUs (ring attention over NCCL).

    # python -m cuflash.distributed.launch --nproc-per-node 2 train.py      (one process per GPU)
    import cuflash.distributed as cfd
    group = cfd.init_process_group()                       # rank, world size, GPU from the launcher's environment
    q = cfd.shard_sequence(q_full, group.rank, group.world_size)   # or build the local shard directly
    o, lse = cfd.ring_attention_forward(q, k, v, group, causal=True)
    dq, dk, dv = cfd.ring_attention_backward(do, q, k, v, o, lse, group, causal=True)

Each rank keeps its queries; the K/V blocks travel around the ring (rank r -> r + 1) on a stream of their own
while the kernels run, and the partial outputs merge through their lse. In the backward the blocks travel again
with their dK/dV sums, which end at the block's home rank. The default `sharding="zigzag"` gives every rank two
chunks of the sequence (chunk r and chunk 2P-1-r of 2P), so that causal attention costs every rank the same.
`simulate_ring_attention_forward/backward` run the same algorithm for P ranks in one process (on one GPU with
CuPy arrays, or with float64 reference math on NumPy arrays) for tests and for counting the traffic.
"""
from __future__ import annotations

import numpy as np

from . import _ring, _sharding
from ._group import LaunchEnv, NcclTransport, ProcessGroup, init_process_group, launch_env
from ._sharding import SHARDINGS, rank_positions, shard_sequence, unshard_sequence

__all__ = ["ProcessGroup", "init_process_group", "launch_env", "LaunchEnv", "ring_attention",
           "ring_attention_forward", "ring_attention_backward", "simulate_ring_attention_forward",
           "simulate_ring_attention_backward", "shard_sequence", "unshard_sequence", "rank_positions", "SHARDINGS"]

LAYOUTS = ("bshd", "bhsd")


def ring_attention_forward(q, k, v, group: ProcessGroup, *, causal=False, softmax_scale=None, layout="bshd",
                           sharding="zigzag", softcap=None, precision=None):
    """Attention of this rank's queries over the whole sharded sequence.

    Args:
        q, k, v: this rank's shards (`shard_sequence` of the global arrays, or built in place), CuPy arrays on the
            group's device in `layout` ("bshd": (batch, seqlen_local, heads, head_dim); "bhsd"), every rank with
            the same shapes; k and v may have fewer heads than q (GQA). dtypes as `cuflash.attention_forward`.
        group: the ProcessGroup of `init_process_group`.
        causal: the causal mask of the global sequence (every shard's positions from `sharding`).
        softmax_scale, softcap, precision: as `cuflash.attention_forward` (the default scale 1/sqrt(head_dim)).
        sharding: "zigzag" (default; balanced causal work) or "contiguous" (rank r holds the r-th 1/P).

    Returns:
        (o, lse): o shaped like q in its dtype; lse (batch, heads, seqlen_local) float32 (float64 for float64),
        both this rank's rows of the unsharded call's outputs.

    Window, ALiBi, dropout, bias and masks are not supported across shards (they depend on global positions);
    varlen batches neither. Communication per step: this rank's K and V shards, sent on while the kernels run.
    """
    opt, ops = _setup(q, k, v, causal, softmax_scale, layout, sharding, softcap, precision, False, group.world_size)
    _check_same_shapes(group, q, k, v)
    gen = _ring.forward_rank(group.rank, group.world_size, q, k, v, ops, opt)
    return _ring.run(gen, NcclTransport(group))


def ring_attention(q, k, v, group: ProcessGroup, **kwargs):
    """`ring_attention_forward`'s output alone."""
    return ring_attention_forward(q, k, v, group, **kwargs)[0]


def ring_attention_backward(dout, q, k, v, out, lse, group: ProcessGroup, *, causal=False, softmax_scale=None,
                            layout="bshd", sharding="zigzag", softcap=None, precision=None, deterministic=False):
    """Gradients of `ring_attention_forward` for this rank's shards: (dq, dk, dv) shaped like q, k, v.

    dout, out, lse: this rank's rows (out and lse as ring_attention_forward returned them); the other arguments as
    given to the forward. deterministic=True makes every kernel bitwise reproducible and the ring adds in a fixed
    order, so the gradients are too. Communication per step: K and V, and the float32 dK/dV sums of the block
    (float64 for float64 inputs)."""
    opt, ops = _setup(q, k, v, causal, softmax_scale, layout, sharding, softcap, precision, deterministic,
                      group.world_size, backward=(dout, out, lse))
    _check_same_shapes(group, q, k, v)
    gen = _ring.backward_rank(group.rank, group.world_size, dout, q, k, v, out, lse, ops, opt)
    return _ring.run(gen, NcclTransport(group))


def simulate_ring_attention_forward(q, k, v, world_size: int, *, causal=False, softmax_scale=None, layout="bshd",
                                    sharding="zigzag", softcap=None, precision=None, trace=None):
    """The ring forward of `world_size` ranks run in one process on the global (unsharded) q, k, v; returns the
    global (o, lse), equal to what the ranks' outputs unshard to.

    CuPy inputs run the kernels on the current GPU; NumPy inputs run float64 reference math (cuflash.reference).
    trace: a list that receives the bytes each rank sends at each exchange."""
    opt, ops, shards = _simulation(q, k, v, world_size, causal, softmax_scale, layout, sharding, softcap, precision,
                                   False)
    gens = [_ring.forward_rank(r, world_size, *shards[r][:3], ops, opt) for r in range(world_size)]
    results = _ring.run_local(gens, _copier(q), trace)
    return (unshard_sequence([o for o, _ in results], axis=opt.seq_axis, sharding=sharding),
            unshard_sequence([lse for _, lse in results], axis=2, sharding=sharding))


def simulate_ring_attention_backward(dout, q, k, v, out, lse, world_size: int, *, causal=False, softmax_scale=None,
                                     layout="bshd", sharding="zigzag", softcap=None, precision=None,
                                     deterministic=False, trace=None):
    """The ring backward of `world_size` ranks in one process on global arrays (out, lse: the global forward's);
    returns the global (dq, dk, dv). Inputs and trace as `simulate_ring_attention_forward`."""
    opt, ops, shards = _simulation(q, k, v, world_size, causal, softmax_scale, layout, sharding, softcap, precision,
                                   deterministic, backward=(dout, out, lse))
    gens = [_ring.backward_rank(r, world_size, s[3], s[0], s[1], s[2], s[4], s[5], ops, opt)
            for r, s in enumerate(shards)]
    results = _ring.run_local(gens, _copier(q), trace)
    return tuple(unshard_sequence([g[i] for g in results], axis=opt.seq_axis, sharding=sharding) for i in range(3))


# --- validation, before any launch or transfer -------------------------------------------------------------------

def _is_cupy(x) -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return isinstance(x, cupy.ndarray)


def _setup(q, k, v, causal, softmax_scale, layout, sharding, softcap, precision, deterministic, world_size,
           backward=None):
    """(RingOptions, CupyOps) of a rank's call, after checking what the kernels' validation does not see."""
    from .. import _problem

    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; supported: 'bshd', 'bhsd'")
    _sharding.check_sharding(sharding)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    a = _problem.attention(q, k, v, causal, softmax_scale, layout, None, None, softcap, 0.0, None, 0, None, None,
                           None, precision)
    if a.seqlen_q != a.seqlen_k:
        raise ValueError(f"q has {a.seqlen_q} local positions and k {a.seqlen_k}: the shards of one sequence must "
                         f"have the same length")
    if sharding == "zigzag" and a.seqlen_q % 2:
        raise ValueError(f"seqlen_local={a.seqlen_q} must be even for sharding='zigzag' (two chunks per rank)")
    if backward is not None:
        _problem.backward(a, backward[0], backward[1], backward[2], deterministic, None, None, None)
    opt = _ring.RingOptions(bool(causal), sharding, layout)
    return opt, _ring.CupyOps(layout, a.scale, softcap, precision, bool(deterministic), a.dtype, q.dtype)


def _check_same_shapes(group: ProcessGroup, q, k, v) -> None:
    """Every rank must pass shards of the same shapes (NCCL sizes its transfers by them): one small all-gather."""
    import cupy as cp

    mine = np.array([*q.shape, *k.shape, *v.shape], dtype=np.int64)
    every = cp.asnumpy(group.all_gather(cp.asarray(mine)))
    if (every != mine).any():
        rows = "; ".join(f"rank {r}: q {tuple(s[:4])} k {tuple(s[4:8])} v {tuple(s[8:])}" for r, s in enumerate(every))
        raise ValueError(f"the ranks' shards differ in shape ({rows}): every rank needs the same local shapes")


def _simulation(q, k, v, world_size, causal, softmax_scale, layout, sharding, softcap, precision, deterministic,
                backward=None):
    """(RingOptions, ops, per-rank shards (q, k, v[, dout, out, lse])) of a simulated ring on global arrays."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; supported: 'bshd', 'bhsd'")
    _sharding.check_sharding(sharding)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    ax = 1 if layout == "bshd" else 2
    arrays = (q, k, v) + (tuple(backward) if backward is not None else ())
    if not all(_is_cupy(x) for x in arrays) and not all(isinstance(x, np.ndarray) for x in arrays):
        raise TypeError("pass CuPy arrays (the kernels) or NumPy arrays (float64 reference math), not a mix")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} has shape {getattr(x, 'shape', None)}; expected 4 dims ({layout})")
    if q.shape[ax] != k.shape[ax]:
        raise ValueError(f"q has {q.shape[ax]} positions and k {k.shape[ax]}: ring attention shards one sequence "
                         f"(self-attention), so they must be equal")
    _sharding.local_length(q.shape[ax], world_size, sharding)
    if _is_cupy(q):  # the kernels' checks on the global arrays: every shard has the same dtype, heads, head dim
        _, ops = _setup(q, k, v, causal, softmax_scale, layout, sharding, softcap, precision, deterministic,
                        world_size, backward)
    else:
        scale = 1.0 / np.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        ops = _ring.NumpyOps(layout, scale, softcap)
    seq = [ax] * len(arrays)
    if backward is not None:
        seq[-1] = 2  # lse: (batch, heads, seqlen)
    shards = [tuple(shard_sequence(x, r, world_size, axis=a, sharding=sharding) for x, a in zip(arrays, seq))
              for r in range(world_size)]
    return _ring.RingOptions(bool(causal), sharding, layout), ops, shards


def _copier(x):
    if _is_cupy(x):
        from ._group import copy_bits
        return copy_bits
    return lambda a: np.array(a, copy=True)
