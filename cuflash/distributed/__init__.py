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
Packed variable-length batches (`ring_attention_varlen_*`) shard every sequence that way.
`simulate_ring_attention_*` run the same algorithm for P ranks in one process (on one GPU with CuPy arrays, or
with float64 reference math on NumPy arrays) for tests and for counting the traffic.
"""
from __future__ import annotations

import numpy as np

from . import _ring, _sharding
from ._group import LaunchEnv, NcclTransport, ProcessGroup, init_process_group, launch_env
from ._sharding import SHARDINGS, rank_positions, shard_packed, shard_sequence, unshard_packed, unshard_sequence

__all__ = ["ProcessGroup", "init_process_group", "launch_env", "LaunchEnv", "ring_attention",
           "ring_attention_forward", "ring_attention_backward", "ring_attention_varlen_forward",
           "ring_attention_varlen_backward", "simulate_ring_attention_forward", "simulate_ring_attention_backward",
           "simulate_ring_attention_varlen_forward", "simulate_ring_attention_varlen_backward", "shard_sequence",
           "unshard_sequence", "shard_packed", "unshard_packed", "rank_positions", "SHARDINGS"]

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

    Window, ALiBi, dropout, bias and masks are not supported across shards (they depend on global positions).
    Communication per step: this rank's K and V shards, sent on while the kernels run.
    """
    opt, ops = _agreed_setup(group, (q, k, v), lambda: _setup(q, k, v, causal, softmax_scale, layout, sharding, softcap,
                                                             precision, False, group.world_size))
    return _ring.run(_ring.forward_rank(group.rank, group.world_size, q, k, v, ops, opt), NcclTransport(group))


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
    opt, ops = _agreed_setup(group, (q, k, v), lambda: _setup(q, k, v, causal, softmax_scale, layout, sharding, softcap,
                                                             precision, deterministic, group.world_size,
                                                             backward=(dout, out, lse)))
    gen = _ring.backward_rank(group.rank, group.world_size, dout, q, k, v, out, lse, ops, opt)
    return _ring.run(gen, NcclTransport(group))


def ring_attention_varlen_forward(q, k, v, cu_seqlens, group: ProcessGroup, *, causal=False, softmax_scale=None,
                                  sharding="zigzag", softcap=None, precision=None):
    """Ring attention of a packed batch of sequences, every sequence sharded over the ranks.

    q: (total_local, heads, head_dim), k, v: (total_local, heads_kv, head_dim): this rank's part of every sequence,
    packed in the same order on every rank (`shard_packed` of the global batch); cu_seqlens: the local cumulative
    lengths (int32 CuPy array or a host sequence; the same on every rank: sequence i's global length / P, each a
    multiple of 2 for zigzag). Returns (o, lse (heads, total_local)), this rank's rows of
    `cuflash.attention_varlen_forward` on the global batch. Other arguments as `ring_attention_forward`."""
    opt, ops = _agreed_setup(group, (q, k, v), lambda: _setup(q, k, v, causal, softmax_scale, "packed", sharding, softcap,
                                                             precision, False, group.world_size, cu_seqlens=cu_seqlens))
    return _ring.run(_ring.forward_rank(group.rank, group.world_size, q, k, v, ops, opt), NcclTransport(group))


def ring_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, group: ProcessGroup, *, causal=False,
                                   softmax_scale=None, sharding="zigzag", softcap=None, precision=None,
                                   deterministic=False):
    """Gradients of `ring_attention_varlen_forward` for this rank's rows: (dq, dk, dv) packed like q, k, v."""
    opt, ops = _agreed_setup(group, (q, k, v), lambda: _setup(q, k, v, causal, softmax_scale, "packed", sharding, softcap,
                                                             precision, deterministic, group.world_size,
                                                             backward=(dout, out, lse), cu_seqlens=cu_seqlens))
    gen = _ring.backward_rank(group.rank, group.world_size, dout, q, k, v, out, lse, ops, opt)
    return _ring.run(gen, NcclTransport(group))


def simulate_ring_attention_forward(q, k, v, world_size: int, *, causal=False, softmax_scale=None, layout="bshd",
                                    sharding="zigzag", softcap=None, precision=None, trace=None):
    """The ring forward of `world_size` ranks run in one process on the global (unsharded) q, k, v; returns the
    global (o, lse), equal to what the ranks' outputs unshard to.

    CuPy inputs run the kernels on the current GPU; NumPy inputs run float64 reference math (cuflash.reference).
    trace: a list that receives the bytes each rank sends at each exchange."""
    opt, ops, shards = _simulation((q, k, v), world_size, causal, softmax_scale, layout, sharding, softcap,
                                   precision, False)
    results = _ring.run_local([_ring.forward_rank(r, world_size, *shards[r], ops, opt) for r in range(world_size)],
                              _copier(q), trace)
    return _unshard(results, 0, opt, sharding, None), _unshard(results, 1, opt, sharding, None, lse=True)


def simulate_ring_attention_backward(dout, q, k, v, out, lse, world_size: int, *, causal=False, softmax_scale=None,
                                     layout="bshd", sharding="zigzag", softcap=None, precision=None,
                                     deterministic=False, trace=None):
    """The ring backward of `world_size` ranks in one process on global arrays (out, lse: the global forward's);
    returns the global (dq, dk, dv). Inputs and trace as `simulate_ring_attention_forward`."""
    opt, ops, shards = _simulation((dout, q, k, v, out, lse), world_size, causal, softmax_scale, layout, sharding,
                                   softcap, precision, deterministic)
    results = _ring.run_local([_ring.backward_rank(r, world_size, *shards[r], ops, opt) for r in range(world_size)],
                              _copier(q), trace)
    return tuple(_unshard(results, i, opt, sharding, None) for i in range(3))


def simulate_ring_attention_varlen_forward(q, k, v, cu_seqlens, world_size: int, *, causal=False, softmax_scale=None,
                                           sharding="zigzag", softcap=None, precision=None, trace=None):
    """`simulate_ring_attention_forward` for a global packed batch (q (total, heads, head_dim), cu_seqlens the global
    cumulative lengths, each sequence a multiple of 2 * world_size long for zigzag); returns the global (o, lse)."""
    opt, ops, shards = _simulation((q, k, v), world_size, causal, softmax_scale, "packed", sharding, softcap,
                                   precision, False, cu_seqlens)
    results = _ring.run_local([_ring.forward_rank(r, world_size, *shards[r], ops, opt) for r in range(world_size)],
                              _copier(q), trace)
    cu = _host_cu(cu_seqlens)
    return _unshard(results, 0, opt, sharding, cu), _unshard(results, 1, opt, sharding, cu, lse=True)


def simulate_ring_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, world_size: int, *, causal=False,
                                            softmax_scale=None, sharding="zigzag", softcap=None, precision=None,
                                            deterministic=False, trace=None):
    """`simulate_ring_attention_backward` for a global packed batch; returns the global (dq, dk, dv)."""
    opt, ops, shards = _simulation((dout, q, k, v, out, lse), world_size, causal, softmax_scale, "packed", sharding,
                                   softcap, precision, deterministic, cu_seqlens)
    results = _ring.run_local([_ring.backward_rank(r, world_size, *shards[r], ops, opt) for r in range(world_size)],
                              _copier(q), trace)
    cu = _host_cu(cu_seqlens)
    return tuple(_unshard(results, i, opt, sharding, cu) for i in range(3))


# --- validation, before any launch or transfer -------------------------------------------------------------------

def _is_cupy(x) -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return isinstance(x, cupy.ndarray)


def _host_cu(cu_seqlens) -> tuple:
    """Cumulative lengths as a tuple of ints (a CuPy array is read back: one synchronization)."""
    if _is_cupy(cu_seqlens):
        import cupy
        cu_seqlens = cupy.asnumpy(cu_seqlens)
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be a 1-D integer array of cumulative lengths starting at 0; got shape "
                         f"{cu.shape} and dtype {cu.dtype}")
    if cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError(f"cu_seqlens={cu.tolist()[:8]}{' ...' if cu.size > 8 else ''} must start at 0 and never "
                         f"decrease")
    return tuple(int(c) for c in cu)


def _check_world(world_size, sharding):
    _sharding.check_sharding(sharding)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")


def _setup(q, k, v, causal, softmax_scale, layout, sharding, softcap, precision, deterministic, world_size,
           backward=None, cu_seqlens=None, local_lengths=None):
    """(RingOptions, CupyOps) of a rank's call (or of a simulation, on the global arrays with local_lengths given),
    after the kernels' own checks (through _problem) and what they do not see."""
    from .. import _problem

    if layout not in LAYOUTS + ("packed",):
        raise ValueError(f"layout={layout!r} is not supported; supported: 'bshd', 'bhsd'")
    _check_world(world_size, sharding)
    if layout == "packed":
        import cupy as cp

        cu = _host_cu(cu_seqlens)
        lengths = np.diff(cu)
        longest = int(lengths.max()) if lengths.size else 0
        cu_dev = cp.asarray(np.array(cu, dtype=np.int32))
        a = _problem.attention_varlen(q, k, v, cu_dev, cu_dev, longest, longest, causal, softmax_scale, True, None,
                                      None, softcap, 0.0, None, 0, None, None, None, precision)
        if local_lengths is None:  # a rank's own call: its local lengths split in two halves each (zigzag)
            local_lengths = tuple(int(n) for n in lengths)
            odd = [i for i, n in enumerate(local_lengths) if n % 2]
            if sharding == "zigzag" and odd:
                raise ValueError(f"local sequence {odd[0]} has {local_lengths[odd[0]]} rows: sharding='zigzag' needs "
                                 f"an even local length for every sequence (two chunks per rank)")
    else:
        a = _problem.attention(q, k, v, causal, softmax_scale, layout, None, None, softcap, 0.0, None, 0, None, None,
                               None, precision)
        if a.seqlen_q != a.seqlen_k:
            raise ValueError(f"q has {a.seqlen_q} positions and k {a.seqlen_k}: ring attention shards one sequence "
                             f"(self-attention), so they must be equal")
        if sharding == "zigzag" and local_lengths is None and a.seqlen_q % 2:
            raise ValueError(f"seqlen_local={a.seqlen_q} must be even for sharding='zigzag' (two chunks per rank)")
    if backward is not None:
        _problem.backward(a, backward[0], backward[1], backward[2], deterministic, None, None, None)
    opt = _ring.RingOptions(bool(causal), sharding, layout, tuple(local_lengths or ()))
    return opt, _ring.CupyOps(opt, a.scale, softcap, precision, bool(deterministic), a.dtype, q.dtype)


_SIGNATURE_LEN = 16  # rejected flag, q, k, v shapes (4 dims each, -1 padded), sequence count, lengths hash


def _signature(failed: bool, arrays, local_lengths) -> list[int]:
    dims = []
    for x in arrays:
        shape = tuple(getattr(x, "shape", ()))[:4]
        dims += list(shape) + [-1] * (4 - len(shape))
    return [int(failed)] + dims + [len(local_lengths), hash(tuple(local_lengths)) % (1 << 62)]


def _agreed_setup(group, arrays, setup):
    """Every rank validates its own inputs (setup()), then the ranks compare notes in one small all-gather: the
    verdict and their shard shapes and sequence lengths (NCCL sizes its transfers by them, and every rank walks the
    same plans). Any rank's bad input makes every rank raise, before any attention kernel or transfer: a rank that
    raised alone would leave the others waiting for it in NCCL."""
    try:
        result, error = setup(), None
    except (TypeError, ValueError) as e:
        result, error = None, e
    lengths = result[0].local_lengths if result is not None else ()
    every = group.all_gather_host(_signature(error is not None, arrays, lengths))
    if error is not None:
        raise error
    rejected = [r for r, sig in enumerate(every) if sig[0]]
    if rejected:
        raise ValueError(f"rank{'s' if len(rejected) > 1 else ''} {', '.join(map(str, rejected))} of "
                         f"{group.world_size} rejected {'their' if len(rejected) > 1 else 'its'} inputs (see "
                         f"{'their' if len(rejected) > 1 else 'its'} error); this rank's were valid")
    mine = every[group.rank]
    if (every != mine).any():
        def shapes(sig):
            return " ".join(f"{n} {tuple(int(d) for d in sig[1 + 4 * i:5 + 4 * i] if d >= 0)}"
                            for i, n in enumerate("qkv"))
        rows = "; ".join(f"rank {r}: {shapes(sig)}{' (other sequence lengths)' if sig[-1] != mine[-1] else ''}"
                         for r, sig in enumerate(every))
        raise ValueError(f"the ranks' shards differ ({rows}): every rank needs the same local shapes and lengths")
    return result


def _simulation(arrays, world_size, causal, softmax_scale, layout, sharding, softcap, precision, deterministic,
                cu_seqlens=None):
    """(RingOptions, ops, per-rank shards of `arrays`) of a simulated ring on global arrays: (q, k, v) or (dout, q,
    k, v, out, lse)."""
    if layout not in LAYOUTS + ("packed",):
        raise ValueError(f"layout={layout!r} is not supported; supported: 'bshd', 'bhsd'")
    _check_world(world_size, sharding)
    backward = len(arrays) == 6
    q, k, v = arrays[1:4] if backward else arrays
    if not all(_is_cupy(x) for x in arrays) and not all(isinstance(x, np.ndarray) for x in arrays):
        raise TypeError("pass CuPy arrays (the kernels) or NumPy arrays (float64 reference math), not a mix")
    ndim = 3 if layout == "packed" else 4
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != ndim:
            raise ValueError(f"{name} has shape {getattr(x, 'shape', None)}; expected {ndim} dims ({layout})")
    ax = {"bshd": 1, "bhsd": 2, "packed": 0}[layout]
    if q.shape[ax] != k.shape[ax]:
        raise ValueError(f"q has {q.shape[ax]} positions and k {k.shape[ax]}: ring attention shards one sequence "
                         f"(self-attention), so they must be equal")
    if layout == "packed":
        cu = _host_cu(cu_seqlens)
        if cu[-1] != q.shape[0]:
            raise ValueError(f"cu_seqlens ends at {cu[-1]} but q has {q.shape[0]} rows")
        local = _sharding.packed_local_lengths(np.diff(cu), world_size, sharding)
    else:
        _sharding.local_length(q.shape[ax], world_size, sharding)
        cu, local = None, None
    lse_ax = 1 if layout == "packed" else 2
    if _is_cupy(q):  # the kernels' checks on the global arrays: every shard has the same dtype, heads, head dim
        opt, ops = _setup(q, k, v, causal, softmax_scale, layout, sharding, softcap, precision, deterministic,
                          world_size, (arrays[0], arrays[4], arrays[5]) if backward else None, cu, local)
    else:
        opt = _ring.RingOptions(bool(causal), sharding, layout, tuple(local or ()))
        scale = 1.0 / np.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        ops = _ring.NumpyOps(opt, scale, softcap)
    axes = [ax] * len(arrays)
    if backward:
        axes[-1] = lse_ax
    if layout == "packed":
        shards = [tuple(shard_packed(x, cu, r, world_size, sharding=sharding, axis=a)[0] for x, a in zip(arrays, axes))
                  for r in range(world_size)]
    else:
        shards = [tuple(shard_sequence(x, r, world_size, axis=a, sharding=sharding) for x, a in zip(arrays, axes))
                  for r in range(world_size)]
    return opt, ops, shards


def _unshard(results, i, opt, sharding, cu, lse=False):
    """The global array of output i of every rank's results."""
    axis = opt.lse_axis if lse else opt.seq_axis
    parts = [r[i] for r in results]
    if opt.layout == "packed":
        return unshard_packed(parts, cu, sharding=sharding, axis=axis)
    return unshard_sequence(parts, axis=axis, sharding=sharding)


def _copier(x):
    if _is_cupy(x):
        from ._group import copy_bits
        return copy_bits
    return lambda a: np.array(a, copy=True)
